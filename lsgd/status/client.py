"""``python -m lsgd status``: a job's status page as a terminal table.

Examples::

    python -m lsgd status                          # the job in ./runs/lsgd, on this machine
    python -m lsgd status --watch                  # redraw every second until the job is over
    python -m lsgd status --address 10.0.0.1:50052 --secret-file secret --tls-ca ca.pem
    python -m lsgd status --json                   # the raw /status.json
    python -m lsgd status --url                    # the dashboard's address, token included

The address defaults to ``127.0.0.1`` and the port node 0 wrote to
``RUN_DIR/global/status.port`` (else 50052). With a job secret (``--secret-file``,
``$SECRET_FILE`` or ``$LSGD_SECRET``) the request carries the page's token
(``lsgd.status.status_token``); with ``--tls-ca`` (or ``$TLS_CA``) it uses HTTPS. Only the
standard library is used. Exit status: 0 done, 1 no status (unreachable, refused, bad answer),
2 bad arguments.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..security import SecurityError, read_secret
from . import status_token
from .table import OVER, render, state

DEFAULT_PORT = 50052
TIMEOUT = 5.0  # seconds for one request (connect and read)
MAX_BYTES = 32 << 20  # a larger answer is not a status page
WATCH_EVERY = 1.0  # seconds between redraws
WATCH_GRACE = 10.0  # seconds --watch rides over a page that stopped answering (a server restart)
CLEAR = "\x1b[H\x1b[2J"


class StatusError(Exception):
    """No status: the message is the one line to print."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """The token goes to the address given and nowhere else."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class StatusClient:
    """Fetches ``/status.json`` from ``base`` (``http(s)://host:port``) with a bounded wait."""

    def __init__(self, base: str, token: str | None = None,
                 context: ssl.SSLContext | None = None, timeout: float = TIMEOUT) -> None:
        self.base, self.token, self.timeout = base.rstrip("/"), token, timeout
        handlers: list[Any] = [urllib.request.ProxyHandler({}), _NoRedirect()]
        if context is not None:
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self._opener = urllib.request.build_opener(*handlers)

    @property
    def dashboard_url(self) -> str:
        return f"{self.base}/" + (f"?token={self.token}" if self.token else "")

    def fetch_text(self) -> str:
        """The body of ``/status.json``. Raises StatusError with a line to print."""
        url = f"{self.base}/status.json"
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                body = _read_bounded(resp, time.monotonic() + 2 * self.timeout)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise StatusError(
                    f"the status page at {self.base} refused the token: is it this job's secret?"
                    if self.token else
                    f"the status page at {self.base} needs the job's secret: give --secret-file "
                    "FILE, or set SECRET_FILE or LSGD_SECRET") from None
            raise StatusError(f"the status page at {self.base} answered HTTP {exc.code} "
                              f"{exc.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            why = getattr(exc, "reason", exc)
            if isinstance(why, ssl.SSLError):
                raise StatusError(f"TLS with {self.base} failed ({why}); give --tls-ca the job's "
                                  "ca.pem and the address node 0's certificate names") from None
            if isinstance(why, (ConnectionResetError, http.client.HTTPException)):
                hint = ("if the job uses TLS, give --tls-ca ca.pem (or set TLS_CA)"
                        if self.base.startswith("http:") else "is it the job's STATUS_PORT?")
                raise StatusError(f"the status page at {self.base} broke off the answer "
                                  f"({type(why).__name__}): {hint}") from None
            raise StatusError(f"cannot reach the status page at {self.base} ({_why(why, self.timeout)}): the "
                              "job may be over, or node 0 runs with STATUS_PORT=0, or on "
                              "another address (--address HOST:PORT)") from None
        if len(body) > MAX_BYTES:
            raise StatusError(f"the answer from {url} is larger than {MAX_BYTES >> 20} MiB")
        return body.decode("utf-8", "replace")

    def fetch(self) -> tuple[dict, str]:
        """``/status.json`` parsed, and its text."""
        text = self.fetch_text()
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("job"), dict):
            raise StatusError(f"the answer from {self.base}/status.json is not an lsgd status "
                              "page (is the address the job's STATUS_PORT?)")
        return data, text


def _read_bounded(resp: Any, deadline: float) -> bytes:
    """The body, read in chunks until ``deadline`` (a page that trickles bytes ends too)."""
    chunks, size = [], 0
    while size <= MAX_BYTES:
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        chunk = resp.read1(1 << 16) if hasattr(resp, "read1") else resp.read(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _why(reason: Any, timeout: float) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError) or "timed out" in str(reason):
        return f"no answer in {timeout:g} s"
    return str(reason)


