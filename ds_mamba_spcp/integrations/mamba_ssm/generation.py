"""mamba-ssm models: a prompt prefilled sharded across the group into an ``InferenceParams``, then decoded.

    sequence_parallel_generate_mamba(model, input_ids, max_new_tokens, group)   the same prompt on every rank
        -> sequence_parallel_prefill_mamba(model, this rank's shard of prompt[:, :n*cp], group)
        -> the other seqlen - n*cp (< cp) prompt tokens one by one through the model's own step
        -> greedy decoding through the model's own step (``Mamba2.step`` via ``inference_params``), on
           every rank alike: the tokens of ``model.generate(input_ids, max_length, top_k=1)``

    sequence_parallel_prefill_mamba(model, input_ids_shard, group)   this rank's contiguous shard
        the model's forward on the shard with ``inference_params``; each ``Mamba2`` mixer runs in_proj ->
        the op with return_final_states -> out_proj and fills
        ``inference_params.key_value_memory_dict[layer_idx] = (conv_state, ssm_state)`` as mamba-ssm's own
        prefill does (its ``allocate_inference_cache`` layout and dtypes: the SSM state in the mixer's
        dtype); ``seqlen_offset`` = the prompt's length.

The model: a forward taking ``(input_ids, inference_params=..., num_last_tokens=...)`` and returning
``.logits`` (``MambaLMHeadModel``), of ``Mamba2`` mixers (or ``DistributedMamba2``) and no attention (``MHA``
is refused). mamba-ssm's decoding step is Triton: decoding runs on GPUs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from ds_mamba_spcp import comm
from ds_mamba_spcp.config import MambaSequenceParallelConfig
from ds_mamba_spcp.engine import modes
from ds_mamba_spcp.inference.prefill import (
    Prefill,
    broadcast_from_last,
    fingerprint,
    mixer_prefill,
    raise_alike,
    same_on_every_rank,
)
from ds_mamba_spcp.integrations.mamba_ssm.mixer import DistributedMamba2
from ds_mamba_spcp.ops.kernels.upstream import mamba2_class, mamba_module


def _mixers(model: nn.Module) -> list[nn.Module]:
    """The mamba-ssm Mamba2 mixers of ``model`` (a DistributedMamba2 stands for its mixer), each once."""
    mamba2, seen, found = mamba2_class(), set(), []
    for m in model.modules():
        mixer = m.local_mixer if isinstance(m, DistributedMamba2) else m
        if isinstance(mixer, mamba2) and id(mixer) not in seen:
            seen.add(id(mixer))
            found.append(mixer)
    return found


def _model_problem(model: nn.Module, mixers: list) -> Exception | None:
    name = type(model).__qualname__
    if not mixers:
        return ValueError(f"{name} holds no mamba-ssm Mamba2 mixer: nothing to prefill by state passing")
    attention = [type(m).__qualname__ for m in model.modules() if type(m).__name__ in ("MHA", "Mamba")]
    if attention:
        return NotImplementedError(
            f"{name} holds {attention[0]} layers (mamba-ssm's attention or Mamba-1), whose inference cache the "
            "sequence-parallel prefill does not fill; only models of Mamba2 layers are supported."
        )
    for m in mixers:
        if m.d_ssm != m.d_inner or m.process_group is not None or m.layer_idx is None:
            return NotImplementedError(
                f"Mamba2 layer {m.layer_idx}: d_ssm={m.d_ssm} (d_inner {m.d_inner}), a tensor-parallel process_group "
                "or no layer_idx; the prefill needs d_ssm=None, no process_group and a layer_idx (as MambaLMHeadModel "
                "builds them)."
            )
    return None


def _mixer_forward(mixer, wrapper: DistributedMamba2, group, cfg, u, seqlen=None, seq_idx=None, cu_seqlens=None,
                   inference_params=None):  # fmt: skip
    """A Mamba2 mixer's forward during the prefill: the op on the shard, the layer's states into the cache."""
    if seqlen is not None or seq_idx is not None or cu_seqlens is not None or inference_params is None:
        raise NotImplementedError("the sharded prefill takes (batch, local_seqlen, d_model) without packing")
    y, state, conv = mixer_prefill(mixer.in_proj(u), wrapper._core(), group, cfg)
    conv_state, ssm_state = mixer.allocate_inference_cache(u.shape[0], inference_params.max_seqlen)
    conv_state.copy_(conv)
    ssm_state.copy_(state)  # mamba-ssm keeps the SSM state in the mixer's dtype
    inference_params.key_value_memory_dict[mixer.layer_idx] = (conv_state, ssm_state)
    return mixer.out_proj(y)


def _restore_forwards(undo: list) -> None:
    """Puts back the instance ``forward`` of every (mixer, had one, previous) that a prefill replaced."""
    for m, had, previous in undo:
        if had:
            m.__dict__["forward"] = previous
        else:
            m.__dict__.pop("forward", None)


@contextlib.contextmanager
def _sharded(mixers: list, group, cfg):
    undo = []
    try:
        for m in mixers:
            had, previous = "forward" in m.__dict__, m.__dict__.get("forward")
            m.forward = functools.partial(_mixer_forward, m, DistributedMamba2(m, group, cfg), group, cfg)
            undo.append((m, had, previous))
        yield
    finally:
        _restore_forwards(undo)


def _resolve_group(group):
    """The group given, DeepSpeed's sequence-parallel group, or the world (``groups.generation_group``)."""
    from ds_mamba_spcp.groups import generation_group

    group = generation_group(group)
    rank, cp = comm.group_rank_size(group)
    return group, rank, cp


