"""Fused attention forward (FlashAttention-style): one program per (query tile, head, batch).

The query tile stays on chip while key/value tiles stream through; softmax is computed online
in fp32 with exp2 and the scale folded into one multiply. Causal tiles entirely above the
diagonal are never visited; tiles fully below it run a loop with no masking at all, and only
the diagonal / boundary tiles pay for masks.

Launch grid: ``(num_query_tiles, Hq, B)``. Query tiles vary fastest so the programs resident
at one time share one head's K/V in L2; with ``causal`` the longest tiles are issued first.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ._common import dot_flags, is_interpreted, padded_head_dim

LOG2E = math.log2(math.e)
MAX_GRID_YZ = 65535


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # Triton's automatic warp specialization of the key loop


# Tuned on an H200 (bf16; benchmarks/prefill.py --sweep-configs --tma 1 0), keyed by the padded
# head dim, one table per way of loading tiles. See docs/perf-notes.md for the sweeps.
POINTER_TABLE = {
    16: TileConfig(128, 64, 8, 3),
    32: TileConfig(128, 64, 8, 3),
    64: TileConfig(128, 64, 8, 3),
    128: TileConfig(128, 128, 8, 3),
    256: TileConfig(128, 64, 8, 2),
}
TMA_TABLE = {
    16: TileConfig(128, 64, 4, 3),
    32: TileConfig(128, 64, 4, 3),
    64: TileConfig(128, 64, 4, 3),
    128: TileConfig(128, 128, 8, 3),
    256: TileConfig(128, 64, 8, 2),
}
# Below this many keys the per-program descriptor setup costs more than TMA saves (1k: -6%,
# 16k: +8% at head dim 128 on the H200).
TMA_MIN_SEQLEN_K = 4096
INTERPRETER_CONFIG = TileConfig(32, 32, 4, 1)


def pick_config(head_dim: int, dtype: torch.dtype, interpreted: bool, tma: bool) -> TileConfig:
    """Tile shape and launch parameters for one call (no autotuning on the hot path)."""
    if interpreted:
        return INTERPRETER_CONFIG
    block_d = padded_head_dim(head_dim)
    if dtype == torch.float32:
        # fp32 tiles are twice as large in shared memory and use exact fp32 products.
        return TileConfig(64, 32, 4, 2 if block_d <= 128 else 1)
    return (TMA_TABLE if tma else POINTER_TABLE)[block_d]


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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the key/value tile starting at ``start_n``.

    ``m_i`` holds the running row max of the scores in log2 units (already scaled).
    With ``MASKED`` the tile may hold keys past ``seqlen_k`` or above the causal diagonal.
    """
    k = _load_tile(k_src, start_n, seqlen_k, stride_ks, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, MASKED)
    v = _load_tile(v_src, start_n, seqlen_k, stride_vs, offs_n, offs_d, HEAD_DIM, BLOCK_D, USE_TMA, MASKED)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        keys = start_n + offs_n
        visible = keys[None, :] < seqlen_k
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None] + causal_shift)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    p = tl.math.exp2(qk * qk_scale - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Lengths change every call in serving; specializing on them (==1, %16) would recompile per length.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _attention_fwd_kernel(
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
    WARP_SPECIALIZE: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    num_m_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL:
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
    q = _load_tile(q_src, first_row, seqlen_q, stride_qs, tl.arange(0, BLOCK_M), offs_d,
                   HEAD_DIM, BLOCK_D, USE_TMA, True)
    if DOT_F32:
        q = q.to(tl.float32)

    # Key range of this tile: [0, end) is visited, [0, full_end) needs no mask at all.
    if CAUSAL:
        end = tl.minimum(seqlen_k, first_row + BLOCK_M + causal_shift)
        full_end = tl.minimum(seqlen_k, first_row + 1 + causal_shift)
    else:
        end = seqlen_k
        full_end = seqlen_k
    end = tl.maximum(end, 0)
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
            seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
            HEAD_DIM, BLOCK_D, False, CAUSAL, USE_TMA, DOT_F32, DOT_PRECISION,
        )
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, offs_n, offs_d,
            seqlen_k, stride_ks, stride_vs, causal_shift, qk_scale,
            HEAD_DIM, BLOCK_D, True, CAUSAL, USE_TMA, DOT_F32, DOT_PRECISION,
        )

    # Rows that saw no key have l = 0 and acc = 0: output 0, LSE -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(Out.dtype.element_ty)
    if USE_TMA:
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
        lse_ptrs = Lse + batch * stride_lb + head * stride_lh + offs_m
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


def _scratch_allocator(size: int, alignment: int, stream):
    """Global scratch for in-kernel TMA descriptors (128 bytes per descriptor per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and strides (the last dim contiguous)."""
    for x in tensors:
        if x.data_ptr() % 16:
            return False
        if any((stride * x.element_size()) % 16 for stride in x.stride()[:-1]):
            return False
    return True


def use_tma(q, k, v, out, interpreted: bool) -> bool:
    """Stream tiles through TMA descriptors on Hopper when the tensors allow it and the key
    sequence is long enough to amortize building the descriptors in every program."""
    if interpreted or q.dtype == torch.float32 or k.shape[1] < TMA_MIN_SEQLEN_K:
        return False
    return torch.cuda.get_device_capability(q.device)[0] >= 9 and tma_compatible(q, k, v, out)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    causal: bool,
    softmax_scale: float,
    config: TileConfig | None = None,
    force_tma: bool | None = None,
):
    """Launch the fused forward into ``out [B, Sq, Hq, D]`` and ``lse [B, Hq, Sq]`` (or None).

    Inputs are validated by the caller; batch, seqlen_q and seqlen_k are all >= 1.
    ``config`` and ``force_tma`` override the tuned choice (benchmarks and tests use them).
    Returns the compiled kernel of the last launch (for resource reports).
    """
    batch, seqlen_q, num_q_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    interpreted = is_interpreted(_attention_fwd_kernel)
    tma = use_tma(q, k, v, out, interpreted) if force_tma is None else force_tma
    tma = tma and tma_compatible(q, k, v, out)
    if config is None:
        config = pick_config(head_dim, q.dtype, interpreted, tma)
    if tma and not interpreted:
        triton.set_allocator(_scratch_allocator)
    lse_arg = lse if lse is not None else out  # unused pointer when WRITE_LSE is False
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    # Grid axes 1 and 2 are limited to 65535: launch large batches in chunks.
    for b0 in range(0, batch, MAX_GRID_YZ):
        b1 = min(batch, b0 + MAX_GRID_YZ)
        grid = (triton.cdiv(seqlen_q, config.block_m), num_q_heads, b1 - b0)
        compiled = _attention_fwd_kernel[grid](
            q[b0:b1], k[b0:b1], v[b0:b1], out[b0:b1],
            lse_arg[b0:b1],
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            *lse_strides,
            seqlen_q, seqlen_k, num_q_heads // num_kv_heads, softmax_scale * LOG2E,
            HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            CAUSAL=causal, WRITE_LSE=lse is not None, USE_TMA=tma,
            WARP_SPECIALIZE=config.warp_specialize,
            num_warps=config.num_warps, num_stages=config.num_stages,
            **dot_flags(q.dtype, interpreted),
        )
    return compiled
