"""State-passing sequence parallelism for the Mamba2 mixer core: the strategy of the table's state-passing
entries (``modes.py``), whose chain is contiguous (one causal segment per rank) or zigzag (two causal
segments per rank packed on the batch axis). See docs/design.md, "The algebra".

Each rank keeps its shard of the sequence. Forward, per layer:

    post the halo all-gather: the last d_conv-1 pre-conv rows of every segment
    backend: dt processing -> wait for the halo -> conv -> chunk states -> summary (S_ext, log_a)
    post the summary all-gather (fp32)          backend: C.B^T chunk products (need no state)
    wait -> exclusive scan -> S_in               backend: the rest of the scan from S_in, the gate

Backward mirrors it: the backend yields L (the gradient reaching S_in), the L's are all-gathered and a
reverse scan gives each segment the gradient reaching its S_out; the halo gradients go back to their owners,
posted before the backend's last kernels. Nothing that scales with the sequence length is exchanged.

Memory held between forward and backward: zxbcdt, the halo (segments x batch x (d_conv-1) x conv_dim), S_in
(fp32), every segment's decays (segments x batch x nheads), the packed-row masks, and, unless
``recompute_output``, the pre-gate output y (batch x local_seqlen x d_inner), freed after the gate's backward.

Packed rows (docs/design.md, "Packed rows"): each segment runs on canonical labels; the labels of the
previous segment's last d_conv-1 tokens travel with the halo, halo rows of another document are zeroed (their
gradient too), and a segment that begins a document gets log_a = -inf, S_in = 0 and no L.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import documents, exchange, layout, modes, traffic
from ds_mamba_spcp.ops import tiles as tiling
from ds_mamba_spcp.ops.autograd import first_order_only
from ds_mamba_spcp.ops.segment import (
    canonical_seq_idx,
    drive_bwd,
    drive_fwd,
    run_bwd_known,
    run_fwd_known,
    state_dtype,
    zero_state,
)
from ds_mamba_spcp.ops.spec import CoreSpec, split_zxbcdt


@dataclass(frozen=True)
class SegmentPlan:
    """Which causal segments this rank holds and how gathered rows map to causal order."""

    group: object
    rank: int
    cp: int
    layout: str  # "contiguous" or "zigzag"
    async_op: bool = True

    @property
    def nlocal(self) -> int:
        return len(layout.segment_ids(self.rank, self.cp, self.layout))

    @property
    def alone(self) -> bool:
        """The lone segment of a group of one: no predecessor, nothing to exchange or scan."""
        return self.cp == 1 and self.nlocal == 1

    @property
    def local_ids(self) -> list[int]:
        return layout.segment_ids(self.rank, self.cp, self.layout)

    @property
    def order(self) -> list[int]:
        return layout.gathered_order(self.cp, self.layout)

    def gather_ordered(self, t: torch.Tensor):
        """Posts an all-gather of (nlocal, ...) rows; wait() gives (nseg, ...) in causal order."""
        return _Reordered(comm.all_gather(t, self.group, self.cp, self.async_op), self.order)

    def split(self, t):  # [b*nlocal, ...] -> [nlocal, b, ...]
        return layout.rows_to_segments(t, self.nlocal)

    def local(self, t_all):  # [nseg, b, ...] -> [b*nlocal, ...]: this rank's segments
        return layout.segments_to_rows(layout.take(t_all, self.local_ids))


class _Reordered:
    def __init__(self, handle, order):
        self.handle, self.order = handle, order

    def wait(self):
        rows = self.handle.wait()  # [cp, nlocal, ...]
        return layout.take(rows.reshape(-1, *rows.shape[2:]), self.order)


# -- the conv halo ----------------------------------------------------------------------------


class _HaloExchange:
    """Posts the halo all-gather at once; ``wait()`` gives every local segment's halo rows.

    xBC: (b*nlocal, m, conv_dim) pre-conv rows; labels: (b*nlocal, m) int32 document labels or None. With
    labels (sent in the same collective), ``wait()`` also fills ``mask`` (b*nlocal, d_conv-1), the halo rows of
    the document the segment begins with (the others zeroed), and ``start0`` (b*nlocal,), whether the segment
    begins a new document.
    """

    def __init__(self, xBC, width: int, plan: SegmentPlan, labels=None):
        self.plan, self.width, self.labels = plan, width, labels
        self.value = self.mask = self.start0 = None
        self._handle = None
        if plan.alone:
            # the lone segment of a group of one: no predecessor, no halo, nothing to exchange
            self._done = True
            return
        parts = []
        if width > 1:
            parts.append(plan.split(xBC[:, -(width - 1) :]))  # [nlocal, b, K-1, conv_dim]
        if labels is not None:
            tail = labels[:, -max(width - 1, 1) :]
            parts.append(plan.split(torch.cat([labels[:, :1], tail], dim=1)))  # [nlocal, b, 1 + tail]: first, tail
        if len(parts) == 1 and labels is None:
            self._handle = plan.gather_ordered(parts[0])
        elif parts:
            handle = comm.all_gather_many(parts, plan.group, plan.cp, plan.async_op)
            self._handle = _ReorderedMany(handle, plan.order)
        self._done = self._handle is None

    def wait(self):
        if self._done:
            return self.value
        self._done = True
        got = self._handle.wait()
        got = [got] if torch.is_tensor(got) else got
        halo_all = got[0] if self.width > 1 else None  # [nseg, b, K-1, conv_dim]
        if halo_all is not None:
            prev = torch.cat([torch.zeros_like(halo_all[:1]), halo_all[:-1]])  # segment s receives s-1's rows
            self.value = self.plan.local(prev)
        if self.labels is not None:
            ids_all = got[-1]  # [nseg, b, 1 + tail]
            # segment 0 has no predecessor: its own first label, so that it starts no document
            first0 = ids_all[:1, :, :1].expand_as(ids_all[:1, :, 1:])
            prev_ids = self.plan.local(torch.cat([first0, ids_all[:-1, :, 1:]]))  # [b*nlocal, tail]
            first = self.labels[:, :1]
            self.start0 = prev_ids[:, -1] != first[:, 0]
            if self.value is not None:
                self.mask = prev_ids[:, -(self.width - 1) :] == first
                self.value = self.value * self.mask[..., None].to(self.value.dtype)
        return self.value


class _ReorderedMany:
    def __init__(self, handle, order):
        self.handle, self.order = handle, order

    def wait(self):
        return [layout.take(t.reshape(-1, *t.shape[2:]), self.order) for t in self.handle.wait()]


def _post_halo_grad(dhalo, mask, plan: SegmentPlan):
    """Posts the return of each segment's halo gradient to the segment that owns those rows."""
    if mask is not None:
        dhalo = dhalo * mask[..., None].to(dhalo.dtype)  # rows of another document were zeros
    return _HaloGrad(plan.gather_ordered(plan.split(dhalo)), plan)


