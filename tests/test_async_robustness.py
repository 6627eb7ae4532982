"""Rules without a barrier when something is wrong (issue 12, review): a delta or a mail that
would overflow is refused and moves nothing; a node drops what the server refused for good
instead of sending it forever, and keeps refused mail's weight; a GoSGD worker that leaves for
good hands on its weight and gets no more mail; a rule that raises resets the worker, not the
node; a flush never runs beside a sync in flight."""

from __future__ import annotations

import random
import threading
import time
import uuid

import grpc
import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.buffers import CENTER, ParamError
from lsgd.global_server.mail import Mailboxes
from lsgd.global_server.params import ParamStore
from lsgd.local_server.async_node import AsyncNode, buffer_names
from lsgd.local_server.store import NodeStore, StoreLayout
from lsgd.rules import AsyncEASGD
from lsgd.rules.asynchronous import SENDING
from lsgd.rules.gosgd import SEND, WEIGHT, GoSGD

P = 64
F32 = np.dtype("<f4")
BIG = np.float32(3e38)  # finite; twice it is not


def seeded_store(init: np.ndarray) -> ParamStore:
    store = ParamStore(AsyncEASGD())
    store.set_param_count(init.size)
    store.push(0, 0, CENTER, init.size, 0, iter([(0, init.astype(F32).tobytes())]))
    return store


def test_a_finite_delta_that_would_overflow_the_center_is_refused_and_moves_nothing():
    init = np.ones(P, np.float32)
    init[5] = BIG
    store = seeded_store(init)
    delta = np.zeros(P, np.float32)
    delta[5] = BIG
    with pytest.raises(ParamError) as e:
        store.push_delta(0, 1, 1, P, iter([(0, delta.tobytes())]), F32)
    assert e.value.code == "INVALID_ARGUMENT" and "non-finite at element 5" in str(e.value)
    np.testing.assert_array_equal(store.buffers[CENTER], init)  # still finite, unchanged
    store.push_delta(0, 1, 2, P, iter([(0, np.ones(P, np.float32).tobytes())]), F32)
    assert store.buffers[CENTER][0] == 2.0  # the node's next delta is taken


def test_mail_that_would_overflow_a_mailbox_is_refused_and_the_mailbox_stays_whole():
    boxes = Mailboxes(P, rng=random.Random(0))
    big = np.full(P, BIG, np.float32)
    assert boxes.post(0, 1, 1, 0.5, [0, 1], [(0, big.tobytes())], F32) == 1
    with pytest.raises(ParamError) as e:
        boxes.post(0, 1, 2, 0.25, [0, 1], [(0, big.tobytes())], F32)
    assert e.value.code == "INVALID_ARGUMENT" and "non-finite" in str(e.value)
    vec, weight = boxes.take(1, 7, 1)
    assert weight == 0.5 and np.array_equal(vec, big)


class _Refusing(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.INVALID_ARGUMENT) -> None:
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "refused on purpose"


