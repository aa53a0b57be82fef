"""Attention variants (sliding window, softcap, ALiBi, sinks) in prefill, decode and varlen.

Every case draws fresh random inputs, runs the public function (outputs start as NaN, see
conftest) and compares output and LSE with the float64 reference under the same variant, with
the error bound relative to PyTorch's own same-dtype error (helpers.assert_output_close).
"""

import itertools
import math

import pytest
import torch

import flashkernel
from flashkernel import interface, reference
from flashkernel.kernels import decode, prefill
from flashkernel.kernels._softmax import Variant
from helpers import DEVICE, DTYPES, assert_output_close, assert_varlen_close, random_qkv
from test_kvcache import make_cache

# The interpreter turns tensor loop bounds into ints through a numpy conversion numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

VARIANTS = ("window", "softcap", "alibi", "sinks")
PAIRS = list(itertools.combinations(VARIANTS, 2))


def alibi_slopes(num_heads: int, batch: int | None = None) -> torch.Tensor:
    """The geometric slopes of the ALiBi paper (``2^(-8 h / H)``), or random ones per sequence."""
    if batch is None:
        exponents = torch.arange(1, num_heads + 1, dtype=torch.float32) * (-8.0 / num_heads)
        return torch.pow(2.0, exponents).to(DEVICE)
    return torch.rand(batch, num_heads, device=DEVICE) * 0.5


def variant_kwargs(names, batch: int, num_heads: int, window=(23, 5)) -> dict:
    """Keyword arguments for the named variants, with fresh random parameters."""
    kwargs = {}
    for name in names:
        if name == "window":
            kwargs["window_size"] = window
        elif name == "softcap":
            kwargs["softcap"] = 2.5  # small enough to bend N(0, 1)-sized scores
        elif name == "alibi":
            kwargs["alibi_slopes"] = alibi_slopes(num_heads, batch if batch % 2 == 0 else None)
        elif name == "sinks":
            kwargs["sinks"] = torch.randn(num_heads, device=DEVICE) * 2
        else:
            raise ValueError(name)
    return kwargs


def run_dense(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, *, causal=False, scale_q=1.0, **variant):
    num_heads, num_kv_heads = heads
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, dtype)
    q = (q.float() * scale_q).to(dtype)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=causal, return_lse=True, **variant)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, num_heads, seqlen_q)
    assert_output_close(out, q, k, v, causal=causal, lse=lse, **variant)
    return q, k, v, out, lse


