"""The backward kernels (``kernels/backward.py``) against float64 autograd of the reference.

Each case runs the public forward (``flash_attn_func`` / ``flash_attn_varlen_func`` with
``return_lse=True``; outputs start as NaN, see conftest), hands ``out`` and ``lse`` to
``attention_backward`` with NaN-filled ``dq, dk, dv``, and compares the gradients of a random
``dout`` with:

* the truth: ``torch.autograd.grad`` through ``reference.attention`` in float64;
* PyTorch's own error: the same autograd through ``reference.attention(upcast=False)``, i.e.
  PyTorch's math path in the inputs' dtype (matmuls in that dtype, softmax in float32).

Bound, per gradient (dq, dk, dv, and dsinks), as the forward's (``helpers.assert_close_to_truth``)
plus one float32 term:

    max error  <= 2 x PyTorch's max error  + floor
    mean error <= 2 x PyTorch's mean error + floor / 8     (not for dsinks, one value per head)
    floor = eps(dtype) x max(1, max |truth|) + 2 x eps(float32) x (1 + max |lse|) x max |M|

``M`` is the gradient computed with every product and sum in absolute value (float64), the scale
of float32 rounding in it (``gradient_magnitudes``). The term covers what any kernel that
recomputes ``P`` from a stored float32 LSE pays and PyTorch's path does not: ``P`` carries a
relative error of about ``eps(float32) x |lse|`` (the rounding of the LSE itself), and ``dS = P
(dP - delta)`` cancels terms of size ``|dO| |v|``. It matters only in float32 (at fp16/bf16 it
is far below PyTorch's own error); there it is what lets a 1 x 1 problem, whose dq/dk PyTorch
gets exactly 0, and logits in the hundreds pass.

dsinks takes ``2 x eps(dtype) x max |M_sink|`` instead, with ``M_sink = sqrt(sum_i p_sink_i^2
sum_d dO_id^2 (P |V|)_id^2)``: its ``delta = dO . out`` uses the stored output, rounded to the
dtype with an error that scales with ``P |V|`` (FlashAttention's backward does the same), where
PyTorch's path differentiates through ``P`` and ``V`` and never rounds the output. Those
roundings are independent, so they add in quadrature; a sum over rows of both signs cancels to
far less than its terms, and the relative error of a small dsink reaches ~1% in fp16.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

import flashkernel
from flashkernel import reference
from flashkernel.kernels import backward
from flashkernel.kernels.backward import BackwardConfig, attention_backward
from flashkernel.kernels.tuning import TileConfig
import test_variants
from helpers import DEVICE, ON_GPU, describe_mismatch, random_qkv

# The interpreter turns tensor loop bounds into ints through a numpy conversion numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

CPU_DTYPES = (torch.float16, torch.float32)
GPU_DTYPES = (torch.float16, torch.bfloat16)
GRAD_NAMES = ("dq", "dk", "dv", "dsinks")
# Unequal, small tiles: many tiles per program, so every masked / unmasked run is visited.
SMALL_TILES = BackwardConfig(TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1), 16, None)


# ---- the wiring: forward, then the backward kernels; and the reference's autograd -------------


def kernel_grads(q, k, v, dout, *, causal=False, softmax_scale=None, varlen=None, config=None, backend="auto",
                 deterministic=False, **variant):
    """``(dq, dk, dv, dsinks)`` from the forward's ``out``/``lse`` and ``attention_backward``.

    ``varlen`` is ``(cu_seqlens_q, cu_seqlens_k)`` for packed inputs; ``backend`` and
    ``deterministic`` go to ``attention_backward``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if varlen is None:
        out, lse = flashkernel.flash_attn_func(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, **variant)
        packed = {}
    else:
        cu_q, cu_k = varlen
        max_q, max_k = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
        out, lse = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                      softmax_scale=scale, return_lse=True, **variant)
        packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    dsinks = attention_backward(dout, q, k, v, out, lse, *grads, causal=causal, softmax_scale=scale, config=config,
                                backend=backend, deterministic=deterministic, **packed, **variant)
    return (*grads, dsinks)


def reference_grads(q, k, v, dout, *, upcast, causal=False, softmax_scale=None, varlen=None, **variant):
    """``(dq, dk, dv, dsinks)`` by autograd through the reference: float64 (``upcast``) or
    PyTorch's math path in the inputs' dtype (sinks in float32)."""
    dtype = torch.float64 if upcast else q.dtype
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    if variant.get("sinks") is not None:
        sinks = variant["sinks"].detach().to(torch.float64 if upcast else torch.float32).requires_grad_()
        variant = dict(variant, sinks=sinks)
        leaves.append(sinks)
    if varlen is None:
        out, _ = reference.attention(*leaves[:3], causal=causal, softmax_scale=softmax_scale, upcast=upcast,
                                     **variant)
    else:
        out, _ = reference.attention_varlen(*leaves[:3], *varlen, causal=causal, softmax_scale=softmax_scale,
                                            upcast=upcast, **variant)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
    return (*grads[:3], grads[3] if len(grads) > 3 else None)


