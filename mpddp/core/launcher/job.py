"""One job from start to end: its store, its rounds, and the restart loop.

Owns: building the job's :class:`~mpddp.core.launcher.job_state.Job` once (core/launcher/job_state.py holds it
and starts its store servers), the store servers this node hosts (node 0's for the whole job, or a round's own
when the rendezvous places it here: :meth:`~mpddp.core.nodes.api.Rendezvous.round_store` says where, and what
its loss means), the rounds (who is in each, the plan of this node's ranks in it), and the
restart loop: a failed round is a :class:`Failed`, and :func:`next_step` decides what follows: a restart while
``max_restarts`` allows (one that admits a node is free), else the end, with the report. A store server lost
is replaced for the next round on one node, and by the next round's own where each round has one; where one
store serves every round of several nodes, the others could not find a new one, so the job ends there.
While the job runs, its entry in this user's runtime folder lets ``mpddp top`` find it (core/launcher/runtime_dir.py,
core/launcher/live.py), ``launch(..., live=True)`` shows its table (core/launcher/live_display.py), and
``--dashboard`` serves the same view as a web page (core/launcher/dashboard.py). This module never asks which
backend runs: only the rendezvous' answers.
"""

from __future__ import annotations

import contextlib
import enum
import socket
from dataclasses import dataclass, replace
from typing import Any

from ...config import LaunchConfig
from ...errors import ConfigError, Outcome, RestartsExhausted, StoreLost, WorkerFailed
from ...log import logger
from ..nodes.api import NotNeeded, Rendezvous, Round, RoundLost
from ..nodes.backends import open_rendezvous
from ..procs.start import forkserver_pid, lost
from ..stores.listen import listen
from . import runtime_dir, stragglers
from .attempt import run_group
from .job_state import Job, start_store, stop_store
from .live import LiveView
from .live_display import showing
from .plan import Plan, for_round
from .startup import launch_ended, restart_forkserver


def run_job(plan: Plan, mp_context: Any, payload: bytes, init_group: bool, listening: socket.socket | None,
            live_table: bool = False, runs: str = "") -> list[Any]:
    """Every attempt of this node's part of the job, with the store up from the first to the last.

    ``listening``: node 0's socket for the job's store (core/launcher/api.py binds it where one store serves every
    round); without it, the rendezvous places each round's store, on a single node too. ``live_table``: the job's
    table shown while it runs (``launch(..., live=True)``). ``runs``: the job's script or function, as the other
    launchers compare it (core/wire/fingerprint.py)."""
    config = plan.config
    port = listening.getsockname()[1] if listening is not None else config.master_port
    job = Job(plan, mp_context, payload, init_group, port,
              forkserver=forkserver_pid() if config.start_method == "forkserver" else None, runs=runs)
    live = job.live = LiveView(job)
    with runtime_dir.serving(live.job_id, config.node_rank, lambda: live.snapshot().to_json()), \
            showing(live, live_table):  # mpddp top; launch(..., live=True)
        with _dashboard(config, live):  # --dashboard: bound here, before any rank starts
            return _run(job, listening)


def _dashboard(config: LaunchConfig, live: LiveView) -> contextlib.AbstractContextManager[object]:
    """--dashboard's page for the block; imported only then: http.server and its kin cost every other launch about
    50 ms of start-up (python -X importtime)."""
    if config.dashboard is None:
        return contextlib.nullcontext()
    from . import dashboard

    return dashboard.serving(config, live)


def _run(job: Job, listening: socket.socket | None) -> list[Any]:
    config, plan, port = job.config, job.plan, job.port
    if config.nnodes > 1 or listening is None:
        # it may connect only once the ranks run (its watch)
        job.link = open_rendezvous(config, port, plan.nprocs, job.runs)
    values = None
    try:
        if listening is not None:
            job.store = start_store(job, listening)
        try:
            values = _attempts(job)
        except NotNeeded as spare:
            logger.warning("%s", spare)
            values = []
        return values
    finally:
        _tell_lags(job, succeeded=values is not None)
        if listening is not None and job.store is None:  # no server took it (its start failed): a client of it
            listening.close()  # would wait without end, this node's leave and every other node's among them
        if job.link is not None and not job.intruder:
            job.link.leave()  # node 0: the store stays until the others have read the last round
        job.close_last_word(wait=False)
        for store in (job.store, job.script_store):
            if store is not None:
                stop_store(store)
        if listening is not None:
            listening.close()
        launch_ended()  # every process the forkserver started is gone: it may go too, in the command line


