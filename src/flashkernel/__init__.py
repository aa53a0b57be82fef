"""flashkernel: exact, IO-aware attention kernels for LLM inference, written in Triton.

Public functions are imported lazily so that ``import flashkernel`` stays cheap and so that
tools (the CLI, tests) can choose Triton's CPU interpreter before any kernel is built.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": "interface",
    "flash_attn_varlen_func": "interface",
    "standard_attention": "interface",
    "flash_attn_with_kvcache": "interface",
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
