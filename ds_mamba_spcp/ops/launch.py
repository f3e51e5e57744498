"""Triton launches at the host cost of the compiled kernel's C launcher (issue 23; on by default where the
installed Triton is one ``tests/test_gpu_launch.py`` has passed on, ``VERIFIED_TRITON``).

Why: on the H200 host, Triton's Python launch path (``Autotuner.run`` then ``JITFunction.run``) costs 90-120 us
per launch inside a training step, against ~6-11 us for the compiled kernel's C launcher under it; a 16K tile
makes ~23 such launches, 2.0 of its 4.8 ms of host time (docs/host_time.md, "Where a step's host time goes").

With ``DS_MAMBA_SPCP_FAST_LAUNCH`` unset (or ``auto``) on a verified Triton, or ``1`` on any, the Triton backend
(``ops/triton.py``) launches mamba-ssm's kernels and its own through this module (``0``: Triton's own path):

- ``launcher(kernel)`` wraps a ``@triton.jit`` function, and ``@triton.autotune`` / ``@triton.heuristics``
  layers over one, in an object launched the same way (``launcher(kernel)[grid](*args, **kwargs)``).
- A launch computes a key from its arguments. The first launch of a key goes through Triton unchanged and
  records what Triton chose: the autotuner's config (its kwargs and its pre-hook, mamba-ssm's
  ``init_to_zero``) and the compiled kernel. Later launches of the key run the config's pre-hook and call the
  compiled kernel's C launcher with the arguments in the order Triton's own launch passes them (every
  parameter in signature order, defaults filled in).
- ``redirect(modules)`` gives copies of mamba-ssm's module namespaces whose functions (``_chunk_scan_fwd``,
  ...; the same code objects, other globals) launch through such launchers. mamba-ssm's modules, and every
  other caller of their kernels (mamba-ssm's own op), are left as they are.

Soundness rests on the key determining everything Triton derives from the arguments:

- non-tensor arguments by type and value: exact ints (Triton specializes ints on ``== 1``, on divisibility by
  16 and on their range), floats, bools, None, strings and Triton dtypes by value. So the key is never coarser
  than Triton's specialization, nor than the autotuner's key (its key arguments' values and every tensor's
  dtype);
- tensors by dtype and address modulo 16 (Triton's tensor specialization on NVIDIA GPUs is 16-byte alignment);
  the keywords' names, types and values; the current device.

Any other argument type (tensor descriptors, Triton's tensor wrappers, tuples) sends that launch through
Triton. Heuristics are evaluated on every launch (they may read shapes, which the key leaves out). What
Triton's path does that this one skips, on purpose: the check that the globals a kernel read when compiled
have not changed (mamba-ssm's kernels read no mutable globals), and knobs changed after a key's first launch
(``knobs.runtime.debug``, instrumentation) are not seen. Launch hooks (``knobs.runtime.launch_enter_hook``,
as Proton sets them) or a kernel's ``pre_run_hooks`` send every launch through Triton.

``DS_MAMBA_SPCP_FAST_LAUNCH=check`` launches the same way and, on every recorded launch, also asks Triton
which compiled kernel it would launch (``JITFunction.run(..., warmup=True)``) and binds the arguments with
``inspect.signature`` (which Triton's binder reproduces), and raises ``LaunchMismatch`` on any difference:
``tests/test_gpu_launch.py`` runs so. Under ``torch.compile`` the backend launches through Triton as before.
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import inspect
import operator
import os
import types
import warnings

import torch

ENV = "DS_MAMBA_SPCP_FAST_LAUNCH"
_MODES = {"": "auto", "auto": "auto", "0": "off", "1": "on", "check": "check"}
# Triton versions whose compiled-kernel launch convention tests/test_gpu_launch.py has passed on (3.6.0: on one
# H200, both cases, check mode and the production path, at 390aa9d). Unset, the variable means this layer on
# these versions and Triton's own path on any other; 1 on another version warns, once
VERIFIED_TRITON: tuple[str, ...] = ("3.6.0",)
MAX_KEYS = 64  # per launcher: past it, new keys go through Triton (a call site whose arguments never repeat)

# launches per (kernel name, path): "fast" (the C launcher), "first" (a key's first launch, through
# Triton), "through" (Triton's path: an unkeyable argument, launch hooks, a kernel this module cannot read),
# "config" (an autotuned kernel launched with the config recorded for its key, then through the launcher below
# it), "interpreted" (TRITON_INTERPRET)
COUNTS: collections.Counter = collections.Counter()
# while ops/programs.py records a call (any thread): a hook every launch of a launcher goes to, which records it
# (in the recording's thread) and launches it
RECORDING: list = []


class LaunchMismatch(RuntimeError):
    """Check mode: a recorded launch differs from what Triton would launch."""


def mode() -> str:
    """'off', 'on' or 'check', from ``DS_MAMBA_SPCP_FAST_LAUNCH`` (read on every call); unset or ``auto``: 'on'
    where the installed Triton is one of ``VERIFIED_TRITON``, else 'off'."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw not in _MODES:
        raise ValueError(
            f"{ENV}={raw!r}: expected 0 (Triton's own launch path), 1 (this package's launch layer), check (the "
            f"layer, every launch verified against Triton) or auto / unset (the layer on a verified Triton: "
            f"{', '.join(VERIFIED_TRITON)})"
        )
    found = _MODES[raw]
    return _auto() if found == "auto" else found


