"""The library-free pieces of a sharded prefill: one Mamba2 layer's decode state, gathered K/V, shared errors.

A Mamba2 layer's decode cache (mamba-ssm's ``allocate_inference_cache``, transformers' ``LinearAttentionLayer``):

    conv state  (batch, conv_dim, d_conv)          the prompt's last d_conv pre-conv xBC columns (zeros on the
                                                   left of a shorter prompt): gathered (``inference/forward.py``)
    SSM state   (batch, nheads, headdim, dstate)   the state after the prompt: the op's final state (fp32)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.config import MambaSequenceParallelConfig
from ds_mamba_spcp.engine import modes
from ds_mamba_spcp.engine.call import MixerCore
from ds_mamba_spcp.inference.forward import conv_tail, mixer_core_prefill  # noqa: F401 - conv_tail re-exported


class Prefill(NamedTuple):
    """What a sharded prefill returns on every rank."""

    logits: torch.Tensor  # (batch, vocab): the logits after the prompt's last token
    cache: Any  # the decode cache of the whole prompt (transformers: PrefilledCache; mamba-ssm: InferenceParams)


_ERRORS = (ValueError, NotImplementedError, TypeError, RuntimeError)
_MESSAGE_BYTES = 4096  # a fixed size, so the exchange itself can never be mismatched


def raise_alike(problem: Exception | None, group, device=None) -> None:
    """Every rank raises the same error, or none does: the lowest failing rank's problem (its type and
    message) is raised on every rank of ``group``. ``problem``: what this rank found (one of ``_ERRORS``) or
    None. ``device``: where the group's collectives run (CUDA under NCCL)."""
    rank, cp = comm.group_rank_size(group)
    if cp == 1:
        if problem is not None:
            raise problem
        return
    code = 0 if problem is None else 1 + next(i for i, t in enumerate(_ERRORS) if isinstance(problem, t))
    text = b"" if problem is None else str(problem).encode()[: _MESSAGE_BYTES - 8]
    buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    buf[:3] = torch.tensor([code, len(text) // 256, len(text) % 256], dtype=torch.uint8)
    if text:
        buf[8 : 8 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    rows = comm.all_gather(buf.to(device or "cpu"), group, cp, async_op=False).wait().cpu()
    for src, row in enumerate(rows):
        if int(row[0]):
            message = bytes(row[8 : 8 + int(row[1]) * 256 + int(row[2])].tolist()).decode(errors="replace")
            if problem is not None and (src == rank or str(problem) == message):
                raise problem  # this rank's own error is the one raised everywhere
            raise _ERRORS[int(row[0]) - 1](f"(raised on rank {src} of the sequence-parallel group) {message}")


def check(condition: bool, error: Exception) -> Exception | None:
    """``error`` when ``condition`` fails (for collecting a rank's problem before ``raise_alike``)."""
    return None if condition else error


def fingerprint(t: torch.Tensor) -> list[int]:
    """A few ints that tell two integer tensors apart (shape and two weighted sums), for cross-rank checks."""
    flat = t.detach().reshape(-1).to(torch.int64).cpu()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64)
    return [t.dim(), *t.shape, int((flat * weights).sum()), int((flat * (weights % 7919 + 1)).square().sum())]


def same_on_every_rank(values: list[int], group, device=None) -> bool:
    """Whether every rank of ``group`` passed the same list of ints (one small all-gather on ``device``)."""
    _, cp = comm.group_rank_size(group)
    if cp == 1:
        return True
    rows = comm.gather_ints(values, torch.device(device or "cpu"), group, cp)
    return all(r == rows[0] for r in rows)


def gather_sequence(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole sequence of a tensor sharded contiguously along ``dim`` (rank order), on every rank."""
    _, cp = comm.group_rank_size(group)
    if cp == 1:
        return t
    parts = comm.all_gather(t.movedim(dim, 0), group, cp, async_op=False).wait()  # (cp, l, ...)
    return parts.flatten(0, 1).movedim(0, dim)


def broadcast_from_last(t: torch.Tensor, group) -> torch.Tensor:
    """The last rank's ``t`` on every rank of ``group`` (the rank that holds the prompt's last token)."""
    rank, cp = comm.group_rank_size(group)
    if cp == 1:
        return t
    import deepspeed.comm as dist

    t = t.contiguous().clone()
    dist.broadcast(t, comm.global_rank(group, cp - 1), group=group)
    return t


def mixer_prefill(zxbcdt: torch.Tensor, core: MixerCore, group, config: MambaSequenceParallelConfig, seq_idx=None):
    """One Mamba2 layer on this rank's contiguous shard, for a prefill. zxbcdt: (batch, local_seqlen, d_in_proj).
    Returns (y, ssm_state, conv_state): this rank's shard of the pre-out_proj output (batch, local_seqlen,
    nheads*headdim), the state after the whole prompt (batch, nheads, headdim, dstate) in fp32 (fp64 for fp64
    input) and the conv state (batch, conv_dim, d_conv) in zxbcdt's dtype, both identical on every rank; with
    ``seq_idx``, one per document, (ndocs, ...)."""
    args, kwargs = core.op_arguments()
    return mixer_core_prefill(
        zxbcdt, *args, process_group=group, mode=modes.STATE_PASSING, load_balancing=modes.NONE,
        input_layout=modes.CONTIGUOUS, seq_idx=seq_idx,
        backend=config.backend, overlap_comm=config.overlap_comm, check_shapes=config.check_shapes,
        tile_length=config.tile_length, **kwargs,
    )  # fmt: skip
