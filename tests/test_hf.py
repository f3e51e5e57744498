"""transformers' Mamba2-style models made sequence-parallel (ds_mamba_spcp.integrations.transformers) against
the unwrapped model in one process, on 2 and 4 gloo ranks, plus the single-process behaviour (checkpoints,
generation, group of one, rejections) and the packaging.

Oracle. The unwrapped model runs transformers' own PyTorch path (its chunked SSD, its causal conv, its gated
RMSNorm, its attention), an implementation written by nobody here: without mamba-ssm's CUDA build transformers
falls back to it (``test_transformers_runs_its_pytorch_path`` checks that this is what runs). Models: tiny
random configs of the six families (``tests/hf_models.py``: 8 SSM heads in 2 groups, dstate 5, chunk 8,
shards of 13 or 14 tokens, so nothing divides evenly; 4 attention heads over 2 key/value heads).

Per case every rank builds the same model and the same batch from one seed, runs the unwrapped model on the
whole sequence and the prepared one (``prepare_sequence_parallel``: DeepSpeed's Ulysses attention for the
attention layers, this package for the Mamba2 mixers) on its shard, and back-propagates ``sum(logits *
gout)``. Reported (reduced over the ranks, so each test sees one number per tensor): the logits' relative
RMS error (squared norms summed over the shards) and every parameter gradient's (the ranks' local
contributions summed, as DeepSpeed's reduction does). Each world size is spawned once and runs all its cases;
the ZeRO-3 cases (marked ``zero3``, run last) go through ``deepspeed.initialize`` and compare the gradients
DeepSpeed reduced instead, with the same bound (the reduction is one more fp32 sum over 2 ranks).

Tolerance, per tensor: relative RMS <= max(1e-5, 3 x the oracle's own spread), the spread being how far
transformers' fp32 run is from its run with fp64 parameters (same inputs). Two fp32 computations of one
model differ by their roundings, and by how much depends on the tensor's conditioning: for almost every
tensor the spread is ~1e-7..5e-6, so the bound is 1e-5..1.5e-5 (the sharded model sums in another order: a
state passed between ranks, gradients summed over ranks; its errors here are ~1e-7..6e-6 too). A few SSM
scalars' gradients (dt_bias, A_log, D of the first layer: sums over every token that nearly cancel) are
ill-conditioned for some seeds: transformers' own fp32 run is then up to ~1e-4 from its fp64 run, and the
sharded fp32 run about as far from the fp32 oracle (seen: 3.3e-5 where the spread is 8e-5), so their bound
follows the spread (two runs each about the spread from the truth are within 2x of it; 3x for margin). An
exact fp64 oracle is not available: transformers' PyTorch path computes the scan and the gated norm in fp32
whatever the parameters' dtype (``A_log.float()``, ``hidden_states.float()``), which is also why its fp64
run only bounds, rather than removes, that rounding; the op's own fp64 equivalence (1e-10) is
tests/test_state_passing.py's. A lost state (the negative control: DeepSpeed's attention sharding alone, each
rank's Mamba layers starting from a zero state) is off by > 1e-2 on tensors whose spread is ~1e-6.

The packed-row cases (marker ``packed``) run once the op takes ``seq_idx`` (they skip, naming the reason,
while it refuses it); their oracle is the unwrapped model on each document separately.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

from tests import hf_models

hf_models.import_models()

from ds_mamba_spcp.config import SECTION  # noqa: E402
from tests.dist_utils import REPO, agree, rel_err, run_ranks, sharded_rel_err, summed_rel_err  # noqa: E402

TOL = 1e-5
ORACLE_FACTOR = 3
BATCH = 2
PER_RANK = {"contiguous": 13, "zigzag": 14}  # tokens per rank (zigzag: two equal chunks)

MODES = {
    "sp_none": dict(mode="state_passing", load_balancing="none", input_layout="contiguous"),
    "sp_virtual": dict(mode="state_passing", load_balancing="virtual", input_layout="zigzag"),
    "sp_permute_p2p": dict(mode="state_passing", load_balancing="permute_p2p", input_layout="zigzag"),
    "sp_permute_a2a": dict(mode="state_passing", load_balancing="permute_a2a", input_layout="zigzag"),
    "ulysses": dict(mode="ulysses", input_layout="contiguous"),
    "ulysses_zigzag": dict(mode="ulysses", input_layout="zigzag"),
}
FAMILIES = list(hf_models.MODULES)


def _cases() -> dict:
    """name -> options. level "model": the whole model (attention sharded by DeepSpeed's Ulysses attention where
    the family has it); level "mixer": one mixer on its own (Falcon-H1 under the zigzag modes: every Falcon-H1
    layer has attention, which DeepSpeed shards contiguously only)."""
    two = {}
    for fam in FAMILIES:  # every family, attention and Mamba sharded together, in the default mode and all-to-all
        two[f"{fam}_sp_none"] = dict(family=fam, mode="sp_none")
        two[f"{fam}_ulysses"] = dict(family=fam, mode="ulysses")
    # the zigzag modes, rotated over the families (attention-free variants: attention needs contiguous shards)
    for fam, mode in [
        ("mamba2", "sp_virtual"), ("zamba2", "sp_virtual"), ("nemotron_h", "sp_permute_p2p"),
        ("bamba", "sp_permute_p2p"), ("granitemoehybrid", "sp_permute_a2a"), ("mamba2", "sp_permute_a2a"),
        ("bamba", "ulysses_zigzag"), ("zamba2", "ulysses_zigzag"),
    ]:  # fmt: skip
        two[f"{fam}_noattn_{mode}"] = dict(family=fam, mode=mode, attention=False)
    for mode in ("sp_virtual", "sp_permute_a2a", "ulysses_zigzag"):
        two[f"falcon_h1_mixer_{mode}"] = dict(family="falcon_h1", mode=mode, level="mixer")
    # Falcon-H1's other norm settings: no norm (nn.Identity: y * silu(z)), and the norm before the gate
    two["falcon_h1_nonorm_sp_none"] = dict(family="falcon_h1", mode="sp_none", extra=dict(mamba_rms_norm=False))
    two["falcon_h1_normbefore_sp_none"] = dict(family="falcon_h1", mode="sp_none",
                                               extra=dict(mamba_norm_before_gate=True))  # fmt: skip
    # an evaluation forward on shards (use_cache left unset: the model-level check turns it off)
    two["nemotron_h_eval_sp_none"] = dict(family="nemotron_h", mode="sp_none", eval=True)
    # negative control: DeepSpeed's Ulysses attention alone (the Mamba layers restart from zero on every rank)
    two["bug_attention_only_bamba"] = dict(family="bamba", mode="sp_none", bug="attention_only")
    # ZeRO-3 through deepspeed.initialize (run after the checks, see _run_world): the families whose decoder
    # layers call the mixer with hidden_states= as a keyword (Mamba2 and Nemotron-H pass it positionally);
    # Falcon-H1 at ZeRO-3 is tests/test_accelerate.py's, through the Trainer
    two["bamba_noattn_zero3_sp_none"] = dict(family="bamba", mode="sp_none", attention=False, zero3=True)
    two["zamba2_zero3_sp_none"] = dict(family="zamba2", mode="sp_none", zero3=True)
    two["granitemoehybrid_zero3_ulysses"] = dict(family="granitemoehybrid", mode="ulysses", zero3=True)
    # the Gated DeltaNet families (integrations/transformers/delta.py), each once, and Qwen3-Next at ZeRO-3
    two["qwen3_5_sp_none"] = dict(family="qwen3_5", mode="sp_none")
    two["qwen3_5_moe_sp_none"] = dict(family="qwen3_5_moe", mode="sp_none")
    two["qwen3_next_ulysses"] = dict(family="qwen3_next", mode="ulysses")
    two["olmo_hybrid_sp_none"] = dict(family="olmo_hybrid", mode="sp_none")
    two["qwen3_next_zero3_sp_none"] = dict(family="qwen3_next", mode="sp_none", zero3=True)
    # negative control: DeepSpeed's Ulysses attention alone, each rank's delta layers restarting from zero
    two["bug_attention_only_qwen3_5"] = dict(family="qwen3_5", mode="sp_none", bug="attention_only")
    # Kimi Linear: KDA layers (a decay per key channel) and MLA attention (values narrower than keys, padded for
    # DeepSpeed's Ulysses attention: layers.ulysses_attention), in the head all-to-all mode of the delta op
    two["kimi_linear_ulysses"] = dict(family="kimi_linear", mode="ulysses")
    # four ranks: a middle rank (its halo and state both from a neighbour) and a scan of two rounds; the families'
    # own code does not change with the group's size, so two families plain and three in the other modes
    four = {
        **{f"{fam}_sp_none": dict(family=fam, mode="sp_none") for fam in ("mamba2", "bamba")},
        "nemotron_h_ulysses": dict(family="nemotron_h", mode="ulysses"),
        "zamba2_noattn_sp_virtual": dict(family="zamba2", mode="sp_virtual", attention=False),
        "granitemoehybrid_noattn_sp_permute_a2a": dict(
            family="granitemoehybrid", mode="sp_permute_a2a", attention=False
        ),  # fmt: skip
    }
    return {2: two, 4: four}


CASES = _cases()

# packed rows: document lengths per row (every row sums to the global length); they cross shard boundaries,
# one is shorter than the conv halo (d_conv - 1 = 3), one starts exactly on a shard boundary
PACKED_DOCS = {2: [[5, 2, 12, 9], [14, 14]], 4: [[5, 2, 20, 29], [14, 14, 28]]}
PACKED = {
    2: {
        "mamba2_sp_none": dict(family="mamba2", mode="sp_none"),
        "bamba_noattn_sp_virtual": dict(family="bamba", mode="sp_virtual", attention=False),
        "zamba2_noattn_sp_permute_a2a": dict(family="zamba2", mode="sp_permute_a2a", attention=False),
        "nemotron_h_noattn_ulysses": dict(family="nemotron_h", mode="ulysses", attention=False),
        "granitemoehybrid_noattn_sp_none": dict(family="granitemoehybrid", mode="sp_none", attention=False),
        "qwen3_5_noattn_sp_none": dict(family="qwen3_5", mode="sp_none", attention=False),
        # Kimi's KDA: the per-channel decay cut into documents with q, k, v and beta (cu_seqlens, row by row)
        "kimi_linear_noattn_sp_none": dict(family="kimi_linear", mode="sp_none", attention=False),
    },
    4: {"mamba2_sp_virtual": dict(family="mamba2", mode="sp_virtual")},
}


def ds_config(world: int, mode: str, **fields) -> dict:
    section = {"enabled": True, **MODES[mode], **fields}
    return {"train_micro_batch_size_per_gpu": BATCH, "sequence_parallel_size": world, SECTION: section}


def _inputs(seqlen: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf_models.VOCAB, (BATCH, seqlen), generator=g)
    gout = torch.randn(BATCH, seqlen, hf_models.VOCAB, generator=g)
    return ids, gout


def _call(model, family, ids, **kw):
    if family != "mamba2":  # Mamba2ForCausalLM has no position embedding
        kw.setdefault("position_ids", torch.arange(ids.shape[1]).expand_as(ids))
    return model(input_ids=ids, **kw).logits


def _grads(model) -> dict:
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def _oracle(run, dtypes=(torch.float32, torch.float64)) -> dict:
    """``run(dtype) -> (output, grads)`` of the unwrapped model in fp32 (the oracle) and with fp64 parameters;
    returns the fp32 results and, per tensor, how far the fp32 run is from the fp64 one (the oracle's own
    rounding, see the module docstring)."""
    (out, grads), (out64, grads64) = (run(dtype) for dtype in dtypes)
    spread = {"out": rel_err(out, out64), **{n: rel_err(g, grads64[n]) for n, g in grads.items()}}
    return {"out": out, "grads": grads, "spread": spread}


def _report(out, ref_out_local, grads, oracle) -> dict:
    """Errors of this rank's output shard (reduced over the ranks) and of every gradient (summed over the ranks)."""
    return {
        "out": sharded_rel_err(out.detach(), ref_out_local),
        "local_out": rel_err(out.detach(), ref_out_local),  # this rank's shard alone
        "grads": {n: summed_rel_err(g, oracle["grads"][n]) for n, g in grads.items()},
        "spread": oracle["spread"],
    }


