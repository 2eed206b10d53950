"""One attempt of one node's worker group: plan, start, watch, stop.

Owns: the plan (GPUs, backend, threads, environment), starting the
processes, the watch loop that drains results and failures while waiting
(reading only after join deadlocks past the 64 KiB pipe buffer), choosing
the rank that failed *first*, and the teardown that always runs. Leaves the
restart loop and shipping ``fn`` to launcher.py, reports to report.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import psutil

from . import procs
from . import ranks as rank_math
from .config import LaunchConfig
from .context import WorkerContext
from .errors import ConfigError, MainGuardError
from .gpus import child_cuda_env
from .heartbeat import Heartbeat, remote_causes
from .machine import banner, physical_cores, threads_per_rank
from .relay import Relay
from .report import RankState, failure_error, root_cause

_FAILURE_WINDOW = 0.3  # seconds to collect other ranks' reports after the first failure
_TEARDOWN_GRACE = 0.5


@dataclass(frozen=True)
class Plan:
    """A validated config plus what the machine decided: GPUs, backend, threads."""

    config: LaunchConfig
    nprocs: int
    backend: str
    gpus: tuple[int, ...] | None  # physical ids; local rank i drives gpus[i % len]
    pin_visible: bool  # write CUDA_VISIBLE_DEVICES for the workers
    threads: int | None
    slots: tuple[rank_math.RankSlot, ...] = field(default=())


def _gpus(config: LaunchConfig) -> tuple[tuple[int, ...] | None, bool]:
    """Physical GPU ids for local ranks 0, 1, ... (None: CPU), and whether to pin them.

    nvidia-smi/NVML answer without a CUDA context; torch.cuda.device_count()
    is the fallback (safe too, DESIGN.md), never is_available().
    """
    import torch

    from .gpus import busy_warnings, query_gpus, resolve_gpus

    query = query_gpus()
    if config.gpus is None and not query.visible:
        count = torch.cuda.device_count()
        return (tuple(range(count)) or None), False
    ids = resolve_gpus(config.gpus, config.nprocs, query)
    for warning in busy_warnings(ids, query):
        print(warning, file=sys.stderr, flush=True)
    return ids, ids is not None


def _check_fork(gpus: tuple[int, ...] | None) -> None:
    """Refuse ``fork`` where a forked child fails or can hang; see DESIGN.md."""
    import torch

    if gpus or torch.cuda.is_initialized():
        raise ConfigError(
            "start_method='fork' is unsafe with CUDA GPUs visible: a forked child fails with 'Cannot re-initialize "
            "CUDA in forked subprocess'; use start_method='forkserver' (the default, as fast) or 'spawn'"
        )
    if threading.active_count() > 1:
        raise ConfigError(
            f"start_method='fork' is unsafe here: this process runs {threading.active_count()} Python threads "
            "(Jupyter does) and a forked child inherits any lock they hold, so it can hang without a word; "
            "use start_method='forkserver' (the default, as fast after the first launch) or 'spawn'"
        )


def _fork_threads(threads: int) -> int:
    """Forked children use one intra-op thread once this process has other OS threads.

    A child forked after a multi-threaded torch op inherits a dead OpenMP pool
    and hangs on its next parallel op, unless it stays on one thread. OS
    threads cannot tell an OpenMP pool from BLAS's, so any extra one counts.
    """
    return 1 if psutil.Process().num_threads() > 1 else threads


def choose(config: LaunchConfig, gpus: tuple[int, ...] | None) -> tuple[int, str]:
    """nprocs and backend for ``config`` on these GPUs (pure; ``mpddp info`` shows the same)."""
    nprocs = config.nprocs or (len(gpus) if gpus else 1)
    backend = config.backend if config.backend != "auto" else ("nccl" if gpus else "gloo")
    if backend == "nccl" and not gpus:
        raise ConfigError("backend='nccl' needs CUDA GPUs but none is visible here; use --backend gloo (or auto)")
    if backend == "nccl" and gpus and nprocs > len(gpus):
        raise ConfigError(
            f"nprocs={nprocs} with {len(gpus)} GPU(s): NCCL refuses two ranks on one GPU; "
            f"pass --nprocs {len(gpus)} or --backend gloo"
        )
    return nprocs, backend


def plan_launch(config: LaunchConfig) -> Plan:
    """Decide GPUs, nprocs, backend and threads without initializing CUDA here."""
    gpus, pin = _gpus(config)
    nprocs, backend = choose(config, gpus)
    # GPU ranks too: 8 ranks each running a thread per core would fight over the CPU
    threads = threads_per_rank(nprocs, physical_cores(), os.environ.get("OMP_NUM_THREADS"))
    if config.start_method == "fork":
        _check_fork(gpus)
        threads = _fork_threads(threads)
    slots = rank_math.layout(config.nnodes, nprocs, gpus)
    mine = tuple(s for s in slots if s.node_rank == config.node_rank)
    return Plan(config, nprocs, backend, gpus, pin, threads, mine)


def _node_env(plan: Plan, port: int, attempt: int) -> dict[str, str]:
    """The environment every worker of this node shares, computed once per group."""
    config = plan.config
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(plan.slots[0].world_size),
        LOCAL_WORLD_SIZE=str(plan.nprocs),
        GROUP_RANK=str(config.node_rank),
        NODE_RANK=str(config.node_rank),
        ROLE_WORLD_SIZE=str(plan.slots[0].world_size),
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        PYTHONUNBUFFERED="1",
        MPDDP_STDOUT_ISATTY="1" if _interactive() else "0",
    )
    env.update(dict(config.env))
    if plan.threads is not None:
        env["OMP_NUM_THREADS"] = str(plan.threads)
    if plan.pin_visible and plan.gpus:
        env.update(child_cuda_env(tuple(dict.fromkeys(plan.gpus))))
    if config.nnodes == 1:
        # one node: every socket on loopback, none on the machine's public interfaces
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    else:
        from .netif import interface_env

        for key, value in interface_env(config.master_addr, os.environ).items():
            env.setdefault(key, value)
    return env


def _rank_env(node_env: dict[str, str], slot: rank_math.RankSlot) -> dict[str, str]:
    """One worker's environment: the node's plus its ranks, as torchrun sets them."""
    return {**node_env, "RANK": str(slot.rank), "LOCAL_RANK": str(slot.local_rank), "ROLE_RANK": str(slot.rank)}


def _interactive() -> bool:
    return "ipykernel" in sys.modules or bool(getattr(sys.stdout, "isatty", lambda: False)())


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
    node_env = _node_env(plan, port, attempt)
    channels = [(mp_context.Pipe(duplex=False), _pipe(), _pipe()) for _ in plan.slots]
    all_fds = {fd for (m_r, m_w), (o_r, o_w), (e_r, e_w) in channels
               for fd in (m_r.fileno(), m_w.fileno(), o_r, o_w.fileno(), e_r, e_w.fileno())}
    for slot, ((msg_r, msg_w), (out_r, out_w), (err_r, err_w)) in zip(plan.slots, channels):
        ctx = WorkerContext(
            rank=slot.rank, local_rank=slot.local_rank, node_rank=slot.node_rank, world_size=slot.world_size,
            nprocs_per_node=plan.nprocs, nnodes=config.nnodes, device=slot.device, backend=plan.backend,
            gpu=slot.gpu, restart=attempt, verbose=config.verbose,
        )
        own = {msg_w.fileno(), out_w.fileno(), err_w.fileno()}
        spec = WorkerSpec(
            ctx=ctx, store_addr=config.master_addr, store_port=port, store_prefix=f"mpddp/attempt_{attempt}",
            timeout=config.timeout, env=_rank_env(node_env, slot), threads=plan.threads,
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
            data = conn.recv_bytes()
        except (EOFError, OSError):
            conn.close()
            return
        if data[:1] == b"R":
            state.result = cloudpickle.loads(data[1:])
            state.has_result = True
        else:
            kind, value = cloudpickle.loads(data)
            if kind == "started":
                state.started = True
            elif kind == "error":
                state.error = value
                state.failed_at = value["time"]


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
        if all(s.exitcode == 0 and s.has_result for s in states):
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
        if not all(s.exitcode == 0 and s.has_result for s in states):
            notes = remote_causes(config, plan.nprocs, root_cause(states).kind, store, port, attempt,
                                  init_group, stop_local=lambda: _teardown(states))
    finally:
        if beat is not None:
            beat.stop()
        _teardown(states)
        relay.stop()
        del store
        if sock is not None:
            sock.close()
    guard = [s for s in states if s.exitcode == _main_guard_exit() and not s.started]
    if guard:
        raise MainGuardError(_MAIN_GUARD_MESSAGE)
    if all(s.exitcode == 0 and s.has_result for s in states):
        return [s.result for s in states]
    for s in states:
        s.tail = relay.tail(s.slot.rank)
    error = failure_error(states)
    if notes:
        error.args = ("\n".join([*notes, str(error)]),)
    raise error


def _main_guard_exit() -> int:
    from .worker import MAIN_GUARD_EXIT

    return MAIN_GUARD_EXIT


_MAIN_GUARD_MESSAGE = """\
mpddp.launch() ran again inside a worker: your script has no main guard.
Each worker process imports your script; put the launch under the guard:

    if __name__ == "__main__":
        mpddp.launch(train, nprocs=2)
"""
