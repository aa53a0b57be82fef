"""flash_attn_with_kvcache over quantized caches (float8_e4m3fn, int8), quantize_kv, KVCache(cache_dtype=).

Every decode case builds a random float cache, quantizes it with ``reference.quantize`` (the
spec), runs one call and checks (1) the whole cache and its scales after the call, bit for bit,
against ``reference.append_to_quantized_cache`` (the new tokens quantized in exactly their slots,
per-token scales beside them, nothing else changed); (2) each sequence's output and LSE against
float64 attention over the dequantized cache (``reference.dequantize``), with the bound relative
to PyTorch's own same-dtype error (helpers.assert_output_close: PyTorch reads the dequantized
values rounded to q's dtype).

On the CPU these run in Triton 3.6's interpreter, which loads, stores and converts float8e4nv
and int8 as the GPU does for everything these kernels do with them (every e4m3 and int8 value
converts exactly; its float32 -> e4m3 conversion truncates, which is why the append kernel
rounds with arithmetic and converts only exact values: ``test_append_rounds_like_torch``). So
the CPU tests run the GPU's code, bf16 queries included (over a quantized cache q is computed
in fp16). GPU-only cases carry the ``gpu`` mark.
"""

import pytest
import torch

import flashkernel
from flashkernel import interface, reference
from flashkernel.kernels import dispatch
from helpers import DEVICE, ON_GPU, assert_output_close
from test_kvcache import make_cache
from test_variants import variant_kwargs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FORMATS = (torch.float8_e4m3fn, torch.int8)
GRANULARITIES = ("tensor", "head", "token")
PAGE_SIZES = (None, 1, 16, 64, 256)  # None = contiguous cache
CPU_LENGTHS = (0, 1, 17, 40)
GPU_LENGTHS = (0, 1, 17, 300, 4097)
FMT_IDS = {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}


def bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bits (NaN-safe equality): 1-byte caches as uint8, float32 scales as int32."""
    return x.view(torch.uint8 if x.element_size() == 1 else torch.int32)


def static_scale(x: torch.Tensor, granularity: str, fmt, headroom: float = 0.8) -> torch.Tensor:
    """``max |x| / range`` per tensor ``[1]`` or per KV head ``[Hkv]``, times ``headroom`` (< 1:
    the largest values saturate, as with a calibrated scale)."""
    largest = x.float().abs().amax(dim=(0, 1, 3))
    if granularity == "tensor":
        largest = largest.amax().reshape(1)
    return (largest.double() / reference.QUANT_MAX[fmt] * headroom).float()  # exactly, as quantize_kv does


def quantize(x: torch.Tensor, granularity: str, fmt):
    """``(stored, scale)`` of a float cache, by the spec (``reference``)."""
    if granularity == "token":
        return reference.quantize_tokens(x, fmt)
    scale = static_scale(x, granularity, fmt)
    return reference.quantize(x, reference.expand_scale(scale), fmt), scale


def write_prefix(cache: torch.Tensor, b: int, values: torch.Tensor, block_table) -> None:
    """``cache``'s slots of sequence ``b``'s first ``len(values)`` tokens = ``values`` (by bytes:
    indexing float8 is not implemented everywhere)."""
    if cache.dtype == torch.float8_e4m3fn:
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    positions = torch.arange(values.shape[0], device=cache.device)
    if block_table is None:
        cache[b, positions] = values
    else:
        page_size = cache.shape[1]
        cache[block_table[b].long()[positions // page_size], positions % page_size] = values


def poison_past_lengths(cache, scale, lengths, block_table) -> None:
    """Every slot past each sequence's length (and every unused page) holds NaN (e4m3) or the
    range's edge (int8), and per-token scales there NaN and Inf: none may reach the output."""
    kept = [(reference.cache_prefix(cache, b, n, block_table).clone(),
             reference.cache_prefix(scale, b, n, block_table).clone() if scale.dim() == 3 else None)
            for b, n in enumerate(lengths)]
    bits(cache).fill_(0x7F)  # e4m3: NaN; int8: 127
    if scale.dim() == 3:
        scale.fill_(float("nan"))
        scale[..., ::2] = float("inf")
    for b, (values, scales) in enumerate(kept):
        write_prefix(cache, b, values, block_table)
        if scales is not None:
            write_prefix(scale, b, scales, block_table)


def check_outputs(out, lse, q, k_cache, k_scale, v_cache, v_scale, totals, block_table, causal, variant) -> None:
    """Each sequence against float64 attention over its dequantized keys and values."""
    keys_all, values_all = reference.dequantize(k_cache, k_scale), reference.dequantize(v_cache, v_scale)
    variant = dict(variant)
    slopes = variant.pop("alibi_slopes", None)
    starts = variant.pop("cache_leftpad", None)
    for b, total in enumerate(totals):
        start = min(int(starts[b]), total) if starts is not None else 0
        keys = reference.cache_prefix(keys_all, b, total, block_table)[None, start:]
        values = reference.cache_prefix(values_all, b, total, block_table)[None, start:]
        per_seq = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        assert_output_close(out[b:b + 1], q[b:b + 1], keys, values, causal=causal, lse=lse[b:b + 1],
                            alibi_slopes=per_seq, **variant)