@functools.cache
def _auto() -> str:
    try:
        import triton
    except ImportError:
        return "off"
    return "on" if triton.__version__ in VERIFIED_TRITON else "off"


# ---------------------------------------------------------------------------------------------
# the key
# ---------------------------------------------------------------------------------------------


class _Unkeyable(Exception):
    pass


def _value_types():
    """Argument types keyed by value: Python scalars, and Triton's dtypes (mamba-ssm passes ``tl.bfloat16`` as a
    constexpr: hashable, compared by name)."""
    types = {int, float, bool, str, type(None)}
    try:
        import triton.language as tl

        types.add(type(tl.float32))
    except ImportError:  # pragma: no cover - Triton is a dependency of the backend that imports this module
        pass
    return frozenset(types)


_BY_VALUE = _value_types()


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, (a.data_ptr() & 15) == 0)
    t = type(a)
    if t in _BY_VALUE:
        return (t, a)  # (bool, True) is not 1, (float, 1.0) is not 1: Triton types them apart
    raise _Unkeyable


def _getter(positions):
    """args -> the tuple of args at these positions (C-level itemgetter; it returns a bare item for one)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        (only,) = positions
        return lambda args: (args[only],)
    return operator.itemgetter(*positions)


def _plan(types):
    """How to key positional arguments of these types: getters of the by-value ones and of the tensors, or None
    when one of them is of a type not keyed."""
    by_value, tensors = [], []
    for i, t in enumerate(types):
        if t in _BY_VALUE:
            by_value.append(i)
        elif issubclass(t, torch.Tensor):
            tensors.append(i)
        else:
            return None
    return _getter(by_value), _getter(tensors)


_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = operator.methodcaller("data_ptr")


class _Keys:
    """The key of a launch: the device; the positional arguments' types (so a bool or a float never meets an int),
    the by-value ones' values, each tensor's dtype and address modulo 16 (Triton specializes on 16-byte
    alignment; a finer key only costs another first launch); the keywords' names, types and values. Per tuple of
    types, a plan picks them out with C-level getters (mamba-ssm's launches take 27-74 arguments)."""

    __slots__ = ("plans",)

    def __init__(self):
        self.plans = {}

    def __call__(self, device, args, kwargs):
        types = tuple(map(type, args))
        plan = self.plans.get(types)
        if plan is None:
            getters = _plan(types)
            plan = self.plans[types] = False if getters is None else (len(self.plans), *getters)
        if plan is False:
            raise _Unkeyable
        number, by_value, tensors = plan  # the plan's number stands for the types in the key (one hash less)
        ts = tensors(args)
        ptrs = tuple(map(_DATA_PTR, ts))
        # all 16-byte aligned (the usual case, one C-level reduction), else each tensor's address modulo 16
        misalign = True if not functools.reduce(operator.or_, ptrs, 0) & 15 else tuple([p & 15 for p in ptrs])
        if kwargs:
            values = tuple(kwargs.values())
            kinds = tuple(map(type, values))
            if _BY_VALUE.issuperset(kinds):
                named = (tuple(kwargs), kinds, values)
            else:
                named = tuple([(k, _arg_key(v)) for k, v in kwargs.items()])
        else:
            named = ()
        return device, number, by_value(args), tuple(map(_DTYPE, ts)), misalign, named


class _Named(collections.abc.Mapping):
    """The arguments by name, looked up on demand: what a config's pre-hook and a grid function read (two or
    three names) without building a dict of all of them on every launch. names: {name: position}; later
    positions are read from ``extra``."""

    __slots__ = ("_names", "_args", "_extra")

    def __init__(self, names, args, extra):
        self._names, self._args, self._extra = names, args, extra

    def __getitem__(self, name):
        i = self._names.get(name)
        if i is not None and i < len(self._args):
            return self._args[i]
        return self._extra[name]

    def __iter__(self):
        n = len(self._args)
        yield from (name for name, i in self._names.items() if i < n)
        yield from (name for name in self._extra if self._names.get(name, n) >= n)

    def __len__(self):
        return sum(1 for _ in self)


# ---------------------------------------------------------------------------------------------
# the runtime pieces of Triton this reads (resolved on first use: a CPU machine has no active driver)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _triton():
    import triton
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every Triton this package supports has it
        InterpretedFunction = ()
    knobs = getattr(triton, "knobs", None)
    return types.SimpleNamespace(
        version=triton.__version__, JITFunction=JITFunction, Autotuner=Autotuner, Heuristics=Heuristics,
        InterpretedFunction=InterpretedFunction, runtime_knobs=None if knobs is None else knobs.runtime,
    )  # fmt: skip


@functools.cache
def _driver_calls():
    """(current device, current stream of a device): the calls JITFunction.run makes, bound once."""
    from triton.runtime.driver import driver

    active = driver.active
    return active.get_current_device, active.get_current_stream


def _hook_set(hook) -> bool:
    # a hook, None, or (later Tritons) a HookChain that is never None and may hold no call
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    rt = _triton().runtime_knobs
    if rt is None:  # Triton before knobs keeps the hooks on CompiledKernel
        from triton.compiler.compiler import CompiledKernel

        return _hook_set(CompiledKernel.launch_enter_hook) or _hook_set(CompiledKernel.launch_exit_hook)
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


@functools.cache
def _warn_unverified():
    version = _triton().version
    if version not in VERIFIED_TRITON:
        warnings.warn(
            f"ds_mamba_spcp: {ENV} is on with Triton {version}, on which tests/test_gpu_launch.py has not passed "
            f"(verified: {', '.join(VERIFIED_TRITON) or 'none yet'}); run it (DS_MAMBA_SPCP_FAST_LAUNCH=check) "
            "before trusting results, or unset the variable",
            RuntimeWarning,
            stacklevel=4,
        )


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------


class _Launcher:
    """Launched like the kernel it wraps: ``launcher[grid](*args, **kwargs)``."""

    name: str

    def __getitem__(self, grid):
        return functools.partial(self._call, grid)

    def _call(self, grid, *args, **kwargs):
        if RECORDING:
            return RECORDING[-1](self, grid, args, kwargs)
        return self.launch(grid, args, kwargs)[0]

    def launch(self, grid, args, kwargs):
        """-> (what Triton's launch returns, the recorded compiled launch used, or None)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<fast launcher of {self.name}>"


def _signature(kernel):
    """(inspect.Signature of the kernel's Python function, [(name, default)], {name: position})."""
    sig = inspect.signature(kernel.fn)
    params = [(name, p.default) for name, p in sig.parameters.items()]
    return sig, params, {name: i for i, (name, _) in enumerate(params)}


class _Compiled:
    """One key's compiled kernel, and how to lay a launch's arguments out for its C launcher."""

    __slots__ = ("kernel", "index", "tail", "_run", "_function", "_packed")

    def __init__(self, kernel, params, index, nargs, kwargs):
        self.kernel = kernel
        self.index = index
        tail = []
        for name, default in params[nargs:]:
            if name in kwargs:
                tail.append((True, name))
            elif default is inspect.Parameter.empty:
                raise TypeError(f"missing argument {name}")  # Triton raised first: not reached
            else:
                tail.append((False, default))
        self.tail = tuple(tail)
        # the attributes JITFunction.run's launch reads (AttributeError: a Triton this module cannot read)
        self._run, self._function, self._packed = kernel.run, kernel.function, kernel.packed_metadata

    def values(self, args, kwargs):
        return args + tuple([kwargs[x] if by_name else x for by_name, x in self.tail])

    def launch(self, grid, args, kwargs, device):
        vals = self.values(args, kwargs)
        if callable(grid):
            grid = grid(_Named(self.index, vals, {}))  # Triton passes its bound parameters
        n = len(grid)
        stream = _driver_calls()[1](device)
        self._run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, self._function, self._packed,
                  None, None, None, *vals)  # fmt: skip
        return self.kernel


class _JitLauncher(_Launcher):
    def __init__(self, kernel, check=False):
        self.kernel = kernel
        self.check = check
        self.name = kernel.__name__
        self.signature, self.params, self.index = _signature(kernel)
        self.keys = _Keys()
        self.entries: dict = {}
        self.broken = None  # why this kernel cannot be launched directly (then always through Triton)

    def _through(self, grid, args, kwargs):
        COUNTS[self.name, "through"] += 1
        return self.kernel.run(*args, grid=grid, warmup=False, **kwargs), None

    def launch(self, grid, args, kwargs):
        if getattr(self.kernel, "pre_run_hooks", None) or _hooks_set():
            return self._through(grid, args, kwargs)
        device = _driver_calls()[0]()
        try:
            key = self.keys(device, args, kwargs)
        except _Unkeyable:
            return self._through(grid, args, kwargs)
        entry = self.entries.get(key)
        if entry is None:
            return self._first(key, grid, args, kwargs)
        if self.check:
            self.verify(entry, grid, args, kwargs)
        COUNTS[self.name, "fast"] += 1
        return entry.launch(grid, args, kwargs, device), entry

    def _first(self, key, grid, args, kwargs):
        COUNTS[self.name, "first"] += 1
        kernel = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        if self.broken or len(self.entries) >= MAX_KEYS:  # (a broken kernel has no entries: every launch is here)
            return kernel, None
        try:
            entry = _Compiled(kernel, self.params, self.index, len(args), kwargs)
        except AttributeError as e:
            self.broken = f"its compiled kernel lacks {e}"
            warnings.warn(
                f"ds_mamba_spcp: {self.name} is launched through Triton: {self.broken}", RuntimeWarning, stacklevel=2
            )
            return kernel, None
        self.entries[key] = entry
        return kernel, entry

    def verify(self, entry, grid, args, kwargs):
        """Raise LaunchMismatch unless Triton would launch entry's kernel, with the same arguments."""
        expected = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)
        if hasattr(expected, "result"):
            expected = expected.result()
        if expected is not entry.kernel:
            raise LaunchMismatch(
                f"{self.name}: Triton would launch another compiled kernel for these arguments than the one recorded "
                f"for their key: the key misses a specialization of this Triton ({_triton().version})"
            )
        params = self.signature.parameters
        bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        vals = entry.values(args, kwargs)
        if len(vals) != len(bound.arguments) or any(a is not b for a, b in zip(vals, bound.arguments.values())):
            raise LaunchMismatch(f"{self.name}: the arguments laid out for the C launcher differ from Triton's binding")


