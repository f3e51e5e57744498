"""The causal-LM loss of transformers' six Mamba2 families and four Gated DeltaNet families without the (tokens x
vocab) logits.

``install_fused_loss(model, tile_tokens)`` replaces the model's ``forward`` as an instance attribute (the class,
its hooks and the previous forward are kept; installing again is a no-op). A training call (the model in training
mode, grad enabled) with ``labels`` or ``shift_labels``:

    previous forward(labels=None, no shift_labels), lm_head returning its input for that call
        -> the last hidden states after the family's own scalar post-processing of the logits
    lm_head(hidden) with its forward swapped for tiled_causal_lm_loss(hidden, lm_head.weight, labels, ...)
        (``memory/logits_loss.py``; a module call, so that ZeRO-3's hooks gather the weight for its forward and
        again before its backward)
    -> the model's output with that loss (plus the MoE families' router loss when the model returns one) and
       logits=None

Every other call (eval mode, no labels, no grad) runs the previous forward unchanged. The post-processing of each
family's logits in transformers' ``ForCausalLM.forward`` (checked for 5.x): Mamba2 casts the hidden states to the
head's dtype and the logits to fp32; Nemotron-H casts the logits to fp32; GraniteMoeHybrid divides them by
``config.logits_scaling``; Falcon-H1 multiplies them by ``model.lm_head_multiplier``; Bamba, Zamba2 and the Gated
DeltaNet families (Qwen3.5 dense and MoE, Qwen3-Next, OLMo-hybrid, Kimi Linear) use them as they are. Scalars
commute with the head, so they are applied to the hidden states; the fp32 casts are undone (the loss upcasts its
logits itself). Refused: a head with a bias or that is not a plain ``nn.Linear``, Bamba's z-loss, a loss function
other than transformers' ``ForCausalLMLoss``, non-scalar multipliers.

A call with ``fused_lm_head=True`` runs the previous forward unchanged too: TRL's ``add_fused_lm_head`` (which
``SFTTrainer`` and TRL's other trainers install on the model) answers it with its own chunked head, which never
holds the logits either and returns the per-token log-probabilities, entropy and top-1 flags that TRL's loss and
its ``entropy`` / ``mean_token_accuracy`` metrics read (the fused loss called it with ``labels=None``: a TypeError
in TRL). Its backward (TRL's ``ChunkedLogProbFunction``) recomputes each tile with the incoming gradient of each
token's log-probability, so a scale applied to the loss later (gradient accumulation, this package's
sequence-parallel share) reaches both of its gradients. Its memory: see docs/huggingface.md, "Long context".

A PEFT model (``peft.PeftModel``, e.g. LoRA) gets the fused loss on the transformers model it wraps
(``get_base_model()``): PEFT's forward reaches that model's ``forward``, the instance attribute installed here, and
its adapters sit in the layers, which run unchanged; an adapter on ``lm_head`` is refused with the other heads
that are not a plain ``nn.Linear``.

Unlike transformers' forward, ``shift_labels`` without ``labels`` is scored too (transformers computes a loss
only when ``labels`` is given; when both are, both use ``shift_labels``).
"""

from __future__ import annotations

import contextlib
import inspect
import numbers

import torch
from torch import nn

from ds_mamba_spcp.memory.logits_loss import tiled_causal_lm_loss

__all__ = ["FUSED_LOSS_CLASSES", "install_fused_loss"]

