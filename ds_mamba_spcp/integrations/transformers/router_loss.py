"""The router load-balancing loss of transformers' MoE hybrids under the long-context key and across ranks.

GraniteMoeHybrid, Qwen3.5-MoE and Qwen3-Next (``output_router_logits=True``; TRL turns it on when
``router_aux_loss_coef`` is set) add ``coef x aux`` to their loss, with (transformers' ``load_balancing_loss_func``;
sums over every layer's router rows, ``R`` of them)::

    aux = E x sum_e (C_e / R) (P_e / R)    C_e: top-k assignments to expert e (no gradient)
                                           P_e: softmax probabilities of expert e, summed over the rows

transformers collects each router's logits by a hook and computes ``aux`` from them. Under the key the routers
run without grad in forward (tiles, TiledMLP, the offloading checkpoint) and a tile's conv halo rows pass through
the router of its layer too: the value counts rows twice and carries no gradient. At ``sequence_parallel_size``
> 1 each rank holds a shard's rows only. C, P and R are sums over the rows, so here (``install``; for the
classes of ``ROUTER_LOSS_CLASSES``) a training call with ``output_router_logits``::

    forward   the model runs with output_router_logits=False (transformers computes no aux, records no logits);
              a hook on each router adds, once per row, C, P (values) and R of the rows it routes (a tile's halo
              rows excluded), in forward only (a recompute adds nothing) -> summed over the sequence-parallel
              group (one all-reduce of 2E + 1 numbers) -> aux, which the model's loss gets as transformers
              adds it (``coef x aux`` when it computes a loss) and ``aux_loss`` returns
    backward  aux's node runs before the last decoder layer's (it is an input of aux), and gives every rank
              dLoss/dP = (the group's sum of dLoss/daux) x E C / R^2; each router call that runs with a graph
              that is backpropagated (the forward's when it has one, a tile's or TiledMLP's or the offloading
              checkpoint's recompute) adds dLoss/dP's contribution to its logits' gradient, its halo rows
              excluded: the routers and every layer below them get the gradient of one process

The group's sum in backward makes the gradient right whatever weight each rank's loss gives aux, as long as the
weights sum to one over the group: the Trainer's sequence-parallel loss weights rank r's loss by its scored
tokens over the group's (accelerate.py); a hand-written loop adds ``coef x aux / sp`` on every rank. ``aux_loss``
is the group's value on every rank; ``router_logits`` is None in such a call (tiles hold a halo row twice).

A padding mask weights each row's C, P, R and gradient as transformers' does (a row of mask 0 is left out): the
forward keeps this rank's (batch, seqlen) mask, and a router call takes its rows of it from where it runs (a
tile's ``spans[k]``, its halo rows out; the chunk of a DeepSpeed TiledMLP tile, long_context.py's ``_MLP.part``;
else the whole shard). At sp > 1 the call drops a right-padding mask (accelerate.py's ``_before_call``), which
hands it over first (``hand_over``). Refused by name: a mask that is not (batch, seqlen) of the input, the losses
of two training forwards under the key backpropagated together (the recomputes would not know which forward's
gradient to add; one after the other, in any order, is right). Outside training, without grad, or without
output_router_logits, the model runs as transformers runs it. docs/huggingface.md, "Long context".
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["ROUTER_LOSS_CLASSES", "hand_over", "install", "installed"]

# The CausalLM classes whose router loss was read (class name -> (modeling module, router class name)).
ROUTER_LOSS_CLASSES = {
    "GraniteMoeHybridForCausalLM": (
        "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
        "GraniteMoeHybridTopKRouter",
    ),
    # the same load_balancing_loss_func (transformers 5.24), its router returning (logits, weights, index) too
    "Qwen3_5MoeForCausalLM": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTopKRouter"),
    # the same function again; its router normalises the top-k weights only when config.norm_topk_prob (the weights
    # pass through the hook unchanged: C, P and R read the logits alone)
    "Qwen3NextForCausalLM": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextTopKRouter"),
}
_ATTR = "_ds_mamba_spcp_router_loss"  # a model's _RouterLoss, in its __dict__


class _Pass:
    """One training forward's sums (this rank's rows) and, once its aux's backward ran, dLoss/dP."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None  # (2E + 1,) fp32: C, P, R
        self.anchor: torch.Tensor | None = None  # the last decoder layer's output (forward only)
        self.deferred = False  # rows routed without grad in forward: their gradient comes in a recompute
        self.grad: torch.Tensor | None = None  # dLoss/dP (E,), the group's sum
        self.injected = 0  # rows whose gradient a backpropagated router graph received
        self.rows = 0  # this rank's rows routed in forward
        self.mask: torch.Tensor | None = None  # (batch, seqlen) fp32 weights of this rank's rows, or None (all 1)


