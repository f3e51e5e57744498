"""The state-passing op on 2, 3, 4 and 8 gloo ranks against the single-process reference.

Each world size is spawned once and runs every case inside (``CASES``); the tests then read the
per-case errors. Every rank builds the same global inputs from one seed, runs the op on its shard
and the reference on the full sequence, and the errors are reduced over ranks (squared norms
summed), so each test sees one global number per tensor.

Tolerances. fp64: the sharded op computes the same sums as the reference, only chunked at other
boundaries and reassociated across segments, so the rounding is ~1e-15 relative; 1e-10 leaves
five orders of magnitude and still catches any algebra slip (a wrong decay or a lost term is
>= 1e-3 relative at these sizes, see the negative control). fp32: same argument at fp32's 6e-8
unit roundoff grown over a few hundred accumulations: relative RMS 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import call_op, run_case
from tests.conftest import make_inputs as shared_inputs
from tests.dist_utils import run_ranks

FP64_TOL = 1e-10
FP32_TOL = 1e-5

# name -> options; L_per_rank multiplies the world size to give the global seqlen
CASES = {
    "fp64_contig_b1_g1_k4_notchunkmultiple": dict(dtype="float64", batch=1, ngroups=1, d_conv=4, chunk=8, per_rank=13),
    "fp64_virtual_b3_g2_k2_rms_init_final_D2": dict(
        dtype="float64", batch=3, ngroups=2, d_conv=2, chunk=4, per_rank=10, lb="virtual", rms=True,
        init=True, final=True, D2=True,
    ),
    "fp64_contig_b2_g2_k4_shortshards_rmsbefore_dtlimit": dict(
        dtype="float64", batch=2, ngroups=2, d_conv=4, chunk=16, per_rank=6, rms=True, before=True,
        init=True, final=True, dt_limit=(0.01, 0.5),
    ),
    "fp64_virtual_b1_g1_k4_final": dict(dtype="float64", batch=1, ngroups=1, d_conv=4, chunk=8, per_rank=18,
                                        lb="virtual", final=True),
    "fp32_contig_b2_g2_k4_rms_init_final": dict(
        dtype="float32", batch=2, ngroups=2, d_conv=4, chunk=8, per_rank=24, rms=True, init=True, final=True
    ),
    "fp32_virtual_b3_g1_k4": dict(dtype="float32", batch=3, ngroups=1, d_conv=4, chunk=8, per_rank=24, lb="virtual"),
    # negative control: the backward without its reverse scan must fail the same check
    "bug_skip_reverse_scan": dict(
        dtype="float64", batch=2, ngroups=2, d_conv=4, chunk=4, per_rank=10, init=True, final=True,
        bug="skip_reverse_scan",
    ),
}  # fmt: skip

NHEADS, HEADDIM, DSTATE = 4, 3, 5


def make_inputs(opts, seqlen, seed=0):
    """Global inputs and upstream gradients of a case, identical on every rank (one seed)."""
    return shared_inputs(
        batch=opts["batch"], seqlen=seqlen, nheads=NHEADS, headdim=HEADDIM, ngroups=opts["ngroups"], dstate=DSTATE,
        d_conv=opts["d_conv"], dtype=getattr(torch, opts["dtype"]), seed=seed, D2=bool(opts.get("D2")),
        rms=bool(opts.get("rms")), init=bool(opts.get("init")), final=bool(opts.get("final")),
    )  # fmt: skip


def _run_case(rank, world, opts):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import scan

    lb = opts.get("lb", "none")
    opts = dict(opts, layout="zigzag" if lb == "virtual" else "contiguous")

    def sharded(sp_in):
        return call_op(mamba_split_conv1d_scan_sp, sp_in, opts, headdim=HEADDIM, load_balancing=lb)

    saved = scan.reverse_scan  # the negative control drops the backward's reverse scan (forward and backward)
    if opts.get("bug") == "skip_reverse_scan":
        scan.reverse_scan = lambda L, log_a, dfinal=None, rows=None: (torch.zeros_like(L[: len(rows)]), L[0])
    try:
        return run_case(rank, world, opts, sharded, inputs=make_inputs, headdim=HEADDIM)
    finally:
        scan.reverse_scan = saved


def _expect_error(fn):
    try:
        fn()
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _run_errors(rank, world):
    """Bad calls: every rank must raise the same kind of error (and none may hang)."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp

    opts = dict(dtype="float64", batch=1, ngroups=1, d_conv=4, chunk=8)
    t, _ = make_inputs(opts, 8 * world)
    args = (t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], 8)
    kw = dict(headdim=HEADDIM, ngroups=1)
    z = t["zxbcdt"]
    return {
        # rank 0 holds one token more than the others: caught by the cross-rank shape check
        "shape_mismatch": _expect_error(lambda: mamba_split_conv1d_scan_sp(z[:, : 6 + (rank == 0)], *args, **kw)),
        "segment_shorter_than_halo": _expect_error(lambda: mamba_split_conv1d_scan_sp(z[:, :2], *args, **kw)),
        "virtual_odd_length": _expect_error(
            lambda: mamba_split_conv1d_scan_sp(z[:, :7], *args, **kw, load_balancing="virtual")
        ),
        # the op still works after the errors (no rank left inside a collective)
        "after": _expect_error(lambda: mamba_split_conv1d_scan_sp(z[:, :8], *args, **kw)),
    }


