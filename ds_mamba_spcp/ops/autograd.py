"""What the package's autograd Functions share: their backward is first-order only.

The backwards run collectives and Triton kernels that build no graph, so with ``create_graph=True`` the op's
second-order terms would vanish silently (``once_differentiable`` raises only when the incoming gradient
requires grad). ``first_order_only`` raises as soon as a backward runs with grad mode on.
"""

from __future__ import annotations

import functools

import torch


def first_order_only(backward):
    """Decorator for an autograd Function's backward: computes it without grad, and raises a clear
    RuntimeError when called with ``create_graph=True``."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "ds_mamba_spcp: second-order gradients (backward with create_graph=True) are not supported by the "
                "sequence-parallel Mamba2 op: its backward runs collectives and kernels that record no graph. "
                "Compute the gradient penalty (or other higher-order term) without this op, or on a model whose "
                'Mamba2 layers are not sequence-parallel ("enabled": false).'
            )
        with torch.no_grad():
            return backward(ctx, *grads)

    return wrapper
