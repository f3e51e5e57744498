"""Adapters to model libraries, one room per library, side by side over one shared core; they import neither
each other nor, outside their own modules, their library (docs/design.md, "Adapters"):

    core.py          MixerCore, mixer_forward: in_proj -> the sharded core -> out_proj (imports no adapter)
    mamba_ssm/       mamba-ssm: DistributedMamba2 (mixer.py) and the sharded prefill of MambaLMHeadModel
                     (generation.py)
    transformers/    Hugging Face transformers (pip install 'ds_mamba_spcp[hf]'): the six Mamba2-style mixers,
                     DeepSpeed's Ulysses attention for them and prepare_sequence_parallel (adapter.py), the sharded
                     prefill into transformers' caches and generate (generation.py), the Trainer / TRL /
                     accelerate hooks (accelerate.py)
    accelerate.py    the documented import path of transformers/accelerate.py's public names
"""
