#!/usr/bin/env bash
# Every GPU measurement docs/performance.md reports, from the repository root, with lwm from the source tree and
# the image's torch and lightning; what the image lacks (omegaconf, jsonargparse, deepspeed, PyAV) is
# installed from .whl/ when there (benchmarks/gpu_wheels.sh makes it):
#
#   benchmarks/gpu.sh OUT_DIR [--budget SECONDS] STAGE...|all
#
#   stages, in the order `all` runs them (the most wanted first): check bench loader attention generate deepspeed
#   bench_kernels profile maxbatch maxbatch_ckpt
#
# A lease here is 15 minutes of device time, the machine's start included, and a call returns at most 8 files. So:
# --budget is the seconds this run may take (give the call's timeout_s about 30 more): a stage starts only if the
# time left is at least its estimate (MIN below, a guess until a GPU session measures it), every command in it stops
# at the budget or at the stage's cap (CAP), and the stages go on after a failing or stopped command
# (benchmarks/train_step.py writes its JSON after each row, so a stopped stage keeps what it measured). `all`
# leaves out the stages an earlier call on the same machine finished (their logs stay), so calls of `all` one after
# another, on a machine still warm, go on where the last one stopped; a stage named on its own always runs. Scratch
# data, runs, logs and JSON stay under /tmp (LWM_GPU_SCRATCH), never in OUT_DIR, which gets two files after every
# stage: summary.txt (each stage's status and seconds, or why it was skipped, call after call; printed last) and
# gpu_results.tar.gz (every log and JSON so far). Results go into docs/performance.md and docs/generation.md by
# hand, with the device's name and the date (both printed by every tool).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu.sh OUT_DIR [--budget SECONDS] STAGE...|all}
shift
BUDGET=0  # 0: no budget
if [ "${1:-}" = "--budget" ]; then
    BUDGET=${2:?--budget needs a number of seconds}
    [[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "--budget must be a whole number of seconds, got $BUDGET" >&2; exit 2; }
    shift 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python || command -v python3)}
WHEELS=${WHEELS:-.whl}
SCRATCH=${LWM_GPU_SCRATCH:-/tmp/lwm_gpu_scratch}
RESULTS="$SCRATCH/results"  # logs and JSON, packed into OUT_DIR at the end
LWM="$PY -m lwm.cli"
BASE=configs/base.yaml
RESERVE=15  # seconds kept at the end of a budget for packing the results

# Seconds a stage needs to give a result (it is skipped with less left) and the most it may take: estimates from
# the CPU and the H100 runs of 2026-11-22 (a base step: 314 ms compiled, 460 eager; compiling at base: minutes),
# not yet measured on this machine.
declare -A MIN=([check]=5 [bench]=240 [loader]=45 [attention]=60 [generate]=60 [deepspeed]=150
                [bench_kernels]=240 [profile]=180 [maxbatch]=240 [maxbatch_ckpt]=240)
declare -A CAP=([check]=60 [bench]=420 [loader]=120 [attention]=150 [generate]=150
                [deepspeed]=240)  # the others: no cap but the budget
ALL=(check bench loader attention generate deepspeed bench_kernels profile maxbatch maxbatch_ckpt)

peak() {  # Lightning knows the H100's bf16 dense peak, not the H200's (the same 989 TFLOP/s)
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep H200 >/dev/null && echo "--peak-tflops 989"
}
CHILD=""  # the command running now (a signal to this script stops it)
run() {  # run CMD..., its output appended to the stage's log, its time and status noted; stopped at STAGE_END
    echo "\$ $*" | tee -a "$LOG"
    local start=$SECONDS left="" out tee_pid status
    if [ -n "$STAGE_END" ]; then
        left=$((STAGE_END - SECONDS))
        if [ "$left" -lt 1 ]; then
            echo "(not run: the stage's time is up)" | tee -a "$LOG"
            return
        fi
    fi
    # in the background, so that a signal to this script is handled at once (bash runs a trap only between
    # commands); timeout runs the command in a process group of its own and passes a signal on to all of it
    exec {out}> >(tee -a "$LOG")
    tee_pid=$!
    if [ -n "$left" ]; then
        timeout -k 10 "$left" "$@" >&"$out" 2>&1 &
    else
        "$@" >&"$out" 2>&1 &
    fi
    CHILD=$!
    wait "$CHILD"
    status=$?
    CHILD=""
    exec {out}>&-
    wait "$tee_pid" 2>/dev/null  # (its last lines written before the status line)
    case "$status" in 124|137) [ -n "$left" ] && echo "(stopped at the stage's time limit)" | tee -a "$LOG" ;; esac
    echo "(status $status, $((SECONDS - start)) s)" | tee -a "$LOG"
}

