"""Ring attention (``flashkernel.distributed``): exact against the float64 reference and against
single-process ``flash_attn_func`` on the gathered tensors, across 2 and 4 ranks.

Without a GPU the ranks are CPU processes on the gloo backend running Triton's interpreter
(tiny shapes); with 2 (4) GPUs the ``gpu`` tests run the same checks with NCCL at larger shapes.
Process start-up costs seconds, so one spawn per world size runs every case (a module-scoped
fixture) and the tests check its results one case each.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

import ring_worker
from flashkernel import flash_attn_func, flash_attn_varlen_func, reference
from flashkernel.distributed import (ring_flash_attn_func, shard, shard_positions, shard_varlen, unshard,
                                     unshard_varlen)
from flashkernel.distributed.layout import num_chunks, rank_segments
from flashkernel.distributed.plan import Band, plan_step
from helpers import assert_output_close, assert_varlen_close, describe_mismatch

ON_GPU = torch.cuda.is_available()
LAYOUTS = ("zigzag", "contiguous")


# --- the plan: every visible pair in exactly one kernel call -------------------------------------


def _global_positions(segments):
    return [seg.global_start + n for seg in segments for n in range(seg.length)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal, window", [
    (False, (-1, -1)), (True, (-1, -1)), (True, (0, -1)), (True, (3, -1)), (True, (7, -1)),
    (True, (12, -1)), (False, (0, 0)), (False, (3, 5)), (False, (-1, 2)), (False, (9, -1)),
    (False, (6, 13)), (True, (40, -1)), (False, (40, 40)),
])
def test_plan_covers_each_visible_pair_once(world, layout, causal, window):
    chunk = 5
    local_len = chunk * num_chunks(world, layout) // world
    band = Band.of(causal, window)
    for rank, source in itertools.product(range(world), repeat=2):
        q_segs = rank_segments(rank, world, layout, local_len)
        k_segs = rank_segments(source, world, layout, local_len)
        pieces = plan_step(q_segs, k_segs, band)
        q_pos, k_pos = _global_positions(q_segs), _global_positions(k_segs)
        for i, j in itertools.product(range(local_len), repeat=2):
            covering = [p for p in pieces if p.visible(i, j)]
            expected = band.visible(q_pos[i], k_pos[j])
            assert len(covering) == int(expected), (
                f"rank {rank} source {source}: query {q_pos[i]} key {k_pos[j]} visible={expected} "
                f"but computed by {covering} (pieces {pieces})"
            )


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_causal_steps_cost_every_rank_the_same(world):
    """The load balance: every rank computes the same number of pairs (4 n^2 over the ring's
    2 n x 2n diagonal blocks) and, apart from the diagonal step, one call of 2 n^2 pairs."""
    chunk = 16
    band = Band.of(True, (-1, -1))
    costs = []
    for rank in range(world):
        q_segs = rank_segments(rank, world, "zigzag", 2 * chunk)
        steps = [plan_step(q_segs, rank_segments((rank - s) % world, world, "zigzag", 2 * chunk), band)
                 for s in range(world)]
        assert [len(step) for step in steps] == [1] * world
        assert steps[0][0].causal and all(step[0].is_full for step in steps[1:])
        assert all(step[0].q_len * step[0].k_len == 2 * chunk * chunk for step in steps[1:])
        costs.append(sum(p.q_len * p.k_len for step in steps for p in step))
    assert len(set(costs)) == 1, costs


# --- shard / unshard ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    seqlen = 3 * num_chunks(world, layout)
    x = torch.randn(2, seqlen, 3, 8)
    shards = [shard(x, r, world, layout=layout) for r in range(world)]
    for r, part in enumerate(shards):
        assert torch.equal(part, x[:, shard_positions(seqlen, r, world, layout)])
    assert torch.equal(unshard(shards, world, layout=layout), x)
    assert torch.equal(unshard(torch.cat(shards, dim=1), world, layout=layout), x)  # all-gathered
    lse = torch.randn(2, 3, seqlen)
    lse_shards = [shard(lse, r, world, dim=2, layout=layout) for r in range(world)]
    assert torch.equal(unshard(lse_shards, world, dim=-1, layout=layout), lse)


def test_zigzag_shard_holds_mirrored_chunks():
    x = torch.arange(16)[None, :]
    assert shard(x, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shard(x, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard(x, 1, 2, layout="contiguous").tolist() == [[8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_varlen_round_trip(layout):
    world = 2
    lengths = [4, 0, 8, 12] if layout == "zigzag" else [2, 0, 6, 4]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    x = torch.randn(int(cu[-1]), 2, 8)
    shards = []
    for r in range(world):
        part, cu_local = shard_varlen(x, cu, r, world, layout)
        assert torch.equal(cu_local, cu // world) and cu_local.dtype == torch.int32
        for b in range(len(lengths)):  # each sequence's rows stay together, in shard() order
            seq = x[cu[b]:cu[b + 1]][None]
            assert torch.equal(part[cu_local[b]:cu_local[b + 1]], shard(seq, r, world, layout=layout)[0])
        shards.append(part)
    assert torch.equal(unshard_varlen(shards, cu, world, layout), x)
    assert torch.equal(unshard_varlen(torch.cat(shards), cu, world, layout), x)


def test_shard_errors_name_the_numbers():
    x = torch.randn(1, 10, 2, 8)
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(the sequence length\) is 10.*4 equal chunks.*12 or 8"):
        shard(x, 0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        shard(x, 2, 2, layout="contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="3 shards for world = 2"):
        unshard([x, x, x], 2, layout="contiguous")
    with pytest.raises(ValueError, match="not a multiple of world = 4"):
        unshard(x, 4)
    with pytest.raises(ValueError, match="sequence 1's length is 6"):
        shard_varlen(torch.randn(10, 2, 8), torch.tensor([0, 4, 10], dtype=torch.int32), 0, 2)
    with pytest.raises(ValueError, match="never decrease"):
        shard_varlen(torch.randn(10, 2, 8), torch.tensor([0, 8, 4], dtype=torch.int32), 0, 2)


def test_ring_needs_an_initialized_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_flash_attn_func(q, q, q)


# --- exactness across ranks ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One ring call: full-sequence shapes and the keyword arguments of ring_flash_attn_func."""

    name: str
    layout: str = "zigzag"
    causal: bool = True
    dtype: torch.dtype = torch.float16
    batch: int = 1
    chunk: int = 8  # tokens per chunk; seqlen = chunk * number of chunks
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    softmax_scale: float | None = None
    return_lse: bool = True
    varlen_chunks: tuple[int, ...] | None = None  # packed: sequence b has varlen_chunks[b] chunks
    grad: bool = False  # also the gradients of (out * dout).sum() (+ (lse * dlse).sum() with return_lse)

    def inputs(self, world: int, device) -> dict:
        kwargs = dict(causal=self.causal, layout=self.layout, softcap=self.softcap,
                      softmax_scale=self.softmax_scale, return_lse=self.return_lse,
                      sinks=torch.randn(self.heads, device=device) if self.sinks else None)
        if self.varlen_chunks is None:
            kwargs["window_size"] = self.window
            rows = (self.batch, self.chunk * num_chunks(world, self.layout))
            extra = {}
        else:
            lengths = [c * num_chunks(world, self.layout) for c in self.varlen_chunks]
            rows = (sum(lengths),)
            extra = {"cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)}
        q = torch.randn(*rows, self.heads, self.head_dim, dtype=self.dtype, device=device)
        k = torch.randn(*rows, self.kv_heads, self.head_dim, dtype=self.dtype, device=device)
        if self.grad:
            extra["dout"] = torch.randn_like(q)
            if self.return_lse:
                extra["dlse"] = torch.randn(rows[0], self.heads, rows[1], device=device)
        return {"q": q, "k": k, "v": torch.randn_like(k), "kwargs": kwargs, **extra}


CPU_CASES_2 = [
    Case("zigzag-causal"),
    Case("zigzag-full", causal=False),
    Case("contiguous-causal", layout="contiguous"),
    Case("contiguous-full", layout="contiguous", causal=False, batch=2),
    Case("fp32-gqa-odd-chunk", dtype=torch.float32, kv_heads=2, head_dim=32, chunk=5),
    Case("mqa-d64-no-lse", kv_heads=1, head_dim=64, return_lse=False),
    Case("head-dim-8-batch-2", head_dim=8, batch=2, chunk=3),
    Case("one-token-chunks", chunk=1),
    Case("empty-sequence", chunk=0),
    Case("causal-window-inside-chunk", window=(6, -1)),
    Case("causal-window-zero", window=(0, 0)),
    Case("causal-window-wide", window=(20, -1), layout="contiguous"),
    Case("window-both-sides", causal=False, window=(3, 5)),
    Case("window-right-only", causal=False, window=(-1, 4), layout="contiguous"),
    Case("window-covers-all", causal=False, window=(100, 100)),
    Case("softcap", softcap=2.0),
    Case("sinks-causal-fp32", sinks=True, dtype=torch.float32),
    Case("sinks-softcap-window", causal=False, sinks=True, softcap=3.0, window=(5, 2), layout="contiguous"),
    Case("softmax-scale", softmax_scale=0.7, causal=False, kv_heads=2),
    Case("varlen-zigzag-causal", varlen_chunks=(2, 0, 5, 1), kv_heads=2),
    Case("varlen-zigzag-full", varlen_chunks=(3, 1), causal=False),
    Case("varlen-contiguous-causal-sinks", varlen_chunks=(4, 1, 2), layout="contiguous", sinks=True),
    Case("varlen-softcap-fp32", varlen_chunks=(1, 2), dtype=torch.float32, softcap=1.5, head_dim=32),
]
CPU_CASES_4 = [
    Case("zigzag-causal-gqa", chunk=4, kv_heads=2),
    Case("contiguous-causal-fp32", layout="contiguous", dtype=torch.float32, chunk=5),
    Case("zigzag-full", causal=False, chunk=3),
    Case("zigzag-window-sinks-softcap", chunk=4, window=(5, -1), sinks=True, softcap=2.5),
    Case("contiguous-window", layout="contiguous", causal=False, window=(3, 3), chunk=4),
    Case("zigzag-window-both-sides", causal=False, window=(6, 3), chunk=3, kv_heads=2),
    Case("varlen-zigzag-causal", varlen_chunks=(2, 1, 3), kv_heads=1),
    Case("varlen-contiguous-full-softcap-sinks", layout="contiguous", causal=False, varlen_chunks=(1, 3),
         softcap=2.0, sinks=True, dtype=torch.float32),
]
CPU_GRAD_CASES_2 = [
    Case("grad-zigzag-causal-sinks-lse", grad=True, dtype=torch.float32, sinks=True),
    Case("grad-contiguous-full-gqa", grad=True, layout="contiguous", causal=False, kv_heads=2, return_lse=False),
    Case("grad-zigzag-window-softcap", grad=True, dtype=torch.float32, window=(6, -1), softcap=2.0, batch=2,
         chunk=5),
]
CPU_GRAD_CASES_4 = [
    Case("grad-zigzag-causal-gqa", grad=True, chunk=4, kv_heads=2, dtype=torch.float32),
]
GPU_GRAD_CASES = [
    Case("grad-zigzag-causal-bf16", grad=True, dtype=torch.bfloat16, chunk=512, heads=8, kv_heads=2, head_dim=128,
         return_lse=False),
    Case("grad-zigzag-window-sinks-fp16", grad=True, chunk=256, heads=4, head_dim=64, window=(300, -1),
         sinks=True),
]
GPU_CASES = [
    Case("zigzag-causal-bf16", dtype=torch.bfloat16, chunk=512, heads=8, kv_heads=2, head_dim=128, batch=2),
    Case("zigzag-causal-fp16", chunk=384, heads=4, head_dim=64),
    Case("zigzag-full-bf16", dtype=torch.bfloat16, causal=False, chunk=256, heads=4, head_dim=128),
    Case("contiguous-causal-bf16", dtype=torch.bfloat16, layout="contiguous", chunk=700, heads=4, head_dim=96),
    Case("zigzag-window-bf16", dtype=torch.bfloat16, chunk=512, heads=4, head_dim=128, window=(300, -1)),
    Case("zigzag-sinks-softcap-fp16", chunk=256, heads=4, head_dim=64, sinks=True, softcap=30.0),
    Case("zigzag-causal-d256-fp32", dtype=torch.float32, chunk=128, heads=2, kv_heads=1, head_dim=256),
    Case("varlen-zigzag-causal-bf16", dtype=torch.bfloat16, varlen_chunks=(100, 3, 257, 0, 64), heads=8,
         kv_heads=2, head_dim=128),
    Case("varlen-contiguous-full-fp16", causal=False, layout="contiguous", varlen_chunks=(300, 17), heads=4,
         head_dim=64, sinks=True),
]


def _error_cases(world: int) -> dict:
    """Bad calls, raised on every rank before any transfer. name -> (exception, message regex)."""
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16)
    odd = torch.randn(1, 3, 2, 16, dtype=torch.float16)
    cases = {
        "alibi": ((q, q, q), dict(causal=True, alibi_slopes=torch.ones(2)), NotImplementedError,
                  r"alibi_slopes.*global positions"),
        "odd-zigzag-shard": ((odd, odd, odd), {}, ValueError, rf"q holds 3 tokens.*2 x {world} = {2 * world}"),
        "q-k-lengths": ((q, odd, odd), dict(layout="contiguous"), ValueError, r"q holds 4 tokens and k 3"),
        "layout": ((q, q, q), dict(layout="ring"), ValueError, r"layout must be one of.*'ring'"),
        "int-dtype": ((q.int(), q.int(), q.int()), {}, TypeError, r"dtype int32"),
        "window-type": ((q, q, q), dict(window_size=3), TypeError, r"window_size must be a pair"),
    }
    packed = torch.randn(6, 2, 16, dtype=torch.float16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    varlen_cases = {
        "varlen-window": ((packed, packed, packed, cu, 4), dict(window_size=(2, 0)), NotImplementedError,
                          r"does not support window_size \(got \(2, 0\)\)"),
        "varlen-alibi": ((packed, packed, packed, cu, 4), dict(alibi_slopes=torch.ones(2)), NotImplementedError,
                         r"alibi_slopes"),
        "varlen-odd-sequence": ((packed, packed, packed, torch.tensor([0, 3, 6], dtype=torch.int32), 4), {},
                                ValueError, rf"sequence 0 has 3 local tokens.*2 x {world}"),
        "varlen-max-seqlen": ((packed, packed, packed, cu, 2), {}, ValueError,
                              r"max_seqlen is 2 but sequence 1 has 4 local tokens"),
        "varlen-grad": ((packed.clone().requires_grad_(), packed, packed, cu, 4), {}, RuntimeError,
                        r"ring_flash_attn_varlen_func has no backward, and q requires grad"),
        "varlen-cu-end": ((packed, packed, packed, torch.tensor([0, 2, 4], dtype=torch.int32), 4), {}, ValueError,
                          r"end at the number of local tokens \(6\)"),
    }
    entries = {f"error-{name}": {"expect_error": True, "args": list(args), "kwargs": kwargs, "exception": exc,
                                 "match": match}
               for name, (args, kwargs, exc, match) in cases.items()}
    entries.update({f"error-{name}": {"expect_error": True, "varlen": True, "args": list(args), "kwargs": kwargs,
                                      "exception": exc, "match": match}
                    for name, (args, kwargs, exc, match) in varlen_cases.items()})
    return entries


def _spawn_ranks(world: int, backend: str, cases: dict, tmp: str) -> list[dict]:
    cases_path = os.path.join(tmp, "cases.pt")
    torch.save({name: {k: v for k, v in case.items() if k not in ("exception", "match")}
                for name, case in cases.items()}, cases_path)
    mp.spawn(ring_worker.run_rank, args=(world, backend, os.path.join(tmp, "store"), cases_path, tmp),
             nprocs=world, join=True)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _ring_results(world: int, backend: str, case_list, device) -> dict:
    torch.manual_seed(1000 + world)  # fresh inputs per case, reproducible per world size
    cases = {case.name: case.inputs(world, device) for case in case_list}
    cases.update(_error_cases(world))
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = _spawn_ranks(world, backend, {n: _to_cpu(c) for n, c in cases.items()}, tmp)
    return {"world": world, "cases": cases, "per_rank": per_rank}


def _to_cpu(case: dict) -> dict:
    def cpu(x):
        return x.cpu() if isinstance(x, torch.Tensor) else x
    moved = {k: cpu(v) for k, v in case.items()}
    if "kwargs" in moved:
        moved["kwargs"] = {k: cpu(v) for k, v in moved["kwargs"].items()}
    return moved


@pytest.fixture(scope="module")
def cpu_ring_2():
    return _ring_results(2, "gloo", CPU_CASES_2 + CPU_GRAD_CASES_2, "cpu")


@pytest.fixture(scope="module")
def cpu_ring_4():
    return _ring_results(4, "gloo", CPU_CASES_4 + CPU_GRAD_CASES_4, "cpu")


@pytest.fixture(scope="module")
def gpu_ring_2():
    return _ring_results(2, "nccl", GPU_CASES + GPU_GRAD_CASES, "cuda")


@pytest.fixture(scope="module")
def gpu_ring_4():
    return _ring_results(4, "nccl", GPU_CASES + GPU_GRAD_CASES, "cuda")


def _check_case(results: dict, case: Case) -> None:
    world, inputs = results["world"], results["cases"][case.name]
    shards = [r[case.name] for r in results["per_rank"]]
    for rank, part in enumerate(shards):
        assert "crash" not in part, f"rank {rank} raised:\n{part['crash']}"
    if case.varlen_chunks is not None:
        _check_varlen_case(world, inputs, shards, case)
        return
    device = inputs["q"].device
    out = unshard([s["out"].to(device) for s in shards], world, layout=case.layout)
    lse = unshard([s["lse"].to(device) for s in shards], world, dim=2, layout=case.layout) if case.return_lse else None
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    assert out.dtype == q.dtype and out.shape == q.shape
    variant = dict(window_size=case.window, softcap=case.softcap, sinks=inputs["kwargs"]["sinks"])
    assert_output_close(out, q, k, v, causal=case.causal, softmax_scale=case.softmax_scale, lse=lse, **variant)
    single, single_lse = flash_attn_func(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale,
                                         return_lse=True, **variant)
    truth, _ = reference.attention(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale, **variant)
    _assert_matches_single(out, lse, single, single_lse, truth)
    if case.grad:
        _check_grads(world, inputs, shards, case)


def _dense_grads(attention, q, k, v, sinks, dout, dlse) -> dict:
    """Gradients of ``(out * dout).sum() (+ (lse * dlse).sum())`` for ``attention(q, k, v, sinks)
    -> (out, lse)``, on leaf copies of the inputs."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in (q, k, v, sinks)]
    out, lse = attention(*leaves)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.double() * dlse.double()).sum()
    loss.backward()
    return {name: x.grad for name, x in zip(("dq", "dk", "dv", "dsinks"), leaves) if x is not None}


def _check_grads(world: int, inputs: dict, shards: list, case: Case) -> None:
    """The ring's gradients (each rank's shard; the sinks' summed over ranks) against one
    process's flash_attn_func backward on the gathered tensors, within twice that backward's own
    distance from the float64 gradients (plus a few units of the dtype)."""
    q, k, v, sinks = inputs["q"], inputs["k"], inputs["v"], inputs["kwargs"]["sinks"]
    dout, dlse = inputs["dout"], inputs.get("dlse")
    options = dict(causal=case.causal, softmax_scale=case.softmax_scale, window_size=case.window,
                   softcap=case.softcap, return_lse=True)
    single = _dense_grads(lambda *x: flash_attn_func(*x[:3], sinks=x[3], **options), q, k, v, sinks, dout, dlse)
    truth = _dense_grads(lambda *x: reference.attention(*x[:3], sinks=x[3], **{
        key: val for key, val in options.items() if key != "return_lse"}),
        *(None if x is None else x.double() for x in (q, k, v, sinks)), dout, dlse)
    device = q.device
    for name in ("dq", "dk", "dv"):
        ring = unshard([s[name].to(device) for s in shards], world, layout=case.layout)
        _assert_grad_matches_single(name, ring, single[name], truth[name])
    if sinks is not None:
        ring_dsinks = sum(s["dsinks"].to(device).double() for s in shards).to(single["dsinks"].dtype)
        _assert_grad_matches_single("dsinks", ring_dsinks, single["dsinks"], truth["dsinks"])


def _assert_grad_matches_single(name, ring, single, truth) -> None:
    assert ring.shape == single.shape and ring.dtype == single.dtype, (name, ring.shape, ring.dtype)
    assert not ring.isnan().any(), f"{name} has NaNs"
    scale = max(1.0, single.abs().max().item())
    single_err = (single.double() - truth).abs().max().item()
    bound = 8 * torch.finfo(single.dtype).eps * scale + 2 * single_err
    diff = (ring.double() - single.double()).abs()
    assert diff.max().item() <= bound, f"{name}: {describe_mismatch(diff, bound)}"


def _check_varlen_case(world: int, inputs: dict, shards: list, case: Case) -> None:
    cu = inputs["cu_seqlens"]
    device = inputs["q"].device
    out = unshard_varlen([s["out"].to(device) for s in shards], cu, world, case.layout)
    # The LSE [H, total / W] is sharded along its token dim: unshard its transpose.
    lse = (unshard_varlen([s["lse"].t().to(device) for s in shards], cu, world, case.layout).t()
           if case.return_lse else None)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    assert out.dtype == q.dtype and out.shape == q.shape
    cu_dev = cu.to(device)
    max_len = int((cu[1:] - cu[:-1]).max())
    variant = dict(softcap=case.softcap, sinks=inputs["kwargs"]["sinks"])
    assert_varlen_close(out, q, k, v, cu_dev, cu_dev, causal=case.causal, softmax_scale=case.softmax_scale,
                        lse=lse, **variant)
    single, single_lse = flash_attn_varlen_func(q, k, v, cu_dev, cu_dev, max_len, max_len, causal=case.causal,
                                                softmax_scale=case.softmax_scale, return_lse=True, **variant)
    truth, _ = reference.attention_varlen(q, k, v, cu_dev, cu_dev, causal=case.causal,
                                          softmax_scale=case.softmax_scale, **variant)
    _assert_matches_single(out, lse, single, single_lse, truth)


def _assert_matches_single(out, lse, single, single_lse, truth) -> None:
    """Against one process's flash_attn_func on the gathered tensors: the ring differs by the
    rounding of each step's partial output and its order of summation, so it may be a few units
    of the dtype, or twice the single call's own distance from the float64 truth, away."""
    if single.numel() == 0:
        return
    diff = (out.double() - single.double()).abs()
    single_err = (single.double() - truth).abs().max().item()
    bound = 4 * torch.finfo(out.dtype).eps * max(1.0, single.abs().max().item()) + 2 * single_err
    assert diff.max().item() <= bound, describe_mismatch(diff, bound)
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(single_lse))
        finite = torch.isfinite(single_lse)
        assert torch.allclose(lse[finite], single_lse[finite], rtol=1e-5, atol=1e-5)


