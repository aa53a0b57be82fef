"""flash_attn_with_kvcache (append + split-KV GQA decode + combine) and KVCache.

Every case builds a fresh random cache, runs one call, then checks (1) the WHOLE cache after
the call equals the cache before with exactly the new tokens written (reference.append_to_cache)
and (2) each sequence's output and LSE against the float64 reference over its keys, with the
error bound relative to PyTorch's own same-dtype error (helpers.assert_output_close).
"""

import dataclasses
import functools

import pytest
import torch

import flashkernel
from flashkernel import interface, ops, reference
from flashkernel.kernels import combine as combine_module
from flashkernel.kernels import decode, dispatch, tuning
from flashkernel.kernels._softmax import Variant
from helpers import DEVICE, DTYPES, assert_output_close

# The interpreter turns tensor loop bounds into ints through a numpy conversion numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

CPU_LENGTHS = (0, 1, 17, 300)
PAGE_SIZES = (None, 1, 16, 64, 256)  # None = contiguous cache


def make_cache(lengths, seqlen_new, num_kv_heads, head_dim, dtype, page_size, slack=5, unused_entry=None):
    """Random caches holding ``lengths`` tokens (+ room for ``seqlen_new`` + slack) per sequence.

    Paged pools have spare pages and a random page order; unused block-table entries hold
    ``unused_entry`` (default: an index past the pool), which must never be read.
    """
    batch = len(lengths)
    need = max(lengths) + seqlen_new + slack
    if page_size is None:
        k_cache = torch.randn(batch, need, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        return k_cache, torch.randn_like(k_cache), None
    max_blocks = -(-need // page_size)
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    pages = torch.randperm(num_blocks, device=DEVICE)[: batch * max_blocks].view(batch, max_blocks)
    block_table = pages.to(torch.int32)
    for b, length in enumerate(lengths):
        used = -(-(length + seqlen_new) // page_size)
        block_table[b, used:] = num_blocks + 1000 if unused_entry is None else unused_entry
    return k_cache, torch.randn_like(k_cache), block_table


def check_sequences(out, lse, q, k_cache, v_cache, lengths, block_table, causal, softmax_scale=None):
    """Each sequence ``b`` against the reference over its first ``lengths[b]`` cached tokens."""
    for b, length in enumerate(lengths):
        if length == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"sequence {b} has no keys"
            assert lse is None or torch.isneginf(lse[b]).all()
            continue
        keys = reference.cache_prefix(k_cache, b, length, block_table)[None]
        values = reference.cache_prefix(v_cache, b, length, block_table)[None]
        assert_output_close(out[b:b + 1], q[b:b + 1], keys, values, causal=causal,
                            softmax_scale=softmax_scale, lse=None if lse is None else lse[b:b + 1])


def run_and_check(lengths, seqlen_new, heads, head_dim, dtype, page_size, *, causal=True,
                  append=True, num_splits=0, softmax_scale=None, validate=None, unused_entry=None):
    num_heads, num_kv_heads = heads
    batch = len(lengths)
    k_cache, v_cache, block_table = make_cache(lengths, seqlen_new, num_kv_heads, head_dim, dtype, page_size,
                                               unused_entry=unused_entry)
    q = torch.randn(batch, seqlen_new, num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = v = None
    if append:
        k = torch.randn(batch, seqlen_new, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        v = torch.randn_like(k)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    saved = [t.clone() for t in (q, cache_seqlens, k_cache, v_cache)]
    out, lse = flashkernel.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens, block_table=block_table,
        causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True, validate=validate,
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, num_heads, seqlen_new) and lse.dtype == torch.float32
    assert torch.equal(q, saved[0]) and torch.equal(cache_seqlens, saved[1])

    expected_k, expected_v = saved[2], saved[3]
    if append:
        expected_k = reference.append_to_cache(expected_k, k, cache_seqlens, block_table)
        expected_v = reference.append_to_cache(expected_v, v, cache_seqlens, block_table)
    assert torch.equal(k_cache, expected_k), "k_cache differs from the cache with k appended"
    assert torch.equal(v_cache, expected_v), "v_cache differs from the cache with v appended"
    totals = [length + (seqlen_new if append else 0) for length in lengths]
    check_sequences(out, lse, q, expected_k, expected_v, totals, block_table, causal, softmax_scale)
    return out, lse


# ---- the grid, cut for the interpreter --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_sizes_and_ragged_lengths(page_size, dtype):
    run_and_check(CPU_LENGTHS, 2, (8, 2), 64, dtype, page_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2), (32, 1)], ids=["mha", "gqa4", "gqa8", "mqa32"])
def test_gqa_ratios(heads, dtype):
    run_and_check((17, 90), 1, heads, 64, dtype, 16)


@pytest.mark.parametrize("seqlen_new", [1, 2, 3, 5, 8])
def test_new_tokens_causal_among_themselves(seqlen_new):
    run_and_check((0, 9, 70), seqlen_new, (8, 2), 64, torch.float16, 16)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 72])
def test_head_dims(head_dim):
    run_and_check((1, 40), 2, (4, 2), head_dim, torch.bfloat16, None)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("page_size", [None, 16])
def test_split_counts(num_splits, page_size):
    """Split and unsplit; more splits than tiles leaves splits empty (merged as -inf)."""
    run_and_check((0, 33, 200), 3, (8, 2), 64, torch.float16, page_size, num_splits=num_splits)


def test_many_row_tiles():
    """MQA with 8 new tokens and head dim 256: 256 rows, more than one row tile."""
    assert decode.pick_block_m(32 * 8, 256) < 32 * 8
    run_and_check((5, 60), 8, (32, 1), 256, torch.float16, 64, num_splits=2)


@pytest.mark.parametrize("page_size", [None, 16])
def test_not_causal(page_size):
    run_and_check((0, 17, 100), 4, (8, 2), 64, torch.float16, page_size, causal=False)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [None, 1])
def test_no_new_tokens(page_size, causal):
    """Without k, v: attend to the cache as it is; with L < seqlen_q early queries see nothing."""
    run_and_check((0, 2, 50), 4, (4, 1), 64, torch.float16, page_size, causal=causal, append=False)


def test_float32():
    run_and_check((3, 45), 2, (4, 2), 64, torch.float32, 16)


@pytest.mark.parametrize("softmax_scale", [0.01, 0.5])
def test_custom_softmax_scale(softmax_scale):
    run_and_check((20, 64), 1, (4, 2), 64, torch.float16, None, softmax_scale=softmax_scale)


def test_early_queries_see_nothing():
    """cache_seqlens 1, 4 query tokens, nothing appended: tokens 0..2 see no key."""
    out, lse = run_and_check((1,), 4, (2, 1), 64, torch.float16, None, append=False)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))
    assert torch.isneginf(lse[0, :, :3]).all() and torch.isfinite(lse[0, :, 3]).all()


MIXED = [  # (page_size, (Hq, Hkv), seqlen_new, head_dim, dtype, num_splits)
    (16, (32, 8), 1, 128, torch.bfloat16, 0),  # the 7B-class decode shape
    (1, (32, 1), 3, 128, torch.bfloat16, 0),
    (256, (8, 2), 8, 64, torch.float16, 4),
    (64, (4, 1), 5, 256, torch.float16, 1),
    (None, (16, 4), 2, 128, torch.bfloat16, 3),
    (None, (32, 32), 1, 64, torch.float16, 0),
]


@pytest.mark.parametrize("page_size, heads, seqlen_new, head_dim, dtype, num_splits", MIXED)
def test_mixed_configurations(page_size, heads, seqlen_new, head_dim, dtype, num_splits):
    run_and_check(CPU_LENGTHS, seqlen_new, heads, head_dim, dtype, page_size, num_splits=num_splits)


# ---- layouts, determinism, workspace -----------------------------------------------------------


