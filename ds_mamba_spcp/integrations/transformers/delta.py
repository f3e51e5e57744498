"""transformers' Gated DeltaNet layers (Qwen3.5 dense and MoE, Qwen3-Next, OLMo-hybrid) and Kimi Linear's KDA
layers made sequence-parallel.

    hidden (batch, local_seqlen, hidden) --the layer's own projections--> mixed_qkv, z (output gate), beta, g
    mixed_qkv --the K-1 rows of the previous rank (halo) + causal conv1d + activation--> q, k, v
    q, k, v, g, beta --chunk_gated_delta_rule_sp--> o
    o --the layer's gated RMSNorm with z, its output projection--> out

The decay g is the layer's own: -exp(A_log) softplus(a + dt_bias) per value head for the Gated DeltaNet layers,
and Kimi's ``forget_gate`` module (per key channel, (batch, seqlen, H, K): the op's KDA form) for
``KimiLinearDeltaAttention``; beta = sigmoid(b) (x2 with allow_neg_eigval).

A wrapped layer keeps its class and place, as the Mamba2 mixers do (``adapter.py``): its instance ``forward`` is
replaced, the previous one runs every unsharded call, it is a ZeRO-3 leaf (the conv weight is read without calling
``conv1d``). ``DELTA_CLASSES`` names the layers; each family's widths, projections (beta and g with them) and output
are read by ``_dims``, ``_projections`` and ``_output``. A sharded call takes no cache (generation runs inside
``sequence_parallel_disabled``; the sharded prefill of ``generation.py`` calls ``forward(..., decode_state=True)``
and fills the cache itself) and no padding; packed rows arrive as ``seq_idx`` (the model call's, or one the layer is
given) and become the op's ``cu_seqlens`` (one packed row per call). The user's page: docs/huggingface.md, "Gated
DeltaNet families".
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ds_mamba_spcp import comm
from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig
from ds_mamba_spcp.delta_op import chunk_gated_delta_rule_sp
from ds_mamba_spcp.engine import modes
from ds_mamba_spcp.integrations.core import loaded_classes

# class name -> modeling module of transformers' Gated DeltaNet layers
DELTA_CLASSES = {
    "Qwen3_5GatedDeltaNet": "transformers.models.qwen3_5.modeling_qwen3_5",
    "Qwen3_5MoeGatedDeltaNet": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "Qwen3NextGatedDeltaNet": "transformers.models.qwen3_next.modeling_qwen3_next",
    "OlmoHybridGatedDeltaNet": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    "KimiLinearDeltaAttention": "transformers.models.kimi_linear.modeling_kimi_linear",
}


def delta_classes() -> tuple[type, ...]:
    """The classes of ``DELTA_CLASSES`` whose modeling module is loaded."""
    return loaded_classes(DELTA_CLASSES)


# -- the families' projections ----------------------------------------------------------------------


def _dims(m: nn.Module) -> tuple[int, int, int, int]:
    """(key_dim, value_dim, head_k_dim, head_v_dim) of a layer: q/k/v's widths in mixed_qkv and their heads'."""
    if hasattr(m, "forget_gate"):  # Kimi Linear: q, k and v of num_heads x head_dim each
        return m.qkv_dim, m.qkv_dim, m.head_dim, m.head_dim
    return m.key_dim, m.value_dim, m.head_k_dim, m.head_v_dim


def _projections(m: nn.Module, hidden: torch.Tensor):
    """(mixed_qkv (batch, seqlen, 2*key_dim + value_dim) before the conv, z (batch, seqlen, v_heads, head_v_dim),
    beta (batch, seqlen, v_heads), g: the log decay, (batch, seqlen, v_heads) or, for Kimi, (batch, seqlen, heads,
    head_dim)) computed by the layer's own projections, as its forward does."""
    B, L, _ = hidden.shape
    if hasattr(m, "forget_gate"):  # Kimi Linear (KDA): low-rank output gate, its forget-gate module per channel
        mixed = torch.cat([m.q_proj(hidden), m.k_proj(hidden), m.v_proj(hidden)], dim=-1)
        z = m.g_b_proj(m.g_a_proj(hidden)).reshape(B, L, -1, m.head_dim)
        return mixed, z, m.b_proj(hidden).sigmoid(), m.forget_gate(hidden)
    if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: fused and interleaved per key head
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hidden), m.in_proj_ba(hidden))
        mixed = torch.cat([t.reshape(B, L, -1) for t in (q, k, v)], dim=-1)
    elif hasattr(m, "in_proj_qkv"):  # Qwen3.5 dense and MoE
        z = m.in_proj_z(hidden).reshape(B, L, -1, m.head_v_dim)
        mixed, b, a = m.in_proj_qkv(hidden), m.in_proj_b(hidden), m.in_proj_a(hidden)
    else:  # OLMo-hybrid: separate projections, a dedicated gate projection
        mixed = torch.cat([m.q_proj(hidden), m.k_proj(hidden), m.v_proj(hidden)], dim=-1)
        z, b, a = m.g_proj(hidden).reshape(B, L, -1, m.head_v_dim), m.b_proj(hidden), m.a_proj(hidden)
    beta = b.sigmoid()
    if getattr(m, "allow_neg_eigval", False):
        beta = beta * 2.0
    return mixed, z, beta, -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)


