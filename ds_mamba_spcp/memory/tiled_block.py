"""One Mamba2 block recomputed in sequence tiles: its transient memory no longer grows with the shard.

    tiled_block(x, norm, mixer, tile_tokens, seq_idx) = x + mixer(norm(x)), and its own activation checkpoint

    forward   no graph; for each tile [s, e) of the shard, in order:
                  norm(x[s-(K-1) : e]) -> in_proj -> zxbcdt of [s, e), and the conv halo (the xBC of the K-1
                  rows before s, from inside the tile's own computation: no halo is stored)
                  -> the mixer core from S_in (the backend's segment, ops/segment.py) -> out_proj -> + x[s:e]
                  -> S_out, the next tile's S_in
              keeps x (the checkpoint) and the S_in of tiles 1.. (fp32 (batch, nheads, headdim, dstate) each)
    backward  for the tiles from the last to the first: tile k again, with a graph, from x[s-(K-1) : e] and its
              saved S_in (a leaf); one autograd.grad with (dout[s:e], the gradient tile k+1 sent to S_out)
              -> dx[s-(K-1) : e] (added: the halo rows are tile k-1's too), S_in's gradient (for tile k-1),
              the parameters' gradients, summed in fp32 over the tiles and returned once per block

K is the conv width (d_conv). Each recompute runs under the forward's autocast settings and, when a random op
drew in forward, from the generators' state that tile's forward began with (``memory/recompute.py``); the core
computes with autocast off, as the untiled op does. The tiles chain as segments of one row do (docs/design.md,
"The algebra", "Packed rows": each tile's labels renumbered from 0, halo rows of another document zeroed, a
tile that begins a document gets S_in = 0).

The parameters are inputs of the block's autograd Function, whose backward returns their gradients summed
over the tiles in fp32 (``torch.autograd.grad`` accumulates nothing), so DeepSpeed's ZeRO 1-2 and bf16
gradient hooks fire once per block, as without tiles. Refused: ZeRO stage 3 (partitioned parameters), a group
of more than one rank (the shard's incoming state comes from the exchange), ``cu_seqlens``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds_mamba_spcp.memory.recompute import autocast_state, rng_state
from ds_mamba_spcp.ops import get_backend
from ds_mamba_spcp.ops.autograd import first_order_only
from ds_mamba_spcp.ops.segment import canonical_seq_idx, run_bwd_known, run_fwd_known, zero_state
from ds_mamba_spcp.ops.spec import CoreSpec

if TYPE_CHECKING:
    from ds_mamba_spcp.engine.call import MixerCore

KEY = "mamba_sequence_parallel.block_tile_tokens"

__all__ = ["Tiles", "TiledFn", "make_tiles", "refuse_partitioned", "tile_spans", "tiled_block"]


def tile_spans(seqlen: int, tile_tokens: int, key: str = KEY) -> tuple:
    """The tiles [(s, e)] of a shard of ``seqlen`` tokens, ``tile_tokens`` each, the last one shorter."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f'"{key}" must be a positive int (tokens per tile), got {tile_tokens!r}')
    return tuple((s, min(s + tile_tokens, seqlen)) for s in range(0, seqlen, tile_tokens))


# -- the core of one tile: the backend's segment with a halo and an incoming state, both differentiable --


