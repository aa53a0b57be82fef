"""Seeded fuzzing of the whole public API against the float64 reference.

    python -m flashkernel.bench.fuzz --configs 10000 --seed 1 --out fuzz.jsonl    # 8 workers on a GPU
    python -m flashkernel.bench.fuzz --seed 1 --index 4321                        # rerun one, verbosely

Every configuration is a pure function of ``(seed, index)`` (``fuzz_space.py``: a kernel class,
then free lengths, batch, variant values, scale, magnitudes and the padding's contents; inputs
come from a torch generator seeded by both). It calls ``flash_attn_func``,
``flash_attn_varlen_func``, ``flash_attn_with_kvcache`` (contiguous or paged caches of every page
size, appending or not, 1 to 16 new tokens, automatic or fixed splits, key starts),
``standard_attention``, ``DecodePlan``, ``VarlenPlan`` or a ``KVCache`` serving loop, with every
variant and their combinations, GQA, strided, padded and misaligned inputs, and checks:

* the output against ``reference.py`` in float64, with the rule of ``flashkernel check``
  (``accuracy.error_bound``: at most 2x PyTorch's own error in the same dtype plus one epsilon
  of the largest output and the float32 rounding of the scores; the mean error likewise, as in
  the test suite; ``fuzz_checks.py``), no NaN anywhere;
* the LSE: rows with LSE ``-inf`` exactly where the reference has them, else within 5e-5
  relative;
* a KV cache after the call: exactly the expected appends, bit for bit, and nothing else in
  its buffer (padding included) changed; plans: bit-equal to the function they plan.

Long sequences are checked on a sample of query rows (``reference.attention(rows=...)``: each
sampled row against every key), so a 64k configuration costs its sample, not 64k x 64k float64
scores. Inputs live inside buffers filled with NaN or inf (padded layouts, cache slots past each
length, unused pages) and outputs are allocated filled with NaN: a read of anything outside the
call's data, or an element never written, shows up as NaN.

Classes bound the compiles (see ``fuzz_space.py``); on a GPU the configurations are run by
``--workers`` processes, each owning whole classes (no kernel compiles twice), and a worker that
dies (a CUDA error poisons its context) or hangs past ``--timeout`` is restarted after the
offending configuration, which is logged as a failure. The log has one JSON line per
configuration; the summary (stdout, and ``<out>.summary.json``) counts them. Exit status 1 when
any configuration failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from .fuzz_checks import RUNNERS, Inputs, Outcome
from .fuzz_space import Config, Space, class_of, draw, make_classes

GENERATOR_VERSION = 1  # bump when a change would make (seed, index) draw another configuration


# --- one configuration ---------------------------------------------------------------------------


@contextlib.contextmanager
def poisoned_outputs():
    """Outputs (and temporaries) the library allocates start as NaN, so an element no kernel
    wrote fails the check (``kernels/_launch.empty`` is the one allocation point)."""
    from ..kernels import _launch

    original = _launch.empty

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    _launch.empty = nan_empty
    try:
        yield
    finally:
        _launch.empty = original


def run_config(config: Config, device: str) -> dict:
    """Run and check one configuration; returns its log record (``ok``, errors, problems, time)."""
    start = time.perf_counter()
    try:
        with poisoned_outputs(), torch.no_grad():
            outcome = RUNNERS[config.cls.family](config, Inputs(config, device))
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - any exception is a finding, logged with the config
        outcome = Outcome()
        outcome.fail(f"raised {type(exc).__name__}: {str(exc)[:300]}")
    return {"index": config.index, "class": config.cls.id, "family": config.cls.family,
            "dtype": config.cls.dtype, "ok": not outcome.problems, "err": _finite(outcome.err),
            "torch_err": _finite(outcome.torch_err), "bound": _finite(outcome.bound),
            "lse_err": _finite(outcome.lse_err), "rows": outcome.rows, "problems": outcome.problems,
            "ms": round(1e3 * (time.perf_counter() - start), 2), "config": config.label()}


def _finite(x: float):
    return None if x is None or not math.isfinite(x) else float(f"{x:.4g}")


def compiled_kernels() -> int:
    """Kernels Triton compiled in this process (every flashkernel kernel's specializations)."""
    from ..kernels import combine, decode, naive, prefill
    from ..kernels._common import optional_kernel_module

    kernels = [prefill._attention_fwd_kernel, decode._decode_kernel, decode._append_kernel, decode._baseline_kernel,
               combine._combine_kernel, naive._scores_kernel, naive._softmax_kernel, naive._pv_kernel]
    for name, attr in (("gluon.prefill", "_gluon_attention_kernel"), ("gluon.decode", "_gluon_decode_kernel")):
        module = optional_kernel_module(name)
        if module is not None:
            kernels.append(getattr(module, attr))
    total = 0
    for kernel in kernels:
        for entry in getattr(kernel, "device_caches", {}).values():
            total += len(entry[0])
    return total


# --- workers and the command line ----------------------------------------------------------------


def space_for(device: str, classes: int | None) -> Space:
    if device == "cuda":
        from ..kernels import dispatch

        probe = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
        gluon = all(dispatch._gluon_refusal(probe, module) is None
                    for module in (dispatch._gluon_prefill_module(), dispatch._gluon_decode_module()))
        space = Space.gpu(gluon)
    else:
        space = Space.cpu()
    return dataclasses.replace(space, classes=classes) if classes else space


def run_worker(seed: int, indices, space: Space, device: str, log) -> None:
    """Run ``indices`` in order, one JSON line each to ``log`` (a ``start`` line first, so a parent
    can tell which configuration a dead or hung worker was in)."""
    classes = make_classes(seed, space)
    for index in indices:
        log.write(json.dumps({"start": index}) + "\n")
        log.flush()
        record = run_config(draw(seed, index, classes, space), device)
        log.write(json.dumps(record) + "\n")
        log.flush()
        if not record["ok"] and device == "cuda" and not _context_usable():
            return  # a CUDA error left this process's context unusable: the parent restarts it
    log.write(json.dumps({"done": True, "compiled": compiled_kernels()}) + "\n")
    log.flush()


def _context_usable() -> bool:
    try:
        return torch.ones(1, device="cuda").sum().item() == 1.0
    except Exception:  # noqa: BLE001 - a sticky CUDA error
        return False


def read_worker_log(path: Path) -> tuple[dict, int | None, dict | None]:
    """``(records by index, index started but not finished, done line)`` of a worker's log."""
    records, started, done = {}, None, None
    if not path.exists():
        return records, started, done
    for line in path.read_text().splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if "start" in item:
            started = item["start"]
        elif "done" in item:
            done = item
        else:
            records[item["index"]] = item
            started = None
    return records, started, done


class _Worker:
    """A child process running a list of configurations, restarted after the one it died in."""

    def __init__(self, number: int, indices: list[int], args, directory: Path):
        self.number, self.pending, self.args, self.dir = number, list(indices), args, directory
        self.records: dict = {}
        self.compiled = 0
        self.restarts = 0
        self.proc = None
        self.log = None

    def start(self) -> None:
        self.log = self.dir / f"worker{self.number}.{self.restarts}.jsonl"
        self.proc = self._spawn()
        self.current, self.current_since = None, time.monotonic()

    def _spawn(self) -> subprocess.Popen:
        """``python -m flashkernel.bench.fuzz --child`` on the pending indices, logging to ``self.log``."""
        todo = self.log.with_suffix(".todo")
        todo.write_text(json.dumps(self.pending))
        cmd = [sys.executable, "-m", "flashkernel.bench.fuzz", "--seed", str(self.args.seed), "--child", str(todo),
               "--child-log", str(self.log)]
        if self.args.classes:
            cmd += ["--classes", str(self.args.classes)]
        with open(self.log.with_suffix(".err"), "w") as err:
            return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)

    def poll(self, timeout: float) -> bool:
        """Collect progress; restart after a crash or a hang. True while work remains."""
        records, started, done = read_worker_log(self.log)
        if started != self.current:
            self.current, self.current_since = started, time.monotonic()
        hung = started is not None and time.monotonic() - self.current_since > timeout
        if hung:
            self.proc.kill()
            self.proc.wait()
        code = self.proc.poll()
        if code is None:
            self._absorb(records)
            return True
        self._absorb(records)
        if done is not None:
            self.compiled += done["compiled"]
            self.pending = []
            return False
        if self.pending:  # died: the configuration it was in failed; go on after it
            culprit = started if started is not None else self.pending[0]
            why = f"timed out after {timeout:.0f} s" if hung else f"worker exited with status {code}"
            err_tail = self.log.with_suffix(".err").read_text()[-400:] if self.log.with_suffix(".err").exists() else ""
            self.records[culprit] = {"index": culprit, "ok": False, "problems": [f"{why}: {err_tail.strip()}"],
                                     "config": ""}
            self.pending = [i for i in self.pending if i not in self.records]
            self.restarts += 1
            if self.pending:
                self.start()
                return True
        return False

    def _absorb(self, records: dict) -> None:
        self.records.update(records)
        self.pending = [i for i in self.pending if i not in self.records]


