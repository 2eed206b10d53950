"""Real machines for the multi-node tests: network-namespace hosts on one bridge, and the faults a machine suffers.

    with Hosts(tmp_path, count=3, etcd=True) as hosts:      # n1, n2, n3 at 10.99.0.1-3; etcd on 10.99.0.254
        runs = [host.launch(["-m", "mpddp", "run", ...], tmp_path / f"n{host.number}") for host in hosts]
        hosts[1].cut()          # its link down: silence both ways, no reset (a pulled cable, a dead switch port)
        hosts[1].heal()         # the link back
        hosts[2].freeze(runs[2]); hosts[2].thaw(runs[2])    # SIGSTOP / SIGCONT of every process of that node
        hosts[0].kill(runs[0])  # SIGKILL of every process of that node at once
        hosts[0].busy(8)        # 8 CPU hogs on the machine (one session each: the kernel shares CPU by session)

Each host is a namespace of scripts/netns_hosts.sh: its own address (10.99.0.N), its host name (nN), its own
/etc/hosts, no resolver. A launcher runs there behind ``netns_hosts.sh run`` as a :class:`~runs.Run` (its marker
finds every process it started, also re-parented ones). Leaving the block kills every run, thaws and heals every
host, stops etcd and deletes the namespaces. Skips (with the reason) where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import pytest
from multinode import NETNS, machine_lock

from runs import Run, marked

BRIDGE = "10.99.0.254"  # the machine itself, as the hosts see it (etcd listens there)


class Host:
    """One namespace host: ``nN`` at 10.99.0.N."""

    def __init__(self, hosts: Hosts, number: int) -> None:
        self.hosts, self.number = hosts, number
        self.name, self.address = f"n{number}", f"10.99.0.{number}"
        self.cut_off = False
        self.frozen: list[psutil.Process] = []
        self.hogs: list[subprocess.Popen[bytes]] = []

    @property
    def prefix(self) -> list[str]:
        return [str(NETNS), "run", str(self.number), str(self.hosts.work)]

    def launch(self, argv: list[str], where: Path, env: dict[str, str] | None = None) -> Run:
        """``python *argv`` on this host, in ``where`` (made here)."""
        where.mkdir(parents=True, exist_ok=True)
        run = Run(argv, where, env=env, prefix=self.prefix)
        self.hosts.runs.append(run)
        return run

    def cut(self) -> None:
        """Its link down: what it sends and what is sent to it vanish, and no peer gets a reset."""
        subprocess.run([str(NETNS), "cut", str(self.number)], check=True, timeout=10)
        self.cut_off = True

    def heal(self) -> None:
        subprocess.run([str(NETNS), "heal", str(self.number)], check=True, timeout=10)
        self.cut_off = False

    def freeze(self, run: Run) -> None:
        """Every process of ``run`` stopped at once (a VM paused, a kernel stall): it answers nothing, and its
        sockets stay open (the peers' kernels still talk to this machine's)."""
        self.frozen = _processes(run)
        for proc in self.frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.suspend()

    def thaw(self) -> None:
        for proc in self.frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()
        self.frozen = []

    def kill(self, run: Run) -> None:
        """Every process of ``run`` SIGKILLed at once: a machine that crashed, as the kernel of a process sees it."""
        for proc in _processes(run):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        run.proc.wait(10)

    def busy(self, count: int) -> None:
        """``count`` CPU hogs, each in a session of its own (Linux shares the CPU by session: hogs in one session
        would take one share), stopped when the hosts go."""
        for _ in range(count):
            self.hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True))

    def idle(self) -> None:
        for hog in self.hogs:
            hog.kill()
            hog.wait()
        self.hogs = []


def _processes(run: Run) -> list[psutil.Process]:
    """The launcher of ``run`` and every process it started (its tree, and those that carry its marker)."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(run.proc.pid)
        found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    found.update({p.pid: p for p in marked(run.marker)})
    run.pids |= set(found)
    return list(found.values())


class Hosts:
    """``count`` namespace hosts, and a 3-member etcd on the bridge where ``etcd``; a context manager."""

    def __init__(self, work: Path, count: int = 3, etcd: bool = False) -> None:
        self.work, self.count, self.with_etcd = work, count, etcd
        self.hosts = [Host(self, n) for n in range(1, count + 1)]
        self.runs: list[Run] = []
        self.etcd: Any = None  # tests/etcd_cluster.py's EtcdCluster, where asked for
        self._stack = contextlib.ExitStack()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self):  # noqa: ANN204
        return iter(self.hosts)

    @property
    def endpoints(self) -> str:
        return str(self.etcd.endpoints)

    def __enter__(self) -> Hosts:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None:
            pytest.skip("namespace hosts need root, iproute2 and nsenter")
        if self.with_etcd and shutil.which("etcd") is None:
            pytest.skip("etcd is not installed (scripts/ci_etcd.sh install)")
        self._stack.enter_context(machine_lock())
        try:  # __exit__ runs only once __enter__ returned: what it made so far goes here otherwise
            self.work.mkdir(parents=True, exist_ok=True)
            up = subprocess.run([str(NETNS), "up", str(self.work), str(self.count)], capture_output=True, text=True,
                                timeout=30)
            if up.returncode == 3:
                pytest.skip(f"cannot make network namespaces here: {up.stderr.strip()}")
            self._stack.callback(subprocess.run, [str(NETNS), "down"], timeout=30, check=False)
            assert up.returncode == 0, up.stderr
            if self.with_etcd:
                from etcd_cluster import EtcdCluster

                self.etcd = self._stack.enter_context(EtcdCluster(host=BRIDGE))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        try:
            for host in self.hosts:
                host.thaw()
                host.idle()
            for run in self.runs:
                run.kill()
        finally:
            self._stack.close()
