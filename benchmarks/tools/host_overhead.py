"""Where the host time of one eager decode step goes (cProfile over many calls).

    PYTHONPATH=src python benchmarks/tools/host_overhead.py
"""

import cProfile
import pstats
import time

import torch

import flashkernel


def main() -> None:
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    step = lambda: flashkernel.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)  # noqa: E731
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"host time per eager call: {host:.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
