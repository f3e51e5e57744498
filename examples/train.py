"""Train a small Mamba2 (or Mamba2 + attention) language model with sequence parallelism under DeepSpeed.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config configs/state_passing.json   # 2 ranks
    python examples/train.py --deepspeed_config configs/state_passing.json                    # 1 process

Without GPUs the launcher starts 2 CPU processes (gloo). Under the launcher every rank of a
sequence-parallel group builds the same model from one seed and the same batch from one data seed,
keeps its shard of every sequence (``ds_mamba_spcp.data.shard_batch``, in the config's
``input_layout``), and trains through ``deepspeed.initialize``; the group is DeepSpeed's own
(``parallel_state_sp``, handed to DeepSpeed as the ``mpu``), so ZeRO reduces over it. Run as plain
``python`` the same script is the single-process reference: same initialisation, same data, the
whole sequence on one device, and the optimizer of the ds_config in plain PyTorch (fp32).

The loss of each rank is its share of the global mean over the group's tokens, times the factor
that undoes DeepSpeed's reduction (sum over sequence-parallel ranks in ZeRO 0-2, average in ZeRO 3):
see ``ds_mamba_spcp.data``. The logged loss is the global mean, comparable step by step with the
single-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
DEFAULT_CONFIG = os.path.join(REPO, "configs", "state_passing.json")

try:
    import ds_mamba_spcp  # noqa: F401 - installed (pip install -e .)
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, REPO)
if _HERE not in sys.path:  # model.py beside this file, also when imported by the tests
    sys.path.insert(0, _HERE)

from model import MambaLM, mamba2_factory, parallelize  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ds_mamba_spcp.config import MambaSequenceParallelConfig, load_mamba_sp_config  # noqa: E402
from ds_mamba_spcp.data import grad_scale_for_engine, sequence_parallel_cross_entropy, shard_batch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", default=DEFAULT_CONFIG, help="ds_config JSON (default: %(default)s)")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--log-json", default=None, help="write one JSON object per step (step, loss, ...) to this file")
    p.add_argument(
        "--model",
        choices=["mamba", "hybrid"],
        default="mamba",
        help="mamba: Mamba2 blocks only; hybrid: every --attn-every-th block is causal self-attention",
    )
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data seed")
    p.add_argument("--seq-len", type=int, default=256, help="global sequence length (tokens)")
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--d-conv", type=int, default=4)
    p.add_argument("--expand", type=int, default=2)
    p.add_argument("--headdim", type=int, default=16)
    p.add_argument("--ngroups", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--attn-every", type=int, default=2, help="hybrid: blocks k-1, 2k-1, ... are attention")
    p.add_argument("--attn-heads", type=int, default=4)
    p.add_argument("--tie-embeddings", action="store_true", help="share the embedding and LM head weights")
    p.add_argument(
        "--grad-scale",
        default="auto",
        help="factor on each rank's loss share: 'auto' reads it off the engine (1 for ZeRO 0-2, "
        "sp_size for ZeRO 3); a number overrides it (the tests' negative control)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logs")
    args = p.parse_args(argv)  # fmt: skip
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


# ------------------------------------------------------------------------------------------------
# data: a deterministic token generator with structure to learn
# ------------------------------------------------------------------------------------------------


def synthetic_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int, noise: float = 0.1) -> dict:
    """Full sequences ``{"input_ids", "labels"}`` (batch_size, seq_len), the same for the same seed.

    Each sequence counts modulo ``vocab_size`` from a random start with its own random stride
    (1..8), and each token is replaced by a uniformly random one with probability ``noise``. A model
    learns to read the stride off the context; the best loss is about the noise's entropy.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 9, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len)) % vocab_size
    noisy = torch.rand(batch_size, seq_len, generator=g) < noise
    tokens = torch.where(noisy, torch.randint(vocab_size, (batch_size, seq_len), generator=g), tokens)
    return {"input_ids": tokens, "labels": tokens.clone()}


def batch_seed(seed: int, step: int, micro: int, dp_rank: int) -> int:
    """Data seed of one micro-batch of one data-parallel replica (int tuples hash deterministically)."""
    return hash((seed, step, micro, dp_rank)) & 0x7FFF_FFFF_FFFF


# ------------------------------------------------------------------------------------------------
# model and optimizer
# ------------------------------------------------------------------------------------------------


