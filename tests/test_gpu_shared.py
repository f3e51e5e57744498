"""The Triton backend at cp = 2, 4 (and 8 for the scan) with every rank on one GPU through gloo (marker ``gpu``).

docs/design.md, "Traps": gloo moves CUDA tensors for collectives, so the sharded op's Triton path runs at
cp > 1 on a single GPU for correctness (point-to-point does not work that way, so ``permute_p2p`` is
left to the NCCL suite, ``tests/test_gpu.py``). Timings from these runs mean nothing.

    python -m pytest -m gpu -q -s tests/test_gpu_shared.py

Checked, bf16, on a shape with several chunks per segment (nheads=8, headdim=64, ngroups=2, dstate=64,
d_conv=4, chunk_size=64), batch 2, global L = 4096, every rank's tokens in the mode's layout:
1. Packed rows (issue 11): documents starting inside segments, exactly on segment borders, within the
   conv's reach of a border, documents shorter than the conv, one spanning several ranks, labels not
   starting at 0, with initial and final states; modes none, virtual, permute_a2a and ulysses, and none and
   virtual with the log-depth summary exchange (``summary_exchange="scan"``, also at cp 8). Each
   against mamba-ssm's single-GPU op on the whole row with the same documents, and both against the
   fp32 reference backend (same documents): the sharded op must stay within 2x upstream's own
   distance from fp32, plus 1e-4 (the NCCL suite's bound: the two bf16 computations round at
   different places where segments do not align with chunks, so neither is closer to fp32 by
   construction; 2x keeps the check meaningful, a lost reset or a leaked state is O(1)).
2. Autocast (issue 16): the op under ``torch.autocast("cuda", torch.bfloat16)`` equals the same call
   without autocast (the op computes as its inputs' dtypes say): bitwise for the output, the final
   states and every gradient the kernels compute deterministically; for causal-conv1d's conv weight and
   bias gradients, whose backward is not run-to-run deterministic, within the spread of the plain call
   run twice in the same process (``SPREAD_FACTOR``; docs/benchmarks.md, reproducibility).
3. Double backward raises (gradients with create_graph=True through the sharded op and through
   mamba-ssm's op at a group of one), instead of silently dropping second-order terms.
4. Waiting for an all-gather from another CUDA stream than the one that posted it raises.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import agree, run_ranks
from tests.gpu_cases import PARAMS, make_inputs, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(nheads=8, headdim=64, ngroups=2, dstate=64, d_conv=4, chunk=64)
SEQLEN, BATCH = 4096, 2
MODES = {
    "none": dict(load_balancing="none"),
    "virtual": dict(load_balancing="virtual"),
    "permute_a2a": dict(load_balancing="permute_a2a"),
    "ulysses": dict(mode="ulysses"),
    # the log-depth summary exchange (engine/exchange.py): gloo moves its point-to-point messages through the host
    "none_scan": dict(load_balancing="none", summary_exchange="scan"),
    "virtual_scan": dict(load_balancing="virtual", summary_exchange="scan"),
}
SCAN_MODES = ("none_scan", "virtual_scan")
TIMEOUT = float(os.environ.get("DS_MAMBA_SPCP_GPU_TIMEOUT", 900))


def labels_for(world: int, device) -> torch.Tensor:
    """(BATCH, SEQLEN) labels: row 0 with starts on every segment border (of 2*world zigzag chunks,
    so also every contiguous shard border), one and two tokens after them, 1-token documents, random
    starts; row 1 with a document spanning most of the row and labels starting at 3, growing by 2."""
    seg = SEQLEN // (2 * world)
    g = torch.Generator().manual_seed(world)
    starts0 = {s * seg + off for s in range(1, 2 * world) for off in (0, 1 + s % 2)} | {7, 8, SEQLEN - 1}
    starts0 |= set(torch.randint(1, SEQLEN, (24,), generator=g).tolist())
    starts1 = {5, 70, SEQLEN - 300}
    rows = []
    for starts, base, step in ((starts0, 0, 1), (starts1, 3, 2)):
        bounds = torch.tensor(sorted(starts))
        rows.append(base + step * torch.bucketize(torch.arange(SEQLEN), bounds, right=True))
    return torch.stack(rows).to(torch.int32).to(device)


def _grads_of(out, final, inputs, gout, gfinal, weight):
    loss = (out.float() * gout.float()).sum() + weight * (final * gfinal).sum()
    loss.backward()
    return {k: v.grad for k, v in inputs.items() if v.grad is not None}


def _run(rank, world, modes=tuple(MODES), extras=True):
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.op import mixer_core
    from ds_mamba_spcp.ops.reference import mamba_split_conv1d_scan_ref
    from ds_mamba_spcp.ops.triton import single_device_op

    dev = torch.device("cuda", 0)
    t, grads = make_inputs(SHAPE, BATCH, SEQLEN, seed=7, device=dev, rms=True, init=True, final=True)
    labels = labels_for(world, dev)
    kw = dict(headdim=SHAPE["headdim"], ngroups=SHAPE["ngroups"], return_final_states=True)

    def full(fn, inputs, **extra):
        args = [inputs[k] for k in ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
        return fn(*args, SHAPE["chunk"], rmsnorm_weight=inputs["rmsnorm_weight"],
                  initial_states=inputs["initial_states"], **kw, **extra)  # fmt: skip

    def leaves(dtype=None):
        return {k: (v if dtype is None else v.to(dtype)).detach().clone().requires_grad_() for k, v in t.items()}

    # upstream on the whole row (labels renumbered from 0, which its kernels need), and fp32 reference
    from ds_mamba_spcp.ops.segment import canonical_seq_idx

    up_in = leaves()
    up_out, up_final = full(single_device_op, up_in, seq_idx=canonical_seq_idx(labels))
    up_grads = _grads_of(up_out, up_final, up_in, grads["out"], grads["final"], 1.0)
    ref_in = leaves(torch.float32)
    ref_out, ref_final = full(mamba_split_conv1d_scan_ref, ref_in, seq_idx=labels)
    ref_grads = _grads_of(ref_out, ref_final, ref_in, grads["out"], grads["final"], 1.0)

    results = {}
    for name in modes:
        mode_kw = MODES[name]
        seq_layout = "contiguous" if mode_kw.get("load_balancing", "none") == "none" else "zigzag"
        shard = lambda x, seq_layout=seq_layout: layout.shard_sequence(x, rank, world, seq_layout)  # noqa: E731
        sp_in = leaves()
        sp_in["zxbcdt"] = shard(t["zxbcdt"]).detach().clone().requires_grad_()
        args = [sp_in[k] for k in ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
        out, final = mixer_core(
            *args, SHAPE["chunk"], rmsnorm_weight=sp_in["rmsnorm_weight"], initial_states=sp_in["initial_states"],
            seq_idx=shard(labels), backend="triton", input_layout=seq_layout, **kw, **mode_kw,
        )  # fmt: skip
        sp_grads = _grads_of(out, final, sp_in, shard(grads["out"]), grads["final"], 1.0 / world)
        # every rank's output shard and gradient contributions, gathered for the global comparison
        import deepspeed.comm as dist

        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out.detach().contiguous())
        dzs = [torch.empty_like(sp_grads["zxbcdt"]) for _ in range(world)]
        dist.all_gather(dzs, sp_grads["zxbcdt"].contiguous())
        got = {"out": layout.unshard_sequence(outs, seq_layout), "final_states": final.detach(),
               "dzxbcdt": layout.unshard_sequence(dzs, seq_layout)}  # fmt: skip
        for k in PARAMS + ("initial_states",):
            g = sp_grads[k].float().contiguous()
            dist.all_reduce(g)
            got["d" + k] = g
        up = {"out": up_out, "final_states": up_final, "dzxbcdt": up_grads["zxbcdt"],
              **{"d" + k: up_grads[k] for k in PARAMS + ("initial_states",)}}  # fmt: skip
        ref = {"out": ref_out, "final_states": ref_final, "dzxbcdt": ref_grads["zxbcdt"],
               **{"d" + k: ref_grads[k] for k in PARAMS + ("initial_states",)}}  # fmt: skip
        rows = {k: dict(sp_up=rel(got[k].float(), up[k].float()), sp_fp32=rel(got[k].float(), ref[k]),
                        up_fp32=rel(up[k].float(), ref[k])) for k in got}  # fmt: skip
        ok = all(r["sp_fp32"] <= 2 * r["up_fp32"] + 1e-4 for r in rows.values())
        results[name] = dict(rows=rows, ok=agree(ok))

    if extras:
        results["autocast"] = _autocast_case(rank, world, t, grads, dev)
        results["stream_check"] = _stream_case(world, dev)
        results["double_backward"] = _double_backward_case(rank, world, t, dev)
    return results


# causal-conv1d's backward accumulates the conv weight and bias gradients across thread blocks in an
# order that changes from run to run (plain vs plain differed there on rank 1 at cp=2 and on three of
# four ranks at cp=4, one H200); every other output of the op is bitwise reproducible.
CONV_NONDETERMINISTIC = ("dconv1d_weight", "dconv1d_bias")
# Bound for those two, relative RMS: autocast vs plain within SPREAD_FACTOR x the plain-vs-plain distance
# measured in the same process, plus a floor of FLIPS elements one rounding step of the gradient's dtype
# apart. The two distances are draws of the same reordering noise when autocast changes nothing: fp32 sums in
# another order, which after rounding to the gradient's dtype (bf16 here) flip a few elements by one ulp and
# leave the rest equal; a draw can be several times another (factor 4), and a plain pair can happen to round
# alike (seen at cp=4 on one H200: plain vs plain bitwise, autocast vs plain 7.5e-5 = one element of 3072 one
# bf16 ulp off), which the floor covers: sqrt(FLIPS / numel) x eps(dtype), ~2.8e-4 for these 3072 bf16
# weights. A bf16 computation where the plain call runs fp32 (what autocast would do to an op that did not
# control its dtypes) moves nearly every element, ~1e-3 and more: above the bound.
SPREAD_FACTOR, FLIPS = 4.0, 4


def _ulp_floor(t: torch.Tensor) -> float:
    return (FLIPS / t.numel()) ** 0.5 * torch.finfo(t.dtype).eps


def _autocast_case(rank, world, t, grads, dev):
    """The op under autocast vs the plain call: bitwise where the kernels are deterministic, within the
    measured run-to-run spread for causal-conv1d's weight and bias gradients. One warm-up call first (Triton
    autotuning), then plain, autocast, plain, so both distances are taken between tuned runs."""
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import layout

    def run(autocast: bool):
        inputs = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
        inputs["zxbcdt"] = layout.shard_sequence(t["zxbcdt"], rank, world, "contiguous").clone().requires_grad_()
        args = [inputs[k] for k in ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D")]
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            out, final = mamba_split_conv1d_scan_sp(
                *args, SHAPE["chunk"], headdim=SHAPE["headdim"], ngroups=SHAPE["ngroups"],
                rmsnorm_weight=inputs["rmsnorm_weight"], initial_states=inputs["initial_states"],
                return_final_states=True, backend="triton",
            )  # fmt: skip
            loss = (out.float() * layout.shard_sequence(grads["out"], rank, world, "contiguous").float()).sum()
            loss = loss + (final * grads["final"]).sum()
        loss.backward()
        return {"out": out.detach(), "final_states": final.detach(), **{"d" + k: v.grad for k, v in inputs.items()}}

    run(False)  # warm-up: autotuning
    plain, under, plain2 = run(False), run(True), run(False)
    rows = {}
    for k in plain:
        rows[k] = dict(
            spread=rel(plain2[k].float(), plain[k].float()), floor=_ulp_floor(plain[k]),
            autocast=rel(under[k].float(), plain[k].float()),
            bitwise_spread=torch.equal(plain[k], plain2[k]), bitwise_autocast=torch.equal(plain[k], under[k]),
        )  # fmt: skip
    ok = all(
        r["autocast"] <= SPREAD_FACTOR * r["spread"] + r["floor"]
        if k in CONV_NONDETERMINISTIC
        else r["bitwise_spread"] and r["bitwise_autocast"]
        for k, r in rows.items()
    )
    return dict(rows=rows, ok=agree(ok))


def _stream_case(world, dev):
    """A gather posted on one stream and waited on from another raises (its buffer's readers would be unordered)."""
    from ds_mamba_spcp import comm

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        handle = comm.all_gather(torch.ones(4, device=dev), None, world, async_op=True)
    try:
        handle.wait()  # on the default stream
        wrong = False
    except RuntimeError as e:
        wrong = "another" in str(e)
    with torch.cuda.stream(side):
        right = bool(handle.wait().sum().item() == 4 * world)
    return agree(wrong and right)


def _double_backward_case(rank, world, t, dev):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.ops.triton import single_device_op

    def attempt(fn, zx):
        w = t["conv1d_weight"].detach().clone().requires_grad_()
        zx = zx.detach().clone().requires_grad_()
        out = fn(zx, w, t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], SHAPE["chunk"], headdim=SHAPE["headdim"],
                 ngroups=SHAPE["ngroups"])  # fmt: skip
        try:
            torch.autograd.grad(out.float().square().sum(), [w], create_graph=True)
        except RuntimeError as e:
            return "second-order" in str(e)
        return False

    shard = layout.shard_sequence(t["zxbcdt"], rank, world, "contiguous")
    sharded = attempt(lambda *a, **k: mamba_split_conv1d_scan_sp(*a, **k, backend="triton"), shard)
    single = attempt(single_device_op, t["zxbcdt"][:, :512])
    return agree(sharded and single)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"cp{w}")
