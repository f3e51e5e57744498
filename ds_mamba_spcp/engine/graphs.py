"""Opt-in CUDA-graph replay of the mixer core on one device (``cuda_graphs=True``; a group of one, whole or in tiles).

At short segments the op is host-bound (docs/host_time.md). The first call of a shape captures its forward
and backward into two CUDA graphs; later calls of that shape replay them:

    forward   copy the inputs into the instance's static inputs -> replay the forward graph
              -> the outputs, cloned (the next replay overwrites the static ones)
    backward  copy the output gradients into the static ones -> replay the backward graph
              -> the input gradients, cloned

The key of a shape: every input's shape, strides, dtype and requires_grad, the device, the options and the
grad mode. An *instance* (static inputs, both graphs, one private memory pool holding the call's whole working
memory) serves one call from its forward until its backward has run (or its graph was dropped), so calls of
one shape with pending backwards (a model's layers) each take their own: the mode suits few live calls per
shape; for a whole model, capture the whole step instead.

Replays compute what eager calls compute (bitwise with MAMBA_DETERMINISTIC=1). Limits: a group of one on CUDA
only; one backward per forward (a second raises: the captured backward frees the kept pre-gate output). The
multi-GPU path: docs/host_time.md, "What to use instead".
"""

from __future__ import annotations

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


class _Instance:
    """Static inputs, the forward (and backward) graph, their outputs and one private memory pool."""

    def __init__(self, call, strategy, needs_grad: bool, warm: bool):
        self.busy, self.generation = False, 0
        self.inputs = [None if t is None else _static_copy(t) for t in (getattr(call, k) for k in _INPUTS)]
        static = call.replace(**dict(zip(_INPUTS, self.inputs)))
        self.diff = [i for i, t in enumerate(self.inputs) if t is not None and t.requires_grad] if needs_grad else []
        pool = torch.cuda.graph_pool_handle()
        if not warm:  # JIT compilation, autotuning and the allocator's first blocks happen outside the capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._eager(static, strategy)
            torch.cuda.current_stream().wait_stream(side)
        self.fwd = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (NCCL's watchdog) must not invalidate the capture
        mode = "thread_local"
        with torch.set_grad_enabled(needs_grad), torch.cuda.graph(self.fwd, pool=pool, capture_error_mode=mode):
            res = strategy(static)
        self.outputs = tuple(res) if isinstance(res, tuple) else (res,)
        self.tuple_result = isinstance(res, tuple)
        self.bwd = None
        if self.diff:
            self.grad_outputs = [torch.empty_like(o) for o in self.outputs]
            self.bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.bwd, pool=pool, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(self.outputs, [self.inputs[i] for i in self.diff], self.grad_outputs,
                                            allow_unused=True)  # fmt: skip
            self.grads = grads
            self.outputs = tuple(o.detach() for o in self.outputs)  # the autograd graph is not needed any more

    def take(self) -> int:
        self.busy, self.generation = True, self.generation + 1
        return self.generation

    def replay(self, tensors) -> tuple:
        """The forward graph on ``tensors`` (copied into the static inputs); its outputs, cloned."""
        for static, t in zip(self.inputs, tensors):
            if static is not None:
                static.copy_(t)
        self.fwd.replay()
        return tuple(o.clone() for o in self.outputs)

    def release(self, generation: int) -> None:
        """Frees the instance, unless a later call has taken it since ``generation``."""
        if self.generation == generation:
            self.busy = False

    def _eager(self, static, strategy):
        res = strategy(static)
        outs = tuple(res) if isinstance(res, tuple) else (res,)
        if self.diff:
            torch.autograd.grad(outs, [self.inputs[i] for i in self.diff], [torch.ones_like(o) for o in outs],
                                allow_unused=True)  # fmt: skip


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
        outs = inst.replay(tensors)
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
        for static, g in zip(inst.grad_outputs, grads):
            static.copy_(g)
        inst.bwd.replay()
        out = [None] * len(_INPUTS)
        for i, g in zip(inst.diff, inst.grads):
            out[i] = None if g is None else g.clone()
        inst.release(ctx.release.generation)  # what the forward left is used up: the next call may take it
        return (None, None, *out)


def run(call, strategy):
    """``strategy(call)`` (a group of one's strategy on a prepared ``MixerCall``), replayed from CUDA graphs."""
    if torch.cuda.is_current_stream_capturing():
        return strategy(call)  # inside the caller's own capture (a whole step captured): nothing to add
    tensors = [getattr(call, k) for k in _INPUTS]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    key = (tuple(_describe(t) for t in tensors), call.zxbcdt.device, call.options, call.spec, needs_grad)
    entry = _CACHE.setdefault(key, [])
    inst = next((i for i in entry if not i.busy), None)
    if inst is None:
        inst = _Instance(call, strategy, needs_grad, warm=bool(entry))
        entry.append(inst)
    generation = inst.take()
    if not needs_grad:
        outs = inst.replay(tensors)
        inst.release(generation)
    else:
        outs = _Replay.apply(inst, generation, *tensors)
    return outs if inst.tuple_result else outs[0]
