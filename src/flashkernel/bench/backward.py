"""Backward-pass benchmark: flashkernel's backward kernels against SDPA's FLASH_ATTENTION and
CUDNN_ATTENTION backends, on the GPU.

Shapes (FlashAttention's benchmark): bf16, 16k tokens per batch (``batch = 16384 // seqlen``),
model dim 2048 (``heads = 2048 // head_dim``, as many KV heads), head dims 64 and 128, causal and
not, seqlen 1k / 4k / 16k.

What is timed, each as the median of ``triton.testing.do_bench`` (which flushes L2 between
calls):

* ``flashkernel``: ``kernels.backward.attention_backward`` given the forward's ``out`` and
  ``lse`` (computed once, outside the timing), writing into preallocated ``dq, dk, dv``: the
  delta preprocess, the dK/dV kernel and the dQ kernel.
* ``sdpa-flash`` / ``sdpa-cudnn``: ``torch.autograd.grad(out, (q, k, v), dout,
  retain_graph=True)`` over one kept graph of ``scaled_dot_product_attention`` with the backend
  forced (``[B, H, S, D]`` views of ``[B, S, H, D]`` tensors, ``dout`` in ``out``'s layout).

FLOPs: backward = 2.5 x forward, forward = ``4 * B * H * S * S * D``, halved when causal
(FlashAttention's convention). Each row also carries flashkernel's largest gradient difference
from SDPA's flash backend, relative to the largest gradient, as a sanity check.

Sections (``--sections``; the default is ``backward``, ``flashkernel bench backward`` runs all):

* ``backward``: the table above.
* ``kernels``: GPU time per call of each of flashkernel's backward kernels (delta, dK/dV, dQ,
  the sums), from a ``torch.profiler`` trace, and each one's share.
* ``layer`` and ``model``: training steps, forward and backward together (``bench/training.py``).

Run: ``PYTHONPATH=src python -m flashkernel.bench.backward [--sections ...] [--out results.json
[--plot]]``.

``--sweep`` instead times flashkernel's backward alone at candidate tile configurations (first
the dK/dV kernel's with the table's dQ tiles, then the dQ kernel's with the best dK/dV tiles),
prints each shape's best against the table's and writes every timing to ``--out``: the data
behind ``kernels/backward.py``'s ``CONFIGS``.

``--compile-check`` instead compiles the backward kernels for sm_90a at the tile table's
configurations (no GPU needed: Triton's bundled ptxas) and reports registers, spills, shared
memory and wgmma counts (``tests/test_backward_compile.py`` runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
from pathlib import Path

from .results import format_table
from .training import SDPA_BACKENDS

TOKENS = 16384
MODEL_DIM = 2048
DEFAULT_SHAPES = tuple((head_dim, causal, seqlen) for head_dim in (64, 128) for causal in (False, True)
                       for seqlen in (1024, 4096, 16384))
# "flashkernel": what attention_backward's "auto" runs (``flashkernel_backend`` in a row says which);
# "flashkernel-triton": the Triton kernels forced, for comparison where "auto" takes the Gluon kernel.
PROVIDERS = ("flashkernel", "flashkernel-triton", *SDPA_BACKENDS)
BACKWARD_FLOPS_FORMULA = "backward FLOPs = 2.5 * 4 * B * H * S * S * D, halved when causal"


@dataclasses.dataclass(frozen=True)
class Case:
    head_dim: int
    causal: bool
    seqlen: int

    @property
    def batch(self) -> int:
        return max(1, TOKENS // self.seqlen)

    @property
    def heads(self) -> int:
        return MODEL_DIM // self.head_dim

    def backward_flops(self) -> float:
        return backward_flops(self.batch, self.heads, self.seqlen, self.head_dim, self.causal)


def backward_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    """:data:`BACKWARD_FLOPS_FORMULA`."""
    forward = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return 2.5 * (forward / 2 if causal else forward)


def _inputs(case: Case, dtype):
    import torch

    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device="cuda") for _ in range(3))
    return q, k, v


def _flashkernel_backward(case: Case, q, k, v, dout, backend: str = "auto"):
    """A zero-argument call running flashkernel's backward, and the gradients it writes."""
    import torch

    import flashkernel
    from flashkernel.kernels.backward import attention_backward

    scale = 1.0 / math.sqrt(case.head_dim)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=case.causal, softmax_scale=scale, return_lse=True)
    grads = tuple(torch.empty_like(x) for x in (q, k, v))

    def call():
        attention_backward(dout, q, k, v, out, lse, *grads, causal=case.causal, softmax_scale=scale,
                           backend=backend)

    return call, grads


