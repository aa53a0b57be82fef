"""flash_attn_with_kvcache: bad input raises a clear error naming the value, before any launch."""

import pytest
import torch

import flashkernel
from flashkernel import interface
from helpers import DEVICE, ON_GPU


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("kernel launched despite bad input")

    monkeypatch.setattr(interface.dispatch, "decode", fail)


def inputs(batch=2, seqlen_q=1, heads=(4, 2), head_dim=64, page_size=16, max_blocks=4, num_blocks=10,
           dtype=torch.float16, device=DEVICE):
    """Valid paged inputs (page_size None: contiguous cache of 64 tokens per sequence)."""
    num_heads, num_kv_heads = heads
    q = torch.randn(batch, seqlen_q, num_heads, head_dim, device=device).to(dtype)
    if page_size is None:
        k_cache = torch.randn(batch, 64, num_kv_heads, head_dim, device=device).to(dtype)
        block_table = None
    else:
        k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, device=device).to(dtype)
        block_table = torch.arange(batch * max_blocks, device=device).view(batch, max_blocks) % num_blocks
        block_table = block_table.to(torch.int32)
    k = torch.randn(batch, seqlen_q, num_kv_heads, head_dim, device=device).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=torch.randn_like(k_cache), k=k, v=torch.randn_like(k),
                cache_seqlens=torch.full((batch,), 5, dtype=torch.int32, device=device),
                block_table=block_table)


def call(args, **overrides):
    args = {**args, **overrides}
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    return flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, **args)


def raises(exc, match, args, **overrides):
    with pytest.raises(exc, match=match):
        call(args, **overrides)


def test_valid_inputs_reach_the_launcher():
    with pytest.raises(AssertionError, match="kernel launched"):
        call(inputs())


def test_q_wrong_rank():
    a = inputs()
    raises(ValueError, r"q must have 4 dimensions .* got 3 with shape \(1, 4, 64\)", a, q=a["q"][0])


def test_cache_not_a_tensor():
    raises(TypeError, "v_cache must be a torch.Tensor, got list", inputs(), v_cache=[1])


def test_paged_cache_wrong_rank():
    a = inputs()
    raises(ValueError, r"k_cache must have 4 dimensions \[num_blocks, page_size, kv_heads, head_dim\], got 3",
           a, k_cache=a["k_cache"][0])


def test_k_v_cache_shapes_differ():
    a = inputs()
    raises(ValueError, r"k_cache has shape \(10, 16, 2, 64\) and v_cache has shape \(9, 16, 2, 64\)",
           a, v_cache=a["v_cache"][:9])


def test_cache_head_dim_differs():
    a = inputs()
    raises(ValueError, "k_cache has head_dim 32 but q has head_dim 64", a,
           k_cache=a["k_cache"][..., :32], v_cache=a["v_cache"][..., :32])


def test_contiguous_cache_batch_differs():
    a = inputs(page_size=None)
    raises(ValueError, "k_cache has batch 1 but q has batch 2", a,
           k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1])


@pytest.mark.parametrize("page_size", [3, 48, 512])
def test_bad_page_size(page_size):
    raises(ValueError, f"k_cache has page size {page_size} .* powers of two from 1 to 256",
           inputs(page_size=page_size, num_blocks=2))


def test_empty_page_pool():
    a = inputs()
    raises(ValueError, "paged cache with 0 blocks", a, k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0])


def test_heads_not_multiple():
    raises(ValueError, "k_cache has 4 heads and q has 6", inputs(heads=(6, 4)))


def test_unsupported_head_dim():
    raises(ValueError, "q has head_dim 36; supported head dims are multiples of 8", inputs(head_dim=36))


def test_mismatched_dtypes():
    a = inputs()
    raises(TypeError, "v_cache has dtype bfloat16 but q has float16", a, v_cache=a["v_cache"].bfloat16())
    raises(TypeError, "k has dtype bfloat16 but q has float16", a, k=a["k"].bfloat16(), v=a["v"].bfloat16())
    raises(TypeError, "q has dtype float64; supported dtypes are", inputs(dtype=torch.float64))


def test_cache_seqlens_must_be_int32():
    a = inputs()
    raises(TypeError, "cache_seqlens has dtype int64; it must be int32", a, cache_seqlens=a["cache_seqlens"].long())
    raises(TypeError, "cache_seqlens must be a torch.Tensor, got int", a, cache_seqlens=5)


