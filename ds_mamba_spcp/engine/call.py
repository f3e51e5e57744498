"""One call of the Mamba2 mixer core: its tensors, sizes and options in one object, checked alike on every rank.

Every entry point (the public ops, and the adapters through ``integrations.core.mixer_forward``) turns its
arguments into a ``MixerCall`` with ``prepare`` and hands it to ``dispatch.run``. The mixer's parameters and
static options travel as one ``MixerCore``, the run options as one ``Options``.

``prepare`` validates the call on each rank without raising, then (``check_shapes``) exchanges a fixed-size
descriptor of it on every call: shapes, dtypes, options, this rank's problem, and for packed rows the labels
at the shard borders. All ranks raise the same kind of error, or none does (one small all-gather per call).
Inside a CUDA-graph capture nothing is exchanged: the eager warm-up call before it was checked. See
docs/design.md, "Every rank decides alike".
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_mamba_spcp import comm
from ds_mamba_spcp.engine import exchange, layout, modes
from ds_mamba_spcp.ops import BACKENDS, get_backend
from ds_mamba_spcp.ops.segment import canonical_seq_idx
from ds_mamba_spcp.ops.spec import CoreSpec

_ERROR_CODES = {ValueError: 1, NotImplementedError: 2, TypeError: 3}
_ERRORS = {v: k for k, v in _ERROR_CODES.items()}


@dataclass(frozen=True)
class MixerCore:
    """The mixer core's parameters and static options: ``mamba_split_conv1d_scan_sp``'s arguments after
    ``zxbcdt``. The adapters read one off their host mixer at every forward (ZeRO-3 swaps parameters)."""

    conv1d_weight: torch.Tensor  # (conv_dim, d_conv)
    conv1d_bias: torch.Tensor | None  # (conv_dim,)
    dt_bias: torch.Tensor  # (nheads,)
    A: torch.Tensor  # (nheads,), negative: -exp(A_log)
    D: torch.Tensor  # (nheads,) or (nheads, headdim)
    chunk_size: int
    headdim: int | None = None  # None: read off D (or zxbcdt)
    ngroups: int = 1
    dt_limit: tuple = (0.0, float("inf"))
    activation: str | None = "silu"
    rmsnorm_weight: torch.Tensor | None = None  # (nheads*headdim,), or None for y * silu(z)
    rmsnorm_eps: float = 1e-6
    norm_before_gate: bool = False

    @property
    def d_in_proj(self) -> int:
        """Width of in_proj's output (z, xBC, dt): d_inner + conv_dim + nheads."""
        nheads = self.A.shape[0]
        return nheads * self.headdim + self.conv1d_weight.shape[0] + nheads

    def op_arguments(self) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of this core for the public ops (``op.mixer_core`` and the forward-only
        ``inference.forward.mixer_core_prefill``), after ``zxbcdt``."""
        args = (self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A, self.D, self.chunk_size)
        kwargs = dict(
            dt_limit=tuple(self.dt_limit), headdim=self.headdim, ngroups=self.ngroups, activation=self.activation,
            rmsnorm_weight=self.rmsnorm_weight, rmsnorm_eps=self.rmsnorm_eps, norm_before_gate=self.norm_before_gate,
        )  # fmt: skip
        return args, kwargs

    def spec(self, zxbcdt) -> CoreSpec:
        """The sizes of a call of this core on ``zxbcdt``; raises a sentence for any that do not fit."""
        return CoreSpec.infer(
            zxbcdt, self.conv1d_weight, self.D, self.chunk_size, headdim=self.headdim, ngroups=self.ngroups,
            dt_limit=self.dt_limit, activation=self.activation, rmsnorm_eps=self.rmsnorm_eps,
            norm_before_gate=self.norm_before_gate,
        )  # fmt: skip


@dataclass(frozen=True)
class Projections:
    """An adapter's projections around the core: ``zxbcdt = in_proj(hidden)``, ``out = out_proj(y)``. The call's
    ``zxbcdt`` is then a "meta" tensor of its shape until the dispatcher applies in_proj after any layout move
    (a permute moves the narrower hidden, not zxbcdt)."""

    hidden: torch.Tensor  # (batch, local_seqlen, d_model)
    in_proj: Callable[[torch.Tensor], torch.Tensor]
    out_proj: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MixerCall:
    """The tensors of one mixer-core call on this rank, with its sizes, options and group. zxbcdt: (batch,
    local_seqlen, d_in_proj), this rank's shard in ``options.input_layout``; seq_idx: (batch, local_seqlen) int32
    document labels as the caller numbered them, or None. cp: the group's size."""

    zxbcdt: torch.Tensor
    conv1d_weight: torch.Tensor
    conv1d_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    rmsnorm_weight: torch.Tensor | None
    initial_states: torch.Tensor | None
    seq_idx: torch.Tensor | None
    spec: CoreSpec
    options: Any  # config.Options: the section's op options and the call's own
    group: Any
    rank: int
    cp: int
    projections: Projections | None = None

    @property
    def params(self) -> tuple:
        """(conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight): the backends' order."""
        return (self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A, self.D, self.rmsnorm_weight)

    @property
    def entry(self) -> modes.Entry:
        return self.options.entry

    def replace(self, **changes) -> MixerCall:
        return dataclasses.replace(self, **changes)

    def with_options(self, **changes) -> MixerCall:
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **changes))

    @property
    def backend(self):
        return get_backend(self.options.backend, self.zxbcdt.device)

    def single_device(self):
        """The backend's single-device op on this call's zxbcdt with its options (seq_idx renumbered from 0
        per row: the kernels apply initial_states to label 0)."""
        kwargs = dict(
            initial_states=self.initial_states, return_final_states=self.options.return_final_states,
            dt_limit=self.spec.dt_limit, headdim=self.spec.headdim, ngroups=self.spec.ngroups,
            activation=self.spec.activation, rmsnorm_weight=self.rmsnorm_weight, rmsnorm_eps=self.spec.rmsnorm_eps,
            norm_before_gate=self.spec.norm_before_gate,
            seq_idx=None if self.seq_idx is None else canonical_seq_idx(self.seq_idx),
        )  # fmt: skip
        params = (self.conv1d_weight, self.conv1d_bias, self.dt_bias, self.A, self.D)
        return self.backend.single_device_op(self.zxbcdt, *params, self.spec.chunk_size, **kwargs)


