"""Bad input raises a clear ValueError / TypeError, naming the value, before any launch."""

import math

import numpy as np
import pytest
import torch

import flashkernel
from flashkernel import interface
from helpers import DEVICE, ON_GPU

FUNCS = [flashkernel.flash_attn_func, flashkernel.standard_attention]


def qkv(q_shape=(1, 8, 4, 64), kv_shape=(1, 8, 2, 64), dtype=torch.float16, device=DEVICE):
    return (
        torch.randn(q_shape, device=device).to(dtype),
        torch.randn(kv_shape, device=device).to(dtype),
        torch.randn(kv_shape, device=device).to(dtype),
    )


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("kernel launched despite bad input")

    monkeypatch.setattr(interface.dispatch, "prefill", fail)
    monkeypatch.setattr(interface.naive, "standard_attention", fail)


def raises(exc, match, func, *args, **kwargs):
    with pytest.raises(exc, match=match):
        func(*args, **kwargs)


@pytest.mark.parametrize("func", FUNCS)
def test_wrong_rank(func):
    q, k, v = qkv()
    raises(ValueError, r"q must have 4 dimensions .* got 3 with shape \(8, 4, 64\)", func, q[0], k, v)


@pytest.mark.parametrize("func", FUNCS)
def test_not_a_tensor(func):
    q, k, v = qkv()
    raises(TypeError, "k must be a torch.Tensor, got list", func, q, [1, 2], v)


@pytest.mark.parametrize("func", FUNCS)
def test_nested_or_sparse_tensor(func):
    """A nested tensor's shape raises PyTorch's internal RuntimeError; every public call names it
    first (the replay look-up turns it away without reading it)."""
    q, k, v = qkv()
    nested = torch.nested.nested_tensor([torch.randn(3, 4, 64), torch.randn(5, 4, 64)]).to(DEVICE, torch.float16)
    raises(TypeError, "q is a nested tensor; .* flash_attn_varlen_func", func, nested, k, v)
    raises(TypeError, "k has layout torch.sparse_coo; .* .to_dense()", func, q, k.float().to_sparse().half(), v)


def test_nested_tensor_in_the_cache_and_packed_calls():
    q, k, v = qkv()
    nested = torch.nested.nested_tensor([torch.randn(3, 4, 64), torch.randn(5, 4, 64)]).to(DEVICE, torch.float16)
    lengths = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    raises(TypeError, "q is a nested tensor", flashkernel.flash_attn_with_kvcache, nested, k, v, cache_seqlens=lengths)
    raises(TypeError, "k_cache is a nested tensor", flashkernel.flash_attn_with_kvcache, q, nested, v,
           cache_seqlens=lengths)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    raises(TypeError, "q is a nested tensor", flashkernel.flash_attn_varlen_func, nested, k[0], v[0], cu, cu, 8, 8)


@pytest.mark.parametrize("func", FUNCS)
def test_mismatched_batch(func):
    q, k, v = qkv(kv_shape=(3, 8, 2, 64))
    raises(ValueError, "k has batch 3 but q has batch 1", func, q, k, v)


@pytest.mark.parametrize("func", FUNCS)
def test_mismatched_head_dim(func):
    q, k, v = qkv(kv_shape=(1, 8, 2, 32))
    raises(ValueError, "k has head_dim 32 but q has head_dim 64", func, q, k, v)


@pytest.mark.parametrize("func", FUNCS)
def test_mismatched_k_v(func):
    q, k, _ = qkv()
    v = torch.randn(1, 9, 2, 64, device=DEVICE).half()
    raises(ValueError, r"k has shape \(1, 8, 2, 64\) and v has shape \(1, 9, 2, 64\)", func, q, k, v)


@pytest.mark.parametrize("func", FUNCS)
def test_mismatched_dtype(func):
    q, k, v = qkv()
    raises(TypeError, "v has dtype bfloat16 but q has float16", func, q, k, v.bfloat16())


@pytest.mark.parametrize("func", FUNCS)
def test_unsupported_dtype(func):
    q, k, v = qkv(dtype=torch.float64)
    raises(TypeError, "q has dtype float64; supported dtypes are float16, bfloat16, float32; for float64 "
           "\\(gradient checks\\) use flashkernel.reference.attention", func, q, k, v)
    q, k, v = qkv()
    raises(TypeError, "has dtype int32", func, q.int(), k.int(), v.int())


