"""State-passing sequence parallelism for the Mamba2 mixer core.

Each rank keeps its shard of the sequence. Forward: the last d_conv-1 pre-conv rows of every
segment are all-gathered (the conv halo), each segment computes its fp32 summary (S_ext, log_a)
from a zero state, the summaries are all-gathered (posted asynchronously) and an exclusive scan
gives every segment its true incoming state. Backward mirrors it: the gradients L that reach the
incoming states are all-gathered, a reverse scan gives the gradient reaching each outgoing state,
the local backward runs once with it, and halo gradients return to their owners. Nothing that
scales with the sequence length is exchanged or saved beyond the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_mamba_spcp import comm, layout, scan
from ds_mamba_spcp.ops import get_backend
from ds_mamba_spcp.ops.spec import CoreSpec, split_zxbcdt

LOAD_BALANCING = ("none", "permute_p2p", "permute_a2a", "virtual")


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
    def local_ids(self) -> list[int]:
        return layout.segment_ids(self.rank, self.cp, self.layout)

    def gather_ordered(self, t: torch.Tensor) -> comm.Gathered:
        """Posts an all-gather of (nlocal, ...) rows; wait() gives (nseg, ...) in causal order."""
        handle = comm.all_gather(t, self.group, self.cp, self.async_op)
        return _Reordered(handle, layout.gathered_order(self.cp, self.layout))


class _Reordered:
    def __init__(self, handle, order):
        self.handle, self.order = handle, order

    def wait(self):
        rows = self.handle.wait()  # [cp, nlocal, ...]
        return layout.take(rows.reshape(-1, *rows.shape[2:]), self.order)


class _SummaryExchange:
    """The ``exchange`` object a backend talks to: post the local summary, wait for S_in.

    Local segments sit on the batch axis: row i*nlocal + k is batch element i's local segment k
    (layout.pack_segments).
    """

    def __init__(self, plan: SegmentPlan, batch: int, initial_states=None, log_a_all=None, dfinal_states=None):
        self.plan, self.batch = plan, batch
        self.initial_states = initial_states
        self.log_a_all = log_a_all  # [nseg, b, h], kept from forward for the reverse scan
        self.dfinal_states = dfinal_states
        self.final_states = None
        self.dinitial_states = None

    def _split(self, t):  # [b*nlocal, ...] -> [nlocal, b, ...]
        return layout.rows_to_segments(t, self.plan.nlocal)

    def _local(self, t_all):  # [nseg, b, ...] -> [b*nlocal, ...]
        return layout.segments_to_rows(layout.take(t_all, self.plan.local_ids))

    def post(self, S_ext, log_a):
        """S_ext (b*nlocal, h, p, n), log_a (b*nlocal, h), both fp32 or wider."""
        cdtype = torch.promote_types(S_ext.dtype, torch.float32)
        S_ext, log_a = S_ext.to(cdtype), log_a.to(cdtype)
        numel = S_ext[0].numel()
        packed = torch.cat([S_ext.flatten(1), log_a], dim=1)  # one buffer, one collective
        handle = self.plan.gather_ordered(self._split(packed))
        return _Deferred(lambda: self._finish_fwd(handle.wait(), numel, S_ext.shape[1:], cdtype))

    def _finish_fwd(self, rows, numel, state_shape, cdtype):
        S_ext_all = rows[..., :numel].reshape(*rows.shape[:2], *state_shape)
        self.log_a_all = rows[..., numel:]
        init = None if self.initial_states is None else self.initial_states.to(cdtype)
        S_in_all, self.final_states = scan.exclusive_scan(S_ext_all, self.log_a_all, init)
        return self._local(S_in_all)

    def post_grad(self, L):
        """L (b*nlocal, h, p, n): gradient reaching the incoming states from this rank's outputs."""
        cdtype = torch.promote_types(L.dtype, torch.float32)
        L = self._split(L.to(cdtype))
        if self.dfinal_states is not None:
            # final_states is returned on every rank: the gradients that reach its copies add up
            extra = torch.zeros_like(L)
            extra[0] = self.dfinal_states.to(cdtype)  # once per rank, on its first local segment
            L = torch.cat([L, extra], dim=1)
        handle = self.plan.gather_ordered(L)
        return _Deferred(lambda: self._finish_bwd(handle.wait()))

    def _finish_bwd(self, rows):
        dfinal = None
        if self.dfinal_states is not None:
            rows, extra = rows[:, : self.batch], rows[:, self.batch :]
            dfinal = extra.sum(dim=0)
        dS_out_all, self.dinitial_states = scan.reverse_scan(rows, self.log_a_all.to(rows.dtype), dfinal)
        return self._local(dS_out_all)


