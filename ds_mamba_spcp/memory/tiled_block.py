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
gradient hooks fire once per block, as without tiles. Under ZeRO stage 3 a block's parameters are gathered once
per pass over its tiles (``gathered``: forward, backward) and their gradients reach ZeRO once, on the pass's last
differentiation (``_differentiate``, ``backward_gathered``). Packed rows by ``seq_idx`` only (no ``cu_seqlens``).

On a sequence-parallel group (``ShardTiledFn``) each local segment of the rank's shard is tiled as above; its
first tile reads the previous segment's last d_conv-1 input rows (an all-gather) and starts from the state the
op's summary exchange gives (engine/exchange.py: the all-gather or the scan), found from a first pass of
summaries (each tile from a zero state, the mixer's input path only); backward sends the segment's state
gradient back through the exchange's reverse scan and pushes what later segments return through the tiles'
state path in a second pass (everything is linear in the state). No rank waits on another tile by tile.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ds_mamba_spcp.engine import layout
from ds_mamba_spcp.memory.recompute import autocast_state, rng_state
from ds_mamba_spcp.ops import get_backend
from ds_mamba_spcp.ops.autograd import first_order_only
from ds_mamba_spcp.ops.segment import canonical_seq_idx, run_bwd_known, run_fwd_known, zero_state
from ds_mamba_spcp.ops.spec import CoreSpec

if TYPE_CHECKING:
    from ds_mamba_spcp.engine.call import MixerCore

KEY = "mamba_sequence_parallel.block_tile_tokens"

__all__ = ["Tiles", "TiledFn", "make_tiles", "tile_spans", "tiled_block"]

# A benchmark's recorder of the tiled Functions' phases (benchmarks/bench_tiled_sp.py), or None: called with each
# phase's name as it begins ("fwd_end" / "bwd_end": the pass is over). Read nowhere else; nothing is recorded here.
PHASES = None


def _mark(name: str) -> None:
    if PHASES is not None:
        PHASES(name)


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

    def _split(self, k: int, zx):
        """(zxbcdt of tile k, its pre-conv halo rows or None) from in_proj's output on the tile and its halo."""
        spec, nhalo, K = self.spec, self.halo_rows(k), self.spec.d_conv
        zxbcdt = zx[:, nhalo:]
        halo = None
        if self.spans[k][0] > 0 and K > 1:  # not the row's (or the chain's) first token
            halo = zx[:, :nhalo, spec.d_inner : spec.d_inner + spec.conv_dim]
            if self.halo_masks[k] is not None:
                halo = halo * self.halo_masks[k][..., None].to(halo.dtype)
            if nhalo < K - 1:  # a tile closer than K-1 tokens to the row's start: zeros before it
                halo = F.pad(halo, (0, 0, K - 1 - nhalo, 0))
        return zxbcdt, halo

    def core(self, k: int, zx, core: MixerCore, S_in):
        """zx: in_proj's output on tile k and its halo rows (batch, nhalo + T, d_in_proj); S_in: the state entering
        the tile (fp32) or None (the row's start). Returns (y (batch, T, d_inner), S_out)."""
        spec = self.spec
        zxbcdt, halo = self._split(k, zx)
        if S_in is None:
            S_in = zero_state(zxbcdt, spec)
        if self.starts[k] is not None:  # a tile that begins a document gets no state
            S_in = S_in * (~self.starts[k]).to(S_in.dtype)[:, None, None, None]
        with torch.autocast(device_type=zxbcdt.device.type, enabled=False):
            return _TileCore.apply(
                self.backend, spec, self.labels[k], self.keep_y and torch.is_grad_enabled(), zxbcdt, halo,
                core.conv1d_weight, core.conv1d_bias, core.dt_bias, core.A, core.D, core.rmsnorm_weight, S_in,
            )  # fmt: skip

    def state(self, k: int, zx, core: MixerCore, S_in):
        """The state after tile k (``core``'s S_out), differentiable: through the backend's state path alone where it
        has one (``segment_state``: both backends), else the whole segment (``_TileCore``, whose backward then runs
        the backend's segment_bwd with a zero output gradient)."""
        state_fn = getattr(self.backend, "segment_state", None)
        if state_fn is None or S_in is None:
            return self.core(k, zx, core, S_in)[1]
        zxbcdt, halo = self._split(k, zx)
        if self.starts[k] is not None:  # a tile that begins a document gets no state
            S_in = S_in * (~self.starts[k]).to(S_in.dtype)[:, None, None, None]
        params = (core.conv1d_weight, core.conv1d_bias, core.dt_bias, core.A, core.D, core.rmsnorm_weight)
        with torch.autocast(device_type=zxbcdt.device.type, enabled=False):
            return state_fn(zxbcdt, halo, params, S_in, spec=self.spec, seq_idx=self.labels[k])

    def summary(self, k: int, zx, core: MixerCore):
        """Tile k's summary from a zero state, (S_ext, log_a) (the backend's segment summary, ops/segment.py):
        log_a is -inf where a document starts inside the tile or on its first token. No graph."""
        zxbcdt, halo = self._split(k, zx)
        params = (core.conv1d_weight, core.conv1d_bias, core.dt_bias, core.A, core.D, core.rmsnorm_weight)
        with torch.no_grad(), torch.autocast(device_type=zxbcdt.device.type, enabled=False):
            gen = self.backend.segment_fwd(zxbcdt, halo, params, spec=self.spec, seq_idx=self.labels[k])
            S_ext, log_a = next(gen)
            gen.close()  # only the summary: the rest of the segment (its output) is never computed
        if self.starts[k] is not None:
            log_a = torch.where(self.starts[k][:, None], float("-inf"), log_a)
        return S_ext, log_a


def make_tiles(core: MixerCore, backend, batch: int, seqlen: int, tile_tokens: int, seq_idx, keep_y: bool,
               key: str = KEY, before: int = 0) -> Tiles:  # fmt: skip
    """The tiles of a shard (batch, seqlen) of ``core``'s mixer; raises (naming ``key``) for tiles the backend
    cannot take in one call, and for labels of another shape. ``before``: rows in front of the shard, the
    previous segment's last tokens on another rank (the conv halo of the first tile, ``ShardTiledFn``): the
    spans start there, and seq_idx (batch, before + seqlen) holds their labels too."""
    spans = tuple((s + before, e + before) for s, e in tile_spans(seqlen, tile_tokens, key))
    spec = core.spec(torch.empty(batch, 1, core.d_in_proj, device="meta"))
    limit = backend.max_tokens_per_call(spec)
    tokens_per_tile = batch * min(tile_tokens, seqlen)
    if limit is not None and tokens_per_tile > limit:
        raise ValueError(
            f'"{key}" is {tile_tokens}: batch x tile = {tokens_per_tile} tokens per tile, more than one call of the '
            f"{backend.NAME} backend takes ({limit} at this shape, int32 offsets). Use at "
            f"most {limit // spec.chunk_size * spec.chunk_size} tokens per tile divided by the batch."
        )
    if seq_idx is not None and tuple(seq_idx.shape) != (batch, before + seqlen):
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
    halo: int = 0  # d_conv - 1: the rows of the previous rank's shard a segment's first tile reads

    def tile(self, k: int, x_ext, S_in, tiles: Tiles | None = None):
        """x_ext: (batch, nhalo + T, d_model), the tile's tokens after its nhalo halo rows; S_in: the state
        entering the tile (fp32), or None (the row's start); tiles: the segment's (``ShardTiledFn``), else the
        block's. Returns (x + mixer(norm(x)) on the tile, S_out)."""
        tiles = self.tiles if tiles is None else tiles
        mixer, nhalo = self.mixer, tiles.halo_rows(k)

        def mixer_tile(h, S_in):
            y, S_out = tiles.core(k, mixer.in_proj(h), mixer._core(), S_in)
            return mixer.out_proj(y), S_out

        out, S_out = _as_call_of(mixer, mixer_tile, self.norm(x_ext), S_in)
        return x_ext[:, nhalo:] + out, S_out

    def summary(self, tiles: Tiles, k: int, x_ext):
        """Tile k's summary (S_ext, log_a) from a zero state: the mixer's input path only."""
        return tiles.summary(k, self.mixer.in_proj(self.norm(x_ext)), self.mixer._core())

    def state(self, tiles: Tiles, k: int, x_ext, S_in):
        """The state after tile k (its state path only: no out_proj, no residual)."""
        return tiles.state(k, self.mixer.in_proj(self.norm(x_ext)), self.mixer._core(), S_in)


def _as_call_of(module: torch.nn.Module, fn, *args):
    """``fn(*args)`` as a call of ``module``: the module's hooks run around it as around its forward. Under ZeRO-3
    a ``DistributedMamba2`` is a leaf module (integrations/mamba_ssm/mixer.py) whose backward hook hands all its
    parameters' gradients to ZeRO; a tile that bypassed its call would leave them accumulated and never reduced
    (ZeRO-3's step then fails on the stale ``.grad``, after updates without the mixer's gradients)."""
    own = module.__dict__.get("forward")  # a forward set on the instance (a wrapper's, accelerate's hooks): kept
    module.__dict__["forward"] = fn  # an instance attribute: nn.Module.__call__ runs it in place of the class's
    try:
        return module(*args)
    finally:
        if own is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = own


class TiledFn(torch.autograd.Function):
    """x -> block(x) tile by tile, for a ``block`` with ``tiles``, ``tile(k, x_ext, S_in) -> (out, S_out)``,
    ``params`` and ``preserve_rng`` (``_Block``; a transformers decoder layer in long_context.py); see the module
    docstring. ``params`` are inputs so that the output requires grad whenever a parameter does, and their
    gradients leave through ``backward`` once."""

    @staticmethod
    def forward(ctx, block: _Block, x, *params):
        _mark("fwd_tiles")
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
        _mark("fwd_end")
        # backward runs the tiles in reverse: each replays its forward's generator state (if anything drew)
        ctx.rngs = None if not rngs or rngs[0].same_as(rng_state(x.device)) else rngs
        ctx.autocast = autocast_state(x.device)  # re-entered around each recompute (memory/recompute.py)
        ctx.block = block
        ctx.nparams = len(params)
        ctx.save_for_backward(x, *states)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        return backward_gathered(TiledFn._backward, ctx, dout, 2)

    @staticmethod
    def _backward(ctx, dout):
        _mark("bwd_tiles")
        x, *states = ctx.saved_tensors
        block = ctx.block
        live = [i for i, p in enumerate(block.params) if p.requires_grad]
        dx = torch.zeros_like(x)
        sums = [None] * len(block.params)
        dS = None  # the gradient reaching the S_out of the tile in hand (none after the shard's last token)
        zero3 = _zero3(block.params)
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
            got = _differentiate(outputs, grads, wrt, 2 if S_in is not None else 1, zero3, last=k == 0)
            dx[:, lo:e] += got[0]
            dS = got[1] if S_in is not None else None
            for i, g in zip(live, got[2 if S_in is not None else 1 :]):
                if g is not None:
                    g = g.to(torch.promote_types(g.dtype, torch.float32))
                    sums[i] = g if sums[i] is None else sums[i] + g
            del out_k, S_out, outputs, got
        dparams = [None if g is None else g.to(p.dtype) for g, p in zip(sums, block.params)]
        _mark("bwd_end")
        return None, dx, *dparams


# -- ZeRO stage 3: a block's parameters gathered once around a whole pass of tiles --------------------

_HELD = "ds_mamba_spcp.tiles"  # in ds_active_sub_modules: ZeRO's per-module release leaves the parameter gathered


@contextlib.contextmanager
def gathered(params):
    """Under ZeRO stage 3 (parameters with ``ds_id``): ``params`` gathered once (DeepSpeed's
    ``GatheredParameters``, one all-gather) for the whole body, and kept so: each module call inside still runs
    ZeRO's fetch and release hooks, but a gathered parameter is not fetched again, and the mark added to its
    active modules keeps the release from partitioning it tile by tile. Partitioned again on exit. Outside
    ZeRO-3, nothing. The gradients leave the tiled Functions once per block (their ``backward`` returns them
    summed), so ZeRO's gradient hooks fire once per parameter and pass, as DeepSpeed's TiledMLP arranges with
    ``ds_grad_is_ready``."""
    zero = [p for p in params if hasattr(p, "ds_id")]
    if not zero:
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(zero):
        for p in zero:
            p.ds_active_sub_modules.add(_HELD)
        try:
            yield
        finally:
            for p in zero:
                p.ds_active_sub_modules.discard(_HELD)


def _zero3(params) -> bool:
    return any(hasattr(p, "ds_id") for p in params)


def _differentiate(outputs, grads, wrt, nleaves: int, zero3: bool, last: bool) -> list:
    """The gradients of ``outputs`` (given ``grads``) for ``wrt``: its first ``nleaves`` (the tile's input and
    incoming state: leaves made for the recompute), then the block's parameters. Outside ZeRO-3 all returned
    (``torch.autograd.grad``; summed over the tiles by the caller, handed over once by the Function). Under ZeRO-3
    DeepSpeed's TiledMLP way: accumulated into the parameters' ``.grad`` (ZeRO's hooks, its leaf modules' too, fire
    on every call and need the parameter gathered), with ``ds_grad_is_ready`` false but on the block's ``last``
    call, so that ZeRO takes each gradient once, whole; the parameters' entries are then None."""
    if not zero3:
        return list(torch.autograd.grad(outputs, wrt, grads, allow_unused=True))
    leaves, params = wrt[:nleaves], wrt[nleaves:]
    for p in params:
        p.ds_grad_is_ready = last
    torch.autograd.backward(outputs, grads, inputs=list(wrt))
    return [t.grad for t in leaves] + [None] * len(params)


def backward_gathered(backward, ctx, dout, first: int) -> tuple:
    """A tiled Function's ``backward(ctx, dout)`` with the block's parameters gathered once for all its passes
    (ZeRO-3, ``gathered``; else the plain call). Under ZeRO-3 the parameters' gradients reached ZeRO inside it
    (``_differentiate``): the Function returns None for them."""
    params = ctx.block.params
    if not _zero3(params):
        return backward(ctx, dout)
    try:
        with gathered(params):
            grads = backward(ctx, dout)
    finally:
        for p in params:
            p.ds_grad_is_ready = True
    return (*grads[:first], *[None] * ctx.nparams)


def autograd_inputs(params) -> list:
    """What a tiled Function takes beside x: the block's parameters (their gradients leave through its backward),
    or under ZeRO-3 one empty leaf that requires grad (the output requires grad whatever x does, and the
    parameters, whose gradients reach ZeRO inside the backward, are no inputs: autograd would hand ZeRO's hooks
    each of them once more)."""
    if _zero3(params):
        return [torch.empty(0, requires_grad=True)]
    return list(params)


# -- a shard of a sequence-parallel group: the tiles of each local segment, the exchange between ranks --


@dataclass
class Chain:
    """This rank's place in the group's causal chain: ``plan`` (its segments, engine/strategies/state_passing.py),
    the summary exchange ``method`` (engine/exchange.py), the shard's document labels (batch, seqlen) or None,
    and ``make(seqlen, seq_idx, before)``, the tiles of one local segment (``make_tiles`` with the block's core)."""

    plan: object
    method: str
    seq_idx: object
    make: object

    def exchange(self, batch: int, **kwargs):
        from ds_mamba_spcp.engine import exchange

        if self.method == exchange.SCAN:
            return exchange.ScanExchange(self.plan, batch, need_final=False, **kwargs)
        return exchange.AllGatherExchange(self.plan, batch, **kwargs)


def make_chain(core: MixerCore, backend, config, group, cp: int, x_shape, tile_tokens: int, seq_idx,
               key: str = KEY) -> Chain:  # fmt: skip
    """This rank's ``Chain`` in ``group`` (``cp`` ranks) for a shard of ``x_shape`` (batch, seqlen, ...) under the
    section ``config``: the chain follows the shard's ``input_layout`` (contiguous: one segment per rank; zigzag:
    two, as load_balancing "virtual" runs them, whatever the mixer's own mode: the layer's other parts are per
    token, and the chain is the same sum); ``summary_exchange`` "auto" resolved as the op resolves it
    (engine/strategies/state_passing.py, from sizes only: alike on every rank). Raises for shards the chain cannot
    take."""
    from ds_mamba_spcp import comm
    from ds_mamba_spcp.engine import exchange, traffic
    from ds_mamba_spcp.engine.strategies.state_passing import SegmentPlan

    batch, seqlen = x_shape[:2]
    spec = core.spec(torch.empty(batch, 1, core.d_in_proj, device="meta"))
    chain_layout = config.input_layout
    rank, _ = comm.group_rank_size(group)
    plan = SegmentPlan(group, rank, cp, chain_layout)
    nl = plan.nlocal
    if seqlen % nl or seqlen // nl < max(spec.d_conv - 1, 1):
        raise ValueError(
            f'"{key}" on {cp} ranks ({chain_layout} shards): each of the shard\'s {nl} causal segment(s) must hold '
            f"the same number of tokens, at least d_conv-1 = {max(spec.d_conv - 1, 1)}, got a shard of {seqlen}. "
            "Use fewer ranks or longer sequences."
        )
    method = config.summary_exchange
    if method == exchange.AUTO:
        summary = traffic.summary_bytes(batch=batch, nheads=spec.nheads, headdim=spec.headdim, dstate=spec.dstate)
        method = traffic.choose_summary_exchange(cp=cp, summary=summary, chain=chain_layout)[0]
    keep_y = not config.recompute_output

    def make(m, ids, before):
        return make_tiles(core, backend, batch, m, tile_tokens, ids, keep_y, key=key, before=before)

    make(seqlen // nl, None, 0)  # the refusals of the tiles' sizes now, before any collective
    return Chain(plan, method, seq_idx, make)


def _from_predecessor(rows, plan):
    """Each local segment receives its predecessor's ``rows`` ((batch*nlocal, ...) -> the same shape; zeros for the
    chain's first segment): one all-gather."""
    got = plan.gather_ordered(plan.split(rows)).wait()  # (nseg, batch, ...) in causal order
    return plan.local(torch.cat([torch.zeros_like(got[:1]), got[:-1]]))


def _from_successor(rows, plan):
    """Each local segment receives its successor's ``rows`` (zeros for the chain's last): one all-gather."""
    got = plan.gather_ordered(plan.split(rows)).wait()
    return plan.local(torch.cat([got[1:], torch.zeros_like(got[:1])]))


class ShardTiledFn(torch.autograd.Function):
    """x -> block(x) tile by tile on this rank's shard of a group of ranks (``Chain``): ``TiledFn``'s recompute
    with the state and the conv halo of each local segment's first tile from the ranks before it.

    forward   the halo: the last d_conv-1 rows of the layer input x (and their labels) of every segment, one
              all-gather, prepended to the next segment (its first tile recomputes norm and in_proj on them);
              pass 1: each tile's summary from a zero state (the mixer's input path only), folded into the
              segment's (S_ext, log_a); the summary exchange -> S_in; pass 2: the tiles from S_in, the output,
              the states entering the tiles kept
    backward  pass 1: the tiles in reverse with the output's gradient, the state gradient from zero at the
              segment's end -> dx, the parameters' gradients and L (what reaches S_in); the exchange's reverse
              scan -> dS_out, the gradient later segments send to the segment's S_out; pass 2: dS_out pushed
              back through the tiles' state path alone (linearity: the two passes add up to the backward of the
              whole); the halo rows' gradients return to their owners, one all-gather

    No rank waits on another tile by tile: two collectives per direction (halo, summaries) at fixed points.
    """

    @staticmethod
    def forward(ctx, block, chain: Chain, x, *params):
        _mark("fwd_halo")
        plan = chain.plan
        nl, P = plan.nlocal, block.halo
        batch, seqlen = x.shape[:2]
        m = seqlen // nl
        xs = layout.rows_to_segments(layout.pack_segments(x, nl), nl)  # (nl, batch, m, d)
        seq = None
        if chain.seq_idx is not None:
            seq = layout.rows_to_segments(layout.pack_segments(chain.seq_idx, nl), nl)  # (nl, batch, m)
        first = [sid == 0 for sid in plan.local_ids]  # the chain's first segment: nothing before it
        halo_x = halo_ids = None
        with torch.no_grad():
            if P:
                halo_x = layout.rows_to_segments(_from_predecessor(layout.segments_to_rows(xs[:, :, -P:]), plan), nl)
            if seq is not None:
                tail = layout.segments_to_rows(seq[:, :, -max(P, 1) :])
                halo_ids = layout.rows_to_segments(_from_predecessor(tail, plan), nl)
        segs, start0 = [], []
        for j in range(nl):
            before = 0 if first[j] else P
            x_ext = x_seg = xs[j]
            ids = None if seq is None else seq[j]
            if before:
                x_ext = torch.cat([halo_x[j].to(x_seg.dtype), x_seg], dim=1)
                ids = None if ids is None else torch.cat([halo_ids[j][:, -P:], ids], dim=1)
            if seq is not None:
                start0.append(torch.zeros_like(seq[j][:, 0], dtype=torch.bool) if first[j]
                              else halo_ids[j][:, -1] != seq[j][:, 0])  # fmt: skip
            segs.append((before, x_ext, chain.make(m, ids, before)))
        rngs = [] if block.preserve_rng else None
        with torch.no_grad():
            _mark("summary")
            # pass 1: every segment's summary from a zero state, folded over its tiles (tiles.py's fold)
            S_ext, log_a = [], []
            for _, x_ext, tiles in segs:
                acc = total = None
                for k, (s, e) in enumerate(tiles.spans):
                    if rngs is not None:
                        rngs.append(rng_state(x.device))
                    S_k, a_k = block.summary(tiles, k, x_ext[:, s - tiles.halo_rows(k) : e])
                    acc = S_k if acc is None else S_k + torch.exp(a_k)[:, :, None, None] * acc
                    total = a_k if total is None else total + a_k
                S_ext.append(acc)
                log_a.append(total)
            _mark("exchange")
            summaries = chain.exchange(batch)
            summaries.start0 = None if seq is None else layout.segments_to_rows(torch.stack(start0))
            S_in = summaries.post(layout.segments_to_rows(torch.stack(S_ext)),
                                  layout.segments_to_rows(torch.stack(log_a))).wait()  # fmt: skip
            S_in = layout.rows_to_segments(S_in, nl)
            _mark("pass2")
            # pass 2: the tiles from S_in
            outs, states, i = [], [], 0
            for j, (before, x_ext, tiles) in enumerate(segs):
                state, out = S_in[j], None
                for k, (s, e) in enumerate(tiles.spans):
                    states.append(state)
                    replay = rngs[i].replay() if rngs is not None else contextlib.nullcontext()
                    with replay:
                        out_k, state = block.tile(k, x_ext[:, s - tiles.halo_rows(k) : e], state, tiles)
                    i += 1
                    if out is None:
                        out = x.new_empty(batch, m, x.shape[2], dtype=out_k.dtype)
                    out[:, s - before : e - before] = out_k
                outs.append(out)
        _mark("fwd_end")
        out = layout.unpack_segments(layout.segments_to_rows(torch.stack(outs)), nl)
        # every recompute replays its tile's generator state (pass 2 and the backward draw inside the replays, which
        # restore the caller's generators: whether the layer draws after its mixer cannot be read off them)
        ctx.rngs = rngs
        ctx.autocast = autocast_state(x.device)
        ctx.block, ctx.chain, ctx.segs = block, chain, [(before, tiles) for before, _, tiles in segs]
        ctx.start0 = summaries.start0
        ctx.nparams = len(params)
        ctx.save_for_backward(x, halo_x if halo_x is not None else x.new_empty(0), summaries.log_a_all, *states)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        return backward_gathered(ShardTiledFn._backward, ctx, dout, 3)

    @staticmethod
    def _backward(ctx, dout):
        _mark("bwd_pass1")
        x, halo_x, log_a_all, *states = ctx.saved_tensors
        block, chain = ctx.block, ctx.chain
        plan = chain.plan
        nl, P = plan.nlocal, block.halo
        batch = x.shape[0]
        xs = layout.rows_to_segments(layout.pack_segments(x, nl), nl)
        douts = layout.rows_to_segments(layout.pack_segments(dout, nl), nl)
        live = [i for i, p in enumerate(block.params) if p.requires_grad]
        sums = [None] * len(block.params)
        firsts, i = [], 0  # per segment: the index of its first tile in the flat lists
        for _, tiles in ctx.segs:
            firsts.append(i)
            i += len(tiles.spans)

        def x_ext_of(j):
            before = ctx.segs[j][0]
            return torch.cat([halo_x[j].to(x.dtype), xs[j]], dim=1) if before else xs[j]

        def recompute(j, k, x_ext, with_output: bool):
            before, tiles = ctx.segs[j]
            s, e = tiles.spans[k]
            lo = s - tiles.halo_rows(k)
            idx = firsts[j] + k
            replay = ctx.rngs[idx].replay() if ctx.rngs is not None else contextlib.nullcontext()
            with torch.enable_grad(), replay, ctx.autocast.context():
                x_t = x_ext[:, lo:e].detach().requires_grad_()
                S_in = states[idx].detach().requires_grad_()
                if with_output:
                    out_k, S_out = block.tile(k, x_t, S_in, tiles)
                else:
                    out_k, S_out = None, block.state(tiles, k, x_t, S_in)
            return lo, s, e, x_t, S_in, out_k, S_out

        def accumulate(got, dx_ext, lo, e):
            dx_ext[:, lo:e] += got[0]
            for n, g in zip(live, got[2:]):
                if g is not None:
                    g = g.to(torch.promote_types(g.dtype, torch.float32))
                    sums[n] = g if sums[n] is None else sums[n] + g

        zero3 = _zero3(block.params)
        nseg = plan.cp * nl
        # the rank's last differentiation (ZeRO-3 hands the parameters' gradients over there, TiledMLP's way)
        # (under ZeRO-3 on every segment: its ranks must call the same modules as often, its trace compares them)
        second = [j for j in range(nl) if zero3 or plan.local_ids[j] != nseg - 1]
        last_call = (2, second[-1]) if second else (1, nl - 1)
        dxs, Ls = [], []
        # pass 1: the output's gradient, the state's from zero at each segment's end
        for j, (before, tiles) in enumerate(ctx.segs):
            x_ext = x_ext_of(j)
            dx_ext = torch.zeros_like(x_ext)
            dS = None
            for k in reversed(range(len(tiles.spans))):
                lo, s, e, x_t, S_in, out_k, S_out = recompute(j, k, x_ext, True)
                outputs, grads = [out_k], [douts[j][:, s - before : e - before]]
                if dS is not None:
                    outputs.append(S_out)
                    grads.append(dS)
                wrt = [x_t, S_in] + [block.params[n] for n in live]
                got = _differentiate(outputs, grads, wrt, 2, zero3, last=(1, j) == last_call and k == 0)
                accumulate(got, dx_ext, lo, e)
                dS = got[1] if got[1] is not None else torch.zeros_like(S_in)
                del out_k, S_out, outputs, got
            dxs.append(dx_ext)
            Ls.append(dS)
        _mark("bwd_exchange")
        # the reverse scan over the group: the gradient reaching each segment's S_out from the later ones
        summaries = chain.exchange(batch, log_a_all=log_a_all, start0=ctx.start0)
        dS_out = summaries.post_grad(layout.segments_to_rows(torch.stack(Ls))).wait()
        dS_out = layout.rows_to_segments(dS_out, nl)
        _mark("bwd_pass2")
        # pass 2: dS_out back through each segment's state path (the chain's last segment receives none). Under
        # ZeRO-3 through the whole layer with a zero output gradient: every parameter takes part in each call, so
        # that the last one hands all of them to ZeRO (and no module's forward is cut short inside its hooks)
        for j in second:
            x_ext, g, tiles = x_ext_of(j), dS_out[j], ctx.segs[j][1]
            for k in reversed(range(len(tiles.spans))):
                lo, s, e, x_t, S_in, out_k, S_out = recompute(j, k, x_ext, zero3)
                wrt = [x_t, S_in] + [block.params[n] for n in live]
                outputs, grads = [S_out], [g.to(S_out.dtype)]
                if zero3:
                    outputs, grads = [out_k, S_out], [torch.zeros_like(out_k), g.to(S_out.dtype)]
                got = _differentiate(outputs, grads, wrt, 2, zero3, last=(2, j) == last_call and k == 0)
                accumulate(got, dxs[j], lo, e)
                g = got[1] if got[1] is not None else torch.zeros_like(S_in)
                del S_out, got
        _mark("bwd_halo")
        # the halo rows' gradients return to the segments that own them (their last d_conv-1 rows)
        dx = torch.stack([dx_ext[:, before:] for dx_ext, (before, _) in zip(dxs, ctx.segs)])  # (nl, batch, m, d)
        if P:
            sent = torch.stack([dx_ext[:, :P] if before else torch.zeros_like(dx_ext[:, :P])
                                for dx_ext, (before, _) in zip(dxs, ctx.segs)])  # fmt: skip
            back = layout.rows_to_segments(_from_successor(layout.segments_to_rows(sent), plan), nl)
            dx[:, :, -P:] += back
        dx = layout.unpack_segments(layout.segments_to_rows(dx), nl)
        dparams = [None if g is None else g.to(p.dtype) for g, p in zip(sums, block.params)]
        _mark("bwd_end")
        return None, None, dx, *dparams


# -- the public function ----------------------------------------------------------------------


def _block_params(norm, mixer) -> list:
    seen, out = set(), []
    for p in list(norm.parameters()) + list(mixer.parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _labels(seq_idx, spans, K):
    """Per tile: canonical labels, whether it begins on a document start, and which of its halo rows share
    its first document."""
    if seq_idx is None:
        n = len(spans)
        return [None] * n, [None] * n, [None] * n
    labels, starts, masks = [], [], []
    for s, e in spans:
        labels.append(canonical_seq_idx(seq_idx[:, s:e]))
        starts.append(None if s == 0 else seq_idx[:, s] != seq_idx[:, s - 1])
        lo = s - min(s, K - 1)
        masks.append(None if s == 0 or lo == s else seq_idx[:, lo:s] == seq_idx[:, s : s + 1])
    return labels, starts, masks


def tiled_block(x, norm, mixer, tile_tokens: int, seq_idx=None, preserve_rng_state: bool = True):
    """``x + mixer(norm(x))`` of a pre-norm Mamba2 block, recomputed in backward tile by tile.

    x: (batch, seqlen, d_model), this rank's shard of the sequence in the mixer's ``input_layout`` (the whole
    sequence on a group of one; on several ranks ``ShardTiledFn``); norm: a per-token module (RMSNorm, LayerNorm);
    mixer: a ``DistributedMamba2``; tile_tokens: tokens per tile (the last may be shorter); seq_idx: (batch,
    seqlen) non-decreasing document labels of the shard, or None; preserve_rng_state: as
    ``torch.utils.checkpoint``'s (a tile draws for its halo rows too: with dropout not the untiled block's draws).
    Returns (batch, seqlen, d_model), the untiled block's up to the order of sums, gradients too. The call is its
    own activation checkpoint: use it in place of one around the block, not inside. ZeRO 0-3 (stage 3: see the
    module docstring). Forward hooks on the mixer see one call per tile, (the tile's normed rows, its S_in).
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
    backend = get_backend(mixer.config.backend, x.device)
    cp = mixer.sequence_parallel_size
    # ZeRO-3: the block's parameters gathered once for the forward's passes over the tiles (the core's and the
    # tiles' sizes read their shapes, the Function records their gathered shapes); its backward gathers them once
    # again (backward_gathered). Outside ZeRO-3 gathered does nothing.
    with gathered(params):
        core = mixer._core()
        if cp == 1:
            keep_y = not mixer.config.recompute_output
            tiles = make_tiles(core, backend, batch, seqlen, tile_tokens, seq_idx, keep_y)
            return TiledFn.apply(_Block(tiles, norm, mixer, params, preserve_rng_state), x, *autograd_inputs(params))
        chain = make_chain(core, backend, mixer.config, mixer.process_group, cp, x.shape, tile_tokens, seq_idx)
        block = _Block(None, norm, mixer, params, preserve_rng_state, halo=core.conv1d_weight.shape[1] - 1)
        return ShardTiledFn.apply(block, chain, x, *autograd_inputs(params))
