"""Bytes each rank sends per Mamba2 layer (forward + backward), by mode, from the sizes alone.

Collectives are counted as ring algorithms do: an all-gather of a p-byte piece sends (cp-1)*p
bytes per rank; an all-to-all of a b-byte buffer sends (cp-1)/cp*b.
"""

from __future__ import annotations

import torch


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_passing_bytes(*, batch, local_seqlen, nheads, headdim, ngroups, dstate, d_conv, cp, dtype,
                        load_balancing="none", return_final_states=False) -> int:  # fmt: skip
    """Halo all-gather and its gradient (input dtype), summary and state-gradient all-gathers (fp32).

    Independent of ``local_seqlen`` except under the permute modes, which also move activations.
    """
    nlocal = 2 if load_balancing == "virtual" else 1
    conv_dim = nheads * headdim + 2 * ngroups * dstate
    halo = nlocal * batch * (d_conv - 1) * conv_dim * _itemsize(dtype)
    state = nlocal * batch * nheads * headdim * dstate * 4
    summary = state + nlocal * batch * nheads * 4
    grad = state * (2 if return_final_states else 1)
    total = (cp - 1) * (2 * halo + summary + grad)
    if load_balancing in ("permute_p2p", "permute_a2a"):
        # zigzag -> contiguous and back, forward and backward, of the in_proj output and the output
        d_in_proj = 2 * nheads * headdim + 2 * ngroups * dstate + nheads
        moved = batch * local_seqlen * (d_in_proj + nheads * headdim) * _itemsize(dtype)
        total += 2 * moved * (cp - 1) // cp
    return int(total)


def ulysses_bytes(*, batch, local_seqlen, nheads, headdim, ngroups, dstate, cp, dtype) -> int:
    """All-to-all of z, xBC, dt there (B and C replicated when cp > ngroups) and of y back,
    forward and backward."""
    bc = 2 * dstate * max(ngroups, cp)
    there = batch * local_seqlen * (2 * nheads * headdim + bc + nheads)
    back = batch * local_seqlen * nheads * headdim
    return int(2 * (there + back) * _itemsize(dtype) * (cp - 1) // cp)
