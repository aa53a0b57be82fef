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
# Scores are float32: softmax_scale * log2(e) * q.k must stay finite. At head dim 256, float16
# inputs reach |q.k| = 256 * 65504^2 = 1.1e12, so scales up to 1e20 never overflow them (at 1e38
# the folded scale itself is inf in float32 and every output NaN).
MAX_SOFTMAX_SCALE = 1e20
MIN_SOFTMAX_SCALE = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(x)}")
    if x.is_nested:
        raise TypeError(f"{name} is a nested tensor; flashkernel takes dense tensors: pack ragged sequences into "
                        "one [total, heads, head_dim] tensor and call flash_attn_varlen_func with cu_seqlens")
    if x.layout is not torch.strided:
        raise TypeError(f"{name} has layout {x.layout}; flashkernel takes dense (torch.strided) tensors: "
                        "call .to_dense() on it")


def check_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(
            f"{name} must have {rank} dimensions {layout}, got {x.dim()} with shape "
            f"{tuple(x.shape)}"
        )


def check_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        accepted = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
        hint = ("; for float64 (gradient checks) use flashkernel.reference.attention, the float64 spec"
                if x.dtype == torch.float64 else "")
        raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)}; supported dtypes are {accepted}{hint}")


def type_name(value) -> str:
    """``value``'s type as an error message names it: qualified outside the builtins (``numpy.bool``
    is not ``bool``)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


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
    raise ValueError(f"{name} is on {x.device}; flashkernel's kernels run on CUDA GPUs (and on the CPU through "
                     "Triton's interpreter, TRITON_INTERPRET=1): move the tensors to a CUDA device")


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


def check_kv_heads(num_q_heads: int, num_kv_heads: int, kv_name: str = "k") -> None:
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{kv_name} has {num_kv_heads} heads and q has {num_q_heads}: the number of query heads "
            "must be a positive multiple of the number of key/value heads (GQA)"
        )


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """Return the scale to use: ``1/sqrt(head_dim)`` when None, else a finite positive float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be a real number or None, got {type_name(softmax_scale)} "
            f"{softmax_scale!r}"
        )
    value = float(softmax_scale)
    if not 0 < value < math.inf:  # comparisons, not math.isfinite: torch.compile traces them
        raise ValueError(
            f"softmax_scale must be finite and positive, got {softmax_scale!r} "
            "(None picks 1/sqrt(head_dim))"
        )
    if value < MIN_SOFTMAX_SCALE:
        raise ValueError(
            f"softmax_scale is {softmax_scale!r}; it must be at least {MIN_SOFTMAX_SCALE!r} (the smallest normal "
            "float32: the kernels compute in float32, where a smaller scale is 0 or loses its digits)"
        )
    if value > MAX_SOFTMAX_SCALE:
        raise ValueError(
            f"softmax_scale is {softmax_scale!r}; it must be at most {MAX_SOFTMAX_SCALE:g}: the scaled scores "
            "are float32, and larger scales overflow them"
        )
    return value


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(value)} {value!r}")


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


# --- flash_attn_with_kvcache -----------------------------------------------------------------

MAX_PAGE_SIZE = 256
MAX_NUM_SPLITS = 256
QUANTIZED_CACHE_DTYPES = (torch.float8_e4m3fn, torch.int8)
SCALE_GRANULARITIES = ("tensor", "head", "token")


def check_int32_vector(name: str, x, length: int, what: str) -> None:
    """``x`` must be an int32 tensor of shape ``[length]``."""
    check_tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)}; it must be int32 (call .int() on it)")
    if tuple(x.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) ({what}), got {tuple(x.shape)}")


def check_page_size(page_size: int) -> None:
    if page_size < 1 or page_size > MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(
            f"k_cache has page size {page_size} (dimension 1 of a paged cache); page sizes must "
            f"be powers of two from 1 to {MAX_PAGE_SIZE}"
        )


