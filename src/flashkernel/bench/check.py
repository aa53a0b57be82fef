"""``flashkernel check``: every public function against the float64 reference, on awkward shapes.

Each case prints its max error, PyTorch's own max error in the same dtype
(``reference.attention(..., upcast=False)``), their ratio, the LSE error and pass / fail under
the rule of :mod:`flashkernel.bench.accuracy`. Cases: a fixed list of awkward shapes (lengths
that are not tile multiples, ``seqlen_q != seqlen_k`` both ways, rows that see no key, GQA / MQA,
odd head dims, fp32, a custom scale) plus seeded random ones; packed sequences
(``flash_attn_varlen_func``, empty ones included); and the variants (sliding window, softcap,
ALiBi, sinks, and all four at once) in ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``; quantized caches (float8_e4m3fn, int8) in ``flash_attn_with_kvcache``
against float64 attention over their dequantized values, and ``quantize_kv`` against the
quantization spec of ``reference`` (bit for bit).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from .. import reference
from . import accuracy
from .results import format_table

LSE_RELATIVE_TOL = 5e-5
VARIANTS = ("window", "softcap", "alibi", "sinks")
ALL_VARIANTS = "+".join(VARIANTS)


def variant_kwargs(variant: str, num_heads: int, device: str) -> dict:
    """Keyword arguments of the variants named in ``variant`` (``"window+sinks"``; ``""`` for
    none), with fresh random sinks."""
    kwargs = {}
    for name in filter(None, variant.split("+")):
        if name == "window":
            kwargs["window_size"] = (13, 4)  # causal calls use (13, 0)
        elif name == "softcap":
            kwargs["softcap"] = 2.5  # small enough to bend N(0, 1)-sized scores
        elif name == "alibi":  # the ALiBi paper's geometric slopes 2^(-8 h / H)
            exponents = torch.arange(1, num_heads + 1, dtype=torch.float32) * (-8.0 / num_heads)
            kwargs["alibi_slopes"] = torch.pow(2.0, exponents).to(device)
        elif name == "sinks":
            kwargs["sinks"] = 2 * torch.randn(num_heads, dtype=torch.float32, device=device)
        else:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    return kwargs


def _variant_label(variant: str) -> str:
    return f" {variant}" if variant else ""


@dataclasses.dataclass(frozen=True)
class DenseCase:
    """``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    softmax_scale: float | None = None
    variant: str = ""

    def label(self) -> str:
        scale = f" scale={self.softmax_scale}" if self.softmax_scale is not None else ""
        return (f"{self.dtype} b={self.batch} sq={self.seqlen_q} sk={self.seqlen_k} h={self.heads}/{self.kv_heads} "
                f"d={self.head_dim} {'causal' if self.causal else 'full'}{scale}{_variant_label(self.variant)}")


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """Packed sequences: sequence ``b`` has ``seqlens_q[b]`` queries and ``seqlens_k[b]`` keys."""

    seqlens_q: tuple
    seqlens_k: tuple
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    variant: str = ""

    def label(self) -> str:
        return (f"{self.dtype} sq={list(self.seqlens_q)} sk={list(self.seqlens_k)} h={self.heads}/{self.kv_heads} "
                f"d={self.head_dim} {'causal' if self.causal else 'full'}{_variant_label(self.variant)}")


@dataclasses.dataclass(frozen=True)
class KVCacheCase:
    """A KV cache of ``capacity`` slots per sequence holding ``cache_seqlens[b]`` tokens; with
    ``append`` the ``seqlen_q`` new tokens' keys/values are passed as ``k=``/``v=`` and written
    into the cache first. ``page_size=0`` means a contiguous cache."""

    cache_seqlens: tuple
    capacity: int
    seqlen_q: int
    append: bool
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int = 0
    num_splits: int = 0
    causal: bool = True
    variant: str = ""
    cache_dtype: str = ""  # "float8_e4m3fn" / "int8": a quantized cache with scales per ``granularity``
    granularity: str = "tensor"

    @property
    def batch(self) -> int:
        return len(self.cache_seqlens)

    def label(self) -> str:
        layout = f"paged{self.page_size}" if self.page_size else "contiguous"
        extra = " +append" if self.append else ""
        splits = f" splits={self.num_splits}" if self.num_splits else ""
        mask = "" if self.causal else " full"
        cache = f" {self.cache_dtype} per {self.granularity}" if self.cache_dtype else ""
        return (f"{self.dtype} lens={list(self.cache_seqlens)} sq={self.seqlen_q}{extra} "
                f"h={self.heads}/{self.kv_heads} d={self.head_dim} {layout}{cache}{splits}{mask}"
                f"{_variant_label(self.variant)}")


