"""What this GPU is, and what it can do: facts from the driver plus two measured ceilings.

* copy bandwidth: ``dst.copy_(src)`` on 1 GiB buffers; bytes = read + written (2 x size).
* dense matmul: ``torch.mm`` on 8192 x 8192 bf16 matrices; FLOPs = 2 * n^3.

Both are measured once per device and cached in ``~/.cache/flashkernel/ceilings.json`` (or
``$FLASHKERNEL_CACHE_DIR`` / ``$XDG_CACHE_HOME/flashkernel``), keyed by GPU name and UUID.
Benchmark figures are reported as fractions of these measured ceilings, not of datasheet peaks.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

from . import measure

CACHE_ENV = "FLASHKERNEL_CACHE_DIR"
COPY_BYTES = 2**30
MATMUL_N = 8192
CEILING_SETTINGS = measure.Settings(warmup_ms=50, rep_ms=200, min_samples=10, max_samples=200)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashkernel"


def cache_path() -> Path:
    return cache_dir() / "ceilings.json"


def versions() -> dict:
    import torch
    import triton

    import flashkernel

    return {"flashkernel": flashkernel.__version__, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda or "", "python": platform.python_version()}


def device_facts(index: int | None = None) -> dict:
    """Name, SM count, L2, memory, compute capability and UUID of a CUDA device."""
    import torch

    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    return {
        "name": props.name,
        "index": index,
        "uuid": str(getattr(props, "uuid", "")),
        "sm_count": props.multi_processor_count,
        "l2_bytes": int(getattr(props, "L2_cache_size", 0)),
        "memory_bytes": int(props.total_memory),
        "compute_capability": f"{props.major}.{props.minor}",
    }


def device_key(facts: dict) -> str:
    return f"{facts['name']}|{facts['uuid']}"


def measure_copy_gbps(size_bytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    size_bytes = int(min(size_bytes, free // 4))
    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    timing = measure.time_cuda([lambda: dst.copy_(src)], CEILING_SETTINGS)
    return 2 * size_bytes / (timing.median_ms * 1e-3) / 1e9


def measure_matmul_tflops(n: int = MATMUL_N) -> float:
    """Dense bf16 matmul TFLOP/s of ``torch.mm`` on n x n matrices (2 n^3 FLOPs)."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    timing = measure.time_cuda([lambda: torch.mm(a, b, out=c)], CEILING_SETTINGS)
    return 2 * n**3 / (timing.median_ms * 1e-3) / 1e12


def read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, entries: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1) + "\n")
    tmp.replace(path)


def measure_ceilings() -> dict:
    return {
        "copy_gbps": measure_copy_gbps(),
        "matmul_tflops": measure_matmul_tflops(),
        "copy_bytes": COPY_BYTES,
        "matmul_n": MATMUL_N,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **{f"measured_with_{k}": v for k, v in versions().items() if k in ("torch", "cuda")},
    }


def ceilings(refresh: bool = False, measure_fn=measure_ceilings) -> dict:
    """The measured ceilings of the current CUDA device, from the cache unless ``refresh``."""
    facts = device_facts()
    key = device_key(facts)
    path = cache_path()
    entries = read_cache(path)
    if refresh or key not in entries:
        entries[key] = {**measure_fn(), "device": facts["name"]}
        write_cache(path, entries)
        entries[key]["source"] = "measured now"
    else:
        entries[key]["source"] = f"cached in {path}"
    return entries[key]


def info_lines(device: str, ceiling: dict | None, facts: dict | None) -> list[str]:
    """The text of ``flashkernel info``."""
    v = versions()
    lines = [f"flashkernel {v['flashkernel']}  torch {v['torch']}  triton {v['triton']}  "
             f"CUDA {v['cuda'] or '-'}  python {v['python']}"]
    if device != "cuda" or facts is None:
        lines += ["GPU: none (no CUDA device visible to torch)",
                  "flashkernel's kernels would run in Triton's CPU interpreter (TRITON_INTERPRET=1): "
                  "correct but slow, for testing only; no ceilings measured"]
        return lines
    lines += [
        f"GPU: {facts['name']}  (device {facts['index']}, compute capability {facts['compute_capability']})",
        f"SMs: {facts['sm_count']}   L2: {facts['l2_bytes'] / 2**20:.0f} MiB   "
        f"memory: {facts['memory_bytes'] / 2**30:.1f} GiB",
    ]
    if ceiling:
        lines += [
            f"measured copy bandwidth (read + write): {ceiling['copy_gbps']:.0f} GB/s",
            f"measured dense bf16 matmul ({ceiling.get('matmul_n', MATMUL_N)}^3): "
            f"{ceiling['matmul_tflops']:.0f} TFLOP/s",
            f"ceilings {ceiling.get('source', '')} (measured {ceiling.get('measured_at', '?')}; "
            "`flashkernel info --refresh` re-measures)",
        ]
    return lines