def _auto_backend(case: Case, q, k, v) -> str:
    """The backend ``attention_backward``'s "auto" picks for this case."""
    from flashkernel.kernels import dispatch

    return dispatch.backward_backend("auto", q, k, v, q, (q, k, v), causal=case.causal, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, sinks=None, varlen=False, deterministic=False,
                                     config=None)


def _sdpa_backward(case: Case, backend_name: str, q, k, v, dout):
    """A zero-argument call running SDPA's backward (one kept graph, ``backend_name`` forced);
    it returns the gradients of ``q, k, v`` in their ``[B, S, H, D]`` layout."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in leaves), is_causal=case.causal, scale=1.0 / math.sqrt(case.head_dim))
    dout_t = dout.transpose(1, 2)  # out's [B, H, S, D] view of the same [B, S, H, D] memory
    if dout_t.stride() != out.stride():
        dout_t = torch.empty_like(out).copy_(dout_t)

    def call():
        return torch.autograd.grad(out, leaves, dout_t, retain_graph=True)

    return call


def _relative_difference(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs| over dq, dk, dv."""
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
               for a, b in zip(ours, theirs))


def measure_case(case: Case, dtype=None, warmup_ms: int = 100, rep_ms: int = 500) -> dict:
    """One row: per provider the median ms and TFLOP/s (or the error it raised), the ratios of
    flashkernel's TFLOP/s to each SDPA backend's, and the gradient check."""
    import torch

    from .measure import time_provider

    dtype = dtype or torch.bfloat16
    q, k, v = _inputs(case, dtype)
    dout = torch.randn_like(q)
    row = {"head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen, "batch": case.batch,
           "heads": case.heads, "dtype": str(dtype).removeprefix("torch."), "flops": case.backward_flops(),
           "flashkernel_backend": _auto_backend(case, q, k, v)}
    ours = None

    def make_call(name):
        nonlocal ours
        if name == "flashkernel":
            call, ours = _flashkernel_backward(case, q, k, v, dout)
            return call
        if name == "flashkernel-triton":
            return _flashkernel_backward(case, q, k, v, dout, backend="triton")[0]
        return _sdpa_backward(case, SDPA_BACKENDS[name], q, k, v, dout)

    flash_grads = None
    for name in PROVIDERS:
        call = time_provider(row, name, lambda: make_call(name), case.backward_flops(), warmup_ms, rep_ms)
        if name == "sdpa-flash" and call is not None:
            flash_grads = call()
    for name in SDPA_BACKENDS:
        if f"{name}_tflops" in row and "flashkernel_tflops" in row:
            row[f"vs_{name}"] = row["flashkernel_tflops"] / row[f"{name}_tflops"]
    if ours is not None and flash_grads is not None:
        row["max_rel_diff_vs_sdpa_flash"] = _relative_difference(ours, flash_grads)
    del q, k, v, dout, ours, flash_grads
    torch.cuda.empty_cache()
    return row


def format_rows(rows: list[dict]) -> str:
    """A readable table: TFLOP/s per provider and flashkernel's ratios."""
    headers = ["hdim", "mask", "seqlen", "B x H", *[f"{p} TF/s" for p in PROVIDERS], "vs flash", "vs cudnn",
               "grad diff"]
    lines = [headers]
    for row in rows:
        cells = [str(row["head_dim"]), "causal" if row["causal"] else "none", str(row["seqlen"]),
                 f"{row['batch']} x {row['heads']}"]
        for name in PROVIDERS:
            value = row.get(f"{name}_tflops")
            cells.append(f"{value:.1f}" if value is not None else "error")
        for name in SDPA_BACKENDS:
            value = row.get(f"vs_{name}")
            cells.append(f"{value:.2f}x" if value is not None else "-")
        diff = row.get("max_rel_diff_vs_sdpa_flash")
        cells.append(f"{diff:.1e}" if diff is not None else "-")
        lines.append(cells)
    errors = [f"{row['head_dim']}/{row['seqlen']}/{'causal' if row['causal'] else 'none'} {name}: "
              f"{row[name + '_error']}" for row in rows for name in PROVIDERS if name + "_error" in row]
    return "\n".join([format_table(lines[0], lines[1:], text_columns=0), *errors])


