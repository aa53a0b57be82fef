"""The Gluon prefill kernel (Hopper only) against the float64 reference, and its dispatch."""

import dataclasses

import pytest
import torch

import flashkernel
from flashkernel.kernels import dispatch, tuning
from flashkernel.kernels._softmax import Variant
from helpers import DEVICE, DTYPES, ON_GPU, assert_output_close, random_qkv

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel needs an sm_90 GPU")
# Configurations under test: name -> (head dims, changes to the head dim's default config).
MODES = {
    "simple": ((64, 128, 256), dict(pipeline=False, pingpong=False)),
    "pipeline": ((64, 128, 256), dict(pipeline=True, pingpong=False)),
    "pingpong": ((64, 128, 256), dict(pipeline=True, pingpong=True)),
    "persistent": ((64, 128, 256), dict(pipeline=True, persistent=True)),
    "persistent_pingpong": ((64, 128, 256), dict(pipeline=True, pingpong=True, persistent=True)),
    # A grid of 7 programs: each runs many work items, so the hand-over between items is tested.
    "persistent_7": ((64, 128, 256), dict(pipeline=True, persistent=True, max_programs=7)),
    # Each warpgroup visits only the key tiles its own rows see (causal): full, pipelined, ping-pong.
    "persistent_wg_7": ((64, 128, 256), dict(pipeline=True, persistent=True, wg_tiles=True, max_programs=7)),
    # d256 persistent stages O in one buffer the consumers take in turn (shared_o); this is the
    # other way, through Q's buffers.
    "persistent_q_as_o_7": ((256,), dict(pipeline=True, persistent=True, wg_tiles=True, shared_o=False,
                                         max_programs=7)),
    # Causal: the longest query tiles first in a snake, and pairs of query tiles at every shape
    # (the automatic choice takes either, by how the pairs fill the grid).
    "persistent_snake_7": ((64, 128, 256), dict(pipeline=True, persistent=True, causal_pairs=False, max_programs=7)),
    "persistent_pairs_7": ((64, 128, 256), dict(pipeline=True, persistent=True, causal_pairs=True, max_programs=7)),
    "persistent_wg_pairs_7": ((64, 128, 256), dict(pipeline=True, persistent=True, wg_tiles=True, causal_pairs=True,
                                                   max_programs=7)),
    "d64_3wg_persistent_pairs_7": ((64,), dict(num_consumers=3, persistent=True, causal_pairs=True, max_programs=7)),
    "pingpong_wg": ((64, 128, 256), dict(pipeline=True, pingpong=True, wg_tiles=True)),
    "simple_wg": ((64, 128, 256), dict(pipeline=False, wg_tiles=True)),
    "d64_3wg": ((64,), dict(num_consumers=3)),
    "d64_3wg_persistent_wg": ((64,), dict(num_consumers=3, persistent=True, wg_tiles=True)),
    "d64_3wg_persistent_7": ((64,), dict(num_consumers=3, persistent=True, max_programs=7)),
}
LENGTHS = [(1, 1), (63, 63), (200, 200), (1000, 1000), (1, 1000), (200, 1000), (1000, 200), (63, 1),
           (129, 4100), (300, 364)]


def test_module_imports_and_configs_exist():
    gluon = dispatch._gluon_prefill_module()
    assert gluon is not None, "kernels/gluon/prefill.py failed to import with this Triton"
    assert set(gluon.HEAD_DIMS) <= set(gluon.CONFIGS)


def _h100_config(head_dim, causal, seqlen_k):
    """What an sm_90 GPU without its own table entry (an H100) gets from the shipped table."""
    rule = tuning.gluon_rule("NVIDIA H100 80GB HBM3", "sm_90", head_dim, causal, seqlen_k)
    return dispatch.gluon_config_from(rule, head_dim)


def test_config_per_call_from_the_table():
    long = _h100_config(128, causal=False, seqlen_k=16384)
    assert long.pipeline and long.pingpong and not long.persistent
    short = _h100_config(256, causal=True, seqlen_k=4096)
    assert short.pipeline and short.persistent and not short.pingpong
    assert _h100_config(64, causal=False, seqlen_k=1024).num_consumers == 3
    causal_d64 = _h100_config(64, causal=True, seqlen_k=8192)
    assert causal_d64.num_consumers == 2 and causal_d64.persistent and causal_d64.pingpong
    assert _h100_config(64, causal=True, seqlen_k=16384).num_consumers == 3
    assert _h100_config(256, causal=True, seqlen_k=8192).wg_tiles
    assert not _h100_config(256, causal=True, seqlen_k=16384).wg_tiles
    # Causal runs persistent at every length, in pairs of query tiles where they fill the grid.
    assert all(_h100_config(d, causal=True, seqlen_k=n).persistent and _h100_config(d, causal=True, seqlen_k=n).causal_pairs
               is not False for d in (64, 128, 256) for n in (512, 16384, 65536))


