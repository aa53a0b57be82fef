"""Hugging Face transformers on flashkernel (``flashkernel.integrations.transformers``).

Tiny random-weight models of each decoder family (2 layers, hidden 64, 4 query / 2 KV heads of
16, float32 on the CPU, where the kernels run in Triton's interpreter) with
``attn_implementation="fk_attention"`` against the same weights on transformers' own attention
(``sdpa``; ``eager`` where sdpa cannot compute the model: Gemma 2's softcap, gpt-oss's sinks):
logits of a left-padded batch, greedy generations with the dynamic and the static cache, and
continuous batching (``paged|fk_attention``). The logits are held to the error bound of the
kernel tests: at most 2x the reference's own distance to the truth (each sequence alone,
unpadded, through a float64 copy of the model), plus a rounding floor. Skipped without
transformers (``pip install flashkernel[transformers]``).
"""

import collections
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashkernel.integrations.transformers as fk_hf  # noqa: E402
from helpers import DEVICE  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, initializer_range=0.2)
# family -> (config overrides, reference attention). Sliding windows of 8 keys are shorter than
# the prompts, so the windows cut.
FAMILIES = {
    "llama": ({}, "sdpa"),
    "mistral": (dict(sliding_window=8), "sdpa"),
    "qwen2": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "sdpa"),
    "qwen3": ({}, "sdpa"),
    "gemma2": (dict(sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                    query_pre_attn_scalar=16), "eager"),  # sdpa has no softcap
    "gemma3_text": (dict(sliding_window=8, query_pre_attn_scalar=16, sliding_window_pattern=2), "sdpa"),
    "gpt_oss": (dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention"]), "eager"),  # no sdpa (sinks)
}
PROMPT = 20  # > DECODE_MAX_QUERIES: the logits checks run the prefill kernels
SHORT_PROMPT = 12  # <= DECODE_MAX_QUERIES: cheap in the interpreter, for the generations
NEW_TOKENS = 3


def tiny_models(family: str, dtype=torch.float32):
    """``(reference model, flashkernel model)``: one set of random weights, two attention
    implementations (each model its own copy of the config: transformers writes the choice into it)."""
    overrides, reference = FAMILIES[family]
    config = transformers.AutoConfig.for_model(family, **TINY, **overrides)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=fk_hf.NAME)
    ours.load_state_dict(ref.state_dict())
    return ref.to(DEVICE, dtype).eval(), ours.to(DEVICE, dtype).eval()


def padded_batch(lengths=(PROMPT - 6, PROMPT), side="left"):
    """Random prompts padded to the longest on ``side``, with their 2-D attention mask."""
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device=DEVICE)
    for b, length in enumerate(lengths):
        mask[b, slice(width - length, None) if side == "left" else slice(0, length)] = 1
    ids = torch.randint(1, TINY["vocab_size"], mask.shape, device=DEVICE)
    return ids.masked_fill(mask == 0, TINY["pad_token_id"]), mask


def assert_logits_close(ours, ref, ids, mask):
    """``ours``' logits at the valid positions within 2x ``ref``'s distance to the truth (+ a
    rounding floor); the truth is each sequence alone, unpadded, in float64 (eager attention)."""
    truth_model = copy.deepcopy(ref).double()
    truth_model.set_attn_implementation("eager")
    if ref.config.model_type == "gpt_oss":
        truth_model.set_experts_implementation("eager")  # grouped_mm has no float64
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, position_ids=positions).logits.double()
        expected = ref(ids, attention_mask=mask, position_ids=positions).logits.double()
        for b, valid in enumerate(mask.bool()):
            truth = truth_model(ids[b, valid][None]).logits[0]
            err = (got[b, valid] - truth).abs().max().item()
            ref_err = (expected[b, valid] - truth).abs().max().item()
            floor = torch.finfo(ours.dtype).eps * truth.abs().max().item()
            assert err <= 2 * ref_err + floor, (
                f"sequence {b}: max error {err:.3e}, the reference's {ref_err:.3e} (floor {floor:.1e})")