class _InterpretedLauncher(_Launcher):
    """Triton's interpreter (TRITON_INTERPRET=1, CPU tests) compiles nothing: every launch goes through it, so
    that the layers above (autotune configs and pre-hooks, heuristics) run as they do on a GPU."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.name = kernel.__name__

    def launch(self, grid, args, kwargs):
        COUNTS[self.name, "interpreted"] += 1
        return self.kernel.run(*args, grid=grid, warmup=False, **kwargs), None


class _AutotuneLauncher(_Launcher):
    """Autotuner.run's branch for a key it has tuned: the chosen config's pre-hook, then the kernel with the
    config's kwargs (num_warps, num_stages, ... included); ``best_config`` is the config of the last launch, as
    on the tuner (mamba-ssm's deterministic mode sizes its workspaces' reduction by it after the launch)."""

    def __init__(self, tuner, inner, check=False):
        self.kernel = tuner
        self.inner = inner
        self.check = check
        self.name = inner.name
        self.index = {name: i for i, name in enumerate(tuner.arg_names)}
        self.keys = _Keys()
        self.entries: dict = {}

    def __getattr__(self, name):
        # what mamba-ssm's wrappers read of their kernels (configs, ...), except the per-launch state, which
        # belongs to this launcher (best_config is set by its own launches, as Autotuner.run sets it), and the
        # tuner's own launch methods, which would leave that state behind: a launch is launcher[grid](...)
        if name in ("best_config", "nargs", "run", "warmup") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def _through(self, grid, args, kwargs):
        COUNTS[self.name, "through"] += 1
        ret = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
        self.best_config = self.kernel.best_config
        return ret, None

    def launch(self, grid, args, kwargs):
        if _hooks_set():
            return self._through(grid, args, kwargs)
        direct = isinstance(self.inner, _JitLauncher)
        try:
            key = self.keys(_driver_calls()[0]() if direct else None, args, kwargs)
        except _Unkeyable:
            return self._through(grid, args, kwargs)
        entry = self.entries.get(key)
        if entry is None:
            # Triton tunes (or reads its cache) and launches; what it chose is then fixed for the key
            COUNTS[self.name, "first"] += 1
            ret = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            config = self.best_config = self.kernel.best_config
            if len(self.entries) < MAX_KEYS:
                self.entries[key] = [config.pre_hook, config.all_kwargs(), None, config]
            return ret, None
        pre_hook, config_kwargs, compiled, self.best_config = entry
        full = {**kwargs, **config_kwargs}
        if pre_hook is not None:
            pre_hook(_Named(self.index, args, full))  # Autotuner.run: {**positional by name, **kwargs, **config}
        if compiled is not None and not self.check and not getattr(self.inner.kernel, "pre_run_hooks", None):
            COUNTS[self.name, "fast"] += 1
            return compiled.launch(grid, args, full, key[0]), compiled
        COUNTS[self.name, "config"] += 1
        ret, compiled = self.inner.launch(grid, args, full)
        if direct:
            entry[2] = compiled  # the inner key is a function of this one and the config: skip it from now on
        return ret, compiled


class _HeuristicsLauncher(_Launcher):
    """Heuristics.run: each heuristic's value from the arguments, on every launch, passed on as a kwarg."""

    def __init__(self, heuristics, inner):
        self.kernel = heuristics
        self.inner = inner
        self.name = inner.name
        self.arg_names = list(heuristics.arg_names)
        self.values = dict(heuristics.values)

    def heuristic_kwargs(self, args, kwargs):
        kwargs = dict(kwargs)
        named = dict(zip(self.arg_names, args))
        for name, heuristic in self.values.items():
            kwargs[name] = heuristic({**named, **kwargs})
        return kwargs

    def launch(self, grid, args, kwargs):
        return self.inner.launch(grid, args, self.heuristic_kwargs(args, kwargs))


