"""The gated delta rule over a sequence-parallel group: state passing (the engine's chains and summary exchange
with the MATRIX summary type) and the head all-to-all baseline (ulysses). See docs/design.md, "The gated delta
rule".

State passing, per call. Each rank holds its causal segments (one, or two zigzag ones packed on the batch axis
under "virtual"); each segment splits at the document starts inside it (packed rows) into pieces, and every
piece of every segment runs in one backend call as one packed row (``cu_seqlens``, batch 1) whose values and
states carry V + K columns:

    v_aug = [v | 0]   initial state [0 | I] for a segment's first piece that continues a document
                                    [S0_d | 0] for a piece that starts document d (S0_d its initial_state or 0)

Columns are independent in the recurrence, so the last piece of a segment ends in [U | M] (U its final state
from zero, M = prod alpha_t (I - beta_t k_t k_t^T), zero when the segment holds a document start: the chain is
cut there), and the outputs are [o_local | P] with P_t = M_{<=t}^T (scale q_t) on a segment's first piece
(zero elsewhere). The exchange (``exchange.py``, kind MATRIX) gives each segment S_in, and

    o_t = o_local_t + S_in^T P_t   (= running the segment again from S_in: the recurrence is affine in the state)

A document's final state is U + M S_in of the piece where it ends, summed over the group (one all-reduce of
(N, H, K, V); each document ends on one rank). The backward is autograd's through the backend and the einsum,
with the exchange's own: dS_out by the reverse scan with M^T, dM = dS_out S_in^T, dU = dS_out per segment.

The head all-to-all gives every rank the whole sequence for H / cp heads (q, k, v, g, beta moved, the output
moved back), runs the backend on it and gathers the final states' heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import exchange, layout, modes, permute, traffic
from ds_mamba_spcp.engine.strategies.state_passing import SegmentPlan
from ds_mamba_spcp.engine.summary import MATRIX


@dataclass(frozen=True)
class DeltaCall:
    """One call of the sharded delta-rule op on this rank, checked alike on every rank (``delta_op.prepare``).
    q, k: (B, L_local, H, K) (grouped heads already repeated to v's); v: (B, L_local, H, V); g, beta: (B, L_local,
    H); initial_state: (N, H, K, V) or None; cu_seqlens: the global row's document offsets (batch 1) or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    initial_state: torch.Tensor | None
    output_final_state: bool
    cu_seqlens: list | None  # Python ints
    use_qk_l2norm_in_kernel: bool
    entry: modes.Entry
    input_layout: str
    summary_exchange: str
    backend: object  # the backend function (ops/delta.py)
    group: object
    rank: int
    cp: int

    def backend_call(self, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
        cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long, device=q.device)
        return self.backend(q, k, v, g, beta, scale=self.scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu,
                            use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel)  # fmt: skip


def state_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


# -- the exchange and the final states as autograd functions ------------------------------------------------


