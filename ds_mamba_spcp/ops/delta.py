"""Backends of the gated delta-rule op: one function each, flash-linear-attention's ``chunk_gated_delta_rule``
contract (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel) ->
(o, final_state or None), differentiable by autograd. g is (B, T, H) (a scalar gate per head: GDN) or (B, T, H, K)
(a gate per key channel: Kimi's KDA), in log space; beta is already a sigmoid; states are K x V.

    reference   ``delta_reference.chunk_gated_delta_rule``: plain PyTorch, any device, fp64-capable, both gates
    fla         flash-linear-attention's Triton kernels (fla-core 0.6.0), imported when first asked for: a gate per
                head goes to ``chunk_gated_delta_rule``, a gate per key channel to ``chunk_kda``. Their contract,
                read in fla 0.6.0's ``fla/ops/gated_delta_rule/chunk.py``, ``fla/ops/kda/chunk.py`` and
                ``fla/ops/common/``: q, k (B, T, Hk, K), v (B, T, H, V) with H a multiple of Hk, V free (the op's
                V + K columns included: every kernel tiles V), K <= 256 (both assert it; refused here by name
                first); g in log space (any float dtype: its chunk cumsum is fp32); the final state is fp32 and so
                is the initial state's gradient; o comes back in q's dtype. ``chunk_gated_delta_rule`` reads an
                initial state of any float dtype as fp32; ``chunk_kda`` asserts fp32, so it gets ``.float()``.
                ``chunk_kda`` is called with its other flags at the values that mean what the reference computes:
                ``use_gate_in_kernel=False`` (g is the decay itself, already in log space, not the raw input of
                ``-exp(A_log) softplus(g + dt_bias)``), ``use_beta_sigmoid_in_kernel=False`` (beta is already a
                sigmoid; ``allow_neg_eigval`` stays False, as it must without it), ``safe_gate=False`` and
                ``lower_bound=None`` (no bound assumed on g), ``state_v_first=False`` (states K x V), ``chunk_size``
                64 (its default); fla's FlashKDA forward (``fla/ops/kda/backends/flash_kda.py``) declines such a
                call (it needs the gate and beta sigmoid in the kernel), so the Triton path runs.
                The call passes through unchanged. fla refuses the per-head gate's backward on Hopper with Triton
                >= 3.4 and < 3.7.1 (fla's issue 640: one miscompiled kernel, ``chunk_bwd_dqkwg``); there this
                package registers that one kernel (a Triton kernel of its own, ``ops/delta_dqkwg.py``) with fla's
                dispatch, so the backward runs on fla with it. Where that is switched off
                (``DS_MAMBA_SPCP_FLA_DQKWG=0``) a call that will need gradients is refused up front
                (``fla_backward_refusal``), so that no rank reaches the backward to fail there. A gate per key
                channel never reaches that kernel.
                Checked on one H100 (tests/test_gpu_delta.py, cp 2 and 4: both gates, forward and backward, the
                per-head gate's backward with the stand-in; benchmarks/results/delta_8033fb4_h100x1/).
    auto        fla for CUDA tensors when it imports, else the reference (with a warning on CUDA); also the
                reference (warned once) for a call needing gradients where fla's backward refuses, and for K > 256

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


def fla_backward_refusal(per_channel: bool = False) -> str | None:
    """Why fla's backward for this gate kind will refuse on this machine, or None if it runs.

    A gate per head (``chunk_gated_delta_rule``): fla 0.6.0's gated ``chunk_bwd_dqkwg`` (``fla/ops/common/chunk_o.py``)
    raises on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (wrong db and dg there, fla's issue 640) unless its
    TileLang backend (the ``tilelang`` package and a usable nvcc) takes the call. The same test, on fla's own flags;
    None where a flag is missing (another fla).

    Where fla would refuse, this package's stand-in for that one kernel (``ops/delta_dqkwg.py``, a Triton kernel
    with a PyTorch reference, registered with fla's dispatch) is installed and the answer is None; still refused where
    ``DS_MAMBA_SPCP_FLA_DQKWG=0`` or fla's dispatch is off (``FLA_DISABLE_BACKEND_DISPATCH=1``).

    A gate per key channel (``chunk_kda``, per_channel=True): None. fla 0.6.0's ``chunk_kda_bwd``
    (``fla/ops/kda/chunk_bwd.py``) runs ``chunk_gated_delta_rule_bwd_dhu`` (``fla/ops/common/chunk_delta_h.py``), its
    own ``chunk_kda_bwd_dAv``, ``chunk_kda_bwd_wy_dqkg_fused`` (TileLang's where it is usable, else Triton) and
    ``chunk_kda_bwd_intra`` (``fla/ops/kda/chunk_intra.py``): none of them is ``chunk_o``'s ``chunk_bwd_dqkwg``, and
    none refuses a Hopper/Triton pair (the only Hopper test on that path, in ``fla/ops/gla/chunk.py``, prunes tuning
    configs for ``state_v_first``, which is not used here)."""
    if per_channel:
        return None
    from ds_mamba_spcp.ops import delta_dqkwg

    if not delta_dqkwg.fla_refuses_here():
        return None
    try:
        from fla.ops.common.backends import CommonTileLangBackend

        if CommonTileLangBackend.is_available() and CommonTileLangBackend().is_enabled():
            return None
    except ImportError:
        pass
    if delta_dqkwg.install():  # the one refused kernel, through fla's own dispatch (ops/delta_dqkwg.py)
        return None
    import triton

    return (
        f"flash-linear-attention refuses the gated delta rule's backward on this Hopper GPU with Triton "
        f"{triton.__version__} (>= 3.4 and < 3.7.1 compute wrong db and dg there: fla's issue 640) unless TileLang "
        f"(the tilelang package and nvcc) is installed, and {delta_dqkwg.ENV}=0 switched off this package's "
        "stand-in for the refused kernel"
    )


FLA_MAX_K = 256  # fla 0.6.0 asserts K <= 256 in chunk_gated_delta_rule, chunk_kda and fla/ops/common/chunk_delta_h.py


def _needs_grad(*tensors) -> bool:
    import torch

    return torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in tensors)


def _fla(auto: bool = False) -> Callable:
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # fla-core, pinned 0.6.0 (requirements/gpu)
    from fla.ops.kda import chunk_kda

    refusals = {per_channel: fla_backward_refusal(per_channel) for per_channel in (False, True)}

    def call(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             use_qk_l2norm_in_kernel=False):  # fmt: skip
        per_channel, why, way_out = g.dim() == 4, None, ""
        if k.shape[-1] > FLA_MAX_K:
            why = f"flash-linear-attention's kernels take key heads of at most {FLA_MAX_K} channels, K = {k.shape[-1]}"
            way_out = "Pass backend='reference' (plain PyTorch, slow)."
        elif refusals[per_channel] is not None and _needs_grad(q, k, v, g, beta, initial_state):
            why = f"{refusals[per_channel]}; this call needs gradients"
            way_out = ("Install Triton >= 3.7.1 or tilelang, or leave DS_MAMBA_SPCP_FLA_DQKWG unset with fla 0.6.0, "
                       "or pass backend='reference' (plain PyTorch, slow) for training; calls without gradients "
                       "(torch.no_grad) run on fla.")  # fmt: skip
        if why is not None:
            if not auto:
                raise RuntimeError(f"backend='fla': {why}. {way_out}")
            _warn_once(f"{why}, so it runs on the slow plain-PyTorch reference. Pass backend='reference' to silence "
                       "this.")  # fmt: skip
            return _reference()(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)  # fmt: skip
        if per_channel:  # Kimi's KDA; the flags: the module docstring
            if initial_state is not None and initial_state.dtype != torch.float32:
                initial_state = initial_state.float()  # chunk_kda asserts an fp32 initial state
            return chunk_kda(
                q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, safe_gate=False, lower_bound=None, state_v_first=False,
            )  # fmt: skip
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
