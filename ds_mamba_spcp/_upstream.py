"""Imports of mamba-ssm submodules that work whether or not its CUDA extension was built.

``import mamba_ssm`` runs ``mamba_ssm/__init__.py``, which imports ``selective_scan_cuda`` and
fails on builds without the CUDA extension (CPU machines, the Triton-only wheels). Everything
this package needs (the Triton SSD pieces, ``Mamba2``) lives in submodules that do not need it.
``mamba_module(name)`` registers a bare package object for ``mamba_ssm`` (its ``__path__`` set
to the installed folder, ``__init__`` not executed) when the real import fails, then imports the
submodule normally. When the real import works, nothing is bypassed.

The Triton backend calls private functions of mamba-ssm and causal-conv1d (``_chunk_state_fwd``,
``causal_conv1d_bwd_function``, ...), whose signatures and semantics change between releases
without notice: ``check_pinned_versions`` refuses versions other than the ones it was written and
tested against (``PINNED``), so that a different release fails loudly instead of computing wrong
gradients.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings

# distribution name -> the version whose private functions ops/triton.py calls
PINNED = {"mamba-ssm": "2.3.2.post1", "causal-conv1d": "1.7.0"}
# set to 1 to run with other versions anyway (a warning instead of an ImportError)
UNPINNED_ENV = "DS_MAMBA_SPCP_ALLOW_UNPINNED"


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


def check_pinned_versions() -> None:
    """Raises ImportError unless mamba-ssm and causal-conv1d are exactly the ``PINNED`` versions."""
    found = {}
    for dist in PINNED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"{dist} is not installed; the Triton backend needs {dist}=={PINNED[dist]}") from None
    bad = {d: v for d, v in found.items() if v != PINNED[d]}
    if not bad:
        return
    msg = (
        "the Triton backend calls private functions of "
        + ", ".join(f"{d}=={PINNED[d]}" for d in PINNED)
        + " and was tested only against those releases; installed: "
        + ", ".join(f"{d} {v}" for d, v in bad.items())
        + f". Install the pinned versions, or set {UNPINNED_ENV}=1 to try these ones at your own risk "
        "(run the GPU test suite first)."
    )
    if os.environ.get(UNPINNED_ENV) == "1":
        warnings.warn(msg, stacklevel=2)
        return
    raise ImportError(msg)


def causal_conv1d_functions():
    """causal-conv1d's ``(causal_conv1d_fwd_function, causal_conv1d_bwd_function)``; ImportError
    when its CUDA extension is missing."""
    from causal_conv1d.cpp_functions import causal_conv1d_bwd_function, causal_conv1d_fwd_function

    return causal_conv1d_fwd_function, causal_conv1d_bwd_function
