"""Hugging Face ``Trainer``, TRL's ``SFTTrainer`` and accelerate: sequence parallelism for Mamba2 models, one call.

The Trainer reaches DeepSpeed's Ulysses sequence parallelism through accelerate (``TrainingArguments(deepspeed=
ds_config, parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N, ...))``), which refuses most
Mamba2 families and trains Falcon-H1 wrong. A script adds one call before it builds the ``Trainer``::

    from ds_mamba_spcp.integrations import accelerate as mamba_sp
    mamba_sp.enable()
    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds_config.json",
                      parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)), ...)
    trainer.train()

``enable()`` replaces seven hooks of accelerate and the Trainer; for a model without transformers' Mamba2 mixers
(or with ``"enabled": false``) each does what it did before::

    accelerate  Accelerator._prepare_deepspeed
      _refuse_recurrent_layers_under_sequence_parallelism(model)  ──> lets the model pass
      UlyssesSPAttentionHF.register_with_transformers(model, ...)  ──> prepare_sequence_parallel(model, section),
            once per model (its group is the mpu handed to deepspeed.initialize)
      UlyssesSPDataLoaderAdapter(loader)  ──> for the model just prepared: the same, gathering rows of different
            lengths on any backend, checked on every rank (``_adapter_class``); DeepSpeed's own for any other model
    transformers  Trainer
      deepspeed_sp_compute_loss  ──> the same global mean, its gradient scaled for the ZeRO stage
      Trainer.get_batch_samples (one optimizer step's micro-batches)  ──> the same, and their scored tokens
            counted over whole rows: each micro-batch's token sum divided by them, as one process does
      skip_first_batches (resume mid-epoch)  ──> the adapter skips its own micro-batches
      Trainer._set_signature_columns_if_needed  ──> keeps the dataset's position_ids column

The prepared model gets two more forward hooks: calls in ``eval()`` mode run unsharded, a training call
whose ``position_ids`` restart inside a row gets the matching ``seq_idx`` (``packed_seq_idx``), and one whose
``attention_mask`` zeros are right padding gets no mask (``_mask_after_scored``; the router loss gets it). The loss
gives each rank ``grad_scale_for_engine(engine) x`` its share (1 at ZeRO 0-2, ``sp`` at ZeRO-3), so that the reduced
gradient is the one-process one at every stage. The ds_config's ``"mamba_sequence_parallel"`` section decides the
mode; absent or without ``"enabled"``, it means ``"enabled": true`` here. Errors are raised on every rank alike,
before any collective. Why each replacement, the settings refused, the tests: docs/huggingface.md, "Trainer,
TRL and accelerate" (tested with ``TESTED``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig, load_mamba_sp_config
from ds_mamba_spcp.data import IGNORE_INDEX, grad_scale, grad_scale_for_engine, shift_labels
from ds_mamba_spcp.engine import modes
from ds_mamba_spcp.integrations.transformers.adapter import (
    MIXER_CLASSES,
    mixer_classes,
    prepare_sequence_parallel,
    sequence_parallel_disabled,
)

TESTED = {"accelerate": "1.15.0", "transformers": "5.24", "trl": "1.16.0", "deepspeed": "0.19.8"}
_INSTALL = "pip install 'ds_mamba_spcp[hf]'"

# keys describing a whole packed row, which no shard can use: the documents travel in position_ids
_WHOLE_ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_STATE_ATTR = "_ds_mamba_spcp_accelerate"  # a prepared model's _Covered, in its __dict__

_patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) of what enable() replaced, in order
# whether this package shards the model accelerate prepared last (then the next data-loader adapter is ours)
_adapter_is_ours = False


# -- enable / disable -------------------------------------------------------------------------------


def enable() -> None:
    """Makes accelerate's DeepSpeed sequence parallelism (so the Trainer's and TRL's) shard transformers'
    Mamba2-style models with this package; call once per process, before the ``Trainer``, ``SFTTrainer`` or
    ``Accelerator`` is built. Idempotent; ``disable()`` undoes it. Models without one of ``MIXER_CLASSES`` keep
    accelerate's behaviour exactly."""
    if _patches:
        return
    try:
        import accelerate.accelerator as accelerator_mod
        import transformers.trainer as trainer_mod
        from deepspeed.runtime.sequence_parallel import ulysses_sp
    except ImportError as e:
        raise ImportError(
            f"ds_mamba_spcp.integrations.accelerate needs accelerate, transformers and DeepSpeed: {_INSTALL} (tested "
            f"with {TESTED})."
        ) from e
    targets = [
        (accelerator_mod.Accelerator, "_prepare_deepspeed", _prepare_deepspeed),
        (accelerator_mod, "_refuse_recurrent_layers_under_sequence_parallelism", _refuse_unless_covered),
        (ulysses_sp.UlyssesSPAttentionHF, "register_with_transformers", classmethod(_register_with_transformers)),
        (ulysses_sp, "UlyssesSPDataLoaderAdapter", _adapter_class(ulysses_sp.UlyssesSPDataLoaderAdapter)),
        (trainer_mod, "deepspeed_sp_compute_loss", _compute_loss),
        (trainer_mod, "skip_first_batches", _skip_first_batches),
        (trainer_mod.Trainer, "get_batch_samples", _get_batch_samples),
        (trainer_mod.Trainer, "_set_signature_columns_if_needed", _set_signature_columns),
    ]
    missing = [f"{getattr(o, '__name__', o)}.{a}" for o, a, _ in targets if a not in vars(o)]
    if missing:
        raise ImportError(
            f"ds_mamba_spcp.integrations.accelerate cannot find {', '.join(missing)} in the installed accelerate / "
            f"transformers / DeepSpeed; it was written against {TESTED}. Install those releases ({_INSTALL})."
        )
    for owner, name, replacement in targets:
        _patches.append((owner, name, vars(owner)[name]))
        setattr(owner, name, replacement)


