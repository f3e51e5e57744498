"""DistributedMamba2: mamba-ssm's ``Mamba2`` mixer on a sequence shard, shaped like DeepSpeed's
``DistributedAttention``.

The wrapper runs the math of ``Mamba2.forward`` (its memory-efficient path: in_proj, the mixer
core, out_proj) with the wrapped module's own parameters, but the mixer core is the
sequence-parallel op chosen by the ``"mamba_sequence_parallel"`` config section:

    state_passing / none     contiguous shards: in_proj -> mamba_split_conv1d_scan_sp -> out_proj
    state_passing / virtual  zigzag shards, two causal segments per rank, no activation moves
    state_passing / permute  zigzag shards: hidden_states -> contiguous (p2p or one all-to-all),
                             the "none" path, output -> zigzag. hidden_states (d_model wide) is
                             narrower than zxbcdt (2*d_inner + 2*ngroups*dstate + nheads), so the
                             permutation sits outside the projections.
    ulysses                  in_proj -> all-to-all head sharding -> full-length scan -> out_proj

The wrapper is transparent to checkpoints: it shares the wrapped module's parameter, buffer and
submodule registries (the same dict objects), so ``state_dict()``, ``named_parameters()``,
``load_state_dict()`` and ``.to()`` see exactly the unwrapped module's names and tensors, and a
checkpoint of the unwrapped model loads unchanged (and vice versa). Wrapping can therefore happen
before or after ``deepspeed.initialize`` (the parameters stay the same objects).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange
from torch import nn

from ds_mamba_spcp import op, permute
from ds_mamba_spcp._upstream import mamba2_class
from ds_mamba_spcp.call import Options, prepare
from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig, load_mamba_sp_config
from ds_mamba_spcp.groups import group_size, resolve_sequence_process_group
from ds_mamba_spcp.ops import get_backend, reference
from ds_mamba_spcp.ops.spec import CoreSpec

# The registries of nn.Module that hold what state_dict / parameters / .to() walk.
_SHARED_REGISTRIES = ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules")
_UNRESOLVED = object()


@dataclass(frozen=True)
class MixerCore:
    """The mixer core's parameters and options, read off a host mixer at each forward.

    Read at every call, not once: ZeRO-3 and ``load_state_dict(assign=True)`` swap parameters.
    Field names and meanings are those of ``mamba_split_conv1d_scan_sp``'s arguments.
    """

    conv1d_weight: torch.Tensor  # (conv_dim, d_conv)
    conv1d_bias: torch.Tensor | None  # (conv_dim,)
    dt_bias: torch.Tensor  # (nheads,)
    A: torch.Tensor  # (nheads,), negative: -exp(A_log)
    D: torch.Tensor  # (nheads,) or (nheads, headdim)
    chunk_size: int
    headdim: int
    ngroups: int
    dt_limit: tuple = (0.0, float("inf"))
    activation: str | None = "silu"
    rmsnorm_weight: torch.Tensor | None = None  # (nheads*headdim,), or None for y * silu(z)
    rmsnorm_eps: float = 1e-6
    norm_before_gate: bool = False

    @property
    def d_in_proj(self) -> int:
        """Width of in_proj's output (z, xBC, dt): d_inner + conv_dim + nheads."""
        nheads = self.A.shape[0]
        return nheads * self.headdim + self.conv1d_weight.shape[0] + nheads

    def op_arguments(self) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of mamba-ssm's ``mamba_split_conv1d_scan_combined`` and of
        this package's ops."""
        args = (self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A, self.D, self.chunk_size)
        kwargs = dict(
            dt_limit=tuple(self.dt_limit), headdim=self.headdim, ngroups=self.ngroups, activation=self.activation,
            rmsnorm_weight=self.rmsnorm_weight, rmsnorm_eps=self.rmsnorm_eps, norm_before_gate=self.norm_before_gate,
        )  # fmt: skip
        return args, kwargs


