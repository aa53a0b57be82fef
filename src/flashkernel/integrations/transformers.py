"""Hugging Face transformers (5.x) on flashkernel: ``attn_implementation="fk_attention"``.

Importing this module (or calling :func:`register`) registers, through transformers' public
``AttentionInterface`` and ``AttentionMaskInterface``:

* ``"fk_attention"``: attention for the decoder models (``[B, H, S, D]`` tensors from
  transformers, read through transposed views, never copied for the kernel's sake) and its mask
  function;
* ``"paged|fk_attention"``: the same for continuous batching (``generate_batch``) over
  transformers' paged KV cache.

The name has no "flash" in it on purpose: transformers 5.17 treats every implementation whose
name contains "flash" as a FlashAttention flavour and, when a model is created or switched to it,
loads that flavour's kernels (``lazy_import_flash_attention``: the ``flash_attn`` package or a
Hub kernel repository), which fails for any other name; models that list
``_compatible_flash_implementations`` (gpt-oss) even replace such a name with their own choice.

Example::

    import flashkernel.integrations.transformers  # registers the names
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fk_attention")
    model.generate(input_ids, attention_mask=mask, max_new_tokens=64)       # any cache
    model.set_attn_implementation("paged|fk_attention")  # else transformers may pick FlashAttention
    model.generate_batch(prompts, generation_config)                         # continuous batching

How each call runs (``q_len`` new tokens against ``kv_len`` keys):

* **decode** (``q_len <= DECODE_MAX_QUERIES``, no gradient wanted): ``flash_attn_with_kvcache``
  with the keys as a contiguous cache, ``cache_seqlens`` = the keys that exist and
  ``cache_leftpad`` = where each sequence's keys start, so left-padded batches and static caches
  (whose tail is unused) run the split-KV, GQA-packed decode kernel. Nothing is appended: the
  cache layer already holds the new keys.
* **prefill**, no padding: ``flash_attn_func`` on the tensors as they are.
* **prefill** with padding or over a static cache: ``flash_attn_varlen_func`` over the batch
  flattened to rows, cut into three packed sequences per sequence (the padding before its keys,
  its keys, the padding or unused cache after them) so the sequences tile the rows exactly: no
  gather, no host synchronisation, and the padding rows only ever attend padding.
* **packed** inputs (batch 1, several sequences one after the other, no padding mask):
  ``flash_attn_varlen_func`` with transformers' ``cu_seq_lens_*`` arguments, or, in eager mode,
  offsets found from ``position_ids`` as transformers' FlashAttention integration finds them (a
  sequence starts where the position is the smallest; one device-to-host copy per forward). A
  traced call (torch.compile) cannot read positions without a host synchronisation: it takes
  packed sequences from ``cu_seq_lens_*`` only, and attends across sequences packed by
  ``position_ids`` alone.

The mask function (:func:`key_spans_mask`) runs once per forward: it turns transformers' 2-D
padding mask and the cache's offsets into each sequence's key span ``(start, end, existing)``,
returned as an int32 ``[B, 1, 1, 3]`` tensor (4-D, so that transformers passes it through as an
already prepared mask when ``generate`` builds masks ahead of a compiled forward), or None when
the keys are exactly the tensors' rows (no padding, no cache offset: a prefill, or a first
forward of any length). Nothing in it
or in the attention function reads a tensor's values on the host while torch.compile traces, so a
compiled model with a static cache has no graph break; in eager mode one all-ones check of the
padding mask per forward (as transformers' sdpa mask makes) and, for batch-1 prefills, the
packed-input check read values.

Each sequence's valid keys must be one run of its padding mask (left padding, or right padding
that is not followed by generated tokens, as transformers' ``generate`` requires of decoder-only
models): in eager mode a mask with a hole inside a sequence raises (one more copy, only for a
mask that pads something) where the cache's offset is a number (no cache, the dynamic cache); a
static cache's offset (a tensor) and a traced call skip the check, and read the run from the
first to the last valid key. Masks
that are not causal, bidirectional or a sliding window over padded or packed sequences (Llama
4's chunked attention, blockwise overlays, custom mask functions) raise: use ``sdpa`` for them.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers import masking_utils
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "flashkernel.integrations.transformers needs Hugging Face transformers 5.x: "
        "pip install 'flashkernel[transformers]'") from error

from .. import _checks, ops
from ..interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["NAME", "PAGED_NAME", "DECODE_MAX_QUERIES", "register", "attention_forward", "paged_attention_forward",
           "key_spans_mask"]

NAME = "fk_attention"
PAGED_NAME = "paged|" + NAME
# Calls with at most this many new tokens per sequence run the decode kernel (its row tile holds
# GQA group x new tokens); longer ones run the prefill kernel, which skips causal tiles.
DECODE_MAX_QUERIES = 16
SPAN_FIELDS = 3  # start, end, existing


def register() -> None:
    """Register ``"fk_attention"`` (attention and mask function) and ``"paged|fk_attention"``
    with transformers (idempotent). The paged name gets no mask function: continuous batching
    passes packed sequences and their offsets instead of a mask."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, key_spans_mask)
    AttentionInterface.register(PAGED_NAME, paged_attention_forward)


