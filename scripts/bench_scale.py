"""What one job's coordination costs as it grows: 8 to 1,024 simulated nodes, on c10d and on etcd.

Each simulated node is a thread (a few, with its round watch and, on etcd, its lease) running the project's
own coordination code: the backend's client (core/nodes/c10d.py, core/nodes/etcd.py), a round's join
(core/nodes/membership.py, an elastic ``--nnodes N-1:N`` job), the round's beat, the first failure's record
and how soon every node knows it, and the next round without the node that failed. The ranks are not there:
nothing trains. The store is the real thing, in a process of its own: torch's TCPStore (libuv) for c10d, a
3-member etcd on loopback for etcd (Debian's etcd-server and etcd3gw; skipped with a line without them).

Per backend and size it prints:

  connect_s           every node's client connected (c10d: a TCPStore client; etcd: a first request)
  join_s              all nodes in the round, from their first arrival to the last one's member list
  ops_per_node_per_s  store operations a node makes in steady state (its beat), and ops_per_s in all
                      (etcd: its requests, the lease's refreshes; the beats go to the round's own store,
                      which the bench serves: scripts/bench_etcd_writes.py counts etcd's Raft writes)
  failure_*           the same while the nodes learn of a failure, and failure_known_s: from the record
                      written to every node's round watch holding it (beat_s: the beat interval)
  next_round_s        from the other nodes' arrival in the next round to their member list (no last call)
  store_cpu_per_s     the store's processes' CPU seconds a second, in steady state
  raft_writes_per_node_per_s, db_bytes_per_node_per_s, requests_by_member
                      etcd only, read from its own /metrics over the steady state: Raft proposals
                      committed and database growth (etcd_mvcc_db_total_size_in_use_in_bytes) a node a
                      second, and the requests each member served (whether the launchers spread)

and ends with one JSON line ``{"results": [...]}``.

    python scripts/bench_scale.py                      # c10d: 8, 64, 256 and 1,024 nodes; etcd: 8 and 64
    python scripts/bench_scale.py --nodes 8,64 --backends c10d
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import benchlib  # noqa: E402

from mpddp.config import LaunchConfig  # noqa: E402
from mpddp.core.nodes import api  # noqa: E402
from mpddp.core.nodes.rules import NodeState  # noqa: E402
from mpddp.core.wire.protocol import FailureRecord  # noqa: E402
from mpddp.errors import Outcome, TooFewNodes  # noqa: E402

STEADY = 3.0  # seconds of steady state measured
_SERVER = """
import socket, sys, time, datetime, torch.distributed as dist
sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 0)); sock.listen(16384)
store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, datetime.timedelta(seconds=600),
                      wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
print(sock.getsockname()[1], flush=True)
sys.stdin.read()
"""


class Counted:
    """A store client whose every operation is counted (the count is shared by all nodes)."""

    def __init__(self, inner: Any, counter: list[int]) -> None:
        self._inner, self._counter = inner, counter

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)
        if name == "set_timeout":
            return method

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counter[0] += 1
            return method(*args, **kwargs)

        return counted


def _links(backend: str, nodes: int, where: str, counter: list[int]) -> list[Any]:
    """One rendezvous client a simulated node, each counting its store operations into ``counter``."""
    conf = "last_call_timeout=600"  # the first round waits for all N (its MAX), however slowly they come
    base = LaunchConfig(nnodes=f"{nodes - 1}:{nodes}", nprocs=1, timeout=600, rdzv_conf=conf,  # type: ignore[arg-type]
                        **({"rdzv_backend": "etcd", "rdzv_endpoint": where, "rdzv_id": f"scale-{nodes}-{os.getpid()}"}
                           if backend == "etcd" else {"master_addr": "127.0.0.1", "master_port": int(where)}))
    links = []
    for node in range(nodes):
        config = replace(base, node_rank=node if backend == "c10d" else None)  # etcd: numbered as they come
        if backend == "c10d":
            from mpddp.core.nodes.c10d import C10dRendezvous

            link: Any = C10dRendezvous(config, config.master_port, 1)
            connect = link.client._connect
            link.client._connect = lambda timeout, connect=connect: Counted(connect(timeout), counter)
        else:
            from mpddp.core.nodes.etcd import EtcdRendezvous

            link = EtcdRendezvous(config, 0, 1)
            call = link.client.call

            def counted(op: Any, timeout: float | None = None, call: Any = call) -> Any:
                counter[0] += 1
                return call(op, timeout)

            link.client.call = counted
        # One process holds every simulated node, so hostname and pid are the same: each one's id says which it
        # is (the random tail alone, 24 bits, repeats among 1,024 nodes in about 3 % of the runs, and two nodes
        # with one id are one arrival: the next round came out one below MIN)
        link.me = f"sim{node}-{link.me}"
        links.append(link)
    return links


def _parallel(work: list[Any]) -> list[Any]:
    """Run every callable in ``work`` in a thread of its own; their results, in order."""
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work[i]()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _metric(port: int, name: str) -> float:
    """etcd's counter or gauge ``name`` on the member serving clients at ``port``, summed over its labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _etcd_counters(ports: list[int]) -> tuple[float, float, list[float]]:
    """Raft proposals committed and the database's size in use (every member commits each one: member 0's),
    and the gRPC requests each member handled."""
    return (_metric(ports[0], "etcd_server_proposals_committed_total"),
            _metric(ports[0], "etcd_mvcc_db_total_size_in_use_in_bytes"),
            [_metric(port, "grpc_server_handled_total") for port in ports])


