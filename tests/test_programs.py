"""ops/programs.py's mechanism on CPU: what a recorded program replays, its key, what it refuses, check mode.

The functions recorded here are small stand-ins for a segment: torch ops (factories, views at offsets, in-place and
out= ops, a multi-output view, a reduction), a write outside torch's dispatcher (numpy, as a C++ extension writes:
an ``extern`` step) and launches through ``ops/launch.py``'s launchers over tests/test_launch.py's stand-in for
Triton's ``JITFunction.run``. Every comparison is exact: replay runs the same ops and the same stand-in math. The
real segment code is replayed under Triton's interpreter in tests/test_triton_interpreter.py, and on the GPU in
tests/test_gpu_launch.py.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from ds_mamba_spcp.ops import launch, programs
from tests.test_launch import _axpy, _axpy_math, _install_stand_in, _zero_out, fake_gpu  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:ds_mamba_spcp. DS_MAMBA_SPCP_FAST_LAUNCH is on")

_TUNER = triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=2, pre_hook=_zero_out)], key=["n"])(_axpy)


def _write_doubled(dst, src):
    """A write outside torch's dispatcher (as causal-conv1d's C++ calls write their outputs)."""
    dst.numpy()[...] = 2 * src.numpy()


_extern_write = programs.extern(_write_doubled)


def _body(x, w, out, n, write, fast):
    """x: a (rows, 40) view (at any storage offset); w: (40,); out: (rows, 40), written in place. Returns
    (sum of the rows, the second half of the split, the cumsum buffer)."""
    rows = x.unflatten(-1, (4, 10)).transpose(-1, -2)[..., 1:3, :]  # views of views, at an offset
    scaled = torch.zeros(rows.shape, dtype=x.dtype).add_(rows).mul(w[:4])  # factory, in-place, broadcast
    first, second = torch.split(x, [n, x.shape[-1] - n], dim=-1)  # a multi-output view
    acc = torch.empty_like(first)
    torch.cumsum(first, dim=-1, out=acc)  # an out= op
    write(out[:, :n], acc)  # the extern step, into a view of a caller's buffer
    if fast is not None:  # a launch through ops/launch.py: out[0, :32] = 2 x[0, :32] + w[:32] (ACC: pre-hook zero)
        fast[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x[0], w, out[0, n:], 32 - n, 2.0, ACC=True)
    return scaled.sum(dim=(-1, -2)), second, acc


_LAUNCHER: dict = {}  # the launcher of _TUNER, made per test (the fake GPU's counts and stand-in are per test)


def _segment(x, w, out, *, n):
    return _body(x, w, out, n, _extern_write, None)


def _segment_launching(x, w, out, *, n):
    return _body(x, w, out, n, _extern_write, _LAUNCHER["fast"])


def _segment_unmarked(x, w, out, *, n):
    return _body(x, w, out, n, _write_doubled, None)


def _inputs(seed, offset=0, rows=3):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows * 40 + offset, generator=g)
    return base[offset:].view(rows, 40), torch.randn(40, generator=g), torch.zeros(rows, 40)


def _run(mode, fn, args, kwargs):
    programs_of = _PROGRAMS.setdefault(fn, programs.Programs(fn))
    if mode == "off":
        return fn(*args, **kwargs)
    return programs_of(mode == "check", *args, **kwargs)


_PROGRAMS: dict = {}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    _PROGRAMS.clear()
    monkeypatch.setattr(programs, "COUNTS", programs.COUNTS.__class__())


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(_same(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.usefixtures("fake_gpu")
def test_replay_equals_the_function(monkeypatch):
    """Three calls of one key (new values, inputs at other storage offsets): the first records, the next two
    replay; results, the caller's buffer and the launches as the function itself gives them. The launch replays
    through its bound compiled kernel (the config's pre-hook included: ACC adds into a zeroed out)."""
    log = []
    _install_stand_in(_axpy, _axpy_math, log)
    _LAUNCHER["fast"] = launch.launcher(_TUNER)
    fn = _segment_launching
    with torch.no_grad():
        for seed, offset in ((0, 0), (1, 8), (2, 4)):
            want_in, got_in = _inputs(seed, offset), _inputs(seed, offset)
            want = fn(*want_in, n=12)
            got = _run("on", fn, got_in, dict(n=12))
            assert _same(got, want) and torch.equal(got_in[2], want_in[2]), seed
            assert got[0].data_ptr() != want[0].data_ptr()  # fresh tensors, not the recorded call's
    assert {(fn.__name__, "record"): 1, (fn.__name__, "replay"): 2} == programs.COUNTS
    # per call: the function's own launch, then the replayed one (bound: the stand-in's direct path)
    assert [e[0] for e in log[-4:]] == ["direct"] * 4 and launch.COUNTS["_axpy", "fast"] >= 4
    # at the recording the launcher had no compiled kernel for the key yet (a key's first launch goes through
    # Triton): the first replay launched through the launcher, and the program was generated again with the
    # launch written out (the C launcher called from the program's own lines), which the last replay took
    (program,) = _PROGRAMS[fn].programs.values()
    assert "data_ptr() & 15 ==" in program.source
    before = launch.COUNTS["_axpy", "fast"]
    with torch.no_grad():
        want_in, got_in = _inputs(4, 8), _inputs(4, 8)
        want = fn(*want_in, n=12)
        assert launch.COUNTS["_axpy", "fast"] == before + 1  # the function's own launch
        with monkeypatch.context() as m:  # the written-out launch does not go through the Bound object
            m.setattr(launch.Bound, "__call__", lambda self, args: pytest.fail("the launch was not written out"))
            got = _run("on", fn, got_in, dict(n=12))
        assert _same(got, want) and torch.equal(got_in[2], want_in[2])
    assert launch.COUNTS["_axpy", "fast"] == before + 2 and log[-1][0] == "direct"


def test_a_write_outside_torch_must_be_an_extern_step():
    """Negative control: the same function with its numpy write not marked ``extern`` records without it, and the
    replay leaves the caller's buffer unwritten (this is why the conv's C++ calls are extern steps)."""
    with torch.no_grad():
        for seed in (0, 1):
            want_in, got_in = _inputs(seed), _inputs(seed)
            _segment(*want_in, n=12)
            _run("on", _segment_unmarked, got_in, dict(n=12))
            if seed == 0:
                assert torch.equal(got_in[2], want_in[2])  # recorded: the function ran
            else:
                assert not torch.equal(got_in[2], want_in[2])  # replayed without the write
                assert got_in[2][:, :12].abs().sum() == 0


def _reads_a_value(x, w, out, *, n):
    return x * float(w[0])  # .item(): a value read to the host


_OUTSIDE = torch.ones(40)


def _uses_a_module_tensor(x, w, out, *, n):
    return x + _OUTSIDE


def _launches_around_the_layer(x, w, out, *, n):
    _axpy[(1,)](x[0], w, out[0], 32, 2.0, BLOCK=8)  # Triton's own object: the launch layer does not see it
    return out


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("fn", [_reads_a_value, _uses_a_module_tensor, _launches_around_the_layer])
def test_a_call_that_cannot_be_recorded_runs_every_time(fn):
    _install_stand_in(_axpy, _axpy_math, [])
    with torch.no_grad():
        for seed in (0, 1, 2):
            want_in, got_in = _inputs(seed), _inputs(seed)
            assert _same(_run("on", fn, got_in, dict(n=12)), fn(*want_in, n=12))
    assert {(fn.__name__, "through"): 3} == programs.COUNTS  # once unrecordable, that key always runs the function


def test_the_key():
    """Another shape, dtype, keyword value, aliasing between arguments: each a key of its own. With grad mode on,
    the function runs unrecorded."""
    x, w, out = _inputs(0)
    calls = [
        ((x, w, out), dict(n=12)),
        ((x[:2], w, out[:2]), dict(n=12)),  # another shape
        ((x.double(), w.double(), out.double()), dict(n=12)),  # another dtype
        ((x, w, out), dict(n=20)),  # another value
        ((x, x[0], x), dict(n=12)),  # one tensor for two arguments
    ]
    with torch.no_grad():
        for args, kwargs in calls:
            _run("on", _segment, args, kwargs)
            _run("on", _segment, args, kwargs)
    assert programs.COUNTS == {("_segment", "record"): 5, ("_segment", "replay"): 5}
    _run("on", _segment, (x, w.clone().requires_grad_(), out), dict(n=12))  # grad mode on: run, not recorded
    assert programs.COUNTS["_segment", "record"] == 5 and programs.COUNTS["_segment", "through"] == 1


def test_the_key_holds_the_state_passing_choice(monkeypatch):
    """DS_MAMBA_SPCP_STATE_PASSING picks the kernels the segment code launches: flipped between calls, the next
    call records again instead of replaying the other kernels."""
    from ds_mamba_spcp.ops import pass_states

    assert pass_states.ENV in programs._ENV_READ
    x, w, out = _inputs(0)
    with torch.no_grad():
        for value in ("prefetch", "upstream", "prefetch"):
            monkeypatch.setenv(pass_states.ENV, value)
            _run("on", _segment, (x, w, out), dict(n=12))
    assert programs.COUNTS == {("_segment", "record"): 2, ("_segment", "replay"): 1}


_FLAG = {"clone": False}


def _reads_a_global(x, w, out, *, n):
    y = x * 2
    return y.clone() if _FLAG["clone"] else y


def test_check_mode_catches_python_outside_the_key(monkeypatch):
    """A function whose ops depend on a global, outside its key (what the soundness assumption excludes): check mode
    runs every call, records it again and raises where the ops differ from the kept program's."""
    x, w, out = _inputs(0)
    with torch.no_grad():
        _run("check", _reads_a_global, (x, w, out), dict(n=12))
        _run("check", _reads_a_global, (x, w, out), dict(n=12))  # the same ops: no error
        monkeypatch.setitem(_FLAG, "clone", True)
        with pytest.raises(programs.ProgramMismatch, match="_reads_a_global"):
            _run("check", _reads_a_global, (x, w, out), dict(n=12))
    assert programs.COUNTS[("_reads_a_global", "check")] == 2  # the second call and the one that raised


@pytest.mark.usefixtures("fake_gpu")
def test_a_bound_launch_goes_back_to_the_launcher_for_another_alignment():
    """The recorded launch is bound to its tensors' address alignment: an input 4 bytes off takes the launcher's
    path (a new key of its own: through Triton's stand-in first), with the same result."""
    log = []
    _install_stand_in(_axpy, _axpy_math, log)
    _LAUNCHER["fast"] = launch.launcher(_TUNER)
    fn = _segment_launching
    with torch.no_grad():
        for offset in (0, 4, 1):  # a float32 offset of 1: 4 bytes, not 16-byte aligned
            want_in, got_in = _inputs(3, offset), _inputs(3, offset)
            want = fn(*want_in, n=12)
            assert _same(_run("on", fn, got_in, dict(n=12)), want)
            assert torch.equal(got_in[2], want_in[2])
    assert {(fn.__name__, "record"): 1, (fn.__name__, "replay"): 2} == programs.COUNTS
    assert launch.COUNTS["_axpy", "first"] >= 2  # the misaligned input's key went through Triton's stand-in


def test_mode_values(monkeypatch):
    for raw, launch_mode, want in [("", "on", "on"), ("auto", "check", "on"), ("0", "on", "off"), ("1", "on", "on"),
                                   ("check", "on", "check"), ("1", "off", "off"), ("", "off", "off")]:  # fmt: skip
        monkeypatch.setenv(programs.ENV, raw)
        assert programs.mode(launch_mode) == want, (raw, launch_mode)
    monkeypatch.setenv(programs.ENV, "yes")
    with pytest.raises(ValueError, match=programs.ENV):
        programs.mode("on")


def _chain(x, w, out, *, n):
    y = x
    for _ in range(n):
        y = y * 1.5 + w  # two temporaries per round, each dead after the next op
    return y


class _LiveCount(TorchDispatchMode):
    """The most tensors made under it that were alive at once (weak references, checked at every op)."""

    def __init__(self):
        super().__init__()
        self.made, self.most = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _flat_tensors(out):
            self.made.append(weakref.ref(t))
        self.most = max(self.most, sum(r() is not None for r in self.made))
        return out


def _flat_tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for x in out for t in _flat_tensors(x)] if isinstance(out, (list, tuple)) else []


