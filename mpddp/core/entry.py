"""Where a rank's process begins: a target the launcher can name without importing torch.

Owns: the function multiprocessing runs first in every rank. Pickling a
process's target imports the module it lives in (to check it by name), so
a target in core/worker.py, which imports torch, would import torch into the
launcher: about a second of CPU beside the forkserver's own import, and
torch's interpreter teardown when a ``launch()`` script exits. The
forkserver has imported core/worker.py already; under spawn the rank imports
it here. Leaves everything the rank does to core/worker.py, the store
keeper's process to core/keeper.py.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from .protocol import WorkerSpec


def rank(spec: WorkerSpec, messages: Connection, out: Connection, err: Connection, stack: Connection) -> None:
    """The target of every rank's process."""
    from .worker import entry

    entry(spec, messages, out, err, stack)
