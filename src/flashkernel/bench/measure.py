"""Timing and its statistics.

Three clocks, one result shape (:class:`Timing`):

* ``cuda-events``: CUDA events around samples of back-to-back calls after a warm-up, in the
  spirit of ``triton.testing.do_bench``. Calls are not synchronised one by one, so a call that
  is cheaper on the GPU than to launch shows its launch cost: what a Python caller sees.
* ``cuda-graph``: the same calls captured once in a CUDA graph and replayed; launch overhead
  disappears and what remains is GPU time.
* ``cpu-interpreter``: wall clock on a machine without CUDA, where flashkernel's kernels run in
  Triton's CPU interpreter. Such times say nothing about GPU speed.

Each function takes a list of zero-argument callables and cycles through them: the runner hands
over one call per copy of the inputs, so inputs that would sit in L2 are rotated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

Call = Callable[[], object]

CUDA_EVENTS = "cuda-events"
CUDA_GRAPH = "cuda-graph"
CPU_INTERPRETER = "cpu-interpreter"


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long to warm up and to measure, per provider and case."""

    # After a pause (a kernel compiling) the GPU clock takes ~0.1 s to ramp up; 10 ms of warm-up
    # measured short prefill cases at half speed (docs/perf-notes.md).
    warmup_ms: float = 200.0
    rep_ms: float = 40.0
    min_samples: int = 10
    max_samples: int = 300
    sample_ms: float = 0.5  # a sample batches calls until it lasts about this long
    cpu_reps: int = 3


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call times in milliseconds over ``samples`` samples of ``calls_per_sample`` calls."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    samples: int
    calls_per_sample: int
    timer: str


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation between order statistics.

    Matches ``numpy.quantile``'s default method: position ``q * (n - 1)`` in the sorted values.
    """
    if not values:
        raise ValueError("quantile of an empty sequence")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    lower = math.floor(position)
    upper = math.ceil(position)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def summarize(per_call_ms: Sequence[float], timer: str, calls_per_sample: int = 1) -> Timing:
    """Median, p10 and p90 of per-call times (one value per sample)."""
    return Timing(
        median_ms=quantile(per_call_ms, 0.5),
        p10_ms=quantile(per_call_ms, 0.1),
        p90_ms=quantile(per_call_ms, 0.9),
        samples=len(per_call_ms),
        calls_per_sample=calls_per_sample,
        timer=timer,
    )


def plan_counts(estimate_ms: float, settings: Settings) -> tuple[int, int, int]:
    """``(warmup_calls, calls_per_sample, samples)`` for a call that takes ``estimate_ms``."""
    estimate_ms = max(estimate_ms, 1e-4)
    warmup_calls = max(1, min(1000, math.ceil(settings.warmup_ms / estimate_ms)))
    calls_per_sample = max(1, min(100, math.ceil(settings.sample_ms / estimate_ms)))
    sample_ms = estimate_ms * calls_per_sample
    samples = math.ceil(settings.rep_ms / sample_ms)
    samples = max(settings.min_samples, min(settings.max_samples, samples))
    return warmup_calls, calls_per_sample, samples


def rotation_copies(working_set_bytes: int, l2_bytes: int, cap: int = 32) -> int:
    """How many input copies to cycle through so that consecutive calls do not hit in L2.

    One copy when the working set is larger than L2 already; otherwise enough copies to cover
    twice the L2 size (at most ``cap``).
    """
    if working_set_bytes <= 0 or working_set_bytes >= l2_bytes:
        return 1
    return max(2, min(cap, math.ceil(2 * l2_bytes / working_set_bytes)))


class Rotation:
    """Calls ``calls`` round-robin, remembering where it stopped (one input copy after another)."""

    def __init__(self, calls: Sequence[Call]):
        self.calls = calls
        self.position = 0

    def run(self, count: int) -> None:
        for _ in range(count):
            self.calls[self.position % len(self.calls)]()
            self.position += 1


def _events_ms(run_sample: Callable[[], None], samples: int) -> list[float]:
    """Time ``samples`` runs of ``run_sample`` with a pair of CUDA events each; ms per run."""
    import torch

    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for start, end in pairs:
        start.record()
        run_sample()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in pairs]


def estimate_ms(rotation: Rotation, repeats: int = 5) -> float:
    """Rough per-call time on the GPU (after one call that compiles / warms)."""
    import torch

    rotation.run(1)
    torch.cuda.synchronize()
    (total,) = _events_ms(lambda: rotation.run(repeats), 1)
    return total / repeats


def time_cuda(calls: Sequence[Call], settings: Settings = Settings()) -> Timing:
    """Per-call time of eager calls, measured with CUDA events after a warm-up."""
    import torch

    rotation = Rotation(calls)
    warmup, per_sample, samples = plan_counts(estimate_ms(rotation), settings)
    rotation.run(warmup)
    torch.cuda.synchronize()
    times = _events_ms(lambda: rotation.run(per_sample), samples)
    return summarize([t / per_sample for t in times], CUDA_EVENTS, per_sample)


def capture_graph(calls: Sequence[Call], calls_per_graph: int):
    """Capture ``calls_per_graph`` calls (cycling through ``calls``) into one CUDA graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        Rotation(calls).run(len(calls) * 2)  # warm-up off the default stream, as capture requires
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        Rotation(calls).run(calls_per_graph)
    torch.cuda.synchronize()
    return graph


def time_cuda_graph(calls: Sequence[Call], settings: Settings = Settings(), min_calls_per_graph: int = 20) -> Timing:
    """Per-call GPU time from replays of a graph that holds the calls back to back."""
    import torch

    calls_per_graph = max(len(calls), min_calls_per_graph)
    graph = capture_graph(calls, calls_per_graph)
    graph.replay()
    torch.cuda.synchronize()
    (replay_ms,) = _events_ms(graph.replay, 1)
    warmup, _, samples = plan_counts(replay_ms, settings)
    for _ in range(min(warmup, 50)):
        graph.replay()
    times = _events_ms(graph.replay, samples)
    return summarize([t / calls_per_graph for t in times], CUDA_GRAPH, calls_per_graph)


def time_cpu(calls: Sequence[Call], settings: Settings = Settings()) -> Timing:
    """Wall-clock time per call without CUDA (Triton interpreter); one call per sample."""
    times = []
    for i in range(settings.cpu_reps):
        start = time.perf_counter()
        calls[i % len(calls)]()
        times.append((time.perf_counter() - start) * 1e3)
    return summarize(times, CPU_INTERPRETER)


def peak_extra_memory_mb(call: Call) -> float | None:
    """MiB allocated on the GPU beyond what was allocated before one call (outputs, workspace)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - before) / 2**20


def time_provider(row: dict, name: str, make_call: Callable[[], Call], flops: float, warmup_ms: int,
                  rep_ms: int) -> Call | None:
    """``make_call()``'s call timed by ``triton.testing.do_bench`` (median, L2 flushed between
    calls) into ``row[name + "_ms"]`` and ``row[name + "_tflops"]``, or the error that stopped
    it into ``row[name + "_error"]`` (a provider that cannot run a shape is reported, not
    fatal). Returns the call, or None when it failed."""
    import torch
    from triton.testing import do_bench

    try:
        call = make_call()
        ms = do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
        return call
    except Exception as error:  # noqa: BLE001 - reported in the row
        row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        return None
    finally:
        torch.cuda.synchronize()