# ---------------------------------------------------------------------------------------------------
# rank functions
# ---------------------------------------------------------------------------------------------------


def _model_case(world, opts, seed):
    from ds_mamba_spcp.data import shard_batch
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel

    fam, attention, extra = opts["family"], opts.get("attention", True), opts.get("extra", {})
    layout = MODES[opts["mode"]]["input_layout"]
    seqlen = PER_RANK[layout] * world
    ids, gout = _inputs(seqlen, seed)

    def build(dtype):
        model = hf_models.build(fam, attention=attention, seed=seed, dtype=dtype, **extra)
        return model.eval() if opts.get("eval") else model

    def unwrapped(dtype):
        ref = build(dtype)
        logits = _call(ref, fam, ids, use_cache=False)
        (logits * gout.to(dtype)).sum().backward()
        return logits.detach(), _grads(ref)

    oracle = _oracle(unwrapped)
    model = build(torch.float32)
    mpu = prepare_sequence_parallel(model, ds_config(world, opts["mode"]))
    group = mpu.get_sequence_parallel_group()
    if opts.get("zero3"):
        return _zero3_step(model, mpu, opts["mode"], fam, ids, gout, oracle)
    if opts.get("bug") == "attention_only":
        for m in model.modules():  # undo the mixers' wrapping: what DeepSpeed's HF integration alone gives
            if "_ds_mamba_spcp_mixer" in m.__dict__:
                del m.__dict__["forward"]
    pos = torch.arange(seqlen).expand_as(ids)
    local = shard_batch({"input_ids": ids, "position_ids": pos, "gout": gout}, group, layout=layout)
    kw = {} if fam == "mamba2" else {"position_ids": local["position_ids"]}
    logits = model(input_ids=local["input_ids"], **kw).logits  # use_cache left unset on purpose
    (logits * local["gout"]).sum().backward()
    return _report(logits, shard_batch(oracle["out"], group, layout=layout), _grads(model), oracle)


