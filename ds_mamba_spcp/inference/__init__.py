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

The op's final state (docs/design.md, "The algebra") is the state after the whole prompt, on every rank.

    forward.py        the mixer core's forward-only path (the state and conv tail of every document)
    prefill.py        library-free pieces: one layer's decode state, K/V gathering, errors raised alike
The host libraries' entries: integrations/transformers/generation.py, integrations/mamba_ssm/generation.py.
"""
