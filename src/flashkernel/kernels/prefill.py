"""Fused attention forward (FlashAttention-style): one program per (query tile, head, batch).

The query tile stays on chip while key/value tiles stream through; softmax is computed online
in fp32 with exp2 and the scale folded into one multiply. Causal tiles entirely above the
diagonal are never visited; tiles fully below it run a loop with no masking at all, and only
the diagonal / boundary tiles pay for masks.

Tiles are loaded through TMA descriptors built in the kernel (Hopper, ``seqlen_k >=
TMA_MIN_SEQLEN_K``, 16-byte aligned tensors; the hardware zero-fills rows past the end and the
head-dim padding) or through pointers whose offsets are rebuilt from a scalar base every tile
(2-D pointer tensors carried across iterations cost ~256 registers and spilled). One tuned table
per path (docs/perf-notes.md).

Launch grid: ``(num_query_tiles, Hq, B)``. Query tiles vary fastest so the programs resident
at one time share one head's K/V in L2; with ``causal`` the longest tiles are issued first.

Variants (``kernels/_softmax.py``): a sliding window visits only the key tiles inside some row's
window, ``[lo, hi)`` per query tile, and runs the tiles inside every row's window without masks,
so the masked tiles are the two boundary runs and time falls with the window. Softcap and ALiBi
modify the scores in every tile; a sink starts the running max and sum. One kernel,
``_attention_fwd_kernel``, serves every call: each variant is a constexpr feature.

Packed sequences (``varlen_forward``): grid ``(tile bound, Hq, 1)`` over a flat list of the
sequences' query tiles; each program finds its sequence from ``cu_seqlens_q`` on the device.

Which kernel serves a call (this one or the Gluon kernel of ``gluon/prefill.py``) is decided in
``kernels/dispatch.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from . import tuning
from ._common import cdiv, cuda_properties, dot_flags, exponent_options, is_interpreted, next_power_of_2, padded_head_dim, tma_compatible
from ._launch import Launcher
from ._softmax import Variant, attend_scores, unmasked_run, window_span
from .tuning import TileConfig

LOG2E = math.log2(math.e)
MAX_GRID_YZ = 65535
MAX_VARLEN_SEQS = 1024  # sequences per varlen launch: the tile schedule's prefix sum is a vector


# Tile configs per GPU are data: kernels/tuned/prefill.json, read by kernels/tuning.py (with a
# heuristic for GPUs it does not list, and opt-in autotuning). Swept on an H200:
# benchmarks/prefill.py --sweep-configs --tma 1 0, docs/perf-notes.md.
# Below this many keys the per-program descriptor setup costs more than TMA saves (1k: -6%,
# 16k: +8% at head dim 128 on the H200).
TMA_MIN_SEQLEN_K = 4096
INTERPRETER_CONFIG = TileConfig(32, 32, 4, 1)


def pick_config(head_dim: int, dtype: torch.dtype, interpreted: bool, tma: bool,
                device: torch.device | None = None) -> TileConfig:
    """Tile shape and launch parameters for one call: the device's table entry (no autotuning on
    the hot path; see ``kernels/tuning.py``). ``device`` defaults to the current CUDA device."""
    if interpreted:
        return INTERPRETER_CONFIG
    block_d = padded_head_dim(head_dim)
    if dtype == torch.float32:
        # fp32 tiles are twice as large in shared memory and use exact fp32 products.
        return TileConfig(64, 32, 4, 2 if block_d <= 128 else 1)
    return tuning.triton_tile_config(device or torch.device("cuda"), block_d, tma)


@triton.jit
def _load_tile(src, row0, num_rows, stride_row, offs_r, offs_d,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr, ROW_MASK: tl.constexpr):
    """Rows ``row0 + offs_r`` of a ``[num_rows, HEAD_DIM]`` matrix, zero outside it.

    ``src`` is a tensor descriptor (TMA: the hardware zero-fills out-of-bounds rows and the
    head-dim padding) or the matrix's base pointer (offsets rebuilt here, in int64, so no 2-D
    pointer tensor is carried through the key loop).
    """
    # Branches are if/else, not early returns: Triton would still build the code after a return.
    if USE_TMA:
        tile = src.load([row0, 0])
    else:
        rows = row0 + offs_r
        ptrs = src + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :]
        if ROW_MASK:
            mask = rows[:, None] < num_rows
            if BLOCK_D != HEAD_DIM:
                mask = mask & (offs_d[None, :] < HEAD_DIM)
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
    seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
    window_left, window_right, softcap_in, softcap_out, alibi_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """One online-softmax step over the key/value tile starting at ``start_n``.

    ``m_i`` holds the running row max of the scores in log2 units (already scaled).
    With ``MASKED`` the tile may hold keys past ``seqlen_k`` or outside a row's causal range or
    window. Row ``i`` (``offs_m``) has position ``i + causal_shift`` (see ``_softmax``).
    """
    k = _load_tile(k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, MASKED)
    v = _load_tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, MASKED)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return attend_scores(acc, l_i, m_i, qk, v, offs_m + causal_shift, start_n + offs_n, seqlen_k, qk_scale,
                         window_left, window_right, softcap_in, softcap_out, alibi_rows,
                         MASKED, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION)


@triton.jit
def _varlen_tile(CuSeqlensQ, CuSeqlensK, tile, num_seqs, total_q, total_k,
                 BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """Sequence and query tile of flat tile ``tile``: the sequences' query tiles end to end.

    Returns ``(seq, m_tile, start_q, seqlen_q, start_k, seqlen_k)``. A tile past the last one
    gets sequence 0 with both lengths 0 (its program then does nothing). Offsets are clamped to
    ``[0, total]`` and made non-decreasing, so unchecked bad ``cu_seqlens`` give wrong results
    but no out-of-bounds access.
    """
    seqs = tl.arange(0, BLOCK_B)
    real = seqs < num_seqs
    q_start = tl.load(CuSeqlensQ + seqs, mask=real, other=0)
    q_end = tl.load(CuSeqlensQ + seqs + 1, mask=real, other=0)
    k_start = tl.load(CuSeqlensK + seqs, mask=real, other=0)
    k_end = tl.load(CuSeqlensK + seqs + 1, mask=real, other=0)
    q_start = tl.minimum(tl.maximum(q_start, 0), total_q)
    q_end = tl.minimum(tl.maximum(q_end, q_start), total_q)
    k_start = tl.minimum(tl.maximum(k_start, 0), total_k)
    k_end = tl.minimum(tl.maximum(k_end, k_start), total_k)
    tiles = (q_end - q_start + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    # The first sequence whose tiles end after `tile`; BLOCK_B (no lane) past the last tile.
    seq = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    pick = seqs == seq
    first_tile = tl.sum(tl.where(pick, tiles_end - tiles, 0), 0)
    start_q = tl.sum(tl.where(pick, q_start, 0), 0)
    seqlen_q = tl.sum(tl.where(pick, q_end - q_start, 0), 0)
    start_k = tl.sum(tl.where(pick, k_start, 0), 0)
    seqlen_k = tl.sum(tl.where(pick, k_end - k_start, 0), 0)
    live = seq < num_seqs
    return (tl.where(live, seq, 0), tl.where(live, tile - first_tile, 0),
            start_q, seqlen_q, start_k, seqlen_k)


@triton.jit
def _attention_fwd_program(
    Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, Slopes, Sinks,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_ab, stride_ah, stride_sh,
    seqlen_q, seqlen_k, num_seqs, group_size, qk_scale,
    window_left, window_right, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_B: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Varlen: program_id(0) is a flat tile over all sequences; seqlen_q/seqlen_k arrive as the
    # totals and become this sequence's lengths. Dense: (query tile, head, batch).
    if IS_VARLEN:
        batch, m_tile, start_q, seqlen_q, start_k, seqlen_k = _varlen_tile(
            CuSeqlensQ, CuSeqlensK, tl.program_id(0), num_seqs, seqlen_q, seqlen_k, BLOCK_M, BLOCK_B)
        if CAUSAL or HAS_WINDOW:
            pid_m = tl.maximum(tl.cdiv(seqlen_q, BLOCK_M) - 1 - m_tile, 0)  # longest tiles first
        else:
            pid_m = m_tile
        head = tl.program_id(1)
        batch = batch.to(tl.int64)
        start_q = start_q.to(tl.int64)
        start_k = start_k.to(tl.int64)
    else:
        num_m_tiles = tl.cdiv(seqlen_q, BLOCK_M)
        if CAUSAL or HAS_WINDOW:
            pid_m = num_m_tiles - 1 - tl.program_id(0)  # longest (most keys) tiles first
        else:
            pid_m = tl.program_id(0)
        head = tl.program_id(1)
        batch = tl.program_id(2).to(tl.int64)
    kv_head = (head // group_size).to(tl.int64)
    head = head.to(tl.int64)

    first_row = pid_m * BLOCK_M
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    causal_shift = seqlen_k - seqlen_q  # query i sees keys j <= i + causal_shift

    if IS_VARLEN:
        q_base = Q + start_q * stride_qs + head * stride_qh
        k_base = K + start_k * stride_ks + kv_head * stride_kh
        v_base = V + start_k * stride_vs + kv_head * stride_vh
        o_base = Out + start_q * stride_os + head * stride_oh
    else:
        q_base = Q + batch * stride_qb + head * stride_qh
        k_base = K + batch * stride_kb + kv_head * stride_kh
        v_base = V + batch * stride_vb + kv_head * stride_vh
        o_base = Out + batch * stride_ob + head * stride_oh
    if USE_TMA:
        if IS_VARLEN:  # a descriptor needs a non-empty shape; an empty one is never loaded from
            q_src = q_base
            k_rows = tl.maximum(seqlen_k, 1)
        else:
            q_src = tl.make_tensor_descriptor(q_base, [seqlen_q, HEAD_DIM], [stride_qs, 1], [BLOCK_M, BLOCK_D])
            k_rows = seqlen_k
        k_src = tl.make_tensor_descriptor(k_base, [k_rows, HEAD_DIM], [stride_ks, 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [k_rows, HEAD_DIM], [stride_vs, 1], [BLOCK_N, BLOCK_D])
    else:
        q_src = q_base
        k_src = k_base
        v_src = v_base
    # Varlen loads q and stores out through pointers: a program past the last tile must not
    # touch a neighbour's rows, which a clipped descriptor of a shifted base could.
    q = _load_tile(q_src, first_row, seqlen_q, stride_qs, tl.arange(0, BLOCK_M), offs_d,
                   HEAD_DIM, BLOCK_D, USE_TMA and not IS_VARLEN, True)
    if DOT_F32:
        q = q.to(tl.float32)

    if HAS_ALIBI:
        slope = tl.load(Slopes + batch * stride_ab + head * stride_ah)
        alibi_rows = tl.zeros([BLOCK_M], dtype=tl.float32) + slope * 1.4426950408889634
    else:
        alibi_rows = 0.0
    if HAS_SINKS:
        # The sink joins the denominator: start from max = sink, sum = exp(sink - max) = 1.
        sink = tl.load(Sinks + head * stride_sh).to(tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if HAS_WINDOW:
        # Keys [lo, hi) lie in some row's window; tiles in [mid_lo, mid_hi) in every row's.
        first_pos = first_row + causal_shift
        last_pos = tl.minimum(first_row + BLOCK_M, seqlen_q) - 1 + causal_shift
        lo, hi = window_span(first_pos, last_pos, seqlen_k, window_left, window_right, BLOCK_N)
        mid_lo, mid_hi = unmasked_run(lo, hi, first_pos, last_pos, window_left, window_right, BLOCK_N)
        for start_n in range(lo, mid_lo, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
                seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
                window_left, window_right, softcap_in, softcap_out, alibi_rows,
                HEAD_DIM, BLOCK_D, True, CAUSAL, USE_TMA, DOT_F32, DOT_PRECISION,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
            )
        for start_n in tl.range(mid_lo, mid_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
                seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
                window_left, window_right, softcap_in, softcap_out, alibi_rows,
                HEAD_DIM, BLOCK_D, False, CAUSAL, USE_TMA, DOT_F32, DOT_PRECISION,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
            )
        for start_n in range(mid_hi, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
                seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
                window_left, window_right, softcap_in, softcap_out, alibi_rows,
                HEAD_DIM, BLOCK_D, True, CAUSAL, USE_TMA, DOT_F32, DOT_PRECISION,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
            )
    else:
        # Key range of this tile: [0, end) is visited, [0, full_end) needs no mask at all.
        if CAUSAL:
            end = tl.minimum(seqlen_k, first_row + BLOCK_M + causal_shift)
            full_end = tl.minimum(seqlen_k, first_row + 1 + causal_shift)
        else:
            end = seqlen_k
            full_end = seqlen_k
        end = tl.maximum(end, 0)
        full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
        for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
                seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
                window_left, window_right, softcap_in, softcap_out, alibi_rows,
                HEAD_DIM, BLOCK_D, False, CAUSAL, USE_TMA, DOT_F32, DOT_PRECISION,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
            )
        for start_n in range(full_end, end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
                seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
                window_left, window_right, softcap_in, softcap_out, alibi_rows,
                HEAD_DIM, BLOCK_D, True, CAUSAL, USE_TMA, DOT_F32, DOT_PRECISION,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI,
            )

    # Rows that saw no key have l = 0 and acc = 0: output 0, LSE -inf. With a sink l >= 1
    # there, so such a row gets output 0 and LSE = sink.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(Out.dtype.element_ty)
    if USE_TMA and not IS_VARLEN:
        o_desc = tl.make_tensor_descriptor(o_base, [seqlen_q, HEAD_DIM], [stride_os, 1], [BLOCK_M, BLOCK_D])
        o_desc.store([first_row, 0], out)  # rows past seqlen_q and the head-dim padding are clipped
    else:
        o_ptrs = o_base + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :]
        o_mask = offs_m[:, None] < seqlen_q
        if BLOCK_D != HEAD_DIM:
            o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_ptrs, out, mask=o_mask)
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
        if IS_VARLEN:
            lse_ptrs = Lse + head * stride_lh + start_q + offs_m  # [Hq, total_q]
        else:
            lse_ptrs = Lse + batch * stride_lb + head * stride_lh + offs_m
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


# One kernel for every call: the variants, packed sequences and TMA loads are constexpr
# features, so a plain call compiles none of their code (``benchmarks/tools/plain_ptx.py``
# checks that its PTX body is the one of the plain kernel before the variants). Strides travel
# as one tuple per tensor. Lengths change every call in serving; specializing on them (== 1,
# % 16) would recompile per length.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def _attention_fwd_kernel(
    Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, Slopes, Sinks,
    q_strides, k_strides, v_strides, o_strides, lse_strides, alibi_strides, sink_stride,
    seqlen_q, seqlen_k, num_seqs, group_size, qk_scale,
    window_left, window_right, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_B: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(query tiles, Hq, B)`` dense, ``(tile bound, Hq, 1)`` packed (see
    :func:`varlen_forward`). ``*_strides``: ``(batch, seq, head)`` per tensor (batch 0 when
    packed), ``lse_strides`` ``(batch, head)``, ``alibi_strides`` ``(batch, head)``."""
    _attention_fwd_program(
        Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, Slopes, Sinks,
        q_strides[0], q_strides[1], q_strides[2],
        k_strides[0], k_strides[1], k_strides[2],
        v_strides[0], v_strides[1], v_strides[2],
        o_strides[0], o_strides[1], o_strides[2],
        lse_strides[0], lse_strides[1],
        alibi_strides[0], alibi_strides[1], sink_stride,
        seqlen_q, seqlen_k, num_seqs, group_size, qk_scale,
        window_left, window_right, softcap_in, softcap_out,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
        CAUSAL, WRITE_LSE, USE_TMA, WARP_SPECIALIZE,
        HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS, IS_VARLEN, BLOCK_B,
        DOT_F32, DOT_PRECISION,
    )