class _HaloGrad:
    def __init__(self, handle, plan):
        self.handle, self.plan = handle, plan

    def wait(self):
        rows = self.handle.wait()  # [nseg, b, K-1, conv_dim]
        nxt = torch.cat([rows[1:], torch.zeros_like(rows[:1])])  # segment s receives from s+1
        return self.plan.local(nxt)


# -- forward and backward of the sharded core -------------------------------------------------


@dataclass(frozen=True)
class _Static:
    spec: CoreSpec
    plan: SegmentPlan
    backend: object
    return_final_states: bool
    recompute_output: bool
    tile_length: int | None = None
    summary_exchange: str = exchange.ALLGATHER  # "allgather" or "scan" (engine/exchange.py), "auto" resolved

    def exchange(self, batch: int, **kwargs):
        """The summary exchange of this call (``summary_exchange``): the all-gather's or the scan's."""
        if self.summary_exchange == exchange.SCAN:
            return exchange.ScanExchange(self.plan, batch, need_final=self.return_final_states, **kwargs)
        return exchange.AllGatherExchange(self.plan, batch, **kwargs)

    def tiles(self, rows: torch.Tensor):
        """The tiles of the (b*nlocal, m, d) segment rows, or None (one call of the backend)."""
        limit = self.backend.max_tokens_per_call(self.spec)
        return tiling.plan(rows.shape[0], rows.shape[1], self.spec, limit, self.tile_length)

    def segment_fwd(self, tiles, saved, *args, **kwargs):
        if tiles is None:
            return self.backend.segment_fwd(*args, **kwargs)
        return tiling.segment_fwd(self.backend, tiles, saved, *args, **kwargs)

    def segment_bwd(self, tiles, saved, *args, S_in, **kwargs):
        if tiles is None:
            return self.backend.segment_bwd(*args, S_in, **kwargs)
        return tiling.segment_bwd(self.backend, tiles, saved, *args, S_in=S_in, **kwargs)


