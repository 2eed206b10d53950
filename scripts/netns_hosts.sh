#!/bin/bash
# Throw-away "hosts" on one Linux box: network namespaces on a bridge, each with its own address and name.
#
#   netns_hosts.sh up [DIR] [N]  bridge mpddp-br0 = 10.99.0.254/24 (the machine itself, name "ctl"),
#                                namespaces mpddp-h1 .. mpddp-hN (N: 2 unless given, at most 9) with
#                                eth0 = 10.99.0.1 .. 10.99.0.N, hosts files DIR/hosts-n1 .. DIR/hosts-nN
#                                (n1 .. nN, ctl) and an empty DIR/resolv-empty
#   netns_hosts.sh run I DIR CMD...   run CMD as host nI: its own network, host name nI, DIR/hosts-nI
#                                as /etc/hosts and no resolver (lookups fail at once, no 10 s timeout)
#   netns_hosts.sh cut I         host nI's link down, as a cable pulled or a switch port lost: what it
#                                sends and what is sent to it vanish, and nobody gets a reset (no RST, no FIN)
#   netns_hosts.sh heal I        its link up again
#   netns_hosts.sh down          delete every namespace and the bridge (no error if absent)
#
# No default route in the namespaces: traffic stays on 127.0.0.0/8 and 10.99.0.0/24.
# Needs root and iproute2. Exits 3 (with the reason on stderr) when namespaces cannot be made.
set -euo pipefail
BR=mpddp-br0
NS_PREFIX=mpddp-h

up() {
  local dir=${1:-/tmp/mpddp-netns} n=${2:-2}
  [[ "$n" =~ ^[1-9]$ ]] || { echo "netns_hosts: N must be 1 to 9, not '$n'" >&2; exit 2; }
  mkdir -p "$dir"
  if ip link show "$BR" >/dev/null 2>&1; then
    echo "netns_hosts: bridge $BR already exists (another run?); run '$0 down' first" >&2; exit 3
  fi
  if ! ip netns add "${NS_PREFIX}1" 2>"$dir/netns.err"; then
    echo "netns_hosts: cannot create a network namespace: $(cat "$dir/netns.err")" >&2; exit 3
  fi
  for i in $(seq 2 "$n"); do ip netns add "${NS_PREFIX}$i"; done
  ip link add "$BR" type bridge
  ip addr add 10.99.0.254/24 dev "$BR"
  ip link set "$BR" up
  : > "$dir/resolv-empty"
  local names="" i
  for i in $(seq 1 "$n"); do names+="10.99.0.$i n$i"$'\n'; done
  for i in $(seq 1 "$n"); do
    ip link add "v-mpddp-h$i" type veth peer name eth0 netns "${NS_PREFIX}$i"
    ip link set "v-mpddp-h$i" master "$BR" up
    ip -n "${NS_PREFIX}$i" addr add "10.99.0.$i/24" dev eth0
    ip -n "${NS_PREFIX}$i" link set eth0 up
    ip -n "${NS_PREFIX}$i" link set lo up
    printf '127.0.0.1 localhost\n%s10.99.0.254 %s ctl\n' "$names" "$(hostname)" > "$dir/hosts-n$i"
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

link() {  # $1 = host number, $2 = up or down: the bridge's end of its cable
  ip link show "v-mpddp-h$1" >/dev/null 2>&1 || { echo "netns_hosts: no host n$1 (run '$0 up' first)" >&2; exit 3; }
  ip link set "v-mpddp-h$1" "$2"
}

hosts() {  # the host numbers whose namespaces or cable ends exist
  { ip netns list 2>/dev/null | sed -n "s/^${NS_PREFIX}\([0-9]*\).*/\1/p"
    ip -o link show 2>/dev/null | sed -n 's/^[0-9]*: v-mpddp-h\([0-9]*\)[@:].*/\1/p'; } | sort -un
}

down() {
  local numbers; numbers=$(hosts)
  for i in $numbers; do ip netns del "${NS_PREFIX}$i" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
  for _ in $(seq 50); do  # the veth ends go away asynchronously; wait so a new 'up' starts clean
    [ -z "$(ip -o link show 2>/dev/null | grep ' v-mpddp-h')" ] && return 0
    sleep 0.1
  done
  for i in $numbers; do ip link del "v-mpddp-h$i" 2>/dev/null || true; done  # a run killed midway left its end
}

case "${1:-}" in
  up) up "${2:-}" "${3:-}" ;;
  run) shift; run "$@" ;;
  cut) link "${2:?host number}" down ;;
  heal) link "${2:?host number}" up ;;
  down) down ;;
  *) echo "usage: $0 up [DIR] [N] | run I DIR CMD... | cut I | heal I | down" >&2; exit 2 ;;
esac
