"""The mixer core on mamba-ssm's Triton SSD kernels and causal-conv1d, segment by segment.

Same contract as ``ops/reference.py`` (``segment_fwd``, ``segment_bwd``, ``segment_state``, ``single_device_op``),
built from the private pieces of mamba-ssm's ``MambaSplitConv1dScanCombinedFn`` called one by one
so that the state summary exchange can sit between them:

    forward   conv (halo as causal-conv1d's initial_states) -> _chunk_cumsum_fwd -> _chunk_state_fwd
              -> S_ext = the chunk states folded from zero (our _fold_chunks_kernel), log_a
              post(S_ext, log_a)
              -> _bmm_chunk_fwd (C.B^T: needs no state, overlaps the all-gather)
              S_in = wait -> the state passing from S_in -> _chunk_scan_fwd (D, z gate) [-> gated RMSNorm]
    backward  recompute the forward's inputs to the scan from the saved inputs, halo and S_in (the
              pre-gate output y is kept from forward unless recompute_output)
              -> dz (or the RMSNorm backward) -> _chunk_scan_bwd_dstates
              -> L = those state gradients folded back to the segment's start (_fold_chunks_kernel)
              post_grad(L)
              -> dCB, ddA (need no dS_out, overlap the all-gather)
              dS_out = wait -> the state passing's backward with dfinal_states = dS_out -> dC, dx, ddt, dD, dB
              (known mode, dS_out there from the start: no fold; dS_in is the state passing's
              dinitial_states, stored in fp32)
              -> _chunk_cumsum_bwd -> conv backward (dinitial_states = halo gradient)
    state     segment_state (S_out alone, a tiled shard's backward pass 2): forward the scan's inputs and the fold
              from S_in; backward the state passing's backward from dS_out alone -> _chunk_state_bwd_dx / _db
              -> _chunk_cumsum_bwd -> conv backward: none of the chunk scan's kernels

The state passing (forward and backward) is ``ops/kernels/pass_states.py``'s: mamba-ssm's recurrences, bitwise;
DS_MAMBA_SPCP_STATE_PASSING=upstream launches mamba-ssm's ``_state_passing_fwd`` / ``_state_passing_bwd`` instead.

Numerics follow upstream's op step for step (bf16 states into the matmuls, fp32 chunk states), so a segment
chain reproduces the single-device op up to rounding; the cross-rank quantities (S_ext, log_a, S_in, L,
dS_out) are fp32. Nothing reads a tensor value on the host (CUDA-graph capturable). Saved: the inputs, the
halo, S_in, the gathered decays and, as upstream's op, the pre-gate output y (unless recompute_output);
the rest is recomputed in backward.

Length limit: mamba-ssm 2.3.2's kernels compute element offsets in int32, so a tensor they touch must hold
fewer than 2**31 elements (``max_tokens``); the sharded op runs longer segments as tiles (``ops/tiles.py``),
and a direct call with more is refused. The bound was checked on an H200
(benchmarks/probes/probe_int32_limit.py: 208384 tokens of a d_in_proj=10304 layer match, 208512 fault).
"""

from __future__ import annotations

import math

import torch
import triton

from ds_mamba_spcp.ops.autograd import first_order_only
from ds_mamba_spcp.ops.kernels import fold, pass_states, upstream
from ds_mamba_spcp.ops.segment import Ready
from ds_mamba_spcp.ops.spec import CoreSpec, split_zxbcdt

upstream.check_pinned_versions()
_conv_fwd_fn, _conv_bwd_fn = upstream.causal_conv1d_functions()
_bmm = upstream.mamba_module("ops.triton.ssd_bmm")
_chunk_state = upstream.mamba_module("ops.triton.ssd_chunk_state")
_state_passing = upstream.mamba_module("ops.triton.ssd_state_passing")
_chunk_scan = upstream.mamba_module("ops.triton.ssd_chunk_scan")
_combined = upstream.mamba_module("ops.triton.ssd_combined")
_layernorm = upstream.mamba_module("ops.triton.layernorm_gated")

NAME = "triton"
INT32_LIMIT = 2**31  # elements; offsets at or past it wrap in mamba-ssm 2.3.2's Triton kernels


# -- the int32 offset guard -------------------------------------------------------------------


def largest_numel(rows: int, seqlen: int, spec: CoreSpec) -> int:
    """Elements of the largest tensor the kernels index for ``rows`` sequences of ``seqlen``."""
    nchunks = math.ceil(seqlen / spec.chunk_size)
    return max(
        rows * seqlen * spec.d_in_proj,  # zxbcdt, dzxbcdt (z, xBC, dt and their gradients are views)
        rows * nchunks * spec.nheads * spec.headdim * spec.dstate,  # chunk states, their gradients
        rows * nchunks * spec.ngroups * spec.chunk_size * spec.chunk_size,  # C.B^T per chunk, dCB
    )


