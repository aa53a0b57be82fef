"""The fuzzer's search space: kernel classes and the configurations drawn from them.

A *kernel class* fixes everything that decides which kernels compile: the public function, dtype,
head dim, GQA layout, variant flags, ``return_lse``, tensor layout, backend, the decode cache's
page size, new tokens per step, append and split mode, and a *divisibility category* for every
free integer that reaches a kernel as an argument. Triton specializes integer arguments on
``== 1`` and ``% 16 == 0`` (and pointers on 16-byte alignment), so a length drawn freely would
compile a kernel per category it lands in; drawn inside its class's category (``one``, ``odd``,
``even`` = even but not a multiple of 16, ``m16``) it compiles none. The lengths themselves, the
batch, the variant values, softmax scale, input magnitudes and what the padding holds vary freely
per configuration. So ``N`` classes compile a bounded number of kernels (a few per class: the
tuned tables still switch tiles at some lengths) whatever the number of configurations.

Everything is a pure function of ``(seed, index)`` and the :class:`Space`: configuration ``i``
draws its class and its values from ``random.Random(f"{seed}/{i}")``, the classes from
``random.Random(f"{seed}/classes")``. Inputs are drawn at run time from a torch generator seeded
the same way (``fuzz_checks.Inputs``).
"""

from __future__ import annotations

import dataclasses
import math
import random

CATEGORIES = ("one", "odd", "even", "m16")
# Lengths at tile edges (the tiles are 16 to 256 keys; 4096 switches the prefill kernel to TMA).
EDGES = (2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 96, 127, 128, 129, 191, 192, 193, 255, 256, 257,
         511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049, 4095, 4096, 4097, 8191, 8192, 8193, 16383, 16384,
         16385, 32767, 32768, 32769, 65535, 65536)
# Length scales: the upper ends are at switches of the kernels' tables (4096: TMA loads).
SCALES = {"tiny": (1, 64), "small": (2, 512), "medium": (2, 4095), "large": (4096, 16384), "huge": (16385, 65536)}
SCALE_WEIGHTS = {"tiny": 30, "small": 35, "medium": 20, "large": 10, "huge": 5}
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FIXED_SPLITS = (1, 2, 3, 4, 5, 8, 13, 16, 32)
GLUON_HEAD_DIMS = (64, 128, 256)
GLUON_DECODE_ROWS = 16  # query rows (GQA group x new tokens) per KV head of the Gluon decode kernel


@dataclasses.dataclass(frozen=True)
class Space:
    """What the fuzzer may draw on one machine.

    ``max_seqlen`` bounds every sequence, ``max_work`` the scores of one call (batch x query heads x
    query rows x keys) and ``max_cache`` the elements of one KV cache (the float64 reference and
    clones are made of them); ``gluon``: the Hopper kernels exist here.
    """

    dtypes: tuple
    head_dims: tuple
    max_seqlen: int
    max_work: int
    max_cache: int
    max_batch: int
    gluon: bool
    classes: int

    @staticmethod
    def gpu(gluon: bool) -> Space:
        return Space(dtypes=("float16", "bfloat16", "float32"), head_dims=tuple(range(8, 257, 8)),
                     max_seqlen=65536, max_work=2**31, max_cache=2**27, max_batch=16, gluon=gluon, classes=96)

    @staticmethod
    def cpu() -> Space:
        """Triton's interpreter: tiny shapes, no bf16 (its ``tl.dot`` on bf16 is wrong there)."""
        return Space(dtypes=("float16", "float32"), head_dims=(8, 16, 24, 32, 40, 64, 72, 128),
                     max_seqlen=80, max_work=2**15, max_cache=2**15, max_batch=3, gluon=False, classes=48)


