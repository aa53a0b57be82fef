"""Plan once, run per layer: the serving loop's calls without repeated work.

A decode step calls attention once per layer with the same lengths, block table, shapes and
variant; only ``q``, the layer's caches and the new keys/values change. :class:`DecodePlan`
validates everything that is fixed for the step once (including the values of the lengths and
the block table, when asked), and :meth:`DecodePlan.run` takes only the per-layer tensors: the
first run records its launches and later runs replay them with the new tensors' addresses
(``kernels/_launch.py``), after checking that each tensor has the planned layout. ``run(...,
out=)`` writes into the caller's output tensor instead of allocating one per layer.
:class:`VarlenPlan` does the same for packed prefill (``cu_seqlens`` planned once per batch).

A plan is made from the first layer's arguments, exactly as they would be passed to the
function, and checks that every later layer's tensors have the same shapes, strides, dtypes and
device. Example (one decode step of a 32-layer model over a paged cache)::

    plan = DecodePlan(q[0], k_caches[0], v_caches[0], k=k[0], v=v[0], cache_seqlens=seqlens,
                      block_table=block_table)
    for layer in range(32):
        out = plan.run(q[layer], k_caches[layer], v_caches[layer], k=k[layer], v=v[layer])

A plan holds the lengths and block table it was made with (not copies): update them in place
between steps and make a new plan when shapes or variants change. Values written in place are
not checked again (that would read them back from the device every step): keep each length
within the cache's capacity (with the step's new tokens) and every block-table entry that the
lengths reach a page of the pool. Past those, results are unspecified (an append past the
capacity is dropped); a new plan with ``validate=True``, or the function, checks them. Results are bit-identical to
:func:`flashkernel.flash_attn_with_kvcache` / :func:`flashkernel.flash_attn_varlen_func` with
the same arguments.
"""

from __future__ import annotations

import torch

from . import _checks, interface, ops
from .kernels import _native, decode, dispatch
from .kernels._launch import CallCache, LayoutGuard, layout, layouts, stream_capturing

__all__ = ["DecodePlan", "VarlenPlan"]


def _same_layout(name: str, x, expected) -> bool:
    """Raise unless ``x`` has the planned layout ``expected`` (``kernels._launch.layout``) up to its
    address's alignment; returns whether the alignment matches too."""
    if x is None or expected is None:
        if (x is None) != (expected is None):
            raise ValueError(f"{name} was {'given' if expected is not None else 'not given'} when the plan was made: "
                             f"pass it {'again' if expected is not None else 'not at all'}, or make a new plan")
        return True
    _checks.check_tensor(name, x)
    got = layout(x)
    if got[:4] != expected[:4]:
        shape, stride, dtype, device, _ = expected
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, strides {x.stride()}, dtype {x.dtype} on {x.device}; the plan "
            f"was made for shape {tuple(shape)}, strides {stride}, dtype {dtype} on {device}: pass the planned "
            f"layout, or make a new plan for this one (which checks {name} as the function does)")
    return got == expected


def _extent(x: torch.Tensor) -> int:
    """Bytes from ``x``'s address to one past its last element (non-negative strides)."""
    if x.numel() == 0:
        return 0
    return (1 + sum([(size - 1) * stride for size, stride in zip(x.shape, x.stride())])) * x.element_size()


