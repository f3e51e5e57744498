"""Training through transformers' ``Trainer`` on one GPU at given lengths, transformers' own path against the
long-context one (issue 37): the longest row that trains, step time, tokens/s and what holds the memory.

Each trial is one fresh process (so one OOM cannot fragment the next trial's memory): a Bamba model of the preset
(random init, bf16 on GPU / fp32 on CPU), a dataset of one row of L random token ids (labels = input_ids) and a
plain ``Trainer`` (batch 1, activation checkpointing, AdamW, lr 1e-5, ``--steps`` steps) under DeepSpeed (ZeRO
``--zero``, bf16, the ``"mamba_sequence_parallel"`` section), started as a one-process torch.distributed job (env
MASTER_ADDR/PORT, RANK=0, WORLD_SIZE=1: no launcher). Two paths:

    transformers   the model as transformers runs it, mamba-ssm's Triton kernels bound (imported before
                   transformers' modeling code on a GPU); nothing of this package touches the model
    long_context   the section's ``"long_context"`` key (``--tile-tokens``, ``--offload-gpu-budget-gib``) and
                   ``ds_mamba_spcp.integrations.accelerate.enable()`` before the Trainer is built

    # both paths at 64K and the ratio of their last steps
    python benchmarks/train_hf.py --preset hf-bamba-2b --compare-at 65536 --out /tmp/hf_65k.json
    # the longest row on the long-context path: 131072, x1.5, ... (multiples of 16384) up to 1.6M, first failure stops
    python benchmarks/train_hf.py --preset hf-bamba-2b --long-context --offload-gpu-budget-gib 40 \\
        --search 131072 --factor 1.5 --max 1600000 --out /tmp/hf_long.json

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
beside them (``<out>_<path>_<L>.log``).

Presets: ``hf-bamba-2b`` (1.93B parameters: 24 layers of d_model 2048, attention at layers 6, 12, 18 with 16
heads / 4 key-value heads, Mamba2 64 heads of 64, d_state 128, one group, chunk 256, MLP 5632, vocab 128000,
untied head); ``hf-bamba-tiny`` (the CPU smoke's: 3 layers, attention at layer 1, vocab 256).
"""

from __future__ import annotations

import argparse
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
}  # fmt: skip
# tensors DeepSpeed's optimizers keep for gradients (ZeRO 1/2, ZeRO-3, the bf16 optimizer of ZeRO 0)
GRAD_BUFFERS = ("grads_in_partition", "ipg_buffer", "averaged_gradients", "grad_partitions_flat_buffer",
                "fp32_groups_gradients_flat", "temp_grad_buffer_for_gpu_offload")  # fmt: skip


def progress(msg: str) -> None:
    print(f"[train_hf] {msg}", file=sys.stderr, flush=True)


