"""Long context for transformers' Mamba2 and Gated DeltaNet families: memory per token flat in the sequence length.

``install(model, config)`` acts on the parsed section's ``"long_context"`` key (``config.LongContext``);
``prepare_sequence_parallel`` and ``enable()`` (the Trainer, TRL, accelerate) call it, at sequence_parallel_size 1
too. It finds a tiled layer's mixer through ``layers.adapters_in`` and tiles it through ``layers.TileableMixer``
(its in_proj, core, out_proj and document labels): this module does not import adapter.py. In training
(``model.train()``, grad enabled), each part can be turned off alone::

    decoder layer with a Mamba2 mixer, no attention   its own checkpoint, recomputed in backward tile by tile
      (tiled_layers)                                   through the layer's own forward: the mixer reads its tile
                                                       and conv halo rows, the fp32 state carried between tiles
                                                       (memory/tiled_block.py: Tiles, TiledFn; on N ranks
                                                       ShardTiledFn, the state from the ranks' exchange)
    every other decoder layer                          one checkpoint of the whole layer (torch.utils.checkpoint,
                                                       or the offloading one below)
    MLP / MoE blocks outside tiled layers (tiled_mlp)  DeepSpeed's TiledMLP
    the causal-LM loss (fused_loss)                    fused_loss.py: tiles of logits, never (tokens x vocab)
    each layer's checkpoint (its input)                on the GPU up to offload_gpu_budget_gib per pass, then
                                                       pinned host memory (memory/offload.py), the host checked
                                                       when any rank's batch is longer than any before

A Gated DeltaNet layer (delta.py; its adapter is no ``TileableMixer``) is never tiled: its decoder layer is one
checkpoint like any other, the delta layer recomputed whole inside it on this package's op. ``tiled_layers`` at its
default says so once (a warning); set explicitly on a model with no Mamba2 layer to tile, it is refused.

Outside training, or with a cache, every layer runs as transformers runs it. A padding mask in a tiled layer:
padding at the rows' ends only (right padding), a padded position's mixer output what transformers' is there
(``_TileCall.mixer_call``); left padding or holes are refused. The mixers run this package's op
(on a group of one: ``routes_op``), which tiles past mamba-ssm's int32 offsets. On a group of several ranks a tiled
layer's tiles cover the rank's shard, their incoming state from the op's summary exchange (``ShardTiledFn``).
Under ZeRO-3 a tiled layer's parameters are gathered once per pass over its tiles and its gradients reach ZeRO
once (tiled_block.gathered, backward_gathered). docs/huggingface.md, "Long context".
"""

from __future__ import annotations

import contextlib
import math
import types
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig
from ds_mamba_spcp.integrations.transformers.layers import (
    TileableMixer,
    adapters_in,
    attention_modules,
    decoder_layers,
    decoder_layers_within,
    raw_forward,
)
from ds_mamba_spcp.memory import offload as offload_mod
from ds_mamba_spcp.memory.recompute import autocast_state, rng_state
from ds_mamba_spcp.memory.tiled_block import (
    ShardTiledFn,
    TiledFn,
    autograd_inputs,
    gathered,
    make_chain,
    make_tiles,
)
from ds_mamba_spcp.ops import get_backend

KEY = f"{SECTION}.long_context"
_STATE_ATTR = "_ds_mamba_spcp_long_context"  # a model's _LongContext, in its __dict__

__all__ = ["install", "installed", "memory_report"]


def _mlps(module: nn.Module) -> list[nn.Module]:
    """transformers' per-token feed-forward blocks (``...MLP``, ``...MoE``, the Qwen families' ``...SparseMoeBlock``)
    in ``module``."""
    return [
        m
        for m in module.modules()
        if type(m).__module__.startswith("transformers.models.")
        and type(m).__name__.endswith(("MLP", "MoE", "SparseMoeBlock"))
    ]


# -- one tile of a decoder layer -------------------------------------------------------------------


