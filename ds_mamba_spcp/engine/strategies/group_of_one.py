"""The strategy of a group of one rank (and of each rank's full-length scan under ulysses).

The backend's single-device op runs the whole row, unless it is past the kernels' int32 limit or a tile length
is set; then the row runs as one causal segment in tiles (``ops/tiles.py``), with no collective.
"""

from __future__ import annotations

import torch

from ds_mamba_spcp.engine import documents, modes
from ds_mamba_spcp.engine.strategies import state_passing
from ds_mamba_spcp.ops import tiles as tiling


def needs_tiles(call) -> bool:
    """Whether the row must run as tiles: a configured tile length, or more tokens than one call of the
    backend takes."""
    limit = call.backend.max_tokens_per_call(call.spec)
    tokens = call.zxbcdt.shape[0] * call.zxbcdt.shape[1]
    return call.options.tile_length is not None or (limit is not None and tokens > limit)


def run(call):
    """A prepared ``MixerCall`` whose row is whole on this rank (labels: each tile renumbers its own)."""
    if not needs_tiles(call):
        return call.single_device()
    one = call.replace(cp=1, rank=0, group=None)
    return state_passing.run(one.with_options(load_balancing=modes.NONE, input_layout=modes.CONTIGUOUS))


def run_forward_only(call):
    """The forward-only route of a whole row on this rank: the backend's segment from the known incoming state,
    in tiles (``tiles.forward_known``) where needed or where packed rows' documents end; nothing saved.
    Returns out, and with return_final_states the state after each document (``documents.py``): (batch, nheads,
    headdim, dstate) without seq_idx, (ndocs, ...) with it."""
    spec, o = call.spec, call.options
    batch, seqlen = call.zxbcdt.shape[:2]
    limit = call.backend.max_tokens_per_call(spec)
    groups = tiling.forward_groups(batch, seqlen, spec, limit, o.tile_length, call.seq_idx)
    with torch.no_grad():
        out, states = tiling.forward_known(call.backend, groups, call.zxbcdt, None, call.params, spec=spec,
                                           seq_idx=call.seq_idx, initial_states=call.initial_states)  # fmt: skip
        if not o.return_final_states:
            return out
        if call.seq_idx is None:
            return out, tiling.final_states(groups, states)
        found = documents.candidates(call.seq_idx, [0])
        values = tiling.states_at(groups, states, found)
        return out, documents.gather([values], found, call.seq_idx[:, 0], None, 1, modes.CONTIGUOUS)[0]