class _Deferred:
    def __init__(self, fn):
        self.fn = fn

    def wait(self):
        return self.fn()


def _exchange_halo(xBC, plan: SegmentPlan, width: int):
    """Last width-1 pre-conv rows of the causally previous segment for every local segment."""
    if width <= 1:
        return None
    tails = layout.rows_to_segments(xBC[:, -(width - 1) :], plan.nlocal)  # [nlocal, b, K-1, conv_dim]
    tails_all = plan.gather_ordered(tails).wait()  # [nseg, b, K-1, conv_dim]
    prev = torch.cat([torch.zeros_like(tails_all[:1]), tails_all[:-1]])
    return layout.segments_to_rows(layout.take(prev, plan.local_ids))


def _return_halo_grad(dhalo, plan: SegmentPlan):
    """Sends each segment's halo gradient to the segment that owns those rows."""
    rows = plan.gather_ordered(layout.rows_to_segments(dhalo, plan.nlocal)).wait()
    nxt = torch.cat([rows[1:], torch.zeros_like(rows[:1])])  # segment s receives from s+1
    return layout.segments_to_rows(layout.take(nxt, plan.local_ids))


def _state_passing_fwd(zxbcdt, params, initial_states, spec: CoreSpec, plan: SegmentPlan, backend, kept=None):
    batch = zxbcdt.shape[0]
    zxbcdt = layout.pack_segments(zxbcdt, plan.nlocal)  # [b, nlocal*m, d] -> [b*nlocal, m, d], a view
    _, xBC, _ = split_zxbcdt(zxbcdt, spec)
    halo = _exchange_halo(xBC, plan, spec.d_conv)
    exchange = _SummaryExchange(plan, batch, initial_states)
    out, S_in = backend.segment_fwd(zxbcdt, halo, *params, spec=spec, exchange=exchange, kept=kept)
    return layout.unpack_segments(out, plan.nlocal), halo, S_in, exchange


def _state_passing_bwd(dout, zxbcdt, halo, params, S_in, log_a_all, dfinal, spec, plan, backend, kept=None):
    batch = zxbcdt.shape[0]
    zxbcdt = layout.pack_segments(zxbcdt, plan.nlocal)
    dout = layout.pack_segments(dout, plan.nlocal)
    exchange = _SummaryExchange(plan, batch, log_a_all=log_a_all, dfinal_states=dfinal)
    dzxbcdt, dhalo, *dparams = backend.segment_bwd(
        dout, zxbcdt, halo, *params, S_in, spec=spec, exchange=exchange, kept=kept
    )
    if dhalo is not None:
        dtail = _return_halo_grad(dhalo, plan)
        start = spec.d_inner  # xBC's channels inside zxbcdt; dzxbcdt is the backend's own fresh buffer
        dzxbcdt[:, -dtail.shape[1] :, start : start + spec.conv_dim] += dtail.to(dzxbcdt.dtype)
    return layout.unpack_segments(dzxbcdt, plan.nlocal), dparams, exchange.dinitial_states


