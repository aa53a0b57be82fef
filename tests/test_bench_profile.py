"""Profile helpers: finding ncu, its command line, parsing its CSV, Triton's resource report."""

import types

from flashkernel.bench import profile

NCU_CSV = '''==PROF== Connected to process 4242 (/usr/bin/python3.11)
==PROF== Profiling "_attention_fwd_kernel" - 0: 0%....50%....100% - 9 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.11","127.0.0.1","_attention_fwd_kernel","1","7","(256, 1, 1)","(32, 16, 4)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","12.34"
"0","4242","python3.11","127.0.0.1","_attention_fwd_kernel","1","7","(256, 1, 1)","(32, 16, 4)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,234,567"
"0","4242","python3.11","127.0.0.1","_attention_fwd_kernel","1","7","(256, 1, 1)","(32, 16, 4)","0","9.0","Command line profiler metrics","launch__registers_per_thread","register/thread","168"
"0","4242","python3.11","127.0.0.1","_attention_fwd_kernel","1","7","(256, 1, 1)","(32, 16, 4)","0","9.0","Command line profiler metrics","launch__shared_mem_per_block_dynamic","byte","98304"
"1","4242","python3.11","127.0.0.1","other_kernel","1","7","(128, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","77.5"
==PROF== Disconnected from process 4242
'''


def test_parse_ncu_csv():
    kernels = profile.parse_ncu_csv(NCU_CSV)
    assert [k["name"] for k in kernels] == ["_attention_fwd_kernel", "other_kernel"]
    metrics = kernels[0]["metrics"]
    assert metrics["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == (12.34, "%")
    assert metrics["gpu__time_duration.sum"] == (1234567.0, "nsecond")
    table = profile.kernel_table(kernels)
    assert "1234.6 us" in table and "168" in table and "96 KiB" in table and "77.5" in table
    assert profile.parse_ncu_csv("==PROF== nothing profiled\n") == []


def test_ncu_command_controls_clocks_and_range():
    command = profile.ncu_command("/opt/ncu", ["--workload", "prefill"])
    assert command[:3] == ["/opt/ncu", "--clock-control", "none"]
    assert "--profile-from-start" in command and command[command.index("--profile-from-start") + 1] == "off"
    assert command[-4:] == ["profile", "--inner", "--workload", "prefill"]
    metrics = command[command.index("--metrics") + 1].split(",")
    assert "launch__registers_per_thread" in metrics and "sm__warps_active.avg.pct_of_peak_sustained_active" in metrics


def test_find_ncu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(profile, "NCU_FALLBACK_PATHS", ())
    assert profile.find_ncu() is None
    assert profile.find_ncu(str(tmp_path / "missing")) is None
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert profile.find_ncu() == str(fake) and profile.find_ncu(str(fake)) == str(fake)
    assert "--ncu /nope is not an executable" in profile.ncu_missing_message("/nope")
    assert "Nsight Compute" in profile.ncu_missing_message()


def test_triton_resource_report_from_compiled_kernels():
    meta = types.SimpleNamespace(shared=65536, num_warps=8, num_stages=3)
    kernel = types.SimpleNamespace(n_regs=168, n_spills=0, metadata=meta)
    fake_jit = types.SimpleNamespace(device_caches={0: ({"key": kernel}, {}, None, None, None)})
    rows = profile.compiled_kernels([("prefill._attention_fwd_kernel", fake_jit)])
    assert rows == [{"kernel": "prefill._attention_fwd_kernel", "registers": 168, "spills": 0, "shared_bytes": 65536,
                     "num_warps": 8, "num_stages": 3}]
    assert "168" in profile.triton_report(rows)
    assert "no flashkernel Triton kernel" in profile.triton_report([])


def test_jit_functions_finds_the_kernels():
    names = [name for name, _ in profile.jit_functions()]
    assert "prefill._attention_fwd_kernel" in names
