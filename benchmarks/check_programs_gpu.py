"""A quick GPU check of ops/programs.py (the short form of tests/test_gpu_launch.py's programs runs), one case.

    MAMBA_DETERMINISTIC=1 python3 -u benchmarks/check_programs_gpu.py [case]

tests/test_gpu_launch.py's case (default rms_packed: the gated RMSNorm on packed rows, 8192 tokens in 2 tiles,
bf16): Triton's own launch path twice (which results reproduce bitwise), then, through the launch layer, one run
with programs in check mode (each call run, recorded again and compared with its key's program) and three
replayed. Prints, per run, the results that differ bitwise from Triton's path among those that reproduce, and the
relative RMS distance of the others (the conv's fp32-atomic gradients always among them), then the programs'
counts. Exit 1 if a reproducible result differs or another is more than one bf16 step away. For a GPU session
with too little time left for tests/test_gpu_launch.py, which is the test.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ds_mamba_spcp.ops import launch, programs  # noqa: E402
from tests.gpu_cases import rel  # noqa: E402
from tests.test_gpu_launch import ATOMIC, EPS_BF16, _run  # noqa: E402


def main():
    case = sys.argv[1] if len(sys.argv) > 1 else "rms_packed"
    os.environ[launch.ENV] = "0"
    first, second = _run(case), _run(case)
    exact = [k for k in first if k not in ATOMIC and torch.equal(first[k], second[k])]
    print(f"{case}: Triton's path reproduces bitwise: {exact}", flush=True)
    os.environ[launch.ENV] = "1"
    runs = []
    for mode in ("check", "1", "1", "1"):
        os.environ[programs.ENV] = mode
        runs.append((mode, _run(case)))
    bad = False
    for i, (mode, got) in enumerate(runs):
        differ = [k for k in exact if not torch.equal(got[k], first[k])]
        far = {k: rel(got[k].float(), first[k].float()) for k in first if k not in exact}
        bad |= bool(differ) or any(v > EPS_BF16 for v in far.values())
        print(f"run {i} (programs {mode}): bitwise different {differ}; distance of the others {far}", flush=True)
    print(f"programs: {dict(programs.COUNTS)}", flush=True)
    print("FAILED" if bad else "PASSED", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