def disable() -> None:
    """Undoes ``enable()`` (models prepared meanwhile stay prepared)."""
    global _adapter_is_ours
    while _patches:
        owner, name, original = _patches.pop()
        setattr(owner, name, original)
    _adapter_is_ours = False


def enabled() -> bool:
    return bool(_patches)


def _original(attr: str):
    """What enable() replaced under the name ``attr`` (the names differ)."""
    for _, name, original in _patches:
        if name == attr:
            return original
    raise RuntimeError(
        f"ds_mamba_spcp.integrations.transformers.accelerate: {attr} is not replaced (enable() was undone)"
    )


# -- which models, which settings -------------------------------------------------------------------


def _ds_config() -> dict:
    """The ds_config of accelerate's active DeepSpeed plugin (the Trainer's ``deepspeed=`` argument, "auto"s filled)."""
    from accelerate.state import AcceleratorState

    plugin = AcceleratorState().deepspeed_plugin
    if plugin is None:
        raise RuntimeError("accelerate's sequence parallelism reached DeepSpeed without a DeepSpeed plugin")
    return plugin.deepspeed_config


def _holds_mixers(model: nn.Module) -> bool:
    from ds_mamba_spcp.integrations.transformers.delta import delta_classes

    classes = mixer_classes() + delta_classes()  # the Mamba2 mixers and the Gated DeltaNet layers
    return bool(classes) and any(isinstance(m, classes) for m in model.modules())


def _covered_section(model: nn.Module, ds_config: dict) -> dict | None:
    """The ``"mamba_sequence_parallel"`` section of ``ds_config`` (``"enabled": true`` added) when this package
    shards ``model``: it holds a Mamba2 mixer and the section does not say ``"enabled": false``; else None."""
    if not _holds_mixers(model):
        return None
    section = ds_config.get(SECTION)
    if section is not None and not isinstance(section, dict):
        raise TypeError(f'the "{SECTION}" section of the ds_config must be a JSON object, got {type(section).__name__}')
    if section is not None and section.get("enabled") is False:
        warnings.warn(
            f'"{SECTION}.enabled" is false: {type(model).__qualname__} holds Mamba2 mixers, which accelerate\'s '
            "sequence parallelism shards without passing their state between ranks (accelerate refuses the "
            "families whose config lists linear_attention layers; Falcon-H1 then trains with wrong gradients).",
            stacklevel=3,
        )
        return None
    return {"enabled": True, **(section or {})}


def _validated_config(section: dict, ds_config: dict, sp_size: int) -> MambaSequenceParallelConfig:
    """The settings parsed from ``ds_config`` with ``section`` for a group of ``sp_size``; ValueError naming the key
    for what accelerate's path cannot honour. Every rank reads the same ds_config, so every rank raises alike,
    before any collective."""
    sizes = {
        f'"{SECTION}.sequence_parallel_size"': section.get("sequence_parallel_size"),
        'the ds_config\'s "sequence_parallel_size"': ds_config.get("sequence_parallel_size"),
    }
    for where, value in sizes.items():
        if value is not None and value != sp_size:
            raise ValueError(
                f"{where} is {value!r} but accelerate's ParallelismConfig has sp_size={sp_size}; drop the key or make "
                "them equal."
            )
    cfg = load_mamba_sp_config({**ds_config, SECTION: {**section, "sequence_parallel_size": sp_size}})
    if cfg.input_layout != modes.CONTIGUOUS:
        raise ValueError(
            f'"{SECTION}.input_layout" is {cfg.input_layout!r}, but under accelerate DeepSpeed\'s '
            'UlyssesSPDataLoaderAdapter cuts every row into contiguous shards; set "input_layout": "contiguous" '
            '(and "load_balancing": "none"), or shard the data yourself in a hand-written loop.'
        )
    try:
        grad_scale(cfg.deepspeed.zero_stage, sp_size, reduce_scatter=cfg.deepspeed.reduce_scatter)
    except ValueError as e:
        raise ValueError(f"{e} (the Trainer's sequence-parallel loss cannot be scaled right otherwise)") from None
    return cfg


class _Covered:
    """What enable() keeps on a prepared model (its ``__dict__``)."""

    def __init__(self, cfg: MambaSequenceParallelConfig, mpu, seq_length: int | None) -> None:
        self.cfg, self.mpu, self.seq_length = cfg, mpu, seq_length
        self.pauses: list = []  # one entry per model call in flight: its sequence_parallel_disabled block, or None
        self.grad_scale: float | None = None  # grad_scale_for_engine, read at the first loss
        self.window: _Window | None = None  # the Trainer's accumulation window in progress (_get_batch_samples)


class _Window:
    """One optimizer step's micro-batches as the Trainer fetched them (``get_batch_samples``): the scored tokens
    of their whole rows, and the factor that undoes the Trainer's division of each loss by their number."""

    def __init__(self, scored: torch.Tensor, micro_batches: int, factor: float) -> None:
        self.scored, self.remaining, self.factor = scored, micro_batches, factor


class _Preparing:
    """One call of accelerate's ``_prepare_deepspeed``: its sequence-parallel size and, per model, the settings read
    from the plugin's ds_config (``_settings``), once for the hooks it calls."""

    def __init__(self, sp_size: int) -> None:
        self.sp_size = sp_size
        self.settings: dict[int, MambaSequenceParallelConfig | None] = {}


_preparing: _Preparing | None = None  # the _prepare_deepspeed call in progress


def _settings(model: nn.Module, sp_size: int) -> MambaSequenceParallelConfig | None:
    """The settings of ``model`` for a group of ``sp_size`` > 1 (the plugin's ds_config read and parsed once per
    ``_prepare_deepspeed`` call), or None when this package does not shard it."""
    known = _preparing is not None and id(model) in _preparing.settings
    if known:
        return _preparing.settings[id(model)]
    cfg = None
    if _holds_mixers(model):
        ds_config = _ds_config()
        section = _covered_section(model, ds_config)
        cfg = None if section is None else _validated_config(section, ds_config, sp_size)
    if _preparing is not None:
        _preparing.settings[id(model)] = cfg
    return cfg


def _covered_state(model: nn.Module) -> _Covered | None:
    for m in (model, getattr(model, "module", None)):  # the model, or a DeepSpeed engine holding it
        state = getattr(m, "__dict__", {}).get(_STATE_ATTR)
        if state is not None:
            return state
    return None


# -- the replacements -------------------------------------------------------------------------------


def _prepare_deepspeed(accelerator, *args):
    """accelerate's ``Accelerator._prepare_deepspeed``; before it, without DeepSpeed's sequence parallelism, a model
    holding the mixers gets the section's ``"long_context"`` on a group of one (``prepare_long_context``). The hooks
    it calls read each model's settings once (``_settings``)."""
    global _preparing
    pc = accelerator.parallelism_config
    sp_on = pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled and pc.sp_size > 1
    if not sp_on:
        for obj in args:
            if isinstance(obj, nn.Module):
                _long_context_alone(obj)
    outer, _preparing = _preparing, _Preparing(pc.sp_size if sp_on else 1)
    try:
        return _original("_prepare_deepspeed")(accelerator, *args)
    finally:
        _preparing = outer


