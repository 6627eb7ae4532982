"""TLS, mutual TLS and the job secret; private files; the loopback rule."""

from __future__ import annotations

import os
import stat

import grpc
import numpy as np
import pytest

from conftest import REPO
from lsgd.config import ConfigError, JobConfig
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server.global_client import GlobalClient, GlobalUnreachable
from lsgd.security import Security, make_certs

pytest.importorskip("cryptography")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_certs(out, ["127.0.0.1", "127.0.0.1"])
    other = tmp_path_factory.mktemp("other")
    make_certs(other, ["127.0.0.1"])  # a different CA
    return out, other


def _sec(d, node=0, secret=True, ca=True, cert=True, mtls=False):
    return Security(secret=(d / "secret").read_text().strip() if secret else None,
                    ca=(d / "ca.pem").read_bytes() if ca else None,
                    cert=(d / f"node{node}.pem").read_bytes() if cert else None,
                    key=(d / f"node{node}-key.pem").read_bytes() if cert else None, mtls=mtls)


@pytest.fixture
def secure_server(certs):
    servers = []

    def start(mtls=False):
        config = JobConfig(num_groups=2, workers=1, job_id="job")
        servicer = build_servicer(config)
        srv, port = create_server("127.0.0.1:0", servicer, security=_sec(certs[0], mtls=mtls))
        servers.append(srv)
        return servicer, f"127.0.0.1:{port}"

    yield start
    for srv in servers:
        srv.stop(grace=0.2).wait(5)


def _join(security, addr, node=0):
    c = GlobalClient(addr, "job", node, round_timeout=2.0, security=security)
    try:
        return c.join(workers=1, param_count=4, algorithm="lsgd", num_groups=2, connect_timeout=2)
    finally:
        c.close()


def test_certs_and_secret_are_private_files(certs):
    out, _ = certs
    names = sorted(p.name for p in out.iterdir())
    assert names == ["ca-key.pem", "ca.pem", "node0-key.pem", "node0.pem", "node1-key.pem",
                     "node1.pem", "secret"]
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert len((out / "secret").read_text().strip()) == 64


def test_tls_with_the_secret_joins(secure_server, certs):
    servicer, addr = secure_server()
    assert _join(_sec(certs[0], node=1, cert=False), addr).session > 0
    assert list(servicer.coord.nodes) == [0]


@pytest.mark.parametrize("case", ["no secret", "wrong secret"])
def test_a_call_without_the_right_secret_is_unauthenticated_and_changes_nothing(
        secure_server, certs, case):
    servicer, addr = secure_server()
    sec = _sec(certs[0], cert=False)
    sec = Security(secret=None if case == "no secret" else "x" * 64, ca=sec.ca)
    with pytest.raises(grpc.RpcError) as e:
        _join(sec, addr)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "job secret" in e.value.details()
    assert not servicer.coord.nodes and servicer.params.param_count is None


def test_a_streaming_upload_without_the_secret_is_unauthenticated(secure_server, certs):
    servicer, addr = secure_server()
    _join(_sec(certs[0], cert=False), addr)
    c = GlobalClient(addr, "job", 0, round_timeout=2.0, security=Security(ca=_sec(certs[0]).ca))
    c.session = 1
    with pytest.raises(grpc.RpcError) as e:
        c.push("sum", np.ones(4, np.float32), round_id=1, summands=1)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not servicer.params.buffers["sum"].any()
    c.close()


def test_a_plaintext_client_cannot_talk_to_a_tls_server(secure_server, certs):
    servicer, addr = secure_server()
    with pytest.raises(GlobalUnreachable, match="TLS_CA"):
        _join(Security(secret=_sec(certs[0]).secret), addr)
    assert not servicer.coord.nodes


def test_a_server_certificate_from_another_ca_is_refused(secure_server, certs):
    servicer, addr = secure_server()
    sec = _sec(certs[0], cert=False)
    with pytest.raises(GlobalUnreachable, match="TLS_CA"):
        _join(Security(secret=sec.secret, ca=(certs[1] / "ca.pem").read_bytes()), addr)
    assert not servicer.coord.nodes