def _tell_lags(job: Job, succeeded: bool) -> None:
    """The ranks' arrivals at collectives: a summary line after a run that ended well, and the timeline."""
    summary = job.lags.summary()
    if job.across.rows >= stragglers.MIN_SAMPLES:  # node 0 of several: the whole job's, as its straggler line named it
        summary = replace(job.across.summary(), nodes=job.config.nnodes)
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


class Step(enum.Enum):
    """What follows a failed round."""

    ADMIT = "admit"  # a node arrived: every node restarts to admit it, not counted against --max-restarts
    RESTART = "restart"  # counted against --max-restarts
    END = "end"  # the job ends with the failure's report


@dataclass(frozen=True)
class Failed:
    """A round that failed, as the restart rule reads it: what the attempt raised and what became of its store."""

    error: WorkerFailed | StoreLost
    store_lost: bool  # the round's store is gone: this node's server, or the one its ranks met in
    lost: str | None  # one store served every round of several nodes: why its loss ends the job (RoundStore.lost)

    @property
    def resized(self) -> bool:
        """Every node stopped to admit a node that arrived: no failure (core/nodes/api.py's resized_record)."""
        failures = self.error.failures if isinstance(self.error, WorkerFailed) else []
        return bool(failures) and failures[0].outcome is Outcome.RESIZED


def next_step(failed: Failed, restarts: int, max_restarts: int) -> Step:
    """What follows ``failed`` after ``restarts`` counted restarts (pure): a node's arrival is admitted for free
    (torchrun's rule); restarts used up, or a lost store no other node can replace, end the job."""
    if failed.resized:
        return Step.ADMIT
    if restarts == max_restarts or (failed.store_lost and failed.lost is not None):
        return Step.END
    return Step.RESTART


def _attempts(job: Job) -> list[Any]:
    """Run the group, and again after a failure while :func:`next_step` says so. ``attempt`` is the round: the
    backend may start this node at a later one."""
    attempt = 0
    while True:
        try:
            attempt = _begin(job, attempt)
        except RoundLost as lost:  # its store's host lost before the ranks started: a failed round, as any
            _go_on(job, lost)
            attempt = lost.round_number + 1
            continue
        try:
            return run_group(job, attempt)
        except KeyboardInterrupt:  # the teardown has already run, in run_group's finally
            raise KeyboardInterrupt("mpddp: interrupted; every worker was stopped") from None
        except (WorkerFailed, StoreLost) as error:
            _go_on(job, error)
            attempt += 1


def _go_on(job: Job, error: WorkerFailed | StoreLost) -> None:
    """After a failed round: the restart :func:`next_step` allows, or the end, raised with the report."""
    failed = _failed(job, error)
    if job.live is not None:
        job.live.failed(str(error).splitlines()[0])
    step = next_step(failed, job.restarts, job.config.max_restarts)
    if step is Step.END:
        job.close_last_word(wait=True)  # node 0, its store server lost: once the others have read why
        final = _final(failed, job.config.max_restarts)
        if final is error:
            raise error  # as it is: its __cause__ is the failing rank's own exception
        raise final from error
    job.restarts += step is Step.RESTART
    _restart(job, failed, step, job.restarts)


def _failed(job: Job, error: WorkerFailed | StoreLost) -> Failed:
    lost = isinstance(error, StoreLost) or (job.store is not None and job.store.lost)
    return Failed(error, lost, job.round_store.lost if job.round_store is not None else None)


def _restart(job: Job, failed: Failed, step: Step, restarts: int) -> None:
    """Before the next round: a single node's store server replaced, if lost, and the cause's line, so that a run
    that recovers still says what went wrong."""
    if job.forkserver is not None and lost(job.forkserver):  # killed from outside: its ranks and store are gone
        job.forkserver = restart_forkserver()  # first: the next store server and ranks come from the new one
    if job.link is None and job.store is not None and (job.store.lost or job.store.stalled()):
        _replace_store(job)
    error = failed.error
    said = ("mpddp: " if isinstance(error, StoreLost) else "") + str(error).splitlines()[0]
    if step is Step.ADMIT:
        logger.warning("%s", said)
    else:
        logger.warning("%s\nmpddp: restarting the group (%d of %d)", said, restarts, job.config.max_restarts)


