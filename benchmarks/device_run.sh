#!/usr/bin/env bash
# One call on the 2-GPU device machine: the benchmark suite, then the GPU test suite in the time left.
#   carry [".whl"] (../shared/device/stage.sh), then:
#   bash benchmarks/device_run.sh COMMIT BENCH_BUDGET_S TEST_TIMEOUT_S [GPU_CASES_REGEX]
# Results land in $OUT: mixer_h200x2.json (+ bench.log), gpu/*.json (+ gpu/pytest.log).
set -u
commit=$1 bench_budget=$2 test_timeout=$3 cases=${4:-}
source .whl/install-on-device.sh || exit 1
export TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1  # shared by both runs
out=${OUT:-/tmp/ds_mamba_spcp_out}
mkdir -p "$out/gpu"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu/nvidia_smi.txt"
timeout $((bench_budget + 90)) python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
    benchmarks/bench_mixer.py --suite default --time-budget "$bench_budget" --git-commit "$commit" \
    --out "$out/mixer_h200x2.json" > "$out/bench.log" 2>&1
echo "benchmark exit $?"; grep -v -i warn "$out/bench.log" | tail -25
DS_MAMBA_SPCP_GPU_REPORT="$out/gpu" DS_MAMBA_SPCP_GPU_CASES="$cases" timeout "$test_timeout" \
    python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu.py > "$out/gpu/pytest.log" 2>&1
echo "gpu tests exit $?"; tail -40 "$out/gpu/pytest.log"
