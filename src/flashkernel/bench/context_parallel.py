"""Context-parallel (ring) attention on N GPUs: flashkernel's ring against flashkernel on one GPU
and against PyTorch's ``context_parallel`` with SDPA on the same GPUs, in one run.

    torchrun --nproc-per-node 2 -m flashkernel.bench.context_parallel \\
        --seqlens 131072 262144 524288 1048576 --out benchmarks/results/h200x2/context_parallel.json

Workload: causal prefill (self-attention, ``Sq = Sk = S``), batch 1, 32 heads x head dim 128,
bf16 (flags change them). Every rank builds the same full inputs from one seed and shards them
in the load-balanced zigzag order (PyTorch's head-tail order is the same one).

Providers, per sequence length:

* ``flashkernel-ring``: :func:`flashkernel.distributed.ring_flash_attn_func` on all ranks.
* ``flashkernel-1gpu``: :func:`flashkernel.flash_attn_func` on the full sequence on rank 0 alone
  (skipped when its tensors would not fit in the free memory), the speed-up's baseline.
* ``torch-cp-<backend>-<rotate>``: ``torch.distributed.tensor.experimental.context_parallel``
  over a 1-D ``DeviceMesh`` with ``scaled_dot_product_attention(is_causal=True)`` under
  ``sdpa_kernel(<backend>)``, kv rotation ``set_rotate_method(<rotate>)``. A failure is recorded
  in the row (status ``error``), not raised.

Time: per call, CUDA events on each rank after a barrier, the slowest rank's time per repetition
(the ring is done when its last rank is), median over repetitions (at least ``--min-reps``, and
more up to ``--max-reps`` while they fit in ``--target-s`` seconds). TFLOP/s use the causal FLOPs
of the whole sequence, ``4 * B * H * D * S * (S + 1) / 2`` (``formulas.attention_flops``).

Overlap (flashkernel-ring): the same ring is also timed computing every step's kernel calls
against the local block with no transfers (``compute``), and with only the ``W - 1`` transfers
(``comm``); ``exposed = max(0, total - compute)`` is the communication the compute did not hide
and ``hidden_fraction = 1 - exposed / comm``. Per-step times come from CUDA events at each step's
start (``run_ring``'s ``on_step``).

Training (``--backward``): each provider is timed for the forward and the backward of
``(out * dout).sum()`` (gradients for q, k and v, ``torch.autograd.grad``); TFLOP/s then count
3.5x the forward's FLOPs (the backward's 2.5x, as FlashAttention counts it), and the overlap
breakdown is skipped.

Correctness: the ring's output is compared with the single-GPU output (max |difference|, after
gathering the shards) and each PyTorch provider's with the ring's (shard by shard).

Results: one JSON with the environment (GPUs, versions, commit, command, NCCL settings), the
formulas and one row per (sequence length, provider). NVLink multicast is not used: the run
calls no symmetric-memory API and leaves the ``NCCL_NVLS_ENABLE`` setting as it finds it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flashkernel.bench import formulas
from flashkernel.bench.results import environment

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SDPA_BACKENDS = ("flash", "cudnn", "efficient")
ROTATE_METHODS = ("allgather", "alltoall")
ENV_KEYS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_P2P_LEVEL",
            "NCCL_ALGO", "NCCL_PROTO")
MEMORY_MARGIN = 1.15  # free memory a single-GPU run must leave: its tensors times this


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flashkernel.bench.context_parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    parser.add_argument("--providers", nargs="+", default=["ring", "single", "torch-cp"],
                        choices=["ring", "single", "torch-cp"])
    parser.add_argument("--torch-backends", nargs="+", default=["flash", "cudnn"], choices=SDPA_BACKENDS)
    parser.add_argument("--torch-rotate", nargs="+", default=["allgather"], choices=ROTATE_METHODS)
    parser.add_argument("--min-reps", type=int, default=2)
    parser.add_argument("--max-reps", type=int, default=10)
    parser.add_argument("--target-s", type=float, default=3.0, help="seconds of repetitions per measurement")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the compute-only / comm-only runs")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (gradients for q, k, v) instead of the forward alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (written by rank 0)")
    parser.add_argument("--cpu", action="store_true",
                        help="smoke-test this script on CPUs (gloo, Triton's interpreter, wall clock; "
                             "use tiny --seqlens/--heads/--head-dim); its times say nothing about GPUs")
    return parser.parse_args(argv)


# --- timing across ranks ----------------------------------------------------------------------


class Clock:
    """CUDA events on the current stream on GPUs; the wall clock in a ``--cpu`` smoke run."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


