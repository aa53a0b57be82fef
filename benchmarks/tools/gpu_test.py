"""The GPU reliability suite in one command: the test suite, the fuzzer, the sanitizers; one
results file with their counts.

    ./run.sh gpu-test                 # all four parts below, in order
    ./run.sh gpu-test tests           # pytest -n 4 over tests/ (the GPU cases run, the interpreter's skip)
    ./run.sh gpu-test tests --shard 1/2   # half of the test files (then --shard 2/2)
    ./run.sh gpu-test fuzz            # 10,000 fuzzed configurations (python -m flashkernel.bench.fuzz)
    ./run.sh gpu-test sanitize        # compute-sanitizer memcheck/racecheck/synccheck/initcheck
    ./run.sh gpu-test summary         # merge what the parts wrote into the results file

Each part writes its log and a small JSON of counts (with the GPU, versions and commit it ran
at) into ``--out`` (default ``benchmarks/results/<gpu>/reliability/``), and ``summary`` merges
whatever is there into ``reliability.json`` beside it (``--results``): configurations fuzzed and
failed, sanitizer runs and errors, tests passed and failed. Every part ends with a summary too.
So the parts can run in separate sessions, even on another machine than the summary: copy their
``--out`` directories together (the sanitizer's tools each leave their own JSON, so
``sanitize --tools memcheck racecheck`` and ``sanitize --tools synccheck initcheck`` add up), then
``summary --out DIR``. ``--limit`` stops a part after that many seconds (its log so far is kept,
a part's whole process group is killed when it ends; a fuzz part stopped by the limit, or
whose fuzzer died, counts the configurations its workers finished and the failures among them,
marked ``"complete": false``, and the fuzzer names each failure in its log as soon as it is
seen).
Exit status 1 when a part failed or found anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("tests", "fuzz", "sanitize")


def gpu_slug() -> str:
    import torch

    from flashkernel.bench.results import gpu_slug as slug

    return slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


def run(cmd: list[str], log: Path, limit: float) -> tuple[object, float]:
    """Run ``cmd`` from the repository root, its output to ``log``; ``(exit status or "timeout", seconds)``.
    ``cmd`` runs in a process group of its own, killed whole when it ends, at the limit or on an
    interrupt: the fuzzer's and pytest's worker processes, and whatever a timed-out sanitizer left,
    would otherwise go on using the GPU under the next part."""
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write(f"# {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            _kill_group(proc)
    return status, round(time.perf_counter() - start, 1)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group ``proc`` leads (its own: ``start_new_session``) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing of the group is left
        pass
    proc.wait()


def test_shard(shard: str) -> list[str]:
    """The test files of shard ``"i/n"``: files dealt largest first to the lightest shard (bytes
    as the weight), so ``1/2`` and ``2/2`` each take about half the suite."""
    index, count = (int(x) for x in shard.split("/"))
    loads, shards = [0] * count, [[] for _ in range(count)]
    for path in sorted((ROOT / "tests").glob("test_*.py"), key=lambda p: (-p.stat().st_size, p.name)):
        lightest = loads.index(min(loads))
        shards[lightest].append(str(path.relative_to(ROOT)))
        loads[lightest] += path.stat().st_size
    return sorted(shards[index - 1])


def part_tests(args, out: Path) -> dict:
    tag = args.shard.replace("/", "of")
    junit = out / f"gpu-tests-{tag}.xml"
    targets = args.pytest_args or test_shard(args.shard)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", str(args.test_workers), "-p", "no:cacheprovider",
           f"--junitxml={junit}", *targets]
    status, seconds = run(cmd, out / f"gpu-tests-{tag}.log", args.limit)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.exists():
        for suite in ElementTree.parse(junit).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
        junit.unlink()
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"command": " ".join(cmd), "exit": status, "seconds": seconds, "passed": passed, "failed": counts["failures"],
            "errors": counts["errors"], "skipped": counts["skipped"], "ok": status == 0}


def part_fuzz(args, out: Path) -> dict:
    log = out / "fuzz.jsonl"
    summary_file, parts = Path(f"{log}.summary.json"), Path(f"{log}.parts")
    for stale in (log, summary_file):  # an earlier run's: never counted as this one's
        stale.unlink(missing_ok=True)
    shutil.rmtree(parts, ignore_errors=True)
    cmd = [sys.executable, "-m", "flashkernel.bench.fuzz", "--configs", str(args.configs), "--seed", str(args.seed),
           "--out", str(log)]
    status, seconds = run(cmd, out / "fuzz.log", args.limit)
    complete = status != "timeout" and summary_file.exists()
    # else stopped by --limit, or died: what the workers had finished (their logs are kept)
    summary = json.loads(summary_file.read_text()) if complete else unfinished_fuzz_counts(log)
    return {"command": " ".join(cmd), "exit": status, "seconds": seconds, "seed": args.seed,
            "configurations": summary.get("configurations", 0), "failed": summary.get("failed"),
            "classes": summary.get("classes"), "compiled_kernels": summary.get("compiled_kernels"),
            "complete": complete, "failures": summary.get("failures", [])[:20],
            "ok": complete and status == 0 and summary.get("failed") == 0}


def unfinished_fuzz_counts(log: Path) -> dict:
    """``configurations``, ``failed`` and ``failures`` (index and problems) of a fuzz run with
    ``--out log`` that was stopped or died: from ``log`` itself for a run in one process, else from its
    workers' logs in ``<log>.parts`` (``worker<n>.<start>.jsonl``: a worker restarted after a
    crash or a hang has a log per start). A log that a later start followed and that ends inside
    a configuration names the one its worker died in: a failure. The configuration each worker's
    last log was in when the run stopped is not counted."""
    from flashkernel.bench.fuzz import read_worker_log

    parts = Path(f"{log}.parts")
    starts: dict[int, list[tuple[int, Path]]] = {}
    for path in parts.glob("worker*.jsonl"):
        worker, start = (int(n) for n in path.stem.removeprefix("worker").split("."))
        starts.setdefault(worker, []).append((start, path))
    records = {} if parts.is_dir() else read_worker_log(log)[0]
    for logs in starts.values():
        logs.sort()
        for number, (_, path) in enumerate(logs):
            done, started, _ = read_worker_log(path)
            records.update(done)
            if started is not None and number < len(logs) - 1:
                records[started] = {"index": started, "ok": False,
                                    "problems": ["its worker died or hung in it (restarted after it)"]}
    failures = [{"index": r["index"], "problems": r["problems"]} for r in records.values() if not r["ok"]]
    return {"configurations": len(records), "failed": len(failures), "failures": failures}


def part_sanitize(args, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tools" / "sanitize.py"), "--out", str(out / "sanitizer"),
           "--timeout", str(round(args.limit - 20)), "--tools", *args.tools]  # the tools run side by side
    status, seconds = run(cmd, out / f"sanitizer-{'-'.join(args.tools)}.log", args.limit)
    result = {"command": " ".join(cmd), "exit": status, "seconds": seconds}
    result.update(sanitizer_counts(out))
    result["ok"] = status == 0 and result["ok"]
    return result


def sanitizer_counts(out: Path) -> dict:
    """The sanitizer tools' results found in ``out/sanitizer`` (each tool's own JSON: tools run in
    separate sessions count together once their directories are copied together)."""
    tools = {}
    for path in sorted((out / "sanitizer").glob("*.json")):
        if path.name != "summary.json":
            t = json.loads(path.read_text())
            tools[t["tool"]] = {k: t.get(k) for k in ("errors", "known_hazards", "warnings", "exit", "seconds", "cases",
                                                      "cases_failed", "ok")}
    return {"runs": len(tools), "errors": sum(t["errors"] or 0 for t in tools.values()) if tools else None,
            "tools": tools, "ok": len(tools) == 4 and all(t["ok"] for t in tools.values())}


RUNNERS = {"tests": part_tests, "fuzz": part_fuzz, "sanitize": part_sanitize}


def environment(part: str) -> dict:
    """Where and at which commit the part ran (each part's JSON carries it: the results file can be
    made elsewhere, from the parts' files copied together)."""
    from flashkernel.bench import results

    import torch

    env = results.environment([], "cuda" if torch.cuda.is_available() else "cpu")
    env["command"] = " ".join(["./run.sh gpu-test", *sys.argv[1:]])
    env["part"] = part
    return env


def summarize(out: Path, results_file: Path) -> dict:
    """Merge each part's JSON (written by the latest run of that part) into ``results_file``."""
    parts = {}
    for name in ("fuzz", "sanitize"):
        path = out / f"{name}.json"
        if path.exists():
            parts[name] = json.loads(path.read_text())
    shards = [json.loads(p.read_text()) for p in sorted(out.glob("tests-*.json"))]
    if shards:  # the suite, possibly in shards run in separate sessions
        parts["tests"] = {key: sum(s[key] for s in shards) for key in ("passed", "failed", "errors", "skipped",
                                                                        "seconds")}
        parts["tests"].update(ok=all(s["ok"] for s in shards), shards=shards, environment=shards[0]["environment"])
    if (out / "sanitizer").is_dir():  # counted from every tool's own file, whichever session ran it
        parts.setdefault("sanitize", {}).update(sanitizer_counts(out))
    fuzz, sanitize, tests = parts.get("fuzz", {}), parts.get("sanitize", {}), parts.get("tests", {})
    doc = {
        "schema": "flashkernel-reliability/1",
        "environment": next((p["environment"] for p in parts.values() if "environment" in p), None),
        "configurations_fuzzed": fuzz.get("configurations", 0),
        "fuzz_failures": fuzz.get("failed"),
        "fuzz_seed": fuzz.get("seed"),
        "fuzz_complete": fuzz.get("complete", fuzz.get("exit") == 0) if fuzz else None,  # False: stopped or died
        "sanitizer_runs": sanitize.get("runs", 0),
        "sanitizer_errors": sanitize.get("errors"),
        "tests_passed": tests.get("passed"),
        "tests_failed": (tests.get("failed") or 0) + (tests.get("errors") or 0) if tests else None,
        "ok": bool(parts) and all(p.get("ok") for p in parts.values()) and set(parts) == set(PARTS),
        "parts": parts,
        "logs": sorted(os.path.relpath(p, results_file.parent) for p in out.rglob("*") if p.is_file()),
    }
    results_file.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", choices=[*PARTS, "summary", "all"], default=["all"])
    parser.add_argument("--out", type=Path, help="logs (default benchmarks/results/<gpu>/reliability)")
    parser.add_argument("--results", type=Path, help="the counts (default benchmarks/results/<gpu>/reliability.json)")
    parser.add_argument("--configs", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=20261124)
    parser.add_argument("--test-workers", type=int, default=4,
                        help="pytest workers (more runs the float64 references of the big tests out of memory)")
    parser.add_argument("--limit", type=float, default=570.0, help="seconds per part")
    parser.add_argument("--tools", nargs="+", default=["memcheck", "racecheck", "synccheck", "initcheck"],
                        help="the sanitizer part's tools (the others keep their last results)")
    parser.add_argument("--shard", default="1/1", help="tests part: run shard I/N of the test files (e.g. 1/2)")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                        help="what pytest runs instead of the shard's files; must come last")
    args = parser.parse_args(argv)
    parts = list(PARTS) if "all" in args.parts else [p for p in PARTS if p in args.parts]
    out = args.out or ROOT / "benchmarks" / "results" / gpu_slug() / "reliability"
    results_file = args.results or out.parent / "reliability.json"
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in parts:
        print(f"gpu-test {name} ...", flush=True)
        result = RUNNERS[name](args, out)
        result["environment"] = environment(name)
        filename = f"tests-{args.shard.replace('/', 'of')}.json" if name == "tests" else f"{name}.json"
        (out / filename).write_text(json.dumps(result, indent=1) + "\n")
        status |= not result["ok"]
        shown = {k: v for k, v in result.items() if k not in ("command", "tools", "environment")}
        print(f"gpu-test {name}: {json.dumps(shown)}", flush=True)
    doc = summarize(out, results_file)
    stopped = ", incomplete" if doc["fuzz_complete"] is False else ""
    print(f"{results_file}: fuzzed {doc['configurations_fuzzed']} ({doc['fuzz_failures']} failed{stopped}), sanitizer "
          f"{doc['sanitizer_runs']} runs ({doc['sanitizer_errors']} errors), tests {doc['tests_passed']} passed "
          f"({doc['tests_failed']} failed): {'ok' if doc['ok'] else 'NOT OK'}")
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
