"""Tuned prefill configurations as data, the heuristic for unknown GPUs, opt-in autotuning."""

import json

import pytest
import torch

import flashkernel
from flashkernel import interface
from flashkernel.kernels import prefill, tuning
from helpers import ON_GPU, assert_output_close, random_qkv

H200_POINTER = {16: (128, 64, 8, 3), 32: (128, 64, 8, 3), 64: (128, 64, 8, 3), 128: (128, 128, 8, 3),
                256: (128, 64, 8, 2)}
H200_TMA = {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 128, 8, 3),
            256: (128, 64, 8, 2)}


@pytest.fixture
def fresh_tables(monkeypatch):
    tuning.load_tables.cache_clear()
    yield monkeypatch
    tuning.load_tables.cache_clear()


def test_shipped_sm90_table_holds_the_h200_sweep(fresh_tables):
    entry = tuning.gpu_entry("NVIDIA H100 80GB HBM3", "sm_90")  # any sm_90 GPU
    for section, expected in (("triton_pointer", H200_POINTER), ("triton_tma", H200_TMA)):
        got = {int(d): tuple(c) for d, c in entry[section].items()}
        assert got == expected
    for head_dim in (64, 128, 256):
        assert entry["gluon"][str(head_dim)], head_dim


def test_name_entry_layers_over_the_capability_entry(fresh_tables, tmp_path):
    """A file as save_autotuned writes it (one head dim, keyed by device name) changes that head
    dim only: the capability entry's other head dims and its Gluon rules stay."""
    user = tmp_path / "mine.json"
    user.write_text(json.dumps({"gpus": {"My GPU": {"triton_pointer": {"128": [64, 64, 4, 2]}},
                                         "sm_90": {"triton_tma": {"64": [64, 64, 4, 2]}}}}))
    fresh_tables.setenv(tuning.USER_FILE_ENV, str(user))
    tuning.load_tables.cache_clear()
    mine = tuning.gpu_entry("My GPU", "sm_90")
    assert mine["triton_pointer"]["128"] == [64, 64, 4, 2]
    assert mine["triton_pointer"]["64"] == [128, 64, 8, 3]
    assert mine["triton_tma"]["64"] == [64, 64, 4, 2] and mine["triton_tma"]["128"] == [128, 128, 8, 3]
    assert tuning.gluon_rule("My GPU", "sm_90", 128, False, 1024)["base"] == "persistent"
    assert tuning.gpu_entry("Other GPU", "sm_90")["triton_pointer"]["128"] == [128, 128, 8, 3]
    assert tuning.gpu_entry("My GPU", "sm_75") == {"triton_pointer": {"128": [64, 64, 4, 2]}}
    assert tuning.gpu_entry("Other GPU", "sm_75") is None


@pytest.mark.parametrize("block_d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("shared_kb", [48, 99, 163, 227])
def test_heuristic_fits_the_shared_memory(block_d, shared_kb):
    config = tuning.heuristic_tile_config(block_d, shared_kb * 1024)
    assert config in tuning.CANDIDATES[block_d]
    fits = [c for c in tuning.CANDIDATES[block_d]
            if tuning.shared_bytes(c, block_d) + tuning.SHARED_RESERVE <= shared_kb * 1024]
    assert config == (fits[0] if fits else tuning.CANDIDATES[block_d][-1])


@pytest.mark.parametrize("block_d, shared, expected", [
    (128, 232448, (128, 128, 8, 3)),  # Hopper's 227 KB: the tuned shape
    (128, 166912, (128, 64, 8, 3)),   # A100's 163 KB
    (128, 101376, (64, 32, 4, 2)),    # 99 KB (sm_86/sm_89)
    (256, 101376, (64, 32, 4, 2)),
    (64, 101376, (128, 64, 8, 3)),    # d64 tiles fit 99 KB whole
])
def test_heuristic_known_gpus(block_d, shared, expected):
    assert tuning.heuristic_tile_config(block_d, shared) == tuning.TileConfig(*expected)


def test_gluon_rules_match_in_order():
    rule = tuning.gluon_rule("X", "sm_90", 64, causal=True, seqlen_k=8192)  # <= 8192 keys
    assert rule["base"] == "persistent" and rule["pingpong"]
    assert tuning.gluon_rule("X", "sm_90", 64, causal=True, seqlen_k=8193)["base"] == "d64_3wg"
    assert tuning.gluon_rule("X", "sm_90", 128, causal=False, seqlen_k=4096)["base"] == "persistent"
    assert tuning.gluon_rule("X", "sm_90", 128, causal=False, seqlen_k=4097)["base"] == "default"
    assert tuning.gluon_rule("X", "sm_80", 128, causal=False, seqlen_k=4097) is None


def test_interpreter_uses_its_own_small_tiles():
    assert prefill.pick_config(128, torch.float16, interpreted=True, tma=False) == prefill.INTERPRETER_CONFIG


@pytest.mark.gpu
def test_autotune_is_opt_in_and_kept_gpu(monkeypatch, tmp_path):
    tuning.clear_autotuned()
    runs = []
    real_autotune = tuning.autotune
    monkeypatch.setattr(tuning, "autotune", lambda *a, **kw: runs.append(1) or real_autotune(*a, **kw))
    try:
        q, k, v = random_qkv(2, 300, 300, 4, 2, 96, torch.float16)  # d96: the Triton kernel
        flashkernel.flash_attn_func(q, k, v, causal=True)
        assert not runs and not tuning._AUTOTUNED, "autotuning ran without FLASHKERNEL_AUTOTUNE=1"
        monkeypatch.setattr(tuning, "AUTOTUNE", True)
        interface._EAGER_CALLS.clear()  # the call above was recorded with the table's config
        for _ in range(2):
            out = flashkernel.flash_attn_func(q, k, v, causal=True)
            assert_output_close(out, q, k, v, causal=True)
        assert len(runs) == 1, "the second call of the class must reuse the tuned config"
        (key, config), = tuning._AUTOTUNED.items()
        assert config in tuning.CANDIDATES[128] and key[1:] == (128, torch.float16, False, True)
        saved = tmp_path / "tuned.json"
        tuning.save_autotuned(saved)
        entry = next(iter(json.loads(saved.read_text())["gpus"].values()))
        assert entry["triton_pointer"]["128"] == [config.block_m, config.block_n, config.num_warps,
                                                  config.num_stages]
    finally:
        tuning.clear_autotuned()


@pytest.mark.gpu
def test_table_config_is_used_gpu():
    if not ON_GPU:
        pytest.skip("needs a GPU")
    name, arch, smem = tuning.device_facts(torch.device("cuda"))
    config = prefill.pick_config(96, torch.float16, interpreted=False, tma=False)
    if tuning.gpu_entry(name, arch):
        assert config == tuning.TileConfig(*tuning.gpu_entry(name, arch)["triton_pointer"]["128"])
    else:
        assert config == tuning.heuristic_tile_config(128, smem)
