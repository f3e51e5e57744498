"""The gated delta rule in one process: the plain-PyTorch chunked form against the per-token recurrence and
transformers' ``torch_chunk_gated_delta_rule`` (run in fp64), the op as a group of one, the MATRIX summary type's
algebra, and the op's refusals. The multi-rank cases (cp 2, 3, 5, 8) run in tests/test_summary_exchange.py's
spawned groups (tests/delta_cases.py).

Tolerance: 1e-12 relative (fp64). The chunked form and the recurrence compute the same products in another
association (a triangular solve per chunk against token-by-token updates): seen ~1e-15.
"""

from __future__ import annotations

import sys

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
    with pytest.raises(ValueError, match="cu_seqlens describes one packed row"):
        chunk_gated_delta_rule_sp(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 19]), backend="reference")
    with pytest.raises(ValueError, match="no empty documents"):
        chunk_gated_delta_rule_sp(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 5, 5, 19]),
                                  backend="reference")  # fmt: skip
    with pytest.raises(ValueError, match=r"initial_state must have shape \(N, H, K, V\)"):
        chunk_gated_delta_rule_sp(q, k, v, g, beta, initial_state=S0[:1], backend="reference")
    with pytest.raises(ValueError, match="backend must be one of"):
        chunk_gated_delta_rule_sp(q, k, v, g, beta, backend="triton")


def _fake_fla(monkeypatch, hopper: bool, triton_3_7_1: bool, tilelang: bool, registry: list | None = None) -> list:
    """A stand-in for flash-linear-attention 0.6.0's modules that the fla backend reads (its kernels
    ``chunk_gated_delta_rule`` and ``chunk_kda``: the reference, recording (name, grad enabled, arguments) per call,
    ``chunk_kda`` with fla 0.6.0's signature and its checks of g's shape and the initial state's dtype; the flags of
    ``fla/ops/common/chunk_o.py``; the TileLang backend's availability). registry: a list, then ``fla.backends``
    exists too (its ``register(operation)`` appends (operation, backend instance) there); else it does not."""
    import sys
    import types

    from ds_mamba_spcp.ops import delta_dqkwg

    monkeypatch.setattr(delta_dqkwg, "_installed", False)
    calls = []

    def kernel(*args, **kwargs):
        calls.append(("chunk_gated_delta_rule", torch.is_grad_enabled(), kwargs))
        return R.chunk_gated_delta_rule(*args, **kwargs)

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, **kwargs):  # fmt: skip
        assert tuple(g.shape) == (*v.shape[:3], k.shape[-1]), "g must have shape [B, T, HV, K]"
        assert initial_state is None or initial_state.dtype == torch.float32, "initial_state must be in float32."
        flags = dict(use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                     allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                     state_v_first=state_v_first, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     v_cols=v.shape[-1], state=None if initial_state is None else tuple(initial_state.shape),
                     )  # fmt: skip
        calls.append(("chunk_kda", torch.is_grad_enabled(), flags))
        return R.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # fmt: skip

    class TileLang:
        @classmethod
        def is_available(cls):
            return tilelang

        def is_enabled(self):
            return True

    mods = {
        "fla": {}, "fla.ops": {}, "fla.ops.gated_delta_rule": dict(chunk_gated_delta_rule=kernel), "fla.ops.common": {},
        "fla.ops.kda": dict(chunk_kda=chunk_kda),
        "fla.ops.common.chunk_o": dict(IS_NVIDIA_HOPPER=hopper, TRITON_ABOVE_3_4_0=True,
                                       TRITON_ABOVE_3_7_1=triton_3_7_1),
        "fla.ops.common.backends": dict(CommonTileLangBackend=TileLang), "triton": dict(__version__="3.6.0"),
    }  # fmt: skip
    if registry is not None:
        mods["fla.backends"] = dict(BaseBackend=object, _DISPATCH_DISABLED=False,
                                    register=lambda op: lambda cls: registry.append((op, cls())))  # fmt: skip
    else:
        monkeypatch.setitem(sys.modules, "fla.backends", None)  # an fla without the dispatch: ImportError
    for name, attrs in mods.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs, __path__=[]))
    return calls


