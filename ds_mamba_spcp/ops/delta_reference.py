"""The gated delta rule in plain PyTorch: the chunked form and the per-token recurrence (fp64-capable).

Per head, with the state S of shape (K, V) and alpha_t = exp(g_t):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

``chunk_gated_delta_rule`` takes flash-linear-attention's argument list (q, k, v, g, beta, scale, initial_state,
output_final_state, cu_seqlens, use_qk_l2norm_in_kernel) and computes in the inputs' dtype promoted to fp32 (fp64
stays fp64). Inside a chunk of C tokens, with G_t the running sum of g from the chunk's start and S_0 the state
entering the chunk, the delta rule's corrected values w_t = beta_t (v_t - alpha_t S_{t-1}^T k_t) solve one unit
lower-triangular system

    w_t + sum_{j<t} beta_t exp(G_t - G_j) (k_t . k_j) w_j = beta_t v_t - beta_t exp(G_t) S_0^T k_t

(solved once for both right-hand sides, the values' and the state's), after which

    o_t   = exp(G_t) S_0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j) w_j
    S_end = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j w_j^T

and the chunks run one after the other. Packed rows (``cu_seqlens``, batch 1) run sequence by sequence, each
from its own row of ``initial_state`` (N, H, K, V); the final states are one per sequence, like the kernel's.

A per-channel gate (Kimi's KDA: g of shape (B, T, H, K), a diagonal decay Diag(alpha_t) of the state's key rows,
applied before the delta update: S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T) runs the
same chunked form with exp(G_t - G_j) taken channel by channel: (k_t . k_j) becomes sum_c k_tc k_jc exp(G_tc - G_jc)
(and likewise for q), exp(G_t) S_0^T k_t becomes S_0^T (exp(G_t) * k_t), and the state's decay Diag(exp(G_C)).

``recurrent_gated_delta_rule`` is the recurrence itself, token by token: the ground truth of the tests.
Grouped heads (q and k with fewer heads than v) are repeated to v's heads, each query/key head serving
consecutive value heads.
"""

from __future__ import annotations

import torch

