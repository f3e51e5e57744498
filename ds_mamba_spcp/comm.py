"""Every collective of the package, through ``deepspeed.comm``.

Raw functions post an operation and return a handle whose ``wait()`` gives the result, so the
algorithm code reads "post, compute, wait". Autograd wrappers (whose backward is the adjoint
collective) live with the code that needs them (ulysses.py, permute.py).
"""

from __future__ import annotations

import torch


def _dist():
    import deepspeed.comm as dist

    return dist


def group_rank_size(group) -> tuple[int, int]:
    """(rank in group, group size); a process that has no distributed backend is a group of one."""
    dist = _dist()
    if not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process_group was given but deepspeed.comm is not initialized")
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def global_rank(group, rank: int) -> int:
    """Global rank of ``rank`` in ``group`` (point-to-point peers are global ranks)."""
    dist = _dist()
    if group is None:
        return rank
    return dist.get_global_rank(group, rank)


class Gathered:
    """Handle of an all-gather: ``wait()`` returns (world, *shape) of the posted tensor."""

    def __init__(self, out, work, shape):
        self._out, self._work, self._shape = out, work, shape

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out.view(-1, *self._shape)


def all_gather(tensor: torch.Tensor, group, world: int, async_op: bool = True) -> Gathered:
    """Posts an all-gather of ``tensor`` over ``group`` (every rank passes the same shape)."""
    tensor = tensor.contiguous()
    if world == 1:
        return Gathered(tensor.clone(), None, tensor.shape)
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    work = _dist().all_gather_into_tensor(out, tensor.view(-1), group=group, async_op=async_op)
    return Gathered(out, work if async_op else None, tensor.shape)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """deepspeed.comm.all_to_all_single over ``group``: equal splits along dim 0."""
    return _dist().all_to_all_single(output, tensor, group=group, async_op=async_op)


def batch_isend_irecv(sends, recvs, group):
    """Posts point-to-point sends [(tensor, group rank)] and receives [(tensor, group rank)]
    together and returns the list of works to wait on."""
    dist = _dist()
    ops = [dist.P2POp(dist.isend, t, global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank(group, peer), group) for t, peer in recvs]
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)