def _grads_enabled(calls) -> list:
    return [grad for _, grad, _ in calls]


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
    assert _grads_enabled(calls) == [False]
    with pytest.warns(RuntimeWarning, match="issue 640.*plain-PyTorch reference"):
        o, _ = D.get_delta_backend("auto", "cuda")(*ins)
    assert _grads_enabled(calls) == [False] and o.requires_grad
    for fixed in (dict(triton_3_7_1=True, tilelang=False), dict(triton_3_7_1=False, tilelang=True)):
        calls = _fake_fla(monkeypatch, hopper=True, **fixed)
        D.get_delta_backend("fla", "cuda")(*ins)
        assert _grads_enabled(calls) == [True], fixed


def test_fla_backend_installs_its_stand_in_where_fla_refuses(monkeypatch):
    """Where fla refuses its gated backward (Hopper, Triton 3.4-3.7.0, no TileLang) and has its dispatch, the fla
    backend registers ops/delta_dqkwg.py's kernel with fla's "common" operations (once, after TileLang in priority)
    and runs the call with gradients on fla; the registered verifier takes the gated calls alone and only where fla
    refuses; DS_MAMBA_SPCP_FLA_DQKWG=0 keeps the refusal."""
    from ds_mamba_spcp.ops import delta as D
    from ds_mamba_spcp.ops import delta_dqkwg

    ins = [t.float().requires_grad_() for t in _data(B=1, N=1)[:5]]
    registry = []
    calls = _fake_fla(monkeypatch, hopper=True, triton_3_7_1=False, tilelang=False, registry=registry)
    D.get_delta_backend("fla", "cuda")(*ins)
    D.get_delta_backend("fla", "cuda")(*ins)
    assert _grads_enabled(calls) == [True, True]
    assert [op for op, _ in registry] == ["common"]  # once
    backend = registry[0][1]
    assert backend.backend_type == delta_dqkwg.BACKEND_TYPE and backend.priority == 6
    assert backend.chunk_bwd_dqkwg.__func__.__qualname__.endswith("TorchDqkwg.chunk_bwd_dqkwg")
    args = [torch.zeros(1)] * 6
    assert backend.chunk_bwd_dqkwg_verifier(*args, g=torch.zeros(1)) == (True, None)
    assert backend.chunk_bwd_dqkwg_verifier(*args)[0] is False  # ungated: fla's kernel is right
    assert backend.chunk_bwd_dqkwg_verifier(*args, g=torch.zeros(1), g_gamma=torch.zeros(1))[0] is False
    _fake_fla(monkeypatch, hopper=True, triton_3_7_1=True, tilelang=False, registry=[])
    assert backend.chunk_bwd_dqkwg_verifier(*args, g=torch.zeros(1))[0] is False  # fla's kernel runs correctly
    _fake_fla(monkeypatch, hopper=True, triton_3_7_1=False, tilelang=False, registry=registry)
    monkeypatch.setattr(delta_dqkwg, "_installed", True)  # the same process as above (_fake_fla resets it)
    monkeypatch.setenv(delta_dqkwg.ENV, "0")  # switched off after it was registered: fla's refusal again
    assert backend.chunk_bwd_dqkwg_verifier(*args, g=torch.zeros(1))[0] is False
    with pytest.raises(RuntimeError, match="issue 640.*DS_MAMBA_SPCP_FLA_DQKWG=0"):
        D.get_delta_backend("fla", "cuda")(*ins)
    assert len(registry) == 1 and delta_dqkwg.installed()


def test_wrapped_delta_layers_install_the_stand_in_on_cuda(monkeypatch):
    """Wrapping Gated DeltaNet layers (integrations/transformers/delta.py) installs the stand-in where fla refuses,
    for transformers' own calls into fla: on a CUDA machine only, and nothing where fla is not installed."""
    from ds_mamba_spcp.integrations.transformers import delta as adapter

    registry = []
    _fake_fla(monkeypatch, hopper=True, triton_3_7_1=False, tilelang=False, registry=registry)
    monkeypatch.setattr(adapter.torch.cuda, "is_available", lambda: False)
    adapter._install_fla_stand_in()
    assert registry == []
    monkeypatch.setattr(adapter.torch.cuda, "is_available", lambda: True)
    adapter._install_fla_stand_in()
    assert [op for op, _ in registry] == ["common"]
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", None)  # fla not installed: ImportError, passed over
    adapter._install_fla_stand_in()