def _scratch_allocator(size: int, alignment: int, stream):
    """Global scratch for in-kernel TMA descriptors (128 bytes per descriptor per program), on
    the current device (the face launches under ``torch.cuda.device(q.device)``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _with_tma_scratch(launcher):
    """Run ``launcher`` with Triton's allocator set to :func:`_scratch_allocator` for its
    launches only, restoring the caller's afterwards. Triton reads the allocator from a context
    variable at launch; where that variable is not there (other Triton versions), the public
    setter is used, which changes it for the whole process."""
    @functools.wraps(launcher)
    def launch_with_scratch(*args, **kwargs):
        var = getattr(_allocation, "_allocator", None)
        if var is None or not hasattr(var, "reset"):
            triton.set_allocator(_scratch_allocator)
            return launcher(*args, **kwargs)
        token = var.set(_scratch_allocator)
        try:
            return launcher(*args, **kwargs)
        finally:
            var.reset(token)

    return launch_with_scratch


def use_tma(q, k, v, out, interpreted: bool, seqlen_k: int | None = None) -> bool:
    """Stream tiles through TMA descriptors on Hopper when the tensors allow it and the key
    sequence (``seqlen_k``, default ``k.shape[1]``) is long enough to amortize building the
    descriptors in every program."""
    seqlen_k = k.shape[1] if seqlen_k is None else seqlen_k
    if interpreted or q.dtype == torch.float32 or seqlen_k < TMA_MIN_SEQLEN_K:
        return False
    return cuda_properties(q.device).major >= 9 and tma_compatible(q, k, v, out)


def _prepare(q, k, v, out, interpreted, force_tma, config, seqlen_k, autotune_launch=None, causal=False):
    """``(tma, config)`` of a launch. ``autotune_launch(config, tma=...)``, when given, runs this
    call with a config: with autotuning on (``tuning.autotune_enabled``) the first call of its
    class is timed over the candidates (``kernels/tuning.py``)."""
    tma = use_tma(q, k, v, out, interpreted, seqlen_k) if force_tma is None else force_tma
    tma = tma and tma_compatible(q, k, v, out)
    if config is None:
        config = pick_config(q.shape[-1], q.dtype, interpreted, tma, q.device)
        if not interpreted and q.dtype != torch.float32 and autotune_launch is not None:
            launch = functools.partial(autotune_launch, tma=tma)
            config = _autotuned_config(q, tma, causal, launch) or config
    return tma, config


def _autotuned_config(q, tma, causal, launch) -> TileConfig | None:
    block_d = padded_head_dim(q.shape[-1])
    key = (q.device.index if q.device.index is not None else torch.cuda.current_device(), block_d,
           q.dtype, tma, causal)
    found = tuning.autotuned(key)
    if found is None and tuning.autotune_enabled():
        found = tuning.autotune(key, launch, block_d, tuning.device_facts(q.device)[2], q.element_size())
    return found


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    """``(batch, seq, head)`` strides of ``[B, S, H, D]``, or ``(0, seq, head)`` of packed ``[T, H, D]``."""
    s = x.stride()
    return (s[0], s[1], s[2]) if x.dim() == 4 else (0, s[0], s[1])


@_with_tma_scratch
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    causal: bool,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    config: TileConfig | None = None,
    force_tma: bool | None = None,
):
    """Launch the Triton forward into ``out [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]`` (or None).

    Inputs are validated by the caller; batch, seqlen_q and seqlen_k are all >= 1. The variant
    arguments are those of ``flash_attn_func`` (``alibi_slopes [Hq]`` or ``[B, Hq]``, ``sinks
    [Hq]``). ``config`` and ``force_tma`` override the tuned choice (benchmarks and tests use
    them). Returns the compiled kernel of the last launch (for resource reports).
    """
    seqlen_k = k.shape[1]
    interpreted = is_interpreted(_attention_fwd_kernel)
    variant = Variant.of(causal, window_size, softcap, alibi_slopes, sinks)

    def launch(config: TileConfig, tma: bool):
        return _launch_dense(q, k, v, out, lse, variant, alibi_slopes, softmax_scale, config, tma, interpreted)

    tma, config = _prepare(q, k, v, out, interpreted, force_tma, config, seqlen_k,
                           autotune_launch=launch if variant.is_plain else None, causal=variant.causal)
    return launch(config, tma)


def _launch_dense(q, k, v, out, lse, variant, alibi_slopes, softmax_scale, config, tma, interpreted):
    """The launches of :func:`attention_forward` (batch chunks of at most 65535)."""
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    lse_arg = lse if lse is not None else out  # unused pointer when WRITE_LSE is False
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    strides = dict(q_strides=_strides3(q), k_strides=_strides3(k), v_strides=_strides3(v),
                   o_strides=_strides3(out), lse_strides=lse_strides)
    # Grid axes 1 and 2 are limited to 65535: launch large batches in chunks.
    for b0 in range(0, batch, MAX_GRID_YZ):
        b1 = min(batch, b0 + MAX_GRID_YZ)
        grid = (cdiv(seqlen_q, config.block_m), num_q_heads, b1 - b0)
        slopes = alibi_slopes[b0:b1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        mods = dataclasses.replace(variant, alibi_slopes=slopes).kernel_args(softmax_scale, seqlen_q, seqlen_k,
                                                                               unused=q)
        compiled = _launch_forward(
            grid, q[b0:b1], k[b0:b1], v[b0:b1], out[b0:b1], lse_arg[b0:b1], q, q,
            **strides, seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_seqs=1,
            group_size=num_q_heads // num_kv_heads, qk_scale=softmax_scale * LOG2E,
            HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            WRITE_LSE=lse is not None, USE_TMA=tma, WARP_SPECIALIZE=config.warp_specialize,
            IS_VARLEN=False, BLOCK_B=1,
            num_warps=config.num_warps, num_stages=config.num_stages,
            **mods, **dot_flags(q.dtype, interpreted), **exponent_options(softmax_scale),
        )
    return compiled


@_with_tma_scratch
def varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    causal: bool,
    softmax_scale: float,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    config: TileConfig | None = None,
    force_tma: bool | None = None,
):
    """Launch the fused forward over packed sequences: ``q [total_q, Hq, D]``, ``k, v [total_k,
    Hkv, D]``, ``cu_seqlens_* [B + 1]`` int32, into ``out [total_q, Hq, D]`` and ``lse [Hq,
    total_q]`` (or None).

    Tile schedule (no host sync, no work on padding): the grid's first axis is a flat list of
    query tiles, the sequences' tiles end to end; each program finds its sequence from
    ``cu_seqlens_q`` on the device (a prefix sum over at most ``MAX_VARLEN_SEQS`` offsets, done
    once per program). The host knows only an upper bound on the number of tiles,
    ``min(total_q // BLOCK_M + B, B * cdiv(max_seqlen_q, BLOCK_M))``; programs past the last
    tile exit at once. More than ``MAX_VARLEN_SEQS`` sequences are launched in chunks.
    """
    total_q, num_q_heads, head_dim = q.shape
    total_k, num_kv_heads = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    interpreted = is_interpreted(_attention_fwd_kernel)
    tma, config = _prepare(q, k, v, out, interpreted, force_tma, config, max_seqlen_k)
    variant = Variant.of(causal, window_size, softcap, alibi_slopes, sinks)
    lse_arg = lse if lse is not None else out
    strides = dict(q_strides=_strides3(q), k_strides=_strides3(k), v_strides=_strides3(v),
                   o_strides=_strides3(out), lse_strides=(0, lse.stride(0) if lse is not None else 0))
    compiled = None
    for b0 in range(0, batch, MAX_VARLEN_SEQS):
        b1 = min(batch, b0 + MAX_VARLEN_SEQS)
        num_seqs = b1 - b0
        tiles = min(total_q // config.block_m + num_seqs, num_seqs * cdiv(max_seqlen_q, config.block_m))
        if tiles == 0:
            continue
        slopes = alibi_slopes[b0:b1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        mods = dataclasses.replace(variant, alibi_slopes=slopes).kernel_args(
            softmax_scale, total_q, total_k, unused=q)
        compiled = _launch_forward(
            (tiles, num_q_heads, 1), q, k, v, out, lse_arg, cu_seqlens_q[b0:], cu_seqlens_k[b0:],
            **strides, seqlen_q=total_q, seqlen_k=total_k, num_seqs=num_seqs,
            group_size=num_q_heads // num_kv_heads, qk_scale=softmax_scale * LOG2E,
            HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            WRITE_LSE=lse is not None, USE_TMA=tma, WARP_SPECIALIZE=config.warp_specialize,
            IS_VARLEN=True, BLOCK_B=max(16, next_power_of_2(num_seqs)),
            num_warps=config.num_warps, num_stages=config.num_stages,
            **mods, **dot_flags(q.dtype, interpreted), **exponent_options(softmax_scale),
        )
    return compiled


_launch_forward = Launcher(_attention_fwd_kernel)
