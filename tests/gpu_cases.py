"""Inputs, error measures and a chained fp32 reference for the GPU suite and the int32 probe.

Nothing here imports the Triton backend at module level: a process that wants mamba-ssm's
deterministic mode must set MAMBA_DETERMINISTIC before the kernels are first imported.
"""

from __future__ import annotations

import math

import torch

# nheads, headdim, ngroups, dstate, d_conv, chunk_size of the benchmark (docs/benchmarks.md)
BENCH = dict(nheads=64, headdim=64, ngroups=8, dstate=128, d_conv=4, chunk=128)
# small and odd: headdim and dstate not powers of two, d_in_proj = 454 not a multiple of 8 (causal-conv1d
# then reads a contiguous copy of xBC), ngroups 2 for 6 heads, width-3 conv, 64-token chunks
SMALL = dict(nheads=6, headdim=24, ngroups=2, dstate=40, d_conv=3, chunk=64)


def spec_of(shape: dict, **options):
    from ds_mamba_spcp.ops.spec import CoreSpec

    return CoreSpec(
        nheads=shape["nheads"], headdim=shape["headdim"], ngroups=shape["ngroups"], dstate=shape["dstate"],
        d_conv=shape["d_conv"], chunk_size=shape["chunk"], **options,
    )  # fmt: skip