class _ExchangeFn(torch.autograd.Function):
    """(U, M) of this rank's segments, (b*nlocal, H, K, V) and (.., K, K) -> S_in (b*nlocal, H, K, V); and the
    documents' final states (ndocs, H, K, V) summed over the group from this rank's shares, share d = F_off[d] +
    F_lin[d] S_in[rows[d]] (F_lin zero where nothing entered), or None.

    One autograd node holds every collective of the call, so that its backward runs them in one order on every
    rank (ranks' graphs differ with their pieces: two nodes could be reached in different orders)."""

    @staticmethod
    def forward(ctx, U, M, F_off, F_lin, plan, method, rows, docs, ndocs):
        batch = U.shape[0] // plan.nlocal
        if plan.alone:  # the lone segment starts every document: M = 0, nothing enters
            S_in, lins = torch.zeros_like(U), None
        else:
            ex = _make_exchange(plan, batch, method)
            S_in, lins = ex.post(U, M).wait(), ex.log_a_all
        ctx.plan, ctx.method, ctx.batch, ctx.lins, ctx.rows, ctx.docs = plan, method, batch, lins, rows, docs
        ctx.save_for_backward(S_in, F_lin)
        if F_off is None:
            return S_in, None
        shares = torch.zeros(ndocs, *U.shape[1:], dtype=U.dtype, device=U.device)
        if docs:
            values = F_off + F_lin @ S_in[rows]
            shares = shares.index_put((torch.tensor(docs, device=U.device),), values)
        final = shares if plan.cp == 1 else comm.all_reduce_sum(shares, plan.group)
        return S_in, final

    @staticmethod
    def backward(ctx, dS_in, dfinal):
        S_in, F_lin = ctx.saved_tensors
        dF_off = dF_lin = None
        if F_lin is not None:
            # the final states were returned on every rank: the gradients reaching the copies add up
            dfinal = dfinal if ctx.plan.cp == 1 else comm.all_reduce_sum(dfinal, ctx.plan.group)
            mine = dfinal[list(ctx.docs)]  # (ndocs_local, H, K, V)
            dF_off, dF_lin = mine, mine @ S_in[ctx.rows].transpose(-1, -2)
            rows = torch.tensor(ctx.rows, device=S_in.device, dtype=torch.long)
            dS_in = dS_in.index_add(0, rows, F_lin.transpose(-1, -2) @ mine)
        if ctx.plan.alone:
            return torch.zeros_like(S_in), None, dF_off, dF_lin, None, None, None, None, None
        ex = _make_exchange(ctx.plan, ctx.batch, ctx.method, log_a_all=ctx.lins)
        dS_out = ex.post_grad(dS_in).wait()  # the gradient reaching each segment's outgoing state
        dM = dS_out @ S_in.transpose(-1, -2).to(dS_out.dtype)
        return dS_out, dM, dF_off, dF_lin, None, None, None, None, None


def _make_exchange(plan, batch, method, **kwargs):
    if method == exchange.SCAN:
        return exchange.ScanExchange(plan, batch, need_final=False, kind=MATRIX, **kwargs)
    return exchange.AllGatherExchange(plan, batch, kind=MATRIX, **kwargs)


# -- pieces -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    row: int  # packed segment row (batch i, local segment k) -> i*nlocal + k
    start: int  # token offsets inside the segment
    end: int
    doc: int  # index of the document among the call's (N of initial_state / final states)
    starts_doc: bool
    ends_doc: bool