def _zero3_step(model, mpu, mode, fam, ids, gout, oracle):
    """The prepared model under deepspeed.initialize at ZeRO-3: one forward and backward of the same loss, the
    gradients DeepSpeed reduced (``safe_get_full_grad``, the same on every rank) against the oracle's. Each
    rank's loss share is scaled by ``grad_scale_for_engine`` (ZeRO-3 averages over the group), so the reduced
    gradient is the whole sequence's. The first backward is the one that fails when ZeRO-3 reduces a mixer's
    gradients before its own backward has run (see ``_hidden_states_positional``): reported, not raised."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ds_mamba_spcp.data import grad_scale_for_engine, shard_batch

    config = {
        **ds_config(mpu.get_sequence_parallel_world_size(), mode), "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
    }  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    local = shard_batch({"input_ids": ids, "position_ids": pos, "gout": gout}, group)
    kw = {} if fam == "mamba2" else {"position_ids": local["position_ids"]}
    try:
        logits = engine(input_ids=local["input_ids"], **kw).logits
        engine.backward((logits * local["gout"]).sum() * grad_scale_for_engine(engine))
    except Exception:  # noqa: BLE001 - reported (every rank fails alike, at the same place)
        return {"error": traceback.format_exc()}
    grads = {n: rel_err(safe_get_full_grad(p), oracle["grads"][n]) for n, p in model.named_parameters()}
    out = sharded_rel_err(logits.detach(), shard_batch(oracle["out"], group))
    return {"out": out, "grads": grads, "spread": oracle["spread"]}


def _mixer_case(world, opts, seed):
    """One Falcon-H1 mixer on its own: output, input gradient and parameter gradients."""
    from ds_mamba_spcp.data import shard_batch
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    layout = MODES[opts["mode"]]["input_layout"]
    seqlen = PER_RANK[layout] * world
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(BATCH, seqlen, hf_models.HIDDEN, generator=g, dtype=torch.float64)
    gout = torch.randn(BATCH, seqlen, hf_models.HIDDEN, generator=g, dtype=torch.float64)

    def unwrapped(dtype):
        mixer = hf_models.build(opts["family"], seed=seed, dtype=dtype).model.layers[0].mamba
        x = u.to(dtype).clone().requires_grad_()
        out = mixer(x)
        (out * gout.to(dtype)).sum().backward()
        return out.detach(), {**_grads(mixer), "u": x.grad}

    oracle = _oracle(unwrapped)
    model = hf_models.build(opts["family"], seed=seed)
    group = _sp_group(world)
    assert wrap_mamba2_mixers(model, group, ds_config(world, opts["mode"])) == 2
    mixer = model.model.layers[0].mamba
    x = shard_batch(u.float(), group, layout=layout).requires_grad_()
    out = mixer(x)
    (out * shard_batch(gout.float(), group, layout=layout)).sum().backward()
    rep = _report(out, shard_batch(oracle["out"], group, layout=layout), _grads(mixer), oracle)
    rep["grads"]["u"] = sharded_rel_err(x.grad, shard_batch(oracle["grads"]["u"], group, layout=layout))
    return rep


def _sp_group(world):
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
        parallel_state_sp.initialize_sequence_parallel(world)
    return parallel_state_sp.get_sequence_parallel_group()


def _raises(fn, exc, *needles) -> tuple[bool, str]:
    """(raised exc with every needle in its message, the message or what happened instead)."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        return all(n in msg for n in needles), msg
    except Exception as e:  # noqa: BLE001 - reported
        return False, f"raised {type(e).__name__} instead: {e}"
    return False, "did not raise"