# ---- flash_attn_func: each variant, each pair, all four ---------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (1, 0), (40, -1), (-1, 5), (19, 7), (200, 200)])
def test_window(window, causal, dtype):
    run_dense(1, 77, 101, (4, 2), 64, dtype, causal=causal, window_size=window)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(101, 77), (1, 90), (70, 70)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_lengths(seqlen_q, seqlen_k, causal):
    run_dense(2, seqlen_q, seqlen_k, (2, 1), 64, torch.float16, causal=causal, window_size=(13, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["softcap", "alibi", "sinks"])
def test_single_variant(name, causal, dtype):
    run_dense(2, 45, 70, (4, 1), 64, dtype, causal=causal, **variant_kwargs([name], 2, 4))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_pairs(pair, causal):
    dtype = DTYPES[PAIRS.index(pair) % 2]
    run_dense(2, 66, 50, (4, 2), 72, dtype, causal=causal, **variant_kwargs(pair, 2, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_all_variants_together(causal, dtype):
    run_dense(1, 70, 97, (6, 2), 64, dtype, causal=causal, **variant_kwargs(VARIANTS, 1, 6))


@pytest.mark.parametrize("head_dim", [8, 256])
def test_head_dims_with_variants(head_dim):
    run_dense(1, 40, 70, (2, 1), head_dim, torch.bfloat16, causal=True,
              **variant_kwargs(VARIANTS, 1, 2, window=(30, 0)))


def test_float32_all_variants():
    run_dense(1, 40, 33, (2, 1), 32, torch.float32, causal=True, **variant_kwargs(VARIANTS, 1, 2))


@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_softcap_saturates_without_nan(softcap):
    """Scores far beyond the cap (|scale * q.k| in the hundreds): tanh hits +-1 exactly."""
    run_dense(1, 40, 64, (2, 1), 64, torch.float16, causal=True, scale_q=12.0, softcap=softcap)


@pytest.mark.parametrize("softcap", [50.0, 1000.0])
def test_float32_softcap_is_as_accurate_as_pytorch(softcap):
    """float32 computes the cap's tanh to a few ulps: with 1 - 2 / (1 + e^(2y)) a cap of 50 put
    the error over twice PyTorch's own (1.2x; 27x at 1000), caps far above the scores worst."""
    run_dense(1, 40, 50, (2, 2), 64, torch.float32, softcap=softcap, scale_q=3.0)
    run_decode((30, 0), 2, (4, 2), 64, torch.float32, 16, softcap=softcap)


def test_softcap_bounds_the_scores():
    """With the cap, LSE <= log(Sk) + softcap whatever the scores."""
    q, k, v, _, lse = run_dense(1, 20, 50, (2, 2), 64, torch.bfloat16, scale_q=30.0, softcap=3.0)
    assert (lse <= math.log(50) + 3.0 + 1e-4).all()


def test_alibi_per_sequence_slopes():
    slopes = torch.rand(3, 4, device=DEVICE)
    run_dense(3, 33, 47, (4, 4), 64, torch.float16, causal=True, alibi_slopes=slopes)


def test_alibi_strided_slopes():
    """A non-contiguous view of slopes (every other column of a wider tensor)."""
    slopes = torch.rand(2, 8, device=DEVICE)[:, ::2]
    run_dense(2, 30, 30, (4, 2), 64, torch.float16, alibi_slopes=slopes)


@pytest.mark.parametrize("sink", [float("-inf"), -30.0, 30.0])
def test_extreme_sinks(sink):
    """-inf is no sink; a very low sink changes nothing; a very high one takes all the weight."""
    sinks = torch.full((2,), sink, device=DEVICE)
    _, _, _, out, lse = run_dense(1, 20, 30, (2, 1), 64, torch.float16, causal=True, sinks=sinks)
    if sink == 30.0:
        assert out.abs().max() < 1e-6 and torch.allclose(lse, torch.full_like(lse, 30.0))


def test_rows_without_keys_get_zero_and_the_sink():
    """Window (0, 0) with Sq > Sk: queries 0..Sq-Sk-1 sit before key 0 and see nothing."""
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    q, k, v = random_qkv(1, 40, 9, 2, 1, 64, torch.float16)
    for with_sink in (False, True):
        extra = {"sinks": sinks} if with_sink else {}
        out, lse = flashkernel.flash_attn_func(q, k, v, window_size=(0, 0), return_lse=True, **extra)
        blind = 40 - 9
        assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
        expected = sinks[None, :, None].expand(1, 2, blind) if with_sink else torch.full((1, 2, blind), -math.inf)
        assert torch.equal(lse[:, :, :blind], expected.to(lse.device))
        assert_output_close(out, q, k, v, window_size=(0, 0), lse=lse, **extra)


def test_causal_window_is_the_intersection():
    """causal=True with window (l, r) == window (l, 0), bitwise; and (-1, 0) == causal."""
    q, k, v = random_qkv(1, 50, 80, 2, 1, 64, torch.float16)
    a = flashkernel.flash_attn_func(q, k, v, causal=True, window_size=(9, 7))
    b = flashkernel.flash_attn_func(q, k, v, window_size=(9, 0))
    assert torch.equal(a, b)
    c = flashkernel.flash_attn_func(q, k, v, window_size=(-1, 0))
    d = flashkernel.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(c, d)


def test_plain_arguments_are_the_plain_call():
    """Default variant arguments (and a window of (-1, -1)) give the plain kernel's bits."""
    q, k, v = random_qkv(2, 40, 40, 4, 2, 64, torch.bfloat16)
    a = flashkernel.flash_attn_func(q, k, v, causal=True)
    b = flashkernel.flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, sinks=None)
    assert torch.equal(a, b)


def _skipped_keys_poisoned(k, v, lo, hi):
    """Copies of k, v with NaN in every key outside ``[lo, hi)``."""
    k2, v2 = k.clone(), v.clone()
    for x in (k2, v2):
        x[:, :lo] = float("nan")
        x[:, hi:] = float("nan")
    return k2, v2


@pytest.mark.parametrize("window", [(30, 0), (12, 20), (5, -1)])
def test_tiles_outside_the_window_are_not_read(window):
    """One query tile (Sq <= BLOCK_M): keys in tiles outside its window span hold NaN, so a
    kernel that read them (NaN * 0 = NaN in P @ V) would return NaN."""
    config = prefill.pick_config(64, torch.float16, interface.kernels_interpreted(), tma=False)
    seqlen_q, seqlen_k = min(20, config.block_m), 300
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 1, 64, torch.float16)
    left, right = window
    first, last = seqlen_k - seqlen_q, seqlen_k - 1  # positions of the first and last query
    lo = max(first - left, 0) // config.block_n * config.block_n
    hi = seqlen_k if right < 0 else min(seqlen_k, last + right + 1)
    hi = min(seqlen_k, lo + -(-(hi - lo) // config.block_n) * config.block_n)
    assert lo > 0
    k2, v2 = _skipped_keys_poisoned(k, v, lo, hi)
    out, lse = flashkernel.flash_attn_func(q, k2, v2, window_size=window, return_lse=True)
    assert_output_close(out, q, k, v, window_size=window, lse=lse)


@pytest.mark.parametrize("tma", [False, True])
def test_tile_load_paths_with_variants(tma):
    """Pointer and TMA-descriptor loads under every variant (dense and packed)."""
    q, k, v = random_qkv(2, 70, 129, 4, 2, 64, torch.float16)
    kwargs = variant_kwargs(VARIANTS, 2, 4, window=(45, 3))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, 70), float("nan"), device=DEVICE)
    prefill.attention_forward(q, k, v, out, lse, causal=True, softmax_scale=0.1, force_tma=tma, **kwargs)
    assert_output_close(out, q, k, v, causal=True, softmax_scale=0.1, lse=lse, **kwargs)

    lengths_q, lengths_k = (70, 0, 3), (129, 20, 0)
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, (4, 2), 64, torch.float16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"), device=DEVICE)
    kwargs = variant_kwargs(VARIANTS, 3, 4, window=(45, 3))
    prefill.varlen_forward(q, k, v, cu_q, cu_k, 70, 129, out, lse, causal=True, softmax_scale=0.1,
                           force_tma=tma, **kwargs)
    assert_varlen_close(out, q, k, v, cu_q, cu_k, causal=True, softmax_scale=0.1, lse=lse, **kwargs)


# ---- flash_attn_with_kvcache --------------------------------------------------------------------


def run_decode(lengths, seqlen_new, heads, head_dim, dtype, page_size, *, causal=True, append=True,
               num_splits=0, **variant):
    num_heads, num_kv_heads = heads
    batch = len(lengths)
    k_cache, v_cache, block_table = make_cache(lengths, seqlen_new, num_kv_heads, head_dim, dtype, page_size)
    q = torch.randn(batch, seqlen_new, num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = v = None
    if append:
        k = torch.randn(batch, seqlen_new, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        v = torch.randn_like(k)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    if append:
        expected_k = reference.append_to_cache(expected_k, k, cache_seqlens, block_table)
        expected_v = reference.append_to_cache(expected_v, v, cache_seqlens, block_table)
    out, lse = flashkernel.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
        causal=causal, num_splits=num_splits, return_lse=True, **variant,
    )
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    slopes = variant.pop("alibi_slopes", None)
    for b, length in enumerate(lengths):
        total = length + (seqlen_new if append else 0)
        keys = reference.cache_prefix(expected_k, b, total, block_table)[None]
        values = reference.cache_prefix(expected_v, b, total, block_table)[None]
        per_seq = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        assert_output_close(out[b:b + 1], q[b:b + 1], keys, values, causal=causal,
                            lse=lse[b:b + 1], alibi_slopes=per_seq, **variant)
    return out, lse


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("name", VARIANTS)
def test_decode_single_variant(name, page_size, num_splits):
    dtype = DTYPES[num_splits % 2]
    run_decode((0, 17, 150), 2, (8, 2), 64, dtype, page_size, num_splits=num_splits,
               **variant_kwargs([name], 3, 8, window=(40, 0)))


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_decode_pairs(pair):
    dtype = DTYPES[PAIRS.index(pair) % 2]
    run_decode((3, 90), 3, (8, 2), 64, dtype, 16, num_splits=2, **variant_kwargs(pair, 2, 8, window=(20, 0)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (1, -1), (70, 2)])
def test_decode_windows_and_all_variants(window, causal):
    kwargs = variant_kwargs(VARIANTS, 3, 4, window=window)
    run_decode((0, 5, 130), 4, (4, 1), 64, torch.float16, None, causal=causal, num_splits=3, **kwargs)


def test_decode_without_append_early_queries_get_the_sink():
    """cache_seqlens 1, 4 queries, nothing appended: tokens 0..2 see no key -> 0 and the sink."""
    sinks = torch.tensor([1.5, -2.0], device=DEVICE)
    out, lse = run_decode((1,), 4, (2, 1), 64, torch.float16, None, append=False, num_splits=2, sinks=sinks)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    assert torch.equal(lse[0, :, :3], sinks[:, None].expand(2, 3))


def test_decode_window_reads_only_the_window():
    """Cache slots below the window's tiles hold NaN and are never read (decode reads ~w keys)."""
    block_n = decode.pick_config(64, torch.float16, interface.kernels_interpreted()).block_n
    lengths, left = (500, 300), 40
    k_cache, v_cache, _ = make_cache(lengths, 1, 2, 64, torch.float16, None)
    q = torch.randn(2, 1, 8, 64, dtype=torch.float16, device=DEVICE)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for b, length in enumerate(lengths):
        lo = (length - 1 - left) // block_n * block_n
        for x in (poisoned_k, poisoned_v):
            x[b, :lo] = float("nan")
            x[b, length:] = float("nan")
    for splits in (1, 4):
        out, lse = flashkernel.flash_attn_with_kvcache(q, poisoned_k, poisoned_v, cache_seqlens=seqlens,
                                                       window_size=(left, 0), num_splits=splits,
                                                       return_lse=True)
        for b, length in enumerate(lengths):
            assert_output_close(out[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :length], v_cache[b:b + 1, :length],
                                causal=True, window_size=(left, 0), lse=lse[b:b + 1])


def test_decode_empty_cache_gets_the_sink_without_launch(monkeypatch):
    monkeypatch.setattr(interface.dispatch, "decode", lambda *a, **k: pytest.fail("launched"))
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16, device=DEVICE)
    cache = torch.randn(2, 0, 2, 64, dtype=torch.float16, device=DEVICE)
    sinks = torch.randn(4, device=DEVICE)
    seqlens = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out, lse = flashkernel.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks[None, :, None].expand(2, 4, 1))


