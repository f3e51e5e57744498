"""The tiled logits loss (ds_mamba_spcp/memory/logits_loss.py) and its install on transformers' six Mamba2 families
(ds_mamba_spcp/integrations/transformers/fused_loss.py), on the CPU.

Oracles. The op: ``F.cross_entropy`` on the full fp64 logits ``hidden @ weight.T`` with transformers' shift and
reductions (itself checked against transformers' ``ForCausalLMLoss``, which rounds the logits to fp32: within
1e-6). The installed model: the same model without the install (a deepcopy), transformers' own forward and loss.

Tolerances.
- The op in fp64 (``OP_TOL`` = 1e-12, relative; loss and relative RMS of each gradient): each logit is the same
  dot product as the oracle's, only the sums are reordered (the loss summed per tile then over tiles, the weight's
  gradient summed over tiles); reordering n terms moves a sum by <= n * 2^-53 of the sum of magnitudes (n <= 74
  tokens here: ~1e-14 unless terms cancel far beyond what random logits do); seen: <= 5e-16.
- The installed fp64 models (``MODEL_TOL`` = 1e-6 for the loss, ``GRAD_TOL`` = 1e-5 relative RMS per parameter
  gradient): both runs compute the same hidden states with the same ops; the oracle then rounds its logits to
  fp32 (transformers' ``logits.float()``) and computes the cross entropy and its gradient in fp32, ours stays in
  fp64 (Mamba2 and Nemotron-H round the hidden states to fp32 instead: their ``.float()`` on the head's output).
  So the losses differ by a few fp32 roundings (2^-24 = 6e-8 relative; seen <= 1.3e-7) and the gradients by
  the fp32 rounding of softmax - one_hot carried back through the layers (seen <= 4.5e-7). A head
  post-processing dropped (Falcon-H1's multiplier 0.6, GraniteMoeHybrid's scaling 2.5) moves the loss by > 1e-2
  (``test_post_processing_matters``: the negative control of these bounds).
- bf16 autocast (``test_autocast_recompute``): see there.

Negative control of the design: DeepSpeed's ``TiledFusedLogitsLoss`` computes the weight's gradient inside its
forward, so a scale applied to the loss afterwards (0.37 here: the Trainer's division by the accumulation steps, a
loss scale) reaches the hidden states' gradient only; ours scales both.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ds_mamba_spcp.memory.logits_loss import tiled_causal_lm_loss
from tests.dist_utils import rel_err, run_ranks
from tests.hf_models import DELTA_MODULES, MODULES, VOCAB, build

OP_TOL = 1e-12
MODEL_TOL = 1e-6
GRAD_TOL = 1e-5
SCALE = 0.37
B, S, D, V = 2, 37, 16, 50  # 74 tokens: tiles of 7 leave a last tile of 4


def _op_inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g, dtype=torch.float64) / 2).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[1, 3:11] = -100
    return hidden, weight, labels


def _oracle(hidden, weight, labels=None, shift_labels=None, num_items_in_batch=None, ignore_index=-100):
    """transformers' ForCausalLMLoss without its fp32 rounding: the full logits in the inputs' dtype."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = (hidden @ weight.T).reshape(-1, weight.shape[0])
    target = shift_labels.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, target, ignore_index=ignore_index)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


def _shift_labels(seed=1):
    g = torch.Generator().manual_seed(seed)
    shifted = torch.randint(0, V, (B, S), generator=g)
    shifted[0, :5] = -100
    return shifted


