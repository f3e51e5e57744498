"""Save sequence-parallel DeepSpeed training and resume it exactly, also at another sequence-parallel size.

Every rank calls each of these, in this order::

    deepspeed.init_distributed()
    ckpt = find_checkpoint(save_dir)                      # None: nothing saved yet, start fresh
    plan = plan_resume(ckpt, ds_config, sequence_parallel_size=sp) if ckpt else None
    engine, *_ = deepspeed.initialize(..., config=plan.ds_config if plan else ds_config, mpu=...)
    set_process_group_timeout(timeout)                    # every group, DeepSpeed's included
    client_state = load_checkpoint(engine, plan) if plan else None
    for step in ...:
        ...
        save_checkpoint(engine, save_dir, client_state={"next_step": step + 1, ...})

On disk (docs/checkpointing.md, "On disk"): DeepSpeed's own files under ``<save_dir>/<tag>/``, plus
``rng_state_rank<r>.pt`` per rank and the manifest ``MANIFEST`` (written last: it marks the checkpoint
complete), ``<save_dir>/latest`` (written last, atomically) and ``<tag>_universal/`` when a resume needs it.

The module state is replicated across a sequence-parallel group and the sharding is a function of the
ds_config, so only ZeRO's partitions (over every rank of the world) depend on the topology: same world size
and stage, DeepSpeed's own load; another world size at ZeRO 1-3, DeepSpeed's universal format (converted once
by rank 0, loaded with ``"checkpoint": {"load_universal": true}``). RNG states are per rank (``_rng_sources``).
Another ZeRO stage, RNG states that differed within a sequence when the size changes, and a warm start from a
universal checkpoint at ZeRO 1-2 are refused before anything is loaded. The DeepSpeed 0.19.8 defects worked
around: ``_mpu_without_tensor_parallelism``. docs/checkpointing.md gives the whole table and the faults;
``set_process_group_timeout`` gives every process group of the rank the timeout (``init_distributed``'s covers
the world group only).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
from datetime import timedelta
from typing import Any

import torch

from ds_mamba_spcp.config import DeepSpeedSettings

MANIFEST = "ds_mamba_spcp.json"
"""The file in a checkpoint folder that describes it; written after every rank's files, it marks it complete."""

UNIVERSAL_SUFFIX = "_universal"
"""``<tag><UNIVERSAL_SUFFIX>`` is the folder of the universal checkpoint converted from ``<tag>``."""

FORMAT_VERSION = 1
_CLIENT_KEY = "ds_mamba_spcp"  # our entry in DeepSpeed's client_state
_LATEST = "latest"  # DeepSpeed's own pointer file, so engine.load_checkpoint(save_dir) finds the same tag


def _dist():
    import deepspeed.comm as dist

    return dist


# -- topology ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Topology:
    """How a run was laid out: ranks, ranks per sequence, ZeRO stage (ZeRO partitions over all ranks)."""

    world_size: int
    sequence_parallel_size: int
    zero_stage: int

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.sequence_parallel_size

    def describe(self) -> str:
        return (
            f"{self.world_size} ranks, sequence_parallel_size {self.sequence_parallel_size}, data-parallel size "
            f"{self.data_parallel_size}, ZeRO stage {self.zero_stage}"
        )


def topology_of(engine) -> Topology:
    """The topology of a DeepSpeed engine (``deepspeed.comm`` initialised)."""
    return Topology(
        world_size=_dist().get_world_size(),
        sequence_parallel_size=int(getattr(engine, "sequence_parallel_size", 1) or 1),
        zero_stage=int(engine.zero_optimization_stage()),
    )


# -- DeepSpeed's parallel_state_sp as an mpu, during checkpoint I/O ------------------------------


