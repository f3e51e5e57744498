"""The mixer benchmark end to end on 2 gloo ranks (its --cpu mode), so the script cannot rot
between GPU runs: launch through torchrun, check the JSON schema, render the report.

Few iterations (3 after 2 warm-ups; the GPU figures use >= 10 after >= 5): the run takes ~10 s
on 2 idle cores once DeepSpeed's shared-memory op is built (the first deepspeed.comm init on a
machine builds it into TORCH_EXTENSIONS_DIR, ~30 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ds_mamba_spcp.comm import remove_deepspeed_shm_buffers
from tests.dist_utils import REPO, free_port

BENCH = os.path.join(REPO, "benchmarks", "bench_mixer.py")
REPORT = os.path.join(REPO, "benchmarks", "report.py")
RECORD_KEYS = {"mode", "cp", "seqlen", "batch", "nheads", "ngroups", "cuda_graph", "status"}
OK_KEYS = {"fwd_bwd_ms", "peak_mem_gib", "rank_median_ms", "rank_min_ms", "host_ms"}


def _load_bench():
    if "bench_mixer" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_mixer", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_mixer"] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules["bench_mixer"]


def _env():
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "cpu.json"
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), BENCH, "--cpu", "--iters", "3", "--warmup", "2", "--no-progress",
           "--docs-per-row", "0,3", "--out", str(out)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    finally:
        remove_deepspeed_shm_buffers(port)  # DeepSpeed's CPU backend leaves them in /dev/shm
    assert proc.returncode == 0, (
        f"bench_mixer --cpu failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    with open(out) as f:
        return out, json.load(f)


@pytest.mark.slow  # a benchmark's CPU smoke, make test-slow (CI's two cores go to the package's own tests)
def test_cpu_run_schema(cpu_run):
    _, data = cpu_run
    bench = _load_bench()
    assert data["schema"] == bench.SCHEMA
    assert data["complete"] is True
    header = data["header"]
    for key in ("date", "git_commit", "hardware", "versions", "backend_module"):
        assert key in header, key
    for key in ("torch", "triton", "deepspeed", "mamba_ssm", "causal_conv1d", "nccl"):
        assert key in header["versions"], key
    assert header["versions"]["torch"] and header["versions"]["deepspeed"]
    assert header["hardware"]["world_size"] == 2

    cells, modes = data["config"]["cells"], data["config"]["modes"]
    assert modes == list(bench.MODES)  # --cpu runs every mode by default
    assert data["config"]["graphs"] is False
    records = data["records"]
    seen = {}
    for r in records:
        assert r.keys() >= RECORD_KEYS, RECORD_KEYS - r.keys()
        key = (r["seqlen"], r["batch"], r["nheads"], r["ngroups"], r["docs_per_row"], r["mode"], r["cuda_graph"])
        assert key not in seen, f"duplicate record {key}"
        seen[key] = r
    for c in cells:
        for mode in modes:
            r = seen.get((c["seqlen"], c["batch"], c["nheads"], c["ngroups"], c["docs"], mode, False))
            assert r is not None, f"no record for mode {mode} in cell {c}"
            assert r["cp"] == 2 and r["cuda_graph"] is False
            # on CPU nothing may fail: a mode either runs or is skipped with a reason (a missing module)
            assert r["status"] in ("ok", "skipped"), f"{mode} {c}: {r['status']}: {r.get('reason')}"
            if r["status"] == "skipped":
                assert r.get("reason"), f"{mode} {c} skipped without a reason"
                continue
            assert r.keys() >= OK_KEYS, OK_KEYS - r.keys()
            assert r["fwd_bwd_ms"] > 0 and r["host_ms"] > 0
            assert len(r["rank_median_ms"]) == 2 and min(r["rank_median_ms"]) > 0
            assert r["fwd_bwd_ms"] == max(r["rank_median_ms"])  # the rank maximum of the medians
            assert r["peak_mem_gib"] is None  # no allocator statistics on CPU
        for mode in ("ideal", "state_passing", "virtual", "ulysses_compute", "ulysses_a2a"):
            r = seen[(c["seqlen"], c["batch"], c["nheads"], c["ngroups"], c["docs"], mode, False)]
            assert r["status"] == "ok", f"{mode} must run on CPU: {r.get('reason')}"
        sp = seen[(c["seqlen"], c["batch"], c["nheads"], c["ngroups"], c["docs"], "state_passing", False)]
        assert sp["pct_of_ideal"] > 0


@pytest.mark.slow  # a benchmark's CPU smoke, make test-slow (CI's two cores go to the package's own tests)
def test_report_renders(cpu_run, tmp_path):
    path, data = cpu_run
    prefix = tmp_path / "report"
    cmd = [sys.executable, REPORT, str(path), "--out", str(prefix)]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    if not has_mpl:
        cmd.append("--no-plot")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = (tmp_path / "report.md").read_text()
    assert "| L | mode | fwd+bwd ms | vs ulysses | % of ideal | peak GiB |" in text
    for r in data["records"]:
        if r["status"] == "ok":
            assert f"| {r['mode']} | " in text
    assert "## Targets (issue 5 item 4)" in text
    assert "honest baseline" in proc.stdout and ("PASS" in proc.stdout or "MISS" in proc.stdout)
    if has_mpl:
        assert (tmp_path / "report.png").stat().st_size > 0


def test_suites_and_payload():
    bench = _load_bench()
    default = bench.SUITES["default"]
    K = 1024
    # issue 5 item 2, the most important cells first
    assert [(c.seqlen, c.batch, c.nheads) for c in default[:4]] == [(L * K, 1, 64) for L in (8, 16, 32, 128)]
    expect = {(L * K, 1, 64, 8) for L in (4, 8, 16, 32, 64, 128, 256)}
    expect |= {(4 * K, 3, 64, 8), (8 * K, 3, 64, 8), (32 * K, 1, 32, 4), (128 * K, 1, 32, 4)}
    assert {(c.seqlen, c.batch, c.nheads, c.ngroups) for c in default} == expect and len(default) == len(expect)
    assert bench.SUITES["part1"] + bench.SUITES["part2"] == default

    # the raw all-to-all moves what the traffic model says ulysses moves, B/C sharded or replicated
    import torch

    from ds_mamba_spcp.engine import traffic

    for cp, nheads, ngroups in [(2, 64, 8), (2, 32, 4), (4, 8, 2), (8, 16, 1)]:
        dims = bench.Dims(headdim=64, dstate=128, d_conv=4, chunk_size=128, dtype="bfloat16", rmsnorm=False)
        ctx = bench.Context(rank=0, cp=cp, device=torch.device("cpu"), backend="auto", dims=dims)
        cell = bench.Cell(seqlen=1024 * cp, batch=2, nheads=nheads, ngroups=ngroups)
        w_in, w_out = bench.ulysses_payload_widths(cell, ctx)
        tokens = cell.batch * cell.seqlen // cp
        sent = 2 * tokens * (w_in + w_out) * 2 * (cp - 1) // cp  # 4 all-to-alls, bf16, own slot stays
        assert sent == traffic.ulysses_bytes(batch=2, local_seqlen=1024, nheads=nheads, headdim=64, ngroups=ngroups,
                                             dstate=128, cp=cp, dtype=torch.bfloat16)  # fmt: skip


def _load_report():
    if "bench_report" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_report", REPORT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_report"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_report"]


def test_target_check_verdicts():
    """The issue-5 target check on hand-made records (not measurements): one PASS, one MISS and
    one NO DATA per kind of comparison, at the thresholds' edges."""
    report = _load_report()
    L = 128 * 1024

    def rec(mode, ms, graph=False, mem=None, seqlen=L):
        return dict(mode=mode, cp=2, seqlen=seqlen, batch=1, nheads=64, ngroups=8, cuda_graph=graph, status="ok",
                    fwd_bwd_ms=ms, peak_mem_gib=mem)  # fmt: skip

    records = [
        rec("ideal", 17.0, mem=10.0), rec("state_passing", 18.0, mem=10.4), rec("virtual", 21.0),
        rec("ulysses", 27.0), rec("ulysses_compute", 18.0), rec("ulysses_a2a", 6.0),
        rec("ideal", 2.0, graph=True, seqlen=8 * 1024), rec("state_passing", 2.4, graph=True, seqlen=8 * 1024),
    ]  # fmt: skip
    targets = dict(report.check_targets(report.Index(records)))

    def only(prefix):
        (rows,) = [rows for name, rows in targets.items() if name.startswith(prefix)]
        return rows

    assert [r[2] for r in only("L=128K, batch 1, eager: state_passing")] == ["PASS"]  # 27/18 = 1.5 >= 1.35
    assert [r[2] for r in only("L=128K, batch 1, eager: virtual")] == ["MISS"]  # 27/21 = 1.29 < 1.3
    assert [r[2] for r in only("every L >= 32K, eager")] == ["PASS"]  # 17/18 = 0.94
    assert [r[2] for r in only("every L >= 32K, CUDA graphs")] == ["NO DATA"]  # no graph record at 128K
    # cells in increasing L: 8K has graph records only, so the eager checks have no data there
    assert [r[2] for r in only("honest baseline, eager")] == ["NO DATA", "PASS"]  # 27 / (18 + 6) = 1.125 <= 1.15
    assert [r[2] for r in only("honest baseline, CUDA graphs")] == ["NO DATA", "NO DATA"]  # no graph ulysses
    assert [r[2] for r in only("state_passing peak memory")] == ["NO DATA", "PASS"]  # 10.4 / 10 = 1.04 <= 1.05
    graph_ideal = only("CUDA graphs, every L >= 8K")
    assert [r[2] for r in graph_ideal] == ["MISS", "NO DATA"]  # 2.4/2.0 = 1.2 > 1.15 at 8K; 128K has no graph data
    assert report.verdict(only("CUDA graphs, L=8K and 16K")) == "NO DATA"


