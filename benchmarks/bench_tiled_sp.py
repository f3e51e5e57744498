"""The cost of a tiled layer's summary and correction passes (issue 43 item 3): one hf-bamba-2b decoder layer with a
Mamba2 mixer, the ``"long_context"`` key's tiled layers on, forward+backward per rank at sp 1 with ``L_shard`` tokens
against sp 2 with two ranks each holding ``L_shard`` (a row of 2 x L_shard), and the parts of each.

    python3 benchmarks/bench_tiled_sp.py --out /tmp/tiled_sp.json          (one GPU; writes .json + .md)
    python3 benchmarks/bench_tiled_sp.py --device cpu --out /tmp/tiled_sp_cpu.json   (smoke: gloo, tiny, seconds)

The layer is transformers' ``BambaDecoderLayer`` (input norm, the mixer, the residual, the pre-MLP norm and the MLP)
of a one-layer ``BambaModel`` of the train_hf.py preset (``--preset``; bf16 on GPU, fp32 and the tiny preset on
CPU), prepared by ``prepare_sequence_parallel`` with ``{"long_context": {"tile_tokens": --tile}}``: at sp 1 the
layer runs ``TiledFn`` (memory/tiled_block.py), at sp 2 ``ShardTiledFn`` (the tiles of the rank's shard, their state
from the ranks' summary exchange). Each timed iteration: the layer's forward on a random (1, L_shard, d_model)
input that requires grad and the backward of a fixed random output gradient (the input's and every parameter's
gradient); CUDA events on GPU, perf_counter on CPU; ``--warmup`` untimed iterations, then ``--iters``; the median
of each rank, the rank maximum reported.

One spawn of two ranks, every one on cuda:0 through gloo (as train_hf.py --shared-gpu; docs/design.md, "Traps"):

    sp 1          rank 0 alone (rank 1 waits in a barrier, the GPU is rank 0's): TiledFn's forward (the tiles) and
                  backward (the tiles in reverse)
    sp 2 shared   both ranks at once, each on its shard: their kernels contend for the one GPU (each phase's time
                  holds the other rank's kernels too) and the collectives go through the host
    sp 2 turns    the same, the ranks taking turns at each compute phase (a barrier before it; rank r starts when
                  ranks < r have synchronized the GPU and left it): each compute phase as on a GPU of its own; a
                  phase holding a collective (halo, exchange) runs on both ranks at once after a barrier, gloo's host
                  copies included. The turns' sum is what two real GPUs would run per rank, up to the collectives
                  (NCCL on NVLink moves the halo rows and the (nheads, headdim, dstate) summaries in microseconds)

The phases, in the order a rank runs them (the names tiled_block.py marks; ``PHASES``):

    fwd_tiles     sp 1: the forward over the tiles              bwd_tiles     sp 1: the backward over the tiles
    fwd_halo      the previous rank's last d_conv-1 input rows (one all-gather) and the tiles' labels
    summary       pass 1: each tile's summary from a zero state (norm, in_proj, the core's summary; no output)
    exchange      the summary exchange -> the state entering the shard (waits for the slower rank)
    pass2         the correction: the tiles from that state (the whole layer, the output)
    bwd_pass1     the tiles in reverse with the output's gradient, the state gradient from zero at the shard's end
    bwd_exchange  the reverse scan: the state gradient later ranks send back
    bwd_pass2     that gradient through the tiles' state path (the chain's last rank has none to push)
    bwd_halo      the halo rows' gradients back to their owners (one all-gather)

``--state-path`` picks what bwd_pass2 runs: ``backend`` (the default) the backend's ``segment_state`` (on a GPU
Triton's chunk-state and state-passing backward kernels alone), ``whole`` the backend's whole segment with a zero
output gradient (what pass 2 ran before the Triton backend had a state path: before/after in one call each),
``reference`` the reference backend's plain-PyTorch state path on the same tensors (an experiment).

``rest`` is the iteration's time outside the marked phases (autograd and the Function's entry and exit). The JSON
(rewritten after each cell) and a Markdown table beside it: per L_shard, sp 1's and sp 2's fwd+bwd per rank and their
ratio (the issue's target: sp 2 / sp 1 <= 1.5 per rank), the turns' sum of phases against sp 1's, and every phase.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import torch  # noqa: E402
from bench_mixer import _fmt_len, _parse_len, provenance, spawned_ranks, versions, write_json  # noqa: E402  (shared with bench_mixer)
from train_hf import PRESETS  # noqa: E402  (the model's sizes)

SCHEMA = "ds_mamba_spcp.bench_tiled_sp/1"
SETTINGS = ("sp1", "sp2_shared", "sp2_turns")
PHASES = ("fwd_tiles", "bwd_tiles", "fwd_halo", "summary", "exchange", "pass2", "bwd_pass1", "bwd_exchange",
          "bwd_pass2", "bwd_halo")  # fmt: skip
COLLECTIVE = ("fwd_halo", "exchange", "bwd_exchange", "bwd_halo")
STATE_PATHS = ("backend", "whole", "reference")
WORLD = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default=None, help="train_hf.py's preset: hf-bamba-2b (cuda), hf-bamba-tiny (cpu)")
    p.add_argument("--shard-lengths", default=None, help="L_shard, tokens per rank: 64K,128K (cuda) / 64 (cpu)")
    p.add_argument("--tile", default=None, help="tile_tokens: 16K (cuda), 16 (cpu)")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--iters", type=int, default=None, help="timed iterations: 8 (cuda), 2 (cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first: 3 (cuda), 1 (cpu)")
    p.add_argument("--budget-s", type=float, default=240.0, help="a cell that would start past it is skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state-path", choices=STATE_PATHS, default="backend",
                   help="backward pass 2: the backend's state path (segment_state), its whole segment with a zero "
                        "output gradient (whole: pass 2 before Triton had a state path), or the reference backend's "
                        "plain-PyTorch state path on the GPU's tensors (reference: an experiment)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no line per cell on stdout")
    p.add_argument("--git-commit", default=None)
    p.add_argument("--out", default=None, help="JSON path (a Markdown table is written beside it)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.preset = args.preset or ("hf-bamba-2b" if cuda else "hf-bamba-tiny")
    if args.preset not in PRESETS:
        p.error(f"--preset: one of {sorted(PRESETS)}")
    args.shard_lengths = [_parse_len(s) for s in (args.shard_lengths or ("64K,128K" if cuda else "64")).split(",")]
    args.tile = _parse_len(args.tile or ("16K" if cuda else "16"))
    args.settings = [s for s in args.settings.split(",") if s]
    if not set(args.settings) <= set(SETTINGS):
        p.error(f"--settings: some of {SETTINGS}, got {args.settings}")
    args.iters = args.iters or (8 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    return args


# -- one rank ---------------------------------------------------------------------------------------------------


def _layer(args, sp: int, device, dtype):
    """The decoder layer of a one-layer BambaModel of the preset (a Mamba2 mixer, no attention), prepared at ``sp``
    with the key's tiled layers (nothing else of the key applies to one layer)."""
    from transformers import BambaConfig, BambaModel

    from ds_mamba_spcp.integrations.transformers import prepare_sequence_parallel

    dims = {**PRESETS[args.preset], "num_hidden_layers": 1, "attn_layer_indices": [], "vocab_size": 256}
    config = BambaConfig(**dims, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with device:
        model = BambaModel(config)
    model = model.to(dtype).train()
    section = {"enabled": True, "sequence_parallel_size": sp,
               "long_context": {"tile_tokens": args.tile, "fused_loss": False, "tiled_mlp": False}}  # fmt: skip
    prepare_sequence_parallel(model, {"mamba_sequence_parallel": section})
    return model.layers[0]


class _Recorder:
    """tiled_block.PHASES during one iteration: each phase's ms. ``turns``: the ranks take turns at each compute
    phase (the module docstring), timed on the host after a synchronize."""

    def __init__(self, cuda: bool, turns: bool, rank: int):
        self.cuda, self.turns, self.rank = cuda, turns, rank
        self.marks, self.current, self.t0 = [], None, 0.0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, name: str) -> None:
        if not self.turns:
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.marks.append((name, ev))
            else:
                self.marks.append((name, time.perf_counter()))
            return
        barrier = torch.distributed.barrier
        if self.current is not None:  # the phase in hand ends
            self._sync()
            self.marks.append((self.current, (time.perf_counter() - self.t0) * 1e3))
            if self.current not in COLLECTIVE:
                for _ in range(WORLD - 1 - self.rank):  # the ranks after this one take their turn
                    barrier()
        self.current = None if name.endswith("_end") else name
        if self.current is not None:
            barrier()  # every rank done with the previous phase
            if self.current not in COLLECTIVE:
                for _ in range(self.rank):  # the ranks before this one had their turn
                    barrier()
            self._sync()
            self.t0 = time.perf_counter()

    def phases(self) -> dict:
        """Phase -> ms of this iteration (after the iteration's synchronize)."""
        out = {}
        if self.turns:
            for name, ms in self.marks:
                out[name] = out.get(name, 0.0) + ms
            return out
        for (name, a), (_, b) in zip(self.marks, self.marks[1:]):
            if not name.endswith("_end"):
                ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
                out[name] = out.get(name, 0.0) + ms
        return out


