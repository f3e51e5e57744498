"""Cases of the gated delta-rule op (``ds_mamba_spcp.delta_op``) run inside the spawned groups of
tests/test_summary_exchange.py (one spawn per world size for both ops), and their references.

Each rank runs every case on its shard (fp64, the plain-PyTorch backend, chunks of 4 tokens so that the pieces
span several) and returns its shards of o and of the gradients; the test process assembles them and compares
with the per-token recurrence and with transformers' ``torch_chunk_gated_delta_rule`` on the whole sequence.
The upstream gradient of the final states is given on rank 0 only (zeros elsewhere): the copies' gradients must
add up over the group for the result to match.
"""

from __future__ import annotations

import types

import torch

K_DIM, V_DIM, PER_RANK = 4, 6, 8

# name -> (mode, load_balancing, summary_exchange, packed, init, final, grouped q/k heads, l2norm)
CASES = {
    "none_allgather_init_final": ("state_passing", "none", "allgather", False, True, True, False, True),
    "none_scan_packed_init_final": ("state_passing", "none", "scan", True, True, True, False, True),
    "virtual_allgather_packed_init_final_gqa": ("state_passing", "virtual", "allgather", True, True, True, True, True),
    "virtual_scan_init_final": ("state_passing", "virtual", "scan", False, True, True, False, False),
    "permute_p2p_allgather_packed_final": ("state_passing", "permute_p2p", "allgather", True, False, True, False, True),
    "permute_a2a_scan_init_final_gqa": ("state_passing", "permute_a2a", "scan", False, True, True, True, True),
    "ulysses_packed_init_final": ("ulysses", "none", "auto", True, True, True, False, True),
    "ulysses_zigzag_init": ("ulysses", "none", "auto", False, True, False, False, True),
    # a gate per key channel (Kimi's KDA, g (batch, T, H, K)): packed rows, zigzag shards, the head all-to-all
    "kda_none_scan_packed_init_final_gqa": ("state_passing", "none", "scan", True, True, True, True, True),
    "kda_permute_a2a_allgather_init_final": ("state_passing", "permute_a2a", "allgather", False, True, True, False,
                                             True),
    "kda_ulysses_packed_init_final": ("ulysses", "none", "auto", True, True, True, False, True),
    # negative control: the incoming state dropped (S_in = 0) must fail the same checks
    "bug_drop_incoming_state": ("state_passing", "none", "allgather", False, True, True, False, True),
}  # fmt: skip
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def cu_seqlens(world: int) -> list[int]:
    """Documents of a packed row of 8*world tokens: one of 3 tokens, one ending at a segment border (token 8,
    contiguous and zigzag), one of 1 token, one spanning ranks, one of 5."""
    T = PER_RANK * world
    return sorted({0, 3, 8, 9, T - 5, T})


def inputs(case: str, world: int):
    """The global inputs of a case, the same from one seed everywhere; and its upstream gradients."""
    mode, _, _, packed, init, _, gqa, l2 = CASES[case]
    heads = world if mode == "ulysses" else 2
    batch, T = (1, PER_RANK * world) if packed else (2, PER_RANK * world)
    n = len(cu_seqlens(world)) - 1 if packed else batch
    gen = torch.Generator().manual_seed(world * 100 + len(case))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    hk = heads // 2 if gqa else heads
    x = dict(q=r(batch, T, hk, K_DIM), k=r(batch, T, hk, K_DIM), v=r(batch, T, heads, V_DIM),
             g=-torch.rand(batch, T, heads, *([K_DIM] if case.startswith("kda") else []), generator=gen,
                           dtype=torch.float64),
             beta=torch.rand(batch, T, heads, generator=gen, dtype=torch.float64),
             initial_state=r(n, heads, K_DIM, V_DIM) if init else None)  # fmt: skip
    if not l2:  # unit keys keep (I - beta k k^T) a contraction without the kernel's normalisation
        x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)
    grads = dict(o=r(batch, T, heads, V_DIM), final=r(n, heads, K_DIM, V_DIM))
    return x, grads


def run_rank(rank: int, world: int) -> dict:
    """Every case on this rank: its shards of o and the gradients, and the final states."""
    from ds_mamba_spcp.delta_op import chunk_gated_delta_rule_sp
    from ds_mamba_spcp.engine import layout
    from ds_mamba_spcp.engine.strategies import delta as strategy
    from ds_mamba_spcp.ops import delta_reference

    delta_reference.CHUNK_SIZE = 4  # several chunks per piece (this spawned process only)
    out = {}
    for case, (mode, lb, method, packed, _, final, _, l2) in CASES.items():
        seq_layout = "zigzag" if lb != "none" or case == "ulysses_zigzag_init" else "contiguous"
        x, grads = inputs(case, world)
        shard = lambda t, seq_layout=seq_layout: layout.shard_sequence(t, rank, world, seq_layout)  # noqa: E731
        ins = {k: (shard(v) if k != "initial_state" else v).clone().requires_grad_()
               for k, v in x.items() if v is not None}  # fmt: skip
        cu = torch.tensor(cu_seqlens(world)) if packed else None
        real = strategy._make_exchange
        if case.startswith("bug"):
            strategy._make_exchange = lambda *a, real=real, **kw: _Dropping(real(*a, **kw))
        try:
            o, fin = chunk_gated_delta_rule_sp(
                ins["q"], ins["k"], ins["v"], ins["g"], ins["beta"], initial_state=ins.get("initial_state"),
                output_final_state=final, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, mode=mode, load_balancing=lb,
                input_layout=seq_layout, summary_exchange=method, backend="reference",
            )  # fmt: skip
            loss = (o * shard(grads["o"])).sum()
            if final:
                loss = loss + (fin * (grads["final"] if rank == 0 else torch.zeros_like(grads["final"]))).sum()
            loss.backward()
        finally:
            strategy._make_exchange = real
        # numpy arrays: pickled by value (a tensor would travel as a shared-memory handle the exiting rank closes)
        grads_out = {k: (torch.zeros_like(v) if v.grad is None else v.grad).numpy() for k, v in ins.items()}
        out[case] = dict(o=o.detach().numpy(), final=None if fin is None else fin.detach().numpy(), layout=seq_layout,
                         grads=grads_out)  # fmt: skip
    out["errors"] = _bad_calls(rank, world, chunk_gated_delta_rule_sp, layout)
    return out


