"""What a Mamba2 layer costs in communication, from the sizes alone: bytes each rank sends per layer (forward +
backward) by entry of the table of modes, and the summary exchange's cost model (``summary_exchange``).

Collectives are counted as ring algorithms do: an all-gather of a p-byte piece sends (cp-1)*p
bytes per rank; an all-to-all of a b-byte buffer sends (cp-1)/cp*b. The scan's messages are counted from its
schedule (``exchange.rounds``).

The cost model of the summary exchange is the alpha-beta model: a message of m bytes over a link costs
``latency + m / bandwidth``; a ring all-gather over cp ranks costs cp - 1 of them (each rank forwards cp - 1
pieces); the scan costs one message per round, ceil(log2 nseg) rounds, plus a small kernel per round to compose
(reading and writing a few summaries at HBM speed). What it leaves out: NCCL pipelines a ring's steps (its
all-gather pays less than cp - 1 full latencies), the all-gather overlaps the whole of the local C·Bᵀ while the
scan overlaps its first round only, and contention between concurrent messages. It ranks the methods; it does not
predict milliseconds (docs/design.md, "Past one node").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_mamba_spcp.engine import exchange, layout, modes


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_bytes(entry: modes.Entry, *, batch, local_seqlen, nheads, headdim, ngroups, dstate, d_conv, cp, dtype,
                return_final_states=False, summary_exchange=exchange.ALLGATHER) -> int:  # fmt: skip
    """What ``entry`` sends per rank and layer. State passing: the halo all-gather and its gradient (input
    dtype), the summary and state-gradient all-gathers (fp32), independent of ``local_seqlen`` unless the
    entry moves activations (``entry.move``). Ulysses: the all-to-all of z, xBC, dt there (B and C replicated
    when cp > ngroups) and of y back, forward and backward."""
    item = _itemsize(dtype)
    if entry.strategy == modes.ULYSSES:
        bc = 2 * dstate * max(ngroups, cp)
        there = batch * local_seqlen * (2 * nheads * headdim + bc + nheads)
        back = batch * local_seqlen * nheads * headdim
        return int(2 * (there + back) * item * (cp - 1) // cp)
    nlocal = entry.segments_per_rank
    conv_dim = nheads * headdim + 2 * ngroups * dstate
    halo = nlocal * batch * (d_conv - 1) * conv_dim * item
    state = nlocal * batch * nheads * headdim * dstate * 4
    summary = state + nlocal * batch * nheads * 4
    grad = state * (2 if return_final_states else 1)
    total = (cp - 1) * (2 * halo + summary + grad)
    if summary_exchange == exchange.SCAN:  # the scan's messages instead of the summary and gradient all-gathers
        one = batch * nheads * (headdim * dstate + 1) * 4
        sent = max(summaries_sent(cp, entry.chain, exchange.SCAN).values())
        total = (cp - 1) * 2 * halo + 2 * sent * one
        if return_final_states:  # the final state broadcast and its gradient's all-reduce (ring: 2 (cp-1)/cp)
            total += one * (cp - 1) // cp + 2 * state * (cp - 1) // (cp * nlocal)
    if entry.move is not None:
        # zigzag -> contiguous and back, forward and backward, of the in_proj output and the output
        d_in_proj = 2 * nheads * headdim + 2 * ngroups * dstate + nheads
        moved = batch * local_seqlen * (d_in_proj + nheads * headdim) * item
        total += 2 * moved * (cp - 1) // cp
    return int(total)


def state_passing_bytes(*, load_balancing=modes.NONE, d_conv, return_final_states=False, **sizes) -> int:
    """``layer_bytes`` of the state-passing entry with this load balancing (sizes as ``layer_bytes``)."""
    entry = modes.entry(modes.STATE_PASSING, load_balancing)
    return layer_bytes(entry, d_conv=d_conv, return_final_states=return_final_states, **sizes)


def ulysses_bytes(**sizes) -> int:
    """``layer_bytes`` of the ulysses entry (sizes as ``layer_bytes``, without d_conv)."""
    return layer_bytes(modes.entry(modes.ULYSSES), d_conv=1, **sizes)


# ---------------------------------------------------------------------------------------------
# the summary exchange: who sends what, and what it costs
# ---------------------------------------------------------------------------------------------


def summaries_sent(cp: int, chain: str, method: str, reverse: bool = False) -> dict[int, int]:
    """Summaries each group rank sends per layer and direction: ``exchange.summaries_moved``'s first half."""
    return exchange.summaries_moved(cp, chain, method, reverse)[0]


@dataclass(frozen=True)
class Link:
    """One hop's cost: ``latency`` seconds per message, ``bandwidth`` bytes per second per GPU and direction."""

    name: str
    bandwidth: float
    latency: float


