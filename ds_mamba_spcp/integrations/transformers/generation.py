"""Hugging Face transformers: a prompt prefilled sharded across the group, then ``model.generate``.

    sequence_parallel_generate(model, input_ids, group)      every rank: the same whole prompt
        -> checks, raised alike on every rank (prompt, mask, kwargs, model; the same random state to sample)
        -> the padding mask generate runs with (given, or derived from pad_token_id); left padding only
        -> sequence_parallel_prefill(model, this rank's shard of prompt[:, :n*cp] and of the mask, group),
           n = (seqlen - 2) // cp
        -> model.generate(input_ids, cache=<the prompt's cache but its last 2..cp+1 tokens (``_FED``)>,
           use_cache=True): transformers feeds the tokens the cache lacks and decodes, on every rank alike
           (with use_cache=False asked for: the decode steps whose form would differ in the chunked form,
           ``_ChunkedDecode``)
        -> the same tokens on every rank (checked), those of model.generate(input_ids) in one process
        a prompt too short to shard (< cp * (d_conv - 1) + 2 tokens): model.generate on every rank

    sequence_parallel_prefill(model, input_ids_shard, group, attention_mask_shard)  every rank: its shard
        the model's own forward on the shard, with a cache (``PrefilledCache``, a ``DynamicCache``):
        Mamba2 mixers   in_proj -> the op with return_final_states -> out_proj; the cache's
                        LinearAttentionLayer gets the state and the conv tail (``inference.prefill``)
        Gated DeltaNet  ``delta.DeltaAdapter`` with the op's final state (``_delta_forward``); the cache's
                        LinearAttentionLayer gets it and the last K pre-conv rows, the last rank's
        attention       DeepSpeed's Ulysses attention (all-to-all [L/cp, heads] -> [L, heads/cp]), as
                        in training; ``cache.update`` gathers every rank's K/V into each rank's cache
        -> (the last prompt token's logits, from the last rank, and the cache), on every rank

Left-padded rows run as packed rows (``seq_idx``: the padding 0, the prompt 1; each row keeps its last
document's state and conv tail), their attention each row's prompt alone after the all-to-all, at generate's
positions (``cumsum(mask) - 1``). The cache layers (transformers >= 5.24) are filled through their own
``update_conv_state`` / ``update_recurrent_state`` / ``update``, the state in fp32. What is refused (a zero
after a one in a mask, an in_proj bias or flex_attention with padding at cp > 1, caches or ``inputs_embeds``
passed in), the token count of attention-free caches, sampling and the group: docs/huggingface.md,
"Generation: the prompt prefilled sharded".
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
from typing import Any

import torch
from torch import nn

from ds_mamba_spcp import comm
from ds_mamba_spcp.config import MambaSequenceParallelConfig
from ds_mamba_spcp.engine import modes
from ds_mamba_spcp.groups import adopt_torch_distributed, generation_group
from ds_mamba_spcp.inference.prefill import (
    Prefill,
    broadcast_from_last,
    fingerprint,
    gather_sequence,
    mixer_prefill,
    raise_alike,
    same_on_every_rank,
)
from ds_mamba_spcp.integrations.transformers import adapter as hf
from ds_mamba_spcp.integrations.transformers.layers import ulysses_attention, ulysses_dims

try:
    from transformers.cache_utils import CacheLayerMixin, DummyLayer, DynamicCache, LinearAttentionCacheLayerMixin
except ImportError:  # transformers before the LinearAttentionLayer cache (5.17 keeps Mamba state elsewhere)
    CacheLayerMixin = DummyLayer = LinearAttentionCacheLayerMixin = None
    DynamicCache = object


class PrefilledCache(DynamicCache):
    """``DynamicCache(config=...)`` filled by a sharded prefill.

    With an attention layer it is a plain ``DynamicCache``. Without one (transformers cannot count its length)
    it answers ``get_seq_length`` and ``get_mask_sizes`` from ``tokens`` (set by the prefill, advanced by
    ``sequence_parallel_generate``; advance it yourself when decoding it another way), and a cache whose every
    layer is linear gets one trailing ``DummyLayer``, so that generate feeds only the tokens it lacks."""

    def __init__(self, config, tokens: int = 0) -> None:
        super().__init__(config=config)
        self.tokens = tokens
        self.attention_free = not any(isinstance(layer, CacheLayerMixin) for layer in self.layers)
        # every layer linear (Mamba2): one DummyLayer more, so that generate slices the prompt by our length;
        # not compileable then, so that generate builds no 4-D masks (Mamba2's forward takes a 2-D one only)
        self.padded = self.attention_free and bool(self.layers) and all(self.is_linear)
        if self.padded:
            self.layers.append(DummyLayer())

    @property
    def is_compileable(self) -> bool:
        return False if self.padded else super().is_compileable

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.tokens if self.attention_free else super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if self.attention_free:
            return self.tokens + query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)


# -- checks, on every rank alike --------------------------------------------------------------------


def _resolve_group(model: nn.Module, group):
    """The group given, a prepared model's, DeepSpeed's sequence-parallel group, or the world
    (``groups.generation_group``)."""
    adopt_torch_distributed()  # before a prepared model resolves its group through deepspeed.comm
    if group is None:
        state = model.__dict__.get(hf._MODEL_ATTR)
        if state is not None:
            group = state.sharding.group()
    group = generation_group(group)
    rank, cp = comm.group_rank_size(group)
    return group, rank, cp


def _config(model: nn.Module, cp: int) -> MambaSequenceParallelConfig:
    """The op's options: a prepared model's (backend, tile_length, ...) in the prefill's mode (state passing,
    contiguous shards), else the defaults."""
    state = model.__dict__.get(hf._MODEL_ATTR)
    base = state.sharding.config.model_dump() if state is not None else {}
    base.update(enabled=True, mode=modes.STATE_PASSING, load_balancing=modes.NONE, input_layout=modes.CONTIGUOUS)
    base.update(sequence_parallel_size=cp, recompute_output=False)
    return MambaSequenceParallelConfig(**base)


def _mixers(model: nn.Module) -> list[nn.Module]:
    classes = hf.mixer_classes()
    return [m for m in model.modules() if isinstance(m, classes)] if classes else []


def _model_problem(model: nn.Module, cfg: MambaSequenceParallelConfig, cp: int) -> Exception | None:
    """Why this package cannot prefill ``model`` sharded (None: it can)."""
    name = type(model).__qualname__
    if CacheLayerMixin is None:
        import transformers

        return NotImplementedError(
            f"sequence-parallel prefill fills transformers' DynamicCache with LinearAttentionLayer (transformers "
            f">= 5.24); found transformers {transformers.__version__}. Upgrade transformers (pip install -U "
            "'transformers>=5.24')."
        )
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        return TypeError(f"{name} is not a transformers generative model (no generate / config)")
    mixers = _mixers(model)
    if not mixers and not _deltas(model):
        return ValueError(
            f"{name} holds no Mamba2 mixer this package can shard (transformers' {', '.join(hf.MIXER_CLASSES)}) and "
            "no Gated DeltaNet layer (delta.DELTA_CLASSES); an attention-only model has nothing for state passing: "
            "prefill it with the model's own forward."
        )
    try:
        for m in mixers:
            hf.check_mixer_supported(m)
        if cp > 1:
            for m in hf.attention_modules(model):
                hf._check_attention(m, cfg, cp)
    except (ValueError, NotImplementedError) as e:
        return e
    return None


def _deltas(model: nn.Module) -> list[nn.Module]:
    from ds_mamba_spcp.integrations.transformers.delta import delta_classes

    classes = delta_classes()
    return [m for m in model.modules() if isinstance(m, classes)] if classes else []


def _ids_problem(ids: Any, what: str) -> Exception | None:
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        got = f"{tuple(ids.shape)} {ids.dtype}" if torch.is_tensor(ids) else type(ids).__name__
        return ValueError(f"{what} must be a (batch, seqlen) tensor of token ids (int64 or int32), got {got}")
    return None


def _check_shards(ids: torch.Tensor, group, device) -> None:
    _, cp = comm.group_rank_size(group)
    if cp == 1:
        return
    rows = comm.gather_ints([int(ids.shape[0]), int(ids.shape[1])], torch.device(device), group, cp)
    if any(r != rows[0] for r in rows):
        raise ValueError(
            "sequence_parallel_prefill: every rank must pass a shard of the same (batch, local_seqlen), the prompt "
            f"split into equal contiguous parts; got {[tuple(r) for r in rows]} by rank. Give every rank seqlen/cp "
            "tokens (sequence_parallel_generate does the split, and takes any length)."
        )


# -- the sharded forward ----------------------------------------------------------------------------


def _mixer_forward(adapter, group, cfg, padding, *args, **kwargs):
    """A mixer's forward during the prefill: the op on the shard, the cache's layer filled; left-padded rows
    (``padding``) as packed rows."""
    hidden, cache, mask, rest = hf.mixer_call(args, kwargs)
    m = adapter.mixer
    if mask is not None or rest.get("seq_idx") is not None:
        raise NotImplementedError(f"{type(m).__qualname__}: a padded or packed prompt reached the sharded prefill")
    seq_idx = None if padding is None else padding.labels
    y, state, conv = mixer_prefill(adapter.in_proj(hidden), adapter.core(), group, cfg, seq_idx=seq_idx)
    if padding is not None:
        state, conv = padding.rows(state), padding.rows(conv)
    cache.update_conv_state(conv, m.layer_idx, conv_kernel_size=conv.shape[-1])
    cache.update_recurrent_state(state.float(), m.layer_idx)  # fp32, as transformers' own prefill keeps it
    return m.out_proj(y)


def _gathering_update(cache, group, key_states, value_states, layer_idx, *args, **kwargs):
    """``cache.update`` during the prefill: every rank's K/V into the cache; the shard's own back to the layer
    (its attention runs through DeepSpeed's Ulysses attention on the shards)."""
    full_k, full_v = gather_sequence(key_states, -2, group), gather_sequence(value_states, -2, group)
    type(cache).update(cache, full_k, full_v, layer_idx, *args, **kwargs)
    return key_states, value_states


def _delta_forward(adapter, group, padding, *args, **kwargs):
    """A Gated DeltaNet layer's forward during the prefill (``delta.DeltaAdapter`` with its decode state): the
    cache's layer gets the op's final state after the whole prompt (identical on every rank) and the last K
    pre-conv rows of q/k/v's mixed projection, the last rank's (it holds the prompt's end), in transformers'
    layout (batch, conv_dim, K); left-padded rows (``padding``) as packed rows, each keeping its last document."""
    hidden, cache, mask, rest = hf.mixer_call(args, kwargs)
    m = adapter.mixer
    if mask is not None or rest.get("seq_idx") is not None:
        raise NotImplementedError(f"{type(m).__qualname__}: a padded or packed prompt reached the sharded prefill")
    out, state, conv = adapter.forward(hidden, None if padding is None else padding.labels, decode_state=True)
    conv = broadcast_from_last(conv, group)
    if padding is not None:
        state, conv = padding.rows(state), padding.rows(conv, per_row=True)
    cache.update_conv_state(conv, m.layer_idx, conv_kernel_size=conv.shape[-1])
    cache.update_recurrent_state(state.float(), m.layer_idx)  # fp32, as transformers' own prefill keeps it
    return out


class _Ulysses:
    """DeepSpeed's Ulysses attention for one module (one instance per batch size), as in training."""

    def __init__(self, module, implementation, core_fn, group, position_ids, padding=None) -> None:
        self.implementation, self.group, self.position_ids = implementation, group, position_ids
        self.core_fn = core_fn if padding is None else functools.partial(_unpadded_attention, core_fn, padding)
        self.heads, self.kv_heads, self.head_dim = ulysses_dims(module)
        self.by_batch: dict = {}

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = self.position_ids
        batch = query.shape[0]
        if batch not in self.by_batch:
            uattn = UlyssesSPAttentionHF(
                attn=self.core_fn, batch_size=batch, attn_head_count=self.heads, attn_head_size=self.head_dim,
                kv_head_count=self.kv_heads, num_hidden_layers=1, process_group=self.group,
                seq_length_is_variable=True,
            )  # fmt: skip
            uattn.core_attn_implementation = self.implementation
            self.by_batch[batch] = uattn
        groups = module.num_key_value_groups  # DeepSpeed rewrites it when it replicates KV heads
        try:  # the mask (built for the local length) is dropped: the kernel masks causally, as in training
            return ulysses_attention(self.by_batch[batch], module, query, key, value, None, *args, **kwargs)
        finally:
            module.num_key_value_groups = groups


def _unpadded_attention(core_fn, padding, module, query, key, value, attention_mask, *args, **kwargs):
    """The attention kernel after Ulysses' all-to-all for left-padded rows: each row's prompt alone, causally
    (rows with as much padding together; no (batch, L, L) mask); the padded queries get zeros (they reach no
    prompt token: the Mamba2 layers restart at the prompt).

    query, key, value: (batch, heads, L, head_dim); returns ((batch, L, heads, head_dim), None), as the kernel."""
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
    positions = kwargs.get("position_ids")
    for pad, rows in padding.groups:
        if pad >= query.shape[2]:
            continue  # rows still all padding: nothing of theirs is attended to
        rows = rows.to(query.device)
        part = dict(kwargs)
        if positions is not None:
            part["position_ids"] = positions[rows, pad:]
        got = core_fn(module, query[rows, :, pad:], key[rows, :, pad:], value[rows, :, pad:], None, *args, **part)[0]
        out[rows, pad:] = got.to(out.dtype)
    return out, None


class _LeftPadding:
    """A left-padded prefix: the labels that make each row's padding a document of its own, and which of the op's
    per-document states is each row's. mask: (batch, L), the whole prefix's (zeros then ones in every row),
    identical on every rank; rank, local: this rank's shard [rank*local, (rank+1)*local)."""

    def __init__(self, mask: torch.Tensor, rank: int, local: int) -> None:
        mask = mask.to(torch.int32)
        self.labels = mask[:, rank * local : (rank + 1) * local].contiguous()  # 0 padding, 1 the prompt
        docs = 1 + (mask[:, 0] != mask[:, -1]).long()  # a row with padding and prompt holds two documents
        self.last = docs.cumsum(0) - 1  # the op's states are per document, row by row
        self.keep = mask[:, -1] == 1  # a prefix that ends in padding: the prompt starts after it, from zero
        pads = (mask == 0).sum(1).tolist()
        self.groups = [(p, torch.tensor([b for b, q in enumerate(pads) if q == p])) for p in sorted(set(pads))]

    def rows(self, per_document: torch.Tensor, per_row: bool = False) -> torch.Tensor:
        """(ndocs, ...) -> (batch, ...): each row's last document, zero where the row is still padding (as
        transformers' masked layers leave it). ``per_row``: already one per row (batch, ...), zeroed alike."""
        picked = per_document if per_row else per_document[self.last.to(per_document.device)]
        keep = self.keep.to(picked.device).view(-1, *([1] * (picked.dim() - 1)))
        return picked * keep.to(picked.dtype)


@contextlib.contextmanager
def _sharded(model: nn.Module, cache, group, cfg, position_ids, padding=None):
    """Inside the block, ``model``'s forward on a shard is the sharded prefill (then everything is put back)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_mamba_spcp.integrations.transformers.delta import DeltaAdapter

    undo = []
    try:
        for m in _mixers(model):
            adapter = hf._MixerAdapter(m, group, cfg)
            had, previous = "forward" in m.__dict__, m.__dict__.get("forward")
            m.forward = functools.partial(_mixer_forward, adapter, group, cfg, padding)
            undo.append(lambda m=m, had=had, previous=previous: _restore(m, "forward", had, previous))
        for m in _deltas(model):
            adapter = DeltaAdapter(m, hf._Sharding(group, cfg))
            had, previous = "forward" in m.__dict__, m.__dict__.get("forward")
            m.forward = functools.partial(_delta_forward, adapter, group, padding)
            undo.append(lambda m=m, had=had, previous=previous: _restore(m, "forward", had, previous))
        cache.update = functools.partial(_gathering_update, cache, group)
        undo.append(lambda: cache.__dict__.pop("update", None))
        handlers, installed = {}, {}
        for m in hf.attention_modules(model):
            impl = m.config._attn_implementation
            current = installed.setdefault(impl, ALL_ATTENTION_FUNCTIONS[impl])
            core = getattr(current, hf._CORE_ATTR, current)
            handlers[id(m)] = _Ulysses(m, impl, core, group, position_ids, padding)
        for impl, current in installed.items():
            ALL_ATTENTION_FUNCTIONS[impl] = _routing(current, handlers)
            undo.append(lambda impl=impl, current=current: ALL_ATTENTION_FUNCTIONS.__setitem__(impl, current))
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _routing(current, handlers):
    def attention(module, *args, **kwargs):
        handler = handlers.get(id(module))
        return (current if handler is None else handler)(module, *args, **kwargs)

    return attention


def _restore(module: nn.Module, name: str, had: bool, previous) -> None:
    if had:
        module.__dict__[name] = previous
    else:
        module.__dict__.pop(name, None)


def _cache_key(model: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _forward_kwargs(model: nn.Module, **values) -> dict:
    """``values`` restricted to what ``model.forward`` takes by name."""
    names = inspect.signature(model.forward).parameters
    return {k: v for k, v in values.items() if k in names and v is not None}


# -- the public functions ---------------------------------------------------------------------------


def _mask_problem(mask: Any, ids: torch.Tensor, what: str) -> Exception | None:
    """Whether ``mask`` is a padding mask of ``ids``' shape (0 padding, 1 a token); None: it is, or none given."""
    if mask is None:
        return None
    if not torch.is_tensor(mask) or tuple(mask.shape) != tuple(ids.shape):
        got = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        return ValueError(
            f"{what} must be a (batch, seqlen) tensor of the prompt's shape {tuple(ids.shape)} (0 for padding, 1 for "
            f"a token), got {got}. Pass the 2-D padding mask the tokenizer returns."
        )
    if not bool(((mask == 0) | (mask == 1)).all()):
        return ValueError(f"{what} must hold 0 (padding) and 1 (a token) only; pass the tokenizer's 2-D padding mask")
    return None


def _left_padding_problem(mask: torch.Tensor) -> Exception | None:
    """None when every row of ``mask`` (batch, L) is zeros then ones (left padding); else why it cannot be sharded."""
    later = mask[:, 1:] < mask[:, :-1]  # a masked position after a kept one
    if bool(later.any()):
        row, col = (int(i) for i in later.nonzero()[0])
        return NotImplementedError(
            f"the attention_mask masks position {col + 1} of row {row} after a token it keeps (right padding, or a "
            "pad_token_id inside the prompt, which generate masks): transformers' Mamba2 layers let the state decay "
            "across such a position without input, which the sharded prefill (left padding run as a document of its "
            "own before the prompt) cannot reproduce. Pad on the left (tokenizer padding_side='left'); to feed pad "
            "ids inside a prompt as ordinary tokens, pass attention_mask=torch.ones_like(input_ids)."
        )
    return None


def _padding_problem(model: nn.Module, cp: int) -> Exception | None:
    """Why a left-padded prompt cannot be prefilled sharded over ``cp`` ranks (None: it can)."""
    if cp == 1:
        return None  # the model's own forward, with its own padding mask
    for m in _mixers(model):
        if m.in_proj.bias is not None:
            return NotImplementedError(
                f"{type(m).__qualname__} (layer {m.layer_idx}) has a bias in in_proj: under transformers' padding mask "
                "the padded positions then pass that bias into the conv of the prompt's first d_conv - 1 tokens, "
                "which the sharded prefill (the padding a document of its own, whose conv columns the prompt does not "
                "see) does not reproduce. Batch prompts of one length without padding, or generate in a group of one."
            )
    for m in hf.attention_modules(model):
        if str(m.config._attn_implementation).startswith("flex"):
            return NotImplementedError(
                f"{type(m).__qualname__} runs flex_attention, whose block mask DeepSpeed's Ulysses attention rebuilds "
                "as a causal one, so it would not leave out the padding. For left-padded prompts use "
                "attn_implementation='sdpa' or a flash attention, or batch prompts of one length without padding."
            )
    return None


def sequence_parallel_prefill(model: nn.Module, input_ids_shard: torch.Tensor, group=None,
                              attention_mask_shard: torch.Tensor | None = None) -> Prefill:  # fmt: skip
    """Prefills a prompt sharded across ``group``; returns, on every rank, the logits after its last token and
    the decode cache of the whole prompt.

    input_ids_shard: (batch, seqlen/cp), this rank's contiguous shard (rank r holds tokens
    [r*seqlen/cp, (r+1)*seqlen/cp)), the same shape on every rank. attention_mask_shard: None, or this rank's
    shard of the prompt's 2-D padding mask (1 a token, 0 padding), left padding only; positions are generate's
    (``cumsum(mask) - 1``). group: the ranks sharing the prompt (None: a prepared model's, DeepSpeed's
    sequence-parallel group, or the world). Returns ``Prefill(logits (batch, vocab), cache)``, the cache a
    ``PrefilledCache`` identical on every rank, for ``model.generate(prompt_and_more, cache=cache)`` (with the
    same mask, extended) or the model's forward. Runs under ``torch.no_grad``; a group of one is the model's own
    forward with ``use_cache=True``. Errors (an unsupported model, shards of different shapes, padding not on
    the left) are raised on every rank alike.
    """
    group, rank, cp = _resolve_group(model, group)
    device = input_ids_shard.device if torch.is_tensor(input_ids_shard) else None
    cfg = _config(model, cp)
    problem = _model_problem(model, cfg, cp) or _ids_problem(input_ids_shard, "input_ids_shard")
    problem = problem or _mask_problem(attention_mask_shard, input_ids_shard, "attention_mask_shard")
    raise_alike(problem, group, device)
    _check_shards(input_ids_shard, group, device)
    local = input_ids_shard.shape[1]
    mask = None
    if attention_mask_shard is not None:
        whole = gather_sequence(attention_mask_shard.to(torch.long), 1, group)  # (batch, local*cp) on every rank
        if bool((whole == 0).any()):
            mask = whole
            raise_alike(_left_padding_problem(mask) or _padding_problem(model, cp), group, device)
    cache = PrefilledCache(model.config)
    if mask is None:
        # contiguous: DeepSpeed all-gathers position_ids, and gloo refuses an expanded (self-overlapping) CUDA tensor
        positions = torch.arange(rank * local, (rank + 1) * local, device=device).expand_as(input_ids_shard)
    else:  # generate's positions of a left-padded row
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, rank * local : (rank + 1) * local]
    positions = positions.contiguous()
    kwargs = _forward_kwargs(model, position_ids=positions, use_cache=True, logits_to_keep=1)
    kwargs[_cache_key(model)] = cache
    with torch.no_grad(), hf.sequence_parallel_disabled(model):
        if cp == 1:  # the model's own prefill
            kwargs.update(_forward_kwargs(model, attention_mask=mask))
            logits = model(input_ids=input_ids_shard, **kwargs).logits[:, -1]
        else:
            padding = None if mask is None else _LeftPadding(mask, rank, local)
            with _sharded(model, cache, group, cfg, positions, padding):
                logits = model(input_ids=input_ids_shard, **kwargs).logits[:, -1]
    cache.tokens = local * cp
    return Prefill(broadcast_from_last(logits, group), cache)


