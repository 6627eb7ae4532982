"""The job's status page: a small HTTP(S) server in the global server's process.

    GET /status.json          the job now (``StatusBoard.snapshot``)
    GET /history.json?since=N rounds, worker points and evaluations from sequence number N on
    GET /metrics              Prometheus text format (``global_server/prom.py``)
    GET /                     the dashboard (``dashboard.html`` next to this file)

Security follows the gRPC port's: without a job secret it listens on 127.0.0.1 only; with one
it listens where the gRPC port does and every endpoint asks for ``status_token(secret)``
(``Authorization: Bearer <token>``, or ``?token=<token>`` for a browser); with node 0's TLS
certificate it speaks HTTPS.

It can never slow the training: at most ``MAX_REQUESTS`` requests are served at once
(``MAX_PER_CLIENT`` from one address; more get 503 at once) and ``MAX_PER_SECOND`` pages a
second (more get 429), each in a thread of its own with ``TIMEOUT`` s socket timeouts; a
request of more than ``MAX_REQUEST_BYTES``, or not arrived whole within ``REQUEST_DEADLINE`` s,
is cut off; only GET and HEAD are answered. The coordinator's lock is held only to copy what a page shows: O(nodes + workers)
for ``/status.json`` and ``/metrics``, references to immutable rows for ``/history.json``.
"""

from __future__ import annotations

import errno
import hmac
import socket
import ipaddress
import json
import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..files import write_atomic
from ..security import is_loopback
from . import status_token

log = logging.getLogger(__name__)

MAX_REQUESTS = 16  # served at once; more are answered 503
MAX_PER_CLIENT = 8  # of them from one address
MAX_PER_SECOND = 20.0  # pages served per second (a browser asks 2, `lsgd status` 1); more: 429
TIMEOUT = 5.0  # seconds any one socket read or write may wait
MAX_REQUEST_BYTES = 16 * 1024  # request line and headers
REQUEST_DEADLINE = 10.0  # seconds to send them
DASHBOARD = Path(__file__).with_name("dashboard.html")
PORT_FILE = "status.port"  # in RUN_DIR/global
BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\n\r\n{\"error\": \"too many requests at once; try again\"}\n")


class _Capped:
    """A request's input stream, cut off after ``limit`` bytes or past ``deadline``."""

    def __init__(self, raw: Any, limit: int, deadline: float) -> None:
        self.raw, self.left, self.deadline = raw, limit, deadline
        self.exceeded = False

    def _room(self, size: int | None) -> int:
        if self.left <= 0 or time.monotonic() > self.deadline:
            self.exceeded = True
            return 0
        return self.left if size is None or size < 0 else min(size, self.left)

    def readline(self, size: int | None = -1) -> bytes:
        n = self._room(size)
        line = self.raw.readline(n) if n else b""
        self.left -= len(line)
        return line

    def read(self, size: int | None = -1) -> bytes:
        n = self._room(size)
        data = self.raw.read(n) if n else b""
        self.left -= len(data)
        return data

    def close(self) -> None:
        self.raw.close()


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _error(message: str) -> bytes:
    return _json({"error": message}) + b"\n"