class _TileCall:
    """What the mixer of a tiled layer computes on tile ``k``: in_proj on the tile and its halo rows, the core
    from ``S_in``, out_proj; the halo rows' outputs are zeros (the layer's caller drops those rows)."""

    def __init__(self, tiles, k: int, S_in, stop: str | None = None, cut: bool = True):
        self.tiles, self.k, self.S_in, self.S_out = tiles, k, S_in, None
        # "summary" / "state": the call ends the layer's forward (_Stop) once the mixer has its tile's summary or
        # S_out (ShardTiledFn's passes that read the state path alone); None: the whole layer. Without ``cut``
        # (ZeRO-3, whose module hooks must see every forward end) the layer runs on: the summary pass's mixer
        # returns zeros
        self.stop, self.summary, self.cut = stop, None, cut

    def mixer_call(self, adapter: TileableMixer, hidden, cache, attention_mask):
        name = adapter.name
        if cache is not None:
            raise NotImplementedError(
                f"{name} got a cache inside a tiled decoder layer ({KEY}.tiled_layers): a tile cannot honour it. "
                f'Pass use_cache=False in training, or set "{KEY}": {{"tiled_layers": false}}.'
            )
        if attention_mask is not None and self.k == 0:  # the first tile, forward and recompute: before any other
            _check_tail_padding(attention_mask, (hidden.shape[0], self.tiles.spans[-1][1]), name)
        zx = adapter.in_proj(hidden)
        if self.stop == "summary":
            self.summary = self.tiles.summary(self.k, zx, adapter.core())
            if self.cut:
                raise _Stop
            return hidden.new_zeros(*hidden.shape[:2], adapter.out_features)
        if self.stop == "state" and self.cut:  # the state path alone (Tiles.state)
            self.S_out = self.tiles.state(self.k, zx, adapter.core(), self.S_in)
            raise _Stop
        y, self.S_out = self.tiles.core(self.k, zx, adapter.core(), self.S_in)
        out = adapter.out_proj(y)
        if attention_mask is not None:
            # transformers' mixers zero a padded position's input and conv output (apply_mask_to_padding_states):
            # its y is 0 there, its output out_proj(0). With padding at the rows' ends only, no kept position sees a
            # padded one (causal), so the tile's kept rows are transformers' as they are, and the padded rows get
            # out_proj(0), through which no gradient reaches the tile (as none reaches it in transformers)
            start, end = self.tiles.spans[self.k]
            keep = attention_mask[:, start:end, None] != 0
            out = torch.where(keep, out, adapter.out_proj(y.new_zeros(1, 1, y.shape[-1])))
        nhalo = self.tiles.halo_rows(self.k)
        return F.pad(out, (0, 0, nhalo, 0)) if nhalo else out


def _check_tail_padding(mask, shape: tuple, name: str) -> None:
    """Raises unless ``mask`` is a 2-D padding mask of ``shape`` (batch, seqlen) whose zeros lie at the rows' ends."""
    if not torch.is_tensor(mask) or mask.dim() != 2 or tuple(mask.shape) != shape:
        got = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise NotImplementedError(
            f"{name} got a padding mask of shape {got} inside a tiled decoder layer ({KEY}.tiled_layers), which takes "
            f'a 2-D (batch, seqlen) = {shape} one. Pass the collator\'s 2-D mask, or set "{KEY}": '
            '{"tiled_layers": false}.'
        )
    kept = mask != 0
    if bool((kept[:, 1:] & ~kept[:, :-1]).any()):  # a kept position after a padded one
        raise NotImplementedError(
            f"{name} got a padding mask with a zero before a kept token (left padding, or a hole inside a row) "
            f"inside a tiled decoder layer ({KEY}.tiled_layers): the tiles honour padding at the rows' ends only. "
            "Pad on the right (the Trainer's and TRL's collators do; tokenizer padding_side='right'), pack the "
            f'documents (seq_idx) instead, or set "{KEY}": {{"tiled_layers": false}}.'
        )


class _Stop(Exception):
    """Raised by a ``_TileCall`` that has what its pass reads (the layer's later modules are not run)."""


