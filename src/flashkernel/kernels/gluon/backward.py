"""Attention backward in Gluon for Hopper (sm_90a): five products per tile, dQ reduced by TMA.

Why: the Triton backward (``kernels/backward.py``) runs seven matrix products per pair of tiles
(a dK/dV kernel with four, a dQ kernel that recomputes ``S`` and ``dP`` for its third) with no
warp specialization, and reaches 0.65-0.87x of cuDNN's backward (docs/perf-notes.md,
"Backward"). Folding dQ into the dK/dV kernel with Triton's atomics or TMA reductions was
slower, because the fifth product and its reduction ran in series with the other four in the
same warps. Here a producer warp streams the query-side tiles and two consumer warpgroups issue
the products asynchronously (FlashAttention 3's structure).

Design (a tile = ``2 x 64`` keys of one (KV head, batch); 2 consumer warpgroups and a producer
warp per CTA):

* **Tiles**: the CTAs are persistent, one per SM: each takes tiles from a counter in the order
  a grid of one CTA per tile would run them (key tiles fastest, so the CTAs running at once
  share their query heads' Q/dO in L2), and the next tile's K/V, Q and dO load while the
  consumers store the previous tile's dK/dV. Causal at 1k keys this took 4-6% off the kernel
  (the fixed cost of a CTA, ~3.7 us, is a fifth of its time there at head dim 64), elsewhere
  at most 4%. The consumers rebuild their K/V views in every step (:func:`_kv_views`):
  otherwise the K/V wgmma descriptors stay live across the tile loop and ptxas spills them at
  head dim 128. Other tile orders: docs/perf-notes.md, "Tried and reverted".
* **Producer** (1 warp): loads the tile's K and V once, then for every query head of the
  GQA group and every query tile of 64 rows that sees the keys, Q, dO and the rows' statistics
  (``lse * log2 e`` and ``delta``, written beforehand by :func:`_row_stats_kernel`) into a
  ``STAGES``-deep ring (``ready``/``empty`` mbarrier pairs; each ``empty`` expects both
  consumers). The consumers read the statistics from shared memory after each product they
  feed has completed, so that the 32 values per thread are not live across the products: at
  head dim 128 with global loads ptxas spilled ~0.8 KB inside the loop.
* **Consumer** ``c`` owns keys ``[64 c, 64 c + 64)`` of the tile and keeps ``dK``, ``dV``
  ``[64, D]`` (float32) in registers. Per query tile it issues ``S^T = K_c Q^T`` and
  ``dP^T = V_c dO^T`` back to back, computes ``P^T = exp2(S^T * scale * log2 e - lse * log2
  e)`` while ``dP^T`` runs, then ``dS^T = P^T (dP^T - delta)``, and issues ``dV += P^T dO``
  and ``dK += dS^T Q`` with ``P^T`` and ``dS^T`` as register operands (nothing in registers
  is transposed: the tiles are transposed from the start).
* **dQ** (the fifth product): each consumer also writes its ``dS^T`` rows, in the input dtype,
  into a shared ``[128, 64]`` buffer (two buffers, alternating by step); after both have
  written (an mbarrier with two arrivals) ``dQ_tile = dS K`` runs over all 128 keys:
  ``SPLIT_COLS`` (head dim 128) gives consumer ``c`` columns ``[c D/2, (c + 1) D/2)`` of it,
  otherwise (head dim 64) one consumer takes the whole tile, alternating by step. The tile is
  added to a float32 accumulator ``[B, Hq, Sq_pad, D]`` by a TMA reduction
  (``cp.reduce.async.bulk.tensor ... add``), which a small kernel scales and casts into ``dq``.
  Float additions in arrival order: the gradients are not bitwise reproducible run to run
  (``deterministic=True`` takes the Triton kernels).
* **Masks**: ``lse`` of rows past ``Sq`` (and of rows that see no key, ``-inf``) is read as
  ``+inf``, so their ``P`` is 0 with no mask; a step whose tiles the causal diagonal crosses or
  whose keys run past ``Sk`` masks ``P`` (keys past ``Sk`` are zero-filled by TMA, so their
  ``S`` is 0 and ``exp2(-lse)`` could overflow for a row of very negative scores). Query tiles
  entirely above the diagonal are not visited.
* **Bounds**: Q, dO, K and V are read through rank-4 descriptors over ``[B, S, H, D]`` (box
  ``[1, rows, 1, D]``): rows past ``S`` are zero-filled per (batch, head). dK and dV leave the
  same way: after the last step (both consumers meet at ``done``, which also frees K/V for the
  producer) each consumer stages dK in its dQ tile and dV in the dS buffer of its own parity,
  and TMA stores them, dropping rows past ``Sk`` (masked register stores of 2 bytes each were a
  quarter of the consumers' time at 1k keys in a profile); they meet again at ``stored`` before
  the next tile writes dS rows.

Head dims 64 and 128, bf16/fp16, dense (not packed) inputs, no window, softcap, ALiBi or sinks;
everything else takes the Triton kernels (:func:`supported`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
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
from triton.language.core import builtin

from .._common import cdiv, tma_aligned
from .._launch import Launcher, allocate
from ..prefill import MAX_GRID_YZ, _strides3
from .common import TORCH_TO_GL, _alloc_barriers, _as_matrix, _ring_slot, make_descriptor, num_sms

LOG2E = math.log2(math.e)
WG_KEYS = 64  # keys per consumer warpgroup (the wgmma M of the transposed tiles)
NUM_CONSUMERS = 2
BLOCK_N = WG_KEYS * NUM_CONSUMERS  # keys per program
BLOCK_M = 64  # query rows per step
HEAD_DIMS = (64, 128)
STAGES = 2
CONSUMER_REGS = 240
PRODUCER_REGS = 24
_WG = gl.constexpr(WG_KEYS)
_BM = gl.constexpr(BLOCK_M)


@gluon.constexpr_function
def _mma_layout(n):
    """Accumulator layout of one warpgroup's ``[64, n]`` wgmma."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


