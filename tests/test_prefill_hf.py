"""Sequence-parallel prefill and generation of transformers models (ds_mamba_spcp.integrations.transformers.generation)
against transformers in one process, on 2 and 4 gloo ranks.

Oracle. transformers' own ``model.generate(prompt)`` in one process (its PyTorch path: its chunked SSD, its
causal conv, its attention; ``test_hf.py::test_transformers_runs_its_pytorch_path`` checks that this is
what runs) and its own prefill ``model(prompt[:, :n*cp], use_cache=True)`` for the cache. For the
attention-free Nemotron-H, whose plain ``generate`` raises in transformers 5.24 (checked below), the oracle
is a greedy loop over the model's forward without any cache (every step recomputes the whole sequence).

Models: ``tests/hf_models.py``'s tiny configs (8 SSM heads in 2 groups, dstate 5, d_conv 4, chunk 8;
4 attention heads over 2 key/value heads) with slow decays (``sensitive``: per-token decay
exp(A*dt) ~ 0.995, so the state after the first shard still weighs on the last token; with
``hf_models.randomize``'s decays of ~0.7 per token a lost state would hardly change a token). Prompt
lengths: seqlen - 2 a multiple of the group (the prefill takes all but the last two tokens, the least
transformers' own continuation is left) and not (up to cp - 1 tokens more); at 4 ranks shards of 3 tokens
(the op's least, d_conv - 1), so the conv state takes columns from two ranks.

Checks per case, every rank reporting and the test asserting every rank's verdict:
- tokens: 12 new greedy tokens equal the oracle's, on every rank. The oracle's smallest top-2 logit
  margin along its tokens is asserted > 1e-3, so that a pass is not luck and a failure is not a near-tie
  (the sharded and the plain computation differ by fp32 roundoff, ~1e-6 relative).
- the cache: every Mamba layer's conv and SSM state and every attention layer's K/V against transformers'
  own prefill of the same tokens, relative RMS <= 1e-5: both are fp32 computations of the same sums in
  other orders (another scan, state passing across ranks; measured ~1e-7..1e-6); a state restarting at a
  shard border is off by > 1e-2 (the negative control below).
- negative control (every family, 2 ranks): the same prefill with each rank's Mamba layers starting from
  the zero state (the op on a group of one per rank) gives other tokens, and states off by > 1e-2.
- initialisations (all six families, 2 ranks): transformers' own initialisation at initializer_range 0.02
  and 0.5 instead of the test models' (``INITS``, see ``test_generation_at_transformers_init``).
- the Gated DeltaNet families (2 ranks, ``DELTA_CASES``): tokens, logits and cache as above, use_cache=False, left
  padding, short prompts, a prepared model; negative control: a zero recurrent state in the cache.
- bad input raised on every rank alike (padding on one rank only, shards of different lengths, too short
  a prompt, different prompts, sampling with unlike seeds, a cache passed in, unsupported models); sampling
  with like seeds gives the same tokens on every rank.
"""

from __future__ import annotations

import math
import time
import traceback

import pytest
import torch

from tests import hf_models

hf_models.import_models()  # before anything loads mamba-ssm's modules: see hf_models.import_models

from tests.dist_utils import agree, rel_err, run_ranks  # noqa: E402

STATE_TOL = 1e-5
MARGIN = 1e-3
NEW_TOKENS = 12
BATCH = 2
TIMEOUT = 900
FAMILIES = [("mamba2", True), ("bamba", True), ("falcon_h1", True), ("nemotron_h", True), ("nemotron_h", False)]
LENGTHS = {2: [27, 30], 4: [14, 15]}  # seqlen; seqlen - 2: 28 and 12 divide by the group, 25 and 13 leave 1


# Transformers' own initialisation (``hf_models.build(init=...)``) instead of the test models' (randomize, then
# ``sensitive``), all six families. At 0.02 the mixers add little to the residual stream. At 0.5 dt = softplus(in_proj
# + dt_bias) falls below Zamba2's and Nemotron-H's floor (time_step_min = 1e-3) in many heads: where their chunked
# (prefill) form and their decode step part, so a prompt token fed alone after the prefill would be computed otherwise
# than in one process (``_FED`` in inference/transformers.py). At 0.3 the floor binds in too few heads of these tiny
# models to show (a one-token continuation was off by 4e-6..5e-5 for Nemotron-H, within roundoff).
INITS = (0.02, 0.5)
INIT_SEQLEN = 21  # at 2 ranks seqlen - 1 divides by the group: a prefill of all but one token would leave one
INIT_TOKENS = 4
# Logits of the prefill and of every generated token against one process, relative RMS: both are fp32 computations
# of the same sums in other orders (another scan, a state passed between ranks, the last tokens through the chunked
# form on top of a cache); measured <= 2.7e-6 over the twelve cases. With the last prompt token fed alone (through
# the decode step) the same run measured 9e-5..1e-3 for Nemotron-H and Zamba2 at 0.5 (the negative control below
# shows it in one process). Greedy tokens: exactly equal.
LOGITS_TOL = 1e-5