# ---- the mask function ---------------------------------------------------------------------------


def key_spans_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   mask_function=None, attention_mask: torch.Tensor | None = None, use_vmap: bool = False,
                   device=None, **kwargs) -> torch.Tensor | None:
    """transformers' mask hook: each sequence's keys, for :func:`attention_forward`.

    Key column ``j`` (of the ``kv_length`` keys the attention receives) is the token at position
    ``kv_offset + j``; the queries are the last ``q_length`` of the ``existing = q_offset +
    q_length - kv_offset`` columns that hold a token (a static cache's later columns are unused).
    ``attention_mask`` is the 2-D padding mask over positions (``[B, >= kv_offset + ...]``, bool)
    or None.

    Returns None when every sequence's keys are exactly the ``kv_length`` columns and this is a
    prefill (``q_length > DECODE_MAX_QUERIES``) or the queries are all the keys (a first forward,
    however short: its ``position_ids`` may pack several sequences, which the attention reads);
    else an int32 ``[B, 1, 1, 3]`` tensor holding per sequence ``(start, end, existing)``: its
    valid keys are columns ``[start, end)`` (the first
    and one past the last valid column of its padding mask below ``existing``; ``start = end =
    existing`` when it has none). In eager mode one device-to-host copy checks whether the mask
    pads anything (transformers' sdpa mask makes the same), and a second, where it does, whether
    it has a hole (:func:`_all_valid`); a traced call (torch.compile) and a static cache's
    (``q_offset`` a tensor) make none.
    """
    if use_vmap:
        raise NotImplementedError(
            "flashkernel's attention computes causal and sliding-window masks with padding; this model asks for a "
            "custom mask (or_mask_function / and_mask_function), which it cannot express: use attn_implementation="
            "'sdpa' for it")
    _check_mask_function(mask_function)
    if kwargs.get("config") is not None:
        _check_chunking(kwargs["config"])
    if device is None:
        device = attention_mask.device if attention_mask is not None else torch.device("cpu")
    padding = _padding_columns(attention_mask, kv_length, kv_offset)
    existing = q_offset + q_length - kv_offset
    if (padding is not None and isinstance(existing, int) and not torch.compiler.is_compiling()
            and _all_valid(padding[:, :existing])):  # a device-to-host copy, as transformers' sdpa mask makes
        padding = None
    if padding is None and isinstance(existing, int):
        if existing == kv_length and (q_length > DECODE_MAX_QUERIES or q_length == kv_length):
            return None
        spans = torch.full((batch_size, 1, 1, SPAN_FIELDS), existing, dtype=torch.int32, device=device)
        spans[..., 0] = 0
        return spans
    if not isinstance(existing, torch.Tensor):
        existing = torch.full((), existing, dtype=torch.int64, device=device)
    existing = existing.to(device=device, dtype=torch.int64).expand(batch_size)
    if padding is None:
        start, end = torch.zeros_like(existing), existing
    else:
        valid = padding & (torch.arange(kv_length, device=device) < existing[:, None])
        found = valid.any(-1)
        first = valid.to(torch.int32).argmax(-1)
        after_last = kv_length - valid.flip(-1).to(torch.int32).argmax(-1)
        start = torch.where(found, first, existing)
        end = torch.where(found, after_last, existing)
    return torch.stack((start, end, existing), -1).to(torch.int32).view(batch_size, 1, 1, SPAN_FIELDS)


