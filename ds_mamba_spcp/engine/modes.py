"""The table of modes: every (mode, load_balancing) the op runs, and every rule that combines them.

The ds_config, the op's call check, the dispatcher, the strategies and the traffic model ask this table; no
other module compares mode or load-balancing names. Adding a mode is one entry here and, if needed, one
strategy (docs/design.md, "Layouts and modes"). Errors are one text per rule, naming the key, the value and
the fix, the same from the ds_config and the op.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_mamba_spcp.engine.layout import LAYOUTS

STATE_PASSING, ULYSSES = "state_passing", "ulysses"
NONE, VIRTUAL, PERMUTE_P2P, PERMUTE_A2A = "none", "virtual", "permute_p2p", "permute_a2a"
CONTIGUOUS, ZIGZAG = LAYOUTS

MODES = (STATE_PASSING, ULYSSES)
LOAD_BALANCING = (NONE, PERMUTE_P2P, PERMUTE_A2A, VIRTUAL)


@dataclass(frozen=True)
class Entry:
    """One way to run the mixer core over a sequence-parallel group. layouts: the input layouts it takes (the
    first is the default); strategy: the module that runs it (``dispatch.STRATEGIES``); chain: the layout of the
    state-passing chain's causal segments (None for ulysses); move: "p2p" / "a2a" when zigzag input moves to
    contiguous shards and back around the strategy (``permute.py``)."""

    mode: str
    load_balancing: str
    layouts: tuple[str, ...]
    strategy: str
    chain: str | None = None
    move: str | None = None
    about: str = ""

    @property
    def segments_per_rank(self) -> int:
        """Causal segments a rank holds in the chain (what the halo and summary exchanges carry per row)."""
        return 2 if self.chain == ZIGZAG else 1


TABLE = {
    (STATE_PASSING, NONE): Entry(
        STATE_PASSING, NONE, (CONTIGUOUS,), STATE_PASSING, chain=CONTIGUOUS,
        about="contiguous shards, one causal segment per rank; only the halo and the state summary move",
    ),
    (STATE_PASSING, VIRTUAL): Entry(
        STATE_PASSING, VIRTUAL, (ZIGZAG,), STATE_PASSING, chain=ZIGZAG,
        about="zigzag shards as two causal segments packed on the batch axis; no activation moves",
    ),
    (STATE_PASSING, PERMUTE_P2P): Entry(
        STATE_PASSING, PERMUTE_P2P, (ZIGZAG,), STATE_PASSING, chain=CONTIGUOUS, move="p2p",
        about="zigzag shards moved to contiguous and back by point-to-point messages around the 'none' chain",
    ),
    (STATE_PASSING, PERMUTE_A2A): Entry(
        STATE_PASSING, PERMUTE_A2A, (ZIGZAG,), STATE_PASSING, chain=CONTIGUOUS, move="a2a",
        about="zigzag shards moved to contiguous and back by one all-to-all around the 'none' chain",
    ),
    (ULYSSES, NONE): Entry(
        ULYSSES, NONE, (CONTIGUOUS, ZIGZAG), ULYSSES,
        about="all-to-all from sequence shards to head shards, the full-length scan, and back",
    ),
}  # fmt: skip


def default_layout(mode: str, load_balancing: str) -> str:
    """The input layout an entry takes by default (contiguous for an unknown pair: its check names it)."""
    entry = TABLE.get((mode, load_balancing))
    return CONTIGUOUS if entry is None else entry.layouts[0]


def entry(mode: str, load_balancing: str = NONE, input_layout: str | None = None, *, recompute_output=False,
          overlap_comm=True) -> Entry:  # fmt: skip
    """The table's entry for these options; raises ValueError (key, value, fix) for a combination it lacks."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if load_balancing not in LOAD_BALANCING:
        raise ValueError(f"load_balancing must be one of {LOAD_BALANCING}, got {load_balancing!r}")
    if input_layout is not None and input_layout not in LAYOUTS:
        raise ValueError(f"input_layout must be one of {LAYOUTS}, got {input_layout!r}")
    found = TABLE.get((mode, load_balancing))
    if found is None:  # only ulysses lacks load-balancing entries
        raise ValueError(
            f'mode "{mode}" does not take load_balancing "{load_balancing}": its all-to-all already gives every rank '
            f'the full sequence; set load_balancing to "none" (any input_layout works) or use mode "{STATE_PASSING}".'
        )
    if found.strategy == ULYSSES and recompute_output:
        raise ValueError(
            f'mode "{mode}" cannot honour "recompute_output": true: it runs mamba-ssm\'s own op, which keeps the '
            f'pre-gate output for backward; set it to false, or use mode "{STATE_PASSING}".'
        )
    if found.strategy == ULYSSES and not overlap_comm:
        raise ValueError(
            f'mode "{mode}" has nothing for "overlap_comm" to overlap (its two all-to-alls are on the critical '
            f'path); leave it at true, or use mode "{STATE_PASSING}".'
        )
    if input_layout is not None and input_layout not in found.layouts:
        if load_balancing == NONE:
            raise ValueError(
                f'load_balancing "{NONE}" with input_layout "{input_layout}" would chain the segments out of causal '
                f'order; set input_layout to "{CONTIGUOUS}", or keep "{ZIGZAG}" and choose load_balancing '
                f'"{VIRTUAL}", "{PERMUTE_P2P}" or "{PERMUTE_A2A}".'
            )
        raise ValueError(
            f'load_balancing "{load_balancing}" expects input_layout "{found.layouts[0]}" but got "{input_layout}"; '
            f'set input_layout to "{found.layouts[0]}" (and shard the data that way), or use load_balancing '
            f'"{NONE}" for contiguous input.'
        )
    return found


