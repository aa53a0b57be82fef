"""Which kernel calls one ring step needs: the visible parts of (local queries) x (a key block).

Ring attention gives each rank, step after step, another rank's key/value block. The global
mask (causal and/or a sliding window over *global* positions) decides which (query, key) pairs
of that block are visible, and flashkernel's kernel only knows block-local positions: its masks
are aligned to the bottom-right corner of the ``Sq x Sk`` block it is given (query ``i`` has
position ``i + Sk - Sq``). This module turns the global mask into calls the kernel expresses
exactly, with no bias or mask tensor:

* A shard is one or two :class:`~.layout.Segment` s (runs of consecutive global positions).
* For each pair (query segment, key segment) the visible pairs form a band
  ``lo <= i - j <= hi`` (in segment-local rows ``i``, ``j``). :func:`piece_for` trims the
  segment pair to the bounding box of the band's visible pairs: the rows that see a key and the
  keys that are seen. Inside that box the block-local diagonal lies in the band (proof at
  :func:`piece_for`), so the band is the kernel window ``(left', right')`` with both sides
  ``>= 0``, or -1 where a side binds nowhere in the box: ``(-1, -1)`` is full attention and
  ``(-1, 0)`` the kernel's causal mask. Rows outside the box see nothing of this block.
* :func:`plan_step` merges pieces where one call does: full pieces side by side (same rows,
  adjacent keys, or the reverse), and the diagonal step of a causal mask without window
  (queries and keys are the same shard, whose positions increase with the local row, so the
  block-local causal mask *is* the global one).

For the zigzag layout with a causal mask this gives, on rank ``r`` with chunks ``A = r`` and
``B = 2W-1-r``, and the block of rank ``s`` with chunks ``C = s`` and ``D = 2W-1-s``::

    s == r   [A B] x [A B]  causal                      one call, 2n x 2n, half visible
    s <  r   [A B] x  C     full  (C precedes A and B)  one call, 2n x n
    s >  r     B   x [C D]  full  (A precedes C, D)     one call, n x 2n

so every step costs every rank the same ``2 n^2`` pairs (``n`` = chunk length).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .layout import Segment

NO_WINDOW = (-1, -1)


@dataclasses.dataclass(frozen=True)
class Band:
    """The global mask: a query at position ``p`` sees a key at position ``t`` iff
    ``-right <= p - t <= left`` (None = unbounded side). Causal is ``right = 0``."""

    left: int | None = None
    right: int | None = None

    @classmethod
    def of(cls, causal: bool, window_size: tuple[int, int]) -> "Band":
        """FlashAttention's rule: ``causal`` sets the window's right side to 0."""
        left, right = window_size
        if causal:
            right = 0
        return cls(None if left < 0 else left, None if right < 0 else right)

    @property
    def is_causal(self) -> bool:
        return self.left is None and self.right == 0

    def visible(self, query_position: int, key_position: int) -> bool:
        delta = query_position - key_position
        return ((self.left is None or delta <= self.left)
                and (self.right is None or -delta <= self.right))


@dataclasses.dataclass(frozen=True)
class Piece:
    """One kernel call: local query rows ``q_start .. q_start + q_len`` against rows
    ``k_start .. k_start + k_len`` of the key block, with the block-local mask ``causal`` and
    ``window`` (as ``flash_attn_func`` takes them; -1 = unbounded side)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    causal: bool = False
    window: tuple[int, int] = NO_WINDOW

    @property
    def is_full(self) -> bool:
        return not self.causal and self.window == NO_WINDOW

    def visible(self, i: int, j: int) -> bool:
        """Whether the call computes local query row ``i`` against block key row ``j``."""
        if not (self.q_start <= i < self.q_start + self.q_len and self.k_start <= j < self.k_start + self.k_len):
            return False
        position = (i - self.q_start) + self.k_len - self.q_len
        left, right = self.window
        if self.causal:
            right = 0
        key = j - self.k_start
        return (left < 0 or key >= position - left) and (right < 0 or key <= position + right)


def _kernel_side(bound: int | None, box_extent: int) -> int:
    """A side of the block-local window: -1 when unbounded or when it binds nowhere in the box
    (``bound >= box_extent - 1``)."""
    if bound is None or bound >= box_extent - 1:
        return -1
    if bound < 0:
        raise RuntimeError(f"ring attention planned a window side of {bound}; this is a bug in the planner")
    return bound


