"""The segment protocol both backends implement, and how its generators are driven.

A backend's ``segment_fwd`` / ``segment_bwd`` are generators that stop where their segment's summary must
travel, so that the caller decides where it goes (another rank, the next tile, nowhere):

    forward   out, y = drive_fwd(segment_fwd(...), post)
                  segment_fwd yields (S_ext, log_a) -> post(S_ext, log_a) returns a handle
                  -> segment_fwd overlaps what needs no incoming state, waits for S_in, returns (out, y)
    backward  grads, dhalo = drive_bwd(segment_bwd(...), post_grad, post_halo_grad)
                  segment_bwd yields L -> post_grad(L) returns a handle to dS_out
                  -> segment_bwd yields the halo's gradient -> post_halo_grad(dhalo) (the caller's
                  return of it to the previous segment overlaps the backend's last kernels)
                  -> segment_bwd returns the other gradients

A handle is anything with ``wait()``. ``LocalExchange`` is a lone segment's exchange (nothing communicated).
Where the incoming state is known before the segment starts (a group of one, its tiles, a block tile), the
generators run without a summary ("known mode"):

    forward   out, y, S_out = run_fwd_known(segment_fwd(..., S_in=S_in))
                  segment_fwd yields nothing and returns the state after the segment too (fp32 or wider)
    backward  grads, dS_in, dhalo = run_bwd_known(segment_bwd(..., dS_out=dS_out), post_halo_grad)
                  segment_bwd yields only the halo's gradient and returns the gradient reaching S_in last

so that a backend can skip what only the exchange needs (the Triton backend's folds).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Ready:
    """A handle whose value is already there."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


def finish(gen, value):
    """Sends ``value`` into a segment generator that must end there; its return value."""
    try:
        gen.send(value)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a segment generator yielded more often than the segment protocol allows")


def drive_fwd(gen, post):
    """Runs a ``segment_fwd`` generator; ``post(S_ext, log_a)`` returns a handle to S_in. -> (out, y)."""
    S_ext, log_a = next(gen)
    return finish(gen, post(S_ext, log_a))


def drive_bwd(gen, post_grad, post_halo_grad=None):
    """Runs a ``segment_bwd`` generator. ``post_grad(L)`` returns a handle to dS_out;
    ``post_halo_grad(dhalo)`` (called when there is a halo) returns whatever the caller wants back
    for it. Returns (the remaining gradients, post_halo_grad's result or the raw dhalo)."""
    L = next(gen)
    dhalo = gen.send(post_grad(L))
    if dhalo is not None and post_halo_grad is not None:
        dhalo = post_halo_grad(dhalo)
    return finish(gen, None), dhalo


def state_dtype(zxbcdt) -> torch.dtype:
    """The dtype of the states a backend carries for ``zxbcdt``: fp32, or wider for wider inputs (fp64)."""
    return torch.promote_types(zxbcdt.dtype, torch.float32)


def zero_state(zxbcdt, spec) -> torch.Tensor:
    """A zero incoming state (batch, nheads, headdim, dstate) for the rows of ``zxbcdt``."""
    return torch.zeros(zxbcdt.shape[0], spec.nheads, spec.headdim, spec.dstate, dtype=state_dtype(zxbcdt),
                       device=zxbcdt.device)  # fmt: skip


def run_fwd_known(gen):
    """Runs a ``segment_fwd`` generator started with ``S_in=``: it yields nothing. -> (out, y, S_out)."""
    try:
        next(gen)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a segment generator in known mode (S_in given) yielded a summary")


def run_bwd_known(gen, post_halo_grad=None):
    """Runs a ``segment_bwd`` generator started with ``dS_out=``: it yields the halo's gradient once.
    -> (the gradients, dS_in, post_halo_grad's result or the raw dhalo)."""
    dhalo = next(gen)
    if dhalo is not None and post_halo_grad is not None:
        dhalo = post_halo_grad(dhalo)
    *grads, dS_in = finish(gen, None)
    return grads, dS_in, dhalo


class LocalExchange:
    """The exchange of a single segment on one device: S_in is the initial state (or zero). After forward,
    ``final_states`` holds the state after the segment; set ``dfinal_states`` before backward, after which
    ``dinitial_states`` holds the gradient of the initial state."""

    def __init__(self, initial_states=None, dfinal_states=None):
        self.initial_states = initial_states
        self.dfinal_states = dfinal_states
        self.final_states = None
        self.dinitial_states = None
        self._log_a = None

    def post(self, S_ext, log_a):
        self._log_a = log_a
        S_in = torch.zeros_like(S_ext) if self.initial_states is None else self.initial_states.to(S_ext.dtype)
        self.final_states = torch.exp(log_a)[:, :, None, None] * S_in + S_ext
        return Ready(S_in)

    def post_grad(self, L):
        dS_out = torch.zeros_like(L) if self.dfinal_states is None else self.dfinal_states.to(L.dtype)
        self.dinitial_states = L + torch.exp(self._log_a)[:, :, None, None].to(L.dtype) * dS_out
        return Ready(dS_out)


# -- document labels of packed rows, as every segment sees them (docs/design.md, "Packed rows") --


def canonical_seq_idx(seq_idx):
    """Document labels renumbered per row from 0 (the row's first document), +1 at each change.

    seq_idx: (batch, seqlen) non-decreasing labels. The kernels apply initial states to label 0 only, so every
    call into them takes this form. Returns int32 on the same device.
    """
    change = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    # the first label from seq_idx itself: change[:, :1] is empty for a one-token row
    first = torch.zeros_like(seq_idx[:, :1], dtype=torch.int32)
    return torch.cat([first, change.cumsum(dim=1, dtype=torch.int32)], dim=1)


class Candidate(NamedTuple):
    """A place where a document may end: ``row`` of the packed segment rows (batch*nlocal, see
    ``layout.pack_segments``), ``batch`` and ``segment`` (global causal index) of that row, the end ``end``
    (exclusive, in the segment's positions), the ``label`` of the document ending there, and whether ``end``
    is the segment's own end (a real end only if the next segment of the row starts another document)."""

    row: int
    batch: int
    segment: int
    end: int
    label: int
    at_segment_end: bool


def starts(labels: torch.Tensor) -> list[set[int]]:
    """Per row of (rows, m) labels, the positions 0 < e < m where a new document starts (one host read)."""
    found: list[set[int]] = [set() for _ in range(labels.shape[0])]
    for row, pos in (labels[:, 1:] != labels[:, :-1]).nonzero().tolist():
        found[row].add(pos + 1)
    return found


def candidates(labels: torch.Tensor, segment_ids: list[int]) -> list[Candidate]:
    """The candidate ends of a rank's packed segment rows. labels: (batch*nlocal, m) raw labels (row
    i*nlocal + k is batch i's local segment k, whose global causal index is ``segment_ids[k]``)."""
    nlocal, m = len(segment_ids), labels.shape[1]
    last = labels[:, -1].tolist()
    found = []
    for row, cuts in enumerate(starts(labels)):
        batch, k = divmod(row, nlocal)
        ends = sorted(cuts)
        before = labels[row, [e - 1 for e in ends]].tolist() if ends else []
        found += [Candidate(row, batch, segment_ids[k], e, int(lab), False) for e, lab in zip(ends, before)]
        found.append(Candidate(row, batch, segment_ids[k], m, int(last[row]), True))
    return found
