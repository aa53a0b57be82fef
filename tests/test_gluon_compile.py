"""The Gluon kernels compile for Hopper (sm_90a) without spills and with the instructions their
design rests on (wgmma/HGMMA and TMA, the softmax under the PV product; mma.sync and ldmatrix
in decode). Triton compiles for a GPU target and its wheel bundles ptxas, so this runs on
machines without a GPU too (``flashkernel.bench.compile_check``, in a child process: the
kernels cannot be compiled where Triton's interpreter is on, as it is in CPU test runs)."""

import pytest

from flashkernel.bench import compile_check as cc
from flashkernel.kernels import tuning

TOOLCHAIN_PROBLEM = cc.toolchain_problem()
needs_toolchain = pytest.mark.skipif(TOOLCHAIN_PROBLEM is not None, reason=f"cannot compile for sm_90a: {TOOLCHAIN_PROBLEM}")


def prefill_specs(head_dim):
    """What the table dispatches at ``head_dim`` in bf16; fp16 at head dim 128."""
    dtypes = ("bfloat16", "float16") if head_dim == 128 else ("bfloat16",)
    return cc.dispatched_prefill_specs(head_dims=(head_dim,), dtypes=dtypes)


DECODE_SPECS = (
    cc.decode_specs(head_dims=(128,), pages=(0, 16, 256), dtypes=("bfloat16",))
    + cc.decode_specs(head_dims=(64, 256), pages=(16,), dtypes=("bfloat16",), rows=((8, 2),), causal=(True,))
    + cc.decode_specs(head_dims=(128,), pages=(64,), dtypes=("float16",), rows=((4, 1),), causal=(True,))
    + cc.decode_specs(head_dims=(128,), pages=(0, 16), dtypes=("bfloat16",), rows=((4, 1),), causal=(True,),
                      cache_dtypes=cc.DECODE_QUANTIZED_CACHES)
    + cc.decode_specs(head_dims=(64, 256), pages=(256,), dtypes=("float16",), rows=((8, 2),), causal=(False,),
                      cache_dtypes=("float8_e4m3fn",))
)


def assert_no_problems(reports, expected_count):
    assert len(reports) == expected_count
    failed = [cc.summary_line(r) for r in reports if r["problems"]]
    assert not failed, "\n".join(failed)


@needs_toolchain
@pytest.mark.parametrize("head_dim", cc.PREFILL_HEAD_DIMS)
def test_prefill_kernel_compiles_for_sm90a(head_dim):
    specs = prefill_specs(head_dim)
    assert_no_problems(cc.compile_in_child(specs), len(specs))


@needs_toolchain
def test_decode_kernel_compiles_for_sm90a():
    assert_no_problems(cc.compile_in_child(DECODE_SPECS), len(DECODE_SPECS))


@needs_toolchain
def test_backward_kernel_compiles_for_sm90a():
    specs = cc.backward_specs()
    assert_no_problems(cc.compile_in_child(specs), len(specs))


@needs_toolchain
def test_every_gluon_rule_of_the_table_is_compiled():
    for head_dim in cc.PREFILL_HEAD_DIMS:
        rules = tuning.gpu_entry(cc.GPU_NAME, "sm_90")["gluon"][str(head_dim)]
        reached = {id(tuning.gluon_rule(cc.GPU_NAME, "sm_90", head_dim, s.causal, int(s.config.split(":")[1])))
                   for s in prefill_specs(head_dim)}
        assert reached == {id(rule) for rule in rules}


# ---- the checks themselves, on made-up reports --------------------------------------------------


def clean_prefill_report(**changes):
    report = dict(family="prefill", ptxas_ok=True, spill_stores=0, spill_loads=0, wgmma=64, hgmma=64,
                  tma_loads=8, tma_stores=2, ptxas_notes=[], config={"pipeline": True}, mufu_overlap=[66, 66])
    return {**report, **changes}


def test_a_clean_report_has_no_problems():
    assert cc.problems(clean_prefill_report()) == []


@pytest.mark.parametrize("changes, expected", [
    (dict(spill_stores=4, spill_loads=4), "spills 4 B"),
    (dict(hgmma=0), "no wgmma"),
    (dict(tma_stores=0), "TMA loads 8, stores 0"),
    (dict(ptxas_notes=["info : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized"]),
     "serialized"),
    (dict(mufu_overlap=[66, 0]), "without exp2 under the PV wgmma"),
    (dict(mufu_overlap=[]), "without exp2 under the PV wgmma"),
    (dict(ptxas_ok=False, ptxas_error="ptxas fatal"), "ptxas failed"),
])
def test_problems_are_reported(changes, expected):
    found = cc.problems(clean_prefill_report(**changes))
    assert any(expected in line for line in found), found


def test_the_simple_loop_needs_no_overlap():
    assert cc.problems(clean_prefill_report(config={"pipeline": False}, mufu_overlap=[])) == []


def test_decode_needs_its_mmas_and_tma():
    report = dict(family="decode", ptxas_ok=True, spill_stores=0, spill_loads=0, mma_sync=32, ldmatrix=0,
                  tma_loads=0, ptxas_notes=[])
    assert cc.problems(report) == ["mma.sync 32, ldmatrix 0", "no TMA load"]


def test_sass_report_counts_exp2_between_the_waits():
    sass = "\n".join([
        "  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;",
        "  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        "  MUFU.EX2 R3, R3 ;", "  MUFU.EX2 R4, R4 ;",
        "  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "  MUFU.EX2 R5, R200 ;",
    ])
    assert cc.sass_report(sass) == dict(max_register=200, hgmma=1, mufu_overlap=[2])
