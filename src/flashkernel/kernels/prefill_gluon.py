"""Prefill forward in Gluon for Hopper (sm_90a): a FlashAttention-3-style prototype.

Why: the Triton kernel (``prefill.py``) plateaus at ~535 TFLOP/s at head dim 128 because one
CTA per SM runs softmax and wgmma in the same warps, one after the other (docs/perf-notes.md,
"Toward cuDNN"). Gluon (``triton.experimental.gluon``, Triton 3.6) exposes what is needed to
overlap them: warp-specialized partitions, mbarriers, TMA and asynchronous wgmma.

Design (one CTA = one 128-row query tile of one (batch, head); 3 warpgroups, 384 threads):

* **Producer partition** (1 warp, 24 registers): loads the two 64-row Q halves once, then
  streams K and V tiles of ``BLOCK_N`` keys into a ``STAGES``-deep shared-memory ring. K and V
  have separate rings (``ready``/``empty`` mbarrier pairs per stage), so K of tile j+1 can land
  while V of tile j is still being read.
* **Two consumer partitions** (the default partition and one 4-warp worker, 240 registers each):
  consumer ``c`` owns query rows ``[64 c, 64 c + 64)`` of the tile and sees every K/V tile (each
  ``empty`` barrier expects 2 arrivals). Per tile: ``S = Q K^T`` with async wgmma (Q and K from
  shared memory), online softmax in fp32 with ``exp2`` (``softmax_scale * log2(e)`` folded into
  one multiply and fused with the max subtraction), ``P`` cast to bf16/fp16 and kept in
  registers as wgmma's A operand (the accumulator layout of ``S`` is the A-operand layout, so
  the conversion moves no data), ``O += P V`` with async wgmma accumulating in registers.
  At head dim 128 that is 64 (S) + 64 (O) + 32 (P) 32-bit registers per thread.
* **Overlap** (constexpr switches, ``GluonConfig``):
  ``PIPELINE`` (intra-warpgroup, FA3 §3.2; on by default): issue ``S_j = Q K_j^T`` and
  ``O += P_{j-1} V_{j-1}`` back to back, wait only for ``S_j``, do the softmax of tile j while
  ``P_{j-1} V_{j-1}`` runs on the tensor cores, then wait for it and rescale O. ptxas hoists
  ``wgmma.wait_group`` above independent ALU work, which would undo this; ``_schedule_fence``
  keeps the softmax above the wait (``benchmarks/tools/gluon_check.py --compile-only`` counts
  the exp2 between the two waits in the SASS: 66 per tile at d128, all of them).
  Without ``PIPELINE`` the loop is QK^T, wait, softmax, PV, wait (the simplest version).
  ``PINGPONG`` (inter-warpgroup, FA3 §3.1, needs ``PIPELINE``): the two consumers take turns
  issuing their GEMMs through a pair of mbarriers, so one warpgroup's softmax runs while the
  other's GEMMs occupy the tensor cores. Without it the two warpgroups still interleave
  through the warp schedulers, just without an enforced order.
* **Masks**: key tiles past the causal diagonal are never loaded; tiles entirely below it and
  inside ``seqlen_k`` run without masks; the others (the diagonal band and the last, partial
  tile) mask keys ``>= seqlen_k`` and, with ``causal``, keys ``> i + seqlen_k - seqlen_q`` to
  ``-inf`` (a warp-uniform branch on the tile index). A row that sees no key keeps
  ``m = -inf``; the exponent uses ``m = 0`` there, so it ends with ``l = 0``: output 0 and LSE
  ``-inf``. Every program visits at least one key tile, so a tile of such rows still writes.
* **Bounds**: every TMA descriptor is rank 4 over the tensor as given, ``[B, S, H, D]`` with
  its strides and box ``[1, rows, 1, D]``: rows past ``S`` are zero-filled on load and dropped on
  store *per (batch, head)*, so no tile ever touches another batch's or head's rows (a 2-D
  descriptor over a flattened ``[B*S, ...]`` view would).
* **Schedule**: a 1-D grid of ``m_tiles * Hq * B`` programs. Without ``causal`` the query tiles
  of one head are adjacent (they share K/V in L2); with ``causal`` the longest tiles (most keys)
  are issued first across all heads, so the short ones fill the tail.

Tile shapes per head dim (``CONFIGS``; shared memory = Q 2x64xD + STAGES x (K + V) BLOCK_N x D):
d64: BLOCK_N 128, 3 stages (112 KB); d128: 128, 2 stages (160 KB); d256: 64, 2 stages (192 KB).

Next steps (not done here): a persistent grid with a tile scheduler (causal tails, descriptor
prefetch), an ``O`` store through a separate buffer so the next tile's Q can load early,
``BLOCK_N`` 176 at d128 / 3 consumer warpgroups at d64 as FA3, skipping the O rescale when the
row max does not move, fewer partition barriers (each ``mbarrier.arrive``/``wait`` in a
4-warp partition comes with a ``bar.sync`` of the warpgroup: 4 per tile), and building the
descriptors once per shape (each call encodes four ``CUtensorMap`` on the host).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = math.log2(math.e)
WG_ROWS = 64  # query rows per consumer warpgroup (the wgmma M of one warpgroup)
NUM_CONSUMERS = 2
BLOCK_M = WG_ROWS * NUM_CONSUMERS  # query rows per program
_WG = gl.constexpr(WG_ROWS)  # the same numbers, usable inside kernels
_BM = gl.constexpr(BLOCK_M)
HEAD_DIMS = (64, 128, 256)
TORCH_TO_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    block_n: int
    stages: int
    pipeline: bool = True
    pingpong: bool = False
    consumer_regs: int = 240
    producer_regs: int = 24


CONFIGS = {
    64: GluonConfig(block_n=128, stages=3),
    128: GluonConfig(block_n=128, stages=2),
    256: GluonConfig(block_n=64, stages=2),
}


# ---- layouts -----------------------------------------------------------------------------------


@gluon.constexpr_function
def wgmma_layout(n):
    """Accumulator layout of one warpgroup's ``[64, n]`` wgmma (instruction m16 x n x k16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def tile_layout(rows, head_dim, dtype):
    """Shared layout of a ``[1, rows, 1, head_dim]`` TMA box (rank 4, widest swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], dtype)


# ---- pieces shared by the partitions --------------------------------------------------------------


@gluon.jit
def _ring_slot(j, STAGES: gl.constexpr):
    """Stage index and mbarrier parity of the ``j``-th use of a ``STAGES``-deep ring."""
    return j % STAGES, (j // STAGES) & 1


@gluon.jit
def _as_matrix(buf):
    """View a ``[1, rows, 1, D]`` shared tile (a TMA box) as the ``[rows, D]`` wgmma operand."""
    return buf.reshape([buf.shape[1], buf.shape[3]])


@gluon.jit
def _key_tiles(row0, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tiles of the query tile starting at ``row0``: ``(n_tiles, unmasked)``.

    Tiles ``[0, unmasked)`` need no mask; ``[unmasked, n_tiles)`` do. At least one tile is
    visited (a tile whose rows all see nothing then runs fully masked and writes 0 / -inf).
    """
    shift = seqlen_k - seqlen_q  # row i sees keys j <= i + shift
    if CAUSAL:
        end = gl.minimum(seqlen_k, gl.minimum(row0 + _BM, seqlen_q) + shift)
        full = gl.minimum(seqlen_k, row0 + 1 + shift)
    else:
        end = seqlen_k
        full = seqlen_k
    n_tiles = gl.maximum(gl.cdiv(gl.maximum(end, 0), BLOCK_N), 1)
    unmasked = gl.maximum(full, 0) // BLOCK_N
    return n_tiles, unmasked