def _check_error(results: dict, name: str) -> None:
    expected = results["cases"][name]
    for rank, result in enumerate(results["per_rank"]):
        got = result[name]
        assert got.get("error") == expected["exception"].__name__, f"rank {rank}: {got}"
        assert re.search(expected["match"], got["message"]), f"rank {rank}: {got['message']}"


ERROR_NAMES = sorted(_error_cases(2))


@pytest.mark.skipif(ON_GPU, reason="the CPU (gloo) ring runs where there is no GPU")
@pytest.mark.parametrize("case", CPU_CASES_2, ids=lambda c: c.name)
def test_ring_two_ranks_cpu(cpu_ring_2, case):
    _check_case(cpu_ring_2, case)


@pytest.mark.skipif(ON_GPU, reason="the CPU (gloo) ring runs where there is no GPU")
@pytest.mark.parametrize("case", CPU_GRAD_CASES_2, ids=lambda c: c.name)
def test_ring_backward_two_ranks_cpu(cpu_ring_2, case):
    _check_case(cpu_ring_2, case)


@pytest.mark.skipif(ON_GPU, reason="the CPU (gloo) ring runs where there is no GPU")
@pytest.mark.parametrize("case", CPU_GRAD_CASES_4, ids=lambda c: c.name)
def test_ring_backward_four_ranks_cpu(cpu_ring_4, case):
    _check_case(cpu_ring_4, case)


@pytest.mark.skipif(ON_GPU, reason="the CPU (gloo) ring runs where there is no GPU")
@pytest.mark.parametrize("case", CPU_CASES_4, ids=lambda c: c.name)
def test_ring_four_ranks_cpu(cpu_ring_4, case):
    _check_case(cpu_ring_4, case)


@pytest.mark.skipif(ON_GPU, reason="the CPU (gloo) ring runs where there is no GPU")
@pytest.mark.parametrize("name", ERROR_NAMES)
def test_ring_errors_cpu(cpu_ring_2, name):
    _check_error(cpu_ring_2, name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_ring_two_gpus(gpu_ring_2, case):
    _check_case(gpu_ring_2, case)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", GPU_GRAD_CASES, ids=lambda c: c.name)
def test_ring_backward_two_gpus(gpu_ring_2, case):
    _check_case(gpu_ring_2, case)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", ERROR_NAMES)
def test_ring_errors_two_gpus(gpu_ring_2, name):
    _check_error(gpu_ring_2, name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("case", GPU_CASES + GPU_GRAD_CASES, ids=lambda c: c.name)
def test_ring_four_gpus(gpu_ring_4, case):
    _check_case(gpu_ring_4, case)
