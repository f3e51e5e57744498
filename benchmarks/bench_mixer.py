"""Mamba2 mixer core forward+backward under sequence parallelism: every mode against the ideal.

Launch one process per GPU (the group is the whole world, cp = number of processes):

    torchrun --nproc_per_node 2 benchmarks/bench_mixer.py --suite default --out benchmarks/results/h200x2.json
    deepspeed --num_gpus 2 benchmarks/bench_mixer.py --suite default --out ...
    torchrun --nproc_per_node 2 benchmarks/bench_mixer.py --cpu --out /tmp/bench_cpu.json   # gloo, seconds
    python3 benchmarks/bench_mixer.py --seqlens 128K:32K,32K:8K --modes ideal,state_passing,sp_cuda_graphs
        # one process (cp = 1): a group of one, in tiles of the length after the colon

What is timed: the mixer core after in_proj and before out_proj, forward and backward
(``torch.autograd.grad`` of the output w.r.t. zxbcdt and every parameter, with a fixed random
upstream gradient): causal conv1d + SiLU, the SSD scan, the D skip and the z gate y * silu(z).
The gated RMSNorm is left out by default so that ``ideal`` is the op docs/benchmarks.md times on one GPU
(``--rmsnorm`` adds it, as Mamba2's fused path does). Modes, per cell (global seqlen L, batch,
nheads, ngroups; cp = world size):

    ideal            the single-device op on one rank's share of the tokens: (batch, L/cp), all heads
    state_passing    mamba_split_conv1d_scan_sp, contiguous shards (load_balancing="none")
    sp_cuda_graphs   the same with the op's own CUDA-graph mode (cuda_graphs=True; a group of one only): the eager
                     timing is then the op replaying its captured forward and backward
    virtual          the same on zigzag shards, two causal segments per rank (load_balancing="virtual")
    permute_p2p      zigzag shards permuted to contiguous and back, point-to-point
    permute_a2a      the same with one all-to-all each way
    ulysses          mamba_split_conv1d_scan_ulysses: all-to-all to (L, nheads/cp) and back
    ulysses_compute  the single-device op on nheads/cp heads at the full length L (ulysses' compute)
    ulysses_a2a      the four raw all-to-alls ulysses moves in fwd+bwd (zxbcdt and out, and their grads)

Each cell reports the rank-maximum of the per-rank median of ``--iters`` timed iterations after
``--warmup`` warm-ups (CUDA events on GPU, perf_counter on CPU), the peak allocated memory of
each rank during the timed iterations, and, with ``--graphs``, the same with fwd+bwd captured in
one CUDA graph (static inputs) and replayed. Inputs are random local shards: the timing does not
depend on the values, so no global sequence is ever built (it would distort peak memory).

Every requested (cell, mode, eager/graph) gets a record: ``status`` is "ok", "oom", "error" or
"skipped" with a ``reason``. Rank 0 rewrites the JSON after every cell, so a run cut short still
leaves every finished cell. Known limit: a rank that fails in the middle of a collective sequence
while its peer waits in a collective leaves that peer waiting until ``--timeout`` (shapes are the
same on every rank, so an OOM normally strikes all ranks at the same point).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as a script from a checkout: make the package importable
    sys.path.insert(0, REPO)

import torch  # noqa: E402

SCHEMA = "ds_mamba_spcp.bench_mixer/1"
MODES = (
    "ideal", "state_passing", "virtual", "permute_p2p", "permute_a2a", "ulysses", "ulysses_compute", "ulysses_a2a",
)  # fmt: skip
EXTRA_MODES = ("sp_cuda_graphs",)  # asked for by name only (--modes): not in the default list
SP_LOAD_BALANCING = {"state_passing": "none", "virtual": "virtual", "permute_p2p": "permute_p2p",
                     "permute_a2a": "permute_a2a", "sp_cuda_graphs": "none"}  # fmt: skip
K = 1024


@dataclass(frozen=True)
class Cell:
    """One shape: global seqlen, batch and the head layout; docs > 0: packed rows of that many documents."""

    seqlen: int
    batch: int
    nheads: int
    ngroups: int
    docs: int = 0
    tile: int = 0  # > 0: the state-passing modes run in tiles of this many tokens (else --tile-length)

    def label(self) -> str:
        packed = f" docs={self.docs}" if self.docs else ""
        tiled = f" tile={_fmt_len(self.tile)}" if self.tile else ""
        return f"L={_fmt_len(self.seqlen)} b={self.batch} h={self.nheads} g={self.ngroups}{packed}{tiled}"


@dataclass(frozen=True)
class Dims:
    """The sizes every cell shares."""

    headdim: int
    dstate: int
    d_conv: int
    chunk_size: int
    dtype: str
    rmsnorm: bool


# Issue 5 item 2, most important cells first (the run may be cut short; the JSON is rewritten per cell).
_MAIN = [Cell(L * K, 1, 64, 8) for L in (8, 16, 32, 128)]
_REST = [Cell(L * K, 1, 64, 8) for L in (4, 64, 256)]
_BATCH3 = [Cell(L * K, 3, 64, 8) for L in (4, 8)]
_TP_LOCAL = [Cell(L * K, 1, 32, 4) for L in (32, 128)]
SUITES = {
    "default": _MAIN + _REST + _BATCH3 + _TP_LOCAL,
    "part1": _MAIN + _REST[:2],  # 8K 16K 32K 128K 4K 64K, batch 1
    "part2": _REST[2:] + _BATCH3 + _TP_LOCAL,  # 256K, batch 3, nheads=32
    "smoke": [Cell(8 * K, 1, 64, 8)],
    "cpu": [Cell(64, 1, 4, 2), Cell(128, 2, 4, 2)],
}
GPU_DIMS = dict(headdim=64, dstate=128, d_conv=4, chunk_size=128, dtype="bfloat16")
CPU_DIMS = dict(headdim=8, dstate=8, d_conv=4, chunk_size=8, dtype="float32")


class Skip(Exception):
    """A mode that cannot run for this cell, with the reason recorded."""


# ---------------------------------------------------------------------------------------------
# inputs and the fwd+bwd step of each mode
# ---------------------------------------------------------------------------------------------


@dataclass
class Context:
    rank: int
    cp: int
    device: torch.device
    backend: str
    dims: Dims
    seed: int = 1234
    recompute_output: bool = False  # the sp op's recompute_output (--recompute-output: True)
    check_shapes: bool = True  # the ops' cross-rank call check (--no-check-shapes: False)
    tile_length: int | None = None  # the sp op's tile_length (--tile-length)
    summary_exchange: str = "auto"  # the sp op's summary_exchange (--summary-exchange)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class CoreInputs:
    """Random mixer-core inputs shaped like Mamba2's: zxbcdt (batch, seqlen, d_in_proj) and the
    parameters, all requiring grad, plus a fixed upstream gradient of the output.

    zxbcdt, conv1d and dt_bias take the compute dtype; A and D are fp32 as Mamba2 builds them
    (A = -exp(A_log.float()), D is created in fp32). dt_bias follows Mamba2's init (softplus^-1
    of dt in [1e-3, 1e-1]), A in [-16, -1]."""

    def __init__(self, batch, seqlen, nheads, ngroups, ctx: Context):
        d, dev, dtype = ctx.dims, ctx.device, getattr(torch, ctx.dims.dtype)
        d_inner = nheads * d.headdim
        conv_dim = d_inner + 2 * ngroups * d.dstate
        self.headdim, self.ngroups, self.chunk_size = d.headdim, ngroups, d.chunk_size
        bound = 1.0 / math.sqrt(d.d_conv)
        self.zxbcdt = torch.randn(batch, seqlen, 2 * d_inner + 2 * ngroups * d.dstate + nheads, device=dev, dtype=dtype)
        self.conv1d_weight = (torch.rand(conv_dim, d.d_conv, device=dev) * 2 - 1).mul_(bound).to(dtype)
        self.conv1d_bias = (torch.rand(conv_dim, device=dev) * 2 - 1).mul_(bound).to(dtype)
        dt = torch.exp(torch.rand(nheads, device=dev) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(dtype)
        self.A = -(torch.rand(nheads, device=dev) * 15 + 1)
        self.D = torch.ones(nheads, device=dev)
        self.rmsnorm_weight = torch.ones(d_inner, device=dev, dtype=dtype) if d.rmsnorm else None
        self.leaves = [self.zxbcdt, self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A, self.D]
        if self.rmsnorm_weight is not None:
            self.leaves.append(self.rmsnorm_weight)
        for t in self.leaves:
            t.requires_grad_()
        self.dout = torch.randn(batch, seqlen, d_inner, device=dev, dtype=dtype)

    def args(self):
        return (self.zxbcdt, self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A, self.D, self.chunk_size)

    def kwargs(self):
        return dict(headdim=self.headdim, ngroups=self.ngroups, rmsnorm_weight=self.rmsnorm_weight)

    def fwd_bwd(self, forward):
        """The timed step: forward, then the gradients of every input (returned, then dropped)."""

        def step():
            out = forward()
            return torch.autograd.grad(out, self.leaves, self.dout)

        return step


def ulysses_local_groups(nheads: int, ngroups: int, cp: int) -> int:
    """Groups a rank holds after the ulysses all-to-all (B and C are replicated when cp > ngroups)."""
    if nheads % cp != 0:
        raise Skip(f"ulysses needs nheads % cp == 0, got nheads={nheads}, cp={cp}")
    if ngroups % cp == 0:
        return ngroups // cp
    if cp % ngroups == 0:
        return 1
    raise Skip(f"ulysses needs ngroups % cp == 0 or cp % ngroups == 0, got ngroups={ngroups}, cp={cp}")


def ulysses_payload_widths(cell: Cell, ctx: Context) -> tuple[int, int]:
    """Channels per token that one rank sends in the ulysses input and output all-to-alls.

    Input: z, x and dt split by head, B and C split by group (each destination gets
    2*dstate*max(ngroups/cp, 1) channels, replicated when cp > ngroups). Output: d_inner."""
    d = ctx.dims
    g_loc = ulysses_local_groups(cell.nheads, cell.ngroups, ctx.cp)
    d_inner = cell.nheads * d.headdim
    width_in = 2 * d_inner + cell.nheads + ctx.cp * 2 * g_loc * d.dstate
    return width_in, d_inner


def packed_labels(cell: Cell, ctx: Context, seq_layout: str):
    """This rank's shard of the document labels of ``cell.docs`` documents per row, or None (unpacked).

    Document lengths are random (one seed for every rank, a different draw per row), at least one
    chunk's worth apart on average, so documents start inside shards and chunks alike."""
    if not cell.docs:
        return None
    from ds_mamba_spcp.engine.layout import shard_sequence

    g = torch.Generator().manual_seed(ctx.seed)
    rows = []
    for _ in range(cell.batch):
        starts = torch.randperm(cell.seqlen - 1, generator=g)[: cell.docs - 1].add(1).sort().values
        rows.append(torch.bucketize(torch.arange(cell.seqlen), starts, right=True))
    labels = torch.stack(rows).to(torch.int32)
    return shard_sequence(labels, ctx.rank, ctx.cp, seq_layout).contiguous().to(ctx.device)


