"""User helpers for sequence-parallel training: shard a batch, gather it back, combine the loss.

A script with the full batch on every rank of the group calls ``shard_batch`` and gets what DeepSpeed's
``UlyssesSPDataLoaderAdapter`` hands that rank for the contiguous layout: labels shifted *before* sharding,
global ``position_ids``, every tensor cut along the sequence dim (zigzag: ``2*cp`` chunks, rank r gets chunks
r and ``2*cp-1-r``). Each rank back-propagates its share of the global mean loss, times
``grad_scale_for_engine``: DeepSpeed 0.19 sums the gradients of a sequence-parallel group at ZeRO 0-2 and
averages them at ZeRO-3 (``reduce_scatter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine.layout import LAYOUTS, shard_sequence, unshard_sequence

IGNORE_INDEX = -100
"""Label value that contributes no loss (the value ``torch.nn.functional.cross_entropy`` skips)."""


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets ``(batch, seqlen)``: ``labels[:, 1:]`` followed by ``ignore_index`` (on the full
    sequence, so that the last position of every shard but the last keeps its true target)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def seq_idx_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document labels of packed rows from positions that restart at 0 at each document. position_ids: (batch,
    seqlen), 0, 1, ..., n0-1, 0, 1, ... (``DataCollatorWithFlattening``). Returns int32 (batch, seqlen) labels
    0, 0, ..., 1, 1, ...: +1 at every restart after the first token."""
    restarts = (position_ids[..., 1:] == 0).to(torch.int32)
    return torch.cat([torch.zeros_like(restarts[..., :1]), restarts.cumsum(dim=-1, dtype=torch.int32)], dim=-1)


def _packed(position_ids: torch.Tensor) -> bool:
    """Whether positions restart inside a row (several documents packed in it)."""
    return bool((position_ids[..., 1:] == 0).any())


def _rank_size(group, rank, world_size) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither (they are then read from the group)")
    if rank is None:
        return comm.group_rank_size(group)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size} ranks")
    return rank, world_size


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_batch(
    batch: Mapping[str, Any] | torch.Tensor,
    group=None,
    *,
    layout: str = "contiguous",
    rank: int | None = None,
    world_size: int | None = None,
    dim: int = 1,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Any] | torch.Tensor:
    """This rank's shard of a full batch, cut along the sequence dim ``dim``.

    ``batch`` is a tensor ``(batch, seqlen, ...)`` or a mapping such as
    ``{"input_ids": (batch, seqlen), "labels": (batch, seqlen), ...}``. For a mapping:

    - ``labels`` is replaced by ``shift_labels`` (shifted before sharding);
    - ``position_ids`` (global positions ``0..seqlen-1``) is added when it is missing;
    - packed rows (``position_ids`` restarting at 0 inside a row) without ``seq_idx`` get ``seq_idx``
      (``seq_idx_from_position_ids``); a ``seq_idx`` given is sharded like the tokens;
    - every tensor is sharded along ``dim`` (all must have the sequence length there); other values pass.

    With ``layout="contiguous"`` this is exactly the micro-batch DeepSpeed's ``UlyssesSPDataLoaderAdapter``
    gives rank ``rank``. The rank and group size come from ``group`` (a deepspeed.comm group; ``None`` is the
    world, or a group of one without a distributed backend) unless ``rank`` and ``world_size`` are given.
    """
    _check_layout(layout)
    rank, cp = _rank_size(group, rank, world_size)
    if torch.is_tensor(batch):
        return shard_sequence(batch, rank, cp, layout, dim)
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a tensor or a mapping of tensors, got {type(batch).__name__}")
    tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    if not tensors:
        raise ValueError("the batch holds no tensor to shard")
    ref_key = "input_ids" if "input_ids" in tensors else next(iter(tensors))
    ref = tensors[ref_key]
    if ref.dim() <= dim:
        raise ValueError(f"{ref_key!r} has shape {tuple(ref.shape)}: it has no sequence dim {dim}")
    seqlen = ref.shape[dim]
    out = dict(batch)
    if "labels" in out:
        if "shift_labels" in out:
            raise ValueError("the batch has both 'labels' and 'shift_labels'; pass one of them")
        out["shift_labels"] = shift_labels(out.pop("labels"), ignore_index)
    if "position_ids" not in out and dim == 1:
        out["position_ids"] = torch.arange(seqlen, device=ref.device).expand(ref.shape[0], seqlen)
    elif "seq_idx" not in out and dim == 1 and torch.is_tensor(out["position_ids"]) and _packed(out["position_ids"]):
        out["seq_idx"] = seq_idx_from_position_ids(out["position_ids"])
    for key, value in out.items():
        if not torch.is_tensor(value):
            continue
        if value.dim() <= dim or value.shape[dim] != seqlen:
            raise ValueError(
                f"{key!r} has shape {tuple(value.shape)} but {ref_key!r} has {seqlen} tokens along dim {dim}; "
                f"every tensor of the batch must have the sequence length there (pass other tensors separately)"
            )
        out[key] = shard_sequence(value, rank, cp, layout, dim)
    return out


