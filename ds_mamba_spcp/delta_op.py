"""The gated delta-rule op over a sequence-parallel group: flash-linear-attention's ``chunk_gated_delta_rule``
argument list plus this package's group keywords, in the modes of the Mamba2 op (docs/design.md, "The gated
delta rule").

chunk_gated_delta_rule_sp
    -> prepare            the arguments checked alike on every rank (one small all-gather of a descriptor)
    -> strategies.delta   state passing (the engine's chains and summary exchange, summary type MATRIX) or the
                          head all-to-all (ulysses)
    -> ops.delta          the kernel on each rank's pieces: the plain-PyTorch reference, or flash-linear-attention's
                          ``chunk_gated_delta_rule`` (g (batch, seqlen, H): a gate per head) or ``chunk_kda`` (g
                          (batch, seqlen, H, K): a gate per key channel, Kimi's KDA); "auto" takes fla on CUDA for both
"""

from __future__ import annotations

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import call as _call
from ds_mamba_spcp.engine import exchange, layout, modes
from ds_mamba_spcp.engine.strategies import delta as strategy
from ds_mamba_spcp.ops.delta import DELTA_BACKENDS, get_delta_backend


def _check(q, k, v, g, beta, initial_state, cu_seqlens, mode, load_balancing, input_layout, summary_exchange,
           backend, cp) -> tuple[modes.Entry, list | None]:  # fmt: skip
    kda = " (batch, seqlen, H): a scalar gate per head, or (batch, seqlen, H, K): a gate per key channel (KDA)"
    for name, t, dims in (("q", q, (4,)), ("k", k, (4,)), ("v", v, (4,)), ("g", g, (3, 4)), ("beta", beta, (3,))):
        if not torch.is_tensor(t) or t.dim() not in dims or not t.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be a floating tensor with {dims[0]} dims (batch, seqlen, heads, ...)"
                + (kda if name == "g" else "")
            )
    B, L, Hk, K = k.shape
    H, V = v.shape[2], v.shape[3]
    if tuple(q.shape) != tuple(k.shape):
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (B, L) or H % Hk:
        raise ValueError(
            f"v must be (batch, seqlen, H, V) like q's (batch, seqlen) = {(B, L)} with H a multiple of q/k's {Hk} "
            f"heads, got {tuple(v.shape)}"
        )
    if tuple(beta.shape) != (B, L, H):
        raise ValueError(f"beta must have shape (batch, seqlen, H) = {(B, L, H)}, got {tuple(beta.shape)}")
    if tuple(g.shape) not in ((B, L, H), (B, L, H, K)):
        raise ValueError(f"g must have shape {(B, L, H)} or {(B, L, H, K)}{kda}, got {tuple(g.shape)}")
    devices = {t.device for t in (q, k, v, g, beta)}
    if len(devices) > 1:
        raise ValueError(f"q, k, v, g, beta must be on one device, got {sorted(map(str, devices))}")
    if backend not in DELTA_BACKENDS:
        raise ValueError(f"backend must be one of {DELTA_BACKENDS}, got {backend!r}")
    if summary_exchange not in exchange.SUMMARY_EXCHANGES:
        raise ValueError(f"summary_exchange must be one of {exchange.SUMMARY_EXCHANGES}, got {summary_exchange!r}")
    entry = modes.entry(mode, load_balancing, input_layout)
    if summary_exchange == exchange.SCAN and entry.strategy != modes.STATE_PASSING:
        raise ValueError(
            f'summary_exchange="scan" with mode "{mode}": that mode exchanges no state summaries (it all-to-alls the '
            'tokens); use mode "state_passing" for the scan, or summary_exchange "auto".'
        )
    modes.check_shapes(entry, nheads=H, ngroups=1, cp=cp, local_seqlen=L, input_layout=input_layout)
    cu = None
    if cu_seqlens is not None:
        if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor of cumulative document lengths (0, ..., seqlen)")
        if B != 1:
            raise ValueError(f"cu_seqlens describes one packed row (batch 1), got batch {B}")
        cu = [int(c) for c in cu_seqlens.tolist()]
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != L * cp or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(
                f"cu_seqlens must rise strictly from 0 to the global seqlen {L * cp} (local seqlen {L} x {cp} ranks; "
                f"no empty documents: drop them), got {cu if len(cu) <= 12 else cu[:6] + ['...'] + cu[-6:]}"
            )
    n = B if cu is None else len(cu) - 1
    if initial_state is not None and tuple(initial_state.shape) != (n, H, K, V):
        raise ValueError(
            f"initial_state must have shape (N, H, K, V) = {(n, H, K, V)} (N: the batch, or the documents of "
            f"cu_seqlens), got {tuple(initial_state.shape)}"
        )
    return entry, cu


def _descriptor(q, v, g, initial_state, cu, options, scale, problem):
    dims = lambda t, n: (list(t.shape) + [-1] * n)[:n] if torch.is_tensor(t) else [-1] * n  # noqa: E731
    fields = [("problem", 0 if problem is None else _call._ERROR_CODES.get(type(problem), 1))]
    fields += list(zip(("batch", "local_seqlen", "k_heads", "K"), dims(q, 4)))
    fields += list(zip(("v_heads", "V"), dims(v, 4)[2:]))
    fields += [("dtype", comm.DTYPE_CODES.get(getattr(v, "dtype", None), 99))]
    fields += [("g.dims", g.dim() if torch.is_tensor(g) else -1)]
    fields += [("initial_state", initial_state is not None), ("scale", _call._float_code(float(scale or 0.0)))]
    fields += [("cu_seqlens.len", -1 if cu is None else len(cu)),
               ("cu_seqlens.sum", -1 if cu is None else sum(cu) & 0x3FFF_FFFF_FFFF)]  # fmt: skip
    fields += [(name, _call._option_code(value)) for name, value in options.items()]
    return [(name, int(value)) for name, value in fields]


