"""``from ds_mamba_spcp.integrations import accelerate as mamba_sp; mamba_sp.enable()``: the Trainer / TRL /
accelerate hooks, which live with the rest of the transformers adapter in ``integrations/transformers/accelerate.py``
(this module only keeps their documented import path)."""

from ds_mamba_spcp.integrations.transformers.accelerate import MIXER_CLASSES, disable, enable, enabled, packed_seq_idx

__all__ = ["MIXER_CLASSES", "disable", "enable", "enabled", "packed_seq_idx"]