OP_CASES = {
    "labels": dict(tile_tokens=7),
    "shift_labels": dict(tile_tokens=7, shift_labels=_shift_labels()),  # wins over labels, as in transformers
    "num_items_tensor": dict(tile_tokens=7, num_items_in_batch=torch.tensor(90)),
    "num_items_int": dict(tile_tokens=9, num_items_in_batch=90),
    "ignored_tile": dict(tile_tokens=8, ignored=slice(16, 24)),  # flattened tokens 16..23: tile 2 whole
    "ignore_index": dict(tile_tokens=5, ignore_index=7),
    "one_tile": dict(tile_tokens=1000),
    "tile_of_one": dict(tile_tokens=1),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_op_matches_cross_entropy(case):
    kw = dict(OP_CASES[case])
    hidden, weight, labels = _op_inputs()
    ignored = kw.pop("ignored", None)
    if ignored is not None:
        flat = labels.reshape(-1)
        flat[ignored.start + 1 : ignored.stop + 1] = -100  # the labels of the next tokens: shifted onto the tile
    if "ignore_index" in kw:
        labels[labels == -100] = kw["ignore_index"]
    tile = kw.pop("tile_tokens")
    expected = _oracle(hidden, weight, labels, **kw)
    want = torch.autograd.grad(expected * SCALE, [hidden, weight])
    got = tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=tile, **kw)
    grads = torch.autograd.grad(got * SCALE, [hidden, weight])
    assert got.dtype == torch.float64
    assert abs(got.item() - expected.item()) <= OP_TOL * abs(expected.item())
    for g, w in zip(grads, want):
        assert rel_err(g, w) <= OP_TOL
    if ignored is not None:
        assert torch.all(grads[0].reshape(-1, D)[ignored] == 0)  # an ignored token's row gets no gradient
    # the oracle is transformers' loss: ForCausalLMLoss (fp32 logits) within fp32 rounding
    from transformers.loss.loss_utils import ForCausalLMLoss

    theirs = ForCausalLMLoss(hidden.detach() @ weight.detach().T, labels, V, **kw)
    assert abs(theirs.item() - expected.item()) <= 1e-6 * abs(expected.item())


def test_op_all_ignored():
    """No scored token: transformers' mean is 0/0 = nan with zero gradients; over num_items_in_batch, 0."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, _ = _op_inputs()
    labels = torch.full((B, S), -100)
    assert torch.isnan(ForCausalLMLoss(hidden @ weight.T, labels, V))  # what transformers gives
    loss = tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7)
    assert torch.isnan(loss)
    dh, dw = torch.autograd.grad(loss, [hidden, weight])
    assert torch.all(dh == 0) and torch.all(dw == 0)
    # the Trainer's sequence-parallel loss (integrations/transformers/accelerate.py) masks such a shard's mean with
    # where(): the incoming gradient is then 0/0 = nan, and the gradients must still be zero
    loss = tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7)
    scored = torch.tensor(0)
    masked = torch.where(scored > 0, loss * scored, torch.zeros_like(loss))
    dh, dw = torch.autograd.grad(masked, [hidden, weight])
    assert torch.all(dh == 0) and torch.all(dw == 0)
    loss = tiled_causal_lm_loss(hidden, weight, labels, num_items_in_batch=torch.tensor(3), tile_tokens=7)
    assert loss.item() == 0.0
    assert ForCausalLMLoss(hidden @ weight.T, labels, V, num_items_in_batch=torch.tensor(3)).item() == 0.0


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_op_one_input_without_grad(frozen):
    hidden, weight, labels = _op_inputs()
    (hidden if frozen == "hidden" else weight).requires_grad_(False)
    live = weight if frozen == "hidden" else hidden
    (want,) = torch.autograd.grad(_oracle(hidden, weight, labels), [live])
    (got,) = torch.autograd.grad(tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7), [live])
    assert rel_err(got, want) <= OP_TOL
    hidden.requires_grad_(False), weight.requires_grad_(False)
    assert not tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7).requires_grad


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_op_holds_one_tile_of_logits():
    """No op of the forward or the backward returns more than max(one tile of logits, the hidden states, the
    weight) elements; the untiled loss does (its logits: B*S*V = 3700 > 1184 = B*S*D)."""
    hidden, weight, labels = _op_inputs()
    bound = max(7 * V, B * S * D, V * D)
    with _Largest() as seen:
        tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7).backward()
    assert seen.numel <= bound
    with _Largest() as seen:
        _oracle(hidden, weight, labels).backward()
    assert seen.numel >= B * S * V > bound  # the negative control


def test_scale_reaches_both_grads_deepspeed_only_one():
    """A scale applied to the loss after the op reaches both gradients (ours); DeepSpeed's TiledFusedLogitsLoss
    accumulates the weight's gradient inside its forward and leaves it unscaled (the negative control)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    hidden, weight, labels = _op_inputs()
    dh, dw = torch.autograd.grad(_oracle(hidden, weight, labels), [hidden, weight])
    (tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7) * SCALE).backward()
    assert rel_err(hidden.grad, SCALE * dh) <= OP_TOL and rel_err(weight.grad, SCALE * dw) <= OP_TOL

    hidden.grad = weight.grad = None
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    count = (shifted != -100).sum()

    def shard_loss(head, x, y):  # one shard's share of the global mean
        return F.cross_entropy(head(x), y.reshape(-1), ignore_index=-100, reduction="sum") / count

    head = lambda x: x @ weight.T  # noqa: E731
    loss = TiledFusedLogitsLoss.apply(shard_loss, head, hidden, shifted, None, 4, [weight], "sum")
    (loss * SCALE).backward()
    assert rel_err(hidden.grad, SCALE * dh) <= OP_TOL  # the hidden states' gradient is scaled
    assert rel_err(weight.grad, dw) <= OP_TOL  # the weight's is not: 1/0.37 too large
    assert rel_err(weight.grad, SCALE * dw) > 1.0


