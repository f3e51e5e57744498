"""flash-linear-attention's gated ``chunk_bwd_dqkwg`` for the machines where fla refuses its own: Triton and PyTorch.

fla 0.6.0's gated delta-rule backward computes dq, dk, dw and the gate's gradient of each 64-token chunk in one Triton
kernel (``chunk_bwd_dqkwg``, ``fla/ops/common/chunk_o.py``). On Hopper GPUs with Triton >= 3.4 and < 3.7.1 that
kernel is miscompiled (fla's issue 640: a transpose of a tensor-core accumulator; dk comes out wrong, and with it dg
and db), so fla raises there instead, unless TileLang (the ``tilelang`` package and nvcc) takes the call. PyTorch
2.11 ships Triton 3.6, so every H100 and H200 with the current PyTorch has no gated delta-rule backward on fla.

This module gives fla's dispatch (``fla.backends``, the same hook TileLang uses) one more backend for that function
alone: ``chunk_bwd_dqkwg`` below, computed by one of two implementations of the same contract. "triton" (the default on
CUDA): ``ops/delta_dqkwg_kernel.py``, a kernel of this package computing what fla's does, in which nothing transposed is
a product (issue 640's trigger). "torch": batched matrix products over the chunks in plain PyTorch, the reference the
kernel is checked against (and the path for fp64 or CPU tensors). ``DS_MAMBA_SPCP_FLA_DQKWG=torch`` or ``=triton`` picks
one. The verifier takes exactly the calls fla would refuse (a gated call on Hopper with Triton in [3.4, 3.7.1)), after
TileLang in priority, so nothing changes on a machine where fla's kernel runs. The rest of fla's backward (the state
recurrence's backward, the WY representation's, the reverse cumsum) stays fla's. ``ops/delta.py`` installs it when fla's
backend is built; ``DS_MAMBA_SPCP_FLA_DQKWG=0`` keeps fla's refusal (the op then falls back as before).

What it computes, per chunk (c) and value head, with fla's conventions: g is the chunk-local cumulative gate in log2
units (fla scales the natural-log cumsum by 1/ln 2, so exp2(g) is the decay), h the state entering the chunk (K x V,
or V x K with ``state_v_first``), dh the loss's gradient with respect to the state the chunk leaves, v the chunk's
v_new (``u - w h``), dv the gradient with respect to it, do the output's gradient. The chunk's part of the forward is

    o_t     = scale * (exp2(g_t) q_t^T h  +  sum_{s <= t} exp2(g_t - g_s) (q_t . k_s) v_s)
    h_out   = exp2(g_last) h  +  sum_s exp2(g_last - g_s) k_s v_s^T
    v_new   = u - w h

and the function returns the gradients of <do, o> + <dh, h_out> + <dv, v_new> with respect to q, k, w and the
natural-log cumulative gate (dg; fla reverse-cumsums it afterwards), v, h, u held fixed. q and k heads serve
HV / H value heads each (grouped), dq and dk are summed back over each group. Every product reads its operands
rounded as fla's kernel does (h and dh to the activations' dtype, the intra-chunk score matrix ds to k's dtype) and
accumulates in fp32 (fp64 for fp64 inputs, which makes the function exact against autograd:
tests/test_delta_dqkwg.py). The PyTorch function's memory: the chunks are processed in slices of about
``SLICE_ELEMENTS`` elements per gathered tensor, and the outputs are held in fla's dtypes (dq, dk, dw in the
activations' dtype, dg fp32), each slice's fp32 sums rounded once as they are written.

Measured on one H100: fla's gated backward with the PyTorch function matches fp64 as fla's own forward does (relative
RMS 3.8e-3 on dg, where fla's own kernel, its check off, is 2.2e-2 off: benchmarks/results/delta_8033fb4_h100x1/), and
with the Triton kernel to three digits the same (benchmarks/results/dqkwg_0b0ba72_h100x1/, where the kernel alone is
within 2x the PyTorch function's bf16 error of fp64 and cp 2 and 4 pass with it). Speed there
(``benchmarks/bench_dqkwg.py``, 8 q/k heads serving 16 value heads of 128): at 16K tokens the kernel takes 0.95 ms, the
PyTorch function 12.1 ms, fla's own (miscompiled) kernel 0.90 ms; at 64K 2.44, 42.3 and 3.07 ms; fla's whole layer
forward + backward 3.95 ms against 15.0 (16K) and 12.3 against 54.3 (64K). The ~2B preset trains 196,608 tokens in
21.9 s a step with the kernel (25.2 with the PyTorch function) and 212,992 at most (74.4 GiB).
"""

from __future__ import annotations

import importlib
import os

import torch

SLICE_ELEMENTS = 1 << 24  # per tensor of a slice ((chunks, 64, heads, V) or (chunks, heads, K, V)): 64 MiB in fp32
BACKEND_TYPE = "ds_mamba_spcp_torch"
ENV = "DS_MAMBA_SPCP_FLA_DQKWG"  # "torch" / "triton": which of the two computes the call; "0": fla's refusal stands
DEFAULT = "triton"  # its GPU checks passed on one H100 (benchmarks/results/dqkwg_0b0ba72_h100x1/)


