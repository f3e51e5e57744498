"""Training through transformers' ``Trainer`` at given lengths, on one GPU or on ``--sp`` ranks sharing each row,
transformers' own path against the long-context one (issue 37): the longest row that trains, step time, tokens/s
and what holds the memory.

Each trial is fresh processes (so one OOM cannot fragment the next trial's memory): a Bamba (or, ``hf-qwen35-*``,
Qwen3.5) model of the preset (random init, bf16 on GPU / fp32 on CPU), a dataset of one row of L random token ids
(labels = input_ids) and a plain ``Trainer`` (batch 1, activation checkpointing, AdamW, lr 1e-5, ``--steps`` steps)
under DeepSpeed (ZeRO ``--zero``, bf16, the ``"mamba_sequence_parallel"`` section), started as a torch.distributed
job by this script itself (env MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE: no launcher). Two paths:

    transformers   the model as transformers runs it, mamba-ssm's Triton kernels bound (imported before
                   transformers' modeling code on a GPU); nothing of this package touches the model at --sp 1
    long_context   the section's ``"long_context"`` key (``--tile-tokens``, ``--offload-gpu-budget-gib``) and
                   ``ds_mamba_spcp.integrations.accelerate.enable()`` before the Trainer is built

``--sp N`` (N > 1): N processes per trial, one process group (killed whole at ``--trial-timeout``, and
``RANK_GRACE_S`` after one rank failed while others still run), the Trainer given DeepSpeed's sequence parallelism
through accelerate (``ParallelismConfig(sp_backend="deepspeed", sp_size=N)``, variable lengths, SDPA) as
examples/hf_trainer.py does, and ``enable()`` on both paths (accelerate alone refuses Bamba; on the transformers
path the section has no ``"long_context"``). L is the whole row's length (each rank holds L/N; L must divide by
N); tokens/s counts the whole row. The key's parts run at any N (tiled layers on each rank's shard). Rank r runs on
cuda:r with nccl; ``--shared-gpu`` puts every rank on cuda:0 with gloo (LOCAL_RANK=0 for all: accelerate and
DeepSpeed pick the device from it; the process group is up before the Trainer, which keeps it); on CPU, gloo.
Each rank records its own steps, losses and peaks: the trial's record is rank 0's, every rank's values listed in
``per_rank``, status "ok" only if every rank's is (else the status and reason of the rank that failed first).
``--peak-check L`` runs one process at L and N ranks on one GPU at N*L (each rank holding L tokens, the same
``"long_context"`` key) and records each rank's GPU peak over the one process's (the issue's bound: 1.1x) and the
same of the transient peaks.

    # both paths at 64K and the ratio of their last steps
    python benchmarks/train_hf.py --preset hf-bamba-2b --compare-at 65536 --out /tmp/hf_65k.json
    # the longest row on the long-context path: 131072, x1.5, ... (multiples of 16384) up to 1.6M, first failure stops
    python benchmarks/train_hf.py --preset hf-bamba-2b --long-context --offload-gpu-budget-gib 40 \\
        --search 131072 --factor 1.5 --max 1600000 --out /tmp/hf_long.json
    # 8 H200s: 8,388,608 tokens, 1,048,576 on each rank (checkpoints past 40 GiB a rank on the host: 8 x 52 GiB)
    python benchmarks/train_hf.py --preset hf-bamba-2b --long-context --sp 8 --lengths 8388608 --steps 3 \\
        --offload-gpu-budget-gib 40 --out /tmp/hf_sp8.json
    # 2 H200s: 2,097,152 tokens, 1,048,576 on each rank
    python benchmarks/train_hf.py --preset hf-bamba-2b --long-context --sp 2 --lengths 2097152 --steps 3 \\
        --offload-gpu-budget-gib 16 --out /tmp/hf_sp2.json
    # one H200: the peak check, one process at 65,536 against 2 ranks sharing the GPU at 131,072
    python benchmarks/train_hf.py --preset hf-bamba-2b --long-context --sp 2 --peak-check 65536 \\
        --out /tmp/hf_peak.json

``--trainer sft``: TRL's ``SFTTrainer`` instead of the plain ``Trainer`` (a word-level tokenizer over the preset's
vocabulary built here): packed rows (TRL's padding-free rows of ``max_length`` L, ``--docs-per-row`` documents of
equal length each, position_ids restarting per document). TRL computes the loss with its own fused head on both
paths (the key's fused loss leaves it to TRL: record ``loss_by``), and logs ``entropy`` and ``mean_token_accuracy``
(recorded per step). ``--grad-accum N``: N micro-batches a step. ``--padded``: batches of two rows, of L and
``short_row(L)`` = 3L/4 tokens, the shorter right-padded to L (attention_mask 0 and label -100 there; with
``--trainer sft`` packing is off and TRL's collator pads; the key's tiled layers take right padding; transformers'
sdpa attention builds an (L x L) mask for a padded batch). The rows of a step are the whole dataset, read in order
(``row_lengths``).
Every record states ``trainer``, ``grad_accum``, ``padded``, ``packed``, ``docs_per_row`` and ``steps`` (the
table's "run" column), and tokens/s counts the step's tokens (``tokens_per_step``: every row's, padding not
counted). ``--compare-at L --trainer sft`` puts the key's run beside TRL's without it.

    # TRL, packed rows, accumulation 2, 3 steps: with the key beside TRL alone at 64K, then the longest
    python benchmarks/train_hf.py --trainer sft --grad-accum 2 --steps 3 --compare-at 65536 --out /tmp/sft.json
    python benchmarks/train_hf.py --trainer sft --grad-accum 2 --steps 3 --long-context --offload-gpu-budget-gib 16 \
        --search 131072 --factor 1.5 --max 1600000 --out /tmp/sft_long.json
    # right-padded batches of two rows
    python benchmarks/train_hf.py --trainer sft --padded --grad-accum 2 --steps 3 --long-context \
        --lengths 65536 --out /tmp/sft_padded.json

Per trial: status ("ok", "oom": torch's OutOfMemoryError or a CUDA "out of memory", "error": any other exception,
its type and message, "timeout", "killed": SIGKILL, the host's out-of-memory killer most likely), each step's wall
time (synchronized at the step's begin and end), the last step's, tokens/s of the last step, the GPU peak of each
step (``max_memory_allocated`` / ``max_memory_reserved``, reset at each step's begin), the host peak (ru_maxrss),
and, at the end of the last step, the bytes on the model's device that hold: the parameters, the gradients (the
parameters' and master weights' ``.grad`` and DeepSpeed's gradient buffers), the optimizer states (the fp32
master partition and AdamW's moments), the other tensors DeepSpeed's optimizer keeps, the layer checkpoints and
pinned host bytes (``long_context.memory_report(model)`` where that function exists, else None) and the transient
peak: the last step's GPU peak less all of those. Storages are counted once each. The JSON (rewritten after every
trial, records appended to an existing file) and a Markdown table land beside ``--out``; a failed trial's output
beside them (``<out>_<path>_<L>.log``, ``<out>_<path>_<L>_sp<N>.log``: every rank's).

Presets: ``hf-bamba-2b`` (1.93B parameters: 24 layers of d_model 2048, attention at layers 6, 12, 18 with 16
heads / 4 key-value heads, Mamba2 64 heads of 64, d_state 128, one group, chunk 256, MLP 5632, vocab 128000,
untied head); ``hf-bamba-tiny`` (the CPU smoke's: 3 layers, attention at layer 1, vocab 256); ``hf-qwen35-2b``
(2.00B parameters, transformers' ``Qwen3_5ForCausalLM``, the text-only Qwen3.5: 24 layers of d_model 2048, Gated
DeltaNet layers and gated attention 3 : 1 (attention at layers 3, 7, ..., 23, 8 heads of 256 / 2 key-value
heads), delta layers of 16 key and 16 value heads of K = V = 128, conv 4, MLP 6144, vocab 151,936, untied head);
``hf-qwen35-tiny`` (its CPU smoke: 4 layers, attention at layer 3, vocab 256). On the long-context path the delta
layers run this package's op (at ``--sp`` 1 too) and each is recomputed whole inside its decoder layer's checkpoint
(no tiled delta layer: docs/huggingface.md, "Long context"); their backward runs on flash-linear-attention, on a
Hopper GPU with Triton 3.6 with ``ops/delta_dqkwg.py`` in place of the one kernel fla 0.6.0 refuses there (before it,
on the op's plain-PyTorch backend: benchmarks/results/hf_qwen35_a731f5c_h100x1/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # run as a script from a checkout: make the package importable
    sys.path.insert(0, REPO)

SCHEMA = "ds_mamba_spcp.train_hf/1"
SECTION = "mamba_sequence_parallel"
PATHS = ("transformers", "long_context")
MAX_FACTOR = 1.5
GIB = 2**30
PEAK_BOUND = 1.1  # --peak-check: each rank's GPU peak at N*L against one process's at L (the bound)
RANK_GRACE_S = 60.0  # after one rank of a trial fails, the others get this long to end before they are killed
PRESETS = {
    "hf-bamba-2b": dict(
        vocab_size=128000, hidden_size=2048, num_hidden_layers=24, attn_layer_indices=[6, 12, 18],
        num_attention_heads=16, num_key_value_heads=4, mamba_n_heads=64, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, intermediate_size=5632,
        tie_word_embeddings=False,
    ),
    "hf-bamba-tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, intermediate_size=128, tie_word_embeddings=False,
    ),
    # Qwen3.5-style (transformers' Qwen3_5ForCausalLM, the text-only causal LM): 3 Gated DeltaNet layers to 1 gated
    # attention layer (Qwen3.5's layer_types default), delta heads of K = V = 128, Qwen's 151,936-token vocabulary
    "hf-qwen35-2b": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, intermediate_size=6144, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    ),
    "hf-qwen35-tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    ),
}  # fmt: skip
# the family of a preset's model: transformers' (config class, CausalLM class)
FAMILIES = {"bamba": ("BambaConfig", "BambaForCausalLM"), "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")}
# tensors DeepSpeed's optimizers keep for gradients (ZeRO 1/2, ZeRO-3, the bf16 optimizer of ZeRO 0)
GRAD_BUFFERS = ("grads_in_partition", "ipg_buffer", "averaged_gradients", "grad_partitions_flat_buffer",
                "fp32_groups_gradients_flat", "temp_grad_buffer_for_gpu_offload")  # fmt: skip


def progress(msg: str) -> None:
    print(f"[train_hf] {msg}", file=sys.stderr, flush=True)


def family(preset: str) -> str:
    return "qwen3_5" if preset.startswith("hf-qwen35") else "bamba"


def preset_config(preset: str):
    import transformers

    cfg = getattr(transformers, FAMILIES[family(preset)][0])(**PRESETS[preset], use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def preset_model(preset: str):
    """The preset's model, initialised by transformers (on the current default device)."""
    import transformers

    return getattr(transformers, FAMILIES[family(preset)][1])(preset_config(preset))


