"""The core of the asynchronous rules (issue 12), as pure logic: the delta ledger, the store's
``push_delta``, the schedule and credits without rounds, the exchange kernels and rules against
plain numpy, and the configuration that async rules refuse. No processes, no sockets."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

from lsgd.config import ConfigError, JobConfig
from lsgd.global_server.buffers import CENTER, ParamError
from lsgd.global_server.coordinator import Coordinator, Schedule
from lsgd.global_server.deltas import DeltaLedger
from lsgd.global_server.params import ParamStore
from lsgd.global_server.records import NO_END
from lsgd.rules import RULES, AsyncEASGD, AsyncRule, Downpour, RoundKind
from lsgd.rules import ops
from lsgd.rules.downpour import FETCH, PUSH, REF

from test_config_cli import run_train

F32 = np.dtype("<f4")


# ---------------------------------------------------------------------------- DeltaLedger
def test_the_ledger_numbers_deltas_per_node_session():
    led = DeltaLedger()
    assert led.begin(0, session=7, seq=1) == 0  # a new session starts anywhere from 1
    led.progress(0, 10)
    led.end(0, complete=True)
    assert led.begin(0, 7, 2) == 0  # the next one
    led.end(0, True)
    assert led.begin(1, 3, 1) == 0  # another node has numbers of its own
    led.end(1, True)
    assert led.begin(0, 8, 5) == 0  # a new session of node 0 (or a restarted server)
    led.end(0, True)
    assert (led.applied, led.retried) == (4, 0)


def test_the_ledger_skips_what_a_broken_upload_applied():
    led = DeltaLedger()
    assert led.begin(0, 1, 1) == 0
    led.progress(0, 300)
    led.end(0, complete=False)  # broke after 300 elements
    assert led.begin(0, 1, 1) == 300  # the retry skips them
    led.progress(0, 1000)
    led.end(0, True)
    assert (led.applied, led.retried) == (1, 1)


def test_an_older_or_fully_applied_delta_is_a_no_op():
    led = DeltaLedger()
    for seq in (1, 2, 3):
        assert led.begin(0, 1, seq) == 0
        led.progress(0, 8)
        led.end(0, True)
    assert led.begin(0, 1, 2) is None  # the node moved on since: applied in full
    assert led.begin(0, 1, 3) is None  # the newest, applied in full: its answer was lost
    assert (led.applied, led.retried) == (3, 0)  # a lost answer is not a second delta
    assert led.begin(0, 1, 4) == 0  # and the next one still goes


@pytest.mark.parametrize("seq", [0, -1, 3])
def test_a_delta_number_out_of_sequence_is_invalid(seq):
    led = DeltaLedger()
    led.begin(0, 1, 1)
    led.end(0, True)
    with pytest.raises(ParamError) as e:  # 0 or below, or one ahead of the next (2)
        led.begin(0, 1, seq)
    assert e.value.code == "INVALID_ARGUMENT"
    assert led.begin(0, 1, 2) == 0  # nothing changed


def test_a_second_upload_of_the_same_node_while_one_is_in_flight_is_aborted():
    led = DeltaLedger()
    assert led.begin(0, 1, 1) == 0
    led.progress(0, 5)
    for seq in (1, 2):
        with pytest.raises(ParamError) as e:
            led.begin(0, 1, seq)
        assert e.value.code == "ABORTED"
    assert led.begin(1, 1, 1) == 0  # another node is not held up
    led.end(0, False)
    assert led.begin(0, 1, 1) == 5  # the in-flight one's progress survived


# ---------------------------------------------------------------------------- push_delta
def seeded_store(init: np.ndarray) -> ParamStore:
    store = ParamStore(AsyncEASGD())
    store.set_param_count(init.size)
    store.push(0, 0, CENTER, init.size, 0, iter([(0, init.astype(F32).tobytes())]))
    assert store.center_ready
    return store


def chunks_of(vec: np.ndarray, bounds) -> list[tuple[int, bytes]]:
    """``vec`` cut at ``bounds`` (element offsets) into (offset, bytes) chunks."""
    cuts = [0, *bounds, vec.size]
    return [(lo, vec[lo:hi].astype(F32).tobytes()) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def broken(chunks, after: int):
    """The first ``after`` chunks, then the connection breaks."""
    yield from chunks[:after]
    raise ConnectionError("the upload broke midway")


def test_a_broken_delta_upload_is_applied_exactly_once():
    rng = np.random.default_rng(1)
    init = rng.integers(-50, 50, 1000).astype(np.float32)
    delta = rng.integers(-9, 10, 1000).astype(np.float32)
    store = seeded_store(init)
    with pytest.raises(ConnectionError):
        store.push_delta(0, 1, 1, 1000, broken(chunks_of(delta, [100, 400, 700]), 2), F32)
    center = store.buffers[CENTER]
    part = init.copy()
    part[:400] += delta[:400]  # the two chunks that arrived, no more
    np.testing.assert_array_equal(center, part)
    # the retry cuts the delta elsewhere: a chunk straddles the applied prefix
    store.push_delta(0, 1, 1, 1000, iter(chunks_of(delta, [250, 600])), F32)
    np.testing.assert_array_equal(center, init + delta)
    store.push_delta(0, 1, 1, 1000, iter(chunks_of(delta, [])), F32)  # its answer was lost
    np.testing.assert_array_equal(center, init + delta)
    assert (store.deltas.applied, store.deltas.retried) == (1, 1)


def test_a_delta_broken_several_times_still_adds_every_element_once():
    rng = np.random.default_rng(2)
    init = np.zeros(500, np.float32)
    delta = rng.integers(-9, 10, 500).astype(np.float32)
    store = seeded_store(init)
    for bounds, after in (([50, 120], 1), ([30, 200, 260], 2), ([10, 300, 499], 3)):
        with pytest.raises(ConnectionError):
            store.push_delta(3, 9, 1, 500, broken(chunks_of(delta, bounds), after), F32)
    store.push_delta(3, 9, 1, 500, iter(chunks_of(delta, [1, 2, 3])), F32)
    np.testing.assert_array_equal(store.buffers[CENTER], delta)
    assert (store.deltas.applied, store.deltas.retried) == (1, 3)


def test_a_short_delta_is_refused_and_its_retry_completes_it():
    init = np.zeros(100, np.float32)
    delta = np.arange(100, dtype=np.float32)
    store = seeded_store(init)
    with pytest.raises(ParamError) as e:  # the stream ended early (a client that gave up)
        store.push_delta(0, 1, 1, 100, iter(chunks_of(delta, [60])[:1]), F32)
    assert e.value.code == "INVALID_ARGUMENT" and "ended at 60" in str(e.value)
    store.push_delta(0, 1, 1, 100, iter(chunks_of(delta, [])), F32)
    np.testing.assert_array_equal(store.buffers[CENTER], delta)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_delta_is_refused_and_moves_nothing(bad):
    init = np.ones(64, np.float32)
    store = seeded_store(init)
    delta = np.ones(64, np.float32)
    delta[10] = bad
    with pytest.raises(ParamError) as e:
        store.push_delta(0, 1, 1, 64, iter(chunks_of(delta, [])), F32)
    assert e.value.code == "INVALID_ARGUMENT" and "element 10" in str(e.value)
    np.testing.assert_array_equal(store.buffers[CENTER], init)
    assert store.deltas.applied == 0


def test_a_delta_of_the_wrong_size_is_refused():
    store = seeded_store(np.zeros(10, np.float32))
    with pytest.raises(ParamError) as e:
        store.push_delta(0, 1, 1, 11, iter(chunks_of(np.ones(11, np.float32), [])), F32)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ParamError) as e:  # header right, chunks too long
        store.push_delta(0, 1, 1, 10, iter(chunks_of(np.ones(11, np.float32), [])), F32)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ParamError) as e:  # a chunk that does not continue where the last ended
        store.push_delta(0, 1, 1, 10, iter([(0, np.ones(4, F32).tobytes()),
                                            (6, np.ones(4, F32).tobytes())]), F32)
    assert e.value.code == "INVALID_ARGUMENT"
    center = store.buffers[CENTER]
    assert center[4:].sum() == 0  # nothing past the first good chunk
    store.push_delta(0, 1, 1, 10, iter(chunks_of(np.ones(10, np.float32), [])), F32)
    np.testing.assert_array_equal(center, np.ones(10))  # each element once


def test_a_delta_before_the_center_is_seeded_is_refused():
    store = ParamStore(AsyncEASGD())
    store.set_param_count(4)
    with pytest.raises(ParamError) as e:
        store.push_delta(0, 1, 1, 4, iter(chunks_of(np.ones(4, np.float32), [])), F32)
    assert e.value.code == "FAILED_PRECONDITION"
    store.push(0, 0, CENTER, 4, 0, iter([(0, np.zeros(4, F32).tobytes())]))
    store.push_delta(0, 1, 1, 4, iter(chunks_of(np.ones(4, np.float32), [])), F32)  # seq 1 free
    np.testing.assert_array_equal(store.buffers[CENTER], np.ones(4))


def test_a_bfloat16_delta_is_decoded_and_added():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    store = seeded_store(np.full(6, 2.0, np.float32))
    delta = np.array([1, -2, 3, 0.5, -0.25, 8], np.float32)
    store.push_delta(0, 1, 1, 6, iter([(0, delta.astype(bf16).tobytes())]), bf16)
    np.testing.assert_array_equal(store.buffers[CENTER], 2.0 + delta)


# ---------------------------------------------------------------------------- schedule, credits
def test_an_asynchronous_schedule_has_only_the_final_round():
    s = Schedule.for_job(num_groups=2, workers=2, l_comm=2, g_comm=4, local_rounds=True,
                         max_iterations=100, rounds=False)
    assert s.local_period is None and s.global_period == 16
    for after in (0, 1, 16, 64, 99):
        assert s.next_event(after) == (100, RoundKind.FINAL)
    unbounded = Schedule.for_job(num_groups=2, workers=2, l_comm=2, g_comm=4, local_rounds=True,
                                 max_iterations=None, rounds=False)
    assert unbounded.next_event(0) == (NO_END, RoundKind.FINAL)
    assert NO_END > 10 ** 15  # a time budget ends such a job long before


def async_coordinator(iters):
    sched = Schedule.for_job(num_groups=2, workers=2, l_comm=2, g_comm=4, local_rounds=True,
                             max_iterations=iters, rounds=False)
    c = Coordinator(job_id="j", algorithm="downpour", num_groups=2, workers=2, schedule=sched,
                    max_seconds=None, node_timeout=5.0, round_timeout=10.0, join_timeout=30.0,
                    now=0.0)
    s = {i: c.join(job_id="j", index=i, workers=2, algorithm="downpour", num_groups=2,
                   now=0.0).session for i in range(2)}
    return c, s


@pytest.mark.parametrize("iters", [100, None])
def test_async_credits_come_in_half_a_fair_share_of_a_period_and_only_the_final_round_opens(iters):
    c, s = async_coordinator(iters)
    period = c.schedule.global_period  # 16: 2 nodes x 2 workers x g_comm 4
    held = {0: 0, 1: 0}
    rounds, grants = [], []
    for _ in range(200 if iters else 50):  # the budget, or 50 requests of a job without one
        for i in (0, 1):
            ans = c.acquire(i, s[i], consumed=held[i], late=0, released=0, want=1 << 20,
                            last_round_seen=c.nodes[i].last_round_seen, now=0.0)
            held[i] = ans.grant  # (wait: the other node holds what is left of the budget)
            if ans.grant:
                grants.append(ans.grant)
            if ans.round is not None:
                rounds.append(ans.round)
        if rounds:
            break
    assert grants and max(grants) <= math.ceil(period / (2 * 2)) == 4
    assert c.outstanding <= period  # no node holds more than a period's worth
    if iters is None:
        assert not rounds and c.round is None and c.target == NO_END
        assert c.done + c.outstanding == sum(grants) == 4 * 100  # 50 requests x 2 nodes, 4 each
        return
    assert {(r.id, r.kind, r.iteration) for r in rounds} == {(1, RoundKind.FINAL, 100)}
    assert c.done == 100 and c.rounds_opened == 1


# ---------------------------------------------------------------------------- kernels
def test_elastic_exchange_by_hand():
    x = np.array([4.0, 0.0], np.float32)
    center = np.array([0.0, 4.0], np.float32)
    outbox = np.array([1.0, 1.0], np.float32)
    dist = ops.elastic_exchange_(x, center, outbox, 0.25)
    # d = 0.25 (x - c) = [1, -1]
    np.testing.assert_array_equal(x, [3.0, 1.0])
    np.testing.assert_array_equal(center, [1.0, 3.0])
    np.testing.assert_array_equal(outbox, [2.0, 0.0])
    assert dist == pytest.approx(math.sqrt(32))


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 1.0])
def test_elastic_exchange_in_chunks_equals_numpy(alpha):
    rng = np.random.default_rng(3)
    x, c, o = (rng.normal(size=1001).astype(np.float32) for _ in range(3))
    d = np.float32(alpha) * (x - c)
    want = (x - d, c + d, o + d, float(np.linalg.norm((x - c).astype(np.float64))))
    dist = ops.elastic_exchange_(x, c, o, alpha, chunk=64)
    for got, exp in zip((x, c, o), want):
        np.testing.assert_array_equal(got, exp)
    assert dist == pytest.approx(want[3], rel=1e-5)


def test_elastic_exchange_refuses_a_strength_outside_the_unit_interval_or_a_size_mismatch():
    z = np.zeros(3, np.float32)
    with pytest.raises(ValueError):
        ops.elastic_exchange_(z.copy(), z.copy(), z.copy(), 1.5)
    with pytest.raises(ValueError):
        ops.elastic_exchange_(z.copy(), np.zeros(4, np.float32), z.copy(), 0.5)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_push_delta_in_chunks_equals_numpy(scale):
    rng = np.random.default_rng(4)
    x, ref, c, o = (rng.normal(size=777).astype(np.float32) for _ in range(4))
    d = x - ref
    if scale != 1:
        d = d * np.float32(scale)
    want = (x.copy(), x.copy(), c + d, o + d)
    ops.push_delta_(x, ref, c, o, scale, chunk=50)
    for got, exp in zip((x, ref, c, o), want):
        np.testing.assert_array_equal(got, exp)


# ---------------------------------------------------------------------------- rules
def node_side(center, outbox=None):
    center = np.asarray(center, np.float32)
    return SimpleNamespace(center=center, outbox=np.zeros_like(center) if outbox is None
                           else np.asarray(outbox, np.float32))


def test_the_async_built_ins_are_asynchronous_rules():
    names = {n for n, r in RULES.items() if not r.synchronous}
    assert {"easgd-async", "downpour"} <= names
    assert all(issubclass(RULES[n], AsyncRule) for n in names)


def test_async_easgd_is_due_every_few_steps_and_exchanges_elastically():
    rule = AsyncEASGD(alpha=0.5, every=3)
    rng = random.Random(0)
    assert [rule.due(s, rng) for s in range(1, 8)] == [0, 0, 1, 0, 0, 1, 0]
    x = np.array([2.0, -2.0], np.float32)
    node = node_side([0.0, 0.0])
    dist = rule.exchange_(1, x, {}, node)
    np.testing.assert_array_equal(x, [1.0, -1.0])  # half way toward the center
    np.testing.assert_array_equal(node.center, [1.0, -1.0])  # the center half way toward x
    np.testing.assert_array_equal(node.outbox, [1.0, -1.0])  # what the center moved by
    assert dist == pytest.approx(math.sqrt(8))
    with pytest.raises(ValueError):
        AsyncEASGD(alpha=0.0)
    with pytest.raises(ValueError):
        AsyncEASGD(every=0)


def test_downpour_is_due_to_push_and_fetch_on_its_own_periods():
    rule = Downpour(n_push=2, n_fetch=3)
    rng = random.Random(0)
    assert [rule.due(s, rng) for s in range(1, 7)] == [0, PUSH, FETCH, PUSH, 0, PUSH | FETCH]
    for bad in (dict(n_push=0), dict(n_fetch=0), dict(scale=0.0), dict(scale=1.5)):
        with pytest.raises(ValueError):
            Downpour(**bad)


def test_downpour_start_sets_ref_and_a_push_sends_the_scaled_change():
    rule = Downpour(scale=0.5)
    x = np.array([0.0, 0.0], np.float32)
    mine = {REF: np.full(2, 99.0, np.float32)}
    rule.start_(x, mine)
    np.testing.assert_array_equal(mine[REF], x)  # the change is counted from here
    x += np.array([4.0, 8.0], np.float32)  # its steps
    node = node_side([1.0, 1.0])
    assert math.isnan(rule.exchange_(PUSH, x, mine, node))
    np.testing.assert_array_equal(node.center, [3.0, 5.0])  # + 0.5 * [4, 8]
    np.testing.assert_array_equal(node.outbox, [2.0, 4.0])
    np.testing.assert_array_equal(mine[REF], [4.0, 8.0])  # ref <- x
    np.testing.assert_array_equal(x, [4.0, 8.0])  # a push leaves x alone
    assert math.isnan(rule.exchange_(PUSH, x, mine, node))  # no change since: nothing moves
    np.testing.assert_array_equal(node.center, [3.0, 5.0])


def test_downpour_push_and_fetch_in_one_action_pushes_first():
    rule = Downpour(scale=0.5)
    x = np.array([4.0, 8.0], np.float32)
    mine = {REF: np.zeros(2, np.float32)}
    node = node_side([1.0, 1.0])
    dist = rule.exchange_(PUSH | FETCH, x, mine, node)
    np.testing.assert_array_equal(node.center, [3.0, 5.0])  # pushed first
    np.testing.assert_array_equal(node.outbox, [2.0, 4.0])
    np.testing.assert_array_equal(x, node.center)  # then fetched the center with its push
    np.testing.assert_array_equal(mine[REF], node.center)
    assert dist == pytest.approx(math.sqrt(1 + 9))  # ||x - center|| after the push


def test_downpour_fetch_takes_the_center_and_sends_nothing():
    rule = Downpour()
    x = np.array([4.0, 8.0], np.float32)
    mine = {REF: np.zeros(2, np.float32)}
    node = node_side([1.0, 1.0], outbox=[0.5, 0.5])
    assert rule.exchange_(FETCH, x, mine, node) == pytest.approx(math.sqrt(9 + 49))
    np.testing.assert_array_equal(x, [1.0, 1.0])
    np.testing.assert_array_equal(mine[REF], [1.0, 1.0])
    np.testing.assert_array_equal(node.center, [1.0, 1.0])
    np.testing.assert_array_equal(node.outbox, [0.5, 0.5])


def test_downpour_default_scale_is_one_over_the_workers_in_the_job():
    rule = JobConfig(algorithm="downpour", num_groups=2, workers=3).make_rule()
    assert isinstance(rule, Downpour) and rule.scale == pytest.approx(1 / 6)


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("knob", ["eval_every", "checkpoint_every"])
def test_async_rules_refuse_round_based_evaluation_and_checkpoints(knob):
    for rule in ("easgd-async", "downpour"):
        with pytest.raises(ConfigError, match=f"{knob} needs the rounds of a synchronous rule"):
            JobConfig(algorithm=rule, **{knob: 100})
    JobConfig(algorithm="easgd", **{knob: 100})  # a synchronous rule takes it


def test_easgd_async_with_eval_every_is_a_one_line_config_error(tmp_path):
    res = run_train(tmp_path, ("ALGORITHM", "easgd-async"), ("EVAL_EVERY", "100"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "eval_every needs the rounds of a synchronous rule" in lines[0], \
        res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_sync_every_out_of_range_is_refused():
    with pytest.raises(ConfigError, match="sync_every must be in"):
        JobConfig(algorithm="downpour", sync_every=-1)
    with pytest.raises(ConfigError, match="sync_every must be in"):
        JobConfig(algorithm="downpour", sync_every=float("nan"))
