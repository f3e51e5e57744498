"""Block checkpoints in pinned host memory, GPU memory spent first, host memory checked before the run.

A model that recomputes every block in backward keeps one tensor per block, its input (batch, seqlen,
d_model). ``OffloadedCheckpoint`` places each one::

    forward, block i       x_i fits the GPU budget (running total of the kept ones)?  keep it on the GPU
                           else: pending; when x_{i+1} arrives, D2H on the copy stream into a pool slot
    backward, block i      x_i back: on the GPU already, prefetched, or H2D now (the compute stream waits
                           for that copy only); then the H2D of x_{i-1} is queued (prefetch: it starts when
                           the work queued before it is done), and block i is recomputed and differentiated
                           while it runs

The newest checkpoint never leaves the GPU (backward needs it first), so the host holds
``len(plan.on_host)`` checkpoints and the GPU the budget's, the newest and one prefetched. The recompute runs
under the forward's autocast settings and RNG state (``recompute.py``); a checkpoint modified in place
before backward raises (``_Saved``). Host slots are exact-size ``cudaHostRegister``'ed allocations, copied
into directly (``PinnedPool``; unlike PyTorch's pinned allocator, no power-of-two rounding: docs/usage.md,
"Offloading the block checkpoints"). Before the run ``plan_offload`` splits the checkpoints from their
shapes and ``check_host_memory`` raises ``HostMemoryError`` on every rank alike when the host cannot hold
them; the pool refuses to grow past the checked bytes. On CPU: synchronous copies into unpinned slots.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ds_mamba_spcp.memory.recompute import autocast_state, rng_state

GiB = 2**30
DEFAULT_HOST_HEADROOM_GIB = 8.0
PAGE = 4096


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 4 else f"{nbytes / 2**20:.1f} MiB"


class HostMemoryError(RuntimeError):
    """The host cannot hold the offloaded checkpoints: raised before the run (or by the pool)."""


# -- planning: which checkpoints stay on the GPU, what the host must hold ------------------------


def block_checkpoint_bytes(tokens: int, d_model: int, n_layers: int, itemsize: int, batch: int = 1) -> list[int]:
    """Bytes of each block's checkpoint (its input, (batch, tokens, d_model)), in forward order."""
    return [batch * tokens * d_model * itemsize] * n_layers


@dataclass(frozen=True)
class OffloadPlan:
    """Where each checkpoint of one forward pass goes (indices in forward order) and what it costs.

    ``on_gpu``: kept on the GPU within the budget. ``on_host``: copied to pinned host memory. ``newest``: the
    last checkpoint when the budget did not take it (never copied). ``host_bytes`` is per rank."""

    checkpoint_bytes: tuple[int, ...]
    gpu_budget_bytes: int
    on_gpu: tuple[int, ...]
    on_host: tuple[int, ...]
    newest: int | None

    @property
    def host_bytes(self) -> int:
        return sum(self.checkpoint_bytes[i] for i in self.on_host)

    @property
    def gpu_bytes(self) -> int:
        """Checkpoint bytes on the GPU at the end of forward, plus one prefetched in backward."""
        kept = sum(self.checkpoint_bytes[i] for i in self.on_gpu)
        newest = self.checkpoint_bytes[self.newest] if self.newest is not None else 0
        prefetch = max((self.checkpoint_bytes[i] for i in self.on_host), default=0)
        return kept + newest + prefetch

    def describe(self) -> str:
        n = len(self.checkpoint_bytes)
        newest = ", the newest on the GPU" if self.newest is not None else ""
        return (
            f"{n} block checkpoints: {len(self.on_gpu)} on the GPU within the budget of "
            f"{_size(self.gpu_budget_bytes)}, {len(self.on_host)} in host memory ({_size(self.host_bytes)} per "
            f"rank){newest}"
        )


def keeps_on_gpu(kept_bytes: int, nbytes: int, gpu_budget_bytes: int) -> bool:
    """The one rule, shared by the plan and the runtime: GPU first, while the kept bytes fit the budget."""
    return kept_bytes + nbytes <= gpu_budget_bytes


