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

Variants (any combination; each is off by default)
--------------------------------------------------
Row ``i`` of ``Sq`` queries over ``Sk`` keys has *position* ``p_i = i + Sk - Sq`` (bottom-right
alignment, as for causal). In this order:

1. ``s = softmax_scale * <q_i, k_j>``.
2. ``softcap > 0``: ``s = softcap * tanh(s / softcap)``. The scale applies *inside* the cap
   (FlashAttention's semantics: ``softcap * tanh(q.k * scale / softcap)``); scores stay in
   ``(-softcap, softcap)``.
3. ``alibi_slopes`` (``[Hq]`` or ``[B, Hq]``): ``s = s - slope[b, h] * |p_i - j|``, after the
   cap (the bias is not capped). This holds with and without causal, so LSE includes the bias.
4. masks: ``causal`` and ``window_size = (left, right)`` (``-1`` = unbounded side): key ``j``
   is visible iff ``p_i - left <= j <= p_i + right``; ``causal=True`` sets ``right = 0``, so
   causal is the window ``(-1, 0)`` and causal with a window is the intersection of both
   (FlashAttention's rule). ``Sq = 4, Sk = 6`` (positions 2..5), 1 = visible::

       window (1, 0) / causal + (1, -1)     window (1, 1)            window (-1, 1)
       keys ->   0 1 2 3 4 5                0 1 2 3 4 5              0 1 2 3 4 5
       query 0   0 1 1 0 0 0                0 1 1 1 0 0              1 1 1 1 0 0
       query 1   0 0 1 1 0 0                0 0 1 1 1 0              1 1 1 1 1 0
       query 2   0 0 0 1 1 0                0 0 0 1 1 1              1 1 1 1 1 1
       query 3   0 0 0 0 1 1                0 0 0 0 1 1              1 1 1 1 1 1

   and with ``Sq = 4, Sk = 2`` (positions -2..1) window ``(0, 0)`` lets only the last two
   queries see a key (their diagonal)::

       keys ->   0 1
       query 0   0 0
       query 1   0 0
       query 2   1 0
       query 3   0 1

5. ``sinks [Hq]``: a per-head logit that joins the softmax denominator and has no value
   vector (gpt-oss, StreamingLLM). It is compared with the final scores as they are (not
   scaled, capped or biased)::

       out_i = sum_j exp(s_ij - m) v_j / (exp(sink_h - m) + sum_j exp(s_ij - m))
       lse_i = log(exp(sink_h) + sum_j exp(s_ij))         (the LSE includes the sink)

   A row that sees no key but has a sink gets output 0 and ``lse = sink``; a sink of
   ``-inf`` is no sink.

Without a sink, a row that sees no key has output 0 and ``lse = -inf``.

Quantized KV caches (``float8_e4m3fn`` or ``int8``)
--------------------------------------------------
A cache entry ``c`` (the stored number) with its float32 scale ``s`` stands for ``c * s``
(:func:`dequantize`); attention over a quantized cache is attention over those values. Scales
come at three granularities, told apart by their shape: ``[1]`` (or ``[]``) one per tensor,
``[Hkv]`` one per KV head, and the cache's leading shape ``[B, S_max, Hkv]`` / ``[num_blocks,
page_size, Hkv]`` one per token and KV head. A new value ``x`` is stored as
``quantize(x / s)`` (:func:`quantize`): the quotient in float32 (IEEE division), saturated to
the format's range (``+-448`` for e4m3, ``+-127`` for int8) and rounded to the nearest
representable number, ties to even. With per-token scales the scale of a new token and head is
computed first, from the token's own values: ``s = max_d |x_d| / 448`` (int8: ``/ 127``) in
float32, so the largest element lands on the range's edge; a row of zeros gets ``s = 0`` and is
stored as zeros.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "alibi_bias",
    "append_to_cache",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "cache_prefix",
    "dequantize",
    "quantize",
    "quantize_tokens",
    "causal_mask",
    "expand_kv_heads",
    "window_mask",
]


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask ``[Sq, Sk]`` (True = query may attend to key)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def window_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), causal: bool = False,
                device=None) -> torch.Tensor:
    """Visible keys ``[Sq, Sk]`` for a local window (True = query may attend to key).

    Query ``i`` (position ``p = i + Sk - Sq``) sees key ``j`` iff ``p - left <= j <= p + right``
    with ``(left, right) = window_size``, -1 meaning unbounded; ``causal`` sets ``right = 0``.
    ``window_mask(Sq, Sk, (-1, 0))`` equals ``causal_mask(Sq, Sk)``. Examples: module docstring.
    """
    return _visible(_positions(seqlen_q, seqlen_k, None, device), seqlen_k, window_size, causal)


def _positions(seqlen_q: int, seqlen_k: int, rows, device) -> torch.Tensor:
    """Positions ``i + Sk - Sq`` of the query rows ``rows`` (all rows when None), as ``[rows, 1]``."""
    position = torch.arange(seqlen_q, device=device) + (seqlen_k - seqlen_q)
    if rows is not None:
        position = position[torch.as_tensor(rows, device=device)]
    return position[:, None]


