import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reaper import watch_this_run  # noqa: E402

from helpers import leftovers  # noqa: E402

# A test suite started as a background job of a non-interactive shell (POSIX: with SIGINT ignored) would
# pass that on to every launcher it starts, and a test's Ctrl-C would then do nothing. An ignored signal
# stays ignored across exec, a handled one starts at its default action: so handle it here, as Python's
# own default does, and every launcher starts as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """The run's first process (not an xdist worker) marks what it starts, and a watcher kills it all once the run
    is gone, killed too (tests/reaper.py): before xdist starts its workers, which carry the mark as well."""
    if not hasattr(config, "workerinput"):
        watch_this_run()


# Files whose tests use this machine's namespace hosts or SLURM daemons (tests/multinode.py's machine_lock):
# one xdist worker runs them all, one after another, so that the other never waits for the lock.
MACHINE_FILES = {"test_hosts.py", "test_lost_machine.py", "test_machine_order.py", "test_mpirun.py",
                 "test_two_hosts.py", "test_slurm_cluster.py"}

# The groups that take longest (a worker's seconds, 2 cores at load 5 to 9, as a run's closing table says): they start
# first, so that the run does not end with one worker on a long file and the other idle. A stale figure costs balance,
# never a result; the groups not named here follow in xdist's order.
LONGEST = {"machine": 300, "test_elastic.py": 110, "test_lost_node.py": 110, "test_door.py": 80,
           "test_store_server_edges.py": 125, "test_named_across_nodes.py": 110, "test_rendezvous_input.py": 95,
           "test_torchrun_flags.py": 85, "test_helper_processes.py": 80, "test_roll_call.py": 80,
           "test_collectives.py": 80, "test_grace.py": 75}


def group(nodeid: str) -> str:
    """The xdist work unit of a test: its file, or "machine" for the files that share the machine's hosts."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return "machine" if name in MACHINE_FILES else name


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` as this suite means it: each test file on one worker, its module fixtures made once.

    Not xdist's own: it marks a test's group in its node id, which pytest 9.2 no longer lets it change, and then
    spreads the tests one by one (pytest-xdist#1386): a module's cluster made twice, the machine files on both
    workers at once, one of them skipped at the lock.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda unit: LONGEST.get(unit, 0))  # the first, where none is named
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return ByFile(config, log)


@pytest.fixture
def cluster(tmp_path: Path):
    """Launchers of one test in one folder (tests/multinode.py's Cluster), every process of theirs killed after."""
    from multinode import Cluster

    c = Cluster(tmp_path)
    yield c
    c.kill_all()


@pytest.fixture
def no_leftovers():
    """Fail the test if any process it started (other than the forkserver) survives it."""
    yield
    left = leftovers()
    for proc in left:
        proc.kill()
    assert not left, f"processes left running: {[p.cmdline() for p in left]}"


@pytest.fixture
def cli(monkeypatch, tmp_path, capsys):
    """Run `mpddp ...` in this process: returns (exit code, stdout, stderr); run_cli's signal handlers undone."""
    from mpddp.cli import run_cli

    monkeypatch.chdir(tmp_path)
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1)}

    def run(*args):
        with pytest.raises(SystemExit) as e:
            run_cli(list(args))
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    yield run
    for s, handler in kept.items():
        signal.signal(s, handler)


@pytest.fixture(scope="module")
def etcd_cluster():
    """A running 3-member etcd cluster on loopback (tests/etcd_cluster.py), shared by a test file."""
    import shutil

    if shutil.which("etcd") is None:
        pytest.skip("Debian's etcd-server is not installed: apt-get install etcd-server")
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        pytest.skip("etcd3gw is not installed: pip install -e '.[etcd]'")
    from etcd_cluster import EtcdCluster

    with EtcdCluster() as cluster:
        yield cluster


# Each file's worker-seconds (setup, call and teardown of its tests, summed over xdist's workers): the suite's budget
# is kept per file (docs/development.rst), and --durations names tests, not files. Printed at the end of every run,
# with the CPU seconds the file's tests spent, their processes' included once reaped (on 2 cores the suite is bound
# by CPU: a file that waits costs a worker, one that computes costs every worker).
_FILE_SECONDS: dict[str, float] = {}
_FILE_CPU: dict[str, float] = {}
_CPU_AT = [0.0]  # this worker's CPU seconds, its reaped children's included, when the last phase of a test ended


def _cpu_now() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _CPU_AT[0] = _cpu_now()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    now = _cpu_now()
    outcome.get_result().user_properties.append(("cpu", now - _CPU_AT[0]))  # travels with the report (xdist)
    _CPU_AT[0] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration
    cpu = sum(value for key, value in report.user_properties if key == "cpu")
    _FILE_CPU[name] = _FILE_CPU.get(name, 0.0) + cpu


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    shown = config.getoption("file_seconds")
    if not _FILE_SECONDS or shown == 0:
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])
    total, cpu = sum(_FILE_SECONDS.values()), sum(_FILE_CPU.values())
    terminalreporter.write_sep("=", f"worker-seconds per file: {total:.0f} in all ({cpu:.0f} CPU seconds), the "
                                    f"{min(shown, len(ranked))} longest")
    for name, seconds in ranked[:shown]:
        terminalreporter.write_line(f"{seconds:8.1f}  {_FILE_CPU.get(name, 0.0):7.1f} CPU  {name}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--file-seconds", type=int, default=12, metavar="N",
                     help="print the N test files that took the most worker-seconds (0: none; default 12)")
