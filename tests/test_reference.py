"""The reference is the spec: check it against independent formulations."""

import torch
import torch.nn.functional as F

from flashkernel import reference


def test_causal_mask_bottom_right_examples():
    expected_2x5 = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(reference.causal_mask(2, 5), expected_2x5)
    expected_5x2 = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(reference.causal_mask(5, 2), expected_5x2)


def test_matches_sdpa_in_float64():
    q = torch.randn(2, 9, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 9, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 9, 2, 16, dtype=torch.float64)
    for causal in (False, True):
        out, _ = reference.attention(q, k, v, causal=causal)
        sdpa = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
        ).transpose(1, 2)
        torch.testing.assert_close(out, sdpa, rtol=1e-12, atol=1e-12)


def test_explicit_loop_with_gqa_scale_and_lse():
    """Element by element: out[b, i, h] = sum_j softmax_j(scale * q.k_j) v_j, head h -> h // 3."""
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    k = torch.randn(1, 7, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 7, 2, 8, dtype=torch.float64)
    out, lse = reference.attention(q, k, v, causal=True, softmax_scale=0.3)
    for h in range(6):
        for i in range(4):
            visible = [j for j in range(7) if j <= i + 7 - 4]
            s = torch.stack([0.3 * q[0, i, h] @ k[0, j, h // 3] for j in visible])
            w = torch.softmax(s, 0)
            expected = sum(w[n] * v[0, j, h // 3] for n, j in enumerate(visible))
            torch.testing.assert_close(out[0, i, h], expected)
            torch.testing.assert_close(lse[0, h, i], torch.logsumexp(s, 0))


def test_rows_without_keys_are_zero_not_nan():
    q = torch.randn(1, 5, 1, 8)
    k = torch.randn(1, 2, 1, 8)
    out, lse = reference.attention(q, k, k, causal=True)
    assert torch.equal(out[0, :3], torch.zeros(3, 1, 8, dtype=torch.float64))
    assert torch.isneginf(lse[0, 0, :3]).all() and torch.isfinite(lse[0, 0, 3:]).all()
