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
    ({"max_restarts": -1}, r"max_restarts=-1 is out of range"),
    ({"gpus": "0,x"}, r"gpus='0,x' is not a list of GPU ids"),
    ({"gpus": "0,1,0"}, r"gpus=0,1,0 names GPU 0 twice"),
    ({"gpus": [0, -2]}, r"gpus=\[0, -2\] holds -2: GPU ids are integers >= 0"),
    ({"gpus": (0, 1), "nprocs": 3}, r"nprocs=3 with gpus=0,1: NCCL needs one GPU per rank"),
    ({"output_ranks": (-1,)}, r"output_ranks=\(-1,\): use 'all' or ranks >= 0"),
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
