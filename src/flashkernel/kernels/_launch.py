"""Kernel launches with little host time: cached compiled kernels, and recorded launch sequences.

Two mechanisms, one above the other.

**Launcher.** A Triton launch (``kernel[grid](*args)``) binds and specializes every argument,
builds a cache key string and looks the compiled kernel up before it launches. A
:class:`Launcher` keeps the compiled kernel of each launch it has seen under a key it computes
in one pass, and launches later calls through the compiled kernel directly. The key holds
constexpr arguments by value; runtime integers (also inside tuples such as stride bundles) by
what Triton specializes them on: ``== 1``, divisibility by 16 and width; runtime floats by type;
tensors by dtype and whether their address is 16-byte aligned; TMA descriptors by dtype, block
shape, layout and padding; other values by type and value; plus the launch options, Triton's
debug and instrumentation knobs, and the device. Whatever Triton specializes on is therefore a
function of the key, so one key never needs two compiled kernels, and a call with new lengths or
strides (a growing sequence) finds its compiled kernel without Triton's argument binding. The
table is cleared when it grows past ``MAX_KEYS``. Not re-checked on the fast path: Triton's
``pre_run_hooks`` and its test that globals read by the kernel kept their values (ours read
only constants fixed at import).

**Recording.** A whole call (validation, dispatch, one to three launches) is a pure function of
its tensors' layouts and its scalar arguments, except for the tensors' addresses. Inside
``with Recorder(inputs) as rec:`` every launch a :class:`Launcher` makes, and every output
allocated through :func:`allocate`, is recorded; :meth:`Recorder.finish` turns them into a
:class:`Replay`: each launch's argument list with the tensors replaced by "the address of input
``i``" (or of allocation ``j``: outputs and temporaries such as the split-KV partials).
``Replay.run(inputs)`` allocates the outputs and launches with the new addresses: through the
small C launcher of ``_native.py`` (every launch's parameters packed once, TMA descriptors
encoded once; one Python call per run) where it qualifies, else through Triton's compiled C
launchers with integer addresses. Either skips argument binding, specialization and the driver's
pointer-attribute query of every tensor. A recording that cannot be replayed exactly (an argument that is a view at an
offset of an input, a kernel that needs profiling scratch, no launch) gives ``None`` and the
caller keeps the slow path for that call. Inputs at one address (the same ``cu_seqlens`` for
queries and keys) are told apart by the order of ``inputs``: the caller's key must include which
inputs share an address (:func:`layouts` does).

Under Triton's interpreter, or with ``FLASHKERNEL_FAST_LAUNCH=0`` in the environment (read once,
at import), every launch goes through ``kernel[grid]`` and nothing is recorded.
"""

from __future__ import annotations

import os
import threading

import torch
from triton import knobs
from triton.runtime import driver

from . import _native
from ._common import is_interpreted

FAST_LAUNCH = os.environ.get("FLASHKERNEL_FAST_LAUNCH", "1") != "0"
MAX_KEYS = 4096


