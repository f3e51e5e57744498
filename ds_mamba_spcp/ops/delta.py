"""Backends of the gated delta-rule op: one function each, flash-linear-attention's ``chunk_gated_delta_rule``
contract (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel) ->
(o, final_state or None), differentiable by autograd.

    reference   ``delta_reference.chunk_gated_delta_rule``: plain PyTorch, any device, fp64-capable
    fla         flash-linear-attention's Triton kernel (fla-core 0.6.0), imported when first asked for. Its
                contract, read in fla 0.6.0's ``fla/ops/gated_delta_rule/chunk.py`` and ``fla/ops/common/``: q, k
                (B, T, Hk, K), v (B, T, H, V) with H a multiple of Hk, V free (the op's V + K columns included; K
                <= 256); g in log space (any float dtype: its chunk cumsum is fp32); an initial state of any float
                dtype (read as fp32); the final state is fp32 and so is the initial state's gradient; o comes back
                in q's dtype. The call passes through unchanged, except that a call that will need gradients is
                refused up front where fla's backward refuses (``fla_backward_refusal``: Hopper with Triton >= 3.4
                and < 3.7.1 and no TileLang, fla's issue 640), so that no rank reaches the backward to fail there.
                Not yet run on a GPU when written (tests/test_gpu_delta.py is its check).
    auto        fla for CUDA tensors when it imports, else the reference (with a warning on CUDA); also the
                reference (warned once) for a call needing gradients where fla's backward refuses
A gate per key channel (Kimi's KDA, g (B, T, H, K)) runs on the reference only: ``delta_op.py`` refuses it for
"fla" and resolves "auto" to the reference (fla's ``chunk_kda`` is another function, not wired or checked here).

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


def fla_backward_refusal() -> str | None:
    """Why fla's ``chunk_gated_delta_rule`` backward will refuse on this machine, or None if it runs.

    fla 0.6.0's gated ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``) raises on Hopper GPUs with Triton >= 3.4
    and < 3.7.1 (wrong db and dg there, fla's issue 640) unless its TileLang backend (the ``tilelang`` package and
    a usable nvcc) takes the call. The same test, on fla's own flags; None where a flag is missing (another fla)."""
    import importlib

    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    flags = ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")
    hopper, above_3_4, above_3_7_1 = (getattr(chunk_o, name, None) for name in flags)
    if not (hopper and above_3_4) or above_3_7_1 is None or above_3_7_1:
        return None
    try:
        from fla.ops.common.backends import CommonTileLangBackend

        if CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled():
            return None
    except ImportError:
        pass
    import triton

    return (
        f"flash-linear-attention refuses the gated delta rule's backward on this Hopper GPU with Triton "
        f"{triton.__version__} (>= 3.4 and < 3.7.1 compute wrong db and dg there: fla's issue 640) unless TileLang "
        "(the tilelang package and nvcc) is installed"
    )


def _needs_grad(*tensors) -> bool:
    import torch

    return torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in tensors)


def _fla(auto: bool = False) -> Callable:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # fla-core, pinned 0.6.0 (requirements/gpu)

    refusal = fla_backward_refusal()

    def call(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             use_qk_l2norm_in_kernel=False):  # fmt: skip
        if refusal is not None and _needs_grad(q, k, v, g, beta, initial_state):
            if not auto:
                raise RuntimeError(
                    f"backend='fla': {refusal}. Install Triton >= 3.7.1 or tilelang, or pass backend='reference' "
                    "(plain PyTorch, slow) for training; calls without gradients (torch.no_grad) run on fla."
                )
            _warn_once(f"{refusal}; this call needs gradients, so it runs on the slow plain-PyTorch reference. Pass "
                       "backend='reference' to silence this.")  # fmt: skip
            return _reference()(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # fmt: skip
        return chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip

    return call


_warned: set = set()


def _warn_once(message: str):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"ds_mamba_spcp: {message}", RuntimeWarning, stacklevel=4)


def get_delta_backend(name: str, device) -> Callable:
    """The backend function for ``name`` and the activations' device (see the module docstring)."""
    if name not in DELTA_BACKENDS:
        raise ValueError(f"backend must be one of {DELTA_BACKENDS} for the delta-rule op, got {name!r}")
    on_cuda = getattr(device, "type", device) == "cuda"
    if name == "reference" or (name == "auto" and not on_cuda):
        return _reference()
    try:
        return _fla(auto=name == "auto")
    except ImportError as e:
        if name == "fla":
            raise ImportError(
                f"backend='fla' needs flash-linear-attention (pip install fla-core==0.6.0) on CUDA: {e}; or pass "
                "backend='reference' (plain PyTorch, slow)"
            ) from e
        _warn_once(
            f"flash-linear-attention did not import ({e}); the delta-rule op runs on the slow plain-PyTorch "
            "reference. Install fla-core==0.6.0, or pass backend='reference' to silence this."
        )
        return _reference()
