"""The state passing over a segment's chunks, forward and backward, with the next chunks' loads in flight.

mamba-ssm's ``_state_passing_fwd`` / ``_state_passing_bwd`` load a chunk's values and use them at once (one
chunk's states in flight per grid). The kernels here compute the same recurrences in the same order and
precision (bitwise equal to upstream's, the ddA partial sums aside, summed over blocks of another size:
``tests/test_triton_interpreter.py``), but walk the chunks in groups of four and issue the next group's loads
before the current group is computed.

    forward   out[0] = S_in; S <- exp(dA_c) S + states[c]; out[c + 1] = S (c < nchunks - 1), final = S (the last)
    backward  dS = dfinal; for c from the last chunk: ddA[c] = sum(out[c] dS) exp(dA_c) (per block of the
              state: the partial sums are summed by the wrapper), dS <- exp(dA_c) dS + dout[c], stored as
              dstates[c - 1] (dinitial_states for c = 0); also out[c] in the compute dtype when asked for

exp(dA_c) is zeroed where chunk c's last token lies in another document than the previous chunk's last token
(seq_idx: canonical labels; label 0 before the first chunk), as upstream does.

Time per launch, ours / upstream's, on one H200 at 64-1024 chunks: forward 0.70-1.00, backward 0.77-0.82
(benchmarks/results/pass_states_h200x1/probe_state_passing_b256.json). A fixed block (``BLOCK``, ``NUM_WARPS``;
no autotuning: the same launch everywhere, nothing to warm up).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ds_mamba_spcp.ops.kernels import upstream

# "upstream": mamba-ssm's kernels instead (for A/B measurements). Read on every call
ENV = "DS_MAMBA_SPCP_STATE_PASSING"
BLOCK = 1024  # the best of 128-1024 x 2-8 warps for all three kernels at 64-1024 chunks (the probe above)
NUM_WARPS = 4


def enabled() -> bool:
    """Whether the Triton backend launches these kernels (``DS_MAMBA_SPCP_STATE_PASSING`` unset, empty or
    ``prefetch``) or mamba-ssm's (``upstream``); anything else is refused. Read as the package's other variables
    are: spaces and case ignored, empty is the default."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "prefetch", "upstream"):
        raise ValueError(f"{ENV}={value!r}: expected 'prefetch' (the default; also unset or empty) or 'upstream'")
    return value != "upstream"


@triton.jit
def _fwd_load(states_ptrs, dA_ptr, seq_ptr, c, nchunks, mask, seqlen, chunk_size, stride_s_c, stride_dA_c,
              stride_seq_l, HAS_SEQ_IDX: tl.constexpr):  # fmt: skip
    """Chunk c's states, log-decay and last token's label (zeros past the last chunk)."""
    inside = c < nchunks
    new = tl.load(states_ptrs + c * stride_s_c, mask=tl.where(inside, mask, False), other=0.0).to(tl.float32)
    dA = tl.load(dA_ptr + c * stride_dA_c, mask=inside, other=0.0).to(tl.float32)
    if HAS_SEQ_IDX:
        label = tl.load(seq_ptr + (tl.minimum((c + 1) * chunk_size, seqlen) - 1) * stride_seq_l, mask=inside, other=0)
    else:
        label = c * 0  # (unused)
    return new, dA, label


@triton.jit
def _fwd_step(S, new, dA, label, prev_label, c, nchunks, out_ptrs, final_ptrs, mask, stride_o_c,
              HAS_SEQ_IDX: tl.constexpr):  # fmt: skip
    scale = tl.exp(dA)
    if HAS_SEQ_IDX:
        scale = tl.where(label == prev_label, scale, 0.0)
    S = scale * S + new
    tl.store(out_ptrs + (c + 1) * stride_o_c, S, mask=tl.where(c < nchunks - 1, mask, False))
    tl.store(final_ptrs, S, mask=tl.where(c == nchunks - 1, mask, False))
    return S


