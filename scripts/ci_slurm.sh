#!/bin/bash
# A throw-away SLURM cluster on one Debian 12 machine (root, no systemd), for CI and by hand.
#
#   ci_slurm.sh up single   one node named $(hostname) at 127.0.0.1
#   ci_slurm.sh up netns    two nodes n1 / n2, each slurmd in its own network + UTS namespace
#                           (10.99.0.1 / 10.99.0.2, see netns_hosts.sh); slurmctld on the bridge 10.99.0.254
#   ci_slurm.sh down        cancel jobs, stop the daemons this script started (by pid file), remove namespaces
#
# Then: export SLURM_CONF=$CI_SLURM_DIR/slurm.conf and use srun / sbatch (always with timeouts and
# --immediate: a request the cluster cannot meet otherwise waits forever).
# Installs slurmd, slurmctld, slurm-client and munge with apt-get when missing.
# Settings: CI_SLURM_DIR (/tmp/mpddp-slurm), FAKE_GPUS (2 fake GPUs per node, for GRES), CI_SLURM_CPUS (4),
# CI_SLURM_PORT (slurmctld port, 6817; slurmd uses the next one).
# Exit codes: 0 up/down, 1 the cluster did not come up (logs printed), 3 cannot run here (not root, no apt).
set -Eeuo pipefail
W=${CI_SLURM_DIR:-/tmp/mpddp-slurm}
FAKE_GPUS=${FAKE_GPUS:-2}
CPUS=${CI_SLURM_CPUS:-4}
PORT=${CI_SLURM_PORT:-6817}
HERE=$(cd "$(dirname "$0")" && pwd)
HOST=$(hostname)
log() { echo "[ci_slurm $(date +%T.%3N)] $*" >&2; }

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
    && command -v munged >/dev/null && return 0
  command -v apt-get >/dev/null || { log "slurm is missing and there is no apt-get"; exit 3; }
  log "installing slurmd slurmctld slurm-client munge"
  apt-get update -qq || { log "apt-get update failed"; exit 3; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    slurmd slurmctld slurm-client munge >/dev/null || { log "apt-get install failed"; exit 3; }
}

start_munge() {
  mkdir -p /run/munge && chown munge:munge /run/munge
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then log "munged already running (not ours)"; return; fi
  [ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create
  # munged runs as user munge, which cannot write to $W: its pid file goes to /run/munge, then here
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/mpddp-munged.pid
  cp /run/munge/mpddp-munged.pid "$W/munged.pid"  # ours: 'down' stops it by this pid
}

write_conf() {  # $1 = single | netns, $2 = SlurmctldHost value
  cat > "$W/slurm.conf" <<CONF
ClusterName=mpddpci
SlurmctldHost=$2
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$W/state
SlurmdSpoolDir=$W/spool/%n
SlurmctldPidFile=$W/slurmctld.pid
SlurmdPidFile=$W/slurmd-%n.pid
SlurmctldLogFile=$W/log/slurmctld.log
SlurmdLogFile=$W/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=5
# sbatch --wait polls every 2 s while 2 < MinJobAge/2; with 30 it sleeps 2, 8, 32 s (a 9 s job took 42 s)
GresTypes=gpu
CONF
  local gres=""; [ "$FAKE_GPUS" -gt 0 ] && gres="Gres=gpu:$FAKE_GPUS"
  if [ "$1" = single ]; then
    echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=8000 $gres State=UNKNOWN" >> "$W/slurm.conf"
  else
    for i in 1 2; do
      echo "NodeName=n$i NodeHostname=n$i NodeAddr=10.99.0.$i CPUs=$CPUS RealMemory=8000 $gres State=UNKNOWN" \
        >> "$W/slurm.conf"
    done
  fi
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=30 State=UP" >> "$W/slurm.conf"
  echo "AutoDetect=off" > "$W/gres.conf"
  if [ "$FAKE_GPUS" -gt 0 ]; then  # char devices (copies of /dev/null) stand in for GPUs
    mkdir -p "$W/fakegpu"
    for ((g = 0; g < FAKE_GPUS; g++)); do [ -e "$W/fakegpu/$g" ] || mknod "$W/fakegpu/$g" c 1 3; done
    echo "Name=gpu File=$W/fakegpu/[0-$((FAKE_GPUS - 1))]" >> "$W/gres.conf"
  fi
}

wait_idle() {  # $1 = number of nodes that must be idle
  for _ in $(seq 100); do
    [ "$(sinfo -h -t idle -o %D 2>/dev/null)" = "$1" ] && return 0
    sleep 0.2
  done
  log "nodes not idle after 20 s:"; sinfo -N -l >&2 || true; tail -n 20 "$W"/log/*.log >&2 || true
  return 1
}

up() {
  local mode=$1
  [ "$(id -u)" = 0 ] || { log "needs root (starts daemons, makes namespaces)"; exit 3; }
  [ "$mode" = single ] || [ "$mode" = netns ] || { log "unknown mode '$mode': use single or netns"; exit 2; }
  trap 'log "up failed; cleaning up"; down; exit 1' ERR
  rm -rf "$W"/state "$W"/spool; mkdir -p "$W"/{state,spool,log}
  install
  start_munge
  export SLURM_CONF=$W/slurm.conf
  if [ "$mode" = single ]; then
    write_conf single "$HOST"
    slurmctld -i
    slurmd -N "$HOST"
    wait_idle 1
  else
    write_conf netns "$HOST(10.99.0.254)"
    "$HERE/netns_hosts.sh" up "$W"
    slurmctld -i
    for i in 1 2; do
      mkdir -p "$W/spool/n$i"
      "$HERE/netns_hosts.sh" run "$i" "$W" slurmd -N "n$i"  # slurmd daemonizes; the pid file names it
    done
    wait_idle 2
  fi
  trap - ERR
  log "up ($mode); export SLURM_CONF=$SLURM_CONF"
}

down() {
  export SLURM_CONF=$W/slurm.conf
  if [ -s "$W/slurmctld.pid" ] && command -v scancel >/dev/null; then
    # Cancel jobs first so that slurmd reaps its job steps (slurmstepd) before it stops.
    timeout 5 scancel --full --quiet --user=root 2>/dev/null || true
    for _ in $(seq 25); do
      [ -z "$(timeout 2 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2
    done
  fi
  local pids="" f p alive
  for f in "$W"/slurmd-*.pid "$W"/slurmctld.pid "$W"/munged.pid; do
    [ -s "$f" ] || continue
    pids="$pids $(cat "$f")"; rm -f "$f"
  done
  [ -n "$pids" ] && kill $pids 2>/dev/null || true
  for _ in $(seq 50); do  # up to 10 s, so that the ports are free again
    alive=0; for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.2
  done
  for p in $pids; do kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null; done
  "$HERE/netns_hosts.sh" down
  log "down"
}

case "${1:-}" in
  install) install ;;
  up) up "${2:-single}" ;;
  down) down ;;
  *) echo "usage: $0 install | up [single|netns] | down" >&2; exit 2 ;;
esac
