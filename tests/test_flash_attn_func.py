"""flash_attn_func (the fused forward kernel) against the float64 reference."""

import itertools

import pytest
import torch

import flashkernel
from flashkernel import interface
from flashkernel.kernels import prefill
from helpers import DEVICE, DTYPES, ON_GPU, assert_output_close, random_qkv

# The interpreter's tiles are 32 x 32 (prefill.INTERPRETER_CONFIG): 300 spans ten, the last one
# partial, at a tenth of the 1000-token case's time there.
LONG = 1000 if ON_GPU else 300
LENGTHS = (1, 17, 127, 129, LONG)
HEAD_DIMS = (8, 64, 72, 128, 200, 256)
HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def run_and_check(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, causal, softmax_scale=None):
    num_heads, num_kv_heads = heads
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, dtype)
    out, lse = flashkernel.flash_attn_func(
        q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, num_heads, seqlen_q)
    assert_output_close(out, q, k, v, causal=causal, softmax_scale=softmax_scale, lse=lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", LENGTHS)
def test_lengths_not_multiple_of_tile(seqlen, causal, dtype):
    run_and_check(1, seqlen, seqlen, (2, 1), 64, dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 129), (1, 127), (129, 17), (127, 1), (LONG, 129)])
def test_seqlen_q_differs_from_seqlen_k(seqlen_q, seqlen_k, causal, dtype):
    run_and_check(2, seqlen_q, seqlen_k, (2, 2), 64, dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(head_dim, causal, dtype):
    run_and_check(1, 65, 97, (2, 1), head_dim, dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
def test_mha_gqa_mqa(layout, causal, dtype):
    run_and_check(2, 70, 70, HEAD_LAYOUTS[layout], 64, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_float32_inputs(causal):
    run_and_check(1, 50, 77, (2, 1), 72, torch.float32, causal)


@pytest.mark.parametrize("softmax_scale", [0.01, 0.5])
def test_custom_softmax_scale(softmax_scale):
    run_and_check(1, 33, 33, (2, 2), 64, torch.float16, True, softmax_scale=softmax_scale)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, causal, layout, head_dim, seqlen, q_vs_k",
    list(itertools.product(DTYPES, [False, True], list(HEAD_LAYOUTS), HEAD_DIMS, LENGTHS, ["=", "<", ">"])),
)
def test_full_grid_gpu(dtype, causal, layout, head_dim, seqlen, q_vs_k):
    """The whole cartesian product, too slow for the interpreter."""
    other = {"=": seqlen, "<": seqlen * 2 + 3, ">": max(1, seqlen // 2 - 1)}[q_vs_k]
    run_and_check(2, seqlen, other, HEAD_LAYOUTS[layout], head_dim, dtype, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_seqlen_16k_gpu(causal, head_dim):
    run_and_check(1, 16384, 16384, (2, 1), head_dim, torch.bfloat16, causal)


def test_query_rows_that_see_no_key_are_zero():
    q, k, v = random_qkv(1, 40, 9, 2, 1, 64, torch.float16)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True)
    blind = 40 - 9  # queries 0..30 see no key (bottom-right alignment)
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all()
    assert torch.isfinite(lse[:, :, blind:]).all()
    assert_output_close(out, q, k, v, causal=True, lse=lse)


def test_packed_qkv_views_are_accepted():
    """q, k, v as strided views of one packed [B, S, 3, H, D] tensor."""
    qkv = torch.randn(2, 45, 3, 4, 64, dtype=torch.float16, device=DEVICE)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out = flashkernel.flash_attn_func(q, k, v, causal=True)
    assert_output_close(out, q, k, v, causal=True)


def test_non_contiguous_heads_and_batch_strides():
    base = torch.randn(3, 60, 8, 64, dtype=torch.bfloat16, device=DEVICE)
    q = base[::2, :50, 1:5]  # batch stride doubled, seqlen and heads sliced
    k = torch.randn(2, 64, 6, 64, dtype=torch.bfloat16, device=DEVICE)[:, :31, ::3]
    v = torch.randn(2, 31, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    out = flashkernel.flash_attn_func(q, k, v)
    assert_output_close(out, q, k, v)


def test_identical_calls_are_bitwise_identical():
    q, k, v = random_qkv(2, 100, 100, 4, 2, 64, torch.float16)
    a, lse_a = flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True)
    b, lse_b = flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)


def test_inputs_are_not_modified():
    q, k, v = random_qkv(1, 33, 40, 2, 1, 64, torch.bfloat16)
    before = [t.clone() for t in (q, k, v)]
    flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True)
    for t, saved in zip((q, k, v), before):
        assert torch.equal(t, saved)


def test_return_lse_false_returns_tensor_only():
    q, k, v = random_qkv(1, 5, 5, 2, 2, 64, torch.float16)
    out = flashkernel.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)], ids=["batch0", "seqlen_q0", "seqlen_k0"])
def test_empty_inputs_return_without_launch(shape, monkeypatch):
    batch, seqlen_q, seqlen_k = shape

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty problem")

    monkeypatch.setattr(interface.dispatch, "prefill", no_launch)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 4, 2, 64, torch.float16)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (batch, seqlen_q, 4, 64) and out.dtype == torch.float16
    assert lse.shape == (batch, 4, seqlen_q) and lse.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


@pytest.mark.gpu
def test_batch_beyond_grid_limit_gpu():
    """Batches larger than the 65535 grid limit are launched in chunks."""
    run_and_check(70000, 3, 5, (1, 1), 16, torch.float16, True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k, head_dim", [(70, 129, 64), (129, 33, 72)])
@pytest.mark.parametrize("tma", [False, True])
def test_tile_load_paths(seqlen_q, seqlen_k, head_dim, causal, tma):
    """Pointer loads and TMA descriptor loads compute the same function."""
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.float16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, seqlen_q), float("nan"), device=DEVICE)
    prefill.attention_forward(q, k, v, out, lse, causal=causal, softmax_scale=0.1, force_tma=tma)
    assert_output_close(out, q, k, v, causal=causal, softmax_scale=0.1, lse=lse)


def test_unaligned_tensors():
    """A view starting 2 bytes into its storage cannot use TMA, even when asked; results stay exact."""
    flat = torch.randn(3 * 40 * 2 * 64 + 1, dtype=torch.float16, device=DEVICE)
    q = flat[1:].view(3, 40, 2, 64)
    k = torch.randn(3, 51, 1, 64, dtype=torch.float16, device=DEVICE)
    v = torch.randn(3, 51, 1, 64, dtype=torch.float16, device=DEVICE)
    assert not prefill.tma_compatible(q)
    out = torch.full_like(q, float("nan"))
    prefill.attention_forward(q, k, v, out, None, causal=True, softmax_scale=0.125, force_tma=True)
    assert_output_close(out, q, k, v, causal=True)


def test_caller_triton_allocator_is_restored():
    """The launchers install their TMA scratch allocator for their own launches only."""
    import triton
    from triton.runtime import _allocation

    def callers_allocator(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=DEVICE)

    triton.set_allocator(callers_allocator)
    q, k, v = random_qkv(1, 20, 20, 2, 1, 64, torch.float16)
    flashkernel.flash_attn_func(q, k, v)
    prefill.attention_forward(q, k, v, torch.empty_like(q), None, causal=False, softmax_scale=0.1,
                              force_tma=True)
    assert _allocation._allocator.get() is callers_allocator
