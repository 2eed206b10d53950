"""What crosses between a worker and its launcher: typed messages and store keys.

Owns: what the launcher sends each worker (:class:`WorkerSpec`), the messages a worker sends up its channel
(:class:`Started`, :class:`Joined`, :class:`Left`, :class:`Result`, :class:`Failure`, and from its reader thread
:class:`Collectives`; each pickled whole) and their encoding, every key mpddp writes in node 0's store (per attempt,
that is per round: who arrived, who finished init, which launchers joined, each node's heartbeat, the round's first
failure as a :class:`FailureRecord`), and the messages between the head of a ``--hosts`` launch and each node's
launcher (:class:`NodeRequest` down, :class:`NodePort`, :class:`NodeResult`, :class:`NodeFailed` up). A failure's
kind is an :class:`~mpddp.errors.Outcome` set in the worker, from the exception's type and the frame it was raised
in, never recovered from its message.
"""

from __future__ import annotations

import base64
import json
import pickle
import struct
from dataclasses import asdict, dataclass, replace
from typing import Any

from ...config import LaunchConfig
from ...context import WorkerContext
from ...errors import MpddpError, Outcome


@dataclass(frozen=True)
class RollCall:
    """What each rank of a job of several nodes checks in its round's store before it joins the group: that its
    launcher runs the job of the round's node 0, that no other launcher holds its node rank, and that every node
    was started with the same shape."""

    launcher: str  # this node's launcher: host, pid and a random tail
    node_rank: int
    nnodes: int
    nprocs: int
    runs: str = ""  # the job's script or function (core/wire/fingerprint.py); "": not compared


@dataclass(frozen=True)
class Refused:
    """The rank did not join the group: ``line`` says why (bad input, exit code 2). ``shared``: the other nodes
    must hear it too (the nodes disagree on the shape); a second launcher with a taken node rank is not the
    job's, and leaves it as it was."""

    line: str
    shared: bool


@dataclass(frozen=True)
class WorkerSpec:
    """Plain data the launcher sends to one worker (pickled at start)."""

    ctx: WorkerContext
    store_addr: str
    store_port: int
    store_prefix: str
    # for reaching node 0's store; collectives keep torch's default (core/launcher/watchdog.py finds hangs)
    timeout: float
    env: dict[str, str]
    threads: int | None
    payload: bytes  # cloudpickle of (fn, args, kwargs, notebook cells' linecache entries)
    close_fds: tuple[int, ...] = ()  # parent fds a forked child inherited
    banner: str | None = None
    init_group: bool = True
    roll: RollCall | None = None  # several nodes: checked before the group is made (or the script runs)
    parent: int | None = None  # the pid that forks it (the forkserver, else the launcher): core/rank/boot.py
    numa_binding: str | None = None  # torch's NUMA binding mode for its GPU (--numa-binding); GPU ranks only


@dataclass(frozen=True)
class Started:
    """The worker runs (its session and pipes are set up) and is about to call ``fn``."""

    pid: int
    main_thread: int  # its ident, to find the main thread in a stack dump (core/wire/stacks.py)


@dataclass(frozen=True)
class Joined:
    """The worker got through node 0's store (the roll call, or ``init_process_group``): it was up, it answered."""


@dataclass(frozen=True)
class Left:
    """The rank destroyed its default process group (fn's own ``destroy_process_group``): it left the world."""

    where: str  # "destroy_process_group at train.py:12"
    time: float  # CLOCK_MONOTONIC


@dataclass(frozen=True)
class Result:
    """``fn``'s return value, pickled apart (cloudpickle) so that the launcher can say which rank's
    value it could not load, instead of failing on the whole message."""

    payload: bytes
    time: float = 0.0  # CLOCK_MONOTONIC when fn returned: an early exit is told by comparing it with failures'


@dataclass(frozen=True)
class Failure:
    """The worker's own report of how it failed."""

    rank: int
    kind: Outcome  # RAISED, EXITED or COLLECTIVE
    error_type: str  # "ValueError", "torch.distributed.DistBackendError", ...
    message: str
    traceback: str
    time: float  # CLOCK_MONOTONIC, machine-wide on Linux: the launcher orders reports by it
    exit_code: int | None = None  # sys.exit's code (kind EXITED)
    where: str | None = None  # for COLLECTIVE: the torch.distributed call, e.g. "all_reduce at train.py:12"
    then: str | None = None  # raised while the error above was being handled: "RuntimeError: unexpected pos ..."
    hint: str | None = None  # mpddp's one line on a known mistake, decided by structure (the frame it came from)
    pickled: bytes | None = None  # the exception itself (cloudpickle), for WorkerFailed.exception; None if it cannot


Lane = tuple[str, str, int]  # what a collective's number counts in: (group name, backend, generation)


