"""mamba-ssm's single-kernel wrappers replayed as recorded programs (issue 23; ``DS_MAMBA_SPCP_REPLAY``).

Why: with the launch layer (``ops/launch.py``) a segment's Triton launches cost the host ~10-25 us each, but each
of mamba-ssm's wrappers around them (``_chunk_scan_bwd_dcb``, ...) still costs 40-140 us of Python: asserts,
30-70 ``stride()`` calls, the grid lambda, ``torch.cuda.device``, the device properties, the deterministic mode's
workspaces. A segment calls ~19 of them, most of its host time (``benchmarks/probe_host_model_cpu.py``).

What: ``redirect(modules)`` gives copies of mamba-ssm's module namespaces (as ``launch.redirect`` does) in which the
wrappers named in ``MEMOIZED`` are ``Memo`` objects. A call computes a key from its arguments (each tensor's shape,
strides, dtype and device, which tensor arguments are the same object, every other argument by type and value,
mamba-ssm's deterministic mode). A key's first call runs the wrapper under a recorder that keeps, in order, every
aten op it dispatches (with its tensor arguments as references to the call's inputs or to earlier ops' results,
everything else as constants) and every Triton launch (the kernel object, the grid, the arguments the same way),
and what it returns. Later calls of the key replay that program: the same aten ops (``OpOverload`` calls) and the
same launches (through the same kernel objects: the launch layer's launchers, or Triton's own), with the new
call's tensors. Nothing in the program holds a tensor.

Soundness rests on the wrapper's Python being a function of the key: for the same shapes, strides, dtypes, devices
and other arguments, it dispatches the same ops with the same non-tensor arguments and launches the same kernels
with the same grids and scalars. mamba-ssm 2.3.2.post1's wrappers (pinned by ``_upstream``) read nothing else of
their tensors (no values, no addresses: a launch's address alignment is keyed again by the launch layer), and their
only other state is the deterministic mode, which is in the key, and the autotuner's choice, fixed per key by
Triton's cache or the launch layer. A call is run by the wrapper itself, and never recorded, when: grad mode is on
(the recorded ops are those below autograd), an argument is of a type not keyed, a tensor it touches is neither an
input nor made by one of its ops (a module-level tensor), an op reads a value to the host, or the wrapper raised.
Side effects that are neither aten ops nor Triton launches are not replayed, which is why only the wrappers listed
in ``MEMOIZED`` are memoized: they launch Triton kernels and call torch, nothing else (no causal-conv1d).

``DS_MAMBA_SPCP_REPLAY=check`` runs the wrapper on every call, records it, and raises ``ReplayMismatch`` where the
program differs from the one memoized for the key (another op, another constant, another grid): what the key must
determine, checked. ``0`` turns replay off; unset (or ``auto``) means on wherever the launch layer is on (both are
verified together on the GPU by ``tests/test_gpu_launch.py``), ``1`` on. Under ``torch.compile`` the backend uses
Triton's objects as before.
"""

from __future__ import annotations

import collections
import os
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_mamba_spcp.ops import launch

ENV = "DS_MAMBA_SPCP_REPLAY"
_MODES = {"": "auto", "auto": "auto", "0": "off", "1": "on", "check": "check"}
MAX_KEYS = 64  # per wrapper: past it, new keys run the wrapper (a call site whose shapes never repeat)

# mamba-ssm's wrappers that the Triton backend calls and that only launch Triton kernels and call torch
MEMOIZED = frozenset({
    "_chunk_cumsum_fwd", "_chunk_cumsum_bwd", "_chunk_state_fwd", "_chunk_state_bwd_db", "_state_passing_fwd",
    "_state_passing_bwd", "_bmm_chunk_fwd", "_bmm_chunk_bwd", "_chunk_scan_fwd", "_chunk_scan_bwd_dz",
    "_chunk_scan_bwd_dstates", "_chunk_scan_bwd_dcb", "_chunk_scan_bwd_ddAcs_stable", "_chunk_scan_bwd_dC",
    "_chunk_scan_chunk_state_bwd_dx", "_layer_norm_fwd", "_layer_norm_bwd",
})  # fmt: skip

# calls per (wrapper name, path): "replay", "record" (a key's first call), "through" (run by the wrapper, unrecorded),
# "check" (run, recorded and compared)
COUNTS: collections.Counter = collections.Counter()


class ReplayMismatch(RuntimeError):
    """Check mode: a wrapper's call differs from the program memoized for its key."""