def run_quantized(lengths, seqlen_new, heads, head_dim, page_size, fmt, granularity, *, dtype=torch.float16,
                  causal=True, append=True, num_splits=0, poison=False, new_scale=1.0, backend="auto", **variant):
    """One call over a quantized cache, checked as the module docstring says. ``new_scale``
    multiplies the new tokens (far above the static scales' range: they saturate)."""
    num_heads, num_kv_heads = heads
    batch = len(lengths)
    k_float, v_float, block_table = make_cache(lengths, seqlen_new, num_kv_heads, head_dim, torch.float32,
                                               page_size)
    (k_cache, k_scale), (v_cache, v_scale) = quantize(k_float, granularity, fmt), quantize(v_float, granularity, fmt)
    if poison:
        poison_past_lengths(k_cache, k_scale, lengths, block_table)
        poison_past_lengths(v_cache, v_scale, lengths, block_table)
    q = torch.randn(batch, seqlen_new, num_heads, head_dim, device=DEVICE).to(dtype)
    k = v = None
    if append:
        k = (torch.randn(batch, seqlen_new, num_kv_heads, head_dim, device=DEVICE) * new_scale).to(dtype)
        v = (torch.randn_like(k, dtype=torch.float32) * new_scale).to(dtype)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    before = [x.clone() for x in (k_cache, k_scale, v_cache, v_scale)]
    out, lse = flashkernel.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table, k_scale=k_scale,
        v_scale=v_scale, causal=causal, num_splits=num_splits, return_lse=True, backend=backend, **variant)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (batch, num_heads, seqlen_new)
    expected = before
    if append:
        expected = [*reference.append_to_quantized_cache(before[0], before[1], k, cache_seqlens, block_table),
                    *reference.append_to_quantized_cache(before[2], before[3], v, cache_seqlens, block_table)]
    for name, got, want in zip(("k_cache", "k_scale", "v_cache", "v_scale"), (k_cache, k_scale, v_cache, v_scale),
                               expected):
        mismatch = bits(got) != bits(want)
        assert not mismatch.any(), f"{name} differs at {mismatch.nonzero()[:5].tolist()} ({int(mismatch.sum())} bytes)"
    totals = [n + (seqlen_new if append else 0) for n in lengths]
    check_outputs(out, lse, q, *expected, totals, block_table, causal, variant)
    return expected, out


# ---- the grid, cut for the interpreter -----------------------------------------------------------


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_formats_and_granularities(fmt, granularity):
    i = FORMATS.index(fmt) * 3 + GRANULARITIES.index(granularity)
    run_quantized(CPU_LENGTHS, 2, (4, 2), 32, PAGE_SIZES[i % 5], fmt, granularity,
                  dtype=(torch.float16, torch.bfloat16)[i % 2], num_splits=(0, 3)[i % 2])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_sizes(page_size):
    fmt, granularity = FORMATS[PAGE_SIZES.index(page_size) % 2], GRANULARITIES[PAGE_SIZES.index(page_size) % 3]
    run_quantized((3, 70), 1, (4, 1), 32, page_size, fmt, granularity, num_splits=2)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2), (32, 1)], ids=["gqa1", "gqa4", "gqa8", "gqa32"])
def test_gqa_groups(heads):
    run_quantized((5, 33), 2, heads, 32, 16, torch.float8_e4m3fn, "token")


@pytest.mark.parametrize("seqlen_new", [1, 3, 8])
def test_new_tokens_causal_among_themselves(seqlen_new):
    run_quantized((0, 9, 50), seqlen_new, (4, 2), 32, None, torch.int8, "head", num_splits=2)


@pytest.mark.parametrize("causal", [True, False])
def test_no_new_tokens(causal):
    run_quantized((0, 12, 61), 3, (4, 2), 32, 16, torch.float8_e4m3fn, "token", causal=causal, append=False)


def test_all_variants_and_key_starts():
    """Window, softcap, ALiBi per sequence, sinks and a per-sequence key start, together."""
    kwargs = variant_kwargs(("window", "softcap", "alibi", "sinks"), 3, 4, window=(30, 0))
    kwargs["cache_leftpad"] = torch.tensor([0, 3, 20], dtype=torch.int32, device=DEVICE)
    run_quantized((0, 9, 70), 2, (4, 2), 32, 16, torch.float8_e4m3fn, "token", num_splits=3, **kwargs)
    run_quantized((4, 9, 70), 2, (4, 2), 32, None, torch.int8, "tensor", num_splits=2, **kwargs)


def test_float32_queries():
    run_quantized((6, 45), 2, (4, 2), 32, None, torch.float8_e4m3fn, "head", dtype=torch.float32)