def build_model(args) -> MambaLM:
    """The plain model (Mamba2 mixers unwrapped), initialised from ``args.seed``."""
    torch.manual_seed(args.seed)
    factory = mamba2_factory(
        args.d_model, d_state=args.d_state, d_conv=args.d_conv, expand=args.expand, headdim=args.headdim,
        ngroups=args.ngroups, chunk_size=args.chunk_size,
    )  # fmt: skip
    return MambaLM(
        args.vocab_size, args.d_model, args.n_layers, factory,
        attn_every=args.attn_every if args.model == "hybrid" else 0, attn_heads=args.attn_heads,
        tie_embeddings=args.tie_embeddings,
    )  # fmt: skip


def torch_optimizer(ds_config: dict, params):
    """The ds_config's ``optimizer`` as a plain PyTorch optimizer (what DeepSpeed builds with
    ``torch_adam: true``, or ``torch.optim.<type>`` for other names)."""
    spec = ds_config.get("optimizer")
    if spec is None:
        raise ValueError('the ds_config has no "optimizer" section; the single-process reference needs one')
    name, kwargs = spec["type"], dict(spec.get("params", {}))
    if name.lower() in ("adam", "adamw"):
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        kwargs.pop("torch_adam", None)
        cls = torch.optim.AdamW if (name.lower() == "adamw" or adam_w_mode) else torch.optim.Adam
        return cls(params, **kwargs)
    return getattr(torch.optim, name)(params, **kwargs)


# ------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------


class StepLog:
    """Per-step log line, JSON lines file and progress bar (rank 0 only)."""

    def __init__(self, args, enabled: bool, tokens_per_step: int):
        self.enabled, self.tokens_per_step, self.records = enabled, tokens_per_step, []
        self.file = open(args.log_json, "w", encoding="utf-8") if (enabled and args.log_json) else None  # noqa: SIM115
        self.bar = tqdm(total=args.steps, disable=not enabled or args.no_progress, dynamic_ncols=True, leave=False)
        self.t0 = time.perf_counter()

    def step(self, step: int, loss: float, seconds: float) -> None:
        rec = {
            "step": step, "loss": loss, "tokens": self.tokens_per_step, "tokens_per_s": self.tokens_per_step / seconds,
            "step_s": seconds, "elapsed_s": time.perf_counter() - self.t0,
        }  # fmt: skip
        self.records.append(rec)
        if not self.enabled:
            return
        tqdm.write(f"step {step:4d} | loss {loss:.6f} | {rec['tokens_per_s']:9.0f} tokens/s | {seconds * 1e3:7.1f} ms")
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()


def _grad_accumulation(ds_config: dict) -> tuple[int, int]:
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    if micro is None:
        raise ValueError('set "train_micro_batch_size_per_gpu" in the ds_config (the sequences per step and rank)')
    return int(micro), int(ds_config.get("gradient_accumulation_steps", 1))