def plan_offload(checkpoint_bytes: Sequence[int], gpu_budget_bytes: int = 0) -> OffloadPlan:
    """Splits one forward pass's checkpoints between the GPU budget and the host (``OffloadPlan``)."""
    if gpu_budget_bytes < 0:
        raise ValueError(f"the GPU budget for checkpoints must be >= 0 bytes, got {gpu_budget_bytes}")
    sizes = tuple(int(b) for b in checkpoint_bytes)
    on_gpu, offloaded, kept = [], [], 0
    for i, nbytes in enumerate(sizes):
        if keeps_on_gpu(kept, nbytes, gpu_budget_bytes):
            on_gpu.append(i)
            kept += nbytes
        else:
            offloaded.append(i)
    newest = offloaded.pop() if offloaded and offloaded[-1] == len(sizes) - 1 else None
    return OffloadPlan(sizes, int(gpu_budget_bytes), tuple(on_gpu), tuple(offloaded), newest)


# -- the host's memory, and the check before the run ---------------------------------------------


@dataclass(frozen=True)
class HostMemory:
    """Bytes this process may still take: ``available = min(MemAvailable, cgroup limit - cgroup usage)``."""

    mem_available: int
    cgroup_free: int | None = None
    cgroup_limit: int | None = None
    source: str = "/proc/meminfo MemAvailable"

    @property
    def available(self) -> int:
        return self.mem_available if self.cgroup_free is None else min(self.mem_available, self.cgroup_free)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_free(root: str = "/sys/fs/cgroup") -> tuple[int | None, int | None, str | None]:
    """(limit - usage + inactive file cache, limit, path) of the tightest memory cgroup of this process."""
    best = (None, None, None)
    candidates = []
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0":  # cgroup v2: walk from this process's group up to the root
            path = os.path.join(root, parts[2].lstrip("/"))
            while path.startswith(root):
                candidates.append((os.path.join(path, "memory.max"), os.path.join(path, "memory.current"),
                                   os.path.join(path, "memory.stat"), "inactive_file"))  # fmt: skip
                if path == root:
                    break
                path = os.path.dirname(path)
    v1 = os.path.join(root, "memory")
    candidates.append((os.path.join(v1, "memory.limit_in_bytes"), os.path.join(v1, "memory.usage_in_bytes"),
                       os.path.join(v1, "memory.stat"), "total_inactive_file"))  # fmt: skip
    for limit_path, usage_path, stat_path, inactive_key in candidates:
        limit, usage = _read(limit_path), _read(usage_path)
        if limit is None or usage is None or not limit.isdigit() or int(limit) >= 2**60:
            continue  # "max" or v1's "no limit" (a page-rounded 2^63)
        inactive = 0
        for line in (_read(stat_path) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key and value.isdigit():
                inactive = int(value)
        free = max(0, int(limit) - int(usage) + inactive)  # inactive page cache is reclaimable
        if best[0] is None or free < best[0]:
            best = (free, int(limit), limit_path)
    return best


def host_memory() -> HostMemory:
    """What this host (and this process's cgroup, if it sets a limit) can still give."""
    available = None
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        raise RuntimeError("cannot read MemAvailable from /proc/meminfo: the host memory check needs Linux")
    free, limit, path = _cgroup_free()
    if free is None:
        return HostMemory(available)
    return HostMemory(available, free, limit, f"/proc/meminfo MemAvailable and {path}")


def ranks_per_host() -> int:
    """The ranks started on this host (torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))


@dataclass(frozen=True)
class HostCheck:
    """The verdict of ``check_host_memory``: bytes needed on this host against bytes available."""

    needed: int
    available: int
    plan: OffloadPlan
    local_ranks: int
    headroom: int
    ok: bool = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "ok", self.needed <= self.available)

    def fitting_budget(self) -> int | None:
        """The smallest GPU budget (bytes per rank) with which this host would hold the rest, or None when
        even keeping every checkpoint on the GPU would not do (the headroom alone does not fit)."""
        sizes, spare = self.plan.checkpoint_bytes, self.available - self.headroom
        budget = 0
        for k in range(len(sizes) + 1):
            budget = sum(sizes[:k])
            if plan_offload(sizes, budget).host_bytes * self.local_ranks <= spare:
                return budget
        return None

    def message(self) -> str:
        per_rank, n = self.plan.host_bytes, self.local_ranks
        budget = self.fitting_budget()
        gpu_fix = (
            f"keep more checkpoints on the GPU (--offload-gpu-budget-gib {budget / GiB:.2f} or more, if the GPU "
            "has the room)"
            if budget is not None
            else "lower --offload-host-headroom-gib"
        )
        return (
            f"offloading the block checkpoints needs {self.needed / GiB:.1f} GiB of host memory on this host, "
            f"{self.available / GiB:.1f} GiB are available: {n} rank(s) x {_size(per_rank)} of "
            f"checkpoints ({self.plan.describe()}) + {self.headroom / GiB:.1f} GiB headroom "
            f"(--offload-host-headroom-gib). Fixes: fewer tokens per rank (--seq-len), {gpu_fix}, or more ranks "
            "per sequence (sequence_parallel_size) over more hosts."
        )


def check_host_memory(
    plan: OffloadPlan,
    *,
    headroom_bytes: int = int(DEFAULT_HOST_HEADROOM_GIB * GiB),
    local_ranks: int | None = None,
    memory: HostMemory | None = None,
    process_group=None,
) -> HostCheck:
    """Raises ``HostMemoryError`` unless this host can hold ``plan`` for each of its ranks (plus the headroom);
    the ranks of ``process_group`` (default: all) agree on the largest need and the smallest availability, so
    all raise or none does. Returns the verdict."""
    local_ranks = ranks_per_host() if local_ranks is None else local_ranks
    memory = host_memory() if memory is None else memory
    needed = plan.host_bytes * local_ranks + headroom_bytes
    available = memory.available
    if plan.host_bytes == 0:
        needed = 0  # nothing goes to the host: nothing to check
    needed, available = _agree(needed, available, process_group)
    verdict = HostCheck(needed, available, plan, local_ranks, headroom_bytes)
    if not verdict.ok:
        raise HostMemoryError(verdict.message())
    return verdict


def _agree(needed: int, available: int, process_group) -> tuple[int, int]:
    """(max needed, min available) over the ranks of the group (the values themselves on one process)."""
    needed, negative = group_max([needed, -available], process_group)
    return needed, -negative


def group_max(values: list[int], process_group=None) -> list[int]:
    """Each of ``values`` maximised over the ranks of the group (default: all), in one all-reduce that every rank
    must enter; the values themselves on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [int(v) for v in values]
    backend = dist.get_backend(process_group)
    device = torch.device("cpu")
    if "nccl" in str(backend):  # before DeepSpeed sets each rank's device: the launcher's LOCAL_RANK says it
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    both = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=process_group)
    return [int(v) for v in both.tolist()]