def greedy(model, ids, mask, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return out[:, ids.shape[1]:]


@pytest.fixture
def calls(monkeypatch):
    """Counts of the flashkernel functions the integration called, by (function, whether a block
    table was passed, whether cache_leftpad was)."""
    counts = collections.Counter()
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        def spy(*args, _name=name, _real=getattr(fk_hf, name), **kwargs):
            counts[(_name, kwargs.get("block_table") is not None, kwargs.get("cache_leftpad") is not None)] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(fk_hf, name, spy)
    return counts


# ---- each family: logits, generate (dynamic and static cache), continuous batching -------------


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_logits_and_greedy_generations(family, calls):
    ref, ours = tiny_models(family)
    assert_logits_close(ours, ref, *padded_batch())
    ids, mask = padded_batch((SHORT_PROMPT - 4, SHORT_PROMPT))
    expected = greedy(ref, ids, mask)
    assert torch.equal(greedy(ours, ids, mask), expected)
    calls.clear()
    assert torch.equal(greedy(ours, ids, mask, cache_implementation="static"), expected)
    # every step (the short prompt included) by the decode kernel, with per-sequence key starts
    assert calls == {("flash_attn_with_kvcache", False, True): TINY["num_hidden_layers"] * NEW_TOKENS}


@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching(family, calls):
    ref, ours = tiny_models(family)
    prompts = [torch.randint(1, TINY["vocab_size"], (n,)).tolist() for n in (5, 22, 13)]
    config = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
    cb_config = transformers.ContinuousBatchingConfig(block_size=16, num_blocks=16, max_batch_tokens=64)
    ref.set_attn_implementation("paged|" + ref.config._attn_implementation)
    ours.set_attn_implementation(fk_hf.PAGED_NAME)
    expected = ref.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
    got = ours.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
    assert {k: r.generated_tokens for k, r in got.items()} == {k: r.generated_tokens for k, r in expected.items()}
    # decode-only steps append to and read the paged cache through a block table (in the
    # full-attention layers: a sliding layer's cache is a ring buffer, read by varlen)
    assert (calls[("flash_attn_with_kvcache", True, False)] > 0) == (family != "mistral")


# ---- one family, the other shapes -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_right_padded_and_unpadded_prefill(dtype):
    ref, ours = tiny_models("llama", dtype)
    ids, mask = padded_batch((PROMPT, PROMPT - 7), side="right")
    assert_logits_close(ours, ref, ids, mask)
    assert_logits_close(ours, ref, ids, torch.ones_like(mask))


@pytest.mark.parametrize("lengths", [(17, 23), (5, 7)])
def test_packed_sequences_attend_only_their_own_tokens(lengths):
    """Batch 1 holding two sequences: from restarting position_ids, or from cu_seq_lens (as
    transformers' DataCollatorWithFlattening passes them); each equals the sequence run alone.
    Also where all of them fit in one decode-sized call (at most 16 tokens)."""
    ref, ours = tiny_models("qwen3")
    seqs = [torch.randint(1, TINY["vocab_size"], (1, n), device=DEVICE) for n in lengths]
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        alone = torch.cat([ref(s).logits for s in seqs], 1)
        from_positions = ours(torch.cat(seqs, 1), position_ids=positions).logits
        from_offsets = ours(torch.cat(seqs, 1), position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            max_length_q=max(lengths), max_length_k=max(lengths)).logits
    for got in (from_positions, from_offsets):
        assert (got - alone).abs().max().item() < 1e-4


def test_packed_and_padded_batch_of_one_compiled_and_a_gap_in_positions():
    """Traced (torch.compile, fullgraph): packed sequences given by ``cu_seq_lens_*`` stay apart,
    and a left-padded batch of one attends no padding (its mask wins over its position_ids).
    Eager: positions that skip ahead without restarting are one sequence, as transformers'
    FlashAttention integration reads them."""
    ref, ours = tiny_models("llama")
    lengths = (9, 11)
    seqs = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), device=DEVICE)
    restarting = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=DEVICE)
    skipping = torch.cat([torch.arange(lengths[0]), torch.arange(lengths[1]) + 15])[None].to(DEVICE)
    ids, mask = padded_batch((PROMPT - 6,), side="left")
    compiled = copy.deepcopy(ours)
    compiled.forward = torch.compile(compiled.forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        alone = torch.cat([ref(seqs[:, :lengths[0]]).logits, ref(seqs[:, lengths[0]:]).logits], 1)
        packed = compiled(seqs, position_ids=restarting, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                          max_length_q=max(lengths), max_length_k=max(lengths)).logits
        assert (packed - alone).abs().max().item() < 1e-4
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        valid = mask[0].bool()
        unpadded = ref(ids[:, valid]).logits[0]
        for model in (ours, compiled):
            got = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[0, valid]
            assert (got - unpadded).abs().max().item() < 1e-4
        one_sequence = ref(seqs, position_ids=skipping, attention_mask=torch.ones_like(seqs)).logits
        assert (ours(seqs, position_ids=skipping).logits - one_sequence).abs().max().item() < 1e-4


def test_masks_it_cannot_compute_are_refused():
    """Llama 4's chunked attention (by its mask function in eager mode, by its config in both), a
    padding mask with a hole, and the attention registered without its mask function: each an
    error, not a silently wrong result; output_attentions warns that no weights come back."""
    masking = transformers.masking_utils
    chunked = masking.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="chunked_overlay.*use attn_implementation='sdpa'"):
        fk_hf.key_spans_mask(1, 20, 20, mask_function=chunked)
    assert fk_hf.key_spans_mask(1, 20, 20, mask_function=masking.sliding_window_causal_mask_function(8)) is None
    attn = tiny_models("llama")[1].model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16, device=DEVICE)
    k = v = torch.randn(1, 2, 3, 16, device=DEVICE)
    attn.config.attention_chunk_size = 8
    with pytest.raises(NotImplementedError, match="chunked attention \\(attention_chunk_size=8\\)"):
        fk_hf.attention_forward(attn, q, k, v, None)
    attn.config.attention_chunk_size = None
    with pytest.warns(UserWarning, match="does not return attention weights"):
        fk_hf._warn_no_attention_weights.cache_clear()
        fk_hf.attention_forward(attn, q, k, v, None, output_attentions=True)
    hole = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"padding between valid tokens in row\(s\) \[1\]"):
        fk_hf.key_spans_mask(2, 6, 6, attention_mask=hole)
    transformers.AttentionInterface.register("fk_without_masks", fk_hf.attention_forward)
    try:
        _, model = tiny_models("llama")
        model.set_attn_implementation("fk_without_masks")
        ids, mask = padded_batch()
        with pytest.raises(TypeError, match="'fk_without_masks' runs flashkernel's attention without its mask"):
            model(ids, attention_mask=mask)
    finally:
        transformers.AttentionInterface._global_mapping.pop("fk_without_masks")


