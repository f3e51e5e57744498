"""Memory per token by component, measured: where the GPU (and host) memory of a long training step goes.

    MAMBA_DETERMINISTIC=1 python benchmarks/memory_table.py --presets mamba-130m,mamba-780m \\
        --lengths 65536,131072 --out benchmarks/results/memory_h200x1.json
    python benchmarks/memory_table.py --cpu --out /tmp/memory_cpu.json        # the tiny CPU path (tests)

One process, one rank: each preset (train_runs.py's: vocab 50280, d_state 128, headdim 64, expand 2, chunk
256, tied embeddings) is built as ``examples/train.py`` builds it under the launcher (a group of one,
``deepspeed.initialize`` with train_runs.py's ds_config: bf16, ZeRO 1, AdamW), then at each length:

    params                  torch.cuda.memory_allocated after deepspeed.initialize, minus before the model
    optimizer and grads     after the first step (fp32 master weights, Adam moments, gradient buffers)
                            minus after initialize (no activations are alive then)
    block checkpoints       what the checkpoint function keeps per block (its inputs, the sum of their bytes)
                            and what stays allocated after the forward pass (the allocator's delta)
    one block: saved        the bytes a block saves for backward when run with grad (saved-tensor hooks,
                            each storage once, parameters excluded), split by who saved them: in_proj,
                            the op itself (conv, scan, gated norm: the mixer's own intermediates), out_proj,
                            the block's RMSNorm
    one block: working set  peak allocated while one block runs forward with grad and backward (its input and
                            output gradient excluded): what a recomputed block needs at once
    loss tiles              peak of the tiled loss (final norm, LM head, cross entropy, 8192 tokens per tile)
                            forward and backward over the hidden states (the hidden state and its gradient
                            excluded)
    step peak               max_memory_allocated over a whole step: checkpoints on the GPU, and with
                            ``ds_mamba_spcp.memory.offload`` at GPU budget 0 (all but the newest in pinned
                            host memory)
    host                    /proc/self/status (VmRSS, RssAnon, RssShmem) around the offloaded step and the
                            pool's bytes; one checkpoint's size pinned two ways: torch's pinned allocator
                            (``pin_memory=True``, what save_on_cpu and DeepSpeed's checkpoint_in_cpu use)
                            against this package's exact-size pool; and a step with DeepSpeed's
                            ``checkpoint_in_cpu`` (its GPU peak and host growth), last per length

Per component the JSON keeps the bytes at each length; the Markdown table gives GiB at each length and
the slope in KiB per token between the two lengths (what one more token costs; constant parts cancel).
``--cpu``: a tiny preset in fp32 through DeepSpeed's CPU accelerator (host columns only, saved bytes and
the split work the same).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import sys
from datetime import datetime, timezone

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for path in (REPO, HERE, os.path.join(REPO, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

SCHEMA = "ds_mamba_spcp.memory_table/1"
TINY = ["--vocab-size", "64", "--d-model", "32", "--n-layers", "3", "--d-state", "8", "--headdim", "8",
        "--expand", "2", "--ngroups", "1", "--chunk-size", "16", "--tie-embeddings"]  # fmt: skip
LOSS_TILE = 8192
GiB = 2**30


def _status() -> dict:
    """Host memory of this process, bytes: VmRSS, RssAnon, RssFile, RssShmem (/proc/self/status)."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


class Gpu:
    """torch.cuda memory statistics, or None everywhere on CPU."""

    def __init__(self, device: torch.device):
        self.on = device.type == "cuda"

    def sync(self):
        if self.on:
            torch.cuda.synchronize()

    def allocated(self):
        self.sync()
        return torch.cuda.memory_allocated() if self.on else None

    def reset_peak(self):
        self.sync()
        if self.on:
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        self.sync()
        return torch.cuda.max_memory_allocated() if self.on else None


def _minus(a, b):
    return None if a is None or b is None else a - b


