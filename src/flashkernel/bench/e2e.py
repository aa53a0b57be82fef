"""End to end: Hugging Face transformers models on flashkernel against transformers' own attention.

    flashkernel bench e2e --out benchmarks/results/h200          # e2e.json, e2e.csv, e2e.png
    flashkernel bench e2e --quick                                # a ~2-minute smoke run
    python -m flashkernel.bench.e2e --models llama3-8b --sections prefill generate

Random-weight models (bf16, on the GPU) built from the configurations in ``bench/models/``:
Llama-3-8B's shapes (32 query / 8 KV heads of 128), Gemma-2-9B's (softcap, a 4096-key window on
every other layer, head dim 256) and gpt-oss-20b's (sinks, a 128-key window on every other layer,
32 experts), each cut to a few layers. Every model runs with ``attn_implementation="fk_attention"``
(``flashkernel.integrations.transformers``) and with each baseline it supports: ``sdpa`` (gpt-oss
has none: ``eager``), and ``flash_attention_2`` / ``flash_attention_3`` when importable. One model
object per configuration; ``set_attn_implementation`` switches it, so every provider has the
same weights.

Sections (each measured after a warm-up that compiles what it needs):

* ``accuracy``: logits of a left-padded and an unpadded batch against the same model in
  float32 (eager attention): max abs difference, top-1 agreement with the baseline (transformers'
  implementation that computes the model exactly: ``sdpa``, ``eager`` for Gemma 2 and gpt-oss);
  greedy tokens of unpadded prompts (eight; two with ``--quick``): where they first differ from
  the baseline's, in the model's dtype and with the model in float32, and how far each token is
  from the float32 model's choice (random weights give flat logits, whose near-ties bf16 rounding flips);
  transformers' ``eager`` attention is compared with the baseline as well.
* ``prefill``: one forward of batch 1 x 8k tokens (logits of the last token only), ms.
* ``generate``: ``model.generate`` at batch 1 and 8, 2k-token prompts, 256 new tokens (greedy,
  no stop token), tokens/s over the whole call (median); eager with the dynamic cache (the
  providers alternate over five rounds: the host's speed drifts between runs by more than the
  rows differ; the speedup is also given as the median of the rounds' own ratios), and compiled
  with the static cache (transformers' default ``CompileConfig``: ``torch.compile`` of the decode
  step, ``mode="reduce-overhead"``; compile time reported apart).
* ``batching``: ``model.generate_batch`` (continuous batching) of 64 requests, prompts of 128 to
  2048 tokens, 256 new tokens each: ``paged|fk_attention`` against ``paged|sdpa`` (and the
  FlashAttention ones when importable); requests/s and generated tokens/s. Twice: with
  transformers' defaults for each (it turns CUDA graphs on only for names containing "flash"),
  and with ``use_cuda_graph=True`` for all. Each provider serves the whole workload once before
  it is timed (the first run compiles kernels for the batch shapes it meets: several seconds,
  reported as ``first_ms``), then the providers alternate over three rounds
  (``Plan.batching_rounds``).

The default run takes about 12 minutes on an H200 (compiles included), ``--quick`` about 2. The
result files are rewritten after every step, so an interrupted run keeps what it measured; a run
split by ``--models`` / ``--sections`` into several commands collects its rows with ``--append``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent / "models"
MODELS = ("llama3-8b", "gemma2-9b", "gpt-oss-20b")
SECTIONS = ("accuracy", "prefill", "generate", "batching")
FLASHKERNEL = "fk_attention"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures."""

    models: tuple[str, ...] = MODELS
    sections: tuple[str, ...] = SECTIONS
    layers: int = 4
    prefill_tokens: int = 8192
    prompt: int = 2048
    new_tokens: int = 256
    batches: tuple[int, ...] = (1, 8)
    compiled_models: tuple[str, ...] = ("llama3-8b",)  # compiles dominate the run's time
    compiled_batches: tuple[int, ...] = (1, 8)
    batching_models: tuple[str, ...] = ("llama3-8b",)
    requests: int = 64
    request_prompts: tuple[int, int] = (128, 2048)
    request_new_tokens: int = 256
    accuracy_prompt: int = 512
    greedy_tokens: int = 32
    greedy_prompts: int = 8
    batching_rounds: int = 3  # continuous batching: rounds of every provider, alternating, after a full warm-up
    batching_graphs: tuple[bool, ...] = (False, True)  # transformers' default, and use_cuda_graph=True
    repeats: int = 2
    generate_rounds: int = 5  # eager generate: rounds of every provider, alternating
    dtype: str = "bfloat16"
    device: str = "cuda"