SECTIONS = ("backward", "kernels", "layer", "model")


def run_backward_bench(shapes=DEFAULT_SHAPES, out_path: str | Path | None = None, dtype=None,
                       warmup_ms: int = 100, rep_ms: int = 500, argv: list[str] | None = None,
                       sections=("backward",), plot: bool = False) -> dict:
    """Run ``sections`` at every ``(head_dim, causal, seqlen)`` of ``shapes`` (the model
    section has its own shapes, ``training.MODEL_BATCHES``), print the tables, and write the
    results (environment, formula, one list of rows per section: ``rows`` for the backward
    table) as JSON to ``out_path`` when given, with ``backward_tflops.png`` beside it when
    ``plot``. Needs CUDA."""
    import torch

    from . import training
    from .results import environment

    if not torch.cuda.is_available():
        raise RuntimeError("the backward benchmark times GPU kernels: it needs a CUDA GPU")
    cases = [Case(head_dim, causal, seqlen) for head_dim, causal, seqlen in shapes]
    env = environment([], "cuda")
    env["command"] = shlex.join(["python", "-m", "flashkernel.bench.backward", *(argv or [])])
    doc = {"workload": "backward", "environment": env, "formula": BACKWARD_FLOPS_FORMULA,
           "timer": f"triton.testing.do_bench median (warmup {warmup_ms} ms, rep {rep_ms} ms)", "rows": []}

    def write():
        if out_path is not None:
            Path(out_path).parent.mkdir(parents=True, exist_ok=True)
            Path(out_path).write_text(json.dumps(doc, indent=1) + "\n")

    if "backward" in sections:
        for case in cases:
            row = measure_case(case, dtype, warmup_ms, rep_ms)
            doc["rows"].append(row)
            speeds = ", ".join(f"{name} {row[name + '_tflops']:.1f}" if name + "_tflops" in row else f"{name} error"
                               for name in PROVIDERS)
            print(f"head_dim {case.head_dim} {'causal' if case.causal else 'none'} seqlen {case.seqlen}: {speeds} "
                  "TFLOP/s", flush=True)
            write()
        print(format_rows(doc["rows"]), flush=True)
    if "kernels" in sections:
        doc["kernels"] = [kernel_row(case) for case in cases]
        print(format_kernel_rows(doc["kernels"]), flush=True)
        write()
    if "layer" in sections:
        doc["layer_formula"] = "forward + backward FLOPs = 3.5 * 4 * B * H * S * S * D, halved when causal"
        doc["layer"] = []
        for case in cases:
            doc["layer"].append(training.layer_row(case.head_dim, case.causal, case.seqlen, case.batch, case.heads,
                                                   warmup_ms, rep_ms))
            write()
        print(training.format_layer_rows(doc["layer"]), flush=True)
    if "model" in sections:
        doc["model"] = training.model_rows()
        write()
    if out_path is not None:
        print(f"wrote {out_path}")
        if plot and doc["rows"]:
            from .plots import PlottingUnavailable, backward_plot

            try:
                print(f"wrote {backward_plot(doc, Path(out_path).parent)}")
            except PlottingUnavailable as error:
                print(error)
    return doc


# ---- kernels: where a backward call's GPU time goes -----------------------------------------------

KERNEL_NAMES = ("_delta_kernel", "_dkdv_kernel", "_dq_kernel", "_sum_kernel", "_sum_parts_kernel",
                "_row_stats_kernel", "_gluon_backward_kernel", "_dq_convert_kernel")


