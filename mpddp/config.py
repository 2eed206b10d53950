"""The launch configuration: one frozen dataclass, validated once.

Owns: every launch option, its default, its validation and its command-line
help (each field's ``metadata``: the CLI's shared launch options are made
from these fields, so the two cannot drift apart). Each violation raises
:class:`~mpddp.errors.ConfigError` naming the value, what is allowed and the
fix. Leaves to others: what this machine's limits allow before anything starts
(open files and processes for the local ranks, a log directory that can be
created) to limits.py, values that need the machine (GPU count, backend
``auto``) to core/launcher/plan.py, reading SLURM to machine/slurm.py, merging the two
to core/launcher/api.py.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import dashboard_options, rendezvous_options, shutdown_options
from .errors import ConfigError
from .hostfile import parse_hostfile
from .limits import check_dir_creatable, check_local_ranks, check_timeline

BACKENDS = ("auto", "nccl", "gloo")
START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_TIMEOUT = 180.0
_FREE_GPUS = re.compile(r"^free(:[1-9][0-9]*)?$")
MAX_TIMEOUT = 1e7  # seconds (115 days): beyond it timedelta and the C++ clocks overflow
MIN_TIMEOUT = 1.0  # seconds: a shorter window cannot tell a hang from a slow start


def check_int(name: str, value: object, low: int, high: int | None, fix: str, verdict: str = "is out of range") -> None:
    """Raise ConfigError unless ``value`` is an int in ``[low, high]``; ``fix`` starts with its own punctuation."""
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} is not allowed: it must be {allowed}{fix}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name}={value} {verdict}: it must be {allowed}{fix}")


def _cli(help: str, kind: Any = str, *decls: str, **more: Any) -> dict[str, Any]:
    """A field's command-line option: its help, its click type (or "flag"), extra spellings; ``bare``: its value
    when given alone, ``check``: the form of its word, checked as the line is read, ``metavar`` (cli/options.py)."""
    return {"cli": {"help": help, "type": kind, "decls": decls, **more}}


def parse_nprocs(spec: str | int | None) -> int | None:
    """``--nprocs``: a number, or torchrun's words: ``gpu`` and ``auto`` are mpddp's default (None: one
    per GPU, else 1), ``cpu`` is one per CPU this process may run on, as torchrun counts them."""
    if spec is None or isinstance(spec, int):
        return spec
    text = spec.strip().lower()
    if text in ("gpu", "auto"):
        return None
    if text == "cpu":
        return len(os.sched_getaffinity(0))
    try:
        return int(text)  # LaunchConfig says what is out of range
    except ValueError:
        pass
    raise ConfigError(f"nprocs={spec!r} is not a number of workers: pass an integer such as 2, or gpu or auto "
                      "(one per CUDA GPU, else 1) or cpu (one per CPU); mpddp drives CUDA GPUs and CPUs only.")


def parse_nnodes(spec: str | int) -> int | str:
    """``--nnodes``: a number, torchrun's ``N:N`` (a fixed size written as a range), or ``MIN:MAX`` (elastic,
    kept as written: LaunchConfig splits it)."""
    if isinstance(spec, int):
        return spec
    low, colon, high = spec.strip().partition(":")
    if not colon or high == low or (low.isdigit() and high.isdigit() and int(high) == int(low)):
        try:
            return int(low)  # LaunchConfig says what is out of range
        except ValueError:
            pass
    if low.isdigit() and high.isdigit():
        return f"{int(low)}:{int(high)}"
    raise ConfigError(f"nnodes={spec!r} is not a number of machines: pass an integer such as 2, or MIN:MAX such as "
                      "2:4 for an elastic job.")


# their forms in every command's help (click would show a type function's name)
NPROCS_METAVAR, NNODES_METAVAR = "N|gpu|cpu|auto", "N|MIN:MAX"


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
    ``node_rank=None`` on several nodes: numbered as it joins (torchrun's c10d without ``--node-rank``):
    node 0 where the store can be hosted, the others in the order they come (:attr:`node`).
    """

    # The extra spellings are torchrun's (docs/torchrun.rst)
    nprocs: int | None = field(default=None, metadata=_cli(
        "Workers on this node: N, or gpu/auto (one per GPU, else 1), cpu (one per CPU) [default: one per GPU, "
        "else 1].", parse_nprocs, "--nproc-per-node", "--nproc_per_node", metavar=NPROCS_METAVAR))
    nnodes: int = field(default=1, metadata=_cli(  # MAX of an elastic job (min_nnodes: MIN)
        "Number of machines: N, or MIN:MAX (elastic: the job runs on MIN to MAX of them) [default: 1, or "
        "SLURM's].",
        parse_nnodes, metavar=NNODES_METAVAR))
    node_rank: int | None = field(default=None, metadata=_cli(  # None: numbered on joining (see `node`)
        "This machine's index, 0..nnodes-1 [default: numbered as it joins: 0 where --master-addr (c10d's "
        "--rdzv-endpoint) is, then 1, 2, ...].", int, "--node_rank"))
    master_addr: str = field(default="127.0.0.1", metadata=_cli(
        "Node 0's address [default: 127.0.0.1].", str, "--master_addr"))
    master_port: int = field(default=0, metadata=_cli(
        "Node 0's port [default: a free one on one node].", int, "--master_port"))
    rdzv_backend: str = field(default="c10d", metadata=_cli(
        "c10d (node 0 hosts the store), static (c10d, a fixed size) or etcd (an etcd cluster: any node's loss "
        "is survived) [default: c10d].",
        str, "--rdzv_backend"))
    rdzv_endpoint: str | None = field(default=None, metadata=_cli(
        "c10d: node 0's HOST[:PORT], as --master-addr/--master-port; etcd: its members, host:port,...",
        str, "--rdzv_endpoint"))
    rdzv_id: str | None = field(default=None, metadata=_cli(
        "The job's id, the same on every node (etcd: its keys' prefix) [default: a new one on one node].",
        str, "--rdzv_id", "--run-id", "--run_id"))
    rdzv_conf: str | None = field(default=None, metadata=_cli(
        "key=value,...: last_call_timeout, ttl (etcd's lease), cacert, cert, key.", str, "--rdzv_conf"))
    local_addr: str | None = field(default=None, metadata=_cli(
        "This node's address for the others (etcd: where a round's store listens) [default: its interface].",
        str, "--local_addr"))
    min_nnodes: int = field(default=0, metadata={"doc": "MIN of ``nnodes='MIN:MAX'`` (0: nnodes, a fixed size)."})
    backend: str = field(default="auto", metadata=_cli("auto (nccl on GPUs, else gloo), nccl or gloo [default: auto]."))
    start_method: str = field(default="forkserver", metadata=_cli(
        "forkserver, spawn or fork [default: forkserver].", str, "--start_method"))
    timeout: float = field(default=DEFAULT_TIMEOUT, metadata=_cli(
        f"Seconds with no rank making progress before the job is declared hung; also how long "
        f"nodes wait to meet [default: {DEFAULT_TIMEOUT:g}].", float))
    gpus: tuple[int, ...] | str | None = field(default=None, metadata=_cli(
        "GPU ids such as 0,3, or free / free:N [default: all visible]."))
    max_restarts: int = field(default=0, metadata=_cli(
        "Restart the group after a failure [default: 0].", int, "--max_restarts"))
    shutdown_timeout: float | None = field(default=None, metadata=_cli(  # None: the environment's, else 30
        "Seconds the ranks get to exit after the launcher is told to stop (SIGTERM, Ctrl-C, ...), then SIGKILL "
        "[default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30].", float, "--shutdown_timeout"))
    signals_to_handle: tuple[str, ...] | str = field(default=shutdown_options.DEFAULT_SIGNALS, metadata=_cli(
        "Signals that stop the job and are passed on to the ranks, e.g. SIGTERM,SIGINT,SIGUSR1 (SLURM's) [default: "
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT].", str, "--signals_to_handle"))
    virtual_local_rank: bool = field(default=False, metadata=_cli(
        "Each rank sees only its own GPU, as cuda:0 (CUDA_VISIBLE_DEVICES), with LOCAL_RANK 0.", "flag",
        "--virtual_local_rank"))
    numa_binding: str | None = field(default=None, metadata=_cli(
        "Bind each rank to the CPUs near its GPU, by torch's NUMA binding: node, socket, exclusive or "
        "core-complex [default: no binding].", str, "--numa_binding"))
    output_ranks: tuple[int, ...] | None = field(default=None, metadata=_cli(  # None: every rank; "0,1" parsed
        "Ranks whose stdout is shown (0, 0,1, all) [default: all]."))
    log_dir: str | None = field(default=None, metadata=_cli(
        "Also write one log file per rank.", "directory", "--log_dir"))
    verbose: bool = field(default=False, metadata=_cli("A banner per worker; every rank's progress.", "flag", "-v"))
    no_prefix: bool = field(default=False, metadata=_cli(
        "Print the workers' lines as they wrote them, without the [rank N] prefix (still whole lines, "
        "never two ranks' glued), e.g. for a pipeline.", "flag"))
    hosts: tuple[str, ...] | None = field(default=None, metadata=_cli(
        "Machines to start one launcher on each, over ssh, e.g. a,b: node rank by position, master on the "
        "first [default: this machine only]."))
    hostfile: str | None = field(default=None, metadata=_cli(
        "A file of hosts, one a line, optional slots=N (DeepSpeed's format), instead of --hosts."))
    ssh: str = field(default="ssh", metadata=_cli(
        "The ssh command for --hosts, with its options, e.g. 'ssh -F ~/.ssh/cluster' [default: ssh]."))
    timeline: str | None = field(default=None, metadata=_cli(
        "Draw every rank's arrival lag at each collective over time into this picture (.png, .svg or .pdf), "
        "to see a straggler and when it started; needs matplotlib (pip install 'mpddp[plot]')."))
    dashboard: str | None = field(default=None, metadata=_cli(  # launch(dashboard=True / 8265 / "HOST:PORT") too
        "Serve a live web page of the job: auto (127.0.0.1, a free port; also --dashboard alone), PORT or "
        "HOST:PORT; the URL is printed at the start; read-only.", str,
        bare=dashboard_options.BARE, check=dashboard_options.command_line_form, metavar="[auto|PORT|HOST:PORT]"))
    dashboard_remote: bool = field(default=False, metadata=_cli(
        "Let --dashboard listen on an address other machines reach; its URL then carries a random token.", "flag"))
    env: tuple[tuple[str, str], ...] = field(default=(), metadata={"doc": (  # no flag: `mpddp run` fills it
        "Extra environment variables for every worker, as (name, value) pairs, set over mpddp's own; no "
        "command-line option (``mpddp run`` passes torchrun's variables through it).")})

    def __post_init__(self) -> None:
        if self.hosts is not None or self.hostfile is not None:
            self._take_hosts()
        if isinstance(self.nnodes, str):  # MIN:MAX (launch(nnodes="2:4") too)
            size = parse_nnodes(self.nnodes)
            low, high = rendezvous_options.parse_nnodes_range(size) if isinstance(size, str) else (size, size)
            rendezvous_options.check_size(low, high)  # here: a MIN of 0 must not read as "MIN is MAX" below
            object.__setattr__(self, "nnodes", high)
            object.__setattr__(self, "min_nnodes", low)
        if self.nprocs is not None:
            check_int("nprocs", self.nprocs, 1, None, "; pass the number of workers for this node, e.g. --nprocs 2")
            check_local_ranks(self.nprocs)
        check_int("nnodes", self.nnodes, 1, None, "; pass the number of machines, e.g. --nnodes 2")
        object.__setattr__(self, "min_nnodes", self.min_nnodes or self.nnodes)
        rendezvous_options.check(self)
        self._take_endpoint()
        self._check_node_rank()
        check_int("master_port", self.master_port, 0, 65535, "; pick a TCP port such as 29500 (0: let the OS choose)")
        if self.nnodes > 1 and self.master_port == 0 and self.hosts is None and \
                rendezvous_options.node_0_hosts_store(self.rdzv_backend):
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
        if not (math.isfinite(self.timeout) and MIN_TIMEOUT <= self.timeout <= MAX_TIMEOUT):
            raise ConfigError(f"timeout={self.timeout!r} is out of range: it must be from {MIN_TIMEOUT:g} to "
                              f"{MAX_TIMEOUT:g} seconds, e.g. 180 (or 86400 for a day)")
        object.__setattr__(self, "timeout", float(self.timeout))
        object.__setattr__(self, "gpus", parse_gpus(self.gpus))
        check_int("max_restarts", self.max_restarts, 0, None, "; pass 0 (no restart) or more")
        object.__setattr__(self, "shutdown_timeout", shutdown_options.grace(self.shutdown_timeout))
        object.__setattr__(self, "signals_to_handle", shutdown_options.parse_signals(self.signals_to_handle))
        object.__setattr__(self, "numa_binding", shutdown_options.parse_numa(self.numa_binding))
        object.__setattr__(self, "output_ranks", parse_output_ranks(self.output_ranks))
        if self.output_ranks is not None:
            ranks = tuple(self.output_ranks)
            if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
                raise ConfigError(f"output_ranks={self.output_ranks!r}: use 'all' or ranks >= 0 such as 0 or 0,1")
            object.__setattr__(self, "output_ranks", ranks)
            self._check_output_ranks(ranks)
        if self.log_dir:  # "" as None: no log files
            check_dir_creatable("log_dir", self.log_dir, "logs")
        if self.timeline is not None:
            check_timeline(self.timeline)
        object.__setattr__(self, "dashboard", dashboard_options.parse(self.dashboard, self.dashboard_remote))
        # backend 'auto' is told by core/launcher/plan.py, which knows first whether there is any GPU at all
        if isinstance(self.gpus, tuple) and self.nprocs is not None and self.nprocs > len(self.gpus):
            if self.backend == "nccl":
                raise ConfigError(
                    f"nprocs={self.nprocs} with gpus={','.join(map(str, self.gpus))}: NCCL needs one GPU per rank; "
                    f"pass --nprocs {len(self.gpus)}, list {self.nprocs} GPUs, or share GPUs with --backend gloo"
                )

    @property
    def node(self) -> int:
        """This node's rank, once known. ``node_rank=None`` is numbered as it joins the job: node 0 on the
        machine that hosts the store (core/launcher/api.py decides it before anything starts), else by its
        backend's join of the first round (core/nodes/), which sets it in the round's config."""
        if self.node_rank is None:
            raise RuntimeError("this node's rank is read before it joined the job's first round")
        return self.node_rank

    def _take_endpoint(self) -> None:
        """c10d's (static's) --rdzv-endpoint as master_addr and master_port; static is c10d of a fixed size."""
        given = {"rdzv_endpoint": self.rdzv_endpoint, "rdzv_backend": self.rdzv_backend,
                 "master_addr": None if self.master_addr == "127.0.0.1" else self.master_addr,  # the defaults: unset
                 "master_port": self.master_port or None}
        for name, value in rendezvous_options.endpoint_as_master(given).items():
            if value is not None or name == "rdzv_endpoint":
                object.__setattr__(self, name, value)
        if self.rdzv_backend == "static":  # checked as static (a fixed size) in rendezvous_options.check
            object.__setattr__(self, "rdzv_backend", "c10d")

    def _check_node_rank(self) -> None:
        """A node rank in 0..MAX-1 on every backend; None (numbered on joining) is 0 on a single node."""
        if self.node_rank is None:
            if self.nnodes == 1:
                object.__setattr__(self, "node_rank", 0)
            return
        check_int("node_rank", self.node_rank, 0, None, "; number the nodes 0, 1, ... nnodes-1, or drop --node-rank "
                  "(each node is numbered as it joins)")
        if self.node_rank < self.nnodes:
            return
        if self.min_nnodes == self.nnodes:
            raise ConfigError(
                f"node_rank={self.node_rank} with nnodes={self.nnodes}: node ranks run from 0 to "
                f"{self.nnodes - 1}; pass --node-rank {self.nnodes - 1} or raise --nnodes to {self.node_rank + 1}, "
                "or drop --node-rank (each node is numbered as it joins)")
        raise ConfigError(
            f"node_rank={self.node_rank} with nnodes={self.min_nnodes}:{self.nnodes}: node ranks run from 0 to "
            f"{self.nnodes - 1} (MAX - 1); pass --node-rank {self.nnodes - 1} or less, raise MAX to --nnodes "
            f"{self.min_nnodes}:{self.node_rank + 1}, or drop --node-rank (each node is numbered as it joins)")

    def _check_output_ranks(self, ranks: tuple[int, ...]) -> None:
        # without nprocs the world's size is known only once core/launcher/plan.py has counted the GPUs
        world = None if self.nprocs is None else self.nnodes * self.nprocs
        if world is not None and max(ranks) >= world:
            raise ConfigError(f"output_ranks={','.join(map(str, ranks))} names rank {max(ranks)}, but the world has "
                              f"{world} rank{'s' if world > 1 else ''} (nnodes={self.nnodes} × nprocs={self.nprocs}): "
                              f"pass ranks from 0 to {world - 1}, or all")

    def _take_hosts(self) -> None:
        """``hosts``/``hostfile`` -> nnodes, master address and (from slots) nprocs; node 0 is this launch."""
        if self.hosts is not None and self.hostfile is not None:
            raise ConfigError("hosts and hostfile both name the machines: pass only one of --hosts and --hostfile")
        slots = None
        if self.hostfile is not None:
            hosts, slots = parse_hostfile(self.hostfile)
        elif isinstance(self.hosts, str):
            hosts = tuple(h.strip() for h in self.hosts.split(",") if h.strip())
        else:
            hosts = tuple(self.hosts or ())
        if not hosts or not all(isinstance(h, str) and h and not h.startswith("-") for h in hosts):
            raise ConfigError(f"hosts={self.hosts or self.hostfile!r} names no host: pass host names such as a,b")
        twice = sorted({h for h in hosts if hosts.count(h) > 1})
        if twice:
            raise ConfigError(f"hosts lists {twice[0]} twice: one launcher per machine starts all its ranks; "
                              "list each host once and pass --nprocs for the ranks on each")
        if slots and self.nprocs is None and len(set(slots)) > 1:
            raise ConfigError(f"hostfile={self.hostfile!r} gives different slots ({', '.join(map(str, slots))}): every "
                              "node runs the same number of ranks; make them equal or pass --nprocs N")
        if self.nnodes not in (1, len(hosts)) or self.node_rank not in (None, 0):
            raise ConfigError(f"hosts names {len(hosts)} machine(s): the node count and node ranks come from it; "
                              "drop --nnodes and --node-rank")
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "hostfile", None)
        object.__setattr__(self, "nnodes", len(hosts))
        object.__setattr__(self, "node_rank", 0)  # this launch: the others are numbered by their place in hosts
        if self.master_addr == "127.0.0.1":
            object.__setattr__(self, "master_addr", hosts[0])
        if slots and self.nprocs is None:
            object.__setattr__(self, "nprocs", slots[0])

    def rdzv_settings(self) -> rendezvous_options.RdzvSettings:
        """What --rdzv-conf says, with the defaults for the rest."""
        return rendezvous_options.parse_rdzv_conf(self.rdzv_conf)


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