def gradient_magnitudes(q, k, v, dout, *, causal=False, softmax_scale=None, varlen=None, **variant):
    """``(M_dq, M_dk, M_dv, M_dsinks)`` and ``max |lse|``: the gradients with every product and
    sum in absolute value, in float64 (``P`` from the reference through one-hot values)."""
    if varlen is not None:
        return _varlen_magnitudes(q, k, v, dout, varlen, causal=causal, softmax_scale=softmax_scale, **variant)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    batch, seqlen_k, num_kv_heads = k.shape[:3]
    num_heads = q.shape[2]
    q, k, v, dout = (x.double() for x in (q, k, v, dout))
    one_hot = torch.eye(seqlen_k, dtype=torch.float64, device=q.device)[None, :, None].expand(
        batch, seqlen_k, num_kv_heads, seqlen_k)
    probs, lse = reference.attention(q, k, one_hot, causal=causal, softmax_scale=scale, **variant)  # [B, Sq, Hq, Sk]
    out, _ = reference.attention(q, k, v, causal=causal, softmax_scale=scale, **variant)
    k_abs, v_abs = (reference.expand_kv_heads(x.abs(), num_heads) for x in (k, v))
    delta_abs = (dout.abs() * out.abs()).sum(-1)  # [B, Sq, Hq]
    ds_abs = probs * (torch.einsum("bqhd,bkhd->bqhk", dout.abs(), v_abs) + delta_abs[..., None])

    def per_kv_head(x):  # [B, Sk, Hq, D] -> [B, Sk, Hkv, D]: GQA sums over the group
        return x.view(batch, seqlen_k, num_kv_heads, -1, x.shape[-1]).sum(3)

    mags = [scale * torch.einsum("bqhk,bkhd->bqhd", ds_abs, k_abs),
            per_kv_head(scale * torch.einsum("bqhk,bqhd->bkhd", ds_abs, q.abs())),
            per_kv_head(torch.einsum("bqhk,bqhd->bkhd", probs, dout.abs()))]
    sinks = variant.get("sinks")
    if sinks is not None:
        # delta comes from the stored output, whose error scales with P |V|, not with |out|;
        # independent roundings add in quadrature.
        out_terms = torch.einsum("bqhk,bkhd->bqhd", probs, v_abs)
        p_sink = torch.exp(sinks.double()[None, :, None] - lse).nan_to_num(0.0)  # [B, Hq, Sq]
        squares = (p_sink ** 2 * (dout ** 2 * out_terms ** 2).sum(-1).transpose(1, 2)).sum((0, 2))
        mags.append(squares.sqrt())
    else:
        mags.append(None)
    finite = lse[torch.isfinite(lse)]
    return mags, finite.abs().max().item() if finite.numel() else 0.0


def _varlen_magnitudes(q, k, v, dout, varlen, *, alibi_slopes=None, **kwargs):
    """:func:`gradient_magnitudes` sequence by sequence (packed layout)."""
    cu_q, cu_k = ([int(x) for x in cu] for cu in varlen)
    mags = [torch.zeros(x.shape, dtype=torch.float64, device=x.device) for x in (q, k, v)]
    mags.append(torch.zeros_like(kwargs["sinks"], dtype=torch.float64) if kwargs.get("sinks") is not None else None)
    lse_max = 0.0
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        seq, seq_lse = gradient_magnitudes(q[None, rows], k[None, keys], v[None, keys], dout[None, rows],
                                           alibi_slopes=slopes, **kwargs)
        mags[0][rows] += seq[0][0]
        mags[1][keys] += seq[1][0]
        mags[2][keys] += seq[2][0]
        if mags[3] is not None:
            mags[3] = (mags[3] ** 2 + seq[3] ** 2).sqrt()
        lse_max = max(lse_max, seq_lse)
    return mags, lse_max


def assert_grad_close(name, mine, truth, torch_grad, dtype, magnitude, lse_max):
    """The bound of the module docstring for one gradient (dsinks: with its own floor)."""
    assert not torch.isnan(mine).any(), f"{name}: NaN in {int(torch.isnan(mine).sum())} elements"
    assert mine.shape == truth.shape, f"{name}: shape {tuple(mine.shape)} != {tuple(truth.shape)}"
    if mine.numel() == 0:
        return
    err = (mine.double() - truth).abs()
    torch_err = (torch_grad.double() - truth).abs()
    rounding = 2 * torch.finfo(dtype).eps if name == "dsinks" else 2 * torch.finfo(torch.float32).eps * (1 + lse_max)
    floor = torch.finfo(dtype).eps * max(1.0, truth.abs().max().item()) + rounding * magnitude.max().item()
    max_bound = 2 * torch_err.max().item() + floor
    assert err.max().item() <= max_bound, f"{name}: {describe_mismatch(err, max_bound)}"
    if name == "dsinks":
        return  # one value per head: the mean says nothing the max does not
    mean_bound = 2 * torch_err.mean().item() + floor / 8
    assert err.mean().item() <= mean_bound, f"{name}: mean error {err.mean().item():.3e} > {mean_bound:.3e}"


