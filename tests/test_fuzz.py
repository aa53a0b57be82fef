"""The fuzzer (``flashkernel.bench.fuzz``): reproducible draws whose compiled kernels are bounded
by their classes, a slice of its configurations in the interpreter, and its worker bookkeeping.

The GPU run (10,000 configurations) is ``./run.sh gpu-test fuzz``.
"""

import argparse
import importlib.util
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashkernel.bench import fuzz
from flashkernel.bench.fuzz_space import (CATEGORIES, FAMILY_WEIGHTS, Space, class_of, draw, in_category,
                                          make_classes)
from helpers import needs_interpreter

ROOT = Path(__file__).resolve().parents[1]

SEED = 0

# Configurations that failed in the first 10,000-configuration GPU run (seed 20261124): one per
# family and kernel of the NaN rows at softmax_scale 1e12 (the FMA-contracted exponent overflowed
# exp2: ``kernels._common.exponent_options``), and 2385, a float32 sequence of one query row whose
# mean error decided the check (``fuzz_checks.MEAN_CHECK_MIN_ROWS``).
GPU_SEED = 20261124
GPU_REGRESSIONS = [17, 53, 83, 194, 269, 459, 480, 2984, 2385]


def test_a_configuration_is_a_function_of_seed_and_index():
    space = Space.gpu(gluon=True)
    classes = make_classes(SEED, space)
    assert classes == make_classes(SEED, space)
    for index in (0, 17, 9999):
        first, again = draw(SEED, index, classes, space), draw(SEED, index, make_classes(SEED, space), space)
        assert first.cls == again.cls and first.values == again.values
        assert class_of(SEED, index, classes) == first.cls
    assert draw(SEED, 1, classes, space).values != draw(SEED, 2, classes, space).values


def _category_bound(config) -> dict:
    """The free integers that reach a kernel as arguments, by the name of their category."""
    cls, values = config.cls, config.values
    if cls.family in ("dense", "standard"):
        found = {"seqlen_k": values["seqlen_k"]}
        if values["seqlen_q"]:  # 0: no launch
            found["seqlen_q"] = values["seqlen_q"]
        return found
    if cls.family in ("varlen", "varlen_plan"):
        return {"total_q": sum(values["lengths_q"])}
    found = {"batch": values["batch"]}
    found["capacity"] = values["capacity"] // (cls.page_size or 1)
    if cls.page_size:
        found["pool"] = values["pool"]
    return found


def test_free_integers_stay_in_their_classs_category():
    """What bounds the compiles: every integer argument Triton specializes (== 1, % 16) lands in
    its class's category, whatever its value; so do the sequence counts of packed batches (the
    kernel's BLOCK_B) and the standard kernel's softmax block."""
    space = Space.gpu(gluon=True)
    classes = make_classes(SEED, space)
    assert {c.family for c in classes} == set(FAMILY_WEIGHTS)
    assert all(cat in CATEGORIES for c in classes for _, cat in c.cats if _ != "sequences")
    for index in range(3000):
        config = draw(SEED, index, classes, space)
        for name, value in _category_bound(config).items():
            assert in_category(value, config.cls.cat(name)), (index, name, value, config.cls.label())
        if config.cls.family in ("varlen", "varlen_plan"):
            count = len(config.values["lengths_q"])
            assert {"one": count == 1, "few": 2 <= count <= 15, "many": 17 <= count <= 31}[config.cls.cat("sequences")]
        if config.cls.family == "standard" and config.values["seqlen_k"] > 1:
            block = config.cls.key_block
            assert block // 2 < config.values["seqlen_k"] <= block or (block == 1024 and config.values["seqlen_k"] > 512)


