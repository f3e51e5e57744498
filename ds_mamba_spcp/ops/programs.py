"""A known-mode segment replayed as a recorded program of torch ops and launches (issue 23; ``DS_MAMBA_SPCP_PROGRAMS``).

Why: at short segments the Triton backend is host-bound. With the launch layer (``ops/launch.py``) a segment's
~25 Triton launches cost the host ~10-25 us each, but everything around them (mamba-ssm's wrappers, this
package's glue, their ~60 torch ops and ~100 views, ~500 ``stride()`` calls, the grid lambdas) costs three times
that: on this project's CPU model of the host (``benchmarks/probe_host_model_cpu.py``) 1.4 ms per segment
forward and backward, of which the launches are ~0.5 ms. A segment of a group of one runs the same Python with the
same shapes on every tile and every step, and that Python computes nothing from tensor values.

What: ``Programs(fn)`` calls ``fn`` (a segment's forward or backward in known mode, ``ops/triton.py``) as it is,
keyed on its arguments: each tensor's shape, strides, dtype and device; which tensor arguments are one object;
every other argument by type and value (the ``CoreSpec`` included); and the state the code reads besides (the
launch layer's mode, mamba-ssm's deterministic mode, grad and inference mode, the current device, which state
passing kernels ``DS_MAMBA_SPCP_STATE_PASSING`` picks). A key's first
call runs ``fn`` under a recorder that keeps, in order:

- every aten op it dispatches, with its tensor arguments as references (to the call's inputs, or to results of
  earlier steps) and everything else as constants; a view of a program tensor is kept as its sizes, strides and
  offset from its base, and replayed with ``torch.as_strided``;
- every Triton launch through the launch layer (``launch.RECORDING``): the launcher, the grid, the arguments;
- every call of a function marked ``extern`` (causal-conv1d's C++ conv forward and backward, which write into
  tensors outside torch's dispatcher), with its arguments and results the same way;

and what ``fn`` returns. Later calls of the key replay that program with the new call's tensors: the same ops
(through torch's Python bindings of the same native functions where ``_FAST`` has one; views as ``as_strided``
from their root tensor, relative to its offset, the unused ones dropped), the same launches (each through the
compiled kernel the launch layer recorded for it, bound once by ``launch.bound``: where a tensor's address
alignment differs from the recorded one's, through the launcher, which keys it again), the same extern calls.
Each value is dropped after the step that uses it last, as the segment code drops its locals. The program holds
no tensor. A replay is one Python function generated from the program (``_generate``; its text in
``source``): every value a local variable, every step a line, every launch whose compiled kernel is bound written
out down to its C launcher call, so that what a replay costs is its torch calls and launches.

Soundness rests on ``fn``'s Python being a function of the key: for the same shapes, strides, dtypes, devices and
other arguments it dispatches the same ops with the same non-tensor arguments, launches the same kernels with the
same grids and scalars, and calls the same extern functions. What the segment code reads of a tensor is its
metadata (never a value: an op that reads one to the host, ``aten._local_scalar_dense``, makes a call
unrecordable); the one address comparison (``ops/triton.py``: whether causal-conv1d returned the buffer it was
given) is decided by the extern function, not by the addresses. A call is run by ``fn`` itself, and not recorded,
where grad mode is on (the ops are recorded below autograd; the segments run inside autograd Functions, with it
off), an argument is of a type not keyed, a tensor it touches is neither an input nor made by a recorded step, a
launch goes around the launch layer, or ``fn`` raised. ``DS_MAMBA_SPCP_PROGRAMS=check`` runs ``fn`` on every call,
records it, and raises ``ProgramMismatch`` where the program differs from the one kept for the key: what the key
must determine, checked on every call (``tests/test_programs.py``, ``tests/test_gpu_launch.py``).

``0`` turns programs off; unset (or ``auto``) means on wherever the launch layer is on (the launches must go
through it to be recorded); ``1`` on wherever the launch layer is on, ``check`` likewise. Under ``torch.compile``
the backend runs as before.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import keyword
import os
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_mamba_spcp.ops import launch

ENV = "DS_MAMBA_SPCP_PROGRAMS"
_MODES = {"": "auto", "auto": "auto", "0": "off", "1": "on", "check": "check"}
MAX_KEYS = 64  # per function: past it, new keys run the function (a caller whose shapes never repeat)

# calls per (function name, path): "replay", "record" (a key's first call), "through" (run, not recorded), "check"
COUNTS: collections.Counter = collections.Counter()


class ProgramMismatch(RuntimeError):
    """Check mode: a call differs from the program kept for its key."""


def mode(launch_mode: str) -> str:
    """'off', 'on' or 'check', from ``DS_MAMBA_SPCP_PROGRAMS`` and the launch layer's mode (``launch.mode()``):
    programs record launches through the launch layer, so they are off wherever it is."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw not in _MODES:
        raise ValueError(
            f"{ENV}={raw!r}: expected 0 (the segment code runs on every call), 1 (recorded programs replayed), check "
            "(every call run, recorded and compared with its key's program) or auto / unset (1 wherever the launch "
            "layer is on)"
        )
    if launch_mode == "off":
        return "off"
    found = _MODES[raw]
    return "on" if found == "auto" else found