@contextlib.contextmanager
def _mpu_without_tensor_parallelism():
    """Inside: ``parallel_state_sp`` answers tensor-parallel size 1 and rank 0, which is the truth (it aliases
    ``get_model_parallel_*`` to the sequence-parallel group and lacks ``get_tensor_model_parallel_*``, so DeepSpeed
    records ``tp_degree = sequence_parallel_size``, which ``ds_to_universal`` refuses, and its ZeRO 1-2 universal
    loader raises AttributeError). Training is untouched: the functions exist only inside this block."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    added = []
    for name, value in (("get_tensor_model_parallel_world_size", 1), ("get_tensor_model_parallel_rank", 0)):
        if not hasattr(mpu, name):
            setattr(mpu, name, lambda value=value: value)
            added.append(name)
    try:
        yield
    finally:
        for name in added:
            delattr(mpu, name)


# -- random number generators --------------------------------------------------------------------


def _rng_state() -> dict:
    """This process's generators: python, numpy (when installed), torch CPU, CUDA (current device)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_digest(state: dict) -> str:
    """A digest that is equal exactly when two states are (compared across ranks)."""
    h = hashlib.sha256()
    h.update(repr(state["python"]).encode())
    h.update(state["torch"].numpy().tobytes())
    if "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        h.update(repr((name, pos, has_gauss, gauss)).encode() + keys.tobytes())
    if "cuda" in state:
        h.update(state["cuda"].numpy().tobytes())
    return h.hexdigest()


def _rng_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rng_state_rank{rank}.pt")


def _rng_sources(saved: Topology, digests: list[str], current: Topology) -> list[int]:
    """For every rank of ``current``, the saved rank whose RNG state it takes; raises when none is right.
    Unchanged topology: each rank its own; else the states must be identical within each saved
    sequence-parallel group (new replica d takes replica d's), or everywhere (then any rank's)."""
    if (saved.world_size, saved.sequence_parallel_size) == (current.world_size, current.sequence_parallel_size):
        return list(range(current.world_size))
    if len(set(digests)) == 1:
        return [0] * current.world_size
    sp = saved.sequence_parallel_size
    uneven = [
        list(range(g * sp, (g + 1) * sp))
        for g in range(saved.data_parallel_size)
        if len(set(digests[g * sp : (g + 1) * sp])) > 1
    ]
    if uneven or current.data_parallel_size != saved.data_parallel_size:
        why = (
            f"the ranks {uneven[0]}, which shared a sequence, held different RNG states (a generator seeded per "
            "rank, or not seeded at all: python's random and numpy's start from OS entropy)"
            if uneven
            else f"the {saved.data_parallel_size} data-parallel replicas held different RNG states and this run "
            f"has {current.data_parallel_size}"
        )
        raise ValueError(
            f"cannot map the checkpoint's per-rank RNG states ({saved.describe()}) onto this run "
            f"({current.describe()}): {why}, so no saved state is the right one for the new ranks. Resume with the "
            "saved topology, or pass rng='skip' to plan_resume (train.py: --resume-without rng) to keep each rank's "
            "current generators (the loss curve then differs wherever randomness is drawn, e.g. dropout)."
        )
    return [(r // current.sequence_parallel_size) * sp for r in range(current.world_size)]


# -- save ----------------------------------------------------------------------------------------


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(engine, save_dir: str, *, client_state: dict | None = None, tag: str | None = None) -> str:
    """Saves ``engine`` (every rank calls it; all block until the checkpoint is complete); returns the tag.
    ``client_state``: the caller's JSON-serialisable training state, stored in DeepSpeed's checkpoint and the
    manifest and returned by :func:`load_checkpoint`. ``tag`` defaults to ``global_step<N>``."""
    dist = _dist()
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    client_state = dict(client_state or {})
    json.dumps(client_state)  # fail here, on every rank, rather than half-way through the save
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    rank = dist.get_rank()
    topology = topology_of(engine)
    state = {
        _CLIENT_KEY: client_state,
        # ds_to_universal needs this key in ZeRO 1-2 checkpoints. No pattern: no tensor-parallel slices.
        UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE},
    }
    with _mpu_without_tensor_parallelism():
        engine.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False)  # ends in a barrier
    folder = os.path.join(save_dir, tag)
    rng = _rng_state()
    torch.save(rng, _rng_file(folder, rank))
    digests: list = [None] * topology.world_size
    dist.all_gather_object(digests, _rng_digest(rng))  # also: every rank's RNG file is written
    if rank == 0:
        import deepspeed

        manifest = {
            "format_version": FORMAT_VERSION,
            "tag": tag,
            "global_steps": int(engine.global_steps),
            "topology": dataclasses.asdict(topology),
            "rng_digests": digests,
            "client_state": client_state,
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
        }
        _write_atomically(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1) + "\n")
        _write_atomically(os.path.join(save_dir, _LATEST), tag)
    dist.barrier()
    return tag