def _begin(job: Job, attempt: int) -> int:
    """Round ``attempt``'s start: on one node, from the second round on, a fresh store for an env:// script (with
    several nodes the rendezvous places it: :meth:`~mpddp.core.nodes.api.Rendezvous.round_store`); with several
    nodes, the round joined. The round's number: the backend may start this node at a later one."""
    if job.link is None:
        if attempt and not job.init_group:
            _new_script_store(job, job.config.master_addr)
        return attempt
    joined = _join(job, attempt)
    job.restarts += _restarts_between(job.link, attempt, joined)
    return joined


def _restarts_between(link: Rendezvous, first: int, joined: int) -> int:
    """The restarts after a failure among rounds ``first`` to ``joined - 1``, which ran without this node (it
    came late, or waited as a spare): each round's record says why it ended, and an admission is no restart."""
    ended = [link.view(number).record for number in range(first, joined)]
    return sum(record is None or record.outcome is not Outcome.RESIZED for record in ended)


def _join(job: Job, attempt: int) -> int:
    """This node's place in the next round, from ``attempt`` on, and where the round's store listens: the
    rendezvous says, and has this node host a fresh one when it is the round's (:func:`_host_store`)."""
    link = job.link
    assert link is not None
    try:
        here = link.join(attempt)
    except ConfigError:  # refused: its --node-rank taken, or one node too many; the job's keys are not its own
        job.intruder = True
        raise
    if job.store is not None and not job.one_store:  # the round before's, which this node hosted
        stop_store(job.store)
        job.store = None
    job.round_store = link.round_store(here.number, lambda host: _host_store(job, host), script=not job.init_group)
    job.port, job.script_port = job.round_store.port, job.round_store.script_port
    job.plan = for_round(job.plan, here.nnodes, here.node_rank, job.round_store.host, job.port)
    _tell_round(job, here)
    return here.number


def _tell_round(job: Job, here: Round) -> None:
    """The round's nodes and their ranks, once they changed (and in the first round, with --verbose)."""
    if here.changed() or (here.number == 0 and here.decided and job.config.verbose):
        logger.warning("mpddp: round %d: %d node(s) x %d rank(s) = %d rank(s); this is node %d. Node -> ranks, "
                       "old -> new:\n%s", here.number, here.nnodes, job.plan.nprocs, here.nnodes * job.plan.nprocs,
                       here.node_rank, "\n".join(here.table(job.plan.nprocs)))


def _host_store(job: Job, host: str) -> int:
    """A fresh store server for this round, on ``host`` (the rendezvous' choice) and a port the OS picks; where
    this node's store serves every round already (node 0's), a restarted env:// script's own."""
    if job.store is not None and job.one_store:  # node 0's serves every round: the rendezvous asks for a script's
        return _new_script_store(job, host)
    sock = listen(host, 0)
    port = sock.getsockname()[1]
    job.store = start_store(job, sock)
    return int(port)


def _final(failed: Failed, max_restarts: int) -> Exception:
    """The error a job ends with: the failure itself, or that restarts gave up after it."""
    failure = failed.error
    if isinstance(failure, StoreLost) and failed.lost is not None and max_restarts:
        return StoreLost(f"{failure}\nmpddp: {failed.lost}")
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
    job.store = None  # a new one that fails to start (its forkserver lost again) leaves none to stop twice
    sock = listen(job.config.master_addr, job.config.master_port)
    job.port = sock.getsockname()[1]
    job.store = start_store(job, sock)


def _new_script_store(job: Job, host: str) -> int:
    """Node 0: a fresh store on ``host`` for a restarted round of a script that calls
    ``init_process_group("env://")`` itself; its port.

    torch's env:// rendezvous under an agent's store (``TORCHELASTIC_USE_AGENT_STORE``) adds no prefix of the
    attempt (torch 2.13: "we create a new TCPStore for every retry"), so a restarted rank on the job's store
    would read the dead ranks' addresses. mpddp's own ranks use a prefix of the round and need none of this.
    The other nodes learn its port from the rendezvous (core/nodes/api.py's ``RoundStore.script_port``).
    """
    if job.script_store is not None:
        stop_store(job.script_store)
    sock = listen(host, 0)
    job.script_port = sock.getsockname()[1]
    job.script_store = start_store(job, sock)
    return job.script_port
