"""The rule's server state (DiLoCo's outer momentum) is saved, restored and checkpointed with the
center, in one piece with it; an older save without it loads with the state at zero."""

from __future__ import annotations

import json
import logging
import threading
import time
import zipfile

import numpy as np
import pytest

from lsgd.config import JobConfig
from lsgd.global_server.buffers import ParamError
from lsgd.global_server.params import CENTER, LEADER, ParamStore
from lsgd.global_server.server import _checkpoint, _restore, _save, build_servicer
from lsgd.rules import Average, DiLoCo, EASGD
from lsgd.rules.base import RoundKind


def _saved(path) -> dict:
    with np.load(path, allow_pickle=False) as z:  # numpy's own reader
        return {k: z[k] for k in z.files}


def _seeded(store: ParamStore, n: int, value: float = 1.0) -> None:
    store.set_param_count(n)
    store.push(0, 0, CENTER, n, 1, [(0, np.full(n, value, np.float32).tobytes())])
    assert store.center_ready


def _round(store: ParamStore, rid: int, sums: list[np.ndarray]) -> None:
    """One global round in which node i uploads ``sums[i]`` (the sum of 1 participant)."""
    n = store.param_count
    store.begin(rid, RoundKind.GLOBAL, None, {i: 1 for i in range(len(sums))}, timeout=5.0)
    for i, s in enumerate(sums):
        store.push(i, rid, "sum", n, 1, [(0, s.tobytes())])
    ex = store.exchange
    assert ex.settled and ex.sums_ok and not ex.failed, ex


def _expected(rule: DiLoCo, x0: np.ndarray, rounds: list[list[np.ndarray]]):
    """Center and momentum after each round, computed with the rule's own update on copies."""
    center, m = x0.copy(), np.zeros_like(x0)
    out = []
    for sums in rounds:
        rule.update_(center, np.sum(sums, axis=0, dtype=np.float32), float(len(sums)), len(sums),
                     {"momentum": m})
        out.append((center.copy(), m.copy()))
    return out


def test_a_diloco_store_saves_and_loads_its_momentum_with_the_center(tmp_path):
    n = 1000
    rng = np.random.default_rng(0)
    store = ParamStore(DiLoCo())
    _seeded(store, n)
    x0 = store.buffers[CENTER].copy()
    rounds = [[rng.normal(size=n).astype(np.float32) for _ in range(2)] for _ in range(3)]
    for rid, sums in enumerate(rounds, start=1):
        _round(store, rid, sums)
    center, momentum = _expected(DiLoCo(), x0, rounds)[-1]
    np.testing.assert_array_equal(store.buffers[CENTER], center)
    np.testing.assert_array_equal(store.state["momentum"], momentum)
    assert np.abs(momentum).min() > 0  # a real test: a lost momentum would be zeros

    path = tmp_path / "params.npz"
    assert store.save(path)
    z = _saved(path)  # numpy reads it: the state is a member beside the center
    assert sorted(z) == ["center", "flags", "leader", "state.momentum"]
    np.testing.assert_array_equal(z["state.momentum"], momentum)
    assert zipfile.ZipFile(path).testzip() is None

    again = ParamStore(DiLoCo())
    again.load(path)
    assert again.param_count == n and again.center_ready and not again.leader_complete
    np.testing.assert_array_equal(again.buffers[CENTER], center)
    np.testing.assert_array_equal(again.state["momentum"], momentum)
    assert again.state["momentum"] is again.buffers["state.momentum"]  # the live buffer
    # ...and goes on from it: the next round is the one the first store would make
    more = [rng.normal(size=n).astype(np.float32) for _ in range(2)]
    _round(store, 4, more)
    _round(again, 4, more)
    np.testing.assert_array_equal(again.buffers[CENTER], store.buffers[CENTER])
    np.testing.assert_array_equal(again.state["momentum"], store.state["momentum"])


