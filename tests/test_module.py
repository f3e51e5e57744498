"""DistributedMamba2 and wrap_mamba2_mixers: equivalence with the single-process module, the group
of one, checkpoints, group resolution and rejections.

Ground truth. mamba-ssm's ``Mamba2.forward`` cannot run on CPU, so the single-process module is
written out here from its memory-efficient path: ``in_proj`` -> ``mamba_split_conv1d_scan_ref``
(the plain-PyTorch twin of ``mamba_split_conv1d_scan_combined``) -> ``out_proj``, with the module's
own parameters, on the full sequence (``ground_truth``).

Multi-rank cases run on 2 and 4 gloo ranks, each world size spawned once (``CASES`` and the
group/rejection checks run inside). Every rank builds the same mixer and global inputs from one
seed. Errors of sharded tensors (output, input gradient) reduce squared norms over the ranks;
parameter gradients are each rank's local contribution, summed over the sequence-parallel group
(what DeepSpeed's gradient reduction does) before they are compared.

Tolerances. fp64: the sharded module computes the same sums as the full one, only chunked at other
boundaries, reassociated across ranks (state summaries, parameter gradients summed over ranks),
so the rounding is ~1e-15 relative; 1e-10 leaves five orders of magnitude and still catches any
slip (a wrong segment order or a lost state is >= 1e-3 relative at these sizes: see the negative
control). fp32: the same argument at fp32's 6e-8 unit roundoff grown over the few hundred terms of
these reductions: relative RMS 1e-5. The worst fp32 entry seen is dD at 6e-6 (a (nheads,) sum over
batch*seqlen*headdim terms that nearly cancel for one head; the fp32 single-process module is itself
3e-6 away from the fp64 truth there); everything else is <= 1.3e-6.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from einops import rearrange

from tests.conftest import MIXER_BATCH as BATCH
from tests.conftest import MIXER_D_MODEL as D_MODEL
from tests.conftest import MIXER_PER_RANK as PER_RANK
from tests.conftest import ground_truth, make_mixer
from tests.dist_utils import agree, rel_err, run_ranks

FP64_TOL = 1e-10
FP32_TOL = 1e-5

MODES = {
    "sp_none": dict(mode="state_passing", load_balancing="none", input_layout="contiguous"),
    "sp_virtual": dict(mode="state_passing", load_balancing="virtual", input_layout="zigzag"),
    "sp_permute_p2p": dict(mode="state_passing", load_balancing="permute_p2p", input_layout="zigzag"),
    "sp_permute_a2a": dict(mode="state_passing", load_balancing="permute_a2a", input_layout="zigzag"),
    "ulysses_contiguous": dict(mode="ulysses", input_layout="contiguous"),
    "ulysses_zigzag": dict(mode="ulysses", input_layout="zigzag"),
}


def _cases():
    cases = {}
    for mode in MODES:
        cases[f"{mode}_fp64_rms_Dh_g2_bias_dtlim"] = dict(mode=mode, dtype="float64", mixer="rms_Dh_g2_bias_dtlim")
        cases[f"{mode}_fp32_rmsbefore_g4"] = dict(mode=mode, dtype="float32", mixer="rmsbefore_g4")
    for mode in ("sp_none", "sp_virtual", "ulysses_contiguous"):
        cases[f"{mode}_fp64_gate_g1"] = dict(mode=mode, dtype="float64", mixer="gate_g1")
    # two sequence-parallel groups of 2 ranks in a world of 4, each with its own sequence
    for mode in ("sp_virtual", "sp_permute_p2p", "ulysses_zigzag"):
        cases[f"{mode}_fp64_pairs"] = dict(mode=mode, dtype="float64", mixer="rms_Dh_g2_bias_dtlim", pairs=True)
    # negative control: zigzag config fed contiguous shards (a plausible wiring bug) must fail the check
    cases["bug_virtual_fed_contiguous"] = dict(
        mode="sp_virtual", dtype="float64", mixer="rms_Dh_g2_bias_dtlim", data_layout="contiguous"
    )
    return cases


CASES = _cases()


# ---------------------------------------------------------------------------------------------
# shared helpers (run in the test process and in the ranks)
# ---------------------------------------------------------------------------------------------


def section(**fields):
    return {"train_micro_batch_size_per_gpu": 1, "mamba_sequence_parallel": {"enabled": True, **fields}}


def global_inputs(dtype, seqlen, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(BATCH, seqlen, D_MODEL, generator=g, dtype=torch.float64).to(dtype)
    gout = torch.randn(BATCH, seqlen, D_MODEL, generator=g, dtype=torch.float64).to(dtype)
    return u, gout


def fwd_bwd(fn, m, u, gout, **kw):
    u = u.detach().clone().requires_grad_()
    out = fn(u, **kw)
    params = [p for _, p in m.named_parameters()]
    grads = torch.autograd.grad(out, [u, *params], gout)
    return out.detach(), dict(zip(["u", *[n for n, _ in m.named_parameters()]], grads))


# ---------------------------------------------------------------------------------------------
# multi-rank cases
# ---------------------------------------------------------------------------------------------


def _equivalence(rank, world, opts, seed):
    import deepspeed.comm as dist

    from ds_mamba_spcp import DistributedMamba2
    from ds_mamba_spcp.engine import layout

    if opts.get("pairs"):
        if world % 2:
            return {"skipped": "needs an even world"}
        groups = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
        group, sp, sp_rank, seq_id = groups[rank // 2], 2, rank % 2, rank // 2
    else:
        group, sp, sp_rank, seq_id = None, world, rank, 0  # None: resolved to the world group
    mode = MODES[opts["mode"]]
    dtype = getattr(torch, opts["dtype"])
    m = make_mixer(opts["mixer"], dtype, seed)
    u, gout = global_inputs(dtype, PER_RANK * sp, seed + 100 + seq_id)
    ref_out, ref_grads = fwd_bwd(lambda x: ground_truth(m, x), m, u, gout)

    wrapper = DistributedMamba2(m, group, section(**mode, sequence_parallel_size=sp, backend="reference"))
    data_layout = opts.get("data_layout", mode["input_layout"])
    shard = lambda x: layout.shard_sequence(x, sp_rank, sp, data_layout)  # noqa: E731
    out, grads = fwd_bwd(wrapper, m, shard(u), shard(gout))

    def sharded_err(local, ref_local):
        sq = torch.tensor([(local.double() - ref_local.double()).square().sum().item(),
                           ref_local.double().square().sum().item()], dtype=torch.float64)  # fmt: skip
        if not torch.isfinite(local).all():
            sq[0] = float("inf")
        dist.all_reduce(sq)
        return (sq[0] / sq[1]).sqrt().item()

    errs = {"out": sharded_err(out, shard(ref_out)), "du": sharded_err(grads["u"], shard(ref_grads["u"]))}
    for name, g in grads.items():
        if name == "u":
            continue
        total = g.detach().double().clone()
        dist.all_reduce(total, group=wrapper.process_group)  # local contributions add up
        e = torch.tensor([rel_err(total, ref_grads[name])], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        errs["d" + name] = e.item()
    tol = FP64_TOL if opts["dtype"] == "float64" else FP32_TOL
    return {"errs": errs, "ok": agree(all(v <= tol for v in errs.values())), "sp": wrapper.sequence_parallel_size}


def _group_of_one(rank, world):
    """An explicit group of one rank: bitwise the single-device computation, on every rank."""
    import deepspeed.comm as dist

    from ds_mamba_spcp import DistributedMamba2

    singles = [dist.new_group([r]) for r in range(world)]
    ok = True
    for variant, dtype in (("rms_Dh_g2_bias_dtlim", torch.float64), ("rmsbefore_g4", torch.float32)):
        m = make_mixer(variant, dtype, seed=rank)
        u, gout = global_inputs(dtype, 12, seed=rank + 7)
        ref_out, ref_grads = fwd_bwd(lambda x, m=m: ground_truth(m, x), m, u, gout)
        w = DistributedMamba2(m, singles[rank], section(mode="state_passing", load_balancing="virtual",
                                                        input_layout="zigzag", sequence_parallel_size=1))  # fmt: skip
        out, grads = fwd_bwd(w, m, u, gout)
        ok &= w.sequence_parallel_size == 1 and torch.equal(out, ref_out)
        ok &= all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    return agree(ok)


def _expect_raises(fn, exc, *words):
    try:
        fn()
    except exc as e:
        msg = str(e)
        return all(w in msg for w in words), f"{type(e).__name__}: {msg}"
    except Exception as e:  # noqa: BLE001 - reported as a failed expectation
        return False, f"wrong exception {type(e).__name__}: {e}"
    return False, "no exception"


def _group_resolution(rank, world):
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    from ds_mamba_spcp import DistributedMamba2, resolve_sequence_process_group

    m = make_mixer("rms_Dh_g2_bias_dtlim")
    res = {}
    everyone = dist.new_group(list(range(world)))
    w = DistributedMamba2(m, everyone, section(sequence_parallel_size=world))
    res["explicit_group_is_used"] = (w.process_group is everyone, "")
    w = DistributedMamba2(m, None, section(sequence_parallel_size=world))
    res["world_group_when_size_matches"] = (
        w.process_group is dist.get_world_group() and w.sequence_parallel_size == world, "")  # fmt: skip
    top = {"sequence_parallel_size": world, "mamba_sequence_parallel": {"enabled": True}}
    res["top_level_size_selects_world"] = (resolve_sequence_process_group(None, top) is dist.get_world_group(), "")
    res["no_group_of_configured_size"] = _expect_raises(
        lambda: DistributedMamba2(m, None, section(sequence_parallel_size=2 * world)).process_group,
        ValueError, "new_group", str(2 * world),
    )  # fmt: skip
    res["size_unset_in_a_world"] = _expect_raises(
        lambda: resolve_sequence_process_group(None, section()), ValueError, "neither", "new_group"
    )
    res["explicit_group_size_mismatch"] = _expect_raises(
        lambda: DistributedMamba2(m, everyone, section(sequence_parallel_size=1)), ValueError, "sequence_parallel_size"
    )
    odd = make_mixer("gate_g1", d_model=6)  # d_inner 12, headdim 4: nheads 3
    res["ulysses_nheads_not_divisible"] = _expect_raises(
        lambda: DistributedMamba2(odd, None, section(mode="ulysses", sequence_parallel_size=world)).process_group,
        ValueError, "nheads=3",
    )  # fmt: skip
    # DeepSpeed's own sequence-parallel group wins over the world group: through the mpu that
    # deepspeed.initialize(mpu=parallel_state_sp) installs, and through parallel_state_sp alone.
    parallel_state_sp.initialize_sequence_parallel(2)
    try:
        ds_group = parallel_state_sp.get_sequence_parallel_group()
        groups.mpu = parallel_state_sp
        w = DistributedMamba2(m, None, section(sequence_parallel_size=2))
        res["deepspeed_mpu_group"] = (w.process_group is ds_group and w.sequence_parallel_size == 2, "")
        groups.mpu = None
        res["deepspeed_parallel_state_sp_group"] = (resolve_sequence_process_group(None, section()) is ds_group, "")
    finally:
        groups.mpu = None
        parallel_state_sp._release_sequence_parallel_groups()
    # the device mesh deepspeed.initialize builds from "data_parallel_size" + "sequence_parallel_size"
    mesh = dist.initialize_mesh_device((world // 2, 2), ("data_parallel", "sequence_parallel"))
    try:
        groups.mesh_device = mesh
        sp_group = mesh.get_group(mesh_dim="sequence_parallel")
        res["deepspeed_mesh_group"] = (resolve_sequence_process_group(None, section()) is sp_group, "")
    finally:
        groups.mesh_device = None
    return {k: (agree(ok), detail) for k, (ok, detail) in res.items()}


def _shard_rejections(rank, world):
    from ds_mamba_spcp import DistributedMamba2

    m = make_mixer("gate_g1")
    w = DistributedMamba2(m, None, section(sequence_parallel_size=world, backend="reference"))
    res = {}
    seqlen = PER_RANK + (2 if rank == 0 else 0)
    res["variable_length_shards"] = _expect_raises(
        lambda: w(torch.randn(BATCH, seqlen, D_MODEL, dtype=torch.float64)), NotImplementedError, "variable-length"
    )
    batch = BATCH + (1 if rank == world - 1 else 0)
    res["different_batch"] = _expect_raises(
        lambda: w(torch.randn(batch, PER_RANK, D_MODEL, dtype=torch.float64)), ValueError, "different shapes"
    )
    return {k: (agree(ok), detail) for k, (ok, detail) in res.items()}


def _run_all(rank, world):
    out = {"cases": {}}
    for i, (name, opts) in enumerate(CASES.items()):
        nheads = make_mixer(opts["mixer"]).nheads
        sp = 2 if opts.get("pairs") else world
        if MODES[opts["mode"]]["mode"] == "ulysses" and nheads % sp != 0:
            # the all-to-all path's own limit (the wrapper raises it: see "ulysses_nheads_not_divisible")
            out["cases"][name] = {"skipped": f"ulysses shards heads: nheads={nheads} on {sp} ranks"}
            continue
        out["cases"][name] = _equivalence(rank, world, opts, seed=10 * i)
    out["group_of_one"] = _group_of_one(rank, world)
    out["resolution"] = _group_resolution(rank, world)
    out["rejections"] = _shard_rejections(rank, world)
    return out


# 2 and 4 ranks: 4 holds two groups of 2 ("pairs"); the op under the adapter runs at 8 ranks in
# test_state_passing, test_permute and test_ulysses, and nothing the adapter adds depends on the rank count
@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, run_ranks(_run_all, world, timeout=900)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("bug")])
def test_matches_single_process_module(world_results, case):
    world, results = world_results
    res = results[0]["cases"][case]
    if "skipped" in res:
        pytest.skip(res["skipped"])
    tol = FP64_TOL if CASES[case]["dtype"] == "float64" else FP32_TOL
    errs = res["errs"]
    assert all(r["cases"][case]["ok"] == res["ok"] for r in results)  # ranks agree
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"world {world}, {case}: errors over {tol}: {bad} (all: {errs})"
    assert res["ok"]
    m = make_mixer(CASES[case]["mixer"])
    assert {"out", "du"} | {"d" + n for n, _ in m.named_parameters()} <= set(errs)
    assert res["sp"] == (2 if CASES[case].get("pairs") else world)


def test_negative_control_fails(world_results):
    world, results = world_results
    res = results[0]["cases"]["bug_virtual_fed_contiguous"]
    assert not res["ok"]
    assert res["errs"]["out"] > 1e-3, res["errs"]


def test_group_of_one_is_bitwise_across_ranks(world_results):
    _, results = world_results
    assert all(r["group_of_one"] for r in results)


@pytest.mark.parametrize(
    "check",
    [
        "explicit_group_is_used",
        "world_group_when_size_matches",
        "top_level_size_selects_world",
        "no_group_of_configured_size",
        "size_unset_in_a_world",
        "explicit_group_size_mismatch",
        "ulysses_nheads_not_divisible",
        "deepspeed_mpu_group",
        "deepspeed_parallel_state_sp_group",
        "deepspeed_mesh_group",
    ],
)
def test_group_resolution(world_results, check):
    _, results = world_results
    ok, detail = results[0]["resolution"][check]
    assert ok, detail


@pytest.mark.parametrize("check", ["variable_length_shards", "different_batch"])
def test_shard_rejections(world_results, check):
    _, results = world_results
    assert all(r["rejections"][check][0] for r in results), [r["rejections"][check][1] for r in results]


# ---------------------------------------------------------------------------------------------
# single-process tests (deepspeed.comm not initialized: a group of one)
# ---------------------------------------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D_MODEL, dtype=torch.float64)
        self.mixer = mixer

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class TinyModel(torch.nn.Module):
    def __init__(self, seed=0, nlayers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [Block(make_mixer("rms_Dh_g2_bias_dtlim", seed=seed + i)) for i in range(nlayers)]
        )
        self.head = torch.nn.Sequential(make_mixer("gate_g1", seed=seed + 50))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_wrap_mamba2_mixers_counts_and_replaces():
    from ds_mamba_spcp import DistributedMamba2, wrap_mamba2_mixers

    model = TinyModel()
    model.layers.append(model.layers[0])  # one mixer reached twice
    mixers = [model.layers[0].mixer, model.layers[1].mixer, model.head[0]]
    assert wrap_mamba2_mixers(model, None, section()) == 3
    assert isinstance(model.head[0], DistributedMamba2)
    assert all(isinstance(b.mixer, DistributedMamba2) for b in model.layers)
    assert model.layers[2].mixer is model.layers[0].mixer
    assert [w.local_mixer for w in (model.layers[0].mixer, model.layers[1].mixer, model.head[0])] == mixers
    assert wrap_mamba2_mixers(model, None, section()) == 0  # already wrapped
    with pytest.raises(ValueError, match="wrap it directly"):
        wrap_mamba2_mixers(make_mixer("gate_g1"), None, section())


def test_state_dict_keys_and_checkpoint_round_trip():
    from ds_mamba_spcp import wrap_mamba2_mixers

    plain = TinyModel(seed=0)
    wrapped = copy.deepcopy(plain)
    wrap_mamba2_mixers(wrapped, None, section(backend="reference"))
    sd_plain, sd_wrapped = plain.state_dict(), wrapped.state_dict()
    assert list(sd_plain) == list(sd_wrapped)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wrapped.named_parameters()]
    assert all(torch.equal(sd_plain[k], sd_wrapped[k]) for k in sd_plain)

    # an unwrapped checkpoint loads unchanged into a wrapped model (strict), through a file
    buf = io.BytesIO()
    torch.save(plain.state_dict(), buf)
    other = TinyModel(seed=123)
    wrap_mamba2_mixers(other, None, section(backend="reference"))
    assert not torch.equal(other.layers[0].mixer.in_proj.weight, plain.layers[0].mixer.in_proj.weight)
    buf.seek(0)
    assert not other.load_state_dict(torch.load(buf)).missing_keys
    x = torch.randn(2, 12, D_MODEL, dtype=torch.float64)
    assert torch.equal(other(x), wrapped(x))
    assert other.layers[0].mixer.local_mixer.in_proj.weight is other.layers[0].mixer.in_proj.weight

    # and a wrapped checkpoint loads into an unwrapped model (strict)
    fresh = TinyModel(seed=7)
    fresh.load_state_dict(wrapped.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd_plain.values()))

    # conversions reach the wrapped module's tensors (the registries are shared)
    wrapped.float()
    assert wrapped.layers[0].mixer.local_mixer.D.dtype == torch.float32
    wrapped.eval()
    assert not wrapped.layers[0].mixer.local_mixer.training


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant,dtype", [("rms_Dh_g2_bias_dtlim", torch.float64),
                                           ("gate_g1", torch.float64), ("rmsbefore_g4", torch.float32)])  # fmt: skip
def test_group_of_one_is_the_unwrapped_computation(mode, variant, dtype):
    """Bitwise: output, input gradient and every parameter gradient, whatever the mode."""
    from ds_mamba_spcp import DistributedMamba2

    m = make_mixer(variant, dtype)
    u, gout = global_inputs(dtype, 10, seed=3)
    ref_out, ref_grads = fwd_bwd(lambda x: ground_truth(m, x), m, u, gout)
    w = DistributedMamba2(m, None, section(**MODES[mode]))
    out, grads = fwd_bwd(w, m, u, gout)
    assert w.sequence_parallel_size == 1
    assert torch.equal(out, ref_out)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    # Mamba2's flattened calling convention: (batch*seqlen, d_model) with seqlen=
    flat = w(rearrange(u, "b l d -> (b l) d"), seqlen=u.shape[1])
    assert torch.equal(flat, rearrange(ref_out, "b l d -> (b l) d"))


def test_disabled_wrapper_is_the_mixer():
    """enabled=false: the mixer's own forward, called with the same arguments, its result returned."""
    from ds_mamba_spcp import DistributedMamba2

    m = make_mixer("gate_g1", d_ssm=8)  # unsupported when enabled, fine when disabled
    calls = []
    sentinel = object()

    def spy(u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None):
        calls.append((u, seqlen, seq_idx, cu_seqlens, inference_params))
        return sentinel

    m.forward = spy
    w = DistributedMamba2(m, None, {"mamba_sequence_parallel": {"enabled": False}})
    u, params = torch.randn(1, 4, D_MODEL), object()
    assert w(u, inference_params=params) is sentinel
    assert calls == [(u, None, None, None, params)]
    assert w.sequence_parallel_size == 1
    assert w.headdim == m.headdim  # public attributes read through


