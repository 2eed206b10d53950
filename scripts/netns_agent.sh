#!/bin/bash
# An ssh stand-in for mpirun: runs a command on one of netns_hosts.sh's namespace "hosts".
#
#   mpirun --mca plm_rsh_agent scripts/netns_agent.sh --host n1,n2 ...     (Open MPI)
#   mpiexec -launcher ssh -launcher-exec scripts/netns_agent.sh -hosts n1,n2 ...   (MPICH's Hydra)
#
# Called as "netns_agent.sh [ssh options] HOST COMMAND...", like ssh: HOST is n1 / n2 or 10.99.0.1 / .2,
# the command words are joined and run by sh inside that host's namespace. NETNS_DIR is the directory
# given to `netns_hosts.sh up` (default /tmp/mpddp-netns). Needs root, like netns_hosts.sh.
set -euo pipefail
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done  # ssh options such as -x are ignored
[ $# -ge 2 ] || { echo "usage: $0 [ssh options] HOST COMMAND..." >&2; exit 255; }
host=$1; shift
case "$host" in
  n1 | 10.99.0.1) n=1 ;;
  n2 | 10.99.0.2) n=2 ;;
  *) echo "netns_agent: unknown host '$host' (n1, n2, 10.99.0.1 or 10.99.0.2)" >&2; exit 255 ;;
esac
exec "$(dirname "$0")/netns_hosts.sh" run "$n" "${NETNS_DIR:-/tmp/mpddp-netns}" sh -c "$*"