@dataclasses.dataclass(frozen=True)
class KernelClass:
    """The compile-relevant part of a configuration (see the module docstring).

    ``family``: ``dense`` (flash_attn_func), ``varlen``, ``kvcache`` (flash_attn_with_kvcache),
    ``standard`` (standard_attention), ``decode_plan``, ``varlen_plan``, ``serving`` (KVCache).
    ``alibi``: None, ``heads`` ([Hq]) or ``batch`` ([B, Hq]); ``sinks``: None or the sinks' dtype.
    ``layout``: ``contiguous``, ``padded`` (views into a larger buffer holding NaN/inf around
    them), ``transposed`` (``[B, H, S, D]`` storage) or ``offset`` (base not 16-byte aligned).
    ``cats``: the divisibility category of each free integer argument; ``scale``: the length scale.
    """

    id: int
    family: str
    dtype: str
    head_dim: int
    kv_heads: int
    group: int
    causal: bool
    window: bool = False
    softcap: bool = False
    alibi: str | None = None
    sinks: str | None = None
    lse: bool = False
    layout: str = "contiguous"
    backend: str = "auto"
    scale: str = "tiny"
    cats: tuple = ()  # ((name, category), ...)
    # kvcache / decode_plan / serving
    page_size: int = 0
    seqlen_new: int = 1
    append: bool = False
    splits: int = 0
    leftpad: bool = False
    # standard: the softmax kernel's block over keys (a constexpr: keys in (block / 2, block])
    key_block: int = 0

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def plain(self) -> bool:
        return not (self.window or self.softcap or self.alibi or self.sinks)

    def cat(self, name: str) -> str:
        return dict(self.cats)[name]

    def label(self) -> str:
        flags = [f for f, on in (("causal", self.causal), ("window", self.window), ("softcap", self.softcap),
                                 (f"alibi-{self.alibi}", self.alibi), (f"sinks-{self.sinks}", self.sinks),
                                 ("lse", self.lse)) if on]
        parts = [self.family, self.dtype, f"d{self.head_dim}", f"h{self.heads}/{self.kv_heads}", *flags,
                 self.layout, self.backend, self.scale]
        if self.family in ("kvcache", "decode_plan", "serving"):
            parts += [f"page{self.page_size}" if self.page_size else "contig", f"T{self.seqlen_new}",
                      "append" if self.append else "noappend", f"splits{self.splits or 'auto'}"]
            parts += ["leftpad"] if self.leftpad else []
        parts += [f"{name}:{cat}" for name, cat in self.cats]
        return " ".join(parts)


# --- drawing values ------------------------------------------------------------------------------


def in_category(n: int, cat: str) -> bool:
    if cat == "one":
        return n == 1
    if cat == "m16":
        return n % 16 == 0 and n > 0
    if cat == "odd":
        return n % 2 == 1 and n > 1
    return n % 2 == 0 and n % 16 != 0  # even


def snap(n: int, cat: str, lo: int, hi: int) -> int:
    """The value of category ``cat`` nearest ``n`` inside ``[lo, hi]`` (outside it when the range
    holds none: the category, which decides the compiled kernel, wins over the range)."""
    if cat == "one":
        return 1
    n = min(max(n, lo), hi)
    for delta in range(0, 64):
        for candidate in (n - delta, n + delta):
            if lo <= candidate <= hi and in_category(candidate, cat):
                return candidate
    candidate = max(hi, 2)
    while not in_category(candidate, cat):
        candidate += 1
    return candidate


def draw_length(rng: random.Random, cat: str, lo: int, hi: int) -> int:
    """A length in ``[lo, hi]`` of category ``cat``: a tile edge a third of the time, else
    log-uniform (short lengths are as likely as long ones)."""
    if cat == "one":
        return 1
    edges = [e for e in EDGES if lo <= e <= hi and in_category(e, cat)]
    if edges and rng.random() < 0.35:
        return rng.choice(edges)
    n = int(round(math.exp(rng.uniform(math.log(max(lo, 1)), math.log(max(hi, 1) + 1)))))
    return snap(n, cat, lo, hi)


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _weighted(rng: random.Random, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


# --- classes -------------------------------------------------------------------------------------

FAMILY_WEIGHTS = {"dense": 30, "varlen": 18, "kvcache": 32, "standard": 3, "decode_plan": 5, "varlen_plan": 4,
                  "serving": 6}
GQA = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4), (3, 1), (1, 3), (2, 4), (4, 2), (8, 1), (1, 8), (2, 8))


class _Cycle:
    """The values of a list in shuffled rounds: over ``n * len(values)`` classes each value is
    drawn ``n`` times (every head dim, dtype, page size and new-token count gets its classes)."""

    def __init__(self, rng: random.Random, values):
        self.rng, self.values, self.queue = rng, list(values), []

    def __call__(self):
        if not self.queue:
            self.queue = list(self.values)
            self.rng.shuffle(self.queue)
        return self.queue.pop()


