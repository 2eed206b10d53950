"""One job from start to end: its store, its rounds, and the restart loop.

Owns: what lives for the whole job and is built once (:class:`Job`: the config, the plan, the start method's
context, ``fn`` shipped by value, the rendezvous), the store server (c10d: node 0's, on the one port every node
finds, for the whole job; etcd: each round's, on the round's first node), the rounds (who is in each, the
plan of this node's ranks in it) and what a failed round becomes: a restart while ``max_restarts`` allows (one
that admits a node is free), else the report. A store server lost is replaced for the next round on one node
and under etcd; under c10d on several nodes the others could not find a new one, so the job ends there.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ...config import LaunchConfig
from ...errors import AddressError, ConfigError, Outcome, RestartsExhausted, StoreLost, WorkerFailed
from ...log import logger
from ..nodes import last_word, rendezvous, store_server
from ..nodes.api import NotNeeded, Rendezvous
from ..nodes.backends import open_rendezvous
from ..nodes.store_server import StoreServer
from ..wire import protocol
from ..wire.protocol import FailureRecord
from . import stragglers
from .attempt import run_group
from .plan import Plan, for_round
from .startup import launch_ended
from .stop import LIVE, LIVE_LOCK


@dataclass
class Job:
    """What every attempt of one launch shares, built once."""

    plan: Plan
    mp_context: Any
    payload: bytes  # cloudpickle of (fn, args, kwargs, notebook cells' lines)
    init_group: bool  # False: fn (or the script) calls init_process_group itself
    port: int  # node 0's store, for the whole job
    store: StoreServer | None = None  # node 0 only
    # A script that calls init_process_group("env://") itself (init_group False) uses MASTER_PORT's store with no
    # prefix of its own: from the second round on it gets a fresh store of the round's (core/launcher/job.py).
    script_port: int | None = None
    script_store: StoreServer | None = None  # node 0 only
    link: Rendezvous | None = None  # several nodes only: what the nodes agree on (core/nodes/api.py)
    lags: stragglers.Stragglers = field(default_factory=stragglers.Stragglers)  # arrivals at collectives, job-wide
    intruder: bool = False  # another launcher holds this node rank: the job's keys are not this one's to touch
    last_store: StoreServer | None = None  # node 0 of several, its store server lost: the store of why, for the others
    # The job's restarts after a failure so far: --max-restarts' count and TORCHELASTIC_RESTART_COUNT. A round that
    # admits a node is none (torchrun's agent counts no membership change); the same number on every node.
    restarts: int = 0

    def open_last_word(self, attempt: int, loss: str) -> None:
        """Node 0 of several (c10d), its store server just lost (``loss`` says how): a fresh one on the same port,
        before the teardown, with the loss as round ``attempt``'s record (core/nodes/last_word.py). The other
        nodes tell it as this one does, not "node 0 is gone"; :func:`_close_last_word` ends it."""
        if self.link is None or self.store is None or self.link.hosts_round_store or self.last_store is not None:
            return
        try:
            self.last_store = _start_store(self.mp_context, rendezvous.listen(self.config.master_addr, self.port),
                                          self.config)
        except (OSError, RuntimeError, AddressError):  # the port taken, the forkserver gone: they say node 0 went
            return
        line = f"{protocol.ERROR_LINE}{loss}"
        last_word.tell(self.config.master_addr, self.port, attempt,
                       FailureRecord(0, 0, 0, Outcome.STORE_LOST, 1, line, time.time(), writer=0))

    @property
    def config(self) -> LaunchConfig:
        return self.plan.config



def run_job(plan: Plan, mp_context: Any, payload: bytes, init_group: bool, listening: socket.socket | None) -> list[Any]:
    """Every attempt of this node's part of the job, with the store up from the first to the last."""
    config = plan.config
    etcd = config.rdzv_backend == "etcd"  # each round's first node hosts the round's store (_join)
    sock = listening or (rendezvous.listen(config.master_addr, config.master_port)
                         if config.node_rank == 0 and not etcd else None)
    port = sock.getsockname()[1] if sock is not None else config.master_port
    job = Job(plan, mp_context, payload, init_group, port)
    if config.nnodes > 1 or etcd:
        job.link = open_rendezvous(config, port, plan.nprocs)  # c10d: it connects once the ranks run (its watch)
    values = None
    try:
        if sock is not None:
            job.store = _start_store(mp_context, sock, config)
        try:
            values = _attempts(job)
        except NotNeeded as spare:
            logger.warning("%s", spare)
            values = []
        return values
    finally:
        _tell_lags(job, succeeded=values is not None)
        if job.link is not None and not job.intruder:
            job.link.leave()  # node 0: the store stays until the others have read the last round
        _close_last_word(job, wait=False)
        for store in (job.store, job.script_store):
            if store is not None:
                _stop_store(store)
        if sock is not None:
            sock.close()
        launch_ended()  # every process the forkserver started is gone: it may go too, in the command line