def parameter_count(preset: str) -> int:
    """The preset's parameters, counted on the meta device (nothing allocated)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in preset_model(preset).parameters())


def long_context_key(args) -> dict:
    key = {}
    if args.tile_tokens is not None:
        key["tile_tokens"] = args.tile_tokens
    if args.offload_gpu_budget_gib is not None:
        key["offload_gpu_budget_gib"] = args.offload_gpu_budget_gib
    for part in filter(None, args.parts_off.split(",")):
        key[part] = False
    return key


def ds_config(args, path: str) -> dict:
    """ZeRO ``--zero``, bf16 as the Trainer says, batch sizes and clipping from the Trainer; the section, with the
    ``"long_context"`` key on the long-context path (on the transformers path nothing reads the section: no
    ``enable()``)."""
    section = {"enabled": True}
    if path == "long_context":
        section["long_context"] = long_context_key(args)
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": args.zero},
        "bf16": {"enabled": "auto"},
        "zero_allow_untested_optimizer": True,  # the Trainer's torch AdamW
        "steps_per_print": 10**9,
        SECTION: section,
    }


def round_to(x: float, multiple: int) -> int:
    """``x`` to the nearest multiple (halves up), at least one multiple."""
    return max(multiple, int(x / multiple + 0.5) * multiple)


def search_lengths(start: int, factor: float, maximum: int, multiple: int) -> list[int]:
    """start, start * factor, start * factor**2, ... rounded to ``multiple``, up to ``maximum``; each one more than
    the one before."""
    out, k = [], 0
    while True:
        length = round_to(start * factor**k, multiple)
        if out and length <= out[-1]:
            length = out[-1] + multiple
        if length > maximum:
            return out
        out.append(length)
        k += 1


# ---------------------------------------------------------------------------------------------------
# one trial: this script again, in its own process (--trial)
# ---------------------------------------------------------------------------------------------------


def _distributed_env() -> None:
    """A one-process torch.distributed job without a launcher (DeepSpeed wants one)."""
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    for k, v in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1").items():
        os.environ.setdefault(k, v)


def _load_kernels_first() -> None:
    """mamba-ssm's Triton modules before transformers' modeling code, the bare package left importable: transformers
    then binds mamba-ssm's fused kernels (what tests/hf_models.load_kernels_first does)."""
    from ds_mamba_spcp.ops.kernels.upstream import expose_mamba_package, mamba_module

    mamba_module("ops.triton.ssd_combined")
    expose_mamba_package()