@dataclasses.dataclass(frozen=True)
class ServingCase:
    """A :class:`flashkernel.KVCache` filled with prompts, then ``steps`` decode steps that append."""

    prompt_lens: tuple
    steps: int
    page_size: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str

    def label(self) -> str:
        return (f"{self.dtype} prompts={list(self.prompt_lens)} pages{self.page_size} h={self.heads}/{self.kv_heads} "
                f"d={self.head_dim}")


@dataclasses.dataclass
class CheckRow:
    function: str
    case: str
    max_err: float | None = None
    torch_err: float | None = None
    ratio: float | None = None
    lse_err: float | None = None
    ok: bool = False
    note: str = ""


# --- case lists --------------------------------------------------------------------------------

CPU_DENSE = [
    DenseCase(1, 17, 17, 2, 1, 64, "float16", True),
    DenseCase(2, 5, 33, 4, 2, 72, "bfloat16", True),
    DenseCase(1, 33, 7, 2, 2, 40, "float16", True),
    DenseCase(1, 20, 20, 3, 1, 8, "float32", False),
    DenseCase(2, 31, 45, 2, 2, 128, "bfloat16", False),
    DenseCase(1, 1, 50, 4, 4, 256, "float16", True),
    DenseCase(1, 24, 24, 2, 2, 64, "float16", False, softmax_scale=0.5),
]
GPU_DENSE = [
    DenseCase(2, 1000, 1000, 8, 2, 128, "bfloat16", True),
    DenseCase(1, 4097, 4097, 4, 4, 64, "float16", True),
    DenseCase(3, 129, 2049, 6, 3, 96, "bfloat16", True),
    DenseCase(2, 2049, 129, 4, 1, 128, "float16", True),
    DenseCase(1, 777, 777, 2, 2, 256, "bfloat16", False),
    DenseCase(4, 1, 3001, 8, 1, 128, "bfloat16", True),
    DenseCase(2, 300, 500, 4, 4, 8, "float32", False),
    DenseCase(1, 512, 512, 4, 2, 64, "float16", True, softmax_scale=0.02),
]
CPU_KVCACHE = [
    KVCacheCase((5, 40, 23), 40, 1, False, 4, 2, 64, "float16"),
    KVCacheCase((5, 40, 23), 48, 1, False, 4, 2, 64, "bfloat16", page_size=16),
    KVCacheCase((0, 17, 30), 48, 2, True, 4, 1, 32, "bfloat16", page_size=16),
    KVCacheCase((0, 12), 16, 1, False, 2, 2, 64, "float16"),
    KVCacheCase((50, 61), 64, 3, False, 4, 2, 64, "float16", num_splits=3),
    KVCacheCase((9, 30), 40, 2, True, 2, 1, 40, "float32", page_size=8, causal=False),
]
GPU_KVCACHE = [
    KVCacheCase((1, 1000, 4097, 333), 4160, 1, False, 32, 8, 128, "bfloat16"),
    KVCacheCase((1, 1000, 4097, 333), 4160, 1, False, 32, 8, 128, "bfloat16", page_size=64),
    KVCacheCase((0, 129, 2000), 2048, 4, True, 16, 4, 64, "float16", page_size=64),
    KVCacheCase((0, 300), 320, 1, False, 8, 8, 128, "float16"),
    KVCacheCase((30000, 7), 30016, 1, True, 32, 8, 128, "bfloat16", page_size=256, num_splits=7),
    KVCacheCase((77, 5000), 5120, 3, True, 8, 2, 96, "float16", page_size=1, causal=False),
]
# Variant lists start with all four variants at once: the one case a quick check keeps.
CPU_DENSE_VARIANTS = [
    DenseCase(2, 40, 47, 4, 2, 64, "float16", True, variant=ALL_VARIANTS),
    DenseCase(1, 33, 33, 4, 2, 64, "float16", True, variant="window"),
    DenseCase(1, 20, 45, 2, 1, 40, "bfloat16", False, variant="window"),
    DenseCase(2, 17, 30, 4, 4, 64, "float16", False, variant="softcap"),
    DenseCase(1, 31, 17, 4, 2, 32, "float32", True, variant="alibi"),
    DenseCase(2, 25, 9, 4, 1, 64, "float16", True, variant="sinks"),
]
GPU_DENSE_VARIANTS = [
    DenseCase(2, 1000, 1000, 8, 2, 128, "bfloat16", True, variant=ALL_VARIANTS),
    DenseCase(1, 2049, 2049, 8, 2, 128, "bfloat16", True, variant="window"),
    DenseCase(2, 300, 777, 4, 1, 64, "float16", False, variant="window"),
    DenseCase(2, 513, 513, 8, 8, 256, "bfloat16", False, variant="softcap"),
    DenseCase(1, 1000, 333, 4, 2, 96, "float16", True, variant="alibi"),
    DenseCase(2, 700, 129, 8, 1, 128, "bfloat16", True, variant="sinks"),
]
CPU_VARLEN = [
    VarlenCase((5, 0, 33, 17), (5, 12, 40, 17), 4, 2, 64, "float16", True),
    VarlenCase((9, 31), (20, 1), 4, 1, 40, "bfloat16", False, variant=ALL_VARIANTS),
    VarlenCase((1, 20, 3), (30, 20, 0), 2, 2, 8, "float32", False),
    VarlenCase((17, 24), (33, 24), 4, 2, 64, "float16", True, variant="window"),
    VarlenCase((12, 5), (20, 19), 4, 4, 32, "float16", False, variant="softcap"),
    VarlenCase((7, 16), (30, 16), 4, 2, 64, "bfloat16", True, variant="alibi"),
    VarlenCase((40, 3), (2, 30), 4, 1, 64, "float16", True, variant="sinks"),
]
GPU_VARLEN = [
    VarlenCase((1, 1000, 0, 4097, 333), (1, 1000, 17, 4097, 2000), 32, 8, 128, "bfloat16", True),
    VarlenCase((300, 2049), (777, 1), 8, 2, 64, "float16", False, variant=ALL_VARIANTS),
    VarlenCase((1, 20, 3), (30, 20, 0), 4, 4, 8, "float32", False),
    VarlenCase((2048, 1000), (2048, 1000), 8, 2, 128, "bfloat16", True, variant="window"),
    VarlenCase((512, 65), (700, 65), 8, 8, 256, "bfloat16", False, variant="softcap"),
    VarlenCase((129, 1023), (1000, 1023), 8, 2, 96, "float16", True, variant="alibi"),
    VarlenCase((2000, 7), (100, 3000), 8, 1, 128, "bfloat16", True, variant="sinks"),
]
CPU_KVCACHE_VARIANTS = [
    KVCacheCase((0, 17, 30), 48, 2, True, 4, 1, 32, "float16", page_size=16, variant=ALL_VARIANTS),
    KVCacheCase((5, 40, 23), 48, 1, False, 4, 2, 64, "float16", variant="window", num_splits=3),
    KVCacheCase((9, 30), 40, 2, True, 4, 2, 64, "bfloat16", page_size=8, variant="softcap"),
    KVCacheCase((12, 3), 16, 3, True, 4, 4, 64, "float32", variant="alibi"),
    KVCacheCase((0, 25), 32, 1, False, 4, 2, 64, "float16", page_size=4, variant="sinks"),
]
GPU_KVCACHE_VARIANTS = [
    KVCacheCase((1, 1000, 4097, 333), 4160, 1, True, 32, 8, 128, "bfloat16", page_size=64, variant=ALL_VARIANTS),
    KVCacheCase((30000, 7), 30016, 1, False, 32, 8, 128, "bfloat16", page_size=256, variant="window"),
    KVCacheCase((0, 129, 2000), 2048, 4, True, 16, 4, 64, "float16", variant="softcap"),
    KVCacheCase((77, 5000), 5120, 3, True, 8, 2, 96, "float16", page_size=16, variant="alibi"),
    KVCacheCase((0, 300), 320, 1, False, 8, 8, 128, "bfloat16", variant="sinks", num_splits=4),
]
CPU_KVCACHE_QUANTIZED = [
    KVCacheCase((0, 17, 30), 48, 2, True, 4, 2, 32, "bfloat16", page_size=16, cache_dtype="float8_e4m3fn",
                granularity="token"),
    KVCacheCase((5, 40), 48, 1, True, 4, 1, 64, "float16", cache_dtype="int8", granularity="head", num_splits=2),
    KVCacheCase((9, 30), 40, 2, False, 4, 2, 32, "float16", page_size=8, cache_dtype="float8_e4m3fn",
                variant=ALL_VARIANTS),
]
GPU_KVCACHE_QUANTIZED = [
    KVCacheCase((1, 1000, 4097, 333), 4160, 1, True, 32, 8, 128, "bfloat16", page_size=16,
                cache_dtype="float8_e4m3fn", granularity="token"),
    KVCacheCase((30000, 7), 30016, 1, True, 32, 8, 128, "bfloat16", cache_dtype="float8_e4m3fn"),
    KVCacheCase((0, 129, 2000), 2048, 4, True, 16, 4, 64, "float16", page_size=64, cache_dtype="int8",
                granularity="head"),
    KVCacheCase((77, 5000), 5120, 3, True, 8, 2, 256, "bfloat16", page_size=1, cache_dtype="int8",
                granularity="token", causal=False, variant=ALL_VARIANTS),
]
QUANTIZE_CASES = [(fmt, granularity) for fmt in ("float8_e4m3fn", "int8") for granularity in ("tensor", "head", "token")]
CPU_SERVING = [ServingCase((5, 33, 17), 2, 8, 4, 2, 32, "float16")]
GPU_SERVING = [ServingCase((1000, 4097, 1), 3, 64, 32, 8, 128, "bfloat16")]
CPU_LENGTHS = (1, 5, 17, 31, 33, 47)
GPU_LENGTHS = (1, 7, 31, 63, 64, 65, 127, 129, 255, 257, 511, 1000, 1023, 2049)
HEAD_LAYOUTS = ((4, 4), (4, 2), (4, 1), (6, 3), (8, 1))


def random_dense_cases(count: int, seed: int, on_gpu: bool) -> list[DenseCase]:
    """Seeded random awkward shapes."""
    rng = random.Random(seed)
    lengths = GPU_LENGTHS if on_gpu else CPU_LENGTHS
    head_dims = tuple(range(8, 257, 8)) if on_gpu else (8, 24, 40, 64)
    cases = []
    for _ in range(count):
        heads, kv_heads = rng.choice(HEAD_LAYOUTS if on_gpu else HEAD_LAYOUTS[:3])
        dtype = rng.choice(("float16", "bfloat16", "bfloat16", "float16", "float32"))
        cases.append(DenseCase(rng.choice((1, 2, 3)), rng.choice(lengths), rng.choice(lengths), heads, kv_heads,
                               rng.choice(head_dims), dtype, rng.random() < 0.5))
    return cases


def dense_cases(on_gpu: bool, quick: bool, random_count: int, seed: int) -> list[DenseCase]:
    fixed = GPU_DENSE if on_gpu else CPU_DENSE
    if quick:
        return fixed[:4] + random_dense_cases(min(random_count, 2 if on_gpu else 0), seed, on_gpu)
    return fixed + random_dense_cases(random_count, seed, on_gpu)


def kvcache_cases(on_gpu: bool, quick: bool) -> list[KVCacheCase]:
    fixed = GPU_KVCACHE if on_gpu else CPU_KVCACHE
    variants = GPU_KVCACHE_VARIANTS if on_gpu else CPU_KVCACHE_VARIANTS
    quantized = GPU_KVCACHE_QUANTIZED if on_gpu else CPU_KVCACHE_QUANTIZED
    return fixed[:3] + variants[:1] + quantized[:1] if quick else fixed + variants + quantized