def sensitive(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Slow decays: A in [-0.1, -0.03] and dt ~ softplus(dt_bias) ~ 0.05, so exp(A*dt) ~ 0.995 per token."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.03, 0.1, generator=g).log().to(p.dtype))
            elif name.endswith("dt_bias"):
                p.copy_((math.log(math.expm1(0.05)) + 0.2 * torch.randn(p.shape, generator=g)).to(p.dtype))
    model.generation_config.eos_token_id = None  # always NEW_TOKENS new tokens
    return model.eval()


def build(family: str, attention: bool, seed: int, **extra) -> torch.nn.Module:
    return sensitive(hf_models.build(family, attention=attention, seed=seed, **extra), seed)


def prompt(seqlen: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, hf_models.VOCAB, (BATCH, seqlen), generator=g)  # 0 is the pad token


GEN = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def positions(model, length: int) -> dict:
    """position_ids for a forward on ``length`` tokens from 0 (Mamba2ForCausalLM takes none)."""
    return {} if "mamba2" in type(model).__name__.lower() else {"position_ids": torch.arange(length)[None]}


def greedy_without_cache(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The oracle where transformers' generate fails: argmax of the last logits, the whole sequence each step."""
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, use_cache=False, **positions(model, ids.shape[1])).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids


def margin(model, tokens: torch.Tensor, seqlen: int) -> float:
    """The smallest top-2 gap of the logits that chose the generated tokens (one forward without cache)."""
    with torch.no_grad():
        kw = positions(model, tokens.shape[1] - 1)
        logits = model(input_ids=tokens[:, :-1], use_cache=False, **kw).logits[:, seqlen - 1 :]
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def oracle(model, ids: torch.Tensor, attention: bool, family: str) -> torch.Tensor:
    if family == "nemotron_h" and not attention:
        return greedy_without_cache(model, ids, NEW_TOKENS)
    return model.generate(ids, **GEN)


def cache_errors(cache, ref) -> dict:
    """Relative RMS error of every cached tensor (conv state, SSM state, K, V) against transformers' cache."""
    errs = {}
    for i, (layer, want) in enumerate(zip(cache.layers, ref.layers)):
        pairs = [(kind, getattr(layer, kind, {}).get(0), getattr(want, kind, {}).get(0))
                 for kind in ("conv_states", "recurrent_states")]  # fmt: skip
        pairs += [(kind, getattr(layer, kind, None), getattr(want, kind, None)) for kind in ("keys", "values")]
        for kind, got, expected in pairs:
            if expected is not None:
                same_shape = got is not None and got.shape == expected.shape
                errs[f"{i}.{kind}"] = rel_err(got, expected) if same_shape else float("inf")
    return errs


def own_prefill(model, ids: torch.Tensor, attention: bool, **kw):
    """transformers' own prefill (``use_cache=True``) and its cache. The attention-free Nemotron-H's forward
    with a plain DynamicCache raises (the mask asks the cache for a length it cannot give); it gets a
    ``PrefilledCache``, which only answers that length, filled by the model's own forward."""
    from ds_mamba_spcp.integrations.transformers.generation import PrefilledCache

    extra = {} if attention else {"cache": PrefilledCache(model.config)}
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **extra, **kw)
    return out, out.cache


# ---------------------------------------------------------------------------------------------------
# rank functions
# ---------------------------------------------------------------------------------------------------


def _case(rank, world, family, attention, seqlen, seed, bug=False):
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate, sequence_parallel_prefill

    model = build(family, attention, seed)
    ids = prompt(seqlen, seed)
    want = oracle(model, ids, attention, family)
    n = (seqlen - 2) // world  # as sequence_parallel_generate splits it
    _, ref_cache = own_prefill(model, ids[:, : n * world], attention)
    restore = _restart_states_at_borders(world) if bug else None
    try:
        got = sequence_parallel_generate(model, ids, **GEN)
        logits, cache = sequence_parallel_prefill(model, ids[:, rank * n : (rank + 1) * n])
    finally:
        if restore is not None:
            restore()
    with torch.no_grad():
        ref_logits = model(input_ids=ids[:, : n * world], use_cache=False).logits[:, -1]
    errs = cache_errors(cache, ref_cache)
    errs["logits"] = rel_err(logits, ref_logits)
    return {
        "same_tokens": agree(torch.equal(got, want)),
        "tokens": got[:, seqlen:].tolist(),
        "want": want[:, seqlen:].tolist(),
        "margin": margin(model, want, seqlen),
        "errs": errs,
        "length": cache.get_seq_length(),
    }


