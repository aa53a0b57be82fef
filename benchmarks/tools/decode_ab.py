"""Decode A/B experiments on the GPU: launch path, split counts and tiles at short contexts.

    PYTHONPATH=src python benchmarks/tools/decode_ab.py --out decode-ab.json

1. ``host``: host time of one eager step (perf_counter over many calls, the GPU never the
   bottleneck): Triton's launch vs the cached compiled kernel (``_launch.FAST_LAUNCH``), with
   and without appending new k/v.
2. ``gpu``: GPU time, graph-replayed and eager, against cuDNN SDPA (eager and graph-replayed)
   on the same shapes.
3. Short contexts (1k): split counts and tile configs, graph-replayed.
4. ``host-profile``: pieces of an eager step timed alone, and cProfile of the whole step.
5. ``rules``: this build's split/tile rules against the previous ones (``OLD_RULES``), same run.
6. ``paged``: contiguous and paged caches (pages of 16 and 256) at issue 4's batches and
   contexts: this build's kernel under several paged tile tables (``PAGED_RULES``) and, with
   ``--before-decode PATH`` (an earlier ``kernels/decode.py``), that build's kernel, same run.
7. ``flush``: graph-replayed steps after ``do_bench``'s flush (it writes 256 MB) and after a
   flush that reads, for flashkernel and cuDNN: the cost of writing back dirty L2 lines.
8. ``timeline``: a graph-replayed step's kernels (decode, combine) and the gap between them,
   from CUPTI, beside do_bench's figure and the timing floor (graphs of trivial kernels).
9. ``gluon``: the Gluon kernel (``kernels/decode_gluon.py``) against the Triton kernel and
   cuDNN, graph-replayed, at issue 4's sweep and over pages of 16 and 256, with the automatic
   split count and ``--gluon-splits`` alternatives; each Gluon result is checked against the
   float64 reference first (``Problem.max_error``).
Shapes are issue 4's: bf16, 32 query heads, 8 KV heads, head dim 128, one new token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from decode import (HEAD_DIM, HEADS, KV_HEADS, Problem, SDPA_PROVIDERS, environment,  # noqa: E402
                    graph_replay)

import flashkernel  # noqa: E402
from flashkernel.kernels import _launch, decode  # noqa: E402


def gpu_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def host_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def print_row(label: str, row: dict, fmt: str = ".1f") -> None:
    """One result row on one line: ``label key=value ...`` (floats in ``fmt``), no section."""
    print(label + " " + " ".join(f"{k}={v:{fmt}}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row.items() if k != "section"), flush=True)


def set_fast_launch(fast: bool) -> None:
    _launch.FAST_LAUNCH = fast


def step(p: Problem, k_cache, v_cache, block_table, append: bool, **kw):
    k_new = torch.randn(p.batch, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=p.dtype) if append else None
    v_new = torch.randn_like(k_new) if append else None
    seqlens = p.seqlens - 1 if append else p.seqlens

    def run():
        return flashkernel.flash_attn_with_kvcache(p.q, k_cache, v_cache, k=k_new, v=v_new,
                                                   cache_seqlens=seqlens, block_table=block_table, **kw)
    return run


def host_section(rows):
    p = Problem(1, 1024, torch.bfloat16)
    for append in (False, True):
        for fast in (False, True):
            set_fast_launch(fast)
            us = host_us(step(p, p.k, p.v, None, append))
            rows.append({"section": "host", "append": append, "fast_launch": fast, "host_us": us})
            print(f"host B=1 1k append={append} fast={fast}: {us:.1f} us/call", flush=True)
    cudnn = SDPA_PROVIDERS["sdpa_cudnn"](p, (p.k.transpose(1, 2).contiguous(), p.v.transpose(1, 2).contiguous()))
    us = host_us(cudnn)
    rows.append({"section": "host", "provider": "sdpa_cudnn", "host_us": us})
    print(f"host B=1 1k sdpa_cudnn: {us:.1f} us/call", flush=True)
    set_fast_launch(True)


def gpu_section(rows):
    cases = [(1, 1024, "contiguous"), (1, 1024, "paged16"), (1, 4096, "contiguous"), (1, 32768, "contiguous"),
             (1, 131072, "contiguous"), (8, 1024, "contiguous"), (8, 1024, "paged16"), (8, 32768, "contiguous"),
             (64, 1024, "contiguous"), (64, 1024, "paged16")]
    problems = {}
    for batch, context, layout in cases:
        if (batch, context) not in problems:
            problems = {(batch, context): Problem(batch, context, torch.bfloat16)}
            torch.cuda.empty_cache()
        p = problems[(batch, context)]
        k_cache, v_cache, block_table = p.layout(layout)
        row = {"section": "gpu", "batch": batch, "context": context, "layout": layout}
        fn = step(p, k_cache, v_cache, block_table, append=False)
        replay, _ = graph_replay(fn)
        row["graph_us"] = gpu_us(replay)
        row["eager_us"] = gpu_us(fn)
        if layout == "contiguous":
            dense = (p.k.transpose(1, 2).contiguous(), p.v.transpose(1, 2).contiguous())
            cudnn = SDPA_PROVIDERS["sdpa_cudnn"](p, dense)
            row["cudnn_eager_us"] = gpu_us(cudnn)
            try:
                replay, _ = graph_replay(cudnn)
                row["cudnn_graph_us"] = gpu_us(replay)
            except Exception as exc:  # noqa: BLE001
                row["cudnn_graph_error"] = str(exc)[:200]
        rows.append(row)
        print_row("gpu", row)


SPLIT_CASES = {  # --split-cases: (batch, context, layout, split counts)
    "short": [(1, 1024, "contiguous", (1, 2, 4, 8, 16)), (1, 1024, "paged16", (1, 2, 4, 8, 16)),
              (8, 1024, "contiguous", (1, 2, 4)), (8, 1024, "paged16", (1, 2, 4)),
              (64, 1024, "contiguous", (1, 2, 4)), (64, 1024, "paged16", (1, 2, 4))],
    "paged4k": [(1, 4096, "contiguous", (8, 16, 32, 64)), (1, 4096, "paged16", (8, 16, 32, 64)),
                (1, 4096, "paged256", (8, 16, 32, 64)), (8, 4096, "paged16", (2, 4, 8))],
    "paged-small": [(1, 1024, "paged16", (4, 8, 16, 32)), (1, 2048, "paged16", (8, 16, 32)),
                    (1, 4096, "paged16", (8, 16, 32, 64)), (1, 8192, "paged16", (16, 32, 64)),
                    (1, 32768, "paged16", (16, 32, 64)), (8, 4096, "paged16", (2, 4, 8)),
                    (8, 32768, "paged16", (2, 4, 8)), (1, 1024, "paged256", (4, 8, 16))],
    "cudnn-close": [(64, 1024, "contiguous", (1,)), (64, 4096, "contiguous", (1, 2)),
                    (8, 131072, "contiguous", (2, 4, 8)), (1, 4096, "contiguous", (8, 16, 32))],
}
SPLIT_CONFIGS = {  # --split-cases -> tile configs swept (default: DEFAULT_SPLIT_CONFIGS)
    "paged-small": [(64, 4, 3), (64, 4, 4), (32, 4, 4), (128, 4, 3)],
    "cudnn-close": [(128, 4, 3), (64, 4, 3), (64, 4, 4), (32, 4, 4), (32, 4, 3), (64, 8, 3), (128, 8, 3),
                    (128, 4, 2), (32, 4, 5), (64, 4, 5)],
}
DEFAULT_SPLIT_CONFIGS = [(128, 4, 3), (64, 4, 3), (64, 4, 2), (32, 4, 4), (128, 4, 2), (64, 8, 3)]


def split_section(rows, cases="short"):
    configs = SPLIT_CONFIGS.get(cases, DEFAULT_SPLIT_CONFIGS)
    for batch, context, layout, split_counts in SPLIT_CASES[cases]:
        p = Problem(batch, context, torch.bfloat16)
        k_cache, v_cache, block_table = p.layout(layout)
        results = []
        for cand in configs:
            for splits in split_counts:
                config = decode.DecodeConfig(*cand)
                out = torch.empty_like(p.q)

                def run():
                    decode.decode_forward(p.q, k_cache, v_cache, p.seqlens, block_table, out, None,
                                          causal=True, softmax_scale=HEAD_DIM ** -0.5, num_splits=splits,
                                          config=config)
                    return out
                try:
                    replay, captured = graph_replay(run)
                    replay()
                    torch.cuda.synchronize()
                    err = p.max_error(captured)
                    us = gpu_us(replay)
                    results.append({"config": cand, "splits": splits, "graph_us": us, "max_err": err})
                except Exception as exc:  # noqa: BLE001
                    results.append({"config": cand, "splits": splits, "error": str(exc)[:200]})
        ok = [r for r in results if "graph_us" in r]
        best = min(ok, key=lambda r: r["graph_us"])
        rows.append({"section": "splits", "batch": batch, "context": context, "layout": layout, "results": results})
        print(f"splits B={batch} ctx={context} {layout}: " + " ".join(
            f"{r['config']}/{r['splits']}={r.get('graph_us', float('nan')):.1f}" for r in results), flush=True)
        print(f"  best {best['config']} splits={best['splits']} {best['graph_us']:.1f} us", flush=True)


def host_profile_section(rows):
    """Where one eager step's host time goes: a few pieces timed alone, then cProfile."""
    import cProfile
    import io
    import pstats

    from flashkernel import _checks, interface

    p = Problem(1, 1024, torch.bfloat16)
    out = torch.empty_like(p.q)

    def guard():
        with interface._on_device(p.q):
            pass
    pieces = {
        "whole step": step(p, p.k, p.v, None, append=False),
        "validation": lambda: (interface._validate_kvcache(p.q, p.k, p.v, None, None, p.seqlens, None, True,
                                                           None, 0, False, None),
                               _checks.check_variant(p.q, 1, HEADS, _checks.NO_WINDOW, 0.0, None, None)),
        "torch.empty out": lambda: torch.empty_like(p.q),
        "device guard": guard,
        "decode_forward": lambda: decode.decode_forward(p.q, p.k, p.v, p.seqlens, None, out, None, causal=True,
                                                        softmax_scale=HEAD_DIM ** -0.5),
        "decode_forward 1 split": lambda: decode.decode_forward(p.q, p.k, p.v, p.seqlens, None, out, None,
                                                                causal=True, softmax_scale=HEAD_DIM ** -0.5,
                                                                num_splits=1),
    }
    for name, fn in pieces.items():
        us = host_us(fn)
        rows.append({"section": "host-profile", "piece": name, "host_us": us})
        print(f"host piece {name}: {us:.1f} us", flush=True)
    fn = pieces["whole step"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue(), flush=True)


