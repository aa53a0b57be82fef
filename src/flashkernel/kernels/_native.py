"""A small C launcher for recorded launch sequences (``_launch.Replay``): one Python call
launches every kernel of a replayed call.

Triton's own launcher takes each launch's arguments as a Python tuple and parses all of them
(about fifty for the decode kernel) before ``cuLaunchKernel``. A replayed call knows everything
but the tensors' addresses in advance, so here each launch's parameters are packed once into a
buffer, in the kernel's parameter layout (the order and C types of Triton's generated launcher:
the non-constexpr arguments, tuples flattened, floats as their bit patterns, then Triton's two
scratch pointers), and a run only writes the addresses into their slots and launches.

Built on first use with the C compiler and CUDA headers Triton itself uses for its launchers
(and cached in Triton's cache directory). Only plain launches qualify: no TMA descriptors, one
CTA per cluster, no cooperative or programmatic-dependent launch, no scratch memory; anything
else, or a build that fails, keeps Triton's launcher (``_launch.Replay`` checks
:func:`launch_for` and :func:`module`). ``FLASHKERNEL_NATIVE_LAUNCH=0`` turns it off (read once).
"""

from __future__ import annotations

import functools
import os
import struct

ENABLED = os.environ.get("FLASHKERNEL_NATIVE_LAUNCH", "1") != "0"

_SOURCE = r"""
#include "cuda.h"
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  CUfunction function;
  unsigned int grid[3], block, shared;
  char *storage;            /* 8 bytes per parameter */
  void **params;
  Py_ssize_t nslots;
  int *slot_param, *slot_source;
  long long *slot_offset;
} Launch;

static void launch_free(PyObject *capsule) {
  Launch *l = (Launch *)PyCapsule_GetPointer(capsule, "flashkernel.Launch");
  if (!l) return;
  free(l->storage); free(l->params); free(l->slot_param); free(l->slot_source); free(l->slot_offset); free(l);
}

/* make(function, gx, gy, gz, block, shared, storage: bytes, slots: tuple of (param, source, offset)) */
static PyObject *make(PyObject *self, PyObject *args) {
  unsigned long long function;
  unsigned int gx, gy, gz, block, shared;
  Py_buffer storage;
  PyObject *slots;
  if (!PyArg_ParseTuple(args, "KIIIIIy*O!", &function, &gx, &gy, &gz, &block, &shared, &storage, &PyTuple_Type, &slots))
    return NULL;
  Py_ssize_t nparams = storage.len / 8, nslots = PyTuple_GET_SIZE(slots);
  Launch *l = (Launch *)calloc(1, sizeof(Launch));
  l->function = (CUfunction)(uintptr_t)function;
  l->grid[0] = gx; l->grid[1] = gy; l->grid[2] = gz; l->block = block; l->shared = shared;
  l->storage = (char *)malloc(storage.len > 0 ? storage.len : 8);
  memcpy(l->storage, storage.buf, storage.len);
  PyBuffer_Release(&storage);
  l->params = (void **)malloc(sizeof(void *) * (nparams > 0 ? nparams : 1));
  for (Py_ssize_t i = 0; i < nparams; i++) l->params[i] = l->storage + 8 * i;
  l->nslots = nslots;
  l->slot_param = (int *)malloc(sizeof(int) * (nslots + 1));
  l->slot_source = (int *)malloc(sizeof(int) * (nslots + 1));
  l->slot_offset = (long long *)malloc(sizeof(long long) * (nslots + 1));
  for (Py_ssize_t i = 0; i < nslots; i++) {
    PyObject *slot = PyTuple_GET_ITEM(slots, i);
    if (!PyArg_ParseTuple(slot, "iiL", &l->slot_param[i], &l->slot_source[i], &l->slot_offset[i])) {
      free(l->storage); free(l->params); free(l->slot_param); free(l->slot_source); free(l->slot_offset); free(l);
      return NULL;
    }
  }
  return PyCapsule_New(l, "flashkernel.Launch", launch_free);
}

/* run(stream, addresses: list of int or None, launches: tuple of capsules) */
static PyObject *run(PyObject *self, PyObject *args) {
  unsigned long long stream;
  PyObject *addresses, *launches;
  if (!PyArg_ParseTuple(args, "KO!O!", &stream, &PyList_Type, &addresses, &PyTuple_Type, &launches)) return NULL;
  CUcontext ctx;
  if (cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) {
    PyErr_SetString(PyExc_RuntimeError, "no current CUDA context");
    return NULL;
  }
  Py_ssize_t naddr = PyList_GET_SIZE(addresses);
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(launches); k++) {
    Launch *l = (Launch *)PyCapsule_GetPointer(PyTuple_GET_ITEM(launches, k), "flashkernel.Launch");
    if (!l) return NULL;
    for (Py_ssize_t i = 0; i < l->nslots; i++) {
      int source = l->slot_source[i];
      if (source < 0 || source >= naddr) {
        PyErr_SetString(PyExc_IndexError, "launch slot refers to a missing address");
        return NULL;
      }
      unsigned long long base = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(addresses, source));
      if (PyErr_Occurred()) return NULL;
      uint64_t ptr = base + (uint64_t)l->slot_offset[i];
      memcpy(l->storage + 8 * l->slot_param[i], &ptr, 8);
    }
    if (l->grid[0] * l->grid[1] * l->grid[2] == 0) continue;
    CUresult err = cuLaunchKernel(l->function, l->grid[0], l->grid[1], l->grid[2], l->block, 1, 1, l->shared,
                                  (CUstream)(uintptr_t)stream, l->params, NULL);
    if (err != CUDA_SUCCESS) {
      const char *msg = NULL;
      cuGetErrorString(err, &msg);
      PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: %s", msg ? msg : "unknown error");
      return NULL;
    }
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"make", make, METH_VARARGS, "pack one launch"},
  {"run", run, METH_VARARGS, "patch addresses and launch"},
  {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flashkernel_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_flashkernel_launch(void) { return PyModule_Create(&module); }
"""

