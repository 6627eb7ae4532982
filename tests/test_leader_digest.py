"""PLANE=chain: the leader's digest (docs/design-scale.md, build step 6). The source registers
the SHA-256 of the leader it sends down the route; a member keeps what came down only if it
matches, and the server refuses a leader upload that does not. A member holding the secret can
so no longer feed its descendants, or the server, a vector of its own."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from lsgd.global_server import digests as digests_mod
from lsgd.global_server.buffers import ParamError
from lsgd.global_server.digests import LeaderDigests, sha256_of


def test_a_digest_is_registered_once_kept_a_few_rounds_and_waited_for_briefly():
    d = LeaderDigests()
    a, b = sha256_of(np.arange(5, dtype=np.float32)), sha256_of(np.ones(5, np.float32))
    d.register(3, a)
    d.register(3, a)  # a retry of the same
    with pytest.raises(ParamError, match="registered already"):
        d.register(3, b)
    with pytest.raises(ParamError, match="32 bytes"):
        d.register(4, b"short")
    assert d.get(3) == a and d.get(9, wait=0.05) is None
    for r in range(10, 10 + digests_mod.KEEP):
        d.register(r, b)
    assert d.get(3) is None and d.get(10) == b  # the oldest rounds are dropped
    d.check(10, np.ones(5, np.float32))
    d.check(99, np.zeros(5, np.float32))  # no digest: nothing to check (the star)
    with pytest.raises(ParamError, match="not the one its source sent"):
        d.check(10, np.zeros(5, np.float32))


def test_a_leader_that_came_down_a_route_is_not_taken_without_its_sources_digest(monkeypatch):
    from lsgd.config import JobConfig
    from lsgd.global_server.params import LEADER, ParamStore
    from lsgd.rules.base import RoundKind

    monkeypatch.setattr(digests_mod, "WAIT", 0.05)
    params = ParamStore(JobConfig(algorithm="lsgd").make_rule())
    params.set_param_count(10)
    params.begin(4, RoundKind.GLOBAL, 2, {0: 1, 1: 1, 2: 1}, 5.0, leader_uploader=0)
    with pytest.raises(ParamError, match="registered no digest"):
        params.push(0, 4, LEADER, 10, 0, [(0, np.ones(10, np.float32).tobytes())])
    assert not params.exchange.leader_ok
    star = ParamStore(JobConfig(algorithm="lsgd").make_rule())  # no route: nothing to check
    star.set_param_count(10)
    star.begin(4, RoundKind.GLOBAL, 2, {0: 1, 1: 1, 2: 1}, 5.0)
    star.push(2, 4, LEADER, 10, 0, [(0, np.ones(10, np.float32).tobytes())])
    assert star.exchange.leader_ok


def test_the_server_refuses_a_leader_upload_that_is_not_the_sources():
    from lsgd.config import JobConfig
    from lsgd.global_server.params import LEADER, ParamStore
    from lsgd.rules.base import RoundKind

    leader = np.linspace(-1, 1, 10).astype(np.float32)
    forged = leader.copy()
    forged[7] += 1e-3
    for sent, ok in ((leader, True), (forged, False)):
        params = ParamStore(JobConfig(algorithm="lsgd").make_rule())
        params.set_param_count(10)
        params.begin(4, RoundKind.GLOBAL, 2, {0: 1, 1: 1, 2: 1}, 5.0, leader_uploader=0)
        params.digests.register(4, sha256_of(leader))
        chunks = [(0, sent.tobytes())]
        if ok:
            params.push(0, 4, LEADER, 10, 0, chunks)
            assert params.exchange.leader_ok and params.leader_complete
        else:
            with pytest.raises(ParamError, match="not the one its source sent"):
                params.push(0, 4, LEADER, 10, 0, chunks)
            assert not params.exchange.leader_ok and not params.leader_complete


@pytest.fixture
def chain_server():
    """A global server of a 3-node PLANE=chain job whose round 4 leader route is 2 -> 0 -> 1."""
    from lsgd.config import JobConfig
    from lsgd.global_server.server import build_servicer, create_server
    from lsgd.local_server.global_client import GlobalClient
    from lsgd.plane.messages import leader_route

    servicer = build_servicer(JobConfig(num_groups=3, workers=1, job_id="job", plane="chain"))
    srv, port = create_server("127.0.0.1:0", servicer)
    clients = []
    try:
        for i in range(3):
            c = GlobalClient(f"127.0.0.1:{port}", "job", i, round_timeout=5.0)
            c.data_address = f"127.0.0.1:{4600 + i}"
            c.join(workers=1, param_count=10, algorithm="lsgd", num_groups=3, connect_timeout=5)
            clients.append(c)
        servicer.routes.current = leader_route(4, [0, 1, 2], 2, servicer.routes.addresses)
        yield servicer, clients
    finally:
        for c in clients:
            c.close()
        srv.stop(None)


def test_only_the_rounds_source_registers_and_every_member_can_ask(chain_server):
    servicer, (c0, c1, c2) = chain_server
    digest = sha256_of(np.arange(10, dtype=np.float32))
    for who, rid, sha, code, why in [
            (c1, 4, digest, grpc.StatusCode.PERMISSION_DENIED, "not the source of round 4"),
            (c2, 5, digest, grpc.StatusCode.PERMISSION_DENIED, "not the source of round 5"),
            (c2, 4, b"x" * 33, grpc.StatusCode.INVALID_ARGUMENT, "a digest is 32 bytes")]:
        with pytest.raises(grpc.RpcError) as e:
            who.digest(rid, sha)
        assert e.value.code() == code and why in e.value.details()
    assert servicer.params.digests.get(4) is None  # nothing was registered
    assert c2.digest(4, digest) == digest
    with pytest.raises(grpc.RpcError) as e:
        c2.digest(4, sha256_of(np.zeros(10, np.float32)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert c0.digest(4) == digest and c1.digest(4) == digest
    servicer.digest_wait = 0.1
    assert c1.digest(6) == b""  # none registered: empty after the (short) wait


class _Member:
    """The parts of a node's local server that ``_leader_from_route`` uses."""

    def __init__(self, came: np.ndarray, registered: bytes | Exception):
        from lsgd.local_server.chain import ChainMixin

        self.held = np.zeros_like(came)
        self.asked = []

        def digest(rid: int, sha: bytes = b"", center: bool = False) -> bytes:
            self.asked.append(rid)
            if isinstance(registered, Exception):
                raise registered
            return registered

        node = SimpleNamespace(
            plane=SimpleNamespace(receive=lambda: came, timeout=1.0),
            liveness=SimpleNamespace(blocking=lambda seconds: contextlib.nullcontext()),
            client=SimpleNamespace(digest=digest),
            store=SimpleNamespace(buffer=lambda name: self.held),
            _free=lambda name, rid: True, _network_call=contextlib.nullcontext)
        self.take = lambda rid: ChainMixin._leader_from_route(node, rid)
        node._verified = lambda rid, vec: ChainMixin._verified(node, rid, vec)


