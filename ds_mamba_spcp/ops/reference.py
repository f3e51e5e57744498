"""Plain-PyTorch reference backend for the Mamba2 mixer core.

Differentiable by autograd, any device, fp64 and fp32: the CPU path of the op and the ground truth of the
tests. ``segment_fwd`` / ``segment_bwd`` state the contract the Triton backend implements too.

Pipeline of one causal segment (a rank's shard, or half of it under ``virtual``):

    xBC --(halo + causal depthwise conv + SiLU)--> x, B, C
    dt  --(+ dt_bias, softplus, clamp)-->          dt
    chunked SSD from a zero state -> y0, S_ext;  log_a = sum_t dt_t * A
    S_in arrives (exchange) -> y = y0 + C_t exp(cumsum(dt*A)_t) S_in;  S_out = a*S_in + S_ext
    y += D*x;  out = y*silu(z) or gated RMSNorm

Shapes follow mamba-ssm: x (batch, seqlen, nheads, headdim), dt (batch, seqlen, nheads),
B and C (batch, seqlen, ngroups, dstate), states (batch, nheads, headdim, dstate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat

from ds_mamba_spcp.ops.segment import canonical_seq_idx
from ds_mamba_spcp.ops.spec import CoreSpec, split_zxbcdt

NAME = "reference"

# -- conv -------------------------------------------------------------------------------------


def causal_conv1d_ref(x, weight, bias=None, initial_states=None, activation="silu", seq_idx=None):
    """Causal depthwise conv1d over time, optionally continuing from a previous segment.

    x: (batch, seqlen, dim); weight: (dim, width); bias: (dim,) or None; initial_states: (batch, width-1, dim),
    the last width-1 *pre-conv* rows of the previous segment (zeros when None). seq_idx: (batch, seqlen) int
    document ids or None: an output reads only its own document's inputs, as causal-conv1d 1.7 does (the
    initial_states rows belong to the row's first document; a negative id is padding, output 0). Computed in
    the wider of x's and weight's dtypes; returns (batch, seqlen, dim) in x's dtype.
    """
    batch, seqlen, dim = x.shape
    width = weight.shape[-1]
    cdtype = torch.promote_types(x.dtype, weight.dtype)
    if initial_states is None:
        initial_states = x.new_zeros(batch, width - 1, dim)
    xpad = torch.cat([initial_states.to(cdtype), x.to(cdtype)], dim=1)  # [b, K-1+L, d]
    weight = weight.to(cdtype)
    bias = None if bias is None else bias.to(cdtype)
    if seq_idx is None:
        out = F.conv1d(xpad.transpose(1, 2), weight.unsqueeze(1), bias, groups=dim).transpose(1, 2)
    else:
        ids = seq_idx.long()
        ids_pad = torch.cat([ids[:, :1].expand(batch, width - 1), ids], dim=1)  # halo rows: the first document
        windows = xpad.unfold(1, width, 1)  # [b, L, d, K]: windows[:, t, :, k] = xpad[:, t + k]
        same = ids_pad.unfold(1, width, 1) == ids[:, :, None]  # [b, L, K]
        out = (windows * same[:, :, None, :].to(cdtype) * weight).sum(-1)
        if bias is not None:
            out = out + bias
        out = torch.where((ids >= 0)[..., None], out, torch.zeros((), dtype=cdtype))
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise NotImplementedError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return out.to(x.dtype)


# -- dt ---------------------------------------------------------------------------------------


def process_dt(dt, dt_bias=None, dt_limit=(0.0, float("inf"))):
    """softplus(dt + dt_bias) clamped to dt_limit, in fp32 at least (as mamba-ssm does)."""
    dt = dt.to(torch.promote_types(dt.dtype, torch.float32))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


# -- SSD --------------------------------------------------------------------------------------


def _heads_from_groups(t, nheads):
    """(b, l, g, n) -> (b, l, h, n): head i reads group i // (nheads // ngroups)."""
    return repeat(t, "b l g n -> b l (g r) n", r=nheads // t.shape[2])


def ssd_chunked_ref(x, dt, A, B, C, chunk_size, initial_states=None, seq_idx=None):
    """Chunked SSD scan (no D, no z). dt is already processed (softplus, bias, clamp).

    Any seqlen (the tail padded with dt = 0). seq_idx: (batch, seqlen) canonical labels or None: the state
    restarts at every document start and initial_states reaches the tokens labelled 0 only.
    Returns y (batch, seqlen, nheads, headdim) in x's dtype and final_states (batch, nheads, headdim, dstate)
    in the compute dtype (fp32 or fp64), the state after the last token.
    """
    batch, seqlen, nheads, headdim = x.shape
    cdtype = torch.promote_types(x.dtype, torch.float32)
    pad = (-seqlen) % chunk_size
    xs, dts = x.to(cdtype), dt.to(cdtype)
    Bh = _heads_from_groups(B, nheads).to(cdtype)
    Ch = _heads_from_groups(C, nheads).to(cdtype)
    ids = None if seq_idx is None else seq_idx.long()
    if pad:
        xs, Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xs, Bh, Ch))
        dts = F.pad(dts, (0, 0, 0, pad))
        if ids is not None:  # the padding continues the last document: no spurious boundary
            ids = torch.cat([ids, ids[:, -1:].expand(batch, pad)], dim=1)
    # [b, c*T, ...] -> [b, c, T, ...]
    xs, Bh, Ch = (rearrange(t, "b (c t) h n -> b c t h n", t=chunk_size) for t in (xs, Bh, Ch))
    dts = rearrange(dts, "b (c t) h -> b c t h", t=chunk_size)
    dA_cs = torch.cumsum(dts * A.to(cdtype), dim=2)  # [b, c, T, h]
    nchunks = xs.shape[1]
    if ids is not None:
        ids = rearrange(ids, "b (c t) -> b c t", t=chunk_size)
        ids_end = ids[:, :, -1]  # [b, c]: the document a chunk's state belongs to
        ids_prev = torch.cat([torch.zeros_like(ids_end[:, :1]), ids_end[:, :-1]], dim=1)  # entering each chunk

    # intra-chunk: y_t = sum_{s<=t, same document} (C_t . B_s) exp(cs_t - cs_s) dt_s x_s
    diff = dA_cs.unsqueeze(3) - dA_cs.unsqueeze(2)  # [b, c, t, s, h]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()[None, None, :, :, None]
    if ids is not None:
        causal = causal & (ids[:, :, :, None] == ids[:, :, None, :])[..., None]
    decay = torch.exp(torch.where(causal, diff, float("-inf")))
    CB = torch.einsum("bcthn,bcshn->bctsh", Ch, Bh)
    y = torch.einsum("bctsh,bcsh,bcshp->bcthp", CB * decay, dts, xs)

    # per-chunk states from zero: sum_s exp(cs_T - cs_s) dt_s x_s B_s^T over the chunk's last document
    decay_to_end = torch.exp(dA_cs[:, :, -1:, :] - dA_cs)  # [b, c, T, h]
    if ids is not None:
        decay_to_end = decay_to_end * (ids == ids_end[:, :, None])[..., None].to(cdtype)
    chunk_states = torch.einsum("bcsh,bcshp,bcshn->bchpn", decay_to_end * dts, xs, Bh)

    # inter-chunk recurrence; the state entering a chunk reaches its rows (of that document) through C
    state = (
        initial_states.to(cdtype)
        if initial_states is not None
        else x.new_zeros(batch, nheads, headdim, Bh.shape[-1], dtype=cdtype)
    )
    chunk_decay = torch.exp(dA_cs[:, :, -1, :])  # [b, c, h]
    if ids is not None:
        chunk_decay = chunk_decay * (ids_end == ids_prev)[..., None].to(cdtype)
    entering = []
    for c in range(nchunks):
        entering.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n]
    reach = torch.exp(dA_cs)
    if ids is not None:
        reach = reach * (ids == ids_prev[:, :, None])[..., None].to(cdtype)
    y = y + torch.einsum("bcthn,bchpn,bcth->bcthp", Ch, entering, reach)
    y = rearrange(y, "b c t h p -> b (c t) h p")[:, :seqlen]
    return y.to(x.dtype), state


