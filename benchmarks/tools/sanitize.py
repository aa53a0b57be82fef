"""compute-sanitizer over every kernel family: memcheck, racecheck, synccheck and initcheck.

    PYTHONPATH=src python benchmarks/tools/sanitize.py --out DIR            # 4 tools x every family
    PYTHONPATH=src python benchmarks/tools/sanitize.py --tools memcheck --families triton_decode
    PYTHONPATH=src python benchmarks/tools/sanitize.py --run all           # the workload alone, no sanitizer
    PYTHONPATH=src python benchmarks/tools/sanitize.py --list

Each tool runs once, over one Python that runs every family's cases (so the CUDA context, the
torch import and Triton's compile cache are paid once per tool, not per family), and the tools
run side by side (``--serial``: one after another); a family's cases start with a ``== family``
line on stdout, and every sanitizer report names its kernel.
Writes ``DIR/<tool>.log`` (the sanitizer's report), ``DIR/<tool>.out`` (the workload's output)
and ``DIR/summary.json`` (per tool: exit status, errors, seconds, the first reports). Exit status
1 when a tool reports an error or a workload fails.

Families (``FAMILIES``): the Triton prefill kernel (pointer and TMA loads, every variant, fp32,
padded views), the Gluon prefill kernel in each schedule (plain, persistent, causal pairs,
ping-pong, and the 3-warpgroup and per-warpgroup-tile variants), packed sequences, the Triton
decode kernel (contiguous and paged caches from pages of 1 to 128, block tables with exactly the
columns the capacity needs, splits past the last key, key starts, variants), the append kernel
(including appends the block table cannot place), the baseline decode kernel, the Gluon decode
kernel, the LSE combine (parts with no key whose outputs were never written), the three naive
kernels of ``standard_attention`` and the backward kernels. Shapes are small (the sanitizers
slow kernels 10 to 1000 times) but cover the edges: partial tiles, rows that see no key, empty
sequences and splits.

Settings per tool: memcheck and initcheck run with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, so each
tensor is its own allocation (a read past a tensor's end leaves every allocation; a fresh output
is uninitialized until a kernel writes it). Every input is fully written before a call, caches
included: the Gluon decode kernel loads whole tiles with TMA and discards the slots past each
sequence's length (the Triton kernels mask those loads), so a cache that was never written
there would show as uninitialized reads of memory whose values are never used. Two reports
are the compiler's and are told apart (``TOOL_ENV`` tells the workload its tool): racecheck's
on Triton's warp-specialization state bytes of the Gluon kernels (``known_hazards``, every
racecheck hazard is printed to classify it), and initcheck's on the atomic copy of in-kernel TMA
descriptors to global scratch (zero-filled under initcheck).
``--families`` / ``--tools`` select; ``--sanitizer`` names the binary (default:
``$COMPUTE_SANITIZER``, then ``PATH``, ``$CUDA_HOME/bin`` and ``/usr/local/cuda*/bin``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
NO_CACHING = ("memcheck", "initcheck")
TOOL_OPTIONS = {"racecheck": ["--racecheck-report", "all"], "memcheck": ["--check-bulk-copy", "yes"],
                "initcheck": ["--check-bulk-copy", "yes"]}
PRINT_LIMIT = {"racecheck": 100000}  # every hazard printed: each is classified (known_hazards)
TOOL_ENV = "FLASHKERNEL_SANITIZE_TOOL"  # the workload's tool, set for it by ToolRun

# Two reports are the compiler's, not the kernels', and are told apart from real ones:
# * racecheck on the Gluon kernels: Triton's warp specialization keeps one state byte per worker
#   warp in shared memory; the default warps write it and the workers read it (one LDS.U8 in the
#   dispatch loop at the kernel's start), separated by full-CTA barriers (bar.sync 1) that
#   racecheck does not count as ordering them. A hazard whose read is that load is counted under
#   ``known_hazards``, not ``errors`` (docs/perf-notes.md, "Reliability": the SASS read).
# * initcheck on in-kernel TMA descriptors: the descriptor is copied to global scratch by one
#   atomic exchange per word, whose discarded old value initcheck counts as a read of
#   uninitialized memory. Under initcheck the workload's scratch is zero-filled.
# * initcheck on outputs stored through TMA: even with --check-bulk-copy, initcheck does not count
#   a TMA store as a write, so copying such an output to the host reads "uninitialized" memory.
#   Under initcheck the library's outputs and temporaries start as NaN (``fuzz.poisoned_outputs``):
#   an element no kernel wrote then fails the float64 check instead.
# TMA loads and stores are bounds-checked by memcheck only with --check-bulk-copy.
DISPATCH_LOOP_END = 0x400  # the workers' dispatch load lies in the first instructions


# --- the workload --------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _device() -> str:
    return "cuda" if _torch().cuda.is_available() else "cpu"


def randn(*shape, dtype="bfloat16"):
    torch = _torch()
    return torch.randn(*shape, dtype=getattr(torch, dtype), device=_device())


def on_cpu(*tensors, **kwargs):
    """Copies on the CPU: the workload's checks run the float64 reference there, so the sanitized
    process launches no GPU kernels but ours and a few copies and fills."""
    moved = [t.cpu() if hasattr(t, "cpu") else t for t in tensors]
    return moved, {k: v.cpu() if hasattr(v, "cpu") else v for k, v in kwargs.items()}


def check_dense(out, lse, q, k, v, **kwargs) -> None:
    """``out``/``lse`` of q, k, v against the float64 reference (the fuzzer's rule)."""
    from flashkernel.bench.fuzz_checks import check_rows

    (out, lse, q, k, v), kwargs = on_cpu(out, lse, q, k, v, **kwargs)
    outcome = check_rows(out, lse, q, k, v, None, **kwargs)
    if outcome.problems:
        raise AssertionError("; ".join(outcome.problems))


def check_decode(out, lse, q, k_cache, v_cache, seqlens, **kwargs) -> None:
    from flashkernel import reference
    from flashkernel.bench.fuzz_checks import compare, logit_bound

    (out, lse, q, k_cache, v_cache, seqlens), kwargs = on_cpu(out, lse, q, k_cache, v_cache, seqlens, **kwargs)
    truth, truth_lse = reference.attention_with_kvcache(q, k_cache, v_cache, seqlens, **kwargs)
    same_dtype, _ = reference.attention_with_kvcache(q, k_cache, v_cache, seqlens, upcast=False, **kwargs)
    keys = [k_cache] + ([kwargs["k"]] if kwargs.get("k") is not None else [])
    outcome = compare(out, lse, truth, truth_lse, same_dtype, q.dtype, logit_bound(q, keys, kwargs.get("softmax_scale")))
    if outcome.problems:
        raise AssertionError("; ".join(outcome.problems))


def padded(x):
    """``x`` as a view into a NaN-filled buffer with a row, a head and 8 head-dim columns around it."""
    torch = _torch()
    batch, seq, heads, dim = x.shape
    buf = torch.full((batch, seq + 2, heads + 1, dim + 8), math.nan, dtype=x.dtype, device=x.device)
    view = buf[:, 1:seq + 1, 1:, :dim]
    view.copy_(x)
    return view


def prefill_case(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype="bfloat16", causal=True, views=False,
                 backend="triton", **variants):
    import flashkernel

    q = randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k, v = (randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    if views:
        q, k, v = padded(q), padded(k), padded(v)
    out, lse = flashkernel.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend=backend, **variants)
    check_dense(out, lse, q, k, v, causal=causal, **variants)


def all_variants(heads, batch=None):
    torch = _torch()
    slopes = torch.rand((batch, heads) if batch else (heads,), device=_device())
    return dict(window_size=(13, 4), softcap=5.0, alibi_slopes=slopes, sinks=torch.randn(heads, device=_device()))


def triton_prefill():
    yield "causal gqa, partial tiles", lambda: prefill_case(2, 129, 200, 4, 2, 64)
    yield "rows that see no key, padded head dim", lambda: prefill_case(1, 200, 77, 2, 1, 72, "float16")
    yield "TMA loads (4100 keys)", lambda: prefill_case(1, 64, 4100, 2, 2, 128, causal=False)
    yield "float32", lambda: prefill_case(1, 100, 100, 2, 2, 32, "float32")
    yield "head dim 256", lambda: prefill_case(1, 65, 130, 2, 1, 256, causal=False)
    yield "head dim 8", lambda: prefill_case(1, 33, 33, 2, 2, 8, "float16")
    yield "views into NaN-filled buffers", lambda: prefill_case(1, 70, 90, 2, 1, 128, views=True)
    yield "window, softcap, alibi, sinks", lambda: prefill_case(2, 90, 150, 4, 2, 64, "float16",
                                                                **all_variants(4, batch=2))


def gluon_schedules():
    """Named Gluon prefill configurations: ``(name, head dim, causal, GluonConfig)``."""
    from flashkernel.kernels import dispatch

    gluon = dispatch._gluon_prefill_module()
    replace = dataclasses.replace
    return [
        ("plain", 128, False, gluon.CONFIGS[128]),
        ("plain simple loop", 64, True, replace(gluon.CONFIGS[64], pipeline=False)),
        ("ping-pong", 128, True, replace(gluon.CONFIGS[128], pingpong=True)),
        ("ping-pong", 256, False, replace(gluon.CONFIGS[256], pingpong=True)),
        ("persistent", 128, False, replace(gluon.PERSISTENT_CONFIGS[128], max_programs=3)),
        ("persistent snake", 256, True, replace(gluon.PERSISTENT_CONFIGS[256], causal_pairs=False, max_programs=3)),
        ("causal pairs", 128, True, replace(gluon.PERSISTENT_CONFIGS[128], causal_pairs=True, max_programs=3)),
        ("causal pairs, per-warpgroup tiles", 256, True,
         replace(gluon.PERSISTENT_CONFIGS[256], causal_pairs=True, wg_tiles=True, max_programs=3)),
        ("causal pairs, ping-pong", 64, True,
         replace(gluon.PERSISTENT_CONFIGS[64], pingpong=True, causal_pairs=True, max_programs=3)),
        ("3 warpgroups, persistent", 64, False, replace(gluon.D64_3WG, persistent=True, max_programs=3)),
    ]


def gluon_case(head_dim, causal, config, seqlen_q=200, seqlen_k=260):
    torch = _torch()
    from flashkernel.kernels import dispatch

    gluon = dispatch._gluon_prefill_module()
    q = randn(2, seqlen_q, 4, head_dim)
    k, v = (randn(2, seqlen_k, 2, head_dim) for _ in range(2))
    out = torch.full_like(q, math.nan)
    lse = torch.full((2, 4, seqlen_q), math.nan, device=q.device)
    gluon.gluon_attention_forward(q, k, v, out, lse, causal=causal, softmax_scale=head_dim ** -0.5, config=config)
    check_dense(out, lse, q, k, v, causal=causal)


def gluon_prefill():
    if not _hopper("gluon.prefill"):
        return
    for name, head_dim, causal, config in gluon_schedules():
        label = f"{name}, d{head_dim}{' causal' if causal else ''}"
        yield label, lambda d=head_dim, c=causal, cfg=config: gluon_case(d, c, cfg)
    yield "uneven causal (63 x 300), persistent", lambda: gluon_case(
        128, True, dataclasses.replace(gluon_schedules()[4][3], max_programs=2), 63, 300)
    yield "flash_attn_func's own choice (views)", lambda: prefill_case(1, 130, 130, 4, 2, 128, views=True,
                                                                        backend="gluon")


def _hopper(module: str) -> bool:
    from flashkernel.kernels import dispatch

    torch = _torch()
    if not torch.cuda.is_available():
        print("  skipped: needs a CUDA GPU")
        return False
    probe = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
    reason = dispatch._gluon_refusal(probe, dispatch.optional_kernel_module(module))
    if reason:
        print(f"  skipped: {reason}")
    return reason is None


def varlen_case(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype="bfloat16", causal=True, **variants):
    import flashkernel
    from flashkernel.bench.check import cumulative

    torch = _torch()
    q = randn(sum(lengths_q), heads, head_dim, dtype=dtype)
    k, v = (randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype) for _ in range(2))
    cu_q, cu_k = cumulative(lengths_q, q.device), cumulative(lengths_k, q.device)
    out, lse = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                                  return_lse=True, **variants)
    for b in range(len(lengths_q)):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        if q1 > q0 and k1 > k0:
            one = dict(variants)
            if "alibi_slopes" in one and one["alibi_slopes"].dim() == 2:
                one["alibi_slopes"] = one["alibi_slopes"][b]
            check_dense(out[None, q0:q1], lse[None, :, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                        causal=causal, **one)
        elif q1 > q0 and not torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1])):
            raise AssertionError(f"sequence {b} has no key but a non-zero output")