def build_step(mode: str, cell: Cell, ctx: Context):
    """The fwd+bwd callable of ``mode`` with its static inputs (raises Skip when unsupported)."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.ops import get_backend

    if cell.seqlen % (2 * ctx.cp) != 0:
        raise Skip(f"seqlen {cell.seqlen} is not a multiple of 2*cp = {2 * ctx.cp}")
    local = cell.seqlen // ctx.cp
    if mode == "ideal":
        inp = CoreInputs(cell.batch, local, cell.nheads, cell.ngroups, ctx)
        op = get_backend(ctx.backend, ctx.device).single_device_op
        labels = packed_labels(cell, ctx, "contiguous")
        packed = {}
        if labels is not None:
            from ds_mamba_spcp.ops.segment import canonical_seq_idx

            packed = dict(seq_idx=canonical_seq_idx(labels))
        return inp.fwd_bwd(lambda: op(*inp.args(), **inp.kwargs(), **packed))
    if mode in SP_LOAD_BALANCING:
        lb = SP_LOAD_BALANCING[mode]
        graphed = mode == "sp_cuda_graphs"
        if graphed and (ctx.cp > 1 or not ctx.cuda):
            raise Skip("the op's cuda_graphs mode runs a group of one on CUDA only")
        inp = CoreInputs(cell.batch, local, cell.nheads, cell.ngroups, ctx)
        labels = packed_labels(cell, ctx, "contiguous" if lb == "none" else "zigzag")
        return inp.fwd_bwd(
            lambda: mamba_split_conv1d_scan_sp(
                *inp.args(),
                load_balancing=lb,
                backend=ctx.backend,
                recompute_output=ctx.recompute_output,
                check_shapes=ctx.check_shapes,
                seq_idx=labels,
                tile_length=cell.tile or ctx.tile_length,
                summary_exchange=ctx.summary_exchange,
                **(dict(cuda_graphs=True) if graphed else {}),
                **inp.kwargs(),
            )
        )
    if mode == "ulysses":
        ulysses_local_groups(cell.nheads, cell.ngroups, ctx.cp)
        try:
            from ds_mamba_spcp.op import mamba_split_conv1d_scan_ulysses
        except ImportError as e:
            raise Skip(f"ds_mamba_spcp.op.mamba_split_conv1d_scan_ulysses is not importable: {e}") from e
        inp = CoreInputs(cell.batch, local, cell.nheads, cell.ngroups, ctx)
        labels = packed_labels(cell, ctx, "contiguous")
        return inp.fwd_bwd(
            lambda: mamba_split_conv1d_scan_ulysses(
                *inp.args(),
                input_layout="contiguous",
                backend=ctx.backend,
                check_shapes=ctx.check_shapes,
                seq_idx=labels,
                **inp.kwargs(),
            )  # fmt: skip
        )
    if mode == "ulysses_compute":
        g_loc = ulysses_local_groups(cell.nheads, cell.ngroups, ctx.cp)
        inp = CoreInputs(cell.batch, cell.seqlen, cell.nheads // ctx.cp, g_loc, ctx)
        op = get_backend(ctx.backend, ctx.device).single_device_op
        return inp.fwd_bwd(lambda: op(*inp.args(), **inp.kwargs()))
    if mode == "ulysses_a2a":
        return _a2a_step(cell, ctx)
    raise ValueError(f"unknown mode {mode!r}; modes are {MODES + EXTRA_MODES}")


def _a2a_step(cell: Cell, ctx: Context):
    """Four equal-split all-to-alls of the packed ulysses payload: zxbcdt and out forward, their
    gradients backward ([cp, batch, L/cp, width/cp] per rank, what the head re-shard moves)."""
    from ds_mamba_spcp import comm

    width_in, width_out = ulysses_payload_widths(cell, ctx)
    dtype = getattr(torch, ctx.dims.dtype)
    tokens = cell.batch * (cell.seqlen // ctx.cp)
    bufs = []
    for width in (width_in, width_out, width_out, width_in):  # zxbcdt, out | dout, dzxbcdt
        send = torch.randn(tokens * width, device=ctx.device, dtype=dtype)
        bufs.append((send, torch.empty_like(send)))

    def step():
        for send, recv in bufs:
            comm.all_to_all_single(recv, send, None)
        return [recv for _, recv in bufs]

    return step


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def _dist():
    import deepspeed.comm as dist

    return dist


def _sync(ctx: Context):
    if ctx.cuda:
        torch.cuda.synchronize()


def agree(ok: bool, ctx: Context) -> bool:
    """All ranks learn whether every rank succeeded (MIN all-reduce)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=ctx.device)
    dist = _dist()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def gather_row(values: list[float], ctx: Context) -> list[list[float]]:
    """Every rank's row of floats, (world, n)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    from ds_mamba_spcp import comm

    out = torch.empty(ctx.cp * t.numel(), dtype=torch.float64, device=ctx.device)
    comm.all_gather_into(out, t)
    return out.view(ctx.cp, -1).tolist()


def _reset_memory(ctx: Context):
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(ctx: Context):
    return torch.cuda.max_memory_allocated() / 2**30 if ctx.cuda else None


def _timed_loop(run, iters: int, ctx: Context):
    """Per-iteration device time (ms) and host time (ms) of ``run()``."""
    host = []
    if ctx.cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            t0 = time.perf_counter()
            start.record()
            run()
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events], host
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
    return list(host), host


def time_eager(step, args, ctx: Context) -> dict:
    """Warm-ups, then the timed iterations (peak memory of the timed ones only: Triton's
    autotuner allocates scratch during the first call)."""
    for _ in range(args.warmup):  # the first one also JIT-compiles and autotunes
        step()
    _sync(ctx)
    _reset_memory(ctx)
    _dist().barrier()
    times, host = _timed_loop(step, args.iters, ctx)
    return dict(times=times, host=host, peak=_peak_gib(ctx))


def time_graph(step, args, ctx: Context) -> dict:
    """Captures one fwd+bwd into a CUDA graph after side-stream warm-ups, then times replays.

    Capture is attempted on every rank and replayed only when every rank captured (a replay
    with collectives on one rank alone would hang its peer)."""
    _reset_memory(ctx)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph, error = torch.cuda.CUDAGraph(), None
    try:
        # thread_local: the NCCL watchdog thread's event queries must not invalidate the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_out = step()  # kept alive with the graph: its outputs live in the graph's pool
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        error = f"{type(e).__name__}: {e}"
    errors = [None] * ctx.cp
    _dist().all_gather_object(errors, error)
    if any(errors):
        first = next((r, e) for r, e in enumerate(errors) if e)
        raise GraphCaptureError(f"capture failed on rank {first[0]}: {first[1]}")
    for _ in range(args.warmup):
        graph.replay()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _dist().barrier()
    times, host = _timed_loop(graph.replay, args.iters, ctx)
    peak = _peak_gib(ctx)
    del static_out, graph
    return dict(times=times, host=host, peak=peak)


class GraphCaptureError(RuntimeError):
    pass


def _classify(e: BaseException) -> tuple[str, str]:
    if isinstance(e, Skip):
        return "skipped", str(e)
    if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
        return "oom", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if isinstance(e, (ImportError, NotImplementedError)):
        return "skipped", f"{type(e).__name__}: {e}"
    return "error", f"{type(e).__name__}: {e}"


def run_mode(mode: str, cell: Cell, args, ctx: Context) -> list[dict]:
    """The eager record (and the graph record with --graphs) of one mode in one cell."""
    base = dict(mode=mode, cp=ctx.cp, seqlen=cell.seqlen, batch=cell.batch, nheads=cell.nheads,
                ngroups=cell.ngroups, docs_per_row=cell.docs, tile_length=cell.tile or ctx.tile_length,
                **asdict(ctx.dims), iters=args.iters,
                warmup=args.warmup)  # fmt: skip
    flags = [False, True] if args.graphs else [False]
    records = {g: dict(base, cuda_graph=g) for g in flags}
    step, status, reason = None, "ok", None
    try:
        step = build_step(mode, cell, ctx)
        _sync(ctx)
    except Exception as e:  # noqa: BLE001
        status, reason = _classify(e)
        if status != "skipped":
            traceback.print_exc()
    if not agree(status == "ok", ctx):  # every rank skips together
        step = None
        status, reason = (status, reason) if status != "ok" else ("error", "failed on another rank")
    for g in flags:
        rec = records[g]
        if step is None:
            rec.update(status=status, reason=reason)
            continue
        if g and not ctx.cuda:
            rec.update(status="skipped", reason="CUDA graphs need CUDA")
            continue
        result, err = None, None
        try:
            result = (time_graph if g else time_eager)(step, args, ctx)
        except Exception as e:  # noqa: BLE001
            err = e
            if not isinstance(e, GraphCaptureError):
                traceback.print_exc()
        if not agree(err is None, ctx):
            st, why = _classify(err) if err is not None else ("error", "failed on another rank")
            if isinstance(err, GraphCaptureError):
                st = "error"
            rec.update(status=st, reason=why)
            _reset_memory(ctx)
            if st == "oom" and not g:
                step = None  # the graph would need the same memory
                status, reason = st, f"eager run: {why}"
            continue
        _fill_timing(rec, result, ctx)
    del step
    _reset_memory(ctx)
    return [records[g] for g in flags]


def _fill_timing(rec: dict, result: dict, ctx: Context):
    times, host = result["times"], result["host"]
    mine = [statistics.median(times), min(times), max(times), statistics.median(host),
            -1.0 if result["peak"] is None else result["peak"]]  # fmt: skip
    rows = gather_row(mine, ctx)
    rec.update(
        status="ok",
        fwd_bwd_ms=max(r[0] for r in rows),
        rank_median_ms=[r[0] for r in rows],
        rank_min_ms=[r[1] for r in rows],
        rank_max_ms=[r[2] for r in rows],
        host_ms=max(r[3] for r in rows),
        peak_mem_gib=None if result["peak"] is None else max(r[4] for r in rows),
        rank_peak_mem_gib=None if result["peak"] is None else [r[4] for r in rows],
    )


def add_derived(records: list[dict]):
    """Ratios within one cell and one eager/graph flag: pct_of_ideal = 100 * ideal / mode,
    speedup_vs_ulysses = ulysses / mode, mem_vs_ideal = peak / ideal peak, and for ulysses the
    bound it is judged against (ulysses_compute + ulysses_a2a)."""
    by = {}
    for r in records:
        if r.get("status") == "ok":
            by[(r["cuda_graph"], r["mode"])] = r
    for r in records:
        if r.get("status") != "ok" or r["mode"] in ("ulysses_compute", "ulysses_a2a"):
            continue
        g, ms = r["cuda_graph"], r["fwd_bwd_ms"]
        ideal, uly = by.get((g, "ideal")), by.get((g, "ulysses"))
        if ideal is not None:
            r["pct_of_ideal"] = 100.0 * ideal["fwd_bwd_ms"] / ms
            if r.get("peak_mem_gib") and ideal.get("peak_mem_gib"):
                r["mem_vs_ideal"] = r["peak_mem_gib"] / ideal["peak_mem_gib"]
        if uly is not None:
            r["speedup_vs_ulysses"] = uly["fwd_bwd_ms"] / ms
        if r["mode"] == "ulysses":
            comp, a2a = by.get((g, "ulysses_compute")), by.get((g, "ulysses_a2a"))
            if comp is not None and a2a is not None:
                r["ulysses_bound_ms"] = comp["fwd_bwd_ms"] + a2a["fwd_bwd_ms"]
                r["ulysses_over_bound"] = ms / r["ulysses_bound_ms"]


# ---------------------------------------------------------------------------------------------
# header, output, driver
# ---------------------------------------------------------------------------------------------


def _version(dist_name: str):
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*cmd):
    try:
        out = subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(git_commit=None) -> dict:
    """What every benchmark's JSON header starts with: the date, the commit (``--git-commit`` or HEAD), whether
    the tracked files differ from it, and the command line."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return dict(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        git_commit=git_commit or _git("rev-parse", "HEAD"),
        git_dirty=None if status is None else bool(status),
        command=" ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
    )


