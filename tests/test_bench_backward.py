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


def test_kernel_table_shows_each_kernels_share():
    row = {"head_dim": 128, "causal": False, "seqlen": 4096, "total_ms": 4.0,
           "kernels_ms": {"_delta_kernel": 0.04, "_dkdv_kernel": 2.4, "_dq_kernel": 1.56},
           "shares": {"_delta_kernel": 0.01, "_dkdv_kernel": 0.6, "_dq_kernel": 0.39}}
    table = backward.format_kernel_rows([row])
    assert "dkdv" in table and "2.400 (60%)" in table and "1.560 (39%)" in table and "sum" not in table


def test_training_tables_and_flops():
    from flashkernel.bench import training

    assert training.layer_flops(2, 16, 1024, 64, causal=False) == 3.5 * 4 * 2 * 16 * 1024 * 1024 * 64
    assert training.layer_flops(2, 16, 1024, 64, causal=True) == training.layer_flops(2, 16, 1024, 64, False) / 2
    layer = training.format_layer_rows([{"head_dim": 64, "causal": True, "seqlen": 1024, "flashkernel_tflops": 300.0,
                                         "sdpa-flash_tflops": 250.0, "sdpa-cudnn_error": "x", "vs_sdpa-flash": 1.2}])
    assert "300.0" in layer and "error" in layer and "1.20x" in layer
    model = training.format_model_rows([{"batch": 4, "seqlen": 4096, "flashkernel_ms": 290.0, "sdpa_ms": 280.0,
                                         "sdpa-flash_ms": 300.0, "sdpa-cudnn_error": "E: no", "vs_sdpa": 0.97,
                                         "vs_sdpa-flash": 1.03}])
    assert "4 x 4096" in model and "0.97x" in model and "sdpa-cudnn: E: no" in model


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_sections_need_cuda_too():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        backward.run_backward_bench(shapes=[(64, False, 1024)], sections=("layer",))
