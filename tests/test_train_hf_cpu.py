"""benchmarks/train_hf.py without a GPU (the real trials are the lead's H200 runs): the tiny Bamba preset trained by
the Trainer under DeepSpeed in one-process trials on gloo, both paths, at two lengths; the record's fields and what
holds the memory; a failing trial (an OOM injected at its first step) recorded with its log and ending the search;
records appended to an existing JSON; the search's lengths and its factor's bound. At --sp 2 (two gloo ranks
sharing each row): both paths, every rank's values in the record and the losses of the one-process run; a failure
on one rank, a trial past its timeout, the refusals and the peak check's ratios."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time

import pytest

from tests.dist_utils import REPO, free_port, load_script


def _train_hf():
    return load_script("benchmarks", "train_hf.py")


def _train_hf_in_process(monkeypatch):
    """train_hf.py's module, for a run in this test process: MASTER_PORT reserved for it (tests/dist_utils.py), the
    DeepSpeed extensions' build directory the suite's."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or
                       os.path.join(REPO, ".cache", "torch_extensions"))  # fmt: skip
    return _train_hf()


def test_search_lengths_and_factor_bound(tmp_path, capsys):
    bench = _train_hf()
    # the device search: 131072 x 1.5^k to 1.6M in multiples of 16384 (663552 -> 671744, 995328 -> 999424, ...)
    assert bench.search_lengths(131072, 1.5, 1_600_000, 16384) == [
        131072, 196608, 294912, 442368, 671744, 999424, 1490944,
    ]  # fmt: skip
    assert bench.search_lengths(100, 1.01, 130, 16) == [96, 112, 128]  # rounding never repeats a length
    with pytest.raises(SystemExit):
        bench.parse_args(["--search", "131072", "--factor", "1.6", "--max", "2000000", "--out", str(tmp_path / "x")])
    assert "--factor must be in (1, 1.5]" in capsys.readouterr().err
    assert bench.parameter_count("hf-bamba-2b") == 1_929_109_696  # ~1.93B, the preset
    assert bench.parameter_count("hf-qwen35-2b") == 1_995_595_584  # ~2.00B, issue 44's Qwen3.5-style preset
    layers = bench.preset_config("hf-qwen35-2b").layer_types  # Qwen3.5's ratio: 3 Gated DeltaNet layers to 1 attention
    assert layers == ["linear_attention"] * 3 + ["full_attention"] + layers[:-4] and len(layers) == 24, layers


