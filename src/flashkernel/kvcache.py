"""Paged KV cache bookkeeping for a batch of sequences, as a serving engine keeps it.

A pool of pages ``[num_blocks, page_size, num_kv_heads, head_dim]`` (one for keys, one for
values) is shared by ``batch`` sequence slots. Each slot owns a list of pages; its row of
``block_table [batch, max_blocks_per_seq]`` (int32) lists them in order, and
``cache_seqlens [batch]`` (int32) holds how many tokens it has. Token ``j`` of slot ``b`` lives
at ``pages[block_table[b, j // page_size], j % page_size]``; these are exactly the arguments of
:func:`flashkernel.flash_attn_with_kvcache`.

Host lists are the source of truth; the device tensors are updated in place (never
reallocated), so a CUDA graph that captured them sees every change. Entries of ``block_table``
that name no page hold -1, never a valid page index: a step that appends to a sequence without
:meth:`KVCache.reserve` is refused by ``flash_attn_with_kvcache``'s checks (CPU tensors, or
``validate=True``) or skipped by the append, and never lands in another sequence's page.
One decode step::

    cache.reserve(1)                      # pages for one more token per sequence (host work)
    out = flash_attn_with_kvcache(q, cache.k_pages, cache.v_pages, k=k, v=v,
                                  cache_seqlens=cache.cache_seqlens, block_table=cache.block_table,
                                  k_scale=cache.k_scale, v_scale=cache.v_scale)  # None unless quantized
    cache.advance(1)                      # cache_seqlens += 1, on the device, no sync

A quantized cache (``cache_dtype=torch.float8_e4m3fn`` or ``torch.int8``) keeps its pages in that
format and its scales in ``k_scale``/``v_scale`` (float32 on the pages' device): ``[1]`` per tensor,
``[num_kv_heads]`` per KV head, or ``[num_blocks, page_size, num_kv_heads]`` per token and head,
written by every append.
"""

from __future__ import annotations

import numbers

import torch

from . import _checks, reference

__all__ = ["KVCache"]

NO_PAGE = -1  # a block_table entry that names no page (rejected by the kernels' checks)


def default_device() -> str:
    """``"cuda"`` when torch sees a GPU, else ``"cpu"`` (for Triton's interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_count(name: str, value) -> None:
    """A number of tokens: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({_checks.type_name(value)})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_page_size(page_size) -> None:
    _check_positive_int("page_size", page_size)
    if page_size > _checks.MAX_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(
            f"page_size must be a power of two from 1 to {_checks.MAX_PAGE_SIZE} (the decode "
            f"kernels' page sizes), got {page_size}"
        )