class _Refused(grpc.RpcError):
    def details(self) -> str:
        return "deadline exceeded"


@pytest.mark.parametrize("case", ["the source's", "forged", "no digest", "no answer"])
def test_a_member_keeps_only_the_leader_its_source_registered(case, caplog):
    leader = np.linspace(0, 1, 64).astype(np.float32)
    came = leader.copy()
    if case == "forged":  # an ancestor (or one claiming to be) changed one element
        came[40] = 0.5
    registered = {"no digest": b"", "no answer": _Refused()}.get(case, sha256_of(leader))
    member = _Member(came, registered)
    with caplog.at_level(logging.WARNING, logger="lsgd.local_server.server"):
        have, staged = member.take(9)
    assert member.asked == [9]
    if case == "the source's":
        assert have and staged is came and np.array_equal(member.held, leader)
        assert not caplog.records
    else:  # nothing applied, nothing forwarded to the server: the server's copy instead
        assert not have and staged is None and not member.held.any()
        assert "is refused" in caplog.text and "taking the server's" in caplog.text


class _Failing(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self) -> str:
        return f"{self._code.name} for the test"


@pytest.mark.parametrize("failures, code, calls, registered", [
    (2, grpc.StatusCode.UNAVAILABLE, 3, True),  # a passing hiccup: registered at the third try
    (5, grpc.StatusCode.UNAVAILABLE, 3, False),
    (5, grpc.StatusCode.PERMISSION_DENIED, 1, False),  # not worth asking again
])
def test_the_source_registers_before_it_sends_and_says_so_when_it_cannot(
        failures, code, calls, registered, caplog, monkeypatch):
    from lsgd.local_server import chain

    monkeypatch.setattr(chain.time, "sleep", lambda s: None)
    slot = np.linspace(0, 1, 32).astype(np.float32)
    tries = []

    def digest(rid: int, sha: bytes = b"", center: bool = False) -> bytes:
        tries.append(sha)
        if len(tries) <= failures:
            raise _Failing(code)
        return sha

    node = SimpleNamespace(plane=SimpleNamespace(stage=np.zeros(32, np.float32)),
                           client=SimpleNamespace(digest=digest),
                           _network_call=contextlib.nullcontext)
    with caplog.at_level(logging.WARNING, logger="lsgd.local_server.server"):
        staged = chain.ChainMixin._send_down_route(node, 5, slot)
    assert np.array_equal(staged, slot) and len(tries) == calls
    assert all(t == sha256_of(slot) for t in tries)
    assert ("could not be registered" in caplog.text) is not registered