def apply_incoming_state(y0, C, dt, A, S_in, seq_idx=None):
    """Adds what an incoming state contributes to a segment computed from a zero state.

    y0: (batch, seqlen, nheads, headdim); C: (batch, seqlen, ngroups, dstate);
    dt: processed (batch, seqlen, nheads); S_in: (batch, nheads, headdim, dstate); seq_idx:
    canonical labels or None (the state reaches the tokens labelled 0 only).
    y_t += exp(sum_{s<=t} dt_s A) C_t S_in   (y0 was computed with S_in = 0: affine in S_in).
    """
    cdtype = torch.promote_types(y0.dtype, torch.float32)
    nheads = y0.shape[2]
    decay = torch.exp(torch.cumsum(dt.to(cdtype) * A.to(cdtype), dim=1))  # [b, l, h]
    if seq_idx is not None:
        decay = decay * (seq_idx == 0)[..., None].to(cdtype)
    Ch = _heads_from_groups(C, nheads).to(cdtype)
    corr = torch.einsum("blhn,bhpn,blh->blhp", Ch, S_in.to(cdtype), decay)
    return (y0.to(cdtype) + corr).to(y0.dtype)


def gated_rmsnorm_ref(y, z, weight, eps=1e-6, group_size=None, norm_before_gate=False):
    """Gated RMSNorm as in mamba-ssm's layernorm_gated, normalising groups of group_size channels.

    norm_before_gate: rmsnorm(y) * silu(z); else rmsnorm(y * silu(z)).
    """
    dtype = y.dtype
    cdtype = torch.promote_types(dtype, torch.float32)
    y, z = y.to(cdtype), z.to(cdtype)
    if not norm_before_gate:
        y = y * F.silu(z)
    group_size = group_size or y.shape[-1]
    yg = rearrange(y, "... (g d) -> ... g d", d=group_size)
    yg = yg * torch.rsqrt(yg.square().mean(dim=-1, keepdim=True) + eps)
    out = rearrange(yg, "... g d -> ... (g d)") * weight.to(cdtype)
    if norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


