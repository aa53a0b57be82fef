"""Decode over a KV cache in Triton: a few new query tokens per sequence attend to a long cache.

One launch per step (two for some split steps, below): ``_decode_kernel`` (:func:`decode_forward`)
runs one program per ``(batch, kv_head, row tile, split)``. All ``group = Hq // Hkv`` query heads
of one KV head, times the ``T`` new tokens, form one tile of ``group * T`` rows (row ``r`` is
token ``r // group`` of query head ``kv_head * group + r % group``), padded to >= 16 rows for
``tl.dot``. So every K/V
byte is read once per step, not once per query head. The context ``[0, L)`` of a sequence is
cut into ``num_splits`` runs of whole ``BLOCK_N`` tiles; each program streams one run and writes
a normalized partial output and its log-sum-exp (float32) to a workspace. The splits are merged
exactly by log-sum-exp: in an eager call (a short step, or one of few splits over a cache in
q's dtype), by the last program of each row tile to finish (an atomic count per row tile,
:func:`_last_split_merges`), so no launch follows; otherwise (under CUDA-graph capture, or a
longer step with more splits or over a 1-byte cache) by ``kernels/combine.py`` in a second
launch (:func:`merges_in_kernel`). With one split the program writes the final output directly.

With new ``k, v [B, T, Hkv, D]`` (``APPEND``), each program first writes into the cache, in
place, the new tokens that fall in the key tiles it will read (positions ``cache_seqlens[b] ..
cache_seqlens[b] + T - 1``, through the block table when paged; ``cache_seqlens`` itself is not
modified) and passes a CTA barrier (:func:`_append_tile_tokens`). Every key a program reads is
then one it wrote or one that was in the cache before: the append needs no launch of its own.
``_append_kernel`` makes the same writes as a kernel of their own, for the Gluon decode kernel
and :func:`append_kv`.

Cache layouts (``PAGE_SIZE`` constexpr): contiguous ``[B, S_max, Hkv, D]`` (``PAGE_SIZE`` 0)
or paged ``[num_blocks, page_size, Hkv, D]`` with ``block_table [B, max_blocks]`` int32: key
``j`` of sequence ``b`` lives in block ``block_table[b, j // page_size]`` at slot
``j % page_size``. Pages at least one tile long are looked up once per tile; smaller pages are
gathered row by row. The look-ups are inline PTX so that Triton's software pipeliner keeps the
K/V loads multi-buffered (:func:`_load_page_index`). All cache offsets are int64.

Causal masking among the new tokens is aligned bottom-right: with ``L = cache_seqlens[b] + T``
(``+ 0`` when nothing is appended), new token ``t`` sees keys ``j <= L - T + t``.

Features, each a constexpr (a call without one compiles none of its code; ``kernels/_softmax.py``
holds the score modifiers): a window is aligned to each sequence's end (new token ``t`` has
position ``L - T + t``), and the splits share out only the window's span of tiles, so a step
reads about ``left + T`` keys whatever ``L``. Softcap and ALiBi modify the scores of each row
(ALiBi's slope is the row's query head's). A sink starts split 0's running max and sum, so the
merge counts it exactly once. A per-sequence key start (``HAS_START``, ``cache_leftpad``)
makes sequence ``b`` attend cache positions ``[start_b, L)``: the kernel works in positions
relative to the start (masks and ALiBi depend only on differences of positions) and adds it
back when it addresses the cache, so the splits share out only the keys that exist.

Quantized caches (``KV_SCALE``, 0 without): float8_e4m3fn or int8 entries with float32 scales,
one per KV head (a per-tensor scale is a head stride of 0: ``KV_SCALE`` 1) or one per token and
KV head beside each slot (``KV_SCALE`` 2). The append (fused or the append kernel) quantizes the new tokens
(:func:`_quantized`: ``x / s``, saturated, rounded to nearest even; per-token scales computed
from the token and stored). The decode kernel computes in fp16 (:func:`_queries_as_f16`,
:func:`_cache_values`: exact conversions), folds scales per KV head into the scores' scale and
the output, and applies per-token scales to the columns of ``q k^T`` and of P
(``_softmax.accumulate_pv``). V arrives as int16 words of two entries (:func:`value_operand`;
byte by byte where its layout does not allow words) and feeds two products of half the head
dim, its even and its odd columns (:func:`_value_pairs`), joined once at the end. A cache in
q's dtype compiles none of it.

Robustness without host synchronisation: lengths are clamped to ``[0, capacity]``, starts to
``[0, length]``, and page indices read from the block table to ``[0, num_blocks)``, so bad
values (when the caller did not validate them) give wrong numbers, never out-of-bounds
accesses; appends skip slots they cannot address instead of clamping them.

Tile shapes and the split rules are data (``tuned/decode.json``, read by ``tuning.py`` into a
:class:`tuning.DecodeTuning` that :func:`decode_forward` takes explicitly).

Also here: :func:`baseline_decode`, the straightforward kernel (one program per query head, no
split, no GQA sharing, every tile masked), kept for benchmarks so each technique's gain shows.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from . import tuning
from ._common import cdiv, cuda_properties, dot_flags, exponent_options, is_interpreted, next_power_of_2, padded_head_dim
from ._launch import Launcher, allocate
from ._softmax import Variant, attend_scores, unmasked_run, window_span
from .combine import combine
from .tuning import DecodeConfig, DecodeTuning

LOG2E = math.log2(math.e)

# Structural limits (not tuning): the row tile's height per padded head dim (the fp32
# accumulator of BLOCK_M x D must fit in registers), and the append kernel's tile.
MAX_TILE_ROWS = {16: 128, 32: 128, 64: 128, 128: 128, 256: 64}
APPEND_TILE_ELEMENTS = 4096
MERGE_ELEMENTS = 2048  # splits x head dim of a row in flight at once in the in-kernel merge (four rows at a time)
_APPEND_ELEMENTS = tl.constexpr(1024)  # new tokens x head dim per step of a decode program's fused append
INTERPRETER_CONFIG = DecodeConfig(32, 4, 1)
INTERPRETER_SMS = 4  # the CPU interpreter has no SMs; a small count still exercises splitting


# --------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_page_index(ptrs):
    """``int32`` block-table entries at ``ptrs`` (a scalar or a tensor of pointers).

    On the GPU this is one ``ld.global.nc`` per entry in inline PTX, which Triton's software
    pipeliner does not see. With ``tl.load`` it sees an index load feeding the K/V addresses and
    gives the K/V loads a single shared-memory buffer (Triton 3.6, every paged configuration):
    one tile in flight per program instead of ``num_stages - 1``. As an opaque instruction the
    look-up runs in the pipeline's first stage, a few tiles ahead of its use, and the K/V loads
    keep their buffers. The table is not written while a decode kernel runs (``.nc`` is safe).

    Being pure, it is also run unguarded for pipelined iterations that never happen (tiles past
    a split's end): callers must pass addresses inside the table whatever the key.
    """
    if _INLINE_PTX:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


_INLINE_PTX = tl.constexpr(not is_interpreted(_load_page_index))  # the interpreter runs no PTX


@triton.jit
def _cache_values(x, dtype: tl.constexpr):
    """Cache entries as ``dtype`` (q's, or float32 under DOT_F32): a no-op for a cache in that
    dtype; int8 to float16 with integer arithmetic (the float16 ``1152 + x`` holds ``x + 128``
    in its low mantissa bits; ``I2F`` runs at a quarter of the ALU rate)."""
    if x.dtype == tl.int8 and dtype == tl.float16:
        if _INLINE_PTX:  # four entries per step: one xor, two byte permutes, two subtractions
            return tl.inline_asm_elementwise(
                """{ .reg .b32 t, e, b;
                xor.b32 t, $2, 0x80808080; mov.b32 e, 0x64646464; mov.b32 b, 0x64806480;
                prmt.b32 $0, t, e, 0x4140; prmt.b32 $1, t, e, 0x4342;
                sub.rn.f16x2 $0, $0, b; sub.rn.f16x2 $1, $1, b; }""",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
    return x.to(dtype)


@triton.jit
def _value_pairs(words, FORMAT: tl.constexpr, dtype: tl.constexpr):
    """``(even, odd)``: a 1-byte cache's entries read as int16 words (word ``j`` of a row holds
    entries ``2j`` and ``2j + 1``), as ``dtype`` (float16, or float32 queries'), each of the
    words' shape; ``FORMAT`` is the cache's dtype (float8_e4m3fn or int8).

    Why words: ``P V`` needs V transposed into the MMA's operand layout. With 16-bit elements
    Triton does that with ``ldmatrix.trans`` (a whole 8x8 block per instruction); 8-bit elements
    it gathers byte by byte from shared memory. Read as words, V is transposed in 16-bit units,
    and the two entries of each word feed two products, of V's even and of its odd columns.
    On the GPU one ``prmt`` per two words and one conversion per output pair; the interpreter
    (no inline PTX) takes the same values through bit operations.
    """
    if _INLINE_PTX:
        # $2 packs words w0, w1 (bytes a0 b0 a1 b1); even = (a0, a1), odd = (b0, b1).
        if FORMAT == tl.float8e4nv:
            even, odd = tl.inline_asm_elementwise(
                """{ .reg .b32 t, z; .reg .b16 lo, hi;
                mov.b32 z, 0; prmt.b32 t, $2, z, 0x3120; mov.b32 {lo, hi}, t;
                cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }""",
                "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
        else:
            # int8 x -> the float16 1024 + (x + 128) (bits 0x64, x ^ 0x80), minus 1152.
            even, odd = tl.inline_asm_elementwise(
                """{ .reg .b32 t, e, b;
                xor.b32 t, $2, 0x80808080; mov.b32 e, 0x64646464; mov.b32 b, 0x64806480;
                prmt.b32 $0, t, e, 0x4240; prmt.b32 $1, t, e, 0x4341;
                sub.rn.f16x2 $0, $0, b; sub.rn.f16x2 $1, $1, b; }""",
                "=r,=r,r", [words], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        bits = words.to(tl.uint16, bitcast=True)
        low = (bits & 0xFF).to(tl.uint8)
        high = (bits >> 8).to(tl.uint8)
        if FORMAT == tl.float8e4nv:
            even = low.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            odd = high.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            even = _cache_values(low.to(tl.int8, bitcast=True), tl.float16)
            odd = _cache_values(high.to(tl.int8, bitcast=True), tl.float16)
    return even.to(dtype), odd.to(dtype)


@triton.jit
def _queries_as_f16(q):
    """Query rows over a quantized cache: ``(q * 2**e as float16, 2**-e)`` for bf16/fp16 ``q``,
    ``e`` chosen per program so the largest magnitude lands in ``[2**14, 2**15)`` (below fp16's
    65504), ``(q, 1)`` for float32 ``q``.

    Why fp16: e4m3 becomes fp16 in one instruction per pair (bf16 needs a second conversion per
    element) and P rounds to fp16 with 3 more bits than bf16. The power of two is exact, and
    undone on the scores; elements more than ``2**28`` below the largest become fp16
    subnormals, an absolute error below ``2**-39`` of the largest per element.
    """
    # One return after a static if: Triton's code generator visits a return inside a constexpr
    # branch and then the code after it too, and refuses two return types.
    if q.dtype == tl.float32:
        rows = q
        down = 1.0
    else:
        x = q.to(tl.float32)
        largest = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        binade = tl.minimum(tl.maximum((largest.to(tl.int32, bitcast=True) >> 23) - 127, -100), 100)
        up = ((141 - binade) << 23).to(tl.float32, bitcast=True)  # 2 ** (14 - binade)
        down = ((113 + binade) << 23).to(tl.float32, bitcast=True)  # 2 ** (binade - 14)
        rows = (x * up).to(tl.float16)
    return rows, down


@triton.jit
def _cache_rows(
    bt_row, stride_btn, batch, start_n, offs_n, length, num_blocks, key_start,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_START: tl.constexpr,
):
    """Block and slot of each key ``start_n + offs_n`` of the tile at ``start_n`` (a multiple of
    ``BLOCK_N``): key j is at ``cache[block, slot]``.

    Keys and ``length`` count from the sequence's key start; the cache position of key
    ``j`` is ``j + key_start`` (``HAS_START``) or ``j``. ``block`` is an int64 scalar
    (contiguous cache, or pages >= BLOCK_N without a start: one page per tile) or an int64
    vector (one look-up per key). ``slot`` is an int64 vector.
    """
    keys = start_n + offs_n
    if HAS_START:
        pos = keys + key_start
    else:
        pos = keys
    if PAGE_SIZE == 0:
        block = batch
        slot = pos.to(tl.int64)
    else:
        # Columns are clamped to the last key's (<= capacity / PAGE_SIZE - 1): keys past the end
        # are masked later, and the pipeliner runs look-ups of tiles past the split's end too.
        # (Clamping the column, not the key, keeps the keys of one page on one address: a quarter
        # of the look-ups at pages of 16.)
        last = tl.maximum(length - 1, 0)
        if HAS_START:
            last = last + key_start
            block = _load_page_index(bt_row + tl.minimum(pos // PAGE_SIZE, last // PAGE_SIZE) * stride_btn)
            slot = pos % PAGE_SIZE
        elif PAGE_SIZE >= BLOCK_N:
            block = _load_page_index(bt_row + (tl.minimum(start_n, last) // PAGE_SIZE) * stride_btn)
            slot = pos % PAGE_SIZE
        else:
            # Tiles start at multiples of BLOCK_N (a multiple of PAGE_SIZE), so a key's page
            # column is the tile's first plus a term of its offset, and its slot depends on the
            # offset alone: both terms are computed once per program, not per tile.
            col = tl.minimum(start_n // PAGE_SIZE + offs_n // PAGE_SIZE, last // PAGE_SIZE)
            block = _load_page_index(bt_row + col * stride_btn)
            slot = offs_n % PAGE_SIZE
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
        slot = slot.to(tl.int64)
    return block, slot


@triton.jit
def _attend_cache_tile(
    acc, l_i, m_i, q, K, V, KScale, VScale, bt_row, stride_btn, batch,
    stride_kb, stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss,
    start_n, offs_n, offs_d, row_token, length, causal_shift, num_blocks, qk_scale,
    window_left, window_right, softcap_in, softcap_out, alibi_rows, key_start,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_START: tl.constexpr, KV_SCALE: tl.constexpr,
):
    """One online-softmax step over keys ``start_n .. start_n + BLOCK_N - 1`` of the cache.

    ``K``/``V`` (and the per-token ``KScale``/``VScale``) already point at this program's KV
    head. ``m_i`` is the running row max in log2 units (scaled). With ``MASKED`` the tile may
    hold keys ``>= length`` or keys outside a row's causal range or window: row token ``t`` has
    position ``t + causal_shift`` (``_softmax``).

    A quantized cache (float8_e4m3fn, int8) is converted to q's dtype (float16 or float32 over a
    quantized cache, :func:`_queries_as_f16`), exactly: every e4m3 and int8 value is an fp16
    value. Its scales multiply the raw numbers' products: per-token scales (``KV_SCALE == 2``)
    the columns of ``q k^T`` and, through :func:`_softmax.accumulate_pv`, P's columns before
    ``P V``; scales per KV head are folded into ``qk_scale`` and the output by the caller.
    """
    keys = start_n + offs_n
    block, slot = _cache_rows(bt_row, stride_btn, batch, start_n, offs_n, length, num_blocks, key_start,
                              PAGE_SIZE, BLOCK_N, HAS_START)
    V_PAIRS: tl.constexpr = V.dtype.element_ty == tl.int16
    if V_PAIRS:  # a 1-byte cache's V as int16 words (_value_pairs): strides count words
        offs_v = tl.arange(0, BLOCK_D // 2)
        v_cols_exist = HEAD_DIM // 2
    else:
        offs_v = offs_d
        v_cols_exist = HEAD_DIM
    k_ptrs = K + (block * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = V + (block * stride_vb + slot * stride_vs)[:, None] + offs_v[None, :]
    if MASKED:
        k_mask = keys[:, None] < length
        v_mask = keys[:, None] < length
        if BLOCK_D != HEAD_DIM:
            k_mask = k_mask & (offs_d[None, :] < HEAD_DIM)
            v_mask = v_mask & (offs_v[None, :] < v_cols_exist)
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=offs_v[None, :] < v_cols_exist, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    k = _cache_values(k, q.dtype)
    if V_PAIRS:
        v = _value_pairs(v, K.dtype.element_ty, q.dtype)
    else:
        v = _cache_values(v, q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if KV_SCALE == 2:
        ks_ptrs = KScale + block * stride_ksb + slot * stride_kss
        vs_ptrs = VScale + block * stride_vsb + slot * stride_vss
        if MASKED:  # the scales past the length may be anything (NaN): never read them
            k_scale = tl.load(ks_ptrs, mask=keys < length, other=0.0)
            v_scale = tl.load(vs_ptrs, mask=keys < length, other=0.0)
        else:
            k_scale = tl.load(ks_ptrs)
            v_scale = tl.load(vs_ptrs)
        qk = qk * k_scale[None, :]
        v_max = tl.max(v_scale, axis=0)
        v_tile = tl.where(v_max > 0, v_max, 1.0)
        v_cols = v_scale * (1.0 / v_tile)
    else:
        v_cols = 0.0
        v_tile = 1.0
    return attend_scores(acc, l_i, m_i, qk, v, row_token + causal_shift, keys, length, qk_scale,
                         window_left, window_right, softcap_in, softcap_out, alibi_rows,
                         MASKED, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                         v_cols, v_tile, KV_SCALE == 2, V_PAIRS)


@triton.jit
def _store_rows(
    Out, Lse, acc, l_i, m_i, split, batch, row_token, row_head, row_ok, offs_d,
    stride_os, stride_ob, stride_ot, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lt,
    HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Write normalized rows ``out [.., token, head, :]`` and ``lse [.., head, token]``.

    Rows that saw no key have ``l = 0`` and ``acc = 0``: output 0, LSE -inf.
    """
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    token = row_token.to(tl.int64)
    head = row_head.to(tl.int64)
    o_ptrs = (Out + split * stride_os + batch * stride_ob
              + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
        l_ptrs = Lse + split * stride_ls + batch * stride_lb + head * stride_lh + token * stride_lt
        tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def _last_split_merges(
    Out, Lse, Final, FinalLse, Counters, num_splits, num_row_tiles, num_kv_heads, group, seqlen_new,
    stride_os, stride_ob, stride_ot, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lt,
    stride_fb, stride_ft, stride_fh, stride_flb, stride_flh, stride_flt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """After a program has stored its split's partial rows: the last of the ``num_splits``
    programs of its row tile to finish merges every split's rows into ``Final`` (and
    ``FinalLse``) by log-sum-exp, as ``combine.py`` does, in split order (so the result does not
    depend on which program came last), and sets the tile's counter back to 0 for the next launch.

    ``Counters[counter]`` counts the finished splits (int32, zero before the launch). The barrier
    puts every thread's stores before the count's release; the program that sees the count reach
    ``num_splits - 1`` acquires the other programs' stores and reads them from L2 (``.cg``). No
    program waits for another, so any number of programs may be resident at once.

    Only the rows of the tile that exist are merged (GQA 4 fills 4 rows of a 16-row tile), as
    ``[4, BLOCK_D]`` tiles (a row per warp): the splits are folded in one after another with a
    running max, so nothing is reduced across threads, and the ``BLOCK_S`` splits of a chunk are
    unrolled with no store between their loads, so they are all in flight at once (each split
    stores all its rows, zeros and lse -inf where it saw no key: no load waits for a weight).
    The program's indices are derived again from its id here, not kept live across the key loop.
    """
    pid = tl.program_id(0)
    row_tile = pid % num_row_tiles
    rest = pid // num_row_tiles
    counter = (rest // num_splits) * num_row_tiles + row_tile
    rest = rest // num_splits
    kv_head = rest % num_kv_heads
    batch = (rest // num_kv_heads).to(tl.int64)
    tl.debug_barrier()
    finished = tl.atomic_add(Counters + counter, 1, sem="acq_rel", scope="gpu")
    if finished == num_splits - 1:
        rows = tl.minimum(group * seqlen_new - row_tile * BLOCK_M, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        for r0 in range(0, rows, 4):
            r = r0 + tl.arange(0, 4)
            row_ok = r < rows
            offs_r = row_tile * BLOCK_M + r
            token = (offs_r // group).to(tl.int64)
            head = (kv_head * group + offs_r % group).to(tl.int64)
            parts = Out + (batch * stride_ob + token * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
            lses = Lse + batch * stride_lb + head * stride_lh + token * stride_lt
            m = tl.full([4], float("-inf"), dtype=tl.float32)
            total = tl.zeros([4], dtype=tl.float32)
            acc = tl.zeros([4, BLOCK_D], dtype=tl.float32)
            for s0 in range(0, num_splits, BLOCK_S):
                # Every load of the chunk first (no store between them: all in flight at once).
                lse_of = ()
                part_of = ()
                for j in tl.static_range(BLOCK_S):
                    split = tl.cast(s0 + j, tl.int64)
                    ok = row_ok & (split < num_splits)
                    lse_of = lse_of + (tl.load(lses + split * stride_ls, mask=ok, other=float("-inf"),
                                               cache_modifier=".cg"),)
                    part_of = part_of + (tl.load(parts + split * stride_os,
                                                 mask=ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0,
                                                 cache_modifier=".cg"),)
                m_new = m
                for j in tl.static_range(BLOCK_S):
                    m_new = tl.maximum(m_new, lse_of[j] * 1.4426950408889634)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m - m_safe)
                acc = acc * alpha[:, None]
                total = total * alpha
                for j in tl.static_range(BLOCK_S):
                    # A split that saw no key has weight 0 and rows of zeros (never NaN: written).
                    w = tl.math.exp2(lse_of[j] * 1.4426950408889634 - m_safe)
                    acc += w[:, None] * part_of[j]
                    total += w
                m = m_new
            total_safe = tl.where(total == 0.0, 1.0, total)
            final = Final + (batch * stride_fb + token * stride_ft + head * stride_fh)[:, None] + offs_d[None, :]
            tl.store(final, (acc / total_safe[:, None]).to(Final.dtype.element_ty),
                     mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
            if WRITE_LSE:
                lse = tl.where(total == 0.0, float("-inf"), (m + tl.math.log2(total_safe)) / 1.4426950408889634)
                tl.store(FinalLse + batch * stride_flb + head * stride_flh + token * stride_flt, lse, mask=row_ok)
        tl.store(Counters + counter, 0)


@triton.jit
def _decode_program(
    Q, K, V, KScale, VScale, BlockTable, SeqLens, Out, Lse, Slopes, Sinks, Starts, KNew, VNew,
    Final, FinalLse, Counters,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ksb, stride_kss, stride_ksh,
    stride_vsb, stride_vss, stride_vsh,
    stride_btb, stride_btn, stride_sl,
    stride_os, stride_ob, stride_ot, stride_oh,
    stride_ls, stride_lb, stride_lh, stride_lt,
    stride_ab, stride_ah, stride_sh, stride_st,
    stride_nkb, stride_nkt, stride_nkh, stride_nvb, stride_nvt, stride_nvh,
    stride_fb, stride_ft, stride_fh, stride_flb, stride_flh, stride_flt,
    seqlen_new, appended, capacity, num_blocks,
    num_kv_heads, group, num_row_tiles, num_splits, qk_scale,
    window_left, window_right, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_START: tl.constexpr, KV_SCALE: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, APPEND: tl.constexpr,
    MERGE: tl.constexpr, MERGE_LSE: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Program id -> (batch, kv_head, split, row tile), row tile fastest, in one grid axis.
    pid = tl.program_id(0)
    row_tile = pid % num_row_tiles
    rest = pid // num_row_tiles
    split = rest % num_splits
    rest = rest // num_splits
    kv_head = rest % num_kv_heads
    batch = (rest // num_kv_heads).to(tl.int64)

    cached = tl.load(SeqLens + batch * stride_sl)
    length = tl.minimum(tl.maximum(cached + appended, 0), capacity)
    if HAS_START:
        # Keys [key_start, length) of the cache, counted from key_start from here on.
        key_start = tl.minimum(tl.maximum(tl.load(Starts + batch * stride_st), 0), length)
        length = length - key_start
    else:
        key_start = 0
    causal_shift = length - seqlen_new  # token t sees keys j <= t + causal_shift

    offs_r = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_token = offs_r // group
    row_head = kv_head * group + offs_r % group
    row_ok = offs_r < group * seqlen_new
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = (Q + batch * stride_qb + row_token[:, None].to(tl.int64) * stride_qt
              + row_head[:, None].to(tl.int64) * stride_qh + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if KV_SCALE != 0:
        q, q_unscale = _queries_as_f16(q)
        qk_scale = qk_scale * q_unscale
        softcap_in = softcap_in * q_unscale
    elif DOT_F32:
        q = q.to(tl.float32)

    if HAS_WINDOW:
        # Keys [win_lo, win_hi) lie in some row's window; the splits share out that span only.
        first_pos = (row_tile * BLOCK_M) // group + causal_shift
        last_pos = tl.minimum((row_tile * BLOCK_M + BLOCK_M - 1) // group, seqlen_new - 1) + causal_shift
        win_lo, win_hi = window_span(first_pos, last_pos, length, window_left, window_right, BLOCK_N)
        per_split = tl.cdiv(tl.cdiv(tl.maximum(win_hi - win_lo, 0), BLOCK_N), num_splits)
        lo = win_lo + split * per_split * BLOCK_N
        hi = tl.minimum(lo + per_split * BLOCK_N, win_hi)
        mid_lo, mid_hi = unmasked_run(lo, hi, first_pos, last_pos, window_left, window_right, BLOCK_N)
    else:
        # This split's keys [lo, hi): a run of whole tiles; keys below `full` are visible to every
        # row of the tile (no mask), the rest pay for masks.
        per_split = tl.cdiv(tl.cdiv(length, BLOCK_N), num_splits)
        lo = split * per_split * BLOCK_N
        hi = tl.minimum(lo + per_split * BLOCK_N, length)
        if CAUSAL:
            full = tl.minimum(hi, (row_tile * BLOCK_M) // group + causal_shift + 1)
        else:
            full = hi
        mid_lo = lo
        mid_hi = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N

    kv_head64 = kv_head.to(tl.int64)
    K = K + kv_head64 * stride_kh
    V = V + kv_head64 * stride_vh
    bt_row = BlockTable + batch * stride_btb
    if KV_SCALE != 0:
        KScale = KScale + kv_head64 * stride_ksh
        VScale = VScale + kv_head64 * stride_vsh
    if APPEND:
        # The new tokens in this program's tiles (the append kernel's work, fused: one launch
        # less per step); the barrier makes every thread's writes visible to the tile loads.
        _append_tile_tokens(
            KNew + batch * stride_nkb + kv_head64 * stride_nkh, VNew + batch * stride_nvb + kv_head64 * stride_nvh,
            K, V, KScale, VScale, bt_row, stride_btn, batch, stride_nkt, stride_nvt,
            stride_kb, stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss,
            cached - key_start, key_start, lo, lo + tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N) * BLOCK_N,
            (split == 0) & (row_tile == 0), seqlen_new, capacity, num_blocks,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, KV_SCALE, _APPEND_ELEMENTS // BLOCK_D)
        tl.debug_barrier()
    if KV_SCALE == 1:
        # One scale per KV head (a per-tensor scale has head stride 0): K's joins the scores'
        # scale, V's multiplies the output (below).
        k_scale = tl.load(KScale)
        qk_scale = qk_scale * k_scale
        softcap_in = softcap_in * k_scale

    if HAS_ALIBI:
        slopes = tl.load(Slopes + batch * stride_ab + row_head.to(tl.int64) * stride_ah)
        alibi_rows = slopes * 1.4426950408889634
    else:
        alibi_rows = 0.0
    if HAS_SINKS:
        # The sink joins the denominator once: split 0 starts from max = sink, sum = 1; the
        # other splits start empty, and the merge counts it exactly once.
        sink = tl.load(Sinks + row_head.to(tl.int64) * stride_sh).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    V_PAIRS: tl.constexpr = V.dtype.element_ty == tl.int16  # V's even and odd columns (_value_pairs)
    if V_PAIRS:
        acc = (tl.zeros([BLOCK_M, BLOCK_D // 2], dtype=tl.float32),
               tl.zeros([BLOCK_M, BLOCK_D // 2], dtype=tl.float32))
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_WINDOW:
        for start_n in range(lo, mid_lo, BLOCK_N):
            acc, l_i, m_i = _attend_cache_tile(
                acc, l_i, m_i, q, K, V, KScale, VScale, bt_row, stride_btn, batch,
                stride_kb, stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss,
                start_n, offs_n, offs_d, row_token, length, causal_shift, num_blocks, qk_scale,
                window_left, window_right, softcap_in, softcap_out, alibi_rows, key_start,
                HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, CAUSAL, DOT_F32, DOT_PRECISION,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_START, KV_SCALE,
            )
    for start_n in range(mid_lo, mid_hi, BLOCK_N):
        acc, l_i, m_i = _attend_cache_tile(
            acc, l_i, m_i, q, K, V, KScale, VScale, bt_row, stride_btn, batch,
            stride_kb, stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss,
            start_n, offs_n, offs_d, row_token, length, causal_shift, num_blocks, qk_scale,
            window_left, window_right, softcap_in, softcap_out, alibi_rows, key_start,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, False, CAUSAL, DOT_F32, DOT_PRECISION,
            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_START, KV_SCALE,
        )
    for start_n in range(mid_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attend_cache_tile(
            acc, l_i, m_i, q, K, V, KScale, VScale, bt_row, stride_btn, batch,
            stride_kb, stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss,
            start_n, offs_n, offs_d, row_token, length, causal_shift, num_blocks, qk_scale,
            window_left, window_right, softcap_in, softcap_out, alibi_rows, key_start,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, CAUSAL, DOT_F32, DOT_PRECISION,
            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_START, KV_SCALE,
        )

    if V_PAIRS:
        acc = tl.join(acc[0], acc[1]).reshape(BLOCK_M, BLOCK_D)
    if KV_SCALE == 1:
        acc = acc * tl.load(VScale)
    _store_rows(
        Out, Lse, acc, l_i, m_i, split.to(tl.int64), batch, row_token, row_head, row_ok, offs_d,
        stride_os, stride_ob, stride_ot, stride_oh,
        stride_ls, stride_lb, stride_lh, stride_lt,
        HEAD_DIM, WRITE_LSE,
    )
    if MERGE:
        _last_split_merges(
            Out, Lse, Final, FinalLse, Counters, num_splits, num_row_tiles, num_kv_heads, group, seqlen_new,
            stride_os, stride_ob, stride_ot, stride_oh,
            stride_ls, stride_lb, stride_lh, stride_lt,
            stride_fb, stride_ft, stride_fh, stride_flb, stride_flh, stride_flt,
            HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_S, MERGE_LSE,
        )


# One kernel for every call: each feature is a constexpr, so a plain call compiles none of the
# variants' code (``benchmarks/tools/plain_ptx.py`` checks its PTX body against the plain
# kernel's before the variants). Strides travel as one tuple per tensor.
@triton.jit(do_not_specialize=["window_left", "window_right"])
def _decode_kernel(
    Q, K, V, KScale, VScale, BlockTable, SeqLens, Out, Lse, Slopes, Sinks, Starts, KNew, VNew,
    Final, FinalLse, Counters,
    q_strides, k_strides, v_strides, ks_strides, vs_strides, bt_strides, seqlens_stride,
    o_strides, lse_strides, alibi_strides, sink_stride, start_stride, knew_strides, vnew_strides,
    final_strides, final_lse_strides,
    seqlen_new, appended, capacity, num_blocks,
    num_kv_heads, group, num_row_tiles, num_splits, qk_scale,
    window_left, window_right, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_START: tl.constexpr, KV_SCALE: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, APPEND: tl.constexpr = False,
    MERGE: tl.constexpr = False, MERGE_LSE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
):
    """Grid ``(B * Hkv * splits * row tiles,)``. Strides: ``q (b, t, h)``, caches and their
    scales ``(block or b, slot, h)`` (scales: 0 where the granularity has no such axis), block
    table ``(b, column)``, outputs ``(split, b, t, h)``, LSE ``(split, b, h, t)``, ALiBi ``(b,
    h)``, new keys/values ``(b, t, h)``. ``KV_SCALE``: 0 a cache in q's dtype, 1 a quantized
    cache with a scale per KV head (or per tensor), 2 per token and KV head. ``APPEND``: write
    ``KNew``/``VNew`` into the cache first (:func:`_append_tile_tokens`). ``MERGE``: ``Out`` and
    ``Lse`` are split partials that the last split of each row tile merges into ``Final (b, t,
    h)`` (and, with ``MERGE_LSE``, ``FinalLse (b, h, t)``), ``BLOCK_S`` splits at a time, counting
    in ``Counters [B * Hkv * row tiles]`` int32 (zeros before the launch; left at zero)."""
    _decode_program(
        Q, K, V, KScale, VScale, BlockTable, SeqLens, Out, Lse, Slopes, Sinks, Starts, KNew, VNew,
        Final, FinalLse, Counters,
        q_strides[0], q_strides[1], q_strides[2],
        k_strides[0], k_strides[1], k_strides[2],
        v_strides[0], v_strides[1], v_strides[2],
        ks_strides[0], ks_strides[1], ks_strides[2],
        vs_strides[0], vs_strides[1], vs_strides[2],
        bt_strides[0], bt_strides[1], seqlens_stride,
        o_strides[0], o_strides[1], o_strides[2], o_strides[3],
        lse_strides[0], lse_strides[1], lse_strides[2], lse_strides[3],
        alibi_strides[0], alibi_strides[1], sink_stride, start_stride,
        knew_strides[0], knew_strides[1], knew_strides[2], vnew_strides[0], vnew_strides[1], vnew_strides[2],
        final_strides[0], final_strides[1], final_strides[2],
        final_lse_strides[0], final_lse_strides[1], final_lse_strides[2],
        seqlen_new, appended, capacity, num_blocks,
        num_kv_heads, group, num_row_tiles, num_splits, qk_scale,
        window_left, window_right, softcap_in, softcap_out,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, PAGE_SIZE, CAUSAL, WRITE_LSE,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, HAS_START, KV_SCALE,
        DOT_F32, DOT_PRECISION, APPEND, MERGE, MERGE_LSE, BLOCK_S,
    )


@triton.jit
def _baseline_kernel(
    Q, K, V, BlockTable, SeqLens, Out, Lse,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb, stride_btn, stride_sl,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh, stride_lt,
    seqlen_new, appended, capacity, num_blocks, num_heads, group, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per (batch, query head): its T new tokens against the whole context."""
    pid = tl.program_id(0)
    head = pid % num_heads
    batch = (pid // num_heads).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(SeqLens + batch * stride_sl) + appended, 0), capacity)
    causal_shift = length - seqlen_new

    row_token = tl.arange(0, BLOCK_M)
    row_head = tl.zeros([BLOCK_M], dtype=tl.int32) + head
    row_ok = row_token < seqlen_new
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = (Q + batch * stride_qb + head.to(tl.int64) * stride_qh
              + row_token[:, None].to(tl.int64) * stride_qt + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    kv_head = (head // group).to(tl.int64)
    K = K + kv_head * stride_kh
    V = V + kv_head * stride_vh
    bt_row = BlockTable + batch * stride_btb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, length, BLOCK_N):
        acc, l_i, m_i = _attend_cache_tile(
            acc, l_i, m_i, q, K, V, K, V, bt_row, stride_btn, batch,
            stride_kb, stride_ks, stride_vb, stride_vs, 0, 0, 0, 0,
            start_n, offs_n, offs_d, row_token, length, causal_shift, num_blocks, qk_scale,
            0, 0, 0.0, 0.0, 0.0, 0,
            HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, True, CAUSAL, DOT_F32, DOT_PRECISION,
            False, False, False, False, 0,
        )
    _store_rows(
        Out, Lse, acc, l_i, m_i, 0, batch, row_token, row_head, row_ok, offs_d,
        0, stride_ob, stride_ot, stride_oh,
        0, stride_lb, stride_lh, stride_lt,
        HEAD_DIM, WRITE_LSE,
    )


@triton.jit
def _round_half_even(y):
    """``y`` (``|y| < 2**22``) rounded to an integer, ties to even: past ``2**23`` a float32 has no
    fraction bits, and the addition rounds to nearest even (the same code in the interpreter,
    which has no ``rint``; ``benchmarks/tools/plain_ptx.py --quantized`` shows the PTX keeps it)."""
    r = (tl.abs(y) + 8388608.0) - 8388608.0
    return tl.where(y < 0, -r, r)


@triton.jit
def _round_to_e4m3(y):
    """``y`` (``|y| <= 448``) rounded to the nearest float8_e4m3fn value, ties to even, as
    float32: 3 fraction bits per binade, and the binades below ``2**-6`` share its spacing
    (subnormals). Exact arithmetic (scaling by powers of two) around one rounding, so the
    interpreter, whose e4m3 conversion truncates, rounds as the GPU does."""
    a = tl.abs(y)
    binade = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    step = ((binade + 124) << 23).to(tl.float32, bitcast=True)  # 2 ** (binade - 3)
    inverse = ((130 - binade) << 23).to(tl.float32, bitcast=True)  # 2 ** (3 - binade)
    r = _round_half_even(a * inverse) * step
    # The sign by a product, not ``-r``: negation compiles to ``0 - r``, which makes -0.0 +0.0
    # (the conversion keeps the sign of a value that rounds to zero).
    return r * tl.where(y < 0, -1.0, 1.0)


@triton.jit
def _quantized(x, Scale, scale_offs, row_ok, PER_TOKEN: tl.constexpr, OUT: tl.constexpr):
    """Rows ``x [H, D]`` (one token's KV heads; zeros past the head dim) as ``OUT``
    (float8_e4m3fn or int8): ``x / scale`` in float32 (IEEE division), saturated to the format's
    range and rounded to nearest even (``reference.quantize``). ``PER_TOKEN``: each row's scale
    is ``max |x| / range`` and is stored at ``Scale + scale_offs``; else it is read from there."""
    if OUT == tl.int8:
        bound = 127.0
    else:
        bound = 448.0
    x = x.to(tl.float32)
    if PER_TOKEN:
        scale = tl.div_rn(tl.max(tl.abs(x), axis=1), bound)
        tl.store(Scale + scale_offs, scale, mask=row_ok)
    else:
        scale = tl.load(Scale + scale_offs, mask=row_ok, other=1.0)
    # A row of zeros has scale 0 (per token): divide by 1 instead, it stays 0.
    y = tl.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
    y = tl.minimum(tl.maximum(y, -bound), bound)
    if OUT == tl.int8:
        y = _round_half_even(y)
    else:
        y = _round_to_e4m3(y)
    return y.to(OUT)


@triton.jit
def _append_tile_tokens(
    KNew, VNew, K, V, KScale, VScale, bt_row, stride_btn, batch,
    stride_nkt, stride_nvt,
    stride_kb, stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss,
    first_key, key_start, lo, tiles_end, below_start, seqlen_new, capacity, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """The append fused into a decode program (``APPEND``): write the new tokens of one KV head
    whose keys lie in the tiles this program reads, ``[lo, tiles_end)``, and with
    ``below_start`` also those below the sequence's key start (which no program reads).

    Keys count from the key start: new token ``t`` has key ``first_key + t`` and cache position
    ``first_key + t + key_start`` (``cache_seqlens[b] + t``). Every key a program reads is one it
    wrote itself or one that was in the cache before the call, so no program waits on another;
    programs of several row tiles (or overlapping window spans) write the same bytes. As in
    :func:`_append_kernel`, positions outside ``[0, capacity)`` or on a page index outside
    ``[0, num_blocks)`` are skipped, and a quantized cache gets :func:`_quantized` values (per-token
    scales written beside the slot). ``KNew``/``VNew`` (at the batch and KV head), ``K``, ``V``
    and the scales already point at the KV head; ``V`` may be a 1-byte cache's int16 words
    (:func:`value_operand`), written byte by byte.
    """
    t_begin = tl.maximum(lo - first_key, 0)
    t_end = tl.minimum(tiles_end - first_key, seqlen_new)
    if below_start:
        t_begin = 0
        t_end = tl.maximum(t_end, tl.minimum(-first_key, seqlen_new))
    V_WORDS: tl.constexpr = V.dtype.element_ty == tl.int16  # strides in words of two entries
    if V_WORDS:
        VB = V.to(tl.pointer_type(K.dtype.element_ty), bitcast=True)
    else:
        VB = V
    offs_d = tl.arange(0, BLOCK_D)
    for t0 in range(t_begin, t_end, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        keys = first_key + tokens
        mine = (keys >= lo) & (keys < tiles_end)
        if below_start:
            mine = mine | (keys < 0)
        pos = keys + key_start
        ok = mine & (tokens < t_end) & (pos >= 0) & (pos < capacity)
        if PAGE_SIZE == 0:
            block = batch + tl.zeros([BLOCK_T], dtype=tl.int64)
            slot = pos.to(tl.int64)
        else:
            block = tl.load(bt_row + (pos // PAGE_SIZE) * stride_btn, mask=ok, other=-1)
            ok = ok & (block >= 0) & (block < num_blocks)
            block = block.to(tl.int64)
            slot = (pos % PAGE_SIZE).to(tl.int64)
        tokens64 = tokens.to(tl.int64)
        mask = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(KNew + tokens64[:, None] * stride_nkt + offs_d[None, :], mask=mask)
        v = tl.load(VNew + tokens64[:, None] * stride_nvt + offs_d[None, :], mask=mask)
        if KV_SCALE != 0:
            k = _quantized(tl.where(mask, k, 0.0), KScale, block * stride_ksb + slot * stride_kss, ok,
                           KV_SCALE == 2, K.dtype.element_ty)
            v = _quantized(tl.where(mask, v, 0.0), VScale, block * stride_vsb + slot * stride_vss, ok,
                           KV_SCALE == 2, K.dtype.element_ty)
        tl.store(K + (block * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :], k, mask=mask)
        v_rows = block * stride_vb + slot * stride_vs  # int64: a word offset may pass 2**31 bytes
        if V_WORDS:
            v_rows = v_rows * 2
        tl.store(VB + v_rows[:, None] + offs_d[None, :], v, mask=mask)


@triton.jit
def _append_kernel(
    KNew, VNew, K, V, KScale, VScale, BlockTable, SeqLens,
    stride_nkb, stride_nkt, stride_nkh,
    stride_nvb, stride_nvt, stride_nvh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ksb, stride_kss, stride_ksh,
    stride_vsb, stride_vss, stride_vsh,
    stride_btb, stride_btn, stride_sl,
    seqlen_new, num_kv_heads, num_head_blocks, capacity, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KV_SCALE: tl.constexpr,
):
    """Copy new token ``t`` of sequence ``b`` (a block of heads) to cache position ``len_b + t``.

    A quantized cache (``KV_SCALE`` 1: scales per KV head or tensor, read; 2: per token and KV
    head, computed and written beside the token) gets the token quantized (:func:`_quantized`).
    The scales' strides are ``(block or b, slot, head)``, 0 where the granularity has no such axis.
    """
    pid = tl.program_id(0)
    head_block = pid % num_head_blocks
    row = pid // num_head_blocks
    token = row % seqlen_new
    batch = (row // seqlen_new).to(tl.int64)
    pos = tl.load(SeqLens + batch * stride_sl) + token
    ok = (pos >= 0) & (pos < capacity)
    if PAGE_SIZE == 0:
        block = batch
    else:
        block = tl.load(BlockTable + batch * stride_btb + (pos // PAGE_SIZE) * stride_btn,
                        mask=ok, other=-1)
        ok = ok & (block >= 0) & (block < num_blocks)
        block = block.to(tl.int64)
        pos = pos % PAGE_SIZE
    pos = pos.to(tl.int64)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A slot that cannot be placed gets no valid head. (Not ``ok & block_mask``: Triton 3.9's
    # interpreter splats a scalar comparison as int32 and then rejects it as a mask.)
    heads_to_write = tl.where(ok, num_kv_heads, 0)
    mask = (heads[:, None] < heads_to_write) & (offs_d[None, :] < HEAD_DIM)
    heads = heads.to(tl.int64)
    token = token.to(tl.int64)
    k = tl.load(KNew + batch * stride_nkb + token * stride_nkt + heads[:, None] * stride_nkh
                + offs_d[None, :], mask=mask)
    v = tl.load(VNew + batch * stride_nvb + token * stride_nvt + heads[:, None] * stride_nvh
                + offs_d[None, :], mask=mask)
    if KV_SCALE != 0:
        row_ok = heads < heads_to_write
        k = _quantized(tl.where(mask, k, 0.0), KScale, block * stride_ksb + pos * stride_kss + heads * stride_ksh,
                       row_ok, KV_SCALE == 2, K.dtype.element_ty)
        v = _quantized(tl.where(mask, v, 0.0), VScale, block * stride_vsb + pos * stride_vss + heads * stride_vsh,
                       row_ok, KV_SCALE == 2, V.dtype.element_ty)
    tl.store(K + block * stride_kb + pos * stride_ks + heads[:, None] * stride_kh + offs_d[None, :],
             k, mask=mask)
    tl.store(V + block * stride_vb + pos * stride_vs + heads[:, None] * stride_vh + offs_d[None, :],
             v, mask=mask)


# --------------------------------------------------------------------------------------------
# Host side: geometry, configs, splits, workspace, launchers
# --------------------------------------------------------------------------------------------

_launch_append = Launcher(_append_kernel)
_launch_decode = Launcher(_decode_kernel)


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Shape facts of a cache: ``page_size`` 0 means contiguous ``[B, S_max, Hkv, D]``."""

    page_size: int
    capacity: int  # tokens one sequence can hold: S_max, or max_blocks * page_size
    num_blocks: int  # pages in the pool (paged), batch (contiguous)

    @staticmethod
    def of(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> CacheGeometry:
        if block_table is None:
            return CacheGeometry(0, k_cache.shape[1], k_cache.shape[0])
        page_size = k_cache.shape[1]
        return CacheGeometry(page_size, block_table.shape[1] * page_size, k_cache.shape[0])


def pick_config(head_dim: int, dtype: torch.dtype, interpreted: bool, page_size: int = 0,
                tuned: DecodeTuning | None = None, quantized: bool = False) -> DecodeConfig:
    """Tile and launch parameters for one call: the tuning's table entry (no autotuning).
    ``page_size`` is 0 for a contiguous cache; ``quantized``: a 1-byte cache."""
    if interpreted:
        return INTERPRETER_CONFIG
    tuned = tuned or tuning.decode_tuning(None)
    config = tuned.table(page_size, quantized)[padded_head_dim(head_dim)]
    if dtype == torch.float32:
        return DecodeConfig(max(16, config.block_n // 2), config.num_warps, config.num_stages)
    return config


@functools.lru_cache(maxsize=1024)
def fit_config(config: DecodeConfig, tokens_per_program: int, grid: int, sms: int, page_size: int,
               head_dim: int, waves: int = 1, tuned: DecodeTuning | None = None,
               kv_scale: int = 0, block_m: int = 16) -> DecodeConfig:
    """The table's ``config`` adjusted to how much each program reads (head dims <= 128 only,
    the ones measured): short splits get short tiles; grids of more than the planned ``waves``
    of programs (the batch alone fills the GPU) get, when the programs are short (or the pages
    small), a config that fits three programs per SM, or four (last paragraph). ``block_m``: the
    programs' row-tile height (:func:`pick_block_m`).

    Over a 1-byte cache at head dims padded to 128 (72-128; ``kv_scale`` 1: scales per tensor
    or KV head, 2: per token, :func:`scale_args`) that last config, a bf16 tile of 32 keys,
    never applies: with scales per tensor or head, contiguous or in small pages, a grid that the
    table's 128-key tiles cannot hold at once (three programs per SM) but 64-key tiles can
    (five) gets the 64-key tiles; every other grid keeps the table's tiles (short splits aside,
    which per-token scales keep too: :func:`whole_tiles`). Measured at head dim 128 (graph
    replays, 32 / 8 heads): batch 64 x 1k and 4k ran 1.3 waves of 128-key tiles, the last one
    mostly idle, and 64-key tiles were 10-20% faster there; per-token scales pay a fixed cost
    per tile (the scale loads, the tile's largest V scale), so 32- and 64-key tiles took
    1.16-1.94x the time of 128-key ones at batch 32-128 (``kvquant-multiwave-sweep.json``);
    128-key tiles beat 32-key ones at batch 48 x 1k, 128 x 1k and 256 x 4k with either scale
    (``kvquant-largegrid-sweep.json``).

    Over a cache in q's dtype at head dims padded to 128, contiguous or in small pages, with
    row tiles of 16 (one new token per GQA group of up to 16: taller tiles hold more registers,
    so fewer programs per SM), a grid of more than the three programs per SM that
    ``multi_wave_config`` (32-key tiles, 4 stages, 64 KB) holds at once and at most the four
    that ``one_wave_config`` (3 stages, 48 KB) holds gets the latter, however long its programs
    (measured up to 4k keys each): all of them run at once instead of a second, mostly idle
    wave. Measured at batch 64 (graph replays, 32 / 8 heads, one host): 1k 67.9 -> 66.5 us, 2k
    128.8 -> 126.8, 4k 247.8 -> 246.2 contiguous (it had 128-key tiles), pages of 16 1-2.6% less;
    3 stages lost where they do not fit at once (batch 96 x 1k: 126 against 106 us)."""
    tuned = tuned or tuning.decode_tuning(None)
    if padded_head_dim(head_dim) > 128:
        return config
    small_pages = 0 < page_size < tuned.large_page
    one_byte = kv_scale > 0 and padded_head_dim(head_dim) == 128
    if (one_byte and kv_scale == 1 and (page_size == 0 or small_pages)
            and tuned.quantized_resident_programs_per_sm * sms < grid
            <= tuned.quantized_multi_wave_resident_programs_per_sm * sms):
        return tuned.quantized_multi_wave_config
    if (kv_scale == 0 and padded_head_dim(head_dim) == 128 and block_m == 16 and (page_size == 0 or small_pages)
            and tuned.multi_wave_resident_programs_per_sm * sms < grid
            <= tuned.one_wave_resident_programs_per_sm * sms):
        return tuned.one_wave_config
    if (not one_byte and grid > waves * sms
            and (tokens_per_program <= tuned.multi_wave_max_tokens or small_pages)):
        return tuned.multi_wave_config
    if (tokens_per_program <= tuned.short_split_tokens and config.block_n > tuned.short_block_n
            and not whole_tiles(kv_scale, head_dim)):
        return dataclasses.replace(config, block_n=tuned.short_block_n)
    return config


def whole_tiles(kv_scale: int, head_dim: int) -> bool:
    """Whether short splits keep the table's tiles (and read at least one whole tile each): over a
    1-byte cache with per-token scales (``kv_scale`` 2) at head dims padded to 128, which pay per
    tile for their scales. Measured at head dim 128 (graph replays, 32 / 8 heads, fp8): batch 1
    x 4k 11.1 against 12.2 us contiguous and 11.8 against 14.1 over pages of 16, batch 8 x 1k
    14.2 against 15.3; batch 1 x 1k over pages of 16 9.4 against 9.1 us (docs/perf-notes.md)."""
    return kv_scale == 2 and padded_head_dim(head_dim) == 128


def pick_block_m(rows: int, head_dim: int) -> int:
    """Row-tile height: all ``group * T`` rows when they fit, padded to >= 16 for ``tl.dot``."""
    return max(16, min(next_power_of_2(rows), MAX_TILE_ROWS[padded_head_dim(head_dim)]))


def _warps_for(config: DecodeConfig, block_m: int, head_dim: int) -> int:
    """Tall row tiles (many heads x tokens) get 8 warps so the fp32 accumulator fits in registers."""
    return config.num_warps if block_m * padded_head_dim(head_dim) <= 8192 else max(config.num_warps, 8)


def sm_count(device: torch.device, interpreted: bool) -> int:
    """Streaming multiprocessors of ``device`` (cached per device; a fixed count when interpreted)."""
    if interpreted or device.type != "cuda":
        return INTERPRETER_SMS
    return cuda_properties(device).multi_processor_count


def attended_span(variant: Variant, capacity: int, seqlen_new: int, tile_tokens: int, block_n: int) -> int:
    """Keys one row tile can see at most: the capacity, or with a window bounded on the left
    its span (``left`` + the tile's tokens + ``right``, plus a tile of alignment). Shapes only."""
    if variant.window is None or variant.window[0] < 0:
        return capacity
    left, right = variant.window
    right = seqlen_new if right < 0 else min(right, seqlen_new)
    return min(capacity, left + min(tile_tokens, seqlen_new) + right + block_n)


def waves_for(page_size: int, programs: int, capacity: int, sms: int, tuned: DecodeTuning | None = None,
              quantized: bool = False) -> int:
    """Programs per SM the automatic split count aims for (``page_size`` 0: contiguous;
    ``quantized``: a 1-byte cache)."""
    tuned = tuned or tuning.decode_tuning(None)
    if page_size == 0:
        return tuned.quantized_contiguous_waves if quantized else 1
    if page_size >= tuned.large_page:
        return 1
    two_wave_splits = max(1, (2 * sms) // max(programs, 1))
    return 2 if capacity // two_wave_splits >= tuned.small_page_two_wave_tokens else 1


def pick_num_splits(programs: int, capacity: int, block_n: int, sms: int, interpreted: bool,
                    page_size: int = 0, min_split_tokens: int | None = None,
                    tuned: DecodeTuning | None = None, quantized: bool = False) -> int:
    """Splits for ``programs`` (batch x kv heads x row tiles) programs: a wave or two per SM.

    Depends on shapes only (no look at the lengths, so no host sync). Each split gets at least
    ``min_split_tokens`` (default the tuning's; one tile when interpreted) of the capacity.
    """
    tuned = tuned or tuning.decode_tuning(None)
    if min_split_tokens is None:
        min_split_tokens = tuned.min_split_tokens
    waves = waves_for(page_size, programs, capacity, sms, tuned, quantized)
    # Round down: one program past a whole wave costs a second, nearly empty wave (a decode
    # program holds a whole SM's shared memory). B=1, 131k: 17 splits x 8 = 136 programs on 132
    # SMs ran at 2.75 TB/s, 16 splits at 3.92.
    wanted = (waves * sms) // max(programs, 1)
    min_tokens = block_n if interpreted else max(block_n, min_split_tokens)
    by_context = max(1, cdiv(capacity, min_tokens))
    return max(1, min(wanted, by_context, tuned.max_auto_splits))


def block_table_args(block_table, cache_seqlens):
    """``(pointer, (stride_b, stride_column))`` of the block table; ``cache_seqlens`` stands in
    as an unused pointer for a contiguous cache."""
    if block_table is None:
        return cache_seqlens, (0, 0)
    return block_table, (block_table.stride(0), block_table.stride(1))


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    s = x.stride()
    return s[0], s[1], s[2]


def value_operand(v_cache: torch.Tensor, quantized: bool) -> torch.Tensor:
    """V as the decode kernel reads it: a 1-byte cache as int16 words, two entries each
    (:func:`_value_pairs`), where its layout allows (even head dim, unit last stride, even
    strides, an even address); otherwise, and for a cache in q's dtype, ``v_cache`` itself
    (read byte by byte)."""
    if (not quantized or v_cache.element_size() != 1 or v_cache.stride(-1) != 1 or v_cache.shape[-1] % 2
            or v_cache.data_ptr() % 2 or any(stride % 2 for stride in v_cache.stride()[:-1])):
        return v_cache
    return v_cache.view(torch.int16)


NO_SCALE = (0, (0, 0, 0))


def scale_args(scale: torch.Tensor | None) -> tuple[int, tuple[int, int, int]]:
    """``(KV_SCALE, (stride_block, stride_slot, stride_head))`` of a quantized cache's scale:
    ``(0, ...)`` without one; 1 for one scale per tensor (``[]``/``[1]``: all strides 0) or per
    KV head (``[Hkv]``); 2 per token and KV head (the cache's leading shape, 3-D)."""
    if scale is None:
        return NO_SCALE
    if scale.dim() == 3:
        return 2, scale.stride()
    return 1, (0, 0, scale.stride(0) if scale.numel() > 1 else 0)


def append_kv(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, k_scale=None, v_scale=None) -> None:
    """Write ``k_new, v_new [B, T, Hkv, D]`` into the cache at ``cache_seqlens[b] + t``, in place.

    A quantized cache (``k_scale``/``v_scale`` of one granularity, see :func:`scale_args`) gets
    the tokens quantized; per-token scales are written at the tokens' slots.
    """
    batch, seqlen_new, num_kv_heads, head_dim = k_new.shape
    if batch == 0 or seqlen_new == 0:
        return
    geometry = CacheGeometry.of(k_cache, block_table)
    block_d = padded_head_dim(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, APPEND_TILE_ELEMENTS // block_d))
    num_head_blocks = cdiv(num_kv_heads, block_h)
    bt, (stride_btb, stride_btn) = block_table_args(block_table, cache_seqlens)
    mode, ks_strides = scale_args(k_scale)
    _, vs_strides = scale_args(v_scale)
    _launch_append((batch * seqlen_new * num_head_blocks,),
        k_new, v_new, k_cache, v_cache, k_scale if mode else k_cache, v_scale if mode else v_cache, bt,
        cache_seqlens,
        k_new.stride(0), k_new.stride(1), k_new.stride(2),
        v_new.stride(0), v_new.stride(1), v_new.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *ks_strides, *vs_strides,
        stride_btb, stride_btn, cache_seqlens.stride(0),
        seqlen_new, num_kv_heads, num_head_blocks, geometry.capacity, geometry.num_blocks,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, PAGE_SIZE=geometry.page_size, KV_SCALE=mode,
        num_warps=4,
    )


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """What :func:`decode_forward` decides from shapes alone: the tile config, the row tiles,
    the split count, the grid of the decode kernel, and whether the kernel merges its splits
    itself (:func:`merges_in_kernel`) or ``combine`` does."""

    config: DecodeConfig
    group: int  # query heads per KV head
    block_m: int
    num_row_tiles: int
    num_splits: int
    num_warps: int
    grid: tuple[int]
    merge: bool = False


def plan_decode(q: torch.Tensor, num_kv_heads: int, geometry: CacheGeometry, variant: Variant, num_splits: int,
                config: DecodeConfig | None, tuned: DecodeTuning, kv_scale: int, interpreted: bool) -> DecodeLaunch:
    """The :class:`DecodeLaunch` of a call: ``q [B, T, Hq, D]``, the cache's ``geometry``, the
    variant (its window bounds the keys a split reads), the requested ``num_splits`` (0:
    automatic), ``config`` (None: the tuning's table) and the cache's scale mode ``kv_scale``
    (:func:`scale_args`: 0 for a cache in q's dtype)."""
    batch, seqlen_new, num_heads, head_dim = q.shape
    quantized = kv_scale != 0
    from_table = config is None
    if from_table:
        config = pick_config(head_dim, q.dtype, interpreted, geometry.page_size, tuned, quantized)
    group = num_heads // num_kv_heads
    block_m = pick_block_m(group * seqlen_new, head_dim)
    num_row_tiles = cdiv(group * seqlen_new, block_m)
    programs = batch * num_kv_heads * num_row_tiles
    span = attended_span(variant, geometry.capacity, seqlen_new, block_m // max(group, 1) + 1, config.block_n)
    sms = sm_count(q.device, interpreted)
    # The short-context rules (fit_config) hold where they were measured: tuned bf16/fp16 configs
    # at head dims <= 128. Their splits may be as short as one short tile.
    short_rules = (from_table and not interpreted and q.dtype != torch.float32
                   and padded_head_dim(head_dim) <= 128)
    if num_splits == 0:
        short_n = config.block_n if whole_tiles(kv_scale, head_dim) else min(config.block_n, tuned.short_block_n)
        num_splits = pick_num_splits(
            programs, span, short_n if short_rules else config.block_n, sms,
            interpreted, page_size=geometry.page_size,
            min_split_tokens=tuned.min_split_tokens if short_rules else tuned.unmeasured_min_split_tokens,
            tuned=tuned, quantized=quantized)
    if short_rules:
        config = fit_config(config, cdiv(span, num_splits), programs * num_splits, sms, geometry.page_size,
                            head_dim, waves_for(geometry.page_size, programs, span, sms, tuned, quantized), tuned,
                            kv_scale, block_m)
    capturing = q.is_cuda and not interpreted and torch.cuda.is_current_stream_capturing()
    merge = merges_in_kernel(num_splits, batch * num_kv_heads * head_dim * q.element_size(), span, tuned, capturing,
                             quantized)
    return DecodeLaunch(config, group, block_m, num_row_tiles, num_splits, _warps_for(config, block_m, head_dim),
                        (programs * num_splits,), merge)


def merges_in_kernel(num_splits: int, bytes_per_key: int, span: int, tuned: DecodeTuning, capturing: bool,
                     quantized: bool = False) -> bool:
    """Whether the decode kernel merges its splits itself (the last program of each row tile,
    :func:`_last_split_merges`) rather than a ``combine`` launch after it: for calls not under
    CUDA-graph capture (graph replays keep the combine: in a graph the in-kernel merge cost 0.7-0.9
    us more GPU time over contiguous caches, 1-2 us at 33 splits over fp8 ones) whose step reads at
    most ``tuned.merge_in_kernel_max_bytes`` of K and V (``span`` keys of ``bytes_per_key`` each,
    q's dtype: an upper bound for 1-byte caches), or, over a cache in q's dtype, has at most
    ``tuned.merge_in_kernel_max_splits`` splits. Why: steps up to that size are host-bound, and a
    launch less took 1.2-2.6 us off an eager call (docs/perf-notes.md, "The splits merged in the
    decode kernel"); and in eager calls of longer steps the kernel boundary the combine adds cost
    more than the merge (back-to-back eager calls on the H200, bf16, head dim 128, one new token,
    2 to 16 splits: 0.7-2.0 us less per call at batch 8 x 4k, batch 1 x 32k and 128k, batch 8 x
    32k; at 33 splits over pages of 16, batch 1 x 32k, 1.1 us more; "Eager steps of few splits
    merge in the kernel at any size"). The span is rounded up to :func:`plan_span_step` keys,
    so the choice, like the rest of the plan, depends on a contiguous cache's capacity only
    through it."""
    if num_splits == 1 or capturing:
        return False
    if not quantized and num_splits <= tuned.merge_in_kernel_max_splits:
        return True
    step = plan_span_step(tuned)
    return cdiv(span, step) * step * 2 * bytes_per_key <= tuned.merge_in_kernel_max_bytes


@functools.lru_cache(maxsize=None)
def plan_span_step(tuned: DecodeTuning) -> int:
    """Keys ``g`` such that :func:`plan_decode` over a contiguous cache (``config`` None) depends
    on its capacity only through ``cdiv(capacity, g)``: a cache that grows by a key per step
    needs a new plan once every ``g`` steps.

    Why: the capacity enters only as the span, the capacity or ``min(capacity, c)`` with ``c``
    fixed by the window and shapes, so ``cdiv(span, g)`` is ``cdiv(capacity, g)`` or
    ``min(cdiv(capacity, g), cdiv(c, g))``; the span then enters only as ``cdiv(span,
    min_tokens)`` (the split count; ``waves_for`` of a contiguous cache ignores it) and as
    comparisons ``cdiv(span, splits) <= t`` (``fit_config``), which hold exactly when ``span <=
    splits * t``. With ``g`` dividing ``min_tokens`` and every ``t`` (the tiles' key counts,
    their float32 halves, the interpreter's tile and the rules' token counts), each of those is
    a function of ``cdiv(span, g)``. ``tests/test_ops.py`` checks it against the plan.
    """
    tiles = [config.block_n for table in (tuned.contiguous, tuned.quantized_contiguous) for config in table.values()]
    counts = tiles + [max(16, block_n // 2) for block_n in tiles] + [
        INTERPRETER_CONFIG.block_n, tuned.short_block_n, tuned.min_split_tokens, tuned.unmeasured_min_split_tokens,
        tuned.short_split_tokens, tuned.multi_wave_max_tokens, tuned.multi_wave_config.block_n,
        tuned.one_wave_config.block_n, tuned.quantized_multi_wave_config.block_n]
    return math.gcd(*counts)


def split_targets(q, out, lse, num_splits):
    """Where a decode kernel writes: ``out``/``lse`` with one split, else fp32 partials
    ``[S, B, T, Hq, D]`` and their LSE ``[S, B, Hq, T]`` in a workspace allocated for the call
    (PyTorch's caching allocator: no new device memory once warm, stream-ordered, so concurrent
    calls on different streams never share it, and CUDA-graph capture takes it from the graph's
    pool). Returns ``(target, target_lse, o_strides, l_strides)``, the strides with a split
    stride first."""
    batch, seqlen_new, num_heads, head_dim = q.shape
    if num_splits == 1:
        o_strides = (0, out.stride(0), out.stride(1), out.stride(2))
        l_strides = (0, lse.stride(0), lse.stride(1), lse.stride(2)) if lse is not None else (0,) * 4
        return out, lse, o_strides, l_strides
    n_out = num_splits * batch * seqlen_new * num_heads * head_dim
    n_lse = num_splits * batch * num_heads * seqlen_new
    buf = allocate((n_out + n_lse,), torch.float32, q.device)
    target = buf[:n_out].view(num_splits, batch, seqlen_new, num_heads, head_dim)
    target_lse = buf[n_out:].view(num_splits, batch, num_heads, seqlen_new)
    return target, target_lse, target.stride()[:4], target_lse.stride()


def decode_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    appended: int,
    causal: bool,
    softmax_scale: float,
    num_splits: int = 0,
    config: DecodeConfig | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tuned: DecodeTuning | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> None:
    """Attend ``q`` to the cache; writes ``out`` and ``lse`` (or None). New keys are already
    appended (``appended`` of them, 0 or T), or given as ``k_new, v_new [B, T, Hkv, D]`` with
    ``appended`` T: the decode kernel appends them itself, as :func:`append_kv` would, in the
    same launch. A quantized cache (float8_e4m3fn or int8) comes with ``k_scale``/``v_scale`` of
    one granularity (:func:`scale_args`).

    Shapes: ``q [B, T, Hq, D]``, caches as in the module docstring, ``cache_seqlens [B]``
    int32, ``out [B, T, Hq, D]``, ``lse [B, Hq, T]`` float32, ``cache_leftpad [B]`` int32 or
    None. Inputs are validated by the caller; B, T >= 1. ``num_splits`` 0 picks from the SM
    count and the capacity (with a window bounded on the left: from the window's span instead,
    see :func:`attended_span`). The variant arguments are those of ``flash_attn_with_kvcache``.
    ``config`` overrides the tuned tile; ``tuned`` the tuning (default: the device's).
    """
    if k_new is not None and appended != q.shape[1]:
        raise ValueError(f"decode_forward appends k_new's {q.shape[1]} tokens itself: pass appended={q.shape[1]}, "
                         f"not {appended}")
    interpreted = is_interpreted(_decode_kernel)
    geometry = CacheGeometry.of(k_cache, block_table)
    variant = Variant.of(causal, window_size, softcap, alibi_slopes, sinks)
    if tuned is None:
        tuned = tuning.decode_tuning(q.device if not interpreted else None)
    kv_scale, ks_strides = scale_args(k_scale)
    plan = plan_decode(q, k_cache.shape[2], geometry, variant, num_splits, config, tuned, kv_scale, interpreted)
    num_splits = plan.num_splits
    seqlen_new = q.shape[1]
    target, target_lse, o_strides, l_strides = split_targets(q, out, lse, num_splits)
    bt, bt_strides = block_table_args(block_table, cache_seqlens)
    mods = variant.kernel_args(softmax_scale, seqlen_new, geometry.capacity, unused=q)
    _, vs_strides = scale_args(v_scale)
    v_operand = value_operand(v_cache, kv_scale != 0)
    append = k_new is not None
    merge = plan.merge  # the last split of each row tile merges them (_last_split_merges): no combine launch
    if merge:
        counters = allocate((plan.grid[0] // num_splits,), torch.int32, q.device, zeroed=True)
    # Arguments named in LENGTH_ARGUMENTS are rebound by rebind_lengths: change them together.
    _launch_decode(
        plan.grid,
        q, k_cache, v_operand, k_scale if kv_scale else q, v_scale if kv_scale else q,
        bt, cache_seqlens, target, target_lse if target_lse is not None else target,
        mods.pop("Slopes"), mods.pop("Sinks"), cache_leftpad if cache_leftpad is not None else cache_seqlens,
        k_new if append else q, v_new if append else q,
        out, lse if lse is not None and merge else out, counters if merge else cache_seqlens,
        _strides3(q), _strides3(k_cache), _strides3(v_operand), ks_strides, vs_strides, bt_strides,
        cache_seqlens.stride(0),
        o_strides, l_strides, mods.pop("alibi_strides"), mods.pop("sink_stride"),
        cache_leftpad.stride(0) if cache_leftpad is not None else 0,
        _strides3(k_new) if append else (0, 0, 0), _strides3(v_new) if append else (0, 0, 0),
        _strides3(out), tuple(lse.stride()) if lse is not None and merge else (0, 0, 0),
        seqlen_new=seqlen_new, appended=appended, capacity=geometry.capacity, num_blocks=geometry.num_blocks,
        num_kv_heads=k_cache.shape[2], group=plan.group, num_row_tiles=plan.num_row_tiles, num_splits=num_splits,
        qk_scale=softmax_scale * LOG2E,
        HEAD_DIM=q.shape[3], BLOCK_D=padded_head_dim(q.shape[3]),
        BLOCK_M=plan.block_m, BLOCK_N=plan.config.block_n, PAGE_SIZE=geometry.page_size,
        WRITE_LSE=target_lse is not None, HAS_START=cache_leftpad is not None, KV_SCALE=kv_scale,
        APPEND=append, MERGE=merge, MERGE_LSE=merge and lse is not None,
        BLOCK_S=min(next_power_of_2(num_splits), max(1, MERGE_ELEMENTS // padded_head_dim(q.shape[3]))),
        num_warps=plan.num_warps, num_stages=plan.config.num_stages,
        **mods, **dot_flags(q.dtype, interpreted), **exponent_options(softmax_scale),
    )
    if num_splits > 1 and not merge:
        combine(target, target_lse, out, lse, softmax_scale=softmax_scale)


# The decode kernel's arguments that follow a contiguous cache's length (its capacity): the
# caches' strides, the capacity, and the window bounds clamped to it (Variant.window_args; the
# kernel does not specialize on them).
LENGTH_ARGUMENTS = ("k_strides", "v_strides", "capacity", "window_left", "window_right")
_LENGTH_INDICES = tuple(_decode_kernel.arg_names.index(name) for name in LENGTH_ARGUMENTS)


def length_arguments(k_cache: torch.Tensor, v_cache: torch.Tensor, variant: Variant, seqlen_new: int,
                     quantized: bool = False) -> tuple:
    """The values of :data:`LENGTH_ARGUMENTS` for contiguous caches ``[B, S, Hkv, D]``, as
    :func:`decode_forward` passes them (``quantized``: 1-byte caches with scales)."""
    capacity = k_cache.shape[1]
    return (_strides3(k_cache), _strides3(value_operand(v_cache, quantized)), capacity,
            *variant.window_args(seqlen_new, capacity))


def rebind_lengths(replay, lengths: tuple):
    """``replay`` (the recorded launches of a decode call over a contiguous cache that appended
    nothing) with :data:`LENGTH_ARGUMENTS` set to ``lengths`` (:func:`length_arguments` of the new
    caches), or None when its first launch is not this module's decode kernel.

    The caller vouches that everything else of the new call equals the recorded call's: every
    other argument's layout and value, the :class:`DecodeLaunch`, and Triton's specialization of
    ``lengths`` (``_launch.runtime_key``), so the rebound launches are those the full path would
    make.
    """
    if not replay.launchers or replay.launchers[0] is not _launch_decode:
        return None
    return replay.with_arguments(0, dict(zip(_LENGTH_INDICES, lengths)))


def baseline_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    causal: bool,
    softmax_scale: float,
    config: DecodeConfig | None = None,
) -> None:
    """The seed's straightforward decode, same contract as :func:`decode_forward` (it appends
    ``k_new, v_new`` itself).

    One program per (batch, query head) reads its KV head's whole context: K/V are read
    ``Hq / Hkv`` times and only ``B * Hq`` programs run. ``T`` (new tokens) must be <= 128.
    """
    if k_new is not None:
        append_kv(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table)
    batch, seqlen_new, num_heads, head_dim = q.shape
    if seqlen_new > 128:
        raise ValueError(f"baseline_decode handles at most 128 new tokens, got {seqlen_new}")
    num_kv_heads = k_cache.shape[2]
    geometry = CacheGeometry.of(k_cache, block_table)
    interpreted = is_interpreted(_baseline_kernel)
    if config is None:
        config = pick_config(head_dim, q.dtype, interpreted)
    bt, (stride_btb, stride_btn) = block_table_args(block_table, cache_seqlens)
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    _baseline_kernel[(batch * num_heads,)](
        q, k_cache, v_cache, bt, cache_seqlens, out, lse if lse is not None else out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_btb, stride_btn, cache_seqlens.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *lse_strides,
        seqlen_new, seqlen_new if k_new is not None else 0, geometry.capacity, geometry.num_blocks,
        num_heads, num_heads // num_kv_heads, softmax_scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        BLOCK_M=max(16, next_power_of_2(seqlen_new)), BLOCK_N=config.block_n,
        PAGE_SIZE=geometry.page_size, CAUSAL=causal, WRITE_LSE=lse is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **dot_flags(q.dtype, interpreted), **exponent_options(softmax_scale),
    )