def _forward(zxbcdt, params, initial_states, seq_idx, st: _Static):
    plan, spec = st.plan, st.spec
    batch = zxbcdt.shape[0]
    rows = layout.pack_segments(zxbcdt, plan.nlocal)  # [b, nlocal*m, d] -> [b*nlocal, m, d], a view
    labels = None if seq_idx is None else layout.pack_segments(seq_idx, plan.nlocal)
    _, xBC, _ = split_zxbcdt(rows, spec)
    halo = _HaloExchange(xBC, spec.d_conv, plan, labels)
    local_ids = None if labels is None else canonical_seq_idx(labels)
    summaries = st.exchange(batch, initial_states=initial_states)

    def post(S_ext, log_a):
        halo.wait()  # the backend has waited for it already: start0 is known
        summaries.start0 = halo.start0
        return summaries.post(S_ext, log_a)

    tiles, saved = st.tiles(rows), {}
    keep_y = not st.recompute_output
    if plan.alone:
        # a group of one: S_in (the initial state or zeros) is known, so the backend runs in known mode
        S_in = zero_state(rows, spec) if initial_states is None else initial_states.to(state_dtype(rows))
        gen = st.segment_fwd(tiles, saved, rows, halo, params, spec=spec, seq_idx=local_ids, keep_y=keep_y,
                             S_in=S_in)  # fmt: skip
        out, y, summaries.final_states = run_fwd_known(gen)
        summaries.S_in = S_in
        return layout.unpack_segments(out, plan.nlocal), y, halo, local_ids, summaries, saved
    gen = st.segment_fwd(tiles, saved, rows, halo, params, spec=spec, seq_idx=local_ids, keep_y=keep_y)
    out, y = drive_fwd(gen, post)
    return layout.unpack_segments(out, plan.nlocal), y, halo, local_ids, summaries, saved


