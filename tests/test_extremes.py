"""Extreme inputs on every path: logits up to +-1e4, float16 values near overflow, rows that see
no key, NaN and inf in cache slots past each length and in padding, tiny and huge softmax
scales, tensors past 2**31 elements. Each is answered like the float64 reference (the fuzzer's
rule, ``bench/fuzz_checks.py: check_rows``) or refused with a clear error, never with a NaN the
reference does not have.

A *path* computes ``q [B, Sq, H, D]`` over ``k, v [B, Sk, Hkv, D]`` with the same semantics
through one entry point: the Triton or Gluon prefill kernel, packed sequences, the Triton or
Gluon decode kernel over a paged cache holding ``k, v`` (``Sq`` new tokens, no append: the same
bottom-right alignment), or ``standard_attention``.
"""

import math

import pytest
import torch

import flashkernel
from flashkernel.bench.fuzz_checks import check_rows
from helpers import DEVICE, ON_GPU

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
PATHS = ["dense", "dense-gluon", "varlen", "decode", "decode-gluon", "standard"]
CPU_DTYPES = (torch.float16, torch.float32)  # bf16's tl.dot is wrong in Triton 3.6's interpreter
DTYPES = (torch.float16, torch.bfloat16, torch.float32) if ON_GPU else CPU_DTYPES
PAGE = 16


def skip_unless_supported(path, dtype, head_dim=64, plain=True, rows=1):
    if path.endswith("gluon"):
        if not HOPPER:
            pytest.skip("the Gluon kernels need an sm_90 GPU")
        if dtype == torch.float32 or head_dim not in (64, 128, 256) or not plain:
            pytest.skip("the Gluon kernels run plain bf16/fp16 attention at head dims 64/128/256")
        if path == "decode-gluon" and rows > 16:
            pytest.skip("the Gluon decode kernel computes at most 16 rows per KV head")
    if path == "standard" and not plain:
        pytest.skip("standard_attention has no variants")


def paged_cache(k, v, fill=math.nan):
    """``k, v [B, Sk, Hkv, D]`` as pages of 16 keys in pools whose other slots (past each length,
    two unused pages) hold ``fill``; returns ``(k_pages, v_pages, block_table)``."""
    batch, seqlen_k, kv_heads, head_dim = k.shape
    blocks = -(-seqlen_k // PAGE)
    table = torch.randperm(batch * blocks + 2, device=k.device)[:batch * blocks].view(batch, blocks).int()
    positions = torch.arange(seqlen_k, device=k.device)
    pools = []
    for x in (k, v):
        pool = torch.full((batch * blocks + 2, PAGE, kv_heads, head_dim), fill, dtype=x.dtype, device=x.device)
        for b in range(batch):
            pool[table[b].long()[positions // PAGE], positions % PAGE] = x[b]
        pools.append(pool)
    return (*pools, table)


def attend(path, q, k, v, fill=math.nan, **kwargs):
    """``(out, lse)`` of the attention of ``q`` over ``k, v`` through ``path``."""
    if path in ("dense", "dense-gluon"):
        backend = "gluon" if path == "dense-gluon" else "triton"
        return flashkernel.flash_attn_func(q, k, v, return_lse=True, backend=backend, **kwargs)
    if path == "standard":
        return flashkernel.standard_attention(q, k, v, return_lse=True, **kwargs)
    batch, seqlen_q, heads, head_dim = q.shape
    if path == "varlen":
        seqlen_k = k.shape[1]
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (batch + 1) * seqlen_k, seqlen_k, dtype=torch.int32, device=q.device)
        out, lse = flashkernel.flash_attn_varlen_func(
            q.reshape(-1, heads, head_dim), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]), cu_q, cu_k,
            seqlen_q, seqlen_k, return_lse=True, **kwargs)
        return out.view(q.shape), lse.view(heads, batch, seqlen_q).transpose(0, 1)
    k_pages, v_pages, table = paged_cache(k, v, fill)
    seqlens = torch.full((batch,), k.shape[1], dtype=torch.int32, device=q.device)
    kwargs.setdefault("causal", False)
    return flashkernel.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                               return_lse=True, backend="gluon" if path == "decode-gluon" else "triton",
                                               **kwargs)


def check(path, q, k, v, **kwargs):
    out, lse = attend(path, q, k, v, **kwargs)
    kwargs.pop("fill", None)
    outcome = check_rows(out, lse, q, k, v, None, **kwargs)
    assert not outcome.problems, "; ".join(outcome.problems)
    return out


def qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, q_std=1.0, k_std=1.0, v_std=1.0):
    q = (torch.randn(batch, seqlen_q, heads, head_dim, device=DEVICE) * q_std).to(dtype)
    k = (torch.randn(batch, seqlen_k, kv_heads, head_dim, device=DEVICE) * k_std).to(dtype)
    v = (torch.randn(batch, seqlen_k, kv_heads, head_dim, device=DEVICE) * v_std).to(dtype)
    return q, k, v


