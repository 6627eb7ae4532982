"""Asynchronous rules never lose or double an update (issue 12): concurrent center deltas, some
broken midway and sent again, add up exactly in the global server's center, in process and over
real gRPC on 127.0.0.1; and ``AsyncNode`` (the node's side, with real shared memory) delivers
every delta its rules made through a flaky connection, or keeps it while there is none.

Every value is a small integer in float32, so every sum is exact and compared with ==.
"""

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
from lsgd.global_server.params import ParamStore
from lsgd.global_server.server import build_servicer, create_server
from lsgd.local_server import async_node
from lsgd.local_server.async_node import AsyncNode, buffer_names
from lsgd.local_server.global_client import GlobalClient
from lsgd.local_server.session_stream import CallError
from lsgd.local_server.store import NodeStore, StoreLayout
from lsgd.proto import lsgd_pb2 as pb
from lsgd.proto import lsgd_pb2_grpc as pb_grpc
from lsgd.rules import AsyncEASGD, Downpour
from lsgd.rules.asynchronous import OUTBOX, SENDING
from lsgd.rules.downpour import FETCH, PUSH

F32 = np.dtype("<f4")


def cut(vec: np.ndarray, rng: random.Random, pieces: int) -> list[tuple[int, bytes]]:
    """``vec`` as (offset, bytes) chunks cut at ``pieces - 1`` random places."""
    bounds = sorted(rng.sample(range(1, vec.size), pieces - 1)) if pieces > 1 else []
    edges = [0, *bounds, vec.size]
    return [(lo, vec[lo:hi].astype(F32).tobytes()) for lo, hi in zip(edges, edges[1:])]


class Broken(ConnectionError):
    pass


def broken(chunks, after: int):
    yield from chunks[:after]
    raise Broken("the upload broke midway")


def seeded_store(init: np.ndarray) -> ParamStore:
    store = ParamStore(Downpour())
    store.set_param_count(init.size)
    store.push(0, 0, CENTER, init.size, 0, iter([(0, init.astype(F32).tobytes())]))
    return store


# ---------------------------------------------------------------------------- in process
@pytest.mark.timeout(60)
def test_concurrent_broken_and_retried_delta_uploads_never_lose_an_update():
    P, NODES, DELTAS = 4000, 4, 25
    init = np.random.default_rng(0).integers(-100, 100, P).astype(np.float32)
    store = seeded_store(init)
    deltas = {n: np.random.default_rng(10 + n).integers(-8, 9, (DELTAS, P)).astype(np.float32)
              for n in range(NODES)}
    errors: list[BaseException] = []
    stop = threading.Event()
    pulls = [0]

    def node(n: int) -> None:
        rng = random.Random(n)
        try:
            for seq, delta in enumerate(deltas[n], 1):
                if seq % 3 == 1:  # broken once, at a random chunk, then sent whole
                    chunks = cut(delta, rng, rng.randint(2, 6))
                    with pytest.raises(Broken):
                        store.push_delta(n, 1, seq, P, broken(chunks, rng.randrange(len(chunks))),
                                         F32)
                store.push_delta(n, 1, seq, P, iter(cut(delta, rng, rng.randint(1, 6))), F32)
                if seq % 5 == 0:  # its answer was lost: the node sends it again
                    store.push_delta(n, 1, seq, P, iter(cut(delta, rng, 3)), F32)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def downloads() -> None:
        try:
            while not stop.is_set():
                got = np.concatenate([np.frombuffer(b, F32)
                                      for _, b in store.pull(0, CENTER, 1000, 5.0)])
                assert got.size == P and np.isfinite(got).all()
                assert np.array_equal(got, np.round(got))  # whole sums of whole deltas
                pulls[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(n,)) for n in range(NODES)]
    reader = threading.Thread(target=downloads)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    stop.set()
    reader.join(10)
    assert not any(t.is_alive() for t in [*threads, reader]), "a thread hung"
    assert not errors, errors
    assert pulls[0] > 0
    expected = init + sum(d.sum(axis=0) for d in deltas.values())
    np.testing.assert_array_equal(store.buffers[CENTER], expected)
    assert store.deltas.applied == NODES * DELTAS  # answers lost and resent: not counted twice
    assert store.deltas.retried == NODES * len(range(1, DELTAS + 1, 3))