def _visible(position: torch.Tensor, seqlen_k: int, window_size, causal: bool) -> torch.Tensor:
    """Visible keys ``[rows, Sk]`` of rows at ``position [rows, 1]`` (see :func:`window_mask`)."""
    left, right = window_size
    if causal:
        right = 0
    j = torch.arange(seqlen_k, device=position.device)[None, :]
    visible = torch.ones(position.shape[0], seqlen_k, dtype=torch.bool, device=position.device)
    if left >= 0:
        visible &= j >= position - left
    if right >= 0:
        visible &= j <= position + right
    return visible


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """ALiBi bias ``-slope * |i + Sk - Sq - j|``: slopes ``[H]`` -> ``[H, Sq, Sk]`` (or ``[B, H]``
    -> ``[B, H, Sq, Sk]``), in the slopes' dtype."""
    return _alibi(slopes, _positions(seqlen_q, seqlen_k, None, slopes.device), seqlen_k)


def _alibi(slopes: torch.Tensor, position: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """:func:`alibi_bias` for rows at ``position [rows, 1]``: ``[(B,) H, rows, Sk]``."""
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (position.to(slopes.device) - j).abs().to(slopes.dtype)
    return -slopes[..., None, None] * distance


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
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    upcast: bool = True,
    rows=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention.

    Args:
        q: ``[B, Sq, Hq, D]``.
        k, v: ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0``.
        causal: bottom-right aligned causal mask (see module docstring).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        window_size, softcap, alibi_slopes (``[Hq]`` or ``[B, Hq]``), sinks (``[Hq]``): the
            variants of the module docstring.
        upcast: True computes everything in float64 (the ground truth). False computes the way
            PyTorch's plain math path does in the input dtype: matmuls in the input dtype,
            softmax (and the score modifiers) in float32, probabilities rounded back to the
            input dtype before P @ V. Tests use it to measure how far PyTorch itself lands
            from the truth.
        rows: indices of the query rows to compute (default: all). The result holds those
            rows only, each exactly as the full computation has it (masks and ALiBi keep the
            positions ``i + Sk - Sq`` of the full ``Sq``): long sequences are checked on a
            sample of rows at the cost of the sample.

    Returns:
        ``out [B, Sq, Hq, D]`` (float64 if upcast, else the input dtype) and
        ``lse [B, Hq, Sq]`` (float64 if upcast, else float32); ``Sq`` is ``len(rows)`` with
        ``rows``.
    """
    dtype = torch.float64 if upcast else q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    num_q_heads = q.shape[2]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    position = _positions(seqlen_q, seqlen_k, rows, q.device)
    if rows is not None:
        q = q[:, torch.as_tensor(rows, device=q.device)]
    qh = q.to(dtype).transpose(1, 2)  # [B, Hq, rows, D]
    kh = expand_kv_heads(k.to(dtype), num_q_heads).transpose(1, 2)  # [B, Hq, Sk, D]
    vh = expand_kv_heads(v.to(dtype), num_q_heads).transpose(1, 2)

    scores = torch.matmul(qh, kh.transpose(-1, -2))
    stats_dtype = torch.float64 if upcast else torch.float32
    scores = scores.to(stats_dtype) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + _alibi(alibi_slopes.to(stats_dtype), position, seqlen_k)  # [(B,) Hq, Sq, Sk]
    if causal or tuple(window_size) != (-1, -1):
        scores = scores.masked_fill(~_visible(position, seqlen_k, window_size, causal), float("-inf"))

    logits = scores
    if sinks is None and seqlen_k == 0:  # no logit at all: output 0, lse -inf
        lse = torch.full(scores.shape[:-1], float("-inf"), dtype=stats_dtype, device=q.device)
        return torch.zeros(q.shape, dtype=dtype, device=q.device), lse
    if sinks is not None:  # one more logit per row, with no value vector
        sink = sinks.to(stats_dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)  # -inf where a row sees nothing (and has no sink)
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(logits - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = torch.where(denom > 0, weights / denom.clamp_min(1e-300), torch.zeros_like(weights))
    out = torch.matmul(probs[..., :seqlen_k].to(dtype), vh)
    return out.transpose(1, 2), lse


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    alibi_slopes: torch.Tensor | None = None,
    upcast: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``; sequence ``b`` is
    rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q (likewise for k, v) and is attended
    alone, exactly as :func:`attention` would (masks aligned to its own lengths). ``alibi_slopes``
    ``[B, Hq]`` gives sequence ``b`` its row; other keyword arguments go to :func:`attention`.

    Returns ``out [total_q, Hq, D]`` and ``lse [Hq, total_q]``.
    """
    dtype = torch.float64 if upcast else q.dtype
    stats_dtype = torch.float64 if upcast else torch.float32
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=stats_dtype, device=q.device)
    cu_q = [int(x) for x in cu_seqlens_q]
    cu_k = [int(x) for x in cu_seqlens_k]
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], alibi_slopes=slopes,
                         upcast=upcast, **kwargs)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = l[0]
    return out, lse


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
    """The first ``length`` tokens of sequence ``b`` as a dense ``[length, Hkv, D]`` copy (any
    dtype: a float8 cache is gathered as its bytes)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache_prefix(cache.view(torch.uint8), b, length, block_table).view(cache.dtype)
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


# --- quantized caches --------------------------------------------------------------------------

QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}  # the largest magnitude each stores


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32 (``scale`` broadcasts against ``x``), saturated to ``dtype``'s
    range and rounded to nearest, ties to even, as ``dtype`` (float8_e4m3fn or int8)."""
    bound = QUANT_MAX[dtype]
    # The float32 quotient correctly rounded, as the kernels' IEEE division gives it: computed in
    # float64 (exact enough that rounding to float32 once more changes nothing), because PyTorch's
    # CUDA division by a scalar multiplies by its reciprocal, off by an ulp now and then.
    y = (x.double() / scale.double()).float().clamp(-bound, bound)
    if dtype == torch.int8:
        return torch.round(y).to(torch.int8)  # torch.round: half to even
    return y.to(dtype)  # round to nearest even, subnormals included


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scales: ``x [..., D]`` -> ``(stored [..., D], scale [...] float32)`` with
    ``scale = max |x| / QUANT_MAX`` over the last dimension (rows of zeros: scale 0, stored 0)."""
    scale = (x.double().abs().amax(dim=-1) / QUANT_MAX[dtype]).float()  # correctly rounded, see quantize
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    stored = quantize(torch.where(scale[..., None] > 0, x.float(), 0.0), safe[..., None], dtype)
    return stored, scale


def expand_scale(scale: torch.Tensor) -> torch.Tensor:
    """A scale of any granularity shaped to broadcast against its cache ``[N, S, Hkv, D]``:
    ``[]``/``[1]`` as is, ``[Hkv]`` -> ``[Hkv, 1]``, ``[N, S, Hkv]`` -> ``[N, S, Hkv, 1]``."""
    return scale if scale.dim() == 0 else scale[..., None]


def dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 values a quantized cache stands for: ``stored * scale`` (any granularity)."""
    return stored.double() * expand_scale(scale).double()


