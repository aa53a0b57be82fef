"""Check and time the Gluon prefill prototype (``kernels/prefill_gluon.py``) on an H200.

    PYTHONPATH=src python benchmarks/tools/gluon_check.py --out $OUT/gluon.json   # GPU
    PYTHONPATH=src python benchmarks/tools/gluon_check.py --compile-only           # no GPU

GPU mode runs each stage in a child process that is killed when its progress stalls (``--stall``,
45 s: a kernel waiting on a wrong mbarrier phase never returns) or when the budget runs out, so a
hang costs one stage, not the run; the whole run stays under ``--budget`` seconds (default 235).

1. ``correctness``, all variants in one child, in order (when a launch hangs or crashes, that
   variant fails and a new child goes on with the variants after it): ``simple`` (QK^T, wait,
   softmax, PV, wait), ``pipeline`` (softmax of tile j overlaps ``P_{j-1} V_{j-1}``; the
   kernel's default), ``pingpong`` (plus the two consumer warpgroups taking turns on the tensor
   cores), ``persistent``/``persistent_pingpong``/``persistent_simple`` (the same loops on a
   persistent grid, one program per SM looping over work items) and, at d64 only, ``d64_3wg``
   (3 consumer warpgroups, 192-row tiles, simple loop), ``d64_3wg_persistent`` and
   ``d64_3wg_n64_persistent`` (pipelined, BLOCK_N 64); the ``*_wg`` variants add per-warpgroup
   key ranges for causal (``GluonConfig.wg_tiles``: ``persistent_wg``, ``persistent_pingpong_wg``,
   ``pipeline_wg`` (non-persistent), ``persistent_n64_wg`` (BLOCK_N 64, d64/d128) and
   ``d64_3wg_persistent_wg``). The first variant runs bf16 and fp16,
   the others bf16 (``--all-dtypes`` for both). B = 2, Hq = 4, Hkv = 2, d 64/128/256, causal and
   not, ``CORRECTNESS_LENGTHS``; persistent variants run each case twice, with their natural
   grid and with ``PERSISTENT_TEST_GRID`` (7) programs so that every program runs many work
   items. Inputs and outputs are views
   into larger NaN-filled buffers (37 extra rows, one extra head), so reading outside a (batch,
   head)'s rows puts NaN in the output and writing outside them changes a guard; ``out`` is
   NaN-poisoned before the launch. Output error against the float64 reference must be at most 2x
   PyTorch's own same-dtype error plus eps(dtype) * max|ref| (the rule of ``tests/helpers.py``
   and ``flashkernel.bench.accuracy``; both errors are recorded), the mean error likewise, and
   the LSE within 5e-5 relative with the same ``-inf`` rows.
2. ``bench``: the issue's shapes (bf16, 16k tokens per batch, Hq = Hkv = 2048 / d, seqlen
   1k/4k/16k, d 64/128/256, causal and not; d128 16k first) for SDPA's cuDNN backend (inputs
   transposed to ``[B, H, S, D]``), the Gluon variants that passed, and ``flash_attn_func``:
   median of ``triton.testing.do_bench`` after one untimed call, TFLOP/s with FLOPs =
   4 * B * Hq * D * visible pairs, ratios to cuDNN and to flashkernel, and each output's max
   abs difference from cuDNN's. The Gluon calls also write the LSE (as in stage 1, so the
   compiled kernels are reused). A Gluon variant that hangs here is dropped and the remaining
   cases rerun without it. Ends with the best Gluon variant of each shape and its ratio to cuDNN.

Selection: ``--variants``, ``--head-dims``, ``--causal-only`` (both stages) and ``--seqlens``
(bench) pick what runs; ``--no-flashkernel`` drops ``flash_attn_func`` from the bench. A short
focused job on the short causal shapes (~2-3 min)::

    PYTHONPATH=src python benchmarks/tools/gluon_check.py --out $OUT/gluon-causal.json \
        --seqlens 512 1024 2048 4096 --causal-only --no-flashkernel --dtypes bfloat16 \
        --budget 175 --bench-reserve 70 --variants persistent persistent_pingpong d64_3wg_persistent \
        persistent_wg persistent_pingpong_wg persistent_n64_wg d64_3wg_persistent_wg

Each child writes a ``start`` line before every launch, so a case that hung is named in the JSON.
``--compile-only`` compiles every specialization for sm_90a with the bundled ptxas and reports
registers, spills, ptxas warnings (and its "wgmma serialized" performance notes, which fail the
check), wgmma/TMA instruction counts and, from the SASS, the highest register used and how many
exp2 sit between the two wgmma waits of the pipelined loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.pop("TRITON_INTERPRET", None)

VARIANTS = {
    "simple": dict(pipeline=False, pingpong=False),
    "pipeline": dict(pipeline=True, pingpong=False),
    "pingpong": dict(pipeline=True, pingpong=True),
    # Persistent grid (one CTA per SM looping over work items, next item's Q/K/V prefetched).
    "persistent": dict(pipeline=True, pingpong=False, persistent=True),
    "persistent_pingpong": dict(pipeline=True, pingpong=True, persistent=True),
    "persistent_simple": dict(pipeline=False, pingpong=False, persistent=True),
    # d64 only: 3 consumer warpgroups (192-row tiles), on prefill_gluon.D64_3WG.
    # (The pipelined loop with 3 warpgroups at BLOCK_N 128 spills at 160 registers: not offered.)
    "d64_3wg": dict(pipeline=False, pingpong=False),
    "d64_3wg_persistent": dict(pipeline=False, pingpong=False, persistent=True),
    "d64_3wg_n64_persistent": dict(block_n=64, stages=3, pipeline=True, pingpong=False, persistent=True),
    # Per-warpgroup key ranges for causal (GluonConfig.wg_tiles; non-causal runs the code above):
    # each warpgroup runs only the key tiles its 64 rows see, at BLOCK_N 128 its last tile as 64
    # keys when that is all it sees (warpgroup 0 on the diagonal).
    "persistent_wg": dict(pipeline=True, pingpong=False, persistent=True, wg_tiles=True),
    "persistent_pingpong_wg": dict(pipeline=True, pingpong=True, persistent=True, wg_tiles=True),
    "pipeline_wg": dict(pipeline=True, pingpong=False, wg_tiles=True),
    # BLOCK_N 64 (d64/d128; d256 is BLOCK_N 64 already): per-warpgroup tile counts at 64 keys.
    "persistent_n64_wg": dict(block_n=64, stages=4, pipeline=True, pingpong=False, persistent=True, wg_tiles=True),
    "d64_3wg_persistent_wg": dict(pipeline=False, pingpong=False, persistent=True, wg_tiles=True),
    # d256 (no room for an O buffer per consumer): O staged in Q's buffers, i.e. without the
    # shared O buffer (GluonConfig.shared_o) that the persistent variants above use there.
    "persistent_q_as_o": dict(pipeline=True, pingpong=False, persistent=True, shared_o=False),
    "persistent_wg_q_as_o": dict(pipeline=True, pingpong=False, persistent=True, wg_tiles=True, shared_o=False),
    # Causal: the longest query tiles of all heads first, dealt out in a snake, instead of units
    # of two complementary query tiles of one head (GluonConfig.causal_pairs).
    "persistent_snake": dict(pipeline=True, pingpong=False, persistent=True, causal_pairs=False),
    "persistent_wg_snake": dict(pipeline=True, pingpong=False, persistent=True, wg_tiles=True, causal_pairs=False),
    "persistent_pingpong_snake": dict(pipeline=True, pingpong=True, persistent=True, causal_pairs=False),
    "d64_3wg_persistent_snake": dict(pipeline=False, pingpong=False, persistent=True, causal_pairs=False),
}
# Variants that exist only for some head dims (the others run at every head dim).
VARIANT_HEAD_DIMS = {v: (64,) for v in VARIANTS if v.startswith("d64_")}
VARIANT_HEAD_DIMS["persistent_n64_wg"] = (64, 128)
VARIANT_HEAD_DIMS.update({v: (256,) for v in VARIANTS if v.endswith("q_as_o")})
HEAD_DIMS = (64, 128, 256)
# (seqlen_q, seqlen_k) of the correctness cases, with B = 2, Hq = 4, Hkv = 2.
CORRECTNESS_LENGTHS = ((1, 1), (63, 63), (200, 200), (1000, 1000), (1, 1000), (200, 1000), (1000, 200), (63, 1),
                       (300, 364))  # 300/364: warpgroup 1 of tile 0 sees 192 keys (a halved tile with Sq != Sk)
PERSISTENT_TEST_GRID = 7  # programs of the capped persistent grid in the correctness stage
BENCH_SEQLENS = (16384, 4096, 1024)  # headline first
# What the GPU stages run, set from the command line (``--head-dims``, ``--causal-only``,
# ``--seqlens``, ``--no-flashkernel``) in the parent and forwarded to the children.
SELECT = dict(head_dims=HEAD_DIMS, causal=(False, True), seqlens=BENCH_SEQLENS, flashkernel=True)
TOKENS_PER_BATCH = 16384
MODEL_DIM = 2048


def log(msg: str) -> None:
    print(msg, flush=True)


def variant_runs(variant: str, head_dim: int) -> bool:
    return head_dim in VARIANT_HEAD_DIMS.get(variant, HEAD_DIMS)


def config_for(head_dim: int, variant: str):
    from flashkernel.kernels import prefill_gluon

    base = prefill_gluon.D64_3WG if variant.startswith("d64_3wg") else prefill_gluon.CONFIGS[head_dim]
    return dataclasses.replace(base, **VARIANTS[variant])


# ---- compile only (no GPU) ---------------------------------------------------------------------


def compile_for_sm90a(fn, args, kwargs, options):
    """Compile Gluon kernel ``fn`` for sm_90a as a launch with ``args`` (positional, CPU tensors
    standing in for GPU ones: only dtypes, shapes, strides and alignment matter) and ``kwargs``
    (constexprs) would, without a GPU."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(fn.arg_names, args)):
        signature[name] = mangle_type(value)
        if isinstance(value, torch.Tensor):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what a launch with an aligned tensor gets
    for name, value in kwargs.items():
        signature[name] = "constexpr"
        constexprs[(fn.arg_names.index(name),)] = value
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def compile_specialization(head_dim: int, causal: bool, dtype_name: str, variant: str) -> dict:
    """Compile one specialization for sm_90a the way a launch would, and inspect PTX and ptxas."""
    import torch

    from flashkernel.kernels import prefill_gluon as pg

    dtype = getattr(torch, dtype_name)
    # CPU tensors stand in for the GPU ones: only dtypes, shapes, strides and alignment matter.
    q = torch.empty(2, 200, 4, head_dim, dtype=dtype)
    k = torch.empty(2, 300, 2, head_dim, dtype=dtype)
    v = torch.empty_like(k)
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 200, dtype=torch.float32)
    # Persistent causal kernels compile as they run on the shapes, in pairs of query
    # tiles (GluonConfig.causal_pairs), unless the variant asks for the other order.
    config = config_for(head_dim, variant)
    config = dataclasses.replace(config, causal_pairs=config.causal_pairs is not False)
    grid, args, kwargs = pg.launch_args(q, k, v, out, lse, causal, 0.125, config)
    t0 = time.time()
    compiled = compile_for_sm90a(pg._gluon_attention_kernel, args, kwargs,
                                 {"num_warps": 4, "maxnreg": pg.maxnreg_for(config)})
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    return dict(
        head_dim=head_dim, causal=causal, dtype=dtype_name, variant=variant,
        compile_s=round(time.time() - t0, 2), **report,
        wgmma=ptx.count("wgmma.mma_async"),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
        tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
        setmaxnreg=sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
        shared_bytes=compiled.metadata.shared,
    )


