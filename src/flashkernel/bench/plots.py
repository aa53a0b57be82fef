"""PNG charts from result documents (needs matplotlib: ``pip install flashkernel[plot]``).

* ``prefill_tflops[_<dtype>].png``: TFLOP/s vs seqlen, one line per provider, one panel per
  head dim and mask.
* ``decode_bandwidth[_<dtype>].png``: effective GB/s vs context, one line per provider, one panel
  per batch size, with the measured copy bandwidth as a dashed line.
* ``roofline.png``: every right, timed row at its arithmetic intensity under the roofs of the
  measured matmul TFLOP/s and copy bandwidth.

Only rows with status ``ok`` are drawn: a wrong provider is never plotted.
"""

from __future__ import annotations

from pathlib import Path

from . import formulas


class PlottingUnavailable(RuntimeError):
    """matplotlib is not installed."""


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlottingUnavailable(
            "plots need matplotlib: pip install 'flashkernel[plot]' (or pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ok_rows(doc: dict) -> list[dict]:
    return [r for r in doc["rows"] if r.get("status") == "ok"]


def _grid(plt, count: int, columns: int):
    rows = max(1, -(-count // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat


def _series(rows: list[dict], x_key: str, y_keys: tuple) -> dict:
    """provider -> sorted (x, y) points; y is the first of ``y_keys`` a row has."""
    series: dict = {}
    for row in rows:
        y = next((row[key] for key in y_keys if row.get(key) is not None), None)
        if y is not None:
            series.setdefault(row["provider"], []).append((row[x_key], y))
    return {name: sorted(points) for name, points in series.items()}


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939")
PROVIDER_ORDER = ("flashkernel-paged", "standard", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math",
                  "flex", "fa2", "fa3", "fa4", "flashinfer", "flashkernel-baseline")


def provider_color(name: str) -> str:
    """The same colour for a provider in every chart; flashkernel is black."""
    if name == "flashkernel":
        return "black"
    index = PROVIDER_ORDER.index(name) if name in PROVIDER_ORDER else len(PROVIDER_ORDER) + sum(map(ord, name))
    return PALETTE[index % len(PALETTE)]


def _draw_lines(ax, series: dict) -> None:
    for name, points in series.items():
        xs, ys = zip(*points)
        width = 2.5 if name == "flashkernel" else 1.2
        ax.plot(xs, ys, marker="o", markersize=3, label=name, linewidth=width, color=provider_color(name))


def _log2_axis(ax, values) -> None:
    """Log-2 x axis with a tick at every measured value."""
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks], fontsize=7)
    ax.minorticks_off()


def _title(doc: dict, what: str) -> str:
    env = doc["environment"]
    return f"{what} on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, {env['git_commit'][:10]})"


def _by_dtype(rows: list[dict]) -> dict:
    groups: dict = {}
    for row in rows:
        groups.setdefault(row["dtype"], []).append(row)
    return groups


def _name(stem: str, dtype: str, several: bool) -> str:
    return f"{stem}_{dtype}.png" if several else f"{stem}.png"


def prefill_plot(doc: dict, out_dir: Path) -> list[Path]:
    """TFLOP/s (or CPU ms) vs seqlen, a panel per (head dim, mask)."""
    plt = pyplot()
    on_gpu = doc["environment"].get("device") == "cuda"
    y_keys, y_label = (("tflops",), "TFLOP/s") if on_gpu else (("median_ms",), "ms per call (CPU interpreter)")
    groups = _by_dtype(ok_rows(doc))
    paths = []
    for dtype, rows in groups.items():
        panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
        fig, axes = _grid(plt, len(panels), 2)
        for ax, (head_dim, causal) in zip(axes, panels):
            chosen = [r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal]
            _draw_lines(ax, _series(chosen, "seqlen_q", y_keys))
            _log2_axis(ax, [r["seqlen_q"] for r in chosen])
            ax.set_title(f"{dtype}, head dim {head_dim}, {'causal' if causal else 'no mask'}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(y_label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(_title(doc, "prefill"), fontsize=9)
        fig.tight_layout()
        path = out_dir / _name("prefill_tflops", dtype, len(groups) > 1)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def backward_plot(doc: dict, out_dir: Path) -> Path:
    """``backward_tflops.png``: the backward suite's TFLOP/s vs seqlen per provider, a panel per
    (head dim, mask) as in ``prefill_tflops.png``; one attention layer's forward + backward
    (the ``layer`` section, where run) dashed."""
    plt = pyplot()
    rows = doc["rows"]
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = _grid(plt, len(panels), 2)
    for ax, (head_dim, causal) in zip(axes, panels):
        for section, style in ((rows, "-"), (doc.get("layer", []), "--")):
            chosen = sorted((r for r in section if r["head_dim"] == head_dim and r["causal"] == causal),
                            key=lambda r: r["seqlen"])
            providers = [k.removesuffix("_tflops") for k in (chosen[0] if chosen else {}) if k.endswith("_tflops")]
            for name in providers:
                points = [(r["seqlen"], r[f"{name}_tflops"]) for r in chosen if f"{name}_tflops" in r]
                if points:
                    xs, ys = zip(*points)
                    label = name if style == "-" else f"{name}, forward + backward"
                    ax.plot(xs, ys, style, marker="o", markersize=3, label=label, color=provider_color(name),
                            linewidth=2.5 if name == "flashkernel" else 1.2)
        _log2_axis(ax, [r["seqlen"] for r in rows if r["head_dim"] == head_dim and r["causal"] == causal])
        ax.set_title(f"backward, head dim {head_dim}, {'causal' if causal else 'no mask'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_title(doc, "backward"), fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "backward_tflops.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def decode_plot(doc: dict, out_dir: Path) -> list[Path]:
    """Effective GB/s (graph replay when measured) vs context, a panel per batch size."""
    plt = pyplot()
    on_gpu = doc["environment"].get("device") == "cuda"
    if on_gpu:  # eager figures only where a provider could not be captured in a graph
        y_keys, y_label = ("graph_gbps", "gbps"), "GB/s (CUDA-graph replay)"
    else:
        y_keys, y_label = ("gbps",), "GB/s (CPU interpreter)"
    copy_gbps = (doc.get("ceilings") or {}).get("copy_gbps")
    groups = _by_dtype(ok_rows(doc))
    paths = []
    for dtype, rows in groups.items():
        batches = sorted({r["batch"] for r in rows})
        fig, axes = _grid(plt, len(batches), min(3, len(batches)))
        for ax, batch in zip(axes, batches):
            chosen = [r for r in rows if r["batch"] == batch]
            _draw_lines(ax, _series(chosen, "context", y_keys))
            if copy_gbps:
                ax.axhline(copy_gbps, linestyle="--", color="gray", label=f"measured copy {copy_gbps:.0f} GB/s")
            _log2_axis(ax, [r["context"] for r in chosen])
            ax.set_title(f"{dtype}, batch {batch}")
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(y_label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(_title(doc, "decode"), fontsize=9)
        fig.tight_layout()
        path = out_dir / _name("decode_bandwidth", dtype, len(groups) > 1)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _roof(ax, ceilings: dict, intensities: list[float]) -> None:
    """min(matmul peak, bandwidth x intensity) over the plotted range."""
    peak, bandwidth = ceilings["matmul_tflops"], ceilings["copy_gbps"] / 1e3  # TB/s
    low, high = min(intensities + [1.0]) / 2, max(intensities + [peak / bandwidth]) * 2
    knee = peak / bandwidth
    ax.plot([low, knee, high], [bandwidth * low, peak, peak], color="gray", linestyle="--",
            label=f"roof: {peak:.0f} TFLOP/s, {ceilings['copy_gbps']:.0f} GB/s")


def roofline_plot(docs: list[dict], out_dir: Path) -> Path:
    """Achieved TFLOP/s vs FLOP/byte for every ok row of every document."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    intensities = []
    for doc in docs:
        for provider, points in _roofline_points(doc).items():
            xs, ys = zip(*points)
            intensities += list(xs)
            marker = "o" if doc["workload"] == "prefill" else "^"
            ax.scatter(xs, ys, s=14, marker=marker, color=provider_color(provider),
                       label=f"{doc['workload']}: {provider}")
    ceilings = next((d.get("ceilings") for d in docs if d.get("ceilings")), None)
    if ceilings:
        _roof(ax, ceilings, intensities)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of Q, K, V, O)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    note = "" if ceilings else "\nno measured ceilings: not a GPU run"
    ax.set_title(_title(docs[0], "roofline") + note, fontsize=7)
    fig.tight_layout()
    path = out_dir / "roofline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _roofline_points(doc: dict) -> dict:
    points: dict = {}
    for row in ok_rows(doc):
        ms = row.get("graph_median_ms") or row.get("median_ms")
        if ms and row.get("bytes"):
            intensity = formulas.arithmetic_intensity(row["flops"], row["bytes"])
            points.setdefault(row["provider"], []).append((intensity, formulas.tflops(row["flops"], ms)))
    return points


def plot_all(docs: list[dict], out_dir: Path) -> list[Path]:
    """Every chart the documents allow."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for doc in docs:
        if not ok_rows(doc):
            continue
        paths += prefill_plot(doc, out_dir) if doc["workload"] == "prefill" else decode_plot(doc, out_dir)
    if any(ok_rows(doc) for doc in docs):
        paths.append(roofline_plot(docs, out_dir))
    return paths