# -- the segment contract shared with the Triton backend --------------------------------------


def _segment_pre(zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, spec: CoreSpec, seq_idx=None):
    z, xBC, dt_raw = split_zxbcdt(zxbcdt, spec)
    xBC = causal_conv1d_ref(xBC, conv1d_weight, conv1d_bias, halo, spec.activation, seq_idx)
    x, B, C = torch.split(xBC, [spec.d_inner, spec.ngroups * spec.dstate, spec.ngroups * spec.dstate], -1)
    x = rearrange(x, "b l (h p) -> b l h p", p=spec.headdim)
    B = rearrange(B, "b l (g n) -> b l g n", g=spec.ngroups)
    C = rearrange(C, "b l (g n) -> b l g n", g=spec.ngroups)
    dt = process_dt(dt_raw, dt_bias, spec.dt_limit)
    y0, S_ext = ssd_chunked_ref(x, dt, A, B, C, spec.chunk_size, seq_idx=seq_idx)
    log_a = (dt * A.to(dt.dtype)).sum(dim=1)  # [b, h]
    if seq_idx is not None:  # a document starts inside: the incoming state never reaches the end
        log_a = torch.where((seq_idx[:, -1] != 0)[:, None], float("-inf"), log_a)
    return z, x, B, C, dt, y0, S_ext, log_a


def _segment_post(z, x, C, dt, y0, A, D, rmsnorm_weight, S_in, spec: CoreSpec, seq_idx=None):
    y = apply_incoming_state(y0, C, dt, A, S_in, seq_idx)
    Dh = D if D.dim() == 2 else D.unsqueeze(-1)  # [h] -> [h, 1]
    y = (y.to(torch.promote_types(y.dtype, torch.float32)) + x * Dh.to(x.dtype)).to(x.dtype)
    y = rearrange(y, "b l h p -> b l (h p)")
    if rmsnorm_weight is None:
        return (y * F.silu(z.to(y.dtype))).to(y.dtype)
    return gated_rmsnorm_ref(
        y, z, rmsnorm_weight, spec.rmsnorm_eps, spec.d_inner // spec.ngroups, spec.norm_before_gate
    )


def _ready(halo):
    """The halo argument of segment_fwd: a handle (``wait()``), a tensor, or None."""
    return halo.wait() if hasattr(halo, "wait") else halo


