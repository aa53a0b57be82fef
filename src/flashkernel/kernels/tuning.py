"""Launch parameters as data: the tuned tables of every kernel family, a heuristic fallback for
prefill, opt-in prefill autotuning.

Prefill: ``tuned/prefill.json``. Decode: ``tuned/decode.json``, read into a
:class:`DecodeTuning` (tile tables per cache layout, the split rules, where the Gluon kernel is
the default) that ``kernels/decode.py`` and the dispatch layer take as an argument, so tools
and tests pass their own instead of changing module constants. Each file's ``about`` field
documents its format.

Prefill tables: a GPU
is looked up by its device name, then by compute capability (``sm_90``: the H200 it was tuned
on and the H100), so a first call never waits on a search. A GPU with no entry gets
:func:`heuristic_tile_config`: the tuned shape family, cut down until it fits the device's
shared memory.

``FLASHKERNEL_TUNING_FILE=path.json`` merges a file of the same format over the shipped one
(per GPU key and section), e.g. one written by :func:`save_autotuned`.

Autotuning is opt-in: with ``FLASHKERNEL_AUTOTUNE=1`` in the environment (read at import), the first plain (no variant, not
packed) Triton-kernel prefill call of each (device, head dim, dtype, load path, causal) class
times :data:`CANDIDATES` on the call's own tensors (``triton.testing.do_bench`` medians) and
keeps the fastest for the rest of the process: that first call's shape decides for its class.
The Gluon kernel's rules are not autotuned.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import torch

from ._common import cuda_properties
from ._launch import spoil_recording

TABLE_FILE = Path(__file__).with_name("tuned") / "prefill.json"
DECODE_TABLE_FILE = Path(__file__).with_name("tuned") / "decode.json"
DEFAULT_GPU_KEY = "sm_90"  # the entry a GPU without its own takes for decode
USER_FILE_ENV = "FLASHKERNEL_TUNING_FILE"
AUTOTUNE_ENV = "FLASHKERNEL_AUTOTUNE"
SHARED_RESERVE = 2048  # bytes of shared memory beyond the tiles (mbarriers, compiler scratch)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # Triton's automatic warp specialization of the key loop


# Autotuning candidates and the heuristic's preference order, per padded head dim (largest first).
CANDIDATES = {
    16: [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 2), TileConfig(64, 64, 4, 3),
         TileConfig(64, 32, 4, 2)],
    32: [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 2), TileConfig(64, 64, 4, 3),
         TileConfig(64, 32, 4, 2)],
    64: [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 2), TileConfig(64, 64, 4, 3),
         TileConfig(64, 32, 4, 2)],
    128: [TileConfig(128, 128, 8, 3), TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 2), TileConfig(64, 64, 4, 3),
          TileConfig(64, 32, 4, 2)],
    256: [TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 3), TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2),
          TileConfig(32, 32, 4, 1)],
}


def shared_bytes(config: TileConfig, block_d: int, element_size: int = 2) -> int:
    """Shared memory of a Triton prefill tile config: Q, plus K and V per pipeline stage."""
    return (config.block_m + 2 * config.num_stages * config.block_n) * block_d * element_size


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


TRITON_SECTIONS = ("triton_pointer", "triton_tma")  # per head dim: merged entry by entry


def _merge_entry(base: dict, extra: dict) -> dict:
    """``extra`` over ``base``: Triton sections per head dim, any other section whole."""
    merged = dict(base)
    for section, value in extra.items():
        if section in TRITON_SECTIONS:
            merged[section] = {**base.get(section, {}), **value}
        else:
            merged[section] = value
    return merged


@functools.lru_cache(maxsize=None)
def load_tables() -> dict:
    """The shipped table, with ``$FLASHKERNEL_TUNING_FILE`` merged over it (cached): per GPU
    key, a section of the file replaces the shipped one, except the Triton sections, which are
    merged per head dim (so a file of a few autotuned head dims keeps the others)."""
    tables = json.loads(TABLE_FILE.read_text())
    user = os.environ.get(USER_FILE_ENV)
    if user:
        extra = json.loads(Path(user).read_text())
        for gpu, sections in extra.get("gpus", {}).items():
            tables["gpus"][gpu] = _merge_entry(tables["gpus"].get(gpu, {}), sections)
    return tables


def device_facts(device: torch.device) -> tuple[str, str, int]:
    """``(name, "sm_XY", opt-in shared memory per block)`` of a CUDA device."""
    props = cuda_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return props.name, f"sm_{props.major}{props.minor}", smem


def gpu_entry(name: str, arch: str) -> dict | None:
    """The table entry for a GPU: its compute capability's entry with the entry of its exact
    device name merged over it (:func:`_merge_entry`); None when neither exists."""
    gpus = load_tables()["gpus"]
    if name not in gpus and arch not in gpus:
        return None
    return _merge_entry(gpus.get(arch, {}), gpus.get(name, {}))


def heuristic_tile_config(block_d: int, shared_limit: int, element_size: int = 2) -> TileConfig:
    """For GPUs without a table entry: the first candidate (tuned shapes first) whose tiles fit
    ``shared_limit`` bytes of shared memory, with 2 KB to spare (barriers, compiler scratch)."""
    for config in CANDIDATES[block_d]:
        if shared_bytes(config, block_d, element_size) + SHARED_RESERVE <= shared_limit:
            return config
    return CANDIDATES[block_d][-1]


def triton_tile_config(device: torch.device, block_d: int, tma: bool) -> TileConfig:
    """The table's Triton prefill config for this device (heuristic when it has no entry)."""
    name, arch, smem = device_facts(device)
    entry = gpu_entry(name, arch) or {}
    section = entry.get("triton_tma" if tma else "triton_pointer", {})
    if str(block_d) in section:
        return TileConfig(*section[str(block_d)])
    return heuristic_tile_config(block_d, smem)


