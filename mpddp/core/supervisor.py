"""One attempt of one node's worker group: start, watch, stop.

Owns: starting this node's processes (each with a message channel and two
output pipes), the watch loop that drains typed messages while waiting
(reading only after join deadlocks past the 64 KiB pipe buffer), the
teardown that always runs, and loading the ranks' return values. Leaves the
plan to core/plan.py, the restart loop to core/api.py, the report to
core/report.py, other nodes to core/heartbeat.py, killing to core/procs.py
and lines to core/relay.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle

from ..context import WorkerContext
from ..errors import MainGuardError, WorkerFailed
from ..ranks import banner
from . import procs, protocol
from .heartbeat import Heartbeat, remote_causes
from .plan import Plan, node_env, rank_env
from .relay import Relay
from .report import RankState, failure_error, root_cause

_FAILURE_WINDOW = 0.3  # seconds to collect other ranks' reports after the first failure
_TEARDOWN_GRACE = 0.5


@contextlib.contextmanager
def _main_file_checked() -> Iterator[None]:
    """Workers re-import ``__main__`` from its file, as multiprocessing does; a
    ``__main__`` with no such file (``python - < script``, an embedded
    interpreter) would make every worker die before it starts. ``fn`` travels
    by value, so such a worker does not need it: hide the name while starting.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(path) or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__  # type: ignore[union-attr]
    try:
        yield
    finally:
        main.__file__ = path  # type: ignore[union-attr]


def _pipe() -> tuple[int, Connection]:
    """An output pipe: the parent's raw read end, the worker's write end."""
    read_fd, write_fd = os.pipe()
    return read_fd, Connection(write_fd, readable=False)


def _start(
    plan: Plan, mp_context: Any, payload: bytes, port: int, attempt: int, relay: Relay, init_group: bool,
    states: list[RankState],
) -> None:
    """Start every rank, adding each to ``states`` at once: a Ctrl-C between two starts
    must still find the ones already running (the caller tears ``states`` down)."""
    from .worker import WorkerSpec, entry

    config = plan.config
    shared_env = node_env(plan, port, attempt)
    channels = [(mp_context.Pipe(duplex=False), _pipe(), _pipe()) for _ in plan.slots]
    all_fds = {fd for (m_r, m_w), (o_r, o_w), (e_r, e_w) in channels
               for fd in (m_r.fileno(), m_w.fileno(), o_r, o_w.fileno(), e_r, e_w.fileno())}
    for slot, ((msg_r, msg_w), (out_r, out_w), (err_r, err_w)) in zip(plan.slots, channels):
        ctx = WorkerContext.at(slot, nnodes=config.nnodes, backend=plan.backend, restart=attempt,
                               verbose=config.verbose)
        own = {msg_w.fileno(), out_w.fileno(), err_w.fileno()}
        spec = WorkerSpec(
            ctx=ctx, store_addr=config.master_addr, store_port=port, store_prefix=protocol.attempt_prefix(attempt),
            timeout=config.timeout, env=rank_env(shared_env, slot), threads=plan.threads,
            payload=payload, banner=banner(ctx) if config.verbose else None, init_group=init_group,
            # a forked child inherits every pipe: it must close the ends that are not its own
            close_fds=tuple(sorted(all_fds - own)) if config.start_method == "fork" else (),
        )
        process = mp_context.Process(target=entry, args=(spec, msg_w, out_w, err_w), name=f"mpddp-rank-{slot.rank}")
        with _main_file_checked():
            process.start()
        states.append(RankState(slot=slot, process=process, messages=msg_r))
        relay.add(slot.rank, out_r, err_r)
    for (_, msg_w), (_, out_w), (_, err_w) in channels:
        for conn in (msg_w, out_w, err_w):
            conn.close()  # the parent keeps only read ends: EOF when a worker is gone


def _receive(state: RankState) -> None:
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
            state.started = True
        elif isinstance(message, protocol.Result):
            state.payload, state.has_result = message.payload, True
        else:
            state.failure, state.failed_at = message, message.time


