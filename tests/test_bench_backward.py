"""The backward benchmark's shapes, FLOP formula and table (the timing itself needs a GPU)."""

import pytest
import torch

from flashkernel.bench import backward


def test_cases_follow_flash_attention_shapes():
    case = backward.Case(head_dim=128, causal=True, seqlen=4096)
    assert (case.batch, case.heads) == (4, 16)
    assert backward.Case(64, False, 16384).batch == 1
    assert len(backward.DEFAULT_SHAPES) == 12


def test_backward_flops_are_two_and_a_half_forwards():
    forward = 4 * 2 * 16 * 1024 * 1024 * 64
    assert backward.backward_flops(2, 16, 1024, 64, causal=False) == 2.5 * forward
    assert backward.backward_flops(2, 16, 1024, 64, causal=True) == 2.5 * forward / 2


def test_table_shows_ratios_and_errors():
    row = {"head_dim": 64, "causal": True, "seqlen": 1024, "batch": 16, "heads": 32,
           "flashkernel_tflops": 300.0, "sdpa-flash_tflops": 150.0, "sdpa-cudnn_error": "RuntimeError: no",
           "vs_sdpa-flash": 2.0, "max_rel_diff_vs_sdpa_flash": 1e-3}
    table = backward.format_rows([row])
    assert "2.00x" in table and "300.0" in table and "sdpa-cudnn: RuntimeError: no" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        backward.run_backward_bench(shapes=[(64, False, 1024)])
