"""The transformers adapter: sequence-parallel Mamba2 mixers and DeepSpeed's Ulysses attention, in one call.

``prepare_sequence_parallel(model, ds_config)``, called once before ``deepspeed.initialize``, creates DeepSpeed's
sequence-parallel group, puts DeepSpeed's ``UlyssesSPAttentionHF`` in front of each attention module, makes the
six families' mixers (``MIXER_CLASSES``: shared attribute names, no base class) sequence-parallel through
``integrations/core.py``, and checks every model call before any collective.

A wrapped mixer keeps its class and place; only its instance ``forward`` is replaced (the previous one runs
every unsharded call), so state_dict keys, isinstance, PEFT and ``generate`` see the unwrapped model; it is a
ZeRO-3 leaf (the core reads ``conv1d.weight`` and ``norm.weight`` without calling those submodules). A call is
sharded when the config is enabled, the group has more than one rank and no ``sequence_parallel_disabled``
block is open. The user's page: docs/huggingface.md.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from einops import rearrange
from torch import nn

MIN_TRANSFORMERS = "5.17"
_INSTALL = f"pip install 'ds_mamba_spcp[hf]' (transformers>={MIN_TRANSFORMERS})"

try:
    import transformers
except ImportError as e:
    raise ImportError(f"ds_mamba_spcp.integrations.transformers needs Hugging Face transformers: {_INSTALL}.") from e

from packaging.version import Version  # noqa: E402 - a dependency of transformers

if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
    raise ImportError(
        f"ds_mamba_spcp.integrations.transformers supports transformers>={MIN_TRANSFORMERS} (the mixers' 5.x "
        f"forward); found {transformers.__version__}. {_INSTALL}."
    )

from ds_mamba_spcp import comm  # noqa: E402
from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig, load_mamba_sp_config  # noqa: E402
from ds_mamba_spcp.groups import group_of_one, group_size, resolve_sequence_process_group  # noqa: E402
from ds_mamba_spcp.integrations.core import MixerCore, is_sharded, loaded_classes, mixer_forward  # noqa: E402
from ds_mamba_spcp.integrations.transformers import long_context, router_loss  # noqa: E402
from ds_mamba_spcp.integrations.transformers.layers import (  # noqa: E402
    CACHE_NAMES,
    MIXER_ATTR,
    attention_modules,
    cache_error,
    copy_adapter,
    install_adapter,
    mixer_call,
    padding_error,
    ulysses_attention,
    ulysses_dims,
)

# The Mamba2-style mixer classes of transformers (class name -> modeling module).
MIXER_CLASSES = {
    "Mamba2Mixer": "transformers.models.mamba2.modeling_mamba2",
    "BambaMixer": "transformers.models.bamba.modeling_bamba",
    "NemotronHMamba2Mixer": "transformers.models.nemotron_h.modeling_nemotron_h",
    "GraniteMoeHybridMambaLayer": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "FalconH1Mixer": "transformers.models.falcon_h1.modeling_falcon_h1",
    "Zamba2MambaMixer": "transformers.models.zamba2.modeling_zamba2",
}

# Plain attributes in a module's __dict__ (not submodules, so state_dict and named_modules ignore them); a wrapped
# mixer's _MixerAdapter is under layers.MIXER_ATTR
_ATTN_ATTR = "_ds_mamba_spcp_attention"  # a sharded attention module's _UlyssesAttention
_MODEL_ATTR = "_ds_mamba_spcp_model"  # a prepared model's _PreparedModel
_CORE_ATTR = "_ds_mamba_spcp_core_attention"  # on the dispatcher: the attention function it replaced
_UNRESOLVED = object()
_warned_norm: set = set()


def mixer_classes() -> tuple[type, ...]:
    """The classes of ``MIXER_CLASSES`` whose modeling module is loaded (a model that holds one has loaded it)."""
    return loaded_classes(MIXER_CLASSES)


# -- when a call is sharded -------------------------------------------------------------------------


class _Sharding:
    """Whether a call is sharded: the config, the process group (resolved on first use) and a pause count
    (``sequence_parallel_disabled``). ``validate(size)`` runs once the group size is known."""

    def __init__(self, group: Any, config: MambaSequenceParallelConfig, validate=None) -> None:
        self.config = config
        self.paused = 0
        self._group_arg, self._group, self.size = group, _UNRESOLVED, 1
        self._validate = validate

    def group(self):
        if self._group is _UNRESOLVED:
            group = resolve_sequence_process_group(self._group_arg, self.config)
            size = group_size(group)
            if self._validate is not None:
                self._validate(size)
            self._group, self.size = group, size
        return self._group

    def active(self) -> bool:
        """True when this call runs sequence-parallel (enabled, not paused, a group of more than one rank)."""
        if not self.config.enabled or self.paused:
            return False
        self.group()
        return self.size > 1

    def routes_op(self) -> bool:
        """True when a mixer call runs this package's op: sequence-parallel, or ``long_context`` on a group of
        one (the op's tiles take any length, mamba-ssm's kernels not: int32 offsets)."""
        if not self.config.enabled or self.paused:
            return False
        self.group()
        return self.size > 1 or self.config.long_context is not None

    def __deepcopy__(self, memo):
        # a copied model shares the process group (a handle, not copyable) and the frozen config
        new = copy.copy(self)
        memo[id(self)] = new
        return new


@contextlib.contextmanager
def sequence_parallel_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model`` runs as if it were not wrapped (every mixer and attention layer wrapped by this
    module runs its own forward, no collective, no check): for ``generate`` or evaluation on whole sequences.
    Blocks nest. (mamba-ssm's ``DistributedMamba2`` is not affected.)"""
    switches = {}
    for module in model.modules():
        for key in (MIXER_ATTR, _ATTN_ATTR, _MODEL_ATTR):
            obj = module.__dict__.get(key)
            if obj is not None:
                switches[id(obj.sharding)] = obj.sharding
    for s in switches.values():
        s.paused += 1
    try:
        yield model
    finally:
        for s in switches.values():
            s.paused -= 1


