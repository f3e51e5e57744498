"""A causal segment run as consecutive tiles on one device, with the state and the conv halo carried.

A segment longer than ``max_tokens_per_call`` (int32 offsets), or any with ``tile_length``, runs here as
tiles: row groups x consecutive stretches, each a segment for the backend, chained with the ranks' algebra
(docs/design.md, "The algebra"):

    forward   every tile's summary (S_ext_k, log_a_k) from a zero state (the backend's first phase)
              -> the segment's summary, folded: S_ext = sum_k (prod_{j>k} a_j) S_ext_k, log_a = sum_k log_a_k
              yield it; S_in arrives -> S_in_k = a_{k-1} S_in_{k-1} + S_ext_{k-1} -> every tile finishes
    backward  every tile's L_k (the gradient reaching its S_in) -> L = sum_k (prod_{j<k} a_j) L_k, yield;
              dS_out arrives -> dS_out_k = L_{k+1} + a_{k+1} dS_out_{k+1} from the last tile back; the
              halo gradient of tile k > 0 lands on tile k-1's last rows; tile 0's goes to the caller

The generators have the protocol of ``ops/segment.py``. Packed rows: a tile that begins a document gets
log_a = -inf, S_in = 0 and no L, and its halo rows of another document are zeroed. Memory: with ranks, the
tiles' intermediates live from their first phase to their finish (the length cap goes, not the peak); the
tiles' fp32 incoming states are kept for the backward. Known mode (S_in there before the start): each tile
runs whole from the previous one's S_out (backward: from the next one's dS_in), one tile alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_mamba_spcp.ops.segment import (
    Ready,
    canonical_seq_idx,
    finish,
    run_bwd_known,
    run_fwd_known,
    state_dtype,
    zero_state,
)
from ds_mamba_spcp.ops.spec import CoreSpec, split_zxbcdt


@dataclass(frozen=True)
class Tiles:
    """Row groups x stretches of one segment: ``rows`` [(r0, r1)], ``spans`` [(s, e)] along the sequence."""

    rows: tuple
    spans: tuple


def plan(nrows: int, seqlen: int, spec: CoreSpec, limit: int | None, tile_length: int | None) -> Tiles | None:
    """The tiles of a (nrows, seqlen) segment, or None when one call takes it whole.

    limit: the backend's most tokens per call (None: unbounded); tile_length: a configured length
    (None: tile only past the limit). Stretches are multiples of the chunk size where they can be.
    """
    span = tile_length
    if span is None and (limit is None or nrows * seqlen <= limit):
        return None
    if span is None:
        span = seqlen if seqlen <= limit else max(spec.chunk_size, limit // spec.chunk_size * spec.chunk_size)
    span = min(span, seqlen)
    per_call = nrows if limit is None else max(1, limit // span)
    rows = tuple((r, min(r + per_call, nrows)) for r in range(0, nrows, per_call))
    spans = tuple((s, min(s + span, seqlen)) for s in range(0, seqlen, span))
    if len(rows) == 1 and len(spans) == 1:
        return None
    return Tiles(rows, spans)


class _Rows:
    """The rows [r0, r1) of a halo handle's value."""

    def __init__(self, halo, r0, r1):
        self.halo, self.r0, self.r1 = halo, r0, r1

    def wait(self):
        value = self.halo.wait() if hasattr(self.halo, "wait") else self.halo
        return None if value is None else value[self.r0 : self.r1]


def _decay(log_a):
    return torch.exp(log_a)[:, :, None, None]


