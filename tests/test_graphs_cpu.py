"""The CUDA-graph mode's switch (``cuda_graphs``): refused on CPU and for groups of several ranks, with the fix.

The replays themselves need a GPU: tests/test_gpu_graphs.py.
"""

from __future__ import annotations

import pytest
import torch

from ds_mamba_spcp import mamba_split_conv1d_scan_sp
from ds_mamba_spcp.call import Options, _check_options
from ds_mamba_spcp.config import MambaSequenceParallelConfig
from ds_mamba_spcp.integrations.core import options_of
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
    assert options_of(cfg).cuda_graphs is True
    cfg.validate_for_mixer(nheads=4, ngroups=2, cp=1)
    with pytest.raises(ValueError, match=r'"mamba_sequence_parallel.cuda_graphs" is true .* 2 ranks'):
        cfg.validate_for_mixer(nheads=4, ngroups=2, cp=2)


def _fake_instance(graphs, addresses, busy=False):
    """An instance without graphs (nothing is captured on CPU): its choice rules only (``free``, ``reads_at``)."""
    inst = object.__new__(graphs._Instance)
    inst.busy, inst.generation, inst.addresses = busy, 0, addresses
    inst.returned = [torch.zeros(4), torch.zeros(4)]  # its output and zxbcdt gradient buffers
    inst.own_refs = [graphs._use_count(t) for t in inst.returned]
    return inst


def test_instance_choice(monkeypatch):
    """Which instance serves a call: one reading in place at the call's addresses, else one with static inputs;
    never one that is busy or whose returned buffers a caller still holds (its next replay would overwrite
    them); a new one is captured in place unless free in-place instances read other addresses."""
    from ds_mamba_spcp import graphs

    captured = []

    class Captured(graphs._Instance):
        def __init__(self, call, strategy, needs_grad, warm, in_place):
            self.busy, self.generation, self.addresses, self.returned, self.own_refs = False, 0, None, [], []
            captured.append(dict(warm=warm, in_place=in_place))

    monkeypatch.setattr(graphs, "_Instance", Captured)
    a, b = torch.zeros(3), torch.zeros(3)
    at_a = graphs._addresses([a, None])
    in_place, static = _fake_instance(graphs, at_a), _fake_instance(graphs, None)
    entry = [in_place, static]
    assert graphs._instance(entry, None, None, [a, None], True) is in_place
    assert graphs._instance(entry, None, None, [b, None], True) is static  # other addresses: copies
    held = in_place.returned[0][1:]  # a caller keeps a view of the output
    assert not in_place.free() and graphs._instance(entry, None, None, [a, None], True) is static
    held2 = in_place.returned[1].detach()  # or the gradient (a leaf's .grad that took it)
    del held
    assert not in_place.free()
    del held2
    assert in_place.free() and graphs._instance(entry, None, None, [a, None], True) is in_place
    in_place.busy = static.busy = True  # both serving calls (backwards pending): a new instance, in place
    new = graphs._instance(entry, None, None, [b, None], True)
    assert captured == [dict(warm=True, in_place=True)] and entry[-1] is new
    in_place.busy = False  # free but at a, the call at b: a new one with static inputs
    graphs._instance([in_place], None, None, [b, None], True)
    assert captured[-1] == dict(warm=True, in_place=False)
    graphs._instance([], None, None, [a, None], True)  # the shape's first call: warmed up, in place
    assert captured[-1] == dict(warm=False, in_place=True) and len(captured) == 3
