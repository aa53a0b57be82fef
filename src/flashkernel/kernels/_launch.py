"""Kernel launches with less host time: reuse the compiled kernel of an earlier launch.

A Triton launch (``kernel[grid](*args)``) binds and specializes every argument, builds a cache
key string and looks the compiled kernel up before it launches; for the ~50-argument decode
kernel that is a large part of an eager decode step's host time (docs/perf-notes.md). A
:class:`Launcher` keeps the compiled kernel of each launch it has seen under a key it computes
in one pass, and launches later calls with that key through the compiled kernel directly.

The key is every argument's value, except tensors, which contribute their dtype and whether
their address is 16-byte aligned, and TMA descriptors, which contribute their dtype, block shape,
layout and padding; plus the launch options (``num_warps``, ``num_stages``, any
other compile option passed by name), Triton's debug and instrumentation knobs, and the device.
Not re-checked on the fast path: Triton's ``pre_run_hooks`` and its test that globals read by
the kernel kept their values (ours read only constants fixed at import, such as
``decode._PTX_INDEX_LOADS``). Whatever Triton
specializes on (constexpr values, integers' ``== 1``, ``% 16`` and width, tensors' dtype and
alignment) is therefore a function of the key, so one key never needs two compiled kernels.
Integers are keyed by value, more finely than Triton needs: a new stride or batch size costs one
Triton launch to fill its entry, then runs fast; the table is cleared when it grows past
``MAX_KEYS``. Other scalars are keyed by type and value (``1``, ``1.0`` and ``True`` are three
Triton types).

Under Triton's interpreter, or with ``FLASHKERNEL_FAST_LAUNCH=0`` in the environment, every
launch goes through ``kernel[grid]`` as usual.
"""

from __future__ import annotations

import os

import torch
from triton import knobs
from triton.runtime import driver

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
    return type(value), value  # floats, bools, None, strings: 1.0, True and 1 stay apart


def launch_key(values) -> tuple:
    """The cache key of one launch's argument values (see the module docstring)."""
    return tuple([v if type(v) is int else _non_int_key(v) for v in values])


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
        self.compiled = {}

    def __call__(self, grid, *args, num_warps: int, num_stages: int | None = None, **named):
        options = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        if not FAST_LAUNCH or self.interpreted:
            return self.kernel[grid](*args, **named, **options)
        values = args + tuple([named[name] for name in self.names[len(args):]])
        device = driver.active.get_current_device()
        key = (device, num_warps, num_stages, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
               launch_key(values))
        if len(named) + len(args) != len(values):  # compile options beyond the parameters
            key += (tuple(sorted((k, v) for k, v in named.items() if k not in self.names)),)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **named, **options)
            if len(self.compiled) >= MAX_KEYS:
                self.compiled.clear()
            self.compiled[key] = compiled
            return compiled
        stream = driver.active.get_current_stream(device)
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values),
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
        return compiled