def _zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeroed pages; 1-byte ones as zeroed bytes (float8 has no fill kernel on every device)."""
    if dtype.itemsize == 1:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (for indexing, which not every device implements for float8)."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _initial_scale(name: str, value, granularity: str, shape, device) -> torch.Tensor:
    """A quantized cache's scale tensor: per token zeros ``[num_blocks, page_size, Hkv]`` (each
    append writes its tokens'); per tensor ``[1]`` / per head ``[Hkv]`` from ``value`` (None:
    1.0; a float; or a float32 tensor of that shape)."""
    if granularity == "token":
        if value is not None:
            raise ValueError(f"{name} is given with scale_granularity='token': per-token scales are computed by "
                             "each append; pass none")
        return torch.zeros(shape[:3], dtype=torch.float32, device=device)
    size = 1 if granularity == "tensor" else shape[2]
    if value is None or isinstance(value, numbers.Real):  # bools too: check_scale_number refuses them
        value = 1.0 if value is None else _checks.check_scale_number(name, value)
        return torch.full((size,), value, dtype=torch.float32, device=device)
    _checks.check_tensor(name, value)
    if value.dtype != torch.float32 or value.numel() != size:
        raise ValueError(f"{name} must be a float or a float32 tensor of {size} element(s) (per {granularity}), got "
                         f"{value.dtype} of shape {tuple(value.shape)}")
    return value.detach().reshape(size).to(device).clone()


class KVCache:
    """A page pool plus per-sequence page lists and lengths.

    Args:
        num_blocks: pages in the pool.
        page_size: tokens per page, a power of two from 1 to 256.
        num_kv_heads, head_dim: shape of one token's keys (and values).
        batch: number of sequence slots.
        max_blocks_per_seq: columns of ``block_table``; a sequence holds at most
            ``max_blocks_per_seq * page_size`` tokens.
        dtype: of the keys and values appended (and of the queries): float16, bfloat16 or
            float32; also of the pages unless ``cache_dtype`` says otherwise.
        device: where the pages live; None (default) means ``"cuda"`` when torch sees a GPU,
            else ``"cpu"`` (where the kernels need Triton's interpreter, ``TRITON_INTERPRET=1``).
        shuffle_pages: hand out pages in a random order (as a long-running engine's pool ends
            up), instead of lowest index first.
        cache_dtype: the pages' dtype; None (default) = ``dtype``, or a quantized format,
            ``torch.float8_e4m3fn`` or ``torch.int8`` (see ``flash_attn_with_kvcache``'s
            ``k_scale``).
        scale_granularity: of a quantized cache's scales: ``"tensor"`` (the default), ``"head"``
            or ``"token"``; an error without a quantized ``cache_dtype``.
        k_scale, v_scale: a quantized cache's static scales (``"tensor"``/``"head"``): a float or
            a float32 tensor of the granularity's shape; default 1.0 for float8_e4m3fn, required
            for int8 (1.0 would round values to whole numbers). Values beyond ``448 * scale``
            (int8: ``127 * scale``) saturate, so set them from calibration (or let
            ``flashkernel.quantize_kv`` compute them from a prefilled cache). Per-token scales
            are computed by every append and written in place into ``k_scale``/``v_scale``:
            a model whose layers each have a cache needs one ``KVCache`` (or one pair of scale
            tensors) per layer; static scales may be shared.

    Unused ``block_table`` entries are -1 (no page), also after :meth:`free`.
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        batch: int,
        max_blocks_per_seq: int,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        shuffle_pages: bool = False,
        cache_dtype: torch.dtype | None = None,
        scale_granularity: str | None = None,
        k_scale=None,
        v_scale=None,
    ):
        for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("batch", batch), ("max_blocks_per_seq", max_blocks_per_seq)):
            _check_positive_int(name, value)
        _check_page_size(page_size)
        _checks.check_head_dim("the cache", head_dim)
        if dtype not in _checks.SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {', '.join(map(str, _checks.SUPPORTED_DTYPES))}, got {dtype}")
        device = default_device() if device is None else device
        self.page_size = page_size
        self.dtype = dtype
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        cache_dtype = dtype if cache_dtype is None else cache_dtype
        if cache_dtype != dtype:
            _checks.check_quantized_dtype(cache_dtype, "cache_dtype")
            scale_granularity = "tensor" if scale_granularity is None else scale_granularity
            _checks.check_granularity(scale_granularity, "scale_granularity")
            if cache_dtype == torch.int8 and scale_granularity != "token" and (k_scale is None or v_scale is None):
                raise ValueError(
                    f"cache_dtype=torch.int8 with scale_granularity={scale_granularity!r} needs k_scale and v_scale: "
                    "int8 keeps 127 steps of its scale, so a scale of 1.0 would round every value to a whole number "
                    "(~28% error on unit-variance keys); pass scales from calibration (about max |x| / 127), or use "
                    "scale_granularity='token' (computed from each token)")
        elif scale_granularity is not None:
            raise ValueError(f"scale_granularity={scale_granularity!r} is given but cache_dtype is {cache_dtype}: scales "
                             "belong to a quantized cache (cache_dtype=torch.float8_e4m3fn or torch.int8)")
        self.k_pages = _zeros(shape, cache_dtype, device)
        self.v_pages = _zeros(shape, cache_dtype, device)
        self.scale_granularity = None
        self.k_scale = self.v_scale = None
        if cache_dtype != dtype:
            self.scale_granularity = scale_granularity
            self.k_scale = _initial_scale("k_scale", k_scale, scale_granularity, shape, device)
            self.v_scale = _initial_scale("v_scale", v_scale, scale_granularity, shape, device)
        elif k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are given but cache_dtype is {cache_dtype}: scales belong to a "
                             "quantized cache (cache_dtype=torch.float8_e4m3fn or torch.int8)")
        self.block_table = torch.full((batch, max_blocks_per_seq), NO_PAGE, dtype=torch.int32, device=device)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        order = torch.randperm(num_blocks).tolist() if shuffle_pages else list(range(num_blocks))
        self._free = order[::-1]  # pop() from the end hands out order[0] first
        self._pages: list[list[int]] = [[] for _ in range(batch)]
        self._lengths = [0] * batch

    # ---- queries -----------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self._lengths)

    @property
    def max_tokens_per_seq(self) -> int:
        return self.block_table.shape[1] * self.page_size

    def length(self, seq: int) -> int:
        """Tokens stored for sequence slot ``seq``."""
        return self._lengths[seq]

    def pages(self, seq: int) -> list[int]:
        """Page indices owned by ``seq``, in token order."""
        return list(self._pages[seq])

    def free_pages(self) -> int:
        return len(self._free)

    def __repr__(self) -> str:
        num_blocks, _, num_kv_heads, head_dim = self.k_pages.shape
        quantized = (f", cache_dtype={self.k_pages.dtype}, scale_granularity={self.scale_granularity!r}"
                     if self.scale_granularity is not None else "")
        return (f"KVCache(num_blocks={num_blocks}, page_size={self.page_size}, num_kv_heads={num_kv_heads}, "
                f"head_dim={head_dim}, batch={self.batch}, max_blocks_per_seq={self.block_table.shape[1]}, "
                f"dtype={self.dtype}{quantized}, device={self.k_pages.device}; lengths {self._lengths}, "
                f"{len(self._free)} of {num_blocks} pages free)")

    # ---- updates -----------------------------------------------------------------------------

    def _seqs(self, seqs) -> list[int]:
        """``seqs``: None (every slot), one slot index, or a list / tuple / range of distinct ones."""
        chosen = list(range(self.batch)) if seqs is None else list(seqs) if isinstance(seqs, (list, tuple, range)) else [seqs]
        for seq in chosen:
            self._check_seq(seq)
        if len(set(chosen)) != len(chosen):
            repeated = sorted({seq for seq in chosen if chosen.count(seq) > 1})
            raise ValueError(f"seqs lists sequence(s) {repeated} more than once; give each slot once")
        return chosen

    def reserve(self, num_tokens: int, seqs=None) -> None:
        """Give each sequence in ``seqs`` (default: all) room for ``num_tokens`` more tokens.

        Allocates pages from the pool and writes them to ``block_table``; lengths are unchanged.
        Checks every sequence first: when one does not fit, nothing is allocated.
        """
        _check_count("num_tokens", num_tokens)
        grows, free = {}, len(self._free)
        for seq in self._seqs(seqs):
            needed = -(-(self._lengths[seq] + num_tokens) // self.page_size)
            if needed > self.block_table.shape[1]:
                raise ValueError(
                    f"sequence {seq} would need {needed} pages for {self._lengths[seq] + num_tokens} "
                    f"tokens; block_table has {self.block_table.shape[1]} columns"
                )
            grow = needed - len(self._pages[seq])
            if grow > free:
                taken = len(self._free) - free
                before = f" (after {taken} for the sequences before it)" if taken else ""
                raise RuntimeError(f"page pool exhausted: sequence {seq} needs {grow} pages, {free} free{before}")
            if grow > 0:
                grows[seq] = grow
                free -= grow
        for seq, grow in grows.items():
            start = len(self._pages[seq])
            new = [self._free.pop() for _ in range(grow)]
            self._pages[seq].extend(new)
            self.block_table[seq, start:start + grow] = torch.tensor(new, dtype=torch.int32)

    def advance(self, num_tokens: int, seqs=None) -> None:
        """Count ``num_tokens`` more tokens (already written, e.g. by a decode step) in ``seqs``."""
        _check_count("num_tokens", num_tokens)
        chosen = self._seqs(seqs)
        # Check every sequence before changing any, so host and device lengths stay in step.
        for seq in chosen:
            if self._lengths[seq] + num_tokens > len(self._pages[seq]) * self.page_size:
                raise ValueError(f"sequence {seq} has no room reserved for {num_tokens} more tokens")
        for seq in chosen:
            self._lengths[seq] += num_tokens
        if seqs is None:
            self.cache_seqlens.add_(num_tokens)  # in place on the device, no sync
        else:
            self.cache_seqlens[chosen] = torch.tensor([self._lengths[s] for s in chosen], dtype=torch.int32)

    def _check_seq(self, seq) -> None:
        if isinstance(seq, bool) or not isinstance(seq, numbers.Integral) or not 0 <= seq < self.batch:
            raise ValueError(f"seq must be a sequence slot from 0 to {self.batch - 1}, got {seq!r}")

    def _check_new_tokens(self, k, v) -> None:
        """``k, v``: tensors of shape ``[n, num_kv_heads, head_dim]`` in the pages' dtype and device."""
        token_shape = tuple(self.k_pages.shape[2:])
        for name, x in (("k", k), ("v", v)):
            _checks.check_tensor(name, x)
            if x.dim() != 3 or tuple(x.shape[1:]) != token_shape:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}; KVCache.append takes [n, num_kv_heads, head_dim] = "
                    f"[n, {token_shape[0]}, {token_shape[1]}]"
                )
            if x.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but the cache takes {self.dtype}: cast it first")
            if x.device != self.k_pages.device:
                raise ValueError(f"{name} is on {x.device} but the cache's pages are on {self.k_pages.device}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens and v has {v.shape[0]}: they must have the same number")

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v [n, num_kv_heads, head_dim]`` after sequence ``seq``'s tokens (prefill).

        Checks the arguments before reserving anything, so a bad call leaves the cache as it was.
        """
        self._check_seq(seq)
        self._check_new_tokens(k, v)
        n = k.shape[0]
        if self.k_scale is not None:  # before reserving: what the quantizer refuses changes nothing
            k, v, k_scale, v_scale = self._quantized(k.contiguous(), v.contiguous())
        self.reserve(n, seq)
        pos = torch.arange(self._lengths[seq], self._lengths[seq] + n)
        pages = torch.tensor(self._pages[seq], dtype=torch.long)[pos // self.page_size]
        slots = pos % self.page_size
        device = self.k_pages.device
        where = (pages.to(device), slots.to(device))
        if self.scale_granularity == "token":
            self.k_scale[where] = k_scale[0]
            self.v_scale[where] = v_scale[0]
        _bytes(self.k_pages)[where] = _bytes(k)
        _bytes(self.v_pages)[where] = _bytes(v)
        self.advance(n, seq)

    def _quantized(self, k, v):
        """``k, v [n, Hkv, D]`` in the pages' format (``flashkernel.quantize_kv`` with this cache's
        scales): ``(k [n, Hkv, D], v, k_scale, v_scale)``, per-token scales ``[1, n, Hkv]``."""
        from .interface import quantize_kv

        static = self.scale_granularity != "token"
        k, v, k_scale, v_scale = quantize_kv(
            k[None], v[None], dtype=self.k_pages.dtype, granularity=self.scale_granularity,
            k_scale=self.k_scale if static else None, v_scale=self.v_scale if static else None)
        return k[0], v[0], k_scale, v_scale

    def free(self, seq: int) -> None:
        """Return ``seq``'s pages to the pool and empty it (the slot can be reused); its
        ``block_table`` row goes back to -1."""
        self._check_seq(seq)
        self._free.extend(reversed(self._pages[seq]))
        self._pages[seq] = []
        self._lengths[seq] = 0
        self.block_table[seq] = NO_PAGE
        self.cache_seqlens[seq] = 0

    def gather(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``seq``'s keys and values as dense ``[length, num_kv_heads, head_dim]`` copies:
        the pages' values, or for a quantized cache the values they stand for (``c * scale``,
        float64: exact, ``reference.dequantize``)."""
        self._check_seq(seq)
        pos = torch.arange(self._lengths[seq])
        pages = torch.tensor(self._pages[seq], dtype=torch.long)[pos // self.page_size].to(self.k_pages.device)
        slots = (pos % self.page_size).to(self.k_pages.device)
        keys = _bytes(self.k_pages)[pages, slots].view(self.k_pages.dtype)
        values = _bytes(self.v_pages)[pages, slots].view(self.v_pages.dtype)
        if self.k_scale is None:
            return keys, values
        if self.scale_granularity == "token":
            return (reference.dequantize(keys, self.k_scale[pages, slots]),
                    reference.dequantize(values, self.v_scale[pages, slots]))
        return reference.dequantize(keys, self.k_scale), reference.dequantize(values, self.v_scale)