def at_odd_offset(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a 1-byte ``cache`` one byte into a larger buffer (its data pointer odd)."""
    buffer = torch.empty(cache.numel() + 1, dtype=torch.uint8, device=cache.device)
    copy = buffer[1:].view(cache.shape)
    copy.copy_(cache.view(torch.uint8))
    return copy.view(cache.dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_values_read_as_words_or_as_bytes(fmt):
    """The kernel reads V two entries at a time where the layout allows (decode.value_operand);
    a V at an odd address is read byte by byte. Both against the reference, and equal."""
    from flashkernel.kernels import decode

    lengths, heads, head_dim = (7, 45), (4, 2), 32
    k_float, v_float, _ = make_cache(lengths, 2, heads[1], head_dim, torch.float32, None)
    (k_cache, k_scale), (v_cache, v_scale) = quantize(k_float, "head", fmt), quantize(v_float, "head", fmt)
    v_odd = at_odd_offset(v_cache)
    assert decode.value_operand(v_cache, True).dtype == torch.int16
    assert decode.value_operand(v_odd, True) is v_odd
    # An odd address at storage offset 0 (memory from elsewhere) is read byte by byte too.
    raw = torch.frombuffer(bytearray(v_cache.numel() + 1), dtype=torch.uint8, offset=1)
    assert raw.storage_offset() == 0 and raw.data_ptr() % 2 == 1
    assert decode.value_operand(raw.view(v_cache.shape).view(fmt), True).dtype == fmt
    q = torch.randn(2, 2, heads[0], head_dim, device=DEVICE).half()
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    outs = []
    for v in (v_cache, v_odd):
        out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v, cache_seqlens=cache_seqlens, k_scale=k_scale,
                                                       v_scale=v_scale, causal=True, num_splits=2, return_lse=True)
        check_outputs(out, lse, q, k_cache, k_scale, v, v_scale, lengths, None, True, {})
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-3)


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_appended_tokens_saturate_at_the_range_edge(fmt):
    """New values ~50x beyond 448 (int8: 127) times the static scale are stored as the edge."""
    expected, _ = run_quantized((2, 30), 2, (4, 2), 32, None, fmt, "tensor", new_scale=200.0)
    edge = reference.QUANT_MAX[fmt]
    appended = torch.stack([expected[0][0, 2:4], expected[0][1, 30:32]]).float()
    assert appended.abs().max() == edge and (appended.abs() == edge).float().mean() > 0.5


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("granularity", ["tensor", "token"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_unused_slots_hold_nan(fmt, granularity, page_size):
    run_quantized((0, 1, 31, 32, 33), 1, (4, 2), 32, page_size, fmt, granularity, poison=True, num_splits=2)


# ---- quantization itself -------------------------------------------------------------------------


def test_append_rounds_like_torch():
    """Every finite e4m3 value, the midpoints between neighbours (ties to even) and just off them,
    subnormals, values past 448, and int8 halves: the kernel's quantization equals torch's."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = torch.sort(codes[torch.isfinite(codes)].unique()).values
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), torch.randn(500) * 300,
                   torch.tensor([500.0, -1000.0, 448.5, 1e-9, -1e-9]), torch.arange(-130, 130) + 0.5])
    x = x[: x.numel() // 32 * 32].view(1, -1, 2, 16).to(DEVICE)
    for fmt in FORMATS:
        one = torch.ones(1, device=DEVICE)
        stored, _, scale, _ = flashkernel.quantize_kv(x, x, dtype=fmt, k_scale=one, v_scale=one)
        assert torch.equal(scale, one)
        want = reference.quantize(x, one, fmt)
        assert torch.equal(stored.float(), want.float()), f"{fmt}: {int((stored.float() != want.float()).sum())} differ"


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_quantize_kv_matches_the_spec(fmt, granularity):
    k = torch.randn(3, 20, 2, 32, device=DEVICE).to(torch.bfloat16)
    k[:, :, 1] *= 30  # one head far larger: its own scale per head
    v = torch.randn_like(k)
    saved = (k.clone(), v.clone())
    k_q, v_q, k_scale, v_scale = flashkernel.quantize_kv(k, v, dtype=fmt, granularity=granularity)
    assert torch.equal(k, saved[0]) and torch.equal(v, saved[1]), "the input changed"
    for x, stored, scale in ((k, k_q, k_scale), (v, v_q, v_scale)):
        assert stored.dtype == fmt and stored.shape == x.shape and scale.dtype == torch.float32
        if granularity == "token":
            want, want_scale = reference.quantize_tokens(x, fmt)
        else:
            want_scale = static_scale(x, granularity, fmt, headroom=1.0)
            want = reference.quantize(x, reference.expand_scale(want_scale), fmt)
        assert torch.equal(scale, want_scale) and torch.equal(stored.float(), want.float())


def test_quantize_kv_takes_static_scales_and_zero_caches():
    k = torch.randn(2, 8, 2, 32, device=DEVICE).half()
    scale = torch.tensor([0.003, 0.05], device=DEVICE)
    k_q, v_q, k_scale, v_scale = flashkernel.quantize_kv(k, torch.zeros_like(k), granularity="head", k_scale=scale)
    assert torch.equal(k_q.float(), reference.quantize(k, scale[:, None], torch.float8_e4m3fn).float())
    assert torch.equal(k_scale, scale) and k_scale is not scale
    assert torch.equal(v_scale, torch.ones(2, device=DEVICE)) and not v_q.float().any()
    # A float stands for that scale in every head (per tensor: the one scale), as KVCache takes it.
    for granularity, size in (("head", 2), ("tensor", 1)):
        k_f, v_f, k_scale, v_scale = flashkernel.quantize_kv(k, k, granularity=granularity, k_scale=0.05, v_scale=2)
        want = torch.full((size,), 0.05, device=DEVICE)
        assert torch.equal(k_scale, want) and torch.equal(v_scale, torch.full((size,), 2.0, device=DEVICE))
        assert torch.equal(k_f.float(), reference.quantize(k, torch.tensor(0.05, device=DEVICE), torch.float8_e4m3fn).float())


# ---- KVCache and DecodePlan ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, granularity", [(torch.float8_e4m3fn, "head"), (torch.int8, "token")],
                         ids=["fp8-head", "int8-token"])
