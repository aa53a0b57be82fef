"""Result files and readable tables.

Each workload run writes ``<out>/<workload>.json`` (environment, ceilings, formulas, provider
availability and every row) and ``<out>/<workload>.csv`` (the rows, each carrying the GPU name,
versions, git commit, timestamp and exact command). Plots and README tables are made from
these files, never typed by hand.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
from pathlib import Path

from . import formulas

SCHEMA = "flashkernel-bench/1"
ENV_COLUMNS = ("gpu", "torch", "triton", "cuda", "git_commit", "timestamp", "command")
ROW_COLUMNS = (
    "workload", "case", "provider", "status", "dtype", "batch", "seqlen_q", "seqlen_k", "context", "heads",
    "kv_heads", "head_dim", "causal", "page_size", "timer", "median_ms", "p10_ms", "p90_ms", "samples",
    "graph_timer", "graph_median_ms", "graph_p10_ms", "graph_p90_ms", "graph_samples", "flops", "bytes",
    "tflops", "gbps", "graph_tflops", "graph_gbps", "fraction_of_matmul_peak", "fraction_of_bandwidth",
    "flashkernel_speedup", "graph_flashkernel_speedup", "max_err", "torch_err", "err_ratio", "err_bound",
    "peak_extra_mb", "model_layers", "model_bytes_per_step", "model_steps_per_s", "model_steps_bound",
    "seconds", "message", "graph_error",
)
STATUS_MARK = {"wrong": "WRONG", "error": "error", "oom": "OOM"}


# --- environment -------------------------------------------------------------------------------


def git_commit(path: Path) -> str:
    """``HEAD``'s hash of the checkout holding ``path`` (with ``+dirty`` when modified).

    ``FLASHKERNEL_GIT_COMMIT``, when set, wins: the caller knows what it copied (a copy of the
    tree on a remote GPU machine may carry no ``.git``, or a stale one that names an older
    commit). Without it and without git: ''.
    """
    def git(*args):
        return subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, timeout=10)

    fallback = os.environ.get("FLASHKERNEL_GIT_COMMIT", "")
    if fallback:
        return fallback
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return fallback
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return fallback
    return head.stdout.strip() + ("+dirty" if dirty else "")


def environment(argv: list[str], device: str) -> dict:
    """Who ran what where: GPU, versions, commit, UTC timestamp and the exact command."""
    import torch
    import triton

    import flashkernel

    env = {
        "gpu": "cpu (Triton interpreter)" if device != "cuda" else torch.cuda.get_device_name(),
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "flashkernel": flashkernel.__version__,
        "git_commit": git_commit(Path(flashkernel.__file__).resolve().parent),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["flashkernel", *argv]),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(sm_count=props.multi_processor_count, compute_capability=f"{props.major}.{props.minor}")
    return env


def gpu_slug(name: str) -> str:
    """A directory-friendly short name: ``NVIDIA H200`` -> ``h200``."""
    words = [w for w in name.lower().replace("nvidia", "").split() if w]
    slug = "-".join(words) or "unknown"
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in slug)


# --- files -------------------------------------------------------------------------------------


def _clean(value):
    """JSON-safe: NaN / inf become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def document(workload: str, env: dict, ceilings: dict | None, settings: dict, availability, rows) -> dict:
    formulas_text = {"prefill_flops": formulas.PREFILL_FLOPS_FORMULA, "decode_bytes": formulas.DECODE_BYTES_FORMULA,
                     "model_step": formulas.MODEL_STEP_FORMULA}
    return {
        "schema": SCHEMA,
        "workload": workload,
        "environment": env,
        "ceilings": ceilings,
        "settings": settings,
        "formulas": formulas_text,
        "providers": [{"name": a.name, "available": a.available, "reason": a.reason, "summary": a.summary}
                      for a in availability],
        "rows": [{k: _clean(v) for k, v in row.items()} for row in rows],
    }


def write_json(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def write_csv(path: Path, doc: dict) -> Path:
    """One line per row; environment columns first, then :data:`ROW_COLUMNS` (and any extra)."""
    rows = doc["rows"]
    extra = sorted({k for row in rows for k in row} - set(ROW_COLUMNS) - set(ENV_COLUMNS) - {"traceback"})
    columns = list(ENV_COLUMNS) + list(ROW_COLUMNS) + extra
    env = {k: doc["environment"].get(k, "") for k in ENV_COLUMNS}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**env, **{k: ("" if v is None else v) for k, v in row.items()}})
    return path


def write_results(out_dir: Path, doc: dict) -> list[Path]:
    """``<out_dir>/<workload>.json`` and ``.csv``."""
    name = doc["workload"]
    return [write_json(out_dir / f"{name}.json", doc), write_csv(out_dir / f"{name}.csv", doc)]


