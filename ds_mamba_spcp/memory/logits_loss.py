"""The causal-LM loss from the last hidden states and the head's weight, one tile of logits at a time.

    tiled_causal_lm_loss(hidden, weight, labels) = transformers' ForCausalLMLoss(hidden @ weight.T, labels)

    forward   no graph; for each tile [s, e) of the batch * seqlen tokens (flattened, so a tile may span rows):
                  logits = hidden[s:e] @ weight.T -> upcast (to fp32, or fp64 for fp64 logits) -> logsumexp
                  minus the label's logit, summed over the tile's scored tokens into one running sum
              keeps hidden, weight and the shifted labels; nothing of size vocab
    backward  for each tile again, under the forward's autocast settings (``memory/recompute.py``): the logits,
              softmax - one_hot(label), times the incoming gradient on scored tokens (zero on ignored ones)
              -> d_hidden[s:e] = d_logits @ weight, d_weight += d_logits.T @ hidden[s:e] (summed in fp32 over
              the tiles, cast to the weight's dtype once)

The reduction is transformers': the sum over scored tokens divided by ``num_items_in_batch`` when given, else by
the global count of scored tokens (not a mean of tile means); no scored token at all gives 0/0 = nan, as
transformers does, with zero gradients. The division is outside the autograd Function, so any scale applied to
the loss afterwards (gradient accumulation, a loss scale) reaches both gradients through the incoming gradient
(DeepSpeed's ``TiledFusedLogitsLoss`` runs the backward inside its forward and scales the hidden states'
gradient only). Peak transient memory: one tile's logits in their dtype plus their upcast copy (6 bytes per
token and vocabulary entry under bf16 autocast: 25 GB for 32768 tokens of a 128k vocabulary).

Differences from transformers, all in rounding only: the sums are reordered (per tile), and fp64 logits stay
fp64 (transformers' ``logits.float()`` rounds them to fp32); the loss has the upcast dtype (fp32, or fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_mamba_spcp.memory.recompute import autocast_state
from ds_mamba_spcp.memory.tiled_block import tile_spans

__all__ = ["tiled_causal_lm_loss"]


def _spans(ntokens: int, tile_tokens: int) -> tuple:
    return tile_spans(ntokens, tile_tokens, "long_context.loss_tile_tokens") or ((0, 0),)  # no token: one empty tile


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _exp_shifted_(z: torch.Tensor) -> tuple:
    """In place, z <- exp(z - max_row(z)) (no second tile-sized buffer, unlike ``torch.logsumexp``); returns
    (max_row, sum_row), each (T, 1): logsumexp = max_row + log(sum_row), softmax = z / sum_row."""
    top = z.amax(dim=-1, keepdim=True)
    z.sub_(top).exp_()
    return top, z.sum(dim=-1, keepdim=True)


class _TiledLogitsLoss(torch.autograd.Function):
    """(hidden (N, d), weight (V, d), labels (N,)) -> the sum over scored tokens of -log softmax(logits)[label],
    a 0-dim tensor of the upcast dtype; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, tile_tokens):
        spans = _spans(hidden.shape[0], tile_tokens)
        total = None
        for s, e in spans:
            z = _upcast(F.linear(hidden[s:e], weight))
            valid = labels[s:e] != ignore_index
            target = torch.where(valid, labels[s:e], 0)
            picked = z.gather(1, target[:, None])
            top, total_exp = _exp_shifted_(z)
            token = (top + total_exp.log() - picked).squeeze(1)
            part = torch.where(valid, token, 0).sum()
            total = part if total is None else total + part
            del z
        ctx.autocast = autocast_state(hidden.device)  # re-entered around each tile's recompute
        ctx.ignore_index, ctx.spans = ignore_index, spans
        ctx.save_for_backward(hidden, weight, labels)
        return total

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "ds_mamba_spcp: the tiled logits loss has no second-order gradient (backward with "
                'create_graph=True); turn it off with "long_context": {"fused_loss": false}.'
            )
        hidden, weight, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        fp32 = torch.promote_types(weight.dtype, torch.float32)
        dw = torch.zeros(weight.shape, dtype=fp32, device=weight.device) if need_w else None
        with torch.no_grad(), ctx.autocast.context():
            for s, e in ctx.spans:
                h = hidden[s:e]
                logits = F.linear(h, weight)
                dtype, z = logits.dtype, _upcast(logits)
                del logits
                valid = labels[s:e] != ctx.ignore_index
                target = torch.where(valid, labels[s:e], 0)
                # softmax in place, minus the one-hot label, times the incoming gradient on scored tokens only
                z.div_(_exp_shifted_(z)[1])
                z.scatter_add_(1, target[:, None], torch.full_like(target[:, None], -1, dtype=z.dtype))
                z.mul_(torch.where(valid, grad.to(z.dtype), 0)[:, None])
                # as autograd would: the gradient reaches the matmul in the logits' dtype (bf16 under autocast)
                dlogits = z.to(dtype)
                del z
                if need_h:
                    dh[s:e] = dlogits @ weight
                if need_w:
                    dw += dlogits.t() @ h
                del dlogits
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None


def tiled_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    tile_tokens: int = 32768,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``logits = hidden @ weight.T``, without ever holding more than one
    tile of ``tile_tokens`` tokens' logits (module docstring).

    hidden (batch, seqlen, d); weight (vocab, d); ``labels`` (batch, seqlen), shifted here (token t is scored
    against labels[t + 1], the last token of each row against nothing), or ``shift_labels`` (batch, seqlen)
    already shifted (it wins when both are given, as in transformers). Returns a 0-dim tensor: the sum over
    tokens whose label is not ``ignore_index``, divided by ``num_items_in_batch`` when given (a tensor or an
    int), else by their count."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("tiled_causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"tiled_causal_lm_loss: hidden (..., d) and weight (vocab, d), got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if tuple(shift_labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"tiled_causal_lm_loss: labels {tuple(shift_labels.shape)} do not match the hidden states' tokens "
            f"{tuple(hidden.shape[:-1])}"
        )
    flat = shift_labels.reshape(-1).to(hidden.device)
    total = _TiledLogitsLoss.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat, ignore_index, tile_tokens)
    if num_items_in_batch is None:
        return total / (flat != ignore_index).sum().to(total.dtype)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