class _Plan:
    """Shared run machinery: per-layer tensors checked against the planned layouts, the first
    run recorded, later runs replayed (into the caller's ``out`` when given)."""

    def __init__(self, names, examples):
        self._names = names
        self._layouts = tuple(layout(x) for x in examples)
        self._extents = tuple(None if x is None else _extent(x) for x in examples)
        self._kept_spans = ()
        self._key = layouts(examples)
        self._calls = CallCache(max_entries=2)  # recorded eagerly and under CUDA-graph capture
        # The per-run check in one C++ call where it can stand in for comparing layouts (run's
        # fast path), by inference mode (LayoutGuard); the same for ``out``, made from the first
        # output a replay wrote directly.
        self._guards = {torch.is_inference_mode_enabled(): LayoutGuard.make(examples)} if examples[0].is_cuda else {}
        self._out_guards = {}
        self._out_bytes = examples[0].numel() * examples[0].element_size()
        self._run_name = type(self).__name__ + ".run"
        # [inference mode][capturing]: (the replay's C state, its guard's C form, the same checking
        # ``out`` or None) where the C launcher runs them, as its plan_run reads them (_native_run),
        # and that function once a run has filed one (runs with sinks that want a gradient: never)
        self._fast_runs = [[None, None], [None, None]]
        self._fast = None

    _HINT = ""  # ends the message that refuses a gradient

    def _check_written(self, tensors) -> None:
        """Raise when what a run writes in place overlaps (tensors of the planned layouts)."""

    def _refuse_grad(self, tensors, sinks=None, where: str = ".run") -> None:
        """Raise when a gradient is wanted through this plan (its runs record no backward): for
        ``tensors`` (named as the planned ones) or, given, the ``sinks`` it keeps."""
        what = type(self).__name__ + where
        if sinks is not None:
            ops.refuse_grad((("sinks", sinks),), what, self._HINT)
        ops.refuse_grad(zip(self._names, tensors), what, self._HINT)

    def _check_run(self, tensors) -> None:
        """What every run checks, fast path included: no forward-mode tangent, and no gradient
        wanted for sinks kept by a plan made without gradients (the replay guard checks only the
        run's own tensors)."""
        ops.check_differentiation_modes(tensors, self._run_name)
        if self._sinks_want_grad:
            self._refuse_grad((), self._fixed[-1])

    def _keep_sinks(self, sinks) -> None:
        """Refuse sinks that want a gradient now; note whether they do for the runs (a plan made
        under ``torch.no_grad()`` may run with gradients on)."""
        self._refuse_grad((), sinks, where="")
        self._sinks_want_grad = sinks is not None and sinks.requires_grad

    def _keep(self, names, tensors) -> None:
        """Note the tensors the plan holds for every run (lengths, tables, slopes, sinks): their
        addresses do not change, so their byte spans are computed once, for the check of ``out``."""
        self._kept_spans = tuple((name, x.data_ptr(), _extent(x))
                                 for name, x in zip(names, tensors) if x is not None and x.numel())

    def _check_out(self, out, tensors) -> bool:
        """Raise unless ``out`` can take the output of a run on ``tensors`` (of the planned
        layouts): q's shape, dtype and device, no gradient wanted, one element per address, and no
        byte range shared with an input or a tensor the plan holds (by address ranges: views that
        interleave in one buffer count as overlapping). Returns whether a replay can write it
        directly (contiguous and 16-byte aligned, as the recorded output)."""
        q = tensors[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out has shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}; the output has "
                             f"shape {tuple(q.shape)}, dtype {q.dtype} on {q.device} (q's): pass such a tensor")
        if out.requires_grad and torch.is_grad_enabled():
            raise ValueError("out requires grad, and a plan's run has no backward: pass a tensor that does not, "
                             "or run under torch.no_grad()")
        contiguous = out.is_contiguous()
        if not contiguous and torch._debug_has_internal_overlap(out) == 1:
            raise ValueError(f"out has strides {out.stride()}: several of its elements share an address (an "
                             "expanded tensor?); pass a tensor with one element per address")
        start = out.data_ptr()
        end = start + (out.numel() * out.element_size() if contiguous else _extent(out))
        name = self._overlapped(start, end, [None if x is None else x.data_ptr() for x in tensors])
        if name is not None:
            raise ValueError(f"out overlaps {name}: pass an output that shares no memory with the inputs")
        direct = contiguous and start % 16 == 0
        if direct and out.is_cuda and torch.is_inference_mode_enabled() not in self._out_guards:
            self._out_guards[torch.is_inference_mode_enabled()] = LayoutGuard.make((out,))
        return direct

    def _overlapped(self, start: int, end: int, addresses) -> str | None:
        """The name of an input (at ``addresses``) or kept tensor with a byte in ``[start, end)``."""
        for name, x_start, extent in zip(self._names, addresses, self._extents):
            if x_start is not None and extent and x_start < end and start < x_start + extent:
                return name
        for name, x_start, extent in self._kept_spans:
            if x_start < end and start < x_start + extent:
                return name
        return None

    def _replayed(self, tensors, fixed, out):
        """The fast path of a run: the results of the recorded launches when the guards vouch for
        ``tensors`` (and for ``out``, which then shares no byte with them); None when the caller
        must take :meth:`_run`'s path (which raises what is wrong, if anything is). Files what
        the C launcher's ``plan_run`` needs for this inference mode and capture state."""
        if torch.compiler.is_compiling():
            return None
        mode = torch.is_inference_mode_enabled()
        guard = self._guards.get(mode)
        if guard is None:  # the CPU, or no guard can be made
            return None
        capturing = stream_capturing()
        replay = self._calls.get(capturing)
        if replay is None:
            return None
        native = self._native_run(mode, capturing, replay, guard, out is not None)
        if out is None:
            if native is not None:
                return replay.run_checked(native[1], tensors, fixed, capturing)
            return guard.run(replay, tensors, fixed, capturing)
        if native is not None and native[2] is not None:
            results = replay.run_checked(native[2], tensors, fixed, capturing, out=out)
            if results is not None:  # written in place: marked as copy_ would have marked it
                torch.autograd.graph.increment_version(out)
            return results
        out_guard = self._out_guards.get(mode)
        if out_guard is None:
            return None
        addresses = guard.addresses(tensors)
        out_address = None if addresses is None else out_guard.addresses((out,))
        if out_address is None or self._overlapped(out_address[0], out_address[0] + self._out_bytes,
                                                   addresses) is not None:
            return None
        addresses += [None if x is None else x.data_ptr() for x in fixed]
        results = replay.run((*tensors, *fixed), reuse_scratch=True, outputs=(out,), addresses=addresses,
                             capturing=capturing)
        torch.autograd.graph.increment_version(out)  # written in place, as copy_ would have marked it
        return results

    def _native_run(self, mode: bool, capturing: bool, replay, guard, with_out: bool):
        """``(replay's C state, its guard's C form, the C form that also checks ``out`` as
        _check_out does or None)`` for runs in ``mode`` and ``capturing`` through the C launcher,
        filed in ``_fast_runs`` for its ``plan_run`` (the output's form once ``out``'s guard
        exists); None where the replay or the guard has no C form."""
        entry = replay._entry if replay._entry is not None else replay._native_entry()
        if not entry:
            return None
        filed = self._fast_runs[mode][capturing]
        if filed is None or filed[0] is not entry[1]:  # none yet, or made for another replay
            guard_native = guard.native()
            if guard_native is None:
                return None
            filed = (entry[1], guard_native, None)
        out_guard = self._out_guards.get(mode)
        if with_out and filed[2] is None and out_guard is not None:
            spans = tuple((start, size) for _, start, size in self._kept_spans)
            out_native = guard.native_form((out_guard, self._out_bytes, self._extents, spans))
            if out_native is not None:
                filed = (filed[0], filed[1], out_native)
        if filed is not self._fast_runs[mode][capturing]:
            self._fast_runs[mode][capturing] = filed
            if self._fast is None and not self._sinks_want_grad:
                self._fast = _native.checking_module().plan_run
        return filed

    def _run(self, tensors, fixed, call, out=None):
        inputs = tuple(tensors) + tuple(fixed)
        try:
            planned = layouts(tensors) == self._key
        except (AttributeError, TypeError):  # not a tensor: _same_layout names it
            planned = False
        if not planned:
            for name, x, expected in zip(self._names, tensors, self._layouts):
                _same_layout(name, x, expected)  # raises for another shape, strides, dtype or device
            self._check_written(tensors)  # other tensors may share memory where the planned ones did not
        direct = out is None or self._check_out(out, tensors)
        if not (planned and direct and tensors[0].is_cuda) or torch.compiler.is_compiling():
            # Another alignment or shared addresses, an output the replay cannot write, the CPU,
            # or a trace: the full path.
            return _into(out, call())
        # Capture is part of the key, as for every recorded call: dispatch may choose other
        # launches under capture (e.g. a split step's merge, kernels/decode.py merges_in_kernel).
        if torch.is_inference_mode_enabled() not in self._guards:  # the plan was made in the other mode
            self._guards[torch.is_inference_mode_enabled()] = LayoutGuard.make(tensors)
        capturing = stream_capturing()
        replay = self._calls.get(capturing)
        if replay is None:
            return _into(out, self._calls.run(capturing, inputs, call))
        if out is None:
            return replay.run(inputs, reuse_scratch=True)
        results = replay.run(inputs, reuse_scratch=True, outputs=(out,))
        torch.autograd.graph.increment_version(out)  # written in place, as copy_ would have marked it
        return results


