"""flashkernel: exact, IO-aware attention kernels for LLM inference, written in Triton.

Tensors are ``[batch, seqlen, heads, head_dim]`` (float16, bfloat16 or float32) on a CUDA GPU,
or on the CPU under Triton's interpreter (set ``TRITON_INTERPRET=1`` before importing).

Public API:

    flash_attn_func          fused attention forward (prefill): causal, GQA / MQA, sliding
                             window, softcap, ALiBi, sinks; optional log-sum-exp
    flash_attn_varlen_func   the same over packed sequences (``cu_seqlens``), no padding
    flash_attn_with_kvcache  decode: append new k/v to a contiguous or paged KV cache, attend
                             (caches in q's dtype, or quantized: float8_e4m3fn / int8 with scales)
    quantize_kv              an existing cache converted to float8_e4m3fn / int8 with its scales
    KVCache                  a paged KV cache's bookkeeping (pages, block table, lengths)
    DecodePlan               one decode step planned once (lengths, pages, shapes), run per layer
    VarlenPlan               one packed batch planned once (cu_seqlens), run per layer
    standard_attention       the textbook three kernels (QK^T, softmax, PV), a baseline
    reference                float64 attention with every variant's semantics: the spec

Each is imported on first use, so ``import flashkernel`` stays cheap and tools (the CLI,
tests) can choose Triton's CPU interpreter before any kernel is built.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": "interface",
    "flash_attn_varlen_func": "interface",
    "standard_attention": "interface",
    "flash_attn_with_kvcache": "interface",
    "quantize_kv": "interface",
    "KVCache": "kvcache",
    "DecodePlan": "plans",
    "VarlenPlan": "plans",
    "reference": None,
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'flashkernel' has no attribute {name!r}")
    module_name = _LAZY[name]
    if module_name is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value  # later lookups skip this hook (it cost ~2 us per decode call)
    return value


def __dir__() -> list[str]:
    """The public API (not yet imported) along with what the module already holds."""
    return sorted(set(globals()) | set(_LAZY))
