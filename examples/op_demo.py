"""Runs the state-passing op on every rank of a deepspeed launch and checks it against one process.

    deepspeed --num_gpus 2 examples/op_demo.py          # 2 ranks (CPU/gloo without GPUs)

Every rank builds the same global inputs from one seed, runs ``mamba_split_conv1d_scan_sp`` on
its shard (forward and backward), and compares with the single-process op on the full sequence.
It prints the errors and the bytes each rank exchanged against what an all-to-all would move.
"""

from __future__ import annotations

import argparse
import os

import torch

from ds_mamba_spcp import mamba_split_conv1d_scan_ref, mamba_split_conv1d_scan_sp
from ds_mamba_spcp.engine.layout import shard_sequence
from ds_mamba_spcp.engine.traffic import state_passing_bytes, ulysses_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1024, help="global sequence length")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--nheads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=16)
    parser.add_argument("--ngroups", type=int, default=2)
    parser.add_argument("--dstate", type=int, default=16)
    parser.add_argument("--d-conv", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--load-balancing", default="none", choices=["none", "virtual"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args()

    import deepspeed.comm as dist

    dist.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    h, p, g, n, K = args.nheads, args.headdim, args.ngroups, args.dstate, args.d_conv
    d_inner, conv_dim = h * p, h * p + 2 * g * n
    params = dict(
        conv1d_weight=torch.randn(conv_dim, K, dtype=dtype) * 0.5,
        conv1d_bias=torch.randn(conv_dim, dtype=dtype) * 0.1,
        dt_bias=torch.randn(h, dtype=dtype) * 0.5,
        A=-torch.rand(h, dtype=dtype).add(0.5),
        D=torch.randn(h, dtype=dtype),
        rmsnorm_weight=torch.ones(d_inner, dtype=dtype),
    )
    zxbcdt = torch.randn(args.batch, args.seqlen, 2 * d_inner + 2 * g * n + h, dtype=dtype)
    dout = torch.randn(args.batch, args.seqlen, d_inner, dtype=dtype)
    params = {k: v.to(device).requires_grad_() for k, v in params.items()}
    zxbcdt, dout = zxbcdt.to(device), dout.to(device)
    kw = dict(headdim=p, ngroups=g, rmsnorm_weight=params.pop("rmsnorm_weight"))
    args_ = [params["conv1d_weight"], params["conv1d_bias"], params["dt_bias"], params["A"], params["D"]]

    layout = "zigzag" if args.load_balancing == "virtual" else "contiguous"
    x_local = shard_sequence(zxbcdt, rank, world, layout).requires_grad_()
    out = mamba_split_conv1d_scan_sp(x_local, *args_, args.chunk_size, load_balancing=args.load_balancing, **kw)
    out.backward(shard_sequence(dout, rank, world, layout))
    grads = [t.grad.clone() for t in args_ + [kw["rmsnorm_weight"]]]
    for gr in grads:
        dist.all_reduce(gr)  # replicated parameters: the full gradient is the sum over ranks

    x_full = zxbcdt.clone().requires_grad_()
    for t in args_ + [kw["rmsnorm_weight"]]:
        t.grad = None
    ref = mamba_split_conv1d_scan_ref(x_full, *args_, args.chunk_size, **kw)
    ref.backward(dout)
    ref_grads = [t.grad for t in args_ + [kw["rmsnorm_weight"]]]

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    errs = {
        "out": rel(out.detach(), shard_sequence(ref.detach(), rank, world, layout)),
        "dzxbcdt": rel(x_local.grad, shard_sequence(x_full.grad, rank, world, layout)),
    }
    names = ["dconv1d_weight", "dconv1d_bias", "ddt_bias", "dA", "dD", "drmsnorm_weight"]
    errs.update({k: rel(a, b) for k, a, b in zip(names, grads, ref_grads)})
    worst = torch.tensor([max(errs.values())], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)

    sizes = dict(batch=args.batch, local_seqlen=args.seqlen // world, nheads=h, headdim=p, ngroups=g, dstate=n)
    sp = state_passing_bytes(**sizes, d_conv=K, cp=world, dtype=dtype, load_balancing=args.load_balancing)
    a2a = ulysses_bytes(**sizes, cp=world, dtype=dtype)
    for r in range(world):
        if r == rank:
            print(f"[rank {rank}/{world}] relative errors vs one process: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)  # fmt: skip
        dist.barrier()
    if rank == 0:
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        verdict = "OK" if worst.item() <= tol else "MISMATCH"
        print(f"\nworst relative error over ranks: {worst.item():.2e} (tolerance {tol:.0e}) -> {verdict}")
        print(f"bytes sent per rank per layer, forward+backward, L={args.seqlen} global, cp={world}:")
        print(f"  state passing ({args.load_balancing}): {sp:>12,d}  (conv halo + fp32 state summary)")
        print(f"  all-to-all (ulysses):           {a2a:>12,d}  (activations there and back)")
        print(f"  ratio: {a2a / sp:.1f}x less traffic with state passing")
    dist.barrier()
    if worst.item() > (1e-10 if dtype == torch.float64 else 1e-5):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    from ds_mamba_spcp.comm import shutdown

    shutdown()  # a gloo rank can abort at exit while its group lives