def check_grads(q, k, v, dout=None, **kwargs):
    """Run the kernels and assert every gradient is within the error bound; returns them."""
    dout = torch.randn_like(q) if dout is None else dout
    ours = kernel_grads(q, k, v, dout, **kwargs)
    for name in ("config", "backend", "deterministic"):
        kwargs.pop(name, None)
    truth = reference_grads(q, k, v, dout, upcast=True, **kwargs)
    torch_grads = reference_grads(q, k, v, dout, upcast=False, **kwargs)
    magnitudes, lse_max = gradient_magnitudes(q, k, v, dout, **kwargs)
    for name, mine, true, theirs, magnitude in zip(GRAD_NAMES, ours, truth, torch_grads, magnitudes):
        if true is None:
            assert mine is None, f"{name}: expected None"
            continue
        assert mine.dtype == (torch.float32 if name == "dsinks" else q.dtype), f"{name} dtype {mine.dtype}"
        assert_grad_close(name, mine, true, theirs, q.dtype, magnitude, lse_max)
    return ours


def run_dense(batch, seqlen_q, seqlen_k, heads, head_dim, dtype, *, scale_q=1.0, **kwargs):
    num_heads, num_kv_heads = heads
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, dtype)
    q = (q.float() * scale_q).to(dtype)
    return q, k, v, check_grads(q, k, v, **kwargs)


def variant_kwargs(names, batch: int, num_heads: int, window=(23, 5)) -> dict:
    """``test_variants``' variant keywords, with "alibi" always ``[Hq]`` slopes and "alibi_batch"
    per-sequence ``[B, Hq]`` ones."""
    kwargs = test_variants.variant_kwargs([n for n in names if not n.startswith("alibi")], batch, num_heads, window)
    if "alibi" in names:
        kwargs["alibi_slopes"] = test_variants.alibi_slopes(num_heads)
    if "alibi_batch" in names:
        kwargs["alibi_slopes"] = test_variants.alibi_slopes(num_heads, batch)
    return kwargs


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def run_varlen(lengths_q, lengths_k, heads, head_dim, dtype, **kwargs):
    num_heads, num_kv_heads = heads
    q = torch.randn(sum(lengths_q), num_heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(sum(lengths_k), num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    return check_grads(q, k, v, varlen=(cu_seqlens(lengths_q), cu_seqlens(lengths_k)), **kwargs)


# ---- plain attention: lengths, dtypes, GQA, head dims ----------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k",
                         [(1, 1, 1), (2, 17, 17), (2, 45, 77), (1, 77, 45), (1, 1, 50), (1, 64, 64)])
def test_plain(batch, seqlen_q, seqlen_k, causal, dtype):
    run_dense(batch, seqlen_q, seqlen_k, (4, 2), 64, dtype, causal=causal)


def test_bfloat16_interpreted():
    """bf16 runs its dots in fp32 in the interpreter (``dot_flags``); the GPU tests cover it fully."""
    run_dense(1, 33, 40, (2, 1), 64, torch.bfloat16, causal=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(3, 3), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa8"])
def test_gqa(heads, causal):
    run_dense(1, 40, 50, heads, 32, torch.float16, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [8, 72, 128])
def test_head_dims(head_dim, causal):
    run_dense(1, 37, 45, (2, 1), head_dim, torch.float16, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(70, 100), (100, 70), (16, 112)])
def test_small_tiles(seqlen_q, seqlen_k, causal):
    """Many tiles per program with BLOCK_M != BLOCK_N: masked and unmasked runs all visited."""
    run_dense(1, seqlen_q, seqlen_k, (2, 1), 32, torch.float32, causal=causal, config=SMALL_TILES)


@pytest.mark.parametrize("group_split", [1, 2, 4])
def test_group_split(group_split):
    """dK/dV with each KV head's 4 query heads over 1, 2 or 4 programs (float32 slices summed)."""
    config = BackwardConfig(SMALL_TILES.dkdv, SMALL_TILES.dq, 16, group_split)
    run_dense(2, 37, 50, (8, 2), 32, torch.float16, causal=True, config=config)


def test_pick_group_split(monkeypatch):
    """Split a group only while the grid has fewer than two programs per SM (132 SMs here)."""
    monkeypatch.setattr(backward, "cuda_properties", lambda device: types.SimpleNamespace(multi_processor_count=132))
    assert backward.pick_group_split(8, 1000, None, interpreted=False) == 1
    assert backward.pick_group_split(32, 33, None, interpreted=False) == 8  # 33 * 8 >= 264
    assert backward.pick_group_split(32, 9, None, interpreted=False) == 32  # never enough: whole group
    assert backward.pick_group_split(6, 50, None, interpreted=False) == 6  # divisors only
    assert backward.pick_group_split(8, 1, None, interpreted=True) == 1


def test_group_split_must_divide_the_group():
    q, k, v = random_qkv(1, 8, 8, 4, 1, 16, torch.float32)
    config = BackwardConfig(SMALL_TILES.dkdv, SMALL_TILES.dq, 16, 3)
    with pytest.raises(ValueError, match="group_split=3 must divide the GQA group size 4"):
        kernel_grads(q, k, v, torch.randn_like(q), config=config)


# ---- variants ---------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (1, 0), (19, 7), (-1, 5), (40, -1), (200, 200)])
def test_window(window, causal):
    run_dense(1, 77, 101, (4, 2), 32, torch.float16, causal=causal, window_size=window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(101, 77), (1, 90)])
