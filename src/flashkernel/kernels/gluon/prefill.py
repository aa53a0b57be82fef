"""Prefill forward in Gluon for Hopper (sm_90a): a FlashAttention-3-style prototype.

Why: the Triton kernel (``prefill.py``) plateaus at ~535 TFLOP/s at head dim 128 because one
CTA per SM runs softmax and wgmma in the same warps, one after the other (docs/perf-notes.md,
"Toward cuDNN"). Gluon (``triton.experimental.gluon``, Triton 3.6) exposes what is needed to
overlap them: warp-specialized partitions, mbarriers, TMA and asynchronous wgmma.

Design (one CTA = one 128-row query tile of one (batch, head); 3 warpgroups, 384 threads; the
persistent and 3-warpgroup options are described after the default design):

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

* **Persistent grid** (``GluonConfig.persistent``, off by default): ``min(#SMs, units)``
  programs, each looping over schedule units of work items ``(query tile, head, batch)``:
  program ``p`` of ``G`` takes unit ``n G + p`` in round ``n``. Without ``causal`` a unit is one
  item, the query tiles of one head adjacent. With ``causal`` (``causal_pairs``, by default when
  the units fill the grid's rounds: ``use_pairs``) unit ``k`` of a head is its query tiles
  ``M - 1 - k`` then ``k``: every unit has the same number of key tiles, and the programs
  running at one time work on a few heads, so K/V come from L2. (The other order, the longest
  tiles of all heads first dealt out in a snake, balances the programs as well but has each
  round read every head's K/V again from HBM: ~600 MB at seqlen 1k where K/V are 134 MB, which
  capped short causal shapes at ~0.85x cuDNN; docs/perf-notes.md.) The producer runs ahead into the next item: each consumer has its own Q buffer with a
  ``q_ready``/``q_empty`` pair, released right after its last ``S = Q K^T`` of the item, so
  the next Q loads during the last softmax, ``P V`` and the epilogue; the K/V ring just goes on
  across items (ring uses, ping-pong rounds and Q phases are running counts that the producer
  and every consumer derive from the same item sequence). O is staged in its own shared buffer
  (``separate_o``; by default when it fits: d64 and d128) and its TMA store is waited for only
  before that buffer is reused, one item later; at d256 (no room for two) the consumers take
  one O buffer in turn (``shared_o``), so Q's buffers are still freed after the last ``S``
  (without it O goes through Q's buffer, and the next item's loads wait for both O stores). The pipelined loop's schedule fence uses a
  dedicated barrier (the Q barriers cycle). The causal mask compares the tile-local column with
  one per-row limit (``FUSED_MASK``), which keeps d128 causal free of spills.
* **3 consumer warpgroups** (``num_consumers=3``, 192-row tiles, ``D64_3WG``): for d64, more
  rows per K/V tile (FA3's d64 tile). 4 warpgroups share the registers: 160 per consumer, so
  the pipelined loop at BLOCK_N 128 spills; ``D64_3WG`` runs the simple loop (3 warpgroups
  still interleave), or pipelined at BLOCK_N 64.

* **Per-warpgroup key ranges** (``GluonConfig.wg_tiles``, causal only; off by default): with the
  causal mask, warpgroup 0 of a query tile sees fewer keys than warpgroup 1. Each consumer then
  computes its own trip count and unmasked-tile count from its 64 rows (``_wg_key_tiles``); the
  producer still loads the tile's union. At BLOCK_N 64 (d256, or ``block_n=64``) warpgroup 0
  skips the diagonal's last 64-key tile and warpgroup 1 runs one more tile unmasked; at
  BLOCK_N 128 a warpgroup whose rows see only the first 64 keys of its last tile (warpgroup 0
  on the diagonal) runs that tile as a peeled half-width iteration: ``S`` is a 64x64 wgmma on
  the first 64 rows of the K tile (a shared-memory slice) and ``P V`` uses the first 64 rows of
  V (tile 0 always runs full width: the prologue is not peeled). A consumer releases the tiles
  it skips, each after waiting for its ``ready`` (an ``empty`` arrival for ring use ``u`` is
  safe only once the phase of use ``u - STAGES`` completed, which ``ready`` of ``u`` implies),
  and with ``PINGPONG`` takes and passes the skipped rounds, so every consumer still runs
  ``n_tiles - 1`` rounds per item. Non-causal specializations compile to the same code.

Tile shapes per head dim (``CONFIGS``; shared memory = Q 2x64xD + STAGES x (K + V) BLOCK_N x D,
plus 2x64xD for the persistent kernel's O buffer at d64/d128):
d64: BLOCK_N 128, 3 stages (112 KB); d128: 128, 2 stages (160 KB); d256: 64, 2 stages (192 KB).

Next steps (not done here): ``BLOCK_N`` 176 at d128, skipping the O rescale when the row max does not move, fewer
partition barriers (each ``mbarrier.arrive``/``wait`` in a 4-warp partition comes with a
``bar.sync`` of the warpgroup: 4 per tile), and building the descriptors once per shape (each
call encodes four ``CUtensorMap`` on the host).
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

from .._common import exponent_options, is_sm90, tma_aligned
from .._launch import Launcher
from .common import (TORCH_TO_GL, _alloc_barriers, _as_matrix, _rescale, _ring_slot, _softmax_tile, make_descriptor,
                     num_sms, tile_layout)

LOG2E = math.log2(math.e)
WG_ROWS = 64  # query rows per consumer warpgroup (the wgmma M of one warpgroup)
NUM_CONSUMERS = 2
BLOCK_M = WG_ROWS * NUM_CONSUMERS  # query rows per program
_WG = gl.constexpr(WG_ROWS)  # the same numbers, usable inside kernels
HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    block_n: int
    stages: int
    pipeline: bool = True
    pingpong: bool = False
    consumer_regs: int = 240
    producer_regs: int = 24
    # Persistent grid (one CTA per SM looping over (query tile, head, batch) work items; the
    # producer runs ahead into the next item). False: one CTA per work item (the original kernel).
    persistent: bool = False
    # Consumer warpgroups of 64 query rows each: 2 (128-row tiles) or 3 (192-row tiles, for d64).
    num_consumers: int = 2
    # Persistent only: stage O in its own shared buffer per consumer (so the next item's Q can
    # land while this item's epilogue runs). None: when it fits (see ``o_separate``); False: in
    # Q's buffer, or in the shared one with ``shared_o=True``.
    separate_o: bool | None = None
    # Persistent only: at most this many programs (None: one per SM). For tests: a small grid
    # makes every program run many work items.
    max_programs: int | None = None
    # Causal only: per-warpgroup key ranges. Each consumer warpgroup runs only the key tiles its
    # own 64 rows see, and its own count of unmasked tiles; at BLOCK_N 128 a warpgroup whose rows
    # see only the first half of its last key tile runs that tile as a 64-key QK^T and PV. The
    # producer still loads the tile's union; a warpgroup that skips tiles releases them (after
    # their ``ready``) and, with ``pingpong``, passes its turns. Non-causal code is unchanged.
    wg_tiles: bool = False
    # Persistent only, when O has no buffer per consumer (d256): one O buffer that the consumers
    # take in turn, so Q's buffers are freed after the last S as with ``separate_o`` and the next
    # item's loads do not wait for O stores. None: when it fits and ``separate_o`` is not set
    # (see ``o_shared``).
    shared_o: bool | None = None
    # Persistent causal only: schedule units of two query tiles of one head, ``M - 1 - k`` then
    # ``k`` (equal work per unit; the programs running at one time share few heads' K/V in L2).
    # False: the longest tiles of all heads first, dealt out in a snake. None: pairs when the
    # units fill the rounds of the grid (``use_pairs``).
    causal_pairs: bool | None = None


CONFIGS = {
    64: GluonConfig(block_n=128, stages=3),
    128: GluonConfig(block_n=128, stages=2),
    256: GluonConfig(block_n=64, stages=2),
}

# Persistent variants per head dim (``GluonConfig.persistent``); d64 also has a 3-warpgroup
# (192-row) tile with 160 registers per consumer (4 warpgroups share the register file).
PERSISTENT_CONFIGS = {d: dataclasses.replace(c, persistent=True) for d, c in CONFIGS.items()}
# The pipelined loop at BLOCK_N 128 needs more than 160 registers (it spills), so this one runs
# the simple loop; ``block_n=64, stages=3`` with ``pipeline=True`` fits as well.
D64_3WG = GluonConfig(block_n=128, stages=2, pipeline=False, num_consumers=3, consumer_regs=160, producer_regs=24)

SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on sm_90


def smem_bytes(head_dim: int, config: GluonConfig, o_bufs: int, elem: int = 2) -> int:
    """Shared memory of the tiles (barriers and compiler scratch not counted) with ``o_bufs``
    O buffers of 64 rows besides Q's (one per consumer, one shared, or none)."""
    tile = WG_ROWS * head_dim * elem
    kv = 2 * config.stages * config.block_n * head_dim * elem
    return (config.num_consumers + o_bufs) * tile + kv


