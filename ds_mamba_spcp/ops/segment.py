"""The segment protocol both backends implement, and how its generators are driven.

A backend's ``segment_fwd`` / ``segment_bwd`` are generators that stop where the summary of their
causal segment must travel, so that the caller decides where it goes (another rank, the next tile
of the same shard, nowhere) and the backend's code still reads "post, compute, wait":

    forward   out, y = drive_fwd(segment_fwd(...), post)
                  segment_fwd yields (S_ext, log_a) -> post(S_ext, log_a) returns a handle
                  -> segment_fwd overlaps what needs no incoming state, waits for S_in, returns (out, y)
    backward  grads, dhalo = drive_bwd(segment_bwd(...), post_grad, post_halo_grad)
                  segment_bwd yields L -> post_grad(L) returns a handle to dS_out
                  -> segment_bwd yields the halo's gradient -> post_halo_grad(dhalo) (the caller's
                  return of it to the previous segment overlaps the backend's last kernels)
                  -> segment_bwd returns the other gradients

A handle is anything with ``wait()``. ``LocalExchange`` is the exchange of a lone segment: the
initial state comes in, the final state goes out, nothing is communicated.

Where the incoming state is known before the segment starts (a group of one, each tile of its chain, a
block tile), the generators run without a summary ("known mode"):

    forward   out, y, S_out = run_fwd_known(segment_fwd(..., S_in=S_in))
                  segment_fwd yields nothing and returns the state after the segment too (fp32 or wider)
    backward  grads, dS_in, dhalo = run_bwd_known(segment_bwd(..., dS_out=dS_out), post_halo_grad)
                  segment_bwd yields only the halo's gradient and returns the gradient reaching S_in last

so that a backend can skip what only the exchange needs (the Triton backend: the forward's fold of the
chunk states, and the backward's separate L; dS_in = L + exp(log_a) dS_out comes out of one fold).
"""

from __future__ import annotations

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
    """The exchange of a single segment on one device: S_in is the initial state (or zero).

    After forward, ``final_states`` holds the state after the segment; set ``dfinal_states`` before
    backward, after which ``dinitial_states`` holds the gradient of the initial state.
    """

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