def run_single(args, ds_config: dict) -> list[dict]:
    """The single-process reference: the whole sequence on one device, plain PyTorch optimizer."""
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    micro, gas = _grad_accumulation(ds_config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args)
    # A group of one on the plain-PyTorch reference op on CPU (mamba-ssm's own kernels need CUDA).
    cfg = load_mamba_sp_config(ds_config)
    one = MambaSequenceParallelConfig(**{**cfg.model_dump(), "enabled": True, "sequence_parallel_size": 1,
                                         "mode": "state_passing", "load_balancing": "none",
                                         "input_layout": "contiguous"})  # fmt: skip
    wrap_mamba2_mixers(model, None, one)
    model.to(device).train()
    optimizer = torch_optimizer(ds_config, model.parameters())
    clip = float(ds_config.get("gradient_clipping", 0.0))
    log = StepLog(args, True, micro * gas * args.seq_len)
    print(f"single process on {device}: {_describe(model, args)}", flush=True)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        losses = []
        for m in range(gas):
            full = synthetic_batch(micro, args.seq_len, args.vocab_size, batch_seed(args.seed, step, m, 0))
            batch = {k: v.to(device) for k, v in shard_batch(full, rank=0, world_size=1).items()}
            loss, mean_loss = sequence_parallel_cross_entropy(model(batch["input_ids"]), batch["shift_labels"])
            (loss / gas).backward()
            losses.append(mean_loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.step(step, sum(losses) / gas, time.perf_counter() - t0)
    log.close()
    return log.records


def sequence_parallel_groups(sp: int):
    """(group, mpu) for ``sp`` ranks per sequence: DeepSpeed's ``parallel_state_sp`` (consecutive
    ranks share a sequence), created once per process. ``mpu`` is None for ``sp == 1``."""
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if sp == 1:
        # every rank is its own group (each rank makes every group, in the same order)
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        return groups[dist.get_rank()], None
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
        parallel_state_sp.initialize_sequence_parallel(sp)
    elif (have := parallel_state_sp.get_sequence_parallel_world_size()) != sp:
        raise RuntimeError(
            f"this process already has a sequence-parallel group of {have} ranks; it cannot also train with "
            f"sequence_parallel_size {sp}"
        )
    return parallel_state_sp.get_sequence_parallel_group(), parallel_state_sp


def run_distributed(args, ds_config: dict) -> list[dict]:
    """One rank of a launched run: shard, train through DeepSpeed, log the global loss on rank 0."""
    import deepspeed
    import deepspeed.comm as dist

    from ds_mamba_spcp import comm

    if not args.verbose:
        deepspeed.utils.logger.setLevel("WARNING")
    if not dist.is_initialized():
        deepspeed.init_distributed(verbose=args.verbose)
    world, rank = dist.get_world_size(), dist.get_rank()
    if "data_parallel_size" in ds_config:
        raise ValueError(
            'drop "data_parallel_size" from the ds_config: this script builds the sequence-parallel groups itself '
            "(DeepSpeed's parallel_state_sp, consecutive ranks per sequence) before deepspeed.initialize"
        )
    cfg = load_mamba_sp_config(ds_config)
    sp = cfg.resolved_sequence_parallel_size
    if not cfg.enabled and sp > 1:
        raise ValueError('"mamba_sequence_parallel.enabled" is false but sequence_parallel_size > 1')
    if world % sp != 0:
        raise ValueError(f"the world has {world} ranks, not a multiple of sequence_parallel_size {sp}")
    group, mpu = sequence_parallel_groups(sp)
    sp_rank, dp_rank = comm.group_rank_size(group)[0], rank // sp
    micro, gas = _grad_accumulation(ds_config)
    if (args.seq_len // sp) % 2 and cfg.input_layout == "zigzag":
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of 2*sp = {2 * sp} for the zigzag layout")

    model = build_model(args)
    parallelize(model, group, ds_config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config, mpu=mpu
    )
    scale = grad_scale_for_engine(engine) if args.grad_scale == "auto" else float(args.grad_scale)
    log = StepLog(args, rank == 0, micro * gas * (world // sp) * args.seq_len)
    if rank == 0:
        print(
            f"{world} ranks, sequence_parallel_size {sp}, ZeRO stage {engine.zero_optimization_stage()}, "
            f"mode {cfg.mode}, load_balancing {cfg.load_balancing}, input_layout {cfg.input_layout}, "
            f"grad scale {scale:g}, {engine.device}: {_describe(model, args)}",
            flush=True,
        )
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        losses = []
        for m in range(gas):
            full = synthetic_batch(micro, args.seq_len, args.vocab_size, batch_seed(args.seed, step, m, dp_rank))
            batch = shard_batch(full, group, layout=cfg.input_layout, rank=sp_rank, world_size=sp)
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            logits = engine(batch["input_ids"])
            loss, mean_loss = sequence_parallel_cross_entropy(logits, batch["shift_labels"], group, grad_scale=scale)
            engine.backward(loss)
            engine.step()
            losses.append(mean_loss)
        # the global loss: the mean over micro-batches and data-parallel replicas (equal on SP ranks)
        total = torch.stack(losses).mean().reshape(1)
        dist.all_reduce(total)
        log.step(step, total.item() / world, time.perf_counter() - t0)
    log.close()
    if engine.device.type == "cpu" and "MASTER_PORT" in os.environ:
        dist.barrier()  # nobody needs DeepSpeed's CPU all-reduce buffers any more: free them (it never does)
        comm.remove_deepspeed_shm_buffers(int(os.environ["MASTER_PORT"]), os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return log.records


def _describe(model, args) -> str:
    nparams = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 partitions p
    kind = "Mamba2" if args.model == "mamba" else f"hybrid Mamba2 + attention every {args.attn_every}"
    return (
        f"{kind} LM, {args.n_layers} layers, d_model {args.d_model}, {nparams / 1e3:.1f}K parameters, "
        f"seq_len {args.seq_len}"
    )


def launched() -> bool:
    """True under the deepspeed launcher (or torchrun): the rank environment is set."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    with open(args.deepspeed_config, encoding="utf-8") as f:
        ds_config = json.load(f)
    if not torch.cuda.is_available():
        # CPU ranks share the host's cores: one share each, instead of every rank taking them all.
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1))) if launched() else 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if launched():
        return run_distributed(args, ds_config)
    return run_single(args, ds_config)


if __name__ == "__main__":
    main()
