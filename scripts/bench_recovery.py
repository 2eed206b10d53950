"""Recovery benchmark: from a rank's death to every rank of the restarted group back at its first step.

A 2-rank-a-node gloo job trains a small DDP model; on the first attempt one rank (the last node's last
rank) SIGKILLs itself ``--fail-after`` seconds after its first step (2 s: a failure in a job that is
under way; 0: at step 2, when a several-node launcher may still be importing torch for its link to
node 0's store), and ``max_restarts=1`` restarts the group. Each rank prints the wall
time of its first step and the failing rank the time just before it dies (one machine, one clock).

  start-up   from the launchers' start to the last rank's first step of attempt 0
  recovery   from the death to the last rank's first step of attempt 1 (and, apart, until the last
             rank's fn was called again: what the launcher takes, before the user's own set-up)
  ratio      recovery / start-up, in the same run (goal on one node: at most 0.25)

A launch with restarts preloads torch._dynamo (DDP's constructor and every optimizer import it) into the forkserver, so
that a restarted rank does not import it again. Nodes are launchers on 127.0.0.1 with node ranks (1, 2, 4, 8), started
together. Side by side on one node: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` running the same job
as a torchrun script (``init_process_group("gloo")`` from the environment).

    python scripts/bench_recovery.py                   # 3 interleaved reps, 1, 2, 4 and 8 nodes
    python scripts/bench_recovery.py --nodes 1,2 --reps 5 --json recovery.json

``--machines``: only a machine killed, cut off (its link down: no RST, no FIN) or frozen (SIGSTOP of all its
processes), side by side, on three network-namespace hosts (tests/machines.py; root), etcd and c10d, the default
--timeout: from the fault to the survivors' first step of the next round (goal: 8 s).

    python scripts/bench_recovery.py --machines --reps 3

Otherwise it ends with a whole node's machine lost in a ``--nnodes N-1:N`` job (every process of it SIGKILLed at step
20; N is 3, or each of ``--loss-nodes 3,16``): node 1 under c10d, node 0 under etcd (a real 3-member etcd on loopback),
timed from the loss to the survivors' first step of the next round; the etcd lease's TTL bounds how soon the loss is
known.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

STEPS, FAIL_AT = 6, 2
GOAL = 0.25


def train(rank: int, restart: int, world_size: int, fail: int, fail_after: float) -> list[float]:
    """The job of every rank, under mpddp or torchrun; the process group is already up."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    print(f"ENTERED {rank} {restart} {time.time():.6f}", flush=True)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1000 + rank)
    first = 0.0
    for step in range(STEPS if restart else 10**6):  # the first attempt runs until the failing rank dies
        x = torch.randn(8, 4, generator=data)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0:
            first = time.time()
            print(f"READY {rank} {restart} {first:.6f}", flush=True)
        if rank == fail and restart == 0 and step >= FAIL_AT and time.time() - first >= fail_after:
            print(f"FAILING {rank} {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.01)
    return [p.detach().sum().item() for p in model.parameters()]


def mpddp_rank(ctx, fail: int, fail_after: float) -> list[float]:  # noqa: ANN001 - a WorkerContext
    return train(ctx.rank, ctx.restart, ctx.world_size, fail, fail_after)


def node_main(node: int, nnodes: int, port: int, fail_after: float) -> None:
    import mpddp

    mpddp.launch(mpddp_rank, nprocs=2, args=(2 * nnodes - 1, fail_after), backend="gloo", nnodes=nnodes, node_rank=node,
                 master_addr="127.0.0.1", master_port=port, max_restarts=1, timeout=120)


def torchrun_main(fail_after: float) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    train(dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"]), dist.get_world_size(), 1, fail_after)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=10)


def one_run(kind: str, nnodes: int, workdir: Path, limit: float, fail_after: float,
            ) -> tuple[float, float, float] | None:
    """(start-up, recovery, recovery up to fn) seconds of one job; None if it did not recover."""
    me = str(Path(__file__).resolve())
    if kind == "torchrun":
        cmds = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "--max-restarts", "1", me, "--torchrun-worker", "--fail-after", str(fail_after)]]
    else:
        port = _free_port()
        cmds = [[sys.executable, me, "--node", str(n), "--nnodes", str(nnodes), "--port", str(port),
                 "--fail-after", str(fail_after)] for n in range(nnodes)]
    outs = [workdir / f"{kind}-{i}.out" for i in range(len(cmds))]
    started = time.time()
    # what a launcher leaves in its TMPDIR (torchrun's torchelastic_*) goes with workdir
    tmpdir = workdir / f"{kind}-tmp"
    tmpdir.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir))
    procs = [subprocess.Popen(cmd, stdout=out.open("w"), stderr=subprocess.STDOUT, env=env)
             for cmd, out in zip(cmds, outs)]
    deadline = time.monotonic() + limit
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:  # torchrun's restart hung here once for 10 minutes
            _kill_tree(proc.pid)
            codes.append(-1)
    if any(codes):
        return None  # a peer whose restart does not recover (torchrun's gloo group, seen here): counted, not timed
    text = "\n".join(o.read_text() for o in outs)
    ready = {(int(r), int(a)): float(t) for r, a, t in re.findall(r"READY (\d+) (\d+) ([\d.]+)", text)}
    entered = {(int(r), int(a)): float(t) for r, a, t in re.findall(r"ENTERED (\d+) (\d+) ([\d.]+)", text)}
    failing = [float(t) for t in re.findall(r"FAILING \d+ ([\d.]+)", text)]
    world = 2 * nnodes
    first = max(t for (r, a), t in ready.items() if a == 0)
    again = max(t for (r, a), t in ready.items() if a == 1)
    assert len([k for k in ready if k[1] == 1]) == world and len(failing) == 1, text[-3000:]
    in_fn = max(t for (r, a), t in entered.items() if a == 1)
    return first - started, again - failing[0], in_fn - failing[0]


