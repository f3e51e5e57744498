"""The summary exchange of the state-passing strategy: how every segment gets the state entering it (forward)
and the gradient reaching its outgoing state (backward). Two methods, the ``summary_exchange`` option:

    allgather   every rank all-gathers every segment's summary (S_ext, log_a), one collective, and scans them
                locally (``scan.exclusive_scan``); per layer and direction a rank receives nseg summaries
    scan        a log-depth exclusive scan of the affine summaries (Hillis-Steele): round k (k = 0, 1, ...,
                ceil(log2 nseg) - 1), segment p sends its running aggregate of segments (p - 2^k, p] to segment
                p + 2^k, which composes it in front of its own; after the last round every segment holds the
                composition of all segments before it. A segment receives at most one summary per round:
                ceil(log2 nseg) in all. The state after the last segment (final_states) is broadcast from its
                rank when it is asked for.
    auto        the cheaper of the two by the cost model (``traffic.summary_exchange_cost``)

Backward is the mirror image in both: the L's (the gradient each segment sends to its incoming state when its
outgoing one receives none) with the same decays, composed from the last segment down (a reverse scan); the
gradients reaching the copies of final_states on the ranks are summed first (an all-reduce of one summary).

The algebra (docs/design.md, "The algebra"): a summary is an affine map S_out = exp(a) S_in + S; two consecutive
ones compose as (S1, a1) then (S2, a2) = (exp(a2) S1 + S2, a1 + a2), in fp32 (fp64 for fp64 input). a = -inf (a
segment that holds or begins a document start) stays finite through exp and sums: the chain is cut there.
That is Mamba2's summary type; both methods take any type of ``summary.py`` (``kind``: how to compose, apply,
transpose and cut summaries), e.g. the gated delta rule's (U, M) with S_out = M S_in + U.

``rounds`` is the schedule as a plain function (which segment sends to which in each round) and
``simulate_exclusive_scan`` runs it in one process; the distributed ``ScanExchange`` follows the same schedule
with point-to-point messages (``comm.post_p2p``: NCCL sends CUDA tensors directly; gloo moves CUDA tensors
through the host, its point-to-point takes CPU tensors only). Nothing reads a tensor value on the host.
"""

from __future__ import annotations

import math

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import layout, scan, summary
from ds_mamba_spcp.engine.summary import DECAY

ALLGATHER, SCAN, AUTO = "allgather", "scan", "auto"
SUMMARY_EXCHANGES = (ALLGATHER, SCAN, AUTO)


# ---------------------------------------------------------------------------------------------
# the schedule, and the scan it runs, in one process
# ---------------------------------------------------------------------------------------------


def rounds(nseg: int) -> list[list[tuple[int, int]]]:
    """The log-depth scan's messages: round k is the list of (sender, receiver) segments, receiver = sender + 2^k,
    for ceil(log2 nseg) rounds (none for a lone segment)."""
    out, step = [], 1
    while step < nseg:
        out.append([(p, p + step) for p in range(nseg - step)])
        step *= 2
    return out


_rounds = rounds


def compose(early, late):
    """The summary of two consecutive runs of segments: ``early`` then ``late``, each (S (..., h, p, n), a (..., h))."""
    return DECAY.compose(early, late)


def simulate_exclusive_scan(S_ext, log_a, initial_states=None, rounds=None):
    """The schedule (``rounds(nseg)``, or the one given) run in one process: (S_in (nseg, ...), final_states), what
    ``scan.exclusive_scan`` returns, each segment holding only what its messages brought it (each round's
    messages carry the senders' values from before the round). S_ext: (nseg, b, h, p, n); log_a: (nseg, b, h).
    The zero summary (0, 0) is the identity of ``compose``."""
    schedule = _rounds(S_ext.shape[0]) if rounds is None else rounds
    running = [S_ext.clone(), log_a.clone()]  # segments (p - 2^k, p] after round k
    before = [torch.zeros_like(S_ext), torch.zeros_like(log_a)]  # segments [0, p): every message p received
    for messages in schedule:
        src = torch.tensor([m[0] for m in messages], dtype=torch.long)
        dst = torch.tensor([m[1] for m in messages], dtype=torch.long)
        got = (running[0][src], running[1][src])
        for acc in (running, before):
            acc[0][dst], acc[1][dst] = compose(got, (acc[0][dst], acc[1][dst]))
    init = torch.zeros_like(S_ext[0]) if initial_states is None else initial_states.to(S_ext.dtype)
    return _enter(before, init), _enter((running[0][-1], running[1][-1]), init)


