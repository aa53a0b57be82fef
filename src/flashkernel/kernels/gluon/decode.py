"""Decode over a KV cache in Gluon for Hopper (sm_90a): a persistent kernel whose producer warp
streams K/V with TMA through one shared-memory ring across all of a program's work.

Why: the Triton decode kernel (``decode.py``) waits on two dependent reads before a paged split's
first K/V load (the length, then the block-table entry); over pages of 16 at B=1, 1k that left a
step 12-16% slower than over a contiguous cache (docs/perf-notes.md). Here the look-ups are the
producer warp's only work, issued ahead of the consumer, and the TMA engine does the copies.

Work items are ``(batch, kv_head, split)``, numbered split fastest; program ``p`` of ``G`` (one
per SM at most) runs items ``p, p + G, ...``, and the producer loads the next item's first tiles
while the consumer still computes the current one. One item: the ``rows = group * T`` query rows
of one KV head (row ``r`` is token ``r // group`` of query head ``kv_head * group + r % group``,
as in ``decode.py``) against the split's run of whole ``BLOCK_N`` tiles of the context.

* **Producer** (1 warp): per item, the sequence length, then per tile one mbarrier expecting K
  and V, and the TMA loads: a contiguous cache ``[B, S_max, Hkv, D]`` as a rank-4 box ``[1,
  BLOCK_N, 1, D]`` at ``[b, start, kv_head, 0]`` (rows past ``S_max`` are zero-filled); a paged
  cache ``[num_blocks, page, Hkv, D]`` with pages of at least ``BLOCK_N`` keys one box per tile
  at the page's slot, smaller pages (>= 16 keys) one box per page into the tile's slices. Page
  look-ups clamp the column to the last valid key's and the block to ``[0, num_blocks)``, as the
  Triton kernel does.
* **Consumer** (the default 4-warp partition): the item's query rows (at most 16, zeros past
  ``rows``) are loaded into registers as the A operand of warp-level ``mma.sync`` (``mma_v2``:
  16-row tiles, so 4 real rows of a GQA group of 4 waste 3/4 of the MMA, where a warpgroup's
  64-row wgmma wastes 15/16; the 4 warps split the keys of ``S`` and the columns of ``O``), K
  and V are read from the ring into registers (``ldmatrix``), and the online softmax runs in fp32 with exp2 (the prefill kernel's
  ``_softmax_tile``). A tile holding keys past the length (the last one of a split) has those
  V rows zeroed in shared memory before ``P V``: the cache past a sequence's length is whatever
  the caller left there, NaN included, and ``0 * NaN`` is NaN. The results go out with masked
  pointer stores: the final output when there is one split, else fp32 partials and their LSE
  for ``combine.py``, exactly as the Triton kernel writes them.

A quantized cache (float8_e4m3fn or int8, scales per tensor or per KV head; ``QUANTIZED``) streams
through the same ring at half the bytes; the consumer converts K and V to fp16 in registers after
``ldmatrix`` (exact), takes q in fp16 scaled by a power of two as the Triton kernel does, folds K's
scale into the scores' scale and multiplies the output by V's. Per-token scales run on the
Triton kernel (they would need the page look-ups in the consumer, or TMA boxes of one float).

Measured on the H200 (docs/perf-notes.md, "Decode in Gluon"): with no math at all the consumer-less stream runs at the Triton kernel's
speed (the cache's layout and the HBM set the pace, not the kernel); a 64-row wgmma consumer was
2-5% slower than Triton, this one -2..+5% on contiguous caches and 2-7% faster over pages at
B=1. Its host cost is higher: Triton's launcher encodes the two TMA descriptors at every launch
(an eager step ~25-45 us more than the Triton kernel's), so the dispatch layer takes it by
default only for paged caches, whose steps serving engines replay as CUDA graphs. Plain attention only (``causal`` or not), bf16/fp16, head dims 64/128/256,
``group * T <= 16`` (more rows in 16-row MMAs would hold a whole K tile per warp: spills),
TMA-compatible caches; :func:`supported` says which calls qualify and
``decode.use_gluon`` where the kernel is used by default.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .._common import exponent_options, is_sm90, tma_aligned
from .._launch import Launcher
from ..combine import combine
from ..decode import split_targets
from .common import TORCH_TO_GL, _alloc_barriers, _as_matrix, _rescale, _ring_slot, _softmax_tile, make_descriptor

LOG2E = math.log2(math.e)
BLOCK_M = 16  # query rows (group * T) of one item at most: the M of mma.sync; 4 warps side by side
_BLOCK_M = gl.constexpr(BLOCK_M)
HEAD_DIMS = (64, 128, 256)
MIN_PAGE = 16  # smaller pages would need a TMA box per few keys; the Triton kernel takes them


@dataclasses.dataclass(frozen=True)
class GluonDecodeConfig:
    block_n: int
    stages: int
    producer_regs: int = 40
    # At most this many programs (None: one per SM). For tests: a small grid makes every program
    # run many work items through one ring.
    max_programs: int | None = None


def config_for(head_dim: int, tuned) -> GluonDecodeConfig:
    """The tile and ring depth for ``head_dim`` from a ``tuning.DecodeTuning``
    (``tuned/decode.json``: head dim 128 measured on the H200, the others keep ~96 KB in
    flight, unmeasured)."""
    block_n, stages = tuned.gluon_configs[head_dim]
    return GluonDecodeConfig(block_n=block_n, stages=stages)


# ---- device code ----------------------------------------------------------------------------------


@gluon.jit
def _item(item, SeqLens, stride_sl, appended, capacity, num_kv_heads, num_splits, BLOCK_N: gl.constexpr):
    """``(batch, kv_head, length, lo, n_tiles)`` of work item ``item``: the split's keys are
    ``[lo, lo + n_tiles * BLOCK_N)`` cut at ``length`` (the Triton kernel's split rule)."""
    split = item % num_splits
    rest = item // num_splits
    kv_head = rest % num_kv_heads
    batch = rest // num_kv_heads
    length = gl.load(SeqLens + batch.to(gl.int64) * stride_sl) + appended
    length = gl.minimum(gl.maximum(length, 0), capacity)
    per_split = gl.cdiv(gl.cdiv(length, BLOCK_N), num_splits)
    lo = split * per_split * BLOCK_N
    hi = gl.minimum(lo + per_split * BLOCK_N, length)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    return batch, kv_head, length, lo, n_tiles


@gluon.jit
def _page(bt_row, stride_btn, key, last, num_blocks, PAGE_SIZE: gl.constexpr):
    """Block holding ``key`` (its column clamped to the last valid key's, the block to the pool)."""
    col = gl.minimum(key, last) // PAGE_SIZE
    block = gl.load(bt_row + col * stride_btn)
    return gl.minimum(gl.maximum(block, 0), num_blocks - 1)


@gluon.jit
def _producer(k_desc, v_desc, k_bufs, v_bufs, ready, empty, BlockTable, SeqLens,
              stride_btb, stride_btn, stride_sl, appended, capacity, num_blocks, num_kv_heads,
              num_splits, num_items,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """TMA warp: every tile of every item of this program through the ring, in order."""
    BOX: gl.constexpr = k_desc.block_type.shape[1]  # keys per TMA box
    use = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        batch, kv_head, length, lo, n_tiles = _item(item, SeqLens, stride_sl, appended, capacity,
                                                     num_kv_heads, num_splits, BLOCK_N)
        bt_row = BlockTable + batch.to(gl.int64) * stride_btb
        last = gl.maximum(length - 1, 0)
        for j in range(n_tiles):
            slot, phase = _ring_slot(use, STAGES)
            mbarrier.wait(empty.index(slot), phase ^ 1)  # a fresh barrier passes parity 1
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * (BLOCK_N // BOX) * k_desc.block_type.nbytes)
            start = lo + j * BLOCK_N
            k_dst = k_bufs.index(slot)
            v_dst = v_bufs.index(slot)
            if PAGE_SIZE == 0:
                tma.async_copy_global_to_shared(k_desc, [batch, start, kv_head, 0], bar, k_dst)
                tma.async_copy_global_to_shared(v_desc, [batch, start, kv_head, 0], bar, v_dst)
            elif PAGE_SIZE >= BLOCK_N:
                block = _page(bt_row, stride_btn, start, last, num_blocks, PAGE_SIZE)
                slot_in_page = start % PAGE_SIZE
                tma.async_copy_global_to_shared(k_desc, [block, slot_in_page, kv_head, 0], bar, k_dst)
                tma.async_copy_global_to_shared(v_desc, [block, slot_in_page, kv_head, 0], bar, v_dst)
            else:
                for p in gl.static_range(BLOCK_N // PAGE_SIZE):
                    block = _page(bt_row, stride_btn, start + p * PAGE_SIZE, last, num_blocks, PAGE_SIZE)
                    tma.async_copy_global_to_shared(k_desc, [block, 0, kv_head, 0], bar,
                                                    k_dst.slice(p * PAGE_SIZE, PAGE_SIZE, dim=1))
                    tma.async_copy_global_to_shared(v_desc, [block, 0, kv_head, 0], bar,
                                                    v_dst.slice(p * PAGE_SIZE, PAGE_SIZE, dim=1))
            use += 1


@gluon.jit
def _load_q_rows(Q, batch, kv_head, stride_qb, stride_qt, stride_qh, group, rows,
                 BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The item's query rows ``[BLOCK_M, D]`` in registers, zeros below ``rows``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    token = (r // group).to(gl.int64)
    head = (kv_head * group + r % group).to(gl.int64)
    offs = batch.to(gl.int64) * stride_qb + token * stride_qt + head * stride_qh
    return gl.load(Q + gl.expand_dims(offs, 1) + gl.expand_dims(d, 0), mask=gl.expand_dims(r < rows, 1), other=0.0)


@gluon.jit
def _queries_as_f16(q):
    """Query rows over a quantized cache, as the Triton kernel takes them
    (``decode._queries_as_f16``): ``(q * 2**e as float16, 2**-e)``, ``e`` per item so the
    largest magnitude lands in ``[2**14, 2**15)``."""
    x = q.to(gl.float32)
    largest = gl.max(gl.max(gl.abs(x), 1), 0)
    binade = gl.minimum(gl.maximum((largest.to(gl.int32, bitcast=True) >> 23) - 127, -100), 100)
    up = ((141 - binade) << 23).to(gl.float32, bitcast=True)  # 2 ** (14 - binade)
    down = ((113 + binade) << 23).to(gl.float32, bitcast=True)  # 2 ** (binade - 14)
    return (x * up).to(gl.float16), down


@gluon.jit
def _zero_rows_past(v_smem, valid, HEAD_DIM: gl.constexpr):
    """Zero rows ``>= valid`` of the ``[BLOCK_N, D]`` V tile in shared memory (keys past the
    length: whatever the cache holds there must not reach ``P V``)."""
    BLOCK_N: gl.constexpr = v_smem.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = v_smem.load(layout)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    v = gl.where(gl.expand_dims(keys < valid, 1), v, gl.zeros_like(v))
    v_smem.store(v)
    fence_async_shared()


@gluon.jit
def _store_item(acc, m_i, l_i, Out, Lse, split, batch, kv_head, group, rows,
                stride_os, stride_ob, stride_ot, stride_oh,
                stride_ls, stride_lb, stride_lh, stride_lt, WRITE_LSE: gl.constexpr):
    """Normalized rows to ``Out [.., token, head, :]`` and their LSE to ``Lse [.., head, token]``;
    rows that saw no key get 0 and -inf."""
    o_layout: gl.constexpr = acc.type.layout
    BLOCK_M: gl.constexpr = acc.shape[0]
    HEAD_DIM: gl.constexpr = acc.shape[1]
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    inv_l = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
    out = acc * gl.expand_dims(inv_l, 1)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    token = (r // group).to(gl.int64)
    head = (kv_head * group + r % group).to(gl.int64)
    base = split.to(gl.int64) * stride_os + batch.to(gl.int64) * stride_ob
    offs = base + token * stride_ot + head * stride_oh
    gl.store(Out + gl.expand_dims(offs, 1) + gl.expand_dims(d, 0), out.to(Out.dtype.element_ty),
             mask=gl.expand_dims(r < rows, 1))
    if WRITE_LSE:
        row_layout: gl.constexpr = l_i.type.layout
        r_l = gl.arange(0, BLOCK_M, layout=row_layout)
        lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        l_offs = (split.to(gl.int64) * stride_ls + batch.to(gl.int64) * stride_lb
                  + (kv_head * group + r_l % group).to(gl.int64) * stride_lh + (r_l // group).to(gl.int64) * stride_lt)
        gl.store(Lse + l_offs, lse, mask=r_l < rows)


@gluon.jit
def _consumer(k_bufs, v_bufs, ready, empty, Q, SeqLens, Out, Lse, KScale, VScale,
              stride_qb, stride_qt, stride_qh, stride_sl, stride_ksh, stride_vsh,
              stride_os, stride_ob, stride_ot, stride_oh,
              stride_ls, stride_lb, stride_lh, stride_lt,
              seqlen_new, appended, capacity, num_kv_heads, group, num_splits, num_items, qk_scale,
              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, QUANTIZED: gl.constexpr):
    """4 warps: per item, the query rows, then the online softmax over its tiles. ``QUANTIZED``:
    a 1-byte cache with one scale per KV head (per tensor: head stride 0); the MMAs run in fp16,
    K's scale joins the scores' scale and V's multiplies the output, as in the Triton kernel."""
    BLOCK_M: gl.constexpr = _BLOCK_M
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    if QUANTIZED:
        dtype: gl.constexpr = gl.float16
    else:
        dtype: gl.constexpr = k_bufs.dtype
    rows = group * seqlen_new
    use = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        batch, kv_head, length, lo, n_tiles = _item(item, SeqLens, stride_sl, appended, capacity,
                                                     num_kv_heads, num_splits, BLOCK_N)
        q = _load_q_rows(Q, batch, kv_head, stride_qb, stride_qt, stride_qh, group, rows, BLOCK_M, HEAD_DIM)
        item_scale = qk_scale
        if QUANTIZED:
            q, q_unscale = _queries_as_f16(q)
            item_scale = qk_scale * q_unscale * gl.load(KScale + kv_head.to(gl.int64) * stride_ksh)
        q = gl.convert_layout(q, a_layout)
        # Token t (row r: t = r // group) sees keys <= t + length - T. In tile-local terms for
        # _softmax_tile (its FUSED_MASK form): keys are counted from lo, the last visible key of
        # each row is ``limit``, and tiles below ``unmasked`` need no mask at all.
        visible_end = length - lo
        if CAUSAL:
            limit = gl.arange(0, BLOCK_M, layout=row_layout) // group + (length - seqlen_new - lo)
            unmasked = gl.maximum(gl.minimum(visible_end, length - seqlen_new + 1 - lo), 0) // BLOCK_N
        else:
            limit = gl.zeros([BLOCK_M], gl.int32, row_layout)
            unmasked = visible_end // BLOCK_N
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma_layout)
        for j in range(n_tiles):
            slot, phase = _ring_slot(use, STAGES)
            mbarrier.wait(ready.index(slot), phase)
            k_smem = _as_matrix(k_bufs.index(slot))
            v_smem = _as_matrix(v_bufs.index(slot))
            k = k_smem.permute((1, 0)).load(b_layout).to(dtype)  # 1-byte entries to fp16: exact
            s = mma_v2(q, k, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout))
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, j, unmasked, limit, visible_end, 0, item_scale,
                                               BLOCK_N, CAUSAL, True)
            if (j + 1) * BLOCK_N > visible_end:
                _zero_rows_past(v_smem, visible_end - j * BLOCK_N, HEAD_DIM)
            acc = mma_v2(gl.convert_layout(p.to(dtype), a_layout), v_smem.load(b_layout).to(dtype), _rescale(acc, alpha))
            mbarrier.arrive(empty.index(slot))
            use += 1
        if QUANTIZED:
            acc = acc * gl.load(VScale + kv_head.to(gl.int64) * stride_vsh)
        _store_item(acc, m_i, l_i, Out, Lse, item % num_splits, batch, kv_head, group, rows,
                    stride_os, stride_ob, stride_ot, stride_oh,
                    stride_ls, stride_lb, stride_lh, stride_lt, WRITE_LSE)


# Lengths, counts and strides of the outputs change between calls and only feed scalar index
# math; specializing on them would compile a kernel per shape.
@gluon.jit(do_not_specialize=["stride_os", "stride_ob", "stride_ot", "stride_oh", "stride_ls", "stride_lb",
                              "stride_lh", "stride_lt", "seqlen_new", "appended", "capacity", "num_blocks",
                              "num_kv_heads", "group", "num_splits", "num_items"])
def _gluon_decode_kernel(
    k_desc, v_desc, Q, BlockTable, SeqLens, Out, Lse, KScale, VScale,
    stride_qb, stride_qt, stride_qh,
    stride_btb, stride_btn, stride_sl, stride_ksh, stride_vsh,
    stride_os, stride_ob, stride_ot, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lt,
    seqlen_new, appended, capacity, num_blocks, num_kv_heads, group, num_splits, num_items, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, PRODUCER_REGS: gl.constexpr, QUANTIZED: gl.constexpr,
):
    """Grid ``(min(#SMs, num_items),)``, 4 warps + 1 producer warp. Descriptors: k/v over the
    cache as given (``[B, S_max, Hkv, D]`` or ``[num_blocks, page, Hkv, D]``), box ``[1,
    BLOCK_N, 1, D]`` (``[1, page, 1, D]`` for pages shorter than a tile). ``Out``/``Lse``: the
    final output and LSE, or with several splits the fp32 partials (``stride_os``/``stride_ls``
    step between splits). ``QUANTIZED``: a float8_e4m3fn / int8 cache with scales per KV head at
    ``KScale``/``VScale`` (head strides ``stride_ksh``/``stride_vsh``, 0 for a per-tensor scale)."""
    dtype: gl.constexpr = k_desc.dtype
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, 1, HEAD_DIM], dtype)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], tile_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, 1, HEAD_DIM], tile_layout)
    ready = _alloc_barriers(STAGES, 1)
    empty = _alloc_barriers(STAGES, 1)
    fence_async_shared()  # barrier inits visible to the async proxy (TMA) before first use
    gl.warp_specialize([
        (_consumer, (k_bufs, v_bufs, ready, empty, Q, SeqLens, Out, Lse, KScale, VScale,
                     stride_qb, stride_qt, stride_qh, stride_sl, stride_ksh, stride_vsh,
                     stride_os, stride_ob, stride_ot, stride_oh,
                     stride_ls, stride_lb, stride_lh, stride_lt,
                     seqlen_new, appended, capacity, num_kv_heads, group, num_splits, num_items, qk_scale,
                     HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, QUANTIZED)),
        (_producer, (k_desc, v_desc, k_bufs, v_bufs, ready, empty, BlockTable, SeqLens,
                     stride_btb, stride_btn, stride_sl, appended, capacity, num_blocks, num_kv_heads,
                     num_splits, num_items, BLOCK_N, STAGES, PAGE_SIZE)),
    ], [1], [PRODUCER_REGS])


