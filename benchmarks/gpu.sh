#!/usr/bin/env bash
# Every GPU measurement the README reports, in stages (each fits a 10-minute slot), from the repository root,
# with lwm from the source tree and the image's torch, lightning and triton; what the image lacks (omegaconf,
# jsonargparse, deepspeed, PyAV) is installed from .whl/ when there (benchmarks/gpu_wheels.sh makes it):
#
#   benchmarks/gpu.sh OUT_DIR STAGE...      stages: check kernels attention bench breakdown maxbatch maxbatch_ckpt
#                                           generate loader deepspeed (or: all)
#
# Each stage writes OUT_DIR/STAGE.log (and JSON where the tool has it) and goes on after a failing command, so
# one run keeps everything that did work. Results go into the README's Performance and Generation sections by
# hand, with the device's name and the date (both printed by every tool).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/gpu.sh OUT_DIR STAGE...}
shift
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
PY=${PYTHON:-$(command -v python || command -v python3)}
WHEELS=${WHEELS:-.whl}
LWM="$PY -m lwm.cli"
BASE=configs/base.yaml
peak() {  # Lightning knows the H100's bf16 dense peak, not the H200's (the same 989 TFLOP/s)
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && echo "--peak-tflops 989"
}
run() {  # run CMD..., its output appended to the stage's log, its time and status noted
    echo "\$ $*" | tee -a "$LOG"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$LOG"
    echo "(status ${PIPESTATUS[0]}, $((SECONDS - start)) s)" | tee -a "$LOG"
}

stage_check() {
    run nvidia-smi
    run $PY -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.get_device_name())"
    for m in einops omegaconf jsonargparse rich h5py torchmetrics triton deepspeed av pytest; do
        run $PY -c "import $m; print('$m', getattr($m, '__version__', ''))"
    done
}
stage_kernels() {  # the Triton kernels compiled on the GPU: against SDPA (bf16 too), and their resources
    # without the project's addopts (--strict-markers would refuse the timeout marker where pytest-timeout is missing)
    run $PY -m pytest -q -p no:cacheprovider -o addopts=-ra tests/modules/test_triton_attention.py
    run $PY benchmarks/triton_kernels.py
}
stage_attention() {
    run $PY benchmarks/temporal_attention.py
    run $PY benchmarks/temporal_attention.py --backward
}
# lwm bench writes its JSON after each variant (and each max-batch trial): a stage cut off by the time limit keeps
# what it measured. Each compiled variant compiles anew (minutes at base): the parts are stages of their own.
stage_bench() {  # the base training step: reference, fast path with each temporal kernel, Lightning
    run $LWM bench --config $BASE --steps 20 --warmup 5 --kernels matmul triton --no-breakdown $(peak) \
        --json "$OUT/bench.json"
}
stage_breakdown() {  # each part alone, and what each rollout pass adds (eager), beside the compiled fast path
    run $LWM bench --config $BASE --steps 20 --warmup 5 --no-reference --no-lightning $(peak) \
        --json "$OUT/breakdown.json"
}
maxbatch() {
    run $LWM bench --config $BASE --max-batch --no-reference --no-breakdown --no-lightning --steps 3 --warmup 2 \
        "$@" $(peak) --json "$OUT/maxbatch${1:+_checkpointing}.json"
}
stage_maxbatch() { maxbatch; }
stage_maxbatch_ckpt() { maxbatch --model.net.activation_checkpointing=true; }
stage_generate() {
    for kernel in sdpa triton; do
        run $PY benchmarks/generate.py --size base --batch 1 32 --frames 16 64 256 --precision bf16 \
            --temporal-attention $kernel
    done
}
stage_loader() {  # windows/s the loader delivers vs what the step consumes (3x the bench's steps/s x batch 32)
    local need=100
    if [ -f "$OUT/bench.json" ]; then
        need=$($PY -c "import json; r = json.load(open('$OUT/bench.json')); print(round(max(v['steps_per_s'] for v in r['variants']) * r['batch'], 1))")
    fi
    run $PY benchmarks/data_loader.py --need "$need" --workers 1 2 4 --context fork --cache hot --json "$OUT/loader.json"
}
stage_deepspeed() {  # ZeRO stage 2 on one GPU: 20 steps with a checkpoint at 10, then resumed from last to 30
    local data="$OUT/synth" root="$OUT/deepspeed_run"
    run $LWM data synth --out "$data" --episodes 64 --frames 32 --size 128
    local common=(--config configs/deepspeed.yaml --data.manifest "$data/manifest.json" --trainer.devices 1
                  --trainer.default_root_dir "$root" --checkpoint.every_n_train_steps 10 --data.num_workers 2)
    run $LWM fit "${common[@]}" --trainer.max_steps 20
    run $LWM fit "${common[@]}" --trainer.max_steps 30 --ckpt_path last
    run ls -R "$root/checkpoints"
}

stages=("$@")
[ "${stages[*]:-}" = "all" ] && stages=(check kernels attention bench breakdown maxbatch maxbatch_ckpt generate loader
                                       deepspeed)
for s in "${stages[@]}"; do
    if ! declare -F "stage_$s" >/dev/null; then
        echo "unknown stage $s (check kernels attention bench breakdown maxbatch maxbatch_ckpt generate loader" \
             "deepspeed, or all)" >&2
        exit 2
    fi
done
install_wheels() {  # packages the image lacks, from benchmarks/gpu_wheels.sh, into /tmp/lwm_site
    if $PY -m pip --version >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lwm_site \
            "$WHEELS"/*.whl
    else  # no pip in the image: a wheel is a zip of the package as installed (these need no install scripts)
        mkdir -p /tmp/lwm_site && for wheel in "$WHEELS"/*.whl; do $PY -m zipfile -e "$wheel" /tmp/lwm_site || return 1; done
    fi
}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    install_wheels || { echo "installing $WHEELS/ failed" >&2; exit 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/lwm_site"
fi
for s in "${stages[@]}"; do
    LOG="$OUT/$s.log"
    : >"$LOG"
    echo "== $s ($(date -u +%FT%TZ))" | tee -a "$LOG"
    "stage_$s"
done