def _all_valid(padding: torch.Tensor) -> bool:
    """Whether the padding mask ``[B, existing]`` (bool) pads nothing (one device-to-host copy);
    where it does, raises if a sequence's valid columns are not one run (a hole: right padding
    followed by generated tokens, say), with a second copy."""
    if bool(padding.all()):
        return True
    rises = padding[:, 1:] & ~padding[:, :-1]  # a valid column after a padded one
    holes = rises.sum(-1) + padding[:, 0] > 1
    if bool(holes.any()):
        rows = holes.nonzero().flatten().tolist()
        raise ValueError(
            f"the attention mask has padding between valid tokens in row(s) {rows}: flashkernel reads each sequence's "
            "keys as one run of its mask (left padding, or right padding with nothing generated after it); "
            "left-pad the prompts (tokenizer.padding_side = 'left'), or use attn_implementation='sdpa'")
    return False


# The parts of transformers' mask functions this attention computes itself, recognised by their
# code objects (masking_utils makes them as closures): causal or bidirectional attention, a sliding
# window (the attention gets it as its ``sliding_window`` argument), packed sequences (found from
# ``position_ids`` here too), and their intersection.
def _closure_code(factory: str, *args):
    make = getattr(masking_utils, factory, None)
    return make(*args).__code__ if make is not None else None


_PLAIN_MASKS = tuple(getattr(masking_utils, name, None) for name in ("causal_mask_function",
                                                                     "bidirectional_mask_function"))
_AND_CODE = _closure_code("and_masks", masking_utils.causal_mask_function)
_PART_CODES = (_closure_code("sliding_window_overlay", 1), _closure_code("packed_sequence_mask_function",
                                                                         torch.zeros(1, 1)))


def _check_mask_function(mask_function) -> None:
    """Raise for a mask this attention does not compute (and would otherwise ignore): anything
    but causal or bidirectional attention, a sliding window and packed sequences, e.g. Llama 4's
    chunked attention or a blockwise overlay. An intersection's parts are checked in eager mode
    only (torch.compile cannot trace a closure's cells); :func:`_check_chunking` refuses chunked
    attention by the model's config in both."""
    if mask_function is None or mask_function in _PLAIN_MASKS:
        return
    code = getattr(mask_function, "__code__", None)
    if code is not None and code in _PART_CODES:
        return
    if code is not None and code is _AND_CODE:
        if not torch.compiler.is_compiling():
            parts = next((cell.cell_contents for cell in mask_function.__closure__ or ()
                          if isinstance(cell.cell_contents, tuple)), None)
            if parts is None:
                raise NotImplementedError(
                    "flashkernel's attention cannot read the parts of this transformers version's combined mask "
                    "function (and_masks): use attn_implementation='sdpa'")
            for part in parts:
                _check_mask_function(part)
        return
    raise NotImplementedError(
        "flashkernel's attention computes causal, bidirectional and sliding-window attention over padded or packed "
        f"sequences; this model's mask is built from {getattr(mask_function, '__qualname__', mask_function)!r} (Llama "
        "4's chunked attention, say), which it cannot express: use attn_implementation='sdpa' for this model")