def piece_for(q_seg: Segment, k_seg: Segment, band: Band) -> Piece | None:
    """The kernel call for one (query segment, key segment) pair, or None if nothing is visible.

    With ``d = q_seg.global_start - k_seg.global_start``, query row ``i`` and key row ``j`` of the
    segments are visible iff ``lo <= i - j <= hi``, ``lo = -right - d``, ``hi = left - d``. The
    rows that see a key are ``[max(0, lo), min(Lq - 1, Lk - 1 + hi)]`` (every row between sees
    one, as the band is convex); the keys seen are ``[max(0, i_min - hi), min(Lk - 1, i_max - lo)]``.
    The last row ``i_max`` sees the last key ``j_max`` (``j_max`` is that row's largest visible
    key since a row's largest key grows with the row), so the box's bottom-right corner, which is
    where the kernel puts its diagonal, is visible: ``lo <= i_max - j_max <= hi``. Hence the
    kernel window ``left' = hi - e``, ``right' = e - lo`` with ``e = i_max - j_max`` is ``>= 0``.
    """
    q_len, k_len = q_seg.length, k_seg.length
    if q_len == 0 or k_len == 0:
        return None
    d = q_seg.global_start - k_seg.global_start
    lo = None if band.right is None else -band.right - d
    hi = None if band.left is None else band.left - d
    i_min = 0 if lo is None else max(0, lo)
    i_max = q_len - 1 if hi is None else min(q_len - 1, k_len - 1 + hi)
    if i_min > i_max:
        return None
    j_min = 0 if hi is None else max(0, i_min - hi)
    j_max = k_len - 1 if lo is None else min(k_len - 1, i_max - lo)
    if j_min > j_max:
        return None
    rows, keys = i_max - i_min + 1, j_max - j_min + 1
    corner = i_max - j_max  # i - j at the box's bottom-right corner: the kernel's diagonal
    left = _kernel_side(None if hi is None else hi - corner, keys)
    right = _kernel_side(None if lo is None else corner - lo, rows)
    causal = (left, right) == (-1, 0)
    return Piece(q_seg.local_start + i_min, rows, k_seg.local_start + j_min, keys,
                 causal=causal, window=NO_WINDOW if causal else (left, right))


def _increasing(segments: Sequence[Segment]) -> bool:
    """Local rows ``0 ..`` in order with global positions increasing along them."""
    local, position = 0, None
    for seg in segments:
        if seg.local_start != local or (position is not None and seg.global_start < position):
            return False
        local, position = local + seg.length, seg.global_start + seg.length
    return True


def _merge_two(a: Piece, b: Piece) -> Piece | None:
    """One full piece covering two full pieces side by side, or None."""
    if not (a.is_full and b.is_full):
        return None
    if (a.q_start, a.q_len) == (b.q_start, b.q_len):
        first, second = sorted((a, b), key=lambda p: p.k_start)
        if first.k_start + first.k_len == second.k_start:
            return Piece(a.q_start, a.q_len, first.k_start, first.k_len + second.k_len)
    if (a.k_start, a.k_len) == (b.k_start, b.k_len):
        first, second = sorted((a, b), key=lambda p: p.q_start)
        if first.q_start + first.q_len == second.q_start:
            return Piece(first.q_start, first.q_len + second.q_len, a.k_start, a.k_len)
    return None


def _merge_full_pieces(pieces: list[Piece]) -> list[Piece]:
    merged = True
    while merged:
        merged = False
        for x in range(len(pieces)):
            for y in range(x + 1, len(pieces)):
                joined = _merge_two(pieces[x], pieces[y])
                if joined is not None:
                    pieces = [p for n, p in enumerate(pieces) if n not in (x, y)] + [joined]
                    merged = True
                    break
            if merged:
                break
    return sorted(pieces, key=lambda p: (p.q_start, p.k_start))


def plan_step(q_segments: Sequence[Segment], k_segments: Sequence[Segment], band: Band) -> list[Piece]:
    """The kernel calls that cover exactly the visible pairs of local queries x one key block.

    Every visible (query row, key row) pair is in exactly one piece, and no piece computes an
    invisible pair (``tests/test_ring_attention.py`` checks this by enumeration).
    """
    total = sum(s.length for s in q_segments)
    if tuple(q_segments) == tuple(k_segments) and band.is_causal and _increasing(q_segments):
        return [Piece(0, total, 0, total, causal=True)] if total else []
    pieces = [p for qs in q_segments for ks in k_segments if (p := piece_for(qs, ks, band)) is not None]
    return _merge_full_pieces(pieces)