def segment_fwd(zxbcdt, halo, params, *, spec, seq_idx=None, keep_y=False, S_in=None):
    """Forward of one causal segment (batch may hold several segments, see layout.py), a generator.

    zxbcdt: (batch, seqlen, d_in_proj); params: (conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight);
    halo: (batch, d_conv-1, conv_dim) pre-conv xBC rows of the previous segment, or a handle whose ``wait()``
    gives them (None: zeros). seq_idx: (batch, seqlen) canonical labels (``canonical_seq_idx``) or None.
    Protocol (``ops/segment.py``): yields ``(S_ext, log_a)`` (fp32 or wider), the summary from a zero state:
    S_ext its final state, log_a the log of the factor by which its incoming state reaches its end (-inf when
    a document starts inside); is sent a handle whose ``wait()`` gives S_in (it reaches the tokens labelled
    0); returns ``(out (batch, seqlen, d_inner), y)``, y the pre-gate output kept when keep_y (None here: this
    backend recomputes). Known mode (S_in given): nothing yielded, returns ``(out, y, S_out)``,
    S_out = exp(log_a) S_in + S_ext.
    """
    conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight = params
    known = S_in is not None
    with torch.no_grad():
        pre = _segment_pre(zxbcdt, _ready(halo), conv1d_weight, conv1d_bias, dt_bias, A, spec, seq_idx)
    z, x, B, C, dt, y0, S_ext, log_a = pre
    if not known:
        handle = yield S_ext, log_a
        S_in = handle.wait()
    with torch.no_grad():
        out = _segment_post(z, x, C, dt, y0, A, D, rmsnorm_weight, S_in, spec, seq_idx)
        if known:
            return out, None, S_ext + torch.exp(log_a)[:, :, None, None] * S_in.to(S_ext.dtype)
    return out, None


def segment_state(zxbcdt, halo, params, S_in, *, spec, seq_idx=None):
    """The state after one segment, ``S_out = exp(log_a) S_in + S_ext``, differentiable by autograd (the inputs'
    graphs kept): the state path alone, no output. Optional in a backend; a tiled shard's backward pass 2 calls it
    where it exists (memory/tiled_block.py, ``Tiles.state``), else differentiates the whole segment with a zero
    output gradient."""
    conv1d_weight, conv1d_bias, dt_bias, A = params[:4]
    *_, S_ext, log_a = _segment_pre(zxbcdt, _ready(halo), conv1d_weight, conv1d_bias, dt_bias, A, spec, seq_idx)
    return torch.exp(log_a)[:, :, None, None] * S_in.to(S_ext.dtype) + S_ext


def segment_bwd(dout, zxbcdt, halo, params, S_in, *, spec, seq_idx=None, kept=None, dS_out=None):
    """Backward of ``segment_fwd`` by recomputation under autograd, a generator.

    kept: the list holding what segment_fwd kept, or None; a backend pops what it uses (freed early) and
    recomputes what is missing. Protocol: yields L, the gradient reaching S_in when S_out receives none; is
    sent a handle whose ``wait()`` gives dS_out, what later segments send to S_out; yields the halo's gradient
    (batch, d_conv-1, conv_dim) (None without a halo), posted by the caller while the backend finishes;
    returns the gradients of (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight) (None for a
    None input). Known mode (dS_out given): only the halo's gradient is yielded, and the gradient reaching S_in
    (L + exp(log_a) dS_out) is returned after the others.
    """
    known = dS_out is not None
    inputs = [zxbcdt, halo, *params]
    leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    S_in = S_in.detach().requires_grad_()
    with torch.enable_grad():
        z, x, B, C, dt, y0, S_ext, log_a = _segment_pre(*leaves[:6], spec, seq_idx)
        out = _segment_post(z, x, C, dt, y0, leaves[5], leaves[6], leaves[7], S_in, spec, seq_idx)
        S_out = torch.exp(log_a)[:, :, None, None] * S_in + S_ext
    live = [t for t in leaves if t is not None]
    # pass 1: the output's gradient, and L = its part that reaches S_in
    g1 = torch.autograd.grad(out, live + [S_in], dout, retain_graph=True, allow_unused=True)
    L = torch.zeros_like(S_in) if g1[-1] is None else g1[-1]
    if not known:
        handle = yield L
        dS_out = handle.wait()
    # pass 2: what later segments send back through S_out (S_in is a constant here)
    dS_out = dS_out.to(S_out.dtype)
    g2 = torch.autograd.grad(S_out, live, dS_out, allow_unused=True)
    grads, it = [], iter(zip(g1[:-1], g2))
    for t in leaves:
        if t is None:
            grads.append(None)
            continue
        a, b = next(it)
        g = a if b is None else (b if a is None else a + b)
        grads.append(torch.zeros_like(t) if g is None else g)
    yield grads[1]
    if known:
        with torch.no_grad():
            dS_in = L + torch.exp(log_a.detach())[:, :, None, None].to(L.dtype) * dS_out.to(L.dtype)
        return (grads[0], *grads[2:], dS_in)
    return (grads[0], *grads[2:])