class _Chain:
    """One row group's tiles: their labels, halos and the masks of tiles that begin a document."""

    def __init__(self, zxbcdt, halo, seq_idx, spec: CoreSpec, r0, r1, spans):
        self.spec, self.r0, self.r1, self.spans = spec, r0, r1, spans
        self.zx = zxbcdt[r0:r1]
        labels = None if seq_idx is None else seq_idx[r0:r1]
        self.labels = [None if labels is None else canonical_seq_idx(labels[:, s:e]) for s, e in spans]
        self.start0 = [None] * len(spans)  # [rows] bool: the tile begins a document (tile 0: the caller's business)
        self.halos = [_Rows(halo, r0, r1)]
        self.masks = [None]
        _, xBC, _ = split_zxbcdt(self.zx, spec)
        K = spec.d_conv
        for s, _ in spans[1:]:
            tail = xBC[:, s - (K - 1) : s] if K > 1 else None
            mask = None
            if K > 1 and s < K - 1:
                # only a document start comes this close to the segment's start (forward_groups: tile lengths are
                # >= d_conv-1): every halo row belongs to an earlier document, so the halo is zeros
                tail, mask = xBC.new_zeros(xBC.shape[0], K - 1, xBC.shape[2]), xBC.new_zeros(xBC.shape[0], K - 1).bool()
            if labels is not None:
                self.start0[len(self.halos)] = labels[:, s] != labels[:, s - 1]
                if tail is not None and mask is None:
                    mask = labels[:, s - (K - 1) : s] == labels[:, s : s + 1]
                    tail = tail * mask[..., None].to(tail.dtype)
            self.halos.append(tail)
            self.masks.append(mask)

    def keep(self, k, t):
        """Zeroes what reaches tile k when it begins a document."""
        start0 = self.start0[k]
        return t if start0 is None else t * (~start0).to(t.dtype)[:, None, None, None]

    def log_a(self, k, log_a):
        start0 = self.start0[k]
        return log_a if start0 is None else torch.where(start0[:, None], float("-inf"), log_a)


def _chains(zxbcdt, halo, seq_idx, spec, tiles: Tiles):
    return [_Chain(zxbcdt, halo, seq_idx, spec, r0, r1, tiles.spans) for r0, r1 in tiles.rows]


def _fold(chains, summaries, decay):
    """The segment's summary from its tiles' (S_ext_k, log_a_k), row group by row group:
    S_ext = sum_k (prod_{j>k} a_j) S_ext_k, log_a = sum_k log_a_k; decay(i) is exp(log_a) of tile i."""
    S_ext_rows, log_a_rows, i = [], [], 0
    for ch in chains:
        acc, total = None, None
        for _ in ch.spans:
            S_ext, log_a = summaries[i]
            acc = S_ext if acc is None else torch.addcmul(S_ext, decay(i), acc)
            total = log_a if total is None else total + log_a
            i += 1
        S_ext_rows.append(acc)
        log_a_rows.append(total)
    return _cat(S_ext_rows), _cat(log_a_rows)


def segment_fwd(backend, tiles: Tiles, saved: dict, zxbcdt, halo, params, *, spec, seq_idx=None, keep_y=False,
                S_in=None):  # fmt: skip
    """``backend.segment_fwd`` over ``tiles``. ``saved`` receives the tiles' incoming states and decays ("S_in",
    "decay": lists per row group) for segment_bwd; the kept y is a list, one entry per tile."""
    chains = _chains(zxbcdt, halo, seq_idx, spec, tiles)
    out = torch.empty(*zxbcdt.shape[:2], spec.d_inner, dtype=zxbcdt.dtype, device=zxbcdt.device)
    # a backend that can writes each tile's output into its view of out (no copy afterwards)
    into = getattr(backend, "WRITES_INTO", False)
    if S_in is not None:
        return _known_fwd(backend, chains, saved, out, into, params, spec, keep_y, S_in)
    gens, summaries = [], []
    for ch in chains:
        for k, (s, e) in enumerate(ch.spans):
            extra = dict(out=out[ch.r0 : ch.r1, s:e]) if into else {}
            gen = backend.segment_fwd(ch.zx[:, s:e], ch.halos[k], params, spec=spec, seq_idx=ch.labels[k],
                                      keep_y=keep_y, **extra)  # fmt: skip
            S_ext, log_a = next(gen)
            gens.append(gen)
            summaries.append((S_ext, ch.log_a(k, log_a)))
    # each tile's decay exp(log_a), once, for the summary fold, the chain of S_in and the backward
    decays = [None] * len(summaries)

    def decay(i):
        if decays[i] is None:
            decays[i] = _decay(summaries[i][1])
        return decays[i]

    handle = yield _fold(chains, summaries, decay)
    S_in_all = handle.wait()
    ys, i = [], 0
    saved["S_in"], saved["decay"] = [], []
    for ch in chains:
        state = S_in_all[ch.r0 : ch.r1]
        states, tile_decays = [], []
        for k, (s, e) in enumerate(ch.spans):
            S_ext = summaries[i][0]
            S_in = ch.keep(k, state)
            tile_out, y = finish(gens[i], Ready(S_in))
            _put(out[ch.r0 : ch.r1, s:e], tile_out)
            ys.append(y)
            states.append(S_in)
            if k + 1 < len(ch.spans):
                state = torch.addcmul(S_ext, decay(i), S_in)
            tile_decays.append(decays[i])  # the backward's: folding L (tiles 0..n-2), passing dS_out back (1..n-1)
            i += 1
        saved["S_in"].append(states)
        saved["decay"].append(tile_decays)
    return out, (ys if keep_y else None)


