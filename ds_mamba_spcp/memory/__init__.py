"""Memory for long sequences: where the block checkpoints live (``offload``)."""

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
]
