"""The rendezvous options, with torchrun's names: which backend keeps what the nodes agree on, and its settings.

Owns: checking ``--rdzv-backend``, ``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf`` and ``--local-addr``
with ``--nnodes MIN:MAX`` (config.py calls :func:`check`), c10d's endpoint as node 0's address and port
(:func:`endpoint_as_master`, for config.py and core/launcher/api.py's ``make_config``), and
:class:`RdzvSettings`, what ``--rdzv-conf key=value,...`` may say. ``c10d`` (node 0's launcher hosts the
store) is the default and needs nothing; ``static`` is torchrun's name for its fixed size; ``etcd`` needs the
members of an etcd cluster and a job id, and survives the loss of any node.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import ConfigError


class _Options(Protocol):
    """The launch options :func:`check` reads (config.py's LaunchConfig has them all)."""

    @property
    def rdzv_backend(self) -> str: ...
    @property
    def rdzv_endpoint(self) -> str | None: ...
    @property
    def rdzv_id(self) -> str | None: ...
    @property
    def rdzv_conf(self) -> str | None: ...
    @property
    def min_nnodes(self) -> int: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def hosts(self) -> tuple[str, ...] | None: ...

RDZV_BACKENDS = ("c10d", "static", "etcd")  # static: torchrun's name for c10d's fixed membership
# whether node 0's launcher hosts the job's store for every round at --master-addr:--master-port (else each round's
# first node hosts that round's, on a port of its own): asked before any backend is open, and kept equal to each
# backend's ``hosts_round_store`` by tests/test_architecture.py
_NODE_0_HOSTS = {"c10d": True, "static": True, "etcd": False}


def node_0_hosts_store(backend: str) -> bool:
    """Node 0's launcher hosts the job's store at a port every node knows in advance (``--master-port``); else the
    backend places each round's store, and node 0 is no node in particular."""
    return _NODE_0_HOSTS[backend]
C10D_PORT = 29400  # torchrun's port for a c10d --rdzv-endpoint without one
DEFAULT_TTL = 3  # seconds: a lost node's keys are gone this long after its last refresh (every TTL/3)
DEFAULT_LAST_CALL = 3.0  # seconds a round of MIN..MAX nodes waits for a newcomer before it starts without


@dataclass(frozen=True)
class RdzvSettings:
    """What ``--rdzv-conf`` says, with the defaults for what it does not."""

    ttl: int = DEFAULT_TTL
    last_call_timeout: float = DEFAULT_LAST_CALL
    tls: dict[str, str] = field(default_factory=dict)  # cacert, cert, key: torchrun's etcd names


def parse_rdzv_conf(text: str | None) -> RdzvSettings:
    """``key=value,key=value`` (torchrun's form) as settings; an unknown key or a bad value is bad input."""
    values: dict[str, str] = {}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        key, equals, value = part.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"rdzv_conf={text!r}: {part!r} is not key=value; pass e.g. "
                              "--rdzv-conf last_call_timeout=5,ttl=3")
        values[key.strip()] = value.strip()
    for name in ("join_timeout", "timeout"):
        if name in values:
            raise ConfigError(f"rdzv_conf {name}={values[name]}: --timeout is how long the nodes wait to meet here; "
                              f"pass --timeout {values[name]}")
    known = ("ttl", "lease_ttl", "last_call_timeout", "cacert", "cert", "key")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"rdzv_conf key {unknown[0]!r} is not known: use {', '.join(known)}")
    ttl = _number(values, ("ttl", "lease_ttl"), DEFAULT_TTL, 2, 3600, int)
    last_call = _number(values, ("last_call_timeout",), DEFAULT_LAST_CALL, 0, 3600, float)
    tls: dict[str, str] = {k: values[k] for k in ("cacert", "cert", "key") if k in values}
    if ("cert" in tls) != ("key" in tls):
        raise ConfigError("rdzv_conf gives cert or key alone: a client certificate needs both, cert=PATH,key=PATH")
    return RdzvSettings(int(ttl), float(last_call), tls)


