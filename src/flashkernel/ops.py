"""The op layer: flashkernel's entry points as ``torch.library`` custom operators.

Each public function of ``interface.py`` validates its arguments, then runs one of these ops:

* ``flashkernel::fwd`` (``flash_attn_func``),
* ``flashkernel::varlen_fwd`` (``flash_attn_varlen_func``),
* ``flashkernel::kvcache_fwd`` (``flash_attn_with_kvcache``; it writes the new keys and values
  into ``k_cache`` and ``v_cache`` in place, and into a quantized cache's per-token
  ``k_scale``/``v_scale`` their scales, declared as mutations of those four arguments).

Each op has a fake (meta) implementation, so ``torch.compile`` traces a model through it
without a graph break and Inductor treats the call as opaque (it never recompiles our Triton
kernels), ``torch.library.opcheck`` can test it, and dynamic shapes need no recompile per
length. Every op returns ``(out, lse)``; ``lse`` is an empty tensor when it was not asked for.

The autograd boundary is here too: ``fwd`` and ``varlen_fwd`` have a backward
(``flashkernel::bwd``, the kernels of ``kernels/backward.py``: gradients for q, k, v, the sinks
and the returned LSE, recomputing the attention matrix from the saved LSE), registered with
``torch.library.register_autograd``, so ``torch.compile`` traces training steps through it too.
Their last argument is the public functions' ``deterministic``: the forward ignores it, the
backward passes it on (``bwd`` adds PyTorch's global flag to it).
The cache op and ``standard_attention`` have none (decode is inference only): a call whose
inputs require grad raises a clear error rather than returning an output with no gradient
(:func:`check_no_grad`).

Host time: an op's real implementation records the launches of its first call per argument
layout and replays them for later calls of the same layout (``kernels/_launch.py``), so calls
from a compiled graph cost little host time too. The public functions call
:func:`fwd_impl` & co. directly in eager mode when no gradient is needed (no dispatcher in the
way), and go through ``torch.ops.flashkernel`` when compiling or differentiating.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd import forward_ad

from .kernels import dispatch
from .kernels._launch import CallCache, allocate, layouts, stream_capturing

__all__ = ["fwd_impl", "varlen_fwd_impl", "kvcache_fwd_impl", "check_no_grad"]

_EMPTY_LSE_SHAPE = (0,)


def _lse(want: bool, shape, device) -> torch.Tensor | None:
    return allocate(shape, torch.float32, device) if want else None


def _with_empty_lse(results):
    """An op's ``(out, lse)``: ``lse`` an empty tensor when it was not asked for (ops return
    tensors; the implementations return None there, which costs no allocation)."""
    out, lse = results
    return out, lse if lse is not None else out.new_empty(_EMPTY_LSE_SHAPE, dtype=torch.float32)


def on_device(x: torch.Tensor):
    """Triton launches on the current CUDA device and stream: make the device ``x``'s for the
    launches (sets a device index; no synchronisation, so CUDA-graph capture is unaffected)."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


# ---- real implementations (validated inputs; outputs allocated here) ------------------------------