def dense_variant_cases(on_gpu: bool, quick: bool) -> list[DenseCase]:
    fixed = GPU_DENSE_VARIANTS if on_gpu else CPU_DENSE_VARIANTS
    return fixed[:1] if quick else fixed


def varlen_cases(on_gpu: bool, quick: bool) -> list[VarlenCase]:
    fixed = GPU_VARLEN if on_gpu else CPU_VARLEN
    return fixed[:2] if quick else fixed


# --- dense functions ---------------------------------------------------------------------------


def lse_error(lse, truth_lse) -> tuple[float, str]:
    """Max |lse - truth| over finite rows, and a problem note ('' when fine)."""
    if lse is None:
        return 0.0, "no lse returned"
    if tuple(lse.shape) != tuple(truth_lse.shape):
        return float("nan"), f"lse shape {tuple(lse.shape)}, expected {tuple(truth_lse.shape)}"
    if not torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(truth_lse.cpu())):
        return float("nan"), "rows with lse = -inf differ from the reference"
    finite = torch.isfinite(truth_lse)
    if not finite.any():
        return 0.0, ""
    err = (lse.double() - truth_lse)[finite].abs().max().item()
    bound = LSE_RELATIVE_TOL * max(1.0, truth_lse[finite].abs().max().item())
    return err, "" if err <= bound else f"lse error {err:.2e} > {bound:.2e}"


def _row_from(function: str, label: str, acc: accuracy.Accuracy, lse_err: float, note: str) -> CheckRow:
    problems = [note] if note else []
    if not acc.ok:
        problems.insert(0, "NaN in output" if acc.has_nan else f"max error over bound {acc.bound:.2e}")
    return CheckRow(function, label, acc.max_err, acc.torch_err, acc.ratio, lse_err, not problems, "; ".join(problems))


def whole_truth(exact: torch.Tensor, same_dtype: torch.Tensor) -> accuracy.Truth:
    """Truth on every row, from the reference's float64 and same-dtype outputs ``[B, Sq, H, D]``."""
    windows = [accuracy.Window(b, 0, exact.shape[1]) for b in range(exact.shape[0])]
    return accuracy.Truth(windows, [exact[b : b + 1] for b in range(exact.shape[0])],
                          [same_dtype[b : b + 1] for b in range(exact.shape[0])])


