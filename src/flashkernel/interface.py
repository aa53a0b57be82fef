"""The public face of flashkernel: docstrings, validation, and the call into the op layer.

Every public function validates its arguments (through ``_checks``) and runs its op
(``ops.py``): through ``torch.ops.flashkernel`` when compiling or when autograd records the
call, and directly otherwise. In eager mode a call whose tensor layouts and scalar arguments
equal an earlier call's skips both validation (what it checks cannot have changed) and
dispatch: the launches recorded for that earlier call are replayed with the new tensors'
addresses (``kernels/_launch.py``). Any other call takes the whole path.
"""

from __future__ import annotations

import warnings

import torch

from . import _checks, ops, reference
from .kernels import decode, dispatch, naive
from .kernels._launch import UNREADABLE, CallCache, allocate, layouts, runtime_key, stream_capturing

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "quantize_kv", "standard_attention"]

MAX_NAIVE_ROWS = 65535  # grid-axis limit of the naive kernels' (batch * heads) axis

_EAGER_CALLS = CallCache()


def kernels_interpreted() -> bool:
    """True when flashkernel's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return dispatch.interpreted()


def _eager(tensors) -> bool:
    """Whether a call may skip the dispatcher: not compiling, plain CUDA tensors, no gradient
    wanted (then nothing but our own launches can observe the op). Arguments that are not
    tensors (bad input) say no with grad mode on; without it :func:`_key` gives them no key.
    Either way validation names them."""
    q = tensors[0]
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor or not q.is_cuda:
        return False
    try:
        return not ops.needs_grad(tensors)
    except AttributeError:
        return False


def _probe(name: str, scalars: tuple, window_size) -> tuple:
    """A call's key without its tensors: its scalars with their types (``1``, ``1.0`` and
    ``True`` are equal but validation accepts some of them and not others) and the window."""
    if window_size is not _checks.NO_WINDOW and isinstance(window_size, (tuple, list)):
        window_size = (window_size.__class__, tuple(window_size), tuple(map(type, window_size)))
    return name, scalars, tuple(map(type, scalars)), window_size


def _key(probe: tuple, tensors) -> tuple | None:
    """A call's cache key: its :func:`_probe` and the tensors' layouts; None when an argument is
    not a tensor (bad input: validation names it)."""
    try:
        return (*probe, layouts(tensors))
    except UNREADABLE:
        return None


def _lookup(name: str, scalars: tuple, window_size, tensors, by_capture: bool = False):
    """``(results, probe, key)`` of an eager call: the outputs of a replayed earlier call with
    these scalars and the tensors' layouts (None when there is none), and for recording this
    call, its probe and key (None when it may not be recorded: see :func:`_eager`).
    ``by_capture``: the call's launches depend on whether a CUDA graph is being captured, which
    becomes one more scalar.

    The recent calls (``CallCache.quick``) answer first: the same few calls over and over, as a
    model's layers make them, are found without building the key."""
    if torch.compiler.is_compiling() or type(tensors[0]) is not torch.Tensor:
        return None, None, None
    capturing = None
    if by_capture:
        capturing = tensors[0].is_cuda and stream_capturing()
        scalars = (*scalars, capturing)
    probe = _probe(name, scalars, window_size)
    results = _EAGER_CALLS.quick(probe, tensors, capturing)
    if results is not None or not _eager(tensors):
        return results, None, None
    key = _key(probe, tensors)
    return _replay(key, probe, tensors), probe, key


def _recent_run(name: str, scalars: tuple, window_size, tensors, by_capture: bool = False):
    """The outputs of this call run by a recent replay in one call into the C launcher
    (``eager_run``: :func:`_lookup`'s first step, the look-up among ``CallCache.quick``'s replays,
    and the run), or None where Python's path has a step to take (no C launcher, no such replay,
    a guard that turns the tensors away, a differentiation mode active, torch.compile tracing).
    The caller's differentiation-mode check may follow: the C call leaves active modes to it."""
    if torch.compiler.is_compiling():  # first: a traced read of native_quick would guard on it
        return None
    quick_run = _EAGER_CALLS.native_quick
    if quick_run is None:
        return None
    results = quick_run(_EAGER_CALLS._recent, name, scalars, window_size, tensors, by_capture)
    return None if results is NotImplemented else results


def _replay(key, probe, tensors):
    """The outputs of a replayed earlier call of the same key, or None (no such call, no key, or
    a key that cannot be hashed)."""
    if key is None:
        return None
    try:
        replay = _EAGER_CALLS.get_noted(key, probe, tensors)
    except TypeError:
        return None
    return None if replay is None else replay.run(tensors, reuse_scratch=True)


def _check_values(validate, index_tensor: torch.Tensor) -> bool:
    """Whether to read and check the values of the index tensors (lengths, offsets, pages):
    ``validate=True`` always, ``None`` when they live on the CPU (no device sync). Not while
    torch.compile traces (it cannot trace a read of tensor values): ``None`` skips, ``True``
    is an error."""
    if torch.compiler.is_compiling():
        if validate:
            raise ValueError("validate=True reads the index tensors' values, which torch.compile cannot trace; "
                             "validate them before the compiled region, or pass validate=None")
        return False
    return bool(validate) or (validate is None and index_tensor.device.type == "cpu")


