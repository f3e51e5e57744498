"""The strategy of a group of one rank (and of each rank's full-length scan under ulysses).

The whole row is on this rank: the backend's single-device op runs it, unless the row holds more tokens
than one call of the backend can index (mamba-ssm's int32 offsets) or a tile length is set; then the row
runs as one causal segment of the state-passing chain in tiles (``ops/tiles.py``), with no group and no
collective: the single-device op with no length cap. See docs/design.md, "Tiles".
"""

from __future__ import annotations

from ds_mamba_spcp import modes, state_passing


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
