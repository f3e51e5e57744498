"""The summary exchange's cost model (ds_mamba_spcp/engine/traffic.py) as a table, cp 2 to 1024: per layer (forward
and backward) for one mixer, the all-gather against the log-depth scan on one NVLink node and on InfiniBand, what a
rank receives, and what ``summary_exchange="auto"`` picks. No GPU: the model only (docs/design.md, "Past one node").

    python benchmarks/probes/summary_exchange_model.py    # Nemotron-3's mixer (64 x 64 x 128), batch 1
    python benchmarks/probes/summary_exchange_model.py --nheads 128 --json /tmp/model.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ds_mamba_spcp.engine import traffic  # noqa: E402


def rows(args) -> list[dict]:
    summary = traffic.summary_bytes(batch=args.batch, nheads=args.nheads, headdim=args.headdim, dstate=args.dstate)
    out = []
    for cp in [2**k for k in range(1, 11)]:
        row = dict(cp=cp, summary_mib=summary / 2**20)
        for link in (traffic.NVLINK, traffic.INFINIBAND):
            for method in ("allgather", "scan"):
                cost = traffic.exchange_cost(method, cp=cp, summary=summary, link=link)
                row[f"{method}_{link.name.split()[-1].lower()}_us"] = 2 * cost["time_s"] * 1e6  # fwd + bwd
                row[f"{method}_received"] = cost["summaries_received"]
        row["auto"], row["why"] = traffic.choose_summary_exchange(cp=cp, summary=summary)
        row["crossings_2_nodes"] = traffic.node_crossings(cp) if cp == 16 else None
        out.append(row)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=64)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dstate", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    table = rows(args)
    print(
        "| cp | all-gather, NVLink | scan, NVLink | all-gather, InfiniBand | scan, InfiniBand | received (ag / scan) "
        "| auto |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['cp']} | {r['allgather_node_us']:.0f} us | {r['scan_node_us']:.0f} us | "
            f"{r['allgather_infiniband_us']:.0f} us | {r['scan_infiniband_us']:.0f} us | "
            f"{r['allgather_received']} / {r['scan_received']} | {r['auto']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=table), f, indent=1)


if __name__ == "__main__":
    main()
