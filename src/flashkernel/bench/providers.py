"""One ``Provider`` shape for everything that computes attention, the probes, and the builders of
flashkernel's and PyTorch SDPA's providers (the full list is in ``registry``).

A provider has a name, a one-line summary of what it calls, a ``probe`` that says why it cannot
run here (or ``None`` when it can), and a ``build`` that turns benchmark inputs into a
:class:`Prepared` call. ``build`` does everything that must not be timed: layout changes,
planning, ``torch.compile``. The call returns the output as ``[B, Sq, H, D]`` (a view is fine)
so every provider is checked against the same reference.

Inputs (see ``runner.make_inputs``):

* prefill: :class:`PrefillInputs` ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]``.
* decode: :class:`DecodeInputs` ``q [B, Sq, H, D]``, a contiguous cache ``k_cache, v_cache
  [B, L, Hkv, D]`` full to ``cache_seqlens [B]`` (int32), and the same cache paged:
  ``k_pages, v_pages [num_blocks, page_size, Hkv, D]`` with ``block_table [B, L / page_size]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable, ContextManager

import torch


@dataclasses.dataclass
class PrefillInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool


@dataclasses.dataclass
class DecodeInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    block_table: torch.Tensor
    page_size: int


@dataclasses.dataclass
class Prepared:
    """A ready call returning ``[B, Sq, H, D]``; ``context`` is entered around all its timing."""

    call: Callable[[], torch.Tensor]
    context: Callable[[], ContextManager] = contextlib.nullcontext


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    workload: str  # "prefill" or "decode"
    summary: str
    probe: Callable[[str], str | None]  # device type ("cuda" / "cpu") -> reason it cannot run
    build: Callable[[object], Prepared]


@dataclasses.dataclass(frozen=True)
class Availability:
    name: str
    available: bool
    reason: str
    summary: str


def availability(provider: Provider, device_type: str) -> Availability:
    """Whether ``provider`` can run on ``device_type``, and why not."""
    try:
        reason = provider.probe(device_type)
    except Exception as exc:  # a probe must never take the whole benchmark down
        reason = f"probe failed: {type(exc).__name__}: {exc}"
    return Availability(provider.name, reason is None, reason or "", provider.summary)


# --- probes ------------------------------------------------------------------------------------


def import_module(name: str):
    """``importlib.import_module``; a seam for tests."""
    return importlib.import_module(name)


def import_reason(module_name: str) -> str | None:
    """None when ``module_name`` imports, else a short reason (not installed / import failed)."""
    try:
        import_module(module_name)
    except ModuleNotFoundError as exc:
        return f"not installed ({exc})"
    except Exception as exc:  # broken installs raise anything: OSError, RuntimeError, ...
        return f"import of {module_name} failed: {type(exc).__name__}: {str(exc)[:160]}"
    return None


def all_of(*probes: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """A probe that reports the first reason among ``probes``."""

    def probe(device_type: str) -> str | None:
        for check in probes:
            reason = check(device_type)
            if reason:
                return reason
        return None

    return probe


def needs_cuda(device_type: str) -> str | None:
    return None if device_type == "cuda" else "needs a CUDA GPU"


def needs_module(module_name: str) -> Callable[[str], str | None]:
    return lambda _device_type: import_reason(module_name)


def needs_flashkernel(function_name: str) -> Callable[[str], str | None]:
    def probe(_device_type: str) -> str | None:
        import flashkernel

        if hasattr(flashkernel, function_name):
            return None
        return f"flashkernel.{function_name} is not in this build"

    return probe


def first_tensor(result) -> torch.Tensor:
    """The output of APIs that return ``out`` or ``(out, lse, ...)`` depending on version."""
    return result[0] if isinstance(result, (tuple, list)) else result


# --- flashkernel -------------------------------------------------------------------------------


def build_flashkernel_prefill(inputs: PrefillInputs) -> Prepared:
    import flashkernel

    fn = flashkernel.flash_attn_func
    return Prepared(lambda: fn(inputs.q, inputs.k, inputs.v, causal=inputs.causal))


def build_flashkernel_triton_prefill(inputs: PrefillInputs) -> Prepared:
    """flashkernel's Triton forward kernel alone (``flash_attn_func`` takes the Gluon kernel at
    head dims 64/128/256 on Hopper): the two measured side by side."""
    from flashkernel.kernels import prefill

    q, k, v = inputs.q, inputs.k, inputs.v
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5

    def run():
        prefill.attention_forward(q, k, v, out, None, causal=inputs.causal, softmax_scale=scale,
                                  backend="triton")
        return out
    return Prepared(run)


def build_standard_prefill(inputs: PrefillInputs) -> Prepared:
    import flashkernel

    fn = flashkernel.standard_attention
    return Prepared(lambda: fn(inputs.q, inputs.k, inputs.v, causal=inputs.causal))


def build_flashkernel_decode(inputs: DecodeInputs) -> Prepared:
    import flashkernel

    fn = flashkernel.flash_attn_with_kvcache
    return Prepared(lambda: fn(inputs.q, inputs.k_cache, inputs.v_cache, cache_seqlens=inputs.cache_seqlens))


def build_flashkernel_paged_decode(inputs: DecodeInputs) -> Prepared:
    import flashkernel

    fn = flashkernel.flash_attn_with_kvcache
    return Prepared(lambda: fn(inputs.q, inputs.k_pages, inputs.v_pages, cache_seqlens=inputs.cache_seqlens,
                               block_table=inputs.block_table))


def build_baseline_decode(inputs: DecodeInputs) -> Prepared:
    """flashkernel's first decode kernel (one program per query head reading its KV head's
    whole context, so K/V are read ``Hq / Hkv`` times), on the contiguous cache."""
    from flashkernel.kernels import decode

    q = inputs.q
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5

    def run():
        decode.baseline_decode(q, inputs.k_cache, inputs.v_cache, inputs.cache_seqlens, None, out, None,
                               causal=True, softmax_scale=scale)
        return out
    return Prepared(run)


def build_standard_decode(inputs: DecodeInputs) -> Prepared:
    import flashkernel

    fn = flashkernel.standard_attention
    return Prepared(lambda: fn(inputs.q, inputs.k_cache, inputs.v_cache, causal=True))


# --- PyTorch SDPA with one backend forced ------------------------------------------------------

SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
SDPA_ON_CPU = {"FLASH_ATTENTION", "MATH"}  # PyTorch has CPU kernels for these two only


def sdpa_probe(backend_name: str) -> Callable[[str], str | None]:
    def probe(device_type: str) -> str | None:
        from torch.nn.attention import SDPBackend

        if not hasattr(SDPBackend, backend_name):
            return f"this PyTorch has no SDPBackend.{backend_name}"
        if device_type != "cuda" and backend_name not in SDPA_ON_CPU:
            return "needs a CUDA GPU"
        return None

    return probe


def sdpa_mask_args(seqlen_q: int, seqlen_k: int, causal: bool) -> dict:
    """SDPA's ``is_causal`` is top-left aligned; bottom-right with Sq != Sk needs a CausalBias."""
    if not causal or seqlen_q == 1:
        return {}  # one query row sees every key under the bottom-right mask
    if seqlen_q == seqlen_k:
        return {"is_causal": True}
    from torch.nn.attention.bias import causal_lower_right

    return {"attn_mask": causal_lower_right(seqlen_q, seqlen_k)}