# ---- large logits and values near overflow -------------------------------------------------------


@pytest.mark.parametrize("magnitude", [1e2, 1e4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_logits_up_to_1e4(path, dtype, magnitude):
    """Scores up to +-magnitude, from the scale (N(0, 1) q and k) and from the values (q, k
    scaled up, whose float16 q.k PyTorch's own matmul overflows at 1e4)."""
    skip_unless_supported(path, dtype, rows=2 * 4)
    head_dim = 64
    scale = magnitude / (4 * math.sqrt(head_dim))
    q, k, v = qkv(1, 4, 37, 4, 2, head_dim, dtype)
    check(path, q, k, v, softmax_scale=scale, causal=True)
    std = math.sqrt(magnitude / 4)  # |q.k / sqrt(D)| up to ~magnitude
    q, k, v = qkv(2, 4, 21, 4, 2, head_dim, dtype, q_std=std, k_std=std)
    check(path, q, k, v)


@pytest.mark.parametrize("path", PATHS)
def test_float16_values_near_overflow(path):
    """q, k and v up to 6e4 (float16's largest is 65504): the scores' products reach 1e11 in
    float32 (PyTorch's float16 q.k overflows), the outputs come close to 65504; none is inf."""
    skip_unless_supported(path, torch.float16, rows=2 * 4)
    q, k, v = (torch.empty(1, n, h, 64, device=DEVICE).uniform_(-6e4, 6e4).half() for n, h in ((4, 4), (33, 2), (33, 2)))
    out = check(path, q, k, v, softmax_scale=1e-9, causal=True)  # scores of a few units
    assert torch.isfinite(out).all() and out.abs().max() > 1e4


# ---- rows that see no key -------------------------------------------------------------------------


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_rows_that_see_no_key(path, sinks):
    """Causal with more queries than keys: the first rows see no key and get 0 and LSE -inf (or
    their sink); with a window of (0, 0) as well, where the window misses every key."""
    skip_unless_supported(path, torch.float16, plain=not sinks, rows=2 * 9)
    q, k, v = qkv(1, 9, 5, 4, 2, 64, torch.float16)
    extra = {"sinks": torch.randn(4, device=DEVICE)} if sinks else {}
    out = check(path, q, k, v, causal=True, **extra)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    if path not in ("dense-gluon", "decode-gluon", "standard"):
        check(path, q, k, v, window_size=(0, 0), **extra)


# ---- NaN and inf where no read may land -----------------------------------------------------------


def padded(x, fill):
    """``x`` as a view into a buffer holding ``fill`` around it (a row, a head, 8 head-dim columns)."""
    batch, seq, heads, dim = x.shape
    buf = torch.full((batch, seq + 2, heads + 1, dim + 8), fill, dtype=x.dtype, device=x.device)
    view = buf[:, 1:seq + 1, 1:, :dim]
    view.copy_(x)
    return view


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("path", PATHS)
def test_nan_and_inf_past_each_length_and_in_padding(path, fill):
    """Inputs inside buffers full of NaN or inf (rows, heads and head-dim columns around them);
    caches whose slots past each length and whose unused pages hold them; block-table entries of
    -1 past each sequence's pages. Nothing of it reaches the output."""
    skip_unless_supported(path, torch.float16, rows=2)
    q, k, v = qkv(2, 1, 37, 4, 2, 64, torch.float16)
    if path in ("dense", "dense-gluon", "standard"):
        q, k, v = padded(q, fill), padded(k, fill), padded(v, fill)
    check(path, q, k, v, fill=fill, causal=True)


@pytest.mark.parametrize("fill", [math.nan, math.inf])
def test_nan_in_packed_padding_and_unused_table_entries(fill):
    """Packed sequences inside a NaN-filled buffer; a decode whose block table has -1 and
    out-of-range entries past each sequence's pages (never read)."""
    lengths = [5, 0, 19]
    total = sum(lengths)
    buf = torch.full((total + 2, 5, 72), fill, dtype=torch.float16, device=DEVICE)
    q = buf[1:total + 1, 1:, :64]
    q.copy_(torch.randn(total, 4, 64, device=DEVICE))
    k, v = torch.randn(total, 2, 64, dtype=torch.float16, device=DEVICE), torch.randn(total, 2, 64, dtype=torch.float16,
                                                                                        device=DEVICE)
    cu = torch.tensor([0, 5, 5, 24], dtype=torch.int32, device=DEVICE)
    out = flashkernel.flash_attn_varlen_func(q, k, v, cu, cu, 19, 19, causal=True)
    for start, stop in ((0, 5), (5, 24)):
        outcome = check_rows(out[None, start:stop], None, q[None, start:stop], k[None, start:stop],
                             v[None, start:stop], None, causal=True)
        assert not outcome.problems, outcome.problems
    keys, values = (torch.randn(2, 20, 2, 64, dtype=torch.float16, device=DEVICE) for _ in range(2))
    k_pages, v_pages, table = paged_cache(keys, values, fill)
    table = torch.cat([table, torch.tensor([[-1, 10**6]] * 2, dtype=torch.int32, device=DEVICE)], dim=1)
    q1 = torch.randn(2, 1, 4, 64, dtype=torch.float16, device=DEVICE)
    seqlens = torch.tensor([20, 20], dtype=torch.int32, device=DEVICE)
    out1, lse1 = flashkernel.flash_attn_with_kvcache(q1, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                                     return_lse=True)
    outcome = check_rows(out1, lse1, q1, keys, values, None, causal=True)
    assert not outcome.problems, outcome.problems


# ---- softmax scales -------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-30, 1e-8, 1e6, 1e12, 1e20])
@pytest.mark.parametrize("path", PATHS)
def test_tiny_and_huge_softmax_scales(path, scale):
    """Tiny scales flatten the softmax to a mean; huge ones make it an argmax, which the output
    must match wherever the two largest scores are far apart in float32 terms. Scores past 2**31
    in log2 units (scales 1e12, 1e20) once gave NaN rows and LSE -inf on the GPU, where the
    exponent was contracted into an FMA (``kernels._common.exponent_options``); the interpreter
    rounds each step, so on the CPU this cannot fail."""
    skip_unless_supported(path, torch.float16, rows=2 * 6)
    q, k, v = qkv(1, 6, 30, 4, 2, 64, torch.float16)
    out = check(path, q, k, v, softmax_scale=scale, causal=True)
    if scale < 1e6:
        return
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2))
    visible = torch.arange(30, device=DEVICE)[None, :] <= torch.arange(6, device=DEVICE)[:, None] + 24
    scores = scores.masked_fill(~visible, -math.inf)
    top = scores.topk(2, dim=-1)
    clear = (top.values[..., 0] - top.values[..., 1]) > 1e-5 * top.values[..., 0].abs() + 50 / scale
    winner = v.double().repeat_interleave(2, dim=2).permute(0, 2, 1, 3).gather(
        2, top.indices[..., :1].expand(-1, -1, -1, 64))  # [B, H, Sq, D]
    got = out.double().permute(0, 2, 1, 3)
    assert clear.any()
    err = (got - winner).abs().amax(-1)[clear]
    assert err.max() <= 2 * torch.finfo(torch.float16).eps * v.abs().max().item()