class _Inject(torch.autograd.Function):
    """weights -> weights; backward adds dLoss/dP's contribution to the router logits' gradient (halo rows out)."""

    @staticmethod
    def forward(ctx, state, fixed, nhalo, batch, rows_mask, weights, logits):
        ctx.state, ctx.fixed, ctx.nhalo, ctx.batch, ctx.rows_mask = state, fixed, nhalo, batch, rows_mask
        ctx.save_for_backward(logits)
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, dweights):
        (logits,) = ctx.saved_tensors
        p = ctx.fixed if ctx.fixed is not None else ctx.state.backward_pass
        if p is None or p.grad is None:
            raise RuntimeError(
                "router_loss: a router's recompute ran in backward before the router loss's gradient was known "
                "(the loss's aux node did not run first); this is a bug of ds_mamba_spcp, please report it."
            )
        probs = torch.softmax(logits.float(), dim=-1)
        g = p.grad.to(probs.dtype)
        dlogits = probs * (g - (probs * g).sum(-1, keepdim=True))
        rows = logits.shape[0]
        if ctx.nhalo:
            dlogits.view(ctx.batch, -1, logits.shape[-1])[:, : ctx.nhalo] = 0
            rows -= ctx.batch * ctx.nhalo
        if ctx.rows_mask is not None:  # dP sums the rows times their mask: a padded row gets no gradient
            own = dlogits.view(ctx.batch, -1, logits.shape[-1])[:, ctx.nhalo :]
            own.mul_(ctx.rows_mask.to(own.dtype).view(ctx.batch, -1, 1))
        p.injected += rows
        return None, None, None, None, None, dweights, dlogits.to(logits.dtype)


class _AuxLoss(torch.autograd.Function):
    """(anchor, sums) -> aux; backward: dLoss/dP for the routers' recomputes, nothing to the anchor (an input only
    so that this node runs before every layer's backward)."""

    @staticmethod
    def forward(ctx, state, p, experts, group, sums, anchor):
        C, P, R = sums[:experts], sums[experts : 2 * experts], sums[2 * experts]
        ctx.state, ctx.p, ctx.group, ctx.scale = state, p, group, experts * C / (R * R)
        # transformers' order: (C / R) * (P / R), summed, times E
        return torch.sum((C / R) * (P / R)) * experts

    @staticmethod
    def backward(ctx, grad):
        g = grad.float() * ctx.scale
        if ctx.group is not None:
            from ds_mamba_spcp.comm import all_reduce_sum

            g = all_reduce_sum(g, ctx.group)
        p, state = ctx.p, ctx.state
        other = state.backward_pass
        if other is not None and other is not p and (other.deferred or p.deferred):
            raise RuntimeError(
                "router_loss: the losses of two training forwards with output_router_logits are backpropagated "
                "together; under the long-context key the router loss's gradient reaches the routers in the layers' "
                "recompute, which cannot tell the two forwards apart. Backpropagate each forward's loss on its own."
            )
        p.grad, p.injected = g, 0
        state.backward_pass = p
        torch.autograd.Variable._execution_engine.queue_callback(lambda: state.end_backward(p))
        return None, None, None, None, None, None