def test_strided_views_of_one_kv_pool():
    """k_cache, v_cache as views of one [num_blocks, 2, page, H, D] pool; q a strided view."""
    pool = torch.randn(12, 2, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    k_cache, v_cache = pool.unbind(1)
    block_table = torch.tensor([[3, 7, 1], [0, 11, 5]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 2, 8, 64, dtype=torch.float16, device=DEVICE)[:, :, ::2]
    k = torch.randn(2, 2, 2, 64, dtype=torch.float16, device=DEVICE)
    v = torch.randn(2, 2, 4, 64, dtype=torch.float16, device=DEVICE)[:, :, 1::2]
    seqlens = torch.tensor([20, 31], dtype=torch.int32, device=DEVICE)
    before = pool.clone()
    out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                                   block_table=block_table, return_lse=True, num_splits=2)
    expected_k = reference.append_to_cache(before[:, 0], k, seqlens, block_table)
    expected_v = reference.append_to_cache(before[:, 1], v, seqlens, block_table)
    assert torch.equal(pool, torch.stack([expected_k, expected_v], dim=1))
    check_sequences(out, lse, q, expected_k, expected_v, [22, 33], block_table, True)


def test_strided_seqlens_and_block_table():
    """cache_seqlens and block_table as strided views (every other element / column)."""
    lengths = (40, 3)
    k_cache, v_cache, block_table = make_cache(lengths, 1, 2, 64, torch.float16, 16)
    wide = torch.zeros(2, 2 * block_table.shape[1], dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = block_table
    wide[:, 1::2] = -5  # never read
    seqlens = torch.tensor([40, -9, 3, -9], dtype=torch.int32, device=DEVICE)[::2]
    q = torch.randn(2, 1, 4, 64, dtype=torch.float16, device=DEVICE)
    out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                   block_table=wide[:, ::2], return_lse=True, num_splits=2)
    check_sequences(out, lse, q, k_cache, v_cache, lengths, block_table, True)


@pytest.mark.parametrize("page_size", [None, 1, 64])
def test_unvalidated_bad_values_stay_in_bounds(page_size):
    """validate=False with lengths past capacity, negative lengths and a block table pointing
    outside the pool: no out-of-bounds access, no append lands anywhere, outputs are finite."""
    k_cache, v_cache, block_table = make_cache((60, 60), 2, 2, 64, torch.float16, page_size)
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * page_size
    if block_table is not None:
        block_table[0] = 10**6
        block_table[1] = -3
    seqlens = torch.tensor([capacity + 50, -7], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 2, 4, 64, dtype=torch.float16, device=DEVICE)
    k = torch.randn(2, 2, 2, 64, dtype=torch.float16, device=DEVICE)
    before = k_cache.clone(), v_cache.clone()
    out = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=k, cache_seqlens=seqlens,
                                             block_table=block_table, validate=False, num_splits=3)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("validate", [None, True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_block_table_padded_with_minus_one(page_size, validate):
    """-1 past each sequence's pages (transformers' continuous batching pads its block tables so)
    is accepted, validated or not, and never read."""
    run_and_check([0, 17, 40], 2, (4, 2), 32, torch.float16, page_size, validate=validate, unused_entry=-1)


def test_identical_calls_are_bitwise_identical():
    k_cache, v_cache, block_table = make_cache((70, 130), 1, 2, 64, torch.bfloat16, 16)
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    seqlens = torch.tensor([70, 130], dtype=torch.int32, device=DEVICE)
    call = lambda: flashkernel.flash_attn_with_kvcache(  # noqa: E731
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table, num_splits=3, return_lse=True)
    (a, lse_a), (b, lse_b) = call(), call()
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)


@pytest.mark.parametrize("in_kernel", [True, False], ids=["merged_in_kernel", "combine"])
def test_nan_workspace_is_never_read_unwritten(monkeypatch, in_kernel):
    """Split partials start as NaN (conftest poisons every allocation of a call): every element
    the merge reads (in the decode kernel or in combine) must have been written."""
    if not in_kernel:
        _merge_in_kernel_at_most(monkeypatch, 0)
    run_and_check((0, 5, 150), 2, (8, 2), 64, torch.float16, 16, num_splits=6)


def _merge_in_kernel_at_most(monkeypatch, max_bytes: int) -> None:
    """Let the decode kernel merge its splits only for steps that read at most ``max_bytes``,
    whatever their split count (recorded calls forgotten: they were planned with the other
    setting)."""
    tuned = tuning.decode_tuning(torch.device(DEVICE) if DEVICE == "cuda" else None)
    monkeypatch.setattr(decode.tuning, "decode_tuning", lambda device: dataclasses.replace(
        tuned, merge_in_kernel_max_bytes=max_bytes, merge_in_kernel_max_splits=0))
    interface._EAGER_CALLS.clear()
    ops._OP_CALLS.clear()


def test_eager_steps_of_few_splits_over_caches_in_qs_dtype_merge_in_the_kernel_at_any_size():
    """``decode.merges_in_kernel``: a short step merges in the kernel whatever its split count; a
    longer one only over a cache in q's dtype with at most ``merge_in_kernel_max_splits`` splits;
    never one split, never under capture."""
    tuned = tuning.decode_tuning(None)
    bytes_per_key, long_span = 8 * 128 * 2, 32768  # batch 1, 8 KV heads of 128, bf16: 128 MiB
    assert long_span * 2 * bytes_per_key > tuned.merge_in_kernel_max_bytes
    most = tuned.merge_in_kernel_max_splits
    assert decode.merges_in_kernel(most, bytes_per_key, long_span, tuned, False)
    assert decode.merges_in_kernel(2, bytes_per_key, long_span, tuned, False)
    assert not decode.merges_in_kernel(most + 1, bytes_per_key, long_span, tuned, False)
    assert not decode.merges_in_kernel(most, bytes_per_key, long_span, tuned, False, quantized=True)
    assert not decode.merges_in_kernel(most, bytes_per_key, long_span, tuned, True)
    assert not decode.merges_in_kernel(1, bytes_per_key, 1024, tuned, False)
    assert decode.merges_in_kernel(4 * most, bytes_per_key, 1024, tuned, False)
    assert decode.merges_in_kernel(4 * most, bytes_per_key, 1024, tuned, False, quantized=True)


@pytest.mark.parametrize("batch, context, page_size, kv_scale, splits, merge", [
    (8, 4096, 0, 0, 2, True),  # 128 MiB of bf16 keys and values: past the bytes rule, 2 splits
    (1, 32768, 0, 0, 16, True),
    (8, 4096, 16, 0, 4, True),
    (1, 32768, 16, 0, 33, False),  # more splits than merge_in_kernel_max_splits: the combine
    (8, 4096, 0, 1, 4, False),  # a 1-byte cache (scales per tensor), 4 splits: the bytes rule only
    (1, 1024, 0, 0, 16, True),  # short: the bytes rule
])
def test_plan_merges_eager_steps_of_few_splits_over_caches_in_qs_dtype(monkeypatch, batch, context, page_size,
                                                                          kv_scale, splits, merge):
    """``plan_decode`` (132 SMs, the shipped tuning, 32 query / 8 KV heads of 128, one new token)
    passes the cache's format to ``merges_in_kernel``: the split counts the rule was measured at
    and the choice at each."""
    monkeypatch.setattr(decode, "sm_count", lambda device, interpreted: 132)
    tuned = tuning.decode_tuning(None)
    q = torch.empty(batch, 1, 32, 128, dtype=torch.bfloat16)
    if page_size:
        k_cache = torch.empty(batch * context // page_size, page_size, 8, 128, dtype=torch.bfloat16)
        block_table = torch.zeros(batch, context // page_size, dtype=torch.int32)
    else:
        k_cache, block_table = torch.empty(batch, context, 8, 128, dtype=torch.bfloat16), None
    plan = decode.plan_decode(q, 8, decode.CacheGeometry.of(k_cache, block_table), Variant.of(False), 0, None, tuned,
                              kv_scale, False)
    assert plan.num_splits == splits and plan.merge == merge


@pytest.mark.parametrize("case", [
    dict(lengths=(0, 37, 150), seqlen_new=1, heads=(8, 2), head_dim=64, num_splits=5),
    dict(lengths=(90,), seqlen_new=3, heads=(12, 2), head_dim=32, num_splits=7),  # 18 rows: five rounds of 4
    dict(lengths=(40,), seqlen_new=5, heads=(32, 1), head_dim=32, num_splits=3),  # 160 rows: two row tiles
    dict(lengths=(200, 3), seqlen_new=2, heads=(4, 4), head_dim=128, num_splits=20),  # two chunks of splits
], ids=["gqa4", "rows_in_rounds", "two_row_tiles", "chunks"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_splits_merged_in_the_kernel_equal_the_combine_launch(monkeypatch, case, page_size):
    """The same split step merged by the decode kernel's last program per row tile and by the
    combine launch: one launch against two, equal outputs and LSEs up to float32 rounding (the
    sums run in another order), and the counters left at zero for the next launch."""
    k_cache, v_cache, block_table = make_cache(case["lengths"], case["seqlen_new"], case["heads"][1],
                                               case["head_dim"], torch.float16, page_size)
    q = torch.randn(len(case["lengths"]), case["seqlen_new"], case["heads"][0], case["head_dim"],
                    dtype=torch.float16, device=DEVICE)
    seqlens = torch.tensor(case["lengths"], dtype=torch.int32, device=DEVICE)
    launches, counters = [], []
    real_combine, real_allocate = decode.combine, decode.allocate

    def counted_combine(*args, **kwargs):
        launches.append("combine")
        return real_combine(*args, **kwargs)

    def kept_allocate(shape, dtype, device, zeroed=False):
        buffer = real_allocate(shape, dtype, device, zeroed=zeroed)
        if zeroed:
            counters.append(buffer)
        return buffer

    monkeypatch.setattr(decode, "combine", counted_combine)
    monkeypatch.setattr(decode, "allocate", kept_allocate)
    results = {}
    for max_bytes in (1 << 40, 0):
        _merge_in_kernel_at_most(monkeypatch, max_bytes)
        launches.clear()
        results[max_bytes] = decode_results = flashkernel.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table, num_splits=case["num_splits"],
            return_lse=True, backend="triton")
        assert launches == ([] if max_bytes else ["combine"])
        assert not torch.isnan(decode_results[0]).any()
    assert len(counters) == 1 and not counters[0].any(), "the counters must be left at zero"
    merged, combined = results[1 << 40], results[0]
    torch.testing.assert_close(merged[0], combined[0], rtol=0, atol=2e-3)
    torch.testing.assert_close(merged[1], combined[1], rtol=1e-6, atol=1e-6, equal_nan=True)


def test_return_lse_false_returns_tensor_only():
    k_cache, v_cache, _ = make_cache((4,), 1, 1, 64, torch.float16, None)
    q = torch.randn(1, 1, 2, 64, dtype=torch.float16, device=DEVICE)
    seqlens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    out = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("shape", [(0, 1), (2, 0)], ids=["batch0", "seqlen_q0"])
def test_empty_inputs_return_without_launch(shape, monkeypatch):
    batch, seqlen_new = shape

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty problem")

    monkeypatch.setattr(interface.dispatch, "decode", no_launch)
    k_cache, v_cache, block_table = make_cache([3] * max(batch, 1), 1, 2, 64, torch.float16, 16)
    block_table = block_table[:batch]
    q = torch.randn(batch, seqlen_new, 4, 64, dtype=torch.float16, device=DEVICE)
    seqlens = torch.full((batch,), 3, dtype=torch.int32, device=DEVICE)
    out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                   block_table=block_table, return_lse=True)
    assert out.shape == q.shape and lse.shape == (batch, 4, seqlen_new)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_auto_splits_depend_on_shapes_only():
    assert decode.pick_num_splits(programs=8, capacity=131072, block_n=64, sms=132, interpreted=False) == 16
    assert decode.pick_num_splits(programs=64, capacity=131072, block_n=64, sms=132, interpreted=False) == 2
    # Small pages: a second wave once each split still reads >= 512 keys; large pages as contiguous.
    assert decode.pick_num_splits(programs=8, capacity=131072, block_n=64, sms=132, interpreted=False,
                                  page_size=16) == 33
    assert decode.pick_num_splits(programs=8, capacity=4096, block_n=64, sms=132, interpreted=False,
                                  page_size=16) == 16
    assert decode.pick_num_splits(programs=8, capacity=131072, block_n=64, sms=132, interpreted=False,
                                  page_size=256) == 16
    assert decode.pick_num_splits(programs=512, capacity=131072, block_n=64, sms=132, interpreted=False) == 1
    # Contiguous 1-byte caches: two programs per SM (the tuning's quantized_contiguous_waves).
    assert decode.pick_num_splits(programs=64, capacity=131072, block_n=128, sms=132, interpreted=False,
                                  quantized=True) == 4
    assert decode.pick_num_splits(programs=8, capacity=131072, block_n=128, sms=132, interpreted=False,
                                  page_size=16, quantized=True) == 33
    assert decode.pick_num_splits(programs=64, capacity=131072, block_n=128, sms=132, interpreted=False,
                                  page_size=256, quantized=True) == 2
    assert decode.pick_num_splits(programs=8, capacity=512, block_n=64, sms=132, interpreted=False) == 8
    assert decode.pick_num_splits(programs=8, capacity=512, block_n=128, sms=132, interpreted=False) == 4
    # Outside the measured short-context regime (head dim > 128, fp32, explicit configs).
    assert decode.pick_num_splits(programs=8, capacity=512, block_n=32, sms=132, interpreted=False,
                                  min_split_tokens=tuning.decode_tuning(None).unmeasured_min_split_tokens) == 2
    assert decode.pick_num_splits(programs=1, capacity=10**6, block_n=64, sms=132, interpreted=False) == 128


def test_gluon_kernel_runs_by_default_over_short_paged_items():
    """The measured regime (docs/perf-notes.md "Decode in Gluon"): paged caches at head dim 128,
    work items of at most gluon_max_item_tokens keys; contiguous caches stay on Triton."""
    tuned = tuning.decode_tuning(None)
    wanted = functools.partial(dispatch.gluon_decode_wanted, tuned=tuned)
    assert wanted(16, 128, 64) and wanted(256, 128, 4096)
    assert not wanted(16, 128, 4097)
    assert not wanted(0, 128, 256) and not wanted(0, 128, 64)
    assert not wanted(16, 64, 64) and not wanted(16, 256, 64)
    # A step that appends: batch 1 to 16 whose batch x capacity is at least 4096 keys.
    assert wanted(16, 128, 64, append_batch_tokens=(1, 4096)) and wanted(16, 128, 64, append_batch_tokens=(16, 4096))
    assert not wanted(16, 128, 64, append_batch_tokens=(1, 4095))
    assert not wanted(16, 128, 64, append_batch_tokens=(17, 17 * 4096))
    assert not wanted(16, 128, 4097, append_batch_tokens=(8, 8 * 4096))
    # One wave of work items: B=1 (8 KV heads) 16 splits, B=8 2, B=64 1; each at least a tile.
    gluon = pytest.importorskip("flashkernel.kernels.gluon.decode")
    splits = functools.partial(gluon.num_splits_for, min_split_tokens=tuned.min_split_tokens,
                               max_splits=tuned.max_auto_splits)
    assert splits(8, 1024, 132, 64) == 16
    assert splits(8, 512, 132, 128) == 4
    assert splits(64, 32768, 132, 64) == 2
    assert splits(512, 4096, 132, 64) == 1


def test_configs_fit_the_work_per_program():
    table = decode.DecodeConfig(128, 4, 3)
    fit = functools.partial(decode.fit_config, sms=132, head_dim=128)
    # B=1, 1k: 16 splits of 64 keys run 64-key tiles.
    assert fit(table, tokens_per_program=64, grid=128, page_size=0).block_n == 64
    # B=1, 4k: 16 splits of 256 keys too; B=8, 4k (4 splits of 1024) keeps 128-key tiles.
    assert fit(table, tokens_per_program=256, grid=128, page_size=0).block_n == 64
    assert fit(table, tokens_per_program=1024, grid=128, page_size=0) == table
    # B=8, 32k: long splits keep the table's tiles.
    assert fit(table, tokens_per_program=16384, grid=128, page_size=0) == table
    tuned = tuning.decode_tuning(None)
    # B=64: 512 programs, more than the multi-wave tile holds at once (three per SM), at most what
    # the one-wave tile holds (four): the one-wave tile, contiguous or in small pages, 1k to 4k.
    for page_size in (0, 16):
        for tokens in (1024, 2048, 4096):
            assert fit(table, tokens_per_program=tokens, grid=512, page_size=page_size) == tuned.one_wave_config
    assert fit(table, tokens_per_program=4096, grid=4 * 132, page_size=0) == tuned.one_wave_config
    # B=96, 1k: 768 programs, more than four per SM: three programs per SM.
    assert fit(table, tokens_per_program=1024, grid=768, page_size=0) == tuned.multi_wave_config
    assert fit(table, tokens_per_program=1024, grid=4 * 132 + 1, page_size=0) == tuned.multi_wave_config
    # B=48, 1k: 384 programs (up to 396), held at once by the multi-wave tile.
    assert fit(table, tokens_per_program=1024, grid=3 * 132, page_size=0) == tuned.multi_wave_config
    # Taller row tiles (several new tokens per GQA group) hold more registers: not measured, the
    # multi-wave rule only.
    assert fit(table, tokens_per_program=1024, grid=512, page_size=0, block_m=32) == tuned.multi_wave_config
    assert fit(table, tokens_per_program=4096, grid=512, page_size=0, block_m=64) == table
    assert fit(table, tokens_per_program=4096, grid=768, page_size=0) == table
    # Large pages: the multi-wave rule only.
    assert fit(table, tokens_per_program=1024, grid=512, page_size=256) == tuned.multi_wave_config
    # ... over small pages whatever the programs' length.
    assert fit(table, tokens_per_program=4096, grid=768, page_size=16) == tuned.multi_wave_config
    assert fit(table, tokens_per_program=4096, grid=512, page_size=256) == table
    # Head dims padded to 64 keep the multi-wave rule.
    assert decode.fit_config(table, 1024, 512, 132, 0, head_dim=64) == tuned.multi_wave_config
    # Two planned waves over small pages (B=8, 32k: 4 splits) are not a multi-wave grid.
    assert fit(table, tokens_per_program=8192, grid=256, page_size=16, waves=2) == table
    assert decode.fit_config(table, 64, 128, 132, 0, head_dim=256) == table


def test_one_byte_caches_keep_a_large_grid_resident():
    tuned = tuning.decode_tuning(None)
    table = tuned.quantized_contiguous[128]
    fit = functools.partial(decode.fit_config, sms=132, head_dim=128, waves=2)
    held = tuned.quantized_resident_programs_per_sm * 132  # 396 programs of 128-key tiles at once
    most = tuned.quantized_multi_wave_resident_programs_per_sm * 132
    # B=64, 4k and 1k, scales per tensor or head: 512 programs, more than 128-key tiles hold at once.
    for page_size in (0, 16):
        for tokens in (4096, 2048, 1024):
            assert fit(table, tokens_per_program=tokens, grid=512, page_size=page_size, kv_scale=1) == \
                tuned.quantized_multi_wave_config
        assert fit(table, tokens_per_program=4096, grid=most, page_size=page_size, kv_scale=1) == \
            tuned.quantized_multi_wave_config
    # Not for grids the table's tiles hold, nor grids 64-key tiles cannot hold either (B=128, 4k).
    assert fit(table, tokens_per_program=4096, grid=held, page_size=0, kv_scale=1) == table
    for page_size in (0, 16):
        assert fit(table, tokens_per_program=4096, grid=most + 1, page_size=page_size, kv_scale=1) == table
    # Not for large pages, other head dims.
    assert fit(table, tokens_per_program=4096, grid=512, page_size=256, kv_scale=1) == table
    assert decode.fit_config(table, 4096, 512, 132, 0, head_dim=64, waves=2, kv_scale=1) == table
    # Per-token scales keep 128-key tiles in every large grid, contiguous or paged, where a bf16
    # cache takes the 32-key multi-wave tile.
    for page_size in (0, 16):
        for tokens, grid in ((4096, 512), (1024, 512), (4096, 1024)):
            assert fit(table, tokens_per_program=tokens, grid=grid, page_size=page_size, kv_scale=2) == table
    assert fit(table, tokens_per_program=1024, grid=512, page_size=16) == tuned.one_wave_config
    # Short splits get short tiles, but with per-token scales (whole_tiles).
    assert fit(table, tokens_per_program=256, grid=128, page_size=0, kv_scale=1).block_n == tuned.short_block_n
    assert fit(table, tokens_per_program=128, grid=264, page_size=0, kv_scale=2) == table
    assert fit(table, tokens_per_program=256, grid=128, page_size=16, kv_scale=2) == table
    assert decode.fit_config(table, 256, 128, 132, 0, head_dim=64, kv_scale=2).block_n == tuned.short_block_n
    # A bf16 cache's grid of the same size takes its own rule (the one-wave tile).
    assert fit(table, tokens_per_program=4096, grid=512, page_size=0) == tuned.one_wave_config


@pytest.mark.parametrize("kv_scale, page_size", [(0, 0), (1, 0), (1, 16), (2, 0), (2, 16)])
def test_planned_decode_takes_the_resident_tiles_for_batch_64(monkeypatch, kv_scale, page_size):
    """What ``plan_decode`` (used by decode_forward and the length families) gives batch 64 x 4k
    on a 132-SM GPU: 64-key tiles over a 1-byte cache with scales per tensor or head only;
    128-key tiles with per-token scales; over bf16 the one-wave tile (pages of 16 too)."""
    monkeypatch.setattr(decode, "sm_count", lambda device, interpreted: 132)
    tuned = tuning.decode_tuning(None)
    q = torch.empty(64, 1, 32, 128, dtype=torch.bfloat16)
    geometry = decode.CacheGeometry(page_size, 4096, 64 if page_size == 0 else 64 * 4096 // page_size)
    launch = decode.plan_decode(q, 8, geometry, Variant.of(True, (-1, -1), 0.0, None, None), 0, None, tuned,
                                kv_scale, False)
    assert launch.num_splits == 1
    if kv_scale == 1:
        assert launch.config == tuned.quantized_multi_wave_config
    elif kv_scale == 2:
        table = tuned.quantized_small_pages if page_size else tuned.quantized_contiguous
        assert launch.config == table[128]
    else:
        assert launch.config == tuned.one_wave_config


@pytest.mark.parametrize("kv_scale, page_size, context, splits, block_n", [
    (2, 0, 4096, 32, 128), (2, 16, 4096, 16, 128), (2, 16, 1024, 8, 128), (2, 0, 1024, 8, 128),
    (1, 0, 4096, 33, 64), (1, 16, 1024, 16, 64), (0, 0, 4096, 16, 64)])
def test_per_token_scales_split_into_whole_tiles(monkeypatch, kv_scale, page_size, context, splits, block_n):
    """Batch 1 over 8 KV heads on a 132-SM GPU: with per-token scales each split reads at least
    one whole 128-key tile (``decode.whole_tiles``); scales per tensor and bf16 caches keep short
    splits of 64-key tiles."""
    monkeypatch.setattr(decode, "sm_count", lambda device, interpreted: 132)
    tuned = tuning.decode_tuning(None)
    q = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16)
    geometry = decode.CacheGeometry(page_size, context, 1 if page_size == 0 else context // page_size)
    launch = decode.plan_decode(q, 8, geometry, Variant.of(True, (-1, -1), 0.0, None, None), 0, None, tuned,
                                kv_scale, False)
    assert (launch.num_splits, launch.config.block_n) == (splits, block_n)


def _paged_copy(cache: torch.Tensor, page_size: int):
    """``cache [B, S, Hkv, D]`` as pages of ``page_size`` in a shuffled pool with spare pages of
    noise, and its block table."""
    batch, capacity = cache.shape[:2]
    pages = capacity // page_size
    pool = torch.randn(batch * pages + 3, page_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    table = torch.randperm(pool.shape[0], device=cache.device)[: batch * pages].view(batch, pages)
    pool[table.reshape(-1)] = cache.reshape(batch * pages, page_size, *cache.shape[2:])
    return pool, table.to(torch.int32)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("window, num_splits, seqlen_new", [((-1, -1), 1, 1), ((-1, -1), 3, 3), ((7, 0), 1, 1),
                                                            ((40, 3), 3, 1), ((5, -1), 2, 3)])
def test_pages_smaller_than_a_tile_read_what_a_contiguous_cache_holds(page_size, window, num_splits, seqlen_new):
    """Pages smaller than the key tile take each key's page column and slot apart from the
    tile's start (``decode._cache_rows``): the same keys as a contiguous cache, bit for bit,
    over windows that start tiles at window edges, splits and several new tokens."""
    config = decode.DecodeConfig(32, 4, 1)
    lengths = torch.tensor([0, 77, 200], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, seqlen_new, 4, 32, dtype=torch.float16, device=DEVICE)
    k_cache = torch.randn(3, 256, 2, 32, dtype=torch.float16, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    k_pages, table = _paged_copy(k_cache, page_size)
    v_pages = torch.empty_like(k_pages).normal_()
    v_pages[table.reshape(-1).long()] = v_cache.reshape(-1, page_size, 2, 32)
    results = []
    for k, v, block_table in ((k_cache, v_cache, None), (k_pages, v_pages, table)):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((3, 4, seqlen_new), float("nan"), device=DEVICE)
        decode.decode_forward(q, k, v, lengths, block_table, out, lse, appended=0, causal=True, softmax_scale=0.2,
                              num_splits=num_splits, config=config, window_size=window)
        results.append((out, lse))
    (out, lse), (paged_out, paged_lse) = results
    assert torch.equal(out, paged_out) and torch.equal(lse, paged_lse)


def _step_with_append(fused, q, k_cache, v_cache, k, v, seqlens, block_table, k_scale, v_scale, causal=True,
                      **kwargs):
    """One decode step on copies of the cache (and scales): the append fused into the decode
    kernel, or the append kernel first. Returns output, LSE, caches and scales as raw bits."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_scale, v_scale = (None if s is None else s.clone() for s in (k_scale, v_scale))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=DEVICE)
    new = dict(k_new=k, v_new=v) if fused else {}
    if not fused:
        decode.append_kv(k, v, k_cache, v_cache, seqlens, block_table, k_scale, v_scale)
    decode.decode_forward(q, k_cache, v_cache, seqlens, block_table, out, lse, appended=q.shape[1],
                          k_scale=k_scale, v_scale=v_scale, causal=causal, softmax_scale=0.25, **new, **kwargs)
    bits = (out, lse, k_cache, v_cache, k_scale, v_scale)
    return [None if x is None else x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int16)
            if x.element_size() == 2 else x.view(torch.int32) for x in bits]


@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("cache_dtype, granularity", [(torch.float16, None), (torch.float8_e4m3fn, "tensor"),
                                                      (torch.int8, "token")])
@pytest.mark.parametrize("seqlen_new, causal, window, num_splits, leftpad", [
    (1, True, (-1, -1), 0, False), (3, True, (5, 0), 3, True), (17, True, (-1, -1), 2, True),
    (17, True, (6, 0), 1, False), (17, False, (3, 2), 2, True)])
def test_the_fused_append_writes_and_reads_what_the_append_kernel_does(page_size, cache_dtype, granularity,
                                                                       seqlen_new, causal, window, num_splits,
                                                                       leftpad):
    """``decode_forward(k_new=, v_new=)`` appends inside the decode kernel (each program writes the
    new tokens of the tiles it reads): output, LSE, the whole cache and the scales bit-identical to
    the append kernel followed by the decode kernel, over pages smaller and larger than a token,
    quantized formats and granularities, causal and two-sided windows, splits, several row tiles
    (17 tokens x a group of 8) and key starts, one of them past the first new token (a token no
    program reads)."""
    batch, kv_heads, group, head_dim = 2, 2, 8 if seqlen_new == 17 else 2, 16
    lengths = [11, 30]
    k_cache, v_cache, block_table = make_cache(lengths, seqlen_new, kv_heads, head_dim, torch.float16, page_size)
    k_scale = v_scale = None
    if granularity is not None:
        k_cache, v_cache = ((x * 8).clamp(-100, 100).to(cache_dtype) for x in (k_cache, v_cache))
        if granularity == "tensor":
            k_scale, v_scale = (torch.rand(1, device=DEVICE) * 0.1 + 0.01 for _ in range(2))
        else:
            k_scale, v_scale = (torch.rand(k_cache.shape[:3], device=DEVICE) * 0.1 + 0.01 for _ in range(2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, seqlen_new, kv_heads * group, head_dim, dtype=torch.float16, device=DEVICE)
    k = torch.randn(batch, seqlen_new, kv_heads, head_dim, dtype=torch.float16, device=DEVICE) * 3
    v = torch.randn_like(k)
    kwargs = dict(causal=causal, window_size=window, num_splits=num_splits, config=decode.DecodeConfig(32, 4, 1))
    if leftpad:
        kwargs["cache_leftpad"] = torch.tensor([3, lengths[1] + 1], dtype=torch.int32, device=DEVICE)
    fused = _step_with_append(True, q, k_cache, v_cache, k, v, seqlens, block_table, k_scale, v_scale, **kwargs)
    separate = _step_with_append(False, q, k_cache, v_cache, k, v, seqlens, block_table, k_scale, v_scale, **kwargs)
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache", "k_scale", "v_scale"), fused, separate):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_the_fused_append_never_reads_a_slot_another_program_has_yet_to_write():
    """Two row tiles (a group of 8 x 17 new tokens) under a window: the first tile's last key
    tile holds new tokens of the second tile's rows, masked for its own rows but still loaded.
    The program writes them too before reading, so the cache's stale contents there (NaN here)
    never reach the output."""
    lengths = [10]
    k_cache = torch.randn(1, 64, 1, 16, dtype=torch.float16, device=DEVICE)
    k_cache[0, lengths[0]:] = float("nan")
    v_cache = k_cache.clone()
    q = torch.randn(1, 17, 8, 16, dtype=torch.float16, device=DEVICE)
    k = torch.randn(1, 17, 1, 16, dtype=torch.float16, device=DEVICE)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kwargs = dict(window_size=(5, 0), config=decode.DecodeConfig(32, 4, 1))
    fused = _step_with_append(True, q, k_cache, v_cache, k, torch.randn_like(k), seqlens, None, None, None, **kwargs)
    out = fused[0].view(torch.float16)
    assert not torch.isnan(out).any()


def test_decode_forward_refuses_new_tokens_it_is_told_are_already_appended():
    q = torch.randn(1, 2, 2, 16, dtype=torch.float16, device=DEVICE)
    k_cache = torch.randn(1, 8, 1, 16, dtype=torch.float16, device=DEVICE)
    k = torch.randn(1, 2, 1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="pass appended=2, not 0"):
        decode.decode_forward(q, k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int32, device=DEVICE), None,
                              torch.empty_like(q), None, appended=0, causal=True, softmax_scale=0.25, k_new=k,
                              v_new=k.clone())


# ---- baseline ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [None, 1, 64])
def test_baseline_matches_reference(page_size):
    lengths, seqlen_new = (0, 17, 90), 3
    k_cache, v_cache, block_table = make_cache(lengths, seqlen_new, 2, 64, torch.float16, page_size)
    q = torch.randn(3, seqlen_new, 8, 64, dtype=torch.float16, device=DEVICE)
    k = torch.randn(3, seqlen_new, 2, 64, dtype=torch.float16, device=DEVICE)
    v = torch.randn_like(k)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    expected_k = reference.append_to_cache(k_cache, k, seqlens, block_table)
    expected_v = reference.append_to_cache(v_cache, v, seqlens, block_table)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((3, 8, seqlen_new), float("nan"), device=DEVICE)
    decode.baseline_decode(q, k_cache, v_cache, seqlens, block_table, out, lse, k_new=k, v_new=v,
                           causal=True, softmax_scale=64 ** -0.5)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    check_sequences(out, lse, q, expected_k, expected_v, [n + seqlen_new for n in lengths], block_table, True)


# ---- the reference itself ----------------------------------------------------------------------


def test_reference_with_kvcache_is_dense_attention_over_the_gathered_prefix():
    """attention_with_kvcache == attention over keys gathered token by token from the pages."""
    k_cache, v_cache, block_table = make_cache((0, 5, 21), 3, 1, 16, torch.float64, 4)
    q = torch.randn(3, 3, 2, 16, dtype=torch.float64, device=DEVICE)
    k = torch.randn(3, 3, 1, 16, dtype=torch.float64, device=DEVICE)
    v = torch.randn_like(k)
    seqlens = [0, 5, 21]
    out, lse = reference.attention_with_kvcache(q, k_cache, v_cache, seqlens, k=k, v=v, block_table=block_table)
    for b, n in enumerate(seqlens):
        old = [k_cache[int(block_table[b, j // 4]), j % 4] for j in range(n)]
        keys = torch.stack(old + [k[b, t] for t in range(3)])[None]
        old = [v_cache[int(block_table[b, j // 4]), j % 4] for j in range(n)]
        values = torch.stack(old + [v[b, t] for t in range(3)])[None]
        expected, expected_lse = reference.attention(q[b:b + 1], keys, values, causal=True)
        torch.testing.assert_close(out[b:b + 1], expected)
        torch.testing.assert_close(lse[b:b + 1], expected_lse)


# ---- combine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("parts, head_dim, sliced, with_lse",
                         [(4, 40, False, True), (70, 256, False, True), (33, 40, True, True), (300, 128, True, True),
                          (33, 72, True, True), (33, 96, True, False)],
                         ids=["one-chunk", "three-chunks", "two-column-slices", "four-slices-two-chunks",
                              "slices-of-an-odd-head-dim", "three-slices-no-lse"])
def test_combine_merges_exactly_and_skips_empty_parts(monkeypatch, parts, head_dim, sliced, with_lse):
    batch, seqlen, heads = 2, 3, 5
    # Slicing the columns over several programs is the rule's choice for few rows and many
    # parts; force it on or off here.
    monkeypatch.setattr(combine_module, "SLICE_MIN_PARTS", 1 if sliced else 1 << 30)
    out_parts = torch.randn(parts, batch, seqlen, heads, head_dim, device=DEVICE)
    lse_parts = torch.randn(parts, batch, heads, seqlen, device=DEVICE) * 3
    lse_parts[1] = float("-inf")  # an empty part everywhere
    lse_parts[:, 0, 2, 1] = float("-inf")  # a row with no key at all
    out_parts[1] = float("nan")  # never read
    out_parts[:, 0, 1, 2] = float("nan")
    out = torch.full((batch, seqlen, heads, head_dim), float("nan"), dtype=torch.float16, device=DEVICE)
    lse = torch.full((batch, heads, seqlen), float("nan"), device=DEVICE)
    combine_module.combine(out_parts, lse_parts, out, lse if with_lse else None)

    lse64 = lse_parts.double()
    truth_lse = torch.logsumexp(lse64, dim=0)  # [B, H, T]
    weights = torch.exp(lse64 - truth_lse).nan_to_num(0.0).permute(0, 1, 3, 2)  # [P, B, T, H]
    truth = (weights[..., None] * out_parts.double().nan_to_num(0.0)).sum(0)
    if with_lse:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(truth_lse))
        finite = torch.isfinite(truth_lse)
        assert (lse.double() - truth_lse)[finite].abs().max() < 1e-5
    else:
        assert lse.isnan().all()  # not written
    assert torch.equal(out[0, 1, 2], torch.zeros_like(out[0, 1, 2]))
    torch.testing.assert_close(out.double(), truth, atol=2e-3, rtol=2e-3)


def test_combine_column_slices_for_few_rows_of_many_parts():
    slices = combine_module.column_slices
    assert slices(num_rows=32, num_parts=33, block_d=128) == 4  # batch 1, 32 query heads
    assert slices(num_rows=16, num_parts=33, block_d=256) == 8
    assert slices(num_rows=256, num_parts=33, block_d=128) == 2  # batch 8
    assert slices(num_rows=512, num_parts=33, block_d=128) == 1
    assert slices(num_rows=32, num_parts=33, block_d=16) == 1  # slices of 32 columns at least
    assert slices(num_rows=32, num_parts=7, block_d=128) == 1


def test_combine_single_part_is_identity():
    out_parts = torch.randn(1, 2, 1, 3, 64, device=DEVICE)
    lse_parts = torch.randn(1, 2, 3, 1, device=DEVICE)
    out = torch.empty(2, 1, 3, 64, device=DEVICE)
    lse = torch.empty(2, 3, 1, device=DEVICE)
    combine_module.combine(out_parts, lse_parts, out, lse)
    torch.testing.assert_close(out, out_parts[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_parts[0], atol=1e-6, rtol=1e-6)


# ---- KVCache ----------------------------------------------------------------------------------


def test_kvcache_bookkeeping():
    cache = flashkernel.KVCache(num_blocks=10, page_size=4, num_kv_heads=2, head_dim=8, batch=3,
                                max_blocks_per_seq=4, dtype=torch.float16, device=DEVICE)
    k = torch.randn(6, 2, 8, dtype=torch.float16, device=DEVICE)
    v = torch.randn_like(k)
    cache.append(1, k, v)
    assert cache.length(1) == 6 and cache.pages(1) == [0, 1] and cache.free_pages() == 8
    assert cache.cache_seqlens.tolist() == [0, 6, 0]
    assert cache.block_table[1, :2].tolist() == [0, 1]
    gk, gv = cache.gather(1)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    cache.reserve(3)  # every sequence: one page for 0 and 2, seq 1 needs a third for 9 tokens
    assert [len(cache.pages(s)) for s in range(3)] == [1, 3, 1] and cache.free_pages() == 5
    cache.advance(3)
    assert cache.cache_seqlens.tolist() == [3, 9, 3]
    assert repr(cache) == (f"KVCache(num_blocks=10, page_size=4, num_kv_heads=2, head_dim=8, batch=3, "
                           f"max_blocks_per_seq=4, dtype=torch.float16, device={cache.k_pages.device}; "
                           "lengths [3, 9, 3], 5 of 10 pages free)")
    cache.free(1)
    assert cache.free_pages() == 8 and cache.length(1) == 0 and cache.cache_seqlens[1] == 0
    assert cache.block_table[1].tolist() == [-1] * 4, "a freed row must name no page"
    with pytest.raises(ValueError, match="sequence 2 would need 5 pages for 20 tokens; block_table has 4 columns"):
        cache.reserve(17, 2)
    with pytest.raises(ValueError, match="sequence 0 has no room reserved for 2 more tokens"):
        cache.advance(2, 0)


def test_kvcache_advance_changes_nothing_when_it_fails():
    """A failed advance leaves host and device lengths as they were (and in step)."""
    cache = flashkernel.KVCache(num_blocks=4, page_size=4, num_kv_heads=1, head_dim=8, batch=2,
                                max_blocks_per_seq=2, dtype=torch.float16, device=DEVICE)
    cache.reserve(1, 0)  # room in sequence 0 only
    with pytest.raises(ValueError, match="sequence 1 has no room reserved for 1 more tokens"):
        cache.advance(1)
    assert [cache.length(s) for s in range(2)] == [0, 0] and cache.cache_seqlens.tolist() == [0, 0]
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        cache.advance(-1)


def test_kvcache_pool_exhausted():
    cache = flashkernel.KVCache(num_blocks=2, page_size=4, num_kv_heads=1, head_dim=8, batch=2,
                                max_blocks_per_seq=4, dtype=torch.float16, device=DEVICE)
    cache.reserve(8, 0)
    with pytest.raises(RuntimeError, match="page pool exhausted: sequence 1 needs 1 pages, 0 free"):
        cache.reserve(1, 1)


def small_cache(**overrides) -> flashkernel.KVCache:
    args = dict(num_blocks=6, page_size=4, num_kv_heads=2, head_dim=8, batch=3, max_blocks_per_seq=2,
                dtype=torch.float16, device=DEVICE)
    return flashkernel.KVCache(**{**args, **overrides})


def test_kvcache_unused_block_table_entries_name_no_page():
    """-1, never a valid page (0 was page 0 of some other sequence), before and after reserve."""
    cache = small_cache()
    assert cache.block_table.tolist() == [[-1, -1]] * 3
    cache.reserve(5, 1)
    assert cache.block_table.tolist() == [[-1, -1], [0, 1], [-1, -1]]


@pytest.mark.parametrize("validate", [True, False])
def test_append_without_reserve_never_writes_another_sequences_page(validate):
    """Sequence 0's page is full and it appends without reserve: the call refuses (validate) or
    skips its token (no validation); either way no other sequence's tokens change, and
    advance then refuses the token that has no room."""
    cache = small_cache()
    dtype, heads = torch.float16, 2
    cache.append(1, torch.randn(3, heads, 8, dtype=dtype, device=DEVICE), torch.randn(3, heads, 8, dtype=dtype, device=DEVICE))
    cache.append(0, torch.randn(4, heads, 8, dtype=dtype, device=DEVICE), torch.randn(4, heads, 8, dtype=dtype, device=DEVICE))
    assert cache.pages(1) == [0] and cache.pages(0) == [1]  # sequence 1 owns page 0
    cache.reserve(1, 1)  # room for sequence 1 only
    before = [cache.gather(seq) for seq in range(2)]
    k_pages, v_pages = cache.k_pages.clone(), cache.v_pages.clone()
    q = torch.randn(2, 1, 4, 8, dtype=dtype, device=DEVICE)
    k = torch.randn(2, 1, heads, 8, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    call = lambda: flashkernel.flash_attn_with_kvcache(  # noqa: E731
        q, cache.k_pages, cache.v_pages, k=k, v=v, cache_seqlens=cache.cache_seqlens[:2],
        block_table=cache.block_table[:2], validate=validate)
    if validate:
        with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 points outside the page pool .* appended: give "
                                             "the new tokens their pages first, as KVCache.reserve does"):
            call()
        assert torch.equal(cache.k_pages, k_pages) and torch.equal(cache.v_pages, v_pages)
        return
    call()
    expected_k, expected_v = k_pages.clone(), v_pages.clone()
    expected_k[0, 3], expected_v[0, 3] = k[1, 0], v[1, 0]  # sequence 1's token 3: page 0, slot 3
    assert torch.equal(cache.k_pages, expected_k) and torch.equal(cache.v_pages, expected_v)
    assert all(torch.equal(a, b) for a, b in zip(cache.gather(0), before[0]))
    with pytest.raises(ValueError, match="sequence 0 has no room reserved for 1 more tokens"):
        cache.advance(1, [0, 1])
    cache.advance(1, 1)
    assert torch.equal(cache.gather(1)[0][-1], k[1, 0])


@pytest.mark.parametrize("k_shape, v_shape, dtype, match", [
    ((5, 3, 8), (5, 3, 8), torch.float16, r"k has shape \(5, 3, 8\); .* \[n, 2, 8\]"),
    ((5, 2, 16), (5, 2, 16), torch.float16, r"k has shape \(5, 2, 16\)"),
    ((5, 16), (5, 16), torch.float16, r"k has shape \(5, 16\)"),
    ((5, 2, 8), (5, 1, 8), torch.float16, r"v has shape \(5, 1, 8\)"),
    ((5, 2, 8), (4, 2, 8), torch.float16, "k has 5 tokens and v has 4"),
    ((5, 2, 8), (5, 2, 8), torch.float32, "k has dtype torch.float32 but the cache takes torch.float16"),
], ids=["heads", "head_dim", "rank", "v-heads", "token-count", "dtype"])
def test_kvcache_append_rejects_bad_tokens_before_reserving(k_shape, v_shape, dtype, match):
    cache = small_cache()
    cache.append(0, torch.randn(2, 2, 8, dtype=torch.float16, device=DEVICE),
                 torch.randn(2, 2, 8, dtype=torch.float16, device=DEVICE))
    table, free = cache.block_table.clone(), cache.free_pages()
    k = torch.randn(k_shape, device=DEVICE).to(dtype)
    v = torch.randn(v_shape, device=DEVICE).to(dtype)
    with pytest.raises((ValueError, TypeError), match=match):
        cache.append(1, k, v)
    assert cache.free_pages() == free and torch.equal(cache.block_table, table), "pages leaked"
    assert [cache.length(s) for s in range(3)] == [2, 0, 0] and cache.cache_seqlens.tolist() == [2, 0, 0]


@pytest.mark.parametrize("seq", [3, -1, 1.0, True])
def test_kvcache_rejects_bad_sequence_slots(seq):
    cache = small_cache()
    k = torch.randn(1, 2, 8, dtype=torch.float16, device=DEVICE)
    for call in (lambda: cache.append(seq, k, k), lambda: cache.reserve(1, seq), lambda: cache.free(seq)):
        with pytest.raises(ValueError, match=r"seq must be a sequence slot from 0 to 2, got"):
            call()
    assert cache.free_pages() == 6


@pytest.mark.parametrize("overrides, match", [
    ({"page_size": 12}, "page_size must be a power of two from 1 to 256 .*got 12"),
    ({"page_size": 512}, "page_size must be a power of two from 1 to 256 .*got 512"),
    ({"page_size": 0}, "page_size must be a positive int, got 0"),
    ({"num_blocks": 0}, "num_blocks must be a positive int, got 0"),
    ({"batch": 2.0}, "batch must be a positive int, got 2.0"),
    ({"dtype": torch.int8}, "dtype must be one of .*got torch.int8"),
    ({"head_dim": 20}, "the cache has head_dim 20; supported head dims are multiples of 8"),
])
def test_kvcache_constructor_names_the_bad_argument(overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        small_cache(**overrides)


def test_kvcache_device_defaults_to_cuda_if_available_else_cpu():
    cache = small_cache(device=None)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    for t in (cache.k_pages, cache.v_pages, cache.block_table, cache.cache_seqlens):
        assert t.device.type == expected


def test_kvcache_reserve_allocates_nothing_when_one_sequence_does_not_fit():
    cache = small_cache(num_blocks=3)
    cache.reserve(4, 0)
    with pytest.raises(RuntimeError, match=r"page pool exhausted: sequence 2 needs 2 pages, 0 free \(after 2 for the sequences before it\)"):
        cache.reserve(8, [1, 2])  # sequence 1 would take 2 of the 2 free pages, sequence 2 needs 2 more
    assert cache.free_pages() == 2 and cache.pages(1) == [] and cache.block_table[1].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -2"):
        cache.reserve(-2)


def test_kvcache_counts_must_be_ints_and_slots_distinct_and_a_refusal_changes_nothing():
    """``reserve``/``advance`` take an int count and distinct slots; a refused call leaves host
    and device lengths and pages as they were."""
    cache = small_cache()
    cache.reserve(8, 0)
    for call, exc, match in ((lambda: cache.advance(2.5), TypeError, r"num_tokens must be an int, got 2.5 \(float\)"),
                             (lambda: cache.reserve(1.5), TypeError, "num_tokens must be an int, got 1.5"),
                             (lambda: cache.advance(True), TypeError, "num_tokens must be an int, got True"),
                             (lambda: cache.advance(5, seqs=[0, 0]), ValueError,
                              r"seqs lists sequence\(s\) \[0\] more than once"),
                             (lambda: cache.reserve(1, seqs=(1, 2, 1)), ValueError, r"sequence\(s\) \[1\]")):
        with pytest.raises(exc, match=match):
            call()
        assert [cache.length(b) for b in range(3)] == [0, 0, 0] and cache.cache_seqlens.tolist() == [0, 0, 0]
        assert cache.pages(0) == [0, 1] and cache.pages(1) == cache.pages(2) == [] and cache.free_pages() == 4
    cache.advance(5, seqs=[0])
    assert cache.length(0) == 5 and cache.cache_seqlens.tolist() == [5, 0, 0]


def test_decode_steps_through_kvcache():
    """Prefill ragged prompts into a shuffled pool, then three decode steps with append."""
    heads, head_dim, dtype = (8, 2), 64, torch.float16
    cache = flashkernel.KVCache(num_blocks=40, page_size=16, num_kv_heads=2, head_dim=head_dim, batch=3,
                                max_blocks_per_seq=8, dtype=dtype, device=DEVICE, shuffle_pages=True)
    for seq, prompt in enumerate((0, 30, 77)):
        if prompt:
            cache.append(seq, torch.randn(prompt, 2, head_dim, dtype=dtype, device=DEVICE),
                         torch.randn(prompt, 2, head_dim, dtype=dtype, device=DEVICE))
    for _ in range(3):
        cache.reserve(1)
        q = torch.randn(3, 1, heads[0], head_dim, dtype=dtype, device=DEVICE)
        k = torch.randn(3, 1, 2, head_dim, dtype=dtype, device=DEVICE)
        v = torch.randn_like(k)
        out, lse = flashkernel.flash_attn_with_kvcache(
            q, cache.k_pages, cache.v_pages, k=k, v=v, cache_seqlens=cache.cache_seqlens,
            block_table=cache.block_table, return_lse=True)
        cache.advance(1)
        for seq in range(3):
            keys, values = cache.gather(seq)
            assert torch.equal(keys[-1], k[seq, 0]) and torch.equal(values[-1], v[seq, 0])
            assert_output_close(out[seq:seq + 1], q[seq:seq + 1], keys[None], values[None],
                                causal=True, lse=lse[seq:seq + 1])


# ---- GPU only ---------------------------------------------------------------------------------


GPU_LENGTHS = (0, 1, 17, 300, 4097)


@pytest.fixture(params=["triton", "gluon"])
def decode_backend(request, monkeypatch):
    """Decode through one kernel: the Triton one, or the Gluon one (``kernels/gluon/decode.py``)
    wherever it supports the call, the rest falling back to Triton. Returns the list of calls
    that took the Gluon kernel."""
    gluon = request.param == "gluon"
    if gluon and dispatch._gluon_decode_module() is None:
        pytest.skip("Gluon is not importable with this Triton")
    calls = []

    def choose(backend, q, k_cache, v_cache, block_table, variant, num_splits, tuned, cache_leftpad=None,
               k_scale=None, appending=False):
        if gluon and dispatch.decode_refusal("gluon", q, k_cache, v_cache, block_table, variant,
                                             cache_leftpad, k_scale) is None:
            calls.append(q.shape)
            return "gluon"
        return "triton"

    monkeypatch.setattr(dispatch, "decode_backend", choose)
    interface._EAGER_CALLS.clear()
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("heads", [(4, 4), (32, 8), (32, 4), (32, 1)], ids=["mha", "gqa4", "gqa8", "mqa32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_full_grid_gpu(head_dim, heads, page_size, dtype, decode_backend):
    run_and_check(GPU_LENGTHS, 4, heads, head_dim, dtype, page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_new", range(1, 9))
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_new_tokens_and_splits_gpu(num_splits, seqlen_new, decode_backend):
    run_and_check(GPU_LENGTHS, seqlen_new, (32, 8), 128, torch.bfloat16, 16, num_splits=num_splits)
    run_and_check(GPU_LENGTHS, seqlen_new, (32, 8), 128, torch.bfloat16, None, num_splits=num_splits,
                  causal=seqlen_new % 2 == 0, append=seqlen_new % 3 != 0)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_long_contexts_gpu(page_size, decode_backend):
    run_and_check((4097, 70001, 131072), 1, (32, 8), 128, torch.bfloat16, page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [None, 16])
def test_batch_64_gpu(page_size, dtype):
    """Batch 64 x 8 KV heads of 128: 512 programs, which a 132-SM GPU (the H200) runs in one wave
    of ``one_wave_config`` tiles (fit_config; the plan is checked on the CPU by
    ``test_planned_decode_takes_the_resident_tiles_for_batch_64``); ragged lengths from 0 to 2k."""
    lengths = [0, 1, 2047] + torch.randint(0, 2048, (61,)).tolist()
    run_and_check(lengths, 1, (32, 8), 128, dtype, page_size)
    run_and_check(lengths, 2, (32, 8), 128, dtype, page_size, append=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 256])
def test_cache_over_2_31_elements_gpu(page_size, decode_backend):
    """Offsets past 2**31 elements: sequence 1's tokens (contiguous) or pages (paged) lie there."""
    heads, head_dim, dtype, seqlen_new = 8, 128, torch.bfloat16, 2
    per_token = heads * head_dim
    tokens = 2**31 // per_token + 4096  # more than 2**31 elements
    lengths = (1000, 3000)
    if page_size is None:  # sequence 1 starts past element 2**31
        k_cache = torch.empty(2, tokens, heads, head_dim, dtype=dtype, device="cuda")
        block_table = None
    else:
        k_cache = torch.empty(tokens // page_size, page_size, heads, head_dim, dtype=dtype, device="cuda")
        last = k_cache.shape[0]
        block_table = torch.arange(last - 32, last, dtype=torch.int32, device="cuda").flip(0).view(2, 16)
    v_cache = torch.empty_like(k_cache)
    assert k_cache.numel() > 2**31
    for cache in (k_cache, v_cache):  # random where read, a sentinel elsewhere (cheap to fill)
        cache.fill_(7.0)
        for b, length in enumerate(lengths):
            n = length + seqlen_new
            if block_table is None:
                cache[b, :n] = torch.randn(n, heads, head_dim, dtype=dtype, device="cuda")
            else:
                cache[block_table[b].long()] = torch.randn(16, page_size, heads, head_dim, dtype=dtype, device="cuda")
    q = torch.randn(2, seqlen_new, 32, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(2, seqlen_new, heads, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                                   block_table=block_table, return_lse=True)
    for b, length in enumerate(lengths):
        keys = reference.cache_prefix(k_cache, b, length + seqlen_new, block_table)
        values = reference.cache_prefix(v_cache, b, length + seqlen_new, block_table)
        assert torch.equal(keys[length:], k[b]) and torch.equal(values[length:], v[b])
        assert_output_close(out[b:b + 1], q[b:b + 1], keys[None], values[None], causal=True, lse=lse[b:b + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("eager_merges_in_kernel", [True, False])
@pytest.mark.parametrize("page_size", [None, 16])
def test_cuda_graph_replay_equals_eager_gpu(page_size, decode_backend, eager_merges_in_kernel, monkeypatch):
    """Capture one decode step (append + attend), replay it with new inputs: the caches bitwise
    eager's; the outputs bitwise too where the eager step merges its splits in a combine launch
    as the captured one does, else up to the float32 rounding of the merge (an eager step of few
    splits merges them in the decode kernel: ``decode.merges_in_kernel``)."""
    if not eager_merges_in_kernel:
        _merge_in_kernel_at_most(monkeypatch, 0)
    lengths, heads, head_dim, dtype = (100, 3000, 0, 1234), (32, 8), 128, torch.bfloat16
    k_cache, v_cache, block_table = make_cache(lengths, 4, heads[1], head_dim, dtype, page_size)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(4, 1, heads[0], head_dim, dtype=dtype, device="cuda")
    k = torch.randn(4, 1, heads[1], head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)

    def step(kc, vc):
        return flashkernel.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                                   block_table=block_table, return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(k_cache, v_cache)  # warm-up: compiles, caches the workspace (the append is idempotent)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step(k_cache, v_cache)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        out_e, lse_e = step(eager_k, eager_v)
        graph.replay()
        torch.cuda.synchronize()
        if eager_merges_in_kernel:
            torch.testing.assert_close(out_g, out_e, rtol=0, atol=4e-3)
            torch.testing.assert_close(lse_g, lse_e, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e)
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
        seqlens.add_(1)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_many_splits_are_deterministic_gpu(page_size):
    """64 splits per row tile, finishing in whatever order the GPU runs them, merged in split
    order: 300 calls (replays reusing one workspace) all bitwise equal the first, which matches
    the reference."""
    lengths = (30000, 1, 4097)
    k_cache, v_cache, block_table = make_cache(lengths, 1, 8, 128, torch.bfloat16, page_size)
    q = torch.randn(3, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    call = lambda: flashkernel.flash_attn_with_kvcache(  # noqa: E731
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table, num_splits=64, return_lse=True)
    first, first_lse = call()
    check_sequences(first, first_lse, q, k_cache, v_cache, lengths, block_table, causal=True)
    results = [call() for _ in range(300)]
    assert all(torch.equal(out, first) and torch.equal(lse, first_lse) for out, lse in results)


@pytest.mark.gpu
def test_decode_step_does_not_sync_gpu(decode_backend):
    k_cache, v_cache, block_table = make_cache((500, 20), 1, 8, 128, torch.bfloat16, 16)
    q = torch.randn(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    seqlens = torch.tensor([500, 20], dtype=torch.int32, device="cuda")
    call = lambda: flashkernel.flash_attn_with_kvcache(  # noqa: E731
        q, k_cache, v_cache, k=k, v=k, cache_seqlens=seqlens, block_table=block_table)
    call()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 16, 64, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cache_past_lengths_holds_nan_gpu(head_dim, page_size, decode_backend):
    """Slots past each sequence's length (and unused pages) hold NaN and Inf, as a cache from
    torch.empty may: they must not reach the output (0 * NaN is NaN in P V)."""
    lengths, seqlen_new = (0, 1, 63, 64, 65, 200), 1
    k_cache, v_cache, block_table = make_cache(lengths, seqlen_new, 2, head_dim, torch.bfloat16, page_size)
    for cache in (k_cache, v_cache):
        poison = torch.full_like(cache, float("nan"))
        poison[..., ::3] = float("inf")
        for b, length in enumerate(lengths):
            valid = reference.cache_prefix(cache, b, length, block_table).clone()
            if block_table is None:
                poison[b, :length] = valid
            else:
                for j in range(0, length, page_size):
                    n = min(page_size, length - j)
                    poison[block_table[b, j // page_size].long(), :n] = valid[j:j + n]
        cache.copy_(poison)
    for causal in (True, False):
        run_and_check_existing(k_cache, v_cache, block_table, lengths, seqlen_new, (8, 2), causal)
    assert decode_backend == [] or len(decode_backend) == 2


def run_and_check_existing(k_cache, v_cache, block_table, lengths, seqlen_new, heads, causal):
    """One call without appending over a given cache, each sequence against the reference."""
    q = torch.randn(len(lengths), seqlen_new, heads[0], k_cache.shape[-1], dtype=k_cache.dtype, device=DEVICE)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out, lse = flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                   block_table=block_table, causal=causal, return_lse=True,
                                                   num_splits=3)
    check_sequences(out, lse, q, k_cache, v_cache, lengths, block_table, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("page_size", [None, 16])
def test_gluon_programs_run_many_items_gpu(programs, page_size, decode_backend, monkeypatch):
    """A small persistent grid: every program streams many (sequence, head, split) items through
    one ring, the next item's tiles loading under the current one's."""
    gluon = dispatch._gluon_decode_module()
    if gluon is not None:
        config_for = gluon.config_for
        monkeypatch.setattr(gluon, "config_for",
                            lambda *a: dataclasses.replace(config_for(*a), max_programs=programs))
    for num_splits in (1, 4):
        run_and_check((0, 1, 17, 300, 4097, 64, 65), 2, (16, 4), 128, torch.bfloat16, page_size,
                      num_splits=num_splits)
    assert decode_backend == [] or len(decode_backend) == 2


@pytest.mark.gpu
def test_gluon_backend_refuses_what_it_cannot_run_gpu():
    q = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.empty(1, 16, 1, 128, dtype=torch.bfloat16, device="cuda")
    if dispatch.decode_refusal("gluon", q, cache, cache, None, Variant.of(True)) is not None:
        pytest.skip("no Gluon decode kernel on this GPU")
    k_cache, v_cache, block_table = make_cache((10,), 1, 1, 64, torch.float16, 1)  # pages of 1
    q = torch.randn(1, 1, 4, 64, dtype=torch.float16, device=DEVICE)
    seqlens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="backend='gluon' cannot run this call: it needs pages of at least 16"):
        flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                            backend="gluon")
    with pytest.raises(ValueError, match="backend must be one of"):
        flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                                            backend="cuda")
