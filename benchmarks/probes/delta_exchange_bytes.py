"""The gated delta rule's exchange against the head all-to-all, from the sizes alone (no GPU), cp 2 to 1024: what
one rank receives per layer and direction (docs/design.md, "The gated delta rule").

State passing sends one summary per segment, (U, M) = H x (K x V + K x K) fp32, whatever the sequence length; a
rank receives cp - 1 of them by the all-gather, ceil(log2 cp) by the scan (``engine/traffic.py``'s counts). The
all-to-all (ulysses) moves L_local x hidden activations (q, k, v, g, beta in, o out) of which a fraction (cp - 1)/cp
leaves the rank; it caps cp at the head count.

    python benchmarks/probes/delta_exchange_bytes.py                       # 48 heads, K = V = 128, 128K tokens
    python benchmarks/probes/delta_exchange_bytes.py --seqlen 1048576 --json /tmp/delta.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ds_mamba_spcp.engine import exchange, traffic  # noqa: E402

MB = 1e6


def rows(args) -> list[dict]:
    summary = traffic.delta_summary_bytes(batch=1, nheads=args.heads, k_dim=args.k_dim, v_dim=args.v_dim)
    # per token: q and k (k_heads x K each), v (heads x V), g and beta (heads each) in, o (heads x V) out
    per_token = (2 * args.k_heads * args.k_dim + 2 * args.heads * args.v_dim + 2 * args.heads) * args.itemsize
    out = []
    for cp in [2**k for k in range(1, 11)]:
        local = args.seqlen // cp
        received_ag = exchange.summaries_moved(cp, "contiguous", exchange.ALLGATHER)[1][0]
        received_scan = max(exchange.summaries_moved(cp, "contiguous", exchange.SCAN)[1].values())
        a2a = local * per_token * (cp - 1) / cp if args.heads % cp == 0 else math.nan
        auto = traffic.choose_summary_exchange(cp=cp, summary=summary)[0]
        out.append(dict(cp=cp, local_seqlen=local, summary_mb=summary / MB, allgather_mb=received_ag * summary / MB,
                        scan_mb=received_scan * summary / MB, scan_rounds=exchange.rounds_needed(cp),
                        alltoall_mb=a2a / MB, auto=auto))  # fmt: skip
    return out


def table(out, args) -> str:
    lines = [
        f"heads {args.heads} (q/k heads {args.k_heads}), K {args.k_dim}, V {args.v_dim}, global seqlen {args.seqlen}, "
        f"activations {args.itemsize} B; summary {out[0]['summary_mb']:.2f} MB; MB received per rank, layer and "
        "direction",
        "",
        "| cp | local seqlen | all-gather | scan (rounds) | all-to-all | auto |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for r in out:
        a2a = "n/a (heads % cp)" if math.isnan(r["alltoall_mb"]) else f"{r['alltoall_mb']:.1f}"
        lines.append(f"| {r['cp']} | {r['local_seqlen']} | {r['allgather_mb']:.1f} | {r['scan_mb']:.1f} "
                     f"({r['scan_rounds']}) | {a2a} | {r['auto']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=48)
    p.add_argument("--k-heads", type=int, default=48)
    p.add_argument("--k-dim", type=int, default=128)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=131072)
    p.add_argument("--itemsize", type=int, default=2, help="bytes per activation element (bf16: 2)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = rows(args)
    print(table(out, args))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
