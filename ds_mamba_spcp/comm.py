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
    rank = dist.get_rank(group=group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the process_group it was given; pass "
            "the sequence-parallel group this rank belongs to (each rank passes its own group)"
        )
    return rank, dist.get_world_size(group=group)


def global_rank(group, rank: int) -> int:
    """Global rank of ``rank`` in ``group`` (point-to-point peers are global ranks)."""
    dist = _dist()
    if group is None:
        return rank
    return dist.get_global_rank(group, rank)


def _current_stream(device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class Gathered:
    """Handle of an all-gather: ``wait()`` returns (world, *shape) of the posted tensor. It must be waited on
    from the stream current at the post (NCCL's ``work.wait()`` orders only the current stream); else it raises.
    """

    def __init__(self, out, work, shape, stream=None):
        self._out, self._work, self._shape, self._stream = out, work, shape, stream

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            if self._stream is not None and _current_stream(self._out.device) != self._stream:
                raise RuntimeError(
                    "an all-gather posted on one CUDA stream is being waited on from another; wait on the stream "
                    "that was current when it was posted"
                )
            self._work.wait()
            self._work = None
        return self._out.view(-1, *self._shape)


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """Gathers every rank's ``tensor`` into ``out`` (world * numel, rank order); returns the work handle.
    torch's ``all_gather_single`` where it exists (torch 2.13 warns at the old name deepspeed.comm 0.19.8 calls).
    """
    single = getattr(torch.distributed, "all_gather_single", None)
    if single is None:
        return _dist().all_gather_into_tensor(out, tensor, group=group, async_op=async_op)
    return single(out, tensor, group=group, async_op=async_op)


def all_gather(tensor: torch.Tensor, group, world: int, async_op: bool = True) -> Gathered:
    """Posts an all-gather of ``tensor`` over ``group`` (every rank passes the same shape)."""
    tensor = tensor.contiguous()
    if world == 1:
        return Gathered(tensor.clone(), None, tensor.shape)
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    work = all_gather_into(out, tensor.view(-1), group=group, async_op=async_op)
    stream = _current_stream(tensor.device) if async_op else None
    return Gathered(out, work if async_op else None, tensor.shape, stream)


class GatheredMany:
    """Handle of ``all_gather_many``: ``wait()`` returns one (world, *shape) tensor per posted tensor."""

    def __init__(self, handle: Gathered, parts):
        self._handle, self._parts = handle, parts

    def wait(self) -> list[torch.Tensor]:
        rows = self._handle.wait()  # [world, bytes per rank], uint8
        return [rows[:, a:b].view(dtype).view(-1, *shape) for a, b, dtype, shape in self._parts]


def all_gather_many(tensors, group, world: int, async_op: bool = True) -> GatheredMany:
    """Posts one all-gather of several tensors of any dtypes (their bytes packed in one buffer, each part at a
    multiple of 8 bytes, so that it is reinterpreted in place). Every rank passes the same shapes and dtypes."""
    chunks, parts, offset = [], [], 0
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        pad = (-raw.numel()) % 8
        chunks.append(raw if pad == 0 else torch.cat([raw, raw.new_zeros(pad)]))
        parts.append((offset, offset + raw.numel(), t.dtype, tuple(t.shape)))
        offset += raw.numel() + pad
    return GatheredMany(all_gather(torch.cat(chunks), group, world, async_op), parts)


def gather_ints(values: list[int], device, group, cp: int, width: int = 16) -> list[list[int]]:
    """Every rank's list of at most ``width - 1`` ints, in group rank order (one small all-gather, a host read).
    The buffer has a fixed size, so the collective is never mismatched: the caller compares the rows."""
    if len(values) > width - 1:
        raise AssertionError(f"{len(values)} values do not fit a buffer of {width}")
    buf = torch.full((width,), -7, dtype=torch.long)
    buf[0] = len(values)
    buf[1 : 1 + len(values)] = torch.tensor([int(v) for v in values], dtype=torch.long)
    rows = all_gather(buf.to(device), group, cp, async_op=False).wait().tolist()
    return [r[1 : 1 + r[0]] if 0 <= r[0] < width else r for r in rows]


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


class Received:
    """Handle of ``post_p2p``: ``wait()`` returns the received tensors, in the order their receives were given."""

    def __init__(self, works, buffers, sends, device):
        self._works, self._buffers, self._sends, self._device = works, buffers, sends, device

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works, self._sends = [], None  # the sends' buffers may go once they are done
        if self._device is None:
            return self._buffers
        return [b.to(self._device) for b in self._buffers]


def post_p2p(sends, receives, like: torch.Tensor, group) -> Received:
    """Posts point-to-point sends [(tensor, group rank)] and receives [(shape, group rank)] of ``like``'s dtype
    and device together (one ``batch_isend_irecv``). Between two ranks, messages match in the order each side
    posts them. gloo's point-to-point takes CPU tensors only, so there CUDA tensors travel through the host (a
    copy and a synchronisation each way; ranks sharing one GPU in tests); NCCL moves them directly."""
    import torch.distributed as tdist

    staged = like.is_cuda and tdist.get_backend(group) == "gloo"
    where = torch.device("cpu") if staged else like.device
    out = [(t.to(where).contiguous(), peer) for t, peer in sends]
    buffers = [torch.empty(shape, dtype=like.dtype, device=where) for shape, _ in receives]
    works = batch_isend_irecv(out, [(b, peer) for b, (_, peer) in zip(buffers, receives)], group)
    return Received(works, buffers, out, like.device if staged else None)


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """Group rank ``src``'s ``tensor`` on every rank of ``group`` (in place; returned)."""
    _dist().broadcast(tensor, global_rank(group, src), group=group)
    return tensor


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum over ``group`` of every rank's ``tensor`` (a new tensor)."""
    out = tensor.contiguous().clone()
    _dist().all_reduce(out, group=group)
    return out


def all_to_all_uneven(
    output: torch.Tensor, tensor: torch.Tensor, output_split_sizes, input_split_sizes, group, async_op: bool = False
):
    """deepspeed.comm.all_to_all_single with explicit splits along dim 0; a work to wait on when async.
    ``input_split_sizes[j]`` rows of ``tensor`` go to group rank j, ``output_split_sizes[i]`` rows of ``output``
    come from group rank i (Python ints, matching across ranks). Both tensors must be contiguous."""
    if not (output.is_contiguous() and tensor.is_contiguous()):
        raise ValueError("all_to_all_uneven needs contiguous input and output buffers")
    if sum(input_split_sizes) != tensor.shape[0] or sum(output_split_sizes) != output.shape[0]:
        raise ValueError(
            f"split sizes {list(input_split_sizes)} -> {list(output_split_sizes)} do not add up to the buffers' "
            f"{tensor.shape[0]} and {output.shape[0]} rows"
        )
    return _dist().all_to_all_single(
        output, tensor, output_split_sizes=list(output_split_sizes), input_split_sizes=list(input_split_sizes),
        group=group, async_op=async_op,
    )  # fmt: skip


# dtype -> small int, for the call descriptors compared across ranks
DTYPE_CODES = {torch.float64: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int32: 4, torch.int64: 5}


def shutdown() -> None:
    """Ends a script's distributed run: a barrier, then the process group is destroyed (a gloo rank exiting
    with its group alive can abort in teardown, exit -6). Does nothing without a backend."""
    dist = _dist()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def remove_deepspeed_shm_buffers(port: int, addr: str = "127.0.0.1", shm_dir: str = "/dev/shm") -> int:
    """Deletes the ~66 MB ``/dev/shm/deepspeed_allreduce_buffer_*_<addr>_<port>_*`` files DeepSpeed's CPU backend
    leaves per rank of a run on ``addr:port`` (never unlinked). Call it once every process of the run has exited.
    Returns the number of files removed.
    """
    import glob
    import os

    removed = 0
    for path in glob.glob(os.path.join(shm_dir, f"deepspeed_allreduce_buffer_*_{addr}_{port}_*")):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed
