"""The ``"mamba_sequence_parallel"`` section of a DeepSpeed ds_config (next to the top-level
``"sequence_parallel_size"``), e.g. ``{"enabled": true, "mode": "state_passing", "load_balancing": "virtual",
"input_layout": "zigzag"}``.

DeepSpeed ignores the section; :func:`load_mamba_sp_config` reads and validates it once, and what depends on
the model (head and group counts) is checked by :meth:`MambaSequenceParallelConfig.validate_for_mixer`. The
keys' table: docs/usage.md, "The ds_config section".

The parsed config is the one object the package's entry points hand down (``prepare_sequence_parallel``,
``enable()``'s hooks, the wrappers): beside the section it carries, as ``config.deepspeed``
(:class:`DeepSpeedSettings`), what the package reads from the rest of the same ds_config (ZeRO stage and
``reduce_scatter``, bf16, the gradient accumulation dtype, optimizer offload), so that no function below an entry
point reads the raw ds_config again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from ds_mamba_spcp.engine import exchange, modes
from ds_mamba_spcp.ops import BACKENDS

SECTION = "mamba_sequence_parallel"
"""Name of the ds_config section read by :func:`load_mamba_sp_config`."""

_TOP_LEVEL_SP_SIZE = "sequence_parallel_size"
_OP = {"op": True}  # a field that is also an option of the op: it becomes a field of ``Options`` (below)


@dataclasses.dataclass(frozen=True)
class DeepSpeedSettings:
    """What the package reads from the ds_config outside its section, read by :func:`load_mamba_sp_config` with it
    (a config built from the section alone has the defaults: DeepSpeed's own, ZeRO stage 0 and no bf16)."""

    zero_stage: int | None = 0
    """``zero_optimization.stage`` (None where it is not an int yet: accelerate's ``"auto"``)."""
    reduce_scatter: bool = True
    """``zero_optimization.reduce_scatter``."""
    bf16: bool = False
    """``bf16.enabled`` (or the older ``bfloat16``)."""
    grad_accum_dtype: str | None = None
    """``data_types.grad_accum_dtype``: the dtype DeepSpeed accumulates gradients in across micro-batches."""
    offload_optimizer: str = "none"
    """``zero_optimization.offload_optimizer.device``."""

    @classmethod
    def from_ds_config(cls, ds_config: Mapping) -> DeepSpeedSettings:
        def part(mapping: Mapping, *keys: str) -> Mapping:  # a sub-object, {} where absent or not an object
            value = next((mapping[k] for k in keys if k in mapping), None)
            return value if isinstance(value, Mapping) else {}

        zero = part(ds_config, "zero_optimization")
        stage = zero.get("stage", 0)
        if isinstance(stage, str) and stage.isdigit():
            stage = int(stage)
        return cls(
            zero_stage=stage if isinstance(stage, int) and not isinstance(stage, bool) else None,
            reduce_scatter=bool(zero.get("reduce_scatter", True)),
            bf16=bool(part(ds_config, "bf16", "bfloat16").get("enabled", False)),
            grad_accum_dtype=part(ds_config, "data_types").get("grad_accum_dtype"),
            offload_optimizer=str(part(zero, "offload_optimizer").get("device", "none")).lower(),
        )

    @property
    def selects_bf16_optimizer(self) -> bool:
        """Whether DeepSpeed 0.19.8 wraps the optimizer in its ``BF16_Optimizer``: ZeRO stage 1, bf16,
        ``"grad_accum_dtype": "fp32"``, no CPU optimizer offload (``_do_optimizer_sanity_check``)."""
        import torch
        from deepspeed.runtime.config import DtypeEnum

        return (
            self.zero_stage == 1
            and self.bf16
            and self.grad_accum_dtype is not None
            and DtypeEnum(self.grad_accum_dtype).value == torch.float32
            and self.offload_optimizer != "cpu"
        )


class LongContext(DeepSpeedConfigModel):
    """The ``"long_context"`` key of the section: per-token memory that stays flat in the sequence length for the
    layers of transformers' Mamba2 families (``integrations/transformers/long_context.py``). Each part can be turned
    off alone; ``true`` in the ds_config means every default below."""

    model_config = ConfigDict(use_attribute_docstrings=True, frozen=True)

    tile_tokens: int = Field(default=32768, ge=1, strict=True)
    """Tokens per tile of this rank's shard, for the layer recompute, the MLPs and the loss."""

    tiled_layers: bool = True
    """Decoder layers whose sequence mixer is a Mamba2 mixer are their own activation checkpoint and are recomputed
    in backward tile by tile, the conv halo and the fp32 state carried (norms, mixer, residuals and the layer's MLP);
    every other decoder layer is checkpointed whole. Gated DeltaNet layers are not tiled: at the default they are
    recomputed whole inside their decoder layer's checkpoint (said once in a warning); set to true on a model with no
    Mamba2 layer to tile, the key refuses. Any ZeRO stage (under ZeRO-3 a tiled layer's parameters are gathered once
    per pass, not per tile)."""

    tiled_mlp: bool = True
    """The MLPs outside tiled layers run tile by tile, recomputed in backward (DeepSpeed's ``TiledMLP``)."""

    fused_loss: bool = True
    """In training, the causal-LM loss is computed tile by tile from the last hidden states and the head's weight,
    never holding the (tokens x vocab) logits; the model then returns no logits."""

    loss_tile_tokens: int | None = Field(default=None, ge=1, strict=True)
    """Tokens per tile of the fused loss. ``None``: 2**29 logits per tile (4,194 tokens at a vocabulary of 128,000:
    3 GiB of bf16 and fp32 logits), at most ``tile_tokens``."""

    offload_gpu_budget_gib: float | None = Field(default=None, ge=0)
    """Layer checkpoints (each layer's input) kept on the GPU up to this many GiB per pass; the rest go to pinned
    host memory, checked before the first step (``memory/offload.py``). ``None``: all stay on the GPU."""

    @model_validator(mode="before")
    @classmethod
    def _from_bool(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            allowed = cls.model_fields
            unknown = [k for k in data if k not in allowed]
            if unknown:
                raise ValueError(
                    f'unknown key(s) {", ".join(map(repr, unknown))} in "{SECTION}.long_context"; allowed keys: '
                    f"{', '.join(allowed)}."
                )
        return data


class MambaSequenceParallelConfig(DeepSpeedConfigModel):
    """Sequence parallelism for Mamba2 mixers, read from ``ds_config["mamba_sequence_parallel"]``; fields and
    cross-field rules are checked when it is built, the model's shapes in :meth:`validate_for_mixer`."""

    # field docstrings are the JSON-schema descriptions; frozen: validated once, shared by every layer
    model_config = ConfigDict(use_attribute_docstrings=True, frozen=True)
    # the rest of the ds_config (not a key of the section): set by load_mamba_sp_config, read as ``deepspeed``
    _deepspeed: DeepSpeedSettings = PrivateAttr(default_factory=DeepSpeedSettings)

    enabled: bool = False
    """Turn the Mamba2 sequence-parallel path on. When False the wrapper runs the plain local mixer."""

    mode: Literal[modes.MODES] = Field(default=modes.STATE_PASSING, json_schema_extra=_OP)
    """How ranks cooperate. ``"state_passing"`` keeps each rank's shard and exchanges only the conv halo and an
    fp32 state summary; ``"ulysses"`` re-shards with all-to-all (``[L/cp, heads] -> [L, heads/cp]``), scans the
    full length on a head slice and re-shards back."""

    load_balancing: Literal[modes.LOAD_BALANCING] = Field(default=modes.NONE, json_schema_extra=_OP)
    """How the causal chain is balanced across ranks (``"state_passing"`` mode only; ``"ulysses"``
    needs ``"none"``). ``"none"``: segments follow rank order (contiguous input). ``"virtual"``: each
    rank's two zigzag chunks become two causal segments packed on the batch dim, no activation moves.
    ``"permute_p2p"`` / ``"permute_a2a"``: zigzag input is permuted to contiguous and back with
    point-to-point sends or one all-to-all."""

    input_layout: Literal[modes.LAYOUTS] = Field(default=modes.CONTIGUOUS, json_schema_extra=_OP)
    """Which tokens each rank holds. ``"contiguous"``: rank r holds tokens ``[r*L/cp, (r+1)*L/cp)``,
    what DeepSpeed-Ulysses and its data-loader adapter produce. ``"zigzag"``: the sequence is cut into
    ``2*cp`` chunks and rank r holds chunk r followed by chunk ``2*cp-1-r``."""

    sequence_parallel_size: int | None = Field(default=None, ge=1, strict=True)
    """Number of ranks sharing one sequence (>= 1). ``None`` means unset: :func:`load_mamba_sp_config`
    fills it from the top-level ds_config key ``"sequence_parallel_size"`` when that key exists, and
    :attr:`resolved_sequence_parallel_size` reads an unset size as 1. When set, the size of the process
    group handed to the wrapper must equal it."""

    overlap_comm: bool = Field(default=True, json_schema_extra=_OP)
    """Issue the state-summary all-gather asynchronously and overlap it with the computation that needs
    no incoming state (the chunk products C·Bᵀ). ``"state_passing"`` mode only (``"ulysses"`` has nothing
    to overlap and refuses ``false``)."""

    summary_exchange: Literal[exchange.SUMMARY_EXCHANGES] = Field(default=exchange.AUTO, json_schema_extra=_OP)
    """How the segments' state summaries reach each other (``"state_passing"`` mode only). ``"allgather"``: every
    rank all-gathers every segment's summary (one collective; per layer and direction a rank receives one per
    segment). ``"scan"``: a log-depth scan of point-to-point messages, ceil(log2 segments) rounds of one summary,
    for groups that span nodes. ``"auto"`` (default): the all-gather inside one node of 8 GPUs, past it the
    cheaper of the two by the cost model (``ds_mamba_spcp.engine.traffic``; docs/design.md, "Past one node")."""

    backend: Literal[BACKENDS] = Field(default="auto", json_schema_extra=_OP)
    """Compute backend. ``"auto"``: Triton (mamba-ssm kernels) for CUDA tensors, the plain-PyTorch
    reference otherwise. ``"reference"``: always the plain-PyTorch twin. ``"triton"``: always Triton."""

    check_shapes: bool = Field(default=True, json_schema_extra=_OP)
    """Compare every call across the ranks of the group (shapes, dtypes, options, packed rows' labels), so that
    a mismatch raises on every rank instead of hanging; one small all-gather per call (``engine.call``)."""

    recompute_output: bool = Field(default=False, json_schema_extra=_OP)
    """``"state_passing"`` mode only: ``False`` keeps the scan's pre-gate output (batch, local_seqlen,
    nheads*headdim) for backward, as mamba-ssm's op does; ``True`` recomputes it in backward (one activation
    less held, one chunk-scan kernel more per layer)."""

    tile_length: int | None = Field(default=None, ge=1, strict=True, json_schema_extra=_OP)
    """Run every causal segment as consecutive tiles of this many tokens, the state and the conv halo carried.
    ``None``: tile only past the int32 indexing limit of mamba-ssm's kernels. A multiple of the chunk size runs
    fastest."""

    block_tile_tokens: int | None = Field(default=None, ge=1, strict=True)
    """Tokens per tile of the tiled block recompute (``ds_mamba_spcp.memory.tiled_block``; docs/usage.md, "Tiled
    block recompute"). The wrapper does not act on it: a model's block calls ``tiled_block`` with it
    (``examples/model.py``). ``None``: off. Any sequence-parallel size (each rank tiles its shard), ZeRO 0-3."""
    long_context: LongContext | None = None
    """Flat memory per token for transformers models trained through the Trainer, TRL, accelerate or
    ``prepare_sequence_parallel`` (``ds_mamba_spcp.integrations.transformers.long_context``; docs/huggingface.md,
    "Long context"). ``true`` turns every part on with its defaults, an object sets them one by one, ``null`` /
    ``false`` (default) leaves the model as transformers runs it. Applies at sequence_parallel_size 1 too."""

    cuda_graphs: bool = Field(default=False, json_schema_extra=_OP)
    """A group of one on CUDA only: replay the mixer core's forward and backward from CUDA graphs captured per
    shape on first use, removing its host time (``ds_mamba_spcp.engine.graphs``)."""

    def __init__(self, **data: Any) -> None:
        # DeepSpeedConfigModel.__init__(strict=False) drops every value equal to "auto" (mode="auto" would become
        # the default) and swallows a "strict" key: keys are checked first and strict is always on.
        _check_keys(data)
        if data.get("long_context") is True:
            data = {**data, "long_context": {}}
        elif data.get("long_context") is False:
            data = {**data, "long_context": None}
        super().__init__(strict=True, **data)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        # DeepSpeedConfigModel forbids extras already; this adds the list of allowed keys to the message.
        if isinstance(data, Mapping):
            _check_keys(data)
        return data

    @model_validator(mode="after")
    def _check_combination(self) -> MambaSequenceParallelConfig:
        entry = self.entry()  # the table of modes raises for a combination it lacks (key, value, fix)
        if self.summary_exchange == exchange.SCAN and entry.strategy != modes.STATE_PASSING:
            raise ValueError(
                f'"{SECTION}.summary_exchange" is "scan" with mode "{self.mode}", which exchanges no state summaries; '
                'use mode "state_passing", or summary_exchange "auto".'
            )
        return self

    def entry(self) -> modes.Entry:
        """This section's entry of the table of modes (``ds_mamba_spcp.engine.modes``)."""
        return modes.entry(self.mode, self.load_balancing, self.input_layout, recompute_output=self.recompute_output,
                           overlap_comm=self.overlap_comm)  # fmt: skip

    def options(self, **call) -> Options:
        """The op options this section sets (its fields marked as op options), and ``call``'s (final states,
        forward only)."""
        return Options(**{name: getattr(self, name) for name in OPTION_KEYS}, **call)

    @property
    def deepspeed(self) -> DeepSpeedSettings:
        """What the package reads from the rest of the ds_config this section was read from (defaults when it was
        built from the section alone)."""
        return self._deepspeed

    @property
    def resolved_sequence_parallel_size(self) -> int:
        """The configured ``sequence_parallel_size``, or 1 when it is unset."""
        return 1 if self.sequence_parallel_size is None else self.sequence_parallel_size

    def validate_for_mixer(self, *, nheads: int, ngroups: int, cp: int) -> None:
        """Check that this config can shard a mixer with ``nheads`` heads and ``ngroups`` B/C groups
        over a sequence-parallel group of ``cp`` ranks. Raises ValueError with the fix."""
        for name, value in (("nheads", nheads), ("ngroups", ngroups), ("cp", cp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.sequence_parallel_size is not None and cp != self.sequence_parallel_size:
            raise ValueError(
                f"the sequence-parallel group has {cp} ranks but the config sets sequence_parallel_size "
                f"{self.sequence_parallel_size}; pass a process group of that size or change "
                f'"{SECTION}.sequence_parallel_size" (or the top-level "{_TOP_LEVEL_SP_SIZE}").'
            )
        if self.cuda_graphs and cp > 1:
            raise ValueError(
                f'"{SECTION}.cuda_graphs" is true but the sequence-parallel group has {cp} ranks: the op replays from '
                "CUDA graphs on one device only (a group of one); set it to false for sequence parallelism."
            )
        modes.check_shapes(self.entry(), nheads=nheads, ngroups=ngroups, cp=cp)


OPTION_KEYS = tuple(k for k, f in MambaSequenceParallelConfig.model_fields.items() if f.json_schema_extra == _OP)


def _options_entry(self) -> modes.Entry:
    """This call's entry of the table of modes (raises for a combination the table lacks)."""
    return modes.entry(self.mode, self.load_balancing, self.input_layout, recompute_output=self.recompute_output,
                       overlap_comm=self.overlap_comm)  # fmt: skip


# How one call of the op is run (``engine.call.MixerCall.options``): every field of the section marked as an op option,
# with its default, so that a new option is one field of the section and its use; and two of a call's own.
Options = dataclasses.make_dataclass(
    "Options",
    [
        (k, f.annotation, dataclasses.field(default=f.default))
        for k, f in MambaSequenceParallelConfig.model_fields.items()
        if k in OPTION_KEYS
    ]
    + [
        ("return_final_states", bool, dataclasses.field(default=False)),
        # inference: the forward-only route (final_states one per document). Not a ds_config key.
        ("forward_only", bool, dataclasses.field(default=False)),
    ],
    frozen=True,
    namespace={"entry": property(_options_entry), "__module__": __name__},
)
Options.__doc__ = "How a call of the op is run: the section's op options and a call's own (see ``OPTION_KEYS``)."


def _check_keys(section: Mapping) -> None:
    allowed = MambaSequenceParallelConfig.model_fields
    unknown = [k for k in section if k not in allowed]
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ValueError(f'unknown key(s) {names} in the "{SECTION}" section; allowed keys: {", ".join(allowed)}.')


def _read_json(path: str | os.PathLike) -> Any:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ds_config file {path!r} does not exist (or is not a file).")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"ds_config file {path!r} is not valid JSON: {e}") from e


def ds_config_dict(config: Any) -> Mapping:
    """The whole ds_config as a mapping, from any of the accepted sources (not a MambaSequenceParallelConfig)."""
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        loaded = _read_json(config)
        if not isinstance(loaded, Mapping):
            raise ValueError(
                f"ds_config file {os.fspath(config)!r} holds a {type(loaded).__name__}, expected a JSON object."
            )
        return loaded
    if isinstance(config, DeepSpeedConfig):
        return config._param_dict
    # a DeepSpeedEngine: the parsed DeepSpeedConfig in `_config`, the ds_config dict in `config`
    parsed = getattr(config, "_config", None)
    if isinstance(parsed, DeepSpeedConfig):
        return parsed._param_dict
    raw = getattr(config, "config", None)
    if isinstance(raw, Mapping):
        return raw
    raise TypeError(
        f"cannot read a ds_config from a {type(config).__module__}.{type(config).__qualname__}; expected a "
        "ds_config dict, a path to a JSON ds_config file, a MambaSequenceParallelConfig, a "
        "deepspeed.runtime.config.DeepSpeedConfig, or a DeepSpeed engine."
    )


def _top_level_sp_size(ds_config: Mapping) -> int | None:
    value = ds_config.get(_TOP_LEVEL_SP_SIZE)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'top-level ds_config key "{_TOP_LEVEL_SP_SIZE}" must be an int >= 1, got {value!r}.')
    return value


def load_mamba_sp_config(config: Any) -> MambaSequenceParallelConfig:
    """Read and validate the ``"mamba_sequence_parallel"`` section of a DeepSpeed config, with what the package
    reads from the rest of it (``deepspeed``: :class:`DeepSpeedSettings`).

    ``config``: a ds_config dict, a path to a JSON ds_config file, a ``DeepSpeedConfig``, a DeepSpeed engine,
    or a :class:`MambaSequenceParallelConfig` (returned as is). A missing section gives the defaults
    (``enabled=False``). An unset ``sequence_parallel_size`` is filled from the top-level key (both set: they
    must agree; neither: ``None``). Raises TypeError for an unsupported ``config`` or a section that is not an
    object, FileNotFoundError for a missing file, ValueError (pydantic's ValidationError too) for bad contents.
    """
    if isinstance(config, MambaSequenceParallelConfig):
        return config
    ds_config = ds_config_dict(config)
    section = ds_config.get(SECTION)
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise TypeError(f'the "{SECTION}" section must be a JSON object, got {type(section).__name__}.')
    section = dict(section)

    top_size = _top_level_sp_size(ds_config)
    own_size = section.get("sequence_parallel_size")
    if own_size is None:
        section["sequence_parallel_size"] = top_size
    elif top_size is not None and own_size != top_size:
        raise ValueError(
            f'"{SECTION}.sequence_parallel_size" is {own_size!r} but the top-level "{_TOP_LEVEL_SP_SIZE}" '
            f"is {top_size}; make them equal or drop one of them."
        )
    config = MambaSequenceParallelConfig(**section)
    config._deepspeed = DeepSpeedSettings.from_ds_config(ds_config)
    return config
