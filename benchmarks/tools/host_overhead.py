"""Where the host time of one eager call goes, and whether short prefill shapes are host-bound.

    PYTHONPATH=src python benchmarks/tools/host_overhead.py [--workload decode|prefill|prefill-graph]

``decode``: host time per eager decode step (B=1, 1k context) and a cProfile of many calls.
``prefill``: the same for ``flash_attn_func`` at a tiny shape (the GPU is never the bottleneck),
on the Gluon path and on the Triton path (``prefill.GLUON_ENABLED``).
``prefill-parts``: host time of each piece of one eager Gluon call (validation, checks, the
descriptors, the launch) next to cuDNN's eager call.
``decode-parts``: host time of one eager decode step through the Triton and the Gluon kernel
(B=1, 4k contiguous and 1k over pages of 16), the pieces of the Gluon path, and cuDNN's call.
``prefill-graph``: issue 5's short shapes (16k tokens per batch, model dim 2048, bf16), GPU time
of back-to-back eager calls (what the benchmark times) against graph replays of the same call,
for flashkernel and cuDNN: where eager exceeds the replay, the host is the bottleneck.
"""

import argparse
import cProfile
import os
import pstats
import sys

import torch
import triton

import flashkernel
from flashkernel.kernels import prefill

sys.path.insert(0, os.path.dirname(__file__))
from decode_ab import host_us  # noqa: E402  (it puts benchmarks/ on the path)
from decode import graph_replay  # noqa: E402  (benchmarks/decode.py)


def profile(step, n=2000, lines=18) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(lines)


def decode_host() -> None:
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    step = lambda: flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # noqa: E731
    print(f"decode: host time per eager call: {host_us(step):.1f} us")
    profile(step)


def prefill_host() -> None:
    q = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    for causal in (False, True):
        step = lambda: flashkernel.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        for gluon in (True, False):
            prefill.GLUON_ENABLED = gluon
            print(f"prefill causal={causal} gluon={gluon}: host time per eager call: {host_us(step):.1f} us",
                  flush=True)
    prefill.GLUON_ENABLED = True
    profile(lambda: flashkernel.flash_attn_func(q, k, v, causal=True), lines=25)