def _checks(rank, world):
    """Behaviour of a prepared model at ``world`` ranks: generation, unsupported calls, configurations."""
    from ds_mamba_spcp.data import shard_batch
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel, sequence_parallel_disabled
    from tests.parse_count import parses

    out = {}
    group = _sp_group(world)
    seqlen = PER_RANK["contiguous"] * world
    ids, _ = _inputs(seqlen, 99)
    pos = torch.arange(seqlen).expand_as(ids)
    local = shard_batch({"input_ids": ids, "position_ids": pos}, group)
    ref = hf_models.build("bamba", seed=3).eval()
    model = hf_models.build("bamba", seed=3)
    with parses() as parsed:
        prepare_sequence_parallel(model, ds_config(world, "sp_none"))
    # the call reads its ds_config once (issue 43 item 4); 018f6c7: 1 load_mamba_sp_config and 3 ds_config_dict
    once = {"load_mamba_sp_config": 1, "ds_config_dict": 1, "accelerate_ds_config": 0}
    out["settings_parsed_once"] = (parsed == once, f"parsed {parsed}")
    # a sharded training step first: at 4 ranks DeepSpeed's attention replicates the 2 KV heads and rewrites
    # the attention modules' num_key_value_groups, which the generation below must not see
    model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits.sum().backward()
    model.eval()
    prompt = ids[:1, :6]

    def generate(m):
        return m.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)

    out["generate_raises"] = _raises(lambda: generate(model), NotImplementedError, "sequence_parallel_disabled")
    with sequence_parallel_disabled(model):
        same = torch.equal(generate(model), generate(ref))
    out["generate_disabled_matches_unwrapped"] = (same, "")
    out["use_cache_true_raises"] = _raises(
        lambda: model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=True),
        NotImplementedError, "use_cache=False",
    )  # fmt: skip
    mask = torch.ones_like(local["input_ids"])
    if rank == world - 1:
        mask[1, -2:] = 0  # right padding in the last rank's shard only: every rank must raise
    out["padding_raises_on_every_rank"] = _raises(
        lambda: model(input_ids=local["input_ids"], position_ids=local["position_ids"], attention_mask=mask),
        NotImplementedError, f"rank(s) [{world - 1}]", "seq_idx",
    )  # fmt: skip
    ones = torch.ones_like(local["input_ids"])
    try:
        model(input_ids=local["input_ids"], position_ids=local["position_ids"], attention_mask=ones)
        out["all_ones_mask_accepted"] = (True, "")
    except Exception as e:  # noqa: BLE001 - reported
        out["all_ones_mask_accepted"] = (False, repr(e))
    out["labels_raise"] = _raises(
        lambda: model(input_ids=local["input_ids"], position_ids=local["position_ids"], labels=local["input_ids"]),
        ValueError, "sequence_parallel_cross_entropy",
    )  # fmt: skip
    out["no_position_ids_raise"] = _raises(lambda: model(input_ids=local["input_ids"]), ValueError, "position_ids")
    seq_idx = torch.zeros_like(local["input_ids"], dtype=torch.int32)
    out["seq_idx_with_sdpa_attention_raises"] = _raises(
        lambda: model(input_ids=local["input_ids"], position_ids=local["position_ids"], seq_idx=seq_idx),
        NotImplementedError, "flash attention",
    )  # fmt: skip
    mixer = model.model.layers[0].mamba
    hidden = torch.randn(1, 4, hf_models.HIDDEN)
    model.train()
    out["mixer_called_with_cache_raises"] = _raises(lambda: mixer(hidden, cache=object()), NotImplementedError, "cache")
    out["eager_attention_raises"] = _raises(
        lambda: prepare_sequence_parallel(hf_models.build("bamba", attn="eager"), ds_config(world, "sp_none")),
        ValueError, "attn_implementation='sdpa'",
    )  # fmt: skip
    out["zigzag_with_attention_raises"] = _raises(
        lambda: prepare_sequence_parallel(hf_models.build("zamba2"), ds_config(world, "sp_virtual")),
        ValueError, '"input_layout": "contiguous"',
    )  # fmt: skip
    heads = world // 2  # not divisible by the group size
    out["attention_heads_not_divisible_raise"] = _raises(
        lambda: prepare_sequence_parallel(
            hf_models.build("bamba", num_attention_heads=heads, num_key_value_heads=heads), ds_config(world, "sp_none")
        ),
        ValueError, f"{heads} query and {heads} key/value heads",
    )  # fmt: skip
    mask4d = torch.zeros(BATCH, 1, local["input_ids"].shape[1], seqlen)
    out["custom_4d_mask_raises"] = _raises(
        lambda: model(input_ids=local["input_ids"], position_ids=local["position_ids"], attention_mask=mask4d),
        NotImplementedError, "non-2-D",
    )  # fmt: skip
    out["prepared_twice_raises"] = _raises(
        lambda: prepare_sequence_parallel(model, ds_config(world, "sp_none")), ValueError, "already prepared"
    )
    out["other_size_raises"] = _raises(
        lambda: prepare_sequence_parallel(hf_models.build("mamba2"), ds_config(2 * world, "sp_none")),
        ValueError, f"has {world} ranks",
    )  # fmt: skip
    return {k: (agree(ok), msg) for k, (ok, msg) in out.items()}