# ---- host side ------------------------------------------------------------------------------------


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int) -> bool:
    """Whether :func:`launch` handles this (already validated) decode call's tensors: a Hopper
    GPU, bf16/fp16, head dim 64/128/256, at most 16 rows (group x new tokens) per KV head, a contiguous cache or
    pages of at least ``MIN_PAGE`` keys, TMA-compatible caches (16-byte aligned base and strides,
    contiguous last dim), in q's dtype or quantized (scales per tensor or KV head: the caller's)."""
    if not q.is_cuda or q.dtype not in TORCH_TO_GL or q.shape[-1] not in HEAD_DIMS:
        return False
    if not is_sm90(q.device):
        return False
    group = q.shape[2] // k_cache.shape[2]
    if group * q.shape[1] > BLOCK_M or 0 < page_size < MIN_PAGE:
        return False
    return tma_aligned(k_cache, broadcast=False) and tma_aligned(v_cache, broadcast=False)


def head_stride(scale: torch.Tensor | None) -> int:
    """A per-tensor (``[]``/``[1]``: 0) or per-KV-head (``[Hkv]``) scale's stride between heads."""
    return 0 if scale is None or scale.numel() == 1 else scale.stride(0)


def launch_args(q, k_cache, v_cache, cache_seqlens, block_table, target, target_lse, o_strides, l_strides, *,
                appended: int, capacity: int, num_blocks: int, page_size: int, num_splits: int, causal: bool,
                softmax_scale: float, config: GluonDecodeConfig, sms: int, k_scale=None, v_scale=None):
    """``(grid, args, kwargs)`` of one launch (also used to compile without a GPU). A quantized
    cache comes with ``k_scale``/``v_scale`` per tensor or per KV head."""
    batch, seqlen_new, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    items = batch * num_kv_heads * num_splits
    box = config.block_n if page_size == 0 else min(page_size, config.block_n)
    if block_table is None:
        bt, stride_btb, stride_btn = cache_seqlens, 0, 0  # an unused pointer
    else:
        bt, stride_btb, stride_btn = block_table, block_table.stride(0), block_table.stride(1)
    grid = (max(1, min(items, config.max_programs or sms)),)
    quantized = k_scale is not None
    args = (make_descriptor(k_cache, box), make_descriptor(v_cache, box), q, bt, cache_seqlens, target,
            target_lse if target_lse is not None else target,
            k_scale if quantized else q, v_scale if quantized else q,
            q.stride(0), q.stride(1), q.stride(2), stride_btb, stride_btn, cache_seqlens.stride(0),
            head_stride(k_scale), head_stride(v_scale),
            *o_strides, *l_strides,
            seqlen_new, appended, capacity, num_blocks, num_kv_heads, num_heads // num_kv_heads, num_splits,
            items, softmax_scale * LOG2E)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_N=config.block_n, STAGES=config.stages, PAGE_SIZE=page_size,
                  CAUSAL=causal, WRITE_LSE=target_lse is not None, PRODUCER_REGS=config.producer_regs,
                  QUANTIZED=quantized)
    return grid, args, kwargs


