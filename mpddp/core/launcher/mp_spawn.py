"""What ``mpddp.spawn`` (core/launcher/api.py) adds to ``launch()`` for ``torch.multiprocessing.spawn``'s contract.

Owns: calling ``fn(i, *args)``, ``i`` the process's index as an int, with
no process group made for it (``fn`` makes its own, as under
``mp.spawn``), and ``join=False``'s context. What it adds to
``mp.spawn``: the failure report (which process failed first, where, what
the others did), the teardown of every process tree (DataLoader workers
too), safety in a notebook, the hang watchdog, and every process's return
value (``mp.spawn`` returns None). Leaves the signature and everything
else to core/launcher/api.py's ``spawn`` and ``launch``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


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
