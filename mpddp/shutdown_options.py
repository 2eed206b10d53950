"""torchrun 2.13's shutdown and placement options: pure rules, checked once in config.py.

Owns: the grace a stopped launcher gives its ranks (:func:`grace`: ``--shutdown-timeout``, else
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s, as torchrun), the signals it passes on to them
(:func:`parse_signals`: ``--signals-to-handle``, torchrun's default and spelling), and the names of
``--numa-binding``'s modes (torch/numa/binding.py's ``AffinityMode``, written out: config.py imports no torch).
Leaves catching the signals to core/wire/signals.py, passing them on and waiting to core/launcher/stop.py, and the
binding itself to core/rank/worker.py.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping, Sequence

from .errors import ConfigError

SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_GRACE = 30.0  # seconds, torchrun's (torch/distributed/launcher/api.py)
DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's --signals-to-handle
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode's values
# signals the launcher cannot pass on: no handler sees them, or its own children's ends and pipes ride on them
_NOT_PASSED = {"SIGKILL": "no process can catch it", "SIGSTOP": "no process can catch it",
               "SIGCHLD": "the launcher learns its ranks' ends by it", "SIGPIPE": "a closed pipe raises it"}


def grace(value: object, environ: Mapping[str, str] | None = None) -> float:
    """Seconds between passing a stop on to the ranks and SIGKILL: ``value``, else the environment's, else 30."""
    if value is None:
        text = (os.environ if environ is None else environ).get(SHUTDOWN_ENV)
        if text is None or not text.strip():
            return DEFAULT_GRACE
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{SHUTDOWN_ENV}={text!r} is not a number of seconds: set it to e.g. 30, or unset "
                              "it (30 s)") from None
        name = SHUTDOWN_ENV
    else:
        name = "shutdown_timeout"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a number of seconds >= 0 that the ranks get "
                          "to save and exit after a stop, e.g. 30 (0: SIGKILL at once)")
    return float(value)


def parse_signals(spec: str | Sequence[str | int]) -> tuple[str, ...]:
    """``"SIGTERM,SIGUSR1"`` (or a list of names or numbers) -> ``("SIGTERM", "SIGUSR1")``; ``USR1`` reads as
    ``SIGUSR1``. A name that is no signal, or one the launcher cannot pass on, is one line."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for part in parts:
        name = _signal_name(part)
        if name in _NOT_PASSED:
            raise ConfigError(f"signals_to_handle names {name}, which the launcher cannot pass on to the ranks "
                              f"({_NOT_PASSED[name]}): drop it, e.g. --signals-to-handle SIGTERM,SIGINT,SIGUSR1")
        if name not in names:
            names.append(name)
    if not names:
        raise ConfigError(f"signals_to_handle={spec!r} names no signal: pass e.g. {','.join(DEFAULT_SIGNALS)}")
    return tuple(names)


def _signal_name(part: str | int) -> str:
    if isinstance(part, int) and not isinstance(part, bool):
        try:
            return signal.Signals(part).name
        except ValueError:
            pass
    elif isinstance(part, str):
        text = part.strip().upper()
        name = text if text.startswith("SIG") else "SIG" + text
        if isinstance(getattr(signal, name, None), signal.Signals) and not name.startswith(("SIG_", "SIGRT")):
            return name
    raise ConfigError(f"signals_to_handle holds {part!r}, which is no signal's name: use names such as SIGTERM, "
                      "SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, comma-separated")


def signal_numbers(names: Sequence[str]) -> tuple[int, ...]:
    """The checked names of :func:`parse_signals` as signal numbers."""
    return tuple(int(getattr(signal, name)) for name in names)


def parse_numa(mode: object) -> str | None:
    """``--numa-binding``'s mode, one of torch's; None: no binding."""
    if mode is None:
        return None
    if not isinstance(mode, str) or mode.strip().lower() not in NUMA_MODES:
        raise ConfigError(f"numa_binding={mode!r} is not one of torch's modes: use {', '.join(NUMA_MODES)} "
                          "(node, if in doubt), or drop it")
    return mode.strip().lower()
