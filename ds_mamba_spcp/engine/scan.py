"""The affine summary algebra across causal segments (docs/design.md, "The algebra"), in fp32 or wider.

A segment maps its incoming state as S_out = a * S_in + S_ext, with a = exp(log_a) per
(batch, head); a segment that holds a document start (packed rows) has log_a = -inf, a = 0.
Segments are indexed in causal order along dim 0.

Both scans are one vectorised pass: the weight of segment j's summary in the state entering segment r is
exp(sum_{j<k<r} log_a_k), a masked sum of log-decays (a difference of cumulative sums would turn -inf into
NaN), and one einsum forms the states. ``rows`` picks the outputs a rank needs (O(nseg * nrows) weights).
"""

from __future__ import annotations

import torch


def _window_log_decay(log_a: torch.Tensor) -> torch.Tensor:
    """W[b, h, r, j] = sum_{j<k<r} log_a[k] for j < r, -inf for j >= r.  log_a: (n, b, h) -> (b, h, n+1, n):
    the log-decay of segment j's summary before boundary r (where segment r starts; boundary n is the end)."""
    n = log_a.shape[0]
    la = log_a.permute(1, 2, 0)  # [n, b, h] -> [b, h, n]
    k = torch.arange(n, device=log_a.device)
    r = torch.arange(n + 1, device=log_a.device)
    before = k[None, :] < r[:, None]  # [n+1, n]: segment k lies before boundary r
    x = torch.where(before, la[..., None, :], torch.zeros((), dtype=la.dtype, device=la.device))  # [b, h, n+1, n]
    # suffix[.., r, j] = sum_{j <= k < r} log_a[k]; shifted by one it excludes segment j itself
    suffix = x.flip(-1).cumsum(-1).flip(-1)
    window = torch.cat([suffix[..., 1:], torch.zeros_like(suffix[..., :1])], dim=-1)
    return torch.where(before, window, torch.full((), float("-inf"), dtype=la.dtype, device=la.device))


def exclusive_scan(S_ext, log_a, initial_states=None, rows=None):
    """State entering each segment, and the state after the last one.

    S_ext: (nseg, batch, nheads, headdim, dstate); log_a: (nseg, batch, nheads);
    initial_states: the state entering segment 0, or None for zero.
    rows: the segments whose incoming state is wanted (default: all), as a list of ints.
    Returns S_in (len(rows), batch, nheads, headdim, dstate) and final_states.

    S_in(r) = sum_{j<r} exp(sum_{j<k<r} log_a_k) S_ext(j) + exp(sum_{k<r} log_a_k) initial_states.
    """
    n = S_ext.shape[0]
    rows = list(range(n)) if rows is None else list(rows)
    window = _window_log_decay(log_a)  # [b, h, n+1, n]
    bounds = rows + [n]  # the incoming boundary of each wanted segment, and the end
    weights = torch.exp(window[:, :, bounds])  # [b, h, len(bounds), n]
    states = torch.einsum("bhrj,jbhpn->rbhpn", weights.to(S_ext.dtype), S_ext)
    if initial_states is not None:
        prefix = log_a.permute(1, 2, 0).cumsum(-1)  # [b, h, n]: sum_{k<=i}
        before = torch.cat([torch.zeros_like(prefix[..., :1]), prefix], dim=-1)[:, :, bounds]  # sum_{k<r}
        decay = torch.exp(before).permute(2, 0, 1)[..., None, None].to(S_ext.dtype)  # [len(bounds), b, h, 1, 1]
        states = states + decay * initial_states.to(S_ext.dtype)
    return states[:-1], states[-1]


def reverse_scan(L, log_a, dfinal_states=None, rows=None):
    """Gradient reaching each segment's outgoing state, and the one reaching the initial state.

    L: (nseg, batch, nheads, headdim, dstate), the gradient each segment sends to its incoming
    state when its outgoing state receives none; dfinal_states: gradient of the state after the
    last segment (or None). rows: the segments whose dS_out is wanted (default: all).
    dS_out(s) = sum_{j>s} exp(sum_{s<k<j} log_a_k) L(j) + exp(sum_{k>s} log_a_k) dfinal;
    dinitial = sum_j exp(sum_{k<j} log_a_k) L(j) + exp(sum_k log_a_k) dfinal.
    """
    n = L.shape[0]
    rows = list(range(n)) if rows is None else list(rows)
    # the mirror image: reversed segments, whose boundary n-1-s sits after reversed segment n-1-s
    window = _window_log_decay(log_a.flip(0))  # [b, h, n+1, n] over reversed indices
    bounds = [n - 1 - s for s in rows] + [n]  # boundary after segment s in reversed order; n: before segment 0
    weights = torch.exp(window[:, :, bounds])
    grads = torch.einsum("bhrj,jbhpn->rbhpn", weights.to(L.dtype), L.flip(0))
    if dfinal_states is not None:
        prefix = log_a.flip(0).permute(1, 2, 0).cumsum(-1)
        before = torch.cat([torch.zeros_like(prefix[..., :1]), prefix], dim=-1)[:, :, bounds]
        decay = torch.exp(before).permute(2, 0, 1)[..., None, None].to(L.dtype)
        grads = grads + decay * dfinal_states.to(L.dtype)
    return grads[:-1], grads[-1]
