"""Generation with the prompt prefilled sharded across the ranks, beside one process's generate.

    deepspeed --num_gpus 2 examples/generate.py                 # 2 ranks (CPU: CUDA_VISIBLE_DEVICES="")
    python examples/generate.py                                 # one process: the same call, a group of one

Every rank builds the same tiny Nemotron-H hybrid from a config (Mamba2 layers and an attention layer, sdpa,
slow decays so that the state passed between the ranks matters) and the same prompt;
``sequence_parallel_generate`` prefills the prompt sharded over the ranks (the Mamba2 layers by state
passing, the attention layer through DeepSpeed's Ulysses attention), builds the decode cache of the whole
prompt on every rank and decodes with transformers' own ``generate``. Rank 0 prints its tokens beside those
of ``model.generate`` on the whole prompt in one process, and whether they agree.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def build_model(seed: int):
    import transformers as tf

    cfg = tf.NemotronHConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, layers_block_type=["mamba", "attention", "mamba", "mlp"], ssm_state_size=8,
        mamba_num_heads=8, mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=16, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.NemotronHForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name.endswith("A_log"):  # decays of ~0.995 per token
                p.copy_(torch.empty(p.shape).uniform_(0.03, 0.1, generator=g).log())
            elif name.endswith("dt_bias"):
                p.fill_(math.log(math.expm1(0.05)))
    model.generation_config.eos_token_id = None
    return model.eval()


def main(argv=None) -> bool:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=97)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    args = p.parse_args(argv)

    import transformers.models.nemotron_h.modeling_nemotron_h  # noqa: F401 - before mamba-ssm's modules (CPU)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        import deepspeed

        torch.set_num_threads(1)
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate

    rank, world = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    model = build_model(args.seed).to(device)
    prompt = torch.randint(1, 64, (2, args.prompt_len), generator=torch.Generator().manual_seed(args.seed + 1))
    prompt = prompt.to(device)
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    tokens = sequence_parallel_generate(model, prompt, **kw)[:, args.prompt_len :]
    alone = model.generate(prompt, **kw)[:, args.prompt_len :]
    same = torch.equal(tokens, alone)
    if rank == 0:
        print(f"prompt of {args.prompt_len} tokens prefilled on {world} rank(s), {args.new_tokens} new tokens:")
        for row in range(prompt.shape[0]):
            print(f"  row {row} sharded prefill: {tokens[row].tolist()}")
            print(f"  row {row} one process:     {alone[row].tolist()}")
        print("the same tokens" if same else "DIFFERENT tokens")
    return same


if __name__ == "__main__":
    same = main()
    from ds_mamba_spcp.comm import shutdown

    shutdown()  # a gloo rank can abort at exit while its group lives
    sys.exit(0 if same else 1)
