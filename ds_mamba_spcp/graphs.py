"""Opt-in CUDA-graph replay of the mixer core on one device (``cuda_graphs=True``; a group of one, whole or in tiles).

At short segments the op is host-bound (docs/host_time.md): the launches of mamba-ssm's ~25 kernels per
segment cost more CPU time than the GPU spends on them. With ``cuda_graphs`` the first call of a shape
captures its forward and its backward into two CUDA graphs, and every later call of that shape replays
them, so that a call costs two graph launches of host time and, at most, one copy of the inputs and one of
the output gradients:

    forward   replay the forward graph (an instance that reads the call's own tensors where they are; else
              copy the inputs into the static inputs of one that does not) -> the static output (no clone),
              the final states cloned
    backward  copy the output gradients into the static ones -> replay the backward graph
              -> the static zxbcdt gradient (no clone), the other gradients cloned

The key of a shape: every input's shape, strides, dtype and requires_grad, the device, the options and
whether grad is enabled. An *instance* (both graphs, their outputs, one private memory pool) serves one
call at a time: from its forward until its backward has run (or autograd has dropped the call's graph
without one) AND nobody holds what the call returned without a clone any more (the output and the
zxbcdt gradient, the large ones, are the instance's own buffers: the next replay overwrites them, so an
instance whose returned buffers are still referenced anywhere, by a view, an alias or a leaf's ``.grad``
that took one, is not reused; a later call of the shape captures another instance instead: a caller that
keeps them pays an instance per kept call, in memory). So calls of one shape whose backwards are
pending (the layers of a model) each take an instance of their own, captured on first use.

Inputs without copies: a new instance is captured reading the call's tensors at their addresses (it keeps
no reference to them, so the caching allocator can hand the same blocks to the next step's tensors), and is
replayed only for a call whose tensors sit at exactly those addresses (with the key's shapes, strides and
dtypes: the same bytes); the call's tensors are saved until its backward (which reads them again, from the
same addresses). A call whose tensors sit elsewhere, while such instances are free, takes an instance with
static inputs of its own (captured on first need) and pays the copy. The output gradients are always
copied (they come from the caller's backward; the backward graph is captured with the forward).

Each instance holds the whole working memory of one call (its pool), not only the activations eager mode
keeps between forward and backward: the mode suits few live calls per shape (a layer at a time under
activation checkpointing, inference, benchmarks); for a whole model, capture the whole step instead
(``benchmarks/bench_mixer.py --graphs``).

Replays compute exactly what eager calls compute (the same kernels on the same values, in the same
order; with MAMBA_DETERMINISTIC=1 bitwise equal, tests/test_gpu_graphs.py). Limits: a group of one on
CUDA only (refused otherwise, with the reason); one backward per forward (a second one, retain_graph,
raises: the captured backward frees the kept pre-gate output as it goes); the inputs' values may change
between calls, their shapes, strides and dtypes select the instance. What the multi-GPU path would need:
docs/host_time.md, "CUDA graphs".
"""

from __future__ import annotations

import gc

import torch

_INPUTS = ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "rmsnorm_weight", "initial_states",
           "seq_idx")  # fmt: skip
_CACHE: dict = {}


def clear() -> None:
    """Drops every captured graph (their memory pools return to the caching allocator)."""
    _CACHE.clear()


def captured_instances() -> int:
    """How many instances (static inputs and graphs) are held, over every shape."""
    return sum(len(entry) for entry in _CACHE.values())


def _describe(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)