@gluon.jit
def _program_tile(seqlen_q, num_heads, batch, CAUSAL: gl.constexpr):
    """``(batch index, head, first query row)`` of this program (see the module docstring)."""
    pid = gl.program_id(0)
    num_m_tiles = gl.cdiv(seqlen_q, _BM)
    num_bh = num_heads * batch
    if CAUSAL:
        m_tile = num_m_tiles - 1 - pid // num_bh
        bh = pid % num_bh
    else:
        m_tile = pid % num_m_tiles
        bh = pid // num_m_tiles
    return bh // num_heads, bh % num_heads, m_tile * (_BM)


# ---- producer ---------------------------------------------------------------------------------


@gluon.jit
def _load_tile(desc, coords, bar, dst):
    """One TMA box into ``dst``, completing on ``bar`` (the full box counts, zero fill included)."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, coords, bar, dst)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars,
              seqlen_q, seqlen_k, num_heads, group_size, batch,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """TMA warp: Q halves once, then K/V tiles through the rings (waits on ``empty``)."""
    q_ready, k_ready, k_empty, v_ready, v_empty = bars
    b, head, row0 = _program_tile(seqlen_q, num_heads, batch, CAUSAL)
    kv_head = head // group_size
    n_tiles, _ = _key_tiles(row0, seqlen_q, seqlen_k, BLOCK_N, CAUSAL)

    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [b, row0 + c * _WG, head, 0], q_ready, q_bufs.index(c))
    for j in range(n_tiles):
        slot, phase = _ring_slot(j, STAGES)
        # A fresh mbarrier counts as having completed the phase before phase 0, so the first
        # pass through the ring (parity 1) does not wait.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        _load_tile(k_desc, [b, j * BLOCK_N, kv_head, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        _load_tile(v_desc, [b, j * BLOCK_N, kv_head, 0], v_ready.index(slot), v_bufs.index(slot))


# ---- consumers --------------------------------------------------------------------------------


@gluon.jit
def _issue_qk(q_smem, k_bufs, k_ready, j, STAGES: gl.constexpr, s_layout: gl.constexpr):
    """Wait for K tile ``j`` and issue ``S = Q K^T`` asynchronously; returns the wgmma token."""
    slot, phase = _ring_slot(j, STAGES)
    mbarrier.wait(k_ready.index(slot), phase)
    k_smem = _as_matrix(k_bufs.index(slot))
    rows: gl.constexpr = q_smem.shape[0]
    cols: gl.constexpr = k_smem.shape[0]
    s0 = gl.zeros([rows, cols], gl.float32, s_layout)
    return warpgroup_mma(q_smem, k_smem.permute((1, 0)), s0, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(p, v_bufs, v_ready, acc, j, STAGES: gl.constexpr):
    """Wait for V tile ``j`` and issue ``acc += P V`` asynchronously (P from registers)."""
    slot, phase = _ring_slot(j, STAGES)
    mbarrier.wait(v_ready.index(slot), phase)
    return warpgroup_mma(p, _as_matrix(v_bufs.index(slot)), acc, is_async=True)


@gluon.jit
def _release(empty, j, STAGES: gl.constexpr):
    """Tell the producer this warpgroup is done with ring use ``j``."""
    mbarrier.arrive(empty.index(j % STAGES))


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, unmasked, rows, seqlen_k, shift, qk_scale,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Online-softmax step on scores ``s [64, BLOCK_N]`` (fp32, unscaled) of key tile ``j``.

    ``m_i``, ``l_i`` ``[64]``: running max (scaled, log2 units) and sum. Returns ``(p, m_new,
    l_new, alpha)`` with ``p = exp2(s * qk_scale - m_new)`` and ``alpha = exp2(m_i - m_new)``
    the factor for the accumulator.
    """
    s_layout: gl.constexpr = s.type.layout
    if j >= unmasked:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols < seqlen_k, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1))
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_new, alpha