def launch(*args, config: GluonDecodeConfig, **kwargs) -> None:
    """One decode launch (arguments of :func:`launch_args`) on the current CUDA device."""
    grid, kernel_args, kernel_kwargs = launch_args(*args, config=config, **kwargs)
    _launch_kernel(grid, *kernel_args, **kernel_kwargs, num_warps=4, **exponent_options(kwargs["softmax_scale"]))


def num_splits_for(programs: int, capacity: int, sms: int, block_n: int, min_split_tokens: int,
                   max_splits: int) -> int:
    """Automatic splits: one wave of work items, each at least a tile (and ``min_split_tokens``)."""
    return max(1, min(sms // max(programs, 1), -(-capacity // max(block_n, min_split_tokens)), max_splits))


def attend(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, *, page_size: int, capacity: int,
           num_blocks: int, appended: int, causal: bool, softmax_scale: float, num_splits: int, config,
           sms: int, k_scale=None, v_scale=None) -> None:
    """The attention of one decode step (new keys already appended) into ``out``/``lse``: the
    kernel writes the output directly with one split, else fp32 partials that ``combine``
    merges (the Triton family's workspace and merge)."""
    target, target_lse, o_strides, l_strides = split_targets(q, out, lse, num_splits)
    launch(q, k_cache, v_cache, cache_seqlens, block_table, target, target_lse, o_strides, l_strides,
           appended=appended, capacity=capacity, num_blocks=num_blocks, page_size=page_size,
           num_splits=num_splits, causal=causal, softmax_scale=softmax_scale, config=config, sms=sms,
           k_scale=k_scale, v_scale=v_scale)
    if num_splits > 1:
        combine(target, target_lse, out, lse, softmax_scale=softmax_scale)


_launch_kernel = Launcher(_gluon_decode_kernel)