def _long_context_alone(model: nn.Module) -> None:
    if not _holds_mixers(model):
        return
    ds_config = _ds_config()
    section = _covered_section(model, ds_config)
    if section is None or section.get("long_context") in (None, False):
        return
    from ds_mamba_spcp.integrations.transformers.adapter import prepare_long_context

    sizes = (section.get("sequence_parallel_size"), ds_config.get("sequence_parallel_size"))
    if any(isinstance(n, int) and n > 1 for n in sizes):
        raise ValueError(
            "the ds_config sets a sequence_parallel_size above 1 but accelerate's ParallelismConfig has no DeepSpeed "
            'sequence parallelism: set ParallelismConfig(sp_backend="deepspeed", sp_size=N), or drop the key.'
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _init_deepspeed_comm()
    prepare_long_context(model, load_mamba_sp_config({**ds_config, SECTION: {**section, "sequence_parallel_size": 1}}))


def _refuse_unless_covered(model: nn.Module) -> None:
    """accelerate's refusal of recurrent layers, for every model this package does not shard."""
    if _preparing is not None and _preparing.sp_size > 1:
        covered = _settings(model, _preparing.sp_size) is not None
    else:
        covered = _holds_mixers(model) and _covered_section(model, _ds_config()) is not None
    if not covered:
        _original("_refuse_recurrent_layers_under_sequence_parallelism")(model)


def _register_with_transformers(
    cls,
    model_name_or_path,
    core_attn_implementation,
    sequence_parallel_size,
    micro_batch_size,
    seq_length=None,
    seq_length_is_variable=True,
    disable_in_eval=False,
    max_length=None,
):
    """DeepSpeed's registration for other models; for a covered one, ``prepare_sequence_parallel``, once per model
    (prepared again, it keeps its mixers, hooks and group)."""
    global _adapter_is_ours
    model = model_name_or_path
    cfg = None
    if isinstance(model, nn.Module) and sequence_parallel_size > 1:
        cfg = _settings(model, sequence_parallel_size)  # the one parse of this prepare (the hook before read it)
    _adapter_is_ours = cfg is not None
    if cfg is None:
        original = _original("register_with_transformers").__func__
        return original(
            cls, model_name_or_path, core_attn_implementation, sequence_parallel_size, micro_batch_size,
            seq_length=seq_length, seq_length_is_variable=seq_length_is_variable, disable_in_eval=disable_in_eval,
            max_length=max_length,
        )  # fmt: skip
    _init_deepspeed_comm()
    seq_length = seq_length if seq_length is not None else max_length
    seq_length = None if seq_length_is_variable else seq_length
    state = model.__dict__.get(_STATE_ATTR)
    if state is not None:
        # the section and size (the rest of the ds_config, the ZeRO stage among it, may differ between two engines)
        if state.cfg.model_dump() != cfg.model_dump():
            raise ValueError(
                f"{type(model).__qualname__} was prepared for sequence parallelism with {state.cfg!r} and is prepared "
                f"again with {cfg!r}; a model's mixers are sharded once: keep the ds_config's \"{SECTION}\" section "
                "and sp_size, or build a fresh model."
            )
        # the new engine may run another ZeRO stage (grad_scale is read again at its first loss)
        state.cfg, state.seq_length, state.grad_scale = cfg, seq_length, None
        return state.mpu
    mpu = prepare_sequence_parallel(model, cfg)
    model.__dict__[_STATE_ATTR] = _Covered(cfg, mpu, seq_length)
    # before prepare_sequence_parallel's own check: unsharded in eval(), seq_idx from packed position_ids
    model.register_forward_pre_hook(_before_call, with_kwargs=True, prepend=True)
    model.register_forward_hook(_after_call, always_call=True)
    return mpu


def _init_deepspeed_comm() -> None:
    """accelerate starts torch.distributed on CPU, not deepspeed.comm, which DeepSpeed's sequence-parallel state
    asserts: bring deepspeed.comm up on the existing process group."""
    import deepspeed
    import deepspeed.comm as dist

    if dist.is_initialized():
        return
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "sequence parallelism needs a distributed launch: start the script with torchrun, accelerate launch or "
            "the deepspeed launcher (WORLD_SIZE > 1)."
        )
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)