def _number(values: dict[str, str], keys: tuple[str, ...], default: float, low: float, high: float,
            kind: type[int] | type[float]) -> float:
    for key in keys:
        if key in values:
            try:
                number = kind(values[key])
            except ValueError:
                number = None
            if number is None or not low <= number <= high:
                raise ConfigError(f"rdzv_conf {key}={values[key]!r} is not allowed: it must be a number of seconds "
                                  f"from {low:g} to {high:g}, e.g. {key}={default:g}")
            return number
    return default


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (a scheme, ``http://``, is allowed and dropped) as (host, port) pairs."""
    found = []
    for part in (p.strip() for p in text.split(",")):
        bare = part.split("://", 1)[-1].rstrip("/")
        host, colon, port = bare.rpartition(":")
        if not part or not colon or not port.isdigit() or not host:
            raise ConfigError(f"--rdzv-endpoint {text!r}: {part!r} is not HOST:PORT of an etcd member; pass the "
                              "members as host:port, comma-separated, e.g. etcd1:2379,etcd2:2379")
        found.append((host.strip("[]"), int(port)))
    return found


def parse_nnodes_range(spec: str) -> tuple[int, int] | None:
    """torchrun's ``MIN:MAX`` as (MIN, MAX); None when ``spec`` is no range."""
    low, colon, high = spec.strip().partition(":")
    if not colon or not (low.isdigit() and high.isdigit()):
        return None
    return int(low), int(high)


def check_size(low: int, high: int) -> None:
    """``--nnodes MIN:MAX``: 1 <= MIN <= MAX (``0:2`` is no size: it is refused, not read as 2)."""
    if not 1 <= low <= high:
        fix = f"{max(1, min(low, high))}:{max(low, high, 1)}"
        raise ConfigError(f"nnodes={low}:{high}: the smallest size must be from 1 to the largest; pass e.g. "
                          f"--nnodes {fix}")


def parse_c10d_endpoint(text: str) -> tuple[str, int]:
    """c10d's ``--rdzv-endpoint``: ``host:port``, ``host`` (torchrun's port, 29400) or ``[::1]:port`` as
    (host, port)."""
    host, colon, port = text.strip().rpartition(":")
    if not colon or "]" in port or (host.count(":") and not host.startswith("[")):  # no port, or a bare IPv6
        host, port = text.strip(), str(C10D_PORT)
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit():
        raise ConfigError(f"--rdzv-endpoint {text!r} is not HOST:PORT: pass node 0's address, e.g. node0:29400")
    return host, int(port)


def endpoint_as_master(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with c10d's (and static's) ``rdzv_endpoint`` as node 0's ``master_addr`` and ``master_port``,
    the place where its launcher hosts the store (etcd's endpoint names its cluster: kept). A value that is
    None, or absent, was not given; an endpoint and a master that disagree are refused."""
    endpoint, backend = options.get("rdzv_endpoint"), options.get("rdzv_backend")
    if endpoint is None or backend not in (None, "c10d", "static"):
        return dict(options)
    folded = {**options, "rdzv_endpoint": None}
    for name, value in zip(("master_addr", "master_port"), parse_c10d_endpoint(endpoint)):
        if options.get(name) is not None and options[name] != value:
            raise ConfigError(f"--rdzv-endpoint {endpoint} and --{name.replace('_', '-')} {options[name]} both say "
                              "where node 0 is, and disagree: pass one of them")
        folded[name] = value
    return folded


def check(config: _Options) -> None:
    """Raise ConfigError for rendezvous options that contradict each other, before anything starts."""
    backend = config.rdzv_backend
    if backend not in RDZV_BACKENDS:
        raise ConfigError(f"rdzv_backend={backend!r} is unknown: use c10d (node 0 hosts the store, the default), "
                          "static (c10d with a fixed size) or etcd (an etcd cluster keeps the job: it survives the "
                          "loss of any node)")
    parse_rdzv_conf(config.rdzv_conf)
    check_size(config.min_nnodes, config.nnodes)
    if backend == "static" and config.min_nnodes < config.nnodes:
        raise ConfigError(f"rdzv_backend='static' is a fixed number of nodes, but nnodes={config.min_nnodes}:"
                          f"{config.nnodes} is a range: pass --nnodes {config.nnodes} (the job waits for all of them), "
                          "or --rdzv-backend c10d for an elastic job")
    if backend != "etcd":
        return
    if not config.rdzv_endpoint:
        raise ConfigError("rdzv_backend='etcd' needs the etcd cluster's members: pass --rdzv-endpoint "
                          "host:2379[,host:2379,...]")
    parse_endpoints(config.rdzv_endpoint)
    if not config.rdzv_id or config.rdzv_id == "none":
        raise ConfigError("rdzv_backend='etcd' needs the job's id, the same on every node and new for each job: "
                          "pass --rdzv-id NAME (e.g. the scheduler's job id)")
    if not config.rdzv_id.isascii():  # etcd3gw sends a key's text as latin-1, and a prefix's end as UTF-8
        raise ConfigError(f"--rdzv-id {config.rdzv_id!r} is not ASCII, and the job's keys in etcd are named after it: "
                          "pass an ASCII name (e.g. the scheduler's job id)")
    if "/" in config.rdzv_id:  # /mpddp/<id>/: "a/i/x" would lie inside job a's keys, and be swept with them
        raise ConfigError(f"--rdzv-id {config.rdzv_id!r} has a '/', and the job's keys in etcd lie under "
                          "/mpddp/<rdzv-id>/ (one with a '/' can lie inside another job's): pass a name without one "
                          "(e.g. the scheduler's job id)")
    if importlib.util.find_spec("etcd3gw") is None:
        raise ConfigError("rdzv_backend='etcd' needs the etcd3gw package: pip install 'mpddp[etcd]'")
    if config.hosts is not None:
        raise ConfigError("--hosts starts the nodes itself with node 0 as the store's host: drop --hosts, or "
                          "--rdzv-backend etcd and start a launcher on each machine")
