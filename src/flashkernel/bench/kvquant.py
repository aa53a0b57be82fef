"""Quantized KV caches: decode steps over bf16, float8_e4m3fn and int8 caches, and what each format costs in accuracy.

    flashkernel bench kvquant --out benchmarks/results/h200            # GPU: kvquant.{json,csv,png}
    python -m flashkernel.bench.kvquant --sections perf --shapes 1:4096 64:4096  # GPU: chosen shapes only
    python -m flashkernel.bench.kvquant --sections accuracy --markdown # CPU is enough: the README's table
    python -m flashkernel.bench.kvquant --sections sweep --out DIR [--sweep-layouts paged16]  # tile configs
        [--sweep-shapes 64:4096 128:4096] [--sweep-configs 32x4w4s 128x4w3s]

Sections:

* ``perf`` (GPU): one decode step (no append) of a 7B-class layer (32 query heads, 8 KV heads,
  head dim 128, bf16 queries, one new token) over bf16 / fp8 / int8 caches, scales per tensor,
  per KV head and per token, contiguous and in pages of 16, batch x context from 1 x 1k to 1 x
  128k, 8 x 4k/32k/128k and 64 x 1k/4k; timed as CUDA-graph replays and as eager calls (inputs
  rotated so that none sits in L2). Per row: the bytes the step reads (K and V at 1 or 2 bytes,
  per-token scales at 4 bytes per token and head, q and the output), the effective bandwidth on
  those bytes and its fraction of the read bandwidth measured in the same run (the faster of
  ``torch.sum`` and a streaming Triton kernel over a 4 GiB buffer), the step's time over the same
  step on a bf16 cache, per-token over
  per-tensor scales, and a 32-layer model's attention steps/s against the bound that read
  bandwidth sets. The Gluon kernel (``backend="gluon"``) is timed too over pages of 16 (graph
  replays, scales per tensor), where the policy would consider it. Outputs at contexts up to
  32k tokens (the first and last sequence) are checked against float64 attention over the
  dequantized cache before timing.
* ``sweep`` (GPU): graph-replayed step times of the Triton kernel's tile configs over 1-byte
  caches (what ``tuned/decode.json``'s ``quantized`` tables choose from) and over the bf16 cache
  (its ``contiguous`` and ``small_pages`` tables), each config given explicitly: the split count
  is the automatic one, but the dispatcher's short-split rule (``fit_config``) does not apply.
  ``--sweep-shapes`` / ``--sweep-configs`` replace the shapes and the configs swept (the bf16
  cache then takes the same configs).
* ``accuracy`` (CPU or GPU, float64 reference, no kernel): the error of attention over each
  format and granularity against the same attention over the bf16 cache it was quantized from,
  on random data and on K with a few channels 100x larger (as real K caches have).

Writes ``kvquant.json`` (every row, the environment and the command), ``kvquant.csv``, and with
matplotlib ``kvquant_steps.png`` (steps/s against context per format) and ``kvquant_model.png``
(the model's steps/s against the bandwidth bound per format).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from .. import reference

LAYERS = 32
SHAPES = ((1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 65536), (1, 131072), (8, 4096), (8, 32768),
          (8, 131072), (64, 1024), (64, 4096))
QUICK_SHAPES = ((1, 4096), (1, 32768), (8, 32768))
FORMATS = {"bf16": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
GRANULARITIES = ("tensor", "head", "token")
LAYOUTS = {"contiguous": 0, "paged16": 16}
CHECK_MAX_TOKENS = 32768  # outputs of contexts up to this many tokens are checked before timing (2 sequences)
READ_BYTES = 4 * 2**30
SWEEP_CONFIGS = ((64, 4, 3), (64, 4, 5), (64, 8, 3), (64, 8, 4), (128, 4, 3), (128, 4, 5), (128, 8, 3),
                 (128, 8, 4), (128, 8, 5))
SWEEP_CONFIGS_BF16 = ((64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3))
SWEEP_SHAPES = ((1, 4096), (1, 32768), (8, 32768), (64, 4096), (8, 131072))
COLUMNS = ("section", "provider", "layout", "format", "granularity", "batch", "context", "graph_us", "eager_us",
           "bytes_read", "graph_gbps", "fraction_of_read", "graph_ratio_vs_bf16", "eager_ratio_vs_bf16",
           "token_over_tensor", "model_steps_per_s", "model_steps_bound", "config", "max_err", "err_bound",
           "data", "out_rms_rel", "out_max_rel", "k_rms_rel", "v_rms_rel")


@dataclasses.dataclass(frozen=True)
class Setup:
    """The layer measured (a 7B-class model's by default) and where: ``device`` "cuda", or "cpu"
    under Triton's interpreter (the tests' small run: times there mean nothing)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    device: str = "cuda"


