"""Compile the Gluon decode kernel (``kernels/decode_gluon.py``) for sm_90a without a GPU.

    PYTHONPATH=src python benchmarks/tools/decode_gluon_compile.py [--out decode-gluon-compile.json]

For every head dim, cache layout (contiguous, pages of 16, 64 and 256), causal or not, and row
count (GQA group x new tokens: 4, 16 rows), compiles the kernel as a launch would and reports
ptxas registers and spills, ``mma.sync`` / ``ldmatrix`` / TMA counts and shared memory. Exit
status 1 if anything fails to compile or spills.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from gluon_check import compile_for_sm90a, log, ptxas_report  # noqa: E402


def compile_case(head_dim: int, page_size: int, causal: bool, group: int, seqlen_new: int, dtype_name: str) -> dict:
    import torch

    from flashkernel.kernels import decode_gluon as dg

    dtype = getattr(torch, dtype_name)
    batch, kv_heads, splits = 2, 2, 3
    q = torch.empty(batch, seqlen_new, kv_heads * group, head_dim, dtype=dtype)
    if page_size == 0:
        k_cache, block_table = torch.empty(batch, 512, kv_heads, head_dim, dtype=dtype), None
    else:
        k_cache = torch.empty(64, page_size, kv_heads, head_dim, dtype=dtype)
        block_table = torch.zeros(batch, 64, dtype=torch.int32)
    seqlens = torch.zeros(batch, dtype=torch.int32)
    parts = torch.empty(splits, batch, seqlen_new, kv_heads * group, head_dim, dtype=torch.float32)
    parts_lse = torch.empty(splits, batch, kv_heads * group, seqlen_new, dtype=torch.float32)
    config = dg.CONFIGS[head_dim]
    _, args, kwargs = dg.launch_args(q, k_cache, torch.empty_like(k_cache), seqlens, block_table, parts, parts_lse,
                                     parts.stride()[:4], parts_lse.stride(), appended=0, capacity=512,
                                     num_blocks=k_cache.shape[0], page_size=page_size, num_splits=splits,
                                     causal=causal, softmax_scale=0.1, config=config, sms=132)
    t0 = time.time()
    compiled = compile_for_sm90a(dg._gluon_decode_kernel, args, kwargs, {"num_warps": 4})
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx)
    report.pop("mufu_overlap", None)
    return dict(head_dim=head_dim, page_size=page_size, causal=causal, rows=group * seqlen_new, dtype=dtype_name,
                block_n=config.block_n, stages=config.stages, compile_s=round(time.time() - t0, 2), **report,
                mma_sync=ptx.count("mma.sync"), ldmatrix=ptx.count("ldmatrix"),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
                shared_bytes=compiled.metadata.shared)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--pages", nargs="+", type=int, default=[0, 16, 64, 256])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    results, ok = [], True
    for dtype_name in args.dtypes:
        for head_dim in args.head_dims:
            for page_size in args.pages:
                for causal in (True, False):
                    for group, seqlen_new in ((4, 1), (8, 2)):
                        label = (f"{dtype_name} d{head_dim} page {page_size:3d} {'causal' if causal else 'full  '} "
                                 f"rows {group * seqlen_new:2d}")
                        try:
                            r = compile_case(head_dim, page_size, causal, group, seqlen_new, dtype_name)
                        except Exception as exc:  # noqa: BLE001 - report every case
                            ok = False
                            results.append(dict(head_dim=head_dim, page_size=page_size, causal=causal,
                                                error=f"{type(exc).__name__}: {exc}"[:2000]))
                            log(f"{label} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
                            continue
                        results.append(r)
                        good = r["ptxas_ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["tma_loads"] > 0
                        ok &= good
                        log(f"{label} {r['registers']} regs (max R{r['max_register']}), spills "
                            f"{r['spill_stores']}/{r['spill_loads']} B, mma.sync {r['mma_sync']}, ldmatrix "
                            f"{r['ldmatrix']}, TMA {r['tma_loads']}, smem {r['shared_bytes'] // 1024} KB"
                            f"{'' if good else '  <-- CHECK'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ok=ok, results=results), f, indent=1)
    log("every case compiles for sm_90a without spills" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