def _into(out, results):
    """``results`` with the output copied into ``out`` (when given)."""
    if out is None:
        return results
    out.copy_(results[0])
    return (out, *results[1:])


class DecodePlan(_Plan):
    """One decode step's fixed part, made from the first layer's arguments; :meth:`run` per layer.

    The arguments are those of ``flash_attn_with_kvcache`` for one layer. ``cache_seqlens``,
    ``block_table``, ``cache_leftpad``, ``alibi_slopes`` and ``sinks`` are kept (not copied: update
    them in place between steps); the values of the lengths, block table and key starts are
    checked now with ``validate=True`` (one device-to-host copy per plan), or when they are on the
    CPU with ``validate=None``, and not at each run: keep each length within the cache's capacity
    (with the step's new tokens) and every block-table entry the lengths reach a page of the pool
    (``flashkernel.plans``' docstring says more). ``q``, ``k_cache``, ``v_cache``, ``k``, ``v``
    and a quantized cache's ``k_scale``, ``v_scale`` are examples: each :meth:`run` takes its
    layer's, which must have the same shapes, strides, dtypes and device (per-token scales: each
    layer its own, as the append writes them).
    """

    def __init__(self, q, k_cache, v_cache, *, k=None, v=None, cache_seqlens, block_table=None,
                 cache_leftpad=None, k_scale=None, v_scale=None, causal: bool = True, softmax_scale=None,
                 window_size=_checks.NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None, num_splits: int = 0,
                 return_lse: bool = False, validate: bool | None = None, backend: str = "auto"):
        scale = interface._validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                                            causal, softmax_scale, num_splits, return_lse, validate, k_scale,
                                            v_scale)
        window, cap = _checks.check_variant(q, q.shape[0], q.shape[2], window_size, softcap, alibi_slopes, sinks)
        dispatch.check_backend(backend)
        super().__init__(("q", "k_cache", "v_cache", "k", "v", "k_scale", "v_scale"),
                         (q, k_cache, v_cache, k, v, k_scale, v_scale))
        self.empty = q.numel() == 0 or decode.CacheGeometry.of(k_cache, block_table).capacity == 0
        self._keep_sinks(sinks)
        self._fixed = (cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks)
        self._keep(("cache_seqlens", "block_table", "cache_leftpad", "alibi_slopes", "sinks"), self._fixed)
        self._scalars = (causal, scale, *window, cap, num_splits, return_lse, backend)
        self.return_lse = return_lse

    def _check_written(self, tensors) -> None:
        q, k_cache, v_cache, k, v, k_scale, v_scale = tensors
        if k is not None:
            _checks.check_written_apart(_checks.written_by_append(k_cache, v_cache, k_scale, v_scale))

    def run(self, q, k_cache, v_cache, k=None, v=None, k_scale=None, v_scale=None, *, out=None):
        """Attention for one layer (appending ``k, v`` when the plan was made with them; a
        quantized cache with its layer's scales). Returns ``out`` (and ``lse`` with
        ``return_lse=True``) as ``flash_attn_with_kvcache`` does.

        ``out``: a tensor of ``q``'s shape, dtype and device to write the output into (saves an
        allocation per layer; contiguous is fastest), not overlapping the inputs; it is returned.
        """
        tensors = (q, k_cache, v_cache, k, v, k_scale, v_scale)
        if self._fast is not None and not torch.compiler.is_compiling():
            results = self._fast(self._fast_runs, tensors, self._fixed, out)  # the whole run in one C call
            if results is not None and results is not NotImplemented:
                return results if self.return_lse else results[0]
        self._check_run(tensors)
        if self.empty:
            self._refuse_grad(tensors)
            if out is not None:
                self._check_out(out, tensors)
            results = _into(out, interface._empty_results(q, self.return_lse, self._fixed[-1]))
        else:
            results = self._replayed(tensors, self._fixed, out)
            if results is None:
                self._refuse_grad(tensors)
                results = self._run(tensors, self._fixed, lambda: ops.kvcache_fwd_impl(
                    q, k_cache, v_cache, k, v, *self._fixed, k_scale, v_scale, *self._scalars), out)
        return results if self.return_lse else results[0]


