"""A/B: split vs stream decode schedule, graph-replayed, plus cuDNN (eager).

Runs on the tree of ``decode-stream.patch`` (applies to commit 7b551a6), from the repository root:
    git apply benchmarks/results/h200/experiments/decode-stream.patch
    PYTHONPATH=src python benchmarks/results/h200/experiments/decode-stream-ab.py contiguous,paged16,paged256
Writes stream-ab.json under $OUT (or the current directory).
"""
import json, os, sys, torch, triton
sys.path.insert(0, "benchmarks")
from decode import Problem, SDPA_PROVIDERS, graph_replay, HEAD_DIM
from flashkernel.kernels import decode
import flashkernel
def us(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
VARIANTS = {"split": ("split", 1, None), "stream1": ("stream", 1, None),
            "stream2_64": ("stream", 2, decode.DecodeConfig(64, 4, 3)),
            "stream3_32": ("stream", 3, decode.DecodeConfig(32, 4, 4))}
cases = [(1, 1024), (1, 4096), (1, 32768), (1, 131072), (8, 1024), (8, 4096), (8, 32768), (8, 131072),
         (64, 1024), (64, 4096), (64, 32768), (16, 1024), (32, 2048), (128, 1024)]
layouts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["contiguous"]
rows = []
for B, ctx in cases:
    torch.manual_seed(0)
    p = Problem(B, ctx, torch.bfloat16)
    for layout in layouts:
        kc, vc, bt = p.layout(layout)
        row = {"batch": B, "context": ctx, "layout": layout}
        outs = {}
        for name, (sched, per_sm, cfg) in VARIANTS.items():
            decode.STREAM_PROGRAMS_PER_SM = per_sm
            out = torch.empty_like(p.q)
            def run(sched=sched, cfg=cfg, out=out):
                decode.decode_forward(p.q, kc, vc, p.seqlens, bt, out, None, causal=True,
                                      softmax_scale=HEAD_DIM ** -0.5, config=cfg, schedule=sched)
                return out
            replay, captured = graph_replay(run)
            row[name] = us(replay)
            outs[name] = captured.clone()
        decode.STREAM_PROGRAMS_PER_SM = 1
        row["err_split"] = p.max_error(outs["split"])
        row["diff_vs_split"] = max((o.float() - outs["split"].float()).abs().max().item() for o in outs.values())
        if layout == "contiguous":
            dense = (p.k.transpose(1, 2).contiguous(), p.v.transpose(1, 2).contiguous())
            fn = SDPA_PROVIDERS["sdpa_cudnn"](p, dense)
            row["cudnn"] = us(fn)
            del dense
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) and v > 0.01 else f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del kc, vc, bt
    del p
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "stream-ab.json"), "w"), indent=1)