def _before_call(model: nn.Module, args: tuple, kwargs: dict):
    state = model.__dict__[_STATE_ATTR]
    if not model.training:  # evaluation, generate: whole sequences on every rank
        block = sequence_parallel_disabled(model)
        block.__enter__()
        state.pauses.append(block)
        return None
    state.pauses.append(None)
    group = state.mpu.get_sequence_parallel_group()
    sp = state.mpu.get_sequence_parallel_world_size()
    name = type(model).__qualname__
    if kwargs.get("labels") is not None:
        _refuse_local_aux_losses(model, kwargs)
    tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if state.seq_length is not None and torch.is_tensor(tokens) and tokens.shape[1] * sp != state.seq_length:
        raise ValueError(
            f"{name} got rows of {tokens.shape[1] * sp} tokens ({tokens.shape[1]} on each of {sp} ranks) but "
            f"accelerate's DeepSpeedSequenceParallelConfig fixes sp_seq_length={state.seq_length} "
            "(sp_seq_length_is_variable=False); set sp_seq_length_is_variable=True, or give every row that length."
        )
    changed = {}
    if _mask_after_scored(kwargs.get("attention_mask"), kwargs.get("shift_labels"), group, sp):
        changed["attention_mask"] = None  # what the call gets without a mask
        from ds_mamba_spcp.integrations.transformers import router_loss

        router_loss.hand_over(model, kwargs["attention_mask"])  # its rows weighted by the mask (router_loss.py)
    position_ids = kwargs.get("position_ids")
    if kwargs.get("seq_idx") is None and torch.is_tensor(position_ids) and position_ids.dim() == 2:
        seq_idx = packed_seq_idx(position_ids, group, sp)
        if seq_idx is not None:
            changed["seq_idx"] = seq_idx
    return (args, {**kwargs, **changed}) if changed else None


def _mask_after_scored(mask, shift_labels, group, sp: int) -> bool:
    """Whether every zero of a training call's ``attention_mask`` shard lies, in its whole row, after the row's last
    scored position (right padding): then the call drops the mask, exactly (causal: no scored output reads those
    tokens), where the mixers refuse zeros. The adapter leaves the mask in the micro-batch, so that the Trainer and
    TRL count its tokens (TRL's ``num_tokens``: ``attention_mask.sum()``, else ``position_ids.size(1)``). One
    all-reduce of two numbers per row; every rank of the group has the same keys and shapes, so all take it alike."""
    if not (torch.is_tensor(mask) and torch.is_tensor(shift_labels) and mask.dim() == 2):
        return False
    if mask.shape != shift_labels.shape:
        return False
    import deepspeed.comm as dist

    length = mask.shape[1]
    index = torch.arange(length, device=mask.device) + dist.get_rank(group=group) * length  # contiguous shards
    first_zero = torch.where(mask == 0, index, sp * length).amin(dim=1)
    last_scored = torch.where(shift_labels.to(mask.device) != IGNORE_INDEX, index, -1).amax(dim=1)
    both = torch.stack([-first_zero, last_scored])  # (2, rows): one MAX reduces both
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return bool((-both[0] > both[1]).all())


def _after_call(model: nn.Module, args, output):
    state = model.__dict__[_STATE_ATTR]
    block = state.pauses.pop() if state.pauses else None
    if block is not None:
        block.__exit__(None, None, None)
    return None


def _refuse_local_aux_losses(model: nn.Module, kwargs: dict) -> None:
    """The Trainer's sequence-parallel loss weights each rank's model loss by its scored tokens: right for the
    token mean, wrong for the extra terms some families add to it from this rank's shard alone (the router loss
    of ``router_loss.ROUTER_LOSS_CLASSES`` is the group's: router_loss.py)."""
    from ds_mamba_spcp.integrations.transformers import router_loss

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = type(model).__qualname__
    if (
        (kwargs.get("output_router_logits") or getattr(config, "output_router_logits", False))
        and getattr(config, "router_aux_loss_coef", 0.0)
        and not router_loss.installed(model)  # summed over the group there (router_loss.py)
    ):
        raise NotImplementedError(
            f"{name} adds the router's load-balancing loss to its loss; under sequence parallelism each rank would "
            "compute it from its own shard's router logits (a product of per-shard means, not the sequence's). Set "
            "config.output_router_logits=False (TRL: router_aux_loss_coef=0.0) for sequence-parallel training."
        )
    if getattr(config, "z_loss_coefficient", 0.0):
        raise NotImplementedError(
            f"{name} adds a z-loss (z_loss_coefficient={config.z_loss_coefficient}) averaged over this rank's shard "
            "only; set config.z_loss_coefficient=0.0 for sequence-parallel training."
        )


def packed_seq_idx(position_ids: torch.Tensor, group, sp: int) -> torch.Tensor | None:
    """Document labels (batch, local_seqlen) int32 of this rank's contiguous shard of packed rows, from
    ``position_ids`` that restart at 0 at every document; None when no rank's shard has a restart. A label counts
    the restarts before a token in the whole row (one all-gather of (batch,) counts), so a document crossing the
    border keeps its label and one starting at the border gets a new one."""
    import deepspeed.comm as dist

    rank = dist.get_rank(group=group)
    starts = position_ids == 0
    if rank == 0:
        starts[:, 0] = False  # the row's first token starts no new document
    counts = starts.sum(dim=1)
    gathered = [torch.empty_like(counts) for _ in range(sp)]
    dist.all_gather(gathered, counts, group=group)
    gathered = torch.stack(gathered)  # [sp, batch]
    if not bool(gathered.any()):
        return None
    before = gathered[:rank].sum(dim=0)  # restarts on the ranks before this one, per row
    return (before[:, None] + starts.cumsum(dim=1)).to(torch.int32)