def check_dense(function: str, case: DenseCase, device: str) -> CheckRow:
    """One call of ``flashkernel.<function>(q, k, v, causal=, softmax_scale=, return_lse=True)``,
    with the case's variant keywords."""
    import flashkernel

    dtype = getattr(torch, case.dtype)
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.head_dim, dtype=dtype, device=device)
    k = torch.randn(case.batch, case.seqlen_k, case.kv_heads, case.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    variant = variant_kwargs(case.variant, case.heads, device)
    common = dict(causal=case.causal, softmax_scale=case.softmax_scale, **variant)
    fn = getattr(flashkernel, function)
    out, lse = fn(q, k, v, return_lse=True, **common)
    shape_problem = accuracy.wrong_shape(out, q.shape)
    if shape_problem:
        return CheckRow(function, case.label(), note=shape_problem)
    exact, truth_lse = reference.attention(q, k, v, **common)
    if variant:
        truth = whole_truth(exact, reference.attention(q, k, v, upcast=False, **common)[0])
    else:  # row windows, so that large GPU shapes stay cheap
        truth = accuracy.dense_truth(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale)
    acc = accuracy.compare(out, truth)
    lse_err, note = lse_error(lse, truth_lse)
    return _row_from(function, case.label(), acc, lse_err, note)


# --- flash_attn_varlen_func --------------------------------------------------------------------


def cumulative(lengths, device) -> torch.Tensor:
    """int32 ``[len(lengths) + 1]``: 0, then the running sums."""
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def check_varlen(case: VarlenCase, device: str) -> CheckRow:
    """``flash_attn_varlen_func`` on packed ``q [total_q, H, D]``, ``k, v [total_k, Hkv, D]``."""
    import flashkernel

    dtype = getattr(torch, case.dtype)
    q = torch.randn(sum(case.seqlens_q), case.heads, case.head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(case.seqlens_k), case.kv_heads, case.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    cu_q, cu_k = cumulative(case.seqlens_q, device), cumulative(case.seqlens_k, device)
    common = dict(causal=case.causal, **variant_kwargs(case.variant, case.heads, device))
    out, lse = flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(case.seqlens_q), max(case.seqlens_k),
                                                  return_lse=True, **common)
    shape_problem = accuracy.wrong_shape(out, q.shape)
    if shape_problem:
        return CheckRow("flash_attn_varlen_func", case.label(), note=shape_problem)
    exact, truth_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **common)
    same_dtype, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, upcast=False, **common)
    acc = accuracy.compare(out[None], whole_truth(exact[None], same_dtype[None]))
    lse_err, note = lse_error(lse, truth_lse)
    return _row_from("flash_attn_varlen_func", case.label(), acc, lse_err, note)


# --- flash_attn_with_kvcache -------------------------------------------------------------------


