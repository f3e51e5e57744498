"""Prefill on one GPU: tokens/s and peak memory of a long prompt's prefill, against transformers' and
mamba-ssm's own forward, and the chunked prefill (tiles through the whole model, states carried).

    MAMBA_DETERMINISTIC=1 python benchmarks/bench_prefill.py --presets mamba-130m,mamba-780m \\
        --lengths 131072,262144,524288,1048576 --chunked-lengths 1048576,2097152,4194304 \\
        --tile 131072 --out benchmarks/results/prefill_130m_h200x1.json

Modes, each a prompt of batch 1 in bf16 under ``torch.no_grad``, the logits of the last token only:
    hf_forward          transformers' ``Mamba2ForCausalLM`` forward (``use_cache=False, logits_to_keep=1``;
                        mamba-ssm's kernels where transformers finds them), the issue's baseline
    mamba_ssm_forward   mamba-ssm's ``MambaLMHeadModel`` forward (its fused path; no decode states)
    mamba_ssm_prefill   the same with ``inference_params`` (its prefill: conv and SSM states filled)
    ours_whole          ``sequence_parallel_prefill_mamba`` in a group of one (this package's op on the whole
                        prompt through the dispatcher's forward-only route, states into ``InferenceParams``)
    ours_whole_training_route   the same through the training route under ``torch.no_grad`` (the autograd
                        Function, y kept, mamba-ssm's own op): what the forward-only route's peak is compared to
    ours_tiled          ``ours_whole`` with the op's ``tile_length`` = ``--tile`` (the mixer core in tiles, one at a
                        time on the forward-only route; in_proj and out_proj still see the whole prompt)
    ours_tiled_training_route   the same tiles through the training route under ``torch.no_grad`` (every
                        tile's first phase alive until the last summary, every tile's y kept)
    ours_chunked        ``chunked_prefill_mamba``: tiles of ``--tile`` tokens through the whole model, every
                        layer's state and conv tail carried; activations of one tile at a time
Per mode and length: status (ok / oom / error), median seconds over ``--repeats`` timed runs after one
warm-up, tokens/s, seconds per 1M prompt tokens, peak memory (``torch.cuda.max_memory_allocated``) and, for
the mamba-ssm model's modes, the last logits' relative RMS distance from ``mamba_ssm_prefill`` (or from
``ours_whole`` where mamba-ssm's model cannot run: CPU). The ratios in the Markdown table come from this
one run. Presets: Mamba2 LMs (vocab 50280, d_state 128, headdim 64, expand 2, chunk 256, ngroups 1):
``mamba-130m`` d_model 768 x 24, ``mamba-780m`` 1536 x 48; ``tiny`` for the CPU path (``--device cpu``).
The model is mamba-ssm's own ``MambaLMHeadModel`` (importable without its ``selective_scan_cuda``:
``_upstream.mamba_lm_head_model``); on GPU with its fused add-norm and Triton RMSNorm, on CPU with
nn.LayerNorm and no fused add-norm (its Triton kernels need a GPU), where the mamba_ssm_* modes are skipped
(its own scan is Triton) and the ours_* modes run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _path in (REPO, HERE):  # the package, and train_runs' results writer beside this script
    if _path not in sys.path:
        sys.path.insert(0, _path)

from train_runs import write_results  # noqa: E402

SCHEMA = "ds_mamba_spcp.bench_prefill/1"
MODES = ("hf_forward", "mamba_ssm_forward", "mamba_ssm_prefill", "ours_whole", "ours_chunked")
# the forward-only route against the training route under no_grad (peak memory): --modes to add them
EXTRA_MODES = ("ours_whole_training_route", "ours_tiled", "ours_tiled_training_route")
COMMON = dict(vocab=50280, d_state=128, headdim=64, expand=2, chunk=256, ngroups=1, d_conv=4)
PRESETS = {
    "mamba-130m": dict(COMMON, d_model=768, n_layer=24),
    "mamba-780m": dict(COMMON, d_model=1536, n_layer=48),
    "tiny": dict(vocab=64, d_state=8, headdim=8, expand=2, chunk=16, ngroups=1, d_conv=4, d_model=32, n_layer=2),
}


def _d_in_proj(p: dict) -> int:
    """Width of in_proj's output: z, xBC and dt."""
    d_inner = p["expand"] * p["d_model"]
    return 2 * d_inner + 2 * p["ngroups"] * p["d_state"] + d_inner // p["headdim"]


