"""One spawn helper for every multi-rank test: free port, gloo through deepspeed.comm, a timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, initialises
deepspeed.comm in each and returns the list of what ``fn(rank, world_size, *args)`` returned.
``backend="nccl"`` gives each rank its own GPU (cuda:rank) and NCCL instead of gloo;
``backend="gloo-cuda"`` puts every rank on GPU 0 with gloo (docs/design.md, "Traps": correctness runs
at cp > 1 on one GPU; gloo moves CUDA tensors for collectives but not for point-to-point).
If any rank raises, the others are killed (they may be waiting in a collective) and the error is
re-raised here with that rank's traceback; a run that outlives ``timeout`` fails the same way.
CPU ranks (gloo) start from a fork server that imported torch and DeepSpeed once for the whole test
session (``multiprocessing``'s "forkserver", ``_PRELOAD``): a fresh interpreter each, as with "spawn",
without each one's ~3 s of imports (the suite starts some 150 ranks on CI's two cores). Nothing of this
package, transformers, mamba-ssm or Triton is preloaded (tests/triton_cpu_shims.py must run before those
load), and each rank takes the test process's environment as it is at the call. GPU ranks are spawned.
Rank functions report; the test process asserts. Verdicts computed inside ranks go through
``agree`` (an all-reduce) first, so every rank reaches the same conclusion.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(*path: str):
    """A script of the repository (``load_script("benchmarks", "train_hf.py")``) imported as a module."""
    import importlib.util

    name = os.path.splitext(path[-1])[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Rendezvous ports (MASTER_PORT). A port from bind(("", 0)) comes from the kernel's ephemeral range, the
# range every outgoing connection's source port is drawn from too: between the moment it is chosen and
# freed here and the moment the launched rank 0 binds it (tens of seconds of imports on a loaded machine),
# any connection on the host (gloo's rank-to-rank sockets of other tests) may take it, and the run fails
# to bind. So ports come from just below that range, where the kernel never assigns one, and each is
# locked (flock on a file every test process on the host sees) for the life of the process that chose it,
# so two test processes never pick the same one. DeepSpeed's CPU backend names its /dev/shm buffers after
# the port and never unlinks them: the buffers a killed run left for this port are removed when it is
# reserved, so no run maps another's stale buffers.
_PORT_SPAN = 8000
_PORT_LOCKS = os.path.join(tempfile.gettempdir(), "ds_mamba_spcp_ports")
_held_ports: dict[int, int] = {}  # port -> the open lock file's descriptor (held: the lock lives with it)


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned ports (Linux default 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="utf-8") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def port_lock_path(port: int) -> str:
    return os.path.join(_PORT_LOCKS, f"{port}.lock")


def free_port() -> int:
    """A TCP port for one run's rendezvous, outside the ephemeral range, reserved for this process (see above)."""
    import fcntl
    import random

    low, _ = ephemeral_port_range()
    first = max(1024, low - _PORT_SPAN)
    os.makedirs(_PORT_LOCKS, exist_ok=True)
    candidates = list(range(first, low))
    random.shuffle(candidates)
    for port in candidates:
        if port in _held_ports:
            continue
        fd = os.open(port_lock_path(port), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # another test process holds it
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                os.close(fd)  # something else listens there
                continue
        _held_ports[port] = fd
        remove_deepspeed_shm_buffers(port)  # stale buffers of a killed run on this port
        return port
    raise RuntimeError(f"no free port in {first}-{low - 1} (below the ephemeral range) for a test run")


# what the fork server imports once (nothing that reads the test's environment or must follow triton_cpu_shims)
_PRELOAD = ["torch", "torch.multiprocessing", "deepspeed", "deepspeed.comm"]


def _context(backend: str):
    """Fork server for CPU ranks (preloaded, see the module docstring), spawn for GPU ones (CUDA and fork)."""
    if backend != "gloo":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call); later calls change nothing
    global _server_stop_registered
    if not _server_stop_registered:  # stopped and reaped at exit (else it outlives the test process as a zombie)
        import atexit
        from multiprocessing import forkserver

        atexit.register(forkserver._forkserver._stop)
        _server_stop_registered = True
    return ctx


_server_stop_registered = False


def _worker(rank, world_size, port, fn, args, queue, backend, init="deepspeed", env=None):
    if env is not None:  # the fork server's environment is the one it started with: the caller's, now
        os.environ.clear()
        os.environ.update(env)
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
        if init == "torch":  # torch.distributed alone, as a script that never calls deepspeed.init_distributed
            torch.distributed.init_process_group(backend="gloo" if shared else backend)
        else:
            dist.init_distributed(dist_backend="gloo" if shared else backend, verbose=False)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
        ends = dist if dist.is_initialized() else torch.distributed  # torch's alone: deepspeed.comm never adopted it
        ends.barrier()
        ends.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 600.0, backend: str = "gloo", init: str = "deepspeed"):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks; returns their results.

    backend: "gloo" (CPU), "nccl" (rank r on cuda:r; needs world_size GPUs) or "gloo-cuda" (every rank
    on cuda:0 through gloo: correctness only, timings mean nothing). init: "deepspeed"
    (``deepspeed.init_distributed``) or "torch" (``torch.distributed.init_process_group`` alone, deepspeed.comm
    left uninitialised)."""
    if backend not in ("gloo", "nccl", "gloo-cuda"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or 'gloo-cuda', got {backend!r}")
    if init not in ("deepspeed", "torch"):
        raise ValueError(f"init must be 'deepspeed' or 'torch', got {init!r}")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    ctx = _context(backend)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend, init, env))
        for r in range(world_size)
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
