#!/bin/bash
# OpenSSH for the --hosts tests (tests/test_hosts.py starts its own sshd in each namespace host with a
# key made for the test; nothing here starts a daemon or touches ~/.ssh).
#
#   ci_ssh.sh install    install Debian's openssh-server and openssh-client when sshd or ssh is missing
#
# Exit codes: 0 installed (or already there), 3 cannot install here (no apt-get, apt failed).
set -Eeuo pipefail
log() { echo "[ci_ssh $(date +%T.%3N)] $*" >&2; }

install() {
  command -v ssh >/dev/null && { [ -x /usr/sbin/sshd ] || command -v sshd >/dev/null; } && return 0
  command -v apt-get >/dev/null || { log "OpenSSH is missing and there is no apt-get"; exit 3; }
  log "installing openssh-server openssh-client"
  apt-get update -qq || { log "apt-get update failed"; exit 3; }
  # policy-rc.d 101: the package must not start the machine's own sshd (the tests start theirs)
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    openssh-server openssh-client >/dev/null || { log "apt-get install failed"; exit 3; }
}

case "${1:-}" in
  install) install ;;
  *) echo "usage: $0 install" >&2; exit 2 ;;
esac
