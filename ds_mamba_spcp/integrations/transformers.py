"""transformers' Mamba2-style models: training with sequence parallelism, and generation with a sharded prefill.

    transformers_adapter.py          the adapter: the six mixers made sequence-parallel through the shared core
                                     (``integrations/core.py``), DeepSpeed's Ulysses attention per attention
                                     module, ``prepare_sequence_parallel``, ``sequence_parallel_disabled``
    ../inference/transformers.py     the sharded prefill into a transformers cache, then transformers' own
                                     ``generate``: ``sequence_parallel_prefill``, ``sequence_parallel_generate``

This module only gathers the public names of both (neither imports it, so nothing circles back here);
docs/huggingface.md is the user's page.
"""

from __future__ import annotations

from ds_mamba_spcp.inference.transformers import sequence_parallel_generate, sequence_parallel_prefill
from ds_mamba_spcp.integrations.transformers_adapter import (
    MIN_TRANSFORMERS,
    MIXER_CLASSES,
    attention_modules,
    check_mixer_supported,
    mixer_classes,
    prepare_sequence_parallel,
    sequence_parallel_disabled,
    wrap_hf_mamba2_mixers,
)

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
