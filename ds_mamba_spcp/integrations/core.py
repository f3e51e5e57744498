"""The adapter core both adapters share: a host mixer's projections around the sharded mixer core.

    hidden (batch, local_seqlen, d_model) --in_proj--> zxbcdt --the sharded core--> y --out_proj--> out

An adapter (``mamba_ssm/mixer.py``, ``transformers/adapter.py``) reads its host's parameters into a ``MixerCore``
at every forward and calls ``mixer_forward`` with its own in_proj and out_proj; this module imports neither.
The projections ride in the ``MixerCall`` to ``engine.dispatch.run``, so that a layout move moves hidden rather
than the wider zxbcdt. See docs/design.md, "Adapters".
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ds_mamba_spcp.config import SECTION, MambaSequenceParallelConfig
from ds_mamba_spcp.engine import dispatch
from ds_mamba_spcp.engine.call import MixerCore, Projections, prepare

__all__ = ["SHARDED_ATTR", "MixerCore", "is_sharded", "loaded_classes", "mixer_forward"]

# set on every mixer an adapter made sequence-parallel: one adapter sees another's without importing it
SHARDED_ATTR = "_ds_mamba_spcp_sharded"


def is_sharded(module) -> bool:
    """Whether ``module`` is a mixer an adapter made sequence-parallel (either adapter's)."""
    return bool(getattr(module, SHARDED_ATTR, False))


def mixer_forward(
    hidden: torch.Tensor,
    in_proj: Callable[[torch.Tensor], torch.Tensor],
    out_proj: Callable[[torch.Tensor], torch.Tensor],
    core: MixerCore,
    config: MambaSequenceParallelConfig,
    group,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    d_model: int | None = None,
) -> torch.Tensor:
    """in_proj -> the sequence-parallel mixer core chosen by ``config`` -> out_proj, on this rank's shard.

    hidden: (batch, local_seqlen, d_model), this rank's shard in ``config.input_layout``; in_proj maps it to
    zxbcdt (batch, local_seqlen, 2*d_inner + 2*ngroups*dstate + nheads), out_proj maps the core's (batch,
    local_seqlen, d_inner) output back (host-specific scaling goes inside them). seq_idx (batch, local_seqlen)
    int32 labels, or cu_seqlens (batch 1), or neither. d_model: checked against hidden's last dim when given.
    Returns this rank's shard of the output, in the same layout; validated on every rank before anything moves.
    """
    c = config
    problem = None
    if hidden.dim() != 3 or (d_model is not None and hidden.shape[-1] != d_model):
        problem = ValueError(
            f"the mixer expects hidden states (batch, local_seqlen, d_model={d_model}), got {tuple(hidden.shape)}"
        )
    shape = tuple(hidden.shape[:2]) if hidden.dim() == 3 else (1, 1)
    probe = torch.empty(*shape, core.d_in_proj, dtype=hidden.dtype, device="meta")  # in_proj's output, to come
    call = prepare(
        probe, core, process_group=group, options=c.options(), seq_idx=seq_idx, cu_seqlens=cu_seqlens,
        device=hidden.device, what=f"{SECTION} ({c.mode}, load_balancing {c.load_balancing})", problem=problem,
        projections=Projections(hidden, in_proj, out_proj),
    )  # fmt: skip
    return dispatch.run(call)


def loaded_classes(table: dict[str, str]) -> tuple[type, ...]:
    """The classes of ``table`` (class name -> its modeling module) whose module is loaded: a model that holds one
    has loaded it, and nothing here imports a modeling module."""
    found = []
    for name, module_name in table.items():
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)