class _LayerTiles:
    """A decoder layer as ``TiledFn``'s (``ShardTiledFn``'s) block: ``tile(k, x_ext, S_in)`` runs the layer's own
    forward on the tile's rows (its halo rows first) with the mixer reading the tile (``_TileCall``); ``summary``
    and ``state`` run it up to the mixer's core."""

    def __init__(self, layer: _Layer, tiles, args: tuple, kwargs: dict, params: list, halo: int = 0):
        self.layer, self.tiles, self.args, self.kwargs, self.params = layer, tiles, args, kwargs, params
        self.preserve_rng, self.halo = True, halo
        self.cut = not any(hasattr(p, "ds_id") for p in params)  # ZeRO-3: every forward runs to its end

    def _run(self, call: _TileCall, x_ext):
        adapter = self.layer.adapter
        adapter.tile = call
        try:
            return self.layer.raw(self.layer.module, x_ext, *self.args, **self.kwargs)
        except _Stop:
            return None
        finally:
            adapter.tile = None

    def tile(self, k: int, x_ext, S_in, tiles=None):
        tiles = self.tiles if tiles is None else tiles
        call = _TileCall(tiles, k, S_in)
        hidden = self.layer.hidden_of(self._run(call, x_ext))
        return hidden[:, tiles.halo_rows(k) :], call.S_out

    def summary(self, tiles, k: int, x_ext):
        call = _TileCall(tiles, k, None, stop="summary", cut=self.cut)
        self._run(call, x_ext)
        return call.summary

    def state(self, tiles, k: int, x_ext, S_in):
        call = _TileCall(tiles, k, S_in, stop="state", cut=self.cut)
        self._run(call, x_ext)
        return call.S_out


# -- the decoder layers ----------------------------------------------------------------------------


class _Layer:
    """The training forward of one decoder layer (installed as the instance's ``forward``)."""

    def __init__(self, module: nn.Module, state: _LongContext, adapter: TileableMixer | None):
        self.module, self.state, self.adapter = module, state, adapter  # adapter: the mixer's, when tiled
        self.raw = raw_forward(type(module))
        self.extra: tuple | None = None  # what the layer returns beside the hidden states (all None)

    def params(self) -> list:
        """The layer's parameters, each once (a shared module's too)."""
        seen, params = set(), []
        for p in self.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        return params

    def hidden_of(self, out):
        """The hidden states of the layer's output; the rest must be None (attention weights not asked for)."""
        if not isinstance(out, tuple):
            self.extra = None
            return out
        if any(o is not None for o in out[1:]):
            raise NotImplementedError(
                f"{type(self.module).__qualname__} returned more than hidden states in training (attention "
                f"weights or router logits, asked for by output_attentions / output_router_logits): {KEY} "
                "recomputes each layer and keeps only its hidden states. Do not ask for them in training."
            )
        self.extra = out[1:]
        return out[0]

    def rebuild(self, hidden):
        return hidden if self.extra is None else (hidden, *self.extra)

    def __call__(self, *args, **kwargs):
        module = self.module
        if not (module.training and torch.is_grad_enabled()):
            return self.raw(module, *args, **kwargs)
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        for name in ("cache", "past_key_values", "cache_params", "layer_past"):
            if kwargs.get(name) is not None:
                kwargs[name] = None  # as transformers' gradient checkpointing: no cache in a recomputed layer
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if self.adapter is not None:
            return self._tiled(hidden, args, kwargs)
        return self._checkpointed(hidden, args, kwargs)

    def _tiled(self, hidden, args, kwargs):
        adapter, state = self.adapter, self.state
        # paused (sequence_parallel_disabled), or the layer reads another tensor with a gradient, which the tiles
        # (differentiating their input, state and parameters only) would drop: the whole layer
        if not adapter.sharding.routes_op() or _closed_over(args, kwargs):
            return self._checkpointed(hidden, args, kwargs)
        cfg = adapter.sharding.config
        params = self.params()
        backend = get_backend(cfg.backend, hidden.device)
        batch, seqlen = hidden.shape[:2]
        key, cp = f"{KEY}.tile_tokens", adapter.sharding.size
        hooks = state.offloader.saved_tensors_hooks(hidden) if state.offloader else contextlib.nullcontext()
        # ZeRO-3: the layer's parameters gathered once for the forward's passes over the tiles (the Function records
        # their gathered shapes); its backward gathers them once again (tiled_block.gathered)
        with gathered(params):
            core = adapter.core()
            if cp > 1:  # the shard's segments tiled, their state from the op's exchange (tiled_block.ShardTiledFn)
                chain = make_chain(core, backend, cfg, adapter.sharding.group(), cp, hidden.shape,
                                   state.lc.tile_tokens, adapter.seq_idx(kwargs), key=key)  # fmt: skip
                runner = _LayerTiles(self, None, args, kwargs, params, halo=core.conv1d_weight.shape[1] - 1)
                with hooks:
                    return self.rebuild(ShardTiledFn.apply(runner, chain, hidden, *autograd_inputs(params)))
            tiles = make_tiles(core, backend, batch, seqlen, state.lc.tile_tokens, adapter.seq_idx(kwargs),
                               not cfg.recompute_output, key=key)  # fmt: skip
            runner = _LayerTiles(self, tiles, args, kwargs, params)
            with hooks:
                out = TiledFn.apply(runner, hidden, *autograd_inputs(params))
        return self.rebuild(out)

    def _checkpointed(self, hidden, args, kwargs):
        def fn(x):
            return self.hidden_of(self.raw(self.module, x, *args, **kwargs))

        offloader = self.state.offloader
        # the offloading checkpoint differentiates its input only: a layer that also reads another tensor with a
        # gradient (Zamba2's hybrid layers read the embeddings) takes torch's checkpoint, which follows any
        if offloader is not None and not _closed_over(args, kwargs):
            out = offload_mod.OffloadedCheckpoint(offloader)(fn, hidden)
        else:
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(fn, hidden, use_reentrant=False)
        return self.rebuild(out)