def _init_case(rank, world, family, init, seed):
    """Sharded generation of a model at transformers' own initialisation against one process: every step's logits,
    the prefill's logits and cache, the tokens."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate, sequence_parallel_prefill

    model = hf_models.build(family, seed=seed, init=init).eval()
    model.generation_config.eos_token_id = None
    ids = prompt(INIT_SEQLEN, seed)
    gen = dict(GEN, max_new_tokens=INIT_TOKENS, output_logits=True, return_dict_in_generate=True)
    want = model.generate(ids, **gen)
    got = sequence_parallel_generate(model, ids, **gen)
    n = (INIT_SEQLEN - 2) // world
    logits, cache = sequence_parallel_prefill(model, ids[:, rank * n : (rank + 1) * n])
    own, own_cache = own_prefill(model, ids[:, : n * world], True, logits_to_keep=1)
    want_logits = torch.stack(want.logits, 1)  # (batch, steps, vocab): the logits that chose the tokens
    top = want_logits.topk(2, dim=-1).values
    uncached = {}
    if init == max(INITS):  # use_cache=False: one process recomputes the chunked form of the whole sequence each step
        want_u = model.generate(ids, use_cache=False, **gen)
        got_u = sequence_parallel_generate(model, ids, use_cache=False, **gen)
        uncached = {
            "uncached_same_tokens": agree(torch.equal(got_u.sequences, want_u.sequences)),
            "uncached_steps": [rel_err(a, b) for a, b in zip(got_u.logits, want_u.logits)],
            "cached_vs_uncached": max(rel_err(a, b) for a, b in zip(want.logits, want_u.logits)),
        }
    return {
        **uncached,
        "same_tokens": agree(torch.equal(got.sequences, want.sequences)),
        "tokens": got.sequences[:, INIT_SEQLEN:].tolist(),
        "want": want.sequences[:, INIT_SEQLEN:].tolist(),
        "steps": [rel_err(a, b) for a, b in zip(got.logits, want.logits)],
        "prefill": rel_err(logits, own.logits[:, -1]),
        "cache": cache_errors(cache, own_cache),
        "margin": float((top[..., 0] - top[..., 1]).min()),
        "scale": float(want_logits.square().mean().sqrt()),
    }


def _restart_states_at_borders(world):
    """The negative control: every rank's Mamba layers run the op on a group of one (their own shard from the
    zero state, and no conv halo from the rank before); the cache gets the last shard's state (on every rank,
    so that they decode alike) and the conv tail gathered over the group."""
    import deepspeed.comm as dist

    from ds_mamba_spcp.inference import prefill
    from ds_mamba_spcp.integrations.transformers import generation as transformers

    singles = [dist.new_group([r]) for r in range(world)]
    own = singles[dist.get_rank()]
    original = transformers.mixer_prefill

    def restarting(zxbcdt, core, group, cfg, seq_idx=None):
        y, state, _ = original(zxbcdt, core, own, cfg)
        state = prefill.broadcast_from_last(state, group)  # the last shard's state alone, alike on every rank
        d_inner = core.A.shape[0] * core.headdim
        conv_dim, d_conv = core.conv1d_weight.shape
        return y, state, prefill.conv_tail(zxbcdt[..., d_inner : d_inner + conv_dim], d_conv, group)

    transformers.mixer_prefill = restarting

    def restore():
        transformers.mixer_prefill = original

    return restore


def _raises(fn, exc, *needles) -> tuple[bool, str]:
    try:
        fn()
    except exc as e:
        return all(n in str(e) for n in needles), str(e)[:300]
    except Exception as e:  # noqa: BLE001 - reported
        return False, f"raised {type(e).__name__} instead: {traceback.format_exc()[-1500:]}"
    return False, "did not raise"


def _bad_input(rank, world):
    """Every refusal raised on every rank (the verdicts all-reduced), and sampling with like seeds."""
    import transformers as tf

    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate, sequence_parallel_prefill

    out = {}
    model = build("bamba", True, 3)
    seqlen = 3 * world + 2
    ids = prompt(seqlen, 5)
    mask = torch.ones_like(ids)
    if rank == world - 1:
        mask[1, :2] = 0  # left padding on one rank only: another prompt there, every rank must raise
    out["mask_on_one_rank"] = _raises(
        lambda: sequence_parallel_generate(model, ids, attention_mask=mask, **GEN), ValueError, "attention_mask"
    )
    try:
        sequence_parallel_generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, pad_token_id=0)
        out["all_ones_mask_accepted"] = (True, "")
    except Exception as e:  # noqa: BLE001 - reported
        out["all_ones_mask_accepted"] = (False, repr(e))
    shard = ids[:, : 3 if rank == 0 else 4]  # rank 0 one token short
    out["shards_of_different_lengths"] = _raises(
        lambda: sequence_parallel_prefill(model, shard), ValueError, "same (batch, local_seqlen)"
    )
    other = ids.clone()
    if rank == 1:
        other[0, 0] += 1
    out["different_prompts"] = _raises(lambda: sequence_parallel_generate(model, other, **GEN), ValueError, "different")
    torch.manual_seed(100 + rank)
    sample = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0, pad_token_id=0)
    out["sampling_unlike_seeds"] = _raises(
        lambda: sequence_parallel_generate(model, ids, **sample), ValueError, "manual_seed"
    )
    torch.manual_seed(7)
    sampled = sequence_parallel_generate(model, ids, **sample)
    torch.manual_seed(7)
    alone = model.generate(ids, **sample)
    out["sampling_like_seeds_same_tokens"] = (torch.equal(sampled, alone), f"{sampled.tolist()} vs {alone.tolist()}")
    from transformers import DynamicCache

    out["cache_passed_in"] = _raises(
        lambda: sequence_parallel_generate(model, ids, cache=DynamicCache(config=model.config), **GEN),
        ValueError, "cache=",
    )  # fmt: skip
    llama = tf.LlamaForCausalLM(
        tf.LlamaConfig(vocab_size=hf_models.VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2)
    ).eval()  # fmt: skip
    out["attention_only_model"] = _raises(
        lambda: sequence_parallel_generate(llama, ids, **GEN), ValueError, "holds no Mamba2 mixer"
    )
    eager = build("bamba", True, 3, attn="eager")
    out["eager_attention"] = _raises(
        lambda: sequence_parallel_generate(eager, ids, **GEN), ValueError, "attn_implementation='sdpa'"
    )
    relu = build("nemotron_h", True, 3, mamba_hidden_act="relu")
    out["unsupported_activation"] = _raises(
        lambda: sequence_parallel_generate(relu, ids, **GEN), NotImplementedError, "mamba_hidden_act"
    )
    out["not_token_ids"] = _raises(
        lambda: sequence_parallel_generate(model, ids.float(), **GEN), ValueError, "tensor of token ids"
    )
    left = torch.ones_like(ids)
    left[0, :3] = 0
    biased = build("bamba", True, 3, mamba_proj_bias=True)
    out["padding_with_in_proj_bias"] = _raises(
        lambda: sequence_parallel_generate(biased, ids, attention_mask=left, **GEN), NotImplementedError, "in_proj"
    )
    empty = torch.ones_like(ids)
    empty[1] = 0
    out["row_without_tokens"] = _raises(
        lambda: sequence_parallel_generate(model, ids, attention_mask=empty, **GEN), ValueError, "row 1"
    )
    return {k: (agree(ok), msg) for k, (ok, msg) in out.items()}


def _example_model():
    """examples/generate.py's ``build_model`` (the issue's reproductions use it)."""
    import importlib.util
    import os

    from tests.dist_utils import REPO

    spec = importlib.util.spec_from_file_location("generate_example", os.path.join(REPO, "examples", "generate.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.build_model


def scores_margin(out) -> float:
    """The smallest top-2 gap of the scores that chose ``generate``'s tokens (``output_scores=True``)."""
    top = torch.stack(out.scores).topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def _use_cache_false(rank, world):
    """generation_config.use_cache = False (fine-tuning configs carry it), and use_cache=False passed: the tokens
    of one process's generate with it (its uncached recomputation), which equal its cached ones."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate

    model = _example_model()(0)
    ids = torch.randint(1, 64, (2, 97), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kw)
    model.generation_config.use_cache = False
    want = model.generate(ids, **kw)  # one process, no cache: the whole sequence again at every step
    out = {"margin": scores_margin(cached), "uncached_equals_cached": torch.equal(want, cached.sequences)}
    try:
        out["config"] = agree(torch.equal(sequence_parallel_generate(model, ids, **kw), want))
        model.generation_config.use_cache = True
        out["kwarg"] = agree(torch.equal(sequence_parallel_generate(model, ids, use_cache=False, **kw), want))
    except Exception:  # noqa: BLE001 - reported
        out["error"] = traceback.format_exc()[-1500:]
    return out


PADDED = [("bamba", True), ("mamba2", True)]  # a hybrid (attention + Mamba2) and an attention-free model
PAD_SEQLEN = 21  # 2 ranks: the prefill takes 18 tokens, generate's continuation the last three


def masked_cache_errors(cache, ref, mask: torch.Tensor) -> dict:
    """``cache_errors`` with K/V compared at the prompt's positions only (``mask`` (batch, L): 1 a token): what
    a padded position holds is masked out of every later attention, in both caches."""
    errs = {}
    for i, (layer, want) in enumerate(zip(cache.layers, ref.layers)):
        for kind in ("conv_states", "recurrent_states"):
            got, expected = getattr(layer, kind, {}).get(0), getattr(want, kind, {}).get(0)
            if expected is not None:
                errs[f"{i}.{kind}"] = rel_err(got, expected) if got.shape == expected.shape else float("inf")
        for kind in ("keys", "values"):
            got, expected = getattr(layer, kind, None), getattr(want, kind, None)
            if expected is not None:
                keep = mask[:, None, :, None].bool()
                errs[f"{i}.{kind}"] = rel_err(torch.where(keep, got, 0.0), torch.where(keep, expected, 0.0))
    return errs


def _padded_case(rank, world, family, attention, seed):
    """A left-padded batch of prompts of different lengths (attention_mask), and prompts that start with pad ids
    (no mask: generate derives one from pad_token_id): the tokens of one process's generate with them."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate, sequence_parallel_prefill

    model = build(family, attention, seed)
    ids = torch.randint(1, hf_models.VOCAB, (3, PAD_SEQLEN), generator=torch.Generator().manual_seed(seed))
    n = (PAD_SEQLEN - 2) // world  # as sequence_parallel_generate splits it
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # 7 pads: the padding ends inside rank 0's shard
    mask[2, : n * world] = 0  # the prefill holds only padding for this row: its three tokens come after
    padded_ids = ids.clone()
    padded_ids[0, :12] = 0  # pad ids (GEN's pad_token_id) in front of the prompt, across the shard border
    scored = dict(output_scores=True, return_dict_in_generate=True, **GEN)
    out = {}
    for name, prompt_ids, kw in [("mask", ids, {"attention_mask": mask}), ("pad_ids", padded_ids, {})]:
        want = model.generate(prompt_ids, **kw, **scored)
        plain = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), **GEN)  # padding as tokens
        res = {"margin": scores_margin(want), "padding_matters": not torch.equal(plain, want.sequences)}
        try:
            got = sequence_parallel_generate(model, prompt_ids, **kw, **GEN)
            res["same_tokens"] = agree(torch.equal(got, want.sequences))
            res["tokens"], res["want"] = got[:, PAD_SEQLEN:].tolist(), want.sequences[:, PAD_SEQLEN:].tolist()
        except Exception:  # noqa: BLE001 - reported
            res["error"] = traceback.format_exc()[-1500:]
        out[name] = res
    # the cache against transformers' own prefill of the same left-padded prefix
    prefix = mask[:, : n * world]
    positions = (prefix.cumsum(-1) - 1).masked_fill(prefix == 0, 0)
    kw = {} if family == "mamba2" else {"position_ids": positions}
    _, ref = own_prefill(model, ids[:, : n * world], attention, attention_mask=prefix, **kw)
    try:
        shard = slice(rank * n, (rank + 1) * n)
        cache = sequence_parallel_prefill(model, ids[:, shard], attention_mask_shard=mask[:, shard]).cache
        out["errs"] = masked_cache_errors(cache, ref, prefix)
        # negative control: the same prefill without the mask (the padding fed as tokens) against the same reference
        unmasked = sequence_parallel_prefill(model, ids[:, shard]).cache
        out["errs_without_mask"] = masked_cache_errors(unmasked, ref, prefix)
    except Exception:  # noqa: BLE001 - reported
        out["errs"] = {"error": traceback.format_exc()[-1500:]}
    inside = padded_ids.clone()
    inside[1, 9] = 0  # a pad id after the prompt's first token: generate masks it mid-row
    ok, msg = _raises(
        lambda: sequence_parallel_generate(model, inside, **GEN),
        NotImplementedError,
        "position 9 of row 1",
        "ones_like",
    )
    out["pad_id_inside_refused"] = (agree(ok), msg)
    right = torch.ones_like(ids)
    right[0, -3:] = 0
    ok, msg = _raises(
        lambda: sequence_parallel_generate(model, ids, attention_mask=right, **GEN), NotImplementedError, "left"
    )
    out["right_padding_refused"] = (agree(ok), msg)
    return out