def test_window_lengths(seqlen_q, seqlen_k, causal):
    run_dense(2, seqlen_q, seqlen_k, (2, 1), 32, torch.float16, causal=causal, window_size=(13, 2))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["softcap", "alibi", "alibi_batch", "sinks"])
def test_single_variant(name, causal, dtype):
    run_dense(2, 45, 70, (4, 1), 64, dtype, causal=causal, **variant_kwargs([name], 2, 4))


PAIRS = [("window", "softcap"), ("window", "alibi"), ("window", "sinks"), ("softcap", "alibi"),
         ("softcap", "sinks"), ("alibi_batch", "sinks")]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_pairs(pair, causal):
    run_dense(2, 66, 50, (4, 2), 72, torch.float16, causal=causal, **variant_kwargs(pair, 2, 4))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_all_variants_together(causal, dtype):
    names = ("window", "softcap", "alibi", "sinks")
    run_dense(1, 70, 97, (6, 2), 64, dtype, causal=causal, **variant_kwargs(names, 1, 6))


# ---- extreme logits, rows that see nothing ----------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits(causal, dtype):
    """Scores with a standard deviation of ~100: the softmax is nearly one-hot per row."""
    run_dense(1, 50, 60, (2, 1), 64, dtype, causal=causal, softmax_scale=1.0, scale_q=12.0)


@pytest.mark.parametrize("scale", [1e8, 1e12])
def test_huge_scales_give_finite_gradients(scale):
    """Scales past the usual (``_common.exponent_options``): the recomputed exponent ``s - lse``
    can exceed 0 by an ulp of scores near 1e13, which overflowed exp2 into inf and NaN gradients
    (float32 here; the accuracy of such gradients falls with the scores' magnitude, so only
    finiteness and the forward are checked)."""
    q, k, v = random_qkv(1, 24, 40, 2, 1, 32, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flashkernel.flash_attn_func(q, k, v, causal=True, softmax_scale=scale)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all()
    for name, grad in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(grad).all(), f"{name} has {int((~torch.isfinite(grad)).sum())} non-finite values"


@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_softcap_saturated(softcap):
    """|scale * q.k| in the hundreds: tanh is +-1 and its derivative 0, exactly, never NaN."""
    run_dense(1, 40, 64, (2, 1), 64, torch.float16, causal=True, scale_q=12.0, softcap=softcap)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("case", ["causal_sq_gt_sk", "window_0_0"])
def test_rows_without_keys(case, sinks):
    """Rows that see no key get zero gradient (and no NaN anywhere), with or without a sink."""
    if case == "causal_sq_gt_sk":
        seqlen_q, seqlen_k, kwargs = 70, 20, dict(causal=True)  # rows 0..49 see nothing
        blind = torch.arange(70) < 50
    else:
        seqlen_q, seqlen_k, kwargs = 40, 20, dict(window_size=(0, 0))  # row i sees key i - 20
        blind = torch.arange(40) < 20
    if sinks:
        kwargs["sinks"] = torch.randn(2, device=DEVICE)
    _, _, _, (dq, _, _, _) = run_dense(1, seqlen_q, seqlen_k, (2, 2), 32, torch.float16, **kwargs)
    assert (dq[:, blind.to(dq.device)] == 0).all()


def test_sink_of_minus_infinity_is_no_sink():
    sinks = torch.tensor([float("-inf"), 0.5], device=DEVICE)
    q, k, v = random_qkv(1, 30, 40, 2, 1, 32, torch.float32)
    dout = torch.randn_like(q)
    dq, dk, dv, dsinks = kernel_grads(q, k, v, dout, causal=True, sinks=sinks)
    assert dsinks[0] == 0 and torch.isfinite(dsinks).all()
    truth = reference_grads(q[:, :, :1], k, v, dout[:, :, :1], upcast=True, causal=True)
    torch.testing.assert_close(dq[:, :, :1].double(), truth[0], atol=1e-5, rtol=1e-5)


# ---- packed sequences -------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("names", [(), ("window",), ("alibi_batch",), ("sinks",), ("softcap",)],
                         ids=["plain", "window", "alibi", "sinks", "softcap"])
def test_varlen(names, causal):
    lengths_q, lengths_k = [5, 0, 40, 33, 1], [7, 3, 40, 0, 50]
    run_varlen(lengths_q, lengths_k, (4, 2), 64, torch.float16, causal=causal,
               **variant_kwargs(names, len(lengths_q), 4, window=(5, 2)))


def test_varlen_float32_small_tiles():
    run_varlen([17, 70, 0, 3], [17, 33, 9, 100], (2, 1), 32, torch.float32, causal=True, config=SMALL_TILES)


