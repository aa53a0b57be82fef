"""Compile the Gluon kernels for Hopper (sm_90a) without a GPU and check what ptxas makes of them.

    python -m flashkernel.bench.compile_check                      # what the tables dispatch
    python -m flashkernel.bench.compile_check --prefill-variants all --dtypes bfloat16 float16
    python -m flashkernel.bench.compile_check --decode-head-dims 128 --out report.json
    python -m flashkernel.bench.compile_check --prefill-head-dims --decode-caches float8_e4m3fn int8

Triton compiles for a ``GPUTarget`` on any machine, and its wheel bundles ``ptxas`` and
``cuobjdump``: every specialization is compiled exactly as a launch would compile it (the kernel
module's own ``launch_args``, with CPU tensors standing in for the GPU ones: only dtypes, shapes,
strides and 16-byte alignment reach the compiler), then assembled for ``sm_90a`` with ``ptxas -v``.
``tests/test_gluon_compile.py`` runs the default selection on machines without a GPU.

What fails a specialization (:func:`problems`):

* every kernel: ptxas rejects the PTX, or spills (spill stores or loads > 0 bytes; the backward
  at head dim 128 within :data:`BACKWARD_SPILL_ALLOWANCE`);
* backward: no ``HGMMA``, no TMA load or no TMA reduction (``cp.reduce.async.bulk.tensor``);
* prefill: no ``wgmma`` in the PTX or no ``HGMMA`` in the SASS, no TMA bulk-tensor load or
  store, ptxas "Performance Loss" notes (it serialized the wgmma: every one waited for at once,
  no overlap; reported as info lines C7510-C7520, not warnings), and, for the pipelined loops,
  a loop body without ``exp2`` between the two wgmma waits (the softmax of tile j must run under
  the PV product of tile j-1);
* decode: no ``mma.sync`` or ``ldmatrix`` (the consumer's warp-level MMAs), no TMA load.

The compiling process must not run Triton's interpreter: under ``TRITON_INTERPRET=1`` the
``@triton.jit`` helpers of the kernel modules are interpreter objects, which the compiler refuses
("Unsupported function referenced: InterpretedFunction"). :func:`compile_in_child` runs the
checks in a fresh Python without it (the test suite sets it on CPU-only machines).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The Gluon kernel modules: the one place this module names them.
PREFILL_GLUON = "flashkernel.kernels.gluon.prefill"
DECODE_GLUON = "flashkernel.kernels.gluon.decode"
BACKWARD_GLUON = "flashkernel.kernels.gluon.backward"

ARCH = "sm_90a"
GPU_NAME = "NVIDIA H200"  # whose table entry (by capability: sm_90) the default selection compiles
DTYPES = ("bfloat16", "float16")

# Named prefill configurations beyond what the table dispatches: changes to the head dim's
# default ``gluon/prefill.py`` ``CONFIGS`` entry (``d64_3wg*``: to ``D64_3WG``). Head dims they exist
# for are in ``PREFILL_VARIANT_HEAD_DIMS`` (default: all).
PREFILL_VARIANTS = {
    "simple": dict(pipeline=False, pingpong=False),
    "pipeline": dict(pipeline=True, pingpong=False),
    "pingpong": dict(pipeline=True, pingpong=True),
    "persistent": dict(pipeline=True, pingpong=False, persistent=True),
    "persistent_pingpong": dict(pipeline=True, pingpong=True, persistent=True),
    "persistent_simple": dict(pipeline=False, pingpong=False, persistent=True),
    "d64_3wg": dict(pipeline=False, pingpong=False),
    "d64_3wg_persistent": dict(pipeline=False, pingpong=False, persistent=True),
    "d64_3wg_n64_persistent": dict(block_n=64, stages=3, pipeline=True, pingpong=False, persistent=True),
    "persistent_wg": dict(pipeline=True, pingpong=False, persistent=True, wg_tiles=True),
    "persistent_pingpong_wg": dict(pipeline=True, pingpong=True, persistent=True, wg_tiles=True),
    "pipeline_wg": dict(pipeline=True, pingpong=False, wg_tiles=True),
    "persistent_n64_wg": dict(block_n=64, stages=4, pipeline=True, pingpong=False, persistent=True, wg_tiles=True),
    "d64_3wg_persistent_wg": dict(pipeline=False, pingpong=False, persistent=True, wg_tiles=True),
    "persistent_q_as_o": dict(pipeline=True, pingpong=False, persistent=True, shared_o=False),
    "persistent_wg_q_as_o": dict(pipeline=True, pingpong=False, persistent=True, wg_tiles=True, shared_o=False),
    "persistent_snake": dict(pipeline=True, pingpong=False, persistent=True, causal_pairs=False),
    "persistent_wg_snake": dict(pipeline=True, pingpong=False, persistent=True, wg_tiles=True, causal_pairs=False),
    "persistent_pingpong_snake": dict(pipeline=True, pingpong=True, persistent=True, causal_pairs=False),
    "d64_3wg_persistent_snake": dict(pipeline=False, pingpong=False, persistent=True, causal_pairs=False),
}
PREFILL_VARIANT_HEAD_DIMS = {name: (64,) for name in PREFILL_VARIANTS if name.startswith("d64_")}
PREFILL_VARIANT_HEAD_DIMS["persistent_n64_wg"] = (64, 128)
PREFILL_VARIANT_HEAD_DIMS.update({name: (256,) for name in PREFILL_VARIANTS if name.endswith("q_as_o")})
PREFILL_HEAD_DIMS = (64, 128, 256)

DECODE_HEAD_DIMS = (64, 128, 256)
DECODE_PAGES = (0, 16, 64, 256)  # 0: a contiguous cache
DECODE_ROWS = ((4, 1), (8, 2))  # (GQA group, new tokens): 4 and 16 query rows per KV head
DECODE_QUANTIZED_CACHES = ("float8_e4m3fn", "int8")


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """One prefill specialization: ``config`` is ``"table:<seqlen_k>"`` (the configuration the
    table's rules give a call with that many keys) or a name of :data:`PREFILL_VARIANTS`."""

    head_dim: int
    causal: bool
    dtype: str
    config: str
    family: str = "prefill"

    def label(self) -> str:
        config = self.config.replace("table:", "table rule at Sk=")
        return f"prefill {self.dtype} d{self.head_dim} {'causal' if self.causal else 'full'} {config}"


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """One decode specialization: head dim, page size (0: contiguous), mask, GQA group x new tokens."""

    head_dim: int
    page_size: int
    causal: bool
    group: int
    seqlen_new: int
    dtype: str
    family: str = "decode"
    cache_dtype: str | None = None  # None: q's dtype; "float8_e4m3fn" / "int8": quantized (per-head scales)

    def label(self) -> str:
        layout = f"page {self.page_size}" if self.page_size else "contiguous"
        cache = f" {self.cache_dtype} cache" if self.cache_dtype else ""
        return (f"decode {self.dtype}{cache} d{self.head_dim} {layout} {'causal' if self.causal else 'full'} "
                f"rows {self.group * self.seqlen_new}")


@dataclasses.dataclass(frozen=True)
class BackwardSpec:
    """One specialization of the Gluon backward kernel."""

    head_dim: int
    causal: bool
    dtype: str
    family: str = "backward"

    def label(self) -> str:
        return f"backward {self.dtype} d{self.head_dim} {'causal' if self.causal else 'full'}"


# Spill bytes (stored) the backward may show at sm_90a: at head dim 128 two float32 [64, 128]
# accumulators (dK, dV) share the 240 registers of a consumer warpgroup with the score tiles, and
# ptxas spills a few scalars outside the step loops (8 B without the mask, 52 B causal). With the
# wgmma descriptors of the K/V views hoisted out of the tile loop it spilled 332-460 B and
# reloaded them every step (gluon/backward.py, ``_kv_views``); more than the allowance fails.
BACKWARD_SPILL_ALLOWANCE = {64: 0, 128: 64}


def backward_specs(head_dims=(64, 128), dtypes=DTYPES) -> list[BackwardSpec]:
    return [BackwardSpec(head_dim, causal, dtype) for dtype in dtypes for head_dim in head_dims
            for causal in (False, True)]


def spec_from_dict(fields: dict):
    kind = {"prefill": PrefillSpec, "backward": BackwardSpec}.get(fields.get("family"), DecodeSpec)
    return kind(**fields)


# ---- the toolchain ----------------------------------------------------------------------------------


def _nvidia_bin(tool: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool


def toolchain_problem() -> str | None:
    """Why the checks cannot run here (None when they can): Triton's bundled ptxas / cuobjdump
    missing, or the Gluon kernel modules not importable with this Triton."""
    for tool in ("ptxas", "cuobjdump"):
        path = _nvidia_bin(tool)
        if not os.access(path, os.X_OK):
            return f"Triton's bundled {tool} is missing ({path})"
    for name in (PREFILL_GLUON, DECODE_GLUON, BACKWARD_GLUON):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure: another Triton, no Gluon
            return f"{name} does not import here: {type(exc).__name__}: {exc}"
    return None


def target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def compile_gluon(fn, args, kwargs, options: dict):
    """Compile Gluon kernel ``fn`` for sm_90a as a launch with positional ``args`` (tensors,
    TMA descriptors, scalars) and constexpr ``kwargs`` would; pointers get the 16-byte
    divisibility a launch with aligned tensors gets."""
    import torch
    import triton
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        signature[name] = mangle_type(value)
        if isinstance(value, torch.Tensor):
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name, value in kwargs.items():
        signature[name] = "constexpr"
        constexprs[(fn.arg_names.index(name),)] = value
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target(), options=options)


def compile_triton(fn, values: dict, num_warps: int, num_stages: int):
    """Compile ``@triton.jit`` kernel ``fn`` for sm_90a. ``values``: argument name -> type string
    (``"*bf16"``, ``"i32"``, ``"fp32"``), a tuple of type strings (a tuple argument), or a
    constexpr value; arguments not named are int32 scalars. Pointers and stride arguments (names
    starting with ``stride`` or ending in ``stride``/``strides``; but those listed in
    ``values["_unit_strides"]``, tuple elements as ``"name[j]"``) get the 16-divisibility
    attribute, as a launch with aligned tensors does."""
    import triton
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    unit = values.get("_unit_strides", ())

    def is_stride(name):
        return name.startswith("stride") or name.endswith(("stride", "strides"))

    for i, name in enumerate(fn.arg_names):
        value = values.get(name, "i32")
        if isinstance(value, tuple):
            signature[name] = value
            for j in range(len(value)):
                if f"{name}[{j}]" not in unit:
                    attrs[(i, j)] = [["tt.divisibility", 16]]
        elif isinstance(value, str) and (value.startswith("*") or value in ("i32", "fp32")):
            signature[name] = value
            if value.startswith("*") or (is_stride(name) and name not in unit):
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "constexpr"
            constexprs[name] = value
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target(), options={"num_warps": num_warps, "num_stages": num_stages})


