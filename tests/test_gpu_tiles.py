"""Tiles on the GPU (Triton backend, bf16, one GPU, no process group): issue 13's exactness checks.

    MAMBA_DETERMINISTIC=1 python -m pytest -m gpu -q -s tests/test_gpu_tiles.py

At the benchmark shape (nheads=64, headdim=64, ngroups=8, dstate=128, d_conv=4, chunk=128), batch 1:
1. L = 131072, a length mamba-ssm's op can run whole: the op with forced tiles (tile_length 32768) and
   mamba-ssm's op, both against the fp32 reference backend (chained over pieces, ``gpu_cases``): the
   tiled op must stay within 2x upstream's own distance from fp32, plus 1e-4 (the bound of the GPU
   suite: the two bf16 computations round at different places, neither is closer to fp32 by
   construction; a lost carry at a tile border is O(1)).
2. L = 307200 (300K), past the old cap of 208412 tokens (the int32 guard refused it): the op tiles on its
   own, and out, final_states and every gradient stay within 2x the distance upstream showed in (1),
   plus 1e-4: the tiles' error does not grow with the number of tiles. The guard still refuses upstream's
   op itself at that length (it cannot tile).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_cases import BENCH, PARAMS, chained_reference, make_inputs, rel, spec_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run(fn, t, grads, **kw):
    inputs = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
    args = [inputs[k] for k in ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
    out, final = fn(*args, BENCH["chunk"], headdim=BENCH["headdim"], ngroups=BENCH["ngroups"],
                    rmsnorm_weight=inputs["rmsnorm_weight"], initial_states=inputs["initial_states"],
                    return_final_states=True, **kw)  # fmt: skip
    ((out.float() * grads["out"].float()).sum() + (final * grads["final"]).sum()).backward()
    got = {"out": out.detach(), "final_states": final.detach(), "dzxbcdt": inputs["zxbcdt"].grad}
    got.update({"d" + k: inputs[k].grad for k in PARAMS + ("initial_states",)})
    return got


def _distances(got, ref):
    return {k: rel(got[k].float(), ref[k]) for k in got}


def _reference(t, grads, piece):
    out, final, g = chained_reference(t, grads, spec_of(BENCH, norm_before_gate=False), piece=piece)
    return {"out": out, "final_states": final, "dzxbcdt": g["zxbcdt"],
            **{"d" + k: g[k] for k in PARAMS + ("initial_states",)}}  # fmt: skip


@pytest.fixture(scope="module")
def at_131072():
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.ops.triton import single_device_op

    dev = torch.device("cuda", 0)
    t, grads = make_inputs(BENCH, 1, 131072, seed=11, device=dev, rms=True, init=True, final=True)
    ref = _reference(t, grads, piece=16384)
    up = _distances(_run(single_device_op, t, grads), ref)
    tiled = _distances(_run(mamba_split_conv1d_scan_sp, t, grads, backend="triton", tile_length=32768), ref)
    return up, tiled


def test_forced_tiles_within_upstreams_distance_from_fp32(at_131072):
    up, tiled = at_131072
    for k in up:
        print(f"L=131072 {k}: tiled {tiled[k]:.2e}, upstream {up[k]:.2e} (vs fp32)")
    # The bound says something only while upstream itself is within bf16 noise of the fp32 reference (~3e-3
    # here; 1e-2 is the usual GPU bound): a call that runs another op (seen: norm_before_gate left to mamba-ssm's
    # default, 0.42 off) would make any tiled result pass.
    assert max(up.values()) < 1e-2, f"upstream's op is not the reference's op: {up}"
    bad = {k: (tiled[k], up[k]) for k in up if not tiled[k] <= 2 * up[k] + 1e-4}
    assert not bad, f"tiled farther from fp32 than 2x upstream: {bad}"


def test_past_the_old_cap(at_131072):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.ops import triton as triton_backend
    from ds_mamba_spcp.ops.triton import single_device_op

    up, _ = at_131072
    L = 307200
    spec = spec_of(BENCH)
    assert triton_backend.max_tokens(spec) < L  # the old guard's bound (208412 at this shape)
    dev = torch.device("cuda", 0)
    t, grads = make_inputs(BENCH, 1, L, seed=12, device=dev, rms=True, init=True, final=True)
    with pytest.raises(ValueError, match="int32"):
        _run(single_device_op, t, grads)  # upstream's op cannot take it whole: still refused
    torch.cuda.empty_cache()
    got = _run(mamba_split_conv1d_scan_sp, t, grads, backend="triton")  # tiles on its own
    torch.cuda.synchronize()
    ref = _reference(t, grads, piece=16384)
    far = _distances(got, ref)
    for k in far:
        print(f"L={L} {k}: tiled {far[k]:.2e} vs fp32 (upstream at 131072: {up[k]:.2e})")
    bad = {k: (far[k], up[k]) for k in far if not far[k] <= 2 * up[k] + 1e-4}
    assert not bad, f"past the cap, farther from fp32 than 2x upstream's distance at 131072: {bad}"
