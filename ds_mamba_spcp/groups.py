"""Which process group shards a sequence: the explicit one, DeepSpeed's, or the world.

``resolve_sequence_process_group(None, config)`` looks, in order, for

1. DeepSpeed's sequence-parallel group (``deepspeed.utils.groups._get_sequence_parallel_group()``: the
   ``mpu`` handed to ``deepspeed.initialize``, or the device mesh it builds when the ds_config sets both
   ``data_parallel_size`` and ``sequence_parallel_size`` or ``mesh_param`` is passed), else the one
   ``parallel_state_sp.initialize_sequence_parallel`` created;
2. the world group, when its size equals the configured ``sequence_parallel_size``;

and otherwise raises a ValueError that says how to build a group and pass it.

The generation entries resolve theirs with ``generation_group``: the group given, else DeepSpeed's
sequence-parallel group, else the world (a world of ``torch.distributed.init_process_group`` alone included:
``adopt_torch_distributed``).
"""

from __future__ import annotations

import sys
from typing import Any

from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig, load_mamba_sp_config

_PARALLEL_STATE_SP = "deepspeed.runtime.sequence_parallel.parallel_state_sp"


def _dist():
    import deepspeed.comm as dist

    return dist


def deepspeed_sequence_parallel_group():
    """DeepSpeed's sequence-parallel group of this rank, or None when DeepSpeed has not made one."""
    from deepspeed.utils import groups

    try:
        # KeyError: no mpu with the method and no mesh; AssertionError: an mpu whose group is not
        # initialized yet; KeyError/RuntimeError/ValueError: a mesh without a "sequence_parallel" dim.
        group = groups._get_sequence_parallel_group()
    except (KeyError, AssertionError, RuntimeError, ValueError, AttributeError):
        group = None
    if group is not None:
        return group
    # initialize_sequence_parallel() ran but its module is not (yet) deepspeed.initialize's mpu: its group
    parallel_state_sp = sys.modules.get(_PARALLEL_STATE_SP)
    return getattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", None)


def adopt_torch_distributed() -> bool:
    """Initialises ``deepspeed.comm`` over an existing ``torch.distributed`` world (no new rendezvous); True
    when it did. Else ``deepspeed.comm``, which every collective here goes through, would report no backend and
    the ranks would each run alone."""
    import torch.distributed as tdist

    dist = _dist()
    if dist.is_initialized() or not tdist.is_available() or not tdist.is_initialized():
        return False
    dist.init_distributed(dist_backend=tdist.get_backend(), verbose=False)
    return True


_GROUP_OF_ONE: list = []  # this rank's group of one, made once per process


def group_of_one():
    """A process group holding this rank alone (a sequence shard of one rank: long_context at
    sequence_parallel_size 1): None without deepspeed.comm, the world when it has one rank, else the group of
    ``new_group([r])`` for this rank. Collective the first time in a world of several ranks: every rank calls
    it at the same point (a model's preparation)."""
    dist = _dist()
    if not dist.is_initialized():
        return None
    if dist.get_world_size() == 1:
        return dist.get_world_group()
    if not _GROUP_OF_ONE:
        rank = dist.get_rank()
        for r in range(dist.get_world_size()):
            group = dist.new_group([r])
            if r == rank:
                _GROUP_OF_ONE.append(group)
    return _GROUP_OF_ONE[0]


def generation_group(group=None):
    """The group a sharded prefill or generation runs over: ``group`` when given; else DeepSpeed's
    sequence-parallel group; else the world (adopted first: ``adopt_torch_distributed``). None (a group of one)
    without a distributed backend."""
    adopt_torch_distributed()
    dist = _dist()
    if group is None and dist.is_initialized():
        group = deepspeed_sequence_parallel_group()
        if group is None:
            group = dist.get_world_group()
    return group


def group_size(group) -> int:
    """Number of ranks in ``group`` (None: the world; 1 in a process without deepspeed.comm)."""
    dist = _dist()
    if not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a sequence process group was given but deepspeed.comm is not initialized")
        return 1
    return dist.get_world_size(group=group)


def resolve_sequence_process_group(sequence_process_group: Any, config: Any):
    """The process group that shards the sequence.

    ``sequence_process_group``: a group (returned as is) or None (looked up, see the module docstring).
    ``config``: anything :func:`~ds_mamba_spcp.config.load_mamba_sp_config` accepts. Returns a group handle
    for ``deepspeed.comm``, or None where deepspeed.comm is not initialized (a group of one). Raises ValueError
    when no group fits the configured size (the result's size is checked by ``validate_for_mixer``).
    """
    cfg = config if isinstance(config, MambaSequenceParallelConfig) else load_mamba_sp_config(config)
    want = cfg.resolved_sequence_parallel_size
    dist = _dist()
    if sequence_process_group is not None:
        if not dist.is_initialized():
            raise RuntimeError(
                "a sequence_process_group was given but deepspeed.comm is not initialized; call "
                "deepspeed.init_distributed() (or deepspeed.initialize) first."
            )
        return sequence_process_group
    if not dist.is_initialized():
        if want == 1:
            return None  # a single process is a group of one
        raise ValueError(
            f'"{SECTION}.sequence_parallel_size" is {want} but deepspeed.comm is not initialized, so there are '
            "no ranks to share the sequence with; launch with the deepspeed launcher (or torchrun) and call "
            "deepspeed.init_distributed() before the first forward."
        )
    group = deepspeed_sequence_parallel_group()
    if group is not None:
        return group
    world = dist.get_world_size()
    if world == want:
        return dist.get_world_group()
    if cfg.sequence_parallel_size is None:
        reason = (
            f'neither "{SECTION}.sequence_parallel_size" nor the top-level "sequence_parallel_size" is set, '
            f"and the world has {world} ranks"
        )
    else:
        reason = f"the config asks for sequence_parallel_size {want} but the world has {world} ranks"
    raise ValueError(
        f"cannot find a sequence-parallel process group: DeepSpeed has none, and {reason}. Either create one "
        "group per set of ranks that share a sequence and pass this rank's group, e.g. "
        "`groups = [deepspeed.comm.new_group(list(range(i, i + sp))) for i in range(0, world, sp)]` (every rank "
        "makes every group, in the same order) then `DistributedMamba2(mixer, groups[rank // sp], ds_config)`; "
        'or let DeepSpeed build it by setting both "sequence_parallel_size" and "data_parallel_size" in the '
        "ds_config passed to deepspeed.initialize; or, when every rank shares one sequence, set "
        f'"{SECTION}.sequence_parallel_size" to {world}.'
    )