# -- local validation: every problem is recorded, none raised before the ranks have compared notes --


def _check_options(options, spec: CoreSpec, cp: int, local_seqlen: int) -> None:
    entry = options.entry  # mode, load balancing, layout and the flags that go with them (modes.py)
    if options.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {options.backend!r}")
    if options.summary_exchange not in exchange.SUMMARY_EXCHANGES:
        raise ValueError(
            f"summary_exchange must be one of {exchange.SUMMARY_EXCHANGES}, got {options.summary_exchange!r}"
        )
    if options.summary_exchange == exchange.SCAN and entry.strategy != modes.STATE_PASSING:
        raise ValueError(
            f'summary_exchange="scan" with mode "{options.mode}": that mode exchanges no state summaries (it '
            'all-to-alls the tokens); use mode "state_passing" for the scan, or summary_exchange "auto".'
        )
    if options.tile_length is not None and (
        isinstance(options.tile_length, bool) or not isinstance(options.tile_length, int)
        or options.tile_length < max(spec.d_conv - 1, 1)
    ):  # fmt: skip
        raise ValueError(
            f"tile_length must be an int of at least d_conv-1 = {max(spec.d_conv - 1, 1)} tokens (a multiple of "
            f"chunk_size={spec.chunk_size} runs fastest), or None to tile only past the kernels' limit; got "
            f"{options.tile_length!r}"
        )
    modes.check_shapes(
        entry, nheads=spec.nheads, ngroups=spec.ngroups, cp=cp, local_seqlen=local_seqlen,
        input_layout=options.input_layout, d_conv=spec.d_conv,
    )  # fmt: skip
    if options.cuda_graphs and cp > 1:
        raise ValueError(
            f"cuda_graphs=True replays the op from CUDA graphs on one device only, but the sequence-parallel group "
            f"has {cp} ranks (its collectives are not captured); pass cuda_graphs=False (or set "
            '"mamba_sequence_parallel.cuda_graphs": false), or capture the whole training step yourself'
        )


