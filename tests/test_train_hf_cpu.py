"""benchmarks/train_hf.py without a GPU (the real trials are the lead's H200 runs): the tiny Bamba preset trained by
the Trainer under DeepSpeed in one-process trials on gloo, both paths, at two lengths; the record's fields and what
holds the memory; a failing trial (an OOM injected at its first step) recorded with its log and ending the search;
records appended to an existing JSON; the search's lengths and its factor's bound."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from tests.dist_utils import REPO, free_port


def _train_hf():
    spec = importlib.util.spec_from_file_location("train_hf", os.path.join(REPO, "benchmarks", "train_hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_trials_on_cpu(tmp_path, monkeypatch):
    """Two driver runs into one JSON: both paths at 64 tokens (--compare-at) and the long-context path at 96, then
    the search on transformers' path from 96 with an OOM injected from 144: 96 trains, 144 fails, 224 never runs."""
    bench = _train_hf()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # reserved for this test process (tests/dist_utils.py)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or
                       os.path.join(REPO, ".cache", "torch_extensions"))  # fmt: skip
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