def _skip_first_batches(dataloader, num_batches=0):
    """accelerate's skip_first_batches (the Trainer's resume) would rebuild a plain DataLoader without the adapter:
    the adapter skips its own micro-batches instead."""
    if hasattr(dataloader, "skip") and hasattr(dataloader, "micro_batches"):
        return dataloader.skip(num_batches)
    return _original("skip_first_batches")(dataloader, num_batches)


def _set_signature_columns(trainer) -> None:
    """The Trainer's kept dataset columns, with ``position_ids`` for a model holding the mixers under DeepSpeed's
    sequence parallelism (``Mamba2ForCausalLM.forward`` takes them in ``**kwargs`` only, so
    ``remove_unused_columns`` would drop the documents of packed rows)."""
    _original("_set_signature_columns_if_needed")(trainer)
    pc = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    columns = trainer._signature_columns
    if (
        pc is not None
        and pc.sp_backend == "deepspeed"
        and pc.sp_enabled
        and isinstance(trainer.model, nn.Module)
        and _holds_mixers(trainer.model)
        and isinstance(columns, list)
        and "position_ids" not in columns
    ):
        columns.append("position_ids")


def _get_batch_samples(trainer, epoch_iterator, num_batches, device):
    """The Trainer's fetch of one optimizer step's micro-batches. For a model this package shards, under DeepSpeed's
    sequence parallelism, it also counts their scored tokens over the whole rows (``_Window``): the Trainer sets
    ``model_accepts_loss_kwargs`` off under sequence parallelism, so it counts none (``num_items_in_batch`` None) and
    would average the micro-batches alike, while one process divides every micro-batch's token sum by the tokens of
    the whole step (transformers' ``num_items_in_batch``)."""
    batch_samples, num_items = _original("get_batch_samples")(trainer, epoch_iterator, num_batches, device)
    model = getattr(trainer, "model", None)
    state = _covered_state(model) if isinstance(model, nn.Module) else None
    if state is None:
        return batch_samples, num_items
    state.window = None
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    sp_on = pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled and pc.sp_size > 1
    if not sp_on or not batch_samples or not all("shift_labels" in b for b in batch_samples):
        return batch_samples, num_items  # _compute_loss raises for a batch without shift_labels
    import deepspeed.comm as dist

    scored = sum((b["shift_labels"] != IGNORE_INDEX).sum() for b in batch_samples).to(device, torch.float32)
    sp = state.mpu.get_sequence_parallel_world_size()
    dp = dist.get_world_size() // sp
    if trainer.args.average_tokens_across_devices and dp > 1:
        # transformers' average over devices: the tokens of every replica; DeepSpeed then averages the replicas'
        # gradients (a division by dp that the factor undoes)
        dist.all_reduce(scored)
    else:
        dist.all_reduce(scored, group=state.mpu.get_sequence_parallel_group())
        dp = 1
    # training_step divides each micro-batch's loss by their number unless it counts the loss as scaled already
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None
    state.window = _Window(scored, len(batch_samples), float(dp * (1 if scaled else len(batch_samples))))
    return batch_samples, num_items


