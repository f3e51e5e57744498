"""The summary exchange's log-depth scan (``summary_exchange="scan"``, engine/exchange.py) against the all-gather.

1. The schedule (``exchange.rounds``) run in one process (``simulate_exclusive_scan``) against the sequential
   scan (``scan.exclusive_scan`` / ``scan.reverse_scan``) for every number of segments from 1 to 1024, fp64, with
   decays of -inf (document starts) among them.
2. What a rank receives and sends, from the schedule, at cp up to 1024: at most ceil(log2 segments) summaries per
   layer and direction (ceil(log2 64) = 6 at cp 64 against 63 for the all-gather; for ``virtual`` at most
   ceil(log2 128) = 7 per segment a rank holds, against 128), as the cost model states it.
3. The distributed exchange on gloo ranks at cp 2, 3, 5 and 16: the op with ``summary_exchange="scan"`` against
   the same op with ``"allgather"`` in every state-passing load balancing, with packed rows, initial states and
   final states, forward and backward; the forward-only prefill (every document's final state) the same. fp64.
   Each rank also counts the summaries it sent by point-to-point: exactly the schedule's count.

Tolerance: 1e-12 relative RMS (fp64). The two methods compute the same sums of the same fp64 products, in another
association (the all-gather's masked window sums of log-decays and one einsum, the scan's pairwise compositions):
seen <= 3e-16 on the schedule and ~1e-15 through the op; a lost round, a swapped composition or a decay applied
twice is O(1) (the negative control, a scan that skips its last round, is checked to fail the bound).
"""

from __future__ import annotations

import pytest
import torch

from tests import delta_cases
from tests.conftest import call_op, make_inputs
from tests.dist_utils import agree, run_ranks, sharded_rel_err

TOL = 1e-12
HEADDIM, NHEADS, DSTATE = 3, 4, 5


