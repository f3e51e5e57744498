"""Imports of mamba-ssm submodules that work whether or not its CUDA extension was built.

``import mamba_ssm`` imports ``selective_scan_cuda`` and fails on builds without the CUDA extension (CPU
machines, the Triton-only wheels); what this package needs lives in submodules that do not need it.
``mamba_module(name)`` then imports the submodule under a bare package object (its ``__path__`` the installed
folder, ``__init__`` not run); when the real import works, nothing is bypassed.

The bare package is in ``sys.modules`` only during an import (the same module objects each time): libraries
probe ``import mamba_ssm`` (transformers binds its kernels when that succeeds), and a half-imported package
would make them bind CUDA-only kernels. ``expose_mamba_package()`` leaves it there for good.

``MambaLMHeadModel``'s imports reach Mamba-1's ``import selective_scan_cuda``; where no real extension exists
it finds a placeholder during the import only, whose every function raises a RuntimeError naming the missing
build (docs/huggingface.md, "The op's forward-only path, packed prompts, mamba-ssm's model").

The Triton backend calls private functions of mamba-ssm and causal-conv1d, whose signatures change between
releases: ``check_pinned_versions`` refuses other versions than ``PINNED``.
"""

from __future__ import annotations

import contextlib
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


_PACKAGE = "mamba_ssm"
# mamba_ssm modules imported under the bare package, kept out of sys.modules between imports
_HIDDEN: dict[str, types.ModuleType] = {}
_STATE = {"real": None, "exposed": False}  # real: whether `import mamba_ssm` works (None: not tried yet)


def _ours(name: str) -> bool:
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


def _real_package_works() -> bool:
    if _STATE["real"] is None:
        before = {k for k in sys.modules if _ours(k)}
        try:
            importlib.import_module(_PACKAGE)
            _STATE["real"] = True
        except ImportError:
            _STATE["real"] = False
            # the failed import leaves the subpackages it got through (mamba_ssm.ops, ...): drop them too
            for name in [k for k in sys.modules if _ours(k) and k not in before]:
                del sys.modules[name]
    return _STATE["real"]