def _validate_dense(q, k, v, causal, softmax_scale, return_lse) -> float:
    _checks.check_qkv(q, k, v, kernels_interpreted())
    _checks.check_flag("causal", causal)
    _checks.check_flag("return_lse", return_lse)
    return _checks.resolve_softmax_scale(softmax_scale, q.shape[-1])


def _empty_results(q: torch.Tensor, want_lse: bool, sinks: torch.Tensor | None = None, kv=None):
    """Outputs for calls that need no launch: batch or seqlen_q is 0, or there are no keys.

    Every row sees no key: output 0 and LSE -inf, or LSE = the head's sink with ``sinks``.
    ``q`` is ``[B, Sq, Hq, D]`` (LSE ``[B, Hq, Sq]``) or packed ``[total_q, Hq, D]`` (LSE
    ``[Hq, total_q]``). ``kv``: ``(k, v)`` of a call with a backward, whose output then carries
    zero gradients to q, k and v (the LSE's to the sinks), as the kernels' backward would.
    """
    out = (torch.zeros_like(q, memory_format=torch.contiguous_format) if kv is None
           else ops.output_without_keys(q, *kv))
    if not want_lse:
        return out, None
    if q.dim() == 4:
        batch, seqlen_q, num_heads, _ = q.shape
        shape, head_axis = (batch, num_heads, seqlen_q), (None, slice(None), None)
    else:
        total_q, num_heads, _ = q.shape
        shape, head_axis = (num_heads, total_q), (slice(None), None)
    lse = torch.full(shape, float("-inf"), dtype=torch.float32, device=q.device)
    if sinks is not None:
        lse.copy_(sinks[head_axis].expand(shape))
    return out, lse


def _with_lse_for_backward(scalars: tuple, tensors) -> tuple:
    """The op's scalars (``..., return_lse, backend``) with ``return_lse`` on when autograd will
    record the call: the backward recomputes the attention from the saved LSE."""
    return (*scalars[:-2], True, scalars[-1]) if ops.needs_grad(tensors) else scalars


def _run(op: str, public: str, eager_key, tensors, named, run_eager, run_op, family=None, probe=None):
    """Run a validated call: recorded for replay in eager mode (and filed under ``family`` and
    ``probe`` when given, see ``CallCache``), else through the op ``op`` (after checking that no
    gradient is wanted where the op has no backward; ``named`` are the differentiable inputs
    with their names)."""
    if eager_key is not None:
        try:
            hash(eager_key)
        except TypeError:  # an unhashable key (a scalar argument given as a list): not recorded
            return run_eager()
        return _EAGER_CALLS.run(eager_key, tensors, run_eager, family, probe)
    ops.check_no_grad(op, named, f"flashkernel.{public}")
    return run_op()