def versions(*dists: str) -> dict:
    """Python, torch and CUDA's versions, then each distribution's (None where it is not installed)."""
    out = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
    return {**out, **{name.replace("-", "_"): _version(name) for name in dists}}


def spawned_ranks(target, nranks: int, extra: tuple, give_up_at: float, on_message) -> str | None:
    """Runs ``target(rank, port, queue, *extra)`` in ``nranks`` spawned processes (gloo through a free local port)
    and hands each message they put on ``queue`` to ``on_message``, which returns None, ("done", rank) or
    ("error", text). Returns the first error, "ranks [...] died" or "timed out" (past ``give_up_at``: a rank stuck
    in a collective), else None once every rank is done. The processes are reaped and DeepSpeed's shared-memory
    buffers of the port removed in every case."""
    import queue as queue_mod
    import socket

    import torch.multiprocessing as mp

    from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, queue, *extra)) for r in range(nranks)]
    for p in procs:
        p.start()
    done, error = set(), None
    try:
        while len(done) < nranks and error is None:
            try:
                message = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]
                if dead or time.time() > give_up_at:
                    error = f"ranks {dead} died" if dead else "timed out"
                continue
            verdict = on_message(message)
            if verdict is not None and verdict[0] == "done":
                done.add(verdict[1])
            elif verdict is not None:
                error = verdict[1]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        remove_deepspeed_shm_buffers(port)  # DeepSpeed's CPU backend never unlinks them
    return error


