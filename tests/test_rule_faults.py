"""A rule's exchange on the global server when something goes wrong: no new center after a
failed exchange, and a rule whose update_ raises or makes the center non-finite."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from lsgd.global_server.buffers import CENTER, SUM, ParamError
from lsgd.global_server.params import ParamStore
from lsgd.rules import DiLoCo
from lsgd.rules.average import Average
from lsgd.rules.base import RoundKind

N = 4


def _upload(store: ParamStore, node: int, rid: int, vec, summands: int = 1) -> None:
    store.push(node, rid, SUM, N, summands, [(0, np.asarray(vec, np.float32).tobytes())])


def _download(store: ParamStore, rid: int) -> np.ndarray:
    return np.frombuffer(b"".join(d for _, d in store.pull(rid, CENTER, N, timeout=2.0)),
                         np.float32)


def _store(rule) -> ParamStore:
    store = ParamStore(rule)
    store.set_param_count(N)
    store.center_ready = True
    return store


def test_a_failed_exchange_has_no_new_center_to_pull_toward():
    store = _store(DiLoCo())
    store.begin(1, RoundKind.GLOBAL, None, {0: 1, 1: 1}, timeout=0.05)
    _upload(store, 0, 1, [1, 2, 3, 4])  # node 1's sum never comes
    time.sleep(0.1)
    with pytest.raises(ParamError, match="round 1 has no new center") as e:
        _download(store, 1)
    assert e.value.code == "FAILED_PRECONDITION"
    np.testing.assert_array_equal(store.buffers[CENTER], 0)  # and nothing moved
    np.testing.assert_array_equal(store.state["momentum"], 0)
    # the next round is whole: its new center is served
    store.begin(2, RoundKind.GLOBAL, None, {0: 1, 1: 1}, timeout=5)
    _upload(store, 0, 2, [1, 1, 1, 1])
    _upload(store, 1, 2, [3, 3, 3, 3])
    assert np.all(_download(store, 2) != 0)


class _Broken(Average):
    name = "broken"
    server_state = ("memory",)

    def __init__(self, how: str) -> None:
        self.how = how

    def update_(self, center, total, weight, count, state):
        state["memory"][:] = 7.0
        if self.how == "raise":
            raise RuntimeError("a bug in the rule")
        center[:] = np.nan


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_rule_whose_update_fails_leaves_the_mean_and_says_so(how, caplog):
    store = _store(_Broken(how))
    store.begin(1, RoundKind.GLOBAL, None, {0: 2}, timeout=5)
    with caplog.at_level(logging.ERROR, "lsgd.global_server.params"):
        _upload(store, 0, 1, [2, 4, 6, 8], summands=2)
    np.testing.assert_array_equal(_download(store, 1), [1, 2, 3, 4])  # the participants' mean
    np.testing.assert_array_equal(store.state["memory"], 0)  # the rule's state starts again
    assert store.rule_failures == 1
    assert "rule broken's update_" in caplog.text and "the center is set to the participants' mean" in caplog.text
