"""ops/launch.py's logic on CPU: keys, recorded configs and pre-hooks, the argument layout, the fallbacks.

No GPU here, so Triton cannot compile: the kernels below are real ``@triton.jit`` / ``@triton.autotune`` /
``@triton.heuristics`` objects whose innermost ``JITFunction.run`` is replaced by a stand-in with Triton's
contract (binds the arguments, keeps one "compiled kernel" per specialization: dtype and 16-byte alignment of
each tensor, the value class of each int, the constexprs; runs the kernel's math in PyTorch through that
kernel's C-launcher-like ``run``). What the stand-in cannot show (Triton's real specialization and launcher
convention) is checked on the GPU by tests/test_gpu_launch.py in check mode. Everything here is exact: the
kernels' math is the same PyTorch code on both paths.
"""

from __future__ import annotations

import inspect
import types

import numpy
import pytest
import torch
import triton
import triton.language as tl

from ds_mamba_spcp.ops import launch

pytestmark = pytest.mark.filterwarnings("ignore:ds_mamba_spcp. DS_MAMBA_SPCP_FAST_LAUNCH is on")


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, ACC: tl.constexpr = False):
    pass  # the stand-in runs out (+)= alpha * x + y over the first n elements


def _axpy_math(vals):
    x, y, out, n, alpha, _block, acc = vals
    res = alpha * x[:n] + y[:n]
    if acc:
        out[:n] += res
    else:
        out[:n] = res


def _zero_out(nargs):
    nargs["out_ptr"].zero_()


class _FakeCompiled:
    """A compiled kernel as JITFunction.run's launch reads it: run(grid..., stream, function, packed, metadata,
    enter hook, exit hook, *every parameter in signature order)."""

    def __init__(self, math, log):
        self.math, self.log = math, log
        self.function, self.packed_metadata = object(), object()

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter, exit_, *vals):
        assert function is self.function and packed is self.packed_metadata and stream == "stream-0"
        self.log.append(("direct", (g0, g1, g2), vals))
        self.math(vals)


def _spec_of(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("u1",)
    if isinstance(a, int):
        return ("i32", a == 1, a % 16 == 0)
    return (type(a).__name__,)


def _install_stand_in(jit, math, log, extra_spec=lambda bound: ()):
    """jit.run := Triton's contract on CPU (see the module docstring)."""
    sig = inspect.signature(jit.fn)
    cache = {}

    def run(*args, grid, warmup, **kwargs):
        params = {k: v for k, v in kwargs.items() if k in sig.parameters}
        bound = sig.bind(*args, **params)
        bound.apply_defaults()
        vals = tuple(bound.arguments.values())
        key = (tuple(_spec_of(v) for v in vals), extra_spec(bound.arguments), tuple(sorted(kwargs.items())))
        kernel = cache.setdefault(key, _FakeCompiled(math, log))
        if not warmup:
            g = grid(bound.arguments) if callable(grid) else grid
            log.append(("triton", tuple(g) + (1,) * (3 - len(g)), vals))
            math(vals)
        return kernel

    jit.run = run
    return cache


@pytest.fixture
def fake_gpu(monkeypatch):
    """Device 0, stream 'stream-0', launch counts from zero, fast launch on."""
    monkeypatch.setattr(launch, "_driver_calls", lambda: (lambda: 0, lambda device: f"stream-{device}"))
    monkeypatch.setattr(launch, "COUNTS", launch.COUNTS.__class__())
    monkeypatch.setenv(launch.ENV, "1")
    yield
    _axpy.__dict__.pop("run", None)


def _tensors(n=32, offset=0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + offset, generator=g)[offset:]
    return x, torch.randn(n, generator=g), torch.full((n,), 7.0)


def test_repeat_launch_goes_direct_with_triton_argument_layout(fake_gpu):
    log = []
    _install_stand_in(_axpy, _axpy_math, log)
    fast = launch.launcher(_axpy)
    x, y, out = _tensors()
    grid = lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)  # noqa: E731
    for _ in range(3):
        fast[grid](x, y, out, 32, 2.0, BLOCK=8, num_warps=4)
    assert [entry[0] for entry in log] == ["triton", "direct", "direct"]
    assert launch.COUNTS["_axpy", "first"] == 1 and launch.COUNTS["_axpy", "fast"] == 2
    # the C launcher gets every parameter in signature order, the default of ACC filled in, and the grid
    # evaluated on the bound parameters (num_warps is a launch option, not a parameter)
    assert log[1][1] == (4, 1, 1) and log[1][2][3:] == (32, 2.0, 8, False)
    assert all(a is b for a, b in zip(log[1][2][:3], (x, y, out)))
    torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change",
    ["misaligned tensor", "int 16 -> 17", "int 1", "bool instead of int", "float instead of int", "dtype", "kwarg",
     "triton dtype"],
)  # fmt: skip
def test_a_new_specialization_is_a_new_key(fake_gpu, change):
    """Every change Triton specializes on takes the key's first launch (through Triton) again: a key that missed
    one would launch a kernel compiled for other arguments."""
    log = []
    _install_stand_in(_axpy, _axpy_math, log)
    fast = launch.launcher(_axpy)
    x, y, out = _tensors(n=40)
    base = dict(BLOCK=8, ACC=tl.float32) if change == "triton dtype" else dict(BLOCK=8)
    fast[(1,)](x[:32], y[:32], out[:32], 16, 2.0, **base)
    fast[(1,)](x[:32], y[:32], out[:32], 16, 2.0, **base)
    args, kwargs = [x[:32], y[:32], out[:32], 16, 2.0], dict(base)
    if change == "misaligned tensor":
        args[0] = x[1:33]  # 4 bytes past a 16-byte boundary
    elif change == "int 16 -> 17":
        args[3] = 17
    elif change == "int 1":
        args[3] = 1
    elif change == "bool instead of int":
        args[3] = True
    elif change == "float instead of int":
        args[4] = 2  # alpha as an int
    elif change == "dtype":
        args[1] = y[:32].double()
    elif change == "triton dtype":
        kwargs["ACC"] = tl.float16  # after tl.float32 below: keyed by value
    else:
        kwargs["ACC"] = True
    fast[(1,)](*args, **kwargs)
    assert [entry[0] for entry in log] == ["triton", "direct", "triton"]