def _padding_columns(attention_mask, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    """The padding mask ``[B, kv_length]`` (bool) of the key columns, or None: positions
    ``kv_offset .. kv_offset + kv_length - 1`` of the 2-D mask, False past its end."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if mask.shape[-1] < kv_length:
        mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]))
    return mask


class _PerTensorMemo:
    """Values derived from a tensor, kept while the tensor is unmodified: every layer of a
    forward gets the same mask and position tensors, so the first layer's work serves the
    others. Holds the last ``size`` tensors (alive, by reference: masks and positions are small).

    Only for eager calls on tensors with a version counter: :meth:`usable` is False while
    torch.compile traces and for inference tensors (made under ``torch.inference_mode()``)."""

    def __init__(self, size: int):
        self.size = size
        self._kept: dict = {}  # id -> (tensor, version, value)

    @staticmethod
    def usable(x) -> bool:
        return isinstance(x, torch.Tensor) and not torch.compiler.is_compiling() and not x.is_inference()

    def get(self, x):
        """The value kept for ``x`` (a :meth:`usable` tensor), or None."""
        kept = self._kept.get(id(x))
        if kept is not None and kept[0] is x and kept[1] == x._version:
            return kept[2]
        return None

    def put(self, x, value) -> None:
        if len(self._kept) >= self.size:
            self._kept.clear()
        self._kept[id(x)] = (x, x._version, value)


_SPANS_OF_MASKS = _PerTensorMemo(8)  # a forward has one mask per layer type


def _key_spans(attention_mask) -> tuple | None:
    """``(spans, start, end, existing)`` from :func:`key_spans_mask`'s output: the int32 ``[B,
    3]`` spans and their three ``[B]`` columns; None for None; any other mask is an error (it
    would be ignored, and padding attended, silently).

    Every layer of a forward gets the same mask tensor (one per layer type), so in eager mode
    the views are made once per mask and kept while it is unmodified: the later layers' calls
    make none."""
    if attention_mask is None:
        return None
    keep = _SPANS_OF_MASKS.usable(attention_mask)
    if keep:
        spans = _SPANS_OF_MASKS.get(attention_mask)
        if spans is not None:
            return spans
    if (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.int32
            and attention_mask.dim() == 4 and tuple(attention_mask.shape[1:]) == (1, 1, SPAN_FIELDS)):
        spans = _with_columns(attention_mask.view(-1, SPAN_FIELDS))
        if keep:
            _SPANS_OF_MASKS.put(attention_mask, spans)
        return spans
    what = (f"a {attention_mask.dtype} tensor of shape {tuple(attention_mask.shape)}"
            if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__)
    raise TypeError(
        f"flashkernel's attention got {what} as its attention mask; it reads the masks of its own mask function: "
        "register both with flashkernel.integrations.transformers.register() (AttentionMaskInterface as well as "
        "AttentionInterface), and pass a 2-D padding mask to the model, not a prepared 4-D one")


def _with_columns(spans: torch.Tensor) -> tuple:
    """``(spans, start, end, existing)`` of int32 spans ``[B, 3]``."""
    return (spans, *spans.unbind(-1))


# ---- attention ---------------------------------------------------------------------------------


def _variant(module, dropout, scaling, sliding_window, softcap, is_causal):
    """``(causal, keyword arguments)`` of the flashkernel call for transformers' arguments: its
    window ``w`` (``w`` keys including the query's own) is flashkernel's ``(w - 1, w - 1)`` (causal
    zeroes the right side), softcap None is 0."""
    if dropout:
        raise NotImplementedError(
            f"flashkernel's attention has no dropout, got dropout={dropout}: call model.eval(), or set the config's "
            "attention_dropout to 0")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    window = _checks.NO_WINDOW if not sliding_window else (sliding_window - 1, sliding_window - 1)
    return causal, dict(softmax_scale=scaling, window_size=window, softcap=0.0 if softcap is None else softcap)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                      cu_seq_lens_k: torch.Tensor | None = None, max_length_q=None, max_length_k=None, **kwargs):
    """transformers' attention hook (``AttentionInterface``): ``query [B, Hq, q_len, D]``, ``key,
    value [B, Hkv, kv_len, D]`` (the cache layer's keys, new ones included), ``attention_mask``
    from :func:`key_spans_mask`; ``s_aux`` (sinks, gpt-oss) ``[Hq]`` in any float dtype. Returns
    ``(out [B, q_len, Hq, D], None)``."""
    causal, variant = _variant(module, dropout, scaling, sliding_window, softcap, is_causal)
    variant["sinks"] = s_aux
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(
            f"flashkernel needs one head dim for queries and values, got {query.shape[-1]} and {value.shape[-1]}")
    if attention_mask is None:  # also what transformers passes when our mask function is not registered
        _check_mask_function_registered(module)
    if kwargs.get("output_attentions"):
        _warn_no_attention_weights()
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    spans = _key_spans(attention_mask)
    if (cu_seq_lens_q is None and spans is None and q.shape[0] == 1 and q.shape[1] == k.shape[1] > 1
            and position_ids is not None):  # a padding mask wins over position_ids, as in transformers
        cu_seq_lens_q, max_length_q = _packed_offsets(position_ids)
        cu_seq_lens_k, max_length_k = cu_seq_lens_q, max_length_q
    if cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        out = _packed(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, causal, variant)
    elif q.shape[1] <= DECODE_MAX_QUERIES and not ops.needs_grad((q, k, v, s_aux)):
        _, start, end, existing = spans or _with_columns(_all_keys(q.shape[0], k.shape[1], q.device))
        # Causal: the queries are the last of the existing keys, and right padding after a
        # sequence's keys lies in no valid query's past. Bidirectional: its keys end at `end`.
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=existing if causal else end, cache_leftpad=start,
                                      causal=causal, **variant)
    elif spans is None:
        out = flash_attn_func(q, k, v, causal=causal, **variant)
    else:
        out = _padded(q, k, v, spans[0], causal, variant)
    return out, None


def _all_keys(batch: int, kv_len: int, device) -> torch.Tensor:
    """Spans of a batch whose keys are all the ``kv_len`` rows."""
    spans = torch.full((batch, SPAN_FIELDS), kv_len, dtype=torch.int32, device=device)
    spans[:, 0] = 0
    return spans


def _padded(q, k, v, spans, causal: bool, variant: dict) -> torch.Tensor:
    """Prefill of a padded batch (``q [B, P, Hq, D]``, keys ``[B, K, Hkv, D]``) as packed
    sequences: the rows of sequence ``b`` are cut into (padding before, keys, rest), for its
    queries and its keys alike, so that every row belongs to exactly one packed sequence."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_len = k.shape[1]
    start, end, existing = spans.to(torch.int64).unbind(-1)
    first_query = existing - q_len  # the key column of query row 0
    q_start = (start - first_query).clamp(0, q_len)
    q_end = (end - first_query).clamp(0, q_len).maximum(q_start)
    q_cuts = torch.stack((q_start, q_end - q_start, q_len - q_end), -1)
    k_cuts = torch.stack((start, end - start, kv_len - end), -1)
    cu_q, cu_k = (torch.nn.functional.pad(cuts.flatten().cumsum(0), (1, 0)).to(torch.int32)
                  for cuts in (q_cuts, k_cuts))
    out = flash_attn_varlen_func(q.reshape(batch * q_len, num_heads, head_dim),
                                 k.reshape(batch * kv_len, *k.shape[2:]), v.reshape(batch * kv_len, *v.shape[2:]),
                                 cu_q, cu_k, q_len, kv_len, causal=causal, **variant)
    return out.view(batch, q_len, num_heads, head_dim)


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, variant: dict) -> torch.Tensor:
    """Sequences end to end in the rows of ``q [B, T, Hq, D]`` (and ``k, v``), the rows one after
    the other: ``cu_q``/``cu_k`` over the ``B * T`` tokens."""
    batch, total, num_heads, head_dim = q.shape
    max_q = max_q if isinstance(max_q, int) else batch * total  # a bound is enough: no device-to-host copy
    max_k = max_k if isinstance(max_k, int) else batch * k.shape[1]
    rows = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))  # a view at batch 1
    out = flash_attn_varlen_func(*rows, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                                 causal=causal, **variant)
    return out.view(batch, total, num_heads, head_dim)