# ---- bytes ------------------------------------------------------------------------------------------


def bytes_read(setup: Setup, batch: int, context: int, fmt: str, granularity: str | None) -> int:
    """Bytes one step reads: K and V (1 byte per entry quantized, 2 bf16), per-token scales (4
    bytes per token, head and tensor), q and the output (bf16)."""
    entry = 2 if FORMATS[fmt] is None else 1
    kv = 2 * batch * context * setup.kv_heads * setup.head_dim * entry
    scales = 2 * batch * context * setup.kv_heads * 4 if granularity == "token" else 0
    return kv + scales + 2 * batch * setup.heads * setup.head_dim * 2


# ---- inputs -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cache:
    """One copy of a step's inputs in one layout and format (scales None for bf16)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    seqlens: torch.Tensor
    block_table: torch.Tensor | None


def paged(cache: torch.Tensor, table: torch.Tensor, page: int) -> torch.Tensor:
    """``[B, L, H, D]`` scattered into pages ``[B * L / page, page, H, D]`` in ``table``'s order."""
    batch, length, heads, dim = cache.shape
    pages = cache.new_empty(batch * length // page, page, heads, dim)
    pages[table.reshape(-1).long()] = cache.reshape(-1, page, heads, dim)
    return pages


def make_caches(setup: Setup, batch: int, context: int, layout: str) -> dict:
    """``{(format, granularity): Cache}`` over one random bf16 cache (quantized with
    ``flashkernel.quantize_kv``), in ``layout``."""
    import flashkernel

    device = setup.device
    q = torch.randn(batch, 1, setup.heads, setup.head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, context, setup.kv_heads, setup.head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    table = None
    page = LAYOUTS[layout]
    if page:
        table = torch.randperm(batch * context // page, device=device).to(torch.int32).view(batch, -1)
        k, v = paged(k, table, page), paged(v, table, page)
    caches = {("bf16", None): Cache(q, k, v, None, None, seqlens, table)}
    for name, fmt in FORMATS.items():
        if fmt is None:
            continue
        for granularity in GRANULARITIES:
            kq, vq, ks, vs = flashkernel.quantize_kv(k, v, dtype=fmt, granularity=granularity)
            caches[(name, granularity)] = Cache(q, kq, vq, ks, vs, seqlens, table)
    return caches


def step(cache: Cache, backend: str):
    import flashkernel

    return lambda: flashkernel.flash_attn_with_kvcache(
        cache.q, cache.k, cache.v, cache_seqlens=cache.seqlens, block_table=cache.block_table,
        k_scale=cache.k_scale, v_scale=cache.v_scale, backend=backend)


def contiguous_values(cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a cache stands for, ``[B, L, Hkv, D]`` float64 (first and last sequence)."""
    rows = sorted({0, cache.q.shape[0] - 1})
    length = int(cache.seqlens[0])
    out = []
    for x, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        dense = []
        for b in rows:
            values = reference.cache_prefix(x, b, length, cache.block_table)
            if scale is not None:
                per_token = scale.dim() == 3
                values = reference.dequantize(values, reference.cache_prefix(scale, b, length, cache.block_table)
                                              if per_token else scale)
            dense.append(values.double())
        out.append(torch.stack(dense))
    return out[0], out[1]


def check(call, cache: Cache) -> dict:
    """Error of one call's output against float64 attention over the values the cache stands
    for (first and last sequence), with the test suite's bound."""
    from . import accuracy

    rows = sorted({0, cache.q.shape[0] - 1})
    keys, values = contiguous_values(cache)
    truth = accuracy.dense_truth(cache.q[rows], keys, values, causal=True, window=None)
    result = accuracy.compare(call()[rows], truth)
    return {"max_err": result.max_err, "err_bound": result.bound, "check_ok": result.ok}


# ---- timing -----------------------------------------------------------------------------------------


@triton.jit
def _read_kernel(X, Out, per_program, BLOCK: tl.constexpr):
    """Sum ``per_program`` float32s from ``X + program * per_program``: a stream of reads."""
    base = X + tl.multiple_of(tl.program_id(0).to(tl.int64) * per_program, 16)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, per_program, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK))
    tl.store(Out + tl.program_id(0), tl.sum(acc, axis=0))


READ_PROGRAMS, READ_BLOCK = 132 * 8, 2048


def measure_read_gbps(settings) -> dict:
    """Read bandwidth of a float32 buffer of ``READ_BYTES``, graph replays: ``torch.sum`` and a
    streaming Triton kernel; ``read_gbps`` is the faster (the ceiling the steps are held to)."""
    from . import measure

    x = torch.ones(READ_BYTES // 4, device="cuda")
    out = torch.empty(READ_PROGRAMS, device="cuda")
    per_program = x.numel() // READ_PROGRAMS // READ_BLOCK * READ_BLOCK
    calls = {
        "torch_sum": lambda: torch.sum(x, dim=0, out=out[0]),
        "triton_stream": lambda: _read_kernel[(READ_PROGRAMS,)](x, out, per_program, BLOCK=READ_BLOCK, num_warps=8,
                                                                num_stages=4),
    }
    nbytes = {"torch_sum": READ_BYTES, "triton_stream": READ_PROGRAMS * per_program * 4}
    rates = {}
    for name, call in calls.items():
        timing = measure.time_cuda_graph([call], settings, min_calls_per_graph=4)
        rates[f"{name}_gbps"] = nbytes[name] / (timing.median_ms * 1e-3) / 1e9
    del x
    return {**rates, "read_gbps": max(rates.values())}


def timed(setup: Setup, calls, settings, eager: bool = True) -> dict:
    """Median microseconds per call: CUDA-graph replays (``graph_us``) and eager calls
    (``eager_us``); on the CPU, interpreter wall time for both."""
    from . import measure

    if setup.device != "cuda":
        us = measure.time_cpu(calls, settings).median_ms * 1e3
        return {"graph_us": us, "eager_us": us} if eager else {"graph_us": us}
    row = {"graph_us": measure.time_cuda_graph(calls, settings).median_ms * 1e3}
    if eager:
        row["eager_us"] = measure.time_cuda(calls, settings).median_ms * 1e3
    return row


def copies_for(setup: Setup, batch: int, context: int, layout: str) -> list[dict]:
    """Enough copies of the inputs that consecutive calls do not hit in L2 (by the smallest
    format's bytes)."""
    from . import measure
    from .runner import l2_bytes

    count = measure.rotation_copies(bytes_read(setup, batch, context, "fp8", "tensor"), l2_bytes(setup.device),
                                    cap=64)
    return [make_caches(setup, batch, context, layout) for _ in range(count)]


def perf_rows(setup: Setup, shapes, settings, read_gbps: float | None, log) -> list[dict]:
    """Every format, granularity and layout at each shape: the Triton kernel, and the Gluon
    kernel where it can run (pages of 16, scales per tensor)."""
    rows = []
    for batch, context in shapes:
        for layout in LAYOUTS:
            copies = copies_for(setup, batch, context, layout)
            for (fmt, granularity), first in copies[0].items():
                backends = ["triton"]
                if layout == "paged16" and granularity in (None, "tensor") and gluon_runs(first):
                    backends.append("gluon")
                for backend in backends:
                    calls = [step(c[(fmt, granularity)], backend) for c in copies]
                    row = dict(section="perf", provider=backend, layout=layout, format=fmt, granularity=granularity,
                               batch=batch, context=context)
                    if context <= CHECK_MAX_TOKENS:
                        row.update(check(calls[0], first))
                    row.update(timed(setup, calls, settings, eager=backend == "triton"))
                    rows.append(figures(setup, row, read_gbps))
                    log(row)
            del copies
            if setup.device == "cuda":
                torch.cuda.empty_cache()
    add_ratios(rows)
    return rows


def gluon_runs(cache: Cache) -> bool:
    """Whether the Gluon decode kernel can run this step here (a Hopper GPU, scales per tensor)."""
    from ..kernels import dispatch
    from ..kernels._softmax import Variant

    return dispatch.decode_refusal("gluon", cache.q, cache.k, cache.v, cache.block_table, Variant.of(True), None,
                                   cache.k_scale) is None


def figures(setup: Setup, row: dict, read_gbps: float | None) -> dict:
    """Bytes, bandwidth and its fraction of the read bandwidth, model steps/s and their bound."""
    nbytes = bytes_read(setup, row["batch"], row["context"], row["format"], row["granularity"])
    seconds = row["graph_us"] * 1e-6
    row.update(bytes_read=nbytes, graph_gbps=nbytes / seconds / 1e9, read_gbps=read_gbps)
    row["model_steps_per_s"] = 1.0 / (LAYERS * seconds)
    if read_gbps:
        row["fraction_of_read"] = row["graph_gbps"] / read_gbps
        row["model_steps_bound"] = read_gbps * 1e9 / (LAYERS * nbytes)
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's time over the bf16 row of its provider, shape and layout; per-token over per-tensor."""
    def key(row):
        return row["provider"], row["layout"], row["batch"], row["context"]

    bf16 = {key(r): r for r in rows if r["format"] == "bf16"}
    tensor = {(key(r), r["format"]): r for r in rows if r["granularity"] == "tensor"}
    for row in rows:
        base = bf16.get(key(row))
        for clock in ("graph", "eager"):
            if base and row.get(f"{clock}_us") and base.get(f"{clock}_us"):
                row[f"{clock}_ratio_vs_bf16"] = row[f"{clock}_us"] / base[f"{clock}_us"]
        per_tensor = tensor.get((key(row), row["format"]))
        if row["granularity"] == "token" and per_tensor:
            row["token_over_tensor"] = row["graph_us"] / per_tensor["graph_us"]


def sweep_rows(setup: Setup, settings, log, layouts=tuple(LAYOUTS), shapes=SWEEP_SHAPES,
               configs=None) -> list[dict]:
    """Graph-replayed step times of the Triton kernel at each of ``SWEEP_CONFIGS`` (fp8 and int8,
    scales per tensor and per token) and of ``SWEEP_CONFIGS_BF16`` (the bf16 cache, for its own
    table), over ``layouts`` at ``shapes`` (``(batch, context)`` pairs); ``configs``
    (``(block_n, num_warps, num_stages)`` triples) replaces both config lists."""
    from ..kernels import decode
    from ..kernels.tuning import DecodeConfig

    rows = []
    for batch, context in shapes:
        for layout in layouts:
            copies = copies_for(setup, batch, context, layout)
            for (fmt, granularity), first in copies[0].items():
                if granularity not in (None, "tensor", "token"):
                    continue
                for config in configs or (SWEEP_CONFIGS if granularity else SWEEP_CONFIGS_BF16):
                    config = DecodeConfig(*config)
                    calls = [sweep_call(c[(fmt, granularity)], config, decode) for c in copies]
                    try:
                        row = dict(section="sweep", provider="triton", layout=layout, format=fmt,
                                   granularity=granularity, batch=batch, context=context,
                                   config=f"{config.block_n}x{config.num_warps}w{config.num_stages}s",
                                   **timed(setup, calls, settings, eager=False))
                    except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                        log({"config": str(config), "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                        continue
                    rows.append(row)
                    log(row)
            del copies
            torch.cuda.empty_cache()
    return rows


def sweep_call(cache: Cache, config, decode):
    out = torch.empty_like(cache.q)
    scale = cache.q.shape[-1] ** -0.5
    return lambda: decode.decode_forward(cache.q, cache.k, cache.v, cache.seqlens, cache.block_table, out, None,
                                         appended=0, causal=True, softmax_scale=scale, config=config,
                                         k_scale=cache.k_scale, v_scale=cache.v_scale)


# ---- accuracy ---------------------------------------------------------------------------------------


def accuracy_rows(setup: Setup, log, context: int = 2048, seqlen_q: int = 8) -> list[dict]:
    """Attention over each format and granularity against attention over the bf16 cache it was
    quantized from (float64 math, no kernel), and for scale the bf16 cache against the float32
    values it rounds. Data: random K and V, and K with 4 of 128 channels 100x larger. The softmax
    scale is ``1 / RMS |k|`` in both, so the scores have the same spread (else the outliers'
    scores alone make the softmax one-hot, and any error picks another key). ``*_rms_rel``: RMS
    error over RMS value; ``out_max_rel``: max error over max |out|."""
    rows = []
    generator = torch.Generator(device="cpu").manual_seed(0)
    for data in ("random", "k-outliers"):
        q = torch.randn(1, seqlen_q, setup.heads, setup.head_dim, generator=generator)
        k = torch.randn(1, context, setup.kv_heads, setup.head_dim, generator=generator)
        v = torch.randn(1, context, setup.kv_heads, setup.head_dim, generator=generator)
        if data == "k-outliers":
            k[..., :: max(1, setup.head_dim // 4)] *= 100.0
        scale = 1.0 / k.pow(2).sum(-1).mean().sqrt().item()
        q, k32, v32 = (x.to(setup.device) for x in (q.to(torch.bfloat16), k, v))
        k, v = k32.to(torch.bfloat16), v32.to(torch.bfloat16)
        truth, _ = reference.attention(q, k, v, softmax_scale=scale)
        exact, _ = reference.attention(q, k32, v32, softmax_scale=scale)
        cases = [("bf16", "-", k32, v32, truth, exact)]
        for name, fmt in FORMATS.items():
            if fmt is not None:
                cases += [(name, granularity, k, v, *dequantized_pair(k, v, fmt, granularity), truth)
                          for granularity in GRANULARITIES]
        for name, granularity, k_ref, v_ref, *rest in cases:
            if name == "bf16":
                k_deq, v_deq, out, base = k.double(), v.double(), truth, exact
            else:
                k_deq, v_deq, base = rest
                out, _ = reference.attention(q, k_deq, v_deq, softmax_scale=scale)
            row = dict(section="accuracy", format=name, granularity=granularity, data=data, context=context,
                       out_rms_rel=rms_rel(out, base), out_max_rel=((out - base).abs().max() / base.abs().max()).item(),
                       k_rms_rel=rms_rel(k_deq, k_ref.double()), v_rms_rel=rms_rel(v_deq, v_ref.double()))
            rows.append(row)
            log(row)
    return rows


def dequantized_pair(k, v, fmt, granularity: str):
    return dequantized(k, fmt, granularity), dequantized(v, fmt, granularity)


def dequantized(x: torch.Tensor, fmt, granularity: str) -> torch.Tensor:
    """``x`` through the quantization spec and back (float64): what a kernel attends to."""
    if granularity == "token":
        stored, scale = reference.quantize_tokens(x, fmt)
    else:
        largest = x.float().abs().amax(dim=(0, 1, 3))
        if granularity == "tensor":
            largest = largest.amax().reshape(1)
        scale = largest / reference.QUANT_MAX[fmt]
        stored = reference.quantize(x, reference.expand_scale(scale), fmt)
    return reference.dequantize(stored, scale)


def rms_rel(x: torch.Tensor, truth: torch.Tensor) -> float:
    return ((x.double() - truth).pow(2).mean().sqrt() / truth.pow(2).mean().sqrt()).item()


def accuracy_markdown(rows: list[dict]) -> str:
    """The accuracy rows as the README's table."""
    lines = ["| format | scales | data | output RMS error | output max error | K RMS error | V RMS error |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        scales = "(vs float32)" if row["format"] == "bf16" else f"per {row['granularity']}"
        lines.append(f"| {row['format']} | {scales} | {row['data']} | {row['out_rms_rel']:.2e} | "
                     f"{row['out_max_rel']:.2e} | {row['k_rms_rel']:.2e} | {row['v_rms_rel']:.2e} |")
    return "\n".join(lines)


# ---- output -----------------------------------------------------------------------------------------


def log_row(row: dict) -> None:
    if "error" in row:
        print(f"  {row}", flush=True)
        return
    if row["section"] == "accuracy":
        print(f"accuracy {row['data']:10s} {row['format']:4s} {row['granularity']:6s} out rms "
              f"{row['out_rms_rel']:.2e} max {row['out_max_rel']:.2e}", flush=True)
        return
    what = f"{row['section']} {row['provider']:6s} {row['layout']:10s} b={row['batch']:<3d} ctx={row['context']:<6d} " \
           f"{row['format']:4s} {str(row['granularity']):6s}"
    if row["section"] == "sweep":
        print(f"{what} {row['config']:10s} graph {row['graph_us']:9.1f} us", flush=True)
        return
    eager = f"{row['eager_us']:9.1f}" if row.get("eager_us") else "        -"
    checked = f" err {row['max_err']:.1e}/{row['err_bound']:.1e}" if "max_err" in row else ""
    fraction = f" ({row['fraction_of_read']:.2f} of read)" if "fraction_of_read" in row else ""
    print(f"{what} graph {row['graph_us']:9.1f} us eager {eager} us {row['graph_gbps']:7.0f} GB/s{fraction}{checked}",
          flush=True)


def write(out_dir: Path, doc: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    import json

    paths = [out_dir / "kvquant.json", out_dir / "kvquant.csv"]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    with open(paths[1], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(doc["rows"])
    return paths


def plot(out_dir: Path, rows: list[dict]) -> list[Path]:
    """``kvquant_steps.png`` and ``kvquant_model.png`` (see the module docstring)."""
    from .plots import pyplot

    plt = pyplot()
    perf = [r for r in rows if r["section"] == "perf" and r["provider"] == "triton"]
    colors = {"bf16": "black", "fp8": "#d62728", "int8": "#1f77b4"}
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    for ax, layout in zip(axes[0], LAYOUTS):
        for fmt in FORMATS:
            for granularity, style in ((None, "-"), ("tensor", "-"), ("token", "--")):
                points = sorted((r["context"], 1e6 / r["graph_us"]) for r in perf
                                if r["batch"] == 1 and r["layout"] == layout and r["format"] == fmt
                                and r["granularity"] == granularity)
                if points:
                    label = fmt if granularity is None else f"{fmt} per {granularity}"
                    ax.plot(*zip(*points), style, marker="o", markersize=3, color=colors[fmt], label=label)
        ax.set(xscale="log", yscale="log", xlabel="context (tokens), batch 1", ylabel="decode steps/s (one layer)",
               title=f"{layout}: graph replays")
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "kvquant_steps.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    shapes = sorted({(r["batch"], r["context"]) for r in perf})
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / 3
    for i, fmt in enumerate(FORMATS):
        chosen = {(r["batch"], r["context"]): r for r in perf
                  if r["layout"] == "contiguous" and r["format"] == fmt and r["granularity"] in (None, "tensor")}
        xs = [j + (i - 1) * width for j in range(len(shapes))]
        got = [chosen[s]["model_steps_per_s"] if s in chosen else 0 for s in shapes]
        bound = [chosen[s].get("model_steps_bound", 0) if s in chosen else 0 for s in shapes]
        ax.bar(xs, bound, width, color="none", edgecolor=colors[fmt], hatch="//", label=f"{fmt} bound")
        ax.bar(xs, got, width * 0.6, color=colors[fmt], label=f"{fmt} measured")
    ax.set_xticks(range(len(shapes)), [f"{b}x{c // 1024}k" for b, c in shapes])
    ax.set(yscale="log", xlabel="batch x context (contiguous cache, scales per tensor)",
           ylabel=f"{LAYERS}-layer attention steps/s", title="7B-class model: steps/s against the read-bandwidth bound")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    paths.append(out_dir / "kvquant_model.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def _shape_arg(text: str) -> tuple[int, int]:
    """``"64:4096"`` -> ``(64, 4096)``: a batch and a context for the sweep."""
    try:
        batch, context = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCH:CONTEXT such as 64:4096, got {text!r}") from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"batch and context must be positive, got {text!r}")
    return batch, context


def _config_arg(text: str) -> tuple[int, int, int]:
    """``"128x4w3s"`` -> ``(128, 4, 3)``: keys per tile, warps, pipeline stages (the form the
    sweep's rows name their config in)."""
    found = re.fullmatch(r"(\d+)x(\d+)w(\d+)s", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"expected BLOCKxWARPSwSTAGESs such as 128x4w3s, got {text!r}")
    return tuple(int(g) for g in found.groups())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results directory (kvquant.json, kvquant.csv, PNGs)")
    parser.add_argument("--sections", nargs="+", choices=("perf", "sweep", "accuracy"),
                        help="default: perf and accuracy on a GPU, accuracy without one")
    parser.add_argument("--quick", action="store_true", help=f"perf at {len(QUICK_SHAPES)} shapes only")
    parser.add_argument("--shapes", nargs="+", type=_shape_arg, metavar="BATCH:CONTEXT",
                        help="shapes the perf section times (default: the full list, or --quick's)")
    parser.add_argument("--sweep-layouts", nargs="+", choices=tuple(LAYOUTS), default=tuple(LAYOUTS),
                        help="cache layouts the sweep section times (default: both)")
    parser.add_argument("--sweep-shapes", nargs="+", type=_shape_arg, default=SWEEP_SHAPES, metavar="BATCH:CONTEXT",
                        help="shapes the sweep section times (default: "
                             f"{' '.join(f'{b}:{c}' for b, c in SWEEP_SHAPES)})")
    parser.add_argument("--sweep-configs", nargs="+", type=_config_arg, metavar="BLOCKxWARPSwSTAGESs",
                        help="tile configs the sweep section times, e.g. 128x4w3s (default: the built-in lists)")
    parser.add_argument("--markdown", action="store_true", help="print the accuracy table as Markdown")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    sections = args.sections or (["perf", "accuracy"] if on_gpu else ["accuracy"])
    if not on_gpu and set(sections) - {"accuracy"}:
        parser.error("the perf and sweep sections need a CUDA GPU")
    from . import measure
    from .results import environment

    settings = measure.Settings(warmup_ms=50, rep_ms=30, min_samples=10, max_samples=100)
    setup = Setup(device="cuda" if on_gpu else "cpu")
    torch.manual_seed(0)
    doc = {"environment": environment(["kvquant", *(argv if argv is not None else sys.argv[1:])], setup.device),
           "setup": dataclasses.asdict(setup), "layers": LAYERS, "rows": []}
    if "perf" in sections:
        doc.update(measure_read_gbps(settings))
        print(f"read bandwidth ({READ_BYTES >> 30} GiB, graph replays): torch.sum {doc['torch_sum_gbps']:.0f} GB/s, "
              f"a streaming Triton kernel {doc['triton_stream_gbps']:.0f} GB/s")
        shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
        doc["rows"] += perf_rows(setup, shapes, settings, doc["read_gbps"], log_row)
    if "sweep" in sections:
        doc["rows"] += sweep_rows(setup, settings, log_row, args.sweep_layouts, args.sweep_shapes, args.sweep_configs)
    if "accuracy" in sections:
        rows = accuracy_rows(setup, log_row)
        doc["rows"] += rows
        if args.markdown:
            print(accuracy_markdown(rows))
    if args.out:
        out_dir = Path(args.out)
        for path in write(out_dir, doc):
            print(f"wrote {path}")
        if any(r["section"] == "perf" for r in doc["rows"]):
            try:
                for path in plot(out_dir, doc["rows"]):
                    print(f"wrote {path}")
            except Exception as exc:  # noqa: BLE001 - no matplotlib: the data is written anyway
                print(f"no plots: {exc}")
    failed = [r for r in doc["rows"] if r.get("check_ok") is False]
    for row in failed:
        print(f"WRONG: {row['provider']} {row['layout']} b={row['batch']} ctx={row['context']} {row['format']} "
              f"{row['granularity']}: max error {row['max_err']:.3g} > {row['err_bound']:.3g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
