"""Shared test helpers: random inputs, error bounds relative to PyTorch's own error."""

from __future__ import annotations

import pytest
import torch

from flashkernel import reference

ON_GPU = torch.cuda.is_available()


def _interpreter_works() -> bool:
    """Triton 3.6's CPU interpreter breaks with numpy >= 2.3 (the GPU machines have newer numpy)."""
    import numpy

    return tuple(int(x) for x in numpy.__version__.split(".")[:2]) < (2, 3)


INTERPRETER_WORKS = _interpreter_works()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER_WORKS, reason="Triton 3.6's interpreter needs numpy < 2.3 (pyproject pins it for CPU installs)")
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.float16, torch.bfloat16)


def random_qkv(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, dtype, device=DEVICE):
    """Fresh standard-normal q ``[B, Sq, Hq, D]``, k and v ``[B, Sk, Hkv, D]`` (never zeros)."""
    q = torch.randn(batch, seqlen_q, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, num_kv_heads, head_dim, dtype=dtype, device=device)
    return q, k, v


def describe_mismatch(err: torch.Tensor, bound: float) -> str:
    bad = err > bound
    where = bad.nonzero()[:5].tolist()
    return f"{int(bad.sum())} of {err.numel()} elements over {bound:.3e}; first at {where}"


def assert_output_close(out, q, k, v, *, causal=False, softmax_scale=None, lse=None, **variant):
    """Assert ``out`` (and ``lse``) match the float64 reference.

    ``variant`` holds the reference's variant keywords (``window_size``, ``softcap``,
    ``alibi_slopes``, ``sinks``). The bound is relative to PyTorch's own error in the input
    dtype: the max error may be at most 2x PyTorch's plus one unit of the dtype's epsilon times
    the largest output (the rounding of the output itself), and likewise for the mean error.
    """
    truth, truth_lse = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, **variant)
    torch_out, _ = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=False,
                                       **variant)
    assert_close_to_truth(out, lse, truth, truth_lse, torch_out, q.dtype)


def assert_varlen_close(out, q, k, v, cu_seqlens_q, cu_seqlens_k, *, lse=None, **kwargs):
    """:func:`assert_output_close` for packed sequences (``reference.attention_varlen``)."""
    truth, truth_lse = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)
    torch_out, _ = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, upcast=False, **kwargs)
    assert_close_to_truth(out, lse, truth, truth_lse, torch_out, q.dtype)


def assert_close_to_truth(out, lse, truth, truth_lse, torch_out, dtype):
    """The error bounds of :func:`assert_output_close`, given the reference results."""
    assert not torch.isnan(out).any(), f"NaN in output: {int(torch.isnan(out).sum())} elements"
    assert out.shape == truth.shape, f"output shape {tuple(out.shape)} != {tuple(truth.shape)}"
    err = (out.double() - truth).abs()
    torch_err = (torch_out.double() - truth).abs()
    floor = torch.finfo(dtype).eps * max(1.0, truth.abs().max().item() if truth.numel() else 0.0)
    if err.numel() == 0:
        return
    max_bound = 2 * torch_err.max().item() + floor
    assert err.max().item() <= max_bound, describe_mismatch(err, max_bound)
    mean_bound = 2 * torch_err.mean().item() + floor / 8
    assert err.mean().item() <= mean_bound, f"mean error {err.mean().item():.3e} > {mean_bound:.3e}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == truth_lse.shape
        assert torch.equal(torch.isneginf(lse), torch.isneginf(truth_lse)), "-inf LSE rows differ"
        assert not torch.isnan(lse).any()
        finite = torch.isfinite(truth_lse)
        lse_err = (lse.double() - truth_lse)[finite].abs()
        bound = 5e-5 * max(1.0, truth_lse[finite].abs().max().item()) if finite.any() else 0
        assert lse_err.numel() == 0 or lse_err.max().item() <= bound, f"LSE error {lse_err.max().item():.3e}"
