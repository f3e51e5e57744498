"""The plain-PyTorch reference backend, the summary algebra and the layouts, in one process.

fp64 throughout: each check compares two evaluations of the same sums in a different order
(chunked vs token by token, affine split vs direct), so agreement is at rounding level (~1e-15);
1e-12 is the bound, far below any real mistake (a dropped decay or a shifted index is O(1)).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_mamba_spcp import mamba_split_conv1d_scan_ref, mamba_split_conv1d_scan_sp
from ds_mamba_spcp.engine import layout, scan
from ds_mamba_spcp.ops import reference as ref
from ds_mamba_spcp.ops.segment import LocalExchange, drive_bwd, drive_fwd
from ds_mamba_spcp.ops.spec import CoreSpec
from tests.dist_utils import rel_err

TOL = 1e-12
F64 = torch.float64


def ssd_inputs(batch, seqlen, nheads, headdim, ngroups, dstate, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seqlen, nheads, headdim, generator=g, dtype=F64)
    dt = torch.rand(batch, seqlen, nheads, generator=g, dtype=F64)
    A = -torch.rand(nheads, generator=g, dtype=F64) - 0.2
    B = torch.randn(batch, seqlen, ngroups, dstate, generator=g, dtype=F64)
    C = torch.randn(batch, seqlen, ngroups, dstate, generator=g, dtype=F64)
    S0 = torch.randn(batch, nheads, headdim, dstate, generator=g, dtype=F64)
    return x, dt, A, B, C, S0


@pytest.mark.parametrize("seqlen", [1, 7, 16, 37])
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_ssd_matches_recurrence(seqlen, ngroups, with_init):
    x, dt, A, B, C, S0 = ssd_inputs(2, seqlen, 4, 3, ngroups, 5)
    init = S0 if with_init else None
    y, final = ref.ssd_chunked_ref(x, dt, A, B, C, chunk_size=8, initial_states=init)
    y_rec, final_rec = ref.ssd_recurrent_ref(x, dt, A, B, C, initial_states=init)
    assert rel_err(y, y_rec) < TOL
    assert rel_err(final, final_rec) < TOL


def test_incoming_state_is_affine():
    """y(S_in) = y(0) + correction(S_in) and S_out = a*S_in + S_ext: the algebra SP relies on."""
    x, dt, A, B, C, S0 = ssd_inputs(2, 29, 4, 3, 2, 5)
    y_direct, final_direct = ref.ssd_chunked_ref(x, dt, A, B, C, 8, S0)
    y0, S_ext = ref.ssd_chunked_ref(x, dt, A, B, C, 8)
    log_a = (dt * A).sum(dim=1)
    assert rel_err(ref.apply_incoming_state(y0, C, dt, A, S0), y_direct) < TOL
    assert rel_err(torch.exp(log_a)[..., None, None] * S0 + S_ext, final_direct) < TOL


def test_conv_initial_states_continue_the_sequence():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 20, 6, generator=g, dtype=F64)
    w, b = torch.randn(6, 4, generator=g, dtype=F64), torch.randn(6, generator=g, dtype=F64)
    full = ref.causal_conv1d_ref(x, w, b)
    tail = ref.causal_conv1d_ref(x[:, 9:], w, b, initial_states=x[:, 6:9])
    assert torch.equal(full[:, :9], ref.causal_conv1d_ref(x[:, :9], w, b))
    assert rel_err(tail, full[:, 9:]) < TOL
    # and it is the textbook causal conv: left zero padding of width-1
    direct = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), w.unsqueeze(1), b, groups=6)).transpose(1, 2)
    assert rel_err(full, direct) < TOL


def core_inputs(batch=2, seqlen=23, nheads=4, headdim=3, ngroups=2, dstate=5, d_conv=4, seed=0, D2=False):
    g = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = nheads * headdim, nheads * headdim + 2 * ngroups * dstate
    t = dict(
        zxbcdt=torch.randn(batch, seqlen, 2 * d_inner + 2 * ngroups * dstate + nheads, generator=g, dtype=F64),
        conv1d_weight=torch.randn(conv_dim, d_conv, generator=g, dtype=F64) * 0.5,
        conv1d_bias=torch.randn(conv_dim, generator=g, dtype=F64) * 0.5,
        dt_bias=torch.randn(nheads, generator=g, dtype=F64) * 0.5,
        A=-torch.rand(nheads, generator=g, dtype=F64) - 0.5,
        D=torch.randn(nheads, headdim, generator=g, dtype=F64) if D2 else torch.randn(nheads, generator=g, dtype=F64),
    )
    extra = dict(
        rmsnorm_weight=torch.rand(d_inner, generator=g, dtype=F64) + 0.5,
        initial_states=torch.randn(batch, nheads, headdim, dstate, generator=g, dtype=F64),
    )
    return t, extra, dict(headdim=headdim, ngroups=ngroups)


def core_by_recurrence(t, extra, headdim, ngroups, norm_before_gate, dt_limit):
    """The mixer core written out token by token: conv, softplus, recurrence, D, gate, norm."""
    nheads = t["A"].shape[0]
    d_inner = nheads * headdim
    z, xBC, dt = torch.split(t["zxbcdt"], [d_inner, t["conv1d_weight"].shape[0], nheads], -1)
    K = t["conv1d_weight"].shape[1]
    conv = torch.stack(
        [
            (F.pad(xBC, (0, 0, K - 1, 0))[:, s : s + K] * t["conv1d_weight"].T).sum(1) + t["conv1d_bias"]
            for s in range(xBC.shape[1])
        ],
        dim=1,
    )
    xBC = F.silu(conv)
    dstate = (xBC.shape[-1] - d_inner) // (2 * ngroups)
    x, B, C = torch.split(xBC, [d_inner, ngroups * dstate, ngroups * dstate], -1)
    bl = x.shape[:2]
    x, B, C = x.reshape(*bl, nheads, headdim), B.reshape(*bl, ngroups, dstate), C.reshape(*bl, ngroups, dstate)
    dt = F.softplus(dt + t["dt_bias"]).clamp(*dt_limit)
    y, final = ref.ssd_recurrent_ref(x, dt, t["A"], B, C, extra["initial_states"])
    D = t["D"] if t["D"].dim() == 2 else t["D"][:, None]
    y = (y + x * D).reshape(*bl, d_inner)
    out = ref.gated_rmsnorm_ref(y, z, extra["rmsnorm_weight"], 1e-6, d_inner // ngroups, norm_before_gate)
    return out, final


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("D2", [False, True])
def test_single_device_ref_matches_recurrence(norm_before_gate, D2):
    t, extra, kw = core_inputs(D2=D2)
    dt_limit = (0.05, 2.0)
    out, final = mamba_split_conv1d_scan_ref(
        *t.values(), 8, **kw, **extra, return_final_states=True, norm_before_gate=norm_before_gate, dt_limit=dt_limit
    )
    out_rec, final_rec = core_by_recurrence(t, extra, kw["headdim"], kw["ngroups"], norm_before_gate, dt_limit)
    assert rel_err(out, out_rec) < TOL
    assert rel_err(final, final_rec) < TOL


def test_segment_contract_matches_single_device_op():
    """segment_fwd/segment_bwd with a local exchange = the single-device op, values and grads."""
    t, extra, kw = core_inputs(seqlen=19)
    spec = CoreSpec.infer(t["zxbcdt"], t["conv1d_weight"], t["D"], 8, **kw)
    params = [t[k] for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")] + [extra["rmsnorm_weight"]]
    dout = torch.randn(2, 19, spec.d_inner, dtype=F64)
    dfinal = torch.randn_like(extra["initial_states"])

    leaves = [t["zxbcdt"]] + params + [extra["initial_states"]]
    leaves = [v.clone().requires_grad_() for v in leaves]
    out, final = mamba_split_conv1d_scan_ref(
        *leaves[:6], 8, **kw, rmsnorm_weight=leaves[6], initial_states=leaves[7], return_final_states=True
    )
    torch.autograd.backward([out, final], [dout, dfinal])

    ex = LocalExchange(extra["initial_states"], dfinal)
    seg_out, _ = drive_fwd(ref.segment_fwd(t["zxbcdt"], None, params, spec=spec), ex.post)
    assert rel_err(seg_out, out) < TOL and rel_err(ex.final_states, final) < TOL
    S_in = extra["initial_states"]
    grads, dhalo = drive_bwd(ref.segment_bwd(dout, t["zxbcdt"], None, params, S_in, spec=spec), ex.post_grad)
    assert dhalo is None
    ours = list(grads) + [ex.dinitial_states]
    for mine, leaf in zip(ours, leaves):
        assert rel_err(mine, leaf.grad) < TOL


def test_scans_match_direct_sums_and_are_adjoint():
    g = torch.Generator().manual_seed(3)
    nseg, shape = 5, (2, 3, 4, 2)
    S_ext = torch.randn(nseg, *shape, generator=g, dtype=F64)
    log_a = -torch.rand(nseg, 2, 3, generator=g, dtype=F64)
    init = torch.randn(*shape, generator=g, dtype=F64)
    S_in, final = scan.exclusive_scan(S_ext, log_a, init)
    a = torch.exp(log_a)[..., None, None]
    for r in range(nseg):
        direct = init * a[:r].prod(0) if r else init.clone()
        for j in range(r):
            direct = direct + a[j + 1 : r].prod(0) * S_ext[j] if j + 1 < r else direct + S_ext[j]
        assert rel_err(S_in[r], direct) < TOL
    assert rel_err(final, a[-1] * S_in[-1] + S_ext[-1]) < TOL
    # reverse_scan is the adjoint of exclusive_scan: check against autograd through it
    S_ext_, init_ = S_ext.clone().requires_grad_(), init.clone().requires_grad_()
    G, Gf = torch.randn_like(S_in), torch.randn_like(final)
    S_in_, final_ = scan.exclusive_scan(S_ext_, log_a, init_)
    torch.autograd.backward([S_in_, final_], [G, Gf])
    dS_out, dinit = scan.reverse_scan(G, log_a, Gf)
    assert rel_err(dS_out, S_ext_.grad) < TOL  # dS_out(s) is exactly dLoss/dS_ext(s)
    assert rel_err(dinit, init_.grad) < TOL


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_layout", ["contiguous", "zigzag"])
def test_layout_round_trips(cp, seq_layout):
    x = torch.arange(2 * 24 * cp * 3).reshape(2, 24 * cp, 3)
    shards = [layout.shard_sequence(x, r, cp, seq_layout) for r in range(cp)]
    assert torch.equal(layout.unshard_sequence(shards, seq_layout), x)
    nloc = len(layout.segment_ids(0, cp, seq_layout))
    assert torch.equal(layout.unpack_segments(layout.pack_segments(shards[0], nloc), nloc), shards[0])
    # gathered_order puts (rank, local segment) rows in causal order
    rows = [s for r in range(cp) for s in layout.segment_ids(r, cp, seq_layout)]
    assert [rows[i] for i in layout.gathered_order(cp, seq_layout)] == list(range(layout.num_segments(cp, seq_layout)))
    if seq_layout == "zigzag":
        n = x.shape[1] // (2 * cp)
        assert torch.equal(shards[0][:, :n], x[:, :n]) and torch.equal(shards[0][:, n:], x[:, -n:])


def test_uneven_split_is_refused_with_the_rule():
    with pytest.raises(ValueError, match="multiple of 4"):
        layout.shard_sequence(torch.zeros(1, 10, 2), 0, 2, "zigzag")


def test_group_of_one_is_the_single_device_op_bitwise():
    t, extra, kw = core_inputs()
    a = mamba_split_conv1d_scan_sp(*t.values(), 8, **kw, **extra, return_final_states=True)
    b = mamba_split_conv1d_scan_ref(*t.values(), 8, **kw, **extra, return_final_states=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_unsupported_arguments_raise():
    t, extra, kw = core_inputs()
    args = (*t.values(), 8)
    with pytest.raises(ValueError, match="seq_idx must hold integer"):
        mamba_split_conv1d_scan_sp(*args, **kw, seq_idx=torch.zeros(2, 23))
    with pytest.raises(ValueError, match="seq_idx must have shape"):
        mamba_split_conv1d_scan_sp(*args, **kw, seq_idx=torch.zeros(2, 22, dtype=torch.int32))
    with pytest.raises(ValueError, match="batch 1"):
        mamba_split_conv1d_scan_sp(*args, **kw, cu_seqlens=torch.tensor([0, 10, 23]))
    with pytest.raises(ValueError, match="decreases inside"):
        mamba_split_conv1d_scan_sp(*args, **kw, seq_idx=torch.tensor([[0] * 12 + [1] * 11, [1] * 12 + [0] * 11]))
    with pytest.raises(ValueError, match="load_balancing must be one of"):
        mamba_split_conv1d_scan_sp(*args, **kw, load_balancing="zigzag")
    with pytest.raises(NotImplementedError, match="d_nonssm"):
        z = t["zxbcdt"]
        mamba_split_conv1d_scan_sp(torch.cat([z, z[..., :8]], -1), *args[1:], **kw)
    with pytest.raises(ValueError, match="expected 2\\*d_inner"):
        mamba_split_conv1d_scan_sp(t["zxbcdt"][..., :-1], *args[1:], **kw)
    with pytest.raises(ValueError, match="initial_states must have shape"):
        mamba_split_conv1d_scan_sp(*args, **kw, initial_states=extra["initial_states"][:1])
    with pytest.raises(ValueError, match="multiple of ngroups"):
        mamba_split_conv1d_scan_sp(*args, headdim=3, ngroups=3)


def test_backend_choice_and_fallback_warning(monkeypatch):
    import sys

    from ds_mamba_spcp import ops

    assert ops.get_backend("auto", torch.device("cpu")) is ref
    assert ops.get_backend("reference", torch.device("cuda")) is ref
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.get_backend("cuda", torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "ds_mamba_spcp.ops.triton", None)  # the Triton backend fails to import
    monkeypatch.setattr(ops, "_warned", False)
    with pytest.warns(RuntimeWarning, match="slow plain-PyTorch reference"):
        assert ops.get_backend("auto", torch.device("cuda")) is ref
    with pytest.raises(ImportError, match="needs mamba-ssm and causal-conv1d"):
        ops.get_backend("triton", torch.device("cuda"))
