"""A small C launcher for recorded launch sequences (``_launch.Replay``): one Python call
launches every kernel of a replayed call.

Triton's own launcher takes each launch's arguments as a Python tuple and parses all of them
(about fifty for the decode kernel) before ``cuLaunchKernel``. A replayed call knows everything
but the tensors' addresses in advance, so here each launch's parameters are packed once into a
buffer, in the kernel's parameter layout (the order and C types of Triton's generated launcher:
the non-constexpr arguments, tuples flattened, floats as their bit patterns, then Triton's two
scratch pointers), and a run only writes the addresses into their slots and launches.

Host-side TMA descriptors (the Gluon kernels' ``TensorDescriptor`` arguments) are encoded once,
when the launch is packed, from the recorded descriptor and Triton's compiled metadata (swizzle,
element type, box), exactly as Triton's launcher encodes them per call; a run only puts the new
base address into each (``cuTensorMapReplaceAddress``). Shape, strides and box cannot change
between runs: they are part of the replay's key.

Built on first use with the C compiler and CUDA headers Triton itself uses for its launchers
(and cached in Triton's cache directory). Only plain launches qualify: one CTA per cluster, no
cooperative or programmatic-dependent launch, no scratch memory, descriptors only where the
kernel takes them as ``CUtensorMap`` parameters; anything else, or a build that fails, keeps
Triton's launcher (``_launch.Replay`` checks :func:`launch_for` and :func:`module`).
``FLASHKERNEL_NATIVE_LAUNCH=0`` turns it off (read once).
"""

from __future__ import annotations

import functools
import os
import re
import struct
from typing import NamedTuple

import torch

ENABLED = os.environ.get("FLASHKERNEL_NATIVE_LAUNCH", "1") != "0"
MAX_SOURCES = 256  # addresses per run (inputs and allocations): the C code's MAX_SOURCES

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
  Py_ssize_t nparams;
  void **params;
  Py_ssize_t nslots;
  int *slot_param, *slot_source;
  long long *slot_offset;
  Py_ssize_t nmaps;         /* TMA descriptors passed by value */
  CUtensorMap *maps;        /* 64-byte aligned, as cuTensorMapEncodeTiled wants */
  int *map_source;
} Launch;

static void launch_free_fields(Launch *l) {
  free(l->storage); free(l->params); free(l->slot_param); free(l->slot_source); free(l->slot_offset);
  free(l->maps); free(l->map_source); free(l);
}

static void launch_free(PyObject *capsule) {
  Launch *l = (Launch *)PyCapsule_GetPointer(capsule, "flashkernel.Launch");
  if (l) launch_free_fields(l);
}

/* Raise RuntimeError("<what> failed: <driver message>"); returns -1. */
static int cuda_error(CUresult err, const char *what) {
  const char *msg = NULL;
  cuGetErrorString(err, &msg);
  PyErr_Format(PyExc_RuntimeError, "%s failed: %s", what, msg ? msg : "unknown error");
  return -1;
}

/* Encode one descriptor from (param, source, address, data type, dims, byte strides, box, swizzle,
   fill): dims and box innermost first, the rank - 1 strides of the outer dims in bytes. */
static int encode_map(CUtensorMap *map, PyObject *spec, int *param, int *source) {
  unsigned long long address;
  int data_type, swizzle, fill;
  PyObject *dims, *strides, *box;
  if (!PyArg_ParseTuple(spec, "iiKiO!O!O!ii", param, source, &address, &data_type, &PyTuple_Type, &dims,
                        &PyTuple_Type, &strides, &PyTuple_Type, &box, &swizzle, &fill))
    return -1;
  Py_ssize_t rank = PyTuple_GET_SIZE(dims);
  if (rank < 1 || rank > 5 || PyTuple_GET_SIZE(box) != rank || PyTuple_GET_SIZE(strides) != rank - 1) {
    PyErr_SetString(PyExc_ValueError, "tensor map: dims, strides and box disagree on the rank");
    return -1;
  }
  cuuint64_t dim[5], stride[5];
  cuuint32_t box_dim[5], element_stride[5] = {1, 1, 1, 1, 1};
  for (Py_ssize_t i = 0; i < rank; i++) {
    dim[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(dims, i));
    box_dim[i] = (cuuint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(box, i));
    if (i + 1 < rank) stride[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(strides, i));
    if (PyErr_Occurred()) return -1;
  }
  CUresult err = cuTensorMapEncodeTiled(map, (CUtensorMapDataType)data_type, (cuuint32_t)rank,
                                        (void *)(uintptr_t)address, dim, stride, box_dim, element_stride,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, (CUtensorMapSwizzle)swizzle,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B, (CUtensorMapFloatOOBfill)fill);
  if (err != CUDA_SUCCESS) return cuda_error(err, "cuTensorMapEncodeTiled");
  return 0;
}

/* make(function, gx, gy, gz, block, shared, storage: bytes, slots: tuple of (param, source, offset),
        maps: tuple of encode_map specs) */
static PyObject *make(PyObject *self, PyObject *args) {
  unsigned long long function;
  unsigned int gx, gy, gz, block, shared;
  Py_buffer storage;
  PyObject *slots, *maps;
  if (!PyArg_ParseTuple(args, "KIIIIIy*O!O!", &function, &gx, &gy, &gz, &block, &shared, &storage,
                        &PyTuple_Type, &slots, &PyTuple_Type, &maps))
    return NULL;
  Py_ssize_t nparams = storage.len / 8, nslots = PyTuple_GET_SIZE(slots), nmaps = PyTuple_GET_SIZE(maps);
  Launch *l = (Launch *)calloc(1, sizeof(Launch));
  if (!l) {
    PyBuffer_Release(&storage);
    return PyErr_NoMemory();
  }
  l->function = (CUfunction)(uintptr_t)function;
  l->grid[0] = gx; l->grid[1] = gy; l->grid[2] = gz; l->block = block; l->shared = shared;
  l->nparams = nparams;
  l->storage = (char *)malloc(storage.len > 0 ? storage.len : 8);
  if (l->storage) memcpy(l->storage, storage.buf, storage.len);
  PyBuffer_Release(&storage);
  l->params = (void **)malloc(sizeof(void *) * (nparams > 0 ? nparams : 1));
  l->nslots = nslots;
  l->slot_param = (int *)malloc(sizeof(int) * (nslots + 1));
  l->slot_source = (int *)malloc(sizeof(int) * (nslots + 1));
  l->slot_offset = (long long *)malloc(sizeof(long long) * (nslots + 1));
  l->map_source = (int *)malloc(sizeof(int) * (nmaps + 1));
  if (!l->storage || !l->params || !l->slot_param || !l->slot_source || !l->slot_offset || !l->map_source) {
    launch_free_fields(l);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < nparams; i++) l->params[i] = l->storage + 8 * i;
  for (Py_ssize_t i = 0; i < nslots; i++) {
    PyObject *slot = PyTuple_GET_ITEM(slots, i);
    if (!PyArg_ParseTuple(slot, "iiL", &l->slot_param[i], &l->slot_source[i], &l->slot_offset[i])) {
      launch_free_fields(l);
      return NULL;
    }
  }
  l->nmaps = nmaps;
  if (posix_memalign((void **)&l->maps, 64, sizeof(CUtensorMap) * (nmaps + 1)) != 0) {
    l->maps = NULL;
    launch_free_fields(l);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < nmaps; i++) {
    int param;
    if (encode_map(&l->maps[i], PyTuple_GET_ITEM(maps, i), &param, &l->map_source[i]) != 0) {
      launch_free_fields(l);
      return NULL;
    }
    if (param < 0 || param >= nparams) {
      launch_free_fields(l);
      PyErr_SetString(PyExc_IndexError, "tensor map parameter out of range");
      return NULL;
    }
    l->params[param] = &l->maps[i];
  }
  PyObject *capsule = PyCapsule_New(l, "flashkernel.Launch", launch_free);
  if (!capsule) launch_free_fields(l);
  return capsule;
}

