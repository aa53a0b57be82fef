"""Which tokens of a sequence each rank holds, and the helpers that shard and unshard.

A sequence of ``S`` tokens is spread over ``W`` ranks in one of two layouts:

* ``"contiguous"``: ``W`` chunks of ``S / W`` tokens; rank ``r`` holds chunk ``r``.
* ``"zigzag"`` (load-balanced, the default): ``2W`` chunks of ``S / (2W)`` tokens; rank ``r``
  holds chunks ``r`` and ``2W - 1 - r``, in that order. Under a causal mask a chunk's work
  grows with its position, so pairing an early chunk with its mirror image gives every rank the
  same number of visible (query, key) pairs. ``S = 16``, ``W = 2`` (chunks of 4 tokens)::

      chunk       0        1        2        3
      tokens    0..3     4..7     8..11   12..15
      rank        0        1        1        0

      rank 0 holds tokens 0..3, 12..15; rank 1 holds tokens 4..11

The sequence length must divide by the number of chunks (``2W`` zigzag, ``W`` contiguous);
nothing is padded. Packed batches (``cu_seqlens``) are sharded sequence by sequence, so rank
``r``'s shard of sequence ``b`` is the rows ``cu_seqlens[b] / W .. cu_seqlens[b + 1] / W`` of
its local tensor, and each sequence's length must divide by the number of chunks.

Positional encodings (RoPE) need the global position of each local token:
:func:`shard_positions` gives them.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")

__all__ = ["LAYOUTS", "shard", "shard_positions", "shard_varlen", "unshard", "unshard_varlen"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of consecutive tokens of a shard: local rows ``local_start .. local_start + length``
    hold global positions ``global_start .. global_start + length``."""

    local_start: int
    global_start: int
    length: int