@dataclasses.dataclass
class _Cycles:
    """One :class:`_Cycle` per attribute that must be covered."""

    dtype: _Cycle
    head_dim: _Cycle
    gqa: _Cycle
    page_size: _Cycle
    seqlen_new: _Cycle

    @staticmethod
    def of(rng: random.Random, space: Space) -> _Cycles:
        # The tuned head dims (the Gluon kernels' and the tables' own) three times as often.
        head_dims = [*space.head_dims, *2 * [d for d in GLUON_HEAD_DIMS if d in space.head_dims]]
        return _Cycles(_Cycle(rng, space.dtypes), _Cycle(rng, head_dims), _Cycle(rng, GQA),
                       _Cycle(rng, (0, 0, 0, 0, *PAGE_SIZES)), _Cycle(rng, (1, 1, 1, *range(2, 17))))


def _scale(rng: random.Random, space: Space) -> str:
    scale = _weighted(rng, SCALE_WEIGHTS)
    while SCALES[scale][0] > space.max_seqlen:
        scale = "tiny"
    return scale


def _variant_flags(rng: random.Random, probability: float) -> dict:
    return dict(window=rng.random() < probability, softcap=rng.random() < probability,
                alibi=rng.choice(("heads", "batch")) if rng.random() < probability else None,
                sinks=rng.choice(("float32", "dtype")) if rng.random() < probability else None)


def _gqa(cycles: _Cycles, scale: str) -> tuple[int, int]:
    kv_heads, group = cycles.gqa()
    if scale in ("large", "huge"):  # long sequences: few heads (the reference holds every key)
        kv_heads, group = min(kv_heads, 2), min(group, 2)
    return kv_heads, group


def _layout(rng: random.Random, weights=None) -> str:
    return _weighted(rng, weights or {"contiguous": 55, "padded": 25, "transposed": 12, "offset": 8})