def _run_world(rank, world):
    out = {"cases": {}}
    cases = list(enumerate(CASES[world].items()))
    for i, (name, opts) in cases:
        if not opts.get("zero3"):
            run = _mixer_case if opts.get("level") == "mixer" else _model_case
            out["cases"][name] = run(world, opts, seed=10 * i)
    out["checks"] = _checks(rank, world)
    # last: ZeRO-3's initialize replaces torch.nn.functional.linear for the rest of the process
    for i, (name, opts) in cases:
        if opts.get("zero3"):
            out["cases"][name] = _model_case(world, opts, seed=10 * i)
    return out


def _run_packed(rank, world):
    out = {}
    for i, (name, opts) in enumerate(PACKED[world].items()):
        try:
            out[name] = _packed_case(world, opts, seed=10 * i)
        except Exception:  # noqa: BLE001 - reported per case (every rank raises alike at the op's entry)
            out[name] = {"error": traceback.format_exc()}
    return out


def _packed_case(world, opts, seed):
    """Packed rows: the prepared model with seq_idx against the unwrapped model on every document separately."""
    from ds_mamba_spcp.data import shard_batch
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel

    fam, attention = opts["family"], opts.get("attention", True)
    layout = MODES[opts["mode"]]["input_layout"]
    seqlen = PER_RANK["zigzag"] * world
    ids, gout = _inputs(seqlen, seed)
    seq_idx = torch.stack([
        torch.repeat_interleave(torch.arange(len(docs), dtype=torch.int32), torch.tensor(docs))
        for docs in PACKED_DOCS[world]
    ])  # fmt: skip
    assert seq_idx.shape == ids.shape

    def unwrapped(dtype):
        ref = hf_models.build(fam, attention=attention, seed=seed, dtype=dtype)
        rows = []
        for b, docs in enumerate(PACKED_DOCS[world]):
            bounds = torch.tensor([0, *docs]).cumsum(0).tolist()
            rows.append(
                torch.cat(
                    [_call(ref, fam, ids[b : b + 1, s:e], use_cache=False) for s, e in zip(bounds, bounds[1:])], 1
                )
            )
        logits = torch.cat(rows)
        (logits * gout.to(dtype)).sum().backward()
        return logits.detach(), _grads(ref)

    oracle = _oracle(unwrapped)
    model = hf_models.build(fam, attention=attention, seed=seed)
    group = prepare_sequence_parallel(model, ds_config(world, opts["mode"])).get_sequence_parallel_group()
    local = shard_batch({"input_ids": ids, "seq_idx": seq_idx, "gout": gout}, group, layout=layout)
    logits = model(input_ids=local["input_ids"], seq_idx=local["seq_idx"]).logits
    (logits * local["gout"]).sum().backward()
    return _report(logits, shard_batch(oracle["out"], group, layout=layout), _grads(model), oracle)


# ---------------------------------------------------------------------------------------------------
# multi-rank tests
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results2():
    return run_ranks(_run_world, 2, timeout=900)


@pytest.fixture(scope="module")
def results4():
    return run_ranks(_run_world, 4, timeout=900)


def _ids(table, keep=lambda name: True):
    pairs = [(w, name) for w in table for name in table[w] if keep(name)]
    return pairs, [f"world{w}-{name}" for w, name in pairs]


_MODEL_CASES, _MODEL_IDS = _ids(CASES, lambda name: not name.startswith("bug"))


def _assert_close(res: dict, where: str) -> None:
    """Every tensor within max(TOL, ORACLE_FACTOR x the oracle's own fp32-vs-fp64 spread) (module docstring)."""
    errs = {"out": res["out"], **res["grads"]}
    bounds = {k: max(TOL, ORACLE_FACTOR * res["spread"][k]) for k in errs}
    worst = max(errs, key=lambda k: errs[k] / bounds[k])
    loose = sorted(k for k in errs if bounds[k] > TOL)
    top = max(errs, key=errs.get)
    print(
        f"{where}: out {errs['out']:.2e}, largest {top} {errs[top]:.2e}, closest to its bound {worst} "
        f"{errs[worst]:.2e} (bound {bounds[worst]:.2e}); {len(loose)} of {len(errs)} bounds above {TOL:g}"
    )
    bad = {k: (errs[k], bounds[k]) for k in errs if not errs[k] <= bounds[k]}
    assert not bad, f"{where}: (error, bound) over the bound: {bad}"


