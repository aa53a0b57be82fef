"""The ``flashkernel`` command line: info, check, bench, profile, plot, report, merge.

    flashkernel info                       GPU facts and measured ceilings (cached)
    flashkernel check [--quick]            every public function vs the float64 reference
    flashkernel bench prefill|decode|all   side-by-side benchmark, result files and plots
    flashkernel bench variants|overhead    variants vs FlexAttention; call cost vs cuDNN
    flashkernel bench e2e [--quick]        transformers models on flashkernel vs sdpa (tokens/s)
    flashkernel bench kvquant              decode over bf16 / fp8 / int8 caches; each format's error
    flashkernel bench backward [--quick]   gradients and training steps vs SDPA's flash and cuDNN backends
    flashkernel profile [shape options]    one configuration under Nsight Compute
    flashkernel plot DIR                   re-draw the plots from the result files in DIR
    flashkernel report DIR [--markdown]    print their tables (Markdown for the README)
    flashkernel merge DIR... --out DIR     merge the results of a sweep split over several runs

Without a CUDA device the kernels run in Triton's CPU interpreter. ``TRITON_INTERPRET=1`` must
be set before any kernel module is imported, so this module imports no kernel (nor
``flashkernel.interface``) at the top; every command imports what it needs after
:func:`select_device` has run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

WORKLOADS = ("prefill", "decode")
DTYPES = ("bfloat16", "float16", "float32")
INTERPRETER_NOTE = (
    "No CUDA device: running flashkernel's kernels in Triton's CPU interpreter (TRITON_INTERPRET=1) "
    "with small shapes. Results test correctness and the tooling, not speed."
)


# --- device selection --------------------------------------------------------------------------


def select_device() -> str:
    """``"cuda"`` when torch sees a GPU; otherwise switch Triton to its CPU interpreter, ``"cpu"``."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    # The interpreter evaluates both sides of tl.where with numpy: harmless inf / nan warnings.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    if "flashkernel.interface" in sys.modules:
        from flashkernel.interface import kernels_interpreted

        if not kernels_interpreted():
            raise SystemExit(
                "flashkernel's kernels were built before TRITON_INTERPRET=1 could be set and there is no "
                "CUDA device; run the command in a fresh process (or set TRITON_INTERPRET=1 first)"
            )
    return "cpu"


# --- info --------------------------------------------------------------------------------------


def cmd_info(args, argv, device, parser) -> int:
    from .bench import ceilings

    facts = ceilings.device_facts() if device == "cuda" else None
    measured = None
    if device == "cuda" and not args.no_measure:
        measured = ceilings.ceilings(refresh=args.refresh)
    for line in ceilings.info_lines(device, measured, facts):
        print(line)
    if args.json:
        print(json.dumps({"versions": ceilings.versions(), "device": facts, "ceilings": measured}, indent=1))
    return 0


# --- check -------------------------------------------------------------------------------------


def cmd_check(args, argv, device, parser) -> int:
    from .bench import check
    from .bench.progress import ProgressLine

    if device != "cuda":
        print(INTERPRETER_NOTE)
    random_count = args.random if args.random is not None else (16 if device == "cuda" else 3)
    plan_size = len(check.planned_checks(device, args.quick, random_count, args.seed))
    progress = ProgressLine(plan_size, enabled=not args.no_progress)
    rows = check.run_checks(device, quick=args.quick, random_count=random_count, seed=args.seed, progress=progress)
    progress.close()
    print(check.check_table(rows))
    for line in check.failure_lines(rows):
        print(line)
    unchecked = check.unchecked_public_names()
    if unchecked:
        print(f"public names without a check: {', '.join(unchecked)}")
    failed = sum(not r.ok for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed "
          f"(rule: max error <= 2 x PyTorch's same-dtype error + eps * max|truth|)")
    return 1 if failed or not rows else 0


# --- bench -------------------------------------------------------------------------------------