def test_report_keeps_cells_of_one_length_in_different_tiles_apart():
    """bench_mixer's 32K:16K and 32K:8K cells share L = 32K: each tile length is a section of its own (the report
    used to keep only the last one read). Hand-made records, not measurements."""
    report = _load_report()
    K = 1024

    def rec(mode, ms, tile, graph=False):
        return dict(mode=mode, cp=1, seqlen=32 * K, batch=1, nheads=64, ngroups=8, cuda_graph=graph, status="ok",
                    fwd_bwd_ms=ms, peak_mem_gib=None, tile_length=tile)  # fmt: skip

    records = [rec("ideal", 7.5, 16 * K), rec("state_passing", 8.1, 16 * K), rec("ideal", 7.5, 8 * K),
               rec("state_passing", 13.4, 8 * K)]  # fmt: skip
    idx = report.Index(records)
    assert len(idx.shapes()) == 2
    text = report.markdown([dict(file="hand-made.json", complete=True)], idx, report.check_targets(idx))
    assert "tiles of 16K" in text and "tiles of 8K" in text, text
    assert "8.10" in text and "13.40" in text, text


@pytest.mark.slow  # a benchmark's CPU smoke, make test-slow (CI's two cores go to the package's own tests)
def test_profile_host_cpu(tmp_path):
    """benchmarks/probes/profile_host.py on 2 gloo ranks: one profile per mode, naming the op's own code."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), os.path.join(REPO, "benchmarks", "probes", "profile_host.py"), "--cpu",
           "--iters", "3", "--modes", "ideal,state_passing", "--out", str(tmp_path)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    finally:
        remove_deepspeed_shm_buffers(port)
    assert proc.returncode == 0, (
        f"profile_host failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    assert sorted(os.listdir(tmp_path)) == ["host_ideal.txt", "host_state_passing.txt"]
    text = (tmp_path / "host_state_passing.txt").read_text()
    assert text.startswith("state_passing L=64 b=1 h=4 g=2 cp=2: host ") and "by cumulative" in text
    assert "state_passing.py" in text  # the profile reaches into the op's code


def test_target_check_cp4_cp8():
    """Issue 7's targets on hand-made records (not measurements): chosen by the records' cp, one
    PASS / MISS / NO DATA at the thresholds' edges; records of two sizes are refused."""
    report = _load_report()
    K = 1024

    def rec(mode, ms, seqlen, cp):
        return dict(mode=mode, cp=cp, seqlen=seqlen, batch=1, nheads=64, ngroups=8, cuda_graph=False, status="ok",
                    fwd_bwd_ms=ms, peak_mem_gib=None)  # fmt: skip

    cp4 = [rec("ulysses", 18.0, 128 * K, 4), rec("state_passing", 10.0, 128 * K, 4), rec("virtual", 10.5, 128 * K, 4),
           rec("ulysses", 3.2, 4 * K, 4), rec("state_passing", 2.5, 4 * K, 4)]  # fmt: skip
    t4 = report.check_targets(report.Index(cp4))
    assert [name.split(",")[0] for name, _ in t4] == ["cp=4", "cp=4"]
    assert [r[2] for r in t4[0][1]] == ["PASS", "MISS"]  # 18/10 = 1.8; 18/10.5 = 1.71
    assert [r[2] for r in t4[1][1]] == ["PASS", "NO DATA"]  # 3.2/2.5 = 1.28; no virtual record at 4K

    cp8 = [rec("ulysses", 1.1, 32 * K, 8), rec("state_passing", 1.0, 32 * K, 8), rec("virtual", 0.9, 32 * K, 8),
           rec("ulysses", 9.0, 64 * K, 8), rec("state_passing", 1.0, 64 * K, 8)]  # fmt: skip
    t8 = dict(report.check_targets(report.Index(cp8)))
    (short,) = [rows for name, rows in t8.items() if "short local" in name]
    assert [r[2] for r in short] == ["MISS", "PASS"]  # only L=32K has 4K tokens per rank: 1.1, 1.22
    assert report.verdict(next(rows for name, rows in t8.items() if "128K" in name)) == "NO DATA"
    with pytest.raises(SystemExit, match="one size at a time"):
        report.check_targets(report.Index(cp4 + cp8))