@dataclass(frozen=True)
class Call:
    """One collective a rank entered, as torch's flight recorder wrote it down (core/rank/recorder.py)."""

    group: str  # the process group's name: "0" is the default group; the same on every member
    seq: int  # the collective's number in that group: the same collective has the same number on every rank
    op: str  # "all_reduce", "broadcast", ... (the backend's prefix dropped)
    sizes: tuple[tuple[int, ...], ...]  # its input tensors' shapes
    dtypes: tuple[str, ...]  # "Float", "BFloat16", ... (torch's ScalarType names)
    entered: int  # when the rank entered it: the wall clock in ns (time_created_ns)
    backend: str = ""  # "gloo", "nccl": a group with both numbers each backend's collectives apart
    generation: int = 0  # the group's name set up again (destroyed, then made anew): numbers start again
    op_id: int = 0  # its number among all the group's ops, point-to-point ones too: what completion counts in

    @property
    def lane(self) -> Lane:
        """What its number counts in: one process group's collectives on one backend, in one generation."""
        return self.group, self.backend, self.generation


@dataclass(frozen=True)
class Collectives:
    """A rank's flight recorder, read again by its reader thread: sent only when something changed."""

    calls: tuple[Call, ...]  # the collectives it entered since its last report, oldest first
    completed: tuple[tuple[Lane, int], ...]  # per lane, the op_id of the last op that completed here


Message = Started | Joined | Left | Result | Failure | Collectives | Refused

MAIN_GUARD_EXIT = 97  # a worker's exit code: it re-ran the user's script and met launch() again