def ptxas_report(ptx: str, sass: bool = True) -> dict:
    """Registers, spills and notes of ``ptxas -arch=sm_90a -v``; with ``sass``, also
    :func:`sass_report` of the assembled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        source.write_text(ptx)
        result = subprocess.run([str(_nvidia_bin("ptxas")), f"-arch={ARCH}", "-v", str(source), "-o", str(cubin)],
                                capture_output=True, text=True)
        disassembly = ""
        if sass and result.returncode == 0:
            disassembly = subprocess.run([str(_nvidia_bin("cuobjdump")), "-sass", str(cubin)],
                                         capture_output=True, text=True).stdout
    text = result.stdout + result.stderr
    regs = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    notes = [line.strip() for line in text.splitlines()
             if "warning" in line.lower() or "Performance Loss" in line or "is injected" in line]
    report = dict(ptxas_ok=result.returncode == 0, registers=int(regs.group(1)) if regs else None,
                  spill_stores=int(stores.group(1)) if stores else None,
                  spill_loads=int(loads.group(1)) if loads else None, ptxas_notes=notes)
    if result.returncode != 0:
        report["ptxas_error"] = text[-2000:]
    if sass:
        report.update(sass_report(disassembly))
    return report


def sass_report(sass: str) -> dict:
    """``max_register``: the highest register index in the SASS (``registers`` is the launch
    limit; warp-specialized partitions move theirs with setmaxnreg). ``hgmma``: HGMMA
    instructions. ``mufu_overlap``: per pipelined loop body, the ``MUFU.EX2`` between the wait
    that leaves one wgmma group in flight (``DEPBAR.LE gsb0, 0x1``) and the wait for it
    (``0x0``): the softmax that runs under the PV product (empty for loops without that wait)."""
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    overlap, counting = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            counting = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and counting is not None:
            overlap.append(counting)
            counting = None
        elif counting is not None and re.search(r"\bMUFU\.EX2\b", line):
            counting += 1
    return dict(max_register=max(regs) if regs else None, hgmma=len(re.findall(r"\bHGMMA\.", sass)),
                mufu_overlap=overlap)


def ptx_counts(ptx: str) -> dict:
    """Instruction counts in the PTX that the checks look at."""
    return dict(
        wgmma=ptx.count("wgmma.mma_async"),
        mma_sync=ptx.count("mma.sync"),
        ldmatrix=ptx.count("ldmatrix"),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
        tma_reductions=len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)),
        setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
    )


# ---- one specialization -----------------------------------------------------------------------------


def prefill_config(spec: PrefillSpec):
    """The ``GluonConfig`` of ``spec``. Persistent causal configurations compile in pairs of query
    tiles (the order they run in at the benchmark shapes) unless the variant asks for the other."""
    from flashkernel.kernels import dispatch, tuning

    gluon = importlib.import_module(PREFILL_GLUON)
    if spec.config.startswith("table:"):
        rule = tuning.gluon_rule(GPU_NAME, "sm_90", spec.head_dim, spec.causal, int(spec.config.split(":")[1]))
        config = dispatch.gluon_config_from(rule, spec.head_dim)
    else:
        base = gluon.D64_3WG if spec.config.startswith("d64_3wg") else gluon.CONFIGS[spec.head_dim]
        config = dataclasses.replace(base, **PREFILL_VARIANTS[spec.config])
    return dataclasses.replace(config, causal_pairs=config.causal_pairs is not False)


def _standin_inputs(spec):
    """CPU stand-ins for a prefill or backward launch: ``q [2, 200, 4, D]``, ``k [2, 300, 2,
    D]`` in the spec's dtype and ``lse [2, 4, 200]`` float32."""
    import torch

    dtype = getattr(torch, spec.dtype)
    q = torch.empty(2, 200, 4, spec.head_dim, dtype=dtype)
    k = torch.empty(2, 300, 2, spec.head_dim, dtype=dtype)
    return q, k, torch.empty(2, 4, 200, dtype=torch.float32)