def test_inference_mode_generations_and_packed_inputs_equal_no_grad():
    """Under ``torch.inference_mode`` (inference tensors have no version counter, which the
    per-forward memos read otherwise) a padded batch generates the same tokens as under no_grad,
    and packed inputs from position_ids give the same logits."""
    ref, ours = tiny_models("llama")
    ids, mask = padded_batch((SHORT_PROMPT - 4, SHORT_PROMPT))
    expected = greedy(ref, ids, mask)
    with torch.inference_mode():
        assert torch.equal(greedy(ours, ids, mask), expected)
        lengths = (9, 12)
        seqs = torch.randint(1, TINY["vocab_size"], (1, sum(lengths)), device=DEVICE)
        positions = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
        packed = ours(seqs, position_ids=positions).logits
        again = ours(seqs, position_ids=positions).logits
    with torch.no_grad():
        want = ours(seqs.clone(), position_ids=positions.clone()).logits
    assert torch.equal(packed, again) and (packed - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_static_cache_decode_has_no_graph_break(family):
    """A decode step over a static cache (left-padded batch) traces whole (fullgraph=True) and
    equals the eager step."""
    ref, ours = tiny_models(family)
    ids, mask = padded_batch()

    def step(model, tokens, step_mask, cache):
        positions = step_mask.cumsum(-1)[:, -1:] - 1
        return model(tokens, attention_mask=step_mask, past_key_values=cache, position_ids=positions).logits

    results = []
    for model, run in ((ref, step), (ours, torch.compile(step, backend="eager", fullgraph=True))):
        cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + 8)
        with torch.no_grad():
            tokens = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
            step_mask = torch.cat([mask, torch.ones_like(tokens)], 1)
            results.append(run(model, tokens, step_mask, cache))
    assert (results[0] - results[1]).abs().max().item() < 1e-4


