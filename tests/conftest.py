"""Shared builders of the test suite (plain functions: the spawned ranks import them too) and its fixtures.

- ``make_inputs``: random mixer-core inputs (zxbcdt and the parameters) and upstream gradients from one seed;
- ``case_inputs`` / ``call_op`` / ``run_case`` / ``run_error_case`` / ``check_case``: one sharded op case
  against the single-process reference (the ulysses and permute suites);
- ``make_mixer`` / ``ground_truth``: a small randomised mamba-ssm ``Mamba2`` and its single-device forward;
- ``load_train`` / ``TINY`` / ``sgd_config``: examples/train.py as a module, its smallest model's arguments, a
  shipped config with plain SGD at a given ZeRO stage;
- ``TinyLM`` / ``tiny_lm_data`` / ``tiny_lm_single_process_grads`` / ``full_param``: a one-mixer model under
  ``deepspeed.initialize`` and its single-process gradients.

Tolerances of ``run_case`` (``FP64_TOL``, ``FP32_TOL``): fp64, every sum is the reference's own up to
reassociation (~1e-15 relative; 1e-10 still catches a misplaced chunk or head, >= 1e-3, see the negative
controls); fp32, the same argument at fp32's unit roundoff grown over a few hundred accumulations:
relative RMS 1e-5.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from tests.dist_utils import REPO, agree, rel_err, sharded_rel_err, summed_rel_err

FP64_TOL = 1e-10
FP32_TOL = 1e-5

# ---------------------------------------------------------------------------------------------
# mixer-core inputs
# ---------------------------------------------------------------------------------------------


def make_inputs(*, batch, seqlen, nheads, headdim, ngroups, dstate, d_conv, dtype=torch.float64, seed=0, bias=True,
                D2=False, rms=False, init=False, final=False, a_offset=0.5):  # fmt: skip
    """Global inputs and upstream gradients, identical on every rank (one seed): (tensors, grads).

    tensors: zxbcdt (batch, seqlen, d_in_proj), conv1d_weight, conv1d_bias (``bias``), dt_bias,
    A in [-(1 + a_offset), -a_offset], D ((nheads, headdim) with ``D2``), rmsnorm_weight (``rms``),
    initial_states (``init``); grads: out, and final (``final``). Draws in that order, in fp64, then cast.
    """
    g = torch.Generator().manual_seed(seed)
    d_inner = nheads * headdim
    conv_dim = d_inner + 2 * ngroups * dstate

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    t = dict(zxbcdt=rnd(batch, seqlen, 2 * d_inner + 2 * ngroups * dstate + nheads))
    t["conv1d_weight"] = rnd(conv_dim, d_conv, scale=0.5)
    if bias:
        t["conv1d_bias"] = rnd(conv_dim, scale=0.5)
    t["dt_bias"] = rnd(nheads, scale=0.5)
    t["A"] = -torch.rand(nheads, generator=g, dtype=torch.float64).add(a_offset).to(dtype)
    t["D"] = rnd(nheads, headdim) if D2 else rnd(nheads)
    if rms:
        t["rmsnorm_weight"] = rnd(d_inner, scale=0.3).add(1.0)
    if init:
        t["initial_states"] = rnd(batch, nheads, headdim, dstate)
    grads = dict(out=rnd(batch, seqlen, d_inner))
    if final:
        grads["final"] = rnd(batch, nheads, headdim, dstate)
    return t, grads


# ---------------------------------------------------------------------------------------------
# one sharded op case against the reference (opts: dtype, batch, nheads, ngroups, d_conv, chunk, ...)
# ---------------------------------------------------------------------------------------------

HEADDIM, DSTATE = 2, 4


def case_inputs(opts, seqlen, seed=0):
    """``make_inputs`` for a case's options."""
    return make_inputs(
        batch=opts.get("batch", 2), seqlen=seqlen, nheads=opts.get("nheads", 8), headdim=HEADDIM,
        ngroups=opts["ngroups"], dstate=DSTATE, d_conv=opts.get("d_conv", 4),
        dtype=getattr(torch, opts.get("dtype", "float64")), seed=seed, bias=not opts.get("nobias"),
        D2=bool(opts.get("D2")), rms=bool(opts.get("rms")), init=bool(opts.get("init")), final=bool(opts.get("final")),
    )  # fmt: skip