@pytest.mark.slow  # a benchmark's CPU smoke, make test-slow (CI's two cores go to the package's own tests)
def test_packed_cells_run_every_mode(cpu_run):
    """--docs-per-row 0,3: every cell twice, unpacked and with 3 documents per row, recorded as such."""
    _, data = cpu_run
    assert data["config"]["docs_per_row"] == [0, 3]
    by_docs = {}
    for r in data["records"]:
        by_docs.setdefault(r["docs_per_row"], []).append(r)
    assert set(by_docs) == {0, 3} and len(by_docs[0]) == len(by_docs[3])
    packed_ok = {r["mode"] for r in by_docs[3] if r["status"] == "ok"}
    assert {"ideal", "state_passing", "virtual", "permute_p2p", "permute_a2a", "ulysses"} <= packed_ok


def test_probe_host_sync_steps_cpu():
    """benchmarks/probes/probe_host_sync.py times on CUDA only; its steps are built here on CPU (bench_mixer's CPU dims,
    fp32, the reference backend) and each tiled call must give the whole op's output and gradients. Tiles
    reorder the fp32 chunk sums only, so 1e-4 relative is loose (seen 4.5e-7); the same tiles each run from a zero
    state and no halo (what a call that lost the tiles' chain would give) are 0.12 off."""
    bench = _load_bench()
    spec = importlib.util.spec_from_file_location("probe_host_sync", os.path.join(REPO, "benchmarks", "probes",
                                                                                   "probe_host_sync.py"))  # fmt: skip
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    import torch

    bargs = bench.parse_args(["--cpu", "--seqlens", "128"])
    ctx = bench.Context(rank=0, cp=1, device=torch.device("cpu"), backend="reference", dims=bargs.dims)
    torch.manual_seed(0)
    inp, steps = probe.steps_of(bargs.cells[0], ctx, [32, 64])
    assert sorted(steps) == ["ideal", "tiles_32", "tiles_64"]
    results = {}
    for name, fwd in steps.items():
        out = fwd()
        results[name] = [out.detach(), *torch.autograd.grad(out, inp.leaves, inp.dout)]
    for name in ("tiles_32", "tiles_64"):
        for got, want in zip(results[name], results["ideal"]):
            assert ((got - want).norm() / want.norm()).item() < 1e-4, name


