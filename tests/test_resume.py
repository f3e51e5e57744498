"""Faults and resume (issue 15): examples/train.py killed mid-step and resumed from its DeepSpeed
checkpoint, also at another sequence-parallel size; a hung rank ends the run within the timeout.

The run: the tiny model of tests/test_train.py, 12 steps, AdamW (the shipped configs' optimizer:
its moments and step count are state that a resume must restore), a checkpoint every 3 steps, fp32
on CPU, 2 ranks per sequence.

- Killed and resumed (state passing at ZeRO 1, state passing with load balancing virtual at ZeRO 3):
  ``deepspeed --num_gpus 2 examples/train.py --fault-drill 1:8`` freezes rank 1 in the middle of step
  8 (after its forward pass); the test SIGKILLs that process. The launcher must end the run with an
  error well within ``--dist-timeout``, with steps 1-7 logged and ``latest`` at step 6. ``--resume``
  then continues from the step-6 checkpoint, in the killed run's save dir and log: one case through
  the launcher, the other in process (the same ``run_distributed``). Steps 7-12 must equal the
  uninterrupted run's bitwise: the resumed run repeats the same fp32 operations in the same order
  (same data, weights, optimizer state and thread count), so nothing can round differently, while a
  lost piece of state moves the loss by > 1e-3 (the negative controls: no data position 0.32, no
  optimizer state 0.093). The other modes and stages (state passing at ZeRO 3, virtual at ZeRO 1,
  ulysses at ZeRO 1 and 3, permute at ZeRO 2) are resumed the same way from the uninterrupted run's
  step-6 checkpoint, in process, without a kill: what the kill checks (the launcher ends the run, the
  checkpoint before the fault is the newest) does not depend on the mode, what the resume checks does.
- Another sequence-parallel size: the uninterrupted run's step-6 checkpoint (2 ranks per sequence)
  resumed on 1 and on 4 gloo ranks, through DeepSpeed's universal checkpoint (ZeRO 1, 2 and 3; one of
  them with another mode, which holds no state). Within 1e-5 relative:
  the same model, but the sequence-parallel sums run in another order (other shard boundaries),
  which moves fp32 results by ~1e-7 (1.5e-7 measured over 6 steps); a partition restored into the
  wrong place, or Adam's step count lost, moves them by > 1e-3.
- Refusals: what cannot be resharded (RNG states that differed within a sequence-parallel group,
  another ZeRO stage, another data-parallel size, another model shape) fails on every rank with the
  reason, before any step.
- A hung rank: rank 1 freezes and stays frozen; rank 0 must raise gloo's timeout error after
  ``--dist-timeout`` (10 s here), which ``ds_mamba_spcp.checkpoint.set_process_group_timeout`` sets on
  every group: without it the sequence-parallel groups keep torch's default of 30 minutes.

The uninterrupted runs, the negative controls and the in-process resumes share one spawn of 2 gloo
ranks (``tests.dist_utils.run_ranks``), after the killed runs; the sp=1 and sp=4 resumes one spawn each. Every launcher
run has a timeout; whatever is left of it is killed by its session id, and its shared-memory files
are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch

from ds_mamba_spcp import checkpoint
from ds_mamba_spcp.checkpoint import Topology
from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers
from tests.conftest import TINY, load_train
from tests.dist_utils import REPO, free_port, run_ranks

STEPS = 12
SAVE_EVERY = 3
FAULT_STEP = 8  # rank 1 is frozen, then killed, in the middle of step 8: step 7 is the last one completed
RESUMED_FROM = 6  # the newest checkpoint before the fault
DIST_TIMEOUT = 60  # --dist-timeout of the killed runs (seconds); the launcher should end them far sooner
HANG_TIMEOUT = 10  # --dist-timeout of the hung run
CP = 2
EXACT = 0.0  # same-topology resume: bitwise (see the module docstring)
RESHARD_TOL = 1e-5  # another sequence-parallel size: relative (see the module docstring)
CONTROL_MIN = 1e-3  # a negative control must move some loss by at least this (relative)

MODELS = {"mamba": ["--model", "mamba", "--n-layers", "2"], "hybrid": ["--model", "hybrid", "--n-layers", "3"]}
# name -> (model, shipped config, ZeRO stage); killed through the launcher, then resumed
CASES = {
    "state_passing-zero1": ("mamba", "state_passing.json", 1),
    "virtual-zero3": ("hybrid", "state_passing_virtual.json", 3),
}
# resumed in process only (no kill): the other modes and stages (each was killed too before; the kill's checks
# do not depend on the mode; the launched runs, ~30 s each, are what this file costs most)
MORE_CASES = {
    "state_passing-zero3": ("mamba", "state_passing.json", 3),
    "virtual-zero1": ("hybrid", "state_passing_virtual.json", 1),
    "ulysses-zero1": ("mamba", "ulysses.json", 1),
    "ulysses-zero3": ("mamba", "ulysses.json", 3),
    "permute-zero2": ("mamba", "state_passing_permute.json", 2),
}
ALL_CASES = {**CASES, **MORE_CASES}
# resumed at another sequence-parallel size (the whole world shares one sequence): the case whose
# checkpoint is resumed -> the case whose config resumes it (the mode may change too: it holds no state)
RESHARD = {
    1: {"state_passing-zero1": "state_passing-zero1", "state_passing-zero3": "state_passing-zero3"},
    4: {
        "state_passing-zero1": "state_passing-zero1",
        "state_passing-zero3": "ulysses-zero3",
        "permute-zero2": "permute-zero2",
    },
}


def argv(name: str) -> list[str]:
    return TINY + ["--steps", str(STEPS)] + MODELS[ALL_CASES[name][0]]  # the last --steps wins


def write_config(folder, name: str, sp: int = CP, stage: int | None = None) -> str:
    """The case's shipped config with its ZeRO stage (or ``stage``) and sequence-parallel size, as a file."""
    _, config_name, case_stage = ALL_CASES[name]
    stage = case_stage if stage is None else stage
    with open(os.path.join(REPO, "configs", config_name), encoding="utf-8") as f:
        config = json.load(f)
    config["zero_optimization"] = {"stage": stage}
    config["sequence_parallel_size"] = sp
    path = os.path.join(str(folder), f"{name}-sp{sp}-zero{stage}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def checkpoint_copy(src: str, dst: str, tag: str) -> None:
    """``dst`` holding only checkpoint ``tag`` of ``src`` (named by ``latest``): a resume from it
    leaves ``src`` as it was."""
    os.makedirs(dst)
    shutil.copytree(os.path.join(src, tag), os.path.join(dst, tag))
    with open(os.path.join(dst, "latest"), "w", encoding="utf-8") as f:
        f.write(tag)


def read_log(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def losses_from(records: list[dict], first: int) -> list[float]:
    """Losses of steps ``first..STEPS``; the steps must be exactly these."""
    steps = [r["step"] for r in records if r["step"] >= first]
    assert steps == list(range(first, STEPS + 1)), f"logged steps {steps}"
    return [r["loss"] for r in records if r["step"] >= first]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------
# in-process runs: one spawn runs a list of jobs, each a fresh model and deepspeed.initialize
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    key: str
    case: str  # model and shipped config of CASES
    config: str  # ds_config file
    flags: tuple[str, ...] = ()
    copy_checkpoint: str | None = None  # the save dir whose step-6 checkpoint --save-dir gets first
    unmappable_rng: bool = False  # and make its RNG states differ between the ranks of a sequence
    refused: bool = False  # the resume must raise; report its message
    log: str | None = None  # --log-json (default: <root>/w<world>/<key>.jsonl)


def _prepare(job: Job, save: str) -> None:
    tag = f"global_step{RESUMED_FROM}"
    checkpoint_copy(job.copy_checkpoint, save, tag)
    if job.unmappable_rng:  # as if python's random had been seeded per rank (or not at all)
        manifest = os.path.join(save, tag, checkpoint.MANIFEST)
        with open(manifest, encoding="utf-8") as f:
            meta = json.load(f)
        meta["rng_digests"][1] = "0" * 64
        with open(manifest, "w", encoding="utf-8") as f:
            json.dump(meta, f)


def _run_jobs(rank, world, root, jobs):
    import deepspeed.comm as dist

    # examples/train.py's main() gives each of the launcher's CPU ranks cpu_count // ranks threads;
    # in-process runs use the same count, so that their fp32 sums are the launched runs' (exact check).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    train = load_train()
    os.makedirs(os.path.join(root, f"w{world}"), exist_ok=True)
    out = {}
    for job in jobs:
        flags = list(job.flags)
        if job.copy_checkpoint:
            save = os.path.join(root, f"w{world}", job.key)
            if rank == 0:
                _prepare(job, save)
            dist.barrier()
            flags += ["--save-dir", save, "--resume"]
        with open(job.config, encoding="utf-8") as f:
            config = json.load(f)
        log = job.log or os.path.join(root, f"w{world}", f"{job.key}.jsonl")
        args = train.parse_args(argv(job.case) + flags + ["--log-json", log])
        try:
            records = train.run_distributed(args, config)
        except (ValueError, RuntimeError) as e:
            if not job.refused:
                raise
            out[job.key] = {"error": str(e), "logged": os.path.exists(log)}
            dist.barrier()  # rank 0 checked for the log before anyone goes on
            continue
        assert not job.refused, f"{job.key}: the resume went through"
        universal = os.path.join(args.save_dir or "", f"global_step{RESUMED_FROM}_universal")
        out[job.key] = {
            "losses": [r["loss"] for r in records],
            "universal": os.path.isfile(os.path.join(universal, checkpoint.MANIFEST)),
            "timeouts": sorted({t.total_seconds() for t in checkpoint.process_group_timeouts()}),
        }
    return out


def run_jobs(world: int, root, jobs: list[Job]) -> dict:
    results = run_ranks(_run_jobs, world, str(root), jobs, timeout=600)
    for key in results[0]:  # the same all-reduced losses, the same refusal on every rank
        for r in range(1, world):
            assert results[r][key] == results[0][key], f"{key}: rank {r} disagrees with rank 0"
    return results[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def configs(workdir):
    return {name: write_config(workdir, name) for name in ALL_CASES}


def uninterrupted_dir(workdir, name: str) -> str:
    return os.path.join(str(workdir), f"w{CP}", name)


@pytest.fixture(scope="module")
def uninterrupted(workdir, configs, killed):
    """Every case for 12 steps, saving every 3; then in-process resumes: the killed runs (``--resume``, their
    own --save-dir and log; the launched one aside), one case from its step-6 checkpoint with every piece
    restored, and without one piece each (the negative controls), the other modes and stages from theirs; and
    a resume onto another data-parallel size, which must be refused. One spawn: the killed runs go first."""
    jobs = [Job(name, name, configs[name], ("--save-dir", uninterrupted_dir(workdir, name), "--save-every",
                                            str(SAVE_EVERY))) for name in ALL_CASES]  # fmt: skip
    jobs += [
        Job(f"killed-{name}", name, configs[name], ("--save-dir", killed[name]["save"], "--resume", "--save-every",
                                                    str(SAVE_EVERY)), log=killed[name]["log"])
        for name in CASES
        if name != LAUNCHED_RESUME
    ]  # fmt: skip
    name = "state_passing-zero1"
    src = uninterrupted_dir(workdir, name)
    for label, skip in (("complete", ()), ("no_data_position", ("data_position",)), ("no_optimizer", ("optimizer",))):
        flags = tuple(f for piece in skip for f in ("--resume-without", piece))
        jobs.append(Job(f"resume-{label}", name, configs[name], flags, copy_checkpoint=src))
    for name in MORE_CASES:  # same topology, in process
        jobs.append(Job(f"resume-{name}", name, configs[name], copy_checkpoint=uninterrupted_dir(workdir, name)))
    name = "state_passing-zero1"
    # 1 rank per sequence on 2 ranks: 2 data-parallel replicas instead of 1, another data stream
    jobs.append(Job("refused-data_parallel", name, write_config(workdir, name, sp=1), copy_checkpoint=src,
                    refused=True))  # fmt: skip
    return run_jobs(CP, workdir, jobs)


# ------------------------------------------------------------------------------------------------
# the deepspeed launcher, with a fault
# ------------------------------------------------------------------------------------------------


def launch(nproc: int, args: list[str], output: str, *, fault: str | None = None, timeout: float = 300.0) -> dict:
    """``deepspeed --num_gpus nproc examples/train.py args`` (CPU ranks); returns its exit code and
    output. ``fault``: "kill" SIGKILLs the rank that ``--fault-drill`` froze, as soon as it is frozen;
    "hang" leaves it frozen until the other rank has exited (then kills it, to end the run). Returns
    ``fault_s``: seconds from the kill (or the freeze) to the end of the other ranks."""
    import psutil

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks even on a GPU machine
    port = free_port()
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--master_port", str(port), "--num_gpus", str(nproc), os.path.join(REPO, "examples", "train.py")]
    result = {"fault_s": None}
    with open(output, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd + args, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        if fault is not None:
            frozen, others, ranks = None, [], []
            while frozen is None:
                assert proc.poll() is None, f"the run ended before a rank froze:\n{_tail(output)}"
                assert time.monotonic() < deadline, f"no rank froze within {timeout:.0f} s"
                with contextlib.suppress(psutil.NoSuchProcess):
                    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if _is_rank(p)]
                frozen = next((p for p in ranks if _status(p) == psutil.STATUS_STOPPED), None)
                others = [p for p in ranks if p is not frozen]
                time.sleep(0.05)
            t0 = time.monotonic()
            if fault == "kill":
                frozen.kill()
            _, alive = psutil.wait_procs(others, timeout=max(1.0, deadline - time.monotonic()))
            assert not alive, (
                f"ranks {[p.pid for p in alive]} still run {time.monotonic() - t0:.0f} s after the {fault}"
            )
            result["fault_s"] = time.monotonic() - t0
            if fault == "hang":
                frozen.kill()
        result["rc"] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever of the run is left (its own session)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        remove_deepspeed_shm_buffers(port)
    result["output"] = _tail(output, 200_000)
    return result


def _is_rank(p) -> bool:
    """A training rank the launcher started (not the launcher itself)."""
    try:
        return any(a.startswith("--local_rank=") for a in p.cmdline())
    except Exception:  # noqa: BLE001 - the process is gone
        return False


def _status(p) -> str | None:
    try:
        return p.status()
    except Exception:  # noqa: BLE001
        return None


def _tail(path: str, n: int = 4000) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()[-n:]


LAUNCHED_RESUME = "virtual-zero3"  # resumed through the launcher; the other case in process (time)


@pytest.fixture(scope="module")
def killed(workdir, configs):
    """Every case launched with checkpoints every 3 steps; rank 1 frozen in step 8 and killed."""
    out = {}
    for name in CASES:
        save, log = str(workdir / f"killed-{name}"), str(workdir / f"killed-{name}.jsonl")
        args = argv(name) + ["--deepspeed_config", configs[name], "--save-dir", save, "--log-json", log,
                             "--save-every", str(SAVE_EVERY), "--fault-drill", f"1:{FAULT_STEP}",
                             "--dist-timeout", str(DIST_TIMEOUT)]  # fmt: skip
        t0 = time.monotonic()
        out[name] = launch(CP, args, log + ".out", fault="kill")
        out[name].update(save=save, log=log, seconds=time.monotonic() - t0, steps=[r["step"] for r in read_log(log)])
        with open(os.path.join(save, "latest"), encoding="utf-8") as f:
            out[name]["latest"] = f.read()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_killed_rank_then_resume_continues_exactly(name, uninterrupted, killed, configs):
    run = killed[name]
    assert run["rc"] != 0, f"the launcher reported success after a rank was killed:\n{run['output'][-3000:]}"
    assert run["fault_s"] < DIST_TIMEOUT, f"the other rank ran {run['fault_s']:.1f} s after the kill"
    assert run["steps"] == list(range(1, FAULT_STEP)), f"the killed run logged steps {run['steps']}"
    assert run["latest"] == f"global_step{RESUMED_FROM}", f"after the kill, latest names {run['latest']}"
    how = "in process"
    if name == LAUNCHED_RESUME:
        args = argv(name) + ["--deepspeed_config", configs[name], "--save-dir", run["save"], "--log-json",
                             run["log"], "--save-every", str(SAVE_EVERY), "--resume"]  # fmt: skip
        t0 = time.monotonic()
        result = launch(CP, args, run["log"] + ".resumed.out")
        how = f"launched, {time.monotonic() - t0:.1f} s"
        assert result["rc"] == 0, result["output"][-4000:]
        assert f"resumed at step {RESUMED_FROM + 1} from" in result["output"]
        assert "through DeepSpeed's own files" in result["output"]
    else:
        assert not uninterrupted[f"killed-{name}"]["universal"], "same topology, yet a universal checkpoint was made"
    records = read_log(run["log"])  # the resumed run continues the killed run's log from step 7
    ref = uninterrupted[name]["losses"]
    assert losses_from(records, 1)[:RESUMED_FROM] == ref[:RESUMED_FROM], "steps before the checkpoint"
    got = losses_from(records, RESUMED_FROM + 1)
    err = max_rel_diff(got, ref[RESUMED_FROM:])
    print(f"{name}: killed run {run['seconds']:.1f} s (the other rank ended {run['fault_s']:.2f} s after the kill); "
          f"resumed ({how}): steps 7-12 max relative difference {err:.1e}")  # fmt: skip
    assert err <= EXACT, f"{name}: steps 7-12 differ from the uninterrupted run by {err:.2e}: {got} vs {ref[6:]}"


@pytest.mark.parametrize("name", list(MORE_CASES))
def test_resume_other_modes_and_stages(name, uninterrupted):
    got = uninterrupted[f"resume-{name}"]
    assert not got["universal"], "same topology, yet a universal checkpoint was made"
    err = max_rel_diff(got["losses"], uninterrupted[name]["losses"][RESUMED_FROM:])
    print(f"{name}: resumed in process, steps 7-12 max relative difference {err:.1e}")
    assert err <= EXACT, f"{name}: steps 7-12 differ from the uninterrupted run by {err:.2e}"


def test_resume_negative_controls(uninterrupted):
    """The same in-process resume with every piece restored matches; without the data position or
    without the optimizer state (Adam's moments and step) it must not."""
    ref = uninterrupted["state_passing-zero1"]["losses"][RESUMED_FROM:]
    assert max_rel_diff(uninterrupted["resume-complete"]["losses"], ref) <= EXACT
    for control in ("resume-no_data_position", "resume-no_optimizer"):
        err = max_rel_diff(uninterrupted[control]["losses"], ref)
        print(f"{control}: steps 7-12 max relative difference {err:.2e}")
        assert err > CONTROL_MIN, f"{control}: resuming without it went unnoticed ({err:.1e})"


# ------------------------------------------------------------------------------------------------
# another sequence-parallel size
# ------------------------------------------------------------------------------------------------


RESHARD_TIMEOUT = 123  # --dist-timeout of these resumes: every process group must end up with it


@pytest.mark.parametrize("world", sorted(RESHARD))
def test_resume_at_another_sequence_parallel_size(world, uninterrupted, workdir):
    """Saved with 2 ranks per sequence, resumed with ``world`` (the ZeRO partitions change: universal
    checkpoint); on 4 ranks also the resumes that must be refused before anything loads."""
    flags = ("--dist-timeout", str(RESHARD_TIMEOUT))
    jobs = [Job(name, name, write_config(workdir, config, sp=world), flags, copy_checkpoint=uninterrupted_dir(
        workdir, name)) for name, config in RESHARD[world].items()]  # fmt: skip
    refusals = {}
    if world == 4:
        name = "state_passing-zero1"
        src, config = uninterrupted_dir(workdir, name), write_config(workdir, name, sp=world)
        refusals = {  # key -> what the message must name
            "refused-rng": (Job("refused-rng", name, config, copy_checkpoint=src, unmappable_rng=True, refused=True),
                            "the ranks [0, 1], which shared a sequence, held different RNG states"),
            "refused-zero_stage": (Job("refused-zero_stage", name, write_config(workdir, name, sp=world, stage=3),
                                       copy_checkpoint=src, refused=True), "saved at ZeRO stage 1"),
            "refused-model": (Job("refused-model", name, config, ("--d-state", "16"), copy_checkpoint=src,
                                  refused=True), "d_state 8 -> 16"),
            # DeepSpeed would restore the optimizer state anyway (universal, ZeRO 1-2)
            "refused-warm_start": (Job("refused-warm_start", name, config, ("--resume-without", "optimizer"),
                                       copy_checkpoint=src, refused=True), "load_optimizer_states=False"),
        }  # fmt: skip
        jobs += [job for job, _ in refusals.values()]
    control = None
    if world == 1:  # negative control: the universal path without the optimizer state must fail the bound
        name = "state_passing-zero3"
        control = Job("control-no_optimizer", name, write_config(workdir, name, sp=world), ("--resume-without",
                      "optimizer"), copy_checkpoint=uninterrupted_dir(workdir, name))  # fmt: skip
        jobs.append(control)
    t0 = time.monotonic()
    results = run_jobs(world, workdir, jobs)
    print(f"sp={world}: {time.monotonic() - t0:.1f} s")
    for name, config in RESHARD[world].items():
        got = results[name]
        assert got["universal"], f"{name}: resumed on {world} ranks without a universal checkpoint"
        assert got["timeouts"] == [float(RESHARD_TIMEOUT)], f"process-group timeouts {got['timeouts']}"
        err = max_rel_diff(got["losses"], uninterrupted[name]["losses"][RESUMED_FROM:])
        print(f"{name} saved at sp=2, resumed as {config} at sp={world}: steps 7-12 max relative difference {err:.1e}")
        assert err <= RESHARD_TOL, f"{name} at sp={world}: {err:.2e} > {RESHARD_TOL:g}"
    if control is not None:
        err = max_rel_diff(results[control.key]["losses"], uninterrupted[control.case]["losses"][RESUMED_FROM:])
        print(f"{control.case} at sp={world} without its optimizer state: max relative difference {err:.1e}")
        assert err > CONTROL_MIN, f"a universal resume without the optimizer state went unnoticed ({err:.1e})"
    for key, (_, needle) in refusals.items():
        assert needle in results[key]["error"], f"{key}: {results[key]['error']}"
        assert not results[key]["logged"], f"{key}: steps ran before the refusal"


def test_resume_onto_another_data_parallel_size_is_refused(uninterrupted):
    got = uninterrupted["refused-data_parallel"]
    assert "data_parallel_size 1 -> 2" in got["error"], got["error"]
    assert not got["logged"]


# ------------------------------------------------------------------------------------------------
# a hung rank
# ------------------------------------------------------------------------------------------------


def test_hung_rank_ends_the_run_within_the_timeout(workdir, configs):
    name = "state_passing-zero1"
    out = str(workdir / "hung.out")
    args = argv(name) + ["--no-progress", "--deepspeed_config", configs[name], "--fault-drill", "1:3",
                         "--dist-timeout", str(HANG_TIMEOUT)]  # fmt: skip
    result = launch(CP, args, out, fault="hang")
    print(f"hung rank: the other rank raised and exited {result['fault_s']:.1f} s after the freeze "
          f"(--dist-timeout {HANG_TIMEOUT})")  # fmt: skip
    assert result["rc"] != 0
    assert f"Timed out waiting {HANG_TIMEOUT * 1000}ms" in result["output"], result["output"][-3000:]
    # it waited the timeout (the freeze is what stopped it), and not much longer (exit takes ~1-2 s)
    assert HANG_TIMEOUT * 0.9 <= result["fault_s"] <= HANG_TIMEOUT + 20


# ------------------------------------------------------------------------------------------------
# pieces, without ranks
# ------------------------------------------------------------------------------------------------


def test_rng_state_round_trip():
    """A restored state draws what the saved one would have; a state that was not restored does not
    (the training script draws nothing, so its loss curve cannot show this)."""
    import random

    import numpy as np

    def seed():  # as a process starts: seeded (a resumed one, then restored)
        torch.manual_seed(1)
        random.seed(1)
        np.random.seed(1)

    def draw():
        return torch.rand(4).tolist(), random.random(), np.random.rand()

    seed()
    draw()  # the state to save is not a fresh seed's
    saved = checkpoint._rng_state()
    expect = draw()
    seed()
    assert checkpoint._rng_digest(checkpoint._rng_state()) != checkpoint._rng_digest(saved)
    fresh = draw()
    assert all(a != b for a, b in zip(fresh, expect))
    seed()
    checkpoint._set_rng_state(saved)
    assert checkpoint._rng_digest(checkpoint._rng_state()) == checkpoint._rng_digest(saved)
    assert draw() == expect


def test_rng_sources_map_states_onto_a_new_topology():
    t = Topology
    same = ["a", "a", "b", "b"]  # 2 replicas x 2 ranks per sequence, identical within each replica
    assert checkpoint._rng_sources(t(4, 2, 1), same, t(4, 2, 1)) == [0, 1, 2, 3]
    assert checkpoint._rng_sources(t(4, 2, 1), same, t(8, 4, 1)) == [0, 0, 0, 0, 2, 2, 2, 2]
    assert checkpoint._rng_sources(t(2, 2, 1), ["a", "a"], t(1, 1, 1)) == [0]
    assert checkpoint._rng_sources(t(4, 2, 1), ["a"] * 4, t(1, 1, 1)) == [0]  # identical everywhere: any
    with pytest.raises(ValueError, match=r"the ranks \[2, 3\], which shared a sequence"):
        checkpoint._rng_sources(t(4, 2, 1), ["a", "a", "b", "c"], t(8, 4, 1))
    with pytest.raises(ValueError, match="2 data-parallel replicas held different RNG states and this run has 1"):
        checkpoint._rng_sources(t(4, 2, 1), same, t(4, 4, 1))


def test_incomplete_checkpoint_is_refused(tmp_path):
    assert checkpoint.find_checkpoint(str(tmp_path)) is None  # nothing saved yet: a fresh start
    (tmp_path / "global_step9").mkdir()
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        checkpoint.find_checkpoint(str(tmp_path))


def test_set_process_group_timeout_rejects_bad_values():
    with pytest.raises(ValueError, match="positive"):
        checkpoint.set_process_group_timeout(timedelta(0))


def test_plan_resume_reads_the_zero_stage_as_the_section_does(monkeypatch):
    """plan_resume reads the run's ZeRO stage through config.DeepSpeedSettings, the one reader of the ds_config
    outside the section: a stage written "2" is stage 2 (here refused against a checkpoint of stage 3), and an
    unresolved "auto" (accelerate's) raises a sentence naming the key (before: int("auto"), "invalid literal")."""
    monkeypatch.setattr(checkpoint, "_dist", lambda: type("Dist", (), {"get_world_size": staticmethod(lambda: 2)}))
    saved = type("Saved", (), {"topology": Topology(2, 1, 3), "path": "ckpt/global_step4"})()
    with pytest.raises(ValueError, match="saved at ZeRO stage 3 and this run uses stage 2"):
        checkpoint.plan_resume(saved, {"zero_optimization": {"stage": "2"}}, sequence_parallel_size=1)
    with pytest.raises(ValueError, match=r"\"zero_optimization.stage\" is 'auto', not a stage number"):
        checkpoint.plan_resume(saved, {"zero_optimization": {"stage": "auto"}}, sequence_parallel_size=1)