def test_varlen_group_split():
    config = BackwardConfig(SMALL_TILES.dkdv, SMALL_TILES.dq, 16, 2)
    run_varlen([20, 0, 45], [30, 12, 45], (4, 1), 32, torch.float16, causal=True, config=config)


# ---- layouts, empty inputs, determinism --------------------------------------------------------


def test_strided_inputs_and_outputs():
    """Transposed q/k/v views, a dout broadcast over the batch, and a dq whose last dim is
    strided (written through a temporary)."""
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in random_qkv(2, 33, 41, 4, 2, 32, torch.float16))
    dout = torch.randn(1, 33, 4, 32, dtype=torch.float16, device=DEVICE).expand(2, -1, -1, -1)
    checked = check_grads(q, k, v, dout, causal=True)
    strided_dq = torch.full((32, 2, 33, 4), float("nan"), dtype=torch.float16, device=DEVICE).permute(1, 2, 3, 0)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    attention_backward(dout, q, k, v, out, lse, strided_dq, dk, dv, causal=True, softmax_scale=32 ** -0.5)
    for mine, expected in zip((strided_dq, dk, dv), checked):
        assert torch.equal(mine, expected)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 5), (5, 0)])
def test_empty_sequences(seqlen_q, seqlen_k):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2, 1, 16, torch.float16)
    dq, dk, dv, dsinks = kernel_grads(q, k, v, torch.randn_like(q), sinks=torch.randn(2, device=DEVICE))
    for grad in (dq, dk, dv, dsinks):
        assert (grad == 0).all()


def test_varlen_without_queries():
    """Every query sequence empty: dK/dV are zero (their keys are never seen)."""
    q = torch.randn(0, 2, 16, dtype=torch.float16, device=DEVICE)
    k = torch.randn(9, 1, 16, dtype=torch.float16, device=DEVICE)
    v = torch.randn_like(k)
    grads = kernel_grads(q, k, v, torch.randn_like(q), varlen=(cu_seqlens([0, 0]), cu_seqlens([4, 5])))
    assert grads[0].shape == q.shape and (grads[1] == 0).all() and (grads[2] == 0).all()


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_launch_chunks(layout, monkeypatch):
    """Batches beyond a grid axis (dense) or ``MAX_VARLEN_SEQS`` sequences (packed) run in chunks;
    shrunk to 2 here so a small case crosses chunk boundaries (per-sequence slopes and sinks too)."""
    monkeypatch.setattr(backward, "MAX_GRID_YZ", 2)
    monkeypatch.setattr(backward, "MAX_VARLEN_SEQS", 2)
    kwargs = variant_kwargs(("alibi_batch", "sinks"), 5, 2)
    if layout == "dense":
        run_dense(5, 20, 33, (2, 1), 32, torch.float16, causal=True, **kwargs)
    else:
        run_varlen([3, 0, 20, 7, 1], [5, 4, 20, 0, 30], (2, 1), 32, torch.float16, causal=True, **kwargs)


def test_deterministic():
    """No atomics: repeated runs are bitwise equal, and ``deterministic=True`` changes nothing."""
    q, k, v = random_qkv(1, 50, 50, 4, 2, 32, torch.float16)
    dout = torch.randn_like(q)
    kwargs = variant_kwargs(("sinks",), 1, 4)
    first = kernel_grads(q, k, v, dout, causal=True, **kwargs)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=True, return_lse=True, **kwargs)
    again = [torch.empty_like(x) for x in (q, k, v)]
    dsinks = attention_backward(dout, q, k, v, out, lse, *again, causal=True, softmax_scale=32 ** -0.5,
                                deterministic=True, **kwargs)
    for a, b in zip(first, (*again, dsinks)):
        assert torch.equal(a, b)


def test_backend_argument():
    """"triton" is what "auto" runs at this length (bit for bit); "gluon" runs on Hopper and is
    refused with the reason elsewhere (the interpreter, other GPUs) and with deterministic=True;
    a bad name or type is refused by name."""
    q, k, v = random_qkv(1, 40, 40, 2, 1, 64, torch.float16)
    dout = torch.randn_like(q)
    auto = kernel_grads(q, k, v, dout, causal=True)
    forced = kernel_grads(q, k, v, dout, causal=True, backend="triton")
    for a, b in zip(auto[:3], forced[:3]):
        assert torch.equal(a, b)
    hopper = ON_GPU and torch.cuda.get_device_capability(q.device) == (9, 0)
    if hopper:  # the Triton kernels' gradients within fp16 rounding (accuracy: the *_gpu tests below)
        triton_grads = kernel_grads(q, k, v, dout, backend="triton")
        for a, b in zip(kernel_grads(q, k, v, dout, backend="gluon")[:3], triton_grads[:3]):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)
    else:
        needs = "a Hopper GPU" if ON_GPU else "a CUDA GPU"
        with pytest.raises(ValueError, match=f"backend='gluon' cannot run this call: it needs {needs}"):
            kernel_grads(q, k, v, dout, backend="gluon")
    with pytest.raises(ValueError, match="deterministic=True needs the Triton kernels"):
        kernel_grads(q, k, v, dout, backend="gluon", deterministic=True)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'gluon', got 'cudnn'"):
        kernel_grads(q, k, v, dout, backend="cudnn")
    with pytest.raises(TypeError, match="backend must be a string"):
        kernel_grads(q, k, v, dout, backend=None)


