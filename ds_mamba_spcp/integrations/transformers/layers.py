"""What the transformers modules share, below all of them: how a wrapped layer is found and called, transformers'
decoder layers and attention modules, and the interface through which the long-context key tiles a mixer.

    adapter.py, delta.py          wrap a layer: ``install_adapter`` (its adapter under ``MIXER_ATTR``, the instance
                                  ``forward`` calling it); read a call with ``mixer_call``; refuse with
                                  ``cache_error`` / ``padding_error``
    long_context.py, router_loss  find the layers (``decoder_layers``) and a layer's adapter (``adapter_of``); the
                                  key tiles a Mamba2 mixer through ``TileableMixer`` alone

This module imports none of the others, so that each of them imports it and none imports another to reach these
pieces (tests/test_import_graph.py keeps the package's import graph acyclic).
"""

from __future__ import annotations

import copy
import types
from typing import Any, Protocol

import torch
from torch import nn

from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig
from ds_mamba_spcp.integrations.core import SHARDED_ATTR, MixerCore

# Plain attribute in a wrapped layer's __dict__ (not a submodule, so state_dict and named_modules ignore it).
MIXER_ATTR = "_ds_mamba_spcp_mixer"  # a wrapped layer's adapter (adapter.py's _MixerAdapter, delta.py's DeltaAdapter)
# the cache argument: "cache" in transformers 5.24, "cache_params" / "past_key_values" in 5.17
CACHE_NAMES = ("cache", "cache_params", "past_key_values")


class Sharding(Protocol):
    """Whether a call of a wrapped layer is sharded (adapter.py's ``_Sharding``)."""

    config: MambaSequenceParallelConfig
    size: int

    def group(self) -> Any: ...
    def active(self) -> bool: ...
    def routes_op(self) -> bool: ...