class _StatePassingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, initial_states, spec, plan,
                backend, return_final_states, recompute_output):  # fmt: skip
        params = (conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight)
        kept = None if recompute_output else []  # the backend appends what it keeps for backward
        out, halo, S_in, exchange = _state_passing_fwd(zxbcdt, params, initial_states, spec, plan, backend, kept)
        ctx.save_for_backward(zxbcdt, halo, S_in, exchange.log_a_all, *params)
        # Not saved tensors: the backward pops them and frees them as soon as it is done with them
        # (a saved tensor lives until the backward returns). Internal intermediates that nothing
        # else can modify; a second backward (retain_graph) finds the list empty and recomputes.
        ctx.kept = kept
        ctx.spec, ctx.plan, ctx.backend = spec, plan, backend
        ctx.has_initial_states = initial_states is not None
        ctx.initial_dtype = None if initial_states is None else initial_states.dtype
        ctx.return_final_states = return_final_states
        if return_final_states:
            return out, exchange.final_states
        return out

    @staticmethod
    def backward(ctx, dout, *rest):
        zxbcdt, halo, S_in, log_a_all, *params = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        dfinal = rest[0] if ctx.return_final_states else None
        dzxbcdt, dparams, dinit = _state_passing_bwd(
            dout.contiguous(), zxbcdt, halo, params, S_in, log_a_all, dfinal, ctx.spec, ctx.plan, ctx.backend, kept
        )
        dinitial = None
        if ctx.has_initial_states:
            # replicated input: the full gradient lands on the rank holding segment 0, zeros elsewhere
            dinitial = (dinit if ctx.plan.rank == 0 else torch.zeros_like(dinit)).to(ctx.initial_dtype)
        return (dzxbcdt, *dparams, dinitial, None, None, None, None, None)


