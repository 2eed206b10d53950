"""The launch configuration: one frozen dataclass, validated once.

Owns: every launch option, its default and its validation. Each violation
raises :class:`~mpddp.errors.ConfigError` naming the value, what is allowed
and the fix. Leaves to others: resolving values that need the machine
(GPU count, backend ``auto``) to launcher.py, reading SLURM to slurm.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import ConfigError

BACKENDS = ("auto", "nccl", "gloo")
START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_TIMEOUT = 180.0
_FREE_GPUS = re.compile(r"^free(:[1-9][0-9]*)?$")


def _check_int(name: str, value: object, low: int, high: int | None, fix: str) -> None:
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} is not allowed: it must be {allowed}; {fix}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name}={value} is out of range: it must be {allowed}; {fix}")


def parse_gpus(spec: str | Sequence[int] | None) -> tuple[int, ...] | str | None:
    """``"0,3"`` / ``[0, 3]`` -> ``(0, 3)``; ``"free"`` / ``"free:2"`` stay strings."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if _FREE_GPUS.match(text):
            return text
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(
                f"gpus={spec!r} is not a list of GPU ids: use ids such as '0,3', "
                "'free' or 'free:N'; see `mpddp info` for the GPUs here"
            )
        ids = tuple(int(p) for p in parts)
    else:
        ids = tuple(spec)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ConfigError(f"gpus={list(spec)!r} holds {i!r}: GPU ids are integers >= 0, e.g. gpus=[0, 3]")
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(
            f"gpus={','.join(map(str, ids))} names GPU {dupes[0]} twice: each local rank needs its own GPU; "
            "list each id once (NCCL refuses two ranks on one GPU)"
        )
    return ids


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one node's launcher needs to start its workers.

    ``nprocs=None`` means one worker per chosen (or visible) GPU, else 1.
    ``master_port=0`` lets the OS pick a free port (single node only).
    """

    nprocs: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "auto"
    start_method: str = "forkserver"
    timeout: float = DEFAULT_TIMEOUT
    gpus: tuple[int, ...] | str | None = None
    max_restarts: int = 0
    output_ranks: tuple[int, ...] | None = None  # None: every rank
    log_dir: str | None = None
    verbose: bool = False
    env: tuple[tuple[str, str], ...] = field(default=())  # extra worker variables

    def __post_init__(self) -> None:
        if self.nprocs is not None:
            _check_int("nprocs", self.nprocs, 1, None, "pass the number of workers for this node, e.g. --nprocs 2")
        _check_int("nnodes", self.nnodes, 1, None, "pass the number of machines, e.g. --nnodes 2")
        _check_int("node_rank", self.node_rank, 0, None, "number the nodes 0, 1, ... nnodes-1")
        if self.node_rank >= self.nnodes:
            raise ConfigError(
                f"node_rank={self.node_rank} with nnodes={self.nnodes}: node ranks run from 0 to "
                f"{self.nnodes - 1}; pass --node-rank {self.nnodes - 1} or raise --nnodes to {self.node_rank + 1}"
            )
        _check_int("master_port", self.master_port, 0, 65535, "pick a TCP port such as 29500 (0: let the OS choose)")
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError(
                "master_port=0 with nnodes>1: every node must know the port in advance; "
                "pass the same --master-port (e.g. 29500) to every node"
            )
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ConfigError(f"master_addr={self.master_addr!r} is empty: pass node 0's host name or IP address")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is unknown: use one of {', '.join(BACKENDS)}")
        if self.start_method not in START_METHODS:
            raise ConfigError(
                f"start_method={self.start_method!r} is unknown: use one of {', '.join(START_METHODS)} "
                "(forkserver is the default and the fast, CUDA-safe choice)"
            )
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"timeout={self.timeout!r} is not allowed: it must be a number of seconds > 0, e.g. 180")
        object.__setattr__(self, "timeout", float(self.timeout))
        object.__setattr__(self, "gpus", parse_gpus(self.gpus))
        _check_int("max_restarts", self.max_restarts, 0, None, "pass 0 (no restart) or more")
        if self.output_ranks is not None:
            ranks = tuple(self.output_ranks)
            if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
                raise ConfigError(f"output_ranks={self.output_ranks!r}: use 'all' or ranks >= 0 such as 0 or 0,1")
            object.__setattr__(self, "output_ranks", ranks)
        if self.log_dir is not None and os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise ConfigError(f"log_dir={self.log_dir!r} is a file: pass a directory (created if missing), e.g. logs")
        if isinstance(self.gpus, tuple) and self.nprocs is not None and self.nprocs > len(self.gpus):
            if self.backend != "gloo":
                raise ConfigError(
                    f"nprocs={self.nprocs} with gpus={','.join(map(str, self.gpus))}: NCCL needs one GPU per rank; "
                    f"pass --nprocs {len(self.gpus)}, list {self.nprocs} GPUs, or share GPUs with --backend gloo"
                )


def parse_output_ranks(spec: str | Sequence[int] | int | None) -> tuple[int, ...] | None:
    """``"all"``/None -> None (every rank); ``"0"``, ``"0,2"``, ``0`` -> a tuple."""
    if spec is None or spec == "all":
        return None
    if isinstance(spec, int):
        return (spec,)
    if isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(f"output_ranks={spec!r} is not 'all' or a list of ranks: use e.g. 0 or 0,1 or all")
        return tuple(int(p) for p in parts)
    return tuple(spec)