def _compute_loss(accelerator, model, inputs, return_outputs, pc):
    """transformers' ``deepspeed_sp_compute_loss`` with the gradient scaled for the ZeRO stage (module docstring),
    the token sum divided by the scored tokens of the whole optimizer step (``_get_batch_samples``)."""
    state = _covered_state(model)
    if state is None:
        return _original("deepspeed_sp_compute_loss")(accelerator, model, inputs, return_outputs, pc)
    if "shift_labels" not in inputs:
        raise ValueError(
            "the Trainer's sequence-parallel loss needs shift_labels (labels shifted before sharding), which "
            "DeepSpeed's UlyssesSPDataLoaderAdapter adds; pass labels in every batch."
        )
    if inputs.get("labels") is None:
        inputs["labels"] = inputs["shift_labels"]  # the model's loss then scores shift_labels without shifting
    outputs = model(**inputs)
    if state.grad_scale is None:
        engine = model if hasattr(model, "zero_optimization_stage") else accelerator.deepspeed_engine_wrapped.engine
        state.grad_scale = grad_scale_for_engine(engine)
    group = state.mpu.get_sequence_parallel_group()
    scored = (inputs["shift_labels"] != IGNORE_INDEX).sum()
    local_mean = outputs.loss
    # a shard with no scored token: the model's mean is 0/0; where() keeps its gradient zero (not NaN)
    token_sum = torch.where(scored > 0, local_mean * scored, torch.zeros_like(local_mean))
    counts = torch.stack([token_sum.detach().float(), scored.to(torch.float32)])
    import deepspeed.comm as dist

    dist.all_reduce(counts, group=group)
    total, ntokens, factor = counts[0], counts[1], 1.0
    window = state.window
    if window is not None and window.remaining > 0:  # a micro-batch of the step the Trainer fetched last
        window.remaining -= 1
        ntokens, factor = window.scored.to(counts.device), window.factor
    ntokens = ntokens.clamp_min(1)
    share = token_sum * (state.grad_scale * factor / ntokens)
    # the value is the group's share of the step's mean, times the factor the Trainer divides by (the same on every
    # rank); the gradient is this rank's share
    loss = share + (total * factor / ntokens - share).detach()
    return (loss, outputs) if return_outputs else loss


# -- the data: DeepSpeed's adapter, with rows of any length on any backend, checked on every rank ---