def test_autocast_recompute():
    """Under CPU bf16 autocast the backward recomputes each tile's logits as the forward made them (bf16 matmul,
    fp32 softmax) and the gradients match transformers' untiled path on the same autocast.

    hidden: each row of d_hidden is the untiled path's own computation on the same bf16 operands (the logits row,
    softmax - one_hot in fp32, rounded to bf16 as autograd does, times the bf16 weight), so only a matmul's
    blocking could move it: bound 5e-4 relative RMS (a one-ulp bf16 flip, 2^-8, on a few % of the elements;
    seen: 0). A recompute outside autocast (fp32 logits) is ~3e-3 away: the negative control.
    weight: the untiled path rounds the whole d_weight to bf16 once; ours rounds each tile's partial sum (a bf16
    matmul output) and adds them in fp32. Each rounding is <= 2^-9 relative, so two independent ones differ by
    ~2^-9 * sqrt(2) RMS; bound 2^-8 = 3.9e-3 (seen: 2.2e-3)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, labels = _op_inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(ForCausalLMLoss(F.linear(hidden, weight), labels, V), [hidden, weight])
        got = torch.autograd.grad(tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7), [hidden, weight])
    assert got[0].dtype == got[1].dtype == torch.float32
    assert rel_err(got[0], want[0]) <= 5e-4
    assert rel_err(got[1], want[1]) <= 2**-8
    fp32 = torch.autograd.grad(ForCausalLMLoss(F.linear(hidden, weight), labels, V), [hidden])[0]
    assert rel_err(fp32, want[0]) > 4 * 5e-4  # the negative control: what a recompute without autocast gives


def test_op_refusals():
    hidden, weight, labels = _op_inputs()
    with pytest.raises(ValueError, match="labels or shift_labels"):
        tiled_causal_lm_loss(hidden, weight)
    with pytest.raises(ValueError, match="do not match"):
        tiled_causal_lm_loss(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="tile_tokens"):
        tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=0)
    loss = tiled_causal_lm_loss(hidden, weight, labels, tile_tokens=7)
    with pytest.raises(RuntimeError, match="second-order"):
        torch.autograd.grad(loss, [hidden], create_graph=True)


# -- the six families ------------------------------------------------------------------------------

FAMILIES = list(MODULES)
# the Gated DeltaNet families (their logits: lm_head's output as it is), with labels only (their rows are scored as
# the Mamba2 families' are; the cases' other inputs change nothing of theirs)
CASES = [(f, c) for c in ("labels", "shift_labels", "packed") for f in FAMILIES] + [
    (f, "labels") for f in DELTA_MODULES
]
# post-processing of the logits made non-trivial, so that dropping it would show
EXTRA = {"granitemoehybrid": dict(logits_scaling=2.5), "falcon_h1": dict(lm_head_multiplier=0.6)}
SEQ = 19


def _model(family, **extra):
    return build(family, dtype=torch.float64, **{**EXTRA.get(family, {}), **extra})


def _batch(case, seed=0):
    """Inputs of one call: labels with ignored tokens; shift_labels (which the model scores instead of labels)
    with num_items_in_batch, as the Trainer passes them; packed rows from DataCollatorWithFlattening (one row,
    position_ids restarting at each document, the first label of each document ignored). All six families accept
    packed rows on the CPU; Mamba2ForCausalLM takes position_ids into its loss kwargs only (its backbone never
    sees them), alike with and without the install."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[1, 3:9] = -100
    if case == "labels":
        return dict(input_ids=ids, labels=labels)
    if case == "shift_labels":
        shifted = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        shifted[0, :7] = -100
        return dict(input_ids=ids, labels=labels, shift_labels=shifted, num_items_in_batch=torch.tensor(45))
    from transformers import DataCollatorWithFlattening

    docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in (7, 12, 9)]
    return DataCollatorWithFlattening(return_tensors="pt")(docs)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("family", "case"), CASES)
