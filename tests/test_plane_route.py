"""Routes of the parameter plane (lsgd/plane/route.py): planning, bypass, epochs, reception.
Pure: no sockets, no processes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lsgd.plane.route import (SERVER, Kind, Reception, RouteError, bypass, plan, stalled)


def reaches_everyone(route) -> bool:
    """Every member is reached from the root along ``downstream`` (broadcast) exactly once."""
    seen, todo = set(), [route.root]
    while todo:
        n = todo.pop()
        assert n not in seen
        seen.add(n)
        todo += route.downstream(n)
    return seen == set(route.members)


def test_a_chain_from_the_leader_visits_every_member_in_order():
    r = plan(Kind.BROADCAST, [0, 1, 2, 3, 5], root=2)
    assert r.parent == {0: 2, 1: 0, 3: 1, 5: 3}
    assert r.downstream(2) == [0] and r.upstream(5) == [3] and r.downstream(5) == []
    assert r.depth() == 4 and reaches_everyone(r)


def test_a_route_to_or_from_the_server_goes_through_node_0():
    down = plan(Kind.BROADCAST, [0, 1, 2, 3], root=SERVER)
    assert down.parent == {0: SERVER, 1: 0, 2: 1, 3: 2} and reaches_everyone(down)
    up = plan(Kind.REDUCE, [0, 1, 2, 3], root=SERVER)
    # a reduce runs the same tree the other way: 3 -> 2 -> 1 -> 0 -> server
    assert up.downstream(3) == [2] and up.upstream(3) == []
    assert up.upstream(0) == [1] and up.downstream(0) == [SERVER]
    assert up.upstream(SERVER) == [0]
    with pytest.raises(RouteError, match="needs node 0"):
        plan(Kind.REDUCE, [1, 2], root=SERVER)


@given(st.integers(1, 64), st.integers(1, 8), st.data())
def test_fanout_cuts_the_rest_into_nearly_equal_chains(n, fanout, data):
    members = list(range(n))
    root = data.draw(st.sampled_from(members))
    r = plan(Kind.BROADCAST, members, root=root, fanout=fanout)
    assert reaches_everyone(r)
    chains = r.children(root)
    assert len(chains) == min(fanout, n - 1)
    if n > 1:  # depth: the rest split over the chains, rounded up
        assert r.depth() == -(-(n - 1) // len(chains))
    for m in members:  # at most one child below the top of a chain
        assert len(r.children(m)) <= (fanout if m == root else 1)


def test_a_bypass_hands_the_stalled_members_children_to_its_parent():
    r = plan(Kind.BROADCAST, [0, 1, 2, 3], root=0)
    r2 = bypass(r, reporter=1, stalled=2)
    assert r2.epoch == 1 and r2.left == {2} and r2.downstream(1) == [3]
    assert 2 not in r2.members and reaches_everyone(r2)
    r3 = bypass(r2, reporter=1, stalled=3)  # the tail too
    assert r3.epoch == 2 and r3.downstream(1) == [] and r3.members == [0, 1]


@pytest.mark.parametrize("reporter, stalled_node, why", [
    (0, 0, "the source 0 stalled"),
    (0, 2, "does not send to node 2"),  # only the parent may report its child
    (1, 7, "not on route"),
])
def test_a_bypass_that_does_not_fit_the_route_is_refused(reporter, stalled_node, why):
    r = plan(Kind.BROADCAST, [0, 1, 2, 3], root=0)
    with pytest.raises(RouteError, match=why):
        bypass(r, reporter, stalled_node)


def test_a_reduce_aborts_rather_than_bypass():
    r = plan(Kind.REDUCE, [0, 1, 2], root=SERVER)
    with pytest.raises(RouteError, match="aborted"):
        bypass(r, reporter=1, stalled=2)


def test_plans_refuse_bad_members():
    for members, root, fanout in (([0, 0, 1], 0, 1), ([0, -2], 0, 1), ([1, 2], 0, 1),
                                  ([0, 1], 0, 0)):
        with pytest.raises(RouteError):
            plan(Kind.BROADCAST, members, root, fanout)


def test_a_stall_is_no_progress_for_the_floor_or_twenty_chunks():
    assert not stalled(10.0, 11.9, 1 << 20, 100e6)
    assert stalled(10.0, 12.1, 1 << 20, 100e6)
    slow = 1e6  # 1 MB/s: twenty 1 MiB chunks take 21 s
    assert not stalled(10.0, 30.0, 1 << 20, slow) and stalled(10.0, 32.0, 1 << 20, slow)


def test_a_receiver_takes_the_newest_epoch_and_only_its_contiguous_chunks():
    rx = Reception(10)
    assert rx.open(0) == 0
    rx.accept(0, 0, 4)
    with pytest.raises(RouteError, match="expected 4"):
        rx.accept(0, 6, 2)  # a gap
    with pytest.raises(RouteError, match="expected 4"):
        rx.accept(0, 0, 4)  # the same chunk again
    assert rx.open(1) == 4  # the re-routed sender resumes where the prefix ends
    with pytest.raises(RouteError, match="epoch 1 is current"):
        rx.accept(0, 4, 2)  # the bypassed sender is cut off
    with pytest.raises(RouteError, match="older"):
        rx.open(0)
    with pytest.raises(RouteError, match="overruns"):
        rx.accept(1, 4, 7)
    rx.accept(1, 4, 6)
    assert rx.complete and rx.offset == 10


def test_a_closed_reception_takes_nothing_more():
    from lsgd.plane.route import Reception, RouteError

    rx = Reception(10)
    rx.open(0)
    rx.accept(0, 0, 4)
    rx.close("the round ended")
    with pytest.raises(RouteError, match="the round ended"):
        rx.accept(0, 4, 2)
    with pytest.raises(RouteError, match="the round ended"):
        rx.open(1)
    assert rx.offset == 4


def test_chunks_grow_on_short_routes_and_keep_a_deep_pipelines_fill_small():
    from lsgd.plane.messages import leader_route
    from lsgd.plane.node import CHUNK, MAX_ROUTE_CHUNK, chunk_for

    assert chunk_for(0, 3) == CHUNK  # the size is not known yet
    assert chunk_for(25_000_000, 1) == MAX_ROUTE_CHUNK  # one hop: no fill to weigh
    assert chunk_for(6_250_000, 15) == CHUNK  # 25 MB down 16 nodes: the floor
    for count in (10_000, 1_000_000, 6_250_000, 25_000_000, 10**9):
        sizes = [chunk_for(count, depth) for depth in range(1, 40)]
        assert all(CHUNK <= c <= MAX_ROUTE_CHUNK for c in sizes)
        assert sizes == sorted(sizes, reverse=True)  # deeper, never larger
        for depth, c in enumerate(sizes, start=1):  # above the floor, the fill is <= 1/8
            assert c == CHUNK or (depth - 1) * c <= count / 8
    addresses = {n: f"127.0.0.1:{1000 + n}" for n in range(4)}
    assert leader_route(1, [0, 1], 0, addresses, count=25_000_000).chunk == MAX_ROUTE_CHUNK
    assert leader_route(1, [0, 1, 2, 3], 0, addresses, count=6_250_000).chunk == chunk_for(6_250_000, 3)