# ---------------------------------------------------------------------------- over gRPC
@pytest.fixture
def grpc_server():
    config = JobConfig(num_groups=4, workers=1, job_id="job", algorithm="easgd-async",
                       round_timeout=5.0)
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer)
    clients: list[GlobalClient] = []
    yield servicer, f"127.0.0.1:{port}", clients
    for c in clients:
        c.close()
    srv.stop(grace=0.5).wait(5)


RETRYABLE = {grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.mark.timeout(60)
def test_concurrent_delta_uploads_over_grpc_add_up_exactly(grpc_server):
    """Three nodes send numbered deltas at once on their own channels, a third of them broken
    midway (the stream cut short, or cancelled by the client) and sent again cut elsewhere;
    a fourth node downloads the center meanwhile, and no download fails."""
    servicer, addr, clients = grpc_server
    P, PUSHERS, DELTAS = 5000, 3, 12
    for i in range(PUSHERS + 1):
        c = GlobalClient(addr, "job", i, round_timeout=5.0)
        clients.append(c)
        c.join(workers=1, param_count=P, algorithm="easgd-async", num_groups=4,
               connect_timeout=5)
    init = np.random.default_rng(0).integers(-100, 100, P).astype(np.float32)
    clients[0].push("center", init, round_id=0)
    deltas = {n: np.random.default_rng(20 + n).integers(-8, 9, (DELTAS, P)).astype(np.float32)
              for n in range(PUSHERS)}
    errors: list[BaseException] = []
    stop = threading.Event()
    pulls = [0]

    def raw_push(c: GlobalClient, stub, seq: int, chunks, fail: str | None):
        header = pb.PushHeader(node=c._node(), round_id=seq, buffer=pb.BUFFER_KIND_CENTER_DELTA,
                               param_count=P)

        def requests():
            yield pb.PushParamsRequest(header=header)
            for i, (off, data) in enumerate(chunks):
                if fail and i == len(chunks) // 2:
                    if fail == "cancel":
                        raise Broken("the node's upload broke midway")
                    return  # "short": the stream ends early
                yield pb.PushParamsRequest(chunk=pb.ParamChunk(offset=off, data=data))

        stub.PushParams(requests(), timeout=10, metadata=c._md)

    def node(n: int) -> None:
        c, rng = clients[n], random.Random(n)
        stub = pb_grpc.GlobalServerStub(c._channel)
        try:
            for seq, delta in enumerate(deltas[n], 1):
                if seq % 3 == 1:
                    with pytest.raises(grpc.RpcError):
                        raw_push(c, stub, seq, cut(delta, rng, 4),
                                 "cancel" if seq % 2 else "short")
                for attempt in range(200):  # the server may still hold the broken stream
                    try:
                        if seq % 2:
                            raw_push(c, stub, seq, cut(delta, rng, rng.randint(1, 5)), None)
                        else:
                            c.push("center_delta", delta, round_id=seq)  # the node's own path
                        break
                    except grpc.RpcError as exc:
                        if exc.code() not in RETRYABLE:
                            raise
                        time.sleep(0.01)
                else:
                    raise AssertionError(f"node {n}: delta {seq} refused 200 times")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def downloads() -> None:
        out = np.zeros(P, np.float32)
        try:
            while not stop.is_set():
                clients[PUSHERS].pull("center", out, round_id=0)
                assert np.isfinite(out).all() and np.array_equal(out, np.round(out))
                pulls[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(n,)) for n in range(PUSHERS)]
    reader = threading.Thread(target=downloads)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    stop.set()
    reader.join(10)
    assert not any(t.is_alive() for t in [*threads, reader]), "a thread hung"
    assert not errors, errors
    assert pulls[0] > 0
    out = np.zeros(P, np.float32)
    clients[PUSHERS].pull("center", out, round_id=0)
    np.testing.assert_array_equal(out, init + sum(d.sum(axis=0) for d in deltas.values()))
    assert servicer.params.deltas.applied == PUSHERS * DELTAS
    assert servicer.params.deltas.retried >= PUSHERS * 2  # at least the streams cut short


def test_a_synchronous_rule_refuses_center_deltas_over_grpc():
    config = JobConfig(num_groups=1, workers=1, job_id="job", algorithm="easgd")
    servicer = build_servicer(config)
    srv, port = create_server("127.0.0.1:0", servicer)
    c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=5.0)
    try:
        c.join(workers=1, param_count=4, algorithm="easgd", num_groups=1, connect_timeout=5)
        c.push("center", np.zeros(4, np.float32), round_id=0)
        with pytest.raises(grpc.RpcError) as e:
            c.push("center_delta", np.ones(4, np.float32), round_id=1)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        np.testing.assert_array_equal(servicer.params.buffers[CENTER], 0.0)
    finally:
        c.close()
        srv.stop(grace=0.5).wait(5)


