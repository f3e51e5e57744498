"""The gated delta rule in one process: the plain-PyTorch chunked form against the per-token recurrence and
transformers' ``torch_chunk_gated_delta_rule`` (run in fp64), the op as a group of one, the MATRIX summary type's
algebra, and the op's refusals. The multi-rank cases (cp 2, 3, 5, 8) run in tests/test_summary_exchange.py's
spawned groups (tests/delta_cases.py).

Tolerance: 1e-12 relative (fp64). The chunked form and the recurrence compute the same products in another
association (a triangular solve per chunk against token-by-token updates): seen ~1e-15.
"""

from __future__ import annotations

import pytest
import torch

from ds_mamba_spcp.delta_op import chunk_gated_delta_rule_sp
from ds_mamba_spcp.engine import summary
from ds_mamba_spcp.ops import delta_reference as R
from tests import delta_cases

TOL = 1e-12


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _data(B=2, T=19, Hk=1, H=2, K=4, V=6, N=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return [r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, H, V), -torch.rand(B, T, H, generator=g, dtype=torch.float64),
            torch.rand(B, T, H, generator=g, dtype=torch.float64), r(B if N is None else N, H, K, V)]  # fmt: skip


def _run(fn, data, cu=None, **kw):
    ins = [t.clone().requires_grad_() for t in data]
    o, f = fn(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
              **kw)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    do = torch.randn(o.shape, generator=g, dtype=o.dtype)
    df = torch.randn(f.shape, generator=g, dtype=f.dtype)
    ((o * do).sum() + (f * df).sum()).backward()
    return [o.detach(), f.detach(), *[t.grad for t in ins]]


@pytest.mark.parametrize("packed", [False, True], ids=["batch2", "packed"])
def test_chunked_reference_and_group_of_one_match_the_recurrence(packed):
    """Chunks of 4 and of 64 (one chunk), and the op as a group of one, against the recurrence: o, final, dq, dk,
    dv, dg, dbeta, dinitial_state; grouped heads (one q/k head for two value heads)."""
    cu = torch.tensor([0, 3, 4, 11, 19]) if packed else None
    data = _data(B=1 if packed else 2, N=4 if packed else None)
    want = _run(R.recurrent_gated_delta_rule, data, cu)
    for got in (_run(R.chunk_gated_delta_rule, data, cu, chunk_size=4), _run(R.chunk_gated_delta_rule, data, cu),
                _run(chunk_gated_delta_rule_sp, data, cu, backend="reference")):  # fmt: skip
        errs = [_rel(a, b) for a, b in zip(got, want)]
        assert max(errs) <= TOL, errs


def test_recurrence_matches_transformers_chunked_form():
    """The ground truth itself against transformers' implementation (models/qwen3_5), both fp64."""
    data = _data(Hk=2)
    hf = delta_cases.transformers_chunk_fp64()
    want = _run(lambda *a, cu_seqlens=None, **kw: hf(*a, chunk_size=8, **kw), data)
    got = _run(R.recurrent_gated_delta_rule, data)
    errs = [_rel(a, b) for a, b in zip(got, want)]
    assert max(errs) <= TOL, errs


def _kda_data(packed: bool = False):
    """``_data`` with a gate per key channel, g (B, T, H, K)."""
    data = _data(B=1 if packed else 2, N=4 if packed else None)
    gen = torch.Generator().manual_seed(3)
    data[3] = -torch.rand(*data[3].shape, 4, generator=gen, dtype=torch.float64)
    return data


@pytest.mark.parametrize("packed", [False, True], ids=["batch2", "packed"])
def test_kda_chunked_reference_and_group_of_one_match_the_recurrence(packed):
    """A gate per key channel (Kimi's KDA): the chunked form (chunks of 4 and 64) and the op as a group of one against
    the per-token recurrence, o, final, and every gradient (dg per channel), grouped heads; the recurrence against
    transformers' KDA recurrence (models/kimi_linear, fp64; its chunked form rounds its decay mask to fp32). Negative
    control: the gate averaged over the channels (a scalar per head) is off by > 1e-2."""
    cu = torch.tensor([0, 3, 4, 11, 19]) if packed else None
    data = _kda_data(packed)
    want = _run(R.recurrent_gated_delta_rule, data, cu)
    for got in (_run(R.chunk_gated_delta_rule, data, cu, chunk_size=4), _run(R.chunk_gated_delta_rule, data, cu),
                _run(chunk_gated_delta_rule_sp, data, cu, backend="reference")):  # fmt: skip
        errs = [_rel(a, b) for a, b in zip(got, want)]
        assert max(errs) <= TOL, errs
    if not packed:
        hf = delta_cases.transformers_kda_fp64()
        got = _run(lambda *a, cu_seqlens=None, **kw: hf(*a, **kw), data)
        errs = [_rel(a, b) for a, b in zip(got, want)]
        assert max(errs) <= TOL, errs
    scalar = list(data)
    scalar[3] = data[3].mean(-1)
    assert _rel(_run(R.recurrent_gated_delta_rule, scalar, cu)[0], want[0]) > 1e-2