/* The parameters packed for launch k in storages (a tuple of bytes, one per launch) into l's
   buffer: replays that share a launch (other scalar values, the same kernel and grid) each write
   their own before launching. No Python code runs between this copy and the launch (launch_all
   calls none; checked_run's calls into Python all come before it), so no other run interleaves. */
static int restore_storage(Launch *l, PyObject *storages, Py_ssize_t k) {
  if (storages == Py_None) return 0;
  if (!PyTuple_Check(storages) || k >= PyTuple_GET_SIZE(storages)) {
    PyErr_SetString(PyExc_ValueError, "storages: one bytes object per launch");
    return -1;
  }
  PyObject *item = PyTuple_GET_ITEM(storages, k);
  if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) != 8 * l->nparams) {
    PyErr_SetString(PyExc_ValueError, "storages: a launch's parameters have another size");
    return -1;
  }
  memcpy(l->storage, PyBytes_AS_STRING(item), 8 * l->nparams);
  return 0;
}

/* Launch every capsule of `launches` with `addresses` (present[j]: whether source j has one). */
static int launch_all(unsigned long long stream, const uint64_t *addresses, const char *present, Py_ssize_t n,
                      PyObject *launches, PyObject *storages) {
  CUcontext ctx;
  if (cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) {
    PyErr_SetString(PyExc_RuntimeError, "no current CUDA context");
    return -1;
  }
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(launches); k++) {
    Launch *l = (Launch *)PyCapsule_GetPointer(PyTuple_GET_ITEM(launches, k), "flashkernel.Launch");
    if (!l || restore_storage(l, storages, k) != 0) return -1;
    for (Py_ssize_t i = 0; i < l->nslots + l->nmaps; i++) {
      int source = i < l->nslots ? l->slot_source[i] : l->map_source[i - l->nslots];
      if (source < 0 || source >= n || !present[source]) {
        PyErr_SetString(PyExc_IndexError, "a launch parameter refers to a missing address");
        return -1;
      }
      if (i < l->nslots) {
        uint64_t ptr = addresses[source] + (uint64_t)l->slot_offset[i];
        memcpy(l->storage + 8 * l->slot_param[i], &ptr, 8);
        continue;
      }
      CUresult err = cuTensorMapReplaceAddress(&l->maps[i - l->nslots], (void *)(uintptr_t)addresses[source]);
      if (err != CUDA_SUCCESS) return cuda_error(err, "cuTensorMapReplaceAddress");
    }
    if (l->grid[0] * l->grid[1] * l->grid[2] == 0) continue;
    CUresult err = cuLaunchKernel(l->function, l->grid[0], l->grid[1], l->grid[2], l->block, 1, 1, l->shared,
                                  (CUstream)(uintptr_t)stream, l->params, NULL);
    if (err != CUDA_SUCCESS) return cuda_error(err, "cuLaunchKernel");
  }
  return 0;
}

#define MAX_SOURCES 256

/* run(stream, addresses: list of int or None, launches: tuple of capsules[, storages: tuple of
       bytes or None]) */
static PyObject *run(PyObject *self, PyObject *args) {
  unsigned long long stream;
  PyObject *addresses, *launches, *storages = Py_None;
  if (!PyArg_ParseTuple(args, "KO!O!|O", &stream, &PyList_Type, &addresses, &PyTuple_Type, &launches, &storages))
    return NULL;
  Py_ssize_t n = PyList_GET_SIZE(addresses);
  if (n > MAX_SOURCES) {
    PyErr_SetString(PyExc_ValueError, "too many addresses for one run");
    return NULL;
  }
  uint64_t values[MAX_SOURCES];
  char present[MAX_SOURCES];
  for (Py_ssize_t j = 0; j < n; j++) {
    PyObject *item = PyList_GET_ITEM(addresses, j);
    present[j] = item != Py_None;
    if (present[j]) {
      values[j] = PyLong_AsUnsignedLongLong(item);
      if (PyErr_Occurred()) return NULL;
    }
  }
  if (launch_all(stream, values, present, n, launches, storages) != 0) return NULL;
  Py_RETURN_NONE;
}

/* ---- runs checked in one call ------------------------------------------------------------
   A guard (made by `guard`) holds what _launch.LayoutGuard checks per call: PyTorch's C++
   tensor guard (its bound `check`), called with the first tensor at each address, then each
   slot's None-ness and address alignment, which slots hold one tensor, and how many distinct
   addresses there are. `checked_run` does all of it and the launches with the addresses read
   here (PyTorch's exported data-pointer function, the one Inductor's C++ wrappers call). */

static void *(*tensor_data_ptr)(PyObject *) = NULL;
static PyTypeObject *tensor_type = NULL;
static PyObject *is_nested_name = NULL;

typedef struct {
  PyObject *check;
  Py_ssize_t nslots, nchecked, nsame, distinct;
  int *alignment;           /* per slot: address & 15, or -1 where the examples had None */
  int *checked;             /* the slots passed to check */
  int *same;                /* pairs (slot, earlier slot holding the same tensor) */
  /* runs into the caller's output (NULL out_check: none) */
  PyObject *out_check;      /* the C++ guard's check of the output's layout */
  unsigned long long out_bytes;
  unsigned long long *extent; /* per slot: bytes from its address to one past its last element */
  Py_ssize_t nspans;
  unsigned long long *span;   /* pairs (start, bytes) of tensors the caller holds for every run */
} Guard;

static void guard_free_fields(Guard *g) {
  Py_XDECREF(g->check);
  Py_XDECREF(g->out_check);
  free(g->alignment); free(g->checked); free(g->same); free(g->extent); free(g->span); free(g);
}

static void guard_free(PyObject *capsule) {
  Guard *g = (Guard *)PyCapsule_GetPointer(capsule, "flashkernel.Guard");
  if (g) guard_free_fields(g);
}

/* setup(data_ptr_function: int, tensor_type: type, example: tensor_type) -> the example's address
   as read through the function (the caller compares it with example.data_ptr()) */
static PyObject *setup(PyObject *self, PyObject *args) {
  unsigned long long function;
  PyObject *type, *example;
  if (!PyArg_ParseTuple(args, "KO!O", &function, &PyType_Type, &type, &example)) return NULL;
  if (!PyObject_TypeCheck(example, (PyTypeObject *)type)) {
    PyErr_SetString(PyExc_TypeError, "setup: the example is not of the tensor type");
    return NULL;
  }
  if (!is_nested_name && !(is_nested_name = PyUnicode_InternFromString("is_nested"))) return NULL;
  Py_INCREF(type);
  Py_XDECREF((PyObject *)tensor_type);
  tensor_type = (PyTypeObject *)type;
  tensor_data_ptr = (void *(*)(PyObject *))(uintptr_t)function;
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)tensor_data_ptr(example));
}

/* guard(check, alignments: tuple of int or None, checked: tuple of int, same: tuple of (int, int),
         distinct: number of distinct addresses among the examples' tensors[, out_check, out_bytes,
         extents: tuple of int or None per slot, spans: tuple of (start, bytes)]) */
