"""Training steps: forward and backward together, one attention layer and a small model.

Two sections of the backward suite (``python -m flashkernel.bench.backward --sections layer
model``, ``flashkernel bench backward``):

* ``layer``: one attention call and its gradients through autograd, the way a training step
  runs it: ``out = attention(q, k, v)`` then ``torch.autograd.grad(out, (q, k, v), dout)``,
  timed together (``do_bench`` median, L2 flushed between calls). flashkernel's
  ``flash_attn_func`` against ``scaled_dot_product_attention`` with its FLASH_ATTENTION and
  CUDNN_ATTENTION backends forced, at the backward table's shapes. FLOPs: forward + backward =
  3.5 x the forward's ``4 * B * H * S * S * D`` (halved when causal).
* ``model``: a training step of a random-weight Llama-3-8B-shaped model (``bench/models/
  llama3-8b.json``, 4 decoder layers, bf16): ``model(input_ids, labels=input_ids).loss
  .backward()`` with ``attn_implementation="fk_attention"`` against ``"sdpa"`` (PyTorch's own
  backend choice) and ``"sdpa"`` inside ``sdpa_kernel`` with each backend forced; the same
  weights for every provider. Wall time per step (synchronised), tokens per second; the loss
  of each provider, as a sanity check.
"""

from __future__ import annotations

import contextlib
import statistics
import time

from .results import format_table

LAYER_PROVIDERS = ("flashkernel", "sdpa-flash", "sdpa-cudnn")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
MODEL_PROVIDERS = ("flashkernel", "sdpa", "sdpa-flash", "sdpa-cudnn")
MODEL_NAME = "llama3-8b"
MODEL_LAYERS = 4
MODEL_BATCHES = ((4, 4096), (1, 16384))  # (batch, sequence length): 16k tokens per step


def layer_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    """Forward plus backward: 3.5 x ``4 * B * H * S * S * D``, halved when causal."""
    forward = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return 3.5 * (forward / 2 if causal else forward)


def _layer_call(provider: str, q, k, v, dout, causal: bool, scale: float):
    """A zero-argument call: the forward of ``provider`` on leaves ``q, k, v [B, S, H, D]`` and
    the gradients of all three."""
    import torch

    import flashkernel

    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    if provider == "flashkernel":
        def forward():
            return flashkernel.flash_attn_func(*leaves, causal=causal, softmax_scale=scale)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, SDPA_BACKENDS[provider])

        def forward():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(x.transpose(1, 2) for x in leaves), is_causal=causal, scale=scale)
            return out.transpose(1, 2)

    def call():
        return torch.autograd.grad(forward(), leaves, dout)

    return call


def layer_row(head_dim: int, causal: bool, seqlen: int, batch: int, heads: int, warmup_ms: int = 100,
              rep_ms: int = 500) -> dict:
    """One shape: per provider the median ms of forward + backward and TFLOP/s (or its error),
    flashkernel's ratios to each SDPA backend."""
    import torch

    from .measure import time_provider

    shape = (batch, seqlen, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    flops = layer_flops(batch, heads, seqlen, head_dim, causal)
    row = {"section": "layer", "head_dim": head_dim, "causal": causal, "seqlen": seqlen, "batch": batch,
           "heads": heads, "dtype": "bfloat16", "flops": flops}
    for provider in LAYER_PROVIDERS:
        time_provider(row, provider, lambda: _layer_call(provider, q, k, v, dout, causal, head_dim ** -0.5), flops,
                      warmup_ms, rep_ms)
    for provider in SDPA_BACKENDS:
        if f"{provider}_ms" in row and "flashkernel_ms" in row:
            row[f"vs_{provider}"] = row[f"{provider}_ms"] / row["flashkernel_ms"]
    del q, k, v, dout
    torch.cuda.empty_cache()
    return row


def _model_context(provider: str):
    """The ``sdpa_kernel`` context forcing ``provider``'s backend, or none."""
    if provider not in SDPA_BACKENDS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[provider]))


def _implementation(provider: str) -> str:
    from .e2e import FLASHKERNEL

    return FLASHKERNEL if provider == "flashkernel" else "sdpa"


