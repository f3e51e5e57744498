"""Offloaded block checkpoints on one GPU (marker ``gpu``; needs 1 CUDA GPU): same gradients, lower peak.

    MAMBA_DETERMINISTIC=1 python -m pytest -m gpu -q -s tests/test_gpu_offload.py

A Mamba2 LM (d_model 256 x 12 layers, bf16, the Triton backend, a group of one) at 40,960 tokens, one
forward and backward with every block recomputed: ``OffloadedCheckpoint`` with a budget that keeps every
checkpoint on the GPU (no offload: the baseline), with budget 0 (all but the newest to pinned host memory,
async on the copy stream, prefetched) and with a budget of 3 checkpoints (the split). Checked:

1. The loss and every gradient bitwise equal to the baseline's (offload is a move; the recompute runs the
   same kernels on the same bits), except causal-conv1d's conv weight and bias gradients, whose CUDA
   backward sums in a run-to-run varying order (docs/checkpointing.md): those within 1e-2 relative RMS
   (bf16's last bit is 2^-8 relative; a wrong or stale checkpoint moves them by O(1)).
2. The GPU peak (``max_memory_allocated`` over the pass) at budget 0 is lower than the baseline's by at
   least ``n_layers - 4`` checkpoints: by the plan at most the newest, the one being recomputed and one
   prefetched are on the GPU at once, where the baseline holds all of them (``n_layers - 2`` fewer at the
   peak); two checkpoints of slack for copies whose memory the allocator frees only once they ran.
3. The pool holds exactly the plan's bytes, in page-locked memory, and a second step allocates nothing new;
   the process's resident host memory (RssAnon + RssShmem) grows over its first offloaded pass (budget 0)
   by the plan's bytes within ``RSS_SLACK`` either way (freed heap pages reused, the driver's own). A
   checkpoint here is 20 MiB: PyTorch's pinned allocator would take 32 MiB for each, 132 MiB more for the
   11 offloaded; a duplicate host copy would add 220 MiB.
"""

from __future__ import annotations

import os

os.environ.setdefault("MAMBA_DETERMINISTIC", "1")  # one Triton config per kernel: the same kernels every call

import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N_LAYERS, D_MODEL, SEQLEN, VOCAB = 12, 256, 40960, 256
RSS_SLACK = 32 * 2**20  # host memory the pass may take besides the pool (driver, allocator, Python)
CONV = ("conv1d.weight", "conv1d.bias")
CONV_TOL = 1e-2


def _model():
    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.module import wrap_mamba2_mixers
    from tests.conftest import load_train

    train = load_train()
    args = train.parse_args([
        "--vocab-size", str(VOCAB), "--d-model", str(D_MODEL), "--n-layers", str(N_LAYERS), "--d-state", "64",
        "--headdim", "64", "--expand", "2", "--ngroups", "1", "--chunk-size", "256", "--seq-len", str(SEQLEN),
    ])  # fmt: skip
    model = train.build_model(args)
    wrap_mamba2_mixers(model, None, MambaSequenceParallelConfig(enabled=True, sequence_parallel_size=1))
    model = model.to("cuda", torch.bfloat16).train()
    batch = train.synthetic_batch(1, SEQLEN, VOCAB, seed=5)
    return model, {k: v.cuda() for k, v in batch.items()}


def _pass(model, batch, offloader):
    from ds_mamba_spcp.memory import OffloadedCheckpoint

    model.checkpoint = OffloadedCheckpoint(offloader)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    logits = model(batch["input_ids"])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten())
    del logits
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}, peak


def _host_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


def _rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).square().mean().sqrt() / b.square().mean().sqrt().clamp_min(1e-30)).item()


def test_offload_same_grads_lower_peak():
    from ds_mamba_spcp.memory import CheckpointOffloader, plan_offload

    model, batch = _model()
    each = SEQLEN * D_MODEL * 2
    _pass(model, batch, CheckpointOffloader(gpu_budget_bytes=2**62))  # warm-up: kernels compiled, allocator warm
    base_loss, base_grads, base_peak = _pass(model, batch, CheckpointOffloader(gpu_budget_bytes=2**62))
    report = {}
    for kept in (0, 3):
        offloader = CheckpointOffloader(gpu_budget_bytes=kept * each)
        rss = _host_rss()
        loss, grads, peak = _pass(model, batch, offloader)
        rss = _host_rss() - rss
        reserved = offloader.pool.reserved_bytes
        loss2, grads2, _ = _pass(model, batch, offloader)  # step 2: the same slots
        plan = plan_offload([each] * N_LAYERS, kept * each)
        exact = [n for n in grads if not any(c in n for c in CONV) and not torch.equal(grads[n], base_grads[n])]
        conv = {n: _rel_rms(grads[n], base_grads[n]) for n in grads if any(c in n for c in CONV)}
        report[kept] = dict(peak_gib=peak / 2**30, base_peak_gib=base_peak / 2**30, conv=max(conv.values()))
        print(f"kept {kept}: peak {peak / 2**30:.3f} GiB vs {base_peak / 2**30:.3f} GiB without offload, "
              f"host pool {reserved / 2**20:.0f} MiB (plan {plan.host_bytes / 2**20:.0f} MiB, RSS growth "
              f"{rss / 2**20:.0f} MiB), "
              f"conv grads rel RMS {max(conv.values()):.2e}")  # fmt: skip
        assert torch.equal(loss, base_loss) and torch.equal(loss2, base_loss)
        assert exact == [], f"budget {kept}: gradients not bitwise equal without offload: {exact}"
        assert max(conv.values()) <= CONV_TOL, conv
        assert all(torch.equal(grads2[n], grads[n]) for n in grads if not any(c in n for c in CONV))
        assert reserved == offloader.pool.reserved_bytes == plan.host_bytes  # exact sizes, nothing new in step 2
        if kept == 0:  # the process's first pool: later ones may reuse the freed pages of this one (glibc)
            assert abs(rss - plan.host_bytes) <= RSS_SLACK, f"host RSS grew by {rss / 2**20:.0f} MiB"
        assert offloader.stats["offloaded"] == 2 * len(plan.on_host)
        slots = [b for bufs in offloader.pool._free.values() for b in bufs]
        # page-locked: the pool's _register raises on any nonzero cudaHostRegister code. Not re-checked here:
        # Tensor.is_pinned knows only PyTorch's own pinned allocator (False for these on the H200), and a second
        # cudaHostRegister, which answers 712 (already registered: it was, seen on the H200), leaves CUDA's last
        # error set for the next kernel launch to raise.
        assert slots and offloader.pool.pin
    saved = base_peak - report[0]["peak_gib"] * 2**30
    assert saved >= (N_LAYERS - 4) * each, f"offload saved {saved / 2**20:.0f} MiB of GPU peak, expected >= " \
        f"{(N_LAYERS - 4) * each / 2**20:.0f} MiB"  # fmt: skip