NODE_LOSS_JOB = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(10**6 if restart == 0 else 20):
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"STEP {restart} {step} {time.time():.6f}", flush=True)
    time.sleep(0.05)
dist.destroy_process_group()
"""


def node_loss_run(backend: str, workdir: Path, limit: float, endpoints: str = "",
                  nodes: int = 3) -> tuple[float, float] | None:
    """The start-up (from the launchers' start to the last rank's first step) and the seconds from a node's
    machine lost (every process of it SIGKILLed at step 20) to the survivors' first step of the next round,
    in a ``--nnodes N-1:N`` job of N launchers of one rank; None if they did not."""
    import uuid

    job = workdir / "node_loss_job.py"
    job.write_text(NODE_LOSS_JOB)
    port, victim = _free_port(), 0 if backend == "etcd" else 1  # c10d survives any node but 0
    common = [sys.executable, "-m", "mpddp", "run", "--nnodes", f"{nodes - 1}:{nodes}", "--nprocs", "1",
              "--max-restarts", "1", "--timeout", str(30 + nodes)]
    where = (["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoints, "--rdzv-id", uuid.uuid4().hex,
              "--local-addr", "127.0.0.1"] if backend == "etcd" else
             ["--master-addr", "127.0.0.1", "--master-port", str(port)])
    outs = [workdir / f"loss-{backend}-{n}.out" for n in range(nodes)]
    started = time.time()
    procs = [subprocess.Popen([*common, *where, "--node-rank", str(n), str(job)], stdout=out.open("w"),
                              stderr=subprocess.STDOUT) for n, out in enumerate(outs)]
    deadline = time.monotonic() + limit
    try:
        while not re.search(r"STEP 0 20 ", outs[victim].read_text()):
            if time.monotonic() > deadline or procs[victim].poll() is not None:
                return None
            time.sleep(0.02)
        _kill_tree(procs[victim].pid)
        lost_at = time.time()
        codes = [p.wait(max(0.1, deadline - time.monotonic())) for n, p in enumerate(procs) if n != victim]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            _kill_tree(p.pid)
    firsts = [re.search(r"STEP 1 0 ([\d.]+)", out.read_text()) for n, out in enumerate(outs) if n != victim]
    starts = [re.search(r"STEP 0 0 ([\d.]+)", out.read_text()) for out in outs]
    if any(codes) or not all(firsts) or not all(starts):
        return None
    return max(float(m.group(1)) for m in starts if m) - started, max(float(m.group(1)) for m in firsts if m) - lost_at


def node_loss_rows(reps: int, limit: float, tmp: Path, sizes: list[int]) -> tuple[list[list[str]], dict[str, Any]]:
    """The loss of a whole node's machine, on each backend (etcd needs Debian's etcd-server and etcd3gw)."""
    import importlib.util

    from mpddp.rendezvous_options import DEFAULT_TTL

    rows, results = [], {}
    cases = [(backend, n, f"node {0 if backend == 'etcd' else 1} of {n} lost" + (
        f", lease ttl {DEFAULT_TTL} s" if backend == "etcd" else "")) for n in sizes for backend in ("c10d", "etcd")]
    for backend, nodes, what in cases:
        if backend == "etcd" and (shutil.which("etcd") is None or importlib.util.find_spec("etcd3gw") is None):
            rows.append([f"{backend}: {what}", "-", "skipped: etcd-server or etcd3gw not installed", "-"])
            continue
        times = []
        for _ in range(reps):
            if backend == "etcd":
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
                from etcd_cluster import EtcdCluster  # a real 3-member cluster on loopback

                with EtcdCluster() as cluster:
                    took = node_loss_run(backend, tmp, limit, cluster.endpoints, nodes)
            else:
                took = node_loss_run(backend, tmp, limit, nodes=nodes)
            if took is None:
                raise RuntimeError(f"{backend}: the survivors of a lost node did not go on: see {tmp}/loss-*.out")
            times.append(took)
        starts, losses = [t[0] for t in times], [t[1] for t in times]
        results[f"{backend} {nodes}"] = {"startup": starts, "loss_to_first_step": losses,
                                         "ttl": DEFAULT_TTL if backend == "etcd" else None}
        rows.append([f"{backend}: {what}", f"{statistics.median(starts):.2f}", f"{statistics.median(losses):.2f}",
                     f"{min(losses):.2f}-{max(losses):.2f}"])
    return rows, results


MACHINE_FAULTS = [("etcd", "kill", 1), ("etcd", "cut", 1), ("etcd", "freeze", 1), ("etcd", "cut", 0),
                  ("etcd", "freeze", 0), ("c10d", "kill", 2), ("c10d", "cut", 2), ("c10d", "freeze", 2),
                  ("c10d", "cut", 0), ("c10d", "freeze", 0)]
MACHINE_GOAL = 8.0  # seconds from a machine's fault to the survivors' first step (c10d's node 0: to their end)


def machine_run(backend: str, fault: str, victim: int, workdir: Path, limit: float) -> float | None:
    """Three namespace hosts (tests/machines.py), a 2:3 job at the default --timeout, one rank a node; host
    ``victim`` killed, cut off or frozen at step 20: the seconds to the survivors' first step of the next round (c10d's
    node 0: to the survivors' end, which its loss is). None when they did not within ``limit``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from machines import Hosts

    workdir.mkdir(parents=True)
    job = workdir / "node_loss_job.py"
    job.write_text(NODE_LOSS_JOB)
    with Hosts(workdir / "hosts", 3, etcd=backend == "etcd") as hosts:
        where = (["--rdzv-backend", "etcd", "--rdzv-endpoint", hosts.endpoints, "--rdzv-id", "bench"]
                 if backend == "etcd" else ["--master-addr", "n1", "--master-port", str(_free_port())])
        runs = [host.launch(["-m", "mpddp", "run", "--nnodes", "2:3", "--node-rank", str(n), "--nprocs", "1",
                             "--max-restarts", "1", *where, str(job)], workdir / host.name)
                for n, host in enumerate(hosts)]
        runs[victim].wait_for(r"STEP 0 20 ", timeout=limit)
        for run in runs:
            run.list_tree()
        host, at = hosts[victim], time.time()
        {"kill": lambda: host.kill(runs[victim]), "cut": host.cut, "freeze": lambda: host.freeze(runs[victim])}[fault]()
        survivors = [run for n, run in enumerate(runs) if n != victim]
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if backend == "c10d" and victim == 0:
                if all(run.proc.poll() is not None for run in survivors):
                    return time.time() - at
            elif all(re.search(r"STEP 1 0 ", run.stdout) for run in survivors):
                return max(float(re.search(r"STEP 1 0 ([\d.]+)", run.stdout).group(1))  # type: ignore[union-attr]
                           for run in survivors) - at
            time.sleep(0.05)
    return None