def o_separate(head_dim: int, config: GluonConfig) -> bool:
    """Whether the persistent kernel stages O in its own buffer (``config.separate_o``, or when
    the extra buffer fits with ~4 KB to spare: d64 and d128 yes, d256 no)."""
    if not config.persistent:
        return False
    if config.separate_o is not None:
        return config.separate_o
    return smem_bytes(head_dim, config, config.num_consumers) <= SMEM_LIMIT - 4096


def o_shared(head_dim: int, config: GluonConfig) -> bool:
    """Whether the persistent kernel stages O in one buffer that the consumers take in turn
    (``config.shared_o``, or when O has no buffer per consumer and one fits: d256, 3 KB left).

    Without it O goes through Q's buffer, so the next item's Q loads (and the K/V loads behind
    them in the producer's program order) wait for both O stores and the tensor cores idle
    meanwhile; with it, Q is freed after the last ``S`` and only the second consumer's O store
    waits, for the first one's to be read (by then the first one runs the next item).
    """
    if not config.persistent or o_separate(head_dim, config):
        return False
    fits = smem_bytes(head_dim, config, 1) <= SMEM_LIMIT - 2048
    if config.shared_o and not fits:
        raise ValueError(f"shared_o=True: no room for an O buffer at head dim {head_dim} with {config}")
    if config.shared_o is not None:
        return config.shared_o
    return fits and config.separate_o is None


def pair_units(m_tiles: int, heads: int) -> int:
    """Schedule units of the pairs order: ``ceil(m_tiles / 2)`` per (batch, head)."""
    return (m_tiles + 1) // 2 * heads


# A round of the persistent grid that units leave partly idle costs this much at most.
PAIRS_MAX_TAIL = 1.1


