"""The quantized-cache benchmark (``bench/kvquant.py``): its byte counts, a small perf run in the
interpreter (every format, granularity and provider checked against float64 before timing), the
accuracy section, the files and plots it writes, and the CLI's entry."""

import json

import pytest
import torch

from flashkernel import cli
from flashkernel.bench import kvquant, measure

SMALL = kvquant.Setup(heads=2, kv_heads=1, head_dim=16, device="cuda" if torch.cuda.is_available() else "cpu")


def test_bytes_read_counts_entries_scales_and_q_o():
    setup = kvquant.Setup()
    q_and_o = 2 * 8 * 32 * 128 * 2
    assert kvquant.bytes_read(setup, 8, 4096, "bf16", None) == 2 * 8 * 4096 * 8 * 128 * 2 + q_and_o
    assert kvquant.bytes_read(setup, 8, 4096, "fp8", "tensor") == 2 * 8 * 4096 * 8 * 128 + q_and_o
    assert kvquant.bytes_read(setup, 8, 4096, "int8", "token") == 2 * 8 * 4096 * 8 * (128 + 4) + q_and_o


def test_perf_rows_check_time_and_compare_every_format(monkeypatch):
    monkeypatch.setattr(kvquant, "LAYOUTS", {"paged16": 16})
    logged = []
    rows = kvquant.perf_rows(SMALL, [(1, 32)], measure.Settings(cpu_reps=1), 4000.0, logged.append)
    assert len(rows) == len(logged) >= 7  # bf16 + 2 formats x 3 granularities (+ Gluon on a Hopper GPU)
    rows = [r for r in rows if r["provider"] == "triton"]
    assert all(row["check_ok"] for row in rows), [(r["format"], r["granularity"], r["max_err"]) for r in rows]
    by_kind = {(r["format"], r["granularity"]): r for r in rows}
    assert by_kind[("bf16", None)]["graph_ratio_vs_bf16"] == 1.0
    token = by_kind[("fp8", "token")]
    assert token["token_over_tensor"] == token["graph_us"] / by_kind[("fp8", "tensor")]["graph_us"]
    assert token["bytes_read"] == kvquant.bytes_read(SMALL, 1, 32, "fp8", "token")
    assert token["fraction_of_read"] == token["graph_gbps"] / 4000.0
    assert token["model_steps_bound"] == 4000e9 / (kvquant.LAYERS * token["bytes_read"])


def test_accuracy_rows_and_their_table():
    rows = kvquant.accuracy_rows(SMALL, lambda row: None, context=64, seqlen_q=2)
    assert len(rows) == 2 * 7
    assert {(r["format"], r["data"]) for r in rows} >= {("bf16", "random"), ("fp8", "k-outliers")}
    for row in rows:
        assert 0 < row["out_rms_rel"] < 1 and 0 < row["k_rms_rel"] < 1
    bf16 = [r for r in rows if r["format"] == "bf16"]
    assert max(r["k_rms_rel"] for r in bf16) < min(r["k_rms_rel"] for r in rows if r["format"] != "bf16")
    table = kvquant.accuracy_markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| fp8 | per token | k-outliers |" in table


def test_results_and_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for fmt, granularity, us in (("bf16", None, 10.0), ("fp8", "tensor", 6.0), ("fp8", "token", 6.2),
                                 ("int8", "tensor", 6.1)):
        for context in (1024, 4096):
            row = dict(section="perf", provider="triton", layout="contiguous", format=fmt, granularity=granularity,
                       batch=1, context=context, graph_us=us * context / 1024, eager_us=20.0)
            rows.append(kvquant.figures(kvquant.Setup(), row, 4000.0))
    kvquant.add_ratios(rows)
    paths = kvquant.write(tmp_path, {"rows": rows}) + kvquant.plot(tmp_path, rows)
    assert sorted(p.name for p in paths) == ["kvquant.csv", "kvquant.json", "kvquant_model.png", "kvquant_steps.png"]
    assert json.loads((tmp_path / "kvquant.json").read_text())["rows"][2]["graph_ratio_vs_bf16"] == 0.6
    assert (tmp_path / "kvquant.csv").read_text().splitlines()[0].startswith("section,provider,layout,format")


def test_cli_runs_the_accuracy_section_without_a_gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(kvquant, "accuracy_rows", lambda setup, log: [
        dict(section="accuracy", format="fp8", granularity="tensor", data="random", context=8, out_rms_rel=0.01,
             out_max_rel=0.02, k_rms_rel=0.03, v_rms_rel=0.04)])
    if torch.cuda.is_available():
        pytest.skip("on a GPU the command runs the perf section too")
    assert cli.main(["bench", "kvquant", "--out", str(tmp_path)]) == 0
    assert "only the accuracy section" in capsys.readouterr().out
    assert json.loads((tmp_path / "kvquant.json").read_text())["rows"][0]["format"] == "fp8"
