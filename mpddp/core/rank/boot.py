"""Where every process the launcher starts begins, before it imports torch.

Owns: the targets multiprocessing runs first in a rank's process (and in the store server's), what of the
launcher's ``__main__`` such a process imports, its own session, so that the terminal's Ctrl-C reaches the launcher
only, and its parent-death signal, both taken before anything slow: under spawn a process imports torch for a second
or more, and a Ctrl-C in that time would print its traceback beside the launcher's report.

Why the targets live here, in a module without torch: pickling a process's target imports the module it lives in
(to check it by name), so a target in core/rank/worker.py would import torch into the launcher, about a second of
CPU beside the forkserver's own import, and torch's interpreter teardown when a ``launch()`` script exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from ..wire.protocol import WorkerSpec
from ..wire.signals import LAUNCHER_GONE, on_parent_death
from .forkserver import interrupts_as_before


def rank_process(spec: WorkerSpec, messages: Connection, out: Connection, err: Connection, stack: Connection) -> None:
    """The target of every rank's process."""
    detach(spec.close_fds, parent=spec.parent)
    from .worker import run_rank

    run_rank(spec, messages, out, err, stack)


def detach(close_fds: tuple[int, ...], with_parent: bool = True, parent: int | None = None) -> None:
    """Own session (the terminal's Ctrl-C goes to the launcher only) and, ``with_parent``, die with the parent.

    ``parent``: the pid that forked this process. Gone already, it sends no parent-death signal: a rank forked just
    before its forkserver was killed ran on, re-parented to init, unknown to the launcher (multiprocessing got no
    pid), and waited --timeout for the store, with multiprocessing's resource tracker held open, and the launcher's
    stdout with it (measured: a test's run of the launcher hung past its end). It exits instead.
    """
    os.setsid()
    if with_parent:
        die_with_parent()
        if parent is not None and os.getppid() != parent:
            os._exit(1)
    signal.signal(LAUNCHER_GONE, signal.SIG_DFL)  # the forkserver's handler, inherited by the fork
    interrupts_as_before()  # and SIGINT as the launcher had it (the forkserver ignores it)
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process the moment its parent dies."""
    on_parent_death(signal.SIGKILL)


@contextlib.contextmanager
def main_hidden(always: bool) -> Iterator[None]:
    """Hide ``__main__`` from multiprocessing while a process starts (call under the attempt's start lock, LIVE_LOCK).

    A started process re-imports ``__main__`` from its file or module name, as
    multiprocessing does. ``always``: the store server, which runs none of the
    user's code (a script's top level can import, print or take seconds).
    Else only a ``__main__`` with no such file (``python - < script``, an
    embedded interpreter), which would make every rank die before it starts;
    ``fn`` travels by value, so a rank does not need it.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    orphan = path is not None and not os.path.isfile(path) and getattr(main, "__spec__", None) is None
    if main is None or not (always or orphan):
        yield
        return
    saved: dict[str, Any] = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # multiprocessing reads it; None: no module name to import
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
