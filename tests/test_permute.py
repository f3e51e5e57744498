"""Zigzag <-> contiguous permutations and load_balancing="permute_p2p" / "permute_a2a" on 2, 3 and
4 gloo ranks (3 ranks: with an odd group one rank sends both its chunks to the same peer).

Permutations only move bytes, so they are checked bitwise: against ``layout.shard_sequence`` of
the same global tensor, round trips, the backward of each direction (it must be the inverse
permutation of the gradient), non-contiguous inputs, any sequence dim, and one large payload. The
op is checked like the other sharded ops (see tests/conftest.py for the tolerances: the permuted op
is the load_balancing="none" op on a contiguous shard, so the same bounds hold): outputs and every
gradient against the single-process reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import call_op, case_inputs, check_case, run_case, run_error_case
from tests.dist_utils import agree, run_ranks

CASES = {
    "fp64_p2p_b2_g2_rms_init_final_D2": dict(
        dtype="float64", batch=2, ngroups=2, d_conv=4, chunk=8, per_rank=10, layout="zigzag", lb="permute_p2p",
        rms=True, init=True, final=True, D2=True,
    ),
    "fp64_a2a_b2_g2_rms_init_final_D2": dict(
        dtype="float64", batch=2, ngroups=2, d_conv=4, chunk=8, per_rank=10, layout="zigzag", lb="permute_a2a",
        rms=True, init=True, final=True, D2=True,
    ),
    "fp64_p2p_b1_g1_k2_rmsbefore_dtlimit": dict(
        dtype="float64", batch=1, ngroups=1, d_conv=2, chunk=4, per_rank=6, layout="zigzag", lb="permute_p2p",
        rms=True, before=True, dt_limit=(0.01, 0.5),
    ),
    "fp64_a2a_b3_g1_nobias_final": dict(
        dtype="float64", batch=3, ngroups=1, d_conv=4, chunk=16, per_rank=8, layout="zigzag", lb="permute_a2a",
        nobias=True, final=True,
    ),
    "fp32_p2p_b2_g1_rms_init_final": dict(
        dtype="float32", batch=2, ngroups=1, d_conv=4, chunk=8, per_rank=16, layout="zigzag", lb="permute_p2p",
        rms=True, init=True, final=True,
    ),
    "fp32_a2a_b2_g2": dict(dtype="float32", batch=2, ngroups=2, d_conv=4, chunk=8, per_rank=16, layout="zigzag",
                           lb="permute_a2a"),
    # negative control: zigzag shards run without the permutation (as if they were contiguous)
    "bug_zigzag_without_permutation": dict(
        dtype="float64", batch=2, ngroups=2, d_conv=4, chunk=8, per_rank=10, layout="zigzag", lb="none", final=True,
    ),
}  # fmt: skip

ERROR_CASES = {
    "scan_odd_local_seqlen": (dict(ngroups=1, layout="zigzag", per_rank=5, lb="permute_p2p"), "even local seqlen"),
    "scan_shapes_differ_across_ranks": (dict(ngroups=1, rank0_extra=2, lb="permute_a2a"), "variable-length shards"),
}

# (shape with the sequence at dim, as a function of the global length, dim)
PERMUTE_SHAPES = [
    (lambda n: (2, n, 5), 1),
    (lambda n: (n, 4), 0),
    (lambda n: (2, 3, n, 2), 2),
    (lambda n: (3, n, 1, 2), -3),
    (lambda n: (1, n, 7), 1),
]
METHODS = ("p2p", "a2a")
LARGE = (1, 2048, 512)  # per rank: (batch, local seqlen, width) fp32, 4 MiB per rank and direction


def _sp(opts):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp

    return lambda inputs: call_op(mamba_split_conv1d_scan_sp, inputs, opts, load_balancing=opts["lb"])


def _permutation_checks(rank, world):
    """name -> bool (agreed over ranks): every permutation property, bitwise."""
    from ds_mamba_spcp.engine.layout import shard_sequence
    from ds_mamba_spcp.engine.permute import contiguous_to_zigzag, zigzag_to_contiguous

    g = torch.Generator().manual_seed(1)

    def rnd(shape, dtype):
        if dtype == torch.int64:
            return torch.randint(-1000, 1000, shape, generator=g)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    out = {}
    for method in METHODS:
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.int64):
            for i, (shape_of, dim) in enumerate(PERMUTE_SHAPES):
                name = f"{method}_{str(dtype)[6:]}_shape{i}"
                full = rnd(shape_of(2 * world * 3), dtype)
                z, c = (shard_sequence(full, rank, world, lay, dim=dim) for lay in ("zigzag", "contiguous"))
                to_c = zigzag_to_contiguous(z, None, method, dim)
                out[name + "_zigzag_to_contiguous"] = torch.equal(to_c, c)
                out[name + "_contiguous_to_zigzag"] = torch.equal(contiguous_to_zigzag(c, None, method, dim), z)
                out[name + "_round_trip"] = torch.equal(contiguous_to_zigzag(to_c, None, method, dim), z)
                # a strided (non-contiguous) view of the same values
                wide = torch.zeros(*z.shape[:-1], 2 * z.shape[-1], dtype=dtype)
                wide[..., ::2] = z
                out[name + "_strided_input"] = torch.equal(zigzag_to_contiguous(wide[..., ::2], None, method, dim), c)
                if dtype.is_floating_point:  # backward of each direction = the inverse permutation, exact
                    gfull = rnd(full.shape, dtype)
                    gz, gc = (shard_sequence(gfull, rank, world, lay, dim=dim) for lay in ("zigzag", "contiguous"))
                    zr, cr = z.clone().requires_grad_(), c.clone().requires_grad_()
                    zigzag_to_contiguous(zr, None, method, dim).backward(gc)
                    contiguous_to_zigzag(cr, None, method, dim).backward(gz)
                    out[name + "_backward_zigzag_to_contiguous"] = torch.equal(zr.grad, gz)
                    out[name + "_backward_contiguous_to_zigzag"] = torch.equal(cr.grad, gc)
        # a large payload, and the output's chunks must not alias the input
        b, lloc, width = LARGE
        full = rnd((b, world * lloc, width), torch.float32)
        z, c = (shard_sequence(full, rank, world, lay) for lay in ("zigzag", "contiguous"))
        to_c = zigzag_to_contiguous(z, None, method)
        back = contiguous_to_zigzag(to_c, None, method)
        out[f"{method}_large_payload"] = torch.equal(to_c, c) and torch.equal(back, z)
        out[f"{method}_no_aliasing"] = to_c.data_ptr() != z.data_ptr() and back.data_ptr() != to_c.data_ptr()
    return {k: agree(v) for k, v in out.items()}


def _convert_errors(rank, world):
    from ds_mamba_spcp.engine.permute import zigzag_to_contiguous

    res = {}
    for name, kwargs in {
        "convert_odd_length": dict(x=torch.zeros(2, 5, 3)),
        "convert_unknown_method": dict(x=torch.zeros(2, 4, 3), method="nccl"),
    }.items():
        try:
            zigzag_to_contiguous(**kwargs)
            res[name] = None
        except Exception as e:  # noqa: BLE001 - checked by the test
            res[name] = (type(e).__name__, str(e))
    return res


def _run_all(rank, world):
    results = {name: run_case(rank, world, opts, _sp(opts)) for name, opts in CASES.items()}
    for name, (opts, _) in ERROR_CASES.items():
        results[name] = run_error_case(rank, world, opts, _sp(opts))
    results.update(_convert_errors(rank, world))
    results["permutations"] = _permutation_checks(rank, world)
    return results


# 8 ranks: slow (8 processes on CI's two cores); 3 (odd) and 4 hold every path the permutations take
@pytest.fixture(scope="module", params=[2, 3, 4, pytest.param(8, marks=pytest.mark.slow)], ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, run_ranks(_run_all, world, timeout=600)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("bug")])
def test_matches_reference(world_results, case):
    world, results = world_results
    check_case(world, results, case, CASES[case])


def test_permutations_exact(world_results):
    world, results = world_results
    checks = results[0]["permutations"]
    assert len(checks) == len(METHODS) * (4 * len(PERMUTE_SHAPES) * 4 + 3 * len(PERMUTE_SHAPES) * 2 + 2)
    failed = sorted(k for k, v in checks.items() if not v)
    assert not failed, f"world {world}: {failed}"


@pytest.mark.parametrize(
    "case, phrase",
    [(k, v[1]) for k, v in ERROR_CASES.items()]
    + [("convert_odd_length", "even local length"), ("convert_unknown_method", "method must be one of")],
)
def test_error_raised_on_every_rank(world_results, case, phrase):
    world, results = world_results
    for rank, res in enumerate(results):
        assert res[case] is not None, f"world {world}, rank {rank}: {case} did not raise"
        kind, msg = res[case]
        # a local seqlen that differs (and nothing else) is a variable-length shard: not supported
        want = "NotImplementedError" if "variable-length" in phrase else "ValueError"
        assert kind == want and phrase in msg, f"world {world}, rank {rank}: {kind}: {msg}"


def test_negative_control_fails(world_results):
    """Zigzag shards run without the permutation (a plausible bug) must fail the same check."""
    world, results = world_results
    res = results[0]["bug_zigzag_without_permutation"]
    assert not res["ok"]
    assert res["errs"]["out"] > 1e-3 and res["errs"]["dzxbcdt"] > 1e-3, res["errs"]


@pytest.mark.parametrize("lb", ["permute_p2p", "permute_a2a"])
def test_group_of_one_is_single_device_op(lb):
    """Without a distributed backend the permuted op is the reference op, bitwise."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_ref, mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine.permute import zigzag_to_contiguous

    opts = dict(dtype="float64", batch=2, ngroups=2, per_rank=12, rms=True, init=True, final=True)
    inputs, _ = case_inputs(opts, 12)
    x = inputs["zxbcdt"]
    assert zigzag_to_contiguous(x, method="a2a") is x
    got = call_op(mamba_split_conv1d_scan_sp, inputs, opts, load_balancing=lb)
    want = call_op(mamba_split_conv1d_scan_ref, inputs, opts)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
