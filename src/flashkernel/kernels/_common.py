"""Helpers shared by the kernel families: interpreter detection and dtype plumbing."""

from __future__ import annotations

import functools
import importlib

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was built by Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return isinstance(kernel, InterpretedFunction)


def dot_flags(dtype: torch.dtype, interpreted: bool) -> dict:
    """Constexprs that choose how ``tl.dot`` runs for ``dtype``.

    * ``DOT_F32``: upcast operands to fp32 before ``tl.dot``. Only in the interpreter and only
      for bf16, whose ``tl.dot`` returns garbage there (triton 3.6); GPU builds never set it.
    * ``DOT_PRECISION``: fp32 inputs use exact fp32 ("ieee") products, so fp32 results are as
      accurate as PyTorch's fp32 path; fp16/bf16 ignore it.
    """
    upcast = interpreted and dtype == torch.bfloat16
    return {
        "DOT_F32": upcast,
        "DOT_PRECISION": "ieee" if (upcast or dtype == torch.float32) else "tf32",
    }


# Scales above this compile the softmax kernels without FMA contraction (:func:`exponent_options`).
EXACT_EXPONENT_SCALE = 1.0
_NO_FP_FUSION = {"enable_fp_fusion": False}


def exponent_options(softmax_scale: float) -> dict:
    """Compile options of a kernel whose online softmax runs at ``softmax_scale``.

    The kernels take ``p = exp2(qk * scale - m)`` with ``m`` the rounded row max of ``qk * scale``
    (log2 units). The compiler contracts the exponent into one FMA, whose unrounded product can
    exceed ``m`` by half an ulp of the score: at most 4 while scaled scores stay below ``2**27``,
    which any ``|scale * q.k| < 9e7`` gives. Past ``2**31`` that half ulp overflows ``exp2`` (a
    NaN row), past ``2**32`` it underflows the row's largest term (a zero sum, LSE -inf). So a
    scale above :data:`EXACT_EXPONENT_SCALE` (1: every usual scale is at most that) compiles the
    kernel without contraction, where the exponent subtracts the very rounded product the max was
    taken of (exactly 0 at the max) for one more instruction per score. A scale of at most 1
    keeps the fused exponent: its contract is ``|scale * q.k| < 9e7`` (logits of 1e4 are far
    inside).
    """
    return _NO_FP_FUSION if exact_exponent(softmax_scale) else {}


def exact_exponent(softmax_scale: float) -> bool:
    """Whether kernels at ``softmax_scale`` compute the exponent unfused (:func:`exponent_options`)."""
    return softmax_scale > EXACT_EXPONENT_SCALE


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` costs ~1 us per host call: it goes
    through Triton's constexpr-function wrapper, and decode calls it on every step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``), like ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """Tile width along head_dim: ``tl.arange`` needs a power of two (>= 16 for ``tl.dot``)."""
    return max(16, next_power_of_2(head_dim))


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def cuda_properties(device: torch.device):
    """``torch.cuda.get_device_properties`` of ``device``, cached per device index: the
    launchers read SM counts, capability and shared memory on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_properties(index)


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU (compute capability 9.0: wgmma, TMA; the Gluon kernels)."""
    props = cuda_properties(device)
    return (props.major, props.minor) == (9, 0)


@functools.lru_cache(maxsize=None)
def optional_kernel_module(name: str):
    """``flashkernel.kernels.<name>``, or None where it cannot be imported (the Gluon kernels
    under another Triton version): callers then take the Triton path."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except Exception:  # noqa: BLE001 - any import failure means "no such path"
        return None


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and strides (the last dim contiguous)."""
    return all(tma_aligned(x) for x in tensors)


def tma_aligned(x: torch.Tensor, broadcast: bool = True) -> bool:
    """Whether TMA can address ``x``: 16-byte aligned base and strides (all but the last).
    With ``broadcast=False`` also a contiguous last dim and no stride-0 dimension of size > 1,
    as host descriptors need. One pass over the strides: the Gluon path checks four tensors per
    call."""
    strides = x.stride()
    if x.data_ptr() % 16 or not (broadcast or strides[-1] == 1):
        return False
    elem = x.element_size()
    for size, stride in zip(x.shape, strides[:-1]):
        if (stride * elem) % 16 or (not broadcast and stride == 0 and size > 1):
            return False
    return True
