"""The summary types the engine's exchange carries: what a causal segment does to the state passed through it.

A segment of any recurrence this package shards is an affine map of its incoming state, S_out = lin(S_in) + off,
so a summary is a pair (off, lin): ``off`` the segment's final state from zero (the state's shape), ``lin`` the
linear part. The exchange (``exchange.py``) and its scan need four things of a type, and nothing of the model:

    compose(early, late)  the summary of two consecutive runs of segments: (lin2 off1 + off2, lin2 lin1)
    enter(summary, S)     the state after the run, given the state S before it: off + lin(S)
    adjoint(summary, L)   the backward's element: the gradient G entering the run from its end maps to the
                          gradient L + lin^T(G) at its start; its scan (from the last segment down) composes these
    cut(lin, start0)      the linear part of a segment that begins a document (packed rows): the chain stops there

plus how to pack a list of summaries into one message buffer and back (``pack`` / ``unpack``).

``DECAY`` is Mamba2's (docs/design.md, "The algebra"): off = S_ext (b, h, p, n), lin = log_a (b, h), a scalar
decay exp(log_a) per head (self-adjoint; a cut is log_a = -inf). Its operations are the exchange's own from
before this module (the same arithmetic, so Mamba2's results are unchanged bit for bit).

``MATRIX`` is the gated delta rule's (docs/design.md, "The gated delta rule"): off = U (b, h, K, V), lin = M
(b, h, K, K), the product of alpha_t (I - beta_t k_t k_t^T) over the segment, later tokens on the left; lin(S) =
M S, the adjoint is M^T, a cut is M = 0. Kimi's KDA (a gate per key channel) has factors (I - beta_t k_t k_t^T)
Diag(alpha_t): M is a general K x K matrix either way, so the type is the same.
"""

from __future__ import annotations

import torch


class DecaySummary:
    """(S (..., h, p, n), log_a (..., h)): S_out = exp(log_a) S_in + S."""

    name = "decay"

    @staticmethod
    def compose(early, late):
        (S1, a1), (S2, a2) = early, late
        return torch.exp(a2)[..., None, None] * S1 + S2, a1 + a2

    @staticmethod
    def enter(summary, state):
        S, a = summary
        return S + torch.exp(a)[..., None, None] * state

    @staticmethod
    def adjoint(lin, L):
        """The backward's element of a segment: (L, the same decay): a scalar per head is its own transpose."""
        return L, lin

    @staticmethod
    def cut(lin, start0):
        return torch.where(start0[:, None], float("-inf"), lin)

    @staticmethod
    def pack(items):
        return torch.stack([torch.cat([S.flatten(1), a], dim=1) for S, a in items])  # (n, b, h*p*n + h)

    @staticmethod
    def unpack(rows, state_shape, lin_shape):
        h = lin_shape[-1]
        return [(r[:, :-h].view(state_shape), r[:, -h:]) for r in rows]


class MatrixSummary:
    """(U (..., h, K, V), M (..., h, K, K)): S_out = M S_in + U."""

    name = "matrix"

    @staticmethod
    def compose(early, late):
        (U1, M1), (U2, M2) = early, late
        return M2 @ U1 + U2, M2 @ M1

    @staticmethod
    def enter(summary, state):
        U, M = summary
        return U + M @ state

    @staticmethod
    def adjoint(lin, L):
        return L, lin.transpose(-1, -2)

    @staticmethod
    def cut(lin, start0):
        return lin * (~start0).to(lin.dtype)[:, None, None, None]

    @staticmethod
    def pack(items):
        return torch.stack([torch.cat([U.flatten(1), M.flatten(1)], dim=1) for U, M in items])

    @staticmethod
    def unpack(rows, state_shape, lin_shape):
        n = state_shape[1:].numel()
        return [(r[:, :n].view(state_shape), r[:, n:].view(lin_shape)) for r in rows]


DECAY, MATRIX = DecaySummary(), MatrixSummary()


def exclusive_scan(kind, offs, lins, initial=None, rows=None):
    """Segment by segment in causal order (any type; ``scan.exclusive_scan`` is DECAY's vectorised twin): the
    state entering each segment of ``rows`` (default all), and the state after the last. offs / lins: (nseg, ...)."""
    n = offs.shape[0]
    rows = list(range(n)) if rows is None else list(rows)
    state = torch.zeros_like(offs[0]) if initial is None else initial.to(offs.dtype)
    entering = []
    for s in range(n):
        entering.append(state)
        state = kind.enter((offs[s], lins[s]), state)
    return torch.stack([entering[r] for r in rows]), state


def reverse_scan(kind, L, lins, dfinal=None, rows=None):
    """The backward's scan (any type; ``scan.reverse_scan`` is DECAY's vectorised twin): the gradient reaching each
    segment's outgoing state for ``rows`` (default all), and the one reaching the state entering segment 0.
    L: (nseg, ...), what each segment's outputs send to its incoming state; lins: (nseg, ...)."""
    n = L.shape[0]
    rows = list(range(n)) if rows is None else list(rows)
    grad = torch.zeros_like(L[0]) if dfinal is None else dfinal.to(L.dtype)
    leaving = [None] * n
    for s in reversed(range(n)):
        leaving[s] = grad
        grad = kind.enter(kind.adjoint(lins[s], L[s]), grad)
    return torch.stack([leaving[r] for r in rows]), grad