def _addresses(tensors) -> tuple:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def _use_count(t) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Instance:
    """The forward (and backward) graph, their outputs and gradients, one private memory pool, and either the
    addresses the graphs read the inputs at (``in_place``) or static inputs of its own."""

    def __init__(self, call, strategy, needs_grad: bool, warm: bool, in_place: bool):
        self.busy, self.generation = False, 0
        tensors = [getattr(call, k) for k in _INPUTS]
        if in_place:  # aliases of the call's own tensors (fresh leaves), dropped after the capture
            inputs = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors]
        else:
            inputs = [None if t is None else _static_copy(t) for t in tensors]
        self.addresses = _addresses(tensors) if in_place else None
        static = call.replace(**dict(zip(_INPUTS, inputs)))
        self.diff = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad] if needs_grad else []
        pool = torch.cuda.graph_pool_handle()
        if not warm:  # JIT compilation, autotuning and the allocator's first blocks happen outside the capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._eager(static, strategy, inputs)
            torch.cuda.current_stream().wait_stream(side)
        self.fwd = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (NCCL's watchdog) must not invalidate the capture
        mode = "thread_local"
        with torch.set_grad_enabled(needs_grad), torch.cuda.graph(self.fwd, pool=pool, capture_error_mode=mode):
            res = strategy(static)
        del static
        self.outputs = tuple(res) if isinstance(res, tuple) else (res,)
        self.tuple_result = isinstance(res, tuple)
        del res
        self.bwd, self.grads = None, ()
        if self.diff:
            self.grad_outputs = [torch.empty_like(o) for o in self.outputs]
            self.bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.bwd, pool=pool, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(self.outputs, [inputs[i] for i in self.diff], self.grad_outputs,
                                            allow_unused=True)  # fmt: skip
            self.grads = grads
            self.outputs = tuple(o.detach() for o in self.outputs)  # the autograd graph is not needed any more
        # in place: no reference to the call's memory survives the capture (the next step's tensors may land there)
        self.inputs = None if in_place else inputs
        del inputs
        # the output and the zxbcdt gradient (the large ones) go out as the instance's own buffers, the small rest
        # (final states, parameter gradients: a parameter's .grad keeps what it is given) as clones
        self.grad_shared = [i == 0 for i in self.diff]
        self.returned = [self.outputs[0]] + [g for g, s in zip(self.grads, self.grad_shared) if s and g is not None]
        gc.collect()  # the capture's own cycles gone: what is left is the instance's
        self.own_refs = [_use_count(t) for t in self.returned]  # more later: a caller still holds a result

    def free(self) -> bool:
        """Not serving a call, and nothing it returned without a clone is referenced outside the instance."""
        return not self.busy and all(_use_count(t) <= n for t, n in zip(self.returned, self.own_refs))

    def reads_at(self, addresses) -> bool:
        """An instance in place reading its inputs at exactly ``addresses`` (the key fixed shapes and strides)."""
        return self.addresses is not None and self.addresses == addresses

    def take(self) -> int:
        self.busy, self.generation = True, self.generation + 1
        return self.generation

    def release(self, generation: int) -> None:
        """Frees the instance, unless a later call has taken it since ``generation``."""
        if self.generation == generation:
            self.busy = False

    def replay_forward(self, tensors) -> tuple:
        """The forward's outputs for ``tensors`` (aliases of the static outputs: no clone)."""
        if self.inputs is not None:
            _copy_in(self.inputs, tensors)
        self.fwd.replay()
        return (self.outputs[0].detach(),) + tuple(o.clone() for o in self.outputs[1:])

    def _eager(self, static, strategy, inputs):
        res = strategy(static)
        outs = tuple(res) if isinstance(res, tuple) else (res,)
        if self.diff:
            torch.autograd.grad(outs, [inputs[i] for i in self.diff], [torch.ones_like(o) for o in outs],
                                allow_unused=True)  # fmt: skip


def _copy_in(statics, tensors) -> None:
    for static, t in zip(statics, tensors):
        if static is not None:
            static.copy_(t)


def _static_copy(t):
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    s.copy_(t.detach())
    return s.requires_grad_(t.requires_grad)


class _Release:
    """Frees its call's instance when autograd drops the call's graph without a backward."""

    def __init__(self, inst, generation):
        self.inst, self.generation = inst, generation

    def __del__(self):
        self.inst.release(self.generation)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inst, generation, *tensors):
        outs = inst.replay_forward(tensors)
        # the backward graph reads the inputs again (an instance in place: at the call's own addresses); saved,
        # they stay alive until then, and autograd's version check refuses them modified in place meanwhile
        ctx.save_for_backward(*tensors)
        ctx.release, ctx.done = _Release(inst, generation), False
        return outs

    @staticmethod
    def backward(ctx, *grads):
        inst = ctx.release.inst
        if ctx.done:
            raise RuntimeError(
                "cuda_graphs=True replays one backward per forward (its captured backward frees what it used); a "
                "second backward through the same call (retain_graph=True) needs the op without cuda_graphs"
            )
        ctx.done = True
        ctx.saved_tensors  # noqa: B018 (the version check: an input modified in place since the forward raises)
        for static, g in zip(inst.grad_outputs, grads):
            static.copy_(g)
        inst.bwd.replay()
        out = [None] * len(_INPUTS)
        for i, g, shared in zip(inst.diff, inst.grads, inst.grad_shared):
            out[i] = None if g is None else g.detach() if shared else g.clone()
        inst.release(ctx.release.generation)  # what the forward left is used up: the next call may take it
        return (None, None, *out)


def _instance(entry, call, strategy, tensors, needs_grad):
    """A free instance of the shape that can serve ``tensors``: one reading them in place, else one with static
    inputs; captured when none is free (in place, unless free in-place instances read other addresses)."""
    addresses = _addresses(tensors)
    free = [i for i in entry if i.free()]
    inst = next((i for i in free if i.reads_at(addresses)), None)
    inst = inst or next((i for i in free if i.addresses is None), None)
    if inst is None:
        in_place = not any(i.addresses is not None for i in free)
        inst = _Instance(call, strategy, needs_grad, warm=bool(entry), in_place=in_place)
        entry.append(inst)
    return inst


def run(call, strategy):
    """``strategy(call)`` (a group of one's strategy on a prepared ``MixerCall``), replayed from CUDA graphs."""
    if torch.cuda.is_current_stream_capturing():
        return strategy(call)  # inside the caller's own capture (a whole step captured): nothing to add
    tensors = [getattr(call, k) for k in _INPUTS]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    key = (tuple(_describe(t) for t in tensors), call.zxbcdt.device, call.options, call.spec, needs_grad)
    inst = _instance(_CACHE.setdefault(key, []), call, strategy, tensors, needs_grad)
    generation = inst.take()
    if not needs_grad:
        outs = inst.replay_forward(tensors)
        inst.release(generation)  # free again once the caller drops the outputs
    else:
        outs = _Replay.apply(inst, generation, *tensors)
    return outs if inst.tuple_result else outs[0]
