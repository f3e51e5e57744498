"""Sequence-parallel prefill of mamba-ssm Mamba2 models into ``InferenceParams``
(ds_mamba_spcp.inference.mamba_ssm), on CPU at 2 and 4 gloo ranks.

mamba-ssm's ``MambaLMHeadModel`` cannot be imported on a CPU build (its ``mixer_seq_simple`` imports
``selective_scan_cuda``), and its ``Mamba2`` forward and step run Triton kernels: the decoding test and
the comparison with mamba-ssm's own prefill are GPU tests (tests/test_prefill_gpu.py). Here a tiny LM
with ``MambaLMHeadModel``'s forward signature (``input_ids, inference_params, num_last_tokens``), built of
mamba-ssm's own ``Mamba2`` mixers (pre-norm residual blocks, plain-PyTorch RMSNorms), in fp64:

1. the first layer's SSM and conv states against a plain recurrence written here (token by token:
   causal conv, SiLU, h <- exp(dt*A) h + dt B x per group; nothing of the package), relative RMS
   <= 1e-10 (fp64; the chunked scan and the recurrence differ by fp64 roundoff, ~1e-15);
2. every layer's states and the last token's logits at 2 and 4 ranks against the group of one (the op on
   the whole prompt in one process), relative RMS <= 1e-10, with shards of 3 tokens (d_conv - 1, the
   op's least) at 4 ranks so that the conv state spans two ranks;
3. the negative control: each rank's layers starting from the zero state at its shard's border gives
   states off by > 1e-2 (slow decays, exp(A*dt) ~ 0.995 per token);
4. the InferenceParams as mamba-ssm's decoding step expects them: seqlen_offset, per-layer (conv_state,
   ssm_state) in ``allocate_inference_cache``'s shapes, strides and dtypes.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_utils import agree, rel_err, run_ranks

TOL = 1e-10
SIZES = dict(d_model=16, d_state=5, d_conv=4, expand=2, headdim=4, ngroups=2, chunk_size=8)
VOCAB, LAYERS, BATCH = 40, 3, 2
LENGTHS = {1: [26, 12], 2: [26], 4: [12]}  # local seqlen 13 / 3 at 2 / 4 ranks


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class TinyMambaLM(nn.Module):
    """MambaLMHeadModel's forward signature over mamba-ssm Mamba2 mixers (CPU-importable norms)."""

    def __init__(self, seed: int, dtype=torch.float64) -> None:
        super().__init__()
        from ds_mamba_spcp._upstream import mamba2_class

        torch.manual_seed(seed)
        mamba2 = mamba2_class()
        self.embedding = nn.Embedding(VOCAB, SIZES["d_model"])
        self.norms = nn.ModuleList(RMSNorm(SIZES["d_model"]) for _ in range(LAYERS))
        self.mixers = nn.ModuleList(mamba2(**SIZES, layer_idx=i) for i in range(LAYERS))
        self.norm_f = RMSNorm(SIZES["d_model"])
        self.lm_head = nn.Linear(SIZES["d_model"], VOCAB, bias=False)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("A_log"):  # slow decays: A in [-0.1, -0.03], dt ~ 0.05
                    p.copy_(torch.empty(p.shape).uniform_(0.03, 0.1, generator=g).log())
                elif name.endswith("dt_bias"):
                    p.copy_(math.log(math.expm1(0.05)) + 0.2 * torch.randn(p.shape, generator=g))
                elif p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        self.to(dtype)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        h = self.embedding(input_ids)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h), inference_params=inference_params)
        h = self.norm_f(h)
        if num_last_tokens > 0:
            h = h[:, -num_last_tokens:]
        return types.SimpleNamespace(logits=self.lm_head(h))


def prompt(seqlen: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seqlen), generator=torch.Generator().manual_seed(seed))


def recurrence_states(model: TinyMambaLM, ids: torch.Tensor):
    """Layer 0's (conv_state, ssm_state) after ``ids``, by the plain Mamba2 recurrence, token by token."""
    m = model.mixers[0]
    with torch.no_grad():
        zxbcdt = m.in_proj(model.norms[0](model.embedding(ids)))
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
    from ds_mamba_spcp.inference import mamba_ssm

    model = TinyMambaLM(seed)
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
    out["agree"] = agree(True)
    return out


@pytest.fixture(scope="module")
def one_process():
    return {seqlen: _tensors(_prefill(0, 1, seqlen, seed=seqlen)) for seqlen in LENGTHS[1]}


@pytest.fixture(scope="module")
def results2():
    return run_ranks(_run_world, 2, timeout=600)


@pytest.fixture(scope="module")
def results4():
    return run_ranks(_run_world, 4, timeout=600)


@pytest.mark.parametrize("seqlen", LENGTHS[1])
def test_group_of_one_matches_the_plain_recurrence(one_process, seqlen):
    model, ids = TinyMambaLM(seqlen), prompt(seqlen, seqlen)
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


def test_negative_control_state_restarting_at_borders(results2, one_process):
    seqlen = LENGTHS[2][0]
    got, want = _tensors(results2[0][f"bug{seqlen}"]), one_process[seqlen]
    errs = [rel_err(got["states"][i][1], want["states"][i][1]) for i in want["states"]]
    assert min(errs) > 1e-2, errs


def test_inference_params_have_mamba_ssms_layout(one_process):
    model = TinyMambaLM(0)
    for i, mixer in enumerate(model.mixers):
        conv, ssm = mixer.allocate_inference_cache(BATCH, 30)
        have = one_process[26]["layout"][i]
        assert have == (tuple(conv.shape), conv.stride(), conv.dtype, tuple(ssm.shape), ssm.dtype)


def test_refuses_what_it_cannot_prefill():
    from ds_mamba_spcp.inference.mamba_ssm import sequence_parallel_generate_mamba, sequence_parallel_prefill_mamba

    with pytest.raises(ValueError, match="no mamba-ssm Mamba2 mixer"):
        sequence_parallel_prefill_mamba(nn.Linear(2, 2), prompt(4, 0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sequence_parallel_generate_mamba(TinyMambaLM(0), prompt(4, 0), 0)


@pytest.mark.parametrize("tile", [2, 7, 26])
def test_chunked_prefill_matches_the_whole_prompt(one_process, tile):
    """Tiles through the whole model, states and conv tails carried (tile 2 < d_conv - 1: the carried tail
    spans several tiles) against the whole prompt in one call, fp64."""
    from ds_mamba_spcp.inference.mamba_ssm import chunked_prefill_mamba

    seqlen = 26
    logits, params = chunked_prefill_mamba(TinyMambaLM(seqlen), prompt(seqlen, seqlen), tile, max_seqlen=30)
    want = one_process[seqlen]
    assert rel_err(logits, want["logits"]) <= TOL
    for i, (c, s) in want["states"].items():
        conv, ssm = params.key_value_memory_dict[i]
        assert rel_err(conv, c) <= TOL and rel_err(ssm, s) <= TOL, (i, rel_err(conv, c), rel_err(ssm, s))
    assert params.seqlen_offset == seqlen