def _output(m: nn.Module, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The layer's gated RMSNorm (per value head, gated by z) and output projection."""
    B, L = o.shape[:2]
    norm, proj = (m.norm, m.out_proj) if hasattr(m, "out_proj") else (m.o_norm, m.o_proj)
    head_v_dim = _dims(m)[3]
    y = norm(o.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim))
    return proj(y.reshape(B, L, -1))


# -- the conv halo ----------------------------------------------------------------------------------


class _Halo(torch.autograd.Function):
    """The last ``K-1`` rows of the previous rank's shard (zeros on rank 0); backward returns each rank's rows'
    gradient to the rank that owns them. Both directions are one all-gather over the group."""

    @staticmethod
    def forward(ctx, tail, group, rank, cp):
        ctx.group, ctx.rank, ctx.cp = group, rank, cp
        every = comm.all_gather(tail, group, cp, async_op=False).wait()  # (cp, *tail.shape)
        return every[rank - 1].clone() if rank > 0 else torch.zeros_like(tail)

    @staticmethod
    def backward(ctx, grad):
        every = comm.all_gather(grad.contiguous(), ctx.group, ctx.cp, async_op=False).wait()
        mine = every[ctx.rank + 1].clone() if ctx.rank + 1 < ctx.cp else torch.zeros_like(grad)
        return mine, None, None, None


def _cu_seqlens(labels: torch.Tensor) -> torch.Tensor:
    """The cumulative document lengths (0, ..., len) of one whole row's document labels."""
    starts = torch.nonzero(labels[1:] != labels[:-1]).flatten() + 1
    return torch.cat([labels.new_zeros(1), starts, labels.new_full((1,), labels.numel())])