# environment variables that change what a run measures
ENV_RECORDED = ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES", "NCCL_ALGO", "MAMBA_DETERMINISTIC")
ENV_RECORDED += ("DS_MAMBA_SPCP_STATE_PASSING",)


def environment(args, ctx: Context) -> dict:
    backend_module = None
    try:
        from ds_mamba_spcp.ops import get_backend

        backend_module = get_backend(ctx.backend, ctx.device).__name__
    except Exception as e:  # noqa: BLE001
        backend_module = f"unavailable: {e}"
    hardware = dict(
        device=ctx.device.type,
        world_size=ctx.cp,
        cpu=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        hostname=platform.node(),
    )
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        hardware.update(
            gpu_name=torch.cuda.get_device_name(ctx.device),
            gpu_count=ctx.cp,
            gpus_visible=torch.cuda.device_count(),
            gpu_mem_gib=round(props.total_memory / 2**30, 1),
        )
    nccl = None
    if ctx.cuda:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            nccl = None
    return dict(
        **provenance(args.git_commit),
        hardware=hardware,
        versions={**versions(), "nccl": nccl, **versions("triton", "deepspeed", "mamba_ssm", "causal_conv1d")},
        backend=ctx.backend,
        backend_module=backend_module,
        env={k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
    )


def write_json(path: str, payload: dict):
    """Atomic rewrite: a run killed mid-write keeps the previous complete file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _fmt_len(n: int) -> str:
    return f"{n // K}K" if n % K == 0 and n >= K else str(n)


def _parse_len(s: str) -> int:
    s = s.strip().upper()
    return int(s[:-1]) * K if s.endswith("K") else int(s)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny shapes on gloo with the reference backend (seconds)")
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="a named list of cells (default: 'default' on GPU, 'cpu' with --cpu); "
                        "'part1' + 'part2' = 'default' split in two device calls")  # fmt: skip
    p.add_argument("--seqlens", default=None,
                   help="custom cells: global seqlens, comma separated (4096 or 4K); 32K:8K also sets the cell's "
                        "tile length for the state-passing modes (else --tile-length)")  # fmt: skip
    p.add_argument("--batch", type=int, default=None, help="custom cells: batch (default 1)")
    p.add_argument("--nheads", type=int, default=None, help="custom cells: nheads (default 64; 4 with --cpu)")
    p.add_argument("--ngroups", type=int, default=None, help="custom cells: ngroups (default 8; 2 with --cpu)")
    p.add_argument("--headdim", type=int, default=None)
    p.add_argument("--dstate", type=int, default=None)
    p.add_argument("--d-conv", type=int, default=None)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), default=None)
    p.add_argument("--rmsnorm", action="store_true", help="include the gated RMSNorm (norm after the gate)")
    p.add_argument(
        "--docs-per-row",
        default="0",
        help="packed cells: comma separated documents per row (0: unpacked, no seq_idx), every cell each",
    )
    p.add_argument(
        "--check-shapes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the ops' cross-rank call check (default on, as for users)",
    )
    p.add_argument(
        "--tile-length",
        type=int,
        default=None,
        help="the state-passing modes run every segment in tiles of this many tokens (a group of one too)",
    )
    p.add_argument(
        "--shared-gpu",
        action="store_true",
        help="every rank on cuda:0 through gloo: kernel lists and correctness only, timings mean nothing",
    )
    p.add_argument("--summary-exchange", choices=("auto", "allgather", "scan"), default="auto",
                   help="sp modes: how the segments' state summaries travel (the op's summary_exchange)")  # fmt: skip
    p.add_argument("--recompute-output", action="store_true",
                   help="sp modes recompute the pre-gate output in backward (recompute_output=True)")  # fmt: skip
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma separated subset of {','.join(MODES + EXTRA_MODES)}")  # fmt: skip
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="also time CUDA-graph replay (default: on with CUDA, off with --cpu)")  # fmt: skip
    p.add_argument("--iters", type=int, default=10, help="timed iterations per cell (>= 10 for the issue's figures)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up iterations per cell (>= 5)")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/mixer_<device>_cp<N>.json)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds: start no cell that is expected to end past this (0: no limit)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    p.add_argument("--git-commit", default=None, help="record this commit (where the checkout has no .git)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = p.parse_args(argv)

    custom = any(v is not None for v in (args.seqlens, args.batch, args.nheads, args.ngroups))
    if custom and args.suite is not None:
        p.error("--suite and the custom-cell options (--seqlens, --batch, --nheads, --ngroups) exclude each other")
    dims = dict(CPU_DIMS if args.cpu else GPU_DIMS)
    for k in ("headdim", "dstate", "d_conv", "chunk_size", "dtype"):
        if getattr(args, k) is not None:
            dims[k] = getattr(args, k)
    args.dims = Dims(**dims, rmsnorm=args.rmsnorm)
    if custom:
        specs = [s.split(":") for s in (args.seqlens or ("64,128" if args.cpu else "8K")).split(",")]
        if any(len(sp) > 2 for sp in specs):
            p.error("--seqlens takes LEN or LEN:TILE, comma separated")
        nheads = args.nheads or (4 if args.cpu else 64)
        ngroups = args.ngroups or (2 if args.cpu else 8)
        args.cells = [Cell(_parse_len(sp[0]), args.batch or 1, nheads, ngroups, tile=_parse_len(sp[1]) if len(sp) > 1
                           else 0) for sp in specs]  # fmt: skip
    else:
        args.cells = SUITES[args.suite or ("cpu" if args.cpu else "default")]
    docs = [int(d) for d in str(args.docs_per_row).split(",") if d.strip()]
    if any(d < 0 for d in docs):
        p.error("--docs-per-row takes counts >= 0")
    args.cells = [Cell(c.seqlen, c.batch, c.nheads, c.ngroups, d, c.tile) for c in args.cells for d in docs]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES + EXTRA_MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {','.join(MODES + EXTRA_MODES)}")
    if args.graphs is None:
        args.graphs = not args.cpu and not args.shared_gpu
    if args.shared_gpu and (args.cpu or args.graphs):
        p.error("--shared-gpu runs gloo on one GPU: no --cpu, no --graphs (gloo collectives cannot be captured)")
    if args.iters < 1 or args.warmup < 1:
        p.error("--iters and --warmup must be at least 1")
    return args


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init(args) -> Context:
    import deepspeed.comm as dist

    launch = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not any(k in os.environ for k in launch):  # a plain `python3 bench_mixer.py`: one process, cp = 1
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    for k in launch:
        if k not in os.environ:
            raise SystemExit(f"{k} is not set: launch with torchrun --nproc_per_node N (or the deepspeed launcher)")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    if args.cpu:
        torch.set_num_threads(1)  # ranks share the machine's cores
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --cpu for the gloo smoke run")
        if args.shared_gpu:
            os.environ["LOCAL_RANK"] = "0"  # DeepSpeed would bind rank i to cuda:i
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_distributed(dist_backend="gloo" if args.cpu or args.shared_gpu else "nccl", verbose=False,
                          timeout=timedelta(seconds=args.timeout))  # fmt: skip
    ctx = Context(
        rank=dist.get_rank(),
        cp=dist.get_world_size(),
        device=device,
        backend=args.backend,
        dims=args.dims,
        recompute_output=args.recompute_output,
        check_shapes=args.check_shapes,
        tile_length=args.tile_length,
        summary_exchange=args.summary_exchange,
    )
    torch.manual_seed(ctx.seed + ctx.rank)
    return ctx


def main(argv=None):
    args = parse_args(argv)
    t_start = time.monotonic()
    ctx = init(args)
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"mixer_{ctx.device.type}_cp{ctx.cp}.json")
    payload = dict(
        schema=SCHEMA,
        header=environment(args, ctx),
        config=dict(
            dims=asdict(args.dims),
            modes=args.modes,
            graphs=args.graphs,
            iters=args.iters,
            warmup=args.warmup,
            cells=[asdict(c) for c in args.cells],
            suite=args.suite,
            recompute_output=ctx.recompute_output,
            check_shapes=ctx.check_shapes,
            tile_length=ctx.tile_length,
            summary_exchange=ctx.summary_exchange,
            docs_per_row=sorted({c.docs for c in args.cells}),
            shared_gpu=args.shared_gpu,
        ),
        records=[],
        complete=False,
    )
    if ctx.cuda and "reference" in (payload["header"]["backend_module"] or "") and ctx.rank == 0:
        print("WARNING: CUDA tensors resolve to the reference backend: the Triton backend did not import", flush=True)
    bar = None
    if ctx.rank == 0 and not args.no_progress:
        from tqdm import tqdm

        # without a terminal (a device log) redraw rarely so that the per-cell summaries stay readable
        bar = tqdm(total=len(args.cells) * len(args.modes), desc="bench_mixer", unit="mode", dynamic_ncols=True,
                   mininterval=0.1 if sys.stderr.isatty() else 30.0)  # fmt: skip
    cell_walls = []  # (tokens*nheads, seconds) of finished cells, for the time budget
    for cell in args.cells:
        t_cell = time.monotonic()
        if _over_budget(args, cell, cell_walls, time.monotonic() - t_start, ctx):
            for mode in args.modes:
                for g in [False, True] if args.graphs else [False]:
                    payload["records"].append(dict(
                        mode=mode, cp=ctx.cp, seqlen=cell.seqlen, batch=cell.batch, nheads=cell.nheads,
                        ngroups=cell.ngroups, **asdict(args.dims), cuda_graph=g, status="skipped",
                        reason=f"time budget of {args.time_budget:.0f} s",
                    ))  # fmt: skip
            if bar is not None:
                bar.update(len(args.modes))
            continue
        cell_records = []
        for mode in args.modes:
            if bar is not None:
                bar.set_postfix_str(f"{cell.label()} {mode}")
            cell_records += run_mode(mode, cell, args, ctx)
            if bar is not None:
                bar.update(1)
        add_derived(cell_records)
        payload["records"] += cell_records
        cell_walls.append((cell.seqlen * cell.batch * cell.nheads, time.monotonic() - t_cell))
        payload["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if ctx.rank == 0:
            write_json(out, payload)
            if bar is not None:
                bar.write(_cell_summary(cell, cell_records))
    payload["complete"] = True
    payload["elapsed_s"] = round(time.monotonic() - t_start, 1)
    if bar is not None:
        bar.close()
    if ctx.rank == 0:
        write_json(out, payload)
        print(f"wrote {out} ({len(payload['records'])} records, {payload['elapsed_s']} s)", flush=True)
    from ds_mamba_spcp.comm import shutdown

    shutdown()


def _over_budget(args, cell: Cell, walls, elapsed: float, ctx: Context) -> bool:
    """Rank 0 decides (ranks' clocks differ). The estimate scales the largest finished cell's wall
    time by size, floored by the fastest cell; the first cell is left out of the estimate (it
    carries the JIT compilation and Triton autotuning)."""
    if args.time_budget <= 0:
        return False
    est = 0.0
    steady = walls[1:]
    if steady:
        size = cell.seqlen * cell.batch * cell.nheads
        largest_size, largest_wall = max(steady)
        est = max(min(w for _, w in steady), largest_wall * size / largest_size)
    decision = torch.tensor([1 if elapsed + est > args.time_budget else 0], dtype=torch.int32, device=ctx.device)
    _dist().broadcast(decision, src=0)
    return bool(decision.item())


def _cell_summary(cell: Cell, records: list[dict]) -> str:
    parts = []
    for r in records:
        tag = r["mode"] + ("[g]" if r["cuda_graph"] else "")
        parts.append(f"{tag} {r['fwd_bwd_ms']:.2f}" if r["status"] == "ok" else f"{tag} {r['status']}")
    return f"{cell.label()}: " + ", ".join(parts) + " (ms)"


if __name__ == "__main__":
    main()