def _warn_if_slopes_want_grad(alibi_slopes) -> None:
    """ALiBi slopes get no gradient (the backward computes none): say so when they ask for one."""
    if (getattr(alibi_slopes, "requires_grad", False) and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):  # torch.compile cannot trace warnings.warn
        warnings.warn("alibi_slopes requires grad, but flashkernel's backward computes no gradient for the slopes "
                      "(they stay fixed); train them with flashkernel.reference.attention or PyTorch's attention",
                      stacklevel=3)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = _checks.NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
):
    """Exact attention, fused in one kernel: ``softmax(scale * q k^T [+ mask]) v``.

    Args:
        q: ``[batch, seqlen_q, num_heads, head_dim]``.
        k: ``[batch, seqlen_k, num_kv_heads, head_dim]``.
        v: ``[batch, seqlen_k, num_kv_heads, head_dim]``.
            Any strides are accepted as long as the last dimension is contiguous (for example
            q, k, v as views of one packed ``[batch, seqlen, 3, heads, head_dim]`` tensor); no
            copy is made. dtype float16, bfloat16 or float32 (all three the same);
            ``head_dim`` any multiple of 8 from 8 to 256.
            GQA / MQA: ``num_heads`` must be a multiple of ``num_kv_heads``; query head ``h``
            reads key/value head ``h // (num_heads // num_kv_heads)``.
        causal: mask aligned to the bottom-right corner, as FlashAttention >= 2.1: query ``i``
            sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``. With seqlen_q = 2,
            seqlen_k = 5 (1 = visible)::

                1 1 1 1 0
                1 1 1 1 1

            and with seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A query row that sees no key returns 0 (and LSE = -inf), never NaN.
        softmax_scale: scale applied to ``q k^T``; default ``1 / sqrt(head_dim)``. At most 1 the
            softmax's exponent is one fused multiply-add, exact while ``|scale * q.k| < 9e7``;
            above 1 the kernels are compiled without that fusion (exact at any score).
        window_size: ``(left, right)``, local (sliding-window) attention; -1 = unbounded side,
            ``(-1, -1)`` (default) = no window. Query ``i`` sees keys ``j`` with
            ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (aligned bottom-right like
            ``causal``). ``causal=True`` sets ``right = 0`` (so the two combine as the
            intersection of their masks; FlashAttention's rule). Key tiles outside every
            row's window are skipped, so time falls with the window. ``Sq = 4, Sk = 6``,
            window ``(1, 0)``::

                0 1 1 0 0 0
                0 0 1 1 0 0
                0 0 0 1 1 0
                0 0 0 0 1 1

        softcap: cap scores at ``softcap * tanh(score / softcap)`` before the softmax, where
            ``score = softmax_scale * q.k`` (the scale applies inside the tanh, as in
            FlashAttention and Gemma 2); 0 (default) = off.
        alibi_slopes: float32 ``[num_heads]`` or ``[batch, num_heads]``: add
            ``-slope * |i + Sk - Sq - j|`` to the (capped) scores, with or without ``causal``.
        sinks: ``[num_heads]`` (float32, float16 or bfloat16, read as float32): a per-head logit
            that joins the softmax denominator with no value vector (gpt-oss): ``out = sum_j
            e^(s_j) v_j / (e^sink + sum_j e^(s_j))``. The returned LSE includes it; a row that
            sees no key returns 0 with LSE = sink. The sink is compared with the final scores as
            is (not scaled or capped). Each sink is a finite logit or -inf (no sink); +inf or NaN
            sinks are not checked (that would read the tensor) and give NaN.
        return_lse: also return the log-sum-exp of each row.
        deterministic: make the backward's gradients repeat bit for bit (see "Gradients" below);
            the forward is unaffected.
        backend: ``"auto"`` (default), ``"triton"`` or ``"gluon"``: which kernel runs the call
            (``kernels/dispatch.py``). ``"auto"`` takes the Gluon kernel on Hopper for plain
            attention at head dim 64/128/256 in bf16/fp16, else the Triton kernel; naming a
            backend that cannot run the call raises a ValueError that says why.

    The variants combine freely with each other, ``causal`` and GQA; order of operations:
    scale, cap, ALiBi bias, masks, softmax with the sink (``reference.py`` is the spec). Each
    is compiled in only when used: a plain call runs the same code as without them.

    Gradients: differentiable (``loss.backward()``, ``torch.autograd.grad``, inside
    ``torch.compile``) for ``q``, ``k``, ``v`` and ``sinks`` (in the sinks' dtype), also through
    the returned LSE; ``alibi_slopes`` get none. The backward recomputes the attention from the
    saved LSE (memory O(seqlen)); there is no dropout. With ``deterministic=True`` (this call)
    or under ``torch.use_deterministic_algorithms(True)`` (every call) the gradients repeat bit
    for bit: the backward keeps the Triton kernels (otherwise the Gluon backward adds dQ in
    arrival order). First order only: differentiating the gradients again raises. float64 is
    not accepted; ``flashkernel.reference.attention`` is the float64 spec (and differentiable)
    for gradient checks.

    Returns:
        ``out [batch, seqlen_q, num_heads, head_dim]`` in the input dtype (contiguous), and with
        ``return_lse=True`` also ``lse [batch, num_heads, seqlen_q]`` float32, natural log.
        Softmax statistics and accumulation are float32.

    Example::

        >>> q = torch.randn(2, 1024, 32, 128, device="cuda", dtype=torch.bfloat16)
        >>> k = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
        >>> v = torch.randn_like(k)
        >>> out = flash_attn_func(q, k, v, causal=True)        # [2, 1024, 32, 128]
    """
    tensors = (q, k, v, alibi_slopes, sinks)
    probe_scalars = (causal, softmax_scale, softcap, return_lse, deterministic, backend)
    # (slopes that want a gradient fail a replay's guard: their warning below is not skipped)
    results = _recent_run("fwd", probe_scalars, window_size, tensors)
    if results is not None:
        return results if return_lse else results[0]
    ops.check_differentiation_modes(tensors, "flashkernel.flash_attn_func")
    if alibi_slopes is not None:
        _warn_if_slopes_want_grad(alibi_slopes)
    results, probe, key = _lookup("fwd", probe_scalars, window_size, tensors)
    if results is not None:
        return results if return_lse else results[0]
    scale = _validate_dense(q, k, v, causal, softmax_scale, return_lse)
    _checks.check_flag("deterministic", deterministic)
    batch, seqlen_q, num_heads, head_dim = q.shape
    window, cap = _checks.check_variant(q, batch, num_heads, window_size, softcap, alibi_slopes, sinks)
    dispatch.check_backend(backend)
    if batch == 0 or seqlen_q == 0 or k.shape[1] == 0:
        out, lse = _empty_results(q, return_lse, sinks, kv=(k, v))
        return (out, lse) if return_lse else out
    scalars = (causal, scale, window[0], window[1], cap, return_lse, backend)
    op_scalars = _with_lse_for_backward(scalars, tensors)
    out, lse = _run("fwd", "flash_attn_func", key, tensors, (("q", q), ("k", k), ("v", v), ("sinks", sinks)),
                    lambda: ops.fwd_impl(*tensors, *scalars), lambda: ops.fwd(*tensors, *op_scalars, deterministic),
                    probe=probe)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = _checks.NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    validate: bool | None = None,
    backend: str = "auto",
):
    """Attention over packed sequences of different lengths, with no padding.

    Sequence ``b`` is rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of ``q`` and rows
    ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]`` of ``k, v``; it attends to its own keys only,
    exactly as :func:`flash_attn_func` on that sequence alone would (masks and ALiBi aligned
    bottom-right to its own lengths ``Sq_b, Sk_b``).

    Args:
        q: ``[total_q, num_heads, head_dim]``; k, v: ``[total_k, num_kv_heads, head_dim]``.
            dtypes, head dims, GQA and strides as in :func:`flash_attn_func`.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]``, cumulative lengths: start at 0,
            never decrease, end at ``total_q`` / ``total_k``. Sequences may be empty.
        max_seqlen_q, max_seqlen_k: ints, at least the longest query / key sequence. They pick
            tile configurations and bound the launch grid (no device-to-host copy of the
            lengths is made); a value below the true maximum can leave rows unwritten.
        causal, softmax_scale, window_size, softcap, sinks, return_lse, deterministic: as in
            :func:`flash_attn_func`, per sequence.
        alibi_slopes: float32 ``[num_heads]`` or ``[batch, num_heads]`` (row ``b`` for
            sequence ``b``).
        validate: check the values of ``cu_seqlens_*`` (start at 0, non-decreasing, last =
            number of tokens) and the ``max_seqlen_*`` against them. That reads the tensors, a
            device-to-host sync on GPU, so ``None`` (default) checks only when they live on the
            CPU; ``True`` always checks (not inside CUDA-graph capture), ``False`` never.
            Unchecked bad offsets give unspecified results but no out-of-bounds memory access
            (the kernel clamps them to ``[0, total]``).
        backend: ``"auto"`` or ``"triton"`` (packed sequences run on the Triton kernel).

    Work: one program per (query tile of a sequence, head); the tiles of all sequences are laid
    end to end in one grid axis and each program finds its sequence from ``cu_seqlens_q`` on
    the device. So no tile is spent on padding, and the host never reads the lengths.

    Gradients: as :func:`flash_attn_func`'s (q, k, v and sinks; first order; the backward of
    packed sequences runs on the Triton kernels, so its gradients repeat bit for bit with or
    without ``deterministic=True`` or ``torch.use_deterministic_algorithms(True)``).

    Returns:
        ``out [total_q, num_heads, head_dim]`` in q's dtype, and with ``return_lse=True`` also
        ``lse [num_heads, total_q]`` float32, natural log.

    Example (three sequences of 5, 300 and 17 tokens)::

        >>> lengths = torch.tensor([5, 300, 17], device="cuda")
        >>> cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()   # [0, 5, 305, 322]
        >>> q = torch.randn(322, 32, 128, device="cuda", dtype=torch.bfloat16)
        >>> k = torch.randn(322, 8, 128, device="cuda", dtype=torch.bfloat16)
        >>> out = flash_attn_varlen_func(q, k, torch.randn_like(k), cu, cu, 300, 300, causal=True)
    """
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    probe_scalars = (max_seqlen_q, max_seqlen_k, causal, softmax_scale, softcap, return_lse, deterministic, validate,
                     backend)
    if validate is not True:  # (as flash_attn_func's)
        results = _recent_run("varlen", probe_scalars, window_size, tensors)
        if results is not None:
            return results if return_lse else results[0]
    ops.check_differentiation_modes(tensors, "flashkernel.flash_attn_varlen_func")
    if alibi_slopes is not None:
        _warn_if_slopes_want_grad(alibi_slopes)
    probe = key = None
    if validate is not True:  # else the values are read and checked at every call
        results, probe, key = _lookup("varlen", probe_scalars, window_size, tensors)
        if results is not None:
            return results if return_lse else results[0]
    interpreted = kernels_interpreted()
    max_q, max_k = _checks.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, interpreted)
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic)):
        _checks.check_flag(name, flag)
    _checks.check_optional_flag("validate", validate)
    scale = _checks.resolve_softmax_scale(softmax_scale, q.shape[-1])
    batch = cu_seqlens_q.shape[0] - 1
    total_q, num_heads, head_dim = q.shape
    window, cap = _checks.check_variant(q, batch, num_heads, window_size, softcap, alibi_slopes, sinks)
    dispatch.check_backend(backend)
    if _check_values(validate, cu_seqlens_q):
        _checks.check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0], max_q, max_k)
    if batch == 0 or total_q == 0 or k.shape[0] == 0 or max_q == 0:
        out, lse = _empty_results(q, return_lse, sinks, kv=(k, v))
        return (out, lse) if return_lse else out
    scalars = (causal, scale, window[0], window[1], cap, return_lse, backend)

    def run_eager():
        return ops.varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, alibi_slopes, sinks, *scalars)

    op_scalars = _with_lse_for_backward(scalars, tensors)
    out, lse = _run("varlen_fwd", "flash_attn_varlen_func", key, tensors,
                    (("q", q), ("k", k), ("v", v), ("sinks", sinks)), run_eager,
                    lambda: ops.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, alibi_slopes, sinks,
                                           *op_scalars, deterministic), probe=probe)
    return (out, lse) if return_lse else out