class DeltaAdapter:
    """The sequence-parallel forward of one Gated DeltaNet layer (held in its ``__dict__`` under the attribute of
    the Mamba2 adapter, so that ``sequence_parallel_disabled`` and ``prepare_sequence_parallel`` find it)."""

    def __init__(self, layer: nn.Module, sharding) -> None:
        self.mixer = layer
        self.original_forward = layer.forward
        self.sharding = sharding
        self.model_state = None  # set by prepare_sequence_parallel
        self.tile = None

    def __call__(self, *args, **kwargs):
        from ds_mamba_spcp.integrations.transformers.layers import cache_error, mixer_call, padding_error

        hidden, cache, attention_mask, rest = mixer_call(args, kwargs)
        if not self.sharding.routes_op():
            return self.original_forward(*args, **kwargs)
        if self.sharding.size == 1 and (cache is not None or attention_mask is not None):
            # the "long_context" key at sequence_parallel_size 1 wraps the layers on a group of one, so that they train
            # on the op (long_context.py recomputes each whole inside its decoder layer's checkpoint); generation and
            # padded rows are transformers' own
            return self.original_forward(*args, **kwargs)
        name = f"{type(self.mixer).__qualname__} (layer {self.mixer.layer_idx})"
        if cache is not None:
            raise cache_error(name)
        if attention_mask is not None:
            raise padding_error(f"an attention_mask reached {name}")
        seq_idx = rest.get("seq_idx")
        if seq_idx is None and self.model_state is not None:
            seq_idx = self.model_state.seq_idx
        return self.forward(hidden, seq_idx)

    def forward(self, hidden: torch.Tensor, seq_idx: torch.Tensor | None, decode_state: bool = False):
        """This rank's shard of the layer's output; with ``decode_state`` (a prefill, ``generation.py``) also the
        decode state after the shard: (out, the op's final states (N, H, K, V) fp32, identical on every rank, N the
        batch or the rows' documents in row order; the last K pre-conv rows (batch, conv_dim, K), this rank's,
        halo included, zero where they lie before the row's last document)."""
        m, cfg = self.mixer, self.sharding.config
        group, cp = self.sharding.group(), self.sharding.size
        rank = comm.group_rank_size(group)[0]
        B, L, _ = hidden.shape
        if not isinstance(m.conv1d, nn.Conv1d):  # e.g. PEFT's LoRA on conv1d (r a multiple of its channels)
            raise NotImplementedError(
                f"{type(m).__qualname__} (layer {m.layer_idx}): its conv1d is a {type(m.conv1d).__module__}."
                f"{type(m.conv1d).__qualname__}, not a torch.nn.Conv1d; the sequence-parallel path reads "
                "conv1d.weight directly, so an adapter there would be skipped. Leave conv1d out of PEFT's "
                "target_modules (the projections may be adapted)."
            )
        mixed, z, beta, g = _projections(m, hidden)
        K = m.conv_kernel_size
        tail = mixed[:, L - (K - 1) :] if L >= K - 1 else None
        if tail is None:
            raise ValueError(
                f"{type(m).__qualname__}: each rank's shard must hold at least conv_kernel_size - 1 = {K - 1} tokens "
                f"(got {L}); use fewer ranks or longer rows."
            )
        halo = _Halo.apply(tail.contiguous(), group, rank, cp)
        x = torch.cat([halo, mixed], dim=1).transpose(1, 2)  # (B, C, K-1+L)
        weight = m.conv1d.weight
        x = x.to(weight.dtype)
        cu = None
        if seq_idx is None:
            x = F.conv1d(x, weight, m.conv1d.bias, groups=x.shape[1])
        else:
            if tuple(seq_idx.shape) != (B, L):
                raise ValueError(
                    f"{type(m).__qualname__}: seq_idx has shape {tuple(seq_idx.shape)} but this rank's hidden_states "
                    f"hold (batch, local_seqlen) = {(B, L)}; shard seq_idx with the tokens."
                )
            labels = comm.all_gather(seq_idx.to(torch.int64), group, cp, async_op=False).wait()  # (cp, B, L)
            cu = [_cu_seqlens(row) for row in labels.transpose(0, 1).reshape(B, cp * L)]
            before = labels[rank - 1][:, L - (K - 1) :] if rank > 0 else labels.new_full((B, K - 1), -1)
            x = _packed_conv(x, torch.cat([before, labels[rank]], dim=1), weight, m.conv1d.bias)
        x = _act(m.activation)(x).to(mixed.dtype).transpose(1, 2)
        key_dim, value_dim, head_k_dim, head_v_dim = _dims(m)
        q, k, v = torch.split(x, [key_dim, key_dim, value_dim], dim=-1)
        q = q.reshape(B, L, -1, head_k_dim)
        k = k.reshape(B, L, -1, head_k_dim)
        v = v.reshape(B, L, -1, head_v_dim)
        options = dict(
            use_qk_l2norm_in_kernel=True, process_group=group, mode=cfg.mode, load_balancing=cfg.load_balancing,
            input_layout=cfg.input_layout, summary_exchange=cfg.summary_exchange,
            backend=_delta_backend(cfg.backend), check_shapes=cfg.check_shapes,
        )  # fmt: skip
        options["output_final_state"] = decode_state
        if cu is None:
            o, final = chunk_gated_delta_rule_sp(q, k, v, g, beta, **options)
        else:  # the op takes one packed row per call (cu_seqlens): row by row, alike on every rank
            rows = [
                chunk_gated_delta_rule_sp(*(t[r : r + 1] for t in (q, k, v, g, beta)), cu_seqlens=cu[r], **options)
                for r in range(B)
            ]  # fmt: skip
            o = torch.cat([row[0] for row in rows])
            final = torch.cat([row[1] for row in rows]) if decode_state else None
        out = _output(m, o, z)
        if not decode_state:
            return out
        window = torch.cat([halo, mixed], dim=1)[:, -K:]  # (B, K, C): L >= K-1, so the halo fills what L lacks
        if seq_idx is not None:
            marks = torch.cat([before, labels[rank]], dim=1)[:, -K:]
            window = window * (marks == marks[:, -1:]).to(window.dtype)[..., None]
        return out, final, window.transpose(1, 2).contiguous()

    def __deepcopy__(self, memo):
        from ds_mamba_spcp.integrations.transformers.layers import copy_adapter

        return copy_adapter(self, memo)


def _act(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _delta_backend(backend: str) -> str:
    """The delta op's backend for the section's ``"backend"`` (the Mamba2 backends' names: only "auto" and
    "reference" mean the same here)."""
    return backend if backend in ("auto", "reference") else "auto"


def _packed_conv(x, labels, weight, bias):
    """The depthwise causal conv of ``x`` (batch, C, K-1+L: halo rows first) where a token reads only rows of its
    own document (``labels`` (batch, K-1+L)), as transformers' fused causal_conv1d does with cu_seqlens."""
    K = weight.shape[-1]
    windows = x.unfold(-1, K, 1)  # (B, C, L, K)
    own = labels.unfold(-1, K, 1) == labels[:, K - 1 :, None]  # (B, L, K)
    y = (windows * own[:, None].to(x.dtype) * weight[:, 0][None, :, None, :]).sum(-1)
    return y if bias is None else y + bias[None, :, None]


def wrap_delta_layers(model: nn.Module, make_sharding) -> int:
    """Makes every Gated DeltaNet layer of ``model`` sequence-parallel, in place (``make_sharding()``: a fresh
    ``_Sharding``); returns how many it wrapped."""
    from ds_mamba_spcp.integrations.transformers.layers import MIXER_ATTR, install_adapter

    classes = delta_classes()
    if not classes:
        return 0
    todo = [m for m in model.modules() if isinstance(m, classes) and MIXER_ATTR not in m.__dict__]
    for m in todo:
        check_delta_supported(m, make_sharding().config)
    for m in todo:
        install_adapter(m, DeltaAdapter(m, make_sharding()))
    if todo:
        _install_fla_stand_in()
    return len(todo)


def _install_fla_stand_in() -> None:
    """On a CUDA machine with flash-linear-attention: where fla 0.6.0 refuses its gated backward (Hopper, Triton
    3.4-3.7.0), registers ``ops/delta_dqkwg.py`` with fla's dispatch (``ops.delta.fla_backward_refusal`` does), so
    that transformers' own calls into fla train there too (a layer's original forward: padded rows at
    ``sequence_parallel_size`` 1, an adapter switched off), not only this package's op, which installs it itself."""
    if not torch.cuda.is_available():
        return
    from ds_mamba_spcp.ops.delta import fla_backward_refusal

    with contextlib.suppress(ImportError):  # no fla: transformers runs its own PyTorch code
        fla_backward_refusal()


def check_delta_supported(m: nn.Module, cfg: MambaSequenceParallelConfig) -> None:
    """Raises for a layer or setting the sequence-parallel path cannot run exactly as transformers does."""
    name = f"{type(m).__qualname__} (layer {m.layer_idx})"
    if cfg.input_layout != modes.CONTIGUOUS:
        raise NotImplementedError(
            f'{name}: "{SECTION}.input_layout" is {cfg.input_layout!r}; the Gated DeltaNet layers take contiguous '
            'shards (their conv halo comes from the previous rank). Set "input_layout": "contiguous" and '
            '"load_balancing": "none".'
        )