def test_family_matches_transformers(family, case):
    from ds_mamba_spcp.integrations.transformers.fused_loss import install_fused_loss

    model = _model(family)
    reference = copy.deepcopy(model)
    install_fused_loss(model, 5)  # 38 tokens: tiles of 5 spanning the rows, the last of 3
    batch = _batch(case)
    want, want_grads = _loss_and_grads(reference, batch)
    got, grads = _loss_and_grads(model, batch)
    assert got.logits is None and want.logits is not None
    assert abs(got.loss.item() - want.loss.item()) <= MODEL_TOL * abs(want.loss.item())
    assert set(grads) == set(want_grads) == {n for n, _ in model.named_parameters()}
    errs = {n: rel_err(grads[n], want_grads[n]) for n in want_grads}
    assert max(errs.values()) <= GRAD_TOL, errs
    if case == "labels":  # outside training with labels: the previous forward, logits as before
        ids = batch["input_ids"]
        model.eval(), reference.eval()
        with torch.no_grad():
            out, ref = model(**batch), reference(**batch)
        assert torch.equal(out.logits, ref.logits) and out.loss.item() == ref.loss.item()
        model.train(), reference.train()
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, reference(**batch).logits)
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_post_processing_matters():
    """The negative control of the family bounds: at these sizes Falcon-H1's lm_head_multiplier and
    GraniteMoeHybrid's logits_scaling (which the install applies to the hidden states) move the loss by far more
    than MODEL_TOL, so a fused loss that dropped them would fail test_family_matches_transformers."""
    batch = _batch("labels")
    neutral_values = {"falcon_h1": dict(lm_head_multiplier=1.0), "granitemoehybrid": dict(logits_scaling=1.0)}
    for family, neutral in neutral_values.items():
        loss, plain = _model(family)(**batch).loss.item(), _model(family, **neutral)(**batch).loss.item()
        assert abs(loss - plain) > 1e-2 * abs(plain)


