"""Keeping strangers out: TLS (optionally mutual) on every gRPC channel, and a per-job secret.

- The **secret** (``SECRET_FILE``, or the ``LSGD_SECRET`` environment variable) travels in the
  metadata of every call; the global server answers UNAUTHENTICATED, with no state change, to a
  call without it. Compared in constant time.
- **TLS**: node 0 serves with ``TLS_CERT``/``TLS_KEY``; every node verifies it against
  ``TLS_CA``. With ``MTLS=1`` the server also requires a client certificate signed by that CA
  (each node presents its own ``TLS_CERT``/``TLS_KEY``).
- ``lsgd certs`` creates a CA, one certificate per node (valid for server and client use) and a
  secret, all readable only by their owner.

A global server that listens on anything but loopback refuses to start without a secret unless
``ALLOW_INSECURE=1`` (config check in ``lsgd.config``).
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

SECRET_KEY = "x-lsgd-secret"  # gRPC metadata key
SECRET_ENV = "LSGD_SECRET"
MIN_SECRET = 16  # characters


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
        return ((SECRET_KEY, self.secret),) if self.secret else ()

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None or self.key is None:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)],
                                           root_certificates=self.ca if self.mtls else None,
                                           require_client_auth=self.mtls)

    def channel(self, address: str, options: Sequence[tuple[str, object]]) -> grpc.Channel:
        if self.ca is None:
            return grpc.insecure_channel(address, options=list(options))
        pair = (self.key, self.cert) if self.mtls else (None, None)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=pair[0],
                                             certificate_chain=pair[1])
        return grpc.secure_channel(address, creds, options=list(options))


class SecretCheck(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the job secret (UNAUTHENTICATED)."""

    def __init__(self, secret: str | None) -> None:
        self._secret = secret.encode() if secret else None

    def intercept_service(self, continuation, details):  # noqa: ANN001 - grpc API
        handler = continuation(details)
        if self._secret is None or handler is None:
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == SECRET_KEY), "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._secret):
            return handler

        def deny(request, context):  # noqa: ANN001 - grpc API
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "wrong or missing job secret (SECRET_FILE or LSGD_SECRET must match node 0's)")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


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
                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
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
