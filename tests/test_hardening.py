"""Issue 16's safeguards on 2 and 4 gloo ranks (CPU, reference backend): every rank decides alike, no
hidden memory, options honoured or refused, autocast and double backward handled.

1. A shape that changes on a later call on one rank only: every rank raises (the op, the ulysses op,
   the permute modes, DistributedMamba2), on the host path (CPU) and on the device path (forced here:
   the rank whose call changed raises the clear error, the others stop on ``torch._assert_async``);
   the group stays usable afterwards.
2. What the state-passing Function holds for backward, read from ``grad_fn.saved_tensors``: the
   inputs, the halo, S_in, the decays of every segment (their own small buffer, not a view of the
   gathered summaries), the packed-row masks; nothing else.
3. ``recompute_output`` reaches the Function in every state-passing mode, from the op and from the
   module; the ulysses mode refuses the options it cannot honour.
4. CPU autocast (bf16) changes nothing: the op equals the same call without autocast, bitwise; a
   negative control (the plain-PyTorch reference run directly under autocast) differs.
5. A backward with create_graph=True raises; a rank outside the group gets an error.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_inputs as shared_inputs
from tests.dist_utils import agree, run_ranks

NHEADS, HEADDIM, NGROUPS, DSTATE, D_CONV, CHUNK, PER_RANK, BATCH = 4, 4, 2, 8, 4, 8, 16, 2


def make_inputs(seqlen, dtype=torch.float64, seed=0):
    return shared_inputs(
        batch=BATCH, seqlen=seqlen, nheads=NHEADS, headdim=HEADDIM, ngroups=NGROUPS, dstate=DSTATE, d_conv=D_CONV,
        dtype=dtype, seed=seed, rms=True,
    )[0]  # fmt: skip


def call(fn, t, zxbcdt=None, **extra):
    from ds_mamba_spcp import mamba_split_conv1d_scan_ref

    z = t["zxbcdt"] if zxbcdt is None else zxbcdt
    if fn is not mamba_split_conv1d_scan_ref:
        extra["backend"] = "reference"
    return fn(
        z, t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], CHUNK, headdim=HEADDIM,
        ngroups=NGROUPS, rmsnorm_weight=t["rmsnorm_weight"], **extra,
    )  # fmt: skip


def _outcome(fn):
    try:
        fn()
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---------------------------------------------------------------------------------------------
# 1. a later call whose shape differs on one rank
# ---------------------------------------------------------------------------------------------


def _later_mismatch(rank, world):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import call as call_mod
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.op import mixer_core

    t = make_inputs(PER_RANK * world)
    contig = layout.shard_sequence(t["zxbcdt"], rank, world, "contiguous")
    zig = layout.shard_sequence(t["zxbcdt"], rank, world, "zigzag")
    entries = {
        "op": lambda z: call(mamba_split_conv1d_scan_sp, t, z),
        "ulysses": lambda z: call(mixer_core, t, z, mode="ulysses"),
        "permute_a2a": lambda z: call(mamba_split_conv1d_scan_sp, t, z, load_balancing="permute_a2a"),
    }
    results = {}
    for path in ("host", "device"):
        saved = call_mod._always_read
        if path == "device":
            call_mod._always_read = lambda device: False  # CPU tensors take the CUDA path: compare on the device
        try:
            for name, fn in entries.items():
                z = zig if name.startswith("permute") else contig
                first = _outcome(lambda fn=fn, z=z: fn(z))
                # later: the last rank drops 4 tokens (a variable-length shard), then the batch differs
                later = _outcome(lambda fn=fn, z=z: fn(z[:, : z.shape[1] - 4 * (rank == world - 1)]))
                batch = _outcome(lambda fn=fn, z=z: fn(z[: 2 - (rank == 0)]))
                after = _outcome(lambda fn=fn, z=z: fn(z))
                results[(path, name)] = (first, later, batch, after)
            results[(path, "module_permute_p2p")] = _module_mismatch(rank, t)
        finally:
            call_mod._always_read = saved
    return results


def _module_mismatch(rank, t):
    """mixer_forward (the module path) under permute_p2p: hidden states of another length on rank 1, on
    the second call, then another batch on rank 0."""
    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.module import MixerCore, mixer_forward

    core = MixerCore(t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], CHUNK, HEADDIM, NGROUPS,
                     rmsnorm_weight=t["rmsnorm_weight"])  # fmt: skip
    lin_in = torch.nn.Linear(12, t["zxbcdt"].shape[-1], dtype=torch.float64)
    lin_out = torch.nn.Linear(NHEADS * HEADDIM, 12, dtype=torch.float64)
    cfg = MambaSequenceParallelConfig(enabled=True, backend="reference", load_balancing="permute_p2p",
                                      input_layout="zigzag")  # fmt: skip
    hidden = torch.randn(BATCH, PER_RANK, 12, dtype=torch.float64)

    def mod(h):
        return mixer_forward(h, lin_in, lin_out, core, cfg, None)

    return (
        _outcome(lambda: mod(hidden)), _outcome(lambda: mod(hidden[:, : PER_RANK - 4 * (rank == 1)])),
        _outcome(lambda: mod(hidden[: 2 - (rank == 0)])), _outcome(lambda: mod(hidden)),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 2. what backward holds
# ---------------------------------------------------------------------------------------------


def _saved_bytes(rank, world):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import layout

    out = {}
    for lb, seq_layout in (("none", "contiguous"), ("virtual", "zigzag")):
        for packed in (False, True):
            t = {k: v.requires_grad_() for k, v in make_inputs(PER_RANK * world).items()}
            z = layout.shard_sequence(t["zxbcdt"].detach(), rank, world, seq_layout).requires_grad_()
            labels = None
            if packed:
                labels = (torch.arange(PER_RANK * world) // 5).expand(BATCH, -1).to(torch.int32)
                labels = layout.shard_sequence(labels, rank, world, seq_layout)
            y = call(mamba_split_conv1d_scan_sp, t, z, load_balancing=lb, seq_idx=labels, recompute_output=False)
            held, seen = 0, set()
            for s in y.grad_fn.saved_tensors:
                if s is None or s.untyped_storage().data_ptr() in seen:
                    continue
                seen.add(s.untyped_storage().data_ptr())
                held += s.untyped_storage().nbytes()
            nloc = 1 if lb == "none" else 2
            nseg = world * nloc
            f64 = 8
            params = sum(t[k].numel() for k in t if k != "zxbcdt") * f64
            expect = (
                z.numel() * f64  # the input shard
                + BATCH * nloc * (D_CONV - 1) * (NHEADS * HEADDIM + 2 * NGROUPS * DSTATE) * f64  # the halo
                + BATCH * nloc * NHEADS * HEADDIM * DSTATE * f64  # S_in of the local segments
                + nseg * BATCH * NHEADS * f64  # the decays of every segment: nothing else of the gathered summaries
                + params
            )
            if packed:
                m = z.shape[1] // nloc
                expect += BATCH * nloc * m * 4 + BATCH * nloc + BATCH * nloc * (D_CONV - 1)  # labels, start0, mask
            out[(lb, packed)] = (held, expect)
            (y * 0).sum().backward()
    return out


# ---------------------------------------------------------------------------------------------
# 3. recompute_output reaches the Function; ulysses refuses what it cannot honour
# ---------------------------------------------------------------------------------------------


def _options_reach_the_function(rank, world):
    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.engine.strategies import state_passing
    from ds_mamba_spcp.module import MixerCore, mixer_forward
    from ds_mamba_spcp.op import mixer_core

    seen = []
    real = state_passing._StatePassingFn.apply

    def spy(*args):
        seen.append(args[-1].recompute_output)  # the _Static the Function receives
        return real(*args)

    state_passing._StatePassingFn.apply = spy
    t = make_inputs(PER_RANK * world)
    results = {}
    try:
        for lb in ("none", "virtual", "permute_p2p", "permute_a2a"):
            seq_layout = "contiguous" if lb == "none" else "zigzag"
            z = layout.shard_sequence(t["zxbcdt"], rank, world, seq_layout)
            for flag in (False, True):
                seen.clear()
                call(mamba_split_conv1d_scan_sp, t, z, load_balancing=lb, recompute_output=flag)
                op_seen = list(seen)
                seen.clear()
                core = MixerCore(t["conv1d_weight"], t["conv1d_bias"], t["dt_bias"], t["A"], t["D"], CHUNK, HEADDIM,
                                 NGROUPS, rmsnorm_weight=t["rmsnorm_weight"])  # fmt: skip
                cfg = MambaSequenceParallelConfig(enabled=True, backend="reference", load_balancing=lb,
                                                  input_layout=seq_layout, recompute_output=flag)  # fmt: skip
                mixer_forward(z, lambda h: h, lambda y: y, core, cfg, None)
                results[(lb, flag)] = (op_seen, list(seen))
    finally:
        state_passing._StatePassingFn.apply = real
    z = layout.shard_sequence(t["zxbcdt"], rank, world, "contiguous")
    results["ulysses_recompute"] = _outcome(lambda: call(mixer_core, t, z, mode="ulysses", recompute_output=True))
    results["ulysses_no_overlap"] = _outcome(lambda: call(mixer_core, t, z, mode="ulysses", overlap_comm=False))
    return results


# ---------------------------------------------------------------------------------------------
# 4. autocast; 5. double backward, a rank outside the group
# ---------------------------------------------------------------------------------------------


def _autocast(rank, world):
    from ds_mamba_spcp import mamba_split_conv1d_scan_ref, mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.op import mixer_core

    t32 = make_inputs(PER_RANK * world, dtype=torch.float32, seed=3)
    res = {}
    for name, fn, seq_layout, kw in (
        ("state_passing", mamba_split_conv1d_scan_sp, "contiguous", {}),
        ("virtual", mamba_split_conv1d_scan_sp, "zigzag", dict(load_balancing="virtual")),
        ("ulysses", mixer_core, "contiguous", dict(mode="ulysses")),
    ):
        runs = []
        for enabled in (False, True):
            t = {k: v.clone().requires_grad_() for k, v in t32.items()}
            z = layout.shard_sequence(t["zxbcdt"].detach(), rank, world, seq_layout).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                y = call(fn, t, z, **kw)
                loss = (y * torch.linspace(-1, 1, y.shape[-1])).sum()
            loss.backward()
            runs.append([y.detach(), z.grad] + [t[k].grad for k in t if k != "zxbcdt"])
        res[name] = agree(all(torch.equal(a, b) for a, b in zip(*runs)))
    # negative control: the plain-PyTorch reference itself, run directly under autocast, does change
    t = {k: v.clone() for k, v in t32.items()}
    plain = call(mamba_split_conv1d_scan_ref, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = call(mamba_split_conv1d_scan_ref, t)
    res["control_differs"] = not torch.equal(plain, under.to(plain.dtype))
    return res


def _double_backward_and_membership(rank, world):
    import deepspeed.comm as dist

    from ds_mamba_spcp import mamba_split_conv1d_scan_sp
    from ds_mamba_spcp.engine import layout

    t = make_inputs(PER_RANK * world)
    z = layout.shard_sequence(t["zxbcdt"], rank, world, "contiguous")
    res = {}
    for lb in ("none", "permute_a2a"):
        zz = layout.shard_sequence(t["zxbcdt"], rank, world, "zigzag") if lb != "none" else z
        w = t["conv1d_weight"].clone().requires_grad_()
        tt = dict(t, conv1d_weight=w)
        y = call(mamba_split_conv1d_scan_sp, tt, zz.clone().requires_grad_(), load_balancing=lb)
        res[f"create_graph_{lb}"] = _outcome(lambda y=y, w=w: torch.autograd.grad(y.sum(), [w], create_graph=True))
        res[f"plain_{lb}"] = _outcome(lambda y=y, w=w: torch.autograd.grad(y.sum(), [w]))
    # every rank makes every group; the last rank is outside the group of the others
    group = dist.new_group(list(range(world - 1)))
    if rank == world - 1:
        res["outside"] = _outcome(lambda: call(mamba_split_conv1d_scan_sp, t, z, process_group=group))
    else:
        res["outside"] = _outcome(lambda: call(mamba_split_conv1d_scan_sp, t, z[:, :12], process_group=group))
    return res


def _run_all(rank, world):
    return {
        "mismatch": _later_mismatch(rank, world),
        "saved": _saved_bytes(rank, world),
        "options": _options_reach_the_function(rank, world),
        "autocast": _autocast(rank, world),
        "misc": _double_backward_and_membership(rank, world),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, run_ranks(_run_all, world, timeout=600)


def test_later_shape_change_fails_every_rank(world_results):
    world, results = world_results
    for key in results[0]["mismatch"]:
        path, name = key
        for rank, r in enumerate(results):
            first, later, batch, after = r["mismatch"][key]
            assert first == "no error" and after == "no error", (world, key, rank, first, after)
            changed_later = rank == (world - 1 if name != "module_permute_p2p" else 1)
            if path == "host" or changed_later:  # the clear message: every rank on CPU, the changed rank on CUDA
                assert later.startswith("NotImplementedError") and "variable-length shards" in later, (key, rank, later)
            else:  # the device-side comparison stops a rank whose own call did not change
                assert later.startswith("RuntimeError"), (key, rank, later)
            # the batch differs on rank 0; the rank that dropped tokens before changed its call too: both read
            if path == "host" or rank == 0 or changed_later:
                assert batch.startswith("ValueError") and "batch=" in batch, (key, rank, batch)
            else:
                assert batch.startswith("RuntimeError"), (key, rank, batch)


def test_backward_holds_only_what_the_docs_say(world_results):
    world, results = world_results
    for r in results:
        for key, (held, expect) in r["saved"].items():
            assert held == expect, f"world {world}, {key}: backward holds {held} bytes, expected {expect}"


def test_recompute_output_reaches_the_function_in_every_mode(world_results):
    world, results = world_results
    opts = results[0]["options"]
    for (lb, flag), (op_seen, module_seen) in ((k, v) for k, v in opts.items() if isinstance(k, tuple)):
        assert op_seen == [flag] and module_seen == [flag], (lb, flag, op_seen, module_seen)
    for r in results:
        assert r["options"]["ulysses_recompute"].startswith("ValueError"), r["options"]["ulysses_recompute"]
        assert "recompute_output" in r["options"]["ulysses_recompute"]
        assert r["options"]["ulysses_no_overlap"].startswith("ValueError")
        assert "overlap_comm" in r["options"]["ulysses_no_overlap"]


def test_autocast_changes_nothing(world_results):
    world, results = world_results
    for r in results:
        assert r["autocast"]["state_passing"] and r["autocast"]["virtual"] and r["autocast"]["ulysses"]
        assert r["autocast"]["control_differs"]  # the check can fail: autocast does reach plain PyTorch ops


def test_double_backward_raises_and_outsiders_are_told(world_results):
    world, results = world_results
    for rank, r in enumerate(results):
        misc = r["misc"]
        for lb in ("none", "permute_a2a"):
            assert (
                misc[f"create_graph_{lb}"].startswith("RuntimeError") and "second-order" in misc[f"create_graph_{lb}"]
            )
            assert misc[f"plain_{lb}"] == "no error"
        if rank == world - 1:
            assert misc["outside"].startswith("ValueError") and "not a member" in misc["outside"], misc["outside"]
        else:
            assert misc["outside"] == "no error", misc["outside"]