@pytest.mark.slow  # a benchmark's CPU smoke, make test-slow (CI's two cores go to the package's own tests)
def test_trials_on_cpu(tmp_path, monkeypatch):
    """Two driver runs into one JSON: both paths at 64 tokens (--compare-at) and the long-context path at 96, then
    the search on transformers' path from 96 with an OOM injected from 144: 96 trains, 144 fails, 224 never runs."""
    bench = _train_hf_in_process(monkeypatch)
    out = tmp_path / "hf.json"
    common = ["--preset", "hf-bamba-tiny", "--out", str(out), "--git-commit", "abc1234"]
    bench.main([*common, "--compare-at", "64", "--lengths", "96", "--long-context", "--tile-tokens", "32"])
    bench.main([*common, "--search", "96", "--factor", "1.5", "--round", "16", "--max", "400",
                "--fail-from-length", "144"])  # fmt: skip
    payload = json.loads(out.read_text())
    assert payload["schema"] == bench.SCHEMA
    got = [(r["path"], r["length"], r["status"]) for r in payload["records"]]
    assert got == [
        ("transformers", 64, "ok"), ("long_context", 64, "ok"), ("long_context", 96, "ok"),
        ("transformers", 96, "ok"), ("transformers", 144, "oom"),
    ], got  # fmt: skip
    assert "--fail-from-length 144" in payload["header"]["command"]
    assert "--compare-at 64" in payload["header"]["earlier_commands"][0]

    n = bench.parameter_count("hf-bamba-tiny")
    assert payload["parameters"] == {"hf-bamba-tiny": n}
    for r in payload["records"][:4]:
        assert r["model"] == "hf-bamba-tiny" and r["parameters"] == n and r["git_commit"] == "abc1234", r
        assert len(r["step_s"]) == 2 and r["last_step_s"] == r["step_s"][-1] > 0
        assert r["tokens_per_s"] == pytest.approx(r["length"] / r["last_step_s"])
        # transformers' init (std 0.02) gives near-uniform logits: the loss of random ids is ln(vocab) within ~0.05
        assert len(r["losses"]) == 2 and all(abs(x - math.log(256)) < 0.1 for x in r["losses"]), r["losses"]
        assert r["gpu_peak_allocated"] is None and r["host_peak_rss"] > 0 and r["exit_status"] == 0
        # fp32 on one rank: DeepSpeed's flat buffer holds exactly the parameters (n is even: no alignment padding),
        # the fp32 master partition a copy, AdamW two moments of it; every storage counted once
        holds = r["holds"]
        assert holds["parameters"] == holds["optimizer_master"] == 4 * n, holds
        assert holds["optimizer_moments"] == 8 * n and holds["optimizer_states"] == 12 * n, holds
        assert holds["transient_peak"] is None  # no GPU peak to take from
        section = r["ds_config"]["mamba_sequence_parallel"]
        assert r["ds_config"]["zero_optimization"] == {"stage": 2}
        if r["path"] == "long_context":
            assert section["long_context"] == {"tile_tokens": 32} and r["long_context"] == {"tile_tokens": 32}
            # long_context.memory_report: recorded when the module has it, else None with the reason
            assert isinstance(r["memory_report"], dict) or (r["memory_report"] is None and r["memory_report_missing"])
        else:
            assert "long_context" not in section and "memory_report" not in r

    failed = payload["records"][4]
    assert "OutOfMemoryError" in failed["reason"] and "injected" in failed["reason"], failed
    assert failed["step_s"] == [] and failed["exit_status"] == 1
    assert "injected" in (tmp_path / "hf_transformers_144.log").read_text()

    (cmp,) = payload["comparisons"]
    hf, lc = payload["records"][:2]
    assert cmp["length"] == 64 and cmp["ratio"] == pytest.approx(lc["last_step_s"] / hf["last_step_s"])
    text = (tmp_path / "hf.md").read_text()
    assert "| hf-bamba-tiny | transformers | 144 | oom |" in text
    assert "| hf-bamba-tiny | long_context (tiles 32) | 96 | ok |" in text
    assert f"ratio {cmp['ratio']:.3f}" in text
    assert "Longest that trained, hf-bamba-tiny transformers: 96 tokens" in text


@pytest.mark.slow  # one more Trainer trial (~15-50 s on 2 shared cores: the delta layers' PyTorch op)
def test_qwen35_preset_trains_on_cpu(tmp_path, monkeypatch):
    """The Qwen3.5-style preset's tiny twin (hf-qwen35-tiny) on the long-context path, 2 steps of 96 tokens in tiles
    of 32: it trains (finite losses), no layer tiled, its 4 decoder layers checkpointed whole, the 4 MLPs in tiles,
    the fused loss; transformers' kernel read from the Qwen3.5 modeling module."""
    bench = _train_hf_in_process(monkeypatch)
    out = tmp_path / "qwen.json"
    bench.main(["--preset", "hf-qwen35-tiny", "--out", str(out), "--long-context", "--lengths", "96", "--tile-tokens",
                "32", "--steps", "2"])  # fmt: skip
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["status"] == "ok" and rec["model"] == "hf-qwen35-tiny", rec.get("reason")
    assert len(rec["losses"]) == 2 and all(math.isfinite(x) for x in rec["losses"]), rec["losses"]
    report = rec["memory_report"]
    assert (report["layers_tiled"], report["layers_checkpointed"], report["mlps_tiled"]) == (0, 4, 4), report
    assert report["fused_loss"] and rec["loss_by"] == "fused_loss", (report, rec["loss_by"])
    assert rec["hf_mixer_kernel"] is not None, rec["hf_mixer_kernel"]