static PyObject *guard(PyObject *self, PyObject *args) {
  PyObject *check, *alignments, *checked, *same, *out_check = NULL, *extents = NULL, *spans = NULL;
  Py_ssize_t distinct;
  unsigned long long out_bytes = 0;
  if (!PyArg_ParseTuple(args, "OO!O!O!n|OKO!O!", &check, &PyTuple_Type, &alignments, &PyTuple_Type, &checked,
                        &PyTuple_Type, &same, &distinct, &out_check, &out_bytes, &PyTuple_Type, &extents,
                        &PyTuple_Type, &spans))
    return NULL;
  if (out_check && (!extents || !spans)) {
    PyErr_SetString(PyExc_TypeError, "guard: an output check needs the extents and spans");
    return NULL;
  }
  Guard *g = (Guard *)calloc(1, sizeof(Guard));
  if (!g) return PyErr_NoMemory();
  g->nslots = PyTuple_GET_SIZE(alignments);
  g->nchecked = PyTuple_GET_SIZE(checked);
  g->nsame = PyTuple_GET_SIZE(same);
  g->nspans = spans ? PyTuple_GET_SIZE(spans) : 0;
  g->distinct = distinct;
  g->out_bytes = out_bytes;
  g->alignment = (int *)malloc(sizeof(int) * (g->nslots + 1));
  g->checked = (int *)malloc(sizeof(int) * (g->nchecked + 1));
  g->same = (int *)malloc(sizeof(int) * (2 * g->nsame + 1));
  g->extent = (unsigned long long *)calloc(g->nslots + 1, sizeof(unsigned long long));
  g->span = (unsigned long long *)malloc(sizeof(unsigned long long) * (2 * g->nspans + 1));
  if (!g->alignment || !g->checked || !g->same || !g->extent || !g->span) {
    guard_free_fields(g);
    return PyErr_NoMemory();
  }
  if (g->nslots > MAX_SOURCES || g->nchecked > g->nslots || (extents && PyTuple_GET_SIZE(extents) != g->nslots)) {
    guard_free_fields(g);
    PyErr_SetString(PyExc_ValueError, "guard: more slots than a run takes, or slots and extents disagree");
    return NULL;
  }
  int bad = 0;
  for (Py_ssize_t i = 0; i < g->nslots && !bad; i++) {
    PyObject *item = PyTuple_GET_ITEM(alignments, i);
    g->alignment[i] = item == Py_None ? -1 : (int)PyLong_AsLong(item);
    item = extents ? PyTuple_GET_ITEM(extents, i) : Py_None;
    if (item != Py_None) g->extent[i] = PyLong_AsUnsignedLongLong(item);
    bad = PyErr_Occurred() != NULL;
  }
  for (Py_ssize_t i = 0; i < g->nchecked && !bad; i++) {
    g->checked[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(checked, i));
    bad = PyErr_Occurred() != NULL || g->checked[i] < 0 || g->checked[i] >= g->nslots;
  }
  for (Py_ssize_t i = 0; i < g->nsame && !bad; i++)
    bad = !PyArg_ParseTuple(PyTuple_GET_ITEM(same, i), "ii", &g->same[2 * i], &g->same[2 * i + 1])
          || g->same[2 * i] < 0 || g->same[2 * i] >= g->nslots || g->same[2 * i + 1] < 0
          || g->same[2 * i + 1] >= g->nslots;
  for (Py_ssize_t i = 0; i < g->nspans && !bad; i++)
    bad = !PyArg_ParseTuple(PyTuple_GET_ITEM(spans, i), "KK", &g->span[2 * i], &g->span[2 * i + 1]);
  if (bad || PyErr_Occurred()) {
    guard_free_fields(g);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "guard: a slot index out of range");
    return NULL;
  }
  Py_INCREF(check);
  g->check = check;
  Py_XINCREF(out_check);
  g->out_check = out_check;
  PyObject *capsule = PyCapsule_New(g, "flashkernel.Guard", guard_free);
  if (!capsule) guard_free_fields(g);
  return capsule;
}

/* After a failed call on a tensor: 0 (turned away, the error cleared) for what a bad argument
   raises (AttributeError, TypeError, RuntimeError), -1 for anything else, which the caller sees. */
static int turned_away(void) {
  if (!PyErr_ExceptionMatches(PyExc_AttributeError) && !PyErr_ExceptionMatches(PyExc_TypeError)
      && !PyErr_ExceptionMatches(PyExc_RuntimeError))
    return -1;
  PyErr_Clear();
  return 0;
}

/* 1 when `check` vouches for tensor x (a plain strided tensor of the checked layout), 0 when not,
   -1 with an exception the caller must see. */
static int tensor_passes(PyObject *check, PyObject *const *x, Py_ssize_t n) {
  for (Py_ssize_t i = 0; i < n; i++) {
    if (!PyObject_TypeCheck(x[i], tensor_type)) return 0;
    /* the C++ guards read a nested tensor's strides, which aborts */
    PyObject *nested = PyObject_GetAttr(x[i], is_nested_name);
    if (!nested) return turned_away();
    int is_nested = PyObject_IsTrue(nested);
    Py_DECREF(nested);
    if (is_nested != 0) return is_nested < 0 ? -1 : 0;
  }
  PyObject *ok = PyObject_Vectorcall(check, x, (size_t)n, NULL);
  if (!ok) return turned_away();
  int passes = PyObject_IsTrue(ok);
  Py_DECREF(ok);
  return passes;
}

/* 1 when the guard vouches for `tensors`' layouts (not yet their addresses), 0 when not (a
   non-tensor, a nested tensor, another layout: the caller's full path says what), -1 with an
   exception the caller must see. */
static int guard_passes(Guard *g, PyObject *tensors) {
  if (PyTuple_GET_SIZE(tensors) != g->nslots) return 0;
  PyObject *checked[MAX_SOURCES];
  for (Py_ssize_t i = 0; i < g->nchecked; i++) checked[i] = PyTuple_GET_ITEM(tensors, g->checked[i]);
  int passes = tensor_passes(g->check, checked, g->nchecked);
  if (passes <= 0) return passes;
  for (Py_ssize_t i = 0; i < g->nsame; i++)
    if (PyTuple_GET_ITEM(tensors, g->same[2 * i]) != PyTuple_GET_ITEM(tensors, g->same[2 * i + 1])) return 0;
  return 1;
}

/* 1 when `out` can take the run's output directly: the checked layout, a 16-byte aligned address
   and no byte shared with an input (at addresses[]) or a held span; 0 when not, -1 on an error. */
static int output_passes(Guard *g, PyObject *out, const uint64_t *addresses, const char *present) {
  int passes = tensor_passes(g->out_check, &out, 1);
  if (passes <= 0) return passes;
  uint64_t start = (uint64_t)(uintptr_t)tensor_data_ptr(out), end = start + g->out_bytes;
  if (start & 15) return 0;
  for (Py_ssize_t i = 0; i < g->nslots; i++)
    if (present[i] && g->extent[i] && addresses[i] < end && start < addresses[i] + g->extent[i]) return 0;
  for (Py_ssize_t i = 0; i < g->nspans; i++)
    if (g->span[2 * i + 1] && g->span[2 * i] < end && start < g->span[2 * i] + g->span[2 * i + 1]) return 0;
  return 1;
}

/* Read the address of each item of `items` (a tuple or list of dense tensors or None: the data
   pointer function throws a C++ exception, which ends the process, for a tensor without storage)
   into addresses[offset...]; -1 with TypeError for an item that is not a tensor. */