def _cell(layer, L: int, args, device, dtype, turns: bool, rank: int) -> dict:
    """Per-iteration totals and phases of one layer at L_shard = L on this rank."""
    tiled_block = importlib.import_module("ds_mamba_spcp.memory.tiled_block")  # the package exports the function

    cuda = device.type == "cuda"
    d = layer.input_layernorm.weight.shape[0]
    g = torch.Generator(device=device).manual_seed(args.seed + 1 + rank)
    x = torch.randn(1, L, d, generator=g, device=device, dtype=dtype).requires_grad_()
    dout = torch.randn(1, L, d, generator=g, device=device, dtype=dtype)
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout)

    totals, phases = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(args.warmup + args.iters):
            rec = _Recorder(cuda, turns, rank)
            tiled_block.PHASES = rec
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= args.warmup:
                totals.append(ms)
                phases.append(rec.phases())
    finally:
        tiled_block.PHASES = None
    names = [n for n in PHASES if any(n in p for p in phases)]
    median = {n: statistics.median(p.get(n, 0.0) for p in phases) for n in names}
    return dict(total_ms=statistics.median(totals), total_min_ms=min(totals), phases_ms=median,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)  # fmt: skip


def _gather(value) -> list:
    out = [None] * WORLD
    torch.distributed.all_gather_object(out, value)
    return out