def varlen():
    yield "empty sequences, gqa", lambda: varlen_case([5, 0, 130, 17], [5, 12, 200, 0], 4, 2, 64, "float16")
    yield "17 sequences", lambda: varlen_case([3, 40, 1, 0, 9] * 3 + [65, 2], [7, 33, 1, 5, 0] * 3 + [64, 70], 2, 1, 32)
    yield "TMA loads (4100 keys)", lambda: varlen_case([30, 64], [4100, 64], 2, 2, 128, causal=False)
    yield "variants", lambda: varlen_case([40, 3], [2, 30], 4, 2, 64, "float16", **all_variants(4, batch=2))
    yield "float32", lambda: varlen_case([20, 33], [33, 20], 2, 1, 40, "float32", causal=False)


def make_cache(lengths, capacity, kv_heads, head_dim, page_size, dtype="bfloat16", extra_pages=3, exact_table=True):
    """Caches with every slot written, and for pages a shuffled block table with exactly the
    columns the capacity needs (its own allocation: a read past a row's end leaves it)."""
    torch = _torch()
    batch = len(lengths)
    if page_size:
        columns = -(-capacity // page_size)
        pool = batch * columns + extra_pages
        shape = (pool, page_size, kv_heads, head_dim)
        block_table = torch.randperm(pool, device=_device())[:batch * columns].to(torch.int32).view(batch, columns)
        block_table = block_table.contiguous() if exact_table else block_table
    else:
        shape, block_table = (batch, capacity, kv_heads, head_dim), None
    k_cache, v_cache = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=_device())
    return k_cache, v_cache, block_table, seqlens