def make_inputs(shape: dict, batch: int, seqlen: int, *, seed: int, device, rms: bool, D2: bool = False,
                init: bool = False, final: bool = False, dtype=torch.bfloat16):  # fmt: skip
    """Global inputs and upstream gradients, the same on every rank (one seed, generated on the GPU).

    Distributions follow Mamba2's initialisation: A = -U(1, 16), dt_bias = softplus^-1 of a
    log-uniform dt in [1e-3, 1e-1] (so some heads remember ~1000 tokens and the state passing
    matters), conv weights U(+-1/sqrt(d_conv)). Activations, conv weights and rmsnorm_weight in
    ``dtype`` (bf16); dt_bias, A and D in fp32 (as Mamba2 keeps them).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    h, p, ng, n, K = (shape[k] for k in ("nheads", "headdim", "ngroups", "dstate", "d_conv"))
    d_inner = h * p
    conv_dim = d_inner + 2 * ng * n
    bf16, f32 = dtype, torch.float32

    def randn(*size, scale=1.0, dtype=bf16):
        return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

    def uniform(lo, hi, *size, dtype=f32):
        return (torch.rand(*size, generator=g, device=device) * (hi - lo) + lo).to(dtype)

    dt0 = torch.exp(uniform(math.log(1e-3), math.log(1e-1), h))
    t = dict(
        zxbcdt=randn(batch, seqlen, 2 * d_inner + 2 * ng * n + h),
        conv1d_weight=uniform(-(K**-0.5), K**-0.5, conv_dim, K, dtype=bf16),
        conv1d_bias=uniform(-(K**-0.5), K**-0.5, conv_dim, dtype=bf16),
        dt_bias=dt0 + torch.log(-torch.expm1(-dt0)),
        A=-uniform(1.0, 16.0, h),
        D=(1 + randn(h, p, scale=0.1, dtype=f32)) if D2 else (1 + randn(h, scale=0.1, dtype=f32)),
    )
    if rms:
        t["rmsnorm_weight"] = 1 + randn(d_inner, scale=0.1)
    if init:
        t["initial_states"] = randn(batch, h, p, n, scale=0.5, dtype=f32)
    grads = dict(out=randn(batch, seqlen, d_inner))
    if final:
        grads["final"] = randn(batch, h, p, n, dtype=f32)
    return t, grads


PARAMS = ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "rmsnorm_weight")


def _sq(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(||a - b||^2, ||b||^2) in fp64, over slices of dim 1 so that huge tensors need no fp64 copy."""
    a, b = a.detach(), b.detach()
    if a.dim() < 3:
        a, b = a.reshape(1, -1), b.reshape(1, -1)
    diff = norm = 0.0
    step = max(1, (1 << 26) // max(1, a[:, :1].numel()))
    for s in range(0, a.shape[1], step):
        x, y = a[:, s : s + step].double(), b[:, s : s + step].double()
        if not torch.isfinite(x).all():
            return float("inf"), 1.0
        diff += (x - y).square().sum().item()
        norm += y.square().sum().item()
    return diff, norm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| accumulated in fp64 (inf for non-finite a)."""
    diff, norm = _sq(a, b)
    return math.sqrt(diff / max(norm, 1e-300))


def sq_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[||a - b||^2, ||b||^2] as an fp64 tensor on a's device, for a sum over ranks."""
    return torch.tensor(_sq(a, b), dtype=torch.float64, device=a.device)


def block_errors(a: torch.Tensor, b: torch.Tensor, block: int) -> list[float]:
    """Relative error of every ``block`` tokens along dim 1 (a wrapped int32 offset corrupts a region)."""
    return [rel(a[:, s : s + block], b[:, s : s + block]) for s in range(0, a.shape[1], block)]


class _Fixed:
    """An exchange whose answers are known in advance (one device, segments run in causal order)."""

    def __init__(self, answer):
        self.answer = answer
        self.sent = None

    def post(self, S_ext, log_a):
        self.sent = (S_ext, log_a)
        return self

    def post_grad(self, L):
        self.sent = L
        return self

    def wait(self):
        return self.answer


@torch.no_grad()
def chained_reference(inputs: dict, grads: dict, spec, *, piece: int):
    """The fp32 reference backend over a long sequence, ``piece`` tokens at a time, on one device.

    Pieces are causal segments chained exactly as the sharded op chains them (conv halo, fp32
    state S_out = exp(log_a) S_in + S_ext forward, and the reverse chain of state gradients), so
    memory stays that of one piece. Returns (out, final_states, {name: gradient}) in fp32.
    """
    from ds_mamba_spcp.ops import reference
    from ds_mamba_spcp.ops.segment import drive_bwd, drive_fwd

    f32 = torch.float32
    zx = inputs["zxbcdt"].to(f32)
    params = [None if inputs.get(k) is None else inputs[k].to(f32) for k in PARAMS]
    dout = grads["out"].to(f32)
    batch, seqlen, _ = zx.shape
    K = spec.d_conv
    xbc = slice(spec.d_inner, spec.d_inner + spec.conv_dim)
    bounds = [(s, min(s + piece, seqlen)) for s in range(0, seqlen, piece)]
    if bounds[-1][1] - bounds[-1][0] < K - 1:
        raise ValueError("the last piece is shorter than the conv halo; choose another piece length")

    def halo_of(s):
        if s == 0:
            return zx.new_zeros(batch, K - 1, spec.conv_dim)
        return zx[:, s - (K - 1) : s, xbc]

    state = inputs.get("initial_states")
    state = zx.new_zeros(batch, spec.nheads, spec.headdim, spec.dstate) if state is None else state.to(f32)
    outs, S_ins, log_as = [], [], []
    for s, e in bounds:
        ex = _Fixed(state)
        out, _ = drive_fwd(reference.segment_fwd(zx[:, s:e], halo_of(s), params, spec=spec), ex.post)
        S_ext, log_a = ex.sent
        outs.append(out)
        S_ins.append(state)
        log_as.append(log_a)
        state = torch.exp(log_a)[:, :, None, None] * state + S_ext
    final = state

    dzx = torch.zeros_like(zx)
    dparams = [None if p is None else torch.zeros_like(p) for p in params]
    g = grads.get("final")
    g = torch.zeros_like(final) if g is None else g.to(f32)
    for k in reversed(range(len(bounds))):
        s, e = bounds[k]
        ex = _Fixed(g)
        gen = reference.segment_bwd(dout[:, s:e], zx[:, s:e], halo_of(s), params, S_ins[k], spec=spec)
        (dz, *dp), dhalo = drive_bwd(gen, ex.post_grad)
        dzx[:, s:e] += dz
        if s > 0:
            dzx[:, s - (K - 1) : s, xbc] += dhalo
        for acc, d in zip(dparams, dp):
            if acc is not None:
                acc += d
        g = ex.sent + torch.exp(log_as[k])[:, :, None, None] * g  # gradient reaching this piece's S_in
    out_grads = {"zxbcdt": dzx, **{k: d for k, d in zip(PARAMS, dparams) if d is not None}}
    if inputs.get("initial_states") is not None:
        out_grads["initial_states"] = g
    return torch.cat(outs, dim=1), final, out_grads