# -- the pinned pool -----------------------------------------------------------------------------


def _register(nbytes: int) -> torch.Tensor:
    """An exact-size page-locked uint8 host buffer: an ordinary allocation, cudaHostRegister'ed, unregistered
    when the last view of it goes."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % PAGE  # page-aligned start: what cudaHostRegister has always accepted
    buf = raw[offset : offset + nbytes]
    buf.zero_()  # fault the pages in on torch's threads: registering present pages is faster than faulting them there
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 1))  # cudaHostRegisterPortable: pinned for every context
    if rc != 0:
        raise HostMemoryError(
            f"cudaHostRegister of {nbytes / GiB:.2f} GiB of host memory failed (cudaError {rc}): the host may be "
            "out of lockable memory; keep more checkpoints on the GPU (--offload-gpu-budget-gib) or use fewer tokens"
        )
    # on the view the pool keeps (``raw``'s Python object goes at return; its storage lives on in ``buf``)
    weakref.finalize(buf, cudart.cudaHostUnregister, buf.data_ptr())
    return buf


class PinnedPool:
    """Host slots reused from step to step. ``acquire(nbytes)`` lends a view of ``nbytes`` of the smallest free
    slot that holds them; when none does, the free slots (all smaller) are dropped and a slot of exactly
    ``nbytes`` is allocated. ``release`` takes the view back. Page-locked (``cudaHostRegister``) when ``pin``.
    ``limit_bytes`` caps what it holds (the bytes ``check_host_memory`` approved): past it, ``HostMemoryError``.

    Bound: a slot is allocated only when none is free, so ``reserved_bytes <= (most slots lent at once) x
    (largest request)``: steps of varying lengths hold at most the longest step's checkpoints. Slots made by
    ``reserve`` (a plan) are kept: a longer checkpoint, which the plan did not check, is refused instead.

    Every write into a slot is issued on its offloader's one copy stream, so a released slot can be lent again
    at once (stream order); a slot is dropped only after ``drain`` (the copy stream synchronised)."""

    def __init__(self, pin: bool, limit_bytes: int | None = None):
        self.pin, self.limit_bytes = pin, limit_bytes
        self.reserved_bytes = 0  # every slot's bytes (lent or free)
        self.in_use_bytes = 0  # the bytes lent (requests, not slot sizes)
        self.peak_in_use_bytes = 0
        self.drain: Callable[[], None] | None = None
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)  # slot size -> free slots
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its slot
        self._kept: set[int] = set()  # data_ptr of the slots ``reserve`` made: never dropped by a miss

    def acquire(self, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        fits = [size for size, slots in self._free.items() if slots and size >= nbytes]
        if fits:
            slot = self._free[min(fits)].pop()
        else:
            drop = [b for slots in self._free.values() for b in slots if b.data_ptr() not in self._kept]
            grown = self.reserved_bytes - sum(b.numel() for b in drop) + nbytes
            if self.limit_bytes is not None and grown > self.limit_bytes:
                kept = max((b.numel() for slots in self._free.values() for b in slots), default=0)
                raise HostMemoryError(
                    f"the pinned pool would grow to {grown / GiB:.2f} GiB, past the {self.limit_bytes / GiB:.2f} "
                    f"GiB checked before the run: a checkpoint of {_size(nbytes)} (the largest free slot: "
                    f"{_size(kept)}) differs from the plan. Plan for the longest sequence and the model that run "
                    "(plan_offload with its checkpoint bytes; examples/train.py: --seq-len)"
                )
            self._drop(drop)
            slot = _register(nbytes) if self.pin else torch.empty(nbytes, dtype=torch.uint8)
            self.reserved_bytes += nbytes
        self._lent[slot.data_ptr()] = slot
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return slot[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        if buf.numel() == 0:
            return
        slot = self._lent.pop(buf.data_ptr())
        self.in_use_bytes -= buf.numel()
        self._free[slot.numel()].append(slot)

    def keep(self, buf: torch.Tensor) -> None:
        """Marks the slot of a lent view as kept (``reserve``): a miss never drops it."""
        self._kept.add(buf.data_ptr())

    def _drop(self, slots: list[torch.Tensor]) -> None:
        if not slots:
            return
        if self.drain is not None:
            self.drain()
        gone = {b.data_ptr() for b in slots}
        for size in list(self._free):
            self._free[size] = [b for b in self._free[size] if b.data_ptr() not in gone]
            if not self._free[size]:
                del self._free[size]
        self._kept -= gone
        self.reserved_bytes -= sum(b.numel() for b in slots)

    def clear(self) -> None:
        """Drops the free slots, kept ones too (their memory goes back to the host once no view is left)."""
        self._drop([b for slots in self._free.values() for b in slots])


# -- the offloader: one per model, driven by OffloadedCheckpoint ---------------------------------


class _Saved:
    """One checkpoint: on the GPU (kept or pending), in a pool slot on the host, or fetched back. Like a tensor
    autograd saves, it must not be modified in place before backward: its version counter is read at the save,
    when the copy to the host is issued and at the restore, and any change raises."""

    __slots__ = ("__weakref__", "index", "nbytes", "shape", "dtype", "device", "where", "gpu", "slot",
                 "fetched", "owner", "generation", "version", "source", "copied_version")  # fmt: skip

    def __init__(self, owner: CheckpointOffloader, index: int, x: torch.Tensor, where: str):
        self.owner, self.index, self.where, self.generation = owner, index, where, owner.generation
        self.nbytes, self.shape, self.dtype, self.device = x.numel() * x.element_size(), x.shape, x.dtype, x.device
        self.gpu, self.slot, self.fetched = x.detach(), None, None  # detach() shares x's version counter
        self.version, self.source, self.copied_version = x._version, weakref.ref(x), None

    def check_version(self) -> None:
        """Raises if the checkpoint's tensor was modified in place since the save."""
        live = self.gpu if self.gpu is not None else self.source()
        for found in (self.copied_version, None if live is None else live._version):
            if found is not None and found != self.version:
                raise RuntimeError(
                    f"block checkpoint {self.index} of the forward pass (the block's input, shape "
                    f"{tuple(self.shape)}, {self.dtype}) has been modified by an inplace operation between the "
                    f"forward and its recompute in backward: it is at version {found}, it was saved at version "
                    f"{self.version}, so the recompute would start from other values than the forward's. Leave "
                    "a checkpointed block's input unmodified until backward (clone it before an in-place "
                    "operation), as torch.utils.checkpoint requires."
                )

    def __del__(self):  # a graph dropped without backward: give the slot and the budget back
        owner = self.owner
        if owner is not None and self.where != "done":
            owner._forget(self)


