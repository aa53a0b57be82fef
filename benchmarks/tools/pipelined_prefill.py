"""Experiment (issue 5): can plain Triton 3.6 overlap the softmax of one key tile with the QK^T /
PV wgmma of another inside the same warps, by restructuring the key loop by hand?

A standalone copy of the plain prefill forward (non-causal and bottom-right causal, GQA, online
softmax in log2 units, masks only on boundary tiles, TMA at long seqlen_k, the tuned tiles of
``flashkernel.kernels.prefill``) whose unmasked key loop comes in several shapes (``MODE``):

* ``base``     our loop: S_j = QK_j; softmax_j; O += P_j V_j (the control).
* ``pipe``     the textbook software pipeline: issue S_{j+1} first, softmax_j, O += P_j V_j,
               S carried to the next iteration.
* ``rot_qk``   rotated so that the QK^T of tile j+1 is issued after a *synchronous* dot:
               O += P_{j-1} V_{j-1} (P carried); S_{j+1} = QK_{j+1}; softmax_j.
* ``rot_pv``   the other way round (FlashAttention-3's order): S_{j+1} = QK_{j+1} (waited);
               O *= alpha_j; O += P_j V_j left in flight; softmax_{j+1}. P is carried in fp32
               and rounded to bf16 just before the dot. ``rot_pv_bf16`` carries bf16: Triton
               then stages P through shared memory (stmatrix), the dot reads A from a buffer
               written in the loop and gets ``wait 0`` right after it in the PTX, but ptxas
               sinks that wait past the softmax (3. below), so it overlaps all the same.
* ``fa3``      both dots asynchronous: a tiny dummy dot (16x16 zeros) supplies the one
               ``wait 0`` per iteration; O *= alpha; O += P_j V_j; S_{j+2} = QK_{j+2};
               softmax_{j+1} (S issued two tiles ahead).
* ``unroll2``  two independent S tiles per iteration: S_a, S_b issued, then softmax/PV of a,
               then of b.

What decides the overlap (Triton 3.6, bundled ptxas 12.8, read from TTGIR/PTX/SASS):

1. Triton (``WGMMAPipeline.cpp``, ``asyncLaunchDots``) leaves a wgmma in flight ("properly
   async") only if its result is used in the loop by nothing but the ``yield`` and, in the next
   iteration, only by another dot's accumulator or by ops after the loop's first
   ``warp_group_dot_wait {pendings=0}``. Every other dot gets ``wgmma.wait_group 0`` right after
   it in the PTX, and ``wait_group 0`` retires every group in flight. Only ``rot_*``/``fa3``
   have the shape [sync dot; wait 0] [async dots] [ALU work on last iteration's results].
2. ptxas serializes every wgmma of the function (advisory "Potential Performance Loss: wgmma.mma_async
   instructions are serialized due to non wgmma instructions reading/defining accumulator
   registers ...") when a carried S tile is copied at the loop back-edge while its wgmma is in
   flight (``rot_qk``, ``fa3``: 64 ``mov`` per iteration), or, in ``rot_pv``/``pipe``, when the
   masked boundary loop after it is pipelined too (d256, pointer path): hence ``MASKED_STAGES``.
3. ptxas moves a ``wgmma.wait_group`` down past independent instructions of the same basic
   block, and spreads one group's HGMMAs through the softmax. So a dot Triton made synchronous
   still overlaps following independent work if no mbarrier spin loop (Triton's wait for a
   TMA/cp.async tile, placed where the load is in the source) lies in between: ``_vf``.

``tl.range`` knobs apply to the unmasked loop of any mode: ``_unroll2`` (loop_unroll_factor=2),
``_nomb`` (disallow_acc_multi_buffer), ``_rs2``/``_rs4`` (num_stages), ``_flat`` (flatten).
Shared memory above 227 KB (an async dot's operand gets one more buffer) does not launch.

    # no GPU: compile every variant for sm_90a, registers/spills, wgmma/wait/ex2 placement
    PYTHONPATH=src python benchmarks/tools/pipelined_prefill.py --ptx-report [--dump /tmp/pipe]
    # H200: correctness (NaN-poisoned outputs, float64 truth) then TFLOP/s vs flashkernel, cuDNN
    PYTHONPATH=src python benchmarks/tools/pipelined_prefill.py --bench --out $OUT/pipelined.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)

MODES = {"base": 0, "pipe": 1, "rot_qk": 2, "rot_pv": 3, "fa3": 4, "unroll2": 5, "rot_pv_bf16": 6}
KNOBS = {  # suffix -> tl.range arguments of the unmasked key loop
    "": {},
    "_unroll2": dict(UNROLL=2),
    "_nomb": dict(NO_ACC_MB=True),
    "_rs2": dict(RANGE_STAGES=2),
    "_rs4": dict(RANGE_STAGES=4),
    "_flat": dict(FLATTEN=True),
}


def variant_args(name: str) -> dict:
    """Constexprs of a variant name ``<mode><knob>[_vf][_m1|_mp][_n64]``.

    ``_vf``: the V tile (``unroll2``: all four tiles) is loaded before the body's first dot, so
    that Triton's wait for it (an mbarrier spin loop: a basic-block boundary for ptxas) does not
    sit between a dot's ``wgmma.wait_group`` and the softmax that ptxas could overlap with it.
    ``_n64``: BLOCK_N 64. The masked boundary loop is left to Triton's pipeliner in ``base`` (as
    in our kernel) and not pipelined (``tl.range(num_stages=1)``, synchronous dots) in the
    restructured modes: with both, ptxas serializes every wgmma of the function at d256 and on
    the pointer path ("non wgmma instructions defining accumulator registers of a wgmma between
    start and end of the pipeline stage"). ``_m1`` / ``_mp`` force either choice."""
    args = dict(MODE=0, UNROLL=None, NO_ACC_MB=False, RANGE_STAGES=None, FLATTEN=False, MASKED_STAGES=None,
                LOADS_FIRST=False)
    rest = name
    masked = None
    changed = True
    while changed:
        changed = False
        for suffix in ("_n64", "_vf", "_m1", "_mp"):
            if rest.endswith(suffix):
                rest = rest[:-len(suffix)]
                changed = True
                if suffix == "_vf":
                    args["LOADS_FIRST"] = True
                elif suffix in ("_m1", "_mp"):
                    masked = 1 if suffix == "_m1" else 0
    for mode, value in sorted(MODES.items(), key=lambda kv: -len(kv[0])):
        if rest.startswith(mode) and rest[len(mode):] in KNOBS:
            args["MODE"] = value
            args.update(KNOBS[rest[len(mode):]])
            if masked is None:
                masked = 0 if value == 0 else 1
            args["MASKED_STAGES"] = 1 if masked else None
            return args
    raise ValueError(f"unknown variant {name!r}")


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------


@triton.jit
def _tile(src, row0, num_rows, stride_row, offs_r, offs_d,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, ROW_MASK: tl.constexpr):
    """Rows ``row0 + offs_r`` of a ``[num_rows, HEAD_DIM]`` matrix (zero outside), through a TMA
    descriptor or a base pointer (offsets rebuilt per tile, nothing 2-D carried)."""
    if USE_TMA:
        t = src.load([row0, 0])
    else:
        rows = row0 + offs_r
        ptrs = src + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :]
        if ROW_MASK:
            mask = rows[:, None] < num_rows
            if BLOCK_D != HEAD_DIM:
                mask = mask & (offs_d[None, :] < HEAD_DIM)
            t = tl.load(ptrs, mask=mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            t = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            t = tl.load(ptrs)
    return t


@triton.jit
def _scores(q, k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr, ROW_MASK: tl.constexpr):
    """Raw ``S = q k^T`` of the key tile at ``start_n`` (one wgmma group on Hopper)."""
    k = _tile(k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, ROW_MASK)
    return tl.dot(q, tl.trans(k))


@triton.jit
def _probs(qk, m_i, l_i, qk_scale, MASKED: tl.constexpr):
    """Online-softmax statistics of raw scores ``qk`` (scale folded into exp2, log2 units).

    Returns ``(p, alpha, l, m)``: fp32 probabilities relative to the new max, the factor that
    rescales everything accumulated so far, the new running sum and max."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_new, m_new


@triton.jit
def _step(acc, l_i, m_i, qk, v, qk_scale, MASKED: tl.constexpr):
    """Our kernel's step: softmax, rescale, O += P V."""
    p, alpha, l_i, m_i = _probs(qk, m_i, l_i, qk_scale, MASKED)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _masked_tile(acc, l_i, m_i, q, k_src, v_src, start_n, row_pos, offs_n, offs_d,
                 seqlen_k, stride_ks, stride_vs, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr):
    qk = _scores(q, k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, True)
    v = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, True)
    keys = start_n + offs_n
    visible = keys[None, :] < seqlen_k
    if CAUSAL:
        visible = visible & (keys[None, :] <= row_pos[:, None])
    qk = tl.where(visible, qk, float("-inf"))
    return _step(acc, l_i, m_i, qk, v, qk_scale, True)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _pipelined_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, group_size, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr, USE_TMA: tl.constexpr,
    MODE: tl.constexpr, UNROLL: tl.constexpr, NO_ACC_MB: tl.constexpr,
    RANGE_STAGES: tl.constexpr, FLATTEN: tl.constexpr, MASKED_STAGES: tl.constexpr,
    LOADS_FIRST: tl.constexpr,
):
    """Plain attention, grid ``(query tiles, Hq, B)``; the key loop's shape is ``MODE``."""
    num_m_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL:
        pid_m = num_m_tiles - 1 - tl.program_id(0)  # longest tiles first
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
    causal_shift = seqlen_k - seqlen_q
    row_pos = offs_m + causal_shift

    q_base = Q + batch * stride_qb + head * stride_qh
    k_base = K + batch * stride_kb + kv_head * stride_kh
    v_base = V + batch * stride_vb + kv_head * stride_vh
    o_base = Out + batch * stride_ob + head * stride_oh
    if USE_TMA:
        q_src = tl.make_tensor_descriptor(q_base, [seqlen_q, HEAD_DIM], [stride_qs, 1], [BLOCK_M, BLOCK_D])
        k_src = tl.make_tensor_descriptor(k_base, [seqlen_k, HEAD_DIM], [stride_ks, 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [seqlen_k, HEAD_DIM], [stride_vs, 1], [BLOCK_N, BLOCK_D])
    else:
        q_src = q_base
        k_src = k_base
        v_src = v_base
    q = _tile(q_src, first_row, seqlen_q, stride_qs, tl.arange(0, BLOCK_M), offs_d, HEAD_DIM, BLOCK_D, USE_TMA, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        end = tl.minimum(seqlen_k, first_row + BLOCK_M + causal_shift)
        full_end = tl.minimum(seqlen_k, first_row + 1 + causal_shift)
    else:
        end = seqlen_k
        full_end = seqlen_k
    end = tl.maximum(end, 0)
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N

    if MODE == 0:  # base: S_j; softmax_j; O += P_j V_j
        for start_n in tl.range(0, full_end, BLOCK_N, num_stages=RANGE_STAGES, loop_unroll_factor=UNROLL,
                                disallow_acc_multi_buffer=NO_ACC_MB, flatten=FLATTEN):
            if LOADS_FIRST:
                v = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            qk = _scores(q, k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            if not LOADS_FIRST:
                v = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            acc, l_i, m_i = _step(acc, l_i, m_i, qk, v, qk_scale, False)
    elif MODE == 1:  # pipe: S_{j+1} issued before softmax_j
        if full_end > 0:
            qk = _scores(q, k_src, 0, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            for start_n in tl.range(0, full_end - BLOCK_N, BLOCK_N, num_stages=RANGE_STAGES,
                                    loop_unroll_factor=UNROLL, disallow_acc_multi_buffer=NO_ACC_MB,
                                    flatten=FLATTEN):
                if LOADS_FIRST:
                    v = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                qk_next = _scores(q, k_src, start_n + BLOCK_N, seqlen_k, stride_ks, offs_n, offs_d,
                                  HEAD_DIM, BLOCK_D, USE_TMA, False)
                if not LOADS_FIRST:
                    v = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                acc, l_i, m_i = _step(acc, l_i, m_i, qk, v, qk_scale, False)
                qk = qk_next
            v = _tile(v_src, full_end - BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            acc, l_i, m_i = _step(acc, l_i, m_i, qk, v, qk_scale, False)
    elif MODE == 2 or MODE == 4:
        # rot_qk: [O += P_{j-1} V_{j-1}; wait 0] [S_{j+1} async] [softmax_j]
        # fa3:    [dummy dot; wait 0] [O *= alpha_j; O += P_j V_j async] [S_{j+2} async] [softmax_{j+1}]
        # Both: tile 0's softmax and tile 1's S in the prologue, the last tile's in the epilogue.
        if full_end > 0:
            qk = _scores(q, k_src, 0, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            p, alpha, l_i, m_i = _probs(qk, m_i, l_i, qk_scale, False)
            p_prev = p.to(Q.dtype.element_ty)
            # tile 1 may not exist (one unmasked tile): a masked load, never used then
            qk = _scores(q, k_src, BLOCK_N, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, True)
            if MODE == 4:
                zero_a = tl.zeros([BLOCK_M, 16], dtype=Q.dtype.element_ty)
                zero_b = tl.zeros([16, 16], dtype=Q.dtype.element_ty)
            for start_n in tl.range(BLOCK_N, full_end - BLOCK_N, BLOCK_N, num_stages=RANGE_STAGES,
                                    loop_unroll_factor=UNROLL, disallow_acc_multi_buffer=NO_ACC_MB,
                                    flatten=FLATTEN):
                v = _tile(v_src, start_n - BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                if MODE == 4:
                    # The loop's one `wait 0` (retires the previous iteration's PV and S), then
                    # both real dots are left in flight across the softmax.
                    z = tl.dot(zero_a, zero_b)
                    acc = acc * (alpha + tl.max(z, 1))[:, None]
                    acc = tl.dot(p_prev, v, acc)
                else:
                    acc = tl.dot(p_prev, v, acc)
                qk_next = _scores(q, k_src, start_n + BLOCK_N, seqlen_k, stride_ks, offs_n, offs_d,
                                  HEAD_DIM, BLOCK_D, USE_TMA, False)
                p, alpha, l_i, m_i = _probs(qk, m_i, l_i, qk_scale, False)
                if MODE == 2:
                    acc = acc * alpha[:, None]
                p_prev = p.to(Q.dtype.element_ty)
                qk = qk_next
            if MODE == 4:
                acc = acc * alpha[:, None]
            if full_end > BLOCK_N:  # the last unmasked tile's softmax (its S is in qk)
                v = _tile(v_src, full_end - 2 * BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D,
                          USE_TMA, False)
                acc = tl.dot(p_prev, v, acc)
                p, alpha, l_i, m_i = _probs(qk, m_i, l_i, qk_scale, False)
                acc = acc * alpha[:, None]
                p_prev = p.to(Q.dtype.element_ty)
            v = _tile(v_src, full_end - BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            acc = tl.dot(p_prev, v, acc)
    elif MODE == 3 or MODE == 6:
        # rot_pv: [S_{j+1}; wait 0] [O *= alpha_j; O += P_j V_j async] [softmax_{j+1}]
        # (FlashAttention-3's order). P is carried in fp32 and rounded to bf16 in the loop just
        # before the dot (MODE 3): carried as bf16 (MODE 6), Triton stages it through shared
        # memory, the dot reads A from a local_alloc inside the loop and cannot be async.
        if full_end > 0:
            qk = _scores(q, k_src, 0, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            p_cur, alpha, l_i, m_i = _probs(qk, m_i, l_i, qk_scale, False)
            if MODE == 6:
                p_cur = p_cur.to(Q.dtype.element_ty)
            for start_n in tl.range(BLOCK_N, full_end, BLOCK_N, num_stages=RANGE_STAGES,
                                    loop_unroll_factor=UNROLL, disallow_acc_multi_buffer=NO_ACC_MB,
                                    flatten=FLATTEN):
                qk = _scores(q, k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                v = _tile(v_src, start_n - BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                acc = acc * alpha[:, None]
                acc = tl.dot(p_cur.to(Q.dtype.element_ty), v, acc)
                p_cur, alpha, l_i, m_i = _probs(qk, m_i, l_i, qk_scale, False)
                if MODE == 6:
                    p_cur = p_cur.to(Q.dtype.element_ty)
            acc = acc * alpha[:, None]
            v = _tile(v_src, full_end - BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            acc = tl.dot(p_cur.to(Q.dtype.element_ty), v, acc)
    else:  # unroll2: S_a, S_b issued, then softmax/PV of a, then of b
        pair_end = full_end // (2 * BLOCK_N) * (2 * BLOCK_N)
        for start_n in tl.range(0, pair_end, 2 * BLOCK_N, num_stages=RANGE_STAGES, loop_unroll_factor=UNROLL,
                                disallow_acc_multi_buffer=NO_ACC_MB, flatten=FLATTEN):
            if LOADS_FIRST:
                k_a = _tile(k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                k_b = _tile(k_src, start_n + BLOCK_N, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D,
                            USE_TMA, False)
                v_a = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                v_b = _tile(v_src, start_n + BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D,
                            USE_TMA, False)
                qk_a = tl.dot(q, tl.trans(k_a))
                qk_b = tl.dot(q, tl.trans(k_b))
                acc, l_i, m_i = _step(acc, l_i, m_i, qk_a, v_a, qk_scale, False)
                acc, l_i, m_i = _step(acc, l_i, m_i, qk_b, v_b, qk_scale, False)
            else:
                qk_a = _scores(q, k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                qk_b = _scores(q, k_src, start_n + BLOCK_N, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D,
                               USE_TMA, False)
                v = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
                acc, l_i, m_i = _step(acc, l_i, m_i, qk_a, v, qk_scale, False)
                v = _tile(v_src, start_n + BLOCK_N, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA,
                          False)
                acc, l_i, m_i = _step(acc, l_i, m_i, qk_b, v, qk_scale, False)
        for start_n in range(pair_end, full_end, BLOCK_N):  # at most one tile
            qk = _scores(q, k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            v = _tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, False)
            acc, l_i, m_i = _step(acc, l_i, m_i, qk, v, qk_scale, False)

    # Boundary tiles (causal diagonal, the end of the keys): masked, our kernel's step.
    for start_n in tl.range(full_end, end, BLOCK_N, num_stages=MASKED_STAGES):
        acc, l_i, m_i = _masked_tile(acc, l_i, m_i, q, k_src, v_src, start_n, row_pos, offs_n, offs_d,
                                     seqlen_k, stride_ks, stride_vs, qk_scale, HEAD_DIM, BLOCK_D, CAUSAL, USE_TMA)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(Out.dtype.element_ty)
    if USE_TMA:
        o_desc = tl.make_tensor_descriptor(o_base, [seqlen_q, HEAD_DIM], [stride_os, 1], [BLOCK_M, BLOCK_D])
        o_desc.store([first_row, 0], out)
    else:
        o_ptrs = o_base + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :]
        o_mask = offs_m[:, None] < seqlen_q
        if BLOCK_D != HEAD_DIM:
            o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_ptrs, out, mask=o_mask)
    if WRITE_LSE:
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
        tl.store(Lse + batch * stride_lb + head * stride_lh + offs_m, lse, mask=offs_m < seqlen_q)


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------


def tile_config(head_dim: int, tma: bool, variant: str):
    """Our tuned tile config (``prefill.pick_config``), BLOCK_N 64 for ``*_n64`` variants."""
    from flashkernel.kernels import prefill
    from flashkernel.kernels._common import padded_head_dim

    cfg = (prefill.TMA_TABLE if tma else prefill.POINTER_TABLE)[padded_head_dim(head_dim)]
    block_n = 64 if variant.endswith("_n64") else cfg.block_n
    return cfg.block_m, block_n, cfg.num_warps, cfg.num_stages


def forward(q, k, v, causal: bool, variant: str = "base", out=None, lse=None, force_tma=None, config=None):
    """``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` (bf16/fp16) -> ``out`` (written in place).
    ``config``: ``(block_m, block_n, num_warps, num_stages)`` instead of our tuned table."""
    from flashkernel.kernels import prefill
    from flashkernel.kernels._common import padded_head_dim

    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    out = torch.empty_like(q) if out is None else out
    tma = prefill.use_tma(q, k, v, out, False) if force_tma is None else force_tma
    block_m, block_n, warps, stages = config or tile_config(head_dim, tma, variant)
    grid = (triton.cdiv(seqlen_q, block_m), num_q_heads, batch)
    lse_arg = lse if lse is not None else out
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    launch = prefill._with_tma_scratch(lambda: _pipelined_fwd_kernel[grid](
        q, k, v, out, lse_arg,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *lse_strides,
        seqlen_q, seqlen_k, num_q_heads // num_kv_heads, head_dim ** -0.5 * LOG2E,
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, WRITE_LSE=lse is not None, USE_TMA=tma,
        num_warps=warps, num_stages=stages, **variant_args(variant)))
    launch()
    return out


# ------------------------------------------------------------------------------------------------
# --ptx-report: compile for sm_90a without a GPU and read where the waits land
# ------------------------------------------------------------------------------------------------

MAX_SMEM = 232448  # bytes of shared memory one CTA may use on sm_90
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_variant(variant: str, head_dim: int, causal: bool, tma: bool, write_lse: bool = False):
    """``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with a real launch's attributes
    (pointers and strides 16-divisible, group_size 1 specialized as at the benchmark shapes)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_m, block_n, warps, stages = tile_config(head_dim, tma, variant)
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                  WRITE_LSE=write_lse, USE_TMA=tma, **variant_args(variant))
    types = dict(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", Lse="*fp32", qk_scale="fp32")
    fn = _pipelined_fwd_kernel
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[name] = consts[name]
        elif name == "group_size":  # == 1 at the benchmark shapes: Triton specializes it
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = types.get(name, "i32")
            if signature[name].startswith("*") or name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def ptxas(ptx: str, workdir: str):
    """Bundled ptxas -v: (registers, spill bytes, performance advisories, SASS text)."""
    path = os.path.join(workdir, "k.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    cubin = os.path.join(workdir, "k.cubin")
    r = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", path, "-o", cubin],
                       capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores", r.stderr)
    advisories = sorted({m.strip() for m in re.findall(r"(?:Potential Performance Loss|warning)[^\n]*", r.stderr)})
    sass = ""
    if r.returncode == 0:
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    else:
        advisories.append("ptxas failed: " + r.stderr.strip()[-300:])
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None, advisories, sass)


# Events of a loop body. Each item: kind, payload.
_PTX_EVENT = [
    (re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\S*\s+\{[^}]*\},\s*(\{)?"), "mma"),
    (re.compile(r"wgmma\.commit_group"), "commit"),
    (re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)"), "wait"),
    (re.compile(r"ex2\.approx"), "ex2"),
    (re.compile(r"\bbar\.sync\b|barrier\.sync"), "bar"),
    (re.compile(r"mbarrier\.try_wait"), "mbar"),
    (re.compile(r"cp\.async\.bulk\.tensor"), "tma"),
    (re.compile(r"cp\.async\.(ca|cg)"), "cpasync"),
]
_SASS_EVENT = [
    (re.compile(r"HGMMA\.(\d+x\d+x\d+)\S*\s+(\S+),\s*(\S+)"), "mma"),
    (re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)"), "wait"),
    (re.compile(r"MUFU\.EX2"), "ex2"),
    (re.compile(r"\bBAR\.SYNC"), "bar"),
    (re.compile(r"SYNCS\.PHASECHK"), "mbar"),
    (re.compile(r"UTMALDG"), "tma"),
    (re.compile(r"LDGSTS"), "cpasync"),
]


def ptx_loops(ptx: str):
    """Bodies (instruction lines) of the loops of a PTX kernel: label .. backward branch."""
    lines = [s.strip() for s in ptx.split("\t.section\t.debug")[0].splitlines()]
    labels = {}
    loops = []
    for i, s in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", s)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", s)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append(lines[labels[m.group(1)]:i + 1])
    return loops


def sass_loops(sass: str):
    """Bodies of the loops of a SASS listing (backward BRA), as instruction texts."""
    insts = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            insts.append((int(m.group(1), 16), m.group(2).strip()))
    index = {addr: i for i, (addr, _) in enumerate(insts)}
    loops = []
    for i, (addr, text) in enumerate(insts):
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if m and m.group(1):
            target = int(m.group(1), 16)
            if target < addr and target in index:
                loops.append([t for _, t in insts[index[target]:i + 1]])
    return loops


def events(body, table, sass: bool):
    """Compress a loop body into events: ("issue", label) at a wgmma group's first instruction,
    ("commit", label) at its last (PTX: commit_group; SASS: the HGMMA carrying gsb0; ptxas may
    spread one group's HGMMAs through other code), ("wait", n), ("ex2", count),
    ("other", count), ("bar", count), ("mbar", count), ("tma", count)."""
    out = []
    group = []

    def push(kind, val=1):
        if out and out[-1][0] == kind and kind in ("ex2", "other", "tma", "cpasync", "bar", "mbar"):
            out[-1] = (kind, out[-1][1] + val)
        else:
            out.append((kind, val))

    for s in body:
        for rx, kind in table:
            m = rx.search(s)
            if not m:
                continue
            if kind == "mma":
                if sass:
                    kindA = "rs" if m.group(3).startswith("R") else "ss"  # HGMMA dst, A, B
                    if not group:
                        push("issue", f"{m.group(1)} {kindA} ->{m.group(2)}")
                    group.append(m.group(1))
                    if "gsb0" in s:
                        push("commit", f"{len(group)}x{group[0]} {kindA} ->{m.group(2)}")
                        group = []
                else:
                    if not group:
                        push("issue", f"{m.group(1)} {'rs' if m.group(2) else 'ss'}")
                    group.append((m.group(1), "rs" if m.group(2) else "ss"))
            elif kind == "commit":
                if group:
                    push("commit", f"{len(group)}x{group[0][0]} {group[0][1]}")
                    group = []
            elif kind == "wait":
                push("wait", int(m.group(1), 0))
            else:
                push(kind)
            break
        else:
            if s and not s.endswith(":") and not s.startswith(("//", ".loc", "@!complete", "{", "}")):
                push("other")
    return out


def overlap(evs):
    """For each wgmma group of the loop body: ``(label, ex2, instr, ex2_after_last)``, the ex2
    and other instructions the warps execute between the group's first instruction and the
    wait that retires it, and the ex2 after its last instruction. The body is simulated twice
    so that a group retired in the next iteration is measured (only the first copy's groups are
    reported)."""
    pending = []  # [label, ex2, other, ex2_after_commit, committed, first_copy]
    done = []
    for copy in (0, 1):
        for kind, val in evs:
            if kind == "issue":
                pending.append([val, 0, 0, 0, False, copy == 0])
            elif kind == "commit":
                for g in pending:
                    if not g[4]:
                        g[0], g[4] = val, True
            elif kind == "wait":
                while len(pending) > val:
                    g = pending.pop(0)
                    if g[5]:
                        done.append((g[0], g[1], g[2], g[3]))
            elif kind in ("ex2", "other"):
                for g in pending:
                    g[1 if kind == "ex2" else 2] += val
                    if kind == "ex2" and g[4]:
                        g[3] += val
    for g in pending:
        if g[5]:
            done.append((g[0], g[1], g[2], g[3]))
    return done


def format_events(evs) -> str:
    """``MMA{..`` first instruction of a wgmma group, ``..}`` its last, ``WAIT(n)``,
    ``{i}i/{e}ex2`` a run of i other instructions of which e are ex2, ``bar`` CTA barrier,
    ``mbar`` mbarrier wait, ``tma`` bulk copy issue."""
    parts = []
    run = [0, 0]

    def flush():
        if run[0] or run[1]:
            parts.append(f"{run[0] + run[1]}i/{run[1]}ex2" if run[1] else f"{run[0]}i")
        run[0] = run[1] = 0

    for kind, val in evs:
        if kind in ("ex2", "other"):
            run[1 if kind == "ex2" else 0] += val
            continue
        flush()
        if kind == "issue":
            parts.append("MMA{")
        elif kind == "commit":
            parts.append(f"{val}}}")
        elif kind == "wait":
            parts.append(f"WAIT({val})")
        else:
            parts.append(kind if val == 1 else f"{kind}x{val}")
    flush()
    return " ".join(parts).replace("MMA{ ", "MMA{")


def report_one(variant, head_dim, causal, tma, workdir, dump=None):
    t0 = time.time()
    try:
        kernel = compile_variant(variant, head_dim, causal, tma)
    except Exception as exc:  # a restructuring Triton cannot compile is a result, not a crash
        msg = str(exc).strip().splitlines()
        return {"variant": variant, "head_dim": head_dim, "causal": causal, "tma": tma,
                "error": f"{type(exc).__name__}: {msg[-1] if msg else ''}"[:300]}
    ptx = kernel.asm["ptx"]
    regs, spills, advisories, sass = ptxas(ptx, workdir)
    tag = f"{variant}-d{head_dim}-{'causal' if causal else 'full'}-{'tma' if tma else 'ptr'}"
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ptx", ptx), ("ttgir", kernel.asm["ttgir"]), ("sass", sass)):
            with open(os.path.join(dump, f"{tag}.{ext}"), "w") as f:
                f.write(text)
    row = {"variant": variant, "head_dim": head_dim, "causal": causal, "tma": tma, "regs": regs,
           "spill_bytes": spills, "advisories": advisories, "shared": kernel.metadata.shared,
           "compile_s": round(time.time() - t0, 1), "loops": []}
    sloops = [b for b in sass_loops(sass) if any("HGMMA" in s for s in b)]
    ploops = [b for b in ptx_loops(ptx) if any("wgmma.mma_async" in s for s in b)]
    for i, body in enumerate(ploops):
        pe = events(body, _PTX_EVENT, sass=False)
        loop = {"ptx": format_events(pe), "ptx_overlap": overlap(pe)}
        if i < len(sloops):
            se = events(sloops[i], _SASS_EVENT, sass=True)
            loop["sass"] = format_events(se)
            loop["sass_overlap"] = overlap(se)
        row["loops"].append(loop)
    return row


def ptx_report(args) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for variant in args.variants:
            for head_dim in args.head_dims:
                for causal in args.causal:
                    for tma in args.tma:
                        row = report_one(variant, head_dim, causal, tma, workdir, args.dump)
                        rows.append(row)
                        print_row(row, args.verbose)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def summarize_overlap(ov) -> str:
    """One loop's wgmma groups, consecutive groups of the same shape and destination merged
    (ptxas's serialization shows as n groups of one HGMMA each, a wait after every one)."""
    merged = []
    for label, ex2, other, after in ov:
        if merged and merged[-1][0] == label:
            merged[-1][1] += 1
            merged[-1][2] += ex2
        else:
            merged.append([label, 1, ex2])
    parts = []
    for label, n, ex2 in merged:
        mark = f" x{n} groups one after another (same registers)" if n > 1 else ""
        parts.append(f"[{label}]{mark} {ex2} ex2 in flight")
    return "; ".join(parts)


def print_row(row, verbose: bool):
    head = (f"{row['variant']:15s} d{row['head_dim']:<3d} {'causal' if row['causal'] else 'full  '} "
            f"{'tma' if row['tma'] else 'ptr'}")
    if "error" in row:
        print(f"{head}  COMPILE ERROR: {row['error']}", flush=True)
        return
    adv = ""
    if row["advisories"]:
        adv = "  PTXAS: " + "; ".join(re.sub(r".*serialized due to (.*?) in the function.*", r"serialized (\1)", a)
                                       for a in row["advisories"])
    fits = "" if row["shared"] <= MAX_SMEM else " (> 227 KB: will not launch)"
    print(f"{head}  {row['regs']} regs, {row['spill_bytes']} B spilled, smem {row['shared'] // 1024} KB{fits}{adv}",
          flush=True)
    for i, loop in enumerate(row["loops"]):
        name = "main" if i == 0 else ("masked" if i == len(row["loops"]) - 1 else f"loop{i}")
        print(f"    {name:6s}: {summarize_overlap(loop.get('sass_overlap', loop['ptx_overlap']))}", flush=True)
        if verbose:
            print(f"      PTX : {loop['ptx']}")
            if "sass" in loop:
                print(f"      SASS: {loop['sass']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ptx-report", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--variants", nargs="+", default=None)
    parser.add_argument("--head-dims", nargs="+", type=int, default=None)
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--tma", nargs="+", type=int, default=[1, 0])
    parser.add_argument("--dump", help="write .ptx/.ttgir/.sass of each compile here")
    parser.add_argument("--verbose", "-v", action="store_true", help="print the loop event sequences")
    parser.add_argument("--out")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="processes compiling in parallel before the GPU run")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    parser.add_argument("--budget", type=float, default=170.0,
                        help="seconds after which the remaining timing shapes are skipped")
    args = parser.parse_args(argv)
    if args.ptx_report:
        args.variants = args.variants or REPORT_VARIANTS
        args.head_dims = args.head_dims or [128]
        args.causal = [bool(c) for c in args.causal]
        args.tma = [bool(t) for t in args.tma]
        return ptx_report(args)
    if args.bench:
        return bench(args)
    parser.print_help()
    return 2


REPORT_VARIANTS = ["base", "base_vf", "pipe", "pipe_vf", "pipe_rs2_vf", "rot_qk", "rot_pv", "rot_pv_rs2",
                   "rot_pv_mp", "rot_pv_bf16", "rot_pv_bf16_rs2", "fa3", "fa3_n64", "unroll2", "unroll2_vf", "base_unroll2",
                   "base_nomb", "base_rs2", "base_rs4", "base_flat", "rot_pv_unroll2"]
# Timed on the GPU: the control (and its 2-stage twin), the textbook pipeline as written and with
# the V load moved up, the FA3-order rotation (3 stages, which need > 227 KB at d128 and fail
# there; 2 stages; P through shared memory), and the two rotations ptxas serializes.
BENCH_VARIANTS = ["base", "base_rs2", "pipe", "pipe_rs2_vf", "rot_pv", "rot_pv_rs2", "rot_pv_bf16_rs2",
                  "rot_qk_rs2", "fa3_n64"]


# ------------------------------------------------------------------------------------------------
# --bench (GPU): correctness on odd shapes, then TFLOP/s against flashkernel and cuDNN
# ------------------------------------------------------------------------------------------------

DEVICE = os.environ.get("PIPELINED_PREFILL_DEVICE", "cuda")  # "cpu" only to dry-run the host code
SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128, 256)
TOKENS, MODEL_DIM = 16384, 2048
# (batch, seqlen_q, seqlen_k, Hq, Hkv, head_dim): GQA, Sq != Sk (bottom-right causal, rows that
# see no key), ragged tails, pointer loads (Sk < 4096) and TMA loads (Sk >= 4096).
CHECK_SHAPES = [
    (2, 333, 333, 4, 2, 64),
    (1, 257, 4500, 6, 2, 128),
    (1, 700, 300, 2, 2, 256),
    (1, 1000, 1000, 2, 2, 128),
    (1, 300, 4097, 2, 2, 64),
]


def visible_pairs(seqlen_q, seqlen_k, causal):
    if not causal:
        return seqlen_q * seqlen_k
    from flashkernel import reference
    return int(reference.causal_mask(seqlen_q, seqlen_k).sum())


def _warm_one(task):
    """Compile one specialization in a worker process (Triton's on-disk cache is shared, so the
    main process then loads instead of compiling). Returns (task, error or None)."""
    kind, variant, head_dim, causal, tma, group = task
    try:
        import flashkernel  # noqa: F401  (sys.path set by the parent)
        from flashkernel.kernels import prefill
        heads = max(MODEL_DIM // head_dim, group)
        q = torch.randn(1, 16, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(1, 16, heads // group, head_dim, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        if kind == "ours":
            prefill.attention_forward(q, k, v, out, None, causal=causal, softmax_scale=head_dim ** -0.5,
                                      force_tma=tma)
        else:
            forward(q, k, v, causal, variant, out=out, force_tma=tma)
        torch.cuda.synchronize()
        return task, None
    except Exception as exc:
        return task, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"


def warm_cache(variants, workers: int, timeout: float = 150.0):
    """Compile every specialization the run will launch, in parallel processes."""
    import concurrent.futures
    import multiprocessing

    tasks = set()
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            for tma in (False, True):
                tasks.add(("ours", "", head_dim, causal, tma, 1))
                for variant in variants:
                    tasks.add(("exp", variant, head_dim, causal, tma, 1))
    for b, sq, sk, hq, hkv, d in CHECK_SHAPES:
        for causal in (False, True):
            tma = sk >= 4096
            tasks.add(("ours", "", d, causal, tma, hq // hkv))
            for variant in variants:
                tasks.add(("exp", variant, d, causal, tma, hq // hkv))
    errors = {}
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futures = {pool.submit(_warm_one, task): task for task in sorted(tasks)}
    done, late = concurrent.futures.wait(futures, timeout=timeout)
    for fut in done:
        task, err = fut.result()
        if err:
            errors[task] = err
    for fut in late:  # compiled (or not) by the main process later, on first launch
        errors[futures[fut]] = f"not compiled within {timeout:.0f} s in the pool"
    pool.shutdown(wait=not late, cancel_futures=True)
    return len(tasks), errors


def check(variants) -> list[dict]:
    """Every variant against the float64 reference on odd shapes, outputs NaN-poisoned first.
    Passes when finite and within max(2 x flashkernel's own error, 1e-2) of the truth."""
    import flashkernel
    from flashkernel import reference

    rows = []
    torch.manual_seed(0)
    for b, sq, sk, hq, hkv, d in CHECK_SHAPES:
        q = torch.randn(b, sq, hq, d, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(b, sk, hkv, d, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(b, sk, hkv, d, device=DEVICE, dtype=torch.bfloat16)
        for causal in (False, True):
            truth, _ = reference.attention(q, k, v, causal=causal)
            ours = flashkernel.flash_attn_func(q, k, v, causal=causal)
            ours_err = (ours.double() - truth).abs().max().item()
            tol = max(2 * ours_err, 1e-2)
            shape = f"B{b} Sq{sq} Sk{sk} H{hq}/{hkv} d{d} {'causal' if causal else 'full'}"
            for variant in variants:
                row = {"shape": shape, "variant": variant, "flashkernel_err": ours_err, "tol": tol}
                try:
                    out = torch.full_like(q, float("nan"))
                    forward(q, k, v, causal, variant, out=out)
                    torch.cuda.synchronize()
                    err = (out.double() - truth).abs().max().item()
                    row.update(max_err=err, nan=bool(torch.isnan(out).any().item()))
                    row["ok"] = (not row["nan"]) and err <= tol
                except Exception as exc:
                    row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                rows.append(row)
                status = "ok" if row["ok"] else "FAIL"
                detail = row.get("error") or f"err {row['max_err']:.2e} (flashkernel {ours_err:.2e})"
                print(f"check {shape:40s} {variant:14s} {status} {detail}", flush=True)
    return rows


def time_ms(fn, warmup, rep) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])


def bench_timing(variants, warmup, rep, deadline) -> list[dict]:
    """d128 first, long sequences first; shapes left when ``deadline`` (time.time()) passes are
    recorded as skipped."""
    import flashkernel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for head_dim in sorted(HEAD_DIMS, key=lambda d: (d != 128, d)):
        for causal in (False, True):
            for seqlen in sorted(SEQLENS, reverse=True):
                if time.time() > deadline:
                    rows.append({"head_dim": head_dim, "causal": causal, "seqlen": seqlen,
                                 "skipped": "time budget (--budget)"})
                    print(f"d{head_dim} {'causal' if causal else 'full'} {seqlen}: skipped (time budget)", flush=True)
                    continue
                batch, heads = TOKENS // seqlen, MODEL_DIM // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
                           for _ in range(3))
                flops = 4 * batch * heads * head_dim * visible_pairs(seqlen, seqlen, causal)
                row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads,
                       "flops": flops}
                ref = None
                qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, S, D] for cuDNN

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)

                providers = [("flashkernel", lambda: flashkernel.flash_attn_func(q, k, v, causal=causal)),
                             ("cudnn", cudnn)]
                out = torch.empty_like(q)
                for variant in variants:
                    providers.append((variant, lambda variant=variant: forward(q, k, v, causal, variant, out=out)))
                for name, fn in providers:
                    try:
                        res = fn()
                        torch.cuda.synchronize()
                        entry = {}
                        if name == "flashkernel":
                            ref = res
                        elif name != "cudnn" and ref is not None:  # same math as ours: agree closely
                            entry["max_diff_vs_flashkernel"] = (res.float() - ref.float()).abs().max().item()
                        ms = time_ms(fn, warmup, rep)
                        entry.update(ms=ms, tflops=flops / ms / 1e9)
                    except Exception as exc:
                        entry = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                    row[name] = entry
                rows.append(row)
                print(format_timing(row, variants), flush=True)
                del q, k, v, qh, kh, vh, out, ref
                torch.cuda.empty_cache()
    return rows


def format_timing(row, variants) -> str:
    cells = [f"d{row['head_dim']:<3d} {'causal' if row['causal'] else 'full  '} {row['seqlen']:5d}"]
    fk = row.get("flashkernel", {}).get("tflops")
    for name in ["flashkernel", "cudnn"] + list(variants):
        r = row.get(name, {})
        if "tflops" in r:
            rel = f" ({r['tflops'] / fk:.2f}x)" if fk and name not in ("flashkernel",) else ""
            cells.append(f"{name} {r['tflops']:.0f}{rel}")
        else:
            cells.append(f"{name} ERR")
    return " | ".join(cells)


def bench(args) -> int:
    t0 = time.time()
    variants = args.variants or BENCH_VARIANTS
    if not torch.cuda.is_available():
        print("--bench needs a GPU", file=sys.stderr)
        return 2
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(src), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, os.path.abspath(src))
    result = {"variants": variants, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "cudnn": torch.backends.cudnn.version()}
    n, errors = warm_cache(variants, args.workers)
    result["compile"] = {"specializations": n, "seconds": round(time.time() - t0, 1),
                         "errors": {" ".join(map(str, k)): v for k, v in errors.items()}}
    print(f"compiled {n} specializations in {time.time() - t0:.0f} s, {len(errors)} failed", flush=True)
    for k, v in errors.items():
        print(f"  compile/launch error {k}: {v}", flush=True)
    result["check"] = check(variants)
    result["timing"] = bench_timing(variants, args.warmup, args.rep, t0 + args.budget)
    result["seconds"] = round(time.time() - t0, 1)
    print(f"done in {result['seconds']} s", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
