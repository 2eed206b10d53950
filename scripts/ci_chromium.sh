#!/bin/bash
# Debian's chromium for the dashboard's browser test (tests/test_dashboard.py drives it headless over its DevTools
# protocol; it starts its own, with its own profile, and stops it).
#
#   ci_chromium.sh install    apt-get install chromium unless a chromium is here
#
# Exit codes: 0 installed or already there, 2 usage, 3 cannot install here (not root, no apt-get, apt failed);
# the test then skips with the reason.
set -euo pipefail
log() { echo "[ci_chromium $(date +%T.%3N)] $*" >&2; }

install() {
  command -v chromium >/dev/null && return 0
  [ "$(id -u)" = 0 ] || { log "chromium is missing and installing it needs root"; exit 3; }
  command -v apt-get >/dev/null || { log "chromium is missing and there is no apt-get"; exit 3; }
  log "installing chromium"
  apt-get update -qq || { log "apt-get update failed"; exit 3; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null \
    || { log "apt-get install chromium failed"; exit 3; }
  command -v chromium >/dev/null || { log "chromium is installed but not on PATH"; exit 3; }
}

case "${1:-}" in
  install) install ;;
  *) echo "usage: $0 install" >&2; exit 2 ;;
esac