def check_block_table(block_table, batch: int) -> None:
    check_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(
            f"block_table has dtype {_dtype_name(block_table.dtype)}; it must be int32 "
            "(call .int() on it)"
        )
    check_rank("block_table", block_table, 2, "[batch, max_blocks_per_sequence]")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but q has batch {batch}")


def check_cache_extent(k_cache, v_cache) -> None:
    """The checks of two rank-4 caches that read their lengths or strides: equal shapes
    (:func:`check_same_cache_shape`), a contiguous last dimension. ``flash_attn_with_kvcache``
    runs only these for a call that differs from a validated one in nothing but the caches'
    lengths and strides (its length families), and the full validation runs both of them: a new
    check that reads the lengths or strides belongs here too."""
    check_same_cache_shape(k_cache, v_cache)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, x)


def check_same_cache_shape(k_cache, v_cache) -> None:
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)} and v_cache has shape "
            f"{tuple(v_cache.shape)}: they must have the same shape"
        )


def check_kv_cache_pair(q, k_cache, v_cache, block_table) -> None:
    """``k_cache, v_cache``: ``[B, S_max, Hkv, D]``, or ``[num_blocks, page_size, Hkv, D]`` when paged."""
    layout = "[num_blocks, page_size, kv_heads, head_dim]" if block_table is not None else (
        "[batch, max_seqlen, kv_heads, head_dim]")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_rank(name, x, 4, layout)
    check_same_cache_shape(k_cache, v_cache)
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(
            f"k_cache has head_dim {k_cache.shape[3]} but q has head_dim {q.shape[3]}: "
            "q and the caches must share one head_dim"
        )
    if block_table is None and k_cache.shape[0] != q.shape[0]:
        raise ValueError(
            f"k_cache has batch {k_cache.shape[0]} but q has batch {q.shape[0]}: a contiguous "
            "cache holds one row per sequence (pass block_table for a paged cache)"
        )
    if block_table is not None:
        check_page_size(k_cache.shape[1])
        if k_cache.shape[0] == 0 and block_table.shape[1] > 0:
            raise ValueError("k_cache is a paged cache with 0 blocks: the page pool is empty")
    check_kv_heads(q.shape[2], k_cache.shape[2], "k_cache")


def check_new_kv(q, k, v, k_cache) -> None:
    """New tokens ``k, v [B, Sq_new, Hkv, D]``, given together or not at all."""
    if (k is None) != (v is None):
        raise ValueError(
            f"k and v must be given together (to append them) or both left None; got "
            f"k={type_name(k)}, v={type_name(v)}"
        )
    if k is None:
        return
    expected = (q.shape[0], q.shape[1], k_cache.shape[2], q.shape[3])
    for name, x in (("k", k), ("v", v)):
        check_tensor(name, x)
        if tuple(x.shape) != expected:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}; new keys/values must have shape "
                f"[batch, seqlen_q, kv_heads, head_dim] = {expected}"
            )


def check_num_splits(num_splits) -> None:
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int, got {type_name(num_splits)} {num_splits!r}")
    if not 0 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(
            f"num_splits must be from 0 (automatic) to {MAX_NUM_SPLITS}, got {num_splits}"
        )


