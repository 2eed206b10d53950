"""The launcher: start one worker per local rank, watch them, stop them whole.

Owns: ``launch()`` — turning a :class:`LaunchConfig` into a plan (GPUs,
backend, threads), the start method (a forkserver that preloads torch by
default), the restart loop, and the watch loop that collects results and
failures, decides which rank failed *first*, and tears the group down.
Leaves rank math to ranks.py, the store to rendezvous.py, the worker's side
to worker.py, lines to relay.py and killing to procs.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from .config import LaunchConfig
from .errors import ConfigError, MpddpError, RestartsExhausted, ShipError, WorkerFailed

_FORKSERVER_PRELOAD = ["mpddp.worker"]
_LAYOUT_KEYS = {"nnodes", "node_rank", "master_addr", "master_port"}


def _refuse_bootstrap() -> None:
    """A worker importing a script without a main guard reaches launch() again."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        from .worker import MAIN_GUARD_EXIT

        os._exit(MAIN_GUARD_EXIT)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, quiet about ranks that were killed.

    Every worker shares this process's tracker. A rank killed mid-run (by a
    failure, SIGTERM or Ctrl-C) cannot release its DataLoader's semaphores;
    the tracker unlinks them, so nothing leaks, but would end the report with
    "There appear to be 28 leaked semaphore objects", which only confuses.
    """
    from multiprocessing import resource_tracker

    previous = os.environ.get("PYTHONWARNINGS")
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    os.environ["PYTHONWARNINGS"] = f"{previous},{quiet}" if previous else quiet  # the tracker's only
    try:
        resource_tracker.ensure_running()
    finally:
        if previous is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = previous


def start_forkserver(method: str = "forkserver") -> None:
    """Start the forkserver now, in parallel with whatever this process imports next.

    The forkserver imports torch once, touches no CUDA and runs no torch op,
    so every worker forked from it is as clean as a spawned one, but starts
    in milliseconds. Started before this process imports torch, the two
    imports overlap; commands that import torch themselves before launching
    (``mpddp train``) call this first. Idempotent; a no-op for other methods.
    """
    if method != "forkserver":
        return
    # the stdlib's context: importing torch.multiprocessing would import all of torch first
    multiprocessing.get_context(method).set_forkserver_preload(_FORKSERVER_PRELOAD)
    from multiprocessing import forkserver

    # read by mpddp.worker when the forkserver imports it (see there); a literal,
    # since importing mpddp.worker here would import torch first
    os.environ["MPDDP_FORKSERVER_PARENT"] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop("MPDDP_FORKSERVER_PARENT", None)


def _start_context(method: str) -> Any:
    """The multiprocessing context, from ``torch.multiprocessing`` (the stdlib's
    object plus torch's tensor reductions), once the forkserver is running."""
    start_forkserver(method)
    import torch.multiprocessing

    return torch.multiprocessing.get_context(method)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C back while torch is imported, then raise it.

    A KeyboardInterrupt in the middle of ``import torch`` leaves torch half
    imported: measured, the interrupt was then swallowed (the run went on) or
    turned into "cannot load module more than once per process". Nothing has
    started yet, so raising it right after costs nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt("mpddp: interrupted before any worker started")


def launch(
    fn: Callable[..., Any],
    nprocs: int | None = None,
    *,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    config: LaunchConfig | None = None,
    init_process_group: bool = True,
    **options: Any,
) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on every local rank; return their values.

    ``options`` are :class:`LaunchConfig` fields (``nnodes``, ``timeout``,
    ``max_restarts``, ...). ``init_process_group=False`` leaves the process
    group to ``fn`` (torchrun-style code calling ``init_process_group("env://")``).
    The list is in local rank order. If a rank fails,
    the whole group is stopped and :class:`WorkerFailed` names the rank that
    failed first, with its traceback.
    """
    _refuse_bootstrap()
    if not callable(fn):
        raise ConfigError(f"fn={fn!r} is not callable: pass a function such as `def train(ctx): ...`")
    if not isinstance(args, (tuple, list)):
        raise ConfigError(f"args={args!r} is not a tuple: pass fn's extra arguments as a tuple, e.g. args=({args!r},)")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"kwargs={kwargs!r} is not a dict: pass fn's keyword arguments as a dict")
    if nprocs is not None:
        options["nprocs"] = nprocs
    if config is None and not _LAYOUT_KEYS & options.keys():
        from .slurm import apply_slurm

        options = apply_slurm(options)  # under srun, SLURM's layout; unchanged elsewhere
    try:
        config = replace(config, **options) if config is not None else LaunchConfig(**options)
    except TypeError as e:
        raise ConfigError(f"{e}: see help(mpddp.LaunchConfig) for the launch options") from e
    payload = ship(fn, tuple(args), dict(kwargs or {}))
    if config.nnodes > 1:
        from .netif import resolve

        resolve(config.master_addr)  # a bad address: one line now, before any process or torch import
    with _interrupts_deferred():
        mp_context = _start_context(config.start_method)
        from .group import plan_launch, run_group

        plan = plan_launch(config)
    for attempt in range(config.max_restarts + 1):
        try:
            return run_group(plan, mp_context, payload, attempt, init_process_group)
        except KeyboardInterrupt:  # the teardown has already run, in run_group's finally
            raise KeyboardInterrupt("mpddp: interrupted; every worker was stopped") from None
        except WorkerFailed as failure:
            if attempt == config.max_restarts:
                if config.max_restarts:
                    raise RestartsExhausted(
                        f"{failure}\nmpddp: gave up after {config.max_restarts} restart(s) (max_restarts="
                        f"{config.max_restarts}); raise --max-restarts or fix the failure above",
                        failure.rank,
                        failure.failures,
                        exit_code=failure.exit_code,
                    ) from failure
                raise
            print(  # the cause's line, so that a run that recovers still says what went wrong
                f"{str(failure).splitlines()[0]}\nmpddp: restarting the group "
                f"({attempt + 1} of {config.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Unshippable:
    what: str
    error: Exception


def _dumps(value: Any) -> bytes:
    """cloudpickle, but code keeps its file name so worker tracebacks point at it."""
    import copyreg
    import io
    import types

    import cloudpickle

    reduce_code = getattr(cloudpickle.cloudpickle, "_code_reduce", None)

    def code_with_filename(code: types.CodeType) -> Any:
        ctor, fields = reduce_code(code)  # type: ignore[misc]
        return ctor, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = copyreg.dispatch_table.copy()
        dispatch_table.update(cloudpickle.Pickler.dispatch_table)
        if reduce_code is not None:
            dispatch_table[types.CodeType] = code_with_filename

    buffer = io.BytesIO()
    Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


def ship(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bytes:
    """Serialize ``fn`` and its arguments by value, before any worker starts."""
    try:
        return _dumps((fn, args, kwargs, _cell_sources()))
    except Exception as e:
        culprit = _find_unshippable(fn, args, kwargs)
        where = f"{culprit.what} ({culprit.error})" if culprit else str(e)
        raise ShipError(
            f"cannot send {where} to the workers: each worker is a separate process, so everything fn "
            "uses is pickled; create locks, sockets, files and threads inside fn instead"
        ) from e


def _cell_sources() -> dict[str, tuple]:
    """Lines of code typed into Jupyter/IPython cells, which no file holds.

    IPython keeps them in linecache with no mtime; sent along, a worker's
    traceback shows the cell's lines instead of bare line numbers.
    """
    import linecache

    return {name: entry for name, entry in list(linecache.cache.items()) if len(entry) == 4 and entry[1] is None}


def _find_unshippable(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> _Unshippable | None:
    import cloudpickle

    candidates: list[tuple[str, Any]] = [(f"args[{i}]={a!r}", a) for i, a in enumerate(args)]
    candidates += [(f"kwargs[{k!r}]={v!r}", v) for k, v in kwargs.items()]
    closure = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    candidates += [(f"{n}={c.cell_contents!r} (captured by fn)", c.cell_contents) for n, c in zip(names, closure)]
    globs = getattr(fn, "__globals__", {})
    for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
        if name in globs:
            candidates.append((f"global {name}={globs[name]!r} (used by fn)", globs[name]))
    candidates.append((f"fn={fn!r}", fn))
    for what, value in candidates:
        try:
            cloudpickle.dumps(value)
        except Exception as e:
            return _Unshippable(what, e)
    return None


__all__ = ["launch", "ship", "MpddpError"]