def test_a_save_racing_diloco_rounds_never_pairs_a_center_with_another_rounds_momentum(tmp_path):
    n = 1 << 20  # 4 MB per vector: rounds land while a save streams
    rule = DiLoCo()
    store = ParamStore(rule)
    _seeded(store, n, 1.0)
    # every element is alike, so a round's (center, momentum) is a pair of numbers; the pairs
    # of the rounds are those of the same update on 1 element
    values = [float(k % 5) - 1.5 for k in range(1, 200)]
    table = _expected(rule, np.ones(1, np.float32),
                      [[np.full(1, v, np.float32)] for v in values])
    pairs = {(float(c[0]), float(m[0])) for c, m in table} | {(1.0, 0.0)}
    rounds = len(values)
    done = threading.Event()

    def run_rounds():
        for rid, v in enumerate(values, start=1):
            _round(store, rid, [np.full(n, v, np.float32)])
            time.sleep(0.001)
        done.set()

    attempts = []
    write = store._write
    store._write = lambda *a: attempts.append(1) or write(*a)
    t = threading.Thread(target=run_rounds)
    t.start()
    path, saves = tmp_path / "params.npz", 0
    try:
        while not done.is_set() and saves < 40:
            assert store.save(path, force=True)
            saves += 1
            z = _saved(path)
            c, m = z["center"], z["state.momentum"]
            assert c.min() == c.max() and m.min() == m.max(), "a torn vector was saved"
            assert (float(c[0]), float(m[0])) in pairs, "center and momentum of different rounds"
    finally:
        t.join(60)
    assert saves >= 3 and len(attempts) > saves, (saves, len(attempts))  # some raced: redone
    assert store.exchange.round_id == rounds


@pytest.mark.parametrize("member", ["leader", "center", "state.momentum"])
def test_a_round_landing_mid_save_is_saved_whole_or_not_at_all(tmp_path, monkeypatch, member):
    """A round settles while the save writes ``member`` (deterministic, unlike the race above):
    the file holds the center and the momentum of one round, the newer one."""
    from lsgd.global_server import saves

    n, rule = 4096, DiLoCo()
    store = ParamStore(rule)
    _seeded(store, n, 1.0)
    _round(store, 1, [np.full(n, 0.5, np.float32)])
    lands = {"left": 1}

    class Writer(saves.NpzWriter):
        def vector(self, name, vec):
            if name == member and lands["left"]:
                lands["left"] -= 1
                _round(store, 2, [np.full(n, 2.0, np.float32)])  # this thread: no lock held
            super().vector(name, vec)

    monkeypatch.setattr(saves, "NpzWriter", Writer)
    path = tmp_path / "params.npz"
    assert store.save(path, force=True) and not lands["left"]
    (c1, m1), (c2, m2) = _expected(rule, np.ones(n, np.float32),
                                   [[np.full(n, 0.5, np.float32)], [np.full(n, 2.0, np.float32)]])
    z = _saved(path)
    np.testing.assert_array_equal(z["center"], c2)
    np.testing.assert_array_equal(z["state.momentum"], m2)
    assert not np.array_equal(m1, m2)


def test_a_checkpoint_and_resume_bring_back_that_rounds_momentum(tmp_path):
    n = 64
    config = JobConfig(num_groups=2, workers=1, job_id="job", algorithm="diloco",
                       checkpoint_every=1000, run_dir=str(tmp_path))
    servicer = build_servicer(config)
    store = servicer.params
    _seeded(store, n)
    rng = np.random.default_rng(1)
    _round(store, 1, [rng.normal(size=n).astype(np.float32) for _ in range(2)])
    at_ckpt = store.buffers[CENTER].copy(), store.state["momentum"].copy()
    files = {k: tmp_path / k for k in ("state.json", "params.npz", "checkpoint.json",
                                        "checkpoint.npz")}
    with servicer.cond:
        servicer.checkpoint_due = (1, servicer.coord.state(servicer.clock()))
        servicer.checkpoint_since = servicer.clock()
    _checkpoint(servicer, files["checkpoint.json"], files["checkpoint.npz"], 5.0,
                files["params.npz"])
    assert servicer.checkpoint_due is None
    assert json.loads(files["checkpoint.json"].read_text())["round"] == 1
    _round(store, 2, [rng.normal(size=n).astype(np.float32) for _ in range(2)])  # moves on
    _save(servicer, files["state.json"], files["params.npz"], None)
    later = store.buffers[CENTER].copy(), store.state["momentum"].copy()
    assert not np.array_equal(later[1], at_ckpt[1])

    resumed = build_servicer(config)  # RESUME=1: the checkpoint's round
    _restore(resumed, files["checkpoint.json"], files["checkpoint.npz"], membership=False)
    np.testing.assert_array_equal(resumed.params.buffers[CENTER], at_ckpt[0])
    np.testing.assert_array_equal(resumed.params.state["momentum"], at_ckpt[1])
    restarted = build_servicer(config)  # a server restart: the newest state
    _restore(restarted, files["state.json"], files["params.npz"])
    np.testing.assert_array_equal(restarted.params.buffers[CENTER], later[0])
    np.testing.assert_array_equal(restarted.params.state["momentum"], later[1])


