"""Variant arguments and flash_attn_varlen_func: bad input raises a clear error naming the value,
before any launch."""

import math

import pytest
import torch

import flashkernel
from flashkernel import interface
from helpers import DEVICE, ON_GPU


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("kernel launched despite bad input")

    monkeypatch.setattr(interface.dispatch, "prefill", fail)
    monkeypatch.setattr(interface.dispatch, "prefill_varlen", fail)
    monkeypatch.setattr(interface.dispatch, "decode", fail)


def dense_call(**overrides):
    q = torch.randn(2, 8, 4, 64, device=DEVICE).half()
    k = torch.randn(2, 8, 2, 64, device=DEVICE).half()
    return flashkernel.flash_attn_func(q, k, torch.randn_like(k), **overrides)


def decode_call(**overrides):
    q = torch.randn(2, 1, 4, 64, device=DEVICE).half()
    cache = torch.randn(2, 16, 2, 64, device=DEVICE).half()
    seqlens = torch.full((2,), 3, dtype=torch.int32, device=DEVICE)
    return flashkernel.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=seqlens, **overrides)


def packed(lengths=(3, 5), heads=(4, 2), head_dim=64, dtype=torch.float16):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    total = int(cu[-1])
    q = torch.randn(total, heads[0], head_dim, device=DEVICE).to(dtype)
    k = torch.randn(total, heads[1], head_dim, device=DEVICE).to(dtype)
    return dict(q=q, k=k, v=torch.randn_like(k), cu_seqlens_q=cu, cu_seqlens_k=cu.clone(),
                max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))


def varlen_call(**overrides):
    args = {**packed(), **overrides}
    positional = [args.pop(name) for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                              "max_seqlen_q", "max_seqlen_k")]
    return flashkernel.flash_attn_varlen_func(*positional, **args)


CALLS = {"dense": dense_call, "decode": decode_call, "varlen": varlen_call}


def raises(exc, match, call, **overrides):
    with pytest.raises(exc, match=match):
        call(**overrides)


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_valid_variants_reach_the_launcher(call):
    with pytest.raises(AssertionError, match="kernel launched"):
        call(window_size=(3, 0), softcap=20.0, alibi_slopes=torch.rand(4, device=DEVICE),
             sinks=torch.zeros(4, device=DEVICE))


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
@pytest.mark.parametrize("window, exc, message", [
    ((-2, 0), ValueError, "window_size left is -2; each side must be -1 .unbounded. or a number of keys >= 0"),
    ((4, -5), ValueError, "window_size right is -5"),
    ((4,), TypeError, r"window_size must be a pair \(left, right\) of ints, .* got tuple \(4,\)"),
    (4, TypeError, "window_size must be a pair .* got int 4"),
    ((1.5, 0), TypeError, "window_size left must be an int, got float 1.5"),
    ((0, True), TypeError, "window_size right must be an int, got bool True"),
])
def test_bad_window(call, window, exc, message):
    raises(exc, message, call, window_size=window)


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
@pytest.mark.parametrize("softcap, exc, message", [
    (-1.0, ValueError, r"softcap must be finite and >= 0 \(0 turns it off\), got -1.0"),
    (math.inf, ValueError, "got inf"),
    (math.nan, ValueError, "got nan"),
    ("50", TypeError, "softcap must be a real number, got str '50'"),
    (True, TypeError, "got bool True"),
])
def test_bad_softcap(call, softcap, exc, message):
    raises(exc, message, call, softcap=softcap)


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_bad_alibi_slopes(call):
    raises(TypeError, "alibi_slopes has dtype float16; it must be float32", call,
           alibi_slopes=torch.rand(4, device=DEVICE).half())
    raises(ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\) .* got \(2,\)", call,
           alibi_slopes=torch.rand(2, device=DEVICE))
    raises(ValueError, r"got \(3, 4\)", call, alibi_slopes=torch.rand(3, 4, device=DEVICE))
    raises(TypeError, "alibi_slopes must be a torch.Tensor, got list", call, alibi_slopes=[0.5] * 4)


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_bad_sinks(call):
    raises(TypeError, "sinks has dtype float64; it must be float32", call,
           sinks=torch.zeros(4, dtype=torch.float64, device=DEVICE))
    raises(ValueError, r"sinks must have shape \(4,\) \(one logit per query head\), got \(2,\)", call,
           sinks=torch.zeros(2, device=DEVICE))
    raises(ValueError, r"got \(1, 4\)", call, sinks=torch.zeros(1, 4, device=DEVICE))


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_variant_tensors_on_another_device(call):
    if not ON_GPU:
        pytest.skip("needs a second device type")
    raises(ValueError, "sinks is on cpu but q is on cuda", call, sinks=torch.zeros(4))
    raises(ValueError, "alibi_slopes is on cpu but q is on cuda", call, alibi_slopes=torch.zeros(4))