def _check_params(zxbcdt, conv1d_bias, dt_bias, A, rmsnorm_weight, initial_states, spec: CoreSpec) -> None:
    if dt_bias is None:
        raise NotImplementedError("dt_bias=None is not supported; pass zeros for no bias")
    expect = {
        "conv1d_bias": (conv1d_bias, (spec.conv_dim,)),
        "dt_bias": (dt_bias, (spec.nheads,)),
        "A": (A, (spec.nheads,)),
        "rmsnorm_weight": (rmsnorm_weight, (spec.d_inner,)),
        "initial_states": (initial_states, (zxbcdt.shape[0], spec.nheads, spec.headdim, spec.dstate)),
    }
    for name, (t, shape) in expect.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _check_no_grad(zxbcdt, core: MixerCore, initial_states, projections) -> None:
    """forward_only records no graph: refuse it where a gradient is wanted (grad mode on and an input that
    requires grad), rather than return outputs that silently carry none."""
    if not torch.is_grad_enabled():
        return
    tensors = [zxbcdt, initial_states, core.conv1d_weight, core.conv1d_bias, core.dt_bias, core.A, core.D,
               core.rmsnorm_weight, None if projections is None else projections.hidden]  # fmt: skip
    wanting = [t for t in tensors if torch.is_tensor(t) and t.requires_grad]
    if wanting:
        raise ValueError(
            f"forward_only=True builds no autograd graph, but grad mode is on and {len(wanting)} input(s) require "
            "grad; call it under torch.no_grad() or torch.inference_mode() (inference), or leave forward_only False "
            "(training)"
        )


def _check_seq_idx(seq_idx, zxbcdt, device) -> torch.Tensor:
    """seq_idx's type, dtype and shape; int64 labels are narrowed to int32 (mamba-ssm's dtype)."""
    if not torch.is_tensor(seq_idx):
        raise TypeError(f"seq_idx must be a tensor (batch, local_seqlen) of int32, got {type(seq_idx).__name__}")
    if seq_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"seq_idx must hold integer document labels (int32, as mamba-ssm takes them), got {seq_idx.dtype}"
        )
    if tuple(seq_idx.shape) != tuple(zxbcdt.shape[:2]):
        raise ValueError(
            f"seq_idx must have shape (batch, local_seqlen) = {tuple(zxbcdt.shape[:2])} like zxbcdt, got "
            f"{tuple(seq_idx.shape)}"
        )
    if seq_idx.device != device:
        raise ValueError(f"seq_idx is on {seq_idx.device} but the activations are on {device}")
    return seq_idx.to(torch.int32).contiguous()


def cu_seqlens_to_seq_idx(cu_seqlens, zxbcdt, rank: int, cp: int, seq_layout: str, device) -> torch.Tensor:
    """This rank's shard of the document labels that ``cu_seqlens`` (of the whole row) describes."""
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens must be a 1-D integer tensor of cumulative document lengths (0, ..., seqlen)")
    batch, local_seqlen = zxbcdt.shape[:2]
    if batch != 1:
        raise ValueError(
            f"cu_seqlens describes one packed row (batch 1), got batch {batch}; pass seq_idx (batch, local_seqlen) "
            "for several rows"
        )
    cu = [int(v) for v in cu_seqlens.tolist()]
    total = local_seqlen * cp
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the global seqlen {total} (local seqlen {local_seqlen} x {cp} ranks) "
            f"without decreasing, got {cu if len(cu) <= 12 else cu[:6] + ['...'] + cu[-6:]}"
        )
    bounds = torch.tensor(cu[1:-1], dtype=torch.long, device=device)
    labels = torch.searchsorted(bounds, torch.arange(total, device=device), right=True)
    return layout.shard_sequence(labels[None].to(torch.int32), rank, cp, seq_layout).contiguous()