def prefill_parts() -> None:
    """Host time of the pieces of one eager Gluon call (tiny causal shape), and of cuDNN's call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashkernel import _checks, interface
    from flashkernel.kernels import prefill_gluon

    q = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v, out = torch.randn_like(q), torch.randn_like(q), torch.empty_like(q)
    config = prefill.gluon_config(128, True, 128, q.device)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    parts = {
        "flash_attn_func": lambda: flashkernel.flash_attn_func(q, k, v, causal=True),
        "  validation": lambda: interface._validate_dense(q, k, v, True, None, False),
        "  output allocation": lambda: torch.empty_like(q),
        "  prefill.use_gluon": lambda: prefill.use_gluon(q, k, v, out, False),
        "  prefill.gluon_config": lambda: prefill.gluon_config(128, True, 128, q.device),
        "  prefill_gluon.launch": lambda: prefill_gluon.launch(q, k, v, out, None, causal=True, softmax_scale=0.1,
                                                               config=config),
        "    launch_args": lambda: prefill_gluon.launch_args(q, k, v, out, None, True, 0.1, config),
        "      one make_descriptor": lambda: prefill_gluon.make_descriptor(q, 64),
        "check_variant": lambda: _checks.check_variant(q, 1, 2, _checks.NO_WINDOW, 0.0, None, None),
        "sdpa cuDNN (eager call)": cudnn,
    }
    for name, fn in parts.items():
        print(f"{name:28s} {host_us(fn):7.1f} us", flush=True)


def decode_parts() -> None:
    """Host time of an eager decode step, Triton kernel against Gluon kernel, and the Gluon pieces."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashkernel.kernels import decode, decode_gluon

    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for context, page in ((4096, 0), (1024, 16)):
        if page:
            k_cache = torch.randn(context // page + 2, page, 8, 128, device="cuda", dtype=torch.bfloat16)
            block_table = torch.arange(context // page, device="cuda", dtype=torch.int32).view(1, -1)
        else:
            k_cache = torch.randn(1, context, 8, 128, device="cuda", dtype=torch.bfloat16)
            block_table = None
        v_cache = torch.randn_like(k_cache)
        seqlens = torch.full((1,), context, dtype=torch.int32, device="cuda")
        geometry = decode.CacheGeometry.of(k_cache, block_table)
        splits = decode._gluon_splits(q, k_cache, geometry, 0)
        config = decode_gluon.CONFIGS[128]
        target, target_lse, o_strides, l_strides = decode._split_targets(q, out, None, splits)
        args = (q, k_cache, v_cache, seqlens, block_table, target, target_lse, o_strides, l_strides)
        kw = dict(appended=0, capacity=geometry.capacity, num_blocks=geometry.num_blocks, page_size=page,
                  num_splits=splits, causal=True, softmax_scale=0.1, config=config, sms=132)
        parts = {
            "flash_attn_with_kvcache (auto)": lambda: flashkernel.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table),
            "decode_forward triton": lambda: decode.decode_forward(q, k_cache, v_cache, seqlens, block_table, out,
                                                                   None, causal=True, softmax_scale=0.1,
                                                                   backend="triton"),
            "decode_forward gluon": lambda: decode.decode_forward(q, k_cache, v_cache, seqlens, block_table, out,
                                                                  None, causal=True, softmax_scale=0.1,
                                                                  backend="gluon"),
            "  use_gluon": lambda: decode.use_gluon(q, k_cache, v_cache, geometry, True, False, 0),
            "  decode_gluon.launch (no combine)": lambda: decode_gluon.launch(*args, **kw),
            "    launch_args": lambda: decode_gluon.launch_args(*args, **kw),
            "  combine": lambda: decode.combine(target, target_lse, out, None),
        }
        for name, fn in parts.items():
            print(f"B=1 {context} page {page:3d} {name:36s} {host_us(fn):7.1f} us", flush=True)
    qt = q.transpose(1, 2)
    kt = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, kt, enable_gqa=True)
    print(f"sdpa cuDNN (eager call, 4k)            {host_us(cudnn):7.1f} us", flush=True)
    profile(lambda: decode.decode_forward(q, k_cache, v_cache, seqlens, block_table, out, None, causal=True,
                                          softmax_scale=0.1, backend="gluon"), lines=20)


def graph_us(fn) -> float:
    """Median GPU time of graph replays of ``fn``."""
    replay, _ = graph_replay(fn)
    return triton.testing.do_bench(replay, warmup=50, rep=200, return_mode="median") * 1e3


def prefill_graph() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for head_dim in (64, 128, 256):
        heads = 2048 // head_dim
        for seqlen in (512, 1024, 2048):
            batch = 16384 // seqlen
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            for causal in (False, True):
                flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
                fk = lambda: flashkernel.flash_attn_func(q, k, v, causal=causal)  # noqa: E731

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                cells = []
                for name, fn in (("flashkernel", fk), ("cudnn", cudnn)):
                    eager = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3
                    replay = graph_us(fn)
                    cells.append(f"{name} eager {eager:6.1f} us graph {replay:6.1f} us "
                                 f"({flops / replay / 1e6:5.0f} TFLOP/s)")
                print(f"d{head_dim} {'causal' if causal else 'full  '} {seqlen:5d}: " + " | ".join(cells),
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workloads = {"decode": decode_host, "decode-parts": decode_parts, "prefill": prefill_host,
                 "prefill-parts": prefill_parts,
                 "prefill-graph": prefill_graph}
    parser.add_argument("--workload", default="decode", choices=tuple(workloads))
    args = parser.parse_args()
    workloads[args.workload]()


if __name__ == "__main__":
    main()
