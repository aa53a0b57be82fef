"""Exact merge of partial attention results by their log-sum-exp.

Attention over a key set split into disjoint parts ``s`` gives, per query row, a normalized
partial output ``o_s`` and its log-sum-exp ``lse_s``. The result over all keys is exactly::

    lse = log(sum_s exp(lse_s))
    out = sum_s exp(lse_s - lse) * o_s

A part that saw no key has ``lse_s = -inf`` and weight 0; its ``o_s`` is never read (it may
hold anything, NaN included). A row whose parts are all ``-inf`` gets ``out = 0`` and
``lse = -inf``. Split-KV decode merges its splits with this; ring attention will merge the
blocks of its steps the same way.

Launch grid: one program per ``(batch, token, head)`` row and slice of ``BLOCK_D`` columns of
the head dim, flattened into axis 0 (no 65535 limit). A program loads the parts in chunks of
``BLOCK_P`` at once (one chunk when ``P`` is small, so a merge costs two dependent loads, not a
loop of ``P``): first the ``lse`` of every part (the max), then weights and its columns of the
outputs of non-empty parts. Every slice of a row computes the same weights, and the order of
the sums is fixed, so the result is deterministic. Few rows of many parts (a batch-1 decode
step split 33 ways has 32 rows) are cut into column slices, so the merge runs on more SMs
(:func:`column_slices`). The slicing follows from the shapes alone (rows, parts, head dim), so
calls of one shape merge alike bit for bit; a row merged with another slicing (the same parts in
a call with more rows) may differ from it in the last bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import cdiv, exponent_options, next_power_of_2, padded_head_dim
from ._launch import Launcher

LOG2E = math.log2(math.e)
MAX_TILE_ELEMENTS = 8192  # BLOCK_P * BLOCK_D: parts loaded at once per program
SLICE_MIN_PARTS = 8  # fewer parts: one program per row (docs/perf-notes.md, "The merge's columns")
SLICE_MAX_PROGRAMS = 512  # rows x slices
SLICE_COLUMNS = 32  # the narrowest slice


def column_slices(num_rows: int, num_parts: int, block_d: int) -> int:
    """Slices of a row's ``block_d`` (padded) columns: with at least ``SLICE_MIN_PARTS`` parts,
    the largest power of two that keeps slices of at least ``SLICE_COLUMNS`` columns and
    ``num_rows * slices`` within ``SLICE_MAX_PROGRAMS`` (a batch-1 step of 32 query heads: 4
    slices of head dim 128). :func:`combine` launches only the slices that hold columns of the
    head dim."""
    slices = 1
    if num_parts < SLICE_MIN_PARTS:
        return slices
    while 2 * slices * SLICE_COLUMNS <= block_d and 2 * slices * num_rows <= SLICE_MAX_PROGRAMS:
        slices *= 2
    return slices


@triton.jit
def _combine_kernel(
    OutPart, LsePart, Out, Lse,
    stride_ps, stride_pb, stride_pt, stride_ph,
    stride_qs, stride_qb, stride_qh, stride_qt,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh, stride_lt,
    num_parts, seqlen, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, SLICES: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    piece = pid % SLICES
    pid = pid // SLICES
    head = (pid % num_heads).to(tl.int64)
    row = pid // num_heads
    token = (row % seqlen).to(tl.int64)
    batch = (row // seqlen).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P).to(tl.int64)
    offs_d = piece * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # Part offsets in int64 (the parts may span more than 2**31 elements): the per-part index and
    # the chunk step are both 64-bit, so no int32 product can wrap.
    step_lse = (offs_p * 0 + stride_qs) * BLOCK_P  # [BLOCK_P] int64, every lane the same step
    step_part = (offs_p * 0 + stride_ps) * BLOCK_P

    lse_ptrs = LsePart + batch * stride_qb + head * stride_qh + token * stride_qt + offs_p * stride_qs
    part_ptrs = (OutPart + batch * stride_pb + token * stride_pt + head * stride_ph
                 + offs_p[:, None] * stride_ps + offs_d[None, :])

    # Pass 1: the largest lse (log2 units); -inf when every part is empty.
    m_p = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    ptrs = lse_ptrs
    for p0 in range(0, num_parts, BLOCK_P):
        lse_p = tl.load(ptrs, mask=p0 + offs_p < num_parts, other=float("-inf"))
        m_p = tl.maximum(m_p, lse_p * 1.4426950408889634)
        ptrs += step_lse
    m = tl.max(m_p, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    # Pass 2: weights exp(lse_p - max); outputs of empty parts are not read.
    total_p = tl.zeros([BLOCK_P], dtype=tl.float32)
    acc_p = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        lse_p = tl.load(lse_ptrs, mask=p0 + offs_p < num_parts, other=float("-inf"))
        w = tl.math.exp2(lse_p * 1.4426950408889634 - m_safe)
        o_p = tl.load(part_ptrs, mask=(w > 0.0)[:, None] & d_ok[None, :], other=0.0)
        acc_p += w[:, None] * o_p.to(tl.float32)
        total_p += w
        lse_ptrs += step_lse
        part_ptrs += step_part[:, None]
    acc = tl.sum(acc_p, 0)
    total = tl.sum(total_p, 0)

    total_safe = tl.where(total == 0.0, 1.0, total)
    out = acc / total_safe
    tl.store(Out + batch * stride_ob + token * stride_ot + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=d_ok)
    if WRITE_LSE and piece == 0:
        lse = tl.where(total == 0.0, float("-inf"), (m_safe + tl.math.log2(total_safe)) / 1.4426950408889634)
        tl.store(Lse + batch * stride_lb + head * stride_lh + token * stride_lt, lse)


def combine(
    out_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    *,
    softmax_scale: float = 1.0,
) -> None:
    """Merge ``P`` partial results into ``out`` (and ``lse``), exactly, by log-sum-exp.

    Args:
        out_parts: ``[P, B, T, H, D]`` normalized partial outputs (any float dtype, float32
            recommended), last dimension contiguous. Parts whose lse is ``-inf`` are not read.
        lse_parts: ``[P, B, H, T]`` float32 natural-log log-sum-exp of each part.
        out: ``[B, T, H, D]`` written in its own dtype (any strides, last dim contiguous).
        lse: ``[B, H, T]`` float32, written when given.
        softmax_scale: the scale the parts were computed at: above 1 the merge is compiled
            without FMA contraction (``_common.exponent_options``), as the parts were.

    The caller checks shapes and devices (this is the kernel layer). ``P`` may be 1.
    """
    num_parts, batch, seqlen, num_heads, head_dim = out_parts.shape
    if batch == 0 or seqlen == 0 or num_heads == 0:
        return
    padded = padded_head_dim(head_dim)
    rows = batch * seqlen * num_heads
    block_d = padded // column_slices(rows, num_parts, padded)
    slices = cdiv(head_dim, block_d)  # no program for a slice wholly past the head dim (72, 96)
    block_p = min(next_power_of_2(num_parts), max(1, MAX_TILE_ELEMENTS // block_d))
    lse_arg = lse if lse is not None else lse_parts  # unused pointer when WRITE_LSE is False
    lse_strides = (lse.stride(0), lse.stride(1), lse.stride(2)) if lse is not None else (0, 0, 0)
    grid = (rows * slices,)
    _launch_combine(
        grid, out_parts, lse_parts, out, lse_arg,
        out_parts.stride(0), out_parts.stride(1), out_parts.stride(2), out_parts.stride(3),
        lse_parts.stride(0), lse_parts.stride(1), lse_parts.stride(2), lse_parts.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        *lse_strides,
        num_parts, seqlen, num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=block_p, SLICES=slices,
        WRITE_LSE=lse is not None,
        num_warps=8 if block_p * block_d > 4096 else 4, **exponent_options(softmax_scale),
    )


_launch_combine = Launcher(_combine_kernel)
