"""Where a launch's host time goes, and how low a launch can go (issue 23, one CUDA device).

    MAMBA_DETERMINISTIC=1 python3 benchmarks/probe_launch_cost.py --all --steps 30 --out /tmp/launch_cost.json

Default: the host time per call (microseconds, median of ``--reps`` batches of ``--calls`` calls on tensors so
small that the GPU never falls behind) of the layers a launch of this package passes through, from a bare torch op
to mamba-ssm's wrapper around an autotuned Triton kernel, and of the same compiled Triton kernel launched
straight through its C launcher (what a launch layer below Triton's ``JITFunction.run`` would cost).

The steps are ``probe_host_sync``'s (``ideal``, ``tiles_8k``, ``tiles_16k``: 32K tokens, bench_mixer's GPU dims).
``--attribute`` times each one with self-time timers on Triton's launch path, mamba-ssm's functions and
causal-conv1d's (``patch_for_attribution``); ``--ab-conv`` times them with causal-conv1d's custom ops and its C++
functions, alternating; ``--ab-launch`` with Triton's launch path and with ``ops/launch.py``
(DS_MAMBA_SPCP_FAST_LAUNCH=1), alternating, plus the launches per step that took the C launcher; ``--ab-programs``
the same with a third variant, ``ops/programs.py`` over the launch layer (DS_MAMBA_SPCP_PROGRAMS=1); ``--all``
runs ``--ab-conv``, the launch layers and ``--attribute`` into one JSON (``results/launch_cost_023b81d_h200x1.json``).
``--loop NAME`` runs one step for ``--seconds``, for an outside sampling profiler; py-spy could not keep up on
the H200 machine (it fell 20-30 s behind and wrote nothing), which is why ``--attribute`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def per_call_us(fn, calls, reps):
    """Median over ``reps`` batches of the host microseconds per call of ``fn`` (the GPU drained between)."""
    for _ in range(20):
        fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def launch_layers(calls, reps):
    from ds_mamba_spcp.ops import triton as tb

    dev = torch.device("cuda")
    res = {}
    small = torch.zeros(256, device=dev)
    res["torch.empty"] = per_call_us(lambda: torch.empty(256, device=dev), calls, reps)
    res["tensor.add_"] = per_call_us(lambda: small.add_(1.0), calls, reps)

    def ctx():
        with torch.cuda.device(small.device.index):
            pass

    res["with torch.cuda.device"] = per_call_us(ctx, calls, reps)

    # our plain @triton.jit kernel (no autotuner): through our wrapper, through JITFunction.run, and straight
    # through the compiled kernel's C launcher
    b, c, h, p, n = 1, 4, 2, 4, 8
    x = torch.randn(b, c, h, p, n, device=dev)
    dA = torch.randn(b, h, c, device=dev)
    res["ours: _fold_chunks (wrapper)"] = per_call_us(lambda: tb._fold_chunks(x, dA, reverse=False), calls, reps)
    flat = x.reshape(b, c, h, p * n)
    out = torch.empty(b, h, p * n, device=dev)
    block = 32
    grid = (1, b, h)
    args = (flat, dA, out, flat, out, c, p * n, 0, 0, *flat.stride(), *dA.stride(), *out.stride(), 0, 0, 0, 0)
    consts = dict(REVERSE=False, HAS_SEQ_IDX=False, LOG_A=False, BLOCK=block)

    def jit_launch():
        tb._fold_chunks_kernel[grid](*args, **consts, num_warps=4)

    res["ours: JITFunction.run"] = per_call_us(jit_launch, calls, reps)
    kernel = tb._fold_chunks_kernel[grid](*args, **consts, num_warps=4)
    try:
        from triton import knobs

        stream = torch.cuda.current_stream().cuda_stream
        all_args = (*args, *consts.values())
        meta = kernel.launch_metadata(grid, stream, *all_args)
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook

        def direct():
            kernel.run(1, b, h, stream, kernel.function, kernel.packed_metadata, meta, enter, exit_, *all_args)

        direct()
        torch.cuda.synchronize()
        ref = out.clone()
        out.zero_()
        direct()
        torch.cuda.synchronize()
        res["direct launch equals JITFunction.run"] = bool(torch.equal(ref, out))
        res["ours: CompiledKernel.run (C launcher)"] = per_call_us(direct, calls, reps)
    except Exception as e:  # noqa: BLE001 - report what this Triton's internals refused
        res["direct launch error"] = repr(e)[:300]

    # mamba-ssm's wrapper around an autotuned kernel (_chunk_cumsum_fwd: one launch, two torch.empty)
    cs = tb._chunk_state
    dt = torch.randn(1, 512, 8, device=dev, dtype=torch.bfloat16)
    A = -torch.rand(8, device=dev)
    bias = torch.rand(8, device=dev)
    res["mamba-ssm: _chunk_cumsum_fwd (wrapper, autotuned)"] = per_call_us(
        lambda: cs._chunk_cumsum_fwd(dt, A, 256, dt_bias=bias, dt_softplus=True), calls, reps
    )

    # causal-conv1d: its torch.library custom op (what mamba-ssm's op calls) and the C++ function under it
    import causal_conv1d_cuda

    from ds_mamba_spcp import _upstream

    custom_fwd = _upstream.causal_conv1d_custom_ops()[0]

    xc = torch.randn(1, 64, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(64, 4, device=dev, dtype=torch.bfloat16)
    bc = torch.randn(64, device=dev, dtype=torch.bfloat16)
    outc = torch.empty_like(xc)
    res["causal-conv1d: causal_conv1d_fwd_function (custom op)"] = per_call_us(
        lambda: custom_fwd(xc, w, bc, None, None, None, True), calls, reps
    )
    res["causal-conv1d: causal_conv1d_cuda.causal_conv1d_fwd (C++)"] = per_call_us(
        lambda: causal_conv1d_cuda.causal_conv1d_fwd(xc, w, bc, None, None, outc, None, True), calls, reps
    )
    return res


class Attribution:
    """Self host time per wrapped callable (its time less that of wrapped callables it calls)."""

    def __init__(self):
        self.self_s, self.calls, self._stack = {}, {}, []

    def wrap(self, label, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                inner = self._stack.pop()
                self.self_s[label] = self.self_s.get(label, 0.0) + dt - inner
                self.calls[label] = self.calls.get(label, 0) + 1
                if self._stack:
                    self._stack[-1] += dt

        return timed


def patch_for_attribution(att):
    """Wraps Triton's launch path, mamba-ssm's Python wrappers, causal-conv1d's functions and its C++ calls."""
    import types

    import causal_conv1d.cpp_functions as ccf
    import causal_conv1d_cuda
    import triton.runtime.autotuner as at
    import triton.runtime.jit as jit

    from ds_mamba_spcp.ops import triton as tb

    jit.JITFunction.run = att.wrap("triton: JITFunction.run (with the C launch)", jit.JITFunction.run)
    at.Autotuner.run = att.wrap("triton: Autotuner.run", at.Autotuner.run)
    at.Heuristics.run = att.wrap("triton: Heuristics.run", at.Heuristics.run)
    for name in ("causal_conv1d_fwd", "causal_conv1d_bwd"):
        setattr(causal_conv1d_cuda, name, att.wrap("causal-conv1d: C++ " + name, getattr(causal_conv1d_cuda, name)))
    conv = {}
    for name in ("causal_conv1d_fwd_function", "causal_conv1d_bwd_function"):
        conv[getattr(ccf, name)] = att.wrap("causal-conv1d: " + name + " (custom op, its Python)", getattr(ccf, name))
    mods = [tb._bmm, tb._chunk_state, tb._state_passing, tb._chunk_scan, tb._combined, tb._layernorm, tb]
    for mod in mods:
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, types.FunctionType) and obj in conv:
                setattr(mod, name, conv[obj])
            elif mod is not tb and isinstance(obj, types.FunctionType) and obj.__module__ == mod.__name__:
                setattr(mod, name, att.wrap("mamba-ssm: " + name, obj))