@pytest.mark.parametrize("world,case", _MODEL_CASES, ids=_MODEL_IDS)
def test_matches_unwrapped_model(request, world, case):
    res = request.getfixturevalue(f"results{world}")[0]["cases"][case]
    assert "error" not in res, f"world {world} {case} raised:\n{res.get('error')}"
    _assert_close(res, f"world {world} {case}")
    assert len(res["grads"]) > 10 or CASES[world][case].get("level") == "mixer"


@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
def test_negative_control_attention_only_fails(results2, family):
    """DeepSpeed's attention sharding alone: the first shard's logits are right, the rest and the gradients not."""
    case = [r["cases"][f"bug_attention_only_{family}"] for r in results2]
    assert case[0]["local_out"] <= TOL  # rank 0's Mamba layers start from the zero state anyway
    assert case[1]["local_out"] > 100 * TOL
    assert max(case[0]["grads"].values()) > 100 * TOL, case[0]["grads"]
    with pytest.raises(AssertionError, match="over the bound"):
        _assert_close(case[0], "attention only")


CHECKS = [
    "generate_raises", "generate_disabled_matches_unwrapped", "use_cache_true_raises", "padding_raises_on_every_rank",
    "all_ones_mask_accepted", "labels_raise", "no_position_ids_raise", "seq_idx_with_sdpa_attention_raises",
    "mixer_called_with_cache_raises", "eager_attention_raises", "zigzag_with_attention_raises",
    "attention_heads_not_divisible_raise", "custom_4d_mask_raises", "prepared_twice_raises", "other_size_raises",
    "settings_parsed_once",
]  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("check", CHECKS)
def test_prepared_model_behaviour(request, world, check):
    ok, msg = request.getfixturevalue(f"results{world}")[0]["checks"][check]
    assert ok, f"world {world}, {check}: {msg}"


def _packed(world):
    return run_ranks(_run_packed, world, timeout=600)


@pytest.fixture(scope="module")
def packed2():
    return _packed(2)


@pytest.fixture(scope="module")
def packed4():
    return _packed(4)


_PACKED_CASES, _PACKED_IDS = _ids(PACKED)


@pytest.mark.packed
@pytest.mark.parametrize("world,case", _PACKED_CASES, ids=_PACKED_IDS)
def test_packed_rows_match_documents_run_separately(request, world, case):
    res = request.getfixturevalue(f"packed{world}")[0][case]
    assert "error" not in res, res.get("error")
    _assert_close(res, f"world {world} packed {case}")


# ---------------------------------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------------------------------


def _section(**fields) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "mamba_sequence_parallel": {"enabled": True, **fields}}


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_runs_its_pytorch_path(family):
    """The oracle: transformers' fused mamba-ssm call gives None here (no CUDA build of mamba-ssm, or CPU
    tensors), so its mixers run their own PyTorch SSD."""
    module = sys.modules[hf_models.MODULES[family]]
    fused = module.mamba2_split_conv1d_scan_combined
    s = hf_models.SSM
    d_inner, conv_dim = s["heads"] * s["headdim"], s["heads"] * s["headdim"] + 2 * s["ngroups"] * s["dstate"]
    zxbcdt = torch.randn(1, 8, d_inner + conv_dim + s["heads"])
    out = fused(zxbcdt, torch.randn(conv_dim, 4), None, torch.zeros(s["heads"]), -torch.ones(s["heads"]),
                D=torch.ones(s["heads"]), chunk_size=8, headdim=s["headdim"], ngroups=s["ngroups"])  # fmt: skip
    assert out is None


@pytest.mark.parametrize("family", FAMILIES)
def test_wrapped_model_keeps_checkpoints_and_is_the_model_in_one_process(family):
    """State_dict keys and tensors unchanged, checkpoints load both ways, the group of one is the model itself
    (bitwise), mixers keep their class, wrapping twice wraps nothing."""
    from ds_mamba_spcp.integrations.transformers import MIXER_CLASSES
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    plain, wrapped = hf_models.build(family, seed=1), hf_models.build(family, seed=1)
    keys = list(plain.state_dict())
    nmixers = sum(type(m).__name__ in MIXER_CLASSES for m in plain.modules())
    assert wrap_mamba2_mixers(wrapped, None, _section()) == nmixers > 0
    assert wrap_mamba2_mixers(wrapped, None, _section()) == 0
    assert list(wrapped.state_dict()) == keys
    assert [type(m) for m in wrapped.modules()] == [type(m) for m in plain.modules()]
    ids, _ = _inputs(20, 0)
    assert torch.equal(_call(wrapped, family, ids, use_cache=False), _call(plain, family, ids, use_cache=False))

    other = hf_models.build(family, seed=2)
    wrapped.load_state_dict(other.state_dict())  # an unwrapped checkpoint into the wrapped model
    assert torch.equal(_call(wrapped, family, ids, use_cache=False), _call(other, family, ids, use_cache=False))
    plain.load_state_dict(wrapped.state_dict())  # and back
    assert torch.equal(_call(plain, family, ids, use_cache=False), _call(other, family, ids, use_cache=False))
    assert all(m._z3_leaf for m in wrapped.modules() if type(m).__name__ in MIXER_CLASSES)


