"""Decode benchmark on one GPU: flashkernel's split-KV GQA decode against SDPA backends and the
seed's baseline kernel, in one run, on a 7B-class attention layer.

    PYTHONPATH=src python benchmarks/decode.py --out benchmarks/results/h200/decode.json
    PYTHONPATH=src python benchmarks/decode.py --sweep-configs   # (BLOCK_N, warps, stages, splits)

Shapes: bf16, 32 query heads, 8 KV heads, head dim 128, one new token per sequence; batch
1/8/64 x context 1k/4k/32k/128k with batch * context <= 2M tokens; every sequence holds the full
context. Cache layouts: contiguous ``[B, S, Hkv, D]`` and paged with 16- and 256-token pages in
a shuffled pool (SDPA runs on the contiguous shapes only, with its preferred ``[B, H, S, D]``
layout and ``enable_gqa=True``).

Effective bandwidth = (K and V bytes read once + Q bytes + O bytes) / time, also as a fraction of
the 4.24 TB/s measured copy bandwidth of an H200. Times are medians of ``triton.testing.do_bench``
(L2 flushed between runs): "flashkernel" is an eager call, "flashkernel_graph" a CUDA-graph
replay of the same call. 7B-class steps/s = 1 / (32 layers x attention time), against the bound
set by reading the cache once per layer at 4.24 TB/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkernel
from flashkernel import reference
from flashkernel.bench.results import git_commit
from flashkernel.kernels import decode

BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096, 32768, 131072)
MAX_TOKENS = 2 * 1024 * 1024
LAYOUTS = ("contiguous", "paged16", "paged256")
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LAYERS = 32
COPY_BANDWIDTH = 4.24e12  # bytes/s, measured H200 copy bandwidth

CANDIDATES = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 3), (128, 4, 2)]
SPLIT_FACTORS = (0.5, 1.0, 2.0)  # times the automatic split count
SWEEP_SHAPES = ((1, 32768), (1, 131072), (8, 4096), (8, 32768), (64, 4096), (64, 32768))


# ---- inputs -----------------------------------------------------------------------------------


class Problem:
    """One shape: q, a filled contiguous cache, and (lazily) paged copies of it."""

    def __init__(self, batch: int, context: int, dtype: torch.dtype):
        self.batch, self.context, self.dtype = batch, context, dtype
        self.q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        self.k = torch.randn(batch, context, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        self.v = torch.randn_like(self.k)
        self.seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")

    def layout(self, name: str):
        """``(k_cache, v_cache, block_table)`` for a layout; paged pools are shuffled copies."""
        if name == "contiguous":
            return self.k, self.v, None
        page = int(name.removeprefix("paged"))
        per_seq = self.context // page
        order = torch.randperm(self.batch * per_seq, device="cuda")
        block_table = order.view(self.batch, per_seq).to(torch.int32)
        pools = []
        for dense in (self.k, self.v):
            pool = torch.empty(self.batch * per_seq, page, KV_HEADS, HEAD_DIM, device="cuda", dtype=self.dtype)
            pool[order] = dense.view(self.batch * per_seq, page, KV_HEADS, HEAD_DIM)
            pools.append(pool)
        return pools[0], pools[1], block_table

    def bytes_moved(self) -> int:
        element = torch.finfo(self.dtype).bits // 8
        kv = 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * element
        return kv + 2 * self.q.numel() * element  # K + V read once, Q read, O written

    def max_error(self, out: torch.Tensor) -> float:
        """Max |out - float64 truth| for sequence 0, KV head 0's query heads (cheap)."""
        group = HEADS // KV_HEADS
        truth, _ = reference.attention(self.q[:1, :, :group], self.k[:1, :, :1], self.v[:1, :, :1])
        return (out[:1, :, :group].double() - truth).abs().max().item()


def shapes(batches, contexts):
    for batch in batches:
        for context in contexts:
            if batch * context <= MAX_TOKENS:
                yield batch, context


# ---- providers --------------------------------------------------------------------------------


def flashkernel_call(p: Problem, k_cache, v_cache, block_table):
    return lambda: flashkernel.flash_attn_with_kvcache(
        p.q, k_cache, v_cache, cache_seqlens=p.seqlens, block_table=block_table)