def sweep_spec(args, device):
    from .bench.suites import DECODE_MAX_TOKENS, SweepSpec

    return SweepSpec(
        quick=args.quick, cpu=device != "cuda", dtypes=tuple(args.dtypes), head_dims=args.head_dims,
        heads=args.heads, kv_heads=args.kv_heads, batches=args.batches, seqlens=args.seqlens,
        seqlen_k=args.seqlen_k, causal=args.causal, tokens=args.tokens, model_dim=args.model_dim,
        contexts=args.contexts, max_tokens=args.max_tokens or DECODE_MAX_TOKENS, page_size=args.page_size,
    )


def measure_settings(args):
    from .bench.measure import Settings

    warmup = args.warmup_ms if args.warmup_ms is not None else (50.0 if args.quick else 200.0)
    rep = args.rep_ms if args.rep_ms is not None else (20.0 if args.quick else 40.0)
    return Settings(warmup_ms=warmup, rep_ms=rep, cpu_reps=2 if args.quick else 3)


def default_out_dir(device: str) -> Path:
    from .bench.results import gpu_slug

    if device != "cuda":
        return Path("flashkernel-results") / "cpu-interpreter"
    import torch

    return Path("flashkernel-results") / gpu_slug(torch.cuda.get_device_name())


def bench_ceilings(args, device):
    if device != "cuda" or args.no_ceilings:
        return None
    from .bench import ceilings

    return ceilings.ceilings()


def list_providers(workloads, device) -> int:
    from .bench.providers import availability
    from .bench.registry import providers_for
    from .bench.results import format_table

    for workload in workloads:
        body = []
        for provider in providers_for(workload):
            a = availability(provider, device)
            body.append([a.name, "yes" if a.available else "no", a.summary if a.available else a.reason])
        print(f"{workload} providers on {device}:")
        print(format_table(["provider", "available", "calls / reason"], body))
    return 0


def check_provider_names(parser, args) -> None:
    from .bench.registry import all_provider_names

    known = all_provider_names()
    for name in (args.providers or []) + (args.skip_providers or []):
        if name not in known:
            parser.error(f"unknown provider {name!r}; known providers: {', '.join(known)}")


def run_workload(workload, args, argv, device, out_dir, ceiling) -> dict:
    from .bench import results
    from .bench.registry import providers_for, select
    from .bench.runner import RunConfig, run_suite
    from .bench.suites import cases_for

    spec = sweep_spec(args, device)
    config = RunConfig(device=device, settings=measure_settings(args),
                       check_window=128 if device == "cuda" else None, ceilings=ceiling,
                       model_layers=args.model_layers, seed=args.seed)
    providers = select(providers_for(workload), args.providers, args.skip_providers)
    cases = cases_for(workload, spec)
    suite = run_suite(workload, cases, providers, config, progress=not args.no_progress)
    settings = {"measure": vars(config.settings), "check_window": config.check_window,
                "model_layers": config.model_layers, "seed": config.seed, "cases": len(cases)}
    doc = results.document(workload, results.environment(argv, device), ceiling, settings, suite.availability,
                           suite.rows)
    previous = out_dir / f"{workload}.json"
    if args.append and previous.exists():
        doc = results.merge(results.load(previous), doc)
    print(results.report(doc))
    for path in results.write_results(out_dir, doc):
        print(f"wrote {path}")
    return doc


def write_plots(docs, out_dir) -> None:
    from .bench import plots

    try:
        for path in plots.plot_all(docs, out_dir):
            print(f"wrote {path}")
    except plots.PlottingUnavailable as exc:
        print(f"no plots: {exc}")


def flashkernel_failed(docs) -> bool:
    """True when one of flashkernel's own rows is wrong: the run cannot stand as evidence."""
    return any(r["provider"].startswith("flashkernel") and r.get("status") == "wrong"
               for doc in docs for r in doc["rows"])


def cmd_bench_variants(args, device) -> int:
    """``bench variants``: sliding window, softcap, ALiBi, sinks and packed sequences against
    FlexAttention (and FlashAttention when importable), in ``bench/variants.py``."""
    if device != "cuda":
        print("the variants benchmark needs a CUDA GPU (it times compiled FlexAttention beside "
              "flashkernel); on this machine run `flashkernel check`, which covers the variants' "
              "correctness in Triton's interpreter")
        return 2
    from .bench import variants

    out_dir = Path(args.out) if args.out else default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = ["--out", str(out_dir / "variants.json")]
    if "flex" in (args.skip_providers or []):
        argv.append("--skip-flex")
    return variants.main(argv)


