"""Adapters to model libraries, one room per library: each translates its library's mixers into this package's op
and holds no algorithm of its own. They sit side by side over one shared core and do not import each other
(docs/design.md, "Adapters"); each imports its library in its own modules, so that the rest of the package imports
without it:

    core.py          MixerCore, mixer_forward: in_proj -> the sharded core -> out_proj (imports no adapter)
    mamba_ssm/       mamba-ssm: DistributedMamba2 (mixer.py) and the sharded prefill of MambaLMHeadModel
                     (generation.py)
    transformers/    Hugging Face transformers (pip install 'ds_mamba_spcp[hf]'): the six Mamba2-style mixers,
                     DeepSpeed's Ulysses attention for them and prepare_sequence_parallel (adapter.py), the sharded
                     prefill into transformers' caches and generate (generation.py), the Trainer / TRL /
                     accelerate hooks (accelerate.py)
    accelerate.py    the documented import path of transformers/accelerate.py's public names
"""