# -- the mixers -------------------------------------------------------------------------------------


def _norm_group_size(norm: nn.Module, d_inner: int) -> int | None:
    """Channels per group of a host's gated RMSNorm, or None where the module does not say (5.17's Mamba2,
    Bamba and GraniteMoeHybrid norms, which normalise the whole width in their PyTorch path)."""
    if hasattr(norm, "group_size"):
        return int(norm.group_size)
    if hasattr(norm, "n_groups"):  # Falcon-H1
        return d_inner // int(norm.n_groups)
    return None


def check_mixer_supported(mixer: nn.Module) -> None:
    """Raises NotImplementedError (naming the option and the way out) for a transformers mixer that the
    sequence-parallel core cannot run exactly as transformers does."""
    name = type(mixer).__qualname__
    d_inner = mixer.num_heads * mixer.head_dim
    if mixer.intermediate_size != d_inner:
        raise NotImplementedError(
            f"{name} (layer {mixer.layer_idx}) has intermediate_size={mixer.intermediate_size} but num_heads * "
            f"head_dim = {d_inner}; the sequence-parallel core (like mamba-ssm's fused kernel) needs them equal. "
            "Fix the config (Falcon-H1: mamba_d_ssm = mamba_n_heads * mamba_d_head)."
        )
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(
            f"{name} (layer {mixer.layer_idx}) applies activation {mixer.activation!r} after its conv (config."
            "mamba_hidden_act for Nemotron-H, config.hidden_act for the others); the sequence-parallel core, like "
            "the mamba-ssm kernel transformers trains with, applies SiLU only. Set it to 'silu', or train without "
            f'sequence parallelism ("{SECTION}.enabled": false).'
        )
    norm = mixer.norm
    if isinstance(norm, nn.Identity):  # Falcon-H1 with mamba_rms_norm=False
        return
    want = d_inner // mixer.n_groups
    have = _norm_group_size(norm, d_inner)
    if have is not None and have != want:
        raise NotImplementedError(
            f"{name} (layer {mixer.layer_idx}) normalises groups of {have} channels; the sequence-parallel core "
            f"groups its gated RMSNorm by n_groups ({want} = intermediate_size // n_groups channels), as mamba-ssm "
            "does. Build the norm with that group size, or train without sequence parallelism."
        )
    if have is None and mixer.n_groups > 1 and type(mixer) not in _warned_norm:
        _warned_norm.add(type(mixer))
        warnings.warn(
            f"transformers {transformers.__version__}: {name}'s PyTorch path normalises the whole width "
            f"({d_inner} channels) where its fused mamba-ssm path normalises each of n_groups={mixer.n_groups} "
            f"groups; the sequence-parallel layer follows the fused path (the training path on GPUs). Newer "
            "transformers releases group the PyTorch path too.",
            stacklevel=3,
        )