def mixer_forward(
    hidden: torch.Tensor,
    in_proj: Callable[[torch.Tensor], torch.Tensor],
    out_proj: Callable[[torch.Tensor], torch.Tensor],
    core: MixerCore,
    config: MambaSequenceParallelConfig,
    group,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    d_model: int | None = None,
) -> torch.Tensor:
    """in_proj -> the sequence-parallel mixer core chosen by ``config`` -> out_proj, on this rank's shard.

    hidden: (batch, local_seqlen, d_model), this rank's shard in ``config.input_layout``; in_proj maps it
    to zxbcdt (batch, local_seqlen, 2*d_inner + 2*ngroups*dstate + nheads) and out_proj maps the core's
    (batch, local_seqlen, d_inner) output back (any host-specific scaling goes inside these callables).
    seq_idx: (batch, local_seqlen) int32 document labels of the shard's tokens (packed rows), or
    cu_seqlens: the row's cumulative document lengths (batch 1); or neither. d_model: checked against
    hidden's last dim when given. Returns this rank's shard of the output, in the same layout.

    The call is validated before anything moves (one descriptor exchange with the other ranks, see
    ``ds_mamba_spcp.call``), then run by ``op.run``. Under the permute modes hidden_states (d_model
    wide) moves between the layouts instead of zxbcdt (several times wider): the permutation sits
    outside the projections. The modules that adapt a host mixer (DistributedMamba2, the transformers
    adapters) call this.
    """
    c = config
    args, kwargs = core.op_arguments()
    problem = None
    if hidden.dim() != 3 or (d_model is not None and hidden.shape[-1] != d_model):
        problem = ValueError(
            f"the mixer expects hidden states (batch, local_seqlen, d_model={d_model}), got {tuple(hidden.shape)}"
        )
    shape = tuple(hidden.shape[:2]) if hidden.dim() == 3 else (1, 1)
    probe = torch.empty(*shape, core.d_in_proj, dtype=hidden.dtype, device="meta")  # in_proj's output, to come
    options = Options(
        mode=c.mode, load_balancing=c.load_balancing, input_layout=c.input_layout,
        recompute_output=c.recompute_output, overlap_comm=c.overlap_comm, backend=c.backend,
        check_shapes=c.check_shapes, tile_length=c.tile_length,
    )  # fmt: skip
    call = prepare(
        probe, *args, process_group=group, options=options, seq_idx=seq_idx, cu_seqlens=cu_seqlens,
        device=hidden.device, what=f"{SECTION} ({c.mode}, load_balancing {c.load_balancing})", problem=problem,
        **kwargs,
    )  # fmt: skip
    method = _PERMUTE_METHOD.get(c.load_balancing) if c.mode == "state_passing" and call.cp > 1 else None
    if method is None:
        return out_proj(op.run(call.replace(zxbcdt=in_proj(hidden))))
    hidden = permute.zigzag_to_contiguous(hidden, group, method=method, dim=1)
    labels = None if call.seq_idx is None else permute.zigzag_to_contiguous(call.seq_idx, group, method=method)
    call = call.replace(zxbcdt=in_proj(hidden), seq_idx=labels)
    y = op.run(call.with_options(load_balancing="none", input_layout="contiguous"))
    return permute.contiguous_to_zigzag(out_proj(y), group, method=method, dim=1)