def base_url(address: str | None, run_dir: str, tls: bool) -> str:
    """``http(s)://host:port`` from ``--address`` (``HOST:PORT``, or a URL), else
    127.0.0.1 and the port in ``RUN_DIR/global/status.port`` (else 50052)."""
    scheme = "https" if tls else "http"
    if address is None:
        port = DEFAULT_PORT
        try:
            port = int((Path(run_dir) / "global" / "status.port").read_text().strip())
        except (OSError, ValueError):
            pass
        return f"{scheme}://127.0.0.1:{port}"
    if "://" not in address:
        address = f"{scheme}://{address}"
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise StatusError(f"--address must be HOST:PORT (e.g. 127.0.0.1:50052), got "
                          f"'{address}'")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


def client_from(args: argparse.Namespace) -> StatusClient:
    """The client the command line asks for. Raises StatusError (bad arguments)."""
    tls_ca = args.tls_ca or os.environ.get("TLS_CA") or None
    try:
        secret = read_secret(args.secret_file or os.environ.get("SECRET_FILE") or None)
    except SecurityError as exc:
        raise StatusError(str(exc)) from None
    context = None
    if tls_ca:
        try:
            context = ssl.create_default_context(cafile=tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise StatusError(f"--tls-ca {tls_ca}: {getattr(exc, 'strerror', None) or exc}") from None
    base = base_url(args.address, args.run_dir, tls=context is not None)
    if base.startswith("https:") and context is None:
        context = ssl.create_default_context()
    return StatusClient(base, status_token(secret.encode()) if secret else None, context)


def watch(client: StatusClient, as_json: bool, every: float | None = None,
          grace: float | None = None) -> int:
    """Redraw every ``every`` s (``WATCH_EVERY``) until Ctrl-C (0), the job is over (0), or
    the page has not answered for ``grace`` s (``WATCH_GRACE``; 0 if the job was ending)."""
    every = WATCH_EVERY if every is None else every
    grace = WATCH_GRACE if grace is None else grace
    tty = sys.stdout.isatty()
    last, silent_since = "", None
    try:
        while True:
            try:
                data, text = client.fetch()
            except StatusError as exc:
                if not last:
                    raise
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > grace:
                    print(f"lsgd status: {exc}", file=sys.stderr)
                    return 0 if last in ("finishing", *OVER) else 1
            else:
                silent_since, last = None, state(data) or "?"
                if as_json:
                    print(json.dumps(data, separators=(",", ":")), flush=True)
                else:
                    stamp = time.strftime("%H:%M:%S")
                    print((CLEAR if tty else "\n") + f"{stamp}  {client.base}\n" + render(data),
                          flush=True)
                if last in OVER:
                    return 0
            time.sleep(every)
    except KeyboardInterrupt:
        return 0


def add_parser(sub: Any) -> None:
    """The ``status`` subcommand's arguments."""
    parts = (__doc__ or "").split("Examples::\n\n", 1)  # python -OO strips docstrings
    examples = parts[1].split("\n\n", 1)[0] if len(parts) == 2 else ""
    p = sub.add_parser("status", help="print a running job's status (node 0's status page)",
                       description="Print a job's status (node 0's /status.json) as a table.",
                       epilog="examples:\n" + examples if examples else None,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", metavar="HOST:PORT",
                   help="node 0's status page (default: 127.0.0.1 and the port in "
                        "RUN_DIR/global/status.port, else 50052)")
    p.add_argument("--run-dir", default=os.environ.get("RUN_DIR") or "runs/lsgd",
                   help="the job's RUN_DIR, for the default port (default: $RUN_DIR or runs/lsgd)")
    p.add_argument("--secret-file", help="the job secret (default: $SECRET_FILE, or $LSGD_SECRET)")
    p.add_argument("--tls-ca", help="CA of node 0's certificate: HTTPS (default: $TLS_CA)")
    p.add_argument("--watch", action="store_true", help="redraw every second until the job is over")
    p.add_argument("--json", action="store_true", help="print the raw /status.json")
    p.add_argument("--url", action="store_true",
                   help="print the dashboard's address (with ?token= when the job has a secret)")


def main(args: argparse.Namespace) -> int:
    """Run ``lsgd status``; returns the exit code."""
    try:
        client = client_from(args)
    except StatusError as exc:
        print(f"lsgd status: error: {exc}", file=sys.stderr)
        return 2
    if args.url:
        print(client.dashboard_url)
        return 0
    try:
        if args.watch:
            return watch(client, args.json)
        data, text = client.fetch()
    except StatusError as exc:
        print(f"lsgd status: {exc}", file=sys.stderr)
        return 1
    print(text.rstrip("\n") if args.json else render(data))
    return 0


__all__ = ["StatusClient", "StatusError", "base_url", "client_from", "watch", "main", "add_parser"]