class _Client:
    """A node's client whose pushes are refused for good (INVALID_ARGUMENT) the first
    ``refuse`` times; its downloads come from ``server``."""

    node = 0

    def __init__(self, server: ParamStore | None, refuse: int = 1,
                 mail: Mailboxes | None = None) -> None:
        self.server, self.refuse, self.mailboxes = server, refuse, mail
        self.pushed: list[int] = []

    def push(self, buffer, vec, round_id, summands=0, wire="float32", weight=0.0):
        if self.refuse:
            self.refuse -= 1
            raise _Refusing()
        self.server.push_delta(0, 1, round_id, vec.size, iter([(0, vec.tobytes())]), F32)
        self.pushed.append(round_id)

    def pull(self, buffer, out, round_id, wire="float32"):
        for off, data in self.server.pull(round_id, buffer, 777, 5.0):
            out[off : off + len(data) // 4] = np.frombuffer(data, F32)

    def push_mail(self, vec, number, weight):
        if self.refuse:
            self.refuse -= 1
            raise _Refusing()
        self.mailboxes.post(0, 1, number, weight, [0, 1], [(0, vec.tobytes())], F32)

    def pull_mail(self, number, out):
        vec, weight = self.mailboxes.take(0, 1, number)
        if vec is not None:
            out[:] = vec
        return weight


def _store(rule, workers: int) -> NodeStore:
    return NodeStore.create(StoreLayout.new("t" + uuid.uuid4().hex[:10], 0, P, workers,
                                            buffer_names(rule, workers)))


def test_a_delta_refused_for_good_is_dropped_and_the_next_one_goes_through():
    server = seeded_store(np.zeros(P, np.float32))
    rule = AsyncEASGD(alpha=1.0, every=1)
    st = _store(rule, 1)
    try:
        node = AsyncNode(rule, st, _Client(server), moved=P, sync_every=0.0)
        node.start_worker(0)
        st.slot(0)[:] = 2.0
        node.exchange(0, 1, True)  # x - center = 2: the delta 2 goes to the outbox
        assert node.sync() is True  # refused for good: dropped, not an error to retry
        assert node.stats()["deltas_refused"] == 1 and not node.pending
        st.slot(0)[:] = 3.0
        node.exchange(0, 1, True)
        assert node.sync() is True
        assert node.client.pushed == [2]  # numbered on from the dropped one
        np.testing.assert_array_equal(server.buffers[CENTER], 3.0)
        np.testing.assert_array_equal(st.buffer(CENTER), 3.0)
    finally:
        st.close(unlink=True)


def test_a_delta_the_server_could_not_take_now_is_sent_again():
    server = seeded_store(np.zeros(P, np.float32))
    rule = AsyncEASGD(alpha=1.0, every=1)
    st = _store(rule, 1)
    try:
        client = _Client(server, refuse=0)
        node = AsyncNode(rule, st, client, moved=P, sync_every=0.0)
        node.start_worker(0)
        st.slot(0)[:] = 2.0
        node.exchange(0, 1, True)

        def unavailable(*a, **k):
            raise _Refusing(grpc.StatusCode.UNAVAILABLE)
        client.push, push = unavailable, client.push
        assert node.sync() is False and node.pending  # kept, owed
        client.push = push
        assert node.sync() is True and client.pushed == [1]
        np.testing.assert_array_equal(server.buffers[CENTER], 2.0)
    finally:
        st.close(unlink=True)


def _gossip_node(workers: int, job_workers: int, client) -> tuple[AsyncNode, NodeStore]:
    rule = GoSGD(p=1.0, workers=job_workers)
    st = _store(rule, workers)
    for i in range(workers):
        st.slot(i)[:] = float(i + 1)
    st.buffer("global_leader")[:] = 1.0
    node = AsyncNode(rule, st, client, moved=P, sync_every=0.0, job_workers=job_workers)
    node.mailroom.rng = random.Random(0)
    for i in range(workers):
        node.start_worker(i)
    return node, st


def _total(node: AsyncNode) -> float:
    return sum(s.get(WEIGHT, 0.0) for s in node.scalars.values()) + node.mailroom.weights()


def test_mail_refused_for_good_stays_with_a_worker_of_the_node():
    node, st = _gossip_node(1, 2, _Client(None, refuse=1, mail=Mailboxes(P)))
    try:
        node.exchange(0, SEND, True)  # its only peer is on another node: half goes out
        assert node.mailroom.out_weight == 0.25
        assert node.sync() is True  # refused for good: kept here, not sent forever
        assert node.stats()["mail_refused"] == 1 and not node.pending
        assert _total(node) == pytest.approx(0.5, abs=1e-12)  # the node's share, all of it
        assert node.mailroom.weight[0] == 0.25  # in its worker's mailbox, merged next time
    finally:
        st.close(unlink=True)


def test_a_gosgd_worker_that_leaves_for_good_hands_on_its_weight_and_gets_no_mail():
    node, st = _gossip_node(3, 3, None)
    try:
        for _ in range(30):
            for i in range(3):
                node.exchange(i, SEND, True)
        assert _total(node) == pytest.approx(1.0, abs=1e-12)
        node.retire_worker(1)
        node.retire_worker(1)  # once only
        assert WEIGHT not in node.scalars[1] and node.mailroom.weight[1] == 0.0
        assert _total(node) == pytest.approx(1.0, abs=1e-12)
        for _ in range(200):
            for i in (0, 2):
                node.exchange(i, SEND, True)
        assert node.mailroom.weight[1] == 0.0  # nothing went to it
        assert _total(node) == pytest.approx(1.0, abs=1e-12)
        assert min(node.scalars[i][WEIGHT] for i in (0, 2)) > 0.05  # the weights did not drain
        node.retire_worker(0)
        node.retire_worker(2)  # the last one: it keeps what it held, counted
        assert _total(node) == pytest.approx(1.0, abs=1e-12)
    finally:
        st.close(unlink=True)


def test_a_respawned_gosgd_worker_never_starts_from_non_finite_parameters():
    node, st = _gossip_node(2, 2, None)
    try:
        node.exchange(0, SEND, True)  # the node's newest exchanged parameters: worker 0's
        good = st.slot(0).copy()
        st.slot(1)[3] = np.nan  # worker 1 died having written NaNs
        node.restart_worker(1)
        np.testing.assert_array_equal(st.slot(1), good)
        st.slot(0)[:] = 7.0
        node.restart_worker(0)  # finite: it starts from its own slot
        np.testing.assert_array_equal(st.slot(0), 7.0)
    finally:
        st.close(unlink=True)


def test_gosgd_takes_no_workers_argument():
    cfg = JobConfig(num_groups=2, workers=3, algorithm="gosgd")
    assert GoSGD.from_config(cfg).workers == 6
    with pytest.raises(ValueError, match="no 'workers' argument"):
        GoSGD.from_config(cfg, workers=2)


class _Broken(AsyncEASGD):
    def exchange_(self, action, x, mine, node):
        x[:] = np.nan  # half done, then a bug
        raise ZeroDivisionError("a bug in the rule")


def test_a_rule_that_raises_in_an_exchange_resets_the_worker_not_the_node():
    server = seeded_store(np.full(P, 4.0, np.float32))
    rule = _Broken(alpha=0.5, every=1)
    st = _store(rule, 1)
    try:
        st.buffer(CENTER)[:] = 4.0
        node = AsyncNode(rule, st, _Client(server, refuse=0), moved=P, sync_every=0.0)
        node.start_worker(0)
        changed, distance, reset = node.exchange(0, 1, True)
        assert changed and reset and np.isnan(distance)
        np.testing.assert_array_equal(st.slot(0), 4.0)  # the center
        assert node.stats()["rule_failures"] == 1 and node.stats()["exchanges"] == 0
    finally:
        st.close(unlink=True)


@pytest.mark.timeout(30)
def test_flush_never_syncs_beside_a_sync_in_flight_and_keeps_to_its_time():
    server = seeded_store(np.zeros(P, np.float32))
    rule = AsyncEASGD(alpha=1.0, every=1)
    st = _store(rule, 1)
    release, entered = threading.Event(), threading.Event()
    inside = []

    class Slow(_Client):
        def push(self, *a, **k):
            inside.append(1)
            assert len(inside) == 1, "two syncs at once"
            entered.set()
            release.wait(10)
            super().push(*a, **k)
            inside.pop()

    try:
        node = AsyncNode(rule, st, Slow(server, refuse=0), moved=P, sync_every=0.0)
        node.start_worker(0)
        node.start()
        st.slot(0)[:] = 2.0
        node.exchange(0, 1, True)  # the thread syncs, and hangs in the push
        assert entered.wait(5)
        t0 = time.monotonic()
        assert node.flush(0.3) is False  # it never ran a sync beside the hung one
        assert time.monotonic() - t0 < 1.5
        release.set()
        node.stop()
        assert node.client.pushed == [1]  # the delta went once, by the thread
        np.testing.assert_array_equal(st.buffer(SENDING), 2.0)
    finally:
        release.set()
        st.close(unlink=True)
