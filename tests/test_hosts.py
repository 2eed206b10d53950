"""``--hosts``: one command on the first machine starts a launcher on every host over ssh.

Two network-namespace hosts (n1, n2; scripts/netns_hosts.sh), each with its
own sshd (Debian's openssh-server) and a key made for the test. The head runs
inside n1, as a user would from a shell on the first machine. Everything a
launch starts on either host carries the test's marker, so that a process left
on any host is found. Needs root, iproute2 and openssh-server; skips with the
reason elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from multinode import NETNS, namespace_hosts

from runs import marked

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

JOB = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print(f"RESULT rank={rank} world={dist.get_world_size()} sum={t.item():g} host={os.uname().nodename}", flush=True)
    if sys.argv[1:] == ["wait"]:
        print(f"READY {rank}", flush=True)
        time.sleep(600)
    dist.destroy_process_group()
""")

API = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import mpddp

    def where(ctx):
        t = torch.ones(1)
        dist.all_reduce(t)
        return (ctx.rank, ctx.node_rank, os.uname().nodename, t.item())

    if __name__ == "__main__":
        print("VALUES", mpddp.launch(where, hosts=["n1", "n2"], nprocs=2, ssh=sys.argv[1]))
""")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """n1 and n2, each running sshd with a key made for the test; -> the directory with ssh_config."""
    if not os.path.exists(SSHD) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("needs OpenSSH (Debian's openssh-server and openssh-client)")
    with namespace_hosts(tmp_path_factory.mktemp("hosts")) as work, _sshd_on_each(work):
        yield work


@contextlib.contextmanager
def _sshd_on_each(work: Path) -> Iterator[None]:
    daemons: list[subprocess.Popen] = []
    try:
        for name in ("key", "hostkey"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / name)], check=True)
        shutil.copy(work / "key.pub", work / "authorized_keys")
        (work / "sshd_config").write_text(textwrap.dedent(f"""
            HostKey {work}/hostkey
            AuthorizedKeysFile {work}/authorized_keys
            PermitRootLogin prohibit-password
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            UsePAM no
            StrictModes no
            PidFile none
        """))
        (work / "ssh_config").write_text(textwrap.dedent(f"""
            Host *
              IdentityFile {work}/key
              StrictHostKeyChecking no
              UserKnownHostsFile /dev/null
              LogLevel ERROR
        """))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        for i in (1, 2):
            daemons.append(subprocess.Popen([str(NETNS), "run", str(i), str(work), SSHD, "-D", "-e", "-f",
                                             str(work / "sshd_config"), "-o", f"ListenAddress=10.99.0.{i}:22"],
                                            stderr=open(work / f"sshd{i}.log", "w")))
        for i in (1, 2):
            _wait_for_ssh(work, f"n{i}")
        yield
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(10)


def _wait_for_ssh(work: Path, host: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        done = _on_n1(work, ["ssh", "-F", str(work / "ssh_config"), "-o", "BatchMode=yes", host, "true"], timeout=20)
        if done.returncode == 0:
            return
        assert time.monotonic() < deadline, f"sshd on {host} does not answer: {done.stderr}"
        time.sleep(0.2)


def _on_n1(work: Path, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(NETNS), "run", "1", str(work), *argv], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def _ssh(work: Path) -> str:
    return f"ssh -F {work / 'ssh_config'}"


def _env(marker: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "MPDDP_TEST_RUN": marker}


def _nothing_left(marker: str, wait: float = 10.0) -> None:
    deadline = time.monotonic() + wait
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [" ".join(p.cmdline())[:120] for p in left]


def test_launch_returns_every_rank_of_every_host(hosts: Path, tmp_path: Path) -> None:
    (tmp_path / "api.py").write_text(API)
    marker = uuid.uuid4().hex
    out = _on_n1(hosts, [sys.executable, "api.py", _ssh(hosts)], timeout=180, cwd=tmp_path, env=_env(marker))
    assert out.returncode == 0, out.stderr
    values = out.stdout.split("VALUES ")[1].strip()
    assert values == "[(0, 0, 'n1', 4.0), (1, 0, 'n1', 4.0), (2, 1, 'n2', 4.0), (3, 1, 'n2', 4.0)]", out.stdout
    _nothing_left(marker)


def test_train_across_two_hosts_reaches_its_accuracy(hosts: Path, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    out = _on_n1(hosts, [sys.executable, "-m", "mpddp", "train", "--hosts", "n1,n2", "--ssh", _ssh(hosts),
                         "--nprocs", "1", "--epochs", "2", "--run-dir", str(tmp_path / "run")],
                 timeout=200, cwd=tmp_path, env=_env(marker))
    assert out.returncode == 0, out.stderr
    last = [line for line in out.stdout.splitlines() if "epoch   2/2" in line]
    accuracy = float(re.search(r"test acc\s+([\d.]+)%", last[0]).group(1))  # type: ignore[union-attr]
    assert accuracy > 90.0, out.stdout
    assert '"world_size": 2' in (tmp_path / "run" / "metrics.jsonl").read_text()
    _nothing_left(marker)


def _start_waiting(hosts: Path, tmp_path: Path, marker: str) -> tuple[subprocess.Popen, Path]:
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "out.txt"
    head = subprocess.Popen([str(NETNS), "run", "1", str(hosts), sys.executable, "-m", "mpddp", "run", "--hosts",
                             "n1,n2", "--ssh", _ssh(hosts), "--nprocs", "2", "job.py", "wait"],
                            stdout=open(out, "w"), stderr=open(tmp_path / "err.txt", "w"), cwd=tmp_path,
                            env=_env(marker), start_new_session=True)
    deadline = time.monotonic() + 120
    while len(re.findall(r"READY \d", out.read_text())) < 4:
        assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()
        time.sleep(0.1)
    return head, tmp_path / "err.txt"


def test_run_across_two_hosts_then_ctrl_c_at_the_head_leaves_nothing_on_either_host(hosts: Path,
                                                                                    tmp_path: Path) -> None:
    """``mpddp run --hosts n1,n2 --nprocs 2``: ranks 0, 1 on n1 and 2, 3 on n2, one world of 4 whose all-reduce sums
    their ranks; then Ctrl-C at the head. (That a --hosts job ends 0 is the launch and train tests': one path.)"""
    marker = uuid.uuid4().hex
    head, err = _start_waiting(hosts, tmp_path, marker)
    try:
        out = (tmp_path / "out.txt").read_text()
        results = sorted(re.findall(r"\[rank (\d)\] RESULT rank=(\d) world=4 sum=6 host=(n\d)", out))
        assert results == [("0", "0", "n1"), ("1", "1", "n1"), ("2", "2", "n2"), ("3", "3", "n2")], out
        assert {p.environ().get("MPDDP_TEST_RUN") for p in marked(marker)} == {marker}
        os.killpg(head.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the head's process group
        assert head.wait(60) == 130, err.read_text()
    finally:
        head.kill()
    assert "mpddp: interrupted (SIGINT); every worker was stopped" in err.read_text()
    _nothing_left(marker)


def test_a_node_killed_mid_run_stops_the_job_and_leaves_nothing(hosts: Path, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    head, err = _start_waiting(hosts, tmp_path, marker)
    try:
        nodes = [p for p in marked(marker) if "mpddp.core.launcher.hosts_node" in " ".join(p.cmdline()) and
                 "ssh" not in p.name()]
        node1 = [p for p in nodes if p.environ().get("MPDDP_TEST_RUN") and "n2" in _hostname(p.pid)]
        assert len(node1) == 1, [(p.pid, _hostname(p.pid)) for p in nodes]
        node1[0].kill()
        assert head.wait(60) == 1, err.read_text()
    finally:
        head.kill()
    assert "mpddp: node 1's launcher on host n2 ended (ssh exit code " in err.read_text(), err.read_text()
    _nothing_left(marker)


def _hostname(pid: int) -> str:
    """The host name (UTS namespace) a process runs under."""
    try:
        return subprocess.run(["nsenter", "-t", str(pid), "-u", "hostname"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def test_a_host_with_no_sshd_is_named(hosts: Path, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    marker = uuid.uuid4().hex
    # 10.99.0.3: an address on the test's own bridge where no host answers
    out = _on_n1(hosts, [sys.executable, "-m", "mpddp", "run", "--hosts", "n1,10.99.0.3", "--ssh", _ssh(hosts),
                         "--nprocs", "1", "--timeout", "10", "job.py"], timeout=120, cwd=tmp_path, env=_env(marker))
    assert out.returncode == 2, out.stderr
    assert re.fullmatch(r"mpddp: error: host 10\.99\.0\.3 (did not answer ssh within \d+ s|refused or failed ssh "
                        r"\(ssh: connect to host 10\.99\.0\.3 port 22: .*\)): .*\n", out.stderr), out.stderr
    _nothing_left(marker)