class TileableMixer(Protocol):
    """What long_context.py's tiled decoder layers ask of a wrapped Mamba2 mixer (adapter.py's ``_MixerAdapter``):
    its projections and core, the call's document labels, and a place for the tile in hand (``tile``: set while the
    layer runs one tile, whose ``mixer_call(mixer, hidden, cache, attention_mask)`` the mixer's call then returns;
    router_loss.py reads its ``tiles`` and ``k``)."""

    tile: Any
    sharding: Sharding
    name: str  # for messages: "Class (layer i)"
    out_features: int

    def in_proj(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def core(self) -> MixerCore: ...
    def out_proj(self, y: torch.Tensor) -> torch.Tensor: ...
    def seq_idx(self, kwargs: dict) -> torch.Tensor | None: ...


# -- wrapped layers ---------------------------------------------------------------------------------


def adapter_of(module: nn.Module):
    """The adapter of a wrapped layer, or None."""
    return module.__dict__.get(MIXER_ATTR)


def adapters_in(module: nn.Module) -> list:
    """The adapters of the wrapped layers in ``module``, in module order."""
    return [m.__dict__[MIXER_ATTR] for m in module.modules() if MIXER_ATTR in m.__dict__]


def _call_adapter(layer: nn.Module, *args, **kwargs):
    return layer.__dict__[MIXER_ATTR](*args, **kwargs)


def _hidden_states_positional(layer: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a wrapped layer: passes ``hidden_states`` positionally when the caller named it.

    ZeRO-3 reduces a leaf's gradients in a full backward hook, which torch fires after the gradients of the
    module's positional tensor inputs, or, without any, as soon as its outputs' (before the mixer's own
    backward: the first backward then fails on the partitioned ``out_proj`` weight). Bamba, Zamba2, Falcon-H1
    and GraniteMoeHybrid pass ``hidden_states=`` by keyword."""
    if not args and "hidden_states" in kwargs:
        kwargs = dict(kwargs)
        return (kwargs.pop("hidden_states"),), kwargs
    return None


def install_adapter(layer: nn.Module, adapter) -> None:
    """Wraps ``layer``: it keeps its class and place, its instance ``forward`` calls ``adapter`` (held in its
    ``__dict__``), and it is a ZeRO-3 leaf (the adapters read weights without calling their submodules)."""
    layer.__dict__[MIXER_ATTR] = adapter
    layer.__dict__[SHARDED_ATTR] = True
    layer.forward = types.MethodType(_call_adapter, layer)
    layer._z3_leaf = True
    layer.register_forward_pre_hook(_hidden_states_positional, with_kwargs=True, prepend=True)


def mixer_call(args: tuple, kwargs: dict) -> tuple[Any, Any, Any, dict]:
    """(hidden_states, cache, attention_mask, other keyword arguments) of a call of a mixer's
    ``forward(hidden_states, cache=None, attention_mask=None, **kwargs)``."""
    if len(args) > 3:
        raise TypeError(f"a transformers Mamba2 mixer takes at most 3 positional arguments, got {len(args)}")
    named = dict(zip(("hidden_states", "cache", "attention_mask"), args))
    rest = dict(kwargs)
    for key in ("hidden_states", "attention_mask"):
        if key in rest:
            named[key] = rest.pop(key)
    cache = named.get("cache")
    for key in CACHE_NAMES:
        value = rest.pop(key, None)
        cache = value if cache is None else cache
    return named.get("hidden_states"), cache, named.get("attention_mask"), rest


def cache_error(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} was called with a cache (generation, or use_cache=True) while sequence parallelism is active: "
        "the cache would hold one rank's conv and SSM state of a sequence split across ranks. For a forward on "
        "shards pass use_cache=False; to generate, or to evaluate on whole sequences, run the model inside "
        "`with ds_mamba_spcp.integrations.transformers.sequence_parallel_disabled(model):` (every layer then runs "
        f'its own forward), or set "{SECTION}.enabled" to false.'
    )


def padding_error(where: str) -> NotImplementedError:
    return NotImplementedError(
        f"padding ({where}) is not supported with sequence parallelism: the Mamba2 mixers would have to zero the "
        "padded tokens, but DeepSpeed's Ulysses attention drops the attention mask (it masks causally only), so "
        "the model cannot honour it. Give every row the full length, or pack documents into full rows and pass "
        "seq_idx (transformers' DataCollatorWithFlattening(return_seq_idx=True)); pass no attention_mask, or an "
        "all-ones one."
    )


# -- transformers' layers ---------------------------------------------------------------------------


def gradient_checkpointing_layer() -> type:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return GradientCheckpointingLayer


def raw_forward(cls: type):
    """The class's forward without transformers' checkpointing wrapper (``GradientCheckpointingLayer``)."""
    forward = cls.forward
    return getattr(forward, "__wrapped__", forward)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The outermost ``GradientCheckpointingLayer`` modules of ``model``, in forward (module) order."""
    base = gradient_checkpointing_layer()
    found, inner = [], set()
    for m in model.modules():
        if id(m) in inner or not isinstance(m, base):
            continue
        found.append(m)
        inner.update(id(c) for c in m.modules() if c is not m)
    return found


def decoder_layers_within(layer: nn.Module) -> list[nn.Module]:
    base = gradient_checkpointing_layer()
    return [m for m in layer.modules() if m is not layer and isinstance(m, base)]


def _is_mla(m: nn.Module) -> bool:
    """Multi-head latent attention (Kimi Linear's ``KimiLinearAttention``): keys and values expanded per head from a
    compressed latent (``kv_b_proj``), keys of ``qk_head_dim`` and values of ``v_head_dim``."""
    return all(hasattr(m, a) for a in ("kv_a_proj_with_mqa", "kv_b_proj", "qk_head_dim", "v_head_dim"))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The transformers attention modules of ``model`` that call ``ALL_ATTENTION_FUNCTIONS`` (q/k/v
    projections, ``head_dim``, ``num_key_value_groups`` and a config naming the attention implementation; or MLA's
    latent projections, ``_is_mla``, in place of the k/v projections and ``head_dim``)."""
    found = []
    for m in model.modules():
        if not type(m).__module__.startswith("transformers.models."):
            continue
        if not all(hasattr(m, a) for a in ("num_key_value_groups", "config")):
            continue
        if _is_mla(m) or all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "head_dim")):
            found.append(m)
    return found


def ulysses_dims(module: nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a module of ``attention_modules`` as DeepSpeed's Ulysses attention
    is built for it (one head dim for queries, keys and values: MLA's ``qk_head_dim``, its narrower values padded to
    it by ``ulysses_attention``)."""
    heads = int(module.config.num_attention_heads)
    kv_heads = heads // int(module.num_key_value_groups)
    if not _is_mla(module):
        return heads, kv_heads, int(module.head_dim)
    if module.v_head_dim > module.qk_head_dim:
        raise ValueError(
            f"{type(module).__qualname__}: values of head dim {module.v_head_dim} are wider than its queries and keys "
            f"({module.qk_head_dim}); DeepSpeed's Ulysses attention takes one head dim, and only narrower values are "
            "padded to the keys' here (wider ones would need the keys padded, changing the softmax scale)."
        )
    return heads, kv_heads, int(module.qk_head_dim)


def ulysses_attention(uattn, module, query, key, value, attention_mask, *args, **kwargs):
    """``uattn(module, query, key, value, attention_mask, ...)`` (DeepSpeed's ``UlyssesSPAttentionHF``, which takes one
    head dim) with values narrower than the queries (MLA) zero-padded to their head dim and the padding dropped from
    the output (batch, local_seqlen, heads x value head dim): softmax(q k^T) [v, 0] = [softmax(q k^T) v, 0]."""
    width, narrow = query.shape[-1], value.shape[-1]
    if narrow == width:
        return uattn(module, query, key, value, attention_mask, *args, **kwargs)
    padded = torch.nn.functional.pad(value, (0, width - narrow))
    out, weights = uattn(module, query, key, padded, attention_mask, *args, **kwargs)
    return out.unflatten(-1, (-1, width))[..., :narrow].flatten(-2), weights


def copy_adapter(adapter, memo):
    """``copy.deepcopy`` of a mixer adapter (adapter.py's and delta.py's): its own fields copied, the mixer, the
    original forward, the sharding and the model state deep-copied through ``memo`` (the mixer holds the adapter:
    ``memo`` is filled first so that the cycle ends at the copy)."""
    new = copy.copy(adapter)
    memo[id(adapter)] = new
    new.mixer = copy.deepcopy(adapter.mixer, memo)
    new.original_forward = copy.deepcopy(adapter.original_forward, memo)
    new.sharding = copy.deepcopy(adapter.sharding, memo)
    new.model_state = copy.deepcopy(adapter.model_state, memo)
    return new