def test_generate_and_deepcopy_after_wrapping():
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    plain, wrapped = hf_models.build("nemotron_h", seed=4).eval(), hf_models.build("nemotron_h", seed=4).eval()
    wrap_mamba2_mixers(wrapped, None, _section())
    prompt, _ = _inputs(6, 1)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(wrapped.generate(prompt, **kw), plain.generate(prompt, **kw))
    twin = copy.deepcopy(wrapped)
    mixer = twin.model.layers[0].mixer
    assert mixer.__dict__["_ds_mamba_spcp_mixer"].mixer is mixer  # the copy's adapter drives the copy
    assert torch.equal(twin.generate(prompt, **kw), plain.generate(prompt, **kw))


def test_wrapping_delta_layers_installs_the_fla_stand_in(monkeypatch):
    """wrap_delta_layers asks for the stand-in of fla's refused kernel once it wraps a layer (delta.py
    ``_install_fla_stand_in``, which acts on CUDA machines only: tests/test_delta_rule.py), and not for a model with
    none left to wrap."""
    from ds_mamba_spcp.config import load_mamba_sp_config
    from ds_mamba_spcp.integrations.transformers import delta
    from ds_mamba_spcp.integrations.transformers.adapter import _Sharding

    asked = []
    monkeypatch.setattr(delta, "_install_fla_stand_in", lambda: asked.append(1))
    model, cfg = hf_models.build("qwen3_5", seed=3), load_mamba_sp_config(_section())
    assert delta.wrap_delta_layers(model, lambda: _Sharding(None, cfg)) > 0 and asked == [1]
    assert delta.wrap_delta_layers(model, lambda: _Sharding(None, cfg)) == 0 and asked == [1]


def test_deepcopy_of_a_wrapped_delta_model():
    """A Gated DeltaNet layer's adapter (delta.py, layers.copy_adapter) is deep-copied with its layer: the copy's
    adapter drives the copy, and the copy generates the unwrapped model's tokens."""
    from ds_mamba_spcp.config import load_mamba_sp_config
    from ds_mamba_spcp.integrations.transformers.adapter import _Sharding
    from ds_mamba_spcp.integrations.transformers.delta import wrap_delta_layers
    from ds_mamba_spcp.integrations.transformers.layers import MIXER_ATTR

    plain, wrapped = hf_models.build("qwen3_5", seed=3).eval(), hf_models.build("qwen3_5", seed=3).eval()
    cfg = load_mamba_sp_config(_section())
    assert wrap_delta_layers(wrapped, lambda: _Sharding(None, cfg)) > 0
    assert wrap_delta_layers(wrapped, lambda: _Sharding(None, cfg)) == 0  # wrapped once
    twin = copy.deepcopy(wrapped)
    layers = [m for m in twin.modules() if MIXER_ATTR in m.__dict__]
    assert layers and all(m.__dict__[MIXER_ATTR].mixer is m for m in layers)
    prompt, _ = _inputs(6, 1)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(twin.generate(prompt, **kw), plain.generate(prompt, **kw))


@pytest.mark.parametrize("family", list(hf_models.DELTA_MODULES))
def test_delta_families_pass_the_generation_checks(family):
    """The Gated DeltaNet families are taken by sequence_parallel_generate (refused by name before; the 2-rank runs:
    tests/test_prefill_hf.py ``test_delta_families_generate_one_process_tokens``), and a prompt too short for shards
    of conv_kernel_size - 1 tokens is left to plain generate (the count was d_conv of the Mamba2 mixers only)."""
    from ds_mamba_spcp.config import load_mamba_sp_config
    from ds_mamba_spcp.integrations.transformers import generation

    cfg = load_mamba_sp_config(ds_config(2, "sp_none"))
    model = hf_models.build(family)
    assert generation._model_problem(model, cfg, 2) is None
    assert generation._least_prompt(model, 2) == 2 * (hf_models.DELTA["d_conv"] - 1) + generation._FED


def test_mla_attention_is_found_and_sized_for_ulysses():
    """Kimi Linear's MLA (KimiLinearAttention: no k_proj / v_proj, values of v_head_dim narrower than its keys) is
    among the attention modules DeepSpeed's Ulysses attention shards, built at the keys' head dim (the values padded
    to it: layers.ulysses_attention; 2f6f4b8 did not find it, so its attention would have run on each rank's shard
    alone); values wider than the keys are refused by name (the 2-rank run: test_matches_unwrapped_model's
    kimi_linear_ulysses)."""
    from ds_mamba_spcp.integrations.transformers.layers import attention_modules, ulysses_dims

    found = attention_modules(hf_models.build("kimi_linear"))
    assert [type(m).__name__ for m in found] == ["KimiLinearAttention"]
    k = hf_models.KIMI
    assert ulysses_dims(found[0]) == (4, 4, k["qk_nope_head_dim"] + k["qk_rope_head_dim"])
    wide = attention_modules(hf_models.build("kimi_linear", v_head_dim=8))[0]
    with pytest.raises(ValueError, match="values of head dim 8 are wider than its queries and keys"):
        ulysses_dims(wide)


def test_disabled_config_leaves_the_model_alone():
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    plain, model = hf_models.build("bamba", seed=5), hf_models.build("bamba", seed=5)
    assert prepare_sequence_parallel(model, {"mamba_sequence_parallel": {"enabled": False}}) is None
    assert prepare_sequence_parallel(model, _section(sequence_parallel_size=1)) is None
    assert not any("_ds_mamba_spcp_mixer" in m.__dict__ for m in model.modules())
    wrap_mamba2_mixers(model, None, {"mamba_sequence_parallel": {"enabled": False}})
    ids, _ = _inputs(16, 2)
    assert torch.equal(_call(model, "bamba", ids), _call(plain, "bamba", ids))  # use_cache as transformers sets it
    with pytest.raises(ValueError, match='"enabled": true'):
        prepare_sequence_parallel(model, {"sequence_parallel_size": 2, "mamba_sequence_parallel": {"enabled": False}})
    with pytest.raises(RuntimeError, match="init_distributed"):
        prepare_sequence_parallel(model, _section(sequence_parallel_size=2))