def compile_prefill(spec: PrefillSpec) -> tuple[object, dict]:
    """``(compiled kernel, the config's fields)`` of one prefill specialization."""
    import torch

    gluon = importlib.import_module(PREFILL_GLUON)
    q, k, lse = _standin_inputs(spec)
    config = prefill_config(spec)
    _, args, kwargs = gluon.launch_args(q, k, torch.empty_like(k), torch.empty_like(q), lse, spec.causal, 0.125, config)
    options = {"num_warps": 4, "maxnreg": gluon.maxnreg_for(config)}
    return compile_gluon(gluon._gluon_attention_kernel, args, kwargs, options), dataclasses.asdict(config)


def compile_decode(spec: DecodeSpec) -> tuple[object, dict]:
    """``(compiled kernel, the config's fields)`` of one decode specialization."""
    import torch

    gluon = importlib.import_module(DECODE_GLUON)
    dtype = getattr(torch, spec.dtype)
    batch, kv_heads, splits, heads = 2, 2, 3, 2 * spec.group
    q = torch.empty(batch, spec.seqlen_new, heads, spec.head_dim, dtype=dtype)
    cache_dtype = getattr(torch, spec.cache_dtype) if spec.cache_dtype else dtype
    if spec.page_size == 0:
        k_cache, block_table = torch.empty(batch, 512, kv_heads, spec.head_dim, dtype=cache_dtype), None
    else:
        k_cache = torch.empty(64, spec.page_size, kv_heads, spec.head_dim, dtype=cache_dtype)
        block_table = torch.zeros(batch, 64, dtype=torch.int32)
    scales = {}
    if spec.cache_dtype:
        scales = dict(k_scale=torch.ones(kv_heads), v_scale=torch.ones(kv_heads))
    seqlens = torch.zeros(batch, dtype=torch.int32)
    parts = torch.empty(splits, batch, spec.seqlen_new, heads, spec.head_dim, dtype=torch.float32)
    parts_lse = torch.empty(splits, batch, heads, spec.seqlen_new, dtype=torch.float32)
    from flashkernel.kernels import tuning

    config = gluon.config_for(spec.head_dim, tuning.decode_tuning(None))
    _, args, kwargs = gluon.launch_args(
        q, k_cache, torch.empty_like(k_cache), seqlens, block_table, parts, parts_lse, parts.stride()[:4],
        parts_lse.stride(), appended=0, capacity=512, num_blocks=k_cache.shape[0], page_size=spec.page_size,
        num_splits=splits, causal=spec.causal, softmax_scale=0.1, config=config, sms=132, **scales)
    return compile_gluon(gluon._gluon_decode_kernel, args, kwargs, {"num_warps": 4}), dataclasses.asdict(config)