def one_size(backend: str, nodes: int, where: str, store_procs: list[psutil.Process],
             round_store: str | None = None, etcd_ports: list[int] | None = None) -> dict[str, Any]:
    """``round_store``: etcd's round store (the port of a TCPStore the bench serves), where the beats go;
    ``etcd_ports``: its members' client ports, whose /metrics are read."""
    counter = [0]
    links = _links(backend, nodes, where, counter)
    started = time.monotonic()
    _parallel([(lambda link=link: link.client.call(lambda s: None)) if backend == "c10d" else link._first_contact
               for link in links])
    connect_s = time.monotonic() - started
    started = time.monotonic()
    _parallel([lambda link=link: link.join(0) for link in links])
    join_s = time.monotonic() - started
    if round_store is not None:  # etcd: the round's first node publishes its store (here the bench's)
        links[0].put(links[0].key(0, "store"), f"127.0.0.1:{int(round_store)}")
    watches = [link.watch(0) for link in links]
    time.sleep(1.0)  # the beats settle
    etcd0 = _etcd_counters(etcd_ports) if etcd_ports else None
    ops0, cpu0, t0 = counter[0], _cpu(store_procs), time.monotonic()
    time.sleep(STEADY)
    steady_ops, steady_s, cpu = counter[0] - ops0, time.monotonic() - t0, _cpu(store_procs) - cpu0
    etcd: dict[str, Any] = {}
    if etcd_ports and etcd0 is not None:
        writes, size, handled = _etcd_counters(etcd_ports)
        etcd = {"raft_writes_per_node_per_s": round((writes - etcd0[0]) / steady_s / nodes, 3),
                "db_bytes_per_node_per_s": round((size - etcd0[1]) / steady_s / nodes, 1),
                "requests_by_member": [round(h - h0) for h, h0 in zip(handled, etcd0[2])]}
    # the failure: the last node's rank raised, its record written; every other node's watch must see it
    last = links[-1]
    node = last.config.node_rank  # its rank in the round (etcd numbers the nodes as they came)
    ops1, t1 = counter[0], time.monotonic()
    last.publish(0, FailureRecord(node, node, 0, Outcome.RAISED, 1, "mpddp: rank failed", time.time()))
    deadline = t1 + 60
    while not all(w.remote_failure is not None for w in watches[:-1]) and time.monotonic() < deadline:
        time.sleep(0.005)
    known_s = time.monotonic() - t1
    time.sleep(max(0.0, t1 + 1.0 - time.monotonic()))  # a second of it at least: the nodes that read the record
    failure_ops, failure_s = counter[0] - ops1, time.monotonic() - t1
    for link, w in zip(links, watches):
        link.move(0, NodeState.ENDED)
        w.stop()
    # the next round, without the node that failed: no last call
    others = links[:-1]
    for link in others:
        link.launched = replace(link.launched, rdzv_conf="last_call_timeout=0")
        if backend == "etcd":
            link.last_call = 0.0
    t2 = time.monotonic()
    try:
        rounds = _parallel([lambda link=link: link.join(1) for link in others])
        next_s: float | None = round(time.monotonic() - t2, 3)
        assert {r.nnodes for r in rounds} == {nodes - 1}, {r.nnodes for r in rounds}
    except TooFewNodes as e:  # the job's one line, as a launcher would end; the sizes after this one still run
        print(f"bench_scale: {backend}, {nodes} nodes: {e}", file=sys.stderr, flush=True)
        next_s = None
    for link in links:
        if backend == "etcd":
            link.leave()
    return {"backend": backend, "nodes": nodes, "connect_s": round(connect_s, 3), "join_s": round(join_s, 3),
            "ops_per_node_per_s": round(steady_ops / steady_s / nodes, 2), "ops_per_s": round(steady_ops / steady_s),
            "failure_ops_per_node_per_s": round(failure_ops / failure_s / nodes, 2),
            "failure_known_s": round(known_s, 3), "beat_s": api.INTERVAL, "next_round_s": next_s,
            "store_cpu_per_s": round(cpu / steady_s, 3), **etcd}


