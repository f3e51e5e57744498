"""Does an eager fwd+bwd of the op wait for the GPU anywhere? (issue 23, one CUDA device)

    MAMBA_DETERMINISTIC=1 python3 benchmarks/probe_host_sync.py --out benchmarks/results/host_sync_h200x1.json

For mamba-ssm's whole op and this package's op in tiles of 8K and 16K (a group of one, 32K tokens, the
shapes of bench_mixer's issue-23 cells: 64 heads of 64, 8 groups, dstate 128, bf16), the host time of the
forward and of the backward (until the Python call returns) is taken three times with the GPU idle and three
times right after ~250 ms of matmuls were queued. A step whose host never waits for the GPU returns after the
same host time in both cases (its kernels just queue behind the matmuls); a step with a synchronizing call
(a host read, a blocking copy, an allocator flush) takes the queue's length too. One more step runs under
torch's sync-debug mode ("warn"), which names torch's own synchronizing calls. Each entry of
``fwd_bwd_total_ms`` is (forward host ms, backward host ms, whole step ms with the final synchronize).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_mamba_spcp import mamba_split_conv1d_scan_sp  # noqa: E402
from ds_mamba_spcp.ops import get_backend  # noqa: E402

L, H, G, P, N, K, CHUNK = 32768, 64, 8, 64, 128, 4, 128


def _inputs(dev):
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N
    bf16 = torch.bfloat16
    zx = torch.randn(1, L, 2 * d_inner + 2 * G * N + H, device=dev, dtype=bf16, requires_grad=True)
    w = ((torch.rand(conv_dim, K, device=dev) * 2 - 1) * 0.5).to(bf16).requires_grad_()
    b = ((torch.rand(conv_dim, device=dev) * 2 - 1) * 0.5).to(bf16).requires_grad_()
    dt = torch.exp(torch.rand(H, device=dev) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(bf16).requires_grad_()
    A = (-(torch.rand(H, device=dev) * 15 + 1)).requires_grad_()
    D = torch.ones(H, device=dev, requires_grad=True)
    dout = torch.randn(1, L, d_inner, device=dev, dtype=bf16)
    return [zx, w, b, dt_bias, A, D], dout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/host_sync.json")
    p.add_argument("--queue", type=int, default=150, help="8192^2 bf16 matmuls queued before a 'busy' step")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_host_sync.py needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    leaves, dout = _inputs(dev)
    ideal = get_backend("auto", dev).single_device_op
    kw = dict(headdim=P, ngroups=G)
    steps = {
        "ideal": lambda: ideal(*leaves, CHUNK, **kw),
        "tiles_8k": lambda: mamba_split_conv1d_scan_sp(*leaves, CHUNK, tile_length=8192, **kw),
        "tiles_16k": lambda: mamba_split_conv1d_scan_sp(*leaves, CHUNK, tile_length=16384, **kw),
    }
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
