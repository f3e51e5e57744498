"""causal-conv1d called straight through its C++ functions (``_upstream.causal_conv1d_functions``, eager) against
its own torch.library custom ops (``_upstream.causal_conv1d_custom_ops``), on the GPU.

    python -m pytest -m gpu -q -s tests/test_gpu_conv.py

The layouts the Triton backend passes (``ops/triton.py``): x (batch, dim, seqlen) with the channels innermost, the
halo as initial_states (batch, dim, width-1) with the channels innermost, or canonical seq_idx labels; bf16,
SiLU. The forward output, dx and the halo's gradient must be bitwise the same (the same kernels on the same
inputs). The conv weight and bias gradients are summed with fp32 atomics in an order that changes from call to
call, then rounded to bf16: an element lands on the same value or a neighbour one rounding step away (a relative
step of at most eps), so their relative RMS must stay at or below eps(bf16) even if every element moved.
Negative controls: another upstream gradient breaks both checks, and under (patched) torch.compile the custom
ops are what run.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_cases import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DIM, WIDTH, SEQLEN = 1536, 4, 2048


def _inputs(seed, packed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf16 = torch.device("cuda"), torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=g).to(bf16)

    x = randn(1, SEQLEN, DIM).transpose(1, 2)  # (b, dim, l), stride(1) == 1
    weight, bias = randn(DIM, WIDTH) * 0.5, randn(DIM)
    dout = randn(1, SEQLEN, DIM).transpose(1, 2)
    if packed:
        seq_idx = torch.zeros(1, SEQLEN, device=dev, dtype=torch.int32)
        seq_idx[:, 700:] = 1
        seq_idx[:, 1500:] = 2
        return x, weight, bias, dout, seq_idx, None
    init = randn(1, WIDTH - 1, DIM).transpose(1, 2)  # the halo in the conv's layout
    return x, weight, bias, dout, None, init


def _run(fns, x, weight, bias, dout, seq_idx, init):
    fwd, bwd = fns
    out = fwd(x, weight, bias, seq_idx, init, None, True)
    dx_buf = torch.empty(1, SEQLEN, DIM, device=x.device, dtype=x.dtype).transpose(1, 2)  # a caller's buffer
    dx, dweight, dbias, dinit = bwd(x, weight, bias, dout, seq_idx, init, None, dx_buf, init is not None, True)
    assert dx.data_ptr() == dx_buf.data_ptr()
    return {"out": out, "dx": dx, "dinit": dinit, "dweight": dweight, "dbias": dbias}


EXACT = ("out", "dx", "dinit")
ATOMIC = ("dweight", "dbias")  # fp32 atomics, then bf16: within one rounding step (see the module docstring)


@pytest.mark.parametrize("packed", [False, True], ids=["halo", "seq_idx"])
def test_direct_calls_match_custom_ops(packed, monkeypatch):
    from ds_mamba_spcp.ops.kernels import upstream as _upstream

    direct, custom = _upstream.causal_conv1d_functions(), _upstream.causal_conv1d_custom_ops()
    t = _inputs(0, packed)
    got, want = _run(direct, *t), _run(custom, *t)
    for k in EXACT:
        if want[k] is None:
            assert got[k] is None, k
            continue
        assert got[k].shape == want[k].shape and got[k].stride() == want[k].stride(), k
        assert torch.equal(got[k], want[k]), k
    eps = torch.finfo(torch.bfloat16).eps
    for k in ATOMIC:
        assert got[k].dtype == want[k].dtype == torch.bfloat16, k
        assert rel(got[k].float(), want[k].float()) <= eps, (k, rel(got[k].float(), want[k].float()))

    # negative control: another upstream gradient moves dx and the parameter gradients past both checks
    other = _run(direct, *t[:3], _inputs(1, packed)[3], *t[4:])
    assert not torch.equal(other["dx"], want["dx"])
    assert all(rel(other[k].float(), want[k].float()) > eps for k in ATOMIC)

    # under torch.compile the custom ops run; eagerly they are not called
    import causal_conv1d.cpp_functions as ccf

    calls = []
    for name in ("_causal_conv1d_fwd_cpp", "_causal_conv1d_bwd_cpp"):
        real = getattr(ccf, name)
        monkeypatch.setattr(ccf, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    _run(direct, *t)
    assert calls == [], calls
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    via_ops = _run(_upstream.causal_conv1d_functions(), *t)
    assert calls == ["_causal_conv1d_fwd_cpp", "_causal_conv1d_bwd_cpp"], calls
    assert torch.equal(via_ops["out"], want["out"]) and torch.equal(via_ops["dx"], want["dx"])
