"""A credit poll woken by a round opening is answered without a full credit request
(``Coordinator.round_news``, ``GlobalServicer.round_answer``): the answer and what it records
must be exactly what ``acquire`` would have given and recorded."""

import copy
import random

import pytest

from lsgd.config import JobConfig
from lsgd.global_server.polls import CreditPoll
from lsgd.global_server.server import build_servicer
from lsgd.proto import lsgd_pb2 as pb
from lsgd.rules.base import RoundKind
from test_coordinator import acq, join_all, make

NODE_FIELDS = ("last_round_seen", "last_grant", "last_seen", "outstanding", "consumed", "spare",
               "timed", "alive", "left", "granted_in")


def _woken(c, i, session, seen, now):
    """What a woken poll of node ``i`` asks: nothing to count, no ``seq``."""
    return c.acquire(i, session, consumed=0, late=0, released=0, want=100,
                     last_round_seen=seen, now=now)


@pytest.mark.parametrize("seed", range(6))
def test_round_news_answers_and_records_what_acquire_would(seed):
    rng = random.Random(seed)
    n = 4
    c = make(num_groups=n, workers=2, l_comm=2, g_comm=4, iters=200, round_timeout=1e9)
    s = join_all(c, n)
    seen = dict.fromkeys(range(n), 0)
    now, answered = 0.0, 0
    for _ in range(400):
        now += 0.01
        i = rng.randrange(n)
        for j in range(n):  # every node's woken poll, both ways, on copies
            fast, full = (copy.deepcopy(c, {id(c.rng): c.rng}) for _ in range(2))
            news = fast.round_news(j, s[j], seen[j], now)
            if news is None:
                continue
            answered += 1
            assert news == _woken(full, j, s[j], seen[j], now)
            assert news.round.kind != RoundKind.LOCAL and news.grant == 0
            for f in NODE_FIELDS:
                assert getattr(fast.nodes[j], f) == getattr(full.nodes[j], f), f
            assert (fast.done, fast.outstanding, fast.rounds_opened) == (
                full.done, full.outstanding, full.rounds_opened)
        # node i moves on: uses what it holds and asks again, or reports the round it heard of
        rnd = c.round
        if rnd is not None and not rnd.closed and seen[i] == rnd.id and i not in rnd.reports:
            c.report(i, s[i], rnd.id, None, 2, now)
            continue
        ans = acq(c, s, i, consumed=c.nodes[i].outstanding, seen=seen[i], now=now)
        if ans.round is not None:
            seen[i] = ans.round.id
        if c.finished:
            break
    assert answered > 0  # the drive reached global rounds that nodes had not heard of yet


def test_round_news_leaves_every_other_case_to_acquire():
    c = make(num_groups=2, workers=2, l_comm=2, g_comm=4, iters=100)
    s = join_all(c, 2)
    assert c.round_news(0, s[0], 0, 0.0) is None  # no round yet
    while c.round is None or c.round.kind != RoundKind.LOCAL:  # a local round: credits too
        acq(c, s, 0, consumed=c.nodes[0].outstanding)
        acq(c, s, 1, consumed=c.nodes[1].outstanding)
    assert c.round_news(0, s[0], 0, 0.0) is None
    i = 0
    while c.round.kind != RoundKind.GLOBAL:  # (the node that opens it learns of it)
        acq(c, s, i, consumed=c.nodes[i].outstanding, seen=c.round.id)
        i = 1 - i
    rid = c.round.id
    assert c.round_news(0, s[0] + 1, 0, 0.0) is None  # another session
    assert c.round_news(0, s[0], rid, 0.0) is None  # heard of it already
    c.nodes[0].last_round_seen = rid
    assert c.round_news(0, s[0], 0, 0.0) is None  # ... by the server's record too
    assert c.round_news(1, s[1], rid - 1, 0.0) == c.nodes[1].last_grant
    c.nodes[1].alive = False
    assert c.round_news(1, s[1], rid - 1, 0.0) is None  # dropped: acquire refuses it
    c.nodes[1].alive = True
    c.round.expected.discard(1)
    assert c.round_news(1, s[1], rid - 1, 0.0) is None  # not one of the round's nodes
    c.round.expected.add(1)
    c.nodes[1].needs_resume = True
    assert c.round_news(1, s[1], rid - 1, 0.0) is None  # a restarted server's: must reattach
    c.nodes[1].needs_resume = False
    c.round.closed = True
    assert c.round_news(1, s[1], rid - 1, 0.0) is None  # closed: time may open the next one
    c.round.closed = False
    c.halt("stopped by hand", 0.0)
    assert c.round_news(1, s[1], rid - 1, 0.0) is None  # a stopped job: acquire says so


