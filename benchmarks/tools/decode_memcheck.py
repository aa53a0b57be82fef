"""Out-of-bounds check of the paged decode kernel's block-table reads, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python benchmarks/tools/decode_memcheck.py [--module path/to/decode.py]

Each tensor gets its own allocation (no caching allocator), so a read past the end of the block
table is outside any allocation and memcheck reports it. Cases: block tables with exactly the
columns the capacity needs, full and partial lengths, automatic and large explicit split
counts (splits past the end, pipelined look-ups of tiles past a split's end), pages of 16 and
128. ``--module`` loads another build's ``kernels/decode.py`` (e.g. one from ``git show``).
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
    for page, columns, length, splits in ((128, 17, 2176, 0), (128, 17, 1000, 0), (128, 17, 2176, 64),
                                          (16, 63, 1008, 0), (16, 63, 500, 32)):
        pool = columns + 3
        k_cache = torch.randn(pool, page, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        block_table = torch.randperm(pool, device="cuda")[:columns].to(torch.int32).view(1, columns).contiguous()
        q = torch.randn(1, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.tensor([length], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        decode.decode_forward(q, k_cache, v_cache, seqlens, block_table, out, None, causal=True,
                              softmax_scale=head_dim ** -0.5, num_splits=splits)
        torch.cuda.synchronize()
        print(f"page {page} columns {columns} length {length} splits {splits or 'auto'}: ok "
              f"(finite: {bool(torch.isfinite(out).all())})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