def compile_backward(spec: BackwardSpec) -> tuple[object, dict]:
    """``(compiled kernel, its launch constants)`` of one backward specialization."""
    import torch

    gluon = importlib.import_module(BACKWARD_GLUON)
    q, k, _ = _standin_inputs(spec)
    sq_pad = 256
    dq_acc = torch.empty(2, 4, sq_pad, spec.head_dim, dtype=torch.float32)
    stats = torch.empty(2 * 4, 2, sq_pad, dtype=torch.float32)
    _, args, kwargs = gluon.launch_args(q, k, torch.empty_like(k), torch.empty_like(q), stats, dq_acc,
                                        torch.empty_like(k), torch.empty_like(k), torch.empty(1, dtype=torch.int32),
                                        causal=spec.causal,
                                        softmax_scale=0.1)
    compiled = compile_gluon(gluon._gluon_backward_kernel, args, kwargs, {"num_warps": 4, "maxnreg": gluon.MAXNREG})
    return compiled, {name: value for name, value in kwargs.items()}


def check_spec(spec) -> dict:
    """Compile one specialization and report on it; ``problems`` lists what fails the check."""
    start = time.monotonic()
    report = dict(dataclasses.asdict(spec), label=spec.label())
    try:
        compile_family = {"prefill": compile_prefill, "backward": compile_backward}.get(spec.family, compile_decode)
        compiled, config = compile_family(spec)
    except Exception as exc:  # noqa: BLE001 - report every specialization
        report.update(error=f"{type(exc).__name__}: {exc}"[-2000:], problems=["does not compile"])
        return report
    ptx = compiled.asm["ptx"]
    report.update(config=config, compile_s=round(time.monotonic() - start, 2), shared_bytes=compiled.metadata.shared,
                  **ptx_counts(ptx), **ptxas_report(ptx))
    report["problems"] = problems(report)
    return report


