"""The op's forward-only prefill path (ds_mamba_spcp.inference.forward.mixer_core_prefill, the dispatcher's
forward-only route) on gloo ranks, fp64, in every mode and layout, with tiles and with packed rows.

1. Unpacked rows, 2 ranks: this rank's output shard and the final state against the single-device reference
   op on the whole sequence (``mamba_split_conv1d_scan_ref``) within 1e-10 relative RMS (fp64: the sharded op
   reassociates the same sums, ~1e-15; ``tests/test_state_passing.py`` argues the bound); the conv state equal
   to the whole sequence's last d_conv pre-conv columns bitwise (a copy, no arithmetic); nothing requires grad
   although every input does (no graph recorded).
2. Forward only against the training route under no_grad (``op.mixer_core`` with ``forward_only`` False), same
   inputs, 2 ranks and a group of one: out and final_states bitwise equal (the same kernels on the same spans in
   the same order: no seq_idx, no initial state), and what differs is seen: the training route runs the
   autograd Function (``state_passing._forward``), fills the tiles' saved dict (``tiles.segment_fwd``) and asks
   the backend to keep y; the forward-only route does none of it, and in a group of one its tiles are open one
   at a time (the training route holds all of them until the last summary).
3. Packed rows (``seq_idx``, and ``cu_seqlens``), 2 and 4 ranks: every document's final state and conv tail, on
   every rank, against that document run alone through the reference op in one process (its own initial
   state: the row's for the row's first document, none for the others). Documents cross rank borders and tile
   borders, one of 2 tokens (< d_conv - 1) crosses a rank border at 4 ranks, one of 1 token ends exactly on a
   border, one of 1 token starts the row. States within 1e-10 relative RMS per document (fp64; the tiles and
   segments cut the chunked scan at other places than the lone document's run: reassociation, ~1e-16 seen),
   tails bitwise (copies of the document's last d_conv columns, zeros before its start).
4. Autocast (one process): the chunked prefill's tiles (``tile_forward``) and ``mixer_core_prefill`` under CPU bf16
   autocast are bitwise what they are without it, for fp32 inputs (autocast off inside both).
Negative controls: the last rank's own last columns are not the conv state under zigzag (the sequence ends on
rank 0); a state restarting at every rank border (S_in zeroed) puts the documents that cross a border off by
> 1e-3 while the test's bound is 1e-10; a rank's own shard alone gives another tail for the 2-token document
that crosses into it.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import agree, rel_err, run_ranks

TOL = 1e-10
NHEADS, HEADDIM, NGROUPS, DSTATE, D_CONV, CHUNK, BATCH = 8, 4, 2, 5, 4, 8, 2
WORLD, SEQLEN = 2, 28  # zigzag chunks of 7 tokens
CASES = {
    "none": dict(mode="state_passing", load_balancing="none"),
    "virtual": dict(mode="state_passing", load_balancing="virtual"),
    "permute_p2p": dict(mode="state_passing", load_balancing="permute_p2p"),
    "permute_a2a": dict(mode="state_passing", load_balancing="permute_a2a"),
    "ulysses": dict(mode="ulysses", input_layout="contiguous"),
    "ulysses_zigzag": dict(mode="ulysses", input_layout="zigzag"),
    "none_tiles": dict(mode="state_passing", load_balancing="none", tile_length=4),
    "virtual_tiles": dict(mode="state_passing", load_balancing="virtual", tile_length=3),
}
# packed rows: 32 tokens (4 ranks: contiguous shards of 8, zigzag chunks of 4). Row 0's documents start at 7, 9,
# 15, 16, 26, 30: [7, 9) crosses the border at 8 with 2 tokens, [15, 16) ends on the border at 16, [16, 26)
# crosses 24 (and the tiles' borders); row 1: a 1-token document, one across every rank, a 1-token one.
DOC_SEQLEN, DOCS = 32, [[7, 2, 6, 1, 10, 4, 2], [1, 30, 1]]
DOC_CASES = {  # the same modes, tiles of 3 (more tile borders inside the documents)
    **CASES,
    "none_tiles": dict(mode="state_passing", load_balancing="none", tile_length=3),
    "virtual_tiles": dict(mode="state_passing", load_balancing="virtual", tile_length=3),
    "ulysses_tiles": dict(mode="ulysses", input_layout="contiguous", tile_length=5),
    "none_cu_seqlens": dict(mode="state_passing", load_balancing="none", rows=1),
}


def _inputs(seed: int, seqlen: int = SEQLEN, batch: int = BATCH):
    g = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = NHEADS * HEADDIM, NHEADS * HEADDIM + 2 * NGROUPS * DSTATE

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    return dict(
        zxbcdt=rnd(batch, seqlen, d_inner + conv_dim + NHEADS), conv1d_weight=rnd(conv_dim, D_CONV, scale=0.5),
        conv1d_bias=rnd(conv_dim, scale=0.5), dt_bias=rnd(NHEADS, scale=0.5),
        A=-torch.rand(NHEADS, generator=g, dtype=torch.float64).mul(0.1).add(0.02), D=rnd(NHEADS),
        rmsnorm_weight=rnd(d_inner, scale=0.3).add(1.0),
    )  # fmt: skip


def _seq_idx(docs):
    return torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in docs]).int()


def _layout_of(opts):
    return opts.get("input_layout") or ("zigzag" if opts.get("load_balancing", "none") != "none" else "contiguous")


def _expected_tail(t):
    d_inner, conv_dim = NHEADS * HEADDIM, t["conv1d_weight"].shape[0]
    return t["zxbcdt"][:, -D_CONV:, d_inner : d_inner + conv_dim].transpose(1, 2)


def document_oracle(t, docs, initial_states):
    """Each document run alone through the single-device reference op: (states (ndocs, ...), tails (ndocs, ...))."""
    from ds_mamba_spcp.ops.reference import mamba_split_conv1d_scan_ref

    d_inner, conv_dim = NHEADS * HEADDIM, t["conv1d_weight"].shape[0]
    params = [t[k] for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
    states, tails = [], []
    for b, row in enumerate(docs):
        start = 0
        for i, n in enumerate(row):
            piece = t["zxbcdt"][b : b + 1, start : start + n]
            init = initial_states[b : b + 1] if i == 0 else None
            _, final = mamba_split_conv1d_scan_ref(
                piece, *params, CHUNK, initial_states=init, return_final_states=True, headdim=HEADDIM,
                ngroups=NGROUPS, rmsnorm_weight=t["rmsnorm_weight"],
            )  # fmt: skip
            cols = piece[0, -D_CONV:, d_inner : d_inner + conv_dim]
            tails.append(torch.cat([cols.new_zeros(D_CONV - cols.shape[0], conv_dim), cols]).T)
            states.append(final[0])
            start += n
    return torch.stack(states), torch.stack(tails)


def crossing_documents(docs, world, seq_layout):
    """Indices of the documents whose tokens lie in more than one causal segment."""
    from ds_mamba_spcp.engine import layout

    seg = DOC_SEQLEN // layout.num_segments(world, seq_layout)
    found, d = [], 0
    for row in docs:
        start = 0
        for n in row:
            if start // seg != (start + n - 1) // seg:
                found.append(d)
            start, d = start + n, d + 1
    return found


class Probe:
    """Counts what the routes do: autograd-Function forwards (``state_passing._forward``), tiles' saved-dict
    fills (``tiles.segment_fwd``), the keep_y the backend is asked for, and the backend segments open at once."""

    def __init__(self):
        from ds_mamba_spcp.engine.strategies import state_passing
        from ds_mamba_spcp.ops import reference, tiles

        self.modules = (state_passing, tiles, reference)
        self.originals = (state_passing._forward, tiles.segment_fwd, reference.segment_fwd)
        self.reset()

    def reset(self):
        self.function_forwards = self.saved_fills = self.open = self.peak_open = 0
        self.keep_y = set()

    def __enter__(self):
        state_passing, tiles, reference = self.modules
        fwd, tiles_fwd, seg_fwd = self.originals
        probe = self

        def function_forward(*args, **kwargs):
            probe.function_forwards += 1
            return fwd(*args, **kwargs)

        def tiles_segment_fwd(backend, tiles_, saved, *args, **kwargs):
            result = yield from tiles_fwd(backend, tiles_, saved, *args, **kwargs)
            probe.saved_fills += len(saved.get("S_in", []))
            return result

        def segment_fwd(*args, keep_y=False, **kwargs):
            probe.keep_y.add(keep_y)
            probe.open += 1
            probe.peak_open = max(probe.peak_open, probe.open)
            try:
                return (yield from seg_fwd(*args, keep_y=keep_y, **kwargs))
            finally:
                probe.open -= 1

        state_passing._forward, tiles.segment_fwd, reference.segment_fwd = (
            function_forward, tiles_segment_fwd, segment_fwd,
        )  # fmt: skip
        return self

    def __exit__(self, *exc):
        state_passing, tiles, reference = self.modules
        state_passing._forward, tiles.segment_fwd, reference.segment_fwd = self.originals

    def summary(self):
        return dict(function_forwards=self.function_forwards, saved_fills=self.saved_fills,
                    keep_y=sorted(self.keep_y), peak_open=self.peak_open)  # fmt: skip


def compare_routes(t, opts, group, seq_layout, rank, world):
    """The training route under no_grad and the forward-only route on the same shard: bitwise, and the probes."""
    from ds_mamba_spcp import op
    from ds_mamba_spcp.engine import layout

    params = [t[k] for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
    local = layout.shard_sequence(t["zxbcdt"], rank, world, seq_layout)
    common = dict(headdim=HEADDIM, ngroups=NGROUPS, rmsnorm_weight=t["rmsnorm_weight"], process_group=group,
                  backend="reference", return_final_states=True, **opts)  # fmt: skip
    got = {}
    with Probe() as probe, torch.no_grad():
        for name, forward_only in (("training", False), ("forward_only", True)):
            probe.reset()
            got[name] = op.mixer_core(local, *params, CHUNK, forward_only=forward_only, **common)
            got[name + "_probe"] = probe.summary()
    (y0, f0), (y1, f1) = got["training"], got["forward_only"]
    return {"bitwise": torch.equal(y0, y1) and torch.equal(f0, f1), "training": got["training_probe"],
            "forward_only": got["forward_only_probe"]}  # fmt: skip


def _documents(rank, world, name, opts, bug=False):
    import deepspeed.comm as dist

    from ds_mamba_spcp.engine import exchange, layout
    from ds_mamba_spcp.inference import forward

    opts = dict(opts)
    rows = opts.pop("rows", BATCH)
    docs = DOCS[:rows]
    t = _inputs(100 + len(name), DOC_SEQLEN, rows)
    init = torch.randn(rows, NHEADS, HEADDIM, DSTATE, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want_states, want_tails = document_oracle(t, docs, init)
    lay = _layout_of(opts)
    seq_idx = _seq_idx(docs)
    local = layout.shard_sequence(t["zxbcdt"], rank, world, lay)
    labels = {}
    if name.endswith("cu_seqlens"):
        labels["cu_seqlens"] = torch.tensor([0, *torch.tensor(docs[0]).cumsum(0).tolist()])
    else:
        labels["seq_idx"] = layout.shard_sequence(seq_idx, rank, world, lay)
    params = [t[k] for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
    original = exchange.AllGatherExchange._keep
    if bug:  # the state restarts at every rank border
        exchange.AllGatherExchange._keep = lambda self, s: s if self.plan.rank == 0 else torch.zeros_like(s)
    try:
        _, states, tails = forward.mixer_core_prefill(
            local, *params, CHUNK, headdim=HEADDIM, ngroups=NGROUPS, rmsnorm_weight=t["rmsnorm_weight"],
            process_group=dist.get_world_group(), initial_states=init, backend="reference", **labels, **opts,
        )  # fmt: skip
    finally:
        exchange.AllGatherExchange._keep = original
    res = {
        "ndocs": (states.shape[0], tails.shape[0], want_states.shape[0]),
        "states": [rel_err(s, w) for s, w in zip(states, want_states)],
        "tails_exact": agree(tails.shape == want_tails.shape and torch.equal(tails, want_tails)),
        "crossing": crossing_documents(docs, world, lay if opts.get("mode") != "ulysses" else "contiguous"),
    }
    if world == 4 and name == "none" and not bug:
        # negative control for the tails: rank 1's shard alone (a group of one) gives the 2-token document [7, 9)
        # that crosses into it only its column 8, not column 7 too
        d_inner, conv_dim = NHEADS * HEADDIM, t["conv1d_weight"].shape[0]
        own = forward.document_tails(local[..., d_inner : d_inner + conv_dim], labels["seq_idx"], D_CONV, None)
        res["naive_tail_wrong"] = rank != 1 or not torch.equal(own[0], want_tails[1])
    return res


def _run(rank, world):
    import deepspeed.comm as dist

    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.inference import forward
    from ds_mamba_spcp.ops.reference import mamba_split_conv1d_scan_ref

    out = {"docs": {}}
    for name, opts in DOC_CASES.items():
        out["docs"][name] = _documents(rank, world, name, opts)
    out["docs_bug"] = _documents(rank, world, "none", DOC_CASES["none"], bug=True)
    if world != WORLD:
        return out
    for i, (name, opts) in enumerate(CASES.items()):
        t = _inputs(i)
        params = {k: v for k, v in t.items() if k not in ("zxbcdt", "rmsnorm_weight")}
        common = dict(headdim=HEADDIM, ngroups=NGROUPS, rmsnorm_weight=t["rmsnorm_weight"])
        want_y, want_final = mamba_split_conv1d_scan_ref(
            t["zxbcdt"], *params.values(), CHUNK, return_final_states=True, **common
        )
        lay = _layout_of(opts)
        local = layout.shard_sequence(t["zxbcdt"], rank, world, lay).requires_grad_()
        grads = {k: v.clone().requires_grad_() for k, v in params.items()}
        y, final, tail = forward.mixer_core_prefill(
            local, *grads.values(), CHUNK, process_group=dist.get_world_group(), backend="reference", **opts, **common,
        )  # fmt: skip
        want_tail = _expected_tail(t)
        naive = local.detach()[:, -D_CONV:, NHEADS * HEADDIM : -NHEADS].transpose(1, 2)  # this shard's own end
        out[name] = {
            "y": rel_err(y, layout.shard_sequence(want_y, rank, world, lay)),
            "final": rel_err(final, want_final),
            "tail_exact": agree(torch.equal(tail, want_tail)),
            "no_graph": agree(y.grad_fn is None and final.grad_fn is None and not tail.requires_grad),
            "naive_tail_wrong": not torch.equal(naive, want_tail),
            "routes": compare_routes(t, opts, dist.get_world_group(), lay, rank, world),
        }
    return out


@pytest.fixture(scope="module")
def results2():
    return run_ranks(_run, 2, timeout=600)


@pytest.fixture(scope="module")
def results4():
    return run_ranks(_run, 4, timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_only_prefill_matches_the_reference(results2, case):
    for rank, r in enumerate(results2):
        res = r[case]
        assert res["y"] <= TOL and res["final"] <= TOL, (rank, res)
        assert res["tail_exact"] and res["no_graph"], (rank, res)


def test_negative_control_naive_tail(results2):
    """The last rank's own last d_conv columns are not the conv state under zigzag: the sequence ends on rank 0."""
    assert results2[WORLD - 1]["virtual"]["naive_tail_wrong"]


