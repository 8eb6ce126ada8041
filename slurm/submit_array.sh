#!/usr/bin/env bash
# Submit slurm/array.sbatch with one array task per run in TASKFILE (see slurm/array.sbatch).
#
#   slurm/submit_array.sh TASKFILE [--section.key=value ...]
#
# Environment: SBATCH_OPTS (extra sbatch options, word-split, e.g. "--gpus-per-node=1 --time=12:00:00"),
# ARRAY_MAX (at most this many tasks at once: --array=0-N%ARRAY_MAX), RUN_ROOT, LWM (passed to the job).
# Prints sbatch's answer ("Submitted batch job ID"). Run from the repository root.
set -euo pipefail

[[ $# -ge 1 ]] || { echo "usage: slurm/submit_array.sh TASKFILE [--section.key=value ...]" >&2; exit 2; }
TASKFILE=$1
[[ -f $TASKFILE ]] || { echo "error: task file $TASKFILE not found" >&2; exit 2; }
N=$(grep -c -v -E '^[[:space:]]*(#|$)' "$TASKFILE" || true)
[[ $N -ge 1 ]] || { echo "error: $TASKFILE has no runs" >&2; exit 2; }
RANGE="0-$((N - 1))${ARRAY_MAX:+%$ARRAY_MAX}"
read -ra OPTS <<<"${SBATCH_OPTS:-}"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec sbatch --array="$RANGE" ${OPTS[@]+"${OPTS[@]}"} "$HERE/array.sbatch" "$@"  # (an empty array under set -u: bash < 4.4)
