"""Packed rows (several documents per row, ``seq_idx`` / ``cu_seqlens``) in every mode, on 2, 3 and 4 gloo ranks.

The oracle is independent of the package's chunked code: the mixer core written out token by token
(``oracle``): a causal conv that reads only inputs of the token's own document, a recurrence whose
state restarts at every document start (``reference.ssd_recurrent_ref`` with labels), then D, the gate
and the gated RMSNorm, differentiated by autograd. Every rank builds the same global inputs and labels
from one seed, runs the op on its shard in the mode's layout, and compares its output shard and every
gradient (replicated inputs' gradients summed over the ranks) with the oracle's.

Label patterns (row 0 and row 1 differ, so batch rows never share boundaries):
- ``edges``: a document starting exactly on every segment border (shard border, or zigzag chunk
  border), one and two tokens after a border (inside the conv halo's reach), documents shorter than
  d_conv-1, one token long documents, and labels that start at 7 and grow by 3;
- ``random``: random starts from the seed, and one document that spans three or more segments;
- ``per_token``: one document per token (row 0) and a single document labelled 4 (row 1: no start
  at all, and a first label that is not 0, so initial_states must still reach it).

Tolerance: fp64. The sharded op and the oracle compute the same sums in another order (chunked,
split at segment borders, affine across ranks), so they agree to ~1e-14 relative; 1e-10 leaves four
orders of magnitude and catches any real slip: the negative control (documents that begin exactly on
a segment border left to receive the incoming state) is off by more than 1e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import make_inputs as shared_inputs
from tests.dist_utils import agree, rel_err, run_ranks, sharded_rel_err, summed_rel_err

TOL = 1e-10
NHEADS, HEADDIM, DSTATE, D_CONV, CHUNK = 24, 2, 3, 4, 4  # 24 heads: ulysses divides them at 2, 3 and 4 ranks
PER_RANK, BATCH = 16, 2
F64 = torch.float64

# mode name -> (op keyword arguments, layout of the shards, ngroups); ulysses needs ngroups | cp or cp | ngroups
MODES = {
    "none": (dict(load_balancing="none"), "contiguous", 2),
    "virtual": (dict(load_balancing="virtual"), "zigzag", 2),
    "permute_p2p": (dict(load_balancing="permute_p2p"), "zigzag", 2),
    "permute_a2a": (dict(load_balancing="permute_a2a"), "zigzag", 1),
    "ulysses": (dict(mode="ulysses"), "contiguous", 1),
    "ulysses_zigzag": (dict(mode="ulysses"), "zigzag", 1),
}
PATTERNS = ("edges", "random", "per_token")


def labels_for(pattern: str, seqlen: int, nseg: int, seed: int = 0) -> torch.Tensor:
    """(BATCH, seqlen) int32 document labels, non-decreasing along each row; see the module docstring."""
    seg = seqlen // nseg
    g = torch.Generator().manual_seed(seed)
    if pattern == "edges":
        starts0 = set()
        for s in range(1, nseg):
            starts0 |= {s * seg, s * seg + 1} if s % 2 else {s * seg, s * seg + 2}
        starts0 |= {5, 6, seqlen - 1}  # short documents: one token (5), one token at the very end
        starts1 = {s * seg + 1 for s in range(1, nseg)} | {2, 3, 4}  # one after every border; a 1-token run
        rows = [sorted(x for x in starts0 if 0 < x < seqlen), sorted(x for x in starts1 if 0 < x < seqlen)]
        base, step = 7, 3
    elif pattern == "random":
        n = max(2, seqlen // 6)
        rows = [sorted(set(torch.randint(1, seqlen, (n,), generator=g).tolist())) for _ in range(BATCH)]
        rows[1] = [x for x in rows[1] if x < seg // 2 or x > seqlen - seg // 2]  # one document spans 3+ segments
        base, step = 0, 1
    elif pattern == "per_token":
        labels = torch.stack([torch.arange(seqlen), torch.full((seqlen,), 4)])
        return labels.to(torch.int32)
    else:
        raise ValueError(pattern)
    out = [base + step * torch.bucketize(torch.arange(seqlen), torch.tensor(r, dtype=torch.long), right=True)
           for r in rows]  # fmt: skip
    return torch.stack(out).to(torch.int32)


def make_inputs(ngroups, seqlen, seed=0):
    return shared_inputs(
        batch=BATCH, seqlen=seqlen, nheads=NHEADS, headdim=HEADDIM, ngroups=ngroups, dstate=DSTATE, d_conv=D_CONV,
        seed=seed, rms=True, init=True, final=True, a_offset=0.2,
    )  # fmt: skip


def oracle(t, labels, ngroups):
    """The mixer core token by token with document resets (autograd-differentiable, fp64)."""
    from ds_mamba_spcp.ops import reference as ref

    d_inner = NHEADS * HEADDIM
    z, xBC, dt = torch.split(t["zxbcdt"], [d_inner, t["conv1d_weight"].shape[0], NHEADS], -1)
    K = D_CONV
    pad = F.pad(xBC, (0, 0, K - 1, 0))
    ids = F.pad(labels.long(), (K - 1, 0), value=-1)  # nothing before the row
    cols = []
    for s in range(xBC.shape[1]):
        same = (ids[:, s : s + K] == labels[:, s : s + 1].long()).to(F64)  # [b, K]: taps of this token's document
        cols.append((pad[:, s : s + K] * same[..., None] * t["conv1d_weight"].T).sum(1) + t["conv1d_bias"])
    xBC = F.silu(torch.stack(cols, dim=1))
    x, B, C = torch.split(xBC, [d_inner, ngroups * DSTATE, ngroups * DSTATE], -1)
    bl = x.shape[:2]
    x, B, C = x.reshape(*bl, NHEADS, HEADDIM), B.reshape(*bl, ngroups, DSTATE), C.reshape(*bl, ngroups, DSTATE)
    dt = F.softplus(dt + t["dt_bias"])
    y, final = ref.ssd_recurrent_ref(x, dt, t["A"], B, C, t["initial_states"], seq_idx=labels)
    y = (y + x * t["D"][:, None]).reshape(*bl, d_inner)
    out = ref.gated_rmsnorm_ref(y, z, t["rmsnorm_weight"], 1e-6, d_inner // ngroups, False)
    return out, final


def _run_case(rank, world, mode, pattern, bug=None):
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.engine.strategies import state_passing
    from ds_mamba_spcp.op import mixer_core

    kwargs, seq_layout, ngroups = MODES[mode]
    seqlen = PER_RANK * world
    nseg = layout.num_segments(world, seq_layout)
    t, grads = make_inputs(ngroups, seqlen, seed=world)
    labels = labels_for(pattern, seqlen, nseg, seed=world)

    ref_in = {k: v.clone().requires_grad_() for k, v in t.items()}
    ref_out, ref_final = oracle(ref_in, labels, ngroups)
    ((ref_out * grads["out"]).sum() + (ref_final * grads["final"]).sum()).backward()

    shard = lambda x: layout.shard_sequence(x, rank, world, seq_layout)  # noqa: E731
    sp_in = {k: (shard(v) if k == "zxbcdt" else v).clone().requires_grad_() for k, v in t.items()}
    saved = state_passing._HaloExchange.wait
    if bug == "start_on_border_ignored":

        def wait(self):
            value = saved(self)
            self.start0 = torch.zeros_like(self.start0)  # a document that begins the segment gets S_in anyway
            return value

        state_passing._HaloExchange.wait = wait
    try:
        out, final = mixer_core(
            sp_in["zxbcdt"], sp_in["conv1d_weight"], sp_in["conv1d_bias"], sp_in["dt_bias"], sp_in["A"], sp_in["D"],
            CHUNK, headdim=HEADDIM, ngroups=ngroups, rmsnorm_weight=sp_in["rmsnorm_weight"],
            initial_states=sp_in["initial_states"], return_final_states=True, seq_idx=shard(labels),
            input_layout=seq_layout, backend="reference", **kwargs,
        )  # fmt: skip
        # the copies of final_states on the ranks share its gradient: each takes a different share
        weight = (rank + 1) / (world * (world + 1) / 2)
        ((out * shard(grads["out"])).sum() + weight * (final * grads["final"]).sum()).backward()
    finally:
        state_passing._HaloExchange.wait = saved

    errs = {"out": sharded_rel_err(out.detach(), shard(ref_out.detach()))}
    errs["dzxbcdt"] = sharded_rel_err(sp_in["zxbcdt"].grad, shard(ref_in["zxbcdt"].grad))
    errs["final_states"] = rel_err(final, ref_final)
    for k in t:
        if k != "zxbcdt":
            errs["d" + k] = summed_rel_err(sp_in[k].grad, ref_in[k].grad)
    return {"errs": errs, "ok": agree(all(v <= TOL for v in errs.values()))}


def _cu_seqlens_case(rank, world):
    """cu_seqlens (batch 1, the same on every rank) gives exactly what the seq_idx it describes gives."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import layout

    t, _ = make_inputs(2, PER_RANK * world, seed=5)
    t = {k: v[:1] if k in ("zxbcdt", "initial_states") else v for k, v in t.items()}
    labels = labels_for("edges", PER_RANK * world, world, seed=5)[:1]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.unique_consecutive(labels[0], return_counts=True)[1]])
    cu = cu.cumsum(0)
    args = [layout.shard_sequence(t["zxbcdt"], rank, world, "contiguous")] + [
        t[k] for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")
    ]
    kw = dict(headdim=HEADDIM, ngroups=2, rmsnorm_weight=t["rmsnorm_weight"], initial_states=t["initial_states"],
              return_final_states=True, backend="reference")  # fmt: skip
    a = mamba_split_conv1d_scan_sp(*args, CHUNK, seq_idx=layout.shard_sequence(labels, rank, world, "contiguous"), **kw)
    b = mamba_split_conv1d_scan_sp(*args, CHUNK, cu_seqlens=cu, **kw)
    return agree(all(torch.equal(x, y) for x, y in zip(a, b)))


