"""The public home of the wrappers: ``wrap_mamba2_mixers`` for every Mamba2 mixer of a model, of either kind.

It sits above the two adapters (``integrations/``, which do not import each other) and re-exports
``DistributedMamba2``, ``MixerCore`` and ``mixer_forward``.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ds_mamba_spcp.config import load_mamba_sp_config
from ds_mamba_spcp.integrations.core import MixerCore, mixer_forward
from ds_mamba_spcp.integrations.mamba_ssm.mixer import DistributedMamba2, wrap_mamba_ssm_mixers

__all__ = ["DistributedMamba2", "MixerCore", "mixer_forward", "wrap_mamba2_mixers"]


def wrap_mamba2_mixers(model: nn.Module, sequence_process_group: Any, config: Any) -> int:
    """Makes every Mamba2 mixer of ``model`` sequence-parallel, in place: mamba-ssm's ``Mamba2`` submodules
    become :class:`DistributedMamba2` (``wrap_mamba_ssm_mixers``), and, when transformers is loaded, its
    Mamba2-style mixers are wrapped too (``integrations.transformers.adapter.wrap_hf_mamba2_mixers``). Mixers
    already wrapped are left alone; returns the number wrapped. State_dict keys do not change (before or after
    loading a checkpoint or ``deepspeed.initialize``; transformers' mixers under ZeRO-3: before)."""
    cfg = load_mamba_sp_config(config)
    count = wrap_mamba_ssm_mixers(model, sequence_process_group, cfg)
    if sys.modules.get("transformers") is None:
        return count
    from ds_mamba_spcp.integrations.transformers.adapter import wrap_hf_mamba2_mixers

    return count + wrap_hf_mamba2_mixers(model, sequence_process_group, cfg)