def test_kvcache_quantized_decode_steps(fmt, granularity):
    """A prompt appended through the host, two decode steps through flash_attn_with_kvcache; gather
    returns the dequantized values the kernel attended to."""
    static = {} if granularity == "token" else {"k_scale": 0.02, "v_scale": 0.01}
    cache = flashkernel.KVCache(num_blocks=10, page_size=16, num_kv_heads=2, head_dim=32, batch=2,
                                max_blocks_per_seq=4, dtype=torch.float16, cache_dtype=fmt,
                                scale_granularity=granularity, **static)
    assert cache.k_pages.dtype == fmt
    prompt = torch.randn(2, 21, 2, 32, device=DEVICE).half()
    cache.append(0, prompt[0], prompt[1])
    for step in range(2):
        cache.reserve(1)
        q = torch.randn(2, 1, 4, 32, device=DEVICE).half()
        k, v = torch.randn(2, 2, 1, 2, 32, device=DEVICE).half()
        out, lse = flashkernel.flash_attn_with_kvcache(
            q, cache.k_pages, cache.v_pages, k=k, v=v, cache_seqlens=cache.cache_seqlens,
            block_table=cache.block_table, k_scale=cache.k_scale, v_scale=cache.v_scale, return_lse=True)
        cache.advance(1)
        for b in range(2):
            keys, values = cache.gather(b)
            assert keys.shape[0] == (21 if b == 0 else 0) + step + 1
            assert_output_close(out[b:b + 1], q[b:b + 1], keys[None], values[None], causal=True, lse=lse[b:b + 1])


def test_decode_plan_over_a_quantized_cache():
    """Plan once, run per layer with each layer's cache and scales: equal to the function."""
    lengths, heads = (7, 40), (4, 2)
    layers = []
    for _ in range(2):
        k_float, v_float, _ = make_cache(lengths, 1, 2, 32, torch.float16, None)
        (k_cache, k_scale), (v_cache, v_scale) = quantize(k_float, "token", FORMATS[0]), quantize(v_float, "token",
                                                                                                  FORMATS[0])
        layers.append((k_cache, v_cache, k_scale, v_scale))
    q = torch.randn(2, 1, 4, 32, device=DEVICE).half()
    k, v = torch.randn(2, 2, 1, 2, 32, device=DEVICE).half()
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    copies = [[x.clone() for x in layer] for layer in layers]
    plan = flashkernel.DecodePlan(q, *layers[0][:2], k=k, v=v, cache_seqlens=seqlens, k_scale=layers[0][2],
                                  v_scale=layers[0][3])
    for layer, copy in zip(layers, copies):
        got = plan.run(q, layer[0], layer[1], k, v, layer[2], layer[3])
        want = flashkernel.flash_attn_with_kvcache(q, copy[0], copy[1], k=k, v=v, cache_seqlens=seqlens,
                                                   k_scale=copy[2], v_scale=copy[3])
        assert torch.equal(got, want)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(layer, copy))
    with pytest.raises(ValueError, match="k_scale was given when the plan was made"):
        plan.run(q, layers[0][0], layers[0][1], k, v)


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("kernel launched despite bad input")

    monkeypatch.setattr(interface.dispatch, "decode", fail)


def quantized_inputs(fmt=torch.float8_e4m3fn, granularity="token"):
    k_float, v_float, block_table = make_cache((3, 9), 1, 2, 32, torch.float16, 16)
    (k_cache, k_scale), (v_cache, v_scale) = quantize(k_float, granularity, fmt), quantize(v_float, granularity, fmt)
    return dict(q=torch.randn(2, 1, 4, 32, device=DEVICE).half(), k_cache=k_cache, v_cache=v_cache,
                cache_seqlens=torch.tensor([3, 9], dtype=torch.int32, device=DEVICE), block_table=block_table,
                k_scale=k_scale, v_scale=v_scale)