_OFFSETS_OF_POSITIONS = _PerTensorMemo(1)


def _packed_offsets(position_ids: torch.Tensor):
    """``(cu_seqlens int32, max_seqlen)`` of the sequences packed into batch 1, as transformers'
    FlashAttention integration finds them: a sequence starts wherever the position is the
    smallest one (0), so one sequence whose positions skip ahead stays one; ``(None, None)`` when
    the positions are one run from the smallest, and while torch.compile traces (the values
    cannot be read there without a host synchronisation: pass ``cu_seq_lens_*``). Eager: one
    device-to-host copy per forward (the answer is kept for the same, unmodified tensor)."""
    if torch.compiler.is_compiling():
        return None, None
    keep = _OFFSETS_OF_POSITIONS.usable(position_ids)
    if keep:
        value = _OFFSETS_OF_POSITIONS.get(position_ids)
        if value is not None:
            return value
    positions = position_ids.reshape(-1)
    starts = positions == positions.min()
    starts[0] = True
    first = starts.nonzero().flatten()  # one device-to-host copy
    if first.numel() <= 1:
        value = (None, None)
    else:
        cu = torch.cat((first, first.new_tensor([positions.numel()]))).to(torch.int32)
        value = (cu, int((cu[1:] - cu[:-1]).max()))
    if keep:
        _OFFSETS_OF_POSITIONS.put(position_ids, value)
    return value