def segment_bwd(backend, tiles: Tiles, saved: dict, dout, zxbcdt, halo, params, *, S_in, spec, seq_idx=None,
                kept=None, dS_out=None):  # fmt: skip
    """``backend.segment_bwd`` over ``tiles``; ``saved`` as filled by ``segment_fwd``; ``kept``: a list
    holding the list of the tiles' kept y (or nothing). Known mode (dS_out given): ``_known_bwd``."""
    chains = _chains(zxbcdt, halo, seq_idx, spec, tiles)
    ys = kept.pop() if kept else None
    dzxbcdt = torch.empty_like(zxbcdt)
    into = getattr(backend, "WRITES_INTO", False)  # each tile's gradient lands in its view of dzxbcdt
    if dS_out is not None:
        dhalo, result = _known_bwd(backend, chains, saved, dout, dzxbcdt, into, params, spec, ys, dS_out)
        del ys
        yield dhalo
        return result
    gens, Ls, i = [], [], 0
    for c, ch in enumerate(chains):
        for k, (s, e) in enumerate(ch.spans):
            tile_kept = [ys[i]] if ys is not None and ys[i] is not None else None
            extra = dict(dzxbcdt=dzxbcdt[ch.r0 : ch.r1, s:e]) if into else {}
            gen = backend.segment_bwd(dout[ch.r0 : ch.r1, s:e], ch.zx[:, s:e], _halo_value(ch, k), params,
                                      saved["S_in"][c][k], spec=spec, seq_idx=ch.labels[k], kept=tile_kept,
                                      **extra)  # fmt: skip
            gens.append(gen)
            Ls.append(ch.keep(k, next(gen)))
            i += 1
    del ys
    # the gradient reaching the segment's S_in, row group by row group
    L_rows, i = [], 0
    for c, ch in enumerate(chains):
        acc = None
        for k in reversed(range(len(ch.spans))):
            L = Ls[i + k]
            acc = L if acc is None else torch.addcmul(L, saved["decay"][c][k].to(L.dtype), acc)
        L_rows.append(acc)
        i += len(ch.spans)
    handle = yield _cat(L_rows)
    dS_out_all = handle.wait()
    dparams = None
    dhalo_rows = []
    i = 0
    for c, ch in enumerate(chains):
        n = len(ch.spans)
        grad = dS_out_all[ch.r0 : ch.r1]
        carry = None  # the halo gradient tile k+1 sends to tile k's last rows
        first_dhalo = None
        for k in reversed(range(n)):
            s, e = ch.spans[k]
            gen = gens[i + k]
            dhalo = gen.send(Ready(grad))
            tile_grads = finish(gen, None)
            _land(dzxbcdt, ch, s, e, tile_grads[0], carry, spec)
            dparams = _add(dparams, tile_grads[1:])
            if k > 0:
                carry = None if dhalo is None else _masked(dhalo, ch.masks[k])
                # the gradient reaching tile k-1's end: what tile k's outputs send, and what passes through tile k
                grad = torch.addcmul(Ls[i + k], saved["decay"][c][k].to(grad.dtype), grad)
            else:
                first_dhalo = dhalo
        dhalo_rows.append(first_dhalo)
        i += n
    yield None if dhalo_rows[0] is None else torch.cat(dhalo_rows)
    return (dzxbcdt, *dparams)


