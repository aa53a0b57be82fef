"""FlexAttention under ``torch.compile``, with proof that every shape really compiled.

A call of ``flex_attention`` that dynamo does not compile (recompile limit reached, a graph
break) runs the unfused eager implementation, tens of times slower; reporting that as Flex's
speed would be wrong. Three guards: the recompile limits are raised (and set to fail rather
than fall back), ``fullgraph=True`` makes a graph break an error, and the compile goes through
:class:`CountingBackend`: the first call of every new shape (``dynamic=False``, so each shape
gets its own specialised kernel) must increment its count, otherwise the call ran eagerly and
the provider fails with :class:`NotCompiledError` instead of being timed.
"""

from __future__ import annotations

from typing import Callable

import torch

from .providers import DecodeInputs, Prepared, PrefillInputs, Provider, all_of, needs_cuda, needs_module

RECOMPILE_LIMIT = 1024
_LIMIT_NAMES = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit")


class NotCompiledError(RuntimeError):
    """A compiled function ran a new shape without compiling it (an eager fallback)."""


class CountingBackend:
    """A ``torch.compile`` backend that counts compilations and hands graphs to ``inner``."""

    def __init__(self, inner: str = "inductor"):
        self.inner = inner
        self.compiles = 0

    def __call__(self, graph_module, example_inputs):
        self.compiles += 1
        if self.inner == "eager":
            return graph_module.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph_module, example_inputs)


def raise_recompile_limits(limit: int = RECOMPILE_LIMIT, fail_on_limit: bool = True) -> None:
    """Let dynamo compile ``limit`` shapes per function, and raise instead of falling back."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in _LIMIT_NAMES:
        if hasattr(config, name):
            setattr(config, name, max(limit, getattr(config, name) if "accumulated" in name else limit))
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = fail_on_limit


class VerifiedCompile:
    """``torch.compile(fn, dynamic=False)`` whose first call per shape key must compile."""

    def __init__(self, fn: Callable, inner_backend: str = "inductor", fullgraph: bool = True):
        self.backend = CountingBackend(inner_backend)
        self.compiled = torch.compile(fn, backend=self.backend, dynamic=False, fullgraph=fullgraph)
        self.seen: set = set()

    def first_call(self, key, *args, **kwargs):
        """Call once for shape ``key``; raise :class:`NotCompiledError` if it did not compile."""
        before = self.backend.compiles
        out = self.compiled(*args, **kwargs)
        if key not in self.seen and self.backend.compiles == before:
            raise NotCompiledError(
                f"torch.compile did not compile shape {key}: the call ran eagerly (recompile "
                "limit or graph break); not reporting eager speed as compiled speed"
            )
        self.seen.add(key)
        return out


_STATE: dict = {}


def compiled_flex() -> VerifiedCompile:
    """The process-wide compiled ``flex_attention`` (limits raised on first use)."""
    if "flex" not in _STATE:
        from torch.nn.attention.flex_attention import flex_attention

        raise_recompile_limits()
        _STATE["flex"] = VerifiedCompile(flex_attention)
    return _STATE["flex"]


def bottom_right_causal(offset: int):
    """Mask mod: query ``i`` sees key ``j`` iff ``j <= i + offset`` (offset = Sk - Sq).

    One function object per offset, so dynamo sees the same function for the same mask.
    """
    cache = _STATE.setdefault("masks", {})
    if offset not in cache:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        cache[offset] = mask_mod
    return cache[offset]


def block_mask_for(seqlen_q: int, seqlen_k: int, device) -> object:
    """A (cached) BlockMask of the bottom-right causal mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("block_mask", seqlen_q, seqlen_k, str(device))
    if key not in _STATE:
        mask_mod = bottom_right_causal(seqlen_k - seqlen_q)
        _STATE[key] = create_block_mask(mask_mod, None, None, seqlen_q, seqlen_k, device=device)
    return _STATE[key]


def build_flex(q, k, v, causal: bool) -> Prepared:
    """Compiled flex on ``[B, H, S, D]`` views; compiles (and verifies) before returning."""
    flex = compiled_flex()
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    kwargs = {"enable_gqa": q.shape[2] != k.shape[2]}
    if causal and seqlen_q > 1:
        kwargs["block_mask"] = block_mask_for(seqlen_q, seqlen_k, q.device)
    key = (tuple(q.shape), tuple(k.shape), str(q.dtype), causal and seqlen_q > 1, seqlen_k - seqlen_q)
    flex.first_call(key, qt, kt, vt, **kwargs)
    return Prepared(lambda: flex.compiled(qt, kt, vt, **kwargs).transpose(1, 2))


FLEX_PROBE = all_of(needs_cuda, needs_module("torch.nn.attention.flex_attention"))
FLEX_SUMMARY = "torch FlexAttention, torch.compile(dynamic=False), compile verified per shape"


def prefill_provider() -> Provider:
    def build(inputs: PrefillInputs) -> Prepared:
        return build_flex(inputs.q, inputs.k, inputs.v, inputs.causal)

    return Provider("flex", "prefill", FLEX_SUMMARY, FLEX_PROBE, build)


def decode_provider() -> Provider:
    def build(inputs: DecodeInputs) -> Prepared:
        return build_flex(inputs.q, inputs.k_cache, inputs.v_cache, True)

    return Provider("flex", "decode", FLEX_SUMMARY, FLEX_PROBE, build)
