"""Which kernel serves a call, and why not another.

Three families, two backends each:

* prefill (``flash_attn_func``, ``flash_attn_varlen_func``): ``"triton"`` (``prefill.py``: every
  variant, packed sequences, any head dim, fp32, any GPU Triton supports, the interpreter) and
  ``"gluon"`` (``gluon/prefill.py``: plain attention, dense batches, Hopper, bf16/fp16, head dim
  64/128/256, TMA-compatible tensors);
* decode (``flash_attn_with_kvcache``): ``"triton"`` (``decode.py``: everything) and ``"gluon"``
  (``gluon/decode.py``: plain attention, Hopper, bf16/fp16, head dim 64/128/256, at most 16 rows
  of GQA group x new tokens, contiguous caches or pages of at least 16 keys, no key start,
  TMA-compatible caches, in q's dtype or quantized with scales per tensor or KV head);
* backward (``kernels/backward.attention_backward``, the gradients of the prefill ops):
  ``"triton"`` (``backward.py``: everything, bitwise reproducible) and ``"gluon"``
  (``gluon/backward.py``: plain or causal attention, dense batches, Hopper, bf16/fp16, head dim
  64/128, TMA-compatible inputs, not ``deterministic``: it sums dQ by TMA reductions).

``backend="auto"`` takes the Gluon kernel where it is supported and the policy wants it (prefill:
always, it was faster at every measured shape; decode: while a CUDA graph is being captured,
paged caches at the tuned head dims whose work items read at most
``DecodeTuning.gluon_max_item_tokens`` keys, see ``tuned/decode.json``, where its GPU time is
lower; a step that appends only at small batches that are not tiny (``gluon_decode_wanted``: the
Triton kernel fuses the append, the Gluon kernel launches it separately); quantized caches too
where ``DecodeTuning.gluon_quantized`` says so; eager calls keep the Triton kernel, chosen when
the Gluon kernel's eager launch still encoded its TMA descriptors per call, see docs/perf-notes.md
"Host TMA descriptors in the C launcher" for the comparison since; backward: from the key
lengths of :data:`GLUON_BACKWARD_MIN_SEQLEN_K`), else Triton. Naming a backend that cannot run
the call raises a ``ValueError`` with the reason from :func:`prefill_refusal` /
:func:`decode_refusal` / :func:`backward_refusal` (None when supported).

The environment is read once, at import (:data:`SETTINGS`): ``FLASHKERNEL_GLUON=0`` keeps
``"auto"`` on the Triton kernels.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from . import decode as triton_decode
from . import prefill as triton_prefill
from . import tuning
from ._common import cdiv, cuda_properties, is_interpreted, optional_kernel_module, tma_aligned
from ._softmax import Variant
from .tuning import DecodeTuning

BACKENDS = ("auto", "triton", "gluon")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Process-wide switches, read from the environment once."""

    gluon: bool = True  # FLASHKERNEL_GLUON: may "auto" pick the Gluon kernels?

    @staticmethod
    def from_environ() -> Settings:
        return Settings(gluon=os.environ.get("FLASHKERNEL_GLUON", "1") != "0")


SETTINGS = Settings.from_environ()


def check_backend(backend) -> None:
    """``backend`` must be one of :data:`BACKENDS` (a ValueError/TypeError naming it, if not)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {', '.join(map(repr, BACKENDS))}; "
                        f"got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


INTERPRETED = is_interpreted(triton_prefill._attention_fwd_kernel)  # fixed when the kernels are built


def interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return INTERPRETED


def _gluon_prefill_module():
    return optional_kernel_module("gluon.prefill")


def _gluon_decode_module():
    return optional_kernel_module("gluon.decode")


def gluon_backward_module():
    return optional_kernel_module("gluon.backward")


def _hopper_refusal(x: torch.Tensor) -> str | None:
    """Why a Gluon kernel cannot run on ``x``'s device, or None."""
    if interpreted() or x.device.type != "cuda":
        return "it needs a CUDA GPU (the interpreter and CPU tensors run the Triton kernel)"
    props = cuda_properties(x.device)
    if (props.major, props.minor) != (9, 0):
        return f"it needs a Hopper GPU (sm_90); {props.name} is sm_{props.major}{props.minor}"
    return None


