"""FLOP and byte formulas, checked by hand and against brute-force mask counts."""

import itertools

import pytest

from flashkernel import reference
from flashkernel.bench import formulas


@pytest.mark.parametrize("seqlen_q, seqlen_k", list(itertools.product([0, 1, 2, 3, 5, 8, 13], repeat=2)))
def test_visible_pairs_matches_the_reference_mask(seqlen_q, seqlen_k):
    brute = int(reference.causal_mask(seqlen_q, seqlen_k).sum())
    assert formulas.visible_pairs(seqlen_q, seqlen_k, causal=True) == brute
    assert formulas.visible_pairs(seqlen_q, seqlen_k, causal=False) == seqlen_q * seqlen_k


def test_visible_pairs_by_hand():
    # Sq = 2, Sk = 5: rows see 4 and 5 keys (the mask pictured in reference.py).
    assert formulas.visible_pairs(2, 5, causal=True) == 9
    # Sq = 5, Sk = 2: three rows see nothing, then 1 and 2 keys.
    assert formulas.visible_pairs(5, 2, causal=True) == 3
    # Sq == Sk: the triangle n (n + 1) / 2.
    assert formulas.visible_pairs(4, 4, causal=True) == 10
    assert formulas.visible_pairs(16384, 16384, causal=True) == 16384 * 16385 // 2
    assert formulas.visible_pairs(3, 7, causal=False) == 21


def test_attention_flops_by_hand():
    # B=2, H=3, D=8, Sq=Sk=4 causal: 10 pairs, 4 FLOPs per pair and dim.
    assert formulas.attention_flops(2, 3, 4, 4, 8, causal=True) == 4 * 2 * 3 * 8 * 10
    # FlashAttention's benchmark shape: 16k tokens, 2048 model dim, no mask.
    batch, heads, seqlen, dim = 8, 16, 2048, 128
    expected = 4 * batch * heads * seqlen**2 * dim
    assert formulas.attention_flops(batch, heads, seqlen, seqlen, dim, causal=False) == expected


def test_decode_bytes_by_hand():
    # B=2, L=10, Hq=4, Hkv=2, D=8, 2-byte elements:
    # K + V = 2 * 2 * 10 * 2 * 8 * 2 = 1280; Q + O = 2 * 2 * 1 * 4 * 8 * 2 = 256.
    assert formulas.decode_bytes(2, 10, 4, 2, 8, 2) == 1280 + 256
    assert formulas.attention_io_bytes(1, 3, 5, 2, 1, 4, 4) == (2 * 3 * 2 * 4 + 2 * 5 * 1 * 4) * 4


def test_model_decode_step_and_bound():
    # 7B-class attention: 32 layers, 8 KV heads of 128, bf16, one 4k-token sequence = 512 MiB.
    per_step = formulas.model_decode_bytes_per_step(32, 1, 4096, 8, 128, 2)
    assert per_step == 32 * 2 * 4096 * 8 * 128 * 2 == 512 * 2**20
    assert formulas.steps_per_second_bound(4800.0, per_step) == pytest.approx(4.8e12 / per_step)
    assert formulas.model_decode_bytes_per_step(32, 8, 4096, 8, 128, 2) == 8 * per_step


def test_units():
    assert formulas.tflops(10**12, 1000.0) == pytest.approx(1.0)
    assert formulas.gbps(10**9, 1.0) == pytest.approx(1000.0)
    assert formulas.arithmetic_intensity(100, 4) == 25


def test_dtype_bytes():
    assert formulas.dtype_bytes("bfloat16") == 2 and formulas.dtype_bytes("float32") == 4
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        formulas.dtype_bytes("int8")