def _bound_kernel(preset: str = "hf-bamba-2b") -> str | None:
    """What transformers' own path calls in training for the preset's mixer (Bamba's Mamba2 scan, Qwen3.5's chunked
    gated delta rule): ``module.function`` of the bound kernel, or "torch" for its reference implementation; None
    where that cannot be read. (On the long-context path the mixers run this package's op instead.)"""
    import inspect

    try:
        if family(preset) == "qwen3_5":
            from transformers.models.qwen3_5 import modeling_qwen3_5

            fn = modeling_qwen3_5.torch_chunk_gated_delta_rule
        else:
            from transformers.models.bamba import modeling_bamba

            fn = modeling_bamba.mamba2_split_conv1d_scan_combined
        bound = inspect.getclosurevars(fn).nonlocals
        if not bound.get("is_new_implementation"):
            return "torch"
        impl = bound["implementation"]
        return f"{impl.__module__}.{impl.__qualname__}"
    except Exception:  # noqa: BLE001 - transformers' wrapper changed: say nothing rather than something wrong
        return None


def _flat_tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat_tensors(v)


def memory_breakdown(engine, model, device) -> dict:
    """Bytes of the tensors on ``device`` (its type) that hold the parameters, the optimizer states, the gradients
    and the rest of DeepSpeed's optimizer, each storage counted once, in that order (a parameter that is a view of
    DeepSpeed's flat buffer counts that buffer once)."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or t.device.type != device.type:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in seen:
                continue
            seen.add(ptr)
            total += storage.nbytes()
        return total

    params = list(model.parameters())
    out = {"parameters": count(p for t in params for p in (t, getattr(t, "ds_tensor", None)))}
    opt = getattr(engine, "optimizer", None)
    base = getattr(opt, "optimizer", opt)
    master = [p for g in base.param_groups for p in g["params"]] if base is not None else []
    states = [v for s in base.state.values() for v in _flat_tensors(s) if v.dim() > 0] if base is not None else []
    out["optimizer_master"] = count(master)
    out["optimizer_moments"] = count(states)
    out["optimizer_states"] = out["optimizer_master"] + out["optimizer_moments"]
    grads = [p.grad for p in params + master]
    grads += [t for name in GRAD_BUFFERS for t in _flat_tensors(getattr(opt, name, None))]
    out["gradients"] = count(grads)
    out["optimizer_other"] = count(t for v in (vars(opt).values() if opt is not None else ()) for t in _flat_tensors(v))
    return out


def _memory_report(model) -> tuple[dict | None, str | None]:
    """``long_context.memory_report(model)`` as JSON values, or (None, why not)."""
    try:
        from ds_mamba_spcp.integrations.transformers.long_context import memory_report
    except ImportError as e:
        return None, f"not importable: {e}"
    try:
        report = memory_report(model)
    except Exception as e:  # noqa: BLE001 - recorded: the benchmark's numbers stand without it
        return None, f"{type(e).__name__}: {e}"
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in report.items()}, None


def _failure(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of an exception out of a trial."""
    import torch

    reason = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".strip()
    oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
    return ("oom" if oom else "error"), reason[:2000]


