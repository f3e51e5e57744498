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

Checkpoints (launched runs): ``--save-dir DIR --save-every N`` saves a DeepSpeed checkpoint every N
steps and after the last one; ``--resume`` continues from the newest complete one in DIR (the same
batches, optimizer state and RNG states), also at another sequence-parallel size, where the ZeRO state
is re-partitioned through DeepSpeed's universal checkpoint (``ds_mamba_spcp.checkpoint``,
docs/checkpointing.md). ``--dist-timeout`` bounds how long a rank waits for a lost peer.

The loss of each rank is its share of the global mean over the group's tokens, times the factor
that undoes DeepSpeed's reduction (sum over sequence-parallel ranks in ZeRO 0-2, average in ZeRO 3):
see ``ds_mamba_spcp.data``. The logged loss is the global mean, comparable step by step with the
single-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
DEFAULT_CONFIG = os.path.join(REPO, "configs", "state_passing.json")
RESUME_PIECES = ("data_position", "optimizer", "rng")

try:
    import ds_mamba_spcp  # noqa: F401 - installed (pip install -e .)
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, REPO)
if _HERE not in sys.path:  # model.py beside this file, also when imported by the tests
    sys.path.insert(0, _HERE)

from model import MambaLM, mamba2_factory, parallelize  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ds_mamba_spcp import checkpoint as checkpointing  # noqa: E402 - not "checkpoint": torch.utils has one
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
        "cp for ZeRO 3); a number overrides it (the tests' negative control)",
    )
    p.add_argument(
        "--packed",
        action="store_true",
        help="pack documents of random lengths into every row (padding-free): Mamba2 layers restart at "
        "each document (seq_idx), attention stays inside it",
    )
    p.add_argument("--doc-len", type=int, default=None, help="--packed: mean document length (default seq_len/6)")
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block in backward (DeepSpeed's activation checkpointing under the launcher)",
    )
    p.add_argument(
        "--offload-activations",
        action="store_true",
        help="with --activation-checkpointing: keep the checkpoints in pinned host memory, past the GPU budget "
        "(ds_mamba_spcp.memory.offload; the host memory it needs is checked before the run)",
    )
    p.add_argument(
        "--offload-gpu-budget-gib",
        type=float,
        default=0.0,
        help="--offload-activations: GiB of checkpoints per rank kept on the GPU before any goes to the host "
        "(the first blocks'; default %(default)s: all but the newest go)",
    )
    p.add_argument(
        "--offload-host-headroom-gib",
        type=float,
        default=8.0,
        help="--offload-activations: host memory left free beyond the checkpoints when checking (default %(default)s)",
    )
    p.add_argument(
        "--offload-impl",
        choices=["pool", "library"],
        default="pool",
        help="--offload-activations: pool (this package's pinned pool, both paths) or library (DeepSpeed's "
        "checkpoint_in_cpu under the launcher, torch's save_on_cpu in one process: unchecked, for comparison)",
    )
    p.add_argument(
        "--block-tile-tokens",
        type=int,
        default=None,
        help="with --activation-checkpointing: recompute each Mamba2 block in sequence tiles of this many tokens "
        '(sets "mamba_sequence_parallel.block_tile_tokens"; any sequence_parallel_size, ZeRO 0-3)',
    )
    p.add_argument(
        "--loss-tile",
        type=int,
        default=0,
        help="score the shard's tokens this many at a time, never materialising the whole shard's "
        "logits (0: all at once)",
    )
    p.add_argument(
        "--shared-gpu",
        action="store_true",
        help="every rank on GPU 0 through gloo: a correctness run of the GPU path on one GPU (timings mean "
        "nothing; docs/design.md, 'Traps')",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logs")
    add_checkpoint_args(p)
    args = p.parse_args(argv)  # fmt: skip
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.offload_activations and not args.activation_checkpointing:
        p.error("--offload-activations needs --activation-checkpointing")
    if args.block_tile_tokens is not None and (not args.activation_checkpointing or args.block_tile_tokens < 1):
        p.error("--block-tile-tokens takes a positive number of tokens, with --activation-checkpointing")
    if args.offload_gpu_budget_gib < 0 or args.offload_host_headroom_gib < 0:
        p.error("--offload-gpu-budget-gib and --offload-host-headroom-gib take GiB >= 0")
    if args.offload_gpu_budget_gib and not (args.offload_activations and args.offload_impl == "pool"):
        p.error("--offload-gpu-budget-gib applies to --offload-activations with --offload-impl pool (the default)")
    if args.doc_len is not None and (not args.packed or args.doc_len < 1):
        p.error("--doc-len takes a positive length, with --packed")
    check_checkpoint_args(p, args)
    return args


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and faults (launched runs)")
    g.add_argument("--save-dir", default=None, help="save DeepSpeed checkpoints here (and resume from here)")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (and after the last step); "
                   "0: only after the last step")  # fmt: skip
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in "
                   "--save-dir, also at another sequence-parallel size; start fresh when it holds none")  # fmt: skip
    g.add_argument(
        "--resume-without", action="append", default=[], choices=RESUME_PIECES,
        help="negative control for the tests: resume without restoring this piece (repeatable)",
    )  # fmt: skip
    g.add_argument(
        "--dist-timeout", type=float, default=None,
        help="seconds a collective waits for a peer before it raises, on every process group (default: "
        "DeepSpeed's, $DEEPSPEED_TIMEOUT minutes or 10)",
    )  # fmt: skip
    g.add_argument(
        "--fault-drill", default=None, metavar="RANK:STEP",
        help="global rank RANK freezes itself (SIGSTOP) in the middle of step STEP, after its forward pass, as "
        "a hung process would; kill it to simulate a lost rank, or wait for --dist-timeout",
    )  # fmt: skip