static int read_addresses(PyObject *items, uint64_t *addresses, char *present, Py_ssize_t offset) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  PyObject **item = PySequence_Fast_ITEMS(items);
  if (offset + n > MAX_SOURCES) {
    PyErr_SetString(PyExc_ValueError, "too many addresses for one run");
    return -1;
  }
  for (Py_ssize_t j = 0; j < n; j++) {
    present[offset + j] = item[j] != Py_None;
    if (!present[offset + j]) continue;
    if (!PyObject_TypeCheck(item[j], tensor_type)) {
      PyErr_SetString(PyExc_TypeError, "checked_run: an address source that is not a tensor");
      return -1;
    }
    addresses[offset + j] = (uint64_t)(uintptr_t)tensor_data_ptr(item[j]);
  }
  return 0;
}

/* A run's buffers from `spec`, a tuple (kept, makers): a copy of the list `kept` (the kept
   temporaries, None at the outputs), then for each maker (index, takes_out, make, args) the buffer
   at index: `out` where takes_out is true and `out` is not None, else make(*args). Python runs no
   frame of its own here when `make` is a C function (PyTorch's allocator). */
static PyObject *made_buffers(PyObject *spec, PyObject *out) {
  if (PyTuple_GET_SIZE(spec) != 2 || !PyList_Check(PyTuple_GET_ITEM(spec, 0))
      || !PyTuple_Check(PyTuple_GET_ITEM(spec, 1))) {
    PyErr_SetString(PyExc_TypeError, "checked_run: buffers must be (kept: list, makers: tuple)");
    return NULL;
  }
  PyObject *kept = PyTuple_GET_ITEM(spec, 0), *makers = PyTuple_GET_ITEM(spec, 1);
  PyObject *buffers = PyList_GetSlice(kept, 0, PyList_GET_SIZE(kept));
  if (!buffers) return NULL;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(makers); i++) {
    PyObject *maker = PyTuple_GET_ITEM(makers, i);
    if (!PyTuple_Check(maker) || PyTuple_GET_SIZE(maker) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(maker, 3))) {
      PyErr_SetString(PyExc_TypeError, "checked_run: a maker must be (index, takes_out, make, args: tuple)");
      goto fail;
    }
    Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(maker, 0));
    if (index == -1 && PyErr_Occurred()) goto fail;
    if (index < 0 || index >= PyList_GET_SIZE(buffers)) {
      PyErr_SetString(PyExc_IndexError, "checked_run: a maker's index is past the buffers");
      goto fail;
    }
    int takes_out = PyObject_IsTrue(PyTuple_GET_ITEM(maker, 1));
    if (takes_out < 0) goto fail;
    PyObject *made;
    if (takes_out && out != Py_None) {
      made = out;
      Py_INCREF(made);
    } else {
      made = PyObject_Call(PyTuple_GET_ITEM(maker, 2), PyTuple_GET_ITEM(maker, 3), NULL);
      if (!made) goto fail;
    }
    PyList_SetItem(buffers, index, made); /* steals made, releases what was there */
  }
  return buffers;
fail:
  Py_DECREF(buffers);
  return NULL;
}

/* The tuple of buffers[j] for each j of `outputs` (None for None). */
static PyObject *picked_outputs(PyObject *buffers, PyObject *outputs) {
  Py_ssize_t n = PyTuple_GET_SIZE(outputs);
  PyObject *picked = PyTuple_New(n);
  if (!picked) return NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *index = PyTuple_GET_ITEM(outputs, i), *item = Py_None;
    if (index != Py_None) {
      Py_ssize_t j = PyLong_AsSsize_t(index);
      if (j == -1 && PyErr_Occurred()) {
        Py_DECREF(picked);
        return NULL;
      }
      if (j < 0 || j >= PyList_GET_SIZE(buffers)) {
        Py_DECREF(picked);
        PyErr_SetString(PyExc_IndexError, "checked_run: an output index past the buffers");
        return NULL;
      }
      item = PyList_GET_ITEM(buffers, j);
    }
    Py_INCREF(item);
    PyTuple_SET_ITEM(picked, i, item);
  }
  return picked;
}

/* checked_run(guard, tensors: tuple, fixed: tuple, buffers_for, stream: int, capturing, launches,
               storages[, out[, outputs]]): if the guard vouches for `tensors` (and for `out`, when
   not None: see output_passes), the run's buffers (allocated only then: `buffers_for(stream,
   capturing, out)`, a list of tensors or None, or made here from a tuple `buffers_for`, see
   made_buffers), launched as `run` with the addresses of tensors, then fixed, then buffers; None
   (nothing launched) if not. Returns the buffers, or with `outputs` (a tuple of buffer indices or
   None) the tuple of those buffers (None for None). */
static PyObject *checked_core(PyObject *capsule, PyObject *tensors, PyObject *fixed, PyObject *buffers_for,
                              PyObject *stream_object, PyObject *capturing, PyObject *launches, PyObject *storages,
                              PyObject *out, PyObject *outputs) {
  if (outputs != Py_None && !PyTuple_Check(outputs)) {
    PyErr_SetString(PyExc_TypeError, "checked_run: outputs must be a tuple or None");
    return NULL;
  }
  if (!tensor_data_ptr) {
    PyErr_SetString(PyExc_RuntimeError, "checked_run before setup");
    return NULL;
  }
  Guard *g = (Guard *)PyCapsule_GetPointer(capsule, "flashkernel.Guard");
  if (!g) return NULL;
  if (out != Py_None && !g->out_check) {
    PyErr_SetString(PyExc_TypeError, "checked_run: an output for a guard made without an output check");
    return NULL;
  }
  unsigned long long stream = PyLong_AsUnsignedLongLong(stream_object);
  if (PyErr_Occurred()) return NULL;
  int passes = guard_passes(g, tensors);
  if (passes <= 0) {
    if (passes < 0) return NULL;
    Py_RETURN_NONE;
  }
  uint64_t addresses[MAX_SOURCES];
  char present[MAX_SOURCES];
  Py_ssize_t distinct = 0;
  for (Py_ssize_t i = 0; i < g->nslots; i++) {
    PyObject *x = PyTuple_GET_ITEM(tensors, i);
    present[i] = x != Py_None;
    if (present[i] != (g->alignment[i] >= 0)) Py_RETURN_NONE;
    if (!present[i]) continue;
    if (!PyObject_TypeCheck(x, tensor_type)) Py_RETURN_NONE;
    addresses[i] = (uint64_t)(uintptr_t)tensor_data_ptr(x);
    if ((int)(addresses[i] & 15) != g->alignment[i]) Py_RETURN_NONE;
    Py_ssize_t k = 0;
    while (k < i && !(present[k] && addresses[k] == addresses[i])) k++;
    distinct += k == i;
  }
  /* as many distinct addresses as the examples had, and one tensor where they had one address
     (checked above): the same partition of the slots */
  if (distinct != g->distinct) Py_RETURN_NONE;
  if (out != Py_None) {
    int fits = output_passes(g, out, addresses, present);
    if (fits <= 0) {
      if (fits < 0) return NULL;
      Py_RETURN_NONE;
    }
  }
  if (read_addresses(fixed, addresses, present, g->nslots) != 0) return NULL;
  PyObject *buffers;
  if (PyTuple_Check(buffers_for)) {
    buffers = made_buffers(buffers_for, out);
  } else {
    PyObject *call_args[3] = {stream_object, capturing, out};
    buffers = PyObject_Vectorcall(buffers_for, call_args, 3, NULL);
  }
  if (!buffers) return NULL;
  if (!PyList_Check(buffers)) {
    Py_DECREF(buffers);
    PyErr_SetString(PyExc_TypeError, "checked_run: buffers_for must return a list");
    return NULL;
  }
  Py_ssize_t n = g->nslots + PyTuple_GET_SIZE(fixed) + PyList_GET_SIZE(buffers);
  if (read_addresses(buffers, addresses, present, g->nslots + PyTuple_GET_SIZE(fixed)) != 0
      || launch_all(stream, addresses, present, n, launches, storages) != 0) {
    Py_DECREF(buffers);
    return NULL;
  }
  if (outputs == Py_None) return buffers;
  PyObject *picked = picked_outputs(buffers, outputs);
  Py_DECREF(buffers);
  return picked;
}