_PERMUTE_METHOD = {"permute_p2p": "p2p", "permute_a2a": "a2a"}


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
        local_mixer: a ``mamba_ssm.modules.mamba2.Mamba2``; its parameters are used (and stay its
            own): the wrapper adds none.
        sequence_process_group: the ranks that share one sequence, or None to look it up at the
            first forward (DeepSpeed's sequence-parallel group, else the world group when its size
            equals the configured ``sequence_parallel_size``; see :mod:`ds_mamba_spcp.groups`), so the
            wrapper may be built before ``deepspeed.initialize`` creates DeepSpeed's groups.
        config: a ds_config holding the ``"mamba_sequence_parallel"`` section (a dict, a path to a JSON
            file, a DeepSpeed engine or DeepSpeedConfig) or a :class:`MambaSequenceParallelConfig`.

    ``forward(u)``: u (batch, local_seqlen, d_model), this rank's shard in the configured
    ``input_layout``, or (batch*local_seqlen, d_model) with ``seqlen=local_seqlen`` as in Mamba2.
    Returns the shard of the output in the same layout and shape.

    With ``enabled`` false the wrapper is the mixer: ``forward`` calls the mixer's own forward with
    the same arguments. With a group of one rank it is the single-device computation: the mixer's
    own forward when the backend is Triton, the same math on the plain-PyTorch reference op
    otherwise (mamba-ssm's forward cannot run on CPU). Parameter gradients are each rank's local
    contribution; DeepSpeed's gradient reduction over the ranks adds them up.

    Not supported (NotImplementedError): Mamba2's gated-MLP part (d_ssm < d_inner), Mamba2's own
    tensor-parallel process_group, decoding with ``inference_params``, packed sequences
    (``seq_idx`` / ``cu_seqlens``), and shards of different lengths on different ranks.
    """

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
        # Transparency: share the mixer's registries instead of registering it as a child, so that
        # the parameter names are the unwrapped ones (no "local_mixer." prefix) for state_dict,
        # named_parameters (ZeRO's checkpoint name maps) and load_state_dict, with no key remapping;
        # and a parameter swap through either module (.to(), load_state_dict(assign=True)) is seen by
        # both. (ZeRO-3 later replaces this module's _parameters with its own dict holding the same
        # Parameter objects; forward reads parameters through the wrapper, so that stays correct.)
        for name in _SHARED_REGISTRIES:
            self.__dict__[name] = local_mixer.__dict__[name]
        self.__dict__["local_mixer"] = local_mixer  # a plain attribute, not a child
        # ZeRO-3 gathers a module's parameters in its forward pre-hook. The mixer core reads the conv1d
        # and norm weights without calling those submodules, and the disabled / group-of-one paths call
        # the mixer, which DeepSpeed never sees (it is not a child); as a ZeRO-3 leaf, the wrapper's
        # pre-hook gathers every parameter below it.
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
            self.config.validate_for_mixer(nheads=m.nheads, ngroups=m.ngroups, sp_size=size)
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
            # Drop-in: public attributes and methods of the mixer (d_model, layer_idx,
            # allocate_inference_cache, ...) read through; private ones and DeepSpeed's ds_* markers do not.
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
        return f"mode={c.mode}, load_balancing={c.load_balancing}, input_layout={c.input_layout}, sp_size={size}"

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
        if self._group_size == 1 and backend is not reference and self._fits_one_call(backend, u):
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
        # Mamba2 takes A_log.float() so that fp16 weights cannot overflow to A = -inf; promoting (instead
        # of casting) is the same for fp16/bf16/fp32 and keeps an fp64 model in fp64.
        A = -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))
        return MixerCore(
            conv1d_weight=rearrange(self.conv1d.weight, "d 1 w -> d w"), conv1d_bias=self.conv1d.bias,
            dt_bias=self.dt_bias, A=A, D=rearrange(self.D, "(h p) -> h p", p=m.headdim) if m.D_has_hdim else self.D,
            chunk_size=m.chunk_size, headdim=m.headdim, ngroups=m.ngroups, dt_limit=m.dt_limit,
            activation=m.activation, rmsnorm_weight=self.norm.weight if m.rmsnorm else None,
            rmsnorm_eps=self.norm.eps if m.rmsnorm else 1e-6, norm_before_gate=m.norm_before_gate,
        )  # fmt: skip


def wrap_mamba2_mixers(model: nn.Module, sequence_process_group: Any, config: Any) -> int:
    """Replaces every ``Mamba2`` submodule of ``model`` with a :class:`DistributedMamba2`, in place, and makes
    transformers' Mamba2-style mixers sequence-parallel (``integrations.transformers.wrap_hf_mamba2_mixers``).

    The config is read once and shared. A mixer registered at several places is wrapped once and the
    same wrapper put at each; mixers already wrapped are left alone. Returns the number of mixers
    wrapped. State_dict keys do not change, so this can run before or after loading a checkpoint, and
    before or after ``deepspeed.initialize`` (the parameters stay the same objects; transformers' mixers
    under ZeRO-3: before, see ``integrations.transformers``).
    """
    mamba2 = mamba2_class()
    if isinstance(model, mamba2):
        raise ValueError(
            "wrap_mamba2_mixers replaces Mamba2 submodules inside a model; the model itself is a Mamba2, so wrap it "
            "directly: DistributedMamba2(mixer, sequence_process_group, config)."
        )
    cfg = config if isinstance(config, MambaSequenceParallelConfig) else load_mamba_sp_config(config)
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
    if sys.modules.get("transformers") is None:
        return len(wrappers)
    # transformers' Mamba2-style mixers (Bamba, Nemotron-H, ...): ds_mamba_spcp.integrations.transformers
    from ds_mamba_spcp.integrations.transformers import wrap_hf_mamba2_mixers

    return len(wrappers) + wrap_hf_mamba2_mixers(model, sequence_process_group, cfg)
