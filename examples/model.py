"""A small language model of Mamba2 blocks, optionally hybrid with causal self-attention.

    embedding -> n_layers x (x + mixer(RMSNorm(x))) -> RMSNorm -> LM head

Every block's mixer is mamba-ssm's ``Mamba2`` (built by a mixer factory), except, in the hybrid
(the Nemotron-H / Jamba pattern), every ``attn_every``-th block, which is causal multi-head
self-attention written in plain PyTorch so that it runs on CPU.

The model is built the same way with or without sequence parallelism (same parameters, same
initialisation from one seed); ``parallelize`` then swaps the compute in place without touching
any parameter: ``ds_mamba_spcp.module.wrap_mamba2_mixers`` wraps the Mamba2 mixers, and each
attention core goes into DeepSpeed's ``DistributedAttention`` (its all-to-all gives every rank the
whole sequence for ``nheads/cp`` heads). The state_dict keys stay those of the plain model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ds_mamba_spcp.engine.layout import LAYOUTS, shard_sequence, unshard_sequence
from ds_mamba_spcp.ops.kernels.upstream import mamba2_class


def mamba2_factory(
    d_model: int, *, d_state: int, d_conv: int, expand: int, headdim: int, ngroups: int, chunk_size: int
) -> Callable[[int], nn.Module]:
    """``factory(layer_idx) -> Mamba2`` with these sizes (mamba-ssm's argument names)."""
    Mamba2 = mamba2_class()

    def make(layer_idx: int) -> nn.Module:
        return Mamba2(
            d_model=d_model, d_state=d_state, d_conv=d_conv, expand=expand, headdim=headdim, ngroups=ngroups,
            chunk_size=chunk_size, layer_idx=layer_idx,
        )  # fmt: skip

    return make


class LocalCausalAttention(nn.Module):
    """softmax(q kᵀ / sqrt(headdim)) v with a causal mask, on (batch, seqlen, nheads, headdim).

    ``zigzag_cp``: 0 when the sequence arrives in causal order. Under DistributedAttention with
    zigzag shards the all-to-all delivers the ranks' shards in rank order, i.e. chunks
    ``0, 2cp-1, 1, 2cp-2, ...``; with ``zigzag_cp = cp`` the chunks are put in causal order
    before the attention and back after it (a local permutation, nothing is exchanged).
    """

    def __init__(self, zigzag_cp: int = 0):
        super().__init__()
        self.zigzag_cp = zigzag_cp

    def forward(self, q, k, v, *args, doc_ids=None):
        """doc_ids: (batch, seqlen) document labels of the whole sequence in causal order (packed rows: a
        token attends to earlier tokens of its own document only), or None."""
        cp = self.zigzag_cp
        if cp > 1:
            q, k, v = (unshard_sequence(list(t.chunk(cp, dim=1)), "zigzag", dim=1) for t in (q, k, v))
        # (batch, seqlen, nheads, headdim) -> (batch, nheads, seqlen, headdim) for SDPA and back
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if doc_ids is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            seqlen = q.shape[2]
            causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=q.device).tril()
            same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [b, L, L]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=(causal & same)[:, None])
        out = out.transpose(1, 2)
        if cp > 1:
            out = torch.cat([shard_sequence(out, r, cp, "zigzag", dim=1) for r in range(cp)], dim=1)
        return out


class CausalSelfAttention(nn.Module):
    """(batch, seqlen, d_model) -> same. The core is a ``LocalCausalAttention`` or, after
    ``parallelize``, a ``DistributedAttention`` around one (no parameters in either)."""

    def __init__(self, d_model: int, nheads: int):
        super().__init__()
        if d_model % nheads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by the attention heads ({nheads})")
        self.nheads = nheads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.core = LocalCausalAttention()

    def forward(self, x, doc_ids=None):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.nheads, d // self.nheads).unbind(2)
        out = self.core(q, k, v, 0, doc_ids=doc_ids)  # batch_dim_idx=0: batch-first tensors
        return self.out_proj(out.reshape(b, l, d))


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(RMSNorm(x)).

    seq_idx: this rank's shard of the document labels (packed rows) for a Mamba2 mixer; doc_ids: the
    whole sequence's labels for an attention mixer (it sees every token after its all-to-all)."""

    def __init__(self, d_model: int, mixer: nn.Module, norm_eps: float = 1e-5):
        super().__init__()
        self.norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.mixer = mixer

    def tile_tokens(self) -> int | None:
        """The Mamba2 mixer's ``"block_tile_tokens"`` (its ds_config section), or None: attention, or no tiles."""
        if isinstance(self.mixer, CausalSelfAttention):
            return None
        return getattr(getattr(self.mixer, "config", None), "block_tile_tokens", None)

    def tiled(self, x, seq_idx=None):
        """``forward`` in sequence tiles of ``tile_tokens()``, as its own activation checkpoint (in place of
        the checkpoint function, not inside it): ``ds_mamba_spcp.memory.tiled_block``."""
        from ds_mamba_spcp.memory import tiled_block

        return tiled_block(x, self.norm, self.mixer, self.tile_tokens(), seq_idx=seq_idx)

    def forward(self, x, seq_idx=None, doc_ids=None):
        if isinstance(self.mixer, CausalSelfAttention):
            return x + self.mixer(self.norm(x), doc_ids=doc_ids)
        if seq_idx is None:
            return x + self.mixer(self.norm(x))
        return x + self.mixer(self.norm(x), seq_idx=seq_idx)


