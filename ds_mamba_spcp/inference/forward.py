"""The mixer core's forward-only path for prefills: no autograd graph, nothing kept for backward, and the
decode state out (the state after each document and its conv tail), in every mode and layout.

    mixer_core_prefill(zxbcdt, ..., mode, load_balancing, input_layout, seq_idx, tile_length)
        -> op.mixer_core(..., return_final_states=True, forward_only=True): the dispatcher's forward-only route
           of the entry the options name: nothing kept for a backward, each tile's intermediates freed when it
           has finished (docs/design.md, "Forward only")
        -> the conv tails: the last d_conv pre-conv columns of each document, from whichever ranks hold them
           (``conv_tail`` for unpacked rows, ``document_tails`` for packed rows)

Packed rows (``seq_idx``): every document gets its own final state and conv tail, on every rank, in document
order (``documents.py``), whichever rank its end lies on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ds_mamba_spcp import comm, op
from ds_mamba_spcp.engine import documents, layout, modes
from ds_mamba_spcp.engine.call import cu_seqlens_to_seq_idx


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


def document_tails(xBC: torch.Tensor, seq_idx: torch.Tensor, d_conv: int, group,
                   input_layout: str = modes.CONTIGUOUS) -> torch.Tensor:  # fmt: skip
    """The conv state after each document of packed rows, on every rank: (ndocs, conv_dim, d_conv) in document
    order, zero before the document's first token. xBC: (batch, local_seqlen, conv_dim), this rank's pre-conv
    columns in ``input_layout``; seq_idx: (batch, local_seqlen). One all-gather of every segment's last
    min(d_conv, segment) columns and labels, then ``documents.gather``."""
    rank, cp = comm.group_rank_size(group)
    nlocal = layout.num_segments(cp, input_layout) // cp if cp > 1 else 1
    ids = layout.segment_ids(rank, cp, input_layout) if cp > 1 else [0]
    rows, labels = layout.pack_segments(xBC, nlocal), layout.pack_segments(seq_idx, nlocal).long()
    m, K = rows.shape[1], d_conv
    k = min(K, m)
    if cp > 1:
        parts = [layout.rows_to_segments(t[:, m - k :], nlocal) for t in (rows, labels)]  # (nlocal, batch, k, ...)
        values, marks = comm.all_gather_many(parts, group, cp, async_op=False).wait()  # (cp, nlocal, batch, k, ...)
        order = layout.gathered_order(cp, input_layout)
        values, marks = (layout.take(t.flatten(0, 1), order) for t in (values, marks))  # (nseg, batch, k, ...)
    found = documents.candidates(labels, ids)
    padded = {}
    for q in {c.row for c in found}:
        batch, j = q // nlocal, ids[q % nlocal]
        if cp > 1 and j > 0:
            before = values[:j, batch].flatten(0, 1)[-(K - 1) :], marks[:j, batch].flatten(0, 1)[-(K - 1) :]
        else:
            before = rows.new_zeros(0, rows.shape[2]), labels.new_zeros(0)
        pad = K - 1 - before[0].shape[0]  # the row's start: nothing before it
        cols = torch.cat([rows.new_zeros(pad, rows.shape[2]), before[0], rows[q]])
        marks_q = torch.cat([labels.new_full((pad,), -1), before[1], labels[q]])
        padded[q] = cols, marks_q
    windows = []
    for c in found:  # own position t = c.end - 1 sits at padded index t + K - 1: the window is [t, t + K)
        cols, marks_q = padded[c.row]
        window, same = cols[c.end - 1 : c.end - 1 + K], marks_q[c.end - 1 : c.end - 1 + K] == c.label
        windows.append((window * same[:, None].to(window.dtype)).T)
    tails = torch.stack(windows) if windows else rows.new_zeros(0, rows.shape[2], K)
    return documents.gather([tails], found, labels[:, 0], group, cp, input_layout)[0].contiguous()


def mixer_core_prefill(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, *, headdim, process_group=None,
                       seq_idx=None, **kwargs):  # fmt: skip
    """The mixer core on this rank's shard, forward only: ``op.mixer_core``'s arguments (any mode, layout,
    packed rows, ``tile_length``, ``initial_states``) without ``return_final_states``.

    Returns (out, final_states, conv_states) on every rank: this rank's shard of the output (batch, local_seqlen,
    nheads*headdim) in the input layout; one final state and one conv state per document, identical on every rank:
        without seq_idx (a row is one document)  (batch, nheads, headdim, dstate) and (batch, conv_dim, d_conv)
        with seq_idx (packed rows)                (ndocs, nheads, headdim, dstate) and (ndocs, conv_dim, d_conv),
                                                  in ``documents.py``'s order
    States in fp32 (fp64 for fp64 input), conv states in zxbcdt's dtype (zero before a document's start).
    ``initial_states`` enters each row's first document only. No graph is recorded.
    """
    forward_only = kwargs.pop("forward_only", True)  # False: the training route under no_grad (a benchmark's baseline)
    mode = kwargs.setdefault("mode", modes.STATE_PASSING)
    load_balancing = kwargs.setdefault("load_balancing", modes.NONE)
    if kwargs.get("input_layout") is None:
        kwargs["input_layout"] = modes.default_layout(mode, load_balancing)
    with torch.no_grad():
        out, final = op.mixer_core(
            zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, process_group=process_group,
            seq_idx=seq_idx, return_final_states=True, forward_only=forward_only, headdim=headdim,
            what="mixer_core_prefill", **kwargs,
        )  # fmt: skip
        d_inner = A.shape[0] * headdim
        conv_dim, d_conv = conv1d_weight.shape
        xBC = zxbcdt[..., d_inner : d_inner + conv_dim]
        if seq_idx is None and kwargs.get("cu_seqlens") is not None:  # the labels the op made of it (checked there)
            rank, cp = comm.group_rank_size(process_group)
            seq_idx = cu_seqlens_to_seq_idx(kwargs["cu_seqlens"], zxbcdt, rank, cp, kwargs["input_layout"],
                                             zxbcdt.device)  # fmt: skip
        if seq_idx is None:
            tail = conv_tail(xBC, d_conv, process_group, kwargs["input_layout"])
        else:
            tail = document_tails(xBC, seq_idx, d_conv, process_group, kwargs["input_layout"])
    return out, final, tail


def tile_forward(zxbcdt, carry, core, backend: str = "auto"):
    """One tile of a chunked prefill on one device: the mixer core on ``zxbcdt`` (batch, tile, d_in_proj) after the
    tokens ``carry`` summarises (``ops/segment.py``'s known mode). carry: None (the sequence starts here) or
    (state (batch, nheads, headdim, dstate) fp32, tail (batch, d_conv, conv_dim), the previous last d_conv
    pre-conv columns, zeros where there were fewer). Returns (out (batch, tile, nheads*headdim), the carry after
    this tile); ``carry[1].transpose(1, 2)`` is the decode conv state. Autocast is off inside."""
    from ds_mamba_spcp.ops import get_backend
    from ds_mamba_spcp.ops.segment import run_fwd_known, state_dtype, zero_state
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
        state = zero_state(zxbcdt, spec)
        tail = zxbcdt.new_zeros(batch, d_conv, conv_dim)
    else:
        state, tail = carry
    # autocast off, as dispatch.run has it around every strategy: a chunked prefill gives what the whole prompt gives
    with torch.no_grad(), torch.autocast(device_type=zxbcdt.device.type, enabled=False):
        # known mode (ops/segment.py): the carried state is the tile's S_in, its S_out the next carry
        gen = get_backend(backend, zxbcdt.device).segment_fwd(
            zxbcdt, tail[:, 1:], (conv1d_weight, conv1d_bias, dt_bias, A, D, kwargs["rmsnorm_weight"]), spec=spec,
            S_in=state.to(state_dtype(zxbcdt)),
        )  # fmt: skip
        out, _, new_state = run_fwd_known(gen)
        new_tail = torch.cat([tail, zxbcdt[..., d_inner : d_inner + conv_dim]], 1)[:, -d_conv:]
    return out, (new_state, new_tail)