def test_pairs_where_units_fill_the_rounds():
    gluon = dispatch._gluon_prefill_module()
    config = gluon.PERSISTENT_CONFIGS[128]
    # Issue 5's causal shapes (16k tokens per batch, model dim 2048) on 132 SMs: always pairs.
    for seqlen in (512, 1024, 4096, 16384):
        assert gluon.use_pairs(True, config, seqlen // 128, 16384 // seqlen * 16, 132)
    assert not gluon.use_pairs(True, config, 4, 67, 132)  # 134 units: 2 rounds, the second all but idle
    assert not gluon.use_pairs(True, config, 8, 16, 132)  # fewer units than programs
    assert not gluon.use_pairs(False, config, 8, 512, 132)
    assert gluon.use_pairs(True, dataclasses.replace(config, causal_pairs=True), 4, 67, 132)
    assert not gluon.use_pairs(True, dataclasses.replace(config, causal_pairs=False), 8, 512, 132)
    assert not gluon.use_pairs(True, gluon.CONFIGS[128], 8, 512, 132)  # not persistent
    # A GPU the table does not know runs the kernel's default configuration.
    assert dispatch.gluon_config_from(tuning.gluon_rule("X", "sm_120", 128, False, 1024), 128) == \
        dispatch._gluon_prefill_module().CONFIGS[128]


def test_o_staging_per_head_dim():
    """The persistent kernel's O buffers: one per consumer where they fit (d64, d128), one
    shared at d256, and every choice within the shared memory of an sm_90 block."""
    gluon = dispatch._gluon_prefill_module()
    configs = gluon.PERSISTENT_CONFIGS
    assert gluon.o_separate(64, configs[64]) and gluon.o_separate(128, configs[128])
    assert not gluon.o_separate(256, configs[256]) and gluon.o_shared(256, configs[256])
    assert not gluon.o_shared(128, configs[128]) and not gluon.o_shared(256, gluon.CONFIGS[256])
    assert not gluon.o_shared(256, dataclasses.replace(configs[256], shared_o=False))
    # An explicit separate_o=False keeps O in Q's buffers unless shared_o asks otherwise.
    assert not gluon.o_shared(128, dataclasses.replace(configs[128], separate_o=False))
    assert gluon.o_shared(128, dataclasses.replace(configs[128], separate_o=False, shared_o=True))
    with pytest.raises(ValueError, match="no room"):
        gluon.o_shared(256, dataclasses.replace(configs[256], num_consumers=3, shared_o=True))
    for head_dim, config in configs.items():
        o_bufs = (config.num_consumers if gluon.o_separate(head_dim, config)
                  else int(gluon.o_shared(head_dim, config)))
        assert gluon.smem_bytes(head_dim, config, o_bufs) <= gluon.SMEM_LIMIT


def test_interpreter_and_unsupported_calls_use_triton():
    plain = Variant.of(False)
    q, k, v = random_qkv(1, 8, 8, 2, 1, 128, torch.float16)
    if not HOPPER:
        assert "needs" in dispatch.prefill_refusal("gluon", q, k, v, plain)
        assert dispatch.prefill_refusal("gluon", q, k, v) == dispatch.prefill_refusal("gluon", q, k, v, plain)
        assert dispatch.prefill_backend("auto", q, k, v, plain) == "triton"
    q72, k72, v72 = random_qkv(1, 8, 8, 2, 1, 72, torch.float16)
    assert dispatch.prefill_backend("auto", q72, k72, v72, plain) == "triton"
    q32, k32, v32 = (x.float() for x in (q, k, v))
    assert dispatch.prefill_backend("auto", q32, k32, v32, plain) == "triton"
    assert "plain attention only" in dispatch.prefill_refusal("gluon", q, k, v, Variant.of(False, softcap=5.0))
    assert "packed sequences" in dispatch.prefill_refusal("gluon", q, k, v, plain, varlen=True)
    assert dispatch.prefill_refusal("triton", q, k, v, Variant.of(False, softcap=5.0)) is None


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS)
def test_gluon_kernel_gpu(seqlen_q, seqlen_k, head_dim, causal, dtype, mode):
    gluon = dispatch._gluon_prefill_module()
    head_dims, changes = MODES[mode]
    if head_dim not in head_dims:
        pytest.skip(f"{mode} is a head dim {head_dims} configuration")
    base = gluon.D64_3WG if changes.get("num_consumers") == 3 else gluon.CONFIGS[head_dim]
    config = dataclasses.replace(base, **{k: v for k, v in changes.items() if k != "num_consumers"})
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, seqlen_q), float("nan"), device=DEVICE)
    gluon.gluon_attention_forward(q, k, v, out, lse, causal=causal, softmax_scale=head_dim ** -0.5,
                                  config=config)
    assert_output_close(out, q, k, v, causal=causal, lse=lse)