static PyObject *checked_run(PyObject *self, PyObject *args) {
  PyObject *capsule, *tensors, *fixed, *buffers_for, *stream_object, *capturing, *launches, *storages;
  PyObject *out = Py_None, *outputs = Py_None;
  if (!PyArg_ParseTuple(args, "OO!O!OO!OO!O|OO", &capsule, &PyTuple_Type, &tensors, &PyTuple_Type, &fixed,
                        &buffers_for, &PyLong_Type, &stream_object, &capturing, &PyTuple_Type, &launches, &storages,
                        &out, &outputs))
    return NULL;
  return checked_core(capsule, tensors, fixed, buffers_for, stream_object, capturing, launches, storages, out,
                      outputs);
}

/* ---- a replay's run from Python's state in one call ---------------------------------------
   What _launch.Replay.run_checked and plans._Plan's fast path do in Python before checked_run
   (the current device and stream, the capture state, the run's buffers for that stream, the
   temporaries' lock; for a plan also the differentiation modes and the inference mode), asked
   here of the same functions, found in _launch's module dict (setup_runs). Where Python has a
   step to take first (another current device, no buffers made yet for this stream, a
   differentiation mode active, no replay recorded yet) the call returns NotImplemented and
   launches nothing. */

/* _launch's globals, and the names read there on every run (so what a test puts in place of one
   of those functions is what runs) */
static PyObject *rt_globals = NULL;
enum { G_DEVICE, G_STREAM, G_CAPTURING, G_INFERENCE, G_FORWARD_AD, G_FUNCTORCH_LEVEL, G_BUMP, G_EMPTY, G_COUNT };
static const char *global_names[G_COUNT] = {"_current_device", "_raw_stream", "stream_capturing", "_inference_mode",
                                            "_forward_ad", "_functorch_level", "_bump_versions", "empty"};
static PyObject *global_keys[G_COUNT];
static PyObject *s_level = NULL, *s_acquire = NULL, *s_release = NULL;

/* setup_runs(launch_globals: dict): _launch's module dict, where replay_run and plan_run find the
   functions they call */
static PyObject *setup_runs(PyObject *self, PyObject *args) {
  PyObject *globals;
  if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &globals)) return NULL;
  for (int i = 0; i < G_COUNT; i++)
    if (!global_keys[i] && !(global_keys[i] = PyUnicode_InternFromString(global_names[i]))) return NULL;
  if (!s_level && !(s_level = PyUnicode_InternFromString("_current_level"))) return NULL;
  if (!s_acquire && !(s_acquire = PyUnicode_InternFromString("acquire"))) return NULL;
  if (!s_release && !(s_release = PyUnicode_InternFromString("release"))) return NULL;
  Py_INCREF(globals);
  Py_XSETREF(rt_globals, globals);
  Py_RETURN_NONE;
}

/* A borrowed reference to _launch's global `which`; NULL with RuntimeError where it is missing. */
static PyObject *launch_global(int which) {
  PyObject *value = PyDict_GetItemWithError(rt_globals, global_keys[which]);
  if (!value && !PyErr_Occurred())
    PyErr_Format(PyExc_RuntimeError, "_launch has no %s", global_names[which]);
  return value;
}

/* launch_global(which)() as a new reference; NULL on an error. */
static PyObject *call_global(int which) {
  PyObject *function = launch_global(which);
  return function ? PyObject_CallNoArgs(function) : NULL;
}

/* 0 when `name` was called with `want` arguments after setup_runs, else -1 with the error. */
static int runs_ready(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
    return -1;
  }
  if (!rt_globals) {
    PyErr_Format(PyExc_RuntimeError, "%s before setup_runs", name);
    return -1;
  }
  return 0;
}

/* The buffers_for of a run outside capture on `stream` (a new reference): the spec kept in
   `specs` for it (_launch.Replay._buffer_spec), if made with the `empty` the launch module has
   now; NULL with no exception where there is none. */
static PyObject *kept_spec(PyObject *specs, PyObject *stream) {
  PyObject *spec = PyDict_GetItemWithError(specs, stream);
  if (!spec) return NULL;
  PyObject *empty = launch_global(G_EMPTY);
  if (!empty || !PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 2 || PyTuple_GET_ITEM(spec, 1) != empty)
    return NULL;
  return Py_NewRef(PyTuple_GET_ITEM(spec, 0));
}

/* entry: (device: int, launches, storages, outputs, lock or None, buffer specs: dict), made by
   _launch.Replay._native_entry. Runs under CUDA-graph capture take Python's path (their buffers
   are made there: NotImplemented). */
static PyObject *entry_run(PyObject *entry, PyObject *guard, PyObject *tensors, PyObject *fixed,
                           PyObject *capturing, PyObject *out) {
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 6 || !PyTuple_Check(tensors) || !PyTuple_Check(fixed)
      || !PyTuple_Check(PyTuple_GET_ITEM(entry, 1)) || !PyDict_Check(PyTuple_GET_ITEM(entry, 5))) {
    PyErr_SetString(PyExc_TypeError, "replay_run: a malformed entry or tensors");
    return NULL;
  }
  PyObject *device = call_global(G_DEVICE);
  if (!device) return NULL;
  int same = PyObject_RichCompareBool(device, PyTuple_GET_ITEM(entry, 0), Py_EQ);
  PyObject *raw_stream = same > 0 ? launch_global(G_STREAM) : NULL;
  PyObject *stream = raw_stream ? PyObject_CallOneArg(raw_stream, device) : NULL;
  Py_DECREF(device);
  if (same <= 0) {
    if (same < 0) return NULL;
    Py_RETURN_NOTIMPLEMENTED;
  }
  if (!stream) return NULL;
  PyObject *result = NULL, *buffers_for = NULL;
  Py_INCREF(capturing);
  if (capturing == Py_None) {
    Py_DECREF(capturing);
    if (!(capturing = call_global(G_CAPTURING))) goto done;
  }
  int captured = PyObject_IsTrue(capturing);
  if (captured < 0) goto done;
  if (captured || !(buffers_for = kept_spec(PyTuple_GET_ITEM(entry, 5), stream))) {
    if (!PyErr_Occurred()) result = Py_NewRef(Py_NotImplemented);
    goto done;
  }
  PyObject *lock = PyTuple_GET_ITEM(entry, 4);
  if (lock != Py_None) {
    PyObject *taken = PyObject_CallMethodNoArgs(lock, s_acquire);  /* waits with the GIL released */
    if (!taken) goto done;
    Py_DECREF(taken);
  }
  result = checked_core(guard, tensors, fixed, buffers_for, stream, capturing, PyTuple_GET_ITEM(entry, 1),
                        PyTuple_GET_ITEM(entry, 2), out, PyTuple_GET_ITEM(entry, 3));
  if (lock != Py_None) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *released = PyObject_CallMethodNoArgs(lock, s_release);
    if (!released) {
      Py_CLEAR(result);
      Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(traceback);
    } else {
      Py_DECREF(released);
      PyErr_Restore(type, value, traceback);
    }
  }