# The earlier build's short-context rules, for the contiguous cache (paged layouts have had other
# rules since: LARGE_PAGE, the small-page waves and multi-wave clause; the "old" column of a paged
# row is not that build's).
OLD_RULES = dict(MIN_SPLIT_TOKENS=256, SHORT_SPLIT_TOKENS=0, MULTI_WAVE_MAX_TOKENS=0)


def rules_section(rows):
    """Split/tile rules of this build against the ones before (same run, graph replays)."""
    new_rules = {name: getattr(decode, name) for name in OLD_RULES}
    cases = [(1, 1024), (1, 2048), (1, 4096), (8, 1024), (8, 2048), (16, 1024), (32, 1024), (32, 2048),
             (64, 1024), (64, 2048), (64, 4096), (128, 1024)]
    for batch, context in cases:
        p = Problem(batch, context, torch.bfloat16)
        layouts = ("contiguous", "paged16", "paged256") if batch in (1, 8) else ("contiguous", "paged16")
        for layout in layouts:
            k_cache, v_cache, block_table = p.layout(layout)
            row = {"section": "rules", "batch": batch, "context": context, "layout": layout}
            for label, rules in (("old", OLD_RULES), ("new", new_rules)):
                for name, value in rules.items():
                    setattr(decode, name, value)
                decode.fit_config.cache_clear()  # it reads the rules
                fn = step(p, k_cache, v_cache, block_table, append=False)
                replay, captured = graph_replay(fn)
                replay()
                torch.cuda.synchronize()
                row[f"{label}_err"] = p.max_error(captured)
                row[f"{label}_us"] = gpu_us(replay)
            if layout == "contiguous":
                dense = (p.k.transpose(1, 2).contiguous(), p.v.transpose(1, 2).contiguous())
                replay, _ = graph_replay(SDPA_PROVIDERS["sdpa_cudnn"](p, dense))
                row["cudnn_graph_us"] = gpu_us(replay)
                del dense
            rows.append(row)
            print_row("rules", row, ".4g")
        del p
        torch.cuda.empty_cache()
    for name, value in new_rules.items():
        setattr(decode, name, value)