class Bound:
    """One launch's compiled kernel bound to everything but its tensors' addresses (``bound``): the config's
    pre-hook, the grid evaluated, the arguments after the positional ones, the device. Called with the positional
    arguments of a launch that differs from the bound one at most in which tensors it passes (same dtypes): launches
    it through the C launcher and returns True, or returns False (nothing launched) where a tensor's address modulo
    16 differs from the bound launch's, which would be another key of the launcher."""

    __slots__ = ("name", "compiled", "pre_hook", "index", "full", "tail", "grid", "device", "stream", "align")

    def __init__(self, name, compiled, pre_hook, index, full, grid, args, device):
        self.name, self.compiled, self.pre_hook, self.index, self.full = name, compiled, pre_hook, index, full
        vals = compiled.values(args, full)
        self.tail = vals[len(args) :]
        if callable(grid):
            grid = grid(_Named(compiled.index, vals, {}))
        n = len(grid)
        self.grid = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        self.device = device
        self.stream = _driver_calls()[1]  # (the active driver's: a compiled kernel is its driver's too)
        # (position, address modulo 16) of each tensor argument
        self.align = tuple((i, a.data_ptr() & 15) for i, a in enumerate(args) if isinstance(a, torch.Tensor))

    def __call__(self, args) -> bool:
        for i, align in self.align:
            if args[i].data_ptr() & 15 != align:
                return False
        if self.pre_hook is not None:
            self.pre_hook(_Named(self.index, args, self.full))
        c = self.compiled
        c._run(*self.grid, self.stream(self.device), c._function, c._packed, None, None, None, *args, *self.tail)
        COUNTS[self.name, "fast"] += 1
        return True


