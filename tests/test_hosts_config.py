"""--hosts and --hostfile: parsed and checked once, before anything starts (no ssh here)."""

from __future__ import annotations

import pytest

import mpddp
from mpddp.cli import main
from mpddp.cli.options import build_config


def test_hosts_give_the_layout():
    config = mpddp.LaunchConfig(hosts="gpu1, gpu2,gpu3", nprocs=4)
    assert (config.hosts, config.nnodes, config.node_rank, config.master_addr, config.master_port) == (
        ("gpu1", "gpu2", "gpu3"), 3, 0, "gpu1", 0)
    assert mpddp.LaunchConfig(hosts=["a", "b"], master_addr="10.0.0.1").master_addr == "10.0.0.1"


def test_a_hostfile_in_deepspeeds_format(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the lab\nworker-1 slots=4\nworker-2 slots=4   # the new one\n\n")
    config = mpddp.LaunchConfig(hostfile=str(path))
    assert (config.hosts, config.nprocs, config.nnodes, config.hostfile) == (("worker-1", "worker-2"), 4, 2, None)
    assert mpddp.LaunchConfig(hostfile=str(path), nprocs=2).nprocs == 2  # --nprocs wins over slots


@pytest.mark.parametrize("options, message", [
    ({"hosts": "a,a"}, "hosts lists a twice: one launcher per machine starts all its ranks; list each host once "
                       "and pass --nprocs for the ranks on each"),
    ({"hosts": ","}, "hosts=',' names no host: pass host names such as a,b"),
    ({"hosts": "a,b", "nnodes": 3}, "hosts names 2 machine(s): the node count and node ranks come from it; "
                                    "drop --nnodes and --node-rank"),
    ({"hosts": "a,b", "hostfile": "f"}, "hosts and hostfile both name the machines: pass only one of --hosts "
                                        "and --hostfile"),
    ({"hostfile": "/nonexistent/hosts"}, "hostfile='/nonexistent/hosts' cannot be read (No such file or "
                                         "directory): pass a file of host names, one a line"),
])
def test_bad_hosts_are_one_line(options, message):
    with pytest.raises(mpddp.ConfigError) as info:
        mpddp.LaunchConfig(**options)
    assert str(info.value) == message


def test_hostfile_lines_and_slots_are_checked(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=4\n")
    with pytest.raises(mpddp.ConfigError, match=r"gives different slots \(2, 4\): every node runs the same number"):
        mpddp.LaunchConfig(hostfile=str(path))
    path.write_text("a slots=2\nb cpus=4\n")
    with pytest.raises(mpddp.ConfigError, match=r"line 2: 'b cpus=4' is not 'host' or 'host slots=N'"):
        mpddp.LaunchConfig(hostfile=str(path))
    path.write_text("a slots=2\nb\n")
    with pytest.raises(mpddp.ConfigError, match="gives slots=N for some hosts only"):
        mpddp.LaunchConfig(hostfile=str(path))


def test_the_command_line_has_the_flags():
    for command in ("run", "train"):
        argv = ["--hosts", "a,b", "--ssh", "ssh -p 2222", *(["x.py"] if command == "run" else [])]
        params = main.commands[command].make_context(command, argv).params
        config = build_config(**params)
        assert (config.hosts, config.ssh, config.nnodes) == (("a", "b"), "ssh -p 2222", 2)


def test_a_host_that_does_not_answer_is_named_before_anything_starts(no_leftovers):
    # 127.0.0.2: loopback, where nothing listens on the port given to ssh
    with pytest.raises(mpddp.ConfigError) as info:
        mpddp.launch(lambda ctx: 1, hosts=["127.0.0.2"], ssh="ssh -p 9 -o StrictHostKeyChecking=no")
    assert str(info.value).startswith("host 127.0.0.2 refused or failed ssh (ssh: connect to host 127.0.0.2 port 9: "
                                      "Connection refused): mpddp uses BatchMode")


def test_the_hosts_wire_is_typed_both_ways():
    """The head's request and the nodes' answers are frozen dataclasses, decoded with a type check."""
    import io
    import pickle

    from mpddp.core.wire import protocol

    config = mpddp.LaunchConfig(hosts="a,b", nprocs=2)
    request = protocol.NodeRequest(config, 1, 29500, b"fn", True, ("torch",), {"MPDDP_X": "1"})
    assert protocol.read_request(io.BytesIO(protocol.encode_request(request))) == request
    mine = request.node_config(29500)
    assert (mine.hosts, mine.nnodes, mine.node_rank, mine.master_addr, mine.master_port) == (None, 2, 1, "a", 29500)
    assert protocol.read_request(io.BytesIO(protocol.encode_request(request)[:5])) is None  # closed early
    for message in (protocol.NodePort(29500), protocol.NodeResult([1, 2]),
                    protocol.NodeFailed(mpddp.ConfigError("bad"))):
        line = protocol.node_line(message)
        assert line.startswith(protocol.NODE_MARK) and line.endswith("\n") and line.count("\n") == 1
        back = protocol.read_node_line(line)
        assert type(back) is type(message)
    untyped = {"config": {}, "payload": b""}  # the old dict wire is refused, not half-read
    data = pickle.dumps(untyped)
    with pytest.raises(TypeError, match="not an mpddp node request: dict"):
        protocol.read_request(io.BytesIO(len(data).to_bytes(8, "big") + data))
    with pytest.raises(TypeError, match="not an mpddp node message: tuple"):
        protocol.read_node_line(protocol.NODE_MARK + __import__("base64").b64encode(pickle.dumps(("port", 1))).decode())
