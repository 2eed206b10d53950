"""A real etcd cluster on loopback (Debian's etcd-server, /usr/bin/etcd) for tests and benchmarks.

    with EtcdCluster() as cluster:      # 3 members, a leader elected, a put/get answered
        run_something(cluster.endpoints)    # "127.0.0.1:C0,127.0.0.1:C1,127.0.0.1:C2"
        cluster.kill(cluster.leader_index())

Each member runs in its own session (a test's signals never reach it) with its data and its log in a
temporary directory; leaving the ``with`` block kills and reaps every member and removes that directory.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from multinode import free_port

if TYPE_CHECKING:
    from etcd3gw.client import Etcd3Client

# Fast elections for tests (etcd's defaults: 100 ms, 1000 ms); only errors in the logs.
FAST = ["--heartbeat-interval", "50", "--election-timeout", "500", "--logger", "zap", "--log-level", "error"]


class EtcdCluster:
    """``members`` etcd processes on one address (127.0.0.1 unless given) that form one cluster; a context manager."""

    def __init__(self, members: int = 3, base_dir: str | Path | None = None, timeout: float = 15.0,
                 quota_bytes: int | None = None, host: str = "127.0.0.1") -> None:
        """``quota_bytes``: etcd's --quota-backend-bytes (its NOSPACE alarm is raised past it; default 2 GiB);
        ``host``: the address its members listen on (a namespace hosts' bridge, tests/machines.py)."""
        self.host = host
        self.members = members
        self.extra = ["--quota-backend-bytes", str(quota_bytes)] if quota_bytes else []
        self.base_dir = base_dir
        self.timeout = timeout
        self.client_ports = [free_port() for _ in range(members)]
        self.peer_ports = [free_port() for _ in range(members)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dir: Path | None = None

    @property
    def endpoints(self) -> str:
        return ",".join(f"{self.host}:{port}" for port in self.client_ports)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def log(self, index: int) -> Path:
        assert self.dir is not None
        return self.dir / f"m{index}.log"

    def client(self, index: int, timeout: float = 2.0) -> Etcd3Client:
        """An etcd3gw client of member ``index`` (no proxy from the environment: it is loopback)."""
        import requests
        from etcd3gw.client import Etcd3Client

        session = requests.Session()
        session.trust_env = False
        return Etcd3Client(host=self.host, port=self.client_ports[index], timeout=timeout, session=session)

    def start(self) -> None:
        deadline = time.monotonic() + self.timeout
        self.dir = Path(tempfile.mkdtemp(prefix="etcd-", dir=self.base_dir))
        token = f"mpddp-test-{uuid.uuid4().hex[:12]}"
        initial = ",".join(f"m{i}=http://{self.host}:{port}" for i, port in enumerate(self.peer_ports))
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}  # flags only
        for i, (client, peer) in enumerate(zip(self.client_ports, self.peer_ports)):
            argv = ["etcd", "--name", f"m{i}", "--data-dir", str(self.dir / f"m{i}"),
                    "--listen-client-urls", f"http://{self.host}:{client}",
                    "--advertise-client-urls", f"http://{self.host}:{client}",
                    "--listen-peer-urls", f"http://{self.host}:{peer}",
                    "--initial-advertise-peer-urls", f"http://{self.host}:{peer}",
                    "--initial-cluster", initial, "--initial-cluster-state", "new",
                    "--initial-cluster-token", token, *FAST, *self.extra]  # fmt: skip
            with open(self.log(i), "wb") as log:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                        start_new_session=True)  # fmt: skip
            self.procs.append(proc)
            # One at a time: a new member first asks its peers whether they are bootstrapped, and a peer that
            # has bound its port but serves nothing yet keeps it waiting a whole second (etcd's bootstrap
            # timeout). Refused (not started yet) or answered (serving) costs nothing.
            self.wait_until(deadline, "serve its peers", functools.partial(self.peer_serves, i))
        self.wait_until(deadline, "elect a leader and answer a put/get", self.answers)

    def wait_until(self, deadline: float, what: str, done: Callable[[], bool]) -> None:
        while not done():
            if any(proc.poll() is not None for proc in self.procs):
                raise RuntimeError(f"an etcd member exited while the cluster started\n{self.tails()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd cluster did not {what} in {self.timeout} s\n{self.tails()}")
            time.sleep(0.02)

    def peer_serves(self, index: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.peer_ports[index]}/version", timeout=0.2):
                return True
        except OSError:  # refused, timed out (bound, not serving yet), or an HTTP error
            return False

    def answers(self) -> bool:
        """Every member names the same leader, and a key put through member 0 is read through each."""
        from etcd3gw.exceptions import Etcd3Exception

        try:
            leaders = {str(self.client(i, 0.2).status().get("leader", "0")) for i in range(self.members)}
            if len(leaders) != 1 or leaders == {"0"}:
                return False
            self.client(0).put("/etcd-cluster/ready", "yes")
            return all(self.client(i).get("/etcd-cluster/ready") == [b"yes"] for i in range(self.members))
        except Etcd3Exception:
            return False

    def tails(self, lines: int = 15) -> str:
        out = []
        for i in range(len(self.procs)):
            text = self.log(i).read_text(errors="replace").splitlines()[-lines:] if self.log(i).exists() else []
            out.append(f"--- member m{i} (pid {self.procs[i].pid}, exit {self.procs[i].poll()}): {self.log(i)}")
            out.extend(text)
        return "\n".join(out)

    def leader_index(self) -> int:
        """The index of the member that is the leader now, as the live members report it."""
        from etcd3gw.exceptions import Etcd3Exception

        ids: dict[str, int] = {}
        leaders: set[str] = set()
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    status = self.client(i).status()
                except Etcd3Exception:
                    continue
                ids[str(status["header"]["member_id"])] = i
                leaders.add(str(status.get("leader", "0")))
        found = [ids[leader] for leader in leaders if leader in ids]
        if len(found) != 1:
            raise RuntimeError(f"no single leader among the live members: leaders {leaders}, members {ids}")
        return found[0]

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` and reap it."""
        self.procs[index].kill()
        self.procs[index].wait()

    def stop(self) -> None:
        """Kill and reap every member, remove the directory; again is a no-op."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