CLOCK = Clock("cuda")  # main() replaces it for --cpu


def _barrier() -> None:
    if CLOCK.cuda:
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=CLOCK.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _time_once(fn, collective: bool = True) -> tuple[float, object]:
    """Milliseconds of one call on this rank (all ranks starting together when ``collective``),
    and the call's result."""
    if collective:
        _barrier()
    CLOCK.sync()
    start = CLOCK.mark()
    result = fn()
    end = CLOCK.mark()
    CLOCK.sync()
    return CLOCK.elapsed_ms(start, end), result


def _reps(args, warm_ms: float) -> int:
    return int(min(args.max_reps, max(args.min_reps, math.floor(args.target_s * 1e3 / max(warm_ms, 1e-3)))))


def time_collective(fn, args) -> tuple[dict, object]:
    """Median over repetitions of the slowest rank's time (one warm-up call first), and the last
    call's result."""
    warm, result = _time_once(fn)
    warm = _max_over_ranks([warm])[0]
    per_rep = []
    for _ in range(_reps(args, warm)):
        ms, result = _time_once(fn)
        per_rep.append(ms)
    return _summary(_max_over_ranks(per_rep), warm), result


def time_local(fn, args) -> tuple[dict, object]:
    """As :func:`time_collective` for a call that runs on this rank alone."""
    warm, result = _time_once(fn, collective=False)
    per_rep = []
    for _ in range(_reps(args, warm)):
        ms, result = _time_once(fn, collective=False)
        per_rep.append(ms)
    return _summary(per_rep, warm), result


def _summary(per_rep: list[float], warm_ms: float) -> dict:
    ordered = sorted(per_rep)
    return {"median_ms": ordered[len(ordered) // 2] if len(ordered) % 2 else
            (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2,
            "min_ms": ordered[0], "max_ms": ordered[-1], "reps": len(per_rep), "warmup_ms": warm_ms,
            "per_rep_ms": per_rep}


# --- inputs -----------------------------------------------------------------------------------


def full_inputs(args, seqlen: int):
    """The same full ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]`` on every rank (one seed)."""
    dtype, kv_heads = DTYPES[args.dtype], args.kv_heads or args.heads
    gen = torch.Generator(device=CLOCK.device).manual_seed(args.seed + seqlen)
    shape_q = (args.batch, seqlen, args.heads, args.head_dim)
    shape_kv = (args.batch, seqlen, kv_heads, args.head_dim)
    return tuple(torch.randn(shape, generator=gen, device=CLOCK.device, dtype=dtype)
                 for shape in (shape_q, shape_kv, shape_kv))


def _bytes(*shapes_and_dtypes) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes_and_dtypes)


# --- providers ----------------------------------------------------------------------------------


BACKWARD_FLOPS_FACTOR = 3.5  # forward + backward (2.5x the forward), as FlashAttention counts them


def timed_call(args, attention, q, k, v):
    """The call a provider times: ``attention(q, k, v) -> out``, or with ``--backward`` the
    forward and the gradients of ``(out * dout).sum()`` for q, k, v (the output is returned,
    detached, either way)."""
    if not args.backward:
        return lambda: attention(q, k, v)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)

    def forward_backward():
        out = attention(*leaves)
        torch.autograd.grad(out, leaves, dout)
        return out.detach()
    return forward_backward


def _error_fields(error: Exception) -> dict:
    """A failed measurement's row fields: status ``oom`` or ``error`` and the message's first line."""
    first_line = str(error).splitlines()[0] if str(error) else ""
    return {"status": "oom" if isinstance(error, torch.OutOfMemoryError) else "error",
            "message": f"{type(error).__name__}: {first_line}"}


