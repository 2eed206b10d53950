"""What a running job costs etcd: Raft writes, database growth and requests per member, from etcd's own counters.

Real launchers (``mpddp run --rdzv-backend etcd``, one rank each) on a real 3-member etcd on loopback; the
ranks make an all_reduce every 10 ms. Once every node trains, etcd's ``/metrics`` are read on every member,
again after ``--seconds``, and the difference is told per node and second:

  raft_writes/node/s   etcd_server_proposals_committed_total on the leader (a lease keepalive is not one)
  db_bytes/node/s      etcd_mvcc_db_total_size_in_use_in_bytes (what compaction would not give back)
  revisions/node/s     etcd_debugging_mvcc_current_revision (a put or a delete makes one)
  requests by member   grpc_server_handled_total on each member (the gateway's calls): are they spread?

Then a rank fails, and the time until every node has named it is told. The ratio is against the limit the
issue sets (0.2 Raft writes a node a second; Kubernetes' node heartbeat is 0.1, torch's old etcd rendezvous 0.2).

    python scripts/bench_etcd_writes.py [--nodes 4] [--seconds 20] [--quota 262144]

Measured on 2 cores, 3 nodes, 15 s: 2.0 Raft writes and 4.3 KB a node a second while every beat put into etcd
(a quota of 256 KiB raised NOSPACE within 20 s); 0.0 and 0 since the beat went to the round's own store.

Needs Debian's etcd-server and etcd3gw (``pip install -e '.[etcd]'``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
JOB = str(ROOT / "tests" / "scripts" / "collectives_until_failed.py")  # ranks all_reduce; rank 1 fails


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+)$")


def metrics(port: int) -> dict[str, float]:
    """etcd's counters of one member, summed over their labels (grpc's by method too)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if (m := _METRIC.match(line)) is not None:
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(3))
    return found


def snapshot(cluster) -> list[dict[str, float]]:
    return [metrics(port) for port in cluster.client_ports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quota", type=int, default=0, help="etcd's --quota-backend-bytes (0: etcd's 2 GiB)")
    args = parser.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("bench_etcd_writes: Debian's etcd-server is needed (apt-get install etcd-server)")
    from etcd_cluster import EtcdCluster

    from runs import Run

    work = Path(tempfile.mkdtemp(prefix="bench-etcd-"))
    fail_at = work / "fail"
    with EtcdCluster(quota_bytes=args.quota or None) as cluster:
        leader, job = cluster.leader_index(), f"bench-{time.time_ns()}"
        runs = []
        for node in range(args.nodes):
            where = work / f"node{node}"
            where.mkdir()
            runs.append(Run(["-m", "mpddp", "run", "--nnodes", str(args.nodes), "--node-rank", str(node),
                             "--nprocs", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", cluster.endpoints,
                             "--rdzv-id", job, "--local-addr", "127.0.0.1", "--timeout", "30",
                             JOB, "1", "100"], where, env={"FAIL_AT": str(fail_at)}))
        try:
            for run in runs:
                run.wait_for(r"STEP 100\b", timeout=120)
            before, started = snapshot(cluster), time.monotonic()
            time.sleep(args.seconds)
            after, seconds = snapshot(cluster), time.monotonic() - started
            client = cluster.client(leader, 5)
            alarms = client.post(client.get_url("/maintenance/alarm"), json={"action": "GET"}).get("alarms", [])
            fail_at.write_text("now")
            failed = time.monotonic()
            named = []
            for run in runs:
                run.proc.wait(60)
                named.append(time.monotonic() - failed)
                assert "rank 1 (node 1, local rank 0) failed first" in run.stderr, run.stderr
        finally:
            for run in runs:
                run.kill()
        per = args.nodes * seconds

        def delta(name: str, member: int) -> float:
            return after[member].get(name, 0.0) - before[member].get(name, 0.0)

        result = {
            "nodes": args.nodes, "seconds": round(seconds, 1),
            "raft_writes_per_node_per_s": round(delta("etcd_server_proposals_committed_total", leader) / per, 3),
            "db_bytes_per_node_per_s": round(delta("etcd_mvcc_db_total_size_in_use_in_bytes", leader) / per, 1),
            "revisions_per_node_per_s": round(delta("etcd_debugging_mvcc_current_revision", leader) / per, 3),
            "requests_by_member_per_s": [round(delta("grpc_server_handled_total", m) / seconds, 1)
                                         for m in range(len(cluster.client_ports))],
            "failure_named_on_every_node_s": round(max(named), 2),
            "alarms": sorted({a.get("alarm", "?") for a in alarms}),
        }
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    print(f"Raft writes per node per second: {result['raft_writes_per_node_per_s']} "
          f"({result['raft_writes_per_node_per_s'] / 0.2:.2f}× the limit of 0.2)")


if __name__ == "__main__":
    main()
