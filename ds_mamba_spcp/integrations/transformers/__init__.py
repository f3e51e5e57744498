"""Hugging Face transformers' Mamba2-style models: training, sharded-prefill generation, the Trainer hooks.

    adapter.py      the six mixers made sequence-parallel through the shared core (``integrations/core.py``),
                    DeepSpeed's Ulysses attention per attention module, ``prepare_sequence_parallel``,
                    ``sequence_parallel_disabled``
    generation.py   the sharded prefill into a transformers cache (the Mamba2 layers through
                    ``inference/``), then transformers' own ``generate``: ``sequence_parallel_prefill``,
                    ``sequence_parallel_generate``
    accelerate.py   the same models under the Trainer, TRL and accelerate: ``enable()``
    long_context.py the section's ``"long_context"`` key (tiled layers, TiledMLP, offload), with
    fused_loss.py   the loss without the (tokens x vocab) logits
    router_loss.py  GraniteMoeHybrid's router load-balancing loss under the key and across ranks (its sums per
                    row where the routers run, over the group)
    layers.py       below all of these: how a wrapped layer is installed and called, transformers' decoder layers
                    and attention modules, the interface the key tiles a mixer through (``TileableMixer``)

This module gathers the public names of the first two; docs/huggingface.md is the user's page.
"""

from __future__ import annotations

from ds_mamba_spcp.integrations.transformers.adapter import (
    MIN_TRANSFORMERS,
    MIXER_CLASSES,
    attention_modules,
    check_mixer_supported,
    mixer_classes,
    prepare_sequence_parallel,
    sequence_parallel_disabled,
    wrap_hf_mamba2_mixers,
)
from ds_mamba_spcp.integrations.transformers.generation import sequence_parallel_generate, sequence_parallel_prefill

__all__ = [
    "MIN_TRANSFORMERS",
    "MIXER_CLASSES",
    "attention_modules",
    "check_mixer_supported",
    "mixer_classes",
    "prepare_sequence_parallel",
    "sequence_parallel_disabled",
    "sequence_parallel_generate",
    "sequence_parallel_prefill",
    "wrap_hf_mamba2_mixers",
]