def results(request):
    world = request.param
    return world, run_ranks(_run, world, timeout=TIMEOUT, backend="gloo-cuda")


def _check_against_upstream(world, res, mode):
    """Every tensor of ``mode`` within 2x mamba-ssm's own distance from fp32 (+1e-4), every rank agreeing."""
    rows = res[0][mode]["rows"]
    print(f"\ncp={world} {mode}: " + ", ".join(f"{k} {v['sp_up']:.2e}/{v['sp_fp32']:.2e}/{v['up_fp32']:.2e}"
                                               for k, v in rows.items()))  # fmt: skip
    bad = {k: v for k, v in rows.items() if not v["sp_fp32"] <= 2 * v["up_fp32"] + 1e-4}
    assert not bad, f"cp={world} {mode}: sp farther from fp32 than 2x upstream: {bad}"
    assert all(r[mode]["ok"] for r in res)


@pytest.mark.parametrize("mode", list(MODES))
def test_packed_rows_match_upstream(results, mode):
    _check_against_upstream(*results, mode)


@pytest.mark.parametrize("mode", SCAN_MODES)
def test_scan_at_eight_ranks_matches_upstream(scan8, mode):
    """The scan at cp 8 (3 rounds; 16 segments, 4 rounds, under virtual), the same bound as every mode."""
    _check_against_upstream(8, scan8, mode)