# ---- the step sequence, shared by the producer and the consumers ----------------------------------


@gluon.jit
def _first_query_tile(key0, seqlen_q, seqlen_k, CAUSAL: gl.constexpr):
    """First 64-row query tile that sees a key of the tile starting at ``key0`` (bottom-right
    causal: row ``i`` sees keys ``<= i + Sk - Sq``)."""
    if CAUSAL:
        return gl.maximum(key0 - (seqlen_k - seqlen_q), 0) // _BM
    else:
        return key0 * 0


# ---- producer ----------------------------------------------------------------------------------


@gluon.jit
def _tile_coords(tile, n_blocks, num_kv_heads):
    """``(first key, KV head, batch)`` of tile ``tile`` (key tiles fastest: the programs running
    at once share their query heads' Q/dO in L2, as a grid of one program per tile did)."""
    rest = tile // n_blocks
    return (tile % n_blocks) * (2 * _WG), rest % num_kv_heads, rest // num_kv_heads


@gluon.jit
def _produce_tile(tile, t, loads, seqlen_q, seqlen_k, group_size, n_blocks, num_kv_heads, CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr):
    """The loads of tile ``tile``, whose first step is the ring's ``t``-th; returns the ring
    position after it. Called once the consumers are done with the previous tile's K/V
    (:func:`_producer` waits on ``done``)."""
    q_desc, k_desc, v_desc, do_desc, stats_desc, k_buf, v_buf, q_bufs, do_bufs, stats_bufs, kv_ready, ready, \
        empty = loads
    key0, kv_head, b = _tile_coords(tile, n_blocks, num_kv_heads)
    m_tiles = gl.cdiv(seqlen_q, _BM)
    num_q_heads = num_kv_heads * group_size
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, key0, kv_head, 0], kv_ready, k_buf)
    tma.async_copy_global_to_shared(v_desc, [b, key0, kv_head, 0], kv_ready, v_buf)
    m_first = _first_query_tile(key0, seqlen_q, seqlen_k, CAUSAL)
    for i in range(group_size):
        head = kv_head * group_size + i
        for m in range(m_first, m_tiles):
            slot, phase = _ring_slot(t, STAGES)
            mbarrier.wait(empty.index(slot), phase ^ 1)
            mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, m * _BM, head, 0], ready.index(slot), q_bufs.index(slot))
            tma.async_copy_global_to_shared(do_desc, [b, m * _BM, head, 0], ready.index(slot), do_bufs.index(slot))
            tma.async_copy_global_to_shared(stats_desc, [b * num_q_heads + head, 0, m * _BM], ready.index(slot),
                                            stats_bufs.index(slot))
            t += 1
    return t


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, stats_desc, k_buf, v_buf, q_bufs, do_bufs, stats_bufs, tile_slot,
              kv_ready, ready, empty, done, tile_counter, seqlen_q, seqlen_k, group_size, n_blocks, num_kv_heads,
              num_tiles, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """Takes tiles until none is left: the first is its program id, the next ones come from
    ``tile_counter`` (fetched while the consumers finish a tile's last steps); each is handed to
    the consumers in ``tile_slot``, which they read after ``kv_ready``. Past the last tile it
    hands them ``num_tiles`` and completes ``kv_ready`` with no load."""
    loads = (q_desc, k_desc, v_desc, do_desc, stats_desc, k_buf, v_buf, q_bufs, do_bufs, stats_bufs, kv_ready, ready,
             empty)
    slot_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile = gl.program_id(0)
    r = 0
    t = 0
    while tile < num_tiles:
        # The consumers are past the previous tile's products (a fresh barrier passes parity 1):
        # they have read the slot, and K/V are free.
        mbarrier.wait(done, (r & 1) ^ 1)
        tile_slot.store(gl.full([1], tile, gl.int32, slot_layout))
        t = _produce_tile(tile, t, loads, seqlen_q, seqlen_k, group_size, n_blocks, num_kv_heads, CAUSAL, STAGES)
        tile = gl.num_programs(0) + gl.atomic_add(tile_counter, 1)
        r += 1
    mbarrier.wait(done, (r & 1) ^ 1)
    tile_slot.store(gl.full([1], num_tiles, gl.int32, slot_layout))
    mbarrier.arrive(kv_ready)


