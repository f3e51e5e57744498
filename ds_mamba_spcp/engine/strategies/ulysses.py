"""The all-to-all strategy of the table's "ulysses" entry (``modes.py``): DeepSpeed-Ulysses applied to heads.

    zxbcdt [b, L/cp, z|x|B|C|dt of every head] --all-to-all--> [b, L, z|x|B|C|dt of nheads/cp heads]
    conv1d + SSD scan + gate (+ norm) over the full sequence: the backend's single-device op
    y [b, L, d_inner/cp] --all-to-all--> [b, L/cp, d_inner]

Forward and backward each run two all-to-alls (plus one small collective for final_states / initial_states
when used). The first send buffer is (cp, batch, local_seqlen, width), the destination rank on dim 0 and each
slot's channels already in the order z, x, B, C, dt of a zxbcdt with nheads/cp heads and ngroups/cp groups
(or the one group a rank's heads read when cp > ngroups): what arrives is a valid zxbcdt once its pieces are in
causal order (a view for contiguous input with batch 1, else one copy). The way back mirrors it.

Parameters are replicated: each rank slices its heads' rows under autograd, so their gradients arrive
full-size with the rank's rows filled; the sum over the group is the full gradient. With cp > ngroups a norm
group spans ranks: the op returns y * silu(z) and the gated RMSNorm runs after the second all-to-all
(norm_before_gate=True is then rejected: y alone never leaves the op).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import layout, modes
from ds_mamba_spcp.engine.strategies import group_of_one
from ds_mamba_spcp.ops.autograd import first_order_only
from ds_mamba_spcp.ops.spec import CoreSpec

# -- how channels and sequence pieces are laid out in the all-to-all buffers ------------------


@dataclass(frozen=True)
class _Piece:
    """A run of channels split over the ranks: slice j // nrep of ``width // local`` slices goes to rank j."""

    offset: int  # first channel in the full tensor
    width: int  # channels in the full tensor
    local: int  # channels each rank receives
    nrep: int = 1  # consecutive ranks that receive the same slice (B and C when cp > ngroups)


