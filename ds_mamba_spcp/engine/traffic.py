"""Bytes each rank sends per Mamba2 layer (forward + backward), by entry of the table of modes, from the sizes alone.

Collectives are counted as ring algorithms do: an all-gather of a p-byte piece sends (cp-1)*p
bytes per rank; an all-to-all of a b-byte buffer sends (cp-1)/cp*b.
"""

from __future__ import annotations

import torch

from ds_mamba_spcp.engine import modes


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_bytes(entry: modes.Entry, *, batch, local_seqlen, nheads, headdim, ngroups, dstate, d_conv, cp, dtype,
                return_final_states=False) -> int:  # fmt: skip
    """What ``entry`` sends per rank and layer. State passing: the halo all-gather and its gradient (input
    dtype), the summary and state-gradient all-gathers (fp32), independent of ``local_seqlen`` unless the
    entry moves activations (``entry.move``). Ulysses: the all-to-all of z, xBC, dt there (B and C replicated
    when cp > ngroups) and of y back, forward and backward."""
    item = _itemsize(dtype)
    if entry.strategy == modes.ULYSSES:
        bc = 2 * dstate * max(ngroups, cp)
        there = batch * local_seqlen * (2 * nheads * headdim + bc + nheads)
        back = batch * local_seqlen * nheads * headdim
        return int(2 * (there + back) * item * (cp - 1) // cp)
    nlocal = entry.segments_per_rank
    conv_dim = nheads * headdim + 2 * ngroups * dstate
    halo = nlocal * batch * (d_conv - 1) * conv_dim * item
    state = nlocal * batch * nheads * headdim * dstate * 4
    summary = state + nlocal * batch * nheads * 4
    grad = state * (2 if return_final_states else 1)
    total = (cp - 1) * (2 * halo + summary + grad)
    if entry.move is not None:
        # zigzag -> contiguous and back, forward and backward, of the in_proj output and the output
        d_in_proj = 2 * nheads * headdim + 2 * ngroups * dstate + nheads
        moved = batch * local_seqlen * (d_in_proj + nheads * headdim) * item
        total += 2 * moved * (cp - 1) // cp
    return int(total)


def state_passing_bytes(*, load_balancing=modes.NONE, d_conv, return_final_states=False, **sizes) -> int:
    """``layer_bytes`` of the state-passing entry with this load balancing (sizes as ``layer_bytes``)."""
    entry = modes.entry(modes.STATE_PASSING, load_balancing)
    return layer_bytes(entry, d_conv=d_conv, return_final_states=return_final_states, **sizes)


def ulysses_bytes(**sizes) -> int:
    """``layer_bytes`` of the ulysses entry (sizes as ``layer_bytes``, without d_conv)."""
    return layer_bytes(modes.entry(modes.ULYSSES), d_conv=1, **sizes)