def bamba_config(preset: str):
    from transformers import BambaConfig

    cfg = BambaConfig(**PRESETS[preset], use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def parameter_count(preset: str) -> int:
    """The preset's parameters, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import BambaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in BambaForCausalLM(bamba_config(preset)).parameters())


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


def _bound_kernel() -> str | None:
    """What transformers' Bamba mixer calls in training: ``module.function`` of the bound kernel, or "torch" for
    its reference implementation; None where that cannot be read."""
    import inspect

    try:
        from transformers.models.bamba import modeling_bamba

        bound = inspect.getclosurevars(modeling_bamba.mamba2_split_conv1d_scan_combined).nonlocals
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
    """One training run of ``args.trial`` tokens on ``args.trial_path``; its record (also written to
    ``args.trial_out``, whatever happens)."""
    _distributed_env()
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("MAMBA_DETERMINISTIC", "1")  # as tests/hf_models.load_kernels_first
    length, path = args.trial, args.trial_path
    rec = dict(model=args.preset, path=path, length=length, steps=args.steps, zero=args.zero, status="error",
               step_s=[], step_gpu_peak_allocated=[], step_gpu_peak_reserved=[], losses=[],
               ds_config=ds_config(args, path), mamba_deterministic=os.environ.get("MAMBA_DETERMINISTIC"))  # fmt: skip
    if path == "long_context":
        rec["long_context"] = long_context_key(args)
    state = {}
    try:
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
        rec["tokens_per_s"] = length / rec["last_step_s"]
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
    return rec


def _train(args, rec: dict, state: dict, cuda: bool) -> None:
    import dataclasses

    import deepspeed
    import torch
    from transformers import BambaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    if cuda:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    rec["hf_mixer_kernel"] = _bound_kernel()
    if rec["path"] == "long_context":
        from ds_mamba_spcp.integrations import accelerate as mamba_sp

        mamba_sp.enable()  # before the Trainer is built
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if cuda else "cpu")
    with device:
        model = BambaForCausalLM(bamba_config(args.preset))
    model = model.to(torch.bfloat16 if cuda else torch.float32).train()
    if cuda:
        torch.cuda.empty_cache()  # the fp32 copy of the init
    rec["parameters"] = sum(p.numel() for p in model.parameters())
    progress(f"{args.preset}: {rec['parameters']:,} parameters; {rec['path']} at {rec['length']:,} tokens")
    ids = torch.randint(0, model.config.vocab_size, (rec["length"],), generator=torch.Generator().manual_seed(1))

    class OneRow(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return {"input_ids": ids, "labels": ids.clone()}

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    training = TrainingArguments(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.trial_out)), "trainer"),
        per_device_train_batch_size=1, bf16=cuda, use_cpu=not cuda, optim="adamw_torch", learning_rate=1e-5,
        max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0,
        disable_tqdm=True, seed=args.seed, deepspeed=ds_config(args, rec["path"]), **{checkpointing: True},
    )  # fmt: skip
    holder = {}

    class Clock(TrainerCallback):
        """Each step's wall time and GPU peak; at the last step's end, what holds the memory."""

        def on_step_begin(self, _args, st, _control, **kw):
            if args.fail_from_length and rec["length"] >= args.fail_from_length:
                raise torch.OutOfMemoryError(f"injected (--fail-from-length {args.fail_from_length})")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
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

    trainer = Trainer(model=model, args=training, train_dataset=OneRow(), callbacks=[Clock()])
    holder["trainer"] = trainer
    trainer.train()
    if len(rec["step_s"]) < args.steps:
        raise RuntimeError(f"the Trainer ran {len(rec['step_s'])} of {args.steps} steps")


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


def trial(args, length: int, path: str, workdir: str) -> dict:
    """One trial in its own process (this script with --trial); its record."""
    rec_path = os.path.join(workdir, f"record_{path}_{length}.json")
    log_path = os.path.join(workdir, f"log_{path}_{length}.txt")
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_SIZE="1")  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), "--trial", str(length), "--trial-path", path,
           "--trial-out", rec_path, "--preset", args.preset, "--steps", str(args.steps), "--zero", str(args.zero),
           "--seed", str(args.seed)]  # fmt: skip
    if args.tile_tokens is not None:
        cmd += ["--tile-tokens", str(args.tile_tokens)]
    if args.offload_gpu_budget_gib is not None:
        cmd += ["--offload-gpu-budget-gib", str(args.offload_gpu_budget_gib)]
    if args.fail_from_length:
        cmd += ["--fail-from-length", str(args.fail_from_length)]
    if args.parts_off:
        cmd += ["--parts-off", args.parts_off]
    t0 = time.monotonic()
    timed_out = stopped = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.trial_timeout)
        except (subprocess.TimeoutExpired, Stopped) as e:
            timed_out, stopped = isinstance(e, subprocess.TimeoutExpired), isinstance(e, Stopped)
            os.killpg(proc.pid, signal.SIGKILL)  # the trial's own process group (start_new_session)
            rc = proc.wait()
    wall = round(time.monotonic() - t0, 1)
    try:  # DeepSpeed's CPU backend leaves /dev/shm buffers named after the port
        from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers

        remove_deepspeed_shm_buffers(int(port))
    except ImportError:
        pass
    with open(log_path, errors="replace") as f:
        out = f.read()
    rec = None
    if os.path.exists(rec_path):
        with open(rec_path) as f:
            rec = json.load(f)
    if rec is None:  # the process died before it could write: the reason is in its output
        rec = dict(model=args.preset, path=path, length=length, steps=args.steps, zero=args.zero)
        if stopped:
            rec["status"] = "stopped"
        elif timed_out:
            rec["status"] = "timeout"
        elif rc in (-9, 137):
            rec["status"] = "killed"
        else:
            rec["status"] = "oom" if "out of memory" in out.lower() else "error"
        lines = [ln for ln in out.splitlines() if "Error" in ln or "error:" in ln]
        tail = out.strip().splitlines()
        said = (lines[-1].strip() if lines else f"last output: {tail[-1].strip()}" if tail else "")[:2000]
        why = f"killed at --trial-timeout {args.trial_timeout:g} s" if timed_out else f"exit status {rc}"
        why = "killed: the driver got SIGTERM (its caller's time limit)" if stopped else why
        rec["reason"] = why + (f": {said}" if said else ", no output")
    elif timed_out or stopped:  # wrote its record, then hung: the record stands
        rec["teardown"] = "killed after writing its record"
    rec.update(exit_status=rc, wall_s=wall, git_commit=args.git_commit)
    if rec["status"] != "ok":
        with open(f"{os.path.splitext(args.out)[0]}_{path}_{length}.log", "w") as f:
            f.write(out[-200_000:])
    return rec


def environment(args) -> dict:
    import importlib.metadata

    import torch

    command = shlex.join(["python", "benchmarks/train_hf.py", *args.argv])
    header = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  torch=torch.__version__, git_commit=args.git_commit, command=command,
                  pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                  mamba_deterministic=os.environ.get("MAMBA_DETERMINISTIC"))  # fmt: skip
    for dist in ("transformers", "deepspeed", "accelerate", "mamba-ssm"):
        try:
            header[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            header[dist] = None
    if torch.cuda.is_available():
        header["gpu"] = torch.cuda.get_device_name(0)
        header["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    return header


def _gib(v) -> str:
    return "" if v is None else f"{v / GIB:.1f}"


def _setting(r: dict) -> str:
    if r["path"] != "long_context":
        return "transformers"
    lc = r.get("long_context") or {}
    parts = [f"tiles {lc['tile_tokens']:,}" if "tile_tokens" in lc else "default tiles"]
    if lc.get("offload_gpu_budget_gib") is not None:
        parts.append(f"offload, GPU budget {lc['offload_gpu_budget_gib']:g} GiB")
    return "long_context (" + ", ".join(parts) + ")"


def markdown(payload: dict) -> str:
    h = payload["header"]
    lines = [f"# transformers Trainer, one process ({h.get('gpu', 'CPU')}, {h['date']}, commit {h.get('git_commit')})",
             "", f"`{h['command']}`", "",
             "| model | path | L | status | last step s | tokens/s | GPU peak GiB | reserved GiB | host peak GiB | "
             "pinned host GiB | params GiB | grads GiB | optimizer GiB | checkpoints GPU GiB | transient GiB | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in payload["records"]:
        holds = r.get("holds") or {}
        note = "" if r["status"] == "ok" else r.get("reason", "")
        note = note.replace("|", "/").replace("\n", " ")[:160]
        step = r.get("last_step_s")
        tps = r.get("tokens_per_s")
        gib = [_gib(r.get(k)) for k in ("gpu_peak_allocated", "gpu_peak_reserved", "host_peak_rss", "pinned_host")]
        gib += [_gib(holds.get(k)) for k in ("parameters", "gradients", "optimizer_states", "checkpoints_gpu",
                                             "transient_peak")]  # fmt: skip
        cells = [r["model"], _setting(r), f"{r['length']:,}", r["status"], "" if step is None else f"{step:.2f}",
                 "" if tps is None else f"{tps:,.0f}", *gib, note]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for c in payload.get("comparisons", []):
        if c["ratio"] is None:
            lines += ["", f"At {c['length']:,} tokens: transformers {c['transformers_status']}, long_context "
                      f"{c['long_context_status']}: no ratio."]  # fmt: skip
        else:
            lines += ["", f"At {c['length']:,} tokens: last step {c['long_context_last_step_s']:.2f} s long_context, "
                      f"{c['transformers_last_step_s']:.2f} s transformers: ratio {c['ratio']:.3f}."]  # fmt: skip
    ok = [r for r in payload["records"] if r["status"] == "ok"]
    for model, setting in sorted({(r["model"], _setting(r)) for r in ok}):
        best = max((r for r in ok if r["model"] == model and _setting(r) == setting), key=lambda r: r["length"])
        lines += ["", f"Longest that trained, {model} {setting}: {best['length']:,} tokens "
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
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trial-timeout", type=float, default=540.0, help="seconds per trial before it is killed")
    p.add_argument("--time-budget", type=float, default=0.0, help="start no trial after this many seconds")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", help="JSON path (records are appended to an existing file)")
    p.add_argument("--fail-from-length", type=int, default=0,
                   help="testing: trials this long or longer raise torch.OutOfMemoryError at step 1")  # fmt: skip
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
    if args.round < 1 or args.steps < 1:
        p.error("--round and --steps must be positive")
    if not (args.lengths or args.search or args.compare_at):
        p.error("nothing to run: give --lengths, --search or --compare-at")
    long_keys = args.tile_tokens is not None or args.offload_gpu_budget_gib is not None
    if long_keys and not (args.long_context or args.compare_at):
        p.error("--tile-tokens and --offload-gpu-budget-gib are long-context settings: add --long-context")
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
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    n = parameter_count(args.preset)
    progress(f"{args.preset}: {n:,} parameters ({n / 1e9:.2f}B)")
    payload = dict(schema=SCHEMA, header=environment(args), parameters={args.preset: n}, records=[], comparisons=[])
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        payload["records"], payload["comparisons"] = old.get("records", []), old.get("comparisons", [])
        payload["parameters"] = {**old.get("parameters", {}), args.preset: n}
        payload["header"]["earlier_commands"] = old["header"].get("earlier_commands", []) + [old["header"]["command"]]
    start = time.monotonic()

    def run(length: int, path: str) -> dict | None:
        if args.time_budget and time.monotonic() - start > args.time_budget:
            progress(f"time budget spent: {path} at {length:,} not run")
            return None
        with tempfile.TemporaryDirectory(prefix="train_hf_") as workdir:
            rec = trial(args, length, path, workdir)
        payload["records"].append(rec)
        write_results(args.out, payload)
        if rec["status"] == "stopped":
            progress(f"SIGTERM: {path} at {length:,} killed and recorded; no more trials")
            raise SystemExit(143)
        step, tps = rec.get("last_step_s"), rec.get("tokens_per_s")
        progress(
            f"{args.preset} {path} L={length:,}: {rec['status']}"
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


if __name__ == "__main__":
    main()