def _float_code(value) -> int:
    """A float (tuple) as an int that is equal on every rank for equal values (float hashes are not salted)."""
    return hash(value) & 0x3FFF_FFFF_FFFF


def _option_code(value) -> int:
    """An option's value as an int equal on every rank for equal values (strings by CRC-32: str hashes are salted)."""
    if value is None:
        return -1
    if isinstance(value, str):
        return zlib.crc32(value.encode()) & 0x3FFF_FFFF
    return int(value)


def _descriptor(zxbcdt, core: MixerCore, options, initial_states, seq_idx, cu_seqlens, problem):
    def dims(t, n):
        shape = list(t.shape)[:n] if t.dim() <= n else [-2] * n
        return shape + [-1] * (n - len(shape))

    cu_len = cu_last = cu_sum = -1
    if torch.is_tensor(cu_seqlens) and cu_seqlens.dim() == 1 and not cu_seqlens.dtype.is_floating_point:
        values = [int(v) for v in cu_seqlens.tolist()]
        cu_len, cu_last, cu_sum = len(values), values[-1] if values else -1, sum(values) & 0x3FFF_FFFF_FFFF
    fields = [
        ("problem", 0 if problem is None else _ERROR_CODES.get(type(problem), 1)),
        ("zxbcdt.dim", zxbcdt.dim()),
        *zip(("batch", "local_seqlen", "d_in_proj"), dims(zxbcdt, 3)),
        *zip(("conv_dim", "d_conv"), dims(core.conv1d_weight, 2)),
        ("D.dim", core.D.dim()),
        *zip(("D.shape0", "D.shape1"), dims(core.D, 2)),
        ("dtype", comm.DTYPE_CODES.get(zxbcdt.dtype, 99)),
        ("chunk_size", int(core.chunk_size)),
        ("headdim", -1 if core.headdim is None else int(core.headdim)),
        ("ngroups", int(core.ngroups)),
        ("initial_states", initial_states is not None),
        ("rmsnorm_weight", core.rmsnorm_weight is not None),
        ("conv1d_bias", core.conv1d_bias is not None),
        ("norm_before_gate", bool(core.norm_before_gate)),
        ("activation", {None: 0, "silu": 1, "swish": 2}.get(core.activation, 9)),
        ("dt_limit", _float_code(tuple(float(v) for v in core.dt_limit))),
        ("rmsnorm_eps", _float_code(float(core.rmsnorm_eps))),
        *((f.name, _option_code(getattr(options, f.name))) for f in dataclasses.fields(options)),
        ("seq_idx", seq_idx is not None),
        ("cu_seqlens", cu_seqlens is not None),
        ("cu_seqlens.len", cu_len),
        ("cu_seqlens.last", cu_last),
        ("cu_seqlens.sum", cu_sum),
    ]  # fmt: skip
    return [(name, int(value)) for name, value in fields]


# Up to this many (segment, batch row) pairs of labels ride in the descriptor itself; more need a host read.
SEQ_SLOTS = 16
_SEQ_FIELDS = 4  # per (segment, row): first label, last label, decreasing inside, smallest label
# The descriptor this process sent last, per (entry point, rank, group size): whether *this rank's* call
# changed (bounded: one entry per entry point and group, whatever the shapes).
_last_sent: dict[tuple, tuple] = {}


def _label_summary(seq_idx, nlocal: int):
    """(nlocal * batch, 4) int64 on the labels' device: first, last, decreasing inside, smallest label of
    every (local segment, row), segment-major (row k*batch + i is local segment k of row i)."""
    seg = layout.rows_to_segments(layout.pack_segments(seq_idx, nlocal), nlocal).flatten(0, 1)  # [nlocal*b, m]
    decreasing = (seg[:, 1:] < seg[:, :-1]).any(dim=1)
    return torch.stack([seg[:, 0], seg[:, -1], decreasing.to(seg.dtype), seg.min(dim=1).values], dim=1).long()


