"""Backends of the mixer core: the plain-PyTorch reference and mamba-ssm's Triton kernels.

Each backend module exposes ``NAME``, ``segment_fwd`` / ``segment_bwd`` (one causal segment, the segment protocol
of ``segment.py``), ``single_device_op`` (the whole op on one device) and ``max_tokens_per_call``; ``segment_state``
(the state after a segment, differentiable: a tiled shard's backward pass 2) is optional. Production code picks one
here (``get_backend``) and imports neither directly.
"""

from __future__ import annotations

import warnings
from types import ModuleType

BACKENDS = ("auto", "reference", "triton")


def get_backend(name: str, device) -> ModuleType:
    """'auto' takes the Triton backend for CUDA tensors when it imports, else the reference."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "reference" or (name == "auto" and getattr(device, "type", device) != "cuda"):
        from ds_mamba_spcp.ops import reference

        return reference
    try:
        from ds_mamba_spcp.ops import triton as triton_backend
    except ImportError as e:
        if name == "triton":
            raise ImportError(f"the Triton backend needs mamba-ssm and causal-conv1d on CUDA: {e}") from e
        _warn_fallback(e)
        from ds_mamba_spcp.ops import reference

        return reference
    return triton_backend


_warned = False


def _warn_fallback(error: Exception) -> None:
    """CUDA tensors on the plain-PyTorch path are correct but slow: say so, once per process."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"ds_mamba_spcp: the Triton backend did not import ({error}); CUDA tensors run on the slow "
            "plain-PyTorch reference backend. Install mamba-ssm==2.3.2.post1 and causal-conv1d==1.7.0, or pass "
            "backend='reference' to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