def kernel_times(call, calls: int = 20) -> dict:
    """GPU time per call of each backward kernel (``KERNEL_NAMES``; anything else as ``other``),
    in ms, from a ``torch.profiler`` trace of ``calls`` calls after one untraced call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in trace.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = getattr(event, "cuda_time_total", 0.0)
        if not total or event.key.startswith(("cudaLaunch", "cuLaunch", "Memcpy", "Memset")):
            continue
        name = next((n for n in KERNEL_NAMES if event.key == n or event.key.startswith(n + "_")), "other")
        times[name] = times.get(name, 0.0) + total / 1e3 / calls
    return times


def kernel_row(case: Case) -> dict:
    """One shape: ms per call of each backward kernel and its share of their sum."""
    import torch

    q, k, v = _inputs(case, torch.bfloat16)
    dout = torch.randn_like(q)
    call, _ = _flashkernel_backward(case, q, k, v, dout)
    times = kernel_times(call)
    total = sum(times.values())
    row = {"section": "kernels", "head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen,
           "batch": case.batch, "heads": case.heads, "total_ms": total, "kernels_ms": times,
           "shares": {name: t / total for name, t in times.items()} if total else {}}
    if not total:
        row["error"] = "the profiler recorded no GPU kernel (CUPTI unavailable?)"
    del call, q, k, v, dout
    torch.cuda.empty_cache()
    return row


def format_kernel_rows(rows: list[dict]) -> str:
    names = [n for n in (*KERNEL_NAMES, "other") if any(n in r["kernels_ms"] for r in rows)]
    lines = [["hdim", "mask", "seqlen", "total ms", *[n.strip("_").removesuffix("_kernel") for n in names]]]
    for row in rows:
        if not row["total_ms"]:
            lines.append([str(row["head_dim"]), "causal" if row["causal"] else "none", str(row["seqlen"]), "-",
                          *["-" for _ in names]])
            continue
        lines.append([str(row["head_dim"]), "causal" if row["causal"] else "none", str(row["seqlen"]),
                      f"{row['total_ms']:.3f}",
                      *[f"{row['kernels_ms'][n]:.3f} ({row['shares'][n]:.0%})" if n in row["kernels_ms"] else "-"
                        for n in names]])
    return format_table(lines[0], lines[1:], text_columns=0)


# ---- sweep: tile configurations timed on the GPU ------------------------------------------------

# (block_m, block_n, num_warps, num_stages). dK/dV: block_n key rows per program, block_m query
# rows per step; dQ: block_m query rows per program, block_n keys per step.
DKDV_CANDIDATES = ((16, 128, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3),
                   (64, 128, 8, 1), (32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 2))
DQ_CANDIDATES = ((128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2),
                 (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 2))


def _time_config(case: Case, tensors, config, rep_ms: int) -> float | str:
    """Median ms of flashkernel's backward at ``config``, or the error that stopped it."""
    import torch
    from triton.testing import do_bench

    from flashkernel.kernels.backward import attention_backward

    q, k, v, out, lse, dout, grads = tensors
    scale = 1.0 / math.sqrt(case.head_dim)
    try:
        return do_bench(lambda: attention_backward(dout, q, k, v, out, lse, *grads, causal=case.causal,
                                                   softmax_scale=scale, config=config),
                        warmup=25, rep=rep_ms, return_mode="median")
    except Exception as error:  # noqa: BLE001 - out of resources and the like: the candidate is out
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        torch.cuda.synchronize()


