"""Which interface reaches the master, and the Gloo/NCCL variables derived from it."""

from __future__ import annotations

import socket
import time

import psutil
import pytest

from mpddp.errors import ConfigError
from mpddp.machine import netif

pytestmark = pytest.mark.timeout(30)


def _an_address_not_on_lo() -> tuple[str, str] | None:
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if name != "lo" and addr.family == socket.AF_INET:
                return name, addr.address
    return None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.5"])
def test_loopback_master_is_reached_through_lo(host: str) -> None:
    assert netif.interface_to(host, 29500) == "lo"


def test_own_address_maps_to_its_interface() -> None:
    found = _an_address_not_on_lo()
    if found is None:
        pytest.skip("this machine has no IPv4 address outside lo")
    name, address = found
    assert netif.interface_of(address) == name
    assert netif.interface_to(address) == name


def test_address_of_no_interface() -> None:
    assert netif.interface_of("203.0.113.77") is None  # TEST-NET-3: no machine holds it


@pytest.mark.parametrize(("host", "ip"), [("10.99.0.1", "10.99.0.1"), ("[::1]", "::1"), ("localhost", "127.0.0.1")])
def test_resolve(host: str, ip: str) -> None:
    assert netif.resolve(host) == ip


def test_unresolvable_name_fails_fast_with_the_fix() -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError,
                       match=r"master address 'no-such-host\.invalid' does not resolve .*check /etc/hosts.*"
                             r"pass node 0's IP address as --master-addr"):
        netif.resolve("no-such-host.invalid")
    assert time.monotonic() - start < netif.RESOLVE_TIMEOUT + 1


def test_slow_resolver_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: time.sleep(5))
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"master address 'gpu01' did not resolve within 0\.2 s: check /etc/hosts"):
        netif.resolve("gpu01", timeout=0.2)
    assert time.monotonic() - start < 1.5


def test_unreachable_master(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(self: socket.socket, address: object) -> None:
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    with pytest.raises(ConfigError, match=r"master address 10\.1\.2\.3 is not reachable from this machine "
                                          r"\(Network is unreachable\).*ip route get 10\.1\.2\.3"):
        netif.source_address("10.1.2.3", 29500)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}),
        ({"GLOO_SOCKET_IFNAME": "eth9"}, {"NCCL_SOCKET_IFNAME": "lo"}),
        ({"NCCL_SOCKET_IFNAME": "ib0"}, {"GLOO_SOCKET_IFNAME": "lo"}),
        ({"GLOO_SOCKET_IFNAME": "eth9", "NCCL_SOCKET_IFNAME": "ib0"}, {}),
        ({"GLOO_SOCKET_IFNAME": ""}, {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}),
    ],
)
def test_interface_env_leaves_user_choices_alone(environ: dict[str, str], expected: dict[str, str]) -> None:
    assert netif.interface_env("127.0.0.1", environ, 29500) == expected


def test_interface_env_skips_the_lookup_when_both_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netif, "interface_to", lambda *a: pytest.fail("looked up an interface"))
    assert netif.interface_env("unresolvable", {"GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"}) == {}


def test_interface_env_unresolvable_master() -> None:
    with pytest.raises(ConfigError, match="master address 'no-such-host.invalid' does not resolve"):
        netif.interface_env("no-such-host.invalid", {})
