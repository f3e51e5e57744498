"""The state passing kernels alone on one GPU: mamba-ssm's against ops/pass_states.py's (issue 23's GPU time per tile).

For each number of chunks (bench_mixer's chunks are 128 tokens: 64 chunks are an 8K tile, 128 16K, 256 32K, 1024
128K), on the bench's shape (nheads=64, headdim=64, dstate=128: a state of 8192 per head), times as one CUDA-event
interval over ``--launches`` back-to-back launches, the median of ``--rounds`` rounds that alternate the kernels:

- forward: out in bf16 (the forward's, for the chunk scan) and in fp32 (the backward's recomputation), from
  initial states;
- backward: from dfinal_states, the states converted to bf16, dinitial_states (what a tile's backward runs);

for mamba-ssm's kernels (its autotuned block) and ours at each ``--blocks`` x ``--warps``. Also checks that ours
equal upstream's bitwise (every result but the ddA partial sums, which are summed over other blocks: their
largest relative difference is reported), also on packed rows. Writes JSON (``--out``).

    python benchmarks/probes/probe_state_passing.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ds_mamba_spcp.ops.kernels import pass_states as ps  # noqa: E402
from ds_mamba_spcp.ops.kernels import upstream as _upstream  # noqa: E402


def _environment(commit):
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, git_commit=commit)


def _ints(text):
    return [int(v) for v in text.split(",") if v]


def _time(fns, rounds, launches):
    """{name: median ms per launch}, the functions alternating round by round."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(launches):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / launches)
    return {name: statistics.median(v) for name, v in times.items()}


def _same(a, b):
    return a is None and b is None or (a is not None and b is not None and torch.equal(a, b))


def _diff(a, b):
    """Where two results differ: (elements that differ, the largest abs difference, the largest relative to the
    value, in units of the dtype's eps)."""
    d = (a.float() - b.float()).abs()
    eps = torch.finfo(a.dtype).eps
    return dict(
        n=int((d > 0).sum()), max_abs=d.max().item(), max_eps=(d / a.float().abs().clamp_min(1e-30)).max().item() / eps
    )


