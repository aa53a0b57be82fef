"""Fused attention backward (FlashAttention-2 style): exact gradients recomputed from the LSE.

The forward saves only ``out`` and the natural-log LSE per row; the backward recomputes each
tile of probabilities ``P = exp(s - lse)`` on chip and never stores an ``Sq x Sk`` matrix, so
memory stays O(N). With ``s`` the final (scaled, capped, biased) scores and ``dO`` the output's
gradient, per row ``i`` and key ``j``::

    delta_i = sum_d dO_id * out_id                      (= sum_j P_ij dP_ij)
    dP_ij   = dO_i . v_j
    dS_ij   = P_ij (dP_ij - delta_i)                    (gradient of the score s_ij)
    dV_j    = sum_i P_ij dO_i
    dQ_i    = sum_j dS_ij f'(q_i . k_j) k_j,   dK_j = sum_i dS_ij f'(q_i . k_j) q_i

where ``f(x) = scale * x``, or ``softcap * tanh(scale * x / softcap)`` with
``f'(x) = scale * (1 - tanh^2)``. ALiBi adds a constant to ``s`` and so nothing to ``f'``
(its slopes get no gradient). A sink joins the softmax denominator without a value vector, so
``delta`` keeps its form and the sink's own gradient is ``dsink_h = -sum_i exp(sink_h - lse_i)
delta_i`` over the rows (and batch) of head ``h``.

Three kernels (and two small sums):

1. ``_delta_kernel``: ``delta = rowsum(dO * out)`` in float32 (``[B, Hq, Sq]``, or ``[Hq,
   total_q]`` packed), plus per-program partial sums of the sink gradient, which
   ``_sum_kernel`` adds up per head.
2. ``_dkdv_kernel``: one program per (key tile, KV head or part of its query-head group,
   batch). It keeps its K/V tile and the dK/dV accumulators (float32) on chip and walks the
   query heads of its GQA group and, for each, the query tiles that can see its keys: tiles the
   causal mask or window hides entirely are never visited (``window_span`` of ``_softmax``,
   mirrored: the roles of rows and keys swap), and only the tiles ``unmasked_run`` does not
   clear compute a mask. That choice is a runtime flag inside one loop rather than separate
   masked and unmasked loops: each extra loop kept its own pipelined copies of the tiles live
   and the kernel spilled registers (ptxas, sm_90a). It works on transposed tiles
   (``S^T = K Q^T``), so ``P^T`` and ``dS^T`` are the left operands of their products and
   nothing in registers is transposed.
3. ``_dq_kernel``: one program per (query tile, query head, batch) over the key tiles it sees,
   like the forward, with the same one-loop masking.

No float atomics anywhere: every gradient element is written by exactly one program, so the
results are bitwise reproducible run to run. (On Hopper, ``attention_backward`` may instead run
``gluon/backward.py``, which adds dQ with TMA reductions; ``deterministic=True`` keeps these
kernels.) When a
GQA group is split over several programs (few key tiles per KV head, e.g. MQA at short
lengths), each part writes its own float32 slice and ``_sum_parts_kernel`` adds them in a fixed
order, which is deterministic too.

Rows that see no key have ``lse = -inf`` and every pair of theirs masked, so they get zero
gradients; the kernels also read such an LSE (and rows past the end) as ``+inf``, so ``P`` is 0
for them even where no mask is applied.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from ._common import (cdiv, cuda_properties, dot_flags, exact_exponent, exponent_options, is_interpreted,
                      next_power_of_2, padded_head_dim)
from ._launch import Launcher, allocate
from ._softmax import Variant, modified_scores, unmasked_run, visible_keys, window_span
from .prefill import MAX_GRID_YZ, MAX_VARLEN_SEQS, _load_tile, _strides3, _varlen_tile
from . import dispatch
from .tuning import TileConfig

LOG2E = math.log2(math.e)


# --------------------------------------------------------------------------------------------
# Tile configurations (data)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Launch parameters of one backward call.

    ``dkdv.block_n`` is the key tile of a dK/dV program and ``dkdv.block_m`` the query rows it
    takes per step; ``dq.block_m`` is the query tile of a dQ program and ``dq.block_n`` the keys
    per step. ``delta_block_m`` rows per program of the delta kernel. ``group_split``: programs
    per KV head's query-head group in the dK/dV kernel (a divisor of the group size; None picks
    one from the grid size, see :func:`pick_group_split`).
    """

    dkdv: TileConfig
    dq: TileConfig
    delta_block_m: int = 64
    group_split: int | None = None