# The CausalLM classes whose forward was read (class name -> modeling module).
FUSED_LOSS_CLASSES = {
    "Mamba2ForCausalLM": "transformers.models.mamba2.modeling_mamba2",
    "BambaForCausalLM": "transformers.models.bamba.modeling_bamba",
    "NemotronHForCausalLM": "transformers.models.nemotron_h.modeling_nemotron_h",
    "GraniteMoeHybridForCausalLM": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "FalconH1ForCausalLM": "transformers.models.falcon_h1.modeling_falcon_h1",
    "Zamba2ForCausalLM": "transformers.models.zamba2.modeling_zamba2",
    # the Gated DeltaNet families (delta.py): their logits are lm_head's output as it is
    "Qwen3_5ForCausalLM": "transformers.models.qwen3_5.modeling_qwen3_5",
    "Qwen3_5MoeForCausalLM": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "Qwen3NextForCausalLM": "transformers.models.qwen3_next.modeling_qwen3_next",
    "OlmoHybridForCausalLM": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    "KimiLinearForCausalLM": "transformers.models.kimi_linear.modeling_kimi_linear",  # no router loss added
}
# the classes that add ``router_aux_loss_coef x aux_loss`` to their loss when they compute one (with labels)
_ADDS_ROUTER_LOSS = ("GraniteMoeHybridForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
_ATTR = "_ds_mamba_spcp_fused_loss"
_OFF = 'turn it off with "long_context": {"fused_loss": false} in the "mamba_sequence_parallel" section'


def _refuse_head(model: nn.Module) -> None:
    """The checks that keep the fused loss equal to the family's own (module docstring)."""
    name = type(model).__name__
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise NotImplementedError(
            f"fused_loss: {name}.lm_head is {type(head).__name__}, not a plain nn.Linear (an adapter on the head "
            f"would be skipped); {_OFF}."
        )
    if head.bias is not None:
        raise NotImplementedError(f"fused_loss: {name}.lm_head has a bias; {_OFF}.")
    if getattr(model, "z_loss_coefficient", 0.0):
        raise NotImplementedError(
            f"fused_loss: {name} adds a z-loss on the logits (z_loss_coefficient={model.z_loss_coefficient}); "
            f"set it to 0.0 or {_OFF}."
        )
    scalars = {
        "GraniteMoeHybridForCausalLM": ("config.logits_scaling", lambda m: m.config.logits_scaling),
        "FalconH1ForCausalLM": ("model.lm_head_multiplier", lambda m: m.model.lm_head_multiplier),
    }
    if name in scalars:
        what, get = scalars[name]
        value = get(model)
        if not isinstance(value, numbers.Real) and not (torch.is_tensor(value) and value.numel() == 1):
            raise NotImplementedError(f"fused_loss: {name}.{what} is not a scalar ({value!r}); {_OFF}.")
    from transformers.loss.loss_utils import ForCausalLMLoss

    if model.loss_function is not ForCausalLMLoss:
        raise NotImplementedError(
            f"fused_loss: {name}.loss_function is {getattr(model.loss_function, '__name__', model.loss_function)}, "
            f"not transformers' ForCausalLMLoss; {_OFF}."
        )


@contextlib.contextmanager
def _forward_swapped(module: nn.Module, fn):
    """``module.forward`` is ``fn`` inside the block (hooks still run around it); restored after."""
    had = "forward" in module.__dict__
    before = module.__dict__.get("forward")
    module.forward = fn
    try:
        yield
    finally:
        if had:
            module.forward = before
        else:
            del module.forward


class _FusedForward:
    """The installed ``forward`` (module docstring). It holds the model and the previous forward, so a deepcopy
    of the model gets its own; it shows the previous forward's signature (the Trainer reads it to keep dataset
    columns and to pass ``num_items_in_batch``)."""

    def __init__(self, model: nn.Module, previous, tile_tokens: int) -> None:
        self.model, self.previous, self.tile_tokens = model, previous, tile_tokens

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.previous)

    def __call__(self, *args, **kwargs):
        model = self.model
        if args:  # e.g. model(input_ids, labels=...): every argument by name
            signature = self.__signature__
            bound, kwargs, args = signature.bind(*args, **kwargs), {}, ()
            for name, value in bound.arguments.items():
                if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                    kwargs.update(value)
                else:
                    kwargs[name] = value
        if kwargs.get("fused_lm_head"):  # TRL's fused head computes the loss itself (module docstring)
            return self.previous(*args, **kwargs)
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        if not (model.training and torch.is_grad_enabled() and (labels is not None or shift_labels is not None)):
            return self.previous(*args, **kwargs)
        _refuse_head(model)
        kwargs = dict(kwargs, labels=None)
        kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        return_dict = model.config.return_dict if return_dict is None else return_dict
        kwargs["return_dict"] = True
        head, seen = model.lm_head, []

        def passthrough(hidden):
            seen.append(hidden)
            return hidden

        with _forward_swapped(head, passthrough):
            out = self.previous(**kwargs)
        if len(seen) != 1 or out.logits is None or out.logits.shape != seen[0].shape:
            raise RuntimeError(
                f"fused_loss: {type(model).__name__}.forward did not turn lm_head's output into its logits by "
                f"scalar operations only (transformers {_transformers_version()}); {_OFF}."
            )
        hidden = out.logits.to(seen[0].dtype)  # Mamba2 and Nemotron-H cast the logits to fp32: undone
        seen.clear()

        def loss_forward(hidden):
            return tiled_causal_lm_loss(
                hidden, head.weight, labels, shift_labels=shift_labels,
                num_items_in_batch=kwargs.get("num_items_in_batch"), ignore_index=kwargs.get("ignore_index", -100),
                tile_tokens=self.tile_tokens,
            )  # fmt: skip

        with _forward_swapped(head, loss_forward):
            loss = head(hidden)
        aux = getattr(out, "aux_loss", None)
        if aux is not None and type(model).__name__ in _ADDS_ROUTER_LOSS:  # its router loss, as it adds it
            loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        out = type(out)(loss=loss, **fields)
        return out if return_dict else out.to_tuple()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _unwrapped_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``peft.PeftModel`` (its ``get_base_model()``); any other model as it is."""
    if not type(model).__module__.startswith("peft."):
        return model
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def install_fused_loss(model: nn.Module, tile_tokens: int) -> None:
    """In training, ``model`` computes its causal-LM loss tile by tile from the last hidden states and
    ``lm_head.weight`` (``tile_tokens`` tokens of logits at a time) and returns no logits; see the module
    docstring. ``model``: one of ``FUSED_LOSS_CLASSES``. Installing again with the same ``tile_tokens`` is a
    no-op. A ``peft.PeftModel`` gets it on the model it wraps."""
    model = _unwrapped_peft(model)
    cls = type(model)
    if FUSED_LOSS_CLASSES.get(cls.__name__) != cls.__module__:
        raise NotImplementedError(
            f"fused_loss supports transformers' {', '.join(FUSED_LOSS_CLASSES)}, not {cls.__module__}."
            f"{cls.__qualname__}; {_OFF}."
        )
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"fused_loss: tile_tokens must be a positive int, got {tile_tokens!r}")
    installed = model.__dict__.get(_ATTR)
    if installed is not None:
        if installed.tile_tokens != tile_tokens:
            raise ValueError(
                f"fused_loss is already installed on this {cls.__name__} with tile_tokens={installed.tile_tokens}, "
                f"not {tile_tokens}"
            )
        return
    _refuse_head(model)
    fused = _FusedForward(model, model.forward, tile_tokens)
    model.__dict__[_ATTR] = fused
    model.forward = fused