@pytest.mark.slow  # a benchmark's smoke (make test-slow; the device stage tiled_sp runs the benchmark): the tiled
# layers at sp 2 are checked by tests/test_tiled_block.py in make test, tiled_block.PHASES only here
def test_bench_tiled_sp_cpu(tmp_path):
    """benchmarks/bench_tiled_sp.py --device cpu (the tiny preset, fp32, two gloo ranks, one spawn): every setting's
    record, each with the phases tiled_block.py marks for its Function (sp 1: TiledFn's two; sp 2: ShardTiledFn's
    eight), phases that fit in the iteration they were timed in (on CPU nothing runs asynchronously), the Markdown's
    ratio column. Times mean nothing here."""
    out = tmp_path / "tiled_sp.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_tiled_sp.py"), "--device", "cpu", "--out", str(out),
           "--no-progress", "--git-commit", "test"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"bench_tiled_sp failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    data = json.loads(out.read_text())
    assert data["schema"] == "ds_mamba_spcp.bench_tiled_sp/1" and data["complete"] is True
    assert data["header"]["git_commit"] == "test"
    records = {r["setting"]: r for r in data["records"]}
    assert sorted(records) == ["sp1", "sp2_shared", "sp2_turns"], records
    want = {
        "sp1": {"fwd_tiles", "bwd_tiles"},
        "sp2": {"fwd_halo", "summary", "exchange", "pass2", "bwd_pass1", "bwd_exchange", "bwd_pass2", "bwd_halo"},
    }
    for setting, r in records.items():
        assert r["status"] == "ok", (setting, r.get("reason"))
        assert set(r["phases_ms"]) == want[setting[:3]], (setting, r["phases_ms"])
        assert all(v >= 0 for v in r["phases_ms"].values()) and r["phases_sum_ms"] > 0
        assert len(r["per_rank"]) == (1 if setting == "sp1" else 2)
        if setting != "sp2_turns":
            assert r["fwd_bwd_ms"] > 0 and r["rest_ms"] >= 0, r  # the phases lie inside the timed iteration
    (ratio,) = data["ratios"]  # sp 2 over sp 1 at the one L_shard
    assert ratio["shard_length"] == 64 and ratio["shared_over_sp1"] > 0 and ratio["turns_over_sp1"] > 0, ratio
    text = (tmp_path / "tiled_sp.md").read_text()
    assert "| shared / sp 1 |" in text and "| 64 | sp2_turns |" in text, text