# ---- consumers ---------------------------------------------------------------------------------


@gluon.jit
def _row_stat(stats_bufs, slot, which: gl.constexpr, col_layout: gl.constexpr):
    """``lse * log2 e`` (``which`` 0) or ``delta`` (1) of a step's 64 query rows from its ``[1,
    2, 64]`` shared tile (row-major: a TMA box without swizzling), in the column layout of the
    transposed score tile."""
    STAGES: gl.constexpr = stats_bufs.shape[0]
    rows = stats_bufs._reinterpret(gl.float32, [STAGES * 2, _BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    return rows.index(2 * slot + which).load(col_layout)


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """Issue ``global[box at coord] += src`` (a shared tile) as a TMA bulk reduction; the caller
    waits (``tma.store_wait``) before writing ``src`` again. Gluon 3.6 has no Hopper call for it:
    the op is built through the builder, as Triton's ``tensor_descriptor.atomic_add`` builds its own."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _kv_views(k_bufs, v_bufs, i, ME: gl.constexpr, SPLIT_COLS: gl.constexpr):
    """``(K rows of consumer ME [64, D], V rows of consumer ME [64, D], K columns of its dQ share
    [128, D/2 or D])`` of the K/V tiles ``k_bufs.index(i)``, ``v_bufs.index(i)`` (the buffers
    hold one tile each).

    Each step builds them with ``i = t * kv_zero``, 0 at run time, which the compiler cannot see
    through. Views of the same buffer at every step let it hoist their 24 wgmma descriptors (8
    per product) out of the tile loop: at head dim 128 ptxas then kept 11 of them in local
    memory and reloaded them every step (12 LDL per plain step, 21 per masked one; the kernel
    ran 4-13% slower than with one program per tile). Built in the step they take no local
    memory; with one program per tile they cost 1.4-2.4% without a mask, and the persistent
    loop they allow gains more (docs/perf-notes.md)."""
    k_all = _as_matrix(k_bufs.index(i))  # [128, D]
    HEAD_DIM: gl.constexpr = k_all.shape[1]
    if SPLIT_COLS:
        k_cols = k_all.slice(ME * (HEAD_DIM // 2), HEAD_DIM // 2, dim=1)  # [128, D/2]
    else:
        k_cols = k_all
    return k_all.slice(ME * _WG, _WG, dim=0), _as_matrix(v_bufs.index(i)).slice(ME * _WG, _WG, dim=0), k_cols


@gluon.jit
def _step(t, m, dk, dv, kv, bufs, bars, dq_desc, dq_row0, keys, key_limit, shift, qk_scale,
          ME: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
          SPLIT_COLS: gl.constexpr):
    """One query tile of 64 rows against this warpgroup's 64 keys: the five products, dK/dV
    accumulated, this warpgroup's share of the dQ tile reduced into ``dq_desc``. ``MASK``: some
    pair of the tile is invisible (keys past ``key_limit``, or the causal diagonal)."""
    k_bufs, v_bufs, kv_zero = kv
    k_mine, v_mine, k_cols = _kv_views(k_bufs, v_bufs, t * kv_zero, ME, SPLIT_COLS)
    q_bufs, do_bufs, stats_bufs, ds_bufs, dq_buf = bufs
    ready, empty, ds_ready = bars
    dtype: gl.constexpr = k_mine.dtype
    HEAD_DIM: gl.constexpr = k_mine.shape[1]
    DQ_COLS: gl.constexpr = k_cols.shape[1]
    s_layout: gl.constexpr = _mma_layout(_BM)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(HEAD_DIM), k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    slot, phase = _ring_slot(t, STAGES)
    mbarrier.wait(ready.index(slot), phase)
    q_s = _as_matrix(q_bufs.index(slot))  # [64, D]
    do_s = _as_matrix(do_bufs.index(slot))
    zero = gl.zeros([_WG, _BM], gl.float32, s_layout)
    st = warpgroup_mma(k_mine, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_mine, do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(1, deps=(st,))
    # Read after the wait, so that the 32 values are not live across the two products.
    lse = _row_stat(stats_bufs, slot, 0, col_layout)
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
    if MASK:
        visible = gl.expand_dims(keys < key_limit, 1)
        if CAUSAL:
            rows = m * _BM + gl.arange(0, _BM, layout=col_layout)
            visible = visible & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows + shift, 0))
        pt = gl.where(visible, pt, 0.0)
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    delta = _row_stat(stats_bufs, slot, 1, col_layout)
    dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
    dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_s, dv, is_async=True)
    ds_buf = ds_bufs.index(t % 2)
    ds_buf.slice(ME * _WG, _WG, dim=0).store(dst)
    fence_async_shared()
    dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q_s, dk, is_async=True)
    mbarrier.arrive(ds_ready.index(t % 2))
    mbarrier.wait(ds_ready.index(t % 2), (t // 2) & 1)
    dq_layout: gl.constexpr = _mma_layout(DQ_COLS)
    if SPLIT_COLS:
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, gl.zeros([_BM, DQ_COLS], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
        dq, dv, dk = warpgroup_mma_wait(0, deps=(dq, dv, dk))
        mbarrier.arrive(empty.index(slot))
        tma.store_wait(0)  # the previous step's reduction has read dq_buf
        dq_buf.store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [dq_row0 + m * _BM, ME * DQ_COLS], dq_buf)
    else:
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(slot))
        if t % 2 == ME:
            dq = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, gl.zeros([_BM, DQ_COLS], gl.float32, dq_layout),
                               use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            tma.store_wait(0)
            dq_buf.store(dq)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [dq_row0 + m * _BM, 0], dq_buf)
    return dk, dv


@gluon.jit
def _stage(bufs, desc, ME: gl.constexpr):
    """Consumer ``ME``'s half of the shared buffers ``bufs`` (one half per consumer) as a tile of
    ``desc``'s box, for a TMA store."""
    box_bytes: gl.constexpr = desc.block_type.nbytes
    total: gl.constexpr = bufs.shape[0] * bufs.shape[1] * bufs.shape[2] * bufs.dtype.primitive_bitwidth // 8
    boxes: gl.constexpr = total // box_bytes
    gl.static_assert(boxes >= 2, "each consumer's half holds a box")
    return bufs._reinterpret(desc.dtype, [boxes] + desc.block_type.shape, desc.layout).index(ME * (boxes // 2))


@gluon.jit
def _consume_tile(tile, r, t, kv, bufs, stages, bars, done, stored, descs, seqlen_q, seqlen_k, group_size, sq_pad,
                  n_blocks, num_kv_heads, qk_scale, sm_scale, ME: gl.constexpr, HEAD_DIM: gl.constexpr,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr, SPLIT_COLS: gl.constexpr):
    """This consumer's share of the ``r``-th tile of this program, ``tile`` (K/V loaded), whose
    first step is the ring's ``t``-th: the steps, then dK/dV out by TMA stores; returns the ring
    position after it."""
    dq_desc, dk_desc, dv_desc = descs
    dk_stage, dv_stage = stages
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    key0, kv_head, b = _tile_coords(tile, n_blocks, num_kv_heads)
    my_key0 = key0 + ME * _WG
    num_q_heads = num_kv_heads * group_size
    shift = seqlen_k - seqlen_q
    m_tiles = gl.cdiv(seqlen_q, _BM)
    dk = gl.zeros([_WG, HEAD_DIM], gl.float32, o_layout)
    dv = gl.zeros([_WG, HEAD_DIM], gl.float32, o_layout)
    keys = my_key0 + gl.arange(0, _WG, layout=gl.SliceLayout(1, _mma_layout(_BM)))
    m_first = _first_query_tile(key0, seqlen_q, seqlen_k, CAUSAL)
    # Steps before m_plain have an invisible pair somewhere in the CTA's keys: the causal diagonal
    # crosses them (row 64 m < last key - shift), or the keys run past Sk (every step then).
    if key0 + 2 * _WG > seqlen_k:
        m_plain = m_tiles
    elif CAUSAL:
        m_plain = gl.minimum(gl.maximum(gl.cdiv(key0 + 2 * _WG - 1 - shift, _BM), m_first), m_tiles)
    else:
        m_plain = m_first
    for i in range(group_size):
        head = kv_head * group_size + i
        dq_row0 = (b * num_q_heads + head) * sq_pad
        for m in range(m_first, m_plain):
            dk, dv = _step(t, m, dk, dv, kv, bufs, bars, dq_desc, dq_row0, keys, seqlen_k, shift, qk_scale,
                           ME, True, CAUSAL, STAGES, SPLIT_COLS)
            t += 1
        for m in range(m_plain, m_tiles):
            dk, dv = _step(t, m, dk, dv, kv, bufs, bars, dq_desc, dq_row0, keys, seqlen_k, shift, qk_scale,
                           ME, False, CAUSAL, STAGES, SPLIT_COLS)
            t += 1
    # Both consumers' products are over: the other's last dQ product has read the dS buffer
    # staged below, and K/V are free for the producer.
    mbarrier.arrive(done)
    mbarrier.wait(done, r & 1)
    dtype: gl.constexpr = dk_desc.dtype
    tma.store_wait(0)  # this consumer's last dQ reduction has read its dQ tile
    _as_matrix(dk_stage).store((dk * sm_scale).to(dtype))
    _as_matrix(dv_stage).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, my_key0, kv_head, 0], dk_stage)
    tma.async_copy_shared_to_global(dv_desc, [b, my_key0, kv_head, 0], dv_stage)
    tma.store_wait(0)
    # The other consumer's next steps write their dS rows into the buffer staged here.
    mbarrier.arrive(stored)
    mbarrier.wait(stored, r & 1)
    return t


@gluon.jit
def _consumer(k_bufs, v_bufs, kv_zero, bufs, tile_slot, kv_ready, bars, done, stored, dq_desc, dk_desc, dv_desc,
              seqlen_q, seqlen_k, group_size, sq_pad, n_blocks, num_kv_heads, num_tiles, qk_scale, sm_scale,
              ME: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
              SPLIT_COLS: gl.constexpr):
    """Consumer ``ME`` (keys ``[64 ME, 64 ME + 64)`` of each tile) of the tiles the producer
    hands over in ``tile_slot``, until it hands ``num_tiles``."""
    q_bufs, do_bufs, stats_bufs, ds_bufs, dq_bufs = bufs
    my_bufs = (q_bufs, do_bufs, stats_bufs, ds_bufs, dq_bufs.index(ME))
    kv = (k_bufs, v_bufs, kv_zero)
    # dK and dV leave by TMA stores staged in this consumer's dQ tile and in the dS buffer of
    # parity ME, so that the producer can fill the Q/dO ring with the next tile meanwhile.
    stages = (_stage(dq_bufs, dk_desc, ME), _stage(ds_bufs, dv_desc, ME))
    descs = (dq_desc, dk_desc, dv_desc)
    slot_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    r = 0
    t = 0
    mbarrier.wait(kv_ready, 0)
    tile = gl.max(tile_slot.load(slot_layout), axis=0)
    while tile < num_tiles:
        t = _consume_tile(tile, r, t, kv, my_bufs, stages, bars, done, stored, descs, seqlen_q, seqlen_k, group_size,
                          sq_pad, n_blocks, num_kv_heads, qk_scale, sm_scale, ME, HEAD_DIM, CAUSAL, STAGES, SPLIT_COLS)
        r += 1
        mbarrier.wait(kv_ready, r & 1)
        tile = gl.max(tile_slot.load(slot_layout), axis=0)


# Lengths and head counts change between calls; they only feed scalar index math.
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "group_size", "sq_pad", "n_blocks", "num_kv_heads",
                              "num_tiles", "kv_zero"])
