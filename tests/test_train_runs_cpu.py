"""benchmarks/train_runs.py without a GPU: the offload flags reach examples/train.py and the record, and a run
the host memory check refused is recorded as "refused" with the check's words, and a trial stopped at its time
limit leaves what it printed beside the record (the trial's process is faked: the real trials are the lead's GPU
runs)."""

from __future__ import annotations

import json
import subprocess

from tests.dist_utils import load_script


def _train_runs():
    return load_script("benchmarks", "train_runs.py")


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


def test_timeout_keeps_the_trials_output(tmp_path, monkeypatch):
    """subprocess hands a timed-out child's output over as bytes even with text=True; the log must keep it
    (a cold machine's first trial timed out with an empty log on the H200)."""
    runs = _train_runs()

    def fake_run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=b"step 1 loss 10.97\n", stderr=b"compiling\n")

    monkeypatch.setattr(runs.subprocess, "run", fake_run)
    out = tmp_path / "runs.json"
    runs.main(["--preset", "mamba-130m", "--lengths", "4096", "--trial-timeout", "5", "--out", str(out)])
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["status"] == "timeout"
    log = (tmp_path / "runs_4096.log").read_text()
    assert "step 1 loss 10.97" in log and "compiling" in log, log