@pytest.mark.slow  # the benchmark's multi-rank driver (make test-slow): the Trainer with the key at sp 2 against one
# process is tests/test_long_context.py's and tests/test_accelerate.py's in make test
def test_sp_trials_on_cpu(tmp_path, monkeypatch):
    """--sp 2 on gloo: both paths at 64 tokens (32 on each rank), then --peak-check 64: one process at 64 (the loss
    reference: the same row and seed) and two ranks at 128 with an OOM injected on rank 1; every rank's values in
    the record, the status from the rank that failed first."""
    bench = _train_hf_in_process(monkeypatch)
    out = tmp_path / "hf.json"
    bench.main(["--preset", "hf-bamba-tiny", "--out", str(out), "--sp", "2", "--compare-at", "64", "--long-context",
                "--tile-tokens", "16", "--peak-check", "64", "--fail-from-length", "128"])  # fmt: skip
    payload = json.loads(out.read_text())
    got = [(r["path"], r["length"], r["sp"], r["status"]) for r in payload["records"]]
    assert got == [
        ("transformers", 64, 2, "ok"), ("long_context", 64, 2, "ok"), ("long_context", 64, 1, "ok"),
        ("long_context", 128, 2, "oom"),
    ], got  # fmt: skip
    n = bench.parameter_count("hf-bamba-tiny")
    hf, lc, ref, failed = payload["records"]
    # at sp > 1 the key at its defaults: the two Mamba2 layers tiled on each rank's shard, the attention layer's
    # MLP through TiledMLP; the one-process reference of the peak check the same key
    for r in (lc, ref):
        assert r["long_context"] == {"tile_tokens": 16}, r["long_context"]
        assert r["memory_report"]["installed"] and r["memory_report"]["layers_tiled"] == 2, r["memory_report"]
        assert r["memory_report"]["mlps_tiled"] == 1, r["memory_report"]
    for r in (hf, lc):
        per = r["per_rank"]
        assert set(per) == set(bench.RANK_FIELDS) and all(len(v) == 2 for v in per.values()), per
        assert per["status"] == ["ok", "ok"] and per["exit_status"] == [0, 0] and per["device"] == ["cpu", "cpu"]
        assert per["tokens"] == [32, 32], per["tokens"]  # each rank's model was given its half of the row
        assert r["backend"] == "gloo" and not r["shared_gpu"]
        for rank in range(2):
            assert len(per["step_s"][rank]) == 2 and per["last_step_s"][rank] == per["step_s"][rank][-1] > 0, per
            assert per["host_peak_rss"][rank] > 0 and per["gpu_peak_allocated"][rank] is None, per
            # ZeRO-2 partitions the fp32 master weights and AdamW's moments over the two ranks (n is even, so
            # without padding): half of the one process's 4n and 8n each
            holds = per["holds"][rank]
            assert holds["optimizer_master"] == 2 * n and holds["optimizer_moments"] == 4 * n, holds
        # the table's values are rank 0's
        assert r["step_s"] == per["step_s"][0] and r["host_peak_rss"] == per["host_peak_rss"][0]
        assert r["tokens_per_s"] == pytest.approx(64 / r["last_step_s"])
        # The Trainer's sequence-parallel loss is the group's token mean (the same value on both ranks) of the row
        # one process trains on, so it is the one-process loss up to the order of fp32 sums (seen equal here);
        # 1e-4 relative, while a rank's own mean is off by 5e-3 (5.630 and 5.557 against 5.599) and the second
        # half run without the first (a lost state) by 1.6e-2. Step 2 follows one AdamW step at lr 1e-5 from the
        # same gradient, reduced in another order: the same bound.
        assert per["losses"][0] == per["losses"][1], per["losses"]
        assert len(ref["losses"]) == 2 and all(abs(x - math.log(256)) < 0.1 for x in ref["losses"]), ref["losses"]
        for step in range(2):
            err = abs(per["losses"][0][step] - ref["losses"][step]) / ref["losses"][step]
            assert err <= 1e-4, (r["path"], step, per["losses"], ref["losses"])
    assert ref["sp"] == 1 and ref["per_rank"]["tokens"] == [64] and ref["tokens"] == 64

    # rank 1 raised; rank 0 then lost its peer inside a collective: the record takes rank 1's status and reason
    per = failed["per_rank"]
    assert per["status"] == ["error", "oom"] and per["exit_status"] == [1, 1], per
    assert failed["reason"].startswith("rank 1 of 2: ") and "injected" in failed["reason"], failed["reason"]
    log = (tmp_path / "hf_long_context_128_sp2.log").read_text()
    assert "===== rank 0 =====" in log and "===== rank 1 =====" in log and "injected" in log
    (check,) = payload["peak_checks"]
    assert check["sp"] == 2 and check["sp_length"] == 128 and check["ratios"] is None, check
    assert check["note"] == "one process ok, 2 ranks oom: no ratio", check

    text = (tmp_path / "hf.md").read_text()
    assert "| hf-bamba-tiny | transformers (sp 2) | 64 | ok |" in text
    assert "| hf-bamba-tiny | long_context (tiles 16, sp 2) | 64 | ok |" in text
    assert "| hf-bamba-tiny | long_context (tiles 16, sp 2) | 128 | oom |" in text