class MambaLM(nn.Module):
    """Token ids (batch, seqlen) -> logits (batch, seqlen, vocab_size).

    ``mixer_factory(layer_idx)`` builds the Mamba2 mixers. With ``attn_every = k > 0`` the blocks
    ``k-1, 2k-1, ...`` are causal self-attention with ``attn_heads`` heads instead. The input is a
    full sequence or, after ``parallelize``, this rank's shard of it (the layout of the data).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        mixer_factory: Callable[[int], nn.Module],
        *,
        attn_every: int = 0,
        attn_heads: int = 4,
        tie_embeddings: bool = False,
    ):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)
        blocks = []
        for i in range(n_layers):
            if attn_every > 0 and i % attn_every == attn_every - 1:
                blocks.append(Block(d_model, CausalSelfAttention(d_model, attn_heads)))
            else:
                blocks.append(Block(d_model, mixer_factory(i)))
        self.layers = nn.ModuleList(blocks)
        self.norm_f = nn.RMSNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.embedding.weight
        # set by parallelize: the group and layout the sequence is sharded in (to gather the document labels
        # that attention needs whole); set by the training script: a block checkpointing function or None
        self.sequence_group, self.layout = None, "contiguous"
        self.checkpoint = None

    def forward(self, input_ids, seq_idx=None, return_hidden=False):
        """input_ids (batch, seqlen): this rank's tokens; seq_idx (batch, seqlen): their document labels
        (packed rows) or None. Returns logits, or with ``return_hidden`` the hidden states before the final
        norm (for a loss that computes the logits tile by tile: ``logits``)."""
        doc_ids = None
        if seq_idx is not None and any(isinstance(b.mixer, CausalSelfAttention) for b in self.layers):
            doc_ids = seq_idx
            if self.sequence_group is not None:
                from ds_mamba_spcp.data import gather_sequence

                doc_ids = gather_sequence(seq_idx, self.sequence_group, layout=self.layout)
        x = self.embedding(input_ids)
        for block in self.layers:
            if self.checkpoint is not None and torch.is_grad_enabled():
                x = self.checkpoint(block, x, seq_idx, doc_ids)
            else:
                x = block(x, seq_idx, doc_ids)
        return x if return_hidden else self.logits(x)

    def logits(self, hidden):
        """The final norm and the LM head on hidden states (batch, n, d_model) -> (batch, n, vocab_size)."""
        return self.lm_head(self.norm_f(hidden))


def wrap_attention(model: nn.Module, sequence_process_group, layout: str = "contiguous") -> int:
    """Puts every attention core of ``model`` into DeepSpeed's ``DistributedAttention`` over
    ``sequence_process_group``; returns how many were wrapped. ``layout`` is the data's layout."""
    import deepspeed.comm as dist
    from deepspeed.sequence.layer import DistributedAttention

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cp = dist.get_world_size(group=sequence_process_group)
    count = 0
    for module in model.modules():
        if not isinstance(module, CausalSelfAttention):
            continue
        if module.nheads % cp != 0:
            raise ValueError(
                f"DistributedAttention shards the {module.nheads} attention heads over {cp} ranks: use a head "
                f"count divisible by the sequence-parallel size (--attn-heads)"
            )
        local = LocalCausalAttention(zigzag_cp=cp if layout == "zigzag" else 0)
        # Batch-first (batch, seqlen, heads, headdim): scatter the heads (dim 2), gather the sequence (dim 1).
        module.core = DistributedAttention(local, sequence_process_group, scatter_idx=2, gather_idx=1)
        count += 1
    return count


def parallelize(model: nn.Module, sequence_process_group, config) -> tuple[int, int]:
    """Wraps the Mamba2 mixers (``ds_mamba_spcp.module.wrap_mamba2_mixers``) and the attention cores
    for ``sequence_process_group``; ``config`` is the ds_config, or its settings parsed (``load_mamba_sp_config``).
    Returns the counts."""
    from ds_mamba_spcp.config import load_mamba_sp_config
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    sp_config = load_mamba_sp_config(config)
    n_mamba = wrap_mamba2_mixers(model, sequence_process_group, sp_config)
    if isinstance(model, MambaLM):
        model.sequence_group, model.layout = sequence_process_group, sp_config.input_layout
    n_attn = 0
    if any(isinstance(m, CausalSelfAttention) for m in model.modules()):
        n_attn = wrap_attention(model, sequence_process_group, sp_config.input_layout)
    return n_mamba, n_attn