def cmd_bench_overhead(args, device) -> int:
    """``bench overhead``: host and GPU time per call against cuDNN's, plan/run, a compiled
    decode loop (``bench/overhead.py``)."""
    if device != "cuda":
        print("the call-cost benchmark needs a CUDA GPU (it times launches and CUDA graphs)")
        return 2
    from .bench import overhead

    out_dir = Path(args.out) if args.out else default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    return overhead.main(["--out", str(out_dir / "overhead.json"), *_sections(args)])


def cmd_bench_e2e(args, device) -> int:
    """``bench e2e``: Hugging Face transformers models on flashkernel against transformers' own
    attention (``bench/e2e.py``)."""
    if device != "cuda":
        print("the end-to-end benchmark needs a CUDA GPU; on this machine the CPU tests "
              "(tests/test_transformers.py) check the transformers integration in Triton's interpreter")
        return 2
    from .bench import e2e

    out_dir = Path(args.out) if args.out else default_out_dir(device)
    argv = ["--out", str(out_dir)]
    argv += ["--quick"] if args.quick else []
    argv += ["--no-progress"] if args.no_progress else []
    argv += ["--no-plots"] if args.no_plots else []
    argv += ["--append"] if args.append else []
    return e2e.main(argv + _sections(args))


def cmd_bench_kvquant(args, device) -> int:
    """``bench kvquant``: decode steps over bf16 / float8_e4m3fn / int8 caches and each format's
    error against a bf16 cache (``bench/kvquant.py``; without a GPU, the error only)."""
    from .bench import kvquant

    out_dir = Path(args.out) if args.out else default_out_dir(device)
    argv = ["--out", str(out_dir)]
    if args.quick:
        argv.append("--quick")
    if args.sections:
        argv += _sections(args)
    elif device != "cuda":
        print("no CUDA device: only the accuracy section (float64 reference, no kernel) runs here")
        argv += ["--sections", "accuracy"]
    return kvquant.main(argv)


def cmd_bench_backward(args, device) -> int:
    """``bench backward``: the backward kernels, per-kernel GPU time, one layer's forward +
    backward and a small model's training steps against SDPA's backends (``bench/backward.py``,
    ``bench/training.py``; its own shapes: the shape options do not apply, ``python -m
    flashkernel.bench.backward --help`` takes head dims, lengths and masks)."""
    if device != "cuda":
        print("the backward benchmark needs a CUDA GPU (it times kernels against SDPA's GPU backends)")
        return 2
    from .bench import backward

    out_dir = Path(args.out) if args.out else default_out_dir(device)
    argv = ["--out", str(out_dir / "backward.json"), "--plot", "--sections"]
    if args.quick:  # no model section: its training steps are most of the run
        argv += [*(args.sections or (s for s in backward.SECTIONS if s != "model")), "--seqlens", "1024", "4096",
                 "--rep-ms", "100"]
    else:
        argv += args.sections or backward.SECTIONS
    return backward.main(argv)


# The benchmarks whose own command lines take --sections (each checks the names it is given), and
# those of them that write their one results file anew (no --append).
SECTIONED = ("overhead", "e2e", "kvquant", "backward")
REWRITTEN = ("overhead", "kvquant", "backward")


def _sections(args) -> list[str]:
    """``--sections`` and the names given, for a benchmark's own command line; none when not given."""
    return ["--sections", *args.sections] if args.sections else []