# -- known mode (ops/segment.py): each tile whole before the next, one tile's intermediates alive at a time --


def _known_tiles(backend, ch, params, spec, keep_y, state, out=None):
    """One chain's tiles in known mode, each run whole before the next starts: yields (s, e, S_in, out, y, S_out)
    per tile, S_out the next tile's S_in. out: the buffer the backend may write each tile's output into."""
    for k, (s, e) in enumerate(ch.spans):
        extra = dict(out=out[ch.r0 : ch.r1, s:e]) if out is not None else {}
        tile_in = ch.keep(k, state)
        gen = backend.segment_fwd(ch.zx[:, s:e], ch.halos[k], params, spec=spec, seq_idx=ch.labels[k],
                                  keep_y=keep_y, S_in=tile_in, **extra)  # fmt: skip
        tile_out, y, state = run_fwd_known(gen)
        yield s, e, tile_in, tile_out, y, state
        tile_out = y = None  # the caller has what it keeps: this tile's output goes before the next tile runs


def _known_fwd(backend, chains, saved, out, into, params, spec, keep_y, S_in):
    """-> (out, ys (one per tile, or None), S_out (rows, ...): the state after every row's last tile)."""
    ys, finals = [], []
    saved["S_in"], saved["decay"] = [], []
    for ch in chains:
        states, afters = [], []
        tiles = _known_tiles(backend, ch, params, spec, keep_y, S_in[ch.r0 : ch.r1], out if into else None)
        for s, e, tile_in, tile_out, y, S_out in tiles:
            _put(out[ch.r0 : ch.r1, s:e], tile_out)
            ys.append(y)
            states.append(tile_in)
            afters.append(S_out)
        saved["S_in"].append(states)
        saved["decay"].append([None] * len(states))  # the known backward needs no decays
        finals.append(afters[-1])
    return out, (ys if keep_y else None), _cat(finals)


def _known_bwd(backend, chains, saved, dout, dzxbcdt, into, params, spec, ys, dS_out):
    """From every row's last tile back, each tile's backward whole, its dS_in the dS_out of the tile before.
    -> (the segment's halo gradient or None, (dzxbcdt, *dparams, dS_in))."""
    dparams, dhalo_rows, dS_in_rows, i = None, [], [], 0
    for c, ch in enumerate(chains):
        n = len(ch.spans)
        grad, carry = dS_out[ch.r0 : ch.r1], None  # carry: the halo gradient tile k+1 sends to tile k's last rows
        for k in reversed(range(n)):
            s, e = ch.spans[k]
            tile_kept = [ys[i + k]] if ys is not None and ys[i + k] is not None else None
            extra = dict(dzxbcdt=dzxbcdt[ch.r0 : ch.r1, s:e]) if into else {}
            gen = backend.segment_bwd(dout[ch.r0 : ch.r1, s:e], ch.zx[:, s:e], _halo_value(ch, k), params,
                                      saved["S_in"][c][k], spec=spec, seq_idx=ch.labels[k], kept=tile_kept,
                                      dS_out=grad, **extra)  # fmt: skip
            tile_grads, dS_in, dhalo = run_bwd_known(gen)
            _land(dzxbcdt, ch, s, e, tile_grads[0], carry, spec)
            dparams = _add(dparams, tile_grads[1:])
            if k > 0:
                carry = None if dhalo is None else _masked(dhalo, ch.masks[k])
                grad = ch.keep(k, dS_in)  # a tile that begins a document got no state: none of its gradient passes
            else:
                dhalo_rows.append(dhalo)
                dS_in_rows.append(dS_in)
        i += n
    dhalo = None if dhalo_rows[0] is None else torch.cat(dhalo_rows)
    return dhalo, (dzxbcdt, *dparams, _cat(dS_in_rows))


