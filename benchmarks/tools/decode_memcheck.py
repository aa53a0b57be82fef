"""Out-of-bounds check of the decode kernels' cache and block-table reads, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python benchmarks/tools/decode_memcheck.py [--module path/to/decode.py]

Each tensor gets its own allocation (no caching allocator), so a read past the end of the block
table is outside any allocation and memcheck reports it. Cases: block tables with exactly the
columns the capacity needs, full and partial lengths, automatic and large explicit split
counts (splits past the end, pipelined look-ups of tiles past a split's end), pages of 16 and
128, and a contiguous cache whose capacity is not a whole number of tiles; each through the
Triton kernel and the Gluon one (``kernels/decode_gluon.py``, TMA; where it is supported).
``--module`` loads another build's ``kernels/decode.py`` (e.g. one from ``git show``; Triton only).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", help="another build's kernels/decode.py")
    args = parser.parse_args()
    if args.module:
        from plain_ptx import load_module
        decode = load_module(args.module, "_memcheck_decode")
    else:
        from flashkernel.kernels import decode
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 32, 8, 128
    backends = [None] if args.module else ["triton", "gluon"]
    cases = [(128, 17, 2176, 0, 1), (128, 17, 1000, 0, 1), (128, 17, 2176, 64, 1), (16, 63, 1008, 0, 1),
             (16, 63, 500, 32, 4), (0, 1000, 1000, 0, 1), (0, 1000, 999, 5, 3)]  # page 0: contiguous, S_max
    for page, columns, length, splits, seqlen_new in cases:
        if page:
            pool = columns + 3
            k_cache = torch.randn(pool, page, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            block_table = torch.randperm(pool, device="cuda")[:columns].to(torch.int32).view(1, columns).contiguous()
        else:
            k_cache = torch.randn(1, columns, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            block_table = None
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(1, seqlen_new, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.tensor([length], dtype=torch.int32, device="cuda")
        for backend in backends:
            out = torch.empty_like(q)
            extra = {} if backend is None else {"backend": backend}
            try:
                decode.decode_forward(q, k_cache, v_cache, seqlens, block_table, out, None, causal=True,
                                      softmax_scale=head_dim ** -0.5, num_splits=splits, **extra)
            except ValueError as exc:  # the Gluon kernel does not take this case
                print(f"page {page} {backend}: skipped ({str(exc)[:60]})", flush=True)
                continue
            torch.cuda.synchronize()
            print(f"page {page} columns {columns} length {length} splits {splits or 'auto'} T {seqlen_new} "
                  f"{backend or 'module'}: ok (finite: {bool(torch.isfinite(out).all())})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
