"""Score modifiers, masks and the online-softmax step shared by the prefill and decode kernels.

One implementation of the math for both families (the semantics are specified in
``reference.py``). Kernels keep scores in log2 units (``log2(e) * score``) so that ``exp2`` is
the only transcendental of the plain path.

Positions: a query row carries its *position* ``pos = i + Sk - Sq`` (row ``i`` of ``Sq`` queries
over ``Sk`` keys; in decode ``Sq`` is the number of new tokens and ``Sk`` the sequence length).
Key ``j`` is on the row's diagonal when ``j == pos``; the bottom-right causal mask is
``j <= pos``, a window ``(left, right)`` is ``pos - left <= j <= pos + right``, and ALiBi's
distance is ``|pos - j|``.

Every variant is a ``tl.constexpr`` flag, so a call without it compiles none of its code:

* ``HAS_WINDOW``: ``window_left`` / ``window_right`` bound the visible keys. ``-1`` (unbounded)
  sides arrive as a number large enough to be inert (:meth:`Variant.window_args`), so the
  kernels never test for -1. A window of ``(-1, 0)`` is plain ``CAUSAL``, not ``HAS_WINDOW``.
* ``HAS_SOFTCAP``: ``s = softcap * tanh(scale * q.k / softcap)``, computed as
  ``tanh(y) = 1 - 2 / (1 + exp(2y))`` with one ``exp2`` and one division; exact limits at
  ``+-inf`` (``exp2`` overflows to ``inf`` or underflows to 0, never NaN). The error is
  absolute, not relative: at most 1.8e-7 on the tanh over ``|y| <= 20`` (float32 in the
  interpreter against float64 ``tanh``; the GPU's 2-ulp division adds about as much), so about
  ``1e-5`` on a score capped at 50, far below fp16/bf16 output rounding. A cap far above every
  score (say 1e6) costs ``~2e-7 * softcap`` of absolute score error: pass 0 when it never binds.
  float32 inputs (``DOT_PRECISION == "ieee"``), whose outputs would show that error (at a cap
  of 50 it exceeded twice PyTorch's own float32 error), take :func:`accurate_tanh` instead: a few
  ulps relative error at any cap, for about ten more instructions per score.
* ``HAS_ALIBI``: ``s -= slope * |pos - j|`` after the cap (FlashAttention's order).
* sinks are not a score modifier: a kernel starts its running max at the sink and its running
  sum at 1, which adds ``exp(sink)`` to the softmax denominator and nothing to the output.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)


# --------------------------------------------------------------------------------------------
# Host side: the variant of one call, as kernel arguments
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """A call's attention variant, normalized for the kernels (inputs already validated).

    ``causal`` is the plain bottom-right causal mask (``CAUSAL``); ``window`` is ``(left,
    right)`` when a window other than "none" or "causal" applies (``HAS_WINDOW``), with
    ``causal=True`` already folded in as ``right = 0`` (FlashAttention's rule, which is the
    intersection of the two masks). ``softcap`` 0 is off.
    """

    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    @staticmethod
    def of(causal: bool, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None) -> Variant:
        if window_size == (-1, -1) and not softcap and alibi_slopes is None and sinks is None:
            return _PLAIN_CAUSAL if causal else _PLAIN  # the common call: no allocation
        left, right = window_size
        if causal:
            right = 0
        if left == -1 and right == -1:
            causal, window = False, None
        elif left == -1 and right == 0:
            causal, window = True, None
        else:
            causal, window = False, (left, right)
        return Variant(causal, window, float(softcap), alibi_slopes, sinks)

    @property
    def is_plain(self) -> bool:
        return (self.window is None and self.softcap == 0.0 and self.alibi_slopes is None
                and self.sinks is None)

    def window_args(self, max_seqlen_q: int, max_seqlen_k: int) -> tuple[int, int]:
        """``(left, right)`` for the kernel: unbounded sides become inert finite bounds.

        Any ``left >= max_seqlen_k`` lets every row see key 0 and any ``right >= max_seqlen_q``
        lets every row see its last key, so clamping there keeps the semantics and keeps
        ``pos - left`` and ``pos + right`` far from int32 overflow.
        """
        if self.window is None:
            return 0, 0
        left, right = self.window
        left = max_seqlen_k if left < 0 else min(left, max_seqlen_k)
        right = max_seqlen_q if right < 0 else min(right, max_seqlen_q)
        return left, right

    def kernel_args(self, softmax_scale: float, max_seqlen_q: int, max_seqlen_k: int, unused: torch.Tensor) -> dict:
        """Keyword arguments shared by the prefill and decode kernels for this variant.

        ``unused`` is any tensor on the device, passed as the pointer of absent operands.
        ``alibi_strides`` is ``(batch, head)`` (batch 0 for per-head slopes).
        """
        window_left, window_right = self.window_args(max_seqlen_q, max_seqlen_k)
        slopes = self.alibi_slopes
        if slopes is None:
            slopes_arg, alibi_strides = unused, (0, 0)
        elif slopes.dim() == 1:
            slopes_arg, alibi_strides = slopes, (0, slopes.stride(0))
        else:
            slopes_arg, alibi_strides = slopes, (slopes.stride(0), slopes.stride(1))
        sinks = self.sinks
        cap = self.softcap
        return dict(
            Slopes=slopes_arg, Sinks=sinks if sinks is not None else unused,
            alibi_strides=alibi_strides, sink_stride=sinks.stride(0) if sinks is not None else 0,
            window_left=window_left, window_right=window_right,
            # softcap * tanh(x / softcap) in log2 units: out - 2 * out / (1 + exp2(qk * in))
            softcap_in=2.0 * softmax_scale * LOG2E / cap if cap > 0 else 0.0,
            softcap_out=cap * LOG2E,
            CAUSAL=self.causal, HAS_WINDOW=self.window is not None, HAS_SOFTCAP=cap > 0,
            HAS_ALIBI=slopes is not None, HAS_SINKS=sinks is not None,
        )


_PLAIN = Variant(False)
_PLAIN_CAUSAL = Variant(True)


# --------------------------------------------------------------------------------------------
# Device side
# --------------------------------------------------------------------------------------------


@triton.jit
def accurate_tanh(y):
    """``tanh(y)`` to a few float32 ulps, relative: the odd Taylor polynomial below ``|y| = 1/4``
    (where ``1 - 2 / (1 + e^(2y))`` loses its digits to cancellation; the first term left out
    is 2e-9 relative there), ``(1 - e^(-2|y|)) / (1 + e^(-2|y|))`` above; never NaN."""
    a = tl.abs(y)
    a2 = a * a
    small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
        -0.05396825396825397 + a2 * 0.021869488536155203))))
    e = tl.math.exp2(a * -2.8853900817779268)  # e^(-2|y|)
    t = tl.where(a < 0.25, small, (1.0 - e) / (1.0 + e))
    return tl.where(y < 0.0, -t, t)


@triton.jit
def modified_scores(qk, row_pos, keys, qk_scale, softcap_in, softcap_out, alibi_rows,
                    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores in log2 units: ``log2(e) * (cap(scale * q.k) - slope * |pos - j|)``.

    ``qk`` is the raw ``[rows, keys]`` product; ``alibi_rows`` is ``slope * log2(e)`` per row.
    ``DOT_PRECISION == "ieee"`` (float32 inputs) computes the cap's tanh with
    :func:`accurate_tanh` (see the module docstring).
    """
    if HAS_SOFTCAP:
        if DOT_PRECISION == "ieee":
            # y = scale * qk / softcap = qk * softcap_in / (2 log2(e))
            s = softcap_out * accurate_tanh(qk * softcap_in * 0.34657359027997264)
        else:
            # softcap * tanh(y), y = scale * qk / softcap, as softcap * (1 - 2 / (1 + e^(2y)))
            s = softcap_out - (2.0 * softcap_out) / (1.0 + tl.math.exp2(qk * softcap_in))
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        distance = tl.abs(row_pos[:, None] - keys[None, :]).to(tl.float32)
        s = s - alibi_rows[:, None] * distance
    return s


