"""Inference: a long prompt prefilled sharded across the sequence-parallel group, then decoded.

    prompt (batch, seqlen), the same on every rank
      -> this rank's contiguous shard (batch, seqlen/cp)
      -> the model's own forward on the shard, with
           Mamba2 mixers:     in_proj -> the op's forward-only route (state passing) -> out_proj
                              + the conv tail: the last d_conv pre-conv columns of the whole prompt
                                (one small all-gather; they may come from several ranks)
           attention layers:  DeepSpeed's Ulysses attention, as in training, and the K/V of every
                              rank gathered into each rank's cache
      -> every rank holds the decode cache of the whole prompt, and the last token's logits
      -> decoding continues with the host library's own step (replicated on every rank)

The final SSM state is exactly what decoding needs: the state-passing algebra (DESIGN.md) makes
the state after the last shard the state after the whole prompt, and it is identical on every rank.

    prefill.py        library-free pieces: the conv tail, K/V gathering, errors raised alike
    transformers.py   Hugging Face models: sequence_parallel_prefill / sequence_parallel_generate
                      (re-exported by ds_mamba_spcp.integrations.transformers)
    mamba_ssm.py      mamba-ssm's MambaLMHeadModel and its InferenceParams
"""
