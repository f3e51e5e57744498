"""Memory per token of long training runs: where the block checkpoints live (``offload.py``: GPU budget
first, then a pinned host pool, the host memory checked before the run) and the tiled block recompute
(``tiled_block.py``: one block's transient memory no longer grows with the shard); both recompute under the
forward's autocast settings and RNG state (``recompute.py``); the causal-LM loss one tile of logits at a time
(``logits_loss.py``).

See docs/design.md, "Rooms", and docs/usage.md, "Tiled block recompute" and "Offloading the block checkpoints".
"""

from ds_mamba_spcp.memory.logits_loss import tiled_causal_lm_loss
from ds_mamba_spcp.memory.offload import (
    CheckpointOffloader,
    HostCheck,
    HostMemory,
    HostMemoryError,
    OffloadedCheckpoint,
    OffloadPlan,
    PinnedPool,
    block_checkpoint_bytes,
    check_host_memory,
    host_memory,
    plan_offload,
)
from ds_mamba_spcp.memory.tiled_block import tile_spans, tiled_block

__all__ = [
    "CheckpointOffloader",
    "HostCheck",
    "HostMemory",
    "HostMemoryError",
    "OffloadPlan",
    "OffloadedCheckpoint",
    "PinnedPool",
    "block_checkpoint_bytes",
    "check_host_memory",
    "host_memory",
    "plan_offload",
    "tile_spans",
    "tiled_block",
    "tiled_causal_lm_loss",
]