@torch.no_grad()
def gather_sequence(x: torch.Tensor, group=None, *, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (the inverse of ``shard_batch`` on a tensor; every rank
    passes the same shape). Not differentiable: for logging, evaluation and checks."""
    _check_layout(layout)
    _, cp = comm.group_rank_size(group)
    if cp == 1:
        return x
    rows = comm.all_gather(x, group, cp, async_op=False).wait()  # (cp, *x.shape)
    return unshard_sequence(list(rows.unbind(0)), layout, dim)


def gather_batch(batch: Mapping[str, Any], group=None, *, layout: str = "contiguous", dim: int = 1) -> dict:
    """``gather_sequence`` on every tensor of a sharded batch; other values pass through."""
    return {k: gather_sequence(v, group, layout=layout, dim=dim) if torch.is_tensor(v) else v for k, v in batch.items()}


def grad_scale_for_engine(engine) -> float:
    """Factor on each rank's loss share that makes DeepSpeed's reduced gradient the single-rank one: 1.0 at
    ZeRO 0-2 (summed over the sequence-parallel group), ``cp`` at ZeRO-3 with ``reduce_scatter`` (averaged).
    ``engine``: a DeepSpeed engine, built with ``mpu=parallel_state_sp``. Raises for settings that break
    sequence parallelism (``check_engine_settings``)."""
    cp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    check_engine_settings(engine)
    stage = int(engine.zero_optimization_stage())
    reduce_scatter = bool(engine.zero_reduce_scatter()) if stage == 3 else True
    return grad_scale(stage, cp, reduce_scatter=reduce_scatter)


def selects_bf16_optimizer(ds_config) -> bool:
    """Whether DeepSpeed 0.19.8 wraps the optimizer of ``ds_config`` in its ``BF16_Optimizer``: ZeRO stage 1, bf16,
    ``"grad_accum_dtype": "fp32"``, no CPU optimizer offload (``config.DeepSpeedSettings.selects_bf16_optimizer``).
    ``ds_config``: a ds_config dict, or the settings parsed from one (``load_mamba_sp_config``)."""
    from ds_mamba_spcp.config import DeepSpeedSettings, MambaSequenceParallelConfig

    if isinstance(ds_config, MambaSequenceParallelConfig):
        return ds_config.deepspeed.selects_bf16_optimizer
    return DeepSpeedSettings.from_ds_config(ds_config).selects_bf16_optimizer


def bf16_optimizer_error() -> ValueError:
    """The error for DeepSpeed's BF16_Optimizer under sequence parallelism (see ``check_engine_settings``)."""
    return ValueError(
        'ZeRO stage 1 with "bf16": {"enabled": true} and "data_types": {"grad_accum_dtype": "fp32"} makes DeepSpeed '
        "0.19.8 use its BF16_Optimizer, whose gradient norm counts parameters only on model-parallel rank 0; "
        "DeepSpeed's sequence-parallel mpu (parallel_state_sp) aliases model parallelism to sequence parallelism, so "
        'sequence-parallel ranks >= 1 count no parameter and fail in get_global_norm_of_tensors ("stack expects a '
        'non-empty TensorList") while rank 0 waits in the all-reduce (a hang on NCCL). Set '
        '"zero_optimization.stage" to 2 (it keeps the fp32 gradient accumulation, and its norm is right), or drop '
        '"data_types.grad_accum_dtype" (ZeRO 1 then accumulates in bf16 through its ZeRO optimizer).'
    )


def check_engine_settings(engine) -> None:
    """Raises ValueError, before the first step and on every rank alike (one ds_config), for DeepSpeed settings
    that break sequence parallelism: ``BF16_Optimizer`` (``selects_bf16_optimizer``) with a sequence-parallel
    mpu. ``prepare_sequence_parallel`` checks the ds_config before ``deepspeed.initialize``."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    cp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
    if cp > 1 and getattr(engine, "mpu", None) is not None and isinstance(engine.optimizer, BF16_Optimizer):
        raise bf16_optimizer_error()


def grad_scale(zero_stage: int, cp: int, *, reduce_scatter: bool = True) -> float:
    """The factor of ``grad_scale_for_engine`` from the ZeRO stage and the sequence-parallel size."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if cp == 1 or zero_stage < 3:
        return 1.0
    if not reduce_scatter:
        # Stage 3 without reduce_scatter sums the gradients of buckets that fit reduce_bucket_size
        # (__avg_scatter_contiguous_grads) and averages the others: no single factor is right.
        raise ValueError(
            'ZeRO stage 3 with "reduce_scatter": false sums some gradient buckets over the sequence-parallel '
            'ranks and averages others; set "zero_optimization.reduce_scatter" to true (the default).'
        )
    return float(cp)


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    group=None,
    *,
    grad_scale: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of a sequence shard, combined over the sequence-parallel ``group``.

    logits: (batch, local_seqlen, vocab); shift_labels: (batch, local_seqlen), from ``shard_batch``.
    Returns ``(loss, mean_loss)``: ``loss``, this rank's share to back-propagate, ``grad_scale * (sum of this
    rank's token losses) / (scored tokens of the whole group)``; ``mean_loss``, the detached global mean (the
    same on every rank), the value to log.
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} disagree: expected "
            "logits (batch, local_seqlen, vocab) and labels (batch, local_seqlen)"
        )
    # bf16/fp16 logits are scored in fp32; fp32 and fp64 keep their precision
    logits = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    token_sum = F.cross_entropy(logits, shift_labels.flatten(), ignore_index=ignore_index, reduction="sum")
    return _share_of_the_mean(token_sum, shift_labels, group, grad_scale, ignore_index)


