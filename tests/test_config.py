import os
import resource

import pytest

from mpddp import ConfigError, LaunchConfig
from mpddp.config import parse_gpus, parse_output_ranks

BAD = [
    ({"nprocs": 0}, r"nprocs=0 is out of range: it must be an integer >= 1"),
    ({"nprocs": -1}, r"nprocs=-1 is out of range"),
    ({"nprocs": "abc"}, r"nprocs='abc' is not allowed: it must be an integer >= 1"),
    ({"nprocs": 2.5}, r"nprocs=2.5 is not allowed"),
    ({"nnodes": 0}, r"nnodes=0 is out of range"),
    ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, r"node_rank=2 with nnodes=2: node ranks run from 0 to 1"),
    ({"node_rank": -1}, r"node_rank=-1 is out of range"),
    ({"master_port": 70000}, r"master_port=70000 is out of range: it must be an integer from 0 to 65535"),
    ({"nnodes": 2}, r"master_port=0 with nnodes>1: .*pass the same --master-port"),
    ({"master_addr": ""}, r"master_addr='' is empty"),
    ({"backend": "mpi"}, r"backend='mpi' is unknown: use one of auto, nccl, gloo"),
    ({"start_method": "thread"}, r"start_method='thread' is unknown: use one of forkserver, spawn, fork"),
    ({"timeout": 0}, r"timeout=0 is not allowed: it must be a number of seconds > 0"),
    ({"timeout": -3.0}, r"timeout=-3.0 is not allowed"),
    ({"timeout": float("inf")}, r"timeout=inf is out of range: it must be from 1 to 1e\+07 seconds"),
    ({"timeout": 1e300}, r"timeout=1e\+300 is out of range: it must be from 1 to 1e\+07 seconds"),
    ({"timeout": 1e-9}, r"timeout=1e-09 is out of range: it must be from 1 to 1e\+07 seconds, e.g. 180"),
    ({"max_restarts": -1}, r"max_restarts=-1 is out of range"),
    ({"gpus": "0,x"}, r"gpus='0,x' is not a list of GPU ids"),
    ({"gpus": "0,1,0"}, r"gpus=0,1,0 names GPU 0 twice"),
    ({"gpus": [0, -2]}, r"gpus=\[0, -2\] holds -2: GPU ids are integers >= 0"),
    ({"gpus": (0, 1), "nprocs": 3, "backend": "nccl"}, r"nprocs=3 with gpus=0,1: NCCL needs one GPU per rank"),
    ({"output_ranks": (-1,)}, r"output_ranks=\(-1,\): use 'all' or ranks >= 0"),
    ({"output_ranks": "7", "nprocs": 2},
     r"output_ranks=7 names rank 7, but the world has 2 ranks \(nnodes=1 × nprocs=2\): "
     r"pass ranks from 0 to 1, or all"),
    ({"output_ranks": (0, 4), "nprocs": 2, "nnodes": 2, "master_port": 29500},
     r"output_ranks=0,4 names rank 4, but the world has 4 ranks \(nnodes=2 × nprocs=2\)"),
    ({"nprocs": 10**20}, r"nprocs=100000000000000000000 needs about 800000000000000000064 open files in the launcher "
                         r"\(8 per rank \+ 64\) but the limit here is \d+ \(ulimit -n\): pass --nprocs \d+ or fewer"),
    ({"log_dir": "/etc/passwd/logs"}, r"log_dir='/etc/passwd/logs' cannot be created: '/etc/passwd' is a file: pass a "
                                      r"directory \(created if missing\), e.g. logs"),
    ({"log_dir": "/proc/nope/logs"}, r"log_dir='/proc/nope/logs' cannot be created: '/proc' is not writable \(on the "
                                     r"proc file system\): pass a directory you can write, e.g. logs"),
    ({"log_dir": "/sys/logs"}, r"log_dir='/sys/logs' cannot be created: '/sys' is not writable \(on the sysfs"),
    ({"log_dir": 5}, r"log_dir=5 is not a path: pass a directory"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_every_violation_is_a_one_line_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        LaunchConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_defaults_are_valid_and_frozen():
    config = LaunchConfig()
    assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (1, 0, "127.0.0.1", 0)
    assert config.start_method == "forkserver" and config.backend == "auto" and config.timeout > 0
    with pytest.raises(AttributeError):
        config.nprocs = 3  # type: ignore[misc]


def test_gpu_and_output_rank_parsing():
    assert parse_gpus("0,3") == (0, 3)
    assert parse_gpus([2]) == (2,)
    assert parse_gpus("free:2") == "free:2"
    assert parse_gpus(None) is None
    assert parse_output_ranks("all") is None
    assert parse_output_ranks("0,2") == (0, 2)
    assert LaunchConfig(gpus="1,2", nprocs=3, backend="gloo").gpus == (1, 2)
    with pytest.raises(ConfigError, match="output_ranks='x'"):
        parse_output_ranks("x")


def test_output_ranks_are_checked_against_the_world_only_when_it_is_known():
    assert LaunchConfig(nprocs=2, nnodes=2, master_port=29500, output_ranks="3").output_ranks == (3,)
    assert LaunchConfig(output_ranks="7").output_ranks == (7,)  # nprocs decided later (one per GPU)


def test_local_ranks_must_fit_the_open_file_and_process_limits(monkeypatch):
    limits = {resource.RLIMIT_NOFILE: (256, 4096), resource.RLIMIT_NPROC: (30, 30)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits[which])
    assert LaunchConfig(nprocs=24).nprocs == 24  # 24 × 8 + 64 = 256 files, 24 < 30 processes
    with pytest.raises(ConfigError, match=r"^nprocs=25 needs about 264 open files in the launcher \(8 per rank \+ 64\) "
                                          r"but the limit here is 256 \(ulimit -n\): pass --nprocs 24 or fewer, or "
                                          r"raise the limit first with `ulimit -n 264`$"):
        LaunchConfig(nprocs=25)
    limits[resource.RLIMIT_NOFILE] = (256, 256)  # the hard limit: ulimit -n cannot go higher
    with pytest.raises(ConfigError, match=r"limit here is 256 \(ulimit -n\): pass --nprocs 24 or fewer$"):
        LaunchConfig(nprocs=25)
    limits[resource.RLIMIT_NOFILE] = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    with pytest.raises(ConfigError,
                       match=r"^nprocs=30 is more processes than this user may run here \(30, ulimit -u\): "
                             r"pass --nprocs 29 or fewer, or raise `ulimit -u`$"):
        LaunchConfig(nprocs=30)
    limits[resource.RLIMIT_NPROC] = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert LaunchConfig(nprocs=5000).nprocs == 5000


def test_a_log_dir_is_checked_without_creating_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert LaunchConfig(log_dir="new/deeper/logs").log_dir == "new/deeper/logs"
    assert LaunchConfig(log_dir=str(tmp_path)).log_dir == str(tmp_path) and LaunchConfig(log_dir="").log_dir == ""
    with pytest.raises(ConfigError,
                       match=r"^log_dir='afile/logs' cannot be created: 'afile' is a file: pass a directory"):
        LaunchConfig(log_dir="afile/logs")
    monkeypatch.setattr(os, "access", lambda path, mode: path != "new")
    (tmp_path / "new").mkdir()
    with pytest.raises(ConfigError, match=r"^log_dir='new/logs' cannot be created: 'new' is not writable \(read-only, "
                                          r"or not yours\): pass a directory you can write, e.g. logs$"):
        LaunchConfig(log_dir="new/logs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "new"]  # only what the test made


def test_an_elastic_size_reads_as_min_and_max_from_the_api_as_from_the_cli():
    from mpddp.core.launcher.api import make_config

    config = LaunchConfig(nnodes="2:4", master_port=29500)  # type: ignore[arg-type]  # launch(nnodes="2:4")
    assert (config.min_nnodes, config.nnodes) == (2, 4)
    assert (LaunchConfig(nnodes="3:3", master_port=29500).min_nnodes,  # type: ignore[arg-type]
            LaunchConfig(nnodes=3, master_port=1).min_nnodes) == (3, 3)
    assert make_config({"nnodes": "2:4", "master_port": 29500}).min_nnodes == 2
