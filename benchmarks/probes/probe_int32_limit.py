"""Where do mamba-ssm 2.3.2's Triton kernels stop matching the fp32 reference? (mamba-ssm issue #1015)

For each length, upstream's ``mamba_split_conv1d_scan_combined`` runs forward and backward once
(bf16, the benchmark shape of docs/benchmarks.md with the gated RMSNorm, batch 1) and is compared
with the reference backend in fp32, chained over 16384-token pieces (``tests/gpu_cases.py``):
the relative error of the worst 1/16 of the sequence for out and dzxbcdt (a wrapped offset
corrupts a region, which a global norm would dilute) and of every parameter's gradient. Each
length runs in its own process (an overflow can end in an illegal memory access, which poisons
the CUDA context), spread over the visible GPUs.

    python benchmarks/probes/probe_int32_limit.py --lengths 65536,208384,208512,212992,262144 --out probe.json

A length "matches" when every error is under 2e-2 (bf16 against fp32 sits near 5e-3; a corrupted
region is O(1)). ``guard_refuses`` says whether ``ops/triton.py``'s int32 guard would refuse it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

MATCH = 2e-2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(seqlen: int) -> dict:
    import torch

    sys.path.insert(0, REPO)
    from ds_mamba_spcp.ops import triton as triton_backend
    from ds_mamba_spcp.ops.kernels import upstream as _upstream
    from tests.gpu_cases import BENCH, PARAMS, block_errors, chained_reference, make_inputs, rel, spec_of

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = spec_of(BENCH)
    res = {
        "seqlen": seqlen,
        "zxbcdt_numel": seqlen * spec.d_in_proj,
        "guard_refuses": triton_backend.largest_numel(1, seqlen, spec) >= triton_backend.INT32_LIMIT,
    }
    combined = _upstream.mamba_module("ops.triton.ssd_combined")
    inputs, grads = make_inputs(BENCH, 1, seqlen, seed=1, device="cuda", rms=True)
    t0 = time.time()
    try:
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        out = combined.mamba_split_conv1d_scan_combined(
            leaves["zxbcdt"], leaves["conv1d_weight"], leaves["conv1d_bias"], leaves["dt_bias"], leaves["A"],
            leaves["D"], BENCH["chunk"], headdim=BENCH["headdim"], ngroups=BENCH["ngroups"],
            rmsnorm_weight=leaves["rmsnorm_weight"], norm_before_gate=False,
        )  # fmt: skip
        (out.float() * grads["out"].float()).sum().backward()
        torch.cuda.synchronize()
        res["peak_gib_upstream"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception:  # noqa: BLE001 - an illegal memory access is a result here
        res["status"] = "crash"
        res["error"] = traceback.format_exc().strip().splitlines()[-1]
        return res
    ref_out, _, ref_grads = chained_reference(inputs, grads, spec, piece=16384)
    block = seqlen // 16
    res["out_worst_block"] = max(block_errors(out.detach(), ref_out, block))
    res["dzxbcdt_worst_block"] = max(block_errors(leaves["zxbcdt"].grad, ref_grads["zxbcdt"], block))
    res["out"], res["dzxbcdt"] = rel(out, ref_out), rel(leaves["zxbcdt"].grad, ref_grads["zxbcdt"])
    for k in PARAMS:
        res["d" + k] = rel(leaves[k].grad, ref_grads[k])
    errors = [v for k, v in res.items() if k in ("out_worst_block", "dzxbcdt_worst_block") or k.startswith("d")]
    res["status"] = "match" if all(e < MATCH for e in errors) else "MISMATCH"
    res["seconds"] = time.time() - t0
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="65536,208384,208512,212992,262144")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per length")
    args = ap.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child)), flush=True)
        return

    import torch

    ngpu = max(torch.cuda.device_count(), 1)
    pending = [int(x) for x in args.lengths.split(",")]
    running, results = {}, []
    while pending or running:
        while pending and len(running) < ngpu:
            gpu = next(i for i in range(ngpu) if i not in [g for g, _ in running.values()])
            seqlen = pending.pop(0)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--child", str(seqlen)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            running[seqlen] = (gpu, (proc, time.time()))
        time.sleep(1.0)
        for seqlen, (_, (proc, start)) in list(running.items()):
            if proc.poll() is None and time.time() - start < args.timeout:
                continue
            if proc.poll() is None:
                proc.kill()
            out = proc.communicate()[0]
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if lines:
                res = json.loads(lines[-1][len("RESULT ") :])
            else:
                res = {"seqlen": seqlen, "status": "crash", "error": (out.strip().splitlines() or ["?"])[-1]}
            results.append(res)
            del running[seqlen]
            print(json.dumps(res), flush=True)
    results.sort(key=lambda r: r["seqlen"])
    print("\nseqlen | zxbcdt elements | guard refuses | status | worst block out / dzxbcdt | worst param grad")
    for r in results:
        params = {k: v for k, v in r.items() if k.startswith("d") and k != "dzxbcdt" and k != "dzxbcdt_worst_block"}
        worst = max(params.items(), key=lambda kv: kv[1]) if params else ("-", float("nan"))
        print(
            f"{r['seqlen']} | {r.get('zxbcdt_numel', '?')} | {r.get('guard_refuses')} | {r['status']} | "
            f"{r.get('out_worst_block', float('nan')):.2e} / {r.get('dzxbcdt_worst_block', float('nan')):.2e} | "
            f"{worst[0]} {worst[1]:.2e} {r.get('error', '')}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
