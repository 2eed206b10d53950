"""mpddp's voice outside the reports: the ``mpddp`` logger.

Owns: the one :mod:`logging` logger every layer uses for warnings and notices (a busy GPU, a restart), and
``console``, its handler: the bare message on the *current* ``sys.stderr`` (so a Jupyter cell shows it). Why
``logging``, not ``warnings`` (which is for what code can fix, and shows a message once only): these are events of
a run, and an application routes or silences them as it does every library's.

Why a handler of its own, not the logging guide's ``NullHandler``: with logging unconfigured (a script, a notebook)
that would drop every INFO notice. The logger still propagates (root handlers and ``caplog`` see every record), and
``console`` steps aside only when a handler on the record's path writes to the process's stdout or stderr (as
``logging.basicConfig()`` makes), the one case where it would double a line; one that captures or routes records
elsewhere (a file, pytest's capture handlers, which pytest 9 attaches to every non-propagating logger) does not
count. Silence: ``logging.getLogger("mpddp").setLevel(logging.ERROR)``; take over:
``logging.getLogger("mpddp").removeHandler(mpddp.log.console)``.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("mpddp")


class _Console(logging.Handler):
    """Prints the message alone on the current ``sys.stderr`` unless another handler already prints it there."""

    def emit(self, record: logging.LogRecord) -> None:
        if _printed_elsewhere():
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stream: nothing more to say
            pass


def _printed_elsewhere() -> bool:
    """Whether a handler other than ours on the record's path writes to this process's stdout or stderr."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(h is not console and _writes_to_console(h) for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _writes_to_console(handler: logging.Handler) -> bool:
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    stream = handler.stream
    if any(stream is s for s in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)):
        return True
    try:
        return stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):  # StringIO and other in-memory streams have no descriptor
        return False


# One console per process, also when this module is loaded again (importlib.reload, a notebook's autoreload).
for _old in [h for h in logger.handlers if type(h).__qualname__ == _Console.__qualname__]:
    logger.removeHandler(_old)
console = _Console()
console.setFormatter(logging.Formatter("%(message)s"))
logger.addHandler(console)
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)  # notices such as "restarting the group" are shown by default