# ---- flash_attn_varlen_func ----------------------------------------------------------------------


def test_varlen_rank():
    a = packed()
    raises(ValueError, r"q must have 3 dimensions \[total_tokens, heads, head_dim\], got 4", varlen_call,
           q=a["q"][None])


def test_varlen_dtypes_and_head_dims():
    a = packed()
    raises(TypeError, "v has dtype bfloat16 but q has float16", varlen_call, v=a["v"].bfloat16())
    raises(ValueError, "k has head_dim 32 but q has head_dim 64", varlen_call,
           k=a["k"][..., :32], v=a["v"][..., :32])
    raises(ValueError, "k has 3 heads and q has 4", varlen_call,
           k=torch.randn(8, 3, 64, device=DEVICE).half(), v=torch.randn(8, 3, 64, device=DEVICE).half())
    raises(ValueError, r"k has shape \(8, 2, 64\) and v has shape \(7, 2, 64\)", varlen_call, v=a["v"][:7])


def test_cu_seqlens_type_and_shape():
    a = packed()
    raises(TypeError, "cu_seqlens_q has dtype int64; it must be int32", varlen_call,
           cu_seqlens_q=a["cu_seqlens_q"].long())
    raises(ValueError, r"cu_seqlens_k must be 1-D of length batch \+ 1 .* got shape \(1, 3\)", varlen_call,
           cu_seqlens_k=a["cu_seqlens_k"][None])
    raises(ValueError, r"cu_seqlens_q must be 1-D .* got shape \(0,\)", varlen_call,
           cu_seqlens_q=a["cu_seqlens_q"][:0])
    raises(ValueError, "cu_seqlens_q has 3 entries and cu_seqlens_k has 2: both must have batch",
           varlen_call, cu_seqlens_k=a["cu_seqlens_k"][:2])
    raises(TypeError, "cu_seqlens_q must be a torch.Tensor, got list", varlen_call, cu_seqlens_q=[0, 3, 8])
    strided = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    strided[::2] = a["cu_seqlens_q"]
    raises(ValueError, "cu_seqlens_q has stride 2; it must be contiguous", varlen_call, cu_seqlens_q=strided[::2])


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_bad_max_seqlen(name):
    raises(ValueError, f"{name} must be >= 0, got -1", varlen_call, **{name: -1})
    raises(TypeError, f"{name} must be an int, got float 5.0", varlen_call, **{name: 5.0})


def test_cu_seqlens_values():
    cu = lambda *xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    raises(ValueError, r"cu_seqlens_q\[0\] = 1; cumulative lengths must start at 0", varlen_call,
           cu_seqlens_q=cu(1, 3, 8), validate=True)
    raises(ValueError, r"cu_seqlens_k decreases: cu_seqlens_k\[2\] = 2 < cu_seqlens_k\[1\] = 6", varlen_call,
           cu_seqlens_k=cu(0, 6, 2), validate=True)
    raises(ValueError, r"cu_seqlens_q\[-1\] = 7 but q has 8 tokens: the last cumulative length must equal",
           varlen_call, cu_seqlens_q=cu(0, 3, 7), validate=True)
    raises(ValueError, r"sequence 1 has 5 tokens \(cu_seqlens_k\) but max_seqlen_k = 4: max_seqlen_k must be "
           "at least the longest sequence", varlen_call, max_seqlen_k=4, validate=True)


def test_cu_seqlens_values_checked_by_default_only_on_cpu():
    bad = torch.tensor([0, 6, 2], dtype=torch.int32, device=DEVICE)
    if ON_GPU:  # no device->host sync unless asked
        with pytest.raises(AssertionError, match="kernel launched"):
            varlen_call(cu_seqlens_k=bad)
    else:
        raises(ValueError, "cu_seqlens_k decreases", varlen_call, cu_seqlens_k=bad)
    with pytest.raises(AssertionError, match="kernel launched"):
        varlen_call(cu_seqlens_k=bad, validate=False)
    raises(TypeError, "validate must be a bool or None, got int 1", varlen_call, validate=1)


def test_varlen_alibi_rows_follow_the_sequences():
    raises(ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)", varlen_call,
           alibi_slopes=torch.rand(3, 4, device=DEVICE))


def test_varlen_flags_and_scale():
    raises(TypeError, "causal must be a bool, got str 'yes'", varlen_call, causal="yes")
    raises(ValueError, "softmax_scale must be finite and positive, got 0.0", varlen_call, softmax_scale=0.0)


def test_varlen_cpu_tensors_outside_interpreter(monkeypatch):
    monkeypatch.setattr(interface, "kernels_interpreted", lambda: False)
    a = {key: (x.cpu() if isinstance(x, torch.Tensor) else x) for key, x in packed().items()}
    raises(ValueError, "q is on the CPU: .* TRITON_INTERPRET=1", varlen_call, **a)