def decode_case(lengths, capacity, seqlen_new, heads, kv_heads, head_dim, page_size=0, append=True, dtype="bfloat16",
                num_splits=0, backend="triton", causal=True, leftpad=None, **variants):
    import flashkernel

    torch = _torch()
    k_cache, v_cache, block_table, seqlens = make_cache(lengths, capacity, kv_heads, head_dim, page_size, dtype)
    q = randn(len(lengths), seqlen_new, heads, head_dim, dtype=dtype)
    k = v = None
    if append:
        k, v = (randn(len(lengths), seqlen_new, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    starts = torch.tensor(leftpad, dtype=torch.int32, device=q.device) if leftpad else None
    before = (k_cache.clone(), v_cache.clone())
    out, lse = flashkernel.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, block_table=block_table, cache_leftpad=starts,
        causal=causal, num_splits=num_splits, return_lse=True, backend=backend, **variants)
    check_decode(out, lse, q, *before, seqlens, k=k, v=v, block_table=block_table, cache_leftpad=starts, causal=causal,
                 **variants)


def triton_decode():
    # The block-table and split edges of the first memcheck of the decode kernel (32/8 heads, d128).
    yield "pages of 128, full table, auto splits", lambda: decode_case([2176], 2176, 1, 32, 8, 128, 128, append=False)
    yield "pages of 128, partial length", lambda: decode_case([999], 2176, 1, 32, 8, 128, 128)
    yield "pages of 128, 64 splits (splits past the end)", lambda: decode_case([999], 2176, 1, 32, 8, 128, 128,
                                                                               num_splits=64)
    yield "pages of 16, 4 new tokens, 32 splits", lambda: decode_case([496], 1008, 4, 32, 8, 128, 16, num_splits=32)
    yield "contiguous, capacity not a whole tile", lambda: decode_case([998], 999, 1, 32, 8, 128, num_splits=5)
    yield "pages of 1 (row gather), empty sequence", lambda: decode_case([0, 37], 48, 2, 4, 2, 64, 1, dtype="float16")
    yield "16 new tokens x group 8 (128 rows)", lambda: decode_case([300, 5], 336, 16, 16, 2, 64, 32)
    yield "key starts, not causal", lambda: decode_case([100, 60], 128, 3, 4, 2, 64, 16, causal=False,
                                                        leftpad=[30, 63])
    yield "variants", lambda: decode_case([70, 0, 129], 160, 2, 4, 2, 64, 8, dtype="float16", num_splits=3,
                                          **all_variants(4, batch=3))
    yield "float32, head dim 40", lambda: decode_case([50, 9], 64, 1, 2, 1, 40, dtype="float32", num_splits=2)
    yield "head dim 256", lambda: decode_case([200], 256, 1, 8, 2, 256, 64)


def append():
    yield "appends the block table cannot place are skipped", skipped_appends
    yield "contiguous append", lambda: decode_case([0, 5, 60], 64, 4, 4, 4, 64, dtype="float16")


def skipped_appends():
    """Appends through the block table, including ones it cannot place (past the capacity, or on
    an entry of -1): skipped, nothing else written."""
    import flashkernel

    torch = _torch()
    k_cache, v_cache, block_table, seqlens = make_cache([30, 14], 32, 2, 64, 16, "float16")
    block_table[1, 1] = -1  # sequence 1's second page is gone: its appends past 16 keys are skipped
    k, v = (randn(2, 4, 2, 64, dtype="float16") for _ in range(2))
    q = randn(2, 4, 4, 64, dtype="float16")
    expected = k_cache.clone()
    flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, block_table=block_table,
                                       validate=False)
    expected[block_table[0, 1].item(), 14:16] = k[0, :2]  # sequence 0: keys 30, 31; 32, 33 exceed the capacity
    expected[block_table[1, 0].item(), 14:16] = k[1, :2]  # sequence 1: keys 14, 15; 16, 17 have no page
    if not torch.equal(k_cache, expected):
        raise AssertionError("the append wrote somewhere other than the slots it could place")


