"""Run the Triton backend's real kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1).

``install()`` must run in a fresh process before anything imports mamba-ssm's Triton modules or
``ds_mamba_spcp.ops.triton``: Triton reads TRITON_INTERPRET when a kernel is defined (``@triton.jit``)
and mamba-ssm picks its autotune configs when the module is imported (MAMBA_DETERMINISTIC=1 keeps one
config per kernel, so nothing is benchmarked). It then

- turns ``torch.cuda.device(index)`` into a no-op context and ``torch.cuda.get_device_properties``
  into fixed H200-like numbers (mamba-ssm wraps every launch in the former and sizes some grids
  with the latter's ``multi_processor_count``);
- replaces causal-conv1d's CUDA functions (``_upstream.causal_conv1d_functions``, called by
  ``ops/triton.py`` at import time) by plain-PyTorch stand-ins with the same signature, return
  values, layout checks and seq_idx semantics (causal-conv1d 1.7: initial_states rows count as the
  row's first document).

The SSD kernels, the gated RMSNorm kernels and all the glue of ``ops/triton.py`` then run for real;
only the depthwise conv is not causal-conv1d's own code.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import torch
import torch.nn.functional as F

SM_COUNT = 132  # an H200's multi_processor_count: the grids come out as they do on the GPU


def _check_layout(name, t, batch, dim, length):
    """causal-conv1d's CUDA kernels take channel-last (batch, dim, length) views: stride(1) == 1."""
    if tuple(t.shape) != (batch, dim, length):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {(batch, dim, length)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}: causal-conv1d needs the channel-last layout (stride(1) == 1), got {t.stride()}")


def _conv(x, weight, bias, initial_states, silu, seq_idx=None):
    """fp32 depthwise causal conv of (batch, dim, seqlen) continuing from initial_states (batch, dim, width-1).

    seq_idx (batch, seqlen): an output reads only inputs with its label; the initial_states rows carry the
    row's first label, a negative label gives output 0 (causal-conv1d 1.7's channel-last kernel).
    """
    width = weight.shape[-1]
    if initial_states is None:
        initial_states = x.new_zeros(x.shape[0], x.shape[1], width - 1)
    xpad = torch.cat([initial_states, x], dim=-1)
    if seq_idx is None:
        out = F.conv1d(xpad, weight.unsqueeze(1), bias, groups=x.shape[1])
    else:
        ids = seq_idx.long()
        ids_pad = torch.cat([ids[:, :1].expand(-1, width - 1), ids], dim=1)
        same = (ids_pad.unfold(1, width, 1) == ids[:, :, None]).to(x.dtype)  # [b, L, K]
        out = (xpad.unfold(2, width, 1) * same[:, None] * weight[None, :, None, :]).sum(-1)  # [b, d, L]
        if bias is not None:
            out = out + bias[None, :, None]
        out = out * (ids >= 0)[:, None, :].to(x.dtype)
    return F.silu(out) if silu else out


def _check_args(x, weight, seq_idx, initial_states, *unused):
    if any(t is not None for t in unused):
        raise NotImplementedError("stand-in: final states are not used by ops/triton.py")
    batch, dim, seqlen = x.shape
    if seq_idx is not None and (seq_idx.dtype != torch.int32 or tuple(seq_idx.shape) != (batch, seqlen)):
        raise ValueError(f"seq_idx: int32 (batch, seqlen) expected, got {seq_idx.dtype} {tuple(seq_idx.shape)}")
    _check_layout("x", x, batch, dim, seqlen)
    if initial_states is not None:
        _check_layout("initial_states", initial_states, batch, dim, weight.shape[-1] - 1)


def conv1d_fwd_function(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
    """Same call and result as ``causal_conv1d.cpp_functions.causal_conv1d_fwd_function``."""
    _check_args(x, weight, seq_idx, initial_states, final_states_out)
    f32 = torch.float32
    init = None if initial_states is None else initial_states.to(f32)
    bias32 = None if bias is None else bias.to(f32)
    out = torch.empty_like(x)  # channel-last like x, as the CUDA function allocates it
    out.copy_(_conv(x.to(f32), weight.to(f32), bias32, init, silu_activation, seq_idx))
    return out


def conv1d_bwd_function(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
                        silu_activation):  # fmt: skip
    """Same call and results as ``causal_conv1d.cpp_functions.causal_conv1d_bwd_function``:
    (dx written into ``dx`` when given, dweight, dbias, dinitial_states (batch, dim, width-1) or None)."""
    _check_args(x, weight, seq_idx, initial_states, dfinal_states)
    batch, dim, seqlen = x.shape
    _check_layout("dout", dout, batch, dim, seqlen)
    if dx is not None:
        _check_layout("dx", dx, batch, dim, seqlen)
    if return_dinitial_states and initial_states is None:
        raise ValueError("return_dinitial_states needs initial_states")
    width = weight.shape[-1]
    f32 = torch.float32
    init = None if initial_states is None else initial_states.to(f32)
    bias32 = None if bias is None else bias.to(f32)
    leaves = [x.to(f32), weight.to(f32), bias32, init if return_dinitial_states else None]
    leaves = [None if t is None else t.detach().requires_grad_() for t in leaves]
    with torch.enable_grad():
        out = _conv(
            leaves[0], leaves[1], leaves[2], leaves[3] if return_dinitial_states else init, silu_activation, seq_idx
        )
        grads = iter(torch.autograd.grad(out, [t for t in leaves if t is not None], dout.to(f32)))
    gx, gw, gb, ginit = (None if t is None else next(grads) for t in leaves)
    if dx is None:
        dx = torch.empty_like(x)
    dx.copy_(gx)
    dinit = None
    if return_dinitial_states:
        # the CUDA function's buffer: (batch, width-1, dim) transposed, so stride(1) == 1
        dinit = torch.empty(batch, width - 1, dim, dtype=x.dtype).transpose(1, 2)
        dinit.copy_(ginit)
    return dx, gw.type_as(weight), None if gb is None else gb.type_as(bias), dinit


class _NoDevice(contextlib.nullcontext):
    def __init__(self, device=None):
        super().__init__()


def _device_properties(device=None):
    return types.SimpleNamespace(name="triton-interpreter", multi_processor_count=SM_COUNT, total_memory=1 << 37)


def install():
    """Interpreter mode, deterministic configs, CUDA shims and the conv stand-in; see the module docstring."""
    from ds_mamba_spcp.ops.kernels.upstream import mamba_modules_loaded

    early = mamba_modules_loaded("mamba_ssm.ops.triton") + [m for m in sys.modules if m == "ds_mamba_spcp.ops.triton"]
    if early:
        raise RuntimeError(f"install() must run before these are imported: {early}")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["MAMBA_DETERMINISTIC"] = "1"
    torch.cuda.device = _NoDevice
    torch.cuda.get_device_properties = _device_properties

    from ds_mamba_spcp.ops.kernels import upstream as _upstream

    _upstream.causal_conv1d_functions = lambda: (conv1d_fwd_function, conv1d_bwd_function)
    from ds_mamba_spcp.ops import triton as triton_backend

    return triton_backend
