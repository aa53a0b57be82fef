"""``flashkernel profile``: one configuration under Nsight Compute, plus Triton's resource report.

The command re-runs itself under ``ncu --clock-control none --profile-from-start off``; the inner
run warms the provider up (compiling everything) and brackets exactly one call with
``cudaProfilerStart`` / ``cudaProfilerStop``, so only that call's kernels are profiled. For each
kernel it prints DRAM and SM throughput (% of peak), achieved occupancy, registers per thread,
local-memory (spill) instructions and shared memory. The compiler's own report for flashkernel's
Triton kernels (registers, spills, shared memory, warps, stages) is printed from the current
process and needs no ncu.
"""

from __future__ import annotations

import csv
import importlib
import io
import os
import pkgutil
import shutil
import subprocess
import sys

from .results import format_table

NCU_METRICS = {
    "gpu__time_duration.sum": "time",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "regs/thread",
    "smsp__sass_inst_executed_op_local_ld.sum": "local ld",
    "smsp__sass_inst_executed_op_local_st.sum": "local st",
    "launch__shared_mem_per_block_static": "static smem",
    "launch__shared_mem_per_block_dynamic": "dynamic smem",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
}
NCU_FALLBACK_PATHS = ("/usr/local/cuda/bin/ncu",)
NCU_MISSING = (
    "Nsight Compute (`ncu`) was not found on PATH{where}. `flashkernel profile` runs the chosen "
    "configuration under ncu to read hardware counters; install Nsight Compute (it ships with the "
    "CUDA toolkit, or from https://developer.nvidia.com/nsight-compute) or pass --ncu /path/to/ncu."
)


def find_ncu(explicit: str | None = None) -> str | None:
    """Path of the ncu executable: ``explicit``, else PATH, else the CUDA toolkit's default."""
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    found = shutil.which("ncu")
    if found:
        return found
    return next((p for p in NCU_FALLBACK_PATHS if os.path.isfile(p) and os.access(p, os.X_OK)), None)


def ncu_missing_message(explicit: str | None = None) -> str:
    where = f" and --ncu {explicit} is not an executable" if explicit else " (nor /usr/local/cuda/bin/ncu)"
    return NCU_MISSING.format(where=where)


def ncu_command(ncu: str, inner_argv: list[str]) -> list[str]:
    """The ncu command line that profiles ``flashkernel profile --inner <inner_argv>``."""
    return [
        ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
        "--csv", "--print-units", "base", "--metrics", ",".join(NCU_METRICS),
        sys.executable, "-m", "flashkernel.cli", "profile", "--inner", *inner_argv,
    ]


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels from ``ncu --csv`` output: ``[{"id", "name", "metrics": {metric: (value, unit)}}]``.

    Lines that are not CSV (ncu's ``==PROF==`` notes, program output) are skipped.
    """
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return []
    kernels: dict = {}
    for record in csv.DictReader(io.StringIO("\n".join(lines))):
        if "Metric Name" not in record or record.get("ID") in (None, "ID"):
            continue
        kernel = kernels.setdefault(record["ID"], {"id": record["ID"], "name": record.get("Kernel Name", "?"),
                                                   "metrics": {}})
        value = _number(record.get("Metric Value", ""))
        kernel["metrics"][record["Metric Name"]] = (value, record.get("Metric Unit", ""))
    return list(kernels.values())


def _metric_cell(value, unit: str) -> str:
    if isinstance(value, float):
        if unit in ("nsecond", "ns"):
            return f"{value / 1e3:.1f} us"
        if unit in ("byte", "bytes") and value >= 1024:
            return f"{value / 1024:.0f} KiB"
        return f"{value:.1f}" if value % 1 else f"{value:.0f}"
    return str(value)


def kernel_table(kernels: list[dict]) -> str:
    headers = ["kernel"] + list(NCU_METRICS.values())
    body = []
    for kernel in kernels:
        cells = [_metric_cell(*kernel["metrics"].get(m, ("-", ""))) for m in NCU_METRICS]
        body.append([kernel["name"][:60]] + cells)
    return format_table(headers, body)


# --- Triton's compiled-kernel report -----------------------------------------------------------


def jit_functions():
    """``(module.name, kernel)`` for every Triton kernel in ``flashkernel.kernels`` (JIT functions
    on a GPU; interpreted ones, which compile nothing, under ``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import flashkernel.kernels as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, (JITFunction, InterpretedFunction)):
                yield f"{info.name}.{name}", obj


def compiled_kernels(functions) -> list[dict]:
    """Resource facts of every compiled variant of ``functions`` (name, JITFunction) pairs."""
    rows = []
    for name, fn in functions:
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():
                meta = kernel.metadata
                rows.append({
                    "kernel": name,
                    "registers": getattr(kernel, "n_regs", None),
                    "spills": getattr(kernel, "n_spills", None),
                    "shared_bytes": getattr(meta, "shared", None),
                    "num_warps": getattr(meta, "num_warps", None),
                    "num_stages": getattr(meta, "num_stages", None),
                })
    return rows


def triton_report(rows: list[dict]) -> str:
    if not rows:
        return "(no flashkernel Triton kernel was compiled by this configuration)"
    body = [[r["kernel"], str(r["registers"]), str(r["spills"]), str(r["shared_bytes"]), str(r["num_warps"]),
             str(r["num_stages"])] for r in rows]
    return format_table(["Triton kernel", "regs/thread", "spills", "shared bytes", "warps", "stages"], body)


# --- running one configuration -----------------------------------------------------------------


def prepared_call(workload: str, case, provider_name: str, device: str):
    """The provider's ready call on fresh inputs of ``case``."""
    from .registry import providers_for
    from .runner import make_inputs

    matches = [p for p in providers_for(workload) if p.name == provider_name]
    if not matches:
        raise ValueError(f"no {workload} provider named {provider_name!r}")
    return matches[0].build(make_inputs(case, device))


def run_profiled(prepared, warmup: int = 3) -> None:
    """Warm up, then one call between cudaProfilerStart and cudaProfilerStop."""
    import torch

    with prepared.context():
        for _ in range(warmup):
            prepared.call()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        prepared.call()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def run_under_ncu(ncu: str, inner_argv: list[str]) -> tuple[list[dict], str]:
    """Kernels measured by ncu, and ncu's raw output (for when nothing parses)."""
    done = subprocess.run(ncu_command(ncu, inner_argv), capture_output=True, text=True)
    return parse_ncu_csv(done.stdout), done.stdout[-3000:] + done.stderr[-3000:]
