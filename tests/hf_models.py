"""Tiny transformers models of the six Mamba2-style families, built from configs (no download), shared by
the CPU tests (tests/test_hf.py) and the GPU test (tests/test_hf_gpu.py).

Sizes are small but not degenerate: 8 SSM heads of headdim 4 in 2 groups (so the gated norm's group
size matters), dstate 5, d_conv 4, chunk 8 (shards that are not chunk multiples), 4 attention heads with
2 key/value heads (at 4 ranks DeepSpeed's Ulysses attention replicates the key/value heads). ``randomize``
gives every parameter an O(1) effect: transformers' own initialisation (std 0.02) makes the mixers' and
attention's contributions so small next to the residual stream that a wrong state would hardly show.
"""

from __future__ import annotations

import os

import torch

VOCAB = 40
HIDDEN = 16
SSM = dict(heads=8, headdim=4, ngroups=2, dstate=5, d_conv=4, chunk=8)
ATTN = dict(heads=4, kv_heads=2)
SIZES = dict(vocab=VOCAB, hidden=HIDDEN, ssm=SSM, attn=ATTN)  # the CPU tests' sizes; ``build(sizes=...)`` others

# family -> the transformers modeling module (imported by ``import_models``)
MODULES = {
    "mamba2": "transformers.models.mamba2.modeling_mamba2",
    "bamba": "transformers.models.bamba.modeling_bamba",
    "nemotron_h": "transformers.models.nemotron_h.modeling_nemotron_h",
    "granitemoehybrid": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "falcon_h1": "transformers.models.falcon_h1.modeling_falcon_h1",
    "zamba2": "transformers.models.zamba2.modeling_zamba2",
}


# the Gated DeltaNet families (ds_mamba_spcp/integrations/transformers/delta.py): family -> modeling module
DELTA_MODULES = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    "kimi_linear": "transformers.models.kimi_linear.modeling_kimi_linear",
}
# 2 query/key heads of dim 4 serving 4 value heads of dim 3 (grouped value heads), conv kernel 4
DELTA = dict(k_heads=2, v_heads=4, k_dim=4, v_dim=3, d_conv=4)
# Kimi Linear: its KDA layers have as many q/k/v heads, all of one dim (2 heads of 4, a decay per key channel);
# its attention is MLA (latent of 6, keys of 4 + 2 rotary-free dims, values of 3: narrower than the keys, as in
# the real model) with 4 heads; the MLP of layer 0 dense, the others MoE (2 experts, top-2, one shared)
KIMI = dict(
    linear_num_heads=2, linear_head_dim=4, kv_lora_rank=6, q_lora_rank=None, qk_nope_head_dim=4, qk_rope_head_dim=2,
    v_head_dim=3, num_key_value_heads=ATTN["heads"], num_local_experts=2, num_experts_per_tok=2, n_group=1,
    topk_group=1, moe_intermediate_size=8, mlp_layer_types=["dense", "sparse", "sparse"],
)  # fmt: skip


def import_models() -> None:
    """Imports the modeling modules (in any order with ds_mamba_spcp: tests/test_import_order.py)."""
    import importlib

    for name in (*MODULES.values(), *DELTA_MODULES.values()):
        importlib.import_module(name)