def chunk_bounds(batch: int, seqlen: int, chunk_size: int, cu_seqlens, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) token offsets into the flattened (batch x seqlen) tokens of every chunk, in fla's chunk order
    (row by row, or document by document of ``cu_seqlens``; a document's last chunk may be short)."""
    if cu_seqlens is None:
        cu = torch.arange(batch + 1, device=device, dtype=torch.long) * seqlen
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    counts = (lengths + chunk_size - 1) // chunk_size
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    first = torch.cumsum(counts, 0) - counts
    start = cu[doc] + (torch.arange(doc.numel(), device=device) - first[doc]) * chunk_size
    return start, torch.minimum(start + chunk_size, cu[doc + 1])


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):  # fmt: skip
    """fla 0.6.0's ``chunk_bwd_dqkwg`` contract, gated case: (dq, dk, dw or None, dg) (see the module docstring).

    q, k (B, T, H, K); v, do, dv (B, T, HV, V); w (B, T, HV, K) or None; g (B, T, HV) fp32; h, dh (B, NT, HV, K, V)
    (NT: the chunks of a row; B = 1 and NT every document's chunks with ``cu_seqlens``). ``chunk_indices`` is
    fla's precomputed chunk list; the bounds are recomputed here from ``cu_seqlens`` (the same order)."""
    if g is None or g_gamma is not None:
        raise NotImplementedError("ds_mamba_spcp's chunk_bwd_dqkwg takes the gated case only (g given, no g_gamma)")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = K**-0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    start, end = chunk_bounds(B, T, chunk_size, cu_seqlens, q.device)
    n_chunks = start.numel()
    if h.shape[0] * h.shape[1] != n_chunks:
        raise ValueError(f"h holds {h.shape[0] * h.shape[1]} chunk states, the tokens make {n_chunks} chunks")
    if kernel_applies(q, chunk_size):  # the Triton kernel (ops/delta_dqkwg_kernel.py), the same contract
        from ds_mamba_spcp.ops import delta_dqkwg_kernel

        return delta_dqkwg_kernel.chunk_bwd_dqkwg(q, k, v, do, h, dh, w, g, dv, scale, state_v_first, start, end,
                                                  chunk_size)  # fmt: skip
    flat = lambda x, heads: x.reshape(B * T, heads, x.shape[-1])  # noqa: E731
    qf, kf, vf, dof = flat(q, H), flat(k, H), flat(v, HV), flat(do, HV)
    dvf = flat(dv, HV) if w is not None else None
    gf = g.reshape(B * T, HV)
    hf, dhf = h.reshape(n_chunks, *h.shape[2:]), dh.reshape(n_chunks, *dh.shape[2:])
    if state_v_first:  # (V, K) states: to (K, V)
        hf, dhf = hf.transpose(-1, -2), dhf.transpose(-1, -2)

    # the outputs in their final dtypes (fla's: q's, k's, w's; dg fp32), each slice's fp32 values rounded once as it
    # is written: fp32 buffers of every token would double the memory this call adds to a layer's backward
    dq = torch.zeros(B * T, H, K, dtype=q.dtype, device=q.device)
    dk = torch.zeros(B * T, H, K, dtype=k.dtype, device=q.device)
    dw = torch.zeros(B * T, HV, K, dtype=w.dtype, device=q.device) if w is not None else None
    dg = torch.zeros(B * T, HV, dtype=acc, device=q.device)  # fp32 as fla's (fp64 for fp64 inputs)
    # (tokens, HV, K) -> (tokens, H, K): the group of value heads each q/k head serves, summed (in fp32)
    heads = lambda x: x.view(-1, H, group, K).sum(2)  # noqa: E731
    offs = torch.arange(chunk_size, device=q.device)
    causal = offs[:, None] >= offs[None, :]
    step = max(1, SLICE_ELEMENTS // (HV * max(chunk_size * max(K, V), K * V)))  # a chunk's tokens or its state
    for a in range(0, n_chunks, step):
        s, e = start[a : a + step], end[a : a + step]
        n = s.numel()
        idx = s[:, None] + offs  # (n, BT)
        valid = idx < e[:, None]
        idx = torch.where(valid, idx, (e - 1)[:, None])  # past a short chunk's end: its last token, masked below
        live = valid[..., None, None].to(acc)

        def gather(x, to=None, idx=idx, live=live):  # (n, BT, heads, dim) in acc, zero past a chunk's end
            x = x[idx]
            return (x if to is None else x.to(to)).to(acc) * live  # to: the rounding fla's kernel applies first

        qc = gather(qf).repeat_interleave(group, dim=2)
        kc = gather(kf).repeat_interleave(group, dim=2)
        vc, doc = gather(vf), gather(dof)
        gc = gf[idx].to(acc)  # (n, BT, HV)
        hc, dhc = hf[a : a + step], dhf[a : a + step]  # (n, HV, K, V)
        h_r, dh_r = hc.to(do.dtype).to(acc), dhc.to(v.dtype).to(acc)

        last = e - s - 1  # each chunk's last token
        g_last = gc[torch.arange(n, device=q.device), last]  # (n, HV)
        dg_last = (hc.to(acc) * dhc.to(acc)).sum((-2, -1)) * torch.exp2(g_last)
        dqc = torch.einsum("nthv,nhkv->nthk", doc, h_r) * (torch.exp2(gc) * scale)[..., None]
        into_state = torch.where(valid[..., None], torch.exp2(g_last[:, None] - gc), 0)  # (n, BT, HV)
        dkc = torch.einsum("nthv,nhkv->nthk", vc, dh_r) * into_state[..., None]
        dg_last = dg_last + (dkc * kc).sum((1, 3))
        if dw is not None:
            dvc = gather(dvf, to=v.dtype)
            dw[idx[valid]] = (-torch.einsum("nthv,nhkv->nthk", dvc, hc.to(v.dtype).to(acc))[valid]).to(dw.dtype)

        gt = gc.transpose(1, 2)  # (n, HV, BT)
        mask = causal & valid[:, :, None] & valid[:, None, :]  # (n, t, s)
        ds = torch.einsum("nthv,nshv->nhts", doc, vc)
        ds = torch.where(mask[:, None], ds * torch.exp2(gt[..., :, None] - gt[..., None, :]), 0) * scale
        ds = ds.to(k.dtype).to(acc)
        dqc = dqc + torch.einsum("nhts,nshk->nthk", ds, kc)
        dkc = dkc + torch.einsum("nhts,nthk->nshk", ds, qc)
        dgc = (dqc * qc).sum(-1) - (dkc * kc).sum(-1)  # (n, BT, HV)
        dgc[torch.arange(n, device=q.device), last] += dg_last

        tokens = idx[valid]
        dq[tokens], dk[tokens] = heads(dqc[valid]).to(dq.dtype), heads(dkc[valid]).to(dk.dtype)
        dg[tokens] = dgc[valid].to(dg.dtype)

    dw = dw.view(B, T, HV, K) if dw is not None else None
    return dq.view(B, T, H, K), dk.view(B, T, H, K), dw, dg.view(B, T, HV)


def implementation() -> str:
    """Which computes a call: "torch" (the plain-PyTorch function) or "triton" (ops/delta_dqkwg_kernel.py);
    ``DS_MAMBA_SPCP_FLA_DQKWG`` where it names one, else ``DEFAULT``."""
    chosen = os.environ.get(ENV, "1")
    if chosen not in ("1", "0", "torch", "triton"):
        raise ValueError(f"{ENV}={chosen!r}: expected torch, triton, 0 (off) or 1 (the default, {DEFAULT})")
    return chosen if chosen in ("torch", "triton") else DEFAULT


def kernel_applies(q: torch.Tensor, chunk_size: int) -> bool:
    """Whether the call runs the Triton kernel: ``implementation()`` is "triton", a CUDA tensor of 16 or 32 bits,
    fla's power-of-two chunks (anything else: the PyTorch function)."""
    return (implementation() == "triton" and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0)  # fmt: skip


def fla_refuses_here() -> bool:
    """fla's own test for refusing its gated kernel (``fla/ops/common/chunk_o.py``): Hopper, Triton in [3.4, 3.7.1)."""
    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    hopper, above_3_4, above_3_7_1 = (getattr(chunk_o, f, None) for f in
                                      ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1"))  # fmt: skip
    return bool(hopper and above_3_4 and above_3_7_1 is False)


_installed = False


def _switched_off() -> bool:
    return os.environ.get(ENV, "1") == "0"


def installed() -> bool:
    """Whether ``install`` registered the stand-in with fla in this process."""
    return _installed


def install() -> bool:
    """Registers ``chunk_bwd_dqkwg`` with fla's dispatch for the calls fla refuses (once); returns whether it is
    registered. False where ``DS_MAMBA_SPCP_FLA_DQKWG=0`` or fla has no dispatch (another fla than 0.6.0)."""
    global _installed
    if _switched_off():
        return False
    if _installed:
        return True
    try:
        import fla.ops.common.chunk_o  # noqa: F401  (its dispatch table, "common", exists from here on)
        from fla.backends import BaseBackend, register

        fla_backends = importlib.import_module("fla.backends")
    except ImportError:
        return False
    if getattr(fla_backends, "_DISPATCH_DISABLED", False):  # FLA_DISABLE_BACKEND_DISPATCH=1: fla's kernel always
        return False

    class TorchDqkwg(BaseBackend):
        backend_type = BACKEND_TYPE
        priority = 6  # after TileLang's (5): where TileLang takes the call, it keeps it

        def chunk_bwd_dqkwg_verifier(self, q, k, v, do, h, dh, w=None, g=None, g_gamma=None, *args, **kwargs):
            if g is None or g_gamma is not None:
                return False, "the gated case only"
            if _switched_off():  # switched off after it was registered: fla's own path (its refusal) again
                return False, f"{ENV}=0"
            if not fla_refuses_here():
                return False, "fla's Triton kernel runs correctly here"
            return True, None

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return chunk_bwd_dqkwg(*args, **kwargs)

    register("common")(TorchDqkwg)
    _installed = True
    return True