def _write(path, res):
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/launch_cost.json")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--loop", default=None, help="run this step of probe_host_sync in a loop instead")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--attribute", default=None, help="steps (comma-separated) to attribute the host time of")
    p.add_argument("--steps", type=int, default=20, help="timed steps per attributed step")
    p.add_argument(
        "--ab-conv",
        default=None,
        help="steps (comma-separated) to time with causal-conv1d's custom ops "
        "and with its C++ functions, alternating step by step",
    )
    p.add_argument(
        "--ab-launch",
        default=None,
        help="steps (comma-separated) to time with Triton's launch path and with ops/launch.py, alternating",
    )
    p.add_argument(
        "--ab-programs",
        default=None,
        help="steps (comma-separated) to time with Triton's launch path, with ops/launch.py alone and with "
        "ops/programs.py over it, alternating",
    )
    p.add_argument("--all", action="store_true", help="--ab-conv, the launch layers and --attribute, into one JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_launch_cost.py needs a CUDA device")
    if args.all:
        names = "ideal,tiles_16k,tiles_8k"
        res = {"ab_conv": ab_conv(names, args.steps), "launch_layers": launch_layers(args.calls, args.reps)}
        args.attribute = names
        res["attribution"] = attribute(args, write=False)
        return _write(args.out, res)
    if args.ab_conv is not None:
        return _write(args.out, ab_conv(args.ab_conv, args.steps))
    if args.ab_launch is not None:
        return _write(args.out, ab_launch(args.ab_launch, args.steps))
    if args.ab_programs is not None:
        return _write(args.out, ab_launch(args.ab_programs, args.steps, programs=True))
    if args.attribute is not None:
        return attribute(args)
    if args.loop is None:
        res = launch_layers(args.calls, args.reps)
        print(json.dumps(res, indent=1))
        return _write(args.out, res)
    inp, steps = _steps()
    fwd = steps[args.loop]
    for _ in range(4):
        torch.autograd.grad(fwd(), inp.leaves, inp.dout)
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        torch.autograd.grad(fwd(), inp.leaves, inp.dout)
        n += 1
    torch.cuda.synchronize()
    print(f"{args.loop}: {n} steps, {(time.perf_counter() - t0) / n * 1e3:.2f} ms per step")