@dataclass(frozen=True)
class _Sharding:
    """Channels of the full tensor <-> per-rank slots (pieces concatenated in order)."""

    pieces: tuple

    @property
    def local_width(self) -> int:
        return sum(p.local for p in self.pieces)

    @property
    def full_width(self) -> int:
        return sum(p.width for p in self.pieces)

    def split(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """t (b, l, full_width) -> out (cp, b, l, local_width): out[j] is rank j's channels."""
        cp, start = out.shape[0], 0
        for p in self.pieces:
            src = t[..., p.offset : p.offset + p.width].unflatten(-1, (p.width // p.local, p.local))
            if p.nrep > 1:  # [b, l, g, n] -> [b, l, g*nrep, n]: a group for each of its ranks
                src = src.unsqueeze(-2).expand(*src.shape[:-1], p.nrep, p.local).flatten(-3, -2)
            assert src.shape[-2] == cp
            out[..., start : start + p.local].copy_(src.movedim(-2, 0))  # [b, l, cp, n] -> [cp, b, l, n]
            start += p.local

    def join(self, t: torch.Tensor) -> torch.Tensor:
        """t (cp, b, l, local_width) -> (b, l, full_width); replicated slices are summed (gradients)."""
        cp, b, l, _ = t.shape
        out = t.new_empty(b, l, self.full_width)
        start = 0
        for p in self.pieces:
            src = t[..., start : start + p.local]
            if p.nrep > 1:  # [cp, b, l, n] -> [g, b, l, n], summed over the ranks sharing a group
                src = src.unflatten(0, (cp // p.nrep, p.nrep)).sum(1, dtype=torch.promote_types(t.dtype, torch.float32))
            dst = out[..., p.offset : p.offset + p.width].unflatten(-1, (p.width // p.local, p.local))
            dst.copy_(src.movedim(0, -2))  # [g, b, l, n] -> [b, l, g, n]
            start += p.local
        return out


def _split_seq(t: torch.Tensor, out: torch.Tensor, seq_layout: str) -> None:
    """t (b, L, c) full-length -> out (cp, b, L/cp, c): out[j] is rank j's shard in ``seq_layout``."""
    cp, b, lloc, c = out.shape
    if seq_layout == "contiguous":
        out.copy_(t.unflatten(1, (cp, lloc)).transpose(0, 1))
        return
    m = lloc // 2
    chunks = t.unflatten(1, (2 * cp, m))  # [b, 2cp, m, c]
    halves = out.unflatten(2, (2, m))  # [cp, b, 2, m, c]
    halves[:, :, 0].copy_(chunks[:, :cp].transpose(0, 1))  # rank j's first chunk is chunk j
    for j in range(cp):  # and its second chunk is 2cp-1-j (no negative strides: one copy each)
        halves[j, :, 1].copy_(chunks[:, 2 * cp - 1 - j])


def _join_seq(t: torch.Tensor, seq_layout: str) -> torch.Tensor:
    """t (cp, b, L/cp, c), rank j's shard at t[j] -> (b, L, c) contiguous in causal order."""
    cp, b, lloc, c = t.shape
    if seq_layout == "contiguous":
        return t.transpose(0, 1).reshape(b, cp * lloc, c)  # a view when b == 1
    m = lloc // 2
    halves = t.unflatten(2, (2, m))  # [cp, b, 2, m, c]
    out = t.new_empty(b, cp * lloc, c)
    chunks = out.unflatten(1, (2 * cp, m))
    chunks[:, :cp].copy_(halves[:, :, 0].transpose(0, 1))
    for j in range(cp):
        chunks[:, 2 * cp - 1 - j].copy_(halves[j, :, 1])
    return out


@dataclass(frozen=True)
class _Plan:
    group: object
    rank: int
    cp: int
    seq_layout: str

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        comm.all_to_all_single(recv, send, self.group)
        return recv


def _seq_to_heads(t: torch.Tensor, sharding: _Sharding, plan: _Plan) -> torch.Tensor:
    # [b, L/cp, full channels] -> [b, L, this rank's channels]
    b, lloc, _ = t.shape
    send = t.new_empty(plan.cp, b, lloc, sharding.local_width)
    sharding.split(t, send)
    return _join_seq(plan.all_to_all(send), plan.seq_layout)


def _heads_to_seq(t: torch.Tensor, sharding: _Sharding, plan: _Plan) -> torch.Tensor:
    # [b, L, this rank's channels] -> [b, L/cp, full channels]
    b, seqlen, c = t.shape
    if plan.seq_layout == "contiguous" and b == 1 and t.is_contiguous():
        send = t.view(plan.cp, b, seqlen // plan.cp, c)  # rank j's rows are already block j: no copy
    else:
        send = t.new_empty(plan.cp, b, seqlen // plan.cp, c)
        _split_seq(t, send, plan.seq_layout)
    return sharding.join(plan.all_to_all(send))


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sharding, plan):
        ctx.sharding, ctx.plan = sharding, plan
        return _seq_to_heads(t, sharding, plan)

    @staticmethod
    def backward(ctx, dout):  # the adjoint re-sharding, itself differentiable (both are linear)
        return _HeadsToSeq.apply(dout, ctx.sharding, ctx.plan), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, sharding, plan):
        ctx.sharding, ctx.plan = sharding, plan
        return _heads_to_seq(t, sharding, plan)

    @staticmethod
    def backward(ctx, dout):
        return _SeqToHeads.apply(dout, ctx.sharding, ctx.plan), None, None


class _GatherHeads(torch.autograd.Function):
    """final_states: this rank's heads (b, h/cp, p, n) -> every head (b, h, p, n) on every rank. Backward: each
    rank's heads get the sum over ranks of their rows' gradients (one all-to-all, summed in a fixed order)."""

    @staticmethod
    def forward(ctx, t, plan):
        ctx.plan = plan
        rows = comm.all_gather(t, plan.group, plan.cp, async_op=False).wait()  # [cp, b, h/cp, p, n]
        return rows.movedim(0, 1).flatten(1, 2)

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        plan = ctx.plan
        send = dout.unflatten(1, (plan.cp, -1)).movedim(1, 0).contiguous()  # [b, h, ..] -> [cp, b, h/cp, ..]
        return plan.all_to_all(send).sum(0), None


class _SliceHeads(torch.autograd.Function):
    """initial_states: every head (b, h, p, n) -> this rank's heads (b, h/cp, p, n).

    Backward: the whole gradient on group rank 0 (zeros elsewhere), as the state-passing op does."""

    @staticmethod
    def forward(ctx, t, plan):
        ctx.plan, ctx.shape = plan, t.shape
        h = t.shape[1] // plan.cp
        return t[:, plan.rank * h : (plan.rank + 1) * h].contiguous()

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        plan = ctx.plan
        rows = comm.all_gather(dout, plan.group, plan.cp, async_op=False).wait()  # [cp, b, h/cp, p, n]
        if plan.rank != 0:
            return dout.new_zeros(ctx.shape), None
        return rows.movedim(0, 1).flatten(1, 2), None


def _group_rmsnorm(y: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> torch.Tensor:
    """RMSNorm over groups of ``group_size`` channels of an already gated y, in fp32 at least."""
    cdtype = torch.promote_types(y.dtype, torch.float32)
    yg = y.to(cdtype).unflatten(-1, (-1, group_size))
    yg = yg * torch.rsqrt(yg.square().mean(dim=-1, keepdim=True) + eps)
    return (yg.flatten(-2) * weight.to(cdtype)).to(y.dtype)


# -- the strategy (the public op is ``op.mamba_split_conv1d_scan_ulysses``) -------------------


def _shardings(spec: CoreSpec, h_loc: int, g_loc: int, nrep: int):
    p, gn = spec.headdim, spec.ngroups * spec.dstate
    di = spec.d_inner
    zxbcdt = _Sharding((
        _Piece(0, di, h_loc * p),  # z
        _Piece(di, di, h_loc * p),  # x
        _Piece(2 * di, gn, g_loc * spec.dstate, nrep),  # B
        _Piece(2 * di + gn, gn, g_loc * spec.dstate, nrep),  # C
        _Piece(2 * di + 2 * gn, spec.nheads, h_loc),  # dt
    ))  # fmt: skip
    y = _Sharding((_Piece(0, di, h_loc * p),))
    return zxbcdt, y


def _full_row_labels(seq_idx, plan: _Plan):
    """Every rank's shard of the labels -> the whole rows in causal order (the scan renumbers them)."""
    shards = comm.all_gather(seq_idx, plan.group, plan.cp, async_op=False).wait()  # [cp, b, L/cp]
    return layout.unshard_sequence(list(shards.unbind(0)), plan.seq_layout)


def run(call):
    """The all-to-all strategy on a prepared ``MixerCall`` (cp > 1; its sizes checked by the table of modes)."""
    return _run(call, forward_only=False)


def run_forward_only(call):
    """The forward-only route: the same two all-to-alls as plain functions, the full-length scan by
    ``group_of_one.run_forward_only``, under no_grad. With return_final_states: the state after each document,
    every head gathered on every rank ((batch, ...) without seq_idx, (ndocs, ...) with it)."""
    with torch.no_grad():
        return _run(call, forward_only=True)


def _run(call, forward_only: bool):
    spec, o = call.spec, call.options
    rank, cp = call.rank, call.cp
    h_loc, g_loc, nrep = modes.ulysses_heads(spec.nheads, spec.ngroups, cp)
    norm_after = call.rmsnorm_weight is not None and nrep > 1
    if norm_after and spec.norm_before_gate:
        raise ValueError(
            f"the ulysses mode with rmsnorm and ngroups={spec.ngroups} < sequence-parallel size {cp} needs "
            "norm_before_gate=False: a norm group then spans ranks and is normalised after the all-to-all, "
            "where only the gated y * silu(z) is available"
        )
    plan = _Plan(call.group, rank, cp, o.input_layout)
    shard_zxbcdt, shard_y = _shardings(spec, h_loc, g_loc, nrep)

    # this rank's heads: rows of the replicated parameters, sliced under autograd
    h0, h1 = rank * h_loc, (rank + 1) * h_loc
    g0 = rank * g_loc if nrep == 1 else rank // nrep
    n, di, gn = spec.dstate, spec.d_inner, spec.ngroups * spec.dstate
    conv_rows = [(h0 * spec.headdim, h1 * spec.headdim), (di + g0 * n, di + (g0 + g_loc) * n)]
    conv_rows.append((di + gn + g0 * n, di + gn + (g0 + g_loc) * n))

    def rows(t):
        return None if t is None else torch.cat([t[a:b] for a, b in conv_rows])

    local_rmsnorm_weight = None
    if call.rmsnorm_weight is not None and not norm_after:
        local_rmsnorm_weight = call.rmsnorm_weight[h0 * spec.headdim : h1 * spec.headdim]
    local_initial_states = call.initial_states
    if local_initial_states is not None:
        local_initial_states = (local_initial_states[:, h0:h1].contiguous() if forward_only
                                else _SliceHeads.apply(local_initial_states, plan))  # fmt: skip
    labels = None if call.seq_idx is None else _full_row_labels(call.seq_idx, plan)

    to_heads = _seq_to_heads if forward_only else _SeqToHeads.apply
    zxbcdt_loc = to_heads(call.zxbcdt, shard_zxbcdt, plan)  # [b, L/cp, d_in_proj] -> [b, L, d_in_proj/cp]
    local = call.replace(
        zxbcdt=zxbcdt_loc, conv1d_weight=rows(call.conv1d_weight), conv1d_bias=rows(call.conv1d_bias),
        dt_bias=call.dt_bias[h0:h1], A=call.A[h0:h1], D=call.D[h0:h1], rmsnorm_weight=local_rmsnorm_weight,
        initial_states=local_initial_states, seq_idx=labels,
        spec=dataclasses.replace(spec, nheads=h_loc, ngroups=g_loc),
    )  # fmt: skip
    scan = group_of_one.run_forward_only if forward_only else group_of_one.run
    res = scan(local.replace(cp=1, rank=0, group=None))  # the full-length scan, in tiles if need be
    y_loc, final_loc = res if o.return_final_states else (res, None)
    out = (_heads_to_seq if forward_only else _HeadsToSeq.apply)(
        y_loc, shard_y, plan
    )  # [b, L, d_inner/cp] -> [b, L/cp, d_inner]
    if norm_after:
        out = _group_rmsnorm(out, call.rmsnorm_weight, spec.rmsnorm_eps, di // spec.ngroups)
    if not o.return_final_states:
        return out
    if forward_only:  # (rows or documents, h/cp, p, n) of every rank -> every head
        return out, comm.all_gather(final_loc, plan.group, plan.cp, async_op=False).wait().movedim(0, 1).flatten(1, 2)
    return out, _GatherHeads.apply(final_loc, plan)