class _MixerAdapter:
    """The sequence-parallel forward of one transformers mixer (held in its ``__dict__``, see the module docstring);
    the long-context key tiles it through ``layers.TileableMixer`` (``in_proj``, ``core``, ``out_proj``,
    ``seq_idx``, ``tile``)."""

    def __init__(self, mixer: nn.Module, group: Any, config: MambaSequenceParallelConfig) -> None:
        self.mixer = mixer
        self.original_forward = mixer.forward  # the class's forward, or a hook's wrapper of it
        self.sharding = _Sharding(group, config, self._validate)
        self.model_state: _PreparedModel | None = None  # set by prepare_sequence_parallel
        self.tile = None  # inside a tiled decoder layer: its tile in hand (long_context.py)

    def _validate(self, size: int) -> None:
        self.sharding.config.validate_for_mixer(nheads=self.mixer.num_heads, ngroups=self.mixer.n_groups, cp=size)

    def __call__(self, *args, **kwargs):
        hidden_states, cache, attention_mask, rest = mixer_call(args, kwargs)
        if self.tile is not None:
            return self.tile.mixer_call(self, hidden_states, cache, attention_mask)
        if not self.sharding.routes_op():
            return self.original_forward(*args, **kwargs)
        if self.sharding.size == 1 and (cache is not None or attention_mask is not None):
            # long_context on a group of one: generation and padded rows are transformers' own
            return self.original_forward(*args, **kwargs)
        name = self.name
        if cache is not None:
            raise cache_error(name)
        if attention_mask is not None:
            raise padding_error(f"an attention_mask with zeros reached {name}")
        seq_idx = self.seq_idx(rest)
        if seq_idx is not None and tuple(seq_idx.shape) != tuple(hidden_states.shape[:2]):
            raise ValueError(
                f"{name}: seq_idx has shape {tuple(seq_idx.shape)} but this rank's hidden_states hold (batch, "
                f"local_seqlen) = {tuple(hidden_states.shape[:2])}; shard seq_idx with the tokens (shard_batch)."
            )
        return mixer_forward(
            hidden_states, self.in_proj, self.mixer.out_proj, self.core(), self.sharding.config, self.sharding.group(),
            seq_idx=seq_idx,
        )  # fmt: skip

    def seq_idx(self, kwargs: dict):
        """The call's document labels: its ``seq_idx``, else the model call's (Mamba2ForCausalLM does not pass
        its **kwargs to its backbone), else None."""
        seq_idx = kwargs.get("seq_idx")
        if seq_idx is None and self.model_state is not None:
            seq_idx = self.model_state.seq_idx
        return seq_idx

    @property
    def name(self) -> str:
        return f"{type(self.mixer).__qualname__} (layer {self.mixer.layer_idx})"

    @property
    def out_features(self) -> int:
        return self.mixer.out_proj.out_features

    def out_proj(self, y: torch.Tensor) -> torch.Tensor:
        return self.mixer.out_proj(y)

    def in_proj(self, hidden: torch.Tensor) -> torch.Tensor:
        """in_proj's output (zxbcdt) on ``hidden``, as the mixer's forward computes it."""
        m = self.mixer
        # Falcon-H1 scales the input by ssm_in_multiplier and in_proj's output by the mup_vector buffer
        multiplier, mup_vector = getattr(m, "ssm_in_multiplier", None), getattr(m, "mup_vector", None)
        zxbcdt = m.in_proj(hidden if multiplier is None else hidden * multiplier)
        return zxbcdt if mup_vector is None else zxbcdt * mup_vector

    def core(self) -> MixerCore:
        """The mixer core's parameters, read at every call (ZeRO-3 and load_state_dict(assign=True) swap them)."""
        m = self.mixer
        norm = None if isinstance(m.norm, nn.Identity) else m.norm
        # transformers takes A_log.float(); promoting instead keeps an fp64 model in fp64 and is the same otherwise
        A = -torch.exp(m.A_log.to(torch.promote_types(m.A_log.dtype, torch.float32)))
        return MixerCore(
            conv1d_weight=rearrange(m.conv1d.weight, "d 1 w -> d w"), conv1d_bias=m.conv1d.bias, dt_bias=m.dt_bias,
            A=A, D=m.D, chunk_size=m.chunk_size, headdim=m.head_dim, ngroups=m.n_groups,
            dt_limit=tuple(m.time_step_limit), activation=m.activation,
            rmsnorm_weight=None if norm is None else norm.weight,
            rmsnorm_eps=1e-6 if norm is None else norm.variance_epsilon,
            norm_before_gate=bool(getattr(norm, "norm_before_gate", False)),
        )  # fmt: skip

    def __deepcopy__(self, memo):
        new = copy_adapter(self, memo)
        new.sharding._validate = new._validate
        return new