def _step(model, ids):
    """One training step's forward and backward (no optimizer: the attention is what differs);
    returns the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def model_rows(batches=MODEL_BATCHES, layers: int = MODEL_LAYERS, rounds: int = 5, warmup: int = 2) -> list[dict]:
    """Per ``(batch, seqlen)``: a training step's wall time for each provider, the providers
    alternating over ``rounds`` rounds (order reversed every other round); median ms, tokens/s,
    loss, and flashkernel's speedup over each (ratio of medians)."""
    import torch

    from .e2e import build_model

    model = build_model(MODEL_NAME, layers)
    model.train()
    config = model.config
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for batch, seqlen in batches:
        ids = torch.randint(0, config.vocab_size, (batch, seqlen), device="cuda", generator=generator)
        seconds: dict[str, list[float]] = {p: [] for p in MODEL_PROVIDERS}
        losses: dict[str, float] = {}
        errors: dict[str, str] = {}
        for provider in MODEL_PROVIDERS:  # warm-up: compiles, cuDNN plans, the allocator's pools
            try:
                model.set_attn_implementation(_implementation(provider))
                with _model_context(provider):
                    for _ in range(warmup):
                        losses[provider] = _step(model, ids).item()
            except Exception as error:  # noqa: BLE001 - reported in the row
                errors[provider] = f"{type(error).__name__}: {str(error)[:200]}"
            torch.cuda.synchronize()
        for r in range(rounds):
            order = [p for p in MODEL_PROVIDERS if p not in errors]
            for provider in order if r % 2 == 0 else order[::-1]:
                model.set_attn_implementation(_implementation(provider))
                try:
                    with _model_context(provider):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        _step(model, ids)
                        torch.cuda.synchronize()
                        seconds[provider].append(time.perf_counter() - start)
                except Exception as error:  # noqa: BLE001 - reported in the row; the others go on
                    errors[provider] = f"{type(error).__name__}: {str(error)[:200]}"
                    torch.cuda.synchronize()
        row = {"section": "model", "model": MODEL_NAME, "layers": layers, "batch": batch, "seqlen": seqlen,
               "dtype": "bfloat16", "rounds": rounds}
        for provider in MODEL_PROVIDERS:
            if provider in errors:
                row[f"{provider}_error"] = errors[provider]
                continue
            ms = statistics.median(seconds[provider]) * 1e3
            row[f"{provider}_ms"] = ms
            row[f"{provider}_min_ms"] = min(seconds[provider]) * 1e3
            row[f"{provider}_tokens_per_s"] = batch * seqlen / (ms * 1e-3)
            row[f"{provider}_loss"] = losses[provider]
        for provider in MODEL_PROVIDERS[1:]:
            if f"{provider}_ms" in row and "flashkernel_ms" in row:
                row[f"vs_{provider}"] = row[f"{provider}_ms"] / row["flashkernel_ms"]
        rows.append(row)
        print(format_model_rows([row]), flush=True)
        del ids
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return rows


def format_layer_rows(rows: list[dict]) -> str:
    """Forward + backward of one layer: TFLOP/s per provider and flashkernel's speedups."""
    lines = [["hdim", "mask", "seqlen", *[f"{p} TF/s" for p in LAYER_PROVIDERS], "vs flash", "vs cudnn"]]
    for row in rows:
        cells = [str(row["head_dim"]), "causal" if row["causal"] else "none", str(row["seqlen"])]
        cells += [f"{row[p + '_tflops']:.1f}" if p + "_tflops" in row else "error" for p in LAYER_PROVIDERS]
        cells += [f"{row['vs_' + p]:.2f}x" if "vs_" + p in row else "-" for p in SDPA_BACKENDS]
        lines.append(cells)
    return format_table(lines[0], lines[1:], text_columns=0)


def format_model_rows(rows: list[dict]) -> str:
    """Training steps of the model: ms per step per provider and flashkernel's speedups."""
    lines = [["batch x seqlen", *[f"{p} ms" for p in MODEL_PROVIDERS], *[f"vs {p}" for p in MODEL_PROVIDERS[1:]]]]
    for row in rows:
        cells = [f"{row['batch']} x {row['seqlen']}"]
        cells += [f"{row[p + '_ms']:.1f}" if p + "_ms" in row else "error" for p in MODEL_PROVIDERS]
        cells += [f"{row['vs_' + p]:.2f}x" if "vs_" + p in row else "-" for p in MODEL_PROVIDERS[1:]]
        lines.append(cells)
    errors = [f"{row['batch']} x {row['seqlen']} {p}: {row[p + '_error']}" for row in rows for p in MODEL_PROVIDERS
              if p + "_error" in row]
    return "\n".join([format_table(lines[0], lines[1:], text_columns=0), *errors])