def check_checkpoint_args(p: argparse.ArgumentParser, args) -> None:
    if args.save_every < 0:
        p.error(f"--save-every must be >= 0, got {args.save_every}")
    if (args.resume or args.save_every) and not args.save_dir:
        p.error("--resume and --save-every need --save-dir (where the checkpoints are)")
    if args.resume_without and not args.resume:
        p.error("--resume-without applies to --resume")
    if args.dist_timeout is not None and args.dist_timeout <= 0:
        p.error(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
    if args.fault_drill is not None:
        try:
            rank, step = (int(v) for v in args.fault_drill.split(":"))
        except ValueError:
            p.error(f"--fault-drill takes RANK:STEP (two integers), got {args.fault_drill!r}")
        args.fault_drill = (rank, step)


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


def synthetic_packed_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int, doc_len: int | None = None,
                           noise: float = 0.1) -> dict:  # fmt: skip
    """Rows packed with documents of random lengths (1 to 2*doc_len tokens, the last one cut by the row's
    end), each counting with its own start and stride as ``synthetic_batch``'s rows do. Returns
    ``{"input_ids", "labels", "position_ids"}``: positions restart at 0 at each document (Hugging Face's
    padding-free convention, from which ``shard_batch`` derives ``seq_idx``), and the label of each
    document's first token is ignored, so that no token is scored against the next document."""
    from ds_mamba_spcp.data import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed)
    doc_len = doc_len or max(1, seq_len // 6)
    rows, positions = [], []
    for _ in range(batch_size):
        lengths = []
        while sum(lengths) < seq_len:
            lengths.append(int(torch.randint(1, 2 * doc_len + 1, (1,), generator=g)))
        lengths[-1] -= sum(lengths) - seq_len
        docs = synthetic_batch(len(lengths), max(lengths), vocab_size, int(torch.randint(2**31, (1,), generator=g)),
                               noise)["input_ids"]  # fmt: skip
        rows.append(torch.cat([docs[i, :n] for i, n in enumerate(lengths)]))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
    tokens, position_ids = torch.stack(rows), torch.stack(positions)
    labels = torch.where(position_ids == 0, IGNORE_INDEX, tokens)
    return {"input_ids": tokens, "labels": labels, "position_ids": position_ids}


def make_batch(args, micro: int, seed: int) -> dict:
    """One micro-batch of full rows: packed documents with --packed, else one sequence per row."""
    if args.packed:
        return synthetic_packed_batch(micro, args.seq_len, args.vocab_size, seed, args.doc_len)
    return synthetic_batch(micro, args.seq_len, args.vocab_size, seed)


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


def forward_loss(model, forward, batch: dict, group, scale: float, args):
    """(loss share to back-propagate, global mean loss) of one sharded micro-batch.

    ``forward`` is the model or its DeepSpeed engine; ``model`` the module itself (its ``logits`` for the
    tiled loss). Packed rows pass their document labels to the model."""
    from ds_mamba_spcp.data import sequence_parallel_tiled_cross_entropy

    kwargs = {} if "seq_idx" not in batch else dict(seq_idx=batch["seq_idx"])
    if args.loss_tile:
        hidden = forward(batch["input_ids"], return_hidden=True, **kwargs)
        return sequence_parallel_tiled_cross_entropy(
            hidden, model.logits, batch["shift_labels"], group, grad_scale=scale, tile_tokens=args.loss_tile
        )
    return sequence_parallel_cross_entropy(forward(batch["input_ids"], **kwargs), batch["shift_labels"], group,
                                           grad_scale=scale)  # fmt: skip


def with_block_tiles(ds_config: dict, args) -> tuple[dict, MambaSequenceParallelConfig]:
    """The ds_config with --block-tile-tokens written into its section, and its settings (parsed here, once: the
    run takes them); raises when the section asks for block tiles without --activation-checkpointing (the tiled
    block is a checkpoint)."""
    if args.block_tile_tokens is not None:
        section = {**ds_config.get("mamba_sequence_parallel", {}), "block_tile_tokens": args.block_tile_tokens}
        ds_config = {**ds_config, "mamba_sequence_parallel": section}
    cfg = load_mamba_sp_config(ds_config)
    tiles = cfg.block_tile_tokens
    if tiles is not None and not args.activation_checkpointing:
        raise ValueError(
            f'"mamba_sequence_parallel.block_tile_tokens" is {tiles} but --activation-checkpointing is off: the '
            "tiled block recompute is a way of checkpointing the blocks. Pass --activation-checkpointing, or drop "
            "the key."
        )
    return ds_config, cfg


def block_checkpointing(model: MambaLM, args, mpu=None, offload_plan=None) -> None:
    """--activation-checkpointing: every block recomputed in backward.

    With --offload-activations (``--offload-impl pool``, the default) both paths use this package's
    ``OffloadedCheckpoint``: GPU budget first, then pinned host memory, at most ``offload_plan.host_bytes``
    (the plan ``check_offload`` approved). Otherwise launched runs use DeepSpeed's activation checkpointing
    (``deepspeed.checkpointing``; ``--offload-impl library`` adds its ``checkpoint_in_cpu``), the
    single-process reference torch's equivalent (``save_on_cpu`` for the library offload). A Mamba2 block
    whose section sets ``block_tile_tokens`` (--block-tile-tokens) is its own checkpoint, recomputed tile by
    tile (``Block.tiled``); with the offload its input goes to the same offloader (pool) or through
    ``save_on_cpu`` (library)."""
    if not args.activation_checkpointing:
        return
    offloader = None
    if args.offload_activations and args.offload_impl == "pool":
        from ds_mamba_spcp.memory import CheckpointOffloader, OffloadedCheckpoint

        offloader = CheckpointOffloader(
            gpu_budget_bytes=int(args.offload_gpu_budget_gib * 2**30),
            host_limit_bytes=None if offload_plan is None else offload_plan.host_bytes,
        )
        if offload_plan is not None:  # the host slots now, before the first step (pinned where the model is on a GPU)
            offloader.reserve(offload_plan, pin=torch.cuda.is_available())
        base = OffloadedCheckpoint(offloader)
    elif launched():
        import deepspeed

        if args.offload_activations and not torch.cuda.is_available():
            raise ValueError(
                "--offload-impl library under the launcher needs a GPU: DeepSpeed 0.19.8's checkpoint_in_cpu without "
                "a side stream hands the recomputed block an empty tensor; use --offload-impl pool (the default)"
            )
        deepspeed.checkpointing.configure(mpu, checkpoint_in_cpu=args.offload_activations)
        base = deepspeed.checkpointing.checkpoint
    else:
        from torch.utils.checkpoint import checkpoint

        def base(block, *inputs):
            if not args.offload_activations:
                return checkpoint(block, *inputs, use_reentrant=False)
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return checkpoint(block, *inputs, use_reentrant=False)

    def block_checkpoint(block, x, seq_idx, doc_ids):
        if not block.tile_tokens():
            return base(block, x, seq_idx, doc_ids)
        if offloader is not None:  # the tiled block's input is its checkpoint: the offloader places it
            with offloader.saved_tensors_hooks(x):
                return block.tiled(x, seq_idx)
        if not args.offload_activations:
            return block.tiled(x, seq_idx)
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return block.tiled(x, seq_idx)

    model.checkpoint = block_checkpoint


def check_offload(args, ds_config: dict, tokens_per_rank: int, launched_run: bool):
    """--offload-activations (pool): the plan of this run's checkpoints from their shapes, checked against
    the host's memory before anything is built (``HostMemoryError`` on every rank alike when it does not
    fit). None without offload."""
    if not (args.activation_checkpointing and args.offload_activations and args.offload_impl == "pool"):
        return None
    from ds_mamba_spcp.memory import block_checkpoint_bytes, check_host_memory, plan_offload

    half = launched_run and any(ds_config.get(k, {}).get("enabled", False) for k in ("bf16", "fp16", "bfloat16"))
    micro, _ = _grad_accumulation(ds_config)
    sizes = block_checkpoint_bytes(tokens_per_rank, args.d_model, args.n_layers, 2 if half else 4, batch=micro)
    plan = plan_offload(sizes, int(args.offload_gpu_budget_gib * 2**30))
    verdict = check_host_memory(plan, headroom_bytes=int(args.offload_host_headroom_gib * 2**30))
    if not launched_run or int(os.environ.get("RANK", 0)) == 0:
        print(f"offload: {plan.describe()}; host check {verdict.needed / 2**30:.1f} GiB needed of "
              f"{verdict.available / 2**30:.1f} GiB available", flush=True)  # fmt: skip
    return plan


def mixer_backend(model) -> str:
    """The backend the Mamba2 layers run on ("triton" / "reference"), for the log."""
    from ds_mamba_spcp.module import DistributedMamba2
    from ds_mamba_spcp.ops import get_backend

    device = next(model.parameters()).device
    for m in model.modules():
        if isinstance(m, DistributedMamba2):
            if not m.config.enabled:
                return "mamba-ssm (sequence parallelism disabled)"
            return get_backend(m.config.backend, device).__name__.rsplit(".", 1)[-1]
    return "none"


# ------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------


class StepLog:
    """Per-step log line, JSON lines file and progress bar (rank 0 only)."""

    def __init__(self, args, enabled: bool, tokens_per_step: int, first_step: int = 1):
        self.enabled, self.tokens_per_step, self.records = enabled, tokens_per_step, []
        self.file = None
        if enabled and args.log_json:
            kept = _log_lines_before(args.log_json, first_step)  # a resumed run continues its log
            self.file = open(args.log_json, "w", encoding="utf-8")  # noqa: SIM115
            self.file.writelines(kept)
        self.bar = tqdm(total=args.steps, initial=first_step - 1, disable=not enabled or args.no_progress,
                        dynamic_ncols=True, leave=False)  # fmt: skip
        self.t0 = time.perf_counter()

    def step(self, step: int, loss: float, seconds: float, grad_norm: float | None = None) -> None:
        rec = {
            "step": step, "loss": loss, "tokens": self.tokens_per_step, "tokens_per_s": self.tokens_per_step / seconds,
            "step_s": seconds, "elapsed_s": time.perf_counter() - self.t0,
        }  # fmt: skip
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)  # the global gradient norm before clipping
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        hwm = _host_peak_rss()
        if hwm is not None:
            rec["host_peak_rss_gib"] = hwm / 2**30  # this process's peak resident memory (pinned pool included)
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