def _gluon_backward_kernel(
    q_desc, k_desc, v_desc, do_desc, stats_desc, dq_desc, dk_desc, dv_desc, tile_counter, kv_zero,
    seqlen_q, seqlen_k, group_size, sq_pad, n_blocks, num_kv_heads, num_tiles, qk_scale, sm_scale,
    HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr, SPLIT_COLS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Tiles ``(key tile, KV head, batch)`` of 128 keys (``num_tiles = n_blocks * num_kv_heads *
    B``, key tiles fastest), grid ``(min(num_tiles, SMs),)``: program ``p`` takes tile ``p``,
    then the next ones in order from ``tile_counter`` (an int32 zeroed beforehand, counting from
    ``num_programs``). ``kv_zero``: 0, passed at run time (:func:`_kv_views`). 4 warps (+ 4 for
    the second consumer, 1 producer warp).

    Descriptors: q/dO ``[B, Sq, Hq, D]`` box ``[1, 64, 1, D]``; k/v ``[B, Sk, Hkv, D]`` box ``[1,
    128, 1, D]``; stats_desc float32 ``[B * Hq, 2, sq_pad]`` (``lse * log2 e`` and ``delta``
    of each row, :func:`_row_stats_kernel`) box ``[1, 2, 64]``; dq_desc float32 ``[B * Hq * sq_pad,
    D]`` box ``[64, D/2]`` (``SPLIT_COLS``) or ``[64, D]``; dk/dv ``[B, Sk, Hkv, D]`` box ``[1,
    64, 1, D]``.
    """
    dtype: gl.constexpr = q_desc.dtype
    k_bufs = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    stats_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape, stats_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * _WG, _BM], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, 2 * _WG, _BM], ds_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    tile_slot = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    kv_ready = _alloc_barriers(1, 1).index(0)
    ready = _alloc_barriers(STAGES, 1)
    empty = _alloc_barriers(STAGES, 2)  # both consumers release each stage
    ds_ready = _alloc_barriers(2, 2)  # both consumers wrote their dS rows
    done = _alloc_barriers(1, 2).index(0)  # both consumers are past a tile's last products
    stored = _alloc_barriers(1, 2).index(0)  # both consumers' dK/dV stores have read shared memory
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before first use
    bufs = (q_bufs, do_bufs, stats_bufs, ds_bufs, dq_bufs)
    bars = (ready, empty, ds_ready)
    gl.warp_specialize([
        (_consumer, (k_bufs, v_bufs, kv_zero, bufs, tile_slot, kv_ready, bars, done, stored, dq_desc, dk_desc,
                     dv_desc, seqlen_q, seqlen_k, group_size, sq_pad, n_blocks, num_kv_heads, num_tiles, qk_scale,
                     sm_scale, 0, HEAD_DIM, CAUSAL, STAGES, SPLIT_COLS)),
        (_consumer, (k_bufs, v_bufs, kv_zero, bufs, tile_slot, kv_ready, bars, done, stored, dq_desc, dk_desc,
                     dv_desc, seqlen_q, seqlen_k, group_size, sq_pad, n_blocks, num_kv_heads, num_tiles, qk_scale,
                     sm_scale, 1, HEAD_DIM, CAUSAL, STAGES, SPLIT_COLS)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, stats_desc, k_bufs.index(0), v_bufs.index(0), q_bufs, do_bufs,
                     stats_bufs, tile_slot, kv_ready, ready, empty, done, tile_counter, seqlen_q, seqlen_k, group_size,
                     n_blocks, num_kv_heads, num_tiles, CAUSAL, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@triton.jit
def _row_stats_kernel(Out, DOut, Lse, DLse, Stats, Acc, TileCounter, o_strides, do_strides, lse_strides, dlse_strides,
                      seqlen_q, num_heads, sq_pad, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``stats[b * Hq + h] = (lse * log2 e, delta)`` of rows ``[0, sq_pad)``, ``delta =
    rowsum(dO * out) - dlse``; ``lse = -inf`` (a row that sees no key) and rows past ``Sq``
    become ``+inf`` (``P = 0`` without a mask), delta 0 past ``Sq``. Also zeroes the same rows of
    the float32 dQ accumulator ``Acc [B, Hq, sq_pad, D]`` (contiguous) that the backward kernel
    adds into, and the backward kernel's int32 tile counter. Grid ``(sq_pad / BLOCK, Hq, B)``;
    ``*_strides``: ``(batch, row, head)`` of ``out``/``dO`` (last dim contiguous), ``(batch,
    head, row)`` of ``lse``/``dlse``."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    valid = rows < seqlen_q
    cols = tl.arange(0, HEAD_DIM)
    o = tl.load(Out + b * o_strides[0] + head * o_strides[2] + rows[:, None].to(tl.int64) * o_strides[1]
                + cols[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(DOut + b * do_strides[0] + head * do_strides[2] + rows[:, None].to(tl.int64) * do_strides[1]
                 + cols[None, :], mask=valid[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + b * dlse_strides[0] + head * dlse_strides[1] + rows * dlse_strides[2], mask=valid,
                         other=0.0)
    lse = tl.load(Lse + b * lse_strides[0] + head * lse_strides[1] + rows * lse_strides[2], mask=valid,
                  other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    dst = Stats + (b * num_heads + head) * (2 * sq_pad) + rows
    tl.store(dst, lse)
    tl.store(dst + sq_pad, delta)
    acc = Acc + ((b * num_heads + head) * sq_pad + rows[:, None]) * HEAD_DIM + cols[None, :]
    tl.store(acc, tl.zeros([BLOCK, HEAD_DIM], tl.float32))
    if tl.program_id(0) + head + b == 0:
        tl.store(TileCounter, 0)


@triton.jit
def _dq_convert_kernel(Acc, DQ, stride_b, stride_s, stride_h, seqlen_q, num_heads, sq_pad, sm_scale,
                       HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """``dq[b, s, h] = scale * acc[b, h, s]`` cast to dq's dtype; grid ``(sq_pad / BLOCK, Hq,
    B)``."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1)
    b = tl.program_id(2)
    cols = tl.arange(0, HEAD_DIM)
    src = Acc + ((b * num_heads + head).to(tl.int64) * sq_pad + rows[:, None]) * HEAD_DIM + cols[None, :]
    mask = rows[:, None] < seqlen_q
    acc = tl.load(src, mask=mask, other=0.0)
    dst = DQ + b.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_s
    tl.store(dst + cols[None, :], (acc * sm_scale).to(DQ.dtype.element_ty), mask=mask)