def _short_prompts(rank, world):
    """At 2 ranks the shortest prompt the sharded prefill takes (cp * (d_conv - 1) + 2 tokens: the op's least shards
    and the two tokens left to generate) gives one process's tokens; shorter ones (a token less, one token), which
    every rank holds whole, are plain generate on every rank (refused before)."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate

    model = build("bamba", True, 4)
    need = world * (hf_models.SSM["d_conv"] - 1) + 2
    ids = prompt(need, 6)
    out = {}
    for name, k in (("shortest", need), ("one_short", need - 1), ("one_token", 1)):
        try:
            same = torch.equal(sequence_parallel_generate(model, ids[:, :k], **GEN), model.generate(ids[:, :k], **GEN))
            out[name] = (agree(same), "")
        except Exception as e:  # noqa: BLE001 - reported
            out[name] = (agree(False), repr(e))
    return out


def _prepared_model(rank, world, model=None, seed=12):
    """A model prepared for training (prepare_sequence_parallel) generates too (one process's tokens), and keeps its
    sharding after: Nemotron-H unless ``model`` is given."""
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel, sequence_parallel_generate

    model = build("nemotron_h", True, 11) if model is None else model
    ids = prompt(4 * world + 1, seed)
    want = model.generate(ids, **GEN)
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "sequence_parallel_size": world,
                 "mamba_sequence_parallel": {"enabled": True}}  # fmt: skip
    prepare_sequence_parallel(model, ds_config)
    got = sequence_parallel_generate(model, ids, **GEN)
    still = _raises(lambda: model.generate(ids, **GEN), NotImplementedError, "sequence_parallel_disabled")
    return {"same_tokens": agree(torch.equal(got, want)), "sharding_kept": (agree(still[0]), still[1])}


# The Gated DeltaNet families (integrations/transformers/delta.py), 2 ranks: hybrids (delta, attention, delta) of each
# family and the attention-free Qwen3.5 (two delta layers), one prompt length each, seqlen - 2 dividing by the group or
# leaving one token more for generate. hf_models.build_delta's models as they come (randomize: per-token decays
# exp(g) ~ 0.2..0.9): the zero-state control below shows that the state after the first shard still moves the tokens.
DELTA_CASES = {"qwen3_5": (True, 15), "qwen3_5_moe": (True, 16), "qwen3_next": (True, 15), "olmo_hybrid": (True, 16),
               "qwen3_5_noattn": (False, 15), "kimi_linear": (True, 16)}  # fmt: skip
DELTA_PADDED = 17  # qwen3_5, a left-padded batch: 2 ranks prefill 14 tokens


def _zero_delta_states():
    """The negative control: every Gated DeltaNet layer of the sharded prefill hands the cache a zero recurrent
    state (its conv state kept)."""
    from ds_mamba_spcp.integrations.transformers.delta import DeltaAdapter

    real = DeltaAdapter.forward

    def zeroed(self, hidden, seq_idx, decode_state=False):
        out = real(self, hidden, seq_idx, decode_state)
        return (out[0], torch.zeros_like(out[1]), out[2]) if decode_state else out

    DeltaAdapter.forward = zeroed

    def restore():
        DeltaAdapter.forward = real

    return restore


def _delta_case(rank, world, name, seed):
    """One delta family: generate's tokens and the logits that chose them against one process's, use_cache=False,
    the prefill's logits and cache against transformers' own prefill, and the zero-state control."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate, sequence_parallel_prefill

    attention, seqlen = DELTA_CASES[name]
    model = hf_models.build(name.replace("_noattn", ""), attention=attention, seed=seed).eval()
    model.generation_config.eos_token_id = None
    ids = prompt(seqlen, seed)
    n = (seqlen - 2) // world
    want = oracle(model, ids, attention, "nemotron_h" if not attention else name)  # attention-free: no generate
    with torch.no_grad():  # the logits that chose each token: one forward over the oracle's tokens, no cache
        want_logits = model(input_ids=want[:, :-1], use_cache=False).logits[:, seqlen - 1 :]
        whole = model(input_ids=ids[:, : n * world], use_cache=False).logits[:, -1]
    top = want_logits.topk(2, dim=-1).values
    gen = dict(GEN, output_logits=True, return_dict_in_generate=True)
    out = {"margin": float((top[..., 0] - top[..., 1]).min()), "want": want[:, seqlen:].tolist()}
    _, ref_cache = own_prefill(model, ids[:, : n * world], attention)
    for run in ("sharded", "zero_state"):
        restore = _zero_delta_states() if run == "zero_state" else None
        try:
            got = sequence_parallel_generate(model, ids, **gen)
            logits, cache = sequence_parallel_prefill(model, ids[:, rank * n : (rank + 1) * n])
        finally:
            if restore is not None:
                restore()
        out[run] = {
            "same_tokens": agree(torch.equal(got.sequences, want)),
            "tokens": got.sequences[:, seqlen:].tolist(),
            "steps": rel_err(torch.stack(got.logits, 1), want_logits),
            "prefill": rel_err(logits, whole),
            "cache": cache_errors(cache, ref_cache),
        }
    uncached = sequence_parallel_generate(model, ids, use_cache=False, **GEN)
    out["sharded"]["uncached_same_tokens"] = agree(torch.equal(uncached, want))
    return out


def _delta_padded(rank, world, seed):
    """A left-padded Qwen3.5 batch (one row padded into rank 0's shard, one whose prefilled part is all padding):
    one process's tokens, and the cache against transformers' own prefill of the padded prefix."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate, sequence_parallel_prefill

    model = hf_models.build("qwen3_5", seed=seed).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, hf_models.VOCAB, (3, DELTA_PADDED), generator=torch.Generator().manual_seed(seed))
    n = (DELTA_PADDED - 2) // world
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, : n * world] = 0
    want = model.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **GEN)
    plain = model.generate(ids, **GEN)
    out = {"margin": scores_margin(want), "padding_matters": not torch.equal(plain, want.sequences)}
    got = sequence_parallel_generate(model, ids, attention_mask=mask, **GEN)
    out["same_tokens"] = agree(torch.equal(got, want.sequences))
    out["tokens"], out["want"] = got[:, DELTA_PADDED:].tolist(), want.sequences[:, DELTA_PADDED:].tolist()
    prefix = mask[:, : n * world]
    positions = (prefix.cumsum(-1) - 1).masked_fill(prefix == 0, 0)
    _, ref = own_prefill(model, ids[:, : n * world], True, attention_mask=prefix, position_ids=positions)
    shard = slice(rank * n, (rank + 1) * n)
    cache = sequence_parallel_prefill(model, ids[:, shard], attention_mask_shard=mask[:, shard]).cache
    out["errs"] = masked_cache_errors(cache, ref, prefix)
    # negative control: the same prefill without the mask (the padding fed as tokens) against the same reference
    unmasked = sequence_parallel_prefill(model, ids[:, shard]).cache
    out["errs_without_mask"] = masked_cache_errors(unmasked, ref, prefix)
    # the shortest prompt the sharded prefill takes (cp * (K - 1) + 2) and one token less (plain generate)
    need = world * (hf_models.DELTA["d_conv"] - 1) + 2
    for name, k in (("shortest", need), ("one_short", need - 1)):
        out[name] = agree(
            torch.equal(sequence_parallel_generate(model, ids[:, :k], **GEN), model.generate(ids[:, :k], **GEN))
        )
    return out


def _delta_prepared(rank, world, seed):
    """A Qwen3-Next model prepared for training generates (one process's tokens) and keeps its sharding after."""
    model = hf_models.build("qwen3_next", seed=seed).eval()
    model.generation_config.eos_token_id = None
    return _prepared_model(rank, world, model, seed)


def _delta_world(rank, world):
    """The delta families' cases, each reporting its error instead of ending the group's other cases."""
    out = {}
    for i, name in enumerate([*DELTA_CASES, "padded", "prepared"]):
        try:
            if name == "padded":
                out[name] = _delta_padded(rank, world, 70)
            elif name == "prepared":
                out[name] = _delta_prepared(rank, world, 71)
            else:
                out[name] = _delta_case(rank, world, name, 60 + i)
        except Exception:  # noqa: BLE001 - reported
            out[name] = {"error": traceback.format_exc()[-1500:]}
    return out


def _run_world(rank, world):
    out = {"cases": {}}
    for i, (family, attention) in enumerate(FAMILIES):
        for seqlen in LENGTHS[world]:
            name = f"{family}{'' if attention else '_noattn'}_L{seqlen}"
            out["cases"][name] = _case(rank, world, family, attention, seqlen, seed=10 * i + seqlen)
        if world == 2:
            seqlen = LENGTHS[world][0]
            out["cases"][f"bug_{family}{'' if attention else '_noattn'}"] = _case(
                rank, world, family, attention, seqlen, seed=10 * i + seqlen, bug=True
            )
    if world == 2:
        out["bad_input"] = _bad_input(rank, world)
        start, out["inits"] = time.perf_counter(), {}
        for j, family in enumerate(hf_models.MODULES):
            for init in INITS:
                out["inits"][f"{family}@{init}"] = _init_case(rank, world, family, init, seed=40 + j)
        out["inits_seconds"] = time.perf_counter() - start
        out["use_cache_false"] = _use_cache_false(rank, world)
        out["padded"] = {f: _padded_case(rank, world, f, a, seed=40 + i) for i, (f, a) in enumerate(PADDED)}
        out["short"] = _short_prompts(rank, world)
        start = time.perf_counter()
        out["delta"] = _delta_world(rank, world)
        out["delta_seconds"] = time.perf_counter() - start
    out["prepared"] = _prepared_model(rank, world)
    return out


@pytest.fixture(scope="module")
def results2():
    return run_ranks(_run_world, 2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def results4():
    return run_ranks(_run_world, 4, timeout=TIMEOUT)


CASES = [
    (w, f"{fam}{'' if att else '_noattn'}_L{seqlen}") for w in (2, 4) for fam, att in FAMILIES for seqlen in LENGTHS[w]
]


@pytest.mark.parametrize("world,case", CASES, ids=[f"world{w}-{c}" for w, c in CASES])
def test_tokens_and_cache_match_one_process(request, world, case):
    results = request.getfixturevalue(f"results{world}")
    res = results[0]["cases"][case]
    print(f"world {world} {case}: margin {res['margin']:.2e}, worst cache error {max(res['errs'].values()):.2e}")
    assert res["margin"] > MARGIN, f"a near-tie in the oracle's tokens ({res['margin']:.1e}): pick another seed"
    assert res["same_tokens"], f"tokens {res['tokens']} != one process's {res['want']}"
    for rank, r in enumerate(results):
        bad = {k: e for k, e in r["cases"][case]["errs"].items() if not e <= STATE_TOL}
        assert not bad, f"rank {rank}: cached tensors over {STATE_TOL}: {bad}"
        assert r["cases"][case]["tokens"] == res["tokens"]
    seqlen = int(case.rsplit("_L", 1)[1])
    assert res["length"] == (seqlen - 2) // world * world
    assert len(res["errs"]) >= 3  # the logits and at least one layer's conv and SSM state were compared


@pytest.mark.parametrize("family,attention", FAMILIES, ids=[f"{f}{'' if a else '_noattn'}" for f, a in FAMILIES])
def test_negative_control_state_restarting_at_shard_borders(results2, family, attention):
    res = results2[0]["cases"][f"bug_{family}{'' if attention else '_noattn'}"]
    states = [e for k, e in res["errs"].items() if k.endswith("recurrent_states")]
    assert not res["same_tokens"], "a lost state gave the same tokens: the test models are not sensitive enough"
    assert max(states) > 1e-2, res["errs"]


INIT_CASES = [f"{family}@{init}" for family in hf_models.MODULES for init in INITS]


@pytest.mark.parametrize("case", INIT_CASES)
def test_generation_at_transformers_init(results2, case):
    """Every family at transformers' initialisation (0.02 and 0.5), 2 ranks, a prompt whose seqlen - 1 divides by the
    group: the logits of the prefill and of every generated token within LOGITS_TOL of one process's, the cache within
    STATE_TOL of transformers' own prefill, the tokens equal on every rank."""
    res = results2[0]["inits"][case]
    print(f"{case}: steps {max(res['steps']):.1e}, prefill {res['prefill']:.1e}, cache {max(res['cache'].values()):.1e}"
          f", margin {res['margin']:.1e}; the twelve cases took {results2[0]['inits_seconds']:.1f} s")  # fmt: skip
    # the top-2 gap far above the logits' error allowed (LOGITS_TOL x their RMS): a pass is no luck, a failure no tie
    assert res["margin"] > 100 * LOGITS_TOL * res["scale"], "a near-tie in the oracle's tokens: pick another seed"
    assert res["same_tokens"], f"tokens {res['tokens']} != one process's {res['want']}"
    for rank, r in enumerate(results2):
        c = r["inits"][case]
        assert max(c["steps"]) <= LOGITS_TOL, f"rank {rank}: logits of the generated tokens off by {c['steps']}"
        assert c["prefill"] <= LOGITS_TOL, f"rank {rank}: the prefill's logits off by {c['prefill']:.2e}"
        bad = {k: e for k, e in c["cache"].items() if not e <= STATE_TOL}
        assert not bad, f"rank {rank}: cached tensors over {STATE_TOL}: {bad}"
        assert len(c["cache"]) >= 2
    if "uncached_steps" in res:
        # use_cache=False: one process's tokens and logits without a cache (the chunked form at every step), which
        # for Zamba2 and Nemotron-H differ from the cached decode's (its step skips the dt floor: cached_vs_uncached,
        # the negative control, seen 1.1e-3 and 3.4e-3; before the fix the sharded path gave those)
        print(f"{case} use_cache=False: steps {max(res['uncached_steps']):.1e}, one process's cached decode "
              f"{res['cached_vs_uncached']:.1e} off its uncached one")  # fmt: skip
        assert res["uncached_same_tokens"], case
        for rank, r in enumerate(results2):
            steps = r["inits"][case]["uncached_steps"]
            assert max(steps) <= LOGITS_TOL, f"rank {rank}: use_cache=False logits off by {steps}"
        if case.split("@")[0] in ("zamba2", "nemotron_h"):
            assert res["cached_vs_uncached"] > 10 * LOGITS_TOL, res["cached_vs_uncached"]


@pytest.mark.parametrize("family,floor", [("zamba2", True), ("nemotron_h", True), ("bamba", False)])
def test_one_token_continuation_is_another_computation(family, floor):
    """Why sequence_parallel_generate leaves transformers' generate two prompt tokens (``_FED``), and the negative
    control of LOGITS_TOL. One process, initializer_range 0.5: the last prompt token fed alone on top of the cache
    of the others (the model's decode step), and the last two fed together (its chunked form, as in the sharded
    generation), against the whole prompt in the chunked form. Zamba2's and Nemotron-H's decode step skips the floor
    on dt (time_step_min) that their chunked form applies: one token is off by more than 5 x LOGITS_TOL (what a
    one-token continuation gave), two agree. Bamba (no floor) agrees either way. Should transformers' decode step
    apply the floor one day, the floor cases fail here and a one-token continuation would do again."""
    model = hf_models.build(family, seed=40, init=0.5).eval()
    ids = prompt(INIT_SEQLEN, 40)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits[:, -1]

        def continued(k):
            _, cache = own_prefill(model, ids[:, :-k], True)
            at = torch.arange(INIT_SEQLEN - k, INIT_SEQLEN)[None]
            return model(input_ids=ids[:, -k:], cache=cache, use_cache=True, position_ids=at).logits[:, -1]

        one, two = rel_err(continued(1), whole), rel_err(continued(2), whole)
    print(f"{family}: one token {one:.1e}, two tokens {two:.1e}")
    assert two <= LOGITS_TOL
    assert one > 5 * LOGITS_TOL if floor else one <= LOGITS_TOL


BAD = [
    "mask_on_one_rank", "all_ones_mask_accepted", "shards_of_different_lengths", "different_prompts",
    "sampling_unlike_seeds", "sampling_like_seeds_same_tokens", "cache_passed_in",
    "attention_only_model", "eager_attention", "unsupported_activation", "not_token_ids", "padding_with_in_proj_bias",
    "row_without_tokens",
]  # fmt: skip


@pytest.mark.parametrize("check", BAD)
def test_bad_input_raises_on_every_rank(results2, check):
    for rank, r in enumerate(results2):
        ok, msg = r["bad_input"][check]
        assert ok, f"rank {rank}, {check}: {msg}"


def test_use_cache_false_gives_one_process_tokens(results2):
    """generation_config.use_cache=False (or use_cache=False passed) once made generate feed the whole prompt again
    on top of the prefilled cache: other tokens, silently. The sharded path decodes from its cache regardless."""
    res = results2[0]["use_cache_false"]
    assert "error" not in res, res["error"]
    assert res["margin"] > MARGIN, f"a near-tie in the oracle's tokens ({res['margin']:.1e}): pick another seed"
    assert res["uncached_equals_cached"]  # one process: use_cache changes the recomputation, not the tokens
    assert res["config"] and res["kwarg"]


@pytest.mark.parametrize("family", [f for f, _ in PADDED])
@pytest.mark.parametrize("case", ["mask", "pad_ids"])
def test_left_padded_prompts_give_one_process_tokens(results2, family, case):
    """A left-padded batch (attention_mask; one row whose prefilled part is all padding) and prompts that start
    with pad ids (the mask generate derives from pad_token_id): one process's ``generate`` tokens on every rank."""
    for rank, r in enumerate(results2):
        res = r["padded"][family][case]
        assert "error" not in res, f"rank {rank}: {res['error']}"
        assert res["padding_matters"], "the padding does not change one process's tokens: the case tests nothing"
        assert res["margin"] > MARGIN, f"a near-tie in the oracle's tokens ({res['margin']:.1e}): pick another seed"
        assert res["same_tokens"], f"rank {rank}: tokens {res['tokens']} != one process's {res['want']}"


@pytest.mark.parametrize("family", [f for f, _ in PADDED])
def test_left_padded_cache_matches_transformers_prefill(results2, family):
    """Every Mamba state and conv state, and K/V at the prompt's positions, within STATE_TOL of transformers' own
    prefill of the same left-padded prefix (its masked mixers, its padding mask, generate's positions)."""
    for rank, r in enumerate(results2):
        errs = r["padded"][family]["errs"]
        assert "error" not in errs, f"rank {rank}: {errs['error']}"
        bad = {k: e for k, e in errs.items() if not e <= STATE_TOL}
        assert not bad, f"rank {rank}: cached tensors over {STATE_TOL}: {bad}"
        assert sum(k.endswith("recurrent_states") for k in errs) >= 1
        control = r["padded"][family]["errs_without_mask"]
        assert max(e for k, e in control.items() if k.endswith("recurrent_states")) > 1e-2, control


@pytest.mark.parametrize("family", [f for f, _ in PADDED])
@pytest.mark.parametrize("check", ["pad_id_inside_refused", "right_padding_refused"])
def test_padding_not_on_the_left_is_refused(results2, family, check):
    for rank, r in enumerate(results2):
        ok, msg = r["padded"][family][check]
        assert ok, f"rank {rank}: {msg}"


@pytest.mark.parametrize("check", ["shortest", "one_short", "one_token"])
def test_short_prompts_at_two_ranks(results2, check):
    for rank, r in enumerate(results2):
        ok, msg = r["short"][check]
        assert ok, f"rank {rank}, {check}: {msg}"


@pytest.mark.parametrize("world", [2, 4])
def test_prepared_model_generates_and_stays_prepared(request, world):
    res = request.getfixturevalue(f"results{world}")[0]["prepared"]
    assert res["same_tokens"]
    assert res["sharding_kept"][0], res["sharding_kept"][1]


@pytest.mark.parametrize("name", list(DELTA_CASES))
def test_delta_families_generate_one_process_tokens(results2, name):
    """A Gated DeltaNet family at 2 ranks: 12 greedy tokens equal one process's (``generate``; the attention-free
    model: a greedy loop without cache, as for Nemotron-H) on every rank, with use_cache=False too; the logits that
    chose them and the prefill's last logits within LOGITS_TOL of one process's forward without cache (same sums in
    other orders: the op's chunks and state passing, the decode step's recurrence; measured <= 3.3e-6); every delta
    layer's conv and recurrent state and every attention layer's K/V within STATE_TOL of transformers' own prefill
    (measured <= 2e-6). Negative control: the same run with a zero recurrent state in the cache gives other tokens,
    logits off by > 0.1 and states off by 1."""
    res = results2[0]["delta"][name]
    assert "error" not in res, res["error"]
    print(f"{name}: steps {res['sharded']['steps']:.1e}, prefill {res['sharded']['prefill']:.1e}, cache "
          f"{max(res['sharded']['cache'].values()):.1e}, margin {res['margin']:.1e}; the delta cases took "
          f"{results2[0]['delta_seconds']:.1f} s")  # fmt: skip
    assert res["margin"] > MARGIN, f"a near-tie in the oracle's tokens ({res['margin']:.1e}): pick another seed"
    for rank, r in enumerate(results2):
        got = r["delta"][name]["sharded"]
        assert got["same_tokens"], f"rank {rank}: tokens {got['tokens']} != one process's {res['want']}"
        assert got["uncached_same_tokens"], f"rank {rank}: use_cache=False gave other tokens"
        assert got["steps"] <= LOGITS_TOL and got["prefill"] <= LOGITS_TOL, (rank, got["steps"], got["prefill"])
        bad = {k: e for k, e in got["cache"].items() if not e <= STATE_TOL}
        assert not bad, f"rank {rank}: cached tensors over {STATE_TOL}: {bad}"
        assert sum(k.endswith("recurrent_states") for k in got["cache"]) == 2
    control = res["zero_state"]
    assert not control["same_tokens"] and control["steps"] > 0.1, control
    assert min(e for k, e in control["cache"].items() if k.endswith("recurrent_states")) > 1e-2, control["cache"]


def test_delta_left_padded_and_short_prompts(results2):
    """Qwen3.5, 2 ranks: a left-padded batch (the padding a document of its own, as for the Mamba2 families) gives one
    process's tokens, its cache within STATE_TOL of transformers' own prefill of the padded prefix (control: the same
    prefill without the mask is off by > 1e-2); the shortest prompt the sharded prefill takes and one token less
    (plain generate: a shard under K - 1 tokens raised before) give one process's tokens."""
    for rank, r in enumerate(results2):
        res = r["delta"]["padded"]
        assert "error" not in res, f"rank {rank}: {res['error']}"
        assert res["padding_matters"] and res["margin"] > MARGIN, res
        assert res["same_tokens"], f"rank {rank}: tokens {res['tokens']} != one process's {res['want']}"
        bad = {k: e for k, e in res["errs"].items() if not e <= STATE_TOL}
        assert not bad, f"rank {rank}: cached tensors over {STATE_TOL}: {bad}"
        control = res["errs_without_mask"]
        assert max(e for k, e in control.items() if k.endswith("recurrent_states")) > 1e-2, control
        assert res["shortest"] and res["one_short"]


def test_delta_prepared_model_generates_and_stays_prepared(results2):
    res = results2[0]["delta"]["prepared"]
    assert "error" not in res, res["error"]
    assert res["same_tokens"]
    assert res["sharding_kept"][0], res["sharding_kept"][1]


def _started_by_torch(rank, world):
    """Ranks started with torch.distributed.init_process_group alone (deepspeed.comm never initialised): group=None
    is the world (it was a group of one on each rank: each rank prefilled the whole prompt alone, silently).
    Reports the group size of every Mamba layer's op call and no verdict (``agree`` needs deepspeed.comm)."""
    import deepspeed.comm as dist

    from ds_mamba_spcp import comm
    from ds_mamba_spcp.integrations.transformers import generation as inference
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate

    model = build("bamba", True, 8)
    ids = prompt(9, 9)
    out = {"deepspeed_comm_before": dist.is_initialized(), "sizes": []}
    original = inference.mixer_prefill

    def counting(zxbcdt, core, group, cfg, **kwargs):
        out["sizes"].append(comm.group_rank_size(group)[1])
        return original(zxbcdt, core, group, cfg, **kwargs)

    inference.mixer_prefill = counting
    try:
        got = sequence_parallel_generate(model, ids, **GEN)
    finally:
        inference.mixer_prefill = original
    out["same_tokens"] = torch.equal(got, model.generate(ids, **GEN))
    return out


def test_ranks_started_by_torch_distributed_share_the_prompt():
    results = run_ranks(_started_by_torch, 2, timeout=TIMEOUT, init="torch")
    for rank, r in enumerate(results):
        assert not r["deepspeed_comm_before"]  # the case: only torch.distributed was initialised
        assert r["sizes"] and all(size == 2 for size in r["sizes"]), f"rank {rank}: op group sizes {r['sizes']}"
        assert r["same_tokens"]


# ---------------------------------------------------------------------------------------------------
# one process: a group of one is the model's own prefill
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,attention", FAMILIES, ids=[f"{f}{'' if a else '_noattn'}" for f, a in FAMILIES])
def test_group_of_one_is_the_models_own_prefill(family, attention):
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate, sequence_parallel_prefill

    model = build(family, attention, 21)
    ids = prompt(15, 22)
    logits, cache = sequence_parallel_prefill(model, ids)
    own, own_cache = own_prefill(model, ids, attention, logits_to_keep=1)
    assert torch.equal(logits, own.logits[:, -1])
    assert all(e == 0 for e in cache_errors(cache, own_cache).values())
    assert cache.get_seq_length() == 15
    assert torch.equal(sequence_parallel_generate(model, ids, **GEN), oracle(model, ids, attention, family))


@pytest.mark.parametrize("seqlen", [1, 2, 3])
def test_one_token_prompt_in_a_group_of_one(seqlen):
    """A prompt of at most the two tokens left to generate has nothing to prefill before generate's own first
    forward (a 1-token prompt crashed: a prefill of 0 tokens); three tokens prefill one."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate

    model = build("bamba", True, 23)
    ids = prompt(seqlen, 24)
    assert torch.equal(sequence_parallel_generate(model, ids, **GEN), model.generate(ids, **GEN))


def test_left_padded_prompts_in_a_group_of_one():
    """A group of one prefills with the model's own forward, given the padding mask and generate's positions."""
    from ds_mamba_spcp.integrations.transformers import sequence_parallel_generate

    model = build("bamba", True, 25)
    ids = prompt(9, 26)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    want = model.generate(ids, attention_mask=mask, **GEN)
    assert not torch.equal(want, model.generate(ids, **GEN))  # the padding changes the tokens
    assert torch.equal(sequence_parallel_generate(model, ids, attention_mask=mask, **GEN), want)


def test_attention_free_nemotron_h_plain_generate_fails_in_transformers():
    """Why the attention-free Nemotron-H needs PrefilledCache: transformers 5.24's own generate raises. If a
    release fixes it, this fails, and the oracle can become its generate."""
    model = build("nemotron_h", False, 1)
    with pytest.raises(ValueError, match="get_seq_length"):
        model.generate(prompt(9, 1), **GEN)


def test_generate_example_in_one_process():
    """examples/generate.py in a group of one (its 2-rank run: ``deepspeed --num_gpus 2 examples/generate.py``)."""
    import importlib.util
    import os

    from tests.dist_utils import REPO

    spec = importlib.util.spec_from_file_location("generate_example", os.path.join(REPO, "examples", "generate.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--prompt-len", "33", "--new-tokens", "4"])