def test_autotuned_kernel_runs_the_config_pre_hook_on_every_direct_launch(fake_gpu, monkeypatch):
    """mamba-ssm's configs zero their accumulators in a pre-hook: the direct launch must run it too (ACC=True
    here: the kernel adds into out, which starts at 7)."""
    log = []
    tuner = triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=2, pre_hook=_zero_out)], key=["n"])(_axpy)
    _install_stand_in(_axpy, _axpy_math, log)
    fast = launch.launcher(tuner)
    x, y, out = _tensors()
    for _ in range(4):
        out.fill_(7.0)
        fast[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, y, out, 32, 2.0, ACC=True)
        torch.testing.assert_close(out, 2.0 * x + y, rtol=0, atol=0)
    # the tuner's own launch, then the jit's first launch with the recorded config, then direct ones
    assert [entry[0] for entry in log] == ["triton", "triton", "direct", "direct"]
    assert log[-1][1] == (2, 1, 1) and log[-1][2][5] == 16  # the config's BLOCK, in the grid and the arguments

    # negative control: the same launches with the recorded pre-hook dropped leave out's 7s in the sum
    assert fast.best_config is tuner.configs[0] and fast.configs is tuner.configs
    with pytest.raises(AttributeError):
        getattr(fast, "run")  # noqa: B009 (the tuner's own launch would bypass the launcher's best_config)
    for entry in fast.entries.values():
        entry[0] = None
    out.fill_(7.0)
    fast[(2,)](x, y, out, 32, 2.0, ACC=True)
    torch.testing.assert_close(out, 2.0 * x + y + 7.0)  # and not the sum alone, as above


def test_heuristics_are_evaluated_on_every_launch(fake_gpu):
    """A heuristic may read what the key leaves out (a shape): its value is computed per launch."""
    log = []
    heur = triton.heuristics({"ACC": lambda args: args["x_ptr"].shape[0] > 32})(_axpy)
    _install_stand_in(_axpy, _axpy_math, log)
    fast = launch.launcher(heur)
    x, y, out = _tensors(n=64)
    for xs in (x[:32], x[:32], x[:64], x[:64]):
        fast[(1,)](xs, y, out, 16, 1.0, BLOCK=8)
    assert [entry[2][-1] for entry in log] == [False, False, True, True]
    assert [entry[0] for entry in log] == ["triton", "direct", "triton", "direct"]