def run_parallel(args, space: Space, indices: list[int], progress) -> tuple[list[dict], int]:
    """Run ``indices`` on ``args.workers`` child processes, each owning whole classes. Their logs
    go to ``<out>.parts/`` (kept if this process is killed; removed once merged)."""
    classes = make_classes(args.seed, space)
    shares: list[list[int]] = [[] for _ in range(args.workers)]
    for index in indices:
        shares[class_of(args.seed, index, classes).id % args.workers].append(index)
    with contextlib.ExitStack() as stack:
        if args.out:
            parts = Path(f"{args.out}.parts")
            shutil.rmtree(parts, ignore_errors=True)  # an earlier, stopped run's logs
            parts.mkdir(parents=True)
        else:
            parts = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flashkernel-fuzz-")))
        workers = [_Worker(n, share, args, parts) for n, share in enumerate(shares) if share]
        for worker in workers:
            worker.start()
        running = list(workers)
        while running:
            time.sleep(1.0)
            running = [w for w in running if w.poll(args.timeout)]
            if progress:
                progress(sum(len(w.records) for w in workers), len(indices),
                         [r for w in workers for r in w.records.values() if not r["ok"]])
        records = [r for w in workers for r in w.records.values()]
        if args.out:
            shutil.rmtree(parts)
        return sorted(records, key=lambda r: r["index"]), sum(w.compiled for w in workers)