class CheckpointOffloader:
    """Places the block checkpoints of one model (module docstring). ``gpu_budget_bytes``: checkpoint bytes kept
    on the GPU before any goes to the host (0: all but the newest go). ``host_limit_bytes``: the most the pinned
    pool may allocate (``plan.host_bytes`` after ``check_host_memory``)."""

    def __init__(self, gpu_budget_bytes: int = 0, host_limit_bytes: int | None = None):
        if gpu_budget_bytes < 0:
            raise ValueError(f"gpu_budget_bytes must be >= 0, got {gpu_budget_bytes}")
        self.gpu_budget_bytes = int(gpu_budget_bytes)
        self.host_limit_bytes = host_limit_bytes
        # made at the first checkpoint, on its device (the model may move after this object is built)
        self.cuda, self.pool, self.copy_stream, self._device = False, None, None, None
        self._order: list[weakref.ref] = []  # this pass's checkpoints, in forward order
        self._pending: _Saved | None = None
        self._kept_bytes = 0
        self.generation = 0  # counts forward passes: a restore prefetches within its own pass only
        self.stats = defaultdict(int)

    def reserve(self, plan: OffloadPlan, pin: bool) -> None:
        """Allocates the pool's slots for ``plan`` now (page-locked when ``pin``: checkpoints on a GPU), so that
        a failure to pin shows before training and the first step allocates nothing."""
        if self.pool is None:
            self.pool = PinnedPool(pin=pin, limit_bytes=self.host_limit_bytes)
        slots = [self.pool.acquire(plan.checkpoint_bytes[i]) for i in plan.on_host]
        for slot in slots:
            self.pool.keep(slot)
            self.pool.release(slot)

    def _bind(self, device: torch.device) -> None:
        """At the first checkpoint: its device decides the copies (streams on CUDA) and the pool's pinning."""
        self.cuda = device.type == "cuda"
        if self.pool is None:
            self.pool = PinnedPool(pin=self.cuda, limit_bytes=self.host_limit_bytes)
        elif self.pool.pin != self.cuda:
            raise RuntimeError(f"the pool was reserved {'pinned' if self.pool.pin else 'unpinned'} but the checkpoints "
                               f"are on {device}: reserve(pin=...) must match the model's device")  # fmt: skip
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:  # before the pool drops a slot: the copies issued from it are done
            self.pool.drain = self.copy_stream.synchronize
        self._device = device

    # -- forward
    def save(self, x: torch.Tensor) -> _Saved:
        if self._device is None:
            self._bind(x.device)
        elif x.device != self._device:
            raise RuntimeError(f"a checkpoint on {x.device} after checkpoints on {self._device}: one offloader serves "
                               "one model on one device")  # fmt: skip
        if not self._live():
            self._order.clear()  # a new forward pass
            self.generation += 1
        self._start_pending()
        nbytes = x.numel() * x.element_size()
        if keeps_on_gpu(self._kept_bytes, nbytes, self.gpu_budget_bytes):
            saved = _Saved(self, len(self._order), x, "kept")
            self._kept_bytes += nbytes
            self.stats["kept"] += 1
        else:
            saved = _Saved(self, len(self._order), x, "pending")
            self._pending = saved
        self._order.append(weakref.ref(saved))
        self.stats["saved"] += 1
        return saved

    def saved_tensors_hooks(self, x: torch.Tensor):
        """A ``torch.autograd.graph.saved_tensors_hooks`` context in which a block that is its own checkpoint
        (``tiled_block``) saves its input ``x`` through this offloader; every other saved tensor (the tiles'
        small fp32 states) stays as saved."""

        like = (x.shape, x.dtype, x.device)  # not x itself: autograd keeps the hooks (and their cells) until backward

        def pack(t):
            if (t.shape, t.dtype, t.device) == like:
                return True, self.save(t)
            return False, t

        def unpack(packed):
            offloaded, value = packed
            return self.restore(value) if offloaded else value

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _live(self) -> bool:
        return any((s := r()) is not None and s.where != "done" for r in self._order)

    def _start_pending(self) -> None:
        """D2H of the pending checkpoint into a pool slot (on the copy stream on GPU); its GPU memory is
        free once the copy has run (record_stream)."""
        saved, self._pending = self._pending, None
        if saved is None or saved.where != "pending":
            return
        saved.copied_version = saved.gpu._version  # the values the copy takes: checked at the restore
        x = saved.gpu if saved.gpu.is_contiguous() else saved.gpu.contiguous()
        slot = self.pool.acquire(saved.nbytes)
        host = slot.view(saved.dtype).view(saved.shape)
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(self.copy_stream):
                host.copy_(x, non_blocking=True)
            x.record_stream(self.copy_stream)
        else:
            host.copy_(x)
        saved.gpu, saved.slot, saved.where = None, slot, "host"
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += saved.nbytes

    # -- backward
    def restore(self, saved: _Saved) -> torch.Tensor:
        """The checkpoint back on its device, for one use; then the previous one's H2D starts."""
        saved.check_version()
        if saved.where in ("kept", "pending"):
            x = saved.gpu
            if saved.where == "kept":
                self._kept_bytes -= saved.nbytes
            if self._pending is saved:
                self._pending = None
        else:
            if saved.where == "host":
                self._fetch(saved)
            x = saved.fetched
            if self.cuda:  # the compute stream waits for this H2D (and nothing after it: none is queued yet)
                torch.cuda.current_stream(x.device).wait_stream(self.copy_stream)
        saved.gpu = saved.fetched = None
        saved.where = "done"
        if saved.index > 0 and saved.generation == self.generation:
            previous = self._order[saved.index - 1]()
            if previous is not None and previous.where == "host":
                self._fetch(previous)  # prefetch: overlaps this block's recompute and backward
                self.stats["prefetched"] += 1
        return x

    def _fetch(self, saved: _Saved) -> None:
        """H2D of a host checkpoint into a fresh device tensor (on the copy stream on GPU); the slot goes back to the
        pool (the next write into it is ordered after this copy). The tensor is allocated on the compute stream; the
        copy waits for the compute work queued so far, so it runs while the block about to be recomputed runs."""
        x = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
        host = saved.slot.view(saved.dtype).view(saved.shape)
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(self.copy_stream):
                x.copy_(host, non_blocking=True)
        else:
            x.copy_(host)
        self.pool.release(saved.slot)
        saved.slot, saved.fetched, saved.where = None, x, "fetched"

    def _forget(self, saved: _Saved) -> None:
        if saved.where == "kept":
            self._kept_bytes -= saved.nbytes
        elif saved.where == "host" and saved.slot is not None:
            self.pool.release(saved.slot)
        if self._pending is saved:
            self._pending = None
        saved.gpu = saved.slot = saved.fetched = None
        saved.where = "done"