def build_sdpa(backend_name: str, q, k, v, causal: bool) -> Prepared:
    """SDPA on ``[B, H, S, D]`` views of ``[B, S, H, D]`` tensors, the backend forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kwargs = sdpa_mask_args(q.shape[1], k.shape[1], causal)
    if q.shape[2] != k.shape[2]:
        kwargs["enable_gqa"] = True
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return Prepared(lambda: sdpa(qt, kt, vt, **kwargs).transpose(1, 2), context=lambda: sdpa_kernel(backend))


def sdpa_prefill_builder(backend_name: str) -> Callable[[PrefillInputs], Prepared]:
    return lambda inputs: build_sdpa(backend_name, inputs.q, inputs.k, inputs.v, inputs.causal)


def sdpa_decode_builder(backend_name: str) -> Callable[[DecodeInputs], Prepared]:
    return lambda inputs: build_sdpa(backend_name, inputs.q, inputs.k_cache, inputs.v_cache, True)


def sdpa_providers(workload: str) -> list[Provider]:
    """One provider per SDPA backend for ``workload`` ("prefill" or "decode")."""
    builder = sdpa_prefill_builder if workload == "prefill" else sdpa_decode_builder
    return [
        Provider(name, workload, f"torch SDPA, backend {backend} forced", sdpa_probe(backend), builder(backend))
        for name, backend in SDPA_BACKENDS.items()
    ]