class _RouterLoss:
    """What ``install`` keeps on a model (its ``__dict__``)."""

    def __init__(self, model: nn.Module, sharding) -> None:
        self.sharding = sharding  # adapter.py's _Sharding of a group of more than one rank, or None
        self.current: _Pass | None = None  # the forward in progress
        self.backward_pass: _Pass | None = None  # the pass whose backward runs (set by its aux's node)
        self.experts = int(model.num_experts)
        self.top_k = int(model.num_experts_per_tok)
        self.handed: torch.Tensor | None = None  # a padding mask the call's caller dropped (``hand_over``)

    def hand_over(self, mask: torch.Tensor) -> None:
        self.handed = mask

    # -- the model's forward ----------------------------------------------------------------------

    def before(self, model: nn.Module, args: tuple, kwargs: dict):
        # no backward runs now (a recompute calls the layers, not the model): a backward that raised is over
        self.current, self.backward_pass = None, None
        handed, self.handed = self.handed, None
        if not (model.training and torch.is_grad_enabled()):
            return None
        if args:  # every argument by name
            signature = inspect.signature(model.forward)
            bound, args = signature.bind(*args, **kwargs), ()
            kwargs = {}
            for name, value in bound.arguments.items():
                if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                    kwargs.update(value)
                else:
                    kwargs[name] = value
        asked = kwargs.get("output_router_logits")
        if asked is None:
            asked = getattr(model.config, "output_router_logits", False)
        if not asked:
            return None
        mask = kwargs.get("attention_mask")
        mask = handed if mask is None else mask
        self.current = _Pass()
        if torch.is_tensor(mask) and bool((mask == 0).any()):  # transformers weights each row by its mask
            tokens = kwargs.get("input_ids")
            tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
            if mask.dim() != 2 or not torch.is_tensor(tokens) or tuple(mask.shape) != tuple(tokens.shape[:2]):
                self.current = None
                got = tuple(mask.shape)
                raise NotImplementedError(
                    f"{type(model).__qualname__}: a padding mask of shape {got} and output_router_logits in training "
                    "under the long-context key or sequence parallelism: the router loss weights the rows by a 2-D "
                    "(batch, seqlen) mask of the input's shape, as transformers' does. Pass the collator's 2-D mask, "
                    "or set config.output_router_logits=False (TRL: router_aux_loss_coef=0.0)."
                )
            self.current.mask = mask.detach().float()
        wants_dict = kwargs.get("return_dict")
        self.wants_tuple = wants_dict is False or (wants_dict is None and not model.config.return_dict)
        return args, {**kwargs, "output_router_logits": False, "return_dict": True}

    def after(self, model: nn.Module, args: tuple, kwargs: dict, output):
        p, self.current = self.current, None
        if p is None:
            return None
        anchor, p.anchor = p.anchor, None
        if p.sums is None:  # no router ran
            return output.to_tuple() if self.wants_tuple else output
        group = None
        if self.sharding is not None and self.sharding.active():
            from ds_mamba_spcp.comm import all_reduce_sum

            group = self.sharding.group()
        sums = p.sums if group is None else all_reduce_sum(p.sums, group)
        if anchor is None:
            anchor = sums.new_zeros(())
        aux = _AuxLoss.apply(self, p, self.experts, group, sums, anchor)
        fields = {k: v for k, v in output.items() if k not in ("loss", "aux_loss", "router_logits")}
        loss = output.get("loss")
        if loss is not None:  # as transformers adds it
            loss = loss + model.router_aux_loss_coef * aux.to(loss.device)
        output = type(output)(loss=loss, aux_loss=aux, **fields)
        return output.to_tuple() if self.wants_tuple else output

    def end_backward(self, p: _Pass) -> None:
        if self.backward_pass is p:
            self.backward_pass = None
        if p.injected and p.injected != p.rows:
            raise RuntimeError(
                f"router_loss: the router loss's gradient reached {p.injected} router rows in backward, but the "
                f"forward routed {p.rows}; this is a bug of ds_mamba_spcp, please report it."
            )

    # -- the layers and routers -------------------------------------------------------------------

    def layer_output(self, layer, args, output):
        if self.current is not None:
            self.current.anchor = output[0] if isinstance(output, tuple) else output

    def router_output(self, adapter, router, args, output, part=None):
        logits, weights, index = output
        p = self.current
        nhalo, batch = 0, 1
        call = getattr(adapter, "tile", None) if adapter is not None else None
        span = None  # the (batch, seqlen) mask -> this call's rows (halo rows out)
        if call is not None:  # inside a tiled layer: (batch, halo rows + tile rows) flattened
            nhalo = call.tiles.halo_rows(call.k)
            s, e = call.tiles.spans[call.k]
            batch, rest = divmod(logits.shape[0], nhalo + e - s)
            if rest:
                raise RuntimeError(f"router_loss: {logits.shape[0]} router rows in a tile of {nhalo} + {e - s} rows")

            def span(mask, s=s, e=e):
                return mask[:, s:e]

        elif part is not None:  # a tile of DeepSpeed's TiledMLP (long_context.py's _MLP): the same chunks of the mask
            i, shards, seqwise = part

            def span(mask, i=i, shards=shards, seqwise=seqwise):
                return torch.chunk(mask, shards, dim=1)[i] if seqwise else torch.chunk(mask.reshape(-1), shards)[i]

        owner = p if p is not None else self.backward_pass
        rows_mask = None
        if owner is not None and owner.mask is not None:
            rows_mask = owner.mask.reshape(-1) if span is None else span(owner.mask).reshape(-1)
            if rows_mask.numel() != logits.shape[0] - batch * nhalo:
                raise RuntimeError(
                    f"router_loss: {logits.shape[0]} router rows ({batch} x {nhalo} halo rows) against "
                    f"{rows_mask.numel()} of the padding mask; this is a bug of ds_mamba_spcp, please report it."
                )
            rows_mask = rows_mask.to(logits.device)
        if p is not None:  # the forward: this call's rows, once
            with torch.no_grad():
                rows = logits.detach()
                if nhalo:
                    rows = rows.view(batch, -1, rows.shape[-1])[:, nhalo:].reshape(-1, rows.shape[-1])
                probs = torch.softmax(rows.float(), dim=-1)
                _, chosen = torch.topk(probs, self.top_k, dim=-1)
                counts = torch.zeros(self.experts, dtype=torch.float32, device=rows.device)
                if rows_mask is None:
                    counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=rows.device))
                    n = torch.tensor([rows.shape[0]], dtype=torch.float32, device=rows.device)
                    sums = torch.cat([counts, probs.sum(0), n])
                else:  # as transformers: each row's assignments, probabilities and count times its mask
                    counts.scatter_add_(0, chosen.reshape(-1), rows_mask.repeat_interleave(self.top_k))
                    sums = torch.cat([counts, (probs * rows_mask[:, None]).sum(0), rows_mask.sum().reshape(1)])
                p.sums = sums if p.sums is None else p.sums + sums
                p.rows += rows.shape[0]
            if not logits.requires_grad:
                p.deferred = True
        if not (logits.requires_grad and torch.is_grad_enabled()):
            return None
        if p is None and self.backward_pass is None:  # a call of a forward without the router loss
            return None
        return logits, _Inject.apply(self, p, nhalo, batch, rows_mask, weights, logits), index


