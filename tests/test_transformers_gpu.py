"""transformers on flashkernel at real model shapes (GPU, bf16): the shipped configurations of
``flashkernel bench e2e`` (Llama-3-8B's, Gemma-2-9B's and gpt-oss-20b's attention), 2 layers,
random weights.

* logits of a left-padded and an unpadded batch: at most 2x as far from a float32 copy of the model
  (eager attention) as transformers' own attention (``sdpa``; ``eager`` for Gemma 2, whose softcap
  sdpa drops, and gpt-oss, which has no sdpa), and top-1 agreement with float32 no worse;
* greedy generations of an unpadded prompt: with the model in float32, identical to the
  baseline's for 32 tokens; in bf16, every token the float32 model's choice up to a tie within the
  baseline's own logit error (random weights give flat logits: bf16 rounding flips near-ties, in
  transformers' implementations as in ours, so bf16 token sequences of two correct
  implementations part at the first near-tie);
* the static cache under ``torch.compile(fullgraph=True)`` (no graph break) equal to eager, in
  float32 (in bf16 Inductor's fusions of the rest of the model round differently);
* continuous batching (``paged|fk_attention``, with and without CUDA graphs) equal to the
  baseline's paged attention for 16 tokens per request, in float32.

About two minutes on an H200: ``pytest -m gpu tests/test_transformers_gpu.py``.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashkernel.bench import e2e  # noqa: E402
from flashkernel.integrations.transformers import NAME  # noqa: E402

pytestmark = pytest.mark.gpu

LAYERS = 2


@pytest.fixture(scope="module", params=list(e2e.MODELS))
def model(request):
    built = e2e.build_model(request.param, LAYERS)
    yield request.param, built
    del built
    torch.cuda.empty_cache()


def prompts(model, batch, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return e2e.random_prompts(model, batch, length, generator)


def logits(model, implementation, ids, mask):
    model.set_attn_implementation(implementation)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions).logits.float()


@pytest.mark.parametrize("padded", [True, False])
def test_logits_as_close_to_float32_as_the_baseline_gpu(model, padded):
    name, model = model
    ids, mask = prompts(model, 2, 1024)
    if padded:
        mask[0, :300] = 0
    baseline = e2e.exact_baseline(model)
    ours, base = logits(model, NAME, ids, mask), logits(model, baseline, ids, mask)
    reference = copy.deepcopy(model).float()
    truth = logits(reference, "eager", ids, mask)
    del reference
    valid = mask.bool()
    ours, base, truth = ours[valid], base[valid], truth[valid]
    err, base_err = (ours - truth).abs().max().item(), (base - truth).abs().max().item()
    floor = torch.finfo(torch.bfloat16).eps * truth.abs().max().item()
    print(f"{name} padded={padded}: max |ours - fp32| {err:.3e}, |{baseline} - fp32| {base_err:.3e}, "
          f"|ours - {baseline}| {(ours - base).abs().max().item():.3e}")
    assert err <= 2 * base_err + floor
    top1 = (ours.argmax(-1) == truth.argmax(-1)).float().mean().item()
    base_top1 = (base.argmax(-1) == truth.argmax(-1)).float().mean().item()
    assert top1 >= base_top1 - 0.01, f"top-1 agreement with float32 {top1:.4f}, the baseline's {base_top1:.4f}"


def greedy(model, implementation, ids, mask, tokens, **kwargs):
    model.set_attn_implementation(implementation)
    return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          **kwargs)[:, ids.shape[1]:]


def first_difference(ours, base) -> str:
    return f"first difference at token {(ours != base).nonzero()[0, 1].item()}" if not torch.equal(ours, base) else ""


def test_greedy_generation_matches_the_baseline_gpu(model):
    name, model = model
    baseline = e2e.exact_baseline(model)
    ids, mask = prompts(model, 1, 256, seed=1)
    reference = copy.deepcopy(model).float()
    ours32 = greedy(reference, NAME, ids, mask, 32, disable_compile=True)
    base32 = greedy(reference, baseline, ids, mask, 32, disable_compile=True)
    assert torch.equal(ours32, base32), first_difference(ours32, base32)

    noise = (logits(model, baseline, ids, mask) - logits(reference, "eager", ids, mask)).abs().max().item()
    reference.set_attn_implementation("eager")
    for implementation in (NAME, baseline):
        tokens = greedy(model, implementation, ids, mask, 32, disable_compile=True)
        gaps = e2e.tie_gaps(reference, ids, tokens[0])
        print(f"{name} {implementation}: bf16 greedy, largest gap to float32's choice {gaps.max().item():.3e} "
              f"(baseline's logit error {noise:.3e})")
        assert gaps.max().item() <= 2 * noise, f"{implementation}: token {gaps.argmax().item()} is no near-tie"


def test_compiled_static_cache_without_graph_breaks_equals_eager_gpu():
    model = e2e.build_model("llama3-8b", LAYERS, dtype="float32")
    ids, mask = prompts(model, 4, 512, seed=2)
    mask[1, :100] = 0
    eager = greedy(model, NAME, ids, mask, 32, cache_implementation="static", disable_compile=True)
    compiled = greedy(model, NAME, ids, mask, 32, cache_implementation="static",
                      compile_config=transformers.CompileConfig(fullgraph=True))
    torch._dynamo.reset()
    assert torch.equal(compiled, eager), first_difference(compiled, eager)


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("name", ["llama3-8b", "gpt-oss-20b"])
def test_continuous_batching_matches_the_baseline_gpu(name, cuda_graphs):
    model = e2e.build_model(name, LAYERS, dtype="float32")
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    requests = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (17, 300, 1000, 64, 513, 5)]
    config = transformers.GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_config = transformers.ContinuousBatchingConfig(block_size=256, num_blocks=64, max_batch_tokens=1024,
                                                      use_cuda_graph=cuda_graphs)
    results = {}
    baseline = e2e.exact_baseline(model)
    for implementation in (NAME, baseline):
        model.set_attn_implementation(f"paged|{implementation}")
        out = model.generate_batch(requests, generation_config=config, continuous_batching_config=cb_config)
        results[implementation] = {key: o.generated_tokens for key, o in out.items()}
    assert results[NAME] == results[baseline]