class _TileCore(torch.autograd.Function):
    """(zxbcdt, halo, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, S_in) -> (out, S_out) of one
    segment, through the backend's ``segment_fwd`` / ``segment_bwd`` in known mode (ops/segment.py)."""

    @staticmethod
    def forward(ctx, backend, spec, labels, keep_y, zxbcdt, halo, *params_and_state):
        *params, S_in = params_and_state
        gen = backend.segment_fwd(zxbcdt, halo, tuple(params), spec=spec, seq_idx=labels, keep_y=keep_y, S_in=S_in)
        out, y, S_out = run_fwd_known(gen)
        ctx.backend, ctx.spec, ctx.labels = backend, spec, labels
        ctx.kept = [y] if y is not None else None
        ctx.has = [t is not None for t in params]
        ctx.save_for_backward(zxbcdt, halo, *params, S_in)
        return out, S_out

    @staticmethod
    @first_order_only
    def backward(ctx, dout, dS_out):
        zxbcdt, halo, *params, S_in = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros(*zxbcdt.shape[:2], ctx.spec.d_inner, dtype=zxbcdt.dtype, device=zxbcdt.device)
        dS_out = torch.zeros_like(S_in) if dS_out is None else dS_out.to(S_in.dtype)
        gen = ctx.backend.segment_bwd(dout, zxbcdt, halo, tuple(params), S_in, spec=ctx.spec, seq_idx=ctx.labels,
                                      kept=ctx.kept, dS_out=dS_out)  # fmt: skip
        (dzxbcdt, *dparams), dS_in, dhalo = run_bwd_known(gen)
        ctx.kept = None
        dparams = [g if has else None for g, has in zip(dparams, ctx.has)]
        return None, None, None, None, dzxbcdt, dhalo, *dparams, dS_in.to(S_in.dtype)


# -- the tiles of one shard, and the core of one tile ----------------------------------------------


@dataclass
class Tiles:
    """What the tiles of one shard share: the core's sizes, the backend, the spans and, for packed rows, each
    tile's labels. A block (here, or a transformers decoder layer: integrations/transformers/long_context.py) calls
    ``core`` from inside its tile's computation with in_proj's output of the tile and its halo rows."""

    spec: CoreSpec
    backend: object
    spans: tuple
    keep_y: bool
    labels: list  # per tile: canonical labels (batch, T) int32, or None
    starts: list  # per tile: (batch,) bool, the tile begins on a document start, or None
    halo_masks: list  # per tile: (batch, nhalo) bool, the halo rows of the tile's first document, or None

    def halo_rows(self, k: int) -> int:
        s, _ = self.spans[k]
        return min(s, self.spec.d_conv - 1)

    def core(self, k: int, zx, core: MixerCore, S_in):
        """zx: in_proj's output on tile k and its halo rows (batch, nhalo + T, d_in_proj); S_in: the state entering
        the tile (fp32) or None (the row's start). Returns (y (batch, T, d_inner), S_out)."""
        spec, nhalo, K = self.spec, self.halo_rows(k), self.spec.d_conv
        zxbcdt = zx[:, nhalo:]
        halo = None
        if k > 0 and K > 1:
            halo = zx[:, :nhalo, spec.d_inner : spec.d_inner + spec.conv_dim]
            if self.halo_masks[k] is not None:
                halo = halo * self.halo_masks[k][..., None].to(halo.dtype)
            if nhalo < K - 1:  # a tile closer than K-1 tokens to the row's start: zeros before it
                halo = F.pad(halo, (0, 0, K - 1 - nhalo, 0))
        if S_in is None:
            S_in = zero_state(zxbcdt, spec)
        if self.starts[k] is not None:  # a tile that begins a document gets no state
            S_in = S_in * (~self.starts[k]).to(S_in.dtype)[:, None, None, None]
        with torch.autocast(device_type=zxbcdt.device.type, enabled=False):
            return _TileCore.apply(
                self.backend, spec, self.labels[k], self.keep_y and torch.is_grad_enabled(), zxbcdt, halo,
                core.conv1d_weight, core.conv1d_bias, core.dt_bias, core.A, core.D, core.rmsnorm_weight, S_in,
            )  # fmt: skip


def make_tiles(core: MixerCore, backend, batch: int, seqlen: int, tile_tokens: int, seq_idx, keep_y: bool,
               key: str = KEY) -> Tiles:  # fmt: skip
    """The tiles of a shard (batch, seqlen) of ``core``'s mixer; raises (naming ``key``) for tiles the backend
    cannot take in one call, and for labels of another shape."""
    spans = tile_spans(seqlen, tile_tokens, key)
    spec = core.spec(torch.empty(batch, 1, core.d_in_proj, device="meta"))
    limit = backend.max_tokens_per_call(spec)
    tokens_per_tile = batch * min(tile_tokens, seqlen)
    if limit is not None and tokens_per_tile > limit:
        raise ValueError(
            f'"{key}" is {tile_tokens}: batch x tile = {tokens_per_tile} tokens per tile, more than one call of the '
            f"{backend.NAME} backend takes ({limit} at this shape, int32 offsets). Use at "
            f"most {limit // spec.chunk_size * spec.chunk_size} tokens per tile divided by the batch."
        )
    if seq_idx is not None and tuple(seq_idx.shape) != (batch, seqlen):
        raise ValueError(f"seq_idx must be (batch, seqlen) = {(batch, seqlen)}, got {tuple(seq_idx.shape)}")
    labels, starts, masks = _labels(seq_idx, spans, spec.d_conv)
    return Tiles(spec, backend, spans, keep_y, labels, starts, masks)