def wrap_hf_mamba2_mixers(model: nn.Module, sequence_process_group: Any, config: Any) -> int:
    """Makes every transformers Mamba2-style mixer in ``model`` (``MIXER_CLASSES``, the model itself included)
    sequence-parallel, in place; returns how many it wrapped (wrapped ones are left alone).

    ``sequence_process_group``: the group sharing each sequence, or None to resolve it at the first forward;
    ``config``: a ds_config or a ``MambaSequenceParallelConfig``. The wrapped mixer keeps transformers' forward
    signature (``hidden_states`` (batch, local_seqlen, hidden_size), this rank's shard in ``config.input_layout``;
    ``seq_idx`` (batch, local_seqlen) int32 in ``**kwargs``) and returns its shard of the output.
    """
    classes = mixer_classes()
    if not classes:
        return 0
    cfg = config if isinstance(config, MambaSequenceParallelConfig) else load_mamba_sp_config(config)
    todo = [m for m in model.modules() if isinstance(m, classes) and MIXER_ATTR not in m.__dict__]
    if cfg.enabled:
        for m in todo:
            check_mixer_supported(m)
    for m in todo:
        adapter = _MixerAdapter(m, sequence_process_group, cfg)
        if cfg.enabled and sequence_process_group is not None:
            adapter.sharding.group()  # an explicit group is checked at once
        install_adapter(m, adapter)
    return len(todo)


# -- the attention layers: DeepSpeed's Ulysses attention, per module --------------------------------


class _UlyssesAttention:
    """DeepSpeed's ``UlyssesSPAttentionHF`` for one attention module, one instance per batch size (it fixes
    the batch size when it is built). Calls: (module, query, key, value, attention_mask, **kwargs) with
    query (batch, heads, local_seqlen, head_dim) -> ((batch, local_seqlen, heads, head_dim), weights)."""

    def __init__(self, module: nn.Module, model_state: _PreparedModel, implementation: str, core_fn) -> None:
        self.model_state, self.sharding = model_state, model_state.sharding
        self.implementation, self.core_fn = implementation, core_fn
        self.heads, self.kv_heads, self.head_dim = ulysses_dims(module)
        self._by_batch: dict = {}

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        if kwargs.get("position_ids") is None:
            # DeepSpeed's attention all-gathers position_ids; GraniteMoeHybrid (no rotary) does not pass them down
            kwargs["position_ids"] = self.model_state.position_ids
        batch = query.shape[0]
        uattn = self._by_batch.get(batch)
        if uattn is None:
            uattn = UlyssesSPAttentionHF(
                attn=self.core_fn, batch_size=batch, attn_head_count=self.heads, attn_head_size=self.head_dim,
                kv_head_count=self.kv_heads, num_hidden_layers=1, process_group=self.sharding.group(),
                seq_length_is_variable=True,
            )  # fmt: skip
            uattn.core_attn_implementation = self.implementation
            self._by_batch[batch] = uattn
        # As DeepSpeed's own registration does: the mask (built for the local length) is dropped and the
        # kernel masks causally on the gathered sequence; flex_attention's BlockMask is rebuilt by DeepSpeed.
        keep = self.implementation == "flex_attention" and not torch.is_tensor(attention_mask)
        # UlyssesSPAttentionHF rewrites num_key_value_groups when it replicates KV heads (cp > kv heads);
        # restore it so that unsharded calls (sequence_parallel_disabled) see the model's own value
        groups = module.num_key_value_groups
        try:
            mask = attention_mask if keep else None
            return ulysses_attention(uattn, module, query, key, value, mask, *args, **kwargs)
        finally:
            module.num_key_value_groups = groups

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        memo[id(self)] = new
        new.model_state = copy.deepcopy(self.model_state, memo)
        new.sharding = new.model_state.sharding
        new._by_batch = {}
        return new