def _land(dzxbcdt, ch, s, e, dzx, carry, spec: CoreSpec):
    """A tile's gradient of zxbcdt into its view of the whole, plus on its last rows the halo gradient that tile
    k+1 sent back (carry, or None)."""
    _put(dzxbcdt[ch.r0 : ch.r1, s:e], dzx)
    if carry is not None:
        xbc = slice(spec.d_inner, spec.d_inner + spec.conv_dim)
        rows = slice(e - (spec.d_conv - 1), e)
        dzxbcdt[ch.r0 : ch.r1, rows, xbc].add_(carry.to(dzxbcdt.dtype))  # (+= would copy it back)


def _cat(rows):
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _put(view, value):
    """Copies a tile's result into its view of the whole, unless the backend wrote it there already."""
    if value.data_ptr() != view.data_ptr() or value.stride() != view.stride():
        view.copy_(value)


# -- forward only (inference): nothing saved for a backward, no kept y, a tile's intermediates freed when it ends --


def forward_groups(nrows: int, seqlen: int, spec: CoreSpec, limit: int | None, tile_length: int | None,
                   labels: torch.Tensor | None = None) -> list[tuple]:  # fmt: skip
    """The chains of a forward-only segment of (nrows, seqlen): [(r0, r1, spans)]. Without labels: ``plan``'s
    tiles. With labels (nrows, seqlen): every row its own chain, cut where ``plan`` cuts and at every document
    start (one host read), so that the state after a span that ends a document is its final state."""
    tiles = plan(nrows, seqlen, spec, limit, tile_length)
    if labels is None:
        if tiles is None:
            return [(0, nrows, ((0, seqlen),))]
        return [(r0, r1, tiles.spans) for r0, r1 in tiles.rows]
    from ds_mamba_spcp.ops.segment import starts

    per_row = plan(1, seqlen, spec, limit, tile_length)
    fixed = set() if per_row is None else {s for s, _ in per_row.spans[1:]}
    groups = []
    for row, cuts in enumerate(starts(labels)):
        bounds = sorted(fixed | cuts)
        groups.append((row, row + 1, tuple(zip([0, *bounds], [*bounds, seqlen]))))
    return groups


class _Out:
    """The segment's output, tile by tile: one tile's own buffer when there is one tile."""

    def __init__(self, zxbcdt, spec: CoreSpec, chains):
        self.whole = len(chains) == 1 and len(chains[0].spans) == 1
        self.value = None
        if not self.whole:
            self.value = torch.empty(*zxbcdt.shape[:2], spec.d_inner, dtype=zxbcdt.dtype, device=zxbcdt.device)

    def put(self, ch, s, e, tile_out):
        if self.whole:
            self.value = tile_out
        else:
            self.value[ch.r0 : ch.r1, s:e] = tile_out


def _chains_of(zxbcdt, halo, seq_idx, spec, groups):
    return [_Chain(zxbcdt, halo, seq_idx, spec, r0, r1, spans) for r0, r1, spans in groups]


