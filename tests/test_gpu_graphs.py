"""The op's CUDA-graph mode (``cuda_graphs=True``, ``engine/graphs.py``) on one GPU: replays equal eager calls.

    MAMBA_DETERMINISTIC=1 python -m pytest -m gpu -q tests/test_gpu_graphs.py

A replay runs the kernels the eager call runs, in the same order, on the same values, so with mamba-ssm's
deterministic mode (no atomics whose order varies) its output, final states and every gradient but two are
bitwise equal to the eager call's: those comparisons are exact (torch.equal). The two are the conv weight and
bias gradients: causal-conv1d's backward sums them with fp32 atomics across thread blocks, in an order that
changes from call to call, eager or replayed (seen on the H200: one replay's dconv1d_weight differed, the
next run of the same test passed); they are compared within one bf16 rounding step (CONV_NONDETERMINISTIC).
Each case calls the graph mode three times with inputs from two seeds (A captures; B and A again replay),
so that a replay that read stale inputs or left stale outputs would fail; one case keeps two calls of one
shape live at once (two instances). Negative control: a replay that skips the copy of the new inputs into
the static ones must differ from the eager result of those inputs, the conv gradients' bound included.
Shapes: gpu_cases.SMALL (6 heads of 24, 2 groups, dstate 40, chunk 64), bf16, batch 1.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu_cases import PARAMS, SMALL, make_inputs, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = {
    # a group of one in 4 tiles of 8K (the state-passing chain of tiles), plain gate, initial/final states
    "tiles_32k_gate": dict(seqlen=32768, tile_length=8192, rms=False),
    # 3 tiles, the gated RMSNorm, a packed row (documents across tile borders)
    "tiles_24k_rms_packed": dict(seqlen=24576, tile_length=8192, rms=True, docs=7),
    # no tiles: mamba-ssm's own op, replayed
    "whole_8k_gate": dict(seqlen=8192, tile_length=None, rms=False),
}


def _labels(seqlen, docs, device):
    g = torch.Generator().manual_seed(5)
    starts = torch.randperm(seqlen - 1, generator=g)[: docs - 1].add(1).sort().values
    starts[0] = 8192  # one document starts exactly on a tile border
    return torch.bucketize(torch.arange(seqlen), starts.sort().values, right=True)[None].int().to(device)


def _call(t, grads, case, seq_idx, **kw):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp

    inputs = {k: None if v is None else v.detach().clone().requires_grad_() for k, v in t.items()}
    args = [inputs[k] for k in ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
    out, final = mamba_split_conv1d_scan_sp(
        *args, SMALL["chunk"], headdim=SMALL["headdim"], ngroups=SMALL["ngroups"], backend="triton",
        rmsnorm_weight=inputs.get("rmsnorm_weight"), initial_states=inputs["initial_states"], return_final_states=True,
        seq_idx=seq_idx, tile_length=case["tile_length"], **kw,
    )  # fmt: skip
    return inputs, out, final


def _grads_of(inputs, out, final, grads):
    torch.autograd.backward([out, final], [grads["out"], grads["final"]])
    got = {"out": out.detach(), "final_states": final.detach(), "dzxbcdt": inputs["zxbcdt"].grad}
    got.update({"d" + k: inputs[k].grad for k in PARAMS + ("initial_states",) if inputs.get(k) is not None})
    return got


def _run(t, grads, case, seq_idx, **kw):
    return _grads_of(*_call(t, grads, case, seq_idx, **kw), grads)


# The same fp32 terms summed in another order, then rounded to the gradient's dtype (bf16): an element lands on
# the same value or on a neighbour one rounding step away (a relative step of at most eps), so the relative RMS
# of the whole tensor is at most eps even if every element moved. A replay on the wrong inputs moves them by
# O(1) (test_negative_control_stale_inputs_differ checks that this bound catches it).
CONV_NONDETERMINISTIC = ("dconv1d_weight", "dconv1d_bias")


def _differs(key, got, want):
    if key in CONV_NONDETERMINISTIC:
        return rel(got, want) > torch.finfo(want.dtype).eps
    return not torch.equal(got, want)


def _differences(got, want):
    return [k for k in want if _differs(k, got[k], want[k])]


def _needs_determinism():
    if os.environ.get("MAMBA_DETERMINISTIC") != "1":
        pytest.skip("bitwise comparisons need MAMBA_DETERMINISTIC=1 (mamba-ssm's backward uses atomics otherwise)")


def _inputs(case, seed, dev):
    return make_inputs(SMALL, 1, case["seqlen"], seed=seed, device=dev, rms=case["rms"], init=True, final=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_replay_is_bitwise_equal_to_eager(name):
    _needs_determinism()
    from ds_mamba_spcp.engine import graphs

    case, dev = CASES[name], torch.device("cuda", 0)
    seq_idx = _labels(case["seqlen"], case["docs"], dev) if case.get("docs") else None
    (tA, gA), (tB, gB) = _inputs(case, 1, dev), _inputs(case, 2, dev)
    want = {"A": _run(tA, gA, case, seq_idx), "B": _run(tB, gB, case, seq_idx)}
    graphs.clear()
    diffs = {}
    for i, (tag, t, g) in enumerate((("A", tA, gA), ("B", tB, gB), ("A", tA, gA))):
        got = _run(t, g, case, seq_idx, cuda_graphs=True)
        diffs[f"call {i} ({tag})"] = _differences(got, want[tag])
    assert graphs.captured_instances() == 1, "a call whose backward has run frees its instance for the next"
    # two live calls of one shape: each takes an instance, both replay right
    first = _call(tA, gA, case, seq_idx, cuda_graphs=True)
    second = _call(tB, gB, case, seq_idx, cuda_graphs=True)
    diffs["live B"] = _differences(_grads_of(*second, gB), want["B"])
    diffs["live A"] = _differences(_grads_of(*first, gA), want["A"])
    assert graphs.captured_instances() == 2
    graphs.clear()
    assert all(not d for d in diffs.values()), diffs


def test_negative_control_stale_inputs_differ(monkeypatch):
    """A replay that does not copy the new inputs in returns the captured call's results: the exact comparison
    of the test above must catch that."""
    _needs_determinism()
    from ds_mamba_spcp.engine import graphs

    case, dev = CASES["tiles_32k_gate"], torch.device("cuda", 0)
    (tA, gA), (tB, gB) = _inputs(case, 1, dev), _inputs(case, 2, dev)
    want_B = _run(tB, gB, case, None)
    graphs.clear()
    _run(tA, gA, case, None, cuda_graphs=True)  # captures with A
    forward = graphs._Replay.forward

    def stale(ctx, inst, generation, *tensors):
        return forward(ctx, inst, generation, *inst.inputs)  # the static inputs copied onto themselves: A's values

    monkeypatch.setattr(graphs._Replay, "forward", staticmethod(stale))
    got = _run(tB, gB, case, None, cuda_graphs=True)
    graphs.clear()
    assert set(_differences(got, want_B)) >= {"out", "final_states", "dzxbcdt", *CONV_NONDETERMINISTIC}


def test_second_backward_raises():
    from ds_mamba_spcp.engine import graphs

    case, dev = CASES["whole_8k_gate"], torch.device("cuda", 0)
    t, g = _inputs(case, 1, dev)
    graphs.clear()
    _run(t, g, case, None, cuda_graphs=True)
    inputs, out, final = _call(t, g, case, None, cuda_graphs=True)
    torch.autograd.backward([out, final], [g["out"], g["final"]], retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        torch.autograd.backward([out, final], [g["out"], g["final"]])
    graphs.clear()
