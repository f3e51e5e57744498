"""Training runs of examples/train.py at given lengths on the GPUs of this machine: the longest global
sequence that trains, and step time and tokens/s per length.

Each trial is a fresh ``torchrun --nproc_per_node N examples/train.py`` process (so one OOM cannot
fragment the next trial's memory) that trains ``--steps`` steps in bf16 through DeepSpeed; a trial
succeeds when every step is logged. Records: status ("ok", "oom", "refused": the host memory check of
``--offload`` said no before the run, "killed": SIGKILL, the host's out-of-memory killer most likely,
"error", "timeout"), the peak GPU memory of rank 0 over the steps (``torch.cuda.max_memory_allocated``),
its peak host memory (VmHWM), the median step time of the steps after the first, tokens/s, and the
offload settings.

    # the longest sequence on one GPU: double from 256K until a trial fails, then bisect to 64K
    python benchmarks/train_runs.py --preset mamba-130m --search 262144 --resolution 65536 \\
        --out benchmarks/results/longest_h200.json
    # step time at given lengths (2 GPUs, state passing): --gpus 2 --mode state_passing --lengths 16384,65536

Presets (Mamba2 LMs, vocab 50280, d_state 128, headdim 64, expand 2, chunk 256, tied embeddings):
``mamba-130m`` d_model 768 x 24 layers; ``mamba-780m`` d_model 1536 x 48 layers; ``mamba-370m-24``
d_model 1024 x 24 layers (the end-to-end runs' model). Long runs use activation checkpointing per block
(DeepSpeed's), the tiled loss (8K tokens of logits at a time) and the op's tiles past the kernels' cap;
``--offload`` keeps the checkpoints in pinned host memory (``ds_mamba_spcp.memory.offload``: GPU budget
first, ``--offload-gpu-budget-gib``; the host memory checked before the run); ``--block-tile-tokens N``
recomputes each block in sequence tiles of N tokens (``ds_mamba_spcp.memory.tiled_block``). The JSON
(rewritten after every trial) and a Markdown table land beside ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "train.py")
SCHEMA = "ds_mamba_spcp.train_runs/1"
COMMON = ["--vocab-size", "50280", "--d-state", "128", "--headdim", "64", "--expand", "2", "--chunk-size", "256",
          "--ngroups", "1", "--tie-embeddings"]  # fmt: skip
PRESETS = {
    "mamba-130m": ["--d-model", "768", "--n-layers", "24"],
    "mamba-370m-24": ["--d-model", "1024", "--n-layers", "24"],
    "mamba-780m": ["--d-model", "1536", "--n-layers", "48"],
}


def ds_config(gpus: int, mode: str) -> dict:
    """bf16, ZeRO 1, AdamW; sequence parallelism over every GPU (off on one GPU)."""
    section = {"enabled": True}  # also on one GPU: a group of one runs long rows in tiles (no length cap)
    if mode == "virtual":
        section.update(load_balancing="virtual", input_layout="zigzag")
    elif mode == "ulysses":
        section.update(mode="ulysses")
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": gpus,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.01, "torch_adam": True},
        },  # fmt: skip
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "steps_per_print": 1000000,
        "mamba_sequence_parallel": section,
    }


def trial(args, seqlen: int, workdir: str) -> dict:
    """One training run at ``seqlen``; its record."""
    config_path = os.path.join(workdir, f"ds_{args.gpus}_{args.mode}.json")
    with open(config_path, "w") as f:
        json.dump(ds_config(args.gpus, args.mode), f)
    log = os.path.join(workdir, f"log_{seqlen}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.gpus), TRAIN,
           "--deepspeed_config", config_path, "--steps", str(args.steps), "--seq-len", str(seqlen), "--log-json", log,
           "--no-progress", *COMMON, *PRESETS[args.preset]]  # fmt: skip
    if args.checkpointing:
        cmd += ["--activation-checkpointing", "--loss-tile", str(args.loss_tile)]
    if args.offload:
        cmd += ["--offload-activations", "--offload-impl", args.offload_impl,
                "--offload-gpu-budget-gib", str(args.offload_gpu_budget_gib),
                "--offload-host-headroom-gib", str(args.offload_host_headroom_gib)]  # fmt: skip
    if args.block_tile_tokens:
        cmd += ["--block-tile-tokens", str(args.block_tile_tokens)]
    cmd += args.extra.split()
    t0 = time.monotonic()
    rec = dict(preset=args.preset, gpus=args.gpus, mode=args.mode, seqlen=seqlen, steps=args.steps,
               checkpointing=args.checkpointing, offload=args.offload, loss_tile=args.loss_tile,
               block_tile_tokens=args.block_tile_tokens or None)  # fmt: skip
    if args.offload:
        rec.update(offload_impl=args.offload_impl, offload_gpu_budget_gib=args.offload_gpu_budget_gib,
                   offload_host_headroom_gib=args.offload_host_headroom_gib)  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.trial_timeout)
        out = proc.stdout + proc.stderr
        status = "ok" if proc.returncode == 0 else ("oom" if "out of memory" in out.lower() else "error")
        if proc.returncode != 0 and "HostMemoryError" in out:
            status = "refused"  # the host memory check before the run (ds_mamba_spcp.memory.offload)
        elif proc.returncode in (-9, 137) or "exitcode  : -9" in out or "Signal 9" in out:
            status = "killed"  # SIGKILL: the host's out-of-memory killer, most likely
    except subprocess.TimeoutExpired as e:
        # what the trial printed before it was stopped: bytes here even under text=True (subprocess's rule)
        out = "".join(b.decode(errors="replace") if isinstance(b, bytes) else b for b in (e.stdout, e.stderr) if b)
        status = "timeout"
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    if status != "ok":  # the trial's own output beside the JSON, for the reason behind the status
        with open(f"{os.path.splitext(args.out)[0]}_{seqlen}.log", "w") as f:
            f.write(out[-200_000:])
    steps = []
    if os.path.exists(log):
        with open(log) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    if status == "ok" and len(steps) < args.steps:
        status = "error"
    rec["status"] = status
    if steps:
        later = steps[1:] or steps
        rec["step_s"] = statistics.median(s["step_s"] for s in later)
        rec["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in later)
        rec["peak_mem_gib"] = max(s.get("peak_mem_gib", 0.0) for s in steps)
        if any("host_peak_rss_gib" in s for s in steps):
            rec["host_peak_rss_gib"] = max(s.get("host_peak_rss_gib", 0.0) for s in steps)
        rec["losses"] = [s["loss"] for s in steps]
    backend = re.search(r"Mamba2 backend (\S+)", out)
    rec["mamba_backend"] = backend.group(1).rstrip(":") if backend else None
    if status != "ok":
        lines = [line for line in out.splitlines() if re.search(r"OutOfMemoryError|Error:|error:", line)]
        refusal = [line for line in out.splitlines() if "HostMemoryError" in line]
        lines = refusal or lines
        rec["reason"] = (lines[-1] if lines else out[-300:]).strip()[:400]
    return rec


def environment(args) -> dict:
    import torch

    header = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  torch=torch.__version__, git_commit=args.git_commit)  # fmt: skip
    if torch.cuda.is_available():
        header["gpu"] = torch.cuda.get_device_name(0)
        header["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return header


def _setting(r: dict) -> str:
    """The memory settings of a record, as its notes say them ("" for the plain checkpointed run)."""
    notes = []
    if r["offload"]:
        impl = r.get("offload_impl", "library")  # records before issue 24: DeepSpeed's checkpoint_in_cpu
        notes.append(f"offload ({impl}, GPU budget {r.get('offload_gpu_budget_gib', 0):g} GiB)")
    if r.get("block_tile_tokens"):
        notes.append(f"block tiles {r['block_tile_tokens']:,}")
    return ", ".join(notes)


def write_results(path: str, payload: dict, to_markdown) -> None:
    """The results JSON at ``path`` (rewritten whole after every record, so a killed run keeps what it measured)
    and its Markdown table beside it (``path`` with .md): ``to_markdown(payload)``. The benchmarks that record
    JSON + Markdown (this one, memory_table.py, bench_prefill.py) write through here."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(to_markdown(payload))