def gluon_rule(name: str, arch: str, head_dim: int, causal: bool, seqlen_k: int) -> dict | None:
    """The first Gluon rule of a GPU's table (by device name, else ``sm_XY``) matching the call."""
    rules = ((gpu_entry(name, arch) or {}).get("gluon") or {}).get(str(head_dim), [])
    for rule in rules:
        if "causal" in rule and rule["causal"] != causal:
            continue
        if "max_seqlen_k" in rule and seqlen_k > rule["max_seqlen_k"]:
            continue
        return rule
    return None


# --------------------------------------------------------------------------------------------
# Opt-in autotuning
# --------------------------------------------------------------------------------------------

_AUTOTUNED: dict[tuple, TileConfig] = {}


AUTOTUNE = os.environ.get(AUTOTUNE_ENV, "0") == "1"  # read once, at import


def autotune_enabled() -> bool:
    return AUTOTUNE


def autotuned(key: tuple) -> TileConfig | None:
    return _AUTOTUNED.get(key)


def autotune(key: tuple, launch, block_d: int, shared_limit: int, element_size: int) -> TileConfig | None:
    """Time ``launch(config)`` for every candidate that fits; keep and return the fastest.

    ``key`` identifies the call class (device, padded head dim, dtype, load path, causal). A
    candidate that does not compile or does not fit the GPU is skipped; any other error
    propagates. Returns None (the caller keeps the table's config) when none ran, or when the
    current stream is capturing a CUDA graph (timing synchronizes, which capture forbids).
    """
    import triton
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    if torch.cuda.is_current_stream_capturing():
        return None
    spoil_recording()  # this call's launches are timing runs, not a replayable sequence
    best, best_ms = None, float("inf")
    for config in CANDIDATES[block_d]:
        if shared_bytes(config, block_d, element_size) > shared_limit:
            continue
        try:
            ms = triton.testing.do_bench(lambda c=config: launch(c), warmup=10, rep=40, return_mode="median")
        except (OutOfResources, CompilationError):
            continue
        if ms < best_ms:
            best, best_ms = config, ms
    if best is not None:
        _AUTOTUNED[key] = best
    return best