def standard_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """Textbook attention in three kernels (QK^T, softmax, PV) that materialize ``[B, H, Sq, Sk]``.

    Same arguments, semantics and results as :func:`flash_attn_func`; it exists as the baseline
    for benchmarks. Its memory grows as ``seqlen_q * seqlen_k`` (a float32 score matrix and a
    probability matrix in the input dtype), so it is for measurement, not for production.
    """
    scale = _validate_dense(q, k, v, causal, softmax_scale, return_lse)
    ops.check_differentiation_modes((q, k, v), "flashkernel.standard_attention")
    batch, seqlen_q, num_heads, _ = q.shape
    if batch * num_heads > MAX_NAIVE_ROWS:
        raise ValueError(
            f"standard_attention supports batch * heads <= {MAX_NAIVE_ROWS}, got "
            f"{batch} * {num_heads} = {batch * num_heads}; use flash_attn_func"
        )
    ops.check_no_grad("standard_attention", (("q", q), ("k", k), ("v", v)), "flashkernel.standard_attention")
    if batch == 0 or seqlen_q == 0 or k.shape[1] == 0:
        out, lse = _empty_results(q, return_lse)
    else:
        out = allocate(q.shape, q.dtype, q.device)
        lse = allocate((batch, num_heads, seqlen_q), torch.float32, q.device)
        with ops.on_device(q):
            naive.standard_attention(q, k, v, out, lse, causal=causal, softmax_scale=scale)
    return (out, lse) if return_lse else out


def _validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal,
                      softmax_scale, num_splits, return_lse, validate, k_scale=None, v_scale=None) -> float:
    _checks.check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                 kernels_interpreted(), k_scale, v_scale)
    _checks.check_cache_leftpad(cache_leftpad, q)
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        _checks.check_flag(name, flag)
    _checks.check_optional_flag("validate", validate)
    _checks.check_num_splits(num_splits)
    geometry = decode.CacheGeometry.of(k_cache, block_table)
    appended = q.shape[1] if k is not None else 0
    _checks.check_cache_capacity(q.shape[1], k is not None, geometry.capacity, block_table)
    if _check_values(validate, cache_seqlens):
        _checks.check_kvcache_values(cache_seqlens, block_table, appended, geometry.capacity,
                                     geometry.num_blocks, max(geometry.page_size, 1), cache_leftpad)
    return _checks.resolve_softmax_scale(softmax_scale, q.shape[-1])


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = _checks.NO_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    validate: bool | None = None,
    backend: str = "auto",
):
    """Decode step: append new keys/values to a KV cache in place, then attend to the cache.

    Args:
        q: ``[batch, seqlen_q, num_heads, head_dim]``, the new tokens' queries; ``seqlen_q`` is
            1 for plain decode, more for speculative or chunked tokens.
        k_cache, v_cache: the cache, in one of two layouts (same shape; q's dtype, or both
            quantized: ``torch.float8_e4m3fn`` or ``torch.int8`` with ``k_scale``/``v_scale``):

            * contiguous ``[batch, max_seqlen, num_kv_heads, head_dim]``: sequence ``b``'s
              token ``j`` is ``k_cache[b, j]``;
            * paged ``[num_blocks, page_size, num_kv_heads, head_dim]`` with ``block_table``:
              token ``j`` of sequence ``b`` is ``k_cache[block_table[b, j // page_size],
              j % page_size]``. ``page_size`` is any power of two from 1 to 256.

            Any strides with a contiguous last dimension. Modified in place when ``k, v`` are
            given, and only at the slots written (nothing else in the cache changes).
        k, v: ``[batch, seqlen_q, num_kv_heads, head_dim]`` or None (both or neither): new
            keys/values, written to positions ``cache_seqlens[b] .. cache_seqlens[b] +
            seqlen_q - 1`` of sequence ``b`` before attending.
        cache_seqlens: ``[batch]`` int32, tokens already in each sequence's cache (lengths may
            differ and may be 0). Not modified: the caller advances it by ``seqlen_q`` after a
            step that appended (as FlashAttention does). The keys attended are positions
            ``[0, L)`` with ``L = cache_seqlens[b] + seqlen_q`` when ``k, v`` are given, else
            ``L = cache_seqlens[b]``.
        block_table: ``[batch, max_blocks]`` int32 page indices into ``k_cache``'s first
            dimension, or None for a contiguous cache. Only the first ``ceil(L / page_size)``
            entries of each row are read. Entries past a sequence's pages may be anything (-1
            included): they are never read, and an append that would land past the entries
            of valid pages is skipped.
        cache_leftpad: ``[batch]`` int32 or None: sequence ``b``'s keys start at cache position
            ``cache_leftpad[b]`` (a left-padded batch, or a static cache whose first slots are
            unused): it attends positions ``[cache_leftpad[b], L)`` as a sequence of
            ``L - cache_leftpad[b]`` keys. Masks and ALiBi depend only on differences of
            positions, so they are unchanged; new keys are still written at
            ``cache_seqlens[b]``. Values are clamped to ``[0, L]``.
        k_scale, v_scale: float32 scales of a quantized cache (required with one, refused
            without), on its device, both of one granularity told by the shape:

            * ``[1]`` (or ``[]``): one per tensor (vLLM's default);
            * ``[num_kv_heads]``: one per KV head;
            * the cache's leading dims, ``[batch, max_seqlen, num_kv_heads]`` (contiguous) or
              ``[num_blocks, page_size, num_kv_heads]`` (paged): one per token and KV head,
              beside each cache slot.

            Cache entry ``c`` with scale ``s`` stands for ``c * s``. Appended tokens are
            quantized on the way in: ``x / s`` in float32, saturated to the format's
            range (+-448 for e4m3, +-127 for int8), rounded to nearest even. With per-tensor or
            per-head scales, ``s`` is the given (static) scale: values beyond ``448 * s`` (int8:
            ``127 * s``) saturate. With per-token scales each new token and head gets ``s = max
            |x| / 448`` (int8: ``/ 127``) from its own values, written to its slot of
            ``k_scale``/``v_scale`` (so those are modified in place, like the caches). The
            scales are device tensors, so nothing syncs with the host and a step stays CUDA-graph
            capturable; values are not checked (they must be positive and finite). q stays
            bf16/fp16/fp32; softmax statistics and accumulation stay float32.
            ``flashkernel.quantize_kv`` converts an existing cache; ``KVCache(cache_dtype=...)``
            keeps one.

            Accuracy: against float64 attention over the dequantized cache (``c * s``, see
            ``reference.dequantize``) the same bound as a cache in q's dtype holds (the kernels'
            error is at most twice PyTorch's, plus the output's rounding); the error of the
            quantization itself, against a bf16 cache, is in the README ("Quantized KV cache").
        causal: the new tokens attend causally among themselves, aligned to the end of each
            sequence: query ``t`` sees keys ``j <= L - seqlen_q + t``. With cache_seqlens = 3
            and two new tokens appended (L = 5), 1 = visible::

                keys ->        0 1 2 3 4
                new token 0    1 1 1 1 0     (stored at position 3)
                new token 1    1 1 1 1 1     (stored at position 4)

            Without ``k, v`` and ``L < seqlen_q`` the first ``seqlen_q - L`` queries see no
            key and return 0 (LSE -inf). With ``causal=False`` every query sees ``[0, L)``.
        softmax_scale: scale applied to ``q k^T``; default ``1 / sqrt(head_dim)``.
        window_size: ``(left, right)``, -1 = unbounded, aligned to each sequence's end: new
            token ``t`` (position ``L - seqlen_q + t``) sees keys ``j`` with ``L - seqlen_q + t
            - left <= j <= L - seqlen_q + t + right``; ``causal=True`` sets ``right = 0``. Only
            the tiles inside the window are read (and split), so a decode step with a window
            of ``w`` reads about ``w`` keys whatever the context length.
        softcap, alibi_slopes (``[num_heads]`` or ``[batch, num_heads]``), sinks
            (``[num_heads]``): as in :func:`flash_attn_func`; the ALiBi distance of new token
            ``t`` to key ``j`` is ``|L - seqlen_q + t - j|``. A sequence with no key returns 0
            and LSE = sink.
        num_splits: split each sequence's context over this many programs per (sequence, KV
            head) and merge the parts exactly by log-sum-exp; 0 (default) picks it from the
            GPU's SM count and the cache capacity (shapes only). 1 disables splitting.
        return_lse: also return the log-sum-exp of each row.
        validate: check that lengths fit the capacity and that the used block-table entries
            lie in ``[0, num_blocks)``. That reads the tensors, a device-to-host sync on GPU,
            so ``None`` (default) checks only when they live on the CPU; ``True`` always checks
            (not inside CUDA-graph capture), ``False`` never. Unchecked bad values give
            unspecified results but no out-of-bounds memory access (lengths and page indices
            are clamped; appends that cannot be placed are skipped).
        backend: ``"auto"`` (default), ``"triton"`` or ``"gluon"`` (``kernels/dispatch.py``):
            ``"auto"`` takes the Gluon kernel on Hopper for plain attention over paged caches at
            head dim 128 whose splits read at most 4096 keys while a CUDA graph is being captured
            (with ``k, v``: only at batch <= 16 and batch x capacity >= 4096, since the Triton
            kernel writes the new tokens itself and the Gluon kernel needs a launch for them),
            else the Triton kernel.

    GQA / MQA: ``num_heads`` must be a multiple of ``num_kv_heads``; query head ``h`` reads KV
    head ``h // (num_heads // num_kv_heads)``. The query heads of one KV head are computed
    together, so each cache byte is read once per call.

    Returns:
        ``out [batch, seqlen_q, num_heads, head_dim]`` in q's dtype, and with
        ``return_lse=True`` also ``lse [batch, num_heads, seqlen_q]`` float32, natural log.

    No host synchronisation: a step can be captured in a CUDA graph (run it eagerly once with the
    same shapes first, so its kernels are compiled before capture; replays then match eager
    calls). The float32 split-KV partials are taken per call from PyTorch's caching allocator (no
    new device memory once warm; a repeated eager call keeps its own per stream,
    ``kernels/_launch.Replay``). Results are deterministic for fixed inputs and ``num_splits``.
    Calls may run at once from several threads and streams (calls sharing a stream issue their
    launches one call at a time).

    Example (a paged cache of 16-token pages; one decode step)::

        >>> cache = KVCache(num_blocks=1024, page_size=16, num_kv_heads=8, head_dim=128,
        ...                 batch=4, max_blocks_per_seq=64, dtype=torch.bfloat16, device="cuda")
        >>> cache.reserve(1)                                   # room for one more token each
        >>> q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        >>> k = torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        >>> out = flash_attn_with_kvcache(q, cache.k_pages, cache.v_pages, k=k, v=torch.randn_like(k),
        ...                               cache_seqlens=cache.cache_seqlens, block_table=cache.block_table)
        >>> cache.advance(1)                                   # cache_seqlens += 1
    """
    # The scales' layouts are part of the replay key, like the caches' dtypes: a call over a
    # quantized cache never replays the launches of a call over another format or granularity.
    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, alibi_slopes, sinks, k_scale,
               v_scale)
    probe_scalars = (causal, softmax_scale, softcap, num_splits, return_lse, validate, backend)
    if validate is not True:
        results = _recent_run("kvcache", probe_scalars, window_size, tensors, by_capture=True)
        if results is not None:
            return results if return_lse else results[0]
    ops.check_differentiation_modes(tensors, "flashkernel.flash_attn_with_kvcache")
    probe = key = None
    if validate is not True:  # else the values are read and checked at every call
        results, probe, key = _lookup("kvcache", probe_scalars, window_size, tensors, by_capture=True)
        if results is None and key is not None:
            results = _rebound_length(key, probe, tensors, causal, softmax_scale, window_size, softcap, num_splits,
                                      return_lse, backend)
        if results is not None:
            return results if return_lse else results[0]
    scale = _validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal,
                              softmax_scale, num_splits, return_lse, validate, k_scale, v_scale)
    batch, seqlen_q, num_heads, head_dim = q.shape
    window, cap = _checks.check_variant(q, batch, num_heads, window_size, softcap, alibi_slopes, sinks)
    dispatch.check_backend(backend)
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("sinks", sinks),
             ("k_scale", k_scale), ("v_scale", v_scale))
    if batch == 0 or seqlen_q == 0 or decode.CacheGeometry.of(k_cache, block_table).capacity == 0:
        ops.check_no_grad("kvcache_fwd", named, "flashkernel.flash_attn_with_kvcache")
        out, lse = _empty_results(q, return_lse, sinks)
        return (out, lse) if return_lse else out
    scalars = (causal, scale, window[0], window[1], cap, num_splits, return_lse, backend)
    family = None if key is None else _length_family(_family_base(key), tensors, scalars)
    out, lse = _run("kvcache_fwd", "flash_attn_with_kvcache", key, tensors, named,
                    lambda: ops.kvcache_fwd_impl(*tensors, *scalars), lambda: ops.kvcache_fwd(*tensors, *scalars),
                    family and family[0], probe)
    return (out, lse) if return_lse else out


def _family_base(key):
    """A cache call's key without the caches' lengths and strides (what calls over contiguous
    caches of other lengths share), or None for a key without two rank-4 caches."""
    name, key_scalars, types, window, tensor_layouts = key
    if any(layout is None or len(layout[0]) != 4 for layout in tensor_layouts[1:3]):
        return None  # bad input: validation names it
    caches = tuple((shape[0], shape[2:], *rest) for shape, _, *rest in tensor_layouts[1:3])
    return name, key_scalars, types, window, tensor_layouts[:1] + caches + tensor_layouts[3:]


def _rebound_length(key, probe, tensors, causal, softmax_scale, window_size, softcap, num_splits, return_lse,
                    backend):
    """The outputs of an eager cache call that no call of its own key recorded, served by a
    recorded call of its length family (``CallCache.rebound``); None when there is none (then
    the caller validates and takes the full path, which files the call under its family).

    A family exists only for a base key (:func:`_family_base`) that a fully validated call had,
    and validation depends on nothing else but the caches' lengths and strides; the checks that
    read those (``_checks.check_cache_extent``) run here, and an empty cache takes the full path."""
    base = _family_base(key)
    if base is None or not _EAGER_CALLS.has_family(base):
        return None
    q, k_cache, v_cache, *_, alibi_slopes, sinks, _, _ = tensors
    _checks.check_cache_extent(k_cache, v_cache)
    if k_cache.shape[1] == 0:
        return None
    batch, _, num_heads, head_dim = q.shape
    window, cap = _checks.check_variant(q, batch, num_heads, window_size, softcap, alibi_slopes, sinks)
    scalars = (causal, _checks.resolve_softmax_scale(softmax_scale, head_dim), window[0], window[1], cap, num_splits,
               return_lse, backend)
    family = _length_family(base, tensors, scalars)
    if family is None:
        return None
    return _EAGER_CALLS.rebound(key, family[0], tensors, lambda replay: decode.rebind_lengths(replay, family[1]),
                                probe)


def _length_family(base, tensors, scalars):
    """``((base, detail), length arguments)`` of a validated eager cache call whose launches a
    recorded call over another length of contiguous cache can make (``dispatch.
    decode_length_family``), or None. ``base`` is the call's :func:`_family_base`; ``detail`` the
    decode launch it plans and how Triton specializes its length arguments: calls of one family
    differ in nothing else that reaches a launch."""
    if base is None:
        return None
    q, k_cache, v_cache, k, _, _, block_table, _, alibi_slopes, sinks, k_scale, _ = tensors
    causal, _, window_left, window_right, cap, num_splits, _, backend = scalars
    found = dispatch.decode_length_family(q, k_cache, v_cache, k, block_table, k_scale, causal=causal,
                                          window_size=(window_left, window_right), softcap=cap,
                                          alibi_slopes=alibi_slopes, sinks=sinks, num_splits=num_splits,
                                          backend=backend, plans=_EAGER_CALLS.notes, base=base)
    if found is None:
        return None
    launch, lengths = found
    # The window bounds are not specialized on (the decode kernel's do_not_specialize).
    return (base, (launch, runtime_key(lengths[:3]))), lengths


AMAX_CHUNK_ELEMENTS = 2**26  # |x| is taken a chunk at a time: no cache-sized temporary


