"""The public mixer-core ops: mamba-ssm's argument list in, one prepared call out to the dispatcher.

mamba_split_conv1d_scan_sp / mamba_split_conv1d_scan_ulysses / mixer_core
    -> from_arguments               the arguments as one MixerCall (engine.call.prepare: checked alike on every rank)
    -> engine.dispatch.run          the strategy the table of modes names (docs/design.md, "One dispatch path")
"""

from __future__ import annotations

import dataclasses

from ds_mamba_spcp.config import Options
from ds_mamba_spcp.engine import modes
from ds_mamba_spcp.engine.call import MixerCall, MixerCore, prepare
from ds_mamba_spcp.engine.dispatch import run

_CORE_FIELDS = tuple(f.name for f in dataclasses.fields(MixerCore))
_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(Options))
_FLAGS = tuple(f.name for f in dataclasses.fields(Options) if f.type in (bool, "bool"))
_DATA = ("initial_states", "seq_idx", "cu_seqlens")


def from_arguments(arguments: dict, *, what: str) -> MixerCall:
    """A public op's arguments (its ``locals()``: mamba-ssm's names plus this package's options) as a
    prepared ``MixerCall``. input_layout left unset (None or absent) is the one the table of modes gives."""
    args = dict(arguments)
    zxbcdt, group = args.pop("zxbcdt"), args.pop("process_group", None)
    core = MixerCore(**{k: args.pop(k) for k in _CORE_FIELDS if k in args})
    data = {k: args.pop(k) for k in _DATA if k in args}
    unknown = [k for k in args if k not in _OPTION_FIELDS]
    if unknown:
        raise TypeError(f"{what} got unexpected keyword argument(s) {unknown}")
    if args.get("input_layout") is None:
        args["input_layout"] = modes.default_layout(args.get("mode", modes.STATE_PASSING),
                                                    args.get("load_balancing", modes.NONE))  # fmt: skip
    args.update({k: bool(args[k]) for k in _FLAGS if k in args})
    return prepare(zxbcdt, core, process_group=group, options=Options(**args), what=what, **data)


def mixer_core(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, *,
               what="mamba_split_conv1d_scan_sp", **kwargs):  # fmt: skip
    """The mixer core in any mode: ``mamba_split_conv1d_scan_sp``'s keyword arguments plus ``mode``
    ("state_passing" or "ulysses") and ``input_layout`` (default: the one the table of modes gives)."""
    arguments = dict(locals(), **kwargs)
    del arguments["what"], arguments["kwargs"]
    return run(from_arguments(arguments, what=what))


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
    load_balancing=modes.NONE,
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
    cuda_graphs=False,
    summary_exchange="auto",
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
            label of every token of a packed row, non-decreasing along the global row (any labels that
            grow at each document start); or
        cu_seqlens: the row's cumulative document lengths (0, ..., global seqlen), the same 1-D tensor
            on every rank (batch 1). Either gives the single-device op on the whole row with those
            documents: the conv and the state restart at every document start, initial_states enters the
            row's first document only, final_states is the state after the row's last token.
    Returns this rank's shard of the output, (batch, local_seqlen, nheads*headdim), and with
    ``return_final_states`` the state after the whole global sequence, (batch, nheads, headdim,
    dstate) in fp32 (fp64 for fp64 input), identical on every rank.

    Gradients: each rank's parameter gradients are its local contribution, summing to the full gradient
    over the group (what DeepSpeed's reduction computes); the gradient of ``initial_states`` lands whole on
    group rank 0 (zeros elsewhere); the gradients reaching the copies of ``final_states`` add up. A double
    backward raises.

    process_group: the sequence-parallel group (None: the default world group; a process without
    deepspeed.comm is a group of one). A group of size 1 runs the plain single-device op.
    load_balancing: "none" (contiguous shards), "virtual" (zigzag shards as two causal segments
    packed on the batch axis), "permute_p2p" / "permute_a2a" (zigzag shards moved to contiguous and
    back). backend: "auto" (Triton on CUDA, else reference), "reference", "triton".
    overlap_comm: post the summary all-gather asynchronously and overlap it with the state-free work.
    check_shapes: compare the ranks' calls (shapes, dtypes, options, seq_idx's borders) on every call, so
    that a mismatch raises on every rank instead of hanging (one small all-gather and a host read per call).
    recompute_output: False (default) keeps the pre-gate output y (batch, local_seqlen, nheads*headdim) for
    backward, as mamba-ssm's op does (the Triton backward skips one kernel); True recomputes it (one
    activation less, one kernel more). The reference backend always recomputes.
    tile_length: run every causal segment as consecutive tiles of this many tokens, state carried
    (``ops/tiles.py``). None: only past the int32 indexing limit of mamba-ssm's kernels.
    cuda_graphs: a group of one on CUDA only: capture forward and backward of each shape in CUDA graphs
    and replay them (``ds_mamba_spcp.engine.graphs``).
    summary_exchange: "allgather" (every rank gathers every segment's summary), "scan" (a log-depth scan of
    point-to-point messages, ceil(log2 segments) rounds) or "auto" (``engine.traffic.choose_summary_exchange``).
    """
    return run(from_arguments(locals(), what="mamba_split_conv1d_scan_sp"))


def mamba_split_conv1d_scan_ulysses(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    *,
    process_group=None,
    input_layout="contiguous",
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
    check_shapes=True,
    tile_length=None,
    cuda_graphs=False,
):
    """Mamba2 mixer core on this rank's shard of a sequence, by all-to-all head sharding.

    Arguments, shapes, output and gradients are those of ``mamba_split_conv1d_scan_sp`` (zxbcdt,
    conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, process_group, initial_states,
    return_final_states, dt_limit, headdim, ngroups, activation, rmsnorm_weight, rmsnorm_eps,
    norm_before_gate, backend, check_shapes, tile_length, cuda_graphs), except:
        input_layout: "contiguous", or "zigzag" (chunks r and 2*cp-1-r of 2*cp equal chunks); the output
            comes back in the same layout.
        seq_idx / cu_seqlens: all-gathered with the tokens, so that each rank scans whole rows with them.
    Each rank's parameter gradients are its heads' rows. Needs nheads % cp == 0 and ngroups a multiple or a
    divisor of cp; with rmsnorm and cp > ngroups, norm_before_gate must be False. The scan is mamba-ssm's
    own op (Triton) or its plain-PyTorch twin (no recompute_output, no overlap); past the kernels' int32
    limit, or with ``tile_length``, it runs in tiles.
    """
    return run(from_arguments(dict(locals(), mode=modes.ULYSSES), what="mamba_split_conv1d_scan_ulysses"))
