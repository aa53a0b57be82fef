"""The backward of dense ring attention: gradients for every rank's shard of q, k, v (and sinks).

The ring runs again with the forward's pieces (``plan.py``). At step ``s`` rank ``r`` holds the
key/value block of rank ``(r - s) mod W`` together with that block's gradient accumulator
``dkv [2, B, S / W, Hkv, D]`` (float32). For each piece it runs the FlashAttention backward of
that block (``kernels/backward.py``), which recomputes the probabilities from the *final* LSE
(``p = exp(s - lse)``, exact for the whole row) and uses ``delta = rowsum(dO * O)`` of the final
output; the block's ``dq`` is added to the local float32 ``dq``, its ``dk``, ``dv`` to the
travelling accumulator. Then the accumulator goes on to rank ``r + 1`` (it reaches its owner
after ``W`` hops: one more than the key/value blocks make) while the keys and values of the next
step, sent before this step's kernels, arrive.

Communication: per step one key/value block in the input dtype (as in the forward) and one
float32 gradient block of the same shape, so 3x the forward's bytes in bf16. The gradient
transfer of a step overlaps the next step's kernels (it is waited on only before their results
are added).

Sinks: a sink's gradient is ``sum_rows exp(sink - lse) * (dlse - delta)`` over this rank's rows:
the local contribution, as for every weight replicated across the ranks of a context-parallel
group (reduce it over the group as those weights' gradients are reduced).
"""

from __future__ import annotations

import torch

from .. import ops


def _block_grads(q, out, lse, dout, dlse, spec):
    """The backward of one piece against the block in hand, as a function ``(kv, piece) ->
    (rows, keys, dq, dk, dv)`` (gradients in the input dtype, for the piece's rows and keys)."""

    def grads(kv: torch.Tensor, piece):
        rows = slice(piece.q_start, piece.q_start + piece.q_len)
        keys = slice(piece.k_start, piece.k_start + piece.k_len)
        piece_dlse = None if dlse is None else dlse[:, :, rows].contiguous()
        dq, dk, dv, _ = ops.bwd_impl(
            dout[:, rows], q[:, rows], kv[0, :, keys], kv[1, :, keys], out[:, rows], lse[:, :, rows].contiguous(),
            None, None, None, None, 0, 0, piece.causal, spec.softmax_scale, *piece.window, spec.softcap, piece_dlse)
        return rows, keys, dq, dk, dv

    return grads


def run_ring_backward(ring, kv: torch.Tensor, dkv: torch.Tensor, dq: torch.Tensor, pieces_for, grads) -> torch.Tensor:
    """The backward ring loop; returns this rank's own block's ``dkv`` after the last hop.

    ``kv [2, B, S / W, Hkv, D]`` is this rank's key/value block, ``dkv`` (float32, same shape,
    zero) its gradient accumulator and ``dq`` (float32 ``[B, S / W, H, D]``, zero) the local
    query gradient, added to in place. ``pieces_for(source)`` and ``grads(kv, piece)`` as in
    :func:`_block_grads`.
    """
    kv_spare = torch.empty_like(kv) if ring.world > 1 else None
    dkv_spare = torch.empty_like(dkv) if ring.world > 1 else None
    kv_free = None
    dkv_transfer = None
    for step in range(ring.world):
        source = (ring.rank - step) % ring.world
        kv_transfer = ring.start(kv, kv_spare, kv_free) if ring.world > 1 and step + 1 < ring.world else None
        parts = [grads(kv, piece) for piece in pieces_for(source)]
        kv_free = ring.mark_read()
        for rows, _, piece_dq, _, _ in parts:
            dq[:, rows] += piece_dq
        if dkv_transfer is not None:  # the accumulator of this step's block arrives
            ring.finish(dkv_transfer)
            dkv, dkv_spare = dkv_spare, dkv
        for _, keys, _, piece_dk, piece_dv in parts:
            dkv[0, :, keys] += piece_dk
            dkv[1, :, keys] += piece_dv
        if ring.world > 1:
            dkv_transfer = ring.start(dkv, dkv_spare)
        if kv_transfer is not None:
            ring.finish(kv_transfer)
            kv, kv_spare = kv_spare, kv
    if dkv_transfer is not None:
        ring.finish(dkv_transfer)
        dkv = dkv_spare
    return dkv


def sink_grads(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
               dlse: torch.Tensor | None) -> torch.Tensor:
    """``[H]`` float32: ``sum exp(sink - lse) * (dlse - delta)`` over this rank's rows, where
    ``delta = rowsum(dout * out)``; ``out, dout [B, S, H, D]``, ``lse, dlse [B, H, S]``."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # [B, H, S]
    weight = torch.exp(sinks.float()[None, :, None] - lse)
    upstream = -delta if dlse is None else dlse.float() - delta
    return (weight * upstream).sum(dim=(0, 2))


def dense_backward(spec, q, k, v, out, lse, dout, dlse, sinks):
    """Gradients ``(dq, dk, dv, dsinks)`` of :func:`ring.dense_forward` for this rank's shard:
    ``q, out, dout [B, S / W, H, D]``, ``k, v [B, S / W, Hkv, D]``, ``lse, dlse [B, H, S / W]``
    (the forward's final float32 LSE, the sinks included; ``dlse`` may be None). ``dq, dk, dv``
    in the inputs' dtypes; ``dsinks`` float32 ``[H]`` or None."""
    batch, local_len = q.shape[:2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    if batch > 0 and local_len > 0:
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        kv = torch.stack((k, v))
        grads = _block_grads(q, out, lse, dout, dlse, spec)
        dkv = run_ring_backward(spec.ring, kv, dkv, dq, spec.pieces_for(local_len), grads)
    dsinks = None if sinks is None else sink_grads(sinks, out, lse, dout, dlse)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks
