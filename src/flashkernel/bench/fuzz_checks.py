"""The fuzzer's checks: inputs of one configuration, the float64 comparison, and one runner per
public entry point (``RUNNERS``, by family). ``fuzz.py`` draws and runs configurations; the
sanitizer workload (``benchmarks/tools/sanitize.py``) and the extreme-input tests reuse the
comparison (:func:`check_rows`, :func:`compare`).

The rule: an output passes when it has no NaN and its max error against float64 truth is at most
``accuracy.error_bound`` (2x PyTorch's own error in the same dtype, plus one epsilon of the
largest output, plus the float32 rounding of the scores), and its mean error likewise (as the
test suite checks it) over at least ``MEAN_CHECK_MIN_ROWS`` rows; an LSE when its ``-inf`` rows are the reference's and the others are
within 5e-5 relative. Long sequences are checked on a sample of query rows
(``reference.attention(rows=...)``: each sampled row against every key).
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from .. import reference
from . import accuracy
from .check import cumulative
from .fuzz_space import Config

LSE_RELATIVE_TOL = 5e-5
FULL_CHECK_SCORES = 2**22  # below this many scores (B x H x Sq x Sk) every query row is checked
SAMPLED_ROWS = 24  # query rows checked per sequence above it (plus the first, last and tile edges)
# The mean error is checked over at least this many (row, head) outputs. One row's D outputs share
# its softmax weights' error, so on a row or two the mean is that row's error (bounded by the max
# check) and 2x PyTorch's mean there is chance: a float32 packed sequence of one query row failed it
# at 4.7e-7 against 4.3e-7 (PyTorch's own error on that row was 10x below its typical one).
MEAN_CHECK_MIN_ROWS = 8
MAX_INPUT_STD = 1e4  # inputs stay far inside float16's range whatever the requested logits


# --- inputs --------------------------------------------------------------------------------------


class Inputs:
    """Random tensors for one configuration, from a generator seeded by ``(seed, index)``."""

    def __init__(self, config: Config, device: str):
        self.config = config
        self.device = device
        self.dtype = getattr(torch, config.cls.dtype)
        seed = random.Random(f"{config.seed}/{config.index}/inputs").getrandbits(62)
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *shape, std: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32) * std

    def fill_value(self) -> float:
        fill = self.config.values["fill"]
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf,
                "max": torch.finfo(self.dtype).max, "random": 3.0}[fill]

    def buffer(self, shape, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(view of shape, its buffer)`` in ``layout``; the buffer outside the view holds the fill.

        ``shape`` is ``[B, S, H, D]`` or ``[T, H, D]``; ``padded``: rows, heads and head dim
        padded around the view (16-byte aligned); ``transposed``: heads stored before the
        sequence; ``offset``: the view starts one element into its buffer (misaligned).
        """
        fill = self.fill_value()
        if layout == "padded":
            lead, (seq, heads, dim) = shape[:-3], shape[-3:]
            buf = torch.full((*lead, seq + 3, heads + 1, dim + 8), fill, dtype=self.dtype, device=self.device)
            view = buf[..., 1:seq + 1, 1:, :dim]
        elif layout == "transposed":
            lead, (seq, heads, dim) = shape[:-3], shape[-3:]
            buf = torch.full((*lead, heads, seq, dim), fill, dtype=self.dtype, device=self.device)
            view = buf.transpose(-3, -2)
        elif layout == "offset":
            numel = math.prod(shape)
            buf = torch.full((numel + 9,), fill, dtype=self.dtype, device=self.device)
            view = buf[1:numel + 1].view(shape)
        else:
            buf = torch.full(shape, fill, dtype=self.dtype, device=self.device)
            view = buf
        return view, buf

    def tensor(self, shape, layout: str = "contiguous", std: float = 1.0) -> torch.Tensor:
        """A random ``shape`` tensor (N(0, std^2)) in ``layout``."""
        view, _ = self.buffer(shape, layout)
        view.copy_(self.normal(*shape, std=std))
        return view

    def qk_std(self, head_dim: int, softmax_scale: float) -> float:
        """Standard deviation of q and k for scores of about ``logit_scale`` (1: N(0, 1)-sized)."""
        target = self.config.values["logit_scale"]
        if target == 1.0:
            return 1.0
        return min(MAX_INPUT_STD, math.sqrt(target / (softmax_scale * math.sqrt(head_dim))))

    def variant_kwargs(self, batch: int) -> dict:
        """The class's variants with this configuration's values."""
        cls, values = self.config.cls, self.config.values
        heads = cls.heads
        kwargs = {}
        if cls.window:
            kwargs["window_size"] = tuple(values["window"])
        if cls.softcap:
            kwargs["softcap"] = values["softcap"]
        if cls.alibi:
            shape = (heads,) if cls.alibi == "heads" else (batch, heads)
            kind = values["alibi_kind"]
            if kind == "geometric":
                slopes = torch.pow(2.0, -8.0 * torch.arange(1, heads + 1, device=self.device) / heads).expand(shape)
                slopes = slopes * (0.5 + torch.rand(shape, generator=self.gen, device=self.device))
            elif kind == "uniform":
                slopes = torch.rand(shape, generator=self.gen, device=self.device)
            else:
                slopes = torch.zeros(shape, device=self.device)
            kwargs["alibi_slopes"] = slopes.float().contiguous()
        if cls.sinks:
            kind = values["sink_kind"]
            sinks = self.normal(heads, std=2.0)
            if kind == "large":
                sinks = sinks * 5e3
            elif kind == "-inf":
                sinks = torch.full((heads,), -math.inf, device=self.device)
            elif kind == "mixed":
                sinks[::2] = -math.inf
            kwargs["sinks"] = sinks.to(torch.float32 if cls.sinks == "float32" else self.dtype)
        return kwargs


def _scale_of(config: Config) -> float:
    scale = config.values["softmax_scale"]
    return scale if scale is not None else 1.0 / math.sqrt(config.cls.head_dim)


# --- comparison ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """One configuration's result. ``err``/``bound``: max error vs float64 and its bound;
    ``problems``: what failed (empty: passed)."""

    err: float = 0.0
    torch_err: float = 0.0
    bound: float = 0.0
    lse_err: float = 0.0
    rows: int = 0  # query rows compared
    problems: list = dataclasses.field(default_factory=list)

    def fail(self, message: str) -> None:
        self.problems.append(message)

    def merge(self, other: Outcome) -> None:
        if other.err > self.err or (math.isnan(other.err) and not math.isnan(self.err)):
            self.err, self.torch_err, self.bound = other.err, other.torch_err, other.bound
        self.lse_err = max(self.lse_err, other.lse_err)
        self.rows += other.rows
        self.problems += other.problems


def same_dtype_result(run, truth: torch.Tensor) -> torch.Tensor:
    """PyTorch's own result in the input dtype (``run(upcast=False)``), the yardstick of the bound.

    Where its float16 ``q k^T`` overflows (scores beyond 65504 become inf, then NaN, where the
    float64 truth is finite) the yardstick is the same computation with float32 scores
    (``run(upcast=False, float32=True)``): what an attention with float32 softmax statistics,
    like this library's, is held to.
    """
    result = run(upcast=False)
    if torch.isfinite(result).all() or not torch.isfinite(truth).all():
        return result
    return run(upcast=False, float32=True)


def logit_bound(q, keys, softmax_scale) -> float:
    """``softmax_scale * max|q_i| * max|k_j|``, a bound on every score's magnitude before the
    variants (``accuracy.error_bound``); ``keys`` is a tensor or a list of them."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    keys = keys if isinstance(keys, (list, tuple)) else [keys]
    k_norm = max((k.double().norm(dim=-1).max().item() for k in keys if k.numel()), default=0.0)
    q_norm = q.double().norm(dim=-1).max().item() if q.numel() else 0.0
    return scale * q_norm * k_norm


def compare(out, lse, truth, truth_lse, torch_out, dtype, logits: float | None = None) -> Outcome:
    """Check ``out`` (and ``lse``, or None) against the float64 truth on the same rows; ``logits``
    bounds the scores' magnitude (:func:`logit_bound`)."""
    outcome = Outcome(rows=out.shape[0] * out.shape[1])
    if out.shape != truth.shape:
        outcome.fail(f"output shape {tuple(out.shape)}, expected {tuple(truth.shape)}")
        return outcome
    if out.numel() == 0:
        return outcome
    nan = torch.isnan(out)
    if nan.any():
        outcome.err = math.nan
        outcome.fail(f"NaN in {int(nan.sum())} of {out.numel()} output elements (first at "
                     f"{nan.nonzero()[0].tolist()})")
        return outcome
    err = (out.double() - truth).abs()
    torch_err = (torch_out.double() - truth).abs()
    truth_max = truth.abs().max().item()
    outcome.err, outcome.torch_err = err.max().item(), torch_err.max().item()
    outcome.bound = accuracy.error_bound(outcome.torch_err, truth_max, dtype, logits)
    if not outcome.err <= outcome.bound:
        worst = (err == err.max()).nonzero()[0].tolist()
        outcome.fail(f"max error {outcome.err:.3e} > bound {outcome.bound:.3e} (torch {outcome.torch_err:.3e}) at "
                     f"{worst}: {int((err > outcome.bound).sum())} elements over")
    floor = outcome.bound - accuracy.TRUTH_FACTOR * outcome.torch_err
    mean_bound = accuracy.TRUTH_FACTOR * torch_err.mean().item() + floor / 8
    if out.numel() // out.shape[-1] >= MEAN_CHECK_MIN_ROWS and not err.mean().item() <= mean_bound:
        outcome.fail(f"mean error {err.mean().item():.3e} > {mean_bound:.3e}")
    if lse is not None:
        _compare_lse(outcome, lse, truth_lse)
    return outcome


def _compare_lse(outcome: Outcome, lse, truth_lse) -> None:
    if lse.shape != truth_lse.shape or lse.dtype != torch.float32:
        outcome.fail(f"lse {lse.dtype} {tuple(lse.shape)}, expected float32 {tuple(truth_lse.shape)}")
        return
    if torch.isnan(lse).any():
        outcome.fail(f"NaN in {int(torch.isnan(lse).sum())} LSE elements")
        return
    if not torch.equal(torch.isneginf(lse), torch.isneginf(truth_lse)):
        outcome.fail("rows with LSE -inf differ from the reference")
        return
    finite = torch.isfinite(truth_lse)
    if finite.any():
        outcome.lse_err = (lse.double() - truth_lse)[finite].abs().max().item()
        bound = LSE_RELATIVE_TOL * max(1.0, truth_lse[finite].abs().max().item())
        if not outcome.lse_err <= bound:
            outcome.fail(f"LSE error {outcome.lse_err:.3e} > {bound:.3e}")


def sample_rows(gen: random.Random, seqlen_q: int, seqlen_k: int, heads: int) -> list[int] | None:
    """Query rows to check: all (None) when the scores are few, else the first, the last, the
    rows around tile edges and ``SAMPLED_ROWS`` random ones, sorted."""
    if heads * seqlen_q * max(seqlen_k, 1) <= FULL_CHECK_SCORES:
        return None
    rows = {0, seqlen_q - 1}
    for edge in (63, 64, 127, 128, 191, 192, 255, 256):
        if edge < seqlen_q:
            rows.add(edge)
    rows.update(gen.randrange(seqlen_q) for _ in range(SAMPLED_ROWS))
    return sorted(rows)


def _reference_runner(q, k, v, rows, **kwargs):
    """``run(upcast=..., float32=...)`` of ``reference.attention`` on these rows."""
    def run(upcast=True, float32=False):
        args = (q.float(), k.float(), v.float()) if float32 else (q, k, v)
        return reference.attention(*args, upcast=upcast, rows=rows, **kwargs)[0].to(
            torch.float64 if upcast else q.dtype)
    return run


def check_rows(out, lse, q, k, v, rows, **kwargs) -> Outcome:
    """``out [B, Sq, H, D]`` (and ``lse [B, H, Sq]``) on query ``rows`` (None: all) against the
    reference attention of ``q, k, v`` with ``kwargs``."""
    truth, truth_lse = reference.attention(q, k, v, rows=rows, **kwargs)
    torch_out = same_dtype_result(_reference_runner(q, k, v, rows, **kwargs), truth)
    if rows is not None:
        index = torch.as_tensor(rows, device=out.device)
        out, q = out[:, index], q[:, index]
        lse = lse[:, :, index] if lse is not None else None
    return compare(out, lse, truth, truth_lse, torch_out, q.dtype, logit_bound(q, k, kwargs.get("softmax_scale")))


# --- the families ----------------------------------------------------------------------------------


def _api():
    import flashkernel

    return flashkernel


def run_dense(config: Config, inputs: Inputs) -> Outcome:
    """``flash_attn_func`` (or ``standard_attention``) on ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``."""
    fk = _api()
    cls, values = config.cls, config.values
    batch, seqlen_q, seqlen_k = values["batch"], values["seqlen_q"], values["seqlen_k"]
    scale = _scale_of(config)
    std = inputs.qk_std(cls.head_dim, scale)
    q = inputs.tensor((batch, seqlen_q, cls.heads, cls.head_dim), cls.layout, std)
    k = inputs.tensor((batch, seqlen_k, cls.kv_heads, cls.head_dim), cls.layout, std)
    v = inputs.tensor((batch, seqlen_k, cls.kv_heads, cls.head_dim), cls.layout)
    common = dict(causal=cls.causal, softmax_scale=values["softmax_scale"])
    if cls.family == "standard":
        out, lse = fk.standard_attention(q, k, v, return_lse=True, **common)
        kwargs = {}
    else:
        kwargs = inputs.variant_kwargs(batch)
        result = fk.flash_attn_func(q, k, v, return_lse=cls.lse, backend=cls.backend, **common, **kwargs)
        out, lse = result if cls.lse else (result, None)
    outcome = Outcome()
    if torch.isnan(out).any():
        outcome.fail("NaN in the output")
    rows = sample_rows(random.Random(f"{config.seed}/{config.index}/rows"), seqlen_q, seqlen_k, batch * cls.heads)
    outcome.merge(check_rows(out, lse, q, k, v, rows, **common, **kwargs))
    return outcome


def _varlen_inputs(config: Config, inputs: Inputs):
    cls, values = config.cls, config.values
    total_q, total_k = sum(values["lengths_q"]), sum(values["lengths_k"])
    std = inputs.qk_std(cls.head_dim, _scale_of(config))
    q = inputs.tensor((total_q, cls.heads, cls.head_dim), cls.layout, std)
    k = inputs.tensor((total_k, cls.kv_heads, cls.head_dim), cls.layout, std)
    v = inputs.tensor((total_k, cls.kv_heads, cls.head_dim), cls.layout)
    return q, k, v


def _varlen_args(config: Config, inputs: Inputs) -> tuple:
    values = config.values
    cu_q = cumulative(values["lengths_q"], inputs.device)
    cu_k = cumulative(values["lengths_k"], inputs.device)
    extra = values["max_extra"]
    return cu_q, cu_k, max(values["lengths_q"]) + extra, max(values["lengths_k"]) + extra


def check_varlen(config: Config, out, lse, q, k, v, kwargs) -> Outcome:
    """Each sequence of a packed batch against the reference attention of its own rows."""
    values, cls = config.values, config.cls
    rng = random.Random(f"{config.seed}/{config.index}/rows")
    outcome = Outcome()
    if torch.isnan(out).any():
        outcome.fail("NaN in the output")
    q0 = k0 = 0
    slopes = kwargs.get("alibi_slopes")
    for b, (n_q, n_k) in enumerate(zip(values["lengths_q"], values["lengths_k"])):
        if n_q:
            one = dict(kwargs)
            if slopes is not None and slopes.dim() == 2:
                one["alibi_slopes"] = slopes[b]
            rows = sample_rows(rng, n_q, n_k, cls.heads)
            seq_lse = lse[None, :, q0:q0 + n_q] if lse is not None else None  # [1, H, n_q]
            if n_k == 0:
                outcome.merge(_no_key_rows(out[q0:q0 + n_q], seq_lse, one.get("sinks")))
            else:
                outcome.merge(check_rows(out[None, q0:q0 + n_q], seq_lse, q[None, q0:q0 + n_q],
                                         k[None, k0:k0 + n_k], v[None, k0:k0 + n_k], rows, causal=cls.causal,
                                         softmax_scale=values["softmax_scale"], **one))
        q0, k0 = q0 + n_q, k0 + n_k
    return outcome


def _no_key_rows(out, lse, sinks) -> Outcome:
    """Rows of a sequence with no key: output 0, LSE the sink (or -inf)."""
    outcome = Outcome(rows=out.shape[0])
    if not torch.equal(out, torch.zeros_like(out)):
        outcome.fail("a sequence with no key has a non-zero output")
    if lse is not None:
        expected = (sinks.double()[None, :, None].expand(lse.shape) if sinks is not None
                    else torch.full(lse.shape, -math.inf, dtype=torch.float64, device=lse.device))
        _compare_lse(outcome, lse, expected)
    return outcome


def run_varlen(config: Config, inputs: Inputs) -> Outcome:
    fk = _api()
    cls, values = config.cls, config.values
    q, k, v = _varlen_inputs(config, inputs)
    cu_q, cu_k, max_q, max_k = _varlen_args(config, inputs)
    kwargs = inputs.variant_kwargs(len(values["lengths_q"]))
    result = fk.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=cls.causal,
                                       softmax_scale=values["softmax_scale"], return_lse=cls.lse,
                                       validate=True if values["validate"] else None, backend=cls.backend, **kwargs)
    out, lse = result if cls.lse else (result, None)
    return check_varlen(config, out, lse, q, k, v, kwargs)


def run_varlen_plan(config: Config, inputs: Inputs, layers: int = 2) -> Outcome:
    """``VarlenPlan`` over ``layers`` layers: the reference, and bit-equal to the function."""
    fk = _api()
    cls, values = config.cls, config.values
    cu_q, cu_k, max_q, max_k = _varlen_args(config, inputs)
    kwargs = inputs.variant_kwargs(len(values["lengths_q"]))
    layer_inputs = [_varlen_inputs(config, inputs) for _ in range(layers)]
    common = dict(causal=cls.causal, softmax_scale=values["softmax_scale"], return_lse=True, **kwargs)
    plan = fk.VarlenPlan(*layer_inputs[0], cu_q, cu_k, max_q, max_k, **common)
    outcome = Outcome()
    for q, k, v in layer_inputs:
        out, lse = plan.run(q, k, v)
        want = fk.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **common)
        if not (_bits_equal(out, want[0]) and _bits_equal(lse, want[1])):
            outcome.fail("VarlenPlan.run differs from flash_attn_varlen_func")
        outcome.merge(check_varlen(config, out, lse, q, k, v, kwargs))
    return outcome


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


class CacheCase:
    """One decode call's inputs: caches (in buffers holding the fill around and past the data),
    lengths, block table, key starts, queries and new tokens."""

    def __init__(self, config: Config, inputs: Inputs):
        cls, values = config.cls, config.values
        self.cls, self.values, self.inputs = cls, values, inputs
        device = inputs.device
        batch, capacity, page = values["batch"], values["capacity"], cls.page_size
        appended = cls.seqlen_new if cls.append else 0
        self.seqlens = values["cache_seqlens"]
        self.starts = values.get("leftpad")
        std = inputs.qk_std(cls.head_dim, _scale_of(config))
        self.block_table = None
        if page:
            self.block_table = self._block_table(batch, capacity // page, values["pool"], appended)
            shape = (values["pool"], page, cls.kv_heads, cls.head_dim)
        else:
            shape = (batch, capacity, cls.kv_heads, cls.head_dim)
        self.k_cache, self.k_buf = inputs.buffer(shape, cls.layout)
        self.v_cache, self.v_buf = inputs.buffer(shape, cls.layout)
        self._fill_tokens(std)
        self.q = inputs.tensor((batch, cls.seqlen_new, cls.heads, cls.head_dim), cls.layout, std)
        self.k = self.v = None
        if cls.append:
            self.k = inputs.tensor((batch, cls.seqlen_new, cls.kv_heads, cls.head_dim), "contiguous", std)
            self.v = inputs.tensor((batch, cls.seqlen_new, cls.kv_heads, cls.head_dim), "contiguous")
        self.cache_seqlens = torch.tensor(self.seqlens, dtype=torch.int32, device=device)
        self.cache_leftpad = (torch.tensor(self.starts, dtype=torch.int32, device=device)
                              if self.starts is not None else None)

    def _block_table(self, batch, max_blocks, pool, appended) -> torch.Tensor:
        rng = random.Random(f"{self.inputs.config.seed}/{self.inputs.config.index}/pages")
        pages = list(range(pool))
        rng.shuffle(pages)
        table = []
        for b in range(batch):
            used = -(-(self.seqlens[b] + appended) // self.cls.page_size)
            row = [pages.pop() for _ in range(used)]
            filler = self.values["unused_entries"]
            row += [-1 if filler == "-1" else rng.randrange(pool) for _ in range(max_blocks - used)]
            table.append(row)
        return torch.tensor(table, dtype=torch.int32, device=self.inputs.device)

    def _fill_tokens(self, std: float) -> None:
        """Random keys and values at each sequence's positions ``[start, length)``; the rest of
        the buffers keeps the fill."""
        for b, length in enumerate(self.seqlens):
            start = self.starts[b] if self.starts is not None else 0
            if length <= start:
                continue
            positions = torch.arange(start, length, device=self.inputs.device)
            shape = (length - start, self.cls.kv_heads, self.cls.head_dim)
            for cache, scale in ((self.k_cache, std), (self.v_cache, 1.0)):
                values = self.inputs.normal(*shape, std=scale).to(cache.dtype)
                if self.block_table is None:
                    cache[b, start:length] = values
                else:
                    page = self.cls.page_size
                    blocks = self.block_table[b].long()[positions // page]
                    cache[blocks, positions % page] = values

    def call_kwargs(self, kwargs: dict, config: Config) -> dict:
        values = config.values
        return dict(cache_seqlens=self.cache_seqlens, block_table=self.block_table, cache_leftpad=self.cache_leftpad,
                    causal=self.cls.causal, softmax_scale=values["softmax_scale"], num_splits=self.cls.splits,
                    return_lse=self.cls.lse, validate=True if values["validate"] else None, backend=self.cls.backend,
                    **kwargs)

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buf.clone(), self.v_buf.clone()


def check_decode(case: CacheCase, config: Config, before, out, lse, kwargs) -> Outcome:
    """The output against the reference over the cache as it was before the call, and the cache
    buffers after it against the expected appends (nothing else may change)."""
    cls, values = config.cls, config.values
    k_buf, v_buf = before
    k_cache = k_buf.as_strided(case.k_cache.shape, case.k_cache.stride(),
                               case.k_cache.storage_offset() - case.k_buf.storage_offset())
    v_cache = v_buf.as_strided(case.v_cache.shape, case.v_cache.stride(),
                               case.v_cache.storage_offset() - case.v_buf.storage_offset())
    ref_kwargs = dict(k=case.k, v=case.v, block_table=case.block_table, cache_leftpad=case.cache_leftpad,
                      causal=cls.causal, softmax_scale=values["softmax_scale"], **kwargs)

    def run(upcast=True, float32=False):
        args = [case.q, k_cache, v_cache]
        extra = dict(ref_kwargs)
        if float32:
            args = [x.float() for x in args]
            if case.k is not None:
                extra.update(k=case.k.float(), v=case.v.float())
        result = reference.attention_with_kvcache(*args, case.cache_seqlens, upcast=upcast, **extra)[0]
        return result.to(torch.float64 if upcast else case.q.dtype)

    truth, truth_lse = reference.attention_with_kvcache(case.q, k_cache, v_cache, case.cache_seqlens, **ref_kwargs)
    starts = case.starts or [0] * len(case.seqlens)
    keys = [reference.cache_prefix(k_cache, b, n, case.block_table)[min(start, n):]
            for b, (n, start) in enumerate(zip(case.seqlens, starts))]
    if case.k is not None:
        keys.append(case.k)
    outcome = compare(out, lse, truth, truth_lse, same_dtype_result(run, truth), case.q.dtype,
                      logit_bound(case.q, keys, values["softmax_scale"]))
    for name, old, new, cache, view in (("k_cache", k_buf, case.k_buf, k_cache, case.k_cache),
                                        ("v_cache", v_buf, case.v_buf, v_cache, case.v_cache)):
        expected = old.clone()
        if case.k is not None:
            appended = reference.append_to_cache(cache, case.k if name == "k_cache" else case.v, case.cache_seqlens,
                                                 case.block_table)
            expected.as_strided(view.shape, view.stride(), view.storage_offset() - new.storage_offset()).copy_(
                appended)
        if not _bits_equal(new, expected):
            changed = int((new.view(torch.int16 if new.element_size() == 2 else torch.int32)
                           != expected.view(torch.int16 if new.element_size() == 2 else torch.int32)).sum())
            outcome.fail(f"{name}'s buffer after the call differs from the expected appends in {changed} elements")
    return outcome


def run_kvcache(config: Config, inputs: Inputs) -> Outcome:
    fk = _api()
    case = CacheCase(config, inputs)
    kwargs = inputs.variant_kwargs(config.values["batch"])
    before = case.snapshot()
    result = fk.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, k=case.k, v=case.v,
                                        **case.call_kwargs(kwargs, config))
    out, lse = result if config.cls.lse else (result, None)
    return check_decode(case, config, before, out, lse, kwargs)


def run_decode_plan(config: Config, inputs: Inputs, layers: int = 2) -> Outcome:
    """``DecodePlan`` made from layer 0's tensors, run per layer: the reference, and bit-equal to
    ``flash_attn_with_kvcache`` on copies of the same caches."""
    fk = _api()
    cases = [CacheCase(config, inputs) for _ in range(layers)]
    first = cases[0]
    # Every layer shares the lengths, block table and key starts the plan holds.
    for case in cases[1:]:
        case.cache_seqlens, case.block_table, case.cache_leftpad = (first.cache_seqlens, first.block_table,
                                                                    first.cache_leftpad)
    kwargs = inputs.variant_kwargs(config.values["batch"])
    call = first.call_kwargs(kwargs, config)
    plan = fk.DecodePlan(first.q, first.k_cache, first.v_cache, k=first.k, v=first.v, **call)
    outcome = Outcome()
    for case in cases:
        before = case.snapshot()
        k_copy, v_copy = (b.as_strided(c.shape, c.stride(), c.storage_offset() - buf.storage_offset())
                          for b, c, buf in ((before[0].clone(), case.k_cache, case.k_buf),
                                            (before[1].clone(), case.v_cache, case.v_buf)))
        result = plan.run(case.q, case.k_cache, case.v_cache, case.k, case.v)
        want = fk.flash_attn_with_kvcache(case.q, k_copy, v_copy, k=case.k, v=case.v, **call)
        out, lse = result if config.cls.lse else (result, None)
        want_out = want[0] if config.cls.lse else want
        if not _bits_equal(out, want_out) or (lse is not None and not _bits_equal(lse, want[1])):
            outcome.fail("DecodePlan.run differs from flash_attn_with_kvcache")
        outcome.merge(check_decode(case, config, before, out, lse, kwargs))
    return outcome


def run_serving(config: Config, inputs: Inputs) -> Outcome:
    """A ``KVCache`` filled with prompts (``append``), then decode steps through ``reserve`` /
    ``flash_attn_with_kvcache(k=, v=)`` / ``advance``, each against the reference over the
    tokens remembered here."""
    fk = _api()
    cls, values = config.cls, config.values
    batch, page, steps = values["batch"], cls.page_size, values["steps"]
    max_blocks = values["capacity"] // page
    cache = fk.KVCache(num_blocks=values["pool"], page_size=page, num_kv_heads=cls.kv_heads, head_dim=cls.head_dim,
                       batch=batch, max_blocks_per_seq=max_blocks, dtype=inputs.dtype, device=inputs.device,
                       shuffle_pages=True)
    std = inputs.qk_std(cls.head_dim, _scale_of(config))
    keys, vals = [], []
    for seq, length in enumerate(values["prompts"]):
        k = inputs.normal(length, cls.kv_heads, cls.head_dim, std=std).to(inputs.dtype)
        v = inputs.normal(length, cls.kv_heads, cls.head_dim).to(inputs.dtype)
        if length:
            cache.append(seq, k, v)
        keys.append(k)
        vals.append(v)
    outcome = Outcome()
    new = (batch, cls.seqlen_new, cls.kv_heads, cls.head_dim)
    for _ in range(steps):
        q = inputs.tensor((batch, cls.seqlen_new, cls.heads, cls.head_dim), std=std)
        k_new, v_new = inputs.tensor(new, std=std), inputs.tensor(new)
        cache.reserve(cls.seqlen_new)
        out = fk.flash_attn_with_kvcache(q, cache.k_pages, cache.v_pages, k=k_new, v=v_new,
                                         cache_seqlens=cache.cache_seqlens, block_table=cache.block_table,
                                         softmax_scale=values["softmax_scale"])
        cache.advance(cls.seqlen_new)
        for b in range(batch):
            keys[b] = torch.cat([keys[b], k_new[b]])
            vals[b] = torch.cat([vals[b], v_new[b]])
            outcome.merge(check_rows(out[b:b + 1], None, q[b:b + 1], keys[b][None], vals[b][None], None, causal=True,
                                     softmax_scale=values["softmax_scale"]))
    return outcome


RUNNERS = {"dense": run_dense, "standard": run_dense, "varlen": run_varlen, "varlen_plan": run_varlen_plan,
           "kvcache": run_kvcache, "decode_plan": run_decode_plan, "serving": run_serving}