# -- one tile of the block --------------------------------------------------------------------


@dataclass
class _Block:
    """A pre-norm block ``x + mixer(norm(x))`` in tiles: the tiles, its modules and parameters."""

    tiles: Tiles
    norm: torch.nn.Module
    mixer: torch.nn.Module
    params: list
    preserve_rng: bool

    def tile(self, k: int, x_ext, S_in):
        """x_ext: (batch, nhalo + T, d_model), the tile's tokens after its nhalo halo rows; S_in: the state
        entering the tile (fp32), or None (the row's start). Returns (x + mixer(norm(x)) on the tile, S_out)."""
        mixer, nhalo = self.mixer, self.tiles.halo_rows(k)
        y, S_out = self.tiles.core(k, mixer.in_proj(self.norm(x_ext)), mixer._core(), S_in)
        return x_ext[:, nhalo:] + mixer.out_proj(y), S_out


class TiledFn(torch.autograd.Function):
    """x -> block(x) tile by tile, for a ``block`` with ``tiles``, ``tile(k, x_ext, S_in) -> (out, S_out)``,
    ``params`` and ``preserve_rng`` (``_Block``; a transformers decoder layer in long_context.py); see the module
    docstring. ``params`` are inputs so that the output requires grad whenever a parameter does, and their
    gradients leave through ``backward`` once."""

    @staticmethod
    def forward(ctx, block: _Block, x, *params):
        out = None  # of the first tile's dtype: a block may return another (a residual kept in fp32)
        states, S_in, rngs = [], None, []
        with torch.no_grad():
            for k, (s, e) in enumerate(block.tiles.spans):
                if k > 0:
                    states.append(S_in)
                if block.preserve_rng:
                    rngs.append(rng_state(x.device))
                out_k, S_in = block.tile(k, x[:, s - block.tiles.halo_rows(k) : e], S_in)
                if out is None:
                    out = x.new_empty(x.shape, dtype=out_k.dtype)
                out[:, s:e] = out_k
        # backward runs the tiles in reverse: each replays its forward's generator state (if anything drew)
        ctx.rngs = None if not rngs or rngs[0].same_as(rng_state(x.device)) else rngs
        ctx.autocast = autocast_state(x.device)  # re-entered around each recompute (memory/recompute.py)
        ctx.block = block
        ctx.save_for_backward(x, *states)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        x, *states = ctx.saved_tensors
        block = ctx.block
        live = [i for i, p in enumerate(block.params) if p.requires_grad]
        dx = torch.zeros_like(x)
        sums = [None] * len(block.params)
        dS = None  # the gradient reaching the S_out of the tile in hand (none after the shard's last token)
        for k in reversed(range(len(block.tiles.spans))):
            s, e = block.tiles.spans[k]
            lo = s - block.tiles.halo_rows(k)
            replay = ctx.rngs[k].replay() if ctx.rngs is not None else contextlib.nullcontext()
            with torch.enable_grad(), replay, ctx.autocast.context():
                x_ext = x[:, lo:e].detach().requires_grad_()
                S_in = states[k - 1].detach().requires_grad_() if k > 0 else None
                out_k, S_out = block.tile(k, x_ext, S_in)
            outputs, grads = [out_k], [dout[:, s:e]]
            if dS is not None:
                outputs.append(S_out)
                grads.append(dS)
            wrt = [x_ext] + ([S_in] if S_in is not None else []) + [block.params[i] for i in live]
            got = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
            dx[:, lo:e] += got[0]
            dS = got[1] if S_in is not None else None
            for i, g in zip(live, got[2 if S_in is not None else 1 :]):
                if g is not None:
                    g = g.to(torch.promote_types(g.dtype, torch.float32))
                    sums[i] = g if sums[i] is None else sums[i] + g
            del out_k, S_out, outputs, got
        dparams = [None if g is None else g.to(p.dtype) for g, p in zip(sums, block.params)]
        return None, dx, *dparams


