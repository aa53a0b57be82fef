"""The three-kernel textbook baseline: each step alone with explicit index math, then composed."""

import pytest
import torch

import flashkernel
from flashkernel.kernels import naive
from helpers import DEVICE, DTYPES, assert_output_close, random_qkv


def nan_tensor(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 72])
def test_scores_step(head_dim, dtype):
    """S[b, h, i, j] = scale * sum_d q[b, i, h, d] * k[b, j, h // group, d]."""
    q, k, _ = random_qkv(2, 37, 70, 4, 2, head_dim, dtype)
    s = nan_tensor((2, 4, 37, 70), torch.float32)
    naive.scores(q, k, 0.125, s)
    k_per_q_head = k.double()[:, :, [h // 2 for h in range(4)]]
    expected = 0.125 * torch.einsum("bihd,bjhd->bhij", q.double(), k_per_q_head)
    torch.testing.assert_close(s.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 1500), (40, 9), (33, 33)])
def test_softmax_step(seqlen_q, seqlen_k, causal):
    """P[b, h, i, j] = exp(S - max) / sum over visible j (j <= i + Sk - Sq when causal)."""
    s = torch.randn(2, 3, seqlen_q, seqlen_k, device=DEVICE) * 4
    p = nan_tensor(s.shape, torch.float16)
    lse = nan_tensor((2, 3, seqlen_q), torch.float32)
    naive.softmax(s, causal, p, lse)
    s64 = s.double()
    if causal:
        i = torch.arange(seqlen_q, device=DEVICE)[:, None]
        j = torch.arange(seqlen_k, device=DEVICE)[None, :]
        s64 = s64.masked_fill(j > i + seqlen_k - seqlen_q, float("-inf"))
    expected_lse = torch.logsumexp(s64, -1)
    expected = torch.nan_to_num(torch.exp(s64 - expected_lse[..., None]), nan=0.0)
    torch.testing.assert_close(p.double(), expected, rtol=2e-3, atol=1e-3)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))
    finite = torch.isfinite(expected_lse)
    torch.testing.assert_close(lse.double()[finite], expected_lse[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pv_step(dtype):
    """out[b, i, h, d] = sum_j P[b, h, i, j] * v[b, j, h // group, d]."""
    p = torch.softmax(torch.randn(2, 4, 21, 75, device=DEVICE), -1).to(dtype)
    v = torch.randn(2, 75, 1, 72, dtype=dtype, device=DEVICE)
    out = nan_tensor((2, 21, 4, 72), dtype)
    naive.pv(p, v, out)
    expected = torch.einsum("bhij,bjd->bihd", p.double(), v.double()[:, :, 0])
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (17, 129), (129, 17), (100, 100)])
def test_composed_matches_reference(seqlen_q, seqlen_k, causal, dtype):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, dtype)
    out, lse = flashkernel.standard_attention(q, k, v, causal=causal, return_lse=True)
    assert_output_close(out, q, k, v, causal=causal, lse=lse)


def test_composed_empty_and_odd_head_dim():
    q, k, v = random_qkv(1, 30, 0, 2, 1, 200, torch.float16)
    out = flashkernel.standard_attention(q, k, v)
    assert torch.equal(out, torch.zeros_like(out))
    q, k, v = random_qkv(1, 30, 31, 2, 1, 200, torch.float16)
    assert_output_close(flashkernel.standard_attention(q, k, v, causal=True), q, k, v, causal=True)