def _static_scale(x: torch.Tensor, granularity: str, dtype: torch.dtype) -> torch.Tensor:
    """``max |x| / reference.QUANT_MAX`` over the whole cache ``[N, S, Hkv, D]`` (``[1]``) or per KV head
    (``[Hkv]``), float32 on x's device (no host sync); 1 where the cache is all zeros."""
    if x.numel() == 0:
        return torch.ones(1 if granularity == "tensor" else x.shape[2], dtype=torch.float32, device=x.device)
    rows = max(1, AMAX_CHUNK_ELEMENTS // x[0].numel())
    parts = [x[i:i + rows].abs().amax(dim=(0, 1, 3)) for i in range(0, x.shape[0], rows)]
    largest = torch.stack(parts).amax(dim=0).float()
    if granularity == "tensor":
        largest = largest.amax().reshape(1)
    scale = (largest.double() / reference.QUANT_MAX[dtype]).float()  # correctly rounded (CUDA's x / 448 is x * (1 / 448))
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _given_scale(scale, size: int, device) -> torch.Tensor:
    """A caller's static scale (a float, or a float32 tensor of ``size`` elements) as a new
    float32 ``[size]`` tensor on ``device``."""
    if isinstance(scale, torch.Tensor):
        return scale.reshape(-1).clone()
    return torch.full((size,), float(scale), dtype=torch.float32, device=device)


def quantize_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensor",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
):
    """Quantize an existing KV cache (e.g. a prefilled prompt's) for :func:`flash_attn_with_kvcache`.

    Args:
        k_cache, v_cache: ``[batch, max_seqlen, num_kv_heads, head_dim]`` or ``[num_blocks,
            page_size, num_kv_heads, head_dim]``, float16, bfloat16 or float32 (the layout does
            not matter: every slot is converted, through the decode path's append kernel).
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.int8``.
        granularity: ``"tensor"`` (default; one scale each for K and V), ``"head"`` (one per KV
            head) or ``"token"`` (one per slot and KV head, from the slot's own values).
        k_scale, v_scale: static scales to use (``"tensor"``: float32 ``[1]``, ``"head"``:
            ``[num_kv_heads]``, or a float for every head), e.g. calibrated ones; by default
            ``max |x| / 448`` (int8: ``/ 127``) over the cache (per head with ``"head"``), so
            nothing saturates; each independently (given ``k_scale`` alone, ``v_scale`` is still
            computed). Computed on the device, without a host sync; non-finite values in unused
            slots would reach them, so zero those slots (``KVCache`` keeps its pool zeroed) or pass
            the scales.

    Quantization is the append kernel's (``flash_attn_with_kvcache``'s ``k_scale`` argument):
    ``x / s`` in float32, saturated, rounded to nearest even.

    Returns:
        ``(k_quantized, v_quantized, k_scale, v_scale)``: the caches in ``dtype`` (same shape,
        contiguous) and float32 scales of the granularity's shape (``[1]``, ``[num_kv_heads]``
        or the cache's leading dims), ready for ``flash_attn_with_kvcache(..., k_scale=,
        v_scale=)``. The inputs are not modified.

    Example::

        >>> k8, v8, ks, vs = quantize_kv(k_cache, v_cache, dtype=torch.float8_e4m3fn, granularity="head")
        >>> out = flash_attn_with_kvcache(q, k8, v8, k=k, v=v, cache_seqlens=lengths, k_scale=ks, v_scale=vs)
    """
    _checks.check_quantize_inputs(k_cache, v_cache, dtype, granularity, k_scale, v_scale, kernels_interpreted())
    batch, seqlen, num_kv_heads, _ = k_cache.shape
    device = k_cache.device
    k_quantized = torch.empty(k_cache.shape, dtype=dtype, device=device)
    v_quantized = torch.empty_like(k_quantized)
    if granularity == "token":
        k_scale = torch.empty(k_cache.shape[:3], dtype=torch.float32, device=device)
        v_scale = torch.empty_like(k_scale)
    else:
        k_scale, v_scale = (_static_scale(x, granularity, dtype) if scale is None
                            else _given_scale(scale, 1 if granularity == "tensor" else num_kv_heads, device)
                            for x, scale in ((k_cache, k_scale), (v_cache, v_scale)))
    if k_cache.numel():
        # Every slot is a "new token" of a contiguous cache whose lengths are all 0.
        starts = torch.zeros(batch, dtype=torch.int32, device=device)
        with ops.on_device(k_cache):
            decode.append_kv(k_cache, v_cache, k_quantized, v_quantized, starts, None, k_scale, v_scale)
    return k_quantized, v_quantized, k_scale, v_scale