@contextlib.contextmanager
def saved_bytes_by_module(root: torch.nn.Module, params: set[int]):
    """Sums the bytes saved for backward inside ``root``, by the innermost module running when each was
    saved (each storage counted once; parameters excluded). Yields the dict it fills."""
    totals: dict[str, int] = {}
    seen: set[int] = set()
    stack = ["(outside)"]
    names = {m: n or type(m).__name__ for n, m in root.named_modules()}
    handles = []

    def enter(module, inputs):
        stack.append(names[module])

    def leave(module, inputs, output):
        stack.pop()  # returns None: the output stays the module's

    for module in names:
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            totals[stack[-1]] = totals.get(stack[-1], 0) + storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield totals
    finally:
        for h in handles:
            h.remove()


def _group(totals: dict[str, int]) -> dict[str, int]:
    """Saved bytes of one block by component (module names of examples/model.py's Block)."""
    out = {"in_proj": 0, "op": 0, "out_proj": 0, "block_norm": 0, "other": 0}
    for name, nbytes in totals.items():
        key = ("in_proj" if name.endswith("in_proj") else "out_proj" if name.endswith("out_proj")
               else "block_norm" if name == "norm" else "op" if name.startswith("mixer") else "other")  # fmt: skip
        out[key] += nbytes
    return out


def pinned_probe(nbytes: int) -> dict:
    """Host memory taken by one ``nbytes`` pinned buffer: torch's pinned allocator vs the exact pool."""
    from ds_mamba_spcp.memory import offload

    out = {"bytes": nbytes}
    before = _status()
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t.fill_(1)  # touch it (cudaHostAlloc'ed memory is committed already; this makes sure)
    out["torch_pin_memory"] = _delta(_status(), before)
    out["torch_pin_memory"]["rss"] = out["torch_pin_memory"]["RssAnon"] + out["torch_pin_memory"]["RssShmem"]
    del t  # cached by torch's host allocator, not returned: the next probe starts from here
    before = _status()
    buf = offload._register(nbytes)
    buf.fill_(1)
    out["exact_pool"] = _delta(_status(), before)
    out["exact_pool"]["rss"] = out["exact_pool"]["RssAnon"] + out["exact_pool"]["RssShmem"]
    del buf
    gc.collect()
    return out


def build(preset_args: list[str], device, cpu: bool):
    """(train module, args, engine, model, group, ds_config, params bytes) for one preset."""
    import deepspeed
    import train as train_mod
    import train_runs
    from model import parallelize

    args = train_mod.parse_args(preset_args + ["--activation-checkpointing", "--loss-tile", str(LOSS_TILE)])
    ds_config = train_runs.ds_config(1, "state_passing")
    if cpu:
        ds_config.pop("bf16")
    group, mpu = train_mod.sequence_parallel_groups(1)
    gpu = Gpu(device)
    before = gpu.allocated()
    model = train_mod.build_model(args)
    parallelize(model, group, ds_config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config,
                                           mpu=mpu)  # fmt: skip
    return train_mod, args, engine, model, group, ds_config, _minus(gpu.allocated(), before)


def step(engine, model, batch, group, offloader, gpu: Gpu) -> dict:
    """One training step with the block checkpoints placed by ``offloader``; its memory phases."""
    from ds_mamba_spcp.data import sequence_parallel_tiled_cross_entropy
    from ds_mamba_spcp.memory import OffloadedCheckpoint

    model.checkpoint = OffloadedCheckpoint(offloader)
    gc.collect()
    gpu.reset_peak()
    a0, host0 = gpu.allocated(), _status()
    hidden = engine(batch["input_ids"], return_hidden=True)
    a1 = gpu.allocated()
    loss, _ = sequence_parallel_tiled_cross_entropy(hidden, model.logits, batch["shift_labels"], group,
                                                    tile_tokens=LOSS_TILE)  # fmt: skip
    engine.backward(loss)
    engine.step()
    del hidden, loss
    delta = _delta(_status(), host0)
    delta["rss"] = delta["RssAnon"] + delta["RssShmem"]  # where pinned memory shows: registered (anon) or shared
    return dict(
        forward_retained=_minus(a1, a0), peak_over_fixed=_minus(gpu.peak(), a0), peak=gpu.peak(),
        host_delta=delta, pool_bytes=offloader.pool.reserved_bytes if offloader.pool else 0,
        checkpoints_offloaded=offloader.stats["offloaded"], checkpoints_saved=offloader.stats["saved"],
    )  # fmt: skip


def step_library(engine, model, batch, group, gpu: Gpu) -> dict:
    """One training step with DeepSpeed's own offload (``checkpoint_in_cpu``, what ``--offload-impl library``
    runs under the launcher): its GPU peak and the host memory it takes (PyTorch's pinned allocator)."""
    import deepspeed

    from ds_mamba_spcp.data import sequence_parallel_tiled_cross_entropy

    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    model.checkpoint = deepspeed.checkpointing.checkpoint
    gc.collect()
    gpu.reset_peak()
    a0, host0 = gpu.allocated(), _status()
    hidden = engine(batch["input_ids"], return_hidden=True)
    loss, _ = sequence_parallel_tiled_cross_entropy(hidden, model.logits, batch["shift_labels"], group,
                                                    tile_tokens=LOSS_TILE)  # fmt: skip
    engine.backward(loss)
    engine.step()
    del hidden, loss
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=False)
    delta = _delta(_status(), host0)
    delta["rss"] = delta["RssAnon"] + delta["RssShmem"]
    return dict(peak=gpu.peak(), peak_over_fixed=_minus(gpu.peak(), a0), host_delta=delta)


def one_block(model, seqlen: int, dtype, device, gpu: Gpu) -> dict:
    block = model.layers[len(model.layers) // 2]
    d = model.embedding.embedding_dim
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(1, seqlen, d, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    gc.collect()
    gpu.reset_peak()
    base = gpu.allocated()
    with saved_bytes_by_module(block, params) as totals:
        y = block(x)
    after_fwd = gpu.allocated()
    y.backward(dy)
    del y
    out = dict(saved=_group(totals), saved_total=sum(totals.values()), forward_retained=_minus(after_fwd, base),
               working_set=_minus(gpu.peak(), base), input_bytes=x.numel() * x.element_size())  # fmt: skip
    model.zero_grad(set_to_none=True)
    return out


def loss_tiles(model, seqlen: int, labels, dtype, device, gpu: Gpu) -> dict:
    from ds_mamba_spcp.data import sequence_parallel_tiled_cross_entropy

    hidden = torch.randn(1, seqlen, model.embedding.embedding_dim, dtype=dtype, device=device, requires_grad=True)
    gc.collect()
    gpu.reset_peak()
    base = gpu.allocated()
    loss, _ = sequence_parallel_tiled_cross_entropy(hidden, model.logits, labels, None, tile_tokens=LOSS_TILE)
    loss.backward()
    hidden_grad = hidden.numel() * hidden.element_size()
    out = dict(peak=_minus(gpu.peak(), base), hidden_grad=hidden_grad,
               peak_without_hidden_grad=_minus(_minus(gpu.peak(), base), hidden_grad))  # fmt: skip
    model.zero_grad(set_to_none=True)
    return out


def measure(preset: str, preset_args: list[str], lengths: list[int], device, cpu: bool) -> list[dict]:
    from ds_mamba_spcp.data import shard_batch
    from ds_mamba_spcp.memory import CheckpointOffloader

    gpu = Gpu(device)
    train_mod, args, engine, model, group, ds_config, params = build(preset_args, device, cpu)
    dtype = next(model.parameters()).dtype
    records, fixed_after_init = [], gpu.allocated()
    for i, seqlen in enumerate(lengths):
        full = train_mod.synthetic_batch(1, seqlen, args.vocab_size, seed=seqlen)
        batch = {k: v.to(device) for k, v in shard_batch(full, rank=0, world_size=1).items()}
        on_gpu = step(engine, model, batch, group, CheckpointOffloader(gpu_budget_bytes=2**62), gpu)
        fixed = gpu.allocated()  # params + optimizer states + gradient buffers, no activations alive
        offloader = CheckpointOffloader(gpu_budget_bytes=0)
        offloaded = step(engine, model, batch, group, offloader, gpu)
        offloaded_again = step(engine, model, batch, group, offloader, gpu)  # the pool reused: no new host memory
        each = seqlen * args.d_model * torch.finfo(dtype).bits // 8
        rec = dict(
            preset=preset, seqlen=seqlen, d_model=args.d_model, n_layers=args.n_layers, dtype=str(dtype),
            params=params, optimizer_and_grads=_minus(fixed, fixed_after_init) if i == 0 else None,
            fixed=fixed, checkpoint_bytes_each=each, checkpoints=each * args.n_layers,
            step_gpu_checkpoints=on_gpu, step_offloaded=offloaded, step_offloaded_again=offloaded_again,
            one_block=one_block(model, seqlen, dtype, device, gpu),
            loss_tiles=loss_tiles(model, seqlen, batch["shift_labels"], dtype, device, gpu),
        )  # fmt: skip
        if gpu.on:
            rec["pinned_probe"] = pinned_probe(each)
            # last: PyTorch's pinned allocator keeps what it allocated cached (the probe above would reuse it).
            # GPU only: DeepSpeed 0.19.8's blocking CPU path (no side stream) hands the block a 0-d tensor.
            rec["step_library"] = step_library(engine, model, batch, group, gpu)
        records.append(rec)
        print(f"{preset} L={seqlen}: step peak {_gib(on_gpu['peak'])} GiB (checkpoints on the GPU), "
              f"{_gib(offloaded['peak'])} GiB offloaded, host pool {_gib(offloaded['pool_bytes'])} GiB",
              flush=True)  # fmt: skip
        del batch, full
    model.checkpoint = None
    del engine, model
    gc.collect()
    if gpu.on:
        torch.cuda.empty_cache()
    return records


def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.2f}"


ROWS = [  # (component, path into a record)
    ("params and master weights (after initialize)", ("params",)),
    ("optimizer state and gradient buffers (after step 1)", ("first", "optimizer_and_grads")),
    ("block checkpoints (inputs, n_layers x d_model x itemsize)", ("checkpoints",)),
    ("kept after forward (allocator, checkpoints on the GPU)", ("step_gpu_checkpoints", "forward_retained")),
    ("kept after forward (offloaded, budget 0)", ("step_offloaded", "forward_retained")),
    ("one block: saved for backward, total", ("one_block", "saved_total")),
    ("one block: saved by in_proj (its input)", ("one_block", "saved", "in_proj")),
    ("one block: saved by the op (conv, scan, gated norm)", ("one_block", "saved", "op")),
    ("one block: saved by out_proj", ("one_block", "saved", "out_proj")),
    ("one block: saved by the block norm", ("one_block", "saved", "block_norm")),
    ("one block: recompute + backward working set (peak)", ("one_block", "working_set")),
    ("loss tiles: peak (hidden grad excluded)", ("loss_tiles", "peak_without_hidden_grad")),
    ("step peak, checkpoints on the GPU", ("step_gpu_checkpoints", "peak")),
    ("step peak, offloaded (budget 0)", ("step_offloaded", "peak")),
    ("host: pinned pool (offloaded)", ("step_offloaded", "pool_bytes")),
    ("host: RSS growth, first offloaded step (pool)", ("step_offloaded", "host_delta", "rss")),
    ("host: VmRSS growth, second offloaded step", ("step_offloaded_again", "host_delta", "VmRSS")),
    ("step peak, DeepSpeed's checkpoint_in_cpu", ("step_library", "peak")),
    ("host: RSS growth, DeepSpeed's checkpoint_in_cpu step", ("step_library", "host_delta", "rss")),
    ("host: one checkpoint pinned by torch (RSS growth)", ("pinned_probe", "torch_pin_memory", "rss")),
    ("host: one checkpoint in the exact pool (RSS growth)", ("pinned_probe", "exact_pool", "rss")),
]


def _at(rec: dict, path: tuple, first: dict):
    value = first if path[0] == "first" else rec
    for key in path[1:] if path[0] == "first" else path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def rows(recs: list[dict]) -> list[tuple[str, list]]:
    """(component, [bytes at each length]) for the Markdown table."""
    return [(name, [_at(r, path, recs[0]) for r in recs]) for name, path in ROWS]


def markdown(payload: dict) -> str:
    h = payload["header"]
    lines = [f"# Memory by component ({h.get('gpu', 'cpu')}, {h['date']}, commit {h.get('git_commit')})", "",
             "One rank, ZeRO 1, AdamW, tiled loss of 8192 tokens; `benchmarks/memory_table.py` (its docstring "
             "says how each row is measured). KiB/token: the slope between the two lengths; '-': not measured "
             "there (GPU rows on CPU).", ""]  # fmt: skip
    for preset in dict.fromkeys(r["preset"] for r in payload["records"]):
        recs = [r for r in payload["records"] if r["preset"] == preset]
        r0 = recs[0]
        lines += [f"## {preset} (d_model {r0['d_model']} x {r0['n_layers']} layers, {r0['dtype']})", ""]
        head = " | ".join(f"GiB at {r['seqlen']:,}" for r in recs)
        lines += [f"| component | {head} | KiB/token |", "|---|" + "---|" * (len(recs) + 1)]
        for name, values in rows(recs):
            slope = "-"
            if len(recs) >= 2 and values[0] is not None and values[-1] is not None:
                slope = f"{(values[-1] - values[0]) / (recs[-1]['seqlen'] - recs[0]['seqlen']) / 1024:.1f}"
            lines.append(f"| {name} | " + " | ".join(_gib(v) for v in values) + f" | {slope} |")
        lines.append("")
    return "\n".join(lines)


def environment(args, device) -> dict:
    header = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  torch=torch.__version__, git_commit=args.git_commit, device=str(device))  # fmt: skip
    if device.type == "cuda":
        header["gpu"] = torch.cuda.get_device_name(0)
        header["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GiB, 1)
    with open("/proc/meminfo", encoding="ascii") as f:
        header["host_mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    return header


def init_one_rank(cpu: bool) -> None:
    """torch.distributed with one rank (what DeepSpeed needs), on a free port."""
    import socket

    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    deepspeed.init_distributed(dist_backend="gloo" if cpu else "nccl", verbose=False)
    deepspeed.utils.logger.setLevel("WARNING")


def main(argv=None) -> dict:
    import train_runs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--presets", default="mamba-130m,mamba-780m", help=f"comma separated, of {sorted(train_runs.PRESETS)}"
    )
    p.add_argument("--lengths", default="65536,131072", help="two (or more) global lengths, comma separated")
    p.add_argument("--cpu", action="store_true", help="the tiny preset on CPU, fp32 (lengths default 64,128)")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", required=True, help="JSON path; the Markdown table lands beside it")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    cpu = device.type == "cpu"
    lengths = [int(x) for x in (("64,128" if args.cpu and args.lengths == p.get_default("lengths") else args.lengths)
                                .split(","))]  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_device(0)
    init_one_rank(cpu)
    presets = (
        {"tiny": TINY} if args.cpu else {n: train_runs.COMMON + train_runs.PRESETS[n] for n in args.presets.split(",")}
    )
    payload = dict(schema=SCHEMA, header=environment(args, device), records=[])
    for name, preset_args in presets.items():
        payload["records"] += measure(name, preset_args, lengths, device, cpu)
        train_runs.write_results(args.out, payload, markdown)
    return payload


if __name__ == "__main__":
    main()
    from ds_mamba_spcp.comm import shutdown

    shutdown()  # a gloo rank can abort at exit while its group lives
