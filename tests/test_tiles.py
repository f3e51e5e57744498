"""Tiles (``ops/tiles.py``): a segment run as consecutive tiles equals the untiled op (CPU, fp64).

Tiles are forced small with ``tile_length`` (the reference backend has no per-call limit) or by a
per-call limit patched onto the reference backend (as mamba-ssm's int32 cap imposes on the Triton
one), which also splits the batch into row groups. Checked: a group of one (the whole row in tiles)
against the untiled single-device op; 2 and 3 gloo ranks in every mode with tiles inside each
segment, against the untiled sharded op; packed rows with documents starting on and near tile
borders; initial and final states; every gradient.

Tolerance 1e-10 (fp64): tiles split the same sums at other borders, exactly like segments between
ranks, so the results agree to rounding (~1e-15); a lost carry or halo is O(1) (the negative control:
tiles whose incoming state is dropped).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_inputs as shared_inputs
from tests.dist_utils import agree, run_ranks, sharded_rel_err, summed_rel_err

TOL = 1e-10
NHEADS, HEADDIM, NGROUPS, DSTATE, D_CONV, CHUNK = 4, 3, 2, 5, 4, 8
F64 = torch.float64


def make_inputs(batch, seqlen, seed=0):
    return shared_inputs(
        batch=batch, seqlen=seqlen, nheads=NHEADS, headdim=HEADDIM, ngroups=NGROUPS, dstate=DSTATE, d_conv=D_CONV,
        seed=seed, rms=True, init=True, final=True, a_offset=0.3,
    )  # fmt: skip


def labels(batch, seqlen, starts):
    positions = torch.arange(seqlen)
    rows = [torch.bucketize(positions, torch.tensor(starts[b % len(starts)]), right=True) for b in range(batch)]
    return torch.stack(rows).to(torch.int32)


def run_op(fn, t, grads, zx_shard, out_shard, final_weight=1.0, **kw):
    """out, final and every gradient of one call (zxbcdt's shard given; parameters replicated)."""
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if k != "zxbcdt"}
    zx = zx_shard.clone().requires_grad_()
    out, final = fn(
        zx, leaves["conv1d_weight"], leaves["conv1d_bias"], leaves["dt_bias"], leaves["A"], leaves["D"], CHUNK,
        headdim=HEADDIM, ngroups=NGROUPS, rmsnorm_weight=leaves["rmsnorm_weight"],
        initial_states=leaves["initial_states"], return_final_states=True, backend="reference", **kw,
    )  # fmt: skip
    ((out * out_shard).sum() + final_weight * (final * grads["final"]).sum()).backward()
    return out.detach(), final.detach(), zx.grad, {k: v.grad for k, v in leaves.items()}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize(
    "name, batch, seqlen, tile, starts",
    [
        ("one_row_uneven_tiles", 1, 100, 24, None),
        ("batch3_tiles_not_chunk_multiples", 3, 70, 13, None),
        ("packed_starts_on_and_near_tile_borders", 2, 96, 32, [[32, 34, 64, 90], [5, 33]]),
        ("tile_shorter_than_a_chunk", 2, 40, 5, [[10, 15, 16]]),
    ],
)
def test_group_of_one_in_tiles_equals_the_single_device_op(name, batch, seqlen, tile, starts):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp

    t, grads = make_inputs(batch, seqlen)
    seq = None if starts is None else labels(batch, seqlen, starts) * 3 + 2  # labels need not start at 0
    want = run_op(mamba_split_conv1d_scan_sp, t, grads, t["zxbcdt"], grads["out"], seq_idx=seq)
    got = run_op(mamba_split_conv1d_scan_sp, t, grads, t["zxbcdt"], grads["out"], seq_idx=seq, tile_length=tile)
    for a, b in zip(got[:3], want[:3]):
        assert rel(a, b) < TOL, name
    for k in want[3]:
        assert rel(got[3][k], want[3][k]) < TOL, (name, k)


