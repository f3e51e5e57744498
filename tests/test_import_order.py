"""transformers model classes work whether they are first touched before or after this package loads mamba-ssm.

transformers binds a Mamba2-style model class to mamba-ssm's kernels when ``import mamba_ssm`` succeeds at the
time its modeling module is imported. Where mamba-ssm's CUDA extension is not built (this CPU venv; the
Triton-only GPU wheels) that import fails and transformers takes its PyTorch path; a bare ``mamba_ssm`` left
in ``sys.modules`` by this package made it succeed instead, and a model class first touched after a wrap
failed inside transformers' forward (``TypeError`` from a CUDA-only kernel). Each order runs in a fresh
subprocess (import order is per process): wrap a ``Mamba2ForCausalLM`` (which loads mamba-ssm's Triton
modules) and run it, then build a ``BambaForCausalLM`` and run it; or import every modeling module first.
Both orders must run, leave no ``mamba_ssm`` package in ``sys.modules``, and give bitwise the same logits
(the same PyTorch path on the same seed and inputs: nothing reorders).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

SCRIPT = r"""
import json, sys
import torch
from tests import hf_models
if sys.argv[1] == "models_first":
    hf_models.import_models()
from ds_mamba_spcp import wrap_mamba2_mixers
config = {"train_micro_batch_size_per_gpu": 1,
          "mamba_sequence_parallel": {"enabled": True, "sequence_parallel_size": 1, "backend": "reference"}}
ids = torch.randint(0, hf_models.VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
mamba2 = hf_models.build("mamba2", attention=False)
wrapped = wrap_mamba2_mixers(mamba2, None, config)
from ds_mamba_spcp.ops.kernels import upstream as _upstream
loaded = getattr(_upstream, "mamba_modules_loaded", lambda p: [k for k in sys.modules if k.startswith(p)])
bamba = hf_models.build("bamba")
with torch.no_grad():
    out = {"wrapped": wrapped, "mamba2": mamba2(input_ids=ids).logits.flatten().tolist(),
           "bamba": bamba(input_ids=ids).logits.flatten().tolist(),
           "triton_modules": len(loaded("mamba_ssm.ops.triton.ssd")),
           "package_in_sys_modules": "mamba_ssm" in sys.modules}
print("RESULT " + json.dumps(out))
"""


def _run(order: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, order], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{order}: the script failed:\n{proc.stderr[-4000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def results():
    return {order: _run(order) for order in ("wrap_first", "models_first")}


def test_both_import_orders_run_and_agree(results):
    for order, res in results.items():
        assert res["wrapped"] == 2, f"{order}: expected both Mamba2 mixers wrapped"
        assert res["triton_modules"] > 0, f"{order}: mamba-ssm's Triton modules were not loaded: a weak test"
        assert not res["package_in_sys_modules"], f"{order}: a bare mamba_ssm was left in sys.modules"
    a, b = results["wrap_first"], results["models_first"]
    assert a["mamba2"] == b["mamba2"], "the wrapped Mamba2 model's logits depend on the import order"
    assert a["bamba"] == b["bamba"], "Bamba's logits depend on the import order"
