"""``ops/delta_dqkwg.py``: fla's gated ``chunk_bwd_dqkwg`` in PyTorch (the stand-in for Hopper with Triton 3.4-3.7.0).

The oracle is autograd in fp64 over the chunk's forward written out token by token in the module docstring's terms
(<do, o> + <dh, h_out> + <dv, v_new>, chunk by chunk, head by head, loops written here and not shared with the module).
In fp64 the function must match it to rounding (1e-12 relative: the same sums, in another order); a negative control
hands the function every chunk's dh one chunk late and must miss by far. bf16 inputs: the function rounds h, dh and
the score matrix to bf16 where fla's kernel does, so it sits within bf16 noise of the fp64 oracle on the same values.
Against fla's own Triton kernel (under the Triton interpreter, where fla is installed): ``test_matches_fla_kernel``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from ds_mamba_spcp.ops import delta_dqkwg

H, HV, K, V, BT = 2, 4, 8, 6, 16  # K != V: a transposed state shows; HV = 2 H: grouped heads
EXACT = 1e-12  # fp64 against fp64: only the order of the sums differs
BF16 = 2e-2  # bf16 operands (2^-9 relative each) through two products and a bf16 score matrix; measured 2.4e-3


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def chunks(cu, batch, seqlen):
    """Per row, its chunks (start, end): each document cut into BT-token chunks, the last one short."""
    rows = [list(zip(cu[:-1], cu[1:]))] if cu is not None else [[(0, seqlen)]] * batch
    return [[(c0, min(c0 + BT, b)) for a, b in docs for c0 in range(a, b, BT)] for docs in rows]


def case(cu, batch=1, seqlen=None, dtype=torch.float64, v_first=False, seed=0):
    """Random inputs of fla's call: cu (a packed row's documents) or batch x seqlen rows; h, dh one per chunk."""
    g = torch.Generator().manual_seed(seed)
    T = cu[-1] if cu is not None else seqlen
    rows = chunks(cu, batch, T)
    B, n = len(rows), len(rows[0])
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    state = (B, n, HV, V, K) if v_first else (B, n, HV, K, V)
    gate = -0.3 * torch.rand(B, T, HV, generator=g, dtype=torch.float64)
    G = torch.empty_like(gate)  # the chunk-local cumsum in log2 units, as fla hands it over
    for row, cuts in enumerate(rows):
        for c0, c1 in cuts:
            G[row, c0:c1] = gate[row, c0:c1].cumsum(0) / math.log(2)
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), do=r(B, T, HV, V), h=r(*state), dh=r(*state),
             w=r(B, T, HV, K), dv=r(B, T, HV, V))  # fmt: skip
    x = {n: t.to(dtype) if n != "dh" or dtype == torch.float64 else t.float() for n, t in x.items()}
    x["g"] = G if dtype == torch.float64 else G.float()
    return x, (torch.tensor(cu) if cu is not None else None)


def oracle(x, cu, scale, v_first):
    """fp64 autograd of the chunk forward (module docstring), chunk by chunk and head by head."""
    d = {n: t.double() for n, t in x.items()}
    q, k, w = (d[n].clone().requires_grad_() for n in ("q", "k", "w"))
    G = (d["g"] * math.log(2)).requires_grad_()  # the natural-log cumulative gate: what dg is the gradient of
    loss = 0
    for row, cuts in enumerate(chunks(cu.tolist() if cu is not None else None, q.shape[0], q.shape[1])):
        for chunk, (c0, c1) in enumerate(cuts):
            for j in range(HV):
                hs, dh = d["h"][row, chunk, j], d["dh"][row, chunk, j]
                if v_first:
                    hs, dh = hs.T, dh.T
                qh, kh = q[row, c0:c1, j // (HV // H)], k[row, c0:c1, j // (HV // H)]
                vh, gh = d["v"][row, c0:c1, j], G[row, c0:c1, j]
                decay = torch.tril(torch.exp(gh[:, None] - gh[None, :]))
                o = scale * (torch.exp(gh)[:, None] * (qh @ hs) + ((qh @ kh.T) * decay) @ vh)
                h_out = torch.exp(gh[-1]) * hs + (kh * torch.exp(gh[-1] - gh)[:, None]).T @ vh
                v_new = -w[row, c0:c1, j] @ hs
                loss = loss + (d["do"][row, c0:c1, j] * o).sum() + (dh * h_out).sum()
                loss = loss + (d["dv"][row, c0:c1, j] * v_new).sum()
    loss.backward()
    return q.grad, k.grad, w.grad, G.grad


def call(x, cu, scale, v_first, **over):
    y = {**x, **over}
    return delta_dqkwg.chunk_bwd_dqkwg(y["q"], y["k"], y["v"], y["do"], y["h"], y["dh"], w=y["w"], g=y["g"],
                                       dv=y["dv"], scale=scale, state_v_first=v_first, cu_seqlens=cu,
                                       chunk_size=BT)  # fmt: skip


LAYOUTS = {
    # documents of 37 (chunks 16, 16, 5), 1 and 52 tokens: short chunks, a one-token document
    "packed": dict(cu=[0, 37, 38, 90]),
    "rows_v_first": dict(cu=None, batch=2, seqlen=40, v_first=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("slices", ["one", "per_chunk"])
def test_exact_in_fp64(layout, slices, monkeypatch):
    kw = dict(LAYOUTS[layout])
    v_first = kw.pop("v_first", False)
    if slices == "per_chunk":  # a slice of one chunk: the slicing's bookkeeping
        monkeypatch.setattr(delta_dqkwg, "SLICE_ELEMENTS", 1)
    x, cu = case(v_first=v_first, **kw)
    want = oracle(x, cu, 0.3, v_first)
    got = call(x, cu, 0.3, v_first)
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert max(errs) < EXACT, f"dq, dk, dw, dg relative errors {errs}"


def test_negative_control_dh_one_chunk_late():
    x, cu = case(**LAYOUTS["packed"])
    want = oracle(x, cu, 0.3, False)
    got = call(x, cu, 0.3, False, dh=torch.roll(x["dh"], 1, dims=1))
    assert rel(got[1], want[1]) > 0.1 and rel(got[3], want[3]) > 0.1  # dk and dg read dh: far off


def test_bf16_within_rounding():
    x, cu = case(**LAYOUTS["packed"], dtype=torch.bfloat16)
    want = oracle(x, cu, 0.3, False)
    got = call(x, cu, 0.3, False)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32]
    errs = [rel(a, b) for a, b in zip(got, want)]
    assert max(errs) < BF16, f"dq, dk, dw, dg relative errors {errs}"


def test_refuses_what_it_does_not_compute():
    x, cu = case(**LAYOUTS["packed"])
    with pytest.raises(NotImplementedError, match="gated case only"):
        call(x, cu, 0.3, False, g=None)
    with pytest.raises(ValueError, match="chunk states"):
        call(x, cu, 0.3, False, h=x["h"][:, 1:], dh=x["dh"][:, 1:])


def test_install_without_fla_or_when_switched_off(monkeypatch):
    monkeypatch.setattr(delta_dqkwg, "_installed", False)
    monkeypatch.setenv(delta_dqkwg.ENV, "0")
    assert delta_dqkwg.install() is False
    monkeypatch.delenv(delta_dqkwg.ENV)
    if importlib.util.find_spec("fla") is None:
        assert delta_dqkwg.install() is False


_FLA_CHECK = r"""
import sys, torch
import triton.runtime.autotuner as tuner
tuner.Autotuner.prune_configs = lambda self, kwargs, *a: self.configs[:1]  # the interpreter cannot time configs
from tests.test_delta_dqkwg import case, call, rel, LAYOUTS
from fla.ops.common.chunk_o import chunk_bwd_dqkwg
worst = 0.0
for name, kw in LAYOUTS.items():
    kw = dict(kw); v_first = kw.pop("v_first", False)
    x, cu = case(dtype=torch.float32, v_first=v_first, **kw)
    x = {n: t.float() for n, t in x.items()}
    want = chunk_bwd_dqkwg(x["q"], x["k"], x["v"], x["do"], x["h"], x["dh"], w=x["w"], g=x["g"], dv=x["dv"],
                           scale=0.3, state_v_first=v_first, cu_seqlens=cu, chunk_size=16)
    got = call(x, cu, 0.3, v_first)
    assert [(a.shape, a.dtype) for a in got] == [(b.shape, b.dtype) for b in want], name
    errs = [rel(a, b) for a, b in zip(got, want)]
    print(name, errs)
    worst = max(worst, *errs)
sys.exit(0 if worst < 1e-5 else 1)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (fla-core 0.6.0)")
def test_matches_fla_kernel():
    """fla's own Triton kernel (the interpreter, fp32: off machines where it is miscompiled) gives the same four
    outputs (1e-5: fp32 sums in another order, against values of order 1-100)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _FLA_CHECK], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


_KERNEL_CHECK = r"""
import sys, torch
import triton.runtime.autotuner as tuner
tuner.Autotuner.prune_configs = lambda self, kwargs, *a: self.configs[:1]  # the interpreter cannot time configs
import tests.test_delta_dqkwg as t
from ds_mamba_spcp.ops import delta_dqkwg, delta_dqkwg_kernel

def kernel(x, cu, v_first, dh):
    start, end = delta_dqkwg.chunk_bounds(x["q"].shape[0], x["q"].shape[1], t.BT, cu, x["q"].device)
    return delta_dqkwg_kernel.chunk_bwd_dqkwg(x["q"], x["k"], x["v"], x["do"], x["h"], dh, x["w"], x["g"], x["dv"],
                                              0.3, v_first, start, end, t.BT)

worst, control = 0.0, []
# the two layouts, then K = 144 and V = 80: two blocks of K (dg summed over them) and two of V
for name, kw, kv in [*((n, kw, None) for n, kw in t.LAYOUTS.items()), ("wide", dict(cu=[0, 20, 50]), (144, 80))]:
    if kv:
        t.K, t.V = kv
    kw = dict(kw); v_first = kw.pop("v_first", False)
    x, cu = t.case(dtype=torch.float32, v_first=v_first, **kw)
    x = {n: v.float() for n, v in x.items()}
    want = t.call(x, cu, 0.3, v_first)
    got = kernel(x, cu, v_first, x["dh"])
    assert [(a.shape, a.dtype) for a in got] == [(b.shape, b.dtype) for b in want], name
    errs = [t.rel(a, b) for a, b in zip(got, want)]
    late = kernel(x, cu, v_first, torch.roll(x["dh"], 1, dims=1))
    control.append(t.rel(late[1], want[1]))
    print(name, errs, "dh one chunk late: dk", control[-1])
    worst = max(worst, *errs)