def _dispatcher(core_fn):
    """The function put in ``ALL_ATTENTION_FUNCTIONS`` in place of ``core_fn``: modules sharded by a
    prepared model go through DeepSpeed's Ulysses attention, every other call (other models, unsharded
    calls) goes to ``core_fn`` unchanged."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        shard = module.__dict__.get(_ATTN_ATTR)
        if shard is None or not shard.sharding.active():
            return core_fn(module, query, key, value, attention_mask, *args, **kwargs)
        return shard(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(attention, _CORE_ATTR, core_fn)
    return attention


def _install_dispatcher(implementation: str):
    """Puts the dispatcher behind ``implementation`` in transformers' attention registry (once per process).
    Returns the function it stands in front of."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS[implementation]
    core = getattr(current, _CORE_ATTR, None)
    if core is not None:
        return core
    if getattr(current, "__qualname__", "").endswith("uattn_wrapper"):
        raise ValueError(
            f"the attention implementation {implementation!r} was already replaced by DeepSpeed's "
            "UlyssesSPAttentionHF.register_with_transformers, which shards every call of every model in the process "
            "(generation included). prepare_sequence_parallel installs the same DeepSpeed attention itself, per model "
            "and per call: drop the register_with_transformers call."
        )
    ALL_ATTENTION_FUNCTIONS[implementation] = _dispatcher(current)
    return current


def _check_attention(module: nn.Module, config: MambaSequenceParallelConfig, cp: int) -> str:
    """The attention implementation of ``module``; raises when DeepSpeed's Ulysses attention cannot shard it."""
    name = type(module).__qualname__
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation is None or implementation == "eager" or implementation.startswith("paged"):
        raise ValueError(
            f"{name} uses attn_implementation={implementation!r}. DeepSpeed's Ulysses attention drops the attention "
            "mask after its all-to-all and relies on the kernel's own causal masking, which 'eager' lacks (it would "
            "attend to later tokens). Build or load the model with attn_implementation='sdpa' (CPU or GPU) or a "
            "flash attention, or call model.set_attn_implementation('sdpa') before prepare_sequence_parallel."
        )
    heads, kv_heads, _ = ulysses_dims(module)
    if heads % cp or (kv_heads % cp and cp % kv_heads):
        raise ValueError(
            f"{name} has {heads} query and {kv_heads} key/value heads; DeepSpeed's Ulysses attention shards heads "
            f"over the {cp} ranks of the sequence-parallel group, which needs the query heads divisible by {cp} and "
            "the key/value heads divisible by it (or dividing it). Choose a sequence_parallel_size that fits."
        )
    if config.input_layout != "contiguous":
        raise ValueError(
            f"the model has attention layers ({name}), which DeepSpeed's Ulysses attention shards contiguously, but "
            f'"{SECTION}.input_layout" is {config.input_layout!r}; set "input_layout": "contiguous" and '
            '"load_balancing": "none" (zigzag layouts need an attention-free model).'
        )
    return implementation


# -- the whole model --------------------------------------------------------------------------------


class _PreparedModel:
    """The model-level state of ``prepare_sequence_parallel`` (held in the model's ``__dict__``)."""

    def __init__(self, model: nn.Module, sharding: _Sharding, implementations: set[str]) -> None:
        self.sharding = sharding
        self.implementations = implementations  # of the sharded attention layers (empty: attention-free)
        self.signature = inspect.signature(model.forward)
        self.var_keyword = [p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD]
        self.position_ids = self.seq_idx = None  # of the current call (set by the pre-forward check)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        memo[id(self)] = new
        new.sharding = copy.deepcopy(self.sharding, memo)
        return new


