"""The context-parallel benchmark script: its rows and an end-to-end smoke run on CPUs (gloo,
Triton's interpreter) under torchrun, so a GPU run does not fail on a Python error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import flashkernel
from flashkernel.bench import context_parallel as cp
from flashkernel.bench import formulas
from helpers import needs_interpreter


def test_row_derives_tflops_and_speedup():
    args = cp.parse_args(["--heads", "4", "--head-dim", "64"])
    row = cp._row(args, 1024, "flashkernel-ring", 2, {"status": "ok", "median_ms": 2.0}, single_ms=3.0)
    flops = formulas.attention_flops(1, 4, 1024, 1024, 64, True)
    assert row["flops"] == flops and row["tflops"] == formulas.tflops(flops, 2.0)
    assert row["tflops_per_gpu"] == row["tflops"] / 2 and row["speedup_vs_1gpu"] == 1.5
    failed = cp._row(args, 1024, "torch-cp-flash-allgather", 2, {"status": "error", "message": "boom"}, 3.0)
    assert "tflops" not in failed and "boom" in cp._summary_table([row, failed])


def _smoke_run(out: Path, *extra: str) -> dict:
    """The benchmark under torchrun on 2 CPU ranks at a tiny shape; its JSON."""
    src = str(Path(flashkernel.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "flashkernel.bench.context_parallel", "--cpu", "--seqlens", "16", "--heads", "2",
               "--head-dim", "16", "--dtype", "float16", "--torch-backends", "flash", "--target-s", "0",
               "--min-reps", "1", "--max-reps", "1", "--out", str(out), *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@needs_interpreter
def test_cpu_smoke_run(tmp_path):
    doc = _smoke_run(tmp_path / "cp.json", "--providers", "ring", "single", "torch-cp")
    rows = {row["provider"]: row for row in doc["rows"]}
    assert rows["flashkernel-1gpu"]["status"] == "ok"
    ring = rows["flashkernel-ring"]
    assert ring["status"] == "ok" and ring["max_abs_diff_vs_1gpu"] < 1e-2
    assert 0.0 <= ring["hidden_fraction"] <= 1.0 and len(ring["per_step_ms"]["overlapped"]) == 2
    assert rows["torch-cp-flash-allgather"]["status"] in ("ok", "error")  # CPU SDPA has no CP rule
    assert doc["environment"]["world_size"] == 2 and "--cpu" in doc["environment"]["command"]


@needs_interpreter
def test_cpu_smoke_run_with_backward(tmp_path):
    doc = _smoke_run(tmp_path / "cp.json", "--providers", "ring", "single", "--backward")
    rows = {row["provider"]: row for row in doc["rows"]}
    for provider in ("flashkernel-1gpu", "flashkernel-ring"):
        row = rows[provider]
        assert row["status"] == "ok" and row["pass"] == "forward+backward", row
        assert row["flops"] == int(formulas.attention_flops(1, 2, 16, 16, 16, True) * cp.BACKWARD_FLOPS_FACTOR)
    assert rows["flashkernel-ring"]["max_abs_diff_vs_1gpu"] < 1e-2
    assert "hidden_fraction" not in rows["flashkernel-ring"]  # no overlap breakdown for the backward