def test_decode_auto_splits_follow_the_window():
    """A left-bounded window shrinks the span the automatic split count is sized for."""
    window = Variant.of(True, (1000, 0))
    assert decode.attended_span(window, 131072, 1, 16, 128) == 1000 + 1 + 0 + 128
    assert decode.attended_span(Variant.of(True), 131072, 1, 16, 128) == 131072
    assert decode.attended_span(Variant.of(False, (-1, 5)), 4096, 4, 16, 64) == 4096
    wide = decode.pick_num_splits(8, 131072, 128, 132, False)
    narrow = decode.pick_num_splits(8, decode.attended_span(window, 131072, 1, 16, 128), 128, 132, False)
    assert narrow < wide


# ---- flash_attn_varlen_func ---------------------------------------------------------------------


def packed(lengths_q, lengths_k, heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    cu_q = torch.tensor([0, *itertools.accumulate(lengths_q)], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *itertools.accumulate(lengths_k)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu_q[-1]), num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(int(cu_k[-1]), num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    return q, k, torch.randn_like(k), cu_q, cu_k


def run_varlen(lengths_q, lengths_k, heads, head_dim, dtype, *, causal=False, **variant):
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, heads, head_dim, dtype)
    out, lse = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                  causal=causal, return_lse=True, **variant)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (heads[0], q.shape[0])
    assert_varlen_close(out, q, k, v, cu_q, cu_k, causal=causal, lse=lse, **variant)
    return q, k, v, cu_q, cu_k, out, lse