def call(args, **overrides):
    args = {**args, **overrides}
    return flashkernel.flash_attn_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: {"v_cache": a["v_cache"].view(torch.int8)}, TypeError,
     "k_cache has dtype float8_e4m3fn but v_cache has int8: a quantized cache keeps keys and values in one format"),
    (lambda a: {"v_cache": a["v_cache"].float().half()}, TypeError,
     "k_cache has dtype float8_e4m3fn but v_cache has float16"),
    (lambda a: {"k_cache": a["k_cache"].view(torch.float8_e5m2), "v_cache": a["v_cache"].view(torch.float8_e5m2),
                "k_scale": None, "v_scale": None}, TypeError,
     "k_cache has dtype float8_e5m2; a cache is in q's dtype or quantized: supported dtypes are .*float8_e4m3fn"),
    (lambda a: {"k_scale": None}, ValueError,
     r"k_cache has dtype float8_e4m3fn \(a quantized cache\) but k_scale is None: pass k_scale and v_scale, "
     r"float32 \[1\] \(per tensor\), \[2\] \(per KV head\) or \[5, 16, 2\]"),
    (lambda a: {"v_scale": None}, ValueError, "but v_scale is None"),
    (lambda a: {"k_scale": a["k_scale"].half()}, TypeError, "k_scale has dtype float16; scales must be float32"),
    (lambda a: {"k_scale": 0.02}, TypeError, r"k_scale is the number 0.02; this call takes scales as float32 tensors "
     r"on the cache's device .* torch.tensor\(\[0.02\], device=k_cache.device\)"),
    (lambda a: {"v_scale": a["v_scale"][:, :8]}, ValueError, r"v_scale has shape \(5, 8, 2\); a scale is \[1\]"),
    (lambda a: {"k_scale": torch.ones(3, device=DEVICE)}, ValueError, r"k_scale has shape \(3,\)"),
    (lambda a: {"k_scale": torch.ones(1, device=DEVICE)}, ValueError,
     "k_scale is per tensor and v_scale per token: keys and values take scales of one granularity"),
    (lambda a: {"k_cache": a["k_cache"].float().half(), "v_cache": a["v_cache"].float().half(), "v_scale": None},
     ValueError, "k_scale is given but the cache has dtype float16: scales belong to a quantized cache"),
], ids=["mixed-formats", "mixed-quantized-and-float", "unsupported-format", "no-k-scale", "no-v-scale",
        "scale-dtype", "scale-number", "scale-shape", "scale-heads", "mixed-granularity",
        "scale-without-quantized-cache"])
def test_bad_quantized_inputs_raise_before_launch(change, exc, match, no_launch):
    a = quantized_inputs()
    with pytest.raises(exc, match=match):
        call(a, **change(a))


def overlapping_views(x):
    """Two contiguous tensors of ``x``'s shape one element apart in one buffer."""
    buffer = torch.ones(x.numel() + 1, dtype=x.dtype, device=x.device)
    return buffer[:-1].view(x.shape), buffer[1:].view(x.shape)


def appended(args):
    """``args`` of :func:`quantized_inputs` with one new token per sequence to append."""
    k, v = torch.randn(2, 2, 1, 2, 32, device=DEVICE).half()
    return {**args, "k": k, "v": v}


@pytest.mark.parametrize("change, match", [
    (lambda a: {"v_scale": a["k_scale"]}, "k_scale and v_scale share memory, and the append writes both in place"),
    (lambda a: dict(zip(("k_scale", "v_scale"), overlapping_views(a["k_scale"]))),
     "k_scale and v_scale share memory"),
    (lambda a: {"k_scale": torch.ones(1, 1, 1, device=DEVICE).expand(a["k_scale"].shape)},
     r"k_scale has strides \(0, 0, 0\): several of its elements share an address"),
    (lambda a: {"v_cache": a["k_cache"]}, "k_cache and v_cache share memory, and the append writes both in place"),
], ids=["one-scale-tensor", "overlapping-views", "expanded-scale", "one-cache-tensor"])
def test_what_an_append_writes_must_not_overlap(change, match, no_launch):
    """An append writes the caches and per-token scales in place: one tensor passed twice, two
    views one element apart, or an expanded tensor would have the values written last overwrite
    the others."""
    a = appended(quantized_inputs())
    with pytest.raises(ValueError, match=match):
        call(a, **change(a))


def test_what_an_append_writes_may_interleave_or_be_shared_when_only_read(no_launch):
    """Not refused: K and V as interleaved halves of one ``[..., 2, Hkv, D]`` pool (their elements
    are apart), and one scale tensor for K and V where it is only read (per tensor, or no append)."""
    a = appended(quantized_inputs())
    pool = torch.zeros(*a["k_cache"].shape[:2], 2, *a["k_cache"].shape[2:], device=DEVICE).to(a["k_cache"].dtype)
    for change in ({"k_cache": pool[:, :, 0], "v_cache": pool[:, :, 1]},
                   {"k": None, "v": None, "v_scale": a["k_scale"]}):
        with pytest.raises(AssertionError, match="kernel launched"):
            call(a, **change)
    static = appended(quantized_inputs(granularity="tensor"))
    with pytest.raises(AssertionError, match="kernel launched"):
        call(static, v_scale=static["k_scale"])


