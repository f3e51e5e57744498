"""Zigzag <-> contiguous by moving activations: the move of the table entries that have one (``modes.py``),
applied by the dispatcher around the state-passing strategy (``move_in`` / ``move_out``).

Of 2*cp equal chunks, zigzag gives rank r chunks (r, 2*cp-1-r), contiguous (2r, 2r+1). A conversion moves
every chunk once from its owner in one layout to its owner in the other (local ones are copied):

- "p2p": one batch of isend/irecv, one message per peer (its chunks packed together);
- "a2a": one all_to_all_single with uneven splits (0, 1 or 2 chunks per peer, 0 for itself).

Both use one flat contiguous send and one receive buffer, split with Python ints from the local shape alone,
and wait for the transfer before the buffers go out of scope (no strided views, freed temporaries or
disagreeing splits reach a collective). The backward is the inverse conversion of the gradient; both exact.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import layout, modes

METHODS = ("p2p", "a2a")


def _held(kind: str, rank: int, cp: int) -> list[int]:
    """Global chunks (of 2*cp) that ``rank`` holds, in local order."""
    if kind == "zigzag":
        return layout.segment_ids(rank, cp, "zigzag")
    return [2 * rank, 2 * rank + 1]


def _owner(kind: str, chunk: int, cp: int) -> int:
    if kind == "zigzag":
        return chunk if chunk < cp else 2 * cp - 1 - chunk
    return chunk // 2


@dataclass(frozen=True)
class _Plan:
    """What one rank sends and receives for one conversion; chunks are named by local position. sends / recvs:
    (peer, local position in the source / target layout), ordered by peer then global chunk; keep: (source
    position, target position) of the chunks that stay on this rank."""

    sends: tuple
    recvs: tuple
    keep: tuple

    def counts(self, pairs, cp: int) -> list[int]:
        return [sum(1 for peer, _ in pairs if peer == j) for j in range(cp)]


@functools.cache
def _plan(src: str, dst: str, rank: int, cp: int) -> _Plan:
    held_src, held_dst = _held(src, rank, cp), _held(dst, rank, cp)
    sends = sorted((_owner(dst, c, cp), c, p) for p, c in enumerate(held_src) if _owner(dst, c, cp) != rank)
    recvs = sorted((_owner(src, c, cp), c, q) for q, c in enumerate(held_dst) if _owner(src, c, cp) != rank)
    keep = tuple((held_src.index(c), held_dst.index(c)) for c in held_dst if c in held_src)
    return _Plan(tuple((j, p) for j, _, p in sends), tuple((j, q) for j, _, q in recvs), keep)


def _permute(x: torch.Tensor, group, rank: int, cp: int, src: str, dst: str, method: str, dim: int) -> torch.Tensor:
    """Moves the two chunks of ``x`` along ``dim`` from layout ``src`` to layout ``dst``."""
    plan = _plan(src, dst, rank, cp)
    m = x.shape[dim] // 2
    xv = x.unflatten(dim, (2, m))  # [.., 2m, ..] -> [.., 2, m, ..]; chunk k is xv.select(dim, k)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ov = out.unflatten(dim, (2, m))
    chunk_shape = xv.select(dim, 0).shape
    numel = chunk_shape.numel()

    send = torch.empty(len(plan.sends) * numel, dtype=x.dtype, device=x.device)
    for slot, (_, p) in enumerate(plan.sends):
        send[slot * numel : (slot + 1) * numel].view(chunk_shape).copy_(xv.select(dim, p))
    recv = torch.empty(len(plan.recvs) * numel, dtype=x.dtype, device=x.device)

    send_counts, recv_counts = plan.counts(plan.sends, cp), plan.counts(plan.recvs, cp)
    if method == "a2a":
        works = [comm.all_to_all_uneven(
            recv, send, [c * numel for c in recv_counts], [c * numel for c in send_counts], group, async_op=True
        )]  # fmt: skip
    else:
        works = comm.batch_isend_irecv(_per_peer(send, send_counts, numel), _per_peer(recv, recv_counts, numel), group)
    for p, q in plan.keep:  # chunks that stay: copied while the transfer runs
        ov.select(dim, q).copy_(xv.select(dim, p))
    for work in works:
        work.wait()
    for slot, (_, q) in enumerate(plan.recvs):
        ov.select(dim, q).copy_(recv[slot * numel : (slot + 1) * numel].view(chunk_shape))
    return out


def _per_peer(buf: torch.Tensor, counts: list[int], numel: int) -> list:
    """[(contiguous slice of buf, peer)] for every peer with a non-zero count (buf is peer-ordered)."""
    pieces, start = [], 0
    for peer, count in enumerate(counts):
        if count:
            pieces.append((buf[start : start + count * numel], peer))
            start += count * numel
    return pieces


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, cp, src, dst, method, dim):
        ctx.args = (group, rank, cp, dst, src, method, dim)  # the inverse conversion
        return _permute(x, group, rank, cp, src, dst, method, dim)

    @staticmethod
    def backward(ctx, dout):
        # a permutation is linear: its backward is the inverse permutation, itself differentiable
        return (_PermuteFn.apply(dout, *ctx.args), None, None, None, None, None, None, None)


def _convert(x, group, method, dim, src, dst):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    rank, cp = comm.group_rank_size(group)
    if cp == 1:  # both layouts are the whole sequence in order
        return x
    dim = dim % x.dim() if x.dim() else dim
    if x.dim() == 0 or x.shape[dim] % 2 != 0:
        raise ValueError(
            f"converting between the zigzag and contiguous layouts needs an even local length along dim {dim} "
            f"(two chunks per rank), got shape {tuple(x.shape)}"
        )
    if not (x.dtype.is_floating_point or x.dtype.is_complex):  # labels (seq_idx): nothing to differentiate
        return _permute(x, group, rank, cp, src, dst, method, dim)
    return _PermuteFn.apply(x, group, rank, cp, src, dst, method, dim)


def zigzag_to_contiguous(x: torch.Tensor, group=None, method: str = "p2p", dim: int = 1) -> torch.Tensor:
    """This rank's contiguous shard from its zigzag shard (autograd: backward is the inverse).

    x: any tensor whose dim ``dim`` is the local sequence (chunks r and 2*cp-1-r of 2*cp). Returns the same shape
    holding chunks 2r and 2r+1. Every rank of ``group`` (None: the world) calls it with the same shape. method:
    "p2p" (one batch of point-to-point messages) or "a2a" (one all_to_all_single).
    """
    return _convert(x, group, method, dim, "zigzag", "contiguous")


def contiguous_to_zigzag(x: torch.Tensor, group=None, method: str = "p2p", dim: int = 1) -> torch.Tensor:
    """Inverse of ``zigzag_to_contiguous`` (same arguments); its backward is ``zigzag_to_contiguous``."""
    return _convert(x, group, method, dim, "contiguous", "zigzag")


def move_in(call, method: str):
    """The call with its input moved zigzag -> contiguous (cp > 1): hidden when it carries projections
    (d_model wide, narrower than zxbcdt), else zxbcdt; seq_idx with it. Its options then name the
    contiguous chain (load_balancing "none"), which the state-passing strategy runs."""
    group = call.group
    seq_idx = None if call.seq_idx is None else zigzag_to_contiguous(call.seq_idx, group, method)
    if call.projections is not None:
        p = call.projections
        moved = call.replace(projections=dataclasses.replace(p, hidden=zigzag_to_contiguous(p.hidden, group, method)),
                             seq_idx=seq_idx)  # fmt: skip
    else:
        moved = call.replace(zxbcdt=zigzag_to_contiguous(call.zxbcdt, group, method), seq_idx=seq_idx)
    return moved.with_options(load_balancing=modes.NONE, input_layout=modes.CONTIGUOUS)


def move_out(out: torch.Tensor, group, method: str) -> torch.Tensor:
    """This rank's output back to its zigzag shard (final_states is global: it needs no move)."""
    return contiguous_to_zigzag(out, group, method)