def ptxas_report(ptx: str) -> dict:
    """Registers, spills and warnings from the bundled ptxas (-v), plus a look at the SASS."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(path, "w") as f:
            f.write(ptx)
        result = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", path, "-o", cubin],
                                capture_output=True, text=True)
        sass = ""
        if result.returncode == 0:
            sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                                  capture_output=True, text=True).stdout
    text = result.stdout + result.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill_st = re.search(r"(\d+) bytes spill stores", text)
    spill_ld = re.search(r"(\d+) bytes spill loads", text)
    # ptxas reports wgmma serialization (every wgmma waited for at once: no overlap at all) as
    # "info" lines (C7510-C7520), not warnings; they count as warnings here.
    warnings = [line.strip() for line in text.splitlines()
                if "warning" in line.lower() or "Performance Loss" in line or "is injected" in line]
    return dict(ptxas_ok=result.returncode == 0, registers=int(regs.group(1)) if regs else None,
                spill_stores=int(spill_st.group(1)) if spill_st else None,
                spill_loads=int(spill_ld.group(1)) if spill_ld else None, ptxas_warnings=warnings,
                **sass_report(sass))


def sass_report(sass: str) -> dict:
    """``max_register``: highest register index in the SASS (``registers`` above is the launch
    limit, 168; the consumer partitions raise theirs to 240 with setmaxnreg). ``mufu_overlap``:
    per pipelined loop body, how many MUFU (exp2) run between the wait that leaves one wgmma
    group in flight (``DEPBAR.LE gsb0, 0x1``) and the wait for it (``0x0``): the softmax work that
    can overlap ``P V`` (0 for the simple loop)."""
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
    return dict(max_register=max(regs) if regs else None, mufu_overlap=overlap)


def run_compile_only(args) -> int:
    results, ok = [], True
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for causal in SELECT["causal"]:
                for variant in args.variants:
                    if not variant_runs(variant, head_dim):
                        continue
                    label = f"{dtype_name} d{head_dim} {'causal' if causal else 'full  '} {variant:8s}"
                    try:
                        r = compile_specialization(head_dim, causal, dtype_name, variant)
                    except Exception as exc:  # keep going: report every specialization
                        ok = False
                        results.append(dict(head_dim=head_dim, causal=causal, dtype=dtype_name, variant=variant,
                                            error=f"{type(exc).__name__}: {exc}"[:2000]))
                        log(f"{label} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                        continue
                    results.append(r)
                    good = (r["ptxas_ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0
                            and r["wgmma"] > 0 and r["tma_loads"] > 0 and r["tma_stores"] > 0
                            and not any("Performance Loss" in w for w in r["ptxas_warnings"]))
                    ok &= good
                    log(f"{label} {r['registers']} regs (max R{r['max_register']}), "
                        f"spills {r['spill_stores']}/{r['spill_loads']} B, exp2 overlapping PV {r['mufu_overlap']}, "
                        f"wgmma {r['wgmma']}, TMA {r['tma_loads']} loads/{r['tma_stores']} stores, "
                        f"setmaxnreg {r['setmaxnreg']}, smem {r['shared_bytes'] // 1024} KB, "
                        f"{r['compile_s']} s{'' if good else '  <-- CHECK'}"
                        + (f"\n    ptxas: {r['ptxas_warnings']}" if r["ptxas_warnings"] else ""))
    if args.out:
        write_json(args.out, dict(mode="compile-only", ok=ok, results=results))
    log("all specializations compile for sm_90a without spills, with wgmma and TMA" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


# ---- GPU helpers ----------------------------------------------------------------------------------


def guarded(shape, dtype, device, fill=None):
    """A view of ``shape`` ``[B, S, H, ...]`` into a NaN-filled buffer with 37 extra rows and one
    extra head, filled with ``fill`` (randn when None). Returns ``(view, buffer)``."""
    import torch

    big_shape = (shape[0], shape[1] + 37, shape[2] + 1, *shape[3:])
    big = torch.full(big_shape, float("nan"), dtype=dtype, device=device)
    view = big[:, :shape[1], :shape[2]]
    view.copy_(torch.randn(shape, dtype=dtype, device=device) if fill is None else fill)
    return view, big


def guard_intact(view, big) -> bool:
    """Everything in ``big`` outside ``view`` is still NaN."""
    import torch

    outside = torch.ones(big.shape, dtype=torch.bool, device=big.device)
    outside[:, :view.shape[1], :view.shape[2]] = False
    return bool(torch.isnan(big[outside]).all())


class Progress:
    """JSON lines: a ``start`` record before each launch, a ``result`` record after it."""

    def __init__(self, path: str):
        self.f = open(path, "a")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def check_case(variant, dtype, head_dim, seqlen_q, seqlen_k, causal, device="cuda", max_programs=None) -> dict:
    """One correctness case (see the module docstring); ``max_programs`` caps a persistent grid."""
    import torch

    from flashkernel import reference
    from flashkernel.bench.accuracy import error_bound
    from flashkernel.kernels.prefill_gluon import gluon_attention_forward

    batch, heads, kv_heads = 2, 4, 2
    scale = 1.0 / math.sqrt(head_dim)
    q, q_big = guarded((batch, seqlen_q, heads, head_dim), dtype, device)
    k, k_big = guarded((batch, seqlen_k, kv_heads, head_dim), dtype, device)
    v, v_big = guarded((batch, seqlen_k, kv_heads, head_dim), dtype, device)
    out, out_big = guarded((batch, seqlen_q, heads, head_dim), dtype, device,
                           fill=torch.full((batch, seqlen_q, heads, head_dim), float("nan")))
    lse_big = torch.full((batch, heads + 1, seqlen_q + 5), float("nan"), dtype=torch.float32, device=device)
    lse = lse_big[:, :heads, :seqlen_q]

    config = config_for(head_dim, variant)
    if max_programs:
        config = dataclasses.replace(config, max_programs=max_programs)
    gluon_attention_forward(q, k, v, out, lse, causal=causal, softmax_scale=scale, config=config)
    if device == "cuda":
        torch.cuda.synchronize()

    truth, truth_lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    torch_out, _ = reference.attention(q, k, v, causal=causal, softmax_scale=scale, upcast=False)
    nan_out = int(torch.isnan(out).sum())
    err = (out.double() - truth).abs()
    torch_err = (torch_out.double() - truth).abs()
    max_err = float(err.nan_to_num(float("inf")).max())
    bound = error_bound(float(torch_err.max()), float(truth.abs().max()), dtype)
    mean_ok = float(err.mean()) <= 2 * float(torch_err.mean()) + bound / 8 if not nan_out else False
    lse_inf_match = bool(torch.equal(torch.isneginf(lse), torch.isneginf(truth_lse)))
    finite = torch.isfinite(truth_lse)
    lse_err = float((lse.double() - truth_lse)[finite].abs().nan_to_num(float("inf")).max()) if finite.any() else 0.0
    lse_bound = 5e-5 * max(1.0, float(truth_lse[finite].abs().max())) if finite.any() else 0.0
    guards = dict(q=guard_intact(q, q_big), k=guard_intact(k, k_big), v=guard_intact(v, v_big),
                  out=guard_intact(out, out_big),
                  lse=bool(torch.isnan(lse_big[:, heads:]).all() and torch.isnan(lse_big[:, :, seqlen_q:]).all()))
    ok = (nan_out == 0 and max_err <= bound and mean_ok and lse_inf_match and lse_err <= lse_bound
          and not bool(torch.isnan(lse).any()) and all(guards.values()))
    return dict(ok=ok, max_err=max_err, torch_max_err=float(torch_err.max()), bound=bound, mean_ok=mean_ok,
                nan_in_out=nan_out, lse_err=lse_err, lse_bound=lse_bound, lse_inf_rows_match=lse_inf_match,
                guards_intact=guards)


def correctness_cases(variant: str, dtypes) -> list:
    """``(dtype, head_dim, causal, seqlen_q, seqlen_k, max_programs)`` of one variant. Persistent
    variants run every case twice: with their natural grid (one program per SM: at these sizes
    every program gets at most one work item) and with the grid capped at ``PERSISTENT_TEST_GRID``
    programs, so that each program runs many items (the K/V ring and the Q/turn barriers cycle
    across items, odd and even item counts, the snake order of causal)."""
    cases = []
    for dtype_name in dtypes:
        for head_dim in SELECT["head_dims"]:
            if not variant_runs(variant, head_dim):
                continue
            for causal in SELECT["causal"]:
                for seqlen_q, seqlen_k in CORRECTNESS_LENGTHS:
                    grids = (None, PERSISTENT_TEST_GRID) if VARIANTS[variant].get("persistent") else (None,)
                    cases += [(dtype_name, head_dim, causal, seqlen_q, seqlen_k, g) for g in grids]
    return cases


def stage_correctness(variants, progress_path: str, deadline: float, dtypes, all_dtypes: bool) -> None:
    """Every case of every variant, in order (the first variant, or all with ``all_dtypes``, in
    every dtype of ``dtypes``; the others in the first)."""
    import torch

    progress = Progress(progress_path)
    for i, variant in enumerate(variants):
        for dtype_name, head_dim, causal, seqlen_q, seqlen_k, max_programs in correctness_cases(
                variant, dtypes if i == 0 or all_dtypes else dtypes[:1]):
            case = dict(stage="correctness", variant=variant, dtype=dtype_name, head_dim=head_dim,
                        causal=causal, seqlen_q=seqlen_q, seqlen_k=seqlen_k, max_programs=max_programs)
            if time.time() > deadline:
                progress.write(dict(kind="result", **case, skipped="time budget"))
                continue
            progress.write(dict(kind="start", **case))
            try:
                result = check_case(variant, getattr(torch, dtype_name), head_dim, seqlen_q, seqlen_k, causal,
                                    max_programs=max_programs)
            except Exception as exc:
                result = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:1500],
                              traceback=traceback.format_exc()[-1500:])
                if "CUDA" in str(exc) or "cuda" in type(exc).__name__.lower():
                    # The context is likely gone (e.g. an illegal address): stop here, so that the
                    # parent blames this variant and goes on with the next ones in a fresh process.
                    progress.write(dict(kind="result", **case, **result))
                    os._exit(3)
            progress.write(dict(kind="result", **case, **result))


def attention_flops(batch, heads, seqlen, head_dim, causal) -> int:
    pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    return 4 * batch * heads * head_dim * pairs


def gluon_runner(q, k, v, causal: bool, scale: float, config):
    """A no-argument call of the Gluon kernel into preallocated ``out`` and ``lse`` (the LSE is
    written, as in the correctness stage, so the compiled kernels are shared)."""
    import torch

    from flashkernel.kernels.prefill_gluon import gluon_attention_forward

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)

    def run():
        gluon_attention_forward(q, k, v, out, lse, causal=causal, softmax_scale=scale, config=config)
        return out

    return run


def bench_case(variants, head_dim, seqlen, causal, batch, heads, case, progress, deadline) -> dict:
    """Time every provider on one bench shape; returns ``{provider: timing or error}``."""
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashkernel

    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    scale = 1.0 / math.sqrt(head_dim)
    flops = attention_flops(batch, heads, seqlen, head_dim, causal)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    providers = {"sdpa-cudnn": cudnn}  # first: its output is the one the others are compared with
    for variant in variants:
        if variant_runs(variant, head_dim):
            providers[f"gluon-{variant}"] = gluon_runner(q, k, v, causal, scale, config_for(head_dim, variant))
    if SELECT["flashkernel"]:
        providers["flashkernel"] = lambda: flashkernel.flash_attn_func(q, k, v, causal=causal)

    reference_out = None
    timings = {}
    for name, fn in providers.items():
        if time.time() > deadline:
            timings[name] = dict(skipped="time budget")
            continue
        progress.write(dict(kind="start", **case, provider=name))
        try:
            result = fn()
            torch.cuda.synchronize()
            entry = dict(nan=bool(torch.isnan(result).any()))
            if reference_out is None:
                reference_out = result.clone()
            else:
                entry["max_abs_diff_vs_cudnn"] = float((result.float() - reference_out.float()).abs().max())
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            entry.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as exc:
            entry = dict(error=f"{type(exc).__name__}: {exc}"[:1500])
        timings[name] = entry
    return timings


def stage_bench(variants, progress_path: str, deadline: float, done: set) -> None:
    import torch

    progress = Progress(progress_path)
    seqlens, head_dims, causals = SELECT["seqlens"], SELECT["head_dims"], SELECT["causal"]
    cases = [(128, s, c) for s in seqlens[:1] for c in causals] if 128 in head_dims else []
    cases += [(d, s, c) for s in seqlens for d in head_dims for c in causals if (d, s, c) not in cases]
    for head_dim, seqlen, causal in cases:
        if f"{head_dim}/{seqlen}/{int(causal)}" in done:
            continue
        batch, heads = TOKENS_PER_BATCH // seqlen, MODEL_DIM // head_dim
        case = dict(stage="bench", head_dim=head_dim, seqlen=seqlen, causal=causal, batch=batch, heads=heads)
        if time.time() > deadline:
            progress.write(dict(kind="result", **case, skipped="time budget"))
            continue
        try:
            timings = bench_case(variants, head_dim, seqlen, causal, batch, heads, case, progress, deadline)
        except Exception as exc:  # e.g. out of memory: record it and go on
            progress.write(dict(kind="result", **case, error=f"{type(exc).__name__}: {exc}"[:1500]))
            torch.cuda.empty_cache()
            continue
        cudnn_t = timings.get("sdpa-cudnn", {}).get("tflops")
        fk_t = timings.get("flashkernel", {}).get("tflops")
        for entry in timings.values():
            if "tflops" in entry:
                entry["vs_cudnn"] = entry["tflops"] / cudnn_t if cudnn_t else None
                entry["vs_flashkernel"] = entry["tflops"] / fk_t if fk_t else None
        progress.write(dict(kind="result", **case, providers=timings))
        torch.cuda.empty_cache()


# ---- parent: stages under timeouts --------------------------------------------------------------


def run_child(stage_args: list, timeout: float, progress_path: str, stall_s: float) -> dict:
    """Run this script as a child for one stage. It is killed at ``timeout`` or when its progress
    file has not grown for ``stall_s`` seconds (a hung kernel never returns; killing the process
    releases the GPU). Returns rc, wall time, why it was killed and the tail of its output."""
    t0 = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), *stage_args, "--progress", progress_path]
    with tempfile.TemporaryFile("w+") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True)
        killed, last_size, last_change = None, -1, time.time()
        while proc.poll() is None:
            time.sleep(0.5)
            size = os.path.getsize(progress_path) if os.path.exists(progress_path) else 0
            if size != last_size:
                last_size, last_change = size, time.time()
            if time.time() - t0 > timeout:
                killed = "stage timeout"
            elif time.time() - last_change > stall_s:
                killed = f"no progress for {stall_s:.0f} s"
            if killed:
                proc.kill()
                proc.wait()
        log_file.seek(0)
        output = log_file.read()
    return dict(rc=proc.returncode, wall_s=round(time.time() - t0, 1), killed=killed, output_tail=output[-3000:])


def hung_provider(records: list) -> str | None:
    """The provider of a bench case that started and never finished (see :func:`read_progress`)."""
    for r in records:
        if "providers" not in r and "provider" in r and "skipped" not in r:
            return r["provider"]
    return None


def read_progress(path: str) -> list:
    """Records of a stage; a ``start`` without its ``result`` becomes a 'hung or crashed' result."""
    if not os.path.exists(path):
        return []
    records, pending = [], None
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.pop("kind") == "start":
                pending = record
            else:
                records.append(record)
                pending = None
    if pending is not None:
        records.append(dict(pending, ok=False, error="no result: the launch hung (killed at the stage timeout) "
                                                     "or the process crashed"))
    return records


def summarize_correctness(records: list) -> dict:
    done = [r for r in records if "skipped" not in r]
    return dict(cases=len(records), run=len(done), passed=sum(1 for r in done if r.get("ok")),
                failed=[r for r in done if not r.get("ok")][:20])


def print_bench(records: list) -> None:
    log("\nTFLOP/s (bf16, 16k tokens per batch, Hq = 2048/d); ratio to cuDNN in brackets")
    for r in records:
        label = f"d{r['head_dim']:3d} s={r['seqlen']:5d} {'causal' if r['causal'] else 'full  '}"
        if "skipped" in r:
            log(f"{label}: skipped ({r['skipped']})")
            continue
        if "providers" not in r:
            where = f" (provider {r['provider']})" if r.get("provider") else ""
            log(f"{label}: {r.get('error')}{where}")
            continue
        cells = []
        for name, e in r["providers"].items():
            if "tflops" in e:
                ratio = f" [{e['vs_cudnn']:.2f}x]" if e.get("vs_cudnn") else ""
                diff = f" diff {e['max_abs_diff_vs_cudnn']:.1e}" if "max_abs_diff_vs_cudnn" in e else ""
                nan = " NaN!" if e.get("nan") else ""
                cells.append(f"{name} {e['tflops']:.0f}{ratio}{diff}{nan}")
            else:
                cells.append(f"{name} {e.get('error') or e.get('skipped')}")
        log(f"{label}: " + " | ".join(cells))
    log("\nbest Gluon variant per shape (ratio to cuDNN; ok = at least 1.00x)")
    for r in records:
        if "providers" not in r:
            continue
        label = f"d{r['head_dim']:3d} s={r['seqlen']:5d} {'causal' if r['causal'] else 'full  '}"
        gluon = [(e["tflops"], name[len("gluon-"):], e.get("vs_cudnn")) for name, e in r["providers"].items()
                 if name.startswith("gluon-") and "tflops" in e and not e.get("nan")]
        if not gluon:
            log(f"{label}: no Gluon result")
            continue
        tflops, name, ratio = max(gluon)
        verdict = "" if ratio is None else ("  ok" if ratio >= 1.0 else "  below cuDNN")
        log(f"{label}: {name:24s} {tflops:5.0f} TFLOP/s" + (f" [{ratio:.2f}x]{verdict}" if ratio else ""))


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def environment() -> dict:
    import torch
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0])
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
                    cudnn=torch.backends.cudnn.version())
    return info


def run_correctness(args, budget_end: float, tmp: str) -> tuple[dict, list]:
    """Correctness of every variant in one child (one Python start, one import), in order; when
    a launch hangs or crashes the child, its variant fails and a new child goes on with the
    variants after it. Returns ``{variant: record}`` for the JSON and the variants that passed
    every case."""
    records, remaining, attempt, children = [], list(args.variants), 0, []
    hung_variants = {}
    while remaining:
        timeout = max(20.0, budget_end - time.time() - args.bench_reserve)
        path = os.path.join(tmp, f"correctness-{attempt}.jsonl")
        log(f"== correctness {' '.join(remaining)} (at most {timeout:.0f} s)")
        # Only the first variant runs in every dtype (unless --all-dtypes), also after a restart.
        dtypes = args.dtypes if attempt == 0 or args.all_dtypes else args.dtypes[:1]
        child = run_child(["--stage", "correctness", "--variants", *remaining, "--deadline",
                           str(time.time() + timeout - 8), "--dtypes", *dtypes]
                          + (["--all-dtypes"] if args.all_dtypes else []) + selection_args(args),
                          timeout, path, args.stall)
        children.append(child)
        new = read_progress(path)
        records += new
        if child["rc"] == 0 or child["killed"] == "stage timeout" or not new:
            if child["rc"] and not new:
                log(child["output_tail"][-1500:])
            break
        # Stalled (a hung launch) or crashed: the variant of the last case is to blame.
        variant = new[-1]["variant"]
        hung_variants[variant] = child["killed"] or f"rc {child['rc']}"
        log(f"   {variant} hung or crashed ({hung_variants[variant]}); going on with the variants after it")
        remaining = remaining[remaining.index(variant) + 1:]
        attempt += 1
    result, passing = {}, []
    for variant in args.variants:
        mine = [r for r in records if r.get("variant") == variant]
        summary = summarize_correctness(mine)
        passed = bool(summary["run"]) and summary["passed"] == summary["run"] and variant not in hung_variants
        if passed:
            passing.append(variant)
        log(f"   {variant}: {summary['passed']}/{summary['run']} passed of {summary['cases']}"
            + (f" (HUNG: {hung_variants[variant]})" if variant in hung_variants else ""))
        for r in summary["failed"][:6]:
            log(f"   FAIL {variant} {r.get('dtype')} d{r.get('head_dim')} causal={r.get('causal')} "
                f"Sq={r.get('seqlen_q')} Sk={r.get('seqlen_k')} grid cap {r.get('max_programs')}: "
                + (r.get("error") or f"max_err {r.get('max_err'):.2e} (bound {r.get('bound'):.2e}), "
                   f"NaN {r.get('nan_in_out')}, lse_err {r.get('lse_err'):.2e}, guards {r.get('guards_intact')}"))
        result[variant] = dict(summary=summary, records=mine, hung=hung_variants.get(variant))
    result["_children"] = [dict(c, output_tail=c["output_tail"][-1500:]) for c in children]
    return result, passing


def run_bench(args, variants: list, budget_end: float, tmp: str) -> list:
    """Bench children until the cases are done or time is out; a Gluon variant that hangs is
    dropped and the remaining cases rerun without it."""
    records, attempt = [], 0
    while budget_end - time.time() > 15:
        timeout = budget_end - time.time()
        path = os.path.join(tmp, f"bench-{attempt}.jsonl")
        done = [f"{r['head_dim']}/{r['seqlen']}/{int(r['causal'])}" for r in records if "providers" in r]
        log(f"== bench: gluon variants {variants or 'none'} vs flashkernel vs cuDNN (at most {timeout:.0f} s)")
        child = run_child(["--stage", "bench", "--deadline", str(time.time() + timeout - 10),
                           "--variants", *variants, "--done", *done] + selection_args(args),
                          timeout, path, args.stall)
        new = read_progress(path)
        records += new
        hung = hung_provider(new)
        if child["rc"] == 0 or not hung:
            if child["rc"]:
                log(f"   bench child rc {child['rc']}: {child['output_tail'][-1500:]}")
            break
        log(f"   {hung} hung or crashed ({child['killed'] or 'rc ' + str(child['rc'])}); rerunning without it")
        if not hung.startswith("gluon-") or hung[len("gluon-"):] not in variants:
            break
        variants = [v for v in variants if v != hung[len("gluon-"):]]
        attempt += 1
    return records


def selection_args(args) -> list:
    """The shape selection of the command line, for a child stage."""
    return (["--head-dims", *map(str, args.head_dims), "--seqlens", *map(str, args.seqlens)]
            + (["--causal-only"] if args.causal_only else []) + (["--no-flashkernel"] if args.no_flashkernel else []))


def run_gpu(args) -> int:
    start = time.time()
    budget_end = start + args.budget
    tmp = tempfile.mkdtemp(prefix="gluon_check_")
    payload = dict(mode="gpu", environment=environment(), budget_s=args.budget, correctness={}, bench=[])
    payload["correctness"], passing = run_correctness(args, budget_end, tmp)
    write_json(args.out, payload)
    payload["bench_variants"] = passing if not args.bench_all else list(args.variants)
    if args.skip_bench:
        log("== bench skipped")
    else:
        payload["bench"] = run_bench(args, payload["bench_variants"], budget_end, tmp)
        print_bench(payload["bench"])
    payload["wall_s"] = round(time.time() - start, 1)
    write_json(args.out, payload)
    log(f"\nwrote {args.out} ({payload['wall_s']} s)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON results (GPU mode default: gluon.json; optional with --compile-only)")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a without a GPU")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                        help="Gluon variants to check and time (default: all; d64_* only run at d64)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS), choices=list(HEAD_DIMS))
    parser.add_argument("--seqlens", nargs="+", type=int, default=list(BENCH_SEQLENS),
                        help="bench sequence lengths (16k tokens per batch; the first one's d128 cases run first)")
    parser.add_argument("--causal-only", action="store_true",
                        help="causal cases only (correctness and bench; with --compile-only, causal specializations)")
    parser.add_argument("--no-flashkernel", action="store_true", help="bench without flash_attn_func (saves time)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    parser.add_argument("--all-dtypes", action="store_true",
                        help="correctness of every variant in every dtype (default: the first variant only)")
    parser.add_argument("--budget", type=float, default=235.0, help="seconds for the whole GPU run")
    parser.add_argument("--bench-reserve", type=float, default=100.0, help="seconds kept for the bench stage")
    parser.add_argument("--bench-all", action="store_true", help="time variants that failed correctness too")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--stall", type=float, default=45.0,
                        help="kill a child whose progress has not moved for this long (s): a hung kernel")
    # internal: one stage in a child process
    parser.add_argument("--stage", choices=["correctness", "bench"], help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--done", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    SELECT.update(head_dims=tuple(args.head_dims), causal=(True,) if args.causal_only else (False, True),
                  seqlens=tuple(args.seqlens), flashkernel=not args.no_flashkernel)

    if args.compile_only:
        return run_compile_only(args)
    if args.stage == "correctness":
        stage_correctness(args.variants, args.progress, args.deadline, args.dtypes, args.all_dtypes)
        return 0
    if args.stage == "bench":
        stage_bench(args.variants, args.progress, args.deadline, set(args.done))
        return 0
    import torch

    if not torch.cuda.is_available():
        log("no CUDA GPU: use --compile-only")
        return 2
    args.out = args.out or "gluon.json"
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
