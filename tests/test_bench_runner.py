"""The suite runner on tiny CPU shapes: checked rows, a wrong provider flagged, figures, speedups;
and the accuracy windows that let large shapes be checked on slices."""

import pytest
import torch

from flashkernel import reference
from flashkernel.bench import accuracy, measure, registry, runner, suites
from flashkernel.bench.providers import Prepared, Provider

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = runner.RunConfig(device=DEVICE, check_window=None,
                          settings=measure.Settings(warmup_ms=1, rep_ms=2, min_samples=3, cpu_reps=1))
TIMER = "cuda-events" if DEVICE == "cuda" else "cpu-interpreter"


def pick(workload, *names):
    return registry.select(registry.providers_for(workload), list(names))


def broken_provider(workload="prefill"):
    """Returns zeros of the right shape: plausible, and wrong."""
    def build(inputs):
        return Prepared(lambda: torch.zeros_like(inputs.q))

    return Provider("broken", workload, "zeros", lambda _d: None, build)


def raising_provider():
    def build(inputs):
        raise RuntimeError("no kernel for this shape")

    return Provider("raises", "prefill", "raises", lambda _d: None, build)


def by_provider(rows):
    return {r["provider"]: r for r in rows}


def test_prefill_suite_checks_times_and_flags():
    cases = [suites.PrefillCase(2, 20, 20, 2, 1, 32, causal=True), suites.PrefillCase(1, 9, 33, 2, 2, 16, causal=True)]
    chosen = pick("prefill", "flashkernel", "sdpa-math") + [broken_provider(), raising_provider()]
    result = runner.run_suite("prefill", cases, chosen, CONFIG, progress=False)
    assert len(result.rows) == 2 * 4
    for case in cases:
        rows = by_provider([r for r in result.rows if r["case"] == case.label()])
        ours, math, broken, raises = rows["flashkernel"], rows["sdpa-math"], rows["broken"], rows["raises"]
        assert ours["status"] == "ok" and ours["timer"] == TIMER and ours["median_ms"] > 0
        assert ours["max_err"] <= ours["err_bound"]
        assert ours["flops"] == 4 * case.batch * case.heads * case.head_dim * sum(
            int(x) for x in reference.causal_mask(case.seqlen_q, case.seqlen_k).sum(dim=1))
        assert math["status"] == "ok" and math["flashkernel_speedup"] == pytest.approx(
            math["median_ms"] / ours["median_ms"])
        assert broken["status"] == "wrong" and "median_ms" not in broken and "flashkernel_speedup" not in broken
        assert "max error" in broken["message"]
        assert raises["status"] == "error" and "no kernel for this shape" in raises["message"]


def test_decode_suite():
    case = suites.DecodeCase(batch=2, context=37, heads=4, kv_heads=2, head_dim=32, page_size=16)
    names = ("flashkernel", "flashkernel-paged", "flashkernel-baseline", "sdpa-math")
    chosen = pick("decode", *names) + [broken_provider("decode")]
    result = runner.run_suite("decode", [case], chosen, CONFIG, progress=False)
    rows = by_provider(result.rows)
    for name in names:
        assert rows[name]["status"] == "ok", rows[name].get("message")
        assert rows[name]["bytes"] == 2 * 2 * 37 * 2 * 32 * 2 + 2 * 2 * 1 * 4 * 32 * 2
        assert rows[name]["model_steps_per_s"] > 0 and "model_steps_bound" not in rows[name]  # no ceilings given
        assert ("graph_median_ms" in rows[name]) == (DEVICE == "cuda")  # CUDA graphs need CUDA
    assert rows["broken"]["status"] == "wrong"


def test_figures_use_the_ceilings():
    case = suites.DecodeCase(batch=1, context=1024)
    config = runner.RunConfig(device="cpu", ceilings={"copy_gbps": 4000.0, "matmul_tflops": 800.0}, model_layers=32)
    row = {"status": "ok", "median_ms": 0.02, "graph_median_ms": 0.01}
    runner.add_figures(row, case, config)
    assert row["bytes"] == 2 * 1024 * 8 * 128 * 2 + 2 * 32 * 128 * 2
    assert row["graph_gbps"] == pytest.approx(row["bytes"] / 1e-5 / 1e9)
    assert row["fraction_of_bandwidth"] == pytest.approx(row["graph_gbps"] / 4000.0)
    per_step = 32 * 2 * 1024 * 8 * 128 * 2
    assert row["model_bytes_per_step"] == per_step
    assert row["model_steps_bound"] == pytest.approx(4000e9 / per_step)
    assert row["model_steps_per_s"] == pytest.approx(1e3 / (32 * 0.01))