# Hopper (H200), bf16/fp16. Head dims 64 and 128: the fastest of the candidates of
# ``python -m flashkernel.bench.backward --sweep`` (bf16, 16k tokens per batch, seqlen 4k and 16k,
# ``benchmarks/results/h200/backward-sweep.json``), 1.16x-1.35x faster than the first table; the
# same tiles won at both lengths (the 4-warp dK/dV tiles spill 152-388 B at sm_90a and are still
# the fastest: ``SPILL_ALLOWANCE`` in ``bench/backward.py``). Head dim 128 wants other dK/dV tiles when causal
# (CAUSAL_CONFIGS). Head dims 16, 32 and 256: written for the register budget and checked offline
# with ptxas for sm_90a (``--compile-check``), not yet swept. The dK/dV program holds two float32
# accumulators [block_n, head_dim] (dK, dV) plus the transposed score tiles [block_n, block_m], so
# block_m shrinks as the head dim grows; wgmma gives each warp 16 rows of the key tile.
CONFIGS = {
    16: BackwardConfig(TileConfig(64, 128, 8, 2), TileConfig(128, 64, 8, 3), 128),
    32: BackwardConfig(TileConfig(64, 128, 8, 2), TileConfig(128, 64, 8, 3), 128),
    64: BackwardConfig(TileConfig(32, 128, 4, 2), TileConfig(128, 64, 8, 3), 128),
    128: BackwardConfig(TileConfig(64, 64, 4, 2), TileConfig(128, 64, 8, 3), 64),
    256: BackwardConfig(TileConfig(16, 64, 8, 2), TileConfig(128, 32, 8, 2), 32),
}
CAUSAL_CONFIGS = {
    128: BackwardConfig(TileConfig(64, 128, 8, 1), TileConfig(128, 64, 8, 3), 64),
}
# fp32 runs exact fp32 ("ieee") products on the FMA units: registers, not shared memory, bound
# the tiles (dense launches spill at most 12 bytes at sm_90a).
FLOAT32_CONFIGS = {
    16: BackwardConfig(TileConfig(32, 64, 4, 1), TileConfig(32, 32, 4, 1), 64),
    32: BackwardConfig(TileConfig(32, 64, 4, 1), TileConfig(32, 32, 4, 1), 64),
    64: BackwardConfig(TileConfig(32, 64, 4, 1), TileConfig(32, 32, 4, 1), 64),
    128: BackwardConfig(TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1), 32),
    256: BackwardConfig(TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1), 16),
}
# The interpreter runs a tile as numpy arrays: few large tiles are faster than many small ones.
INTERPRETER_CONFIG = BackwardConfig(TileConfig(32, 32, 4, 1), TileConfig(32, 32, 4, 1), 32, 1)


def pick_config(head_dim: int, dtype: torch.dtype, interpreted: bool, causal: bool = False) -> BackwardConfig:
    """The table's configuration for this head dim, dtype and mask (the interpreter's small one)."""
    if interpreted:
        return INTERPRETER_CONFIG
    padded = padded_head_dim(head_dim)
    if dtype == torch.float32:
        return FLOAT32_CONFIGS[padded]
    return CAUSAL_CONFIGS.get(padded, CONFIGS[padded]) if causal else CONFIGS[padded]


def pick_group_split(group_size: int, programs: int, device: torch.device, interpreted: bool) -> int:
    """Split each KV head's group of query heads over this many dK/dV programs when the grid
    (``programs`` without splitting) would leave SMs idle: the smallest divisor of the group
    size that gives two programs per SM, or the whole group. The interpreter never splits."""
    if interpreted or group_size == 1:
        return 1
    target = 2 * cuda_properties(device).multi_processor_count
    for split in range(1, group_size + 1):
        if group_size % split == 0 and programs * split >= target:
            return split
    return group_size


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _softcap_slope(qk, softcap_in):
    """``1 - tanh^2(y)`` with ``y = scale * qk / softcap`` (``softcap_in = 2 log2(e) scale /
    softcap``), as ``u (2 - u)`` with ``u = 1 - tanh(y) = 2 / (1 + e^(2y))``: no cancellation
    near ``|tanh| = 1``, and exactly 0 (not NaN) where ``e^(2y)`` overflows or underflows."""
    u = 2.0 / (1.0 + tl.math.exp2(qk * softcap_in))
    return u * (2.0 - u)