def use_pairs(causal: bool, config: GluonConfig, m_tiles: int, heads: int, programs: int) -> bool:
    """Whether the persistent causal kernel runs pairs of query tiles (``config.causal_pairs``).

    Automatic (None): when the units fill the grid's rounds to within ``PAIRS_MAX_TAIL``. A unit
    is two items' work, so with few units whole units queue on some programs while others idle
    (e.g. 134 units on 132 programs take two rounds of full units, where the snake deals 268
    items into two rounds of unequal ones); at the issue's shapes (16k tokens per batch) units are
    512 or more and fill their rounds to within 6%.
    """
    if not (config.persistent and causal) or config.causal_pairs is False:
        return False
    if config.causal_pairs:
        return True
    units = pair_units(m_tiles, heads)
    rounds = -(-units // programs)
    return units >= programs and rounds * programs <= PAIRS_MAX_TAIL * units


# ---- layouts -----------------------------------------------------------------------------------


@gluon.constexpr_function
def wgmma_layout(n):
    """Accumulator layout of one warpgroup's ``[64, n]`` wgmma (instruction m16 x n x k16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


# ---- pieces shared by the partitions --------------------------------------------------------------


@gluon.jit
def _key_tiles(row0, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Key tiles of the query tile starting at ``row0``: ``(n_tiles, unmasked)``.

    Tiles ``[0, unmasked)`` need no mask; ``[unmasked, n_tiles)`` do. At least one tile is
    visited (a tile whose rows all see nothing then runs fully masked and writes 0 / -inf).
    """
    shift = seqlen_k - seqlen_q  # row i sees keys j <= i + shift
    if CAUSAL:
        end = gl.minimum(seqlen_k, gl.minimum(row0 + BLOCK_M, seqlen_q) + shift)
        full = gl.minimum(seqlen_k, row0 + 1 + shift)
    else:
        end = seqlen_k
        full = seqlen_k
    n_tiles = gl.maximum(gl.cdiv(gl.maximum(end, 0), BLOCK_N), 1)
    unmasked = gl.maximum(full, 0) // BLOCK_N
    return n_tiles, unmasked


@gluon.jit
def _wg_key_tiles(wg_row0, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr, HALF: gl.constexpr):
    """Causal key range of one consumer warpgroup (rows ``[wg_row0, wg_row0 + 64)``):
    ``(n_tiles, unmasked, half_last)``.

    Never more tiles than :func:`_key_tiles` gives its query tile (the producer's count): its
    rows are a subset. With ``HALF`` (BLOCK_N = 128) ``half_last`` is 1 when the rows see only
    the first 64 keys of their last tile (keys ``< end <= 128 (n - 1) + 64``) and that tile is
    not tile 0 (the pipelined loop's prologue always runs a full tile); else 0.
    """
    shift = seqlen_k - seqlen_q
    end = gl.minimum(seqlen_k, gl.minimum(wg_row0 + _WG, seqlen_q) + shift)
    full = gl.minimum(seqlen_k, wg_row0 + 1 + shift)
    unmasked = gl.maximum(full, 0) // BLOCK_N
    if HALF:
        halves = gl.maximum(gl.cdiv(gl.maximum(end, 0), BLOCK_N // 2), 1)
        n_tiles = (halves + 1) // 2
        half_last = (halves % 2) * (n_tiles >= 2).to(gl.int32)
    else:
        n_tiles = gl.maximum(gl.cdiv(gl.maximum(end, 0), BLOCK_N), 1)
        half_last = n_tiles * 0
    return n_tiles, unmasked, half_last


@gluon.jit
def _decode_item(t, seqlen_q, num_heads, batch, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """``(batch index, head, first query row)`` of work item ``t`` (see the module docstring):
    without ``causal`` the query tiles of one head are adjacent; with it the longest tiles of
    all heads come first."""
    num_m_tiles = gl.cdiv(seqlen_q, BLOCK_M)
    num_bh = num_heads * batch
    if CAUSAL:
        m_tile = num_m_tiles - 1 - t // num_bh
        bh = t % num_bh
    else:
        m_tile = t % num_m_tiles
        bh = t // num_m_tiles
    return bh // num_heads, bh % num_heads, m_tile * BLOCK_M


@gluon.jit
def _program_tile(seqlen_q, num_heads, batch, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Non-persistent grid: the work item of this program."""
    return _decode_item(gl.program_id(0), seqlen_q, num_heads, batch, CAUSAL, BLOCK_M)


@gluon.jit
def _units_per_head(seqlen_q, PAIRS: gl.constexpr, BLOCK_M: gl.constexpr):
    """Persistent grid: schedule units per (batch, head): its query tiles, or with ``PAIRS``
    their complementary pairs (the middle tile of an odd count alone)."""
    num_m_tiles = gl.cdiv(seqlen_q, BLOCK_M)
    if PAIRS:
        return (num_m_tiles + 1) // 2
    else:
        return num_m_tiles


@gluon.jit
def _persistent_units(seqlen_q, num_heads, batch, SNAKE: gl.constexpr, PAIRS: gl.constexpr,
                      BLOCK_M: gl.constexpr):
    """Persistent grid: how many schedule units this program runs (see :func:`_persistent_unit`)."""
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    total = _units_per_head(seqlen_q, PAIRS, BLOCK_M) * num_heads * batch
    full = total // num_progs
    if SNAKE:
        slot = pid + (full & 1) * (num_progs - 1 - 2 * pid)
    else:
        slot = pid
    return full + (slot < total % num_progs).to(gl.int32)


@gluon.jit
def _persistent_unit(n, SNAKE: gl.constexpr):
    """Schedule unit of this program's ``n``-th round: round ``n`` covers units ``[n G, n G + G)``
    (G programs); program ``p`` takes ``n G + p``, or with ``SNAKE`` ``n G + G - 1 - p`` in odd
    rounds, so that with the longest-first causal order no program gets the longest unit of
    every round. Every unit is taken exactly once (checked on CPU for all totals and G < 20)."""
    pid = gl.program_id(0)
    num_progs = gl.num_programs(0)
    if SNAKE:
        slot = pid + (n & 1) * (num_progs - 1 - 2 * pid)
    else:
        slot = pid
    return n * num_progs + slot


@gluon.jit
def _unit_items(u, seqlen_q, PAIRS: gl.constexpr, BLOCK_M: gl.constexpr):
    """Work items of schedule unit ``u``: 1, or with ``PAIRS`` 2 (1 for the middle tile)."""
    if PAIRS:
        num_m_tiles = gl.cdiv(seqlen_q, BLOCK_M)
        per_head = (num_m_tiles + 1) // 2
        middle = ((num_m_tiles % 2) == 1) & ((u % per_head) == per_head - 1)
        return 2 - middle.to(gl.int32)
    else:
        return u * 0 + 1  # a tensor like the other branch's


@gluon.jit
def _unit_item(u, h, seqlen_q, num_heads, batch, CAUSAL: gl.constexpr, PAIRS: gl.constexpr,
               BLOCK_M: gl.constexpr):
    """``(batch index, head, first query row)`` of item ``h`` of schedule unit ``u``.

    With ``PAIRS`` (causal) unit ``u`` is pair ``k`` of (batch, head) ``u // ceil(M / 2)``: query
    tile ``M - 1 - k`` (``h = 0``), then tile ``k``; their causal key tiles add up to the same
    count for every ``k``, so equal shares of units are equal shares of work, and consecutive
    units are one head's, whose K/V the programs running them share in L2. Else unit ``u`` is
    item ``u`` of :func:`_decode_item`.
    """
    if PAIRS:
        num_m_tiles = gl.cdiv(seqlen_q, BLOCK_M)
        per_head = (num_m_tiles + 1) // 2
        bh = u // per_head
        k = u % per_head
        m_tile = k + (1 - h) * (num_m_tiles - 1 - 2 * k)
        return bh // num_heads, bh % num_heads, m_tile * BLOCK_M
    else:
        return _decode_item(u, seqlen_q, num_heads, batch, CAUSAL, BLOCK_M)


# ---- producer ---------------------------------------------------------------------------------


@gluon.jit
def _load_tile(desc, coords, bar, dst):
    """One TMA box into ``dst``, completing on ``bar`` (the full box counts, zero fill included)."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, coords, bar, dst)


@gluon.jit
def _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
             b, kv_head, n_tiles, base, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """K/V tiles ``0 .. n_tiles-1`` as ring uses ``base .. base + n_tiles - 1``."""
    for j in range(n_tiles):
        slot, phase = _ring_slot(base + j, STAGES)
        # A fresh mbarrier counts as having completed the phase before phase 0, so the first
        # pass through the ring (parity 1) does not wait.
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        _load_tile(k_desc, [b, j * BLOCK_N, kv_head, 0], k_ready.index(slot), k_bufs.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        _load_tile(v_desc, [b, j * BLOCK_N, kv_head, 0], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, q_empty,
              seqlen_q, seqlen_k, num_heads, group_size, batch,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              NUM_CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr, PAIRS: gl.constexpr):
    """TMA warp: Q once per work item, then K/V tiles through the rings (waits on ``empty``)."""
    q_ready, k_ready, k_empty, v_ready, v_empty = bars
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * _WG
    if PERSISTENT:
        # One Q buffer per consumer with its own ready/empty pair: consumer c frees its Q buffer
        # after its last S = Q K^T of item n (or after its O store when O is staged in Q's
        # buffer); the load of item n + 1 waits for that (parity (n & 1) ^ 1: item 0 passes on
        # the fresh barrier, item n waits for the consumer's n-th release). Then this item's K/V
        # stream continues the ring where the previous item left it (``base``), so the next
        # item's first tiles load while the consumers finish the current one.
        base = 0
        n = 0  # work items so far
        SNAKE: gl.constexpr = CAUSAL and not PAIRS
        for r in range(_persistent_units(seqlen_q, num_heads, batch, SNAKE, PAIRS, BLOCK_M)):
            u = _persistent_unit(r, SNAKE)
            for h in range(_unit_items(u, seqlen_q, PAIRS, BLOCK_M)):
                b, head, row0 = _unit_item(u, h, seqlen_q, num_heads, batch, CAUSAL, PAIRS, BLOCK_M)
                n_tiles, _ = _key_tiles(row0, seqlen_q, seqlen_k, BLOCK_N, CAUSAL, BLOCK_M)
                for c in gl.static_range(NUM_CONSUMERS):
                    mbarrier.wait(q_empty.index(c), (n & 1) ^ 1)
                    _load_tile(q_desc, [b, row0 + c * _WG, head, 0], q_ready.index(c), q_bufs.index(c))
                _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                         b, head // group_size, n_tiles, base, BLOCK_N, STAGES)
                base += n_tiles
                n += 1
    else:
        b, head, row0 = _program_tile(seqlen_q, num_heads, batch, CAUSAL, BLOCK_M)
        n_tiles, _ = _key_tiles(row0, seqlen_q, seqlen_k, BLOCK_N, CAUSAL, BLOCK_M)
        mbarrier.expect(q_ready, NUM_CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(NUM_CONSUMERS):
            tma.async_copy_global_to_shared(q_desc, [b, row0 + c * _WG, head, 0], q_ready, q_bufs.index(c))
        _load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                 b, head // group_size, n_tiles, 0, BLOCK_N, STAGES)


# ---- consumers --------------------------------------------------------------------------------


@gluon.jit
def _issue_qk(q_smem, k_bufs, k_ready, j, STAGES: gl.constexpr, s_layout: gl.constexpr, HALF: gl.constexpr = False):
    """Wait for K ring use ``j`` and issue ``S = Q K^T`` asynchronously; returns the wgmma token.
    With ``HALF`` only the first half of the tile's keys (``s_layout`` is then the half width's)."""
    slot, phase = _ring_slot(j, STAGES)
    mbarrier.wait(k_ready.index(slot), phase)
    k_smem = _as_matrix(k_bufs.index(slot))
    if HALF:
        k_smem = k_smem.slice(0, k_smem.shape[0] // 2, dim=0)
    rows: gl.constexpr = q_smem.shape[0]
    cols: gl.constexpr = k_smem.shape[0]
    s0 = gl.zeros([rows, cols], gl.float32, s_layout)
    return warpgroup_mma(q_smem, k_smem.permute((1, 0)), s0, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(p, v_bufs, v_ready, acc, j, STAGES: gl.constexpr, HALF: gl.constexpr = False):
    """Wait for V ring use ``j`` and issue ``acc += P V`` asynchronously (P from registers; with
    ``HALF`` the first half of the tile's keys only)."""
    slot, phase = _ring_slot(j, STAGES)
    mbarrier.wait(v_ready.index(slot), phase)
    v_smem = _as_matrix(v_bufs.index(slot))
    if HALF:
        v_smem = v_smem.slice(0, v_smem.shape[0] // 2, dim=0)
    return warpgroup_mma(p, v_smem, acc, is_async=True)


@gluon.jit
def _release(empty, j, STAGES: gl.constexpr):
    """Tell the producer this warpgroup is done with ring use ``j``."""
    mbarrier.arrive(empty.index(j % STAGES))


@gluon.jit
def _as_a_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr):
    """``p`` cast to the input dtype in wgmma's register A-operand layout for ``O += P V``."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    return gl.convert_layout(p.to(dtype), a_layout)


@gluon.jit
def _take_turn(turn_bars, me: gl.constexpr, round):
    """Ping-pong: wait until it is consumer ``me``'s turn to issue GEMMs in ``round``.

    Consumers go in order 0, 1, .., NC-1, 0, .. Consumer 0's round r waits for phase r - 1 of
    its barrier (completed by the last consumer's round r - 1; round 0 waits on parity 1 of a
    fresh barrier and passes at once); consumer c > 0's round r waits for phase r of its
    barrier (completed by consumer c - 1's round r). No barrier can run two phases ahead of its
    waiter: its next phase needs this consumer's own next round first.
    """
    if me == 0:
        mbarrier.wait(turn_bars.index(me), (round & 1) ^ 1)
    else:
        mbarrier.wait(turn_bars.index(me), round & 1)


@gluon.jit
def _pass_turn(turn_bars, me: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    mbarrier.arrive(turn_bars.index((me + 1) % NUM_CONSUMERS))


@gluon.jit
def _skip_tiles(k_ready, k_empty, v_ready, v_empty, turn_bars, first, n_total, base, round0,
                ME: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """Release ring uses ``base + first .. base + n_total - 1`` that this warpgroup does not
    compute (``wg_tiles``: the other warpgroups' rows see more keys).

    Each release waits for the tile's ``ready`` first: an ``empty`` arrival for use ``u`` is
    only safe once the barrier's phase of use ``u - STAGES`` has completed (else it would count
    towards that phase), and ``ready`` of use ``u`` implies it (the producer waited for it before
    loading). With ``PINGPONG`` the skipped rounds (``round0 + j - 1``) are taken and passed at
    once, so every warpgroup runs the same rounds per item and the order stays 0, 1, .., 0, ..
    """
    for j in range(first, n_total):
        if PINGPONG:
            _take_turn(turn_bars, ME, round0 + j - 1)
            _pass_turn(turn_bars, ME, NUM_CONSUMERS)
        slot, phase = _ring_slot(base + j, STAGES)
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.wait(v_ready.index(slot), phase)
        mbarrier.arrive(v_empty.index(slot))


@gluon.jit
def _half_softmax(s_h, m_i, l_i, j, unmasked, rows, seqlen_k, shift, qk_scale,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, FUSED_MASK: gl.constexpr):
    """:func:`_softmax_tile` on the first half (``BLOCK_N // 2`` keys) of key tile ``j``: it is
    key tile ``2 j`` of half width; the row vectors move to the half-width layout and back (the
    same registers: both are the rows of an m64 wgmma accumulator)."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    row_h: gl.constexpr = gl.SliceLayout(1, s_h.type.layout)
    row_layout: gl.constexpr = m_i.type.layout
    p, m_h, l_h, alpha = _softmax_tile(s_h, gl.convert_layout(m_i, row_h), gl.convert_layout(l_i, row_h), 2 * j,
                                       2 * unmasked, gl.convert_layout(rows, row_h), seqlen_k, shift, qk_scale,
                                       HALF_N, CAUSAL, FUSED_MASK)
    return p, gl.convert_layout(m_h, row_layout), gl.convert_layout(l_h, row_layout), alpha


@gluon.jit
def _loop_simple(q_smem, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, q_empty,
                 n_tiles, unmasked, rows, seqlen_k, shift, qk_scale, base,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, RELEASE_Q: gl.constexpr, FUSED_MASK: gl.constexpr = False,
                 n_total=0, half_last=0, turn_bars=None, round0=0, ME: gl.constexpr = 0,
                 NUM_CONSUMERS: gl.constexpr = 2, WG_TILES: gl.constexpr = False, SKIP: gl.constexpr = False):
    """Key loop without cross-tile overlap: QK^T, wait, softmax, PV, wait. Returns acc, m, l.

    Ring uses are ``base + j``; with ``RELEASE_Q``, ``q_empty`` is arrived on once the last
    ``S`` is complete (Q is not read after that). With ``WG_TILES`` this warpgroup computes
    ``n_tiles`` of the item's ``n_total`` tiles, the last one halved when ``half_last`` (BLOCK_N
    128), and releases the rest (:func:`_skip_tiles`). With ``SKIP`` the same release, and
    ``n_tiles`` may be 0 (a warpgroup whose rows all lie past the query length)."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    HALF: gl.constexpr = WG_TILES and BLOCK_N == 2 * _WG
    m_i = gl.full([_WG], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([_WG], gl.float32, row_layout)
    acc = gl.zeros([_WG, HEAD_DIM], gl.float32, o_layout)
    if HALF:
        n_loop = n_tiles - half_last
    else:
        n_loop = n_tiles
    for j in range(n_loop):
        s = _issue_qk(q_smem, k_bufs, k_ready, base + j, STAGES, s_layout)
        s = warpgroup_mma_wait(0, deps=(s,))
        _release(k_empty, base + j, STAGES)
        if RELEASE_Q:
            mbarrier.arrive(q_empty, pred=j == n_tiles - 1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, unmasked, rows, seqlen_k, shift, qk_scale,
                                           BLOCK_N, CAUSAL, FUSED_MASK)
        acc = _rescale(acc, alpha)
        acc = _issue_pv(_as_a_operand(p, q_smem.dtype, o_layout), v_bufs, v_ready, acc, base + j, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _release(v_empty, base + j, STAGES)
    if HALF:
        if half_last != 0:
            # The last tile (index n_tiles - 1 >= 1), first 64 keys only.
            jl = n_tiles - 1
            s_h = _issue_qk(q_smem, k_bufs, k_ready, base + jl, STAGES, wgmma_layout(BLOCK_N // 2), True)
            s_h = warpgroup_mma_wait(0, deps=(s_h,))
            _release(k_empty, base + jl, STAGES)
            if RELEASE_Q:
                mbarrier.arrive(q_empty)
            p_h, m_i, l_i, alpha_h = _half_softmax(s_h, m_i, l_i, jl, unmasked, rows, seqlen_k, shift, qk_scale,
                                                 BLOCK_N, CAUSAL, FUSED_MASK)
            acc = _rescale(acc, alpha_h)
            acc = _issue_pv(_as_a_operand(p_h, q_smem.dtype, o_layout), v_bufs, v_ready, acc, base + jl, STAGES, True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _release(v_empty, base + jl, STAGES)
    if WG_TILES or SKIP:
        if RELEASE_Q:
            mbarrier.arrive(q_empty, pred=n_tiles == 0)
        _skip_tiles(k_ready, k_empty, v_ready, v_empty, turn_bars, n_tiles, n_total, base, round0,
                    ME, STAGES, False, NUM_CONSUMERS)
    return acc, m_i, l_i


@gluon.jit
def _schedule_fence(done_bar):
    """Keep the softmax above the next ``warpgroup_mma_wait``.

    ptxas schedules ``wgmma.wait_group`` as early as it may, so without this the whole softmax
    of tile j sinks below the wait for ``P_{j-1} V_{j-1}`` and nothing overlaps (seen in the
    SASS of every specialization). Waiting on an mbarrier whose phase 0 completed long ago and
    which never completes another phase (``q_ready`` of the non-persistent kernel; a dedicated
    barrier, arrived on once at start, in the persistent one, whose Q barriers cycle) costs one
    non-blocking try-wait, but its retry loop ends the basic block, which ptxas does not
    schedule across.
    """
    mbarrier.wait(done_bar, 0)


@gluon.jit
def _loop_pipelined(q_smem, fence_bar, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, turn_bars, q_empty,
                    n_tiles, unmasked, rows, seqlen_k, shift, qk_scale, base, round0,
                    ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                    NUM_CONSUMERS: gl.constexpr, RELEASE_Q: gl.constexpr, FUSED_MASK: gl.constexpr = False,
                    n_total=0, half_last=0, WG_TILES: gl.constexpr = False):
    """Key loop with the softmax of tile j overlapping ``P_{j-1} V_{j-1}`` (see the module
    docstring). Ring uses are ``base + j``, ping-pong rounds ``round0 + j - 1``; with
    ``RELEASE_Q``, ``q_empty`` is arrived on once the last ``S`` is complete. With ``WG_TILES``
    this warpgroup computes ``n_tiles`` of the item's ``n_total`` tiles, the last one (index >= 1)
    halved when ``half_last`` (BLOCK_N 128: a peeled last iteration of half width), and releases
    the rest (:func:`_skip_tiles`). Returns acc, m, l."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    HALF: gl.constexpr = WG_TILES and BLOCK_N == 2 * _WG

    # Prologue: tile 0's scores and probabilities; O starts at 0, so no rescale.
    s = _issue_qk(q_smem, k_bufs, k_ready, base, STAGES, s_layout)
    s = warpgroup_mma_wait(0, deps=(s,))
    _release(k_empty, base, STAGES)
    if RELEASE_Q:
        mbarrier.arrive(q_empty, pred=n_tiles == 1)
    m_i = gl.full([_WG], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([_WG], gl.float32, row_layout)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, unmasked, rows, seqlen_k, shift, qk_scale,
                                       BLOCK_N, CAUSAL, FUSED_MASK)
    p_op = _as_a_operand(p, dtype, o_layout)
    acc = gl.zeros([_WG, HEAD_DIM], gl.float32, o_layout)

    if HALF:
        n_loop = n_tiles - half_last
    else:
        n_loop = n_tiles
    for j in range(1, n_loop):
        if PINGPONG:
            _take_turn(turn_bars, ME, round0 + j - 1)
        s = _issue_qk(q_smem, k_bufs, k_ready, base + j, STAGES, s_layout)
        acc = _issue_pv(p_op, v_bufs, v_ready, acc, base + j - 1, STAGES)
        if PINGPONG:
            _pass_turn(turn_bars, ME, NUM_CONSUMERS)
        s = warpgroup_mma_wait(1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may still run
        _release(k_empty, base + j, STAGES)
        if RELEASE_Q:
            mbarrier.arrive(q_empty, pred=j == n_tiles - 1)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, unmasked, rows, seqlen_k, shift, qk_scale,
                                           BLOCK_N, CAUSAL, FUSED_MASK)
        _schedule_fence(fence_bar)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _release(v_empty, base + j - 1, STAGES)
        acc = _rescale(acc, alpha)
        p_op = _as_a_operand(p, dtype, o_layout)

    if HALF:
        if half_last != 0:
            # Peeled last iteration (j = n_tiles - 1 >= 1): S of the tile's first 64 keys
            # alongside P_{j-1} V_{j-1}, then the half-width P V.
            jl = n_tiles - 1
            if PINGPONG:
                _take_turn(turn_bars, ME, round0 + jl - 1)
            s_h = _issue_qk(q_smem, k_bufs, k_ready, base + jl, STAGES, wgmma_layout(BLOCK_N // 2), True)
            acc = _issue_pv(p_op, v_bufs, v_ready, acc, base + jl - 1, STAGES)
            if PINGPONG:
                _pass_turn(turn_bars, ME, NUM_CONSUMERS)
            s_h = warpgroup_mma_wait(1, deps=(s_h,))
            _release(k_empty, base + jl, STAGES)
            if RELEASE_Q:
                mbarrier.arrive(q_empty)
            p_h, m_i, l_i, alpha_h = _half_softmax(s_h, m_i, l_i, jl, unmasked, rows, seqlen_k, shift, qk_scale,
                                                 BLOCK_N, CAUSAL, FUSED_MASK)
            _schedule_fence(fence_bar)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _release(v_empty, base + jl - 1, STAGES)
            acc = _rescale(acc, alpha_h)
            acc = _issue_pv(_as_a_operand(p_h, dtype, o_layout), v_bufs, v_ready, acc, base + jl, STAGES, True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _release(v_empty, base + jl, STAGES)
        else:
            acc = _issue_pv(p_op, v_bufs, v_ready, acc, base + n_tiles - 1, STAGES)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            _release(v_empty, base + n_tiles - 1, STAGES)
    else:
        acc = _issue_pv(p_op, v_bufs, v_ready, acc, base + n_tiles - 1, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        _release(v_empty, base + n_tiles - 1, STAGES)
    if WG_TILES:
        _skip_tiles(k_ready, k_empty, v_ready, v_empty, turn_bars, n_tiles, n_total, base, round0,
                    ME, STAGES, PINGPONG, NUM_CONSUMERS)
    return acc, m_i, l_i


@gluon.jit
def _write_results(acc, m_i, l_i, o_desc, o_buf, Lse, stride_lb, stride_lh, stride_ls,
                   b, head, row0, rows, seqlen_q, WRITE_LSE: gl.constexpr, WAIT_STORE: gl.constexpr):
    """``O = acc / l`` through shared memory and one TMA store (rows >= seqlen_q are dropped by
    the descriptor's bounds); LSE (natural log) with a masked store. With ``WAIT_STORE`` the
    store has finished reading ``o_buf`` on return; otherwise the caller waits before reusing
    it."""
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
    if WAIT_STORE:
        tma.store_wait(0)


@gluon.jit
def _consumer(q_bufs, o_bufs, k_bufs, v_bufs, bars, q_empty, turn_bars, fence_bar, o_desc, Lse,
              stride_lb, stride_lh, stride_ls,
              seqlen_q, seqlen_k, num_heads, batch, qk_scale,
              ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr,
              PIPELINE: gl.constexpr, PINGPONG: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
              PERSISTENT: gl.constexpr, SEPARATE_O: gl.constexpr, WG_TILES_OPT: gl.constexpr,
              SHARED_O: gl.constexpr, o_turn, PAIRS: gl.constexpr):
    """Consumer warpgroup ``ME``: query rows ``[row0 + 64 ME, row0 + 64 ME + 64)`` of each tile."""
    WG_TILES: gl.constexpr = WG_TILES_OPT and CAUSAL  # per-warpgroup key ranges (causal only)
    RELEASE_Q: gl.constexpr = SEPARATE_O or SHARED_O  # Q's buffer is free after the last S
    q_ready, k_ready, k_empty, v_ready, v_empty = bars
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * _WG
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    shift = seqlen_k - seqlen_q
    q_buf = q_bufs.index(ME)
    if PERSISTENT:
        my_q_ready = q_ready.index(ME)
        my_q_empty = q_empty.index(ME)
        # Q's own buffer without SEPARATE_O or SHARED_O (the kernel passes q_bufs); the shared one.
        o_buf = o_bufs.index(0 if SHARED_O else ME)
        base = 0  # ring uses before this item (both rings, all consumers, the producer agree)
        n = 0  # work items so far
        SNAKE: gl.constexpr = CAUSAL and not PAIRS
        for r in range(_persistent_units(seqlen_q, num_heads, batch, SNAKE, PAIRS, BLOCK_M)):
            u = _persistent_unit(r, SNAKE)
            for h in range(_unit_items(u, seqlen_q, PAIRS, BLOCK_M)):
                _, _, tile_row0 = _unit_item(u, h, seqlen_q, num_heads, batch, CAUSAL, PAIRS, BLOCK_M)
                n_tiles, unmasked = _key_tiles(tile_row0, seqlen_q, seqlen_k, BLOCK_N, CAUSAL, BLOCK_M)
                n_mine = n_tiles
                half_last = 0
                if WG_TILES:
                    n_mine, unmasked, half_last = _wg_key_tiles(tile_row0 + ME * _WG, seqlen_q, seqlen_k, BLOCK_N,
                                                                BLOCK_N == 2 * _WG)
                if not PIPELINE:
                    # Rows all past seqlen_q (the last query tile of a 192-row tiling when
                    # seqlen_q % 192 <= 128): compute nothing, release the tiles.
                    active = (tile_row0 + ME * _WG < seqlen_q).to(gl.int32)
                    n_mine = n_mine * active
                    half_last = half_last * active
                # The loop gets each row's last visible key (shift 0) and nothing else per item that
                # lives through it: (b, head, rows) are recomputed from (u, h) after it (at d128 causal,
                # keeping them live spills).
                last_key = tile_row0 + ME * _WG + shift + gl.arange(0, _WG, layout=gl.SliceLayout(1, s_layout))
                mbarrier.wait(my_q_ready, n & 1)  # the n-th load into this Q buffer
                if PIPELINE:
                    # Ping-pong rounds: n_tiles - 1 per item, so base - n before this one.
                    acc, m_i, l_i = _loop_pipelined(_as_matrix(q_buf), fence_bar, k_bufs, v_bufs, k_ready, k_empty,
                                                    v_ready, v_empty, turn_bars, my_q_empty, n_mine, unmasked, last_key,
                                                    seqlen_k, 0, qk_scale, base, base - n,
                                                    ME, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG, NUM_CONSUMERS,
                                                    RELEASE_Q, True, n_tiles, half_last, WG_TILES)
                else:
                    acc, m_i, l_i = _loop_simple(_as_matrix(q_buf), k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                                 my_q_empty, n_mine, unmasked, last_key, seqlen_k, 0, qk_scale, base,
                                                 HEAD_DIM, BLOCK_N, STAGES, CAUSAL, RELEASE_Q, True,
                                                 n_tiles, half_last, turn_bars, base - n, ME, NUM_CONSUMERS, WG_TILES,
                                                 True)
                base += n_tiles
                b, head, tile_row0 = _unit_item(u, h, seqlen_q, num_heads, batch, CAUSAL, PAIRS, BLOCK_M)
                row0 = tile_row0 + ME * _WG
                rows = row0 + gl.arange(0, _WG, layout=gl.SliceLayout(1, s_layout))
                if SEPARATE_O:
                    # The previous item's O store must have finished reading o_buf (the compiler puts
                    # a warpgroup barrier between this wait and the shared-memory writes below).
                    tma.store_wait(0)
                    _write_results(acc, m_i, l_i, o_desc, o_buf, Lse, stride_lb, stride_lh, stride_ls,
                                   b, head, row0, rows, seqlen_q, WRITE_LSE, False)
                elif SHARED_O:
                    # Consumers take the one O buffer in order 0, 1, .. per item (round n), each
                    # passing it on once its store has read it.
                    _take_turn(o_turn, ME, n)
                    _write_results(acc, m_i, l_i, o_desc, o_buf, Lse, stride_lb, stride_lh, stride_ls,
                                   b, head, row0, rows, seqlen_q, WRITE_LSE, True)
                    _pass_turn(o_turn, ME, NUM_CONSUMERS)
                else:
                    # O goes through Q's buffer: free it for the next Q only once the store read it.
                    _write_results(acc, m_i, l_i, o_desc, o_buf, Lse, stride_lb, stride_lh, stride_ls,
                                   b, head, row0, rows, seqlen_q, WRITE_LSE, True)
                    mbarrier.arrive(my_q_empty)
                n += 1
        tma.store_wait(0)
    else:
        b, head, tile_row0 = _program_tile(seqlen_q, num_heads, batch, CAUSAL, BLOCK_M)
        n_tiles, unmasked = _key_tiles(tile_row0, seqlen_q, seqlen_k, BLOCK_N, CAUSAL, BLOCK_M)
        row0 = tile_row0 + ME * _WG
        n_mine = n_tiles
        half_last = 0
        if WG_TILES:
            n_mine, unmasked, half_last = _wg_key_tiles(row0, seqlen_q, seqlen_k, BLOCK_N, BLOCK_N == 2 * _WG)
        rows = row0 + gl.arange(0, _WG, layout=gl.SliceLayout(1, s_layout))
        mbarrier.wait(q_ready, 0)
        if PIPELINE:
            acc, m_i, l_i = _loop_pipelined(_as_matrix(q_buf), q_ready, k_bufs, v_bufs, k_ready, k_empty,
                                            v_ready, v_empty, turn_bars, q_empty, n_mine, unmasked, rows, seqlen_k,
                                            shift, qk_scale, 0, 0,
                                            ME, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, PINGPONG, NUM_CONSUMERS, False,
                                            False, n_tiles, half_last, WG_TILES)
        else:
            acc, m_i, l_i = _loop_simple(_as_matrix(q_buf), k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                                         q_empty, n_mine, unmasked, rows, seqlen_k, shift, qk_scale, 0,
                                         HEAD_DIM, BLOCK_N, STAGES, CAUSAL, False, False,
                                         n_tiles, half_last, turn_bars, 0, ME, NUM_CONSUMERS, WG_TILES)
        # Q is dead once the last S was waited for: its buffer stages this warpgroup's output.
        _write_results(acc, m_i, l_i, o_desc, q_buf, Lse, stride_lb, stride_lh, stride_ls,
                       b, head, row0, rows, seqlen_q, WRITE_LSE, True)


# ---- kernel -----------------------------------------------------------------------------------


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
    PERSISTENT: gl.constexpr = False, NUM_CONSUMERS: gl.constexpr = 2, SEPARATE_O: gl.constexpr = False,
    WG_TILES: gl.constexpr = False, SHARED_O: gl.constexpr = False, PAIRS: gl.constexpr = False,
):
    """Grid ``(m_tiles * Hq * B,)``, or ``(min(#SMs, units),)`` with ``PERSISTENT`` (units: work
    items, or with ``PAIRS`` pairs of them, see :func:`_unit_item`);
    4 warps (+ 4 per extra consumer + 1 producer warp in the partitions).

    Descriptors: q/o ``[B, Sq, Hq, D]`` box ``[1, 64, 1, D]``; k/v ``[B, Sk, Hkv, D]`` box
    ``[1, BLOCK_N, 1, D]``. ``Lse`` fp32 ``[B, Hq, Sq]`` (strides given) when ``WRITE_LSE``.
    """
    gl.static_assert(not PINGPONG or PIPELINE, "PINGPONG needs PIPELINE")
    gl.static_assert(NUM_CONSUMERS == 2 or NUM_CONSUMERS == 3, "2 or 3 consumer warpgroups")
    gl.static_assert(not SEPARATE_O or PERSISTENT, "SEPARATE_O is a persistent-kernel option")
    gl.static_assert(not SHARED_O or (PERSISTENT and not SEPARATE_O), "SHARED_O: persistent, without SEPARATE_O")
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    if SEPARATE_O:
        o_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    elif SHARED_O:
        o_bufs = gl.allocate_shared_memory(dtype, [1] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_bufs = q_bufs
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    if PERSISTENT:
        q_ready = _alloc_barriers(NUM_CONSUMERS, 1)  # one per consumer's Q buffer
        q_empty = _alloc_barriers(NUM_CONSUMERS, 1)
        fence_bar = _alloc_barriers(1, 1).index(0)  # completes phase 0 below, then never again
    else:
        q_ready = _alloc_barriers(1, 1).index(0)
        q_empty = q_ready  # unused
        fence_bar = q_ready
    k_ready = _alloc_barriers(STAGES, 1)
    v_ready = _alloc_barriers(STAGES, 1)
    k_empty = _alloc_barriers(STAGES, NUM_CONSUMERS)  # every consumer releases each stage
    v_empty = _alloc_barriers(STAGES, NUM_CONSUMERS)
    turn_bars = _alloc_barriers(NUM_CONSUMERS, 1)
    if SHARED_O:
        o_turn = _alloc_barriers(NUM_CONSUMERS, 1)  # whose turn it is to use the O buffer
    else:
        o_turn = turn_bars  # unused
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before first use
    if PERSISTENT:
        mbarrier.arrive(fence_bar)
    bars = (q_ready, k_ready, k_empty, v_ready, v_empty)

    # The argument lists are spelled out: Gluon 3.6's frontend neither binds a function into a
    # tuple variable nor concatenates tuples that hold constexprs.
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (q_bufs, o_bufs, k_bufs, v_bufs, bars, q_empty, turn_bars, fence_bar, o_desc, Lse,
                         stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, num_heads, batch, qk_scale,
                         0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, PIPELINE, PINGPONG, NUM_CONSUMERS,
                         PERSISTENT, SEPARATE_O, WG_TILES, SHARED_O, o_turn, PAIRS)),
            (_consumer, (q_bufs, o_bufs, k_bufs, v_bufs, bars, q_empty, turn_bars, fence_bar, o_desc, Lse,
                         stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, num_heads, batch, qk_scale,
                         1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, PIPELINE, PINGPONG, NUM_CONSUMERS,
                         PERSISTENT, SEPARATE_O, WG_TILES, SHARED_O, o_turn, PAIRS)),
            (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, q_empty,
                         seqlen_q, seqlen_k, num_heads, group_size, batch, BLOCK_N, STAGES, CAUSAL,
                         NUM_CONSUMERS, PERSISTENT, PAIRS)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_bufs, o_bufs, k_bufs, v_bufs, bars, q_empty, turn_bars, fence_bar, o_desc, Lse,
                         stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, num_heads, batch, qk_scale,
                         0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, PIPELINE, PINGPONG, NUM_CONSUMERS,
                         PERSISTENT, SEPARATE_O, WG_TILES, SHARED_O, o_turn, PAIRS)),
            (_consumer, (q_bufs, o_bufs, k_bufs, v_bufs, bars, q_empty, turn_bars, fence_bar, o_desc, Lse,
                         stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, num_heads, batch, qk_scale,
                         1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, PIPELINE, PINGPONG, NUM_CONSUMERS,
                         PERSISTENT, SEPARATE_O, WG_TILES, SHARED_O, o_turn, PAIRS)),
            (_consumer, (q_bufs, o_bufs, k_bufs, v_bufs, bars, q_empty, turn_bars, fence_bar, o_desc, Lse,
                         stride_lb, stride_lh, stride_ls, seqlen_q, seqlen_k, num_heads, batch, qk_scale,
                         2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, PIPELINE, PINGPONG, NUM_CONSUMERS,
                         PERSISTENT, SEPARATE_O, WG_TILES, SHARED_O, o_turn, PAIRS)),
            (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, bars, q_empty,
                         seqlen_q, seqlen_k, num_heads, group_size, batch, BLOCK_N, STAGES, CAUSAL,
                         NUM_CONSUMERS, PERSISTENT, PAIRS)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# ---- host side --------------------------------------------------------------------------------


def _tma_ok(x: torch.Tensor) -> bool:
    """TMA: 16-byte aligned base and strides, last dim contiguous, no broadcast (stride-0) dims."""
    return tma_aligned(x, broadcast=False)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`gluon_attention_forward` handles these inputs (shapes as in its docstring)."""
    if not (q.is_cuda and k.device == q.device and v.device == q.device):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return False
    if not is_sm90(q.device):  # wgmma exists on sm_90a only
        return False
    if q.dtype not in TORCH_TO_GL or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS or k.shape[-1] != head_dim or q.shape[0] != k.shape[0]:
        return False
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        return False
    if min(*q.shape[:3], *k.shape[:3]) < 1:  # empty tensors: the Triton path launches nothing
        return False
    return all(_tma_ok(x) for x in (q, k, v))


def output_ok(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` can take the kernel's output for ``q`` (same shape and dtype, TMA-ready)."""
    return out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and _tma_ok(out)


def launch_args(q, k, v, out, lse, causal: bool, softmax_scale: float, config: GluonConfig):
    """``(grid, args, kwargs)`` of one launch (also used to compile without a GPU)."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    lse_arg = lse if lse is not None else out
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    m_tiles = triton.cdiv(seqlen_q, WG_ROWS * config.num_consumers)
    items = m_tiles * num_heads * batch
    max_programs = config.max_programs or num_sms(q.device)
    pairs = use_pairs(causal, config, m_tiles, num_heads * batch, max_programs)
    units = pair_units(m_tiles, num_heads * batch) if pairs else items
    grid = (min(units, max_programs) if config.persistent else items,)
    args = (make_descriptor(q, WG_ROWS), make_descriptor(k, config.block_n), make_descriptor(v, config.block_n),
            make_descriptor(out, WG_ROWS), lse_arg, *lse_strides,
            seqlen_q, seqlen_k, num_heads, num_heads // num_kv_heads, batch, softmax_scale * LOG2E)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_N=config.block_n, STAGES=config.stages, CAUSAL=causal,
                  WRITE_LSE=lse is not None, PIPELINE=config.pipeline, PINGPONG=config.pingpong,
                  CONSUMER_REGS=config.consumer_regs, PRODUCER_REGS=config.producer_regs,
                  PERSISTENT=config.persistent, NUM_CONSUMERS=config.num_consumers,
                  SEPARATE_O=o_separate(head_dim, config))
    kwargs["WG_TILES"] = config.wg_tiles
    kwargs["SHARED_O"] = o_shared(head_dim, config)
    kwargs["PAIRS"] = pairs
    return grid, args, kwargs




def maxnreg_for(config: GluonConfig) -> int:
    """Launch register limit: 64K registers over (consumers + 1) warpgroups, multiple of 8.

    With 2 consumers, 3 warpgroups share 64K: 168 per thread at launch (65536 / 384, rounded
    down to a multiple of 8); the partitions then move them with setmaxnreg (240 + 240 + 24 =
    504 = 3 x 168). With 3 consumers, 4 warpgroups: 128 per thread at launch, 160 + 160 + 160
    + 24 (<= 4 x 128) after setmaxnreg.
    """
    return (65536 // (128 * (config.num_consumers + 1))) // 8 * 8


def gluon_attention_forward(q, k, v, out, lse, *, causal: bool, softmax_scale: float,
                            config: GluonConfig | None = None) -> None:
    """Attention forward with the Gluon kernel into ``out`` (and ``lse`` unless None).

    Args:
        q: ``[B, Sq, Hq, D]`` bf16/fp16; k, v: ``[B, Sk, Hkv, D]``, ``Hq % Hkv == 0``; D in
            64/128/256; last dim contiguous, base and strides 16-byte aligned (:func:`supported`).
        out: like q (written); lse: fp32 ``[B, Hq, Sq]`` or None.
        causal: bottom-right aligned mask (query i sees keys j <= i + Sk - Sq).
        softmax_scale: scale of ``q k^T``.
        config: tile shape and overlap switches (default: ``CONFIGS[D]``; ``PERSISTENT_CONFIGS[D]``
            and ``D64_3WG`` are the persistent and 3-warpgroup variants).
    """
    if not supported(q, k, v) or not output_ok(q, out):
        raise ValueError("inputs not supported by the Gluon prefill kernel (see prefill_gluon.supported)")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (q.shape[0], q.shape[2], q.shape[1])):
        raise ValueError(f"lse must be float32 [B, Hq, Sq], got {lse.dtype} {tuple(lse.shape)}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")
    with torch.cuda.device(q.device):
        launch(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, config=config or CONFIGS[q.shape[-1]])


def launch(q, k, v, out, lse, *, causal: bool, softmax_scale: float, config: GluonConfig) -> None:
    """:func:`gluon_attention_forward` without its checks, for callers that made them
    (``prefill.attention_forward``: validated inputs, :func:`supported` and ``out`` TMA-ready),
    on the current CUDA device (the interface sets ``q``'s)."""
    grid, args, kwargs = launch_args(q, k, v, out, lse, causal, softmax_scale, config)
    _launch_kernel(grid, *args, **kwargs, num_warps=4, maxnreg=maxnreg_for(config), **exponent_options(softmax_scale))


_launch_kernel = Launcher(_gluon_attention_kernel)
