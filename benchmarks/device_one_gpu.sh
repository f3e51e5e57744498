#!/usr/bin/env bash
# One device call per stage on one H200 (hf_long with SP=N: on N H200s), each well under the 10-minute limit of a call:
#   carry [".whl"] (../shared/device/stage.sh), then:
#   bash benchmarks/device_one_gpu.sh COMMIT STAGE
# STAGE:
#   tests        every one-GPU test file at once, one process each (TESTS= picks them, TEST_TIMEOUT= seconds each,
#                520 by default; transformers 5.24 from .whl/extra when it is there); ONE_CONFIG=1: each Triton
#                autotuner runs its first config (a cold machine's minutes of tuning saved; tests only, never timings)
#   cells        bench_mixer's one-GPU cells, eager and CUDA graph: 128K in 4 tiles of 32K, 32K in 2 tiles of 16K and
#                in 4 of 8K, against mamba-ssm's op (the ideal column); RUNS= repeats (2 by default)
#   pass_states  ops/pass_states.py's kernels alone against mamba-ssm's (benchmarks/probes/probe_state_passing.py)
#   longest      the 130M with block tiles of 32,768 at 3,145,728 and 3,407,872 tokens
#   offload      the 780M with the pinned pool at 524,288 and 786,432 (budget 0), and 1,048,576 with block tiles and a
#                GPU budget of 36 GiB
#   hf_long      benchmarks/train_hf.py: hf-bamba-2b (PRESET=) through transformers' Trainer. COMPARE_AT=L: L on both paths
#                (transformers' and long-context) and the ratio of their last steps; LENGTHS=a,b or
#                SEARCH="START FACTOR MAX": on the long-context path (LONG=0: transformers' path). BUDGET_GIB=
#                long_context.offload_gpu_budget_gib, TILE= tile_tokens, STEPS= (2), NAME= of the JSON (hf_long),
#                TRIAL_TIMEOUT= seconds per trial (530), STAGE_TIMEOUT= seconds in all (560), PARTS_OFF= parts.
#                SP=N: N ranks share each row (lengths are the row's), rank r on cuda:r: the call's kind has N GPUs
#                (nvidia-h200-x2, -x8; the JSON is NAME_h200xN); SHARED=1: every rank on the one GPU (gloo);
#                PEAK_CHECK=L (with SP=N >= 2, one GPU): one process at L against N ranks sharing the GPU at N*L.
#                TRAINER=sft: TRL's SFTTrainer (packed rows, DOCS= documents a row; COMPARE_AT=L then sets TRL without
#                the key beside it), GA= gradient accumulation steps (1), PADDED=1: batches of two right-padded rows
#                (L and 3L/4). TRL needs trl, datasets, dill and multiprocess (in .whl/extra, carried with .whl) and
#                accelerate, tokenizers, pyarrow (>= 24), pandas, xxhash, fsspec, jinja2 on the machine: the stage
#                names any that is missing before it starts (carry its wheel in .whl/extra). Padded rows: sdpa builds
#                an (L x L) mask per attention layer (16 GiB at 65,536), so keep them short.
#                  1 H200:   TRAINER=sft GA=2 STEPS=3 COMPARE_AT=65536 NAME=hf_sft ... COMMIT hf_long
#                  1 H200:   TRAINER=sft GA=2 STEPS=3 SEARCH="131072 1.5 1600000" BUDGET_GIB=16 NAME=hf_sft_long ...
#                  1 H200:   TRAINER=sft GA=2 PADDED=1 STEPS=3 LENGTHS=65536 NAME=hf_sft_padded ... COMMIT hf_long
#                  8 H200s:  DETACH=1 SP=8 LENGTHS=8388608 STEPS=3 BUDGET_GIB=40 NAME=hf_sp8 ... COMMIT hf_long
#                  2 H200s:  DETACH=1 SP=2 LENGTHS=2097152 STEPS=3 BUDGET_GIB=16 NAME=hf_sp2 ... COMMIT hf_long
#                  1 H200:   SP=2 PEAK_CHECK=262144 NAME=hf_peak ... COMMIT hf_long
#                ZERO=3: ZeRO stage 3 (the default 2), e.g. ZeRO-3 against ZeRO-2 at one length, two calls:
#                  1 H200:   LENGTHS=262144 ZERO=3 NAME=hf_zero3 ... COMMIT hf_long   (ZERO=2 NAME=hf_zero2 beside it)
#                DETACH=1: the run started detached (setsid nohup) and the stage returns at once: its JSON, Markdown
#                and log under DETACH_DIR (/tmp/hf_detached, emptied first), the ranks' own logs in its work/; the
#                limits then TRIAL_TIMEOUT= 1680 and STAGE_TIMEOUT= 1700 (the machine's 30 minutes); `collect` below
#                  1 H200:   DETACH=1 LENGTHS=1048576 STEPS=3 BUDGET_GIB=8 NAME=hf_1m ... COMMIT hf_long
#                PRESET= train_hf's preset (hf-bamba-2b). hf-qwen35-2b (issue 44: Qwen3.5-style, 2.00B, 3 Gated DeltaNet
#                layers to 1 attention layer): the key's parts that apply (delta layers recomputed whole; their
#                backward on fla, with ops/delta_dqkwg.py where fla refuses its kernel: one H100 trains 65,536 tokens
#                at 6.35 s a step with its PyTorch function (80 s on the op's PyTorch backward before it), and with
#                its Triton kernel 212,992 at most, 24.6 s a step, benchmarks/results/dqkwg_0b0ba72_h100x1/); the
#                longest that trains 3 steps:
#                  1 H200:   DETACH=1 PRESET=hf-qwen35-2b SEARCH="229376 1.25 1048576" STEPS=3 BUDGET_GIB=8
#                            NAME=hf_qwen35_long ... COMMIT hf_long   (then `collect`)
#   collect      waits up to WAIT_S= seconds (540) for the run DETACH=1 started, printing its new [train_hf] lines (the
#                driver's and rank 0's, its steps) every POLL_S= seconds (20), then copies its JSON, Markdown and logs
#                into $OUT; "still running" if it has not ended (collect again); exit status: the run's, else 3
#   tiled_sp     benchmarks/bench_tiled_sp.py (issue 43 item 3): a tiled hf-bamba-2b decoder layer, forward+backward
#                per rank at sp 1 (L_shard tokens) against sp 2 (2 ranks sharing the GPU through gloo, each holding
#                L_shard; and taking turns at each compute phase), every phase (summary, exchange, correction,
#                backward passes); L_shard 64K and 128K in tiles of 16K. TILED_ARGS= more arguments (e.g.
#                "--shard-lengths 32K --tile 8K"); BENCH_BUDGET= seconds of cells (200)
#   delta        the gated delta rule on fla (issue 44): tests/test_gpu_delta.py (cp 2 and 4 sharing the GPU, errors
#                against fp64 beside fla's own; the gated backward in one process; TEST_TIMEOUT= seconds, 230;
#                DELTA_TEST_ARGS= pytest's, e.g. "-k one_process"; ONE_CONFIG=1 as for tests), then benchmarks/bench_delta.py (state
#                passing, ulysses, fla on the shard alone; BENCH_BUDGET= seconds of cells, 70; BYPASS=0 leaves fla's
#                refused backward untimed, else it is timed with fla's Hopper check off, values unused;
#                DELTA_BENCH_ARGS= more arguments, e.g. "--seqlens 32K --cps 2"; BENCH_TIMEOUT= seconds, 150)
# Results land in $OUT (JSON + Markdown + logs); copy them into benchmarks/results/ with the commit named.
set -u
commit=${1:?commit} stage=${2:?stage}
if [ "$stage" != collect ]; then  # collect installs nothing under the detached run's feet
source .whl/install-on-device.sh >/dev/null || exit 1
if ls .whl/extra/*.whl >/dev/null 2>&1; then
    pip install -q --no-index --no-deps --target /tmp/site2 .whl/extra/*.whl >/dev/null 2>&1
    export PYTHONPATH=/tmp/site2:$PYTHONPATH
fi
fi
export MAMBA_DETERMINISTIC=1 TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
# ONE_CONFIG=1: the tests (stage tests, and delta's test) run every Triton autotuner's first config, untimed
# (benchmarks/one_config/sitecustomize.py): a cold machine skips minutes of compiling fla's and mamba-ssm's tuning
# configs. Never the timings: the benchmarks keep the tuned choice.
tests_env=(env)
[ "${ONE_CONFIG:-0}" = 1 ] && tests_env=(env DS_MAMBA_SPCP_ONE_CONFIG=1 "PYTHONPATH=$PWD/benchmarks/one_config:${PYTHONPATH:-}")
out=${OUT:-/tmp/ds_mamba_spcp_out}
mkdir -p "$out"
# A fresh machine spends minutes compiling Triton kernels. SAVE_TC=1: the Triton cache comes back as $OUT/tc.tgz
# (parts of 15 MiB, tc.tgz.aa, .ab, ...); put them in .tc/ (ignored: `echo /.tc/ >> .git/info/exclude`), carry
# [".whl", ".tc"], and the next machine starts from that cache (same GPU architecture; the autotuning choices too).
if [ ! -d /tmp/tc ] && ls .tc/tc.tgz.* >/dev/null 2>&1; then mkdir -p /tmp/tc && cat .tc/tc.tgz.* | tar xzf - -C /tmp/tc; fi
[ "${SAVE_TC:-0}" = 1 ] && trap 'tar czf - -C /tmp/tc . 2>/dev/null | split -b 15M - "$out/tc.tgz."' EXIT
case "$stage" in
tests)
    files=${TESTS:-"test_gpu_conv test_gpu_graphs test_gpu_offload test_gpu_tiles test_gpu_tiled_block test_gpu_state_path test_prefill_gpu test_gpu test_gpu_shared test_hf_gpu test_accelerate"}
    for t in $files; do
        timeout "${TEST_TIMEOUT:-520}" "${tests_env[@]}" python3 -u -m pytest -m gpu -q -s -p no:cacheprovider "tests/$t.py" > "$out/$t.log" 2>&1 &
    done
    wait
    for t in $files; do echo "$t: $(grep -E '[0-9]+ (passed|failed|error)' "$out/$t.log" | tail -1)"; done ;;
cells)
    for run in $(seq "${RUNS:-2}"); do
        timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_mixer.py --seqlens 128K:32K,32K:16K,32K:8K \
            --modes ideal,state_passing --graphs --iters 10 --warmup 5 --no-progress --git-commit "$commit" \
            --out "$out/cells_run$run.json" >> "$out/cells.log" 2>&1
        echo "cells run $run exit $?: $(python3 benchmarks/report.py --ratios "$out/cells_run$run.json")"
    done ;;
pass_states)
    timeout 200 python3 benchmarks/probes/probe_state_passing.py --nchunks 64,128,256,1024 ${PROBE_ARGS:-} \
        --git-commit "$commit" --out "$out/probe_state_passing_h200x1.json" > "$out/probe_state_passing.log" 2>&1
    echo "probe exit $?"; grep -E "^(nchunks|all|NOT)" "$out/probe_state_passing.log" | cut -c1-600 ;;
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
hf_long)
    gpus=1
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)  # the JSON names the card
    card=${card:-gpu}
    [ "${SP:-1}" -gt 1 ] && [ "${SHARED:-0}" != 1 ] && [ -z "${PEAK_CHECK:-}" ] && gpus=$SP
    dest=$out trial_s=530 stage_s=560
    if [ "${DETACH:-0}" = 1 ]; then
        dest=${DETACH_DIR:-/tmp/hf_detached} trial_s=1680 stage_s=1700
        rm -rf "$dest" && mkdir -p "$dest/work"
    fi
    H=(--preset "${PRESET:-hf-bamba-2b}" --git-commit "$commit" --steps "${STEPS:-2}" --trial-timeout "${TRIAL_TIMEOUT:-$trial_s}"
       --out "$dest/${NAME:-hf_long}_${card}x$gpus.json" --sp "${SP:-1}")
    [ -n "${ZERO:-}" ] && H+=(--zero "$ZERO")
    [ "${SHARED:-0}" = 1 ] && H+=(--shared-gpu)
    [ -n "${PEAK_CHECK:-}" ] && H+=(--peak-check "$PEAK_CHECK")
    [ "${LONG:-1}" = 1 ] && H+=(--long-context)
    [ -n "${COMPARE_AT:-}" ] && H+=(--compare-at "$COMPARE_AT")
    [ -n "${LENGTHS:-}" ] && H+=(--lengths "$LENGTHS")
    if [ -n "${SEARCH:-}" ]; then read -r s f m <<< "$SEARCH"; H+=(--search "$s" --factor "$f" --max "$m"); fi
    [ -n "${BUDGET_GIB:-}" ] && H+=(--offload-gpu-budget-gib "$BUDGET_GIB")
    [ -n "${TILE:-}" ] && H+=(--tile-tokens "$TILE")
    [ -n "${PARTS_OFF:-}" ] && H+=(--parts-off "$PARTS_OFF")
    [ -n "${TRAINER:-}" ] && H+=(--trainer "$TRAINER")
    [ -n "${GA:-}" ] && H+=(--grad-accum "$GA")
    [ "${PADDED:-0}" = 1 ] && H+=(--padded)
    [ -n "${DOCS:-}" ] && H+=(--docs-per-row "$DOCS")
    if [ "${TRAINER:-trainer}" = sft ]; then
        python3 -c "import importlib.util as u, sys; m = [n for n in ('trl', 'datasets', 'dill', 'multiprocess',
'accelerate', 'tokenizers', 'pyarrow', 'pandas', 'xxhash', 'fsspec', 'jinja2') if u.find_spec(n) is None]
sys.exit('missing for TRAINER=sft: ' + ' '.join(m) if m else 0)" || exit 1
    fi
    if [ "${DETACH:-0}" = 1 ]; then  # the ranks' logs (their steps) in work/ for `collect`; rc written at the end
        TMPDIR=$dest/work PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True setsid nohup bash -c \
            'timeout "$1" python3 benchmarks/train_hf.py "${@:3}" > "$2" 2>&1; echo $? > "${2%/*}/rc"' \
            detached "${STAGE_TIMEOUT:-$stage_s}" "$dest/${NAME:-hf_long}.log" "${H[@]}" < /dev/null > /dev/null 2>&1 &
        echo $! > "$dest/pid"
        echo "train_hf detached: pid $(cat "$dest/pid"), log $dest/${NAME:-hf_long}.log; then the stage collect"
        exit 0
    fi
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${STAGE_TIMEOUT:-$stage_s}" python3 \
        benchmarks/train_hf.py "${H[@]}" > "$out/${NAME:-hf_long}.log" 2>&1
    echo "train_hf exit $?"; grep -F "[train_hf]" "$out/${NAME:-hf_long}.log" | cut -c1-400 ;;
collect)
    dir=${DETACH_DIR:-/tmp/hf_detached}
    [ -f "$dir/pid" ] || { echo "collect: nothing started in $dir (DETACH=1 ... hf_long first)"; exit 2; }
    end=$((SECONDS + ${WAIT_S:-540})); touch "$dir/seen"
    while :; do
        # the [train_hf] lines not shown before: the driver's log, the ranks' (deleted with their trial's work dir)
        grep -hF "[train_hf]" "$dir"/*.log "$dir"/work/train_hf_*/log_*_rank0.txt 2>/dev/null \
            | grep -vxFf "$dir/seen" | tee -a "$dir/seen" | cut -c1-400
        [ -f "$dir/rc" ] || [ $SECONDS -ge "$end" ] && break
        sleep "${POLL_S:-20}"
    done
    cp "$dir"/*.json "$dir"/*.md "$dir"/*.log "$out"/ 2>/dev/null
    if [ -f "$dir/rc" ]; then echo "train_hf exit $(cat "$dir/rc") (detached)"; exit "$(cat "$dir/rc")"; fi
    echo "still running after ${WAIT_S:-540} s (pid $(cat "$dir/pid")): collect again"; exit 3 ;;
tiled_sp)
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)
    # shellcheck disable=SC2086
    timeout 290 python3 benchmarks/bench_tiled_sp.py --git-commit "$commit" --budget-s "${BENCH_BUDGET:-200}" \
        ${TILED_ARGS:-} --out "$out/tiled_sp_${card:-gpu}x1.json" > "$out/tiled_sp.log" 2>&1
    echo "bench_tiled_sp exit $?"; grep -F "[bench_tiled_sp]" "$out/tiled_sp.log" | cut -c1-300
    cat "$out/tiled_sp_${card:-gpu}x1.md" 2>/dev/null || tail -30 "$out/tiled_sp.log" ;;
delta)
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]00" | tr H h)
    python3 -c "import fla, transformers; print('fla', fla.__version__, 'transformers', transformers.__version__)"
    # shellcheck disable=SC2086
    timeout "${TEST_TIMEOUT:-230}" "${tests_env[@]}" python3 -u -m pytest -m gpu -q -s -p no:cacheprovider \
        tests/test_gpu_delta.py ${DELTA_TEST_ARGS:-} > "$out/test_gpu_delta.log" 2>&1
    echo "test_gpu_delta exit $?: $(grep -E '[0-9]+ (passed|failed|error)' "$out/test_gpu_delta.log" | tail -1)"
    grep -E "^\[delta|OVER|^(case|none|permute|ulysses|bug|kda)" "$out/test_gpu_delta.log" | cut -c1-160
    B=(--git-commit "$commit" --budget-s "${BENCH_BUDGET:-70}" --out "$out/delta_${card:-gpu}x1.json")
    [ "${BYPASS:-1}" = 1 ] && B+=(--time-refused-backward)
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_delta.py "${B[@]}" ${DELTA_BENCH_ARGS:-} > "$out/bench_delta.log" 2>&1
    echo "bench_delta exit $?"; cat "$out/delta_${card:-gpu}x1.md" 2>/dev/null || tail -20 "$out/bench_delta.log" ;;
*)
    echo "unknown stage $stage (tests, cells, pass_states, longest, offload, hf_long, collect, tiled_sp, delta)"; exit 2 ;;
esac