def _watch(states: list[RankState]) -> None:
    """Wait until every rank succeeded, or a failure window has closed."""
    first_failure: float | None = None
    while True:
        waitables: list[Any] = [s.messages for s in states if not s.messages.closed]
        waitables += [s.process.sentinel for s in states if s.exitcode is None]
        ready = wait(waitables, timeout=0.2) if waitables else []
        for s in states:
            if s.messages in ready or s.process.sentinel in ready or s.exitcode is None:
                _receive(s)
            if s.exitcode is None and s.process.sentinel in ready:
                s.process.join(0)
                s.exitcode = s.process.exitcode
                _receive(s)
                if s.exitcode is not None and s.failed_at is None and (s.exitcode != 0 or not s.has_result):
                    s.failed_at = time.monotonic()
        now = time.monotonic()
        if first_failure is None and any(s.failed_at is not None for s in states):
            first_failure = now
        if all(s.succeeded for s in states):
            return
        if first_failure is not None and (now - first_failure > _FAILURE_WINDOW or all(
                s.exitcode is not None for s in states)):
            return


def _teardown(states: list[RankState]) -> None:
    alive = [s for s in states if s.exitcode is None and s.process.is_alive()]
    for s in alive:
        s.stopped = True
    pids = [s.process.pid for s in states if s.process.pid]
    procs.kill_tree([s.process.pid for s in alive], _TEARDOWN_GRACE, groups=pids)
    for s in states:
        s.process.join(2.0)
        if s.exitcode is None:
            s.exitcode = s.process.exitcode


def run_group(plan: Plan, mp_context: Any, payload: bytes, attempt: int, init_group: bool = True) -> list[Any]:
    """Start this node's ranks, watch them, and stop them all, whatever happens."""
    from . import rendezvous

    config = plan.config
    sock = rendezvous.listen(config.master_addr, config.master_port) if config.node_rank == 0 else None
    port = sock.getsockname()[1] if sock is not None else config.master_port
    relay = Relay(config.output_ranks, config.log_dir)
    states: list[RankState] = []
    store = beat = None
    notes: list[str] = []
    try:
        _start(plan, mp_context, payload, port, attempt, relay, init_group, states)
        relay.start()
        if sock is not None:
            store = rendezvous.host_store(sock, config.timeout)
        if config.nnodes > 1:
            beat = Heartbeat(config.master_addr, port, config.node_rank, attempt, config.timeout)
        _watch(states)
        if not all(s.succeeded for s in states):
            notes = remote_causes(config, plan.nprocs, root_cause(states).outcome, store, port, attempt,
                                  init_group, stop_local=lambda: _teardown(states))
    finally:
        if beat is not None:
            beat.stop()
        _teardown(states)
        relay.stop()
        del store
        if sock is not None:
            sock.close()
    if any(s.exitcode == protocol.MAIN_GUARD_EXIT and not s.started for s in states):
        raise MainGuardError(_MAIN_GUARD_MESSAGE)
    if all(s.succeeded for s in states):
        return [_value(s) for s in states]
    for s in states:
        s.tail = relay.tail(s.slot.rank)
    error = failure_error(states)
    if notes:
        error.args = ("\n".join([*notes, str(error)]),)
    raise error


def _value(state: RankState) -> Any:
    """A rank's return value, loaded here; a value this process cannot load names its rank."""
    try:
        return cloudpickle.loads(state.payload or b"")
    except Exception as e:
        rank = state.slot.rank
        raise WorkerFailed(
            f"mpddp: rank {rank} returned a value that the launcher cannot load ({type(e).__name__}: {e}): "
            "it was pickled by reference to something only the worker had (a module it imported, a class "
            "defined under `if` in a worker); return plain data (numbers, lists, dicts, tensors) or make that "
            "module importable in the launching process",
            rank, [state.record()], exit_code=1,
        ) from None


_MAIN_GUARD_MESSAGE = """\
mpddp.launch() ran again inside a worker: your script has no main guard.
Each worker process imports your script; put the launch under the guard:

    if __name__ == "__main__":
        mpddp.launch(train, nprocs=2)
"""
