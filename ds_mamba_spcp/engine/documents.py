"""The documents of packed rows: where each one ends, and per-document values gathered in document order.

A document is a maximal run of equal labels along a row of ``seq_idx`` (a row without labels is one
document). Documents are numbered row by row and, within a row, in causal order: document d of a result is
the d-th (row, run) pair, so a batch of B unpacked rows has B documents in row order. In a sharded row a
document may span segments and ranks; its last token lies in exactly one causal segment.

A segment knows the documents that end inside it, and that one may end at its own end (unless the next
segment of the row starts with the same label). ``candidates`` lists both kinds; ``gather`` sends every rank's
values for its candidates to every rank, keeps the real ends and sorts them in document order. It moves
per-document tensors (states, conv tails), never anything that grows with the sequence.
"""

from __future__ import annotations

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import layout
from ds_mamba_spcp.ops.segment import Candidate, candidates, starts  # noqa: F401 - this module's callers use them


def gather(values: list[torch.Tensor], found: list[Candidate], firsts: torch.Tensor, group, cp: int,
           seg_layout: str) -> list[torch.Tensor]:  # fmt: skip
    """Every document's values on every rank, in document order. values: tensors (len(found), ...), one row per
    candidate of this rank; firsts: (batch*nlocal,) the first label of each packed segment row. Returns each
    tensor as (ndocs, ...). Two small all-gathers and their host reads; none for cp == 1."""
    device = firsts.device
    meta = torch.tensor([[c.batch, c.segment, c.end, c.label, int(c.at_segment_end)] for c in found],
                        dtype=torch.int64).reshape(-1, 5).to(device)  # fmt: skip
    first, nseg = {}, 1
    if cp > 1:
        nlocal = len(layout.segment_ids(0, cp, seg_layout))
        head = torch.cat([firsts.to(torch.int64), torch.tensor([len(found)], device=device)])
        rows = comm.all_gather(head, group, cp, async_op=False).wait()  # (cp, batch*nlocal + 1)
        counts = rows[:, -1].tolist()
        width = max(1, max(counts))

        def pad(t):
            return torch.cat([t, t.new_zeros(width - t.shape[0], *t.shape[1:])]) if t.shape[0] < width else t

        got = comm.all_gather_many([pad(meta), *[pad(v) for v in values]], group, cp, async_op=False).wait()
        meta = torch.cat([got[0][r, : counts[r]] for r in range(cp)])
        values = [torch.cat([g[r, : counts[r]] for r in range(cp)]) for g in got[1:]]
        # the first label of every (global segment, batch row): rank r's packed row i*nlocal + k is segment ids[k]
        for r, row in enumerate(rows[:, :-1].tolist()):
            ids = layout.segment_ids(r, cp, seg_layout)
            for q, label in enumerate(row):
                first[(ids[q % nlocal], q // nlocal)] = label
        nseg = layout.num_segments(cp, seg_layout)
    keep = []
    for n, (batch, segment, end, label, at_end) in enumerate(meta.tolist()):
        if at_end and segment + 1 < nseg and first[(segment + 1, batch)] == label:
            continue  # the document goes on in the next segment: its end lies there
        keep.append((batch, segment, end, n))
    index = torch.tensor([n for *_, n in sorted(keep)], dtype=torch.long, device=device)
    return [v.index_select(0, index) for v in values]