def test_cache_seqlens_wrong_shape():
    raises(ValueError, r"cache_seqlens must have shape \(2,\) .* got \(3,\)", inputs(),
           cache_seqlens=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_block_table_must_be_int32_2d_with_batch_rows():
    a = inputs()
    raises(TypeError, "block_table has dtype int64; it must be int32", a, block_table=a["block_table"].long())
    raises(ValueError, r"block_table must have 2 dimensions .* got 1", a, block_table=a["block_table"][0])
    raises(ValueError, "block_table has 1 rows but q has batch 2", a, block_table=a["block_table"][:1])


def test_k_without_v():
    raises(ValueError, "k and v must be given together .* got k=torch.Tensor, v=NoneType", inputs(), v=None)


def test_new_kv_wrong_shape():
    a = inputs()
    raises(ValueError, r"k has shape \(2, 1, 1, 64\); new keys/values must have shape .* = \(2, 1, 2, 64\)",
           a, k=a["k"][:, :, :1])


def test_new_kv_last_dim_not_contiguous():
    a = inputs()
    k = torch.randn(2, 1, 2, 128, device=DEVICE).half()[..., ::2]
    raises(ValueError, "k has stride 2 in its last", a, k=k)


def test_cache_last_dim_not_contiguous():
    a = inputs()
    strided = torch.randn(10, 16, 2, 128, device=DEVICE).half()[..., ::2]
    raises(ValueError, "k_cache has stride 2 in its last", a, k_cache=strided)


def test_bad_flags_and_scale():
    a = inputs()
    raises(TypeError, "causal must be a bool, got str 'yes'", a, causal="yes")
    raises(TypeError, "return_lse must be a bool, got int 1", a, return_lse=1)
    raises(TypeError, "validate must be a bool or None, got str 'always'", a, validate="always")
    raises(ValueError, "softmax_scale must be finite and positive, got -1.0", a, softmax_scale=-1.0)


@pytest.mark.parametrize("num_splits, exc, message", [
    (-1, ValueError, "num_splits must be from 0 .* to 256, got -1"),
    (1000, ValueError, "got 1000"),
    (2.0, TypeError, "num_splits must be an int, got float 2.0"),
    (True, TypeError, "got bool True"),
])
def test_bad_num_splits(num_splits, exc, message):
    raises(exc, message, inputs(), num_splits=num_splits)


def test_new_tokens_beyond_capacity_by_shape():
    raises(ValueError, r"k has 65 new tokens per sequence but the cache holds at most 64 tokens .*max_blocks",
           inputs(seqlen_q=65))


def test_length_beyond_capacity():
    a = inputs()
    seqlens = torch.tensor([5, 64], dtype=torch.int32, device=DEVICE)
    raises(ValueError, r"cache_seqlens\[1\] = 64 plus 1 new tokens exceeds the cache capacity of 64", a,
           cache_seqlens=seqlens, validate=True)
    contiguous = inputs(page_size=None)
    raises(ValueError, r"cache_seqlens\[0\] = 65 exceeds the cache capacity of 64 tokens .*k_cache.shape\[1\]",
           contiguous, k=None, v=None, validate=True,
           cache_seqlens=torch.tensor([65, 0], dtype=torch.int32, device=DEVICE))


def test_negative_length():
    raises(ValueError, r"cache_seqlens\[1\] = -3 is negative", inputs(), validate=True,
           cache_seqlens=torch.tensor([0, -3], dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("bad", [10, -1, 2**30])
def test_block_table_points_outside_pool(bad):
    a = inputs()
    table = a["block_table"].clone()
    table[1, 0] = bad
    raises(ValueError, rf"block_table\[1, 0\] = {bad} points outside the page pool of 10 blocks", a,
           block_table=table, validate=True)


def test_unused_block_table_entries_are_not_checked():
    """Only the pages a sequence uses must be valid (5 + 1 tokens use page 0 of each row)."""
    a = inputs()
    table = a["block_table"].clone()
    table[:, 1:] = -7
    with pytest.raises(AssertionError, match="kernel launched"):
        call(a, block_table=table, validate=True)


def test_values_checked_by_default_only_on_cpu():
    a = inputs()
    seqlens = torch.tensor([5, 99], dtype=torch.int32, device=DEVICE)
    if ON_GPU:  # no device->host sync unless asked: reaches the launcher
        with pytest.raises(AssertionError, match="kernel launched"):
            call(a, cache_seqlens=seqlens)
    else:
        raises(ValueError, "exceeds the cache capacity", a, cache_seqlens=seqlens)
    with pytest.raises(AssertionError, match="kernel launched"):
        call(a, cache_seqlens=seqlens, validate=False)


def test_cpu_tensors_outside_interpreter(monkeypatch):
    monkeypatch.setattr(interface, "kernels_interpreted", lambda: False)
    raises(ValueError, "q is on the CPU: .* TRITON_INTERPRET=1", inputs(device="cpu"))


def test_mismatched_device():
    if not ON_GPU:
        pytest.skip("needs a second device type")
    a = inputs()
    raises(ValueError, "cache_seqlens is on cpu but q is on cuda", a, cache_seqlens=a["cache_seqlens"].cpu())
    raises(ValueError, "block_table is on cpu but q is on cuda", a, block_table=a["block_table"].cpu())


def test_failed_call_leaves_cache_untouched():
    a = inputs()
    before = (a["k_cache"].clone(), a["v_cache"].clone())
    with pytest.raises(ValueError):
        call(a, cache_seqlens=torch.tensor([5, 64], dtype=torch.int32, device=DEVICE), validate=True)
    assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])
