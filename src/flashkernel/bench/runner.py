"""Run a suite of cases through providers into flat result rows (one per case and provider).

For each case: make the inputs (several copies when they would fit in L2), compute the float64
truth once, then for each available provider build its call, check the output, and only when
it is right time it (eager; decode also as CUDA-graph replays) and measure its peak memory.
A provider that is wrong is flagged (status ``wrong``) and never timed or ranked; one that
raises is recorded with its error. Figures (TFLOP/s, GB/s, fractions of the measured ceilings,
model steps/s) and flashkernel's speedup over each provider are added at the end.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback

import torch

from . import accuracy, formulas, measure
from .progress import ProgressLine
from .providers import Availability, DecodeInputs, PrefillInputs, Provider, availability
from .suites import DecodeCase, PrefillCase, case_fields

DEFAULT_L2_BYTES = 50 * 2**20
REFERENCE = "flashkernel"


@dataclasses.dataclass
class RunConfig:
    device: str = "cuda"
    settings: measure.Settings = dataclasses.field(default_factory=measure.Settings)
    check_window: int | None = 128  # query rows checked at each end; None checks everything
    ceilings: dict | None = None  # {"copy_gbps": ..., "matmul_tflops": ...}
    model_layers: int = 32
    seed: int = 0


# --- inputs ------------------------------------------------------------------------------------


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def working_set_bytes(case) -> int:
    """Bytes one call touches at least once (inputs and output)."""
    e = formulas.dtype_bytes(case.dtype)
    if isinstance(case, DecodeCase):
        return formulas.decode_bytes(case.batch, case.context, case.heads, case.kv_heads, case.head_dim, e,
                                     case.seqlen_q)
    return formulas.attention_io_bytes(case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.kv_heads,
                                       case.head_dim, e)


def l2_bytes(device: str) -> int:
    if device != "cuda":
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", DEFAULT_L2_BYTES) or DEFAULT_L2_BYTES)


def make_prefill_inputs(case: PrefillCase, device: str) -> PrefillInputs:
    dtype = torch_dtype(case.dtype)
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, dtype=dtype, device=device)
    k = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return PrefillInputs(q, k, v, case.causal)


def paged_layout(cache: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """``cache [B, L, Hkv, D]`` scattered into pages ``[B * blocks, page_size, Hkv, D]`` so that
    token ``t`` of sequence ``b`` lives at ``pages[block_table[b, t // page_size], t % page_size]``."""
    batch, length, kv_heads, head_dim = cache.shape
    blocks = block_table.shape[1]
    padded = cache.new_zeros(batch, blocks * page_size, kv_heads, head_dim)
    padded[:, :length] = cache
    pages = cache.new_empty(batch * blocks, page_size, kv_heads, head_dim)
    pages[block_table.reshape(-1).long()] = padded.view(batch * blocks, page_size, kv_heads, head_dim)
    return pages


def make_decode_inputs(case: DecodeCase, device: str) -> DecodeInputs:
    dtype = torch_dtype(case.dtype)
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, dtype=dtype, device=device)
    k_cache = torch.randn(case.batch, case.context, case.kv_heads, case.head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
    blocks = math.ceil(case.context / case.page_size)
    order = torch.randperm(case.batch * blocks, device=device).to(torch.int32)
    table = order.view(case.batch, blocks)
    return DecodeInputs(q, k_cache, v_cache, seqlens, paged_layout(k_cache, table, case.page_size),
                        paged_layout(v_cache, table, case.page_size), table, case.page_size)


def make_inputs(case, device: str):
    if isinstance(case, DecodeCase):
        return make_decode_inputs(case, device)
    return make_prefill_inputs(case, device)


def input_copies(case, config: RunConfig) -> list:
    """Inputs, several copies when the working set fits in L2 (so calls do not hit in L2)."""
    copies = measure.rotation_copies(working_set_bytes(case), l2_bytes(config.device))
    return [make_inputs(case, config.device) for _ in range(copies)]


def truth_for(case, inputs, window: int | None) -> accuracy.Truth:
    if isinstance(case, DecodeCase):
        return accuracy.dense_truth(inputs.q, inputs.k_cache, inputs.v_cache, causal=True, window=window)
    return accuracy.dense_truth(inputs.q, inputs.k, inputs.v, causal=case.causal, window=window)


# --- one provider on one case ------------------------------------------------------------------


def _error_message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text[:300]


def _time(calls, config: RunConfig) -> measure.Timing:
    if config.device == "cuda":
        return measure.time_cuda(calls, config.settings)
    return measure.time_cpu(calls, config.settings)


def _timing_fields(timing: measure.Timing, prefix: str = "") -> dict:
    return {
        f"{prefix}median_ms": timing.median_ms,
        f"{prefix}p10_ms": timing.p10_ms,
        f"{prefix}p90_ms": timing.p90_ms,
        f"{prefix}samples": timing.samples,
        f"{prefix}timer": timing.timer,
    }


def _graph_fields(calls, config: RunConfig) -> dict:
    """CUDA-graph replay timing; a capture failure is recorded, not fatal."""
    try:
        return _timing_fields(measure.time_cuda_graph(calls, config.settings), "graph_")
    except Exception as exc:
        return {"graph_error": _error_message(exc)}


def check_and_time(provider: Provider, case, copies: list, truth: accuracy.Truth, config: RunConfig) -> dict:
    """Build, check and (when right) time one provider on one case. Returns the row's fields."""
    prepared = [provider.build(inputs) for inputs in copies]
    calls = [p.call for p in prepared]
    with prepared[0].context():
        out = calls[0]()
        expected = (case.batch, case.seqlen_q, case.heads, case.head_dim)
        shape_problem = accuracy.wrong_shape(out, expected)
        if shape_problem:
            return {"status": "wrong", "message": shape_problem}
        acc = accuracy.compare(out, truth)
        del out
        fields = {"max_err": acc.max_err, "torch_err": acc.torch_err, "err_ratio": acc.ratio, "err_bound": acc.bound}
        if not acc.ok:
            message = f"max error {acc.max_err:.3g} > bound {acc.bound:.3g} (PyTorch's own {acc.torch_err:.3g})"
            return {**fields, "status": "wrong", "message": message}
        fields.update(_timing_fields(_time(calls, config)))
        if config.device == "cuda" and case.workload == "decode":
            fields.update(_graph_fields(calls, config))
        fields["peak_extra_mb"] = measure.peak_extra_memory_mb(calls[0])
    return {**fields, "status": "ok"}


def run_one(provider: Provider, case, copies: list, truth: accuracy.Truth, config: RunConfig) -> dict:
    """:func:`check_and_time`, turning exceptions into ``error`` / ``oom`` rows; ``seconds`` is the
    wall time spent on the provider for this case (compiling, checking, timing)."""
    start = time.monotonic()
    try:
        fields = check_and_time(provider, case, copies, truth, config)
    except torch.cuda.OutOfMemoryError as exc:
        fields = {"status": "oom", "message": _error_message(exc)}
    except Exception as exc:
        fields = {"status": "error", "message": _error_message(exc), "traceback": traceback.format_exc(limit=4)}
    finally:
        if config.device == "cuda":
            torch.cuda.empty_cache()
    fields["seconds"] = time.monotonic() - start
    return {**case_fields(case), "case": case.label(), "provider": provider.name, **fields}


# --- figures -----------------------------------------------------------------------------------


def add_figures(row: dict, case, config: RunConfig) -> dict:
    """Work counts and the figures derived from the times (in place; returns the row)."""
    e = formulas.dtype_bytes(case.dtype)
    seqlen_k = case.context if isinstance(case, DecodeCase) else case.seqlen_k
    causal = True if isinstance(case, DecodeCase) else case.causal
    row["flops"] = formulas.attention_flops(case.batch, case.heads, case.seqlen_q, seqlen_k, case.head_dim, causal)
    row["bytes"] = working_set_bytes(case)
    if row.get("status") != "ok":
        return row
    for prefix in ("", "graph_"):
        ms = row.get(f"{prefix}median_ms")
        if ms:
            row[f"{prefix}tflops"] = formulas.tflops(row["flops"], ms)
            row[f"{prefix}gbps"] = formulas.gbps(row["bytes"], ms)
    ceilings = config.ceilings or {}
    best_ms = row.get("graph_median_ms") or row.get("median_ms")
    if ceilings.get("matmul_tflops"):
        row["fraction_of_matmul_peak"] = formulas.tflops(row["flops"], best_ms) / ceilings["matmul_tflops"]
    if ceilings.get("copy_gbps"):
        row["fraction_of_bandwidth"] = formulas.gbps(row["bytes"], best_ms) / ceilings["copy_gbps"]
    if isinstance(case, DecodeCase):
        add_model_steps(row, case, e, best_ms, config)
    return row


def add_model_steps(row: dict, case: DecodeCase, elem_bytes: int, best_ms: float, config: RunConfig) -> None:
    """Steps/s of a ``model_layers``-layer model's attention, achieved and bandwidth-bound."""
    per_step = formulas.model_decode_bytes_per_step(config.model_layers, case.batch, case.context,
                                                    case.kv_heads, case.head_dim, elem_bytes)
    row["model_layers"] = config.model_layers
    row["model_bytes_per_step"] = per_step
    row["model_steps_per_s"] = 1e3 / (config.model_layers * best_ms)
    if (config.ceilings or {}).get("copy_gbps"):
        row["model_steps_bound"] = formulas.steps_per_second_bound(config.ceilings["copy_gbps"], per_step)


def add_speedups(rows: list[dict]) -> None:
    """``flashkernel_speedup = provider time / flashkernel time`` (> 1: flashkernel is faster),
    for eager and graph times, between rows of the same case that are both ``ok``."""
    by_case = {}
    for row in rows:
        if row["provider"] == REFERENCE and row.get("status") == "ok":
            by_case[row["case"]] = row
    for row in rows:
        ours = by_case.get(row["case"])
        if ours is None or row.get("status") != "ok":
            continue
        for prefix in ("", "graph_"):
            theirs_ms, ours_ms = row.get(f"{prefix}median_ms"), ours.get(f"{prefix}median_ms")
            if theirs_ms and ours_ms:
                row[f"{prefix}flashkernel_speedup"] = theirs_ms / ours_ms


# --- the suite ---------------------------------------------------------------------------------


@dataclasses.dataclass
class SuiteResult:
    workload: str
    availability: list[Availability]
    rows: list[dict]


def setup_failed_row(provider: Provider, case, exc: Exception) -> dict:
    message = f"inputs or float64 reference failed: {_error_message(exc)}"
    return {**case_fields(case), "case": case.label(), "provider": provider.name, "status": "error", "message": message}


def run_suite(workload: str, cases: list, providers: list[Provider], config: RunConfig,
              progress: bool = True) -> SuiteResult:
    """Every available provider on every case."""
    avail = [availability(p, config.device) for p in providers]
    usable = [p for p, a in zip(providers, avail) if a.available]
    line = ProgressLine(len(cases) * max(len(usable), 1), enabled=progress)
    rows = []
    torch.manual_seed(config.seed)
    for case in cases:
        try:
            copies = input_copies(case, config)
            truth = truth_for(case, copies[0], config.check_window)
        except Exception as exc:  # no inputs or no reference: every provider's row says why
            rows += [setup_failed_row(p, case, exc) for p in usable]
            line.done += len(usable)
            continue
        for provider in usable:
            line.show(f"{workload} {case.label()} {provider.name}")
            rows.append(add_figures(run_one(provider, case, copies, truth, config), case, config))
            line.step()
        del copies, truth
    line.close()
    add_speedups(rows)
    return SuiteResult(workload, avail, rows)