# prompt tokens left to generate: at least two, so that its first forward takes the model's chunked form, as one
# process's does (Zamba2's and Nemotron-H's decode step does not floor dt; docs/huggingface.md, "Generation")
_FED = 2

_REFUSED = {
    "cache": "the cache is built by the sharded prefill",
    "past_key_values": "the cache is built by the sharded prefill",
    "inputs_embeds": "the prompt is sharded as token ids",
    "assistant_model": "assisted decoding would run the assistant on the whole prompt in one process",
    "prefill_chunk_size": "the prefill is sharded instead (chunked prefill on shards is not supported)",
}


def _generate_problem(model, input_ids, kwargs: dict, cp: int) -> Exception | None:
    problem = _ids_problem(input_ids, "input_ids")
    if problem is not None:
        return problem
    for key, why in _REFUSED.items():
        if kwargs.get(key) is not None:
            return ValueError(f"sequence_parallel_generate does not take {key}= ({why}); drop it")
    return None


def _least_prompt(model, cp: int) -> int:
    """The fewest prompt tokens a sharded prefill over ``cp`` ranks takes: d_conv - 1 per rank (a shard's conv
    halo comes from the rank before alone) and the last ``_FED`` for generate."""
    halo = max([int(m.conv1d.weight.shape[-1]) - 1 for m in _mixers(model) + _deltas(model)] or [0])
    return cp * max(1, halo) + _FED


