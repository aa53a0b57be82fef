"""Experiment: a persistent prefill grid (one program per SM looping over query tiles), with and
without Triton's loop flattening, against flashkernel's one-program-per-tile grid.

    PYTHONPATH=src python benchmarks/tools/persistent_prefill.py --out persistent.json   # H200
    PYTHONPATH=src python benchmarks/tools/persistent_prefill.py --ptx                    # no GPU

Question: at short sequences (512-2k keys, 4-16 key tiles per query tile) is the per-tile
prologue/epilogue (Q load, pipeline fill, output store) what separates us from cuDNN, and does
a persistent loop whose next tile's loads overlap the current tile's epilogue (``tl.range(...,
flatten=True)``, as in Triton's persistent matmul) recover it? Pointer loads, bf16, GQA; the
experiment needs ``seqlen % BLOCK_N == 0`` (no key mask outside the causal diagonal).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)


@triton.jit
def _persistent_kernel(
    Q, K, V, Out,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    seqlen, num_heads, group, qk_scale, num_tiles, num_m_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        m_tile = tile % num_m_tiles
        if CAUSAL:
            m_tile = num_m_tiles - 1 - m_tile
        rest = tile // num_m_tiles
        head = rest % num_heads
        batch = (rest // num_heads).to(tl.int64)
        kv_head = (head // group).to(tl.int64)
        head = head.to(tl.int64)
        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.load(Q + batch * stride_qb + head * stride_qh + offs_m[:, None].to(tl.int64) * stride_qs
                    + offs_d[None, :])
        k_base = K + batch * stride_kb + kv_head * stride_kh
        v_base = V + batch * stride_vb + kv_head * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        end = tl.minimum(seqlen, (m_tile + 1) * BLOCK_M) if CAUSAL else seqlen
        for start_n in range(0, end, BLOCK_N):
            keys = start_n + offs_n
            k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_ks + offs_d[None, :])
            v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vs + offs_d[None, :])
            qk = tl.dot(q, tl.trans(k))
            if CAUSAL:
                qk = tl.where(keys[None, :] <= offs_m[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Out + batch * stride_ob + head * stride_oh + offs_m[:, None].to(tl.int64) * stride_os
                 + offs_d[None, :], out.to(Out.dtype.element_ty))


CONFIGS = {64: (128, 64, 8, 3), 128: (128, 128, 8, 3)}


def persistent_forward(q, k, v, causal: bool, flatten: bool, programs_per_sm: int = 1, config=None):
    batch, seqlen, heads, head_dim = q.shape
    block_m, block_n, warps, stages = config or CONFIGS[head_dim]
    assert seqlen % block_m == 0 and seqlen % block_n == 0
    out = torch.empty_like(q)
    num_m_tiles = seqlen // block_m
    num_tiles = num_m_tiles * heads * batch
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = min(num_tiles, sms * programs_per_sm)
    _persistent_kernel[(programs,)](
        q, k, v, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        seqlen, heads, heads // k.shape[2], head_dim ** -0.5 * LOG2E, num_tiles, num_m_tiles,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, NUM_PROGRAMS=programs,
        FLATTEN=flatten, num_warps=warps, num_stages=stages,
    )
    return out


def ptx_report() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for head_dim, (bm, bn, warps, stages) in CONFIGS.items():
        for causal in (False, True):
            for flatten in (False, True):
                signature = {name: "i32" for name in _persistent_kernel.arg_names}
                signature.update(Q="*bf16", K="*bf16", V="*bf16", Out="*bf16", qk_scale="fp32")
                constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, NUM_PROGRAMS=132,
                                  FLATTEN=flatten)
                for name in constexprs:
                    signature[name] = "constexpr"
                attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(_persistent_kernel.arg_names)
                         if n in ("Q", "K", "V", "Out") or n.startswith("stride")}
                label = f"d{head_dim} {'causal' if causal else 'full'} flatten={flatten}"
                try:
                    compiled = triton.compile(ASTSource(_persistent_kernel, signature, constexprs, attrs),
                                              target=GPUTarget("cuda", 90, 32),
                                              options={"num_warps": warps, "num_stages": stages})
                    ptx = compiled.asm["ptx"]
                    print(f"{label}: wgmma {ptx.count('wgmma.mma_async')} cp.async {ptx.count('cp.async')}", flush=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def bench(out_path: str | None) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashkernel

    rows = []
    for head_dim in (64, 128):
        heads = 2048 // head_dim
        for seqlen in (512, 1024, 2048, 4096):
            batch = 16384 // seqlen
            for causal in (False, True):
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                pairs = seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen
                flops = 4 * batch * heads * head_dim * pairs
                ref = flashkernel.flash_attn_func(q, k, v, causal=causal)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                row = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal}
                fns = {
                    "flashkernel": lambda: flashkernel.flash_attn_func(q, k, v, causal=causal),
                    "persistent": lambda: persistent_forward(q, k, v, causal, False),
                    "persistent_flat": lambda: persistent_forward(q, k, v, causal, True),
                    "persistent_flat_2": lambda: persistent_forward(q, k, v, causal, True, 2),
                }

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                fns["cudnn"] = cudnn
                for name, fn in fns.items():
                    try:
                        out = fn()
                        if name != "cudnn":
                            row[name + "_err"] = (out.float() - ref.float()).abs().max().item()
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                        row[name] = flops / (ms * 1e-3) / 1e12
                    except Exception as exc:  # noqa: BLE001
                        row[name] = None
                        row[name + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                del q, k, v, qt, kt, vt, ref
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ptx", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.ptx:
        ptx_report()
    else:
        bench(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