@triton.jit
def visible_keys(row_pos, keys, seqlen_k, window_left, window_right,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """``[rows, keys]`` mask: key exists, and lies in the row's window (or causal range)."""
    visible = keys[None, :] < seqlen_k
    if HAS_WINDOW:
        visible = visible & (keys[None, :] >= row_pos[:, None] - window_left)
        visible = visible & (keys[None, :] <= row_pos[:, None] + window_right)
    elif CAUSAL:
        visible = visible & (keys[None, :] <= row_pos[:, None])
    return visible


@triton.jit
def window_span(first_pos, last_pos, seqlen_k, window_left, window_right, BLOCK_N: tl.constexpr):
    """Keys ``[lo, hi)`` seen by some row with position in ``[first_pos, last_pos]``.

    ``lo`` is rounded down to a multiple of ``BLOCK_N`` (tiles stay aligned); ``hi`` may be
    ``<= lo`` when no row sees any key.
    """
    lo = tl.maximum(first_pos - window_left, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(seqlen_k, last_pos + window_right + 1)
    return lo, hi


@triton.jit
def unmasked_run(lo, hi, first_pos, last_pos, window_left, window_right, BLOCK_N: tl.constexpr):
    """Of the tiles ``lo, lo + BLOCK_N, ...`` below ``hi`` (all keys ``< hi <= seqlen_k``), the
    run ``[mid_lo, mid_hi)`` that every row in ``[first_pos, last_pos]`` sees whole.

    The caller visits ``[lo, mid_lo)`` masked, ``[mid_lo, mid_hi)`` unmasked and
    ``[mid_hi, hi)`` masked; each range is empty or a whole number of tiles from ``lo``.
    """
    # First tile starting at or after the last row's lower bound (the highest lower bound).
    mid_lo = lo + tl.cdiv(tl.maximum(last_pos - window_left - lo, 0), BLOCK_N) * BLOCK_N
    mid_lo = tl.minimum(mid_lo, hi)
    # Whole tiles ending at or before the first row's upper bound (the lowest upper bound).
    full_hi = tl.minimum(hi, first_pos + window_right + 1)
    mid_hi = mid_lo + tl.maximum(full_hi - mid_lo, 0) // BLOCK_N * BLOCK_N
    return mid_lo, mid_hi


@triton.jit
def _rescaled_product(acc, alpha, pv, v, v_tile, V_COLS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``acc * alpha + pv v`` (times ``v_tile`` with ``V_COLS``)."""
    acc = acc * alpha[:, None]
    if V_COLS:
        acc += tl.dot(pv, v, input_precision=DOT_PRECISION) * v_tile
    else:
        acc = tl.dot(pv, v, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def accumulate_pv(acc, alpha, p, v, v_cols, v_tile, V_COLS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  V_PAIRS: tl.constexpr = False):
    """``acc * alpha + P V``. With ``V_COLS`` (a quantized cache's per-token V scales) key ``j``'s
    value row is ``v_cols[j] * v_tile * v[j]``: ``v_cols <= 1`` scales P's columns before the
    product (P stays in ``[0, 1]`` in V's dtype) and the tile's ``v_tile`` the product.
    With ``V_PAIRS``, ``v`` and ``acc`` are pairs ``(even columns, odd columns)`` of V and of the
    output (a 1-byte cache read two entries at a time, ``decode._value_pairs``)."""
    if V_COLS:
        p = p * v_cols[None, :]
    if V_PAIRS:
        pv = p.to(v[0].dtype)
        acc = (_rescaled_product(acc[0], alpha, pv, v[0], v_tile, V_COLS, DOT_PRECISION),
               _rescaled_product(acc[1], alpha, pv, v[1], v_tile, V_COLS, DOT_PRECISION))
    else:
        acc = _rescaled_product(acc, alpha, p.to(v.dtype), v, v_tile, V_COLS, DOT_PRECISION)
    return acc


@triton.jit
def softmax_step_scaled(acc, l_i, m_i, qk, qk_scale, v, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        v_cols=0.0, v_tile=1.0, V_COLS: tl.constexpr = False, V_PAIRS: tl.constexpr = False):
    """Online-softmax update for raw scores ``qk`` (the scale is folded into the exponent).

    ``m_i`` is the running row max in log2 units. With ``MASKED`` some scores may be -inf and a
    row may have seen no key yet (``m = -inf``): subtract 0 there so exp2 gives 0, not NaN.
    ``v_cols``, ``v_tile``, ``V_COLS``, ``V_PAIRS``: :func:`accumulate_pv`.
    """
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = accumulate_pv(acc, alpha, p, v, v_cols, v_tile, V_COLS, DOT_PRECISION, V_PAIRS)
    return acc, l_i, m_new


@triton.jit
def softmax_step(acc, l_i, m_i, s, v, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 v_cols=0.0, v_tile=1.0, V_COLS: tl.constexpr = False, V_PAIRS: tl.constexpr = False):
    """Online-softmax update for scores ``s`` already in log2 units (score modifiers applied)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.math.exp2(s - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = accumulate_pv(acc, alpha, p, v, v_cols, v_tile, V_COLS, DOT_PRECISION, V_PAIRS)
    return acc, l_i, m_new


@triton.jit
def attend_scores(acc, l_i, m_i, qk, v, row_pos, keys, length, qk_scale,
                  window_left, window_right, softcap_in, softcap_out, alibi_rows,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  v_cols=0.0, v_tile=1.0, V_COLS: tl.constexpr = False, V_PAIRS: tl.constexpr = False):
    """A tile's raw scores ``qk = q.k^T`` -> modifiers, mask, one online-softmax step.

    Shared by prefill and decode. ``row_pos [M]`` are the rows' positions (``i + Sk - Sq``),
    ``keys [N]`` the tile's key indices, ``length`` the keys that exist. Without softcap/ALiBi
    the scale stays folded into the exp2 (:func:`softmax_step_scaled`); masks only when ``MASKED``.
    ``v_cols``, ``v_tile``, ``V_COLS``, ``V_PAIRS`` (decode over a quantized cache):
    :func:`accumulate_pv`.
    """
    if HAS_SOFTCAP or HAS_ALIBI:
        s = modified_scores(qk, row_pos, keys, qk_scale, softcap_in, softcap_out, alibi_rows,
                            HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        if MASKED:
            visible = visible_keys(row_pos, keys, length, window_left, window_right, CAUSAL, HAS_WINDOW)
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_new = softmax_step(acc, l_i, m_i, s, v, MASKED, DOT_PRECISION, v_cols, v_tile, V_COLS,
                                       V_PAIRS)
    else:
        if MASKED:
            visible = visible_keys(row_pos, keys, length, window_left, window_right, CAUSAL, HAS_WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
        acc, l_i, m_new = softmax_step_scaled(acc, l_i, m_i, qk, qk_scale, v, MASKED, DOT_PRECISION, v_cols, v_tile,
                                              V_COLS, V_PAIRS)
    return acc, l_i, m_new