# The chunk length of ``chunk_gated_delta_rule`` when none is given (flash-linear-attention's kernels use 64).
CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, the normalisation the kernels apply to q and k."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """(B, T, H, *) inputs as (B, H, T, *) in the compute dtype, q scaled, k and q normalised if asked."""
    cdtype = torch.promote_types(v.dtype, torch.float32)
    hv = v.shape[2]
    if q.shape[2] != hv:
        if hv % q.shape[2]:
            raise ValueError(f"v's {hv} heads are not a multiple of q/k's {q.shape[2]} heads")
        q, k = (t.repeat_interleave(hv // q.shape[2], dim=2) for t in (q, k))
    q, k, v = (t.transpose(1, 2).to(cdtype) for t in (q, k, v))
    g, beta = (t.transpose(1, 2).to(cdtype) for t in (g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta, cdtype


def _dense(q, k, v, g, beta, S, chunk_size: int):
    """The chunked form on (B, H, T, *) prepared tensors from the state S (B, H, K, V): (o, S_end)."""
    if g.dim() == 4:
        return _dense_per_channel(q, k, v, g, beta, S, chunk_size)
    T = q.shape[2]
    outs = []
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        qc, kc, vc, gc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
        C = qc.shape[2]
        G = gc.cumsum(-1)  # (B, H, C)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf"))
        decay = diff.exp()  # exp(G_t - G_j) for j <= t, 0 above the diagonal
        strict = decay * torch.ones(C, C, dtype=q.dtype, device=q.device).tril(-1)
        system = torch.eye(C, dtype=q.dtype, device=q.device) + bc[..., None] * strict * (kc @ kc.transpose(-1, -2))
        rhs = torch.cat([bc[..., None] * vc, bc[..., None] * G.exp()[..., None] * kc], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        w = solved[..., : vc.shape[-1]] - solved[..., vc.shape[-1] :] @ S  # (B, H, C, V)
        attn = (qc @ kc.transpose(-1, -2)) * decay
        outs.append(G.exp()[..., None] * (qc @ S) + attn @ w)
        tail = (G[..., -1:] - G).exp()[..., None] * kc  # (B, H, C, K)
        S = G[..., -1].exp()[..., None, None] * S + tail.transpose(-1, -2) @ w
    return torch.cat(outs, dim=2), S


def _dense_per_channel(q, k, v, g, beta, S, chunk_size: int):
    """``_dense`` with a gate per key channel, g (B, H, T, K) (the module docstring's KDA form)."""
    T = q.shape[2]
    outs = []
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        qc, kc, vc, gc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl]
        C = qc.shape[2]
        G = gc.cumsum(2)  # (B, H, C, K)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf"))
        decay = diff.exp()  # (B, H, C, C, K): exp(G_tc - G_jc) for j <= t, 0 above the diagonal
        kk = (kc[..., :, None, :] * kc[..., None, :, :] * decay).sum(-1)  # sum_c k_tc k_jc exp(G_tc - G_jc)
        system = torch.eye(C, dtype=q.dtype, device=q.device) + bc[..., None] * kk.tril(-1)
        rhs = torch.cat([bc[..., None] * vc, bc[..., None] * G.exp() * kc], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        w = solved[..., : vc.shape[-1]] - solved[..., vc.shape[-1] :] @ S  # (B, H, C, V)
        attn = (qc[..., :, None, :] * kc[..., None, :, :] * decay).sum(-1)
        outs.append((G.exp() * qc) @ S + attn @ w)
        tail = (G[..., -1:, :] - G).exp() * kc  # (B, H, C, K)
        S = G[..., -1, :].exp()[..., None] * S + tail.transpose(-1, -2) @ w
    return torch.cat(outs, dim=2), S


def _sequences(cu_seqlens, T: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, T)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def _run(step, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel):
    """Shared by both forms: checks, the packed rows' sequences, dtypes. step(q, k, v, g, beta, S) -> (o, S)."""
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens describes one packed row (batch 1), got batch {q.shape[0]}")
    out_dtype = v.dtype
    q, k, v, g, beta, cdtype = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, H, T, K = k.shape
    V = v.shape[-1]
    spans = _sequences(cu_seqlens, T)
    n = B if cu_seqlens is None else len(spans)
    if initial_state is not None and tuple(initial_state.shape) != (n, H, K, V):
        raise ValueError(f"initial_state must have shape {(n, H, K, V)}, got {tuple(initial_state.shape)}")
    outs, finals = [], []
    for i, (a, b) in enumerate(spans):
        rows = slice(None) if cu_seqlens is None else slice(0, 1)
        if initial_state is None:
            S = torch.zeros(B if cu_seqlens is None else 1, H, K, V, dtype=cdtype, device=v.device)
        else:
            S = initial_state.to(cdtype) if cu_seqlens is None else initial_state[i : i + 1].to(cdtype)
        o, S = step(q[rows, :, a:b], k[rows, :, a:b], v[rows, :, a:b], g[rows, :, a:b], beta[rows, :, a:b], S)
        outs.append(o)
        finals.append(S)
    o = torch.cat(outs, dim=2).transpose(1, 2).to(out_dtype)
    return o, (torch.cat(finals) if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size: int | None = None):  # fmt: skip
    """flash-linear-attention's ``chunk_gated_delta_rule`` in plain PyTorch (module docstring).

    q, k: (B, T, Hk, K); v: (B, T, H, V); g (log decays, <= 0): (B, T, H), or (B, T, H, K) for a gate per key
    channel (KDA: flash-linear-attention's ``chunk_kda`` contract); beta: (B, T, H); initial_state: (N, H, K, V)
    with N = B, or the number of sequences of ``cu_seqlens`` (batch 1). Returns o (B, T, H, V) in v's dtype and
    the final states (N, H, K, V) in fp32 (fp64 for fp64 input), or None. Differentiable by autograd. chunk_size:
    tokens per chunk (None: ``CHUNK_SIZE``).
    """

    size = CHUNK_SIZE if chunk_size is None else chunk_size

    def step(q, k, v, g, beta, S):
        return _dense(q, k, v, g, beta, S, size)

    return _run(step, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False):  # fmt: skip
    """The recurrence token by token (same arguments and results as ``chunk_gated_delta_rule``)."""

    def step(q, k, v, g, beta, S):
        outs = []
        for t in range(q.shape[2]):
            kt = k[:, :, t]
            if g.dim() == 4:  # a gate per key channel (KDA): Diag(alpha_t) first, then the delta update
                S = g[:, :, t].exp()[..., :, None] * S
                S = S + beta[:, :, t, None, None] * kt[..., :, None] * (v[:, :, t, None, :] - kt[..., None, :] @ S)
                outs.append((q[:, :, t, None, :] @ S)[..., 0, :])
                continue
            S = g[:, :, t].exp()[..., None, None] * (S - beta[:, :, t, None, None] * kt[..., :, None]
                                                     * (kt[..., None, :] @ S))  # fmt: skip
            S = S + beta[:, :, t, None, None] * kt[..., :, None] * v[:, :, t, None, :]
            outs.append((q[:, :, t, None, :] @ S)[..., 0, :])
        return torch.stack(outs, dim=2), S

    return _run(step, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)
