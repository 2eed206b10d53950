"""``mpddp.spawn``: ``torch.multiprocessing.spawn``'s signature and contract, on mpddp's launcher.

Owns: calling ``fn(i, *args)`` in ``nprocs`` processes, ``i`` the process's
index as an int, with no process group made for it (``fn`` makes its own,
as under ``mp.spawn``), and ``join=False``'s context. What it adds to
``mp.spawn``: the failure report (which process failed first, where, what
the others did), the teardown of every process tree (DataLoader workers
too), safety in a notebook, the hang watchdog, and every process's return
value (``mp.spawn`` returns None). Leaves everything else to
:func:`mpddp.core.api.launch`, which it calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..context import WorkerContext
from ..errors import ConfigError


class ByIndex:
    """``fn(i, *args)`` for the user, ``fn(ctx, *args)`` for mpddp: mp.spawn's first argument is the index."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, ctx: WorkerContext, *args: Any) -> Any:
        return self.fn(ctx.local_rank, *args)


class SpawnContext:
    """What ``spawn(..., join=False)`` returns: the launch runs in a thread; :meth:`join` waits for it."""

    def __init__(self, run: Callable[[], list[Any]]) -> None:
        self.values: list[Any] | None = None  # every process's return value, once joined
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), name="mpddp-spawn", daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], list[Any]]) -> None:
        try:
            self.values = run()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by join()
            self._error = e

    def join(self, timeout: float | None = None) -> bool:
        """True once every process ended well; False if ``timeout`` passed first; raises the failure, as
        ``torch.multiprocessing.ProcessContext.join`` does (here mpddp's :class:`~mpddp.WorkerFailed`)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self._error is not None:
            raise self._error
        return True


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str | None = None, **options: Any) -> list[Any] | SpawnContext:
    """``torch.multiprocessing.spawn``, with mpddp's launcher underneath: ``fn(i, *args)`` in ``nprocs``
    processes, ``i`` from 0; ``fn`` makes its own process group, as under mp.spawn.

    ``join=True`` waits and returns every process's value (mp.spawn returns None); ``join=False`` returns a
    context whose ``join(timeout=None)`` waits. ``daemon`` is accepted for the signature: mpddp's processes
    never outlive the launcher either way, and may start processes of their own (DataLoader workers).
    ``start_method``: None is mpddp's forkserver (fast: torch is imported once); "spawn" and "fork" as in
    mp.spawn. ``options``: any :class:`~mpddp.LaunchConfig` field (``timeout``, ``max_restarts``, ...).
    """
    from .api import launch, make_config

    if not callable(fn):
        raise ConfigError(f"fn={fn!r} is not callable: pass a function such as `def main(rank, world_size): ...`")
    if not isinstance(join, bool) or not isinstance(daemon, bool):
        raise ConfigError(f"join={join!r}, daemon={daemon!r}: both are True or False, as in torch.multiprocessing.spawn")
    if not isinstance(args, (tuple, list)):
        raise ConfigError(f"args={args!r} is not a tuple: pass fn's extra arguments as a tuple, e.g. args=({args!r},)")
    if start_method is not None:
        options["start_method"] = start_method
    config = make_config({**options, "nprocs": nprocs})  # bad input: one line now, also with join=False

    def run() -> list[Any]:
        return launch(ByIndex(fn), args=tuple(args), init_process_group=False, config=config)

    return run() if join else SpawnContext(run)