def problems(report: dict) -> list[str]:
    """What is wrong with one compiled specialization (see the module docstring)."""
    found = []
    if not report["ptxas_ok"]:
        return [f"ptxas failed: {report.get('ptxas_error', '')[-300:]}"]
    allowance = BACKWARD_SPILL_ALLOWANCE[report["head_dim"]] if report["family"] == "backward" else 0
    if report["spill_stores"] > allowance or report["spill_loads"] > allowance + allowance // 4:
        found.append(f"spills {report['spill_stores']} B stored / {report['spill_loads']} B loaded")
    if report["family"] == "backward":
        if not report["hgmma"]:
            found.append("no HGMMA")
        if not report["tma_loads"] or not report["tma_reductions"]:
            found.append(f"TMA loads {report['tma_loads']}, reductions {report['tma_reductions']}")
    elif report["family"] == "prefill":
        if not report["wgmma"] or not report["hgmma"]:
            found.append(f"no wgmma (PTX {report['wgmma']}, SASS HGMMA {report['hgmma']})")
        if not report["tma_loads"] or not report["tma_stores"]:
            found.append(f"TMA loads {report['tma_loads']}, stores {report['tma_stores']}")
        serialized = [n for n in report["ptxas_notes"] if "Performance Loss" in n]
        if serialized:
            found.append(f"ptxas serialized the wgmma: {serialized[0]}")
        if report["config"]["pipeline"] and (not report["mufu_overlap"] or not all(report["mufu_overlap"])):
            found.append(f"pipelined loop without exp2 under the PV wgmma (per loop: {report['mufu_overlap']})")
    else:
        if not report["mma_sync"] or not report["ldmatrix"]:
            found.append(f"mma.sync {report['mma_sync']}, ldmatrix {report['ldmatrix']}")
        if not report["tma_loads"]:
            found.append("no TMA load")
    return found


