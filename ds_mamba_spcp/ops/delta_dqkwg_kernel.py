"""The gated ``chunk_bwd_dqkwg`` as a Triton kernel that Hopper compiles correctly (ops/delta_dqkwg.py's fast path).

fla's kernel (``fla/ops/common/chunk_o.py``) forms the intra-chunk score gradient ds = do v^T once and reads its
transpose for dk (``tl.dot(tl.trans(ds), q)``); on Hopper with Triton in [3.4, 3.7.1) that transpose of a
tensor-core result is miscompiled (fla's issue 640). This kernel never transposes a product: it forms ds^T with a
second product, v do^T (the transposes it takes are of tensors loaded from memory, as fla's own forward does), which
costs one more (64 x 64 x V) product per chunk and nothing else. The rest is the same contract as
``delta_dqkwg.chunk_bwd_dqkwg`` (the plain-PyTorch function, its reference: the formulas are in that module's
docstring) with the same roundings: h to do's dtype and dh to v's before their products, ds to k's dtype, fp32
accumulation, outputs in fla's dtypes.

One program per (chunk, value head, block of K); the value dimension is walked in blocks. A document's chunks come
from ``delta_dqkwg.chunk_bounds`` (token offsets, so a short last chunk is masked), and the state of chunk c is
``h[c]`` in the flattened (batch x chunks) order fla uses. dg comes out per block of K and is summed after, as fla
does. Checked against the PyTorch function under Triton's interpreter on CPU (tests/test_delta_dqkwg.py) and on GPU
(tests/test_gpu_delta.py: on one H100 with Triton 3.6, the very setting where fla's kernel is miscompiled, within bf16
noise of fp64 as the PyTorch function is, and fla's whole backward with it as accurate as with that function;
benchmarks/results/dqkwg_0b0ba72_h100x1/). Speed there: 0.95 ms for 16K tokens at 16 value heads of 128, about fla's
own 0.90 and 13x under the PyTorch function (``benchmarks/bench_dqkwg.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3)],
    key=["H", "HV", "K", "V", "BT", "BK", "BV", "USE_DW", "STATE_V_FIRST"],
)
@triton.jit(do_not_specialize=["n_tokens"])
def _dqkwg_kernel(q, k, v, do, h, dh, dv, g, chunk_start, chunk_end, dq, dk, dw, dg, scale, n_tokens,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, USE_DW: tl.constexpr,
                  STATE_V_FIRST: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    chunk, i_k = pid // NK, pid % NK
    head = tl.program_id(1).to(tl.int64)  # value head
    qk_head = head // (HV // H)
    first = tl.load(chunk_start + chunk).to(tl.int64)
    stop = tl.load(chunk_end + chunk).to(tl.int64)

    rows = first + tl.arange(0, BT)  # this chunk's tokens (flattened batch x time)
    live = rows < stop
    cols_k = i_k * BK + tl.arange(0, BK)
    live_k = cols_k < K
    live_tk = live[:, None] & live_k[None, :]
    state = (chunk * HV + head) * K * V  # h[chunk, head], K x V (V x K with STATE_V_FIRST)

    acc_dq = tl.zeros([BT, BK], dtype=tl.float32)  # do h^T
    acc_dk = tl.zeros([BT, BK], dtype=tl.float32)  # v dh^T
    acc_dw = tl.zeros([BT, BK], dtype=tl.float32)  # dv h^T
    acc_ds = tl.zeros([BT, BT], dtype=tl.float32)  # do v^T: [t, s]
    acc_dst = tl.zeros([BT, BT], dtype=tl.float32)  # v do^T: [s, t], formed, never transposed
    h_dot_dh = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        cols_v = v0 + tl.arange(0, BV)
        live_v = cols_v < V
        live_tv = live[:, None] & live_v[None, :]
        token_v = (rows[:, None] * HV + head) * V + cols_v[None, :]
        b_v = tl.load(v + token_v, mask=live_tv, other=0.0)
        b_do = tl.load(do + token_v, mask=live_tv, other=0.0)
        if STATE_V_FIRST:  # [BV, BK] blocks of the state either way
            at = state + cols_v[:, None] * K + cols_k[None, :]
        else:
            at = state + cols_k[None, :] * V + cols_v[:, None]
        live_vk = live_v[:, None] & live_k[None, :]
        b_h = tl.load(h + at, mask=live_vk, other=0.0)
        b_dh = tl.load(dh + at, mask=live_vk, other=0.0)
        h_dot_dh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)
        acc_ds = tl.dot(b_do, tl.trans(b_v), acc_ds)
        acc_dst = tl.dot(b_v, tl.trans(b_do), acc_dst)
        acc_dq = tl.dot(b_do, b_h.to(b_do.dtype), acc_dq)
        acc_dk = tl.dot(b_v, b_dh.to(b_v.dtype), acc_dk)
        if USE_DW:
            b_dv = tl.load(dv + token_v, mask=live_tv, other=0.0)
            acc_dw = tl.dot(b_dv.to(b_v.dtype), b_h.to(b_v.dtype), acc_dw)

    token_k = (rows[:, None] * HV + head) * K + cols_k[None, :]  # dq, dk, dw: (tokens, HV, K)
    if USE_DW:
        tl.store(dw + token_k, (-acc_dw).to(dw.dtype.element_ty), mask=live_tk)

    qk_at = (rows[:, None] * H + qk_head) * K + cols_k[None, :]
    b_q = tl.load(q + qk_at, mask=live_tk, other=0.0)
    b_k = tl.load(k + qk_at, mask=live_tk, other=0.0)
    b_g = tl.load(g + rows * HV + head, mask=live, other=0.0)
    g_last = tl.load(g + (stop - 1) * HV + head)

    b_dq = acc_dq * tl.exp2(b_g)[:, None] * scale
    b_dk = acc_dk * tl.where(live, tl.exp2(g_last - b_g), 0.0)[:, None]
    dg_last = tl.sum(h_dot_dh) * tl.exp2(g_last) + tl.sum(b_dk * b_k.to(tl.float32))

    pos = tl.arange(0, BT)
    both = live[:, None] & live[None, :]
    causal = (pos[:, None] >= pos[None, :]) & both  # [t, s]: s <= t
    ds = tl.where(causal, acc_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0.0) * scale
    anticausal = (pos[None, :] >= pos[:, None]) & both  # [s, t]: t >= s
    dst = tl.where(anticausal, acc_dst * tl.exp2(b_g[None, :] - b_g[:, None]), 0.0) * scale
    b_dq = tl.dot(ds.to(b_k.dtype), b_k, b_dq)
    b_dk = tl.dot(dst.to(b_q.dtype), b_q, b_dk)

    b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
    b_dg = tl.where(rows == stop - 1, b_dg + dg_last, b_dg)
    tl.store(dq + token_k, b_dq.to(dq.dtype.element_ty), mask=live_tk)
    tl.store(dk + token_k, b_dk.to(dk.dtype.element_ty), mask=live_tk)
    tl.store(dg + i_k * n_tokens * HV + rows * HV + head, b_dg, mask=live)


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w, g, dv, scale, state_v_first, start, end, chunk_size):
    """(dq, dk, dw or None, dg) of the gated case on a CUDA device; ``start``/``end``: each chunk's token offsets
    (``delta_dqkwg.chunk_bounds``). Shapes and dtypes as ``delta_dqkwg.chunk_bwd_dqkwg``."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    n_tokens, n_chunks = B * T, start.numel()
    BK = min(max(triton.next_power_of_2(K), 16), 128)
    BV = min(max(triton.next_power_of_2(V), 16), 64)
    NK = triton.cdiv(K, BK)
    contiguous = [x.contiguous() if x is not None else None for x in (q, k, v, do, h, dh, dv, g)]
    q, k, v, do, h, dh, dv, g = contiguous
    dq = torch.empty(n_tokens, HV, K, dtype=q.dtype, device=q.device)
    dk = torch.empty(n_tokens, HV, K, dtype=k.dtype, device=q.device)
    dw = torch.empty(n_tokens, HV, K, dtype=w.dtype, device=q.device) if w is not None else None
    dg = torch.empty(NK, n_tokens, HV, dtype=torch.float32, device=q.device)
    _dqkwg_kernel[(n_chunks * NK, HV)](
        q, k, v, do, h, dh, dv if w is not None else do, g.float() if g.dtype != torch.float32 else g,
        start, end, dq, dk, dw if w is not None else dq, dg, scale, n_tokens,
        H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, NK=NK, USE_DW=w is not None, STATE_V_FIRST=state_v_first,
    )  # fmt: skip
    if H != HV:  # each q/k head's group of value heads, summed (as fla does)
        dq, dk = dq.view(n_tokens, H, HV // H, K).sum(2), dk.view(n_tokens, H, HV // H, K).sum(2)
    dw = dw.view(B, T, HV, K) if dw is not None else None
    return dq.view(B, T, H, K), dk.view(B, T, H, K), dw, dg.sum(0).view(B, T, HV)
