"""Adapters to model libraries: they translate a host library's mixers into this package's op.

The adapters sit side by side over one shared core and do not import each other (docs/design.md,
"Adapters"); each imports its library in its own module, so that the rest of the package imports
without it:

    ds_mamba_spcp.integrations.core           MixerCore, mixer_forward: in_proj -> sharded core -> out_proj
    ds_mamba_spcp.integrations.mamba_ssm      mamba-ssm's Mamba2: DistributedMamba2, wrap_mamba_ssm_mixers
    ds_mamba_spcp.integrations.transformers   Hugging Face transformers' Mamba2-style mixers
                                              (pip install 'ds_mamba_spcp[hf]'): training
                                              (transformers_adapter.py) and the sharded prefill (inference/)
    ds_mamba_spcp.integrations.accelerate     the same under transformers' Trainer, TRL and accelerate
                                              (enable(), before the Trainer is built)
"""