def run_single(args, q, k, v) -> tuple[dict, torch.Tensor | None]:
    """flashkernel on rank 0 alone; the other ranks wait. Returns (row fields, output on rank 0)."""
    from flashkernel import flash_attn_func

    fields, out = {}, None
    if dist.get_rank() == 0:
        # the output and its working set; with the backward also dout and the three gradients
        need = _bytes((q.shape, q.dtype)) * (6 if args.backward else 2) * MEMORY_MARGIN
        free = torch.cuda.mem_get_info()[0] if CLOCK.cuda else math.inf
        if need > free:
            fields = {"status": "skipped", "message": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
        else:
            try:
                attention = lambda q, k, v: flash_attn_func(q, k, v, causal=True)  # noqa: E731
                fields, out = time_local(timed_call(args, attention, q, k, v), args)
                fields["status"] = "ok"
            except Exception as error:  # noqa: BLE001 - recorded in the row; the other ranks go on
                fields = _error_fields(error)
    _barrier()
    return fields, out


def _ring_spec(args, q_local, k_local, v_local):
    from flashkernel.distributed import ring

    return ring.prepare_dense(q_local, k_local, v_local, None, True, None, (-1, -1), 0.0, None, None, False,
                              args.layout)


def _step_clock(marks: list):
    def on_step(step: int) -> None:
        marks.append(CLOCK.mark())
    return on_step


def _per_step_ms(marks: list) -> list[float]:
    CLOCK.sync()
    return [CLOCK.elapsed_ms(a, b) for a, b in zip(marks, marks[1:])]


def _exchange_only(spec, kv: torch.Tensor, marks: list | None = None) -> None:
    """The ring's ``W - 1`` transfers of the packed key/value buffer, with no compute."""
    ring = spec.ring
    spare = torch.empty_like(kv)
    clock = _step_clock(marks if marks is not None else [])
    for step in range(ring.world - 1):
        clock(step)
        ring.finish(ring.start(kv, spare))
        kv, spare = spare, kv
    clock(ring.world - 1)


def ring_breakdown(args, spec, q_local, k_local, v_local, total: dict) -> dict:
    """Compute alone, communication alone, the exposed and hidden parts, and per-step times."""
    from flashkernel.distributed import ring

    def compute_only():
        ring.dense_forward(spec, q_local, k_local, v_local, communicate=False).finish(q_local.dtype)

    kv = torch.stack((k_local, v_local))
    compute, _ = time_collective(compute_only, args)
    comm, _ = time_collective(lambda: _exchange_only(spec, kv), args)
    steps_overlapped, steps_compute, steps_comm = [], [], []
    _time_once(lambda: ring.dense_forward(spec, q_local, k_local, v_local, on_step=_step_clock(steps_overlapped)))
    _time_once(lambda: ring.dense_forward(spec, q_local, k_local, v_local, communicate=False,
                                          on_step=_step_clock(steps_compute)))
    _time_once(lambda: _exchange_only(spec, kv, steps_comm))
    per_step = {name: _max_over_ranks(_per_step_ms(marks)) for name, marks in
                (("overlapped", steps_overlapped), ("compute", steps_compute), ("comm", steps_comm))}
    exposed = max(0.0, total["median_ms"] - compute["median_ms"])
    comm_ms = comm["median_ms"]
    kv_bytes = kv.numel() * kv.element_size()
    return {
        "compute_ms": compute["median_ms"], "comm_ms": comm_ms, "exposed_comm_ms": exposed,
        "hidden_fraction": None if comm_ms <= 0 else max(0.0, min(1.0, 1.0 - exposed / comm_ms)),
        "bytes_per_step": kv_bytes, "comm_gbps_per_step": formulas.gbps(kv_bytes, comm_ms / max(1, spec.ring.world - 1)),
        "per_step_ms": per_step,
    }


def run_flashkernel_ring(args, q_local, k_local, v_local) -> tuple[dict, torch.Tensor]:
    from flashkernel.distributed import ring_flash_attn_func

    def attention(q, k, v):
        return ring_flash_attn_func(q, k, v, causal=True, layout=args.layout)

    fields, out = time_collective(timed_call(args, attention, q_local, k_local, v_local), args)
    fields["status"] = "ok"
    if not (args.no_breakdown or args.backward) and dist.get_world_size() > 1:
        fields.update(ring_breakdown(args, _ring_spec(args, q_local, k_local, v_local), q_local, k_local,
                                     v_local, fields))
    return fields, out


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, chunk_tokens: int = 1 << 16) -> float:
    """max |a - b| over ``[B, S, ...]`` tensors, in float32, a slice of tokens at a time (the
    float32 copies of a whole 1M-token output would take tens of GiB)."""
    worst = 0.0
    for start in range(0, a.shape[1], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        worst = max(worst, (a[:, part].float() - b[:, part].float()).abs().max().item())
    return worst


def _gathered_max_diff(out_local: torch.Tensor, reference_full: torch.Tensor | None, args) -> float | None:
    """max |ring - single| over the full sequence: every rank's shard against the same tokens of
    the single-GPU output (on rank 0)."""
    from flashkernel.distributed.layout import rank_segments

    world = dist.get_world_size()
    gathered = [torch.empty_like(out_local) for _ in range(world)]
    dist.all_gather(gathered, out_local.contiguous())
    if reference_full is None:
        return None
    worst = 0.0
    for rank, part in enumerate(gathered):
        for seg in rank_segments(rank, world, args.layout, part.shape[1]):
            worst = max(worst, max_abs_diff(part[:, seg.local_start:seg.local_start + seg.length],
                                            reference_full[:, seg.global_start:seg.global_start + seg.length]))
    return worst


def run_torch_cp(args, seqlen: int, backend: str, rotate: str, ring_out_local: torch.Tensor | None) -> dict:
    """PyTorch's context parallel with SDPA on the same GPUs; errors become the row's message."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    try:
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        mesh = _device_mesh()
        set_rotate_method(rotate)
        # SDPA's layout [B, H, S, D], one tensor at a time (at 2M tokens each is 16 GiB);
        # context_parallel shards these buffers in place, in head-tail order (= zigzag).
        q, k, v = full_inputs(args, seqlen)
        q = q.transpose(1, 2).contiguous()
        k = k.transpose(1, 2).contiguous()
        v = v.transpose(1, 2).contiguous()
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}), \
                sdpa_kernel(backends[backend]):
            def attention(q, k, v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            fields, out = time_collective(timed_call(args, attention, q, k, v), args)
        fields["status"] = "ok"
        if ring_out_local is not None and args.layout == "zigzag":
            diff = max_abs_diff(out.transpose(1, 2), ring_out_local)
            fields["max_abs_diff_vs_ring"] = _max_over_ranks([diff])[0]
        return fields
    except Exception as error:  # noqa: BLE001 - recorded in the results, the run goes on
        return _error_fields(error)
    finally:
        _empty_cache()


def _empty_cache() -> None:
    if CLOCK.cuda:
        torch.cuda.empty_cache()


_MESHES: dict[int, object] = {}


def _device_mesh():
    """One 1-D DeviceMesh over all ranks, made once."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world not in _MESHES:
        _MESHES[world] = init_device_mesh(CLOCK.device, (world,))
    return _MESHES[world]


# --- the run --------------------------------------------------------------------------------------


def _row(args, seqlen: int, provider: str, gpus: int, fields: dict, single_ms: float | None) -> dict:
    kv_heads = args.kv_heads or args.heads
    flops = formulas.attention_flops(args.batch, args.heads, seqlen, seqlen, args.head_dim, True)
    if args.backward:
        flops = int(flops * BACKWARD_FLOPS_FACTOR)
    row = {"seqlen": seqlen, "provider": provider, "gpus": gpus, "batch": args.batch, "heads": args.heads,
           "kv_heads": kv_heads, "head_dim": args.head_dim, "dtype": args.dtype, "causal": True,
           "pass": "forward+backward" if args.backward else "forward",
           "layout": args.layout if provider == "flashkernel-ring" else None, "flops": flops, **fields}
    ms = fields.get("median_ms")
    if fields.get("status") == "ok" and ms:
        row["tflops"] = formulas.tflops(flops, ms)
        row["tflops_per_gpu"] = row["tflops"] / gpus
        if single_ms:
            row["speedup_vs_1gpu"] = single_ms / ms
    return row


def run_length(args, seqlen: int, log) -> list[dict]:
    from flashkernel.distributed import shard

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    q, k, v = full_inputs(args, seqlen)
    q_l, k_l, v_l = (shard(x, rank, world, layout=args.layout) for x in (q, k, v))
    single_fields, single_out = ({}, None)
    if "single" in args.providers:
        single_fields, single_out = run_single(args, q, k, v)
        single_fields = _broadcast_fields(single_fields)
        log(f"S={seqlen} flashkernel-1gpu {single_fields.get('median_ms', single_fields.get('status'))}")
    del q, k, v
    single_ms = single_fields.get("median_ms") if single_fields.get("status") == "ok" else None
    if single_fields:
        rows.append(_row(args, seqlen, "flashkernel-1gpu", 1, single_fields, single_ms))
    ring_out = None
    if "ring" in args.providers:
        ring_fields, ring_out = run_flashkernel_ring(args, q_l, k_l, v_l)
        ring_fields["max_abs_diff_vs_1gpu"] = _gathered_max_diff(ring_out, single_out, args)
        ring_fields = _broadcast_fields(ring_fields)
        rows.append(_row(args, seqlen, "flashkernel-ring", world, ring_fields, single_ms))
        log(f"S={seqlen} flashkernel-ring {ring_fields['median_ms']:.2f} ms, hidden {ring_fields.get('hidden_fraction')}")
    del single_out, q_l, k_l, v_l
    _empty_cache()
    if "torch-cp" in args.providers:
        for backend in args.torch_backends:
            for rotate in args.torch_rotate:
                fields = run_torch_cp(args, seqlen, backend, rotate, ring_out)
                rows.append(_row(args, seqlen, f"torch-cp-{backend}-{rotate}", world, fields, single_ms))
                log(f"S={seqlen} torch-cp-{backend}-{rotate} {fields.get('median_ms', fields.get('message'))}")
    del ring_out
    _empty_cache()
    return rows


def _broadcast_fields(fields: dict) -> dict:
    """Rank 0's dict on every rank (single-GPU results and the gathered comparison live there)."""
    holder = [fields]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _cell(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _summary_table(rows: list[dict]) -> str:
    header = f"{'seqlen':>8} {'provider':<28} {'ms':>10} {'TFLOP/s':>8} {'x 1GPU':>7} {'hidden':>7}  note"
    lines = [header]
    for row in rows:
        lines.append(
            f"{row['seqlen']:>8} {row['provider']:<28} {_cell(row.get('median_ms'), '.2f'):>10} "
            f"{_cell(row.get('tflops'), '.0f'):>8} {_cell(row.get('speedup_vs_1gpu'), '.2f'):>7} "
            f"{_cell(row.get('hidden_fraction'), '.2f'):>7}  {row.get('message', '')}"
        )
    return "\n".join(lines)


def _init(args) -> None:
    """NCCL on one GPU per rank; gloo and Triton's interpreter for ``--cpu``."""
    global CLOCK
    # A long timeout: the other ranks wait at a barrier while rank 0 times the single-GPU run.
    timeout = datetime.timedelta(minutes=30)
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before flashkernel's kernels are imported
        CLOCK = Clock("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timeout)


def _environment(argv: list[str], world: int) -> dict:
    env = environment(argv, CLOCK.device)
    env.update(
        command=f"torchrun --nproc-per-node {world} -m flashkernel.bench.context_parallel {' '.join(argv)}",
        world_size=world,
        env={key: os.environ.get(key) for key in ENV_KEYS},
    )
    if CLOCK.cuda:
        env.update(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                   nccl_version=".".join(map(str, torch.cuda.nccl.version())))
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    _init(args)
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    started = time.time()
    rows = []
    try:
        for seqlen in args.seqlens:
            rows += run_length(args, seqlen, log)
        if rank == 0:
            doc = {
                "workload": "context_parallel",
                "environment": _environment(argv, world),
                "formulas": {"flops": formulas.PREFILL_FLOPS_FORMULA,
                             "hidden_fraction": "1 - max(0, total - compute) / comm, clipped to [0, 1]",
                             "speedup_vs_1gpu": "flashkernel-1gpu median_ms / provider median_ms"},
                "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "seconds": time.time() - started,
                "rows": rows,
            }
            print(_summary_table(rows), flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
                print(f"wrote {args.out}", flush=True)
        # Leave together: a rank tearing down gloo while rank 0 still writes was seen to abort
        # ("terminate called without an active exception") under a loaded CPU.
        _barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _leave(code: int) -> None:
    """Exit with ``code``; a ``--cpu`` run without the interpreter's shutdown. Under gloo a rank
    sometimes aborted after the process group was destroyed and ``main`` had returned
    ("terminate called without an active exception", no Python frame left: a C++ destructor at
    exit), failing a run whose results were already written. GPU runs exit normally (profilers
    such as nsys flush their data at exit)."""
    if CLOCK.cuda:
        raise SystemExit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _leave(main())