def check_optional_flag(name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool or None, got {type_name(value)} {value!r}")


def check_cache_dtypes(q, k_cache, v_cache) -> bool:
    """The caches are in q's dtype, or both in one quantized format (float8_e4m3fn or int8).
    Returns whether they are quantized."""
    quantized = [x.dtype in QUANTIZED_CACHE_DTYPES for x in (k_cache, v_cache)]
    if not any(quantized):
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if x.dtype not in SUPPORTED_DTYPES:
                accepted = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES + QUANTIZED_CACHE_DTYPES)
                raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)}; a cache is in q's dtype or quantized: "
                                f"supported dtypes are {accepted}")
        check_same_dtype((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
        return False
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"k_cache has dtype {_dtype_name(k_cache.dtype)} but v_cache has {_dtype_name(v_cache.dtype)}: a "
            "quantized cache keeps keys and values in one format (float8_e4m3fn or int8; flashkernel.quantize_kv "
            "converts a cache)")
    return True


def scale_granularity(scale: torch.Tensor) -> str:
    """``"tensor"`` (shape ``[]`` or ``[1]``), ``"head"`` (``[Hkv]``) or ``"token"`` (3-D: the
    cache's leading dims) of a validated scale."""
    if scale.dim() == 3:
        return "token"
    return "tensor" if scale.numel() == 1 else "head"


def scale_shapes(k_cache: torch.Tensor) -> str:
    """The accepted scale shapes of a cache, for messages."""
    return (f"[1] (per tensor), [{k_cache.shape[2]}] (per KV head) or {list(k_cache.shape[:3])} "
            "(per token and KV head: the cache's leading dims)")


def check_kv_scales(k_scale, v_scale, k_cache, quantized: bool) -> None:
    """None for a cache in q's dtype; for a quantized cache, float32 scales of one granularity on
    the cache's device (values unread: they must be positive and finite)."""
    named = (("k_scale", k_scale), ("v_scale", v_scale))
    if not quantized:
        for name, scale in named:
            if scale is not None:
                raise ValueError(
                    f"{name} is given but the cache has dtype {_dtype_name(k_cache.dtype)}: scales belong to a "
                    "quantized cache (float8_e4m3fn or int8); leave k_scale and v_scale None")
        return
    accepted = {(), (1,), (k_cache.shape[2],), tuple(k_cache.shape[:3])}
    for name, scale in named:
        if scale is None:
            raise ValueError(
                f"k_cache has dtype {_dtype_name(k_cache.dtype)} (a quantized cache) but {name} is None: pass "
                f"k_scale and v_scale, float32 {scale_shapes(k_cache)}")
        if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
            raise TypeError(f"{name} is the number {scale!r}; this call takes scales as float32 tensors on the cache's "
                            f"device (nothing then syncs with the host): make one once, torch.tensor([{scale!r}], "
                            "device=k_cache.device), and pass it to every call (quantize_kv and KVCache take numbers)")
        check_tensor(name, scale)
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {_dtype_name(scale.dtype)}; scales must be float32 (call .float() on it)")
        if tuple(scale.shape) not in accepted:
            raise ValueError(f"{name} has shape {tuple(scale.shape)}; a scale is {scale_shapes(k_cache)}")
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device} but k_cache is on {k_cache.device}: move it to the "
                             "cache's device")
    k_kind, v_kind = scale_granularity(k_scale), scale_granularity(v_scale)
    if k_kind != v_kind:
        raise ValueError(f"k_scale is per {k_kind} and v_scale per {v_kind}: keys and values take scales of one "
                         "granularity")


def check_quantized_dtype(dtype, name: str = "dtype") -> None:
    """A quantized cache's format (argument ``name``): float8_e4m3fn or int8."""
    if dtype not in QUANTIZED_CACHE_DTYPES:
        accepted = " or ".join(f"torch.{_dtype_name(d)}" for d in QUANTIZED_CACHE_DTYPES)
        raise TypeError(f"{name} must be {accepted} (the quantized cache formats), got {dtype!r}")


def check_granularity(granularity, name: str = "granularity") -> None:
    if granularity not in SCALE_GRANULARITIES:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, SCALE_GRANULARITIES))}, got {granularity!r}")