def test_gpu_draws_cover_the_surface():
    """Over 3000 draws: every page size, 1 to 16 new tokens, appends and fixed splits, every
    layout and dtype, long sequences, the Gluon backends."""
    space = Space.gpu(gluon=True)
    classes = make_classes(SEED, space)
    configs = [draw(SEED, index, classes, space) for index in range(3000)]
    decode = [c for c in configs if c.cls.family in ("kvcache", "decode_plan", "serving")]
    assert {c.cls.page_size for c in decode} == {0, 1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {c.cls.seqlen_new for c in decode if c.cls.family != "serving"} == set(range(1, 17)) and {c.cls.append for c in decode} == {False, True}
    assert {c.cls.head_dim for c in configs} == set(range(8, 257, 8))
    assert {c.cls.splits > 0 for c in decode} == {False, True}
    assert {c.cls.layout for c in configs} == {"contiguous", "padded", "transposed", "offset"}
    assert {c.cls.dtype for c in configs} == {"float16", "bfloat16", "float32"}
    assert "gluon" in {c.cls.backend for c in configs}
    assert max(c.values.get("seqlen_k", 0) for c in configs) > 16384


@needs_interpreter
@pytest.mark.parametrize("chunk", range(3))
def test_cpu_slice(chunk, tmp_path):
    """Eight configurations per chunk through the command line: every one passes, the log has a
    line each and the summary counts them."""
    out = tmp_path / "fuzz.jsonl"
    status = fuzz.main(["--configs", "8", "--first", str(8 * chunk), "--seed", str(SEED), "--workers", "1",
                        "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(out.with_name("fuzz.jsonl.summary.json").read_text())
    assert status == 0, summary["failures"]
    assert [r["index"] for r in records] == list(range(8 * chunk, 8 * chunk + 8))
    assert all(r["ok"] for r in records)
    assert summary["configurations"] == 8 and summary["failed"] == 0 and summary["seed"] == SEED


class _FakeWorker(fuzz._Worker):
    """A worker whose child is scripted: ``script[restart]`` is ``(log lines, exit status or
    None to hang)``."""

    def __init__(self, indices, tmp_path, script):
        super().__init__(0, indices, argparse.Namespace(seed=SEED, classes=None), tmp_path)
        self.script = script
        self.spawned = []

    def _spawn(self):
        lines, status = self.script[self.restarts]
        self.spawned.append(list(self.pending))
        self.log.write_text("".join(json.dumps(line) + "\n" for line in lines))
        code = "import time; time.sleep(60)" if status is None else f"raise SystemExit({status})"
        return subprocess.Popen([sys.executable, "-c", code])


def _record(index):
    return {"index": index, "ok": True, "problems": [], "config": ""}


def _finish(worker, timeout):
    worker.start()
    deadline = time.monotonic() + 30
    while worker.poll(timeout) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_worker_that_dies_is_restarted_after_its_configuration(tmp_path):
    script = [([{"start": 5}, _record(5), {"start": 7}], 3),  # dies in 7 (a CUDA error, say)
              ([{"start": 9}, _record(9), {"done": True, "compiled": 4}], 0)]
    worker = _FakeWorker([5, 7, 9], tmp_path, script)
    _finish(worker, timeout=60)
    assert worker.spawned == [[5, 7, 9], [9]]
    assert worker.records[5]["ok"] and worker.records[9]["ok"] and worker.compiled == 4
    assert not worker.records[7]["ok"] and "exited with status 3" in worker.records[7]["problems"][0]


def test_a_worker_that_hangs_is_killed_and_restarted(tmp_path):
    script = [([{"start": 5}], None), ([{"start": 6}, _record(6), {"done": True, "compiled": 0}], 0)]
    worker = _FakeWorker([5, 6], tmp_path, script)
    _finish(worker, timeout=0.3)
    assert worker.spawned == [[5, 6], [6]]
    assert "timed out" in worker.records[5]["problems"][0] and worker.records[6]["ok"]


def test_progress_names_each_failure_once_as_soon_as_it_is_seen():
    stream = io.StringIO()
    show = fuzz._progress_printer(stream)
    bad = {"index": 3, "ok": False, "problems": ["max error 1.0"], "config": "the configuration"}
    show(2, 4, [bad])
    show(3, 4, [bad])  # within 5 s: no count line, the failure not repeated
    show(4, 4, [bad])  # the last one: a count line
    lines = stream.getvalue().splitlines()
    assert lines == ["fuzz: FAIL [3] max error 1.0", "    the configuration", "fuzz: 2/4, 1 failed",
                     "fuzz: 4/4, 1 failed"]


def _gpu_test_tool():
    spec = importlib.util.spec_from_file_location("gpu_test", ROOT / "benchmarks" / "tools" / "gpu_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stopped_runs_counts_come_from_its_workers_logs(tmp_path):
    """``gpu-test fuzz`` stopped by its time limit counts what the workers' logs hold: finished
    configurations, and the one a restarted worker died in; not the ones still running."""
    def log(name, lines):
        (tmp_path / "fuzz.jsonl.parts" / name).write_text(
            "".join(json.dumps(line) + "\n" for line in lines) + '{"index": 4, "o')  # a line cut by the kill

    (tmp_path / "fuzz.jsonl.parts").mkdir()

    bad = {"index": 6, "ok": False, "problems": ["max error 1.0"], "config": ""}
    log("worker0.0.jsonl", [{"start": 5}, _record(5), {"start": 7}])  # died in 7, restarted
    log("worker0.1.jsonl", [{"start": 9}, _record(9), {"start": 11}])  # stopped while in 11
    log("worker1.0.jsonl", [{"start": 6}, bad, {"start": 8}, _record(8), {"done": True, "compiled": 2}])
    counts = _gpu_test_tool().unfinished_fuzz_counts(tmp_path / "fuzz.jsonl")
    assert counts["configurations"] == 5 and counts["failed"] == 2  # 5, 7, 9, 6, 8
    assert {f["index"] for f in counts["failures"]} == {6, 7}


def test_a_part_kills_its_process_group_when_it_ends(tmp_path):
    """Children a part's command leaves behind (the fuzzer's workers, pytest's) are killed with
    it: at the limit, and after a normal exit too."""
    tool = _gpu_test_tool()
    for limit, status in ((1.0, "timeout"), (30.0, 0)):
        pid_file = tmp_path / f"child-{status}.pid"
        # a child that would sleep on for a minute; the command itself waits at the limit or exits
        script = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
                  f"'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(child.pid)); "
                  f"time.sleep(10 if {status!r} == 'timeout' else 0)")
        assert tool.run([sys.executable, "-c", script], tmp_path / "part.log", limit)[0] == status
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by its init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("status, summary", [("timeout", None), (1, None), (0, {"configurations": 3, "failed": 0})])
def test_a_fuzz_part_is_complete_only_with_its_summary(tmp_path, monkeypatch, status, summary):
    """A run stopped or dead without its summary counts its logs (never an earlier run's) and is
    not complete; a finished one reads its summary."""
    tool = _gpu_test_tool()
    stale = tmp_path / "fuzz.jsonl.parts"
    stale.mkdir()
    (stale / "worker0.0.jsonl").write_text(json.dumps(_record(1)) + "\n")  # an earlier run's

    def fake_run(cmd, log, limit):
        assert not stale.exists() and not (tmp_path / "fuzz.jsonl.summary.json").exists()
        if summary is not None:
            (tmp_path / "fuzz.jsonl.summary.json").write_text(json.dumps(summary))
        (tmp_path / "fuzz.jsonl").write_text(json.dumps(_record(0)) + "\n")
        return status, 1.0

    (tmp_path / "fuzz.jsonl.summary.json").write_text(json.dumps({"configurations": 99, "failed": 0}))
    monkeypatch.setattr(tool, "run", fake_run)
    result = tool.part_fuzz(argparse.Namespace(configs=3, seed=SEED, limit=10.0), tmp_path)
    assert result["complete"] is (summary is not None) and result["ok"] is (summary is not None)
    assert result["configurations"] == (3 if summary else 1)


def test_a_stopped_single_process_runs_counts_come_from_its_log(tmp_path):
    bad = {"index": 1, "ok": False, "problems": ["max error 1.0"], "config": ""}
    (tmp_path / "fuzz.jsonl").write_text(json.dumps(_record(0)) + "\n" + json.dumps(bad) + "\n" + '{"ind')
    counts = _gpu_test_tool().unfinished_fuzz_counts(tmp_path / "fuzz.jsonl")
    assert counts == {"configurations": 2, "failed": 1, "failures": [{"index": 1, "problems": ["max error 1.0"]}]}


@pytest.mark.gpu
@pytest.mark.parametrize("index", GPU_REGRESSIONS)
def test_gpu_run_failures_stay_fixed(index):
    space = fuzz.space_for("cuda", None)
    record = fuzz.run_config(draw(GPU_SEED, index, make_classes(GPU_SEED, space), space), "cuda")
    assert record["ok"], (record["config"], record["problems"])