def fwd_impl(q, k, v, alibi_slopes, sinks, causal: bool, softmax_scale: float, window_left: int,
             window_right: int, softcap: float, return_lse: bool, backend: str):
    """``flash_attn_func`` after validation: ``(out [B, Sq, Hq, D], lse [B, Hq, Sq] or None)``."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    out = allocate((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
    lse = _lse(return_lse, (batch, num_heads, seqlen_q), q.device)
    with on_device(q):
        dispatch.prefill(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                         window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                         sinks=sinks, backend=backend)
    return out, lse


def varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, alibi_slopes, sinks,
                    causal: bool, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                    return_lse: bool, backend: str):
    """``flash_attn_varlen_func`` after validation: ``(out [total_q, Hq, D], lse [Hq, total_q] or None)``."""
    total_q, num_heads, head_dim = q.shape
    out = allocate((total_q, num_heads, head_dim), q.dtype, q.device)
    lse = _lse(return_lse, (num_heads, total_q), q.device)
    with on_device(q):
        dispatch.prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, causal=causal, softmax_scale=softmax_scale,
                                window_size=(window_left, window_right), softcap=softcap,
                                alibi_slopes=alibi_slopes, sinks=sinks, backend=backend)
    return out, lse


def kvcache_fwd_impl(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                     k_scale, v_scale, causal: bool, softmax_scale: float, window_left: int, window_right: int,
                     softcap: float, num_splits: int, return_lse: bool, backend: str):
    """``flash_attn_with_kvcache`` after validation (appends ``k, v`` in place when given, and
    their scales to per-token ``k_scale``/``v_scale``): ``(out [B, T, Hq, D], lse [B, Hq, T] or
    None)``."""
    batch, seqlen_q, num_heads, head_dim = q.shape
    out = allocate((batch, seqlen_q, num_heads, head_dim), q.dtype, q.device)
    lse = _lse(return_lse, (batch, num_heads, seqlen_q), q.device)
    with on_device(q):
        dispatch.decode(q, k_cache, v_cache, cache_seqlens, block_table, out, lse,
                        k_new=k, v_new=v, cache_leftpad=cache_leftpad, causal=causal, softmax_scale=softmax_scale,
                        num_splits=num_splits, window_size=(window_left, window_right), softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale, backend=backend)
    return out, lse


# ---- the registered ops: replayed launches per argument layout ---------------------------------

_OP_CALLS = CallCache()


_KEEPS_TEMPORARIES = frozenset({"kvcache_fwd"})  # ops whose replays keep temporaries per stream: _cached


def _cached(name: str, tensors: tuple, scalars: tuple, run):
    """``run()`` (the op's implementation on ``tensors`` and ``scalars``) through the op-level
    call cache: replayed when a call of the same layouts and scalars ran before (CUDA only).

    A recent call of the same scalars is found by its guard (``CallCache.quick``: one C++ check
    of the layouts) before the key is built. The cache op's replays keep their temporaries (the
    split-KV partials and merge counters, small) per stream as eager calls do: a compiled model
    pays their allocation per layer otherwise. A compiled model's calls may run while
    ``torch.compile``'s CUDA graphs route this thread's allocations to their own pool, which must
    hold no buffer of ours afterwards; kept temporaries are made on another thread
    (``_launch.allocated_off_thread``). The other ops' replays keep none: the backward's
    temporaries are large (float32 dQ accumulators), and a replay is kept per shape."""
    if not tensors[0].is_cuda:
        return run()
    capturing = stream_capturing()
    types = tuple(map(type, scalars))
    probe = (name, scalars, types, capturing)
    keep = name in _KEEPS_TEMPORARIES
    results = _OP_CALLS.quick(probe, tensors, capturing, reuse_scratch=keep)
    if results is not None:
        return results
    key = (name, layouts(tensors), scalars, types, capturing)
    replay = _OP_CALLS.get_noted(key, probe, tensors)
    if replay is not None:
        return replay.run(tensors, reuse_scratch=keep, capturing=capturing)
    return _OP_CALLS.run(key, tensors, run, probe=probe)


@torch.library.custom_op("flashkernel::fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi_slopes: torch.Tensor | None,
            sinks: torch.Tensor | None, causal: bool, softmax_scale: float, window_left: int, window_right: int,
            softcap: float, return_lse: bool, backend: str,
            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scalars = (causal, softmax_scale, window_left, window_right, softcap, return_lse, backend)
    return _with_empty_lse(_cached("fwd", (q, k, v, alibi_slopes, sinks), scalars,
                                   lambda: fwd_impl(q, k, v, alibi_slopes, sinks, *scalars)))


@_fwd_op.register_fake
def _fwd_fake(q, k, v, alibi_slopes, sinks, causal, softmax_scale, window_left, window_right, softcap,
              return_lse, backend, deterministic):
    batch, seqlen_q, num_heads, _ = q.shape
    lse_shape = (batch, num_heads, seqlen_q) if return_lse else _EMPTY_LSE_SHAPE
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("flashkernel::varlen_fwd", mutates_args=())
def _varlen_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, causal: bool, softmax_scale: float,
                   window_left: int, window_right: int, softcap: float, return_lse: bool,
                   backend: str, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scalars = (causal, softmax_scale, window_left, window_right, softcap, return_lse, backend)
    return _with_empty_lse(_cached("varlen_fwd", (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks),
                                   (max_seqlen_q, max_seqlen_k) + scalars,
                                   lambda: varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                           max_seqlen_k, alibi_slopes, sinks, *scalars)))


@_varlen_fwd_op.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks,
                     causal, softmax_scale, window_left, window_right, softcap, return_lse, backend,
                     deterministic):
    total_q, num_heads, _ = q.shape
    lse_shape = (num_heads, total_q) if return_lse else _EMPTY_LSE_SHAPE
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


# The cache op is defined with torch.library.Library rather than custom_op: custom_op wraps an op
# that mutates its arguments in a Python kernel that rebinds every argument against the schema to
# bump the version counters of the mutated ones (12x the dispatch of the same schema defined here;
# docs/perf-notes.md, "Compiled decode"), and a compiled model pays that per layer. Here the
# implementation bumps the two counters itself.
_LIBRARY = torch.library.Library("flashkernel", "FRAGMENT")
# The scales are declared mutable because per-token scales are written with the appended tokens
# (per-tensor and per-head scales are only read; the declaration is then conservative).
_LIBRARY.define(
    "kvcache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor cache_seqlens, "
    "Tensor? block_table, Tensor? cache_leftpad, Tensor? alibi_slopes, Tensor? sinks, Tensor(c!)? k_scale, "
    "Tensor(d!)? v_scale, bool causal, float softmax_scale, int window_left, int window_right, float softcap, "
    "int num_splits, bool return_lse, str backend) -> (Tensor, Tensor)")


def _kvcache_fwd_op(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                    k_scale, v_scale, causal, softmax_scale, window_left, window_right, softcap, num_splits,
                    return_lse, backend):
    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks, k_scale,
               v_scale)
    scalars = (causal, softmax_scale, window_left, window_right, softcap, num_splits, return_lse, backend)
    if k is not None:
        written = (k_cache, v_cache, k_scale, v_scale) if k_scale is not None and k_scale.dim() == 3 else (
            k_cache, v_cache)
        torch.autograd.graph.increment_version(written)
    return _with_empty_lse(_cached("kvcache_fwd", tensors, scalars, lambda: kvcache_fwd_impl(*tensors, *scalars)))


for _device_type in ("CPU", "CUDA"):
    _LIBRARY.impl("kvcache_fwd", _kvcache_fwd_op, _device_type)


@torch.library.register_fake("flashkernel::kvcache_fwd", lib=_LIBRARY)
def _kvcache_fwd_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks,
                      k_scale, v_scale, causal, softmax_scale, window_left, window_right, softcap, num_splits,
                      return_lse, backend):
    batch, seqlen_q, num_heads, _ = q.shape
    lse_shape = (batch, num_heads, seqlen_q) if return_lse else _EMPTY_LSE_SHAPE
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


fwd = torch.ops.flashkernel.fwd
varlen_fwd = torch.ops.flashkernel.varlen_fwd
kvcache_fwd = torch.ops.flashkernel.kvcache_fwd


# ---- autograd -----------------------------------------------------------------------------------

_BACKWARD_OPS = {"fwd", "varlen_fwd"}


def bwd_impl(dout, q, k, v, out, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
             max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int, window_right: int,
             softcap: float, dlse, deterministic: bool = False):
    """Gradients ``(dq, dk, dv, dsinks)`` of a forward (dense, or packed with ``cu_seqlens_*``);
    ``dsinks`` is float32 ``[Hq]``, empty without sinks; ``dlse`` the gradient of the returned
    LSE or None. With ``deterministic=True`` or under ``torch.use_deterministic_algorithms(True)``
    the gradients are bitwise reproducible (the Triton kernels, no float atomics)."""
    from .kernels.backward import attention_backward

    varlen = cu_seqlens_q is not None
    _check_backward_shapes(dout, q, out, lse, dlse, varlen)
    dq, dk, dv = (allocate(x.shape, x.dtype, x.device) for x in (q, k, v))
    with on_device(q):
        dsinks = attention_backward(
            dout, q, k, v, out, lse, dq, dk, dv, causal=causal, softmax_scale=softmax_scale,
            window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q if varlen else None,
            max_seqlen_k=max_seqlen_k if varlen else None, dlse=dlse,
            deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
    if dsinks is None:
        dsinks = allocate(_EMPTY_LSE_SHAPE, torch.float32, q.device)
    return dq, dk, dv, dsinks


def _check_backward_shapes(dout, q, out, lse, dlse, varlen: bool) -> None:
    """The backward op's own check of what it reads besides q, k and v (which its forward
    validated): ``dout`` and ``out`` shaped like ``q``, ``lse`` (and ``dlse``) the forward's float32
    LSE, ``[Hq, total_q]`` packed or ``[B, Hq, Sq]``. A call of the op by hand gets a clear error,
    not a read past an LSE the forward did not return."""
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    for name, x, shape in (("dout", dout, q.shape), ("out", out, q.shape), ("lse", lse, lse_shape),
                           ("dlse", dlse, lse_shape)):
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"flashkernel::bwd: {name} has shape {tuple(x.shape)}, expected {tuple(shape)} (from q "
                             f"{tuple(q.shape)}); pass the forward's outputs, its LSE asked for with return_lse=True")
    if lse.dtype != torch.float32:
        raise ValueError(f"flashkernel::bwd: lse has dtype {lse.dtype}, expected torch.float32 (the forward's LSE)")


@torch.library.custom_op("flashkernel::bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
            cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
            causal: bool, softmax_scale: float, window_left: int, window_right: int, softcap: float,
            dlse: torch.Tensor | None,
            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = (dout, q, k, v, out, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, dlse)
    scalars = (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap)
    # Resolved before the replay key: the global flag picks the kernels as the argument does.
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    return _cached("bwd", tensors, (*scalars, deterministic), lambda: bwd_impl(
        dout, q, k, v, out, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, *scalars, dlse, deterministic))


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, out, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, softmax_scale, window_left, window_right, softcap, dlse, deterministic):
    dsinks_shape = (q.shape[-2],) if sinks is not None else _EMPTY_LSE_SHAPE
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty(dsinks_shape,
                                                                                       dtype=torch.float32)


def _contiguous_last(x):
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _setup_fwd(ctx, inputs, output):
    q, k, v, alibi_slopes, sinks, causal, scale, window_left, window_right, softcap, return_lse, backend, \
        deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
    ctx.packed = None
    ctx.scalars = (causal, scale, window_left, window_right, softcap)
    ctx.lse_returned, ctx.backend, ctx.deterministic = return_lse, backend, deterministic
    ctx.set_materialize_grads(False)


def _setup_varlen_fwd(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, causal, scale,
     window_left, window_right, softcap, return_lse, backend, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k)
    ctx.packed = (max_seqlen_q, max_seqlen_k)
    ctx.scalars = (causal, scale, window_left, window_right, softcap)
    ctx.lse_returned, ctx.backend, ctx.deterministic = return_lse, backend, deterministic
    ctx.set_materialize_grads(False)


def _forward_lse(ctx, q, k, v, alibi_slopes, sinks, cu_q, cu_k) -> torch.Tensor:
    """The LSE of a forward that was called without it (an op called directly with
    ``return_lse=False``; the public functions ask for it whenever autograd records the call): the
    forward again, with it."""
    tail = (*ctx.scalars, True, ctx.backend, ctx.deterministic)
    if ctx.packed:
        return torch.ops.flashkernel.varlen_fwd(q, k, v, cu_q, cu_k, *ctx.packed, alibi_slopes, sinks, *tail)[1]
    return torch.ops.flashkernel.fwd(q, k, v, alibi_slopes, sinks, *tail)[1]


def _backward(ctx, dout, dlse):
    """Gradients of ``fwd`` / ``varlen_fwd`` for q, k, v and the sinks (none for ALiBi slopes)."""
    saved = ctx.saved_tensors
    q, k, v, out, lse, alibi_slopes, sinks = saved[:7]
    cu_q, cu_k = saved[7:] if ctx.packed else (None, None)
    max_q, max_k = ctx.packed or (0, 0)
    if dout is None:
        dout = torch.zeros_like(out)
    if not ctx.lse_returned:
        dlse = None  # nothing flows into an LSE that was not returned
        lse = _forward_lse(ctx, q, k, v, alibi_slopes, sinks, cu_q, cu_k)
    dq, dk, dv, dsinks = torch.ops.flashkernel.bwd(
        _contiguous_last(dout), q, k, v, out, lse, alibi_slopes, sinks, cu_q, cu_k, max_q, max_k, *ctx.scalars,
        _contiguous_last(dlse), ctx.deterministic)
    dsinks = dsinks.to(sinks.dtype) if sinks is not None else None
    grads = (dq, dk, dv)
    return (*grads, None, None, None, None, None, dsinks) if ctx.packed else (*grads, None, dsinks)


# The ops' arguments after the sinks: causal, softmax_scale, window_left, window_right, softcap,
# return_lse, backend, deterministic; none gets a gradient.
_TRAILING_SCALARS = 8


def _backward_fwd(ctx, dout, dlse):
    return _backward(ctx, dout, dlse) + (None,) * _TRAILING_SCALARS


def _backward_varlen_fwd(ctx, dout, dlse):
    return _backward(ctx, dout, dlse) + (None,) * _TRAILING_SCALARS


torch.library.register_autograd("flashkernel::fwd", _backward_fwd, setup_context=_setup_fwd)
torch.library.register_autograd("flashkernel::varlen_fwd", _backward_varlen_fwd, setup_context=_setup_varlen_fwd)


def _no_second_order(ctx, *grads):
    raise RuntimeError(
        "flashkernel's attention backward has no backward of its own: second-order gradients through "
        "flash_attn_func / flash_attn_varlen_func (a gradient taken with create_graph=True, then differentiated "
        "again) are not supported; compute those terms with flashkernel.reference.attention (float64, "
        "differentiable to any order) or PyTorch's scaled_dot_product_attention")


# Without a formula of its own, a second backward through bwd failed with PyTorch's note for op authors.
torch.library.register_autograd("flashkernel::bwd", _no_second_order)


class _OutputWithoutKeys(torch.autograd.Function):
    """The output of a differentiable call that launches nothing (no batch, no query row or no
    key): zeros shaped like ``q`` (contiguous), whose gradients for q, k and v are zeros."""

    @staticmethod
    def forward(q, k, v):
        return torch.zeros_like(q, memory_format=torch.contiguous_format)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.inputs = [(x.shape, x.dtype, x.device) for x in inputs]

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs)


def output_without_keys(q, k, v) -> torch.Tensor:
    """Zeros shaped like ``q`` for a call with nothing to compute, recorded by autograd (zero
    gradients for q, k and v) when it would record the call."""
    if needs_grad((q, k, v)):
        return _OutputWithoutKeys.apply(q, k, v)
    return torch.zeros_like(q, memory_format=torch.contiguous_format)


def check_no_grad(op: str, tensors, what: str) -> None:
    """Raise when gradients are wanted through ``op``, which has no backward: better than an
    output that silently has no ``grad_fn``."""
    if op not in _BACKWARD_OPS:
        refuse_grad(tensors, what)


def refuse_grad(tensors, what: str, hint: str = "") -> None:
    """Raise when gradients are wanted through ``what`` (grad mode on, one of the ``(name,
    tensor)`` pairs requiring grad), which records no backward; ``hint`` ends the message."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors:
        if getattr(t, "requires_grad", False):  # None or not a tensor (validation names it): no
            raise RuntimeError(
                f"{what} has no backward, and {name} requires grad: call it under torch.no_grad() or "
                f"torch.inference_mode(), or pass {name}.detach(){hint}")