# Awkward: empty sequences (q and k), one-token ones, lengths around the tile size, Sq != Sk.
RAGGED_Q = (5, 0, 70, 33, 1, 64)
RAGGED_K = (40, 9, 70, 0, 1, 100)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_plain(causal, dtype):
    run_varlen(RAGGED_Q, RAGGED_K, (4, 2), 64, dtype, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", VARIANTS)
def test_varlen_single_variant(name, causal):
    dtype = DTYPES[len(name) % 2]
    run_varlen(RAGGED_Q, RAGGED_K, (4, 1), 64, dtype, causal=causal,
               **variant_kwargs([name], len(RAGGED_Q), 4, window=(17, 3)))


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_varlen_pairs(pair):
    dtype = DTYPES[PAIRS.index(pair) % 2]
    run_varlen((31, 2, 40), (31, 50, 3), (4, 2), 64, dtype, causal=True, **variant_kwargs(pair, 3, 4))


def test_varlen_all_variants_gqa():
    run_varlen((10, 65, 1), (80, 65, 1), (8, 2), 72, torch.bfloat16, causal=True,
               **variant_kwargs(VARIANTS, 3, 8, window=(30, -1)))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_dense_per_sequence(causal):
    """Each sequence of a packed call is the dense call on that sequence alone (bitwise when
    interpreted: same tiles, same order of operations)."""
    lengths = (37, 64, 5)
    q, k, v, cu_q, cu_k = packed(lengths, lengths, (4, 2), 64, torch.float16)
    sinks = torch.randn(4, device=DEVICE)
    out, lse = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=causal, sinks=sinks,
                                                  window_size=(20, 20), return_lse=True)
    for b in range(3):
        s, e = int(cu_q[b]), int(cu_q[b + 1])
        dense, dense_lse = flashkernel.flash_attn_func(q[None, s:e], k[None, s:e], v[None, s:e], causal=causal,
                                                       sinks=sinks, window_size=(20, 20), return_lse=True)
        if interface.kernels_interpreted():
            assert torch.equal(out[s:e], dense[0]) and torch.equal(lse[:, s:e], dense_lse[0])
        else:
            torch.testing.assert_close(out[s:e], dense[0], atol=2e-3, rtol=0)