@triton.jit
def _state_passing_fwd_kernel(
    states_ptr, out_ptr, final_ptr, dA_ptr, init_ptr, seq_ptr, dim, nchunks, seqlen, chunk_size,
    stride_s_b, stride_s_c, stride_s_h, stride_s_d,
    stride_o_b, stride_o_c, stride_o_h, stride_o_d,
    stride_f_b, stride_f_h, stride_f_d,
    stride_dA_b, stride_dA_c, stride_dA_h,
    stride_i_b, stride_i_h, stride_i_d,
    stride_seq_b, stride_seq_l,
    HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim
    s_ptrs = states_ptr + pid_b * stride_s_b + pid_h * stride_s_h + offs * stride_s_d
    o_ptrs = out_ptr + pid_b * stride_o_b + pid_h * stride_o_h + offs * stride_o_d
    f_ptrs = final_ptr + pid_b * stride_f_b + pid_h * stride_f_h + offs * stride_f_d
    dA_ptr += pid_b * stride_dA_b + pid_h * stride_dA_h
    if HAS_SEQ_IDX:
        seq_ptr += pid_b * stride_seq_b
    if HAS_INIT:
        i_ptrs = init_ptr + pid_b * stride_i_b + pid_h * stride_i_h + offs * stride_i_d
        S = tl.load(i_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK,), dtype=tl.float32)
    tl.store(o_ptrs, S, mask=mask)
    c0 = pid_m * 0  # a tensor, so that every chunk index below is one (loop-carried values keep their type)
    n0, d0, l0 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, c0, nchunks, mask, seqlen, chunk_size, stride_s_c, stride_dA_c,
                           stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    n1, d1, l1 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, c0 + 1, nchunks, mask, seqlen, chunk_size, stride_s_c,
                           stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    n2, d2, l2 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, c0 + 2, nchunks, mask, seqlen, chunk_size, stride_s_c,
                           stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    n3, d3, l3 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, c0 + 3, nchunks, mask, seqlen, chunk_size, stride_s_c,
                           stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    prev = c0  # the label before the first chunk
    for g in range(0, nchunks, 4):
        # the next group's loads first: they are in flight while this group is computed
        m0, e0, k0 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, g + 4, nchunks, mask, seqlen, chunk_size, stride_s_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        m1, e1, k1 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, g + 5, nchunks, mask, seqlen, chunk_size, stride_s_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        m2, e2, k2 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, g + 6, nchunks, mask, seqlen, chunk_size, stride_s_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        m3, e3, k3 = _fwd_load(s_ptrs, dA_ptr, seq_ptr, g + 7, nchunks, mask, seqlen, chunk_size, stride_s_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        S = _fwd_step(S, n0, d0, l0, prev, g, nchunks, o_ptrs, f_ptrs, mask, stride_o_c, HAS_SEQ_IDX)
        S = _fwd_step(S, n1, d1, l1, l0, g + 1, nchunks, o_ptrs, f_ptrs, mask, stride_o_c, HAS_SEQ_IDX)
        S = _fwd_step(S, n2, d2, l2, l1, g + 2, nchunks, o_ptrs, f_ptrs, mask, stride_o_c, HAS_SEQ_IDX)
        S = _fwd_step(S, n3, d3, l3, l2, g + 3, nchunks, o_ptrs, f_ptrs, mask, stride_o_c, HAS_SEQ_IDX)
        prev = l3
        n0, d0, l0, n1, d1, l1, n2, d2, l2, n3, d3, l3 = m0, e0, k0, m1, e1, k1, m2, e2, k2, m3, e3, k3


@triton.jit
def _bwd_load(out_ptrs, dout_ptrs, dA_ptr, seq_ptr, c, mask, chunk_size, stride_o_c, stride_do_c, stride_dA_c,
              stride_seq_l, HAS_SEQ_IDX: tl.constexpr):  # fmt: skip
    """Chunk c's entering state, its gradient from the chunk's own outputs, its log-decay and the label of the
    previous chunk's last token (0 for the first chunk); zeros before the first chunk (c < 0)."""
    inside = c >= 0
    state = tl.load(out_ptrs + c * stride_o_c, mask=tl.where(inside, mask, False), other=0.0).to(tl.float32)
    dout = tl.load(dout_ptrs + c * stride_do_c, mask=tl.where(inside, mask, False), other=0.0).to(tl.float32)
    dA = tl.load(dA_ptr + c * stride_dA_c, mask=inside, other=0.0).to(tl.float32)
    if HAS_SEQ_IDX:
        label = tl.load(seq_ptr + (c * chunk_size - 1) * stride_seq_l, mask=c > 0, other=0)
    else:
        label = c * 0  # (unused)
    return state, dout, dA, label


@triton.jit
def _bwd_step(dS, state, dout, dA, label, next_label, c, dstates_ptrs, conv_ptrs, ddA_ptr, dinit_ptrs, mask,
              stride_ds_c, stride_o_c, stride_ddA_c, CONVERT_STATES: tl.constexpr, HAS_DINIT: tl.constexpr,
              HAS_SEQ_IDX: tl.constexpr):  # fmt: skip
    """Chunk c (nothing where c < 0): its ddA partial sum, the gradient reaching the state entering it."""
    inside = c >= 0
    scale = tl.exp(dA)
    if HAS_SEQ_IDX:
        scale = tl.where(label == next_label, scale, 0.0)
    if CONVERT_STATES:
        tl.store(conv_ptrs + c * stride_o_c, state, mask=tl.where(inside, mask, False))
    ddA = tl.sum(state * dS) * scale
    if HAS_DINIT:
        tl.store(ddA_ptr + c * stride_ddA_c, ddA, mask=inside)
    else:
        tl.store(ddA_ptr + c * stride_ddA_c, tl.where(c > 0, ddA, 0.0), mask=inside)
    dS_new = scale * dS + dout
    tl.store(dstates_ptrs + (c - 1) * stride_ds_c, dS_new, mask=tl.where(c > 0, mask, False))
    if HAS_DINIT:
        tl.store(dinit_ptrs, dS_new, mask=tl.where(c == 0, mask, False))
    return dS_new


@triton.jit
def _state_passing_bwd_kernel(
    dout_ptr, out_ptr, dA_ptr, dfinal_ptr, seq_ptr, dstates_ptr, ddA_ptr, dinit_ptr, conv_ptr,
    dim, nchunks, seqlen, chunk_size,
    stride_do_b, stride_do_c, stride_do_h, stride_do_d,
    stride_o_b, stride_o_c, stride_o_h, stride_o_d,
    stride_dA_b, stride_dA_c, stride_dA_h,
    stride_df_b, stride_df_h, stride_df_d,
    stride_seq_b, stride_seq_l,
    stride_ds_b, stride_ds_c, stride_ds_h, stride_ds_d,
    stride_ddA_b, stride_ddA_c, stride_ddA_h,
    stride_di_b, stride_di_h, stride_di_d,
    CONVERT_STATES: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim
    o_ptrs = out_ptr + pid_b * stride_o_b + pid_h * stride_o_h + offs * stride_o_d
    do_ptrs = dout_ptr + pid_b * stride_do_b + pid_h * stride_do_h + offs * stride_do_d
    ds_ptrs = dstates_ptr + pid_b * stride_ds_b + pid_h * stride_ds_h + offs * stride_ds_d
    if CONVERT_STATES:
        conv_ptrs = conv_ptr + pid_b * stride_o_b + pid_h * stride_o_h + offs * stride_o_d  # the states' strides
    else:
        conv_ptrs = o_ptrs  # (not stored to)
    ddA_ptr += pid_b * stride_ddA_b + pid_h * stride_ddA_h + pid_m
    if HAS_DINIT:
        di_ptrs = dinit_ptr + pid_b * stride_di_b + pid_h * stride_di_h + offs * stride_di_d
    else:
        di_ptrs = o_ptrs  # (not stored to)
    dA_ptr += pid_b * stride_dA_b + pid_h * stride_dA_h
    if HAS_SEQ_IDX:
        seq_ptr += pid_b * stride_seq_b
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + pid_b * stride_df_b + pid_h * stride_df_h + offs * stride_df_d, mask=mask,
                     other=0.0).to(tl.float32)  # fmt: skip
    else:
        dS = tl.zeros((BLOCK,), dtype=tl.float32)
    tl.store(ds_ptrs + (nchunks - 1) * stride_ds_c, dS, mask=mask)
    last = nchunks - 1 + pid_m * 0  # a tensor (see the forward)
    if HAS_SEQ_IDX:
        nxt = tl.load(seq_ptr + (seqlen - 1) * stride_seq_l)  # the last token's label
    else:
        nxt = last * 0  # (unused)
    s0, g0, d0, l0 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, last, mask, chunk_size, stride_o_c, stride_do_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    s1, g1, d1, l1 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, last - 1, mask, chunk_size, stride_o_c, stride_do_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    s2, g2, d2, l2 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, last - 2, mask, chunk_size, stride_o_c, stride_do_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    s3, g3, d3, l3 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, last - 3, mask, chunk_size, stride_o_c, stride_do_c,
                               stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
    for i in range(0, nchunks, 4):
        c = last - i
        # the next group's loads first: they are in flight while this group is computed
        t0, h0, e0, k0 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, c - 4, mask, chunk_size, stride_o_c, stride_do_c,
                                   stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        t1, h1, e1, k1 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, c - 5, mask, chunk_size, stride_o_c, stride_do_c,
                                   stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        t2, h2, e2, k2 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, c - 6, mask, chunk_size, stride_o_c, stride_do_c,
                                   stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        t3, h3, e3, k3 = _bwd_load(o_ptrs, do_ptrs, dA_ptr, seq_ptr, c - 7, mask, chunk_size, stride_o_c, stride_do_c,
                                   stride_dA_c, stride_seq_l, HAS_SEQ_IDX)  # fmt: skip
        dS = _bwd_step(dS, s0, g0, d0, l0, nxt, c, ds_ptrs, conv_ptrs, ddA_ptr, di_ptrs, mask, stride_ds_c,
                       stride_o_c, stride_ddA_c, CONVERT_STATES, HAS_DINIT, HAS_SEQ_IDX)  # fmt: skip
        dS = _bwd_step(dS, s1, g1, d1, l1, l0, c - 1, ds_ptrs, conv_ptrs, ddA_ptr, di_ptrs, mask, stride_ds_c,
                       stride_o_c, stride_ddA_c, CONVERT_STATES, HAS_DINIT, HAS_SEQ_IDX)  # fmt: skip
        dS = _bwd_step(dS, s2, g2, d2, l2, l1, c - 2, ds_ptrs, conv_ptrs, ddA_ptr, di_ptrs, mask, stride_ds_c,
                       stride_o_c, stride_ddA_c, CONVERT_STATES, HAS_DINIT, HAS_SEQ_IDX)  # fmt: skip
        dS = _bwd_step(dS, s3, g3, d3, l3, l2, c - 3, ds_ptrs, conv_ptrs, ddA_ptr, di_ptrs, mask, stride_ds_c,
                       stride_o_c, stride_ddA_c, CONVERT_STATES, HAS_DINIT, HAS_SEQ_IDX)  # fmt: skip
        nxt = l3
        s0, g0, d0, l0, s1, g1, d1, l1 = t0, h0, e0, k0, t1, h1, e1, k1
        s2, g2, d2, l2, s3, g3, d3, l3 = t2, h2, e2, k2, t3, h3, e3, k3


def state_passing_fwd(states, dA_last, initial_states=None, seq_idx=None, chunk_size=None, out_dtype=None,
                      block=BLOCK, num_warps=NUM_WARPS):  # fmt: skip
    """mamba-ssm's ``_state_passing_fwd`` (same arguments and results) on this module's forward kernel: states
    (b, c, h, dim) -> (out (b, c, h, dim) in out_dtype (the states' dtype by default): the state entering every
    chunk, final (b, h, dim) fp32)."""
    batch, nchunks, nheads, dim = states.shape
    out = torch.empty(batch, nchunks, nheads, dim, device=states.device, dtype=out_dtype or states.dtype)
    final = torch.empty(batch, nheads, dim, device=states.device, dtype=torch.float32)
    has_seq = seq_idx is not None
    block = min(block, triton.next_power_of_2(dim))
    with torch.cuda.device(states.device.index):
        _state_passing_fwd_kernel[(triton.cdiv(dim, block), batch, nheads)](
            states, out, final, dA_last, initial_states, seq_idx, dim, nchunks,
            seq_idx.shape[-1] if has_seq else 0, chunk_size if has_seq else 0,
            *states.stride(), *out.stride(), *final.stride(),
            dA_last.stride(0), dA_last.stride(2), dA_last.stride(1),
            *(initial_states.stride() if initial_states is not None else (0, 0, 0)),
            *(seq_idx.stride() if has_seq else (0, 0)),
            HAS_INIT=initial_states is not None, HAS_SEQ_IDX=has_seq, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return out, final


def bwd_buffers(states, dout, dstates_dtype, states_dtype, dinit_dtype):
    """The backward's outputs (both kernels'): (dstates, the converted states (None unless states_dtype differs from
    the states'), dinitial_states (b, h, dim) in dinit_dtype (None for None))."""
    batch, _, nheads, dim = states.shape
    dstates = torch.empty_like(dout, dtype=dstates_dtype)
    converted = None
    if states_dtype is not None and states_dtype != states.dtype:
        converted = torch.empty_like(states, dtype=states_dtype)
        if converted.stride() != states.stride():
            raise AssertionError("the converted states must have the states' strides (the kernel shares them)")
    dinit = None if dinit_dtype is None else torch.empty(batch, nheads, dim, device=dout.device, dtype=dinit_dtype)
    return dstates, converted, dinit


def state_passing_bwd(states, dA_last, dout, dfinal_states=None, seq_idx=None, *, has_initial_states,
                      dstates_dtype, states_dtype=None, dinit_dtype=None, chunk_size=None, block=BLOCK,
                      num_warps=NUM_WARPS):  # fmt: skip
    """mamba-ssm's ``_state_passing_bwd`` (same arguments) on this module's backward kernel: -> (dstates
    (dstates_dtype), ddA_chunk_cumsum (b, h, c) in dA_last's dtype, dinitial_states (b, h, dim) in dinit_dtype
    (dstates_dtype by default; None without initial states), the states converted to states_dtype (the states
    themselves when they have it; None when states_dtype is None))."""
    batch, nchunks, nheads, dim = states.shape
    dstates, converted, dinit = bwd_buffers(states, dout, dstates_dtype, states_dtype,
                                            (dinit_dtype or dstates_dtype) if has_initial_states else None)  # fmt: skip
    block = min(block, triton.next_power_of_2(dim))
    n_blocks = triton.cdiv(dim, block)
    ddA_partial = torch.empty(batch, nheads, nchunks, n_blocks, dtype=torch.float32, device=dout.device)
    has_seq = seq_idx is not None
    with torch.cuda.device(dout.device.index):
        _state_passing_bwd_kernel[(n_blocks, batch, nheads)](
            dout, states, dA_last, dfinal_states, seq_idx, dstates, ddA_partial, dinit, converted,
            dim, nchunks, seq_idx.shape[-1] if has_seq else 0, chunk_size if has_seq else 0,
            *dout.stride(), *states.stride(), dA_last.stride(0), dA_last.stride(2), dA_last.stride(1),
            *(dfinal_states.stride() if dfinal_states is not None else (0, 0, 0)),
            *(seq_idx.stride() if has_seq else (0, 0)), *dstates.stride(),
            ddA_partial.stride(0), ddA_partial.stride(2), ddA_partial.stride(1),
            *(dinit.stride() if dinit is not None else (0, 0, 0)),
            CONVERT_STATES=converted is not None, HAS_DFINAL=dfinal_states is not None,
            HAS_DINIT=dinit is not None, HAS_SEQ_IDX=has_seq, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    ddA_chunk_cumsum = ddA_partial.sum(dim=-1).to(dtype=dA_last.dtype)
    if states_dtype is not None and states_dtype == states.dtype:
        converted = states
    return dstates, ddA_chunk_cumsum, dinit, converted


def state_passing_bwd_fp32_dinit(states, dA_chunk_cumsum, dout, dfinal_states, seq_idx, *, dstates_dtype,
                                  states_dtype, chunk_size):  # fmt: skip
    """mamba-ssm's ``_state_passing_bwd`` (``has_initial_states``; this module's kernel unless
    DS_MAMBA_SPCP_STATE_PASSING=upstream) with the initial states' gradient stored in fp32 (upstream's wrapper
    stores it in the compute dtype): known mode's dS_in, the recurrence ``fold.fold_chunks(..., init=dS_out)``
    computes too; with ranks it is discarded. -> (dstates, ddA_chunk_cumsum, dinitial_states fp32 (b, h, dim),
    the states converted to ``states_dtype`` or None)."""
    if enabled():  # this module's kernel: the same recurrence, its loads ahead
        return state_passing_bwd(
            states, dA_chunk_cumsum, dout, dfinal_states, seq_idx, has_initial_states=True,
            dstates_dtype=dstates_dtype, states_dtype=states_dtype, dinit_dtype=torch.float32, chunk_size=chunk_size,
        )  # fmt: skip
    batch, nchunks, nheads, dim = states.shape
    dstates, converted, dinit = bwd_buffers(states, dout, dstates_dtype, states_dtype, torch.float32)
    n_blocks = triton.cdiv(dim, 64)  # upstream's smallest BLOCK_SIZE: a partial sum per block of the config's
    ddA_partial = torch.empty(batch, nheads, nchunks, n_blocks, dtype=torch.float32, device=dout.device)
    seq_strides = (seq_idx.stride(0), seq_idx.stride(1)) if seq_idx is not None else (0, 0)
    kernel = upstream.mamba_module("ops.triton.ssd_state_passing")._state_passing_bwd_kernel
    with torch.cuda.device(dout.device.index):
        kernel[lambda meta: (triton.cdiv(dim, meta["BLOCK_SIZE"]), batch, nheads)](
            dout, states, dA_chunk_cumsum, dfinal_states, seq_idx, dstates, ddA_partial, dinit, converted,
            dim, nchunks, seq_idx.shape[-1] if seq_idx is not None else 0, chunk_size if seq_idx is not None else 0,
            *dout.stride(), *states.stride(),
            dA_chunk_cumsum.stride(0), dA_chunk_cumsum.stride(2), dA_chunk_cumsum.stride(1),
            *dfinal_states.stride(), *seq_strides, *dstates.stride(),
            ddA_partial.stride(0), ddA_partial.stride(2), ddA_partial.stride(1), *dinit.stride(),
            CONVERT_STATES=converted is not None, HAS_DFINAL_STATES=True, HAS_DINITSTATES=True,
            HAS_SEQ_IDX=seq_idx is not None,
        )  # fmt: skip
    valid = triton.cdiv(dim, kernel.best_config.kwargs["BLOCK_SIZE"])
    ddA_chunk_cumsum = ddA_partial[..., :valid].sum(dim=-1).to(dtype=dA_chunk_cumsum.dtype)
    if states_dtype is not None and states_dtype == states.dtype:
        converted = states
    return dstates, ddA_chunk_cumsum, dinit, converted
