"""``"long_context"`` (integrations/transformers/long_context.py) on transformers' six Mamba2 families, on CPU.

In one process (sequence_parallel_size 1, ``prepare_sequence_parallel``): tiny models of ``tests/hf_models.py``
whose rows of 30 tokens run in tiles of 7 (5 tiles, the last shorter, none a multiple of the chunk size 8). The
objective is ``sum(logits * w)`` for a fixed random ``w``. Compared: the objective and every parameter's gradient,
as relative errors, against the same op on whole layers (``tiled_layers`` off) and against transformers' own path.

fp32, not fp64: transformers' RMSNorms compute in fp32 and cast back (a downcast in an fp64 model), so the
gradient of a tile's halo rows, summed from two tiles after that cast instead of before it, rounds at the fp32
level whatever the dtype. Bound TOL = 5e-5: errors seen are 6.7e-7..4.9e-6 (the largest on a norm weight's and
A_log's gradients, long sums), the same size as those of the whole-layer op against transformers' own path
(7.2e-7..3.9e-6); a carried state or halo lost is off by 1e-2..1 (the negative controls).

The Trainer's runs (losses, grad_norms, updates against the same run without the key) are at the end.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import time
import warnings

import pytest
import torch

from tests import hf_models

hf_models.import_models()

from tests.conftest import ZERO3_EVERY_USE, count_zero3_gathers  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402

TOL = 5e-5
SEQ, TILE = 30, 7


def _section(**lc) -> dict:
    lc = {"tile_tokens": TILE, "fused_loss": False, **lc}
    return {"mamba_sequence_parallel": {"enabled": True, "long_context": lc}}


def _prepared(model, **lc):
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel

    model = copy.deepcopy(model)
    assert prepare_sequence_parallel(model, _section(**lc)) is None  # a group of one: no mpu
    return model


def _run(model, ids, w, **kw) -> dict:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False, **kw).logits
    objective = (logits * w).sum()
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"objective": objective.detach(), **grads}


def _worst(got: dict, ref: dict) -> tuple[float, str]:
    assert set(got) == set(ref), set(got) ^ set(ref)
    errs = {k: float((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref}
    key = max(errs, key=errs.get)
    return errs[key], key


def _inputs(batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf_models.VOCAB, (batch, SEQ), generator=g)
    w = torch.randn(batch, SEQ, hf_models.VOCAB, generator=g)
    return ids, w


@pytest.mark.parametrize("family", list(hf_models.MODULES))
def test_tiled_layers_match_whole_layers(family):
    """The key's tiled layers against the same op on whole layers, and against transformers' own path."""
    from ds_mamba_spcp.integrations.transformers.long_context import memory_report

    ref = hf_models.build(family, dtype=torch.float32)
    model, whole = _prepared(ref), _prepared(ref, tiled_layers=False)
    report = memory_report(model)
    # Falcon-H1's every layer has attention beside its mixer: checkpointed whole, its MLPs tiled
    assert report["layers_tiled"] >= (0 if family == "falcon_h1" else 1), report
    assert report["layers_tiled"] + report["layers_checkpointed"] >= 2, report
    ids, w = _inputs()
    got, want = _run(model, ids, w), _run(whole, ids, w)
    err, key = _worst(got, want)
    assert err < TOL, f"{family}: {key} is {err:.2e} off"
    err, key = _worst(got, _run(ref, ids, w))
    assert err < TOL, f"{family} against transformers: {key} is {err:.2e} off"


def test_moe_blocks_through_tiled_mlp():
    """Nemotron-H's MoE layer (a block of its own, checkpointed whole) through DeepSpeed's TiledMLP: routing is per
    token, so tiles change nothing but sums' order; rows of 2 (the MoE views its input: tiles made contiguous)."""
    import transformers as tf

    from ds_mamba_spcp.integrations.transformers.long_context import memory_report

    config = tf.NemotronHConfig(
        vocab_size=hf_models.VOCAB, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        intermediate_size=20, layers_block_type=["mamba", "moe", "mamba", "attention"], ssm_state_size=5,
        mamba_num_heads=8, mamba_head_dim=4, n_groups=2, conv_kernel=4, chunk_size=8, tie_word_embeddings=False,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=12,
        n_group=1, topk_group=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = tf.NemotronHForCausalLM(config)
    hf_models.randomize(base)
    model, whole = _prepared(base.train()), _prepared(base, tiled_layers=False, tiled_mlp=False)
    assert memory_report(model)["mlps_tiled"] == 2  # the MoE and its shared expert's MLP
    ids, w = _inputs()
    err, key = _worst(_run(model, ids, w), _run(whole, ids, w))
    assert err < TOL, f"{key} is {err:.2e} off"


def _mlp_grads(mlp, f, x, dout) -> list:
    xx = x.clone().requires_grad_()
    mlp.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward under autocast, the backward outside it
        y = f(xx)
    y.backward(dout.to(y.dtype))
    return [xx.grad] + [p.grad for p in mlp.parameters()]


def test_tiled_mlp_recomputes_under_the_forwards_autocast():
    """DeepSpeed's TiledMLP recomputes each tile in backward as it is called there, outside the loop's autocast:
    the wrapper re-enters the forward's settings. Against the graph of the same tiles under autocast (one row, so
    TiledMLP's forward and backward cut the same tiles): the input's gradient bitwise (seen without the fix: 5.5e-3
    off); the weights' within bf16's rounding (2**-8: the graph sums the tiles' bf16 gradients of the one cast
    weight in bf16, TiledMLP each tile's in fp32; seen 2.8e-3)."""
    import math

    from ds_mamba_spcp.integrations.transformers.long_context import _MLP

    mlp = hf_models.build("bamba").model.layers[0].feed_forward
    g = torch.Generator().manual_seed(0)
    x, dout = torch.randn(1, SEQ, hf_models.HIDDEN, generator=g), torch.randn(1, SEQ, hf_models.HIDDEN, generator=g)
    shards = math.ceil(SEQ / TILE)

    def graph_of_tiles(t):
        return torch.cat([type(mlp).forward(mlp, c) for c in torch.chunk(t, shards, dim=1)], dim=1)

    got, want = _mlp_grads(mlp, _MLP(mlp, TILE), x, dout), _mlp_grads(mlp, graph_of_tiles, x, dout)
    assert torch.equal(got[0], want[0]), float((got[0] - want[0]).norm() / want[0].norm())
    for a, b in zip(got[1:], want[1:]):
        assert float((a - b).norm() / b.norm()) < 2**-8


def test_tiled_mlp_refuses_random_draws():
    """TiledMLP replays no generator state, so an MLP with dropout would be recomputed with other masks: refused."""
    from ds_mamba_spcp.integrations.transformers.long_context import _MLP

    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    with pytest.raises(NotImplementedError, match="tiled_mlp"):
        _MLP(mlp, 2)(torch.randn(1, 6, 4, requires_grad=True))
    mlp.eval()  # no draws: plain forward
    _MLP(mlp, 2)(torch.randn(1, 6, 4, requires_grad=True))


def test_tiled_layer_with_another_gradient_input_runs_whole(monkeypatch):
    """A tiled layer differentiates its input, the carried state and its parameters only: called with another
    tensor that requires grad it runs whole (torch's checkpoint follows every input), never dropping that
    gradient silently."""
    from ds_mamba_spcp.integrations.transformers import long_context

    model = _prepared(hf_models.build("mamba2"))
    layer = model.backbone.layers[0]
    calls = []
    for name in ("_tiled", "_checkpointed"):
        original = getattr(long_context._Layer, name)
        monkeypatch.setattr(
            long_context._Layer, name, lambda self, *a, _o=original, _n=name: calls.append(_n) or _o(self, *a)
        )
    hidden = torch.randn(2, SEQ, hf_models.HIDDEN, requires_grad=True)
    layer(hidden).sum().backward()
    other = torch.randn(2, SEQ, hf_models.HIDDEN, requires_grad=True)
    layer(hidden, other_input=other).sum().backward()
    assert calls == ["_tiled", "_tiled", "_checkpointed"], calls


def _drop_state(monkeypatch):
    from ds_mamba_spcp.integrations.transformers import long_context

    init = long_context._TileCall.__init__
    monkeypatch.setattr(long_context._TileCall, "__init__", lambda self, tiles, k, S_in: init(self, tiles, k, None))


def _drop_halo(monkeypatch):
    tiled_block = importlib.import_module("ds_mamba_spcp.memory.tiled_block")
    halo_rows = tiled_block.Tiles.halo_rows
    monkeypatch.setattr(tiled_block.Tiles, "core", _core_without_halo(tiled_block.Tiles.core, halo_rows))


def _core_without_halo(core, halo_rows):
    def without(self, k, zx, mixer_core, S_in):
        n = halo_rows(self, k)
        return core(self, k, torch.cat([torch.zeros_like(zx[:, :n]), zx[:, n:]], dim=1), mixer_core, S_in)

    return without


@pytest.mark.parametrize("bug", [_drop_state, _drop_halo])
def test_negative_control_carry_lost(monkeypatch, bug):
    base = hf_models.build("bamba", dtype=torch.float32)
    ref, model = _prepared(base, tiled_layers=False), _prepared(base)
    ids, w = _inputs()
    want = _run(ref, ids, w)
    bug(monkeypatch)
    err, key = _worst(_run(model, ids, w), want)
    assert err > 1e-3, f"{bug.__name__}: the tiles still match ({key} {err:.2e})"


@pytest.mark.parametrize("family", ["bamba", "nemotron_h"])
def test_packed_rows_in_tiles(family):
    """Packed rows (seq_idx in the call): documents of 9, 4, 11 and 6 tokens cut by the tiles of 7 anywhere
    (one begins on a tile's first token, one ends inside a tile's halo rows). transformers' own path ignores
    seq_idx, so the reference is the op on whole layers (``tiled_layers`` off), which keeps documents apart."""
    base = hf_models.build(family, dtype=torch.float32)
    whole = _prepared(base, tiled_layers=False)
    tiled = _prepared(base)
    ids, w = _inputs()
    seq_idx = torch.tensor([0] * 9 + [1] * 4 + [2] * 11 + [3] * 6, dtype=torch.int32).expand(2, SEQ).contiguous()
    err, key = _worst(_run(tiled, ids, w, seq_idx=seq_idx), _run(whole, ids, w, seq_idx=seq_idx))
    assert err < TOL, f"{key} is {err:.2e} off"
    # the documents matter: the same rows unpacked differ at O(1)
    unpacked, _ = _worst(_run(tiled, ids, w), _run(whole, ids, w, seq_idx=seq_idx))
    assert unpacked > 1e-3


def test_right_padding_in_tiles():
    """Right-padded rows (the Trainer's and TRL's collators pad on the right; refused inside tiled layers before):
    row 0 padded from position 17 (inside the third tile), row 1 from 21 (a tile's first token). Against
    transformers' own path with the same mask: the objective over every position, the padded ones included
    (transformers zeroes a padded position's mixer input and conv output: out_proj(0) there), and every gradient."""
    ref = hf_models.build("bamba", dtype=torch.float32)  # tiled Mamba2 layers and attention layers with the mask
    model = _prepared(ref)
    ids, w = _inputs()
    mask = torch.ones_like(ids)
    mask[0, 17:] = 0
    mask[1, 21:] = 0
    want = _run(ref, ids, w, attention_mask=mask)
    err, key = _worst(_run(model, ids, w, attention_mask=mask), want)
    assert err < TOL, f"{key} is {err:.2e} off"
    # the mask matters: the rows run unmasked are off at O(1) (the padded positions)
    unmasked, _ = _worst(_run(model, ids, w), want)
    assert unmasked > 1e-3, unmasked


def test_offloaded_checkpoints():
    """Every layer checkpoint through the offloader (budget 0: all but the newest to host memory, plain copies on
    CPU), planned and checked before the pass: the same numbers."""
    from ds_mamba_spcp.integrations.transformers.long_context import memory_report

    ref = _prepared(hf_models.build("bamba", dtype=torch.float32), tiled_layers=False)
    model = _prepared(hf_models.build("bamba", dtype=torch.float32), offload_gpu_budget_gib=0)
    ids, w = _inputs()
    err, key = _worst(_run(model, ids, w), _run(ref, ids, w))
    assert err < TOL, f"{key} is {err:.2e} off"
    report = memory_report(model)
    layers = report["layers_tiled"] + report["layers_checkpointed"]
    assert report["checkpoints_on_host"] == layers - 1, report  # the newest stays
    assert report["offload_offloaded"] == layers - 1 and report["offload_saved"] == layers, report


def _largest_mlp_call(model, ids) -> int:
    """The most tokens one call of an MLP's own forward saw in a training pass (forward and backward)."""
    from ds_mamba_spcp.integrations.transformers.long_context import _STATE_ATTR

    seen = [0]
    for mlp in model.__dict__[_STATE_ATTR].mlps:

        def spy(module, x, *a, _raw=mlp.raw, **kw):
            seen[0] = max(seen[0], x.shape[:-1].numel())
            return _raw(module, x, *a, **kw)

        mlp.raw = spy
    model(input_ids=ids, use_cache=False).logits.float().sum().backward()
    return seen[0]


def test_offloaded_checkpoints_tile_the_mlps():
    """The offloading checkpoint runs its layers' forward under no_grad: the MLPs there are tiled too (before, the
    whole (batch x seqlen) went through each MLP at once: 128 tokens here). Falcon-H1 (every layer checkpointed
    whole, its MLPs tiled), rows 2 x 64, tiles of 7 tokens: TiledMLP cuts 64 into ceil(128 / 7) = 19 shards of
    at most 4 positions, 8 tokens a call, with the offload and without it."""
    base = hf_models.build("falcon_h1", dtype=torch.float32)
    ids = torch.randint(0, hf_models.VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    plain = _largest_mlp_call(_prepared(base), ids)
    offloaded = _largest_mlp_call(_prepared(base, offload_gpu_budget_gib=0), ids)
    assert plain == offloaded == 8, (plain, offloaded)


def test_outside_training_the_model_is_unchanged():
    ref = hf_models.build("zamba2", dtype=torch.float32)
    model = _prepared(ref).eval()
    ids, _ = _inputs()
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref.eval()(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # generation keeps transformers' cache path
        a = model.generate(input_ids=ids[:1, :6], max_new_tokens=3, do_sample=False)
        b = ref.generate(input_ids=ids[:1, :6], max_new_tokens=3, do_sample=False)
    assert torch.equal(a, b)


def test_delta_layers_recomputed_whole(monkeypatch):
    """A Gated DeltaNet family under the key (Qwen3.5, tests/test_accelerate.py's DELTA_MODEL): at the defaults no
    layer is tiled, each decoder layer is checkpointed whole (its delta layer on this package's op), the MLPs run in
    tiles, said once in a warning; the objective and every gradient against transformers' own path within TOL
    (measured 4.9e-6). ``"tiled_layers": true`` set on it (no Mamba2 layer to tile) is refused by name. At 2f6f4b8
    the key was refused on every delta family ("holds no Mamba2 mixer", "covers the Mamba2 mixers only")."""
    from ds_mamba_spcp.integrations.transformers.long_context import memory_report

    ref = hf_models.build("qwen3_5", **_acc().DELTA_MODEL)
    with pytest.warns(UserWarning, match=r"2 decoder layer\(s\) of Qwen3_5ForCausalLM hold a Gated DeltaNet layer"):
        model = _prepared(ref)
    report = memory_report(model)
    assert (report["layers_tiled"], report["layers_checkpointed"], report["mlps_tiled"]) == (0, 3, 3), report
    ids, w = _inputs()
    err, worst = _worst(_run(model, ids, w), _run(ref, ids, w))
    assert err <= TOL, (err, worst)
    with pytest.raises(
        NotImplementedError, match=r'\{"tiled_layers": true\} is set but Qwen3_5ForCausalLM has no Mamba2'
    ):
        _prepared(ref, tiled_layers=True)
    with warnings.catch_warnings(record=True) as said:  # off: nothing to say
        warnings.simplefilter("always")
        _prepared(ref, tiled_layers=False)
    assert not [w for w in said if "Gated DeltaNet" in str(w.message)], [str(w.message) for w in said]
    # Qwen3-Next's MoE blocks (Qwen3NextSparseMoeBlock, not matched before: only their shared expert was, which sees
    # 2-D rows, so nothing was tiled) through TiledMLP, against the same key without tiled MLPs (sums' order only)
    moe = hf_models.build("qwen3_next", **_acc().DELTA_MODEL)
    tiled, whole = _prepared(moe), _prepared(moe, tiled_mlp=False)
    assert memory_report(tiled)["mlps_tiled"] == 6, memory_report(tiled)  # 3 MoE blocks and their shared experts
    from ds_mamba_spcp.integrations.transformers import long_context as lc

    calls, call = [], lc._MLP.__call__
    monkeypatch.setattr(lc._MLP, "__call__", lambda self, *a, **k: calls.append(self.module) or call(self, *a, **k))
    got = _run(tiled, ids, w)
    blocks = sum(type(m).__name__ == "Qwen3NextSparseMoeBlock" for m in calls)
    assert blocks == 6, [type(m).__name__ for m in calls]  # 3 blocks, in forward and in the layers' recompute
    err, worst = _worst(got, _run(whole, ids, w))
    assert err <= TOL, (err, worst)


def test_refusals():
    from ds_mamba_spcp.config import load_mamba_sp_config
    from ds_mamba_spcp.integrations.transformers import long_context, prepare_sequence_parallel, wrap_hf_mamba2_mixers

    cfg = load_mamba_sp_config(_section())
    model = hf_models.build("bamba")
    wrap_hf_mamba2_mixers(model, None, cfg)
    # Falcon-H1 has no layer to tile (attention beside every mixer): nothing to refuse at two ranks
    falcon = hf_models.build("falcon_h1")
    wrap_hf_mamba2_mixers(falcon, None, cfg)
    assert long_context.install(falcon, cfg)
    with pytest.raises(ValueError, match='enabled" is false'):
        prepare_sequence_parallel(model, {"mamba_sequence_parallel": {"long_context": True}})
    with pytest.raises(ValueError, match="unknown key"):
        load_mamba_sp_config({"mamba_sequence_parallel": {"long_context": {"tiles": 4}}})
    # left padding or a hole inside a tiled layer: refused by name, never silently ignored (right padding runs)
    padded = _prepared(hf_models.build("mamba2"))
    ids, _ = _inputs()
    for zeros in (slice(0, 3), slice(10, 12)):
        mask = torch.ones_like(ids)
        mask[0, zeros] = 0
        with pytest.raises(NotImplementedError, match="zero before a kept token .* inside a tiled decoder layer"):
            padded(input_ids=ids, attention_mask=mask).logits.sum().backward()


# ---------------------------------------------------------------------------------------------------
# GraniteMoeHybrid's router load-balancing loss (integrations/transformers/router_loss.py)
# ---------------------------------------------------------------------------------------------------

# 4 experts, 2 per token; a coefficient of 0.5 (TRL's default is 1e-3) so that the router loss's share of every
# gradient stands far above the bound
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5, num_local_experts=4, num_experts_per_tok=2)


def _router_run(model, ids, mask=None) -> dict:
    """The model's loss (cross-entropy + coef x aux) backpropagated: aux_loss, the loss, every gradient. ``mask``:
    right padding (its zeros' labels -100)."""
    model.zero_grad(set_to_none=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"aux": out.aux_loss.detach().reshape(1), "loss": out.loss.detach().reshape(1), **grads}


def test_router_loss_matches_transformers(monkeypatch):
    """The router loss under the key against transformers' own path (no key): aux_loss, the model's loss and every
    parameter's gradient. ``defaults``: tiled layers (the MoE inside them, halo rows through the router), the
    offloading checkpoint for the attention layer, TiledMLP there, the fused loss; ``whole_layers``: tiled_layers
    off. Bound TOL (module docstring): the sums are reordered only. Before router_loss.py (b97e3d3): aux 2.006111
    against 2.010620 (halo rows counted), the routers' gradients 0.09..0.32 off (the router loss's share lost);
    with whole layers the value right, the gradients as far off. Negative control: the same gradient lost here
    (the recompute's addition dropped) is as far off."""
    from ds_mamba_spcp.integrations.transformers import router_loss

    base = hf_models.build("granitemoehybrid", dtype=torch.float32, **ROUTER)
    ids = _inputs()[0][:, :16]  # tiles of 7, 7 and 2 tokens: the halo rows of two
    want = _router_run(base, ids)
    settings = {"defaults": {"fused_loss": True, "offload_gpu_budget_gib": 0}, "whole_layers": {"tiled_layers": False}}
    models = {}
    for parts, lc in settings.items():
        models[parts] = _prepared(base, **lc)
        err, key = _worst(_router_run(models[parts], ids), want)
        assert err < TOL, f"{parts}: {key} is {err:.2e} off"
    backward = router_loss._Inject.backward

    def dropped(ctx, dweights):
        *rest, dlogits = backward(ctx, dweights)
        return (*rest, torch.zeros_like(dlogits))

    monkeypatch.setattr(router_loss._Inject, "backward", staticmethod(dropped))
    got = _router_run(models["defaults"], ids)
    errs = [float((got[k] - want[k]).norm() / want[k].norm()) for k in want if k.endswith("router.weight")]
    assert len(errs) == 3 and min(errs) > 1e-2, errs


def test_router_loss_with_right_padding(monkeypatch):
    """Right-padded rows of two lengths (13 and 9 of 16; TRL pads so with packing=False): transformers leaves the
    rows of mask 0 out of C, P and R, and out of the gradient. The key's defaults (the padded rows in the last two
    tiles, TiledMLP's tiles in the attention layer, the offloading checkpoint) and whole layers against
    transformers' own path with the mask: aux_loss, the loss, every gradient, bound TOL (module docstring: sums
    reordered only). Before (d520ed5): refused ("a padding mask with zeros"). Negative control: the router loss
    blind to the mask (the padded rows counted, as the call without its mask at sequence_parallel_size 2 did
    before): aux 8.2e-4 off, the routers' gradients 0.14..0.26."""
    from ds_mamba_spcp.integrations.transformers import router_loss

    base = hf_models.build("granitemoehybrid", dtype=torch.float32, **ROUTER)
    ids = _inputs()[0][:, :16]
    mask = torch.ones_like(ids)
    mask[0, 13:] = 0
    mask[1, 9:] = 0
    want = _router_run(base, ids, mask)
    settings = {"defaults": {"fused_loss": True, "offload_gpu_budget_gib": 0}, "whole_layers": {"tiled_layers": False}}
    for parts, lc in settings.items():
        model = _prepared(base, **lc)
        err, key = _worst(_router_run(model, ids, mask), want)
        print(f"right padding, {parts}: the worst is {key}, {err:.1e} off")
        assert err < TOL, f"{parts}: {key} is {err:.2e} off"

    class Unmasked(router_loss._Pass):  # the negative control: the router loss never sees the mask
        mask = property(lambda self: None, lambda self, value: None)

    monkeypatch.setattr(router_loss, "_Pass", Unmasked)
    got = _router_run(model, ids, mask)
    errs = {k: float((got[k] - want[k]).norm() / want[k].norm()) for k in want if k == "aux" or "router" in k}
    print(f"the padded rows counted: {errs}")
    assert len(errs) == 4 and min(errs.values()) > 10 * TOL, errs


def test_router_loss_refusals():
    """A padding mask that is not the input's (batch, seqlen) (transformers' router loss flattens it against the
    rows) and the losses of two training forwards backpropagated together (the recomputes could not tell the two
    apart): refused by name."""
    model = _prepared(hf_models.build("granitemoehybrid", dtype=torch.float32, **ROUTER), fused_loss=True)
    ids = _inputs()[0][:, :16]
    mask = torch.ones_like(ids)[:, None, None, :].float()
    mask[1, ..., -2:] = 0
    with pytest.raises(NotImplementedError, match="a padding mask of shape"):
        model(input_ids=ids, labels=ids, attention_mask=mask)
    first, second = model(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="backpropagated together"):
        (first + second).backward()


# ---------------------------------------------------------------------------------------------------
# through the Trainer (enable()): the same run with the key and without it
# ---------------------------------------------------------------------------------------------------

# family -> (ZeRO stage, the key's settings) at sp_size 1. Tiles of 7 tokens cut the rows of 18..28 tokens; the
# offload budget 0 sends every layer checkpoint but the newest through the offloader. ZeRO-3 refuses tiled layers:
# there the other parts run (whole-layer checkpoints, TiledMLP, the loss).
LC = {"tile_tokens": 7, "loss_tile_tokens": 5}
ONE = {
    "bamba": (2, {**LC, "offload_gpu_budget_gib": 0}),
    "granitemoehybrid": (2, LC),
    "nemotron_h": (1, LC),
    "zamba2": (3, {**LC, "tiled_layers": False}),
    "falcon_h1": (3, {**LC, "offload_gpu_budget_gib": 0}),
}
# at sp_size 2 the key at its defaults: tiled layers on each rank's shard, their state from the exchange
# (tiled_block.ShardTiledFn), under ZeRO-3 too (a layer's parameters gathered once per pass, its gradients handed
# to ZeRO once); Falcon-H1 has no layer to tile (attention beside every mixer). "<family>_zero3": that family again
TWO = {"bamba": (2, LC), "bamba_zero3": (3, LC), "granitemoehybrid": (2, LC), "falcon_h1": (3, LC)}
# "bamba_zero3": ZERO3_EVERY_USE (tests/conftest.py), every use of a parameter one all-gather that _count_gathers sees
# GraniteMoeHybrid trains with its router loss on (ROUTER), at one process and at two ranks: 3 steps (its runs with
# the key cost 3x those without) at a learning rate of 0.02 (at 0.05 the router loss's coefficient of 0.5 makes
# the steps amplify rounding: grad_norm 3.5e-7 off at step 1 between runs that differ by the order of sums,
# 5.7e-5 at step 5; at 0.02 <= 3.6e-5 over 5 steps)
ROUTER_RUN = {"learning_rate": 0.02, "max_steps": 3}
# the Gated DeltaNet families under the key: no layer tiled (their decoder layers are recomputed whole, the MLPs /
# MoE blocks tiled, the fused loss): Qwen3.5 at sp_size 1 and 2 (ZeRO-2), Qwen3-Next at 2 (ZeRO-3), each against the
# same family without the key in one process (tests/test_accelerate.py has the delta families at sp_size 2 against
# one process), with tests/test_accelerate.py's settings for them (DELTA_MODEL, DELTA_TRAIN: the tiny delta models
# meet its bound only so). family -> (ZeRO stage, the key). Qwen3-Next at ZeRO-3 without tiled MLPs: DeepSpeed's
# TiledMLP on its MoE blocks gathers the experts at every tile's call, which on 2 gloo ranks took that run from ~6 s
# to 21.6 s (tiles of 14); the MoE blocks in tiles are checked in one process (test_delta_layers_recomputed_whole),
# TiledMLP under ZeRO-3 by "bamba_zero3"
DELTA = {"qwen3_5": (2, LC), "qwen3_next": (3, {**LC, "tiled_mlp": False})}


def _acc():
    return importlib.import_module("tests.test_accelerate")


def _right_padded(rows):
    """``crop_collate``'s rows of 18..28 tokens, right-padded to two lengths (2 and 5 tokens of padding: mask 0,
    labels -100), as TRL pads rows with packing=False."""
    batch = _acc().crop_collate(rows)
    mask = torch.ones_like(batch["input_ids"])
    for row, pad in enumerate((2, 5)[: len(mask)]):
        mask[row, -pad:] = 0
    batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return {**batch, "attention_mask": mask}


def _router_padded(world: int, out: str) -> dict:
    """GraniteMoeHybrid with its router loss (ROUTER) on ``_right_padded`` rows: the Trainer, ZeRO-2, no key."""
    model = hf_models.build("granitemoehybrid", **ROUTER)
    return _acc()._train("granitemoehybrid", 2, world, out, _right_padded, model=model, evaluate=False, **ROUTER_RUN)


def _count_calls() -> dict:
    """Counts, per kind, the training calls of the key's parts in this process (which parts a run went through)."""
    from ds_mamba_spcp.integrations.transformers import long_context as lc

    calls: dict = {}
    for owner, name in ((lc._Layer, "_tiled"), (lc._Layer, "_checkpointed"), (lc._MLP, "__call__")):
        original = getattr(owner, name)

        def spy(self, *a, _original=original, _name=f"{owner.__name__}.{name}", **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *a, **kw)

        setattr(owner, name, spy)
    return calls


def _count_gathers():
    """Under ZeRO-3, per pass of a tiled layer over its tiles (its forward, ``_Layer._tiled``; its backward,
    ``tiled_block.backward_gathered``): ("forward" / "backward", the fewest and the most all-gathers of any of the
    layer's parameters in it): tests/conftest.py, ``count_zero3_gathers``."""
    from ds_mamba_spcp.integrations.transformers import long_context as lc

    return count_zero3_gathers(lc._Layer, "_tiled", lambda self, *a: self.params())


SFT_ROWS = [31, 27, 29, 25] * 2  # odd lengths: at two ranks each row gets one padded token


def _sft(world: int, out: str, section) -> dict:
    """TRL's SFTTrainer on Bamba (ZeRO-2, 3 steps, one unpacked row of odd length per step; at two ranks padded to
    an even length, the tail ignored): per step (loss, grad_norm) and TRL's (entropy, mean_token_accuracy), every
    parameter's update. Rows of 25..31 tokens: enough that the random model's top-1 hits some labels (a
    mean_token_accuracy of 0 at every step would compare nothing)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    acc = _acc()
    g = torch.Generator().manual_seed(6)
    docs = [torch.randint(3, hf_models.VOCAB, (n,), generator=g).tolist() for n in SFT_ROWS]
    model = hf_models.build("bamba")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = acc.training_args(
        out, 2, world, section=section, cls=SFTConfig, per_device_train_batch_size=1, packing=False, max_length=32,
        pad_to_multiple_of=2 if world > 1 else None, max_steps=3,
    )  # fmt: skip
    data = Dataset.from_dict({"input_ids": docs})
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=acc._tokenizer())
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return {
        "logs": [(h["loss"], h["grad_norm"]) for h in steps],
        "metrics": [(h["entropy"], h["mean_token_accuracy"]) for h in steps],
        "update": acc._updates(before, acc._params(trainer)),
    }


def _lora(world: int, out: str, section) -> dict:
    """transformers' Trainer on Bamba wrapped by PEFT's LoRA at PEFT's defaults (B = 0: the adapters change the
    loss from step 2 on) on in_proj and the attention projections, 3 steps. (With B at random, the 3 steps amplify
    fp32 rounding: grad_norm 3e-5 and updates 4.5e-5 apart with the key and without, 1.8e-6 at PEFT's init; the
    random-B forward and gradients are checked in tests/test_logits_loss.py, test_peft_lora_gets_the_fused_loss.)"""
    import peft

    model = hf_models.build("bamba")
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["in_proj", "q_proj", "v_proj"]))
    return _acc()._train("bamba", 2, world, out, model=model, section=section, evaluate=False, max_steps=3)


def _offload_with_data_parallelism(rank: int) -> dict:
    """Two data-parallel ranks (sp_size 1 each), every layer checkpoint offloaded, rows of other lengths on each
    rank: the longest batch grows on one rank only at steps 2 and 4. After each step every rank enters one
    all-reduce of another size than the host check's: a rank that entered one collective more (the host check
    alone, before the fix) pairs it with this one and gloo raises (NCCL would hang)."""
    from ds_mamba_spcp.integrations.transformers.long_context import _STATE_ATTR
    from ds_mamba_spcp.memory import offload

    model = _prepared(hf_models.build("bamba", dtype=torch.float32), offload_gpu_budget_gib=0).train()
    g = torch.Generator().manual_seed(rank)
    planned = []
    for n in ([14, 8, 21, 7], [8, 15, 10, 24])[rank]:
        ids = torch.randint(0, hf_models.VOCAB, (2, n), generator=g)
        model(input_ids=ids, use_cache=False).logits.sum().backward()
        torch.distributed.all_reduce(torch.zeros(3, dtype=torch.float64))
        planned.append(model.__dict__[_STATE_ATTR].planned)
    t0 = time.perf_counter()
    for _ in range(200):  # the cost of the all-reduce every training call adds (one integer)
        offload.group_max([rank])
    return {"planned": planned, "group_max_s": (time.perf_counter() - t0) / 200}


def _delta_run(fam: str, world: int, out: str, section) -> dict:
    acc = _acc()
    model = hf_models.build(fam, **acc.DELTA_MODEL)
    return acc._train(fam, DELTA[fam][0], world, out, model=model, section=section, evaluate=False, **acc.DELTA_TRAIN)


@contextlib.contextmanager
def _delta_recompute_alone():
    """The negative control's bug: a decoder layer's recompute in backward runs its Gated DeltaNet layer with the
    state entering the rank's shard dropped (zeros, still in the graph), its forward right: the recompute's saved
    tensors, and so the gradients, are not the forward's."""
    from torch.utils.checkpoint import checkpoint

    from ds_mamba_spcp.engine.strategies import delta as strategy
    from ds_mamba_spcp.integrations.transformers import long_context as lc

    whole, exchange_fn = lc._Layer._checkpointed, strategy._ExchangeFn

    class Dropped:
        @staticmethod
        def apply(*args):
            S_in, final = exchange_fn.apply(*args)
            return S_in * 0, final

    def recompute_alone(self, hidden, args, kwargs):
        calls = []

        def fn(x):
            calls.append(None)
            strategy._ExchangeFn = Dropped if len(calls) > 1 else exchange_fn
            try:
                return self.hidden_of(self.raw(self.module, x, *args, **kwargs))
            finally:
                strategy._ExchangeFn = exchange_fn

        return self.rebuild(checkpoint(fn, hidden, use_reentrant=False))

    lc._Layer._checkpointed = recompute_alone
    try:
        yield
    finally:
        lc._Layer._checkpointed = whole