def append_to_quantized_cache(cache: torch.Tensor, scale: torch.Tensor, new: torch.Tensor, cache_seqlens,
                              block_table=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``cache`` and its ``scale`` with ``new [B, T, Hkv, D]`` quantized and written at
    ``cache_seqlens[b] + t``: with a per-token ``scale`` (3-D) each token's scales computed from
    its values and written beside it, else quantized with the given scale."""
    if scale.dim() == 3:
        stored, new_scale = quantize_tokens(new, cache.dtype)
        return (append_to_cache(cache, stored, cache_seqlens, block_table),
                append_to_cache(scale, new_scale, cache_seqlens, block_table))
    per_head = expand_scale(scale)
    return append_to_cache(cache, quantize(new, per_head, cache.dtype), cache_seqlens, block_table), scale.clone()


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    block_table=None,
    cache_leftpad=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    upcast: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decode over a cache (see the section comment above); inputs are not modified.

    A quantized cache (``k_scale``, ``v_scale`` given: see "Quantized KV caches" above) gets the
    new tokens quantized (:func:`append_to_quantized_cache`) and is attended as its dequantized
    values.

    ``cache_leftpad [B]``: sequence ``b``'s keys start at cache position ``cache_leftpad[b]``
    (left padding, or a static cache's unused head): it attends positions ``[start, L)`` as a
    sequence of ``L - start`` keys (masks and ALiBi depend on differences of positions only,
    so they are unchanged by the shift).

    ``window_size``, ``softcap``, ``alibi_slopes`` (``[Hq]`` or ``[B, Hq]``) and ``sinks`` are
    those of :func:`attention`, applied to each sequence's ``T`` queries over its ``L`` keys, so
    the window is aligned to the sequence's end (new token ``t`` has position ``L - T + t``).
    Returns ``out [B, T, Hq, D]`` and ``lse [B, Hq, T]`` with the dtypes of :func:`attention`.
    A sequence with no keys gets output 0 and lse -inf (the sink with ``sinks``).
    """
    if k is not None and k_scale is not None:
        k_cache, k_scale = append_to_quantized_cache(k_cache, k_scale, k, cache_seqlens, block_table)
        v_cache, v_scale = append_to_quantized_cache(v_cache, v_scale, v, cache_seqlens, block_table)
    elif k is not None:
        k_cache = append_to_cache(k_cache, k, cache_seqlens, block_table)
        v_cache = append_to_cache(v_cache, v, cache_seqlens, block_table)
    if k_scale is not None:
        k_cache, v_cache = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    added = q.shape[1] if k is not None else 0
    outs, lses = [], []
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b]) + added
        start = min(int(cache_leftpad[b]), length) if cache_leftpad is not None else 0
        keys = cache_prefix(k_cache, b, length, block_table)[None, start:]
        values = cache_prefix(v_cache, b, length, block_table)[None, start:]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        out, lse = attention(q[b:b + 1], keys, values, causal=causal, softmax_scale=softmax_scale,
                             alibi_slopes=slopes, upcast=upcast, **kwargs)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