@pytest.mark.parametrize("func", FUNCS)
def test_heads_not_multiple(func):
    q, k, v = qkv(q_shape=(1, 8, 6, 64), kv_shape=(1, 8, 4, 64))
    raises(ValueError, "k has 4 heads and q has 6: the number of query heads must be a positive multiple", func, q, k, v)


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("head_dim", [4, 36, 264, 512])
def test_unsupported_head_dim(func, head_dim):
    q, k, v = qkv(q_shape=(1, 8, 2, head_dim), kv_shape=(1, 8, 2, head_dim))
    raises(ValueError, f"q has head_dim {head_dim}; supported head dims are multiples of 8 from 8 to 256", func, q, k, v)


@pytest.mark.parametrize("func", FUNCS)
def test_last_dim_not_contiguous(func):
    q, k, v = qkv()
    k_strided = torch.randn(1, 8, 2, 128, device=DEVICE).half()[..., ::2]
    raises(ValueError, "k has stride 2 in its last .* call .contiguous", func, q, k_strided, v)


@pytest.mark.parametrize("func", FUNCS)
def test_mismatched_device(func):
    if not ON_GPU:
        pytest.skip("needs a second device type")
    q, k, v = qkv()
    raises(ValueError, "v is on cpu but q is on cuda", func, q, k, v.cpu())


@pytest.mark.parametrize("func", FUNCS)
def test_cpu_tensors_outside_interpreter(func, monkeypatch):
    monkeypatch.setattr(interface, "kernels_interpreted", lambda: False)
    q, k, v = qkv(device="cpu")
    raises(ValueError, "q is on the CPU: .* TRITON_INTERPRET=1", func, q, k, v)


@pytest.mark.parametrize("func", FUNCS)
def test_tensors_on_a_device_no_kernel_runs_on(func):
    q, k, v = qkv(device="meta")
    raises(ValueError, r"q is on meta; flashkernel's kernels run on CUDA GPUs \(and on the CPU through Triton's "
           r"interpreter, TRITON_INTERPRET=1\): move the tensors to a CUDA device", func, q, k, v)


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_bad_softmax_scale_value(func, scale):
    q, k, v = qkv()
    raises(ValueError, f"softmax_scale must be finite and positive, got {scale}", func, q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("scale", [1e-39, 1e-100, 5e-324])
def test_softmax_scale_below_float32s_normal_range(func, scale):
    """A scale of 1e-100 (0 in float32) made every output and LSE NaN."""
    q, k, v = qkv()
    raises(ValueError, f"softmax_scale is {scale!r}; it must be at least 1.1754943508222875e-38", func, q, k, v,
           softmax_scale=scale)


@pytest.mark.parametrize("func", FUNCS)
def test_softmax_scale_that_overflows_float32_scores(func):
    """A scale of 1e38 made every output NaN (its float32 product with log2(e) is inf)."""
    q, k, v = qkv()
    raises(ValueError, "softmax_scale is 1e\\+38; it must be at most 1e\\+20", func, q, k, v, softmax_scale=1e38)


@pytest.mark.parametrize("func", FUNCS)
def test_bad_softmax_scale_type(func):
    q, k, v = qkv()
    raises(TypeError, "softmax_scale must be a real number or None, got str '0.1'", func, q, k, v, softmax_scale="0.1")
    raises(TypeError, "got torch.Tensor", func, q, k, v, softmax_scale=torch.tensor(0.1))


@pytest.mark.parametrize("func", FUNCS)
def test_bad_causal_flag(func):
    q, k, v = qkv()
    raises(TypeError, "causal must be a bool, got str 'yes'", func, q, k, v, causal="yes")
    raises(TypeError, "causal must be a bool, got numpy.bool", func, q, k, v, causal=np.bool_(True))


def test_inputs_untouched_by_failed_call():
    q, k, v = qkv(kv_shape=(1, 8, 3, 64))
    saved = [t.clone() for t in (q, k, v)]
    with pytest.raises(ValueError):
        flashkernel.flash_attn_func(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), saved))
