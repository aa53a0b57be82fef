"""Textbook ("standard") attention as three kernels that write the N x N matrices to memory.

1. ``scores``: ``S[b, h, i, j] = scale * <q[b, i, h], k[b, j, h // group]>``, float32, ``[B, Hq, Sq, Sk]``.
2. ``softmax``: ``P = softmax(S)`` row by row with the bottom-right causal mask, written in the
   input dtype, plus ``lse [B, Hq, Sq]``.
3. ``pv``: ``out[b, i, h] = sum_j P[b, h, i, j] * v[b, j, h // group]``.

It exists to be measured against (its memory grows as seqlen^2) and so each step can be tested
alone. Offsets into the N x N matrices are int64: they pass 2**31 elements at 16k tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_flags, is_interpreted, padded_head_dim

SCORES_BLOCK = 64
SOFTMAX_BLOCK = 1024
PV_BLOCK_M = 64
PV_BLOCK_N = 64


@triton.jit
def _scores_kernel(
    Q, K, S,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    seqlen_q, seqlen_k, num_heads, group_size, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    batch = (bh // num_heads).to(tl.int64)
    head = bh % num_heads
    kv_head = (head // group_size).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + batch * stride_qb + head.to(tl.int64) * stride_qh
        + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :],
        mask=(offs_m[:, None] < seqlen_q) & d_ok[None, :], other=0.0,
    )
    k = tl.load(
        K + batch * stride_kb + kv_head * stride_kh
        + offs_n[:, None].to(tl.int64) * stride_ks + offs_d[None, :],
        mask=(offs_n[:, None] < seqlen_k) & d_ok[None, :], other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    row = bh.to(tl.int64) * seqlen_q + offs_m
    s_ptrs = S + row[:, None] * seqlen_k + offs_n[None, :]
    tl.store(s_ptrs, s, mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


@triton.jit
def _softmax_kernel(
    S, P, Lse, seqlen_q, seqlen_k,
    CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row ``(b, h, i)`` of S; two passes over the row."""
    row = tl.program_id(0).to(tl.int64)
    i = row % seqlen_q
    s_row = S + row * seqlen_k
    p_row = P + row * seqlen_k
    if CAUSAL:
        visible_end = tl.minimum(tl.maximum(i + seqlen_k - seqlen_q + 1, 0), seqlen_k)
    else:
        visible_end = seqlen_k

    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, visible_end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(s_row + cols, mask=cols < visible_end, other=float("-inf"))
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.exp(s - m_safe)
        m = m_new
    row_max = tl.max(m, 0)
    row_max_safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(total * tl.exp(m - row_max_safe), 0)
    inv_sum = tl.where(row_sum > 0.0, 1.0 / row_sum, 0.0)

    for start in range(0, seqlen_k, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(s_row + cols, mask=cols < visible_end, other=float("-inf"))
        p = tl.exp(s - row_max_safe) * inv_sum
        tl.store(p_row + cols, p.to(P.dtype.element_ty), mask=cols < seqlen_k)
    lse = tl.where(row_sum > 0.0, row_max_safe + tl.log(row_sum), float("-inf"))
    tl.store(Lse + row, lse)


@triton.jit
def _pv_kernel(
    P, V, Out,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    seqlen_q, seqlen_k, num_heads, group_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    batch = (bh // num_heads).to(tl.int64)
    head = bh % num_heads
    kv_head = (head // group_size).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = bh.to(tl.int64) * seqlen_q + offs_m
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + offs_n
        p = tl.load(P + row[:, None] * seqlen_k + cols[None, :],
                    mask=(offs_m[:, None] < seqlen_q) & (cols[None, :] < seqlen_k), other=0.0)
        v = tl.load(V + batch * stride_vb + kv_head * stride_vh
                    + cols[:, None].to(tl.int64) * stride_vs + offs_d[None, :],
                    mask=(cols[:, None] < seqlen_k) & d_ok[None, :], other=0.0)
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    o_ptrs = (Out + batch * stride_ob + head.to(tl.int64) * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :])
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=(offs_m[:, None] < seqlen_q) & d_ok[None, :])


def _num_warps(interpreted: bool) -> int:
    return 1 if interpreted else 4


def scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, s: torch.Tensor) -> None:
    """Write ``s [B, Hq, Sq, Sk]`` float32 (contiguous) = ``softmax_scale * q @ k^T`` per head."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    interpreted = is_interpreted(_scores_kernel)
    grid = (triton.cdiv(seqlen_q, SCORES_BLOCK), triton.cdiv(seqlen_k, SCORES_BLOCK), batch * num_heads)
    _scores_kernel[grid](
        q, k, s,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        seqlen_q, seqlen_k, num_heads, num_heads // k.shape[2], softmax_scale,
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        BLOCK_M=SCORES_BLOCK, BLOCK_N=SCORES_BLOCK,
        num_warps=_num_warps(interpreted), **dot_flags(q.dtype, interpreted),
    )


def softmax(s: torch.Tensor, causal: bool, p: torch.Tensor, lse: torch.Tensor) -> None:
    """Row softmax of ``s [B, H, Sq, Sk]`` into ``p`` (same shape, contiguous) and ``lse [B, H, Sq]``."""
    batch, num_heads, seqlen_q, seqlen_k = s.shape
    interpreted = is_interpreted(_softmax_kernel)
    _softmax_kernel[(batch * num_heads * seqlen_q,)](
        s, p, lse, seqlen_q, seqlen_k,
        CAUSAL=causal, BLOCK=min(SOFTMAX_BLOCK, max(16, triton.next_power_of_2(seqlen_k))),
        num_warps=_num_warps(interpreted),
    )


def pv(p: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``out [B, Sq, Hq, D] = P @ v`` with ``p [B, Hq, Sq, Sk]``, ``v [B, Sk, Hkv, D]``."""
    batch, num_q_heads, seqlen_q, seqlen_k = p.shape
    head_dim = v.shape[3]
    interpreted = is_interpreted(_pv_kernel)
    grid = (triton.cdiv(seqlen_q, PV_BLOCK_M), batch * num_q_heads)
    _pv_kernel[grid](
        p, v, out,
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        seqlen_q, seqlen_k, num_q_heads, num_q_heads // v.shape[2],
        HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        BLOCK_M=PV_BLOCK_M, BLOCK_N=PV_BLOCK_N,
        num_warps=_num_warps(interpreted), **dot_flags(v.dtype, interpreted),
    )


def standard_attention(q, k, v, out, lse, *, causal: bool, softmax_scale: float) -> None:
    """The three kernels composed, into ``out [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]``.

    Allocates the float32 score matrix and the probability matrix (input dtype), each
    ``[B, Hq, Sq, Sk]``: this is the memory that grows as seqlen^2.
    """
    batch, seqlen_q, num_heads, _ = q.shape
    shape = (batch, num_heads, seqlen_q, k.shape[1])
    s = torch.empty(shape, dtype=torch.float32, device=q.device)
    scores(q, k, softmax_scale, s)
    p = torch.empty(shape, dtype=q.dtype, device=q.device)
    softmax(s, causal, p, lse)
    del s
    pv(p, v, out)