# Scalar packing of Triton's launcher (``backends/nvidia/driver.py``: ``ty_to_cpp`` and the
# float storage types): each parameter one little-endian 8-byte word (``_WORD_CODES``).


@functools.lru_cache(maxsize=None)
def module():
    """The compiled C module, or None where it cannot be built (no compiler, no CUDA driver)."""
    if not ENABLED:
        return None
    try:
        from triton.backends.nvidia import driver as nvidia
        from triton.runtime.build import compile_module_from_src

        return compile_module_from_src(_SOURCE, "flashkernel_launch", library_dirs=nvidia.library_dirs(),
                                       include_dirs=nvidia.include_dirs, libraries=nvidia.libraries)
    except Exception:  # noqa: BLE001 - any failure keeps Triton's launcher
        return None


# struct codes of one 8-byte parameter word per scalar type (the value, then zero padding)
_WORD_CODES = {"i1": "b7x", "i8": "b7x", "i16": "h6x", "i32": "i4x", "i64": "q",
               "u1": "B7x", "u8": "B7x", "u16": "H6x", "u32": "I4x", "u64": "Q",
               "fp32": "f4x", "f32": "f4x", "fp64": "d", "fp16": "e6x"}


@functools.lru_cache(maxsize=1024)
def _packing(signature: tuple) -> tuple | None:
    """How to pack a launch of ``signature`` (its ``(name, type)`` items): the struct format of
    the parameter buffer and, per parameter, ``(argument, element or -1, kind)`` with kind
    ``"ptr"``, ``"int"`` or ``"float"``; None if a parameter is not a plain scalar or pointer.
    Computed once per signature, so recording a launch packs its parameters in one call."""
    codes, entries = ["<"], []
    for arg, (_, ty) in enumerate(signature):
        if isinstance(ty, tuple) and any(isinstance(t, tuple) for t in ty):
            return None  # nested tuples: not in our kernels
        for element, t in (enumerate(ty) if isinstance(ty, tuple) else [(-1, ty)]):
            if t == "constexpr":
                continue
            if t.startswith("*"):
                codes.append("Q")
                entries.append((arg, element, "ptr"))
            elif t in _WORD_CODES:
                codes.append(_WORD_CODES[t])
                entries.append((arg, element, "float" if t[0] == "f" else "int"))
            else:
                return None  # bf16 scalars, TMA descriptors, ...
    codes.append("16x")  # Triton's global and profile scratch pointers (none: checked by the caller)
    return "".join(codes), tuple(entries)


def pack(signature: dict, values, pointer_slots: dict) -> tuple[bytes, tuple] | None:
    """The parameter buffer of one launch and its address slots, or None if a parameter's type
    is not a plain scalar or pointer.

    ``values``: the launch's arguments in the kernel's order (tensors replaced by None);
    ``pointer_slots``: argument index -> ``(source, byte offset)`` of the address it takes.
    Returns ``(bytes, ((parameter index, source, offset), ...))``.
    """
    packing = _packing(tuple(signature.items()))
    if packing is None:
        return None
    fmt, entries = packing
    words = [values[arg] if element < 0 else values[arg][element] for arg, element, _ in entries]
    slots = []
    for param, (arg, element, kind) in enumerate(entries):
        if kind == "ptr":
            if element < 0 and arg in pointer_slots:
                slots.append((param, *pointer_slots[arg]))
                words[param] = 0
            else:
                words[param] = int(words[param] or 0)
    try:
        return struct.pack(fmt, *words), tuple(slots)
    except struct.error:  # a scalar that is not a Python int / float (e.g. a numpy integer)
        words = [int(w) if kind != "float" else float(w) for w, (_, _, kind) in zip(words, entries)]
        return struct.pack(fmt, *words), tuple(slots)


def launch_for(compiled, grid, values, pointer_slots: dict):
    """A packed launch (a capsule of the C module) for one recorded launch, or None when it does
    not qualify (see the module docstring)."""
    native = module()
    if native is None:
        return None
    runner = compiled.run
    if (getattr(runner, "global_scratch_size", 0) or getattr(runner, "profile_scratch_size", 0)
            or getattr(runner, "launch_cooperative_grid", False) or getattr(runner, "launch_pdl", False)):
        return None
    num_warps, num_ctas, shared = compiled.packed_metadata
    if num_ctas != 1:
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict) or len(signature) != len(values):
        return None
    packed = pack(signature, values, pointer_slots)
    if packed is None:
        return None
    storage, slots = packed
    return native.make(compiled.function, grid[0], grid[1], grid[2], 32 * num_warps, shared, storage, slots)
