"""The Trainer under accelerate's DeepSpeed sequence parallelism on one GPU (marker ``gpu``; skipped without
CUDA): Falcon-H1 at cp=2, the two ranks sharing the GPU through gloo, against the same script with sp_size 1 in
one process, and the negative control (accelerate alone). The CPU test (tests/test_accelerate.py) says what is
compared; here both runs take transformers' GPU path where it is unsharded (mamba-ssm's fused kernel, loaded
before the models, as tests/test_hf_gpu.py does) and this package's Triton backend where it is sharded.

    MAMBA_DETERMINISTIC=1 python -m pytest -m gpu -q -s tests/test_accelerate_gpu.py

Bound 5e-3 relative on the losses, grad_norms and updates: fp32 parameters, but mamba-ssm's Triton kernels
(the reference's and the sharded run's, chunked differently) multiply in TF32 (10-bit mantissa, ~5e-4 per
product), so two fp32 runs that sum in another order differ by ~1e-3; the negative control (a lost state,
gradients 2x at ZeRO-2) is off by O(1) and must exceed 10x the bound.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ranks share it through gloo)"),
]

if torch.cuda.is_available():  # before tests.test_accelerate imports the models: transformers binds the kernels
    from tests import hf_models

    hf_models.load_kernels_first()

from tests import test_accelerate as cpu  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402
from tests.hf_models import GPU_SIZES  # noqa: E402

GPU_TOL = 5e-3
FAMILY, STAGE = "falcon_h1", 2


def _runs(rank, world, tmp):
    from ds_mamba_spcp.integrations import accelerate as mamba_sp

    sp = world
    out = {}
    if sp > 1:
        mamba_sp.enable()
    out["run"] = cpu._train(FAMILY, STAGE, sp, os.path.join(tmp, f"run{sp}"), sizes=GPU_SIZES, use_cpu=False)
    out["fixed"] = None
    if sp == 1:  # the negative control's reference (DeepSpeed's own adapter needs equal lengths on gloo)
        out["fixed"] = cpu._train(
            FAMILY, STAGE, 1, os.path.join(tmp, "fixed1"), cpu.fixed_collate, sizes=GPU_SIZES, use_cpu=False
        )  # fmt: skip
    else:
        import deepspeed.comm as dist
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        core_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"].__dict__.get("_ds_mamba_spcp_core_attention")
        mamba_sp.disable()
        dist.barrier()
        parallel_state_sp._release_sequence_parallel_groups()
        if core_sdpa is not None:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = core_sdpa
        out["fixed"] = cpu._train(
            FAMILY, STAGE, sp, os.path.join(tmp, "bug"), cpu.fixed_collate, sizes=GPU_SIZES, use_cpu=False
        )  # fmt: skip
    return out


def test_trainer_on_one_gpu(tmp_path):
    ref = run_ranks(_runs, 1, str(tmp_path / "ref"), backend="gloo-cuda", timeout=1200)[0]
    sp = run_ranks(_runs, 2, str(tmp_path / "sp"), backend="gloo-cuda", timeout=1200)
    for rank, out in enumerate(sp):
        err = cpu._errors(out["run"], ref["run"])
        bug = cpu._errors(out["fixed"], ref["fixed"])
        print(f"{FAMILY} ZeRO-{STAGE} cp=2 rank {rank}: {err}; negative control: {bug}")
        assert err["loss"] <= GPU_TOL and err["grad_norm"] <= GPU_TOL and err["update"] <= GPU_TOL, err
        assert bug["update"] > 10 * GPU_TOL, bug
        assert abs(out["run"]["eval_loss"] - ref["run"]["eval_loss"]) <= GPU_TOL * abs(ref["run"]["eval_loss"])
