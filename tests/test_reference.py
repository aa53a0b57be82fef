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


# ---- variants ------------------------------------------------------------------------------------


def _rows(text: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in line.split()] for line in text.strip().splitlines()], dtype=torch.bool)


def test_window_masks_match_the_docstring_pictures():
    assert torch.equal(reference.window_mask(4, 6, (1, 0)), _rows("""
        0 1 1 0 0 0
        0 0 1 1 0 0
        0 0 0 1 1 0
        0 0 0 0 1 1"""))
    assert torch.equal(reference.window_mask(4, 6, (1, -1), causal=True), reference.window_mask(4, 6, (1, 0)))
    assert torch.equal(reference.window_mask(4, 6, (1, 1)), _rows("""
        0 1 1 1 0 0
        0 0 1 1 1 0
        0 0 0 1 1 1
        0 0 0 0 1 1"""))
    assert torch.equal(reference.window_mask(4, 6, (-1, 1)), _rows("""
        1 1 1 1 0 0
        1 1 1 1 1 0
        1 1 1 1 1 1
        1 1 1 1 1 1"""))
    assert torch.equal(reference.window_mask(4, 2, (0, 0)), _rows("""
        0 0
        0 0
        1 0
        0 1"""))


def test_causal_is_the_window_minus_one_zero():
    for sq, sk in ((3, 7), (7, 3), (5, 5)):
        assert torch.equal(reference.window_mask(sq, sk, (-1, 0)), reference.causal_mask(sq, sk))
        assert torch.equal(reference.window_mask(sq, sk, causal=True), reference.causal_mask(sq, sk))
        assert reference.window_mask(sq, sk).all()


def test_variants_element_by_element():
    """Every variant at once, written as a loop over (head, query) from the definitions."""
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 9, 2, 8, dtype=torch.float64) * 3
    v = torch.randn(2, 9, 2, 8, dtype=torch.float64)
    slopes = torch.rand(2, 4, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64)
    scale, cap, (left, right) = 0.4, 1.5, (2, 1)
    out, lse = reference.attention(q, k, v, softmax_scale=scale, window_size=(left, right), softcap=cap,
                                   alibi_slopes=slopes, sinks=sinks)
    for b in range(2):
        for h in range(4):
            for i in range(5):
                pos = i + 9 - 5
                keys = [j for j in range(9) if pos - left <= j <= pos + right]
                s = torch.stack([cap * torch.tanh(scale * q[b, i, h] @ k[b, j, h // 2] / cap)
                                 - slopes[b, h] * abs(pos - j) for j in keys])
                denominator = torch.exp(sinks[h]) + torch.exp(s).sum()
                expected = sum(torch.exp(s[n]) * v[b, j, h // 2] for n, j in enumerate(keys)) / denominator
                torch.testing.assert_close(out[b, i, h], expected)
                torch.testing.assert_close(lse[b, h, i], torch.log(denominator))


def test_alibi_bias_is_symmetric_around_the_diagonal():
    bias = reference.alibi_bias(torch.tensor([0.5]), 3, 5)[0]
    assert torch.equal(bias, torch.tensor([[-1.0, -0.5, 0.0, -0.5, -1.0],
                                           [-1.5, -1.0, -0.5, 0.0, -0.5],
                                           [-2.0, -1.5, -1.0, -0.5, 0.0]]))


def test_sink_only_rows():
    """No key at all: output 0 and LSE = sink; no key and no sink: 0 and -inf."""
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 0, 1, 8, dtype=torch.float64)
    out, lse = reference.attention(q, k, k, sinks=torch.tensor([0.5, -2.0], dtype=torch.float64))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse[0], torch.tensor([[0.5] * 3, [-2.0] * 3], dtype=torch.float64))
    out, lse = reference.attention(q, k, k)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_varlen_reference_is_attention_per_sequence():
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 9], dtype=torch.int32)
    q = torch.randn(10, 2, 8, dtype=torch.float64)
    k = torch.randn(9, 1, 8, dtype=torch.float64)
    v = torch.randn(9, 1, 8, dtype=torch.float64)
    slopes = torch.rand(3, 2, dtype=torch.float64)
    out, lse = reference.attention_varlen(q, k, v, cu, cu_k, causal=True, alibi_slopes=slopes)
    expected, expected_lse = reference.attention(q[None, :3], k[None, :4], v[None, :4], causal=True,
                                                 alibi_slopes=slopes[0])
    torch.testing.assert_close(out[:3], expected[0])
    torch.testing.assert_close(lse[:, :3], expected_lse[0])
    assert torch.equal(out[3:], torch.zeros_like(out[3:])) and torch.isneginf(lse[:, 3:]).all()  # no keys


def test_rows_are_the_full_computations_rows():
    """``rows=`` computes those query rows exactly as the full call does (their positions are
    the full ``Sq``'s), for every mask, ALiBi and sinks."""
    q = torch.randn(2, 9, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 13, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 13, 2, 8, dtype=torch.float64)
    rows = [0, 3, 4, 8]
    cases = [dict(causal=True), dict(window_size=(2, 1)), dict(causal=True, window_size=(3, -1), softcap=2.0),
             dict(alibi_slopes=torch.rand(2, 4, dtype=torch.float64), sinks=torch.randn(4, dtype=torch.float64))]
    for kwargs in cases:
        full_out, full_lse = reference.attention(q, k, v, **kwargs)
        out, lse = reference.attention(q, k, v, rows=rows, **kwargs)
        torch.testing.assert_close(out, full_out[:, rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, full_lse[:, :, rows], rtol=1e-12, atol=1e-12)