# ---- past 2**31 elements --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["dense", "dense-gluon", "varlen"])
@pytest.mark.parametrize("stride", ["batch", "row"])
def test_tensors_past_2_31_elements_gpu(path, stride):
    """q lies in a NaN-filled buffer of more than 2**31 elements, its second sequence (batch
    stride) or its last rows (row stride) past element 2**31: every offset into it needs 64
    bits. Checked on a sample of rows against every key."""
    skip_unless_supported(path, torch.bfloat16, head_dim=128)
    if path == "varlen" and stride == "batch":
        pytest.skip("packed sequences have no batch stride")
    heads, head_dim, seqlen = 4, 128, 300
    if stride == "batch":  # [2, 300, 4, 128] with sequence 1 at element 2**31 + 512
        strides = (2**31 + 512, heads * head_dim, head_dim, 1)
        shape, size = (2, seqlen, heads, head_dim), 2**31 + 512 + seqlen * heads * head_dim
    else:  # rows 2**23 elements apart: row 256 onwards past 2**31
        strides = (2**23 * seqlen, 2**23, head_dim, 1)
        shape, size = (1, seqlen, heads, head_dim), 2**23 * seqlen
    store = torch.full((size,), math.nan, dtype=torch.bfloat16, device=DEVICE)
    q = store.as_strided(shape, strides)
    q.copy_(torch.randn(shape, device=DEVICE))
    k, v = (torch.randn(shape[0], seqlen, 2, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    if path == "varlen":
        q = q[0]
        cu = torch.tensor([0, 100, seqlen], dtype=torch.int32, device=DEVICE)
        out = flashkernel.flash_attn_varlen_func(q, k[0], v[0], cu, cu, 200, 200, causal=True)
        for start, stop in ((0, 100), (100, seqlen)):
            rows = [0, stop - start - 1, (stop - start) // 2]
            outcome = check_rows(out[None, start:stop], None, q[None, start:stop], k[:, start:stop], v[:, start:stop],
                                 rows, causal=True)
            assert not outcome.problems, outcome.problems
        return
    out, lse = attend(path, q, k, v, causal=True)
    rows = [0, 1, 255, 256, 257, seqlen - 1]
    outcome = check_rows(out, lse, q, k, v, rows, causal=True)
    assert not outcome.problems, outcome.problems
