"""Materialized attention in float64: the specification and the ground truth of every test.

Everything here is written as plainly as possible; speed does not matter. Layout follows the
public API: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``.

Semantics
---------
* scores ``s[i, j] = softmax_scale * <q_i, k_j>`` with ``softmax_scale = 1/sqrt(D)`` by default.
* GQA / MQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
* causal masks are aligned bottom-right: query ``i`` sees key ``j`` iff
  ``j <= i + Sk - Sq``. For ``Sq = 2, Sk = 5`` (1 = visible)::

      keys ->   0 1 2 3 4
      query 0   1 1 1 1 0
      query 1   1 1 1 1 1

  and for ``Sq = 5, Sk = 2`` the first three queries see nothing::

      keys ->   0 1
      query 0   0 0
      query 1   0 0
      query 2   0 0
      query 3   1 0
      query 4   1 1

* a query row that sees no key has output 0 and log-sum-exp ``-inf`` (never NaN).
* ``lse [B, Hq, Sq]`` is the natural-log log-sum-exp of the scaled, masked scores.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention", "causal_mask", "expand_kv_heads"]


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask ``[Sq, Sk]`` (True = query may attend to key)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Repeat KV heads ``[B, S, Hkv, D]`` -> ``[B, S, Hq, D]`` so query head h reads h // group."""
    group = num_q_heads // x.shape[2]
    return x.repeat_interleave(group, dim=2)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention.

    Args:
        q: ``[B, Sq, Hq, D]``.
        k, v: ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0``.
        causal: bottom-right aligned causal mask (see module docstring).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        upcast: True computes everything in float64 (the ground truth). False computes the way
            PyTorch's plain math path does in the input dtype: matmuls in the input dtype,
            softmax in float32, probabilities rounded back to the input dtype before P @ V.
            Tests use it to measure how far PyTorch itself lands from the truth.

    Returns:
        ``out [B, Sq, Hq, D]`` (float64 if upcast, else the input dtype) and
        ``lse [B, Hq, Sq]`` (float64 if upcast, else float32).
    """
    dtype = torch.float64 if upcast else q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    num_q_heads = q.shape[2]
    qh = q.to(dtype).transpose(1, 2)  # [B, Hq, Sq, D]
    kh = expand_kv_heads(k.to(dtype), num_q_heads).transpose(1, 2)  # [B, Hq, Sk, D]
    vh = expand_kv_heads(v.to(dtype), num_q_heads).transpose(1, 2)

    scores = torch.matmul(qh, kh.transpose(-1, -2))
    stats_dtype = torch.float64 if upcast else torch.float32
    scores = scores.to(stats_dtype) * scale
    if causal:
        visible = causal_mask(q.shape[1], k.shape[1], device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees nothing
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = torch.where(denom > 0, weights / denom.clamp_min(1e-300), torch.zeros_like(weights))
    out = torch.matmul(probs.to(dtype), vh)
    return out.transpose(1, 2), lse