def test_set_attn_implementation_switches_an_existing_model():
    ref, _ = tiny_models("mistral")
    ids, mask = padded_batch()
    expected = greedy(ref, ids, mask)
    ref.set_attn_implementation(fk_hf.NAME)
    assert ref.config._attn_implementation == fk_hf.NAME
    assert torch.equal(greedy(ref, ids, mask), expected)


# ---- the pieces --------------------------------------------------------------------------------


def test_block_table_from_read_index_pads_with_minus_one():
    """Two sequences of 5 and 12 keys in pages of 4: pages (3, 0) and (1, 4, 2), the rest -1."""
    slots = [3 * 4 + i for i in range(4)] + [0] + [4 + i for i in range(4)] + [16 + i for i in range(4)] + [8, 9, 10, 11]
    read_index = torch.tensor(slots, device=DEVICE)
    cu = torch.tensor([0, 5, 17], dtype=torch.int32, device=DEVICE)
    table = fk_hf.block_table_from_read_index(read_index, cu, 12, 4)
    assert table.dtype == torch.int32
    assert table.tolist() == [[3, 0, -1], [1, 4, 2]]


def test_key_spans_of_padding_and_static_caches():
    """(start, end, existing) per sequence: left padding, right padding, a row with no token, and a
    static cache's unused tail (existing < kv_length)."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    spans = fk_hf.key_spans_mask(3, 2, 8, q_offset=4, kv_offset=0, attention_mask=mask).view(3, 3)
    assert spans.tolist() == [[2, 6, 6], [0, 3, 6], [6, 6, 6]]
    static = fk_hf.key_spans_mask(2, 1, 10, q_offset=torch.tensor(6), attention_mask=None).view(2, 3)
    assert static.tolist() == [[0, 7, 7], [0, 7, 7]]
    # a prefill whose keys are exactly the rows (mask all ones) needs no spans
    assert fk_hf.key_spans_mask(2, 20, 20, attention_mask=torch.ones(2, 20, dtype=torch.bool)) is None


def test_a_mask_from_another_mask_function_is_refused():
    """Registering the attention without its mask function would attend padding silently."""
    _, ours = tiny_models("llama")
    q = torch.randn(2, 4, 3, 16, device=DEVICE)
    k = v = torch.randn(2, 2, 3, 16, device=DEVICE)
    sdpa_mask = torch.zeros(2, 1, 3, 3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(TypeError, match=r"got a torch.bool tensor of shape \(2, 1, 3, 3\).*register\(\)"):
        fk_hf.attention_forward(ours.model.layers[0].self_attn, q, k, v, sdpa_mask)


def test_dropout_and_a_paged_call_without_cache_are_refused():
    _, ours = tiny_models("llama")
    attn = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16, device=DEVICE)
    k = v = torch.randn(1, 2, 3, 16, device=DEVICE)
    with pytest.raises(NotImplementedError, match="no dropout, got dropout=0.1"):
        fk_hf.attention_forward(attn, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"paged\|fk_attention is continuous batching's attention"):
        fk_hf.paged_attention_forward(attn, q, k, v, None)


def test_custom_masks_are_refused():
    with pytest.raises(NotImplementedError, match="custom mask"):
        fk_hf.key_spans_mask(1, 4, 4, use_vmap=True)


def test_registered_names_avoid_flash():
    """transformers loads FlashAttention kernels for any name containing "flash"."""
    assert "flash" not in fk_hf.NAME and "flash" not in fk_hf.PAGED_NAME
    assert transformers.AttentionInterface._global_mapping[fk_hf.NAME] is fk_hf.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping[fk_hf.NAME] is fk_hf.key_spans_mask
    assert fk_hf.PAGED_NAME not in transformers.AttentionMaskInterface._global_mapping


def test_readme_example_runs_and_matches_sdpa(tmp_path):
    """The README's transformers example, as printed, in a fresh process."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    marker = "<!-- transformers-example"
    block = re.search(r"```python\n(.*?)```", readme[readme.index(marker):], flags=re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(block)
    package_root = str(Path(fk_hf.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=package_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "same tokens as sdpa: True" in done.stdout, done.stdout