def _pieces(batch: int, plan: SegmentPlan, m: int, cu_seqlens) -> list[_Piece]:
    """Every piece of this rank's segment rows, row-major then causal: a (row, segment) without documents is one
    piece; packed rows (cu_seqlens, batch 1) split at each document start inside a segment."""
    out = []
    for i in range(batch):
        for k, s in enumerate(plan.local_ids):
            row, lo, hi = i * plan.nlocal + k, s * m, (s + 1) * m
            if cu_seqlens is None:
                out.append(_Piece(row, 0, m, i, s == 0, s == plan.cp * plan.nlocal - 1))
                continue
            cu = cu_seqlens
            for d in range(len(cu) - 1):
                a, b = max(cu[d], lo), min(cu[d + 1], hi)
                if a < b:
                    out.append(_Piece(row, a - lo, b - lo, d, cu[d] == a, cu[d + 1] == b))
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(nrows, m, ...) -> (1, nrows*m, ...)."""
    return t.reshape(1, -1, *t.shape[2:])


def _state_passing(call: DeltaCall, plan: SegmentPlan):
    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    batch, H, K, V = v.shape[0], v.shape[2], k.shape[3], v.shape[3]
    rows = [layout.pack_segments(t, plan.nlocal) for t in (q, k, v, g, beta)]  # (b*nlocal, m, ...)
    nrows, m = rows[0].shape[:2]
    pieces = _pieces(batch, plan, m, call.cu_seqlens)
    sdtype = state_dtype(v)
    ndocs = batch if call.cu_seqlens is None else len(call.cu_seqlens) - 1
    # each piece's initial state, V + K columns
    eye = torch.eye(K, dtype=sdtype, device=v.device).expand(H, K, K)
    inits = []
    for p in pieces:
        if p.starts_doc:
            S0 = torch.zeros(H, K, V, dtype=sdtype, device=v.device)
            if call.initial_state is not None:
                S0 = call.initial_state[p.doc].to(sdtype)
            inits.append(torch.cat([S0, torch.zeros_like(eye)], dim=-1))
        else:  # a segment's first piece, continuing the document of the segment before it
            inits.append(torch.cat([torch.zeros(H, K, V, dtype=sdtype, device=v.device), eye], dim=-1))
    init_aug = torch.stack(inits)
    v_aug = torch.cat([rows[2], rows[2].new_zeros(*rows[2].shape[:-1], K)], dim=-1)
    flat = [_flat(t) for t in (rows[0], rows[1], v_aug, rows[3], rows[4])]
    cu_local = [0]
    for p in pieces:
        cu_local.append(p.row * m + p.end)
    assert cu_local[-1] == nrows * m and all(b > a for a, b in zip(cu_local, cu_local[1:]))
    o_aug, final_aug = call.backend_call(*flat, init_aug, True, cu_local)
    o_aug = o_aug.reshape(nrows, m, H, V + K)
    last = {}
    for n, p in enumerate(pieces):
        last[p.row] = n  # the segment row's last piece
    ends = final_aug[[last[r] for r in range(nrows)]]  # (nrows, H, K, V + K)
    U, M = ends[..., :V], ends[..., V:]
    F_off = F_lin = None
    ending = [n for n, p in enumerate(pieces) if p.ends_doc]  # where this rank's documents end
    if call.output_final_state:
        # a piece's M block is zero unless it is its segment's first and continues a document: one formula
        F_off, F_lin = final_aug[ending, ..., :V], final_aug[ending, ..., V:]
    rows_of = [pieces[n].row for n in ending]
    docs = [pieces[n].doc for n in ending]
    S_in, final = _ExchangeFn.apply(U, M, F_off, F_lin, plan, call.summary_exchange, rows_of, docs, ndocs)
    P = o_aug[..., V:]
    o = o_aug[..., :V] + torch.einsum("rmhk,rhkv->rmhv", P.to(sdtype), S_in).to(o_aug.dtype)
    return layout.unpack_segments(o, plan.nlocal), final


def summary_exchange_of(call_method: str, *, cp: int, batch: int, nheads: int, k_dim: int, v_dim: int,
                        chain: str) -> str:  # fmt: skip
    """The exchange a call runs: its option, "auto" resolved by the cost model with this summary's bytes."""
    if call_method != exchange.AUTO or cp == 1:
        return exchange.ALLGATHER if call_method == exchange.AUTO else call_method
    summary = traffic.delta_summary_bytes(batch=batch, nheads=nheads, k_dim=k_dim, v_dim=v_dim)
    return traffic.choose_summary_exchange(cp=cp, summary=summary, chain=chain)[0]


