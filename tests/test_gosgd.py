"""GoSGD: the push-sum merge, the rule's exchange, and the weights of the job summing to 1
throughout, across nodes, through broken uploads and lost deliveries; end to end on 2 nodes."""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest

from conftest import assert_clean_exit, global_summary
from lsgd.global_server.buffers import ParamError
from lsgd.global_server.mail import Mailboxes
from lsgd.local_server.async_node import AsyncNode, buffer_names
from lsgd.local_server.store import NodeStore, StoreLayout
from lsgd.rules import ops
from lsgd.rules.asynchronous import Mine
from lsgd.rules.gosgd import SEND, WEIGHT, GoSGD

P = 64


def test_the_merge_is_the_weighted_mean_of_the_worker_and_its_mail():
    rng = np.random.default_rng(0)
    x, a, b = (rng.normal(size=P).astype(np.float32) for _ in range(3))
    mail = (0.25 * a + 0.125 * b).astype(np.float32)  # two messages of weights 1/4 and 1/8
    want = (0.5 * x + 0.25 * a + 0.125 * b) / 0.875
    distance = ops.merge_(x, 0.5, mail, 0.375)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)
    assert distance > 0
    with pytest.raises(ValueError):
        ops.merge_(x, 0.0, mail, 0.375)


class _Node:
    """The NodeSide of one exchange, by hand."""

    def __init__(self, mail: np.ndarray, weight: float) -> None:
        self.box, self.box_weight, self.posted = mail, weight, []

    def mail(self, mine):
        return self.box, self.box_weight

    def clear_mail(self, mine):
        self.box[:] = 0
        self.box_weight = 0.0

    def post(self, x, weight):
        self.posted.append((x.copy(), weight))


def test_an_exchange_merges_the_mail_then_sends_half_its_weight():
    rule = GoSGD(p=0.5, workers=4)
    x = np.ones(P, np.float32)
    mine = Mine(0, {}, {})
    rule.start_(x, mine)
    assert mine.scalars[WEIGHT] == 0.25
    node = _Node(np.full(P, 0.25 * 3.0, np.float32), 0.25)  # one message: x = 3, weight 1/4
    rule.exchange_(SEND, x, mine, node)
    np.testing.assert_allclose(x, 2.0)  # (1/4 * 1 + 1/4 * 3) / (1/2)
    assert mine.scalars[WEIGHT] == 0.25 and node.box_weight == 0.0  # 1/2, halved
    (sent, w), = node.posted
    assert w == 0.25 and np.allclose(sent, 2.0)
    rule.start_(x, mine)  # a respawned worker keeps its weight
    assert mine.scalars[WEIGHT] == 0.25
    rng = random.Random(1)
    draws = [rule.due(i, rng) for i in range(1000)]
    assert set(draws) == {0, SEND}


def test_a_diverged_worker_is_reset_to_finite_parameters_even_if_it_exchanged_last():
    # The newest parameters that passed an exchange were this very worker's: its slot now holds
    # its non-finite ones, so a reset must not read the slot (it was "reset" to itself, and
    # reset again at its next exchange: 2 resets in the NaN fault test, 1 run in 3).
    rule = GoSGD(p=1.0, workers=2)
    store = NodeStore.create(StoreLayout.new("tgreset", 0, P, 2, buffer_names(rule, 2)))
    try:
        store.slot(0)[:], store.slot(1)[:] = 1.0, 3.0
        store.buffer("global_leader")[:] = 1.0  # the initial model
        side = AsyncNode(rule, store, None, moved=P, sync_every=0.0, job_workers=2)
        for i in (0, 1):
            side.start_worker(i)
        assert side.exchange(1, SEND, True)[0]  # worker 1 gossips last (to worker 0)
        store.slot(1)[::7] = np.nan  # then diverges, and publishes that for its next exchange
        changed, _, reset = side.exchange(1, SEND, False)
        assert changed and reset
        np.testing.assert_array_equal(store.slot(1), 3.0)  # its parameters at its last exchange
        weights = sum(s["weight"] for s in side.scalars.values()) + side.mailroom.weights()
        assert weights == pytest.approx(1.0, abs=1e-12)  # it kept its weight
    finally:
        store.close(unlink=True)


class _FlakyClient:
    """The mail calls of a GlobalClient, straight into a ``Mailboxes``; some break, before or
    after the server acted (a lost request, a lost answer)."""

    def __init__(self, boxes: Mailboxes, node: int, live: list[int], rng: random.Random) -> None:
        self.boxes, self.node, self.live, self.rng = boxes, node, live, rng
        self.in_transit = 0.0  # weight the server handed out whose answer was lost
        self.arrived = 0.0  # weight of mail that arrived but whose answer was lost (a copy
        # stays on the node, owed, until it is sent again and found posted)

    def _maybe_break(self) -> None:
        if self.rng.random() < 0.2:
            raise _Broken()

    def push_mail(self, vec, number, weight):
        self._maybe_break()  # lost on the way: nothing arrived
        self.boxes.post(self.node, 1, number, weight, self.live,
                        [(0, vec.astype("<f4").tobytes())], np.dtype("<f4"))
        self.arrived = weight
        self._maybe_break()  # arrived, the answer was lost: sent again, a no-op then
        self.arrived = 0.0

    def pull_mail(self, number, out):
        self._maybe_break()
        vec, weight = self.boxes.take(self.node, 1, number)
        self.in_transit = 0.0
        if self.rng.random() < 0.2 and vec is not None:  # the delivery broke on the way
            self.in_transit = weight
            raise _Broken()
        if vec is not None:
            out[:] = vec
        return weight


