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

__all__ = [
    "append_to_cache",
    "attention",
    "attention_with_kvcache",
    "cache_prefix",
    "causal_mask",
    "expand_kv_heads",
]


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


# --- attention over a KV cache (decode) ------------------------------------------------------
#
# A cache is contiguous ``[B, S_max, Hkv, D]`` (token j of sequence b at ``cache[b, j]``) or
# paged ``[num_blocks, page_size, Hkv, D]`` with ``block_table [B, max_blocks]`` (token j of
# sequence b at ``cache[block_table[b, j // page_size], j % page_size]``).
#
# Decode with new tokens ``k, v [B, T, Hkv, D]`` first writes them at positions
# ``cache_seqlens[b] .. cache_seqlens[b] + T - 1``; then the queries ``q [B, T, Hq, D]`` of
# sequence b attend to its first ``L = cache_seqlens[b] + T`` tokens (``L = cache_seqlens[b]``
# without new tokens) exactly as ``attention(q[b], keys[:L], values[:L])`` would: the causal
# mask is the bottom-right aligned one above, so new token t sees keys ``j <= L - T + t``.


def _token_location(b: int, j: int, page_size: int | None, block_table):
    """Index of token j of sequence b in the cache's first two dimensions."""
    if block_table is None:
        return b, j
    return int(block_table[b, j // page_size]), j % page_size


def cache_prefix(cache: torch.Tensor, b: int, length: int, block_table=None) -> torch.Tensor:
    """The first ``length`` tokens of sequence ``b`` as a dense ``[length, Hkv, D]`` copy."""
    positions = torch.arange(length, device=cache.device)
    if block_table is None:
        return cache[b, positions]
    page_size = cache.shape[1]
    blocks = block_table[b].to(device=cache.device, dtype=torch.long)[positions // page_size]
    return cache[blocks, positions % page_size]


def append_to_cache(cache: torch.Tensor, new: torch.Tensor, cache_seqlens, block_table=None) -> torch.Tensor:
    """A copy of ``cache`` with ``new [B, T, Hkv, D]`` written at ``cache_seqlens[b] + t``."""
    result = cache.clone()
    page_size = cache.shape[1] if block_table is not None else None
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            result[_token_location(b, int(cache_seqlens[b]) + t, page_size, block_table)] = new[b, t]
    return result


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    block_table=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decode over a cache (see the section comment above); inputs are not modified.

    Returns ``out [B, T, Hq, D]`` and ``lse [B, Hq, T]`` with the dtypes of :func:`attention`.
    A sequence with no keys gets output 0 and lse -inf.
    """
    if k is not None:
        k_cache = append_to_cache(k_cache, k, cache_seqlens, block_table)
        v_cache = append_to_cache(v_cache, v, cache_seqlens, block_table)
    added = q.shape[1] if k is not None else 0
    outs, lses = [], []
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b]) + added
        keys = cache_prefix(k_cache, b, length, block_table)[None]
        values = cache_prefix(v_cache, b, length, block_table)[None]
        if length == 0:
            dtype = torch.float64 if upcast else q.dtype
            outs.append(torch.zeros(q[b:b + 1].shape, dtype=dtype, device=q.device))
            lses.append(torch.full((1, q.shape[2], q.shape[1]), float("-inf"),
                                   dtype=torch.float64 if upcast else torch.float32, device=q.device))
            continue
        out, lse = attention(q[b:b + 1], keys, values, causal=causal,
                             softmax_scale=softmax_scale, upcast=upcast)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
