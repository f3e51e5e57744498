"""The gated ``chunk_bwd_dqkwg`` that stands in for fla's refused kernel on Hopper (``ops/delta_dqkwg.py``): its Triton
kernel against its plain-PyTorch function, alone and inside fla's whole gated delta-rule forward + backward (issue 44).

    python3 benchmarks/bench_dqkwg.py --out /tmp/dqkwg.json          (one GPU; fla-core 0.6.0; writes .json + .md)
    python3 benchmarks/bench_dqkwg.py --device cpu --out /tmp/d.json (smoke: the PyTorch function alone, tiny)

One process, one GPU, no ranks: not a proxy of anything. Per length L (one packed row of two documents), median ms
of ``--iters`` (CUDA events) after ``--warmup`` calls (the first compiles and tunes):

    dqkwg_kernel       ops/delta_dqkwg_kernel.py on fla's inputs (bf16 q, k, v, do, dv, w, h, dh; fp32 g)
    dqkwg_pytorch      ops/delta_dqkwg.py's PyTorch function on the same
    dqkwg_fla          fla's own ``chunk_bwd_dqkwg``, where it runs; where fla refuses it (Hopper, Triton in
                       [3.4, 3.7.1)) its check is switched off for this cell alone: miscompiled values (fla's issue
                       640), time only
    layer_kernel       fla's ``chunk_gated_delta_rule`` forward + backward (q, k L2-normalised in the kernel) with
                       the stand-in's Triton kernel (``DS_MAMBA_SPCP_FLA_DQKWG=triton``)
    layer_pytorch      the same with ``DS_MAMBA_SPCP_FLA_DQKWG=torch`` (the PyTorch function)

Shapes: Qwen3.5's linear-attention heads (8 query/key heads serving 16 value heads, K = V = 128), as
tests/test_gpu_delta.py. ``--budget-s`` bounds the whole run; a cell past it is "skipped".
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import traceback
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_delta import measure_ms  # noqa: E402
from bench_mixer import _fmt_len, _parse_len, provenance, versions, write_json  # noqa: E402  (shared with bench_mixer)

from ds_mamba_spcp.ops import delta_dqkwg  # noqa: E402

SCHEMA = "ds_mamba_spcp.bench_dqkwg/1"
CELLS = ("dqkwg_kernel", "dqkwg_pytorch", "dqkwg_fla", "layer_kernel", "layer_pytorch")
BT = 64  # fla's chunk


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seqlens", default=None, help="lengths, e.g. 16K,64K (cuda) / 256 (cpu)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=120.0, help="seconds for every cell together")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=None, help="JSON path (a Markdown table is written beside it)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.seqlens = [_parse_len(s) for s in (args.seqlens or ("16K,64K" if cuda else "256")).split(",")]
    args.heads = (8, 16, 128) if cuda else (2, 4, 16)  # (q/k heads, value heads, K = V)
    if any(L % BT for L in args.seqlens):
        p.error(f"lengths must divide by {BT}")
    return args


def _dqkwg_inputs(L: int, heads, device, seed: int = 0):
    hk, hv, d = heads
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).bfloat16().to(device)  # noqa: E731
    cu = torch.tensor([0, L // 3 // BT * BT + 17, L], device=device)
    start, end = delta_dqkwg.chunk_bounds(1, L, BT, cu, device)
    raw = -0.05 * torch.rand(1, L, hv, generator=g)
    gate = torch.zeros(1, L, hv)
    for s, e in zip(start.tolist(), end.tolist()):  # fla's chunk-local cumulative gate, log2 units
        gate[:, s:e] = raw[:, s:e].cumsum(1) / math.log(2)
    n = start.numel()
    x = dict(q=r(1, L, hk, d), k=r(1, L, hk, d), v=r(1, L, hv, d), do=r(1, L, hv, d), h=r(1, n, hv, d, d),
             dh=r(1, n, hv, d, d), w=r(1, L, hv, d), dv=r(1, L, hv, d), g=gate.to(device))  # fmt: skip
    return x, cu


def _layer_inputs(L: int, heads, device, seed: int = 1):
    hk, hv, d = heads
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=r(1, L, hv, d).bfloat16(), k=r(1, L, hv, d).bfloat16(), v=r(1, L, hv, d).bfloat16(),
             g=-0.005 * torch.rand(1, L, hv, generator=g), beta=torch.sigmoid(r(1, L, hv)).bfloat16())  # fmt: skip
    return {k: v.to(device).requires_grad_() for k, v in x.items()}, r(1, L, hv, d).bfloat16().to(device)


def _time(fn, iters: int, warmup: int, cuda: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return measure_ms(fn, iters, cuda)


def _cell(name: str, L: int, args, device):
    """The function one cell times (None: not on this machine, with why)."""
    cuda = device.type == "cuda"
    if name.startswith("dqkwg"):
        x, cu = _dqkwg_inputs(L, args.heads, device)
        call = dict(w=x["w"], g=x["g"], dv=x["dv"], scale=args.heads[2] ** -0.5, cu_seqlens=cu, chunk_size=BT)
        ins = (x["q"], x["k"], x["v"], x["do"], x["h"], x["dh"])
        if name == "dqkwg_fla":
            if not cuda:
                return None, "needs CUDA and fla"
            import fla.ops.common.chunk_o as chunk_o

            def fla_own():
                real = chunk_o.TRITON_ABOVE_3_7_1
                chunk_o.TRITON_ABOVE_3_7_1 = True  # fla's check off where it refuses: time only
                try:
                    chunk_o.chunk_bwd_dqkwg(*ins, **call)
                finally:
                    chunk_o.TRITON_ABOVE_3_7_1 = real

            return fla_own, None
        if name == "dqkwg_kernel" and not cuda:
            return None, "needs CUDA"
        mode = "triton" if name == "dqkwg_kernel" else "torch"

        def ours():
            with mock.patch.dict(os.environ, {delta_dqkwg.ENV: mode}):
                delta_dqkwg.chunk_bwd_dqkwg(*ins, **call)

        return ours, None
    if not cuda:
        return None, "needs CUDA and fla"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from ds_mamba_spcp.ops.delta import fla_backward_refusal

    if fla_backward_refusal() is not None:
        return None, f"fla's backward refused: {fla_backward_refusal()}"
    x, do = _layer_inputs(L, args.heads, device)
    mode = "triton" if name == "layer_kernel" else "torch"

    def layer():
        with mock.patch.dict(os.environ, {delta_dqkwg.ENV: mode}):
            o, _ = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)
            o.backward(do)

    return layer, None


def run(args) -> list[dict]:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        from ds_mamba_spcp.ops.delta import fla_backward_refusal

        fla_backward_refusal()  # installs the stand-in where fla refuses its kernel
    deadline = time.time() + args.budget_s
    records = []
    for L in args.seqlens:
        for name in CELLS:
            rec = dict(seqlen=L, cell=name)
            if time.time() > deadline:
                records.append({**rec, "status": "skipped", "reason": "past --budget-s"})
                continue
            try:
                fn, why = _cell(name, L, args, device)
                if fn is None:
                    rec.update(status="n/a", reason=why)
                else:
                    times = _time(fn, args.iters, args.warmup, device.type == "cuda")
                    rec.update(status="ok", ms=statistics.median(times), times_ms=times)
            except torch.OutOfMemoryError as e:
                rec.update(status="oom", reason=str(e)[:300])
            except Exception as e:  # noqa: BLE001  (a cell's failure is recorded, the others still run)
                rec.update(
                    status="error", reason=f"{type(e).__name__}: {e}"[:500], trace=traceback.format_exc()[-2000:]
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"[bench_dqkwg] L={_fmt_len(L)} {name}: {rec['status']} {rec.get('ms', '')}", flush=True)
            records.append(rec)
    return records


def markdown(payload: dict) -> str:
    h = payload["header"]
    lines = [f"# bench_dqkwg, {h['hardware'].get('gpu_name') or h['hardware']['device']}, commit "
             f"{(h['git_commit'] or '?')[:9]}", "",
             f"Heads (q/k, v, K = V) {tuple(payload['config']['heads'])}; median ms of {payload['config']['iters']}.",
             "", "| L | " + " | ".join(CELLS) + " | pytorch / kernel (alone) | (in the layer) |",
             "|---|" + "---|" * (len(CELLS) + 2)]  # fmt: skip
    rows = {}
    for r in payload["records"]:
        rows.setdefault(r["seqlen"], {})[r["cell"]] = r
    ms = lambda r: f"{r['ms']:.2f}" if r and r["status"] == "ok" else (r["status"] if r else "-")  # noqa: E731
    for L, row in sorted(rows.items()):
        ratio = [(row.get(f"{p}_pytorch"), row.get(f"{p}_kernel")) for p in ("dqkwg", "layer")]
        ratio = [
            f"{a['ms'] / b['ms']:.1f}" if a and b and a["status"] == b["status"] == "ok" else "-" for a, b in ratio
        ]
        lines.append(
            f"| {_fmt_len(L)} | " + " | ".join(ms(row.get(c)) for c in CELLS) + " | " + " | ".join(ratio) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for the smoke run")
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"dqkwg_{args.device}.json")
    cuda = args.device == "cuda"
    header = dict(**provenance(args.git_commit),
                  hardware=dict(device=args.device, gpu_name=torch.cuda.get_device_name(0) if cuda else None,
                                cpu_count=os.cpu_count(), hostname=platform.node()),
                  versions=versions("triton", "fla-core"),
                  fla_refuses_its_kernel=delta_dqkwg.fla_refuses_here() if cuda else None)  # fmt: skip
    payload = dict(schema=SCHEMA, header=header,
                   config=dict(seqlens=args.seqlens, heads=list(args.heads), iters=args.iters, warmup=args.warmup,
                               budget_s=args.budget_s),
                   records=run(args))  # fmt: skip
    write_json(out, payload)
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown(payload))
    print(f"[bench_dqkwg] wrote {out} and {md}")
    return 1 if any(r["status"] == "error" for r in payload["records"]) else 0


if __name__ == "__main__":
    sys.exit(main())
