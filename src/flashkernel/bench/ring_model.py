"""Predicted scaling of ring attention to W GPUs, from a measured run on fewer GPUs.

    python -m flashkernel.bench.ring_model benchmarks/results/h200x2/context_parallel.json --world 4 \\
        --seqlens 262144 524288 1048576 2097152

A model, not a measurement: it says what a run on W GPUs should show, so that the run, when
it is made, can be read against it. Inputs, all from the measured file (``bench/context_parallel.py``,
causal zigzag ring, ``flashkernel-ring`` and ``flashkernel-1gpu`` rows):

* **Compute per ring step.** With the zigzag layout every step of every rank does the same
  work: ``F(S) / W**2`` FLOPs for the causal FLOPs ``F(S)`` of the whole sequence, on blocks of
  ``S / W`` queries and keys. A measured run on ``W0`` GPUs at length ``S * W0 / W`` has steps of
  exactly that size, so its per-step compute time (the compute-only breakdown, no transfers) is
  taken as is. Where no such length was measured, the step time is that FLOP count at the
  per-step rate of the longest measured length (marked ``extrapolated``).
* **Transfer per step.** Each step passes one key/value block, ``2 * (S / W) * Hkv * D`` elements,
  at the link bandwidth measured per step (the median of the file's ``comm_gbps_per_step``).
* **Overlap.** The transfer of step ``i + 1``'s block runs during step ``i``'s compute, so a step
  waits only for ``max(0, transfer - compute)``. The ring's fixed cost per call (the last merge,
  launches) is the median of ``total - compute - exposed`` over the measured lengths.
* **One GPU.** The measured single-GPU time at ``S`` where there is one, else ``F(S)`` at the
  single-GPU rate of the longest measured length (marked ``extrapolated``).

Predicted ring time: ``W * step + (W - 1) * max(0, transfer - step) + fixed``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from . import formulas


def _rows(doc: dict, provider: str) -> dict[int, dict]:
    return {row["seqlen"]: row for row in doc["rows"] if row["provider"] == provider and row.get("status") == "ok"}


def _causal_flops(seqlen: int, row: dict) -> float:
    return formulas.attention_flops(row["batch"], row["heads"], seqlen, seqlen, row["head_dim"], causal=True)


def predict(doc: dict, world: int, seqlens: list[int]) -> list[dict]:
    """One prediction per sequence length (see the module docstring): ring time, single-GPU time,
    speed-up, per-step compute and transfer, hidden fraction of the transfers."""
    measured_world = doc["environment"]["world_size"]
    ring, single = _rows(doc, "flashkernel-ring"), _rows(doc, "flashkernel-1gpu")
    if not ring:
        raise ValueError("the file has no successful flashkernel-ring rows with a compute/comm breakdown")
    example = next(iter(ring.values()))
    link_gbps = statistics.median(row["comm_gbps_per_step"] for row in ring.values())
    fixed_ms = statistics.median(max(0.0, row["median_ms"] - row["compute_ms"] - row["exposed_comm_ms"])
                                 for row in ring.values())
    longest = max(ring)
    step_rate = _causal_flops(longest, example) / measured_world ** 2 / statistics.median(
        ring[longest]["per_step_ms"]["compute"])  # FLOPs per ms of one rank's step
    single_rate = (_causal_flops(max(single), example) / single[max(single)]["median_ms"]) if single else None
    element_bytes = 2 if example["dtype"] in ("bfloat16", "float16") else 4

    predictions = []
    for seqlen in seqlens:
        step_flops = _causal_flops(seqlen, example) / world ** 2
        source = ring.get(seqlen * measured_world // world) if seqlen * measured_world % world == 0 else None
        if source is not None:
            step_ms, step_basis = statistics.median(source["per_step_ms"]["compute"]), f"measured at {source['seqlen']}"
        else:
            step_ms, step_basis = step_flops / step_rate, f"extrapolated from {longest}"
        transfer_ms = 2 * seqlen / world * example["kv_heads"] * example["head_dim"] * element_bytes / link_gbps / 1e6
        exposed_ms = (world - 1) * max(0.0, transfer_ms - step_ms)
        ring_ms = world * step_ms + exposed_ms + fixed_ms
        if seqlen in single:
            single_ms, single_basis = single[seqlen]["median_ms"], "measured"
        elif single_rate is not None:
            single_ms, single_basis = _causal_flops(seqlen, example) / single_rate, f"extrapolated from {max(single)}"
        else:
            single_ms, single_basis = None, "none"
        predictions.append(dict(
            seqlen=seqlen, world=world, ring_ms=ring_ms, single_ms=single_ms,
            speedup_vs_1gpu=single_ms / ring_ms if single_ms else None, step_ms=step_ms, step_basis=step_basis,
            transfer_ms=transfer_ms, hidden_fraction=1.0 - exposed_ms / ((world - 1) * transfer_ms),
            single_basis=single_basis, link_gbps=link_gbps, fixed_ms=fixed_ms,
            tflops_per_gpu=_causal_flops(seqlen, example) / ring_ms / world / 1e9))
    return predictions


def table(predictions: list[dict]) -> str:
    lines = [f"{'seqlen':>8} {'GPUs':>4} {'ring ms':>9} {'1-GPU ms':>9} {'x 1GPU':>7} {'step ms':>8} "
             f"{'xfer ms':>8} {'hidden':>6}  basis (step; 1 GPU)"]
    for p in predictions:
        single = f"{p['single_ms']:9.1f}" if p["single_ms"] else f"{'-':>9}"
        speedup = f"{p['speedup_vs_1gpu']:7.2f}" if p["speedup_vs_1gpu"] else f"{'-':>7}"
        lines.append(f"{p['seqlen']:8d} {p['world']:4d} {p['ring_ms']:9.1f} {single} {speedup} {p['step_ms']:8.2f} "
                     f"{p['transfer_ms']:8.2f} {p['hidden_fraction']:6.2f}  {p['step_basis']}; {p['single_basis']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashkernel.bench.ring_model", description=__doc__.split("\n")[0])
    parser.add_argument("measured", type=Path, help="a context_parallel.json of a ring run")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[262144, 524288, 1048576, 2097152])
    parser.add_argument("--out", type=Path, default=None, help="write the predictions as JSON here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.world < 1:
        parser.error(f"--world must be at least 1, got {args.world}")
    doc = json.loads(args.measured.read_text())
    predictions = predict(doc, args.world, args.seqlens)
    print(table(predictions))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": "ring_model", "measured": str(args.measured),
                                        "measured_environment": doc["environment"], "predictions": predictions},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
