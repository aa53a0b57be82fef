"""The backward kernels compile for Hopper (sm_90a) at the tile table's configurations, use
wgmma, and do not spill registers (``flashkernel.bench.backward --compile-check``; in a child
process without Triton's interpreter, so this runs on machines without a GPU too)."""

import pytest

from flashkernel.bench import backward as bench
from flashkernel.bench import compile_check as cc

TOOLCHAIN_PROBLEM = cc.toolchain_problem()


@pytest.mark.skipif(TOOLCHAIN_PROBLEM is not None, reason=f"cannot compile for sm_90a: {TOOLCHAIN_PROBLEM}")
def test_backward_kernels_compile_for_sm90a():
    specs = bench.compile_specs(dtypes=("bfloat16",))
    reports = bench.compile_in_child(specs)
    assert len(reports) == len(specs)
    failed = [f"{r['kernel']} {r['dtype']} d{r['head_dim']} causal={r['causal']}: {'; '.join(r['problems'])}"
              for r in reports if r["problems"]]
    assert not failed, "\n".join(failed)


def test_problems_name_spills_beyond_the_allowance(monkeypatch):
    """The report's checks, on a made-up compile result."""
    class Compiled:
        asm = {"ptx": "wgmma.mma_async"}
        metadata = type("Metadata", (), {"shared": 1024})

    monkeypatch.setattr(cc, "compile_triton", lambda *args: Compiled)
    monkeypatch.setattr(cc, "ptxas_report", lambda ptx, sass: dict(ptxas_ok=True, registers=255, spill_stores=24,
                                                                    spill_loads=24))
    assert bench.compile_report(bench.CompileSpec("dkdv", "bfloat16", 128, True))["problems"] == ["spills 24 B"]
    assert bench.compile_report(bench.CompileSpec("dkdv", "bfloat16", 256, True))["problems"] == ["spills 24 B"]
    monkeypatch.setattr(cc, "ptxas_report", lambda ptx, sass: dict(ptxas_ok=True, registers=255, spill_stores=8,
                                                                    spill_loads=8))
    assert bench.compile_report(bench.CompileSpec("dkdv", "bfloat16", 256, True))["problems"] == []