def _move_all(tensors, group, rank, cp, method, src, dst):
    """Zigzag <-> contiguous for a list of (B, L, ...) tensors, one message per dtype (``permute.py``)."""
    out = list(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = [tensors[i].reshape(*tensors[i].shape[:2], -1) for i in idx]
        moved = permute._permute(torch.cat(flat, dim=-1).contiguous(), group, rank, cp, src, dst, method, 1)
        for i, part in zip(idx, moved.split([f.shape[-1] for f in flat], dim=-1)):
            out[i] = part.reshape(tensors[i].shape)
    return out


class _ManyFn(torch.autograd.Function):
    """A linear move (``fn(tensors, forward)``: a permutation of rows across ranks) of several tensors in one
    autograd node, so that the backward's collectives run in one order on every rank."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn, ctx.like = fn, [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(fn([t.contiguous() for t in tensors], True))

    @staticmethod
    def backward(ctx, *grads):
        grads = [torch.zeros(s, dtype=d, device=dev) if g is None else g.contiguous()
                 for g, (s, d, dev) in zip(grads, ctx.like)]  # fmt: skip
        return (None, *ctx.fn(grads, False))


def _move(tensors, group, method, to_contiguous: bool):
    rank, cp = comm.group_rank_size(group)
    a, b = ("zigzag", "contiguous") if to_contiguous else ("contiguous", "zigzag")

    def fn(ts, forward):
        return _move_all(ts, group, rank, cp, method, a, b) if forward else _move_all(ts, group, rank, cp, method, b, a)

    return list(_ManyFn.apply(fn, *tensors))


def run_state_passing(call: DeltaCall):
    """The state-passing entries of the table of modes: (o in the input layout, final states or None)."""
    entry = call.entry
    if call.cp > 1 and entry.move is not None:
        q, k, v, g, beta = _move([call.q, call.k, call.v, call.g, call.beta], call.group, entry.move, True)
        moved = _replace(call, q=q, k=k, v=v, g=g, beta=beta, entry=modes.TABLE[(modes.STATE_PASSING, modes.NONE)])
        o, final = run_state_passing(moved)
        return _move([o], call.group, entry.move, False)[0], final
    chain = entry.chain if call.cp > 1 else modes.CONTIGUOUS
    plan = SegmentPlan(call.group if call.cp > 1 else None, call.rank, call.cp, chain, async_op=False)
    return _state_passing(call, plan)


def _replace(call, **changes):
    import dataclasses

    return dataclasses.replace(call, **changes)


# -- the head all-to-all (ulysses) ------------------------------------------------------------------------------


def _a2a(x: torch.Tensor, group, cp: int, rank: int, seq_layout: str, to_heads: bool) -> torch.Tensor:
    """(B, L_local, H, ...) sequence shards -> (B, L, H/cp, ...) head shards (to_heads), or back."""
    if to_heads:
        h = x.shape[2] // cp
        send = torch.stack([x[:, :, j * h : (j + 1) * h] for j in range(cp)]).contiguous()
    else:
        send = torch.stack([layout.shard_sequence(x, r, cp, seq_layout) for r in range(cp)]).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_uneven(recv.view(cp, -1), send.view(cp, -1), [1] * cp, [1] * cp, group)
    if to_heads:
        return layout.unshard_sequence(list(recv.unbind(0)), seq_layout)
    return torch.cat(list(recv.unbind(0)), dim=2)


def _a2a_many(tensors, group, cp, rank, seq_layout, to_heads):
    """``_a2a`` of several tensors in one autograd node (its adjoint: the inverse move)."""

    def fn(ts, forward):
        return [_a2a(t, group, cp, rank, seq_layout, to_heads == forward) for t in ts]

    return list(_ManyFn.apply(fn, *tensors))


class _GatherHeadsFn(torch.autograd.Function):
    """(N, H/cp, K, V) per rank -> (N, H, K, V) on every rank; the copies' gradients add up, each rank keeps its
    heads' share."""

    @staticmethod
    def forward(ctx, t, group, cp, rank):
        ctx.group, ctx.rank, ctx.h = group, rank, t.shape[1]
        rows = comm.all_gather(t.contiguous(), group, cp, async_op=False).wait()  # (cp, N, h, K, V)
        return torch.cat(list(rows.unbind(0)), dim=1)

    @staticmethod
    def backward(ctx, grad):
        total = comm.all_reduce_sum(grad, ctx.group)
        return total[:, ctx.rank * ctx.h : (ctx.rank + 1) * ctx.h].contiguous(), None, None, None


def run_ulysses(call: DeltaCall):
    cp, rank, group = call.cp, call.rank, call.group
    q, k, v, g, beta = _a2a_many([call.q, call.k, call.v, call.g, call.beta], group, cp, rank, call.input_layout, True)
    h = v.shape[2]
    init = None if call.initial_state is None else call.initial_state[:, rank * h : (rank + 1) * h]
    o, final = call.backend_call(q, k, v, g, beta, init, call.output_final_state, call.cu_seqlens)
    o = _a2a_many([o], group, cp, rank, call.input_layout, False)[0]
    if final is not None:
        final = _GatherHeadsFn.apply(final, group, cp, rank)
    return o, final
