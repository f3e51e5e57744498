"""DeepSpeed settings that real runs use (issue 19): gradient clipping at ZeRO 1-3 in fp32 and bf16,
DeepSpeed's BF16_Optimizer refused under sequence parallelism, and the package's all-gather on torch
2.13's current API (no deprecation warning: ``all_gather_into_tensor`` is deprecated for
``all_gather_single``, which deepspeed.comm 0.19.8 does not have).

One spawn of 2 gloo ranks, sequence-parallel size 2, DeepSpeed's own group (``parallel_state_sp`` as the
mpu, how examples/train.py and ``prepare_sequence_parallel`` run), a fresh engine per case, one SGD step
(lr 1) with ``gradient_clipping`` set to half the single-process gradient norm, so that clipping acts
(coefficient ~0.5). Per case:

- ``norm_vs_reduced``: ``engine.get_global_grad_norm()`` against the fp64 norm of the gradient DeepSpeed
  reduced (``safe_get_full_grad`` before the step): the norm of the gradient it holds, whatever the dtype.
  Relative 1e-5: both are fp32 sums of the same few hundred squares in another order (<= 1e-7 seen);
  a norm that counts one rank's parameters twice, or once too few, is off by >= 1e-2 here.
- ``norm_vs_single``: the same norm against the single-process fp32 model's (the truth). fp32: 1e-5 (the
  reduced gradients match the single-process ones to <= 3e-7, test_deepspeed_initialize.py). bf16: the
  forward and backward run in bf16 (8-bit mantissa), so the gradient itself differs from the fp32 one by
  about 1e-2; 5e-2 is the bound, and a norm off by sqrt(2) (one rank's gradient counted twice) fails it.
- ``update_vs_clip``: the step's update ``(before - after) / lr`` of the fp32 (master) parameters
  against ``torch.nn.utils.clip_grad_norm_`` applied to the reduced gradient, relative RMS per
  parameter <= 1e-4: the update is p - (p - g') in fp32, which loses up to ulp(p) / |g'| ~ 1e-5 to
  cancellation here. Negative control in the same numbers: the unclipped gradient is ~50% off.
- fp32 only, ``update_vs_single``: the same update against clip_grad_norm_ on the single-process
  gradient, <= 1e-4.

The BF16_Optimizer case: ZeRO 1 + bf16 + ``"data_types": {"grad_accum_dtype": "fp32"}`` makes DeepSpeed
0.19.8 wrap the optimizer in its BF16_Optimizer, whose norm skips every parameter on sequence-parallel
ranks >= 1 (the first step fails there with "stack expects a non-empty TensorList" while rank 0 waits in
the all-reduce). ``grad_scale_for_engine`` must refuse it on both ranks, with the setting and the fix in
the message, before any step; ``selects_bf16_optimizer`` (the rule ``prepare_sequence_parallel`` checks
before ``deepspeed.initialize``) must agree with the optimizer the engine chose, in every case.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import TINY_LM_SEQLEN as SEQLEN
from tests.conftest import TinyLM
from tests.conftest import full_param as _full_param
from tests.conftest import tiny_lm_data as _data
from tests.conftest import tiny_lm_single_process_grads as _single_process_grads
from tests.dist_utils import agree, rel_err, run_ranks

LR = 1.0
CLIP_FRACTION = 0.5  # gradient_clipping = this x the single-process norm: the clip coefficient
NORM_TOL = {"fp32": 1e-5, "bf16": 5e-2}
NORM_REDUCED_TOL = 1e-5
UPDATE_TOL = 1e-4

# name -> (ZeRO stage, dtype, data_types.grad_accum_dtype, loss factor: None for grad_scale_for_engine's)
CASES = {f"zero{stage}-{dtype}": (stage, dtype, None, None) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")}
# ZeRO 2 keeps an fp32 gradient accumulation through its own optimizer (the fix the error offers)
CASES["zero2-bf16-accum_fp32"] = (2, "bf16", "fp32", None)
# negative control: ZeRO 3 averages over the sequence-parallel ranks; without grad_scale_for_engine's factor
# the reduced gradient, its norm and so the clipping are half the true ones
CONTROL = {"control-zero3-unscaled": (3, "fp32", None, 1.0)}
BF16_OPTIMIZER_CASE = (1, "bf16", "fp32")


def _ds_config(stage, dtype, accum, clip, world):
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
        "steps_per_print": 1000, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bf16"}, "sequence_parallel_size": world,
        "mamba_sequence_parallel": {"enabled": True, "backend": "reference"},
    }  # fmt: skip
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    return config


def _engine(stage, dtype, accum, clip, world):
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from ds_mamba_spcp import wrap_mamba2_mixers

    config = _ds_config(stage, dtype, accum, clip, world)
    model = TinyLM()
    assert wrap_mamba2_mixers(model, None, config) == 1  # before initialize: ZeRO-3 leaf hooks
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config, mpu=parallel_state_sp
    )
    return engine, model, config


def _norm(grads) -> float:
    return torch.stack([g.double().norm() for g in grads]).norm().item()


def _clipped(grads, clip):
    """torch.nn.utils.clip_grad_norm_ on copies of ``grads`` (as the parameters' .grad)."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.detach().clone()
    torch.nn.utils.clip_grad_norm_(params, clip)
    return [p.grad for p in params]


def _one_step(engine, model, rank, world, dtype, scale=None):
    from deepspeed.utils import safe_get_full_grad

    from ds_mamba_spcp.data import grad_scale_for_engine
    from ds_mamba_spcp.engine import layout

    x, target = _data()
    shard = lambda t: layout.shard_sequence(t, rank, world, "contiguous")  # noqa: E731
    scale = grad_scale_for_engine(engine) if scale is None else scale
    model_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    before = [_full_param(p).float() for p in model.parameters()]
    out = engine(shard(x).to(model_dtype)).float()
    engine.backward((out - shard(target)).square().sum() * (scale / SEQLEN))
    reduced = [safe_get_full_grad(p).detach().float().clone() for p in model.parameters()]
    engine.step()
    after = [_full_param(p).float() for p in model.parameters()]
    update = [(b - a) / LR for b, a in zip(before, after)]
    return float(engine.get_global_grad_norm()), reduced, update


def _gather_without_deprecation(rank, world):
    """The package's all-gather, every warning recorded: torch 2.13 deprecates all_gather_into_tensor."""
    import warnings

    from ds_mamba_spcp import comm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = comm.all_gather(torch.full((3,), float(rank)), None, world, async_op=True).wait()
    deprecated = [str(w.message) for w in caught if "deprecated" in str(w.message)]
    ok = torch.equal(rows, torch.arange(world, dtype=torch.float32)[:, None].expand(world, 3))
    return {"deprecated": deprecated, "ok": agree(ok and not deprecated)}


def _run(rank, world):
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from ds_mamba_spcp.data import grad_scale_for_engine, selects_bf16_optimizer

    deepspeed.utils.logger.setLevel("WARNING")
    out = {"gather": _gather_without_deprecation(rank, world)}
    parallel_state_sp.initialize_sequence_parallel(world)
    truth = list(_single_process_grads(TinyLM()).values())
    true_norm = _norm(truth)
    clip = CLIP_FRACTION * true_norm
    out.update(true_norm=true_norm, clip=clip)
    rule_ok = True
    for name, (stage, dtype, accum, scale) in {**CASES, **CONTROL}.items():
        engine, model, config = _engine(stage, dtype, accum, clip, world)
        rule_ok &= selects_bf16_optimizer(config) == isinstance(engine.optimizer, BF16_Optimizer)
        norm, reduced, update = _one_step(engine, model, rank, world, dtype, scale)
        expected = _clipped(reduced, clip)
        res = dict(
            norm=norm,
            norm_vs_reduced=abs(norm - _norm(reduced)) / _norm(reduced),
            norm_vs_single=abs(norm - true_norm) / true_norm,
            update_vs_clip=max(rel_err(u, e) for u, e in zip(update, expected)),
            control_unclipped=min(rel_err(u, g) for u, g in zip(update, reduced)),
        )
        if dtype == "fp32":
            res["update_vs_single"] = max(rel_err(u, e) for u, e in zip(update, _clipped(truth, clip)))
        res["ok"] = agree(
            res["norm_vs_reduced"] <= NORM_REDUCED_TOL
            and res["norm_vs_single"] <= NORM_TOL[dtype]
            and res["update_vs_clip"] <= UPDATE_TOL
            and res.get("update_vs_single", 0.0) <= UPDATE_TOL
        )
        out[name] = res
        del engine, model

    # DeepSpeed's BF16_Optimizer: refused before the first step, on every rank
    engine, model, config = _engine(*BF16_OPTIMIZER_CASE, clip, world)
    rule_ok &= selects_bf16_optimizer(config) and isinstance(engine.optimizer, BF16_Optimizer)
    try:
        grad_scale_for_engine(engine)
        out["bf16_optimizer_error"] = None
    except ValueError as e:
        out["bf16_optimizer_error"] = str(e)
    out["refused_everywhere"] = agree(out["bf16_optimizer_error"] is not None)
    out["rule_ok"] = agree(rule_ok)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, 2, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_clipping_and_global_norm(results, name):
    res = results[0][name]
    print(f"{name}: {res}")
    assert res["norm_vs_reduced"] <= NORM_REDUCED_TOL, f"{name}: DeepSpeed's norm is not its gradient's: {res}"
    assert res["norm_vs_single"] <= NORM_TOL[CASES[name][1]], f"{name}: norm differs from the single-process one"
    assert res["update_vs_clip"] <= UPDATE_TOL, f"{name}: the clipped update is not clip_grad_norm_'s: {res}"
    assert res.get("update_vs_single", 0.0) <= UPDATE_TOL, f"{name}: update differs from the single process's"
    assert res["control_unclipped"] > 100 * UPDATE_TOL, f"{name}: clipping did not act, the test is weak: {res}"
    assert res["ok"], f"{name}: another rank saw a different verdict"


def test_negative_control_unscaled_zero3_fails(results):
    """The same checks catch a plausible bug: ZeRO 3's average over the sequence-parallel ranks left unscaled."""
    res = results[0]["control-zero3-unscaled"]
    # Only the norm can tell: the halved gradient's norm is the clip value here, so its (unclipped) update
    # equals the clipped true one. Clipping hides a wrong scale from the parameters; the norm does not.
    assert res["norm_vs_single"] > 100 * NORM_TOL["fp32"], f"a halved gradient went unnoticed: {res}"


def test_bf16_optimizer_refused_on_every_rank(results):
    assert results[0]["refused_everywhere"], "grad_scale_for_engine accepted DeepSpeed's BF16_Optimizer"
    assert results[0]["bf16_optimizer_error"] == results[1]["bf16_optimizer_error"]
    msg = results[0]["bf16_optimizer_error"]
    for needle in ("grad_accum_dtype", "BF16_Optimizer", '"zero_optimization.stage" to 2'):
        assert needle in msg, f"the error does not name {needle!r}: {msg}"


def test_all_gather_uses_the_current_torch_api(results):
    res = results[0]["gather"]
    assert not res["deprecated"], f"comm.all_gather called a deprecated torch API: {res['deprecated']}"
    assert res["ok"], "comm.all_gather gave wrong rows, or another rank saw a deprecation warning"


def test_bf16_optimizer_rule_matches_deepspeed(results):
    assert results[0]["rule_ok"], "selects_bf16_optimizer disagrees with the optimizer DeepSpeed chose"


def test_bf16_optimizer_refused_before_initialize():
    """prepare_sequence_parallel (the transformers path) refuses the same ds_config before any group exists."""
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel

    config = _ds_config(*BF16_OPTIMIZER_CASE, 1.0, 2)
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        prepare_sequence_parallel(copy.deepcopy(torch.nn.Linear(2, 2)), config)
