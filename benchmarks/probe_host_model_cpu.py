"""The host time of a segment on CPU, with every kernel a no-op (issue 23): a model of the glue's host cost.

    python benchmarks/probe_host_model_cpu.py --profile --out /tmp/host_model.json
    python benchmarks/probe_host_model_cpu.py --ab a:SOME_SWITCH=0 b:SOME_SWITCH=1    # two variants, step by step

No GPU is needed and none is used. The Triton backend runs on tiny CPU tensors: Triton's active driver is one that
reports device 0 and stream 0 (``probe_launch_layer_cpu.py``'s), ``JITFunction.run`` returns a compiled kernel whose
launch does nothing, the autotuner keeps each kernel's first config (mamba-ssm's deterministic mode,
``MAMBA_DETERMINISTIC=1`` as in every GPU measurement here) and causal-conv1d's two C++ calls are stand-ins that
allocate what they return. Everything else runs as on a GPU host: the public op (a group of one in tiles), the
tiles, the segment generators, mamba-ssm's wrappers, the launch layer (``ops/launch.py``, on:
``DS_MAMBA_SPCP_FAST_LAUNCH=1``) down to the compiled kernel's launch call, and the torch ops (on CPU tensors of a
few KiB: their own compute is a few us). What it leaves out: the C launcher of each Triton launch (~6-11 us on the
H200 host), the CUDA driver's share of each torch op, and the conv's C++ work.

The variants (``--ab name:VAR=value,VAR=value``) alternate step by step in one process, so that the drift of this
machine (a shared VM: the same step takes 5-12 ms from one run to the next) falls on all of them alike; each
variant's environment is set before its step (the backend reads its modes on every call; a variable that another
variant sets is put back to its value from before the run). Per variant: the median
forward and backward host ms of ``--steps`` steps and the same per segment (tile). ``--profile`` then runs
``--steps`` more steps of the first variant under cProfile and prints (and writes) each layer's own time per
segment: the launch layer, Triton's Python, mamba-ssm's wrappers, this package's modules, torch's Python and the
builtins (torch ops, ``stride()`` calls, ...). cProfile inflates code that makes many small Python calls, so the
layers' shares are a guide, not a measurement; the A/B medians above are the measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import torch  # noqa: E402


def _install():
    """The no-op kernels, the CPU driver, the CUDA shims; then the backend (imported here, after them)."""
    os.environ["MAMBA_DETERMINISTIC"] = "1"
    os.environ.setdefault("DS_MAMBA_SPCP_FAST_LAUNCH", "1")
    import probe_launch_layer_cpu as cpu_launch
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from tests import triton_cpu_shims

    driver.set_active(cpu_launch._CpuDriver())
    compiled = cpu_launch._NoLaunch()
    JITFunction.run = lambda self, *args, **kwargs: compiled

    def first_config(self, *args, **kwargs):  # Autotuner.run with its first config (nothing to benchmark)
        self.best_config = config = self.configs[0]
        full = {**kwargs, **config.all_kwargs()}
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(self.arg_names, args)), **full})
        return self.fn.run(*args, **full)

    Autotuner.run = first_config
    torch.cuda.device = triton_cpu_shims._NoDevice
    torch.cuda.get_device_properties = triton_cpu_shims._device_properties
    from ds_mamba_spcp import _upstream

    _upstream.causal_conv1d_functions = lambda: (None, None)  # replaced below, after the import
    from ds_mamba_spcp.ops import triton as backend

    def conv_fwd(x, weight, bias, seq_idx, initial_states, final_states_out, silu):
        return torch.empty_like(x)

    def conv_bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinit, silu):
        dx = torch.empty_like(x) if dx is None else dx
        dweight = torch.zeros_like(weight, dtype=torch.float32)
        dbias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        dinit = torch.empty(x.shape[0], weight.shape[1] - 1, x.shape[1], dtype=x.dtype).transpose(1, 2)
        return dx, dweight, dbias, dinit if return_dinit else None

    from ds_mamba_spcp.ops import programs

    backend._conv_fwd_fn, backend._conv_bwd_fn = programs.extern(conv_fwd), programs.extern(conv_bwd)
    return backend


def _inputs(seqlen, nheads, headdim, ngroups, dstate, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    d_inner = nheads * headdim
    conv_dim = d_inner + 2 * ngroups * dstate
    t = [
        torch.randn(1, seqlen, 2 * d_inner + 2 * ngroups * dstate + nheads, generator=g).to(dtype),
        torch.randn(conv_dim, 4, generator=g).to(dtype),
        torch.randn(conv_dim, generator=g).to(dtype),
        torch.full((nheads,), -2.0),
        -(torch.rand(nheads, generator=g) + 0.5),
        torch.randn(nheads, generator=g),
    ]
    for x in t:
        x.requires_grad_()
    return t, torch.randn(1, seqlen, d_inner, generator=g).to(dtype)


def _layer(filename: str, name: str) -> str:
    if filename == "~":
        return "builtin: " + name.replace("<built-in method ", "").replace("<method ", "").rstrip(">")
    path = filename.replace(os.sep, "/")
    if "/ds_mamba_spcp/ops/launch.py" in path:
        return "launch layer (ops/launch.py)"
    if "/ds_mamba_spcp/" in path:
        return "ds_mamba_spcp/" + path.rsplit("/ds_mamba_spcp/", 1)[1]
    for lib in ("mamba_ssm", "triton", "torch", "einops"):
        if f"/{lib}/" in path:
            return lib
    return "other"


def _profile(step, steps, segments, env):
    """{layer: own ms per segment} of ``steps`` steps under cProfile, largest first (printed)."""
    import collections
    import cProfile
    import pstats

    os.environ.update(env)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    own = collections.Counter()
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        own[_layer(filename, name)] += tottime * 1e3 / steps / segments
    total = sum(own.values())
    print(f"under cProfile: {total:.3f} ms per segment; each layer's own time:")
    for layer, ms in own.most_common(25):
        print(f"  {ms:7.3f} ms  {100 * ms / total:4.1f}%  {layer}")
    return {"total": total, **dict(own.most_common())}


def _variant(spec: str):
    name, _, assigns = spec.partition(":")
    env = dict(a.split("=", 1) for a in assigns.split(",") if a)
    return name, env


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ab", nargs="+", default=["default:"],
                   help="variants name:VAR=value,VAR=value, alternated step by step")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="each layer's own time per segment, under cProfile")
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--tile-length", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--rmsnorm", action="store_true", help="the gated RMSNorm in the op (as Mamba2 layers run it)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--git-commit", default=None)
    args = p.parse_args(argv)
    _install()
    torch.set_num_threads(1)
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp

    nheads, headdim, ngroups, dstate = 4, 8, 2, 8
    tensors, dout = _inputs(args.seqlen, nheads, headdim, ngroups, dstate)
    extra = {}
    if args.rmsnorm:
        extra["rmsnorm_weight"] = torch.ones(nheads * headdim, dtype=torch.bfloat16, requires_grad=True)
    leaves = tensors + list(extra.values())
    segments = -(-args.seqlen // args.tile_length)
    variants = [_variant(v) for v in args.ab]

    def step():
        t0 = time.perf_counter()
        out = mamba_split_conv1d_scan_sp(
            *tensors, args.chunk_size, backend="triton", tile_length=args.tile_length, headdim=headdim,
            ngroups=ngroups, **extra,
        )  # fmt: skip
        t1 = time.perf_counter()
        torch.autograd.grad(out, leaves, dout)
        return t1 - t0, time.perf_counter() - t1

    times = {name: ([], []) for name, _ in variants}
    # a variable one variant sets is back at its value from before the run for the variants that do not set it
    base = {k: os.environ.get(k) for _, env in variants for k in env}

    def use(env):
        for k, v in base.items():
            if k in env:
                os.environ[k] = env[k]
            elif v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    for i in range(args.warmup + args.steps):
        for name, env in variants:
            use(env)
            fwd, bwd = step()
            if i >= args.warmup:
                times[name][0].append(fwd)
                times[name][1].append(bwd)
    rows = {}
    for name, env in variants:
        fwd, bwd = (statistics.median(x) * 1e3 for x in times[name])
        rows[name] = dict(env=env, fwd_ms=fwd, bwd_ms=bwd, step_ms=fwd + bwd, per_segment_ms=(fwd + bwd) / segments,
                          fwd_per_segment_ms=fwd / segments, bwd_per_segment_ms=bwd / segments)  # fmt: skip
        print(f"{name:>16}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms; per segment {rows[name]['per_segment_ms']:.3f} ms "
              f"(fwd {fwd / segments:.3f}, bwd {bwd / segments:.3f})", flush=True)  # fmt: skip
    use(variants[0][1])
    layers = _profile(step, args.steps, segments, variants[0][1]) if args.profile else None
    if args.out:
        commit = (
            args.git_commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
            ).stdout.strip()
        )
        header = dict(
            commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), python=platform.python_version(),
            torch=torch.__version__, triton=__import__("triton").__version__, seqlen=args.seqlen,
            tile_length=args.tile_length, chunk_size=args.chunk_size, segments=segments, steps=args.steps,
            rmsnorm=args.rmsnorm, dims=dict(nheads=nheads, headdim=headdim, ngroups=ngroups, dstate=dstate),
        )  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"header": header, "variants": rows, "profile_ms_per_segment": layers}, f, indent=1)


if __name__ == "__main__":
    main()
