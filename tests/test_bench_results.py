"""Result files (JSON / CSV written and parseable), tables, environment and the ceilings cache."""

import csv
import json
import math
import re
import subprocess

import pytest

from flashkernel.bench import ceilings, results
from flashkernel.bench.providers import Availability

ENV = {"gpu": "NVIDIA H200", "device": "cuda", "torch": "2.9.0", "triton": "3.6.0", "cuda": "12.8",
       "git_commit": "abc123", "timestamp": "2025-01-01T00:00:00Z", "command": "flashkernel bench prefill --quick"}


def prefill_row(provider, status="ok", tflops=100.0, **extra):
    row = {"workload": "prefill", "case": "bfloat16 d=128 causal b=4 h=16 s=4096", "provider": provider,
           "status": status, "dtype": "bfloat16", "batch": 4, "seqlen_q": 4096, "seqlen_k": 4096, "heads": 16,
           "kv_heads": 16, "head_dim": 128, "causal": True, "flops": 10**12, "bytes": 10**9}
    if status == "ok":
        row.update(median_ms=1000.0 / tflops, tflops=tflops, timer="cuda-events")  # 1e12 FLOPs
    row.update(extra)
    return row


def sample_doc(rows=None, env=ENV):
    rows = rows if rows is not None else [
        prefill_row("flashkernel", tflops=400.0, fraction_of_matmul_peak=0.5),
        prefill_row("sdpa-flash", tflops=300.0, flashkernel_speedup=1.3333),
        prefill_row("standard", status="wrong", message="max error 1 > bound 0.01", max_err=float("nan")),
    ]
    avail = [Availability("flashkernel", True, "", "ours"), Availability("fa3", False, "not installed (x)", "FA3")]
    return results.document("prefill", env, {"copy_gbps": 4000.0, "matmul_tflops": 800.0}, {"cases": 1}, avail, rows)


def test_json_and_csv_are_written_and_parse(tmp_path):
    doc = sample_doc()
    paths = results.write_results(tmp_path / "out", doc)
    assert [p.name for p in paths] == ["prefill.json", "prefill.csv"]
    loaded = results.load(paths[0])
    assert loaded["schema"] == results.SCHEMA and loaded["workload"] == "prefill"
    assert loaded["environment"]["command"] == ENV["command"]
    assert loaded["rows"][2]["max_err"] is None  # NaN is not valid JSON: written as null
    assert loaded["providers"][1] == {"name": "fa3", "available": False, "reason": "not installed (x)",
                                      "summary": "FA3"}
    assert "4 * B * Hq * D" in loaded["formulas"]["prefill_flops"]
    with open(paths[1], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    for column in ("gpu", "torch", "triton", "cuda", "git_commit", "timestamp", "command", "provider", "tflops"):
        assert column in rows[0]
    assert rows[0]["gpu"] == "NVIDIA H200" and rows[0]["command"] == ENV["command"]
    assert float(rows[0]["tflops"]) == 400.0 and rows[2]["status"] == "wrong" and rows[2]["tflops"] == ""


def test_merge_keeps_rows_of_earlier_runs(tmp_path):
    old = sample_doc([prefill_row("flashkernel", tflops=1.0), prefill_row("sdpa-math", tflops=2.0)])
    new_env = {**ENV, "command": "flashkernel bench prefill --append", "timestamp": "2025-01-02T00:00:00Z"}
    new = sample_doc([prefill_row("flashkernel", tflops=3.0)], env=new_env)
    merged = results.merge(old, new)
    by_provider = {r["provider"]: r for r in merged["rows"]}
    assert by_provider["flashkernel"]["tflops"] == 3.0 and by_provider["sdpa-math"]["tflops"] == 2.0
    assert by_provider["sdpa-math"]["command"] == ENV["command"]
    assert merged["environment"]["earlier_commands"] == [ENV["command"]]
    path = results.write_csv(tmp_path / "merged.csv", merged)
    with open(path, newline="") as f:
        rows = {r["provider"]: r for r in csv.DictReader(f)}
    assert rows["sdpa-math"]["command"] == ENV["command"] and rows["flashkernel"]["command"] == new_env["command"]
    with pytest.raises(ValueError, match="cannot append"):
        results.merge(old, sample_doc([], env={**ENV, "gpu": "NVIDIA A100"}))


def test_load_rejects_other_json(tmp_path):
    path = tmp_path / "prefill.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a flashkernel result file"):
        results.load(path)