stage_check() {
    run nvidia-smi
    run $PY -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.get_device_name())"
    for m in einops omegaconf jsonargparse rich h5py torchmetrics deepspeed av; do
        run $PY -c "import $m; print('$m', getattr($m, '__version__', ''))"
    done
}
stage_attention() {  # temporal attention formulations side by side, % of the copy bandwidth measured in the run
    run $PY benchmarks/temporal_attention.py --backward
    run $PY benchmarks/temporal_attention.py
}
stage_loader() {  # windows/s the loader delivers; the step consumes train_step's steps/s x batch 32 (bench.json)
    local need=""
    if [ -f "$RESULTS/bench.json" ]; then  # (a JSON cut short, or no variant measured yet: 100)
        need=$($PY -c "import json; r = json.load(open('$RESULTS/bench.json'))
print(round(max(v['steps_per_s'] for v in r['variants']) * r['batch'], 1))" 2>/dev/null)
    fi
    run $PY benchmarks/data_loader.py --need "${need:-100}" --workers 1 2 4 --context fork --cache hot \
        --json "$RESULTS/loader.json"
}
stage_generate() {
    run $PY benchmarks/generate.py --size base --batch 1 32 --frames 16 64 256 --precision bf16 \
        --temporal-attention sdpa
}
stage_deepspeed() {  # ZeRO stage 2 on one GPU: 20 steps with a checkpoint at 10, then resumed from last to 30
    local data="$SCRATCH/synth" root="$SCRATCH/deepspeed_run"
    rm -rf "$data" "$root"
    run $LWM data synth --out "$data" --episodes 64 --frames 32 --size 128
    local common=(--config configs/deepspeed.yaml --data.manifest "$data/manifest.json" --trainer.devices 1
                  --trainer.default_root_dir "$root" --checkpoint.every_n_train_steps 10 --data.num_workers 2)
    run $LWM fit "${common[@]}" --trainer.max_steps 20
    run $LWM fit "${common[@]}" --trainer.max_steps 30 --ckpt_path last
    run ls -R "$root/checkpoints"
    run cp "$root/metrics.csv" "$RESULTS/deepspeed_metrics.csv"
}
# benchmarks/train_step.py writes its JSON after each row: a stage stopped at its time keeps what it measured. Each
# compiled row compiles anew (minutes at base; inductor's on-disk cache helps the later ones); dynamo's graph breaks
# and recompiles go to the log (TORCH_LOGS).
STEP=benchmarks/train_step.py
stage_bench() {  # the base step: raw (compiled), raw eager, the same step in lwm fit on synthetic data, the loader
    local -x TORCH_LOGS=graph_breaks,recompiles
    run $PY $STEP --config $BASE --steps 10 --warmup 3 $(peak) --json "$RESULTS/bench.json"
}
stage_bench_kernels() {  # the raw step with each temporal-attention kernel, side by side
    local -x TORCH_LOGS=graph_breaks,recompiles
    run $PY $STEP --config $BASE --steps 10 --warmup 3 --kernels matmul --raw-only $(peak) \
        --json "$RESULTS/bench_kernels.json"
}
stage_profile() {  # torch.profiler's operator table of the compiled raw step, and its host syncs
    run $PY $STEP --config $BASE --steps 5 --warmup 3 --raw-only --profile $(peak) --json "$RESULTS/profile.json"
}
# The largest batch on an 80 GB card, to 8 samples: PyTorch sees 79.2 GiB on an H100 80GB, less its CUDA context.
maxbatch() {
    run $PY $STEP --config $BASE --max-batch --memory-gib 78.5 --batch-step 8 --raw-only --steps 3 --warmup 2 "$@" \
        $(peak) --json "$RESULTS/maxbatch${1:+_checkpointing}.json"
}
stage_maxbatch() { maxbatch; }
stage_maxbatch_ckpt() { maxbatch --model.net.activation_checkpointing=true; }

stages=()
plan=""
for arg in "$@"; do
    if [ "$arg" = all ]; then
        stages+=("${ALL[@]}")
        plan=all
    elif declare -F "stage_$arg" >/dev/null; then
        stages+=("$arg")
    else
        echo "unknown stage $arg (${ALL[*]}, or all)" >&2
        exit 2
    fi
done
[ "${#stages[@]}" -gt 0 ] || { echo "usage: benchmarks/gpu.sh OUT_DIR [--budget SECONDS] STAGE...|all" >&2; exit 2; }

mkdir -p "$OUT" "$RESULTS"
SUMMARY="$RESULTS/summary.txt"  # every call's lines, one after another
[ "$BUDGET" -gt 0 ] && of=", budget $BUDGET s" || of=""
echo "-- call of $(date -u +%FT%TZ): ${*}$of" >>"$SUMMARY"
loader_ratio() {  # the loader's best windows/s over what the fastest step measured consumes (both from this run)
    [ -f "$RESULTS/bench.json" ] && [ -f "$RESULTS/loader.json" ] || return 0
    $PY -c "
import json
bench, rows = json.load(open('$RESULTS/bench.json')), json.load(open('$RESULTS/loader.json'))
need = max(v['steps_per_s'] for v in bench['variants']) * bench['batch']
best = max(r['windows_per_s'] for r in rows)
print(f'loader: {best:.0f} windows/s, {best / need:.1f}x the {need:.0f} windows/s of the fastest step measured')
" 2>/dev/null
}
pack() {  # OUT_DIR: the summary and one archive of every log and JSON (a call returns at most 8 files)
    { cat "$SUMMARY"; loader_ratio; } >"$OUT/summary.txt"
    tar -czf "$OUT/gpu_results.tar.gz" -C "$RESULTS" .
}
on_signal() {  # stop the running command, pack (on EXIT), go
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null
    echo "(stopped by a signal)" >>"$SUMMARY"
    exit 143
}
trap pack EXIT
trap on_signal TERM INT
install_wheels() {  # packages the image lacks, from benchmarks/gpu_wheels.sh, into /tmp/lwm_site
    if $PY -m pip --version >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lwm_site \
            "$WHEELS"/*.whl
    else  # no pip in the image: a wheel is a zip of the package as installed (these need no install scripts)
        mkdir -p /tmp/lwm_site && for wheel in "$WHEELS"/*.whl; do $PY -m zipfile -e "$wheel" /tmp/lwm_site || return 1; done
    fi
}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    install_wheels >"$RESULTS/install.log" 2>&1 || {
        echo "installing $WHEELS/ failed (install.log):" | tee -a "$SUMMARY" >&2
        tail -5 "$RESULTS/install.log" | tee -a "$SUMMARY" >&2
        exit 1
    }
    export PYTHONPATH="$PYTHONPATH:/tmp/lwm_site"
fi
DEADLINE=$((BUDGET - RESERVE))  # SECONDS counts from this script's start: the wheels' install is in the budget
for s in "${stages[@]}"; do
    LOG="$RESULTS/$s.log"
    if [ "$plan" = all ] && [ -f "$RESULTS/$s.done" ]; then
        echo "$s: done in an earlier call" | tee -a "$SUMMARY"
        continue
    fi
    STAGE_END=""
    if [ "$BUDGET" -gt 0 ]; then
        left=$((DEADLINE - SECONDS))
        if [ "$left" -lt "${MIN[$s]}" ]; then
            echo "$s: skipped ($left s of the budget left, it needs about ${MIN[$s]} s)" | tee -a "$SUMMARY"
            continue
        fi
        STAGE_END=$DEADLINE
    fi
    if [ -n "${CAP[$s]:-}" ]; then
        capped=$((SECONDS + CAP[$s]))
        if [ -z "$STAGE_END" ] || [ "$capped" -lt "$STAGE_END" ]; then
            STAGE_END=$capped
        fi
    fi
    rm -f "$RESULTS/$s.done"
    : >"$LOG"
    echo "== $s ($(date -u +%FT%TZ))" | tee -a "$LOG"
    start=$SECONDS
    "stage_$s"
    failed=$(grep -c '^(status [1-9]' "$LOG")
    stopped=$(grep -c '^(stopped at the stage' "$LOG")
    unrun=$(grep -c '^(not run' "$LOG")
    note=""
    [ "$stopped" -gt 0 ] && note+=", $stopped of them stopped at the time limit"
    [ "$unrun" -gt 0 ] && note+=", $unrun not run"
    echo "$s: $((SECONDS - start)) s, $failed command(s) failed$note" | tee -a "$SUMMARY"
    [ "$stopped" -eq 0 ] && [ "$unrun" -eq 0 ] && touch "$RESULTS/$s.done"  # (all ran to the end, failed or not)
    pack
done
echo "== summary ($SECONDS s in this call$of)"
cat "$OUT/summary.txt" 2>/dev/null || cat "$SUMMARY"
