"""Context parallelism: exact attention over a sequence sharded across the ranks of a
``torch.distributed`` process group (ring attention), and the helpers that shard and unshard.

* :func:`ring_flash_attn_func`: each rank passes its shard ``[B, S / W, H, D]``; keys and values
  travel round the ring while each rank attends its queries to them (``ring.py``).
* :func:`shard` / :func:`unshard` (dense), :func:`shard_varlen` / :func:`unshard_varlen`
  (packed batches) and :func:`shard_positions` (global positions, for RoPE), in the
  load-balanced ``"zigzag"`` layout or the ``"contiguous"`` one (``layout.py``).

Importing this module imports flashkernel's kernels: set ``TRITON_INTERPRET=1`` before it to run
them in Triton's CPU interpreter.
"""

from .layout import LAYOUTS, shard, shard_positions, shard_varlen, unshard, unshard_varlen
from .ring import ring_flash_attn_func, ring_flash_attn_varlen_func

__all__ = [
    "LAYOUTS",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "shard",
    "shard_positions",
    "shard_varlen",
    "unshard",
    "unshard_varlen",
]