def forward_known(backend, groups, zxbcdt, halo, params, *, spec, seq_idx=None, initial_states=None):
    """A segment whose incoming state is known (a group of one: the initial state or zeros), forward only.

    groups: ``forward_groups``' chains; each tile runs whole before the next (the peak is one tile's). Returns
    (out (rows, seqlen, d_inner), states): states[g][k] is the state after span k of chain g, fp32 or wider."""
    chains = _chains_of(zxbcdt, halo, seq_idx, spec, groups)
    out, states = _Out(zxbcdt, spec, chains), []
    for ch in chains:
        given = None if initial_states is None else initial_states[ch.r0 : ch.r1].to(state_dtype(ch.zx))
        after = []
        # the training route's known mode (a group of one) runs the same tiles: the two agree bitwise
        tiles = _known_tiles(backend, ch, params, spec, False, zero_state(ch.zx, spec) if given is None else given)
        for s, e, _, tile_out, _, S_out in tiles:
            out.put(ch, s, e, tile_out)
            after.append(S_out)
        states.append(after)
    return out.value, states


def segment_fwd_only(backend, groups, zxbcdt, halo, params, *, spec, seq_idx=None):
    """A segment whose incoming state arrives from elsewhere (the ranks' exchange), forward only: a generator
    with the protocol of ``ops/segment.py``. groups: ``forward_groups``' chains.

    One tile keeps its first phase alive across the exchange; several run in two passes, one tile alive at a
    time: each tile's summary (its first phase, then dropped), the exchange, then every tile again from its
    incoming state (the first phase recomputed bitwise) to its output. Nothing is kept for a backward.
    Returns (out, states) as ``forward_known``."""
    chains = _chains_of(zxbcdt, halo, seq_idx, spec, groups)
    two_pass = sum(len(ch.spans) for ch in chains) > 1

    def first_phase(ch, k):
        s, e = ch.spans[k]
        gen = backend.segment_fwd(ch.zx[:, s:e], ch.halos[k], params, spec=spec, seq_idx=ch.labels[k],
                                  keep_y=False)  # fmt: skip
        S_ext, log_a = next(gen)
        return gen, (S_ext, ch.log_a(k, log_a))

    gens, summaries = [], []
    for ch in chains:
        for k in range(len(ch.spans)):
            gen, summary = first_phase(ch, k)
            if two_pass:
                gen.close()  # its intermediates go now; the second pass runs the tile again
                gen = None
            gens.append(gen)
            summaries.append(summary)
    handle = yield _fold(chains, summaries, lambda i: _decay(summaries[i][1]))  # the fold of segment_fwd
    S_in_all = handle.wait()
    out, states, i = _Out(zxbcdt, spec, chains), [], 0
    for ch in chains:
        state, after = S_in_all[ch.r0 : ch.r1], []
        for k, (s, e) in enumerate(ch.spans):
            S_ext, log_a = summaries[i]
            gen = gens[i] if gens[i] is not None else first_phase(ch, k)[0]
            S_in = ch.keep(k, state)
            tile_out, _ = finish(gen, Ready(S_in))
            out.put(ch, s, e, tile_out)
            gen = gens[i] = summaries[i] = tile_out = None  # this tile's intermediates go now
            state = torch.addcmul(S_ext, _decay(log_a), S_in)
            after.append(state)
            i += 1
        states.append(after)
    return out.value, states


def final_states(groups, states) -> torch.Tensor:
    """The state after every row's last span, in row order (the chains cover the rows in order)."""
    return torch.cat([after[-1] for after in states])


def states_at(groups, states, found) -> torch.Tensor:
    """The states after the spans that end at the ``documents.Candidate`` ends ``found`` (per-row chains:
    ``forward_groups`` with labels), one row per candidate."""
    at = {(r0, e): st for (r0, _, spans), after in zip(groups, states) for (_, e), st in zip(spans, after)}
    return torch.cat([at[(c.row, c.end)] for c in found])


def _halo_value(ch: _Chain, k: int):
    halo = ch.halos[k]
    return halo.wait() if hasattr(halo, "wait") else halo


def _masked(dhalo, mask):
    return dhalo if mask is None else dhalo * mask[..., None].to(dhalo.dtype)


def _add(acc, grads):
    if acc is None:
        return list(grads)
    return [a if g is None else (g if a is None else a + g) for a, g in zip(acc, grads)]