class _Handler(BaseHTTPRequestHandler):
    server_version = "lsgd-status"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads
    timeout = TIMEOUT
    server: "_Server"

    def setup(self) -> None:
        # A request must have arrived whole within REQUEST_DEADLINE: a client that trickles
        # its bytes (each read's timeout starts again with every byte) has its socket cut.
        self.parsed = False
        self._cut = threading.Timer(REQUEST_DEADLINE, self._cut_if_unread)
        self._cut.daemon = True
        self._cut.start()
        self.request.settimeout(TIMEOUT)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()  # here, in this request's thread, never in accept()
        super().setup()
        self.rfile = _Capped(self.rfile, MAX_REQUEST_BYTES, time.monotonic() + REQUEST_DEADLINE)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if self.request_version == "HTTP/0.9":  # a 2-word line (or one cut off): answer in 1.0
            self.request_version = "HTTP/1.0"
        if ok and self.rfile.exceeded:
            self._send(431, _error("request too large or too slow"))
            return False
        return ok

    def _cut_if_unread(self) -> None:
        if not self.parsed:
            try:
                self.request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def finish(self) -> None:
        self._cut.cancel()
        super().finish()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self._serve(body=True)

    def do_HEAD(self) -> None:  # noqa: N802 - http.server API
        self._serve(body=False)

    def _send(self, code: int, data: bytes, ctype: str = "application/json",
              body: bool = True, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")  # a ?token= must not leak onward
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _serve(self, body: bool) -> None:
        self.parsed = True
        app: StatusPage = self.server.app
        if self.rfile.exceeded:
            return self._send(431, _error("request too large or too slow"), body=body)
        try:
            url = urlsplit(self.path)
            query = parse_qs(url.query, max_num_fields=8)
        except ValueError:
            return self._send(400, _error("bad query string"), body=body)
        if url.path == "/favicon.ico":
            return self._send(404, b"", body=body)
        if not app.host_allowed(self.headers.get("Host")):
            return self._send(403, _error("without a job secret the status page answers only "
                                          "to http://127.0.0.1 or http://localhost"), body=body)
        if not app.authorized(self.headers.get("Authorization"), query.get("token")):
            return self._send(401, _error("this job's status page needs its token: "
                                          "`python -m lsgd status --url` prints the URL with it"),
                              body=body, headers=(("WWW-Authenticate", "Bearer"),))
        if not app.pace():
            return self._send(429, _error(f"more than {MAX_PER_SECOND:g} requests a second; "
                                          "poll less often"), body=body,
                              headers=(("Retry-After", "1"),))
        try:
            code, data, ctype = app.page(url.path, query)
        except Exception:  # a bug must not take the page down: 500, and one log line
            app.failed()
            return self._send(500, _error("internal error; see the global server's log"),
                              body=body)
        self._send(code, data, ctype, body=body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], app: "StatusPage",
                 tls: ssl.SSLContext | None) -> None:
        self.app = app
        self.slots = threading.BoundedSemaphore(MAX_REQUESTS)
        self.per_client: dict[str, int] = {}  # requests in progress by client address
        self.lock = threading.Lock()
        self.busy = 0  # requests turned away with 503
        super().__init__(address, _Handler)
        if tls is not None:  # the handshake happens in the request's thread (_Handler.setup)
            self.socket = tls.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)

    def server_bind(self) -> None:
        TCPServer.server_bind(self)  # without HTTPServer's reverse DNS lookup of the host
        self.server_name, self.server_port = self.server_address[:2]

    def _admit(self, client: str) -> bool:
        with self.lock:
            if self.per_client.get(client, 0) >= MAX_PER_CLIENT:
                return False
            if not self.slots.acquire(blocking=False):
                return False
            self.per_client[client] = self.per_client.get(client, 0) + 1
            return True

    def _leave(self, client: str) -> None:
        with self.lock:
            left = self.per_client.pop(client, 1) - 1
            if left > 0:
                self.per_client[client] = left
            self.slots.release()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit(client_address[0]):
            self.busy += 1
            if not isinstance(request, ssl.SSLSocket):  # TLS would need a handshake first
                try:
                    request.setblocking(False)
                    request.send(BUSY)
                except OSError:
                    pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._leave(client_address[0])
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._leave(client_address[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("status page: request from %s failed", client_address, exc_info=True)


class StatusPage:
    """The status page of one global server (``GlobalServicer``); ``port`` once listening."""

    def __init__(self, servicer: Any, host: str, port: int, token: str | None = None,
                 tls: tuple[str, str] | None = None) -> None:
        from ..global_server.prom import CONTENT_TYPE_LATEST, make_registry, render

        self.servicer = servicer
        self.token = token.encode() if token else None
        self._registry, self._render, self._prom_type = make_registry(servicer), render, CONTENT_TYPE_LATEST
        self._failures = 0
        self._allowance, self._paced_at = MAX_PER_SECOND, time.monotonic()  # a token bucket
        self._pace_lock = threading.Lock()
        context = None
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(*tls)
        self.scheme = "https" if context else "http"
        self._server = _Server((host, port), self, context)
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="lsgd-status-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()  # returns once the accept loop has ended (<= 0.5 s)
        self._server.server_close()
        self._thread.join(2.0)

    def authorized(self, header: str | None, tokens: list[str] | None) -> bool:
        if self.token is None:
            return True
        given = None
        if header and header[:7].lower() == "bearer ":
            given = header[7:].strip()
        elif tokens:
            given = tokens[0]
        return given is not None and hmac.compare_digest(given.encode("utf-8", "replace"),
                                                         self.token)

    def pace(self) -> bool:
        """False when pages are asked for faster than ``MAX_PER_SECOND`` (bursts of as many):
        readers hammering /history.json must not take the server's CPU from the job."""
        with self._pace_lock:
            now = time.monotonic()
            self._allowance = min(MAX_PER_SECOND,
                                  self._allowance + (now - self._paced_at) * MAX_PER_SECOND)
            self._paced_at = now
            if self._allowance < 1.0:
                return False
            self._allowance -= 1.0
            return True

    def host_allowed(self, host: str | None) -> bool:
        """Without a token, only a request addressed to an IP address or ``localhost``: a web
        page in the user's browser cannot read the page through a name it controls (DNS
        rebinding). With a token, any (the token is the key)."""
        if self.token is not None or not host:
            return True
        name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
        if name.lower() == "localhost":
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def failed(self) -> None:
        self._failures += 1
        if self._failures == 1:
            log.exception("status page: a request failed (logged once; the page goes on)")
        else:
            log.debug("status page: a request failed", exc_info=True)

    def page(self, path: str, query: dict[str, list[str]]) -> tuple[int, bytes, str]:
        """(HTTP status, body, content type) of GET ``path``."""
        s = self.servicer
        if path == "/status.json":
            with s.cond:
                doc = s.board.snapshot(s.coord, s.clock(), wall=time.time())
            return 200, _json(doc), "application/json"
        if path == "/history.json":
            try:
                since = int(query.get("since", ["0"])[0])
                if not 0 <= since < 1 << 63:
                    raise ValueError
            except ValueError:
                return 400, _error("since must be a whole number >= 0"), "application/json"
            with s.cond:
                rows = s.board.history_rows(since)
            return 200, _json(s.board.format_history(rows)), "application/json"
        if path == "/metrics":
            return 200, self._render(self._registry), self._prom_type
        if path in ("/", "/index.html"):
            try:
                return 200, DASHBOARD.read_bytes(), "text/html; charset=utf-8"
            except FileNotFoundError:
                return (404, b"no dashboard installed (lsgd/status/dashboard.html); "
                        b"/status.json, /history.json and /metrics are served\n",
                        "text/plain; charset=utf-8")
        return 404, _error(f"no page {path[:100]}; try /status.json, /history.json, /metrics "
                           "or /"), "application/json"


def status_host(config: Any, secret: str | None) -> str:
    """Where the page listens: loopback without a secret (whatever the gRPC port does), else
    where the gRPC port listens (``serve``: loopback for a loopback ``ip_addr``, else all)."""
    return "127.0.0.1" if secret is None or is_loopback(config.ip_addr) else "0.0.0.0"


def start_status_page(config: Any, servicer: Any, secret: str | None, out: Path,
                      restore: bool = False) -> StatusPage | None:
    """Serve the status page of the job ``config`` describes, as ``serve()`` does.

    The port is ``config.status_address`` (None: off); a restarted server (``restore``) takes
    the port its predecessor wrote to ``out/status.port``. A port in use is one warning and no
    page: the job goes on. The port chosen is written to ``out/status.port``.
    """
    port_file = out / PORT_FILE
    port = config.status_address
    if port is None:
        port_file.unlink(missing_ok=True)  # of an earlier run: it no longer answers
        return None
    if restore:
        try:
            port = int(port_file.read_text().strip())
        except (OSError, ValueError):
            pass
    host = status_host(config, secret)
    tls = (config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
    try:
        page = StatusPage(servicer, host, port, status_token(secret.encode()) if secret else None,
                          tls)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        if getattr(exc, "errno", None) == errno.EADDRINUSE:
            log.warning("status page not served: port %d in use; set STATUS_PORT to a free "
                        "port, or 0 to turn it off", port)
        else:
            log.warning("status page not served: cannot listen on %s:%d (%s); set STATUS_PORT "
                        "to a free port, or 0 to turn it off", host, port, exc)
        port_file.unlink(missing_ok=True)
        return None
    write_atomic(port_file, f"{page.port}\n")
    shown = "127.0.0.1" if host == "127.0.0.1" else config.ip_addr
    log.info("status page: %s://%s:%d/ (/status.json, /metrics)%s", page.scheme, shown, page.port,
             "; it asks for the job's token: `python -m lsgd status --url` prints the URL "
             "with it" if secret else "")
    return page