def test_varlen_many_sequences_in_chunks(monkeypatch):
    """More sequences than one launch schedules: launched in chunks, [B, Hq] slopes follow."""
    monkeypatch.setattr(prefill, "MAX_VARLEN_SEQS", 4)
    lengths = (3, 0, 17, 1, 40, 2, 2, 33, 9, 1)
    run_varlen(lengths, lengths, (2, 1), 64, torch.float16, causal=True,
               alibi_slopes=torch.rand(len(lengths), 2, device=DEVICE))


def test_varlen_sequences_after_the_grid_bound_are_computed():
    """Many short sequences: the tile bound min(total // BLOCK_M + B, B * cdiv(max, BLOCK_M))."""
    lengths = (1,) * 40 + (45,)
    run_varlen(lengths, lengths, (2, 2), 32, torch.float16, causal=True)


def test_varlen_no_keys_anywhere_gets_the_sink_without_launch(monkeypatch):
    monkeypatch.setattr(interface.dispatch, "prefill_varlen", lambda *a, **k: pytest.fail("launched"))
    q, k, v, cu_q, cu_k = packed((3, 4), (0, 0), (2, 1), 64, torch.float16)
    sinks = torch.tensor([0.25, -3.0], device=DEVICE)
    out, lse = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 0, sinks=sinks, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sinks[:, None].expand(2, 7))
    out, lse = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 0, return_lse=True)
    assert torch.isneginf(lse).all()


def test_varlen_empty_batch():
    q, k, v, cu_q, cu_k = packed((), (), (2, 1), 64, torch.float16)
    out = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 0)
    assert out.shape == (0, 2, 64)