sys.exit(0 if worst < 1e-5 and min(control) > 0.1 else 1)
"""


def test_triton_kernel_matches_under_the_interpreter():
    """``ops/delta_dqkwg_kernel.py`` under Triton's interpreter (fp32: the interpreter has no bf16) against the
    PyTorch function: 1e-5 (fp32 sums in another order, values of order 1-100); packed documents with short chunks,
    batch rows with the state stored V x K, and K = 144, V = 80 (two blocks of each). Negative control: dh handed one
    chunk late must move dk by 10% at least. The GPU check at bf16 and full size: tests/test_gpu_delta.py."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_implementation_choice(monkeypatch):
    """``DS_MAMBA_SPCP_FLA_DQKWG`` picks the PyTorch function or the Triton kernel; unset, the default; a CPU tensor
    never takes the kernel; a misspelt value is refused, not read as the default."""
    monkeypatch.delenv(delta_dqkwg.ENV, raising=False)
    assert delta_dqkwg.implementation() == delta_dqkwg.DEFAULT
    for value in ("torch", "triton"):
        monkeypatch.setenv(delta_dqkwg.ENV, value)
        assert delta_dqkwg.implementation() == value
    assert not delta_dqkwg.kernel_applies(torch.zeros(1), 64)  # "triton" still set: CPU tensors take the function
    monkeypatch.setenv(delta_dqkwg.ENV, "trition")
    with pytest.raises(ValueError, match="expected torch, triton"):
        delta_dqkwg.implementation()