def _label_problem(summary_all, what):
    """The first violation in (nseg, batch, 4) gathered label summaries in causal order, as a ValueError."""
    values = summary_all.tolist()
    for s, per_row in enumerate(values):
        for b, (first, _last, decreasing, low) in enumerate(per_row):
            where = f"row {b}, causal segment {s} of {len(values)}"
            if low < 0:
                return ValueError(
                    f"{what}: seq_idx holds a negative label in {where}: padding tokens (label -1) are not supported "
                    "in packed rows; give padding its own document label (or drop it)"
                )
            if decreasing:
                return ValueError(
                    f"{what}: seq_idx decreases inside {where}: document labels must be non-decreasing along the row "
                    "(as mamba-ssm and DataCollatorWithFlattening number them)"
                )
            if s > 0 and first < values[s - 1][b][1]:
                return ValueError(
                    f"{what}: seq_idx decreases across a shard border in {where}: it starts at {first} after the "
                    f"previous segment ended at {values[s - 1][b][1]}; no global row allows that. Shard seq_idx "
                    "exactly like the tokens (ds_mamba_spcp.data.shard_batch does)"
                )
    return None


def _agree(fields, problem, seq_idx, device, group, rank, cp, seq_layout, what) -> None:
    """Every rank decides alike: raise, or go on (one all-gather of descriptor, problem code, label summary).

    A rank reads the result on the host (and raises the clear error) when its own call changed since its
    last one, when it found a problem, on CPU, or for packed rows; otherwise it compares on the device
    (``torch._assert_async``, no host sync). A call that differs from the others' differs from its own
    previous one, so some rank always reads: a mismatch never reaches a mismatched collective.
    """
    values = tuple(v for _, v in fields)
    if cp == 1 or seq_layout not in layout.LAYOUTS:  # a group of one holds the row as one segment; a bad
        seq_layout = "contiguous"  # layout is a problem recorded already, raised below on every rank
    nlocal = len(layout.segment_ids(rank, cp, seq_layout))
    summary = None if seq_idx is None else _label_summary(seq_idx, nlocal)
    fits = summary is None or summary.shape[0] <= SEQ_SLOTS
    key = (what, rank, cp)
    read = _always_read(device) or problem is not None or summary is not None or _last_sent.get(key) != values
    _last_sent[key] = values
    head = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        head = head.pin_memory().to(device, non_blocking=True)  # no host sync (the copy is stream-ordered)
    labels = torch.full((SEQ_SLOTS, _SEQ_FIELDS), -1, dtype=torch.long, device=device)
    if summary is not None and fits:
        labels[: summary.shape[0]] = summary
    rows = comm.all_gather(torch.cat([head, labels.flatten()]), group, cp, async_op=False).wait()  # [cp, width]
    nf = len(values)
    if not read:
        torch._assert_async((rows[:, :nf] == rows[:1, :nf]).all())  # the problem codes too (all 0: see `read`)
        return
    host = rows.tolist()
    bad = [k for k, r in enumerate(host) if r[0] != 0]
    if bad:
        if problem is not None:
            raise problem
        kind = _ERRORS.get(host[bad[0]][0], ValueError)
        raise kind(
            f"{what}: rank(s) {bad} of the sequence-parallel group rejected this call with a {kind.__name__} (see "
            "their message); every rank raises it so that none is left waiting in a collective"
        )
    _compare(fields, [r[:nf] for r in host], what)
    if seq_idx is None:
        return
    if fits:
        got = rows[:, nf:].view(cp, SEQ_SLOTS, _SEQ_FIELDS)[:, : summary.shape[0]]
    else:  # shapes are known to agree now: a gather sized by them is safe
        got = comm.all_gather(summary, group, cp, async_op=False).wait()
    ordered = layout.take(got.reshape(cp * nlocal, -1, _SEQ_FIELDS), layout.gathered_order(cp, seq_layout))
    label_problem = _label_problem(ordered, what)
    if label_problem is not None:
        raise label_problem


