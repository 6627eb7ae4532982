"""The parameter plane's broadcast between real processes on loopback (lsgd/plane/node.py):
every member ends with the source's exact vector, a member killed or hung in the middle of a
transfer is bypassed (its successor resumes where it stopped), and a member whose sender is
gone with nobody to bypass it ends with nothing, never a part. Bypasses are answered by the
global server's own ``Routes``."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import signal
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait

import numpy as np
import pytest

from lsgd.global_server.records import CoordinatorError
from lsgd.global_server.routes import Routes
from lsgd.plane.messages import leader_route
from lsgd.plane.node import RouteInfo
from plane_member import member, vector

COUNT = 64 * 1024  # elements: 64 chunks of 1024
CHUNK = 1024
SECRET = "a job secret of enough characters"


class Chain:
    """Members 0..n-1 in processes; the test process plays the global server."""

    def __init__(self, n: int, delays: dict[int, float], timeout: float = 20.0,
                 count: int = COUNT, chunk: int = CHUNK, reduce: bool = False,
                 fanout: int = 1) -> None:
        self.count = count
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            here, there = ctx.Pipe()
            p = ctx.Process(target=member, args=(i, count, delays.get(i, 0.0), SECRET, there),
                            daemon=True)
            p.start()
            here.send(timeout)
            self.conns.append(here)
            self.procs.append(p)
        self.routes = Routes(fanout)
        for i, c in enumerate(self.conns):
            assert c.poll(60), f"member {i} did not start"
            kind, address = c.recv()
            self.routes.addresses[i] = address
        if reduce:
            self.info = self.routes.plan_sums(7, {i: 1 for i in range(n)})
        else:
            self.info = self.routes.plan(7, list(range(n)), leader_node=0)
        self.info = replace(self.info, chunk=chunk)
        self.routes.current = self.info
        self.results: dict[int, tuple] = {}
        self.refused: list[str] = []
        self._serving = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> None:
        for c in self.conns:
            c.send(self.info)
        self._serving.start()

    def _serve(self) -> None:
        open_ = {c: i for i, c in enumerate(self.conns)}
        end = time.monotonic() + 90
        while len(self.results) < len(self.conns) and time.monotonic() < end:
            live = [c for c, i in open_.items() if i not in self.results and self.procs[i].is_alive()]
            if not live:
                break
            for c in wait(live, timeout=0.2):
                try:
                    kind, value = c.recv()
                except (EOFError, OSError):
                    self.results[open_[c]] = ("dead", None)
                    continue
                if kind == "bypass":
                    try:
                        c.send(("route", self.routes.bypass(*value)))
                    except CoordinatorError as exc:
                        self.refused.append(f"{exc.code}: {exc}")
                        c.send(("error", str(exc)))
                elif kind == "done":
                    self.results[open_[c]] = value

    def finish(self, timeout: float = 90) -> dict[int, tuple]:
        self._serving.join(timeout)
        assert not self._serving.is_alive(), "the members did not finish"
        for c in self.conns:
            try:
                c.send("go")
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
        return self.results

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)


@pytest.fixture
def chain_of():
    made = []

    def make(*args, **kw) -> Chain:
        c = Chain(*args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def received(results, i) -> np.ndarray | None:
    (kind, value), _ = results[i]
    assert kind == "received"
    return None if value is None else np.frombuffer(value, dtype=np.float32)


def test_every_member_gets_the_exact_vector_down_a_chain(chain_of):
    chain = chain_of(4, delays={})
    chain.start()
    results = chain.finish()
    assert results[0][0] == ("sent", True)
    want = vector(COUNT)
    for i in (1, 2, 3):
        got = received(results, i)
        assert got is not None and np.array_equal(got, want), f"member {i}"
        assert results[i][1]["received"] == 1 and results[i][1]["failed"] == 0
    assert [results[i][1]["sent"] for i in range(4)] == [1, 1, 1, 0]  # 0 -> 1 -> 2 -> 3
    assert chain.routes.bypasses == 0


def test_a_member_killed_mid_transfer_is_bypassed_and_its_successor_resumes(chain_of):
    # member 1 takes a chunk every 20 ms (about 1.3 s for the vector): killed after ~0.4 s
    chain = chain_of(4, delays={1: 0.02})
    chain.start()
    time.sleep(0.4 + 0.5)  # the members learn the route, then 1 is part-way
    os.kill(chain.procs[1].pid, signal.SIGKILL)
    results = chain.finish()
    assert chain.routes.bypasses == 1 and chain.routes.current.route.left == {1}
    assert results[0][0] == ("sent", True)
    want = vector(COUNT)
    for i in (2, 3):
        got = received(results, i)
        assert got is not None and np.array_equal(got, want), f"member {i}"
    # member 2 had a part from member 1, and went on from there with member 0
    assert results[2][1]["resumed"] == 1
    assert results[0][1]["bypasses"] == 1


def test_every_member_gets_the_exact_vector_down_a_tree_of_chains(chain_of):
    chain = chain_of(5, delays={}, fanout=2)  # PLANE_FANOUT=2: 0 -> 1 -> 2 and 0 -> 3 -> 4
    assert chain.info.route.children(0) == [1, 3] and chain.info.route.depth() == 2
    chain.start()
    results = chain.finish()
    want = vector(COUNT)
    for i in range(1, 5):
        got = received(results, i)
        assert got is not None and np.array_equal(got, want), f"member {i}"
    assert [results[i][1]["sent"] for i in range(5)] == [2, 1, 0, 1, 0]


def test_a_member_killed_mid_transfer_in_one_branch_of_a_tree_is_bypassed(chain_of):
    chain = chain_of(5, delays={3: 0.02}, fanout=2)  # member 3 heads the second chain, slowly
    chain.start()
    time.sleep(0.4 + 0.5)
    os.kill(chain.procs[3].pid, signal.SIGKILL)
    results = chain.finish()
    assert chain.routes.bypasses == 1 and chain.routes.current.route.left == {3}
    assert chain.routes.current.route.children(0) == [1, 4]  # 4 now hangs from the source
    want = vector(COUNT)
    for i in (1, 2, 4):
        got = received(results, i)
        assert got is not None and np.array_equal(got, want), f"member {i}"
    assert results[4][1]["resumed"] == 1  # it had a part from 3 and went on from there


def test_a_hung_member_is_bypassed_once_it_stalls(chain_of):
    chain = chain_of(4, delays={2: 0.02})
    chain.start()
    time.sleep(0.9)
    os.kill(chain.procs[2].pid, signal.SIGSTOP)  # hung: its process lives, takes nothing
    try:
        t0 = time.monotonic()
        while 3 not in chain.results and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        got = received(chain.results, 3)
        assert got is not None and np.array_equal(got, vector(COUNT))
        assert chain.routes.bypasses == 1 and chain.routes.current.route.left == {2}
    finally:
        os.kill(chain.procs[2].pid, signal.SIGKILL)
    results = chain.finish()
    assert results[1][1]["bypasses"] == 1 and results[3][1]["resumed"] == 1


def test_a_member_whose_source_dies_ends_with_nothing_at_the_deadline(chain_of):
    # The source is killed mid-transfer: nobody can bypass it, the others time out with
    # nothing applied. 32 MiB in 128 chunks of 256 KiB, which member 1 takes in 2.6 s: at the
    # kill it has at most 45 chunks, and the sockets' buffers (at most ~10 MB on loopback) hold
    # 40 more, so the source cannot have sent the whole vector (16 MiB could: a CI run did).
    chain = chain_of(3, delays={1: 0.02}, timeout=4.0, count=1 << 23, chunk=1 << 16)
    chain.start()
    time.sleep(0.9)
    os.kill(chain.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    results = chain.finish()
    assert received(results, 1) is None and received(results, 2) is None
    assert results[1][1]["failed"] == 1 and results[2][1]["failed"] == 1
    assert time.monotonic() - t0 < 15


def test_the_server_refuses_a_bypass_from_a_member_that_does_not_send_to_it():
    routes = Routes()
    routes.addresses = {i: f"127.0.0.1:{4000 + i}" for i in range(4)}
    routes.plan(3, [0, 1, 2, 3], leader_node=0)  # 0 -> 1 -> 2 -> 3
    with pytest.raises(CoordinatorError, match="does not send to node 3"):
        routes.bypass(1, 3, 0, 3, "made up")
    with pytest.raises(CoordinatorError, match="no route of round 2"):
        routes.bypass(0, 2, 0, 1, "stale")
    with pytest.raises(CoordinatorError, match="never issued"):
        routes.bypass(0, 3, 5, 1, "future")
    with pytest.raises(CoordinatorError, match="source"):
        routes.bypass(1, 3, 0, 0, "the source")
    info = routes.bypass(0, 3, 0, 1, "gone")
    assert info.route.epoch == 1 and info.route.parent == {2: 0, 3: 2}
    assert routes.bypass(0, 3, 0, 1, "retry") is info  # a retry gets the same answer


def test_a_route_puts_node_0_beside_the_server_and_leaves_out_nodes_without_an_address():
    addresses = {0: "127.0.0.1:1", 2: "127.0.0.1:3", 3: "127.0.0.1:4"}
    info = leader_route(5, [0, 1, 2, 3], 3, addresses)
    assert info.route.root == 3 and info.feeds_server == 0 and set(info.addresses) == {0, 2, 3}
    assert info.route.parent == {0: 3, 2: 0}
    no_zero = leader_route(5, [1, 2, 3], 2, addresses)  # node 0 missed the round
    assert no_zero.feeds_server == 2 and set(no_zero.addresses) == {2, 3}
    assert leader_route(5, [0, 1], 1, addresses) is None  # the source has no address
    assert leader_route(5, [0, 2], 2, {2: "127.0.0.1:3"}) is None  # one member: the star


def test_a_join_naming_another_hosts_data_address_is_refused_and_changes_nothing():
    """A node (with the secret, say) may not point the others' sends at a third party."""
    import grpc

    from lsgd.config import JobConfig
    from lsgd.global_server.server import build_servicer, create_server
    from lsgd.local_server.global_client import GlobalClient

    servicer = build_servicer(JobConfig(num_groups=2, workers=1, job_id="job", plane="chain"))
    srv, port = create_server("127.0.0.1:0", servicer)
    try:
        for bad, why in [("10.9.9.9:5000", "not the address this node connects from"),
                         ("127.0.0.1:0", "not host:port"), ("localhost:80", "IP address"),
                         ("127.0.0.1:1" + "0" * 300, "ASCII characters")]:
            c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=5.0)
            c.data_address = bad
            with pytest.raises(grpc.RpcError) as e:
                c.join(workers=1, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
            c.close()
        assert not servicer.coord.nodes and not servicer.routes.addresses
        c = GlobalClient(f"127.0.0.1:{port}", "job", 0, round_timeout=5.0)
        c.data_address = "127.0.0.1:4567"
        c.join(workers=1, param_count=10, algorithm="lsgd", num_groups=2, connect_timeout=5)
        assert servicer.routes.addresses == {0: "127.0.0.1:4567"}
        c.close()
    finally:
        srv.stop(grace=0.5).wait(5)


# ---------------------------------------------------------------- in one process (threads)
def local_planes(n: int, timeout: float = 10.0, addresses: dict[int, str] | None = None):
    """n DataPlanes on loopback and a chain route 0 -> 1 -> ... among them."""
    from lsgd.plane.node import DataPlane

    calls = []

    def refuse(*args):
        calls.append(args)
        raise RuntimeError("no bypass in this test")

    ps = [DataPlane(job_id="job", index=i, count=COUNT, secret=SECRET, host="127.0.0.1",
                    timeout=timeout, bypass=refuse) for i in range(n)]
    info = leader_route(1, list(range(n)), 0, {i: p.address for i, p in enumerate(ps)})
    info = RouteInfo(1, info.route, addresses or info.addresses, info.feeds_server, CHUNK)
    return ps, info, calls


def test_idle_connections_are_dropped_and_do_not_shut_out_the_sender():
    import socket

    (a, b), info, calls = local_planes(2)
    idle = [socket.create_connection(("127.0.0.1", int(b.address.rsplit(":", 1)[1])))
            for _ in range(40)]  # more than MAX_CONNECTIONS, none authenticating
    try:
        b.begin(info)
        a.begin(info)
        t0 = time.monotonic()
        assert a.send(vector(COUNT))
        got = b.receive()
        assert got is not None and np.array_equal(got, vector(COUNT)) and not calls
        assert time.monotonic() - t0 < 8  # the idle ones were dropped after AUTH_WAIT (2 s)
    finally:
        for s in idle:
            s.close()
        a.close()
        b.close()


def test_a_receiver_that_learns_its_route_late_is_waited_for_not_bypassed():
    (a, b), info, calls = local_planes(2)
    try:
        a.begin(info)
        late = threading.Timer(4.0, b.begin, args=(info,))  # past the 3 s stall bound
        late.start()
        assert a.send(vector(COUNT)) and not calls
        late.join()
        got = b.receive()
        assert got is not None and np.array_equal(got, vector(COUNT))
    finally:
        a.close()
        b.close()


def test_a_sender_not_at_its_announced_host_is_refused():
    (a, b), info, calls = local_planes(2)
    port = info.addresses[0].rsplit(":", 1)[1]
    lying = RouteInfo(1, info.route, {0: f"127.0.0.2:{port}", 1: info.addresses[1]},
                      info.feeds_server, CHUNK)  # node 0 "is" at 127.0.0.2; it sends from .1
    try:
        b.begin(lying)
        a.begin(lying)
        assert not a.send(vector(COUNT))  # refused; the bypass was asked for and refused here
        assert calls and "announced 127.0.0.2, not 127.0.0.1" in calls[0][3]
        assert b.current.reception.offset == 0  # nothing taken
    finally:
        a.close()
        b.close()


def test_a_member_with_no_chunk_for_a_while_stops_waiting_and_takes_nothing(monkeypatch):
    from lsgd.plane import node as plane_node

    monkeypatch.setattr(plane_node, "RECEIVE_STALL", 0.5)
    (a, b), info, calls = local_planes(2)
    try:
        b.begin(info)  # its sender never sends (it hung after its own sender was done)
        t0 = time.monotonic()
        assert b.receive() is None and b.stats["failed"] == 1
        assert time.monotonic() - t0 < 3
        a.begin(info)  # it comes back: the closed reception takes nothing of this round
        assert not a.send(vector(COUNT))
        assert b.current.reception.offset == 0
    finally:
        a.close()
        b.close()


def test_a_member_waiting_on_its_route_stops_as_soon_as_it_hears_the_job_stopped():
    """Ctrl-C on node 0 mid-transfer: a member told of the stop (any answer from the server)
    stops waiting at once, not after RECEIVE_STALL."""
    from lsgd.local_server.global_client import GlobalClient

    (a, b), info, calls = local_planes(2)
    client = GlobalClient("127.0.0.1:1", "job", 1, round_timeout=5.0)
    told = []
    client.on_stopped = lambda why: (told.append(why), b.stop(f"the job stopped ({why})"))
    try:
        b.begin(info)  # its sender (node 0) never sends: it was interrupted
        threading.Timer(0.3, client._note_stop, ["job stopped on node 0: interrupted"]).start()
        t0 = time.monotonic()
        assert b.receive() is None
        assert time.monotonic() - t0 < 2 and b.stats["failed"] == 1
        client._note_stop("again")  # told once
        assert told == ["job stopped on node 0: interrupted"]
        assert client.stopped == "job stopped on node 0: interrupted"
    finally:
        client.close()
        a.close()
        b.close()


def test_a_bypass_of_the_member_feeding_the_server_moves_the_upload_to_the_reporter():
    from lsgd.config import JobConfig
    from lsgd.global_server.params import LEADER, ParamStore
    from lsgd.rules.base import RoundKind

    routes = Routes()
    routes.addresses = {i: f"127.0.0.1:{4000 + i}" for i in range(3)}
    info = routes.plan(4, [0, 1, 2], leader_node=2)  # 2 -> 0 -> 1; node 0 feeds the server
    assert info.feeds_server == 0 and info.route.parent == {0: 2, 1: 0}
    params = ParamStore(JobConfig(algorithm="lsgd").make_rule())
    params.set_param_count(10)
    params.begin(4, RoundKind.GLOBAL, 2, {0: 1, 1: 1, 2: 1}, 5.0, leader_uploader=0)
    assert params.exchange.expected == {(0, LEADER)}
    new = routes.bypass(2, 4, 0, 0, "node 0 hung")
    assert new.feeds_server == 2 and new.route.parent == {1: 2}
    assert params.reassign_upload(4, LEADER, 0, 2) and params.exchange.expected == {(2, LEADER)}
    assert not params.reassign_upload(4, LEADER, 0, 2)  # nothing expected from 0 any more



# ---------------------------------------------------------------- reduce
def reduced(results, i) -> np.ndarray | None:
    (kind, value), _ = results[i]
    assert kind == "reduced"
    return None if value is None else np.frombuffer(value, dtype=np.float32)


def chain_total(n: int) -> np.ndarray:
    """Member i's sum is vector(i); the chain adds from the far end: 0 + (1 + (2 + ...))."""
    total = vector(COUNT, n - 1)
    for i in range(n - 2, -1, -1):
        total = vector(COUNT, i) + total
    return total


def test_the_sums_add_up_along_a_chain_to_node_0():
    chain = Chain(4, delays={}, reduce=True)
    try:
        assert chain.info.reduce and chain.info.route.parent == {1: 0, 2: 1, 3: 2}
        assert chain.info.total_summands == 4
        chain.start()
        results = chain.finish()
    finally:
        chain.close()
    total = reduced(results, 0)
    assert total is not None and np.array_equal(total, chain_total(4))
    assert all(reduced(results, i) is not None for i in (1, 2, 3))  # each did its part
    assert [results[i][1]["sent"] for i in range(4)] == [0, 1, 1, 1]
    assert not chain.refused and chain.routes.aborts == 0


def test_a_member_killed_mid_reduce_aborts_it_and_no_total_is_made(chain_of):
    chain = chain_of(4, delays={1: 0.02}, reduce=True)  # member 1 adds slowly: killed part-way
    chain.start()
    time.sleep(0.9)
    os.kill(chain.procs[1].pid, signal.SIGKILL)
    results = chain.finish()
    assert reduced(results, 0) is None  # node 0 has no total: nothing goes to the server
    assert reduced(results, 2) is None  # its send to the dead member failed
    assert chain.routes.aborts == 1 and chain.routes.current is None
    assert any(r.startswith("ABORTED") for r in chain.refused), chain.refused


def test_an_aborted_reduce_fails_the_rounds_exchange_at_once():
    """What the servicer does with the abort: the exchange settles, failed, no center moves."""
    from lsgd.config import JobConfig
    from lsgd.global_server.params import CENTER, SUM, ParamStore
    from lsgd.plane.messages import sum_route
    from lsgd.rules.base import RoundKind

    params = ParamStore(JobConfig(algorithm="average").make_rule())
    params.set_param_count(10)
    before = params.buffers[CENTER].copy()
    route = sum_route(3, {0: (2, 0.0), 1: (2, 0.0), 2: (1, 0.0)},
                      {0: "127.0.0.1:1", 1: "127.0.0.1:2"})  # node 2 has no address: the star
    assert route.total_summands == 4 and route.total_weight == 4.0
    params.begin(3, RoundKind.GLOBAL, None, {0: 2, 1: 2, 2: 1}, 30.0, reduce=route)
    assert params.exchange.expected == {(0, SUM), (2, SUM)}
    with pytest.raises(Exception, match="sums 4 participants"):  # node 0 must bring the total
        params.push(0, 3, SUM, 10, 2, iter([(0, np.ones(10, np.float32).tobytes())]))
    params.fail(3, "the reduce of round 3 is aborted")
    assert params.exchange.settled and not params.exchange.sums_ok
    assert np.array_equal(params.buffers[CENTER], before)


def test_the_open_rounds_weights_survive_a_late_note_and_make_the_reduce_total():
    routes = Routes()
    routes.addresses = {i: f"127.0.0.1:{4000 + i}" for i in range(3)}
    routes.note_weight(0, 5, 2, 0.5)
    routes.note_weight(1, 5, 2, 0.7)
    routes.note_weight(2, 4, 2, 3.0)  # a report of an older round: it touches nothing of round 5
    with pytest.raises(CoordinatorError, match="must be in"):
        routes.note_weight(2, 5, 2, 3e6)  # beyond 2 participants' bound: refused, nothing kept
    info = routes.plan_sums(5, {0: 2, 1: 2, 2: 1})
    assert info.total_summands == 5 and info.total_weight == pytest.approx(0.5 + 0.7 + 1)
    routes.note_weight(0, 6, 6, 6 * 1e-6 * (1 - 1e-12))  # clipped weights summed in floats


def test_a_member_waiting_on_an_aborted_reduce_stops_when_the_server_says_so():
    """A member died before it ever connected downstream: nothing can break at the route's end,
    which would wait RECEIVE_STALL (10 s) for a chunk. The server aborted the reduce (another
    member's bypass told it); a heartbeat's answer says so, and the wait ends at once."""
    from lsgd.plane.messages import sum_route
    from lsgd.plane.node import RECEIVE_STALL, DataPlane

    told = []
    plane = DataPlane(job_id="job", index=0, count=COUNT, secret=SECRET, host="127.0.0.1",
                      timeout=30.0, bypass=lambda *args: told.append(args))
    try:
        with socket.socket() as unused:  # node 1's address: nobody there, nobody sends
            unused.bind(("127.0.0.1", 0))
            addresses = {0: plane.address, 1: f"127.0.0.1:{unused.getsockname()[1]}"}
        info = sum_route(7, {0: (1, 0.0), 1: (1, 0.0)}, addresses, COUNT)
        plane.begin(info, own=np.ones(COUNT, np.float32))
        plane.reduce_aborted(6)  # another round's abort: nothing changes
        threading.Timer(0.3, plane.reduce_aborted, args=(7,)).start()
        t0 = time.monotonic()
        assert plane.reduce() is None
        assert time.monotonic() - t0 < min(3.0, RECEIVE_STALL / 2)
        assert told == []  # the server knows already: no abort is sent back
    finally:
        plane.close()


def test_the_servers_heartbeat_answer_names_the_newest_aborted_reduce():
    from lsgd.config import JobConfig
    from lsgd.global_server.server import build_servicer

    servicer = build_servicer(JobConfig(algorithm="average", num_groups=3, port=0))
    routes = servicer.routes
    routes.addresses = {i: f"127.0.0.1:{4000 + i}" for i in range(3)}
    routes.plan_sums(9, {0: 1, 1: 1, 2: 1})
    assert servicer._heartbeat_answer(0).aborted_reduce == 0
    with pytest.raises(CoordinatorError, match="aborted"):
        routes.bypass(2, 9, 0, 1, "connection refused", reduce=True)
    assert servicer._heartbeat_answer(0).aborted_reduce == 9


def test_a_heartbeat_answer_naming_an_aborted_reduce_reaches_the_nodes_plane():
    from types import SimpleNamespace

    from lsgd.local_server.global_client import GlobalClient
    from lsgd.proto import lsgd_pb2 as pb

    client = GlobalClient("127.0.0.1:1", "job", 1, 30.0)  # no call goes out: a fake stub
    try:
        heard = []
        client._stub = SimpleNamespace(
            Heartbeat=lambda req, timeout, metadata: pb.HeartbeatResponse(aborted_reduce=5))
        client.beat()  # nobody listens yet: nothing to tell
        client.on_aborted = heard.append
        client.beat()
        assert heard == [5]
    finally:
        client.close()


def test_a_member_holding_its_whole_sum_stops_sending_on_an_aborted_reduce_and_says_nothing():
    """The member in the middle has its upstream's whole partial sum and is still sending it
    on (to a node 0 that accepted the connection and then went silent): the server's abort
    ends its send as well, and it does not report the abort back to the server."""
    from lsgd.plane.messages import sum_route
    from lsgd.plane.node import DataPlane

    told = {1: [], 2: []}
    silent = socket.create_server(("127.0.0.1", 0))  # node 0: a backlog, never an answer
    planes = {i: DataPlane(job_id="job", index=i, count=COUNT, secret=SECRET, host="127.0.0.1",
                           timeout=20.0, bypass=lambda *args, i=i: told[i].append(args))
              for i in (1, 2)}
    try:
        addresses = {0: f"127.0.0.1:{silent.getsockname()[1]}", 1: planes[1].address,
                     2: planes[2].address}
        info = sum_route(7, {0: (1, 0.0), 1: (1, 0.0), 2: (1, 0.0)}, addresses, COUNT)
        middle = next(i for i in (1, 2) if info.route.upstream(i) and info.route.downstream(i))
        for p in planes.values():
            p.begin(info, own=np.ones(COUNT, np.float32))
        end = time.monotonic() + 10
        while not planes[middle].current.reception.complete:
            assert time.monotonic() < end, "the leaf's sum never reached the middle member"
            time.sleep(0.02)
        planes[middle].reduce_aborted(7)
        t0 = time.monotonic()
        assert planes[middle].reduce() is None
        assert time.monotonic() - t0 < 5
        assert told[middle] == []
    finally:
        for p in planes.values():
            p.close()
        silent.close()
