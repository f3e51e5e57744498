"""The tiled block recompute on one GPU (Triton backend, bf16): parity with the untiled block, and its memory.

    python -m pytest -m gpu -q -s tests/test_gpu_tiled_block.py

One block of the 780M preset (d_model 1536, d_state 128, headdim 64, expand 2, ngroups 1, chunk 256, d_conv 4;
48 heads, in_proj 1536 -> 6448) at L = 130,000 tokens, batch 1: tiles of 16,384 tokens (8 tiles, the last
of 15,312, not a multiple of the chunk).
1. Parity, one document per row and packed rows (documents starting on a tile border, a token after one, and
   inside tiles): the block's output, the input's gradient and every parameter's gradient, tiled in bf16 and untiled
   in bf16 (mamba-ssm's own Mamba2.forward, what a group of one runs), both against the untiled block in fp32
   on the same (bf16-rounded) weights and inputs. The tiled block must stay within 2x the untiled block's own
   distance from fp32, plus 1e-4: the bound of the GPU suite (tests/test_gpu_tiles.py): the two bf16
   computations round at different places and neither is closer to fp32 by construction, while a lost state
   or halo at a tile border is O(1) (the CPU negative controls). The untiled distance must itself be bf16 noise
   (< 1e-2), or the bound would say nothing.
2. Memory: the peak above the forward's leftovers during one block's recompute + backward, untiled under
   torch.utils.checkpoint (what --activation-checkpointing runs) against tiled. Both are printed; the tiled peak
   must be under half the untiled one (untiled: tens of KiB per token of transients, in_proj's output and its
   gradient, the conv output, fp32 chunk states; tiled: the block's input and output gradients, 6 KiB per
   token at d_model 1536 in bf16, plus one tile's transients).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SEQLEN, TILE = 130_000, 16_384
D_MODEL = 1536


def _block(dtype):
    import sys

    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.module import DistributedMamba2
    from tests.dist_utils import REPO

    sys.path.insert(0, f"{REPO}/examples")
    from model import Block, mamba2_factory

    torch.manual_seed(0)
    mixer = mamba2_factory(D_MODEL, d_state=128, d_conv=4, expand=2, headdim=64, ngroups=1, chunk_size=256)(0)
    cfg = MambaSequenceParallelConfig(enabled=True, sequence_parallel_size=1, backend="triton")
    return Block(D_MODEL, DistributedMamba2(mixer, None, cfg)).to("cuda", dtype)


def _run(block, fn, x, dout, seq_idx=None):
    x = x.clone().requires_grad_()
    out = fn(block, x, seq_idx)
    out.backward(dout)
    got = {"out": out.detach().float(), "dx": x.grad.float()}
    for name, p in block.named_parameters():
        got["d" + name] = p.grad.float()
        p.grad = None
    return got


def _untiled(block, x, seq_idx=None):
    return block(x, seq_idx=seq_idx)


def _tiled(block, x, seq_idx=None):
    from ds_mamba_spcp.memory import tiled_block

    return tiled_block(x, block.norm, block.mixer, TILE, seq_idx=seq_idx)


def _packed_labels():
    """Documents of the row: starts at 0, one exactly on the border of tiles 2 and 3, one a token after the
    next border, and others inside tiles (int32 labels, one per document)."""
    starts = [0, 9_000, 2 * TILE, 3 * TILE + 1, 70_001, 100_000, 129_990]
    labels = torch.zeros(1, SEQLEN, dtype=torch.int32, device="cuda")
    for s in starts[1:]:
        labels[:, s:] += 1
    return labels


@pytest.fixture(scope="module")
def blocks():
    bf16 = _block(torch.bfloat16)
    f32 = _block(torch.float32)
    f32.load_state_dict(bf16.state_dict())  # the same bf16-rounded weights
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, SEQLEN, D_MODEL, generator=g, device="cuda").bfloat16()
    dout = torch.randn(1, SEQLEN, D_MODEL, generator=g, device="cuda").bfloat16()
    return bf16, f32, x, dout


@pytest.mark.parametrize("packed", [False, True], ids=["one_document", "packed"])
def test_tiled_within_untiled_distance_from_fp32(blocks, packed):
    from tests.gpu_cases import rel

    bf16, f32, x, dout = blocks
    seq_idx = _packed_labels() if packed else None
    ref = _run(f32, _untiled, x.float(), dout.float(), seq_idx)
    untiled = {k: rel(v, ref[k]) for k, v in _run(bf16, _untiled, x, dout, seq_idx).items()}
    tiled = {k: rel(v, ref[k]) for k, v in _run(bf16, _tiled, x, dout, seq_idx).items()}
    for k in ref:
        print(f"L={SEQLEN} packed={packed} tiles of {TILE} {k}: tiled {tiled[k]:.2e}, untiled {untiled[k]:.2e} "
              "(vs fp32)")  # fmt: skip
    assert max(untiled.values()) < 1e-2, f"the untiled bf16 block is not bf16 noise off fp32: {untiled}"
    bad = {k: (tiled[k], untiled[k]) for k in ref if not tiled[k] <= 2 * untiled[k] + 1e-4}
    assert not bad, f"tiled farther from fp32 than 2x untiled: {bad}"


def _backward_peak(block, fn, x, dout) -> tuple[float, float]:
    """(forward peak, backward peak) in GiB above what is allocated before each."""
    x = x.clone().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(block, x, None)
    torch.cuda.synchronize()
    forward = (torch.cuda.max_memory_allocated() - base) / 2**30
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(dout)
    torch.cuda.synchronize()
    backward = (torch.cuda.max_memory_allocated() - base) / 2**30
    for p in block.parameters():
        p.grad = None
    return forward, backward


def test_tiled_block_backward_peak_lower(blocks):
    from torch.utils.checkpoint import checkpoint

    bf16, _, x, dout = blocks

    def checkpointed(block, x, seq_idx=None):
        return checkpoint(block, x, use_reentrant=False)

    _backward_peak(bf16, _tiled, x, dout)  # warm up the kernels' autotuning outside the measurement
    _backward_peak(bf16, checkpointed, x, dout)
    untiled = _backward_peak(bf16, checkpointed, x, dout)
    tiled = _backward_peak(bf16, _tiled, x, dout)
    per_token = 2**30 / SEQLEN / 1024
    print(
        f"one 780M block at L={SEQLEN}: untiled (checkpointed) forward {untiled[0]:.2f} GiB, recompute + backward "
        f"{untiled[1]:.2f} GiB ({untiled[1] * per_token:.1f} KiB/token); tiles of {TILE}: forward {tiled[0]:.2f} "
        f"GiB, recompute + backward {tiled[1]:.2f} GiB ({tiled[1] * per_token:.1f} KiB/token)"
    )
    assert tiled[1] < 0.5 * untiled[1], f"tiled backward peak {tiled[1]:.2f} GiB vs untiled {untiled[1]:.2f} GiB"