def test_a_replay_drops_each_intermediate_after_its_last_use(monkeypatch):
    """A recording and a replay hold no more tensors at once than the function does (one more at most: the replay
    frees a value after the step that used it last, the function when its name is rebound; the recorder holds weak
    references only); negative control: with nothing dropped, every intermediate of the 30 rounds stays alive to
    the end."""
    x, w, out = _inputs(0)

    def most_alive(mode):
        with torch.no_grad(), _LiveCount() as live:
            _run(mode, _chain, (x, w, out), dict(n=30))
        return live.most

    ran = most_alive("off")
    assert most_alive("on") <= ran + 1, "the recording kept tensors alive"  # records: the code runs, watched
    assert most_alive("on") <= ran + 1, (ran, programs.COUNTS)
    assert programs.COUNTS["_chain", "replay"] == 1
    _PROGRAMS.clear()
    monkeypatch.setattr(programs, "_last_uses", lambda steps, result, n_inputs: [()] * len(steps))
    most_alive("on")
    assert most_alive("on") > 30, "nothing dropped, yet few tensors alive: the count sees nothing"


def _maybe_copies(x, w, out, *, n):
    a = x.t().contiguous()  # a copy: its schema says it may alias
    b = x[:, ::2].reshape(-1)  # a copy too (not viewable)
    c = x.reshape(-1)  # a view (viewable)
    return a * 2, b + 1, c * w.sum()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_ops_that_may_alias_replay_as_what_they_did(mode):
    """Under inference mode ``contiguous`` and ``reshape`` reach the recorder whole, with schemas that say they may
    alias their input: recorded as views only where they returned one (a replay of a copy as a view of the input
    would read the input's memory in the copy's strides)."""
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        for seed in (0, 1, 2):
            args = _inputs(seed)
            assert _same(_run("on", _maybe_copies, args, dict(n=12)), _maybe_copies(*args, n=12)), seed
    assert programs.COUNTS == {("_maybe_copies", "record"): 1, ("_maybe_copies", "replay"): 2}


def _lists_and_tuples(x, w, out, *, n):
    both = torch.cat([x[:, :n], w[None, :n].expand(x.shape[0], n)], dim=0)  # a list of program tensors
    values, order = torch.sort(x, dim=-1, descending=True)  # an op with two new results
    lo, hi = torch.aminmax(both, dim=0)
    return both, values, order, {"range": (lo, hi), "n": n}


def test_lists_multi_results_and_nested_results_replay():
    """The generated function's other shapes: a list of tensors as an argument, ops with several new results, a
    result nested in a dict of tuples with a plain value beside it."""
    with torch.no_grad():
        for seed in (0, 1, 2):
            args = _inputs(seed, offset=seed)
            got, want = _run("on", _lists_and_tuples, args, dict(n=12)), _lists_and_tuples(*args, n=12)
            assert _same(got[:3], want[:3]) and _same(got[3]["range"], want[3]["range"]) and got[3]["n"] == 12
    assert programs.COUNTS == {("_lists_and_tuples", "record"): 1, ("_lists_and_tuples", "replay"): 2}
    (program,) = _PROGRAMS[_lists_and_tuples].programs.values()
    assert "_flat(" in program.source and "[v" in program.source  # the two-result steps, the list argument