done:
  Py_DECREF(stream);
  Py_XDECREF(capturing);
  Py_XDECREF(buffers_for);
  return result;
}

/* 1 while forward AD has a level (a tangent may be attached) or a torch.func transform is
   active, 0 when neither, -1 on an error: what ops.check_differentiation_modes looks at, left to
   it. */
static int differentiation_modes(void) {
  PyObject *forward_ad = launch_global(G_FORWARD_AD), *functorch_level = launch_global(G_FUNCTORCH_LEVEL);
  if (!forward_ad || !functorch_level) return -1;
  PyObject *level = PyObject_GetAttr(forward_ad, s_level);
  long forward_level = level ? PyLong_AsLong(level) : 0;
  Py_XDECREF(level);
  if (PyErr_Occurred()) {  /* a PyTorch without that attribute: Python's check looks */
    PyErr_Clear();
    return 1;
  }
  if (forward_level >= 0) return 1;
  if (functorch_level == Py_None) return 0;
  PyObject *transform = PyObject_CallNoArgs(functorch_level);
  if (!transform) return -1;
  Py_DECREF(transform);
  return transform != Py_None;
}

/* replay_run(entry, guard, tensors, fixed, capturing, out): _launch.Replay.run_checked with
   reuse_scratch in one call: the outputs' tuple, None when the guard turns the tensors away,
   NotImplemented where Python's path must run. */
static PyObject *replay_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (runs_ready("replay_run", nargs, 6) != 0) return NULL;
  return entry_run(args[0], args[1], args[2], args[3], args[4], args[5]);
}

/* plan_run(runs, tensors, fixed, out): the fast path of a plan's run (plans._Plan._replayed):
   runs[inference mode][capture state] is None or (entry, guard, guard with the output check or
   None). Returns what replay_run does, and NotImplemented while a forward-mode tangent can be
   attached (forward AD's level) or a torch.func transform is active: Python's path checks them.
   A run into `out` bumps its version counter, as copy_ would. */
static PyObject *plan_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (runs_ready("plan_run", nargs, 4) != 0) return NULL;
  PyObject *runs = args[0], *out = args[3];
  int modes = differentiation_modes();
  if (modes != 0) return modes < 0 ? NULL : Py_NewRef(Py_NotImplemented);
  PyObject *mode = call_global(G_INFERENCE);
  if (!mode) return NULL;
  int inference = PyObject_IsTrue(mode);
  Py_DECREF(mode);
  if (inference < 0) return NULL;
  PyObject *capturing = call_global(G_CAPTURING);
  if (!capturing) return NULL;
  int captured = PyObject_IsTrue(capturing);
  PyObject *recorded = NULL, *result = NULL;
  if (captured < 0) goto done;
  if (!PyList_Check(runs) || PyList_GET_SIZE(runs) != 2 || !PyList_Check(PyList_GET_ITEM(runs, inference))
      || PyList_GET_SIZE(PyList_GET_ITEM(runs, inference)) != 2) {
    PyErr_SetString(PyExc_TypeError, "plan_run: runs must be [[run, run], [run, run]]");
    goto done;
  }
  recorded = Py_NewRef(PyList_GET_ITEM(PyList_GET_ITEM(runs, inference), captured));
  if (recorded == Py_None) {
    result = Py_NewRef(Py_NotImplemented);
    goto done;
  }
  if (!PyTuple_Check(recorded) || PyTuple_GET_SIZE(recorded) != 3) {
    PyErr_SetString(PyExc_TypeError, "plan_run: a run must be (entry, guard, output guard)");
    goto done;
  }
  PyObject *guard = PyTuple_GET_ITEM(recorded, out == Py_None ? 1 : 2);
  if (guard == Py_None) {
    result = Py_NewRef(Py_NotImplemented);
    goto done;
  }
  result = entry_run(PyTuple_GET_ITEM(recorded, 0), guard, args[1], args[2], capturing, out);
  if (result && PyTuple_Check(result) && out != Py_None) {
    PyObject *written = PyTuple_Pack(1, out);
    PyObject *bump = written ? launch_global(G_BUMP) : NULL;
    PyObject *bumped = bump ? PyObject_CallOneArg(bump, written) : NULL;
    Py_XDECREF(written);
    if (!bumped) Py_CLEAR(result);
    Py_XDECREF(bumped);
  }
done:
  Py_DECREF(capturing);
  Py_XDECREF(recorded);
  return result;
}

/* 1 when the items of `values` (a tuple or list) and `extra` (appended when not NULL) equal
   `filed` item by item and have the types of `types` (two tuples), 0 when not, -1 on an error. */
static int strict_equal(PyObject *values, PyObject *extra, PyObject *filed, PyObject *types) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(values), total = n + (extra != NULL);
  if (!PyTuple_Check(filed) || !PyTuple_Check(types) || PyTuple_GET_SIZE(filed) != total
      || PyTuple_GET_SIZE(types) != total)
    return 0;
  PyObject **items = PySequence_Fast_ITEMS(values);
  for (Py_ssize_t i = 0; i < total; i++) {
    PyObject *item = i < n ? items[i] : extra;
    if ((PyObject *)Py_TYPE(item) != PyTuple_GET_ITEM(types, i)) return 0;
    int same = PyObject_RichCompareBool(item, PyTuple_GET_ITEM(filed, i), Py_EQ);
    if (same <= 0) return same;
  }
  return 1;
}

/* 1 when `window` is the window of a probe filed as `filed` (interface._probe: the default
   object itself, or (type, values, their types) of a tuple or list), 0 when not, -1 on error. */
static int same_window(PyObject *window, PyObject *filed) {
  if (window == filed) return 1;
  if (!(PyTuple_Check(window) || PyList_Check(window)) || !PyTuple_Check(filed) || PyTuple_GET_SIZE(filed) != 3
      || PyTuple_GET_ITEM(filed, 0) != (PyObject *)Py_TYPE(window))
    return 0;
  return strict_equal(window, NULL, PyTuple_GET_ITEM(filed, 1), PyTuple_GET_ITEM(filed, 2));
}

static PyObject *s_native = NULL, *s_entry = NULL;

/* The run of a recent replay's entry (probe, guard, replay, shapes) on `tensors` through its
   guard's C form and its own C entry: what entry_run returns, or NotImplemented where either has
   no C form yet. */
static PyObject *filed_run(PyObject *entry, PyObject *tensors, PyObject *capturing) {
  PyObject *guard = PyObject_GetAttr(PyTuple_GET_ITEM(entry, 1), s_native);
  PyObject *replay_entry = guard ? PyObject_GetAttr(PyTuple_GET_ITEM(entry, 2), s_entry) : NULL;
  PyObject *result = NULL;
  if (replay_entry) {
    if (PyCapsule_CheckExact(guard) && PyTuple_Check(replay_entry) && PyTuple_GET_SIZE(replay_entry) == 2) {
      PyObject *fixed = PyTuple_New(0);
      result = fixed ? entry_run(PyTuple_GET_ITEM(replay_entry, 1), guard, tensors, fixed, capturing, Py_None) : NULL;
      Py_XDECREF(fixed);
    } else {
      result = Py_NewRef(Py_NotImplemented);
    }
  }
  Py_XDECREF(guard);
  Py_XDECREF(replay_entry);
  return result;
}

