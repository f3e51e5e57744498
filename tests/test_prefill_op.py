"""The op's forward-only prefill path (ds_mamba_spcp.inference.forward.mixer_core_prefill) at 2 gloo ranks, fp64,
against the single-device reference op on the whole sequence (``mamba_split_conv1d_scan_ref`` with
``return_final_states``) in every mode and layout, with tiles and with packed rows.

Per case: this rank's output shard and the final state within 1e-10 relative RMS (fp64: the sharded op
reassociates the same sums, ~1e-15; ``tests/test_state_passing.py`` argues the bound), the conv state equal
to the whole sequence's last d_conv pre-conv columns bitwise (a copy, no arithmetic), zeroed before the last
document's start in packed rows; nothing requires grad although every input does (no graph recorded). The
negative control: the last rank's own last columns are not the conv state under zigzag (the sequence ends
on rank 0) nor in a packed row whose last document is shorter than d_conv.
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
    # packed rows: the last document (2 tokens, < d_conv) starts on rank 1 (contiguous) / rank 0 (zigzag)
    "none_packed": dict(mode="state_passing", load_balancing="none", docs=[[5, 9, 12, 2], [28]]),
    "virtual_packed": dict(mode="state_passing", load_balancing="virtual", docs=[[5, 9, 12, 2], [20, 8]]),
}


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    d_inner, conv_dim = NHEADS * HEADDIM, NHEADS * HEADDIM + 2 * NGROUPS * DSTATE

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    return dict(
        zxbcdt=rnd(BATCH, SEQLEN, d_inner + conv_dim + NHEADS), conv1d_weight=rnd(conv_dim, D_CONV, scale=0.5),
        conv1d_bias=rnd(conv_dim, scale=0.5), dt_bias=rnd(NHEADS, scale=0.5),
        A=-torch.rand(NHEADS, generator=g, dtype=torch.float64).add(0.5), D=rnd(NHEADS),
        rmsnorm_weight=rnd(d_inner, scale=0.3).add(1.0),
    )  # fmt: skip


def _seq_idx(docs):
    return torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in docs]).int()


def _expected_tail(t, seq_idx):
    d_inner, conv_dim = NHEADS * HEADDIM, t["conv1d_weight"].shape[0]
    cols = t["zxbcdt"][:, -D_CONV:, d_inner : d_inner + conv_dim].clone()
    if seq_idx is not None:
        cols[seq_idx[:, -D_CONV:] != seq_idx[:, -1:]] = 0
    return cols.transpose(1, 2)


def _run(rank, world):
    import deepspeed.comm as dist

    from ds_mamba_spcp import layout
    from ds_mamba_spcp.inference import forward
    from ds_mamba_spcp.ops.reference import mamba_split_conv1d_scan_ref

    out = {}
    for i, (name, opts) in enumerate(CASES.items()):
        opts = dict(opts)
        t = _inputs(i)
        seq_idx = _seq_idx(opts.pop("docs")) if "docs" in opts else None
        params = {k: v for k, v in t.items() if k not in ("zxbcdt", "rmsnorm_weight")}
        common = dict(headdim=HEADDIM, ngroups=NGROUPS, rmsnorm_weight=t["rmsnorm_weight"])
        want_y, want_final = mamba_split_conv1d_scan_ref(
            t["zxbcdt"], *params.values(), CHUNK, return_final_states=True, seq_idx=seq_idx, **common
        )
        lay = opts.get("input_layout") or ("zigzag" if opts.get("load_balancing", "none") != "none" else "contiguous")
        local = layout.shard_sequence(t["zxbcdt"], rank, world, lay).requires_grad_()
        grads = {k: v.clone().requires_grad_() for k, v in params.items()}
        local_idx = None if seq_idx is None else layout.shard_sequence(seq_idx, rank, world, lay)
        y, final, tail = forward.mixer_core_prefill(
            local, *grads.values(), CHUNK, process_group=dist.get_world_group(), seq_idx=local_idx, backend="reference",
            **opts, **common,
        )  # fmt: skip
        want_tail = _expected_tail(t, seq_idx)
        naive = local.detach()[:, -D_CONV:, NHEADS * HEADDIM : -NHEADS].transpose(1, 2)  # this shard's own end
        out[name] = {
            "y": rel_err(y, layout.shard_sequence(want_y, rank, world, lay)),
            "final": rel_err(final, want_final),
            "tail_exact": agree(torch.equal(tail, want_tail)),
            "no_graph": agree(y.grad_fn is None and final.grad_fn is None and not tail.requires_grad),
            "naive_tail_wrong": not torch.equal(naive, want_tail),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, WORLD, timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_only_prefill_matches_the_reference(results, case):
    for rank, r in enumerate(results):
        res = r[case]
        assert res["y"] <= TOL and res["final"] <= TOL, (rank, res)
        assert res["tail_exact"] and res["no_graph"], (rank, res)


@pytest.mark.parametrize("case", ["virtual", "none_packed"])
def test_negative_control_naive_tail(results, case):
    """The last rank's own last d_conv columns are not the conv state: under zigzag the sequence ends on rank 0;
    in the packed row the last document (2 tokens) starts after the conv's reach begins."""
    assert results[WORLD - 1][case]["naive_tail_wrong"]