@gluon.jit
def _rescale(acc, alpha):
    """``acc * alpha[:, None]`` with alpha moved to the accumulator's row layout (no data moves)."""
    row_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    return acc * gl.expand_dims(gl.convert_layout(alpha, row_layout), 1)


@gluon.jit
def _as_a_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr):
    """``p`` cast to the input dtype in wgmma's register A-operand layout for ``O += P V``."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    return gl.convert_layout(p.to(dtype), a_layout)


@gluon.jit
def _take_turn(turn_bars, me: gl.constexpr, round):
    """Ping-pong: wait until it is consumer ``me``'s turn to issue GEMMs in ``round``.

    Consumer 0 goes first: its round 0 waits on parity 1 of a fresh barrier (passes at once);
    every later round waits for the other consumer's previous round.
    """
    mbarrier.wait(turn_bars.index(me), (round & 1) ^ (1 - me))


@gluon.jit
def _pass_turn(turn_bars, me: gl.constexpr):
    mbarrier.arrive(turn_bars.index(1 - me))


@gluon.jit
def _loop_simple(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                 n_tiles, unmasked, rows, seqlen_k, shift, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """Key loop without cross-tile overlap: QK^T, wait, softmax, PV, wait. Returns acc, m, l."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([_WG], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([_WG], gl.float32, row_layout)
    acc = gl.zeros([_WG, HEAD_DIM], gl.float32, o_layout)
    for j in range(n_tiles):
        s = _issue_qk(q_smem, k_bufs, k_ready, j, STAGES, s_layout)
        s = warpgroup_mma_wait(0, deps=(s,))
        _release(k_empty, j, STAGES)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, unmasked, rows, seqlen_k, shift, qk_scale,
                                           BLOCK_N, CAUSAL)
        acc = _rescale(acc, alpha)
        acc = _issue_pv(_as_a_operand(p, q_smem.dtype, o_layout), v_bufs, v_ready, acc, j, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _release(v_empty, j, STAGES)
    return acc, m_i, l_i


@gluon.jit
def _schedule_fence(done_bar):
    """Keep the softmax above the next ``warpgroup_mma_wait``.

    ptxas schedules ``wgmma.wait_group`` as early as it may, so without this the whole softmax
    of tile j sinks below the wait for ``P_{j-1} V_{j-1}`` and nothing overlaps (seen in the
    SASS of every specialization). Waiting on an mbarrier whose phase completed long ago
    (``q_ready``) costs one non-blocking try-wait, but its retry loop ends the basic block,
    which ptxas does not schedule across.
    """
    mbarrier.wait(done_bar, 0)


@gluon.jit
def _loop_pipelined(q_smem, q_ready, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars,
                    n_tiles, unmasked, rows, seqlen_k, shift, qk_scale,
                    ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    """Key loop with the softmax of tile j overlapping ``P_{j-1} V_{j-1}`` (see the module
    docstring). Returns acc, m, l."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    # Prologue: tile 0's scores and probabilities; O starts at 0, so no rescale.
    s = _issue_qk(q_smem, k_bufs, k_ready, 0, STAGES, s_layout)
    s = warpgroup_mma_wait(0, deps=(s,))
    _release(k_empty, 0, STAGES)
    m_i = gl.full([_WG], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([_WG], gl.float32, row_layout)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, unmasked, rows, seqlen_k, shift, qk_scale,
                                       BLOCK_N, CAUSAL)
    p_op = _as_a_operand(p, dtype, o_layout)
    acc = gl.zeros([_WG, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_tiles):
        if PINGPONG:
            _take_turn(turn_bars, ME, j - 1)
        s = _issue_qk(q_smem, k_bufs, k_ready, j, STAGES, s_layout)
        acc = _issue_pv(p_op, v_bufs, v_ready, acc, j - 1, STAGES)
        if PINGPONG:
            _pass_turn(turn_bars, ME)
        s = warpgroup_mma_wait(1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may still run
        _release(k_empty, j, STAGES)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, unmasked, rows, seqlen_k, shift, qk_scale,
                                           BLOCK_N, CAUSAL)
        _schedule_fence(q_ready)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _release(v_empty, j - 1, STAGES)
        acc = _rescale(acc, alpha)
        p_op = _as_a_operand(p, dtype, o_layout)

    acc = _issue_pv(p_op, v_bufs, v_ready, acc, n_tiles - 1, STAGES)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    _release(v_empty, n_tiles - 1, STAGES)
    return acc, m_i, l_i


@gluon.jit
def _write_results(acc, m_i, l_i, o_desc, o_buf, Lse, stride_lb, stride_lh, stride_ls,
                   b, head, row0, rows, seqlen_q, WRITE_LSE: gl.constexpr):
    """``O = acc / l`` through shared memory and one TMA store (rows >= seqlen_q are dropped by
    the descriptor's bounds); LSE (natural log) with a masked store."""
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    o_layout: gl.constexpr = acc.type.layout
    inv_l = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
    out = (acc * gl.expand_dims(inv_l, 1)).to(o_desc.dtype)
    _as_matrix(o_buf).store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, row0, head, 0], o_buf)
    if WRITE_LSE:
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        ptrs = Lse + b.to(gl.int64) * stride_lb + head.to(gl.int64) * stride_lh + rows.to(gl.int64) * stride_ls
        gl.store(ptrs, lse, mask=rows < seqlen_q)
    tma.store_wait(0)


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, bars, turn_bars, o_desc, Lse,
              stride_lb, stride_lh, stride_ls,
              seqlen_q, seqlen_k, num_heads, batch, qk_scale,
              ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr,
              PIPELINE: gl.constexpr, PINGPONG: gl.constexpr):
    """Consumer warpgroup ``ME``: query rows ``[row0 + 64 ME, row0 + 64 ME + 64)`` of the tile."""
    q_ready, k_ready, k_empty, v_ready, v_empty = bars
    b, head, tile_row0 = _program_tile(seqlen_q, num_heads, batch, CAUSAL)
    n_tiles, unmasked = _key_tiles(tile_row0, seqlen_q, seqlen_k, BLOCK_N, CAUSAL)
    row0 = tile_row0 + ME * _WG
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    rows = row0 + gl.arange(0, _WG, layout=gl.SliceLayout(1, s_layout))
    shift = seqlen_k - seqlen_q

    q_buf = q_bufs.index(ME)
    mbarrier.wait(q_ready, 0)
    if PIPELINE:
        acc, m_i, l_i = _loop_pipelined(_as_matrix(q_buf), q_ready, k_bufs, v_bufs, k_ready, k_empty,
                                        v_ready, v_empty, turn_bars, n_tiles, unmasked, rows, seqlen_k, shift, qk_scale,
                                        ME, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG)
    else:
        acc, m_i, l_i = _loop_simple(_as_matrix(q_buf), k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                     n_tiles, unmasked, rows, seqlen_k, shift, qk_scale,
                                     HEAD_DIM, BLOCK_N, STAGES, CAUSAL)
    # Q is dead once the last S was waited for: its buffer stages this warpgroup's output.
    _write_results(acc, m_i, l_i, o_desc, q_buf, Lse, stride_lb, stride_lh, stride_ls,
                   b, head, row0, rows, seqlen_q, WRITE_LSE)