def _gluon_refusal(q: torch.Tensor, gluon) -> str | None:
    """What every Gluon kernel needs: a Hopper GPU, Gluon itself (the module ``gluon``, None
    when it cannot be imported), bf16/fp16 and one of its head dims."""
    reason = _hopper_refusal(q)
    if reason is not None:
        return reason
    if gluon is None:
        return "triton.experimental.gluon (Triton 3.6) could not be imported"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it needs bfloat16 or float16 inputs, got {q.dtype}"
    if q.shape[-1] not in gluon.HEAD_DIMS:
        return f"it supports head dims {', '.join(map(str, gluon.HEAD_DIMS))}, got {q.shape[-1]}"
    return None


def _refuse(backend: str, reason: str | None) -> None:
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run this call: {reason}; use backend='auto' or 'triton'")


# ---- prefill -------------------------------------------------------------------------------------


def prefill_refusal(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant | None = None,
                    varlen: bool = False) -> str | None:
    """Why ``backend`` cannot run this (validated) prefill call, or None when it can. ``variant``:
    the call's window, softcap, ALiBi and sinks (None: plain attention)."""
    if backend == "triton":
        return None
    if varlen:
        return "packed sequences (flash_attn_varlen_func) run on the Triton kernel only"
    if variant is not None and not variant.is_plain:
        return "the Gluon prefill kernel runs plain attention only (no window, softcap, ALiBi or sinks)"
    gluon = _gluon_prefill_module()
    reason = _gluon_refusal(q, gluon)
    if reason is not None:
        return reason
    if not gluon.supported(q, k, v):
        return ("it needs TMA-compatible tensors: 16-byte aligned base addresses and strides, a "
                "contiguous last dim, no broadcast dims")
    return None


def prefill_backend(backend: str, q, k, v, variant: Variant, varlen: bool = False) -> str:
    """The backend that runs this call: ``backend`` itself, checked, or the choice of "auto"."""
    if backend == "auto":
        if SETTINGS.gluon and prefill_refusal("gluon", q, k, v, variant, varlen) is None:
            return "gluon"
        return "triton"
    _refuse(backend, prefill_refusal(backend, q, k, v, variant, varlen))
    return backend


def gluon_prefill_config(head_dim: int, causal: bool, seqlen_k: int, device: torch.device):
    """The Gluon prefill kernel's configuration for one call: the first matching rule of the
    device's table (``tuned/prefill.json``; the kernel's default config when none matches)."""
    name, arch, _ = tuning.device_facts(device)
    rule = tuning.gluon_rule(name, arch, head_dim, causal, seqlen_k)
    key = (id(rule), head_dim)  # built once per rule; the rule lives as long as the loaded tables
    cached = _GLUON_CONFIGS.get(key)
    if cached is None or cached[0] is not rule:
        cached = _GLUON_CONFIGS[key] = (rule, gluon_config_from(rule, head_dim))
    return cached[1]


_GLUON_CONFIGS: dict[tuple[int, int], tuple] = {}


def gluon_config_from(rule: dict | None, head_dim: int):
    """A ``gluon.prefill.GluonConfig`` from a table rule: its ``base`` configuration
    ("default", "persistent" or "d64_3wg") with the rule's other fields replaced.

    On the H200 (docs/perf-notes.md, "Prefill in Gluon"): causal runs a persistent grid at every
    length (pairs of query tiles per schedule unit; at d256 up to 8192 keys each warpgroup
    visits only the key tiles its own rows see; at d64 up to 8192 keys two consumer
    warpgroups taking turns, above that three). Without the mask, d128/d256 above 4096 keys run
    one program per query tile with the two consumer warpgroups taking turns on the tensor
    cores, up to 4096 keys a persistent grid; d64 three consumer warpgroups, persistent.
    """
    gluon = _gluon_prefill_module()
    if rule is None:
        return gluon.CONFIGS[head_dim]
    bases = {"default": gluon.CONFIGS[head_dim], "persistent": gluon.PERSISTENT_CONFIGS[head_dim],
             "d64_3wg": gluon.D64_3WG}
    fields = {key: value for key, value in rule.items() if key not in ("causal", "max_seqlen_k", "base")}
    return dataclasses.replace(bases[rule.get("base", "default")], **fields)


