"""Provider availability logic (imports faked), registry, SDPA masks and the flex compile guard."""

import sys
import types

import pytest
import torch

from flashkernel import reference
from flashkernel.bench import external, flex, providers, registry
from flashkernel.bench.providers import Provider, availability


def fake_module(name, **attributes):
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def provider_named(workload, name):
    return next(p for p in registry.providers_for(workload) if p.name == name)


def test_every_provider_is_listed_once_per_workload():
    for workload in ("prefill", "decode"):
        names = [p.name for p in registry.providers_for(workload)]
        assert len(names) == len(set(names))
        assert names[0] == "flashkernel"
        for expected in ("standard", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex", "fa2",
                         "fa3", "fa4", "flashinfer"):
            assert expected in names
    assert "flashkernel-paged" in registry.all_provider_names()


def test_absent_module_is_reported_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # makes the import fail
    a = availability(provider_named("prefill", "fa3"), "cuda")
    assert not a.available and "not installed" in a.reason


def test_broken_install_is_reported(monkeypatch):
    def broken(name):
        raise OSError("libcudart.so.12: cannot open shared object file")

    monkeypatch.setattr(providers, "import_module", broken)
    reason = providers.import_reason("flashinfer")
    assert "import of flashinfer failed" in reason and "libcudart" in reason


@pytest.mark.parametrize("version, ok", [("2.0.9", False), ("2.1.0", True), ("2.7.4.post1", True),
                                         ("2.8.3+cu12", True)])
def test_flash_attn_version_gate(monkeypatch, version, ok):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_module("flash_attn", __version__=version))
    monkeypatch.setattr(external, "import_module", lambda name: sys.modules[name])
    a = availability(provider_named("prefill", "fa2"), "cuda")
    assert a.available == ok
    if not ok:
        assert "top-left" in a.reason and version in a.reason


def test_installed_providers_still_need_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_module("flashinfer"))
    assert availability(provider_named("decode", "flashinfer"), "cuda").available
    a = availability(provider_named("decode", "flashinfer"), "cpu")
    assert not a.available and a.reason == "needs a CUDA GPU"


def test_fa4_needs_its_entry_point(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_module("flash_attn", __version__="2.8.0"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake_module("flash_attn.cute"))
    monkeypatch.setattr(external, "import_module", lambda name: sys.modules[name])
    a = availability(provider_named("prefill", "fa4"), "cuda")
    assert not a.available and "has no flash_attn_func" in a.reason


def test_flashkernel_decode_availability_follows_the_build(monkeypatch):
    assert providers.needs_flashkernel("flash_attn_with_kvcache")("cpu") is None
    reason = providers.needs_flashkernel("flash_attn_not_there")("cpu")
    assert reason == "flashkernel.flash_attn_not_there is not in this build"


def test_a_failing_probe_becomes_a_reason():
    def explode(device_type):
        raise RuntimeError("boom")

    a = availability(Provider("odd", "prefill", "", explode, None), "cuda")
    assert not a.available and "probe failed: RuntimeError: boom" in a.reason


def test_sdpa_backends_on_cpu():
    for name, expected in (("sdpa-flash", True), ("sdpa-math", True), ("sdpa-cudnn", False), ("sdpa-efficient", False)):
        assert availability(provider_named("prefill", name), "cpu").available == expected


def test_select_keeps_registry_order():
    chosen = registry.select(registry.prefill_providers(), ["sdpa-math", "flashkernel", "flex"], ["flex"])
    assert [p.name for p in chosen] == ["flashkernel", "sdpa-math"]


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(3, 9), (9, 3), (6, 6), (1, 7)])
def test_sdpa_provider_uses_the_bottom_right_causal_mask(seqlen_q, seqlen_k):
    q = torch.randn(2, seqlen_q, 4, 16, dtype=torch.float32)
    k = torch.randn(2, seqlen_k, 2, 16, dtype=torch.float32)
    v = torch.randn_like(k)
    prepared = provider_named("prefill", "sdpa-math").build(providers.PrefillInputs(q, k, v, causal=True))
    with prepared.context():
        out = prepared.call()
    truth, _ = reference.attention(q, k, v, causal=True)
    visible_rows = reference.causal_mask(seqlen_q, seqlen_k).any(dim=1)  # SDPA gives NaN/garbage on empty rows
    assert torch.allclose(out[:, visible_rows].double(), truth[:, visible_rows], atol=1e-5)


def test_bottom_right_mask_mod_matches_the_reference():
    for seqlen_q, seqlen_k in ((3, 7), (7, 3), (5, 5)):
        mask_mod = flex.bottom_right_causal(seqlen_k - seqlen_q)
        rows = torch.arange(seqlen_q)[:, None]
        cols = torch.arange(seqlen_k)[None, :]
        assert torch.equal(mask_mod(0, 0, rows, cols), reference.causal_mask(seqlen_q, seqlen_k))
    assert flex.bottom_right_causal(4) is flex.bottom_right_causal(4)  # one function per mask


@pytest.fixture
def dynamo_config():
    """Restore dynamo's settings and caches after a test changes them.

    Saved and restored by hand: pytest >= 9.2's monkeypatch deletes attributes of torch's
    ConfigModule on teardown (they are not in its ``__dict__``), which breaks dynamo afterwards.
    """
    import torch._dynamo

    config = torch._dynamo.config
    names = (*flex._LIMIT_NAMES, "fail_on_recompile_limit_hit")
    saved = {name: getattr(config, name) for name in names if hasattr(config, name)}
    torch._dynamo.reset()
    yield config
    for name, value in saved.items():
        setattr(config, name, value)
    torch._dynamo.reset()


def scale_and_shift(x):
    return x * 2 + 1


def test_verified_compile_counts_one_compile_per_shape(dynamo_config):
    compiled = flex.VerifiedCompile(scale_and_shift, inner_backend="eager")
    a, b = torch.randn(3), torch.randn(5)
    assert torch.equal(compiled.first_call(("a",), a), a * 2 + 1)
    compiled.first_call(("a",), a)  # same shape again: a cache hit is fine
    compiled.first_call(("b",), b)
    assert compiled.backend.compiles == 2


def test_verified_compile_refuses_a_silent_eager_fallback(dynamo_config):
    flex.raise_recompile_limits(limit=1, fail_on_limit=False)  # the second shape falls back to eager
    compiled = flex.VerifiedCompile(scale_and_shift, inner_backend="eager", fullgraph=False)
    compiled.first_call(("a",), torch.randn(3))
    with pytest.raises(flex.NotCompiledError, match="ran eagerly"):
        compiled.first_call(("b",), torch.randn(7))


def test_fullgraph_makes_the_recompile_limit_an_error(dynamo_config):
    flex.raise_recompile_limits(limit=1, fail_on_limit=False)
    compiled = flex.VerifiedCompile(scale_and_shift, inner_backend="eager")
    compiled.first_call(("a",), torch.randn(3))
    with pytest.raises(Exception) as raised:
        compiled.first_call(("b",), torch.randn(7))
    assert "recompile" in str(raised.value).lower() or "fullgraph" in str(raised.value)


def test_raise_recompile_limits(dynamo_config):
    flex.raise_recompile_limits()
    assert dynamo_config.recompile_limit >= flex.RECOMPILE_LIMIT
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        assert dynamo_config.fail_on_recompile_limit_hit is True
