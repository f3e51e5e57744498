"""The public mixer-core op: one call in, one strategy picked.

    mamba_split_conv1d_scan_sp / mixer_core
        -> call.prepare        (the arguments as one MixerCall, checked alike on every rank)
        -> run(call)           group of one: the backend's single-device op
                               mode "ulysses": ulysses.run
                               load_balancing "permute_*": permute.run (-> state_passing.run)
                               otherwise: state_passing.run

The strategies import nothing above them; this module is the only one that knows them all.
"""

from __future__ import annotations

import torch

from ds_mamba_spcp import permute, state_passing, ulysses
from ds_mamba_spcp.call import PERMUTE, MixerCall, Options, prepare


def run(call: MixerCall):
    """Runs a prepared call with the strategy its options name. Autocast does not reach inside: the op
    computes as its inputs' dtypes say, with every cross-rank quantity in fp32 (as mamba-ssm's op)."""
    with torch.autocast(device_type=call.zxbcdt.device.type, enabled=False):
        if call.cp == 1:  # the plain single-device op, or, past the kernels' cap, the row in tiles
            return state_passing.run(call) if state_passing.needs_tiles(call) else call.single_device()
        if call.options.mode == "ulysses":
            return ulysses.run(call)
        if call.options.load_balancing in PERMUTE:
            return permute.run(call)
        return state_passing.run(call)


def mixer_core(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    *,
    process_group=None,
    mode="state_passing",
    load_balancing="none",
    input_layout=None,
    initial_states=None,
    return_final_states=False,
    dt_limit=(0.0, float("inf")),
    headdim=None,
    ngroups=1,
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
    tile_length=None,
    what="mamba_split_conv1d_scan_sp",
):
    """The mixer core in any mode: ``mamba_split_conv1d_scan_sp``'s arguments plus ``mode``
    ("state_passing" or "ulysses") and ``input_layout`` (default: what load_balancing implies; under
    ulysses "contiguous" or "zigzag")."""
    if input_layout is None:
        input_layout = "contiguous" if mode == "ulysses" or load_balancing == "none" else "zigzag"
    options = Options(
        mode=mode, load_balancing=load_balancing, input_layout=input_layout,
        return_final_states=bool(return_final_states), recompute_output=bool(recompute_output),
        overlap_comm=bool(overlap_comm), backend=backend, check_shapes=bool(check_shapes), tile_length=tile_length,
    )  # fmt: skip
    call = prepare(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, process_group=process_group, options=options,
        initial_states=initial_states, dt_limit=dt_limit, headdim=headdim, ngroups=ngroups, activation=activation,
        rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps, norm_before_gate=norm_before_gate, seq_idx=seq_idx,
        cu_seqlens=cu_seqlens, what=what,
    )  # fmt: skip
    return run(call)


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
    tile_length=None,
):
    """Mamba2 mixer core (conv1d + SSD + gating) on this rank's shard of a sequence, by state passing.

    Arguments mean what they mean in mamba-ssm's ``mamba_split_conv1d_scan_combined``:
        zxbcdt: (batch, local_seqlen, 2*nheads*headdim + 2*ngroups*dstate + nheads), this rank's
            shard of in_proj's output (contiguous layout for load_balancing="none", zigzag for the
            others: rank r holds chunks r and 2*cp-1-r of 2*cp equal chunks).
        conv1d_weight: (nheads*headdim + 2*ngroups*dstate, d_conv); conv1d_bias: (conv_dim,) or None
        dt_bias: (nheads,); A: (nheads,) (negative); D: (nheads,) or (nheads, headdim)
        initial_states: (batch, nheads, headdim, dstate), the state before the global sequence.
        rmsnorm_weight: (nheads*headdim,) for the gated RMSNorm (groups of nheads*headdim/ngroups
            channels), or None for y * silu(z).
        seq_idx: (batch, local_seqlen) int32, this rank's shard (in the input layout) of the document
            label of every token of a packed row, non-decreasing along the global row (mamba-ssm's and
            DataCollatorWithFlattening's numbering, the global labels DeepSpeed's
            UlyssesSPDataLoaderAdapter slices, or any labels that grow at each document start); or
        cu_seqlens: the row's cumulative document lengths (0, ..., global seqlen), the same 1-D tensor
            on every rank (batch 1, as flash-attn's varlen takes it). Either makes the result that of
            the single-device op on the whole row with those documents: the conv and the state restart
            at every document start, initial_states enters the row's first document only, and
            final_states is the state after the row's last token.
    Returns this rank's shard of the output, (batch, local_seqlen, nheads*headdim), and with
    ``return_final_states`` the state after the whole global sequence, (batch, nheads, headdim,
    dstate) in fp32 (fp64 for fp64 input), identical on every rank.

    Gradients: parameters are replicated, and each rank's parameter gradients are its local
    contribution; their sum over the group is the full gradient (what DeepSpeed's data/sequence
    parallel reduction computes). Likewise the gradient of ``initial_states`` lands whole on rank 0
    of the group (zeros elsewhere), and the gradients reaching the copies of ``final_states`` on
    the different ranks add up. Second-order gradients are not supported (a double backward raises).

    process_group: the sequence-parallel group (None: the default world group; a process without
    deepspeed.comm is a group of one). A group of size 1 runs the plain single-device op.
    load_balancing: "none" (contiguous shards), "virtual" (zigzag shards as two causal segments
    packed on the batch axis), "permute_p2p" / "permute_a2a" (zigzag shards moved to contiguous and
    back). backend: "auto" (Triton on CUDA, else reference), "reference", "triton".
    overlap_comm: post the summary all-gather asynchronously and overlap it with the state-free work.
    check_shapes: compare the ranks' calls (shapes, dtypes, options, seq_idx's borders) on every call,
    so that a mismatch raises the same error on every rank instead of hanging (one small all-gather
    and a host read per call; see ``ds_mamba_spcp.call``).
    recompute_output: False (default) keeps the pre-gate output y (batch, local_seqlen,
    nheads*headdim) from forward, as mamba-ssm's own op does, so that the Triton backward skips one
    chunk-scan kernel, and frees it as soon as the gate's backward has used it; True saves only the
    inputs, the halo, S_in and the decays and recomputes y too (one activation less held between
    forward and backward, one kernel more). The reference backend always recomputes.
    tile_length: run every causal segment (a shard, or half of it under "virtual") as consecutive tiles of
    this many tokens with the state carried through (``ops/tiles.py``). None (default): only where a
    segment holds more tokens than one call of mamba-ssm's kernels can index (int32 offsets), so that
    no shard length is refused; a group of one then runs the whole row in tiles.
    """
    return mixer_core(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, process_group=process_group,
        mode="state_passing", load_balancing=load_balancing, initial_states=initial_states,
        return_final_states=return_final_states, dt_limit=dt_limit, headdim=headdim, ngroups=ngroups,
        activation=activation, rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps,
        norm_before_gate=norm_before_gate, seq_idx=seq_idx, cu_seqlens=cu_seqlens, backend=backend,
        overlap_comm=overlap_comm, check_shapes=check_shapes, recompute_output=recompute_output,
        tile_length=tile_length,
    )  # fmt: skip