def mode(launch_mode: str) -> str:
    """'off', 'on' or 'check', from ``DS_MAMBA_SPCP_REPLAY``; unset or ``auto``: on where the launch layer is
    (``launch_mode``: ``launch.mode()``)."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw not in _MODES:
        raise ValueError(
            f"{ENV}={raw!r}: expected 0 (mamba-ssm's wrappers run on every call), 1 (recorded programs replayed), "
            "check (every call run, recorded and compared with the replayed program) or auto / unset (on where "
            "the launch layer is on)"
        )
    found = _MODES[raw]
    if found == "auto":
        return "off" if launch_mode == "off" else "on"
    return found


def _deterministic() -> bool:
    return os.environ.get("MAMBA_DETERMINISTIC", "")[:1] == "1" or torch.are_deterministic_algorithms_enabled()


# ---------------------------------------------------------------------------------------------
# the key
# ---------------------------------------------------------------------------------------------


class _Unkeyable(Exception):
    pass


_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype})


def _value_key(v):
    t = type(v)
    if t in _SCALARS:
        return (t, v)
    if t is tuple:
        return (tuple, tuple(map(_value_key, v)))
    if t in launch._BY_VALUE:  # Triton dtypes
        return (t, v)
    raise _Unkeyable


def _key(args, kwargs):
    """(per argument: a tensor's shape, strides, dtype and device index, or a value's type and value; the same for
    the keywords; which tensor arguments are one object; the deterministic mode)."""
    parts, seen = [], {}
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            first = seen.setdefault(id(a), len(seen))
            parts.append((a.shape, a.stride(), a.dtype, a.get_device(), first))
        else:
            parts.append(_value_key(a))
    return tuple(kwargs), tuple(parts), _deterministic()


# ---------------------------------------------------------------------------------------------
# programs
# ---------------------------------------------------------------------------------------------


class _Ref:
    """A tensor of the program: the call's inputs first, then every op's tensor results in order."""

    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i

    def __eq__(self, other):
        return type(other) is _Ref and other.i == self.i

    def __hash__(self):
        return hash(("ref", self.i))

    def __repr__(self):
        return f"%{self.i}"


class _NotRecordable(Exception):
    pass


def _grid_sig(grid):
    """What a grid is: a tuple by value, a function by its code and the values it closes over (a wrapper's grid
    lambda is a new object on every call)."""
    if not callable(grid):
        return ("tuple", tuple(grid))
    cells = tuple(c.cell_contents for c in (grid.__closure__ or ()))
    return ("fn", grid.__code__, cells, grid.__defaults__)


class _Recorder(TorchDispatchMode):
    """Keeps the aten ops (and, through ``_KernelProxy``, the launches) of one wrapper call."""

    def __init__(self, inputs):
        super().__init__()
        self.refs = {}  # id(tensor) -> _Ref
        self.n = 0  # refs made
        self.alive = []  # every tensor seen, so that no id is reused while recording
        self.steps = []  # ("op", OpOverload, args, kwargs, n_results) | ("launch", kernel, grid, args, kwargs)
        self.paused = 0
        self.error = None
        for t in inputs:
            self._new(t)

    def _new(self, t):
        if id(t) not in self.refs:
            self.refs[id(t)] = _Ref(self.n)
            self.n += 1
            self.alive.append(t)

    def template(self, v):
        if isinstance(v, torch.Tensor):
            ref = self.refs.get(id(v))
            if ref is None:
                raise _NotRecordable("a tensor that is neither an input nor made by a recorded op")
            return ref
        if type(v) in (list, tuple):
            return type(v)(self.template(x) for x in v)
        if type(v) is dict:
            return {k: self.template(x) for k, x in v.items()}
        return v

    def _results(self, out):
        """The positions, among the op's tensor results (flattened), of the new ones (in-place and out= ops
        return tensors the program already has)."""
        new = []
        for i, t in enumerate(_flat(out)):
            if id(t) not in self.refs:
                self._new(t)
                new.append(i)
        return tuple(new)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or self.error is not None:
            return out
        try:
            if func is torch.ops.aten._local_scalar_dense.default:
                raise _NotRecordable("a value read to the host")
            if func in _SAME and isinstance(out, torch.Tensor) and id(args[0]) in self.refs:
                # a detached alias (factory results come back through detach under the recorder) is the same
                # memory with the same metadata: the program keeps the tensor it came from
                self.refs[id(out)] = self.refs[id(args[0])]
                self.alive.append(out)
                return out
            step = ("op", func, self.template(args), self.template(kwargs))
            self.steps.append((*step, self._results(out)))
        except _NotRecordable as e:
            self.error = str(e)
        return out

    def launch(self, kernel, grid, args, kwargs):
        if self.error is not None:
            return
        try:
            self.steps.append(("launch", kernel, grid, self.template(args), self.template(kwargs)))
        except _NotRecordable as e:
            self.error = str(e)


_ACTIVE: list[_Recorder] = []

_aten = torch.ops.aten
_SAME = frozenset({_aten.detach.default, _aten.alias.default})
# aten ops replayed through torch's Python bindings of the same native functions: the same schema and the same
# kernel, at a third of an OpOverload call's host cost (~1.5 us against ~6 us for an empty on this project's CPU)
_FAST = {
    _aten.empty.memory_format: torch.empty,
    _aten.zeros.default: torch.zeros,
    _aten.empty_like.default: torch.empty_like,
    _aten.zeros_like.default: torch.zeros_like,
    _aten.sum.dim_IntList: torch.sum,
    _aten.cumsum.out: torch.cumsum,
    _aten.cumsum.default: torch.cumsum,
    _aten.copy_.default: torch.Tensor.copy_,
    _aten.view.default: torch.Tensor.view,
    _aten.select.int: torch.select,
    _aten.add_.Tensor: torch.Tensor.add_,
    _aten.zero_.default: torch.Tensor.zero_,
}


def _fill(t, vals):
    c = t.__class__
    if c is _Ref:
        return vals[t.i]
    if c is tuple or c is list:
        return c(_fill(x, vals) for x in t)
    if c is dict:
        return {k: _fill(x, vals) for k, x in t.items()}
    return t


def _has_ref(t) -> bool:
    c = t.__class__
    if c is _Ref:
        return True
    if c is tuple or c is list:
        return any(map(_has_ref, t))
    if c is dict:
        return any(map(_has_ref, t.values()))
    return False


def _slots(template):
    """(the template with refs left in place, [(position, ref index)] of its top-level refs), or None where a ref
    sits deeper (a list of tensors): that step fills its arguments recursively."""
    items = template.items() if type(template) is dict else enumerate(template)
    slots = []
    for pos, v in items:
        if type(v) is _Ref:
            slots.append((pos, v.i))
        elif _has_ref(v):
            return None
    return tuple(slots)


class _Program:
    """The steps of one key, laid out for replay: each step's callable bound once, its arguments a template whose
    tensor positions are filled from the values (the call's inputs, then every op's new tensors)."""

    __slots__ = ("steps", "result", "signature")

    def __init__(self, steps, result):
        self.signature = tuple(
            (s[0], s[1], _grid_sig(s[2]), s[3], tuple(sorted(s[4].items()))) if s[0] == "launch" else s for s in steps
        )
        compiled = []
        for s in steps:
            if s[0] == "op":
                _, func, args, kwargs, new = s
                call = _FAST.get(func, func)
            else:
                _, kernel, grid, args, kwargs = s
                call, new = kernel[grid], ()  # (a launch returns no tensor the program uses)
            a, k = _slots(args), _slots(kwargs)
            deep = a is None or k is None
            compiled.append((call, args, kwargs, a or (), k or (), deep, new))
        self.steps = tuple(compiled)
        self.result = result

    def run(self, inputs):
        vals = list(inputs)
        for call, args, kwargs, aslots, kslots, deep, new in self.steps:
            if deep:
                out = call(*_fill(args, vals), **_fill(kwargs, vals))
            else:
                if aslots:
                    args = list(args)
                    for pos, i in aslots:
                        args[pos] = vals[i]
                if kslots:
                    kwargs = dict(kwargs)
                    for name, i in kslots:
                        kwargs[name] = vals[i]
                out = call(*args, **kwargs)
            if new:
                if new == (0,) and isinstance(out, torch.Tensor):
                    vals.append(out)
                else:
                    flat = _flat(out)
                    vals.extend(flat[i] for i in new)
        return _fill(self.result, vals)


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (list, tuple):
        return [t for x in out for t in _flat(x)]
    return []


def _inputs(args, kwargs):
    """The call's tensors, each object once, in argument order (the key records which arguments are one)."""
    seen, out = set(), []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and id(a) not in seen:
            seen.add(id(a))
            out.append(a)
    return out