def installed(model: nn.Module) -> bool:
    return any(_ATTR in m.__dict__ for m in model.modules())


def hand_over(model: nn.Module, mask: torch.Tensor) -> None:
    """Gives the router loss of ``model``'s next call the padding mask that its caller drops from that call
    (accelerate.py's ``_before_call``: right padding after the scored tokens at sequence_parallel_size > 1); this
    rank's shard of the rows, (batch, local seqlen)."""
    for m in model.modules():
        state = m.__dict__.get(_ATTR)
        if state is not None:
            state.hand_over(mask)


def install(model: nn.Module, sharding=None) -> bool:
    """Installs the router loss's sums on the modules of ``ROUTER_LOSS_CLASSES`` in ``model`` (its mixers already
    wrapped by adapter.py); ``sharding``: adapter.py's sharding of the sequence-parallel group, or None for a
    group of one. Installing again only sets a sharding given. Returns whether a module of those classes is
    held."""
    from ds_mamba_spcp.integrations.transformers.layers import adapters_in, decoder_layers

    found = False
    for lm in model.modules():
        spec = ROUTER_LOSS_CLASSES.get(type(lm).__name__)
        if spec is None or type(lm).__module__ != spec[0]:
            continue
        found = True
        state = lm.__dict__.get(_ATTR)
        if state is not None:
            if sharding is not None:
                state.sharding = sharding
            continue
        state = _RouterLoss(lm, sharding)
        lm.__dict__[_ATTR] = state
        lm.register_forward_pre_hook(state.before, with_kwargs=True)
        lm.register_forward_hook(state.after, with_kwargs=True)
        layers = decoder_layers(lm)
        if layers:
            layers[-1].register_forward_hook(state.layer_output)
        hooked = set()
        for layer in layers:
            adapters = adapters_in(layer)  # a tiled layer's mixer: its ``tile`` (layers.TileableMixer)
            adapter = adapters[0] if len(adapters) == 1 else None
            for m in layer.modules():
                if type(m).__name__ == spec[1]:
                    mlps = [a for a in layer.modules() if a is not m and any(c is m for c in a.modules())]
                    m.register_forward_hook(_RouterHook(state, adapter, mlps))
                    hooked.add(id(m))
        for m in lm.modules():
            if type(m).__name__ == spec[1] and id(m) not in hooked:
                m.register_forward_hook(_RouterHook(state, None, []))
    return found


class _RouterHook:
    """A router's forward hook: the state, the mixer adapter of its layer and the modules of the layer that hold the
    router (long_context.py's TiledMLP wrapper, ``_MLP``, may be one's forward; a copied model copies all)."""

    def __init__(self, state: _RouterLoss, adapter, holders: list) -> None:
        self.state, self.adapter, self.holders = state, adapter, holders

    def __call__(self, module, args, output):
        part = None
        for holder in self.holders:
            part = getattr(holder.__dict__.get("forward"), "part", None) or part
        return self.state.router_output(self.adapter, module, args, output, part)