def c10d_server() -> tuple[subprocess.Popen[str], str, list[psutil.Process]]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    return proc, port, [psutil.Process(proc.pid)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="8,64,256,1024", help="simulated nodes on c10d")
    parser.add_argument("--etcd-nodes", default="8,64", help="simulated nodes on etcd (256 saturate 2 cores: see "
                                                               "the manual's performance page)")
    parser.add_argument("--backends", default="c10d,etcd")
    parser.add_argument("--tiny", action="store_true", help="8 nodes on c10d (the suite's smoke run)")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch.distributed  # noqa: F401 - imported once here, not by the first simulated node's connection

    if args.tiny:
        args.nodes, args.etcd_nodes, args.backends = "8", "8", "c10d"
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a connection or two a simulated node
    results, notes = [], []
    for backend in args.backends.split(","):
        for nodes in [int(n) for n in (args.etcd_nodes if backend == "etcd" else args.nodes).split(",")]:
            if backend == "etcd":
                import importlib.util
                import shutil

                if shutil.which("etcd") is None or importlib.util.find_spec("etcd3gw") is None:
                    notes.append("etcd: skipped (Debian's etcd-server and pip's etcd3gw are needed)")
                    break
                sys.path.insert(0, str(ROOT / "tests"))
                from etcd_cluster import EtcdCluster

                server, port, store_procs = c10d_server()  # the round's own store: the beats go there
                try:
                    with EtcdCluster() as cluster:
                        procs = [psutil.Process(pid) for pid in cluster.pids]
                        results.append(one_size(backend, nodes, cluster.endpoints, procs, port, cluster.client_ports))
                finally:
                    server.kill()
                    server.wait()
            else:
                server, port, procs = c10d_server()
                try:
                    results.append(one_size(backend, nodes, port, procs))
                finally:
                    server.kill()
                    server.wait()
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    header = ["backend", "nodes", "connect s", "join s", "ops/node/s", "ops/s", "failure ops/node/s", "failure known s",
              "next round s", "store CPU/s"]
    rows = [[r["backend"], r["nodes"], r["connect_s"], r["join_s"], r["ops_per_node_per_s"], r["ops_per_s"],
             r["failure_ops_per_node_per_s"], r["failure_known_s"], r["next_round_s"], r["store_cpu_per_s"]]
            for r in results]
    print(f"\n{benchlib.machine()}; beat every {api.INTERVAL} s\n")
    print(benchlib.table(header, rows))
    for r in results:
        if "raft_writes_per_node_per_s" in r:
            print(f"etcd at {r['nodes']} nodes, steady state: {r['raft_writes_per_node_per_s']} Raft writes and "
                  f"{r['db_bytes_per_node_per_s']} bytes of database a node a second; requests by member "
                  f"{r['requests_by_member']}")
    for note in notes:
        print(note)
    benchlib.write_json(args.json, {"results": results})
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
