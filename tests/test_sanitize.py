"""The compute-sanitizer driver (``benchmarks/tools/sanitize.py``): its workload runs (the cheap
families here, in the interpreter; all of them under the sanitizers on a GPU: ``./run.sh gpu-test
sanitize``) and its reading of the sanitizers' reports."""

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import needs_interpreter

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "tools" / "sanitize.py"


@pytest.fixture(scope="module")
def sanitize():
    spec = importlib.util.spec_from_file_location("sanitize_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kernel_family_has_cases(sanitize, capsys):
    assert set(sanitize.FAMILIES) >= {"triton_prefill", "gluon_prefill", "varlen", "triton_decode", "append",
                                      "baseline_decode", "gluon_decode", "combine", "naive", "backward"}
    assert sanitize.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for schedule in ("plain", "persistent", "causal pairs", "ping-pong"):
        assert schedule in listed or "skipped" in listed  # the Gluon schedules need an sm_90 GPU


@needs_interpreter
def test_cheap_families_run(sanitize, capsys):
    assert sanitize.run_workload(["combine", "naive", "append", "baseline_decode"]) == 0
    out = capsys.readouterr().out
    assert out.count("  ok ") == 8 and "FAIL" not in out


def test_reports_are_counted(sanitize, tmp_path):
    memcheck = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at _decode_kernel+0x1230 in decode.py:123
=========     by thread (0,0,0) in block (5,0,0)
=========
========= ERROR SUMMARY: 1 error
"""
    racecheck = """========= COMPUTE-SANITIZER
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
    found = sanitize.parse_report(memcheck)
    assert found["errors"] == 1 and found["first_reports"] == [
        "Invalid __global__ read of size 4 bytes | at _decode_kernel+0x1230 in decode.py:123"]
    assert sanitize.parse_report(racecheck) == {"errors": 0, "warnings": 0, "first_reports": []}
    assert sanitize.parse_report("no summary at all")["errors"] is None  # a run that died: not "0 errors"
    first = {"tool": "memcheck", "errors": 0, "cases": 5, "ok": True}
    (tmp_path / "memcheck.json").write_text(json.dumps(first))
    assert sanitize.merge_summary(tmp_path)["runs"] == 1
    (tmp_path / "racecheck.json").write_text(json.dumps({"tool": "racecheck", "errors": 2, "cases": 5, "ok": False}))
    merged = sanitize.merge_summary(tmp_path)  # e.g. racecheck run in another session
    assert [t["tool"] for t in merged["tools"]] == ["memcheck", "racecheck"]
    assert merged["runs"] == 2 and merged["errors"] == 2 and not merged["ok"]
    assert json.loads((tmp_path / "summary.json").read_text())["tools"][0] == first


def test_warp_specialization_hazards_are_told_apart(sanitize):
    """Racecheck's reports whose read is the warp-specialization dispatch load of a Gluon kernel
    (Triton's state byte) are counted apart, both per hazard and per instruction pair; a hazard
    read elsewhere, or in another kernel, stays an error, and so do all of them when some were
    not printed."""
    def hazard(kernel, read_at):
        return (f"========= Error: Potential RAW hazard detected at __shared__ 0x28538 in block (13,0,0) :\n"
                f"=========     Write Thread (31,0,0) at {kernel}+0x7480 in prefill.py:870\n"
                f"=========     Read Thread (256,0,0) at {kernel}+{read_at} in prefill.py:870\n"
                f"=========     Current Value : 2\n")
    pair = ("========= Error: Race reported between Read access at _gluon_attention_kernel+0x120 in prefill.py:870\n"
            "=========     and Write access at _gluon_attention_kernel+0x7480 in prefill.py:870 [26 hazards]\n")
    loads = [["_gluon_attention_kernel", 0x120]]
    log = (hazard("_gluon_attention_kernel", "0x120") + hazard("_gluon_attention_kernel", "0x500")
           + hazard("_decode_kernel", "0x120") + pair
           + "========= RACECHECK SUMMARY: 4 hazards displayed (4 errors, 0 warnings)\n")
    found = sanitize.parse_report(log, loads)
    assert found["errors"] == 2 and found["known_hazards"] == 2
    assert [r.split(" | ")[1] for r in found["first_reports"][:2]] == [
        "Write Thread (31,0,0) at _gluon_attention_kernel+0x7480 in prefill.py:870",
        "Write Thread (31,0,0) at _decode_kernel+0x7480 in prefill.py:870"]  # the real ones, still shown
    assert "warp-specialization state" in found["first_reports"][-1]
    assert sanitize.parse_report(log)["errors"] == 4
    assert sanitize.parse_report(log.replace("(4 errors", "(9 errors"), loads)["errors"] == 9
