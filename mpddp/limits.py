"""What this machine allows a launch, checked before anything starts.

Owns: whether the launcher's open-file and process limits hold the local ranks (each rank's four pipes
counted), whether a directory can be made and written (a log directory, a run's, a timeline's: walking
up to the part that exists, and refusing file systems that hold no user's directories, such as /proc),
and whether ``--timeline`` can be drawn. Each refusal is a :class:`~mpddp.errors.ConfigError` naming the
value and the fix. Leaves the options themselves to config.py, which calls these checks once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource

from .errors import ConfigError

FDS_PER_RANK = 8  # core/launcher/attempt.py opens 4 pipes a local rank (messages, stdout, stderr, stacks) up front
FD_HEADROOM = 64  # the launcher's own files, sockets and torch's
# File systems where no directory of a user's can be made, whatever os.access says (it says yes to root)
_NO_USER_DIRS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
                           "bpf", "configfs", "efivarfs", "devpts", "fusectl", "binfmt_misc"})


def check_local_ranks(nprocs: int) -> None:
    """Raise ConfigError when this machine's limits cannot hold ``nprocs`` local ranks (before any starts)."""
    files, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = nprocs * FDS_PER_RANK + FD_HEADROOM
    if files != resource.RLIM_INFINITY and need > files:
        most = (files - FD_HEADROOM) // FDS_PER_RANK
        fixes = [f"pass --nprocs {most} or fewer"] if most >= 1 else []
        if hard == resource.RLIM_INFINITY or need <= hard:  # a user may raise the soft limit up to the hard one
            fixes.append(f"raise the limit first with `ulimit -n {need}`")
        raise ConfigError(f"nprocs={nprocs} needs about {need} open files in the launcher ({FDS_PER_RANK} per rank "
                          f"+ {FD_HEADROOM}) but the limit here is {files} (ulimit -n): "
                          f"{', or '.join(fixes) or 'ask for a higher open-file limit (ulimit -Hn)'}")
    processes = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if processes != resource.RLIM_INFINITY and nprocs >= processes:
        raise ConfigError(f"nprocs={nprocs} is more processes than this user may run here ({processes}, "
                          f"ulimit -u): pass --nprocs {max(processes - 1, 1)} or fewer, or raise `ulimit -u`")


def check_dir_creatable(name: str, path: str | os.PathLike[str], example: str) -> None:
    """Raise ConfigError unless ``path`` is, or could be made, a directory this process can write.

    Creates nothing: it walks up to the nearest part of the path that
    exists, which must be a writable directory on a file system that holds
    users' directories.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{name}={path!r} is not a path: pass a directory (created if missing), e.g. {example}")
    shown = os.fspath(path)
    full = probe = os.path.normpath(shown)
    while probe not in ("", ".") and not os.path.lexists(probe):  # up to "/" or the working directory
        probe = os.path.dirname(probe)
    probe = probe or "."
    if not os.path.isdir(probe):
        what = "a file" if os.path.isfile(probe) else "not a directory"
        where = f"is {what}" if probe == full else f"cannot be created: {probe!r} is {what}"
        raise ConfigError(f"{name}={shown!r} {where}: pass a directory (created if missing), e.g. {example}")
    kind = _file_system(probe)
    if kind in _NO_USER_DIRS or not os.access(probe, os.W_OK | os.X_OK):
        why = f"on the {kind} file system" if kind in _NO_USER_DIRS else "read-only, or not yours"
        where = "is not writable" if probe == full else f"cannot be created: {probe!r} is not writable"
        raise ConfigError(f"{name}={shown!r} {where} ({why}): pass a directory you can write, e.g. {example}")


_PICTURES = (".png", ".svg", ".pdf")


def check_timeline(path: str) -> None:
    """``--timeline``: a picture file in a writable directory, and matplotlib to draw it."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"timeline={path!r} is not a file name: pass a picture to write, e.g. timeline.png")
    if not path.lower().endswith(_PICTURES):
        raise ConfigError(f"timeline={path!r} is not a picture file: end its name with {', '.join(_PICTURES)}, "
                          "e.g. timeline.png")
    if os.path.isdir(path):
        raise ConfigError(f"timeline={path!r} is a directory: pass a file name in it, e.g. {path.rstrip('/')}/t.png")
    check_dir_creatable("timeline", os.path.dirname(os.path.abspath(path)), "a directory of yours")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(f"timeline={path!r} needs matplotlib, which is not installed: pip install 'mpddp[plot]' "
                          "(or matplotlib), or drop --timeline")


def _file_system(path: str) -> str | None:
    """The type of the file system that holds ``path`` (``proc``, ``ext4``...), from /proc/self/mounts."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:  # not Linux: os.access alone decides
        return None
    real, best, kind = os.path.realpath(path), "", None
    for point, fs in mounts:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # "\040" is a space
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the deepest mount wins; of equal ones, the last mounted
            best, kind = point, fs
    return kind