class _Broken(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "broken on purpose"


def _held(boxes: Mailboxes, clients) -> float:
    """The server's weight not counted elsewhere: mail waiting, and deliveries whose answer
    was lost (a delivery that arrived is in its node's mailboxes until acknowledged)."""
    return sum(b.pending_weight for b in boxes._boxes.values()) + sum(
        c.in_transit - c.arrived for c in clients)


def test_the_weights_of_workers_and_mail_sum_to_1_throughout():
    nodes, workers = 3, 2
    rule = GoSGD(p=1.0, workers=nodes * workers)
    rng = random.Random(7)
    boxes = Mailboxes(P, rng=rng)
    stores, sides, clients = [], [], []
    try:
        for n in range(nodes):
            store = NodeStore.create(StoreLayout.new("tgosgd", n, P, workers,
                                                     buffer_names(rule, workers)))
            stores.append(store)
            for i in range(workers):
                store.slot(i)[:] = n * workers + i  # every worker starts apart
            client = _FlakyClient(boxes, n, list(range(nodes)), rng)
            clients.append(client)
            side = AsyncNode(rule, store, client, moved=P, sync_every=0.0,
                             job_workers=nodes * workers)
            for i in range(workers):
                side.start_worker(i)
            sides.append(side)

        def total() -> float:
            return (sum(s["weight"] for side in sides for s in side.scalars.values())
                    + sum(side.mailroom.weights() for side in sides) + _held(boxes, clients))

        for _ in range(600):
            n = rng.randrange(nodes)
            if rng.random() < 0.6:
                sides[n].exchange(rng.randrange(workers), SEND, True)
            else:
                sides[n].sync()  # may break anywhere: nothing is lost
            assert total() == pytest.approx(1.0, abs=1e-12)
        for side in sides:  # deliver everything: every answer gets through
            for c in clients:
                c.rng = random.Random(0)
                c._maybe_break = lambda: None
        for _ in range(3):
            for side in sides:
                assert side.sync()
        for side in sides:
            for i in range(workers):
                side.exchange(i, SEND, True)  # merge what arrived
        assert total() == pytest.approx(1.0, abs=1e-12)
        assert boxes.posted > 20 and boxes.delivered > 20
        spread = np.ptp([s.slot(i)[0] for s in stores for i in range(workers)])
        assert spread < 5.0  # gossip moved the workers toward each other (they started 0..5)
    finally:
        for store in stores:
            store.close(unlink=True)


def test_the_server_refuses_mail_it_cannot_take():
    boxes = Mailboxes(4)
    four = [(0, np.ones(4, "<f4").tobytes())]
    with pytest.raises(ParamError, match="weight"):
        boxes.post(0, 1, 1, 2.0, [0, 1], four, np.dtype("<f4"))
    with pytest.raises(ParamError, match="ended at 2"):
        boxes.post(0, 1, 1, 0.5, [0, 1], [(0, np.ones(2, "<f4").tobytes())], np.dtype("<f4"))
    with pytest.raises(ParamError, match="non-finite"):
        boxes.post(0, 1, 1, 0.5, [0, 1], [(0, np.full(4, np.nan, "<f4").tobytes())],
                   np.dtype("<f4"))
    with pytest.raises(ParamError, match="next is 1"):
        boxes.post(0, 1, 3, 0.5, [0, 1], four, np.dtype("<f4"))
    assert boxes.post(0, 1, 1, 0.5, [0, 1], four, np.dtype("<f4")) == 1  # the other node
    assert boxes.post(0, 1, 1, 0.5, [0, 1], four, np.dtype("<f4")) is None  # again: a no-op
    vec, w = boxes.take(1, 9, 1)
    assert w == 0.5 and np.allclose(vec, 1.0)
    assert boxes.take(1, 9, 1)[1] == 0.5  # asked again: resent
    assert boxes.take(1, 9, 2) == (None, 0.0)  # acknowledged, nothing more
    with pytest.raises(ParamError, match="next is"):
        boxes.take(1, 9, 1)
    assert boxes.weights_held() == 0.0


@pytest.mark.timeout(180)
def test_gosgd_trains_digits_on_two_nodes_and_its_weights_still_sum_to_1(cluster):
    knobs = dict(NUM_GROUPS=2, WORKERS=2, ITERATIONS=6000, ALGORITHM="gosgd",
                 RULE_ARGS="p=0.05")
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n1.wait(150) == 0, n1.output
    assert n0.wait(30) == 0, n0.output
    g = global_summary(cluster.run_dir)
    summaries = [n0.summary(), n1.summary()]
    done = sum(sum(s["workers"].values()) for s in summaries)
    assert g["counter"] == done == knobs["ITERATIONS"]
    assert g["rounds"] == 1  # only the final one
    weight = g["mail"]["weight_held"] + sum(
        sum(s["async"]["weights"].values()) + s["async"]["mail_weight"] for s in summaries)
    assert weight == pytest.approx(1.0, abs=1e-9)
    assert g["mail"]["posted"] > 5  # mail did cross nodes
    assert summaries[0]["evaluation"]["average"]["accuracy"] >= 0.95, summaries[0]["evaluation"]
    assert_clean_exit(cluster.run_dir, [n0, n1])