def bound(launcher, grid, args, kwargs) -> Bound | None:
    """The launch ``launcher[grid](*args, **kwargs)`` bound (``Bound``), for a launch whose key the launcher has
    recorded (it ran before); None where it has none, or would not launch it directly (check mode, hooks, an
    argument not keyed, a tensor among the keywords, the interpreter). The grid is evaluated once: it must depend
    only on what the key fixes (mamba-ssm's grids read sizes and the config's block sizes), and the heuristics of a
    ``@triton.heuristics`` layer likewise (mamba-ssm's test arguments for None)."""
    if _hooks_set() or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    if isinstance(launcher, _HeuristicsLauncher):
        kwargs = launcher.heuristic_kwargs(args, kwargs)
        launcher = launcher.inner
    if isinstance(launcher, _AutotuneLauncher):
        if launcher.check or not isinstance(launcher.inner, _JitLauncher):
            return None
        try:
            key = launcher.keys(_driver_calls()[0](), args, kwargs)
        except _Unkeyable:
            return None
        entry = launcher.entries.get(key)
        if entry is None or entry[2] is None or getattr(launcher.inner.kernel, "pre_run_hooks", None):
            return None
        pre_hook, config_kwargs, compiled, _ = entry
        return Bound(launcher.name, compiled, pre_hook, launcher.index, {**kwargs, **config_kwargs}, grid, args, key[0])
    if isinstance(launcher, _JitLauncher):
        if launcher.check or getattr(launcher.kernel, "pre_run_hooks", None):
            return None
        device = _driver_calls()[0]()
        try:
            entry = launcher.entries.get(launcher.keys(device, args, kwargs))
        except _Unkeyable:
            return None
        return None if entry is None else Bound(launcher.name, entry, None, None, kwargs, grid, args, device)
    return None


