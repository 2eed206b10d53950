#!/bin/bash
# Debian's Open MPI for the real-mpirun tests (tests/test_mpirun.py), on a CI machine or by hand.
#
#   ci_mpi.sh install   apt-get install openmpi-bin (mpirun, orted) unless an Open MPI mpirun is here
#
# Exit codes: 0 installed or already there, 2 usage, 3 cannot install here (not root, no apt-get,
# apt failed); the tests then skip with the reason.
set -euo pipefail
log() { echo "[ci_mpi $(date +%T.%3N)] $*" >&2; }

have_open_mpi() {  # Debian names it mpirun.openmpi; mpirun may be MPICH's through alternatives
  local m
  for m in mpirun.openmpi mpirun; do
    command -v "$m" >/dev/null && "$m" --version 2>/dev/null | grep -q "Open MPI" && return 0
  done
  return 1
}

install() {
  have_open_mpi && return 0
  [ "$(id -u)" = 0 ] || { log "Open MPI is missing and installing it needs root"; exit 3; }
  command -v apt-get >/dev/null || { log "Open MPI is missing and there is no apt-get"; exit 3; }
  log "installing openmpi-bin"
  apt-get update -qq || { log "apt-get update failed"; exit 3; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openmpi-bin >/dev/null \
    || { log "apt-get install openmpi-bin failed"; exit 3; }
  have_open_mpi || { log "openmpi-bin is installed but no Open MPI mpirun answers"; exit 3; }
}

case "${1:-}" in
  install) install ;;
  *) echo "usage: $0 install" >&2; exit 2 ;;
esac