def test_the_overlap_check_skips_fake_tensors():
    """Under ``FakeTensorMode`` (shape and memory estimates) or ``make_fx``, tensors have no
    addresses (every fake one reads as 0): the append's overlap check leaves them alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k_cache, v_cache, k, v, lens):
        return flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, validate=False)

    def inputs():
        return (torch.randn(2, 1, 4, 32, device=DEVICE).half(), torch.zeros(2, 8, 2, 32, device=DEVICE).half(),
                torch.zeros(2, 8, 2, 32, device=DEVICE).half(), torch.randn(2, 1, 2, 32, device=DEVICE).half(),
                torch.randn(2, 1, 2, 32, device=DEVICE).half(), torch.tensor([3, 5], dtype=torch.int32, device=DEVICE))

    with FakeTensorMode():
        assert step(*inputs()).shape == (2, 1, 4, 32)
    assert make_fx(step, tracing_mode="fake")(*inputs()) is not None


def test_a_plan_refuses_runs_whose_appends_overlap():
    """A plan's run whose caches or per-token scales share memory where the planned ones did not
    gets the function's error (its layouts alone match the plan)."""
    a = appended(quantized_inputs())
    plan = flashkernel.DecodePlan(a["q"], a["k_cache"], a["v_cache"], k=a["k"], v=a["v"],
                                  cache_seqlens=a["cache_seqlens"], block_table=a["block_table"], k_scale=a["k_scale"],
                                  v_scale=a["v_scale"])
    with pytest.raises(ValueError, match="k_scale and v_scale share memory"):
        plan.run(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["k_scale"], a["k_scale"])
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        flashkernel.DecodePlan(a["q"], a["k_cache"], a["k_cache"], k=a["k"], v=a["v"],
                               cache_seqlens=a["cache_seqlens"], block_table=a["block_table"], k_scale=a["k_scale"],
                               v_scale=a["v_scale"])


def test_scale_on_another_device(no_launch):
    if not ON_GPU:
        pytest.skip("needs a second device type")
    a = quantized_inputs()
    with pytest.raises(ValueError, match="k_scale is on cpu but k_cache is on cuda"):
        call(a, k_scale=a["k_scale"].cpu())


def test_gluon_backend_refuses_per_token_scales():
    a = quantized_inputs(granularity="token")
    with pytest.raises(ValueError, match="backend='gluon' cannot run this call: the Gluon decode kernel takes "
                                         "quantized caches with scales per tensor or per KV head only"):
        call(a, backend="gluon")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(dtype=torch.float16), TypeError, "dtype must be torch.float8_e4m3fn or torch.int8"),
    (dict(granularity="channel"), ValueError, "granularity must be one of 'tensor', 'head', 'token', got 'channel'"),
    (dict(granularity="token", k_scale=torch.ones(1)), ValueError, "k_scale is given with granularity 'token'"),
    (dict(granularity="head", k_scale=torch.ones(1)), ValueError, r"k_scale has shape \(1,\); a per-head scale "
                                                                  r"has shape \(2,\)"),
    (dict(v_scale=torch.ones(1, dtype=torch.float64)), TypeError, "v_scale has dtype float64"),
    (dict(k_scale=-0.5), ValueError, r"k_scale must be finite and positive, got -0.5"),
    (dict(granularity="token", v_scale=0.5), ValueError, "v_scale is given with granularity 'token'"),
    (dict(k_scale=True), TypeError, "k_scale must be a float or a float32 tensor, got bool"),
    (dict(k_scale=1e-300), ValueError, r"k_scale must be finite and positive, got 1e-300 \(a normal float32"),
    (dict(v_scale=1e300), ValueError, r"v_scale must be finite and positive, got 1e\+300 \(a normal float32"),
], ids=["format", "granularity", "token-with-scale", "head-scale-shape", "scale-dtype", "negative-float",
        "token-with-float", "bool", "underflow", "overflow"])