@pytest.mark.parametrize("case", list(CASES))
def test_forward_only_route_is_bitwise_the_training_route_and_skips_its_backward_work(results2, case):
    tiled = "tile_length" in CASES[case]
    for rank, r in enumerate(results2):
        res = r[case]["routes"]
        assert res["bitwise"], (rank, res)
        fo, tr = res["forward_only"], res["training"]
        assert fo["function_forwards"] == 0 and fo["saved_fills"] == 0 and fo["keep_y"] == [False], (rank, fo)
        # positive control: the probes see the training route's Function, its kept y and (tiles) its saved dict
        # (ulysses' training route scans with the single-device op, which the probes do not watch)
        if CASES[case]["mode"] == "state_passing":
            assert tr["function_forwards"] == 1 and tr["keep_y"] == [True], (rank, tr)
            assert tr["saved_fills"] == (1 if tiled else 0), (rank, tr)  # one row group of tiles per call
            if tiled:  # every tile opened before the exchange; the forward-only route's two passes: one at a time
                assert tr["peak_open"] > 1 and fo["peak_open"] == 1, (rank, tr, fo)


def test_group_of_one_tiles_run_one_at_a_time_and_bitwise():
    """A group of one (no deepspeed.comm in this process): in tiles of 4 of 28 tokens, both routes run the tiles in
    known mode (ops/segment.py), one at a time (one tile's intermediates alive), and agree bitwise. (With ranks,
    the training route opens every tile before the exchange: test_forward_only_route_is_bitwise_..., the probe's
    positive control.)"""
    res = compare_routes(_inputs(3), dict(tile_length=4), None, "contiguous", 0, 1)
    assert res["bitwise"], res
    assert res["forward_only"]["peak_open"] == 1 and res["forward_only"]["keep_y"] == [False], res
    assert res["training"]["peak_open"] == 1 and res["training"]["saved_fills"] == 1, res
    assert res["training"]["keep_y"] == [True], res


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(DOC_CASES))
def test_every_documents_state_and_tail(request, world, case):
    results = request.getfixturevalue(f"results{world}")
    for rank, r in enumerate(results):
        res = r["docs"][case]
        assert res["ndocs"][0] == res["ndocs"][1] == res["ndocs"][2], (rank, res["ndocs"])
        assert max(res["states"]) <= TOL, (rank, res["states"])
        assert res["tails_exact"], rank
        if world == 4 or "cu_seqlens" not in case:  # (row 0 alone crosses no border at 2 ranks)
            assert res["crossing"], "the case must have documents that cross a segment border"