def mamba_split_conv1d_scan_sp(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    *,
    process_group=None,
    load_balancing="none",
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
    cu_seqlens=None,
    backend="auto",
    overlap_comm=True,
    check_shapes=True,
    recompute_output=False,
):
    """Mamba2 mixer core (conv1d + SSD + gating) on this rank's shard of a sequence.

    Arguments mean what they mean in mamba-ssm's ``mamba_split_conv1d_scan_combined``:
        zxbcdt: (batch, local_seqlen, 2*nheads*headdim + 2*ngroups*dstate + nheads), this rank's
            shard of in_proj's output (contiguous layout for load_balancing="none", zigzag for
            "virtual": rank r holds chunks r and 2*cp-1-r of 2*cp equal chunks).
        conv1d_weight: (nheads*headdim + 2*ngroups*dstate, d_conv); conv1d_bias: (conv_dim,) or None
        dt_bias: (nheads,); A: (nheads,) (negative); D: (nheads,) or (nheads, headdim)
        initial_states: (batch, nheads, headdim, dstate), the state before the global sequence.
        rmsnorm_weight: (nheads*headdim,) for the gated RMSNorm (groups of nheads*headdim/ngroups
            channels), or None for y * silu(z).
    Returns this rank's shard of the output, (batch, local_seqlen, nheads*headdim), and with
    ``return_final_states`` the state after the whole global sequence, (batch, nheads, headdim,
    dstate) in fp32 (fp64 for fp64 input), identical on every rank.

    Gradients: parameters are replicated, and each rank's parameter gradients are its local
    contribution; their sum over the group is the full gradient (what DeepSpeed's data/sequence
    parallel reduction computes). Likewise the gradient of ``initial_states`` lands whole on rank 0
    of the group (zeros elsewhere), and the gradients reaching the copies of ``final_states`` on
    the different ranks add up.

    process_group: the sequence-parallel group (None: the default world group; a process without
    deepspeed.comm is a group of one). A group of size 1 runs the plain single-device op.
    load_balancing: "none" (contiguous shards) or "virtual" (zigzag shards as two causal segments
    packed on the batch axis). backend: "auto" (Triton on CUDA, else reference), "reference", "triton".
    recompute_output: False (default) keeps the pre-gate output y (batch, local_seqlen,
    nheads*headdim) from forward, as mamba-ssm's own op does, so that the Triton backward skips one
    chunk-scan kernel, and frees it as soon as the gate's backward has used it; True saves only the
    inputs, the halo, S_in and the decays and recomputes y too (one activation less held between
    forward and backward, one kernel more). The reference backend always recomputes.
    """
    if seq_idx is not None or cu_seqlens is not None:
        raise NotImplementedError(
            "packed sequences (seq_idx / cu_seqlens) are not supported by the sequence-parallel op yet: "
            "a document boundary inside a shard needs its decay zeroed in the summary"
        )
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"load_balancing must be one of {LOAD_BALANCING}, got {load_balancing!r}")
    if load_balancing in ("permute_p2p", "permute_a2a"):
        from ds_mamba_spcp import permute

        return permute.permuted_scan(
            zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
            process_group=process_group, load_balancing=load_balancing, initial_states=initial_states,
            return_final_states=return_final_states, dt_limit=dt_limit, headdim=headdim, ngroups=ngroups,
            activation=activation, rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps,
            norm_before_gate=norm_before_gate, backend=backend, overlap_comm=overlap_comm,
            check_shapes=check_shapes,
        )  # fmt: skip
    spec = CoreSpec.infer(
        zxbcdt, conv1d_weight, D, chunk_size, headdim=headdim, ngroups=ngroups, dt_limit=dt_limit,
        activation=activation, rmsnorm_eps=rmsnorm_eps, norm_before_gate=norm_before_gate,
    )  # fmt: skip
    _check_params(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, initial_states, spec)
    impl = get_backend(backend, zxbcdt.device)
    rank, cp = comm.group_rank_size(process_group)
    if cp == 1:
        return impl.single_device_op(
            zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=initial_states,
            return_final_states=return_final_states, dt_limit=dt_limit, headdim=headdim, ngroups=ngroups,
            activation=activation, rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps,
            norm_before_gate=norm_before_gate,
        )  # fmt: skip
    seq_layout = "zigzag" if load_balancing == "virtual" else "contiguous"
    plan = SegmentPlan(process_group, rank, cp, seq_layout, async_op=overlap_comm)
    local_seqlen = zxbcdt.shape[1]
    if local_seqlen % plan.nlocal != 0:
        raise ValueError(
            f"load_balancing='virtual' needs an even local seqlen (two zigzag chunks of equal length; the "
            f"global seqlen must be a multiple of 2*cp = {2 * cp}), got local seqlen {local_seqlen}"
        )
    seg_len = local_seqlen // plan.nlocal
    if seg_len < max(spec.d_conv - 1, 1):
        raise ValueError(
            f"each causal segment must hold at least d_conv-1 = {spec.d_conv - 1} tokens (and at least 1) "
            f"so that its conv halo comes from the previous segment alone; got {seg_len} tokens per segment "
            f"(local seqlen {local_seqlen}, {plan.nlocal} segment(s) per rank). Use fewer ranks or longer sequences."
        )
    if check_shapes:
        key = (
            *zxbcdt.shape, *conv1d_weight.shape, *D.shape, comm.DTYPE_CODES.get(zxbcdt.dtype, 9),
            chunk_size, headdim, ngroups, initial_states is not None, bool(return_final_states),
            rmsnorm_weight is not None, conv1d_bias is not None, LOAD_BALANCING.index(load_balancing),
        )  # fmt: skip
        comm.check_same_across_ranks(key, zxbcdt.device, process_group, cp, "mamba_split_conv1d_scan_sp")
    return _StatePassingFn.apply(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, initial_states, spec, plan, impl,
        bool(return_final_states), bool(recompute_output),
    )  # fmt: skip


def _check_params(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, initial_states, spec):
    expect = {
        "conv1d_bias": (conv1d_bias, (spec.conv_dim,)),
        "dt_bias": (dt_bias, (spec.nheads,)),
        "A": (A, (spec.nheads,)),
        "rmsnorm_weight": (rmsnorm_weight, (spec.d_inner,)),
        "initial_states": (initial_states, (zxbcdt.shape[0], spec.nheads, spec.headdim, spec.dstate)),
    }
    for name, (t, shape) in expect.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if dt_bias is None:
        raise NotImplementedError("dt_bias=None is not supported; pass zeros for no bias")
