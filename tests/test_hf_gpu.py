"""transformers' six Mamba2-style families sequence-parallel on one GPU, against transformers on mamba-ssm's
kernels (marker ``gpu``; skipped without CUDA).

Run on a machine with one CUDA GPU, the packages of pyproject.toml and transformers (the device image has
5.17; the CPU suite tests 5.24):

    python -m pytest -m gpu -q -s tests/test_hf_gpu.py

The two ranks share the GPU through gloo (``run_ranks(..., backend="gloo-cuda")``, docs/design.md, "Traps"): this is a
correctness check, timings mean nothing. Every rank loads mamba-ssm's Triton modules before transformers'
models (as ``import mamba_ssm`` does where its CUDA extension is built), so that the unwrapped model takes
transformers' GPU training path: mamba-ssm's fused ``mamba_split_conv1d_scan_combined`` and causal-conv1d
(``kernels_path_bound`` checks it), while the wrapped model runs this package's Triton backend at cp=2,
attention through DeepSpeed's Ulysses attention ("sdpa").

Per family (sizes ``hf_models.GPU_SIZES``, global L=1024, batch 2, ``sum(logits * gout)`` back-propagated), three runs
on the same bf16-rounded parameters: the unwrapped model in fp32 (the reference), the unwrapped model in
bf16, the wrapped model in bf16 at cp=2. Per tensor (logits; every parameter gradient, the ranks' partial
gradients summed as DeepSpeed does) the wrapped model's relative RMS distance from the fp32 reference must be
within ``2 x`` the unwrapped bf16 model's own distance ``+ FLOOR``: each bf16 run is about its own rounding
away from fp32, and the wrapped model's gradients are summed from two bf16 partials, each rounded once more
(~1e-3 relative, hence ``FLOOR``). The negative control (DeepSpeed's attention sharding alone: Bamba's Mamba
layers restarting from a zero state on rank 1) must break that bound. MAMBA_DETERMINISTIC=1 (no autotuning)
keeps the run short: ~20 kernels compiled per dtype, then a few seconds of compute.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import hf_models
from tests.dist_utils import run_ranks, sharded_rel_err, summed_rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ranks share it through gloo)"),
]

WORLD = 2
DEVICE = "cuda"
SEQLEN, BATCH = 1024, 2
FACTOR, FLOOR = 2.0, 1e-3
# Falcon-H1: transformers' fused training path always gates before the norm, so the model is built that way.
# GraniteMoeHybrid: dense (no routed experts): in bf16 two runs that round differently route some tokens to
# other experts, a discrete change that swamps the rounding this test measures.
EXTRA = {"falcon_h1": dict(mamba_norm_before_gate=False), "granitemoehybrid": dict(num_local_experts=0)}
CASES = {fam: dict(family=fam, extra=EXTRA.get(fam, {})) for fam in hf_models.MODULES}
CASES["bug_attention_only_bamba"] = dict(family="bamba", extra={}, bug="attention_only")


def _kernels_path_bound() -> bool:
    import sys

    module = sys.modules[hf_models.MODULES["bamba"]]
    s = hf_models.GPU_SIZES["ssm"]
    d_inner, nheads = s["heads"] * s["headdim"], s["heads"]
    conv_dim = d_inner + 2 * s["ngroups"] * s["dstate"]
    dev = torch.device("cuda")
    out = module.mamba2_split_conv1d_scan_combined(
        torch.randn(1, 64, d_inner + conv_dim + nheads, device=dev), torch.randn(conv_dim, 4, device=dev), None,
        torch.zeros(nheads, device=dev), -torch.ones(nheads, device=dev), D=torch.ones(nheads, device=dev),
        chunk_size=64, headdim=s["headdim"], ngroups=s["ngroups"],
    )  # fmt: skip
    return out is not None  # the PyTorch fallback returns None


def _run(model, fam, ids, gout, pos):
    # use_cache=False: transformers' hybrids would otherwise build a cache in training too, and a mixer
    # called with a cache leaves the fused training path
    kw = {} if fam == "mamba2" else {"position_ids": pos}
    logits = model(input_ids=ids, use_cache=False, **kw).logits
    (logits.float() * gout).sum().backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _case(world, opts):
    from ds_mamba_spcp.data import shard_batch
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel

    fam, dev = opts["family"], torch.device(DEVICE)

    def build(dtype):
        model = hf_models.build(fam, seed=7, sizes=hf_models.GPU_SIZES, **opts["extra"])
        with torch.no_grad():  # the same bf16-rounded parameters for every run
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        return model.to(device=dev, dtype=dtype)

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, hf_models.GPU_SIZES["vocab"], (BATCH, SEQLEN), generator=g).to(dev)
    gout = torch.randn(BATCH, SEQLEN, hf_models.GPU_SIZES["vocab"], generator=g).to(torch.bfloat16).float().to(dev)
    pos = torch.arange(SEQLEN, device=dev).expand(BATCH, SEQLEN)
    ref32 = _run(build(torch.float32), fam, ids, gout, pos)
    ref16 = _run(build(torch.bfloat16), fam, ids, gout, pos)

    model = build(torch.bfloat16)
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "sequence_parallel_size": world,
                 "mamba_sequence_parallel": {"enabled": True}}  # fmt: skip
    group = prepare_sequence_parallel(model, ds_config).get_sequence_parallel_group()
    if opts.get("bug") == "attention_only":
        for m in model.modules():
            if "_ds_mamba_spcp_mixer" in m.__dict__:
                del m.__dict__["forward"]
    local = shard_batch({"input_ids": ids, "position_ids": pos, "gout": gout}, group)
    sp_logits, sp_grads = _run(model, fam, local["input_ids"], local["gout"], local["position_ids"])

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    unwrapped = {"logits": rel(ref16[0], ref32[0]), **{n: rel(ref16[1][n], g) for n, g in ref32[1].items()}}
    wrapped = {"logits": sharded_rel_err(sp_logits, shard_batch(ref32[0], group))}
    for n, g in ref32[1].items():
        wrapped[n] = summed_rel_err(sp_grads.get(n, torch.zeros_like(g)), g)
    return {"unwrapped": unwrapped, "wrapped": wrapped}


def _ranks(rank, world):
    hf_models.load_kernels_first()
    out = {"kernels_path_bound": _kernels_path_bound(), "cases": {}}
    for name, opts in CASES.items():
        out["cases"][name] = _case(world, opts)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(
        _ranks, WORLD, timeout=float(os.environ.get("DS_MAMBA_SPCP_GPU_TIMEOUT", 600)), backend="gloo-cuda"
    )


def test_unwrapped_model_runs_mamba_ssm_kernels(results):
    assert all(r["kernels_path_bound"] for r in results), "transformers took its PyTorch path, not mamba-ssm's"


def _over(res) -> dict:
    return {
        k: (v, FACTOR * res["unwrapped"][k] + FLOOR)
        for k, v in res["wrapped"].items()
        if not v <= FACTOR * res["unwrapped"][k] + FLOOR
    }


@pytest.mark.parametrize("family", list(hf_models.MODULES))
def test_bf16_wrapped_within_unwrapped_distance_from_fp32(results, family):
    res = results[0]["cases"][family]
    worst = max(res["wrapped"], key=lambda k: res["wrapped"][k] - FACTOR * res["unwrapped"][k])
    print(
        f"{family}: logits wrapped {res['wrapped']['logits']:.2e} / unwrapped {res['unwrapped']['logits']:.2e}; "
        f"closest to the bound: {worst} wrapped {res['wrapped'][worst]:.2e} / unwrapped {res['unwrapped'][worst]:.2e}"
    )
    bad = _over(res)
    assert not bad, f"{family}: (wrapped distance, bound) over the bound: {bad}"


def test_negative_control_attention_only_breaks_the_bound(results):
    res = results[0]["cases"]["bug_attention_only_bamba"]
    assert len(_over(res)) > 5, res