def graph_replay(fn):
    """Capture ``fn`` (after a warm-up on a side stream) and return (replay, captured output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def baseline_call(p: Problem, k_cache, v_cache, block_table):
    out = torch.empty_like(p.q)

    def run():
        decode.baseline_decode(p.q, k_cache, v_cache, p.seqlens, block_table, out, None,
                               causal=True, softmax_scale=HEAD_DIM ** -0.5)
        return out
    return run


def sdpa_call(backend):
    def make(p: Problem, dense_bhsd):
        q = p.q.transpose(1, 2)  # [B, Hq, 1, D]
        k, v = dense_bhsd

        def run():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return out.transpose(1, 2)
        return run
    return make


SDPA_PROVIDERS = {
    "sdpa_cudnn": sdpa_call(SDPBackend.CUDNN_ATTENTION),
    "sdpa_flash": sdpa_call(SDPBackend.FLASH_ATTENTION),
    "sdpa_efficient": sdpa_call(SDPBackend.EFFICIENT_ATTENTION),
}
FLASHKERNEL_PROVIDERS = ("flashkernel", "flashkernel_graph", "baseline")
PROVIDERS = FLASHKERNEL_PROVIDERS + tuple(SDPA_PROVIDERS)


# ---- measurement ------------------------------------------------------------------------------


def time_ms(fn) -> dict:
    fn()
    torch.cuda.synchronize()
    p50, p10, p90 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.1, 0.9])
    return {"ms": p50, "p10_ms": p10, "p90_ms": p90}


def measure(p: Problem, fn, captured_out=None) -> dict:
    """Time ``fn``; its output (or ``captured_out``, for a graph replay) is checked for error."""
    out = fn()
    if captured_out is not None:
        out = captured_out
    torch.cuda.synchronize()
    err = p.max_error(out)
    t = time_ms(fn)
    tbps = p.bytes_moved() / (t["ms"] * 1e-3) / 1e12
    return {**t, "tb_per_s": tbps, "bw_fraction": tbps * 1e12 / COPY_BANDWIDTH, "max_err": err,
            "steps_per_s_7b": 1e3 / (LAYERS * t["ms"])}


def run_provider(name, p, k_cache, v_cache, block_table, dense_bhsd) -> dict:
    try:
        if name == "flashkernel":
            return measure(p, flashkernel_call(p, k_cache, v_cache, block_table))
        if name == "flashkernel_graph":
            replay, out = graph_replay(flashkernel_call(p, k_cache, v_cache, block_table))
            return measure(p, replay, captured_out=out)
        if name == "baseline":
            return measure(p, baseline_call(p, k_cache, v_cache, block_table))
        return measure(p, SDPA_PROVIDERS[name](p, dense_bhsd))
    except Exception as exc:  # a provider that cannot run this shape is reported, not ranked
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def run_compare(args) -> list[dict]:
    rows = []
    for batch, context in shapes(args.batches, args.contexts):
        p = Problem(batch, context, args.dtype)
        sdpa_wanted = [n for n in args.providers if n in SDPA_PROVIDERS]
        dense_bhsd = None
        if sdpa_wanted:
            dense_bhsd = (p.k.transpose(1, 2).contiguous(), p.v.transpose(1, 2).contiguous())
        for layout in args.layouts:
            k_cache, v_cache, block_table = p.layout(layout)
            bound = COPY_BANDWIDTH / (LAYERS * p.bytes_moved())
            row = {"batch": batch, "context": context, "layout": layout, "bytes": p.bytes_moved(),
                   "steps_per_s_7b_bound": bound}
            for name in args.providers:
                if name in SDPA_PROVIDERS and layout != "contiguous":
                    continue
                row[name] = run_provider(name, p, k_cache, v_cache, block_table, dense_bhsd)
            rows.append(row)
            print(format_row(row, args.providers), flush=True)
            del k_cache, v_cache, block_table
        del p, dense_bhsd
        torch.cuda.empty_cache()
    add_ratios(rows)
    return rows


def add_ratios(rows) -> None:
    """Speed of flashkernel against cuDNN (same shape, contiguous SDPA row) and its own contiguous."""
    contiguous = {(r["batch"], r["context"]): r for r in rows if r["layout"] == "contiguous"}
    for row in rows:
        base = contiguous.get((row["batch"], row["context"]), {})
        for name in ("flashkernel", "flashkernel_graph"):
            mine = row.get(name, {})
            if "ms" not in mine:
                continue
            cudnn = base.get("sdpa_cudnn", {})
            if "ms" in cudnn:
                mine["x_cudnn"] = cudnn["ms"] / mine["ms"]
            same = base.get(name, {})
            if "ms" in same and row["layout"] != "contiguous":
                mine["x_contiguous"] = same["ms"] / mine["ms"]


def format_row(row, providers) -> str:
    cells = [f"B={row['batch']:2d} ctx={row['context']:6d} {row['layout']:10s}"]
    for name in providers:
        r = row.get(name)
        if r is None:
            continue
        if "error" in r:
            cells.append(f"{name}: ERR")
        else:
            cells.append(f"{name}: {r['ms'] * 1e3:7.1f}us {r['tb_per_s']:4.2f}TB/s err {r['max_err']:.0e}")
    fk, cudnn = row.get("flashkernel_graph", {}), row.get("sdpa_cudnn", {})
    if "ms" in fk and "ms" in cudnn:
        cells.append(f"x_cudnn={cudnn['ms'] / fk['ms']:.2f}")
    if "ms" in fk:
        cells.append(f"7B steps/s {fk['steps_per_s_7b']:.0f} of {row['steps_per_s_7b_bound']:.0f}")
    return " | ".join(cells)


# ---- tuning sweep -----------------------------------------------------------------------------


def run_sweep(args) -> list[dict]:
    rows = []
    for batch, context in SWEEP_SHAPES:
        if batch * context > MAX_TOKENS:
            continue
        p = Problem(batch, context, args.dtype)
        for layout in ("contiguous", "paged16", "paged256"):
            k_cache, v_cache, block_table = p.layout(layout)
            out = torch.empty_like(p.q)
            results = []
            for cand in CANDIDATES:
                config = decode.DecodeConfig(*cand)
                auto = auto_splits(p, k_cache, block_table, config)
                for factor in SPLIT_FACTORS:
                    splits = max(1, round(auto * factor))
                    fn = lambda: decode.decode_forward(  # noqa: E731
                        p.q, k_cache, v_cache, p.seqlens, block_table, out, None, causal=True,
                        softmax_scale=HEAD_DIM ** -0.5, num_splits=splits, config=config)
                    key = {"config": cand, "num_splits": splits}
                    try:
                        fn()
                        err = p.max_error(out)
                        t = time_ms(fn)
                    except Exception as exc:
                        results.append({**key, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                        continue
                    tbps = p.bytes_moved() / (t["ms"] * 1e-3) / 1e12
                    results.append({**key, "tb_per_s": tbps, "max_err": err, **t})
            print(format_sweep(batch, context, layout, results), flush=True)
            rows.append({"batch": batch, "context": context, "layout": layout, "results": results})
            del k_cache, v_cache, block_table
        del p
        torch.cuda.empty_cache()
    return rows


def format_sweep(batch, context, layout, results) -> str:
    cells = [f"{r['config']}/{r['num_splits']}={r.get('tb_per_s', float('nan')):.2f}" for r in results]
    ok = [r for r in results if "tb_per_s" in r]
    best = max(ok, key=lambda r: r["tb_per_s"]) if ok else None
    summary = f"best {best['config']} splits={best['num_splits']} {best['tb_per_s']:.2f} TB/s" if best else "none ran"
    return f"B={batch} ctx={context} {layout}: {' '.join(cells)}\n  {summary}"


def auto_splits(p: Problem, k_cache, block_table, config) -> int:
    """The split count ``num_splits=0`` would choose for this problem and config."""
    geometry = decode.CacheGeometry.of(k_cache, block_table)
    group = HEADS // KV_HEADS
    row_tiles = triton.cdiv(group, decode.pick_block_m(group, HEAD_DIM))
    sms = decode.sm_count(p.q.device, interpreted=False)
    return decode.pick_num_splits(p.batch * KV_HEADS * row_tiles, geometry.capacity, config.block_n, sms, False,
                                  page_size=geometry.page_size)


# ---- entry point ------------------------------------------------------------------------------


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    commit = git_commit(Path(__file__).parent)
    return {
        "gpu": props.name, "sm_count": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(), "git_commit": commit,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "new_tokens": 1},
        "copy_bandwidth_bytes_per_s": COPY_BANDWIDTH,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--sweep-configs", action="store_true")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    rows = run_sweep(args) if args.sweep_configs else run_compare(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
