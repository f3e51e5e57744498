"""Where the host time of one eager fwd+bwd goes: cProfile of bench_mixer's steps, per mode.

Eager mode is host-bound at short shards (bench_mixer's ``host_ms`` is close to ``fwd_bwd_ms``);
this prints, for each mode, the Python functions that spend that time (rank 0; the other ranks
run the same steps unprofiled so that the collectives pair up):

    torchrun --nproc_per_node 2 benchmarks/probes/profile_host.py --seqlen 8K --modes ideal,state_passing
    torchrun --nproc_per_node 2 benchmarks/probes/profile_host.py --cpu      # gloo, reference backend
    python3 benchmarks/probes/profile_host.py --seqlen 32K --tile-length 8K --kernels  # a group of one in tiles

Writes ``<out>/host_<mode>.txt`` (top functions by own time and by cumulative time) and prints a
line per mode: host ms per step with and without the profiler. ``--kernels`` (CUDA) also writes
``<out>/kernels_<mode>.txt`` (GPU time per kernel) and ``<out>/launches_<mode>.txt``: every kernel launched
in one step, in the GPU's order, forward and backward apart (two profiler sessions), with the counts per
segment (a tile, or a rank's segment) by kernel.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import bench_mixer as bm  # noqa: E402
import torch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--seqlen", default=None, help="global seqlen (default 8K; 64 with --cpu)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--modes", default="ideal,state_passing")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--recompute-output", action="store_true")
    p.add_argument("--out", default="/tmp/profile_host")
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--kernels", action="store_true", help="also a torch.profiler table of GPU time per kernel")
    p.add_argument(
        "--shared-gpu",
        action="store_true",
        help="every rank on cuda:0 through gloo (kernel lists only: timings mean nothing)",
    )
    p.add_argument("--docs-per-row", type=int, default=0, help="packed rows of this many documents (0: unpacked)")
    p.add_argument("--tile-length", default=None, help="the state-passing modes run in tiles of this many tokens")
    args = p.parse_args(argv)
    # bench_mixer's own defaults (dims, backend, timeout) for the rest
    bm_argv = ["--cpu"] if args.cpu else []
    bm_argv += ["--seqlens", args.seqlen or ("64" if args.cpu else "8K"), "--batch", str(args.batch)]
    bm_argv += ["--recompute-output"] if args.recompute_output else []
    bm_argv += ["--shared-gpu"] if args.shared_gpu else []
    bm_argv += ["--docs-per-row", str(args.docs_per_row)]
    if args.tile_length:
        bm_argv += ["--tile-length", str(bm._parse_len(args.tile_length))]
    return args, bm.parse_args(bm_argv)


def _kernel_table(step, mode, cell, ctx, args):
    """GPU time per kernel over a few steps (rank 0 writes ``<out>/kernels_<mode>.txt``)."""
    from torch.profiler import ProfilerActivity, profile

    bm._dist().barrier()
    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if ctx.rank == 0:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70)
        tag = f"_docs{args.docs_per_row}" if args.docs_per_row else ""
        with open(os.path.join(args.out, f"kernels_{mode}{tag}.txt"), "w") as f:
            f.write(f"{mode} {cell.label()} cp={ctx.cp}: totals over {steps} steps\n{table}\n")


def _segments(mode, cell, ctx) -> int:
    """Causal segments per rank of one step: the tiles of the rank's segments, or its segments."""
    local = cell.seqlen // ctx.cp
    nseg = 2 if mode == "virtual" else 1
    tile = ctx.tile_length if mode in bm.SP_LOAD_BALANCING else None
    return nseg * (-(-(local // nseg) // tile) if tile else 1)


def device_launches(events) -> list[str]:
    """The device activities (kernels, memcpys, memsets) among a profiler's events, in the GPU's order.

    Read from the GPU-side events themselves, not from ``FunctionEvent.kernels`` of the CPU ops (the
    profiler attaches a kernel to the CPU op its launch correlates with): round 1's lists did the latter
    and attached the Triton kernels (launched by ``cuLaunchKernel`` outside any aten op) as one block to
    an op early in the forward: the ideal's "forward" held all 15 Triton kernels of both halves, in
    order, then 3 torch kernels. The record_function ranges' GPU-side copies (user annotations) are not
    launches.
    """
    from torch.autograd import DeviceType

    gpu = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return [e.name for e in sorted(gpu, key=lambda e: e.time_range.start)]


def _launch_lists(mode, cell, ctx, args):
    """Every kernel one step launches, in order, forward and backward apart (``<out>/launches_<mode>.txt``).

    The forward and the backward run in two profiler sessions with a synchronize between them, so a
    launch belongs to the half whose session recorded it: no time ranges (the GPU runs behind the host)
    and no CPU-op attribution (see ``device_launches``).
    """
    import collections

    from torch.profiler import ProfilerActivity, profile

    fwd_bwd = bm.CoreInputs.fwd_bwd
    halves = {}

    def split(self, forward):
        def step():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = forward()
                torch.cuda.synchronize()
            halves["forward"] = prof.events()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                grads = torch.autograd.grad(out, self.leaves, self.dout)
                torch.cuda.synchronize()
            halves["backward"] = prof.events()
            return grads

        return step

    bm.CoreInputs.fwd_bwd = split
    try:
        step = bm.build_step(mode, cell, ctx)
    finally:
        bm.CoreInputs.fwd_bwd = fwd_bwd
    step()  # warm: the profiler's first session pays its own setup
    torch.cuda.synchronize()
    bm._dist().barrier()
    step()
    if ctx.rank != 0:
        return
    lists = {name: device_launches(events) for name, events in halves.items()}
    segments = _segments(mode, cell, ctx)
    with open(os.path.join(args.out, f"launches_{mode}.txt"), "w") as f:
        f.write(f"{mode} {cell.label()} cp={ctx.cp} tile_length={ctx.tile_length}: {segments} segment(s) per rank\n")
        for name in ("forward", "backward"):
            names = lists[name]
            f.write(f"\n=== {name}: {len(names)} launches, {len(names) / segments:.1f} per segment ===\n")
            for kernel, n in collections.Counter(names).most_common():
                f.write(f"{n / segments:7.2f} per segment  {n:5d}  {kernel[:110]}\n")
            f.write("\n--- in launch order ---\n" + "\n".join(k[:110] for k in names) + "\n")
    print(f"{mode}: " + ", ".join(f"{n} {len(lists[n]) / segments:.1f} launches/segment"
                                  for n in ("forward", "backward")), flush=True)  # fmt: skip


def main(argv=None):
    args, bargs = parse_args(argv)
    ctx = bm.init(bargs)
    cell = bargs.cells[0]
    os.makedirs(args.out, exist_ok=True)
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        step = bm.build_step(mode, cell, ctx)
        for _ in range(5):  # compile, autotune
            step()
        bm._sync(ctx)
        bm._dist().barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        plain_ms = (time.perf_counter() - t0) * 1e3 / args.iters
        bm._sync(ctx)
        bm._dist().barrier()
        prof = cProfile.Profile() if ctx.rank == 0 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        for _ in range(args.iters):
            step()
        if prof:
            prof.disable()
        profiled_ms = (time.perf_counter() - t0) * 1e3 / args.iters
        bm._sync(ctx)
        if ctx.rank == 0:
            buf = io.StringIO()
            buf.write(f"{mode} {cell.label()} cp={ctx.cp}: host {plain_ms:.2f} ms/step, {profiled_ms:.2f} profiled\n")
            for key in ("tottime", "cumulative"):
                buf.write(f"\n=== by {key} (totals over {args.iters} steps) ===\n")
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            with open(os.path.join(args.out, f"host_{mode}.txt"), "w") as f:
                f.write(buf.getvalue())
            print(f"{mode}: host {plain_ms:.2f} ms/step ({profiled_ms:.2f} under cProfile)", flush=True)
        if args.kernels and ctx.cuda:
            _kernel_table(step, mode, cell, ctx, args)
            _launch_lists(mode, cell, ctx, args)
        del step
        if ctx.cuda:
            torch.cuda.empty_cache()
    from ds_mamba_spcp.comm import shutdown

    shutdown()  # CI saw a gloo rank abort at exit without it


if __name__ == "__main__":
    main()
