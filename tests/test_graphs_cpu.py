"""The CUDA-graph mode's switch (``cuda_graphs``): refused on CPU and for groups of several ranks, with the fix.

The replays themselves need a GPU: tests/test_gpu_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

from ds_mamba_spcp import mamba_split_conv1d_scan_sp
from ds_mamba_spcp.config import MambaSequenceParallelConfig, Options
from ds_mamba_spcp.engine.call import _check_options
from ds_mamba_spcp.ops.spec import CoreSpec


def _inputs():
    h, p, g, n, K = 2, 4, 1, 8, 4
    d_inner, conv_dim = h * p, h * p + 2 * g * n
    zxbcdt = torch.randn(1, 16, 2 * d_inner + 2 * g * n + h)
    return (zxbcdt, torch.randn(conv_dim, K), torch.randn(conv_dim), torch.zeros(h), -torch.ones(h), torch.ones(h), 8)


def test_refused_on_cpu():
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs CUDA tensors.*cpu.*cuda_graphs=False"):
        mamba_split_conv1d_scan_sp(*_inputs(), headdim=4, ngroups=1, cuda_graphs=True)
    mamba_split_conv1d_scan_sp(*_inputs(), headdim=4, ngroups=1, cuda_graphs=False)  # the default runs


def test_refused_for_a_group_of_several_ranks():
    spec = CoreSpec(nheads=2, headdim=4, ngroups=1, dstate=8, d_conv=4, chunk_size=8)
    _check_options(Options(cuda_graphs=True), spec, 1, 16)
    with pytest.raises(ValueError, match=r"cuda_graphs=True .* one device only.* 2 ranks"):
        _check_options(Options(cuda_graphs=True), spec, 2, 16)


def test_config_key():
    cfg = MambaSequenceParallelConfig(enabled=True, cuda_graphs=True)
    assert cfg.options().cuda_graphs is True
    cfg.validate_for_mixer(nheads=4, ngroups=2, cp=1)
    with pytest.raises(ValueError, match=r'"mamba_sequence_parallel.cuda_graphs" is true .* 2 ranks'):
        cfg.validate_for_mixer(nheads=4, ngroups=2, cp=2)