def test_one_config_sitecustomize_leaves_one_config(tmp_path):
    """benchmarks/one_config (device_one_gpu.sh ONE_CONFIG=1): with its switch on, a fresh interpreter's autotuners
    keep the first of their configs after the kernel's own pruning; with it off (the negative control), all three."""
    code = """if True:
        import triton, triton.language as tl
        def prune(configs, nargs, **kw):  # the kernel's own pruning runs first
            return configs[1:]
        @triton.autotune(configs=[triton.Config({"B": b}) for b in (8, 16, 32, 64)], key=[],
                         prune_configs_by={"early_config_prune": prune})
        @triton.jit
        def k(x, B: tl.constexpr):
            pass
        k.nargs = {}
        print([c.kwargs["B"] for c in k.prune_configs({})])"""
    script = tmp_path / "tuned.py"  # Triton reads a kernel's source from its file
    script.write_text(code)
    seen = {}
    for switch in ("1", "0"):
        env = {**_env(), "DS_MAMBA_SPCP_ONE_CONFIG": switch}
        env["PYTHONPATH"] = os.path.join(REPO, "benchmarks", "one_config") + os.pathsep + env["PYTHONPATH"]
        run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        seen[switch] = run.stdout.strip()
    assert seen == {"1": "[16]", "0": "[16, 32, 64]"}, seen


def test_bench_dqkwg_cpu(tmp_path):
    """benchmarks/bench_dqkwg.py --device cpu: the PyTorch function's cell timed, the CUDA cells recorded "n/a" with
    why (not errors), the JSON's schema and the Markdown's row. Times mean nothing here."""
    out = tmp_path / "dqkwg.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_dqkwg.py"), "--device", "cpu", "--out", str(out),
           "--iters", "2", "--warmup", "1", "--git-commit", "test"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"bench_dqkwg failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    data = json.loads(out.read_text())
    assert data["schema"] == "ds_mamba_spcp.bench_dqkwg/1" and data["header"]["git_commit"] == "test"
    cells = {r["cell"]: r for r in data["records"]}
    assert cells["dqkwg_pytorch"]["status"] == "ok" and len(cells["dqkwg_pytorch"]["times_ms"]) == 2
    assert all(cells[c]["status"] == "n/a" and "CUDA" in cells[c]["reason"] for c in cells if c != "dqkwg_pytorch")
    assert "| 256 | n/a |" in (tmp_path / "dqkwg.md").read_text()
