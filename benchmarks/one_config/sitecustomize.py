"""Every Triton autotuner in this process runs one config, its first (after the kernel's own pruning), untimed.

For correctness runs on a cold GPU machine only: fla's and mamba-ssm's kernels autotune over up to dozens of configs
each, compiled one by one, which costs a fresh machine minutes of its device time before a test computes anything.
A test's tolerances hold for any valid config (they bound bf16 rounding, not a config's summation order), so a test
needs one. Never for timings: benchmarks keep the tuned choice.

Switched on by ``DS_MAMBA_SPCP_ONE_CONFIG=1`` with this folder first on ``PYTHONPATH`` (spawned ranks inherit both):
``ONE_CONFIG=1 bash benchmarks/device_one_gpu.sh COMMIT tests`` (or ``delta``) sets them. Python imports the first
``sitecustomize`` it finds, so this one stands in for the interpreter's own (Debian's only hooks apport).
"""

import os

if os.environ.get("DS_MAMBA_SPCP_ONE_CONFIG") == "1":
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # no Triton: nothing to tune
        pass
    else:
        _prune = Autotuner.prune_configs

        def _first_config(self, kwargs, *args, **kw):
            # Autotuner.run skips the timing when one config is left, and caches it for the key
            return _prune(self, kwargs, *args, **kw)[:1]

        Autotuner.prune_configs = _first_config