/* eager_run(recent: list, name, scalars: tuple, window, tensors: tuple, by_capture): an eager
   call's look-up among the recent replays (_launch.CallCache.quick, whose entries are (probe,
   guard, replay, shapes)) and its run, in one call: the first replay filed with this call's
   probe (interface._probe of name, scalars, with the capture state appended when by_capture, and
   window) that runs on `tensors` here alone (filed_run: its guard vouches for them, both have
   their C forms, the stream its buffers) is run. NotImplemented (nothing launched) wherever
   Python's look-up has more to do or check: q not a plain tensor, no such replay, forward AD or a
   torch.func transform active. */
static PyObject *eager_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (runs_ready("eager_run", nargs, 6) != 0) return NULL;
  if (!s_native && !(s_native = PyUnicode_InternFromString("_native"))) return NULL;
  if (!s_entry && !(s_entry = PyUnicode_InternFromString("_entry"))) return NULL;
  PyObject *recent = args[0], *name = args[1], *scalars = args[2], *window = args[3], *tensors = args[4];
  if (!PyList_Check(recent) || !PyTuple_Check(scalars) || !PyTuple_Check(tensors)) {
    PyErr_SetString(PyExc_TypeError, "eager_run: recent must be a list, scalars and tensors tuples");
    return NULL;
  }
  int by_capture = PyObject_IsTrue(args[5]);
  if (by_capture < 0) return NULL;
  /* a subclass (a fake tensor, a wrapper) first: only plain tensors' calls are looked up */
  if (PyTuple_GET_SIZE(tensors) == 0 || !tensor_type || Py_TYPE(PyTuple_GET_ITEM(tensors, 0)) != tensor_type)
    Py_RETURN_NOTIMPLEMENTED;
  int modes = differentiation_modes();
  if (modes != 0) return modes < 0 ? NULL : Py_NewRef(Py_NotImplemented);
  PyObject *capturing = by_capture ? call_global(G_CAPTURING) : Py_NewRef(Py_None);
  if (!capturing) return NULL;
  PyObject *result = NULL;
  /* the list may change while Python runs (a comparison's __eq__): hold each entry */
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(recent) && !result; i++) {
    PyObject *entry = PyList_GET_ITEM(recent, i);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) continue;
    Py_INCREF(entry);
    PyObject *probe = PyTuple_GET_ITEM(entry, 0);
    int same = PyTuple_Check(probe) && PyTuple_GET_SIZE(probe) == 4;
    if (same) same = PyObject_RichCompareBool(PyTuple_GET_ITEM(probe, 0), name, Py_EQ);
    if (same > 0) same = same_window(window, PyTuple_GET_ITEM(probe, 3));
    if (same > 0)
      same = strict_equal(scalars, by_capture ? capturing : NULL, PyTuple_GET_ITEM(probe, 1),
                          PyTuple_GET_ITEM(probe, 2));
    if (same > 0) {
      /* turned away, or not runnable here alone: the next replay of this probe (one whose guard
         passes runs what any other such would: the same layouts and scalars) */
      result = filed_run(entry, tensors, capturing);
      if (result == Py_None || result == Py_NotImplemented) Py_CLEAR(result);
    }
    Py_DECREF(entry);
    if (same < 0 || (same > 0 && !result && PyErr_Occurred())) break;
  }
  if (!result && !PyErr_Occurred()) result = Py_NewRef(Py_NotImplemented);
  Py_DECREF(capturing);
  return result;
}

static PyMethodDef methods[] = {
  {"make", make, METH_VARARGS, "pack one launch"},
  {"run", run, METH_VARARGS, "patch addresses and launch"},
  {"setup", setup, METH_VARARGS, "the tensor type and its data-pointer function"},
  {"guard", guard, METH_VARARGS, "pack one layout guard"},
  {"checked_run", checked_run, METH_VARARGS, "check a guard, read addresses, patch and launch"},
  {"setup_runs", setup_runs, METH_VARARGS, "the module dict whose functions replay_run and plan_run call"},
  {"replay_run", (PyCFunction)(void (*)(void))replay_run, METH_FASTCALL, "a replay's checked run from its state"},
  {"plan_run", (PyCFunction)(void (*)(void))plan_run, METH_FASTCALL, "a plan's run from its recorded runs"},
  {"eager_run", (PyCFunction)(void (*)(void))eager_run, METH_FASTCALL, "an eager call's recent replay, run"},
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


@functools.lru_cache(maxsize=None)
def checking_module():
    """The C module set up for :func:`make_guard` and its ``checked_run`` (it reads tensors'
    addresses through the data-pointer function PyTorch exports for Inductor's C++ wrappers,
    checked here on one tensor), or None where the module or that function is missing."""
    native = module()
    try:
        from torch._C._dynamo.guards import _torchinductor_pyobject_tensor_data_ptr as data_ptr
    except ImportError:
        return None
    if native is None or not isinstance(data_ptr, int):
        return None
    example = torch.empty(3)
    try:
        if native.setup(data_ptr, torch.Tensor, example) != example.data_ptr():
            return None
    except (TypeError, ValueError, OverflowError):
        return None
    return native


def make_guard(check, alignments: tuple, checked: tuple, same: tuple, distinct: int, output=None):
    """The C form of a ``_launch.LayoutGuard`` for ``checked_run``: its C++ ``check``, each slot's
    address alignment (None: no tensor), the slots passed to ``check``, the pairs of slots that
    hold one tensor, and how many distinct addresses the examples' tensors had; ``output``: for
    runs into the caller's output, ``(check, bytes, extents, spans)``: the output's C++ check and
    size, each slot's extent in bytes (None: no tensor) and the ``(start, bytes)`` of tensors held
    for every run, none of which the output may overlap. None where :func:`checking_module` is
    None."""
    native = checking_module()
    if native is None:
        return None
    return native.guard(check, alignments, checked, same, distinct, *(output or ()))


# struct codes of one 8-byte parameter word per scalar type (the value, then zero padding)
_WORD_CODES = {"i1": "b7x", "i8": "b7x", "i16": "h6x", "i32": "i4x", "i64": "q",
               "u1": "B7x", "u8": "B7x", "u16": "H6x", "u32": "I4x", "u64": "Q",
               "fp32": "f4x", "f32": "f4x", "fp64": "d", "fp16": "e6x"}


def _descriptor_rank(ty: str) -> int | None:
    """The rank of a ``tensordesc<dtype[d0, d1, ...], ...>`` signature type, None for other types."""
    if not ty.startswith("tensordesc"):
        return None
    match = re.match(r"tensordesc<[^\[>]*\[([^\]]*)\]", ty)
    return None if match is None else match.group(1).count(",") + 1


@functools.lru_cache(maxsize=1024)
def _packing(signature: tuple) -> tuple | None:
    """How to pack a launch of ``signature`` (its ``(name, type)`` items): the struct format of
    the parameter buffer; per parameter, ``(argument, element or -1, kind)`` with kind
    ``"ptr"``, ``"int"``, ``"float"``, or for a TMA descriptor argument (Triton's launcher passes
    it as the ``CUtensorMap``, then its shape as i32 and its strides as i64) ``"map"`` (an
    8-byte placeholder: the C module points the parameter at the encoded map), ``"shape"`` and
    ``"stride"`` (``element`` the dimension); and ``scalars``: ``(argument, element) ->
    (parameter, struct code)`` of each scalar, None for a constexpr (not passed). None if a
    parameter is none of these. Computed once per signature, so recording a launch packs its
    parameters in one call."""
    codes, entries, scalars = ["<"], [], {}
    for arg, (_, ty) in enumerate(signature):
        if isinstance(ty, tuple) and any(isinstance(t, tuple) for t in ty):
            return None  # nested tuples: not in our kernels
        for element, t in (enumerate(ty) if isinstance(ty, tuple) else [(-1, ty)]):
            rank = _descriptor_rank(t)
            if t == "constexpr":
                scalars[arg, element] = None
                continue
            if rank is not None and element < 0:
                codes.append("8x" + "i4x" * rank + "q" * rank)
                entries += [(arg, -1, "map")] + [(arg, d, "shape") for d in range(rank)]
                entries += [(arg, d, "stride") for d in range(rank)]
            elif t.startswith("*"):
                codes.append("Q")
                entries.append((arg, element, "ptr"))
            elif t in _WORD_CODES:
                scalars[arg, element] = (len(entries), "<" + _WORD_CODES[t])
                codes.append(_WORD_CODES[t])
                entries.append((arg, element, "float" if t[0] == "f" else "int"))
            else:
                return None  # bf16 scalars, descriptors inside tuples, ...
    codes.append("16x")  # Triton's global and profile scratch pointers (none: checked by the caller)
    return "".join(codes), tuple(entries), scalars


def _map_spec(param: int, descriptor, meta) -> tuple | None:
    """The C module's encoding of one host TMA descriptor (``make``'s map spec), as Triton's
    launcher encodes it (``make_tensordesc_arg``): dims and box innermost first, the outer dims'
    strides in bytes, Triton's element type translated to the driver's. None where Triton's
    metadata is missing or unexpected (then Triton's launcher keeps the launch)."""
    source, shape, strides, padding, address = descriptor
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
        if meta is None or meta.get("fp4_padded"):
            return None
        elem_size, block = int(meta["elem_size"]), [int(b) for b in meta["block_size"]]
        data_type, swizzle = TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], int(meta["swizzle"])
    except (ImportError, KeyError, TypeError, ValueError, AttributeError):
        return None
    if len(block) != len(shape) or strides[-1] != 1:
        return None
    outer_strides = tuple(elem_size * int(stride) for stride in reversed(strides[:-1]))
    return (param, source, address, data_type, tuple(int(d) for d in reversed(shape)), outer_strides,
            tuple(reversed(block)), swizzle, 1 if padding == "nan" else 0)