# ---- selections ---------------------------------------------------------------------------------------


def table_seqlens(head_dim: int) -> list[int]:
    """Key counts that reach every rule of the table's Gluon entry for ``head_dim``: each
    threshold, one past it, and 1."""
    from flashkernel.kernels import tuning

    rules = ((tuning.gpu_entry(GPU_NAME, "sm_90") or {}).get("gluon") or {}).get(str(head_dim), [])
    limits = {rule["max_seqlen_k"] for rule in rules if "max_seqlen_k" in rule}
    return sorted({1} | limits | {limit + 1 for limit in limits})


def dispatched_prefill_specs(head_dims=PREFILL_HEAD_DIMS, dtypes=DTYPES) -> list[PrefillSpec]:
    """One spec per distinct configuration the table dispatches (per head dim, mask and dtype)."""
    specs = []
    for dtype in dtypes:
        for head_dim in head_dims:
            seen = set()
            for causal in (False, True):
                for seqlen_k in table_seqlens(head_dim):
                    spec = PrefillSpec(head_dim, causal, dtype, f"table:{seqlen_k}")
                    key = (causal, tuple(sorted(dataclasses.asdict(prefill_config(spec)).items())))
                    if key not in seen:
                        seen.add(key)
                        specs.append(spec)
    return specs


def variant_prefill_specs(variants, head_dims=PREFILL_HEAD_DIMS, dtypes=DTYPES) -> list[PrefillSpec]:
    return [PrefillSpec(head_dim, causal, dtype, variant)
            for dtype in dtypes for head_dim in head_dims for causal in (False, True) for variant in variants
            if head_dim in PREFILL_VARIANT_HEAD_DIMS.get(variant, PREFILL_HEAD_DIMS)]


def decode_specs(head_dims=DECODE_HEAD_DIMS, pages=DECODE_PAGES, dtypes=DTYPES, rows=DECODE_ROWS,
                 causal=(True, False), cache_dtypes=(None,)) -> list[DecodeSpec]:
    return [DecodeSpec(head_dim, page, is_causal, group, seqlen_new, dtype, cache_dtype=cache)
            for cache in cache_dtypes for dtype in dtypes for head_dim in head_dims for page in pages
            for is_causal in causal for group, seqlen_new in rows]


# ---- running ------------------------------------------------------------------------------------------


def check_specs(specs, log=None) -> list[dict]:
    """:func:`check_spec` of every spec in this process (``TRITON_INTERPRET`` must be unset)."""
    reports = []
    for spec in specs:
        report = check_spec(spec)
        reports.append(report)
        if log:
            log(summary_line(report))
    return reports