def check_scale_number(name: str, value) -> float:
    """A quantized cache's scale given as a Python number: positive and a normal float32 (it is
    stored as one: a smaller number would become 0 or a subnormal, a larger one overflow)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a float32 tensor, got bool")
    info = torch.finfo(torch.float32)
    if not info.tiny <= float(value) <= info.max:  # NaN too
        raise ValueError(f"{name} must be finite and positive, got {value!r} (a normal float32: {info.tiny:.3g} to "
                         f"{info.max:.3g})")
    return float(value)


def check_quantize_inputs(k_cache, v_cache, dtype, granularity, k_scale, v_scale, interpreted: bool) -> None:
    """``quantize_kv``: caches ``[N, S, Hkv, D]`` in one float dtype (float16, bfloat16, float32),
    a quantized format, a granularity, and static scales only for per-tensor/per-head."""
    named = (("k_cache", k_cache), ("v_cache", v_cache))
    for name, x in named:
        check_tensor(name, x)
        check_rank(name, x, 4, "[batch or num_blocks, seqlen or page_size, kv_heads, head_dim]")
        check_dtype(name, x)
    check_same_dtype(named)
    check_same_device(named)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)} and v_cache has shape {tuple(v_cache.shape)}: "
                         "they must have the same shape")
    check_device("k_cache", k_cache, interpreted)
    check_head_dim("k_cache", k_cache.shape[3])
    for name, x in named:
        check_last_dim_contiguous(name, x)
    check_quantized_dtype(dtype)
    check_granularity(granularity)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if granularity == "token":
            raise ValueError(f"{name} is given with granularity 'token': per-token scales are computed from the "
                             "values; pass none")
        if isinstance(scale, numbers.Real):  # bools too: check_scale_number refuses them
            check_scale_number(name, scale)
            continue
        shape = (1,) if granularity == "tensor" else (k_cache.shape[2],)
        check_tensor(name, scale)
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {_dtype_name(scale.dtype)}; scales must be float32 (call .float() on it)")
        if tuple(scale.shape) != shape and not (granularity == "tensor" and scale.dim() == 0):
            raise ValueError(f"{name} has shape {tuple(scale.shape)}; a per-{granularity} scale has shape {shape}")
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device} but k_cache is on {k_cache.device}: move it to the "
                             "cache's device")


def check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, interpreted,
                         k_scale=None, v_scale=None) -> None:
    """Shapes, dtypes and devices of ``flash_attn_with_kvcache``'s tensors, and that what an
    append writes does not overlap (no data is read)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, x)
    check_rank("q", q, 4, "[batch, seqlen_q, heads, head_dim]")
    batch = q.shape[0]
    if block_table is not None:
        check_block_table(block_table, batch)
    check_kv_cache_pair(q, k_cache, v_cache, block_table)
    check_new_kv(q, k, v, k_cache)
    check_int32_vector("cache_seqlens", cache_seqlens, batch, "one length per sequence of q")

    floats = [("q", q)]
    if k is not None:
        floats += [("k", k), ("v", v)]
    for name, x in floats:
        check_dtype(name, x)
    check_same_dtype(floats)
    caches = [("k_cache", k_cache), ("v_cache", v_cache)]
    quantized = check_cache_dtypes(q, k_cache, v_cache)
    indices = [("cache_seqlens", cache_seqlens)]
    if block_table is not None:
        indices.append(("block_table", block_table))
    check_same_device(floats + caches + indices)
    check_kv_scales(k_scale, v_scale, k_cache, quantized)
    check_device("q", q, interpreted)
    check_head_dim("q", q.shape[3])
    for name, x in floats + caches:  # the caches' two checks: check_cache_extent's
        check_last_dim_contiguous(name, x)
    if k is not None and not torch.compiler.is_compiling():  # a trace's tensors have no addresses
        check_written_apart(written_by_append(k_cache, v_cache, k_scale, v_scale))


def written_by_append(k_cache, v_cache, k_scale, v_scale) -> list:
    """``(name, tensor)`` of what an append writes in place: the caches, and per-token scales
    (validated tensors: scales of the other granularities are only read)."""
    written = [("k_cache", k_cache), ("v_cache", v_cache)]
    if k_scale is not None and scale_granularity(k_scale) == "token":
        written += [("k_scale", k_scale), ("v_scale", v_scale)]
    return written


