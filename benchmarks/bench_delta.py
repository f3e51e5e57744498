"""The gated delta-rule op (``delta_op.chunk_gated_delta_rule_sp``) on one GPU, ranks sharing it: state passing
against the head all-to-all (ulysses) and against flash-linear-attention's kernel on one rank's shard alone (issue 44).

    python3 benchmarks/bench_delta.py --out /tmp/delta.json            (one GPU; fla-core 0.6.0; writes .json + .md)
    python3 benchmarks/bench_delta.py --device cpu --out /tmp/delta_cpu.json   (smoke: gloo, the reference, tiny)

A PROXY. The script spawns cp ranks per group size (``--cps``), every one on cuda:0 through gloo (docs/design.md,
"Traps"), so the ranks' kernels contend for the one GPU and every collective goes through the host: a rank's time is
about the whole group's GPU work plus host copies, not one GPU's share of a cp-GPU run. The columns compare under the
same contention; the ulysses column pays gloo's host-staged all-to-alls (the whole q, k, v, g, beta and o), which NCCL
on NVLink would not, so read ``ulysses_compute`` beside it. Per cell (global length L, cp), forward and
forward+backward, the rank-maximum of each rank's median of ``--iters`` (CUDA events):

    ideal            fla on this rank's shard alone: (1, L/cp) tokens, all heads, as one packed row from a zero
                     initial state, keeping its final state (the kernels' variant the op's pieces run, so that
                     the device stage's test has compiled and tuned them)
    state_passing    the op, contiguous shards, summary exchange "auto" (fla on V + K value columns, the exchange, the
                     correction; ``engine/strategies/delta.py``)
    ulysses          the op with mode "ulysses": all-to-all to (L, H/cp), fla, all-to-all back
    ulysses_compute  fla on (1, L) tokens and H/cp heads alone (ulysses' kernel without its all-to-alls)

Backward: fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (fla's issue 640; ``ops/delta.py``); there
``ops/delta_dqkwg.py`` stands in for the refused kernel, so the backward is timed as it trains. With that switched off
(``DS_MAMBA_SPCP_FLA_DQKWG=0``) the forward+backward columns are "refused" unless ``--time-refused-backward``: fla's
check is then switched off in the benchmark's processes only (``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1``) so its
kernels run and are timed; their db and dg values are wrong there (issue 640) and nothing reads them. The JSON's
config says which.

Shapes: Qwen3.5's linear-attention layer (16 heads, K = V = 128; bf16 q, k, v, beta, fp32 g, q and k L2-normalised in
the kernel). Budget: ``--budget-s`` seconds in all, shared evenly by the group sizes still to run; within one, length
by length, each length's forward cells then its forward+backward cells; a cell past its share is recorded "skipped".
On a fresh machine Triton's compilation and fla's autotuning (per head count and V) take most of the first cells'
time (one H100 at 8033fb4: 170 s went to the forward cells of two lengths and two group sizes, the pass order then
forward first for every length).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mixer import _fmt_len, _parse_len, provenance, spawned_ranks, versions, write_json  # noqa: E402  (shared with bench_mixer)

SCHEMA = "ds_mamba_spcp.bench_delta/1"
MODES = ("ideal", "state_passing", "ulysses", "ulysses_compute")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seqlens", default=None, help="global lengths, e.g. 32K,128K (cuda) / 512 (cpu)")
    p.add_argument("--cps", default="2,4", help="group sizes, each a fresh spawn of that many ranks")
    p.add_argument("--heads", type=int, default=None, help="value (and query/key) heads: 16 (cuda), 4 (cpu)")
    p.add_argument("--head-dim", type=int, default=None, help="K = V: 128 (cuda), 16 (cpu)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--passes", default="forward,forward_backward")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=80.0, help="seconds for every cell together")
    p.add_argument(
        "--time-refused-backward",
        action="store_true",
        help="time fla's backward where it refuses (Hopper, Triton < 3.7.1): wrong values, timing only",
    )
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=None, help="JSON path (a Markdown table is written beside it)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.seqlens = [_parse_len(s) for s in (args.seqlens or ("32K,128K" if cuda else "512")).split(",")]
    args.cps = [int(c) for c in args.cps.split(",")]
    args.heads = args.heads or (16 if cuda else 4)
    args.head_dim = args.head_dim or (128 if cuda else 16)
    args.modes = [m for m in args.modes.split(",") if m]
    args.passes = [m for m in args.passes.split(",") if m]
    if not set(args.passes) <= {"forward", "forward_backward"}:
        p.error(f"--passes takes forward and/or forward_backward, got {args.passes}")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {MODES}")
    for L in args.seqlens:
        for cp in args.cps:
            if L % cp or args.heads % cp:
                p.error(f"length {L} and heads {args.heads} must divide by cp {cp}")
    return args


# -- one rank ---------------------------------------------------------------------------------------------------


def _inputs(tokens: int, heads: int, dim: int, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=r(1, tokens, heads, dim).bfloat16(), k=r(1, tokens, heads, dim).bfloat16(),
             v=r(1, tokens, heads, dim).bfloat16(), g=-0.005 * torch.rand(1, tokens, heads, generator=g),
             beta=torch.sigmoid(r(1, tokens, heads)).bfloat16())  # fmt: skip
    return {k: v.to(device).requires_grad_() for k, v in x.items()}


def _step(mode: str, L: int, cp: int, args, device, backend: str):
    """(forward, forward+backward) closures of one mode on this rank."""
    from ds_mamba_spcp.delta_op import chunk_gated_delta_rule_sp
    from ds_mamba_spcp.ops.delta import get_delta_backend

    rank = torch.distributed.get_rank()
    H, D = args.heads, args.head_dim
    if mode == "ideal":
        x = _inputs(L // cp, H, D, device, rank)
    elif mode == "ulysses_compute":
        x = _inputs(L, H // cp, D, device, rank)
    else:
        x = _inputs(L // cp, H, D, device, rank)
    do = torch.randn(x["v"].shape, device=device, dtype=x["v"].dtype)
    names = ("q", "k", "v", "g", "beta")

    if mode in ("ideal", "ulysses_compute"):
        fn = get_delta_backend(backend, device)
        kw = dict(use_qk_l2norm_in_kernel=True)
        if mode == "ideal":
            tokens = x["v"].shape[1]
            kw.update(cu_seqlens=torch.tensor([0, tokens], device=device), output_final_state=True,
                      initial_state=torch.zeros(1, H, D, D, device=device))  # fmt: skip

        def run():
            return fn(*[x[n] for n in names], **kw)[0]
    else:
        sp_mode = "ulysses" if mode == "ulysses" else "state_passing"

        def run():
            return chunk_gated_delta_rule_sp(*[x[n] for n in names], use_qk_l2norm_in_kernel=True, mode=sp_mode,
                                             backend=backend)[0]  # fmt: skip

    def forward():
        with torch.no_grad():
            run()

    def forward_backward():
        o = run()
        torch.autograd.grad(o, [x[n] for n in names], do)

    return forward, forward_backward


def _time(fn, iters: int, warmup: int, cuda: bool) -> list[float]:
    """Per-iteration ms after the warm-ups (the first compiles and autotunes); fewer iterations (2 at least, the
    same on every rank: the steps hold collectives) where a warmed-up step takes over half a second."""
    for i in range(warmup):
        if i == warmup - 1:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        fn()
    if cuda:
        torch.cuda.synchronize()
    if warmup:
        step_s = _rank_max(time.perf_counter() - t0)
        iters = max(2, min(iters, int(2.5 / max(step_s, 1e-6))))
    torch.distributed.barrier()
    return measure_ms(fn, iters, cuda)


def measure_ms(fn, iters: int, cuda: bool) -> list[float]:
    """Each of ``iters`` calls' milliseconds: CUDA events on a GPU, the wall clock on a CPU."""
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _rank_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _agree(ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def _group(rank: int, cp: int, args, deadline: float) -> list[dict]:
    """Every (length, mode, pass) cell of one group size on this rank; rank 0's records are returned."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "fla" if cuda else "reference"
    refusal = None
    if cuda:
        from ds_mamba_spcp.ops.delta import fla_backward_refusal

        refusal = fla_backward_refusal()
        if refusal is not None and args.time_refused_backward:
            import importlib

            importlib.import_module("fla.ops.common.chunk_o").TRITON_ABOVE_3_7_1 = True  # timing only: see docstring
    records = []
    for L in args.seqlens:  # each length's passes together: a short budget still times both at the first length
        for pass_name in args.passes:
            for mode in args.modes:
                rec = dict(seqlen=L, cp=cp, mode=mode, pass_=pass_name, status="ok")
                records.append(rec)
                if not _agree(time.time() < deadline):
                    rec.update(status="skipped", reason=f"past --budget-s {args.budget_s:.0f}")
                    continue
                if pass_name == "forward_backward" and refusal is not None and not args.time_refused_backward:
                    rec.update(status="refused", reason=refusal)
                    continue
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    fwd, fwd_bwd = _step(mode, L, cp, args, device, backend)
                    times = _time(fwd if pass_name == "forward" else fwd_bwd, args.iters, args.warmup, cuda)
                    ok, err = True, None
                except Exception as e:  # noqa: BLE001 - recorded; every rank agrees before going on
                    ok, err = False, f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                if not _agree(ok):
                    rec.update(status="error", reason=err or "another rank failed")
                    continue
                rec.update(ms=_rank_max(statistics.median(times)), ms_min=_rank_max(min(times)), iters=len(times),
                           peak_gib=_rank_max(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0))  # fmt: skip
                if refusal is not None and pass_name == "forward_backward":
                    rec["note"] = "fla's backward check bypassed (issue 640): timing only"
                if rank == 0:
                    print(f"[bench_delta] L={_fmt_len(L)} cp={cp} {mode:<16} {pass_name:<17} {rec['ms']:9.2f} ms "
                          f"peak {rec['peak_gib']:.2f} GiB", flush=True)  # fmt: skip
    return records if rank == 0 else []


def _worker(rank, port, queue, cp, args, deadline):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK="0")  # fmt: skip
    torch.set_num_threads(1)
    try:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        import deepspeed.comm as dist

        dist.init_distributed(dist_backend="gloo", verbose=False)
        records = _group(rank, cp, args, deadline)
        dist.barrier()
        queue.put((rank, "ok", records))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))


def _spawn(cp: int, args, deadline: float) -> list[dict]:
    records = []

    def on_message(message):
        rank, status, payload = message
        if status != "ok":
            return "error", f"rank {rank}:\n{payload}"
        records.extend(payload)
        return "done", rank

    # a rank stuck in a collective: give up past the budget plus two minutes
    error = spawned_ranks(_worker, cp, (cp, args, deadline), deadline + 120, on_message)
    if error is not None:
        print(f"[bench_delta] cp={cp} failed: {error}", flush=True)
        records.append(dict(cp=cp, status="error", reason=error[-2000:]))
    return records


# -- output -----------------------------------------------------------------------------------------------------


def header(args) -> dict:
    cuda = args.device == "cuda"
    return dict(
        **provenance(args.git_commit),
        hardware=dict(
            device=args.device,
            gpu_name=torch.cuda.get_device_name(0) if cuda else None,
            cpu_count=os.cpu_count(),
            hostname=platform.node(),
        ),
        versions=versions("triton", "fla-core", "deepspeed"),
        proxy=(
            "every rank on one GPU through gloo: ranks contend for the GPU, collectives go through the host"
            if cuda
            else "a CPU smoke run (gloo, the plain-PyTorch reference): times mean nothing"
        ),
    )


def markdown(payload: dict) -> str:
    cfg = payload["config"]
    h = payload["header"]
    lines = [
        f"# bench_delta: gated delta rule, {h['hardware'].get('gpu_name') or h['hardware']['device']}, commit "
        f"{(h['git_commit'] or '?')[:9]}",
        "",
        f"PROXY: {h['proxy']}. Heads {cfg['heads']}, K = V = {cfg['head_dim']}; median ms of {cfg['iters']} "
        f"(rank maximum). Backward: {cfg['backward']}.",
        "",
        "| L | cp | pass | " + " | ".join(cfg["modes"]) + " | state_passing / ideal | ulysses / ideal |",
        "|---|---|---|" + "---|" * len(cfg["modes"]) + "---|---|",
    ]
    cells = {}
    for r in payload["records"]:
        if "mode" in r:
            cells.setdefault((r["seqlen"], r["cp"], r["pass_"]), {})[r["mode"]] = r
    for (L, cp, pass_name), row in sorted(cells.items()):
        tds = ["-" if row.get(m) is None else f"{row[m]['ms']:.2f}" if row[m]["status"] == "ok" else row[m]["status"]
               for m in cfg["modes"]]  # fmt: skip
        ratios = [_ratio(row.get(m), row.get("ideal")) for m in ("state_passing", "ulysses")]
        lines.append(f"| {_fmt_len(L)} | {cp} | {pass_name} | " + " | ".join(tds + ratios) + " |")
    failed = [r for r in payload["records"] if r["status"] in ("error", "refused")]
    if failed:
        lines += ["", "Not timed:"] + sorted({f"- {r['status']}: {r.get('reason', '')[:300]}" for r in failed})
    return "\n".join(lines) + "\n"


def _ratio(a, b) -> str:
    ok = a and b and a["status"] == b["status"] == "ok"
    return f"{a['ms'] / b['ms']:.2f}" if ok else "-"


def write(payload: dict, out: str):
    write_json(out, payload)
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown(payload))
    return md


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for the smoke run")
    deadline = time.time() + args.budget_s
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"delta_{args.device}.json")
    backward = "fla"
    if args.device == "cpu":
        backward = "the plain-PyTorch reference (smoke run)"
    else:
        from ds_mamba_spcp.ops import delta_dqkwg
        from ds_mamba_spcp.ops.delta import fla_backward_refusal

        refusal = fla_backward_refusal()
        if refusal is not None:
            backward = ("fla with its check bypassed, timing only (values wrong: fla issue 640)"
                        if args.time_refused_backward else f"refused ({refusal})")  # fmt: skip
        elif delta_dqkwg.installed():
            how = {"torch": "its PyTorch function", "triton": "its Triton kernel"}[delta_dqkwg.implementation()]
            backward = f"fla, its refused chunk_bwd_dqkwg replaced by ops/delta_dqkwg.py ({how})"
    payload = dict(schema=SCHEMA, header=header(args),
                   config=dict(seqlens=args.seqlens, cps=args.cps, heads=args.heads, head_dim=args.head_dim,
                               modes=args.modes, iters=args.iters, warmup=args.warmup, budget_s=args.budget_s,
                               backward=backward, shared_gpu=True),
                   records=[])  # fmt: skip
    for i, cp in enumerate(args.cps):
        share = (deadline - time.time()) / (len(args.cps) - i)
        payload["records"] += _spawn(cp, args, time.time() + share)
        write(payload, out)
    md = write(payload, out)
    print(f"[bench_delta] wrote {out} and {md}")
    bad = [r for r in payload["records"] if r["status"] == "error"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
