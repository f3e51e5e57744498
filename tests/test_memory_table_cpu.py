"""benchmarks/memory_table.py's CPU path (the GPU run is the lead's): the JSON and Markdown, and the measured
numbers where they are known exactly from the shapes (fp32, tiny preset, lengths 64 and 128)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

SCRIPT = os.path.join(REPO, "benchmarks", "memory_table.py")


@pytest.mark.slow  # a benchmark's CPU smoke, make test-slow (CI's two cores go to the package's own tests)
def test_memory_table_cpu_path(tmp_path):
    out = tmp_path / "memory_cpu.json"
    # its own process: it initialises torch.distributed (one rank, for DeepSpeed), which must not leak into pytest's
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["schema"] == "ds_mamba_spcp.memory_table/1"
    recs = payload["records"]
    assert [(r["preset"], r["seqlen"]) for r in recs] == [("tiny", 64), ("tiny", 128)]
    for r in recs:
        each = r["seqlen"] * r["d_model"] * 4  # fp32 block inputs
        assert r["checkpoint_bytes_each"] == each and r["checkpoints"] == r["n_layers"] * each
        # budget 0: every checkpoint but the newest went to the pool, and the second step reused it
        off = r["step_offloaded"]
        assert off["checkpoints_saved"] == r["n_layers"] and off["checkpoints_offloaded"] == r["n_layers"] - 1
        assert off["pool_bytes"] == r["step_offloaded_again"]["pool_bytes"] == (r["n_layers"] - 1) * each
        assert r["step_gpu_checkpoints"]["pool_bytes"] == 0
        # the saved-tensor hooks: in_proj saves exactly its input (the normed block input), each byte counted once
        saved = r["one_block"]["saved"]
        assert saved["in_proj"] == each and sum(saved.values()) == r["one_block"]["saved_total"]
        assert saved["op"] > 0 and saved["other"] == 0
    text = (tmp_path / "memory_cpu.md").read_text()
    assert "## tiny (d_model 32 x 3 layers, torch.float32)" in text
    assert "| one block: saved by in_proj (its input) | 0.00 | 0.00 | 0.1 |" in text  # 32 x 4 bytes per token
