"""User helpers of ds_mamba_spcp.data: sharding, gathering, the loss split and DeepSpeed's reduction.

The sharding is checked against DeepSpeed's own ``UlyssesSPDataLoaderAdapter`` (contiguous layout,
same keys and values) on 2 gloo ranks; the loss convention against a single-process
cross-entropy; and ``grad_scale_for_engine`` against what DeepSpeed 0.19's ZeRO stages really do to
the gradients of a sequence-parallel group (sum in stages 1-2, average in stage 3), measured with
an SGD step on a one-parameter model. All comparisons are exact (integer data, or fp64 sums of a
few terms) except the loss, which is a reassociated fp32 sum: 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_mamba_spcp.data import (
    IGNORE_INDEX,
    gather_batch,
    gather_sequence,
    grad_scale,
    sequence_parallel_cross_entropy,
    shard_batch,
    shift_labels,
)
from ds_mamba_spcp.engine.layout import shard_sequence
from tests.dist_utils import run_ranks

CP = 2


def _batch(seed: int, batch=2, seqlen=12, vocab=50) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch, seqlen), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seqlen).expand(batch, seqlen)}


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------


def test_shift_labels_pads_with_ignore_index():
    labels = torch.tensor([[1, 2, 3, 4]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, IGNORE_INDEX]]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_batch_shards_every_tensor_after_the_shift(layout):
    full = _batch(0)
    del full["position_ids"]
    full["note"] = "kept as is"
    shards = [shard_batch(full, rank=r, world_size=CP, layout=layout) for r in range(CP)]
    shifted = shift_labels(full["labels"])
    for r, shard in enumerate(shards):
        assert set(shard) == {"input_ids", "shift_labels", "position_ids", "note"}
        assert shard["note"] == "kept as is"
        assert torch.equal(shard["input_ids"], shard_sequence(full["input_ids"], r, CP, layout))
        # shifted before sharding: a shard's last target is the next shard's first token
        assert torch.equal(shard["shift_labels"], shard_sequence(shifted, r, CP, layout))
        positions = torch.arange(12).expand(2, 12)
        assert torch.equal(shard["position_ids"], shard_sequence(positions, r, CP, layout))
    assert shards[0]["shift_labels"][0, 2].item() == full["input_ids"][0, 3].item()
    assert "labels" not in full or torch.equal(full["labels"], full["input_ids"])  # the input is not modified


def test_shard_batch_of_a_tensor_and_a_group_of_one():
    x = torch.arange(24).reshape(2, 12)
    assert torch.equal(shard_batch(x, rank=1, world_size=3), x[:, 4:8])
    assert torch.equal(shard_batch(x), x)  # no distributed backend: a group of one
    assert torch.equal(gather_sequence(x), x)


def test_shard_batch_rejections():
    full = _batch(0)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_batch({"input_ids": full["input_ids"][:, :10]}, rank=0, world_size=CP, layout="zigzag")
    with pytest.raises(ValueError, match="'mask' has shape"):
        shard_batch({**full, "mask": torch.ones(2, 5)}, rank=0, world_size=CP)
    with pytest.raises(ValueError, match="both 'labels' and 'shift_labels'"):
        shard_batch({**full, "shift_labels": full["labels"]}, rank=0, world_size=CP)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_batch(full, rank=0, world_size=CP, layout="striped")
    with pytest.raises(ValueError, match="both rank and world_size"):
        shard_batch(full, rank=0)
    with pytest.raises(ValueError, match="outside a group"):
        shard_batch(full, rank=2, world_size=CP)


def test_grad_scale_by_zero_stage():
    assert [grad_scale(stage, 2) for stage in (0, 1, 2)] == [1.0, 1.0, 1.0]
    assert grad_scale(3, 2) == 2.0 and grad_scale(3, 4) == 4.0
    assert grad_scale(3, 1) == 1.0
    with pytest.raises(ValueError, match="reduce_scatter"):
        grad_scale(3, 2, reduce_scatter=False)
    with pytest.raises(ValueError, match="zero_stage"):
        grad_scale(4, 2)


def test_cross_entropy_of_a_group_of_one_is_the_mean():
    logits = torch.randn(2, 6, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(1))
    labels[0, -1] = IGNORE_INDEX
    loss, mean = sequence_parallel_cross_entropy(logits, labels)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(mean, expected)
    with pytest.raises(ValueError, match="disagree"):
        sequence_parallel_cross_entropy(logits, labels[:, :-1])


# ---------------------------------------------------------------------------------------------
# 2 gloo ranks: DeepSpeed's adapter, gathering, the loss split, DeepSpeed's gradient reduction
# ---------------------------------------------------------------------------------------------


def _adapter_and_helpers(rank, world):
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    out = {}
    # The adapter gathers one batch from each rank's loader and hands rank r shard r of batch j at
    # iteration j; every rank here can rebuild every rank's batch from its seed.
    loader = [_batch(seed=100 + rank)]
    adapter = UlyssesSPDataLoaderAdapter(loader, rank, dist.get_world_group(), world, torch.device("cpu"))
    mismatches = []
    for j in range(world):
        theirs = next(adapter)
        ours = shard_batch(_batch(seed=100 + j), rank=rank, world_size=world)
        if list(theirs) != list(ours):
            mismatches.append(f"batch {j}: keys {list(theirs)} vs {list(ours)}")
            continue
        mismatches += [f"batch {j}: {k}" for k in ours if not torch.equal(theirs[k], ours[k])]
    out["adapter_mismatches"] = mismatches

    # gather_sequence / gather_batch undo shard_batch in both layouts
    full = _batch(seed=7, seqlen=16)
    for layout in ("contiguous", "zigzag"):
        shard = shard_batch(full, None, layout=layout)
        back = gather_batch(shard, None, layout=layout)
        out[f"gather_{layout}"] = torch.equal(back["input_ids"], full["input_ids"]) and torch.equal(
            back["shift_labels"], shift_labels(full["labels"])
        )

    # the loss split: shares add up to the global mean, the logged mean is the global mean, and the
    # gradient of every shard's logits is the full-sequence gradient restricted to the shard
    g = torch.Generator().manual_seed(3)
    logits_full = torch.randn(2, 16, 9, generator=g, dtype=torch.float64)
    labels_full = torch.randint(9, (2, 16), generator=g)
    labels_full[1, 3] = IGNORE_INDEX
    ref = F.cross_entropy(logits_full.flatten(0, 1), labels_full.flatten(), ignore_index=IGNORE_INDEX)
    logits = shard_batch(logits_full, None).clone().requires_grad_(True)
    loss, mean = sequence_parallel_cross_entropy(logits, shard_batch(labels_full, None), None, grad_scale=1.0)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    full_logits = logits_full.clone().requires_grad_(True)
    F.cross_entropy(full_logits.flatten(0, 1), labels_full.flatten(), ignore_index=IGNORE_INDEX).backward()
    out["loss_sum_err"] = abs(total.item() - ref.item()) / ref.item()
    out["mean_err"] = abs(mean.item() - ref.item()) / ref.item()
    out["grad_equal"] = torch.allclose(logits.grad, shard_batch(full_logits.grad, None), rtol=1e-12, atol=0)
    return out


def test_helpers_on_two_ranks_match_deepspeeds_adapter():
    results = run_ranks(_adapter_and_helpers, CP, timeout=300)
    for rank, res in enumerate(results):
        assert res["adapter_mismatches"] == [], f"rank {rank}: {res['adapter_mismatches']}"
        assert res["gather_contiguous"] and res["gather_zigzag"], f"rank {rank}: gather did not invert shard"
        assert res["loss_sum_err"] < 1e-12 and res["mean_err"] < 1e-12, res
        assert res["grad_equal"], f"rank {rank}: shard logits gradient differs from the full one"


def _zero_reduction(rank, world, stages):
    """One SGD step (lr 1) on a parameter w = 0 whose local gradient is (rank + 1) on rank ``rank``:
    the update is minus DeepSpeed's reduced gradient. Returns per stage (reduced, grad_scale_for_engine)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from ds_mamba_spcp.data import grad_scale_for_engine

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
        parallel_state_sp.initialize_sequence_parallel(world)
    out = {}
    for stage in stages:
        model = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, mpu=parallel_state_sp
        )
        loss = engine(torch.ones(1, 4)).sum() * (rank + 1)
        engine.backward(loss)
        engine.step()
        if stage == 3:
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                w = engine.module.weight.detach().clone()
        else:
            w = engine.module.weight.detach().clone()
        out[stage] = (-w.flatten()[0].item(), grad_scale_for_engine(engine))
    return out