def test_report_flags_wrong_and_lists_absent():
    text = results.report(sample_doc())
    assert "TFLOP/s" in text and "400.0 (50%)" in text
    assert "WRONG" in text and "standard on" in text
    assert "absent: fa3: not installed (x)" in text
    assert re.search(r"sdpa-flash\s+1\.33x", text)


def test_report_labels_cpu_interpreter_time():
    env = {**ENV, "gpu": "cpu (Triton interpreter)", "device": "cpu"}
    text = results.report(sample_doc(env=env))
    assert "CPU-INTERPRETER TIME" in text and "TFLOP/s (median" not in text


def test_format_table_alignment():
    table = results.format_table(["name", "value"], [["a", "1"], ["long name", "22"]])
    assert table.splitlines() == ["name       value", "---------  -----", "a              1",
                                  "long name     22"]


def test_speedup_summary_geometric_mean():
    rows = [prefill_row("x", flashkernel_speedup=2.0), prefill_row("x", flashkernel_speedup=8.0)]
    text = results.speedup_summary({"rows": rows})
    assert re.search(r"x\s+4x\s+2x\s+8x\s+2", text)


def test_gpu_slug():
    assert results.gpu_slug("NVIDIA H200") == "h200"
    assert results.gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert results.gpu_slug("cpu (Triton interpreter)") == "cpu--triton-interpreter-"


def test_git_commit(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.delenv("FLASHKERNEL_GIT_COMMIT", raising=False)
    repo = Path(__file__).resolve().parents[1]
    probe = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("git cannot read this copy of the tree (e.g. on a lent GPU machine)")
    commit = results.git_commit(Path(__file__).parent)
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit)
    assert results.git_commit(tmp_path) == ""


def test_environment_records_the_command():
    env = results.environment(["bench", "prefill", "--seqlens", "1024 2048"], "cpu")
    assert env["command"] == "flashkernel bench prefill --seqlens '1024 2048'"
    assert env["gpu"] == "cpu (Triton interpreter)"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", env["timestamp"])


FACTS = {"name": "Fake GPU", "index": 0, "uuid": "GPU-1234", "sm_count": 132, "l2_bytes": 50 * 2**20,
         "memory_bytes": 141 * 2**30, "compute_capability": "9.0"}


def test_ceilings_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(ceilings.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(ceilings, "device_facts", lambda index=None: dict(FACTS))
    calls = []

    def fake_measure():
        calls.append(1)
        return {"copy_gbps": 4000.0 + len(calls), "matmul_tflops": 700.0}

    first = ceilings.ceilings(measure_fn=fake_measure)
    second = ceilings.ceilings(measure_fn=fake_measure)
    assert len(calls) == 1 and first["copy_gbps"] == second["copy_gbps"] == 4001.0
    assert first["source"] == "measured now" and second["source"].startswith("cached in")
    stored = json.loads((tmp_path / "ceilings.json").read_text())
    assert list(stored) == ["Fake GPU|GPU-1234"] and "source" not in stored["Fake GPU|GPU-1234"]
    refreshed = ceilings.ceilings(refresh=True, measure_fn=fake_measure)
    assert len(calls) == 2 and refreshed["copy_gbps"] == 4002.0


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv(ceilings.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ceilings.cache_path() == tmp_path / "flashkernel" / "ceilings.json"


def test_info_lines():
    cpu = "\n".join(ceilings.info_lines("cpu", None, None))
    assert "GPU: none" in cpu and "interpreter" in cpu and "torch" in cpu
    gpu = "\n".join(ceilings.info_lines("cuda", {"copy_gbps": 4100.0, "matmul_tflops": 750.0, "source": "measured now"},
                                        FACTS))
    assert "Fake GPU" in gpu and "SMs: 132" in gpu and "50 MiB" in gpu and "4100 GB/s" in gpu and "750 TFLOP/s" in gpu
    assert math.isclose(141.0, float(re.search(r"memory: ([\d.]+) GiB", gpu).group(1)))


def test_git_commit_from_environment_wins(tmp_path, monkeypatch):
    """The commit the caller passes is reported, with or without a (possibly stale) .git."""
    from pathlib import Path

    monkeypatch.setenv("FLASHKERNEL_GIT_COMMIT", "0123abcd")
    assert results.git_commit(tmp_path) == "0123abcd"
    assert results.git_commit(Path(__file__).parent) == "0123abcd"
    monkeypatch.delenv("FLASHKERNEL_GIT_COMMIT")
    assert results.git_commit(tmp_path) == ""
