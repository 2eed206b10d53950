"""mpddp's voice outside the reports: the ``mpddp`` logger.

Owns: the one :mod:`logging` logger every layer uses for warnings and
notices (a busy GPU, a restart, threads ``fn`` left running), and its
default: the bare message on the *current* ``sys.stderr`` (so a Jupyter
cell shows it), exactly as a ``print`` would. Why ``logging`` and not
``warnings``: these are events of a run that the caller cannot fix in code
(the ``warnings`` module is for that, and shows each message once only); an
application routes or silences them as it does every library's. The logger
does not propagate by default (a test runner's or a notebook's root handlers
would otherwise swallow or double them); the default handler steps aside as
soon as the application adds a handler of its own to ``mpddp``, or turns
``propagate`` on while the root logger has handlers. Silence:
``logging.getLogger("mpddp").setLevel(logging.ERROR)``. Leaves failure
reports, which are exceptions, to errors.py.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("mpddp")


class _DefaultHandler(logging.Handler):
    """Prints the message alone on the current ``sys.stderr`` while nobody else handles mpddp's records."""

    def emit(self, record: logging.LogRecord) -> None:
        if _configured_elsewhere():
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stream: nothing more to say
            pass


def _configured_elsewhere() -> bool:
    if any(h is not _handler for h in logger.handlers):
        return True
    return logger.propagate and bool(logging.getLogger().handlers)


_handler = _DefaultHandler()
_handler.setFormatter(logging.Formatter("%(message)s"))
if not any(isinstance(h, _DefaultHandler) for h in logger.handlers):
    logger.addHandler(_handler)
    logger.propagate = False
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)  # notices such as "restarting the group" are shown by default
