"""Does an eager fwd+bwd of the op wait for the GPU anywhere? (issue 23, one CUDA device)

    MAMBA_DETERMINISTIC=1 python3 benchmarks/probes/probe_host_sync.py --out benchmarks/results/host_sync_h200x1.json

For mamba-ssm's whole op and this package's op in tiles of 8K and 16K (a group of one, 32K tokens, bench_mixer's
inputs and GPU shapes, those of its issue-23 cells: 64 heads of 64, 8 groups, dstate 128, bf16), the host time of the
forward and of the backward (until the Python call returns) is taken three times with the GPU idle and three
times right after ~250 ms of matmuls were queued. A step whose host never waits for the GPU returns after the
same host time in both cases (its kernels just queue behind the matmuls); a step with a synchronizing call
(a host read, a blocking copy, an allocator flush) takes the queue's length too. One more step runs under
torch's sync-debug mode ("warn"), which names torch's own synchronizing calls. Each entry of
``fwd_bwd_total_ms`` is (forward host ms, backward host ms, whole step ms with the final synchronize).
(``results/host_sync_7349b3b_h200x1.json`` came from this probe before it took bench_mixer's inputs: the same
shapes and distributions from its own generator; host time does not depend on the values.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import bench_mixer as bm  # noqa: E402
import torch  # noqa: E402


def steps_of(cell, ctx, tiles):
    """bench_mixer's inputs for ``cell`` and a forward per probed op: mamba-ssm's whole op ("ideal") and this
    package's op in tiles of each length in ``tiles`` ("tiles_<n>")."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.ops import get_backend

    inp = bm.CoreInputs(cell.batch, cell.seqlen, cell.nheads, cell.ngroups, ctx)
    ideal = get_backend(ctx.backend, ctx.device).single_device_op
    steps = {"ideal": lambda: ideal(*inp.args(), **inp.kwargs())}
    for t in tiles:
        steps[f"tiles_{t // 1024}k" if t % 1024 == 0 else f"tiles_{t}"] = lambda t=t: mamba_split_conv1d_scan_sp(
            *inp.args(), tile_length=t, backend=ctx.backend, **inp.kwargs()
        )
    return inp, steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/host_sync.json")
    p.add_argument("--seqlen", default="32K")
    p.add_argument("--tiles", default="8K,16K", help="tile lengths of the op's tiled calls")
    p.add_argument("--queue", type=int, default=150, help="8192^2 bf16 matmuls queued before a 'busy' step")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_host_sync.py needs a CUDA device")
    bargs = bm.parse_args(["--seqlens", args.seqlen])  # bench_mixer's GPU dims and heads for the rest
    dev = torch.device("cuda")
    ctx = bm.Context(rank=0, cp=1, device=dev, backend=bargs.backend, dims=bargs.dims)
    torch.manual_seed(0)
    inp, steps = steps_of(bargs.cells[0], ctx, [bm._parse_len(t) for t in args.tiles.split(",")])
    leaves, dout = inp.leaves, inp.dout
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy():
        for _ in range(args.queue):
            big @ big

    res = {}
    for name, fwd in steps.items():
        for _ in range(4):  # compile, warm the allocator
            torch.autograd.grad(fwd(), leaves, dout)
        torch.cuda.synchronize()
        t = time.perf_counter()
        busy()
        busy_enqueue = time.perf_counter() - t
        torch.cuda.synchronize()
        t = time.perf_counter()
        busy()
        torch.cuda.synchronize()
        busy_ms = (time.perf_counter() - t) * 1e3
        rows = {}
        for cond in ("idle", "busy"):
            hs = []
            for _ in range(3):
                torch.cuda.synchronize()
                if cond == "busy":
                    busy()
                t0 = time.perf_counter()
                out = fwd()
                t1 = time.perf_counter()
                torch.autograd.grad(out, leaves, dout)
                t2 = time.perf_counter()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                hs.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t0) * 1e3))
            rows[cond] = hs
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.autograd.grad(fwd(), leaves, dout)
                torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        res[name] = dict(busy_ms=busy_ms, busy_enqueue_ms=busy_enqueue * 1e3, fwd_bwd_total_ms=rows,
                         sync_warnings=sorted({str(c.message)[:200] for c in caught}))  # fmt: skip
        print(name, json.dumps(res[name], indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