def test_a_per_call_limit_tiles_rows_and_stretches(monkeypatch):
    """A backend limit (mamba-ssm's int32 cap, here 40 tokens per call) splits the batch into row groups and
    long rows into stretches, automatically, with the same results."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.ops import reference, tiles
    from ds_mamba_spcp.ops.spec import CoreSpec

    spec = CoreSpec(NHEADS, HEADDIM, NGROUPS, DSTATE, D_CONV, CHUNK)
    assert tiles.plan(3, 20, spec, 40, None).rows == ((0, 2), (2, 3))  # two rows per call, one stretch
    assert tiles.plan(2, 100, spec, 40, None).spans == ((0, 40), (40, 80), (80, 100))  # chunk multiples
    assert tiles.plan(2, 20, spec, 40, None) is None  # fits one call
    t, grads = make_inputs(3, 100, seed=1)
    want = run_op(mamba_split_conv1d_scan_sp, t, grads, t["zxbcdt"], grads["out"])
    calls = []
    real = reference.segment_fwd

    def counted(zxbcdt, *args, **kwargs):
        calls.append(tuple(zxbcdt.shape[:2]))
        return real(zxbcdt, *args, **kwargs)

    monkeypatch.setattr(reference, "max_tokens_per_call", lambda spec: 40)
    monkeypatch.setattr(reference, "segment_fwd", counted)
    got = run_op(mamba_split_conv1d_scan_sp, t, grads, t["zxbcdt"], grads["out"])
    assert calls and all(r * n <= 40 for r, n in calls) and len(calls) == 9, calls  # 3 rows x 3 stretches
    for a, b in zip(got[:3], want[:3]):
        assert rel(a, b) < TOL
    for k in want[3]:
        assert rel(got[3][k], want[3][k]) < TOL, k


@pytest.mark.parametrize("dropped", ["state", "gradient"])
def test_negative_control_a_dropped_carry_fails(monkeypatch, dropped):
    """A group of one runs its tiles in known mode (ops/segment.py): each tile's S_out is the next one's S_in,
    each tile's dS_in the previous one's dS_out. Dropping either carry must show."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.ops import reference

    t, grads = make_inputs(1, 64)
    want = run_op(mamba_split_conv1d_scan_sp, t, grads, t["zxbcdt"], grads["out"])
    fwd, bwd = reference.segment_fwd, reference.segment_bwd

    def fwd_dropping(*args, **kwargs):
        out, y, S_out = yield from fwd(*args, **kwargs)
        return out, y, torch.zeros_like(S_out)

    def bwd_dropping(*args, **kwargs):
        *grads_, dS_in = yield from bwd(*args, **kwargs)
        return (*grads_, torch.zeros_like(dS_in))

    if dropped == "state":
        monkeypatch.setattr(reference, "segment_fwd", fwd_dropping)
    else:
        monkeypatch.setattr(reference, "segment_bwd", bwd_dropping)
    got = run_op(mamba_split_conv1d_scan_sp, t, grads, t["zxbcdt"], grads["out"], tile_length=16)
    if dropped == "state":
        assert rel(got[0], want[0]) > 1e-3
    else:
        assert rel(got[0], want[0]) < TOL and rel(got[2], want[2]) > 1e-3  # the output intact, dzxbcdt not


MODES = {
    "none": (dict(load_balancing="none"), "contiguous"),
    "virtual": (dict(load_balancing="virtual"), "zigzag"),
    "permute_a2a": (dict(load_balancing="permute_a2a"), "zigzag"),
    "ulysses": (dict(mode="ulysses"), "contiguous"),
}


def _sharded(rank, world):
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.op import mixer_core

    results = {}
    for mode, (kw, seq_layout) in MODES.items():
        if mode == "ulysses" and NHEADS % world:
            continue  # the head count must divide over the ranks (tested at 2 ranks)
        for packed in (False, True):
            per_rank = 40
            t, grads = make_inputs(2, per_rank * world, seed=world)
            seq = labels(2, per_rank * world, [[7, 20, 21, 40, 41, 66], [3]]) if packed else None
            shard = lambda x, sl=seq_layout: layout.shard_sequence(x, rank, world, sl)  # noqa: E731
            extra = dict(kw, input_layout=seq_layout, seq_idx=None if seq is None else shard(seq))
            w = 1.0 / world  # the copies of final_states share its gradient
            want = run_op(mixer_core, t, grads, shard(t["zxbcdt"]), shard(grads["out"]), w, **extra)
            got = run_op(mixer_core, t, grads, shard(t["zxbcdt"]), shard(grads["out"]), w, tile_length=8, **extra)
            errs = {"out": sharded_rel_err(got[0], want[0]), "dzxbcdt": sharded_rel_err(got[2], want[2]),
                    "final": rel(got[1], want[1])}  # fmt: skip
            # want's parameter gradients summed over ranks: summed_rel_err sums got's
            for k in want[3]:
                total = want[3][k].clone()
                import deepspeed.comm as dist

                dist.all_reduce(total)
                errs["d" + k] = summed_rel_err(got[3][k], total)
            results[(mode, packed)] = dict(errs=errs, ok=agree(all(v < TOL for v in errs.values())))
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def sharded_results(request):
    world = request.param
    return world, run_ranks(_sharded, world, timeout=600)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("mode", list(MODES))
def test_tiles_inside_every_mode_equal_untiled(sharded_results, mode, packed):
    world, results = sharded_results
    if (mode, packed) not in results[0]:
        pytest.skip(f"{mode} cannot split {NHEADS} heads over {world} ranks")
    res = results[0][(mode, packed)]
    assert all(r[(mode, packed)]["ok"] == res["ok"] for r in results)
    bad = {k: v for k, v in res["errs"].items() if not v < TOL}
    assert not bad, f"world {world}, {mode}, packed={packed}: {bad}"
