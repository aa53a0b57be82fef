"""The command line: exit codes, messages, files. Kernels run in Triton's interpreter here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashkernel
from flashkernel import cli
from flashkernel.bench import profile

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter")
ON_GPU = torch.cuda.is_available()
SRC = str(Path(__file__).resolve().parents[1] / "src")
cpu_only = pytest.mark.skipif(ON_GPU, reason="checks the CPU-interpreter run (tiny shapes, CPU labels)")


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def wrong_by_a_little(fn):
    """A drop-in replacement for ``fn`` whose output is off by 0.1 everywhere."""
    def wrapped(*args, **kwargs):
        result = fn(*args, **kwargs)
        if isinstance(result, tuple):
            return (result[0] + 0.1, *result[1:])
        return result + 0.1
    return wrapped


def test_unknown_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["frobnicate"])
    assert raised.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_no_subcommand_prints_help_and_exits_2(capsys):
    code, out, _ = run_cli(capsys)
    assert code == 2 and "flashkernel info" in out


def test_unknown_provider_exits_2(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["bench", "prefill", "--providers", "nope"])
    assert raised.value.code == 2 and "unknown provider 'nope'" in capsys.readouterr().err


@cpu_only
def test_bench_variants_without_gpu_says_so(capsys):
    code, out, _ = run_cli(capsys, "bench", "variants")
    assert code == 2 and "needs a CUDA GPU" in out and "flashkernel check" in out


def test_bench_variants_formulas():
    """The variants benchmark's pair counts: causal with and without a sliding window."""
    from flashkernel.bench import variants

    assert variants.causal_pairs(4) == 10
    assert variants.causal_pairs(6, window=2) == 1 + 2 + 2 + 2 + 2 + 2  # at most 2 keys per query