def max_tokens(spec: CoreSpec) -> int:
    """The most tokens (batch * seqlen, summed over a rank's segments) one call can take."""
    per_token = max(
        spec.d_in_proj,
        math.ceil(spec.nheads * spec.headdim * spec.dstate / spec.chunk_size),
        spec.ngroups * spec.chunk_size,
    )
    return (INT32_LIMIT - 1) // per_token


def max_tokens_per_call(spec: CoreSpec) -> int:
    """The most tokens one call of the kernels takes (ops/tiles.py runs longer segments as tiles)."""
    return max_tokens(spec)


def check_lengths(rows: int, seqlen: int, spec: CoreSpec, *, sharded: bool) -> None:
    """Raises ValueError, with the way out, when one call of ``rows`` x ``seqlen`` tokens would overflow the
    kernels' int32 offsets (only a direct call can: the sharded op runs longer segments in tiles)."""
    if largest_numel(rows, seqlen, spec) < INT32_LIMIT:
        return
    tokens, limit = rows * seqlen, max_tokens(spec)
    where = "this segment holds" if sharded else "the input holds"
    raise ValueError(
        f"{where} {tokens} tokens (batch x seqlen); mamba-ssm 2.3.2's Triton kernels index with int32 offsets "
        f"and silently return wrong results once a tensor reaches 2**31 elements (mamba-ssm issue #1015). With "
        f"d_in_proj={spec.d_in_proj} (nheads={spec.nheads}, headdim={spec.headdim}, ngroups={spec.ngroups}, "
        f"dstate={spec.dstate}) one call can take at most {limit} tokens. Call "
        "ds_mamba_spcp.mamba_split_conv1d_scan_sp instead (it runs longer rows in tiles, also on one GPU), or "
        f"pass it a tile_length of at most {limit // spec.chunk_size * spec.chunk_size}."
    )


# -- shared pieces ----------------------------------------------------------------------------


def _silu(spec: CoreSpec) -> bool:
    return spec.activation in ("silu", "swish")


def _conv_layout(t):
    """(batch, seqlen, dim) -> (batch, dim, seqlen) with stride(1) == 1, as causal-conv1d wants it."""
    return _combined.ensure_stride(t).transpose(1, 2)


def _halo_layout(halo):
    """(batch, d_conv-1, dim) time-major rows -> causal-conv1d's initial_states (batch, dim, d_conv-1)."""
    return None if halo is None else halo.contiguous().transpose(1, 2)


def _conv_fwd(xBC, halo, conv1d_weight, conv1d_bias, spec: CoreSpec, seq_idx=None, init=None):
    """init: the halo already in causal-conv1d's layout (``_halo_layout``), in place of ``halo``."""
    init = _halo_layout(halo) if init is None else init
    out = _conv_fwd_fn(_conv_layout(xBC), conv1d_weight, conv1d_bias, seq_idx, init, None, _silu(spec))
    return out.transpose(1, 2)


def _ready(halo):
    """The halo argument: a handle (``wait()``), a tensor, or None."""
    return halo.wait() if hasattr(halo, "wait") else halo


def _split_xBC(xBC, spec: CoreSpec):
    x, B, C = torch.split(xBC, [spec.d_inner, spec.ngroups * spec.dstate, spec.ngroups * spec.dstate], dim=-1)
    return (
        x.unflatten(-1, (spec.nheads, spec.headdim)),
        B.unflatten(-1, (spec.ngroups, spec.dstate)),
        C.unflatten(-1, (spec.ngroups, spec.dstate)),
    )


def _scan_inputs(zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, spec: CoreSpec, seq_idx=None, init=None):
    """dt processing, then (the halo having arrived meanwhile) conv and per-chunk states from zero:
    everything before any state arrives. init: the halo in the conv's layout, given instead of ``halo``."""
    z, xBC, dt_raw = split_zxbcdt(zxbcdt, spec)
    dA_cumsum, dt = _chunk_state._chunk_cumsum_fwd(
        dt_raw, A, spec.chunk_size, dt_bias=dt_bias, dt_softplus=True, dt_limit=spec.dt_limit
    )
    x, B, C = _split_xBC(_conv_fwd(xBC, _ready(halo), conv1d_weight, conv1d_bias, spec, seq_idx, init), spec)
    # the stride fixes of upstream's _mamba_chunk_scan_combined_fwd
    B = B if B.stride(-1) == 1 else B.contiguous()
    C = C if C.stride(-1) == 1 else C.contiguous()
    x = x if x.stride(-1) == 1 or x.stride(1) == 1 else x.contiguous()
    z = z.unflatten(-1, (spec.nheads, spec.headdim))
    z = z if z.stride(-1) == 1 or z.stride(1) == 1 else z.contiguous()
    chunk_states = _chunk_state._chunk_state_fwd(B, x, dt, dA_cumsum, seq_idx=seq_idx, states_in_fp32=True)
    return z, xBC, dt_raw, x, B, C, dt, dA_cumsum, chunk_states  # chunk_states: [b, c, h, p, n] fp32