def cmd_bench(args, argv, device, parser) -> int:
    if args.sections and args.workload not in SECTIONED:
        parser.error(f"--sections applies to bench {', '.join(SECTIONED)} (each benchmark's own sections), not to "
                     f"bench {args.workload}")
    if args.append and args.workload in REWRITTEN:
        parser.error(f"--append merges prefill, decode and e2e results; bench {args.workload} writes its own file "
                     "anew: pass another --out to keep an earlier run's")
    if args.workload == "e2e":
        return cmd_bench_e2e(args, device)
    if args.workload == "variants":
        return cmd_bench_variants(args, device)
    if args.workload == "kvquant":
        return cmd_bench_kvquant(args, device)
    if args.workload == "overhead":
        return cmd_bench_overhead(args, device)
    if args.workload == "backward":
        return cmd_bench_backward(args, device)
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    if args.list_providers:
        return list_providers(workloads, device)
    check_provider_names(parser, args)
    if device != "cuda":
        print(INTERPRETER_NOTE + " Every time below is CPU-interpreter time.")
    out_dir = Path(args.out) if args.out else default_out_dir(device)
    ceiling = bench_ceilings(args, device)
    if ceiling:
        print(f"measured ceilings: copy {ceiling['copy_gbps']:.0f} GB/s, bf16 matmul {ceiling['matmul_tflops']:.0f} "
              f"TFLOP/s ({ceiling.get('source', '')})")
    docs = [run_workload(w, args, argv, device, out_dir, ceiling) for w in workloads]
    if not args.no_plots:
        write_plots(docs, out_dir)
    if flashkernel_failed(docs):
        print("flashkernel's own output was WRONG in this run (see above)")
        return 1
    return 0


# --- profile -----------------------------------------------------------------------------------


def profile_case(args):
    from .bench.suites import DecodeCase, PrefillCase

    if args.workload == "decode":
        return DecodeCase(args.batch, args.context, args.heads or 32, args.kv_heads or 8, args.head_dim,
                          args.dtype, page_size=args.page_size)
    heads = args.heads or 16
    return PrefillCase(args.batch, args.seqlen, args.seqlen_k or args.seqlen, heads, args.kv_heads or heads,
                       args.head_dim, args.causal, args.dtype)


def profile_inner_argv(args) -> list[str]:
    """The same configuration as options, for the process that runs under ncu."""
    argv = ["--workload", args.workload, "--provider", args.provider, "--batch", str(args.batch),
            "--seqlen", str(args.seqlen), "--context", str(args.context), "--head-dim", str(args.head_dim),
            "--dtype", args.dtype, "--page-size", str(args.page_size)]
    for flag, value in (("--seqlen-k", args.seqlen_k), ("--heads", args.heads), ("--kv-heads", args.kv_heads)):
        if value:
            argv += [flag, str(value)]
    return argv + (["--causal"] if args.causal else [])


def cmd_profile(args, argv, device, parser) -> int:
    from .bench import profile

    case = profile_case(args)
    if args.inner:
        profile.run_profiled(profile.prepared_call(args.workload, case, args.provider, device))
        return 0
    ncu = profile.find_ncu(args.ncu)
    if ncu is None:
        print(profile.ncu_missing_message(args.ncu))
    if device != "cuda":
        print("flashkernel profile needs a CUDA GPU; none is visible to torch, so nothing was profiled.")
        return 1
    print(f"profiling {args.provider} on {args.workload} {case.label()}")
    prepared = profile.prepared_call(args.workload, case, args.provider, device)
    profile.run_profiled(prepared, warmup=1)
    print(profile.triton_report(profile.compiled_kernels(profile.jit_functions())))
    if ncu is None:
        return 1
    kernels, raw = profile.run_under_ncu(ncu, profile_inner_argv(args))
    if not kernels:
        print("ncu reported no kernel; its output:\n" + raw)
        return 1
    print(f"Nsight Compute ({ncu} --clock-control none), one call:")
    print(profile.kernel_table(kernels))
    return 0


# --- plot --------------------------------------------------------------------------------------


def cmd_plot(args, argv, device, parser) -> int:
    from .bench import plots, results

    files = results.result_files(Path(args.directory))
    if not files:
        print(f"no prefill.json / decode.json in {args.directory}")
        return 1
    docs = [results.load(f) for f in files]
    try:
        for path in plots.plot_all(docs, Path(args.out or args.directory)):
            print(f"wrote {path}")
    except plots.PlottingUnavailable as exc:
        print(exc)
        return 1
    return 0