def _inference_params(max_seqlen: int, batch: int):
    return mamba_module("utils.generation").InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch)


def sequence_parallel_prefill_mamba(model: nn.Module, input_ids_shard: torch.Tensor, group=None, *,
                                    max_seqlen: int | None = None, config: Any = None) -> Prefill:  # fmt: skip
    """Prefills a prompt sharded across ``group`` into mamba-ssm's ``InferenceParams``.

    input_ids_shard: (batch, seqlen/cp), this rank's contiguous shard, the same shape on every rank. group: None
    is ``groups.generation_group``'s. max_seqlen: the ``InferenceParams``' (default: the prompt's length).
    config: the op's options (a ds_config or a MambaSequenceParallelConfig; default the defaults). Returns
    ``Prefill(logits (batch, vocab) after the prompt's last token, InferenceParams with seqlen_offset =
    seqlen)``, identical on every rank; under ``torch.no_grad``. Errors are raised on every rank alike.
    """
    from ds_mamba_spcp.config import load_mamba_sp_config

    group, rank, cp = _resolve_group(group)
    device = input_ids_shard.device if torch.is_tensor(input_ids_shard) else None
    mixers = _mixers(model)
    problem = _model_problem(model, mixers)
    if problem is None and (not torch.is_tensor(input_ids_shard) or input_ids_shard.dim() != 2):
        problem = ValueError("input_ids_shard must be a (batch, local_seqlen) tensor of token ids")
    raise_alike(problem, group, device)
    shape = [int(s) for s in input_ids_shard.shape]
    if not same_on_every_rank(shape, group, device):
        raise ValueError(
            "sequence_parallel_prefill_mamba: every rank must pass a shard of the same (batch, local_seqlen), the "
            "prompt split into equal contiguous parts."
        )
    base = {} if config is None else load_mamba_sp_config(config).model_dump()
    base.update(enabled=True, mode=modes.STATE_PASSING, load_balancing=modes.NONE, input_layout=modes.CONTIGUOUS)
    cfg = MambaSequenceParallelConfig(**{**base, "sequence_parallel_size": cp, "recompute_output": False})
    batch, local = shape
    params = _inference_params(max_seqlen or local * cp, batch)
    with torch.no_grad(), _sharded(mixers, group, cfg):
        logits = model(input_ids_shard, inference_params=params, num_last_tokens=1).logits[:, -1]
    params.seqlen_offset = local * cp
    return Prefill(broadcast_from_last(logits, group), params)


def _step(model, tokens: torch.Tensor, params) -> torch.Tensor:
    """One token per row through the model's own decoding step; the logits after it."""
    logits = model(tokens[:, None], inference_params=params, num_last_tokens=1).logits[:, -1]
    params.seqlen_offset += 1
    return logits


