"""Ring attention over a ``torch.distributed`` process group (context parallelism).

Each of the ``W`` ranks of a group holds a shard of the sequence (``layout.py``): its queries,
keys and values ``[B, S / W, H, D]``. The keys and values travel round the ring: at step ``s``
rank ``r`` holds the block of rank ``(r - s) mod W``, attends its queries to the visible parts
of that block (``plan.py`` picks the kernel calls: causal, full, windowed or none), and passes
the block on to rank ``r + 1`` while receiving the next one from rank ``r - 1``. The partial
results of the steps merge exactly by log-sum-exp. After ``W`` steps every query has seen every
key once, and the output is in the caller's shard layout.

Communication
-------------
Keys and values are packed once into one buffer ``[2, B, S / W, Hkv, D]`` so a step is one send
and one receive (``torch.distributed.batch_isend_irecv`` to the next and from the previous
rank), issued *before* the step's compute so the transfer overlaps it. Two buffers alternate
(double buffering): the one being read by this step's kernels and the one being received into.
On CUDA the transfer is issued from a side stream that first waits for an event recorded after
the previous step's attention kernels (they read the buffer it receives into; the merges that
follow them need not finish first); an event recorded on the side stream after the transfer
completes is what the compute stream waits on before it reads the received block. Nothing
blocks the host. On the CPU (gloo) the same code waits on the work handles instead; gloo moves
the data on its own threads, so the transfer still overlaps.

Merge
-----
The running result is one float32 accumulator ``[B, S / W, H, D]`` with its LSE ``[B, H, S / W]``,
updated in place after each kernel call by the exact rule of ``kernels/combine.py``::

    lse' = logaddexp(lse, lse_part)
    out' = out * exp(lse - lse') + out_part * exp(lse_part - lse')

written with torch ops. Why not ``kernels.combine.combine``: it merges ``P`` parts that all cover
the same rows, stacked as ``[P, B, T, H, D]``, so it would need every step's output kept (memory
``W`` times the shard's output) and padded to all rows, while a step's kernel call covers only
some rows (half the rows on most zigzag steps, a trimmed range with a window). The in-place merge
keeps memory constant in ``W`` and touches only the rows a call wrote; a first part covering
every row (the diagonal step) simply becomes the accumulator. Sinks are merged once at
the end as one more part with LSE ``sink`` and output 0, which is exactly the sink's definition
(the kernel calls get no sink, so it is not counted ``W`` times).

Variants
--------
* causal, sliding windows and their intersection: exact through the plan (global positions).
* softcap, softmax_scale, GQA, head dims, dtypes: passed to each kernel call as they are.
* sinks: merged once at the end, as above.
* ALiBi: refused (``NotImplementedError``). Its bias ``-slope * |p - t|`` uses global positions;
  the kernel measures distance from the block's own bottom-right corner, and for a block a query
  sees whole (every step but the diagonal one) no shift of that corner makes the two agree (the
  kernel's distance changes sign inside the block, the global one does not).
* packed sequences (:func:`ring_flash_attn_varlen_func`): causal and full attention, softcap,
  sinks, GQA; each sequence is sharded on its own and a step is one varlen call per piece of
  the dense plan (:class:`VarlenRing`). Windows are refused there: their calls would be trimmed
  per sequence length.

Backward
--------
Dense calls whose inputs require grad run through an ``autograd.Function`` that saves the
inputs, the output and the final LSE (computed in float32 whether or not it is returned); its
backward runs the ring again (``backward.py``). Packed calls (:func:`ring_flash_attn_varlen_func`)
have no backward: inputs that require grad get a clear error.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .. import _checks, ops
from ..interface import flash_attn_func, flash_attn_varlen_func, kernels_interpreted
from . import layout as layouts
from .backward import dense_backward
from .plan import Band, Piece, plan_step

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func"]


# --- the ring: passing a buffer to the next rank ------------------------------------------------


@dataclasses.dataclass
class _Transfer:
    works: list
    done: torch.cuda.Event | None


_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}


def _comm_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per CUDA device for the ring's transfers (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COMM_STREAMS[index]


class Ring:
    """The ranks of a process group in a ring: sends go to ``rank + 1``, receives come from
    ``rank - 1`` (group ranks, mod the group size)."""

    def __init__(self, group, device: torch.device):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.next_rank = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev_rank = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        self.stream = _comm_stream(device) if device.type == "cuda" else None

    def start(self, send: torch.Tensor, recv: torch.Tensor, recv_free: torch.cuda.Event | None = None) -> _Transfer:
        """Send ``send`` to the next rank and receive the previous rank's into ``recv``, in the
        background. Neither may be written until :meth:`finish`; ``recv`` may not be read.

        On CUDA the transfer starts once ``recv_free`` (:meth:`mark_read` after the last kernel
        that read ``recv``) has passed, or, without it, once all work queued so far on the
        current stream is done. ``send`` must have arrived through this ring or be ready on the
        current stream by then.
        """
        ops = [dist.P2POp(dist.isend, send, self.next_rank, self.group),
               dist.P2POp(dist.irecv, recv, self.prev_rank, self.group)]
        if self.stream is None:
            return _Transfer(dist.batch_isend_irecv(ops), None)
        if recv_free is None:
            self.stream.wait_stream(torch.cuda.current_stream(send.device))
        else:
            self.stream.wait_event(recv_free)
        with torch.cuda.stream(self.stream):
            works = dist.batch_isend_irecv(ops)
            for work in works:
                work.wait()  # NCCL: the side stream waits for the transfer; the host does not
            done = torch.cuda.Event()
            done.record(self.stream)
        return _Transfer(works, done)

    def mark_read(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the current stream (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def finish(self, transfer: _Transfer) -> None:
        """After this, the received buffer may be read on the current stream (CUDA), or at all
        (CPU), and the sent one written."""
        if transfer.done is None:
            for work in transfer.works:
                work.wait()
        else:
            torch.cuda.current_stream().wait_event(transfer.done)


# --- the exact merge ------------------------------------------------------------------------------


class MergedResult:
    """A float32 running output ``[B, T, H, D]`` and LSE ``[B, H, T]``, merged by log-sum-exp.

    Rows no part has reached hold output 0 and LSE -inf. Token rows are dim 1 of the output and
    dim 2 of the LSE (``token_dim`` shifts both, for packed ``[T, H, D]`` / ``[H, T]`` results).
    A first part that covers every row becomes the result as it is (no zero fill, no merge).
    """

    def __init__(self, out_shape, lse_shape, device, token_dim: int = 1):
        self.out_shape, self.lse_shape, self.device, self.token_dim = out_shape, lse_shape, device, token_dim
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def _start_empty(self) -> None:
        if self.out is None:
            self.out = torch.zeros(self.out_shape, dtype=torch.float32, device=self.device)
            self.lse = torch.full(self.lse_shape, float("-inf"), dtype=torch.float32, device=self.device)

    def add(self, rows: slice | torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
        """Merge a part covering token ``rows`` (a slice, or an int64 index of rows), its LSE
        -inf where it saw no key. The part's tensors may be kept and modified."""
        t = self.token_dim
        if self.out is None and isinstance(rows, slice) and (rows.start, rows.stop) == (0, self.out_shape[t]):
            self.out, self.lse = part_out.float(), part_lse
            return
        self._start_empty()
        if isinstance(rows, slice):  # views: merged in place
            count = rows.stop - rows.start
            _merge_in_place(self.out.narrow(t, rows.start, count), self.lse.narrow(t + 1, rows.start, count),
                            part_out, part_lse, t)
            return
        out_rows, lse_rows = self.out.index_select(t, rows), self.lse.index_select(t + 1, rows)
        _merge_in_place(out_rows, lse_rows, part_out, part_lse, t)
        self.out.index_copy_(t, rows, out_rows)
        self.lse.index_copy_(t + 1, rows, lse_rows)

    def finish(self, dtype: torch.dtype, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out in dtype, lse float32)``, with the sinks ``[H]`` merged when given."""
        self._start_empty()
        if sinks is not None:
            self.add_sinks(sinks)
        return self.out.to(dtype), self.lse

    def add_sinks(self, sinks: torch.Tensor) -> None:
        """Merge the sink of each head ``[H]``: a part with LSE ``sink`` and output 0."""
        self._start_empty()
        head_shape = [1] * self.lse.dim()
        head_shape[self.token_dim] = sinks.shape[0]
        _merge_in_place(self.out, self.lse, None, sinks.view(head_shape), self.token_dim)


def _merge_in_place(out, lse, part_out, part_lse, token_dim: int) -> None:
    """``out, lse`` (float32) := their exact log-sum-exp merge with the part (``part_out`` None:
    a part with output 0, e.g. a sink). Rows that no part reached keep weight 0 (no NaN)."""
    merged = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isneginf(merged), 0.0, merged)
    out.mul_(_per_token(torch.exp(lse - finite), token_dim))
    if part_out is not None:
        out.addcmul_(part_out, _per_token(torch.exp(part_lse - finite), token_dim))
    lse.copy_(merged)


def _per_token(weight: torch.Tensor, token_dim: int) -> torch.Tensor:
    """An LSE-shaped weight ``[.., H, T]`` as ``[.., T, H, 1]`` to scale output rows."""
    return weight.transpose(token_dim, token_dim + 1).unsqueeze(-1)


# --- validation -----------------------------------------------------------------------------------


def _check_distributed(group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring attention needs an initialized torch.distributed process group: call "
            "torch.distributed.init_process_group (e.g. under torchrun) first"
        )


def _check_no_alibi(alibi_slopes) -> None:
    if alibi_slopes is not None:
        raise NotImplementedError(
            "ring attention does not support alibi_slopes: ALiBi's bias -slope * |p - t| uses "
            "global positions, while each ring step's kernel call measures distances from its own "
            "block's corner; for a key block a query sees whole, the two differ by a per-key term "
            "the kernel cannot add. Use flash_attn_func on one device for ALiBi models"
        )


def _check_shard_lengths(q, k, world: int, layout: str) -> None:
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q holds {q.shape[1]} tokens and k {k.shape[1]}: ring attention shards one sequence "
            "(self-attention), so every rank's q, k and v hold the same tokens"
        )
    per_rank = layouts.num_chunks(world, layout) // world
    if q.shape[1] % per_rank != 0:
        raise ValueError(
            f"q holds {q.shape[1]} tokens, an odd number: the zigzag layout gives each rank two "
            f"equal chunks, so the full sequence ({world} x {q.shape[1]} tokens) must divide by "
            f"2 x {world} = {2 * world}; shard it with flashkernel.distributed.shard, or use "
            "layout='contiguous'"
        )


# --- the forward ----------------------------------------------------------------------------------


Rows = slice | torch.Tensor  # the local query rows a part covers: a range, or an int64 index
AttendPiece = Callable[[torch.Tensor, Piece], tuple[Rows, torch.Tensor, torch.Tensor]]


def run_ring(ring: Ring, kv: torch.Tensor, pieces_for: Callable[[int], Iterable[Piece]],
             attend: AttendPiece, result: MergedResult, *, communicate: bool = True,
             on_step: Callable[[int], None] | None = None) -> None:
    """The ring loop: at step ``s`` attend to the block of rank ``(rank - s) mod W`` (its pieces
    from ``pieces_for(source)``) while the next block is in flight.

    ``kv`` is this rank's packed key/value buffer; ``attend(kv_block, piece)`` returns the part
    ``(rows, out, lse)`` for the piece's query rows. ``communicate=False`` computes every step's pieces
    against the local block instead (the same work without the transfers; for benchmarks).
    ``on_step(s)`` is called as step ``s`` begins and with ``s = W`` after the last (benchmarks
    record CUDA events there).
    """
    spare = torch.empty_like(kv) if communicate and ring.world > 1 else None
    spare_free = None  # when the last kernel reading `spare` is done (None: all queued work)
    for step in range(ring.world):
        if on_step is not None:
            on_step(step)
        source = (ring.rank - step) % ring.world
        transfer = ring.start(kv, spare, spare_free) if spare is not None and step + 1 < ring.world else None
        parts = [attend(kv, piece) for piece in pieces_for(source)]
        # The next transfer may overwrite this block as soon as these kernels have read it: it
        # need not wait for the merges below.
        spare_free = ring.mark_read()
        for part in parts:
            result.add(*part)
        if transfer is not None:
            ring.finish(transfer)
            kv, spare = spare, kv
    if on_step is not None:
        on_step(ring.world)


@dataclasses.dataclass(frozen=True)
class DenseRing:
    """Everything a dense ring forward needs besides the tensors (the benchmark reuses it)."""

    ring: Ring
    layout: str
    band: Band
    softmax_scale: float
    softcap: float

    def pieces_for(self, local_len: int) -> Callable[[int], list[Piece]]:
        rank, world = self.ring.rank, self.ring.world
        q_segments = layouts.rank_segments(rank, world, self.layout, local_len)
        plans = {source: plan_step(q_segments, layouts.rank_segments(source, world, self.layout, local_len),
                                   self.band)
                 for source in range(world)}
        return plans.__getitem__

    def attend(self, q: torch.Tensor) -> AttendPiece:
        def attend_piece(kv: torch.Tensor, piece: Piece):
            rows, keys = slice(piece.q_start, piece.q_start + piece.q_len), slice(piece.k_start, piece.k_start + piece.k_len)
            out, lse = flash_attn_func(
                q[:, rows], kv[0, :, keys], kv[1, :, keys], causal=piece.causal,
                softmax_scale=self.softmax_scale, window_size=piece.window, softcap=self.softcap,
                return_lse=True,
            )
            return rows, out, lse
        return attend_piece


def dense_forward(spec: DenseRing, q, k, v, **run_options) -> MergedResult:
    """The ring over validated dense shards; ``run_options`` go to :func:`run_ring`."""
    batch, local_len, num_heads, head_dim = q.shape
    result = MergedResult((batch, local_len, num_heads, head_dim), (batch, num_heads, local_len), q.device)
    if batch > 0 and local_len > 0:
        kv = torch.stack((k, v))  # the buffer that travels: [2, B, S / W, Hkv, D]
        run_ring(spec.ring, kv, spec.pieces_for(local_len), spec.attend(q), result, **run_options)
    return result


def prepare_dense(q, k, v, group, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks,
                  return_lse, layout) -> DenseRing:
    """Validate a dense call (before any communication, so every rank raises alike)."""
    _check_distributed(group)
    layouts.check_layout(layout)
    _check_no_alibi(alibi_slopes)
    _checks.check_qkv(q, k, v, kernels_interpreted())
    _checks.check_flag("causal", causal)
    _checks.check_flag("return_lse", return_lse)
    scale = _checks.resolve_softmax_scale(softmax_scale, q.shape[-1])
    window, cap = _checks.check_variant(q, q.shape[0], q.shape[2], window_size, softcap, None, sinks)
    ring = Ring(group, q.device)
    _check_shard_lengths(q, k, ring.world, layout)
    return DenseRing(ring, layout, Band.of(causal, window), scale, cap)


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = _checks.NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    layout: str = "zigzag",
):
    """Exact attention over a sequence sharded across the ranks of ``group`` (ring attention).

    Every rank of ``group`` calls this with its own shard; the result equals
    :func:`flashkernel.flash_attn_func` on the full sequence, sharded the same way.

    Args:
        q: ``[batch, seqlen / W, num_heads, head_dim]``, this rank's queries (``W`` = group size).
        k, v: ``[batch, seqlen / W, num_kv_heads, head_dim]``, this rank's keys and values, the
            same tokens as ``q``. Shard the full tensors with
            :func:`flashkernel.distributed.shard` (``layout`` below); dtypes, head dims, GQA and
            strides as in :func:`flashkernel.flash_attn_func`. Every rank passes the same shapes.
        group: the ``torch.distributed`` process group (None = the default group). On CUDA use
            NCCL with one device per rank (``torch.cuda.set_device``); on the CPU, gloo.
        causal, softmax_scale, window_size, softcap, sinks: as in
            :func:`flashkernel.flash_attn_func`, over *global* positions (the full sequence is
            self-attention, ``Sq = Sk``, so query ``p`` sees keys ``t <= p`` when causal).
        alibi_slopes: not supported (``NotImplementedError``; see the module docstring).
        return_lse: also return the log-sum-exp of each row, ``[batch, num_heads, seqlen / W]``
            float32, in the shard's token order.
        layout: ``"zigzag"`` (default; rank ``r`` holds chunks ``r`` and ``2W-1-r`` of ``2W``,
            so causal work is the same on every rank) or ``"contiguous"`` (rank ``r`` holds chunk
            ``r`` of ``W``; causal work grows with the rank). The sequence must divide by
            ``2W`` (zigzag) or ``W``: in zigzag the shard length must be even (``ValueError``).

    Returns:
        ``out [batch, seqlen / W, num_heads, head_dim]`` in q's dtype, in the shard's token
        order, and with ``return_lse=True`` also ``lse``. Differentiable: gradients flow to q, k, v
        and sinks (each rank gets its shard's; a sink's gradient is this rank's contribution).

    Example (under ``torchrun --nproc-per-node 2``)::

        >>> dist.init_process_group("nccl"); rank = dist.get_rank()
        >>> torch.cuda.set_device(rank)
        >>> q, k, v = (shard(x, rank, 2) for x in (q_full, k_full, v_full))  # [B, S/2, H, D]
        >>> out = ring_flash_attn_func(q, k, v, causal=True)   # == shard(flash_attn_func(...))
    """
    ops.check_differentiation_modes((q, k, v, sinks), "ring_flash_attn_func")
    spec = prepare_dense(q, k, v, group, causal, softmax_scale, window_size, softcap, alibi_slopes,
                         sinks, return_lse, layout)
    if ops.needs_grad((q, k, v, sinks)):
        out, lse = _RingAttention.apply(q, k, v, sinks, spec)
    else:
        out, lse = dense_forward(spec, q, k, v).finish(q.dtype, sinks)
    return (out, lse) if return_lse else out


class _RingAttention(torch.autograd.Function):
    """The dense ring with its backward (``backward.py``): saves the inputs, the output and the
    final LSE, as the single-device op does."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec):
        out, lse = dense_forward(spec, q, k, v).finish(q.dtype, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dsinks = dense_backward(ctx.spec, q, k, v, out, lse, dout, dlse, sinks)
        return dq, dk, dv, None if dsinks is None else dsinks.to(sinks.dtype), None


# --- packed sequences -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowSet:
    """Some rows of a packed shard, as a varlen call takes them: ``index`` (None = all rows, in
    order) and the cumulative lengths and longest length of the selected sequences' rows."""

    index: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int


class VarlenRing:
    """A ring forward over packed sequences, each sharded on its own (``layout.shard_varlen``).

    Every rank holds, of sequence ``b``, ``L_b`` local rows made of ``c`` equal chunks (``c = 2``
    zigzag, 1 contiguous) and the same ``L_b`` on every rank, so a step's calls are those of the
    dense plan with chunks of one token ("chunk units"), scaled per sequence: a piece over chunk
    units ``[a, a + n)`` covers rows ``a * L_b / c .. (a + n) * L_b / c`` of every sequence. This
    holds for causal and full pieces; windows would be trimmed per sequence length, so they are
    refused. Pieces over all rows use the tensors as they are; the others (zigzag causal steps)
    gather their rows (queries once, keys per step) and merge back by index.
    """

    def __init__(self, ring: Ring, layout: str, causal: bool, softmax_scale: float, softcap: float,
                 cu_seqlens: torch.Tensor, lengths: list[int], max_seqlen: int):
        self.ring, self.layout, self.softmax_scale, self.softcap = ring, layout, softmax_scale, softcap
        self.band = Band.of(causal, _checks.NO_WINDOW)
        self.per_rank = layouts.num_chunks(ring.world, layout) // ring.world
        self.cu_seqlens, self.lengths, self.max_seqlen = cu_seqlens, lengths, max_seqlen
        self._row_sets: dict[tuple[int, int], RowSet] = {}

    def pieces_for(self, source: int) -> list[Piece]:
        world, unit = self.ring.world, self.per_rank
        return plan_step(layouts.rank_segments(self.ring.rank, world, self.layout, unit),
                         layouts.rank_segments(source, world, self.layout, unit), self.band)

    def rows(self, start: int, count: int) -> RowSet:
        """The rows of chunk units ``[start, start + count)`` of every sequence."""
        if (start, count) not in self._row_sets:
            self._row_sets[start, count] = self._make_rows(start, count)
        return self._row_sets[start, count]

    def _make_rows(self, start: int, count: int) -> RowSet:
        if (start, count) == (0, self.per_rank):
            return RowSet(None, self.cu_seqlens, self.max_seqlen)
        device, unit = self.cu_seqlens.device, self.per_rank
        index, first = [], 0
        for length in self.lengths:
            chunk = length // unit
            index.append(torch.arange(first + start * chunk, first + (start + count) * chunk, device=device))
            first += length
        sub_lengths = [length // unit * count for length in self.lengths]
        cu = torch.tensor([0, *itertools.accumulate(sub_lengths)], dtype=torch.int32, device=device)
        return RowSet(torch.cat(index), cu, max(sub_lengths, default=0))

    def attend(self, q: torch.Tensor) -> AttendPiece:
        gathered_q: dict[tuple[int, int], torch.Tensor] = {}

        def attend_piece(kv: torch.Tensor, piece: Piece):
            q_rows, k_rows = self.rows(piece.q_start, piece.q_len), self.rows(piece.k_start, piece.k_len)
            if q_rows.index is None:
                q_part = q
            else:
                q_part = gathered_q.setdefault((piece.q_start, piece.q_len), q.index_select(0, q_rows.index))
            k_part, v_part = (kv[0], kv[1]) if k_rows.index is None else kv.index_select(1, k_rows.index).unbind(0)
            out, lse = flash_attn_varlen_func(
                q_part, k_part, v_part, q_rows.cu_seqlens, k_rows.cu_seqlens, q_rows.max_seqlen,
                k_rows.max_seqlen, causal=piece.causal, softmax_scale=self.softmax_scale,
                softcap=self.softcap, return_lse=True, validate=False,
            )
            rows = slice(0, q.shape[0]) if q_rows.index is None else q_rows.index
            return rows, out, lse
        return attend_piece


def _check_no_varlen_window(window_size) -> None:
    if tuple(window_size) != _checks.NO_WINDOW:
        raise NotImplementedError(
            f"ring_flash_attn_varlen_func does not support window_size (got {tuple(window_size)}): "
            "a window's kernel calls are trimmed to each sequence's length, so one packed call per "
            "ring step cannot express them; use ring_flash_attn_func on each sequence"
        )


def _local_lengths(cu_seqlens: torch.Tensor, total: int, max_seqlen: int, world: int, layout: str) -> list[int]:
    """The local sequence lengths (read on the host), checked against the shard's rows, the
    layout (even lengths for zigzag) and ``max_seqlen``."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at the number of local tokens "
            f"({total}), got {bounds}"
        )
    lengths = [b1 - b0 for b0, b1 in zip(bounds, bounds[1:])]
    per_rank = layouts.num_chunks(world, layout) // world
    for b, length in enumerate(lengths):
        if length % per_rank:
            raise ValueError(
                f"sequence {b} has {length} local tokens, an odd number: the zigzag layout gives each "
                f"rank two equal chunks of every sequence, so its full length must divide by "
                f"2 x {world} = {2 * world}; shard with flashkernel.distributed.shard_varlen"
            )
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen is {max_seqlen} but sequence {lengths.index(max(lengths))} has "
                         f"{max(lengths)} local tokens: pass at least the longest local length")
    return lengths


def ring_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = _checks.NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    layout: str = "zigzag",
):
    """Ring attention over packed sequences, each sharded across the ranks of ``group``.

    Every rank calls this with its shard of the packed batch, as
    :func:`flashkernel.distributed.shard_varlen` makes it; the result equals
    :func:`flashkernel.flash_attn_varlen_func` on the full batch, sharded the same way.

    Args:
        q: ``[total / W, num_heads, head_dim]``; k, v: ``[total / W, num_kv_heads, head_dim]``:
            this rank's rows of every sequence (sequence ``b`` at rows ``cu_seqlens[b] ..
            cu_seqlens[b + 1]``), the same rows for q, k and v (self-attention).
        cu_seqlens: int32 ``[batch + 1]``, the *local* cumulative lengths (the full batch's
            divided by ``W``; identical on every rank). Read on the host (a device-to-host copy
            on GPU) to check the lengths and to index the zigzag causal steps.
        max_seqlen: int, at least the longest local sequence.
        group, causal, softmax_scale, softcap, sinks, return_lse, layout: as in
            :func:`ring_flash_attn_func`, per sequence. Each full sequence length must divide by
            ``2W`` (zigzag) or ``W`` (contiguous).
        window_size, alibi_slopes: not supported (``NotImplementedError``).

    Returns:
        ``out [total / W, num_heads, head_dim]`` in q's dtype, and with ``return_lse=True`` also
        ``lse [num_heads, total / W]`` float32, in the shard's row order. Forward only: inputs
        that require grad raise a RuntimeError.
    """
    _check_distributed(group)
    _check_no_alibi(alibi_slopes)
    layouts.check_layout(layout)
    max_q, _ = _checks.check_varlen_inputs(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                           kernels_interpreted())
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        _checks.check_flag(name, flag)
    scale = _checks.resolve_softmax_scale(softmax_scale, q.shape[-1])
    window, cap = _checks.check_variant(q, cu_seqlens.shape[0] - 1, q.shape[1], window_size, softcap, None, sinks)
    _check_no_varlen_window(window)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q holds {q.shape[0]} tokens and k {k.shape[0]}: ring attention shards one packed "
                         "batch (self-attention), so q, k and v hold the same rows")
    ops.check_no_grad("ring_varlen", (("q", q), ("k", k), ("v", v), ("sinks", sinks)), "ring_flash_attn_varlen_func")
    ops.check_differentiation_modes((q, k, v, sinks), "ring_flash_attn_varlen_func")
    ring = Ring(group, q.device)
    lengths = _local_lengths(cu_seqlens, q.shape[0], max_q, ring.world, layout)
    total, num_heads, head_dim = q.shape
    result = MergedResult((total, num_heads, head_dim), (num_heads, total), q.device, token_dim=0)
    if total > 0:
        spec = VarlenRing(ring, layout, causal, scale, cap, cu_seqlens, lengths, max_q)
        run_ring(ring, torch.stack((k, v)), spec.pieces_for, spec.attend(q), result)
    out, lse = result.finish(q.dtype, sinks)
    return (out, lse) if return_lse else out