def cmd_report(args, argv, device, parser) -> int:
    from .bench import results

    files = results.result_files(Path(args.directory))
    if not files:
        print(f"no prefill.json / decode.json in {args.directory}")
        return 1
    print("\n\n".join(results.report(results.load(f), markdown=args.markdown) for f in files))
    return 0


def cmd_merge(args, argv, device, parser) -> int:
    """Fold the result files of several runs (e.g. a sweep split over commands) into one directory."""
    from .bench import results

    out_dir = Path(args.out)
    merged_docs = []
    for workload in WORKLOADS:
        sources = [Path(d) / f"{workload}.json" for d in args.directories]
        docs = [results.load(p) for p in sources if p.exists()]
        if not docs:
            continue
        merged = docs[0]
        for doc in docs[1:]:
            merged = results.merge(merged, doc)
        for path in results.write_results(out_dir, merged):
            print(f"wrote {path}")
        merged_docs.append(merged)
    if not merged_docs:
        print(f"no prefill.json / decode.json in {', '.join(args.directories)}")
        return 1
    if not args.no_plots:
        write_plots(merged_docs, out_dir)
    return 0


# --- parser ------------------------------------------------------------------------------------


def _shape_options() -> argparse.ArgumentParser:
    shapes = argparse.ArgumentParser(add_help=False)
    group = shapes.add_argument_group("shapes (defaults: the workload's standard sweep)")
    group.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=DTYPES, help="input dtypes (bfloat16)")
    group.add_argument("--head-dims", type=int, nargs="+", help="prefill: 64 128 256; decode: 128")
    group.add_argument("--heads", type=int, help="query heads (prefill: model-dim / head-dim; decode: 32)")
    group.add_argument("--kv-heads", type=int, help="key/value heads (prefill: = heads; decode: 8)")
    group.add_argument("--batches", type=int, nargs="+", help="prefill: tokens / seqlen; decode: 1 8 64")
    group.add_argument("--seqlens", type=int, nargs="+", help="prefill sequence lengths (512 .. 16384)")
    group.add_argument("--seqlen-k", type=int, help="prefill key length when it differs from seqlen_q")
    group.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="prefill masks")
    group.add_argument("--tokens", type=int, help="prefill tokens per batch (16384)")
    group.add_argument("--model-dim", type=int, help="prefill model dim, heads = model-dim / head-dim (2048)")
    group.add_argument("--contexts", type=int, nargs="+", help="decode context lengths (1k 4k 32k 128k)")
    group.add_argument("--max-tokens", type=int, help="decode: skip batch * context above this (2M)")
    group.add_argument("--page-size", type=int, help="decode paged-cache page size (256)")
    group.add_argument("--model-layers", type=int, default=32, help="decode steps/s of a model with this many layers")
    return shapes


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", parents=[_shape_options()], help="side-by-side benchmark",
                           description="Benchmark flashkernel against every provider importable here.")
    bench.add_argument("workload", nargs="?", choices=(*WORKLOADS, "variants", "overhead", "e2e", "kvquant", "backward",
                                                     "all"),
                       default="all",
                       help="what to benchmark (default: all = prefill and decode; variants: window, "
                            "softcap, ALiBi, sinks, varlen against FlexAttention; overhead: host and GPU time "
                            "per call against cuDNN; e2e: transformers models, prefill, generate and continuous "
                            "batching against sdpa, see python -m flashkernel.bench.e2e --help; kvquant: decode "
                            "over bf16 / fp8 / int8 caches and each format's error; backward: gradients, per-kernel "
                            "time and training steps against SDPA's flash and cuDNN backends)")
    bench.add_argument("--quick", action="store_true", help="a short sweep")
    bench.add_argument("--providers", nargs="+", help="only these providers (see --list-providers)")
    bench.add_argument("--skip-providers", nargs="+", help="leave these providers out")
    bench.add_argument("--list-providers", action="store_true", help="list providers and their availability")
    bench.add_argument("--out", help="results directory (default flashkernel-results/<gpu>)")
    bench.add_argument("--append", action="store_true",
                       help="merge into existing result files in --out (a sweep split over several commands)")
    bench.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    bench.add_argument("--no-ceilings", action="store_true", help="do not measure / load the GPU's ceilings")
    bench.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    bench.add_argument("--warmup-ms", type=float, help="warm-up per provider and case (200; quick 50): long enough for the GPU clock to recover after a compile pause")
    bench.add_argument("--rep-ms", type=float, help="measuring time per provider and case (40; quick 20)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    bench.add_argument("--sections", nargs="+", metavar="SECTION",
                       help="overhead, e2e, kvquant, backward: only these sections of that benchmark (their names: "
                            "python -m flashkernel.bench.<workload> --help; default: each one's default set). "
                            "overhead, kvquant and backward then write their file with these sections only: "
                            "give another --out to keep a whole run's")
    bench.set_defaults(handler=cmd_bench)


