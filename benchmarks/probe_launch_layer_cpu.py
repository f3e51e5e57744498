"""The host cost of ops/launch.py's direct launch against Triton's own launch path, on CPU (issue 23).

    python benchmarks/probe_launch_layer_cpu.py --out /tmp/launch_layer_cpu.json

No GPU is needed and none is used. Triton's active driver is replaced by one that reports device 0, stream 0
and an sm_90 CUDA target, so that Triton's real ``Autotuner.run`` and ``JITFunction.run`` run: the binder, the
specialization of every argument, the cache key and lookup, the grid, the launch call. The compiled kernel they
look up is a stand-in put into the JIT's cache under the key Triton computes, whose launch is a no-op. Each of
mamba-ssm's autotuned kernels below is launched with arguments of the kinds its wrapper passes (small CPU
tensors for the ``*_ptr`` parameters, distinct ints for the others, its constexprs as keywords), in mamba-ssm's
deterministic mode (MAMBA_DETERMINISTIC=1, set by the script, as in every GPU measurement here) with every
autotune config kept (``--configs all``: TRITON_CACHE_AUTOTUNING=1, as benchmarks/device_one_gpu.sh sets it, so
``Autotuner.run`` builds its key on every launch; a fake benchmarker makes it keep the first config) or one
config per kernel (``--configs one``). Per launch, median of ``--reps`` batches of ``--calls``:

- ``triton_us``: ``Autotuner.run`` then ``JITFunction.run`` (the config's pre-hook included: mamba-ssm's
  ``init_to_zero`` zero-fills);
- ``direct_us``: ops/launch.py's launcher once the key is recorded (its key, the pre-hook, the argument layout,
  the grid, the launch call);
- ``autotuner_only_us``: ``Autotuner.run`` over a ``JITFunction.run`` that returns at once.

Both sides leave out the C launch itself (~6-11 us on the H200 host), which the direct path keeps. The fake
driver and the key reads use the internals of the Triton installed here (3.9 in this project's CPU venv); the
H200 machine's Triton (3.6) is measured on the GPU by ``probe_launch_cost.py --ab-launch``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

KERNELS = {  # module -> autotuned kernels the backward and forward of a segment launch
    "ssd_combined": ("_chunk_scan_chunk_state_bwd_dx_kernel",),
    "ssd_chunk_scan": ("_chunk_scan_fwd_kernel", "_chunk_scan_bwd_dstates_kernel", "_chunk_scan_bwd_dc_kernel"),
    "ssd_chunk_state": ("_chunk_cumsum_fwd_kernel", "_chunk_state_fwd_kernel", "_chunk_state_bwd_db_kernel"),
    "ssd_state_passing": ("_state_passing_fwd_kernel", "_state_passing_bwd_kernel"),
}


class _NoLaunch:
    """A compiled kernel as JITFunction.run reads it, whose launch does nothing."""

    def __init__(self):
        self.function, self.packed_metadata = object(), object()

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        pass


class _CpuDriver:
    """What JITFunction.run asks the active driver: device 0, stream 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        # Autotuner's benchmark of each config: equal times (nothing runs), so it keeps the first config
        return lambda kernel_call, quantiles=None, **kwargs: [1.0, 1.0, 1.0]


def _seed_cache(jit, args, kwargs, kernel):
    """Put ``kernel`` into the JIT's cache under the key its run computes for these arguments (Triton 3.9)."""
    from triton import knobs
    from triton.runtime.jit import compute_cache_key

    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", jit.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    kernel_cache, key_cache, _, _, binder = jit.device_caches[0]
    _, specialization, options = binder(*args, **kw)
    kernel_cache[compute_cache_key(key_cache, specialization, options)] = kernel


def _arguments(tuner):
    """Positional arguments and constexpr keywords of the kinds mamba-ssm's wrapper passes."""
    import triton.language as tl

    tuned = {k for c in tuner.configs for k in c.kwargs}
    args, kwargs = [], {}
    for name, p in inspect.signature(tuner.fn.fn).parameters.items():
        if p.annotation is tl.constexpr or "constexpr" in str(p.annotation):
            if name not in tuned and p.default is inspect.Parameter.empty:
                kwargs[name] = 16 if name.startswith("BLOCK") else False
        elif name.endswith("_ptr"):
            args.append(torch.zeros(64))
        else:
            args.append(64 + len(args))  # distinct ints: strides and sizes
    return args, kwargs


def per_call_us(fn, calls, reps):
    for _ in range(50):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/launch_layer_cpu.json")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--git-commit", default=None, help="the commit measured (default: git rev-parse --short HEAD)")
    p.add_argument(
        "--configs",
        choices=("all", "one"),
        default="all",
        help="all: every autotune config kept (TRITON_CACHE_AUTOTUNING=1, as the GPU runs here set it: Autotuner.run "
        "then builds its key on every launch); one: mamba-ssm's deterministic mode picks one config per kernel",
    )
    args = p.parse_args(argv)
    # mamba-ssm's deterministic mode, as in every GPU measurement of this project; with TRITON_CACHE_AUTOTUNING=1
    # (benchmarks/device_one_gpu.sh sets it) it keeps every config and Triton tunes (here: the fake benchmarker)
    os.environ["MAMBA_DETERMINISTIC"] = "1"
    if args.configs == "all":
        os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
        os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="probe_launch_layer_"))
    else:
        os.environ.pop("TRITON_CACHE_AUTOTUNING", None)
    from triton.runtime.driver import driver

    from ds_mamba_spcp import _upstream
    from ds_mamba_spcp.ops import launch

    driver.set_active(_CpuDriver())
    compiled = _NoLaunch()
    res = {}
    grid = lambda meta: (4, 2, 1)  # noqa: E731
    for module, names in KERNELS.items():
        m = _upstream.mamba_module(f"ops.triton.{module}")
        for name in names:
            tuner = getattr(m, name)
            pos, kw = _arguments(tuner)
            _seed_cache(tuner.fn, pos, {**kw, **tuner.configs[0].all_kwargs()}, compiled)
            fast = launch.launcher(tuner)
            for _ in range(3):  # the tuner's launch, the jit's first launch, then recorded
                fast[grid](*pos, **kw)
            assert launch.COUNTS[name, "fast"] >= 1, launch.COUNTS

            def through_triton(tuner=tuner, pos=pos, kw=kw):
                tuner.run(*pos, grid=grid, warmup=False, **kw)

            def direct(fast=fast, pos=pos, kw=kw):
                fast[grid](*pos, **kw)

            row = {"arguments": len(pos) + len(kw), "tensors": sum(isinstance(a, torch.Tensor) for a in pos)}
            row["triton_us"] = per_call_us(through_triton, args.calls, args.reps)
            row["direct_us"] = per_call_us(direct, args.calls, args.reps)
            tuner.fn.run = lambda *a, **k: compiled  # JITFunction.run returning at once: Autotuner.run alone
            row["autotuner_only_us"] = per_call_us(through_triton, args.calls, args.reps)
            del tuner.fn.run
            res[name] = row
            print(name, json.dumps(row), flush=True)
    commit = (
        args.git_commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
        ).stdout.strip()
    )
    header = dict(
        commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), python=platform.python_version(),
        torch=torch.__version__, triton=__import__("triton").__version__, calls=args.calls, reps=args.reps,
        configs=args.configs,
    )  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"header": header, "kernels": res}, f, indent=1)


if __name__ == "__main__":
    main()
