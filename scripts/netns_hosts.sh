#!/bin/bash
# Two throw-away "hosts" on one Linux box: network namespaces on a bridge.
#
#   netns_hosts.sh up [DIR]      bridge mpddp-br0 = 10.99.0.254/24 (the machine itself, name "ctl"),
#                                namespaces mpddp-h1 / mpddp-h2 with eth0 = 10.99.0.1 / 10.99.0.2,
#                                hosts files DIR/hosts-n1, DIR/hosts-n2 (n1, n2, ctl) and an empty
#                                DIR/resolv-empty
#   netns_hosts.sh run N DIR CMD...   run CMD as host nN: its own network, host name nN, DIR/hosts-nN
#                                as /etc/hosts and no resolver (lookups fail at once, no 10 s timeout)
#   netns_hosts.sh down          delete the namespaces and the bridge (no error if absent)
#
# No default route in the namespaces: traffic stays on 127.0.0.0/8 and 10.99.0.0/24.
# Needs root and iproute2. Exits 3 (with the reason on stderr) when namespaces cannot be made.
set -euo pipefail
BR=mpddp-br0
NS_PREFIX=mpddp-h

up() {
  local dir=${1:-/tmp/mpddp-netns}
  mkdir -p "$dir"
  if ip link show "$BR" >/dev/null 2>&1; then
    echo "netns_hosts: bridge $BR already exists (another run?); run '$0 down' first" >&2; exit 3
  fi
  if ! ip netns add "${NS_PREFIX}1" 2>"$dir/netns.err"; then
    echo "netns_hosts: cannot create a network namespace: $(cat "$dir/netns.err")" >&2; exit 3
  fi
  ip netns add "${NS_PREFIX}2"
  ip link add "$BR" type bridge
  ip addr add 10.99.0.254/24 dev "$BR"
  ip link set "$BR" up
  : > "$dir/resolv-empty"
  for i in 1 2; do
    ip link add "v-mpddp-h$i" type veth peer name eth0 netns "${NS_PREFIX}$i"
    ip link set "v-mpddp-h$i" master "$BR" up
    ip -n "${NS_PREFIX}$i" addr add "10.99.0.$i/24" dev eth0
    ip -n "${NS_PREFIX}$i" link set eth0 up
    ip -n "${NS_PREFIX}$i" link set lo up
    printf '127.0.0.1 localhost\n10.99.0.1 n1\n10.99.0.2 n2\n10.99.0.254 %s ctl\n' "$(hostname)" > "$dir/hosts-n$i"
  done
}

run() {  # $1 = host number, $2 = dir, rest = command
  local i=$1 dir=$2; shift 2
  # nsenter, not 'ip netns exec': the latter remounts /sys and hides the cgroup fs (slurmd dies).
  # The mount namespace lets /etc/hosts and /etc/resolv.conf differ per host; UTS gives a host name.
  exec nsenter --net="/run/netns/${NS_PREFIX}$i" unshare --uts --mount sh -c '
    mount --bind "$1/hosts-n$2" /etc/hosts && mount --bind "$1/resolv-empty" /etc/resolv.conf &&
    hostname "n$2" && shift 2 && exec "$@"' sh "$dir" "$i" "$@"
}

down() {
  for i in 1 2; do ip netns del "${NS_PREFIX}$i" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
  for _ in $(seq 50); do  # the veth ends go away asynchronously; wait so a new 'up' starts clean
    ip link show v-mpddp-h1 >/dev/null 2>&1 || ip link show v-mpddp-h2 >/dev/null 2>&1 || return 0
    sleep 0.1
  done
  for i in 1 2; do ip link del "v-mpddp-h$i" 2>/dev/null || true; done  # a run killed midway left its end
}

case "${1:-}" in
  up) up "${2:-}" ;;
  run) shift; run "$@" ;;
  down) down ;;
  *) echo "usage: $0 up [DIR] | run N DIR CMD... | down" >&2; exit 2 ;;
esac