# -- the public function ----------------------------------------------------------------------


def _block_params(norm, mixer) -> list:
    seen, out = set(), []
    for p in list(norm.parameters()) + list(mixer.parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _check(mixer, params, tile_tokens) -> None:
    """Refusals, alike on every rank of a group (they read the configuration, not the data)."""
    cp = mixer.sequence_parallel_size
    if cp > 1:
        raise ValueError(
            f'"{KEY}" is {tile_tokens} with a sequence-parallel group of {cp} ranks: the tiled block recompute '
            "runs on a group of one only (a shard's incoming state comes from the ranks' exchange, which the tiles "
            f'do not run). Unset "{KEY}", or train with sequence_parallel_size 1.'
        )
    refuse_partitioned(params, f'"{KEY}" is {tile_tokens}', f'unset "{KEY}"')


def refuse_partitioned(params, what: str, fix: str) -> None:
    """ZeRO stage 3 partitions parameters between module calls; the tiles' recompute does not gather them."""
    if any(hasattr(p, "ds_id") for p in params):
        raise ValueError(
            f"{what} under ZeRO stage 3, which partitions the parameters between module calls and which the tiled "
            f'block recompute does not gather. Set "zero_optimization.stage" to 0, 1 or 2, or {fix}.'
        )


def _labels(seq_idx, spans, K):
    """Per tile: canonical labels, whether it begins on a document start, and which of its halo rows share
    its first document."""
    if seq_idx is None:
        n = len(spans)
        return [None] * n, [None] * n, [None] * n
    labels, starts, masks = [], [], []
    for k, (s, e) in enumerate(spans):
        labels.append(canonical_seq_idx(seq_idx[:, s:e]))
        starts.append(None if k == 0 else seq_idx[:, s] != seq_idx[:, s - 1])
        lo = s - min(s, K - 1)
        masks.append(None if k == 0 or lo == s else seq_idx[:, lo:s] == seq_idx[:, s : s + 1])
    return labels, starts, masks


def tiled_block(x, norm, mixer, tile_tokens: int, seq_idx=None, preserve_rng_state: bool = True):
    """``x + mixer(norm(x))`` of a pre-norm Mamba2 block, recomputed in backward tile by tile.

    x: (batch, seqlen, d_model), the whole sequence on this rank (a group of one); norm: a per-token module
    (RMSNorm, LayerNorm); mixer: a ``DistributedMamba2``; tile_tokens: tokens per tile (the last may be shorter);
    seq_idx: (batch, seqlen) non-decreasing document labels, or None; preserve_rng_state: as
    ``torch.utils.checkpoint``'s (a tile draws for its halo rows too: with dropout not the untiled block's draws).
    Returns (batch, seqlen, d_model), the untiled block's up to the order of sums, gradients too. The call is its
    own activation checkpoint: use it in place of one around the block, not inside.
    """
    from ds_mamba_spcp.integrations.mamba_ssm.mixer import DistributedMamba2

    if not isinstance(mixer, DistributedMamba2):
        raise TypeError(
            f'"{KEY}" tiles blocks whose mixer is a DistributedMamba2 (ds_mamba_spcp.wrap_mamba2_mixers), got a '
            f"{type(mixer).__qualname__}"
        )
    if x.dim() != 3:
        raise ValueError(f"tiled_block expects x (batch, seqlen, d_model), got shape {tuple(x.shape)}")
    batch, seqlen, _ = x.shape
    params = _block_params(norm, mixer)
    _check(mixer, params, tile_tokens)
    core = mixer._core()
    backend = get_backend(mixer.config.backend, x.device)
    tiles = make_tiles(core, backend, batch, seqlen, tile_tokens, seq_idx, not mixer.config.recompute_output)
    block = _Block(tiles, norm, mixer, params, preserve_rng_state)
    return TiledFn.apply(block, x, *params)
