"""The affine summary algebra across causal segments (DESIGN.md section 2), in fp32 or wider.

A segment maps its incoming state as S_out = a * S_in + S_ext, with a = exp(log_a) per
(batch, head). Segments are indexed in causal order along dim 0.
"""

from __future__ import annotations

import torch


def _decay(log_a):
    return torch.exp(log_a)[..., None, None]  # [.., b, h] -> [.., b, h, 1, 1]


def exclusive_scan(S_ext, log_a, initial_states=None):
    """Incoming state of every segment, and the state after the last one.

    S_ext: (nseg, batch, nheads, headdim, dstate); log_a: (nseg, batch, nheads);
    initial_states: the state entering segment 0, or None for zero.
    Returns S_in (nseg, batch, nheads, headdim, dstate) and final_states.
    """
    state = torch.zeros_like(S_ext[0]) if initial_states is None else initial_states.to(S_ext.dtype)
    S_in = []
    for s in range(S_ext.shape[0]):
        S_in.append(state)
        state = _decay(log_a[s]) * state + S_ext[s]
    return torch.stack(S_in), state


def reverse_scan(L, log_a, dfinal_states=None):
    """Gradient reaching each segment's outgoing state, and the one reaching the initial state.

    L: (nseg, batch, nheads, headdim, dstate), the gradient each segment sends to its incoming
    state when its outgoing state receives none; dfinal_states: gradient of the state after the
    last segment (or None). dS_out(s) = sum_{j>s} (prod_{s<k<j} a_k) L(j) + (prod_{k>s} a_k) dfinal.
    """
    grad = torch.zeros_like(L[0]) if dfinal_states is None else dfinal_states.to(L.dtype)
    dS_out = [None] * L.shape[0]
    for s in reversed(range(L.shape[0])):
        dS_out[s] = grad
        grad = L[s] + _decay(log_a[s]).to(L.dtype) * grad
    return torch.stack(dS_out), grad
