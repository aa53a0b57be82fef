"""``flashkernel check``'s plan: every public function, its variants, and failing when wrong."""

import pytest
import torch

import flashkernel
from flashkernel.bench import check
from helpers import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")
ON_GPU = torch.cuda.is_available()
PUBLIC_FUNCTIONS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")


def test_every_public_name_has_a_check():
    assert check.unchecked_public_names() == []
    assert check.unchecked_public_names("cuda") == []


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_plan_has_each_variant_for_each_public_function(device, quick):
    plan = check.planned_checks(device, quick=quick, random_count=0, seed=0)
    for function in PUBLIC_FUNCTIONS:
        labels = [label for f, label, _ in plan if f == function]
        assert any(not label.endswith(tuple(check.VARIANTS)) for label in labels), f"{function}: no plain case"
        if quick:  # the quick plan keeps the case with all four variants at once
            assert any(label.endswith(check.ALL_VARIANTS) for label in labels), function
        else:
            for variant in check.VARIANTS:
                assert any(label.endswith(f" {variant}") for label in labels), f"{function} has no {variant} row"


def test_variant_kwargs_names_each_variant():
    kwargs = check.variant_kwargs(check.ALL_VARIANTS, num_heads=4, device=DEVICE)
    assert set(kwargs) == {"window_size", "softcap", "alibi_slopes", "sinks"}
    assert kwargs["alibi_slopes"].shape == (4,) and kwargs["alibi_slopes"].dtype == torch.float32
    assert check.variant_kwargs("", 4, DEVICE) == {}
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        check.variant_kwargs("window+nope", 4, DEVICE)


@pytest.mark.skipif(ON_GPU, reason="small CPU cases")
@pytest.mark.parametrize("case", check.CPU_VARLEN[:2], ids=lambda c: c.label())
def test_varlen_check_passes(case):
    row = check.check_varlen(case, DEVICE)
    assert row.ok, row.note


@pytest.mark.skipif(ON_GPU, reason="small CPU cases")
def test_varlen_check_fails_when_the_function_is_wrong(monkeypatch):
    right = flashkernel.flash_attn_varlen_func

    def off_by_a_little(*args, **kwargs):
        out, lse = right(*args, **kwargs)
        return out + 0.1, lse

    monkeypatch.setattr(flashkernel, "flash_attn_varlen_func", off_by_a_little, raising=False)
    row = check.check_varlen(check.CPU_VARLEN[1], DEVICE)
    assert not row.ok and "max error over bound" in row.note


@pytest.mark.skipif(ON_GPU, reason="small CPU cases")
def test_variant_rows_fail_when_a_variant_is_ignored(monkeypatch):
    """A function that drops the softcap (a plausible bug) fails the softcap row."""
    right = flashkernel.flash_attn_func

    def no_softcap(*args, softcap=0.0, **kwargs):
        return right(*args, **kwargs)

    monkeypatch.setattr(flashkernel, "flash_attn_func", no_softcap, raising=False)
    case = next(c for c in check.CPU_DENSE_VARIANTS if c.variant == "softcap")
    row = check.check_dense("flash_attn_func", case, DEVICE)
    assert not row.ok, "the check did not notice a missing softcap"
