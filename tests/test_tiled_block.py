"""The tiled block recompute (ds_mamba_spcp.memory.tiled_block) against the untiled block, on CPU.

1. fp64, the reference backend: the block's output, the gradient of its input and of every parameter, tiled
   against ``Block.forward`` (examples/model.py, the mixer on the group-of-one path), at most 1e-10 apart
   (the same math; only the order of the sums over tiles differs, ~1e-14 seen). Tile counts 1, 2 and 3 with
   an uneven last tile, and tiles of 1 and 2 tokens (shorter than the conv halo, d_conv - 1 = 3), for the
   three mixer variants of conftest; packed rows with documents starting on, just after and inside tiles.
2. Negative controls: the state not carried to the next tile, or the conv halo dropped, must fail 1e-3.
3. The recompute keeps torch.utils.checkpoint's contract: under the forward's autocast (CPU bf16, the backward
   outside it) and from each tile's own RNG state (a dropout norm), bitwise against torch's checkpoint (one
   tile) or the graph of the same tiles; an input saved through the offloader and modified in place raises.
4. Refusals, by their messages: a mixer of another kind, a tile of no tokens.
5. A sequence-parallel group (sp 2 and 3 on gloo, one spawn of three ranks): the tiled block on each rank's shard
   (contiguous and zigzag shards, the all-gather and the scan exchange, packed rows, tiles shorter than the conv
   halo) against the untiled block in one process, fp64, relative RMS over the group <= 1e-10 (~1e-15 seen);
   the negative control drops the exchange's incoming state (~0.5 off).
6. Under DeepSpeed (one gloo rank, one spawn): examples/train.py with --block-tile-tokens at ZeRO 1 and 2
   (and the hybrid model on packed rows: attention blocks keep DeepSpeed's checkpoint) trains step by step as
   the untiled run at ZeRO 2 (fp32, SGD, 20 steps, relative 1e-4 as in test_train.py:
   the sums' order drifts ~1e-6 there, while a gradient that ZeRO's hooks dropped or counted twice moves the
   loss by ~1e-2 from the first update on); at ZeRO 3 as the untiled ZeRO-3 run, each tiled block's parameters
   all-gathered once per pass (negative control: gathered without its mark, once per tile). At
   sequence_parallel_size 2 (ZeRO 1 and 3): tests/test_train.py, the "-tiles" cases.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from ds_mamba_spcp.config import MambaSequenceParallelConfig
from ds_mamba_spcp.memory import tiled_block
from ds_mamba_spcp.module import DistributedMamba2
from tests.conftest import MIXER_D_MODEL, MIXERS, TINY, TRAIN_STEPS, load_train, make_mixer, sgd_config
from tests.dist_utils import REPO, run_ranks

tiled_block_module = importlib.import_module("ds_mamba_spcp.memory.tiled_block")  # the package exports the function
TOL = 1e-10
SEQLEN, BATCH = 29, 2
TILES = {"one": SEQLEN, "two_uneven": 15, "three_uneven": 10, "two_tokens": 2, "one_token": 1}


def _block(variant: str):
    sys.path.insert(0, f"{REPO}/examples")
    from model import Block

    mixer = make_mixer(variant, torch.float64, seed=3)
    cfg = MambaSequenceParallelConfig(enabled=True, sequence_parallel_size=1, backend="reference")
    block = Block(MIXER_D_MODEL, DistributedMamba2(mixer, None, cfg)).double()
    with torch.no_grad():
        block.norm.weight.copy_(1.0 + 0.3 * torch.randn(MIXER_D_MODEL, generator=torch.Generator().manual_seed(4)))
    return block


def _inputs():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, SEQLEN, MIXER_D_MODEL, generator=g, dtype=torch.float64)
    dout = torch.randn(BATCH, SEQLEN, MIXER_D_MODEL, generator=g, dtype=torch.float64)
    return x, dout


def _run(block, fn, x, dout):
    x = x.clone().requires_grad_()
    out = fn(x)
    out.backward(dout)
    grads = {"out": out.detach(), "dx": x.grad}
    for name, p in block.named_parameters():
        grads["d" + name] = p.grad
        p.grad = None
    return grads


def _worst(got, ref) -> tuple[float, str]:
    assert got.keys() == ref.keys()
    return max(((got[k] - ref[k]).abs().max().item() / ref[k].abs().max().item(), k) for k in ref)


# documents: 0-6, 7-9 (starts on the 7-token tile's border), 10 (one token), 11-20, 21-28; row 2: 0-14, 15-28
PACKED = torch.tensor([[0] * 7 + [1] * 3 + [2] + [3] * 10 + [4] * 8, [5] * 15 + [6] * 14], dtype=torch.int32)


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("variant", list(MIXERS))
def test_tiled_equals_untiled_fp64(variant, tiles):
    block = _block(variant)
    x, dout = _inputs()
    ref = _run(block, block, x, dout)
    got = _run(block, lambda x: tiled_block(x, block.norm, block.mixer, TILES[tiles]), x, dout)
    err, key = _worst(got, ref)
    assert err <= TOL, f"{variant}, tiles of {TILES[tiles]}: {key} is {err:.2e} off the untiled block"


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_offloaded_input_is_bitwise_a_move(budget):
    """Two tiled blocks whose inputs are saved through one CheckpointOffloader (examples/train.py with
    --offload-activations): output and every gradient bitwise those without it (a pure move, nothing
    reordered), and the inputs are placed as planned: with no budget the first goes to a host slot (the
    newest never leaves the device), within the budget both stay."""
    from ds_mamba_spcp.memory import CheckpointOffloader

    block = _block("rms_Dh_g2_bias_dtlim")
    x, dout = _inputs()

    def tiled(x):
        return tiled_block(x, block.norm, block.mixer, TILES["three_uneven"])

    ref = _run(block, lambda x: tiled(tiled(x)), x, dout)
    offloader = CheckpointOffloader(gpu_budget_bytes=budget)

    def offloaded(x):
        for _ in range(2):
            with offloader.saved_tensors_hooks(x):
                x = tiled(x)
        return x

    got = _run(block, offloaded, x, dout)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
    stats = dict(offloader.stats)
    assert stats["saved"] == 2 and stats.get("offloaded", 0) == (0 if budget else 1), stats
    assert stats.get("kept", 0) == (2 if budget else 0), stats


def test_offloaded_inputs_are_released():
    """An offloaded block input must not stay referenced until backward (the hooks once held it in a closure
    cell: every checkpoint stayed on the GPU, and 1M tokens of the 780M ran out of memory with offload on)."""
    import weakref

    from ds_mamba_spcp.memory import CheckpointOffloader

    block = _block("rms_Dh_g2_bias_dtlim")
    x, _ = _inputs()
    offloader, h, refs = CheckpointOffloader(gpu_budget_bytes=0), x.clone().requires_grad_() * 1.0, []
    for _ in range(3):
        refs.append(weakref.ref(h))
        with offloader.saved_tensors_hooks(h):
            h = tiled_block(h, block.norm, block.mixer, TILES["three_uneven"])
    assert [r() is None for r in refs] == [True, True, True], dict(offloader.stats)
    assert offloader.stats["offloaded"] == 2


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_offloaded_input_modified_in_place_raises(budget):
    """A tiled block's input saved through the offloader's hooks and modified in place before backward:
    autograd does not check a tensor saved through hooks, so the offloader must (before the fix: no error, the
    recompute ran on the modified input). Kept on the device, or pending its copy to the host when modified."""
    from ds_mamba_spcp.memory import CheckpointOffloader

    block = _block("rms_Dh_g2_bias_dtlim")
    x, dout = _inputs()
    offloader, h = CheckpointOffloader(gpu_budget_bytes=budget), x.clone().requires_grad_() * 1.0
    with offloader.saved_tensors_hooks(h):
        out = tiled_block(h, block.norm, block.mixer, TILES["three_uneven"])
    h.mul_(3)
    with offloader.saved_tensors_hooks(out):
        out = tiled_block(out, block.norm, block.mixer, TILES["three_uneven"])
    with pytest.raises(RuntimeError, match="block checkpoint 0 .*modified by an inplace operation"):
        out.backward(dout)


@pytest.mark.parametrize("tile_tokens", [15, 7, 10, 2])
def test_packed_rows_fp64(tile_tokens):
    block = _block("rms_Dh_g2_bias_dtlim")
    x, dout = _inputs()
    ref = _run(block, lambda x: block(x, seq_idx=PACKED), x, dout)
    got = _run(block, lambda x: tiled_block(x, block.norm, block.mixer, tile_tokens, seq_idx=PACKED), x, dout)
    err, key = _worst(got, ref)
    assert err <= TOL, f"packed, tiles of {tile_tokens}: {key} is {err:.2e} off the untiled block"


def _drop_state(tile):
    return lambda self, k, x_ext, S_in: tile(self, k, x_ext, None)


def _drop_halo(tile):
    def without_halo(self, k, x_ext, S_in):
        nhalo = self.tiles.halo_rows(k)
        x_ext = torch.cat([torch.zeros_like(x_ext[:, :nhalo]), x_ext[:, nhalo:]], dim=1)
        return tile(self, k, x_ext, S_in)

    return without_halo


@pytest.mark.parametrize("bug", [_drop_state, _drop_halo])
def test_negative_control_carry_lost(monkeypatch, bug):
    block = _block("rms_Dh_g2_bias_dtlim")
    x, dout = _inputs()
    ref = _run(block, block, x, dout)
    monkeypatch.setattr(tiled_block_module._Block, "tile", bug(tiled_block_module._Block.tile))
    got = _run(block, lambda x: tiled_block(x, block.norm, block.mixer, 10), x, dout)
    err, key = _worst(got, ref)
    assert err > 1e-3, f"{bug.__name__}: the tiles still match the untiled block ({key} {err:.2e})"


def _graph_of_tiles(block, x, *params):
    """The tiles of ``TiledFn.forward`` with a graph and nothing recomputed (patched in for
    ``TiledFn.apply``): the function the tiled forward computes, differentiated by autograd."""
    outs, S = [], None
    for k, (s, e) in enumerate(block.tiles.spans):
        out_k, S = block.tile(k, x[:, s - block.tiles.halo_rows(k) : e], S)
        outs.append(out_k)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("tiles", ["one", "three_uneven"])
def test_recompute_under_the_forwards_autocast(monkeypatch, tiles):
    """fp32 weights, the forward under CPU bf16 autocast and the backward outside it (accelerate, the Trainer,
    most loops): the recompute must run under the forward's autocast, or the gradients are those of the fp32
    block (seen before the fix: 5.5e-3 relative on dx, 1.9e-2 on dt_bias, against torch's checkpoint).

    Exact: bf16 on CPU is deterministic, and the recompute runs the forward's kernels on the forward's inputs
    (torch's own checkpoint is bitwise the plain autocast graph, asserted). One tile against torch's checkpoint
    of the untiled block (the same ops); three tiles against the graph of the same tiles (untiled bf16 rounds
    elsewhere, ~3e-3: no reference at a useful tolerance), with autocast's weight-cast cache off, since with it
    the graph would sum the tiles' weight gradients in bf16 through the one cached cast (the tiles sum in fp32)."""
    block = _block("rms_Dh_g2_bias_dtlim").float()
    x, dout = (t.float() for t in _inputs())
    cache = tiles == "one"

    def under_autocast(fn):
        def run(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
                return fn(x)

        return run

    def tiled(x):
        return tiled_block(x, block.norm, block.mixer, TILES[tiles])

    got = _run(block, under_autocast(tiled), x, dout)
    if tiles == "one":
        plain = _run(block, under_autocast(block), x, dout)
        ref = _run(block, under_autocast(lambda x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)),
                   x, dout)  # fmt: skip
        assert [k for k in ref if not torch.equal(ref[k], plain[k])] == [], "torch's checkpoint is not exact here"
    else:
        monkeypatch.setattr(tiled_block_module.TiledFn, "apply", _graph_of_tiles)
        ref = _run(block, under_autocast(tiled), x, dout)
        monkeypatch.undo()
    assert ref["out"].dtype == torch.float32 and got["out"].dtype == torch.float32
    err, key = _worst(got, ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == [], f"{key} is {err:.2e} off"


def test_recompute_replays_each_tiles_draws(monkeypatch):
    """A norm with dropout (fp64): every tile recomputed in backward must draw what it drew in forward, and the
    tiles run in reverse there. One tile against torch's checkpoint of the untiled block (the same draws; the
    core's sums in another order: 1e-10 as above); three tiles against the graph of the same tiles (each tile
    draws its own mask, halo rows included, so the untiled block is not the reference; the same ops: bitwise).
    Without the replay the masks are new draws (O(1)); with the first tile's state replayed for every tile
    (the plausible slip), tile 0's mask again. The caller's generator ends where the graph's run leaves it."""
    block = _block("rms_Dh_g2_bias_dtlim")
    x, dout = _inputs()
    noisy = torch.nn.Sequential(block.norm, torch.nn.Dropout(0.3))

    def seeded(fn):
        def run(x):
            torch.manual_seed(11)
            return fn(x)

        return run

    def tiled(tile_tokens):
        return seeded(lambda x: tiled_block(x, noisy, block.mixer, tile_tokens))

    got = _run(block, tiled(SEQLEN), x, dout)
    ref = _run(block, seeded(lambda x: torch.utils.checkpoint.checkpoint(lambda x: x + block.mixer(noisy(x)), x,
                                                                           use_reentrant=False)), x, dout)  # fmt: skip
    err, key = _worst(got, ref)
    assert err <= TOL, f"one tile with dropout: {key} is {err:.2e} off torch's checkpoint"
    got = _run(block, tiled(10), x, dout)
    after = torch.get_rng_state()
    monkeypatch.setattr(tiled_block_module.TiledFn, "apply", _graph_of_tiles)
    ref = _run(block, tiled(10), x, dout)
    assert torch.equal(after, torch.get_rng_state()), "the backward moved the caller's generator"
    err, key = _worst(got, ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == [], f"three tiles with dropout: {key} {err:.2e} off"


def _state_grads(tiles, k, mixer, zx, S_in, g, state) -> dict:
    core = mixer._core()
    S_out = state(tiles, k, zx, core, S_in)
    params = dict(mixer.named_parameters())
    got = torch.autograd.grad((S_out * g).sum(), [zx, S_in, *params.values()], allow_unused=True)
    names = ["S_out", "dzx", "dS_in", *("d" + n for n in params)]
    values = [S_out.detach(), *got]
    return {n: v for n, v in zip(names, values) if v is not None and v.abs().max() > 0}  # zeros: unused


def _halo_dropped(state):
    """A state path whose tile's halo rows never reach its conv."""
    return lambda zxbcdt, halo, *args, **kwargs: state(zxbcdt, None, *args, **kwargs)


@pytest.mark.parametrize("packed", [False, True])
def test_state_path_equals_the_whole_segment_fp64(monkeypatch, packed):
    """A tiled shard's backward pass 2 reads only the state after each tile: ``Tiles.state`` takes it through the
    reference backend's ``segment_state`` (the segment's summary, no output) instead of the whole segment
    differentiated with a zero output gradient (``Tiles.core``, _TileCore: segment_fwd and segment_bwd). S_out and
    the gradients of the tile's in_proj output with its halo rows, of S_in and of every mixer parameter agree to
    1e-12 (fp64, the same operations: seen bitwise equal), on tiles with halo rows, of packed rows too (a tile that
    starts on a document start, starts inside tiles). Negative control: the halo rows dropped, > 1e-3 off."""
    from ds_mamba_spcp.ops import reference

    block = _block("rms_Dh_g2_bias_dtlim")
    mixer, core = block.mixer, block.mixer._core()
    ids = PACKED if packed else None
    tiles = tiled_block_module.make_tiles(core, reference, BATCH, SEQLEN, 10, ids, keep_y=False)
    spec = tiles.spec
    g = torch.Generator().manual_seed(5)
    shape = (BATCH, spec.nheads, spec.headdim, spec.dstate)
    S_in, dS = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    worst = {}
    for k in (1, 2):
        s, e = tiles.spans[k]
        zx = torch.randn(BATCH, tiles.halo_rows(k) + e - s, core.d_in_proj, generator=g, dtype=torch.float64)
        whole = _state_grads(tiles, k, mixer, zx.requires_grad_(), S_in.clone().requires_grad_(), dS,
                             lambda t, *a: t.core(*a)[1])  # fmt: skip
        for name in ("state", "no_halo"):
            if name == "no_halo":  # the negative control
                monkeypatch.setattr(reference, "segment_state", _halo_dropped(reference.segment_state))
            got = _state_grads(tiles, k, mixer, zx, S_in.clone().requires_grad_(), dS, type(tiles).state)
            monkeypatch.undo()
            assert got.keys() == whole.keys(), (name, got.keys() ^ whole.keys())
            err = max((got[n] - whole[n]).norm().item() / whole[n].norm().item() for n in whole)
            worst[name] = max(worst.get(name, 0.0), err)
    print(f"state path against the whole segment: {worst['state']:.1e}; halo dropped: {worst['no_halo']:.1e}")
    assert worst["state"] <= 1e-12, worst
    assert worst["no_halo"] > 1e-3, worst


def test_a_forward_set_on_the_mixer_is_kept():
    """Each tile calls the mixer through its module call (tiled_block._as_call_of: under ZeRO-3 the mixer's hooks
    hand its gradients over), its forward replaced for that call: a forward set on the instance (a wrapper's, as
    accelerate's hooks set one) is there again afterwards, and the tiles do not run it."""
    block = _block("gate_g1")
    x, _ = _inputs()

    def own(*args, **kwargs):
        raise AssertionError("a tile ran the instance's forward")

    block.mixer.forward = own
    with torch.no_grad():  # one tile, forward only: the call is what matters here
        tiled_block(x, block.norm, block.mixer, SEQLEN)
    assert block.mixer.__dict__["forward"] is own


def test_refusals():
    block = _block("gate_g1")
    x, _ = _inputs()
    with pytest.raises(TypeError, match="DistributedMamba2"):
        tiled_block(x, block.norm, block.mixer.local_mixer, 8)
    with pytest.raises(ValueError, match=r"block_tile_tokens\" must be a positive int.* got 0"):
        tiled_block(x, block.norm, block.mixer, 0)


# ---------------------------------------------------------------------------------------------
# a sequence-parallel group: sp 2 and 3 on gloo, one spawn of three ranks
# ---------------------------------------------------------------------------------------------

SP_SEQLEN = 24  # sp 3: shards of 8 (zigzag: two segments of 4 >= d_conv - 1); sp 2: 12 (two of 6)
# (group size, input layout and load balancing, summary exchange, packed rows, tile tokens, mixer variant)
SP_CASES = {
    "sp3-contiguous-allgather": (3, ("contiguous", "none"), "allgather", False, 3, "rms_Dh_g2_bias_dtlim"),
    "sp3-zigzag-scan-packed": (3, ("zigzag", "virtual"), "scan", True, 2, "gate_g1"),
    "sp2-contiguous-scan-packed": (2, ("contiguous", "none"), "scan", True, 5, "rmsbefore_g4"),
    "sp2-zigzag-permute-allgather": (2, ("zigzag", "permute_a2a"), "allgather", False, 4, "rms_Dh_g2_bias_dtlim"),
    "sp2-ulysses": (2, ("contiguous", "ulysses"), "auto", True, 3, "gate_g1"),
}
# documents across the shard borders of both group sizes: starting on a border (12, 16), just after one (9),
# inside a segment, one of one token (20)
SP_PACKED = torch.tensor([[0] * 9 + [1] * 3 + [2] * 4 + [3] * 4 + [4] + [5] * 3, [6] * 13 + [7] * 11],
                         dtype=torch.int32)  # fmt: skip


def _sp_case(name, group, sp, sp_rank, single):
    import deepspeed.comm as dist

    from ds_mamba_spcp.engine import layout

    _, (data_layout, balancing), method, packed, tile, variant = SP_CASES[name]
    ref_block = _block(variant)
    ref_block.mixer = DistributedMamba2(ref_block.mixer.local_mixer, single, ref_block.mixer.config)  # one process
    g = torch.Generator().manual_seed(11)
    x = torch.randn(BATCH, SP_SEQLEN, MIXER_D_MODEL, generator=g, dtype=torch.float64)
    dout = torch.randn(BATCH, SP_SEQLEN, MIXER_D_MODEL, generator=g, dtype=torch.float64)
    seq_idx = SP_PACKED if packed else None
    ref = _run(ref_block, lambda x: ref_block(x, seq_idx=seq_idx), x, dout)
    mode = dict(mode="ulysses", load_balancing="none") if balancing == "ulysses" else dict(load_balancing=balancing)
    cfg = MambaSequenceParallelConfig(enabled=True, sequence_parallel_size=sp, backend="reference",
                                      input_layout=data_layout, summary_exchange=method, **mode)  # fmt: skip
    block = _block(variant)
    block.mixer = DistributedMamba2(block.mixer.local_mixer, group, cfg)
    shard = lambda t: layout.shard_sequence(t, sp_rank, sp, data_layout).contiguous()  # noqa: E731
    ids = None if seq_idx is None else shard(seq_idx)
    got = _run(block, lambda x: tiled_block(x, block.norm, block.mixer, tile, seq_idx=ids), shard(x), shard(dout))
    errs = {}
    for key in ref:
        if key in ("out", "dx"):  # the shards' squared differences add up over the group
            sq = torch.stack([(got[key] - shard(ref[key])).square().sum(), shard(ref[key]).square().sum()])
            dist.all_reduce(sq, group=group)
            errs[key] = (sq[0] / sq[1]).sqrt().item()
        else:  # each rank's share of a parameter's gradient; their sum is the whole
            total = got[key].clone()
            dist.all_reduce(total, group=group)
            errs[key] = ((total - ref[key]).norm() / ref[key].norm()).item()
    return errs


def _sp_cases(rank, world):
    import deepspeed.comm as dist

    from ds_mamba_spcp.ops.segment import Ready
    from tests.dist_utils import agree

    pair = dist.new_group([0, 1])  # every rank makes every group, in the same order
    single = [dist.new_group([r]) for r in range(world)][rank]
    out = {}
    for name, (sp, *_) in SP_CASES.items():
        if sp == 3:
            errs = _sp_case(name, None, 3, rank, single)
        elif rank < 2:
            errs = _sp_case(name, pair, 2, rank, single)
        else:
            errs = None
        worst = max(errs.values()) if errs else 0.0
        out[name] = (errs, agree(worst <= TOL))
    # the negative control: each shard's tiles start from a zero state (the exchange's S_in dropped)
    original = tiled_block_module.Chain.exchange

    def dropped(self, batch, **kwargs):
        ex = original(self, batch, **kwargs)
        post = ex.post
        ex.post = lambda S_ext, log_a: Ready(torch.zeros_like(post(S_ext, log_a).wait()))
        return ex

    tiled_block_module.Chain.exchange = dropped
    try:
        errs = _sp_case("sp3-contiguous-allgather", None, 3, rank, single)
    finally:
        tiled_block_module.Chain.exchange = original
    out["negative"] = (errs, agree(max(errs.values()) > 1e-3))
    return out


@pytest.fixture(scope="module")
def sp_runs():
    return run_ranks(_sp_cases, 3, timeout=300)[0]


@pytest.mark.parametrize("name", list(SP_CASES))
def test_tiled_at_sp_equals_one_process_fp64(sp_runs, name):
    """At sp 2 and 3 the tiled block (shard tiles, the summary exchange, the halo from the previous rank) matches
    the untiled block in one process to fp64 rounding (relative RMS over the group, 1e-10: the same sums in
    another order); every rank reached the same verdict (agree)."""
    errs, ok = sp_runs[name]
    print(f"{name}: worst relative RMS {max(errs.values()):.1e}")
    assert ok, f"{name}: {errs}"


def test_tiled_at_sp_negative_control(sp_runs):
    """The shards' tiles from a zero incoming state (the exchange dropped) miss the one-process block by > 1e-3."""
    errs, ok = sp_runs["negative"]
    print(f"negative control: largest relative RMS {max(errs.values()):.1e}")
    assert ok, f"dropping the incoming state went unnoticed: {errs}"


# ---------------------------------------------------------------------------------------------
# under DeepSpeed: examples/train.py on one gloo rank
# ---------------------------------------------------------------------------------------------

STEPS = TRAIN_STEPS
DS_TILES = 10  # 4 tiles of the 32 tokens, the last of 2 (shorter than the conv halo)
MAMBA, HYBRID_PACKED = ("--model", "mamba", "--n-layers", "2"), ("--model", "hybrid", "--n-layers", "3", "--packed",
                                                                  "--doc-len", "5")  # fmt: skip
TILED = ("--block-tile-tokens", str(DS_TILES))
# name -> (ZeRO stage, flags, the untiled case it must match)
DS_CASES = {
    "zero2": (2, MAMBA, None),
    "zero2-tiles": (2, MAMBA + TILED, "zero2"),
    "zero1-tiles": (1, MAMBA + TILED, "zero2"),
    # packed rows, and attention blocks (DeepSpeed's checkpoint) between tiled Mamba2 blocks
    "hybrid-packed-zero2": (2, HYBRID_PACKED, None),
    "hybrid-packed-zero2-tiles": (2, HYBRID_PACKED + TILED, "hybrid-packed-zero2"),
    # ZeRO-3 with every parameter released after each use (ZERO3_EVERY_USE): the tiled run's all-gathers counted
    "zero3": (3, MAMBA, None),
    "zero3-tiles": (3, MAMBA + TILED, "zero3"),
}
# the count's negative control: the tiled blocks' parameters gathered without the mark that keeps ZeRO's per-module
# release from partitioning them (tiled_block.gathered), 2 steps
UNHELD_STEPS = 2


def _unheld(params):
    """``tiled_block.gathered`` without its mark in ``ds_active_sub_modules``: one all-gather on entry, then ZeRO's
    module hooks release and fetch the parameters around every module call, tile by tile."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters([p for p in params if hasattr(p, "ds_id")])


def _ds_cases(rank, world):
    from ds_mamba_spcp import memory
    from tests.conftest import ZERO3_EVERY_USE, count_zero3_gathers

    train = load_train()
    out = {}

    def block_params(x, norm, mixer, *args, **kwargs):
        return tiled_block_module._block_params(norm, mixer)

    def run(stage, extra):
        args = train.parse_args(TINY + ["--activation-checkpointing", *extra])
        config = sgd_config("state_passing.json", stage)
        config["sequence_parallel_size"] = 1  # one rank: a group of one
        if stage == 3:
            config["zero_optimization"].update(ZERO3_EVERY_USE)
        if not (stage == 3 and TILED[0] in extra):
            return [r["loss"] for r in train.run_distributed(args, config)], None
        with count_zero3_gathers(memory, "tiled_block", block_params) as passes:  # Block.tiled's import of it
            return [r["loss"] for r in train.run_distributed(args, config)], passes

    for name, (stage, extra, _) in DS_CASES.items():
        out[name], out[f"{name}:gathers"] = run(stage, extra)
    original = tiled_block_module.gathered
    tiled_block_module.gathered = _unheld
    try:
        out["zero3-tiles-unheld"], out["zero3-tiles-unheld:gathers"] = run(3, MAMBA + TILED + ("--steps", "2"))
    finally:
        tiled_block_module.gathered = original
    return out


@pytest.fixture(scope="module")
def deepspeed_runs():
    return run_ranks(_ds_cases, 1, timeout=600)[0]


@pytest.mark.parametrize("name", [name for name, case in DS_CASES.items() if case[2] is not None])
def test_deepspeed_tiles_train_as_untiled(deepspeed_runs, name):
    ref, got = deepspeed_runs[DS_CASES[name][2]], deepspeed_runs[name]
    assert isinstance(got, list), got
    first, last = sum(ref[:5]) / 5, sum(ref[-5:]) / 5
    assert last < 0.95 * first, f"the untiled run did not learn (mean loss {first:.4f} -> {last:.4f}): a weak test"
    assert len(got) == len(ref) == STEPS
    err = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"{name}: max relative loss difference over {STEPS} steps {err:.2e}")
    assert err <= 1e-4, f"{name}: {got} vs untiled {ref}"


def test_zero3_gathers_a_tiled_block_once_per_pass(deepspeed_runs):
    """examples/train.py under ZeRO-3 with --block-tile-tokens (4 tiles a block, ZERO3_EVERY_USE): in each pass of
    a tiled block over its tiles (its forward, its backward: tiled_block.gathered, backward_gathered) every
    parameter of the block is all-gathered exactly once, 20 steps x 2 blocks x forward and backward, and its
    gradient handed to ZeRO once per backward pass (the losses match the untiled ZeRO-3 run:
    test_deepspeed_tiles_train_as_untiled). Negative control: gathered without its
    mark in ds_active_sub_modules, so that ZeRO's module hooks release and fetch the parameters tile by tile."""
    passes = deepspeed_runs["zero3-tiles:gathers"]
    assert len(passes) == STEPS * 2 * 2, passes
    assert sorted({kind for kind, _, _ in passes}) == ["backward", "forward"], passes
    assert all((fewest, most) == (1, 1) for _, fewest, most in passes), passes
    # every parameter's gradient handed to ZeRO once per backward pass (the pass's last differentiation)
    assert passes.handed == [(1, 1)] * STEPS * 2, passes.handed
    unheld = deepspeed_runs["zero3-tiles-unheld:gathers"]
    print(f"gathers per pass without the mark: {sorted(set(unheld))}")
    assert len(unheld) == UNHELD_STEPS * 2 * 2 and max(most for _, _, most in unheld) > 1, unheld