def build_delta(family: str, *, attention: bool = True, seed: int = 0, dtype=torch.float32, attn="sdpa",
                gated_eps: float | None = None, **extra):  # fmt: skip
    """A tiny Gated DeltaNet ``<Family>ForCausalLM`` (delta, attention, delta layers; ``attention=False``: two
    delta layers) with randomized parameters (``kimi_linear``: KDA layers at ``KIMI``'s sizes, MLA attention);
    ``extra`` overrides config fields. ``gated_eps``: the epsilon of the delta layers' gated RMSNorm alone
    (config.rms_norm_eps sets every norm's; see ``WELL_CONDITIONED``)."""
    import transformers as tf

    d = DELTA
    types = ["linear_attention", "full_attention", "linear_attention"] if attention else ["linear_attention"] * 2
    if family == "kimi_linear":  # its own field names (no grouped heads, MLA): KIMI
        kimi = dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, tie_word_embeddings=False, num_attention_heads=ATTN["heads"],
            intermediate_size=20, num_hidden_layers=len(types), layer_types=types, linear_conv_kernel_dim=d["d_conv"],
            pad_token_id=None, bos_token_id=None, eos_token_id=None, **KIMI,
        )  # fmt: skip
        kimi["mlp_layer_types"] = kimi["mlp_layer_types"][: len(types)]
        return _finish_delta(tf.KimiLinearConfig(**{**kimi, **extra}), tf.KimiLinearForCausalLM, True, seed, dtype,
                             attn, gated_eps)  # fmt: skip
    fields = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, tie_word_embeddings=False, num_attention_heads=ATTN["heads"],
        num_key_value_heads=ATTN["kv_heads"], head_dim=HIDDEN // ATTN["heads"], intermediate_size=20,
        num_hidden_layers=len(types), layer_types=types, linear_num_key_heads=d["k_heads"],
        linear_num_value_heads=d["v_heads"], linear_key_head_dim=d["k_dim"], linear_value_head_dim=d["v_dim"],
        linear_conv_kernel_dim=d["d_conv"], pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    # top-2 of 2 experts: no discrete routing choice, which fp32 and fp64 runs could make differently (the
    # router's gradient then disagreed by ~1 between the oracle's two runs with top-1)
    experts = dict(num_experts=2, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8)
    config_cls, model_cls, more = {
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, {}),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, experts),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, experts),
        "olmo_hybrid": (tf.OlmoHybridConfig, tf.OlmoHybridForCausalLM, {}),
    }[family]
    return _finish_delta(config_cls(**{**fields, **more, **extra}), model_cls, bool(more), seed, dtype, attn, gated_eps)


def _finish_delta(cfg, model_cls, experts: bool, seed: int, dtype, attn, gated_eps):
    cfg._attn_implementation = attn
    if experts:
        cfg._experts_implementation = "eager"  # the loop over experts (the grouped GEMM refuses fp64 on CPU)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    randomize(model, seed)
    if gated_eps is not None:
        for m in model.modules():
            if type(m).__name__.endswith("RMSNormGated"):
                m.variance_epsilon = gated_eps
    return model.to(dtype).train()


