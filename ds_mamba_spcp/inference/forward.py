"""The mixer core's forward-only path for prefills: no autograd graph, nothing kept for backward, and the
decode state out (the state after the whole sequence and the conv tail), in every mode and layout.

    mixer_core_prefill(zxbcdt, ..., mode, load_balancing, input_layout, seq_idx, tile_length)
        -> op.mixer_core(..., return_final_states=True) under torch.no_grad: the strategy the options
           name (state passing none / virtual / permute_*, ulysses, tiles) runs its forward only; its
           autograd Function records no graph, so whatever its forward hands to ``ctx`` is dropped when
           the call returns (nothing stays alive until a backward that never comes)
        -> conv_tail(...): the last d_conv pre-conv columns of the global sequence, from whichever ranks
           and segments hold them (contiguous: the last ranks; zigzag: the second halves of ranks 0, 1,
           ..., which hold the last chunks); for packed rows the columns before the last document's
           start are zero (the conv restarts there, as mamba-ssm's varlen conv states do)

What it does not give: the final state of every document of a packed row (only the row's last one),
which a batch of prompts packed in one row would need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ds_mamba_spcp import comm, layout, modes, op


def conv_tail(
    xBC: torch.Tensor, d_conv: int, group, input_layout: str = modes.CONTIGUOUS, seq_idx=None
) -> torch.Tensor:
    """The conv state after the global sequence, on every rank: (batch, conv_dim, d_conv), zeros on the left of
    a sequence shorter than d_conv and, with ``seq_idx`` (batch, local_seqlen), before the last document.

    xBC: (batch, local_seqlen, conv_dim), this rank's shard of the pre-conv columns in ``input_layout``."""
    rank, cp = comm.group_rank_size(group)
    nseg = layout.num_segments(cp, input_layout) // cp  # segments per rank: 1 contiguous, 2 zigzag
    seg = xBC.shape[1] // nseg
    k = min(d_conv, seg)
    labels = torch.zeros(xBC.shape[:2], dtype=torch.int64, device=xBC.device) if seq_idx is None else seq_idx.long()
    # this rank's segments' last k columns and their document labels: (nseg, batch, k, conv_dim), (nseg, batch, k)
    tails = [torch.stack([t[:, (s + 1) * seg - k : (s + 1) * seg] for s in range(nseg)]) for t in (xBC, labels)]
    values, labels = comm.all_gather_many(tails, group, cp, async_op=False).wait()  # (cp, nseg, ...) each
    order = [(r, s) for r in range(cp) for s in range(nseg)]
    ids = [layout.segment_ids(r, cp, input_layout)[s] for r, s in order]
    order = [o for _, o in sorted(zip(ids, order))]  # segments in global order
    value = rearrange(torch.stack([values[r, s] for r, s in order]), "n b k d -> b (n k) d")[:, -d_conv:]
    label = rearrange(torch.stack([labels[r, s] for r, s in order]), "n b k -> b (n k)")[:, -d_conv:]
    value = value * (label == label[:, -1:]).to(value.dtype)[..., None]  # the last document's columns only
    value = rearrange(value, "b l d -> b d l")
    return F.pad(value, (d_conv - value.shape[-1], 0)) if value.shape[-1] < d_conv else value.contiguous()


def mixer_core_prefill(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, *, headdim, process_group=None,
                       seq_idx=None, **kwargs):  # fmt: skip
    """The mixer core on this rank's shard, forward only: ``op.mixer_core``'s arguments (any mode, layout,
    packed rows, ``tile_length``, ``initial_states``) without ``return_final_states``.

    Returns (out, final_states, conv_state): this rank's shard of the output (batch, local_seqlen,
    nheads*headdim) in the input layout, the state after the global sequence (batch, nheads, headdim, dstate)
    in fp32 (fp64 for fp64 input) and the conv state (batch, conv_dim, d_conv) in zxbcdt's dtype, the last
    two identical on every rank. Nothing requires grad and no graph is recorded."""
    mode = kwargs.setdefault("mode", modes.STATE_PASSING)
    load_balancing = kwargs.setdefault("load_balancing", modes.NONE)
    if kwargs.get("input_layout") is None:
        kwargs["input_layout"] = modes.default_layout(mode, load_balancing)
    with torch.no_grad():
        out, final = op.mixer_core(
            zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, process_group=process_group,
            seq_idx=seq_idx, return_final_states=True, headdim=headdim, what="mixer_core_prefill", **kwargs,
        )  # fmt: skip
        d_inner = A.shape[0] * headdim
        conv_dim, d_conv = conv1d_weight.shape
        tail = conv_tail(
            zxbcdt[..., d_inner : d_inner + conv_dim], d_conv, process_group, kwargs["input_layout"], seq_idx
        )  # fmt: skip
    return out, final, tail


def tile_forward(zxbcdt, carry, core, backend: str = "auto"):
    """One tile of a chunked prefill on one device: the mixer core on ``zxbcdt`` (batch, tile, d_in_proj)
    after the tokens ``carry`` summarises, through the backend's segment protocol (``ops/segment.py``).

    carry: None (the sequence starts here) or (state (batch, nheads, headdim, dstate) fp32, tail (batch,
    d_conv, conv_dim)): the state after the previous tokens and their last d_conv pre-conv columns (zeros
    where there were fewer). Returns (out (batch, tile, nheads*headdim), the carry after this tile): the
    state S_out = exp(log_a) * S_in + S_ext (the algebra the ranks use, DESIGN.md section 2, here from
    one tile to the next) and the new tail; ``carry[1].transpose(1, 2)`` is the decode conv state."""
    from ds_mamba_spcp.ops import get_backend
    from ds_mamba_spcp.ops.segment import Ready
    from ds_mamba_spcp.ops.spec import CoreSpec

    args, kwargs = core.op_arguments()
    conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size = args
    spec = CoreSpec.infer(
        zxbcdt, conv1d_weight, D, chunk_size, headdim=kwargs["headdim"], ngroups=kwargs["ngroups"],
        dt_limit=kwargs["dt_limit"], activation=kwargs["activation"], rmsnorm_eps=kwargs["rmsnorm_eps"],
        norm_before_gate=kwargs["norm_before_gate"],
    )  # fmt: skip
    d_inner, (conv_dim, d_conv) = A.shape[0] * core.headdim, conv1d_weight.shape
    batch = zxbcdt.shape[0]
    if carry is None:
        state = torch.zeros(batch, A.shape[0], core.headdim, spec.dstate, dtype=torch.float32, device=zxbcdt.device)
        state = state.to(torch.promote_types(zxbcdt.dtype, torch.float32))
        tail = zxbcdt.new_zeros(batch, d_conv, conv_dim)
    else:
        state, tail = carry
    with torch.no_grad():
        gen = get_backend(backend, zxbcdt.device).segment_fwd(
            zxbcdt, tail[:, 1:], conv1d_weight, conv1d_bias, dt_bias, A, D, kwargs["rmsnorm_weight"], spec=spec
        )
        S_ext, log_a = next(gen)
        try:
            gen.send(Ready(state.to(S_ext.dtype)))
        except StopIteration as stop:
            out, _ = stop.value
        new_state = torch.exp(log_a)[..., None, None] * state.to(S_ext.dtype) + S_ext
        new_tail = torch.cat([tail, zxbcdt[..., d_inner : d_inner + conv_dim]], 1)[:, -d_conv:]
    return out, (new_state, new_tail)