NVLINK = Link("one NVLink node", 450e9, 7.5e-6)  # H100/H200 NVSwitch: ~450 GB/s per GPU, ~5-10 us per message
INFINIBAND = Link("InfiniBand", 50e9, 15e-6)  # 400 Gb/s per GPU, ~10-20 us per message
HBM_BANDWIDTH = 4.0e12  # bytes/s: the composition's reads and writes on an H200
KERNEL = 5e-6  # seconds: one small kernel's launch and tail
GPUS_PER_NODE = 8  # auto's assumption: a group of more ranks spans nodes, its messages cross InfiniBand


def summary_bytes(*, batch: int, nheads: int, headdim: int, dstate: int) -> int:
    """One segment's summary: its state (batch, nheads, headdim, dstate) and decays (batch, nheads), fp32."""
    return batch * nheads * (headdim * dstate + 1) * 4


def delta_summary_bytes(*, batch: int, nheads: int, k_dim: int, v_dim: int) -> int:
    """One segment's summary of the gated delta rule: U (batch, nheads, K, V) and M (batch, nheads, K, K), fp32."""
    return batch * nheads * k_dim * (k_dim + v_dim) * 4


def exchange_cost(method: str, *, cp: int, summary: int, chain: str = modes.CONTIGUOUS, link: Link = NVLINK) -> dict:
    """The summary exchange of one layer and direction for one rank (the busiest), by the model in the module
    docstring: messages (sent one after the other), summaries received and sent, its time on ``link`` (seconds)
    and the local work (the all-gather's scan of every segment, or the scan's compositions)."""
    nlocal = len(layout.segment_ids(0, cp, chain))
    nseg = cp * nlocal
    if method == exchange.ALLGATHER:
        messages, piece = cp - 1, nlocal * summary
        sent = received = messages * nlocal
        work = 4 * KERNEL + (nseg + nseg * nlocal) * summary / HBM_BANDWIDTH  # weights, then one pass over them
    elif method == exchange.SCAN:
        messages, piece = exchange.rounds_needed(nseg), nlocal * summary
        sent = max(summaries_sent(cp, chain, exchange.SCAN).values())
        received = max(exchange.summaries_moved(cp, chain, exchange.SCAN)[1].values())
        work = messages * (KERNEL + 3 * nlocal * summary / HBM_BANDWIDTH)
    else:
        raise ValueError(f"method must be {exchange.ALLGATHER!r} or {exchange.SCAN!r}, got {method!r}")
    comm_s = messages * (link.latency + piece / link.bandwidth)
    return dict(method=method, cp=cp, nseg=nseg, messages=messages, summaries_sent=sent, summaries_received=received,
                bytes_received=received * summary, comm_s=comm_s, work_s=work, time_s=comm_s + work)  # fmt: skip


def layer_exchange_time(method: str, **kwargs) -> float:
    """A layer's forward and backward exchanges (the same cost each way), seconds."""
    return 2 * exchange_cost(method, **kwargs)["time_s"]


def choose_summary_exchange(*, cp: int, summary: int, chain: str = modes.CONTIGUOUS) -> tuple[str, str]:
    """What ``summary_exchange="auto"`` runs, and why (the same on every rank: sizes only). Inside one node
    (cp <= GPUS_PER_NODE) the all-gather: it is the path measured on GPUs (95% of the ideal at cp 2), and the
    model's edge for the scan there (tens of microseconds) is within what it leaves out (NCCL pipelines the ring,
    the all-gather overlaps the whole local C·Bᵀ). Past one node the cheaper of the two by the model on
    InfiniBand, which is the scan from cp 16 on at any summary size (docs/design.md, "Past one node")."""
    link = NVLINK if cp <= GPUS_PER_NODE else INFINIBAND
    ag = exchange_cost(exchange.ALLGATHER, cp=cp, summary=summary, chain=chain, link=link)["time_s"]
    sc = exchange_cost(exchange.SCAN, cp=cp, summary=summary, chain=chain, link=link)["time_s"]
    method = exchange.SCAN if cp > GPUS_PER_NODE and sc < ag else exchange.ALLGATHER
    rounds = exchange.rounds_needed(cp * len(layout.segment_ids(0, cp, chain)))
    why = (f"cp={cp}, {summary / 2**20:.2f} MiB per summary, {link.name}: modelled {ag * 1e6:.0f} us for the "
           f"all-gather, {sc * 1e6:.0f} us for the scan ({rounds} rounds)")  # fmt: skip
    return method, why


def node_crossings(cp: int, chain: str = modes.CONTIGUOUS, gpus_per_node: int = GPUS_PER_NODE,
                   reverse: bool = False) -> list[int]:  # fmt: skip
    """Per round of the scan, how many of its messages cross nodes when group rank r sits on node
    r // gpus_per_node (a group laid out node by node, as the launcher's ranks are). A round costs the slowest
    of its messages: one crossing puts it on InfiniBand."""
    nlocal = len(layout.segment_ids(0, cp, chain))
    nseg = cp * nlocal
    owner = {s: r for r in range(cp) for s in layout.segment_ids(r, cp, chain)}
    node = {p: owner[nseg - 1 - p if reverse else p] // gpus_per_node for p in range(nseg)}
    return [sum(node[src] != node[dst] for src, dst in messages) for messages in exchange.rounds(nseg)]