def test_grad_scale_matches_deepspeeds_reduction_over_the_sequence_group():
    """The trap this package's loss convention exists for: with local gradients 1 and 2 on the two
    ranks of one sequence-parallel group, ZeRO 1-2 apply their sum (3) and ZeRO 3 their mean (1.5);
    scaling the loss by grad_scale_for_engine makes both the sum."""
    stages = (1, 2, 3)
    results = run_ranks(_zero_reduction, CP, stages, timeout=300)
    for stage in stages:
        reduced, scale = results[0][stage]
        assert results[1][stage] == results[0][stage], f"ranks disagree at stage {stage}: {results}"
        expected = 3.0 if stage < 3 else 1.5
        assert reduced == pytest.approx(expected, rel=1e-6), f"stage {stage}: DeepSpeed applied {reduced}"
        assert reduced * scale == pytest.approx(3.0, rel=1e-6), f"stage {stage}: grad scale {scale} does not fix it"


def test_seq_idx_from_position_ids_and_packed_shards():
    """Hugging Face's padding-free positions (restarting at 0 per document) give the document labels,
    and shard_batch shards them with the tokens, in both layouts."""
    from ds_mamba_spcp.data import seq_idx_from_position_ids, shard_batch

    lengths = [[3, 1, 6, 2], [12]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels = seq_idx_from_position_ids(pos)
    assert labels.dtype == torch.int32
    assert labels.tolist() == [[0] * 3 + [1] + [2] * 6 + [3] * 2, [0] * 12]
    # a row that begins in the middle of a document is labelled from 0 all the same
    assert seq_idx_from_position_ids(torch.tensor([[5, 6, 0, 1]])).tolist() == [[0, 0, 1, 1]]
    ids = torch.arange(24).reshape(2, 12)
    for layout_ in ("contiguous", "zigzag"):
        shards = [shard_batch({"input_ids": ids, "position_ids": pos}, rank=r, world_size=2, layout=layout_)
                  for r in range(2)]  # fmt: skip
        for r, shard in enumerate(shards):
            assert torch.equal(shard["seq_idx"], shard_sequence(labels, r, 2, layout_))
            assert torch.equal(shard["input_ids"], shard_sequence(ids, r, 2, layout_))
    # unpacked rows get no labels; labels given with the batch are sharded as they are
    plain = shard_batch({"input_ids": ids}, rank=0, world_size=2)
    assert "seq_idx" not in plain
    given = shard_batch({"input_ids": ids, "seq_idx": labels + 7}, rank=1, world_size=2)
    assert torch.equal(given["seq_idx"], labels[:, 6:] + 7)


def test_tiled_cross_entropy_equals_the_full_one():
    """The tiled loss (logits never whole) gives the full loss, its gradient for the hidden states and for the
    head's weights, in fp64 (the sum is only reordered: 1e-12), with ignored labels and a partial last tile."""
    from ds_mamba_spcp.data import sequence_parallel_cross_entropy, sequence_parallel_tiled_cross_entropy

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 11, dtype=torch.float64)
    hidden = torch.randn(2, 13, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(11, (2, 13), generator=g)
    labels[0, 3] = labels[1, -1] = -100
    results = []
    for tiled in (False, True):
        head.zero_grad()
        hidden.grad = None
        if tiled:
            loss, mean = sequence_parallel_tiled_cross_entropy(hidden, head, labels, grad_scale=3.0, tile_tokens=5)
        else:
            loss, mean = sequence_parallel_cross_entropy(head(hidden), labels, grad_scale=3.0)
        loss.backward()
        results.append((loss.detach(), mean, hidden.grad.clone(), head.weight.grad.clone()))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