def _check_chunking(config) -> None:
    """Raise for chunked attention (Llama 4's ``attention_chunk_size``), which this attention
    cannot express and torch.compile hides from :func:`_check_mask_function`. Eager calls read
    ``config``'s own attributes directly: transformers' config attribute lookup costs several
    microseconds (its ``__getattribute__``), this read half of one."""
    if torch.compiler.is_compiling():
        chunk = getattr(config, "attention_chunk_size", None)
    else:
        chunk = object.__getattribute__(config, "__dict__").get("attention_chunk_size")
    if chunk:
        raise NotImplementedError(
            f"this model uses chunked attention (attention_chunk_size={chunk}), which flashkernel's attention cannot "
            "express: use attn_implementation='sdpa' for it")


def _check_mask_function_registered(module) -> None:
    """Raise unless transformers builds this model's masks with :func:`key_spans_mask`: without it
    transformers passes no mask at all (its mask interface has no entry for the name), and
    padding would be attended, silently. Called for calls without a mask only (a few
    microseconds: transformers' config attributes are slow to read); it checks the config's
    chunking too."""
    config = getattr(module, "config", None)
    if config is None:
        return
    _check_chunking(config)
    name = getattr(config, "_attn_implementation", None)
    mapping = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    if name is None or (name in mapping and mapping[name] is key_spans_mask):
        return
    raise TypeError(
        f"attn_implementation {name!r} runs flashkernel's attention without its mask function, so padding would be "
        "attended: use flashkernel.integrations.transformers.register() and the name "
        f"{NAME!r}, or register key_spans_mask under {name!r} with AttentionMaskInterface as well")


@functools.cache
def _warn_no_attention_weights() -> None:
    """Once per process (cached)."""
    warnings.warn("flashkernel's attention does not return attention weights (output_attentions=True): "
                  "the model returns none; use attn_implementation='eager' to get them", stacklevel=3)