def sweep_case(case: Case, rep_ms: int = 100) -> dict:
    """The dK/dV candidates with the table's dQ tiles, then the dQ candidates with the best dK/dV
    tiles; returns the table's time, every candidate's and the best configuration."""
    import torch

    import flashkernel
    from flashkernel.kernels import backward as bw
    from flashkernel.kernels.tuning import TileConfig

    q, k, v = _inputs(case, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=case.causal, return_lse=True)
    tensors = (q, k, v, out, lse, dout, tuple(torch.empty_like(x) for x in (q, k, v)))
    table = bw.pick_config(case.head_dim, torch.bfloat16, interpreted=False, causal=case.causal)
    row = {"head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen, "batch": case.batch,
           "heads": case.heads, "table": dataclasses.asdict(table), "table_ms": _time_config(case, tensors, table, rep_ms)}
    best, best_ms = table, row["table_ms"] if isinstance(row["table_ms"], float) else math.inf
    for stage, candidates in (("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)):
        timings = []
        for tile in candidates:
            config = dataclasses.replace(best, **{stage: TileConfig(*tile)})
            ms = _time_config(case, tensors, config, rep_ms)
            timings.append({"tile": tile, "ms": ms})
            if isinstance(ms, float) and ms < best_ms:
                best, best_ms = config, ms
        row[f"{stage}_timings"] = timings
    row["best"], row["best_ms"] = dataclasses.asdict(best), best_ms
    row["speedup_vs_table"] = row["table_ms"] / best_ms if isinstance(row["table_ms"], float) else None
    del tensors, q, k, v, out, lse, dout
    torch.cuda.empty_cache()
    return row


def run_sweep(shapes, out_path: Path | None, rep_ms: int, argv: list[str]) -> dict:
    """:func:`sweep_case` for every shape; prints each shape's best and writes the JSON."""
    from .results import environment

    rows = []
    for head_dim, causal, seqlen in shapes:
        row = sweep_case(Case(head_dim, causal, seqlen), rep_ms)
        rows.append(row)
        best = row["best"]
        print(f"head_dim {head_dim} {'causal' if causal else 'none'} seqlen {seqlen}: table {row['table_ms']} ms, "
              f"best {row['best_ms']:.3f} ms (x{row['speedup_vs_table'] or 0:.3f}) dkdv {best['dkdv']} dq {best['dq']}",
              flush=True)
    env = environment([], "cuda")
    env["command"] = shlex.join(["python", "-m", "flashkernel.bench.backward", *argv])
    doc = {"workload": "backward-sweep", "environment": env, "rows": rows}
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# ---- compile check: the kernels as ptxas sees them for sm_90a (no GPU needed) --------------------

COMPILE_DTYPES = ("bfloat16", "float16")
# Bytes of spills accepted per (head dim, causal), a guard against regressions rather than a
# rule: the 4-warp dK/dV tiles the sweep picked (d64, and d128 without a mask) spill 152-388 B
# yet ran 1.16x-1.35x faster than the spill-free 8-warp tiles (``backward-sweep.json``); at 256
# the dK/dV accumulators alone take 128 registers per thread, and the least-spilling causal tile
# tried spills 8 bytes.
SPILL_ALLOWANCE = {(64, False): 160, (64, True): 176, (128, False): 392, (256, True): 16}
TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """One specialization of a backward kernel at the tile table's configuration."""

    kernel: str  # "dkdv" or "dq"
    dtype: str
    head_dim: int
    causal: bool


def _kernel_values(spec: CompileSpec):
    """``(kernel, values, num_warps, num_stages)`` for ``compile_check.compile_triton``: the
    argument types and constexprs a dense launch of ``spec`` passes."""
    import torch

    from flashkernel.kernels import backward as bw
    from flashkernel.kernels._common import padded_head_dim

    ty = TRITON_TYPES[spec.dtype]
    config = bw.pick_config(spec.head_dim, getattr(torch, spec.dtype), interpreted=False, causal=spec.causal)
    tile = config.dkdv if spec.kernel == "dkdv" else config.dq
    rows, stat = ("i32",) * 3, ("i32",) * 2
    values = dict(Q=f"*{ty}", K=f"*{ty}", V=f"*{ty}", DOut=f"*{ty}", Lse="*fp32", Delta="*fp32",
                  CuSeqlensQ="*i32", CuSeqlensK="*i32", Slopes="*fp32",
                  q_strides=rows, k_strides=rows, v_strides=rows, do_strides=rows, lse_strides=stat,
                  delta_strides=stat, alibi_strides=stat,
                  qk_scale="fp32", sm_scale="fp32", softcap_in="fp32", softcap_out="fp32",
                  HEAD_DIM=spec.head_dim, BLOCK_D=padded_head_dim(spec.head_dim), BLOCK_M=tile.block_m,
                  BLOCK_N=tile.block_n, CAUSAL=spec.causal, HAS_WINDOW=False, HAS_SOFTCAP=False,
                  HAS_ALIBI=False, IS_VARLEN=False, BLOCK_B=1, DOT_F32=False, CLAMP_EXP=False,
                  DOT_PRECISION="ieee" if spec.dtype == "float32" else "tf32")
    if spec.kernel == "dkdv":
        values.update(DK=f"*{ty}", DV=f"*{ty}", dk_strides=("i32",) * 4, dv_strides=("i32",) * 4)
        kernel = bw._dkdv_kernel
    else:
        values.update(DQ=f"*{ty}", dq_strides=rows)
        kernel = bw._dq_kernel
    return kernel, values, tile.num_warps, tile.num_stages


def compile_report(spec: CompileSpec) -> dict:
    """Compile ``spec`` for sm_90a and report ptxas's registers and spills, the wgmma count of
    the PTX, and the problems: ptxas failing, spills beyond :data:`SPILL_ALLOWANCE`, no wgmma at
    16-bit dtypes."""
    from . import compile_check as cc

    kernel, values, num_warps, num_stages = _kernel_values(spec)
    compiled = cc.compile_triton(kernel, values, num_warps, num_stages)
    ptx = compiled.asm["ptx"]
    report = {**dataclasses.asdict(spec), **cc.ptxas_report(ptx, sass=False),
              "wgmma": ptx.count("wgmma.mma_async"), "shared_bytes": compiled.metadata.shared}
    problems = []
    if not report["ptxas_ok"]:
        problems.append("ptxas failed")
    if max(report["spill_stores"] or 0, report["spill_loads"] or 0) > SPILL_ALLOWANCE.get((spec.head_dim, spec.causal), 0):
        problems.append(f"spills {report['spill_stores']} B")
    if spec.dtype != "float32" and not report["wgmma"]:
        problems.append("no wgmma")
    report["problems"] = problems
    return report


def compile_specs(dtypes=COMPILE_DTYPES, head_dims=(64, 128, 256)) -> list[CompileSpec]:
    """The plain and causal dK/dV and dQ kernels at the table's configuration."""
    return [CompileSpec(kernel, dtype, head_dim, causal) for kernel in ("dkdv", "dq") for dtype in dtypes
            for head_dim in head_dims for causal in (False, True)]


def compile_in_child(specs, timeout: float = 900) -> list[dict]:
    """:func:`compile_report` of each spec in a fresh Python without ``TRITON_INTERPRET`` (the
    kernels cannot be compiled where the interpreter is on)."""
    import os
    import subprocess
    import tempfile

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        request, reply = Path(tmp) / "specs.json", Path(tmp) / "reports.json"
        request.write_text(json.dumps([dataclasses.asdict(s) for s in specs]))
        result = subprocess.run([sys.executable, "-m", "flashkernel.bench.backward", "--compile-specs", str(request),
                                 "--out", str(reply)], env=env, capture_output=True, text=True, timeout=timeout)
        if not reply.exists():
            raise RuntimeError(f"the compile child failed (rc {result.returncode}): {result.stderr[-3000:]}")
        return json.loads(reply.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m flashkernel.bench.backward", description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--masks", choices=["none", "causal"], nargs="+", default=["none", "causal"])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument("--compile-check", action="store_true",
                        help="compile the kernels for sm_90a (no GPU needed) and report registers and spills")
    parser.add_argument("--compile-specs", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=["backward"],
                        help="backward: the kernels against SDPA's backends; kernels: GPU time per backward "
                             "kernel; layer: one attention layer's forward + backward; model: training steps of a "
                             "4-layer Llama-shaped model")
    parser.add_argument("--plot", action="store_true", help="draw backward_tflops.png beside --out")
    parser.add_argument("--sweep", action="store_true",
                        help="time flashkernel's backward at candidate tile configurations (GPU)")
    args = parser.parse_args(argv)
    if args.compile_check or args.compile_specs:
        specs = (compile_specs(head_dims=args.head_dims) if args.compile_specs is None
                 else [CompileSpec(**fields) for fields in json.loads(args.compile_specs.read_text())])
        reports = [compile_report(spec) for spec in specs]
        for r in reports:
            print(f"{r['kernel']:5s} {r['dtype']:9s} d{r['head_dim']:<4d} {'causal' if r['causal'] else 'none':6s} "
                  f"regs {r['registers']} spills {r['spill_stores']}/{r['spill_loads']} B wgmma {r['wgmma']} "
                  f"smem {r['shared_bytes']} {'; '.join(r['problems']) or 'ok'}", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(reports, indent=1) + "\n")
        return 1 if any(r["problems"] for r in reports) else 0
    shapes = [(d, mask == "causal", s) for d in args.head_dims for mask in args.masks for s in args.seqlens]
    if args.sweep:
        run_sweep(shapes, args.out, min(args.rep_ms, 100), argv)
        return 0
    run_backward_bench(shapes, args.out, rep_ms=args.rep_ms, argv=argv, sections=tuple(args.sections), plot=args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