def _generation_config(model, kwargs: dict):
    """The generation config ``model.generate(**kwargs)`` runs with (transformers' own resolution, on a copy)."""
    named = inspect.signature(model.generate).parameters
    rest = {k: v for k, v in kwargs.items() if k not in named}
    return model._prepare_generation_config(kwargs.get("generation_config"), **rest)[0]


def _generation_mask(model, input_ids: torch.Tensor, kwargs: dict, config) -> Any:
    """The 2-D padding mask ``generate`` runs ``input_ids`` with: the one passed, or the one transformers derives
    from ``pad_token_id`` (the pad ids of the prompt masked, unless the pad id is also an eos id)."""
    mask = kwargs.get("attention_mask")
    if mask is not None or "attention_mask" not in inspect.signature(model.forward).parameters:
        return mask
    config = copy.deepcopy(config)  # _prepare_special_tokens writes its tensors into it
    model._prepare_special_tokens(config, None, device=input_ids.device, batch_size=input_ids.shape[0])
    return model._prepare_attention_mask_for_generation(input_ids, config, {})


def _generation_mask_problem(model, input_ids: torch.Tensor, mask: Any, cp: int) -> Exception | None:
    problem = _mask_problem(mask, input_ids, "attention_mask")
    if problem is not None or mask is None or not bool((mask == 0).any()):
        return problem
    empty = (mask == 0).all(1).nonzero().flatten().tolist()
    if empty:
        return ValueError(
            f"row {empty[0]} of the attention_mask keeps no token (all padding): there is no prompt to continue. "
            "Drop the row, or give it at least one token."
        )
    return _left_padding_problem(mask.long()) or _padding_problem(model, cp)