@pytest.mark.parametrize(
    "family,extra,match",
    [
        ("nemotron_h", dict(mamba_hidden_act="relu"), "mamba_hidden_act"),
        ("bamba", dict(hidden_act="gelu"), "applies SiLU only"),
    ],
)
def test_unsupported_mixer_options_raise(family, extra, match):
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    with pytest.raises(NotImplementedError, match=match):
        wrap_mamba2_mixers(hf_models.build(family, **extra), None, _section())


def test_norm_group_size_other_than_n_groups_raises():
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    model = hf_models.build("zamba2")
    model.model.layers[0].mamba.norm.group_size = hf_models.SSM["heads"] * hf_models.SSM["headdim"]
    with pytest.raises(NotImplementedError, match="normalises groups of 32 channels"):
        wrap_mamba2_mixers(model, None, _section())


def test_deepspeed_registration_already_installed_raises():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_mamba_spcp.integrations.transformers.adapter import _install_dispatcher

    def uattn_wrapper(*args, **kwargs):  # the name DeepSpeed's register_with_transformers installs
        raise AssertionError("not called")

    key = "ds_mamba_spcp_test_attention"
    ALL_ATTENTION_FUNCTIONS[key] = uattn_wrapper
    try:
        with pytest.raises(ValueError, match="drop the register_with_transformers call"):
            _install_dispatcher(key)
    finally:
        del ALL_ATTENTION_FUNCTIONS[key]


def test_mixer_classes_exist_in_transformers():
    """A transformers release that renames a mixer class would silently leave it unwrapped: catch it here."""
    from ds_mamba_spcp.integrations.transformers import MIXER_CLASSES, mixer_classes

    assert sorted(c.__name__ for c in mixer_classes()) == sorted(MIXER_CLASSES)


def test_package_imports_without_transformers():
    """Without transformers the package imports and works; the integration says what to install."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import ds_mamba_spcp, ds_mamba_spcp.module, ds_mamba_spcp.integrations\n"
        "from ds_mamba_spcp.module import wrap_mamba2_mixers\n"
        "import torch; assert wrap_mamba2_mixers(torch.nn.Linear(2, 2), None, {}) == 0\n"
        "try:\n"
        "    import ds_mamba_spcp.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pip install 'ds_mamba_spcp[hf]'" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------------
# the example, through the deepspeed launcher
# ---------------------------------------------------------------------------------------------------

TRAIN_TOL = 1e-4
TRAIN_STEPS = 20
TRAIN_TINY = [
    "--seq-len", "32", "--vocab-size", "32", "--hidden-size", "32", "--pattern", "M*-M*", "--mamba-heads", "4",
    "--mamba-headdim", "8", "--ngroups", "2", "--d-state", "8", "--chunk-size", "8", "--attn-heads", "2",
    "--kv-heads", "2", "--steps", str(TRAIN_STEPS), "--no-progress",
]  # fmt: skip


def _load_example(name: str):
    """examples/<name>.py as a module (examples/ is not a package)."""
    key = f"ds_mamba_spcp_examples_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(REPO, "examples", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def test_train_hf_example_launcher_matches_single_process(tmp_path):
    """``deepspeed --num_gpus 2 examples/train_hf.py`` (2 CPU ranks; ZeRO-3, AdamW; attention and Mamba both
    sharded) against ``python examples/train_hf.py`` (transformers' own forward on whole sequences): the global
    loss of every step within 1e-4 relative. The two runs round differently (another implementation of the
    scan, sums reassociated across ranks), ~1e-6 per step, and AdamW carries that along for 20 steps; a wrong
    gradient (a lost state, a doubled or halved reduction) moves the loss by ~1e-2 from the first update."""
    from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers
    from tests.dist_utils import free_port

    config = os.path.join(REPO, "configs", "state_passing_zero3.json")
    script = os.path.join(REPO, "examples", "train_hf.py")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    logs = {name: tmp_path / f"{name}.jsonl" for name in ("dist", "ref")}
    port = free_port()
    argv = [*TRAIN_TINY, "--deepspeed_config", config]
    try:
        dist = subprocess.run(
            [launcher, "--master_port", str(port), "--num_gpus", "2", script, *argv, "--log-json", str(logs["dist"])],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        remove_deepspeed_shm_buffers(port)
    assert dist.returncode == 0, f"launcher failed:\n{dist.stdout[-4000:]}\n{dist.stderr[-4000:]}"
    _load_example("train_hf").main([*argv, "--log-json", str(logs["ref"])])  # the reference, in this process

    losses = {k: [json.loads(line)["loss"] for line in path.read_text().splitlines()] for k, path in logs.items()}
    assert len(losses["dist"]) == len(losses["ref"]) == TRAIN_STEPS
    first, last = sum(losses["ref"][:5]) / 5, sum(losses["ref"][-5:]) / 5
    assert last < 0.95 * first, f"the reference did not learn (mean loss {first:.4f} -> {last:.4f}): a weak test"
    err = max(abs(a - b) / abs(b) for a, b in zip(losses["dist"], losses["ref"]))
    print(f"train_hf.py, state_passing_zero3.json: max relative loss difference over {TRAIN_STEPS} steps {err:.2e}")
    assert err <= TRAIN_TOL
