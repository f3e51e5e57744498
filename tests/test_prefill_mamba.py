"""Sequence-parallel prefill of mamba-ssm's real ``MambaLMHeadModel`` (Mamba2 layers) into ``InferenceParams``
(ds_mamba_spcp.integrations.mamba_ssm.generation), on CPU at 2 and 4 gloo ranks, fp64.

The model imports without mamba-ssm's ``selective_scan_cuda`` through ``_upstream.mamba_lm_head_model`` (a
placeholder for the Mamba-1 extension it never calls). CPU-runnable flags: ``rms_norm=False`` (nn.LayerNorm, not
mamba-ssm's Triton RMSNorm), ``fused_add_norm=False``, ``residual_in_fp32=False`` (it would round the fp64
residual to fp32), Mamba2 ``rmsnorm=False`` and ``ngroups=1``, so that mamba-ssm's own decoding step takes its
plain-PyTorch path once its Triton ``selective_state_update`` is set aside (``cpu_step``; causal-conv1d's update
is absent on CPU already). The Mamba2 forward of a prefill is this package's op; mamba-ssm's own prefill (its
Triton scan) is the GPU test's oracle (tests/test_prefill_gpu.py).

1. the first layer's SSM and conv states against a plain recurrence written here (token by token: causal
   conv, SiLU, h <- exp(dt*A) h + dt B x; nothing of the package), relative RMS <= 1e-10 (fp64; the chunked
   scan and the recurrence differ by fp64 roundoff, ~1e-15);
2. every layer's states and the logits against mamba-ssm's own decoding step run over the whole prompt from
   the zero state (``seqlen_offset`` 1 from the first token, so every token goes through ``Mamba2.step``):
   relative RMS <= 1e-6, because that step takes ``A = -exp(A_log.float())``, fp32: a relative 6e-8 on each
   log-decay, |dt*A| <= ~0.02 per token over 26 tokens, ~1e-8 on the states (seen: ~1e-9);
3. every layer's states and the last token's logits at 2 and 4 ranks against the group of one (the op on
   the whole prompt in one process), relative RMS <= 1e-10, with shards of 3 tokens (d_conv - 1, the
   op's least) at 4 ranks so that the conv state spans two ranks;
4. greedy decoding after the sharded prefill (``sequence_parallel_generate_mamba``, 12 new tokens, prompts with
   a remainder for the step), every rank's tokens equal to those of mamba-ssm's step-only run (2.), whose
   smallest top-2 logit margin is checked to be far above that run's 1e-6 distance;
5. the negative control: each rank's layers starting from the zero state at its shard's border gives
   states off by > 1e-2 (slow decays, exp(A*dt) ~ 0.995 per token);
6. the InferenceParams as mamba-ssm's decoding step expects them: seqlen_offset, per-layer (conv_state,
   ssm_state) in ``allocate_inference_cache``'s shapes, strides and dtypes.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import agree, rel_err, run_ranks

TOL = 1e-10
STEP_TOL = 1e-6  # against mamba-ssm's own step, which rounds A to fp32 (see 2. above)
SIZES = dict(d_state=5, d_conv=4, expand=2, headdim=4, ngroups=1, chunk_size=8, rmsnorm=False)
D_MODEL, VOCAB, LAYERS, BATCH, NEW = 16, 40, 3, 2, 12
LENGTHS = {1: [26, 12], 2: [26], 4: [12]}  # local seqlen 13 / 3 at 2 / 4 ranks
GENERATE = {2: 27, 4: 26}  # remainders of 1 and 2 tokens go through the step


def tiny_mamba_lm(seed: int, dtype=torch.float64):
    """mamba-ssm's MambaLMHeadModel with CPU-runnable flags and slow decays (A in [-0.1, -0.03], dt ~ 0.05)."""
    from ds_mamba_spcp.ops.kernels.upstream import mamba_lm_head_model

    model_cls, config_cls = mamba_lm_head_model()
    cfg = config_cls(
        d_model=D_MODEL, n_layer=LAYERS, vocab_size=VOCAB, rms_norm=False, fused_add_norm=False,
        residual_in_fp32=False, pad_vocab_size_multiple=8, ssm_cfg=dict(layer="Mamba2", **SIZES),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_cls(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.03, 0.1, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(math.log(math.expm1(0.05)) + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.to(dtype).eval()


@contextlib.contextmanager
def cpu_step():
    """mamba-ssm's Mamba2.step on its plain-PyTorch path: its Triton selective_state_update set aside."""
    from ds_mamba_spcp.ops.kernels.upstream import mamba_module

    mamba2 = mamba_module("modules.mamba2")
    saved, mamba2.selective_state_update = mamba2.selective_state_update, None
    try:
        yield
    finally:
        mamba2.selective_state_update = saved


def step_only(model, ids: torch.Tensor, new: int = 0):
    """mamba-ssm's own step over every prompt token from the zero state, then ``new`` greedy tokens:
    (the per-layer (conv, ssm) states after the prompt, logits after the prompt, tokens (batch, seqlen + new),
    smallest top-2 margin of the new)."""
    from ds_mamba_spcp.ops.kernels.upstream import mamba_module

    params = mamba_module("utils.generation").InferenceParams(max_seqlen=ids.shape[1] + new, max_batch_size=BATCH)
    params.seqlen_offset = 1  # every token through Mamba2.step (its zero states allocated on first use)
    out, margin = [ids], float("inf")
    with torch.no_grad(), cpu_step():
        for t in range(ids.shape[1]):
            logits = model(ids[:, t : t + 1], inference_params=params, num_last_tokens=1).logits[:, -1]
        prompt_logits = logits
        states = {i: (c.clone(), s.clone()) for i, (c, s) in params.key_value_memory_dict.items()}
        for i in range(new):
            top = logits.topk(2, dim=-1).values
            margin = min(margin, float((top[:, 0] - top[:, 1]).min()))
            out.append(logits.argmax(-1)[:, None])
            if i + 1 < new:
                logits = model(out[-1], inference_params=params, num_last_tokens=1).logits[:, -1]
    return states, prompt_logits, torch.cat(out, 1), margin


def prompt(seqlen: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seqlen), generator=torch.Generator().manual_seed(seed))


def recurrence_states(model, ids: torch.Tensor):
    """Layer 0's (conv_state, ssm_state) after ``ids``, by the plain Mamba2 recurrence, token by token."""
    block = model.backbone.layers[0]
    m = block.mixer
    with torch.no_grad():
        zxbcdt = m.in_proj(block.norm(model.backbone.embedding(ids)))
        d_inner, conv_dim = m.d_inner, m.conv1d.weight.shape[0]
        xBC, dt = zxbcdt[..., d_inner : d_inner + conv_dim], zxbcdt[..., d_inner + conv_dim :]
        conv_state = F.pad(xBC.transpose(1, 2), (m.d_conv, 0))[..., -m.d_conv :]
        w = m.conv1d.weight[:, 0]  # (conv_dim, d_conv)
        padded = F.pad(xBC, (0, 0, m.d_conv - 1, 0))
        conv = sum(padded[:, k : k + ids.shape[1]] * w[:, k] for k in range(m.d_conv)) + m.conv1d.bias
        x, B, C = torch.split(F.silu(conv), [d_inner, m.ngroups * m.d_state, m.ngroups * m.d_state], dim=-1)
        A = -torch.exp(m.A_log)
        dt = F.softplus(dt + m.dt_bias)
        x = x.reshape(*x.shape[:2], m.nheads, m.headdim)
        B = B.reshape(*B.shape[:2], m.ngroups, m.d_state).repeat_interleave(m.nheads // m.ngroups, dim=2)
        h = torch.zeros(ids.shape[0], m.nheads, m.headdim, m.d_state, dtype=x.dtype)
        for t in range(ids.shape[1]):
            decay = torch.exp(dt[:, t] * A)[:, :, None, None]
            h = decay * h + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]
    return conv_state, h


def _states(params) -> dict:
    # numpy copies: tensors sent through the result queue would share memory with a finished process
    return {i: (c.numpy().copy(), s.numpy().copy()) for i, (c, s) in params.key_value_memory_dict.items()}


def _tensors(res: dict) -> dict:
    out = dict(res, logits=torch.from_numpy(res["logits"]))
    out["states"] = {i: (torch.from_numpy(c), torch.from_numpy(s)) for i, (c, s) in res["states"].items()}
    return out


def _prefill(rank, world, seqlen, seed, bug=False):
    from ds_mamba_spcp.integrations.mamba_ssm import generation as mamba_ssm

    model = tiny_mamba_lm(seed)
    ids = prompt(seqlen, seed)
    n = seqlen // world
    original = mamba_ssm.mixer_prefill
    if bug:  # the op on a group of one per rank: the state restarts at every shard border
        import deepspeed.comm as dist

        own = [dist.new_group([r]) for r in range(world)][rank]

        def restarting(zxbcdt, core, group, cfg):
            y, state, conv = original(zxbcdt, core, own, cfg)
            return y, mamba_ssm.broadcast_from_last(state, group), conv

        mamba_ssm.mixer_prefill = restarting
    try:
        logits, params = mamba_ssm.sequence_parallel_prefill_mamba(model, ids[:, rank * n : (rank + 1) * n])
    finally:
        mamba_ssm.mixer_prefill = original
    layout = {
        i: (tuple(c.shape), c.stride(), c.dtype, tuple(s.shape), s.dtype)
        for i, (c, s) in params.key_value_memory_dict.items()
    }
    return {
        "logits": logits.numpy().copy(),
        "states": _states(params),
        "offset": params.seqlen_offset,
        "layout": layout,
    }


def _run_world(rank, world):
    out = {}
    for seqlen in LENGTHS[world]:
        out[seqlen] = _prefill(rank, world, seqlen, seed=seqlen)
        if world == 2:
            out[f"bug{seqlen}"] = _prefill(rank, world, seqlen, seed=seqlen, bug=True)
    from ds_mamba_spcp.integrations.mamba_ssm.generation import sequence_parallel_generate_mamba

    seqlen = GENERATE[world]
    with cpu_step():
        tokens = sequence_parallel_generate_mamba(tiny_mamba_lm(seqlen), prompt(seqlen, seqlen), NEW)
    out["tokens"] = tokens.numpy().copy()
    out["agree"] = agree(True)
    return out


def _started_by_torch(rank, world):
    """Ranks started with torch.distributed.init_process_group alone: group=None is the world (it was a group of
    one on each rank). Reports the group size of every Mamba layer's op call and the prefill's states."""
    import deepspeed.comm as dist

    from ds_mamba_spcp import comm
    from ds_mamba_spcp.integrations.mamba_ssm import generation as mamba_ssm

    before, sizes, original = dist.is_initialized(), [], mamba_ssm.mixer_prefill

    def counting(zxbcdt, core, group, cfg, **kwargs):
        sizes.append(comm.group_rank_size(group)[1])
        return original(zxbcdt, core, group, cfg, **kwargs)

    mamba_ssm.mixer_prefill = counting
    try:
        res = _prefill(rank, world, LENGTHS[2][0], seed=LENGTHS[2][0])
    finally:
        mamba_ssm.mixer_prefill = original
    return dict(res, deepspeed_comm_before=before, sizes=sizes)


@pytest.fixture(scope="module")
def one_process():
    return {seqlen: _tensors(_prefill(0, 1, seqlen, seed=seqlen)) for seqlen in LENGTHS[1]}


@pytest.fixture(scope="module")
def upstream_step():
    """mamba-ssm's own step over the prompts (states, logits) and its greedy continuation of the generate prompts."""
    out = {}
    for seqlen in sorted(set(LENGTHS[1]) | set(GENERATE.values())):
        states, logits, tokens, margin = step_only(tiny_mamba_lm(seqlen), prompt(seqlen, seqlen), NEW)
        out[seqlen] = dict(logits=logits, tokens=tokens, margin=margin, states=states)
    return out


@pytest.fixture(scope="module")
def results2():
    return run_ranks(_run_world, 2, timeout=600)


@pytest.fixture(scope="module")
def results4():
    return run_ranks(_run_world, 4, timeout=600)


@pytest.mark.parametrize("seqlen", LENGTHS[1])
def test_group_of_one_matches_the_plain_recurrence(one_process, seqlen):
    model, ids = tiny_mamba_lm(seqlen), prompt(seqlen, seqlen)
    conv, ssm = recurrence_states(model, ids)
    got_conv, got_ssm = one_process[seqlen]["states"][0]
    assert rel_err(got_conv, conv) <= TOL
    assert rel_err(got_ssm, ssm) <= TOL, rel_err(got_ssm, ssm)
    assert one_process[seqlen]["offset"] == seqlen


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_states_and_logits_match_one_process(request, one_process, world):
    results = request.getfixturevalue(f"results{world}")
    for seqlen in LENGTHS[world]:
        want = one_process[seqlen]
        for rank, r in enumerate(results):
            got = _tensors(r[seqlen])
            errs = {"logits": rel_err(got["logits"], want["logits"])}
            for i, (c, s) in want["states"].items():
                errs[f"{i}.conv"] = rel_err(got["states"][i][0], c)
                errs[f"{i}.ssm"] = rel_err(got["states"][i][1], s)
            print(f"world {world} rank {rank} L {seqlen}: worst {max(errs.values()):.1e}")
            assert all(e <= TOL for e in errs.values()), errs
            assert got["offset"] == seqlen and got["layout"] == want["layout"]


def test_ranks_started_by_torch_distributed_share_the_prompt(one_process):
    seqlen = LENGTHS[2][0]
    results = run_ranks(_started_by_torch, 2, timeout=600, init="torch")
    want = one_process[seqlen]
    for rank, r in enumerate(results):
        assert not r["deepspeed_comm_before"]  # the case: only torch.distributed was initialised
        assert r["sizes"] and all(size == 2 for size in r["sizes"]), f"rank {rank}: op group sizes {r['sizes']}"
        got = _tensors(r)
        errs = [rel_err(got["states"][i][1], s) for i, (_, s) in want["states"].items()]
        assert max(errs) <= TOL and rel_err(got["logits"], want["logits"]) <= TOL, errs


def test_negative_control_state_restarting_at_borders(results2, one_process):
    seqlen = LENGTHS[2][0]
    got, want = _tensors(results2[0][f"bug{seqlen}"]), one_process[seqlen]
    errs = [rel_err(got["states"][i][1], want["states"][i][1]) for i in want["states"]]
    assert min(errs) > 1e-2, errs


def test_inference_params_have_mamba_ssms_layout(one_process):
    model = tiny_mamba_lm(0)
    for i, mixer in enumerate(layer.mixer for layer in model.backbone.layers):
        conv, ssm = mixer.allocate_inference_cache(BATCH, 30)
        have = one_process[26]["layout"][i]
        assert have == (tuple(conv.shape), conv.stride(), conv.dtype, tuple(ssm.shape), ssm.dtype)


def test_refuses_what_it_cannot_prefill():
    from ds_mamba_spcp.integrations.mamba_ssm.generation import (
        sequence_parallel_generate_mamba,
        sequence_parallel_prefill_mamba,
    )

    with pytest.raises(ValueError, match="no mamba-ssm Mamba2 mixer"):
        sequence_parallel_prefill_mamba(nn.Linear(2, 2), prompt(4, 0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sequence_parallel_generate_mamba(tiny_mamba_lm(0), prompt(4, 0), 0)


@pytest.mark.parametrize("tile", [2, 7, 26])
def test_chunked_prefill_matches_the_whole_prompt(one_process, tile):
    """Tiles through the whole model, states and conv tails carried (tile 2 < d_conv - 1: the carried tail
    spans several tiles) against the whole prompt in one call, fp64."""
    from ds_mamba_spcp.integrations.mamba_ssm.generation import chunked_prefill_mamba

    seqlen = 26
    logits, params = chunked_prefill_mamba(tiny_mamba_lm(seqlen), prompt(seqlen, seqlen), tile, max_seqlen=30)
    want = one_process[seqlen]
    assert rel_err(logits, want["logits"]) <= TOL
    for i, (c, s) in want["states"].items():
        conv, ssm = params.key_value_memory_dict[i]
        assert rel_err(conv, c) <= TOL and rel_err(ssm, s) <= TOL, (i, rel_err(conv, c), rel_err(ssm, s))
    assert params.seqlen_offset == seqlen


@pytest.mark.parametrize("seqlen", LENGTHS[1])
def test_group_of_one_matches_mamba_ssms_own_step(one_process, upstream_step, seqlen):
    """Every layer's cache and the logits after the prompt, against mamba-ssm's Mamba2.step token by token."""
    want, got = upstream_step[seqlen], one_process[seqlen]
    errs = {"logits": rel_err(got["logits"], want["logits"])}
    for i, (c, s) in want["states"].items():
        errs[f"{i}.conv"], errs[f"{i}.ssm"] = rel_err(got["states"][i][0], c), rel_err(got["states"][i][1], s)
    print(f"L {seqlen}: worst against mamba-ssm's step {max(errs.values()):.1e}")
    assert max(errs.values()) <= STEP_TOL, errs


@pytest.mark.parametrize("world", [2, 4])
def test_decoding_after_the_sharded_prefill(request, upstream_step, world):
    """12 greedy tokens through mamba-ssm's own step after the sharded prefill, on every rank, equal to the
    step-only run's; its smallest top-2 margin is far above the two runs' 1e-6 distance (so no tie decides)."""
    want = upstream_step[GENERATE[world]]
    print(f"world {world}: smallest margin of the step-only run {want['margin']:.2e}")
    assert want["margin"] > 1e3 * STEP_TOL, want["margin"]
    for rank, r in enumerate(request.getfixturevalue(f"results{world}")):
        assert torch.equal(torch.from_numpy(r["tokens"]), want["tokens"]), (rank, r["tokens"], want["tokens"])


def test_selective_scan_placeholder_names_the_missing_build():
    """The real model imports without selective_scan_cuda; the placeholder is gone afterwards and raises clearly."""
    import sys

    from ds_mamba_spcp.ops.kernels import upstream as _upstream

    tiny_mamba_lm(0)
    assert _upstream.SELECTIVE_SCAN not in sys.modules and "mamba_ssm" not in sys.modules
    interface = _upstream.mamba_module("ops.selective_scan_interface")
    if getattr(interface.selective_scan_cuda, "IS_PLACEHOLDER", False):
        with pytest.raises(RuntimeError, match="selective_scan_cuda is not built here"):
            interface.selective_scan_cuda.fwd()
