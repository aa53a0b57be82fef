"""Pieces shared by the Gluon kernels (``prefill.py``, ``decode.py``): dtypes, shared-memory
layouts and host TMA descriptors, ring and barrier helpers, and the online-softmax step of a
tile of scores."""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._common import cuda_properties

TORCH_TO_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# A decode cache's element types: q's, or a quantized cache's 1-byte formats.
CACHE_TO_GL = {**TORCH_TO_GL, torch.float8_e4m3fn: gl.float8e4nv, torch.int8: gl.int8}


@gluon.constexpr_function
def tile_layout(rows, head_dim, dtype):
    """Shared layout of a ``[1, rows, 1, head_dim]`` TMA box (rank 4, widest swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], dtype)


@functools.lru_cache(maxsize=None)
def _host_tile_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """:func:`tile_layout` for the host's descriptors, cached (building one costs ~9 us, and a
    call makes four)."""
    return tile_layout(rows, head_dim, CACHE_TO_GL[dtype])


def make_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """Rank-4 TMA descriptor over ``x [B, S, H, D]`` with box ``[1, rows, 1, D]``.

    Built without ``TensorDescriptor.__post_init__``: it re-checks what :func:`supported` and
    :func:`output_ok` checked before any launch (alignment, strides, contiguous last dim) and the
    fixed box and layout, at ~2 us per descriptor, four per call (tests compare the result with
    the checked constructor's).
    """
    desc = object.__new__(TensorDescriptor)
    desc.base = x
    desc.shape = list(x.shape)
    desc.strides = list(x.stride())
    desc.block_shape = [1, rows, 1, x.shape[3]]
    desc.layout = _host_tile_layout(rows, x.shape[3], x.dtype)
    desc.padding = "zero"
    return desc


def num_sms(device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200 when there is no GPU: compile only)."""
    if not isinstance(device, torch.device) or device.type != "cuda" or not torch.cuda.is_available():
        return 132
    return cuda_properties(device).multi_processor_count


@gluon.jit
def _ring_slot(j, STAGES: gl.constexpr):
    """Stage index and mbarrier parity of the ``j``-th use of a ``STAGES``-deep ring."""
    return j % STAGES, (j // STAGES) & 1


@gluon.jit
def _as_matrix(buf):
    """View a ``[1, rows, 1, D]`` shared tile (a TMA box) as the ``[rows, D]`` wgmma operand."""
    return buf.reshape([buf.shape[1], buf.shape[3]])


@gluon.jit
def _alloc_barriers(count: gl.constexpr, arrivals: gl.constexpr):
    """``count`` mbarriers, each completing a phase after ``arrivals`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(bars.index(i), count=arrivals)
    return bars


@gluon.jit
def _softmax_tile(s, m_i, l_i, j, unmasked, rows, seqlen_k, shift, qk_scale,
                  BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, FUSED_MASK: gl.constexpr = False):
    """Online-softmax step on scores ``s [64, BLOCK_N]`` (fp32, unscaled) of key tile ``j``.

    ``m_i``, ``l_i`` ``[64]``: running max (scaled, log2 units) and sum. Returns ``(p, m_new,
    l_new, alpha)`` with ``p = exp2(s * qk_scale - m_new)`` and ``alpha = exp2(m_i - m_new)``
    the factor for the accumulator. With ``FUSED_MASK`` (the persistent kernel) ``rows`` holds
    each row's last visible key (``shift`` is 0) and the two masks become one comparison of the
    tile-local column with a per-row limit (fewer registers in the masked branch).
    """
    s_layout: gl.constexpr = s.type.layout
    if j >= unmasked:
        if FUSED_MASK:
            cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            if CAUSAL:
                limit = gl.minimum(rows, seqlen_k - 1) - j * BLOCK_N
                visible = gl.expand_dims(cols, 0) <= gl.expand_dims(limit, 1)
            else:
                visible = gl.expand_dims(cols < seqlen_k - j * BLOCK_N, 0)
        else:
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
