"""deepspeed.initialize on 2 gloo ranks with the "mamba_sequence_parallel" section in ds_config and a
DistributedMamba2 inside the model: one SGD step, checked against the single-process model.

Three set-ups, run one after the other in the same two processes:

- ``wrap_then_initialize``: the mixers are wrapped with the ds_config dict before
  ``deepspeed.initialize``; DeepSpeed has no sequence-parallel group, so the wrapper takes the world
  group (its size equals the configured ``sequence_parallel_size``). DeepSpeed sees a data-parallel
  world of 2 and averages gradients, so each rank's loss is the mean over its own tokens.
- ``zero3_ulysses``: the same with ZeRO stage 3 (parameters partitioned between forwards; the
  wrapper is a ZeRO-3 leaf module) and mode "ulysses".
- ``initialize_then_wrap``: DeepSpeed's sequence-parallel group comes from
  ``parallel_state_sp`` passed as ``mpu`` (how DeepSpeed's Ulysses/ALST integration sets it up), the
  mixers are wrapped afterwards with ``config=engine`` (the wrapper reads the section from the
  engine) and resolve DeepSpeed's group; zigzag input with load_balancing "virtual", ZeRO stage 2.
  DeepSpeed sums gradients over the sequence-parallel ranks, so each rank's loss is its tokens'
  squared error divided by the global token count.

Either way the gradients DeepSpeed reduced (read with ``safe_get_full_grad`` before the step) must
be those of the single-process model's mean loss over the full sequence, the step must move the
parameters, and the replicas must agree after it. Tolerance (fp32; DeepSpeed reduces no fp64
gradients): relative RMS 1e-5 per parameter, as the sharded and full gradients differ only by
reassociated fp32 sums over a few hundred terms (<= 3.2e-7 seen), while a lost or doubled
contribution from one rank is >= 1e-2. (Gradients are compared, not parameter deltas: p - (p - lr*g)
in fp32 would lose digits to cancellation for small g.)
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

LR = 0.1
TOL = 1e-5


def _step(engine, model, layout_name, rank, world, loss_scale):
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad

    from ds_mamba_spcp.engine import layout

    x, target = _data()
    shard = lambda t: layout.shard_sequence(t, rank, world, layout_name)  # noqa: E731
    before = [_full_param(p) for p in model.parameters()]
    loss = (engine(shard(x)) - shard(target)).square().sum() * loss_scale
    engine.backward(loss)
    reduced = {n: safe_get_full_grad(p).detach().clone() for n, p in model.named_parameters()}
    engine.step()
    after = [_full_param(p) for p in model.parameters()]
    moved = all(not torch.equal(b, a) for b, a in zip(before, after))
    # the replicas agree after the step
    same = True
    for a in after:
        rows = [torch.empty_like(a) for _ in range(world)]
        dist.all_gather(rows, a.contiguous())
        same &= all(torch.equal(r, rows[0]) for r in rows)
    return loss.detach(), reduced, same and moved


def _verdicts(loss, reduced, same, reference_model):
    expected = _single_process_grads(reference_model)
    errs = {n: rel_err(reduced[n], expected[n]) for n in expected}
    return dict(
        finite=agree(bool(torch.isfinite(loss))), same=agree(same), errs=errs,
        ok=agree(all(e <= TOL for e in errs.values())),
    )  # fmt: skip


def _run(rank, world):
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from ds_mamba_spcp import DistributedMamba2, wrap_mamba2_mixers
    from ds_mamba_spcp.config import load_mamba_sp_config

    results = {}
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 1000}  # fmt: skip

    # 1. wrap with the ds_config dict, then initialize (world group, data-parallel averaging)
    ds_config = {
        **base,
        "zero_optimization": {"stage": 0},
        "mamba_sequence_parallel": {"enabled": True, "sequence_parallel_size": world, "backend": "reference"},
    }
    model = TinyLM()
    reference_model = copy.deepcopy(model)
    assert wrap_mamba2_mixers(model, None, ds_config) == 1
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ds_config
    )
    step = _step(engine, model, "contiguous", rank, world, loss_scale=world / SEQLEN)
    results["wrap_then_initialize"] = dict(
        **_verdicts(*step, reference_model),
        group_ok=agree(model.mixer.process_group is dist.get_world_group()),
        config_ok=agree(load_mamba_sp_config(engine) == model.mixer.config),
    )  # fmt: skip

    # 2. ZeRO-3 (parameters partitioned between forwards), mode "ulysses", wrap before initialize
    ds_config = {
        **base,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "mamba_sequence_parallel": {"enabled": True, "mode": "ulysses", "sequence_parallel_size": world,
                                    "backend": "reference"},
    }  # fmt: skip
    model = TinyLM()
    reference_model = copy.deepcopy(model)
    assert wrap_mamba2_mixers(model, None, ds_config) == 1
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ds_config
    )
    step = _step(engine, model, "contiguous", rank, world, loss_scale=world / SEQLEN)
    results["zero3_ulysses"] = dict(
        **_verdicts(*step, reference_model),
        group_ok=agree(model.mixer.process_group is dist.get_world_group()),
        config_ok=agree(load_mamba_sp_config(engine) == model.mixer.config),
    )  # fmt: skip

    # 3. DeepSpeed's sequence-parallel group (mpu), initialize, then wrap with config=engine
    parallel_state_sp.initialize_sequence_parallel(world)
    ds_config = {
        **base,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "sequence_parallel_size": world,
        "mamba_sequence_parallel": {"enabled": True, "load_balancing": "virtual", "input_layout": "zigzag",
                                    "backend": "reference"},
    }  # fmt: skip
    model = TinyLM()
    reference_model = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ds_config, mpu=parallel_state_sp
    )
    assert wrap_mamba2_mixers(engine.module, None, engine) == 1
    wrapper = engine.module.mixer
    step = _step(engine, model, "zigzag", rank, world, loss_scale=1.0 / SEQLEN)
    results["initialize_then_wrap"] = dict(
        **_verdicts(*step, reference_model),
        group_ok=agree(isinstance(wrapper, DistributedMamba2)
                       and wrapper.process_group is engine.get_sequence_parallel_group()
                       and wrapper.sequence_parallel_size == world),
        config_ok=agree(wrapper.config == load_mamba_sp_config(engine) and wrapper.config.load_balancing == "virtual"),
    )  # fmt: skip
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, 2, timeout=900)


@pytest.mark.parametrize("setup", ["wrap_then_initialize", "zero3_ulysses", "initialize_then_wrap"])
def test_one_training_step(results, setup):
    res = results[0][setup]
    assert res["finite"], "loss is not finite"
    assert res["group_ok"], "the wrapper did not resolve the expected process group"
    assert res["config_ok"], "the wrapper's config differs from load_mamba_sp_config(engine)"
    assert res["same"], "parameters did not move, or differ across ranks after the step"
    bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
    assert not bad and res["ok"], f"reduced gradients differ from the single-process ones: {bad} (all: {res['errs']})"
