"""Sequence layouts over a sequence-parallel group and the segments each rank owns.

- contiguous: rank r holds tokens [r*L/cp, (r+1)*L/cp): one causal segment, global index r.
- zigzag: the sequence is cut into 2*cp equal chunks and rank r holds chunk r followed by chunk
  2*cp-1-r. Under ``virtual`` the two chunks are two causal segments (global indices r and
  2*cp-1-r) packed on the batch axis, so no activation moves.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def segment_ids(rank: int, cp: int, layout: str) -> list[int]:
    """Global causal indices of the segments rank ``rank`` holds, in local order."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * cp - 1 - rank]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_segments(cp: int, layout: str) -> int:
    return cp if layout == "contiguous" else 2 * cp


def gathered_order(cp: int, layout: str) -> list[int]:
    """Row of an all-gather's flattened (rank, local segment) rows for each global segment."""
    nlocal = len(segment_ids(0, cp, layout))
    order = [0] * num_segments(cp, layout)
    for rank in range(cp):
        for k, s in enumerate(segment_ids(rank, cp, layout)):
            order[s] = rank * nlocal + k
    return order


def take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] along dim 0 from Python indices: views stacked, no index tensor copied from the
    host, so it stays legal inside CUDA-graph capture."""
    if rows == list(range(t.shape[0])):
        return t
    return torch.stack([t[i] for i in rows])


def pack_segments(x: torch.Tensor, nseg: int) -> torch.Tensor:
    """(batch, nseg*m, ...) -> (batch*nseg, m, ...): row i*nseg + k is batch element i's local
    segment k. A view of contiguous input (no activation is copied)."""
    if nseg == 1:
        return x
    b, l = x.shape[:2]
    return x.reshape(b * nseg, l // nseg, *x.shape[2:])


def unpack_segments(x: torch.Tensor, nseg: int) -> torch.Tensor:
    """Inverse of ``pack_segments``."""
    if nseg == 1:
        return x
    nb, m = x.shape[:2]
    return x.reshape(nb // nseg, nseg * m, *x.shape[2:])


def rows_to_segments(t: torch.Tensor, nseg: int) -> torch.Tensor:
    """Packed rows (batch*nseg, ...) -> (nseg, batch, ...), a view: [k, i] is row i*nseg + k."""
    return t.unflatten(0, (-1, nseg)).transpose(0, 1)


def segments_to_rows(t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rows_to_segments``: (nseg, batch, ...) -> (batch*nseg, ...)."""
    return t.transpose(0, 1).flatten(0, 1)


def shard_sequence(x: torch.Tensor, rank: int, cp: int, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full sequence along ``dim`` (the length must split evenly)."""
    n = num_segments(cp, layout)
    if x.shape[dim] % n != 0:
        raise ValueError(
            f"a sequence of length {x.shape[dim]} cannot be split over {cp} ranks in the {layout} layout: "
            f"the length must be a multiple of {n}"
        )
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[s] for s in segment_ids(rank, cp, layout)], dim=dim)


def unshard_sequence(shards, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """Full sequence from the list of every rank's shard (inverse of ``shard_sequence``)."""
    cp = len(shards)
    nlocal = len(segment_ids(0, cp, layout))
    pieces = [None] * num_segments(cp, layout)
    for rank, shard in enumerate(shards):
        for k, s in enumerate(segment_ids(rank, cp, layout)):
            pieces[s] = shard.chunk(nlocal, dim=dim)[k]
    return torch.cat(pieces, dim=dim)
