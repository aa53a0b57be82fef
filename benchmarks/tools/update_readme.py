"""Regenerate the README's performance section from committed result files.

    PYTHONPATH=src python benchmarks/tools/update_readme.py benchmarks/results/h200

Replaces what stands between ``<!-- results:start -->`` and ``<!-- results:end -->`` with the
output of ``flashkernel report DIR --markdown``, and between ``<!-- callcost:start -->`` /
``<!-- training:start -->`` and their ends with tables made here from ``overhead.json``
(``flashkernel bench overhead``), ``backward.json`` (``flashkernel bench backward``) and
``../h200x2/context_parallel.json`` (``torchrun ... -m flashkernel.bench.context_parallel``), and
between ``<!-- e2e:start -->`` and its end with the tables of ``e2e.json`` (``flashkernel bench
e2e``), and between ``<!-- kvquant:start -->`` / ``<!-- kvquant-accuracy:start -->`` and their ends
with the quantized-cache tables of ``kvquant.json`` (``flashkernel bench kvquant``); the tables
are never typed by hand.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"README.md has no {start} ... {end} section")
    return re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{body}\n{end}", text, flags=re.S)


def call_cost_table(results: Path) -> str:
    """Decode and prefill call cost from ``overhead.json`` (and the build before the op layer from
    ``overhead-before-*.json`` when present): eager wall and host time per call against cuDNN."""
    rows = json.loads((results / "overhead.json").read_text())["rows"]
    before = {}
    for path in results.glob("overhead-before-*.json"):
        for r in json.loads(path.read_text())["rows"]:
            if r["provider"] == "flashkernel":
                before[(r["workload"], r.get("batch"), r.get("context"), r.get("page_size"), r.get("head_dim"),
                        r.get("seqlen"), r.get("causal"))] = r

    def key(r):
        return (r["workload"], r.get("batch"), r.get("context"), r.get("page_size"), r.get("head_dim"), r.get("seqlen"),
                r.get("causal"))

    by = {(r["provider"], key(r)): r for r in rows if r["workload"] != "compiled"}
    lines = ["Decode step (32 query / 8 KV heads, head dim 128, one new token), microseconds per call: eager "
             "wall time of back-to-back calls / host time; GPU time from CUDA-graph replays.", "",
             "| batch | context | cache | flashkernel wall / host | plan.run wall / host | before: wall / host | "
             "cuDNN wall / host | GPU flashkernel / cuDNN |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["workload"] != "decode" or r["provider"] != "flashkernel":
            continue
        k = key(r)
        plan = by.get(("flashkernel_plan_run", k))
        cudnn = by.get(("sdpa_cudnn", ("decode", k[1], k[2], 0, None, None, None)))
        old = before.get(k)
        cell = lambda x: "-" if x is None else f"{x['wall_us']:.1f} / {x['host_us']:.1f}"  # noqa: E731
        lines.append(f"| {k[1]} | {k[2]} | {'pages of ' + str(k[3]) if k[3] else 'contiguous'} | {cell(r)} | "
                     f"{cell(plan)} | {cell(old)} | {cell(cudnn)} | {r['gpu_us']:.1f} / {cudnn['gpu_us']:.1f} |")
    prefill = [(r, by.get(("sdpa_cudnn", key(r)))) for r in rows if r["workload"] == "prefill"
               and r["provider"] == "flashkernel"]
    ratios = [r["wall_us"] / c["wall_us"] for r, c in prefill if c]
    hosts = [r["host_us"] for r, _ in prefill]
    old_hosts = [before[key(r)]["host_us"] for r, _ in prefill if key(r) in before]
    lines += ["", f"Prefill (16k tokens per batch, model dim 2048, seqlen 512 to 2048, head dim 64/128/256, causal "
              f"or not, {len(prefill)} shapes): eager wall time {min(ratios):.2f}x to {max(ratios):.2f}x of cuDNN's; "
              f"host time {min(hosts):.0f} to {max(hosts):.0f} us per call"
              + (f" (before: {min(old_hosts):.0f} to {max(old_hosts):.0f})." if old_hosts else ".")]
    short = [(r, by.get(("sdpa_cudnn", key(r)))) for r in rows if r["workload"] == "prefill-short"
             and r["provider"] == "flashkernel"]
    if short:
        cells = [f"seqlen {r['seqlen']}: {r['wall_us']:.1f} / {r['host_us']:.1f} us against cuDNN's "
                 f"{c['wall_us']:.1f} / {c['host_us']:.1f}" for r, c in short if c]
        lines += ["", "Short prompts (batch 1, 32 query / 8 KV heads of 128, causal: host-bound), eager wall / host "
                  "time per call: " + "; ".join(cells) + "."]
    compiled = [r for r in rows if r["workload"] == "compiled" and "step_us" in r]
    if compiled:
        sdpa = any(r["provider"].startswith("sdpa_") for r in compiled)
        lines += ["", "A 32-layer attention-only decode loop (append + attend per layer, context 1k), time per step"
                  + (" (SDPA: the same loop over a static cache as transformers runs it, the new token written in "
                     "place and a key-padding mask over the whole cache; SDPA's own backend choice):" if sdpa
                     else ":"),
                  "", "| batch | | eager | torch.compile | torch.compile reduce-overhead |",
                  "| ---: | --- | ---: | ---: | ---: |"]
        for batch in sorted({r["batch"] for r in compiled}):
            step = {r["provider"]: r["step_us"] for r in compiled if r["batch"] == batch}
            for name in ("flashkernel", "sdpa") if sdpa else ("flashkernel",):
                lines.append(f"| {batch} | {name} | "
                             + " | ".join(f"{step[f'{name}_{mode}'] / 1e3:.2f} ms" if f"{name}_{mode}" in step
                                          else "failed" for mode in ("eager", "compiled", "reduce-overhead")) + " |")
    return "\n".join(lines)


def _against_sdpa(rows: list[dict]) -> list[str]:
    """Table lines: TFLOP/s of flashkernel and SDPA's FA2 and cuDNN backends per shape (and of
    flashkernel's Triton kernels forced, when the rows have them)."""
    triton = any("flashkernel-triton_tflops" in r for r in rows)
    lines = ["| head dim | mask | seqlen | flashkernel |" + (" its Triton kernels |" if triton else "")
             + " SDPA FA2 | SDPA cuDNN | vs FA2 | vs cuDNN |",
             "| ---: | --- | ---: | ---: |" + (" ---: |" if triton else "") + " ---: | ---: | ---: | ---: |"]
    def cell(r, key, form):
        return form.format(r[key]) if key in r else "-"

    for r in rows:
        ours = cell(r, 'flashkernel_tflops', '{:.0f}')
        if r.get("flashkernel_backend") == "gluon":
            ours += " (Gluon)"
        lines.append(f"| {r['head_dim']} | {'causal' if r['causal'] else 'none'} | {r['seqlen']} | {ours} | "
                     + (f"{cell(r, 'flashkernel-triton_tflops', '{:.0f}')} | " if triton else "")
                     + f"{cell(r, 'sdpa-flash_tflops', '{:.0f}')} | "
                     f"{cell(r, 'sdpa-cudnn_tflops', '{:.0f}')} | {cell(r, 'vs_sdpa-flash', '{:.2f}x')} | "
                     f"{cell(r, 'vs_sdpa-cudnn', '{:.2f}x')} |")
    return lines


