"""Validation of user input for the public API.

Every check raises ``TypeError`` / ``ValueError`` naming the actual values and what would be
accepted, before anything is launched. Nothing here touches tensor data.
"""

from __future__ import annotations

import math
import numbers

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(
            f"{name} must have {rank} dimensions {layout}, got {x.dim()} with shape "
            f"{tuple(x.shape)}"
        )


def check_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        accepted = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)}; supported dtypes are {accepted}")


def check_same_dtype(names_and_tensors) -> None:
    (first_name, first), *rest = names_and_tensors
    for name, x in rest:
        if x.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {_dtype_name(x.dtype)} but {first_name} has "
                f"{_dtype_name(first.dtype)}: all inputs must share one dtype (cast them first)"
            )


def check_same_device(names_and_tensors) -> None:
    (first_name, first), *rest = names_and_tensors
    for name, x in rest:
        if x.device != first.device:
            raise ValueError(
                f"{name} is on {x.device} but {first_name} is on {first.device}: "
                "all inputs must be on the same device"
            )


def check_device(name: str, x: torch.Tensor, interpreted: bool) -> None:
    if x.device.type == "cuda":
        return
    if x.device.type == "cpu" and interpreted:
        return
    if x.device.type == "cpu":
        raise ValueError(
            f"{name} is on the CPU: flashkernel's kernels run on CUDA GPUs; move the tensors "
            "with .cuda(), or set TRITON_INTERPRET=1 before importing flashkernel to run "
            "Triton's (slow) CPU interpreter"
        )
    raise ValueError(f"{name} is on {x.device}; flashkernel runs on CUDA devices only")


def check_head_dim(name: str, head_dim: int) -> None:
    if head_dim % 8 != 0 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"{name} has head_dim {head_dim}; supported head dims are multiples of 8 "
            f"from 8 to {MAX_HEAD_DIM}"
        )


def check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} has stride {x.stride(-1)} in its last (head_dim) dimension; it must be "
            "contiguous there (stride 1): call .contiguous() on it first"
        )


def check_kv_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"k has {num_kv_heads} heads and q has {num_q_heads}: the number of query heads "
            "must be a positive multiple of the number of key/value heads (GQA)"
        )


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """Return the scale to use: ``1/sqrt(head_dim)`` when None, else a finite positive float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__} "
            f"{softmax_scale!r}"
        )
    value = float(softmax_scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"softmax_scale must be finite and positive, got {softmax_scale!r} "
            "(None picks 1/sqrt(head_dim))"
        )
    return value


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_qkv(q, k, v, interpreted: bool) -> None:
    """Validate ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` for dense attention."""
    named = (("q", q), ("k", k), ("v", v))
    for name, x in named:
        check_tensor(name, x)
    for name, x in named:
        check_rank(name, x, 4, "[batch, seqlen, heads, head_dim]")
    for name, x in named:
        check_dtype(name, x)
    check_same_dtype(named)
    check_same_device(named)
    check_device("q", q, interpreted)

    batch, _, num_q_heads, head_dim = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != batch:
            raise ValueError(
                f"{name} has batch {x.shape[0]} but q has batch {batch}: batch sizes must match"
            )
        if x.shape[3] != head_dim:
            raise ValueError(
                f"{name} has head_dim {x.shape[3]} but q has head_dim {head_dim}: "
                "q, k and v must share one head_dim"
            )
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(
            f"k has shape {tuple(k.shape)} and v has shape {tuple(v.shape)}: k and v must "
            "have the same seqlen and number of heads"
        )
    check_head_dim("q", head_dim)
    check_kv_heads(num_q_heads, k.shape[2])
    for name, x in named:
        check_last_dim_contiguous(name, x)