def build(family: str, *, attention: bool = True, seed: int = 0, dtype=torch.float32, attn="sdpa", sizes=None,
          init: float | None = None, **extra):  # fmt: skip
    """A tiny ``<Family>ForCausalLM`` with randomized parameters. ``attention=False`` gives the family's
    attention-free variant (all but Falcon-H1, whose every layer has attention beside its mixer). ``sizes``
    replaces ``SIZES``; ``extra`` overrides config fields. ``init``: transformers' own initialisation at
    ``initializer_range=init`` (its dt, A and D initialisations too) instead of ``randomize``."""
    import transformers as tf

    if family in DELTA_MODULES:
        return build_delta(family, attention=attention, seed=seed, dtype=dtype, attn=attn, **extra)
    if init is not None:
        extra["initializer_range"] = init
    sizes = sizes or SIZES
    s, a, hidden = sizes["ssm"], sizes["attn"], sizes["hidden"]
    common = dict(vocab_size=sizes["vocab"], hidden_size=hidden, tie_word_embeddings=False)
    attn_common = dict(
        num_attention_heads=extra.pop("num_attention_heads", a["heads"]),
        num_key_value_heads=extra.pop("num_key_value_heads", a["kv_heads"]),
    )
    if family == "mamba2":
        cfg = tf.Mamba2Config(
            **common, num_heads=s["heads"], head_dim=s["headdim"], state_size=s["dstate"], n_groups=s["ngroups"],
            conv_kernel=s["d_conv"], chunk_size=s["chunk"], num_hidden_layers=2, expand=2, **extra,
        )  # fmt: skip
        cls = tf.Mamba2ForCausalLM
    elif family == "bamba":
        cfg = tf.BambaConfig(
            **common, **attn_common, intermediate_size=20, num_hidden_layers=3,
            attn_layer_indices=[1] if attention else [], mamba_n_heads=s["heads"], mamba_d_head=s["headdim"],
            mamba_n_groups=s["ngroups"], mamba_d_state=s["dstate"], mamba_d_conv=s["d_conv"], mamba_expand=2,
            mamba_chunk_size=s["chunk"], **extra,
        )  # fmt: skip
        cls = tf.BambaForCausalLM
    elif family == "nemotron_h":
        cfg = tf.NemotronHConfig(
            **common, **attn_common, head_dim=hidden // attn_common["num_attention_heads"], intermediate_size=20,
            layers_block_type=["mamba", "attention", "mamba", "mlp"] if attention else ["mamba", "mlp", "mamba"],
            ssm_state_size=s["dstate"], mamba_num_heads=s["heads"], mamba_head_dim=s["headdim"],
            n_groups=s["ngroups"], conv_kernel=s["d_conv"], chunk_size=s["chunk"], **extra,
        )  # fmt: skip
        cls = tf.NemotronHForCausalLM
    elif family == "granitemoehybrid":
        experts = dict(num_local_experts=2, num_experts_per_tok=1)
        experts.update(extra)
        cfg = tf.GraniteMoeHybridConfig(
            **common, **attn_common, intermediate_size=20, num_hidden_layers=3 if attention else 2,
            layer_types=["mamba", "attention", "mamba"] if attention else ["mamba", "mamba"],
            shared_intermediate_size=16, mamba_n_heads=s["heads"], mamba_d_head=s["headdim"],
            mamba_n_groups=s["ngroups"], mamba_d_state=s["dstate"], mamba_d_conv=s["d_conv"], mamba_expand=2,
            mamba_chunk_size=s["chunk"], **experts,
        )  # fmt: skip
        cfg._experts_implementation = "eager"  # the loop over experts: the grouped GEMM refuses fp64 on CPU
        cls = tf.GraniteMoeHybridForCausalLM
    elif family == "falcon_h1":
        if not attention:
            raise ValueError("every Falcon-H1 layer has attention beside its mixer: there is no attention-free variant")
        opts = dict(mamba_rms_norm=True, mamba_norm_before_gate=False, ssm_in_multiplier=0.7,
                    ssm_multipliers=[1.1, 0.8, 1.3, 0.9, 1.2])  # fmt: skip
        opts.update(extra)
        cfg = tf.FalconH1Config(
            **common, **attn_common, intermediate_size=20, num_hidden_layers=2,
            mamba_d_ssm=s["heads"] * s["headdim"], mamba_n_heads=s["heads"], mamba_d_head=s["headdim"],
            mamba_n_groups=s["ngroups"], mamba_d_state=s["dstate"], mamba_d_conv=s["d_conv"], mamba_expand=2,
            mamba_chunk_size=s["chunk"], **opts,
        )  # fmt: skip
        cls = tf.FalconH1ForCausalLM
    elif family == "zamba2":
        cfg = tf.Zamba2Config(
            **common, **attn_common, num_hidden_layers=3 if attention else 2,
            layers_block_type=["mamba", "hybrid", "mamba"] if attention else ["mamba", "mamba"],
            mamba_d_state=s["dstate"], mamba_d_conv=s["d_conv"], mamba_expand=2, mamba_ngroups=s["ngroups"],
            n_mamba_heads=s["heads"], chunk_size=s["chunk"], intermediate_size=20, **extra,
        )  # fmt: skip
        cls = tf.Zamba2ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}; one of {list(MODULES)}")
    if family != "mamba2":  # attention-free: transformers refuses any attention implementation but its default
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg)
    if init is None:
        randomize(model, seed)
    return model.to(dtype).train()


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter drawn anew: matrices ~ N(0, 1/fan_in); the SSM's A in [-1.5, -0.5], dt ~ softplus(-1)
    (decays of order one per shard, so the state passed between ranks matters), D, norm weights and biases
    around their usual values."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                value = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            elif name.endswith("A_log"):
                value = torch.rand(p.shape, generator=g).add(0.5).log()
            elif name.endswith("dt_bias"):
                value = torch.randn(p.shape, generator=g) * 0.5 - 1.0
            elif name.endswith(".D") or "norm" in name:
                value = 1.0 + 0.3 * torch.randn(p.shape, generator=g)
            else:
                value = 0.3 * torch.randn(p.shape, generator=g)
            p.copy_(value.to(p.dtype))


# sizes of the GPU tests (tests/test_hf_gpu.py, tests/test_accelerate.py::test_trainer_on_one_gpu)
GPU_SIZES = dict(
    vocab=256, hidden=128, ssm=dict(heads=8, headdim=32, ngroups=2, dstate=64, d_conv=4, chunk=64),
    attn=dict(heads=4, kv_heads=2),
)  # fmt: skip


def load_kernels_first():
    """mamba-ssm's Triton modules before transformers' models: transformers then binds its fused kernels."""
    os.environ.setdefault("MAMBA_DETERMINISTIC", "1")
    from ds_mamba_spcp.ops.kernels.upstream import expose_mamba_package, mamba_module

    mamba_module("ops.triton.ssd_combined")
    expose_mamba_package()  # the bare mamba_ssm stays in sys.modules: transformers finds it and binds the kernels
    import_models()