# -- resume --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint found by :func:`find_checkpoint`."""

    load_dir: str
    tag: str
    manifest: dict

    @property
    def topology(self) -> Topology:
        return Topology(**self.manifest["topology"])

    @property
    def client_state(self) -> dict:
        return self.manifest["client_state"]

    @property
    def path(self) -> str:
        return os.path.join(self.load_dir, self.tag)


def find_checkpoint(load_dir: str, tag: str | None = None) -> Checkpoint | None:
    """The checkpoint ``tag`` of ``load_dir`` (default: the one ``latest`` names), or None when
    ``load_dir`` holds no ``latest`` (nothing saved yet). Reads files only: callable before
    ``deepspeed.initialize``; every rank reads the same files and reaches the same answer."""
    if tag is None:
        latest = os.path.join(load_dir, _LATEST)
        if not os.path.isfile(latest):
            return None
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    manifest_path = os.path.join(load_dir, tag, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(
            f"{manifest_path} is missing: checkpoint {tag!r} in {load_dir} is incomplete (a run stopped while "
            "saving it) or was not written by ds_mamba_spcp.checkpoint.save_checkpoint. Point 'latest' at a "
            "complete checkpoint (a folder that holds the manifest) or pass its tag."
        )
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{manifest_path} has format_version {manifest.get('format_version')!r}; this ds_mamba_spcp reads "
            f"{FORMAT_VERSION}. Resume with the ds_mamba_spcp version that saved it."
        )
    return Checkpoint(load_dir, tag, manifest)


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What :func:`load_checkpoint` will do; made before ``deepspeed.initialize``."""

    checkpoint: Checkpoint
    saved: Topology
    current: Topology
    universal: bool
    """True: load ``<tag>_universal`` with ``"checkpoint": {"load_universal": true}`` (ZeRO re-partitioned)."""
    ds_config: dict
    """The ds_config to pass to ``deepspeed.initialize`` (``checkpoint.load_universal`` set accordingly)."""
    rng_sources: list[int] | None
    """Saved rank whose RNG state each rank takes; None: RNG states are not restored."""

    @property
    def load_tag(self) -> str:
        return self.checkpoint.tag + (UNIVERSAL_SUFFIX if self.universal else "")

    def describe(self) -> str:
        how = "universal checkpoint (ZeRO re-partitioned)" if self.universal else "DeepSpeed's own files"
        return f"{self.checkpoint.path}: saved with {self.saved.describe()}; loading through {how}"


def plan_resume(checkpoint: Checkpoint, ds_config: dict, *, sequence_parallel_size: int, rng: str = "restore"):
    """Decides how this run loads ``checkpoint``; converts it to the universal format when needed.

    Every rank calls it between ``deepspeed.init_distributed`` and ``deepspeed.initialize``, with the ds_config
    it is about to use; raises alike on every rank, before any state is touched, when the checkpoint cannot be
    resharded onto this run. ``rng``: ``"restore"`` or ``"skip"`` (keep the current generators). Rank 0 converts
    ``<tag>`` to ``<tag>_universal`` when needed (convert ahead, ``python -m ds_mamba_spcp.checkpoint DIR``, when
    that would outlast the process-group timeout).
    """
    if rng not in ("restore", "skip"):
        raise ValueError(f"rng must be 'restore' or 'skip', got {rng!r}")
    dist = _dist()
    saved = checkpoint.topology
    stage = DeepSpeedSettings.from_ds_config(ds_config).zero_stage  # read where the section's settings read it
    if stage is None:
        raise ValueError(
            f'"zero_optimization.stage" is {ds_config["zero_optimization"]["stage"]!r}, not a stage number: a resume '
            "is planned before deepspeed.initialize, from the ds_config the run will use. Set the stage (0-3) in the "
            "ds_config before plan_resume."
        )
    current = Topology(dist.get_world_size(), int(sequence_parallel_size), stage)
    if current.world_size % current.sequence_parallel_size:
        raise ValueError(
            f"the world has {current.world_size} ranks, not a multiple of sequence_parallel_size "
            f"{current.sequence_parallel_size}"
        )
    if saved.zero_stage != current.zero_stage:
        raise ValueError(
            f"{checkpoint.path} was saved at ZeRO stage {saved.zero_stage} and this run uses stage "
            f"{current.zero_stage}: a checkpoint's file layout and optimizer partitioning belong to its stage "
            "(stage 3 partitions the parameters too and names its files per rank), and DeepSpeed 0.19.8 loads "
            f'neither natively nor through its universal format across that change. Set "zero_optimization.stage" '
            f"to {saved.zero_stage} to resume."
        )
    rng_sources = _rng_sources(saved, checkpoint.manifest["rng_digests"], current) if rng == "restore" else None
    universal = current.zero_stage > 0 and current.world_size != saved.world_size
    if universal:
        error = None
        if dist.get_rank() == 0:
            try:
                convert_to_universal(checkpoint.load_dir, checkpoint.tag)
            except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised everywhere
                error = f"{type(e).__name__}: {e}"
        status = [error]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None:
            raise RuntimeError(f"converting {checkpoint.path} to DeepSpeed's universal format failed on rank 0: "
                               f"{status[0]}")  # fmt: skip
    config = copy.deepcopy(ds_config)
    config.setdefault("checkpoint", {})["load_universal"] = universal
    return ResumePlan(checkpoint, saved, current, universal, config, rng_sources)


def convert_to_universal(load_dir: str, tag: str) -> str:
    """Converts ``<load_dir>/<tag>`` to DeepSpeed's universal format in ``<load_dir>/<tag>_universal``
    (one process; a finished conversion is reused). Returns the output folder."""
    src = os.path.join(load_dir, tag)
    out = src + UNIVERSAL_SUFFIX
    if os.path.isfile(os.path.join(out, MANIFEST)):
        return out  # converted before: the manifest is copied last
    if not os.path.isfile(os.path.join(src, MANIFEST)):
        raise FileNotFoundError(f"{src} holds no {MANIFEST}: not a complete ds_mamba_spcp checkpoint")
    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(out, ignore_errors=True)  # a conversion that was interrupted
    print(f"converting {src} to DeepSpeed's universal checkpoint format in {out}", flush=True)
    ds_to_universal.main(
        argparse.Namespace(
            input_folder=src, output_folder=out, num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
            strict=True, inject_missing_state=False,
        )
    )  # fmt: skip
    shutil.copy2(os.path.join(src, MANIFEST), os.path.join(out, MANIFEST))
    return out


def load_checkpoint(engine, plan: ResumePlan, *, load_optimizer_states: bool = True) -> dict:
    """Loads the planned checkpoint into ``engine`` (every rank, from ``deepspeed.initialize(config=
    plan.ds_config)``) and restores the RNG states; returns the ``client_state`` given to :func:`save_checkpoint`.
    ``load_optimizer_states=False`` keeps the fresh optimizer state (a warm start)."""
    have = topology_of(engine)
    if have != plan.current:
        raise ValueError(
            f"the engine ({have.describe()}) is not the run the resume was planned for ({plan.current.describe()}): "
            "pass plan.ds_config to deepspeed.initialize"
        )
    if bool(engine.load_universal_checkpoint()) != plan.universal:
        raise ValueError(
            f'the engine\'s "checkpoint.load_universal" is {engine.load_universal_checkpoint()} but the plan needs '
            f"{plan.universal}: pass plan.ds_config to deepspeed.initialize"
        )
    if plan.universal and not load_optimizer_states and plan.current.zero_stage in (1, 2):
        raise ValueError(
            f"load_optimizer_states=False with a universal checkpoint at ZeRO stage {plan.current.zero_stage}: "
            "DeepSpeed 0.19.8 restores the optimizer state from a universal checkpoint at stages 1-2 whatever "
            "load_optimizer_states says, so the warm start would silently keep it. Resume at the saved world size "
            f"({plan.saved.world_size} ranks) for a warm start, or at ZeRO stage 3."
        )
    ckpt = plan.checkpoint
    with _mpu_without_tensor_parallelism():
        load_path, client = engine.load_checkpoint(
            ckpt.load_dir, tag=plan.load_tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_optimizer_states,
        )  # fmt: skip
    if load_path is None or client is None or _CLIENT_KEY not in client:
        raise RuntimeError(f"DeepSpeed loaded nothing from {os.path.join(ckpt.load_dir, plan.load_tag)}")
    if engine.global_steps != ckpt.manifest["global_steps"]:
        raise RuntimeError(
            f"{ckpt.path}: the engine restored global_steps {engine.global_steps}, the manifest says "
            f"{ckpt.manifest['global_steps']}; the checkpoint is inconsistent"
        )
    if plan.rng_sources is not None:
        source = plan.rng_sources[_dist().get_rank()]
        _set_rng_state(torch.load(_rng_file(ckpt.path, source), weights_only=False))
    return client[_CLIENT_KEY]


# -- faults --------------------------------------------------------------------------------------


def set_process_group_timeout(timeout: timedelta) -> int:
    """Gives every process group this rank belongs to the timeout ``timeout`` (torch's ``_set_pg_timeout``), so
    that a collective waiting longer for a peer raises; returns their number. Call it after
    ``deepspeed.initialize`` (which makes groups of its own)."""
    import torch.distributed.distributed_c10d as c10d

    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    setter, world = getattr(c10d, "_set_pg_timeout", None), getattr(c10d, "_world", None)
    if setter is None or world is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed.distributed_c10d._set_pg_timeout / _world, so the "
            "timeout of groups made after init (the sequence-parallel ones) cannot be changed; use torch >= 2.4"
        )
    groups = [pg for pg in list(world.pg_map) if not c10d._rank_not_in_group(pg)]
    for pg in groups:
        setter(timeout, pg)
    return len(groups)


def process_group_timeouts() -> list[timedelta]:
    """The timeouts of this rank's process groups that have a CPU (gloo) backend (for checks and logs)."""
    import torch.distributed.distributed_c10d as c10d

    out = []
    for pg in list(c10d._world.pg_map):
        if c10d._rank_not_in_group(pg):
            continue
        try:
            out.append(pg._get_backend(torch.device("cpu")).options._timeout)
        except (RuntimeError, AttributeError):
            continue  # no CPU backend (NCCL only)
    return out


def main(argv=None) -> int:
    """``python -m ds_mamba_spcp.checkpoint SAVE_DIR [--tag TAG]``: convert ahead of a resume."""
    p = argparse.ArgumentParser(description="Convert a ds_mamba_spcp checkpoint to DeepSpeed's universal format")
    p.add_argument("save_dir")
    p.add_argument("--tag", default=None, help="default: the tag in SAVE_DIR/latest")
    args = p.parse_args(argv)
    ckpt = find_checkpoint(args.save_dir, args.tag)
    if ckpt is None:
        print(f"{args.save_dir} holds no '{_LATEST}' file: nothing to convert", file=sys.stderr)
        return 1
    print(convert_to_universal(ckpt.load_dir, ckpt.tag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