def stamp_rows(doc: dict) -> dict:
    """Copy the run's command and timestamp into each row, so rows keep them when merged."""
    for row in doc["rows"]:
        row.setdefault("command", doc["environment"]["command"])
        row.setdefault("timestamp", doc["environment"]["timestamp"])
    return doc


def merge(old: dict, new: dict) -> dict:
    """``new`` plus the rows of ``old`` whose (case, provider) ``new`` did not measure.

    For sweeps split over several commands (``flashkernel bench ... --append``); every row
    keeps the command and timestamp of the run that measured it.
    """
    if old["workload"] != new["workload"] or old["environment"].get("gpu") != new["environment"].get("gpu"):
        raise ValueError(
            f"cannot append {new['workload']} results from {new['environment'].get('gpu')} to "
            f"{old['workload']} results from {old['environment'].get('gpu')}"
        )
    measured = {(r["case"], r["provider"]) for r in new["rows"]}
    kept = [r for r in stamp_rows(old)["rows"] if (r["case"], r["provider"]) not in measured]
    merged = dict(stamp_rows(new))
    merged["rows"] = kept + new["rows"]
    merged["environment"] = {**new["environment"],
                             "earlier_commands": old["environment"].get("earlier_commands", [])
                             + [old["environment"]["command"]]}
    return merged


def load(path: Path) -> dict:
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a flashkernel result file (schema {doc.get('schema')!r})")
    return doc


def result_files(directory: Path) -> list[Path]:
    """The result JSON files in ``directory`` (prefill first)."""
    order = {"prefill.json": 0, "decode.json": 1}
    files = [p for p in Path(directory).glob("*.json") if p.name in order]
    return sorted(files, key=lambda p: order[p.name])


# --- tables ------------------------------------------------------------------------------------