def _add_profile(sub) -> None:
    prof = sub.add_parser("profile", help="one configuration under Nsight Compute",
                          description="Run one configuration under `ncu --clock-control none` and print the "
                                      "counters that matter, plus Triton's resource report.")
    prof.add_argument("--workload", choices=WORKLOADS, default="prefill")
    prof.add_argument("--provider", default="flashkernel")
    prof.add_argument("--batch", type=int, default=4)
    prof.add_argument("--seqlen", type=int, default=4096, help="prefill")
    prof.add_argument("--seqlen-k", type=int, help="prefill, when it differs from --seqlen")
    prof.add_argument("--context", type=int, default=32768, help="decode")
    prof.add_argument("--heads", type=int, help="prefill 16, decode 32")
    prof.add_argument("--kv-heads", type=int, help="prefill = heads, decode 8")
    prof.add_argument("--head-dim", type=int, default=128)
    prof.add_argument("--causal", action="store_true")
    prof.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    prof.add_argument("--page-size", type=int, default=256)
    prof.add_argument("--ncu", help="path of the ncu executable")
    prof.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    prof.set_defaults(handler=cmd_profile)


def build_parser() -> argparse.ArgumentParser:
    usage = __doc__.split("\n\n")[1]
    parser = argparse.ArgumentParser(
        prog="flashkernel", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"flashkernel's command line:\n\n{usage}\n\nWithout a CUDA device, kernels run in Triton's "
                    "CPU interpreter with small shapes (slow; for testing).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{info,check,bench,profile,plot,report,merge}")
    info = sub.add_parser("info", help="GPU facts and measured ceilings")
    info.add_argument("--refresh", action="store_true", help="re-measure the ceilings")
    info.add_argument("--no-measure", action="store_true", help="do not measure or load ceilings")
    info.add_argument("--json", action="store_true", help="also print everything as JSON")
    info.set_defaults(handler=cmd_info)
    check = sub.add_parser("check", help="correctness sweep against the float64 reference")
    check.add_argument("--quick", action="store_true", help="fewer cases")
    check.add_argument("--random", type=int, help="random shapes on top of the fixed ones (GPU 16, CPU 3)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    check.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    check.set_defaults(handler=cmd_check)
    _add_bench(sub)
    _add_profile(sub)
    plot = sub.add_parser("plot", help="draw the plots from result files")
    plot.add_argument("directory", help="directory with prefill.json and/or decode.json")
    plot.add_argument("--out", help="where to write the PNGs (default: the same directory)")
    plot.set_defaults(handler=cmd_plot)
    merge = sub.add_parser("merge", help="merge result directories of split runs into one")
    merge.add_argument("directories", nargs="+", help="result directories, oldest first (later rows win)")
    merge.add_argument("--out", required=True, help="directory for the merged files and plots")
    merge.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    merge.set_defaults(handler=cmd_merge)
    report = sub.add_parser("report", help="print the tables of result files (Markdown for the README)")
    report.add_argument("directory", help="directory with prefill.json and/or decode.json")
    report.add_argument("--markdown", action="store_true", help="print Markdown tables (as the README has them)")
    report.set_defaults(handler=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    device = select_device()
    return args.handler(args, argv, device, parser)


if __name__ == "__main__":
    sys.exit(main())