# ---- continuous batching -----------------------------------------------------------------------


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, cache=None, cu_seq_lens_q: torch.Tensor | None = None,
                            cu_seq_lens_k=None, max_seqlen_q: int | None = None, max_seqlen_k=None,
                            block_table: torch.Tensor | None = None, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention hook for continuous batching (``"paged|fk_attention"``).

    ``query [1, Hq, T, D]``, ``key, value [1, Hkv, T, D]``: the batch's ``T`` new tokens, its
    sequences given by ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 ``[S + 1]``; per layer type
    for models with sliding layers); ``cache`` transformers' ``PagedAttentionCache``.

    * A decode-only batch (``block_table`` given, or every sequence has one new token:
      ``max_seqlen_q == 1``) on a full-attention layer: ``flash_attn_with_kvcache`` appends the
      new keys and values to the paged cache in place and attends there, through the block table
      (transformers' own, padded with -1, or read off ``read_index``: the physical slot of each
      page's first token).
    * Anything else (prefill chunks, mixed batches, sliding-window layers, whose cache is a ring
      buffer): the cache layer writes the new tokens and gathers each sequence's keys
      (``cache.update``), then ``flash_attn_varlen_func``.

    Returns ``(out [T, Hq, D], None)``.
    """
    if cache is None:
        raise ValueError(
            f"{PAGED_NAME} is continuous batching's attention (model.generate_batch): it needs transformers' "
            f"paged cache; for a plain forward use attn_implementation='{NAME}'")
    _check_chunking(module.config)
    causal, variant = _variant(module, dropout, scaling, sliding_window, softcap, True)
    variant["sinks"] = s_aux
    layer = module.layer_idx
    sliding_group = cache.sliding_windows[layer] > 1
    if isinstance(cu_seq_lens_k, dict):
        layer_type = "sliding_attention" if sliding_group else "full_attention"
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[layer_type], max_seqlen_k[layer_type]
    read_index, write_index = kwargs.get("read_index"), kwargs.get("write_index")
    group, index_in_group = cache.layer_index_to_group_indices[layer]
    decode_only = block_table is not None or (max_seqlen_q == 1 and read_index is not None
                                              and read_index[group].numel() > 0)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    if (decode_only and not sliding_group and _pageable(cache.block_size)
            and not ops.needs_grad((query, key, value, s_aux))):
        if block_table is not None:
            table, seqlens = block_table[group], _cached_lengths(cu_seq_lens_k, q.shape[0])
        else:
            table, seqlens = _step_tables(read_index[group], cu_seq_lens_k, max_seqlen_k, cache.block_size)
        out = _paged_decode(q, key, value, cache, index_in_group, seqlens, table, variant)
    else:
        keys, values = cache.update(key_states=key, value_states=value, layer_idx=layer, read_index=read_index,
                                    write_index=write_index)
        out = flash_attn_varlen_func(q, keys, values, cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32),
                                     max_seqlen_q, max_seqlen_k, causal=causal, **variant)
    return out, None


def _pageable(block_size: int) -> bool:
    """Whether flashkernel's paged decode takes pages of ``block_size`` tokens."""
    return 0 < block_size <= _checks.MAX_PAGE_SIZE and block_size & (block_size - 1) == 0


def _cached_lengths(cu_seq_lens_k: torch.Tensor, tokens: int) -> torch.Tensor:
    """int32 ``[T]``: each sequence's keys before its one new token (``-1`` for the empty
    sequences transformers pads a batch with)."""
    return (cu_seq_lens_k[1:tokens + 1] - cu_seq_lens_k[:tokens] - 1).to(torch.int32)


_LAST_STEP: dict = {}


def _step_tables(read_index, cu_seq_lens_k, max_seqlen_k: int, block_size: int):
    """``(block table, cached lengths)`` of a decode step (:func:`block_table_from_read_index`,
    :func:`_cached_lengths`), computed once per forward: the layers of a group share ``read_index``
    and ``cu_seq_lens_k`` (the same tensors, unmodified), so the first layer's are kept for the
    others; not while a CUDA graph is being captured (tensors made outside the graph are not
    refreshed by its replays)."""
    key = (read_index._version, cu_seq_lens_k._version, max_seqlen_k, block_size)
    last = _LAST_STEP.get("key")
    capturing = read_index.is_cuda and torch.cuda.is_current_stream_capturing()
    if (last is not None and not capturing and last[0]() is read_index and last[1]() is cu_seq_lens_k
            and last[2:] == key):
        return _LAST_STEP["value"]
    value = (block_table_from_read_index(read_index, cu_seq_lens_k, max_seqlen_k, block_size),
             _cached_lengths(cu_seq_lens_k, cu_seq_lens_k.shape[0] - 1))
    if not capturing:
        _LAST_STEP.update(key=(weakref.ref(read_index), weakref.ref(cu_seq_lens_k), *key), value=value)
    return value


def _paged_decode(q, key, value, cache, index_in_group: int, seqlens, table, variant: dict) -> torch.Tensor:
    """One new token per sequence (``q [T, Hq, D]``, sequence ``i`` = token ``i``): append it to
    the paged cache after the sequence's ``seqlens[i]`` keys and attend to all of them."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = key.shape[1]
    pages = (-1, cache.block_size, num_kv_heads, head_dim)
    k_pages = cache.key_cache[index_in_group].view(pages)
    v_pages = cache.value_cache[index_in_group].view(pages)
    new_k, new_v = (x[0].transpose(0, 1).unsqueeze(1) for x in (key, value))  # [T, 1, Hkv, D]
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_pages, v_pages, k=new_k, v=new_v, cache_seqlens=seqlens,
                                  block_table=table, causal=True, **variant)
    return out.view(tokens, num_heads, head_dim)


def block_table_from_read_index(read_index: torch.Tensor, cu_seq_lens_k: torch.Tensor, max_seqlen_k: int,
                                block_size: int) -> torch.Tensor:
    """The block table ``[S, ceil(max_seqlen_k / block_size)]`` int32 (-1 past a sequence's pages)
    of a batch whose ``read_index`` lists, sequence after sequence, the physical slot of each of
    its keys in a paged cache of ``block_size``-token pages, keys in order (transformers'
    full-attention layers): page ``m`` of sequence ``i`` holds the slot of its key ``m *
    block_size``. On the device, no host synchronisation."""
    pages = -(-max_seqlen_k // block_size)
    first_keys = torch.arange(pages, device=read_index.device) * block_size
    starts = cu_seq_lens_k[:-1].to(torch.int64)
    lengths = cu_seq_lens_k[1:].to(torch.int64) - starts
    slots = read_index[(starts[:, None] + first_keys).clamp_max(read_index.numel() - 1)]
    return torch.where(first_keys < lengths[:, None], slots // block_size, -1).to(torch.int32)


register()