def _adapter_class(base: type) -> type:
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` with its own ``refill``, for a model this package shards
    (``_adapter_is_ours``; any other model gets DeepSpeed's adapter itself). Each rank gets its contiguous shard of
    every rank's batch in turn, labels shifted before the cut. Unlike DeepSpeed's (gloo refuses unequal sizes) it
    pads to the group's longest row and batch, gathers, and crops. It raises, on every rank, for a row the group
    cannot cut evenly and for packed rows without ``position_ids``; rows without them are whole documents and get
    ``0 .. seqlen-1``. It drops ``_WHOLE_ROW_KEYS``; a row's trailing padding is not a document
    (``_padding_as_tail``)."""

    class UlyssesSPDataLoaderAdapter(base):
        __doc__ = base.__doc__

        def __new__(cls, *args, **kwargs):
            if not _adapter_is_ours:  # the model prepared last is not sharded by this package: DeepSpeed's adapter
                return base(*args, **kwargs)
            return super().__new__(cls)

        def refill(self):
            import deepspeed.comm as dist

            try:
                batch = next(self.iter)
            except StopIteration:
                self.iter = iter(self.dl)  # as DeepSpeed's: the next epoch starts afresh
                raise
            whole_row = [k for k in _WHOLE_ROW_KEYS if k in batch]
            batch = {k: v for k, v in batch.items() if k not in _WHOLE_ROW_KEYS}
            problem, rows, length = _check_batch(batch, whole_row)
            sp, group = self.sp_world_size, self.sp_group
            # a flag for this rank's problem travels with its shape, so that every rank raises alike
            shape = torch.tensor([rows, length, problem is not None], dtype=torch.int64, device=self.device)
            shapes = [torch.empty_like(shape) for _ in range(sp)]
            dist.all_gather(shapes, shape, group=group)
            shapes = [tuple(int(v) for v in s.tolist()) for s in shapes]
            failing = [r for r, (_, _, flag) in enumerate(shapes) if flag]
            if failing:
                problems = [None] * sp
                dist.all_gather_object(problems, problem, group=group)
                raise ValueError(f"rank {failing[0]} of the sequence-parallel group: {problems[failing[0]]}")
            shapes = [(r, n) for r, n, _ in shapes]
            bad = [n for _, n in shapes if n % sp]
            if bad:
                raise ValueError(
                    f"rows of {bad[0]} tokens cannot be cut into {sp} equal sequence shards (the group's ranks hold "
                    f"rows of {[n for _, n in shapes]} tokens). Make every row's length a multiple of sp_size={sp}: "
                    f"pad_to_multiple_of={sp} in the data collator (TRL: SFTConfig(pad_to_multiple_of={sp})) with "
                    "labels -100 on the padding (right padding, which no loss sees), or crop the rows."
                )
            if "position_ids" not in batch:  # unpacked rows (_check_batch): the positions of whole rows
                batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
            most_rows, longest = max(r for r, _ in shapes), max(n for _, n in shapes)
            per_rank: list[dict] = [{} for _ in range(sp)]
            for key, value in batch.items():
                if not torch.is_tensor(value):
                    objects = [None] * sp
                    dist.all_gather_object(objects, value, group=group)
                    for r in range(sp):
                        per_rank[r][key] = objects[r]
                    continue
                padded = value.new_zeros((most_rows, longest, *value.shape[2:]), device=self.device)
                padded[:rows, :length] = value.to(self.device)
                gathered = [torch.empty_like(padded) for _ in range(sp)]
                with torch.no_grad():
                    dist.all_gather(gathered, padded, group=group)
                for r, (n_rows, n) in enumerate(shapes):
                    per_rank[r][key] = gathered[r][:n_rows, :n]
            for one in per_rank:  # every rank's batch, in rank order: this rank's shard of each
                chunk = one["input_ids"].shape[1] // sp
                if "labels" in one:
                    _padding_as_tail(one)
                    one["shift_labels"] = shift_labels(one.pop("labels"))
                for key, value in one.items():
                    if torch.is_tensor(value):
                        one[key] = value[:, chunk * self.sp_rank : chunk * (self.sp_rank + 1)].cpu()
                self.micro_batches.append(one)

        def skip(self, batches: int):
            """Consumes ``batches`` micro-batches (resuming mid-epoch: every rank skips alike, refills included)."""
            for _ in range(batches):
                next(self)
            return self

        def set_epoch(self, epoch: int) -> None:
            # the Trainer reseeds its loader's sampler per epoch through set_epoch, which DeepSpeed's adapter hides
            if hasattr(self.dl, "set_epoch"):
                self.dl.set_epoch(epoch)

    UlyssesSPDataLoaderAdapter.__qualname__ = base.__qualname__
    UlyssesSPDataLoaderAdapter.__module__ = __name__
    return UlyssesSPDataLoaderAdapter


def _padding_as_tail(batch: dict) -> None:
    """In place, on one batch of whole rows (labels not yet shifted): a row's trailing tokens that no loss sees are
    not a document. From the first position restart inside the trailing run of labels -100 to the row's end,
    positions continue those before it. Exact: those tokens come after every scored one, so nothing flows from
    them to a scored token. A restart before the run stays a document. The ``attention_mask`` stays (the Trainer's
    and TRL's token counts read it); the model's call drops it when its zeros are such padding
    (``_mask_after_scored``)."""
    labels, positions = batch["labels"], batch.get("position_ids")
    if not (torch.is_tensor(labels) and torch.is_tensor(positions) and labels.dim() == 2 and positions.dim() == 2):
        return
    length = labels.shape[1]
    index = torch.arange(length, device=labels.device)
    # the trailing run of labels -100 begins after the last scored label (at `length` where the last one is scored)
    tail = index >= torch.where(labels != IGNORE_INDEX, index, -1).amax(dim=1, keepdim=True) + 1
    first = torch.where((positions == 0) & tail & (index > 0), index, length).amin(dim=1, keepdim=True)  # (rows, 1)
    if bool((first < length).any()):
        before = positions.gather(1, (first - 1).clamp(0, length - 1))  # the position before the restart
        batch["position_ids"] = torch.where(index >= first, before + 1 + (index - first), positions).to(positions.dtype)


def _check_batch(batch: dict, whole_row: list[str]) -> tuple[str | None, int, int]:
    """(what is wrong with one rank's batch or None, rows, seqlen), before any collective."""
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        shape = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
        return (
            f"sequence parallelism needs 'input_ids' (batch, seqlen) in every batch, got {shape}; every tensor of the "
            "batch is cut along dim 1 with it.", 0, 0,
        )  # fmt: skip
    rows, length = ids.shape
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or tuple(value.shape[:2]) != (rows, length)):
            return (
                f"{key!r} has shape {tuple(value.shape)} but input_ids is {(rows, length)}: every tensor of a batch "
                "is cut along dim 1, so it must be (batch, seqlen, ...).", rows, length,
            )  # fmt: skip
    positions = batch.get("position_ids")
    if positions is not None and not torch.is_tensor(positions):
        return f"'position_ids' must be a (batch, seqlen) tensor, got {type(positions).__name__}.", rows, length
    if positions is None and whole_row:
        return (
            f"packed rows (the batch has {', '.join(whole_row)}) without 'position_ids': the documents of a row cut "
            "across ranks travel in position_ids restarting at 0 per document. Have the data collator return them "
            "(DataCollatorWithFlattening(return_position_ids=True)); a Trainer keeps the dataset's position_ids "
            "column for these models once enable() is called.", rows, length,
        )  # fmt: skip
    return None, rows, length


__all__ = ["MIXER_CLASSES", "disable", "enable", "enabled", "packed_seq_idx"]