class VarlenPlan(_Plan):
    """One packed batch's fixed part, made from the first layer's arguments of
    ``flash_attn_varlen_func``; :meth:`run` per layer.

    ``cu_seqlens_q``, ``cu_seqlens_k``, ``alibi_slopes`` and ``sinks`` are kept (not copied); the
    offsets' values are checked now with ``validate=True`` (or on the CPU with ``None``). ``q``,
    ``k``, ``v`` are examples: each :meth:`run` takes its layer's, of the same layouts.
    """

    _HINT = "; to train, call flash_attn_varlen_func, which has one"

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                 causal: bool = False, softmax_scale=None, window_size=_checks.NO_WINDOW, softcap=0.0,
                 alibi_slopes=None, sinks=None, return_lse: bool = False, validate: bool | None = None,
                 backend: str = "auto"):
        max_q, max_k = _checks.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   interface.kernels_interpreted())
        for name, flag in (("causal", causal), ("return_lse", return_lse)):
            _checks.check_flag(name, flag)
        _checks.check_optional_flag("validate", validate)
        scale = _checks.resolve_softmax_scale(softmax_scale, q.shape[-1])
        batch = cu_seqlens_q.shape[0] - 1
        window, cap = _checks.check_variant(q, batch, q.shape[1], window_size, softcap, alibi_slopes, sinks)
        dispatch.check_backend(backend)
        if interface._check_values(validate, cu_seqlens_q):
            _checks.check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_q, max_k)
        super().__init__(("q", "k", "v"), (q, k, v))
        self.empty = batch == 0 or q.shape[0] == 0 or k.shape[0] == 0 or max_q == 0
        self._keep_sinks(sinks)
        self._fixed = (cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
        self._keep(("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "sinks"), self._fixed)
        self._args = (cu_seqlens_q, cu_seqlens_k, max_q, max_k, alibi_slopes, sinks, causal, scale, *window, cap,
                      return_lse, backend)
        self.return_lse = return_lse

    def run(self, q, k, v, *, out=None):
        """Attention for one layer: ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]``; ``out``
        as in :meth:`DecodePlan.run`."""
        if self._fast is not None and not torch.compiler.is_compiling():
            results = self._fast(self._fast_runs, (q, k, v), self._fixed, out)  # the whole run in one C call
            if results is not None and results is not NotImplemented:
                return results if self.return_lse else results[0]
        self._check_run((q, k, v))
        if self.empty:
            self._refuse_grad((q, k, v))
            if out is not None:
                self._check_out(out, (q, k, v))
            results = _into(out, interface._empty_results(q, self.return_lse, self._fixed[-1]))
        else:
            results = self._replayed((q, k, v), self._fixed, out)
            if results is None:
                self._refuse_grad((q, k, v))
                results = self._run((q, k, v), self._fixed, lambda: ops.varlen_fwd_impl(q, k, v, *self._args), out)
        return results if self.return_lse else results[0]