class _KernelProxy:
    """A kernel object of the copied namespaces (a launcher of ``ops/launch.py``, or Triton's own): launched as it
    is, and recorded while a wrapper call is recorded. Everything else (``best_config``, ``configs``, ...) is the
    kernel's."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        object.__setattr__(self, "kernel", kernel)

    def __getitem__(self, grid):
        kernel = self.kernel

        def run(*args, **kwargs):
            if _ACTIVE:
                rec = _ACTIVE[-1]
                rec.launch(kernel, grid, args, kwargs)
                rec.paused += 1  # a config's pre-hook (zero-fills), the interpreter's copies: the launch's own
                try:
                    return kernel[grid](*args, **kwargs)
                finally:
                    rec.paused -= 1
            return kernel[grid](*args, **kwargs)

        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __setattr__(self, name, value):
        setattr(self.kernel, name, value)


class Memo:
    """A wrapper of mamba-ssm's, called as it is, replaying a program per key (see the module docstring)."""

    def __init__(self, fn, check=False):
        self.fn = fn
        self.name = fn.__name__
        self.check = check
        self.programs: dict = {}
        self.through: set = set()  # keys whose call could not be recorded: always run by the wrapper

    def __call__(self, *args, **kwargs):
        if _ACTIVE or torch.is_grad_enabled():  # inside another wrapper's recording; or ops autograd would see
            COUNTS[self.name, "through"] += 1
            return self.fn(*args, **kwargs)
        try:
            key = _key(args, kwargs)
        except _Unkeyable:
            COUNTS[self.name, "through"] += 1
            return self.fn(*args, **kwargs)
        program = self.programs.get(key)
        if program is not None and not self.check:
            COUNTS[self.name, "replay"] += 1
            return program.run(_inputs(args, kwargs))
        if key in self.through:
            COUNTS[self.name, "through"] += 1
            return self.fn(*args, **kwargs)
        result, recorded = self._record(args, kwargs)
        if recorded is None:
            if len(self.through) < MAX_KEYS:
                self.through.add(key)
            return result
        if program is not None:  # check mode
            COUNTS[self.name, "check"] += 1
            if recorded.signature != program.signature or recorded.result != program.result:
                raise ReplayMismatch(_difference(self.name, program, recorded))
            return result  # the wrapper's own result: check mode computes as if replay were off
        COUNTS[self.name, "record"] += 1
        if len(self.programs) < MAX_KEYS:
            self.programs[key] = recorded
        return result

    def _record(self, args, kwargs):
        rec = _Recorder(_inputs(args, kwargs))
        _ACTIVE.append(rec)
        try:
            with rec:
                result = self.fn(*args, **kwargs)
        finally:
            _ACTIVE.pop()
        if rec.error is None:
            try:
                template = rec.template(result)
            except _NotRecordable as e:
                rec.error = str(e)
        if rec.error is not None:
            COUNTS[self.name, "through"] += 1
            return result, None
        return result, _Program(rec.steps, template)

    def __repr__(self):
        return f"<replayed {self.name}>"