def markdown(payload: dict) -> str:
    h = payload["header"]
    lines = [f"# Training runs ({h.get('gpu')}, {h['date']}, commit {h.get('git_commit')})", ""]
    lines += ["| preset | GPUs | mode | global L | status | step s | tokens/s | peak GiB | host peak GiB | notes |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in payload["records"]:
        note = _setting(r)
        if r["status"] == "oom":
            note = "CUDA out of memory"
        elif r["status"] != "ok":
            note = f"{note}: {r.get('reason', '')}" if note else r.get("reason", "")
        lines.append(
            f"| {r['preset']} | {r['gpus']} | {r['mode']} | {r['seqlen']:,} | {r['status']} | "
            f"{r.get('step_s', float('nan')):.2f} | {r.get('tokens_per_s', float('nan')):,.0f} | "
            f"{r.get('peak_mem_gib', float('nan')):.1f} | {r.get('host_peak_rss_gib', float('nan')):.1f} | "
            f"{note[:160]} |"
        )
    ok = [r for r in payload["records"] if r["status"] == "ok"]
    for preset, setting in sorted({(r["preset"], _setting(r)) for r in ok}):
        runs = [r for r in ok if r["preset"] == preset and _setting(r) == setting]
        best = max(runs, key=lambda r: r["seqlen"])
        label = f"{preset}" + (f" ({setting})" if setting else "")
        lines += [
            "",
            f"Longest that trained, {label}: {best['seqlen']:,} tokens ({best['peak_mem_gib']:.1f} GiB peak).",
        ]
        pts = sorted((r["seqlen"], r["peak_mem_gib"]) for r in runs)
        (l0, m0), (l1, m1) = pts[0], pts[-1]
        if l1 > l0:
            lines.append(f"Peak memory grows by {(m1 - m0) / (l1 - l0) * 2**20:.1f} GiB per 1M tokens "
                         f"(from {l0:,} to {l1:,} tokens).")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--mode", choices=("state_passing", "virtual", "ulysses"), default="state_passing")
    p.add_argument("--lengths", default="", help="comma separated global lengths to run")
    p.add_argument("--search", type=int, default=0, help="find the longest length: double from this one, then bisect")
    p.add_argument("--resolution", type=int, default=65536, help="--search stops when the bracket is this narrow")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation checkpointing per block and the tiled loss (default on)",
    )
    p.add_argument("--loss-tile", type=int, default=8192)
    p.add_argument("--offload", action="store_true", help="activation checkpoints in pinned host memory "
                   "(examples/train.py --offload-activations)")  # fmt: skip
    p.add_argument("--offload-impl", choices=("pool", "library"), default="pool",
                   help="pool: ds_mamba_spcp.memory.offload; library: DeepSpeed's checkpoint_in_cpu")  # fmt: skip
    p.add_argument("--offload-gpu-budget-gib", type=float, default=0.0,
                   help="GiB of checkpoints kept on the GPU before any goes to the host")  # fmt: skip
    p.add_argument("--offload-host-headroom-gib", type=float, default=8.0,
                   help="host memory left free beyond the checkpoints in the check before each trial")  # fmt: skip
    p.add_argument(
        "--block-tile-tokens",
        type=int,
        default=0,
        help="with --checkpointing: recompute each Mamba2 block in sequence tiles of this many tokens "
        "(examples/train.py --block-tile-tokens; 0: off)",
    )
    p.add_argument("--trial-timeout", type=float, default=300.0)
    p.add_argument("--time-budget", type=float, default=0.0, help="stop starting trials after this many seconds")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--extra", default="", help="more examples/train.py arguments (they override the preset's)")
    p.add_argument("--out", required=True, help="JSON path (records are appended to an existing file)")
    args = p.parse_args(argv)
    if args.block_tile_tokens < 0 or (args.block_tile_tokens and not args.checkpointing):
        p.error("--block-tile-tokens takes a positive number of tokens, with --checkpointing")
    payload = dict(schema=SCHEMA, header=environment(args), records=[])
    if os.path.exists(args.out):
        with open(args.out) as f:
            payload["records"] = json.load(f).get("records", [])
    start = time.monotonic()

    def run(seqlen):
        if args.time_budget and time.monotonic() - start > args.time_budget:
            print(f"time budget spent: {seqlen} not run", flush=True)
            return None
        with tempfile.TemporaryDirectory() as workdir:
            rec = trial(args, seqlen, workdir)
        payload["records"].append(rec)
        write_results(args.out, payload, markdown)
        print(f"{args.preset} L={seqlen}: {rec['status']} peak {rec.get('peak_mem_gib')} GiB, "
              f"{rec.get('step_s')} s/step, {rec['wall_s']} s wall {rec.get('reason', '')}", flush=True)  # fmt: skip
        return rec["status"] == "ok"

    for L in [int(x) for x in args.lengths.split(",") if x.strip()]:
        run(L)
    if args.search:
        good, bad, L = None, None, args.search
        while bad is None:
            ok = run(L)
            if ok is None:
                break
            good, bad, L = (L, None, 2 * L) if ok else (good, L, L)
        while good is not None and bad is not None and bad - good > args.resolution:
            mid = (good + bad) // 2 // args.resolution * args.resolution
            ok = run(mid)
            if ok is None:
                break
            good, bad = (mid, bad) if ok else (good, mid)


if __name__ == "__main__":
    main()