def _error_cases(rank, world):
    """Bad labels: every rank raises the same kind of error, none hangs, and the group stays usable."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import layout

    t, _ = make_inputs(2, PER_RANK * world, seed=9)
    labels = labels_for("random", PER_RANK * world, world, seed=9)
    x = layout.shard_sequence(t["zxbcdt"], rank, world, "contiguous")
    mine = layout.shard_sequence(labels, rank, world, "contiguous")
    args = (x, t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], CHUNK)
    kw = dict(headdim=HEADDIM, ngroups=2, backend="reference")

    def attempt(**extra):
        try:
            mamba_split_conv1d_scan_sp(*args, **kw, **extra)
        except (ValueError, NotImplementedError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    bad_inside = mine.clone()
    if rank == world - 1:
        bad_inside[1, 0] = bad_inside[1].max() + 1  # decreasing inside the last rank's shard, only there
    border = mine.clone()
    if rank == 0:
        border = border + 1000  # rank 1 starts below where rank 0 ended
    cu = torch.tensor([0, 5, PER_RANK * world])
    return {
        "decreasing_inside_one_shard": attempt(seq_idx=bad_inside),
        "decreasing_across_a_border": attempt(seq_idx=border),
        "float_labels_on_one_rank": attempt(seq_idx=mine.double() if rank == 0 else mine),
        "seq_idx_and_cu_seqlens": attempt(seq_idx=mine, cu_seqlens=cu),
        "cu_seqlens_with_batch_2": attempt(cu_seqlens=cu),
        "negative_label": attempt(seq_idx=mine - 100 * (rank == 0)),
        "int64_labels_accepted": attempt(seq_idx=mine.long()),
        "after": attempt(seq_idx=mine),
    }


def _run_all(rank, world):
    results = {}
    for mode in MODES:
        for pattern in PATTERNS:
            results[(mode, pattern)] = _run_case(rank, world, mode, pattern)
    results[("bug", "edges")] = _run_case(rank, world, "none", "edges", bug="start_on_border_ignored")
    results["cu_seqlens"] = _cu_seqlens_case(rank, world)
    results["errors"] = _error_cases(rank, world)
    return results


# 2, 3 and 4 ranks: an odd group, zigzag chunks, ulysses with sharded and replicated groups; 8 ranks (16
# segments) took a minute and reached no code path 4 ranks do not (the summary of 8 ranks fits the
# descriptor as 4 ranks' does; the scan over 16 segments runs in test_state_passing)
@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, run_ranks(_run_all, world, timeout=900)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", list(MODES))
def test_packed_rows_match_the_token_by_token_oracle(world_results, mode, pattern):
    world, results = world_results
    res = results[0][(mode, pattern)]
    assert all(r[(mode, pattern)]["ok"] == res["ok"] for r in results)  # every rank reached the same verdict
    bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
    assert not bad, f"world {world}, {mode}, {pattern}: errors over {TOL}: {bad} (all: {res['errs']})"
    assert {"out", "dzxbcdt", "final_states", "dinitial_states", "dA", "ddt_bias", "dconv1d_weight"} <= set(res["errs"])


def test_negative_control_fails(world_results):
    """A document that begins exactly on a segment border but still receives the incoming state must fail."""
    world, results = world_results
    errs = results[0][("bug", "edges")]["errs"]
    assert not results[0][("bug", "edges")]["ok"]
    assert errs["out"] > 1e-3 and errs["dzxbcdt"] > 1e-3, errs


def test_cu_seqlens_equals_seq_idx(world_results):
    world, results = world_results
    assert all(r["cu_seqlens"] for r in results)


@pytest.mark.parametrize(
    "case, kind, phrase",
    [
        ("decreasing_inside_one_shard", "ValueError", "decreases inside"),
        ("decreasing_across_a_border", "ValueError", "across a shard border"),
        ("float_labels_on_one_rank", "ValueError", "integer document labels"),
        ("seq_idx_and_cu_seqlens", "ValueError", "not both"),
        ("cu_seqlens_with_batch_2", "ValueError", "batch 1"),
        ("negative_label", "ValueError", "negative label"),
    ],
)
def test_bad_labels_fail_on_every_rank(world_results, case, kind, phrase):
    world, results = world_results
    for rank, res in enumerate(results):
        msg = res["errors"][case]
        assert msg.startswith(kind), f"world {world}, rank {rank}: {msg}"
        if case != "float_labels_on_one_rank" or rank == 0:  # the other ranks name the rank that failed
            assert phrase in msg, f"world {world}, rank {rank}: {msg}"
        else:
            assert "rank(s) [0]" in msg, f"world {world}, rank {rank}: {msg}"
    for res in results:
        assert res["errors"]["int64_labels_accepted"] == "no error"
        assert res["errors"]["after"] == "no error"  # no rank left inside a collective