def test_speedups_only_between_ok_rows():
    rows = [
        {"case": "a", "provider": "flashkernel", "status": "ok", "median_ms": 2.0, "graph_median_ms": 1.0},
        {"case": "a", "provider": "x", "status": "ok", "median_ms": 4.0, "graph_median_ms": 3.0},
        {"case": "a", "provider": "y", "status": "wrong"},
        {"case": "b", "provider": "flashkernel", "status": "wrong"},
        {"case": "b", "provider": "x", "status": "ok", "median_ms": 1.0},
    ]
    runner.add_speedups(rows)
    assert rows[1]["flashkernel_speedup"] == 2.0 and rows[1]["graph_flashkernel_speedup"] == 3.0
    assert rows[0]["flashkernel_speedup"] == 1.0
    assert "flashkernel_speedup" not in rows[2] and "flashkernel_speedup" not in rows[4]


def test_paged_layout_round_trip():
    cache = torch.randn(3, 37, 2, 8)
    table = torch.randperm(3 * 3).to(torch.int32).view(3, 3)
    pages = runner.paged_layout(cache, table, 16)
    assert pages.shape == (9, 16, 2, 8)
    for b in range(3):
        assert torch.equal(reference.cache_prefix(pages, b, 37, table), cache[b])


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(40, 40), (40, 13), (13, 40), (33, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_windowed_truth_equals_slices_of_the_full_truth(seqlen_q, seqlen_k, causal):
    q = torch.randn(3, seqlen_q, 2, 8, dtype=torch.float64)
    k = torch.randn(3, seqlen_k, 1, 8, dtype=torch.float64)
    v = torch.randn_like(k)
    full, _ = reference.attention(q, k, v, causal=causal)
    truth = accuracy.dense_truth(q, k, v, causal=causal, window=5)
    assert [(w.batch, w.row_start, w.row_stop) for w in truth.windows] == [
        (b, r0, r1) for b in (0, 2) for r0, r1 in ((0, 5), (seqlen_q - 5, seqlen_q))]
    for w, exact in zip(truth.windows, truth.truth):
        assert torch.allclose(exact, full[w.batch : w.batch + 1, w.row_start : w.row_stop], atol=1e-12)
    assert accuracy.compare(full.to(torch.float32), truth).ok


def test_accuracy_rule():
    bound = accuracy.error_bound(1e-3, 1.0, torch.float16)
    acc = accuracy.Accuracy(max_err=2.5e-3, torch_err=1e-3, bound=bound, has_nan=False)
    assert acc.ok and acc.ratio == pytest.approx(2.5)
    assert not accuracy.Accuracy(1.0, 1e-3, 3e-3, False).ok
    assert not accuracy.Accuracy(0.0, 1e-3, 3e-3, True).ok
    assert accuracy.Accuracy(1e-3, 0.0, 1.0, False).ratio == float("inf")
    assert accuracy.wrong_shape(torch.zeros(1, 2), (1, 3)) == "output shape (1, 2), expected (1, 3)"


def test_default_sweeps():
    prefill = suites.prefill_cases(suites.SweepSpec())
    assert len(prefill) == 6 * 3 * 2
    assert all(c.batch * c.seqlen_q == 16384 and c.heads * c.head_dim == 2048 for c in prefill)
    decode = suites.decode_cases(suites.SweepSpec())
    assert {(c.batch, c.context) for c in decode} == {
        (b, c) for b in (1, 8, 64) for c in (1024, 4096, 32768, 131072) if b * c <= 2 * 1024 * 1024}
    assert len(decode) == 11 and all((c.heads, c.kv_heads, c.head_dim) == (32, 8, 128) for c in decode)
    custom = suites.prefill_cases(suites.SweepSpec(seqlens=[100], head_dims=[64], causal="yes", batches=[1, 3],
                                                   heads=8, kv_heads=2, dtypes=("float16",)))
    assert [(c.batch, c.heads, c.kv_heads, c.causal, c.dtype) for c in custom] == [
        (1, 8, 2, True, "float16"), (3, 8, 2, True, "float16")]