def _pass_states(chunk_states, dA_cumsum, initial_states, out_dtype=None, seq_idx=None, chunk_size=None):
    """States entering every chunk (out_dtype) and the state after the last one (fp32)."""
    flat = chunk_states.flatten(-2)
    init = None if initial_states is None else initial_states.flatten(-2)
    if pass_states.enabled():  # the same recurrence, with the next chunks' loads in flight (ops/kernels/pass_states.py)
        prev, final = pass_states.state_passing_fwd(
            flat, dA_cumsum[:, :, :, -1], initial_states=init, seq_idx=seq_idx, chunk_size=chunk_size,
            out_dtype=out_dtype,
        )  # fmt: skip
    else:
        prev, final = _state_passing._state_passing_fwd(
            flat, dA_cumsum[:, :, :, -1], initial_states=init, seq_idx=seq_idx, chunk_size=chunk_size,
            out_dtype=out_dtype,
        )  # fmt: skip
    p, n = chunk_states.shape[-2:]
    return prev.unflatten(-1, (p, n)), final.unflatten(-1, (p, n))


def _flat_rows(t):
    """t (b, l, ...) as ((b l), ...) rows if that is a view, else None (writes must land in t itself)."""
    if t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1):
        return t.flatten(0, 1)
    return None


def _chunk_scan_fwd_into(cb, x, dt, dA_cumsum, C, states, D, z, seq_idx, out):
    """mamba-ssm's ``_chunk_scan_fwd`` writing the gated output into ``out`` (b, l, h, p), possibly a view of a
    longer tensor. The kernel indexes the fresh pre-gate output y with ``out``'s strides, so only the batch
    stride may differ, and only for batch 1. Returns (out, y)."""
    batch, seqlen, nheads, headdim = x.shape
    _, _, nchunks, chunk_size = dt.shape
    _, _, ngroups, dstate = C.shape
    y = torch.empty(batch, seqlen, nheads, headdim, device=x.device, dtype=x.dtype)
    if out.shape != y.shape or out.dtype != y.dtype or (y.stride()[1:] != out.stride()[1:]) or batch != 1:
        raise AssertionError(f"cannot write the chunk scan into {tuple(out.shape)} {out.stride()} {out.dtype}")

    def grid(meta):
        return (triton.cdiv(chunk_size, meta["BLOCK_SIZE_M"]) * triton.cdiv(headdim, meta["BLOCK_SIZE_N"]),
                batch * nchunks, nheads)  # fmt: skip

    seq_strides = (seq_idx.stride(0), seq_idx.stride(1)) if seq_idx is not None else (0, 0)
    with torch.cuda.device(x.device.index):
        _chunk_scan._chunk_scan_fwd_kernel[grid](
            cb, x, z, out, y, dt, dA_cumsum, seq_idx, C, states, D,
            chunk_size, headdim, dstate, batch, seqlen, nheads // ngroups,
            *cb.stride(), *x.stride(), *z.stride(), *out.stride(),
            dt.stride(0), dt.stride(2), dt.stride(1), dt.stride(3),
            dA_cumsum.stride(0), dA_cumsum.stride(2), dA_cumsum.stride(1), dA_cumsum.stride(3),
            *seq_strides, *C.stride(), *states.stride(), D.stride(0) if D is not None else 0,
            True, D is not None, D.dim() == 2 if D is not None else True,
            BLOCK_SIZE_DSTATE=max(triton.next_power_of_2(dstate), 16), HAS_Z=True, HAS_SEQ_IDX=seq_idx is not None,
            IS_TRITON_22=_chunk_scan.TRITON_22,
        )  # fmt: skip
    return out, y


def _can_write_scan_into(out, x):
    return out is not None and x.shape[0] == 1 and out.stride(-1) == 1 and out.stride(1) == x.shape[-2] * x.shape[-1]