class _Ctx:
    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise AssertionError(f"{code}: {details}")


def test_a_woken_polls_answer_is_the_one_a_full_request_makes_and_follows_the_counter():
    cfg = JobConfig(num_groups=2, workers=2, l_comm=2, g_comm=4, iterations=10**6)
    sv = build_servicer(cfg)
    ids = {}
    for i in (0, 1):
        r = sv.Join(pb.JoinRequest(node=pb.NodeId(job_id=cfg.job_id, node_index=i),
                                   num_workers=2, param_count=10, algorithm=cfg.rule_spec,
                                   num_groups=2), _Ctx())
        ids[i] = pb.NodeId(job_id=cfg.job_id, node_index=i, session=r.session)
    held, seen = {0: 0, 1: 0}, {0: 0, 1: 0}
    for _ in range(100):  # to the first global round
        for i in (0, 1):
            a = sv.AcquireCredits(pb.AcquireCreditsRequest(
                node=ids[i], consumed=held[i], want=100, last_round_seen=seen[i]), _Ctx())
            held[i] = a.grant
            if a.round.id:
                seen[i] = a.round.id
        if sv.coord.round is not None and sv.coord.round.kind == RoundKind.GLOBAL:
            break
    rnd = sv.coord.round
    assert rnd.kind == RoundKind.GLOBAL
    with sv.cond:
        poll = CreditPoll(sv, pb.AcquireCreditsRequest(node=ids[1], want=100,
                                                        last_round_seen=rnd.id - 1,
                                                        max_wait_ms=500))
        poll._first = False  # as after its first pass: woken
        fast = poll.step()
    full = sv.AcquireCredits(pb.AcquireCreditsRequest(node=ids[1], want=100,
                                                      last_round_seen=rnd.id - 1), _Ctx())
    assert fast.SerializeToString() == full.SerializeToString()
    with sv.cond:  # the counter moved (a late step): the next answer says so
        sv.coord.done += 1
        assert sv.round_answer(rnd).counter == full.counter + 1
        assert sv.round_answer(rnd) is sv.round_answer(rnd)  # made once per counter


def test_a_retried_request_after_a_fast_answer_gets_that_answer_again():
    c = make(num_groups=2, workers=2, l_comm=2, g_comm=4, local=False, iters=100)
    s = join_all(c, 2)
    seq = {0: 0, 1: 0}

    def ask(i, consumed, seen):
        seq[i] += 1
        return c.acquire(i, s[i], consumed=consumed, late=0, released=0, want=100,
                         last_round_seen=seen, now=0.0, seq=seq[i])

    held = {i: ask(i, 0, 0).grant for i in (0, 1)}
    while True:  # node 0 uses its credits until the rest of the period is node 1's
        used = held[0]
        a = ask(0, used, 0)
        if a.wait:
            break
        held[0] = a.grant
    while c.round is None:  # node 1's steps open the global round
        held[1] = ask(1, held[1], 0).grant
    rnd = c.round
    assert rnd.kind == RoundKind.GLOBAL
    done = c.done
    news = c.round_news(0, s[0], 0, 0.0)  # node 0's poll wakes
    assert news is not None and news.round is rnd
    again = c.acquire(0, s[0], consumed=used, late=0, released=0, want=100,
                      last_round_seen=0, now=0.0, seq=seq[0])  # its reply was lost: a retry
    assert again == news and c.done == done  # the same answer, nothing counted twice
