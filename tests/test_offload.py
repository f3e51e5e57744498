"""ds_mamba_spcp.memory.offload on CPU: the split, the host check and its refusal, and offload as a pure move.

Offload only moves each block's input to a pool slot and back; nothing is recomputed differently, so in
fp64 on CPU the loss and every gradient must be bitwise those of the same model without offload (and of
torch's own checkpoint and of no checkpointing at all: the recompute runs the same ops on the same
inputs). The negative control hands every checkpoint the same pool slot (a plausible pool bug: a slot
reused before its checkpoint came back); block 0 then recomputes from block 1's input and its gradients
change. The GPU twin (pinned, async, lower peak) is tests/test_gpu_offload.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ds_mamba_spcp.memory import (
    CheckpointOffloader,
    HostMemory,
    HostMemoryError,
    OffloadedCheckpoint,
    PinnedPool,
    block_checkpoint_bytes,
    check_host_memory,
    plan_offload,
)
from ds_mamba_spcp.memory import offload as offload_mod
from tests.conftest import TINY, load_train, sgd_config
from tests.dist_utils import run_ranks

GiB = 2**30
N_LAYERS = 4


# ---------------------------------------------------------------------------------------------
# the split and the host check
# ---------------------------------------------------------------------------------------------


def test_split_gpu_first_newest_stays():
    sizes = block_checkpoint_bytes(1024, 8, N_LAYERS, 2)  # 16 KiB each
    each = sizes[0]
    none = plan_offload(sizes, 0)
    assert none.on_gpu == () and none.on_host == (0, 1, 2) and none.newest == 3
    assert none.host_bytes == 3 * each and none.gpu_bytes == 2 * each  # the newest + one prefetched
    two = plan_offload(sizes, 2 * each + 1)  # the budget takes whole checkpoints, the first ones
    assert two.on_gpu == (0, 1) and two.on_host == (2,) and two.newest == 3 and two.host_bytes == each
    everything = plan_offload(sizes, 10 * each)
    assert everything.on_gpu == (0, 1, 2, 3) and everything.on_host == () and everything.newest is None
    assert everything.host_bytes == 0
    with pytest.raises(ValueError, match="GPU budget"):
        plan_offload(sizes, -1)


def test_host_check_refuses_with_the_numbers_and_a_budget_that_fits():
    sizes = block_checkpoint_bytes(1048576, 1536, 48, 2)  # the 780M at 1M tokens: 3 GiB per checkpoint
    plan = plan_offload(sizes, 0)
    assert plan.host_bytes == 47 * 3 * GiB
    with pytest.raises(HostMemoryError) as e:
        check_host_memory(plan, headroom_bytes=8 * GiB, local_ranks=1, memory=HostMemory(118 * GiB))
    msg = str(e.value)
    for part in ("149.0 GiB of host memory", "118.0 GiB are available", "--seq-len", "sequence_parallel_size",
                 "--offload-gpu-budget-gib 33.00"):  # fmt: skip
        assert part in msg, (part, msg)
    # the budget it names fits: 11 checkpoints on the GPU, 36 x 3 GiB + 8 GiB <= 118 GiB
    fits = check_host_memory(plan_offload(sizes, 33 * GiB), headroom_bytes=8 * GiB, local_ranks=1,
                             memory=HostMemory(118 * GiB))  # fmt: skip
    assert fits.ok and fits.needed == 36 * 3 * GiB + 8 * GiB
    with pytest.raises(HostMemoryError):  # one GiB less of budget: one more checkpoint on the host, too much
        check_host_memory(plan_offload(sizes, 32 * GiB), headroom_bytes=8 * GiB, local_ranks=1,
                          memory=HostMemory(118 * GiB))  # fmt: skip
    # the ranks of one host share it; a cgroup limit tighter than MemAvailable wins
    half = plan_offload(block_checkpoint_bytes(262144, 1536, 48, 2), 0)  # 47 x 0.75 GiB
    check_host_memory(half, headroom_bytes=0, local_ranks=1, memory=HostMemory(36 * GiB))
    with pytest.raises(HostMemoryError, match="2 rank"):
        check_host_memory(half, headroom_bytes=0, local_ranks=2, memory=HostMemory(36 * GiB))
    with pytest.raises(HostMemoryError, match="20.0 GiB are available"):
        check_host_memory(half, headroom_bytes=0, local_ranks=1, memory=HostMemory(36 * GiB, cgroup_free=20 * GiB))


def test_cgroup_limits_are_read(tmp_path):
    v1 = tmp_path / "memory"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text(str(10 * GiB))
    (v1 / "memory.usage_in_bytes").write_text(str(7 * GiB))
    (v1 / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GiB}\n")
    free, limit, _ = offload_mod._cgroup_free(str(tmp_path))
    assert (free, limit) == (4 * GiB, 10 * GiB)  # 10 - 7 + 1 reclaimable
    (tmp_path / "memory.max").write_text(str(6 * GiB))  # cgroup v2 at the root: the walk up reaches it
    (tmp_path / "memory.current").write_text(str(5 * GiB))
    (tmp_path / "memory.stat").write_text("inactive_file 0\n")
    free, limit, _ = offload_mod._cgroup_free(str(tmp_path))
    assert (free, limit) == (GiB, 6 * GiB)  # the tighter of the two
    (tmp_path / "memory.max").write_text("max")
    assert offload_mod._cgroup_free(str(tmp_path))[0] == 4 * GiB
    assert offload_mod.host_memory().available > 0  # this machine's


def _refuse_on_rank(rank, world):
    # rank 1 sees less memory: both ranks must take the smallest and raise the same words
    memory = HostMemory((40 if rank == 0 else 30) * GiB)
    plan = plan_offload(block_checkpoint_bytes(262144, 1536, 48, 2), 0)  # 35.25 GiB per rank
    out = []
    try:
        check_host_memory(plan, headroom_bytes=0, local_ranks=1, memory=memory)
        out.append(None)
    except HostMemoryError as e:
        out.append(str(e))
    # examples/train.py under the launcher: refused before the model is built, on both ranks
    train = load_train()
    args = train.parse_args(TINY + ["--steps", "1", "--activation-checkpointing", "--offload-activations",
                                    "--offload-host-headroom-gib", "1e9"])  # fmt: skip
    try:
        train.run_distributed(args, sgd_config("state_passing.json", 1))
        out.append(None)
    except HostMemoryError as e:
        out.append(str(e))
    return out


def test_refusal_is_the_same_on_every_rank():
    (check0, train0), (check1, train1) = run_ranks(_refuse_on_rank, 2, timeout=180)
    assert check0 is not None and check0 == check1, (check0, check1)
    assert "30.0 GiB are available" in check0
    assert train0 is not None and train0 == train1 and "2 rank(s)" in train0, (train0, train1)


def test_train_refuses_before_building():
    train = load_train()
    args = train.parse_args(TINY + ["--steps", "1", "--activation-checkpointing", "--offload-activations",
                                    "--offload-host-headroom-gib", "1e9"])  # fmt: skip
    with pytest.raises(HostMemoryError, match="--offload-host-headroom-gib"):
        train.run_single(args, sgd_config("state_passing.json", 1))


# ---------------------------------------------------------------------------------------------
# the pool
# ---------------------------------------------------------------------------------------------


def test_pool_reuses_exact_sizes_and_keeps_its_limit():
    pool = PinnedPool(pin=False, limit_bytes=300)
    a = pool.acquire(100)
    b = pool.acquire(200)
    assert pool.reserved_bytes == 300
    with pytest.raises(HostMemoryError, match="checked before the run"):
        pool.acquire(1)
    pool.release(a)
    assert pool.acquire(100).data_ptr() == a.data_ptr()  # the same slot, no new memory
    pool.release(b)
    assert pool.reserved_bytes == 300 and pool.peak_in_use_bytes == 300


def test_pool_lends_the_smallest_fitting_slot():
    """A free slot at least as large serves a request (the smallest such); a request no free slot holds drops
    the free ones first (after ``drain``: on a GPU, copies from them may still run); a slot ``reserve`` kept is
    never dropped, so a request past it and the limit is refused with the kept slot in place."""
    pool, drained = PinnedPool(pin=False), []
    pool.drain = lambda: drained.append(True)
    a, b, c = pool.acquire(100), pool.acquire(200), pool.acquire(400)
    for buf in (a, b, c):
        pool.release(buf)
    d = pool.acquire(150)
    assert (d.numel(), d.data_ptr(), pool.reserved_bytes, drained) == (150, b.data_ptr(), 700, [])
    e = pool.acquire(450)  # the free 100 and 400 are too small: dropped, 450 allocated
    assert (pool.reserved_bytes, drained) == (200 + 450, [True])
    pool.release(d)
    pool.release(e)
    assert pool.in_use_bytes == 0 and pool.peak_in_use_bytes == 700  # a, b and c at once
    limited = PinnedPool(pin=False, limit_bytes=300)
    kept = limited.acquire(100)
    limited.keep(kept)
    limited.release(kept)
    with pytest.raises(HostMemoryError, match="checked before the run"):
        limited.acquire(250)
    assert limited.reserved_bytes == 100 and limited.acquire(80).data_ptr() == kept.data_ptr()


# rows of 100-180 tokens, one length per step (what the Trainer's and SFT's padding to the longest row gives)
LENGTHS = [131, 100, 176, 152, 131, 118, 180, 164, 107, 145, 180, 126]


def _step(offloader, length, d_model=8):
    """One forward and backward of N_LAYERS checkpointed blocks (tanh(Linear), fp64) on (1, length, d_model)."""
    torch.manual_seed(0)
    lins = [torch.nn.Linear(d_model, d_model).double() for _ in range(N_LAYERS)]
    ck = OffloadedCheckpoint(offloader)
    h = torch.randn(1, length, d_model, dtype=torch.float64, requires_grad=True)
    for lin in lins:
        h = ck(lambda x, lin=lin: torch.tanh(lin(x)), h)
    h.sum().backward()


def test_pool_stays_within_the_longest_steps_need():
    """Over steps of varying lengths the pool holds at most the longest step's checkpoints (its slots serve
    every shorter one; before the fix it kept a slot set per length: 7.8x here, the issue saw 5.25x); for one
    length it is exact (test_offload_is_bitwise_a_move)."""
    offloader = CheckpointOffloader(0)
    need = lambda n: plan_offload(block_checkpoint_bytes(n, 8, N_LAYERS, 8), 0).host_bytes  # noqa: E731
    for i, length in enumerate(LENGTHS):
        _step(offloader, length)
        longest = need(max(LENGTHS[: i + 1]))
        ratio = offloader.pool.reserved_bytes / longest
        assert offloader.pool.reserved_bytes <= longest, f"step {i}: the pool holds {ratio:.2f}x the longest need"
    assert offloader.pool.in_use_bytes == 0 and offloader.stats["offloaded"] == len(LENGTHS) * (N_LAYERS - 1)


def test_a_plan_covers_every_shorter_length():
    """A plan for the longest length (what check_offload approves and reserve pins) serves every shorter one
    with its slots, allocating nothing (before the fix the first other length raised HostMemoryError); a
    longer one is refused at its first checkpoint, before anything is dropped or allocated."""
    plan = plan_offload(block_checkpoint_bytes(max(LENGTHS), 8, N_LAYERS, 8), 0)
    offloader = CheckpointOffloader(0, host_limit_bytes=plan.host_bytes)
    offloader.reserve(plan, pin=False)
    for length in LENGTHS:
        _step(offloader, length)
        assert offloader.pool.reserved_bytes == plan.host_bytes
    with pytest.raises(HostMemoryError, match="checked before the run"):
        _step(offloader, max(LENGTHS) + 1)
    assert offloader.pool.reserved_bytes == plan.host_bytes


# ---------------------------------------------------------------------------------------------
# offload is a pure move: fp64 CPU, bitwise
# ---------------------------------------------------------------------------------------------


def _model():
    train = load_train()
    args = train.parse_args(TINY + ["--n-layers", str(N_LAYERS), "--seq-len", "24"])
    model = train.build_model(args).double()
    from ds_mamba_spcp.config import MambaSequenceParallelConfig
    from ds_mamba_spcp.module import wrap_mamba2_mixers

    wrap_mamba2_mixers(model, None, MambaSequenceParallelConfig(enabled=True, sequence_parallel_size=1))
    batch = train.synthetic_batch(2, args.seq_len, args.vocab_size, seed=3)
    return model, batch


def _loss_and_grads(model, batch, checkpoint, autocast=False):
    """One forward and backward; with ``autocast`` the forward (only) under CPU bf16 autocast, as accelerate
    and the Trainer run it."""
    model.checkpoint = checkpoint
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(batch["input_ids"])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _torch_checkpoint(block, *inputs):
    return torch.utils.checkpoint.checkpoint(block, *inputs, use_reentrant=False)


@pytest.fixture(scope="module")
def reference():
    model, batch = _model()
    plain = _loss_and_grads(model, batch, None)
    return model, batch, plain


def _same(a, b) -> list[str]:
    """Names that differ (the loss as "loss"): empty when bitwise equal."""
    bad = [] if torch.equal(a[0], b[0]) else ["loss"]
    return bad + [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]


@pytest.mark.parametrize("kept", [0, 1, N_LAYERS])
def test_offload_is_bitwise_a_move(reference, kept):
    model, batch, plain = reference
    each = batch["input_ids"].numel() * model.embedding.embedding_dim * 8  # fp64
    assert _same(_loss_and_grads(model, batch, _torch_checkpoint), plain) == []
    offloader = CheckpointOffloader(gpu_budget_bytes=kept * each)
    for step in range(2):  # the second step reuses the pool's slots
        got = _loss_and_grads(model, batch, OffloadedCheckpoint(offloader))
        assert _same(got, plain) == [], f"step {step}: offload changed {_same(got, plain)}"
    plan = plan_offload([each] * N_LAYERS, kept * each)
    # the path really ran, and as planned: the host held exactly the plan's bytes, reused on step 2
    assert offloader.stats["offloaded"] == 2 * len(plan.on_host) and offloader.stats["kept"] == 2 * kept
    assert offloader.pool.reserved_bytes == offloader.pool.peak_in_use_bytes == plan.host_bytes
    assert offloader.pool.in_use_bytes == 0
    assert offloader.stats["prefetched"] == 2 * len(plan.on_host)


def test_recompute_under_the_forwards_autocast():
    """fp32 weights, the forward under CPU bf16 autocast, the backward outside it: the recompute must run under
    the forward's autocast (before the fix it ran in fp32: the gradients of another function, seen 2.1e-2
    relative at worst). Bitwise: bf16 on CPU is deterministic and the recompute runs the forward's kernels on
    the forward's inputs; torch's checkpoint is bitwise the plain autocast graph (asserted)."""
    model, batch = _model()
    model.float()
    plain = _loss_and_grads(model, batch, None, autocast=True)
    assert _same(_loss_and_grads(model, batch, _torch_checkpoint, autocast=True), plain) == []
    got = _loss_and_grads(model, batch, OffloadedCheckpoint(CheckpointOffloader(0)), autocast=True)
    worst = max(((got[1][n] - plain[1][n]).norm() / plain[1][n].norm()).item() for n in plain[1])
    assert _same(got, plain) == [], f"the recompute left the forward's autocast: {worst:.2e} relative at worst"


def test_recompute_replays_the_forwards_draws():
    """A block with dropout: the recompute draws what the forward drew (bitwise torch's checkpoint, the same
    ops), and the caller's generator ends where torch's leaves it."""
    torch.manual_seed(0)
    lin, drop = torch.nn.Linear(8, 8).double(), torch.nn.Dropout(0.5)
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def grads(checkpoint):
        torch.manual_seed(1)
        h = x.clone().requires_grad_()
        out = checkpoint(lambda h: torch.tanh(drop(lin(h))), h)
        out = checkpoint(lambda h: torch.tanh(drop(lin(h))), out)
        out.square().sum().backward()
        got = [h.grad, lin.weight.grad.clone()]
        lin.weight.grad = None
        return got, torch.get_rng_state()

    (ref, ref_rng), (got, rng) = grads(_torch_checkpoint), grads(OffloadedCheckpoint(CheckpointOffloader(0)))
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and torch.equal(rng, ref_rng)


def test_reserved_pool_is_used_as_planned(reference):
    model, batch, plain = reference
    each = batch["input_ids"].numel() * model.embedding.embedding_dim * 8
    plan = plan_offload([each] * N_LAYERS, 0)
    offloader = CheckpointOffloader(0, host_limit_bytes=plan.host_bytes)
    offloader.reserve(plan, pin=False)  # what train.py does before the first step
    assert offloader.pool.reserved_bytes == plan.host_bytes and offloader.pool.in_use_bytes == 0
    got = _loss_and_grads(model, batch, OffloadedCheckpoint(offloader))
    assert _same(got, plain) == [] and offloader.pool.reserved_bytes == plan.host_bytes  # nothing allocated later
    with pytest.raises(HostMemoryError, match="checked before the run"):
        offloader.pool.acquire(each + 1)  # past the checked bytes: refused, not allocated


def test_negative_control_a_shared_slot_is_caught(reference, monkeypatch):
    model, batch, plain = reference
    shared = {}

    def one_slot(self, nbytes):  # every checkpoint into the same buffer
        return shared.setdefault(nbytes, torch.empty(nbytes, dtype=torch.uint8))

    monkeypatch.setattr(PinnedPool, "acquire", one_slot)
    monkeypatch.setattr(PinnedPool, "release", lambda self, buf: None)
    got = _loss_and_grads(model, batch, OffloadedCheckpoint(CheckpointOffloader(0)))
    assert torch.equal(got[0], plain[0])  # the forward never reads a checkpoint back
    assert _same(got, plain), "a shared slot went unnoticed: the bitwise check is too weak"


def _modified_input(where: str, budget: int) -> str:
    """Two checkpointed blocks (a tanh(Linear) each, fp64); the first one's input modified in place after its
    forward: ``after_save`` before the second save (while the first checkpoint is kept, or pending its
    deferred device-to-host copy), ``after_copy`` after it. Returns the error backward raised."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).double()
    ck = OffloadedCheckpoint(CheckpointOffloader(budget))
    h = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True) * 1.0

    def fn(x):
        return torch.tanh(lin(x))

    out = ck(fn, h)
    if where == "after_save":
        h.mul_(3)
    out = ck(fn, out)
    if where == "after_copy":
        h.mul_(3)
    with pytest.raises(RuntimeError) as e:
        out.sum().backward()
    return str(e.value)


@pytest.mark.parametrize("where,budget", [("after_save", 2**30), ("after_save", 0), ("after_copy", 0)])
def test_a_modified_input_raises(where, budget):
    """An input modified in place between forward and backward would be recomputed from the modified values
    (before the fix: silently, a weight gradient 1.05 off); torch's checkpoint raises, so does this one, naming
    the checkpoint: kept on the device, pending its deferred copy to the host when modified (the copy would
    take the modified values), and modified after that copy."""
    message = _modified_input(where, budget)
    assert "modified by an inplace operation" in message and "block checkpoint 0 " in message, message


def test_a_dropped_graph_gives_its_slots_back(reference):
    model, batch, plain = reference
    offloader = CheckpointOffloader(0)
    model.checkpoint = OffloadedCheckpoint(offloader)
    logits = model(batch["input_ids"])
    assert offloader.pool.in_use_bytes > 0
    del logits
    gc.collect()
    assert offloader.pool.in_use_bytes == 0
    got = _loss_and_grads(model, batch, OffloadedCheckpoint(offloader))  # a new pass, from index 0
    assert _same(got, plain) == []
