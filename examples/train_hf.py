"""Train a tiny Nemotron-H-style hybrid (Hugging Face transformers, built from a config) with sequence parallelism.

    deepspeed --num_gpus 2 examples/train_hf.py --deepspeed_config configs/state_passing.json   # 2 ranks
    python examples/train_hf.py --deepspeed_config configs/state_passing.json                    # 1 process

The model is transformers' ``NemotronHForCausalLM`` (Mamba2 mixers, attention and MLP layers in the order of
``--pattern``), from a config: nothing is downloaded. Under the launcher every rank builds the same model
from one seed, one call shards it (``ds_mamba_spcp.integrations.transformers.prepare_sequence_parallel``:
DeepSpeed's sequence-parallel group from the ds_config, DeepSpeed's Ulysses attention for the attention
layers, this package for the Mamba2 mixers), and each rank trains on its contiguous shard of every sequence
through ``deepspeed.initialize(..., mpu=...)``. Run as plain ``python`` the same script is the reference:
the same model, data and optimizer (plain PyTorch, fp32), whole sequences, and transformers' own forward
(its PyTorch path on CPU, mamba-ssm's kernels where they are installed). Without GPUs the launcher starts
CPU processes (gloo). The ds_config's ``input_layout`` must be contiguous (the attention is sharded that way):
``configs/state_passing.json``, ``state_passing_zero3.json``, ``ulysses.json``, ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # train.py beside this file, also when imported by the tests
    sys.path.insert(0, _HERE)

# the data, the single-process optimizer and the step log of the Mamba2 example
from train import (  # noqa: E402
    DEFAULT_CONFIG,
    StepLog,
    _grad_accumulation,
    batch_seed,
    launched,
    read_config_and_share_cores,
    synthetic_batch,
    train_single_process,
)

from ds_mamba_spcp.config import load_mamba_sp_config  # noqa: E402
from ds_mamba_spcp.data import grad_scale_for_engine, sequence_parallel_cross_entropy, shard_batch  # noqa: E402

LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp"}  # Nemotron-H's pattern letters


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", default=DEFAULT_CONFIG, help="ds_config JSON (default: %(default)s)")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--log-json", default=None, help="write one JSON object per step (step, loss, ...) to this file")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data seed")
    p.add_argument("--seq-len", type=int, default=256, help="global sequence length (tokens)")
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--pattern", default="M*-M-M*-", help="layers: M Mamba2, * attention, - MLP (Nemotron-H's letters)")
    p.add_argument("--mamba-heads", type=int, default=8)
    p.add_argument("--mamba-headdim", type=int, default=16)
    p.add_argument("--ngroups", type=int, default=2)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--attn-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logs")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if set(args.pattern) - set(LAYER_KINDS):
        p.error(f"--pattern takes the letters {''.join(LAYER_KINDS)}, got {args.pattern!r}")
    return args


def build_model(args):
    """A ``NemotronHForCausalLM`` from a config, initialised from ``args.seed`` (transformers' own init)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        layers_block_type=[LAYER_KINDS[c] for c in args.pattern],
        num_attention_heads=args.attn_heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.attn_heads, intermediate_size=2 * args.hidden_size,
        mamba_num_heads=args.mamba_heads, mamba_head_dim=args.mamba_headdim, n_groups=args.ngroups,
        ssm_state_size=args.d_state, chunk_size=args.chunk_size, tie_word_embeddings=False,
        initializer_range=0.1, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"  # DeepSpeed's Ulysses attention needs a kernel that masks causally itself
    torch.manual_seed(args.seed)
    return NemotronHForCausalLM(config)


def _logits(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits


def run_single(args, ds_config: dict) -> list[dict]:
    """The reference: transformers' model on whole sequences, plain PyTorch optimizer."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args).to(device).train()
    print(f"single process on {device}: {_describe(model, args)}", flush=True)
    return train_single_process(
        args, ds_config, model, device,
        lambda step, m, micro: synthetic_batch(micro, args.seq_len, args.vocab_size, batch_seed(args.seed, step, m, 0)),
        lambda batch: sequence_parallel_cross_entropy(_logits(model, batch), batch["shift_labels"]),
    )  # fmt: skip


def run_distributed(args, ds_config: dict) -> list[dict]:
    """One rank of a launched run: prepare, shard, train through DeepSpeed, log the global loss on rank 0."""
    import deepspeed
    import deepspeed.comm as dist

    from ds_mamba_spcp import comm
    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel

    if not args.verbose:
        deepspeed.utils.logger.setLevel("WARNING")
    if not dist.is_initialized():
        deepspeed.init_distributed(verbose=args.verbose)
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = load_mamba_sp_config(ds_config)
    sp = cfg.resolved_sequence_parallel_size if cfg.enabled else 1
    micro, gas = _grad_accumulation(ds_config)

    model = build_model(args)
    mpu = prepare_sequence_parallel(model, ds_config)  # the one call: groups, attention, Mamba2 mixers
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    sp_rank, dp_rank = comm.group_rank_size(group)[0], rank // sp  # parallel_state_sp: consecutive ranks per group
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu)
    scale = grad_scale_for_engine(engine)
    log = StepLog(args, rank == 0, micro * gas * (world // sp) * args.seq_len)
    if rank == 0:
        print(
            f"{world} ranks, sequence_parallel_size {sp}, ZeRO stage {engine.zero_optimization_stage()}, "
            f"mode {cfg.mode}, grad scale {scale:g}, {engine.device}: {_describe(model, args)}",
            flush=True,
        )
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        losses = []
        for m in range(gas):
            full = synthetic_batch(micro, args.seq_len, args.vocab_size, batch_seed(args.seed, step, m, dp_rank))
            # this rank's tokens, global position_ids, labels shifted before sharding
            batch = shard_batch(full, group, rank=sp_rank, world_size=sp)
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss, mean_loss = sequence_parallel_cross_entropy(
                _logits(engine, batch), batch["shift_labels"], group, grad_scale=scale
            )
            engine.backward(loss)
            engine.step()
            losses.append(mean_loss)
        total = torch.stack(losses).mean().reshape(1)  # the global loss: equal on the SP ranks, mean over replicas
        dist.all_reduce(total)
        log.step(step, total.item() / world, time.perf_counter() - t0)
    log.close()
    if engine.device.type == "cpu" and "MASTER_PORT" in os.environ:
        dist.barrier()  # free DeepSpeed's CPU all-reduce buffers (it never does)
        comm.remove_deepspeed_shm_buffers(int(os.environ["MASTER_PORT"]), os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return log.records


def _describe(model, args) -> str:
    nparams = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 partitions p
    return (
        f"NemotronHForCausalLM (transformers), layers {args.pattern}, hidden {args.hidden_size}, "
        f"{nparams / 1e3:.1f}K parameters, seq_len {args.seq_len}"
    )


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    ds_config = read_config_and_share_cores(args.deepspeed_config)
    if launched():
        return run_distributed(args, ds_config)
    return run_single(args, ds_config)


if __name__ == "__main__":
    main()
    from ds_mamba_spcp.comm import shutdown

    shutdown()  # a gloo rank can abort at exit while its group lives
