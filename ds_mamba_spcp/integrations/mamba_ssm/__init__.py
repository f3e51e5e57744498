"""mamba-ssm: its ``Mamba2`` mixer made sequence-parallel (``mixer.py``: ``DistributedMamba2``,
``wrap_mamba_ssm_mixers``), and its ``MambaLMHeadModel`` prefilled sharded, then decoded (``generation.py``)."""

from ds_mamba_spcp.integrations.mamba_ssm.mixer import DistributedMamba2, wrap_mamba_ssm_mixers

__all__ = ["DistributedMamba2", "wrap_mamba_ssm_mixers"]