def call_op(fn, inputs, opts, headdim=HEADDIM, **extra):
    """``fn`` (an op with mamba-ssm's arguments) on a case's inputs and options."""
    return fn(
        inputs["zxbcdt"], inputs["conv1d_weight"], inputs.get("conv1d_bias"), inputs["dt_bias"], inputs["A"],
        inputs["D"], opts.get("chunk", 8), headdim=headdim, ngroups=opts["ngroups"],
        dt_limit=opts.get("dt_limit", (0.0, float("inf"))), rmsnorm_weight=inputs.get("rmsnorm_weight"),
        norm_before_gate=opts.get("before", False), initial_states=inputs.get("initial_states"),
        return_final_states=opts.get("final", False), **extra,
    )  # fmt: skip


def run_case(rank, world, opts, sharded_op, inputs=case_inputs, headdim=HEADDIM):
    """Errors of ``sharded_op(zxbcdt_shard, ..., **common kwargs)`` against the reference.

    ``inputs(opts, seqlen)`` builds the global tensors and gradients (a suite's own sizes), ``headdim`` goes
    with them. Returns {"errs": {tensor: global relative error}, "checks": {name: bool}, "ok": bool}.
    """
    import deepspeed.comm as dist

    from ds_mamba_spcp import mamba_split_conv1d_scan_ref
    from ds_mamba_spcp.engine import layout

    seq_layout = opts.get("layout", "contiguous")
    seqlen = opts["per_rank"] * world
    tensors, grads = inputs(opts, seqlen)

    def loss_of(res, gout, weight):
        out, final = res if isinstance(res, tuple) else (res, None)
        loss = (out * gout).sum()
        if final is not None:
            loss = loss + weight * (final * grads["final"].to(final.dtype)).sum()
        return out, final, loss

    ref_in = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    ref_out, ref_final, ref_loss = loss_of(
        call_op(mamba_split_conv1d_scan_ref, ref_in, opts, headdim=headdim), grads["out"], 1.0
    )
    ref_loss.backward()

    # each rank takes a different share of final_states' gradient (the shares must add up)
    shard = lambda x: layout.shard_sequence(x, rank, world, seq_layout)  # noqa: E731
    sp_in = {k: (shard(v) if k == "zxbcdt" else v).clone().requires_grad_() for k, v in tensors.items()}
    weight = (rank + 1) / (world * (world + 1) / 2)
    sp_out, sp_final, sp_loss = loss_of(sharded_op(sp_in), shard(grads["out"]), weight)
    sp_loss.backward()

    errs = {"out": sharded_rel_err(sp_out.detach(), shard(ref_out.detach()))}
    errs["dzxbcdt"] = sharded_rel_err(sp_in["zxbcdt"].grad, shard(ref_in["zxbcdt"].grad))
    for k in tensors:
        if k != "zxbcdt":
            errs["d" + k] = summed_rel_err(sp_in[k].grad, ref_in[k].grad)
    checks = {}
    if ref_final is not None:
        e = torch.tensor([rel_err(sp_final, ref_final)], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        errs["final_states"] = e.item()
        copies = [torch.empty_like(sp_final) for _ in range(world)]
        dist.all_gather(copies, sp_final.detach().contiguous())
        checks["final_states_identical_on_ranks"] = agree(all(torch.equal(c, copies[0]) for c in copies))
        checks["final_states_fp32_or_wider"] = sp_final.dtype in (torch.float32, torch.float64)
    if "initial_states" in tensors:
        # the whole gradient lands on group rank 0: zeros elsewhere
        checks["dinitial_states_zero_off_rank0"] = agree(rank == 0 or not sp_in["initial_states"].grad.any())
    tol = FP64_TOL if opts["dtype"] == "float64" else FP32_TOL
    ok = agree(all(v <= tol for v in errs.values()) and all(checks.values()))
    return {"errs": errs, "checks": checks, "ok": ok}


def run_error_case(rank, world, opts, sharded_op):
    """Calls the op with a bad configuration; returns (exception type name, message) or None."""
    opts = dict(opts)
    opts.setdefault("per_rank", 6)
    seqlen = opts["per_rank"] * world
    tensors, _ = case_inputs(opts, seqlen)
    from ds_mamba_spcp.engine import layout

    local = layout.shard_sequence(tensors["zxbcdt"], rank, world, "contiguous")
    if opts.get("layout") == "zigzag":
        local = tensors["zxbcdt"][:, : opts["per_rank"]]  # odd lengths cannot be sharded as zigzag
    if rank == 0 and opts.get("rank0_extra"):
        local = torch.cat([local, local[:, : opts["rank0_extra"]]], dim=1)
    try:
        sharded_op({**tensors, "zxbcdt": local})
    except Exception as e:  # noqa: BLE001 - reported to the test, which checks type and message
        return type(e).__name__, str(e)
    return None


def check_case(world, results, case, opts):
    if "skipped" in results[0][case]:
        pytest.skip(f"world {world}: {results[0][case]['skipped']}")
    tol = FP64_TOL if opts["dtype"] == "float64" else FP32_TOL
    errs, checks = results[0][case]["errs"], results[0][case]["checks"]
    assert all(r[case]["ok"] == results[0][case]["ok"] for r in results)  # ranks agree
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"world {world}, {case}: errors over {tol}: {bad} (all: {errs})"
    assert all(checks.values()), f"world {world}, {case}: failed checks {checks}"
    assert results[0][case]["ok"]
    expected = {"out", "dzxbcdt", "dconv1d_weight", "ddt_bias", "dA", "dD"}
    assert expected <= set(errs)


# ---------------------------------------------------------------------------------------------
# a small mamba-ssm Mamba2 (run in the test process and in the ranks)
# ---------------------------------------------------------------------------------------------

MIXER_D_MODEL, MIXER_D_STATE, MIXER_D_CONV, MIXER_EXPAND, MIXER_HEADDIM, MIXER_CHUNK = 8, 4, 4, 2, 4, 4  # nheads = 4
MIXER_BATCH, MIXER_PER_RANK = 2, 8  # per-rank tokens: two zigzag chunks of 4 >= d_conv - 1

MIXERS = {
    "rms_Dh_g2_bias_dtlim": dict(ngroups=2, rmsnorm=True, D_has_hdim=True, bias=True, dt_limit=(0.05, 5.0)),
    "gate_g1": dict(ngroups=1, rmsnorm=False),
    "rmsbefore_g4": dict(ngroups=4, rmsnorm=True, norm_before_gate=True),
}


def make_mixer(variant: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A small Mamba2 with every parameter randomised (decays of order one per shard, so the state
    passed between ranks matters)."""
    from ds_mamba_spcp.ops.kernels.upstream import mamba2_class

    opts = {**MIXERS[variant], **overrides}
    torch.manual_seed(seed)
    m = mamba2_class()(
        d_model=opts.pop("d_model", MIXER_D_MODEL), d_state=MIXER_D_STATE, d_conv=MIXER_D_CONV, expand=MIXER_EXPAND,
        headdim=opts.pop("headdim", MIXER_HEADDIM), chunk_size=MIXER_CHUNK, **opts,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        m.A_log.copy_(torch.rand(m.nheads, generator=g).add(0.5).log())  # A in [-1.5, -0.5]
        m.dt_bias.copy_(torch.randn(m.nheads, generator=g) * 0.5 - 1.0)  # dt ~ softplus(-1) ~ 0.3
        m.D.copy_(torch.randn(m.D.shape, generator=g))
        m.conv1d.bias.copy_(torch.randn(m.conv1d.bias.shape, generator=g) * 0.3)
        if m.rmsnorm:
            m.norm.weight.copy_(1.0 + 0.3 * torch.randn(m.norm.weight.shape, generator=g))
        for lin in (m.in_proj, m.out_proj):
            if lin.bias is not None:
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.3)
    return m.to(dtype)


def ground_truth(m, u):
    """Mamba2.forward's memory-efficient path on one device, on the reference core."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_ref

    A = -torch.exp(m.A_log.to(torch.promote_types(m.A_log.dtype, torch.float32)))
    D = rearrange(m.D, "(h p) -> h p", p=m.headdim) if m.D_has_hdim else m.D
    y = mamba_split_conv1d_scan_ref(
        m.in_proj(u), rearrange(m.conv1d.weight, "d 1 w -> d w"), m.conv1d.bias, m.dt_bias, A, D, m.chunk_size,
        dt_limit=m.dt_limit, headdim=m.headdim, ngroups=m.ngroups, activation=m.activation,
        rmsnorm_weight=m.norm.weight if m.rmsnorm else None, rmsnorm_eps=m.norm.eps if m.rmsnorm else 1e-6,
        norm_before_gate=m.norm_before_gate,
    )  # fmt: skip
    return F.linear(y, m.out_proj.weight, m.out_proj.bias)


# ---------------------------------------------------------------------------------------------
# examples/train.py
# ---------------------------------------------------------------------------------------------

TRAIN_STEPS = 20
CONFIGS = os.path.join(REPO, "configs")


def load_train():
    """examples/train.py as a module (examples/ is not a package)."""
    name = "ds_mamba_spcp_examples_train"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# A model small enough for 20 steps x a dozen cases in well under a minute on 2 shared cores, with
# every piece present: several chunks per shard, a conv halo, 8 SSM heads (4 per rank under
# ulysses), attention heads divisible by cp, 4 zigzag chunks of 8 tokens.
TINY = [
    "--seq-len", "32", "--vocab-size", "32", "--d-model", "32", "--d-state", "8", "--headdim", "8",
    "--expand", "2", "--ngroups", "1", "--chunk-size", "8", "--attn-heads", "2", "--attn-every", "2",
    "--steps", str(TRAIN_STEPS), "--no-progress",
]  # fmt: skip


def sgd_config(name: str, stage: int) -> dict:
    """A shipped config with its ZeRO stage set, plain SGD as the optimizer and no clipping."""
    with open(os.path.join(CONFIGS, name), encoding="utf-8") as f:
        config = json.load(f)
    config = copy.deepcopy(config)
    config["zero_optimization"] = {"stage": stage}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
    config["zero_allow_untested_optimizer"] = True
    config["bf16"] = {"enabled": False}
    # The shipped configs clip at 1.0; these cases check the loss convention, which clipping would hide (a
    # doubled gradient clipped to the same norm is the same update: the negative controls would pass).
    # Clipping under sequence parallelism is checked in test_settings.py and test_sp_dp.py.
    config["gradient_clipping"] = 0.0
    return config


# ---------------------------------------------------------------------------------------------
# a one-mixer model under deepspeed.initialize
# ---------------------------------------------------------------------------------------------

TINY_LM_SEQLEN = 16  # global tokens


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(4, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.mixer = make_mixer("rms_Dh_g2_bias_dtlim", torch.float32, seed=1)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, mixer_fn=None):
        h = self.embed(x)
        h = h + (mixer_fn or self.mixer)(self.norm(h))
        return self.head(h)


def tiny_lm_data():
    g = torch.Generator().manual_seed(5)
    return tuple(torch.randn(1, TINY_LM_SEQLEN, n, generator=g) for n in (4, 1))


def tiny_lm_single_process_grads(model):
    """Gradients of the full-sequence mean loss, single process, reference core."""
    x, target = tiny_lm_data()
    loss = (model(x, mixer_fn=lambda u: ground_truth(model.mixer, u)) - target).square().mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return {n: g for (n, _), g in zip(model.named_parameters(), grads)}


def full_param(p):
    """The whole parameter whatever the ZeRO stage (ZeRO-3 partitions it between forwards)."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(p)
    return (p if full is None else full).detach().clone()


# ZeRO-3 with every parameter partitioned and released after each use (no persistence, no reuse, no prefetch), so
# that each use of a parameter is one all-gather and count_zero3_gathers sees every one
ZERO3_EVERY_USE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                   "stage3_prefetch_bucket_size": 0}  # fmt: skip


class Zero3Passes(list):
    """``count_zero3_gathers``'s record: (kind, fewest, most) all-gathers per pass, and ``handed``: per backward
    pass, the fewest and the most times ZeRO-3 took a gradient of one of the block's parameters for reduction."""

    def __init__(self):
        super().__init__()
        self.handed = []


@contextlib.contextmanager
def count_zero3_gathers(owner, name: str, params_of):
    """Under ZeRO-3, per pass of a tiled block over its tiles (its forward: ``owner.name``, a function or method
    whose arguments give its parameters through ``params_of``; its backward: ``tiled_block.backward_gathered``):
    ("forward" / "backward", the fewest and the most all-gathers of any of the block's parameters in it). Counted
    as DeepSpeed's releases (``Init._partition`` of an available parameter: one after each gather), read around the
    pass; with ZERO3_EVERY_USE nothing stays gathered between passes. Per backward pass also the gradients handed to
    ZeRO (``Zero3Passes.handed``): its gradient hooks' calls with ``ds_grad_is_ready`` (unset: true)."""
    from deepspeed.runtime.zero.partition_parameters import Init, ZeroParamStatus
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    tiled_block = importlib.import_module("ds_mamba_spcp.memory.tiled_block")  # the package exports the function
    released, handed, passes = collections.Counter(), collections.Counter(), Zero3Passes()
    partition, forward, backward_gathered = Init._partition, getattr(owner, name), tiled_block.backward_gathered
    take = Stage3.reduce_independent_p_g_buckets_and_remove_grads

    def counted(self, param_list, *args, **kwargs):
        released.update(id(p) for p in param_list if p.ds_status == ZeroParamStatus.AVAILABLE)
        return partition(self, param_list, *args, **kwargs)

    def taken(self, param):
        if getattr(param, "ds_grad_is_ready", True):
            handed[id(param)] += 1
        return take(self, param)

    def window(kind, params, call):
        before = [(released[id(p)], handed[id(p)]) for p in params]
        out = call()
        got = [released[id(p)] - b for p, (b, _) in zip(params, before)]
        passes.append((kind, min(got), max(got)))
        if kind == "backward":
            got = [handed[id(p)] - b for p, (_, b) in zip(params, before)]
            passes.handed.append((min(got), max(got)))
        return out

    Init._partition, Stage3.reduce_independent_p_g_buckets_and_remove_grads = counted, taken
    setattr(owner, name, lambda *a, **kw: window("forward", params_of(*a, **kw), lambda: forward(*a, **kw)))
    tiled_block.backward_gathered = lambda fn, ctx, *a: window("backward", ctx.block.params,
                                                               lambda: backward_gathered(fn, ctx, *a))  # fmt: skip
    try:
        yield passes
    finally:
        Init._partition, tiled_block.backward_gathered = partition, backward_gathered
        Stage3.reduce_independent_p_g_buckets_and_remove_grads = take
        setattr(owner, name, forward)
