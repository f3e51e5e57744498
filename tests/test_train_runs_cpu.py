"""benchmarks/train_runs.py without a GPU: the offload flags reach examples/train.py and the record, and a run
the host memory check refused is recorded as "refused" with the check's words (the trial's process is faked:
the real trials are the lead's GPU runs)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

from tests.dist_utils import REPO


def _train_runs():
    spec = importlib.util.spec_from_file_location("train_runs", os.path.join(REPO, "benchmarks", "train_runs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offload_flags_and_refusal_are_recorded(tmp_path, monkeypatch):
    runs = _train_runs()
    seen = {}
    refusal = "ds_mamba_spcp.memory.offload.HostMemoryError: offloading the block checkpoints needs 149.0 GiB"

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=f"Traceback\n{refusal}\n")

    monkeypatch.setattr(runs.subprocess, "run", fake_run)
    out = tmp_path / "runs.json"
    runs.main(["--preset", "mamba-780m", "--lengths", "1048576", "--offload", "--offload-gpu-budget-gib", "33",
               "--out", str(out)])  # fmt: skip
    cmd = seen["cmd"]
    for flag, value in (("--offload-impl", "pool"), ("--offload-gpu-budget-gib", "33.0"),
                        ("--offload-host-headroom-gib", "8.0")):  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value, cmd
    assert "--offload-activations" in cmd

    (rec,) = json.loads(out.read_text())["records"]
    assert rec["status"] == "refused" and rec["reason"] == refusal
    assert rec["offload_impl"] == "pool" and rec["offload_gpu_budget_gib"] == 33.0
    assert "| refused |" in (tmp_path / "runs.md").read_text()
