"""The rank processes of the ring attention tests (``test_ring_attention.py``).

A spawned process imports flashkernel afresh, so Triton's interpreter must be chosen here,
before the import, when there is no GPU. Each rank loads the full inputs of every case, shards
them, runs the ring and saves its output shard; the test process unshards and compares.
"""

import datetime
import os
import traceback

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import torch.distributed as dist  # noqa: E402

from flashkernel import interface  # noqa: E402
from flashkernel.distributed import (ring_flash_attn_func, ring_flash_attn_varlen_func, shard,  # noqa: E402
                                     shard_varlen)


def _poison_outputs():
    """As tests/conftest.py does for the test process: every kernel output starts as NaN."""
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    interface._empty = nan_empty


def _run_case(case: dict, rank: int, world: int, device) -> dict:
    layout = case["kwargs"].get("layout", "zigzag")
    kwargs = dict(case["kwargs"])
    if kwargs.get("sinks") is not None:
        kwargs["sinks"] = kwargs["sinks"].to(device)
    if "cu_seqlens" in case:
        q, k, v = (shard_varlen(case[name], case["cu_seqlens"], rank, world, layout)[0].to(device)
                   for name in ("q", "k", "v"))
        cu_local = (case["cu_seqlens"] // world).to(device)
        max_local = int((cu_local[1:] - cu_local[:-1]).max()) if cu_local.numel() > 1 else 0
        result = ring_flash_attn_varlen_func(q, k, v, cu_local, max_local, **kwargs)
    else:
        q, k, v = (shard(case[name], rank, world, layout=layout).to(device) for name in ("q", "k", "v"))
        if "dout" in case:
            return _run_grad_case(case, q, k, v, kwargs, rank, world, device)
        result = ring_flash_attn_func(q, k, v, **kwargs)
    out, lse = result if kwargs.get("return_lse") else (result, None)
    return {"out": out.cpu(), "lse": None if lse is None else lse.cpu()}


def _run_grad_case(case: dict, q, k, v, kwargs: dict, rank: int, world: int, device) -> dict:
    """Forward and backward of ``(out * dout).sum() (+ (lse * dlse).sum())`` on this rank's shard."""
    layout = kwargs["layout"]
    leaves = [x.requires_grad_() for x in (q, k, v)]
    sinks = kwargs["sinks"] = kwargs["sinks"].requires_grad_() if kwargs["sinks"] is not None else None
    out, lse = ring_flash_attn_func(*leaves, **{**kwargs, "return_lse": True})
    dout = shard(case["dout"], rank, world, layout=layout).to(device)
    loss = (out.double() * dout.double()).sum()
    if "dlse" in case:
        loss = loss + (lse.double() * shard(case["dlse"], rank, world, dim=2, layout=layout).to(device).double()).sum()
    loss.backward()
    grads = {name: x.grad.cpu() for name, x in zip(("dq", "dk", "dv"), leaves)}
    return {"out": out.detach().cpu(), "lse": lse.detach().cpu() if kwargs.get("return_lse") else None,
            "dsinks": None if sinks is None else sinks.grad.cpu(), **grads}


def _run_error_case(case: dict, device) -> dict:
    """Call with bad input; record the exception (none is a failure the test reports)."""
    def moved(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x

    args = [moved(x) for x in case["args"]]
    kwargs = {name: moved(x) for name, x in case["kwargs"].items()}
    function = ring_flash_attn_varlen_func if case.get("varlen") else ring_flash_attn_func
    try:
        function(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - the test checks the type and the message
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None, "message": "no exception"}


def run_rank(rank: int, world: int, backend: str, store_path: str, cases_path: str, out_dir: str) -> None:
    """Entry point of one spawned rank: run every case of ``cases_path``, save the results."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    _poison_outputs()
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cases = torch.load(cases_path, weights_only=False)
        results = {}
        for name, case in cases.items():
            try:
                if case.get("expect_error"):
                    results[name] = _run_error_case(case, device)
                else:
                    results[name] = _run_case(case, rank, world, device)
            except Exception:  # noqa: BLE001 - reported by the test of that case
                results[name] = {"crash": traceback.format_exc()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