def _bad_calls(rank, world, op, layout):
    """Calls the ranks disagree on, or that no rank can run: every rank raises the same kind of error (none hangs),
    and a good call after them runs."""
    x, _ = inputs("none_allgather_init_final", world)
    args = [layout.shard_sequence(x[k], rank, world, "contiguous") for k in NAMES[:5]]
    out = {}
    calls = {
        "options_differ": dict(output_final_state=rank == 0),
        "ulysses_heads": dict(mode="ulysses", input_layout="contiguous") if world > 2 else dict(scale=None, bad=True),
        "after": dict(),
    }
    for name, kw in calls.items():
        try:
            if kw.pop("bad", False):  # world 2 divides the 2 heads: a wrong-shaped initial state instead
                kw["initial_state"] = x["initial_state"][:1]
            op(*args, backend="reference", **kw)
            out[name] = "no error"
        except (ValueError, NotImplementedError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


class _Dropping:
    """An exchange whose forward hands every segment a zero incoming state (the negative control)."""

    def __init__(self, ex):
        self.ex = ex

    def post(self, U, M):
        got = self.ex.post(U, M).wait()
        self.log_a_all = self.ex.log_a_all
        return types.SimpleNamespace(wait=lambda: torch.zeros_like(got))

    def post_grad(self, L):
        return self.ex.post_grad(L)


def transformers_chunk_fp64():
    """transformers' ``torch_chunk_gated_delta_rule`` (models/qwen3_5) computing in fp64: it casts its inputs to
    ``torch.float32`` by that name, so it runs here with a module namespace whose float32 is float64 (its
    algorithm untouched), to compare at fp64's rounding."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as m

    return _fp64(m.torch_chunk_gated_delta_rule)


def transformers_kda_fp64():
    """transformers' ``recurrent_kimi_delta_attention`` (models/kimi_linear: the KDA recurrence, token by token) in
    fp64 as above, taking this package's arguments (chunk_size ignored; grouped q/k heads repeated to v's). Its
    chunked form casts its decay mask with ``.float()`` (fp32 whatever the namespace: 1.2e-8 off in fp64)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as m

    fn = _fp64(m.recurrent_kimi_delta_attention)

    def call(q, k, v, g, beta, chunk_size=None, **kw):
        q, k = (t.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for t in (q, k))
        return fn(q, k, v, g, beta, **kw)

    return call


def _fp64(fn):
    fn = getattr(fn, "__wrapped__", fn)

    class _Fp64Torch:
        def __getattr__(self, name):
            return torch.float64 if name == "float32" else getattr(torch, name)

    return types.FunctionType(fn.__code__, dict(fn.__globals__, torch=_Fp64Torch()), fn.__name__, fn.__defaults__)


def reference(case: str, world: int, which: str):
    """o, final states and the gradients of the whole sequence by ``which``: "recurrent" (this package's per-token
    recurrence) or "transformers" (run per document of a packed row, each from its initial state)."""
    from ds_mamba_spcp.ops.delta_reference import recurrent_gated_delta_rule

    _, _, _, packed, init, final, _, l2 = CASES[case]
    x, grads = inputs(case, world)
    ins = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    args = [ins[k] for k in NAMES[:5]]
    S0 = ins.get("initial_state")
    cu = cu_seqlens(world) if packed else None
    if which == "recurrent":
        o, fin = recurrent_gated_delta_rule(*args, initial_state=S0, output_final_state=True,
                                            cu_seqlens=None if cu is None else torch.tensor(cu),
                                            use_qk_l2norm_in_kernel=l2)  # fmt: skip
    else:
        hf = transformers_kda_fp64() if case.startswith("kda") else transformers_chunk_fp64()
        spans = [(0, args[0].shape[1])] if cu is None else list(zip(cu[:-1], cu[1:]))
        outs, fins = [], []
        for d, (a, b) in enumerate(spans):
            init_d = S0 if cu is None or S0 is None else S0[d : d + 1]
            o_d, f_d = hf(*[t[:, a:b] for t in args], chunk_size=4, initial_state=init_d, output_final_state=True,
                          use_qk_l2norm_in_kernel=l2)  # fmt: skip
            outs.append(o_d)
            fins.append(f_d)
        o, fin = torch.cat(outs, dim=1), torch.cat(fins)
    loss = (o * grads["o"]).sum() + ((fin * grads["final"]).sum() if final else 0)
    loss.backward()
    return dict(o=o.detach(), final=fin.detach(),
                grads={k: (torch.zeros_like(v) if v.grad is None else v.grad) for k, v in ins.items()})  # fmt: skip
