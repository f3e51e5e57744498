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