def run_serial(args, space: Space, indices: list[int], device: str, progress) -> tuple[list[dict], int]:
    """Run ``indices`` here, one after the other; each record goes to ``args.out`` as it is made."""
    classes = make_classes(args.seed, space)
    records, failures = [], []
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(args.out, "w")) if args.out else None
        for index in indices:
            records.append(run_config(draw(args.seed, index, classes, space), device))
            if not records[-1]["ok"]:
                failures.append(records[-1])
            if log:
                log.write(json.dumps(records[-1]) + "\n")
                log.flush()
            if progress:
                progress(len(records), len(indices), failures)
    return records, compiled_kernels() if device == "cuda" else 0


def summarize(records: list[dict], args, space: Space, seconds: float, compiled: int, device: str) -> dict:
    from .results import environment

    failures = [r for r in records if not r["ok"]]
    classes = make_classes(args.seed, space)
    per_class = Counter(r["class"] for r in records if "class" in r)
    env = environment([], device)
    env["command"] = " ".join(["python -m flashkernel.bench.fuzz", *sys.argv[1:]])
    return {
        "schema": "flashkernel-fuzz/1", "environment": env, "seed": args.seed, "generator_version": GENERATOR_VERSION,
        "classes": space.classes, "configurations": len(records), "passed": len(records) - len(failures),
        "failed": len(failures), "seconds": round(seconds, 1), "compiled_kernels": compiled,
        "workers": args.workers, "by_family": dict(Counter(r["family"] for r in records if "family" in r)),
        "by_dtype": dict(Counter(r["dtype"] for r in records if "dtype" in r)),
        "rows_checked": sum(r.get("rows", 0) for r in records),
        "class_labels": {c.id: f"{per_class[c.id]} x {c.label()}" for c in classes},
        "failures": [{"index": r["index"], "problems": r["problems"], "config": r.get("config", "")}
                     for r in failures[:50]],
    }


def _progress_printer(stream=sys.stderr):
    """``show(done, total, failures)``: every 5 s a line of how many configurations ran and failed,
    and each failure (a record) as soon as it is seen, so a log cut short by a time limit still
    names them."""
    last, reported = [0.0], set()

    def show(done: int, total: int, failures: list[dict]) -> None:
        for r in failures:
            if r["index"] not in reported:
                reported.add(r["index"])
                print(f"fuzz: FAIL [{r['index']}] {'; '.join(r['problems'])}\n    {r.get('config', '')}", file=stream,
                      flush=True)
        now = time.monotonic()
        if now - last[0] >= 5 or done == total:
            last[0] = now
            print(f"fuzz: {done}/{total}, {len(failures)} failed", file=stream, flush=True)

    return show


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashkernel.bench.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=int, default=100, help="configurations to run (indices 0..N-1)")
    parser.add_argument("--first", type=int, default=0, help="index of the first configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index", type=int, nargs="*", help="run only these indices, verbosely")
    parser.add_argument("--classes", type=int, help="kernel classes (default: 96 on a GPU, 48 on CPU)")
    parser.add_argument("--workers", type=int, help="processes (default: 8 on a GPU, 1 on CPU)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one configuration may take")
    parser.add_argument("--out", type=Path, help="JSON-lines log (and <out>.summary.json)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-log", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from ..cli import select_device

    device = select_device()
    space = space_for(device, args.classes)
    if args.child:
        with open(args.child_log, "w") as log:
            run_worker(args.seed, json.loads(args.child.read_text()), space, device, log)
        return 0
    if args.index:
        classes = make_classes(args.seed, space)
        status = 0
        for index in args.index:
            config = draw(args.seed, index, classes, space)
            print(f"[{index}] class {config.cls.id}: {config.cls.label()}\n    {config.label()}")
            record = run_config(config, device)
            print(json.dumps(record, indent=1))
            status |= not record["ok"]
        return status
    if args.workers is None:
        args.workers = 8 if device == "cuda" else 1
    indices = list(range(args.first, args.first + args.configs))
    start = time.perf_counter()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.workers > 1:
        records, compiled = run_parallel(args, space, indices, _progress_printer())
        if args.out:
            args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    else:
        records, compiled = run_serial(args, space, indices, device, _progress_printer())
    summary = summarize(records, args, space, time.perf_counter() - start, compiled, device)
    if args.out:
        Path(f"{args.out}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"fuzz seed {args.seed}: {summary['configurations']} configurations, {summary['passed']} passed, "
          f"{summary['failed']} failed, {summary['classes']} classes, {compiled} kernels compiled, "
          f"{summary['seconds']} s")
    for failure in summary["failures"]:
        print(f"FAIL [{failure['index']}] {'; '.join(failure['problems'])}\n    {failure['config']}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
