"""Benchmark cases and the default sweeps.

* prefill: FlashAttention's benchmark shapes. 16k tokens per batch (``batch = tokens // seqlen``),
  model dim 2048 (``heads = model_dim // head_dim``, MHA), seqlen 512..16k, head dim 64/128/256,
  causal and not, bf16.
* decode: a 7B-class model's attention. 32 query heads, 8 KV heads, head dim 128, bf16, one new
  token per sequence, batch 1/8/64 x context 1k/4k/32k/128k with ``batch * context <= 2M``.

Without CUDA the sweeps shrink to shapes Triton's CPU interpreter finishes in seconds.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

PREFILL_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
PREFILL_HEAD_DIMS = (64, 128, 256)
PREFILL_TOKENS = 16384
MODEL_DIM = 2048

DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (1024, 4096, 32768, 131072)
DECODE_MAX_TOKENS = 2 * 1024 * 1024
DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM = 32, 8, 128
DECODE_PAGE_SIZE = 256


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    """Dense attention ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    dtype: str = "bfloat16"
    workload = "prefill"

    def label(self) -> str:
        lengths = f"s={self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"sq={self.seqlen_q} sk={self.seqlen_k}"
        heads = f"h={self.heads}" if self.heads == self.kv_heads else f"h={self.heads}/{self.kv_heads}"
        mask = "causal" if self.causal else "full"
        return f"{self.dtype} d={self.head_dim} {mask} b={self.batch} {heads} {lengths}"


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode step: ``q [B, Sq, H, D]`` against a KV cache holding ``context`` tokens per sequence."""

    batch: int
    context: int
    heads: int = DECODE_HEADS
    kv_heads: int = DECODE_KV_HEADS
    head_dim: int = DECODE_HEAD_DIM
    dtype: str = "bfloat16"
    seqlen_q: int = 1
    page_size: int = DECODE_PAGE_SIZE
    workload = "decode"

    def label(self) -> str:
        return (f"{self.dtype} d={self.head_dim} h={self.heads}/{self.kv_heads} "
                f"b={self.batch} ctx={self.context}")


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What the command line asked for; ``None`` means the workload's default."""

    quick: bool = False
    cpu: bool = False
    dtypes: Sequence[str] = ("bfloat16",)
    head_dims: Sequence[int] | None = None
    heads: int | None = None
    kv_heads: int | None = None
    batches: Sequence[int] | None = None
    seqlens: Sequence[int] | None = None
    seqlen_k: int | None = None
    causal: str = "both"  # "both", "yes", "no"
    tokens: int | None = None
    model_dim: int | None = None
    contexts: Sequence[int] | None = None
    max_tokens: int = DECODE_MAX_TOKENS
    page_size: int | None = None


def _causal_flags(choice: str) -> tuple[bool, ...]:
    return {"both": (False, True), "yes": (True,), "no": (False,)}[choice]


def _prefill_defaults(spec: SweepSpec) -> dict:
    """Seqlens, head dims, tokens per batch and model dim for the sweep's size class."""
    if spec.cpu:
        seqlens, head_dims = ((40,), (32,)) if spec.quick else ((40, 100), (32, 64))
        return {"seqlens": seqlens, "head_dims": head_dims, "tokens": 80, "model_dim": 64}
    if spec.quick:
        return {"seqlens": (1024, 4096), "head_dims": (128,), "tokens": PREFILL_TOKENS, "model_dim": MODEL_DIM}
    return {"seqlens": PREFILL_SEQLENS, "head_dims": PREFILL_HEAD_DIMS, "tokens": PREFILL_TOKENS,
            "model_dim": MODEL_DIM}


def prefill_cases(spec: SweepSpec) -> list[PrefillCase]:
    """The prefill sweep: dtype x head dim x mask x seqlen (x batch when batches are given)."""
    defaults = _prefill_defaults(spec)
    seqlens = spec.seqlens or defaults["seqlens"]
    head_dims = spec.head_dims or defaults["head_dims"]
    tokens = spec.tokens or defaults["tokens"]
    model_dim = spec.model_dim or defaults["model_dim"]
    cases = []
    grid = itertools.product(spec.dtypes, head_dims, _causal_flags(spec.causal), seqlens)
    for dtype, head_dim, causal, seqlen in grid:
        heads = spec.heads or max(1, model_dim // head_dim)
        kv_heads = spec.kv_heads or heads
        batches = spec.batches or (max(1, tokens // seqlen),)
        for batch in batches:
            cases.append(PrefillCase(batch, seqlen, spec.seqlen_k or seqlen, heads, kv_heads, head_dim, causal, dtype))
    return cases


def _decode_defaults(spec: SweepSpec) -> dict:
    if spec.cpu:
        contexts = (40,) if spec.quick else (40, 100)
        return {"batches": (2,), "contexts": contexts, "heads": 4, "kv_heads": 2, "head_dims": (32,), "page_size": 16}
    if spec.quick:
        return {"batches": (1, 8), "contexts": (4096, 32768), "heads": DECODE_HEADS, "kv_heads": DECODE_KV_HEADS,
                "head_dims": (DECODE_HEAD_DIM,), "page_size": DECODE_PAGE_SIZE}
    return {"batches": DECODE_BATCHES, "contexts": DECODE_CONTEXTS, "heads": DECODE_HEADS,
            "kv_heads": DECODE_KV_HEADS, "head_dims": (DECODE_HEAD_DIM,), "page_size": DECODE_PAGE_SIZE}


def decode_cases(spec: SweepSpec) -> list[DecodeCase]:
    """The decode sweep: dtype x head dim x batch x context, keeping ``batch * context <= max_tokens``."""
    defaults = _decode_defaults(spec)
    batches = spec.batches or defaults["batches"]
    contexts = spec.contexts or defaults["contexts"]
    head_dims = spec.head_dims or defaults["head_dims"]
    heads = spec.heads or defaults["heads"]
    kv_heads = spec.kv_heads or defaults["kv_heads"]
    page_size = spec.page_size or defaults["page_size"]
    cases = []
    for dtype, head_dim, batch, context in itertools.product(spec.dtypes, head_dims, batches, contexts):
        if batch * context <= spec.max_tokens:
            cases.append(DecodeCase(batch, context, heads, kv_heads, head_dim, dtype, page_size=page_size))
    return cases


def cases_for(workload: str, spec: SweepSpec) -> list:
    """Cases of ``workload`` ("prefill" or "decode")."""
    if workload == "prefill":
        return prefill_cases(spec)
    if workload == "decode":
        return decode_cases(spec)
    raise ValueError(f"unknown workload {workload!r}; expected 'prefill' or 'decode'")


def case_fields(case) -> dict:
    """The case as a flat dict (for result rows)."""
    fields = dataclasses.asdict(case)
    fields["workload"] = case.workload
    return fields