def _run_traffic(rank, world):
    """Bytes the op actually posts (counted at comm.all_gather) vs the traffic model the demo prints."""
    from ds_mamba_spcp import comm, mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine.layout import shard_sequence
    from ds_mamba_spcp.engine.strategies import state_passing
    from ds_mamba_spcp.engine.traffic import state_passing_bytes

    counted = []
    real_all_gather = comm.all_gather

    def counting_all_gather(tensor, group, world_, async_op=True):
        counted.append(tensor.numel() * tensor.element_size() * (world_ - 1))  # ring all-gather: (cp-1) pieces
        return real_all_gather(tensor, group, world_, async_op)

    out = {}
    for lb in ("none", "virtual"):
        for final in (False, True):
            opts = dict(dtype="float32", batch=2, ngroups=2, d_conv=4, chunk=8, final=final)
            t, _ = make_inputs(opts, 16 * world)
            z = shard_sequence(t["zxbcdt"], rank, world, "zigzag" if lb == "virtual" else "contiguous")
            z.requires_grad_()
            counted.clear()
            state_passing.comm.all_gather = counting_all_gather
            try:
                res = mamba_split_conv1d_scan_sp(
                    z, t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], 8, headdim=HEADDIM,
                    ngroups=2, load_balancing=lb, return_final_states=final, check_shapes=False,
                )  # fmt: skip
                loss = (res[0].sum() + res[1].sum()) if final else res.sum()
                loss.backward()
            finally:
                state_passing.comm.all_gather = real_all_gather
            model = state_passing_bytes(
                batch=2, local_seqlen=16, nheads=NHEADS, headdim=HEADDIM, ngroups=2, dstate=DSTATE, d_conv=4,
                cp=world, dtype=torch.float32, load_balancing=lb, return_final_states=final,
            )  # fmt: skip
            out[f"{lb}_final{final}"] = (sum(counted), model)
    return out


def _run_all(rank, world):
    results = {name: _run_case(rank, world, opts) for name, opts in CASES.items()}
    results["errors"] = _run_errors(rank, world)
    results["traffic"] = _run_traffic(rank, world)
    return results


@pytest.fixture(scope="module", params=[2, 3, 4, 8], ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, run_ranks(_run_all, world, timeout=600)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("bug")])
def test_matches_reference(world_results, case):
    world, results = world_results
    tol = FP64_TOL if CASES[case]["dtype"] == "float64" else FP32_TOL
    errs = results[0][case]["errs"]
    assert all(r[case]["ok"] == results[0][case]["ok"] for r in results)  # ranks agree
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"world {world}, {case}: errors over {tol}: {bad} (all: {errs})"
    assert results[0][case]["ok"]
    expected = {"out", "dzxbcdt", "dconv1d_weight", "dconv1d_bias", "ddt_bias", "dA", "dD"}
    assert expected <= set(errs)


def test_negative_control_fails(world_results):
    """Dropping the reverse scan (a plausible bug) must break the gradients the check looks at."""
    world, results = world_results
    errs = results[0]["bug_skip_reverse_scan"]["errs"]
    assert not results[0]["bug_skip_reverse_scan"]["ok"]
    assert errs["out"] <= FP64_TOL  # forward untouched
    assert errs["dzxbcdt"] > 1e-3 and errs["dA"] > 1e-3, errs


def test_bad_calls_fail_on_every_rank(world_results):
    world, results = world_results
    errs = [r["errors"] for r in results]
    for rank_errs in errs:
        msg = rank_errs["shape_mismatch"]  # only the local seqlen differs: a variable-length shard
        assert msg.startswith("NotImplementedError") and "variable-length shards" in msg, msg
        assert "at least d_conv-1 = 3 tokens" in rank_errs["segment_shorter_than_halo"]
        assert "even local seqlen" in rank_errs["virtual_odd_length"]
        assert rank_errs["after"] == "no error"


def test_traffic_model_matches_what_is_sent(world_results):
    """``traffic.state_passing_bytes`` (what the demo and README print) equals the bytes the op posts."""
    world, results = world_results
    for rank_result in results:
        for key, (sent, model) in rank_result["traffic"].items():
            assert sent == model, f"world {world}, {key}: op posted {sent} bytes, the traffic model says {model}"
            assert sent > 0