# --- validation ---------------------------------------------------------------------------------


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def check_rank_and_world(rank, world) -> None:
    for name, value in (("world", world), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if world < 1:
        raise ValueError(f"world must be >= 1 (the number of ranks), got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}) for world = {world}, got {rank}")


def num_chunks(world: int, layout: str) -> int:
    """Chunks a sequence is cut into: ``2 * world`` for zigzag, ``world`` for contiguous."""
    return 2 * world if layout == "zigzag" else world


def check_divisible(seqlen: int, world: int, layout: str, what: str = "the sequence length") -> int:
    """The chunk length, or a ValueError naming the numbers when ``seqlen`` does not divide."""
    chunks = num_chunks(world, layout)
    if seqlen % chunks != 0:
        lower, upper = seqlen // chunks * chunks, -(-seqlen // chunks) * chunks
        raise ValueError(
            f"{what} is {seqlen}, which does not divide into {chunks} equal chunks ({layout} layout "
            f"over {world} ranks cuts it into {chunks}); pad or trim it to a multiple of {chunks} "
            f"(e.g. {upper} or {lower})"
        )
    return seqlen // chunks


# --- where each rank's tokens are -----------------------------------------------------------------


def rank_chunks(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in local order."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def rank_segments(rank: int, world: int, layout: str, local_len: int) -> tuple[Segment, ...]:
    """The runs of consecutive global positions in a shard of ``local_len`` tokens."""
    chunk_ids = rank_chunks(rank, world, layout)
    chunk = local_len // len(chunk_ids)
    return tuple(Segment(n * chunk, c * chunk, chunk) for n, c in enumerate(chunk_ids))


def shard_positions(seqlen: int, rank: int, world: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions ``[seqlen / world]`` (int64) of the tokens rank ``rank`` holds, in local
    order: ``shard(x, rank, world)`` holds ``x[:, shard_positions(...)]``. For RoPE."""
    check_layout(layout)
    check_rank_and_world(rank, world)
    chunk = check_divisible(seqlen, world, layout)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in rank_chunks(rank, world, layout)])


# --- dense tensors ------------------------------------------------------------------------------


def _check_dim(x: torch.Tensor, dim: int, name: str = "x") -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for {name} with shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x: torch.Tensor, rank: int, world: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (a new contiguous tensor).

    ``x`` is e.g. ``[B, S, H, D]`` with ``dim=1``; the result has ``S / world`` tokens along
    ``dim`` (see the module docstring for the layouts). ``S`` must divide by ``2 * world``
    (zigzag) or ``world`` (contiguous); nothing is padded.
    """
    check_layout(layout)
    check_rank_and_world(rank, world)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(x, dim)
    chunk = check_divisible(x.shape[dim], world, layout, f"x.shape[{dim}] (the sequence length)")
    parts = [x.narrow(dim, c * chunk, chunk) for c in rank_chunks(rank, world, layout)]
    return torch.cat(parts, dim=dim)


def _split_gathered(shards, world: int, dim: int, what: str) -> list[torch.Tensor]:
    """``shards`` as a list of ``world`` tensors: given as such, or concatenated along ``dim``."""
    if isinstance(shards, torch.Tensor):
        dim = _check_dim(shards, dim, what)
        if shards.shape[dim] % world != 0:
            raise ValueError(
                f"{what} has {shards.shape[dim]} rows along dim {dim}, not a multiple of world = {world}: "
                "pass the shards concatenated in rank order (e.g. from all_gather_into_tensor)"
            )
        return list(shards.chunk(world, dim)) if shards.shape[dim] else [shards] * world
    if not isinstance(shards, (list, tuple)) or not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError(f"{what} must be a tensor or a list of tensors, got {type(shards).__name__}")
    if len(shards) != world:
        raise ValueError(f"{what} has {len(shards)} shards for world = {world}: pass one per rank, in rank order")
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"the shards in {what} differ in shape: {sorted(shapes)}; every rank holds the same number of tokens")
    return list(shards)


def unshard(shards, world: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from the shards of all ranks: the inverse of :func:`shard`.

    ``shards`` is a list of ``world`` tensors in rank order, or one tensor holding them
    concatenated along ``dim`` (what ``all_gather_into_tensor`` along that dim gives).
    """
    check_layout(layout)
    check_rank_and_world(0, world)
    parts = _split_gathered(shards, world, dim, "shards")
    dim = _check_dim(parts[0], dim, "a shard")
    local_len = parts[0].shape[dim]
    per_rank = num_chunks(world, layout) // world
    check_divisible(local_len * world, world, layout, f"the gathered length ({world} x {local_len})")
    chunk = local_len // per_rank
    ordered: list[torch.Tensor | None] = [None] * num_chunks(world, layout)
    for rank, part in enumerate(parts):
        for n, c in enumerate(rank_chunks(rank, world, layout)):
            ordered[c] = part.narrow(dim, n * chunk, chunk)
    return torch.cat(ordered, dim=dim)


# --- packed (varlen) batches --------------------------------------------------------------------


def _lengths(cu_seqlens, world: int, layout: str) -> list[int]:
    """Sequence lengths from ``cu_seqlens`` (read on the host), each checked to divide."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [batch + 1] of cumulative lengths starting at 0")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {bounds}")
    lengths = [b1 - b0 for b0, b1 in zip(bounds, bounds[1:])]
    for b, length in enumerate(lengths):
        check_divisible(length, world, layout, f"sequence {b}'s length")
    return lengths


def _varlen_index(lengths: Sequence[int], rank: int, world: int, layout: str, device) -> torch.Tensor:
    """Global row indices of rank ``rank``'s packed shard, sequence after sequence."""
    parts, start = [], 0
    for length in lengths:
        chunk = length // num_chunks(world, layout)
        parts += [torch.arange(start + c * chunk, start + (c + 1) * chunk, device=device)
                  for c in rank_chunks(rank, world, layout)]
        start += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world: int,
                 layout: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of a packed batch ``x [total, ...]``, sequence by sequence.

    Returns ``(x_local [total / world, ...], cu_seqlens_local)`` with ``cu_seqlens_local =
    cu_seqlens // world`` (same dtype and device): each sequence keeps its order and its tokens
    stay together. Every sequence length must divide by ``2 * world`` (zigzag) or ``world``
    (contiguous). ``cu_seqlens`` is read on the host (a device-to-host copy on GPU).
    """
    check_layout(layout)
    check_rank_and_world(rank, world)
    lengths = _lengths(cu_seqlens, world, layout)
    if x.shape[0] != sum(lengths):
        raise ValueError(f"x has {x.shape[0]} rows but cu_seqlens ends at {sum(lengths)}")
    index = _varlen_index(lengths, rank, world, layout, x.device)
    return x.index_select(0, index), torch.div(cu_seqlens, world, rounding_mode="floor")


def unshard_varlen(shards, cu_seqlens: torch.Tensor, world: int, layout: str = "zigzag") -> torch.Tensor:
    """The full packed batch ``[total, ...]`` from every rank's :func:`shard_varlen` shard.

    ``shards``: a list of ``world`` tensors in rank order, or one tensor holding them
    concatenated along dim 0. ``cu_seqlens`` is the full batch's (as given to shard_varlen).
    """
    check_layout(layout)
    check_rank_and_world(0, world)
    lengths = _lengths(cu_seqlens, world, layout)
    parts = _split_gathered(shards, world, 0, "shards")
    if parts[0].shape[0] * world != sum(lengths):
        raise ValueError(
            f"the shards hold {world} x {parts[0].shape[0]} rows but cu_seqlens ends at {sum(lengths)}"
        )
    full = parts[0].new_empty((sum(lengths), *parts[0].shape[1:]))
    for rank, part in enumerate(parts):
        full.index_copy_(0, _varlen_index(lengths, rank, world, layout, part.device), part)
    return full
