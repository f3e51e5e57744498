"""The demo behind ``make demo``: a real 2-rank training run through the deepspeed launcher, beside
the single-process run, and what each sequence-parallel mode sends per layer.

    python examples/demo.py [--config configs/state_passing.json] [--steps 8] [--model mamba|hybrid]

1. ``deepspeed --num_gpus 2 examples/train.py --deepspeed_config <config>``: 2 ranks (CPU/gloo
   when there is no GPU), each holding half of every sequence;
2. ``python examples/train.py`` with the same config: one process, whole sequences;
3. the per-step loss of both side by side, and the bytes each rank sends per layer and training
   step (forward + backward) in every mode, from the model's sizes (``ds_mamba_spcp.engine.traffic``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
import train  # noqa: E402 - examples/train.py (puts the checkout on sys.path when not installed)

from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers  # noqa: E402
from ds_mamba_spcp.config import load_mamba_sp_config  # noqa: E402
from ds_mamba_spcp.engine.traffic import state_passing_bytes, ulysses_bytes  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher() -> list[str]:
    """The deepspeed launcher of this interpreter's environment."""
    exe = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "deepspeed.launcher.runner"]


def bytes_per_layer(args, ds_config: dict, seq_len: int) -> list[tuple[str, int]]:
    """(mode, bytes each rank sends per layer per training step) at ``seq_len`` global tokens."""
    cfg = load_mamba_sp_config(ds_config)
    cp = cfg.resolved_sequence_parallel_size
    batch = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    d_inner = args.expand * args.d_model
    sizes = dict(
        batch=batch, local_seqlen=seq_len // cp, nheads=d_inner // args.headdim, headdim=args.headdim,
        ngroups=args.ngroups, dstate=args.d_state, cp=cp, dtype=dtype,
    )  # fmt: skip
    rows = [
        ("state_passing, contiguous (halo + summary)", state_passing_bytes(**sizes, d_conv=args.d_conv)),
        ("state_passing, virtual zigzag (2 segments)",
         state_passing_bytes(**sizes, d_conv=args.d_conv, load_balancing="virtual")),
        ("state_passing, permute (activations moved)",
         state_passing_bytes(**sizes, d_conv=args.d_conv, load_balancing="permute_a2a")),
        ("ulysses (all-to-all of activations)", ulysses_bytes(**sizes)),
    ]  # fmt: skip
    # DeepSpeed's DistributedAttention (hybrid blocks): q, k, v and the output, forward and backward
    itemsize = torch.empty((), dtype=dtype).element_size()
    attention = 2 * 4 * batch * (seq_len // cp) * args.d_model * itemsize * (cp - 1) // cp
    rows.append(("attention block, DistributedAttention", attention))
    return rows


def read_log(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "state_passing.json"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", choices=["mamba", "hybrid"], default="mamba")
    opts = p.parse_args(argv)
    with open(opts.config, encoding="utf-8") as f:
        ds_config = json.load(f)
    common = ["--deepspeed_config", opts.config, "--steps", str(opts.steps), "--model", opts.model, "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    with tempfile.TemporaryDirectory() as tmp:
        dist_log, ref_log = os.path.join(tmp, "dist.jsonl"), os.path.join(tmp, "single.jsonl")
        script = os.path.join(REPO, "examples", "train.py")
        port = free_port()
        cmd = launcher() + ["--master_port", str(port), "--num_gpus", "2", script] + common
        shown = ["deepspeed", "--master_port", "<free>", "--num_gpus", "2", "examples/train.py", *common]
        print("$ " + " ".join(shown).replace(REPO + os.sep, ""), flush=True)
        try:
            subprocess.run(cmd + ["--log-json", dist_log], env=env, cwd=REPO, check=True)
        finally:
            remove_deepspeed_shm_buffers(port)  # DeepSpeed's CPU backend leaves them in /dev/shm
        print(f"$ python examples/train.py {' '.join(common)}".replace(REPO + os.sep, ""), flush=True)
        subprocess.run([sys.executable, script, *common, "--log-json", ref_log], env=env, cwd=REPO, check=True)
        dist, ref = read_log(dist_log), read_log(ref_log)

    cfg = load_mamba_sp_config(ds_config)
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    print(f"\n{os.path.relpath(opts.config, REPO)}: mode {cfg.mode}, load_balancing {cfg.load_balancing}, "
          f"input_layout {cfg.input_layout}, ZeRO stage {stage}")  # fmt: skip
    print(f"{'step':>4}  {'2 ranks (launcher)':>18}  {'1 process':>10}  {'rel. diff':>9}")
    worst = 0.0
    for d, r in zip(dist, ref):
        rel = abs(d["loss"] - r["loss"]) / abs(r["loss"])
        worst = max(worst, rel)
        print(f"{d['step']:>4}  {d['loss']:>18.6f}  {r['loss']:>10.6f}  {rel:>9.1e}")
    print(f"max relative difference {worst:.1e}")

    args = train.parse_args(common)
    long = 131072
    print(f"\nbytes each rank sends per layer and step (fwd + bwd), batch "
          f"{ds_config.get('train_micro_batch_size_per_gpu', 1)}, this model's sizes:")  # fmt: skip
    here, there = bytes_per_layer(args, ds_config, args.seq_len), bytes_per_layer(args, ds_config, long)
    print(f"{'':44}  {f'{args.seq_len} tokens':>12}  {f'{long} tokens':>14}")
    for (name, a), (_, b) in zip(here, there):
        print(f"{name:44}  {human(a):>12}  {human(b):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
