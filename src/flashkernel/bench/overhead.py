"""Call cost: what one attention call costs its caller, on the host and on the GPU, against cuDNN.

    flashkernel bench overhead --out benchmarks/results/h200            # writes overhead.json
    python -m flashkernel.bench.overhead --out overhead.json --label after

Uses the public API only, so the same file measures another build of flashkernel too (put that
build's ``src`` first on ``PYTHONPATH`` and run this file by path with ``--label before``).

Per call, for each provider (flashkernel's eager call, its plan/run call where the build has
plans, the same writing into an output the caller keeps where ``run`` takes ``out=``, SDPA's
cuDNN backend's eager call, its backend chosen once outside the timed calls):

* ``eager_us``: median of ``triton.testing.do_bench`` over eager calls (it flushes L2 between
  calls, so host time the GPU waits for shows up);
* ``wall_us``: wall-clock time per call of 200 back-to-back eager calls, synchronised at the end
  (what a loop of calls costs; the larger of host and GPU time);
* ``host_us``: host time per call: the same loop, not synchronised (launches are asynchronous;
  600 launches stay below the launch queue's depth);
* ``gpu_us``: GPU time per call, from CUDA-graph replays of 20 calls (no host at all);
* decode, append and prefill calls also: ``host_paired_us``, host time per call from 15 rounds in which
  every provider of the step and cuDNN's call take turns (a 200-call unsynchronised loop each),
  and ``host_vs_cudnn``, the median over the rounds of the provider's time over cuDNN's in the
  same round: host time drifts between loops on these hosts by more than the differences measured,
  and pairing cancels the drift (for pages of 16, cuDNN's call is over a contiguous cache of the
  same size, its only layout).

Shapes (bf16): decode, 32 query heads, 8 KV heads, head dim 128, one new token, batch 1/8/64 x
context 1k/4k, contiguous and pages of 16 (cuDNN gets the contiguous cache in its preferred
``[B, H, S, D]`` layout); ``--sections append``: the same steps appending the new token's key and
value (:func:`append_rows`); ``--sections append-backends`` (not in the default set): appending
steps over pages as CUDA-graph replays, per decode backend (:func:`append_backend_rows`);
prefill, 16k tokens per batch, model dim 2048, head dim 64/128/256, seqlen 512/1k/2k, causal and
not; and host-bound short prompts (``prefill-short`` rows: batch 1, 32 query / 8 KV heads of
128, causal, seqlen 128 and 512). ``--sections compiled``: a 32-layer attention-only decode loop
(append + attend per layer, B=1 and 8, context 1k) as eager calls, under ``torch.compile`` and
under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), time per step, and the same loop
on SDPA over a static cache as transformers runs it (:class:`SdpaStaticCacheDecoder`); ``--sections op``:
host time per call of the registered cache op, which such a compiled model calls per layer,
against the eager function on the same step (:func:`op_rows`). ``--sections
growing``: transformers' dynamic cache, a new ``[B, Hkv, S, D]`` cache one key longer every step
(passed transposed, with per-sequence lengths and key starts as transformers' integration passes
them), 4 layers per step, batch 1 and 8 from a 2k context: host time of each step's first call
(a new length) and of the other layers' calls, medians over 40 steps, against SDPA's call on the
same tensors with its own backend choice (what transformers' ``"sdpa"`` gets).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import statistics
import sys
import time

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    # Run by path, this directory comes first on sys.path, and its profile.py would shadow the
    # standard library's (torch.compile imports cProfile).
    del sys.path[0]

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashkernel

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DECODE = [(b, c, p) for b in (1, 8, 64) for c in (1024, 4096) for p in (0, 16)]
PREFILL = [(d, s, causal) for d in (64, 128, 256) for s in (512, 1024, 2048) for causal in (False, True)]
PREFILL_SHORT = (128, 512)  # seqlens of the host-bound prefill rows (batch 1, causal, decode's heads)
LOOP_CALLS = 200
PAIRED_ROUNDS = 15
GRAPH_CALLS = 20
LAYERS = 32
GROWING_LAYERS, GROWING_STEPS, GROWING_CONTEXT = 4, 40, 2048


# ---- timers -------------------------------------------------------------------------------------


def eager_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def loop_us(fn, synchronize: bool, repeats: int = 7) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(LOOP_CALLS):
            fn()
        if synchronize:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / LOOP_CALLS * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def graph_us(fn) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(GRAPH_CALLS):
                    fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / GRAPH_CALLS
    except Exception as exc:  # noqa: BLE001 - a provider that cannot be captured reports no GPU time
        print(f"    (no graph timing: {type(exc).__name__}: {str(exc)[:120]})", flush=True)
        return None


def paired_host_us(providers: dict, reference, context=None) -> dict:
    """``{name: (host_paired_us, host_vs_cudnn)}`` for each provider, from :data:`PAIRED_ROUNDS`
    rounds in which the providers and ``reference`` (cuDNN's call, timed under its backend
    choice: ``context``, default :func:`cudnn_context`) each run one unsynchronised loop; see the
    module docstring."""
    timed = dict(providers, _reference=reference)
    samples = {name: [] for name in timed}
    with (context or cudnn_context)():
        for _ in range(PAIRED_ROUNDS):
            for name, fn in timed.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(LOOP_CALLS):
                    fn()
                samples[name].append((time.perf_counter() - start) / LOOP_CALLS * 1e6)
        torch.cuda.synchronize()
    return {name: (statistics.median(samples[name]),
                   statistics.median([t / r for t, r in zip(samples[name], samples["_reference"])]))
            for name in providers}


def measure(fn, context=contextlib.nullcontext) -> dict:
    """The four times of one call ``fn`` (run inside ``context()``, entered once: SDPA's backend
    choice is a context manager that costs as much as the call itself)."""
    with context():
        for _ in range(5):
            fn()  # warm-up: compile, record
        torch.cuda.synchronize()
        return dict(eager_us=eager_us(fn), wall_us=loop_us(fn, True), host_us=loop_us(fn, False),
                    gpu_us=graph_us(fn))


def cudnn_context():
    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)


# ---- decode -------------------------------------------------------------------------------------


def decode_inputs(batch: int, context: int, page: int):
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, context, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    if page == 0:
        return q, k, v, seqlens, None
    blocks = batch * context // page
    order = torch.randperm(blocks, device="cuda")
    k_pages = torch.empty(blocks, page, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.empty_like(k_pages)
    k_pages[order] = k.reshape(blocks, page, KV_HEADS, HEAD_DIM)
    v_pages[order] = v.reshape(blocks, page, KV_HEADS, HEAD_DIM)
    return q, k_pages, v_pages, seqlens, order.to(torch.int32).view(batch, -1)


def decode_rows(label: str) -> list[dict]:
    rows = []
    for batch, context, page in DECODE:
        q, k_cache, v_cache, seqlens, block_table = decode_inputs(batch, context, page)
        providers = {"flashkernel": lambda: flashkernel.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table)}
        if hasattr(flashkernel, "DecodePlan"):
            plan = flashkernel.DecodePlan(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table)
            providers["flashkernel_plan_run"] = lambda: plan.run(q, k_cache, v_cache)
            if "out" in inspect.signature(plan.run).parameters:
                out = torch.empty_like(q)
                providers["flashkernel_plan_run_out"] = lambda: plan.run(q, k_cache, v_cache, out=out)
        qt = q.transpose(1, 2).contiguous()
        if page == 0:
            kt, vt = (x.transpose(1, 2).contiguous() for x in (k_cache, v_cache))
        else:  # cuDNN has no pages: the same step over a contiguous cache
            kt, vt = (torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))

        def cudnn(qt=qt, kt=kt, vt=vt):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        if page == 0:
            providers["sdpa_cudnn"] = cudnn
        rows += step_rows("decode", label, batch, context, page, providers, cudnn)
        del q, k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def step_rows(workload: str, label: str, batch: int, context: int, page: int, providers: dict,
              cudnn) -> list[dict]:
    """One row of :func:`measure` per provider of a decode step (SDPA's under its cuDNN backend),
    with its host time paired with ``cudnn``'s call (:func:`paired_host_us`)."""
    rows = []
    for name, fn in providers.items():
        timer_context = cudnn_context if name == "sdpa_cudnn" else contextlib.nullcontext
        row = dict(workload=workload, label=label, provider=name, batch=batch, context=context, page_size=page,
                   **measure(fn, timer_context))
        rows.append(row)
    paired = paired_host_us(providers, cudnn)
    for row in rows:
        row["host_paired_us"], row["host_vs_cudnn"] = paired[row["provider"]]
        print(f"{workload} b={batch:2d} ctx={context:5d} page={page:2d} {row['provider']:24s} " + cells(row)
              + f" host/cuDNN {row['host_vs_cudnn']:5.2f}", flush=True)
    return rows


def append_rows(label: str) -> list[dict]:
    """Decode steps that append the new token's key and value (what a serving loop calls): the
    caches hold ``context`` tokens and room for one more, each call writes slot ``context`` and
    attends to ``context + 1`` keys. SDPA gets the same step as a cache write (``index_copy_``,
    as transformers' static cache does) plus its cuDNN call."""
    rows = []
    for batch, context, page in DECODE:
        q, k_cache, v_cache, seqlens, block_table = decode_inputs(batch, context + (page or 1), page)
        seqlens.fill_(context)
        k = torch.randn(batch, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        providers = {"flashkernel": lambda: flashkernel.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, block_table=block_table)}
        if hasattr(flashkernel, "DecodePlan"):
            plan = flashkernel.DecodePlan(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                          block_table=block_table)
            providers["flashkernel_plan_run"] = lambda: plan.run(q, k_cache, v_cache, k, v)
            if "out" in inspect.signature(plan.run).parameters:
                out = torch.empty_like(q)
                providers["flashkernel_plan_run_out"] = lambda: plan.run(q, k_cache, v_cache, k, v, out=out)
        qt, kn, vn = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        if page == 0:
            kt, vt = (x.transpose(1, 2).contiguous() for x in (k_cache[:, :context + 1], v_cache[:, :context + 1]))
        else:  # cuDNN has no pages: the same step over a contiguous cache
            kt, vt = (torch.randn(batch, KV_HEADS, context + 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
        slot = torch.tensor([context], device="cuda")

        def sdpa_step(qt=qt, kt=kt, vt=vt, kn=kn, vn=vn, slot=slot):
            kt.index_copy_(2, slot, kn)
            vt.index_copy_(2, slot, vn)
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        if page == 0:
            providers["sdpa_cudnn"] = sdpa_step
        rows += step_rows("append", label, batch, context, page, providers, sdpa_step)
        del q, k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


APPEND_BACKEND_PAGES, APPEND_BACKEND_BATCHES = (16, 64), (1, 2, 4, 8, 16, 32, 64)
APPEND_BACKEND_CONTEXTS = (512, 1024, 2048, 4096, 8192)


def append_backend_rows(label: str) -> list[dict]:
    """GPU time (CUDA-graph replays) of an appending decode step over pages, per backend as it
    runs under capture: ``"triton"`` (the append fused into the decode kernel), ``"gluon"`` (its
    append a launch of its own) and ``"auto"`` (the rule of ``dispatch.gluon_decode_wanted``);
    batch x context up to 256k keys. The data behind that rule."""
    rows = []
    for page in APPEND_BACKEND_PAGES:
        for batch in APPEND_BACKEND_BATCHES:
            for context in APPEND_BACKEND_CONTEXTS:
                if batch * context > 256 * 1024:
                    continue
                q, k_cache, v_cache, seqlens, block_table = decode_inputs(batch, context + page, page)
                seqlens.fill_(context)
                k = torch.randn(batch, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                times = {}
                for backend in ("triton", "gluon", "auto"):
                    times[backend] = graph_us(lambda: flashkernel.flash_attn_with_kvcache(
                        q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, block_table=block_table,
                        backend=backend))
                    rows.append(dict(workload="append-backends", label=label, provider=backend, batch=batch,
                                     context=context, page_size=page, gpu_us=times[backend]))
                print(f"append-backends page={page:2d} b={batch:2d} ctx={context:5d} "
                      + " ".join(f"{name} {'   -  ' if t is None else f'{t:6.1f}'}" for name, t in times.items()),
                      flush=True)
                del q, k_cache, v_cache
                torch.cuda.empty_cache()
    return rows


# ---- prefill ------------------------------------------------------------------------------------


def prefill_rows(label: str) -> list[dict]:
    rows = []
    for head_dim, seqlen, causal in PREFILL:
        batch, heads = 16384 // seqlen, 2048 // head_dim
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        providers = {
            "flashkernel": lambda: flashkernel.flash_attn_func(q, k, v, causal=causal),
            "sdpa_cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)}
        rows += prefill_provider_rows("prefill", label, providers, head_dim=head_dim, seqlen=seqlen, causal=causal,
                                      batch=batch, heads=heads)
    for seqlen in PREFILL_SHORT:
        q = torch.randn(1, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, seqlen, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        providers = {
            "flashkernel": lambda: flashkernel.flash_attn_func(q, k, v, causal=True),
            "sdpa_cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                                   enable_gqa=True)}
        rows += prefill_provider_rows("prefill-short", label, providers, head_dim=HEAD_DIM, seqlen=seqlen, causal=True,
                                      batch=1, heads=HEADS)
    return rows


def prefill_provider_rows(workload: str, label: str, providers: dict, **shape) -> list[dict]:
    """One row of :func:`measure` per provider of a prefill call (SDPA's under its cuDNN backend),
    with its host time paired with cuDNN's call (:func:`paired_host_us`)."""
    rows = []
    for name, fn in providers.items():
        context = cudnn_context if name == "sdpa_cudnn" else contextlib.nullcontext
        rows.append(dict(workload=workload, label=label, provider=name, **shape, **measure(fn, context)))
    paired = paired_host_us(providers, providers["sdpa_cudnn"])
    for row in rows:
        row["host_paired_us"], row["host_vs_cudnn"] = paired[row["provider"]]
        print(f"{workload} b={shape['batch']:2d} d={shape['head_dim']:3d} s={shape['seqlen']:4d} "
              f"{'causal' if shape['causal'] else 'full  '} {row['provider']:22s} " + cells(row)
              + f" host/cuDNN {row['host_vs_cudnn']:5.2f}", flush=True)
    return rows


# ---- a compiled decode loop ----------------------------------------------------------------------


class _LayersOfCaches(torch.nn.Module):
    """A module holding random ``k_caches`` and ``v_caches`` buffers of ``shape`` (layers first)."""

    def __init__(self, shape: tuple, device, dtype):
        super().__init__()
        self.register_buffer("k_caches", torch.randn(shape, device=device, dtype=dtype))
        self.register_buffer("v_caches", torch.randn(shape, device=device, dtype=dtype))


class AttentionOnlyDecoder(_LayersOfCaches):
    """``LAYERS`` layers, each appending one token to its own cache and attending to it."""

    def __init__(self, batch: int, capacity: int, layers: int = LAYERS, device="cuda", dtype=torch.bfloat16):
        super().__init__((layers, batch, capacity, KV_HEADS, HEAD_DIM), device, dtype)

    def forward(self, q, k, v, seqlens):
        """``q [layers, B, 1, Hq, D]``, ``k, v [layers, B, 1, Hkv, D]``, ``seqlens [B]`` int32 (the
        keys before this step's) -> ``[B, 1, Hq, D]``."""
        out = q[0]
        for layer in range(self.k_caches.shape[0]):
            out = flashkernel.flash_attn_with_kvcache(q[layer] + out, self.k_caches[layer], self.v_caches[layer],
                                                      k=k[layer], v=v[layer], cache_seqlens=seqlens)
        return out


class SdpaStaticCacheDecoder(_LayersOfCaches):
    """The same loop as transformers' static cache runs it on SDPA: per layer the new token is
    written at its position (``index_copy_``, every sequence of the batch at the same length) and
    SDPA attends over the whole ``[B, Hkv, capacity, D]`` cache, its KV heads repeated for the query
    heads, under a key-padding mask built once per step (SDPA's own backend choice for a masked
    call)."""

    def __init__(self, batch: int, capacity: int, layers: int = LAYERS, device="cuda", dtype=torch.bfloat16):
        super().__init__((layers, batch, KV_HEADS, capacity, HEAD_DIM), device, dtype)

    def forward(self, q, k, v, seqlens):
        """As :meth:`AttentionOnlyDecoder.forward`; every ``seqlens`` entry equal."""
        position = seqlens[:1].long()
        keys = torch.arange(self.k_caches.shape[3], device=q.device)
        mask = (keys[None, :] <= seqlens[:, None])[:, None, None, :]
        out = q[0]
        for layer in range(self.k_caches.shape[0]):
            self.k_caches[layer].index_copy_(2, position, k[layer].transpose(1, 2))
            self.v_caches[layer].index_copy_(2, position, v[layer].transpose(1, 2))
            attended = torch.nn.functional.scaled_dot_product_attention(
                (q[layer] + out).transpose(1, 2), repeat_kv_heads(self.k_caches[layer]),
                repeat_kv_heads(self.v_caches[layer]), attn_mask=mask)
            out = attended.transpose(1, 2)
        return out


def repeat_kv_heads(cache: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, S, D] -> [B, Hq, S, D]``, each KV head repeated for its query heads, as
    transformers does before a masked SDPA call (SDPA's ``enable_gqa`` with a mask runs its math
    kernel)."""
    batch, kv_heads, length, head_dim = cache.shape
    return cache[:, :, None].expand(batch, kv_heads, HEADS // kv_heads, length, head_dim).reshape(
        batch, HEADS, length, head_dim)


COMPILED_MODELS = {"flashkernel": AttentionOnlyDecoder, "sdpa": SdpaStaticCacheDecoder}
COMPILED_CAPACITY = 1152  # keys per cache: the 1k context, 60 steps, a multiple of 64 (SDPA's masked kernels want
                          # an aligned key count)


def compiled_rows(label: str) -> list[dict]:
    """Time per step of the 32-layer decode loop for each of :data:`COMPILED_MODELS`, eager,
    under ``torch.compile`` and under ``torch.compile(mode="reduce-overhead")``: medians of 30
    steps after 30 of warm-up, every sequence one key longer each step."""
    rows = []
    for batch in (1, 8):
        context, steps = 1024, 30
        inputs = [torch.randn(LAYERS, batch, 1, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                  for h in (HEADS, KV_HEADS, KV_HEADS)]
        for name, module in COMPILED_MODELS.items():
            for mode in ("eager", "compiled", "reduce-overhead"):
                model = module(batch, COMPILED_CAPACITY)
                if mode == "compiled":
                    model = torch.compile(model, fullgraph=True)
                elif mode == "reduce-overhead":
                    model = torch.compile(model, fullgraph=True, mode="reduce-overhead")
                seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                row = dict(workload="compiled", label=label, provider=f"{name}_{mode}", batch=batch,
                           context=context, layers=LAYERS)
                try:
                    row["step_us"] = step_median_us(model, inputs, seqlens, steps)
                except Exception as exc:  # noqa: BLE001 - report the failure as the row
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"compiled b={batch} {name:11s} {mode:16s} " + (
                    f"{row['step_us']:9.1f} us/step" if "step_us" in row else row["error"]), flush=True)
                rows.append(row)
                del model
                torch._dynamo.reset()
    return rows


def step_median_us(model, inputs, seqlens, steps: int) -> float:
    """Median time per step (CUDA events around each call) of ``steps`` steps after as many of
    warm-up (compilation included), ``seqlens`` one longer after each step."""
    times = []
    for step in range(2 * steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(*inputs, seqlens)
        end.record()
        seqlens += 1
        torch.cuda.synchronize()
        if step >= steps:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def op_rows(label: str) -> list[dict]:
    """Host time per call of the registered cache op (``torch.ops.flashkernel.kvcache_fwd``: what
    a model compiled without CUDA graphs calls per layer) against the eager function on the same
    step (batch 1 and 8, context 1k, appending one token, as a compiled layer's call does), in
    :data:`PAIRED_ROUNDS` alternating rounds (:func:`paired_host_us`, the eager function as the
    reference): medians, and the median of the rounds' ratios."""
    rows = []
    for batch in (1, 8):
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k_cache, v_cache = (torch.randn(batch, 1040, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        k, v = (torch.randn(batch, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        seqlens = torch.full((batch,), 1024, dtype=torch.int32, device="cuda")
        calls = {
            "flashkernel": lambda: flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                                                      cache_seqlens=seqlens, causal=True),
            "flashkernel_op": lambda: torch.ops.flashkernel.kvcache_fwd(
                q, k_cache, v_cache, k, v, seqlens, None, None, None, None, None, None, True, HEAD_DIM ** -0.5, -1, -1,
                0.0, 0, False, "auto"),
        }
        for call in calls.values():
            for _ in range(5):
                call()
        paired = paired_host_us(calls, calls["flashkernel"], contextlib.nullcontext)
        for name in calls:
            row = dict(workload="op", label=label, provider=name, batch=batch, context=1024,
                       host_us=paired[name][0], host_vs_eager=1.0 if name == "flashkernel" else paired[name][1])
            print(f"op b={batch} {name:16s} host {row['host_us']:7.1f} us  vs eager {row['host_vs_eager']:5.2f}",
                  flush=True)
            rows.append(row)
    return rows


# ---- a cache that grows every step -----------------------------------------------------------


def growing_step(batch: int, length: int):
    """One step's tensors for each layer: ``q [B, Hq, 1, D]``, ``k, v [B, Hkv, S, D]`` (fresh:
    transformers' dynamic cache concatenates a new tensor each step), spans ``[B, 3]``."""
    layers = [tuple(torch.randn(batch, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
                    for heads, n in ((HEADS, 1), (KV_HEADS, length), (KV_HEADS, length)))
              for _ in range(GROWING_LAYERS)]
    spans = torch.tensor([[0, length, length]] * batch, dtype=torch.int32, device="cuda")
    return layers, spans


def growing_rows(label: str) -> list[dict]:
    calls = {
        "flashkernel": lambda q, k, v, spans: flashkernel.flash_attn_with_kvcache(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=spans[:, 2],
            cache_leftpad=spans[:, 0], causal=True),
        # SDPA's own backend choice, as transformers' "sdpa" gets it: its cuDNN backend builds a
        # graph per new length (~50 ms per step's first call on the H200 host).
        "sdpa": lambda q, k, v, spans: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    rows = []
    for batch in (1, 8):
        for name, call in calls.items():
            first, rest = [], []
            for step in range(GROWING_STEPS + 5):
                layers, spans = growing_step(batch, GROWING_CONTEXT + step)
                torch.cuda.synchronize()
                for layer, tensors in enumerate(layers):
                    start = time.perf_counter()
                    call(*tensors, spans)
                    (first if layer == 0 else rest).append((time.perf_counter() - start) * 1e6)
                torch.cuda.synchronize()
            first, rest = first[5:], rest[5 * (GROWING_LAYERS - 1):]  # after 5 warm-up steps
            row = dict(workload="growing", label=label, provider=name, batch=batch, context=GROWING_CONTEXT,
                       layers=GROWING_LAYERS, first_call_us=statistics.median(first),
                       other_calls_us=statistics.median(rest))
            print(f"growing b={batch} {name:12s} first call {row['first_call_us']:7.1f} us, other layers "
                  f"{row['other_calls_us']:7.1f} us", flush=True)
            rows.append(row)
    return rows


def cells(row: dict) -> str:
    def fmt(x):
        return "    -  " if x is None else f"{x:7.1f}"
    return " ".join(f"{key[:-3]} {fmt(row[key])}" for key in ("eager_us", "wall_us", "host_us", "gpu_us"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--label", default="current", help="name of this build in the results")
    parser.add_argument("--sections", nargs="+", default=["decode", "append", "prefill", "op", "compiled", "growing"],
                        choices=("decode", "append", "append-backends", "prefill", "op", "compiled", "growing"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for section in args.sections:
        rows += {"decode": decode_rows, "append": append_rows, "append-backends": append_backend_rows,
                 "prefill": prefill_rows, "op": op_rows, "compiled": compiled_rows,
                 "growing": growing_rows}[section](args.label)
    doc = dict(command=" ".join(sys.argv), label=args.label, gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               flashkernel_path=flashkernel.__file__, time=time.strftime("%Y-%m-%d %H:%M:%S"), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