def test_an_older_save_without_state_loads_with_zero_momentum(tmp_path, caplog):
    old = tmp_path / "old.npz"  # what earlier versions wrote: leader, center, flags
    np.savez(old, leader=np.arange(6, dtype=np.float32), center=np.full(6, 2.0, np.float32),
             flags=np.array([True, True]))
    store = ParamStore(DiLoCo())
    caplog.set_level(logging.INFO, logger="lsgd.global_server.params")
    store.load(old)
    assert store.buffers[CENTER].tolist() == [2.0] * 6 and store.center_ready
    assert store.state["momentum"].tolist() == [0.0] * 6
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "holds no state of rule diloco (momentum)" in lines[0], lines
    assert "starts at zero" in lines[0] and str(old) in lines[0]
    # a store whose momentum had values loses them: the file's round has none
    store.state["momentum"].fill(3.0)
    store.load(old)
    assert store.state["momentum"].tolist() == [0.0] * 6
    # a rule without state reads a DiLoCo file (its state is not its business), silently
    new = tmp_path / "new.npz"
    store.state["momentum"].fill(0.5)
    assert store.save(new, force=True)
    caplog.clear()
    plain = ParamStore(Average())
    plain.load(new)
    assert plain.buffers[CENTER].tolist() == [2.0] * 6 and plain.state == {}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    back = ParamStore(DiLoCo())
    back.load(new)
    assert back.state["momentum"].tolist() == [0.5] * 6
    assert "momentum (norm 1.224745e+00)" in caplog.text  # sqrt(6 * 0.25)


def test_a_state_member_of_the_wrong_size_is_a_clear_error(tmp_path):
    path = tmp_path / "params.npz"
    np.savez(path, leader=np.ones(4, np.float32), center=np.ones(4, np.float32),
             flags=np.ones(2, bool), **{"state.momentum": np.ones(5, np.float32)})
    store = ParamStore(DiLoCo())
    with pytest.raises(ValueError, match="state.momentum"):
        store.load(path)
    assert store.param_count is None  # nothing taken from it


def test_a_center_not_seeded_is_saved_not_ready_with_zero_state(tmp_path):
    store = ParamStore(DiLoCo())
    store.set_param_count(8)
    path = tmp_path / "params.npz"
    assert store.save(path)
    z = _saved(path)
    assert z["flags"].tolist() == [False, False] and z["state.momentum"].tolist() == [0.0] * 8


@pytest.mark.parametrize("rule, vectors", [(DiLoCo(), 4), (Average(), 3), (EASGD(alpha=0.1), 3)])
def test_memory_for_the_model_counts_the_rules_state_vectors(rule, vectors):
    n = 1000
    store = ParamStore(rule)
    store.memory = lambda: vectors * 4 * n - 1
    with pytest.raises(ParamError) as e:
        store.check_param_count(n)
    assert e.value.code == "RESOURCE_EXHAUSTED" and f"its {vectors} buffers" in str(e.value)
    store.memory = lambda: vectors * 4 * n
    store.set_param_count(n)
    assert len(store.buffers) == vectors and sorted(store.state) == sorted(rule.server_state)
    assert store.buffers[LEADER].size == n