# ---------------------------------------------------------------------------- AsyncNode
class FlakyClient:
    """A node's ``GlobalClient`` straight into a ``ParamStore``, breaking now and then.

    Its first upload breaks midway (part of the delta applied), the answer to its second is
    lost (applied whole), and after that each upload or download fails with probability
    ``flaky``, uploads midway. ``down``: every call fails, applying nothing.
    """

    def __init__(self, store: ParamStore, node: int, seed: int, flaky: float = 0.2,
                 down: bool = False) -> None:
        self.store, self.node, self.session = store, node, 1000 + node
        self.rng, self.flaky, self.down = random.Random(seed), flaky, down
        self.pushes = 0
        self.lock = threading.Lock()  # the sync thread and flush() never overlap, but be sure

    def _fail(self, what: str) -> CallError:
        return CallError(grpc.StatusCode.UNAVAILABLE, f"{what}: connection reset")

    def push(self, buffer: str, vec: np.ndarray, round_id: int, summands: int = 0,
             wire: str = "float32", weight: float = 0.0) -> None:
        assert buffer == "center_delta" and wire == "float32" and vec.dtype == np.float32
        with self.lock:
            if self.down:
                raise self._fail("push")
            self.pushes += 1
            chunks = cut(vec, self.rng, self.rng.randint(2 if self.pushes == 1 else 1, 5))
            midway = self.pushes == 1 or (self.pushes > 2 and self.rng.random() < self.flaky)
            lost = self.pushes == 2 or self.rng.random() < self.flaky / 2
        try:
            if midway and len(chunks) > 1:
                self.store.push_delta(self.node, self.session, round_id, vec.size,
                                      broken(chunks, self.rng.randrange(1, len(chunks))), F32)
            self.store.push_delta(self.node, self.session, round_id, vec.size, iter(chunks), F32)
        except Broken:
            raise self._fail("push") from None
        except ParamError as exc:
            raise CallError(getattr(grpc.StatusCode, exc.code), str(exc)) from None
        if lost:
            raise self._fail("push answer")

    def pull(self, buffer: str, out: np.ndarray, round_id: int, wire: str = "float32") -> None:
        with self.lock:
            if self.down or self.rng.random() < self.flaky:
                raise self._fail("pull")
        for off, data in self.store.pull(round_id, buffer, 777, 5.0):
            out[off : off + len(data) // 4] = np.frombuffer(data, F32)


class Recording:
    """Wraps an async rule: keeps the sum of every delta its exchanges made (outbox after
    minus before, under the node's lock) and checks that the center moved by the same."""

    def __init__(self, rule) -> None:
        self.rule, self.total, self.calls = rule, None, 0

    def __getattr__(self, name):
        return getattr(self.rule, name)

    def exchange_(self, action, x, mine, node):
        out0, c0 = node.outbox.astype(np.float64), node.center.astype(np.float64)
        distance = self.rule.exchange_(action, x, mine, node)
        d = node.outbox - out0
        assert np.array_equal(node.center - c0, d), "the center and the outbox moved apart"
        self.total = d if self.total is None else self.total + d
        self.calls += 1
        return distance


def make_node(rule, server: ParamStore, client, P: int, moved: int, workers: int, init,
              stores: list) -> AsyncNode:
    layout = StoreLayout.new("t" + uuid.uuid4().hex[:10], client.node, P, workers,
                             buffer_names(rule, workers))
    st = NodeStore.create(layout)
    stores.append(st)
    for i in range(workers):
        st.slot(i)[:] = init
    st.buffer(CENTER)[:] = init
    node = AsyncNode(rule, st, client, moved=moved, sync_every=0.001)
    for i in range(workers):
        node.start_worker(i)
    return node


RULE_CASES = {
    # alpha 1 keeps every value a whole number (a smaller alpha makes fractions that round)
    "easgd-async": (lambda: AsyncEASGD(alpha=1.0, every=1), lambda rng: 1),
    "downpour": (lambda: Downpour(), lambda rng: rng.choice([PUSH, PUSH, FETCH, PUSH | FETCH])),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_async_nodes_deliver_every_delta_through_a_flaky_connection(monkeypatch, case):
    monkeypatch.setattr(async_node, "RETRY", 0.01)
    make_rule, action = RULE_CASES[case]
    P, MOVED, NODES, WORKERS = 3000, 2990, 3, 2  # the last 10 entries: statistics, not moved
    init = np.random.default_rng(0).integers(-20, 20, P).astype(np.float32)
    server = ParamStore(make_rule())
    server.set_param_count(P)
    server.push(0, 0, CENTER, P, 0, iter([(0, init.tobytes())]))
    stores: list[NodeStore] = []
    nodes: list[AsyncNode] = []
    try:
        for n in range(NODES):
            nodes.append(make_node(Recording(make_rule()), server,
                                   FlakyClient(server, n, seed=n), P, MOVED, WORKERS, init,
                                   stores))
            nodes[-1].start()
        rng, steps = random.Random(1), np.random.default_rng(2)
        exchanges = [0] * NODES
        end = time.monotonic() + 20
        for it in range(150):
            for n, node in enumerate(nodes):
                for i in range(WORKERS):
                    x = stores[n].slot(i)[:MOVED]
                    x += steps.integers(-3, 4, MOVED).astype(np.float32)  # a worker's steps
                    if rng.random() < 0.5:
                        assert node.exchange(i, action(rng), True)[0]
                        exchanges[n] += 1
            time.sleep(0.001)  # let the sync threads run
            assert time.monotonic() < end
        assert all(node.flush(10.0) for node in nodes)
        total = sum(node.rule.total for node in nodes)
        center = server.buffers[CENTER]
        np.testing.assert_array_equal(center[:MOVED], init[:MOVED] + total)
        np.testing.assert_array_equal(center[MOVED:], init[MOVED:])  # the statistics tail
        stats = [node.stats() for node in nodes]
        print(case, stats, server.deltas.applied, server.deltas.retried)
        assert [s["exchanges"] for s in stats] == exchanges
        assert [node.rule.calls for node in nodes] == exchanges
        assert server.deltas.applied == sum(s["deltas_sent"] for s in stats)
        for node, s in zip(nodes, stats):
            assert s["sync_failures"] >= 2 and s["syncs"] >= 1  # the broken upload, the lost answer
            assert not node.owed and not node.outbox.any()
            assert node.exchange(0, action(rng), True)[0] is False  # closed: moves nothing
        assert server.deltas.retried >= NODES  # each node's first upload continued
    finally:
        for node in nodes:
            node.stop()
        for st in stores:
            st.close(unlink=True)


@pytest.mark.timeout(30)
def test_a_node_that_cannot_reach_the_server_keeps_its_deltas_and_flush_gives_up_in_time(
        monkeypatch):
    monkeypatch.setattr(async_node, "RETRY", 0.05)
    P = 1000
    init = np.zeros(P, np.float32)
    server = ParamStore(Downpour())
    server.set_param_count(P)
    server.push(0, 0, CENTER, P, 0, iter([(0, init.tobytes())]))
    client = FlakyClient(server, 0, seed=0, flaky=0.0, down=True)
    stores: list[NodeStore] = []
    node = make_node(Recording(Downpour()), server, client, P, P, 2, init, stores)
    try:
        node.start()
        steps = np.random.default_rng(3)
        for it in range(40):
            for i in range(2):
                stores[0].slot(i)[:] += steps.integers(-3, 4, P).astype(np.float32)
                node.exchange(i, PUSH | (FETCH if it % 3 == 0 else 0), True)
            time.sleep(0.002)
        t0 = time.monotonic()
        assert node.flush(0.5) is False
        took = time.monotonic() - t0
        assert took < 0.5 + async_node.RETRY + 1.0, f"flush took {took:.2f} s"
        s = node.stats()
        assert s["exchanges"] == 80 and s["deltas_sent"] == 0 and s["syncs"] == 0
        assert s["sync_failures"] >= 1
        # nothing lost: what the server never took is in `sending` and `outbox`
        kept = stores[0].buffer(SENDING) + stores[0].buffer(OUTBOX)
        np.testing.assert_array_equal(kept, node.rule.total)
        np.testing.assert_array_equal(server.buffers[CENTER], init)
        client.down = False  # the server is back: a later flush delivers all of it, once
        assert node.flush(5.0) is True
        np.testing.assert_array_equal(server.buffers[CENTER], init + node.rule.total)
        assert server.deltas.applied == node.stats()["deltas_sent"] >= 1
    finally:
        node.stop()
        for st in stores:
            st.close(unlink=True)
