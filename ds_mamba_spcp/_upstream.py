"""Imports of mamba-ssm submodules that work whether or not its CUDA extension was built.

``import mamba_ssm`` runs ``mamba_ssm/__init__.py``, which imports ``selective_scan_cuda`` and
fails on builds without the CUDA extension (CPU machines, the Triton-only wheels). Everything
this package needs (the Triton SSD pieces, ``Mamba2``) lives in submodules that do not need it.
``mamba_module(name)`` registers a bare package object for ``mamba_ssm`` (its ``__path__`` set
to the installed folder, ``__init__`` not executed) when the real import fails, then imports the
submodule normally.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def _ensure_mamba_package() -> None:
    if "mamba_ssm" in sys.modules:
        return
    try:
        importlib.import_module("mamba_ssm")
        return
    except ImportError:
        sys.modules.pop("mamba_ssm", None)
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mamba-ssm is not installed (pip install mamba-ssm==2.3.2.post1)")
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    pkg.__file__ = spec.origin
    sys.modules["mamba_ssm"] = pkg


def mamba_module(name: str):
    """``mamba_module("ops.triton.ssd_combined")`` -> that submodule of mamba_ssm."""
    _ensure_mamba_package()
    return importlib.import_module(f"mamba_ssm.{name}")


def mamba2_class():
    """mamba-ssm's ``Mamba2`` module class."""
    return mamba_module("modules.mamba2").Mamba2