def prefill(q, k, v, out, lse, *, causal: bool, softmax_scale: float, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, sinks=None, backend: str = "auto") -> str:
    """Run a dense forward (``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]``, validated, all
    lengths >= 1) into ``out`` and ``lse`` (or None); returns the backend that ran it."""
    variant = Variant.of(causal, window_size, softcap, alibi_slopes, sinks)
    chosen = prefill_backend(backend, q, k, v, variant)
    if chosen == "gluon":
        config = gluon_prefill_config(q.shape[-1], variant.causal, k.shape[1], q.device)
        _gluon_prefill_module().launch(q, k, v, out, lse, causal=variant.causal, softmax_scale=softmax_scale,
                                       config=config)
    else:
        triton_prefill.attention_forward(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                         sinks=sinks)
    return chosen


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, *, causal: bool,
                   softmax_scale: float, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                   backend: str = "auto") -> str:
    """Run a packed forward (see ``prefill.varlen_forward``); returns the backend that ran it."""
    variant = Variant.of(causal, window_size, softcap, alibi_slopes, sinks)
    chosen = prefill_backend(backend, q, k, v, variant, varlen=True)
    triton_prefill.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                                  causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    return chosen


# ---- decode --------------------------------------------------------------------------------------


def decode_refusal(backend: str, q, k_cache, v_cache, block_table=None, variant: Variant | None = None,
                   cache_leftpad=None, k_scale=None) -> str | None:
    """Why ``backend`` cannot run this (validated) decode call, or None when it can. ``variant``:
    the call's window, softcap, ALiBi and sinks (None: plain attention)."""
    if backend == "triton":
        return None
    if k_scale is not None and k_scale.dim() == 3:
        return ("the Gluon decode kernel takes quantized caches with scales per tensor or per KV head only "
                "(per-token scales run on the Triton kernel)")
    if variant is not None and not variant.is_plain:
        return "the Gluon decode kernel runs plain attention only (no window, softcap, ALiBi or sinks)"
    if cache_leftpad is not None:
        return "the Gluon decode kernel has no per-sequence key start (cache_leftpad)"
    gluon = _gluon_decode_module()
    reason = _gluon_refusal(q, gluon)
    if reason is not None:
        return reason
    rows = q.shape[2] // k_cache.shape[2] * q.shape[1]
    if rows > gluon.BLOCK_M:
        return (f"it computes at most {gluon.BLOCK_M} rows per KV head (GQA group x new tokens), this call "
                f"has {rows}")
    page_size = triton_decode.CacheGeometry.of(k_cache, block_table).page_size
    if 0 < page_size < gluon.MIN_PAGE:
        return f"it needs pages of at least {gluon.MIN_PAGE} keys, got {page_size}"
    if not (tma_aligned(k_cache, broadcast=False) and tma_aligned(v_cache, broadcast=False)):
        return ("it needs TMA-compatible caches: 16-byte aligned base addresses and strides, a contiguous "
                "last dim, no broadcast dims")
    return None


def gluon_decode_wanted(page_size: int, head_dim: int, tokens_per_item: int, tuned: DecodeTuning,
                        append_batch_tokens: tuple[int, int] | None = None) -> bool:
    """The "auto" policy for a call the Gluon decode kernel supports, under CUDA-graph capture:
    paged caches at the tuned head dims whose work items (a split of one sequence and KV head)
    read at most ``tuned.gluon_max_item_tokens`` keys. Contiguous caches stay on the Triton
    kernel (docs/perf-notes.md, "Decode in Gluon"). A step that appends (``append_batch_tokens``
    = ``(batch, batch x capacity)``) pays the Gluon kernel a launch of its own for the append,
    which the Triton kernel fuses: it takes the Gluon kernel only at batch <=
    ``tuned.gluon_append_max_batch`` and batch x capacity >= ``tuned.gluon_append_min_batch_tokens``
    (docs/perf-notes.md, "Appending steps under capture")."""
    if append_batch_tokens is not None:
        batch, batch_tokens = append_batch_tokens
        if batch > tuned.gluon_append_max_batch or batch_tokens < tuned.gluon_append_min_batch_tokens:
            return False
    return (page_size > 0 and head_dim in tuned.gluon_head_dims
            and tokens_per_item <= tuned.gluon_max_item_tokens)


def gluon_decode_splits(q, k_cache, geometry, tuned: DecodeTuning) -> int:
    """Automatic splits of the Gluon decode kernel: one wave of work items."""
    gluon = _gluon_decode_module()
    config = gluon.config_for(q.shape[-1], tuned)
    return gluon.num_splits_for(q.shape[0] * k_cache.shape[2], geometry.capacity,
                                triton_decode.sm_count(q.device, False), config.block_n, tuned.min_split_tokens,
                                tuned.max_auto_splits)