def sequence_parallel_generate_mamba(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, group=None,
                                     **prefill_kwargs) -> torch.Tensor:  # fmt: skip
    """Greedy generation with the prompt prefilled sharded across ``group``: on every rank, the
    (batch, seqlen + max_new_tokens) tokens of mamba-ssm's ``model.generate(input_ids, max_length=seqlen +
    max_new_tokens, top_k=1)``. Every rank passes the same prompt (checked). The prefill takes the first
    ``(seqlen // cp) * cp`` tokens; the rest (< cp) go through the model's own step one by one."""
    group, rank, cp = _resolve_group(group)
    device = input_ids.device if torch.is_tensor(input_ids) else None
    problem = None
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        problem = ValueError("input_ids must be a (batch, seqlen) tensor of token ids")
    elif input_ids.shape[1] < cp:
        problem = ValueError(f"the prompt has {input_ids.shape[1]} tokens, fewer than the {cp} ranks sharing it")
    elif int(max_new_tokens) < 1:
        problem = ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    raise_alike(problem, group, device)
    if not same_on_every_rank(fingerprint(input_ids), group, device):
        raise ValueError("sequence_parallel_generate_mamba: the ranks passed different prompts; pass the same one")
    seqlen = input_ids.shape[1]
    n = seqlen // cp
    prefill_kwargs.setdefault("max_seqlen", seqlen + max_new_tokens)
    logits, params = sequence_parallel_prefill_mamba(model, input_ids[:, rank * n : (rank + 1) * n], group,
                                                     **prefill_kwargs)  # fmt: skip
    out = [input_ids]
    with torch.no_grad():
        for i in range(n * cp, seqlen):
            logits = _step(model, input_ids[:, i], params)
        for i in range(max_new_tokens):
            token = logits.argmax(-1)
            out.append(token[:, None])
            if i + 1 < max_new_tokens:
                logits = _step(model, token, params)
    tokens = torch.cat(out, 1)
    if not same_on_every_rank(fingerprint(tokens), group, device):
        raise RuntimeError("sequence_parallel_generate_mamba: the ranks decoded different tokens from the same cache")
    return tokens


def _tile_mixer_forward(mixer, wrapper, carries: dict, backend: str, u, seqlen=None, seq_idx=None, cu_seqlens=None,
                        inference_params=None):  # fmt: skip
    from ds_mamba_spcp.inference.forward import tile_forward

    if seqlen is not None or seq_idx is not None or cu_seqlens is not None:
        raise NotImplementedError("the chunked prefill takes (batch, tile, d_model) without packing")
    out, carries[mixer.layer_idx] = tile_forward(mixer.in_proj(u), carries.get(mixer.layer_idx), wrapper._core(),
                                                 backend)  # fmt: skip
    return mixer.out_proj(out)


def chunked_prefill_mamba(model: nn.Module, input_ids: torch.Tensor, tile_length: int, *, backend: str = "auto",
                          max_seqlen: int | None = None) -> Prefill:  # fmt: skip
    """A prompt prefilled on one device in tiles of ``tile_length`` tokens through the whole model, every Mamba2
    layer's state and conv tail carried (``forward.tile_forward``): one tile's activations at a time. Returns
    ``Prefill(logits (batch, vocab) after the last token, InferenceParams)`` as ``sequence_parallel_prefill_mamba``
    does (the same states up to roundoff), under ``torch.no_grad``."""
    mixers = _mixers(model)
    problem = _model_problem(model, mixers)
    if problem is not None:
        raise problem
    if tile_length < 1:
        raise ValueError(f"tile_length must be >= 1, got {tile_length}")
    batch, seqlen = input_ids.shape
    carries: dict = {}
    undo = []
    try:
        for m in mixers:
            had, previous = "forward" in m.__dict__, m.__dict__.get("forward")
            wrapper = DistributedMamba2(m, None, {"mamba_sequence_parallel": {"enabled": False}})
            m.forward = functools.partial(_tile_mixer_forward, m, wrapper, carries, backend)
            undo.append((m, had, previous))
        with torch.no_grad():
            for start in range(0, seqlen, tile_length):
                logits = model(input_ids[:, start : start + tile_length], num_last_tokens=1).logits[:, -1]
    finally:
        _restore_forwards(undo)
    params = _inference_params(max_seqlen or seqlen, batch)
    for m in mixers:
        state, tail = carries[m.layer_idx]
        conv_state, ssm_state = m.allocate_inference_cache(batch, params.max_seqlen)
        conv_state.copy_(tail.transpose(1, 2))
        ssm_state.copy_(state)
        params.key_value_memory_dict[m.layer_idx] = (conv_state, ssm_state)
    params.seqlen_offset = seqlen
    return Prefill(logits, params)