def _rng_fingerprint(device) -> list[int]:
    states = [torch.get_rng_state()]
    if torch.device(device).type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    digest = hashlib.sha256(b"".join(s.numpy().tobytes() for s in states)).digest()
    return [int.from_bytes(digest[i : i + 7], "little") for i in (0, 7, 14)]


def sequence_parallel_generate(model: nn.Module, input_ids: torch.Tensor, group=None, **generate_kwargs):
    """``model.generate(input_ids, **generate_kwargs)`` with the prompt prefilled sharded across ``group``.

    Every rank passes the same whole prompt ``input_ids`` (batch, seqlen) and ``attention_mask`` if any
    (checked); left padding only, pad ids masked as ``generate`` masks them. The first ``n*cp`` tokens
    (n = (seqlen - 2) // cp) are prefilled sharded; ``generate`` feeds the other 2..cp+1 and decodes from that
    cache whatever ``use_cache`` says (with ``use_cache=False``, in the chunked form where one process's
    recomputation would differ: ``_ChunkedDecode``). A prompt shorter than cp * (d_conv - 1) + 2 tokens at cp > 1,
    or of at most 2 in a group of one, is plain ``generate`` on every rank. Returns on every rank what
    ``model.generate`` returns in one process (the ranks' tokens compared). Sampling needs every rank's random
    generator in the same state (checked). group: see ``sequence_parallel_prefill``. Errors are raised on every
    rank alike.
    """
    group, rank, cp = _resolve_group(model, group)
    device = input_ids.device if torch.is_tensor(input_ids) else None
    problem = _generate_problem(model, input_ids, generate_kwargs, cp)
    # a prompt too short to shard (every rank holds it whole): plain generate on every rank (checked alike below)
    plain = problem is None and (cp == 1 or input_ids.shape[1] < _least_prompt(model, cp))
    config = mask = None
    if problem is None and not hasattr(model, "_prepare_generation_config"):
        problem = TypeError(f"{type(model).__qualname__} is not a transformers generative model (no generate)")
    if problem is None:
        try:
            config = _generation_config(model, generate_kwargs)
        except (ValueError, TypeError) as e:  # what generate itself would raise
            problem = e
    if problem is None:
        mask = _generation_mask(model, input_ids, generate_kwargs, config)
        problem = _generation_mask_problem(model, input_ids, mask, 1 if plain else cp)
    raise_alike(problem, group, device)
    if mask is not None and not bool((mask == 0).any()):
        mask = None  # all ones: no padding (generate drops it too)
    prompt = fingerprint(input_ids) + fingerprint(torch.ones_like(input_ids) if mask is None else mask.long())
    if not same_on_every_rank(prompt, group, device):
        raise ValueError(
            "sequence_parallel_generate: the ranks passed different prompts (shape, tokens or attention_mask); every "
            "rank of the group must pass the same whole input_ids and mask (each prefills its own shard of them)."
        )
    if config.do_sample and not same_on_every_rank(_rng_fingerprint(input_ids.device), group, device):
        raise ValueError(
            "sequence_parallel_generate with do_sample=True: the ranks' random generators are in different states, "
            "so they would sample different tokens. Seed every rank alike before the call (torch.manual_seed(s) "
            "with the same s on every rank), or decode greedily (do_sample=False)."
        )
    n = (input_ids.shape[1] - _FED) // cp
    if n <= 0 or (plain and cp > 1):  # nothing to prefill before generate's first forward, or nothing to shard
        with hf.sequence_parallel_disabled(model):
            out = model.generate(input_ids, **generate_kwargs)
        return out
    shard = slice(rank * n, (rank + 1) * n)
    cache = sequence_parallel_prefill(model, input_ids[:, shard], group, None if mask is None else mask[:, shard]).cache
    # use_cache=False would feed the whole sequence again on top of the cache: decode from the cache, in the chunked
    # form where the decode step would compute otherwise than one process's recomputation (_ChunkedDecode)
    kwargs = {**generate_kwargs, "use_cache": True, _cache_key(model): cache}
    hook = None
    if cache.attention_free:
        hook = model.register_forward_hook(functools.partial(_count_tokens, cache), with_kwargs=True)
    chunked = _ChunkedDecode(model, _config(model, cp)) if not config.use_cache else contextlib.nullcontext()
    try:
        with hf.sequence_parallel_disabled(model), chunked:
            out = model.generate(input_ids, **kwargs)
    finally:
        if hook is not None:
            hook.remove()
    tokens = out if torch.is_tensor(out) else out.sequences
    if not same_on_every_rank(fingerprint(tokens), group, device):
        raise RuntimeError(
            "sequence_parallel_generate: the ranks decoded different tokens from the same cache (nondeterministic "
            "kernels, or a logits processor or stopping criterion that differs by rank). Decode greedily with "
            "deterministic kernels, or generate on one rank and broadcast."
        )
    return out