def test_check_mode_catches_a_specialization_the_key_lacks(fake_gpu, monkeypatch):
    """Check mode asks Triton which kernel it would launch: a Triton that specialized on something the key
    leaves out (here, the stand-in specializes on x's length) is caught instead of launching the wrong one."""
    log = []
    _install_stand_in(_axpy, _axpy_math, log, extra_spec=lambda bound: (bound["x_ptr"].shape[0],))
    fast = launch.launcher(_axpy, check=True)
    x, y, out = _tensors(n=64)
    fast[(1,)](x[:32], y, out, 16, 1.0, BLOCK=8)
    fast[(1,)](x[:32], y, out, 16, 1.0, BLOCK=8)  # the same specialization: passes the check
    assert launch.COUNTS["_axpy", "fast"] == 1
    with pytest.raises(launch.LaunchMismatch, match="another compiled kernel"):
        fast[(1,)](x[:48], y, out, 16, 1.0, BLOCK=8)


def test_launch_hooks_and_unkeyable_arguments_go_through_triton(fake_gpu, monkeypatch):
    log = []
    _install_stand_in(_axpy, _axpy_math, log)
    fast = launch.launcher(_axpy)
    x, y, out = _tensors()
    fast[(1,)](x, y, out, 32, 1.0, BLOCK=8)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    fast[(1,)](x, y, out, 32, 1.0, BLOCK=8)  # a profiler's hook must see the launch
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    fast[(1,)](x, y, out, numpy.int64(32), 1.0, BLOCK=8)  # not a Python int: not keyed
    assert [entry[0] for entry in log] == ["triton"] * 3 and launch.COUNTS["_axpy", "through"] == 2


def test_mode_values(monkeypatch):
    for raw, want in (("0", "off"), ("1", "on"), ("check", "check")):
        monkeypatch.setenv(launch.ENV, raw)
        assert launch.mode() == want
    # unset or auto: the layer only on a Triton that tests/test_gpu_launch.py has passed on
    for verified, want in (((triton.__version__,), "on"), (("0.0.0",), "off")):
        monkeypatch.setattr(launch, "VERIFIED_TRITON", verified)
        launch._auto.cache_clear()
        for raw in ("", "auto"):
            monkeypatch.setenv(launch.ENV, raw)
            assert launch.mode() == want, (verified, raw)
        monkeypatch.delenv(launch.ENV)
        assert launch.mode() == want
    launch._auto.cache_clear()
    monkeypatch.setenv(launch.ENV, "yes")
    with pytest.raises(ValueError, match="expected 0"):
        launch.mode()


def test_state_passing_kernel_values(monkeypatch):
    """DS_MAMBA_SPCP_STATE_PASSING: ops/pass_states.py's kernels unless 'upstream'; empty is the default, as for the
    package's other variables (it raised); a typo is refused, not read as either."""
    from ds_mamba_spcp.ops import pass_states

    monkeypatch.delenv(pass_states.ENV, raising=False)
    assert pass_states.enabled()
    for raw, want in (("prefetch", True), ("upstream", False), ("", True), (" Upstream ", False)):
        monkeypatch.setenv(pass_states.ENV, raw)
        assert pass_states.enabled() is want
    monkeypatch.setenv(pass_states.ENV, "mamba")
    with pytest.raises(ValueError, match="expected 'prefetch'"):
        pass_states.enabled()


# ---------------------------------------------------------------------------------------------
# mamba-ssm's wrappers, rebound
# ---------------------------------------------------------------------------------------------

MAMBA_MODULES = ("ssd_bmm", "ssd_chunk_state", "ssd_state_passing", "ssd_chunk_scan", "ssd_combined",
                 "layernorm_gated")  # fmt: skip
# the wrappers ops/triton.py calls, by module
CALLED = {
    "ssd_bmm": ("_bmm_chunk_fwd", "_bmm_chunk_bwd"),
    "ssd_chunk_state": ("_chunk_cumsum_fwd", "_chunk_cumsum_bwd", "_chunk_state_fwd", "_chunk_state_bwd_db"),
    "ssd_state_passing": ("_state_passing_fwd", "_state_passing_bwd"),
    "ssd_chunk_scan": (
        "_chunk_scan_fwd",
        "_chunk_scan_bwd_dz",
        "_chunk_scan_bwd_dstates",
        "_chunk_scan_bwd_dcb",
        "_chunk_scan_bwd_ddAcs_stable",
        "_chunk_scan_bwd_dC",
    ),  # fmt: skip
    "ssd_combined": ("_chunk_scan_chunk_state_bwd_dx",),
    "layernorm_gated": ("_layer_norm_fwd", "_layer_norm_bwd"),
}