def _rms_args(y, z, spec: CoreSpec):
    """(b, l, h, p) y and z -> the 2-D rows the gated RMSNorm kernels take."""
    return y.reshape(-1, spec.d_inner), z.reshape(-1, spec.d_inner)


# -- the segment contract ---------------------------------------------------------------------

WRITES_INTO = True  # segment_fwd takes out=, segment_bwd dzxbcdt=: buffers (views of the tiles' whole) to fill


def segment_fwd(zxbcdt, halo, params, *, spec, seq_idx=None, keep_y=False, out=None, S_in=None):
    """Forward of one causal segment, a generator with the protocol and arguments of ``ops/reference.py``'s
    ``segment_fwd`` (``ops/segment.py``); the halo may be a handle, waited for after the dt processing.

    Yields (S_ext, log_a) (fp32), is sent the handle to S_in (fp32), returns (out (batch, seqlen,
    nheads*headdim), y), y the pre-gate output when keep_y (the backward then skips one _chunk_scan_fwd).
    out: a buffer (a view of a longer one) to write the output into where the kernels can (then returned).
    Known mode (S_in given): nothing yielded; returns (out, y, S_out).
    """
    conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight = params
    batch, seqlen, _ = zxbcdt.shape
    check_lengths(batch, seqlen, spec, sharded=True)
    D = D.contiguous()
    known = S_in is not None
    z, _, _, x, B, C, dt, dA_cumsum, chunk_states = _scan_inputs(
        zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, spec, seq_idx
    )
    if known:
        CB = _bmm._bmm_chunk_fwd(C, B, spec.chunk_size, seq_idx=seq_idx, output_dtype=torch.float32)
    else:
        # S_ext and log_a (the segment's total decay, exp(log_a); -inf where a document starts inside): one launch
        S_ext, log_a = fold.fold_chunks(
            chunk_states, dA_cumsum[:, :, :, -1], reverse=False, seq_idx=seq_idx, chunk_size=spec.chunk_size,
            log_a=True,
        )  # fmt: skip
        handle = yield S_ext, log_a
        CB = _bmm._bmm_chunk_fwd(C, B, spec.chunk_size, seq_idx=seq_idx, output_dtype=torch.float32)  # overlaps
        S_in = handle.wait()
    prev_states, S_out = _pass_states(chunk_states, dA_cumsum, S_in, C.dtype, seq_idx, spec.chunk_size)
    del chunk_states
    res, y = _scan_out(CB, x, dt, dA_cumsum, C, prev_states, D, z, rmsnorm_weight, spec, seq_idx, out)
    y = y if keep_y else None  # y: before the gate
    return (res, y, S_out) if known else (res, y)


def _scan_out(CB, x, dt, dA_cumsum, C, prev_states, D, z, rmsnorm_weight, spec, seq_idx, out):
    """The chunk scan and the gate (or the gated RMSNorm): (out (batch, seqlen, d_inner), y)."""
    batch, seqlen = x.shape[:2]
    if rmsnorm_weight is None:
        if _can_write_scan_into(out, x):
            into = out.unflatten(-1, x.shape[-2:])
            _, y = _chunk_scan_fwd_into(CB, x, dt, dA_cumsum, C, prev_states, D, z, seq_idx, into)
            return out, y
        res, y = _chunk_scan._chunk_scan_fwd(CB, x, dt, dA_cumsum, C, prev_states, D=D, z=z, seq_idx=seq_idx)
        return res.flatten(-2), y
    y, _ = _chunk_scan._chunk_scan_fwd(CB, x, dt, dA_cumsum, C, prev_states, D=D, z=None, seq_idx=seq_idx)
    y_rms, z_rms = _rms_args(y, z, spec)
    out_rows = None if out is None else _flat_rows(out)
    res, _, _ = _layernorm._layer_norm_fwd(
        y_rms, rmsnorm_weight.contiguous(), None, spec.rmsnorm_eps, z_rms, out=out_rows,
        group_size=spec.d_inner // spec.ngroups, norm_before_gate=spec.norm_before_gate, is_rms_norm=True,
    )  # fmt: skip
    return (out if out_rows is not None else res.view(batch, seqlen, -1)), y


