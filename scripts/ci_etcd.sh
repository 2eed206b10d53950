#!/bin/bash
# Debian's etcd for the etcd tests (tests/test_etcd_cluster.py; tests/etcd_cluster.py starts its own
# 3-member cluster on free loopback ports, so the machine's own etcd service is neither used nor left running).
#
#   ci_etcd.sh install    apt-get install etcd-server (/usr/bin/etcd) unless an etcd is here
#
# Exit codes: 0 installed or already there, 2 usage, 3 cannot install here (not root, no apt-get,
# apt failed); the tests then skip with the reason.
set -euo pipefail
log() { echo "[ci_etcd $(date +%T.%3N)] $*" >&2; }

# The package's own etcd (127.0.0.1:2379, /var/lib/etcd) runs as user etcd, from its init script
# (--chuid etcd) or its systemd unit (User=etcd); the tests' members run as the user who runs the tests.
stop_package_etcd() {
  if [ -d /run/systemd/system ]; then
    systemctl disable --now etcd.service >/dev/null 2>&1 || true
  fi
  if getent passwd etcd >/dev/null && pgrep -x -u etcd etcd >/dev/null; then
    log "stopping the etcd that the package started (user etcd)"
    pkill -x -u etcd etcd || true
  fi
}

install() {
  command -v etcd >/dev/null && return 0
  [ "$(id -u)" = 0 ] || { log "etcd is missing and installing it needs root"; exit 3; }
  command -v apt-get >/dev/null || { log "etcd is missing and there is no apt-get"; exit 3; }
  log "installing etcd-server"
  apt-get update -qq || { log "apt-get update failed"; exit 3; }
  # policy-rc.d 101: the package must not start the machine's etcd (invoke-rc.d and deb-systemd-invoke
  # both ask it); a policy-rc.d that is already there is left as it is
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server >/dev/null \
    || { log "apt-get install etcd-server failed"; exit 3; }
  stop_package_etcd
  command -v etcd >/dev/null || { log "etcd-server is installed but no etcd is on PATH"; exit 3; }
}

case "${1:-}" in
  install) install ;;
  *) echo "usage: $0 install" >&2; exit 2 ;;
esac