def check_written_apart(written) -> None:
    """Tensors a call writes in place (``(name, tensor)``, validated) must each have one element
    per address and share no memory: not one start address, and for two contiguous tensors no
    common byte. Views that interleave in one buffer (K and V halves of a ``[..., 2, H, D]``
    pool) are not refused: their elements are apart, which only a per-element test would show.
    Tensors of other types (a trace's fake or functional tensors) have no addresses: skipped."""
    present = [(name, x) for name, x in written if type(x) is torch.Tensor and x.numel()]
    for name, x in present:
        if not x.is_contiguous() and torch._debug_has_internal_overlap(x) == 1:
            raise ValueError(f"{name} has strides {x.stride()}: several of its elements share an address (an expanded "
                             "tensor?), and the append writes it in place: pass a tensor with one element per address "
                             "(.contiguous() makes one)")
    for i, (name, x) in enumerate(present):
        for other, y in present[i + 1:]:
            if _share_memory(x, y):
                hint = (" (per-token scales: torch.zeros_like for each, and each layer its own)" if "scale" in name
                        else "")
                raise ValueError(f"{name} and {other} share memory, and the append writes both in place: give each "
                                 f"its own tensor{hint}")


def _share_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` start at one address, or are both contiguous with a common byte."""
    x_start, y_start = x.data_ptr(), y.data_ptr()
    if x_start == y_start:
        return True
    if not (x.is_contiguous() and y.is_contiguous()):
        return False
    return x_start < y_start + y.numel() * y.element_size() and y_start < x_start + x.numel() * x.element_size()


def check_cache_capacity(seqlen_new: int, appending: bool, capacity: int, block_table) -> None:
    """Shape-only capacity check: the new tokens alone must fit."""
    if appending and seqlen_new > capacity:
        where = "max_blocks * page_size" if block_table is not None else "k_cache.shape[1]"
        raise ValueError(
            f"k has {seqlen_new} new tokens per sequence but the cache holds at most {capacity} "
            f"tokens per sequence ({where})"
        )


def check_cache_leftpad(cache_leftpad, q) -> None:
    """None, or int32 ``[batch]`` on q's device (values are read only by :func:`check_kvcache_values`)."""
    if cache_leftpad is None:
        return
    check_int32_vector("cache_leftpad", cache_leftpad, q.shape[0], "the first cache position of each sequence")
    if cache_leftpad.device != q.device:
        raise ValueError(f"cache_leftpad is on {cache_leftpad.device} but q is on {q.device}: move it to q's device")


def check_kvcache_values(
    cache_seqlens, block_table, appended: int, capacity: int, num_blocks: int, page_size: int,
    cache_leftpad=None,
) -> None:
    """Lengths, key starts and block-table entries. Reads tensor data: a device->host copy on GPU.

    Every sequence needs ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + appended <= capacity``;
    with ``cache_leftpad``, ``0 <= cache_leftpad[b] <= cache_seqlens[b] + appended``; with a block
    table, the entries of the pages it uses (``ceil(length / page_size)`` per row) must lie in
    ``[0, num_blocks)``.
    """
    seqlens = cache_seqlens.detach().to("cpu", torch.int64)
    negative = (seqlens < 0).nonzero()
    if negative.numel():
        b = int(negative[0, 0])
        raise ValueError(f"cache_seqlens[{b}] = {int(seqlens[b])} is negative")
    lengths = seqlens + appended
    over = (lengths > capacity).nonzero()
    if over.numel():
        b = int(over[0, 0])
        where = "max_blocks * page_size" if block_table is not None else "k_cache.shape[1]"
        plus = f" plus {appended} new tokens" if appended else ""
        raise ValueError(
            f"cache_seqlens[{b}] = {int(seqlens[b])}{plus} exceeds the cache capacity of "
            f"{capacity} tokens per sequence ({where})"
        )
    if cache_leftpad is not None:
        starts = cache_leftpad.detach().to("cpu", torch.int64)
        bad = ((starts < 0) | (starts > lengths)).nonzero()
        if bad.numel():
            b = int(bad[0, 0])
            raise ValueError(
                f"cache_leftpad[{b}] = {int(starts[b])} lies outside [0, {int(lengths[b])}]: a sequence's keys "
                "start at or after position 0 and at or before its length")
    if block_table is None:
        return
    table = block_table.detach().to("cpu", torch.int64)
    pages_used = (lengths + page_size - 1) // page_size
    used = torch.arange(table.shape[1])[None, :] < pages_used[:, None]
    bad = (used & ((table < 0) | (table >= num_blocks))).nonzero()
    if bad.numel():
        b, i = int(bad[0, 0]), int(bad[0, 1])
        hint = (f" (with the {appended} token(s) appended: give the new tokens their pages first, as "
                "KVCache.reserve does)" if appended else "")
        raise ValueError(
            f"block_table[{b}, {i}] = {int(table[b, i])} points outside the page pool of "
            f"{num_blocks} blocks (k_cache.shape[0]); sequence {b} uses its first "
            f"{int(pages_used[b])} entries{hint}"
        )


# --- attention variants (window, softcap, ALiBi, sinks) ---------------------------------------


def check_window_size(window_size) -> tuple[int, int]:
    """``(left, right)``: each an int, -1 (unbounded) or >= 0. Returns it as a tuple of ints."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(
            f"window_size must be a pair (left, right) of ints, -1 meaning unbounded; got "
            f"{type_name(window_size)} {window_size!r}"
        )
    for side, value in zip(("left", "right"), window_size):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"window_size {side} must be an int, got {type_name(value)} {value!r}"
            )
        if value < -1:
            raise ValueError(
                f"window_size {side} is {value}; each side must be -1 (unbounded) or a number of "
                "keys >= 0"
            )
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    """A finite real ``>= 0``; 0 turns the cap off."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type_name(softcap)} {softcap!r}")
    value = float(softcap)
    if not 0 <= value < math.inf:  # comparisons, not math.isfinite: torch.compile traces them
        raise ValueError(f"softcap must be finite and >= 0 (0 turns it off), got {softcap!r}")
    return value


def _check_float32_param(name: str, x, shapes: list[tuple[int, ...]], what: str, q,
                         dtypes=(torch.float32,)) -> None:
    check_tensor(name, x)
    if x.dtype not in dtypes:
        accepted = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(
            f"{name} has dtype {_dtype_name(x.dtype)}; it must be {accepted} (call .float() on it)"
        )
    if tuple(x.shape) not in shapes:
        accepted = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {accepted} ({what}), got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}: move it to q's device")


def check_alibi_slopes(alibi_slopes, batch: int, num_heads: int, q) -> None:
    """None, or float32 ``[num_heads]`` / ``[batch, num_heads]`` on q's device (values unread)."""
    if alibi_slopes is not None:
        _check_float32_param("alibi_slopes", alibi_slopes, [(num_heads,), (batch, num_heads)],
                             "one slope per query head, or per sequence and query head", q)


def check_sinks(sinks, num_heads: int, q) -> None:
    """None, or ``[num_heads]`` float32 / float16 / bfloat16 on q's device (read as float32;
    values unread here; -inf means no sink)."""
    if sinks is not None:
        _check_float32_param("sinks", sinks, [(num_heads,)], "one logit per query head", q,
                             dtypes=(torch.float32, torch.float16, torch.bfloat16))


NO_WINDOW = (-1, -1)  # the default window_size of the public functions


def check_variant(q, batch: int, num_heads: int, window_size, softcap, alibi_slopes, sinks):
    """All variant arguments of one call; returns the normalized ``(window_size, softcap)``."""
    if (window_size is NO_WINDOW and type(softcap) is float and softcap == 0.0
            and alibi_slopes is None and sinks is None):
        return NO_WINDOW, 0.0  # the defaults: nothing to check (a decode step's hot path)
    window = check_window_size(window_size)
    cap = check_softcap(softcap)
    check_alibi_slopes(alibi_slopes, batch, num_heads, q)
    check_sinks(sinks, num_heads, q)
    return window, cap


# --- flash_attn_varlen_func --------------------------------------------------------------------


def check_max_seqlen(name: str, value) -> int:
    if isinstance(value, torch.SymInt):  # traced with dynamic shapes: checked when it is concrete
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(value)} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_cu_seqlens(name: str, x) -> None:
    check_tensor(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {_dtype_name(x.dtype)}; it must be int32 (call .int() on it)")
    if x.dim() != 1 or x.shape[0] < 1:
        raise ValueError(
            f"{name} must be 1-D of length batch + 1 (cumulative sequence lengths starting at 0), "
            f"got shape {tuple(x.shape)}"
        )
    if x.shape[0] > 1 and x.stride(0) != 1:
        raise ValueError(
            f"{name} has stride {x.stride(0)}; it must be contiguous (call .contiguous() on it)"
        )


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        interpreted: bool) -> tuple[int, int]:
    """Shapes, dtypes and devices of packed ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``.

    Returns ``(max_seqlen_q, max_seqlen_k)`` as ints. No tensor data is read.
    """
    named = (("q", q), ("k", k), ("v", v))
    for name, x in named:
        check_tensor(name, x)
    for name, x in named:
        check_rank(name, x, 3, "[total_tokens, heads, head_dim]")
    for name, x in named:
        check_dtype(name, x)
    check_same_dtype(named)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries and cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0]}: both must have batch + 1"
        )
    check_same_device(named + (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    check_device("q", q, interpreted)
    head_dim = q.shape[2]
    for name, x in (("k", k), ("v", v)):
        if x.shape[2] != head_dim:
            raise ValueError(
                f"{name} has head_dim {x.shape[2]} but q has head_dim {head_dim}: "
                "q, k and v must share one head_dim"
            )
    if k.shape != v.shape:
        raise ValueError(
            f"k has shape {tuple(k.shape)} and v has shape {tuple(v.shape)}: k and v must "
            "have the same number of tokens and heads"
        )
    check_head_dim("q", head_dim)
    check_kv_heads(q.shape[1], k.shape[1])
    for name, x in named:
        check_last_dim_contiguous(name, x)
    return check_max_seqlen("max_seqlen_q", max_seqlen_q), check_max_seqlen("max_seqlen_k", max_seqlen_k)


def check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                        max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Offsets start at 0, never decrease, end at the number of tokens, and no sequence is
    longer than its ``max_seqlen``. Reads tensor data: a device->host copy on GPU."""
    for name, cu, total, max_name, max_len, tensor in (
        ("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q, "q"),
        ("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k, "k"),
    ):
        offsets = cu.detach().to("cpu", torch.int64)
        if int(offsets[0]) != 0:
            raise ValueError(f"{name}[0] = {int(offsets[0])}; cumulative lengths must start at 0")
        lengths = offsets[1:] - offsets[:-1]
        shrinking = (lengths < 0).nonzero()
        if shrinking.numel():
            b = int(shrinking[0, 0])
            raise ValueError(
                f"{name} decreases: {name}[{b + 1}] = {int(offsets[b + 1])} < {name}[{b}] = "
                f"{int(offsets[b])}; cumulative lengths must not decrease"
            )
        if int(offsets[-1]) != total:
            raise ValueError(
                f"{name}[-1] = {int(offsets[-1])} but {tensor} has {total} tokens: the last "
                "cumulative length must equal the number of packed tokens"
            )
        if lengths.numel() and int(lengths.max()) > max_len:
            b = int(lengths.argmax())
            raise ValueError(
                f"sequence {b} has {int(lengths[b])} tokens ({name}) but {max_name} = {max_len}: "
                f"{max_name} must be at least the longest sequence"
            )