def chunk_gated_delta_rule_sp(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    *,
    process_group=None,
    mode=modes.STATE_PASSING,
    load_balancing=modes.NONE,
    input_layout=None,
    summary_exchange="auto",
    backend="auto",
    check_shapes=True,
):
    """The gated delta rule on this rank's shard of a sequence (docs/design.md, "The gated delta rule").

    Arguments mean what they mean in flash-linear-attention's ``chunk_gated_delta_rule``:
        q, k: (batch, local_seqlen, Hk, K); v: (batch, local_seqlen, H, V), H a multiple of Hk (each query/key
            head serves H/Hk consecutive value heads); g: (batch, local_seqlen, H) log decays (<= 0); beta:
            (batch, local_seqlen, H); g may also be (batch, local_seqlen, H, K), a gate per key channel (Kimi's
            KDA: S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T; on fla it runs
            fla's ``chunk_kda``, a gate per head fla's ``chunk_gated_delta_rule``). This rank's shard in
            ``input_layout``.
        scale: q's scale (None: K ** -0.5). use_qk_l2norm_in_kernel: L2-normalise q and k first.
        initial_state: (N, H, K, V), the state before each sequence: N = batch, or the documents of cu_seqlens.
        cu_seqlens: the global row's cumulative document lengths (0, ..., global seqlen), the same 1-D tensor on
            every rank (batch 1); the state restarts at every document (from its initial_state row).
    Returns this rank's shard of o, (batch, local_seqlen, H, V) in v's dtype, and the final states (N, H, K, V),
    fp32 (fp64 for fp64 input), identical on every rank (None unless ``output_final_state``).

    Gradients: those of q, k, v, g, beta are this rank's shard's; a document's initial_state gradient lands on the
    rank where the document starts under state passing (on the rank of its heads under ulysses), zeros elsewhere:
    summed over the group, the full gradient. The gradients reaching the copies of the final states add up.

    process_group: the sequence-parallel group (None: the default world group; a process without deepspeed.comm is
    a group of one). mode: "state_passing" (per layer, each rank sends H x (K x K + K x V) fp32 per segment) or
    "ulysses" (the head all-to-all: needs H % cp == 0). load_balancing: "none" (contiguous shards), "virtual",
    "permute_p2p", "permute_a2a" (zigzag shards, as in the Mamba2 op). summary_exchange: "allgather", "scan" or
    "auto". backend: "auto" (flash-linear-attention on CUDA, else the plain-PyTorch reference; for both gate
    kinds), "reference", "fla" (``chunk_gated_delta_rule`` or ``chunk_kda`` by g's shape; both checked on
    one H100 at cp 2: tests/test_gpu_delta.py). check_shapes: compare the ranks' calls first, so that a mismatch raises
    on every rank instead of hanging.
    """
    rank, cp = comm.group_rank_size(process_group)
    if input_layout is None:
        input_layout = modes.default_layout(mode, load_balancing)
    options = dict(mode=mode, load_balancing=load_balancing, input_layout=input_layout,
                   summary_exchange=summary_exchange, backend=backend, output_final_state=bool(output_final_state),
                   use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel))  # fmt: skip
    problem, entry, cu = None, None, None
    try:
        entry, cu = _check(q, k, v, g, beta, initial_state, cu_seqlens, mode, load_balancing, input_layout,
                           summary_exchange, backend, cp)  # fmt: skip
    except (ValueError, NotImplementedError, TypeError) as e:
        problem = e
    if check_shapes and cp > 1:
        fields = _descriptor(q, v, g, initial_state, cu, options, scale, problem)
        rows = comm.gather_ints([v for _, v in fields], q.device, process_group, cp, width=len(fields) + 1)
        bad = [r for r, row in enumerate(rows) if row[0] != 0]
        if bad and problem is None:
            kind = _call._ERRORS.get(rows[bad[0]][0], ValueError)
            problem = kind(
                f"chunk_gated_delta_rule_sp: rank(s) {bad} of the sequence-parallel group rejected this call with a "
                f"{kind.__name__} (see their message); every rank raises it so that none is left waiting"
            )
        if problem is None:
            _call._compare(fields, rows, "chunk_gated_delta_rule_sp")
    if problem is not None:
        raise problem
    H, K = v.shape[2], k.shape[3]
    if q.shape[2] != H:  # grouped heads: each query/key head serves consecutive value heads
        q, k = (t.repeat_interleave(H // q.shape[2], dim=2) for t in (q, k))
    method = strategy.summary_exchange_of(summary_exchange, cp=cp, batch=v.shape[0], nheads=H, k_dim=K,
                                          v_dim=v.shape[3], chain=entry.chain or layout.LAYOUTS[0])  # fmt: skip
    dcall = strategy.DeltaCall(
        q=q, k=k, v=v, g=g, beta=beta, scale=K**-0.5 if scale is None else float(scale), initial_state=initial_state,
        output_final_state=bool(output_final_state), cu_seqlens=cu,
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        entry=entry, input_layout=input_layout, summary_exchange=method,
        backend=get_delta_backend(backend, v.device),  # a gate per key channel: fla's chunk_kda (ops/delta.py)
        group=process_group if cp > 1 else None, rank=rank, cp=cp,
    )  # fmt: skip
    if cp > 1 and entry.strategy == modes.ULYSSES:
        o, final = strategy.run_ulysses(dcall)
    else:
        o, final = strategy.run_state_passing(dcall)
    return o, (final if output_final_state else None)
