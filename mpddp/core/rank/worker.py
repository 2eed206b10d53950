"""The worker side: from a fresh process to ``fn(ctx)`` and back.

Owns: what happens inside each worker process, in order (after
core/rank/boot.py gave it its own session and parent-death signal):
stdout/stderr onto the relay pipes, environment and
threads, ``set_device``, connecting to node 0's store, an explicit
``init_process_group(rank=..., world_size=...)``, calling ``fn``, sending
the result or a typed failure back (core/rank/outcome.py makes either: a
failure's kind comes from the exception's type and frame), and always
``destroy_process_group``;
meanwhile a thread reads torch's flight recorder (core/rank/recorder.py).
The forkserver preloads this module, so importing torch here is paid once.
Leaves running a script (``mpddp run``) to core/rank/script.py.
"""

from __future__ import annotations

import ctypes
import io
import json
import linecache
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from ...log import logger
from ..procs import teardown
from ..wire import protocol, stacks
from ..wire.fingerprint import Fingerprint, refusal
from ..wire.protocol import WorkerSpec
from . import outcome, recorder
from .by_index import ByIndex
from .forkserver import serve_if_forkserver

THREAD_GRACE = 5.0  # seconds a worker waits for threads and child processes fn left running
_GROUPS_LEFT: list[Any] = []  # the default group, destroyed but not freed as the rank ends (run_rank)
_IOLBF = 1  # glibc's setvbuf mode for line buffering


# The forkserver imports this module first: there it also adopts orphans and cleans up
# after the launcher, even one killed by SIGKILL (core/rank/forkserver.py).
serve_if_forkserver()


def _redirect(out: Connection, err: Connection) -> None:
    """Point fds 1 and 2 at the relay pipes: catches C-level writes too."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    _c_stdio("setvbuf", _IOLBF)


def _c_stdio(call: str, mode: int = 0) -> None:
    """C code's printf reaches the relay line by line (``setvbuf``), and all of it (``fflush``).

    On a pipe, C stdout is fully buffered, and a worker ends in ``os._exit``, which drops
    C buffers: without this, printf output from C extensions is lost unless the launcher
    happened to run with PYTHONUNBUFFERED (a Jupyter kernel does not).
    """
    try:
        libc = ctypes.CDLL(None)
        if call == "setvbuf":
            libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, mode, ctypes.c_size_t(0))
        else:
            libc.fflush(None)
    except (OSError, AttributeError, ValueError):
        pass  # not glibc: C output keeps the platform's buffering


_PLUMBING = (os.path.join("mpddp", "core", "rank", "script.py"), "<frozen runpy>", "runpy.py")


def _user_traceback(exc: BaseException) -> BaseException:
    """``exc`` with its traceback starting at the user's fn or script, not at run_rank or runpy."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and (
            tb.tb_frame.f_code in (run_rank.__code__, ByIndex.__call__.__code__)
            or tb.tb_frame.f_code.co_filename.endswith(_PLUMBING)):
        tb = tb.tb_next
    return exc.with_traceback(tb)


class _Refused(BaseException):
    """The rank leaves before the group is made: it sent protocol.Refused."""


def _round_store(spec: WorkerSpec) -> Any:
    return torch.distributed.PrefixStore(spec.store_prefix, _connect(spec.store_addr, spec.store_port, spec.timeout))


def _roll_call(roll: protocol.RollCall, rank: int, store: Any, where: str) -> protocol.Refused | None:
    """Before this rank joins: its launcher runs the job of the round's node 0 (:func:`_other_job`, first: a
    launcher of another job takes no node rank from this one's), its node rank is its launcher's alone in this
    round (the first launcher to come with it holds it), and its node's --nnodes and --nprocs are the first
    node's; then its arrival, numbered (node 0 names the ranks that never came). Six operations."""
    if (other := _other_job(roll, store, where)) is not None:
        return protocol.Refused(other, shared=False)
    holder = store.compare_set(protocol.claim_key(roll.node_rank), "", roll.launcher).decode()
    if holder != roll.launcher:
        return protocol.Refused(f"--node-rank {roll.node_rank} is taken: the launcher {holder} came first with it; "
                                f"pass another --node-rank on this machine ({socket.gethostname()})", shared=False)
    shape = json.dumps([roll.node_rank, roll.nnodes, roll.nprocs])
    node, nnodes, nprocs = json.loads(store.compare_set(protocol.SHAPE, "", shape))
    if (nnodes, nprocs) == (roll.nnodes, roll.nprocs):
        store.set(protocol.arrived_entry(store.add(protocol.ARRIVED, 1)), str(rank))
        return None
    return protocol.Refused(f"node {roll.node_rank} was started with --nnodes {roll.nnodes} --nprocs {roll.nprocs}, "
                            f"node {node} with --nnodes {nnodes} --nprocs {nprocs}: start every node's launcher with "
                            "the same --nnodes and --nprocs", shared=True)