def compile_in_child(specs, timeout: float = 900) -> list[dict]:
    """:func:`check_specs` in a fresh Python without ``TRITON_INTERPRET`` (see the module docstring)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        request, reply = Path(tmp) / "specs.json", Path(tmp) / "reports.json"
        request.write_text(json.dumps([dataclasses.asdict(s) for s in specs]))
        result = subprocess.run([sys.executable, "-m", "flashkernel.bench.compile_check", "--specs", str(request), "--out", str(reply), "--quiet"],
                                env=env, capture_output=True, text=True, timeout=timeout)
        if not reply.exists():
            raise RuntimeError(f"the compile child failed (rc {result.returncode}): {result.stderr[-3000:]}")
        return json.loads(reply.read_text())["reports"]


def summary_line(report: dict) -> str:
    if "error" in report:
        return f"{report['label']}: FAILED {report['error'][:300]}"
    counts = {"prefill": f"wgmma {report['wgmma']}, exp2 under PV {report['mufu_overlap']}, setmaxnreg "
                         f"{report['setmaxnreg']}",
              "backward": f"wgmma {report['wgmma']}, TMA reductions {report['tma_reductions']}"}.get(
        report["family"], f"mma.sync {report['mma_sync']}, ldmatrix {report['ldmatrix']}")
    verdict = "" if not report["problems"] else "  <-- " + "; ".join(report["problems"])
    return (f"{report['label']}: {report['registers']} regs (max R{report['max_register']}), spills "
            f"{report['spill_stores']}/{report['spill_loads']} B, {counts}, TMA {report['tma_loads']} loads/"
            f"{report['tma_stores']} stores, smem {report['shared_bytes'] // 1024} KB, {report['compile_s']} s{verdict}")


def selected_specs(args) -> list:
    if args.specs:
        return [spec_from_dict(fields) for fields in json.loads(Path(args.specs).read_text())]
    if args.prefill_variants == ["table"]:
        specs = dispatched_prefill_specs(args.prefill_head_dims, args.dtypes)
    else:
        variants = list(PREFILL_VARIANTS) if args.prefill_variants == ["all"] else args.prefill_variants
        specs = variant_prefill_specs(variants, args.prefill_head_dims, args.dtypes)
    caches = [None if name == "same" else name for name in args.decode_caches]
    return (specs + decode_specs(args.decode_head_dims, args.decode_pages, args.dtypes, cache_dtypes=caches)
            + backward_specs(dtypes=args.dtypes))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill-variants", nargs="+", default=["table"],
                        choices=["table", "all", *PREFILL_VARIANTS],
                        help="table: the configurations the tuned table dispatches (default); all: every named variant")
    parser.add_argument("--prefill-head-dims", nargs="*", type=int, default=list(PREFILL_HEAD_DIMS))
    parser.add_argument("--decode-head-dims", nargs="*", type=int, default=list(DECODE_HEAD_DIMS))
    parser.add_argument("--decode-pages", nargs="+", type=int, default=list(DECODE_PAGES))
    parser.add_argument("--decode-caches", nargs="+", default=["same", *DECODE_QUANTIZED_CACHES],
                        choices=["same", *DECODE_QUANTIZED_CACHES],
                        help="decode cache dtypes: q's ('same') and the quantized formats (per-head scales)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--out", help="write every report as JSON here")
    parser.add_argument("--specs", help=argparse.SUPPRESS)  # a JSON list of specs (compile_in_child)
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: the kernels would be built for the interpreter; unset it")
    problem = toolchain_problem()
    if problem:
        print(f"cannot compile for {ARCH} here: {problem}")
        return 2
    reports = check_specs(selected_specs(args), log=None if args.quiet else print)
    failed = [r for r in reports if r["problems"]]
    if args.out:
        Path(args.out).write_text(json.dumps({"arch": ARCH, "ok": not failed, "reports": reports}, indent=1))
    if not args.quiet:
        print(f"{len(reports) - len(failed)} of {len(reports)} specializations compile for {ARCH} without problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