def test_rejections():
    from ds_mamba_spcp import DistributedMamba2

    cfg = section(backend="reference")
    with pytest.raises(NotImplementedError, match="d_ssm"):
        DistributedMamba2(make_mixer("gate_g1", d_ssm=8), None, cfg)
    tp = make_mixer("gate_g1")
    tp.process_group = object()  # as if built with a tensor-parallel group
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        DistributedMamba2(tp, None, cfg)
    with pytest.raises(TypeError, match="Mamba2"):
        DistributedMamba2(torch.nn.Linear(2, 2), None, cfg)
    w = DistributedMamba2(make_mixer("gate_g1"), None, cfg)
    u = torch.randn(1, 8, D_MODEL, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="inference cache"):
        w(u, inference_params=object())
    with pytest.raises(ValueError, match="seq_idx must have shape"):
        w(u, seq_idx=torch.zeros(1, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        w(u, seq_idx=torch.zeros(1, 8, dtype=torch.int32), cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="d_model=8"):
        w(u[..., :4])
    with pytest.raises(NotImplementedError, match="decoding"):
        w.step(u[:, :1], None, None)  # Mamba2.step must not be reachable through the wrapper


def test_sequence_parallel_size_without_distributed_backend():
    from ds_mamba_spcp import DistributedMamba2

    w = DistributedMamba2(make_mixer("gate_g1"), None, section(sequence_parallel_size=2))
    with pytest.raises(ValueError, match="not initialized"):
        w(torch.randn(1, 8, D_MODEL, dtype=torch.float64))


@pytest.mark.parametrize("fields", [dict(), dict(recompute_output=True, overlap_comm=False, check_shapes=False)])
def test_config_options_reach_the_op(monkeypatch, fields):
    """The section's op options are the options of the call the wrapper runs."""
    from ds_mamba_spcp import DistributedMamba2
    from ds_mamba_spcp.engine import dispatch

    seen = {}

    def run(call):  # the dispatcher, which applies the adapter's projections around the core
        seen.update(vars(call.options))
        hidden = call.projections.hidden
        return call.projections.out_proj(hidden.new_zeros(*hidden.shape[:2], m.d_ssm))

    monkeypatch.setattr(dispatch, "run", run)
    m = make_mixer("gate_g1")
    w = DistributedMamba2(m, None, section(backend="reference", **fields))
    w(torch.randn(BATCH, 6, D_MODEL, dtype=torch.float64))
    expected = {**dict(recompute_output=False, overlap_comm=True, check_shapes=True), **fields}
    assert {k: seen[k] for k in expected} == expected
    assert seen["backend"] == "reference" and seen["load_balancing"] == "none"
