"""Memory per token of long training runs: the tiled block recompute (``tiled_block.py``).

See docs/design.md, "Rooms", and docs/usage.md, "Tiled block recompute".
"""

from ds_mamba_spcp.memory.tiled_block import tile_spans, tiled_block

__all__ = ["tile_spans", "tiled_block"]