def _closed_over(args: tuple, kwargs: dict) -> bool:
    """Whether a layer call passes, beside its hidden states, a tensor that requires grad."""
    return any(torch.is_tensor(t) and t.requires_grad for t in (*args, *kwargs.values()))


class _MLP:
    """The training forward of one MLP or MoE block: DeepSpeed's ``TiledMLP`` over tiles of the sequence."""

    def __init__(self, module: nn.Module, tile_tokens: int):
        self.module, self.tile_tokens = module, tile_tokens
        self.raw = type(module).forward
        self.part = None  # the tile running now, for router_loss.py's padding mask: (index, shards, along seqlen)

    def __call__(self, x, *args, **kwargs):
        module = self.module
        tokens = x.shape[0] * x.shape[1] if x.dim() == 3 else 0
        # in training, with grad or without: the offloading checkpoint runs its layers' forward under no_grad, where
        # the whole MLP would hold (tokens x intermediate) at once (docs/huggingface.md, "Long context")
        if args or kwargs or not module.training or tokens <= self.tile_tokens:
            return self.raw(module, x, *args, **kwargs)
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        shards = min(math.ceil(tokens / self.tile_tokens), x.shape[1])
        params = [p for p in module.parameters() if p.requires_grad]
        # TiledMLP recomputes each tile in backward as it is called there (outside the loop's autocast, as a rule):
        # the tiles run under the forward's autocast settings, as torch.utils.checkpoint's recompute does
        autocast, drawn = autocast_state(x.device), rng_state(x.device)

        calls = {True: 0, False: 0}  # TiledMLP's forward hands (batch, tile) slices, its backward flattened rows

        def per_tile(m, tile):
            seqwise = tile.dim() == 3
            self.part, calls[seqwise] = (calls[seqwise], shards, seqwise), calls[seqwise] + 1
            try:
                with autocast.context():
                    return self._per_token(m, tile)
            finally:
                self.part = None

        out = TiledMLP.apply(per_tile, module, x, shards, params)  # under no_grad: its forward's tiles only
        # TiledMLP replays no generator state: the recompute would differ (nothing is recomputed under no_grad)
        if torch.is_grad_enabled() and not drawn.same_as(rng_state(x.device)):
            raise NotImplementedError(
                f"{type(module).__qualname__} draws random numbers (dropout) in training, which DeepSpeed's TiledMLP "
                f'does not replay in its recompute; set "{KEY}": {{"tiled_mlp": false}}, or the dropout to 0.'
            )
        return out

    def _per_token(self, module, x):
        # TiledMLP's forward hands (batch, tile, hidden) slices of the rows (not contiguous for batch > 1: Nemotron-H's
        # MoE views them), its backward (tokens, hidden) tiles of the flattened batch: one row of them
        x = x.contiguous()
        return self.raw(module, x[None])[0] if x.dim() == 2 else self.raw(module, x)


# -- the model -------------------------------------------------------------------------------------