def _elements(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(n, 2, 3, 2, 4, dtype=torch.float64, generator=g)
    a = -torch.rand(n, 2, 3, dtype=torch.float64, generator=g)
    if n > 2:  # document starts: the chain is cut there
        a[n // 3, 0, 1] = a[n - 1, 1, 2] = float("-inf")
    init = torch.randn(2, 3, 2, 4, dtype=torch.float64, generator=g)
    return S, a, init


def _rel(got, want):
    return ((got - want).norm() / want.norm()).item()


def test_schedule_equals_the_sequential_scan_up_to_1024_segments():
    """Every number of segments from 1 to 1024 against the state carried one segment at a time (an exclusive scan
    of the first n segments is the first n states of a longer one), and the backward's reverse scan (the same
    scan over the segments in reverse order) against ``scan.reverse_scan``."""
    from ds_mamba_spcp.engine import exchange, scan

    S, a, init = _elements(1024)
    carried = [init]  # the state entering segment p, and after the last
    for p in range(1024):
        carried.append(S[p] + torch.exp(a[p])[..., None, None] * carried[-1])
    carried = torch.stack(carried)
    worst = 0.0
    for n in range(1, 1025):
        got_in, got_final = exchange.simulate_exclusive_scan(S[:n], a[:n], init)
        worst = max(worst, _rel(got_in, carried[:n]), _rel(got_final, carried[n]))
    for n in (1, 2, 7, 64, 100):
        want_grads, want_dinit = scan.reverse_scan(S[:n], a[:n], init)
        got_grads, got_dinit = exchange.simulate_exclusive_scan(S[:n].flip(0), a[:n].flip(0), init)
        worst = max(worst, _rel(got_grads.flip(0), want_grads), _rel(got_dinit, want_dinit))
    assert worst <= TOL, worst
    # negative control: the first round dropped (each segment misses its neighbour's summary)
    bug = [_rel(exchange.simulate_exclusive_scan(S[:n], a[:n], init, rounds=exchange.rounds(n)[1:])[0], carried[:n])
           for n in (5, 64, 1000)]  # fmt: skip
    assert min(bug) > 1e-3, bug


@pytest.mark.parametrize("cp", [2, 3, 5, 8, 64, 100, 1024])
def test_each_rank_receives_log_many_summaries(cp):
    import math

    from ds_mamba_spcp.engine import exchange, traffic

    summary = traffic.summary_bytes(batch=1, nheads=64, headdim=64, dstate=128)
    for chain, nlocal in (("contiguous", 1), ("zigzag", 2)):
        bound = math.ceil(math.log2(cp * nlocal))  # per segment a rank holds
        got = exchange.summaries_moved(cp, chain, exchange.SCAN)[1]
        sent = traffic.summaries_sent(cp, chain, exchange.SCAN)
        assert max(got.values()) <= nlocal * bound and max(sent.values()) <= nlocal * bound, (chain, got, sent)
        if chain == "contiguous":
            assert max(got.values()) == bound  # the last rank receives in every round
        cost = traffic.exchange_cost(exchange.SCAN, cp=cp, summary=summary, chain=chain)
        assert cost["summaries_received"] == max(got.values()) and cost["messages"] == bound
        gather = traffic.exchange_cost(exchange.ALLGATHER, cp=cp, summary=summary, chain=chain)
        assert gather["summaries_received"] == (cp - 1) * nlocal
    if cp == 64:
        assert max(exchange.summaries_moved(64, "contiguous", exchange.SCAN)[1].values()) == 6
        assert max(exchange.summaries_moved(64, "zigzag", exchange.SCAN)[1].values()) <= 2 * 7


def test_auto_picks_the_all_gather_inside_a_node_and_the_scan_past_it():
    from ds_mamba_spcp.engine import traffic

    summary = traffic.summary_bytes(batch=1, nheads=64, headdim=64, dstate=128)  # 2 MiB: Nemotron-3's mixer
    assert [traffic.choose_summary_exchange(cp=cp, summary=summary)[0] for cp in (2, 8, 16, 64, 256)] == [
        "allgather", "allgather", "scan", "scan", "scan"
    ]  # fmt: skip
    method, why = traffic.choose_summary_exchange(cp=64, summary=64)  # a tiny summary: latency-bound, still the scan
    assert method == "scan" and "InfiniBand" in why


def test_scan_with_ulysses_is_refused():
    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.op import mixer_core

    with pytest.raises(ValueError, match="summary_exchange"):
        MambaSequenceParallelConfig(mode="ulysses", summary_exchange="scan")
    tensors, _ = make_inputs(batch=1, seqlen=8, nheads=NHEADS, headdim=HEADDIM, ngroups=2, dstate=DSTATE, d_conv=4)
    with pytest.raises(ValueError, match='summary_exchange="scan" with mode "ulysses"'):
        call_op(mixer_core, tensors, dict(ngroups=2, chunk=4), headdim=HEADDIM, mode="ulysses",
                summary_exchange="scan")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the distributed exchange
# ---------------------------------------------------------------------------------------------

CASES = {  # name -> (load balancing, packed rows, initial states, final states)
    "none_init_final": ("none", False, True, True),
    "none_packed": ("none", True, False, True),
    "virtual_packed_init_final": ("virtual", True, True, True),
    "permute_p2p_init": ("permute_p2p", False, True, False),
    "permute_a2a_final": ("permute_a2a", False, False, True),
}
PER_RANK = 8  # tokens per rank: two zigzag chunks of 4 >= d_conv - 1


def _labels(batch, seqlen):
    """Packed rows: documents starting inside shards and on a shard border (position PER_RANK)."""
    cuts = torch.tensor([3, PER_RANK, PER_RANK + 5, 3 * PER_RANK - 2])
    return torch.bucketize(torch.arange(seqlen), cuts, right=True).expand(batch, seqlen).int().contiguous()


def _rank(rank, world, only=None):
    from ds_mamba_spcp import comm, mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import exchange, layout, traffic
    from ds_mamba_spcp.inference.forward import mixer_core_prefill

    sent = []
    real = comm.post_p2p

    def counting(sends, *args, **kwargs):  # one call per round; one row per summary sent
        sent.append(sum(t.shape[0] for t, _ in sends))
        return real(sends, *args, **kwargs)

    comm.post_p2p = counting
    out = {}
    seqlen = PER_RANK * world
    for name, (lb, packed, init, final) in CASES.items():
        if only is not None and name not in only:
            continue
        chain = "zigzag" if lb != "none" else "contiguous"  # the input layout
        segments = "zigzag" if lb == "virtual" else "contiguous"  # the chain the exchange runs on
        tensors, grads = make_inputs(batch=2, seqlen=seqlen, nheads=NHEADS, headdim=HEADDIM, ngroups=2, dstate=DSTATE,
                                     d_conv=4, init=init, final=final, rms=True, seed=world)  # fmt: skip
        shard = lambda x, chain=chain: layout.shard_sequence(x, rank, world, chain)  # noqa: E731
        labels = shard(_labels(2, seqlen)) if packed else None
        opts = dict(ngroups=2, chunk=4, final=final)
        res = {}
        for method in ("allgather", "scan"):
            sent.clear()
            inp = {k: (shard(v) if k == "zxbcdt" else v).clone().requires_grad_() for k, v in tensors.items()}
            got = call_op(mamba_split_conv1d_scan_sp, inp, opts, headdim=HEADDIM, process_group=None,
                          load_balancing=lb, seq_idx=labels, summary_exchange=method)  # fmt: skip
            y, fin = got if final else (got, None)
            loss = (y * shard(grads["out"])).sum() + (0 if fin is None else (fin * grads["final"]).sum() / world)
            loss.backward()
            res[method] = dict(y=y.detach(), final=None if fin is None else fin.detach(),
                               grads={k: v.grad for k, v in inp.items()}, sent=list(sent))  # fmt: skip
        errs = {"out": sharded_rel_err(res["scan"]["y"], res["allgather"]["y"])}
        scan_grads, ag_grads = res["scan"]["grads"], res["allgather"]["grads"]
        errs.update({"d" + k: sharded_rel_err(g, ag_grads[k]) for k, g in scan_grads.items()})
        if final:
            errs["final_states"] = sharded_rel_err(res["scan"]["final"], res["allgather"]["final"])
        out[name] = dict(errs=errs, sent=res["scan"]["sent"], sent_allgather=res["allgather"]["sent"],
                         expected=traffic.summaries_sent(world, segments, "scan")[rank]
                         + traffic.summaries_sent(world, segments, "scan", reverse=True)[rank],
                         rounds=exchange.rounds_needed(layout.num_segments(world, segments)))  # fmt: skip
    if only is None:  # forward only: every document's final state, on packed rows
        tensors, _ = make_inputs(batch=2, seqlen=seqlen, nheads=NHEADS, headdim=HEADDIM, ngroups=2, dstate=DSTATE,
                                 d_conv=4, rms=True, seed=7)  # fmt: skip
        zx = layout.shard_sequence(tensors["zxbcdt"], rank, world, "contiguous")
        labels = layout.shard_sequence(_labels(2, seqlen), rank, world, "contiguous")
        got = {}
        for method in ("allgather", "scan"):
            y, states, tails = mixer_core_prefill(
                zx, tensors["conv1d_weight"], tensors["conv1d_bias"], tensors["dt_bias"], tensors["A"], tensors["D"],
                4, headdim=HEADDIM, ngroups=2, rmsnorm_weight=tensors["rmsnorm_weight"], seq_idx=labels,
                summary_exchange=method,
            )  # fmt: skip
            got[method] = (y, states)
        out["prefill"] = dict(
            errs={
                "out": sharded_rel_err(got["scan"][0], got["allgather"][0]),
                "states": sharded_rel_err(got["scan"][1], got["allgather"][1]),
            },  # fmt: skip
            ndocs=got["scan"][1].shape[0],
        )
    out["ok"] = agree(all(v <= TOL for case in out.values() if isinstance(case, dict) for v in case["errs"].values()))
    if only is None:  # the gated delta rule's op in the same spawned group (tests/delta_cases.py)
        out["delta"] = delta_cases.run_rank(rank, world)
    return out


# cp 8 (another power of two, 3 rounds) ran here too: its schedule is checked in one process (1., 2.) and a power
# of two through the ranks at 2 and 16; each spawned rank costs seconds of imports on CI's two cores
@pytest.fixture(scope="module", params=[2, 3, 5], ids=lambda w: f"world{w}")
def results(request):
    return request.param, run_ranks(_rank, request.param, timeout=600)


@pytest.mark.parametrize("case", [*CASES, "prefill"])
def test_scan_equals_the_all_gather(results, case):
    world, res = results
    for rank, r in enumerate(res):
        bad = {k: v for k, v in r[case]["errs"].items() if not v <= TOL}
        assert not bad, f"world {world} rank {rank} {case}: {r[case]['errs']}"
    if case != "prefill":
        for rank, r in enumerate(res):
            # forward and backward: one point-to-point post per round, the schedule's messages in all
            sent = r[case]["sent"]
            assert len(sent) == 2 * r[case]["rounds"] and sum(sent) == r[case]["expected"], (rank, sent)
            assert r[case]["sent_allgather"] == [], "the all-gather posted point-to-point messages"
    assert all(r["ok"] == res[0]["ok"] for r in res)


def _assembled(res, case):
    """The ranks' shards of the delta-rule case as whole-sequence tensors; initial_state's gradient summed."""
    from ds_mamba_spcp.engine import layout

    t = torch.from_numpy
    per = [dict(r["delta"][case]) for r in res]
    for p in per:
        p["o"], p["final"] = t(p["o"]), None if p["final"] is None else t(p["final"])
        p["grads"] = {k: t(v) for k, v in p["grads"].items()}
    seq_layout = per[0]["layout"]
    grads = {k: layout.unshard_sequence([p["grads"][k] for p in per], seq_layout) for k in per[0]["grads"]
             if k != "initial_state"}  # fmt: skip
    if "initial_state" in per[0]["grads"]:
        grads["initial_state"] = sum(p["grads"]["initial_state"] for p in per)
    o = layout.unshard_sequence([p["o"] for p in per], seq_layout)
    return o, per[0]["final"], grads, [p["final"] for p in per]


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("case", [c for c in delta_cases.CASES if not c.startswith("bug")])
def test_delta_rule_matches_the_recurrence_and_transformers(results, case):
    """The delta-rule op at cp 2, 3, 5 (fp64) against the per-token recurrence and against transformers'
    chunked form on the whole sequence: o, final states, dq, dk, dv, dg, dbeta, dinitial_state. Tolerance 1e-12
    relative (the module's: fp64 sums reassociated across pieces and segments; seen ~1e-15)."""
    world, res = results
    o, final, grads, finals = _assembled(res, case)
    if final is not None:
        assert all(torch.equal(f, final) for f in finals), "the ranks' final states differ"
    for which in ("recurrent", "transformers"):
        ref = delta_cases.reference(case, world, which)
        errs = {"o": _rel(o, ref["o"]), **{"d" + k: _rel(g, ref["grads"][k]) for k, g in grads.items()}}
        if final is not None:
            errs["final"] = _rel(final, ref["final"])
        assert set(errs) >= {"o", "dq", "dk", "dv", "dg", "dbeta"}
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"world {world}, {case} against {which}: {errs}"


def test_delta_rule_negative_control(results):
    """Dropping the incoming state (S_in = 0 on every segment) fails the same check by orders of magnitude."""
    world, res = results
    o, final, grads, _ = _assembled(res, "bug_drop_incoming_state")
    ref = delta_cases.reference("bug_drop_incoming_state", world, "recurrent")
    assert _rel(o, ref["o"]) > 1e-3 and _rel(final, ref["final"]) > 1e-3
    assert _rel(grads["k"], ref["grads"]["k"]) > 1e-3


def test_delta_rule_bad_calls_fail_on_every_rank(results):
    world, res = results
    for r in res:
        errs = r["delta"]["errors"]
        assert errs["options_differ"].startswith("ValueError") and "output_final_state" in errs["options_differ"]
        assert errs["ulysses_heads"].startswith("ValueError"), errs
        assert errs["after"] == "no error"


@pytest.mark.slow  # 16 processes on CI's two cores; the same rounds' code runs at cp 5 (4 rounds) in every case
def test_sixteen_ranks():
    """One run at 16 ranks (32 segments under virtual): packed rows, initial and final states."""
    res = run_ranks(_rank, 16, ["virtual_packed_init_final"], timeout=900)
    for rank, r in enumerate(res):
        case = r["virtual_packed_init_final"]
        assert all(v <= TOL for v in case["errs"].values()), (rank, case["errs"])
        assert len(case["sent"]) == 2 * 5 and max(case["sent"]) <= 2  # 5 rounds (32 segments), two segments per rank