def run_trial(args) -> dict:
    """One rank's training run of ``args.trial`` tokens (the whole row: each of the ``--sp`` ranks holds its
    ``1/sp``) on ``args.trial_path``; its record (also written to ``args.trial_out``, whatever happens)."""
    _distributed_env()
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("MAMBA_DETERMINISTIC", "1")  # as tests/hf_models.load_kernels_first
    length, path = args.trial, args.trial_path
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rec = dict(model=args.preset, path=path, length=length, steps=args.steps, zero=args.zero, sp=args.sp, rank=rank,
               trainer=args.trainer, grad_accum=args.grad_accum, padded=bool(args.padded), rows_per_batch=2 if
               args.padded else 1, packed=args.trainer == "sft" and not args.padded,
               docs_per_row=args.docs_per_row if args.trainer == "sft" and not args.padded else None,
               shared_gpu=bool(args.shared_gpu and cuda), status="error", step_s=[], step_gpu_peak_allocated=[],
               step_gpu_peak_reserved=[], step_held_at_begin=[], losses=[], ds_config=ds_config(args, path),
               mamba_deterministic=os.environ.get("MAMBA_DETERMINISTIC"))  # fmt: skip
    if path == "long_context":
        rec["long_context"] = long_context_key(args)
    state = {}
    try:
        if world != args.sp or length % args.sp:
            raise ValueError(f"--sp {args.sp} needs WORLD_SIZE={args.sp} (got {world}) and a length that divides by it "
                             f"(got {length})")  # fmt: skip
        if cuda:
            _load_kernels_first()  # before transformers' modeling code is imported
        _train(args, rec, state, cuda)
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - every failure is a record
        rec["status"], rec["reason"] = _failure(e)
        rec["traceback"] = traceback.format_exc()[-4000:]
        progress(rec["traceback"])
    if cuda:
        rec["gpu_peak_allocated_at_end"] = torch.cuda.max_memory_allocated()
        rec["gpu_peak_reserved_at_end"] = torch.cuda.max_memory_reserved()
    rec["host_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if rec["step_s"]:
        rec["last_step_s"] = rec["step_s"][-1]
        # the step's tokens: every row's (the whole row's under sequence parallelism), padding not counted
        rec["tokens_per_s"] = rec.get("tokens_per_step", length) / rec["last_step_s"]
        rec["gpu_peak_allocated"] = max(rec["step_gpu_peak_allocated"], default=None)
        rec["gpu_peak_reserved"] = max(rec["step_gpu_peak_reserved"], default=None)
    holds = state.get("holds")
    if holds is not None:
        report = rec.get("memory_report") or {}
        holds["checkpoints_gpu"] = report.get("checkpoint_gpu_bytes")
        holds["checkpoints_host"] = report.get("checkpoint_host_bytes")
        peak = rec["step_gpu_peak_allocated"][-1] if cuda and rec["step_gpu_peak_allocated"] else None
        persistent = holds["parameters"] + holds["gradients"] + holds["optimizer_states"] + holds["optimizer_other"]
        holds["transient_peak"] = None if peak is None else peak - persistent - (holds["checkpoints_gpu"] or 0)
        rec["holds"] = holds
    rec["pinned_host"] = (rec.get("memory_report") or {}).get("checkpoint_host_bytes")
    with open(args.trial_out, "w") as f:
        json.dump(rec, f, indent=1)
    if rec["status"] == "ok" and args.sp > 1:
        # every rank past its last collective before any exits (main's os._exit): an early exit would break a
        # peer's last collective into an error. A failed rank exits at once (the driver ends the others).
        import deepspeed.comm as dist

        try:
            dist.barrier()
        except Exception as e:  # noqa: BLE001 - a peer ended first: this rank's record stands
            progress(f"the last barrier failed ({type(e).__name__}: {e}): a peer ended first")
    return rec


def _train(args, rec: dict, state: dict, cuda: bool) -> None:
    import dataclasses

    import deepspeed
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        # --shared-gpu: LOCAL_RANK 0 on every rank (the driver's), which accelerate and DeepSpeed read as cuda:0
        torch.cuda.set_device(local)
    backend = "nccl" if cuda and not args.shared_gpu else "gloo"
    # accelerate and the Trainer find the process group up and keep it (their own pick would be nccl on a GPU)
    if backend == "gloo" and cuda:
        # DeepSpeed's init passes device_id on a GPU, and torch 2.11's new_group then splits the group, which gloo
        # cannot ("no attribute 'perform_nocolor_split'"): gloo up first, without a device
        torch.distributed.init_process_group(backend="gloo")
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    rec.update(backend=backend, device=str(device), hf_mixer_kernel=_bound_kernel(args.preset))
    if rec["path"] == "long_context" or args.sp > 1:
        from ds_mamba_spcp.integrations import accelerate as mamba_sp

        mamba_sp.enable()  # before the Trainer is built; at sp > 1 on both paths (accelerate alone refuses Bamba)
    parallelism = None
    if args.sp > 1:
        from accelerate.utils import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        parallelism = ParallelismConfig(
            sp_backend="deepspeed", sp_size=args.sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
        )  # fmt: skip
    torch.manual_seed(args.seed)
    with device:
        model = preset_model(args.preset)
    model = model.to(torch.bfloat16 if cuda else torch.float32).train()
    if cuda:
        torch.cuda.empty_cache()  # the fp32 copy of the init
    rec["parameters"] = sum(p.numel() for p in model.parameters())
    shard = f" ({rec['length'] // args.sp:,} on each of {args.sp} ranks)" if args.sp > 1 else ""
    progress(f"{args.preset}: {rec['parameters']:,} parameters; {rec['path']} at {rec['length']:,} tokens{shard}")
    # whole rows on every rank: under sequence parallelism DeepSpeed's data-loader adapter gives each rank its
    # contiguous 1/sp of each, labels shifted before the cut
    rows = row_lengths(args, rec["length"])
    rec["tokens_per_step"] = sum(rows)  # the tokens (padding not counted) of the step's micro-batches
    # who computes the loss: TRL's SFTTrainer its own fused head (the key's fused loss leaves it TRL's), else the
    # key's fused loss where it is on, else transformers (the full logits)
    fused = rec["path"] == "long_context" and "fused_loss" not in (rec.get("long_context") or {})
    rec["loss_by"] = "trl_fused_head" if args.trainer == "sft" else "fused_loss" if fused else "transformers"
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in rows]
    if args.trainer == "sft" and not args.padded:  # packed: each row's documents, TRL packs them back into the row
        docs = [d for row in docs for d in row.tensor_split(args.docs_per_row)]

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    batch = 2 if args.padded else 1
    training = dict(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.trial_out)), "trainer"),
        per_device_train_batch_size=batch, gradient_accumulation_steps=args.grad_accum, bf16=cuda, use_cpu=not cuda,
        optim="adamw_torch", learning_rate=1e-5, max_steps=args.steps, logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, seed=args.seed,
        deepspeed=ds_config(args, rec["path"]), parallelism_config=parallelism, **{checkpointing: True},
    )  # fmt: skip
    if "train_sampling_strategy" in fields:  # the rows in their order: each padded batch pairs a long and a short row
        training["train_sampling_strategy"] = "sequential"
    holder = {}

    class Clock(TrainerCallback):
        """Each step's wall time and GPU peak; at the last step's end, what holds the memory."""

        def on_step_begin(self, _args, st, _control, **kw):
            if args.fail_from_length and rec["length"] >= args.fail_from_length and rec["rank"] == args.sp - 1:
                raise torch.OutOfMemoryError(f"injected (--fail-from-length {args.fail_from_length})")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                # what the step starts with: torch's AdamW creates its moments in the first optimizer step, so the
                # first step's peak runs without them (8 bytes a parameter) and every later one with them
                engine = holder["trainer"].model_wrapped
                begin = memory_breakdown(engine, model, device)
                rec["step_held_at_begin"].append({"allocated": torch.cuda.memory_allocated(), **begin})
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, st, _control, model=None, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec["step_s"].append(round(time.perf_counter() - self.t0, 4))
            if cuda:
                rec["step_gpu_peak_allocated"].append(torch.cuda.max_memory_allocated())
                rec["step_gpu_peak_reserved"].append(torch.cuda.max_memory_reserved())
            progress(f"step {st.global_step}: {rec['step_s'][-1]:.3f} s")
            engine = holder["trainer"].model_wrapped
            state["holds"] = memory_breakdown(engine, model, device)
            if rec["path"] == "long_context":
                rec["memory_report"], why = _memory_report(model)
                if why:
                    rec["memory_report_missing"] = why

        def on_log(self, _args, st, _control, logs=None, **kw):
            if logs and "loss" in logs:
                rec["losses"].append(float(logs["loss"]))
            for key in ("entropy", "mean_token_accuracy"):  # TRL's metrics (the sft trainer)
                if logs and key in logs:
                    rec.setdefault(key, []).append(float(logs[key]))

    def tokens(_model, pos, kw):  # what this rank's model is given: L/sp tokens under sequence parallelism
        ids = kw.get("input_ids", pos[0] if pos else None)
        if model.training and torch.is_tensor(ids):
            rec["tokens"] = int(ids.shape[-1])

    model.register_forward_pre_hook(tokens, with_kwargs=True)
    if args.trainer == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        sft = SFTConfig(
            **training, max_length=rec["length"], packing=not args.padded,
            pad_to_multiple_of=args.sp if args.sp > 1 else None,
        )  # fmt: skip
        data = Dataset.from_dict({"input_ids": [d.tolist() for d in docs]})
        trainer = SFTTrainer(model=model, args=sft, train_dataset=data, processing_class=_tokenizer(model.config),
                             callbacks=[Clock()])  # fmt: skip
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**training), train_dataset=Rows(docs),
                          data_collator=right_padded, callbacks=[Clock()])  # fmt: skip
    holder["trainer"] = trainer
    trainer.train()
    if len(rec["step_s"]) < args.steps:
        raise RuntimeError(f"the Trainer ran {len(rec['step_s'])} of {args.steps} steps")


def row_lengths(args, length: int) -> list[int]:
    """The tokens of each row of one optimizer step, in order: ``--grad-accum`` micro-batches of one row of
    ``length`` tokens, or with ``--padded`` of two rows, ``length`` and ``short_row(length)`` (right-padded to
    ``length``). The dataset is these rows, read in order and again at every step."""
    per_batch = [length, short_row(length, args.sp)] if args.padded else [length]
    return per_batch * args.grad_accum


def short_row(length: int, sp: int) -> int:
    """The shorter row of a padded batch: 3/4 of ``length``, a multiple of ``sp`` (so that, at sp > 1, its padded
    tail starts on a shard of its own)."""
    return max(sp, (3 * length // 4) // sp * sp)


class Rows:
    """The plain Trainer's dataset: one row of token ids each, labels = input_ids (a map-style dataset)."""

    def __init__(self, docs: list) -> None:
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.docs[i]}


def right_padded(rows: list[dict]) -> dict:
    """The plain Trainer's batch: rows right-padded to the longest (token 0, label -100, attention_mask 0); a batch
    of rows of one length gets no attention_mask (what the unpadded runs always had)."""
    import torch

    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100)}
    if not bool(mask.all()):
        batch["attention_mask"] = mask
    return batch


