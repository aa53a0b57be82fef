"""Timing statistics and the timing loops (CUDA ones driven by a fake CUDA on CPU)."""

import contextlib
import time

import numpy as np
import pytest
import torch

from flashkernel.bench import measure


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.random.rand(37))])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_quantile_matches_numpy(values, q):
    assert measure.quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        measure.quantile([], 0.5)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        measure.quantile([1.0], 1.5)


def test_summarize():
    t = measure.summarize([4.0, 1.0, 3.0, 2.0, 10.0], measure.CUDA_EVENTS, calls_per_sample=3)
    assert t.median_ms == 3.0
    assert t.p10_ms == pytest.approx(1.4) and t.p90_ms == pytest.approx(7.6)
    assert (t.samples, t.calls_per_sample, t.timer) == (5, 3, "cuda-events")


def test_plan_counts():
    settings = measure.Settings(warmup_ms=10, rep_ms=40, min_samples=10, max_samples=300, sample_ms=0.5)
    # A slow call: one warm-up call, one call per sample, at least min_samples samples.
    assert measure.plan_counts(100.0, settings) == (1, 1, 10)
    # A 1 ms call: 10 warm-up calls, 40 samples.
    assert measure.plan_counts(1.0, settings) == (10, 1, 40)
    # A 10 us call: samples batch 50 calls to last 0.5 ms; 80 samples fill 40 ms.
    assert measure.plan_counts(0.01, settings) == (1000, 50, 80)
    # Absurdly fast: capped.
    warmup, per_sample, samples = measure.plan_counts(0.0, settings)
    assert warmup == 1000 and per_sample == 100 and samples <= 300


def test_rotation_copies():
    l2 = 50 * 2**20
    assert measure.rotation_copies(l2, l2) == 1
    assert measure.rotation_copies(4 * l2, l2) == 1
    assert measure.rotation_copies(l2 // 2, l2) == 4
    assert measure.rotation_copies(10 * 2**20, l2) == 10
    assert measure.rotation_copies(1024, l2) == 32  # capped
    assert measure.rotation_copies(1024, 0) == 1  # no L2 known (CPU)


def test_time_cpu_cycles_through_copies():
    seen = []
    calls = [lambda i=i: seen.append(i) for i in range(2)]
    timing = measure.time_cpu(calls, measure.Settings(cpu_reps=3))
    assert seen == [0, 1, 0]
    assert timing.timer == "cpu-interpreter" and timing.samples == 3 and timing.median_ms >= 0


class FakeEvent:
    """Records host time; elapsed_time in ms like torch.cuda.Event."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class FakeStream:
    def wait_stream(self, other):
        pass


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1
        time.sleep(1e-4)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Just enough of torch.cuda for the timing loops to run on a CPU."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **k: contextlib.nullcontext())


def test_time_cuda_with_fake_events(fake_cuda):
    counts = [0, 0]

    def make(i):
        def call():
            counts[i] += 1
            time.sleep(2e-4)
        return call

    settings = measure.Settings(warmup_ms=1, rep_ms=5, min_samples=5, max_samples=50, sample_ms=0.5)
    timing = measure.time_cuda([make(0), make(1)], settings)
    assert timing.timer == "cuda-events"
    assert 5 <= timing.samples <= 50 and timing.calls_per_sample >= 1
    assert 0.1 < timing.median_ms < 50 and timing.p10_ms <= timing.median_ms <= timing.p90_ms
    assert abs(counts[0] - counts[1]) <= 1  # both input copies were used


def test_time_cuda_graph_with_fake_graph(fake_cuda):
    calls = []
    timing = measure.time_cuda_graph([lambda: calls.append(1)], measure.Settings(rep_ms=2, min_samples=3))
    assert timing.timer == "cuda-graph" and timing.calls_per_sample == 20
    assert len(calls) == 2 + 20  # side-stream warm-up, then the captured calls
    assert timing.median_ms > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_peak_memory_is_none_without_cuda():
    assert measure.peak_extra_memory_mb(lambda: None) is None