@pytest.mark.gpu
@hopper_only
def test_gluon_reads_and_writes_only_its_rows_gpu():
    """Views into a NaN-filled buffer with extra rows and heads: any read outside the view would
    put NaN into the output, any write outside it would change the guard."""
    batch, seqlen, heads, head_dim = 2, 200, 4, 128
    q_store = torch.full((batch, seqlen + 37, heads + 1, head_dim), float("nan"), device=DEVICE,
                         dtype=torch.bfloat16)
    q = q_store[:, 5:5 + seqlen, 1:]
    q.copy_(torch.randn_like(q))
    k, v = (torch.randn(batch, seqlen, 2, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    out_store = torch.full_like(q_store, float("nan"))
    out = out_store[:, 5:5 + seqlen, 1:]
    assert dispatch.prefill(q, k, v, out, None, causal=True, softmax_scale=0.1) == "gluon"
    assert_output_close(out, q, k, v, causal=True, softmax_scale=0.1)
    guard = out_store.clone()
    guard[:, 5:5 + seqlen, 1:] = float("nan")
    assert torch.isnan(guard).all()


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_uses_gluon_at_head_dim_128_gpu(causal, monkeypatch):
    calls = []
    gluon = dispatch._gluon_prefill_module()
    original = gluon.launch  # every Gluon launch goes through it
    monkeypatch.setattr(gluon, "launch", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    q, k, v = random_qkv(1, 300, 300, 4, 4, 128, torch.bfloat16)
    out = flashkernel.flash_attn_func(q, k, v, causal=causal)
    assert len(calls) == 1
    assert_output_close(out, q, k, v, causal=causal)


@pytest.mark.gpu
@hopper_only
def test_supported_rejects_what_tma_cannot_address_gpu():
    gluon = dispatch._gluon_prefill_module()
    q, k, v = random_qkv(1, 64, 64, 4, 2, 128, torch.bfloat16)
    assert gluon.supported(q, k, v)
    flat = torch.randn(q.numel() + 1, device=DEVICE, dtype=torch.bfloat16)
    assert not gluon.supported(flat[1:].view(q.shape), k, v)  # base not 16-byte aligned
    assert not gluon.supported(q, k[:, :, :1].expand(1, 64, 2, 128), v)  # broadcast (stride-0) heads
    q3, k3, v3 = random_qkv(1, 64, 64, 3, 2, 128, torch.bfloat16)
    assert not gluon.supported(q3, k3, v3)  # 3 query heads over 2 KV heads
    q0 = q[:, :, :0]
    assert not gluon.supported(q0, k, v)
    out = flashkernel.flash_attn_func(q0, k, v)  # zero query heads: an empty result, no error
    assert out.shape == q0.shape


def test_tma_checks_and_descriptors_without_a_gpu():
    """The one-pass TMA check and the descriptor built without TensorDescriptor's checks (both
    on every Gluon call) agree with the checked versions."""
    gluon = dispatch._gluon_prefill_module()
    x = torch.randn(2, 40, 4, 64, dtype=torch.bfloat16)
    assert gluon._tma_ok(x)
    flat = torch.randn(x.numel() + 1, dtype=torch.bfloat16)
    assert not gluon._tma_ok(flat[1:].view(x.shape))  # base not 16-byte aligned
    assert not gluon._tma_ok(x[:, :, :1].expand(2, 40, 2, 64))  # broadcast (stride-0) heads
    assert gluon._tma_ok(x[:, :, :1].expand(2, 40, 1, 64))  # a stride-0 dim of size 1 is fine
    assert not gluon._tma_ok(x.transpose(2, 3))  # last dim not contiguous
    assert not gluon._tma_ok(torch.randn(2, 40, 4, 68, dtype=torch.bfloat16)[..., :64])  # 136-byte rows
    for rows in (64, 128):
        fast = gluon.make_descriptor(x, rows)
        common = pytest.importorskip("flashkernel.kernels.gluon.common")
        checked = common.TensorDescriptor(x, list(x.shape), list(x.stride()), [1, rows, 1, 64],
                                          common._host_tile_layout(rows, 64, x.dtype))
        for field in dataclasses.fields(checked):
            a, b = getattr(fast, field.name), getattr(checked, field.name)
            assert a is b or a == b, field.name


def test_unknown_backend_is_refused():
    q, k, v = random_qkv(1, 8, 8, 2, 1, 128, torch.float16)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'gluon', got 'Gluon'"):
        flashkernel.flash_attn_func(q, k, v, backend="Gluon")
    with pytest.raises(TypeError, match="backend must be a string"):
        flashkernel.flash_attn_func(q, k, v, backend=None)
    if not HOPPER:
        with pytest.raises(ValueError, match="backend='gluon' cannot run this call: it needs"):
            flashkernel.flash_attn_func(q, k, v, backend="gluon")
    with pytest.raises(ValueError, match="packed sequences"):
        cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
        flashkernel.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, backend="gluon")
