"""The registry of every provider: flashkernel's, PyTorch's SDPA backends, FlexAttention and
the other projects' (``external``), in the order runs and tables list them.

Imports point one way: ``providers`` (the shape and the probes) <- ``external``, ``flex`` <- here.
"""

from __future__ import annotations

from . import external, flex
from .providers import (
    Provider,
    build_baseline_decode,
    build_flashkernel_decode,
    build_flashkernel_paged_decode,
    build_flashkernel_prefill,
    build_flashkernel_triton_prefill,
    build_standard_decode,
    build_standard_prefill,
    needs_flashkernel,
    sdpa_providers,
)


def prefill_providers() -> list[Provider]:
    """Every prefill provider, flashkernel first."""
    return [
        Provider("flashkernel", "prefill", "flashkernel.flash_attn_func (fused kernel: Gluon at d64/d128/d256 "
                 "on Hopper, else Triton)", lambda _d: None, build_flashkernel_prefill),
        Provider("flashkernel-triton", "prefill", "flashkernel's Triton forward kernel alone",
                 lambda _d: None, build_flashkernel_triton_prefill),
        Provider("standard", "prefill", "flashkernel.standard_attention (3 kernels, N x N in memory)",
                 lambda _d: None, build_standard_prefill),
        *sdpa_providers("prefill"),
        flex.prefill_provider(),
        *external.prefill_providers(),
    ]


def decode_providers() -> list[Provider]:
    """Every decode provider, flashkernel first."""
    kvcache = needs_flashkernel("flash_attn_with_kvcache")
    return [
        Provider("flashkernel", "decode", "flashkernel.flash_attn_with_kvcache, contiguous cache",
                 kvcache, build_flashkernel_decode),
        Provider("flashkernel-paged", "decode", "flashkernel.flash_attn_with_kvcache, paged cache + block_table",
                 kvcache, build_flashkernel_paged_decode),
        Provider("flashkernel-baseline", "decode", "flashkernel's first decode kernel (a program per query head, "
                 "K/V read Hq/Hkv times), contiguous cache", lambda _d: None, build_baseline_decode),
        Provider("standard", "decode", "flashkernel.standard_attention (3 kernels) on the cache",
                 lambda _d: None, build_standard_decode),
        *sdpa_providers("decode"),
        flex.decode_provider(),
        *external.decode_providers(),
    ]


def providers_for(workload: str) -> list[Provider]:
    if workload == "prefill":
        return prefill_providers()
    if workload == "decode":
        return decode_providers()
    raise ValueError(f"unknown workload {workload!r}")


def all_provider_names() -> list[str]:
    """Names across both workloads, in registry order."""
    names = [p.name for p in prefill_providers()] + [p.name for p in decode_providers()]
    return list(dict.fromkeys(names))


def select(providers: list[Provider], names: list[str] | None, skip: list[str] | None = None) -> list[Provider]:
    """Providers named in ``names`` (all when None) minus ``skip``, keeping registry order."""
    chosen = [p for p in providers if names is None or p.name in names]
    return [p for p in chosen if not skip or p.name not in skip]