@contextlib.contextmanager
def _bare_package():
    """``sys.modules`` holds the bare ``mamba_ssm`` and the modules imported under it inside the block."""
    if _PACKAGE not in _HIDDEN:
        spec = importlib.util.find_spec(_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mamba-ssm is not installed (pip install mamba-ssm==2.3.2.post1)")
        pkg = types.ModuleType(_PACKAGE)
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        pkg.__file__ = spec.origin
        _HIDDEN[_PACKAGE] = pkg
    if _STATE["exposed"]:
        yield
        return
    # what is there already stays (subpackages left by another library's failed `import mamba_ssm`)
    before = {k for k in sys.modules if _ours(k)}
    sys.modules.update({k: v for k, v in _HIDDEN.items() if k not in before})
    try:
        yield
    finally:
        for name in [k for k in sys.modules if _ours(k) and k not in before]:
            _HIDDEN[name] = sys.modules.pop(name)


SELECTIVE_SCAN = "selective_scan_cuda"  # mamba-ssm's Mamba-1 CUDA extension (a top-level module)


def _missing_selective_scan(name: str):
    def missing(*args, **kwargs):
        raise RuntimeError(
            f"{SELECTIVE_SCAN}.{name} was called, but mamba-ssm's CUDA extension {SELECTIVE_SCAN} is not built here "
            "(CPU builds and the Triton-only wheels lack it): Mamba-1 layers (mamba_ssm.modules.mamba_simple.Mamba, "
            "ssm_cfg layer 'Mamba1') need it; Mamba2 layers do not. Build mamba-ssm with CUDA "
            "(pip install mamba-ssm==2.3.2.post1 --no-binary mamba-ssm on a CUDA machine) or use Mamba2 layers."
        )

    missing.__name__ = name
    return missing


def _placeholder_module() -> types.ModuleType:
    placeholder = types.ModuleType(SELECTIVE_SCAN, f"ds_mamba_spcp's stand-in for mamba-ssm's missing {SELECTIVE_SCAN}")

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing_selective_scan(name)

    placeholder.__getattr__ = __getattr__
    placeholder.IS_PLACEHOLDER = True
    return placeholder


@contextlib.contextmanager
def selective_scan_placeholder():
    """Inside the block, ``import selective_scan_cuda`` finds the placeholder where no real extension is
    installed (nothing changes where one is); it leaves ``sys.modules`` on the way out."""
    if SELECTIVE_SCAN in sys.modules or importlib.util.find_spec(SELECTIVE_SCAN) is not None:
        yield
        return
    sys.modules[SELECTIVE_SCAN] = _placeholder_module()
    try:
        yield
    finally:
        if getattr(sys.modules.get(SELECTIVE_SCAN), "IS_PLACEHOLDER", False):
            del sys.modules[SELECTIVE_SCAN]


def mamba_module(name: str):
    """``mamba_module("ops.triton.ssd_combined")`` -> that submodule of mamba_ssm (``models.mixer_seq_simple``
    too where ``selective_scan_cuda`` is missing: see the module docstring)."""
    full = f"{_PACKAGE}.{name}"
    if _real_package_works():
        return importlib.import_module(full)
    if full in _HIDDEN:
        return _HIDDEN[full]
    with _bare_package(), selective_scan_placeholder():
        return importlib.import_module(full)


def mamba_modules_loaded(prefix: str = _PACKAGE) -> list[str]:
    """Names of the mamba_ssm modules loaded in this process that start with ``prefix`` (in ``sys.modules`` or
    kept aside by ``mamba_module``): e.g. to check that no Triton module was imported before an environment
    variable it reads at import time was set."""
    names = set(_HIDDEN) | {k for k in sys.modules if _ours(k)}
    return sorted(n for n in names if n.startswith(prefix) and n != _PACKAGE)


def expose_mamba_package() -> None:
    """Leaves the bare ``mamba_ssm`` package and its imported modules in ``sys.modules`` from now on (nothing
    to do where the real import works). Libraries that import mamba_ssm afterwards then find it and bind its
    Triton kernels: on a GPU without mamba-ssm's CUDA extension, what a built ``import mamba_ssm`` gives."""
    if _real_package_works() or _STATE["exposed"]:
        return
    with _bare_package():
        pass
    for name, module in _HIDDEN.items():  # the attribute chain mamba_ssm.ops.triton... that importers walk
        parent, _, child = name.rpartition(".")
        if parent in _HIDDEN and not hasattr(_HIDDEN[parent], child):
            setattr(_HIDDEN[parent], child, module)
    sys.modules.update({k: v for k, v in _HIDDEN.items() if k not in sys.modules})
    _STATE["exposed"] = True


def mamba2_class():
    """mamba-ssm's ``Mamba2`` module class."""
    return mamba_module("modules.mamba2").Mamba2


def mamba_lm_head_model():
    """(mamba-ssm's ``MambaLMHeadModel``, its ``MambaConfig``): importable without ``selective_scan_cuda``
    (a Mamba-1 layer's scan then raises, naming the missing build; Mamba2 layers run)."""
    return mamba_module("models.mixer_seq_simple").MambaLMHeadModel, mamba_module("models.config_mamba").MambaConfig


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
    """causal-conv1d's conv forward and backward, with the signatures and results of its
    ``causal_conv1d_fwd_function`` / ``causal_conv1d_bwd_function``; ImportError when its CUDA extension
    is missing. Eager calls go straight to the C++ functions (the custom ops' dispatch cost the host ~100-240 us
    per call against ~15-20 us in C++ on an H200: benchmarks/results/README.md); under torch.compile the custom
    ops run. The outputs are fresh tensors or the caller's ``dx``; nothing saved for autograd is written.
    """
    import causal_conv1d_cuda
    import torch

    causal_conv1d_fwd_function, causal_conv1d_bwd_function = causal_conv1d_custom_ops()
    compiling = torch.compiler.is_compiling

    def conv_fwd(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
        if compiling():
            return causal_conv1d_fwd_function(x, weight, bias, seq_idx, initial_states, final_states_out,
                                              silu_activation)  # fmt: skip
        out = torch.empty_like(x)
        causal_conv1d_cuda.causal_conv1d_fwd(
            x, weight, bias, seq_idx, initial_states, out, final_states_out, silu_activation
        )
        return out

    def conv_bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
                 silu_activation):  # fmt: skip
        if compiling():
            return causal_conv1d_bwd_function(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx,
                                              return_dinitial_states, silu_activation)  # fmt: skip
        dx = torch.empty_like(x) if dx is None else dx
        # the C++ backward accumulates the parameter gradients in fp32 (atomics: not bitwise reproducible)
        dweight = torch.zeros_like(weight, dtype=torch.float32)
        dbias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        dinit = None
        if return_dinitial_states:  # (batch, dim, width-1) with the channels innermost, as the kernel writes it
            batch, dim, width = x.shape[0], x.shape[1], weight.shape[-1]
            dinit = torch.empty(batch, width - 1, dim, device=x.device, dtype=x.dtype).transpose(1, 2)
        causal_conv1d_cuda.causal_conv1d_bwd(
            x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, dweight, dbias, dinit, silu_activation
        )
        return dx, dweight.type_as(weight), None if dbias is None else dbias.type_as(bias), dinit

    return conv_fwd, conv_bwd


def causal_conv1d_custom_ops():
    """causal-conv1d's own ``(causal_conv1d_fwd_function, causal_conv1d_bwd_function)`` (its custom ops), which
    ``causal_conv1d_functions`` calls under torch.compile; the GPU tests compare the two."""
    from causal_conv1d.cpp_functions import causal_conv1d_bwd_function, causal_conv1d_fwd_function

    return causal_conv1d_fwd_function, causal_conv1d_bwd_function