def format_table(headers: list[str], rows: list[list[str]], text_columns: int = 1, markdown: bool = False) -> str:
    """A fixed-width (or Markdown) table; the first ``text_columns`` left-aligned, the rest right-aligned."""
    if markdown:
        align = ["---" if i < text_columns else "---:" for i in range(len(headers))]
        lines = [headers, align, *rows]
        return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]

    def line(cells):
        parts = [str(c).ljust(w) if i < text_columns else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _cell(row: dict | None, key: str, fmt: str, fraction_key: str | None = None) -> str:
    """``key`` formatted (with `` (NN%)`` of ``fraction_key`` when present), or the status mark."""
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return STATUS_MARK.get(row.get("status"), row.get("status", "?"))
    value = row.get(key)
    if value is None:
        return "-"
    fraction = row.get(fraction_key) if fraction_key else None
    return format(value, fmt) + (f" ({fraction:.0%})" if fraction is not None else "")


def _pivot(rows: list[dict]) -> tuple[list[str], dict]:
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    cases: dict = {}
    for r in rows:
        cases.setdefault(r["case"], {})[r["provider"]] = r
    return providers, cases


def _case_label(workload: str, row: dict, with_dtype: bool) -> str:
    if workload == "decode":
        label = f"b={row['batch']} ctx={row['context']}"
    else:
        label = f"d={row['head_dim']} {'causal' if row['causal'] else 'full'} s={row['seqlen_q']} b={row['batch']}"
    return f"{row['dtype']} {label}" if with_dtype else label


def provider_table(doc: dict, key: str, fmt: str, fraction_key: str | None = None, markdown: bool = False) -> str:
    """Cases down, providers across, ``key`` in the cells (or WRONG / error / OOM)."""
    providers, cases = _pivot(doc["rows"])
    with_dtype = len({r["dtype"] for r in doc["rows"]}) > 1
    body = []
    for per_provider in cases.values():
        label = _case_label(doc["workload"], next(iter(per_provider.values())), with_dtype)
        body.append([label] + [_cell(per_provider.get(p), key, fmt, fraction_key) for p in providers])
    return format_table(["case"] + providers, body, markdown=markdown)


def speedup_summary(doc: dict, key: str = "flashkernel_speedup", markdown: bool = False) -> str:
    """Geometric mean, min and max of flashkernel's speedup over each provider."""
    per_provider: dict = {}
    for row in doc["rows"]:
        if row.get(key) and row["provider"] != "flashkernel":
            per_provider.setdefault(row["provider"], []).append(row[key])
    body = []
    for name, values in per_provider.items():
        geo = math.exp(sum(math.log(v) for v in values) / len(values))
        body.append([name, f"{geo:.3g}x", f"{min(values):.3g}x", f"{max(values):.3g}x", str(len(values))])
    if not body:
        return "(no provider to compare with flashkernel)"
    return format_table(["flashkernel vs", "geo-mean", "min", "max", "cases"], body, markdown=markdown)


def model_steps_table(doc: dict, markdown: bool = False) -> str:
    """flashkernel's achieved model decode steps/s against the bandwidth bound, per case."""
    body, layers = [], "?"
    for row in doc["rows"]:
        if row["provider"] == "flashkernel" and row.get("status") == "ok":
            layers = row.get("model_layers", layers)
            bound = row.get("model_steps_bound")
            achieved = row.get("model_steps_per_s")
            frac = f"{achieved / bound:.0%}" if bound else "-"
            body.append([f"b={row['batch']} ctx={row['context']}", f"{achieved:.1f}",
                         f"{bound:.1f}" if bound else "-", frac])
    if not body:
        return "(no flashkernel decode rows)"
    headers = [f"flashkernel, {layers}-layer model", "steps/s", "bound", "of bound"]
    return format_table(headers, body, markdown=markdown)


def problems(doc: dict) -> list[str]:
    """One line per wrong or failed provider run, and per failed CUDA-graph capture."""
    lines = []
    for row in doc["rows"]:
        if row.get("status") != "ok":
            mark = STATUS_MARK.get(row["status"], row["status"])
            lines.append(f"{mark:5s} {row['provider']} on {row['case']}: {row.get('message', '')}")
        elif row.get("graph_error"):
            lines.append(f"no CUDA graph for {row['provider']} on {row['case']}: {row['graph_error']}")
    return lines


def absent_lines(doc: dict) -> list[str]:
    return [f"absent: {p['name']}: {p['reason']}" for p in doc["providers"] if not p["available"]]


def timer_note(doc: dict) -> str:
    if doc["environment"].get("device") != "cuda":
        return ("CPU-INTERPRETER TIME: no CUDA device, flashkernel's kernels ran in Triton's CPU interpreter; "
                "these milliseconds say nothing about GPU speed")
    return "GPU time from CUDA events (median per call); decode also as CUDA-graph replays"


def _sections(doc: dict, markdown: bool) -> list[tuple[str, str]]:
    """(title, table) pairs of the report."""
    on_gpu = doc["environment"].get("device") == "cuda"
    sections = []
    if doc["workload"] == "prefill":
        if on_gpu:
            sections.append(("TFLOP/s (median; % of the measured bf16 matmul peak)",
                             provider_table(doc, "tflops", ".1f", "fraction_of_matmul_peak", markdown)))
        sections.append((f"ms per call ({'median' if on_gpu else 'CPU-interpreter'})",
                         provider_table(doc, "median_ms", ".3f", markdown=markdown)))
    elif on_gpu:
        sections += [
            ("GB/s, CUDA-graph replay (GPU time; % of the measured copy bandwidth)",
             provider_table(doc, "graph_gbps", ".0f", "fraction_of_bandwidth", markdown)),
            ("ms per call, eager (what a Python caller sees)",
             provider_table(doc, "median_ms", ".4f", markdown=markdown)),
            (formulas.MODEL_STEP_FORMULA, model_steps_table(doc, markdown)),
        ]
    else:
        sections.append(("ms per call (CPU-interpreter)", provider_table(doc, "median_ms", ".3f", markdown=markdown)))
    sections.append(("flashkernel speedup (provider time / flashkernel time)", speedup_summary(doc, markdown=markdown)))
    if on_gpu and doc["workload"] == "decode":
        sections.append(("... on CUDA-graph times", speedup_summary(doc, "graph_flashkernel_speedup", markdown)))
    return sections


def report(doc: dict, markdown: bool = False) -> str:
    """The readable report for one workload (plain text, or Markdown for the README)."""
    formula = formulas.PREFILL_FLOPS_FORMULA if doc["workload"] == "prefill" else formulas.DECODE_BYTES_FORMULA
    env = doc["environment"]
    if markdown:
        head = [f"### {doc['workload']} on {env['gpu']}", "", f"`{env['command']}` (commit {env['git_commit'][:12]}, "
                f"torch {env['torch']}, triton {env['triton']}, {env['timestamp']})", "", timer_note(doc), "", formula]
        body = [part for title, table in _sections(doc, True) for part in ("", f"{title}:", "", table)]
        notes = ["", *(f"- {line}" for line in problems(doc) + absent_lines(doc))]
        return "\n".join(head + body + notes)
    head = [f"== {doc['workload']} on {env['gpu']} ==", timer_note(doc), formula]
    body = [part for title, table in _sections(doc, False) for part in (f"{title}:", table)]
    return "\n".join(head + body + problems(doc) + absent_lines(doc))