def is_kernel(obj) -> bool:
    t = _triton()
    return isinstance(obj, (t.JITFunction, t.Autotuner, t.Heuristics)) or (
        bool(t.InterpretedFunction) and isinstance(obj, t.InterpretedFunction)
    )


def launcher(kernel, check=False):
    """The fast launcher of a Triton kernel object, or None for a kind this module does not know. check: verify
    every recorded launch against Triton (``DS_MAMBA_SPCP_FAST_LAUNCH=check``)."""
    t = _triton()
    if isinstance(kernel, t.JITFunction):
        return _JitLauncher(kernel, check)
    if t.InterpretedFunction and isinstance(kernel, t.InterpretedFunction):
        return _InterpretedLauncher(kernel)
    if isinstance(kernel, (t.Autotuner, t.Heuristics)):
        inner = launcher(kernel.fn, check)
        if inner is None:
            return None
        return (
            _AutotuneLauncher(kernel, inner, check)
            if isinstance(kernel, t.Autotuner)
            else _HeuristicsLauncher(kernel, inner)
        )
    return None


# ---------------------------------------------------------------------------------------------
# mamba-ssm's wrappers, rebound
# ---------------------------------------------------------------------------------------------


def _rebound(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__module__ = fn.__module__
    new.__dict__.update(fn.__dict__)
    return new


def redirect(modules, check=False) -> dict[str, types.ModuleType]:
    """Module name -> a copy of that module's namespace in which every Triton kernel is its ``launcher`` and
    every function defined in one of ``modules`` runs with these copies as its globals (so a wrapper that calls
    another module's wrapper, or imported it, reaches the copy). The modules themselves are not changed."""
    _warn_unverified()
    modules = list(modules)
    replaced: dict[int, object] = {}  # id(original) -> its replacement (the originals stay alive in the modules)
    spaces = {m.__name__: types.ModuleType(m.__name__) for m in modules}
    for m in modules:
        for obj in vars(m).values():
            if id(obj) not in replaced and is_kernel(obj):
                fast = launcher(obj, check)
                if fast is not None:
                    replaced[id(obj)] = fast
    for m in modules:
        namespace = vars(spaces[m.__name__])
        for obj in vars(m).values():
            if isinstance(obj, types.FunctionType) and obj.__globals__ is vars(m) and id(obj) not in replaced:
                replaced[id(obj)] = _rebound(obj, namespace)
    for m in modules:
        vars(spaces[m.__name__]).update({name: replaced.get(id(obj), obj) for name, obj in vars(m).items()})
    return spaces
