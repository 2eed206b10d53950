"""One attempt's ranks started, each with its four pipes, and the typed messages read from them.

Owns: a rank's channels (typed messages, stdout, stderr and stack dumps:
the launcher keeps only the read ends, so EOF tells a rank is gone), starting
every rank of the attempt from the start method's context (each added to
the attempt's states at once, so that a Ctrl-C between two starts still
finds the ones already running), and reading what a rank sent. Leaves the
watch loop to core/launcher/watch.py and the messages' types to core/wire/protocol.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from ...context import WorkerContext
from ...rank_math import banner
from ..procs.start import start_process
from ..rank import boot
from ..wire import protocol
from .board import Board
from .classify import RankState
from .job_state import Job
from .output import Relay
from .plan import node_env, rank_env
from .stop import LIVE, LIVE_LOCK


def _pipe() -> tuple[int, Connection]:
    """A pipe: the parent's raw read end, the worker's write end."""
    read_fd, write_fd = os.pipe()
    return read_fd, Connection(write_fd, readable=False)


@dataclass
class _Channels:
    """One rank's four pipes: typed messages (core/wire/protocol.py), stdout, stderr and stack dumps."""

    messages: tuple[Connection, Connection]
    out: tuple[int, Connection]
    err: tuple[int, Connection]
    stack: tuple[int, Connection]

    @property
    def worker_ends(self) -> tuple[Connection, ...]:
        return self.messages[1], self.out[1], self.err[1], self.stack[1]

    @property
    def fds(self) -> set[int]:
        return {self.messages[0].fileno(), self.out[0], self.err[0], self.stack[0]} | {
            c.fileno() for c in self.worker_ends}


def start_ranks(job: Job, attempt: int, relay: Relay, states: list[RankState], error_dir: str) -> None:
    """Start every rank, adding each to ``states`` at once: a Ctrl-C between two starts
    must still find the ones already running (the caller tears ``states`` down)."""
    plan, mp_context, config, port = job.plan, job.mp_context, job.config, job.port
    shared_env = node_env(plan, job.script_port or port, job.restarts)
    channels = [_Channels(mp_context.Pipe(duplex=False), _pipe(), _pipe(), _pipe()) for _ in plan.slots]
    all_fds = set().union(*(c.fds for c in channels))
    for slot, ch in zip(plan.slots, channels):
        # --virtual-local-rank: the rank's GPU is the only one it sees, its cuda:0
        seen = replace(slot, cuda_index=0) if config.virtual_local_rank and slot.cuda_index is not None else slot
        ctx = WorkerContext.at(seen, nnodes=config.nnodes, backend=plan.backend, restart=attempt,
                               verbose=config.verbose)
        spec = protocol.WorkerSpec(
            ctx=ctx, store_addr=config.master_addr, store_port=port, store_prefix=protocol.attempt_prefix(attempt),
            timeout=config.timeout, env=rank_env(shared_env, slot, error_dir, config.virtual_local_rank),
            threads=plan.threads,
            payload=job.payload, banner=banner(ctx) if config.verbose else None, init_group=job.init_group,
            roll=protocol.RollCall(job.link.me, config.node, config.nnodes, plan.nprocs, job.runs)
            if job.link is not None and config.nnodes > 1 else None,
            # a forked child inherits every pipe: it must close the ends that are not its own
            close_fds=tuple(sorted(all_fds - {c.fileno() for c in ch.worker_ends}))
            if config.start_method == "fork" else (),
            parent=job.forkserver if job.forkserver is not None else os.getpid(),
            numa_binding=config.numa_binding if plan.gpus else None,
        )
        process = mp_context.Process(target=boot.rank_process, args=(spec, *ch.worker_ends),
                                     name=f"mpddp-rank-{slot.rank}")
        with LIVE_LOCK, boot.main_hidden(always=False):
            start_process(process, job.forkserver)
            LIVE.add(process.pid)
        os.set_blocking(ch.stack[0], False)
        states.append(RankState(slot=slot, process=process, messages=ch.messages[0], stack_fd=ch.stack[0],
                                pid=process.pid))
        relay.add(slot.rank, ch.out[0], ch.err[0])
    for ch in channels:
        for conn in ch.worker_ends:
            conn.close()  # the parent keeps only read ends: EOF when a worker is gone


def receive(state: RankState, board: Board) -> None:
    """Read every message waiting on this rank's channel (results can be large)."""
    conn: Connection | None = state.messages
    while conn is not None and not conn.closed:
        try:
            if not conn.poll():
                return
            message = protocol.decode(conn.recv_bytes())
        except (EOFError, OSError):
            conn.close()
            return
        if isinstance(message, protocol.Started):
            state.started, state.main_thread = True, message.main_thread
        elif isinstance(message, protocol.Joined):
            state.joined = True
        elif isinstance(message, protocol.Collectives):
            board.add(state.slot.rank, message)
        elif isinstance(message, protocol.Left):
            state.left = message
        elif isinstance(message, protocol.Refused):
            state.refused = message
        elif isinstance(message, protocol.Result):
            state.payload, state.has_result, state.finished_at = message.payload, True, message.time
        else:
            state.failure, state.failed_at = message, message.time