QUICK = Plan(models=("llama3-8b",), prefill_tokens=2048, prompt=1024, new_tokens=64, compiled_batches=(1,),
             requests=16, request_prompts=(128, 1024), request_new_tokens=64, accuracy_prompt=256, repeats=1,
             generate_rounds=2, greedy_prompts=2, batching_rounds=1)


# ---- models --------------------------------------------------------------------------------------


def load_config(name: str, layers: int | None = None):
    """The transformers configuration shipped as ``bench/models/<name>.json`` (``layers`` layers;
    alternating layer types are extended or cut to match)."""
    import transformers

    fields = json.loads((MODELS_DIR / f"{name}.json").read_text())
    fields.pop("_comment", None)
    model_type = fields.pop("model_type")
    if layers is not None:
        fields["num_hidden_layers"] = layers
        if "layer_types" in fields:
            pattern = fields["layer_types"]
            fields["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return transformers.AutoConfig.for_model(model_type, **fields)


def build_model(name: str, layers: int | None = None, dtype: str = "bfloat16", device: str = "cuda"):
    """A random-weight model of the shipped configuration ``name``, on ``device`` (initialised
    there), in eval mode, with ``fk_attention`` registered."""
    import torch
    import transformers

    import flashkernel.integrations.transformers  # noqa: F401 - registers fk_attention

    config = load_config(name, layers)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def baselines(model) -> list[str]:
    """transformers' attention implementations to compare with on this model and machine."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    names = ["sdpa" if model._supports_sdpa else "eager"]
    if model._supports_flash_attn:
        names += [f"flash_attention_{v}" for v, ok in ((2, is_flash_attn_2_available()), (3, is_flash_attn_3_available()))
                  if ok]
    return names


def exact_baseline(model) -> str:
    """transformers' implementation that computes this model exactly, to compare logits with:
    ``sdpa``, or ``eager`` where sdpa cannot (Gemma 2's softcap, which transformers' sdpa path
    drops; gpt-oss's sinks, for which it has no sdpa path)."""
    softcap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    return "sdpa" if model._supports_sdpa and not softcap else "eager"


def use(model, provider: str):
    model.set_attn_implementation(provider)
    return model


# ---- timing ---------------------------------------------------------------------------------------


def timed(fn, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` (synchronised around each)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    seconds = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return seconds


def random_prompts(model, batch: int, length: int, generator):
    """Token ids ``[batch, length]`` (never the pad token) and an all-ones attention mask."""
    import torch

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (batch, length), generator=generator).to(model.device)
    pad = model.config.get_text_config().pad_token_id
    if pad is not None:
        ids = ids.masked_fill(ids == pad, pad + 1 if pad + 1 < vocab else pad - 1)
    return ids, torch.ones_like(ids)


# ---- sections -------------------------------------------------------------------------------------


def greedy_tokens(model, provider: str, prompt, mask, tokens: int):
    """``tokens`` greedy tokens after ``prompt`` (no stop token, no compile)."""
    use(model, provider)
    return model.generate(prompt, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False, disable_compile=True)[0, prompt.shape[1]:]


def tie_gaps(reference, prompt, tokens):
    """How far each greedy token is from the float32 model's choice: ``max(logits) -
    logits[token]`` of ``reference`` (the model in float32) at each generated position, teacher
    forced on ``prompt + tokens``. 0 where the token is float32's argmax; a token chosen where two
    candidates are closer than the bf16 model's own logit error is a tie, not an error."""
    import torch

    ids = torch.cat([prompt[0], tokens])[None]
    with torch.no_grad():
        logits = reference(ids).logits[0, prompt.shape[1] - 1:-1].float()
    return logits.max(-1).values - logits.gather(-1, tokens[:, None])[:, 0]


def _identical(a, b) -> int:
    same = (a == b).tolist()
    return same.index(False) if False in same else len(same)


def accuracy_rows(name, model, providers, plan: Plan, generator) -> list[dict]:
    """Logits against float32 (left-padded batch of 2, unpadded batch of 1) and greedy tokens
    (:func:`greedy_rows`), each provider against :func:`exact_baseline` (run too if it is not
    among them).

    Greedy tokens, three ways: in the model's dtype against the baseline's (random weights give
    flat logits, so bf16 rounding flips near-ties: ``identical_tokens`` is the fewest tokens
    before the first difference over the prompts, ``identical_per_prompt`` each prompt's); each
    token's :func:`tie_gaps` against the float32 model (``max_tie_gap``, in logit units, beside
    the baseline's logit error ``noise``); and the same model in float32, where there are no bf16
    ties, against the baseline in float32 (``fp32_identical_tokens``, the fewest).
    transformers' ``eager`` attention is compared too where the baseline is another: two exact
    implementations of transformers' own, whose greedy tokens part where bf16 rounding flips ties."""
    import torch

    baseline = exact_baseline(model)
    providers = list(dict.fromkeys([*providers, baseline, "eager"]))
    rows = []
    ids, mask = random_prompts(model, 2, plan.accuracy_prompt, generator)
    mask[0, : plan.accuracy_prompt // 4] = 0  # sequence 0 is left-padded
    cases = {"b=2 left-padded": (ids, mask), "b=1": (ids[1:], mask[1:])}
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = {}
    with torch.no_grad():
        for provider in providers:
            use(model, provider)
            for case, (x, m) in cases.items():
                logits[case, provider] = model(x, attention_mask=m, position_ids=positions[-x.shape[0]:]).logits.float()
        reference = use(copy.deepcopy(model).float(), "eager")
        truth = {case: reference(x, attention_mask=m, position_ids=positions[-x.shape[0]:]).logits.float()
                 for case, (x, m) in cases.items()}
    noise = 0.0
    for case, (x, m) in cases.items():
        valid = m.bool()
        base_top = logits[case, baseline][valid].argmax(-1)
        for provider in providers:
            got = logits[case, provider][valid]
            row = dict(section="accuracy", model=name, case=case, provider=provider,
                       max_abs_vs_fp32=(got - truth[case][valid]).abs().max().item(),
                       max_abs_vs_baseline=(got - logits[case, baseline][valid]).abs().max().item(),
                       top1_vs_baseline=(got.argmax(-1) == base_top).float().mean().item(),
                       top1_vs_fp32=(got.argmax(-1) == truth[case][valid].argmax(-1)).float().mean().item(),
                       baseline=baseline)
            rows.append(row)
            if provider == baseline:
                noise = max(noise, row["max_abs_vs_fp32"])
    rows += greedy_rows(name, model, reference, providers, baseline, noise, plan, generator)
    del reference
    return rows


def greedy_rows(name, model, reference, providers, baseline, noise, plan: Plan, generator) -> list[dict]:
    """Greedy tokens of ``plan.greedy_prompts`` unpadded prompts, each provider against the
    baseline: per prompt the tokens before the first difference in the model's dtype
    (``identical_per_prompt``) and with the model in float32 (``fp32_identical_per_prompt``),
    and the largest :func:`tie_gaps` of the provider's tokens over all prompts. One prompt says
    little: where two candidates are nearly tied, the first bf16 rounding that differs (between
    any two exact implementations) changes every later token."""
    prompts = [random_prompts(model, 1, plan.accuracy_prompt, generator) for _ in range(plan.greedy_prompts)]
    tokens = {p: [greedy_tokens(model, p, x, m, plan.greedy_tokens) for x, m in prompts] for p in providers}
    tokens32 = {p: [greedy_tokens(reference, p, x, m, plan.greedy_tokens) for x, m in prompts] for p in providers}
    use(reference, "eager")
    rows = []
    for provider in providers:
        same = [_identical(a, b) for a, b in zip(tokens[provider], tokens[baseline])]
        same32 = [_identical(a, b) for a, b in zip(tokens32[provider], tokens32[baseline])]
        gap = max(tie_gaps(reference, x, t).max().item() for (x, _), t in zip(prompts, tokens[provider]))
        rows.append(dict(section="accuracy", model=name, case=f"greedy b=1 {plan.greedy_tokens} tokens",
                         provider=provider, baseline=baseline, prompts=len(prompts),
                         identical_tokens=min(same), identical_per_prompt=same,
                         all_identical_prompts=same.count(plan.greedy_tokens),
                         max_tie_gap=gap, noise=noise,
                         fp32_identical_tokens=min(same32), fp32_identical_per_prompt=same32))
    return rows


def prefill_rows(name, model, providers, plan: Plan, generator) -> list[dict]:
    import torch

    ids, mask = random_prompts(model, 1, plan.prefill_tokens, generator)
    rows = []
    for provider in providers:
        use(model, provider)
        with torch.no_grad():
            run = lambda: model(ids, attention_mask=mask, logits_to_keep=1, use_cache=False)  # noqa: E731
            timed(run, 2)
            seconds = timed(run, 3 * plan.repeats + 1)
        rows.append(dict(section="prefill", model=name, case=f"b=1 {plan.prefill_tokens} tokens", provider=provider,
                         batch=1, prompt=plan.prefill_tokens, median_ms=statistics.median(seconds) * 1e3))
    return rows


def generate_rows(name, model, providers, plan: Plan, generator, compiled: bool) -> list[dict]:
    """tokens/s of ``model.generate``: eager with the dynamic cache, or compiled with the static
    cache (the compiled call is rebuilt for each provider; its first call's time is reported as
    ``compile_s``). Eager runs alternate the providers over ``plan.generate_rounds`` rounds (one
    warm-up each first, the order reversed every other round), so a drift of the host's speed
    falls on every provider alike; rows carry the median, the fastest and slowest round and
    every round's time (``round_ms``, in order: :func:`add_speedups` pairs them)."""
    import torch

    rows = []
    for batch in (plan.compiled_batches if compiled else plan.batches):
        ids, mask = random_prompts(model, batch, plan.prompt, generator)
        case = dict(model=name, case=f"b={batch} prompt {plan.prompt} +{plan.new_tokens}", batch=batch,
                    prompt=plan.prompt, new_tokens=plan.new_tokens)
        if compiled:
            for provider in providers:
                run = _generate_call(model, provider, ids, mask, plan, compiled=True)
                first = timed(run, 1)[0]
                seconds = timed(run, plan.repeats)
                rows.append(_generate_row(case, provider, seconds, "generate compiled static",
                                          compile_s=first - statistics.median(seconds)))
            continue
        runs = {provider: _generate_call(model, provider, ids, mask, plan, compiled=False) for provider in providers}
        for provider, run in runs.items():
            use(model, provider)
            run()  # warm-up

        def run_one(provider):
            use(model, provider)
            return timed(runs[provider], 1)  # noqa: B023

        seconds = alternating_rounds(providers, plan.generate_rounds, run_one)
        rows += [_generate_row(case, provider, seconds[provider], "generate eager dynamic",
                               round_ms=[t * 1e3 for t in seconds[provider]]) for provider in providers]
    if compiled:
        torch._dynamo.reset()
        model.__dict__.pop("_compiled_call", None)
    return rows


def _generate_call(model, provider: str, ids, mask, plan: Plan, compiled: bool):
    """``model.generate`` of ``plan.new_tokens`` tokens with ``provider``'s attention (set now)."""
    import torch
    import transformers

    use(model, provider)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=plan.new_tokens,
                  min_new_tokens=plan.new_tokens)
    if compiled:
        torch._dynamo.reset()
        model.__dict__.pop("_compiled_call", None)
        kwargs.update(cache_implementation="static", compile_config=transformers.CompileConfig())
    else:
        kwargs.update(disable_compile=True)
    return lambda: model.generate(ids, **kwargs)


def _generate_row(case: dict, provider: str, seconds: list[float], section: str, **extra) -> dict:
    return _timed_row(case, provider, seconds, section, case["batch"] * case["new_tokens"], **extra)


def _timed_row(case: dict, provider: str, seconds: list[float], section: str, tokens: int, **extra) -> dict:
    """A row of runs that took ``seconds`` each and generated ``tokens`` each: the median, the
    fastest and slowest run, tokens/s over the median."""
    median = statistics.median(seconds)
    return dict(section=section, **case, provider=provider, median_ms=median * 1e3,
                min_ms=min(seconds) * 1e3, max_ms=max(seconds) * 1e3, runs=len(seconds),
                tokens_per_s=tokens / median, **extra)


def batching_rows(name, model, providers, plan: Plan, cuda_graphs: bool = False) -> list[dict]:
    """Continuous batching (``generate_batch``): every provider's paged implementation on the same
    requests and cache geometry, with transformers' defaults (no CUDA graphs for names without
    "flash" in them) or with ``use_cuda_graph=True``. The requests are drawn from a generator of
    their own, so both cases serve the same ones.

    Each provider first serves the whole workload once untimed (``first_ms``: it compiles the
    kernels for the batch shapes continuous batching meets; in the CUDA-graph case the other
    case has compiled most of them already), then the providers alternate over
    ``plan.batching_rounds`` rounds (:func:`alternating_rounds`). Every ``generate_batch`` call
    makes a new manager, which captures its CUDA graphs again (transformers' ``warmup``), so
    the timed runs include the captures, as a caller of ``generate_batch`` pays them."""
    import torch
    import transformers

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    low, high = plan.request_prompts
    lengths = torch.randint(low, high + 1, (plan.requests,), generator=generator).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    config = transformers.GenerationConfig(max_new_tokens=plan.request_new_tokens, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    block = 256
    blocks = sum(-(-(n + plan.request_new_tokens) // block) for n in lengths) + 16
    cb_config = transformers.ContinuousBatchingConfig(
        block_size=block, num_blocks=blocks, max_batch_tokens=4096, max_requests_per_batch=plan.requests,
        **(dict(use_cuda_graph=True) if cuda_graphs else {}))
    generated = {}

    def serve(provider):
        # "paged|..." set before generate_batch: given an implementation without the prefix,
        # transformers switches to FlashAttention when it finds it (package or Hub kernel)
        use(model, f"paged|{provider}")
        outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
        generated[provider] = sum(len(o.generated_tokens) for o in outputs.values())

    first = {provider: timed(lambda: serve(provider), 1)[0] for provider in providers}  # noqa: B023
    seconds = alternating_rounds(providers, plan.batching_rounds, lambda provider: timed(lambda: serve(provider), 1))
    case = dict(model=name, case=f"{plan.requests} requests, prompts {low}-{high}, +{plan.request_new_tokens}"
                + (", CUDA graphs" if cuda_graphs else ""), batch=plan.requests, new_tokens=plan.request_new_tokens)
    return [_timed_row(case, f"paged|{provider}", seconds[provider], "batching", generated[provider],
                       cuda_graphs=cuda_graphs, round_ms=[t * 1e3 for t in seconds[provider]],
                       first_ms=first[provider] * 1e3,
                       requests_per_s=plan.requests / statistics.median(seconds[provider]))
            for provider in providers]


def alternating_rounds(providers, rounds: int, run_one) -> dict:
    """``{provider: [seconds, ...]}`` of ``rounds`` rounds in which every provider runs once
    (``run_one(provider)`` returns a list of seconds), the order reversed every other round, so a
    drift of the host's speed falls on every provider alike."""
    seconds = {provider: [] for provider in providers}
    for round_ in range(rounds):
        for provider in (providers if round_ % 2 == 0 else providers[::-1]):
            seconds[provider] += run_one(provider)
    return seconds


# ---- the run --------------------------------------------------------------------------------------


def planned_steps(plan: Plan) -> list[tuple[str, str]]:
    """(model, section) pairs in run order."""
    steps = []
    for name in plan.models:
        for section in plan.sections:
            if section == "generate":
                steps.append((name, "generate eager dynamic"))
                if name in plan.compiled_models:
                    steps.append((name, "generate compiled static"))
            elif section == "batching":
                if name in plan.batching_models:
                    steps += [(name, "batching cuda graphs" if graphs else "batching")
                              for graphs in plan.batching_graphs]
            else:
                steps.append((name, section))
    return steps


def run(plan: Plan, progress=None, checkpoint=None) -> list[dict]:
    """Every planned step's rows (a failing step gives an ``error`` row and the run goes on);
    ``checkpoint(rows)`` after each step, so that an interrupted run keeps what it measured."""
    import torch

    rows = []
    generator = torch.Generator().manual_seed(0)
    current = None
    model = providers = None
    for name, section in planned_steps(plan):
        if name != current:
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            model = build_model(name, plan.layers, plan.dtype, plan.device)
            providers = [FLASHKERNEL, *baselines(model)]
            current = name
        if progress is not None:
            progress.show(f"{name}: {section}")
        try:
            if section == "accuracy":
                rows += accuracy_rows(name, model, providers, plan, generator)
            elif section == "prefill":
                rows += prefill_rows(name, model, providers, plan, generator)
            elif section.startswith("generate"):
                rows += generate_rows(name, model, providers, plan, generator, compiled="compiled" in section)
            else:
                rows += batching_rows(name, model, providers, plan, cuda_graphs="cuda graphs" in section)
        except Exception as exc:  # noqa: BLE001 - one failing section is a row, the run goes on
            rows.append(dict(section=section, model=name, case="", provider="", status="error",
                             message=f"{type(exc).__name__}: {str(exc)[:400]}"))
            print(f"{name} {section}: {rows[-1]['message']}", file=sys.stderr, flush=True)
        if progress is not None:
            progress.step()
        if checkpoint is not None:
            checkpoint(add_speedups(rows))
    return add_speedups(rows)


def add_speedups(rows: list[dict]) -> list[dict]:
    """``flashkernel_speedup`` on every timed row: its time / flashkernel's (or flashkernel's
    throughput / its), for the same model, section and case. Rows timed in alternating rounds
    (``round_ms``) also get ``paired_speedup``: the median over rounds of the two providers'
    ratio within the round, which a drift of the host's speed between rounds does not move."""
    def key(row):
        return row["model"], row["section"], row["case"]

    ours = {key(r): r for r in rows if r.get("provider", "").endswith(FLASHKERNEL) and "median_ms" in r}
    for row in rows:
        row.setdefault("status", "ok")
        mine = ours.get(key(row))
        if mine is not None and "median_ms" in row:
            row["flashkernel_speedup"] = row["median_ms"] / mine["median_ms"]
            rounds, my_rounds = row.get("round_ms"), mine.get("round_ms")
            if rounds and my_rounds and len(rounds) == len(my_rounds):
                row["paired_speedup"] = statistics.median(t / mine_t for t, mine_t in zip(rounds, my_rounds))
    return rows


# ---- report ---------------------------------------------------------------------------------------


def _greedy_summary(r: dict) -> str:
    """``identical`` of a greedy row: over several prompts, how many matched all tokens and the
    median; an older single-prompt row, its count."""
    fp32 = r.get("fp32_identical_tokens", "-")
    if "identical_per_prompt" not in r:
        return f"{r['identical_tokens']} identical (fp32: {fp32})"
    same = r["identical_per_prompt"]
    return (f"{r['all_identical_prompts']}/{len(same)} prompts all identical, median {statistics.median(same):g} "
            f"(fp32: min {fp32})")


def table(rows: list[dict], markdown: bool = False) -> str:
    from .results import format_table

    timed_rows, accuracy = [], []
    for r in rows:
        if r.get("status") == "error":
            timed_rows.append([r["model"], r["section"], "error", "", "", r["message"][:80]])
        elif r["section"] == "accuracy" and "identical_tokens" in r:
            accuracy.append([r["model"], r["case"], r["provider"], f"gap {r.get('max_tie_gap', float('nan')):.3g}",
                             f"noise {r.get('noise', float('nan')):.3g}",
                             _greedy_summary(r)])
        elif r["section"] == "accuracy":
            accuracy.append([r["model"], r["case"], r["provider"], f"{r['max_abs_vs_fp32']:.3g}",
                             f"{r['max_abs_vs_baseline']:.3g}", f"{r['top1_vs_baseline']:.4f}"])
        else:
            value = (f"{r['median_ms']:.1f} ms" if r["section"] == "prefill" else
                     f"{r['tokens_per_s']:.0f} tok/s" + (f", {r['requests_per_s']:.2f} req/s" if "requests_per_s" in r
                                                         else ""))
            extra = f" (compile {r['compile_s']:.0f} s)" if "compile_s" in r else ""
            mine = r["provider"].endswith(FLASHKERNEL)
            speedup = f"{r['flashkernel_speedup']:.2f}x" if "flashkernel_speedup" in r and not mine else ""
            if speedup and "paired_speedup" in r:
                speedup += f" (rounds: {r['paired_speedup']:.2f}x)"
            timed_rows.append([r["model"], r["section"], r["case"], r["provider"], value + extra, speedup])
    parts = [format_table(["model", "section", "case", "provider", "result", "fk_attention speedup"], timed_rows,
                          text_columns=4, markdown=markdown)]
    if accuracy:
        parts.append(format_table(["model", "case", "provider", "max |logits - fp32|", "max |logits - baseline|",
                                   "top-1 agreement / greedy"], accuracy, text_columns=3, markdown=markdown))
    return "\n\n".join(parts)


def plot(rows: list[dict], out: Path, title: str = "") -> Path:
    """``e2e.png``: flashkernel's speedup over each baseline, one bar per timed row."""
    from .plots import pyplot

    plt = pyplot()
    bars = [r for r in rows if r.get("flashkernel_speedup") and not r["provider"].endswith(FLASHKERNEL)]
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(bars) + 1.5))
    labels = [f"{r['model']} {r['section']} {r['case']} vs {r['provider']}" for r in bars]
    values = [r["flashkernel_speedup"] for r in bars]
    ax.barh(range(len(bars)), values, color=["tab:blue" if v >= 1 else "tab:red" for v in values])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(bars)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("fk_attention speedup (time of the baseline / time of fk_attention)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = out / "e2e.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="results directory (e2e.json, e2e.csv, e2e.png)")
    parser.add_argument("--quick", action="store_true", help="Llama only, shorter prompts and generations")
    parser.add_argument("--models", nargs="+", choices=MODELS)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS)
    parser.add_argument("--layers", type=int, help="decoder layers per model (4)")
    parser.add_argument("--rounds", type=int, help="eager generate: alternating rounds of every provider (5)")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of --out's e2e.json that this run does not measure (a run split by "
                             "--models or --sections)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from .progress import ProgressLine

    if not torch.cuda.is_available():
        print("the end-to-end benchmark needs a CUDA GPU (bf16 models of a few billion parameters); the CPU "
              "tests (tests/test_transformers.py) check the integration in Triton's interpreter")
        return 2
    plan = QUICK if args.quick else Plan()
    overrides = {k: tuple(v) for k, v in (("models", args.models), ("sections", args.sections)) if v}
    if args.layers:
        overrides["layers"] = args.layers
    if args.rounds:
        overrides["generate_rounds"] = args.rounds
    plan = dataclasses.replace(plan, **overrides)
    command = ["bench", "e2e", *(sys.argv[1:] if argv is None else argv)]
    earlier = previous_rows(Path(args.out)) if args.out and args.append else []
    progress = ProgressLine(len(planned_steps(plan)), enabled=not args.no_progress, log_every_s=0)

    def checkpoint(rows):
        write(merged(earlier, rows), plan, command, args.out, "cuda", plots=False, quiet=True)

    rows = run(plan, progress, checkpoint if args.out else None)
    progress.close()
    write(merged(earlier, rows), plan, command, args.out, "cuda", plots=not args.no_plots)
    return 1 if any(r.get("status") == "error" for r in rows) else 0


def _row_key(row: dict) -> tuple:
    return row["model"], row["section"], row["case"], row["provider"]


def previous_rows(out: Path) -> list[dict]:
    """The rows of an earlier run's ``e2e.json`` in ``out`` (none when there is no such file)."""
    path = out / "e2e.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def merged(earlier: list[dict], rows: list[dict]) -> list[dict]:
    """The ``earlier`` rows with those that ``rows`` measure again replaced where they stand, and
    ``rows``' other rows after the last earlier row of their model and section (else at the end),
    so the table keeps its order (for a run split into several commands with ``--append``)."""
    new = {_row_key(r): r for r in rows}
    result = [new.pop(_row_key(r), r) for r in earlier]
    for row in rows:
        if _row_key(row) not in new:
            continue
        near = [i for i, r in enumerate(result) if (r["model"], r["section"]) == (row["model"], row["section"])]
        result.insert(near[-1] + 1 if near else len(result), row)
    return result


def write(rows: list[dict], plan: Plan, argv: list[str], out: str | None, device: str, plots: bool = True,
          quiet: bool = False) -> None:
    """Print the tables (unless ``quiet``); with ``out``, write ``e2e.json`` and ``e2e.csv`` (and
    ``e2e.png``) there."""
    from . import results

    if not quiet:
        print(table(rows))
    if not out:
        return
    doc = results.document("e2e", results.environment(argv, device), None, {"plan": dataclasses.asdict(plan)}, [],
                           rows)
    for path in results.write_results(Path(out), doc):
        if not quiet:
            print(f"wrote {path}")
    if plots:
        try:
            env = doc["environment"]
            title = f"transformers on flashkernel vs its own attention: {env['gpu']}, commit {env['git_commit'][:8]}"
            print(f"wrote {plot(rows, Path(out), title)}")
        except Exception as exc:  # noqa: BLE001 - matplotlib missing: the data is written
            print(f"no plot: {exc}")

if __name__ == "__main__":
    sys.exit(main())
