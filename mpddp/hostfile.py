"""DeepSpeed's hostfile, as ``--hostfile`` reads it: the machines of a job, one a line, with their slots."""

from __future__ import annotations

import re

from .errors import ConfigError


def parse_hostfile(path: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """DeepSpeed's hostfile: ``host [slots=N]`` a line, ``#`` comments -> (hosts, slots or None)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.split("#")[0].split() for line in f]
    except OSError as e:
        raise ConfigError(f"hostfile={path!r} cannot be read ({e.strerror}): pass a file of host names, one a line") \
            from e
    hosts, slots = [], []
    for n, parts in enumerate(lines, 1):
        if not parts:
            continue
        extra = [p for p in parts[1:] if not re.fullmatch(r"slots=[1-9][0-9]*", p)]
        if extra:
            raise ConfigError(f"hostfile={path!r} line {n}: {' '.join(parts)!r} is not 'host' or 'host slots=N'")
        hosts.append(parts[0])
        slots += [int(p.split("=")[1]) for p in parts[1:]]
    if slots and len(slots) != len(hosts):
        raise ConfigError(f"hostfile={path!r} gives slots=N for some hosts only: give it for every host, or none")
    return tuple(hosts), (tuple(slots) if slots else None)