def _conv_bwd_into(xBC, conv1d_weight, conv1d_bias, dxBC, dxBC_given, seq_idx, init, spec):
    """The conv's backward (causal-conv1d) from dxBC, the gradient of its output, written into dxBC_given (the xBC
    columns of dzxbcdt). Returns (dweight, dbias, the halo's gradient (batch, d_conv-1, conv_dim) or None): the
    halo's is causal-conv1d's dinitial_states."""
    dxBC_done, dweight, dbias, dinit = _conv_bwd_fn(
        _conv_layout(xBC), conv1d_weight, conv1d_bias, _conv_layout(dxBC), seq_idx, init, None,
        _conv_layout(dxBC_given), init is not None, _silu(spec),
    )  # fmt: skip
    dxBC_done = dxBC_done.transpose(1, 2)
    if dxBC_done.data_ptr() != dxBC_given.data_ptr() or dxBC_done.stride() != dxBC_given.stride():
        dxBC_given.copy_(dxBC_done)
    return dweight, dbias, None if dinit is None else dinit.transpose(1, 2)


def segment_bwd(dout, zxbcdt, halo, params, S_in, *, spec, seq_idx=None, kept=None, dzxbcdt=None, dS_out=None):
    """Backward of ``segment_fwd`` by recomputation, a generator with the protocol of ``ops/reference.py``'s.

    Yields L (fp32), is sent the handle to dS_out (fp32), yields the halo's gradient (batch, d_conv-1,
    conv_dim) (None without a halo) before the dt backward, returns the gradients of the inputs as the
    reference's. kept: the list holding segment_fwd's y, popped (y freed after the gate's backward); None or
    empty: y is recomputed. dzxbcdt: a buffer (a view of a longer one) that receives zxbcdt's gradient.
    Known mode (dS_out given): L is neither folded nor yielded; dS_in (fp32, from
    ``pass_states.state_passing_bwd_fp32_dinit``) is returned last.
    """
    conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight = params
    known = dS_out is not None
    batch, seqlen, _ = zxbcdt.shape
    check_lengths(batch, seqlen, spec, sharded=True)
    chunk = spec.chunk_size
    D = D.contiguous()
    dout = (dout if dout.stride(-1) == 1 else dout.contiguous()).unflatten(-1, (spec.nheads, spec.headdim))
    init = _halo_layout(_ready(halo))  # laid out once: the recomputed conv and the conv backward take it
    z, xBC, dt_raw, x, B, C, dt, dA_cumsum, chunk_states = _scan_inputs(
        zxbcdt, None, conv1d_weight, conv1d_bias, dt_bias, A, spec, seq_idx, init=init
    )
    prev_states, _ = _pass_states(chunk_states, dA_cumsum, S_in, None, seq_idx, chunk)  # fp32, as upstream's backward
    del chunk_states
    CB = _bmm._bmm_chunk_fwd(C, B, chunk, seq_idx=seq_idx, output_dtype=torch.float32)
    if kept:
        y = kept.pop()  # the pre-gate output, kept by the forward
        prev_lowp = None  # the states as the forward's chunk scan read them: from _state_passing_bwd below
    else:
        prev_lowp = prev_states.to(C.dtype)
        y, _ = _chunk_scan._chunk_scan_fwd(CB, x, dt, dA_cumsum, C, prev_lowp, D=D, z=None, seq_idx=seq_idx)

    # gradient buffers: views into dzxbcdt (z, dt) and into one xBC-shaped buffer (x, B, C)
    if dzxbcdt is None or (rmsnorm_weight is not None and _flat_rows(dzxbcdt) is None):
        dzxbcdt = torch.empty_like(zxbcdt)  # (the gated RMSNorm's backward writes dz as 2-D rows)
    dz, dxBC_given, ddt_given = split_zxbcdt(dzxbcdt, spec)
    dxBC = torch.empty_like(xBC)
    dx, dB, dC = _split_xBC(dxBC, spec)

    # output gate / gated RMSNorm: dout -> gradient of y
    if rmsnorm_weight is None:
        dz = dz.unflatten(-1, (spec.nheads, spec.headdim))
        dz, dy, dD_gate = _chunk_scan._chunk_scan_bwd_dz(x, z, y, dout, chunk_size=chunk, has_ddAcs=False, D=D, dz=dz)
        drmsnorm_weight = None
    else:
        y_rms, z_rms = _rms_args(y, z, spec)
        weight = rmsnorm_weight.contiguous()
        group_size = spec.d_inner // spec.ngroups
        _, _, rstd = _layernorm._layer_norm_fwd(y_rms, weight, None, spec.rmsnorm_eps, z_rms, group_size=group_size,
                                                norm_before_gate=spec.norm_before_gate, is_rms_norm=True)  # fmt: skip
        dy_rms, drmsnorm_weight, _, _ = _layernorm._layer_norm_bwd(
            dout.reshape(-1, spec.d_inner), y_rms, weight, None, spec.rmsnorm_eps, None, rstd, z_rms,
            group_size=group_size, norm_before_gate=spec.norm_before_gate, is_rms_norm=True, dz=_flat_rows(dz),
        )  # fmt: skip
        dy = dy_rms.view(batch, seqlen, spec.nheads, spec.headdim)
        dD_gate = None
        del y_rms  # a view: it would keep y's memory alive
    del y

    # L: the gradient reaching S_in when S_out receives none
    dprev = _chunk_scan._chunk_scan_bwd_dstates(C, dA_cumsum, dy, seq_idx=seq_idx, dtype=torch.float32)
    prev_flat, dprev_flat = prev_states.flatten(-2), dprev.flatten(-2)
    dA_last = dA_cumsum[:, :, :, -1]
    if known:  # dS_in comes from _state_passing_bwd below, in fp32 (it starts from dS_out)
        handle = Ready(dS_out)
    else:
        handle = yield fold.fold_chunks(dprev, dA_last, reverse=True, seq_idx=seq_idx, chunk_size=chunk)

    # needs no dS_out: overlaps the all-gather
    dCB = _chunk_scan._chunk_scan_bwd_dcb(x, dt, dA_cumsum, dy, seq_idx=seq_idx, ngroups=spec.ngroups).to(CB.dtype)
    ddA = _chunk_scan._chunk_scan_bwd_ddAcs_stable(x, dt, dA_cumsum, dy, CB)  # CB is masked across documents

    dS_out = handle.wait().flatten(-2)
    # with the later segments' gradient, and (as upstream) the states rounded to the compute dtype in the same pass
    states_dtype = x.dtype if prev_lowp is None else None
    if known or pass_states.enabled():  # (with ranks, this dS_in is not needed: L was folded above)
        dstates, ddA_chunk_cumsum, dS_in, converted = pass_states.state_passing_bwd_fp32_dinit(
            prev_flat, dA_last, dprev_flat, dS_out, seq_idx, dstates_dtype=x.dtype, states_dtype=states_dtype,
            chunk_size=chunk,
        )  # fmt: skip
        dS_in = dS_in.view(dS_in.shape[0], dS_in.shape[1], spec.headdim, spec.dstate)
        converted = [converted]
    else:
        dstates, ddA_chunk_cumsum, _, *converted = _state_passing._state_passing_bwd(
            prev_flat, dA_last, dprev_flat, dfinal_states=dS_out, seq_idx=seq_idx, has_initial_states=True,
            dstates_dtype=x.dtype, states_dtype=states_dtype, chunk_size=chunk,
        )  # fmt: skip
    if prev_lowp is None:
        prev_lowp = converted[0].unflatten(-1, (spec.headdim, spec.dstate))
    del prev_states, prev_flat, dprev, dprev_flat, converted
    dC_states, ddA_cumsum_prev = _chunk_scan._chunk_scan_bwd_dC(
        prev_lowp, dA_cumsum, dy, seq_idx=seq_idx, C=C, ngroups=spec.ngroups
    )
    _bmm._bmm_chunk_bwd(B, dCB.transpose(-1, -2), residual=dC_states, out=dC)
    del dC_states, prev_lowp
    dstates = dstates.unflatten(-1, (spec.headdim, spec.dstate))
    dx, ddt, dD_x = _combined._chunk_scan_chunk_state_bwd_dx(
        x, dt, dA_cumsum, B, CB, dy, dstates, D=D, seq_idx=seq_idx, dx=dx
    )
    dB_states, ddA_next = _chunk_state._chunk_state_bwd_db(
        x, dt, dA_cumsum, dstates, seq_idx=seq_idx, B=B, ngroups=spec.ngroups
    )
    _bmm._bmm_chunk_bwd(C, dCB, residual=dB_states, out=dB)
    dD = dD_gate if dD_gate is not None else dD_x

    dweight, dbias, dhalo = _conv_bwd_into(xBC, conv1d_weight, conv1d_bias, dxBC, dxBC_given, seq_idx, init, spec)
    del dxBC
    yield dhalo  # on its way back

    ddA = fold.ddA_tail(ddA, ddA_next, ddA_cumsum_prev, ddA_chunk_cumsum)  # upstream's six small ops in one launch
    _, dA, ddt_bias = _chunk_state._chunk_cumsum_bwd(
        ddA, ddt, dt_raw.clone(), A, dt_bias=dt_bias, dt_softplus=True, dt_limit=spec.dt_limit, ddt=ddt_given
    )  # upstream clones dt here too (a Triton "invalid device context" workaround)
    grads = (
        dzxbcdt,
        dweight,
        dbias,
        None if ddt_bias is None else ddt_bias.to(dt_bias.dtype),
        dA.to(A.dtype),
        dD,
        drmsnorm_weight,
    )
    return (*grads, dS_in) if known else grads