def test_gluon_backward_supported_tensors():
    """The Gluon kernel's tensor check (metadata only): dK/dV leave by TMA stores, so they must be
    TMA-ready like the inputs; dq needs only a contiguous last dim (a cast kernel writes it)."""
    from flashkernel.kernels.gluon import backward as gluon_backward

    q = torch.empty(2, 100, 4, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 90, 2, 64, dtype=torch.bfloat16)
    grads = lambda: [torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)]  # noqa: E731
    assert gluon_backward.supported(q, k, k, q, *grads())
    shifted = torch.empty(2 * 90 * 2 * 64 + 1, dtype=torch.bfloat16)[1:].view(k.shape)  # 2-byte aligned
    for i in (1, 2):
        bad = grads()
        bad[i] = shifted
        assert not gluon_backward.supported(q, k, k, q, *bad)
    dq_strided = torch.empty(2, 100, 4, 72, dtype=torch.bfloat16)[..., :64]  # rows of 144 bytes
    assert gluon_backward.supported(q, k, k, q, dq_strided, *grads()[1:])
    dq_columns = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim of stride 4
    assert not gluon_backward.supported(q, k, k, q, dq_columns, *grads()[1:])


@pytest.mark.parametrize("head_dim, causal, seqlen_k, programs, wanted", [
    (64, False, 1024, 132, True), (64, False, 1023, 132, False), (64, False, 1024, 131, False),
    (64, True, 1024, 200, True), (64, True, 1000, 200, False), (128, False, 1024, 200, True),
    (128, False, 512, 200, False), (128, True, 1024, 200, True), (128, True, 1000, 200, False),
    (128, True, 16384, 100, False),
    (256, False, 16384, 200, False), (96, True, 16384, 200, False)])
def test_gluon_backward_rule(head_dim, causal, seqlen_k, programs, wanted):
    from flashkernel.kernels import dispatch

    assert dispatch.gluon_backward_wanted(head_dim, causal, seqlen_k, programs, 132) is wanted


def test_config_table_covers_every_head_dim():
    for block_d in (16, 32, 64, 128, 256):
        for table in (backward.CONFIGS, backward.FLOAT32_CONFIGS):
            config = table[block_d]
            assert config.dkdv.block_n % 16 == 0 and config.dq.block_m % 16 == 0
    assert backward.pick_config(72, torch.bfloat16, interpreted=False) is backward.CONFIGS[128]


# ---- GPU: full-size shapes ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "gluon"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (17, 17), (4097, 4097), (1000, 4097), (4097, 1000)])
def test_full_grid_gpu(seqlen_q, seqlen_k, head_dim, causal, dtype, backend):
    """Every shape edge on the kernels "auto" picks (mostly Triton's at these sizes) and on the
    Gluon kernel forced (head dims 64 and 128)."""
    if backend == "gluon" and head_dim not in (64, 128):
        pytest.skip("the Gluon backward has head dims 64 and 128")
    run_dense(1, seqlen_q, seqlen_k, (4, 2), head_dim, dtype, causal=causal, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "gluon"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (32, 4), (32, 1)], ids=["mha", "gqa4", "gqa8", "mqa32"])
