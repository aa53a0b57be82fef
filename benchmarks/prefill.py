"""Prefill benchmark on one GPU: flashkernel's fused forward against SDPA backends and the
three-kernel baseline, in one run, on FlashAttention's benchmark shapes.

    PYTHONPATH=src python benchmarks/prefill.py --out benchmarks/results/h200/prefill.json
    PYTHONPATH=src python benchmarks/prefill.py --sweep-configs   # tile-config search

Shapes: 16k tokens per batch (batch = 16384 / seqlen), model dim 2048 (heads = 2048 / head_dim),
bf16. FLOPs = 4 * B * H * D * (number of visible (query, key) pairs): Sq * Sk without a mask,
Sq * (Sq + 1) / 2 with the causal mask when Sq == Sk.
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
from flashkernel.kernels import prefill

SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128, 256)
TOKENS = 16384
MODEL_DIM = 2048

CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 3), (256, 64, 16, 2), (128, 64, 4, 3, True),
         (128, 128, 8, 3, True)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (256, 64, 16, 2), (128, 128, 8, 3, True),
          (128, 64, 4, 3, True)],
    256: [(128, 64, 8, 2), (128, 32, 8, 3), (256, 32, 16, 2), (128, 64, 8, 2, True), (64, 64, 4, 2)],
}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    if not causal:
        return seqlen_q * seqlen_k
    return int(reference.causal_mask(seqlen_q, seqlen_k).sum())


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal) -> int:
    return 4 * batch * heads * head_dim * visible_pairs(seqlen_q, seqlen_k, causal)


def sdpa(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
            ).transpose(1, 2)
    return run


PROVIDERS = {
    "flashkernel": lambda q, k, v, causal: flashkernel.flash_attn_func(q, k, v, causal=causal),
    "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    "standard": lambda q, k, v, causal: flashkernel.standard_attention(q, k, v, causal=causal),
}


def time_ms(fn) -> dict:
    fn()
    torch.cuda.synchronize()
    p50, p10, p90 = triton.testing.do_bench(fn, warmup=50, rep=300, quantiles=[0.5, 0.1, 0.9])
    return {"ms": p50, "p10_ms": p10, "p90_ms": p90}


def peak_memory_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def max_error(out, q, k, v, causal) -> float:
    """Max |out - float64 truth| over the first batch element and first 2 heads (cheap)."""
    hkv = k.shape[2]
    group = q.shape[2] // hkv
    qs, ks, vs = q[:1, :, : 2 * group], k[:1, :, :2], v[:1, :, :2]
    truth, _ = reference.attention(qs, ks, vs, causal=causal)
    return (out[:1, :, : 2 * group].double() - truth).abs().max().item()


def shapes(args):
    for head_dim in args.head_dims:
        for causal in (False, True):
            for seqlen in args.seqlens:
                yield head_dim, causal, seqlen


def make_inputs(seqlen, head_dim, dtype):
    batch, heads = TOKENS // seqlen, MODEL_DIM // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    return q, k, v


def run_compare(args) -> list[dict]:
    rows = []
    for head_dim, causal, seqlen in shapes(args):
        q, k, v = make_inputs(seqlen, head_dim, args.dtype)
        batch, _, heads, _ = q.shape
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
        row = {"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
               "heads": heads, "flops": flops}
        for name in args.providers:
            fn = PROVIDERS[name]
            if name == "standard" and seqlen > args.standard_max_seqlen:
                continue
            try:
                out = fn(q, k, v, causal)
                err = max_error(out, q, k, v, causal)
                del out
                t = time_ms(lambda: fn(q, k, v, causal))
                mem = peak_memory_mb(lambda: fn(q, k, v, causal))
            except Exception as exc:  # a provider that cannot run this shape is reported, not ranked
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            row[name] = {**t, "tflops": flops / t["ms"] / 1e9, "max_err": err, "peak_mb": mem}
        rows.append(row)
        print(format_row(row, args.providers), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def format_row(row, providers) -> str:
    cells = [f"d={row['head_dim']:3d} {'causal' if row['causal'] else 'full  '} s={row['seqlen']:5d}"]
    for name in providers:
        r = row.get(name)
        if r is None:
            cells.append(f"{name}: -")
        elif "error" in r:
            cells.append(f"{name}: ERR")
        else:
            cells.append(f"{name}: {r['tflops']:6.1f} TF/s {r['peak_mb']:8.0f} MB err {r['max_err']:.1e}")
    fk = row.get("flashkernel", {})
    for peer in ("sdpa_flash", "sdpa_cudnn"):
        if "tflops" in fk and "tflops" in row.get(peer, {}):
            cells.append(f"x{peer}={fk['tflops'] / row[peer]['tflops']:.2f}")
    return " | ".join(cells)


def resources(compiled) -> dict:
    """Registers, spills, shared memory and whether wgmma (Hopper MMA) made it into the PTX."""
    try:
        ptx = compiled.asm.get("ptx", "")
        return {"regs": compiled.n_regs, "spills": compiled.n_spills,
                "shared": compiled.metadata.shared, "wgmma": "wgmma" in ptx}
    except Exception as exc:  # resource fields moved between Triton versions
        return {"resources_error": str(exc)[:100]}


def run_sweep(args) -> list[dict]:
    rows = []
    for head_dim, causal, seqlen in shapes(args):
        q, k, v = make_inputs(seqlen, head_dim, args.dtype)
        batch, _, heads, _ = q.shape
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
        out = torch.empty_like(q)
        results = []
        for cand in CANDIDATES[head_dim]:
            for tma in args.tma:
                config = prefill.TileConfig(*cand)
                fn = lambda: prefill.attention_forward(q, k, v, out, None, causal=causal,
                                                       softmax_scale=head_dim ** -0.5, config=config,
                                                       force_tma=tma)
                try:
                    compiled = fn()
                    err = max_error(out, q, k, v, causal)
                    t = time_ms(fn)
                except Exception as exc:
                    results.append({"config": cand, "tma": tma, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                    continue
                results.append({"config": cand, "tma": tma, "tflops": flops / t["ms"] / 1e9, "max_err": err,
                                **t, **resources(compiled)})
        anchors = {}
        for name in ("sdpa_flash", "sdpa_cudnn"):
            try:
                anchors[name] = flops / time_ms(lambda: PROVIDERS[name](q, k, v, causal))["ms"] / 1e9
            except Exception as exc:
                anchors[name] = float("nan")
        ok = [r for r in results if "tflops" in r]
        best = max(ok, key=lambda r: r["tflops"]) if ok else None
        print(f"d={head_dim} causal={causal} s={seqlen} anchors " +
              " ".join(f"{n}={t:.0f}" for n, t in anchors.items()), flush=True)
        for r in results:
            print(f"    {r['config']} tma={r['tma']}: " + (
                f"{r['tflops']:.0f} TF/s regs={r.get('regs')} spills={r.get('spills')} "
                f"smem={r.get('shared')} wgmma={r.get('wgmma')} err={r['max_err']:.1e}"
                if "tflops" in r else r["error"]), flush=True)
        print(f"  best={best and (best['config'], best['tma'])}", flush=True)
        rows.append({"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "anchors": anchors,
                     "results": results})
        del q, k, v, out
        torch.cuda.empty_cache()
    return rows


def markdown_table(path: str) -> str:
    """The README's table, generated from a committed result file."""
    with open(path) as f:
        data = json.load(f)
    env = data["environment"]
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, bf16, TFLOP/s (median)", "",
             "| head dim | mask | seqlen | flashkernel | FA2 (SDPA) | cuDNN (SDPA) | standard | x FA2 | x cuDNN | standard peak MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        t = {name: row.get(name, {}).get("tflops") for name in PROVIDERS}
        cell = lambda x: f"{x:.0f}" if x else "-"
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        lines.append(
            f"| {row['head_dim']} | {'causal' if row['causal'] else 'none'} | {row['seqlen']} "
            f"| {cell(t['flashkernel'])} | {cell(t['sdpa_flash'])} | {cell(t['sdpa_cudnn'])} "
            f"| {cell(t['standard'])} | {ratio(t['flashkernel'], t['sdpa_flash'])} "
            f"| {ratio(t['flashkernel'], t['sdpa_cudnn'])} | {row.get('standard', {}).get('peak_mb', 0):.0f} |")
    return "\n".join(lines)


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    commit = git_commit(Path(__file__).parent) or "unknown"
    return {
        "gpu": props.name, "sm_count": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "git_commit": commit,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(SEQLENS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--standard-max-seqlen", type=int, default=16384)
    parser.add_argument("--sweep-configs", action="store_true")
    parser.add_argument("--tma", type=int, nargs="+", default=[1], help="with --sweep-configs: 1, 0 or both")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--markdown", metavar="JSON", help="print the README table of a result file")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(args.markdown))
        return 0
    args.dtype = getattr(torch, args.dtype)
    args.tma = [bool(t) for t in args.tma]
    rows = run_sweep(args) if args.sweep_configs else run_compare(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