PAGED_RULES = {  # label -> decode module attributes set for the run (the rest as built)
    "built": {},
    "small-128x4x3": {"SMALL_PAGE_TABLE": decode.CONTIGUOUS_TABLE},
    "small-one-wave": {"SMALL_PAGE_TWO_WAVE_TOKENS": 1 << 40},
}
RULE_NAMES = ("SMALL_PAGE_TABLE", "LARGE_PAGE_TABLE", "SMALL_PAGE_TWO_WAVE_TOKENS")
PAGED_CASES = [(1, 1024), (1, 4096), (1, 32768), (1, 131072), (8, 1024), (8, 4096), (8, 32768), (8, 131072),
               (64, 1024), (64, 4096)]


def paged_section(rows, before_path=None):
    """Graph-replayed GPU time per (case, layout) under each rule set of ``PAGED_RULES``."""
    before = None
    if before_path:
        sys.path.insert(0, os.path.dirname(__file__))
        from plain_ptx import load_module
        before = load_module(before_path, "_before_decode")
    built = {name: getattr(decode, name) for name in RULE_NAMES}
    for batch, context in PAGED_CASES:
        p = Problem(batch, context, torch.bfloat16)
        for layout in ("contiguous", "paged16", "paged256"):
            k_cache, v_cache, block_table = p.layout(layout)
            row = {"section": "paged", "batch": batch, "context": context, "layout": layout}
            runs = [(label, decode, rules) for label, rules in PAGED_RULES.items()]
            if layout == "contiguous":
                runs = runs[:1]
            elif layout == "paged256":
                runs = [r for r in runs if not r[0].startswith("small")]
            if before is not None:
                runs.append(("before", before, {}))
            for label, module, rules in runs:
                for name, value in {**built, **rules}.items():
                    setattr(decode, name, value)
                decode.fit_config.cache_clear()  # it reads module constants
                out = torch.empty_like(p.q)

                def run(module=module, out=out):
                    module.decode_forward(p.q, k_cache, v_cache, p.seqlens, block_table, out, None,
                                          causal=True, softmax_scale=HEAD_DIM ** -0.5)
                    return out
                replay, captured = graph_replay(run)
                replay()
                torch.cuda.synchronize()
                row[f"{label}_err"] = p.max_error(captured)
                row[f"{label}_us"] = gpu_us(replay)
            for name, value in built.items():
                setattr(decode, name, value)
            rows.append(row)
            print_row("paged", row, ".4g")
            del k_cache, v_cache, block_table
        del p
        torch.cuda.empty_cache()