def _difference(name, memo, now) -> str:
    for i, (a, b) in enumerate(zip(memo.signature, now.signature)):
        if a != b:
            return f"{name}: step {i} differs from the program memoized for the same key: {a!r} then {b!r}"
    if len(memo.signature) != len(now.signature):
        return f"{name}: {len(now.signature)} steps, the memoized program has {len(memo.signature)}"
    return f"{name}: the result differs from the memoized program's: {memo.result!r} then {now.result!r}"


def _is_kernel(obj) -> bool:
    return isinstance(obj, launch._Launcher) or launch.is_kernel(obj)


def redirect(modules, check=False) -> dict[str, types.ModuleType]:
    """Module name -> a copy of that module (or of a copy ``launch.redirect`` made) in which every kernel object is
    recorded when launched from a recorded call and the wrappers in ``MEMOIZED`` are ``Memo`` objects; every
    function runs with these copies as its globals. The modules given are not changed."""
    modules = list(modules)
    spaces = {m.__name__: types.ModuleType(m.__name__) for m in modules}
    replaced: dict[int, object] = {}
    for m in modules:
        for obj in vars(m).values():
            if id(obj) not in replaced and _is_kernel(obj):
                replaced[id(obj)] = _KernelProxy(obj)
    for m in modules:
        namespace = vars(spaces[m.__name__])
        for name, obj in vars(m).items():
            if isinstance(obj, types.FunctionType) and obj.__globals__ is vars(m) and id(obj) not in replaced:
                fn = launch._rebound(obj, namespace)
                replaced[id(obj)] = Memo(fn, check) if name in MEMOIZED else fn
    for m in modules:
        vars(spaces[m.__name__]).update({name: replaced.get(id(obj), obj) for name, obj in vars(m).items()})
    return spaces