def _host_peak_rss() -> int | None:
    """VmHWM of /proc/self/status in bytes (None off Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _log_lines_before(path: str, first_step: int) -> list[str]:
    """The lines of an existing JSON-lines log for steps before ``first_step`` (those of the run a resume
    continues; later ones, logged after the checkpoint, are replaced by the resumed run's)."""
    if first_step <= 1 or not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [line for line in f if line.strip() and json.loads(line)["step"] < first_step]


def _grad_accumulation(ds_config: dict) -> tuple[int, int]:
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    if micro is None:
        raise ValueError('set "train_micro_batch_size_per_gpu" in the ds_config (the sequences per step and rank)')
    return int(micro), int(ds_config.get("gradient_accumulation_steps", 1))


def run_single(args, ds_config: dict) -> list[dict]:
    """The single-process reference: the whole sequence on one device, plain PyTorch optimizer."""
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    ds_config, cfg = with_block_tiles(ds_config, args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    offload_plan = check_offload(args, ds_config, args.seq_len, launched_run=False)  # before building
    model = build_model(args)
    # A group of one on the plain-PyTorch reference op on CPU (mamba-ssm's own kernels need CUDA).
    one = MambaSequenceParallelConfig(**{**cfg.model_dump(), "enabled": True, "sequence_parallel_size": 1,
                                         "mode": "state_passing", "load_balancing": "none",
                                         "input_layout": "contiguous"})  # fmt: skip
    wrap_mamba2_mixers(model, None, one)
    model.to(device).train()
    block_checkpointing(model, args, offload_plan=offload_plan)
    print(f"single process on {device}, Mamba2 backend {mixer_backend(model)}: {_describe(model, args)}", flush=True)
    return train_single_process(
        args, ds_config, model, device,
        lambda step, m, micro: make_batch(args, micro, batch_seed(args.seed, step, m, 0)),
        lambda batch: forward_loss(model, model, batch, None, 1.0, args),
    )  # fmt: skip


def train_single_process(args, ds_config: dict, model, device, full_batch, loss_of) -> list[dict]:
    """The single-process loop (plain PyTorch optimizer of the ds_config, gradient accumulation, clipping).

    ``full_batch(step, micro_index, micro_batch_size)`` gives full rows, ``loss_of(batch)`` the (loss, mean
    loss) of one batch as ``shard_batch`` (a group of one) makes it, on ``device``."""
    micro, gas = _grad_accumulation(ds_config)
    optimizer = torch_optimizer(ds_config, model.parameters())
    clip = float(ds_config.get("gradient_clipping", 0.0))
    log = StepLog(args, True, micro * gas * args.seq_len)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        losses = []
        for m in range(gas):
            full = full_batch(step, m, micro)
            batch = {k: v.to(device) for k, v in shard_batch(full, rank=0, world_size=1).items()}
            loss, mean_loss = loss_of(batch)
            (loss / gas).backward()
            losses.append(mean_loss.item())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip > 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.step(step, sum(losses) / gas, time.perf_counter() - t0, grad_norm)
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


# ------------------------------------------------------------------------------------------------
# checkpoints and faults (ds_mamba_spcp.checkpoint; docs/checkpointing.md)
# ------------------------------------------------------------------------------------------------

# What a checkpoint is bound to: the model's shape (its weights) and the data stream (the batches of a
# step are a function of the seed, the step, the micro-batch index and the data-parallel rank).
MODEL_ARGS = ("model", "vocab_size", "d_model", "n_layers", "d_state", "d_conv", "expand", "headdim", "ngroups",
              "chunk_size", "tie_embeddings")  # fmt: skip
HYBRID_ARGS = ("attn_every", "attn_heads")


def seed_generators(seed: int) -> None:
    """Seeds python's and numpy's generators (``build_model`` seeds torch's) alike on every rank, so that
    the ranks sharing a sequence hold the same RNG states and a checkpoint's states map onto another
    sequence-parallel size (``ds_mamba_spcp.checkpoint`` refuses per-rank states there)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)


def dist_timeout(args) -> timedelta:
    """--dist-timeout, or DeepSpeed's default (``$DEEPSPEED_TIMEOUT`` minutes, 10 when unset)."""
    from deepspeed.constants import default_pg_timeout

    return default_pg_timeout if args.dist_timeout is None else timedelta(seconds=args.dist_timeout)


def run_identity(args, ds_config: dict, dp: int) -> dict:
    """The settings a resumed run must share with the run that saved the checkpoint."""
    micro, gas = _grad_accumulation(ds_config)
    keys = MODEL_ARGS + (HYBRID_ARGS if args.model == "hybrid" else ())
    return {
        "model": {k: getattr(args, k) for k in keys},
        "data": {"seed": args.seed, "seq_len": args.seq_len, "train_micro_batch_size_per_gpu": micro,
                 "gradient_accumulation_steps": gas, "data_parallel_size": dp},
    }  # fmt: skip


def save(engine, args, ds_config: dict, next_data_step: int, dp: int) -> None:
    """A checkpoint of this rank's engine, its RNG states and the data position (every rank calls it)."""
    import deepspeed.comm as dist

    t0 = time.perf_counter()
    state = {"next_data_step": next_data_step, **run_identity(args, ds_config, dp)}
    tag = checkpointing.save_checkpoint(engine, args.save_dir, client_state=state)
    if dist.get_rank() == 0:
        tqdm.write(f"saved checkpoint {os.path.join(args.save_dir, tag)} ({time.perf_counter() - t0:.2f} s)")


def resume_plan(args, ds_config: dict, sp: int):
    """How to resume from --save-dir (None: it holds no checkpoint yet, start at step 1). Raises, on every
    rank and before anything is loaded, when the checkpoint does not fit this run."""
    import deepspeed.comm as dist

    found = checkpointing.find_checkpoint(args.save_dir)
    if found is None:
        if dist.get_rank() == 0:
            print(f"--resume: {args.save_dir} holds no checkpoint yet; starting at step 1", flush=True)
        return None
    now = run_identity(args, ds_config, dist.get_world_size() // sp)
    saved = found.client_state
    diffs = [
        f"{key} {saved[part].get(key)!r} -> {value!r}"
        for part in ("model", "data")
        for key, value in now[part].items()
        if saved[part].get(key) != value
    ]
    if diffs:
        raise ValueError(
            f"cannot resume from {found.path}: this run differs from the one that saved it in {', '.join(diffs)} "
            "(saved -> now). The model's shape must match the saved weights, and the batches continue exactly only "
            "with the same seed, sequence length and sequences per step (micro-batch x accumulation x data-parallel "
            "size; the sequence-parallel size may change). Use the saved values, or another --save-dir for a new run."
        )
    rng = "skip" if "rng" in args.resume_without else "restore"
    return checkpointing.plan_resume(found, ds_config, sequence_parallel_size=sp, rng=rng)


def resume(engine, plan, args) -> tuple[int, int]:
    """Loads the planned checkpoint into ``engine``. Returns ``(first_step, data_offset)``: the loop
    runs from ``first_step`` and draws the batches of step ``step + data_offset``."""
    import deepspeed.comm as dist

    t0 = time.perf_counter()
    client = checkpointing.load_checkpoint(engine, plan, load_optimizer_states="optimizer" not in args.resume_without)
    first_step = engine.global_steps + 1
    if client["next_data_step"] != first_step:
        raise RuntimeError(
            f"{plan.checkpoint.path}: data position {client['next_data_step']} but optimizer step "
            f"{engine.global_steps}; this script saves them together, so the checkpoint is inconsistent"
        )
    # negative control (--resume-without data_position): the batches start over from step 1
    data_offset = 1 - first_step if "data_position" in args.resume_without else 0
    if dist.get_rank() == 0:
        skipped = f" (not restored: {', '.join(args.resume_without)})" if args.resume_without else ""
        print(f"resumed at step {first_step} from {plan.describe()}{skipped} ({time.perf_counter() - t0:.2f} s)",
              flush=True)  # fmt: skip
        if first_step > args.steps:
            print(f"the checkpoint is past --steps {args.steps}: nothing left to train", flush=True)
    return first_step, data_offset


def fault_drill() -> None:
    """--fault-drill: this rank freezes (SIGSTOP) in the middle of a step, as a hung process would. The
    other ranks wait in the step's next collective: until this rank is killed (the launcher, or the
    transport, notices) or until the process-group timeout (--dist-timeout) raises there."""
    print(f"fault drill: pid {os.getpid()} stops itself (SIGSTOP) in the middle of a step", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def run_distributed(args, ds_config: dict) -> list[dict]:
    """One rank of a launched run: shard, train through DeepSpeed, log the global loss on rank 0."""
    import deepspeed
    import deepspeed.comm as dist

    from ds_mamba_spcp import comm

    if not args.verbose:
        deepspeed.utils.logger.setLevel("WARNING")
    if args.shared_gpu:  # before DeepSpeed binds rank i to cuda:i
        os.environ["LOCAL_RANK"] = "0"
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if args.shared_gpu else None, verbose=args.verbose,
                                   timeout=dist_timeout(args))  # fmt: skip
    world, rank = dist.get_world_size(), dist.get_rank()
    ds_config, cfg = with_block_tiles(ds_config, args)
    if torch.cuda.is_available() and not args.shared_gpu:
        # the device DeepSpeed binds this rank to, now: the offload's check and pinned pool run before initialize
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "data_parallel_size" in ds_config:
        raise ValueError(
            'drop "data_parallel_size" from the ds_config: this script builds the sequence-parallel groups itself '
            "(DeepSpeed's parallel_state_sp, consecutive ranks per sequence) before deepspeed.initialize"
        )
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
    plan = resume_plan(args, ds_config, sp) if args.resume else None  # before initialize: it may change the config

    offload_plan = check_offload(args, ds_config, args.seq_len // sp, launched_run=True)  # before building
    seed_generators(args.seed)  # python's and numpy's too: the same states on every rank (a checkpoint keeps them)
    model = build_model(args)
    parallelize(model, group, cfg)
    block_checkpointing(model, args, mpu, offload_plan)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=plan.ds_config if plan else ds_config, mpu=mpu,
    )  # fmt: skip
    checkpointing.set_process_group_timeout(dist_timeout(args))  # every group: the ones made above and DeepSpeed's
    first_step, data_offset = resume(engine, plan, args) if plan else (1, 0)
    scale = grad_scale_for_engine(engine) if args.grad_scale == "auto" else float(args.grad_scale)
    log = StepLog(args, rank == 0, micro * gas * (world // sp) * args.seq_len, first_step)
    if rank == 0:
        print(
            f"{world} ranks, sequence_parallel_size {sp}, ZeRO stage {engine.zero_optimization_stage()}, "
            f"mode {cfg.mode}, load_balancing {cfg.load_balancing}, input_layout {cfg.input_layout}, "
            f"grad scale {scale:g}, {engine.device}, Mamba2 backend {mixer_backend(model)}: {_describe(model, args)}",
            flush=True,
        )
    for step in range(first_step, args.steps + 1):
        t0 = time.perf_counter()
        losses = []
        data_step = step + data_offset  # the data position (the step, unless a negative control shifts it)
        for m in range(gas):
            full = make_batch(args, micro, batch_seed(args.seed, data_step, m, dp_rank))
            batch = shard_batch(full, group, layout=cfg.input_layout, rank=sp_rank, world_size=sp)
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss, mean_loss = forward_loss(model, engine, batch, group, scale, args)
            if args.fault_drill == (rank, step) and m == 0:
                fault_drill()
            engine.backward(loss)
            engine.step()
            losses.append(mean_loss)
        # the global loss: the mean over micro-batches and data-parallel replicas (equal on SP ranks)
        total = torch.stack(losses).mean().reshape(1)
        dist.all_reduce(total)
        norm = engine.get_global_grad_norm() if engine.gradient_clipping() > 0 else None
        log.step(step, total.item() / world, time.perf_counter() - t0, None if norm is None else float(norm))
        if args.save_dir and (step == args.steps or (args.save_every and step % args.save_every == 0)):
            save(engine, args, ds_config, next_data_step=data_step + 1, dp=world // sp)
    log.close()
    if engine.device.type == "cpu" and "MASTER_PORT" in os.environ:
        dist.barrier()  # nobody needs DeepSpeed's CPU all-reduce buffers any more: free them (it never does)
        comm.remove_deepspeed_shm_buffers(int(os.environ["MASTER_PORT"]), os.environ.get("MASTER_ADDR", "127.0.0.1"))
    return log.records


def _describe(model, args) -> str:
    nparams = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 partitions p
    kind = "Mamba2" if args.model == "mamba" else f"hybrid Mamba2 + attention every {args.attn_every}"
    tiles = {b.tile_tokens() for b in model.layers} - {None}
    return (
        f"{kind} LM, {args.n_layers} layers, d_model {args.d_model}, {nparams / 1e3:.1f}K parameters, "
        f"seq_len {args.seq_len}" + (f", block tiles of {tiles.pop()} tokens" if tiles else "")
    )


def launched() -> bool:
    """True under the deepspeed launcher (or torchrun): the rank environment is set."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def read_config_and_share_cores(path: str) -> dict:
    """The ds_config at ``path``; on CPU, each local rank takes its share of the host's cores (instead of
    every rank taking them all)."""
    with open(path, encoding="utf-8") as f:
        ds_config = json.load(f)
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1))) if launched() else 1
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return ds_config


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    ds_config = read_config_and_share_cores(args.deepspeed_config)
    if launched():
        return run_distributed(args, ds_config)
    if args.save_dir or args.fault_drill:
        raise ValueError(
            "--save-dir, --resume and --fault-drill need DeepSpeed (the single-process reference is plain PyTorch): "
            "run one rank through the launcher, `deepspeed --num_gpus 1 examples/train.py ...`"
        )
    return run_single(args, ds_config)


if __name__ == "__main__":
    main()
    from ds_mamba_spcp.comm import shutdown

    shutdown()  # a gloo rank can abort at exit while its group lives