def _other_job(roll: protocol.RollCall, store: Any, where: str) -> str | None:
    """The line that refuses a launcher of another job than the round's node 0 (the store at ``where``), whose
    ranks say theirs; the others wait for it, as long as their group would wait for node 0's ranks (gone by then:
    the launcher names them, and this check is moot). None: the same job, or one not said ("": not compared)."""
    if roll.node_rank == 0:
        standing = store.compare_set(protocol.RUNS, "", roll.runs).decode()
    else:
        try:
            store.wait([protocol.RUNS])
        except Exception:  # noqa: BLE001 - torch's timeout: node 0's ranks never came
            return None
        standing = store.get(protocol.RUNS).decode()
    mine = Fingerprint(roll.runs, roll.nprocs)  # --nprocs: the shape's, told to every node (below)
    if not (roll.runs and standing and (difference := mine.differs(Fingerprint(standing, roll.nprocs)))):
        return None
    return refusal(f"the job at {where} (node 0's store)", difference, "give this job a --master-port of its own")


def _init_group(spec: WorkerSpec, store: Any) -> None:
    ctx = spec.ctx
    dist.init_process_group(
        ctx.backend,
        store=store,
        rank=ctx.rank,  # the global rank, never local_rank
        world_size=ctx.world_size,
        # torch's default timeout, as under torchrun: the launcher's watchdog finds hangs, and a
        # short collective timeout would kill a long rank-0-only phase (evaluation, a checkpoint)
    )
    # Gloo's init returns on one rank while a peer still connects to it: a rank whose fn
    # returns at once would exit and fail that peer ("connectFullMesh failed ... closed by
    # peer"). Leave init only when every rank has.
    if store.add(protocol.INITIALIZED, 1) == ctx.world_size:
        store.set(protocol.ALL_INITIALIZED, "1")
    store.wait([protocol.ALL_INITIALIZED])


def _connect(addr: str, port: int, timeout: float) -> Any:
    from ..wire.store import connect

    return connect(addr, port, timeout)


def _wait_for_leftovers(rank: int, threads_too: bool) -> bool:
    """Give the threads and child processes fn left running a moment; True if some are still running.

    multiprocessing joins every non-daemon thread and child process before a
    worker exits, so one that fn forgot (a logger, a prefetcher, a
    ``multiprocessing.Process``) would keep the worker, and the whole launch,
    alive forever after fn returned. A script (``mpddp run``) waits for its
    threads, as ``python script.py`` does; its forgotten processes get the grace.
    """
    deadline = time.monotonic() + THREAD_GRACE
    threads = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for thread in threads if threads_too else ():
        thread.join(max(0.0, deadline - time.monotonic()))
    children = [p for p in multiprocessing.active_children() if not p.daemon]
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    left_threads = [t.name for t in threads if t.is_alive()] if threads_too else []
    left_children = [f"{p.name} (pid {p.pid})" for p in children if p.is_alive()]
    if not left_threads and not left_children:
        return False
    what = [f"thread(s) {', '.join(left_threads)}"] * bool(left_threads)
    what += [f"process(es) {', '.join(left_children)}"] * bool(left_children)
    logger.warning("mpddp: rank %d: fn returned but left %s running; stopped them after %.0f s (join them in fn, "
                   "or make them daemon)", rank, " and ".join(what), THREAD_GRACE)
    return True


def _stop_descendants() -> None:
    """Stop every process this worker started, also those in a session of their own.

    The launcher stops a rank's process group; a child started with
    ``start_new_session=True`` is not in it, and once this worker has exited it
    would be re-parented and lost. So a worker takes its whole tree along.
    """
    try:
        below = [p.pid for p in psutil.Process().children(recursive=True)]
    except psutil.Error:
        return
    if below:
        teardown.kill_tree(below, grace=0.2)


def _bind_near(gpu_index: int, mode: str) -> None:
    """``--numa-binding``: this rank's threads on the CPUs near its GPU (``gpu_index`` among those it sees), by
    torch's own binding, as torchrun's agent binds each worker (torch/numa/binding.py)."""
    from torch.numa.binding import AffinityMode, NumaOptions, _maybe_apply_numa_binding_to_current_process

    _maybe_apply_numa_binding_to_current_process(gpu_index=gpu_index,
                                                 numa_options=NumaOptions(affinity_mode=AffinityMode(mode)))