def test_router_loss_and_call_forms():
    """GraniteMoeHybrid's router loss is added as transformers adds it; positional input_ids and return_dict=False
    give transformers' tuple (loss first, no logits)."""
    from ds_mamba_spcp.integrations.transformers.fused_loss import install_fused_loss

    model = _model("granitemoehybrid", output_router_logits=True)
    reference = copy.deepcopy(model)
    install_fused_loss(model, 4)
    batch = _batch("labels")
    want, want_grads = _loss_and_grads(reference, batch)
    got, grads = _loss_and_grads(model, batch)
    assert got.aux_loss is not None and abs(got.loss.item() - want.loss.item()) <= MODEL_TOL * want.loss.item()
    assert max(rel_err(grads[n], want_grads[n]) for n in want_grads) <= GRAD_TOL

    model = _model("mamba2")
    reference = copy.deepcopy(model)
    install_fused_loss(model, 4)
    ids, labels = batch["input_ids"], batch["labels"]
    out = model(ids, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0
    assert all(not (torch.is_tensor(t) and t.shape[-1:] == (VOCAB,)) for t in out[1:])
    assert abs(out[0].item() - reference(ids, labels=labels).loss.item()) <= MODEL_TOL * out[0].item()


def test_install_rules():
    from ds_mamba_spcp.integrations.transformers.fused_loss import install_fused_loss

    model = _model("bamba")
    previous = inspect.signature(model.forward)
    install_fused_loss(model, 5)
    fused = model.forward
    install_fused_loss(model, 5)  # again: a no-op
    assert model.forward is fused
    assert inspect.signature(model.forward) == previous  # the Trainer reads it (columns, loss kwargs)
    with pytest.raises(ValueError, match="tile_tokens=5"):
        install_fused_loss(model, 6)
    twin = copy.deepcopy(model)  # the copy's forward runs the copy
    assert twin.forward.model is twin and twin.forward.previous.__self__ is twin
    batch = _batch("labels")
    assert twin(**batch).loss.item() == model(**batch).loss.item()

    base = build("bamba").model  # BambaModel: not a CausalLM class
    with pytest.raises(NotImplementedError, match=r'BambaModel.*"fused_loss": false'):
        install_fused_loss(base, 5)
    with pytest.raises(NotImplementedError, match="Linear"):
        install_fused_loss(torch.nn.Linear(2, 2), 5)
    biased = _model("zamba2")
    biased.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="bias"):
        install_fused_loss(biased, 5)
    with pytest.raises(NotImplementedError, match="z-loss"):
        install_fused_loss(_model("bamba", z_loss_coefficient=0.1), 5)


