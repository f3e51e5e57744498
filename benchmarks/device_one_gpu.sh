#!/usr/bin/env bash
# The one-GPU measurements of issues 23 and 24, one stage per device call (each under ~9 minutes; host_time, sync,
# longest and offload ran at 7349b3b: benchmarks/results/{tiles_host_7349b3b,host_sync_7349b3b,
# longest_130m_block_tiles,offload}_h200x1.*):
#   carry [".whl"] (../shared/device/stage.sh), then:
#   bash benchmarks/device_one_gpu.sh COMMIT STAGE
# STAGE:
#   tests       the one-GPU tests of the final tree: the launch path, the conv's C++ path, graphs, offload, tiles, the tiled block, the prefill
#               (TESTS= picks them, TEST_TIMEOUT= seconds each, 290 by default)
#               (transformers 5.24 from .whl/extra when it is there)
#   tests_parallel  the same files and test_gpu, test_gpu_shared, test_hf_gpu, test_accelerate's GPU test, all at once
#   host_time   issue 23's three cells (eager, whole-step graph, the op's cuda_graphs mode) and the launch lists
#   sync        issue 23: does the step's host wait for the GPU? (benchmarks/probe_host_sync.py)
#   launch      issue 23: each launch layer's host cost, where a step's host time goes, the conv's two paths
#               alternating (benchmarks/probe_launch_cost.py --all; results/launch_cost_023b81d_h200x1.json)
#   fast_launch issue 23: ops/launch.py (DS_MAMBA_SPCP_FAST_LAUNCH): its GPU test in check mode, then the two launch
#               paths alternating step by step (probe_launch_cost.py --ab-launch), then bench_mixer's eager cells
#               on each path; fast_launch_test: its first two steps alone; fast_launch_bench: the bench cells
#               twice more, old / new / old / new
#   programs_test  issue 23: tests/test_gpu_launch.py (the launch layer, and programs in check mode and replayed; it
#               timed out at 240 s on a cold machine at 43a31a5: 420 s by default now)
#   programs    issue 23: ops/programs.py: the three paths alternating step by step (probe_launch_cost.py
#               --ab-programs), bench_mixer's eager and graph cells (results/programs_43a31a5_h200x1/)
#   pass_states issue 23: ops/pass_states.py's kernels alone against mamba-ssm's (benchmarks/probe_state_passing.py),
#               then bench_mixer's eager and graph cells with mamba-ssm's state passing and with ours, alternating
#               (DS_MAMBA_SPCP_STATE_PASSING=upstream / prefetch; RUNS= pairs, 2 by default)
#   longest     issue 24: the 130M with block tiles of 32,768 at 3,145,728 and 3,407,872 (its longest at 7349b3b;
#               a search from 1,572,864 with 150 s trials timed out on its first, cold trial)
#   offload     issue 24: the 780M with the pinned pool at 524,288 and 786,432 (budget 0), and 1,048,576 with
#               block tiles and a GPU budget of 36 GiB (the GPU keeps 12 of the 48 checkpoints, the host 36: 108 GiB)
# Results land in $OUT (JSON + Markdown + logs); copy them into benchmarks/results/ with the commit named.
set -u
commit=${1:?commit} stage=${2:?stage}
source .whl/install-on-device.sh >/dev/null || exit 1
if ls .whl/extra/*.whl >/dev/null 2>&1; then
    pip install -q --no-index --no-deps --target /tmp/site2 .whl/extra/*.whl >/dev/null 2>&1
    export PYTHONPATH=/tmp/site2:$PYTHONPATH
fi
export MAMBA_DETERMINISTIC=1 TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
out=${OUT:-/tmp/ds_mamba_spcp_out}
mkdir -p "$out"
# A fresh machine compiles for minutes: a Triton cache carried as .devtmp/tc.tgz (git-excluded) is unpacked first.
# (Sending the cache back does not work: after one stage it is ~25 MB, over the 16 MiB a returned file may be.)
[ -f .devtmp/tc.tgz ] && [ ! -d /tmp/tc ] && tar xzf .devtmp/tc.tgz -C /tmp
bench_pair() {  # bench_mixer's eager cells through Triton's launch path, then through ops/launch.py
    for v in 0 1; do
        DS_MAMBA_SPCP_FAST_LAUNCH=$v timeout 100 python3 benchmarks/bench_mixer.py --seqlens 128K:32K,32K:16K,32K:8K \
            --modes ideal,state_passing --iters 10 --warmup 5 --no-progress --git-commit "$commit" \
            --out "$out/bench_fast${v}_$1.json" >> "$out/bench_fast.log" 2>&1
        echo "bench fast_launch=$v run $1 exit $?"
    done
}
case "$stage" in
tests)
    for t in ${TESTS:-test_gpu_launch test_gpu_conv test_gpu_graphs test_gpu_offload test_gpu_tiles test_gpu_tiled_block test_prefill_gpu}; do
        timeout "${TEST_TIMEOUT:-290}" python3 -m pytest -m gpu -q -s -p no:cacheprovider "tests/$t.py" > "$out/$t.log" 2>&1
        echo "$t exit $?: $(grep -E '[0-9]+ (passed|failed)' "$out/$t.log" | tail -1)"
    done ;;
tests_parallel)  # every one-GPU test file at once, one process each (16 cores compile in parallel; peaks are per process)
    files=${TESTS:-"test_gpu_launch test_gpu_conv test_gpu_graphs test_gpu_offload test_gpu_tiles test_gpu_tiled_block test_prefill_gpu test_gpu test_gpu_shared test_hf_gpu test_accelerate"}
    for t in $files; do
        timeout "${TEST_TIMEOUT:-520}" python3 -u -m pytest -m gpu -q -s -p no:cacheprovider "tests/$t.py" > "$out/$t.log" 2>&1 &
    done
    wait
    for t in $files; do echo "$t: $(grep -E '[0-9]+ (passed|failed|error)' "$out/$t.log" | tail -1)"; done ;;
host_time)
    timeout 240 python3 benchmarks/bench_mixer.py --seqlens 128K:32K,32K:16K,32K:8K \
        --modes ideal,state_passing,sp_cuda_graphs --graphs --iters 10 --warmup 5 --no-progress \
        --git-commit "$commit" --out "$out/tiles_host_h200x1.json" > "$out/bench.log" 2>&1
    echo "bench exit $?"; tail -2 "$out/bench.log"
    timeout 120 python3 benchmarks/profile_host.py --seqlen 32K --tile-length 8K --modes ideal,state_passing \
        --kernels --iters 10 --out "$out/profile_32k_tile8k" 2>&1 | grep launches ;;
sync)
    timeout 240 python3 benchmarks/probe_host_sync.py --out "$out/host_sync_h200x1.json" > "$out/sync.log" 2>&1
    echo "probe exit $?" ;;
launch)
    timeout 240 python3 benchmarks/probe_launch_cost.py --all --steps 30 --out "$out/launch_cost_h200x1.json" \
        > "$out/launch.log" 2>&1
    echo "probe exit $?"; grep -E "^(ideal|tiles)" "$out/launch.log" | head -3 ;;
fast_launch_test)  # fast_launch's first two steps alone (a cold machine compiles for most of a call)
    timeout 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_launch.py > "$out/test_gpu_launch.log" 2>&1
    echo "test_gpu_launch exit $?: $(grep -E '[0-9]+ (passed|failed)' "$out/test_gpu_launch.log" | tail -1)"
    timeout 150 python3 benchmarks/probe_launch_cost.py --ab-launch ideal,tiles_16k,tiles_8k --steps 20 \
        --out "$out/ab_launch_h200x1.json" > "$out/ab_launch.log" 2>&1
    echo "probe exit $?"; grep -E "^(ideal|tiles)" "$out/ab_launch.log" | cut -c1-240 ;;
fast_launch)
    timeout 300 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_launch.py > "$out/test_gpu_launch.log" 2>&1
    echo "test_gpu_launch exit $?: $(grep -E '[0-9]+ (passed|failed)' "$out/test_gpu_launch.log" | tail -1)"
    timeout 120 python3 benchmarks/probe_launch_cost.py --ab-launch ideal,tiles_16k,tiles_8k --steps 20 \
        --out "$out/ab_launch_h200x1.json" > "$out/ab_launch.log" 2>&1
    echo "probe exit $?"; grep -E "^(ideal|tiles)" "$out/ab_launch.log" | cut -c1-240
    bench_pair 1 ;;
programs_test)  # ops/programs.py's GPU test (in test_gpu_launch: check mode, replays); a cold machine compiles most of it
    timeout "${TEST_TIMEOUT:-420}" python3 -u -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_launch.py \
        > "$out/test_gpu_launch.log" 2>&1
    echo "test_gpu_launch exit $?: $(grep -E '[0-9]+ (passed|failed)' "$out/test_gpu_launch.log" | tail -1)" ;;
programs)  # ops/programs.py: the three paths alternating, then bench_mixer's eager and graph cells
    timeout 150 python3 benchmarks/probe_launch_cost.py --ab-programs ideal,tiles_16k,tiles_8k --steps 20 \
        --out "$out/ab_programs_h200x1.json" > "$out/ab_programs.log" 2>&1
    echo "probe exit $?"; grep -E "^(ideal|tiles)" "$out/ab_programs.log" | cut -c1-300
    timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_mixer.py --seqlens 128K:32K,32K:16K,32K:8K \
        --modes ideal,state_passing --iters 10 --warmup 5 --no-progress --git-commit "$commit" \
        --out "$out/bench_programs.json" > "$out/bench_programs.log" 2>&1
    echo "bench exit $?"; tail -3 "$out/bench_programs.log" ;;
fast_launch_bench)
    bench_pair 1; bench_pair 2 ;;
pass_states)
    timeout 200 python3 benchmarks/probe_state_passing.py --nchunks 64,128,256,1024 ${PROBE_ARGS:-} --git-commit "$commit" \
        --out "$out/probe_state_passing_h200x1.json" > "$out/probe_state_passing.log" 2>&1
    echo "probe exit $?"; grep -E "^(nchunks|all|NOT)" "$out/probe_state_passing.log" | cut -c1-600
    for run in $(seq "${RUNS:-2}"); do
        for sp in upstream prefetch; do
            DS_MAMBA_SPCP_STATE_PASSING=$sp timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_mixer.py \
                --seqlens 128K:32K,32K:16K,32K:8K --modes ideal,state_passing --iters 10 --warmup 5 --no-progress \
                --git-commit "$commit" --out "$out/bench_${sp}_run$run.json" >> "$out/bench_pass_states.log" 2>&1
            echo "bench $sp run $run exit $?: $(python3 benchmarks/report.py --ratios "$out/bench_${sp}_run$run.json")"
        done
    done ;;
fast_launch_bench_tests)  # the two bench pairs, then the tests stage (TESTS= to choose) on the warm cache
    bench_pair 1; bench_pair 2; bash "$0" "$commit" tests ;;
longest)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 540 python3 benchmarks/train_runs.py \
        --preset mamba-130m --lengths 3145728,3407872 --block-tile-tokens 32768 --trial-timeout 270 \
        --git-commit "$commit" --out "$out/longest_130m_block_tiles_h200x1.json" > "$out/longest.log" 2>&1
    echo "runs exit $?"; grep "L=" "$out/longest.log" | cut -c1-200 ;;
offload)
    O=(--git-commit "$commit" --out "$out/offload_h200x1.json" --preset mamba-780m --offload)
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    timeout 170 python3 benchmarks/train_runs.py "${O[@]}" --lengths 524288 --trial-timeout 150 > "$out/o1.log" 2>&1
    timeout 200 python3 benchmarks/train_runs.py "${O[@]}" --lengths 786432 --trial-timeout 180 > "$out/o2.log" 2>&1
    timeout 200 python3 benchmarks/train_runs.py "${O[@]}" --lengths 1048576 --block-tile-tokens 32768 \
        --offload-gpu-budget-gib 36 --trial-timeout 180 > "$out/o3.log" 2>&1
    grep -h "L=" "$out"/o[123].log | cut -c1-200 ;;
*)
    echo "unknown stage $stage (tests, tests_parallel, host_time, sync, launch, fast_launch, fast_launch_test, fast_launch_bench, fast_launch_bench_tests, programs_test, programs, pass_states, longest, offload)"; exit 2 ;;
esac