# -- the single-device op on the full sequence (ground truth of the distributed tests) --------


def mamba_split_conv1d_scan_ref(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    *,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, float("inf")),
    headdim,
    ngroups,
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    norm_before_gate=False,
    seq_idx=None,
):
    """Single-device mixer core in plain PyTorch, differentiable by autograd end to end.

    Same arguments as ``mamba_split_conv1d_scan_sp`` (minus the group and layout; seq_idx the whole row's).
    Returns out (batch, seqlen, nheads*headdim), and final_states (batch, nheads, headdim, dstate) in fp32
    (fp64 for fp64 input) when return_final_states.
    """
    spec = CoreSpec.infer(
        zxbcdt,
        conv1d_weight,
        D,
        chunk_size,
        headdim=headdim,
        ngroups=ngroups,
        dt_limit=dt_limit,
        activation=activation,
        rmsnorm_eps=rmsnorm_eps,
        norm_before_gate=norm_before_gate,
    )
    ids = None if seq_idx is None else canonical_seq_idx(seq_idx)
    z, x, B, C, dt, y0, S_ext, log_a = _segment_pre(zxbcdt, None, conv1d_weight, conv1d_bias, dt_bias, A, spec, ids)
    if initial_states is None:
        S_in = torch.zeros_like(S_ext)
    else:
        S_in = initial_states.to(S_ext.dtype)
    out = _segment_post(z, x, C, dt, y0, A, D, rmsnorm_weight, S_in, spec, ids)
    if not return_final_states:
        return out
    return out, torch.exp(log_a)[:, :, None, None] * S_in + S_ext


def ssd_recurrent_ref(x, dt, A, B, C, initial_states=None, seq_idx=None):
    """Token-by-token recurrence h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = C_t h_t.

    seq_idx: (batch, seqlen) document labels or None: h restarts from zero wherever the label changes. The
    slow, obviously correct definition the chunked scan and the sharded op are tested against.
    """
    batch, seqlen, nheads, headdim = x.shape
    cdtype = torch.promote_types(x.dtype, torch.float32)
    Bh = _heads_from_groups(B, nheads).to(cdtype)
    Ch = _heads_from_groups(C, nheads).to(cdtype)
    h = (
        initial_states.to(cdtype)
        if initial_states is not None
        else x.new_zeros(batch, nheads, headdim, Bh.shape[-1], dtype=cdtype)
    )
    ys = []
    for t in range(seqlen):
        dtt = dt[:, t].to(cdtype)  # [b, h]
        if seq_idx is not None and t > 0:  # a document starts here: forget the previous one
            h = h * (seq_idx[:, t] == seq_idx[:, t - 1]).to(cdtype)[:, None, None, None]
        h = torch.exp(dtt * A.to(cdtype))[:, :, None, None] * h + torch.einsum(
            "bh,bhp,bhn->bhpn", dtt, x[:, t].to(cdtype), Bh[:, t]
        )
        ys.append(torch.einsum("bhn,bhpn->bhp", Ch[:, t], h))
    return torch.stack(ys, dim=1).to(x.dtype), h


single_device_op = mamba_split_conv1d_scan_ref


def max_tokens_per_call(spec: CoreSpec) -> None:
    """Plain PyTorch indexes with int64: no limit on the tokens of one call (see ops/tiles.py)."""
    return None
