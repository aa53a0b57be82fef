"""The ring-attention scaling model (``bench/ring_model.py``) on the committed 2-GPU run."""

from pathlib import Path

import json

import pytest

from flashkernel.bench import ring_model

MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200x2" / "context_parallel.json"


@pytest.fixture(scope="module")
def doc():
    return json.loads(MEASURED.read_text())


def test_the_model_reproduces_the_measured_world(doc):
    """At the measured world size the model's ring time is the measured one (128k, 512k: single,
    undisturbed repetitions), within 3%."""
    measured = {r["seqlen"]: r["median_ms"] for r in doc["rows"] if r["provider"] == "flashkernel-ring"}
    for p in ring_model.predict(doc, 2, [131072, 524288]):
        assert p["ring_ms"] == pytest.approx(measured[p["seqlen"]], rel=0.03)
        assert p["step_basis"].startswith("measured")


def test_four_gpus_take_half_the_steps_of_two_at_twice_the_length(doc):
    four = {p["seqlen"]: p for p in ring_model.predict(doc, 4, [262144, 524288, 1048576, 2097152])}
    two = {p["seqlen"]: p for p in ring_model.predict(doc, 2, [131072, 262144, 524288])}
    for seqlen in (262144, 524288, 1048576):
        assert four[seqlen]["step_ms"] == pytest.approx(two[seqlen // 2]["step_ms"])
        assert four[seqlen]["transfer_ms"] == pytest.approx(two[seqlen // 2]["transfer_ms"])
    assert four[2097152]["step_basis"].startswith("extrapolated")
    assert all(p["speedup_vs_1gpu"] > 3 for p in four.values())


def test_cli_writes_the_predictions(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert ring_model.main([str(MEASURED), "--world", "4", "--seqlens", "524288", "--out", str(out)]) == 0
    assert "524288" in capsys.readouterr().out
    assert json.loads(out.read_text())["predictions"][0]["world"] == 4