def _trainer_runs(rank, world, tmp):
    from transformers import default_data_collator

    from ds_mamba_spcp.integrations.transformers import accelerate as mamba_sp

    acc = _acc()
    t0 = time.perf_counter()
    dp = _offload_with_data_parallelism(rank) if world > 1 else None
    mamba_sp.enable()
    calls = _count_calls()
    cases = ONE if world == 1 else TWO
    out = {"dp_offload": dp}
    for fam, (stage, lc) in cases.items():
        for key, section in (("off", None), ("on", {"long_context": lc})):
            path = os.path.join(tmp, f"{fam}_{key}")
            calls.clear()
            family = fam.removesuffix("_zero3")
            kw = {"model": hf_models.build(family, **ROUTER), **ROUTER_RUN} if family == "granitemoehybrid" else {}
            if fam != family:
                kw.update(max_steps=3, zero=ZERO3_EVERY_USE)  # ZeRO-3's tiled layers are the slow runs (CPU gloo)
            counting = _count_gathers() if fam == "bamba_zero3" and key == "on" else contextlib.nullcontext([])
            with counting as passes:
                out[f"{fam}_{key}"] = acc._train(family, stage, world, path, section=section, evaluate=fam == "bamba",
                                                 **kw)  # fmt: skip
            out[f"{fam}_{key}"]["gathers"] = passes
            out[f"{fam}_{key}"]["calls"] = dict(calls)
    t1 = time.perf_counter()
    for fam in DELTA if world > 1 else ["qwen3_5"]:  # with the key (one process: Qwen3.5 only)
        calls.clear()
        out[f"delta_{fam}_on"] = acc._attempt(_delta_run, fam, world, os.path.join(tmp, f"delta_{fam}"),
                                              {"long_context": DELTA[fam][1]})  # fmt: skip
        out[f"delta_{fam}_on"]["calls"] = dict(calls)
    if world == 1:  # the references, without the key
        for fam in DELTA:
            out[f"delta_{fam}_off"] = acc._attempt(_delta_run, fam, 1, os.path.join(tmp, f"delta_{fam}_off"), None)
    else:  # the negative control
        with _delta_recompute_alone():
            out["delta_bug"] = acc._attempt(_delta_run, "qwen3_5", world, os.path.join(tmp, "delta_bug"),
                                            {"long_context": LC})  # fmt: skip
    out["delta_s"] = time.perf_counter() - t1
    # the router loss with right-padded rows: one process without the key is transformers' own (the mask weights
    # the router rows); at two ranks the call drops the mask (accelerate.py) and hands it to the router loss
    t1 = time.perf_counter()
    out["router_padded"] = acc._attempt(_router_padded, world, os.path.join(tmp, "router_padded"))
    out["router_padded_s"] = time.perf_counter() - t1
    for key, section in (("off", None), ("on", {"long_context": LC})):
        model = hf_models.build("mamba2")
        out[f"packed_{key}"] = acc._train(
            "mamba2", 2, world, os.path.join(tmp, f"packed_{key}"), default_data_collator, model=model,
            dataset=acc._packed_rows(), evaluate=False, max_steps=3, section=section,
        )  # fmt: skip
    # TRL's SFTTrainer and PEFT with the key at its defaults (tiled layers on each rank's shard at two ranks); their
    # references are the runs without the package's key in one process
    keys = {"on": {"long_context": True}}
    if world == 1:
        keys["off"] = None
    for key, section in keys.items():
        out[f"sft_{key}"] = acc._attempt(_sft, world, os.path.join(tmp, f"sft_{key}"), section)
        if world == 1:
            out[f"lora_{key}"] = acc._attempt(_lora, world, os.path.join(tmp, f"lora_{key}"), section)
    out["seconds"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    one = run_ranks(_trainer_runs, 1, str(tmp_path_factory.mktemp("one")), timeout=600)[0]
    two = run_ranks(_trainer_runs, 2, str(tmp_path_factory.mktemp("two")), timeout=600)
    print(f"\nlong_context Trainer runs: one process {one['seconds']:.0f} s, two ranks {two[0]['seconds']:.0f} s")
    return one, two


@pytest.mark.parametrize("case", [f"1:{f}" for f in ONE] + [f"2:{f}" for f in TWO] + ["1:packed", "2:packed"])
def test_trainer_with_the_key_matches_without(trainer_runs, case):
    """Per-step loss and grad_norm, every parameter's update: the Trainer tests' bound (tests/test_accelerate.py,
    TOL 1e-4: the runs differ by the order of sums only; a lost state or a doubled gradient is off by 1e-2..1).
    With the key the model leaves the Trainer's evaluation and generate as they were: Bamba's eval loss and greedy
    tokens after training too."""
    acc = _acc()
    sp, fam = case.split(":")
    runs = trainer_runs[0] if sp == "1" else trainer_runs[1][0]
    on, off = runs[f"{fam}_on"], runs[f"{fam}_off"]
    if fam != "packed":  # the parts ran: tiled layers where the settings and the family allow, the rest whole
        tiled = on["calls"].get("_Layer._tiled", 0)
        assert (tiled > 0) == (fam not in ("zamba2", "falcon_h1")), on["calls"]
        assert on["calls"].get("_Layer._checkpointed", 0) > 0 and on["calls"].get("_MLP.__call__", 0) > 0, on["calls"]
        assert off["calls"] == {}, off["calls"]
    errs = acc._errors(on, off)
    assert max(errs["loss"], errs["grad_norm"], errs["update"]) < acc.TOL, errs
    if fam == "bamba":  # evaluated (unsharded, whole rows) and generated from after training, both runs
        assert abs(on["eval_loss"] - off["eval_loss"]) / abs(off["eval_loss"]) < acc.TOL
        assert on["generated"] == off["generated"]


@pytest.mark.parametrize("case", ["1:sft", "2:sft", "1:lora"])
def test_trl_and_peft_with_the_key_match_without(trainer_runs, case):
    """TRL's SFTTrainer with the key at its defaults (the fused loss on) crashed in TRL's own fused head
    (TypeError: 'NoneType' object is not subscriptable, one rank or two); a PEFT (LoRA) model was refused by the
    fused loss ("not peft.peft_model.PeftModel"). Now both train as without the key in one process: per-step loss,
    grad_norm and every parameter's update within the Trainer tests' bound (tests/test_accelerate.py, TOL 1e-4),
    and TRL's entropy (same bound) and mean_token_accuracy (a ratio of counts: equal up to its rounding) too."""
    acc = _acc()
    sp, what = case.split(":")
    one = trainer_runs[0]
    runs = [one] if sp == "1" else trainer_runs[1]
    off = one[f"{what}_off"]
    assert "error" not in off, off["error"]
    for run in runs:
        on = run[f"{what}_on"]
        assert "error" not in on, on["error"]
        errs = acc._errors(on, off)
        print(f"{case} with the key against without it in one process: {errs}")
        assert max(errs["loss"], errs["grad_norm"], errs["update"]) < acc.TOL, errs
        if what == "sft":
            assert len(on["metrics"]) == len(off["metrics"]) == 3
            assert any(accuracy > 0 for _, accuracy in off["metrics"]), off["metrics"]  # something to compare
            for (entropy, accuracy), (want_entropy, want_accuracy) in zip(on["metrics"], off["metrics"]):
                assert abs(entropy - want_entropy) <= acc.TOL * abs(want_entropy), (on["metrics"], off["metrics"])
                assert abs(accuracy - want_accuracy) <= 1e-6, (on["metrics"], off["metrics"])


def test_zero3_gathers_a_tiled_layer_once_per_pass(trainer_runs):
    """Bamba at sp_size 2 under ZeRO-3 with every parameter released after each use (ZERO3_EVERY_USE): in each pass
    of a tiled layer over its tiles (forward: halo, summaries, exchange, the tiles from the state; backward: both
    passes and the exchange) every parameter of the layer is all-gathered exactly once (tiled_block.gathered), on
    both ranks, 3 steps x 2 tiled layers x forward and backward. Negative control, run by hand (gathered replaced by
    a no-op in long_context.py and tiled_block.py): ZeRO's module hooks then gather per module call, per tile:
    4 gathers a forward pass and up to 8 a backward one (0 for parameters the state path does not reach), the losses
    unchanged."""
    for rank, run in enumerate(trainer_runs[1]):
        passes = run["bamba_zero3_on"]["gathers"]
        assert len(passes) == 3 * 2 * 2, passes
        assert sorted({kind for kind, _, _ in passes}) == ["backward", "forward"], passes
        assert all((fewest, most) == (1, 1) for _, fewest, most in passes), (rank, passes)


def test_offload_plans_alike_on_data_parallel_ranks(trainer_runs):
    """Every rank plans for the group's largest batch (2 x the longest row so far of either rank), and enters the
    same collectives (before the fix: gloo's "Received data size doesn't match expected size" at step 2)."""
    ranks = [r["dp_offload"] for r in trainer_runs[1]]
    assert ranks[0]["planned"] == ranks[1]["planned"] == [2 * 14, 2 * 15, 2 * 21, 2 * 24], ranks
    print(f"\nthe shape's all-reduce per training call (2 gloo ranks): {ranks[0]['group_max_s'] * 1e6:.0f} us")


def test_router_loss_at_two_ranks_matches_one_process(trainer_runs):
    """GraniteMoeHybrid with its router loss (ROUTER) at sp_size 2 (ZeRO-2), without the key and with it (its
    defaults: tiled layers on each shard), against one process without the key (transformers' own loss): per-step
    loss and grad_norm, every parameter's update, the Trainer tests' bound (tests/test_accelerate.py). Before
    router_loss.py (b97e3d3) the sp_size 2 runs were refused ("adds the router's load-balancing loss"). ``padded``:
    right-padded rows of two lengths (the Trainer, ZeRO-2, no key) against transformers in one process, which leaves
    the padded rows out of the router loss; before (d520ed5) the two ranks counted them (the call's mask dropped),
    silently: loss 3.1e-4, grad_norm 2.5e-3, a router's update 9.7e-2 off; now <= 9.1e-7."""
    acc = _acc()
    one = trainer_runs[0]["granitemoehybrid_off"]
    for key in ("off", "on"):
        errs = acc._errors(trainer_runs[1][0][f"granitemoehybrid_{key}"], one)
        assert max(errs["loss"], errs["grad_norm"], errs["update"]) < acc.TOL, (key, errs)
    one = trainer_runs[0]["router_padded"]
    assert "error" not in one, one["error"]
    for rank in trainer_runs[1]:
        two = rank["router_padded"]
        assert "error" not in two, two["error"]
        errs = acc._errors(two, one)
        print(f"right-padded rows with the router loss, two ranks against one process: {errs}")
        print(f"their runs: {trainer_runs[0]['router_padded_s']:.1f} s in one process, {rank['router_padded_s']:.1f} s")
        assert max(errs["loss"], errs["grad_norm"], errs["update"]) < acc.TOL, ("padded", errs)


@pytest.mark.parametrize("case", ["1:qwen3_5", "2:qwen3_5", "2:qwen3_next"])
def test_delta_families_with_the_key_match_without(trainer_runs, case):
    """The Gated DeltaNet families through the Trainer with the key (tile_tokens 7: the MLPs (Qwen3.5's) and the loss
    in tiles; no layer tiled, each decoder layer checkpointed whole, the delta layers on this package's op at
    sp_size 1 too) against the same family without the key in one process (DELTA: Qwen3.5 at ZeRO-2, Qwen3-Next
    at ZeRO-3): per-step loss and grad_norm, every update, the Trainer tests' bound (tests/test_accelerate.py, TOL
    1e-4). At 2f6f4b8 every such run was refused ("long_context ... covers the Mamba2 mixers only"). The negative
    control (Qwen3.5 at sp_size 2, the delta layers' recompute without the state entering the shard:
    _delta_recompute_alone) is off by > 100x TOL."""
    acc = _acc()
    sp, fam = case.split(":")
    off = trainer_runs[0][f"delta_{fam}_off"]
    assert "error" not in off, off["error"]
    runs = [trainer_runs[0]] if sp == "1" else trainer_runs[1]
    for rank, run in enumerate(runs):
        on = run[f"delta_{fam}_on"]
        assert "error" not in on, on["error"]
        calls = on["calls"]  # no layer tiled; the decoder layers checkpointed whole, the MLPs in tiles
        assert "_Layer._tiled" not in calls and calls.get("_Layer._checkpointed", 0) > 0, calls
        assert (calls.get("_MLP.__call__", 0) > 0) == DELTA[fam][1].get("tiled_mlp", True), calls
        errs = acc._errors(on, off)
        print(f"{case} rank {rank}, the key against without it in one process: {errs} ({run['delta_s']:.1f} s)")
        assert max(errs["loss"], errs["grad_norm"], errs["update"]) < acc.TOL, errs
        if sp == "2" and fam == "qwen3_5":
            assert "error" not in run["delta_bug"], run["delta_bug"]["error"]
            bug = acc._errors(run["delta_bug"], off)
            print(f"negative control (the delta layers' recompute without the incoming state) rank {rank}: {bug}")
            assert bug["update"] > 100 * acc.TOL, bug
