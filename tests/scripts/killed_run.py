"""A test run that tests/test_killed_run.py kills: its only test holds a 3-member etcd cluster and a launcher with
two ranks, says where they are (the file $KILLED_RUN_OUT names), and waits to be killed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil


def test_holds_a_cluster_and_a_launcher(etcd_cluster, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("import time\ntime.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "mpddp", "run", "--nprocs", "2", "job.py"], cwd=tmp_path,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while len(psutil.Process(launcher.pid).children(recursive=True)) < 3:  # its forkserver and two ranks
        time.sleep(0.2)
    pids = [*etcd_cluster.pids, launcher.pid, *(p.pid for p in psutil.Process(launcher.pid).children(recursive=True))]
    Path(os.environ["KILLED_RUN_OUT"]).write_text(json.dumps({"pids": pids, "token": os.environ["MPDDP_TEST_SUITE"]}))
    time.sleep(600)
