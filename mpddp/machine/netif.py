"""Network interfaces: which local interface reaches the master, for Gloo and NCCL.

Owns: resolving the master address (fast, with a deadline), finding the
local source address the kernel would use to reach it (a UDP ``connect``
sends no packet), mapping that address to an interface name, and the
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` additions for the workers'
environment. Leaves to others: writing the workers' environment
(core/launcher/plan.py) and the rendezvous (core/stores/listen.py).

Why: without ``GLOO_SOCKET_IFNAME`` Gloo picks its address from the host
name; where that resolves to 127.0.0.1 (common in /etc/hosts) the ranks on
other machines get "Connection refused" only after the timeout. The
interface that routes to the master is the one the other nodes can reach.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

import psutil

from ..errors import ConfigError

RESOLVE_TIMEOUT = 3.0  # seconds; a resolver with no reachable DNS server would wait 10 s or more
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_FIX = "check /etc/hosts on this machine or pass node 0's IP address as --master-addr"


def _getaddrinfo(host: str, result: list[object]) -> None:
    try:
        result.append(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except OSError as e:
        result.append(e)


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT) -> str:
    """``host`` as an IP address: literals as they are, names looked up within ``timeout`` seconds.

    IPv4 answers come first, as Gloo and NCCL prefer them.
    """
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    result: list[object] = []
    # getaddrinfo has no timeout of its own: run it on a daemon thread and stop waiting.
    worker = threading.Thread(target=_getaddrinfo, args=(host, result), daemon=True)
    worker.start()
    worker.join(timeout)
    if not result:
        raise ConfigError(f"master address {host!r} did not resolve within {timeout:g} s: {_FIX}")
    answer = result[0]
    if isinstance(answer, OSError) or not answer:
        raise ConfigError(f"master address {host!r} does not resolve ({answer}): {_FIX}")
    infos: list[Any] = sorted(answer, key=lambda info: info[0] != socket.AF_INET)  # type: ignore[call-overload]
    return str(infos[0][4][0])


def source_address(ip: str, port: int = 9) -> str:
    """The local address the kernel picks to reach ``ip`` (connecting UDP sends nothing)."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((ip, port or 9))
        except OSError as e:
            raise ConfigError(
                f"master address {ip} is not reachable from this machine ({e.strerror}): "
                "check the address and this machine's routes (`ip route get " + ip + "`)"
            ) from e
        return str(sock.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (e.g. ``lo`` for 127.0.0.1), or None."""
    wanted = ipaddress.ip_address(address.split("%")[0])
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(addr.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    if wanted.is_loopback:  # e.g. 127.0.0.2: Linux answers the whole 127/8 on lo
        return "lo" if "lo" in psutil.net_if_addrs() else None
    return None


def interface_to(master_addr: str, master_port: int = 0) -> str | None:
    """The local interface whose address the kernel uses to reach the master, or None."""
    return interface_of(source_address(resolve(master_addr), master_port))


def interface_env(master_addr: str, environ: Mapping[str, str] | None = None, master_port: int = 0) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for the workers, unless the user set them.

    Empty when both are set already, or when no interface holds the source
    address (Gloo and NCCL then choose as they would without mpddp).
    """
    env = os.environ if environ is None else environ
    missing = [name for name in IFNAME_VARIABLES if not env.get(name)]
    if not missing:
        return {}
    ifname = interface_to(master_addr, master_port)
    return {name: ifname for name in missing} if ifname else {}