def _non_int_key(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if hasattr(value, "block_shape") and hasattr(value, "base"):
        # A host TMA descriptor: Triton specializes on its dtype, block shape and layout; its
        # shape and strides are encoded into the tensor map at every launch.
        return (type(value), value.base.dtype, tuple(value.block_shape), getattr(value, "layout", None),
                getattr(value, "padding", None))
    return type(value), value  # floats, bools, None, strings, tuples: 1.0, True and 1 stay apart


def value_key(value):
    """The key of a constexpr argument: an integer by value, anything else by :func:`_non_int_key`."""
    return value if type(value) is int else _non_int_key(value)


def launch_key(values) -> tuple:
    """The cache key of argument values all keyed as constexprs are (integers by value)."""
    return tuple([v if type(v) is int else _non_int_key(v) for v in values])


def runtime_key(value):
    """The key of a runtime (not constexpr) argument: an integer by Triton's specialization of
    it (``== 1``, ``% 16 == 0``, int32 / int64 / uint64 range), a tuple element by element, a
    float by its type (Triton passes every float as an fp32 argument), anything else as
    :func:`launch_key` has it."""
    kind = type(value)
    if kind is int:
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31, -2**63 <= value < 2**63
    if kind is tuple:
        return tuple([runtime_key(element) for element in value])
    if kind is float:
        return float
    return _non_int_key(value)


def parameter_keys(kernel) -> tuple:
    """For each parameter of a Triton kernel, the function that keys its argument:
    constexprs by :func:`value_key`, the rest by :func:`runtime_key`. A kernel
    object without parameter metadata keys every argument by value."""
    params = getattr(kernel, "params", None)
    if not params:
        return ()
    return tuple(value_key if p.is_constexpr else runtime_key for p in params)


# What reading a bad argument's layout raises: no tensor (AttributeError, TypeError), a nested
# tensor's shape (RuntimeError). Look-ups answer "no match" on these; validation names the argument.
UNREADABLE = (AttributeError, TypeError, RuntimeError)


# ---- recording --------------------------------------------------------------------------------

_ACTIVE = threading.local()


def _recorder() -> Recorder | None:
    return getattr(_ACTIVE, "recorder", None)


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``: the one allocation point of call outputs, recorded or replayed (tests
    replace it to poison outputs with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def allocate(shape, dtype: torch.dtype, device, zeroed: bool = False) -> torch.Tensor:
    """:func:`empty` for a call's outputs and temporaries; recorded while a recording is on.
    ``zeroed``: filled with zeros, for a temporary that the kernels using it leave at zero when
    they end (e.g. counters), so that a replay keeping it per stream zeroes it only once."""
    out = _fresh(shape, dtype, device, zeroed)
    rec = _recorder()
    if rec is not None:
        if zeroed:
            rec.zeroed.add(len(rec.allocations))
        rec.allocations.append(out)
    return out


def _fresh(shape, dtype: torch.dtype, device, zeroed: bool, strides=None) -> torch.Tensor:
    """A new buffer for an allocation; ``strides`` (contiguous ones, given by replays running on
    ``device``, the current device) let a CUDA buffer come from PyTorch's direct allocator, which
    skips the dispatcher: a third of ``torch.empty``'s host time."""
    if zeroed:
        return torch.zeros(shape, dtype=dtype, device=device)
    if strides is not None and _direct_allocation(device):
        return _empty_strided_cuda(shape, strides, dtype)
    return empty(shape, dtype, device)


def _direct_allocation(device) -> bool:
    """Whether a new (not zeroed) buffer on ``device`` comes from PyTorch's direct CUDA allocator
    (given its strides): where the build has it and :func:`empty` has not been replaced."""
    return _empty_strided_cuda is not None and empty is _default_empty and device.type == "cuda"


def allocated_off_thread(stream: int, device, make):
    """``make()``, run on a helper thread with ``device`` and the raw CUDA ``stream`` current, for
    buffers kept past the call that makes them (a replay's temporaries per stream).

    Why another thread: ``torch.compile``'s CUDA graphs route the calling thread's allocations to
    their private pool while they warm up (a registered op's calls run then), and that pool must
    hold no buffer of ours afterwards; PyTorch routes allocations to such a pool per thread, so a
    helper thread's come from its ordinary cache. On ``stream`` (as an external stream), the
    buffers belong to that stream as if made on it, and a zero fill is ordered before its
    kernels. So kept buffers never come from a pool the caller routes allocations to (a pool of
    the caller's own included). Other devices: ``make()`` runs on the helper thread as it is."""
    made = []

    def run():
        try:
            if device.type != "cuda":
                made.append(make())
                return
            with torch.cuda.device(device):
                current = torch.cuda.current_stream()  # a new thread's: the device's default stream
                same = current.cuda_stream == stream
                with torch.cuda.stream(current if same else torch.cuda.ExternalStream(stream, device=device)):
                    made.append(make())
        except BaseException as exc:  # noqa: BLE001 - raised again in the calling thread
            made.append(exc)

    helper = threading.Thread(target=run, name="flashkernel-kept-buffers")
    helper.start()
    helper.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


_default_empty = empty  # replaced (tests poison outputs): every buffer then goes through the replacement
try:  # what Inductor's generated code allocates with; absent from some builds
    from torch._C._dynamo.guards import _empty_strided_cuda
except ImportError:
    _empty_strided_cuda = None


def spoil_recording() -> None:
    """Mark the call being recorded as not replayable (e.g. it ran autotuning launches)."""
    rec = _recorder()
    if rec is not None:
        rec.spoiled = True


class _Address(int):
    """A device address that also answers ``data_ptr()``, as Triton's launcher asks of a TMA
    descriptor's base."""

    __slots__ = ()

    def data_ptr(self) -> int:
        return int(self)


class _Descriptor:
    """A host TMA descriptor as Triton's launcher reads it: base, shape, strides, padding."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides, padding):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


class Recorder:
    """Records the launches and allocations of one call (see the module docstring).

    ``inputs`` are the call's tensors (None allowed) in the order :meth:`Replay.run` will get
    them. Recording is per thread; a recording inside a recording is not supported (the inner
    one wins until it ends).
    """

    def __init__(self, inputs):
        self.inputs = tuple(inputs)
        self.launches: list = []
        self.allocations: list[torch.Tensor] = []
        self.zeroed: set[int] = set()  # indices of allocations made zeroed
        self.spoiled = not FAST_LAUNCH
        self.refusal = None  # why finish() gave no replay
        self._outer = None

    def __enter__(self) -> Recorder:
        self._outer = _recorder()
        _ACTIVE.recorder = self
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.recorder = self._outer

    def add(self, compiled, grid, values, device: int, launcher: Launcher | None = None) -> None:
        self.launches.append((compiled, grid, values, device, launcher))

    def finish(self, outputs) -> Replay | None:
        """The :class:`Replay` of this call, whose results are ``outputs`` (tensors allocated
        through :func:`allocate`, or None), or None when the call cannot be replayed."""
        if self.spoiled or not self.launches:
            self.refusal = "spoiled" if self.spoiled else "no launch"
            return None
        try:
            return Replay(self, tuple(outputs))
        except _NotReplayable as exc:
            self.refusal = str(exc)
            return None


class _NotReplayable(Exception):
    pass


def _first_at_address(candidates) -> dict[int, int]:
    """Each address of ``candidates`` (tensors or None) -> the index of the first tensor there."""
    first: dict[int, int] = {}
    for i, t in enumerate(candidates):
        if t is not None:
            first.setdefault(t.data_ptr(), i)
    return first


def _identify(ptr: int, candidates, first_at: dict[int, int], first_allocation: int) -> tuple[int, int]:
    """``(index, byte offset)``: the first tensor in ``candidates`` whose address is ``ptr``
    (offset 0; ``first_at`` is :func:`_first_at_address` of them), or an allocation (index >=
    ``first_allocation``: buffers made for this call, never shared) that holds ``ptr`` (a view
    into it, e.g. one of the split partials' parts)."""
    index = first_at.get(ptr)
    if index is not None:
        return index, 0
    for i, t in enumerate(candidates[first_allocation:], first_allocation):
        base = t.untyped_storage().data_ptr()
        if base <= ptr < base + t.untyped_storage().nbytes():
            return i, ptr - t.data_ptr()
    raise _NotReplayable(f"an argument at {ptr:#x} is none of the call's tensors (a view at an offset?)")


class Replay:
    """The recorded launches of one call, replayable with other tensors of the same layouts."""

    def __init__(self, rec: Recorder, outputs: tuple):
        inputs = rec.inputs
        if any(x is not None and not x.is_cuda for x in inputs):
            raise _NotReplayable("an input is not on a CUDA device")
        alloc_ids = {id(t): i for i, t in enumerate(rec.allocations)}
        if any(o is not None and id(o) not in alloc_ids for o in outputs):
            raise _NotReplayable("an output was not made by allocate()")  # zeros, a copy
        self.allocations = tuple((tuple(t.shape), t.dtype, t.device, i in rec.zeroed, t.stride())
                                 for i, t in enumerate(rec.allocations))
        self.num_inputs = len(inputs)
        # Temporaries (allocations that are not outputs, e.g. split-KV partials): reusable per
        # stream by callers that ask (``run(..., reuse_scratch=True)``), one run at a time. Zeroed
        # ones are zeroed when allocated: the kernels that use them leave them at zero.
        self._scratch_by_stream: dict[int, list] = {}
        self._scratch_lock = threading.Lock()
        # stream -> (the C launcher's form of that stream's buffers (_buffer_spec), the `empty` it
        # allocates through): shared, as the temporaries are, by replays of other scalar values
        self._buffer_specs: dict[int, tuple] = {}
        self.outputs = tuple(None if o is None else alloc_ids[id(o)] for o in outputs)
        self.scratch = tuple(i for i in range(len(rec.allocations)) if i not in self.outputs)
        self.everything = inputs + tuple(rec.allocations)
        self.first_at = _first_at_address(self.everything)
        self.device = rec.launches[0][3]
        self.launchers = tuple(launch[4] for launch in rec.launches)  # Launcher objects (None: another caller)
        self._compiled = tuple(launch[0] for launch in rec.launches)
        self.launches = tuple(self._launch_template(c, g, v, d) for c, g, v, d, _ in rec.launches)
        del self.everything, self.first_at  # the call's tensors: needed only to read the addresses
        self._packed = self._native_launches()
        self.native = None if self._packed is None else tuple(p.capsule for p in self._packed)
        # Each launch's parameters, passed to every run: replays of other scalar values share
        # the capsules (with_arguments), and each run writes its own before launching.
        self._storages = None if self._packed is None else tuple(p.storage for p in self._packed)

    def _launch_template(self, compiled, grid, values, device):
        if device != self.device:
            raise _NotReplayable("launches on two devices")
        runner = compiled.run  # Triton's CudaLauncher (built on first use)
        if not hasattr(runner, "launch") or getattr(runner, "profile_scratch_size", 0) > 0:
            raise _NotReplayable("another Triton's launcher, or instrumentation")
        # The template keeps no tensor of the recorded call (its slots are filled per run): a
        # replay must not keep the call's outputs or the caller's tensors alive.
        args, slots, descriptors = list(values), [], []
        for i, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                slots.append((i, *_identify(value.data_ptr(), self.everything, self.first_at, self.num_inputs)))
                args[i] = None
            elif hasattr(value, "block_shape") and hasattr(value, "base"):
                address = value.base.data_ptr()
                j, offset = _identify(address, self.everything, self.first_at, self.num_inputs)
                if offset:
                    raise _NotReplayable("a TMA descriptor of a view at an offset")
                # The recorded address is an integer (no tensor kept): the C launcher encodes with it.
                descriptors.append((i, j, list(value.shape), list(value.strides), value.padding, address))
                args[i] = None
        grid = tuple(grid) + (1,) * (3 - len(grid))
        scratch = getattr(runner, "global_scratch_size", 0) * grid[0] * grid[1] * grid[2] * runner.num_ctas
        head = (runner.launch, grid, compiled.function, runner.launch_cooperative_grid, runner.launch_pdl,
                compiled.packed_metadata)
        return head, list(args), tuple(slots), tuple(descriptors), scratch

    def _native_launches(self):
        """The launches packed for the C launcher (``_native.py``), or None when one of them does
        not qualify (then every launch goes through Triton's launcher)."""
        if self.num_inputs + len(self.allocations) > _native.MAX_SOURCES:
            return None
        packed = []
        for compiled, launch in zip(self._compiled, self.launches):
            native = self._native_launch(compiled, launch)
            if native is None:
                return None
            packed.append(native)
        return tuple(packed)

    @staticmethod
    def _native_launch(compiled, launch):
        (_, grid, *_), template, slots, descriptors, _ = launch
        return _native.launch_for(compiled, grid, template, {i: (j, offset) for i, j, offset in slots},
                                  {i: rest for i, *rest in descriptors})

    def with_arguments(self, index: int, values: dict) -> Replay:
        """A replay whose launch ``index`` takes ``values`` (argument index -> value: integers or
        tuples of them, in place of the recorded ones) and is otherwise this one: same kernels,
        grids, allocations and tensor slots, and the same temporaries kept per stream.

        The caller vouches that the new values specialize as the recorded ones do
        (:func:`runtime_key`), so the recorded compiled kernel is the one Triton would pick.
        """
        head, template, slots, descriptors, scratch = self.launches[index]
        template = list(template)
        for i, value in values.items():
            template[i] = value
        launch = (head, template, slots, descriptors, scratch)
        # A shallow copy (as copy.copy makes, at a quarter of its cost): it shares _scratch_by_stream
        # and its lock, the allocations being the same.
        clone = object.__new__(Replay)
        clone.__dict__.update(self.__dict__)
        clone.launches = self.launches[:index] + (launch,) + self.launches[index + 1:]
        clone._entry = None  # its own parameters
        if self.native is not None:
            # The same capsules (kernel, grid, address slots) with other parameters: from now on
            # every replay sharing them passes its own parameters to each run.
            packed = _native.with_values(self._packed[index], values)
            if packed is None:
                clone._packed = clone.native = clone._storages = None
            else:
                clone._packed = self._packed[:index] + (packed,) + self._packed[index + 1:]
                clone._storages = tuple(p.storage for p in clone._packed)
        return clone

    def run(self, inputs, reuse_scratch: bool = False, outputs=None, addresses=None, capturing=None):
        """Launch the recorded kernels for ``inputs`` (same layouts as the recorded call's, on the
        recorded device); returns the outputs as the recorded call did.

        ``outputs``: tensors (or None) to write in place of the first recorded outputs, in their
        order; each must have its recorded output's shape, strides, dtype and device and a 16-byte
        aligned address (the caller checks; Triton specialized the kernels on it).

        ``addresses``: the inputs' ``data_ptr()`` (None for None), when the caller has read them
        already; ``capturing``: whether the current stream is capturing a CUDA graph, when the
        caller knows (each saves a query per run).

        ``reuse_scratch``: keep the temporaries per stream and reuse them in the next run on that
        stream, instead of allocating them per run. Safe for eager calls: the kernels of one
        stream run in order, so a run's temporaries are free once its last kernel has read them
        (runs from several threads are issued one after another). Under CUDA-graph capture
        (checked here) the temporaries are new; kept ones are made on a helper thread
        (:func:`allocated_off_thread`), so none comes from a pool the calling thread allocates from.
        """
        if _current_device() != self.device:
            with torch.cuda.device(self.device):  # the capture state asked again: that device's stream's
                return self.run(inputs, reuse_scratch, outputs, addresses, None)
        if reuse_scratch and self.scratch:
            # Threads launching on one stream share its temporaries, so one run's launches are all
            # issued before another run's begin: else a second run's split kernel could overwrite
            # partials the first run's merge has yet to read (Triton's launcher releases the GIL
            # while it launches; the C launcher's one call does not).
            with self._scratch_lock:
                return self._launch(inputs, reuse_scratch, outputs, addresses, capturing)
        return self._launch(inputs, reuse_scratch, outputs, addresses, capturing)

    _entry = None  # (the C launcher's replay_run, this replay's entry for it), False: none (_native_entry)

    def _native_entry(self):
        """``(replay_run, entry)``: the C launcher's run of this replay from its state in one call
        (``_native.py``: the device, the launches and their parameters, the outputs, the
        temporaries' lock and the buffers kept per stream), or False where the C launcher or its
        checks are missing. Made once per replay (a replay of other arguments makes its own): it
        holds ``native``, ``_storages`` and the lock as they are now, so those are not reassigned."""
        native = native_runs() if self.native is not None else None
        if native is None:
            self._entry = False
        else:
            self._entry = (native.replay_run, (self.device, self.native, self._storages, self.outputs,
                                               self._scratch_lock if self.scratch else None, self._buffer_specs))
        return self._entry

    def run_checked(self, guard, tensors, fixed=(), capturing=None, out=None, reuse_scratch: bool = True):
        """:meth:`run` on ``(*tensors, *fixed)`` with ``reuse_scratch`` (and ``outputs=(out,)``
        when ``out`` is given), where the C launcher first checks ``tensors`` (and ``out``) with
        ``guard`` (a :meth:`LayoutGuard.native_form`) and reads every address itself: None when the
        guard does not vouch for them (nothing allocated or launched). For replays through the C
        launcher (``native`` not None). With ``reuse_scratch``, one call into the C launcher
        (:meth:`_native_entry`) where it can do the run alone (the current device, a stream whose
        buffers are made, outside capture)."""
        entry = self._entry
        if reuse_scratch and (entry or (entry is None and self._native_entry())):
            run, state = self._entry
            results = run(state, guard, tensors, fixed, capturing, out)
            if results is not NotImplemented:
                return results
        if _current_device() != self.device:
            with torch.cuda.device(self.device):  # the capture state asked again: that device's stream's
                return self.run_checked(guard, tensors, fixed, None, out, reuse_scratch)
        stream = _raw_stream(self.device)
        if capturing is None:
            capturing = stream_capturing()
        checked_run = _native.module().checked_run
        if not reuse_scratch:
            buffers = self._fresh_buffers
        elif self.scratch:  # one run's launches at a time per stream's temporaries: see run()
            with self._scratch_lock:
                results = checked_run(guard, tensors, fixed, self._buffer_spec(stream, capturing), stream,
                                      capturing, self.native, self._storages, out, self.outputs)
            if results is not None and not capturing and stream not in self._buffer_specs:
                self._buffer_spec(stream, capturing)  # its temporaries made: the C call runs the next alone
            return results
        else:
            buffers = self._buffer_spec(stream, capturing)
        return checked_run(guard, tensors, fixed, buffers, stream, capturing, self.native, self._storages, out,
                           self.outputs)

    def _buffer_spec(self, stream: int, capturing):
        """What the C launcher makes a checked run's buffers from (``checked_run``'s
        ``buffers_for``): outside capture, ``(kept, makers)``: the temporaries kept for ``stream``
        and, per output, where ``out`` goes or what allocates a new one (PyTorch's allocator,
        called from C with no Python frame where :func:`_fresh` would call it directly); under
        capture, and before this stream's temporaries are made, :meth:`_buffers` (called only once
        the guard has passed: a call turned away allocates nothing). Made again when ``empty`` is
        replaced; a replaced ``_fresh`` or ``_empty_strided_cuda`` is not noticed (the tests
        replace ``empty`` only)."""
        if capturing:
            return self._buffers
        entry = self._buffer_specs.get(stream)
        if entry is None or entry[1] is not empty:
            if self.scratch and stream not in self._scratch_by_stream:
                return self._buffers  # makes and keeps them on its first run that passes the guard
            kept = self._kept(stream) if self.scratch else [None] * len(self.allocations)
            makers = tuple((j, i == 0, *self._maker(j)) for i, j in enumerate(self.outputs) if j is not None)
            entry = self._buffer_specs[stream] = ((kept, makers), empty)
        return entry[0]

    def _maker(self, j: int) -> tuple:
        """``(make, args)``: ``make(*args)`` is what :func:`_fresh` gives for allocation ``j``, with
        PyTorch's direct allocator called as it is where ``_fresh`` would call it."""
        shape, dtype, device, zeroed, strides = self.allocations[j]
        if not zeroed and _direct_allocation(device):
            return _empty_strided_cuda, (shape, strides, dtype)
        return _fresh, self.allocations[j]

    def _fresh_buffers(self, stream: int, capturing, out=None) -> list:
        """:meth:`_buffers` with new temporaries, none kept (what a checked run without
        ``reuse_scratch`` asks the C call for)."""
        return self._buffers(stream, capturing, out, reuse_scratch=False)

    def _buffers(self, stream: int, capturing, out=None, reuse_scratch: bool = True, given=()) -> list:
        """The run's buffers, one per recorded allocation: the temporaries kept for ``stream`` (with
        ``reuse_scratch``, not under capture) or new ones, and the outputs: ``out`` (or ``given``'s
        tensors, in order) where given, else new ones: for runs without the C checks, and what a checked
        run's C call asks for under capture (outside it, the C call makes them from :meth:`_buffer_spec`)."""
        if reuse_scratch and self.scratch and not (capturing or (capturing is None and stream_capturing())):
            allocated = self._kept(stream).copy()
        else:
            allocated = [None if i in self.outputs else _fresh(*allocation)
                         for i, allocation in enumerate(self.allocations)]
        if out is not None:
            given = (out,)
        for i, j in enumerate(self.outputs):
            if j is not None:
                allocated[j] = given[i] if i < len(given) and given[i] is not None else _fresh(*self.allocations[j])
        return allocated

    def _kept(self, stream: int) -> list:
        """The temporaries kept for ``stream`` (made on its first run, by
        :func:`allocated_off_thread`), None for the outputs."""
        kept = self._scratch_by_stream.get(stream)
        if kept is None:
            kept = self._scratch_by_stream[stream] = allocated_off_thread(
                stream, self.allocations[0][2],
                lambda: [None if i in self.outputs else _fresh(*allocation)
                         for i, allocation in enumerate(self.allocations)])
        return kept

    def _launch(self, inputs, reuse_scratch: bool, outputs, addresses, capturing):
        stream = _raw_stream(self.device)
        allocated = self._buffers(stream, capturing, None, reuse_scratch, outputs or ())
        allocation_addresses = [None if t is None else t.data_ptr() for t in allocated]
        if addresses is None:
            addresses = [None if x is None else x.data_ptr() for x in inputs]
        addresses = [*addresses, *allocation_addresses]
        if self.native is not None:
            _native.module().run(stream, addresses, self.native, self._storages)
            return tuple([None if j is None else allocated[j] for j in self.outputs])
        for (launch, grid, function, coop, pdl, metadata), template, slots, descriptors, scratch in self.launches:
            args = template.copy()
            for i, j, offset in slots:
                args[i] = addresses[j] + offset
            for i, j, shape, strides, padding, _ in descriptors:
                args[i] = _Descriptor(_Address(addresses[j]), shape, strides, padding)
            scratch_buf = torch.empty(scratch, dtype=torch.uint8, device=inputs[0].device) if scratch else None
            launch(grid[0], grid[1], grid[2], stream, function, coop, pdl, scratch_buf, None, metadata, None,
                   None, None, *args)
        return tuple([None if j is None else allocated[j] for j in self.outputs])


# The current CUDA stream of a device, as Triton's launcher takes it: PyTorch's C function where
# the build has it (CUDA builds), called without a Python wrapper.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                      lambda device: torch.cuda.current_stream(device).cuda_stream)
# torch.cuda.current_device without its Python wrapper (absent from CPU builds of torch).
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
# torch.cuda.is_current_stream_capturing without its Python wrapper (CUDA builds: on others, as
# that function, it raises when called).
stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
# What the C launcher's plan_run asks besides those (it finds all of them in this module's dict,
# _native.py's setup_runs): the inference mode, forward AD's level, functorch's transform level
# (None outside every transform; absent from builds without functorch), and the bump of the
# version counters of tensors written in place (a tuple of them).
_inference_mode = torch.is_inference_mode_enabled
_forward_ad = torch.autograd.forward_ad
_functorch_level = getattr(torch._C._functorch, "maybe_current_level", None)


def _bump_versions(tensors: tuple) -> None:
    for tensor in tensors:
        torch.autograd.graph.increment_version(tensor)


if hasattr(torch._C, "_increment_version"):
    _probe = torch.empty(0)
    try:  # PyTorch's C function where it takes a tuple (its Python wrapper passes one)
        torch._C._increment_version((_probe,))
        if _probe._version == 1:
            _bump_versions = torch._C._increment_version  # noqa: F811
    except (TypeError, RuntimeError):
        pass
    del _probe


def native_runs():
    """The C launcher's module with its runs from Python's state (``replay_run``, ``plan_run``,
    ``eager_run``) set up to find this module's functions (``_current_device``, ``_raw_stream``,
    ``stream_capturing``, ``empty``, ...), or None where :func:`_native.checking_module` is."""
    native = _native.checking_module()
    if native is not None:
        native.setup_runs(globals())
    return native


def replay_allowed() -> bool:
    """Whether recorded launches may replay now: no Triton launch hooks (profilers) are set."""
    return knobs.runtime.launch_enter_hook is None and knobs.runtime.launch_exit_hook is None


def layout(t: torch.Tensor | None):
    """What a recorded call depends on in a tensor besides its address: shape, strides, dtype,
    device and the address's alignment (Triton specializes on 16-byte alignment). None for None."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15


def layouts(tensors) -> tuple:
    """The :func:`layout` of each tensor, plus which of them share an address (each tensor's
    entry ends with the index of the first tensor at its address): a recorded call's key."""
    first: dict = {}
    return tuple([None if t is None else
                   (t.shape, t.stride(), t.dtype, t.device, first.setdefault(p := t.data_ptr(), i), p & 15)
                   for i, t in enumerate(tensors)])


class LayoutGuard:
    """A quicker :func:`layouts` comparison, for callers that check calls against one set of
    example tensors (a plan's layers; a recent call): shapes, strides, dtypes, devices and that no
    gradient is wanted, in one call into PyTorch's C++ tensor guards (what ``torch.compile``'s
    compiled frames check their inputs with), then in Python the addresses' alignments and which
    of them are equal. :meth:`addresses` stands for ``layouts(tensors) == layouts(examples)``
    where it answers. :meth:`make` gives None where it cannot stand in: a build of PyTorch without
    the guards, no tensor, a tensor that is not a plain strided one or wants a gradient, two slots
    at one address that do not hold one tensor.

    The C++ guards also compare the dispatch keys a tensor has under the thread's state when they
    check it: a guard made outside ``torch.inference_mode()`` answers None inside it, and the
    other way round (callers keep one per mode).
    """

    __slots__ = ("_check", "_checked", "_alignments", "_same", "_distinct", "_native")

    def __init__(self, check, checked, examples):
        self._check, self._checked = check, checked
        addresses = [None if x is None else x.data_ptr() for x in examples]
        self._alignments = tuple(None if a is None else a & 15 for a in addresses)
        self._same = tuple((i, addresses.index(a)) for i, a in enumerate(addresses)
                           if a is not None and addresses.index(a) != i)  # (slot, first slot at its address)
        self._distinct = len(set(addresses))
        self._native = False  # its C form (_native.make_guard), made on the first run through the C launcher

    @classmethod
    def make(cls, examples) -> LayoutGuard | None:
        present = [x for x in examples if x is not None]
        if _TensorGuards is None or not present or any(
                type(x) is not torch.Tensor or x.is_nested or x.layout is not torch.strided or x.requires_grad
                for x in present):
            return None
        # The C++ guards refuse one object twice: a slot at an earlier slot's address is checked
        # by holding that slot's tensor (the one ``cu_seqlens`` for queries and keys), so the
        # examples must hold one tensor there too.
        addresses = [None if x is None else x.data_ptr() for x in examples]
        checked = tuple(i for i, a in enumerate(addresses) if a is not None and addresses.index(a) == i)
        if any(examples[i] is not examples[addresses.index(a)] for i, a in enumerate(addresses) if a is not None):
            return None
        tensors = [examples[i] for i in checked]
        try:
            guard = _TensorGuards(*tensors, dynamic_dims_sizes=[list(x.shape) for x in tensors],
                                  dynamic_dims_strides=[list(x.stride()) for x in tensors])
            if not guard.check(*tensors):
                return None
        except Exception:  # noqa: BLE001 - another build's signature: the caller keeps layouts()
            return None
        return cls(guard.check, checked, examples)

    def addresses(self, tensors) -> list | None:
        """``tensors``' addresses (None for None) when they have the examples' layouts: None in the
        same places, one tensor where they had one address; else None (and the caller compares
        :func:`layouts`)."""
        try:
            if len(tensors) != len(self._alignments):
                return None
            checked = [tensors[i] for i in self._checked]
            for x in checked:
                if x.is_nested:  # the C++ guards read a nested tensor's strides, which aborts
                    return None
            if not self._check(*checked):
                return None
        except UNREADABLE:  # a missing or non-tensor argument
            return None
        for i, j in self._same:
            if tensors[i] is not tensors[j]:
                return None
        addresses = []
        for x, alignment in zip(tensors, self._alignments):
            if x is None:
                if alignment is not None:
                    return None
                addresses.append(None)
            else:
                if alignment is None:
                    return None
                address = x.data_ptr()
                if address & 15 != alignment:
                    return None
                addresses.append(address)
        # As many distinct addresses as the examples had, and one tensor where they had one
        # address: the same partition of the slots.
        if len(set(addresses)) != self._distinct:
            return None
        return addresses

    def native_form(self, output=None):
        """This guard for the C launcher's ``checked_run`` (``_native.make_guard``), or None where
        it cannot be made. ``output``: ``(guard, bytes, extents, spans)`` for runs into a caller's
        output: the output's guard (of one 16-byte aligned tensor) and size, each slot's extent in
        bytes and the ``(start, bytes)`` of tensors held for every run; the output may overlap none."""
        if output is not None:
            out_guard, size, extents, spans = output
            if out_guard._alignments != (0,):
                return None
            output = (out_guard._check, size, extents, spans)
        return _native.make_guard(self._check, self._alignments, self._checked, self._same,
                                  self._distinct - (None in self._alignments), output)

    def native(self):
        """:meth:`native_form` without an output check, made once; None where it cannot be made."""
        if self._native is False:
            self._native = self.native_form()
        return self._native

    def run(self, replay: Replay, tensors, fixed=(), capturing=None, reuse_scratch: bool = True):
        """``replay.run((*tensors, *fixed), reuse_scratch=reuse_scratch)`` when ``tensors`` have the
        examples' layouts (as :meth:`addresses` says), else None (nothing launched). Where the
        replay runs through the C launcher, the check, the addresses (of ``fixed`` too: dense
        tensors the caller has validated, or None) and the launches are one call into it
        (:meth:`Replay.run_checked`)."""
        if replay.native is not None:
            native = self.native()
            if native is not None:
                return replay.run_checked(native, tensors, fixed, capturing, reuse_scratch=reuse_scratch)
        addresses = self.addresses(tensors)
        if addresses is None:
            return None
        if fixed:
            addresses += [None if x is None else x.data_ptr() for x in fixed]
        return replay.run((*tensors, *fixed), reuse_scratch=reuse_scratch, addresses=addresses, capturing=capturing)


try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:
    _TensorGuards = None


class BoundedNotes(dict):
    """A dict that empties itself before it would hold more than ``max_entries`` keys (a memo
    whose entries can all be derived again)."""

    def __init__(self, max_entries: int):
        super().__init__()
        self.max_entries = max_entries

    def __setitem__(self, key, value) -> None:
        if key not in self and len(self) >= self.max_entries:
            self.clear()
        super().__setitem__(key, value)


def _leading_shapes(inputs) -> tuple:
    """The shapes of the first three inputs (None for None): with the probe, ``CallCache``'s
    index of the replays that left the recent ones. Raises one of :data:`UNREADABLE` for bad
    input. An object with a shape that is no tensor passes here; the guard turns it away."""
    return tuple([None if x is None else x.shape for x in inputs[:3]])


class CallCache:
    """Replays of recorded calls, by key (the caller's: its name, the :func:`layout` of each
    tensor and every scalar argument). Bounded: cleared when it grows past ``max_entries``.

    Families: a caller may also file a replay under a family ``(base, detail)``, shared by calls
    that differ only in arguments it knows how to rebind (a decode call over a contiguous cache
    one token longer: the caches' strides, the capacity, the window bounds). A call whose own key
    has no replay yet is then served by :meth:`rebound`: the family's replay with those arguments
    replaced, filed under the call's key, with no dispatch or recording of its own launches.
    :meth:`has_family` tells the caller whether any call of a ``base`` was filed (what its
    checks of a new call may rely on); ``notes`` is the caller's to keep what it derives per
    base (cleared with the replays, and bounded on its own: a :class:`BoundedNotes` of
    ``max_entries``).
    """

    RECENT = 8  # replays :meth:`quick` looks through

    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._replays: dict = {}
        self._families: dict = {}
        # (probe, LayoutGuard, replay, _leading_shapes of its inputs or None) of the replays last
        # filed, looked up by key or found by shapes (quick), newest first
        self._recent: list = []
        # (id(replay), inference mode) -> its entry (as in _recent, the guard None where none can be
        # made): a guard is made once per replay and mode while this lasts (cleared with the
        # replays, or when full), however often its replay leaves _recent and comes back.
        self._entries = BoundedNotes(2 * max_entries)
        self._by_shapes = BoundedNotes(max_entries)  # (probe, shapes) -> the _recent entry last remembered there
        self.notes = BoundedNotes(max_entries)
        self.last_refusal = None  # why the last recording gave no replay (diagnostics)
        # The C launcher's eager_run over _recent (look-up and run in one call), once a replay it
        # can run has been remembered; None before (and without the C launcher)
        self.native_quick = None

    def quick(self, probe, inputs, capturing=None, reuse_scratch: bool = True):
        """The outputs of a recent replay filed with ``probe`` (the caller's key without the tensors'
        layouts, e.g. its name and scalar arguments) whose inputs had the layouts of ``inputs``
        (:class:`LayoutGuard`), run on ``inputs`` (keeping its temporaries per stream with
        ``reuse_scratch``, see :meth:`Replay.run`); None when there is none. What a caller that
        makes the same few calls over and over (a model's layers) finds without building its key:
        :func:`layouts` of every tensor and the key's hash cost more than this look-up.

        Past the recent replays, the one last remembered with ``probe`` and the shapes of
        ``inputs``' first three tensors is tried (then put first): a decode loop's first layer
        of each step, whose cache is one token longer than at the step before, finds the replay
        of that length recorded in an earlier generation. Once one guard has refused ``inputs``,
        the other recent replays of ``probe`` are tried only where those shapes are theirs (a
        guard refuses other shapes; trying one costs a few microseconds of Python)."""
        shapes = None
        for filed, guard, replay, filed_shapes in self._recent:
            try:
                same = filed == probe
            except Exception:  # noqa: BLE001 - an argument that is no scalar (an array): validation names it
                return None
            if not same or (shapes is not None and filed_shapes is not None and filed_shapes != shapes):
                continue
            results = guard.run(replay, inputs, capturing=capturing, reuse_scratch=reuse_scratch)
            if results is not None:
                return results
            if shapes is None:
                try:
                    shapes = _leading_shapes(inputs)
                except UNREADABLE:  # bad input: validation names it
                    return None
        if not self._by_shapes:
            return None
        try:
            entry = self._by_shapes.get((probe, shapes if shapes is not None else _leading_shapes(inputs)))
        except UNREADABLE:  # bad input: validation names it
            return None
        if entry is None or any(entry is e for e in self._recent):  # its guard said no above
            return None
        results = entry[1].run(entry[2], inputs, capturing=capturing, reuse_scratch=reuse_scratch)
        if results is not None:
            self._put_first(entry)
        return results

    def get_noted(self, key, probe, inputs) -> Replay | None:
        """:meth:`get`, and a replay found there goes first among those :meth:`quick` looks
        through (with its guard under the current inference mode). A decode loop needs this: each
        step's layers make one call of a new cache length, whose replay (recorded for that length
        in an earlier generation) was pushed out of the recent ones long ago; brought back by the
        first layer's look-up, it serves the other layers without their keys being built."""
        replay = self.get(key)
        if replay is not None:
            self._remember(probe, inputs, replay)
        return replay

    def _remember(self, probe, inputs, replay) -> None:
        """Put ``replay`` (filed with ``probe``, run with ``inputs``) first among the recent ones;
        its guard is made from ``inputs`` once per inference mode (none where it cannot be made)."""
        made = (id(replay), torch.is_inference_mode_enabled())
        entry = self._entries.get(made)
        if entry is None:
            try:
                shapes = _leading_shapes(inputs)
            except UNREADABLE:
                shapes = None
            # The entry holds the replay, so its id names no other replay while the entry lasts.
            entry = self._entries[made] = (probe, LayoutGuard.make(inputs), replay, shapes)
        if entry[1] is None:  # no guard can be made: quick never serves it
            return
        if replay.native is not None:
            if self.native_quick is None:
                native = native_runs()
                self.native_quick = None if native is None else native.eager_run
            if self.native_quick is not None:
                # eager_run runs a replay only through its guard's and its own C forms: made now,
                # else the next call (a decode step's second layer, after the first rebound a
                # replay to the cache's new length) would take Python's path to make them
                entry[1].native()
                if replay._entry is None:
                    replay._native_entry()
        if entry[3] is not None:
            try:
                self._by_shapes[entry[0], entry[3]] = entry
            except UNREADABLE:  # a probe that cannot be hashed
                pass
        self._put_first(entry)

    def _put_first(self, entry) -> None:
        if not self._recent or self._recent[0] is not entry:
            self._recent = [entry, *[e for e in self._recent if e is not entry][:self.RECENT - 1]]

    def get(self, key) -> Replay | None:
        """The replay of ``key``; None when there is none (yet, or ever: :meth:`run` knows)."""
        replay = self._replays.get(key)
        return replay or None

    def _file(self, key, replay) -> None:
        if len(self._replays) >= self.max_entries:
            self.clear()
        self._replays[key] = replay

    def run(self, key, inputs, run, family=None, probe=None):
        """``run()`` (the full path of a call whose key had no replay): recorded under a
        :class:`Recorder` of ``inputs`` and kept as a replay when it can be one (also as the
        replay of ``family`` when given, and for :meth:`quick` under ``probe`` when given); a call
        that cannot be replayed (the refusal does not depend on addresses) is remembered, so later
        calls of its key run the full path without recording. ``run`` returns a tuple of output
        tensors (None allowed), which is returned."""
        if key in self._replays:  # refused before
            return run()
        with Recorder(inputs) as rec:
            outputs = run()
        replay = rec.finish(outputs)
        self.last_refusal = rec.refusal
        if replay is not None or rec.refusal not in (None, "spoiled"):
            self._file(key, replay or False)
            if replay is not None and family is not None:
                base, detail = family
                self._families.setdefault(base, {})[detail] = replay
            if replay is not None and probe is not None:
                self._remember(probe, inputs, replay)
        return outputs

    def has_family(self, base) -> bool:
        """Whether a replay was filed under a family of ``base``."""
        try:
            return base in self._families
        except TypeError:  # an unhashable key: never filed
            return False

    def rebound(self, key, family, inputs, rebind, probe=None):
        """The outputs of the replay of ``family`` rebound to this call by ``rebind(replay) ->
        Replay | None`` and run on ``inputs`` (and kept for :meth:`quick` under ``probe`` when
        given); None when the family has no replay or ``rebind`` declines (then the caller takes
        the full path, :meth:`run` with ``family``)."""
        base, detail = family
        try:
            recorded = self._families.get(base, {}).get(detail)
        except TypeError:  # an unhashable key: never filed
            return None
        replay = None if recorded is None else rebind(recorded)
        if replay is None:
            return None
        self._file(key, replay)
        if probe is not None:
            self._remember(probe, inputs, replay)
        return replay.run(inputs, reuse_scratch=True)

    def clear(self) -> None:
        self._replays.clear()
        self._families.clear()
        self._recent = []
        self._entries.clear()
        self._by_shapes.clear()
        self.notes.clear()

    def __len__(self) -> int:
        """Keys with a replay."""
        return sum(1 for replay in self._replays.values() if replay)


# ---- the launcher -----------------------------------------------------------------------------


class Launcher:
    """``Launcher(kernel)(grid, *args, num_warps=..., **named)`` launches like ``kernel[grid]``.

    ``args`` are the kernel's leading parameters in order and ``named`` the rest by name (every
    parameter must be given: the kernels launched this way have no defaults). Returns the
    compiled kernel (None when interpreted).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.interpreted = is_interpreted(kernel)
        self.names = tuple(kernel.arg_names)
        self.keyers = parameter_keys(kernel)
        self.compiled = {}

    def __call__(self, grid, *args, num_warps: int, num_stages: int | None = None, **named):
        options = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        if not FAST_LAUNCH or self.interpreted:
            spoil_recording()
            return self.kernel[grid](*args, **named, **options)
        values = args + tuple([named[name] for name in self.names[len(args):]])
        device = driver.active.get_current_device()
        keyed = (tuple([keyer(v) for keyer, v in zip(self.keyers, values)])
                 if len(self.keyers) == len(values) else launch_key(values))
        key = (device, num_warps, num_stages, knobs.runtime.debug, knobs.compilation.instrumentation_mode, keyed)
        if len(named) + len(args) != len(values):  # compile options beyond the parameters
            key += (tuple(sorted((k, v) for k, v in named.items() if k not in self.names)),)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **named, **options)
            if len(self.compiled) >= MAX_KEYS:
                self.compiled.clear()
            self.compiled[key] = compiled
        else:
            stream = driver.active.get_current_stream(device)
            compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                         stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid, stream, *values),
                         knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
        rec = _recorder()
        if rec is not None:
            rec.add(compiled, grid, values, device, self)
        return compiled