def test_fla_backend_sends_a_per_channel_gate_to_chunk_kda(monkeypatch):
    """Kimi's KDA on fla (issue 44): a gate per key channel reaches fla's ``chunk_kda`` (a gate per head its
    ``chunk_gated_delta_rule``) with the op's contract: g in log space (``use_gate_in_kernel=False``), beta already a
    sigmoid, no gate bound, K x V states, an fp32 initial state (a bf16 one is cast: chunk_kda asserts fp32); "fla"
    and "auto" (on CUDA) take it, also with gradients where fla refuses the per-head backward (KDA's backward does
    not reach that kernel); through the op (a group of one) with the V + K columns; K > 256 refused by name ("auto":
    the reference, warned). The fake kernels are the reference, so o matches the reference exactly. On the old code
    the per-channel gate reached ``chunk_gated_delta_rule`` and the op refused backend "fla" for it."""
    from ds_mamba_spcp.ops import delta as D

    kda = [t.float() for t in _kda_data(packed=True)]
    kda[5] = kda[5].bfloat16()
    ins = [t.clone().requires_grad_() for t in kda]
    cu = torch.tensor([0, 3, 4, 11, 19])
    kw = dict(output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    want = R.chunk_gated_delta_rule(*kda[:5], initial_state=kda[5].float(), **kw)
    flags = dict(use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                 safe_gate=False, lower_bound=None, state_v_first=False)  # fmt: skip
    for hopper_bug in (False, True):  # fla's per-head backward refused (issue 640) or not: KDA runs on fla either way
        calls = _fake_fla(monkeypatch, hopper=hopper_bug, triton_3_7_1=False, tilelang=False)
        for name in ("fla", "auto"):
            o, f = D.get_delta_backend(name, "cuda")(*ins[:5], initial_state=ins[5], scale=0.3, **kw)
            assert torch.equal(o, R.chunk_gated_delta_rule(*kda[:5], initial_state=kda[5].float(), scale=0.3, **kw)[0])
        assert [c[:2] for c in calls] == [("chunk_kda", True)] * 2, calls
        assert all({k: c[2][k] for k in flags} == flags and c[2]["scale"] == 0.3 for c in calls), calls
        (o.sum() + f.sum()).backward()
        assert ins[5].grad.dtype == torch.bfloat16 and ins[3].grad.shape == kda[3].shape
    # a gate per head still reaches chunk_gated_delta_rule
    calls = _fake_fla(monkeypatch, hopper=False, triton_3_7_1=False, tilelang=False)
    D.get_delta_backend("fla", "cuda")(*ins[:3], ins[3][..., 0], ins[4], initial_state=ins[5].float(), **kw)
    assert [c[0] for c in calls] == ["chunk_gated_delta_rule"]
    # the op with backend "fla" (CPU tensors reach the fake): chunk_kda on the pieces, V + K columns, fp32 states
    calls = _fake_fla(monkeypatch, hopper=True, triton_3_7_1=False, tilelang=False)
    o, f = chunk_gated_delta_rule_sp(*kda[:5], initial_state=kda[5], backend="fla", **kw)
    H, K, V = kda[2].shape[2], kda[0].shape[3], kda[2].shape[3]
    assert [c[0] for c in calls] == ["chunk_kda"] and calls[0][2]["v_cols"] == V + K
    assert calls[0][2]["state"] == (4, H, K, V + K)
    assert _rel(o, want[0]) <= 1e-6 and _rel(f, want[1]) <= 1e-6  # fp32: the op adds the V + K columns' products
    # K > 256: fla asserts; refused by name first ("auto": the reference, warned)
    big = _data(B=1, T=3, H=1, K=257, V=2)[:5]
    with pytest.raises(RuntimeError, match=r"at most 256 channels, K = 257.*backend='reference'"):
        D.get_delta_backend("fla", "cuda")(*big)
    with pytest.warns(RuntimeWarning, match="at most 256 channels"):
        D.get_delta_backend("auto", "cuda")(*big)
    assert [c[0] for c in calls] == ["chunk_kda"]