class _LongContext:
    """What ``install`` keeps on a model (its ``__dict__``)."""

    def __init__(self, lc, layers: list, mlps: list, offloader):
        self.lc, self.layers, self.mlps, self.offloader = lc, layers, mlps, offloader
        self.planned: int | None = None  # the batch x seqlen tokens the host was last checked for (any rank's most)
        self.plan: offload_mod.OffloadPlan | None = None
        self.loss_tile_tokens: int | None = None


LOSS_TILE_LOGITS = 2**29


def loss_tile_tokens(model: nn.Module, lc) -> int:
    """The fused loss's tokens per tile: the key's, or LOSS_TILE_LOGITS logits' worth, at most ``tile_tokens``."""
    if lc.loss_tile_tokens is not None:
        return lc.loss_tile_tokens
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return max(1, min(lc.tile_tokens, LOSS_TILE_LOGITS // int(config.vocab_size)))


def installed(model: nn.Module) -> bool:
    return _STATE_ATTR in model.__dict__


def install(model: nn.Module, config: MambaSequenceParallelConfig) -> bool:
    """Installs ``config.long_context`` on ``model`` (its mixers already wrapped by adapter.py, on the group of
    ``config``); a no-op when the key is unset or the model was installed before. Returns whether it installed."""
    lc = config.long_context
    if lc is None or installed(model):
        return False
    offloader = None
    if lc.offload_gpu_budget_gib is not None:
        offloader = offload_mod.CheckpointOffloader(int(lc.offload_gpu_budget_gib * offload_mod.GiB))
    state = _LongContext(lc, [], [], offloader)
    layers, whole = [], 0  # whole: decoder layers holding a mixer that cannot be tiled (a Gated DeltaNet layer)
    for layer in decoder_layers(model):
        adapters = adapters_in(layer)
        whole += not all(map(_tileable, adapters))
        tiled = lc.tiled_layers and len(adapters) == 1 and _tileable(adapters[0]) and not attention_modules(layer)
        layers.append((layer, adapters[0] if tiled else None))
    if whole and lc.tiled_layers:
        _delta_layers_whole(model, lc, whole, sum(a is not None for _, a in layers))
    in_tiled = set()
    for layer, adapter in layers:
        tiled = adapter is not None
        wrapper = _Layer(layer, state, adapter)
        layer.forward = wrapper
        for inner in decoder_layers_within(layer):  # checkpointed with their layer: not again by transformers
            inner.forward = types.MethodType(raw_forward(type(inner)), inner)
        state.layers.append(wrapper)
        if tiled:
            in_tiled.update(id(m) for m in layer.modules())
    if lc.tiled_mlp:
        for mlp in _mlps(model):
            if id(mlp) not in in_tiled:
                wrapper = _MLP(mlp, lc.tile_tokens)
                mlp.forward = wrapper
                state.mlps.append(wrapper)
    if lc.fused_loss:
        from ds_mamba_spcp.integrations.transformers.fused_loss import install_fused_loss

        install_fused_loss(model, loss_tile_tokens(model, lc))
    state.loss_tile_tokens = loss_tile_tokens(model, lc) if lc.fused_loss else None
    model.__dict__[_STATE_ATTR] = state
    if offloader is not None:
        model.register_forward_pre_hook(_check_host, with_kwargs=True)
    return True


def _tileable(adapter) -> bool:
    """Whether a wrapped mixer's adapter is a ``layers.TileableMixer`` (adapter.py's Mamba2 mixers; delta.py's Gated
    DeltaNet layers are not: their layers are recomputed whole)."""
    return all(callable(getattr(adapter, name, None)) for name in ("in_proj", "core", "out_proj", "seq_idx"))


def _delta_layers_whole(model: nn.Module, lc, whole: int, tiled: int) -> None:
    """``tiled_layers`` on a model with decoder layers whose mixer cannot be tiled (Gated DeltaNet): each of them is
    recomputed whole inside its decoder layer's checkpoint (the other parts apply as to any layer). At the default
    that is said once; set explicitly on a model with no Mamba2 layer to tile it is refused (it would do nothing)."""
    name = type(model).__qualname__
    if tiled == 0 and "tiled_layers" in lc.model_fields_set:
        raise NotImplementedError(
            f'"{KEY}": {{"tiled_layers": true}} is set but {name} has no Mamba2 layer to tile: its {whole} linear '
            "decoder layer(s) hold Gated DeltaNet layers, for which no tiled recompute is written (each would be "
            'recomputed whole inside the checkpoint of its decoder layer). Leave "tiled_layers" out (its default tiles '
            "the Mamba2 layers of a model and recomputes the others whole) or set it to false."
        )
    warnings.warn(
        f"{KEY}: {whole} decoder layer(s) of {name} hold a Gated DeltaNet layer, which is not tiled: each is "
        f"recomputed whole inside its decoder layer's checkpoint ({tiled} Mamba2 layer(s) tiled); the tiled MLPs, "
        "the fused loss and the offloaded checkpoints apply to them as to any layer.",
        stacklevel=3,
    )


def _check_host(model: nn.Module, args: tuple, kwargs: dict):
    """Before every training pass: the largest batch (batch x seqlen tokens) of any rank, in one all-reduce of one
    integer that every rank enters whatever its own batch (data-parallel ranks hold rows of different lengths).
    When it is larger than any before: the plan of the layer checkpoints for it and the host check
    (``HostMemoryError`` on every rank alike before anything is offloaded, its own all-reduce entered by every
    rank alike); the pool's slots are allocated for it (a failure to pin shows now)."""
    state = model.__dict__[_STATE_ATTR]
    if not (model.training and torch.is_grad_enabled()):
        return None
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    local = int(tokens.shape[0]) * int(tokens.shape[1]) if torch.is_tensor(tokens) and tokens.dim() >= 2 else 0
    (longest,) = offload_mod.group_max([local])
    if longest == 0 or (state.planned is not None and longest <= state.planned):
        return None
    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    if hidden == 0:
        raise ValueError(f"{KEY}.offload_gpu_budget_gib: cannot size the layer checkpoints of a model without "
                         "config.hidden_size")  # fmt: skip
    dtype = next(model.parameters()).dtype
    itemsize = max(torch.empty(0, dtype=dtype).element_size(), 4 if getattr(config, "residual_in_fp32", False) else 0)
    sizes = offload_mod.block_checkpoint_bytes(longest, hidden, len(state.layers), itemsize)  # linear in the tokens
    plan = offload_mod.plan_offload(sizes, state.offloader.gpu_budget_bytes)
    offload_mod.check_host_memory(plan)
    offloader = state.offloader
    offloader.host_limit_bytes = plan.host_bytes
    if offloader.pool is not None:
        offloader.pool.clear()
        offloader.pool.limit_bytes = plan.host_bytes
    device = next(model.parameters()).device
    offloader.reserve(plan, pin=device.type == "cuda")
    state.planned, state.plan = longest, plan
    return None


def memory_report(model: nn.Module) -> dict[str, Any]:
    """What ``install`` did to ``model`` and where its layer checkpoints went in the last pass planned."""
    m = getattr(model, "module", model)  # a DeepSpeed engine holds the model
    state = m.__dict__.get(_STATE_ATTR)
    if state is None:
        return {"installed": False}
    report = {
        "installed": True,
        "tile_tokens": state.lc.tile_tokens,
        "layers_tiled": sum(layer.adapter is not None for layer in state.layers),
        "layers_checkpointed": sum(layer.adapter is None for layer in state.layers),
        "mlps_tiled": len(state.mlps),
        "fused_loss": state.lc.fused_loss,
        "loss_tile_tokens": state.loss_tile_tokens,
        "offload_gpu_budget_bytes": None if state.offloader is None else state.offloader.gpu_budget_bytes,
    }
    plan = state.plan
    if plan is not None:
        report.update(
            checkpoint_bytes=sum(plan.checkpoint_bytes),
            checkpoint_gpu_bytes=plan.gpu_bytes,
            checkpoint_host_bytes=plan.host_bytes,
            checkpoints_on_host=len(plan.on_host),
        )
    if state.offloader is not None and state.offloader.pool is not None:
        pool = state.offloader.pool
        report.update(pool_reserved_bytes=pool.reserved_bytes, pool_peak_in_use_bytes=pool.peak_in_use_bytes)
        report.update({f"offload_{k}": v for k, v in state.offloader.stats.items()})
    return report


def warn_unused(model: nn.Module, config: MambaSequenceParallelConfig) -> None:
    """A warning when the key is set but the model holds nothing it acts on."""
    if config.long_context is not None and not decoder_layers(model):
        warnings.warn(f"{KEY} is set but {type(model).__qualname__} has no transformers decoder layers", stacklevel=3)