# ---- host side --------------------------------------------------------------------------------


def supported(q, k, v, dout, dq, dk, dv) -> bool:
    """Whether the kernel can take these tensors (the variant, device and dtype are the dispatch
    layer's checks): dense ``[B, S, H, D]`` inputs of one dtype, head dim 64/128, no empty dim,
    q/k/v/dout and dk/dv TMA-ready (dK/dV leave by TMA stores), dq with a contiguous last dim, the
    batch and the query heads within a grid axis (65535; the row passes run one program per query
    head) and the float32 dQ buffer's rows within TMA's int32 coordinates."""
    if q.dim() != 4 or q.dtype not in TORCH_TO_GL or q.shape[-1] not in HEAD_DIMS:
        return False
    dq_rows = q.shape[0] * q.shape[2] * cdiv(q.shape[1], BLOCK_M) * BLOCK_M
    if max(k.shape[0], q.shape[2]) > MAX_GRID_YZ or dq_rows >= 2**31:
        return False
    if any(x.dtype != q.dtype or x.device != q.device for x in (k, v, dout, dq, dk, dv)):
        return False
    if min(*q.shape[:3], *k.shape[:3]) < 1:
        return False
    if not all(tma_aligned(x, broadcast=False) for x in (q, k, v, dout, dk, dv)):
        return False
    return dq.stride(-1) == 1