# ---- kernel -----------------------------------------------------------------------------------


@gluon.jit
def _alloc_barriers(count: gl.constexpr, arrivals: gl.constexpr):
    """``count`` mbarriers, each completing a phase after ``arrivals`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(bars.index(i), count=arrivals)
    return bars


# Lengths, head counts and LSE strides change between calls; specializing on them (== 1, % 16)
# would compile one kernel per shape, and they only feed scalar index math.
@gluon.jit(do_not_specialize=["stride_lb", "stride_lh", "stride_ls", "seqlen_q", "seqlen_k", "num_heads",
                              "group_size", "batch"])
def _gluon_attention_kernel(
    q_desc, k_desc, v_desc, o_desc, Lse,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, num_heads, group_size, batch, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, PIPELINE: gl.constexpr, PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Grid ``(m_tiles * Hq * B,)``, 4 warps (+ 4 consumer + 1 producer warps in the partitions).

    Descriptors: q/o ``[B, Sq, Hq, D]`` box ``[1, 64, 1, D]``; k/v ``[B, Sk, Hkv, D]`` box
    ``[1, BLOCK_N, 1, D]``. ``Lse`` fp32 ``[B, Hq, Sq]`` (strides given) when ``WRITE_LSE``.
    """
    gl.static_assert(not PINGPONG or PIPELINE, "PINGPONG needs PIPELINE")
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = _alloc_barriers(1, 1).index(0)
    k_ready = _alloc_barriers(STAGES, 1)
    v_ready = _alloc_barriers(STAGES, 1)
    k_empty = _alloc_barriers(STAGES, 2)  # both consumers release each stage
    v_empty = _alloc_barriers(STAGES, 2)
    turn_bars = _alloc_barriers(2, 1)
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before first use
    bars = (q_ready, k_ready, k_empty, v_ready, v_empty)

    gl.warp_specialize([
        (_consumer, (q_bufs, k_bufs, v_bufs, bars, turn_bars, o_desc, Lse, stride_lb, stride_lh, stride_ls,
                     seqlen_q, seqlen_k, num_heads, batch, qk_scale,
                     0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, PIPELINE, PINGPONG)),
        (_consumer, (q_bufs, k_bufs, v_bufs, bars, turn_bars, o_desc, Lse, stride_lb, stride_lh, stride_ls,
                     seqlen_q, seqlen_k, num_heads, batch, qk_scale,
                     1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, PIPELINE, PINGPONG)),
        (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars,
                     seqlen_q, seqlen_k, num_heads, group_size, batch, BLOCK_N, STAGES, CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ---- host side --------------------------------------------------------------------------------


def _tma_ok(x: torch.Tensor) -> bool:
    """TMA: 16-byte aligned base and strides, last dim contiguous."""
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        return False
    return all((s * x.element_size()) % 16 == 0 for s in x.stride()[:-1])


def gluon_available() -> bool:
    """A Hopper (sm_90) GPU is present: wgmma exists on sm_90a only (not on Blackwell)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`gluon_attention_forward` handles these inputs (shapes as in its docstring)."""
    if not (q.is_cuda and k.device == q.device and v.device == q.device):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in TORCH_TO_GL or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS or k.shape[-1] != head_dim or q.shape[0] != k.shape[0]:
        return False
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return False
    if min(q.shape[0], q.shape[1], k.shape[1]) < 1:
        return False
    return all(_tma_ok(x) for x in (q, k, v))


def make_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """Rank-4 TMA descriptor over ``x [B, S, H, D]`` with box ``[1, rows, 1, D]``."""
    block = [1, rows, 1, x.shape[3]]
    layout = tile_layout(rows, x.shape[3], TORCH_TO_GL[x.dtype])
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def launch_args(q, k, v, out, lse, causal: bool, softmax_scale: float, config: GluonConfig):
    """``(grid, args, kwargs)`` of one launch (also used to compile without a GPU)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    lse_arg = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    grid = (triton.cdiv(seqlen_q, BLOCK_M) * num_heads * batch,)
    args = (make_descriptor(q, WG_ROWS), make_descriptor(k, config.block_n), make_descriptor(v, config.block_n),
            make_descriptor(out, WG_ROWS), lse_arg, *lse_strides,
            seqlen_q, seqlen_k, num_heads, num_heads // num_kv_heads, batch, softmax_scale * LOG2E)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_N=config.block_n, STAGES=config.stages, CAUSAL=causal,
                  WRITE_LSE=lse is not None, PIPELINE=config.pipeline, PINGPONG=config.pingpong,
                  CONSUMER_REGS=config.consumer_regs, PRODUCER_REGS=config.producer_regs)
    return grid, args, kwargs


# Registers: 3 warpgroups share 64K, so the launch limit is 168 per thread (65536 / 384, rounded
# down to a multiple of 8); the partitions then move them with setmaxnreg (240 + 240 + 24 = 504
# = 3 x 168).
MAXNREG = 168


def gluon_attention_forward(q, k, v, out, lse, *, causal: bool, softmax_scale: float,
                            config: GluonConfig | None = None) -> None:
    """Attention forward with the Gluon kernel into ``out`` (and ``lse`` unless None).

    Args:
        q: ``[B, Sq, Hq, D]`` bf16/fp16; k, v: ``[B, Sk, Hkv, D]``, ``Hq % Hkv == 0``; D in
            64/128/256; last dim contiguous, base and strides 16-byte aligned (:func:`supported`).
        out: like q (written); lse: fp32 ``[B, Hq, Sq]`` or None.
        causal: bottom-right aligned mask (query i sees keys j <= i + Sk - Sq).
        softmax_scale: scale of ``q k^T``.
        config: tile shape and overlap switches (default: ``CONFIGS[D]``).
    """
    if not supported(q, k, v) or out.shape != q.shape or out.dtype != q.dtype or not _tma_ok(out):
        raise ValueError("inputs not supported by the Gluon prefill kernel (see prefill_gluon.supported)")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (q.shape[0], q.shape[2], q.shape[1])):
        raise ValueError(f"lse must be float32 [B, Hq, Sq], got {lse.dtype} {tuple(lse.shape)}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")
    config = config or CONFIGS[q.shape[-1]]
    grid, args, kwargs = launch_args(q, k, v, out, lse, causal, softmax_scale, config)
    with torch.cuda.device(q.device):
        _gluon_attention_kernel[grid](*args, **kwargs, num_warps=4, maxnreg=MAXNREG)
