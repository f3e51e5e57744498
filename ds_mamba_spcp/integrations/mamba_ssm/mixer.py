"""The mamba-ssm adapter: ``DistributedMamba2``, mamba-ssm's ``Mamba2`` mixer on a sequence shard, shaped like
DeepSpeed's ``DistributedAttention``.

The wrapper runs the math of ``Mamba2.forward`` (in_proj, the mixer core, out_proj) with the wrapped module's
own parameters, through ``integrations/core.py``. It shares the wrapped module's parameter, buffer and
submodule registries (the same dict objects), so ``state_dict()``, ``load_state_dict()`` and ``.to()`` see the
unwrapped module's names and tensors, and wrapping may happen before or after ``deepspeed.initialize``.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import nn

from ds_mamba_spcp.config import SECTION, load_mamba_sp_config
from ds_mamba_spcp.groups import group_size, resolve_sequence_process_group
from ds_mamba_spcp.integrations.core import MixerCore, mixer_forward
from ds_mamba_spcp.ops import get_backend
from ds_mamba_spcp.ops.kernels.upstream import mamba2_class
from ds_mamba_spcp.ops.spec import CoreSpec

# The registries of nn.Module that hold what state_dict / parameters / .to() walk.
_SHARED_REGISTRIES = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")
_UNRESOLVED = object()


def _check_mixer_supported(mixer) -> None:
    """Raises NotImplementedError for Mamba2 configurations the sequence-parallel path cannot run."""
    if mixer.d_ssm != mixer.d_inner:
        raise NotImplementedError(
            f"Mamba2 with d_ssm={mixer.d_ssm} < d_inner={mixer.d_inner} (a gated-MLP part beside the SSM) is not "
            "supported by DistributedMamba2: the sequence-parallel mixer core handles only z, xBC and dt. Build "
            "the mixer with d_ssm=None."
        )
    if mixer.process_group is not None:
        raise NotImplementedError(
            "Mamba2 built with a tensor-parallel process_group (and its own sequence_parallel flag, which "
            "splits batch*seqlen across the tensor-parallel ranks) is not supported by DistributedMamba2; build "
            "the mixer with process_group=None and shard the sequence through the DeepSpeed "
            f'"{SECTION}" section instead.'
        )


def _reject_call(inference_params) -> None:
    if inference_params is not None:
        raise NotImplementedError(
            "decoding with an inference cache (inference_params) is not supported by DistributedMamba2: the "
            "cache would hold one rank's conv and SSM state while the sequence is split across ranks. Generate "
            f'with the unwrapped mixer, or with "{SECTION}.enabled" set to false (the wrapper then runs the '
            "mixer's own forward)."
        )


class DistributedMamba2(nn.Module):
    """mamba-ssm's ``Mamba2`` mixer run on this rank's shard of the sequence.

    Arguments:
        local_mixer: a ``mamba_ssm.modules.mamba2.Mamba2``; its parameters are used (the wrapper adds none).
        sequence_process_group: the ranks that share one sequence, or None to look it up at the first
            forward (:mod:`ds_mamba_spcp.groups`; the wrapper may then precede ``deepspeed.initialize``).
        config: anything :func:`load_mamba_sp_config` reads.

    ``forward(u)``: u (batch, local_seqlen, d_model), this rank's shard in the configured ``input_layout``, or
    (batch*local_seqlen, d_model) with ``seqlen=local_seqlen``; returns the output's shard, same layout and shape.
    With ``enabled`` false ``forward`` is the mixer's own; in a group of one, the mixer's own on Triton, the same
    math on the reference op otherwise. Parameter gradients are each rank's local contribution. Packed rows:
    ``seq_idx`` or ``cu_seqlens``. Not supported (NotImplementedError): d_ssm < d_inner, Mamba2's own
    tensor-parallel process_group, ``inference_params``, shards of different lengths.
    """

    _ds_mamba_spcp_sharded = True  # integrations.core.SHARDED_ATTR

    def __init__(self, local_mixer: nn.Module, sequence_process_group: Any, config: Any) -> None:
        super().__init__()
        mamba2 = mamba2_class()
        if not isinstance(local_mixer, mamba2):
            raise TypeError(
                f"DistributedMamba2 wraps a mamba_ssm.modules.mamba2.Mamba2, got {type(local_mixer).__qualname__}."
            )
        self.config = load_mamba_sp_config(config)
        if self.config.enabled:
            _check_mixer_supported(local_mixer)
        # share the mixer's registries instead of registering it as a child: the unwrapped parameter names, and a
        # parameter swap through either module is seen by both (forward reads them through the wrapper)
        for name in _SHARED_REGISTRIES:
            self.__dict__[name] = local_mixer.__dict__[name]
        self.__dict__["local_mixer"] = local_mixer  # a plain attribute, not a child
        # a ZeRO-3 leaf: its pre-hook gathers every parameter below it (the core reads conv1d and norm weights
        # without calling them; the mixer, not a child, is never seen by DeepSpeed)
        self._z3_leaf = True
        self._group_arg = sequence_process_group
        self._group = _UNRESOLVED
        self._group_size = 1
        self._checked_shards: set = set()
        if self.config.enabled and sequence_process_group is not None:
            self._resolve_group()  # an explicit group is checked at once

    # -- the process group --------------------------------------------------------------------------

    def _resolve_group(self):
        if self._group is _UNRESOLVED:
            group = resolve_sequence_process_group(self._group_arg, self.config)
            size = group_size(group)
            m = self.local_mixer
            self.config.validate_for_mixer(nheads=m.nheads, ngroups=m.ngroups, cp=size)
            self._group, self._group_size = group, size
        return self._group

    @property
    def process_group(self):
        """The sequence-parallel group (resolved on first use; None: a process without deepspeed.comm)."""
        return self._resolve_group()

    @property
    def sequence_parallel_size(self) -> int:
        """Number of ranks sharing the sequence (1 when the wrapper is disabled)."""
        if not self.config.enabled:
            return 1
        self._resolve_group()
        return self._group_size

    # -- nn.Module plumbing ---------------------------------------------------------------------------

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            # drop-in: the mixer's public attributes read through; private ones and DeepSpeed's ds_* markers do not
            mixer = self.__dict__.get("local_mixer")
            if mixer is None or name.startswith(("_", "ds_")):
                raise
            return getattr(mixer, name)

    def step(self, hidden_states, conv_state, ssm_state):
        """Decoding one token with the mixer's cache: only without sequence parallelism."""
        if self.config.enabled:
            raise NotImplementedError(
                "decoding (Mamba2.step with a conv/SSM state cache) is not supported by DistributedMamba2 while "
                f'sequence parallelism is enabled: the cache would hold one rank\'s state. Set "{SECTION}.enabled" '
                "to false for generation (the wrapper then runs the mixer itself)."
            )
        return self.local_mixer.step(hidden_states, conv_state, ssm_state)

    def train(self, mode: bool = True):
        super().train(mode)
        self.local_mixer.training = mode  # not a child, so nn.Module.train does not reach it
        return self

    def extra_repr(self) -> str:
        c = self.config
        if not c.enabled:
            return "enabled=False"
        size = "unresolved" if self._group is _UNRESOLVED else self._group_size
        return f"mode={c.mode}, load_balancing={c.load_balancing}, input_layout={c.input_layout}, cp={size}"

    # -- forward --------------------------------------------------------------------------------------

    def forward(self, u, seqlen=None, seq_idx=None, cu_seqlens=None, inference_params=None):
        """Same signature as ``Mamba2.forward``; ``u`` is this rank's shard of the sequence, ``seq_idx`` its
        shard of the packed row's document labels (or ``cu_seqlens`` the row's document lengths)."""
        if not self.config.enabled:
            return self.local_mixer(
                u, seqlen=seqlen, seq_idx=seq_idx, cu_seqlens=cu_seqlens, inference_params=inference_params
            )
        _reject_call(inference_params)
        group = self._resolve_group()
        backend = get_backend(self.config.backend, u.device)
        if self._group_size == 1 and backend.NAME == "triton" and self._fits_one_call(backend, u):
            return self.local_mixer(u, seqlen=seqlen, seq_idx=seq_idx, cu_seqlens=cu_seqlens)  # the unwrapped module
        hidden = u if seqlen is None else rearrange(u, "(b l) d -> b l d", l=seqlen)
        out = mixer_forward(
            hidden, self.in_proj, self.out_proj, self._core(), self.config, group, seq_idx=seq_idx,
            cu_seqlens=cu_seqlens, d_model=self.local_mixer.d_model,
        )  # fmt: skip
        return out if seqlen is None else rearrange(out, "b l d -> (b l) d")

    def _fits_one_call(self, backend, u) -> bool:
        """Whether mamba-ssm's own op can take these tokens in one call (else the op runs them in tiles)."""
        m = self.local_mixer
        spec = CoreSpec(m.nheads, m.headdim, m.ngroups, m.d_state, m.d_conv, m.chunk_size)
        limit = backend.max_tokens_per_call(spec)
        tokens = u.numel() // u.shape[-1]
        return self.config.tile_length is None and (limit is None or tokens <= limit)

    def _core(self) -> MixerCore:
        """The mixer core's parameters and options, read off the wrapped Mamba2 as its forward does."""
        m = self.local_mixer
        # Mamba2 takes A_log.float(); promoting is the same for fp16/bf16/fp32 and keeps fp64 in fp64
        A = -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))
        return MixerCore(
            conv1d_weight=rearrange(self.conv1d.weight, "d 1 w -> d w"), conv1d_bias=self.conv1d.bias,
            dt_bias=self.dt_bias, A=A, D=rearrange(self.D, "(h p) -> h p", p=m.headdim) if m.D_has_hdim else self.D,
            chunk_size=m.chunk_size, headdim=m.headdim, ngroups=m.ngroups, dt_limit=m.dt_limit,
            activation=m.activation, rmsnorm_weight=self.norm.weight if m.rmsnorm else None,
            rmsnorm_eps=self.norm.eps if m.rmsnorm else 1e-6, norm_before_gate=m.norm_before_gate,
        )  # fmt: skip


def wrap_mamba_ssm_mixers(model: nn.Module, sequence_process_group: Any, config: Any) -> int:
    """Replaces every mamba-ssm ``Mamba2`` submodule of ``model`` with a :class:`DistributedMamba2`, in place (one
    wrapper per mixer, wrapped ones left alone); returns the number wrapped. State_dict keys do not change."""
    mamba2 = mamba2_class()
    if isinstance(model, mamba2):
        raise ValueError(
            "wrap_mamba2_mixers replaces Mamba2 submodules inside a model; the model itself is a Mamba2, so wrap it "
            "directly: DistributedMamba2(mixer, sequence_process_group, config)."
        )
    cfg = load_mamba_sp_config(config)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, mamba2)
    ]
    wrappers: dict[int, DistributedMamba2] = {}
    for parent, name, child in targets:
        if id(child) not in wrappers:
            wrappers[id(child)] = DistributedMamba2(child, sequence_process_group, cfg)
        setattr(parent, name, wrappers[id(child)])
    return len(wrappers)
