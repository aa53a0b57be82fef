"""Variants benchmark on one GPU: sliding window, softcap, ALiBi, sinks and packed sequences,
against FlexAttention (torch.compile'd, compilation verified per shape) and FlashAttention when
importable; and an A/B of the plain path against the kernels of the build before the variants.

    flashkernel bench variants --out benchmarks/results/h200          # writes variants.json there
    python -m flashkernel.bench.variants --out variants.json             # the same, all options
    git show 2d1dec1:src/flashkernel/kernels/prefill.py > benchmarks/before_prefill.py
    git show 2d1dec1:src/flashkernel/kernels/decode.py > benchmarks/before_decode.py
    python -m flashkernel.bench.variants --cases plain-ab \\
        --before-prefill benchmarks/before_prefill.py --before-decode benchmarks/before_decode.py

Shapes: bf16, head dim 128, 16 heads (model dim 2048), MHA, causal.

* ``window``: one 16384-token sequence; full causal against a sliding window of 4096 keys
  (``window_size=(4095, 0)``: query i sees keys i-4095 .. i). Time should fall by about the
  ratio of visible pairs (0.44).
* ``mods``: batch 4 x 4096; softcap 50 (Gemma 2), ALiBi (geometric slopes), sinks, all three,
  each against flashkernel's plain call (the cost of the modifier) and the peers.
* ``varlen``: 16384 packed tokens. Equal lengths (16 x 1024) against the dense batch
  ``[16, 1024]`` (the same work: within 10% is the goal); skewed lengths (halving 8192, 4096,
  ..., 1, 1 and a long-tailed random draw of 64 sequences) against the dense batch padded to
  ``[B, max_len]`` (what a caller without varlen pays).
* ``plain-ab`` (with ``--before-*``): the plain prefill and decode calls of this build against
  the kernel modules of the build before, loaded from the given files, timed alternately in
  one run. Decode is timed eager and graph-replayed (host overhead and GPU time).

TFLOP/s count visible (query, key) pairs only: 4 * H * D * pairs. Times are medians of
``triton.testing.do_bench``. Every output is checked against the float64 reference on a few
rows (the last 128 queries of up to two sequences, two heads) and its max error is reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton

import flashkernel
from flashkernel import reference
from flashkernel.bench.results import git_commit

HEADS, HEAD_DIM = 16, 128
WINDOW_SEQLEN, WINDOW = 16384, 4096
MODS_BATCH, MODS_SEQLEN, SOFTCAP = 4, 4096, 50.0
TOTAL_TOKENS = 16384
CHECK_ROWS = 128
CASES = ("window", "mods", "varlen", "plain-ab")
AB_PREFILL = [(d, s) for d in (64, 128) for s in (1024, 16384)]  # (head dim, seqlen), 16k tokens
AB_DECODE = ((1, 1024, 0), (1, 131072, 0), (8, 32768, 0), (64, 4096, 16))  # (batch, context, page)


# ---- timing and checking ------------------------------------------------------------------------


def time_ms(fn, warmup=25, rep=150) -> dict:
    fn()
    torch.cuda.synchronize()
    p50, p10, p90 = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.1, 0.9])
    return {"ms": p50, "p10_ms": p10, "p90_ms": p90}


def graph_ms(fn, calls=20) -> float:
    """Per-call time of ``calls`` calls captured in one CUDA graph (no host overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_ms(graph.replay)["ms"] / calls


def causal_pairs(seqlen: int, window: int | None = None) -> int:
    """Visible pairs of a causal square of ``seqlen`` with a window of ``window`` keys per query."""
    if window is None or window >= seqlen:
        return seqlen * (seqlen + 1) // 2
    return window * (window + 1) // 2 + (seqlen - window) * window


def flops(pairs: int) -> int:
    return 4 * HEADS * HEAD_DIM * pairs


def check_dense(out, q, k, v, **kwargs) -> float:
    """Max error on the last CHECK_ROWS queries of batch element 0, heads 0-1 (bottom-right
    alignment keeps the rows' positions when only the last queries are kept)."""
    rows = min(CHECK_ROWS, q.shape[1])
    slopes = kwargs.pop("alibi_slopes", None)
    sinks = kwargs.pop("sinks", None)
    truth, _ = reference.attention(q[:1, -rows:, :2], k[:1, :, :2], v[:1, :, :2],
                                   alibi_slopes=None if slopes is None else slopes[:2],
                                   sinks=None if sinks is None else sinks[:2], **kwargs)
    return (out[:1, -rows:, :2].double() - truth).abs().max().item()


def check_packed(out, q, k, v, lengths, **kwargs) -> float:
    """Max error on the last rows of the longest and the last sequence, heads 0-1."""
    starts = [0, *itertools.accumulate(lengths)]
    worst = 0.0
    for b in {max(range(len(lengths)), key=lambda i: lengths[i]), len(lengths) - 1}:
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        rows = min(CHECK_ROWS, e - s)
        truth, _ = reference.attention(q[None, e - rows:e, :2], k[None, s:e, :2], v[None, s:e, :2], **kwargs)
        worst = max(worst, (out[e - rows:e, :2].double() - truth[0]).abs().max().item())
    return worst


def ready(fn):
    """A build step for a provider that needs no preparation: the call itself."""
    return lambda: fn


def measure(row: dict, name: str, build, check, flop_count: int, args) -> None:
    """``build()`` prepares the call (compiles, untimed); check it once, then time it.
    Errors are recorded in the row, not raised."""
    try:
        started = time.time()
        fn = build()
        out = fn()
        err = check(out)
        del out
        t = time_ms(fn)
        row[name] = {**t, "tflops": flop_count / t["ms"] / 1e9, "max_err": err,
                     "build_s": round(time.time() - started, 1)}
    except Exception as exc:  # a peer that cannot run this case is reported, not ranked
        row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if args.verbose:
        print(f"    {name}: {row[name]}", flush=True)


# ---- peers ---------------------------------------------------------------------------------------


def flex_builder(key, q, k, v, *, mask_mod=None, score_mod=None):
    """FlexAttention on ``[B, H, S, D]`` views, compiled once per key (verified by the counting
    backend of ``flashkernel.bench.flex``: a call that ran eagerly raises instead)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from flashkernel.bench.flex import compiled_flex

    def build():
        flex = compiled_flex()
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kwargs = {}
        if mask_mod is not None:
            kwargs["block_mask"] = create_block_mask(mask_mod, None, None, q.shape[1], k.shape[1], device=q.device)
        if score_mod is not None:
            kwargs["score_mod"] = score_mod
        flex.first_call(key, qt, kt, vt, **kwargs)
        return lambda: flex.compiled(qt, kt, vt, **kwargs).transpose(1, 2)

    return build


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window_mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def softcap_score_mod(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def alibi_score_mod_for(slopes):
    def alibi_score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return alibi_score_mod


def document_mask_mod_for(doc_ids):
    def document_causal_mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

    return document_causal_mask_mod


def flash_attn_modules():
    """FlashAttention 2 (>= 2.1, bottom-right causal) and 3, when importable."""
    found = {}
    for name, module_name in (("fa2", "flash_attn"), ("fa3", "flash_attn_interface")):
        try:
            found[name] = importlib.import_module(module_name)
        except Exception:
            continue
    return found


def first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


# ---- cases ---------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    return torch.pow(2.0, torch.arange(1, num_heads + 1, dtype=torch.float32) * (-8.0 / num_heads)).cuda()


def case_window(args) -> list[dict]:
    q, k, v = (torch.randn(1, WINDOW_SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=args.dtype) for _ in range(3))
    fa = flash_attn_modules()
    rows = []
    for label, window in (("causal", None), (f"window{WINDOW}", WINDOW)):
        kw = {} if window is None else {"window_size": (window - 1, 0)}
        pairs = causal_pairs(WINDOW_SEQLEN, window)
        row = {"case": "window", "shape": f"1x{WINDOW_SEQLEN} {label}", "pairs": pairs, "flops": flops(pairs)}
        check = lambda out, kw=kw: check_dense(out, q, k, v, causal=True, **kw)  # noqa: E731
        call = lambda kw=kw: flashkernel.flash_attn_func(q, k, v, causal=True, **kw)  # noqa: E731
        measure(row, "flashkernel", ready(call), check, row["flops"], args)
        if not args.skip_flex:
            mask = causal_mask_mod if window is None else sliding_window_mask_mod
            measure(row, "flex", flex_builder(("window", label), q, k, v, mask_mod=mask), check, row["flops"], args)
        for name, module in fa.items():
            call = lambda m=module, kw=kw: first(m.flash_attn_func(q, k, v, causal=True, **kw))  # noqa: E731
            measure(row, name, ready(call), check, row["flops"], args)
        rows.append(row)
    return rows


def case_mods(args) -> list[dict]:
    shape = (MODS_BATCH, MODS_SEQLEN, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=args.dtype) for _ in range(3))
    slopes = alibi_slopes(HEADS)
    sinks = torch.randn(HEADS, device="cuda")
    pairs = MODS_BATCH * causal_pairs(MODS_SEQLEN)
    fa = flash_attn_modules()
    variants = {
        "plain": ({}, None, {}),
        f"softcap{SOFTCAP:g}": ({"softcap": SOFTCAP}, softcap_score_mod, {"softcap": SOFTCAP}),
        "alibi": ({"alibi_slopes": slopes}, alibi_score_mod_for(slopes), {"alibi_slopes": slopes}),
        "sinks": ({"sinks": sinks}, "none", None),
        "softcap+alibi+sinks": ({"softcap": SOFTCAP, "alibi_slopes": slopes, "sinks": sinks}, "none", None),
    }
    rows = []
    for label, (kw, score_mod, fa_kw) in variants.items():
        row = {"case": "mods", "shape": f"{MODS_BATCH}x{MODS_SEQLEN} causal {label}", "pairs": pairs,
               "flops": flops(pairs)}
        check = lambda out, kw=kw: check_dense(out, q, k, v, causal=True, **kw)  # noqa: E731
        call = lambda kw=kw: flashkernel.flash_attn_func(q, k, v, causal=True, **kw)  # noqa: E731
        measure(row, "flashkernel", ready(call), check, row["flops"], args)
        if not args.skip_flex and score_mod != "none":
            build = flex_builder(("mods", label), q, k, v, mask_mod=causal_mask_mod, score_mod=score_mod)
            measure(row, "flex", build, check, row["flops"], args)
        if fa_kw is not None:
            for name, module in fa.items():
                if name == "fa3" and "alibi_slopes" in fa_kw:
                    continue  # FlashAttention 3 has no ALiBi
                call = lambda m=module, kw=fa_kw: first(m.flash_attn_func(q, k, v, causal=True, **kw))  # noqa: E731
                measure(row, name, ready(call), check, row["flops"], args)
        rows.append(row)
    return rows


def skewed_lengths(kind: str) -> list[int]:
    if kind == "equal":
        return [1024] * (TOTAL_TOKENS // 1024)
    if kind == "halving":  # 8192, 4096, ..., 2, 1, 1
        lengths, left = [], TOTAL_TOKENS
        while left > 1:
            lengths.append(left // 2)
            left -= left // 2
        return lengths + [left]
    # long-tailed: 64 lognormal draws scaled to the total, at least one token each
    gen = torch.Generator().manual_seed(0)
    draws = torch.exp(torch.randn(64, generator=gen) * 1.2)
    lengths = [max(1, int(x)) for x in draws / draws.sum() * TOTAL_TOKENS]
    lengths[0] += TOTAL_TOKENS - sum(lengths)
    return lengths


def case_varlen(args) -> list[dict]:
    fa = flash_attn_modules()
    rows = []
    for kind in ("equal", "halving", "random64"):
        lengths = skewed_lengths(kind)
        batch, longest = len(lengths), max(lengths)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(TOTAL_TOKENS, HEADS, HEAD_DIM, device="cuda", dtype=args.dtype) for _ in range(3))
        pairs = sum(causal_pairs(n) for n in lengths)
        row = {"case": "varlen", "shape": f"{kind}: {batch} seqs, max {longest}, {TOTAL_TOKENS} tokens causal",
               "pairs": pairs, "flops": flops(pairs), "lengths": lengths}
        check = lambda out, lengths=lengths: check_packed(out, q, k, v, lengths, causal=True)  # noqa: E731
        call = lambda: flashkernel.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)  # noqa: E731
        measure(row, "flashkernel", ready(call), check, row["flops"], args)
        # The dense alternative: a batch padded to the longest sequence (for equal lengths this is
        # the same work as varlen). Its rows are the packed ones placed at the start of each slot.
        padded = [torch.zeros(batch, longest, HEADS, HEAD_DIM, device="cuda", dtype=args.dtype) for _ in range(3)]
        for b, (s, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
            for dst, src in zip(padded, (q, k, v)):
                dst[b, :n] = src[s:s + n]
        name = "dense_same_work" if kind == "equal" else "dense_padded"
        measure(row, name, ready(lambda: flashkernel.flash_attn_func(*padded, causal=True)),
                lambda out: check_dense(out, *padded, causal=True), row["flops"], args)
        if not args.skip_flex:
            doc_ids = torch.repeat_interleave(torch.arange(batch, device="cuda"),
                                              torch.tensor(lengths, device="cuda"))
            # One key for the three length sets: same shapes and mask code, only the captured
            # document ids differ, so dynamo may reuse the compiled kernel (still compiled; an
            # eager fallback raises: recompile limits fail loudly and fullgraph forbids breaks).
            build = flex_builder(("varlen", TOTAL_TOKENS), q[None], k[None], v[None],
                                 mask_mod=document_mask_mod_for(doc_ids))
            measure(row, "flex", build, lambda out, lengths=lengths: check_packed(out[0], q, k, v, lengths, causal=True),
                    row["flops"], args)
        for fa_name, module in fa.items():
            call = lambda m=module: first(m.flash_attn_varlen_func(  # noqa: E731
                q, k, v, cu, cu, longest, longest, causal=True))
            measure(row, fa_name, ready(call), check, row["flops"], args)
        rows.append(row)
        del q, k, v, padded
        torch.cuda.empty_cache()
    return rows


# ---- plain path A/B against the build before the variants ----------------------------------------


def load_module(path: str, name: str):
    """Load a kernel module file as ``flashkernel.kernels.<name>`` (its relative imports work)."""
    spec = importlib.util.spec_from_file_location(f"flashkernel.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "flashkernel.kernels"
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def alternate(fns: dict, rounds: int, timer) -> dict:
    """Median per name of ``rounds`` alternating measurements (drift hits both alike)."""
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(timer(fn))
    return {name: sorted(values)[len(values) // 2] for name, values in samples.items()}


def case_plain_ab(args) -> list[dict]:
    from flashkernel.kernels import decode, prefill

    rows = []
    if args.before_prefill:
        before = load_module(args.before_prefill, "_before_prefill")
        for head_dim, seqlen in AB_PREFILL:
            for causal in (False, True):
                batch, heads = TOTAL_TOKENS // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=args.dtype)
                           for _ in range(3))
                out = torch.empty_like(q)
                fns = {name: (lambda m=module: m.attention_forward(q, k, v, out, None, causal=causal,
                                                                   softmax_scale=head_dim ** -0.5))
                       for name, module in (("after", prefill), ("before", before))}
                ms = alternate(fns, args.ab_rounds, lambda fn: time_ms(fn)["ms"])
                row = {"case": "plain-ab", "kernel": "prefill",
                       "shape": f"d{head_dim} {batch}x{seqlen} {'causal' if causal else 'full'}",
                       "after_ms": ms["after"], "before_ms": ms["before"],
                       "after_over_before": ms["after"] / ms["before"]}
                rows.append(row)
                print(format_ab(row), flush=True)
    if args.before_decode:
        before = load_module(args.before_decode, "_before_decode")
        for batch, context, page in AB_DECODE:
            q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=args.dtype)
            if page:
                blocks = batch * context // page
                k_cache = torch.randn(blocks, page, 8, 128, device="cuda", dtype=args.dtype)
                table = torch.randperm(blocks, device="cuda").view(batch, -1).to(torch.int32)
            else:
                k_cache = torch.randn(batch, context, 8, 128, device="cuda", dtype=args.dtype)
                table = None
            v_cache = torch.randn_like(k_cache)
            seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            fns = {name: (lambda m=module: m.decode_forward(q, k_cache, v_cache, seqlens, table, out, None,
                                                            causal=True, softmax_scale=128 ** -0.5))
                   for name, module in (("after", decode), ("before", before))}
            eager = alternate(fns, args.ab_rounds, lambda fn: time_ms(fn)["ms"])
            graph = alternate(fns, args.ab_rounds, graph_ms)
            row = {"case": "plain-ab", "kernel": "decode",
                   "shape": f"B{batch} ctx{context} {'paged' + str(page) if page else 'contiguous'}",
                   "after_ms": eager["after"], "before_ms": eager["before"],
                   "after_over_before": eager["after"] / eager["before"],
                   "graph_after_ms": graph["after"], "graph_before_ms": graph["before"],
                   "graph_after_over_before": graph["after"] / graph["before"]}
            rows.append(row)
            print(format_ab(row), flush=True)
    return rows


# ---- output --------------------------------------------------------------------------------------


def format_ab(row) -> str:
    text = (f"plain-ab {row['kernel']:7s} {row['shape']:28s} after {row['after_ms'] * 1e3:9.1f} us  "
            f"before {row['before_ms'] * 1e3:9.1f} us  after/before {row['after_over_before']:.3f}")
    if "graph_after_ms" in row:
        text += (f" | graph after {row['graph_after_ms'] * 1e3:8.1f} us before "
                 f"{row['graph_before_ms'] * 1e3:8.1f} us ratio {row['graph_after_over_before']:.3f}")
    return text


def format_row(row) -> str:
    cells = [f"{row['case']:7s} {row['shape']:42s}"]
    for name, r in row.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            cells.append(f"{name}: ERR")
        else:
            cells.append(f"{name}: {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s err {r['max_err']:.1e}")
    return " | ".join(cells)


def summary(rows) -> list[str]:
    """The ratios the issue asks about."""
    lines = []
    by_shape = {(r["case"], r["shape"]): r for r in rows if "shape" in r}

    def ms(case, prefix, name):
        for (c, shape), r in by_shape.items():
            if c == case and shape.startswith(prefix) and "ms" in r.get(name, {}):
                return r[name]["ms"]
        return None

    full = ms("window", f"1x{WINDOW_SEQLEN} causal", "flashkernel")
    window = ms("window", f"1x{WINDOW_SEQLEN} window", "flashkernel")
    if full and window:
        ratio = causal_pairs(WINDOW_SEQLEN, WINDOW) / causal_pairs(WINDOW_SEQLEN)
        lines.append(f"window {WINDOW} / full causal time: {window / full:.3f} (visible pairs ratio {ratio:.3f})")
    plain = ms("mods", f"{MODS_BATCH}x{MODS_SEQLEN} causal plain", "flashkernel")
    for label in (f"softcap{SOFTCAP:g}", "alibi", "sinks", "softcap+alibi+sinks"):
        t = ms("mods", f"{MODS_BATCH}x{MODS_SEQLEN} causal {label}", "flashkernel")
        if plain and t:
            lines.append(f"{label} / plain time: {t / plain:.3f}")
    for r in rows:
        if r.get("case") != "varlen":
            continue
        fk = r.get("flashkernel", {}).get("ms")
        for name in ("dense_same_work", "dense_padded", "flex", "fa2", "fa3"):
            other = r.get(name, {}).get("ms")
            if fk and other:
                lines.append(f"varlen {r['shape'].split(':')[0]}: flashkernel / {name} time {fk / other:.3f}")
    for r in rows:
        if r.get("case") in ("window", "mods"):
            fk = r.get("flashkernel", {}).get("ms")
            for name in ("flex", "fa2", "fa3"):
                other = r.get(name, {}).get("ms")
                if fk and other:
                    lines.append(f"{r['shape']}: flashkernel / {name} time {fk / other:.3f}")
    return lines


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "git_commit": git_commit(Path(__file__).resolve().parent),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--skip-flex", action="store_true", help="leave FlexAttention out (its compiles take time)")
    parser.add_argument("--before-prefill", help="kernels/prefill.py of the build to compare the plain path with")
    parser.add_argument("--before-decode", help="kernels/decode.py of the build to compare the plain path with")
    parser.add_argument("--ab-rounds", type=int, default=3)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    started = time.time()
    rows = []
    runners = {"window": case_window, "mods": case_mods, "varlen": case_varlen, "plain-ab": case_plain_ab}
    for case in args.cases:
        if case == "plain-ab" and not (args.before_prefill or args.before_decode):
            continue
        t0 = time.time()
        case_rows = runners[case](args)
        for row in case_rows:
            if row["case"] != "plain-ab":
                print(format_row(row), flush=True)
        print(f"[{case}: {time.time() - t0:.0f} s]", flush=True)
        rows += case_rows
    lines = summary(rows)
    print("\n".join(lines))
    print(f"[total {time.time() - started:.0f} s]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "rows": rows, "summary": lines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