def baseline_decode():
    from flashkernel.kernels import decode

    torch = _torch()
    for page_size in (0, 16):
        k_cache, v_cache, block_table, seqlens = make_cache([100, 7], 128, 2, 64, page_size, "float16")
        q = randn(2, 2, 4, 64, dtype="float16")
        out = torch.full_like(q, math.nan)
        lse = torch.full((2, 4, 2), math.nan, device=q.device)

        def run(kc=k_cache, vc=v_cache, bt=block_table, sl=seqlens, q=q, out=out, lse=lse):
            decode.baseline_decode(q, kc, vc, sl, bt, out, lse, causal=True, softmax_scale=0.125)
            check_decode(out, lse, q, kc, vc, sl, block_table=bt, causal=True, softmax_scale=0.125)

        yield f"baseline kernel, {'pages of 16' if page_size else 'contiguous'}", run


def gluon_decode():
    if not _hopper("gluon.decode"):
        return
    yield "contiguous, auto splits", lambda: decode_case([1000, 3], 1024, 1, 32, 8, 128, backend="gluon")
    yield "pages of 16, 7 splits", lambda: decode_case([500, 0], 512, 2, 16, 8, 128, 16, num_splits=7,
                                                       backend="gluon")
    yield "pages of 128, 16 rows", lambda: decode_case([300], 384, 4, 16, 4, 64, 128, backend="gluon")
    yield "head dim 256, not causal", lambda: decode_case([77], 128, 1, 4, 2, 256, 64, causal=False,
                                                          backend="gluon", dtype="float16")