def decode_backend(backend: str, q, k_cache, v_cache, block_table, variant: Variant, num_splits: int,
                   tuned: DecodeTuning, cache_leftpad=None, k_scale=None, appending: bool = False) -> str:
    """The backend that runs this decode call (see the module docstring); ``appending``: the call
    writes new keys and values first."""
    if backend == "auto":
        if (not SETTINGS.gluon or not variant.is_plain or cache_leftpad is not None or interpreted()
                or (k_scale is not None and not tuned.gluon_quantized)):
            return "triton"  # the cheap tests first: most calls stop here
        if not torch.cuda.is_current_stream_capturing():
            return "triton"  # an eager call (see the module docstring)
        geometry = triton_decode.CacheGeometry.of(k_cache, block_table)
        append = (q.shape[0], q.shape[0] * geometry.capacity) if appending else None
        if not gluon_decode_wanted(geometry.page_size, q.shape[-1], 0, tuned, append):
            return "triton"
        if decode_refusal("gluon", q, k_cache, v_cache, block_table, variant, cache_leftpad, k_scale) is not None:
            return "triton"
        splits = num_splits or gluon_decode_splits(q, k_cache, geometry, tuned)
        wanted = gluon_decode_wanted(geometry.page_size, q.shape[-1], cdiv(geometry.capacity, splits), tuned, append)
        return "gluon" if wanted else "triton"
    _refuse(backend, decode_refusal(backend, q, k_cache, v_cache, block_table, variant, cache_leftpad, k_scale))
    return backend


def decode(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, *, k_new=None, v_new=None, cache_leftpad=None,
           causal: bool, softmax_scale: float, num_splits: int = 0, window_size=(-1, -1), softcap=0.0,
           alibi_slopes=None, sinks=None, k_scale=None, v_scale=None, backend: str = "auto",
           tuned: DecodeTuning | None = None) -> str:
    """One decode step (validated inputs, B and T >= 1): append ``k_new, v_new`` when given
    (quantized with ``k_scale``/``v_scale`` over a quantized cache), then attend into
    ``out``/``lse``. Returns the backend that ran the attention."""
    if tuned is None:
        tuned = tuning.decode_tuning(q.device if q.device.type == "cuda" and not interpreted() else None)
    variant = Variant.of(causal, window_size, softcap, alibi_slopes, sinks)
    chosen = decode_backend(backend, q, k_cache, v_cache, block_table, variant, num_splits, tuned, cache_leftpad,
                            k_scale, appending=k_new is not None)
    appended = q.shape[1] if k_new is not None else 0
    if chosen == "gluon":
        if k_new is not None:
            triton_decode.append_kv(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale)
        geometry = triton_decode.CacheGeometry.of(k_cache, block_table)
        gluon = _gluon_decode_module()
        gluon.attend(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, page_size=geometry.page_size,
                     capacity=geometry.capacity, num_blocks=geometry.num_blocks, appended=appended,
                     causal=variant.causal, softmax_scale=softmax_scale,
                     num_splits=num_splits or gluon_decode_splits(q, k_cache, geometry, tuned),
                     config=gluon.config_for(q.shape[-1], tuned), sms=triton_decode.sm_count(q.device, False),
                     k_scale=k_scale, v_scale=v_scale)
    else:
        triton_decode.decode_forward(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, appended=appended,
                                     causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                     sinks=sinks, cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale,
                                     tuned=tuned, k_new=k_new, v_new=v_new)
    return chosen


def decode_length_family(q, k_cache, v_cache, k_new, block_table, k_scale, *, causal: bool, window_size, softcap: float,
                         alibi_slopes, sinks, num_splits: int, backend: str, tuned: DecodeTuning | None = None,
                         plans: dict | None = None, base=None):
    """For a validated decode call whose recorded launches could serve another cache length:
    ``(launch, lengths)``, the :class:`decode.DecodeLaunch` it runs and its
    ``decode.length_arguments``; None for other calls.

    ``plans``: the caller's memo of launches, by ``(base, cdiv(capacity, g))`` with ``base`` a
    key of everything but the caches' lengths and strides that the call's arguments fix, and
    ``g`` = ``decode.plan_span_step``: calls that agree on both plan the same launch.

    Such a call reads a contiguous cache and appends nothing (transformers' dynamic cache hands
    over a new, one-token-longer cache every step), on the Triton kernel: ``"auto"`` never takes
    the Gluon kernel for a contiguous cache, and ``"gluon"`` is left out. Two such calls whose
    other arguments have equal layouts and values, equal launches and equally specialized length
    arguments make the same launches but for the length arguments (``decode.rebind_lengths``)."""
    quantized = k_scale is not None
    if (block_table is not None or k_new is not None or (quantized and k_scale.dim() == 3)
            or backend == "gluon"):
        return None
    if quantized and triton_decode.value_operand(v_cache, True) is v_cache:
        return None  # V read byte-wise: whether it is depends on strides the family leaves out
    # decode_backend is not asked (its "auto" gives the Gluon kernel paged caches only): should that
    # policy change, decode.rebind_lengths still serves only replays of the Triton kernel.
    if tuned is None:
        tuned = tuning.decode_tuning(q.device)
    variant = Variant.of(causal, window_size, softcap, alibi_slopes, sinks)
    capacity = k_cache.shape[1]
    where = None if plans is None else (base, cdiv(capacity, triton_decode.plan_span_step(tuned)))
    launch = None if where is None else plans.get(where)
    if launch is None:
        geometry = triton_decode.CacheGeometry(0, capacity, k_cache.shape[0])
        launch = triton_decode.plan_decode(q, k_cache.shape[2], geometry, variant, num_splits, None, tuned,
                                           triton_decode.scale_args(k_scale)[0], interpreted())
        if where is not None:
            plans[where] = launch
    return launch, triton_decode.length_arguments(k_cache, v_cache, variant, q.shape[1], quantized)


