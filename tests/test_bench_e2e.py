"""``flashkernel bench e2e`` (``bench/e2e.py``): the shipped model configurations, and every
section's code on a tiny model in Triton's interpreter (the timings mean nothing there; the rows,
the table and the result files do)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashkernel.bench import e2e  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.mark.parametrize("name, heads, kv_heads, head_dim", [
    ("llama3-8b", 32, 8, 128), ("gemma2-9b", 16, 8, 256), ("gpt-oss-20b", 64, 8, 64)])
def test_shipped_configs_have_the_models_attention_shapes(name, heads, kv_heads, head_dim):
    config = e2e.load_config(name, layers=6)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (heads, kv_heads, head_dim)
    assert config.num_hidden_layers == 6
    if name != "llama3-8b":  # alternating sliding / full layers, extended to the layer count
        assert config.layer_types == ["sliding_attention", "full_attention"] * 3


def tiny_config(name, layers=None):
    return transformers.AutoConfig.for_model(
        "llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=1)


def test_every_section_runs_and_writes_its_results(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e, "load_config", tiny_config)
    plan = e2e.Plan(models=("llama3-8b",), compiled_models=(), prefill_tokens=20, prompt=12, new_tokens=3,
                    batches=(2,), requests=3, request_prompts=(5, 20), request_new_tokens=3, accuracy_prompt=20,
                    greedy_tokens=3, greedy_prompts=2, repeats=1, generate_rounds=2, batching_rounds=1, dtype="float32",
                    device="cuda" if torch.cuda.is_available() else "cpu")
    rows = e2e.run(plan)
    assert all(r["status"] == "ok" for r in rows), [r.get("message") for r in rows]
    for r in rows:
        if r["section"] == "generate eager dynamic":  # every provider timed in each round
            assert r["runs"] == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"] and len(r["round_ms"]) == 2
    sections = {(r["section"], r["provider"]) for r in rows}
    for section in ("accuracy", "prefill", "generate eager dynamic"):
        assert {(section, "fk_attention"), (section, "sdpa")} <= sections
    assert {("batching", "paged|fk_attention"), ("batching", "paged|sdpa")} <= sections
    batching = [r for r in rows if r["section"] == "batching"]
    assert sorted((r["cuda_graphs"], r["provider"]) for r in batching) == [
        (False, "paged|fk_attention"), (False, "paged|sdpa"), (True, "paged|fk_attention"), (True, "paged|sdpa")]
    assert len({r["case"] for r in batching}) == 2  # one case per CUDA-graph setting: speedups pair within it
    for r in batching:  # a full warm-up, then every provider in each round
        assert r["runs"] == 1 and len(r["round_ms"]) == 1 and r["first_ms"] > 0 and r["tokens_per_s"] > 0
    by_key = {(r["section"], r["case"], r["provider"]): r for r in rows}
    greedy = [r for r in rows if "identical_tokens" in r]
    assert {r["provider"] for r in greedy} == {"fk_attention", "sdpa", "eager"}  # eager: a second exact one
    assert {r["identical_tokens"] for r in greedy} == {3}  # float32: the same tokens as sdpa
    assert {r["fp32_identical_tokens"] for r in greedy} == {3}
    assert all(r["identical_per_prompt"] == [3, 3] and r["all_identical_prompts"] == 2 for r in greedy)
    assert all(r["max_tie_gap"] < 1e-3 for r in greedy)  # every token float32's own argmax
    padded = by_key["accuracy", "b=2 left-padded", "fk_attention"]
    assert padded["top1_vs_baseline"] == 1.0 and padded["max_abs_vs_fp32"] < 1e-4
    for r in rows:
        if "median_ms" in r:
            mine = by_key[r["section"], r["case"], "paged|fk_attention" if r["section"] == "batching" else "fk_attention"]
            assert r["flashkernel_speedup"] == pytest.approx(r["median_ms"] / mine["median_ms"])
            if "round_ms" in r:  # paired within each round
                ratios = sorted(t / m for t, m in zip(r["round_ms"], mine["round_ms"]))
                half = len(ratios) // 2
                middle = ratios[half] if len(ratios) % 2 else (ratios[half - 1] + ratios[half]) / 2
                assert r["paired_speedup"] == pytest.approx(middle)
    assert "fk_attention speedup" in e2e.table(rows)
    assert "2/2 prompts all identical, median 3 (fp32: min 3)" in e2e.table(rows)

    e2e.write(rows, plan, ["bench", "e2e"], str(tmp_path), "cpu")
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["workload"] == "e2e" and len(doc["rows"]) == len(rows)
    assert (tmp_path / "e2e.csv").exists() and (tmp_path / "e2e.png").exists()


def test_append_keeps_the_rows_a_run_did_not_measure_in_their_order():
    def row(model, case, ms):
        return dict(model=model, section="batching", case=case, provider="p", median_ms=ms)

    old = [row("a", "c", 1.0), row("b", "c", 2.0)]
    new = [row("a", "c", 3.0), row("a", "c graphs", 4.0), row("z", "c", 5.0)]
    # a re-measured row stays where it was; a new case follows its model's rows; a new model goes last
    assert e2e.merged(old, new) == [new[0], new[1], old[1], new[2]]


class _Output:
    def __init__(self, tokens):
        self.generated_tokens = list(range(tokens))


class _BatchingModel:
    """Stands in for a transformers model in :func:`e2e.batching_rows`: records every
    ``generate_batch`` call (the implementation set last, the request count, the CUDA-graph
    setting) and returns ``max_new_tokens`` tokens per request."""

    def __init__(self):
        self.config = transformers.LlamaConfig(vocab_size=50)
        self.implementation = None
        self.calls = []

    def generate_batch(self, prompts, generation_config, continuous_batching_config):
        self.calls.append((self.implementation, len(prompts), continuous_batching_config.use_cuda_graph))
        return {i: _Output(generation_config.max_new_tokens) for i in range(len(prompts))}


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_batching_serves_the_whole_workload_once_then_alternates_the_providers(monkeypatch, cuda_graphs):
    model = _BatchingModel()
    monkeypatch.setattr(e2e, "use", lambda m, name: setattr(m, "implementation", name))
    plan = e2e.Plan(requests=5, request_prompts=(3, 9), request_new_tokens=4, batching_rounds=3)
    rows = e2e.batching_rows("m", model, ["fk_attention", "sdpa"], plan, cuda_graphs=cuda_graphs)
    graphs = True if cuda_graphs else None  # None: transformers decides (no graphs for these names)
    sdpa = ("paged|sdpa", 5, graphs)
    fk = ("paged|fk_attention", 5, graphs)
    assert model.calls == [fk, sdpa] + [fk, sdpa] + [sdpa, fk] + [fk, sdpa]  # warm-up, then rounds
    assert [r["provider"] for r in rows] == ["paged|fk_attention", "paged|sdpa"]
    assert {r["case"].endswith(", CUDA graphs") for r in rows} == {cuda_graphs}
    for r in rows:
        assert r["cuda_graphs"] is cuda_graphs and r["runs"] == 3 and len(r["round_ms"]) == 3
        assert r["tokens_per_s"] == pytest.approx(5 * 4 / (r["median_ms"] / 1e3))


def test_batching_steps_one_per_cuda_graph_setting():
    plan = e2e.Plan(models=("llama3-8b", "gemma2-9b"), sections=("batching",))
    assert e2e.planned_steps(plan) == [("llama3-8b", "batching"), ("llama3-8b", "batching cuda graphs")]