def _compare(fields: list[tuple[str, int]], rows: list[list[int]], what: str) -> None:
    """Raises the same error on every rank when the ranks' descriptors differ (NotImplementedError when only the
    local seqlen does, ValueError otherwise). ``fields``: this rank's (name, int) pairs; ``rows``: every rank's
    values; the message lists the fields that differ, per rank."""
    if all(r == rows[0] for r in rows):
        return
    names = [n for n, _ in fields]
    if any(len(r) != len(names) for r in rows):
        differ = names
    else:
        differ = [n for i, n in enumerate(names) if len({r[i] for r in rows}) > 1]
    per_rank = "; ".join(
        f"rank {k}: " + ", ".join(f"{n}={r[names.index(n)]}" for n in differ if names.index(n) < len(r))
        for k, r in enumerate(rows)
    )
    if differ == ["local_seqlen"]:
        raise NotImplementedError(
            f"{what}: variable-length shards are not supported: every rank of the sequence-parallel group must hold "
            f"the same number of tokens ({per_rank}); pad the sequence to a multiple of the number of chunks (the "
            "group size for contiguous shards, twice it for zigzag) before sharding it."
        )
    raise ValueError(
        f"{what}: the ranks of the sequence-parallel group called it with different shapes or options; every rank "
        f"must pass the same batch, local seqlen, sizes, dtype and options. Differing: {per_rank}."
    )


def _always_read(device) -> bool:
    """A host read costs nothing where there is no device queue to drain: CPU tensors."""
    return device.type != "cuda"


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def prepare(
    zxbcdt, core: MixerCore, *, process_group, options, initial_states=None, seq_idx=None, cu_seqlens=None,
    what="mamba_split_conv1d_scan_sp", device=None, problem=None, projections: Projections | None = None,
) -> MixerCall:  # fmt: skip
    """Validates one call on every rank alike and returns it as a ``MixerCall``; see the module docstring.
    device: where the activations live, when zxbcdt is a "meta" tensor (``projections``). problem: an
    exception the caller already found on this rank, to be raised on every rank alike."""
    device = zxbcdt.device if device is None else torch.device(device)
    rank, cp = comm.group_rank_size(process_group)
    spec = None
    try:
        if problem is not None:
            raise problem
        spec = core.spec(zxbcdt)
        _check_params(zxbcdt, core.conv1d_bias, core.dt_bias, core.A, core.rmsnorm_weight, initial_states, spec)
        _check_options(options, spec, cp, zxbcdt.shape[1])
        if options.cuda_graphs and device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs CUDA tensors, got them on {device}; pass cuda_graphs=False (or set "
                '"mamba_sequence_parallel.cuda_graphs": false) on CPU'
            )
        if options.forward_only:
            _check_no_grad(zxbcdt, core, initial_states, projections)
        if seq_idx is not None and cu_seqlens is not None:
            raise ValueError("pass seq_idx or cu_seqlens, not both (they describe the same documents)")
        if seq_idx is not None:
            seq_idx = _check_seq_idx(seq_idx, zxbcdt, device)
        elif cu_seqlens is not None:
            seq_idx = cu_seqlens_to_seq_idx(cu_seqlens, zxbcdt, rank, cp, options.input_layout, device)
    except (ValueError, NotImplementedError, TypeError) as e:
        problem = e
    if options.check_shapes and (cp > 1 or seq_idx is not None) and not _capturing(device):
        fields = _descriptor(zxbcdt, core, options, initial_states, seq_idx, cu_seqlens, problem)
        # (zigzag chunks are the segments whose label borders are checked, whatever the strategy)
        _agree(fields, problem, seq_idx, device, process_group, rank, cp, options.input_layout, what)
    if problem is not None:
        raise problem
    return MixerCall(
        zxbcdt=zxbcdt, conv1d_weight=core.conv1d_weight, conv1d_bias=core.conv1d_bias, dt_bias=core.dt_bias, A=core.A,
        D=core.D, rmsnorm_weight=core.rmsnorm_weight, initial_states=initial_states, seq_idx=seq_idx, spec=spec,
        options=options, group=process_group, rank=rank, cp=cp, projections=projections,
    )  # fmt: skip