@pytest.fixture(scope="module")
def scan8():
    return run_ranks(_run, 8, SCAN_MODES, False, timeout=TIMEOUT, backend="gloo-cuda")


def test_autocast_changes_nothing(results):
    world, res = results
    for rank, r in enumerate(res):
        rows = r["autocast"]["rows"]
        print(f"\ncp={world} rank {rank} autocast vs plain (plain vs plain): " + ", ".join(
            f"{k} {v['autocast']:.1e} ({v['spread']:.1e})" for k, v in rows.items()))  # fmt: skip
        nondeterministic = sorted(k for k, v in rows.items() if not v["bitwise_spread"])
        unexpected = [k for k in nondeterministic if k not in CONV_NONDETERMINISTIC]
        assert not unexpected, f"cp={world} rank {rank}: {unexpected} differ from run to run (docs/benchmarks.md)"
        changed = {
            k: v for k, v in rows.items()
            if (not v["bitwise_autocast"] if k not in CONV_NONDETERMINISTIC
                else v["autocast"] > SPREAD_FACTOR * v["spread"] + v["floor"])
        }  # fmt: skip
        assert not changed, f"cp={world} rank {rank}: the op under autocast differs from the plain call: {changed}"
    assert all(r["autocast"]["ok"] for r in res)


def test_wait_on_another_stream_raises(results):
    world, res = results
    assert all(r["stream_check"] for r in res)


def test_double_backward_raises(results):
    world, res = results
    assert all(r["double_backward"] for r in res)
