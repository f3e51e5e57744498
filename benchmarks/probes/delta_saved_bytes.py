"""Bytes per token that the Gated DeltaNet layers keep for backward, counted on CPU (no GPU needed).

What a delta layer of ``benchmarks/train_hf.py``'s ``hf-qwen35-2b`` holds while its recompute waits for its
backward under the long-context key: the tensors autograd saves (``saved_tensors_hooks``, each storage once), at two
lengths; the slope is the bytes per token (the intercept, the weights the matmuls save, does not grow):

    python benchmarks/probes/delta_saved_bytes.py                 # 512 and 1024 tokens
    python benchmarks/probes/delta_saved_bytes.py --lengths 1024 2048

1. the op alone: ``ops/delta_reference.py``'s chunked rule (chunk 64, the package's PyTorch backend, which trains on a
   Hopper GPU where fla 0.6.0 refuses its backward), bf16 q/k/v of 16 heads of K = V = 128 (computed in fp32);
2. the whole delta decoder layer (input norm, the delta layer on this package's op as the key runs it at sp 1, the
   residual, the post norm, the MLP in tiles of 256 through DeepSpeed's TiledMLP), bf16.

Measured (CPU, transformers 5.24): the op 124.8 KiB a token (7.8 KiB a token and head), the decoder layer 281 KiB
a token. The backward's own transients (gradients of one chunk's tensors at a time, the layer's input gradient) come
on top; not counted here.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/ (train_hf's presets)


def saved_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saves while ``fn(*args, **kwargs)`` runs, its result)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return sum(seen.values()), out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs=2, default=[512, 1024])
    args = p.parse_args(argv)
    import torch
    import train_hf

    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel
    from ds_mamba_spcp.ops.delta_reference import chunk_gated_delta_rule

    torch.manual_seed(0)
    heads, dim = 16, 128
    op = []
    for T in args.lengths:
        q, k, v = (torch.randn(1, T, heads, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = (-torch.rand(1, T, heads)).requires_grad_()
        beta = torch.rand(1, T, heads, dtype=torch.bfloat16).requires_grad_()
        op.append(saved_bytes(chunk_gated_delta_rule, q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0])

    cfg = train_hf.preset_config("hf-qwen35-2b")
    cfg.num_hidden_layers, cfg.layer_types, cfg.vocab_size = 1, ["linear_attention"], 256
    import transformers

    model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).train()
    key = {"tile_tokens": 256, "fused_loss": False}
    prepare_sequence_parallel(model, {"mamba_sequence_parallel": {"enabled": True, "long_context": key}})
    layer = model.model.layers[0]
    forward = getattr(type(layer).forward, "__wrapped__", type(layer).forward)  # the layer's own, not the key's
    whole = []
    for T in args.lengths:
        x = torch.randn(1, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        rope = model.model.rotary_emb(x, torch.arange(T)[None])
        whole.append(saved_bytes(forward, layer, x, position_embeddings=rope, attention_mask=None)[0])

    span = args.lengths[1] - args.lengths[0]
    for name, (a, b) in (("op alone", op), ("delta decoder layer", whole)):
        per = (b - a) / span
        print(f"{name}: {per / 1024:.1f} KiB a token (saved {a / 2**20:.1f} MiB at {args.lengths[0]}, "
              f"{b / 2**20:.1f} MiB at {args.lengths[1]})")  # fmt: skip
    print(f"op per token and head: {(op[1] - op[0]) / span / heads / 1024:.2f} KiB")


if __name__ == "__main__":
    main()