# ---- backward ------------------------------------------------------------------------------------

# Where "auto" takes the Gluon backward: from this key length per (head dim, causal), the shortest
# length of the backward sweep (1k/4k/16k, bf16, 16k tokens per batch, model dim 2048;
# ``flashkernel bench backward``, ``benchmarks/results/h200/backward.json``) at which it beat the
# Triton kernels (in the committed run it wins at every point, by 1.34-1.66x).
# Shorter keys were not measured and keep the Triton kernels.
GLUON_BACKWARD_MIN_SEQLEN_K = {(64, False): 1024, (64, True): 1024, (128, False): 1024, (128, True): 1024}


def backward_refusal(backend: str, q, k, v, dout, grads, *, window_size, softcap, alibi_slopes, sinks, varlen: bool,
                     deterministic: bool, config) -> str | None:
    """Why ``backend`` cannot run this (validated) backward call, or None when it can."""
    if backend == "triton":
        return None
    if deterministic:
        return "deterministic=True needs the Triton kernels (the Gluon kernel adds dQ with float reductions)"
    if config is not None:
        return "a tile config selects the Triton kernels"
    if varlen:
        return "packed sequences run on the Triton kernels only"
    if not Variant.of(False, tuple(window_size), softcap, alibi_slopes, sinks).is_plain:
        return "the Gluon backward runs plain and causal attention only (no window, softcap, ALiBi or sinks)"
    gluon = gluon_backward_module()
    reason = _gluon_refusal(q, gluon)
    if reason is not None:
        return reason
    if not gluon.supported(q, k, v, dout, *grads):
        return ("it needs non-empty, TMA-compatible q, k, v, dout, dk and dv (16-byte aligned base addresses "
                "and strides, a contiguous last dim) of one dtype, and dq with a contiguous last dim")
    return None


def backward_backend(backend: str, q, k, v, dout, grads, *, causal: bool, window_size, softcap, alibi_slopes, sinks,
                     varlen: bool, deterministic: bool, config) -> str:
    """The backend that runs this backward call: ``backend`` itself, checked, or the choice of
    "auto": the Gluon kernel where it serves the call, the keys are at least
    :data:`GLUON_BACKWARD_MIN_SEQLEN_K` long and there is a program per SM (it does not split a
    GQA group over programs), else the Triton kernels."""
    check_backend(backend)
    refusal = backward_refusal("gluon" if backend == "auto" else backend, q, k, v, dout, grads,
                               window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                               varlen=varlen, deterministic=deterministic, config=config)
    if backend != "auto":
        _refuse(backend, refusal)
        return backend
    if refusal is not None or not SETTINGS.gluon:
        return "triton"
    programs = cdiv(k.shape[1], gluon_backward_module().BLOCK_N) * k.shape[0] * k.shape[2]
    wanted = gluon_backward_wanted(q.shape[-1], causal, k.shape[1], programs,
                                   cuda_properties(q.device).multi_processor_count)
    return "gluon" if wanted else "triton"


def gluon_backward_wanted(head_dim: int, causal: bool, seqlen_k: int, programs: int, sms: int) -> bool:
    """The rule of "auto" for a call the Gluon backward serves: keys at least
    :data:`GLUON_BACKWARD_MIN_SEQLEN_K` long and ``programs`` (key tiles x KV heads x batch) at
    least one per SM."""
    minimum = GLUON_BACKWARD_MIN_SEQLEN_K.get((head_dim, causal))
    return minimum is not None and seqlen_k >= minimum and programs >= sms
