"""``--dashboard``: the live view of ``mpddp top`` as a small web page, served by the launcher while the job runs.

Owns: :func:`serving` (the page's server for the block: bound before any rank starts, its URL said in one line,
gone at the end), what it answers (the page and its script and style from web/, ``/snapshot.json``, the same
:class:`~mpddp.core.launcher.live.Snapshot` JSON as ``mpddp top --json``, ``/timeline.json``, every rank's arrival
lags of the last minutes, the whole job's, the live form of ``--timeline``'s picture, and ``/look.json``, both from
one moment, which the page reads), and who may read it
(:func:`refusal`): a page on 127.0.0.1 answers requests addressed to this machine's loopback names only (a web page
elsewhere cannot read it by pointing a name of its own at 127.0.0.1); one on another address (--dashboard-remote)
needs the launcher's random token in the URL. Read-only: GET alone; no request signals, stops or changes the job.
Why the standard library's http.server: a page and two JSON reads a second need no framework, and nothing is added
to the install. Why a thread blocked in ``accept()`` and not ``serve_forever()`` (which wakes every half second):
while nobody loads the page, nothing runs.
Leaves the address's rules to dashboard_options.py, the rows and every node's part to core/launcher/live.py, the
lags, the rule that names a straggler and the timeline to core/launcher/stragglers.py, and the drawing to the page
(web/dashboard.js).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import importlib.resources
import json
import secrets
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ... import dashboard_options
from ...config import LaunchConfig
from ...errors import ConfigError
from ...log import logger
from .live import LiveView

_STOP_WAIT = 5.0  # seconds the end of a job waits for the page's thread (it leaves accept() at once)
_FILES = {"/": ("index.html", "text/html"), "/index.html": ("index.html", "text/html"),
          "/dashboard.js": ("dashboard.js", "text/javascript"), "/dashboard.css": ("dashboard.css", "text/css")}
_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                                                                  "frame-ancestors 'none'"}


@dataclass(frozen=True)
class Page:
    """What the server needs: where it listens, the token (None on 127.0.0.1), the files, and the two reads."""

    token: str | None
    files: dict[str, bytes]
    snapshot: Callable[[], str]
    timeline: Callable[[], str]
    look: Callable[[], str]  # both, from one moment: what the page reads


@contextlib.contextmanager
def serving(config: LaunchConfig, live: LiveView) -> Iterator[str | None]:
    """The page of this launcher's job while the block runs (its URL; None without ``--dashboard``). An address
    that cannot be bound is :class:`ConfigError` now, before any rank starts."""
    if config.dashboard is None:
        yield None
        return
    token = secrets.token_urlsafe(24) if config.dashboard_remote else None
    page = Page(token, _files(token), lambda: live.snapshot().to_json(), lambda: json.dumps(live.timeline()),
                lambda: _look(live))
    server = _bind(config.dashboard, page)
    url = _url(server, token)
    thread = threading.Thread(target=_serve, args=(server,), name="mpddp-dashboard", daemon=True)
    thread.start()
    logger.info("mpddp: the dashboard of this job: %s", url)
    try:
        yield url
    finally:
        with contextlib.suppress(OSError):
            server.socket.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        server.server_close()
        thread.join(_STOP_WAIT)  # gone before the launch returns, as its other threads


class _Server(ThreadingHTTPServer):
    """One thread a request (a browser keeps idle connections open: one must not hold up the next)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, page: Page) -> None:
        self.address_family, self.page = family, page
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        """http.server's, less its reverse lookup of the host (a slow DNS would hold up the start)."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("mpddp: a dashboard request failed", exc_info=True)  # a browser gone: the job goes on


def _bind(address: str, page: Page) -> _Server:
    host, port = dashboard_options.split(address)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise ConfigError(f"dashboard={address!r}: the host {host!r} is not known ({e.strerror}); pass an address of "
                          "this machine, e.g. --dashboard 127.0.0.1:8265") from None
    try:
        return _Server((host, port), family, page)
    except OSError as e:
        fix = ("another program listens there: pick another port, or auto" if e.errno == errno.EADDRINUSE else
               "it is no address of this machine: pass one of its addresses, or 0.0.0.0 for every interface")
        raise ConfigError(f"dashboard={address!r} cannot be served ({e.strerror}): {fix}") from None


def _url(server: _Server, token: str | None) -> str:
    host, port = server.server_name, server.server_port
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()  # every interface: a name the other machines may know
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/" + (f"?token={token}" if token else "")


def _files(token: str | None) -> dict[str, bytes]:
    """The page's files, read once (a broken install fails here, before any rank starts); the page's links carry
    the token, so that its script and style load too."""
    web = importlib.resources.files(__package__).joinpath("web")
    files = {name: web.joinpath(name).read_bytes() for name, _ in _FILES.values()}
    files["index.html"] = files["index.html"].replace(b"__QUERY__", f"?token={token}".encode() if token else b"")
    return files


def _serve(server: _Server) -> None:
    """Every connection, until the socket is shut: blocked in accept() while nobody loads the page."""
    while True:
        try:
            request, address = server.socket.accept()
        except OSError:
            return
        try:
            server.process_request(request, address)
        except Exception:  # noqa: BLE001 - no thread for it: that request is dropped, the job goes on
            server.shutdown_request(request)


def refusal(token: str | None, given: str | None, host_header: str | None) -> HTTPStatus | None:
    """Why a request may not read the page (403), or None. With a token: the token, compared in constant time.
    Without (127.0.0.1): a request addressed to a loopback name, so that a site whose name points at 127.0.0.1
    (DNS rebinding) cannot read the job from a browser of this machine."""
    if token is not None:
        return None if hmac.compare_digest((given or "").encode(), token.encode()) else HTTPStatus.FORBIDDEN
    host = (host_header or "").strip()
    host = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] if ":" in host else host
    return None if host and dashboard_options.is_local(host) else HTTPStatus.FORBIDDEN


class _Handler(BaseHTTPRequestHandler):
    """GET only: the page's files and its two reads; every other method is 405."""

    server: _Server
    timeout = 10  # seconds an idle connection keeps its thread
    server_version, sys_version = "mpddp", ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        page = self.server.page
        if refusal(page.token, parse_qs(url.query).get("token", [None])[0], self.headers.get("Host")) is not None:
            return self._send(HTTPStatus.FORBIDDEN, b"forbidden: this page needs its URL as the launcher printed it\n")
        if url.path in _FILES:
            name, kind = _FILES[url.path]
            return self._send(HTTPStatus.OK, page.files[name], kind)
        read = {"/snapshot.json": page.snapshot, "/timeline.json": page.timeline, "/look.json": page.look}.get(url.path)
        if read is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n")
        try:
            body = read().encode()
        except Exception as e:  # noqa: BLE001 - a look that failed: the page says so and asks again; the job goes on
            logger.debug("mpddp: a dashboard read failed (%s: %s)", type(e).__name__, e)
            return self._send(HTTPStatus.SERVICE_UNAVAILABLE, b"the launcher could not look just now\n")
        return self._send(HTTPStatus.OK, body, "application/json")

    def _refuse_method(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"read-only: GET alone\n", allow=True)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse_method  # noqa: N815
    do_HEAD = _refuse_method  # noqa: N815

    def _send(self, status: HTTPStatus, body: bytes, kind: str = "text/plain", allow: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in _HEADERS.items():
            self.send_header(name, value)
        if allow:
            self.send_header("Allow", "GET")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        logger.debug("mpddp: dashboard: " + format, *args)  # not a line a request on the launcher's terminal


def _look(live: LiveView) -> str:
    """The snapshot and the whole job's timeline of one moment: the other nodes' parts are read once for both."""
    snapshot = live.snapshot()
    return json.dumps({"snapshot": json.loads(snapshot.to_json()), "timeline": live.timeline()})