def sequence_parallel_tiled_cross_entropy(
    hidden: torch.Tensor,
    logits_fn,
    shift_labels: torch.Tensor,
    group=None,
    *,
    grad_scale: float = 1.0,
    tile_tokens: int = 8192,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_parallel_cross_entropy`` without ever holding the logits of the whole shard.

    hidden: (batch, local_seqlen, d_model), what ``logits_fn`` maps to logits (the final norm and the LM
    head, per token). Tokens are scored ``tile_tokens`` at a time, each tile's logits recomputed in backward
    (``torch.utils.checkpoint``), so at most one tile's logits exist at once. Returns as
    ``sequence_parallel_cross_entropy``, equal up to the order of the sum. (DeepSpeed's ``TiledFusedLogitsLoss``
    computes the gradients in its forward, blind to the loss scale and gradient accumulation.)
    """
    from torch.utils.checkpoint import checkpoint

    if hidden.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and shift_labels {tuple(shift_labels.shape)} disagree: expected "
            "hidden (batch, local_seqlen, d_model) and labels (batch, local_seqlen)"
        )
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")

    def tile_loss(h, y):
        logits = logits_fn(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")

    h, y = hidden.flatten(0, 1), shift_labels.flatten()
    token_sum = sum(
        checkpoint(tile_loss, h[s : s + tile_tokens], y[s : s + tile_tokens], use_reentrant=False)
        for s in range(0, h.shape[0], tile_tokens)
    )
    return _share_of_the_mean(token_sum, shift_labels, group, grad_scale, ignore_index)


def _share_of_the_mean(token_sum, shift_labels, group, grad_scale, ignore_index):
    """(this rank's share of the group's mean loss, times grad_scale; the detached global mean)."""
    counts = torch.stack([token_sum.detach(), (shift_labels != ignore_index).sum().to(token_sum.dtype)])
    _, cp = comm.group_rank_size(group)
    if cp > 1:
        import deepspeed.comm as dist

        dist.all_reduce(counts, group=group)
    total_sum, ntokens = counts.unbind(0)
    ntokens = ntokens.clamp_min(1)
    return token_sum * (grad_scale / ntokens), total_sum / ntokens