def _dense_class(rng, space, cycles, cid, family):
    scale = _scale(rng, space)
    kv_heads, group = _gqa(cycles, scale)
    head_dim = cycles.head_dim()
    dtype = cycles.dtype()
    flags = _variant_flags(rng, 0.25) if family == "dense" else {}
    sk_cat = rng.choice(CATEGORIES[1:]) if rng.random() > 0.1 else "one"
    sq_cat = rng.choice(CATEGORIES)
    cls = KernelClass(cid, family, dtype, head_dim, kv_heads, group, causal=rng.random() < 0.5,
                      lse=rng.random() < 0.5 if family == "dense" else True, layout=_layout(rng), scale=scale,
                      cats=(("seqlen_q", sq_cat), ("seqlen_k", sk_cat)), **flags)
    if family == "standard":
        # One softmax block per class: keys in (block / 2, block], or from 513 up for 1024.
        blocks = [b for b in (16, 32, 64, 128, 256, 512, 1024) if b // 2 < space.max_seqlen]
        block = 16 if sk_cat == "one" else rng.choice(blocks)
        cls = dataclasses.replace(cls, key_block=block, scale="tiny" if block < 1024 else "small")
    if family == "dense" and _gluon_class(rng, cls, space):
        return _for_gluon(rng, cls)
    return dataclasses.replace(cls, backend=_weighted(rng, {"auto": 70, "triton": 30}) if family == "dense" else "auto")


# Share of the dense and decode classes at the Gluon kernels' head dims made for those kernels
# (plain attention in bf16/fp16, TMA-compatible layouts; decode: at most 16 rows, pages of 16 keys
# or more), which the draws above would rarely give them.
GLUON_SHARE = 0.75


def _gluon_class(rng, cls: KernelClass, space: Space) -> bool:
    return space.gluon and cls.head_dim in GLUON_HEAD_DIMS and rng.random() < GLUON_SHARE


def _for_gluon(rng, cls: KernelClass) -> KernelClass:
    """``cls`` changed into a class the Gluon kernel of its family runs (``backend`` "gluon", or for
    prefill "auto" half the time: the automatic choice takes it too)."""
    changes = dict(window=False, softcap=False, alibi=None, sinks=None, leftpad=False,
                   dtype=cls.dtype if cls.dtype != "float32" else "bfloat16",
                   layout=cls.layout if cls.layout != "offset" else "contiguous")
    if cls.family == "dense":
        changes["backend"] = rng.choice(("gluon", "auto"))
    else:
        if cls.layout == "transposed":
            changes["layout"] = "padded"
        if 0 < cls.page_size < 16:
            changes["page_size"] = rng.choice((16, 32, 64, 128, 256))
        changes.update(group=max(1, min(cls.group, GLUON_DECODE_ROWS // cls.seqlen_new)), backend="gluon")
    return dataclasses.replace(cls, **changes)


def _varlen_class(rng, space, cycles, cid, family):
    scale = _scale(rng, space)
    kv_heads, group = _gqa(cycles, scale)
    flags = _variant_flags(rng, 0.25)
    # Sequences per launch: one, 2-15 or 17-31 (the kernel's BLOCK_B is a power of two >= 16).
    seqs = _weighted(rng, {"one": 10, "few": 75, "many": 15 if scale in ("tiny", "small") else 0})
    lse = rng.random() < 0.5
    cats = (("sequences", seqs), ("total_q", rng.choice(CATEGORIES[1:])))
    cls = KernelClass(cid, family, cycles.dtype(), cycles.head_dim(), kv_heads, group,
                      causal=rng.random() < 0.5, lse=lse, layout=_layout(rng, {"contiguous": 60, "padded": 25,
                                                                             "transposed": 10, "offset": 5}),
                      scale=scale, cats=cats, **flags)
    return dataclasses.replace(cls, backend="auto" if rng.random() < 0.8 else "triton")


def _decode_class(rng, space, cycles, cid, family):
    scale = _scale(rng, space)
    kv_heads, group = _gqa(cycles, scale)
    seqlen_new = cycles.seqlen_new() if family != "serving" else rng.choice((1, 1, 2, 4))
    page_size = cycles.page_size()
    if family == "serving" and page_size == 0:
        page_size = rng.choice(PAGE_SIZES)
    flags = _variant_flags(rng, 0.15) if family == "kvcache" else {}
    leftpad = family == "kvcache" and rng.random() < 0.12
    # One page per sequence (a block table of one column) only where the new tokens fit in it.
    single_page = 0 < page_size and seqlen_new <= page_size and scale == "tiny"
    batch_cats = CATEGORIES if space.max_batch >= 16 else CATEGORIES[:3]
    cats = (("capacity", rng.choice(CATEGORIES if single_page else CATEGORIES[1:])),
            ("pool", rng.choice(CATEGORIES[1:])), ("batch", rng.choice(batch_cats)))
    cls = KernelClass(cid, family, cycles.dtype(), cycles.head_dim(), kv_heads, group,
                      causal=rng.random() < 0.7 or family == "serving", lse=rng.random() < 0.4,
                      layout=_layout(rng, {"contiguous": 60, "padded": 30, "offset": 10}) if family != "serving"
                      else "contiguous",
                      scale=scale, cats=cats, page_size=page_size, seqlen_new=seqlen_new,
                      append=family == "serving" or rng.random() < 0.6,
                      splits=0 if rng.random() < 0.6 else rng.choice(FIXED_SPLITS), leftpad=leftpad, **flags)
    if family != "serving" and _gluon_class(rng, cls, space):
        return _for_gluon(rng, cls)
    backend = "auto" if family == "serving" else _weighted(rng, {"auto": 70, "triton": 30})
    return dataclasses.replace(cls, backend=backend)


_CLASS_MAKERS = {"dense": _dense_class, "standard": _dense_class, "varlen": _varlen_class,
                 "varlen_plan": _varlen_class, "kvcache": _decode_class, "decode_plan": _decode_class,
                 "serving": _decode_class}


def make_classes(seed: int, space: Space, count: int | None = None) -> list[KernelClass]:
    """The ``count`` (default ``space.classes``) kernel classes of ``seed``; every family has one."""
    rng = random.Random(f"{seed}/classes")
    count = count or space.classes
    families = list(FAMILY_WEIGHTS)
    while len(families) < count:
        families.append(_weighted(rng, FAMILY_WEIGHTS))
    rng.shuffle(families)
    cycles = _Cycles.of(rng, space)
    return [_CLASS_MAKERS[family](rng, space, cycles, cid, family) for cid, family in enumerate(families[:count])]


# --- configurations ------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    """One fuzzed call: its class and every free value (``values``, by name; JSON-friendly)."""

    seed: int
    index: int
    cls: KernelClass
    values: dict

    def label(self) -> str:
        shown = {k: v for k, v in self.values.items() if k not in ("lengths_q", "lengths_k", "cache_seqlens",
                                                                   "prompts", "leftpad")}
        for name in ("lengths_q", "lengths_k", "cache_seqlens", "prompts", "leftpad"):
            if name in self.values:
                seq = self.values[name]
                shown[name] = seq if len(seq) <= 8 else [*seq[:4], "...", *seq[-2:]]
        return " ".join(f"{k}={v}" for k, v in shown.items())


def class_of(seed: int, index: int, classes: list[KernelClass]) -> KernelClass:
    """Configuration ``index``'s class (the first draw of its generator)."""
    return classes[random.Random(f"{seed}/{index}").randrange(len(classes))]


def draw(seed: int, index: int, classes: list[KernelClass], space: Space) -> Config:
    """Configuration ``index`` of ``seed``: its class, then its free values."""
    rng = random.Random(f"{seed}/{index}")
    cls = classes[rng.randrange(len(classes))]
    values = _VALUE_DRAWERS[cls.family](rng, cls, space)
    values.update(_common_values(rng, cls))
    return Config(seed, index, cls, values)


def _common_values(rng: random.Random, cls: KernelClass) -> dict:
    """Softmax scale, input magnitude, the padding's contents and the variants' values."""
    values = {}
    r = rng.random()
    if r < 0.6:
        values["softmax_scale"] = None
    elif r < 0.9:
        values["softmax_scale"] = log_uniform(rng, 1e-2, 10.0)
    else:
        values["softmax_scale"] = rng.choice((1e-30, 1e-8, 1e3, 1e6, 1e12))
    # Logits: N(0, 1)-sized scores, or large ones (up to +-1e4) a tenth of the time.
    values["logit_scale"] = 1.0 if rng.random() < 0.9 else log_uniform(rng, 10.0, 1e4)
    values["fill"] = _weighted(rng, {"nan": 50, "inf": 15, "-inf": 10, "max": 10, "random": 15})
    if cls.window:
        values["window"] = (_window_side(rng), _window_side(rng))
        if values["window"] == (-1, -1):
            values["window"] = (rng.randrange(0, 64), -1)
    if cls.softcap:
        # bf16/fp16 caps compute tanh with one exp2: an absolute score error of ~2e-7 * softcap
        # (kernels/_softmax.py), so caps far above the scores, which only cost accuracy, stop at 100.
        top = 1e4 if cls.dtype == "float32" else 100.0
        values["softcap"] = rng.choice((log_uniform(rng, 0.3, 30.0), log_uniform(rng, 30.0, top)))
    if cls.sinks:
        values["sink_kind"] = _weighted(rng, {"normal": 70, "large": 10, "-inf": 10, "mixed": 10})
    if cls.alibi:
        values["alibi_kind"] = _weighted(rng, {"geometric": 60, "uniform": 30, "zero": 10})
    return values


def _window_side(rng: random.Random) -> int:
    return _weighted(rng, {-1: 25, 0: 15, rng.randrange(1, 65): 35, rng.randrange(64, 70000): 25})


def _batch(rng: random.Random, space: Space) -> int:
    return min(space.max_batch, _weighted(rng, {1: 40, 2: 30, 3: 15, 4: 10, 8: 5}))


def _dense_values(rng: random.Random, cls: KernelClass, space: Space) -> dict:
    lo, hi = SCALES[cls.scale]
    hi = min(hi, space.max_seqlen)
    if cls.family == "standard":
        lo, hi = (513, min(8192, space.max_seqlen)) if cls.key_block == 1024 else (cls.key_block // 2 + 1,
                                                                                    cls.key_block)
    seqlen_k = draw_length(rng, cls.cat("seqlen_k"), lo, hi)
    q_hi = hi if rng.random() < 0.6 else min(hi, 64)
    seqlen_q = 0 if rng.random() < 0.03 else draw_length(rng, cls.cat("seqlen_q"), min(lo, q_hi), q_hi)
    batch = _batch(rng, space)
    # Work bound: shorten the queries (within their category), then the batch.
    limit = space.max_work if cls.family != "standard" else min(space.max_work, 2**26)
    while seqlen_q > 1 and cls.heads * seqlen_q * seqlen_k > limit:
        shorter = snap(seqlen_q // 2, cls.cat("seqlen_q"), 1, seqlen_q - 1)
        if shorter >= seqlen_q:
            break  # the shortest length of the category
        seqlen_q = shorter
    batch = max(1, min(batch, limit // max(1, cls.heads * seqlen_q * seqlen_k)))
    rows = max(seqlen_q * cls.heads, seqlen_k * cls.kv_heads) * cls.head_dim  # elements per sequence
    batch = max(1, min(batch, space.max_cache // max(1, rows)))
    return {"batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}


def _varlen_values(rng: random.Random, cls: KernelClass, space: Space) -> dict:
    lo, hi = SCALES[cls.scale]
    hi = min(hi, space.max_seqlen)
    count = {"one": 1, "few": rng.randrange(2, 16), "many": rng.randrange(17, 32)}[cls.cat("sequences")]
    lengths_q, lengths_k = [], []
    for _ in range(count):
        k_len = 0 if rng.random() < 0.1 else draw_length(rng, rng.choice(CATEGORIES), 1, hi)
        q_len = 0 if rng.random() < 0.1 else draw_length(rng, rng.choice(CATEGORIES), 1, hi)
        lengths_q.append(q_len if rng.random() < 0.6 else min(q_len, k_len))
        lengths_k.append(k_len)
    # Bounded work (scores) and tensors (elements): halve the longest sequences.
    while cls.heads * sum(q * k for q, k in zip(lengths_q, lengths_k)) > space.max_work:
        longest = max(range(count), key=lambda b: lengths_k[b])
        lengths_k[longest] //= 2
    for lengths, heads in ((lengths_q, cls.heads), (lengths_k, cls.kv_heads)):
        while sum(lengths) * heads * cls.head_dim > space.max_cache:
            longest = max(range(count), key=lambda b: lengths[b])
            lengths[longest] //= 2
    # The category of total_q (the LSE's stride) is the class's: pad the last sequence to it.
    total = sum(lengths_q)
    lengths_q[-1] += snap(total, cls.cat("total_q"), total, total + 64) - total
    extra = rng.choice((0, 0, 0, 1, 37))  # max_seqlen_* may exceed the longest sequence
    return {"lengths_q": lengths_q, "lengths_k": lengths_k, "max_extra": extra,
            "validate": rng.random() < 0.15}


def _decode_values(rng: random.Random, cls: KernelClass, space: Space) -> dict:
    lo, hi = SCALES[cls.scale]
    hi = min(hi, space.max_seqlen)
    appended = cls.seqlen_new if cls.append else 0
    batch_cat = cls.cat("batch")
    batch = draw_length(rng, batch_cat, 1, min(space.max_batch, 16) if batch_cat != "m16" else 32)
    page = cls.page_size
    # Capacity per sequence: S_max (contiguous) or max_blocks * page_size, max_blocks in its category.
    want = max(draw_length(rng, rng.choice(CATEGORIES[1:]), max(lo, appended), max(hi, appended)), appended, 1)
    if page == 0:
        capacity = snap(want, cls.cat("capacity"), max(want, 1), want + 64)
    else:
        blocks = snap(-(-want // page), cls.cat("capacity"), max(1, -(-appended // page)), -(-want // page) + 16)
        capacity = blocks * page
    per_token = cls.kv_heads * cls.head_dim
    batch = max(1, min(batch, space.max_cache // max(1, capacity * per_token)))
    batch = snap(batch, batch_cat, 1, batch) if batch_cat != "one" else 1
    room = capacity - appended
    seqlens = []
    for _ in range(batch):
        r = rng.random()
        if r < 0.1:
            seqlens.append(0)
        elif r < 0.2:
            seqlens.append(room)
        else:
            seqlens.append(min(room, draw_length(rng, rng.choice(CATEGORIES), 1, max(room, 1))))
    values = {"batch": batch, "capacity": capacity, "cache_seqlens": seqlens, "validate": rng.random() < 0.15}
    if cls.family == "serving":  # prompts, then steps of seqlen_new tokens each, all within capacity
        steps = max(1, min(rng.randrange(1, 4), capacity // cls.seqlen_new))
        seqlens = [rng.randrange(0, capacity - steps * cls.seqlen_new + 1) for _ in range(batch)]
        values.update(prompts=seqlens, steps=steps)
        del values["cache_seqlens"]
        appended = steps * cls.seqlen_new
    if page:
        used = sum(-(-(n + appended) // page) for n in seqlens)
        blocks = capacity // page
        pool = snap(used + rng.choice((0, 1, 3, blocks)), cls.cat("pool"), max(used, 1), used + blocks + 64)
        values.update(pool=pool, unused_entries=_weighted(rng, {"-1": 60, "random": 40}))
    if cls.leftpad:
        values["leftpad"] = [rng.randrange(0, n + appended + 1) if rng.random() < 0.8 else 0 for n in seqlens]
    return values


_VALUE_DRAWERS = {"dense": _dense_values, "standard": _dense_values, "varlen": _varlen_values,
                  "varlen_plan": _varlen_values, "kvcache": _decode_values, "decode_plan": _decode_values,
                  "serving": _decode_values}