def test_gqa_gpu(heads, dtype, backend):
    """Includes groups split over several dK/dV programs (few key tiles per KV head; Triton's)
    and whole groups in one program (Gluon's)."""
    run_dense(2, 1031, 1031, heads, 128, dtype, causal=True, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_backward_rows_past_the_tiles_gpu(head_dim, causal):
    """Several batches and heads whose rows and keys end inside a tile (Sq != Sk), so every
    descriptor bound (loads zero-filled, dK/dV stores dropping rows past Sk), the dQ cast's mask
    and the +inf LSE of a row past the end are exercised; rows that see no key (causal, Sq > Sk)
    get zero gradients."""
    run_dense(3, 333, 200, (6, 3), head_dim, torch.bfloat16, causal=causal, backend="gluon")
    run_dense(2, 200, 333, (4, 4), head_dim, torch.float16, causal=causal, backend="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_backward_many_tiles_per_program_gpu(head_dim, programs, causal, monkeypatch):
    """The Gluon backward runs persistent programs that take tiles from a counter: with the grid
    cut to a few programs, each takes many tiles of several heads and batches (the K/V reload
    after the previous tile's products, the dK/dV stores staged under the next tile's loads, the
    ring and barrier phases carried across tiles), including GQA groups and tiles that end past
    Sk."""
    from flashkernel.kernels.gluon import backward as gluon_backward

    monkeypatch.setattr(gluon_backward, "num_sms", lambda device: programs)
    run_dense(3, 333, 200, (6, 3), head_dim, torch.bfloat16, causal=causal, backend="gluon")
    run_dense(2, 200, 461, (8, 2), head_dim, torch.float16, causal=causal, backend="gluon")


@pytest.mark.gpu
def test_gluon_backward_calls_replayed_through_autograd_gpu():
    """``loss.backward()`` of ``flash_attn_func`` at a shape "auto" runs on the Gluon kernel,
    three times: the calls after the first replay the recorded launches, whose float32 dQ buffer
    must start at zero every time (the row statistics' pass zeroes it), so each call's gradients
    match the Triton kernels' within bf16 rounding."""
    q, k, v = random_qkv(1, 4096, 4096, 16, 16, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    expected = kernel_grads(q, k, v, dout, backend="triton")[:3]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    for _ in range(3):
        out = flashkernel.flash_attn_func(*leaves)
        grads = torch.autograd.grad(out, leaves, dout)
        for name, got, want in zip("qkv", grads, expected):
            diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert diff < 2e-2, f"d{name}: relative difference {diff:.3e} to the Triton kernels"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, dlse_layout", [(64, "contiguous"), (128, "contiguous"), (128, "rows outer"),
                                                   (64, "one per head")])
def test_gluon_backward_with_lse_gradient_gpu(head_dim, dlse_layout):
    """A gradient into the returned LSE (``dlse``, contiguous or not: rows as the outer dim, or
    one value per head expanded over the rows) enters the Gluon kernel's row statistics: its
    gradients of ``(out * dout + lse * dlse).sum()`` are as close to float64 autograd as the
    Triton kernels' (rows past ``Sq`` and keys past ``Sk`` inside the last tiles)."""
    q, k, v = random_qkv(2, 300, 333, 4, 2, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    scale = head_dim ** -0.5
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
    batch, heads, rows = lse.shape
    dlse = {"contiguous": lambda: torch.randn_like(lse),
            "rows outer": lambda: torch.randn(rows, batch, heads, device=DEVICE).permute(1, 2, 0),
            "one per head": lambda: torch.randn(batch, heads, 1, device=DEVICE).expand(batch, heads, rows)}[dlse_layout]()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference.attention(*leaves, causal=True, softmax_scale=scale)
    want = torch.autograd.grad((ref_out * dout.double()).sum() + (ref_lse * dlse.double()).sum(), leaves)
    errors = {}
    for backend in ("triton", "gluon"):
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        attention_backward(dout, q, k, v, out, lse, *grads, causal=True, softmax_scale=scale, dlse=dlse,
                           backend=backend)
        errors[backend] = [((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(grads, want)]
    for name, mine, triton in zip("qkv", errors["gluon"], errors["triton"]):
        assert mine <= 2 * triton + 1e-3, f"d{name}: relative error {mine:.3e}, Triton kernels {triton:.3e}"


@pytest.mark.gpu
def test_gluon_backward_strided_gradients_gpu():
    """dK/dV leave by TMA stores through descriptors of the gradients' own strides: TMA-ready
    views of ``[B, H, S, D]`` storage as ``[B, S, H, D]`` get the dK/dV of contiguous gradients
    bit for bit, and the same dQ within its arrival-order sums."""
    q, k, v = random_qkv(2, 333, 333, 4, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    scale = 128 ** -0.5
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
    plain = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    strided = [torch.full((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), float("nan"), dtype=x.dtype,
                          device=DEVICE).transpose(1, 2) for x in (q, k, v)]
    for grads in (plain, strided):
        attention_backward(dout, q, k, v, out, lse, *grads, causal=True, softmax_scale=scale, backend="gluon")
    assert torch.equal(strided[1], plain[1]) and torch.equal(strided[2], plain[2])
    diff = ((strided[0].float() - plain[0].float()).abs().max() / plain[0].float().abs().max()).item()
    assert diff < 1e-2, f"dq: relative difference {diff:.3e}"


def test_gluon_row_statistics_kernel():
    """The Gluon backward's row statistics (run by the interpreter here): ``lse * log2 e`` with
    ``-inf`` read as ``+inf``, ``rowsum(dO * out) - dlse``, and ``+inf`` / 0 in the padded rows;
    the float32 dQ accumulator zeroed, padded rows included, and the tile counter zeroed."""
    from flashkernel.kernels.gluon import backward as gluon_backward

    batch, seqlen, heads, head_dim, sq_pad = 2, 70, 3, 64, 128
    out = torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=torch.float16)
    dout = torch.randn_like(out)
    lse = torch.randn(batch, heads, seqlen, device=DEVICE)
    lse[0, 1, 5] = float("-inf")
    dlse = torch.randn_like(lse)
    for grad_lse in (None, dlse):
        stats = torch.full((batch * heads, 2, sq_pad), float("nan"), device=DEVICE)
        acc = torch.full((batch, heads, sq_pad, head_dim), float("nan"), device=DEVICE)
        counter = torch.full((1,), 12345, dtype=torch.int32, device=DEVICE)
        gluon_backward._launch_stats(
            (sq_pad // 64, heads, batch), out, dout, lse, lse if grad_lse is None else grad_lse, stats, acc, counter,
            out.stride()[:3], dout.stride()[:3], lse.stride(), lse.stride(), seqlen, heads, sq_pad, HEAD_DIM=head_dim,
            BLOCK=64, HAS_DLSE=grad_lse is not None, num_warps=4, num_stages=1)
        delta = (out.float() * dout.float()).sum(-1).transpose(1, 2)
        if grad_lse is not None:
            delta = delta - grad_lse
        want_lse = torch.where(lse == float("-inf"), float("inf"), lse) * math.log2(math.e)
        stats = stats.view(batch, heads, 2, sq_pad)
        torch.testing.assert_close(stats[:, :, 0, :seqlen], want_lse, rtol=1e-6, atol=0)
        torch.testing.assert_close(stats[:, :, 1, :seqlen], delta, rtol=1e-5, atol=1e-5)
        assert (stats[:, :, 0, seqlen:] == float("inf")).all() and (stats[:, :, 1, seqlen:] == 0).all()
        assert (acc == 0).all()
        assert counter.item() == 0


@pytest.mark.gpu
def test_gluon_backward_extreme_logits_gpu():
    run_dense(1, 2000, 2000, (4, 4), 128, torch.bfloat16, causal=True, softmax_scale=1.0, scale_q=12.0,
              backend="gluon")


@pytest.mark.gpu
def test_auto_takes_the_gluon_backward_at_long_keys_gpu():
    """At the sweep's 16k-token shapes "auto" runs the Gluon kernel unless determinism is asked
    for: ``deterministic=True`` and ``torch.use_deterministic_algorithms`` keep the Triton kernels,
    whose gradients repeat bit for bit."""
    from flashkernel.kernels import dispatch

    q, k, v = random_qkv(1, 4096, 4096, 16, 16, 128, torch.bfloat16)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    choose = lambda deterministic: dispatch.backward_backend(  # noqa: E731
        "auto", q, k, v, torch.empty_like(q), grads, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, sinks=None, varlen=False, deterministic=deterministic, config=None)
    assert choose(False) == "gluon"
    assert choose(True) == "triton"
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            out = flashkernel.flash_attn_func(*leaves)
            runs.append(torch.autograd.grad(out, leaves, dout))
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_all_variants_gpu(causal, dtype):
    names = ("window", "softcap", "alibi_batch", "sinks")
    run_dense(2, 2049, 3001, (8, 2), 128, dtype, causal=causal, **variant_kwargs(names, 2, 8, window=(700, 64)))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_float32_gpu(head_dim):
    run_dense(1, 300, 517, (4, 2), head_dim, torch.float32, causal=True, **variant_kwargs(("softcap",), 1, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gpu(causal):
    lengths_q, lengths_k = [4097, 0, 1, 300, 2048], [4097, 17, 0, 700, 2048]
    run_varlen(lengths_q, lengths_k, (8, 2), 128, torch.bfloat16, causal=causal,
               **variant_kwargs(("alibi_batch", "sinks"), len(lengths_q), 8))


@pytest.mark.gpu
def test_extreme_logits_gpu():
    run_dense(1, 2000, 2000, (4, 4), 128, torch.bfloat16, causal=True, softmax_scale=1.0, scale_q=12.0)


@pytest.mark.gpu
def test_deterministic_gpu():
    """Bitwise equal over repeated runs at a size with many programs and a split GQA group."""
    q, k, v = random_qkv(1, 4097, 4097, 32, 1, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    first = kernel_grads(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(3):
        again = kernel_grads(q, k, v, dout, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first[:3], again[:3]))


@pytest.mark.gpu
def test_batch_beyond_grid_limit_gpu():
    """More batch elements than grid axis 2 takes (65535): launched in chunks."""
    run_dense(65537, 3, 5, (1, 1), 16, torch.float16, causal=True)


@pytest.mark.gpu
def test_recorded_call_replays_gpu():
    """Every launch and temporary of a backward call is recorded (``_launch.Recorder``): its
    replay with another ``dout`` gives the gradients a direct call gives, bit for bit (a split
    GQA group and sinks included, so all five kernels run)."""
    from flashkernel.kernels._launch import CallCache, allocate

    q, k, v = random_qkv(2, 300, 300, 8, 2, 128, torch.bfloat16)
    sinks = torch.randn(8, device=DEVICE)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_lse=True)
    table = backward.CONFIGS[128]
    config = BackwardConfig(table.dkdv, table.dq, table.delta_block_m, 2)

    def run(dout):
        grads = [allocate(x.shape, x.dtype, x.device) for x in (q, k, v)]
        dsinks = attention_backward(dout, q, k, v, out, lse, *grads, causal=True, softmax_scale=128 ** -0.5,
                                    sinks=sinks, config=config)
        return (*grads, dsinks)

    cache = CallCache()
    first_dout = torch.randn_like(q)
    cache.run("backward", (first_dout, q, k, v, out, lse, sinks), lambda: run(first_dout))
    replay = cache.get("backward")
    assert replay is not None
    dout = torch.randn_like(q)
    replayed = replay.run((dout, q, k, v, out, lse, sinks))
    for a, b in zip(replayed, run(dout)):
        assert torch.equal(a, b)