@triton.jit
def _visible_queries(keys, row_pos, window_left, window_right,
                     CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """``[keys, rows]`` mask of the transposed tile: the key lies in the row's window (or causal
    range). Key and row existence are not checked here (see ``_dkdv_step``)."""
    if HAS_WINDOW:
        visible = (keys[:, None] >= row_pos[None, :] - window_left) & (keys[:, None] <= row_pos[None, :] + window_right)
    else:  # CAUSAL
        visible = keys[:, None] <= row_pos[None, :]
    return visible


@triton.jit
def _span_bounds(seqlen_q, seqlen_k, window_left, window_right,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """``(left, right)`` of the visible band in position space for any mask: the window, causal
    as ``(Sk, 0)``, no mask as ``(Sk, Sq)`` (bounds wide enough to be inert)."""
    if HAS_WINDOW:
        left = window_left
        right = window_right
    elif CAUSAL:
        left = seqlen_k
        right = 0
    else:
        left = seqlen_k
        right = seqlen_q
    return left, right


@triton.jit
def _exponent(x, CLAMP_EXP: tl.constexpr):
    """``x = s - lse`` (log2 units), at most 0 in exact arithmetic. Past the usual scales (where
    ``_common.exponent_options`` turns FMA contraction off) the LSE's round trip through natural
    log and the recomputed scores' own rounding, each an ulp of scores that may pass 2**31, can
    put it far above 0: clamped there, so no gradient overflows (their accuracy then falls with
    the scores' magnitude: float32 scores no longer resolve the softmax)."""
    if CLAMP_EXP:
        x = tl.minimum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return x


@triton.jit
def _load_row_stats(lse_base, delta_base, rows, seqlen_q):
    """A tile's LSE in log2 units and its ``delta``. Rows past ``seqlen_q`` and rows that saw no
    key (``lse = -inf``) get ``+inf``, so ``exp2(s - lse)`` is 0 for every key of theirs."""
    lse = tl.load(lse_base + rows, mask=rows < seqlen_q, other=float("inf"))
    delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return lse, delta


@triton.jit
def _load_pair(a_base, b_base, row0, num_rows, stride_a, stride_b, offs_r, offs_d,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, DOT_F32: tl.constexpr):
    """Rows ``row0 + offs_r`` of two ``[num_rows, HEAD_DIM]`` matrices (q and dO, or k and v),
    zero outside them with ``MASKED``, upcast to fp32 with ``DOT_F32``."""
    a = _load_tile(a_base, row0, num_rows, stride_a, offs_r, offs_d, HEAD_DIM, BLOCK_D, False, MASKED)
    b = _load_tile(b_base, row0, num_rows, stride_b, offs_r, offs_d, HEAD_DIM, BLOCK_D, False, MASKED)
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _program_sequence(CuSeqlensA, CuSeqlensB, num_seqs, length_a, length_b,
                      BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, IS_VARLEN: tl.constexpr):
    """``(batch, tile, start_a, length_a, start_b, length_b)`` of this program: its tile along
    the tiled side ``a`` (queries for dQ, keys for dK/dV) and its sequence. Dense: grid axes 0
    and 2, starts 0. Packed: the flat tile ``program_id(0)`` over all sequences (``length_*``
    arrive as the totals; see ``prefill._varlen_tile``)."""
    if IS_VARLEN:
        batch, tile, start_a, length_a, start_b, length_b = _varlen_tile(
            CuSeqlensA, CuSeqlensB, tl.program_id(0), num_seqs, length_a, length_b, BLOCK, BLOCK_B)
        batch = batch.to(tl.int64)
        start_a = start_a.to(tl.int64)
        start_b = start_b.to(tl.int64)
    else:
        batch = tl.program_id(2).to(tl.int64)
        tile = tl.program_id(0)
        start_a = 0
        start_b = 0
    return batch, tile, start_a, length_a, start_b, length_b


# --------------------------------------------------------------------------------------------
# 1. delta = rowsum(dO * out), and the sinks' partial gradients
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["seqlen"])
def _delta_kernel(
    Out, DOut, Lse, Delta, Sinks, DSinkParts,
    o_strides, do_strides, lse_strides, delta_strides, parts_strides, sink_stride,
    seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Grid ``(row tiles, Hq, B)`` (packed sequences: ``B = 1``, ``seqlen = total_q``, batch
    strides 0). ``*_strides``: ``(batch, row, head)`` of ``out``/``dO``, ``(batch, head)`` of
    ``lse``/``delta``, ``(head, batch)`` of ``DSinkParts [Hq, B, row tiles]``, which gets
    ``-sum_i exp(sink - lse_i) delta_i`` of each program's rows."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = (Out + batch * o_strides[0] + head * o_strides[2] + rows[:, None].to(tl.int64) * o_strides[1]
              + offs_d[None, :])
    do_ptrs = (DOut + batch * do_strides[0] + head * do_strides[2] + rows[:, None].to(tl.int64) * do_strides[1]
               + offs_d[None, :])
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(Delta + batch * delta_strides[0] + head * delta_strides[1] + rows, delta, mask=rows < seqlen)
    if HAS_SINKS:
        lse = tl.load(Lse + batch * lse_strides[0] + head * lse_strides[1] + rows, mask=rows < seqlen,
                      other=float("-inf"))
        sink = tl.load(Sinks + head * sink_stride).to(tl.float32)
        # The sink's probability; 0 for a row with lse = -inf (no key and a -inf sink).
        p_sink = tl.where(lse == float("-inf"), 0.0, tl.exp(sink - lse))
        part = -tl.sum(p_sink * delta, 0)
        tl.store(DSinkParts + head * parts_strides[0] + batch * parts_strides[1] + pid_m, part)


@triton.jit
def _sum_kernel(Parts, Sums, count, BLOCK: tl.constexpr):
    """Grid ``(rows,)``: ``Sums[r] = sum(Parts[r, :count])`` in a fixed order (``Parts``
    contiguous float32): the sinks' gradient from the delta kernel's partial sums."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, count, BLOCK):
        acc += tl.load(Parts + row * count + start + offs, mask=start + offs < count, other=0.0)
    tl.store(Sums + row, tl.sum(acc, 0))


@triton.jit(do_not_specialize=["seqlen"])
def _sum_parts_kernel(
    Parts, Out, parts_strides, out_strides, seqlen, num_parts,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid ``(row tiles, H, B)``: ``Out[b, s, h] = sum_p Parts[p, b, s, h]`` in a fixed order,
    cast to ``Out``'s dtype (dK/dV of a GQA group split over several programs).
    ``parts_strides`` ``(part, batch, row, head)``, ``out_strides`` ``(batch, row, head)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(1).to(tl.int64)
    batch = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    src = (Parts + batch * parts_strides[1] + head * parts_strides[3] + rows[:, None].to(tl.int64) * parts_strides[2]
           + offs_d[None, :])
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for part in range(num_parts):
        acc += tl.load(src + part * parts_strides[0], mask=mask, other=0.0)
    dst = (Out + batch * out_strides[0] + head * out_strides[2] + rows[:, None].to(tl.int64) * out_strides[1]
           + offs_d[None, :])
    tl.store(dst, acc.to(Out.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# 2. dK, dV: one program per key tile
# --------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_step(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, masked, keys, offs_d,
    seqlen_q, stride_qs, stride_dos, causal_shift, qk_scale,
    window_left, window_right, softcap_in, softcap_out, alibi_keys,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, CLAMP_EXP: tl.constexpr,
):
    """Add one query tile's contribution (rows ``start_m + [0, BLOCK_M)``) to ``dk, dv
    [BLOCK_N, BLOCK_D]``, on transposed tiles ``[keys, rows]``.

    ``masked`` (a runtime flag, uniform over the program) says the tile may hold pairs outside
    the causal range or window; only then is the mask computed. Any tile may hold rows past
    ``seqlen_q``: their loads are masked (zero ``q``, ``dO``, ``delta`` and ``lse = +inf``, so
    ``P = 0``). Keys past ``seqlen_k`` are not masked: each key's dK/dV row depends on that
    key's scores only, and those rows are not stored.
    """
    offs_r = tl.arange(0, BLOCK_M)
    rows = start_m + offs_r
    q, do = _load_pair(q_base, do_base, start_m, seqlen_q, stride_qs, stride_dos, offs_r, offs_d,
                       HEAD_DIM, BLOCK_D, True, DOT_F32)
    lse, delta = _load_row_stats(lse_base, delta_base, rows, seqlen_q)

    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [keys, rows]
    row_pos = rows + causal_shift
    if HAS_SOFTCAP or HAS_ALIBI:
        # |pos - j| is symmetric, so the [rows, keys] helper serves the transposed tile.
        s_t = modified_scores(qk_t, keys, row_pos, qk_scale, softcap_in, softcap_out, alibi_keys,
                              HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
    else:
        s_t = qk_t * qk_scale
    p_t = tl.math.exp2(_exponent(s_t - lse[None, :], CLAMP_EXP))
    if CAUSAL or HAS_WINDOW:
        if masked:
            p_t = tl.where(_visible_queries(keys, row_pos, window_left, window_right, CAUSAL, HAS_WINDOW), p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * _softcap_slope(qk_t, softcap_in)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def _dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, CuSeqlensQ, CuSeqlensK,
    q_strides, k_strides, v_strides, do_strides, lse_strides, delta_strides, dk_strides, dv_strides,
    Slopes, alibi_strides,
    seqlen_q, seqlen_k, num_seqs, group_size, heads_per_program, qk_scale, sm_scale,
    window_left, window_right, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr, BLOCK_B: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CLAMP_EXP: tl.constexpr,
):
    """Grid ``(key tiles, Hkv * parts, B)`` dense, ``(key tile bound, Hkv * parts, 1)`` packed.

    Part ``p`` of KV head ``g`` covers query heads ``g * group_size + p * heads_per_program``
    onwards (``heads_per_program`` of them) and writes slice ``p`` of ``DK``/``DV``.
    ``*_strides``: ``(batch, row, head)`` (batch 0 when packed); ``dk_strides``/``dv_strides``
    ``(part, batch, row, head)`` (part 0 when the group is not split); ``lse_strides``,
    ``delta_strides`` and ``alibi_strides`` ``(batch, head)``.
    """
    stride_qb, stride_qs, stride_qh = q_strides[0], q_strides[1], q_strides[2]
    stride_dob, stride_dos, stride_doh = do_strides[0], do_strides[1], do_strides[2]
    batch, n_tile, start_k, seqlen_k, start_q, seqlen_q = _program_sequence(
        CuSeqlensK, CuSeqlensQ, num_seqs, seqlen_k, seqlen_q, BLOCK_N, BLOCK_B, IS_VARLEN)
    parts = group_size // heads_per_program
    kv_head = tl.program_id(1) // parts
    part = tl.program_id(1) % parts
    first_head = kv_head * group_size + part * heads_per_program
    kv_head = kv_head.to(tl.int64)

    start_n = n_tile * BLOCK_N
    offs_k = tl.arange(0, BLOCK_N)
    keys = start_n + offs_k
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + batch * k_strides[0] + start_k * k_strides[1] + kv_head * k_strides[2]
    v_base = V + batch * v_strides[0] + start_k * v_strides[1] + kv_head * v_strides[2]
    k, v = _load_pair(k_base, v_base, start_n, seqlen_k, k_strides[1], v_strides[1], offs_k, offs_d,
                      HEAD_DIM, BLOCK_D, True, DOT_F32)

    # Query tiles that see some key of this tile, [lo, hi), and those whose every row sees every
    # key, [mid_lo, mid_hi): the forward's spans with rows and keys swapped (a key j "at
    # position" j - shift sees rows i with j - right <= i + shift <= j + left).
    causal_shift = seqlen_k - seqlen_q
    left, right = _span_bounds(seqlen_q, seqlen_k, window_left, window_right, CAUSAL, HAS_WINDOW)
    first_key = start_n - causal_shift
    last_key = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1 - causal_shift
    lo, hi = window_span(first_key, last_key, seqlen_q, right, left, BLOCK_M)
    mid_lo, mid_hi = unmasked_run(lo, hi, first_key, last_key, right, left, BLOCK_M)
    if not HAS_WINDOW:
        # Every row past mid_lo sees every key here: no mask up to the end, the last tile
        # partial (rows past seqlen_q are masked in the loads).
        mid_hi = hi

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for h in range(heads_per_program):
        head = (first_head + h).to(tl.int64)
        q_base = Q + batch * stride_qb + start_q * stride_qs + head * stride_qh
        do_base = DOut + batch * stride_dob + start_q * stride_dos + head * stride_doh
        lse_base = Lse + batch * lse_strides[0] + head * lse_strides[1] + start_q
        delta_base = Delta + batch * delta_strides[0] + head * delta_strides[1] + start_q
        if HAS_ALIBI:
            slope = tl.load(Slopes + batch * alibi_strides[0] + head * alibi_strides[1])
            alibi_keys = tl.zeros([BLOCK_N], dtype=tl.float32) + slope * 1.4426950408889634
        else:
            alibi_keys = 0.0
        for start_m in tl.range(lo, hi, BLOCK_M):
            dk, dv = _dkdv_step(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m,
                (start_m < mid_lo) | (start_m >= mid_hi), keys, offs_d,
                seqlen_q, stride_qs, stride_dos, causal_shift, qk_scale,
                window_left, window_right, softcap_in, softcap_out, alibi_keys,
                HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                DOT_F32, DOT_PRECISION, CLAMP_EXP)

    dk = dk * sm_scale
    mask = keys[:, None] < seqlen_k
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    part = part.to(tl.int64)
    rows_k = start_k + keys[:, None].to(tl.int64)
    dk_ptrs = (DK + part * dk_strides[0] + batch * dk_strides[1] + kv_head * dk_strides[3]
               + rows_k * dk_strides[2] + offs_d[None, :])
    dv_ptrs = (DV + part * dv_strides[0] + batch * dv_strides[1] + kv_head * dv_strides[3]
               + rows_k * dv_strides[2] + offs_d[None, :])
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# 3. dQ: one program per query tile
# --------------------------------------------------------------------------------------------


@triton.jit
def _dq_step(
    dq, q, do, lse, delta, k_base, v_base, start_n, masked, row_pos, offs_d,
    seqlen_k, stride_ks, stride_vs, qk_scale,
    window_left, window_right, softcap_in, softcap_out, alibi_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, CLAMP_EXP: tl.constexpr,
):
    """Add one key tile's contribution (keys ``start_n + [0, BLOCK_N)``) to ``dq [BLOCK_M,
    BLOCK_D]``. ``masked`` (runtime, uniform over the program) says the tile may hold keys past
    ``seqlen_k`` (loaded as zeros) or outside a row's causal range or window; only then is the
    mask computed (a missing key's zero row must not meet an infinite ``dS``)."""
    offs_k = tl.arange(0, BLOCK_N)
    keys = start_n + offs_k
    k, v = _load_pair(k_base, v_base, start_n, seqlen_k, stride_ks, stride_vs, offs_k, offs_d,
                      HEAD_DIM, BLOCK_D, True, DOT_F32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [rows, keys]
    if HAS_SOFTCAP or HAS_ALIBI:
        s = modified_scores(qk, row_pos, keys, qk_scale, softcap_in, softcap_out, alibi_rows,
                            HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)
    else:
        s = qk * qk_scale
    p = tl.math.exp2(_exponent(s - lse[:, None], CLAMP_EXP))
    if masked:
        p = tl.where(visible_keys(row_pos, keys, seqlen_k, window_left, window_right, CAUSAL, HAS_WINDOW), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * _softcap_slope(qk, softcap_in)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def _dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, CuSeqlensQ, CuSeqlensK,
    q_strides, k_strides, v_strides, do_strides, lse_strides, delta_strides, dq_strides,
    Slopes, alibi_strides,
    seqlen_q, seqlen_k, num_seqs, group_size, qk_scale, sm_scale,
    window_left, window_right, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_VARLEN: tl.constexpr, BLOCK_B: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CLAMP_EXP: tl.constexpr,
):
    """Grid ``(query tiles, Hq, B)`` dense, ``(query tile bound, Hq, 1)`` packed; with a mask
    the tiles with the most keys are issued first. Strides as in :func:`_dkdv_kernel`."""
    batch, m_tile, start_q, seqlen_q, start_k, seqlen_k = _program_sequence(
        CuSeqlensQ, CuSeqlensK, num_seqs, seqlen_q, seqlen_k, BLOCK_M, BLOCK_B, IS_VARLEN)
    if CAUSAL or HAS_WINDOW:  # programs past the last tile (packed) clamp to 0 and store nothing
        m_tile = tl.maximum(tl.cdiv(seqlen_q, BLOCK_M) - 1 - m_tile, 0)
    head = tl.program_id(1)
    kv_head = (head // group_size).to(tl.int64)
    head = head.to(tl.int64)

    first_row = m_tile * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    rows = first_row + offs_r
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + batch * q_strides[0] + start_q * q_strides[1] + head * q_strides[2]
    do_base = DOut + batch * do_strides[0] + start_q * do_strides[1] + head * do_strides[2]
    k_base = K + batch * k_strides[0] + start_k * k_strides[1] + kv_head * k_strides[2]
    v_base = V + batch * v_strides[0] + start_k * v_strides[1] + kv_head * v_strides[2]
    q, do = _load_pair(q_base, do_base, first_row, seqlen_q, q_strides[1], do_strides[1], offs_r, offs_d,
                       HEAD_DIM, BLOCK_D, True, DOT_F32)
    lse, delta = _load_row_stats(Lse + batch * lse_strides[0] + head * lse_strides[1] + start_q,
                                 Delta + batch * delta_strides[0] + head * delta_strides[1] + start_q,
                                 rows, seqlen_q)
    if HAS_ALIBI:
        slope = tl.load(Slopes + batch * alibi_strides[0] + head * alibi_strides[1])
        alibi_rows = tl.zeros([BLOCK_M], dtype=tl.float32) + slope * 1.4426950408889634
    else:
        alibi_rows = 0.0

    causal_shift = seqlen_k - seqlen_q
    row_pos = rows + causal_shift
    left, right = _span_bounds(seqlen_q, seqlen_k, window_left, window_right, CAUSAL, HAS_WINDOW)
    first_pos = first_row + causal_shift
    last_pos = tl.minimum(first_row + BLOCK_M, seqlen_q) - 1 + causal_shift
    lo, hi = window_span(first_pos, last_pos, seqlen_k, left, right, BLOCK_N)
    mid_lo, mid_hi = unmasked_run(lo, hi, first_pos, last_pos, left, right, BLOCK_N)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in tl.range(lo, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, start_n,
                      (start_n < mid_lo) | (start_n >= mid_hi), row_pos, offs_d,
                      seqlen_k, k_strides[1], v_strides[1], qk_scale,
                      window_left, window_right, softcap_in, softcap_out, alibi_rows,
                      HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
                      DOT_F32, DOT_PRECISION, CLAMP_EXP)

    dq = dq * sm_scale
    mask = rows[:, None] < seqlen_q
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    dq_ptrs = (DQ + batch * dq_strides[0] + head * dq_strides[2]
               + (start_q + rows[:, None].to(tl.int64)) * dq_strides[1] + offs_d[None, :])
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

_launch_delta = Launcher(_delta_kernel)
_launch_sum = Launcher(_sum_kernel)
_launch_sum_parts = Launcher(_sum_parts_kernel)
_launch_dkdv = Launcher(_dkdv_kernel)
_launch_dq = Launcher(_dq_kernel)
SUM_PARTS_ROWS = 32  # rows per program of the split-group sum


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where rows live: dense ``[B, S, H, D]`` (batch chunks of ``MAX_GRID_YZ`` on grid axis 2)
    or packed ``[total, H, D]`` with ``cu_seqlens`` (chunks of ``MAX_VARLEN_SEQS`` sequences,
    batch strides 0, lengths passed as the totals and found per program on the device)."""

    varlen: bool
    batch: int  # batch size, or number of sequences
    seqlen_q: int  # Sq, or total_q
    seqlen_k: int  # Sk, or total_k
    max_seqlen_q: int
    max_seqlen_k: int

    def chunks(self):
        step = MAX_VARLEN_SEQS if self.varlen else MAX_GRID_YZ
        return [(b0, min(self.batch, b0 + step)) for b0 in range(0, self.batch, step)]

    def rows(self, x: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
        """``x`` restricted to a batch chunk (dense), or whole (packed)."""
        return x if self.varlen else x[b0:b1]

    def tiles(self, length: int, max_length: int, block: int, num_seqs: int) -> int:
        """Grid axis 0: tiles per sequence (dense), or a bound on all sequences' tiles (packed)."""
        if not self.varlen:
            return cdiv(length, block)
        return min(length // block + num_seqs, num_seqs * cdiv(max_length, block))

    def cu_seqlens(self, cu: torch.Tensor | None, b0: int, fallback: torch.Tensor) -> torch.Tensor:
        return cu[b0:] if self.varlen else fallback


def _stat_strides(x: torch.Tensor) -> tuple[int, int]:
    """``(batch, head)`` strides of a ``[B, H, S]`` statistic, or ``(0, head)`` of ``[H, total]``
    (rows contiguous)."""
    return (x.stride(0), x.stride(1)) if x.dim() == 3 else (0, x.stride(0))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _slopes_chunk(alibi_slopes, b0: int, b1: int):
    """Per-sequence ``[B, Hq]`` slopes restricted to a chunk; ``[Hq]`` slopes are shared."""
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        return alibi_slopes[b0:b1]
    return alibi_slopes


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
    config: BackwardConfig | None = None,
    dlse: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor | None:
    """Gradients of attention into ``dq, dk, dv``; returns the sinks' gradient (or None).

    Dense: ``q, out, dout, dq [B, Sq, Hq, D]``, ``k, v, dk, dv [B, Sk, Hkv, D]``, ``lse [B,
    Hq, Sq]``. Packed (``cu_seqlens_q/k`` int32 ``[B + 1]`` given): ``q, out, dout, dq
    [total_q, Hq, D]``, ``k, v, dk, dv [total_k, Hkv, D]``, ``lse [Hq, total_q]``;
    ``max_seqlen_*`` bound the grid (default: the totals). ``out`` and ``lse`` (float32,
    natural log, including the sink) are the forward's. The variant arguments are the
    forward's; ``alibi_slopes`` get no gradient. Inputs are validated by the caller.

    ``dq, dk, dv`` are written whole (any strides; one whose last dim is not contiguous goes
    through a temporary). dK/dV of a KV head are summed over its query heads (GQA).
    Returns ``dsinks [Hq]`` float32 when ``sinks`` is given: ``-sum exp(sink - lse) * delta``
    over the rows of every sequence.

    Every launch goes through a :class:`Launcher` and every temporary through
    ``_launch.allocate``, so a recorded call replays whole (``_launch.Recorder``; tested on the
    GPU). The paths that use torch operations instead (empty inputs, non-contiguous last dims)
    are ones a recording cannot identify (no launch, or an unknown address), so they are never
    replayed; nor are batch chunks past the first (views at an offset).

    ``dlse`` (shaped like ``lse``, or None): a gradient flowing into the returned LSE too. Since
    ``d lse_i / d s_ij = P_ij``, it enters as ``delta_i - dlse_i`` (and the sink's share of it
    adds ``sum exp(sink - lse) * dlse`` to the sinks' gradient).

    ``backend``: ``"auto"`` takes the Gluon kernel (``gluon/backward.py``: five products, dQ
    added by TMA reductions) where ``dispatch.backward_backend`` finds it faster, else these
    Triton kernels; ``"triton"`` and ``"gluon"`` force one (``"gluon"`` raises ``ValueError``
    for a call it does not serve). ``deterministic=True`` keeps the Triton kernels, whose results
    are bitwise reproducible (no float atomics); the Gluon kernel's dQ is summed in arrival order.
    """
    varlen = cu_seqlens_q is not None
    interpreted = is_interpreted(_dkdv_kernel)
    head_dim = q.shape[-1]
    num_q_heads = q.shape[-2]
    if varlen:
        seqlen_q, seqlen_k = q.shape[0], k.shape[0]
        layout = _Layout(True, cu_seqlens_q.shape[0] - 1, seqlen_q, seqlen_k,
                         seqlen_q if max_seqlen_q is None else max_seqlen_q,
                         seqlen_k if max_seqlen_k is None else max_seqlen_k)
    else:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        layout = _Layout(False, q.shape[0], seqlen_q, seqlen_k, seqlen_q, seqlen_k)
    if layout.batch == 0 or seqlen_q == 0 or seqlen_k == 0 or num_q_heads == 0 or layout.max_seqlen_q == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return torch.zeros(num_q_heads, dtype=torch.float32, device=q.device) if sinks is not None else None

    chosen = dispatch.backward_backend(backend, q, k, v, dout, (dq, dk, dv), causal=causal, window_size=window_size,
                                       softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, varlen=varlen,
                                       deterministic=deterministic, config=config)
    config = config or pick_config(head_dim, q.dtype, interpreted, causal)
    variant = Variant.of(causal, tuple(window_size), softcap, alibi_slopes, sinks)
    dout, q, k, v, out, lse = (_last_dim_contiguous(x) for x in (dout, q, k, v, out, lse))
    targets = [g if g.stride(-1) == 1 else torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in (dq, dk, dv)]

    dsinks = None
    if chosen == "gluon":  # no sinks there; it computes its own row statistics
        dispatch.gluon_backward_module().gluon_backward(
            dout, q, k, v, out, lse, *targets, causal=causal, softmax_scale=softmax_scale,
            dlse=None if dlse is None else dlse.expand_as(lse))  # broadcast as the Triton path's subtraction
    else:
        delta, dsinks = _delta(out, dout, lse, sinks, layout, config)
        if dlse is not None:
            delta = delta - dlse
            if sinks is not None:
                sink_rows = sinks.float()[:, None] if varlen else sinks.float()[None, :, None]
                dsinks = dsinks + (torch.exp(sink_rows - lse) * dlse).sum(dim=1 if varlen else (0, 2))
        _dkdv(q, k, v, dout, lse, delta, targets[1], targets[2], cu_seqlens_q, cu_seqlens_k, variant,
              softmax_scale, layout, config, interpreted)
        _dq(q, k, v, dout, lse, delta, targets[0], cu_seqlens_q, cu_seqlens_k, variant, softmax_scale, layout,
            config, interpreted)
    for grad, target in zip((dq, dk, dv), targets):
        if grad is not target:
            grad.copy_(target)
    return dsinks


def _delta(out, dout, lse, sinks, layout: _Layout, config: BackwardConfig):
    """``delta`` (``[B, Hq, Sq]`` / ``[Hq, total_q]`` float32) and the sinks' gradient."""
    num_q_heads, head_dim = out.shape[-2], out.shape[-1]
    stat_shape = (num_q_heads, layout.seqlen_q) if layout.varlen else (layout.batch, num_q_heads, layout.seqlen_q)
    delta = allocate(stat_shape, torch.float32, out.device)
    block_m = config.delta_block_m
    tiles = cdiv(layout.seqlen_q, block_m)
    batch_grid = 1 if layout.varlen else layout.batch
    parts = allocate((num_q_heads, batch_grid, tiles), torch.float32, out.device) if sinks is not None else delta
    for b0, b1 in [(0, 1)] if layout.varlen else layout.chunks():
        rows = functools.partial(layout.rows, b0=b0, b1=b1)
        _launch_delta(
            (tiles, num_q_heads, b1 - b0),
            rows(out), rows(dout), rows(lse), rows(delta), sinks if sinks is not None else out,
            parts[:, b0:b1] if sinks is not None else parts,
            o_strides=_strides3(out), do_strides=_strides3(dout), lse_strides=_stat_strides(lse),
            delta_strides=_stat_strides(delta),
            parts_strides=(parts.stride(0), parts.stride(1)) if sinks is not None else (0, 0),
            sink_stride=sinks.stride(0) if sinks is not None else 0, seqlen=layout.seqlen_q,
            HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=block_m, HAS_SINKS=sinks is not None,
            num_warps=4, num_stages=1,
        )
    if sinks is None:
        return delta, None
    dsinks = allocate((num_q_heads,), torch.float32, out.device)
    _launch_sum((num_q_heads,), parts, dsinks, batch_grid * tiles, BLOCK=1024, num_warps=4, num_stages=1)
    return delta, dsinks


def _variant_args(variant: Variant, alibi_slopes, softmax_scale: float, layout: _Layout, unused) -> dict:
    """The variant's kernel arguments without the sinks (only the delta kernel reads them)."""
    args = dataclasses.replace(variant, alibi_slopes=alibi_slopes, sinks=None).kernel_args(
        softmax_scale, layout.seqlen_q, layout.seqlen_k, unused=unused)
    for name in ("Sinks", "sink_stride", "HAS_SINKS"):
        del args[name]
    return args


def _dkdv(q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, variant: Variant, softmax_scale: float,
          layout: _Layout, config: BackwardConfig, interpreted: bool) -> None:
    """Launch the dK/dV kernel; with a split group, into float32 slices then summed."""
    num_q_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    group = num_q_heads // num_kv_heads
    tile = config.dkdv
    key_tiles = layout.tiles(layout.seqlen_k, layout.max_seqlen_k, tile.block_n, layout.batch)
    parts = config.group_split
    if parts is None:
        programs = key_tiles * num_kv_heads * (1 if layout.varlen else layout.batch)
        parts = pick_group_split(group, programs, q.device, interpreted)
    if group % parts:
        raise ValueError(f"group_split={parts} must divide the GQA group size {group} "
                         f"({num_q_heads} query heads over {num_kv_heads} KV heads)")
    if parts > 1:
        dk_out = allocate((parts, *dk.shape), torch.float32, dk.device)
        dv_out = allocate((parts, *dv.shape), torch.float32, dv.device)
    else:
        dk_out, dv_out = dk[None], dv[None]
    dk_strides = (dk_out.stride(0) if parts > 1 else 0, *_strides3(dk_out[0]))
    dv_strides = (dv_out.stride(0) if parts > 1 else 0, *_strides3(dv_out[0]))
    for b0, b1 in layout.chunks():
        num_seqs = b1 - b0
        grid = (layout.tiles(layout.seqlen_k, layout.max_seqlen_k, tile.block_n, num_seqs), num_kv_heads * parts,
                1 if layout.varlen else num_seqs)
        if grid[0] == 0:
            continue
        rows = functools.partial(layout.rows, b0=b0, b1=b1)
        _launch_dkdv(
            grid, rows(q), rows(k), rows(v), rows(dout), rows(lse), rows(delta),
            dk_out if layout.varlen else dk_out[:, b0:b1], dv_out if layout.varlen else dv_out[:, b0:b1],
            layout.cu_seqlens(cu_seqlens_q, b0, q), layout.cu_seqlens(cu_seqlens_k, b0, q),
            **_kernel_tail(q, k, v, dout, lse, delta, variant, _slopes_chunk(variant.alibi_slopes, b0, b1),
                           softmax_scale, layout, num_seqs, group, tile, interpreted),
            dk_strides=dk_strides, dv_strides=dv_strides, heads_per_program=group // parts,
        )
    if parts > 1:
        for target, summed in ((dk, dk_out), (dv, dv_out)):
            grid = (cdiv(target.shape[-3], SUM_PARTS_ROWS), num_kv_heads, 1 if layout.varlen else target.shape[0])
            _launch_sum_parts(grid, summed, target, (summed.stride(0), *_strides3(summed[0])), _strides3(target),
                              target.shape[-3], parts, HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
                              BLOCK_R=SUM_PARTS_ROWS, num_warps=4, num_stages=1)


def _dq(q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, variant: Variant, softmax_scale: float,
        layout: _Layout, config: BackwardConfig, interpreted: bool) -> None:
    """Launch the dQ kernel."""
    num_q_heads = q.shape[-2]
    group = num_q_heads // k.shape[-2]
    tile = config.dq
    for b0, b1 in layout.chunks():
        num_seqs = b1 - b0
        grid = (layout.tiles(layout.seqlen_q, layout.max_seqlen_q, tile.block_m, num_seqs), num_q_heads,
                1 if layout.varlen else num_seqs)
        if grid[0] == 0:
            continue
        rows = functools.partial(layout.rows, b0=b0, b1=b1)
        _launch_dq(
            grid, rows(q), rows(k), rows(v), rows(dout), rows(lse), rows(delta), rows(dq),
            layout.cu_seqlens(cu_seqlens_q, b0, q), layout.cu_seqlens(cu_seqlens_k, b0, q),
            **_kernel_tail(q, k, v, dout, lse, delta, variant, _slopes_chunk(variant.alibi_slopes, b0, b1),
                           softmax_scale, layout, num_seqs, group, tile, interpreted),
            dq_strides=_strides3(dq),
        )


def _kernel_tail(q, k, v, dout, lse, delta, variant: Variant, alibi_slopes, softmax_scale: float, layout: _Layout,
                 num_seqs: int, group: int, tile: TileConfig, interpreted: bool) -> dict:
    """The named arguments shared by the dK/dV and dQ launches."""
    mods = _variant_args(variant, alibi_slopes, softmax_scale, layout, unused=q)
    head_dim = q.shape[-1]
    return dict(
        q_strides=_strides3(q), k_strides=_strides3(k), v_strides=_strides3(v), do_strides=_strides3(dout),
        lse_strides=_stat_strides(lse), delta_strides=_stat_strides(delta),
        seqlen_q=layout.seqlen_q, seqlen_k=layout.seqlen_k, num_seqs=num_seqs, group_size=group,
        qk_scale=softmax_scale * LOG2E, sm_scale=softmax_scale,
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        IS_VARLEN=layout.varlen, BLOCK_B=max(16, next_power_of_2(num_seqs)) if layout.varlen else 1,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        CLAMP_EXP=exact_exponent(softmax_scale),
        **mods, **dot_flags(q.dtype, interpreted), **exponent_options(softmax_scale),
    )