def test_sp_refusals_timeout_and_peak_ratios(tmp_path, monkeypatch, capsys):
    """Lengths that do not divide by --sp are refused before any trial (the key's parts, tiled layers too, are kept);
    a two-rank trial past --trial-timeout is killed whole (both ranks' records say so); the peak check's ratios."""
    bench = _train_hf()
    common = ["--preset", "hf-bamba-tiny", "--out", str(tmp_path / "x.json"), "--sp", "2"]
    for extra, message in [
        (["--lengths", "64,97"], "--lengths 97: each of the --sp 2 ranks"),
        (["--search", "64", "--max", "200", "--round", "15"], "--round 15: each of the --sp 2 ranks"),
    ]:
        with pytest.raises(SystemExit):
            bench.parse_args(common + extra)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "hf-bamba-tiny", "--out", "x", "--peak-check", "64"])
    assert "give --sp 2 or more" in capsys.readouterr().err
    args = bench.parse_args(common + ["--lengths", "64", "--long-context"])
    assert args.parts_off == "" and bench.long_context_key(args) == {}

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    payload = bench.main(common + ["--lengths", "64", "--trial-timeout", "2"])
    (r,) = payload["records"]
    assert r["status"] == "timeout" and r["per_rank"]["status"] == ["timeout", "timeout"], r
    assert r["per_rank"]["exit_status"] == [-9, -9] and "killed at --trial-timeout 2 s" in r["reason"], r

    # a rank that failed while its peer waits (in a collective that never completes, say): the peer is given
    # RANK_GRACE_S, then ended; its record says why
    monkeypatch.setattr(bench, "RANK_GRACE_S", 0.5)
    procs = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["false"])]
    try:
        assert bench._wait_ranks(procs, time.monotonic() + 30) == "abandoned"
    finally:
        procs[0].kill()
    args = bench.parse_args(common + ["--lengths", "64"])
    rec = bench._rank_record(args, "transformers", 64, str(tmp_path / "none.json"), "", -9, "abandoned")
    assert rec["status"] == "error" and rec["abandoned"] and rec["reason"].startswith("killed 0.5 s after another")

    gib = 2**30
    one = dict(path="long_context", length=64, status="ok", gpu_peak_allocated=100 * gib, holds={"transient_peak": 50})
    holds = [{"transient_peak": 52}, {"transient_peak": 60}]
    peaks = [105 * gib, 112 * gib]
    group = dict(sp=2, length=128, status="ok", per_rank={"gpu_peak_allocated": peaks, "holds": holds})
    check = bench.peak_check(one, group)
    assert check["ratios"] == [1.05, 1.12] and check["max_ratio"] == 1.12 and check["within_bound"] is False, check
    assert check["transient_ratios"] == [1.04, 1.2], check
    group["per_rank"]["gpu_peak_allocated"] = [105 * gib, 110 * gib]
    check = bench.peak_check(one, group)
    assert check["within_bound"] is True
    text = bench.markdown(dict(header=dict(date="d", command="c", git_commit="abc"), records=[], peak_checks=[check]))
    want = "at 128: GPU peak 100.0 GiB against 105.0, 110.0 GiB by rank: ratios 1.050, 1.100, within 1.1x."
    assert want in text, text


