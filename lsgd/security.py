"""Keeping strangers out: TLS (optionally mutual) on every gRPC channel, and a per-job secret.

- The **secret** (``SECRET_FILE``, or the ``LSGD_SECRET`` environment variable) never travels:
  each node signs every call with it (``lsgd.signing``), and the global server answers
  UNAUTHENTICATED, with no state change, to a call whose signature is missing, wrong, stale or
  replayed.
- **TLS**: node 0 serves with ``TLS_CERT``/``TLS_KEY``; every node verifies it against
  ``TLS_CA``. With ``MTLS=1`` the server also requires a client certificate signed by that CA
  (each node presents its own ``TLS_CERT``/``TLS_KEY``), and checks on every call that the
  certificate names the node the call is for (PERMISSION_DENIED otherwise).
- ``lsgd certs`` creates a CA, one certificate per node (valid for server and client use,
  naming the node's index as SAN URI ``lsgd://node/<i>``) and a secret, all readable only by
  their owner.

A global server that listens on anything but loopback refuses to start without a secret unless
``ALLOW_INSECURE=1`` (config check in ``lsgd.config``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import grpc

from .signing import SESSION_METHOD, SIGNATURE_KEY, Signer, Verifier

NODE_URI = "lsgd://node/{}"  # SAN URI naming a node's index in its certificate
_NODE_URI = re.compile(r"lsgd://node/(\d{1,9})")
SECRET_ENV = "LSGD_SECRET"
MIN_SECRET = 16  # characters
# Standard services a probe or a tool calls without the job secret (health checking, server
# reflection): they read nothing of the job's and change nothing (global_server/probes.py).
UNSIGNED_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")


class SecurityError(ValueError):
    """A key, certificate or secret is missing or unusable; the message says which."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read {what} '{path}': {exc.strerror}") from None
    if not data.strip():
        raise SecurityError(f"{what} '{path}' is empty")
    return data


def _read_pem(path: str, what: str, key: bool = False) -> bytes:
    """Read a PEM certificate (chain) or private key; SecurityError if it is not one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    data = _read(path, what)
    try:
        if key:
            serialization.load_pem_private_key(data, password=None)
        else:
            x509.load_pem_x509_certificates(data)
    except (ValueError, TypeError) as exc:
        raise SecurityError(f"{what} '{path}' is not a PEM {'private key' if key else 'certificate'} "
                            f"without a passphrase ({exc})") from None
    return data


def read_secret(secret_file: str | None) -> str | None:
    """The job secret from ``secret_file`` or ``$LSGD_SECRET`` (None when neither is set)."""
    if secret_file:
        text = _read(secret_file, "secret file").decode("utf-8", "replace").strip()
    else:
        text = os.environ.get(SECRET_ENV, "").strip()
        if not text:
            return None
    if len(text) < MIN_SECRET or not text.isascii() or not text.isprintable():
        raise SecurityError(f"the job secret must be at least {MIN_SECRET} printable ASCII "
                            "characters (lsgd certs writes one)")
    return text


@dataclass(frozen=True)
class Security:
    """What one process needs to serve or call securely. ``Security()`` is plain loopback."""

    secret: str | None = None
    ca: bytes | None = None  # verifies the peer (the server; with mtls, clients too)
    cert: bytes | None = None  # this node's certificate chain (server, or client under mtls)
    key: bytes | None = None
    mtls: bool = False

    @classmethod
    def from_config(cls, cfg) -> "Security":  # noqa: ANN001 - JobConfig (import cycle)
        """Load the files named by the job configuration; SecurityError on a bad one."""
        ca = _read_pem(cfg.tls_ca, "TLS CA certificate") if cfg.tls_ca else None
        cert = _read_pem(cfg.tls_cert, "TLS certificate") if cfg.tls_cert else None
        key = _read_pem(cfg.tls_key, "TLS key", key=True) if cfg.tls_key else None
        return cls(read_secret(cfg.secret_file), ca, cert, key, cfg.mtls)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata for every call: none, the secret never travels (the channel signs calls)."""
        return ()

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        """The checks every call to the global server passes (``CallCheck``)."""
        return [CallCheck(self.secret, check_nodes=self.mtls and self.cert is not None)]

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None or self.key is None:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)],
                                           root_certificates=self.ca if self.mtls else None,
                                           require_client_auth=self.mtls)

    def channel(self, address: str, options: Sequence[tuple[str, object]]) -> grpc.Channel:
        """A channel to the global server: TLS with a CA, every call signed with a secret."""
        if self.ca is None:
            channel = grpc.insecure_channel(address, options=list(options))
        else:
            pair = (self.key, self.cert) if self.mtls else (None, None)
            creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=pair[0],
                                                 certificate_chain=pair[1])
            channel = grpc.secure_channel(address, creds, options=list(options))
        return grpc.intercept_channel(channel, Signer(self.secret)) if self.secret else channel


