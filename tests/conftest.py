import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import leftovers  # noqa: E402

# A test suite started as a background job of a non-interactive shell (POSIX: with SIGINT ignored) would
# pass that on to every launcher it starts, and a test's Ctrl-C would then do nothing. An ignored signal
# stays ignored across exec, a handled one starts at its default action: so handle it here, as Python's
# own default does, and every launcher starts as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Files whose tests use this machine's namespace hosts or SLURM daemons (tests/multinode.py's machine_lock):
# one xdist worker runs them all, one after another, so that the other never waits for the lock.
MACHINE_FILES = {"test_hosts.py", "test_mpirun.py", "test_multinode.py", "test_slurm_cluster.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test file runs on one worker, as one group: its module fixtures are then made once."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            name = item.path.name
            item.add_marker(pytest.mark.xdist_group("machine" if name in MACHINE_FILES else name))


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
