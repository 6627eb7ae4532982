"""A node's Leave on its session stream (issue 15): on the session port, the node's last call
is a message of its stream, not a unary call (at the end of a 512-node job, 512 unary calls
held up the last rounds of the other nodes). It counts as ``Leave`` does, its MAC covers its
own field, and a node whose stream is held by another call leaves with the unary call.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from lsgd.proto import lsgd_pb2 as pb
from lsgd.signing import ACQUIRE_FIELD, LEAVE_FIELD
from tests.test_session_vectors import _joined, _one_signed, server, transport  # noqa: F401


def _no_unary(c) -> None:  # noqa: ANN001
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the unary Leave was used")

    c._stub.Leave = refuse


def test_a_node_leaves_on_its_stream_where_it_has_the_session_port(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    g = a.acquire(consumed=0, late=0, released=0, want=4, last_round_seen=0, max_wait=0)
    on_port = bool(a._session_port)
    if on_port:
        _no_unary(a)
    assert a.leave(consumed=g.grant, late=0) == g.grant  # its steps count
    assert servicer.coord.nodes[0].left and servicer.coord.done == g.grant
    assert servicer.calls.counts["Leave"] == 1
    a.close(), b.close()


@pytest.mark.parametrize("transport", ["aio"], indirect=True)
def test_a_node_whose_stream_is_busy_leaves_with_the_unary_call(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    assert a._session_port
    held = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with a._call_lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        t0 = time.monotonic()
        assert a.leave(consumed=0, late=0) == 0
        assert time.monotonic() - t0 < 2  # it did not wait for the stream
        assert servicer.coord.nodes[0].left
    finally:
        done.set()
        t.join(5)
    a.close(), b.close()


@pytest.mark.parametrize("server", ["secret"], indirect=True)  # MACs need a job secret
def test_a_leave_message_needs_the_mac_of_its_own_field(server):
    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    body = pb.LeaveRequest(node=a._node()).SerializeToString()
    refused = _one_signed(server, a._node(), "leave", body, ACQUIRE_FIELD)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "MAC" in refused.details()
    assert not servicer.coord.nodes[0].left
    reply = _one_signed(server, a._node(), "leave", body, LEAVE_FIELD)
    assert reply.code == 0 and servicer.coord.nodes[0].left
    a.close(), b.close()


@pytest.mark.parametrize("transport", ["aio"], indirect=True)
def test_a_call_cut_by_ctrl_c_leaves_no_reply_for_the_leave_after_it(server, monkeypatch):
    """Ctrl-C raises KeyboardInterrupt in the node loop's call, here a report waiting in its
    round's barrier; node 0 then leaves to stop the job. The cut call's stream is closed, so
    the Leave does not go there (it would queue behind the barrier, and then read the
    report's answer as its own): it is the unary call, at once."""
    from lsgd.local_server.session_socket import SocketSession
    from tests.test_carried_transfers import _to_round

    servicer, addr, security = server
    a, b = _joined(addr, security, 0), _joined(addr, security, 1)
    rid = {}
    ts = [threading.Thread(target=lambda c=c: rid.setdefault(c.node_index, _to_round(c)))
          for c in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    real = SocketSession._read

    def cut(self, size, deadline):  # noqa: ANN001, ANN202
        monkeypatch.setattr(SocketSession, "_read", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(SocketSession, "_read", cut)
    assert not servicer.coord.round.closed
    with pytest.raises(KeyboardInterrupt):  # sent: node 0 waits in the barrier (node 1 has
        a.report_round(rid[0], None, 2)  # not reported), its answer never read
    t0 = time.monotonic()
    a.leave(consumed=0, late=0, stop_job="interrupted (test)")
    assert time.monotonic() - t0 < 1.0  # not after the round's time-out (1.5 s)
    assert servicer.coord.stopped is not None and servicer.coord.nodes[0].left
    assert 0 in servicer.coord.round.reports  # the cut report had reached the barrier
    a.close(), b.close()