def _steps():
    import bench_mixer as bm
    from probe_host_sync import steps_of

    bargs = bm.parse_args(["--seqlens", "32K"])
    ctx = bm.Context(rank=0, cp=1, device=torch.device("cuda"), backend=bargs.backend, dims=bargs.dims)
    torch.manual_seed(0)
    return steps_of(bargs.cells[0], ctx, [8192, 16384])


def _host_ms(step, inp, n):
    """Median host ms (forward call + backward call, until they return) over n steps, the GPU drained first."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.autograd.grad(step(), inp.leaves, inp.dout)
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def _alternate(names, n, variants, inp, steps):
    """Host ms (forward and backward calls) and step ms (until the GPU is done) of each step (``_steps()``) under
    each variant (name -> a function that switches to it), alternating step by step so that the host's drift falls
    on all alike; medians of ``n`` steps each, after 3 warm-up rounds."""
    res = {}
    for name in names.split(","):
        times = {v: ([], []) for v in variants}
        for i in range(n + 3):
            for v, switch in variants.items():
                switch()
                torch.cuda.synchronize()
                t = time.perf_counter()
                torch.autograd.grad(steps[name](), inp.leaves, inp.dout)
                host = time.perf_counter() - t
                torch.cuda.synchronize()
                if i >= 3:
                    times[v][0].append(host * 1e3)
                    times[v][1].append((time.perf_counter() - t) * 1e3)
        res[name] = {v: {"host_ms": statistics.median(h), "step_ms": statistics.median(s), "steps": n}
                     for v, (h, s) in times.items()}  # fmt: skip
        print(name, json.dumps(res[name]), flush=True)
    return res


def ab_conv(names, n):
    """``_alternate`` with causal-conv1d's custom ops and with its C++ functions
    (``_upstream.causal_conv1d_functions``)."""
    from ds_mamba_spcp import _upstream
    from ds_mamba_spcp.ops import triton as tb

    fns = {"custom_ops": _upstream.causal_conv1d_custom_ops(), "cpp": _upstream.causal_conv1d_functions()}

    def use(v):
        def switch():
            tb._conv_fwd_fn, tb._conv_bwd_fn = fns[v]

        return switch

    try:
        return _alternate(names, n, {v: use(v) for v in fns}, *_steps())
    finally:
        tb._conv_fwd_fn, tb._conv_bwd_fn = fns["cpp"]


def ab_launch(names, n, programs=False):
    """``_alternate`` with Triton's own launch path and with ``ops/launch.py`` (DS_MAMBA_SPCP_FAST_LAUNCH=1), and
    the launches per step of each kind on the latter (``launch.COUNTS``: "fast" ones went through the C launcher).
    The launch layer's variant runs with DS_MAMBA_SPCP_PROGRAMS=0, whose default (on) would replay known-mode
    segments over it. programs: a third variant, ``ops/programs.py`` over the launch layer
    (DS_MAMBA_SPCP_PROGRAMS=1), with the segment calls per step it replayed."""
    from ds_mamba_spcp.ops import launch
    from ds_mamba_spcp.ops import programs as prog

    before = {k: os.environ.get(k) for k in (launch.ENV, prog.ENV)}

    def use(fast, replay="0"):
        return lambda: os.environ.update({launch.ENV: fast, prog.ENV: replay})

    variants = {"triton": use("0"), "fast_launch": use("1")}  # the launch layer alone, as before programs existed
    if programs:
        variants["programs"] = use("1", "1")
    inp, steps = _steps()
    try:
        res = _alternate(names, n, variants, inp, steps)
        for name in names.split(","):
            for v in variants:
                if v == "triton":
                    continue
                variants[v]()
                launch.COUNTS.clear()
                replayed = dict(prog.COUNTS)
                torch.autograd.grad(steps[name](), inp.leaves, inp.dout)
                by_path = {}
                for (_, path), count in launch.COUNTS.items():
                    by_path[path] = by_path.get(path, 0) + count
                res[name][v]["launches_per_step"] = by_path
                res[name][v]["programs_per_step"] = {
                    f"{k[0]}:{k[1]}": c - replayed.get(k, 0) for k, c in prog.COUNTS.items() if c != replayed.get(k, 0)
                }
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return res


def attribute(args, write=True):
    inp, steps = _steps()
    names = args.attribute.split(",")
    res = {}
    for name in names:  # plain host time first, before anything is wrapped
        for _ in range(4):
            torch.autograd.grad(steps[name](), inp.leaves, inp.dout)
        res[name] = {"host_ms_unwrapped": _host_ms(steps[name], inp, args.steps)}
    att = Attribution()
    patch_for_attribution(att)
    for name in names:
        _host_ms(steps[name], inp, 2)
        att.self_s.clear()
        att.calls.clear()
        res[name]["host_ms_wrapped"] = _host_ms(steps[name], inp, args.steps)
        rows = {k: {"self_ms_per_step": v * 1e3 / args.steps, "calls_per_step": att.calls[k] / args.steps}
                for k, v in sorted(att.self_s.items(), key=lambda kv: -kv[1])}  # fmt: skip
        res[name]["attributed"] = rows
        res[name]["rest_ms_per_step"] = res[name]["host_ms_wrapped"] - sum(r["self_ms_per_step"] for r in rows.values())
        print(name, json.dumps(res[name], indent=1), flush=True)
    if write:
        _write(args.out, res)
    return res


if __name__ == "__main__":
    main()