def _check_model_call(model: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a prepared model: on every rank alike and before any collective, rejects what a
    sharded call cannot honour, and sets use_cache=False when the caller left it unset."""
    state = model.__dict__.get(_MODEL_ATTR)
    if state is None or not state.sharding.active():
        return None
    try:
        call = state.signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None  # the model's forward reports its own argument errors
    for name in state.var_keyword:
        call = {**call, **call.pop(name, {})}
    model_name = type(model).__qualname__
    if any(call.get(key) is not None for key in CACHE_NAMES) or call.get("use_cache"):
        raise cache_error(model_name)
    # with shift_labels (shifted before sharding, as the Trainer's sequence-parallel loss passes them) the model's
    # loss scores them unshifted: a correct mean over this rank's tokens, for the caller to combine over the group
    if call.get("labels") is not None and call.get("shift_labels") is None:
        raise ValueError(
            f"{model_name} got labels while sequence parallelism is active: its own loss would shift the labels "
            "inside this rank's shard and average over its tokens only. Pass no labels; score the logits with "
            "ds_mamba_spcp.data.sequence_parallel_cross_entropy(logits, shift_labels, group) (shard_batch shifts "
            "the labels before sharding), or pass shift_labels with them (the Trainer's sequence-parallel loss)."
        )
    state.position_ids, state.seq_idx = call.get("position_ids"), call.get("seq_idx")
    if state.implementations and state.position_ids is None:
        raise ValueError(
            f"{model_name} has attention layers sharded by DeepSpeed's Ulysses attention, which needs position_ids "
            "(the global positions of this rank's tokens): without them each rank numbers its shard from 0 (wrong "
            "rotary embeddings). Pass position_ids from ds_mamba_spcp.data.shard_batch (or DeepSpeed's "
            "UlyssesSPDataLoaderAdapter)."
        )
    if call.get("seq_idx") is not None:
        plain = sorted(i for i in state.implementations if not i.startswith("flash_attention"))
        if plain:
            raise NotImplementedError(
                f"packed rows (seq_idx) in a model whose attention runs {plain[0]!r} under DeepSpeed's Ulysses "
                "attention: it masks causally over the whole gathered row, so tokens would attend across documents. "
                "Use a flash attention (it keeps documents apart from the gathered position_ids), or unpacked rows."
            )
    mask = call.get("attention_mask")
    if mask is not None:
        _reject_padding(mask, state.sharding)
    # transformers' hybrids default use_cache to config.use_cache (True), in training too
    if "use_cache" not in call and ("use_cache" in state.signature.parameters or state.var_keyword):
        return args, {**kwargs, "use_cache": False}
    return None


def _reject_padding(mask: torch.Tensor, sharding: _Sharding) -> None:
    """Raises on every rank when any rank's attention_mask has a zero (one all-gather of a flag)."""
    if not torch.is_tensor(mask) or mask.dim() != 2:
        raise NotImplementedError(
            "a custom (non-2-D) attention_mask is not supported with sequence parallelism: DeepSpeed's Ulysses "
            "attention drops it. Pass none, or a 2-D all-ones padding mask."
        )
    padded = (mask == 0).any().to(torch.long).reshape(1)
    flags = comm.all_gather(padded, sharding.group(), sharding.size, async_op=False).wait().flatten().tolist()
    ranks = [r for r, flag in enumerate(flags) if flag]
    if ranks:
        raise padding_error(f"zeros in the attention_mask of rank(s) {ranks} of the sequence-parallel group")


def _is_mamba_ssm_mamba2(module: nn.Module) -> bool:
    """mamba-ssm's unwrapped ``Mamba2`` (by its class, without importing mamba-ssm here)."""
    cls = type(module)
    return cls.__name__ == "Mamba2" and cls.__module__.endswith("modules.mamba2")


def prepare_sequence_parallel(model: nn.Module, ds_config: Any):
    """Shards a transformers Mamba2-style model over DeepSpeed's sequence-parallel group; call once, before
    ``deepspeed.initialize``.

    ``ds_config``: the ds_config (dict, path, ...) with ``sequence_parallel_size`` and the
    ``"mamba_sequence_parallel"`` section. Attention must be 'sdpa', a flash attention or flex_attention.
    Returns ``parallel_state_sp``, the ``mpu`` for ``deepspeed.initialize(..., mpu=...)``; or None when the
    config leaves sequence parallelism off (the model then untouched).

    The prepared model takes this rank's shard of every sequence (``data.shard_batch``): ``input_ids`` (batch,
    seqlen/cp), ``position_ids`` (global, needed with attention), no labels, cache or padding; it returns this
    rank's shard of the logits. ``sequence_parallel_disabled`` gives back the unwrapped behaviour.
    """
    cfg = load_mamba_sp_config(ds_config)  # the one read of the ds_config: what follows takes cfg (and cfg.deepspeed)
    cp = cfg.resolved_sequence_parallel_size
    if not cfg.enabled:
        if cp > 1:
            raise ValueError(
                f'the ds_config sets sequence_parallel_size {cp} but "{SECTION}.enabled" is false: sharding the '
                "sequence with the Mamba2 layers unwrapped would restart their state at every shard (right-looking "
                'losses, wrong gradients). Set "enabled": true, or drop sequence_parallel_size.'
            )
        if cfg.long_context is not None:
            raise ValueError(f'"{SECTION}.long_context" is set but "{SECTION}.enabled" is false; set "enabled": true.')
        return None
    if cp == 1:
        if cfg.long_context is not None:
            prepare_long_context(model, cfg)
        return None
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from ds_mamba_spcp.data import bf16_optimizer_error

    if cfg.deepspeed.selects_bf16_optimizer:
        raise bf16_optimizer_error()  # the returned mpu would break DeepSpeed's BF16_Optimizer

    if not dist.is_initialized():
        raise RuntimeError(
            "prepare_sequence_parallel needs deepspeed.comm: launch with the deepspeed launcher (or torchrun) and "
            "call deepspeed.init_distributed() first."
        )
    if _MODEL_ATTR in model.__dict__:
        raise ValueError(f"{type(model).__qualname__} was already prepared for sequence parallelism")
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
        parallel_state_sp.initialize_sequence_parallel(cp)
    elif (have := parallel_state_sp.get_sequence_parallel_world_size()) != cp:
        raise ValueError(
            f"DeepSpeed's sequence-parallel group of this process has {have} ranks but the ds_config asks for {cp}."
        )
    group = parallel_state_sp.get_sequence_parallel_group()
    sharding = _Sharding(group, cfg)
    sharding.group()

    attention = [(m, _check_attention(m, cfg, cp)) for m in attention_modules(model)]
    loose = [name for name, m in model.named_modules() if _is_mamba_ssm_mamba2(m)]
    if loose:
        raise ValueError(
            f"{type(model).__qualname__} holds mamba-ssm Mamba2 mixers ({', '.join(loose[:3])}): "
            "prepare_sequence_parallel shards transformers' mixers; make mamba-ssm's sequence-parallel first: "
            "parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size), then "
            "ds_mamba_spcp.wrap_mamba2_mixers(model, parallel_state_sp.get_sequence_parallel_group(), ds_config), "
            "then this call."
        )
    wrap_hf_mamba2_mixers(model, group, cfg)
    from ds_mamba_spcp.integrations.transformers.delta import wrap_delta_layers

    wrap_delta_layers(model, lambda: _Sharding(group, cfg))  # the Gated DeltaNet families (delta.py)
    if not any(is_sharded(m) for m in model.modules()):
        raise ValueError(
            f"{type(model).__qualname__} holds no Mamba2 mixer this package can shard (transformers' "
            f"{', '.join(MIXER_CLASSES)}, or mamba-ssm's Mamba2); for an attention-only model use DeepSpeed's "
            "UlyssesSPAttentionHF.register_with_transformers."
        )
    state = _PreparedModel(model, sharding, {impl for _, impl in attention})
    for module, implementation in attention:
        core_fn = _install_dispatcher(implementation)
        module.__dict__[_ATTN_ATTR] = _UlyssesAttention(module, state, implementation, core_fn)
    for m in model.modules():
        adapter = m.__dict__.get(MIXER_ATTR)
        if adapter is not None:
            adapter.model_state = state
    model.__dict__[_MODEL_ATTR] = state
    model.register_forward_pre_hook(_check_model_call, with_kwargs=True)
    long_context.install(model, cfg)
    router_loss.install(model, sharding)  # the MoE router loss summed over the group
    return parallel_state_sp


def prepare_long_context(model: nn.Module, config: MambaSequenceParallelConfig) -> None:
    """``"long_context"`` on a group of one (sequence_parallel_size 1): the mixers run this package's op on this
    rank alone, and ``long_context.install`` does the rest. Once per model."""
    if long_context.installed(model):
        return
    group = group_of_one()
    wrap_hf_mamba2_mixers(model, group, config)
    from ds_mamba_spcp.integrations.transformers.delta import DELTA_CLASSES, wrap_delta_layers

    wrap_delta_layers(model, lambda: _Sharding(group, config))  # run on this package's op too (delta.py)
    if not any(is_sharded(m) for m in model.modules()):
        raise ValueError(
            f'"{SECTION}.long_context" is set but {type(model).__qualname__} holds no Mamba2 mixer or Gated DeltaNet '
            f"layer this package wraps (transformers' {', '.join([*MIXER_CLASSES, *DELTA_CLASSES])})."
        )
    long_context.install(model, config)
    router_loss.install(model)  # the MoE router loss from the rows the key routes without grad