def _agree(ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def _record(setting: str, L: int, args, per_rank: list) -> dict:
    """One cell's record from the ranks' results (sp 1: rank 0's alone)."""
    ranks = [r for r in per_rank if r is not None]
    rec = dict(setting=setting, sp=1 if setting == "sp1" else 2, shard_length=L, tile_tokens=args.tile,
               state_path=args.state_path,
               status="ok", per_rank=ranks)  # fmt: skip
    bad = [r for r in ranks if r.get("status") != "ok"]
    if bad:
        rec.update(status=bad[0]["status"], reason=bad[0].get("reason"))
        return rec
    names = [n for n in PHASES if any(n in r["phases_ms"] for r in ranks)]
    rec["phases_ms"] = {n: max(r["phases_ms"].get(n, 0.0) for r in ranks) for n in names}  # the rank maximum
    rec["phases_sum_ms"] = max(sum(r["phases_ms"].values()) for r in ranks)
    rec["compute_ms"] = max(sum(v for n, v in r["phases_ms"].items() if n not in COLLECTIVE) for r in ranks)
    rec["peak_gib"] = None if ranks[0]["peak_gib"] is None else max(r["peak_gib"] for r in ranks)
    if setting != "sp2_turns":  # the turns' iteration holds barriers: its total is no fwd+bwd time
        rec["fwd_bwd_ms"] = max(r["total_ms"] for r in ranks)
        rec["rest_ms"] = max(r["total_ms"] - sum(r["phases_ms"].values()) for r in ranks)
    return rec


def _run_cell(layer, L, args, device, dtype, turns, rank, active: bool):
    """This rank's result (None when not ``active``: sp 1's rank 1 waits); every rank agrees on failures."""
    result, err = None, None
    if active:
        try:
            result = dict(status="ok", **_cell(layer, L, args, device, dtype, turns, rank))
        except torch.cuda.OutOfMemoryError as e:
            result = dict(status="oom", reason=str(e)[:300])
        except Exception as e:  # noqa: BLE001 - recorded; the ranks agree before going on
            traceback.print_exc()
            err = f"{type(e).__name__}: {e}"
            result = dict(status="error", reason=err[:2000])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _ranks(rank: int, args, deadline: float, out_queue) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = {}
    if "sp1" in args.settings:
        layers[1] = _layer(args, 1, device, dtype)  # every rank: the group of one is made collectively
    if {"sp2_shared", "sp2_turns"} & set(args.settings):
        layers[2] = _layer(args, 2, device, dtype)
    for L in args.shard_lengths:
        for setting in args.settings:
            if not _agree(time.time() < deadline):
                rec = dict(setting=setting, shard_length=L, tile_tokens=args.tile, status="skipped",
                           reason=f"past --budget-s {args.budget_s:.0f}")  # fmt: skip
            else:
                sp = 1 if setting == "sp1" else 2
                torch.distributed.barrier()
                mine = _run_cell(layers[sp], L, args, device, dtype, setting == "sp2_turns", rank,
                                 active=sp == 2 or rank == 0)  # fmt: skip
                rec = _record(setting, L, args, _gather(mine))
            if rank == 0:
                out_queue.put(("record", rec))
                if not args.no_progress:
                    value = rec.get("fwd_bwd_ms", rec.get("phases_sum_ms"))
                    shown = f"{value:9.1f} ms" if rec["status"] == "ok" else rec["status"]
                    print(f"[bench_tiled_sp] L_shard={_fmt_len(L)} {setting:<10} {shown}", flush=True)


def _choose_state_path(args) -> None:
    """--state-path, in this rank's process: ``Tiles.state`` (memory/tiled_block.py) takes the backend's
    ``segment_state`` where the backend module has one, else the whole segment."""
    from ds_mamba_spcp.ops import reference

    if args.device == "cuda":
        from ds_mamba_spcp.ops import triton as backend
    else:
        backend = reference  # (the layer's backend on CPU)
    if args.state_path == "whole":
        del backend.segment_state
    elif args.state_path == "reference":
        backend.segment_state = reference.segment_state


def _worker(rank, port, out_queue, args, deadline):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK="0")  # fmt: skip
    torch.set_num_threads(1 if args.device == "cpu" else max(1, (os.cpu_count() or 2) // WORLD))
    try:
        if args.device == "cuda":
            torch.cuda.set_device(0)
        _choose_state_path(args)
        import deepspeed.comm as dist

        # gloo up before DeepSpeed: its init passes device_id on a GPU, and torch 2.11's new_group then splits the
        # group, which gloo cannot ("no attribute 'perform_nocolor_split'": the first H100 run of this benchmark)
        torch.distributed.init_process_group(backend="gloo")
        dist.init_distributed(dist_backend="gloo", verbose=False)
        _ranks(rank, args, deadline, out_queue)
        dist.barrier()
        out_queue.put(("done", rank))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out_queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _spawn(args, deadline: float, payload: dict, out: str) -> str | None:
    """The two ranks; each record lands in ``payload`` (and the files) as rank 0 sends it. Returns an error or None."""

    def on_message(message):
        kind, value = message
        if kind == "record":
            payload["records"].append(value)
            write(payload, out)
            return None
        return ("done", value) if kind == "done" else ("error", value)

    # a rank stuck in a collective: give up three minutes past the budget
    return spawned_ranks(_worker, WORLD, (args, deadline), deadline + 180, on_message)


# -- output -----------------------------------------------------------------------------------------------------


def header(args) -> dict:
    cuda = args.device == "cuda"
    return dict(
        **provenance(args.git_commit),
        hardware=dict(
            device=args.device,
            gpu_name=torch.cuda.get_device_name(0) if cuda else None,
            cpu_count=os.cpu_count(),
            hostname=platform.node(),
        ),
        versions=versions("triton", "deepspeed", "transformers", "mamba_ssm"),
        proxy=(
            "two ranks on one GPU through gloo: sp 2 shared contends for the GPU, sp 2 turns times each compute "
            "phase alone"
            if cuda
            else "a CPU smoke run (gloo, tiny, fp32): times mean nothing"
        ),
    )


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _gib(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _cells(records: list) -> dict:
    cells = {}
    for r in records:
        cells.setdefault(r["shard_length"], {})[r["setting"]] = r
    return cells


def ratios(records: list) -> list:
    """Per L_shard: sp 2's fwd+bwd per rank over sp 1's (ranks sharing the GPU), and the turns' sum of phases over sp
    1's (each compute phase on a GPU of its own: the two-GPU estimate); None where a setting did not run."""
    out = []
    for L, row in sorted(_cells(records).items()):
        ok = {k: v for k, v in row.items() if v["status"] == "ok"}
        one, shared, turns = ok.get("sp1", {}), ok.get("sp2_shared", {}), ok.get("sp2_turns", {})

        def over(a, b):
            return None if a is None or not b else a / b

        out.append(dict(shard_length=L, shared_over_sp1=over(shared.get("fwd_bwd_ms"), one.get("fwd_bwd_ms")),
                        turns_over_sp1=over(turns.get("phases_sum_ms"), one.get("phases_sum_ms"))))  # fmt: skip
    return out


def markdown(payload: dict) -> str:
    cfg, h = payload["config"], payload["header"]
    lines = [
        f"# bench_tiled_sp: a tiled {cfg['preset']} decoder layer at sp 1 and sp 2, "
        f"{h['hardware'].get('gpu_name') or h['hardware']['device']}, commit {(h['git_commit'] or '?')[:9]}",
        "",
        f"PROXY: {h['proxy']}. Tiles of {_fmt_len(cfg['tile_tokens'])}, {cfg['dtype']}; per rank the median of "
        f"{cfg['iters']} iterations after {cfg['warmup']}, rank maximum. Target (issue 43): sp 2 / sp 1 <= 1.5.",
        "",
        "| L_shard | sp 1 fwd+bwd ms | sp 2 shared ms | shared / sp 1 | sp 2 turns: phases ms | turns / sp 1 phases "
        "| turns compute ms | sp 1 peak GiB | sp 2 peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = _cells(payload["records"])
    for L, row in sorted(cells.items()):
        ok = {k: v for k, v in row.items() if v["status"] == "ok"}
        one, shared, turns = ok.get("sp1", {}), ok.get("sp2_shared", {}), ok.get("sp2_turns", {})
        ratio = next((r for r in payload.get("ratios", []) if r["shard_length"] == L), {})
        lines.append(
            f"| {_fmt_len(L)} | {_ms(one.get('fwd_bwd_ms'))} | {_ms(shared.get('fwd_bwd_ms'))} | "
            f"{_ratio(ratio.get('shared_over_sp1'))} | {_ms(turns.get('phases_sum_ms'))} | "
            f"{_ratio(ratio.get('turns_over_sp1'))} | {_ms(turns.get('compute_ms'))} | "
            f"{_gib(one.get('peak_gib'))} | {_gib(shared.get('peak_gib'))} |"
        )
    names = [n for n in PHASES if any(n in r.get("phases_ms", {}) for r in payload["records"])]
    lines += ["", "Phases, ms (rank maximum of the medians; rest: outside the marked phases):", "",
              "| L_shard | setting | " + " | ".join(names) + " | rest |",
              "|---|---|" + "---|" * (len(names) + 1)]  # fmt: skip
    for L, row in sorted(cells.items()):
        for setting in SETTINGS:
            r = row.get(setting)
            if r is None:
                continue
            if r["status"] != "ok":
                lines.append(f"| {_fmt_len(L)} | {setting} | {r['status']}: {(r.get('reason') or '')[:200]} |")
                continue
            tds = [_ms(r["phases_ms"].get(n)) for n in names]
            lines.append(f"| {_fmt_len(L)} | {setting} | " + " | ".join(tds) + f" | {_ms(r.get('rest_ms'))} |")
    return "\n".join(lines) + "\n"


def write(payload: dict, out: str) -> str:
    payload["ratios"] = ratios(payload["records"])
    write_json(out, payload)
    md = os.path.splitext(out)[0] + ".md"
    with open(md, "w") as f:
        f.write(markdown(payload))
    return md


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --device cpu for the smoke run")
    deadline = time.time() + args.budget_s
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"tiled_sp_{args.device}.json")
    payload = dict(schema=SCHEMA, header=header(args), complete=False,
                   config=dict(preset=args.preset, shard_lengths=args.shard_lengths, tile_tokens=args.tile,
                               settings=args.settings, iters=args.iters, warmup=args.warmup, budget_s=args.budget_s,
                               dtype="bfloat16" if args.device == "cuda" else "float32", world=WORLD,
                               shared_gpu=True),
                   records=[])  # fmt: skip
    error = _spawn(args, deadline, payload, out)
    if error is not None:
        print(f"[bench_tiled_sp] failed: {error}", flush=True)
        payload["error"] = error[-4000:]
    payload["complete"] = error is None
    md = write(payload, out)
    print(f"[bench_tiled_sp] wrote {out} and {md}", flush=True)
    bad = [r for r in payload["records"] if r["status"] == "error"]
    return 1 if bad or error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
