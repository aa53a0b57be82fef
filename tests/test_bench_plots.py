"""PNG plots are written from result documents (skipped when matplotlib is missing)."""

import sys

import pytest

from flashkernel.bench import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ENV = {"gpu": "NVIDIA H200", "device": "cuda", "torch": "2.9.0", "triton": "3.6.0", "git_commit": "0123456789abcdef"}
CEILINGS = {"copy_gbps": 4000.0, "matmul_tflops": 750.0}


def prefill_doc():
    rows = []
    for head_dim in (64, 128):
        for causal in (False, True):
            for seqlen in (512, 1024, 2048):
                for provider, tflops in (("flashkernel", 300.0), ("sdpa-flash", 280.0), ("standard", 50.0)):
                    rows.append({"provider": provider, "status": "ok", "dtype": "bfloat16", "head_dim": head_dim,
                                 "causal": causal, "seqlen_q": seqlen, "batch": 16384 // seqlen, "tflops": tflops,
                                 "median_ms": 1.0, "flops": int(tflops * 1e9), "bytes": 10**8})
    rows.append({**rows[0], "provider": "broken", "status": "wrong", "tflops": None})
    return {"workload": "prefill", "environment": ENV, "ceilings": CEILINGS, "rows": rows}


def decode_doc():
    rows = []
    for batch in (1, 8):
        for context in (1024, 4096, 32768):
            for provider, gbps in (("flashkernel", 3000.0), ("flashkernel-paged", 2900.0), ("sdpa-math", 500.0)):
                rows.append({"provider": provider, "status": "ok", "dtype": "bfloat16", "batch": batch,
                             "context": context, "graph_gbps": gbps, "gbps": gbps / 2, "median_ms": 0.02,
                             "graph_median_ms": 0.01, "flops": 10**8, "bytes": 4 * 10**7})
    return {"workload": "decode", "environment": ENV, "ceilings": CEILINGS, "rows": rows}


def assert_png(path):
    assert path.exists() and path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 5000


def test_all_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    paths = plots.plot_all([prefill_doc(), decode_doc()], tmp_path)
    assert sorted(p.name for p in paths) == ["decode_bandwidth.png", "prefill_tflops.png", "roofline.png"]
    for path in paths:
        assert_png(path)


def test_one_file_per_dtype_and_no_ceilings(tmp_path):
    pytest.importorskip("matplotlib")
    doc = prefill_doc()
    doc["rows"] += [{**row, "dtype": "float16"} for row in doc["rows"]]
    doc["ceilings"] = None
    names = sorted(p.name for p in plots.plot_all([doc], tmp_path))
    assert names == ["prefill_tflops_bfloat16.png", "prefill_tflops_float16.png", "roofline.png"]


def test_wrong_rows_are_never_plotted(tmp_path):
    pytest.importorskip("matplotlib")
    doc = {"workload": "prefill", "environment": ENV, "ceilings": None,
           "rows": [{"provider": "broken", "status": "wrong", "dtype": "bfloat16"}]}
    assert plots.plot_all([doc], tmp_path) == []
    assert plots.provider_color("flashkernel") == "black"
    assert plots.provider_color("fa3") == plots.provider_color("fa3") != plots.provider_color("fa2")


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plots.PlottingUnavailable, match=r"pip install 'flashkernel\[plot\]'"):
        plots.pyplot()


def backward_doc():
    rows, layer = [], []
    for head_dim in (64, 128):
        for causal in (False, True):
            for seqlen in (1024, 4096):
                rows.append({"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "flashkernel_tflops": 300.0,
                             "sdpa-flash_tflops": 250.0, "sdpa-cudnn_error": "RuntimeError: not here"})
                layer.append({"head_dim": head_dim, "causal": causal, "seqlen": seqlen, "flashkernel_tflops": 320.0,
                              "sdpa-cudnn_tflops": 400.0})
    return {"workload": "backward", "environment": ENV, "rows": rows, "layer": layer}


def test_backward_plot_has_a_panel_per_head_dim_and_mask(tmp_path):
    pytest.importorskip("matplotlib")
    assert_png(plots.backward_plot(backward_doc(), tmp_path))