def encode(message: Message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    message = pickle.loads(data)
    if not isinstance(message, (Started, Joined, Left, Result, Failure, Collectives, Refused)):
        raise TypeError(f"not an mpddp message: {type(message).__name__}")
    return message


# ---- store keys ------------------------------------------------------------------------------
# One store serves the whole job (node 0's store server lives from the first attempt to the last). Each
# attempt is a round that every node joins; its keys live under the attempt's prefix, so a restart
# never reads an older round's keys. Workers see the store through a PrefixStore of their attempt;
# the launchers use the full names.


def attempt_prefix(attempt: int) -> str:
    return f"mpddp/attempt_{attempt}"


def claim_key(node: int) -> str:
    """Set once, by the first rank of launcher that came to the round as node ``node`` (its RollCall)."""
    return f"claim/{node}"


RUNS = "runs"  # set once, by the ranks of the round's node 0: its job (RollCall.runs), which every node's must be
# set once, by the first rank to come: the --nnodes and --nprocs of its node, which every node's must be
SHAPE = "shape"


ARRIVED = "arrived"  # a counter: the ranks that reached the round's store, numbering their arrived_entry
BEATING = "beating"  # a counter: the nodes that beat in the round (c10d): node 0 reads the beats once all did


def arrived_entry(number: int) -> str:
    """The ``number``-th rank to reach the round's store (ARRIVED numbers them): its rank (node 0 names the ranks
    that never did, from as many entries as came: one operation for --nnodes 100000 as for 2)."""
    return f"arrived/entry/{number}"


INITIALIZED = "initialized"  # a counter: ranks through init_process_group
ALL_INITIALIZED = "all_initialized"  # set by the last of them
JOINED = "joined"  # a counter: the node launchers that joined this round (core/nodes/c10d.py)
FAILURE = "failure"  # the round's first failure, a FailureRecord: the first node to write it wins
PROGRESS = "progress"  # a counter every node's watchdog bumps while its ranks compute (core/launcher/watchdog.py)
# the round's own store for env:// scripts, from the second round on (core/nodes/c10d.py, round_store)
SCRIPT_PORT = "script_port"
STATE = "state"  # a node's record in the round, ``state/<node>``: its core/nodes/rules.py NodeState, by compare-and-set
# The counters a node's moves enter it in (core/nodes/rules.py's COUNTERS), each once: ``<counter>/<node>`` flags
# it, and ``<counter>#<n>`` is the n-th node counted, ``[node, wall time]``, so that a store lists them in two reads.
WAITING = "waiting"  # the nodes that wait for the round's record (their ranks only saw a peer vanish)
RETURNED = "returned"  # the nodes whose ranks all returned
QUIET = "quiet"  # the nodes that wait for the record, returned, ended or were found lost
DONE = "done"  # the nodes whose ranks returned, or that ended the round or were found lost
ALL_JOINED = "all_joined"  # set by the last node launcher to join a restarted round: the others wait for it
FAILED = 1 << 40  # added to PROGRESS by the writer of the round's record: every beat's one add also tells of it
LEFT = "mpddp/job/left"  # a counter, job-wide: the launchers that are done with the store (node 0 waits for them)
LOST = "lost"  # a counter: the nodes found lost in the round (node 0 does not wait for them to leave)
READ = "read"  # a counter: the launchers that read the round's record another node wrote (each once)
WATCHED = 1 << 44  # added to PROGRESS by a node while it is watched (``mpddp top``), taken back after: every beat's
# one add also tells whether any node is watched (above FAILED, which a round's few writers add once each)


def joined_key(node: int) -> str:
    """Set by a node's launcher when it joined the round (the barrier names the nodes without it)."""
    return f"joined/{node}"


def heartbeat_key(node: int) -> str:
    """One node launcher's heartbeat counter."""
    return f"heartbeat/{node}"


SHARERS = "sharers"  # a counter: the nodes that shared their ranks' collectives, numbering their sharer_entry


def sharer_entry(number: int) -> str:
    """The ``number``-th node to share its ranks' collectives (SHARERS numbers them): its node rank."""
    return f"sharers/entry/{number}"


def calls_key(node: int) -> str:
    """A node's ranks' last collectives (core/launcher/board.py's snapshot): any node's hang report sees them all."""
    return f"calls/{node}"


def full_key(attempt: int, key: str) -> str:
    """``key`` as seen without the attempt's PrefixStore."""
    return f"{attempt_prefix(attempt)}/{key}"


ERROR_LINE = "mpddp: error: "  # how mpddp/cli starts the line of an error it exits with; so does a record of one


@dataclass(frozen=True)
class FailureRecord:
    """A round's first failure, as the node where it happened tells every other node (through the store).

    ``line`` is the first line of that node's report, so every node's report starts with the same words;
    ``exit_code`` is the failing rank's, so every node exits with it.
    """

    rank: int
    node_rank: int
    local_rank: int
    outcome: Outcome
    exit_code: int
    line: str
    wall_time: float  # time.time() on the node that wrote it
    writer: int = -1  # the node that wrote it (NodeLink.publish): one node may name another's rank

    def encode(self) -> bytes:
        return json.dumps({**asdict(self), "outcome": self.outcome.value}).encode()

    @classmethod
    def decode(cls, data: bytes) -> FailureRecord:
        fields = json.loads(data)
        return cls(**{**fields, "outcome": Outcome(fields["outcome"])})


# ---- between the head of a --hosts launch and each node's launcher ----
# (core/launcher/hosts_head.py, core/launcher/hosts_node.py)
# The head writes one NodeRequest on the node's stdin (length, then a pickle); the node answers on stdout
# with lines that start with NODE_MARK (a NodeMessage, pickled, base64), between its ranks' lines. Both
# ends decode with a type check, as the rank wire does.

NODE_MARK = "\x1empddp-node "  # an ASCII record separator, then a word: no rank's line starts so
_LENGTH = struct.Struct("!Q")


@dataclass(frozen=True)
class NodeRequest:
    """What the head sends one node's launcher: the job, and this node's whole config."""

    config: LaunchConfig  # the head's: see :meth:`node_config`
    node_rank: int
    master_port: int  # node 0's, or 0 for node 0 itself: it binds a free one and tells it (NodePort)
    payload: bytes  # cloudpickle of (fn, args, kwargs, notebook cells' linecache entries), as for a rank
    init_process_group: bool
    preload: tuple[str, ...]
    environ: dict[str, str]  # the head's MPDDP_* variables
    runs: str = ""  # the job's script or function, as its fingerprint says it (core/wire/fingerprint.py)

    def node_config(self, master_port: int) -> LaunchConfig:
        """This node's config: the head's, without its hosts (a node starts no ssh), at its rank and port."""
        return replace(self.config, hosts=None, hostfile=None, node_rank=self.node_rank, master_port=master_port)


@dataclass(frozen=True)
class NodePort:
    """Node 0 holds the rendezvous port: the other nodes are started with it."""

    port: int


@dataclass(frozen=True)
class NodeResult:
    """Every value of this node's ranks, in local rank order."""

    values: list[Any]


@dataclass(frozen=True)
class NodeFailed:
    """This node's report of the job's failure (an :class:`~mpddp.errors.MpddpError`: they pickle)."""

    error: MpddpError


@dataclass(frozen=True)
class NodeEnded:
    """Not on the wire: the head's own note that a node's launcher exited (its ssh session ended)."""

    exit_code: int


NodeMessage = NodePort | NodeResult | NodeFailed


def encode_request(request: NodeRequest) -> bytes:
    data = pickle.dumps(request)
    return _LENGTH.pack(len(data)) + data


def read_request(stream: Any) -> NodeRequest | None:
    """The head's request from ``stream``; None if it closed first."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    request = pickle.loads(data)
    if not isinstance(request, NodeRequest):
        raise TypeError(f"not an mpddp node request: {type(request).__name__}")
    return request


def node_line(message: NodeMessage) -> str:
    """A node's message as one line on its stdout."""
    return f"{NODE_MARK}{base64.b64encode(pickle.dumps(message)).decode('ascii')}\n"


def read_node_line(line: str) -> NodeMessage:
    message = pickle.loads(base64.b64decode(line[len(NODE_MARK):]))
    if not isinstance(message, (NodePort, NodeResult, NodeFailed)):
        raise TypeError(f"not an mpddp node message: {type(message).__name__}")
    return message