def test_varlen_unchecked_bad_offsets_stay_in_bounds():
    """validate=False with offsets past the end: wrong numbers allowed, no crash or NaN-free
    promise, but the kernel clamps every offset into the tensors."""
    q, k, v, _, _ = packed((10, 10), (10, 10), (2, 1), 64, torch.float16)
    bad = torch.tensor([0, 15, 10**6], dtype=torch.int32, device=DEVICE)
    flashkernel.flash_attn_varlen_func(q, k, v, bad, bad, 20, 20, validate=False)


# ---- host-side normalization ------------------------------------------------------------------


def test_variant_normalization():
    assert Variant.of(False) == Variant(False, None)
    assert Variant.of(True).causal and Variant.of(True).window is None
    assert Variant.of(False, (-1, 0)).causal  # the causal window is the CAUSAL kernel
    assert Variant.of(True, (5, 9)).window == (5, 0)  # causal caps the right side at 0
    assert Variant.of(True, (-1, 9)) == Variant(True, None)
    assert Variant.of(False, (-1, 3)).window == (-1, 3)
    assert Variant.of(False, (4, -1)).window_args(10, 20) == (4, 10)  # unbounded right -> Sq
    assert Variant.of(False, (-1, 2)).window_args(10, 20) == (20, 2)  # unbounded left -> Sk
    assert Variant.of(False, (10**9, 10**9)).window_args(10, 20) == (20, 10)
    assert Variant.of(False).is_plain and not Variant.of(False, softcap=1.0).is_plain


# ---- GPU only -----------------------------------------------------------------------------------

GPU_COMBOS = [(), *[(v,) for v in VARIANTS], *PAIRS, VARIANTS]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("combo", GPU_COMBOS, ids=["+".join(c) or "plain" for c in GPU_COMBOS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_grid_gpu(dtype, combo, causal, head_dim):
    for seqlen_q, seqlen_k in ((1000, 1000), (257, 4500), (4500, 300)):
        run_dense(2, seqlen_q, seqlen_k, (8, 2), head_dim, dtype, causal=causal,
                  **variant_kwargs(combo, 2, 8, window=(511, 129)))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(4096, 0), (1000, 1000), (0, 0), (-1, 300)])
def test_sliding_window_16k_gpu(window):
    run_dense(1, 16384, 16384, (4, 1), 128, torch.bfloat16, causal=window[1] == 0, window_size=window)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("combo", GPU_COMBOS, ids=["+".join(c) or "plain" for c in GPU_COMBOS])
def test_decode_grid_gpu(combo, page_size):
    for seqlen_new, splits in ((1, 0), (4, 0), (3, 5)):
        run_decode((0, 1, 17, 300, 4097), seqlen_new, (32, 8), 128, torch.bfloat16, page_size, num_splits=splits,
                   **variant_kwargs(combo, 5, 32, window=(1024, 0)))


@pytest.mark.gpu
@pytest.mark.parametrize("combo", GPU_COMBOS, ids=["+".join(c) or "plain" for c in GPU_COMBOS])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_grid_gpu(combo, causal):
    lengths_q = (1, 0, 127, 129, 1000, 4097, 3)
    lengths_k = (1, 5, 127, 300, 1000, 4097, 0)
    # 4 query heads: the float64 reference of the 4097-token sequence is ~0.5 GB per
    # intermediate, so many test workers can share the GPU.
    run_varlen(lengths_q, lengths_k, (4, 1), 128, torch.bfloat16, causal=causal,
               **variant_kwargs(combo, 7, 4, window=(700, 50)))


@pytest.mark.gpu
def test_varlen_skewed_many_sequences_gpu():
    """More sequences than one launch takes (chunks of MAX_VARLEN_SEQS), one of them long."""
    lengths = [int(x) for x in torch.randint(1, 1000, (prefill.MAX_VARLEN_SEQS + 77,))]
    lengths[7] = 16000
    run_varlen(lengths, lengths, (2, 2), 64, torch.bfloat16, causal=True)  # 16k^2 float64 reference: 2 heads