def check_differentiation_modes(tensors, what: str) -> None:
    """Raise when one of ``tensors`` carries a forward-mode tangent (``torch.func.jvp``,
    ``torch.autograd.forward_ad``): the ops have no forward-mode formula, and PyTorch would
    otherwise return the output with a zero tangent, or none, without a word. Also when one is
    differentiated by torch.func's reverse-mode transforms (``grad``, ``jacrev``, ``vjp``), where
    PyTorch's own error names its internals. Costs one attribute read and one query of functorch's
    level while neither is active."""
    if getattr(forward_ad, "_current_level", 0) >= 0 and _any_tensor(tensors, _has_tangent):
        raise NotImplementedError(
            f"{what} has no forward-mode derivative, and one of its inputs carries a tangent (torch.func.jvp or "
            "torch.autograd.forward_ad): compute the tangent with flashkernel.reference.attention (float64, "
            "differentiable in both modes) or PyTorch's scaled_dot_product_attention")
    if (_functorch_level is not None and _functorch_level() is not None and not torch.compiler.is_compiling()
            and torch.is_grad_enabled() and _any_tensor(tensors, _differentiated_by_functorch)):
        raise NotImplementedError(
            f"{what} does not support torch.func.grad / jacrev / vjp (functorch cannot run the ops' registered "
            "backward): differentiate with torch.autograd (.backward() or torch.autograd.grad) where the function is "
            "differentiable, or use flashkernel.reference.attention (float64) under torch.func")


def _any_tensor(values, test) -> bool:
    return any(isinstance(t, torch.Tensor) and test(t) for t in values)


def _differentiated_by_functorch(t: torch.Tensor) -> bool:
    """A tensor a torch.func grad transform differentiates (wrapped at a level and requiring grad;
    data computed inside the transform is wrapped too, but needs no gradient)."""
    return t.requires_grad and _is_grad_tracking(t)


# functorch's current transform level (None outside every transform) and its test for a tensor
# that a grad transform tracks (absent from builds without functorch).
_functorch_level = getattr(torch._C._functorch, "maybe_current_level", None)
_is_grad_tracking = getattr(torch._C._functorch, "is_gradtrackingtensor", lambda t: False)


def _has_tangent(t: torch.Tensor) -> bool:
    try:
        return forward_ad.unpack_dual(t).tangent is not None
    except RuntimeError:  # a transform inside jvp (vmap) cannot unpack it: it may carry one
        return True


def needs_grad(tensors) -> bool:
    """Whether autograd would record a call on ``tensors`` (grad mode on, an input requiring grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False