# -- the checkpoint function ---------------------------------------------------------------------


class _OffloadedCheckpoint(torch.autograd.Function):
    """fn(x, *rest) run without grad; x kept by the offloader; recomputed with grad in backward. ``dummy`` (an
    empty tensor that requires grad) makes the output require grad also when ``x`` does not (a frozen embedding)."""

    @staticmethod
    def forward(ctx, fn, offloader, preserve_rng, dummy, x, *rest):
        ctx.fn, ctx.offloader, ctx.rest, ctx.x_requires_grad = fn, offloader, rest, x.requires_grad
        ctx.autocast = autocast_state(x.device)
        ctx.rng = rng_state(x.device) if preserve_rng else None
        with torch.no_grad():
            out = fn(x, *rest)
        ctx.saved = offloader.save(x)
        return out

    @staticmethod
    def backward(ctx, dout):
        x = ctx.offloader.restore(ctx.saved)
        ctx.saved = None
        x = x.detach().requires_grad_(ctx.x_requires_grad)
        # the forward's function: its autocast settings (the backward usually runs outside autocast) and draws
        replay = ctx.rng.replay() if ctx.rng is not None else contextlib.nullcontext()
        with replay, ctx.autocast.context(), torch.enable_grad():
            out = ctx.fn(x, *ctx.rest)
        torch.autograd.backward(out, dout)
        return (None, None, None, None, x.grad if ctx.x_requires_grad else None) + (None,) * len(ctx.rest)


class OffloadedCheckpoint:
    """``checkpoint(block, x, *rest)``: a block checkpoint function (``MambaLM.checkpoint``) whose checkpoints
    (the hidden state ``x``, (batch, seqlen, d_model)) are placed by a ``CheckpointOffloader``. ``rest``
    (document labels, None) is kept as passed, without gradient. The block is recomputed once in backward
    under the forward's autocast settings, and its RNG states when ``preserve_rng_state``."""

    def __init__(self, offloader: CheckpointOffloader, preserve_rng_state: bool = True):
        self.offloader, self.preserve_rng_state = offloader, preserve_rng_state
        self._dummy = torch.empty(0, requires_grad=True)

    def __call__(self, fn: Callable, x: torch.Tensor, *rest):
        if not torch.is_grad_enabled():
            return fn(x, *rest)
        return _OffloadedCheckpoint.apply(fn, self.offloader, self.preserve_rng_state, self._dummy, x, *rest)
