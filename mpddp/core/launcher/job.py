"""One job from start to end: its rounds and the restart loop.

Owns: building the job's :class:`~mpddp.core.launcher.job_state.Job` once (core/launcher/job_state.py holds it
and starts its store servers), the store server (c10d: node 0's, on the one port every node finds, for the
whole job; etcd: each round's, on the round's first node), the rounds (who is in each, the plan of this node's
ranks in it) and what a failed round becomes: a restart while ``max_restarts`` allows (one that admits a node
is free), else the report. A store server lost is replaced for the next round on one node and under etcd;
under c10d on several nodes the others could not find a new one, so the job ends there.
"""

from __future__ import annotations

import socket
from typing import Any

from ...config import LaunchConfig
from ...errors import ConfigError, Outcome, RestartsExhausted, StoreLost, WorkerFailed
from ...log import logger
from ..nodes import rendezvous
from ..nodes.api import NotNeeded
from ..nodes.backends import open_rendezvous
from . import stragglers
from .attempt import run_group
from .job_state import Job, start_store, stop_store
from .plan import Plan, for_round
from .startup import launch_ended


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
            job.store = start_store(mp_context, sock, config)
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
        job.close_last_word(wait=False)
        for store in (job.store, job.script_store):
            if store is not None:
                stop_store(store)
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
    arrived is free, as torchrun's). ``attempt`` is the round: the backend may start this node at a later one."""
    config = job.config
    attempt = restarts = 0
    numbered = config.node_rank is None  # the backend's join numbers this node (no --node-rank: torchrun's c10d)
    while True:
        if job.link is not None and (job.link.hosts_round_store or config.min_nnodes < config.nnodes or numbered):
            if attempt and not job.init_group and not job.link.hosts_round_store:
                _new_script_store(job, attempt)  # c10d's node 0, before the others read its port
            attempt = _join(job, attempt)
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
            if not resized and (restarts == config.max_restarts or (store_lost and fixed_store)):
                job.close_last_word(wait=True)  # node 0, its store server lost: once the others have read why
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
                restarts += 1
                logger.warning("%s\nmpddp: restarting the group (%d of %d)", said, restarts, config.max_restarts)
            attempt += 1


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
            stop_store(job.store)
            job.store = None
        if here.node_rank == 0:
            host = job.config.local_addr or _own_address(job.config)
            sock = rendezvous.listen(host, 0)
            port = sock.getsockname()[1]
            job.store = start_store(job.mp_context, sock, job.config)
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


def _replace_store(job: Job) -> None:
    """One node: a fresh store server on a fresh port after the last one was lost (every rank is this node's)."""
    assert job.store is not None
    stop_store(job.store)
    sock = rendezvous.listen(job.config.master_addr, job.config.master_port)
    job.port = sock.getsockname()[1]
    job.store = start_store(job.mp_context, sock, job.config)


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
        stop_store(job.script_store)
    sock = rendezvous.listen(job.config.master_addr, 0)
    job.script_port = sock.getsockname()[1]
    job.script_store = start_store(job.mp_context, sock, job.config)
    if job.link is not None:
        job.link.set_script_port(attempt, job.script_port)