def _cell(sp, nchunks, nheads, dim, args, seq=None, chunk_size=128):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(nchunks)
    states = torch.randn(1, nchunks, nheads, dim, device=dev, generator=g)
    dA = -torch.rand(1, nheads, nchunks, device=dev, generator=g) * 0.5
    init = torch.randn(1, nheads, dim, device=dev, generator=g)
    prev = torch.randn(1, nchunks, nheads, dim, device=dev, generator=g)
    dout = torch.randn(1, nchunks, nheads, dim, device=dev, generator=g)
    dfinal = torch.randn(1, nheads, dim, device=dev, generator=g)
    extra = {} if seq is None else dict(seq_idx=seq, chunk_size=chunk_size)
    bf16 = torch.bfloat16
    bkw = dict(has_initial_states=True, dstates_dtype=bf16, states_dtype=bf16)
    res = dict(nchunks=nchunks, nheads=nheads, dim=dim, packed=seq is not None)

    # equality: ours (default block) against upstream
    for od, name in ((bf16, "fwd_bf16"), (torch.float32, "fwd_fp32")):
        want = sp._state_passing_fwd(states, dA, initial_states=init, out_dtype=od, **extra)
        got = ps.state_passing_fwd(states, dA, init, out_dtype=od, **extra)
        res[f"equal_{name}"] = all(_same(a, b) for a, b in zip(want, got))
    want = sp._state_passing_bwd(prev, dA, dout, dfinal_states=dfinal, **bkw, **extra)
    got = ps.state_passing_bwd(prev, dA, dout, dfinal, seq, **bkw, dinit_dtype=bf16, chunk_size=chunk_size)
    res["equal_bwd"] = {n: _same(want[i], got[i]) for i, n in ((0, "dstates"), (2, "dinit"), (3, "converted"))}
    res["diff_bwd"] = {n: _diff(want[i], got[i]) for i, n in ((0, "dstates"), (2, "dinit"), (3, "converted"))}
    # the dinit known mode takes, in fp32, against upstream's (bf16: its wrapper's dtype for it) and against its
    # own rounding to bf16
    wide = ps.state_passing_bwd(prev, dA, dout, dfinal, seq, **bkw, dinit_dtype=torch.float32,
                                chunk_size=chunk_size)[2]  # fmt: skip
    res["dinit_fp32_rounded_equal"] = _same(wide.to(bf16), want[2])
    res["dinit_fp32_vs_bf16"] = _diff(want[2], wide)
    scale = want[1].abs().max().item()
    res["ddA_max_rel_diff"] = (want[1] - got[1]).abs().max().item() / max(scale, 1e-30)
    res["upstream_blocks"] = {
        "fwd": sp._state_passing_fwd_kernel.best_config.kwargs.get("BLOCK_SIZE"),
        "bwd": sp._state_passing_bwd_kernel.best_config.kwargs.get("BLOCK_SIZE"),
    }
    if seq is not None:
        return res

    fns = {
        "upstream_fwd_bf16": lambda: sp._state_passing_fwd(states, dA, initial_states=init, out_dtype=bf16),
        "upstream_fwd_fp32": lambda: sp._state_passing_fwd(states, dA, initial_states=init),
        "upstream_bwd": lambda: sp._state_passing_bwd(prev, dA, dout, dfinal_states=dfinal, **bkw),
    }
    for block in args.blocks:
        for warps in args.warps:
            tag = f"b{block}_w{warps}"
            kw = dict(block=block, num_warps=warps)
            fns[f"ours_fwd_bf16_{tag}"] = lambda kw=kw: ps.state_passing_fwd(states, dA, init, out_dtype=bf16, **kw)
            fns[f"ours_fwd_fp32_{tag}"] = lambda kw=kw: ps.state_passing_fwd(states, dA, init, **kw)
            fns[f"ours_bwd_{tag}"] = lambda kw=kw: ps.state_passing_bwd(prev, dA, dout, dfinal, None, **bkw,
                                                                        dinit_dtype=torch.float32, **kw)  # fmt: skip
    ms = _time(fns, args.rounds, args.launches)
    res["ms"] = ms
    state_bytes = nchunks * nheads * dim * 4
    moved = {"fwd_bf16": state_bytes * 1.5, "fwd_fp32": state_bytes * 2, "bwd": state_bytes * 3}  # read + write
    res["gb_per_s"] = {n: moved[next(k for k in moved if k in n)] / (t * 1e-3) / 1e9 for n, t in ms.items()}
    for kind in moved:
        ours = {n: t for n, t in ms.items() if n.startswith(f"ours_{kind}_")}
        best = min(ours, key=ours.get)
        res[f"best_{kind}"] = dict(name=best, ms=ours[best], upstream_ms=ms[f"upstream_{kind}"],
                                   ratio=ours[best] / ms[f"upstream_{kind}"])  # fmt: skip
        default = f"ours_{kind}_b{ps.BLOCK}_w{ps.NUM_WARPS}"
        if default in ms:
            res[f"default_{kind}_ratio"] = ms[default] / ms[f"upstream_{kind}"]
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nchunks", type=_ints, default=_ints("64,128,256,1024"))
    p.add_argument("--nheads", type=int, default=64)
    p.add_argument("--dim", type=int, default=64 * 128)
    p.add_argument("--blocks", type=_ints, default=_ints("128,256,512,1024"))
    p.add_argument("--warps", type=_ints, default=_ints("2,4,8"))
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    sp = _upstream.mamba_module("ops.triton.ssd_state_passing")
    cells = []
    for nchunks in args.nchunks:
        cell = _cell(sp, nchunks, args.nheads, args.dim, args)
        cells.append(cell)
        short = {k: v for k, v in cell.items() if k.startswith(("equal", "ddA", "best", "default", "diff", "dinit"))}
        print(f"nchunks={nchunks}: {json.dumps(short)}", flush=True)
    # packed rows: documents of 3000 tokens (starts inside chunks), the equality only
    labels = (torch.arange(64 * 128, device="cuda") // 3000).int()[None]
    cell = _cell(sp, 64, args.nheads, args.dim, args, seq=labels, chunk_size=128)
    cells.append(cell)
    print(f"packed: {json.dumps(cell)}", flush=True)
    doc = dict(environment=_environment(args.git_commit), args={k: str(v) for k, v in vars(args).items()}, cells=cells)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    ok = all(c["equal_fwd_bf16"] and c["equal_fwd_fp32"] and all(c["equal_bwd"].values()) for c in cells)
    print("all equal" if ok else "NOT EQUAL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
