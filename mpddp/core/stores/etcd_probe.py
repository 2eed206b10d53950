"""Whether ``--rdzv-endpoint`` is an etcd this launcher may use: asked once, before the job's first round.

Owns: :func:`check`, the first contact's probe of etcd's HTTP gateway, member by member: its ``/version``
(is it etcd at all?) and one count-only read under the job's prefix (does it let a client without a user
read, or is its authentication on?); :func:`read_version` and :func:`read_range`, which decide from the
HTTP status and the shape of the JSON alone (etcd's gRPC code), never from its words; and the one line of
bad input each refusal becomes. A bare ``etcd3gw`` call would raise a JSON decoder's error, or "Not Found",
as a traceback from deep in the first round.

Leaves the client itself to core/stores/etcd_client.py, and the line for a member that does not answer at
all to core/nodes/etcd.py's first contact (this module raises :class:`RendezvousGone` for it).
"""

from __future__ import annotations

import base64
import enum
import time
from dataclasses import dataclass
from typing import Any

from ...errors import AddressError, RendezvousGone
from ...rendezvous_options import parse_endpoints

_REQUEST_TIMEOUT = 2.0  # seconds one request to one member may take (etcd_client.py's)
# gRPC codes etcd's gateway answers a well-formed read with when authentication is on: INVALID_ARGUMENT (no
# user name was given: the request itself is well-formed, so nothing else makes it), PERMISSION_DENIED (the
# user may not read the key), UNAUTHENTICATED (a token that is not valid)
_REFUSED = {3: "INVALID_ARGUMENT, no user given", 7: "PERMISSION_DENIED", 16: "UNAUTHENTICATED"}
# gRPC codes of a member that cannot serve a read now (no leader, no quorum): another member, or later, may
_NOT_NOW = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE


class Answer(enum.Enum):
    """What one member's answer says."""

    ETCD = "etcd"  # etcd, and it lets this launcher read
    NOT_ETCD = "not-etcd"  # something answers HTTP there, but not as etcd's gateway does
    AUTH = "auth"  # etcd with authentication on: a launcher with no user is refused
    SILENT = "silent"  # no answer (refused, timed out), or none now (a member without its cluster)


@dataclass(frozen=True)
class Reading:
    """One member's answer, and what was seen, for the line (``HTTP 404 on /version``)."""

    answer: Answer
    seen: str = ""
    api: str = "/v3/"  # the gateway's path, by etcd's version (etcd3gw's rule)


def read_version(status: int, body: Any) -> Reading:
    """``GET /version``: etcd answers 200 and ``{"etcdserver": "3.4.23", ...}``; anything else is not etcd."""
    if status != 200:
        return Reading(Answer.NOT_ETCD, f"HTTP {status} on /version")
    version = body.get("etcdserver") if isinstance(body, dict) else None
    parts = version.split(".")[:2] if isinstance(version, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return Reading(Answer.NOT_ETCD, "no etcdserver version in the answer to /version")
    major, minor = int(parts[0]), int(parts[1])
    api = "/v3/" if (major, minor) >= (3, 4) else "/v3beta/" if (major, minor) >= (3, 3) else "/v3alpha/"
    return Reading(Answer.ETCD, f"etcd {version}", api)


def read_range(status: int, body: Any) -> Reading:
    """``POST <api>kv/range``: etcd answers 200 and a ``header``, or an error as ``{"code": <gRPC code>, ...}``."""
    if status == 200 and isinstance(body, dict) and "header" in body:
        return Reading(Answer.ETCD)
    code = body.get("code") if isinstance(body, dict) else None
    if not isinstance(code, int):
        return Reading(Answer.NOT_ETCD, f"HTTP {status} on a read, with no gRPC code")
    if code in _REFUSED:
        return Reading(Answer.AUTH, f"gRPC code {code}, {_REFUSED[code]}")
    if code in _NOT_NOW:
        return Reading(Answer.SILENT, f"gRPC code {code}")
    return Reading(Answer.ETCD, f"gRPC code {code}")  # etcd all the same: what it refuses is told later


def check(endpoints: str, tls: dict[str, str], prefix: str, wait: float) -> None:
    """Return once a member of ``endpoints`` answers as etcd and lets this launcher read ``prefix``. A member
    that answers otherwise is bad input, one line (:class:`AddressError`); none that answers within ``wait``
    seconds: :class:`RendezvousGone`."""
    import requests

    deadline = time.monotonic() + wait
    session = requests.Session()
    if "cacert" in tls:
        session.verify = tls["cacert"]
    if "cert" in tls and "key" in tls:
        session.cert = (tls["cert"], tls["key"])
    scheme = "https" if "cacert" in tls else "http"
    try:
        while True:
            for host, port in parse_endpoints(endpoints):
                member = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                timeout = max(0.1, min(_REQUEST_TIMEOUT, deadline - time.monotonic()))
                reading = _ask(session, f"{scheme}://{member}", prefix, timeout)
                if reading.answer is Answer.ETCD:
                    return
                if reading.answer is not Answer.SILENT:
                    raise AddressError(refusal(reading, member, endpoints, prefix))
            if time.monotonic() >= deadline:
                raise RendezvousGone(f"no member of {endpoints} answers")
            time.sleep(0.2)
    finally:
        session.close()


def _ask(session: Any, base: str, prefix: str, timeout: float) -> Reading:
    """One member's two answers: its ``/version``, then a count-only read of ``prefix`` (linearizable: a
    member that lags behind the one that turned authentication on must not answer for the cluster)."""
    import requests

    try:
        answer = session.get(base + "/version", timeout=timeout)
        reading = read_version(answer.status_code, _json(answer))
        if reading.answer is not Answer.ETCD:
            return reading
        key = prefix.encode()
        body = {"key": _b64(key), "range_end": _b64(key[:-1] + bytes([key[-1] + 1])), "count_only": True}
        answer = session.post(base + reading.api + "kv/range", json=body, timeout=timeout)
        return read_range(answer.status_code, _json(answer))
    except requests.exceptions.RequestException:  # refused, timed out, reset, TLS refused: no answer
        return Reading(Answer.SILENT)


def _json(answer: Any) -> Any:
    try:
        return answer.json()
    except ValueError:  # HTML, or nothing: not JSON
        return None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def refusal(reading: Reading, member: str, endpoints: str, prefix: str) -> str:
    """The one line for a member that answered, but not as an etcd this launcher may use."""
    if reading.answer is Answer.AUTH:
        return (f"--rdzv-endpoint {endpoints}: the etcd at {member} has authentication on and refuses a read of "
                f"{prefix} from a client without a user ({reading.seen}); mpddp gives no user or password: run the "
                "job on an etcd without authentication (etcdctl auth disable), or give a TLS client certificate "
                "whose common name is a user that may read and write /mpddp/ (--rdzv-conf "
                "cacert=PATH,cert=PATH,key=PATH)")
    return (f"--rdzv-endpoint {endpoints}: {member} answers HTTP, but not as etcd does ({reading.seen}): pass the "
            "client address of the etcd members, host:port (2379 by default), or, for an etcd with TLS, "
            "--rdzv-conf cacert=PATH")