def machine_rows(reps: int, limit: float, tmp: Path) -> tuple[list[list[str]], dict[str, Any]]:
    """Kill, cut and freeze side by side, on each backend, on namespace hosts (root, iproute2; etcd for its rows)."""
    rows, results = [], {}
    for backend, fault, victim in MACHINE_FAULTS:
        label = f"{backend}: node {victim} {fault}" + (" (ends the job)" if backend == "c10d" and victim == 0 else "")
        times = []
        for rep in range(reps):
            try:
                took = machine_run(backend, fault, victim, tmp / f"{backend}-{fault}-{victim}-{rep}", limit)
            except BaseException as e:  # noqa: BLE001 - pytest's Skipped: no namespaces (or no etcd) here
                if type(e).__name__ != "Skipped":
                    raise
                rows.append([label, f"skipped: {e}", "-"])
                break
            if took is None:
                raise RuntimeError(f"{label}: the survivors did not go on within {limit:g} s: see {tmp}")
            times.append(took)
        if times:
            results[label] = times
            rows.append([label, f"{statistics.median(times):.1f}", f"{min(times):.1f}-{max(times):.1f}"])
    return rows, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="1,2,4,8", help="node counts, e.g. 1,2,4,8")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-torchrun", action="store_true")
    parser.add_argument("--fail-after", type=float, default=2.0,
                        help="seconds after its first step the failing rank dies (0: at step 2, the worst case)")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds a job may take before it counts as hung")
    parser.add_argument("--tiny", action="store_true", help="one rep, one node (the suite's smoke run)")
    parser.add_argument("--quiet", type=float, default=60.0, help="wait until the CPUs are at most this %% busy")
    parser.add_argument("--no-node-loss", action="store_true", help="skip the rows of a whole node's machine lost")
    parser.add_argument("--loss-nodes", default="3", help="launchers of the node-loss jobs, e.g. 3,16")
    parser.add_argument("--machines", action="store_true",
                        help="only the rows of a machine killed, cut off or frozen, on three namespace hosts (root)")
    parser.add_argument("--json")
    parser.add_argument("--node", type=int)
    parser.add_argument("--nnodes", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--torchrun-worker", action="store_true")
    args = parser.parse_args()
    if args.torchrun_worker:
        return torchrun_main(args.fail_after)
    if args.node is not None:
        return node_main(args.node, args.nnodes, args.port, args.fail_after)
    if args.machines:
        return machines_main(args)
    nodes = [1] if args.tiny else [int(n) for n in args.nodes.split(",")]
    reps = 1 if args.tiny else args.reps
    kinds = [("mpddp", n) for n in nodes]
    if not args.no_torchrun:
        kinds.append(("torchrun", 1))
    times: dict[str, list[tuple[float, float, float]]] = {f"{k} {n}": [] for k, n in kinds}
    failed: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-recovery-") as tmp:
        for _ in range(reps):
            for kind, n in kinds:
                benchlib.wait_for_quiet(args.quiet, patience=30.0)
                if ((timed := one_run(kind, n, Path(tmp), args.limit, args.fail_after)) is None
                        and kind.startswith("mpddp")):
                    raise RuntimeError(f"mpddp on {n} node(s) did not recover: see {tmp}")
                if timed is None:
                    failed[f"{kind} {n}"] = failed.get(f"{kind} {n}", 0) + 1
                else:
                    times[f"{kind} {n}"].append(timed)
    rows, results = [], {}
    for key, runs in times.items():
        if not runs:
            rows.append([key + " node(s)", "-", f"did not recover ({failed.get(key, 0)} of {reps}: failed or hung)",
                         "-", "-", "-"])
            results[key] = {"failed": failed.get(key, 0)}
            continue
        start = statistics.median(s for s, _, _ in runs)
        back = statistics.median(r for _, r, _ in runs)
        to_fn = statistics.median(f for _, _, f in runs)
        ratios = [r / s for s, r, _ in runs]
        results[key] = {"startup": [s for s, _, _ in runs], "recovery": [r for _, r, _ in runs],
                        "recovery_to_fn": [f for _, _, f in runs], "ratio": ratios}
        label = key + " node(s)" + (f" ({failed[key]} of {reps} did not recover)" if failed.get(key) else "")
        rows.append([label, f"{start:.2f}", f"{back:.2f}", f"{to_fn:.2f}", f"{statistics.median(ratios):.2f}",
                     f"{min(ratios):.2f}-{max(ratios):.2f}"])
    print(f"\n{benchlib.machine()}; load {benchlib.load():.1f}; {reps} rep(s), medians\n")
    print(benchlib.table(["job", "start-up s", "recovery s", "of it, until fn runs", "recovery / start-up", "range"],
                         rows))
    if (one := results.get("mpddp 1")) is not None:
        ratio = statistics.median(one["ratio"])
        print(f"\ngoal on one node, recovery / start-up <= {GOAL:.2f}: {ratio:.2f} "
              f"({'met' if ratio <= GOAL else 'not met'})")
    if not (args.tiny or args.no_node_loss):
        kept = Path(tempfile.mkdtemp(prefix="mpddp-bench-loss-"))  # kept when a run did not recover: its outputs
        sizes = [int(n) for n in args.loss_nodes.split(",")]
        loss_rows, results["node_loss"] = node_loss_rows(reps, args.limit, kept, sizes)
        shutil.rmtree(kept, ignore_errors=True)
        print("\na node's machine lost (--nnodes N-1:N, N launchers x 1 rank): from the SIGKILL of its every "
              "process to the survivors' first step of the next round\n")
        print(benchlib.table(["job", "start-up s", "loss to first step s", "range"], loss_rows))
        print("goal: under 10 s with the default settings (NVRx's in-job restart: about a minute; torchrun with "
              "c10d: the job ends when node 0 is lost)")
    benchlib.write_json(args.json, {"results": results, "goal": GOAL})


def machines_main(args: argparse.Namespace) -> None:
    benchlib.wait_for_quiet(args.quiet, patience=30.0)
    with tempfile.TemporaryDirectory(prefix="mpddp-bench-machines-") as tmp:
        rows, results = machine_rows(args.reps, args.limit, Path(tmp))
    print(f"\n{benchlib.machine()}; load {benchlib.load():.1f}; {args.reps} rep(s), medians")
    print("three namespace hosts, --nnodes 2:3, 1 rank a node, the default --timeout; from the fault to the "
          "survivors' first step of the next round (c10d's node 0: to their end)\n")
    print(benchlib.table(["fault", "seconds", "range"], rows))
    worst = max((max(t) for t in results.values()), default=0.0)
    print(f"\ngoal: at most {MACHINE_GOAL:g} s for every fault: {worst:.1f} s at most "
          f"({'met' if worst <= MACHINE_GOAL else 'not met'})")
    benchlib.write_json(args.json, {"machines": results, "goal": MACHINE_GOAL})


if __name__ == "__main__":
    main()
