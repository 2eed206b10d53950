"""What every attempt of one job shares, and the store servers this launcher hosts for it.

Owns: :class:`Job`, built once by core/launcher/job.py (the config, the plan, the start method's context,
``fn`` shipped by value, the rendezvous, the store servers) and read by each attempt (core/launcher/attempt.py,
core/launcher/channels.py); node 0's last word, a store server opened on the job's port and closed (what it holds
is the rendezvous backend's: :meth:`~mpddp.core.nodes.api.Rendezvous.say_last_word`);
and how a store server is started and stopped, counted among this process's live children. Leaves the rounds
and the restart loop to core/launcher/job.py, the store server itself to core/stores/store_server.py.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ...config import LaunchConfig
from ...errors import AddressError, ForkserverLost, Outcome
from ..nodes.api import Rendezvous, RoundStore
from ..stores import store_server
from ..stores.listen import listen
from ..stores.store_server import StoreServer
from ..wire import protocol
from ..wire.protocol import FailureRecord
from . import stragglers
from .live import LiveView
from .plan import Plan
from .stop import LIVE, LIVE_LOCK


@dataclass
class Job:
    """What every attempt of one launch shares, built once."""

    plan: Plan
    mp_context: Any
    payload: bytes  # cloudpickle of (fn, args, kwargs, notebook cells' lines)
    init_group: bool  # False: fn (or the script) calls init_process_group itself
    port: int  # the round's store: node 0's, for the whole job, or the round's own
    # The pid of the forkserver the launch started (None under spawn and fork): every process of the job comes from
    # it, and one lost is named as such, not as the loss of its store server (core/procs/start.py)
    forkserver: int | None = None
    store: StoreServer | None = None  # the store server this node hosts (node 0's, or the round's first node's)
    # A script that calls init_process_group("env://") itself (init_group False) uses MASTER_PORT's store with no
    # prefix of its own: from the second round on it gets a fresh store of the round's (core/launcher/job.py).
    script_port: int | None = None
    script_store: StoreServer | None = None  # node 0 only
    link: Rendezvous | None = None  # several nodes only: what the nodes agree on (core/nodes/api.py)
    round_store: RoundStore | None = None  # several nodes: where the round's store listens, as the link placed it
    lags: stragglers.Stragglers = field(default_factory=stragglers.Stragglers)  # this node's ranks' arrivals
    # node 0 of several: each node's last arrival at every collective lined up (stragglers.AcrossNodes), the whole
    # job's straggler; empty on the other nodes and on one node
    across: stragglers.Stragglers = field(default_factory=stragglers.Stragglers)
    intruder: bool = False  # another launcher holds this node rank: the job's keys are not this one's to touch
    last_store: StoreServer | None = None  # node 0 of several, its store server lost: the store of why, for the others
    # The job's restarts after a failure so far: --max-restarts' count and TORCHELASTIC_RESTART_COUNT. A round that
    # admits a node is none (torchrun's agent counts no membership change); the same number on every node.
    restarts: int = 0
    live: LiveView | None = None  # what a watcher sees (mpddp top, core/launcher/live.py), set by run_job
    runs: str = ""  # the job's script or function, as every launcher of it must run it (core/wire/fingerprint.py)

    def open_last_word(self, attempt: int, loss: str) -> None:
        """Node 0 of several, whose store serves every round, its store server just lost (``loss`` says how): a
        fresh one on the same port, before the teardown, with the loss as round ``attempt``'s record
        (the backend's :meth:`~mpddp.core.nodes.api.Rendezvous.say_last_word`). The other nodes tell it as this one
        does, not "node 0 is gone";
        :meth:`close_last_word` ends it."""
        if self.link is None or self.store is None or not self.one_store or self.last_store is not None:
            return
        try:
            self.last_store = start_store(self, listen(self.config.master_addr, self.port))
        except (OSError, RuntimeError, AddressError, ForkserverLost):  # the port taken, the forkserver gone:
            return  # they say node 0 went
        line = f"{protocol.ERROR_LINE}{loss}"
        self.link.say_last_word(attempt, FailureRecord(0, 0, 0, Outcome.STORE_LOST, 1, line, time.time(), writer=0))

    def close_last_word(self, wait: bool) -> None:
        """Stop node 0's last word, once the other launchers have read it (``wait``: a few seconds at most)."""
        if self.last_store is None:
            return
        if wait and self.link is not None:
            self.link.last_word_heard()
        stop_store(self.last_store)
        self.last_store = None

    @property
    def config(self) -> LaunchConfig:
        return self.plan.config

    @property
    def one_store(self) -> bool:
        """One store serves every round (node 0's, or the single node's), not each round its own."""
        return self.round_store is None or self.round_store.serves_every_round


def start_store(job: Job, sock: socket.socket) -> StoreServer:
    """Node 0's store, in its own process (core/stores/store_server.py) from the job's forkserver, counted among this
    process's live children."""
    config = job.config
    with LIVE_LOCK:
        store = store_server.start(job.mp_context, sock, config.timeout, forked=config.start_method == "fork",
                                   forkserver=job.forkserver)
        LIVE.add(store.pid)
    # The store server's copy listens; were it to die, clients are refused, not left waiting (a torch client
    # connected to a socket that listens, but that no server accepts from, waits without end: measured).
    sock.close()
    return store


def stop_store(store: StoreServer) -> None:
    store.stop()
    with LIVE_LOCK:
        LIVE.discard(store.pid)