def _kvcache_inputs(case: KVCacheCase, device: str) -> dict:
    """Random cache (contiguous, or pages in a shuffled order), queries and new tokens."""
    dtype = getattr(torch, case.dtype)

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    batch, kv_heads, head_dim = case.batch, case.kv_heads, case.head_dim
    inputs = {"q": randn(batch, case.seqlen_q, case.heads, head_dim), "k": None, "v": None, "block_table": None,
              "cache_seqlens": torch.tensor(case.cache_seqlens, dtype=torch.int32, device=device)}
    if case.append:
        new_tokens = (batch, case.seqlen_q, kv_heads, head_dim)
        inputs.update(k=randn(*new_tokens), v=randn(*new_tokens))
    if case.page_size:
        blocks = -(-case.capacity // case.page_size)
        order = torch.randperm(batch * blocks, device=device).to(torch.int32)
        inputs["block_table"] = order.view(batch, blocks)
        shape = (batch * blocks, case.page_size, kv_heads, head_dim)
    else:
        shape = (batch, case.capacity, kv_heads, head_dim)
    inputs.update(k_cache=randn(*shape), v_cache=randn(*shape), k_scale=None, v_scale=None)
    if case.cache_dtype:
        for name in ("k", "v"):
            inputs[f"{name}_cache"], inputs[f"{name}_scale"] = quantized(inputs[f"{name}_cache"], case)
    return inputs


def quantized(cache: torch.Tensor, case: KVCacheCase) -> tuple[torch.Tensor, torch.Tensor]:
    """A float cache quantized by the spec (``reference``): ``(stored, scale)``; static scales
    from the cache's largest magnitude (per tensor or KV head)."""
    fmt = getattr(torch, case.cache_dtype)
    if case.granularity == "token":
        return reference.quantize_tokens(cache, fmt)
    largest = cache.float().abs().amax(dim=(0, 1, 3))
    scale = (largest.amax().reshape(1) if case.granularity == "tensor" else largest) / reference.QUANT_MAX[fmt]
    return reference.quantize(cache, reference.expand_scale(scale), fmt), scale


def _kvcache_reference(inputs: dict, case: KVCacheCase, variant: dict, upcast: bool):
    return reference.attention_with_kvcache(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["cache_seqlens"], k=inputs["k"], v=inputs["v"],
        block_table=inputs["block_table"], causal=case.causal, k_scale=inputs["k_scale"], v_scale=inputs["v_scale"],
        upcast=upcast, **variant,
    )


def per_sequence_truth(q, keys: list, values: list) -> accuracy.Truth:
    """Truth for ``q [B, Sq, H, D]`` where sequence b attends (bottom-right causal) to
    ``keys[b], values[b] [L_b, Hkv, D]``."""
    truth = accuracy.Truth([], [], [])
    for b, (k, v) in enumerate(zip(keys, values)):
        one = accuracy.dense_truth(q[b : b + 1], k[None], v[None], causal=True)
        truth.windows.append(accuracy.Window(b, 0, q.shape[1]))
        truth.truth += one.truth
        truth.torch_out += one.torch_out
    return truth


def _cache_update_note(before: dict, after: dict, case: KVCacheCase) -> str:
    """'' when the caches (and per-token scales) hold exactly the appended tokens and nothing else
    changed."""
    for name in ("k", "v"):
        expected, scale = before[f"{name}_cache"], before[f"{name}_scale"]
        if case.append and scale is not None:
            expected, scale = reference.append_to_quantized_cache(expected, scale, before[name], before["cache_seqlens"],
                                                                  before["block_table"])
        elif case.append:
            expected = reference.append_to_cache(expected, before[name], before["cache_seqlens"], before["block_table"])
        if not torch.equal(_bits(after[f"{name}_cache"]), _bits(expected)):
            return f"{name}_cache after the call differs from the expected append"
        if scale is not None and not torch.equal(after[f"{name}_scale"], scale):
            return f"{name}_scale after the call differs from the expected append"
    return ""


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A cache as comparable elements: a 1-byte cache as its bytes (float8 has no ``eq`` on every device)."""
    return x.view(torch.uint8) if x.element_size() == 1 else x


def check_kvcache(case: KVCacheCase, device: str) -> CheckRow:
    """``flash_attn_with_kvcache`` (contiguous or paged, with or without appended tokens)."""
    import flashkernel

    before = _kvcache_inputs(case, device)
    after = {**before, **{name: before[name].clone() for name in ("k_cache", "v_cache", "k_scale", "v_scale")
                          if before[name] is not None}}
    variant = variant_kwargs(case.variant, case.heads, device)
    out, lse = flashkernel.flash_attn_with_kvcache(
        after["q"], after["k_cache"], after["v_cache"], k=after["k"], v=after["v"],
        cache_seqlens=after["cache_seqlens"], block_table=after["block_table"], k_scale=after["k_scale"],
        v_scale=after["v_scale"], causal=case.causal, num_splits=case.num_splits, return_lse=True, **variant,
    )
    shape_problem = accuracy.wrong_shape(out, before["q"].shape)
    if shape_problem:
        return CheckRow("flash_attn_with_kvcache", case.label(), note=shape_problem)
    exact, truth_lse = _kvcache_reference(before, case, variant, upcast=True)
    same_dtype, _ = _kvcache_reference(before, case, variant, upcast=False)
    acc = accuracy.compare(out, whole_truth(exact, same_dtype))
    lse_err, note = lse_error(lse, truth_lse)
    note = "; ".join(n for n in (note, _cache_update_note(before, after, case)) if n)
    return _row_from("flash_attn_with_kvcache", case.label(), acc, lse_err, note)


def check_serving(case: ServingCase, device: str) -> list[CheckRow]:
    """Prompts appended with ``KVCache.append``, then decode steps through ``reserve`` /
    ``flash_attn_with_kvcache(k=, v=)`` / ``advance``; each step checked against the reference
    over the tokens the test itself remembers."""
    import flashkernel

    dtype = getattr(torch, case.dtype)
    batch, kv_heads, head_dim = len(case.prompt_lens), case.kv_heads, case.head_dim
    blocks_per_seq = -(-(max(case.prompt_lens) + case.steps) // case.page_size)
    cache = flashkernel.KVCache(num_blocks=batch * blocks_per_seq + 3, page_size=case.page_size, num_kv_heads=kv_heads,
                                head_dim=head_dim, batch=batch, max_blocks_per_seq=blocks_per_seq, dtype=dtype,
                                device=device, shuffle_pages=True)
    keys = [torch.randn(n, kv_heads, head_dim, dtype=dtype, device=device) for n in case.prompt_lens]
    values = [torch.randn_like(k) for k in keys]
    for seq, (k, v) in enumerate(zip(keys, values)):
        cache.append(seq, k, v)
    rows = []
    for step in range(case.steps):
        q = torch.randn(batch, 1, case.heads, head_dim, dtype=dtype, device=device)
        k_new = torch.randn(batch, 1, kv_heads, head_dim, dtype=dtype, device=device)
        v_new = torch.randn_like(k_new)
        cache.reserve(1)
        out = flashkernel.flash_attn_with_kvcache(q, cache.k_pages, cache.v_pages, k=k_new, v=v_new,
                                                  cache_seqlens=cache.cache_seqlens, block_table=cache.block_table)
        cache.advance(1)
        keys = [torch.cat([k, k_new[b]]) for b, k in enumerate(keys)]
        values = [torch.cat([v, v_new[b]]) for b, v in enumerate(values)]
        acc = accuracy.compare(out, per_sequence_truth(q, keys, values))
        rows.append(_row_from("KVCache", f"{case.label()} step {step + 1}", acc, None, ""))
    return rows


def check_quantize_kv(fmt: str, granularity: str, device: str) -> CheckRow:
    """``quantize_kv`` of a bf16 cache (a few channels 100x larger) against the spec, bit for bit:
    ``max err`` is the largest difference of the dequantized values (0 when right)."""
    import flashkernel

    case = KVCacheCase((), 0, 0, False, 0, 0, 0, "", cache_dtype=fmt, granularity=granularity)
    cache = torch.randn(3, 40, 2, 64, device=device)
    cache[..., ::16] *= 100
    cache = cache.to(torch.bfloat16)
    stored, _, scale, _ = flashkernel.quantize_kv(cache, cache, dtype=getattr(torch, fmt), granularity=granularity)
    want, want_scale = quantized(cache, case)
    err = (reference.dequantize(stored, scale) - reference.dequantize(want, want_scale)).abs().max().item()
    return CheckRow("quantize_kv", f"bfloat16 -> {fmt} per {granularity} [3, 40, 2, 64]", max_err=err, ok=err == 0,
                    note="" if err == 0 else "differs from reference.quantize")


# --- plans (one step planned once, run per layer) ------------------------------------------------


def check_decode_plan(case: KVCacheCase, device: str, layers: int = 3) -> CheckRow:
    """``DecodePlan`` made from the first layer's arguments, run for each of ``layers`` layers:
    against the reference, and equal bit for bit to ``flash_attn_with_kvcache``."""
    import flashkernel

    layer_inputs = [_kvcache_inputs(case, device) for _ in range(layers)]
    first = layer_inputs[0]
    fixed = dict(cache_seqlens=first["cache_seqlens"], block_table=first["block_table"], causal=case.causal,
                 num_splits=case.num_splits, return_lse=True)
    plan = flashkernel.DecodePlan(first["q"], first["k_cache"], first["v_cache"], k=first["k"], v=first["v"], **fixed)
    worst, problems = None, []
    for inputs in layer_inputs:
        inputs = {**inputs, "cache_seqlens": first["cache_seqlens"], "block_table": first["block_table"]}
        caches = (inputs["k_cache"].clone(), inputs["v_cache"].clone())
        out, lse = plan.run(inputs["q"], caches[0], caches[1], k=inputs["k"], v=inputs["v"])
        want, _ = flashkernel.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"].clone(), inputs["v_cache"].clone(),
                                                      k=inputs["k"], v=inputs["v"], **fixed)
        if not torch.equal(out, want):
            problems.append("differs from flash_attn_with_kvcache")
        exact, truth_lse = _kvcache_reference(inputs, case, {}, upcast=True)
        same_dtype, _ = _kvcache_reference(inputs, case, {}, upcast=False)
        acc = accuracy.compare(out, whole_truth(exact, same_dtype))
        worst = acc if worst is None or not acc.ok or (worst.ok and acc.max_err > worst.max_err) else worst
    return _row_from("DecodePlan", f"{case.label()} x{layers} layers", worst, None, "; ".join(sorted(set(problems))))


def check_varlen_plan(case: VarlenCase, device: str, layers: int = 3) -> CheckRow:
    """``VarlenPlan`` over ``layers`` layers: the reference, and bit-equal to the function."""
    import flashkernel

    dtype = getattr(torch, case.dtype)
    cu_q, cu_k = cumulative(case.seqlens_q, device), cumulative(case.seqlens_k, device)
    maxima = (max(case.seqlens_q), max(case.seqlens_k))

    def layer():
        q = torch.randn(sum(case.seqlens_q), case.heads, case.head_dim, dtype=dtype, device=device)
        k = torch.randn(sum(case.seqlens_k), case.kv_heads, case.head_dim, dtype=dtype, device=device)
        return q, k, torch.randn_like(k)

    layer_inputs = [layer() for _ in range(layers)]
    plan = flashkernel.VarlenPlan(*layer_inputs[0], cu_q, cu_k, *maxima, causal=case.causal)
    worst, problems = None, []
    for q, k, v in layer_inputs:
        out = plan.run(q, k, v)
        if not torch.equal(out, flashkernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, *maxima, causal=case.causal)):
            problems.append("differs from flash_attn_varlen_func")
        exact, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=case.causal)
        same_dtype, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=case.causal, upcast=False)
        acc = accuracy.compare(out[None], whole_truth(exact[None], same_dtype[None]))
        worst = acc if worst is None or not acc.ok or (worst.ok and acc.max_err > worst.max_err) else worst
    return _row_from("VarlenPlan", f"{case.label()} x{layers} layers", worst, None, "; ".join(sorted(set(problems))))


# --- the sweep ---------------------------------------------------------------------------------

DENSE_FUNCTIONS = ("flash_attn_func", "standard_attention")
NOT_CHECKED = {"reference"}  # the float64 truth everything else is checked against


def unchecked_public_names(device: str = "cpu") -> list[str]:
    """Public names of flashkernel that no planned check calls (reported, so that a new
    function is not forgotten)."""
    import flashkernel

    planned = {function for function, _, _ in planned_checks(device, quick=False, random_count=0, seed=0)}
    return [name for name in getattr(flashkernel, "__all__", []) if name not in planned | NOT_CHECKED]


def _guarded(function: str, label: str, run) -> list[CheckRow]:
    """The check's row(s); an exception becomes a failed row naming it."""
    try:
        result = run()
    except Exception as exc:
        return [CheckRow(function, label, note=f"raised {type(exc).__name__}: {str(exc)[:200]}")]
    return result if isinstance(result, list) else [result]


def planned_checks(device: str, quick: bool, random_count: int, seed: int) -> list[tuple[str, str, object]]:
    """``(function, case label, zero-argument check)`` for everything this build offers."""
    import flashkernel

    on_gpu = device == "cuda"
    plan = []
    for function in DENSE_FUNCTIONS:
        if hasattr(flashkernel, function):
            for case in dense_cases(on_gpu, quick, random_count, seed):
                plan.append((function, case.label(), lambda f=function, c=case: check_dense(f, c, device)))
    if hasattr(flashkernel, "flash_attn_func"):
        for case in dense_variant_cases(on_gpu, quick):
            plan.append(("flash_attn_func", case.label(), lambda c=case: check_dense("flash_attn_func", c, device)))
    if hasattr(flashkernel, "flash_attn_varlen_func"):
        for case in varlen_cases(on_gpu, quick):
            plan.append(("flash_attn_varlen_func", case.label(), lambda c=case: check_varlen(c, device)))
    if hasattr(flashkernel, "flash_attn_with_kvcache"):
        for case in kvcache_cases(on_gpu, quick):
            plan.append(("flash_attn_with_kvcache", case.label(), lambda c=case: check_kvcache(c, device)))
    if hasattr(flashkernel, "quantize_kv"):
        for fmt, granularity in QUANTIZE_CASES[:1] if quick else QUANTIZE_CASES:
            plan.append(("quantize_kv", f"{fmt} per {granularity}",
                         lambda f=fmt, g=granularity: check_quantize_kv(f, g, device)))
    if hasattr(flashkernel, "KVCache") and hasattr(flashkernel, "flash_attn_with_kvcache"):
        for case in GPU_SERVING if on_gpu else CPU_SERVING:
            plan.append(("KVCache", case.label(), lambda c=case: check_serving(c, device)))
    if hasattr(flashkernel, "DecodePlan"):
        case = next(c for c in kvcache_cases(on_gpu, quick) if not c.variant and not c.cache_dtype)
        plan.append(("DecodePlan", case.label(), lambda c=case: check_decode_plan(c, device)))
    if hasattr(flashkernel, "VarlenPlan"):
        case = next(c for c in varlen_cases(on_gpu, quick) if not c.variant)
        plan.append(("VarlenPlan", case.label(), lambda c=case: check_varlen_plan(c, device)))
    return plan


def run_checks(device: str, quick: bool = False, random_count: int = 4, seed: int = 0, progress=None) -> list[CheckRow]:
    rows = []
    for index, (function, label, run) in enumerate(planned_checks(device, quick, random_count, seed)):
        if progress:
            progress.show(f"{function} {label}")
        torch.manual_seed(seed * 100003 + index)
        rows.extend(_guarded(function, label, run))
        if progress:
            progress.step()
    return rows


def _fmt(value, spec: str = ".2e") -> str:
    return "-" if value is None else format(value, spec)


def check_table(rows: list[CheckRow]) -> str:
    body = [[r.function, r.case, _fmt(r.max_err), _fmt(r.torch_err), _fmt(r.ratio, ".2f"), _fmt(r.lse_err),
             "pass" if r.ok else "FAIL"] for r in rows]
    return format_table(["function", "case", "max err", "torch err", "ratio", "lse err", "result"], body,
                        text_columns=2)


def failure_lines(rows: list[CheckRow]) -> list[str]:
    return [f"FAIL {r.function} {r.case}: {r.note}" for r in rows if not r.ok]