def _tokenizer(config):
    """TRL's SFTTrainer needs a tokenizer (its pad and eos tokens): a word-level one over the model's vocabulary,
    built here (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t1")


# ---------------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------------


class Stopped(Exception):
    """SIGTERM reached the driver (a caller's time limit, ``timeout``) while a trial ran."""


def _on_sigterm(signum, frame):
    raise Stopped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a rank's own values, listed per rank in a trial's record ("per_rank"); the record's own are rank 0's
RANK_FIELDS = ("status", "reason", "exit_status", "device", "tokens", "step_s", "last_step_s", "losses",
               "step_gpu_peak_allocated", "step_gpu_peak_reserved", "gpu_peak_allocated", "gpu_peak_reserved",
               "gpu_peak_allocated_at_end", "host_peak_rss", "pinned_host", "holds")  # fmt: skip
# which failing rank's status and reason a trial's record takes: a rank's own failure before its peers' echoes
STATUS_ORDER = ("oom", "killed", "error", "timeout", "stopped")


def trial(args, length: int, path: str, workdir: str, sp: int | None = None, shared: bool | None = None) -> dict:
    """One trial: ``sp`` processes of this script (--trial), the ranks of one torch.distributed job, in one process
    group (killed whole at ``--trial-timeout``, at the driver's SIGTERM, and ``RANK_GRACE_S`` after one rank
    failed while others still run); its record: rank 0's, with every rank's ``RANK_FIELDS`` in ``per_rank`` and
    status "ok" only if every rank's is."""
    sp = args.sp if sp is None else sp
    shared = args.shared_gpu if shared is None else shared
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(sp), LOCAL_SIZE=str(sp),
               LOCAL_WORLD_SIZE=str(sp))  # fmt: skip
    if sp > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // sp)))  # as torchrun: no oversubscription
    cmd = [sys.executable, os.path.abspath(__file__), "--trial", str(length), "--trial-path", path,
           "--preset", args.preset, "--steps", str(args.steps), "--zero", str(args.zero), "--seed", str(args.seed),
           "--sp", str(sp), "--trainer", args.trainer, "--grad-accum", str(args.grad_accum),
           "--docs-per-row", str(args.docs_per_row)]  # fmt: skip
    if args.padded:
        cmd += ["--padded"]
    if shared:
        cmd += ["--shared-gpu"]
    if args.tile_tokens is not None:
        cmd += ["--tile-tokens", str(args.tile_tokens)]
    if args.offload_gpu_budget_gib is not None:
        cmd += ["--offload-gpu-budget-gib", str(args.offload_gpu_budget_gib)]
    if args.fail_from_length:
        cmd += ["--fail-from-length", str(args.fail_from_length)]
    if args.parts_off:
        cmd += ["--parts-off", args.parts_off]
    rec_paths = [os.path.join(workdir, f"record_{path}_{length}_rank{r}.json") for r in range(sp)]
    log_paths = [os.path.join(workdir, f"log_{path}_{length}_rank{r}.txt") for r in range(sp)]
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    ended = None  # why the driver ended the ranks: "timeout", "stopped" (SIGTERM), "abandoned" (a peer failed)
    spawn_error = None
    try:
        for r in range(sp):
            # rank 0 leads a new process group (outside the driver's, as a new session would be); the others join it
            join = os.setpgrp if r == 0 else (lambda group=procs[0].pid: os.setpgid(0, group))
            rank_env = dict(env, RANK=str(r), LOCAL_RANK="0" if shared else str(r))
            try:
                with open(log_paths[r], "w") as log:
                    procs.append(subprocess.Popen([*cmd, "--trial-out", rec_paths[r]], cwd=REPO, env=rank_env,
                                                  stdout=log, stderr=subprocess.STDOUT, preexec_fn=join))  # fmt: skip
            except (OSError, subprocess.SubprocessError) as e:  # rank 0 already gone, say
                spawn_error = f"not started: {type(e).__name__}: {e}"
                break
        ended = "abandoned" if spawn_error else _wait_ranks(procs, t0 + args.trial_timeout)
    except Stopped:
        ended = "stopped"
    finally:
        if procs:
            with contextlib.suppress(ProcessLookupError):  # what is left of the group (ranks, their children)
                os.killpg(procs[0].pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
    wall = round(time.monotonic() - t0, 1)
    try:  # DeepSpeed's CPU backend leaves /dev/shm buffers named after the port
        from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers

        remove_deepspeed_shm_buffers(int(port))
    except ImportError:
        pass
    outs, ranks = [], []
    for r in range(sp):
        if r >= len(procs):
            outs.append("")
            ranks.append(dict(model=args.preset, path=path, length=length, steps=args.steps, zero=args.zero,
                              status="error", reason=spawn_error, exit_status=None))  # fmt: skip
            continue
        with open(log_paths[r], errors="replace") as f:
            outs.append(f.read())
        ranks.append(_rank_record(args, path, length, rec_paths[r], outs[-1], procs[r].returncode, ended))
    failing = [r for r in range(sp) if ranks[r]["status"] != "ok"]
    # the driver's SIGTERM first (the driver stops after this trial), then a rank's own failure before its peers'
    first = min(failing, default=0, key=lambda r: (ranks[r]["status"] != "stopped", bool(ranks[r].get("abandoned")),
                                                   _status_rank(ranks[r]["status"]), r))  # fmt: skip
    rec = dict(ranks[0])
    rec.pop("rank", None)
    rec.pop("abandoned", None)
    rec.update(sp=sp, shared_gpu=rec.get("shared_gpu", shared), status=ranks[first]["status"])
    if failing:
        rec["reason"] = (f"rank {first} of {sp}: " if sp > 1 else "") + ranks[first].get("reason", "")
        if "traceback" in ranks[first]:
            rec["traceback"] = ranks[first]["traceback"]
    rec["per_rank"] = {k: [one.get(k) for one in ranks] for k in RANK_FIELDS}
    rec.update(exit_status=ranks[first]["exit_status"], wall_s=wall, git_commit=args.git_commit)
    if failing:
        outs = [out[-200_000:] for out in outs]
        text = outs[0] if sp == 1 else "".join(f"===== rank {r} =====\n{out}\n" for r, out in enumerate(outs))
        with open(f"{os.path.splitext(args.out)[0]}_{path}_{length}{f'_sp{sp}' if sp > 1 else ''}.log", "w") as f:
            f.write(text)
    return rec


def _status_rank(status: str) -> int:
    return STATUS_ORDER.index(status) if status in STATUS_ORDER else len(STATUS_ORDER)


def _wait_ranks(procs: list, deadline: float) -> str | None:
    """Until every rank has exited (None), the deadline passed ("timeout"), or ``RANK_GRACE_S`` passed since a rank
    failed while others still run ("abandoned": they may wait in a collective that never completes)."""
    failed_at = None
    while True:
        codes = [proc.poll() for proc in procs]
        if all(c is not None for c in codes):
            return None
        now = time.monotonic()
        if now >= deadline:
            return "timeout"
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at >= RANK_GRACE_S:
            return "abandoned"
        time.sleep(0.1)


def _rank_record(args, path: str, length: int, rec_path: str, out: str, rc: int | None, ended: str | None) -> dict:
    """One rank's record: the one it wrote, or one made from its output and exit status."""
    rec = None
    if os.path.exists(rec_path):
        with open(rec_path) as f:
            rec = json.load(f)
    if rec is not None:
        if ended and rc in (-9, None):  # wrote its record, then hung (teardown, a peer's end): the record stands
            rec["teardown"] = "killed after writing its record"
        rec["exit_status"] = rc
        return rec
    rec = dict(model=args.preset, path=path, length=length, steps=args.steps, zero=args.zero, exit_status=rc)
    if ended == "stopped":
        rec["status"] = "stopped"
    elif ended == "timeout" and rc in (-9, None):
        rec["status"] = "timeout"
    elif ended == "abandoned" and rc in (-9, None):
        rec["status"], rec["abandoned"] = "error", True
    elif rc in (-9, 137):
        rec["status"] = "killed"
    else:
        rec["status"] = "oom" if "out of memory" in out.lower() else "error"
    lines = [ln for ln in out.splitlines() if "Error" in ln or "error:" in ln]
    tail = out.strip().splitlines()
    said = (lines[-1].strip() if lines else f"last output: {tail[-1].strip()}" if tail else "")[:2000]
    why = {
        "timeout": f"killed at --trial-timeout {args.trial_timeout:g} s",
        "stopped": "killed: the driver got SIGTERM (its caller's time limit)",
        "abandoned": f"killed {RANK_GRACE_S:g} s after another rank failed",
    }.get(ended if rc in (-9, None) or ended == "stopped" else None, f"exit status {rc}")
    rec["reason"] = why + (f": {said}" if said else ", no output")
    return rec


def environment(args) -> dict:
    import importlib.metadata

    import torch

    command = shlex.join(["python", "benchmarks/train_hf.py", *args.argv])
    header = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  torch=torch.__version__, git_commit=args.git_commit, command=command,
                  pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                  mamba_deterministic=os.environ.get("MAMBA_DETERMINISTIC"),
                  fla_dqkwg=os.environ.get("DS_MAMBA_SPCP_FLA_DQKWG"))  # fmt: skip
    for dist in ("transformers", "deepspeed", "accelerate", "trl", "mamba-ssm"):
        try:
            header[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            header[dist] = None
    if torch.cuda.is_available():
        header["gpu"] = torch.cuda.get_device_name(0)
        header["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        header["gpu_count"] = torch.cuda.device_count()
    return header


def _gib(v) -> str:
    return "" if v is None else f"{v / GIB:.1f}"


def _run_kind(r: dict) -> str:
    """The trainer, accumulation, rows and steps of a record ("Trainer" alone for the records before they were
    recorded: one unpadded row a step, no accumulation)."""
    words = ["TRL SFTTrainer" if r.get("trainer") == "sft" else "Trainer"]
    if r.get("grad_accum", 1) > 1:
        words.append(f"GA {r['grad_accum']}")
    if r.get("padded"):
        words.append("2 right-padded rows")
    elif r.get("packed"):
        docs = r.get("docs_per_row") or 1
        words.append(f"packed, {docs} document{'s' if docs > 1 else ''} a row")
    words.append(f"{r.get('steps')} steps")
    return ", ".join(words)


def _variant(r: dict) -> str:
    """What sets a record's runs apart from the plain Trainer on one unpadded row a step ("" for those)."""
    plain = r.get("trainer", "trainer") == "trainer" and r.get("grad_accum", 1) == 1 and not r.get("padded")
    return "" if plain else _run_kind(r).rsplit(", ", 1)[0]


def _setting(r: dict) -> str:
    sp = r.get("sp", 1)
    group = f"sp {sp}" + (" on one GPU" if r.get("shared_gpu") else "") if sp > 1 else ""
    if r.get("zero", 2) != 2:  # ZeRO 2 unsaid (the default); another stage named beside the group
        group = ", ".join(filter(None, [group, f"ZeRO {r['zero']}"]))
    if r["path"] != "long_context":
        return f"transformers ({group})" if group else "transformers"
    lc = r.get("long_context") or {}
    parts = [f"tiles {lc['tile_tokens']:,}" if "tile_tokens" in lc else "default tiles"]
    if lc.get("offload_gpu_budget_gib") is not None:
        parts.append(f"offload, GPU budget {lc['offload_gpu_budget_gib']:g} GiB")
    parts += [f"{k} off" for k, v in lc.items() if v is False]
    return "long_context (" + ", ".join(parts + ([group] if group else [])) + ")"


def markdown(payload: dict) -> str:
    h = payload["header"]
    lines = [f"# transformers Trainer ({h.get('gpu', 'CPU')}, {h['date']}, commit {h.get('git_commit')})",
             "", f"`{h['command']}`", "",
             "| model | path | L | status | last step s | tokens/s | GPU peak GiB | reserved GiB | host peak GiB | "
             "pinned host GiB | params GiB | grads GiB | optimizer GiB | checkpoints GPU GiB | transient GiB | run | "
             "notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in payload["records"]:
        holds = r.get("holds") or {}
        note = "" if r["status"] == "ok" else r.get("reason", "")
        note = note.replace("|", "/").replace("\n", " ")[:160]
        peaks = (r.get("per_rank") or {}).get("gpu_peak_allocated") or []
        if r["status"] == "ok" and len(peaks) > 1 and None not in peaks:
            note = "GPU peak GiB by rank: " + ", ".join(_gib(p) for p in peaks)
        step = r.get("last_step_s")
        tps = r.get("tokens_per_s")
        gib = [_gib(r.get(k)) for k in ("gpu_peak_allocated", "gpu_peak_reserved", "host_peak_rss", "pinned_host")]
        gib += [_gib(holds.get(k)) for k in ("parameters", "gradients", "optimizer_states", "checkpoints_gpu",
                                             "transient_peak")]  # fmt: skip
        cells = [r["model"], _setting(r), f"{r['length']:,}", r["status"], "" if step is None else f"{step:.2f}",
                 "" if tps is None else f"{tps:,.0f}", *gib, _run_kind(r), note]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for r in payload["records"]:  # each step's peak beside what it started with (optimizer moments from step 2 on)
        begins, peaks = r.get("step_held_at_begin") or [], r.get("step_gpu_peak_allocated") or []
        if len(peaks) < 2 or len(begins) != len(peaks):
            continue
        lines += ["", f"Per step, {r['model']} {_setting(r)} at {r['length']:,} tokens (GiB):", "",
                  "| step | s | GPU peak | allocated at begin | optimizer master | optimizer moments | gradients |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for k, (b, peak) in enumerate(zip(begins, peaks)):
            held = [_gib(b.get(key)) for key in ("allocated", "optimizer_master", "optimizer_moments", "gradients")]
            cells = [str(k + 1), f"{r['step_s'][k]:.2f}", _gib(peak), *held]
            lines.append("| " + " | ".join(cells) + " |")
    for c in payload.get("comparisons", []):
        if c["ratio"] is None:
            lines += ["", f"At {c['length']:,} tokens: transformers {c['transformers_status']}, long_context "
                      f"{c['long_context_status']}: no ratio."]  # fmt: skip
        else:
            lines += ["", f"At {c['length']:,} tokens: last step {c['long_context_last_step_s']:.2f} s long_context, "
                      f"{c['transformers_last_step_s']:.2f} s transformers: ratio {c['ratio']:.3f}."]  # fmt: skip
    for c in payload.get("peak_checks", []):
        head = f"Peak check: one process at {c['length']:,} tokens, {c['sp']} ranks on one GPU at {c['sp_length']:,}"
        if c["max_ratio"] is None:
            lines += ["", f"{head}: {c['note']}."]
        else:
            verdict = "within" if c["within_bound"] else "NOT within"
            lines += ["", f"{head}: GPU peak {_gib(c['one_process_gpu_peak'])} GiB against "
                      f"{', '.join(_gib(p) for p in c['rank_gpu_peaks'])} GiB by rank: ratios "
                      f"{', '.join(f'{x:.3f}' for x in c['ratios'])}, {verdict} {c['bound']:g}x."]  # fmt: skip
    ok = [r for r in payload["records"] if r["status"] == "ok"]
    for model, setting, variant in sorted({(r["model"], _setting(r), _variant(r)) for r in ok}):
        best = max((r for r in ok if (r["model"], _setting(r), _variant(r)) == (model, setting, variant)),
                   key=lambda r: r["length"])  # fmt: skip
        lines += ["", f"Longest that trained, {model} {setting}{f' [{variant}]' if variant else ''}: "
                  f"{best['length']:,} tokens at {best.get('steps')} steps "
                  f"({_gib(best.get('gpu_peak_allocated')) or '-'} GiB GPU peak)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_results(path: str, payload: dict) -> None:
    """The JSON at ``path`` (rewritten whole after every trial) and its Markdown beside it (``.md``)."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(markdown(payload))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="hf-bamba-2b")
    p.add_argument("--lengths", default="", help="comma separated lengths to run")
    p.add_argument("--search", type=int, default=0, help="the longest length: START, START*F, ... to --max, "
                   "rounded to --round, stopping at the first failure")  # fmt: skip
    p.add_argument("--factor", type=float, default=MAX_FACTOR, help=f"--search's factor (1 < F <= {MAX_FACTOR})")
    p.add_argument("--max", type=int, default=0, help="--search's longest length")
    p.add_argument("--round", type=int, default=16384, help="--search's lengths are multiples of this")
    p.add_argument("--compare-at", type=int, default=0, help="run this length on both paths; the ratio of last steps")
    p.add_argument("--long-context", action="store_true", help="--lengths and --search on the long-context path")
    p.add_argument("--tile-tokens", type=int, default=None, help='"long_context.tile_tokens" (default: the key\'s)')
    p.add_argument("--offload-gpu-budget-gib", type=float, default=None,
                   help='"long_context.offload_gpu_budget_gib" (default: no offload)')  # fmt: skip
    p.add_argument("--parts-off", default="", help='long_context parts turned off, e.g. "fused_loss,tiled_mlp"')
    p.add_argument("--sp", type=int, default=1, help="ranks sharing each row (DeepSpeed sequence parallelism through "
                   "accelerate): one process each; lengths are the whole row's and must divide by it")  # fmt: skip
    p.add_argument("--shared-gpu", action="store_true", help="every rank on cuda:0 with gloo (correctness runs on one "
                   "GPU); else rank r on cuda:r with nccl")  # fmt: skip
    p.add_argument("--peak-check", type=int, default=0, metavar="L", help="one process at L, then --sp ranks on one "
                   f"GPU at sp*L: each rank's GPU peak over the one process's (bound {PEAK_BOUND}x)")  # fmt: skip
    p.add_argument("--trainer", choices=("trainer", "sft"), default="trainer", help="transformers' Trainer, or TRL's "
                   "SFTTrainer (packed rows: padding-free, position_ids restarting per document)")  # fmt: skip
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (micro-batches per step)")
    p.add_argument("--padded", action="store_true", help="batches of two rows, of L and 3L/4 tokens, the shorter "
                   "right-padded to L (attention_mask, labels -100); with --trainer sft: packing off")  # fmt: skip
    p.add_argument("--docs-per-row", type=int, default=1, help="--trainer sft without --padded: documents per packed "
                   "row of L tokens (equal parts)")  # fmt: skip
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trial-timeout", type=float, default=540.0, help="seconds per trial before it is killed")
    p.add_argument("--time-budget", type=float, default=0.0, help="start no trial after this many seconds")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", help="JSON path (records are appended to an existing file)")
    p.add_argument("--fail-from-length", type=int, default=0,
                   help="testing: trials this long or longer raise torch.OutOfMemoryError at step 1, on the last "
                   "rank only (its peers fail after it)")  # fmt: skip
    p.add_argument("--trial", type=int, default=0, help=argparse.SUPPRESS)  # this process is one trial of this length
    p.add_argument("--trial-path", choices=PATHS, default="transformers", help=argparse.SUPPRESS)
    p.add_argument("--trial-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.trial:
        return args
    if not args.out:
        p.error("--out is required")
    if args.search and not (1.0 < args.factor <= MAX_FACTOR):
        p.error(f"--factor must be in (1, {MAX_FACTOR}], got {args.factor}")
    if args.search and args.max < args.search:
        p.error("--search needs --max >= START")
    if args.round < 1 or args.steps < 1 or args.sp < 1 or args.grad_accum < 1 or args.docs_per_row < 1:
        p.error("--round, --steps, --sp, --grad-accum and --docs-per-row must be positive")
    if args.docs_per_row > 1 and (args.trainer != "sft" or args.padded):
        p.error("--docs-per-row is for packed rows: --trainer sft without --padded")
    if not (args.lengths or args.search or args.compare_at or args.peak_check):
        p.error("nothing to run: give --lengths, --search, --compare-at or --peak-check")
    long_keys = args.tile_tokens is not None or args.offload_gpu_budget_gib is not None
    if long_keys and not (args.long_context or args.compare_at):
        p.error("--tile-tokens and --offload-gpu-budget-gib are long-context settings: add --long-context")
    if args.peak_check and args.sp < 2:
        p.error("--peak-check compares --sp ranks with one process: give --sp 2 or more")
    lengths = [("--lengths", int(x)) for x in args.lengths.split(",") if x.strip()]
    lengths += [(flag, v) for flag, v in (("--compare-at", args.compare_at), ("--search", args.search)) if v]
    if args.search:
        lengths.append(("--round", args.round))  # every length of the search is a multiple of it
    for flag, length in lengths:
        if length % args.sp:
            p.error(f"{flag} {length}: each of the --sp {args.sp} ranks holds an equal shard of the row: give lengths "
                    f"that divide by {args.sp}")  # fmt: skip
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.trial:
        rec = run_trial(args)
        sys.stdout.flush()
        sys.stderr.flush()
        # no teardown: the record is written, and a process group after a CUDA error can hang in it
        os._exit(0 if rec["status"] == "ok" else 1)
    from ds_mamba_spcp.config import load_mamba_sp_config

    load_mamba_sp_config({SECTION: ds_config(args, "long_context")[SECTION]})  # a wrong key: refused before any trial
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and args.sp > gpus and not args.shared_gpu:
        raise SystemExit(f"train_hf.py: --sp {args.sp} puts rank r on cuda:r but {gpus} GPU(s) are visible: add "
                         "--shared-gpu (every rank on cuda:0) or lower --sp")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    n = parameter_count(args.preset)
    progress(f"{args.preset}: {n:,} parameters ({n / 1e9:.2f}B)")
    payload = dict(schema=SCHEMA, header=environment(args), parameters={args.preset: n}, records=[], comparisons=[],
                   peak_checks=[])  # fmt: skip
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        payload["records"], payload["comparisons"] = old.get("records", []), old.get("comparisons", [])
        payload["peak_checks"] = old.get("peak_checks", [])
        payload["parameters"] = {**old.get("parameters", {}), args.preset: n}
        payload["header"]["earlier_commands"] = old["header"].get("earlier_commands", []) + [old["header"]["command"]]
    start = time.monotonic()

    def run(length: int, path: str, sp: int | None = None, shared: bool | None = None) -> dict | None:
        if args.time_budget and time.monotonic() - start > args.time_budget:
            progress(f"time budget spent: {path} at {length:,} not run")
            return None
        with tempfile.TemporaryDirectory(prefix="train_hf_") as workdir:
            rec = trial(args, length, path, workdir, sp, shared)
        payload["records"].append(rec)
        write_results(args.out, payload)
        if rec["status"] == "stopped":
            progress(f"SIGTERM: {path} at {length:,} killed and recorded; no more trials")
            raise SystemExit(143)
        step, tps = rec.get("last_step_s"), rec.get("tokens_per_s")
        group = f" sp={rec['sp']}{' on one GPU' if rec.get('shared_gpu') else ''}" if rec["sp"] > 1 else ""
        progress(
            f"{args.preset} {path} L={length:,}{group}: {rec['status']}"
            + (f", last step {step:.2f} s, {tps:,.0f} tokens/s" if step else "")
            + (f", GPU peak {_gib(rec.get('gpu_peak_allocated'))} GiB" if rec.get("gpu_peak_allocated") else "")
            + (f", host peak {_gib(rec['host_peak_rss'])} GiB" if rec.get("host_peak_rss") else "")
            + f", {rec['wall_s']} s wall"
            + (f": {rec.get('reason', '')[:300]}" if rec["status"] != "ok" else "")
        )
        return rec

    previous = signal.signal(signal.SIGTERM, _on_sigterm)  # a trial killed by the caller's limit is recorded
    try:
        _trials(args, payload, run)
    except Stopped:
        progress("SIGTERM between trials: no more trials")
        raise SystemExit(143) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    return payload


def _trials(args, payload: dict, run) -> None:
    main_path = "long_context" if args.long_context else "transformers"
    if args.compare_at:
        pair = {path: run(args.compare_at, path) for path in PATHS}
        if all(pair.values()):
            hf, lc = pair["transformers"], pair["long_context"]
            both = hf["status"] == lc["status"] == "ok"
            payload["comparisons"].append(dict(
                length=args.compare_at, transformers_status=hf["status"], long_context_status=lc["status"],
                transformers_last_step_s=hf.get("last_step_s"), long_context_last_step_s=lc.get("last_step_s"),
                ratio=lc["last_step_s"] / hf["last_step_s"] if both else None,
                transformers_gpu_peak=hf.get("gpu_peak_allocated"), long_context_gpu_peak=lc.get("gpu_peak_allocated"),
            ))  # fmt: skip
            write_results(args.out, payload)
    for length in [int(x) for x in args.lengths.split(",") if x.strip()]:
        run(length, main_path)
    if args.search:
        lengths = search_lengths(args.search, args.factor, args.max, args.round)
        progress(f"search: {', '.join(f'{x:,}' for x in lengths)}")
        for length in lengths:
            rec = run(length, main_path)
            if rec is None or rec["status"] != "ok":
                break
    if args.peak_check:
        one = run(args.peak_check, main_path, sp=1, shared=False)
        group = run(args.peak_check * args.sp, main_path, sp=args.sp, shared=True) if one else None
        if one and group:
            payload["peak_checks"].append(peak_check(one, group))
            write_results(args.out, payload)


def peak_check(one: dict, group: dict) -> dict:
    """One process at L against ``sp`` ranks on one GPU at sp*L (each rank holding L tokens): each rank's GPU peak
    (``max_memory_allocated`` of its process over the steps) over the one process's, and the same of the transient
    peaks (the peak less parameters, gradients, optimizer states and layer checkpoints: what grows with the
    tokens; ZeRO splits the optimizer states over the ranks, so the whole peak's ratio favours the group)."""
    out = dict(path=one["path"], length=one["length"], sp=group["sp"], sp_length=group["length"],
               one_process_status=one["status"], sp_status=group["status"], bound=PEAK_BOUND,
               one_process_gpu_peak=one.get("gpu_peak_allocated"), rank_gpu_peaks=None, ratios=None, max_ratio=None,
               within_bound=None, one_process_transient=(one.get("holds") or {}).get("transient_peak"),
               rank_transients=None, transient_ratios=None)  # fmt: skip
    if one["status"] != "ok" or group["status"] != "ok":
        out["note"] = f"one process {one['status']}, {group['sp']} ranks {group['status']}: no ratio"
        return out
    peaks = group["per_rank"]["gpu_peak_allocated"]
    if out["one_process_gpu_peak"] is None or None in peaks:
        out["note"] = "no GPU peaks (CPU): no ratio"
        return out
    out["rank_gpu_peaks"] = peaks
    out["ratios"] = [p / out["one_process_gpu_peak"] for p in peaks]
    out["max_ratio"] = max(out["ratios"])
    out["within_bound"] = out["max_ratio"] <= PEAK_BOUND
    transients = [(h or {}).get("transient_peak") for h in group["per_rank"]["holds"]]
    out["rank_transients"] = transients
    if out["one_process_transient"] and None not in transients:
        out["transient_ratios"] = [t / out["one_process_transient"] for t in transients]
    return out


if __name__ == "__main__":
    main()
