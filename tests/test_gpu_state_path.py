"""The Triton backend's state path (``ops/triton.py``, ``segment_state``) on one GPU, bf16 (marker ``gpu``).

    MAMBA_DETERMINISTIC=1 python -m pytest -m gpu -q -s tests/test_gpu_state_path.py

A tiled shard's backward pass 2 (memory/tiled_block.py, ``Tiles.state``) sends the gradient reaching each tile's
final state back through the tile's state path alone; before ``segment_state`` the Triton backend ran the whole
segment's backward with a zero output gradient there. Checked against that whole segment:
1. One segment at a layer's shape (batch 2 x 4096 tokens, nheads 24, headdim 64, dstate 128, ngroups 1, d_conv 4,
   chunk 256; bf16 zxbcdt, conv weights and halo, fp32 dt_bias, A and S_in), one document per row and packed rows:
   S_out and the gradients of (S_out * g).sum() with respect to zxbcdt, the halo, conv1d_weight, conv1d_bias,
   dt_bias, A and S_in. The whole segment runs segment_fwd / segment_bwd in known mode with dout = 0.
2. The tiled block (examples/model.py's Block, d_model 768: 24 heads) at sp 2, two gloo ranks sharing the GPU, 8192
   tokens per rank in tiles of 2048, one document and packed rows (rank 0's last document running on into rank 1,
   so that pass 2 has a gradient to push): the output, the input's gradient and every parameter's gradient with the
   state path against the same run with the whole segment in pass 2, and rank 0's tiles counted through the state
   path. (The same code runs on CPU at a tiny size, ``_tiled_sp2``'s arguments: with the reference backend in fp32
   within 2e-8, and with the Triton kernels under the interpreter (triton_cpu_shims) bitwise equal, ~9 minutes.)

Bound, relative RMS <= 1e-4 per tensor: both compute the same bf16 products into fp32 accumulators (the chunk-state
backward's kernel instead of the combined one, whose chunk-scan terms are exact zeros with dout = 0; under the CPU
interpreter the two are bitwise equal, tests/test_triton_interpreter.py), so on the GPU they may differ only by the
order of fp32 sums (other autotuned blocks, causal-conv1d's atomics): ~1e-7 relative, ~1e-5 where a sum cancels.
One bf16 rounding of a tensor is ~1e-3 relative RMS and a lost term O(1) (the interpreter test's negative controls:
0.5 to 30).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import agree, run_ranks
from tests.gpu_cases import make_inputs, rel, spec_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BOUND = 1e-4
SHAPE = dict(nheads=24, headdim=64, ngroups=1, dstate=128, d_conv=4, chunk=256)
BATCH, SEQLEN = 2, 4096
STATE_INPUTS = ("zxbcdt", "halo", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "S_in")
TIMEOUT = float(os.environ.get("DS_MAMBA_SPCP_GPU_TIMEOUT", 900))


def _labels(device):
    """Row 0: starts inside chunks, on a chunk border, a token after one, in the conv's reach of another; row 1 one
    document from token 3 (the incoming state reaches only the first three tokens)."""
    rows = [[100, 512, 513, 515, 2000, 3071, 4095], [3]]
    return torch.stack([torch.bucketize(torch.arange(SEQLEN), torch.tensor(r), right=True) for r in rows]).to(
        device=device, dtype=torch.int32
    )


def _segment_inputs(device):
    t, grads = make_inputs(SHAPE, BATCH, SEQLEN, seed=21, device=device, rms=False, init=True, final=True)
    g = torch.Generator(device=device).manual_seed(22)
    conv_dim = t["conv1d_weight"].shape[0]
    t["halo"] = torch.randn(BATCH, SHAPE["d_conv"] - 1, conv_dim, generator=g, device=device).bfloat16()
    t["S_in"] = t.pop("initial_states")
    return t, grads["final"]


def _state_path(t, g, spec, seq_idx):
    from ds_mamba_spcp.ops import triton as triton_backend

    leaves = {k: t[k].detach().clone().requires_grad_() for k in STATE_INPUTS}
    params = (leaves["conv1d_weight"], leaves["conv1d_bias"], leaves["dt_bias"], leaves["A"], t["D"], None)
    S_out = triton_backend.segment_state(leaves["zxbcdt"], leaves["halo"], params, leaves["S_in"], spec=spec,
                                         seq_idx=seq_idx)  # fmt: skip
    got = torch.autograd.grad((S_out * g).sum(), list(leaves.values()))
    return {"S_out": S_out.detach(), **{"d" + k: v for k, v in zip(STATE_INPUTS, got)}}


def _whole_segment(t, g, spec, seq_idx):
    from ds_mamba_spcp.ops import triton as triton_backend
    from ds_mamba_spcp.ops.segment import run_bwd_known, run_fwd_known

    params = [t[k] for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")] + [None]
    with torch.no_grad():
        _, _, S_out = run_fwd_known(triton_backend.segment_fwd(t["zxbcdt"], t["halo"], params, spec=spec,
                                                               seq_idx=seq_idx, S_in=t["S_in"]))  # fmt: skip
        dout = torch.zeros(BATCH, SEQLEN, spec.d_inner, dtype=t["zxbcdt"].dtype, device=g.device)
        gen = triton_backend.segment_bwd(dout, t["zxbcdt"], t["halo"], params, t["S_in"], spec=spec, seq_idx=seq_idx,
                                         dS_out=g)  # fmt: skip
        (dzxbcdt, dw, db, ddt_bias, dA, _, _), dS_in, dhalo = run_bwd_known(gen)
    return dict(S_out=S_out, dzxbcdt=dzxbcdt, dhalo=dhalo, dconv1d_weight=dw, dconv1d_bias=db, ddt_bias=ddt_bias,
                dA=dA, dS_in=dS_in)  # fmt: skip


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
def test_segment_state_equals_the_whole_segment(packed):
    dev = torch.device("cuda", 0)
    t, g = _segment_inputs(dev)
    spec = spec_of(SHAPE)
    seq_idx = _labels(dev) if packed else None
    whole = _whole_segment(t, g, spec, seq_idx)
    got = _state_path(t, g, spec, seq_idx)
    torch.cuda.synchronize()
    assert got.keys() == whole.keys()
    errs = {k: rel(got[k].float(), whole[k].float()) for k in whole}
    print(f"\nsegment_state vs the whole segment (packed={packed}): "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))  # fmt: skip
    bad = {k: v for k, v in errs.items() if not v <= BOUND}
    assert not bad, f"state path off the whole segment by more than {BOUND}: {bad}"


# -- the tiled block at sp 2, two ranks on the GPU ---------------------------------------------------

D_MODEL, PER_RANK, TILE = 768, 8192, 2048


def _tiled_sp2(rank, world, device="cuda", backend="triton", dtype=torch.bfloat16, sizes=(D_MODEL, PER_RANK, TILE)):
    """This rank's errors, state path against whole segment (device, backend, dtype and sizes: a CPU dry run of this
    code can take the reference backend in fp32 at a tiny size)."""
    import importlib
    import sys

    import deepspeed.comm as dist

    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.memory import tiled_block
    from ds_mamba_spcp.module import DistributedMamba2
    from tests.dist_utils import REPO

    sys.path.insert(0, f"{REPO}/examples")
    from model import Block, mamba2_factory

    module = importlib.import_module(f"ds_mamba_spcp.ops.{backend}")
    d_model, per_rank, tile = sizes
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    torch.manual_seed(0)
    mixer = mamba2_factory(d_model, d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256)(0)
    cfg = MambaSequenceParallelConfig(enabled=True, sequence_parallel_size=world, backend=backend)
    block = Block(d_model, DistributedMamba2(mixer, dist.get_world_group(), cfg)).to(dev, dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, world * per_rank, d_model, generator=g, device=dev).to(dtype)
    dout = torch.randn(1, world * per_rank, d_model, generator=g, device=dev).to(dtype)
    # documents starting inside a tile, on a tile's last token, a token after a tile border and in the conv's reach of
    # one; the one on rank 0's end runs on into rank 1 (one starting on the shard border would leave pass 2 nothing)
    starts = torch.tensor([per_rank // 11, per_rank - tile - 1, per_rank + 1 + tile, per_rank + 3 * tile - 2])
    labels = torch.bucketize(torch.arange(world * per_rank), starts, right=True)[None].to(dev, torch.int32)
    shard = lambda t: layout.shard_sequence(t, rank, world, "contiguous").contiguous()  # noqa: E731

    def run(seq_idx):
        xs = shard(x).requires_grad_()
        out = tiled_block(xs, block.norm, block.mixer, tile, seq_idx=None if seq_idx is None else shard(seq_idx))
        out.backward(shard(dout))
        got = {"out": out.detach().float(), "dx": xs.grad.float()}
        for name, p in block.named_parameters():
            got["d" + name] = p.grad.float()
            p.grad = None
        return got

    res = {}
    real = module.segment_state
    for tag, seq_idx in (("one_document", None), ("packed", labels)):
        calls = []

        def counted(*args, _calls=calls, **kwargs):
            _calls.append(1)
            return real(*args, **kwargs)

        module.segment_state = counted  # (the calls counted: the state path was taken)
        try:
            state = run(seq_idx)
            module.segment_state = None  # Tiles.state then differentiates the whole segment
            whole = run(seq_idx)
        finally:
            module.segment_state = real
        errs = {}
        for k in whole:
            diff, ref = state[k] - whole[k], whole[k].clone()
            if k in ("out", "dx"):  # sharded: the shards' squares add up
                sq = torch.stack([diff.double().square().sum(), ref.double().square().sum()])
            else:  # each rank's share of a parameter's gradient: their sums are the whole
                dist.all_reduce(diff)
                dist.all_reduce(ref)
                sq = torch.stack([diff.double().square().sum(), ref.double().square().sum()]) / world
            dist.all_reduce(sq)
            errs[k] = (sq[0] / sq[1].clamp_min(1e-300)).sqrt().item()
        res[tag] = {"errs": errs, "ok": agree(all(v <= BOUND for v in errs.values())), "calls": len(calls)}
    return res


@pytest.fixture(scope="module")
def sp2():
    return run_ranks(_tiled_sp2, 2, timeout=TIMEOUT, backend="gloo-cuda")


@pytest.mark.parametrize("case", ["one_document", "packed"])
def test_tiled_block_at_sp2_state_path_equals_the_whole_segment(sp2, case):
    errs = sp2[0][case]["errs"]
    print(f"\nsp 2 tiled block, state path vs whole segment ({case}): worst {max(errs.values()):.1e} "
          f"({max(errs, key=errs.get)})")  # fmt: skip
    assert all(r[case]["ok"] for r in sp2), f"{case}: over {BOUND}: {errs}"
    # rank 0 pushes rank 1's state gradient through each of its tiles (the chain's last rank has none to push)
    assert [r[case]["calls"] for r in sp2] == [PER_RANK // TILE, 0], [r[case]["calls"] for r in sp2]