# ---------------------------------------------------------------- the new center of a reduce
def _settled_average_round(total: np.ndarray):
    """A store of an `average` job whose round 3 sums (node 0's total of 2) are in."""
    from lsgd.config import JobConfig
    from lsgd.global_server.params import SUM, ParamStore
    from lsgd.plane.messages import sum_route
    from lsgd.rules.base import RoundKind

    params = ParamStore(JobConfig(algorithm="average").make_rule())
    params.set_param_count(total.size)
    route = sum_route(3, {0: (1, 0.0), 1: (1, 0.0)}, {0: "127.0.0.1:1", 1: "127.0.0.1:2"})
    params.begin(3, RoundKind.GLOBAL, None, {0: 1, 1: 1}, 30.0, reduce=route)
    return params, lambda: params.push(0, 3, SUM, total.size, 2, [(0, total.tobytes())])


def test_the_server_vouches_for_the_center_it_made_and_for_nothing_else():
    from lsgd.global_server.params import CENTER

    params, push = _settled_average_round(np.full(8, 4.0, np.float32))
    assert params.center_digest(3, timeout=0.05) is None  # the sums are not in yet
    push()
    assert params.exchange.settled
    assert params.center_digest(3, timeout=0.05) == sha256_of(params.buffers[CENTER])
    assert np.allclose(params.buffers[CENTER], 2.0)  # the mean of the total of two
    assert params.center_digest(2, timeout=0.05) is None  # an older round: over
    assert params.center_digest(0, timeout=0.05) is None
    failed, _ = _settled_average_round(np.ones(8, np.float32))
    failed.fail(3, "the reduce was aborted")
    assert failed.center_digest(3, timeout=0.05) is None  # no new center: nothing to vouch for


def test_nobody_registers_a_centers_digest(chain_server):
    servicer, (c0, c1, c2) = chain_server
    req = dict(sha256=sha256_of(np.zeros(10, np.float32)), center=True)
    with pytest.raises(grpc.RpcError) as e:
        c2.digest(4, **req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "server's own" in e.value.details()
    servicer.digest_wait = 0.05
    assert c1.digest(4, center=True) == b""  # an LSGD job's round has no new center


@pytest.mark.parametrize("case", ["the server's", "forged"])
def test_a_member_keeps_only_the_center_the_server_made(case, caplog):
    from lsgd.local_server.chain import ChainMixin
    from lsgd.plane.messages import sum_route

    made = np.linspace(-1, 1, 16).astype(np.float32)  # the center the server made
    came = made.copy()
    if case == "forged":
        came[3] = 7.0
    held, pulled = np.zeros(16, np.float32), []
    route = sum_route(6, {0: (1, 0.0), 1: (1, 0.0), 2: (1, 0.0)},
                      {i: f"127.0.0.1:{i + 1}" for i in range(3)})
    node = SimpleNamespace(
        plane=SimpleNamespace(current=None, timeout=1.0, begin=lambda info: None,
                              receive=lambda: came),
        liveness=SimpleNamespace(blocking=lambda seconds: contextlib.nullcontext()),
        cfg=SimpleNamespace(node_index=2, wire="float32"),
        client=SimpleNamespace(digest=lambda rid, sha=b"", center=False:
                               sha256_of(made) if center else b""),
        store=SimpleNamespace(buffer=lambda name: held),
        _free=lambda name, rid: True, _network_call=contextlib.nullcontext,
        _pull=lambda name, kind, rid: pulled.append((name, rid)) or True)
    node._verified = lambda rid, vec, center=False: ChainMixin._verified(node, rid, vec, center)
    with caplog.at_level(logging.WARNING, logger="lsgd.local_server.server"):
        assert ChainMixin._center_in(node, 6, route)
    if case == "the server's":
        assert np.array_equal(held, made) and not pulled and not caplog.records
    else:  # refused: the server's copy instead
        assert not held.any() and pulled == [("center", 6)]
        assert "the center that came down the route is refused" in caplog.text