def _floor_binds(mixer: nn.Module) -> bool:
    """Whether the mixer's chunked form clamps dt (``time_step_limit`` other than (0, inf): Zamba2's and Nemotron-H's
    (time_step_min, inf), or a config's own), which transformers' decode step (5.24) does not: there one process's
    ``generate(use_cache=False)``, the chunked form of the whole sequence at every step, and the cached decode part."""
    limit = getattr(mixer, "time_step_limit", None)
    if limit is None:
        return False
    low, high = (float(v) for v in limit)
    return low > 0.0 or high < float("inf")


class _ChunkedDecode:
    """During ``generate`` with ``use_cache=False`` asked for: each one-token decode step of a mixer whose decode step
    would part from its chunked form (``_floor_binds``) runs the chunked form instead, from the cached state and conv
    tail (the op's ``inference.forward.tile_forward`` on a tile of one token, dt clamped as in the chunked form),
    written back through the cache layer's own ``update_conv_state`` / ``update_recurrent_state``. Every other call
    runs the mixer's forward as it is."""

    def __init__(self, model: nn.Module, cfg: MambaSequenceParallelConfig) -> None:
        self.model, self.cfg, self.undo = model, cfg, []

    def __enter__(self):
        for m in _mixers(self.model):
            if not _floor_binds(m):
                continue
            had, previous = "forward" in m.__dict__, m.__dict__.get("forward")
            m.forward = functools.partial(self._step, hf._MixerAdapter(m, None, self.cfg), m.forward)
            self.undo.append(lambda m=m, had=had, previous=previous: _restore(m, "forward", had, previous))
        return self

    def __exit__(self, *exc) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo = []

    def _step(self, adapter, forward, *args, **kwargs):
        from ds_mamba_spcp.inference.forward import tile_forward

        hidden, cache, _, _ = hf.mixer_call(args, kwargs)
        m = adapter.mixer
        recording = getattr(cache, "is_recording_past", None)
        if (cache is None or hidden.shape[1] != 1 or cache.get_recurrent_state(m.layer_idx) is None
                or (recording is not None and recording(m.layer_idx))):  # fmt: skip
            return forward(*args, **kwargs)
        zx = adapter.in_proj(hidden)
        state, conv = cache.get_recurrent_state(m.layer_idx), cache.get_conv_state(m.layer_idx)
        y, (new_state, _) = tile_forward(zx, (state, conv.transpose(1, 2)), adapter.core(), self.cfg.backend)
        d_inner = m.num_heads * m.head_dim
        cache.update_conv_state(zx[..., d_inner : d_inner + conv.shape[1]].transpose(1, 2), m.layer_idx)
        cache.update_recurrent_state(new_state.to(state.dtype), m.layer_idx)
        return m.out_proj(y.to(hidden.dtype))


def _count_tokens(cache: PrefilledCache, module, args, kwargs, output) -> None:
    """Forward hook during ``generate``: an attention-free cache counts the tokens each forward fed it."""
    if kwargs.get("cache", kwargs.get("past_key_values")) is not cache:
        return
    fed = kwargs.get("input_ids")
    fed = kwargs.get("inputs_embeds") if fed is None else fed
    if fed is None and args:
        fed = args[0]
    if fed is not None:
        cache.tokens += int(fed.shape[1])