def combine_case(parts, empty_parts):
    """``combine`` of ``parts`` partial results where ``empty_parts`` have LSE -inf and outputs
    never written (it must not read them)."""
    torch = _torch()
    from flashkernel.kernels.combine import combine

    batch, seqlen, heads, dim = 2, 3, 4, 64
    out_parts = torch.empty(parts, batch, seqlen, heads, dim, dtype=torch.float32, device=_device())
    lse_parts = torch.randn(parts, batch, heads, seqlen, device=_device())
    lse_parts[list(empty_parts)] = -math.inf
    full = [p for p in range(parts) if p not in empty_parts]
    out_parts[full] = torch.randn(len(full), batch, seqlen, heads, dim, device=_device())
    out = torch.full((batch, seqlen, heads, dim), math.nan, dtype=torch.bfloat16, device=_device())
    lse = torch.full((batch, heads, seqlen), math.nan, device=_device())
    combine(out_parts, lse_parts, out, lse)
    weights = torch.softmax(lse_parts[full], dim=0)  # [P, B, H, T]
    expected = (weights.permute(0, 1, 3, 2)[..., None] * out_parts[full]).sum(0)
    if not torch.allclose(out.float(), expected, atol=2e-2, rtol=2e-2):
        raise AssertionError("combine differs from the softmax-weighted sum of its parts")
    if not torch.allclose(lse, torch.logsumexp(lse_parts[full], dim=0), atol=1e-5):
        raise AssertionError("combine's LSE differs from the log-sum-exp of its parts")