@cpu_only
def test_check_in_a_fresh_process_sets_the_interpreter_itself():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "flashkernel.cli", "check", "--quick", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Triton's CPU interpreter" in done.stdout
    header = done.stdout.splitlines()[1]
    for column in ("function", "case", "max err", "torch err", "ratio", "result"):
        assert column in header
    for function in ("flash_attn_func", "standard_attention", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        assert function in done.stdout
    assert "window+softcap+alibi+sinks" in done.stdout
    assert "public names without a check" not in done.stdout
    assert "FAIL" not in done.stdout and " passed, 0 failed" in done.stdout


def test_check_fails_when_a_function_is_wrong(capsys, monkeypatch):
    monkeypatch.setattr(flashkernel, "standard_attention", wrong_by_a_little(flashkernel.standard_attention),
                        raising=False)
    code, out, _ = run_cli(capsys, "check", "--quick", "--no-progress", "--random", "0")
    assert code == 1
    assert "FAIL standard_attention" in out and "max error over bound" in out
    assert [line for line in out.splitlines() if line.startswith("flash_attn_func")][0].endswith("pass")


@cpu_only
def test_bench_prefill_quick_writes_results(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "bench", "prefill", "--quick", "--out", str(tmp_path), "--no-progress",
                           "--providers", "flashkernel", "standard", "sdpa-math", "flex", "fa2")
    assert code == 0
    assert "CPU-INTERPRETER" in out and "absent: flex: needs a CUDA GPU" in out and "absent: fa2" in out
    doc = json.loads((tmp_path / "prefill.json").read_text())
    assert doc["environment"]["command"].startswith("flashkernel bench prefill --quick")
    assert {r["provider"] for r in doc["rows"]} == {"flashkernel", "standard", "sdpa-math"}
    assert all(r["status"] == "ok" and r["timer"] == "cpu-interpreter" for r in doc["rows"])
    assert (tmp_path / "prefill.csv").read_text().count("\n") == len(doc["rows"]) + 1


@cpu_only
def test_bench_flags_a_wrong_provider_and_does_not_rank_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(flashkernel, "standard_attention", wrong_by_a_little(flashkernel.standard_attention),
                        raising=False)
    code, out, _ = run_cli(capsys, "bench", "prefill", "--quick", "--out", str(tmp_path), "--no-progress",
                           "--no-plots", "--providers", "flashkernel", "standard", "--causal", "yes")
    assert code == 0  # another provider being wrong does not fail the run
    assert "WRONG standard on" in out
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    standard = [r for r in rows if r["provider"] == "standard"]
    assert standard and all(r["status"] == "wrong" and "median_ms" not in r for r in standard)
    assert "(no provider to compare with flashkernel)" in out


@cpu_only
def test_bench_fails_when_flashkernel_is_wrong(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(flashkernel, "flash_attn_func", wrong_by_a_little(flashkernel.flash_attn_func), raising=False)
    code, out, _ = run_cli(capsys, "bench", "prefill", "--quick", "--out", str(tmp_path), "--no-progress",
                           "--no-plots", "--providers", "flashkernel", "--causal", "no")
    assert code == 1 and "flashkernel's own output was WRONG" in out


@cpu_only
def test_bench_append_merges_split_sweeps(capsys, tmp_path):
    common = ["bench", "prefill", "--quick", "--out", str(tmp_path), "--no-progress", "--no-plots", "--providers",
              "flashkernel"]
    assert run_cli(capsys, *common, "--causal", "no")[0] == 0
    assert run_cli(capsys, *common, "--causal", "yes", "--append")[0] == 0
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    assert sorted(r["causal"] for r in rows) == [False, True]
    assert any("--causal no" in r["command"] for r in rows) and any("--append" in r["command"] for r in rows)


@cpu_only
def test_merge_command(capsys, tmp_path):
    common = ["bench", "prefill", "--quick", "--no-progress", "--no-plots", "--providers", "flashkernel"]
    assert run_cli(capsys, *common, "--causal", "no", "--out", str(tmp_path / "a"))[0] == 0
    assert run_cli(capsys, *common, "--causal", "yes", "--out", str(tmp_path / "b"))[0] == 0
    code, out, _ = run_cli(capsys, "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "all"),
                           "--no-plots")
    assert code == 0 and "wrote" in out
    rows = json.loads((tmp_path / "all" / "prefill.json").read_text())["rows"]
    assert sorted(r["causal"] for r in rows) == [False, True]
    assert run_cli(capsys, "merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"))[0] == 1


@cpu_only
def test_bench_decode_quick(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "bench", "decode", "--quick", "--out", str(tmp_path), "--no-progress",
                           "--no-plots", "--providers", "flashkernel", "flashkernel-paged", "sdpa-math")
    assert code == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert {r["provider"] for r in rows} == {"flashkernel", "flashkernel-paged", "sdpa-math"}
    assert all(r["status"] == "ok" for r in rows), [r.get("message") for r in rows]
    assert "bytes = K + V read once" in out


def test_bench_list_providers(capsys):
    code, out, _ = run_cli(capsys, "bench", "--list-providers")  # the workload defaults to all
    assert code == 0 and "prefill providers on" in out and "decode providers on" in out
    assert "flashkernel-paged" in out and "flashinfer" in out


@cpu_only
def test_plot_command(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, _, _ = run_cli(capsys, "bench", "prefill", "--quick", "--out", str(tmp_path), "--no-progress",
                         "--no-plots", "--providers", "flashkernel", "sdpa-math", "--causal", "no")
    assert code == 0
    code, out, _ = run_cli(capsys, "plot", str(tmp_path))
    assert code == 0 and (tmp_path / "prefill_tflops.png").exists() and (tmp_path / "roofline.png").exists()
    code, out, _ = run_cli(capsys, "plot", str(tmp_path / "empty"))
    assert code == 1 and "no prefill.json / decode.json" in out


@cpu_only
def test_report_command(capsys, tmp_path):
    code, _, _ = run_cli(capsys, "bench", "prefill", "--quick", "--out", str(tmp_path), "--no-progress",
                         "--no-plots", "--providers", "flashkernel", "sdpa-math", "--causal", "no")
    assert code == 0
    code, out, _ = run_cli(capsys, "report", str(tmp_path), "--markdown")
    assert code == 0 and out.startswith("### prefill on cpu")
    assert "| case | flashkernel | sdpa-math |" in out and "| --- | ---: | ---: |" in out
    assert "`flashkernel bench prefill --quick" in out


@cpu_only
def test_profile_without_ncu_says_so(capsys, monkeypatch):
    monkeypatch.setattr(profile, "find_ncu", lambda explicit=None: None)
    code, out, _ = run_cli(capsys, "profile")
    assert code == 1
    assert "Nsight Compute (`ncu`) was not found" in out and "--ncu /path/to/ncu" in out
    assert "needs a CUDA GPU" in out


@cpu_only
def test_info_on_cpu(capsys):
    code, out, _ = run_cli(capsys, "info", "--json")
    assert code == 0 and "GPU: none" in out and '"ceilings": null' in out


@cpu_only
def test_bench_backward_without_cuda_says_so(capsys):
    code, out, _ = run_cli(capsys, "bench", "backward")
    assert code == 2 and "backward benchmark needs a CUDA GPU" in out


def test_bench_sections_reach_each_benchmarks_own_command_line(monkeypatch, tmp_path):
    """``flashkernel bench overhead|e2e|kvquant|backward --sections ...`` hands the names to that
    benchmark's own parser (which checks them); without ``--sections`` each runs its default set."""
    import argparse

    from flashkernel.bench import backward, e2e, kvquant, overhead

    seen = {}
    for name, module in (("overhead", overhead), ("e2e", e2e), ("kvquant", kvquant), ("backward", backward)):
        monkeypatch.setattr(module, "main", lambda argv, name=name: seen.__setitem__(name, argv) or 0)
    commands = {"overhead": cli.cmd_bench_overhead, "e2e": cli.cmd_bench_e2e, "kvquant": cli.cmd_bench_kvquant,
                "backward": cli.cmd_bench_backward}
    for sections in (["growing"], None):
        args = argparse.Namespace(out=str(tmp_path), quick=False, no_progress=True, no_plots=True, append=False,
                                  sections=sections)
        for name, command in commands.items():
            assert command(args, "cuda") == 0
            argv = seen[name]
            if sections:
                assert argv[argv.index("--sections") + 1:][:1] == ["growing"], (name, argv)
            elif name == "backward":
                assert argv[argv.index("--sections") + 1:] == list(backward.SECTIONS)
            else:
                assert "--sections" not in argv, (name, argv)


def test_bench_sections_of_a_benchmark_without_sections_is_an_error(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["bench", "prefill", "--sections", "decode"])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and "--sections applies to bench overhead, e2e, kvquant, backward" in err
    with pytest.raises(SystemExit) as raised:
        cli.main(["bench", "overhead", "--sections", "growing", "--append"])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and "bench overhead writes its own file anew: pass another --out" in err
