#!/usr/bin/env bash
# Stop the single-node SLURM started by slurm/start_local_slurm.sh (slurmd, slurmctld, munged), by pid file.
# Jobs still running are cancelled first. The packages, slurm.conf and the munge key stay.
set -uo pipefail

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
log() { echo "[stop_local_slurm] $*"; }

if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q "is UP"; then
  $SUDO scancel --user="$(id -un)" 2>/dev/null || true
fi

stop() {  # stop NAME PIDFILE
  local name=$1 pidfile=$2 pid
  if [[ -f $pidfile ]] && pid=$(cat "$pidfile") && kill -0 "$pid" 2>/dev/null; then
    log "stopping $name ($pid)"
    $SUDO kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then log "$name did not stop; SIGKILL"; $SUDO kill -9 "$pid"; fi
  else
    log "$name not running"
  fi
}

stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
stop munged /run/munge/munged.pid
