"""The public face of flashkernel: docstrings, validation and dispatch to the kernels.

This is the only module that turns user tensors into kernel launches. It validates (through
``_checks``), allocates outputs and calls the launchers in ``kernels/``.
"""

from __future__ import annotations

import torch

from . import _checks
from .kernels import naive, prefill
from .kernels._common import is_interpreted

__all__ = ["flash_attn_func", "standard_attention"]

MAX_NAIVE_ROWS = 65535  # grid-axis limit of the naive kernels' (batch * heads) axis


def kernels_interpreted() -> bool:
    """True when flashkernel's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return is_interpreted(prefill._attention_fwd_kernel)


def _validate_dense(q, k, v, causal, softmax_scale, return_lse) -> float:
    _checks.check_qkv(q, k, v, kernels_interpreted())
    _checks.check_flag("causal", causal)
    _checks.check_flag("return_lse", return_lse)
    return _checks.resolve_softmax_scale(softmax_scale, q.shape[-1])


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate an output. The one allocation point, so tests can poison outputs with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def _empty_results(q: torch.Tensor, want_lse: bool):
    """Outputs for calls that need no launch: batch or seqlen_q is 0, or there are no keys."""
    batch, seqlen_q, num_heads, _ = q.shape
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full((batch, num_heads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    return out, (lse if want_lse else None)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """Exact attention, fused in one kernel: ``softmax(scale * q k^T [+ mask]) v``.

    Args:
        q: ``[batch, seqlen_q, num_heads, head_dim]``.
        k: ``[batch, seqlen_k, num_kv_heads, head_dim]``.
        v: ``[batch, seqlen_k, num_kv_heads, head_dim]``.
            Any strides are accepted as long as the last dimension is contiguous (for example
            q, k, v as views of one packed ``[batch, seqlen, 3, heads, head_dim]`` tensor); no
            copy is made. dtype float16, bfloat16 or float32 (all three the same);
            ``head_dim`` any multiple of 8 from 8 to 256.
            GQA / MQA: ``num_heads`` must be a multiple of ``num_kv_heads``; query head ``h``
            reads key/value head ``h // (num_heads // num_kv_heads)``.
        causal: mask aligned to the bottom-right corner, as FlashAttention >= 2.1: query ``i``
            sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. With seqlen_q = 2,
            seqlen_k = 5 (1 = visible)::

                1 1 1 1 0
                1 1 1 1 1

            and with seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A query row that sees no key returns 0 (and LSE = -inf), never NaN.
        softmax_scale: scale applied to ``q k^T``; default ``1 / sqrt(head_dim)``.
        return_lse: also return the log-sum-exp of each row.

    Returns:
        ``out [batch, seqlen_q, num_heads, head_dim]`` in the input dtype (contiguous), and with
        ``return_lse=True`` also ``lse [batch, num_heads, seqlen_q]`` float32, natural log.
        Softmax statistics and accumulation are float32. Forward only (no autograd).

    Example::

        >>> q = torch.randn(2, 1024, 32, 128, device="cuda", dtype=torch.bfloat16)
        >>> k = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
        >>> v = torch.randn_like(k)
        >>> out = flash_attn_func(q, k, v, causal=True)        # [2, 1024, 32, 128]
    """
    scale = _validate_dense(q, k, v, causal, softmax_scale, return_lse)
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    if batch == 0 or seqlen_q == 0 or seqlen_k == 0:
        out, lse = _empty_results(q, return_lse)
    else:
        out = _empty((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
        lse = _empty((batch, num_heads, seqlen_q), torch.float32, q.device) if return_lse else None
        prefill.attention_forward(q, k, v, out, lse, causal=causal, softmax_scale=scale)
    return (out, lse) if return_lse else out


def standard_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """Textbook attention in three kernels (QK^T, softmax, PV) that materialize ``[B, H, Sq, Sk]``.

    Same arguments, semantics and results as :func:`flash_attn_func`; it exists as the baseline
    for benchmarks. Its memory grows as ``seqlen_q * seqlen_k`` (a float32 score matrix and a
    probability matrix in the input dtype), so it is for measurement, not for production.
    """
    scale = _validate_dense(q, k, v, causal, softmax_scale, return_lse)
    batch, seqlen_q, num_heads, _ = q.shape
    if batch * num_heads > MAX_NAIVE_ROWS:
        raise ValueError(
            f"standard_attention supports batch * heads <= {MAX_NAIVE_ROWS}, got "
            f"{batch} * {num_heads} = {batch * num_heads}; use flash_attn_func"
        )
    if batch == 0 or seqlen_q == 0 or k.shape[1] == 0:
        out, lse = _empty_results(q, return_lse)
    else:
        out = _empty(q.shape, q.dtype, q.device)
        lse = _empty((batch, num_heads, seqlen_q), torch.float32, q.device)
        naive.standard_attention(q, k, v, out, lse, causal=causal, softmax_scale=scale)
    return (out, lse) if return_lse else out
