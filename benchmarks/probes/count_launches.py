"""Kernel launches and torch ops per segment of the Triton backend, counted on CPU (no GPU needed).

The Triton backend runs under Triton's interpreter (``tests/triton_cpu_shims.py``: TRITON_INTERPRET=1,
causal-conv1d's CUDA conv replaced by a plain-PyTorch stand-in), so every launch of one of mamba-ssm's
kernels or of ours goes through ``InterpretedFunction.run`` and every torch op through the dispatcher,
where they are counted: the host work of the glue in numbers that do not depend on the machine.

    python benchmarks/probes/count_launches.py --seqlen 64 --tile-length 32     # a group of one, 2 tiles
    python benchmarks/probes/count_launches.py --json /tmp/counts.json

One fwd+bwd step of ``mamba_split_conv1d_scan_sp`` (a group of one, no process group) is run once to warm
up and once counted. Printed (and written as JSON): per direction, the Triton launches by kernel, the torch
ops by name (the conv stand-in's own ops excluded: on a GPU it is one causal-conv1d call, counted as
"conv"), their totals, and the same per segment (tiles). Must run in a fresh process (the interpreter has
to be set up before the kernels are defined).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ops that allocate but launch no kernel: counted as torch ops, not as device kernels
_ALLOC = {"empty", "empty_like", "empty_strided", "promote_types"}
# ops that create no kernel and no allocation (metadata only): not counted
_VIEWS = {
    "view", "_unsafe_view", "as_strided", "slice", "select", "transpose", "t", "permute", "unsqueeze", "squeeze",
    "expand", "split", "split_with_sizes", "unbind", "alias", "detach", "unflatten", "_reshape_alias", "reshape",
    "flatten", "diagonal", "narrow", "view_as", "lift_fresh", "empty_strided_view", "_to_copy_view",
}  # fmt: skip


class Counter(TorchDispatchMode):
    """Counts the aten ops that run (views left out), and, through ``launch``, Triton launches."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.launches = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in _VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


_ACTIVE: list[Counter] = []


def _install_counting():
    """Interpreter + shims, then hooks on the interpreter's launch path and on the conv stand-in."""
    sys.path.insert(0, REPO)
    from tests import triton_cpu_shims

    backend = triton_cpu_shims.install()
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if _ACTIVE and not _ACTIVE[-1].paused:
            _ACTIVE[-1].launches[self.fn.__name__] += 1
        if _ACTIVE:
            with _ACTIVE[-1].pause():  # the interpreter's own torch calls are not the glue's
                return run(self, *args, **kwargs)
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted_run

    def wrap(fn, label):
        def counted(*args, **kwargs):
            if not _ACTIVE:
                return fn(*args, **kwargs)
            _ACTIVE[-1].launches[label] += 1
            with _ACTIVE[-1].pause():
                return fn(*args, **kwargs)

        return counted

    backend._conv_fwd_fn = wrap(backend._conv_fwd_fn, "causal_conv1d_fwd")
    backend._conv_bwd_fn = wrap(backend._conv_bwd_fn, "causal_conv1d_bwd")
    return backend


def make_inputs(batch, seqlen, nheads=8, headdim=4, ngroups=1, dstate=8, d_conv=4, seed=0):
    """Tiny fp32 inputs; d_in_proj = 88 and conv_dim = 48 are multiples of 8 like a real model's (otherwise
    mamba-ssm's ensure_stride copies xBC for causal-conv1d, a copy no real shape pays)."""
    g = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = nheads * headdim, nheads * headdim + 2 * ngroups * dstate
    t = dict(
        zxbcdt=torch.randn(batch, seqlen, 2 * d_inner + 2 * ngroups * dstate + nheads, generator=g),
        conv1d_weight=torch.randn(conv_dim, d_conv, generator=g) * 0.5,
        conv1d_bias=torch.randn(conv_dim, generator=g) * 0.5,
        dt_bias=torch.full((nheads,), -2.0),
        A=-(torch.rand(nheads, generator=g) + 0.5),
        D=torch.randn(nheads, generator=g),
    )
    for v in t.values():
        v.requires_grad_()
    return t, torch.randn(batch, seqlen, d_inner, generator=g), dict(headdim=headdim, ngroups=ngroups)


def count_step(t, dout, kw, *, chunk_size, tile_length, cuda_graphs=False):
    """(forward Counter, backward Counter) of one fwd+bwd of the op."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp

    args = [t[k] for k in ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
    fwd, bwd = Counter(), Counter()
    _ACTIVE.append(fwd)
    with fwd:
        out = mamba_split_conv1d_scan_sp(*args, chunk_size, backend="triton", tile_length=tile_length, **kw)
    _ACTIVE.pop()
    _ACTIVE.append(bwd)
    with bwd:
        torch.autograd.grad(out, args, dout)
    _ACTIVE.pop()
    return fwd, bwd


def summary(fwd: Counter, bwd: Counter, segments: int) -> dict:
    res = {}
    for name, c in (("forward", fwd), ("backward", bwd)):
        kernels = sum(c.launches.values()) + sum(n for op, n in c.ops.items() if op not in _ALLOC)
        res[name] = dict(
            launches=sum(c.launches.values()), torch_ops=sum(c.ops.values()), device_kernels=kernels,
            device_kernels_per_segment=kernels / segments,
            launches_per_segment=sum(c.launches.values()) / segments,
            torch_ops_per_segment=sum(c.ops.values()) / segments,
            by_kernel=dict(sorted(c.launches.items())), by_op=dict(c.ops.most_common()),
        )  # fmt: skip
    res["segments"] = segments
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--tile-length", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    _install_counting()
    torch.set_num_threads(1)
    t, dout, kw = make_inputs(args.batch, args.seqlen)
    segments = -(-args.seqlen // args.tile_length)
    count_step(t, dout, kw, chunk_size=args.chunk_size, tile_length=args.tile_length)  # warm-up
    res = summary(*count_step(t, dout, kw, chunk_size=args.chunk_size, tile_length=args.tile_length), segments)
    for name in ("forward", "backward"):
        r = res[name]
        print(f"{name}: {r['launches']} Triton/conv launches, {r['torch_ops']} torch ops, {r['device_kernels']} "
              f"device kernels in all over {segments} segments ({r['launches_per_segment']:.1f}, "
              f"{r['torch_ops_per_segment']:.1f} and {r['device_kernels_per_segment']:.1f} per segment)")  # fmt: skip
        print("  kernels: " + ", ".join(f"{k} {v}" for k, v in r["by_kernel"].items()))
        print("  ops:     " + ", ".join(f"{k} {v}" for k, v in r["by_op"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