def _enter(summary, state):
    """The state after a run of segments, given the state before it."""
    return DECAY.enter(summary, state)


# ---------------------------------------------------------------------------------------------
# the distributed scan
# ---------------------------------------------------------------------------------------------


def _owners(cp: int, chain: str) -> dict[int, int]:
    """Global segment index -> the group rank that holds it."""
    return {s: r for r in range(cp) for s in layout.segment_ids(r, cp, chain)}


class _Scan:
    """One exclusive scan over the group's segments, from this rank's local ones: ``post`` sends round 0,
    ``wait`` finishes the rounds. Elements are summaries of type ``kind`` ((S (b, h, p, n), a (b, h)) for DECAY) per
    local segment, in local order."""

    def __init__(self, plan, elements, reverse: bool, kind=DECAY):
        self.plan, self.kind = plan, kind
        self.nseg = plan.cp * plan.nlocal
        owners = _owners(plan.cp, plan.layout)
        # positions along the scan: causal order, or reversed for the backward's scan
        self.pos = {s: (self.nseg - 1 - s if reverse else s) for s in owners}
        self.owner_of_pos = {self.pos[s]: r for s, r in owners.items()}
        self.local = [self.pos[s] for s in plan.local_ids]  # this rank's positions, in local order
        self.running = dict(zip(self.local, elements))
        self.before = dict.fromkeys(self.local)
        self.schedule = rounds(self.nseg)
        self.shape = elements[0][0].shape  # (b, h, p, n)
        self.lin_shape = elements[0][1].shape  # (b, h) for DECAY
        self.round, self.handle = 0, None
        if self.schedule:
            self.handle = self._post(0)

    def _post(self, k):
        mine = set(self.local)
        sends, recvs, self.local_moves = {}, {}, []
        for src, dst in self.schedule[k]:
            if src in mine and dst in mine:
                self.local_moves.append((src, dst))
            elif src in mine:
                sends.setdefault(self.owner_of_pos[dst], []).append(src)
            elif dst in mine:
                recvs.setdefault(self.owner_of_pos[src], []).append(dst)
        payloads = [(self._pack([self.running[p] for p in ps]), peer) for peer, ps in sorted(sends.items())]
        self.expect = sorted(recvs.items())  # (peer, receiving positions, ascending: the senders' order too)
        like = self._pack([self.running[self.local[0]]])[0]
        shapes = [((len(ps), *like.shape), peer) for peer, ps in self.expect]
        # the local sends' values are taken before any update of this round
        self.local_values = [(dst, self.running[src]) for src, dst in self.local_moves]
        return comm.post_p2p(payloads, shapes, like, self.plan.group)

    def _pack(self, items):
        return self.kind.pack(items)  # (n, b, width)

    def _unpack(self, rows):
        return self.kind.unpack(rows, self.shape, self.lin_shape)

    def _receive(self, dst, got):
        compose = self.kind.compose
        self.running[dst] = compose(got, self.running[dst])
        self.before[dst] = got if self.before[dst] is None else compose(got, self.before[dst])

    def wait(self):
        """Finishes every round: (the composition of all segments before each local one (None for the first),
        in local order; the composition of all segments up to the last position, on its rank, else None)."""
        while self.handle is not None:
            received = self.handle.wait()
            for dst, got in self.local_values:
                self._receive(dst, got)
            for (_, positions), rows in zip(self.expect, received):
                for dst, got in zip(positions, self._unpack(rows)):
                    self._receive(dst, got)
            self.round += 1
            self.handle = self._post(self.round) if self.round < len(self.schedule) else None
        last = self.running.get(self.nseg - 1)
        return [self.before[p] for p in self.local], last

    @property
    def last_owner(self) -> int:
        return self.owner_of_pos[self.nseg - 1]