def check_shapes(found: Entry, *, nheads: int, ngroups: int, cp: int, local_seqlen: int | None = None,
                 input_layout: str = CONTIGUOUS, d_conv: int = 1) -> None:  # fmt: skip
    """The rules of an entry that need the model's sizes and the group size ``cp`` (and, for a call, its
    local seqlen); raises ValueError naming the sizes and the fix. Nothing to check for a group of one."""
    if cp == 1:
        return
    if found.strategy == ULYSSES:
        if nheads % cp:
            raise ValueError(
                f'mode "{ULYSSES}" shards heads over the cp={cp} ranks of the sequence-parallel group, but nheads='
                f"{nheads} is not divisible by cp={cp}; use a group size that divides nheads, or mode "
                f'"{STATE_PASSING}".'
            )
        if ngroups % cp and cp % ngroups:
            raise ValueError(
                f'mode "{ULYSSES}" shards the B/C groups (or replicates each group on the ranks of its heads), which '
                f"needs ngroups={ngroups} and cp={cp} to divide one another; change one of them, or use mode "
                f'"{STATE_PASSING}".'
            )
    if local_seqlen is None:
        return
    if (input_layout == ZIGZAG or found.chain == ZIGZAG) and local_seqlen % 2:
        raise ValueError(
            f'input_layout "{ZIGZAG}" (load_balancing "{found.load_balancing}") needs an even local seqlen (two '
            f"zigzag chunks of equal length; the global seqlen must be a multiple of 2*cp = {2 * cp}), got local "
            f"seqlen {local_seqlen}"
        )
    if found.chain is None:
        return
    seg_len = local_seqlen // found.segments_per_rank
    if seg_len < max(d_conv - 1, 1):
        raise ValueError(
            f"each causal segment must hold at least d_conv-1 = {d_conv - 1} tokens (and at least 1) so that its "
            f"conv halo comes from the previous segment alone; got {seg_len} tokens per segment (local seqlen "
            f"{local_seqlen}, {found.segments_per_rank} segment(s) per rank). Use fewer ranks or longer sequences."
        )


def ulysses_heads(nheads: int, ngroups: int, cp: int) -> tuple[int, int, int]:
    """(heads per rank, groups per rank, ranks sharing each group) of the ulysses entry (checked sizes)."""
    if ngroups % cp == 0:
        return nheads // cp, ngroups // cp, 1
    return nheads // cp, 1, cp // ngroups