def combine():
    yield "5 parts, 2 empty (never written)", lambda: combine_case(5, (1, 3))
    yield "300 parts (chunks of parts), 100 empty", lambda: combine_case(300, tuple(range(0, 300, 3)))


def naive():
    import flashkernel

    def case(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, causal):
        q = randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
        k, v = (randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype) for _ in range(2))
        out, lse = flashkernel.standard_attention(q, k, v, causal=causal, return_lse=True)
        check_dense(out, lse, q, k, v, causal=causal)

    yield "causal, rows that see no key", lambda: case(2, 70, 33, 4, 2, 64, "bfloat16", True)
    yield "1100 keys (two softmax blocks), float32", lambda: case(1, 20, 1100, 2, 1, 40, "float32", False)


def backward():
    import flashkernel

    torch = _torch()
    from flashkernel.bench.check import cumulative

    def dense(causal, dtype, head_dim, **variants):
        q = randn(2, 70, 4, head_dim, dtype=dtype).requires_grad_()
        k, v = (randn(2, 90, 2, head_dim, dtype=dtype).requires_grad_() for _ in range(2))
        out = flashkernel.flash_attn_func(q, k, v, causal=causal, **variants)
        out.backward(torch.randn_like(out))
        if not all(torch.isfinite(x.grad).all() for x in (q, k, v)):
            raise AssertionError("non-finite gradient")

    def packed():
        lengths = [5, 0, 70, 33]
        q = randn(sum(lengths), 4, 64).requires_grad_()
        k, v = (randn(sum(lengths), 2, 64).requires_grad_() for _ in range(2))
        cu = cumulative(lengths, q.device)
        out = flashkernel.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        out.backward(torch.randn_like(out))
        if not all(torch.isfinite(x.grad).all() for x in (q, k, v)):
            raise AssertionError("non-finite gradient")

    yield "dense causal", lambda: dense(True, "bfloat16", 64)
    yield "dense, head dim 128, not causal", lambda: dense(False, "float16", 128)
    yield "dense with every variant", lambda: dense(True, "float16", 64, **all_variants(4))
    yield "packed sequences", packed


FAMILIES = {"triton_prefill": triton_prefill, "gluon_prefill": gluon_prefill, "varlen": varlen,
            "triton_decode": triton_decode, "append": append, "baseline_decode": baseline_decode,
            "gluon_decode": gluon_decode, "combine": combine, "naive": naive, "backward": backward}


def _zero_filled_tma_scratch() -> None:
    from flashkernel.kernels import prefill

    torch = _torch()
    prefill._scratch_allocator = lambda size, alignment, stream: torch.zeros(size, dtype=torch.int8, device="cuda")


def warp_specialization_state() -> list:
    """``[kernel name, offset]`` of the workers' dispatch load (the ``LDS.U8`` of Triton's
    warp-specialization state) in every Gluon kernel this process compiled."""
    import tempfile

    import triton.backends.nvidia
    from flashkernel.kernels._common import optional_kernel_module

    cuobjdump = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    loads = set()
    for name in ("gluon.prefill", "gluon.decode"):
        module = optional_kernel_module(name)
        launcher = getattr(module, "_launch_kernel", None) if module is not None else None
        for compiled in (launcher.compiled.values() if launcher is not None else ()):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(compiled.asm["cubin"])
                cubin.flush()
                sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True).stdout
            for offset in re.findall(r"/\*([0-9a-f]+)\*/\s+LDS\.U8\b", sass):
                if int(offset, 16) < DISPATCH_LOOP_END:
                    loads.add((compiled.metadata.name, int(offset, 16)))
    return sorted(loads)


def run_workload(families) -> int:
    """Run each family's cases; prints one line per case, returns the number that failed. Under
    racecheck the last line lists the Gluon kernels' warp-specialization state
    (``WS_STATE <json>``)."""
    torch = _torch()
    tool = os.environ.get(TOOL_ENV)
    outputs = contextlib.nullcontext()
    if tool == "initcheck":
        from flashkernel.bench.fuzz import poisoned_outputs

        _zero_filled_tma_scratch()
        outputs = poisoned_outputs()
    with outputs:
        failed = _run_families(families, torch)
    if tool == "racecheck":
        print("WS_STATE " + json.dumps(warp_specialization_state()), flush=True)
    return failed


