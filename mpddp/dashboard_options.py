"""``--dashboard``'s address, and who may load the page: pure rules, checked once in config.py.

Owns: :func:`parse` (``auto``, ``PORT``, ``HOST:PORT`` or ``launch(dashboard=True/8080/"HOST:PORT")`` as one
canonical ``HOST:PORT``), :func:`split` (it back to a host and a port), :func:`command_line_form` (the word after a
bare ``--dashboard``, told at once when it is no address: the script, most likely), :func:`is_local` and the rule that
an address other machines can reach needs ``--dashboard-remote`` (the page's URL then carries a random token). Why a
flag and not a default token: the page shows what every rank prints; opening it beyond this machine must be said. Leaves
binding the address (a port taken, a host not of this machine) and the token to core/launcher/dashboard.py.
"""

from __future__ import annotations

import ipaddress

from .errors import ConfigError

LOCAL = "127.0.0.1"
BARE = "auto"  # `--dashboard` given alone (followed by another option, or last on the line)
_FIX = "pass --dashboard auto (127.0.0.1, a free port), PORT or HOST:PORT, e.g. --dashboard 8265"


def parse(value: object, remote: bool) -> str | None:
    """The dashboard's address as ``HOST:PORT`` (an IPv6 host in brackets); None: no dashboard. Port 0: the OS
    picks a free one."""
    if value is None or value is False:
        if remote:
            raise ConfigError("dashboard_remote=True without a dashboard: pass --dashboard HOST:PORT too, e.g. "
                              "--dashboard 0.0.0.0:8265, or drop --dashboard-remote")
        return None
    if value is True or value == "auto":
        return f"{LOCAL}:0"
    if isinstance(value, int):
        return f"{LOCAL}:{_port(value, value)}"
    if not isinstance(value, str):
        raise ConfigError(f"dashboard={value!r} is not an address: {_FIX}")
    host, port = split(value)
    if not remote and not is_local(host):
        raise ConfigError(f"dashboard={value!r} listens where other machines can load the page: pass "
                          "--dashboard-remote too (its URL then carries a random token), or keep 127.0.0.1 and "
                          f"reach it with ssh -L {port or 8265}:127.0.0.1:{port or 8265} from your machine")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def command_line_form(value: str | None) -> str | None:
    """The option's word as given on a command line, if it is ``auto``, ``PORT`` or ``HOST:PORT``; else
    :class:`ConfigError`. Why here and not in :func:`parse` alone: a bare ``--dashboard`` before the script takes the
    script's name as its address (click cannot tell them apart), and the command line would then say only that the
    script is missing."""
    if value is None or value == BARE:
        return value
    try:
        split(value)
    except ConfigError:
        raise ConfigError(f"dashboard={value!r} is not PORT or HOST:PORT: --dashboard takes auto, PORT or HOST:PORT; "
                          f"alone (last, or before another option) it means auto, and before the script, write "
                          f"--dashboard auto {value}.") from None
    return value


def split(value: str) -> tuple[str, int]:
    """``"8265"`` -> ``("127.0.0.1", 8265)``; ``"0.0.0.0:8265"``, ``"[::1]:8265"`` -> their host and port."""
    text = value.strip()
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = LOCAL, text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or (":" in host and not text.startswith("[")):
        raise ConfigError(f"dashboard={value!r} is not PORT or HOST:PORT: {_FIX} (an IPv6 host in brackets, "
                          "[::1]:8265; every interface: 0.0.0.0:8265 with --dashboard-remote)")
    return host, _port(int(port), value)


def _port(port: int, value: object) -> int:
    if not 0 <= port <= 65535:
        raise ConfigError(f"dashboard={value!r}: port {port} is out of range: it must be from 0 to 65535 (0: a free "
                          "one); pass e.g. --dashboard 8265")
    return port


def is_local(host: str) -> bool:
    """Only this machine can connect to ``host``: ``localhost`` or a loopback address (no name is looked up)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