def test_mutual_tls_requires_a_client_certificate_from_the_job_ca(secure_server, certs):
    servicer, addr = secure_server(mtls=True)
    no_cert = _sec(certs[0], cert=False)
    foreign = Security(secret=no_cert.secret, ca=no_cert.ca, mtls=True,
                       cert=(certs[1] / "node0.pem").read_bytes(),
                       key=(certs[1] / "node0-key.pem").read_bytes())
    for sec in (no_cert, foreign):
        with pytest.raises(GlobalUnreachable, match="MTLS"):
            _join(sec, addr)
    assert not servicer.coord.nodes
    assert _join(_sec(certs[0], node=0, mtls=True), addr, node=0).session > 0  # node 0 first
    assert _join(_sec(certs[0], node=1, mtls=True), addr, node=1).session > 0


def test_each_node_certificate_names_its_node_index(certs):
    from cryptography import x509

    for i in (0, 1):
        cert = x509.load_pem_x509_certificate((certs[0] / f"node{i}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"lsgd://node/{i}"]


def _client(security, addr, node, session=0):
    c = GlobalClient(addr, "job", node, round_timeout=2.0, security=security)
    c.session = session
    return c


def _refused(call, code=grpc.StatusCode.PERMISSION_DENIED):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    return e.value.details()


def test_mutual_tls_a_node_certificate_cannot_join_or_act_as_another_node(secure_server, certs):
    servicer, addr = secure_server(mtls=True)
    node1_cert = _sec(certs[0], node=1, mtls=True)
    # node 1's certificate joining as node 0: refused, nothing changes
    details = _refused(lambda: _join(node1_cert, addr, node=0))
    assert "node 1's" in details and "for node 0" in details
    assert not servicer.coord.nodes and servicer.params.param_count is None
    # node 0 joins with its own certificate (node 0's is also the server's)
    session0 = _join(_sec(certs[0], node=0, mtls=True), addr, node=0).session
    before = servicer.coord.snapshot()
    # node 1's certificate, even knowing node 0's session, cannot speak for node 0
    c = _client(node1_cert, addr, node=0, session=session0)
    try:
        for call in (c.heartbeat,
                     lambda: c.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0,
                                       max_wait=0.0),
                     lambda: c.report_round(1, None, 1),
                     lambda: c.push("sum", np.ones(4, np.float32), round_id=1, summands=1),
                     lambda: c.pull("center", np.zeros(4, np.float32), round_id=0),
                     lambda: c.leave(0, 0)):
            _refused(call)
    finally:
        c.close()
    assert servicer.coord.snapshot() == before
    assert servicer.coord.nodes[0].session == session0 and not servicer.coord.nodes[0].left
    assert not servicer.params.buffers["sum"].any()
    assert _join(node1_cert, addr, node=1).session > 0  # as itself it joins


def test_mutual_tls_a_certificate_that_names_no_node_is_refused(secure_server, certs, tmp_path):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = certs[0]
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca-key.pem").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lsgd node 0")]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    plain = Security(secret=_sec(d).secret, ca=ca.public_bytes(serialization.Encoding.PEM),
                     cert=cert.public_bytes(serialization.Encoding.PEM), mtls=True,
                     key=key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    servicer, addr = secure_server(mtls=True)
    assert "names no lsgd node" in _refused(lambda: _join(plain, addr, node=0))
    assert not servicer.coord.nodes


def test_listening_beyond_loopback_needs_a_secret_or_an_explicit_opt_out(tmp_path, monkeypatch):
    monkeypatch.delenv("LSGD_SECRET", raising=False)
    with pytest.raises(ConfigError, match="not a loopback address.*ALLOW_INSECURE"):
        JobConfig(ip_addr="10.0.0.1")
    JobConfig(ip_addr="10.0.0.1", allow_insecure=True)
    (tmp_path / "s").write_text("short")
    with pytest.raises(ConfigError, match="at least 16"):
        JobConfig(ip_addr="10.0.0.1", secret_file=str(tmp_path / "s"))
    (tmp_path / "s").write_text("a" * 32 + "\n")
    JobConfig(ip_addr="10.0.0.1", secret_file=str(tmp_path / "s"))
    monkeypatch.setenv("LSGD_SECRET", "b" * 20)
    JobConfig(ip_addr="10.0.0.1")
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        JobConfig(tls_cert=str(tmp_path / "s"))
    with pytest.raises(ConfigError, match="tls_ca '.*' not found"):
        JobConfig(tls_ca=str(tmp_path / "missing.pem"))


@pytest.mark.timeout(120)
def test_a_job_over_mutual_tls_with_a_secret(cluster, certs, tmp_path):
    d = certs[0]
    knobs = dict(ENTRY="toyjob:main", NUM_GROUPS=2, ITERATIONS=2000, SECRET_FILE=d / "secret",
                 TLS_CA=d / "ca.pem", MTLS=1, JOIN_TIMEOUT=20)
    n0 = cluster(0, PORT=0, TLS_CERT=d / "node0.pem", TLS_KEY=d / "node0-key.pem", **knobs)
    port = cluster.port_of_node0()
    # a node with the wrong secret is turned away with one clear line, and changes nothing
    (tmp_path / "wrong").write_text("w" * 64)
    bad = cluster(1, PORT=port, TLS_CERT=d / "node1.pem", TLS_KEY=d / "node1-key.pem",
                  **(knobs | {"SECRET_FILE": tmp_path / "wrong"}))
    assert bad.wait(60) == 2  # a configuration error
    assert "UNAUTHENTICATED" in bad.output and "job secret" in bad.output
    # a node that presents node 0's certificate cannot join as node 1
    bad = cluster(1, PORT=port, TLS_CERT=d / "node0.pem", TLS_KEY=d / "node0-key.pem", **knobs)
    assert bad.wait(60) == 1
    assert "PERMISSION_DENIED" in bad.output and "node 0's" in bad.output
    n1 = cluster(1, PORT=port, TLS_CERT=d / "node1.pem", TLS_KEY=d / "node1-key.pem", **knobs)
    assert n0.wait(90) == 0, n0.output
    assert n1.wait(30) == 0, n1.output
    assert n0.summary()["counter"] == 2000
    # no session port under TLS (its connections are not encrypted): the loops' streams went
    # to PORT, over the same mutual TLS, and no node looked for another port
    assert "no session port and no bulk port under TLS" in n0.output
    assert "session streams on port" not in n0.output
    assert "did not answer" not in n0.output + n1.output
    run = cluster.run_dir
    for p in [run / "node0", run / "node1", run / "global"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    for p in [run / "node0" / "metrics.csv", run / "node0" / "summary.json",
              run / "global" / "summary.json", run / "global.port"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_lsgd_certs_command(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "lsgd", "certs", "--out", str(tmp_path / "c"),
                          "--hosts", "10.0.0.1,node-b.example"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "node1-key.pem" in out.stdout and (tmp_path / "c" / "node1.pem").exists()
    assert os.stat(tmp_path / "c" / "secret").st_mode & 0o077 == 0


def test_a_file_that_is_not_a_certificate_or_key_is_one_clear_line(cluster, certs, tmp_path):
    d = certs[0]
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    node = cluster(0, PORT=0, ENTRY="toyjob:main", TLS_CA=tmp_path / "junk.pem",
                   TLS_CERT=d / "node0.pem", TLS_KEY=d / "node0-key.pem")
    assert node.wait(30) == 2
    assert "TLS CA certificate" in node.output and "is not a PEM certificate" in node.output
    assert "Traceback" not in node.output
    node = cluster(0, PORT=0, ENTRY="toyjob:main", TLS_CA=d / "ca.pem", TLS_CERT=d / "node0.pem",
                   TLS_KEY=d / "node0.pem")  # a certificate where the key belongs
    assert node.wait(30) == 2 and "is not a PEM private key" in node.output