# what the segment code reads of the environment besides: which state passing kernels it launches
# (ops/pass_states.py's ENV; read raw here, this module knows no kernel)
_ENV_READ = ("DS_MAMBA_SPCP_STATE_PASSING",)


def _state():
    """What the segment code reads besides its arguments."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else -1
    deterministic = os.environ.get("MAMBA_DETERMINISTIC", "")[:1] == "1" or torch.are_deterministic_algorithms_enabled()
    env = tuple(os.environ.get(name) for name in _ENV_READ)
    return (launch.mode(), deterministic, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), device, env)


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
    if getattr(t, "__dataclass_params__", None) is not None and t.__dataclass_params__.frozen:
        return (t, v)  # a frozen dataclass of values (CoreSpec): hashed and compared by value
    raise _Unkeyable


def _key(args, kwargs):
    """(the key, the call's tensors: each object once, in argument order; the key records which arguments are one)."""
    parts, seen, inputs = [], {}, []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            first = seen.get(id(a))
            if first is None:
                first = seen[id(a)] = len(inputs)
                inputs.append(a)
            parts.append((a.shape, a.stride(), a.dtype, a.get_device(), first))
        else:
            t = type(a)
            parts.append((t, a) if t in _SCALARS else _value_key(a))
    return (tuple(kwargs), tuple(parts), _state()), inputs


def _inputs(args, kwargs):
    return _key(args, kwargs)[1]


# ---------------------------------------------------------------------------------------------
# recording
# ---------------------------------------------------------------------------------------------


class _Ref:
    """A tensor of the program: the call's inputs first, then every step's new tensors in order."""

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


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if type(out) in (list, tuple):
        return [t for x in out for t in _flat(x)]
    return []


class _Recorder(TorchDispatchMode):
    """Keeps the steps of one call: aten ops (dispatched here), launches and extern calls (reported to it)."""

    def __init__(self, inputs):
        super().__init__()
        self.refs: dict[int, _Ref] = {}  # id(tensor) -> its ref
        self.n = 0
        # a weak reference per tensor seen, whose callback forgets its id when it is freed: a tensor made later
        # at the same address of Python objects is not taken for it, and the recording keeps no tensor alive (the
        # segment's peak memory stays the code's on a key's first call too)
        self.watch: dict[int, weakref.ref] = {}
        self.steps: list = []
        self.bound: dict = {}  # id(launch step) -> its launch.Bound
        self.paused = 0
        self.error: str | None = None
        for t in inputs:
            self._new(t)
        self.n_inputs = self.n

    def _new(self, t):
        if id(t) not in self.refs:
            key = id(t)
            self.refs[key] = _Ref(self.n)
            self.n += 1
            self.watch[key] = weakref.ref(t, lambda _, key=key: self._gone(key))

    def _gone(self, key):
        self.refs.pop(key, None)
        self.watch.pop(key, None)

    def template(self, v):
        if isinstance(v, torch.Tensor):
            ref = self.refs.get(id(v))
            if ref is None:
                raise _NotRecordable("a tensor that is neither an input nor made by a recorded step")
            return ref
        if type(v) in (list, tuple):
            return type(v)(self.template(x) for x in v)
        if type(v) is dict:
            return {k: self.template(x) for k, x in v.items()}
        return v

    def _results(self, out) -> tuple:
        """The positions, among a step's tensor results (flattened), of the new ones (in-place and out= ops return
        tensors the program has)."""
        new = []
        for i, t in enumerate(_flat(out)):
            if id(t) not in self.refs:
                self._new(t)
                new.append(i)
        return tuple(new)

    def fail(self, why):
        if self.error is None:
            self.error = why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or self.error is not None:
            return out
        try:
            if func is torch.ops.aten._local_scalar_dense.default:
                raise _NotRecordable("a tensor value read to the host")
            if func.is_view and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.refs:
                base = args[0]
                views = _flat(out)
                # an op whose schema says it may alias (contiguous, reshape: under inference mode they reach the
                # recorder whole) is a view only where its result shares its input's memory; a copy is an op
                storage = base.untyped_storage().data_ptr()
                if all(v.dtype == base.dtype and v.untyped_storage().data_ptr() == storage for v in views):
                    offset = base.storage_offset()
                    geometry = tuple((tuple(v.shape), v.stride(), v.storage_offset() - offset) for v in views)
                    self.steps.append(("view", self.refs[id(base)], geometry, self._results(out)))
                    return out
            self.steps.append(("op", func, self.template(args), self.template(kwargs), self._results(out)))
        except _NotRecordable as e:
            self.fail(str(e))
        return out

    def call(self, kind, fn, grid, args, kwargs, run):
        """A launch (kind "launch", grid) or an extern call (kind "extern"): recorded, then run unrecorded."""
        if self.error is None:
            try:
                step = (kind, fn, grid, self.template(args), self.template(kwargs))
            except _NotRecordable as e:
                self.fail(str(e))
        self.paused += 1  # what the launch does (a config's pre-hook, the interpreter's copies) is the launch's own
        try:
            out = run()
            if kind == "launch" and self.error is None:
                bound = launch.bound(fn, grid, args, kwargs)
        finally:
            self.paused -= 1
        if self.error is None:
            self.steps.append((*step, self._results(out) if kind == "extern" else ()))
            if kind == "launch" and bound is not None:
                self.bound[id(self.steps[-1])] = bound
        return out


class _Local(threading.local):
    stack: list  # the recorders of this thread's recordings (a recording sees only its own thread's steps)

    def __init__(self):
        self.stack = []


_LOCAL = _Local()


def _recording():
    """This thread's recorder, where it records now (not inside a launch or an extern call), else None."""
    stack = _LOCAL.stack
    return stack[-1] if stack and not stack[-1].paused else None


def _launch_hook(launcher, grid, args, kwargs):
    """``launch.RECORDING``'s entry: the launch layer reports each launch here while any thread records."""
    rec = _recording()
    if rec is None:
        return launcher.launch(grid, args, kwargs)[0]
    return rec.call("launch", launcher, grid, args, kwargs, lambda: launcher.launch(grid, args, kwargs)[0])


def extern(fn):
    """``fn`` (a function that writes tensors outside torch's dispatcher: a C++ extension's call) as a step of a
    recorded program, called with its arguments and results as program tensors."""

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        rec = _recording()
        if rec is not None:
            return rec.call("extern", fn, None, args, kwargs, lambda: fn(*args, **kwargs))
        return fn(*args, **kwargs)

    return recorded


@contextlib.contextmanager
def _triton_guarded():
    """While a call is recorded, a Triton kernel launched as ``kernel[grid](...)`` on Triton's own object (not a
    launcher of the launch layer) while the recorder records makes the call unrecordable: its program would lack
    that launch. (``KernelInterface.__getitem__`` is where every such launch starts: Triton's ``JITFunction``,
    ``Autotuner``, ``Heuristics`` and the interpreter's function share it, and an instance cannot shadow it.)"""
    from triton.runtime.jit import KernelInterface

    getitem = KernelInterface.__dict__["__getitem__"]

    @functools.wraps(getitem)
    def guarded(self, grid):
        rec = _recording()
        if rec is not None:
            rec.fail(f"{getattr(self, '__name__', type(self).__name__)} launched around the launch layer")
        return getitem(self, grid)

    KernelInterface.__getitem__ = guarded
    try:
        yield
    finally:
        KernelInterface.__getitem__ = getitem


# ---------------------------------------------------------------------------------------------
# programs
# ---------------------------------------------------------------------------------------------

_aten = torch.ops.aten
# aten ops replayed through torch's Python bindings of the same native functions (the same schema, the same kernel)
# at a fraction of an OpOverload call's host cost (~1.5 us against ~6 us for an empty, on this project's CPU)
_FAST = {
    _aten.empty.memory_format: torch.empty,
    _aten.zeros.default: torch.zeros,
    _aten.empty_like.default: torch.empty_like,
    _aten.zeros_like.default: torch.zeros_like,
    _aten.sum.dim_IntList: torch.sum,
    _aten.cumsum.out: torch.cumsum,
    _aten.cumsum.default: torch.cumsum,
    _aten.copy_.default: torch.Tensor.copy_,
    _aten.add_.Tensor: torch.Tensor.add_,
    _aten.add.Tensor: torch.add,
    _aten.mul.Tensor: torch.mul,
    _aten.zero_.default: torch.Tensor.zero_,
    _aten.clone.default: torch.clone,
    _aten.exp.default: torch.exp,
    _aten.cat.default: torch.cat,
}


def _has_ref(t) -> bool:
    c = t.__class__
    if c is _Ref:
        return True
    if c is tuple or c is list:
        return any(map(_has_ref, t))
    if c is dict:
        return any(map(_has_ref, t.values()))
    return False


def _grid_sig(grid):
    """A grid by what it is: a tuple by value; a function (a wrapper's lambda, a new object on every call) by its
    code, the values it closes over and its defaults."""
    if grid is None or not callable(grid):
        return grid
    cells = tuple(c.cell_contents for c in (grid.__closure__ or ()))
    return ("fn", grid.__code__, cells, grid.__defaults__)


def _signature(steps):
    sig = []
    for s in steps:
        if s[0] in ("launch", "extern"):
            kind, fn, grid, args, kwargs, new = s
            sig.append((kind, fn, _grid_sig(grid), args, tuple(kwargs.items()), new))
        else:
            sig.append(s)
    return tuple(sig)


def _refs_in(t, out):
    c = t.__class__
    if c is _Ref:
        out.add(t.i)
    elif c is tuple or c is list:
        for x in t:
            _refs_in(x, out)
    elif c is dict:
        for x in t.values():
            _refs_in(x, out)
    return out


def _renumber(t, new):
    c = t.__class__
    if c is _Ref:
        return _Ref(new[t.i])
    if c is tuple or c is list:
        return c(_renumber(x, new) for x in t)
    if c is dict:
        return {k: _renumber(x, new) for k, x in t.items()}
    return t


def _collapse_views(steps, result, n_inputs):
    """(steps, result, the original index of each kept step): every view taken straight from the nearest tensor
    that is not a view (an input or a result of an op, a launch or an extern call), the views nothing else uses
    dropped, the refs renumbered. as_strided takes absolute sizes and strides, so a view of a view is its root
    and the sum of the two offsets."""
    first = []  # the index of the first ref each step makes
    n = n_inputs
    for st in steps:
        first.append(n)
        n += len(st[-1])
    root = {}  # view ref -> (root ref, offset from the root)
    used = _refs_in(result, set())
    for st, f in zip(steps, first):
        if st[0] == "view":
            _, base, geometry, new = st
            r, off = root.get(base.i, (base.i, 0))
            for k, pos in enumerate(new):
                root[f + k] = (r, off + geometry[pos][2])
        else:
            _refs_in(st[2:4] if st[0] == "op" else st[3:5], used)
    remap = {i: i for i in range(n_inputs)}
    out, origin = [], []
    nxt = n_inputs
    for j, (st, f) in enumerate(zip(steps, first)):
        if st[0] == "view":
            _, base, geometry, new = st
            live = [(k, pos) for k, pos in enumerate(new) if f + k in used]
            if not live:
                continue
            views = []
            for k, pos in live:
                size, stride, _ = geometry[pos]
                views.append((size, stride, root[f + k][1]))
                remap[f + k] = nxt
                nxt += 1
            out.append(("view", _Ref(remap[root[f][0]]), tuple(views), tuple(range(len(views)))))
        else:
            if st[0] == "op":
                renamed = (st[0], st[1], _renumber(st[2], remap), _renumber(st[3], remap), st[4])
            else:
                renamed = (st[0], st[1], st[2], _renumber(st[3], remap), _renumber(st[4], remap), st[5])
            for k in range(len(st[-1])):
                remap[f + k] = nxt
                nxt += 1
            out.append(renamed)
        origin.append(j)
    return out, _renumber(result, remap), origin


def _last_uses(steps, result, n_inputs):
    """Per step, the values to drop after it: those no later step uses and the result does not hold (a value no step
    uses is dropped after the step that made it). Without this a replay would keep every intermediate tensor of the
    segment alive to its end, where the segment code frees each when its last name goes."""
    last, made, n = {}, [], n_inputs
    for j, st in enumerate(steps):
        used = {st[1].i} if st[0] == "view" else _refs_in(st[2:4] if st[0] == "op" else st[3:5], set())
        for i in used:
            last[i] = j
        made.append(range(n, n + len(st[-1])))
        n += len(st[-1])
    keep = _refs_in(result, set())
    free = [[] for _ in steps]
    for j, new in enumerate(made):
        for i in new:
            if i not in keep:
                free[last.get(i, j)].append(i)
    for i in range(n_inputs):  # the program's references to the inputs, too (the caller holds its own)
        if i in last and i not in keep:
            free[last[i]].append(i)
    return [tuple(f) for f in free]


def _returns_a_tensor(func) -> bool:
    returns = getattr(getattr(func, "_schema", None), "returns", None)
    return returns is not None and len(returns) == 1 and str(returns[0].type) == "Tensor"


def _constant(v, names: dict) -> str:
    """The source of a constant of a program: an int, a bool or None written out, anything else a global of the
    generated function (the recorded object itself)."""
    if v is None or type(v) in (int, bool):
        return repr(v)
    name = f"_k{len(names)}"
    names[name] = v
    return name


def _expr(t, names: dict) -> str:
    """The source of a template: refs as the values' names, containers rebuilt, constants as ``_constant``."""
    c = t.__class__
    if c is _Ref:
        return f"v{t.i}"
    if not _has_ref(t):
        return _constant(t, names)
    if c is tuple:
        return "(" + "".join(_expr(x, names) + ", " for x in t) + ")"
    if c is list:
        return "[" + ", ".join(_expr(x, names) for x in t) + "]"
    return "{" + ", ".join(f"{k!r}: {_expr(x, names)}" for k, x in t.items()) + "}"


def _call_args(args, kwargs, names: dict) -> str:
    parts = [_expr(a, names) for a in args]
    for k, v in kwargs.items():
        parts.append(f"{k}={_expr(v, names)}" if k.isidentifier() and not keyword.iskeyword(k) else
                     f"**{{{k!r}: {_expr(v, names)}}}")  # fmt: skip
    return ", ".join(parts)


def _inline_launch(b: launch.Bound, args: list, fallback: str, names: dict) -> list:
    """A launch step's lines where its compiled kernel is bound (``launch.Bound``, what its ``__call__`` does,
    written out): the C launcher called directly where every tensor's address modulo 16 is the bound launch's,
    else ``fallback`` (the step's ``_Launch``: the launcher)."""
    c, k = b.compiled, lambda v: _constant(v, names)
    aligned = " and ".join(f"{args[i]}.data_ptr() & 15 == {a}" for i, a in b.align) or "True"
    listed = ", ".join(args)
    lines = [f"    if {aligned}:"]
    if b.pre_hook is not None:
        lines.append(f"        {k(b.pre_hook)}({k(launch._Named)}({k(b.index)}, ({listed},), {k(b.full)}))")
    grid = ", ".join(map(str, b.grid)) if all(type(g) is int for g in b.grid) else f"*{k(b.grid)}"
    tail = "".join(", " + k(v) for v in b.tail)
    lines.append(f"        {k(c._run)}({grid}, {k(b.stream)}({k(b.device)}), {k(c._function)}, {k(c._packed)}, None, "
                 f"None, None, {listed}{tail})")  # fmt: skip
    lines.append(f"        {k(launch)}.COUNTS[{k((b.name, 'fast'))}] += 1")  # (the module's: tests replace it)
    lines += ["    else:", f"        {fallback}"]
    return lines


def _generate(steps, result, n_inputs, name):
    """A program's steps as one Python function of its inputs (``v0``, ``v1``, ...), each value a local named by its
    index and deleted after its last use: a replay costs what its torch calls and launches cost, not a loop that
    interprets them."""
    names = {"_as": torch.as_strided, "_flat": _flat}
    lines = [f"def replay({''.join(f'v{i}, ' for i in range(n_inputs))}):"]
    n, offsets = n_inputs, set()
    for kind, call, args, kwargs, new, free in steps:
        if kind == "view":  # call: the base's index; args: its views' (sizes, strides, offset from the base)
            if call not in offsets:
                offsets.add(call)
                lines.append(f"    o{call} = v{call}.storage_offset()")
            for size, stride, delta in args:
                size, stride = _constant(size, names), _constant(stride, names)
                lines.append(f"    v{n} = _as(v{call}, {size}, {stride}, o{call} + {delta})")
                n += 1
        else:
            if kind == "launch":  # a _Launch: the positional arguments as one tuple, the keywords as they were
                text = f"{_constant(call, names)}({_expr(tuple(args), names)}, {_constant(kwargs, names)})"
                if call.bound is not None:  # (a launch makes no new value)
                    lines.extend(_inline_launch(call.bound, [_expr(a, names) for a in args], text, names))
                    text = None
            else:
                text = f"{_constant(call, names)}({_call_args(args, kwargs, names)})"
            if text is None:  # written out already
                pass
            elif not new:
                lines.append(f"    {text}")
            elif kind == "tensor_op":  # an op whose schema returns one tensor, new
                lines.append(f"    v{n} = {text}")
                n += 1
            else:
                lines.append(f"    _t = _flat({text})")
                for i in new:
                    lines.append(f"    v{n} = _t[{i}]")
                    n += 1
                lines.append("    del _t")
        if free:
            lines.append(f"    del {', '.join(f'v{i}' for i in free)}")
    lines.append(f"    return {_expr(result, names)}")
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<program of {name}>", "exec"), names)
    return names["replay"], source


class _Program:
    """One key's steps, laid out for replay (views from their roots, each value dropped after its last use) and
    generated as one Python function (``_generate``)."""

    __slots__ = ("_steps", "result", "replay_result", "signature", "n_inputs", "name", "fn", "source")

    def __init__(self, steps, result, bound, n_inputs, name="program"):
        self.signature = _signature(steps)
        self.result = result  # (as recorded: what check mode compares)
        self.n_inputs, self.name = n_inputs, name
        bound = [bound.get(id(st)) for st in steps]
        steps, result, origin = _collapse_views(steps, result, n_inputs)
        laid = []
        for s, j in zip(steps, origin):
            if s[0] == "view":
                _, base, geometry, new = s
                laid.append(("view", base.i, geometry, None, new))
            elif s[0] == "op":
                _, func, args, kwargs, new = s
                laid.append(
                    ("tensor_op" if _returns_a_tensor(func) else "op", _FAST.get(func, func), args, kwargs, new)
                )
            elif s[0] == "launch":
                _, launcher, grid, args, kwargs, new = s
                laid.append(("launch", _Launch(launcher, grid, bound[j]), args, kwargs, new))
            else:
                _, call, _, args, kwargs, new = s
                laid.append(("extern", call, args, kwargs, new))
        free = _last_uses(steps, result, n_inputs)
        self.replay_result = result
        self.steps = tuple((*c, f) for c, f in zip(laid, free))

    @property
    def steps(self):
        """(kind, callable or base index, args, kwargs, new, values dropped after it) per step; setting them
        generates the function again."""
        return self._steps

    @steps.setter
    def steps(self, steps):
        self._steps = steps
        for st in steps:
            if st[0] == "launch":
                st[1].program = self
        self.fn, self.source = _generate(steps, self.replay_result, self.n_inputs, self.name)

    def run(self, inputs):
        fn = self.fn
        if fn is None:  # a launch got its compiled kernel since the function was generated
            self.steps = self._steps
            fn = self.fn
        return fn(*inputs)


class _Launch:
    """A launch step: through its compiled kernel bound at recording (``launch.bound``) where the tensors' address
    alignment matches, else through the launcher (which keys it again)."""

    __slots__ = ("launcher", "grid", "bound", "program")

    def __init__(self, launcher, grid, bound):
        self.launcher, self.grid, self.bound = launcher, grid, bound
        self.program = None  # the _Program whose step this is (set by it)

    def __call__(self, args, kwargs):
        bound = self.bound
        if bound is not None and bound(args):
            return
        self.launcher.launch(self.grid, args, kwargs)
        if bound is None:  # the launcher had not recorded this key's compiled kernel at the recording: now it has
            self.bound = launch.bound(self.launcher, self.grid, args, kwargs)
            if self.bound is not None and self.program is not None:
                self.program.fn = None  # generated again on its next run, with this launch written out


def _difference(name, kept, now) -> str:
    for i, (a, b) in enumerate(zip(kept.signature, now.signature)):
        if a != b:
            return f"{name}: step {i} differs from the program kept for the same key: {a!r} then {b!r}"
    if len(kept.signature) != len(now.signature):
        return f"{name}: {len(now.signature)} steps, the program kept for the key has {len(kept.signature)}"
    return f"{name}: the result differs from the kept program's: {kept.result!r} then {now.result!r}"


class Programs:
    """``fn`` called as it is, or replayed from the program recorded for its arguments' key (see the module
    docstring). ``check``: run, record and compare on every call."""

    def __init__(self, fn):
        self.fn = fn
        self.name = fn.__name__
        self.programs: dict = {}
        self.through: set = set()  # keys whose call could not be recorded: always run by fn

    def __call__(self, check, *args, **kwargs):
        if _LOCAL.stack:  # inside another recording: part of its program
            return self.fn(*args, **kwargs)
        if torch.is_grad_enabled():  # ops recorded below autograd would replay through it: not recorded
            COUNTS[self.name, "through"] += 1
            return self.fn(*args, **kwargs)
        try:
            key, inputs = _key(args, kwargs)
        except _Unkeyable:
            COUNTS[self.name, "through"] += 1
            return self.fn(*args, **kwargs)
        program = self.programs.get(key)
        if program is not None and not check:
            COUNTS[self.name, "replay"] += 1
            return program.run(inputs)
        if key in self.through:
            COUNTS[self.name, "through"] += 1
            return self.fn(*args, **kwargs)
        result, recorded = self._record(args, kwargs)
        if recorded is None:
            if len(self.through) < MAX_KEYS:
                self.through.add(key)
            return result
        if program is not None:
            COUNTS[self.name, "check"] += 1
            if recorded.signature != program.signature or recorded.result != program.result:
                raise ProgramMismatch(_difference(self.name, program, recorded))
            return result
        COUNTS[self.name, "record"] += 1
        if len(self.programs) < MAX_KEYS:
            self.programs[key] = recorded
        return result

    def _record(self, args, kwargs):
        rec = _Recorder(_inputs(args, kwargs))
        _LOCAL.stack.append(rec)
        launch.RECORDING.append(_launch_hook)
        try:
            with _triton_guarded(), rec:
                result = self.fn(*args, **kwargs)
        finally:
            launch.RECORDING.pop()
            _LOCAL.stack.pop()
        if rec.error is None:
            try:
                template = rec.template(result)
            except _NotRecordable as e:
                rec.fail(str(e))
        if rec.error is not None:
            COUNTS[self.name, "through"] += 1
            return result, None
        return result, _Program(rec.steps, template, rec.bound, rec.n_inputs, self.name)

    def __repr__(self):
        return f"<programs of {self.name}: {len(self.programs)} keys>"