def test_matrix_summary_composes_as_the_recurrence():
    """(U, M) of two runs composed = the summary of their concatenation; the sequential exclusive and reverse scans
    agree with applying the maps one by one (the adjoint: M^T)."""
    g = torch.Generator().manual_seed(1)
    n, shape_U, shape_M = 5, (2, 3, 4, 6), (2, 3, 4, 4)
    U = torch.randn(n, *shape_U, generator=g, dtype=torch.float64)
    M = torch.randn(n, *shape_M, generator=g, dtype=torch.float64) / 2
    M[2, 0, 1] = 0  # a document start: the chain is cut there
    S_in, final = summary.exclusive_scan(summary.MATRIX, U, M)
    S = torch.zeros(shape_U, dtype=torch.float64)
    for s in range(n):
        assert torch.allclose(S_in[s], S, rtol=0, atol=1e-13)
        S = M[s] @ S + U[s]
    assert torch.allclose(final, S, rtol=0, atol=1e-13)
    both = summary.MATRIX.compose((U[0], M[0]), (U[1], M[1]))
    assert torch.allclose(summary.MATRIX.enter(both, S), M[1] @ (M[0] @ S + U[0]) + U[1], rtol=0, atol=1e-13)
    # the reverse scan is the adjoint: <L, S_in> summed over segments equals <dS_out, U> summed (one linear map)
    L = torch.randn(n, *shape_U, generator=g, dtype=torch.float64)
    dS_out, dinit = summary.reverse_scan(summary.MATRIX, L, M)
    lhs = sum((L[s] * S_in[s]).sum() for s in range(n))
    rhs = sum((dS_out[s] * U[s]).sum() for s in range(n))
    assert abs((lhs - rhs).item()) <= 1e-12 * abs(lhs.item())
    assert dinit.shape == shape_U


def test_refusals_name_the_setting():
    q, k, v, g, beta, S0 = _data()
    with pytest.raises(ValueError, match=r"a gate per key channel \(KDA\)"):
        chunk_gated_delta_rule_sp(q, k, v, g[..., None].expand(*g.shape, 5), beta, backend="reference")  # K is 4
    with pytest.raises(NotImplementedError, match='backend="reference"'):
        chunk_gated_delta_rule_sp(q, k, v, g[..., None].expand(*g.shape, 4), beta, backend="fla")
    with pytest.raises(ValueError, match="cu_seqlens describes one packed row"):
        chunk_gated_delta_rule_sp(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 19]), backend="reference")
    with pytest.raises(ValueError, match="no empty documents"):
        chunk_gated_delta_rule_sp(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 5, 5, 19]),
                                  backend="reference")  # fmt: skip
    with pytest.raises(ValueError, match=r"initial_state must have shape \(N, H, K, V\)"):
        chunk_gated_delta_rule_sp(q, k, v, g, beta, initial_state=S0[:1], backend="reference")
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_gated_delta_rule_sp(q, k, v, g, beta, backend="triton")


def _fake_fla(monkeypatch, hopper: bool, triton_3_7_1: bool, tilelang: bool) -> list:
    """A stand-in for flash-linear-attention 0.6.0's modules that the fla backend reads (its kernel: the reference,
    recording its calls; the flags of ``fla/ops/common/chunk_o.py``; the TileLang backend's availability)."""
    import sys
    import types

    calls = []

    def kernel(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return R.chunk_gated_delta_rule(*args, **kwargs)

    class TileLang:
        @classmethod
        def is_available(cls):
            return tilelang

        def is_enabled(self):
            return True

    mods = {
        "fla": {}, "fla.ops": {}, "fla.ops.gated_delta_rule": dict(chunk_gated_delta_rule=kernel), "fla.ops.common": {},
        "fla.ops.common.chunk_o": dict(IS_NVIDIA_HOPPER=hopper, TRITON_ABOVE_3_4_0=True,
                                       TRITON_ABOVE_3_7_1=triton_3_7_1),
        "fla.ops.common.backends": dict(CommonTileLangBackend=TileLang), "triton": dict(__version__="3.6.0"),
    }  # fmt: skip
    for name, attrs in mods.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs, __path__=[]))
    return calls


def test_fla_backend_refuses_a_backward_that_fla_refuses(monkeypatch):
    """fla 0.6.0 raises in the gated backward on Hopper with Triton >= 3.4, < 3.7.1 and no TileLang (its issue 640,
    ``fla/ops/common/chunk_o.py``): backend "fla" refuses such a call before its forward (no rank is left waiting in
    a collective while another fails in the backward) and names the way out; without gradients the call runs on
    fla; "auto" falls back to the reference with a warning; with Triton 3.7.1 or TileLang, fla runs with
    gradients. On the old backend the refused call went through to fla (no error)."""
    from ds_mamba_spcp.ops import delta as D

    data = _data(B=1, N=1)
    ins = [t.float().requires_grad_() for t in data[:5]]
    calls = _fake_fla(monkeypatch, hopper=True, triton_3_7_1=False, tilelang=False)
    with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0.*issue 640.*Triton >= 3\.7\.1 or tilelang.*'reference'"):
        D.get_delta_backend("fla", "cuda")(*ins)
    with torch.no_grad():
        D.get_delta_backend("fla", "cuda")(*ins)
    assert calls == [False]
    with pytest.warns(RuntimeWarning, match="issue 640.*plain-PyTorch reference"):
        o, _ = D.get_delta_backend("auto", "cuda")(*ins)
    assert calls == [False] and o.requires_grad
    for fixed in (dict(triton_3_7_1=True, tilelang=False), dict(triton_3_7_1=False, tilelang=True)):
        calls = _fake_fla(monkeypatch, hopper=True, **fixed)
        D.get_delta_backend("fla", "cuda")(*ins)
        assert calls == [True], fixed