def test_quantize_kv_rejects_bad_arguments(kwargs, exc, match):
    k = torch.randn(2, 8, 2, 32, device=DEVICE).half()
    kwargs = {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    with pytest.raises(exc, match=match):
        flashkernel.quantize_kv(k, k, **kwargs)
    with pytest.raises(TypeError, match="k_cache has dtype int8; supported dtypes are"):
        flashkernel.quantize_kv(k.to(torch.int8), k.to(torch.int8))


@pytest.mark.parametrize("overrides, exc, match", [
    (dict(cache_dtype=torch.float8_e5m2), TypeError, "^cache_dtype must be torch.float8_e4m3fn or torch.int8"),
    (dict(cache_dtype=torch.int8, scale_granularity="row"), ValueError, "^scale_granularity must be one of"),
    (dict(cache_dtype=torch.int8, scale_granularity="token", k_scale=0.1), ValueError,
     "k_scale is given with scale_granularity='token'"),
    (dict(cache_dtype=torch.int8, k_scale=0.1, v_scale=-1.0), ValueError,
     "v_scale must be finite and positive, got -1.0"),
    (dict(cache_dtype=torch.int8, k_scale=1e-300, v_scale=0.1), ValueError,
     "k_scale must be finite and positive, got 1e-300"),
    (dict(cache_dtype=torch.int8, k_scale=True, v_scale=0.1), TypeError,
     "k_scale must be a float or a float32 tensor, got bool"),
    (dict(cache_dtype=torch.int8, scale_granularity="head", k_scale=torch.ones(3), v_scale=0.1), ValueError,
     r"k_scale must be a float or a float32 tensor of 2 element\(s\) \(per head\)"),
    (dict(k_scale=0.5), ValueError, "k_scale/v_scale are given but cache_dtype is torch.float16"),
    (dict(scale_granularity="token"), ValueError,
     "scale_granularity='token' is given but cache_dtype is torch.float16: scales belong to a quantized cache"),
    (dict(cache_dtype=torch.int8, k_scale=0.1), ValueError,
     "cache_dtype=torch.int8 with scale_granularity='tensor' needs k_scale and v_scale"),
    (dict(cache_dtype=torch.int8, scale_granularity="head"), ValueError,
     "cache_dtype=torch.int8 with scale_granularity='head' needs k_scale and v_scale"),
], ids=["format", "granularity", "token-with-scale", "negative", "underflow", "bool", "head-shape",
        "scale-without-quantized-cache", "granularity-without-quantized-cache", "int8-without-v-scale",
        "int8-head-without-scales"])
def test_kvcache_rejects_bad_quantization_arguments(overrides, exc, match):
    with pytest.raises(exc, match=match):
        flashkernel.KVCache(num_blocks=4, page_size=16, num_kv_heads=2, head_dim=32, batch=1, max_blocks_per_seq=2,
                            dtype=torch.float16, device=DEVICE, **overrides)


@pytest.mark.parametrize("granularity", ["tensor", "token"])
def test_kvcache_append_takes_any_layout_and_a_refused_append_changes_nothing(granularity, monkeypatch):
    """A quantized cache's ``append`` takes the new tokens in any layout, as an unquantized one
    does (a view whose last dim is not contiguous lands as its contiguous copy), and quantizes
    them before reserving: an append the quantizer refuses takes no page."""
    def make():
        return flashkernel.KVCache(num_blocks=4, page_size=4, num_kv_heads=2, head_dim=16, batch=1,
                                   max_blocks_per_seq=2, dtype=torch.float16, device=DEVICE, cache_dtype=torch.int8,
                                   scale_granularity=granularity, **({} if granularity == "token" else
                                                                     dict(k_scale=0.05, v_scale=0.05)))
    k, v = (torch.randn(5, 16, 2, device=DEVICE).half().transpose(1, 2) for _ in range(2))  # [5, 2, 16], last dim strided
    assert k.stride(-1) != 1
    strided, dense = make(), make()
    strided.append(0, k, v)
    dense.append(0, k.contiguous(), v.contiguous())
    for got, want in zip(strided.gather(0), dense.gather(0)):
        assert torch.equal(got, want)
    refused = make()

    def refuse(*args):
        raise ValueError("refused")

    monkeypatch.setattr(refused, "_quantized", refuse)
    with pytest.raises(ValueError, match="refused"):
        refused.append(0, k, v)
    assert refused.free_pages() == 4 and refused.pages(0) == [] and refused.block_table.tolist() == [[-1, -1]]
    assert refused.length(0) == 0 and refused.cache_seqlens.tolist() == [0]


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_layouts_gpu(fmt, granularity, page_size):
    run_quantized(GPU_LENGTHS, 4, (32, 8), 128, page_size, fmt, granularity, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, granularity", [(64, "token"), (256, "head")])
@pytest.mark.parametrize("heads", [(4, 4), (32, 4), (32, 1)], ids=["gqa1", "gqa8", "gqa32"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_head_dims_and_groups_gpu(fmt, heads, head_dim, granularity):
    run_quantized(GPU_LENGTHS, 2, heads, head_dim, 16, fmt, granularity, dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("head_dim", [8, 16, 24, 72])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_small_and_padded_head_dims_gpu(fmt, head_dim, page_size):
    """V read as words (decode.value_operand): halves of 4 to 36 words, masked past the head dim."""
    run_quantized(GPU_LENGTHS, 2, (8, 2), head_dim, page_size, fmt, "head", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_new", range(1, 9))
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_new_tokens_and_splits_gpu(num_splits, seqlen_new):
    if num_splits == 1 and seqlen_new % 4:
        pytest.skip("one split is covered at 4 and 8 new tokens")
    run_quantized(GPU_LENGTHS, seqlen_new, (32, 8), 128, 16, torch.float8_e4m3fn, "token", dtype=torch.bfloat16,
                  num_splits=num_splits)
    run_quantized(GPU_LENGTHS, seqlen_new, (32, 8), 128, None, torch.int8, "tensor", dtype=torch.bfloat16,
                  num_splits=num_splits, causal=seqlen_new % 2 == 0, append=seqlen_new % 3 != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["window", "softcap", "alibi", "sinks", "all"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_variants_gpu(fmt, name):
    names = ("window", "softcap", "alibi", "sinks") if name == "all" else (name,)
    kwargs = variant_kwargs(names, 5, 32, window=(300, 0))
    if name == "all":
        kwargs["cache_leftpad"] = torch.tensor([0, 1, 5, 100, 4000], dtype=torch.int32, device=DEVICE)
    run_quantized(GPU_LENGTHS, 2, (32, 8), 128, 16, fmt, "token", dtype=torch.bfloat16, num_splits=3, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, head_dim", [(None, 128), (16, 128), (64, 128), (256, 128), (16, 64), (16, 256)])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_gluon_kernel_gpu(fmt, granularity, page_size, head_dim):
    """The Gluon decode kernel over quantized caches (scales per tensor or KV head), named
    explicitly: "auto" gives it quantized caches only where ``tuned/decode.json`` says so."""
    a = quantized_inputs(fmt, granularity)
    if dispatch.decode_refusal("gluon", a["q"], a["k_cache"], a["v_cache"], a["block_table"],
                               dispatch.Variant.of(True), None, a["k_scale"]) is not None:
        pytest.skip("no Gluon decode kernel on this GPU")
    for seqlen_new, num_splits, poison in ((1, 0, True), (4, 3, False)):
        run_quantized(GPU_LENGTHS, seqlen_new, (16, 4), head_dim, page_size, fmt, granularity, dtype=torch.bfloat16,
                      num_splits=num_splits, poison=poison, causal=num_splits == 0, backend="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("granularity", ["tensor", "token"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_long_contexts_gpu(fmt, granularity, page_size):
    run_quantized((4097, 70001, 131072), 1, (32, 8), 128, page_size, fmt, granularity, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, head_dim", [(None, 128), (16, 128), (64, 128), (256, 128), (16, 64), (16, 256)])
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS.get)
def test_unused_slots_hold_nan_gpu(fmt, page_size, head_dim):
    for causal in (True, False):
        run_quantized((0, 1, 63, 64, 65, 200), 1, (8, 2), head_dim, page_size, fmt, "token", dtype=torch.bfloat16,
                      poison=True, causal=causal, num_splits=3)


@pytest.mark.gpu
def test_cache_over_2_31_elements_gpu():
    """A 1-byte cache of more than 2**31 elements: sequence 1's tokens lie past element 2**31."""
    heads, head_dim, lengths = 8, 128, (1000, 3000)
    tokens = 2**31 // (heads * head_dim) + 4096
    k_cache = torch.zeros(2, tokens, heads, head_dim, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache.view(torch.uint8)).view(torch.float8_e4m3fn)
    k_scale = torch.zeros(2, tokens, heads, device="cuda")
    v_scale = torch.zeros_like(k_scale)
    for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
        for b, n in enumerate(lengths):
            cache[b, :n], scale[b, :n] = reference.quantize_tokens(torch.randn(n, heads, head_dim, device="cuda"),
                                                                   torch.float8_e4m3fn)
    q = torch.randn(2, 1, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, 2, 1, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                                   k_scale=k_scale, v_scale=v_scale, return_lse=True)
    for b, n in enumerate(lengths):
        stored, scale = reference.quantize_tokens(k[b], torch.float8_e4m3fn)
        assert torch.equal(bits(k_cache[b, n:n + 1]), bits(stored)) and torch.equal(k_scale[b, n:n + 1], scale)
        keys = reference.dequantize(k_cache[b, :n + 1], k_scale[b, :n + 1])
        values = reference.dequantize(v_cache[b, :n + 1], v_scale[b, :n + 1])
        assert_output_close(out[b:b + 1], q[b:b + 1], keys[None], values[None], causal=True, lse=lse[b:b + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_cuda_graph_replay_equals_eager_gpu(page_size):
    """Capture one step (quantizing append with per-token scales + attend), replay it with new
    inputs: bitwise the eager call, caches and scales included."""
    lengths = (100, 3000, 0, 1234)
    k_float, v_float, block_table = make_cache(lengths, 4, 8, 128, torch.float32, page_size)
    k_cache, v_cache, k_scale, v_scale = flashkernel.quantize_kv(k_float, v_float, granularity="token")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(4, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, 4, 1, 8, 128, dtype=torch.bfloat16, device="cuda")

    def step(*cache):
        return flashkernel.flash_attn_with_kvcache(q, cache[0], cache[1], k=k, v=v, cache_seqlens=seqlens,
                                                   block_table=block_table, k_scale=cache[2], v_scale=cache[3],
                                                   return_lse=True)

    state = (k_cache, v_cache, k_scale, v_scale)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*state)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step(*state)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        eager = [x.clone() for x in state]
        out_e, lse_e = step(*eager)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(state, eager))
        seqlens.add_(1)


@pytest.mark.gpu
def test_decode_step_does_not_sync_gpu():
    a = quantized_inputs()
    k = torch.randn(2, 1, 2, 32, dtype=torch.float16, device="cuda")
    call(a, k=k, v=k)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(a, k=k, v=k)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_replayed_calls_never_mix_formats_gpu():
    """The eager fast path replays a call's launches for later calls of the same layouts: calls of
    one shape over a bf16 cache, then fp8 and int8 caches, per-tensor then per-token scales, each
    twice, in turn, are each right (a replay of another format's launches would not be)."""
    lengths, heads = (50, 700), (32, 8)
    k_float, v_float, _ = make_cache(lengths, 1, 8, 128, torch.bfloat16, None)
    q = torch.randn(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    cases = [(k_float, v_float, None, None)]
    for fmt in FORMATS:
        for granularity in ("tensor", "token"):
            cases.append(flashkernel.quantize_kv(k_float, v_float, dtype=fmt, granularity=granularity))
    for _ in range(2):
        for k_cache, v_cache, k_scale, v_scale in cases:
            out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                           k_scale=k_scale, v_scale=v_scale, return_lse=True)
            keys = k_cache if k_scale is None else reference.dequantize(k_cache, k_scale)
            values = v_cache if v_scale is None else reference.dequantize(v_cache, v_scale)
            for b, n in enumerate(lengths):
                assert_output_close(out[b:b + 1], q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n], causal=True,
                                    lse=lse[b:b + 1])
    assert len(interface._EAGER_CALLS) == len(cases)