def _fresh_random_state() -> None:
    """Seed torch's generators (CPU now, CUDA's once CUDA starts) and numpy's global one from the OS, as in a
    fresh process.

    A rank forked from the forkserver (or from the launcher, under fork) inherits its parent's generators:
    every rank, and every restart, would draw the same dropout masks, augmentations and unseeded samples
    (measured: the same ``torch.initial_seed()`` on both ranks; torchrun's differ). CPython reseeds ``random``
    after a fork by itself. A user who seeds does so later, in ``fn`` or the script, and wins.
    """
    if torch.version.cuda or torch.version.hip or torch.xpu.is_available():
        torch.seed()  # CUDA's generators get it queued: it is applied when the rank first uses CUDA, not here
    else:  # a CPU build: torch.seed() would queue the seeding of GPUs it has not, each with its caller's stack
        torch.default_generator.seed()  # (format_stack: 2 to 13 ms a rank, on the way to the first step)
    numpy = sys.modules.get("numpy")  # torch imports it where installed; a rank that imports it later is fresh
    if numpy is not None:
        numpy.random.seed()


_SEND_LOCK = threading.Lock()  # the main thread and the collectives reader share the channel


def _send(messages: Connection, message: protocol.Message) -> None:
    data = protocol.encode(message)
    with _SEND_LOCK:
        messages.send_bytes(data)


def _tell_leaving(messages: Connection) -> Callable[..., Any]:
    """Wrap torch.distributed's ``destroy_process_group``: a rank that destroys the default group (fn's own
    call) says so first, and where, so that a peer's broken collective is told as the consequence of that;
    returns the real function, for the worker's own cleanup."""
    real = dist.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if group is None and dist.is_initialized():
            caller = sys._getframe(1)
            where = f"destroy_process_group at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
            _send(messages, protocol.Left(where, time.monotonic()))
        real(group)

    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
    return real


def run_rank(spec: WorkerSpec, messages: Connection, out: Connection, err: Connection, stack: Connection) -> None:
    """Everything a rank does, once core/rank/boot.py has given it its own session."""
    _redirect(out, err)
    stacks.install(os.dup(stack.fileno()))  # the launcher can ask where this rank is, even when it blocks in C
    stack.close()
    os.environ.clear()
    os.environ.update(spec.env)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    _fresh_random_state()
    # as under torchrun, fn's own multiprocessing (DataLoader workers, ...) gets the
    # platform's default start method, not the forkserver this worker came from
    multiprocessing.set_start_method(None, force=True)
    ctx = spec.ctx
    _send(messages, protocol.Started(os.getpid(), threading.get_ident()))
    # which collective this rank has reached, for the launcher's watchdog and straggler count (core/rank/recorder.py)
    reader = recorder.Reader.start(lambda report: _send(messages, report), spec.env, spec.timeout)
    destroy = _tell_leaving(messages)
    if spec.banner:
        print(spec.banner, flush=True)
    code = 0
    try:
        fn, args, kwargs, sources = cloudpickle.loads(spec.payload)
        linecache.cache.update(sources)  # notebook cells' lines, for tracebacks
        if ctx.device.startswith("cuda"):
            torch.cuda.set_device(ctx.device)  # before init: else every rank lands on cuda:0
            if spec.numa_binding is not None:
                _bind_near(int(ctx.device.partition(":")[2]), spec.numa_binding)
        store = _round_store(spec) if spec.init_group or spec.roll is not None else None
        if spec.roll is not None:
            if (refused := _roll_call(spec.roll, ctx.rank, store, f"{spec.store_addr}:{spec.store_port}")) is not None:
                _send(messages, refused)
                raise _Refused
            _send(messages, protocol.Joined())  # through node 0's store: it answered (a script's group is its own)
        if spec.init_group:
            _init_group(spec, store)
            _send(messages, protocol.Joined())
        store = None  # a script makes its own connection (env://)
        result = fn(ctx, *args, **kwargs)
        _send(messages, protocol.Result(outcome.pickled(ctx.rank, result), time.monotonic()))
    except _Refused:
        code = 2  # bad input: the launcher says why (protocol.Refused)
    except SystemExit as e:
        code = outcome.exit_code(e)
        _send(messages, outcome.failure(ctx, _user_traceback(e)) if code
              else protocol.Result(cloudpickle.dumps(None), time.monotonic()))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the launcher
        _send(messages, outcome.failure(ctx, _user_traceback(e), spec.init_group))
        code = 1
    finally:
        if reader is not None:
            reader.stop()
        if dist.is_initialized():
            # Kept referenced, the group's C++ object is never freed in a forked rank, which ends in os._exit: the
            # backends are shut down all the same (destroy_process_group calls their shutdown()), but gloo's
            # destructor, which joins its threads after their 10 ms polls (20 ms a rank, measured), is not waited
            # for on the way out.
            _GROUPS_LEFT.append(dist.group.WORLD)
            destroy()
        left = _wait_for_leftovers(ctx.rank, threads_too=spec.init_group)
        _stop_descendants()
        sys.stdout.flush()
        sys.stderr.flush()
        _c_stdio("fflush")
    if left:
        os._exit(code)  # the normal exit would join the threads left; the launcher reaps what they leave
    if code:
        sys.exit(code)