def _fused_head_run(model, batch, scale):
    """TRL's fused-head call, as SFTTrainer makes it: its outputs and the gradients of ``scale x loss``."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, fused_lm_head=True)
    (out.loss * scale).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", ["labels", "shift_labels"])
def test_trl_fused_head_computes_the_loss(case):
    """TRL's SFTTrainer installs its own fused head (trl.trainer.utils.add_fused_lm_head) and calls
    ``model(..., fused_lm_head=True)``; the fused loss called it with labels=None (TypeError in TRL). Now the call
    reaches TRL's head unchanged: its loss, per-token log-probabilities, entropy (TRL's ``entropy`` metric) and top-1
    flags (``mean_token_accuracy``) and every gradient equal those of the same model without the install, exactly
    (the same ops in the same order). TRL's head takes the incoming gradient in its backward, so a scale applied to
    the loss afterwards (SCALE: gradient accumulation, this package's sequence-parallel share) reaches every
    gradient: bound GRAD_TOL, since TRL accumulates its backward products in fp32 (trl/kernels/chunked_logprob.py,
    ``_addmm_fp32``) and the scaled run rounds apart from the unscaled one by ~2^-24 per product (seen <= 5.7e-7);
    an ignored scale would be 1 - SCALE = 0.63 off (asserted)."""
    from trl.trainer.utils import add_fused_lm_head

    from ds_mamba_spcp.integrations.transformers.fused_loss import install_fused_loss

    outputs = ("log_probs", "entropy", "is_top1")  # what SFTTrainer asks for
    model, reference = _model("bamba"), _model("bamba")  # built alike (seeded)
    for m in (model, reference):
        add_fused_lm_head(m, outputs=outputs)
    install_fused_loss(model, 5)
    batch = _batch(case)
    want, want_grads = _fused_head_run(reference, batch, 1.0)
    got, grads = _fused_head_run(model, batch, 1.0)
    for key in ("loss", *outputs, "label_mask"):
        assert torch.equal(getattr(got, key), getattr(want, key)), key
    assert set(grads) == set(want_grads) == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)
    _, scaled = _fused_head_run(model, batch, SCALE)
    errs = {n: rel_err(scaled[n], SCALE * want_grads[n]) for n in want_grads}
    assert max(errs.values()) <= GRAD_TOL, errs
    assert min(rel_err(scaled[n], want_grads[n]) for n in want_grads) > 0.5  # the scale reached every gradient


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_gets_the_fused_loss(family):
    """A PeftModel was refused by name ("not peft.peft_model.PeftModel"); now the fused loss is installed on the
    model it wraps, and its loss and the adapters' gradients match the PeftModel without the install (the family
    bounds above: the same model, logits rounded to fp32 by transformers only). LoRA on the mixers' in_proj and the
    attention and MLP projections (PEFT refuses out_proj and conv1d on Mamba models), B initialised at random so
    that the adapters change the loss. A LoRA adapter on lm_head, which the fused loss would skip, is refused by
    name."""
    peft = pytest.importorskip("peft")
    from ds_mamba_spcp.integrations.transformers.fused_loss import install_fused_loss

    torch.manual_seed(0)
    targets = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(_model(family), config)
    reference = copy.deepcopy(model)
    install_fused_loss(model, 5)
    batch = _batch("labels")
    want, want_grads = _loss_and_grads(reference, batch)
    got, grads = _loss_and_grads(model, batch)
    assert got.logits is None and want.logits is not None
    assert abs(got.loss.item() - want.loss.item()) <= MODEL_TOL * abs(want.loss.item())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and set(grads) == set(want_grads) == trainable
    errs = {n: rel_err(grads[n], want_grads[n]) for n in want_grads}
    assert max(errs.values()) <= GRAD_TOL, errs
    if family == "bamba":
        on_head = peft.get_peft_model(_model(family), peft.LoraConfig(r=2, target_modules=["lm_head"]))
        with pytest.raises(NotImplementedError, match=r'lm_head is Linear, not a plain nn.Linear.*"fused_loss": false'):
            install_fused_loss(on_head, 5)


# -- ZeRO-3: the head's weight gathered for the loss's forward and backward -------------------------


def _zero3(rank, world):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ds_mamba_spcp.integrations.transformers.fused_loss import install_fused_loss

    model = build("bamba")  # fp32: DeepSpeed reduces fp32 gradients
    reference = copy.deepcopy(model)
    batch = _batch("labels")
    want, want_grads = _loss_and_grads(reference, batch)
    install_fused_loss(model, 5)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    partitioned = model.lm_head.weight.numel() == 0
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    try:  # outside the module call the weight is a partition: the loss must go through lm_head
        tiled_causal_lm_loss(hidden, model.lm_head.weight, torch.zeros(1, 3, dtype=torch.long))
        bare = "ran"
    except ValueError:
        bare = "refused"
    out = engine(**batch)
    engine.backward(out.loss)
    errs = {n: rel_err(safe_get_full_grad(p), want_grads[n]) for n, p in model.named_parameters()}
    return dict(partitioned=partitioned, bare=bare, logits=out.logits, loss=(out.loss.item(), want.loss.item()),
                errs=errs)  # fmt: skip


def test_zero3_gathers_the_head():
    """One rank under ZeRO-3 (parameters partitioned between module calls; stage3_param_persistence_threshold 0
    so that the tiny head is partitioned too): the gradients DeepSpeed reduced equal the unwrapped fp32 model's
    within 1e-5 relative RMS (fp32, sums reordered over a few hundred terms; seen: <= 5e-7)."""
    (res,) = run_ranks(_zero3, 1, timeout=300)
    assert res["partitioned"] and res["bare"] == "refused" and res["logits"] is None
    loss, want = res["loss"]
    assert abs(loss - want) <= 1e-5 * want
    assert max(res["errs"].values()) <= 1e-5, res["errs"]
