"""Backends of the gated delta-rule op: one function each, flash-linear-attention's ``chunk_gated_delta_rule``
contract (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel) ->
(o, final_state or None), differentiable by autograd.

    reference   ``delta_reference.chunk_gated_delta_rule``: plain PyTorch, any device, fp64-capable
    fla         flash-linear-attention's Triton kernel (fla-core 0.6.0), imported when first asked for.
                UNTESTED here: no GPU and no fla on the machines this was written on; the lead's GPU runs
                are its first. It passes the call through unchanged.
    auto        fla for CUDA tensors when it imports, else the reference (with a warning on CUDA)

The sharded op (``delta_op.py``) calls a backend on each rank's pieces as one packed row (``cu_seqlens``, batch 1)
with one initial state per piece; ``v`` and the state carry V + K columns there (``engine/strategies/delta.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

DELTA_BACKENDS = ("auto", "reference", "fla")


def _reference() -> Callable:
    from ds_mamba_spcp.ops.delta_reference import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _fla() -> Callable:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # fla-core, pinned 0.6.0 (requirements/gpu)

    def call(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             use_qk_l2norm_in_kernel=False):  # fmt: skip
        return chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip

    return call


_warned = False


def get_delta_backend(name: str, device) -> Callable:
    """The backend function for ``name`` and the activations' device (see the module docstring)."""
    global _warned
    if name not in DELTA_BACKENDS:
        raise ValueError(f"backend must be one of {DELTA_BACKENDS} for the delta-rule op, got {name!r}")
    on_cuda = getattr(device, "type", device) == "cuda"
    if name == "reference" or (name == "auto" and not on_cuda):
        return _reference()
    try:
        return _fla()
    except ImportError as e:
        if name == "fla":
            raise ImportError(
                f"backend='fla' needs flash-linear-attention (pip install fla-core==0.6.0) on CUDA: {e}; or pass "
                "backend='reference' (plain PyTorch, slow)"
            ) from e
        if not _warned:
            _warned = True
            warnings.warn(
                f"ds_mamba_spcp: flash-linear-attention did not import ({e}); the delta-rule op runs on the slow "
                "plain-PyTorch reference. Install fla-core==0.6.0, or pass backend='reference' to silence this.",
                RuntimeWarning,
                stacklevel=3,
            )
        return _reference()