def _names_reached(code):
    """Global names a code object and the code nested in it (lambdas, inner functions) read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_reached(const)
    return names


@pytest.fixture(scope="module")
def mamba_modules():
    from ds_mamba_spcp import _upstream

    return [_upstream.mamba_module(f"ops.triton.{name}") for name in MAMBA_MODULES]


def _escapes(spaces, mamba_modules):
    """Walk from each wrapper ops/triton.py calls (in ``spaces``) through every global it, or a function it calls,
    reads: (what escapes Triton's path: kernels, original mamba-ssm functions, the modules themselves; the names of
    the launchers reached)."""
    originals = {id(m) for m in mamba_modules}
    mamba_functions = {
        id(f) for m in mamba_modules for f in vars(m).values()
        if isinstance(f, types.FunctionType) and f.__globals__ is vars(m)
    }  # fmt: skip
    escapes, launchers, seen = [], set(), set()
    todo = [vars(spaces[f"mamba_ssm.ops.triton.{m}"])[name] for m, names in CALLED.items() for name in names]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if id(fn) in mamba_functions:
            escapes.append(f"{fn.__qualname__} is the original")
            continue
        for name in _names_reached(fn.__code__):
            obj = fn.__globals__.get(name)
            if launch.is_kernel(obj):
                escapes.append(f"{fn.__qualname__} reaches {name}, a kernel launched through Triton")
            elif id(obj) in originals:
                escapes.append(f"{fn.__qualname__} reads the module {name}")
            elif isinstance(obj, launch._Launcher):
                launchers.add(obj.name)
            elif isinstance(obj, types.FunctionType) and obj.__module__.startswith("mamba_ssm.ops.triton"):
                todo.append(obj)
            elif isinstance(obj, types.FunctionType) and obj.__module__.startswith("mamba_ssm"):
                # defined elsewhere in mamba-ssm (utils.determinism): left as it is, so it must launch nothing
                reached = [obj.__globals__.get(n) for n in _names_reached(obj.__code__)]
                if any(launch.is_kernel(o) for o in reached):
                    escapes.append(f"{obj.__qualname__} launches a kernel")
    return escapes, launchers


def test_redirect_reaches_every_launch_of_the_called_wrappers(mamba_modules):
    """No launch of the wrappers ops/triton.py calls escapes to Triton's path."""
    escapes, launchers = _escapes(launch.redirect(mamba_modules), mamba_modules)
    assert escapes == []
    # the SSD kernels the backward and forward launch, among others
    assert {"_chunk_scan_chunk_state_bwd_dx_kernel", "_state_passing_bwd_kernel", "_layer_norm_fwd_1pass_kernel",
            "_chunk_cumsum_fwd_kernel", "_bmm_chunk_fwd_kernel"} <= launchers  # fmt: skip


def test_a_kernel_left_unreplaced_is_caught(mamba_modules):
    """Negative control: one kernel put back as Triton's object in a copy (as a redirect that missed it would
    leave it), and the walk names it."""
    spaces = launch.redirect(mamba_modules)
    chunk_scan = mamba_modules[3]
    vars(spaces[chunk_scan.__name__])["_chunk_scan_bwd_dz_kernel"] = chunk_scan._chunk_scan_bwd_dz_kernel
    escapes, _ = _escapes(spaces, mamba_modules)
    assert escapes == ["_chunk_scan_bwd_dz reaches _chunk_scan_bwd_dz_kernel, a kernel launched through Triton"]


def test_redirect_leaves_the_modules_alone(mamba_modules):
    before = [dict(vars(m)) for m in mamba_modules]
    spaces = launch.redirect(mamba_modules)
    assert all(vars(m) == b for m, b in zip(mamba_modules, before))
    chunk_scan = mamba_modules[3]
    original = chunk_scan._chunk_scan_fwd
    rebound = spaces[chunk_scan.__name__]._chunk_scan_fwd
    assert rebound.__code__ is original.__code__ and original.__globals__ is vars(chunk_scan)
    assert isinstance(rebound.__globals__["_chunk_scan_fwd_kernel"], launch._Launcher)
    # ssd_combined imported ssd_bmm's wrapper: its copy reaches ssd_bmm's copy
    combined = spaces["mamba_ssm.ops.triton.ssd_combined"]
    assert combined._bmm_chunk_fwd is spaces["mamba_ssm.ops.triton.ssd_bmm"]._bmm_chunk_fwd