class _Exchange:
    """What both methods share: this rank's local segments sit on the batch axis (row i*nlocal + k is batch
    element i's local segment k, ``layout.pack_segments``); ``post(S_ext, log_a)`` -> a handle to this rank's
    S_in rows, ``post_grad(L)`` -> a handle to its dS_out rows, and ``final_states`` / ``dinitial_states`` /
    ``log_a_all`` after them. start0: (b*nlocal,) bool, the segments that begin a document, or None. kind: the
    summary type (``summary.py``); for another than DECAY, ``post``'s (S_ext, log_a) are its (off, lin) and
    ``log_a_all`` holds the linear parts."""

    def __init__(self, plan, batch: int, initial_states=None, log_a_all=None, dfinal_states=None, start0=None,
                 kind=DECAY):  # fmt: skip
        self.plan, self.batch, self.kind = plan, batch, kind
        self.initial_states, self.log_a_all, self.dfinal_states, self.start0 = (
            initial_states,
            log_a_all,
            dfinal_states,
            start0,
        )
        self.S_in = self.final_states = self.dinitial_states = None

    def _keep(self, t):
        """Zeroes what reaches a segment that begins a document (the incoming state stops there)."""
        return t if self.start0 is None else t * (~self.start0).to(t.dtype)[:, None, None, None]


class AllGatherExchange(_Exchange):
    """The ``allgather`` method: every segment's summary to every rank in one all-gather, then the local scan
    (``scan.exclusive_scan``); ``log_a_all`` keeps every segment's decays (nseg, b, h) for the backward's reverse
    scan. With ranks only (a group of one runs in known mode)."""

    def post(self, S_ext, log_a):
        """S_ext (b*nlocal, h, p, n), log_a (b*nlocal, h), both fp32 or wider."""
        cdtype = torch.promote_types(S_ext.dtype, torch.float32)
        S_ext, log_a = S_ext.to(cdtype), log_a.to(cdtype)
        if self.start0 is not None:
            log_a = self.kind.cut(log_a, self.start0)
        numel = S_ext[0].numel()
        packed = torch.cat([S_ext.flatten(1), log_a.flatten(1)], dim=1)  # one buffer, one collective
        handle = self.plan.gather_ordered(self.plan.split(packed))
        shapes = (S_ext.shape[1:], log_a.shape[1:])
        return _Deferred(lambda: self._finish_fwd(handle.wait(), numel, shapes, cdtype))

    def _finish_fwd(self, rows, numel, shapes, cdtype):
        state_shape, lin_shape = shapes
        S_ext_all = rows[..., :numel].reshape(*rows.shape[:2], *state_shape)
        # only the decays (linear parts) outlive the gathered buffer
        self.log_a_all = rows[..., numel:].reshape(*rows.shape[:2], *lin_shape).clone()
        init = None if self.initial_states is None else self.initial_states.to(cdtype)
        if self.kind is DECAY:
            S_in, self.final_states = scan.exclusive_scan(S_ext_all, self.log_a_all, init, rows=self.plan.local_ids)
        else:
            S_in, self.final_states = summary.exclusive_scan(self.kind, S_ext_all, self.log_a_all, init,
                                                             rows=self.plan.local_ids)  # fmt: skip
        # its own buffer: a view would keep the scan's whole output (final_states too) alive until backward
        self.S_in = self._keep(layout.segments_to_rows(S_in).clone())
        return self.S_in

    def post_grad(self, L):
        """L (b*nlocal, h, p, n): gradient reaching the incoming states from this rank's outputs."""
        cdtype = torch.promote_types(L.dtype, torch.float32)
        L = self.plan.split(self._keep(L.to(cdtype)))
        if self.dfinal_states is not None:
            # final_states is returned on every rank: the gradients that reach its copies add up
            extra = torch.zeros_like(L)
            extra[0] = self.dfinal_states.to(cdtype)  # once per rank, on its first local segment
            L = torch.cat([L, extra], dim=1)
        handle = self.plan.gather_ordered(L)
        return _Deferred(lambda: self._finish_bwd(handle.wait()))

    def _finish_bwd(self, rows):
        dfinal = None
        if self.dfinal_states is not None:
            rows, extra = rows[:, : self.batch], rows[:, self.batch :]
            dfinal = extra.sum(dim=0)
        if self.kind is DECAY:
            dS_out, self.dinitial_states = scan.reverse_scan(
                rows, self.log_a_all.to(rows.dtype), dfinal, rows=self.plan.local_ids
            )
        else:
            dS_out, self.dinitial_states = summary.reverse_scan(
                self.kind, rows, self.log_a_all.to(rows.dtype), dfinal, rows=self.plan.local_ids
            )
        return layout.segments_to_rows(dS_out)