def _tell_lags(job: Job, succeeded: bool) -> None:
    """The ranks' arrivals at collectives: a summary line after a run that ended well, and the timeline."""
    summary = job.lags.summary()
    if succeeded and summary.collectives >= stragglers.MIN_SAMPLES:
        logger.info("%s", "\n".join(stragglers.summary_lines(summary, job.config.verbose)),
                    extra={"mpddp_collectives": summary})
    path = job.config.timeline
    if path is None:
        return
    if not summary.collectives:
        logger.warning("mpddp: no timeline drawn (%s): no collective was reached by every rank of this node", path)
        return
    try:
        stragglers.draw_timeline(job.lags, path)
        logger.info("mpddp: the timeline of arrivals at collectives is in %s", path)
    except (OSError, ValueError, RuntimeError) as e:
        logger.warning("mpddp: could not draw the timeline %s (%s: %s)", path, type(e).__name__, e)


def _attempts(job: Job) -> list[Any]:
    """Run the group, and again after a failure while restarts are left (a restart that admits a node that
    arrived is free, as torchrun's: ``job.restarts`` does not count it). ``attempt`` is the round, which does:
    the backend may start this node at a later one."""
    config = job.config
    attempt = 0
    numbered = config.node_rank is None  # the backend's join numbers this node (no --node-rank: torchrun's c10d)
    while True:
        if job.link is not None and (job.link.hosts_round_store or config.min_nnodes < config.nnodes or numbered):
            if attempt and not job.init_group and not job.link.hosts_round_store:
                _new_script_store(job, attempt)  # c10d's node 0, before the others read its port
            joined = _join(job, attempt)
            job.restarts += _restarts_between(job.link, attempt, joined)
            attempt = joined
        elif attempt:
            if not job.init_group:
                _new_script_store(job, attempt)
            if job.link is not None:
                job.link.join(attempt)  # a restart starts its ranks once every node's launcher is there
                if not job.init_group and job.store is None:
                    job.script_port = job.link.script_port(attempt)
        try:
            return run_group(job, attempt)
        except KeyboardInterrupt:  # the teardown has already run, in run_group's finally
            raise KeyboardInterrupt("mpddp: interrupted; every worker was stopped") from None
        except (WorkerFailed, StoreLost) as failure:
            resized = isinstance(failure, WorkerFailed) and bool(failure.failures) and (
                failure.failures[0].outcome is Outcome.RESIZED)
            store_lost = isinstance(failure, StoreLost) or (job.store is not None and job.store.lost)
            fixed_store = job.link is not None and not job.link.hosts_round_store  # c10d: node 0's, job-long
            if not resized and (job.restarts == config.max_restarts or (store_lost and fixed_store)):
                _close_last_word(job, wait=True)  # node 0, its store server lost: once the others have read why
                final = _final(failure, config.max_restarts, several_nodes=job.link is not None)
                if final is failure:
                    raise  # as it is: its __cause__ is the failing rank's own exception
                raise final from failure
            if job.link is None and job.store is not None and (job.store.lost or job.store.stalled()):
                _replace_store(job)
            # the cause's line, so that a run that recovers still says what went wrong
            said = ("mpddp: " if isinstance(failure, StoreLost) else "") + str(failure).splitlines()[0]
            if resized:
                logger.warning("%s", said)
            else:
                job.restarts += 1
                logger.warning("%s\nmpddp: restarting the group (%d of %d)", said, job.restarts, config.max_restarts)
            attempt += 1


def _restarts_between(link: Rendezvous, first: int, joined: int) -> int:
    """The restarts after a failure among rounds ``first`` to ``joined - 1``, which ran without this node (it
    came late, or waited as a spare): each round's record says why it ended, and an admission is no restart."""
    ended = [link.record(number) for number in range(first, joined)]
    return sum(record is None or record.outcome is not Outcome.RESIZED for record in ended)


