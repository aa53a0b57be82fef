"""Comparison against the float64 reference, shared by ``flashkernel bench`` and ``check``.

The rule (the same as the test suite's): an output passes when it has no NaN and its max error
against float64 truth is at most ``2 x`` PyTorch's own max error in the same dtype
(``reference.attention(..., upcast=False)``) plus one unit of the dtype's epsilon times the
largest output magnitude.

Large benchmark shapes are checked on slices that keep the semantics exact: the first and the
last batch element, and the first and last ``window`` query rows. A window of query rows
``[r0, r1)`` under the bottom-right causal mask sees exactly the keys ``[0, r1 + Sk - Sq)`` with
the same alignment, so slicing q and k that way reproduces the full computation's rows.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import reference

TRUTH_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Window:
    """Batch index and query-row range ``[row_start, row_stop)`` of one checked slice."""

    batch: int
    row_start: int
    row_stop: int


@dataclasses.dataclass
class Truth:
    """Float64 truth and PyTorch's same-dtype result on each window (outputs ``[1, rows, H, D]``)."""

    windows: list
    truth: list
    torch_out: list


@dataclasses.dataclass(frozen=True)
class Accuracy:
    max_err: float
    torch_err: float
    bound: float
    has_nan: bool

    @property
    def ok(self) -> bool:
        return not self.has_nan and self.max_err <= self.bound

    @property
    def ratio(self) -> float:
        """Error relative to PyTorch's own (inf when PyTorch is exact and we are not)."""
        if self.torch_err > 0:
            return self.max_err / self.torch_err
        return 0.0 if self.max_err == 0 else float("inf")


def error_bound(torch_err: float, truth_abs_max: float, dtype: torch.dtype, logit_bound: float | None = None) -> float:
    """Largest max error allowed (see the module docstring).

    With ``logit_bound`` (a bound on ``softmax_scale * |q| |k|`` over the rows and keys compared)
    the bound also allows for the float32 rounding of the scores, ``eps32 * logit_bound``: the
    absolute error of a float32 ``q.k`` grows with ``|q| |k|`` even where the score is small (it
    cancels, or a softcap bends it), and scaled scores are rounded at their own magnitude. No
    float32 softmax avoids it, but PyTorch's error on a few rows may happen not to show it (at a
    power-of-two scale PyTorch rounds each score once, the kernels twice: the scale is folded
    with ``log2(e)``). It matters for float32 and for large logits.
    """
    bound = TRUTH_FACTOR * torch_err + torch.finfo(dtype).eps * max(1.0, truth_abs_max)
    if logit_bound is not None:
        bound += torch.finfo(torch.float32).eps * max(1.0, logit_bound) * max(1.0, truth_abs_max)
    return bound


def row_windows(batch: int, seqlen_q: int, window: int | None) -> list[Window]:
    """Slices to check: first and last batch element x first and last ``window`` rows.

    ``window=None`` checks everything (one slice per batch element).
    """
    if window is None:
        return [Window(b, 0, seqlen_q) for b in range(batch)]
    batches = sorted({0, batch - 1})
    if seqlen_q <= 2 * window:
        ranges = [(0, seqlen_q)]
    else:
        ranges = [(0, window), (seqlen_q - window, seqlen_q)]
    return [Window(b, r0, r1) for b in batches for r0, r1 in ranges]


def _keys_seen(window: Window, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    if not causal:
        return seqlen_k
    return max(0, min(seqlen_k, window.row_stop + seqlen_k - seqlen_q))


def _attention_or_zeros(q, k, v, causal, softmax_scale, upcast):
    """``reference.attention`` that also accepts zero keys (every row sees nothing: output 0)."""
    if k.shape[1] == 0:
        dtype = torch.float64 if upcast else q.dtype
        return torch.zeros(q.shape, dtype=dtype, device=q.device)
    out, _ = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=upcast)
    return out


def dense_truth(q, k, v, *, causal: bool, softmax_scale=None, window: int | None = None) -> Truth:
    """Truth for ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` on the windows of :func:`row_windows`."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    windows = row_windows(q.shape[0], seqlen_q, window)
    truth, torch_out = [], []
    for w in windows:
        keys = _keys_seen(w, seqlen_q, seqlen_k, causal)
        qs = q[w.batch : w.batch + 1, w.row_start : w.row_stop]
        ks, vs = k[w.batch : w.batch + 1, :keys], v[w.batch : w.batch + 1, :keys]
        truth.append(_attention_or_zeros(qs, ks, vs, causal, softmax_scale, upcast=True))
        torch_out.append(_attention_or_zeros(qs, ks, vs, causal, softmax_scale, upcast=False))
    return Truth(windows, truth, torch_out)


def compare(out: torch.Tensor, truth: Truth) -> Accuracy:
    """Compare ``out [B, Sq, H, D]`` with the truth on its windows."""
    max_err = torch_err = truth_max = 0.0
    has_nan = False
    for w, exact, same_dtype in zip(truth.windows, truth.truth, truth.torch_out):
        piece = out[w.batch : w.batch + 1, w.row_start : w.row_stop]
        has_nan = has_nan or bool(torch.isnan(piece).any())
        if piece.numel() == 0:
            continue
        max_err = max(max_err, (piece.double() - exact).abs().max().item())
        torch_err = max(torch_err, (same_dtype.double() - exact).abs().max().item())
        truth_max = max(truth_max, exact.abs().max().item())
    if has_nan:
        max_err = float("nan")
    bound = error_bound(torch_err, truth_max, out.dtype)
    return Accuracy(max_err, torch_err, bound, has_nan)


def wrong_shape(out, expected_shape) -> str | None:
    """A message when a provider's output has the wrong shape, else None."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if tuple(out.shape) != tuple(expected_shape):
        return f"output shape {tuple(out.shape)}, expected {tuple(expected_shape)}"
    return None