@pytest.mark.parametrize("world", [2, 4])
def test_negative_control_state_restarting_at_borders(request, world):
    """S_in zeroed at every rank border: the documents that cross a border are wrong, the others still right."""
    res = request.getfixturevalue(f"results{world}")[0]["docs_bug"]
    crossing = set(res["crossing"])
    assert min(res["states"][d] for d in crossing) > 1e-3, res["states"]
    assert max(e for d, e in enumerate(res["states"]) if d not in crossing) <= TOL, res["states"]


def test_negative_control_shard_alone_misses_the_crossing_tail(results4):
    assert all(r["docs"]["none"]["naive_tail_wrong"] for r in results4)


def test_forward_only_refuses_inputs_that_want_a_gradient():
    from ds_mamba_spcp import op

    t = _inputs(0)
    params = [t[k].requires_grad_() for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
    with pytest.raises(ValueError, match="forward_only=True builds no autograd graph"):
        op.mixer_core(t["zxbcdt"], *params, CHUNK, headdim=HEADDIM, ngroups=NGROUPS, forward_only=True)


def test_chunked_prefill_ignores_the_callers_autocast():
    """One rule for the forward-only paths: the core computes as its inputs' dtypes say, autocast or not (op.run
    turns autocast off around the strategy, so ``mixer_core_prefill`` does). The chunked prefill's tiles
    (``tile_forward``: the backend's segment, outside op.run) follow it: fp32 inputs under CPU bf16 autocast give
    bitwise what they give without it (the same computation), tile after tile with the state and conv tail carried;
    ``mixer_core_prefill`` on the whole row is checked the same way. Without the rule the tiles' matmuls ran in bf16
    (relative RMS ~6e-3 on the reference backend)."""
    from ds_mamba_spcp.engine.call import MixerCore
    from ds_mamba_spcp.inference.forward import mixer_core_prefill, tile_forward

    t = {k: v.float() for k, v in _inputs(5).items()}
    core = MixerCore(t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], CHUNK, headdim=HEADDIM,
                     ngroups=NGROUPS, rmsnorm_weight=t["rmsnorm_weight"])  # fmt: skip

    def tiles():
        outs, carry = [], None
        for start in range(0, SEQLEN, 7):
            out, carry = tile_forward(t["zxbcdt"][:, start : start + 7], carry, core, backend="reference")
            outs.append(out)
        return torch.cat(outs, 1), *carry

    def whole():
        args, kwargs = core.op_arguments()
        return mixer_core_prefill(t["zxbcdt"], *args, backend="reference", **kwargs)

    for run in (tiles, whole):
        plain = run()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = run()
        errs = [rel_err(a, b) for a, b in zip(cast, plain)]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(cast, plain)), (run.__name__, errs)
