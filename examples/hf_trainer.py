"""Train a tiny Nemotron-H hybrid with transformers' plain ``Trainer`` and DeepSpeed sequence parallelism.

    torchrun --nproc_per_node 2 examples/hf_trainer.py                 # 2 ranks, sp_size 2
    accelerate launch --num_processes 2 examples/hf_trainer.py         # the same through accelerate (on CPU: --cpu)
    deepspeed --num_gpus 2 examples/hf_trainer.py                      # the same through DeepSpeed's launcher
    python examples/hf_trainer.py                                      # one process: the reference
    python examples/hf_trainer.py --long-context --tile-tokens 16      # long context (docs/huggingface.md)
    torchrun --nproc_per_node 2 examples/hf_trainer.py --model llama   # a Llama: accelerate's own path (below)

The script is what a Trainer user already writes; the only addition is ``mamba_sp.enable()`` before the
Trainer is built. Launched on N ranks it asks accelerate for DeepSpeed's sequence parallelism over all of them
(``ParallelismConfig(sp_backend="deepspeed", sp_size=N)``); the ds_config (``--deepspeed``, default
``configs/hf_trainer.json``) carries the ``"mamba_sequence_parallel"`` section that ``enable()`` reads. Run as
plain ``python`` the same script trains the same model on the same data in one process, so the two logs
(``--log-json``) can be compared step by step. The model is ``NemotronHForCausalLM`` from a config (Mamba2,
attention and MLP layers as ``--pattern`` says), the data random token rows whose length changes between
steps: nothing is downloaded. On CPU (no CUDA) the ranks run on gloo.

``--long-context`` adds the section's ``"long_context"`` key (tiled layers, tiled MLPs, the fused loss; with
``--offload-gpu-budget-gib`` the layer checkpoints past that budget go to host memory): the same losses, memory per
token flat in the length, at any number of ranks (tiled layers too).

``--model llama`` trains a tiny ``LlamaForCausalLM`` instead, a model without Mamba2 mixers, which ``enable()``
leaves to accelerate, DeepSpeed and transformers as they are (rows of ``--seq-len`` tokens: DeepSpeed's own
data-loader adapter gathers rows of one length only on gloo): what a user of other models gets
(docs/huggingface.md, "Other models"). ``--grad-accum`` sets ``gradient_accumulation_steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "hf_trainer.json")
LAYER_KINDS = {"M": "mamba", "*": "attention", "-": "mlp"}  # Nemotron-H's pattern letters


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed", default=DEFAULT_CONFIG, help="ds_config JSON (default: %(default)s)")
    p.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=64, help="longest row (rows are 3/4 to all of it, even lengths)")
    p.add_argument("--pattern", default="M*-M-", help="layers: M Mamba2, * attention, - MLP")
    p.add_argument("--model", choices=("nemotron_h", "llama"), default="nemotron_h")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-context", action="store_true", help='the section\'s "long_context" key')
    p.add_argument("--tile-tokens", type=int, default=None, help="long_context.tile_tokens (default: the key's)")
    p.add_argument("--offload-gpu-budget-gib", type=float, default=None, help="long_context.offload_gpu_budget_gib")
    p.add_argument("--parts-off", default="", help='long_context parts turned off, e.g. "tiled_layers,fused_loss"')
    p.add_argument("--log-json", default=None, help="write one JSON object per step (step, loss, grad_norm)")
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary folder)")
    return p.parse_args(argv)


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM, NemotronHConfig, NemotronHForCausalLM

    if args.model == "llama":
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, tie_word_embeddings=False, initializer_range=0.1, use_cache=False,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        torch.manual_seed(args.seed)
        return LlamaForCausalLM(config)

    config = NemotronHConfig(
        vocab_size=64, hidden_size=32, layers_block_type=[LAYER_KINDS[c] for c in args.pattern],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=16, tie_word_embeddings=False,
        initializer_range=0.1, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"  # DeepSpeed's Ulysses attention needs a kernel that masks causally itself
    torch.manual_seed(args.seed)
    return NemotronHForCausalLM(config)


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, rows: int, length: int, seed: int) -> None:
        self.ids = torch.randint(0, 64, (rows, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def collate(rows, longest: int, multiple: int = 8):
    """Rows cropped to one length per batch (a multiple of 8 from 3/4 of ``longest`` up, picked from the batch's
    tokens), with labels and position_ids (DeepSpeed's adapter cuts every row by them)."""
    ids = torch.stack([r["input_ids"] for r in rows])
    shortest = max(1, (3 * longest // 4) // multiple)
    length = multiple * (shortest + int(ids[0, :4].sum()) % (longest // multiple - shortest + 1))
    ids = ids[:, :length]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length).expand_as(ids).clone()}


def ds_config(args) -> dict:
    """The ds_config file, with the section's ``"long_context"`` key when ``--long-context`` asks for it."""
    with open(args.deepspeed, encoding="utf-8") as f:
        config = json.load(f)
    if args.long_context:
        key = {part: False for part in filter(None, args.parts_off.split(","))}
        if args.tile_tokens is not None:
            key["tile_tokens"] = args.tile_tokens
        if args.offload_gpu_budget_gib is not None:
            key["offload_gpu_budget_gib"] = args.offload_gpu_budget_gib
        config.setdefault("mamba_sequence_parallel", {})["long_context"] = key
    return config


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:  # plain python: DeepSpeed still wants a (one-process) distributed environment
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from ds_mamba_spcp.integrations.transformers import accelerate as mamba_sp

    mamba_sp.enable()  # the one line: before the Trainer is built (in one process it acts on "long_context" only)
    parallelism = None
    if world > 1:
        from accelerate.utils import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        parallelism = ParallelismConfig(
            sp_backend="deepspeed", sp_size=world,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
        )  # fmt: skip
    model = build_model(args)
    cuda = torch.cuda.is_available()
    training = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_"), deepspeed=ds_config(args),
        parallelism_config=parallelism, per_device_train_batch_size=2, max_steps=args.steps, learning_rate=args.lr,
        gradient_accumulation_steps=args.grad_accum,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
        report_to=[], seed=args.seed, use_cpu=not cuda, bf16=False, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    if args.model == "llama" and world > 1 and not cuda:
        # on CPU accelerate starts torch.distributed but not deepspeed.comm, whose sequence-parallel group DeepSpeed's
        # own path asserts (enable() does the same for the models it shards)
        import deepspeed

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    records: list[dict] = []

    class Log(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **kw):
            if logs and "loss" in logs and "grad_norm" in logs:
                records.append({"step": state.global_step, "loss": logs["loss"], "grad_norm": float(logs["grad_norm"])})

    rows = TokenRows(8 * args.steps, args.seq_len, args.seed)
    longest = args.seq_len
    multiple = args.seq_len if args.model == "llama" else 8  # a Llama's rows: all of --seq-len (docstring)
    trainer = Trainer(
        model=model, args=training, train_dataset=rows, data_collator=lambda b: collate(b, longest, multiple),
        callbacks=[Log()],
    )  # fmt: skip
    trainer.train()
    if args.log_json and trainer.is_world_process_zero():
        with open(args.log_json, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return records


if __name__ == "__main__":
    main()
