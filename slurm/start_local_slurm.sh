#!/usr/bin/env bash
# Start a single-node SLURM cluster (munge + slurmctld + slurmd) on this machine, for trying the sbatch
# scripts and for tests/slurm. Debian/Ubuntu, as root (or with sudo). Idempotent: installs slurm-wlm and munge
# with apt-get if missing, writes a minimal /etc/slurm/slurm.conf (this host as the only node, all its CPUs,
# one partition "local") unless one not written by this script exists, and starts whichever daemon is not running.
#
#   slurm/start_local_slurm.sh            # then: sinfo; sbatch ...; slurm/stop_local_slurm.sh
#
# Environment: SLURM_CONF_DIR (default /etc/slurm), LOCAL_SLURM_FORCE_CONF=1 rewrites a foreign slurm.conf.
set -euo pipefail

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
CONF_DIR=${SLURM_CONF_DIR:-/etc/slurm}
CONF=$CONF_DIR/slurm.conf
MARKER="# written by lwm slurm/start_local_slurm.sh"
LOG_DIR=/var/log/slurm

log() { echo "[start_local_slurm] $*"; }

# ---- install ------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

# ---- munge --------------------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating /etc/munge/munge.key"
  $SUDO mkdir -p /etc/munge
  if command -v mungekey >/dev/null; then
    $SUDO mungekey --create --keyfile=/etc/munge/munge.key --force
  else
    $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
fi
$SUDO mkdir -p /run/munge /var/lib/munge /var/log/munge
$SUDO chown munge:munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
$SUDO chmod 0400 /etc/munge/munge.key
$SUDO chmod 0755 /run/munge
$SUDO chmod 0700 /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  $SUDO runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || { log "munged does not answer"; exit 1; }
fi

# ---- slurm.conf ---------------------------------------------------------------------------------------
HOST=$(hostname -s)
$SUDO mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
if [[ ! -f $CONF ]] || grep -qF "$MARKER" "$CONF" || [[ ${LOCAL_SLURM_FORCE_CONF:-0} == 1 ]]; then
  # slurmd -C reports this machine's CPUs/sockets/cores/threads and memory; keep 5% of the memory for the OS.
  NODE_LINE=$(slurmd -C 2>/dev/null | grep '^NodeName=' | sed -E 's/ ?RealMemory=[0-9]+//' || true)
  MEM_MB=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)
  if [[ -z $NODE_LINE ]]; then NODE_LINE="NodeName=$HOST CPUs=$(nproc)"; fi
  NEW=$(mktemp)
  cat >"$NEW" <<EOF
$MARKER
ClusterName=lwmlocal
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Test-friendly timings: a requeued job may start again after cred_expire (default 120 s), and pending jobs
# are looked at every few seconds (defaults 60 s / 30 s).
AuthInfo=cred_expire=20
SchedulerParameters=sched_interval=5,bf_interval=5
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
$NODE_LINE RealMemory=$MEM_MB State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
  if ! cmp -s "$NEW" "$CONF" 2>/dev/null; then
    log "writing $CONF"
    $SUDO cp "$NEW" "$CONF"
    $SUDO chmod 0644 "$CONF"
    CONF_CHANGED=1
  fi
  rm -f "$NEW"
else
  log "keeping $CONF (not written by this script; LOCAL_SLURM_FORCE_CONF=1 replaces it)"
fi

# ---- daemons ------------------------------------------------------------------------------------------
running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [[ ${CONF_CHANGED:-0} == 1 ]]; then  # a changed config needs fresh daemons
  for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if running $pidfile; then
      log "restarting for the new config: $pidfile"
      $SUDO kill "$(cat $pidfile)"
      for _ in $(seq 100); do running $pidfile || break; sleep 0.1; done
    fi
  done
fi
if ! running /run/slurmctld.pid; then
  log "starting slurmctld (log $LOG_DIR/slurmctld.log)"
  $SUDO /usr/sbin/slurmctld -f "$CONF"
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.2; done
scontrol ping | grep -q "is UP" || { log "slurmctld does not answer; see $LOG_DIR/slurmctld.log"; exit 1; }
if ! running /run/slurmd.pid; then
  log "starting slurmd (log $LOG_DIR/slurmd.log)"
  $SUDO /usr/sbin/slurmd -f "$CONF"
fi

# Wait for the node to register; resume it if an earlier session left it down or drained.
for _ in $(seq 150); do
  STATE=$(sinfo -h -n "$HOST" -o %T 2>/dev/null | head -1)
  case $STATE in
    idle*|mixed*|allocated*|completing*) break ;;
    down*|drain*|fail*) $SUDO scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 0.2
done
STATE=$(sinfo -h -n "$HOST" -o %T | head -1)
log "node $HOST: $STATE"
case $STATE in
  idle*|mixed*|allocated*|completing*) ;;
  *) log "node not usable; see $LOG_DIR/slurmd.log and 'scontrol show node $HOST'"; exit 1 ;;
esac
sinfo