def _backward(dout, zxbcdt, halo, params, S_in, log_a_all, dfinal, local_ids, start0, mask, kept, saved,
              st: _Static):  # fmt: skip
    plan, spec = st.plan, st.spec
    batch = zxbcdt.shape[0]
    rows = layout.pack_segments(zxbcdt, plan.nlocal)
    dout = layout.pack_segments(dout, plan.nlocal)
    summaries = st.exchange(batch, log_a_all=log_a_all, dfinal_states=dfinal, start0=start0)
    post_halo_grad = lambda dh: _post_halo_grad(dh, mask, plan)  # noqa: E731
    if plan.alone:  # known mode, as the forward ran: dS_out is the final state's gradient (or zeros)
        dS_out = torch.zeros_like(S_in) if dfinal is None else dfinal.to(S_in.dtype)
        gen = st.segment_bwd(st.tiles(rows), saved, dout, rows, halo, params, S_in=S_in, spec=spec,
                             seq_idx=local_ids, kept=kept, dS_out=dS_out)  # fmt: skip
        (dzxbcdt, *dparams), summaries.dinitial_states, dtail = run_bwd_known(gen, post_halo_grad)
    else:
        gen = st.segment_bwd(st.tiles(rows), saved, dout, rows, halo, params, S_in=S_in, spec=spec,
                             seq_idx=local_ids, kept=kept)  # fmt: skip
        (dzxbcdt, *dparams), dtail = drive_bwd(gen, summaries.post_grad, post_halo_grad)
    if dtail is not None:
        dtail = dtail.wait()
        start = spec.d_inner  # xBC's channels inside zxbcdt; dzxbcdt is the backend's own fresh buffer
        dzxbcdt[:, -dtail.shape[1] :, start : start + spec.conv_dim] += dtail.to(dzxbcdt.dtype)
    return layout.unpack_segments(dzxbcdt, plan.nlocal), dparams, summaries.dinitial_states


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (non-reentrant checkpointing, save_on_cpu, offloading) are active."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


def _no_autocast(device):
    """The op computes as its inputs' dtypes say (cross-rank quantities in fp32), autocast or not."""
    return torch.autocast(device_type=device.type, enabled=False)


class _StatePassingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, initial_states, seq_idx,
                st):  # fmt: skip
        params = (conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight)
        with _no_autocast(zxbcdt.device):
            out, y, halo, local_ids, summaries, saved = _forward(zxbcdt, params, initial_states, seq_idx, st)
        to_save = [zxbcdt, halo.value, summaries.S_in, summaries.log_a_all, local_ids, halo.start0, halo.mask, *params]
        # tiles: their incoming states and decays (fp32, (rows, heads, ...) each: small), flattened
        ctx.tile_counts = [len(states) for states in saved.get("S_in", [])]
        to_save += [t for states in saved.get("S_in", []) for t in states]
        to_save += [t for decays in saved.get("decay", []) for t in decays]
        # The pre-gate output y (a tensor, or one per tile) is saved where saved-tensor hooks must see it;
        # otherwise the backward pops it, freeing it after the gate's backward (a second backward recomputes it).
        ys = [] if y is None else (y if isinstance(y, list) else [y])
        ctx.y_count = len(ys) if ys and _saved_tensor_hooks_active() else 0
        ctx.y_is_list = isinstance(y, list)
        ctx.kept = [] if y is None or ctx.y_count else [y]
        ctx.save_for_backward(*to_save, *(ys if ctx.y_count else []))
        ctx.st = st
        ctx.initial_dtype = None if initial_states is None else initial_states.dtype
        if st.return_final_states:
            return out, summaries.final_states
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, dout, *rest):
        zxbcdt, halo, S_in, log_a_all, local_ids, start0, mask, *more = ctx.saved_tensors
        params, more = more[:6], more[6:]
        kept = ctx.kept
        if ctx.y_count:
            ys, more = more[-ctx.y_count :], more[: -ctx.y_count]
            kept = [list(ys) if ctx.y_is_list else ys[0]]
        ctx.kept = []
        saved, n = {}, sum(ctx.tile_counts)
        if n:
            flat_S, flat_a, saved["S_in"], saved["decay"] = more[:n], more[n : 2 * n], [], []
            for count in ctx.tile_counts:
                saved["S_in"].append(list(flat_S[:count]))
                saved["decay"].append(list(flat_a[:count]))
                flat_S, flat_a = flat_S[count:], flat_a[count:]
        st = ctx.st
        dfinal = rest[0] if st.return_final_states else None
        with _no_autocast(dout.device):
            dzxbcdt, dparams, dinit = _backward(
                dout.contiguous(), zxbcdt, halo, params, S_in, log_a_all, dfinal, local_ids, start0, mask, kept, saved,
                st,
            )  # fmt: skip
        dinitial = None
        if ctx.initial_dtype is not None:
            # replicated input: the full gradient lands on the rank holding segment 0, zeros elsewhere
            dinitial = (dinit if st.plan.rank == 0 else torch.zeros_like(dinit)).to(ctx.initial_dtype)
        return (dzxbcdt, *dparams, dinitial, None, None)