def training_table(results: Path) -> str:
    """Backward TFLOP/s against SDPA's FA2 and cuDNN (``backward.json``), and ring attention on
    two GPUs (``../h200x2/context_parallel.json``) when present."""
    doc = json.loads((results / "backward.json").read_text())
    lines = ["Backward (bf16, 16k tokens per batch, model dim 2048; FLOPs = 2.5 x forward), TFLOP/s:", "",
             *_against_sdpa(doc["rows"])]
    if doc.get("layer"):
        lines += ["", "A training step's attention: one layer's forward + backward through autograd (same shapes; FLOPs = "
                  "3.5 x forward), TFLOP/s:", "", *_against_sdpa(doc["layer"])]
    if doc.get("model"):
        lines += ["", "Training steps (forward + backward, no optimizer) of a random-weight Llama-3-8B-shaped model, "
                  "4 layers, bf16, median of 5 alternating rounds, ms per step (flashkernel's speedup):", "",
                  "| batch x seqlen | flashkernel | sdpa (its choice) | sdpa, FA2 forced | sdpa, cuDNN forced |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for r in doc["model"]:
            cell = lambda name: f"{r[name + '_ms']:.0f} ({r['vs_' + name]:.2f}x)" if "vs_" + name in r else "-"  # noqa: E731
            ours = f"{r['flashkernel_ms']:.0f}" if "flashkernel_ms" in r else "-"
            lines.append(f"| {r['batch']} x {r['seqlen']} | {ours} | {cell('sdpa')} | "
                         f"{cell('sdpa-flash')} | {cell('sdpa-cudnn')} |")
    cp = results.parent / "h200x2" / "context_parallel.json"
    if cp.exists():
        cp_rows = json.loads(cp.read_text())["rows"]
        lines += ["", "Ring attention, causal prefill on 2 H200s (bf16, 32 heads x 128), milliseconds (x 1 GPU):", "",
                  "| tokens | flashkernel 1 GPU | flashkernel ring, 2 GPUs | PyTorch context_parallel (cuDNN), 2 GPUs |",
                  "| ---: | ---: | ---: | ---: |"]
        for seqlen in sorted({r["seqlen"] for r in cp_rows}):
            got = {r["provider"]: r for r in cp_rows if r["seqlen"] == seqlen and r.get("status") == "ok"}
            cell = lambda name: (f"{got[name]['median_ms']:.0f} ({got[name]['speedup_vs_1gpu']:.2f}x)"  # noqa: E731
                                 if name in got else "-")
            lines.append(f"| {seqlen // 1024}k | {cell('flashkernel-1gpu')} | {cell('flashkernel-ring')} | "
                         f"{cell('torch-cp-cudnn-allgather')} |")
    return "\n".join(lines)


def e2e_table(results: Path) -> str:
    """The tables of ``flashkernel bench e2e`` (``e2e.json``), as the benchmark prints them."""
    from flashkernel.bench import e2e

    doc = json.loads((results / "e2e.json").read_text())
    env = doc["environment"]
    runs = env.get("runs") or [{"commit": env["git_commit"][:7], "command": env["command"], "rows": "all rows"}]
    made = "; ".join(f"{run['rows']}: `{run['command']}` at {run['commit']}" for run in runs)
    return f"{made} (torch {env['torch']}, {env['timestamp'][:10]})\n\n{e2e.table(doc['rows'], markdown=True)}"


KVQUANT_COLUMNS = (("bf16", None), ("fp8", "tensor"), ("fp8", "token"), ("int8", "tensor"), ("int8", "token"))


def kvquant_table(results: Path) -> str:
    """Decode steps over bf16 / fp8 / int8 caches (``kvquant.json``, Triton kernel, graph replays)."""
    doc = json.loads((results / "kvquant.json").read_text())
    rows = [r for r in doc["rows"] if r["section"] == "perf" and r["provider"] == "triton"]
    by = {(r["layout"], r["batch"], r["context"], r["format"], r["granularity"]): r for r in rows}
    lines = [f"One decode step (32 query / 8 KV heads, head dim 128, bf16 queries, no append), CUDA-graph "
             f"replays: microseconds (time over the bf16 cache's, fraction of the {doc['read_gbps']:.0f} GB/s "
             "read bandwidth measured in the same run, on the bytes actually read):", "",
             "| batch | context | cache | " + " | ".join(f"{f}" + (f" per {g}" if g else "") for f, g in KVQUANT_COLUMNS)
             + " |", "| ---: | ---: | --- |" + " ---: |" * len(KVQUANT_COLUMNS)]
    for layout, batch, context in sorted({(r["layout"], r["batch"], r["context"]) for r in rows},
                                         key=lambda k: (k[0], k[1], k[2])):
        cells = []
        for fmt, granularity in KVQUANT_COLUMNS:
            r = by.get((layout, batch, context, fmt, granularity))
            cells.append("-" if r is None else f"{r['graph_us']:.1f} ({r['graph_ratio_vs_bf16']:.2f}x, "
                                               f"{r['fraction_of_read']:.0%})")
        lines.append(f"| {batch} | {context} | {layout} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kvquant_accuracy_table(results: Path) -> str:
    from flashkernel.bench.kvquant import accuracy_markdown

    rows = [r for r in json.loads((results / "kvquant.json").read_text())["rows"] if r["section"] == "accuracy"]
    return accuracy_markdown(rows)


def main(results_dir: str) -> int:
    report = subprocess.run(
        [sys.executable, "-m", "flashkernel.cli", "report", results_dir, "--markdown"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    readme = Path(__file__).resolve().parents[2] / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} section")
    body = f"{START}\n{report}\n{END}"
    text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: body, text, flags=re.S)
    results = Path(results_dir)
    if (results / "overhead.json").exists():
        text = _replace(text, "callcost", call_cost_table(results))
    if (results / "backward.json").exists():
        text = _replace(text, "training", training_table(results))
    if (results / "e2e.json").exists():
        text = _replace(text, "e2e", e2e_table(results))
    if (results / "kvquant.json").exists():
        text = _replace(text, "kvquant", kvquant_table(results))
        text = _replace(text, "kvquant-accuracy", kvquant_accuracy_table(results))
    readme.write_text(text)
    print(f"updated {readme} from {results_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/h200"))
