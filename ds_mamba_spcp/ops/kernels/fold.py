"""This package's own Triton kernels for the SSD glue (``ops/triton.py``), with their launchers.

    fold_chunks   acc <- exp(dA_c) acc + x[c] over a segment's chunks, from zero (or a state): the summary S_ext
                  and log_a in forward, L in backward, in one read of the per-chunk values (mamba-ssm's
                  state passing would also write every chunk's state, which the summary does not need)
    ddA_tail      upstream's six small ops on the cumulative log-decays' gradient, in one launch

The math of each is in its launcher's docstring; both follow mamba-ssm's recurrences in the same order and precision
(``tests/test_triton_interpreter.py``: bitwise under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fold_chunks_kernel(
    x_ptr, dA_ptr, out_ptr, seq_idx_ptr, log_a_ptr, init_ptr, nchunks, dim, seqlen, chunk_size,
    stride_x_b, stride_x_c, stride_x_h, stride_x_d,
    stride_dA_b, stride_dA_h, stride_dA_c,
    stride_out_b, stride_out_h, stride_out_d,
    stride_seq_b, stride_seq_l, stride_la_b, stride_la_h, stride_init_b, stride_init_h, stride_init_d,
    REVERSE: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, LOG_A: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim
    x_ptr += pid_b * stride_x_b + pid_h * stride_x_h + offs * stride_x_d
    dA_ptr += pid_b * stride_dA_b + pid_h * stride_dA_h
    seq_idx_ptr += pid_b * stride_seq_b
    if HAS_INIT:
        init_ptrs = init_ptr + pid_b * stride_init_b + pid_h * stride_init_h + offs * stride_init_d
        acc = tl.load(init_ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
    total = tl.zeros((1,), dtype=tl.float32)
    for i in range(nchunks):
        c = nchunks - 1 - i if REVERSE else i
        log_decay = tl.load(dA_ptr + c * stride_dA_c).to(tl.float32)
        total += log_decay
        scale = tl.exp(log_decay)
        if HAS_SEQ_IDX:
            # the carry crosses chunk c only if its last token is in the document the carry belongs to
            # (the one the previous chunk ended in; label 0 before the first chunk), as in mamba-ssm
            last = tl.load(seq_idx_ptr + (tl.minimum((c + 1) * chunk_size, seqlen) - 1) * stride_seq_l)
            prev = tl.load(seq_idx_ptr + (c * chunk_size - 1) * stride_seq_l, mask=c > 0, other=0)
            scale = tl.where(last == prev, scale, 0.0)
        acc = scale * acc + tl.load(x_ptr + c * stride_x_c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_b * stride_out_b + pid_h * stride_out_h + offs * stride_out_d, acc, mask=mask)
    if LOG_A:
        # the segment's total log-decay, -inf where a document starts inside (canonical labels: the last
        # token's label is not 0): the incoming state never reaches the end
        if HAS_SEQ_IDX:
            ends_inside = tl.load(seq_idx_ptr + (seqlen - 1) * stride_seq_l + tl.zeros((1,), dtype=tl.int32)) != 0
            total = tl.where(ends_inside, float("-inf"), total)
        one = tl.arange(0, 1)
        tl.store(log_a_ptr + pid_b * stride_la_b + pid_h * stride_la_h + one, total, mask=(one + pid_m) == 0)


def fold_chunks(x, dA_last, *, reverse: bool, seq_idx=None, chunk_size=None, log_a=False, init=None):
    """acc <- s_c * acc + x[c] over the chunks, from zero (or from init (b, h, p, n)); fp32 (b, h, p, n).

    x: (b, c, h, p, n) per-chunk values; dA_last: (b, h, c) each chunk's total log-decay; s_c =
    exp(dA_last[c]), zeroed for a chunk whose last token starts or lies in another document than the
    previous chunk's last token (seq_idx: (b, seqlen) canonical labels, with chunk_size, or None).
    Forward (x: chunk states): S_ext; reverse (x: gradients reaching the states entering each chunk): L. The
    recurrences, order and precision of mamba-ssm's _state_passing_fwd / _bwd, without storing their per-chunk
    outputs. log_a=True: also the segment's total log-decay (b, h) fp32 (-inf for a row whose labels end past
    0). init (reverse, known mode): dS_out; the fold then returns dS_in = L + exp(log_a) dS_out, in fp32.
    """
    b, nchunks, h, p, n = x.shape
    flat = x.reshape(b, nchunks, h, p * n)
    out = torch.empty(b, h, p * n, device=x.device, dtype=torch.float32)
    total = torch.empty(b, h, device=x.device, dtype=torch.float32) if log_a else out
    block = min(512, triton.next_power_of_2(p * n))
    grid = (triton.cdiv(p * n, block), b, h)
    has_seq = seq_idx is not None
    seq_strides = seq_idx.stride() if has_seq else (0, 0)
    init_flat = None if init is None else init.reshape(b, h, p * n)
    with torch.cuda.device(x.device.index):
        _fold_chunks_kernel[grid](
            flat, dA_last, out, seq_idx if has_seq else flat, total, flat if init is None else init_flat, nchunks,
            p * n, seq_idx.shape[1] if has_seq else 0, chunk_size if has_seq else 0,
            *flat.stride(), *dA_last.stride(), *out.stride(), *seq_strides, *(total.stride() if log_a else (0, 0)),
            *(init_flat.stride() if init is not None else (0, 0, 0)),
            REVERSE=reverse, HAS_SEQ_IDX=has_seq, LOG_A=log_a, HAS_INIT=init is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return (out.view(b, h, p, n), total) if log_a else out.view(b, h, p, n)


@triton.jit
def _ddA_tail_kernel(
    ddA_ptr, next_ptr, prev_ptr, chunk_ptr, chunk_size,
    stride_b, stride_h, stride_c, stride_l,
    stride_n_b, stride_n_h, stride_n_c, stride_n_l,
    stride_p_b, stride_p_h, stride_p_c, stride_p_l,
    stride_k_b, stride_k_h, stride_k_c,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid_b, pid_h, pid_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = tl.arange(0, BLOCK)
    mask = offs < chunk_size
    prev = tl.load(prev_ptr + pid_b * stride_p_b + pid_h * stride_p_h + pid_c * stride_p_c + offs * stride_p_l,
                   mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    last = tl.load(chunk_ptr + pid_b * stride_k_b + pid_h * stride_k_h + pid_c * stride_k_c).to(tl.float32)
    prev = tl.where(offs == chunk_size - 1, prev + last, prev)
    tail = tl.cumsum(prev, axis=0, reverse=True)
    nxt = tl.load(next_ptr + pid_b * stride_n_b + pid_h * stride_n_h + pid_c * stride_n_c + offs * stride_n_l,
                  mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    ptrs = ddA_ptr + pid_b * stride_b + pid_h * stride_h + pid_c * stride_c + offs * stride_l
    ddA = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, ddA + (nxt + tail), mask=mask)


def ddA_tail(ddA, ddA_next, ddA_prev, ddA_chunk):
    """ddA += ddA_next + reverse-cumsum(ddA_prev with ddA_chunk added at each chunk's last position), in place, in
    one launch (ddA_prev unmodified). ddA, ddA_next, ddA_prev: (b, h, c, chunk_size) fp32, ddA_chunk: (b, h, c):
    the cumulative log-decays' gradients upstream's backward sums in six small ops."""
    b, h, c, chunk_size = ddA.shape
    with torch.cuda.device(ddA.device.index):
        _ddA_tail_kernel[(b, h, c)](
            ddA, ddA_next, ddA_prev, ddA_chunk, chunk_size, *ddA.stride(), *ddA_next.stride(), *ddA_prev.stride(),
            *ddA_chunk.stride(), BLOCK=triton.next_power_of_2(chunk_size), num_warps=4,
        )  # fmt: skip
    return ddA
