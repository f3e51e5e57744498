"""How often a call parses the settings (issue 43 item 4): calls of ``config.load_mamba_sp_config`` with a ds_config
(a typed config handed back as it is reads nothing) and of ``config.ds_config_dict`` (every read of a raw ds_config
goes through it), wherever a module of the package holds them by name, and of accelerate.py's ``_ds_config`` (the
ds_config of accelerate's DeepSpeed plugin). ``with parses() as n:`` counts inside the block, ``n ==
{"load_mamba_sp_config": .., "ds_config_dict": .., "accelerate_ds_config": ..}``."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def parses():
    from ds_mamba_spcp import config

    counts = {"load_mamba_sp_config": 0, "ds_config_dict": 0, "accelerate_ds_config": 0}
    originals = {name: getattr(config, name) for name in ("load_mamba_sp_config", "ds_config_dict")}

    def counting(name):
        original = originals[name]

        def fn(cfg, *args, **kwargs):
            if not isinstance(cfg, config.MambaSequenceParallelConfig):
                counts[name] += 1
            return original(cfg, *args, **kwargs)

        return fn

    patched = []
    for module in [m for k, m in sys.modules.items() if k.startswith("ds_mamba_spcp") and m is not None]:
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                patched.append((module, name, original))
                setattr(module, name, counting(name))
    accelerate = sys.modules.get("ds_mamba_spcp.integrations.transformers.accelerate")
    if accelerate is not None:
        plugin_config = accelerate._ds_config

        def read_plugin():
            counts["accelerate_ds_config"] += 1
            return plugin_config()

        patched.append((accelerate, "_ds_config", plugin_config))
        accelerate._ds_config = read_plugin
    try:
        yield counts
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