class CallCheck(grpc.ServerInterceptor):
    """Refuses calls before any handler runs, so a refusal changes no state.

    - With a secret: a call whose signature (``lsgd.signing``) is missing, wrong, stale or
      replayed gets UNAUTHENTICATED.
    - With mutual TLS (``check_nodes``): a call whose ``NodeId.node_index`` is not a node that
      the client certificate names (SAN URI ``lsgd://node/<i>``) gets PERMISSION_DENIED, so
      one node's certificate cannot join or act as another node.

    Both look at the request as received: its bytes (signature) and its ``node`` (for an
    upload, the header's); a stream is checked when its handler reads the first message.
    Calls to ``UNSIGNED_SERVICES`` (health, reflection) pass unchecked: a probe has no secret.
    """

    def __init__(self, secret: str | None, check_nodes: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.verifier = Verifier(secret, clock) if secret else None
        self.check_nodes = check_nodes

    def intercept_service(self, continuation, details):  # noqa: ANN001 - grpc API
        handler = continuation(details)
        if handler is None or (self.verifier is None and not self.check_nodes):
            return handler
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(UNSIGNED_SERVICES):
            return handler
        signature = next((v for k, v in details.invocation_metadata or () if k == SIGNATURE_KEY),
                         None)
        raw: list[bytes] = []  # the first request message's bytes, as received
        deserialize = handler.request_deserializer

        def capture(data: bytes) -> object:
            if not raw:
                raw.append(data)
            return deserialize(data) if deserialize else data

        def check(request: object, context: grpc.ServicerContext) -> None:
            if self.verifier is not None:
                why = self.verifier.check(signature, method, raw[0] if raw else b"")
                if why:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            if self.check_nodes:
                why = _wrong_node(request, context.auth_context())
                if why:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

        if not handler.request_streaming:
            inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

            def unary(request, context):  # noqa: ANN001 - grpc API
                check(request, context)
                return inner(request, context)

            kind = "unary_stream" if handler.response_streaming else "unary_unary"
            return handler._replace(request_deserializer=capture, **{kind: unary})
        inner = handler.stream_stream if handler.response_streaming else handler.stream_unary

        def stream(requests, context):  # noqa: ANN001 - grpc API
            if self.verifier is not None and signature is None:  # no need to wait for a header
                context.abort(grpc.StatusCode.UNAUTHENTICATED, self.verifier.check(None, method, b""))

            def checked() -> Iterator[object]:  # checked when the handler reads the header
                first = next(requests, None)
                check(first, context)
                if first is None:
                    return
                yield first
                if self.verifier is None or method != SESSION_METHOD:
                    yield from requests
                    return
                for request in requests:  # a Session stream: every later message has its MAC
                    why = self.verifier.check_message(first.nonce, request)
                    if why:
                        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
                    yield request

            return inner(checked(), context)

        kind = "stream_stream" if handler.response_streaming else "stream_unary"
        return handler._replace(request_deserializer=capture, **{kind: stream})


def cert_nodes(auth_context: Mapping[str, Sequence[bytes]]) -> set[int]:
    """The node indices a verified client certificate names (SAN URIs ``lsgd://node/<i>``)."""
    names = auth_context.get("peer_uri") or auth_context.get("x509_subject_alternative_name") or ()
    found = set()
    for name in names:
        m = _NODE_URI.fullmatch(name.decode("ascii", "replace") if isinstance(name, bytes) else name)
        if m:
            found.add(int(m.group(1)))
    return found


def _wrong_node(request: object, auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
    """Why ``request`` may not come from the peer with this certificate (None: it may)."""
    holder = request
    if holder is not None and hasattr(holder, "header"):  # an upload: the header names the node
        holder = holder.header if holder.HasField("header") else None
    node = getattr(holder, "node", None)
    if node is None:
        return None  # names no node; the handler refuses it
    names = cert_nodes(auth_context)
    if node.node_index in names:
        return None
    if not names:
        return ("the client certificate names no lsgd node (SAN URI lsgd://node/<i>): make the "
                "nodes' certificates with `lsgd certs`, or add that URI to each")
    mine = ", ".join(str(i) for i in sorted(names))
    return (f"this client certificate is node {mine}'s, but the call is for node "
            f"{node.node_index}: each node presents its own node<i>.pem (TLS_CERT, TLS_KEY) and "
            "runs as that index")


# ------------------------------------------------------------------ certificates
def make_certs(out: str | Path, hosts: Sequence[str], days: int = 365) -> list[Path]:
    """Write a job CA, one certificate and key per host, and a secret into ``out``.

    ``hosts`` are the nodes' addresses (IP or DNS name), node 0 first; node i gets
    ``node<i>.pem`` / ``node<i>-key.pem``, valid as server and client certificate for that
    host (and for localhost). Every file is created readable by its owner only. Returns the
    paths written.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise SecurityError("give the nodes' addresses, node 0 first (--hosts 10.0.0.1,10.0.0.2)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(out, 0o700)
    taken = [p.name for p in out.iterdir()]
    if taken:
        raise SecurityError(f"{out} is not empty ({', '.join(sorted(taken)[:3])} ...); give "
                            "lsgd certs a new directory")
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    written: list[Path] = []

    def write(filename: str, data: bytes) -> None:
        path = out / filename
        # O_EXCL | O_NOFOLLOW: never write a key into a file or link someone else made first
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
        written.append(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(name("lsgd job CA")).issuer_name(name("lsgd job CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    write("ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    write("ca-key.pem", pem_key(ca_key))
    for i, host in enumerate(hosts):
        names: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                         x509.UniformResourceIdentifier(NODE_URI.format(i))]
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(f"lsgd node {i} ({host})"))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, hashes.SHA256()))
        write(f"node{i}.pem", cert.public_bytes(serialization.Encoding.PEM))
        write(f"node{i}-key.pem", pem_key(key))
    write("secret", (secrets.token_hex(32) + "\n").encode())
    return written
