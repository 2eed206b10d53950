"""mpddp's voice outside the reports: the ``mpddp`` logger.

Owns: the one :mod:`logging` logger every layer uses for warnings and
notices (a busy GPU, a restart, threads ``fn`` left running), and its
default: the bare message on the *current* ``sys.stderr`` (so a Jupyter
cell shows it), exactly as a ``print`` would. Why ``logging`` and not
``warnings``: these are events of a run that the caller cannot fix in code
(the ``warnings`` module is for that, and shows each message once only); an
application routes or silences them as it does every library's. Leaves
failure reports, which are exceptions, to errors.py.

The rule under applications that attach handlers (decided, issue 20).
Python's logging guide asks a library to add only a ``NullHandler`` and to
propagate. mpddp propagates, so an application's root handlers and a test
runner's ``caplog`` see every record, but it keeps one handler of its own:
with logging left unconfigured, as in a plain script or a notebook, the
guide's rule would drop every INFO notice ("restarting the group") and
print the warnings through ``lastResort`` only. That handler is a console
of last resort, and the one question it asks is *would this record already
reach the person's console?* It steps aside only when a handler on the
record's path (mpddp's own, then its ancestors' while ``propagate`` holds)
is a stream handler writing to the process's stdout or stderr, as
``logging.basicConfig()`` makes; that is the only case in which printing
would double a line. A handler that captures or routes records elsewhere (a
file, a list, pytest's capture handlers, which pytest 9 also attaches to
every non-propagating logger) is no reason to print nothing. Silence:
``logging.getLogger("mpddp").setLevel(logging.ERROR)``; take over the
output entirely: ``logging.getLogger("mpddp").removeHandler(mpddp.log.console)``.
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