# -- the state path alone (a tiled shard's backward pass 2) -----------------------------------


def _last_document(seq_idx, chunk_size: int):
    """(batch, seqlen) bool: the tokens in the document their chunk ends in, the only ones whose inputs reach the
    chunk's state (``_chunk_state_fwd`` masks the others). Tensor ops only: no host read."""
    seqlen = seq_idx.shape[1]
    pos = torch.arange(seqlen, device=seq_idx.device)
    last = torch.clamp((pos // chunk_size + 1) * chunk_size, max=seqlen) - 1  # each token's chunk's last token
    return seq_idx == seq_idx[:, last]


class _SegmentState(torch.autograd.Function):
    """(zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, S_in) -> S_out, the state after the segment (fp32).

    Forward: the scan's inputs (``_scan_inputs``: dt, conv, the chunk states from zero), then the chunk states
    folded from S_in (``fold.fold_chunks``: one launch, no per-chunk state written); saves the inputs only.
    Backward, by recomputation: the scan's inputs and the states entering every chunk (the state passing from
    S_in: the decays' gradients read them), then the state passing's backward from dS_out alone (no gradient
    from the outputs: a stride-0 zero), which gives the chunk states' gradients, the chunk decays' gradient
    and dS_in (fp32); then mamba-ssm's chunk-state backward kernels (``_chunk_state_bwd_dx``: dx, ddt;
    ``_chunk_state_bwd_db``: dB and the cumulative decays' gradient, as upstream's backward takes them), the
    decays' gradients summed as upstream's backward sums them with a zero output gradient, ``_chunk_cumsum_bwd``
    and the conv backward (halo gradient = causal-conv1d's dinitial_states). None of the chunk scan's kernels,
    the gate's or the RMSNorm's: z, C and D get no gradient (zero columns of dzxbcdt)."""

    @staticmethod
    def forward(ctx, spec, seq_idx, zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, S_in):
        check_lengths(zxbcdt.shape[0], zxbcdt.shape[1], spec, sharded=True)
        *_, dA_cumsum, chunk_states = _scan_inputs(zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, spec, seq_idx)
        S_out = fold.fold_chunks(chunk_states, dA_cumsum[:, :, :, -1], reverse=False, seq_idx=seq_idx,
                                 chunk_size=spec.chunk_size, init=S_in)  # fmt: skip
        ctx.spec, ctx.seq_idx = spec, seq_idx
        ctx.save_for_backward(zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, S_in)
        return S_out

    @staticmethod
    @first_order_only
    def backward(ctx, dS_out):
        zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, S_in = ctx.saved_tensors
        spec, seq_idx, chunk = ctx.spec, ctx.seq_idx, ctx.spec.chunk_size
        init = _halo_layout(halo)
        _, xBC, dt_raw, x, B, _, dt, dA_cumsum, chunk_states = _scan_inputs(
            zxbcdt, None, conv1d_weight, conv1d_bias, dt_bias, A, spec, seq_idx, init=init
        )
        prev_states, _ = _pass_states(chunk_states, dA_cumsum, S_in, None, seq_idx, chunk)  # fp32, as segment_bwd
        del chunk_states
        prev_flat = prev_states.flatten(-2)
        no_dprev = prev_flat.new_zeros(()).expand(prev_flat.shape)  # the outputs send the entering states nothing
        dS_out = dS_out.to(torch.float32).flatten(-2).contiguous()
        dstates, ddA_chunk, dS_in, _ = pass_states.state_passing_bwd_fp32_dinit(
            prev_flat, dA_cumsum[:, :, :, -1], no_dprev, dS_out, seq_idx, dstates_dtype=x.dtype, states_dtype=None,
            chunk_size=chunk,
        )  # fmt: skip
        del prev_states, prev_flat
        dstates = dstates.unflatten(-1, (spec.headdim, spec.dstate))

        dzxbcdt = torch.empty_like(zxbcdt)
        dz, dxBC_given, ddt_given = split_zxbcdt(dzxbcdt, spec)
        dz.zero_()
        dxBC = torch.empty_like(xBC)
        dx, dB, dC = _split_xBC(dxBC, spec)
        dC.zero_()
        # _chunk_state_bwd_dx reads no labels: B zeroed on the tokens whose inputs do not reach their chunk's state
        # gives them dx = ddt = 0 exactly, as _chunk_scan_chunk_state_bwd_dx's masked scale does
        B_reach = B if seq_idx is None else B * _last_document(seq_idx, chunk)[:, :, None, None].to(B.dtype)
        _, ddt, _ = _chunk_state._chunk_state_bwd_dx(B_reach, x, dt, dA_cumsum, dstates, dx=dx)
        del B_reach
        dB_states, ddA = _chunk_state._chunk_state_bwd_db(
            x, dt, dA_cumsum, dstates, seq_idx=seq_idx, B=B, ngroups=spec.ngroups
        )
        dB.copy_(dB_states)
        del dB_states, dstates
        # upstream's sum with a zero output gradient: the chunk scan's terms vanish and the reverse cumsum of a
        # chunk's last-position gradient (the state passing's) puts it on every position of the chunk
        ddA += ddA_chunk.unsqueeze(-1)

        dweight, dbias, dhalo = _conv_bwd_into(xBC, conv1d_weight, conv1d_bias, dxBC, dxBC_given, seq_idx, init, spec)
        del dxBC
        _, dA, ddt_bias = _chunk_state._chunk_cumsum_bwd(
            ddA, ddt, dt_raw.clone(), A, dt_bias=dt_bias, dt_softplus=True, dt_limit=spec.dt_limit, ddt=ddt_given
        )  # (the clone: upstream's workaround, as in segment_bwd)
        return (
            None, None, dzxbcdt, dhalo, dweight, dbias, None if ddt_bias is None else ddt_bias.to(dt_bias.dtype),
            dA.to(A.dtype), dS_in.view_as(S_in).to(S_in.dtype),
        )  # fmt: skip


def segment_state(zxbcdt, halo, params, S_in, *, spec, seq_idx=None):
    """The state after one segment, ``S_out = exp(log_a) S_in + S_ext`` (fp32), differentiable (first order) with
    respect to zxbcdt (its x, B and dt columns; z and C get zeros), the halo, conv1d_weight, conv1d_bias, dt_bias, A
    and S_in: the contract of ``ops/reference.py``'s ``segment_state``, on the chunk-state and state-passing kernels
    alone (``_SegmentState``). A tiled shard's backward pass 2 calls it (memory/tiled_block.py, ``Tiles.state``) in
    place of the whole segment differentiated with a zero output gradient. D and rmsnorm_weight do not reach the
    state: no gradient (None)."""
    conv1d_weight, conv1d_bias, dt_bias, A = params[:4]
    return _SegmentState.apply(spec, seq_idx, zxbcdt, _ready(halo), conv1d_weight, conv1d_bias, dt_bias, A, S_in)


# -- the single-device op ---------------------------------------------------------------------


class _FirstOrderOnly(torch.autograd.Function):
    """Identity on the inputs of mamba-ssm's op, whose backward (Triton kernels) builds no graph: a
    backward with create_graph=True raises here instead of losing this op's second-order terms."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @first_order_only
    def backward(ctx, *grads):
        return grads


def _first_order_only(*tensors):
    """The tensors that require grad, passed through ``_FirstOrderOnly``; the others as they are."""
    idx = [i for i, t in enumerate(tensors) if t is not None and t.requires_grad]
    if not idx or not torch.is_grad_enabled():
        return tensors
    out = list(tensors)
    for i, t in zip(idx, _FirstOrderOnly.apply(*(tensors[i] for i in idx))):
        out[i] = t
    return tuple(out)


def single_device_op(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, **kwargs):
    """mamba-ssm's ``mamba_split_conv1d_scan_combined`` itself (after the int32 length guard), with the
    arguments of ``reference.mamba_split_conv1d_scan_ref``. seq_idx: canonical labels
    (``segment.canonical_seq_idx``; the kernels apply initial_states to label 0 only) or None."""
    # the reference's default, which this package's ops share (mamba-ssm's own default is True)
    kwargs.setdefault("norm_before_gate", False)
    spec_keys = ("headdim", "ngroups", "dt_limit", "activation", "rmsnorm_eps", "norm_before_gate")
    spec = CoreSpec.infer(zxbcdt, conv1d_weight, D, chunk_size, **{k: kwargs[k] for k in spec_keys if k in kwargs})
    check_lengths(zxbcdt.shape[0], zxbcdt.shape[1], spec, sharded=False)
    initial_states, rmsnorm_weight, seq_idx = (kwargs.get(k) for k in ("initial_states", "rmsnorm_weight", "seq_idx"))
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight = _first_order_only(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, rmsnorm_weight
    )
    kwargs.update(
        initial_states=initial_states, rmsnorm_weight=rmsnorm_weight,
        seq_idx=None if seq_idx is None else seq_idx.to(torch.int32).contiguous(),
    )  # fmt: skip
    return _combined.mamba_split_conv1d_scan_combined(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, **kwargs
    )
