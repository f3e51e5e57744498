"""The glue's host work per segment, counted on CPU: Triton launches and torch ops (issue 23).

``benchmarks/probes/count_launches.py`` runs one fwd+bwd of ``mamba_split_conv1d_scan_sp`` (a group of one, the
Triton backend under Triton's interpreter, 64 tokens in 2 tiles of 32) in a fresh process and counts every
Triton launch (mamba-ssm's kernels and ours, and the conv) and every torch op that is not a view. The counts
do not depend on timing or on the machine, only on the code and the pinned mamba-ssm/Triton versions, so
the bounds are the counts measured after the issue-23 changes, exactly (a regression by one op fails).
Before them (main 616f0d0), per segment: forward 30.0 torch ops and 27.0 device kernels (Triton, conv and
kernel-launching torch ops), backward 79.0 and 75.0; after round 1 (5e136a0) 13.5 and 10.5, 57.0 and 55.0; then
13.5 and 10.5, 55.0 and 53.0 (the tiles' decays computed once, in the forward; the halo laid out once per
backward; the halo gradient added into dzxbcdt without a copy back); now, a group of one in known mode
(ops/segment.py: no summary fold, no chain of summaries), 9.0 and 7.0, 53.5 and 52.0; now, its dS_in
from the state passing's backward (no fold in the backward either), 9.0 and 7.0, 52.5 and 51.0. What remains is
listed in docs/host_time.md (most of the backward's are mamba-ssm's own wrappers: deterministic-mode
workspaces, zero-fills and their sums).
~8 s (the interpreter runs every kernel in numpy).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

# per segment, measured (see the module docstring)
BOUNDS = {
    "forward": dict(torch_ops_per_segment=9.0, device_kernels_per_segment=7.0, launches_per_segment=6.0),
    "backward": dict(torch_ops_per_segment=52.5, device_kernels_per_segment=51.0, launches_per_segment=18.0),
}
# the scan of a lone segment and the summary folds' small ops are gone from the forward
NOT_IN_FORWARD = ("cat", "flip", "sum", "arange", "where", "index", "cumsum", "mul", "copy_")


@pytest.mark.slow  # the launch counts' probe under Triton's interpreter (~30 s), make test-slow
def test_launches_and_torch_ops_per_segment(tmp_path):
    out = tmp_path / "counts.json"
    cmd = [sys.executable, "benchmarks/probes/count_launches.py", "--seqlen", "64", "--tile-length", "32"]
    cmd += ["--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["segments"] == 2
    over = {
        (d, k): (got[d][k], bound) for d, bounds in BOUNDS.items() for k, bound in bounds.items() if got[d][k] > bound
    }
    assert not over, f"more host work per segment than the bound (got, bound): {over}\n{proc.stdout}"
    fwd, bwd = got["forward"], got["backward"]
    assert not [op for op in NOT_IN_FORWARD if op in fwd["by_op"]], fwd["by_op"]
    # known mode: no fold in either direction (S_out is the state passing's final state, dS_in its backward's
    # initial-state gradient, stored in fp32), one launch for the ddA tail
    assert "_fold_chunks_kernel" not in fwd["by_kernel"] and "_fold_chunks_kernel" not in bwd["by_kernel"]
    assert bwd["by_kernel"]["_ddA_tail_kernel"] == 2
    # no decays exp(log_a) in either direction, no chain of summaries (addcmul)
    assert not [op for op in ("exp", "addcmul") if op in fwd["by_op"] or op in bwd["by_op"]], (fwd, bwd)