def pack(signature: dict, values, pointer_slots: dict, descriptors=None, descriptor_meta=None):
    """The parameter buffer of one launch, its address slots and its TMA descriptors, or None if
    a parameter's type is not a plain scalar, pointer or described descriptor.

    ``values``: the launch's arguments in the kernel's order (tensors and descriptors replaced
    by None); ``pointer_slots``: argument index -> ``(source, byte offset)`` of the address it
    takes; ``descriptors``: argument index -> ``(source, shape, strides, padding, address)`` of a
    host TMA descriptor over the whole of a tensor (``address``: the recorded one, to encode
    with), and ``descriptor_meta``: Triton's ``tensordesc_meta`` of the compiled kernel (one
    entry per descriptor argument, in order).
    Returns ``(bytes, ((parameter index, source, offset), ...), (map spec, ...))``.
    """
    packing = _packing(tuple(signature.items()))
    if packing is None:
        return None
    fmt, entries, _ = packing
    descriptors = descriptors or {}
    described = [arg for arg, _, kind in entries if kind == "map"]
    if described and (not descriptor_meta or len(descriptor_meta) != len(described)
                      or any(arg not in descriptors for arg in described)):
        return None
    meta_of = dict(zip(described, descriptor_meta or ()))
    words, kinds, slots, maps = [], [], [], []
    for param, (arg, element, kind) in enumerate(entries):
        if kind == "map":  # its "8x" placeholder takes no value
            spec = _map_spec(param, descriptors[arg], meta_of[arg])
            if spec is None:
                return None
            maps.append(spec)
            continue
        if kind in ("shape", "stride"):
            word = int(descriptors[arg][1 if kind == "shape" else 2][element])
        else:
            word = values[arg] if element < 0 else values[arg][element]
        if kind == "ptr":
            if element < 0 and arg in pointer_slots:
                slots.append((param, *pointer_slots[arg]))
                word = 0
            else:
                word = int(word or 0)
        words.append(word)
        kinds.append(kind)
    try:
        storage = struct.pack(fmt, *words)
    except struct.error:  # a scalar that is not a Python int / float (e.g. a numpy integer)
        storage = struct.pack(fmt, *[float(w) if kind == "float" else int(w) for w, kind in zip(words, kinds)])
    return storage, tuple(slots), tuple(maps)


class Packed(NamedTuple):
    """One launch packed for the C module: ``capsule`` is what its ``run`` takes; the rest is
    what :func:`with_values` needs to give it other scalar arguments."""

    capsule: object
    make_args: tuple  # function, grid x, y, z, threads per CTA, shared memory
    storage: bytes  # the parameters (addresses left to the run); what the capsule was made with, or with_values's
    slots: tuple
    maps: tuple
    scalars: dict  # _packing's (argument, element) -> (parameter, struct code) or None


def launch_for(compiled, grid, values, pointer_slots: dict, descriptors=None) -> Packed | None:
    """The packed launch for one recorded launch, or None when it does not qualify (see the
    module docstring). ``descriptors`` as in :func:`pack`."""
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
    meta = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
    packed = pack(signature, values, pointer_slots, descriptors, meta)
    if packed is None:
        return None
    storage, slots, maps = packed
    make_args = (compiled.function, grid[0], grid[1], grid[2], 32 * num_warps, shared)
    capsule = _make(native, make_args, storage, slots, maps)
    if capsule is None:
        return None
    return Packed(capsule, make_args, storage, slots, maps, _packing(tuple(signature.items()))[2])


def with_values(packed: Packed, values: dict) -> Packed | None:
    """``packed`` with scalar arguments replaced (``values``: argument index -> int or float, or
    a tuple of them for a tuple argument) and the same capsule, or None when an argument is not a
    packed scalar. Elements that are constexprs in the compiled kernel are skipped: the caller
    vouches that the new values specialize as the packed ones did, so they are equal.

    The capsule is shared: the launch's C buffer holds whichever parameters were written last, so
    every replay that runs a shared capsule passes its launches' ``storage`` to ``run`` (the
    C module copies them in before launching)."""
    storage, scalars = bytearray(packed.storage), packed.scalars
    try:
        for arg, value in values.items():
            if isinstance(value, tuple) and ((arg, len(value) - 1) not in scalars or (arg, len(value)) in scalars):
                return None  # not the tuple's length
            for element, word in (enumerate(value) if isinstance(value, tuple) else ((-1, value),)):
                where = scalars[arg, element]
                if where is not None:
                    struct.pack_into(where[1], storage, 8 * where[0], word)
    except (KeyError, struct.error, OverflowError, TypeError):
        return None
    return packed._replace(storage=bytes(storage))


def _make(native, make_args: tuple, storage: bytes, slots: tuple, maps: tuple):
    try:
        return native.make(*make_args, storage, slots, maps)
    except (RuntimeError, ValueError, IndexError, OverflowError, MemoryError):
        return None  # e.g. the driver refused to encode a descriptor: Triton's launcher keeps the launch