def summary_exchange_of(call) -> str:
    """The summary exchange a call runs: its option, "auto" resolved by the cost model from the group size and the
    summary's bytes (``traffic.choose_summary_exchange``; sizes only, so the same on every rank)."""
    method = call.options.summary_exchange
    if method != exchange.AUTO or call.cp == 1:
        return exchange.ALLGATHER if method == exchange.AUTO else method
    spec = call.spec
    summary = traffic.summary_bytes(batch=call.zxbcdt.shape[0], nheads=spec.nheads, headdim=spec.headdim,
                                    dstate=spec.dstate)  # fmt: skip
    return traffic.choose_summary_exchange(cp=call.cp, summary=summary, chain=call.entry.chain)[0]


def run(call):
    """The state-passing strategy on a prepared ``MixerCall``: the causal chain of the call's entry of the table
    of modes (one contiguous segment per rank, or two zigzag segments per rank under "virtual"). A call with
    cp 1 is the one segment of a group of one (``group_of_one.py``)."""
    o = call.options
    chain = call.entry.chain if call.cp > 1 else modes.CONTIGUOUS
    plan = SegmentPlan(call.group if call.cp > 1 else None, call.rank, call.cp, chain, async_op=o.overlap_comm)
    st = _Static(call.spec, plan, call.backend, bool(o.return_final_states), bool(o.recompute_output),
                 o.tile_length, summary_exchange_of(call))  # fmt: skip
    return _StatePassingFn.apply(call.zxbcdt, *call.params, call.initial_states, call.seq_idx, st)


def run_forward_only(call):
    """The forward-only route of the state-passing strategy (cp > 1): the same exchanges around
    ``tiles.segment_fwd_only``, nothing saved for a backward, each tile's intermediates freed when it ends.
    Returns out, and with return_final_states the state after each document on every rank: (batch, nheads,
    headdim, dstate) without seq_idx, (ndocs, ...) with it (``documents.gather``)."""
    o, spec = call.options, call.spec
    plan = SegmentPlan(call.group, call.rank, call.cp, call.entry.chain, async_op=o.overlap_comm)
    need_final = bool(o.return_final_states) and call.seq_idx is None
    st = _Static(spec, plan, call.backend, need_final, False, o.tile_length, summary_exchange_of(call))
    with torch.no_grad(), _no_autocast(call.zxbcdt.device):
        rows = layout.pack_segments(call.zxbcdt, plan.nlocal)
        labels = None if call.seq_idx is None else layout.pack_segments(call.seq_idx, plan.nlocal)
        _, xBC, _ = split_zxbcdt(rows, spec)
        halo = _HaloExchange(xBC, spec.d_conv, plan, labels)
        summaries = st.exchange(call.zxbcdt.shape[0], initial_states=call.initial_states)

        def post(S_ext, log_a):
            halo.wait()
            summaries.start0 = halo.start0
            return summaries.post(S_ext, log_a)

        limit = call.backend.max_tokens_per_call(spec)
        groups = tiling.forward_groups(rows.shape[0], rows.shape[1], spec, limit, o.tile_length, labels)
        gen = tiling.segment_fwd_only(call.backend, groups, rows, halo, call.params, spec=spec, seq_idx=labels)
        out, states = drive_fwd(gen, post)
        out = layout.unpack_segments(out, plan.nlocal)
        if not o.return_final_states:
            return out
        if labels is None:
            return out, summaries.final_states
        found = documents.candidates(labels, plan.local_ids)
        values = tiling.states_at(groups, states, found)
        return out, documents.gather([values], found, labels[:, 0], plan.group, plan.cp, plan.layout)[0]