def _run_families(families, torch) -> int:
    failed = 0
    for family in families:
        print(f"== {family}", flush=True)
        torch.manual_seed(0)
        try:
            for label, case in FAMILIES[family]():
                try:
                    case()
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    print(f"  ok    {label}", flush=True)
                except Exception as exc:  # noqa: BLE001 - reported, counted, and the next case runs
                    failed += 1
                    print(f"  FAIL  {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a family whose setup failed
            failed += 1
            print(f"  FAIL  {family} setup: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"workload: {failed} failed", flush=True)
    return failed


# --- the sanitizer runs --------------------------------------------------------------------------


def find_sanitizer(explicit: str | None) -> str | None:
    candidates = [explicit, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            candidates.append(os.path.join(home, "bin", "compute-sanitizer"))
    candidates.append("/usr/local/cuda/bin/compute-sanitizer")
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


SUMMARY_PATTERNS = (
    re.compile(r"ERROR SUMMARY: (\d+) errors?"),
    re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)"),
)


REPORT = re.compile(r"=+ (?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER)(\S.*)")


HAZARD = re.compile(r"Error: Potential \w+ hazard detected at __shared__ 0x[0-9a-f]+ in block")
HAZARD_READ = re.compile(r"Read Thread \([0-9,]+\) at (\w+)\+(0x[0-9a-f]+)")
RACE = re.compile(r"Error: Race reported between Read access at (\w+)\+(0x[0-9a-f]+)")


def racecheck_reports(lines, dispatch_loads) -> tuple[int, set]:
    """``(printed, known)``: the number of racecheck's error reports (each hazard, and each pair
    of instructions it summarizes them by), and the line numbers of those whose read is a
    dispatch load of :func:`warp_specialization_state` (``dispatch_loads``: ``[kernel, offset]``
    pairs)."""
    loads = {(name, offset) for name, offset in dispatch_loads}
    printed, known = 0, set()
    for i, line in enumerate(lines):
        if HAZARD.search(line):
            reads = [m for m in map(HAZARD_READ.search, lines[i + 1:i + 3]) if m]
        else:
            reads = [m for m in [RACE.search(line)] if m]
            if not reads:
                continue
        printed += 1
        if any((m.group(1), int(m.group(2), 16)) in loads for m in reads):
            known.add(i)
    return printed, known


def parse_report(text: str, dispatch_loads=()) -> dict:
    """Errors (and racecheck warnings) from a sanitizer log, and its first reports, each with
    the line after it (where it names the kernel). Racecheck reports whose read is a dispatch
    load (:func:`racecheck_reports`) are ``known_hazards``, not errors and not among the first
    reports, when every report was printed."""
    errors = warnings = None
    lines = text.splitlines()
    printed, known = racecheck_reports(lines, dispatch_loads) if dispatch_loads else (0, set())
    for line in lines:
        for pattern in SUMMARY_PATTERNS:
            m = pattern.search(line)
            if m:
                errors = (errors or 0) + int(m.group(1))
                if m.lastindex == 2:
                    warnings = (warnings or 0) + int(m.group(2))
    if not (known and errors is not None and printed == errors):
        known = set()
    reports = []
    for i, line in enumerate(lines):
        m = REPORT.match(line)
        if m and i not in known and len(reports) < 20 and not line.startswith("=========     "):
            detail = lines[i + 1].strip("= ").strip() if i + 1 < len(lines) else ""
            reports.append(f"{m.group(1).strip()} | {detail}")
    result = {"errors": errors, "warnings": warnings, "first_reports": reports}
    if known:
        result["errors"], result["known_hazards"] = errors - len(known), len(known)
        reports.append(f"{len(known)} reports on Triton's warp-specialization state (not counted as errors)")
    return result


class ToolRun:
    """One tool's sanitized run of the workload, started at once (the tools can run side by
    side: each is its own process and CUDA context); :meth:`result` waits for it."""

    def __init__(self, sanitizer: str, tool: str, families, out_dir: Path):
        env = dict(os.environ)
        env[TOOL_ENV] = tool
        if tool in NO_CACHING:
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        self.tool, self.families = tool, list(families)
        self.log, self.output = out_dir / f"{tool}.log", out_dir / f"{tool}.out"
        self.cmd = [sanitizer, "--tool", tool, "--log-file", str(self.log), "--print-limit", str(PRINT_LIMIT.get(tool, 200)),
                    "--error-exitcode", "3", *TOOL_OPTIONS.get(tool, []), sys.executable, os.path.abspath(__file__),
                    "--run", *families]
        self.start = time.perf_counter()
        with open(self.output, "w") as stdout:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT)

    def result(self, deadline: float) -> dict:
        try:
            code = self.proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = "timeout"
        result = {"tool": self.tool, "families": self.families, "exit": code,
                  "seconds": round(time.perf_counter() - self.start, 1), "command": " ".join(self.cmd)}
        text = self.output.read_text(errors="replace")
        state = re.search(r"^WS_STATE (.*)$", text, re.M)
        loads = json.loads(state.group(1)) if state else ()
        result.update(parse_report(self.log.read_text(errors="replace") if self.log.exists() else "", loads))
        result["cases"] = len(re.findall(r"^  (ok|FAIL) ", text, re.M))
        result["cases_failed"] = len(re.findall(r"^  FAIL ", text, re.M))
        # Racecheck exits with the error code for hazards it reports, known ones included.
        exited_ok = code == 0 or (code == 3 and bool(result.get("known_hazards")))
        result["ok"] = exited_ok and result["errors"] == 0 and result["cases_failed"] == 0
        return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("sanitizer"))
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--sanitizer", help="path of compute-sanitizer")
    parser.add_argument("--timeout", type=float, default=540.0,
                        help="seconds the tools may take (each, with --serial)")
    parser.add_argument("--serial", action="store_true", help="one tool at a time (default: all at once)")
    parser.add_argument("--run", nargs="+", metavar="FAMILY", help="run the workload of these families ('all')")
    parser.add_argument("--list", action="store_true", help="list the families and their cases")
    args = parser.parse_args(argv)
    if args.list:
        for family, cases in FAMILIES.items():
            print(family)
            for label, _ in cases():
                print(f"  {label}")
        return 0
    if args.run:
        return 1 if run_workload(list(FAMILIES) if args.run == ["all"] else args.run) else 0
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("compute-sanitizer not found: pass --sanitizer, set COMPUTE_SANITIZER, or put it on PATH",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    version = _sanitizer_version(sanitizer)
    runs = []
    for tool in args.tools:
        if args.serial and runs:
            runs[-1] = runs[-1].result(time.perf_counter() + args.timeout)
        print(f"{tool}: {len(args.families)} families ...", flush=True)
        runs.append(ToolRun(sanitizer, tool, args.families, args.out))
    deadline = time.perf_counter() + args.timeout
    for run in runs:
        result = run if isinstance(run, dict) else run.result(deadline)
        result.update(sanitizer=sanitizer, version=version, environment=_environment())
        (args.out / f"{result['tool']}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"{result['tool']}: exit {result['exit']}, {result['errors']} errors, {result['cases']} cases "
              f"({result['cases_failed']} failed), {result['seconds']} s", flush=True)
        for line in result["first_reports"][:5]:
            print(f"    {line}")
    summary = merge_summary(args.out)
    print(f"sanitizer: {summary['runs']} runs, {summary['errors']} errors, {summary['cases']} cases: "
          f"{'ok' if summary['ok'] else 'FAILED'}")
    return 0 if summary["ok"] else 1


def merge_summary(out: Path) -> dict:
    """``out/summary.json`` from every ``out/<tool>.json`` there: the tools can run in separate
    sessions (``--tools memcheck racecheck``, then the others), their directories copied together."""
    tools = [json.loads((out / f"{tool}.json").read_text()) for tool in TOOLS if (out / f"{tool}.json").exists()]
    summary = {"schema": "flashkernel-sanitize/1", "runs": len(tools), "errors": sum(t["errors"] or 0 for t in tools),
               "cases": sum(t["cases"] for t in tools), "ok": len(tools) == len(TOOLS) and all(t["ok"] for t in tools),
               "tools": tools}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _environment() -> dict:
    from flashkernel.bench.results import environment

    env = environment([], "cuda" if _torch().cuda.is_available() else "cpu")
    env["command"] = " ".join(["python", "benchmarks/tools/sanitize.py", *sys.argv[1:]])
    return env


def _sanitizer_version(sanitizer: str) -> str:
    try:
        text = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return " ".join(text.split())[-80:]


if __name__ == "__main__":
    sys.exit(main())