def _hf_binds_mamba_kernels():
    """Whether transformers bound mamba-ssm's fused op to its Mamba2 (None: cannot tell on this release)."""
    import inspect

    import transformers.models.mamba2.modeling_mamba2 as m

    f = getattr(m, "mamba2_split_conv1d_scan_combined", None)
    while f is not None:
        try:
            found = inspect.getclosurevars(f).nonlocals.get("is_new_implementation")
        except TypeError:
            found = None
        if found is not None:
            return bool(found)
        f = getattr(f, "__wrapped__", None)
    return None


def _hf_model(p: dict, device, dtype):
    import torch
    import transformers as tf

    cfg = tf.Mamba2Config(
        vocab_size=p["vocab"], hidden_size=p["d_model"], num_hidden_layers=p["n_layer"], state_size=p["d_state"],
        head_dim=p["headdim"], num_heads=p["expand"] * p["d_model"] // p["headdim"], expand=p["expand"],
        n_groups=p["ngroups"], chunk_size=p["chunk"], conv_kernel=p["d_conv"], tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.Mamba2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _mamba_model(p: dict, device, dtype):
    """mamba-ssm's MambaLMHeadModel: its fused add-norm on GPU, plain LayerNorms on CPU."""
    import torch

    from ds_mamba_spcp.ops.kernels.upstream import mamba_lm_head_model

    model_cls, config_cls = mamba_lm_head_model()
    gpu = device.type == "cuda"
    cfg = config_cls(
        d_model=p["d_model"], n_layer=p["n_layer"], vocab_size=p["vocab"], rms_norm=gpu, fused_add_norm=gpu,
        residual_in_fp32=True, tie_embeddings=True,
        ssm_cfg=dict(layer="Mamba2", d_state=p["d_state"], headdim=p["headdim"], ngroups=p["ngroups"],
                     chunk_size=p["chunk"], expand=p["expand"], d_conv=p["d_conv"]),
    )  # fmt: skip
    torch.manual_seed(0)
    return model_cls(cfg, device=device, dtype=dtype).eval()


def _with_route(run, forward_only: bool):
    """``run`` with the prefill's mixer core on the forward-only route (True) or the training route (False)."""
    import functools

    from ds_mamba_spcp.inference import forward, prefill

    def routed(ids):
        original = prefill.mixer_core_prefill
        prefill.mixer_core_prefill = functools.partial(forward.mixer_core_prefill, forward_only=forward_only)
        try:
            return run(ids)
        finally:
            prefill.mixer_core_prefill = original

    return routed


def _runner(mode: str, models: dict, tile: int):
    """``run(ids) -> last logits`` for a mode, or a string saying why it cannot run here."""

    from ds_mamba_spcp.integrations.mamba_ssm.generation import chunked_prefill_mamba, sequence_parallel_prefill_mamba
    from ds_mamba_spcp.ops.kernels.upstream import mamba_module

    hf, mamba, gpu = models["hf"], models["mamba"], models["gpu"]
    if mode == "hf_forward":
        return lambda ids: hf(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
    if mode in ("mamba_ssm_forward", "mamba_ssm_prefill") and not gpu:
        return "mamba-ssm's own Mamba2 scan is Triton: GPU only"
    if mode == "mamba_ssm_forward":
        return lambda ids: mamba(ids, num_last_tokens=1).logits[:, -1]
    if mode == "mamba_ssm_prefill":

        def prefill(ids):
            params = mamba_module("utils.generation").InferenceParams(max_seqlen=ids.shape[1], max_batch_size=1)
            return mamba(ids, inference_params=params, num_last_tokens=1).logits[:, -1]

        return prefill
    if mode.startswith("ours_whole") or mode.startswith("ours_tiled"):
        config = {"mamba_sequence_parallel": {"tile_length": tile}} if mode.startswith("ours_tiled") else None
        run = lambda ids: sequence_parallel_prefill_mamba(mamba, ids, config=config).logits  # noqa: E731
        return _with_route(run, forward_only=not mode.endswith("training_route"))
    if mode == "ours_chunked":
        return lambda ids: chunked_prefill_mamba(mamba, ids, tile).logits
    raise ValueError(mode)


def measure(run, seqlen: int, vocab: int, device, repeats: int) -> tuple[dict, object]:
    """One warm-up and ``repeats`` timed runs of ``run`` on a random prompt; (record, last logits)."""
    import torch

    ids = torch.randint(0, vocab, (1, seqlen), generator=torch.Generator().manual_seed(seqlen)).to(device)
    cuda = device.type == "cuda"
    rec, logits = {}, None
    try:
        with torch.no_grad():
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            logits = run(ids)
            times = []
            for _ in range(repeats):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = run(ids)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        rec["status"] = "ok"
        rec["seconds"] = statistics.median(times)
        rec["tokens_per_s"] = seqlen / rec["seconds"]
        rec["s_per_1m_tokens"] = rec["seconds"] * 2**20 / seqlen
        if cuda:
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError as e:
        rec.update(status="oom", reason=str(e).splitlines()[0][:300])
    except RuntimeError as e:
        rec.update(status="error", reason=str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
    finally:
        del ids
        if cuda:
            torch.cuda.empty_cache()
    return rec, logits


def environment(args) -> dict:
    import torch

    header = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), host=platform.node(),
                  torch=torch.__version__, device=args.device, tile=args.tile, repeats=args.repeats,
                  deterministic=os.environ.get("MAMBA_DETERMINISTIC"))  # fmt: skip
    try:
        header["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                              text=True, timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        header["git_commit"] = None
    for dist in ("transformers", "mamba-ssm", "causal-conv1d", "triton"):
        try:
            import importlib.metadata as md

            header[dist] = md.version(dist)
        except Exception:  # noqa: BLE001 - a missing package is recorded as absent
            header[dist] = None
    if torch.cuda.is_available() and args.device == "cuda":
        header["gpu"] = torch.cuda.get_device_name(0)
    return header


def markdown(payload: dict) -> str:
    h = payload["header"]
    lines = [
        f"# Prefill ({h.get('gpu', h['device'])}, {h['date']}, commit {h.get('git_commit')}, tile {h['tile']})",
        "",
    ]
    lines += ["| preset | prompt | mode | status | tokens/s | s per 1M | peak GiB | vs hf_forward "
              "| vs mamba_ssm_forward | logits err | notes |", "|---" * 11 + "|"]  # fmt: skip
    recs = payload["records"]
    rate = {(r["preset"], r["seqlen"], r["mode"]): r.get("tokens_per_s") for r in recs if r["status"] == "ok"}
    for r in recs:
        ok = r["status"] == "ok"
        ratios = [rate.get((r["preset"], r["seqlen"], base)) for base in ("hf_forward", "mamba_ssm_forward")]
        ratios = [f"{r['tokens_per_s'] / b:.2f}x" if ok and b else "" for b in ratios]
        err = f"{r['logits_err']:.1e}" if r.get("logits_err") is not None else ""
        lines.append(
            f"| {r['preset']} | {r['seqlen']:,} | {r['mode']} | {r['status']} | "
            + (f"{r['tokens_per_s']:,.0f} | {r['s_per_1m_tokens']:.2f} | " if ok else " |  | ")
            + (f"{r['peak_mem_gib']:.1f}" if ok and "peak_mem_gib" in r else "")
            + f" | {ratios[0]} | {ratios[1]} | {err} | {r.get('reason', '')[:80]} |"
        )
    for preset in sorted({r["preset"] for r in recs}):
        chunked = [r["seqlen"] for r in recs if r["preset"] == preset and r["mode"] == "ours_chunked" and
                   r["status"] == "ok"]  # fmt: skip
        if chunked:
            lines += ["", f"Longest chunked prefill, {preset}: {max(chunked):,} tokens."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="mamba-130m", help=f"comma separated, of {sorted(PRESETS)}")
    p.add_argument("--lengths", default="131072,262144,524288", help="prompt lengths for every mode")
    p.add_argument("--chunked-lengths", default="", help="further lengths for ours_chunked only")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma separated, of {MODES + EXTRA_MODES}")
    p.add_argument("--tile", type=int, default=262144, help="ours_chunked's tile length")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--time-budget", type=float, default=540.0, help="start no new cell after this many seconds")
    p.add_argument("--out", required=True, help="JSON path; the Markdown table lands beside it")
    args = p.parse_args(argv)

    import torch

    if args.device == "cuda":
        # transformers binds mamba-ssm's Triton kernels to Mamba2 only when `import mamba_ssm` works; on a GPU
        # without mamba-ssm's CUDA extension this package's bare mamba_ssm makes it work (the baseline
        # is transformers' forward on mamba-ssm's kernels, not its PyTorch path)
        from ds_mamba_spcp.ops.kernels.upstream import expose_mamba_package

        expose_mamba_package()
    import transformers  # noqa: F401 - its Mamba2 module binds mamba-ssm's kernels or its PyTorch path first
    import transformers.models.mamba2.modeling_mamba2  # noqa: F401

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = [m for m in args.modes.split(",") if m]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    chunked = [int(x) for x in args.chunked_lengths.split(",") if x]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    payload = dict(schema=SCHEMA, header=environment(args), records=[], complete=False)
    # whether transformers' Mamba2 runs mamba-ssm's kernels (its fused path) or its PyTorch path
    payload["header"]["hf_mamba2_fast_path"] = _hf_binds_mamba_kernels()
    start = time.monotonic()
    for preset in [x for x in args.presets.split(",") if x]:
        spec = PRESETS[preset]
        models = {"hf": _hf_model(spec, device, dtype), "mamba": _mamba_model(spec, device, dtype),
                  "gpu": device.type == "cuda"}  # fmt: skip
        cells = [(L, m) for L in lengths for m in modes] + [(L, "ours_chunked") for L in chunked if "ours_chunked" in
                                                            modes]  # fmt: skip
        reference = {}
        for seqlen, mode in cells:
            if time.monotonic() - start > args.time_budget:
                print(f"time budget spent: {preset} {seqlen} {mode} not run", flush=True)
                continue
            run = _runner(mode, models, args.tile)
            rec = dict(preset=preset, seqlen=seqlen, mode=mode)
            if not mode.startswith("ours") and seqlen * _d_in_proj(spec) >= 2**31:
                # mamba-ssm's kernels index in_proj's output with int32 offsets: past them the call makes an
                # illegal memory access, which poisons the CUDA context for every later cell (780M at 524,288)
                run = f"in_proj's output ({seqlen} x {_d_in_proj(spec)}) is past mamba-ssm's int32 offsets"
            if isinstance(run, str):
                rec.update(status="skipped", reason=run)
            else:
                result, logits = measure(run, seqlen, spec["vocab"], device, args.repeats)
                rec.update(result)
                base = "mamba_ssm_prefill" if models["gpu"] else "ours_whole"
                if logits is not None and mode in ("mamba_ssm_prefill", "ours_whole"):
                    reference.setdefault((seqlen, mode), logits.float().cpu())
                ref = reference.get((seqlen, base))
                if logits is not None and ref is not None and mode.startswith("ours") and mode != base:
                    d = logits.float().cpu() - ref
                    rec["logits_err"] = float(d.norm() / ref.norm())
            payload["records"].append(rec)
            print(json.dumps(rec), flush=True)
            write_results(args.out, payload, markdown)
        del models
        if device.type == "cuda":
            torch.cuda.empty_cache()
    payload["complete"] = True
    write_results(args.out, payload, markdown)
    return payload


if __name__ == "__main__":
    main()