def _join(job: Job, attempt: int) -> int:
    """A round whose nodes the backend decides (etcd, an elastic job, a node numbered as it joins): this node's
    place in it, and where the round's store listens. With etcd the round's first node hosts it, a fresh one
    each round (a restarted env:// script finds no dead rank's keys); with c10d it is node 0's, for the whole
    job."""
    link = job.link
    assert link is not None
    try:
        here = link.join(attempt)
    except ConfigError:  # refused: its --node-rank taken, or one node too many; the job's keys are not its own
        job.intruder = True
        raise
    if not link.hosts_round_store:
        host, port = link.store(here.number)
        if here.number and not job.init_group and job.store is None:
            job.script_port = link.script_port(here.number)
    else:
        if job.store is not None:
            _stop_store(job.store)
            job.store = None
        if here.node_rank == 0:
            host = job.config.local_addr or _own_address(job.config)
            sock = rendezvous.listen(host, 0)
            port = sock.getsockname()[1]
            job.store = _start_store(job.mp_context, sock, job.config)
            link.set_store(here.number, host, port)
        else:
            host, port = link.store(here.number)
        job.port, job.script_port = port, None if job.init_group else port
    job.plan = for_round(job.plan, here.nnodes, here.node_rank, host, port)
    if here.changed() or (here.number == 0 and job.config.verbose):
        logger.warning("mpddp: round %d: %d node(s) x %d rank(s) = %d rank(s); this is node %d. Node -> ranks, "
                       "old -> new:\n%s", here.number, here.nnodes, job.plan.nprocs, here.nnodes * job.plan.nprocs,
                       here.node_rank, "\n".join(here.table(job.plan.nprocs)))
    return here.number


def _own_address(config: LaunchConfig) -> str:
    """This node's address toward the etcd cluster's first member: the interface the other nodes reach too."""
    from ...machine.netif import resolve, source_address
    from ...rendezvous_options import parse_endpoints

    host, port = parse_endpoints(config.rdzv_endpoint or "")[0]
    return source_address(resolve(host), port)


def _final(failure: WorkerFailed | StoreLost, max_restarts: int, several_nodes: bool) -> Exception:
    """The error a job ends with: the failure itself, or that restarts gave up after it."""
    if isinstance(failure, StoreLost) and several_nodes and max_restarts:
        return StoreLost(f"{failure}\nmpddp: not restarted: node 0 hosted the job's store (--rdzv-backend c10d), and "
                         "no other node can take its place; with --rdzv-backend etcd the job survives the loss of any "
                         "node, node 0 included")
    if not max_restarts:
        return failure
    gave_up = (f"{failure}\nmpddp: gave up after {max_restarts} restart(s) (max_restarts={max_restarts}); raise "
               "--max-restarts or fix the failure above")
    if isinstance(failure, StoreLost):
        return StoreLost(gave_up)
    exhausted = RestartsExhausted(gave_up, failure.rank, failure.failures, exit_code=failure.exit_code)
    exhausted.exception = failure.exception
    return exhausted


def _start_store(mp_context: Any, sock: socket.socket, config: Any) -> StoreServer:
    """Node 0's store, in its own process (core/nodes/store_server.py), counted among this process's live children."""
    with LIVE_LOCK:
        store = store_server.start(mp_context, sock, config.timeout, forked=config.start_method == "fork")
        LIVE.add(store.pid)
    # The store server's copy listens; were it to die, clients are refused, not left waiting (a torch client
    # connected to a socket that listens, but that no server accepts from, waits without end: measured).
    sock.close()
    return store


def _close_last_word(job: Job, wait: bool) -> None:
    """Stop node 0's last word, once the other launchers have read it (``wait``, :data:`last_word.WAIT` at most)."""
    if job.last_store is None:
        return
    if wait and job.link is not None:
        last_word.heard(job.config.master_addr, job.port, job.config.nnodes - 1 - len(job.link.gone))
    _stop_store(job.last_store)
    job.last_store = None


def _stop_store(store: StoreServer) -> None:
    store.stop()
    with LIVE_LOCK:
        LIVE.discard(store.pid)


def _replace_store(job: Job) -> None:
    """One node: a fresh store server on a fresh port after the last one was lost (every rank is this node's)."""
    assert job.store is not None
    _stop_store(job.store)
    sock = rendezvous.listen(job.config.master_addr, job.config.master_port)
    job.port = sock.getsockname()[1]
    job.store = _start_store(job.mp_context, sock, job.config)


def _new_script_store(job: Job, attempt: int) -> None:
    """Node 0: a fresh store for a round of a script that calls ``init_process_group("env://")`` itself.

    torch's env:// rendezvous under an agent's store (``TORCHELASTIC_USE_AGENT_STORE``) adds no prefix of the
    attempt (torch 2.13: "we create a new TCPStore for every retry"), so a restarted rank on the job's store
    would read the dead ranks' addresses. mpddp's own ranks use a prefix of the round and need none of this.
    The other nodes read its port from the job's store once they have joined the round.
    """
    if job.store is None:
        return
    if job.script_store is not None:
        _stop_store(job.script_store)
    sock = rendezvous.listen(job.config.master_addr, 0)
    job.script_port = sock.getsockname()[1]
    job.script_store = _start_store(job.mp_context, sock, job.config)
    if job.link is not None:
        job.link.set_script_port(attempt, job.script_port)
