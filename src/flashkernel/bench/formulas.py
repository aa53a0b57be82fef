"""FLOP and byte counts: the formulas behind every TFLOP/s, GB/s and steps/s figure.

Pure integer arithmetic, no torch. Shapes follow the public API: ``q [B, Sq, Hq, D]``,
``k, v [B, Sk, Hkv, D]``; causal masks are aligned bottom-right (query ``i`` sees key ``j`` iff
``j <= i + Sk - Sq``).
"""

from __future__ import annotations

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

PREFILL_FLOPS_FORMULA = (
    "FLOPs = 4 * B * Hq * D * visible_pairs; visible_pairs = Sq * Sk without a mask, "
    "sum_i max(0, min(Sk, i + Sk - Sq + 1)) with the bottom-right causal mask "
    "(= Sq * (Sq + 1) / 2 when Sq == Sk)"
)
DECODE_BYTES_FORMULA = (
    "bytes = K + V read once (2 * B * L * Hkv * D * e) + Q read + O written (2 * B * Sq * Hq * D * e)"
)
MODEL_STEP_FORMULA = (
    "bytes per decode step = layers * B * 2 * L * Hkv * D * e; steps/s bound = bandwidth / bytes"
)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype given by name (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Number of (query, key) pairs that the mask lets through, for one batch element and head.

    Causal (bottom-right): query ``i`` sees ``max(0, i + Sk - Sq + 1)`` keys (never more than
    ``Sk``, reached at the last query). Summing that arithmetic progression over the rows that
    see at least one key gives the closed form below.
    """
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    if not causal:
        return seqlen_q * seqlen_k
    first_row = max(0, seqlen_q - seqlen_k)  # rows before it see no key
    rows = seqlen_q - first_row
    first_count = first_row + seqlen_k - seqlen_q + 1
    return rows * (first_count + seqlen_k) // 2


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> int:
    """Matmul FLOPs of the forward pass: ``2 * D`` for ``q.k`` and ``2 * D`` for ``p.v`` per pair."""
    return 4 * batch * heads * head_dim * visible_pairs(seqlen_q, seqlen_k, causal)


def attention_io_bytes(batch: int, seqlen_q: int, seqlen_k: int, heads: int, kv_heads: int,
                       head_dim: int, elem_bytes: int) -> int:
    """Compulsory memory traffic: Q, K, V read once and O written once (the roofline's bytes)."""
    q_and_o = 2 * batch * seqlen_q * heads * head_dim
    k_and_v = 2 * batch * seqlen_k * kv_heads * head_dim
    return (q_and_o + k_and_v) * elem_bytes


def decode_bytes(batch: int, context: int, heads: int, kv_heads: int, head_dim: int,
                 elem_bytes: int, seqlen_q: int = 1) -> int:
    """Bytes one decode call must move: K and V of the cache read once, plus Q and O."""
    return attention_io_bytes(batch, seqlen_q, context, heads, kv_heads, head_dim, elem_bytes)


def model_decode_bytes_per_step(layers: int, batch: int, context: int, kv_heads: int,
                                head_dim: int, elem_bytes: int) -> int:
    """KV-cache bytes one decode step of a whole model reads: ``layers * B * 2 * L * Hkv * D * e``."""
    return layers * batch * 2 * context * kv_heads * head_dim * elem_bytes


def steps_per_second_bound(bandwidth_gbs: float, bytes_per_step: int) -> float:
    """Upper bound on decode steps/s when the KV cache must stream from memory once per step."""
    return bandwidth_gbs * 1e9 / bytes_per_step


def tflops(flops: int, ms: float) -> float:
    """TFLOP/s achieved by ``flops`` in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def gbps(num_bytes: int, ms: float) -> float:
    """GB/s (10^9 bytes per second) achieved by moving ``num_bytes`` in ``ms`` milliseconds."""
    return num_bytes / (ms * 1e-3) / 1e9


def arithmetic_intensity(flops: int, num_bytes: int) -> float:
    """FLOPs per byte: the x axis of the roofline."""
    return flops / num_bytes