FLUSH_BYTES = 256 << 20  # twice and more the H200's 50 MB L2, like do_bench's flush buffer


def clean_flush_us(fn, flush: torch.Tensor, reps: int = 100) -> float:
    """Median GPU time of ``fn`` after a flush that READS ``flush`` (the L2 ends up holding
    clean lines). ``do_bench`` zeroes its buffer instead, so the timed call starts with ~50 MB
    of dirty lines to write back while it reads; a decode step in a model follows kernels that
    mostly read (weights) and write little."""
    sink = torch.empty((), dtype=flush.dtype, device=flush.device)
    fn()
    times = []
    for _ in range(reps):
        torch.sum(flush, dim=0, out=sink)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[reps // 2] * 1e3


def flush_section(rows):
    """Graph-replayed steps timed after do_bench's writing flush and after a reading one,
    flashkernel and cuDNN (eager and graph-replayed) alike: how much of a short step's time
    is the write-back of the previous flush's dirty L2 lines, and whether it moves ratios."""
    flush = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    for batch, context in ((1, 1024), (1, 4096), (1, 32768), (1, 131072), (8, 4096), (64, 1024), (64, 4096)):
        p = Problem(batch, context, torch.bfloat16)
        dense = (p.k.transpose(1, 2).contiguous(), p.v.transpose(1, 2).contiguous())
        cudnn = SDPA_PROVIDERS["sdpa_cudnn"](p, dense)
        providers = {"flashkernel_graph": graph_replay(step(p, p.k, p.v, None, append=False))[0],
                     "cudnn_eager": cudnn, "cudnn_graph": graph_replay(cudnn)[0]}
        row = {"section": "flush", "batch": batch, "context": context}
        for name, fn in providers.items():
            row[f"{name}_write_flush_us"] = gpu_us(fn)
            row[f"{name}_read_flush_us"] = clean_flush_us(fn, flush)
        rows.append(row)
        print_row("flush", row)
        del p, dense, providers
        torch.cuda.empty_cache()


def timeline_section(rows):
    """Where a graph-replayed step's time goes: kernel durations and the gap between them
    (CUPTI, torch.profiler) after do_bench's flush, against do_bench's figure for the replay
    and for graphs of one and two trivial kernels (the floor of the timing method)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.zeros(16, device="cuda")
    for name, fn in (("one", lambda: x.add_(1)), ("two", lambda: (x.add_(1), x.mul_(1)))):
        rows.append({"section": "timeline", "floor_kernels": name, "graph_us": gpu_us(graph_replay(fn)[0])})
        print(f"timeline floor, graph of {name} trivial kernel(s): {rows[-1]['graph_us']:.1f} us", flush=True)
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    for batch, context in ((1, 1024), (1, 4096), (1, 32768), (8, 4096), (64, 1024), (64, 4096), (8, 131072)):
        p = Problem(batch, context, torch.bfloat16)
        replay = graph_replay(step(p, p.k, p.v, None, append=False))[0]
        row = {"section": "timeline", "batch": batch, "context": context, "graph_us": gpu_us(replay)}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                flush.zero_()
                replay()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"
                          and ("_decode" in e.name or "_combine" in e.name)), key=lambda e: e.time_range.start)
        for which in ("_decode_kernel", "_combine_kernel"):
            times = sorted(e.time_range.end - e.time_range.start for e in kernels if e.name.startswith(which))
            if times:
                row[f"{which.strip('_')}_us"] = times[len(times) // 2]
        gaps = sorted(b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])
                      if a.name.startswith("_decode") and b.name.startswith("_combine"))
        if gaps:
            row["gap_us"] = gaps[len(gaps) // 2]
        rows.append(row)
        print_row("timeline", row)
        del p, replay
        torch.cuda.empty_cache()


GLUON_CASES = [(1, 1024, "contiguous"), (1, 4096, "contiguous"), (1, 32768, "contiguous"), (1, 131072, "contiguous"),
               (8, 1024, "contiguous"), (8, 4096, "contiguous"), (8, 32768, "contiguous"), (8, 131072, "contiguous"),
               (64, 1024, "contiguous"), (64, 4096, "contiguous"), (64, 32768, "contiguous"),
               (1, 1024, "paged16"), (1, 4096, "paged16"), (1, 32768, "paged16"), (8, 32768, "paged16"),
               (64, 4096, "paged16"), (1, 1024, "paged256"), (1, 32768, "paged256"), (8, 32768, "paged256"),
               (64, 4096, "paged256"), (1, 32768, "bhsd"), (8, 131072, "bhsd"), (64, 1024, "bhsd"),
               (64, 4096, "bhsd")]


def gluon_config_runs(specs):
    """``--gluon-configs block_n:stages`` -> runs with that head-dim-128 config."""
    from flashkernel.kernels import decode_gluon
    runs = {}
    for spec in specs or ():
        block_n, stages = spec.split(":")
        config = decode_gluon.GluonDecodeConfig(int(block_n), int(stages))
        runs[f"gluon_{block_n}_{stages}"] = dict(backend="gluon", _gluon_config=config)
    return runs


def decode_with(kw, *args, **kwargs):
    """``decode.decode_forward`` with ``kw``; ``_gluon_config`` replaces the Gluon kernel's
    head-dim-128 config for the call."""
    from flashkernel.kernels import decode_gluon
    kw = dict(kw)
    config = kw.pop("_gluon_config", None)
    saved = decode_gluon.CONFIGS
    if config is not None:
        decode_gluon.CONFIGS = {**saved, 128: config}
    try:
        decode.decode_forward(*args, **kwargs, **kw)
    finally:
        decode_gluon.CONFIGS = saved


def gluon_section(rows, extra_splits=(), cases=None, configs=None):
    wanted = None if not cases else {tuple(int(x) if x.isdigit() else x for x in c.split(":")) for c in cases}
    problem = None
    for batch, context, layout in GLUON_CASES:
        if wanted is not None and (batch, context, layout) not in wanted:
            continue
        if problem is None or (problem.batch, problem.context) != (batch, context):
            problem = None
            torch.cuda.empty_cache()
            problem = Problem(batch, context, torch.bfloat16)
        p = problem
        if layout == "bhsd":  # [B, S, H, D] views of a [B, H, S, D] tensor, cuDNN's layout
            k_cache, v_cache, block_table = (p.k.transpose(1, 2).contiguous().transpose(1, 2),
                                             p.v.transpose(1, 2).contiguous().transpose(1, 2), None)
        else:
            k_cache, v_cache, block_table = p.layout(layout)
        row = {"section": "gluon", "batch": batch, "context": context, "layout": layout}
        runs = {"triton": dict(backend="triton"), "gluon": dict(backend="gluon")}
        for splits in extra_splits:
            runs[f"gluon_s{splits}"] = dict(backend="gluon", num_splits=splits)
        runs.update(gluon_config_runs(configs))
        for name, kw in runs.items():
            out = torch.empty_like(p.q)

            def run(kw=kw, out=out):
                decode_with(kw, p.q, k_cache, v_cache, p.seqlens, block_table, out, None, causal=True,
                            softmax_scale=HEAD_DIM ** -0.5)
                return out
            try:
                replay, captured = graph_replay(run)
                replay()
                torch.cuda.synchronize()
                row[f"{name}_err"] = p.max_error(captured)
                row[f"{name}_us"] = gpu_us(replay)
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_error"] = str(exc)[:300]
        if layout == "contiguous":
            dense = (p.k.transpose(1, 2).contiguous(), p.v.transpose(1, 2).contiguous())
            row["cudnn_us"] = gpu_us(graph_replay(SDPA_PROVIDERS["sdpa_cudnn"](p, dense))[0])
            del dense
        tb = (2 * batch * context * KV_HEADS * HEAD_DIM * 2) / 1e6  # MB of K and V
        for name in list(row):
            if name.endswith("_us"):
                row[name.replace("_us", "_tbs")] = tb / row[name]
        rows.append(row)
        print_row("gluon", row, ".3g")
        del k_cache, v_cache, block_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["host", "gpu", "splits", "host-profile", "rules"])
    parser.add_argument("--split-cases", default="short", choices=list(SPLIT_CASES))
    parser.add_argument("--before-decode", help="an earlier kernels/decode.py for the paged section's A/B")
    parser.add_argument("--gluon-splits", nargs="*", type=int, default=[], help="gluon: extra split counts")
    parser.add_argument("--gluon-cases", nargs="*", help="gluon: only these B:context:layout cases")
    parser.add_argument("--gluon-configs", nargs="*", help="gluon: also these head-dim-128 configs, block_n:stages")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    sections = {"host": host_section, "gpu": gpu_section, "host-profile": host_profile_section,
                "rules": rules_section, "flush": flush_section,
                "timeline": timeline_section,
                "gluon": lambda rows: gluon_section(rows, args.gluon_splits, args.gluon_cases,
                                                            args.gluon_configs),
                "splits": lambda rows: split_section(rows, args.split_cases),
                "paged": lambda rows: paged_section(rows, args.before_decode)}
    for name in args.sections:
        sections[name](rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