def save_autotuned(path: str | Path) -> None:
    """Write the configs autotuned in this process as a ``FLASHKERNEL_TUNING_FILE`` (keyed by
    device name; per head dim and load path, the last tuned class wins)."""
    gpus: dict = {}
    for (index, block_d, _dtype, tma, _causal), config in _AUTOTUNED.items():
        name = device_facts(torch.device("cuda", index))[0]
        section = gpus.setdefault(name, {}).setdefault("triton_tma" if tma else "triton_pointer", {})
        section[str(block_d)] = [config.block_m, config.block_n, config.num_warps, config.num_stages]
    Path(path).write_text(json.dumps({"gpus": gpus}, indent=2) + "\n")


def clear_autotuned() -> None:
    _AUTOTUNED.clear()


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch parameters of the Triton decode kernel: a K and a V tile of
    ``block_n x D`` per pipeline stage."""

    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Everything the decode path decides by measurement (``tuned/decode.json``).

    Tables (``padded head dim -> DecodeConfig``): ``contiguous`` caches; pages of at least
    ``large_page`` keys use the contiguous table (one look-up per tile); ``small_pages``; the
    same two for 1-byte (quantized) caches, ``quantized_contiguous`` and ``quantized_small_pages``.
    Rules: automatic splits aim for one program per SM, over small pages two once each split
    still reads ``small_page_two_wave_tokens`` keys, over contiguous 1-byte caches (not large
    pages: not measured) ``quantized_contiguous_waves``; each split gets at least
    ``min_split_tokens`` of the capacity where the short-context rules were measured (bf16/fp16,
    head dim <= 128), ``unmeasured_min_split_tokens`` elsewhere, and at most
    ``max_auto_splits`` splits; eager steps that read at most ``merge_in_kernel_max_bytes`` of K
    and V, or (caches in q's dtype) have at most ``merge_in_kernel_max_splits`` splits, merge
    their splits in the decode kernel (``decode.merges_in_kernel``); splits of at
    most ``short_split_tokens`` keys use ``short_block_n``-key tiles; grids of more than a wave
    whose programs read at most ``multi_wave_max_tokens`` keys (or read small pages) use
    ``multi_wave_config``; at head dims padded to 128, contiguous or in small pages, with row
    tiles of 16, grids of more than ``multi_wave_resident_programs_per_sm`` (what
    ``multi_wave_config`` holds at once) and at most ``one_wave_resident_programs_per_sm``
    programs per SM use ``one_wave_config`` whatever their programs read, except over 1-byte
    caches, where grids of
    more than ``quantized_resident_programs_per_sm`` and at most
    ``quantized_multi_wave_resident_programs_per_sm`` programs per SM use
    ``quantized_multi_wave_config`` (scales per tensor or head, contiguous or small pages) and
    every other grid keeps the quantized table's tiles (short splits aside). Gluon:
    the default for paged caches at ``gluon_head_dims`` whose work items read at most
    ``gluon_max_item_tokens`` keys (a step that appends: only at batch <= ``gluon_append_max_batch``
    and batch x capacity >= ``gluon_append_min_batch_tokens``), with ``gluon_configs`` (``head dim
    -> (block_n, stages)``), over quantized caches too when ``gluon_quantized``.
    """

    contiguous: dict
    small_pages: dict
    quantized_contiguous: dict
    quantized_small_pages: dict
    quantized_contiguous_waves: int
    quantized_resident_programs_per_sm: int
    quantized_multi_wave_config: DecodeConfig
    quantized_multi_wave_resident_programs_per_sm: int
    large_page: int
    small_page_two_wave_tokens: int
    min_split_tokens: int
    unmeasured_min_split_tokens: int
    short_split_tokens: int
    short_block_n: int
    multi_wave_max_tokens: int
    multi_wave_config: DecodeConfig
    multi_wave_resident_programs_per_sm: int
    one_wave_config: DecodeConfig
    one_wave_resident_programs_per_sm: int
    max_auto_splits: int
    merge_in_kernel_max_bytes: int
    merge_in_kernel_max_splits: int
    gluon_head_dims: tuple
    gluon_max_item_tokens: int
    gluon_append_max_batch: int
    gluon_append_min_batch_tokens: int
    gluon_configs: dict
    gluon_quantized: bool

    def table(self, page_size: int, quantized: bool = False) -> dict:
        """The tile table for a cache layout (``page_size`` 0: contiguous) and element size
        (``quantized``: 1-byte entries)."""
        whole_tiles = page_size == 0 or page_size >= self.large_page
        if quantized:
            return self.quantized_contiguous if whole_tiles else self.quantized_small_pages
        return self.contiguous if whole_tiles else self.small_pages

    def __hash__(self) -> int:  # dict fields: hashed by identity (one object per loaded entry)
        return id(self)

    def __eq__(self, other) -> bool:
        return self is other

    @staticmethod
    def from_entry(entry: dict) -> DecodeTuning:
        triton_part, gluon_part = entry["triton"], entry["gluon"]
        rules = triton_part["rules"]

        def table(section):
            return {int(d): DecodeConfig(*v) for d, v in section.items()}

        return DecodeTuning(
            contiguous=table(triton_part["contiguous"]), small_pages=table(triton_part["small_pages"]),
            quantized_contiguous=table(triton_part["quantized"]["contiguous"]),
            quantized_small_pages=table(triton_part["quantized"]["small_pages"]),
            quantized_contiguous_waves=triton_part["quantized"]["contiguous_waves"],
            quantized_resident_programs_per_sm=triton_part["quantized"]["resident_programs_per_sm"],
            quantized_multi_wave_config=DecodeConfig(*triton_part["quantized"]["multi_wave_config"]),
            quantized_multi_wave_resident_programs_per_sm=triton_part["quantized"]["multi_wave_resident_programs_per_sm"],
            large_page=triton_part["large_page"],
            small_page_two_wave_tokens=rules["small_page_two_wave_tokens"],
            min_split_tokens=rules["min_split_tokens"],
            unmeasured_min_split_tokens=rules["unmeasured_min_split_tokens"],
            short_split_tokens=rules["short_split_tokens"], short_block_n=rules["short_block_n"],
            multi_wave_max_tokens=rules["multi_wave_max_tokens"],
            multi_wave_config=DecodeConfig(*rules["multi_wave_config"]),
            multi_wave_resident_programs_per_sm=rules["multi_wave_resident_programs_per_sm"],
            one_wave_config=DecodeConfig(*rules["one_wave_config"]),
            one_wave_resident_programs_per_sm=rules["one_wave_resident_programs_per_sm"],
            max_auto_splits=rules["max_auto_splits"],
            merge_in_kernel_max_bytes=rules["merge_in_kernel_max_bytes"],
            merge_in_kernel_max_splits=rules["merge_in_kernel_max_splits"],
            gluon_head_dims=tuple(gluon_part["head_dims"]), gluon_max_item_tokens=gluon_part["max_item_tokens"],
            gluon_append_max_batch=gluon_part["append_max_batch"],
            gluon_append_min_batch_tokens=gluon_part["append_min_batch_tokens"],
            gluon_configs={int(d): tuple(v) for d, v in gluon_part["configs"].items()},
            gluon_quantized=gluon_part["quantized"],
        )


@functools.lru_cache(maxsize=None)
def _decode_tuning_for(name: str, arch: str) -> DecodeTuning:
    gpus = json.loads(DECODE_TABLE_FILE.read_text())["gpus"]
    entry = gpus.get(name) or gpus.get(arch) or gpus[DEFAULT_GPU_KEY]
    return DecodeTuning.from_entry(entry)


def decode_tuning(device: torch.device | None) -> DecodeTuning:
    """The decode tuning of a CUDA ``device`` (None: the default entry, e.g. for the
    interpreter or offline compiles). Cached per GPU model."""
    if device is None or device.type != "cuda":
        return _decode_tuning_for("", DEFAULT_GPU_KEY)
    return _decode_tuning_of_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _decode_tuning_of_index(index: int) -> DecodeTuning:
    name, arch, _ = device_facts(torch.device("cuda", index))
    return _decode_tuning_for(name, arch)
