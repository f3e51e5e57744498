"""Adapters to model libraries: they translate a host library's modules into this package's ops.

Each adapter lives in its own module and imports its library there, so that the rest of the
package imports without it:

    ds_mamba_spcp.integrations.transformers   Hugging Face transformers' Mamba2-style mixers
                                              (pip install 'ds_mamba_spcp[hf]')
    ds_mamba_spcp.integrations.accelerate     the same under transformers' Trainer, TRL and accelerate
                                              (enable(), before the Trainer is built)
"""