def launch_args(q, k, v, dout, stats, dq_acc, dk, dv, tile_counter, *, causal: bool, softmax_scale: float):
    """``(grid, args, kwargs)`` of the backward kernel (also used to compile without a GPU): one
    program per SM at most (:func:`num_sms`), each taking tiles until none is left."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    split_cols = head_dim == 128
    dq_cols = head_dim // 2 if split_cols else head_dim
    sq_pad = dq_acc.shape[2]
    dq_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, dq_cols], gl.float32)
    dq_desc = TensorDescriptor(dq_acc, [batch * num_heads * sq_pad, head_dim], [head_dim, 1], [BLOCK_M, dq_cols],
                               dq_layout)
    stats_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)  # row-major
    stats_desc = TensorDescriptor(stats, [batch * num_heads, 2, sq_pad], [2 * sq_pad, sq_pad, 1], [1, 2, BLOCK_M],
                                  stats_layout)
    n_blocks = cdiv(seqlen_k, BLOCK_N)
    num_tiles = n_blocks * num_kv_heads * batch
    grid = (min(num_tiles, num_sms(q.device)),)
    args = (make_descriptor(q, BLOCK_M), make_descriptor(k, BLOCK_N), make_descriptor(v, BLOCK_N),
            make_descriptor(dout, BLOCK_M), stats_desc, dq_desc, make_descriptor(dk, WG_KEYS),
            make_descriptor(dv, WG_KEYS), tile_counter, 0,
            seqlen_q, seqlen_k, num_heads // num_kv_heads, sq_pad, n_blocks, num_kv_heads, num_tiles,
            softmax_scale * LOG2E, softmax_scale)
    kwargs = dict(HEAD_DIM=head_dim, CAUSAL=causal, STAGES=STAGES, SPLIT_COLS=split_cols,
                  CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    return grid, args, kwargs


MAXNREG = (65536 // (128 * (NUM_CONSUMERS + 1))) // 8 * 8  # 168: setmaxnreg moves them (240 + 240 + 24)
CONVERT_ROWS = BLOCK_M  # rows per program of the row statistics and the cast (sq_pad is a multiple)


def gluon_backward(dout, q, k, v, out, lse, dq, dk, dv, *, causal: bool, softmax_scale: float, dlse=None) -> None:
    """dQ, dK, dV of dense attention into ``dq, dk, dv`` (inputs checked by :func:`supported`).

    ``q, dout, out, dq [B, Sq, Hq, D]`` (``out``, ``dout`` with a contiguous last dim), ``k, v,
    dk, dv [B, Sk, Hkv, D]``; ``lse`` (the forward's, natural log) and ``dlse`` (a gradient
    flowing into it, or None) float32 ``[B, Hq, Sq]``, any strides. dK/dV of a KV head are summed
    over its query heads.
    """
    batch, seqlen_q, num_heads, head_dim = q.shape
    sq_pad = cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    # Zeroed by the row statistics' pass, which runs first (a fill at allocation and a zeroing
    # after the cast, for replays that keep the buffer, wrote it twice per eager call).
    dq_acc = allocate((batch, num_heads, sq_pad, head_dim), torch.float32, q.device)
    stats = allocate((batch * num_heads, 2, sq_pad), torch.float32, q.device)
    tile_counter = allocate((1,), torch.int32, q.device)
    _launch_stats((sq_pad // CONVERT_ROWS, num_heads, batch), out, dout, lse, lse if dlse is None else dlse, stats,
                  dq_acc, tile_counter, _strides3(out), _strides3(dout), lse.stride(),
                  (0, 0, 0) if dlse is None else dlse.stride(), seqlen_q, num_heads, sq_pad, HEAD_DIM=head_dim,
                  BLOCK=CONVERT_ROWS, HAS_DLSE=dlse is not None, num_warps=4, num_stages=1)
    grid, args, kwargs = launch_args(q, k, v, dout, stats, dq_acc, dk, dv, tile_counter, causal=causal,
                                     softmax_scale=softmax_scale)
    _launch_kernel(grid, *args, **kwargs, num_warps=4, maxnreg=MAXNREG)
    _launch_convert((sq_pad // CONVERT_ROWS, num_heads, batch), dq_acc, dq, dq.stride(0), dq.stride(1),
                    dq.stride(2), seqlen_q, num_heads, sq_pad, softmax_scale, HEAD_DIM=head_dim,
                    BLOCK=CONVERT_ROWS, num_warps=4, num_stages=1)


_launch_kernel = Launcher(_gluon_backward_kernel)
_launch_convert = Launcher(_dq_convert_kernel)
_launch_stats = Launcher(_row_stats_kernel)
