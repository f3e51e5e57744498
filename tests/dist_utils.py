"""One spawn helper for every multi-rank test: free port, gloo through deepspeed.comm, a timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, initialises
deepspeed.comm in each and returns the list of what ``fn(rank, world_size, *args)`` returned.
``backend="nccl"`` gives each rank its own GPU (cuda:rank) and NCCL instead of gloo;
``backend="gloo-cuda"`` puts every rank on GPU 0 with gloo (docs/design.md, "Traps": correctness runs
at cp > 1 on one GPU; gloo moves CUDA tensors for collectives but not for point-to-point).
If any rank raises, the others are killed (they may be waiting in a collective) and the error is
re-raised here with that rank's traceback; a run that outlives ``timeout`` fails the same way.
Rank functions report; the test process asserts. Verdicts computed inside ranks go through
``agree`` (an all-reduce) first, so every rank reaches the same conclusion.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, backend):
    shared = backend == "gloo-cuda"
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0" if shared else str(rank),
        LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    try:
        import deepspeed.comm as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
        if shared:
            torch.cuda.set_device(0)  # DeepSpeed would bind rank i to cuda:i from LOCAL_RANK
        dist.init_distributed(dist_backend="gloo" if shared else backend, verbose=False)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 600.0, backend: str = "gloo"):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks; returns their results.

    backend: "gloo" (CPU), "nccl" (rank r on cuda:r; needs world_size GPUs) or "gloo-cuda" (every rank
    on cuda:0 through gloo: correctness only, timings mean nothing)."""
    if backend not in ("gloo", "nccl", "gloo-cuda"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'gloo-cuda', got {backend!r}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, error = {}, None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and error is None:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
                if dead:
                    error = f"ranks {dead} died without reporting (exit codes {[procs[r].exitcode for r in dead]})"
                elif time.monotonic() > deadline:
                    silent = sorted(set(range(world_size)) - set(results))
                    error = f"timed out after {timeout:.0f} s with ranks {silent} silent"
                continue
            if status == "ok":
                results[rank] = payload
            else:
                error = f"rank {rank} raised:\n{payload}"
        if error is None:
            for p in procs:
                p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        remove_deepspeed_shm_buffers(port)  # DeepSpeed's CPU backend never unlinks them
    if error is not None:
        raise RuntimeError(error)
    return [results[r] for r in range(world_size)]


def agree(ok: bool) -> bool:
    """All-reduces a verdict (MIN over ranks) so that every rank reaches the same one."""
    import deepspeed.comm as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| in fp64 (inf when a has NaN/Inf)."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = b.norm().item()
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


def sharded_rel_err(local: torch.Tensor, ref_local: torch.Tensor) -> float:
    """Relative RMS error of a tensor sharded over the ranks: squared norms summed over ranks."""
    import deepspeed.comm as dist

    sq = torch.tensor(
        [(local.double() - ref_local.double()).square().sum().item(), ref_local.double().square().sum().item()],
        dtype=torch.float64,
    )
    dist.all_reduce(sq)
    return (sq[0] / sq[1]).sqrt().item()


def summed_rel_err(local: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error of a replicated input's gradient: the ranks' local contributions summed."""
    import deepspeed.comm as dist

    total = local.detach().double().clone()
    dist.all_reduce(total)
    return rel_err(total, ref)