def test_sft_trial_and_run_options(tmp_path, monkeypatch, capsys):
    """--trainer sft: TRL's SFTTrainer with the key (its fused loss on: TRL's fused head crashed under it), packed
    rows, gradient accumulation 2, one tiny trial; the record states the run (trainer, accumulation, padding,
    steps) and TRL's metrics. --padded: each batch pairs a row of L and one of 3L/4 right-padded to L."""
    bench = _train_hf_in_process(monkeypatch)
    out = tmp_path / "sft.json"
    bench.main(["--preset", "hf-bamba-tiny", "--out", str(out), "--trainer", "sft", "--grad-accum", "2",
                "--long-context", "--tile-tokens", "32", "--lengths", "64"])  # fmt: skip
    (r,) = json.loads(out.read_text())["records"]
    assert r["status"] == "ok", r.get("reason")
    assert (r["trainer"], r["grad_accum"], r["padded"], r["packed"], r["docs_per_row"]) == ("sft", 2, False, True, 1)
    assert r["loss_by"] == "trl_fused_head" and r["memory_report"]["fused_loss"], r
    assert r["tokens"] == 64 and r["tokens_per_step"] == 128  # two micro-batches of one packed row of 64
    assert r["tokens_per_s"] == pytest.approx(128 / r["last_step_s"])
    assert len(r["losses"]) == 2 and all(abs(x - math.log(256)) < 0.1 for x in r["losses"]), r["losses"]
    assert len(r["entropy"]) == 2 and all(abs(x - math.log(256)) < 0.1 for x in r["entropy"]), r["entropy"]
    assert len(r["mean_token_accuracy"]) == 2
    text = (tmp_path / "sft.md").read_text()
    assert "| TRL SFTTrainer, GA 2, packed, 1 document a row, 2 steps |" in text, text
    assert "[TRL SFTTrainer, GA 2, packed, 1 document a row]: 64 tokens at 2 steps" in text, text

    args = bench.parse_args(["--out", "x", "--lengths", "64", "--padded", "--grad-accum", "2", "--sp", "2"])
    assert bench.row_lengths(args, 64) == [64, 48, 64, 48]
    import torch

    batch = bench.right_padded([{"input_ids": torch.tensor(ids)} for ids in (list(range(3, 9)), [5, 6, 7, 8])])
    assert batch["input_ids"].tolist() == [[3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 0, 0]]
    assert batch["labels"].tolist() == [[3, 4, 5, 6, 7, 8], [5, 6, 7, 8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1] * 4 + [0] * 2]
    assert "attention_mask" not in bench.right_padded([{"input_ids": torch.tensor([1, 2])}] * 2)
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--lengths", "64", "--docs-per-row", "2"])
    assert "--docs-per-row is for packed rows" in capsys.readouterr().err
