"""Providers from other projects, used only when importable: FlashAttention 2 / 3 / 4, FlashInfer.

Every one of them is listed in a run; when absent, its probe says why (not installed, no CUDA,
too old). Their outputs are checked against the float64 reference like flashkernel's, so an
API whose semantics differ (for example a top-left causal mask) shows up as wrong, not fast.
"""

from __future__ import annotations

import torch

from .providers import (
    DecodeInputs,
    Prepared,
    PrefillInputs,
    Provider,
    all_of,
    first_tensor,
    import_module,
    needs_cuda,
    needs_module,
)

FLASHINFER_WORKSPACE_BYTES = 256 * 2**20


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def fa2_version_reason(_device_type: str) -> str | None:
    """FlashAttention >= 2.1 aligns causal masks bottom-right, as flashkernel does."""
    module = import_module("flash_attn")
    version = getattr(module, "__version__", "0")
    if _version_tuple(version) < (2, 1):
        return f"flash_attn {version} aligns causal masks top-left; need >= 2.1"
    return None


def has_attribute(module_name: str, attribute: str):
    def probe(_device_type: str) -> str | None:
        if hasattr(import_module(module_name), attribute):
            return None
        return f"{module_name} has no {attribute}"

    return probe


# --- FlashAttention 2 / 3 / 4 ------------------------------------------------------------------

FA2_PROBE = all_of(needs_cuda, needs_module("flash_attn"), fa2_version_reason)
FA3_PROBE = all_of(needs_cuda, needs_module("flash_attn_interface"))
FA4_PROBE = all_of(needs_cuda, needs_module("flash_attn.cute"), has_attribute("flash_attn.cute", "flash_attn_func"))


def _dense_builder(module_name: str):
    """``module.flash_attn_func(q, k, v, causal=...)`` on the native ``[B, S, H, D]`` layout."""

    def build(inputs: PrefillInputs) -> Prepared:
        fn = import_module(module_name).flash_attn_func
        return Prepared(lambda: first_tensor(fn(inputs.q, inputs.k, inputs.v, causal=inputs.causal)))

    return build


def _kvcache_builder(module_name: str):
    """``module.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., causal=True)``."""

    def build(inputs: DecodeInputs) -> Prepared:
        fn = import_module(module_name).flash_attn_with_kvcache
        return Prepared(lambda: first_tensor(fn(inputs.q, inputs.k_cache, inputs.v_cache,
                                                cache_seqlens=inputs.cache_seqlens, causal=True)))

    return build


def _fa4_decode(inputs: DecodeInputs) -> Prepared:
    """FA4 has no KV-cache entry point: attention of the new token over the full cache."""
    fn = import_module("flash_attn.cute").flash_attn_func
    return Prepared(lambda: first_tensor(fn(inputs.q, inputs.k_cache, inputs.v_cache, causal=True)))


# --- FlashInfer --------------------------------------------------------------------------------

FLASHINFER_PROBE = all_of(needs_cuda, needs_module("flashinfer"))


_WORKSPACES: dict = {}


def _workspace(device) -> torch.Tensor:
    """One FlashInfer workspace per device, shared by every plan (inputs are rotated in copies)."""
    key = str(device)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]


def _flashinfer_prefill(inputs: PrefillInputs) -> Prepared:
    """Batch prefill on ragged (packed) q/k/v, ``[B * S, H, D]``, planned once."""
    flashinfer = import_module("flashinfer")
    q, k, v = inputs.q, inputs.k, inputs.v
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD")
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_k
    wrapper.plan(qo_indptr, kv_indptr, heads, kv_heads, head_dim, causal=inputs.causal, q_data_type=q.dtype)
    flat_q, flat_k, flat_v = (x.reshape(-1, x.shape[2], head_dim) for x in (q, k, v))
    return Prepared(lambda: wrapper.run(flat_q, flat_k, flat_v).view(batch, seqlen_q, heads, head_dim))


def _flashinfer_decode(inputs: DecodeInputs) -> Prepared:
    """Batch decode on the paged cache (NHD pages), planned once."""
    flashinfer = import_module("flashinfer")
    q, table, page = inputs.q, inputs.block_table, inputs.page_size
    batch, _, heads, head_dim = q.shape
    kv_heads = inputs.k_pages.shape[2]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(q.device), "NHD")
    blocks = table.shape[1]
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * blocks
    context = int(inputs.cache_seqlens[0])
    last_page_len = torch.full((batch,), context - (blocks - 1) * page, dtype=torch.int32, device=q.device)
    wrapper.plan(indptr, table.reshape(-1), last_page_len, heads, kv_heads, head_dim, page,
                 q_data_type=q.dtype, kv_data_type=inputs.k_pages.dtype)
    pages = (inputs.k_pages, inputs.v_pages)
    q_rows = q[:, 0]
    return Prepared(lambda: wrapper.run(q_rows, pages).unsqueeze(1))


def prefill_providers() -> list[Provider]:
    return [
        Provider("fa2", "prefill", "flash_attn.flash_attn_func (FlashAttention 2)", FA2_PROBE,
                 _dense_builder("flash_attn")),
        Provider("fa3", "prefill", "flash_attn_interface.flash_attn_func (FlashAttention 3)", FA3_PROBE,
                 _dense_builder("flash_attn_interface")),
        Provider("fa4", "prefill", "flash_attn.cute.flash_attn_func (FlashAttention 4)", FA4_PROBE,
                 _dense_builder("flash_attn.cute")),
        Provider("flashinfer", "prefill", "flashinfer BatchPrefillWithRaggedKVCacheWrapper", FLASHINFER_PROBE,
                 _flashinfer_prefill),
    ]


def decode_providers() -> list[Provider]:
    return [
        Provider("fa2", "decode", "flash_attn.flash_attn_with_kvcache (FlashAttention 2)", FA2_PROBE,
                 _kvcache_builder("flash_attn")),
        Provider("fa3", "decode", "flash_attn_interface.flash_attn_with_kvcache (FlashAttention 3)", FA3_PROBE,
                 _kvcache_builder("flash_attn_interface")),
        Provider("fa4", "decode", "flash_attn.cute.flash_attn_func over the whole cache (FlashAttention 4)",
                 FA4_PROBE, _fa4_decode),
        Provider("flashinfer", "decode", "flashinfer BatchDecodeWithPagedKVCacheWrapper (paged)", FLASHINFER_PROBE,
                 _flashinfer_decode),
    ]