class ScanExchange(_Exchange):
    """The ``scan`` method. ``log_a_all`` holds this rank's segments' decays only ((nlocal, b, h), the -inf of
    document starts applied): the backward's scan carries the others' in its messages. ``need_final``: broadcast
    the state after the last segment (asked for by return_final_states)."""

    def __init__(self, plan, batch: int, need_final: bool = True, **kwargs):
        super().__init__(plan, batch, **kwargs)
        self.need_final = need_final
        self.scan = None  # the last _Scan

    def post(self, S_ext, log_a):
        cdtype = torch.promote_types(S_ext.dtype, torch.float32)
        S_ext, log_a = S_ext.to(cdtype), log_a.to(cdtype)
        if self.start0 is not None:
            log_a = self.kind.cut(log_a, self.start0)
        S_local, a_local = self.plan.split(S_ext), self.plan.split(log_a)  # (nlocal, b, ...)
        self.log_a_all = a_local
        self.scan = _Scan(self.plan, list(zip(S_local, a_local)), reverse=False, kind=self.kind)
        return _Deferred(lambda: self._finish_fwd(cdtype))

    def _finish_fwd(self, cdtype):
        before, last = self.scan.wait()
        shape = self.scan.shape
        init = torch.zeros(shape, dtype=cdtype, device=self.log_a_all.device)
        if self.initial_states is not None:
            init = self.initial_states.to(cdtype)
        enter = self.kind.enter
        S_in = torch.stack([init if b is None else enter(b, init) for b in before])  # (nlocal, b, h, p, n)
        self.S_in = self._keep(layout.segments_to_rows(S_in))
        if self.need_final:
            final = enter(last, init) if last is not None else torch.empty_like(init)
            self.final_states = comm.broadcast(final, self.scan.last_owner, self.plan.group)
        return self.S_in

    def post_grad(self, L):
        cdtype = torch.promote_types(L.dtype, torch.float32)
        L = self.plan.split(self._keep(L.to(cdtype)))
        self.dfinal = None
        if self.dfinal_states is not None:  # final_states was returned on every rank: the gradients add up
            self.dfinal = comm.all_reduce_sum(self.dfinal_states.to(cdtype), self.plan.group)
        a = self.log_a_all.to(cdtype)
        self.scan = _Scan(self.plan, [self.kind.adjoint(lin, g) for g, lin in zip(L, a)], reverse=True, kind=self.kind)
        return _Deferred(self._finish_bwd)

    def _finish_bwd(self):
        after, total = self.scan.wait()  # the segments after each local one, composed; all of them (segment 0's rank)
        zero = torch.zeros(self.scan.shape, dtype=self.log_a_all.dtype, device=self.log_a_all.device)
        dfinal = zero if self.dfinal is None else self.dfinal
        enter = self.kind.enter
        dS_out = torch.stack([dfinal if x is None else enter(x, dfinal) for x in after])
        self.dinitial_states = enter(total, dfinal) if total is not None else torch.zeros_like(dfinal)
        return layout.segments_to_rows(dS_out)


class _Deferred:
    def __init__(self, fn):
        self.fn = fn

    def wait(self):
        return self.fn()


def summaries_moved(cp: int, chain: str, method: str, reverse: bool = False) -> tuple[dict, dict]:
    """Summaries each group rank sends and receives per layer and direction (``reverse``: the backward's), from the
    schedule alone: ({rank: sent}, {rank: received}). The all-gather's ring forwards and receives cp - 1 pieces of
    nlocal summaries; the scan moves what its schedule says (a summary between two segments of one rank, under
    ``virtual``, stays local)."""
    nlocal = len(layout.segment_ids(0, cp, chain))
    if method == ALLGATHER:
        each = {r: (cp - 1) * nlocal for r in range(cp)}
        return each, dict(each)
    nseg = cp * nlocal
    owners = _owners(cp, chain)
    at = (lambda p: owners[nseg - 1 - p]) if reverse else owners.__getitem__  # the backward scans from the end
    sent, got = dict.fromkeys(range(cp), 0), dict.fromkeys(range(cp), 0)
    for messages in rounds(nseg):
        for src, dst in messages:
            if at(src) != at(dst):
                sent[at(src)] += 1
                got[at(dst)] += 1
    return sent, got


def rounds_needed(nseg: int) -> int:
    return math.ceil(math.log2(nseg)) if nseg > 1 else 0
