"""Sequence x data parallelism: examples/train.py at sp 2 x dp 2 (4 gloo ranks) against sp 1 x dp 2, with clipping.

Ranks 0-1 share the sequences of data-parallel replica 0, ranks 2-3 those of replica 1 (DeepSpeed's
``parallel_state_sp``, consecutive ranks per sequence; ZeRO reduces over both axes). The reference is sp 1 x
dp 2 computed in one process: the same model and seed, every step both replicas' batches (the batches
``batch_seed`` gives data-parallel ranks 0 and 1) in one batch of twice the rows, whose mean loss is the mean
of the two replicas' means (equal token counts), so its gradient is what dp 2 averages, and then torch's
``clip_grad_norm_`` and SGD. Every mode the 4-rank run allows (state_passing with load_balancing none,
virtual, permute_p2p, permute_a2a; ulysses, 8 heads over 2 ranks) at ZeRO 2 and 3, 6 steps each, in one
spawn (4 ranks on 2 shared cores: each case a fresh engine, the processes started once).

``gradient_clipping`` 0.5 acts at every step here (the reference's norms are 3-6). Clipping hides a wrong
gradient scale from the parameters (a gradient twice too large, clipped, is the same update), so every
step's global norm before clipping (``engine.get_global_grad_norm()``, logged by train.py) is compared
with the reference's as well as the loss. Tolerance for both, relative: 1e-4, as in test_train.py (fp32;
the runs differ by reassociated sums, ~1e-6 after a few steps); the negative control (ZeRO 3 without
``grad_scale_for_engine``'s factor: a gradient half the true one) must miss the norm by far more.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_train, sgd_config
from tests.dist_utils import run_ranks

STEPS = 6
TOL = 1e-4
CLIP = 0.5
SP, DP = 2, 2
TINY = [
    "--seq-len", "32", "--vocab-size", "32", "--d-model", "32", "--d-state", "8", "--headdim", "8",
    "--expand", "2", "--ngroups", "1", "--chunk-size", "8", "--model", "mamba", "--n-layers", "2",
    "--steps", str(STEPS), "--no-progress",
]  # fmt: skip
MODES = {
    "state_passing": ("state_passing.json", None),
    "virtual": ("state_passing_virtual.json", None),
    "permute_p2p": ("state_passing_permute.json", "permute_p2p"),
    "permute_a2a": ("state_passing_permute.json", "permute_a2a"),
    "ulysses": ("ulysses.json", None),
}
# name -> (shipped config, load_balancing override, ZeRO stage, --grad-scale)
CASES = {f"{mode}-zero{stage}": (*MODES[mode], stage, "auto") for mode in MODES for stage in (2, 3)}
CONTROL = {"control-zero3-unscaled": ("state_passing.json", None, 3, "1")}


def _config(name: str, load_balancing, stage: int) -> dict:
    config = sgd_config(name, stage)
    config["gradient_clipping"] = CLIP
    if load_balancing is not None:
        config["mamba_sequence_parallel"] = {**config["mamba_sequence_parallel"], "load_balancing": load_balancing}
    return config


def _run_cases(rank, world, cases):
    train = load_train()
    out = {}
    for name, (config_name, load_balancing, stage, grad_scale) in cases.items():
        args = train.parse_args(TINY + ["--grad-scale", grad_scale])
        records = train.run_distributed(args, _config(config_name, load_balancing, stage))
        out[name] = [(r["loss"], r["grad_norm"]) for r in records]
    return out


def _reference() -> list[tuple[float, float]]:
    """sp 1 x dp 2 in one process: both replicas' batches in one, the group-of-one reference op."""
    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    train = load_train()
    args = train.parse_args(TINY)
    config = _config("state_passing.json", None, 2)
    model = train.build_model(args)
    one = MambaSequenceParallelConfig(enabled=True, sequence_parallel_size=1, backend="reference")
    wrap_mamba2_mixers(model, None, one)
    model.train()

    def full_batch(step, m, micro):
        replicas = [train.make_batch(args, micro, train.batch_seed(args.seed, step, m, r)) for r in range(DP)]
        return {k: torch.cat([b[k] for b in replicas]) for k in replicas[0]}

    records = train.train_single_process(
        args, config, model, torch.device("cpu"), full_batch,
        lambda batch: train.forward_loss(model, model, batch, None, 1.0, args),
    )  # fmt: skip
    return [(r["loss"], r["grad_norm"]) for r in records]


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module")
def distributed():
    results = run_ranks(_run_cases, SP * DP, {**CASES, **CONTROL}, timeout=1200)
    return results[0]  # rank 0 logs; every rank logs the same all-reduced loss


def _max_rel(values, ref) -> float:
    assert len(values) == len(ref) == STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(values, ref))


def test_reference_clips(reference):
    assert all(norm > CLIP for _, norm in reference), f"clipping does not act at every step: {reference}"


@pytest.mark.parametrize("name", list(CASES))
def test_sp2_dp2_matches_sp1_dp2(name, reference, distributed):
    run = distributed[name]
    loss_err = _max_rel([r[0] for r in run], [r[0] for r in reference])
    norm_err = _max_rel([r[1] for r in run], [r[1] for r in reference])
    print(f"{name}: max relative difference over {STEPS} steps: loss {loss_err:.2e}, grad norm {norm_err:.2e}")
    assert loss_err <= TOL, f"{name}: loss differs from sp 1 x dp 2 by {loss_err:.2e}"
    assert norm_err <= TOL, f"{name}: global gradient norm differs from sp 1 x dp 2 by {norm_err:.2e}"


def test_negative_control_unscaled_zero3_fails(reference, distributed):
    run = distributed["control-zero3-unscaled"]
    assert _max_rel([r[1] for r in run], [r[1] for r in reference]) > 100 * TOL, "a halved gradient went unnoticed"
