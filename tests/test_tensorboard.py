"""TENSORBOARD=1: a node's metrics rows and the loop's worker.log() scalars as event files, read
back with TensorBoard's own reader; on_log callbacks; the writer never holds up its caller."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import pytest

from conftest import metric_rows
from lsgd import tensorboard as tb
from lsgd.cli import main
from lsgd.config import ConfigError, JobConfig
from lsgd.local_server import tensorboard as node_tb
from lsgd.local_server.metrics import MetricsWriter
from lsgd.worker.client import Worker, WorkerContext
from lsgd.worker.scalars import ScalarLog
from lsgd.worker.solo import SoloWorker

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def rows_of_round(rid, kind, it, t, workers, leader=None, local=None, **cols) -> list[dict]:
    return [{"round": rid, "kind": kind, "iteration": it, "time_s": t, "worker_id": w,
             "worker_iterations": n, "loss": 0.5 / rid + w, "local_leader": local,
             "global_leader": leader, **cols} for w, n in workers.items()]


def test_rows_become_scalars_with_the_global_iteration_as_step():
    conv = node_tb.RowScalars()
    first = list(conv(rows_of_round(1, "local", 64, 0.0, {0: 32, 1: 32}, local=1, pull_local=0.25)))
    assert ("loss/worker1", 1.5, 64) in first and ("distance/local_leader/worker0", 0.25, 64) in first
    assert ("leader/local", 1.0, 64) in first
    assert not [s for s in first if s[0] in ("leader/global", "rate/iterations_per_s")]
    # 0.5 s later: too soon for a rate point (RATE_EVERY); 1.2 s after the first, one point
    # over every worker iteration since the first rows: (64 - 32) + (80 - 32) = 80 in 1.2 s
    second = list(conv(rows_of_round(2, "global", 128, 0.5, {0: 48, 1: 48}, leader=0, local=0,
                                     pull_global=float("nan"), reset="global_leader")))
    assert ("leader/global", 0.0, 128) in second and ("resets/worker1", 1.0, 128) in second
    assert not [s for s in second if s[0].startswith(("distance", "rate"))]  # NaN: no point
    third = dict((s[0], s[1:]) for s in conv(rows_of_round(3, "global", 192, 1.2, {0: 64, 1: 80},
                                                           leader=1, pull_center=2.0)))
    assert third["rate/iterations_per_s"] == pytest.approx((80 / 1.2, 192))
    assert third["distance/center/worker1"] == (2.0, 192) and third["leader/global"] == (1.0, 192)
    evals = list(conv([{"round": 4, "kind": "eval", "iteration": 256, "time_s": 1.3,
                        "worker_id": 1, "target": "leader", "metric": "accuracy", "value": 0.97},
                       {"round": 4, "kind": "eval", "iteration": 256, "time_s": 1.3,
                        "worker_id": None, "target": "center", "metric": "error", "value": None}]))
    assert evals == [("eval/leader/accuracy", 0.97, 256)]


def test_node_sink_writes_event_files_under_run_dir(tmp_path):
    cfg = JobConfig(run_dir=str(tmp_path / "run"), node_index=0, tensorboard=True)
    metrics = MetricsWriter(tmp_path / "run" / "node0" / "metrics.csv")
    writer = node_tb.attach(cfg, metrics)
    assert writer is not None and writer.logdir == tmp_path / "run" / "tensorboard" / "node0"
    for rid in range(1, 4):
        metrics.rows(rows_of_round(rid, "global", 64 * rid, 0.8 * rid, {0: 32 * rid, 1: 32 * rid},
                                   leader=rid % 2, pull_global=0.1 * rid))
    metrics.close()
    writer.close()
    writer.close()  # twice is fine
    got = read_scalars(writer.logdir)
    assert got["leader/global"] == [(64, 1.0), (128, 0.0), (192, 1.0)]
    assert [s for s, _ in got["loss/worker0"]] == [64, 128, 192]
    assert [s for s, _ in got["distance/global_leader/worker1"]] == [64, 128, 192]
    assert [v for _, v in got["distance/global_leader/worker1"]] == pytest.approx([0.1, 0.2, 0.3])
    (step, rate), = got["rate/iterations_per_s"]  # 2 workers x 64 iterations in 1.6 s
    assert step == 192 and rate == pytest.approx(128 / 1.6)
    assert node_tb.attach(cfg.replace(tensorboard=False), metrics) is None


def test_adding_never_waits_for_a_stuck_writer(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tb, "QUEUE_BATCHES", 5)
    release = threading.Event()

    def slow(item):
        release.wait(30)
        return item

    writer = tb.EventWriter(tmp_path / "tb", slow)
    t0 = time.monotonic()
    for i in range(200):
        writer.add([("x", float(i), i)])
    assert time.monotonic() - t0 < 0.5
    assert 190 <= writer.dropped <= 195  # the thread holds one batch, the queue five
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        writer.close(timeout=0.3)  # bounded even though the thread is stuck
        assert time.monotonic() - t0 < 2.0
    assert "did not finish" in caplog.text and "dropped" in caplog.text
    release.set()
    writer._thread.join(10)
    assert not writer._thread.is_alive()


def test_a_failing_conversion_stops_the_writer_not_the_caller(tmp_path, caplog):
    def bad(item):
        raise RuntimeError("disk on fire")

    writer = tb.EventWriter(tmp_path / "tb", bad)
    with caplog.at_level(logging.WARNING):
        writer.add("anything")
        writer.close()
    assert "disk on fire" in caplog.text
    writer.add("after close")  # ignored


def test_tensorboard_without_tensorboardx_is_a_config_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX fails
    with pytest.raises(ConfigError, match=r"pip install 'lsgd\[tensorboard\]'"):
        JobConfig(tensorboard=True)
    assert main(["train", "--tensorboard", "1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensorboardX" in err
    with pytest.raises(ImportError, match="lsgd.tensorboard"):
        tb.EventWriter(tmp_path / "tb")


@pytest.mark.parametrize("scalars, step, error, words", [
    ([("a", 1.0)], None, TypeError, "dict of name -> number"),
    ({1: 1.0}, None, TypeError, "names must be strings"),
    ({" ": 1.0}, None, ValueError, "empty"),
    ({"a": "1.0"}, None, TypeError, "'a' must be a number, got str"),
    ({"a": None}, None, TypeError, "'a' must be a number"),
    ({"a": [1.0, 2.0]}, None, TypeError, "'a' must be one number"),
    ({"a": 1.0}, 1.5, TypeError, "step must be an integer"),
    ({"a": 1.0}, -1, ValueError, "step must be >= 0"),
])
def test_log_rejects_bad_input_with_one_clear_message(scalars, step, error, words):
    calls = []
    log = ScalarLog(None, lambda: 0)
    log.on_log(lambda s, n: calls.append(s))
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        log.log(scalars, step)
    assert not calls


def test_on_log_gets_floats_and_the_default_step():
    np = pytest.importorskip("numpy")
    steps = iter([7, 8])
    log = ScalarLog(None, lambda: next(steps))
    got = []

    @log.on_log
    def record(scalars, step):
        got.append((scalars, step))

    assert callable(record)  # the decorator gives the function back
    log.log({"acc": np.float32(0.5), "n": 3, "t": np.array([2.0])})
    log.log({"acc": 0.75}, step=100)
    log.log({"acc": 1.0})
    assert got == [({"acc": 0.5, "n": 3.0, "t": 2.0}, 7), ({"acc": 0.75}, 100), ({"acc": 1.0}, 8)]
    with pytest.raises(TypeError, match="on_log"):
        log.on_log("not a function")


def test_worker_log_writes_its_own_run(tmp_path):
    cfg = JobConfig(run_dir=str(tmp_path / "run"), node_index=0, workers=3, tensorboard=True)
    worker = Worker(WorkerContext(cfg, 2, inbox=None, replies=None, parent_pid=0, beat=None))
    got = []
    worker.on_log(lambda s, n: got.append((s, n)))
    worker.iterations = 41
    worker.log({"train/acc": 0.5})
    worker.log({"train/acc": 0.6}, step=50)
    worker.close()
    assert got == [({"train/acc": 0.5}, 41), ({"train/acc": 0.6}, 50)]
    assert read_scalars(tmp_path / "run" / "tensorboard" / "worker2") == {
        "train/acc": [(41, 0.5), (50, pytest.approx(0.6))]}


def test_solo_worker_logs_too(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD", raising=False)
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    solo = SoloWorker()
    got = []
    solo.on_log(lambda s, n: got.append((s, n)))
    solo.register([pytest.importorskip("numpy").zeros(3)])
    solo.step(1.0)
    solo.log({"x": 1})
    solo.close()
    assert got == [({"x": 1.0}, 1)] and not (tmp_path / "run").exists()  # no TensorBoard asked
    monkeypatch.setenv("TENSORBOARD", "1")
    solo = SoloWorker()
    solo.log({"x": 2.0}, step=3)
    solo.close()
    assert read_scalars(tmp_path / "run" / "tensorboard" / "solo") == {"x": [(3, 2.0)]}


@pytest.mark.timeout(120)
def test_a_job_with_tensorboard(cluster, tmp_path):
    out = tmp_path / "onlog"
    out.mkdir()
    node = cluster(0, PORT=0, ENTRY="tbjob:main", TENSORBOARD=1, EVAL_EVERY=500,
                   ITERATIONS=2000, WORKERS=2, TBJOB_DIR=out, LOG_LEVEL="WARNING")
    assert node.wait(90) == 0, node.output
    board = cluster.run_dir / "tensorboard"
    assert sorted(p.name for p in board.iterdir()) == ["node0", "worker0", "worker1"]
    got = read_scalars(board / "node0")
    rows = metric_rows(cluster.run_dir / "node0" / "metrics.csv")
    for wid in (0, 1):
        mine = [r for r in rows if r["kind"] != "eval" and r["worker_id"] == str(wid)]
        assert [s for s, _ in got[f"loss/worker{wid}"]] == [int(r["iteration"]) for r in mine]
        assert [v for _, v in got[f"loss/worker{wid}"]] == pytest.approx(
            [float(r["loss"]) for r in mine], rel=1e-4)
        assert f"distance/global_leader/worker{wid}" in got
    leaders = {int(r["iteration"]): float(r["global_leader"]) for r in rows if r["kind"] == "global"}
    assert dict(got["leader/global"]) == leaders
    for target in ("leader", "average"):
        evals = [(int(r["iteration"]), float(r["value"])) for r in rows
                 if r["kind"] == "eval" and r["target"] == target]
        assert len(evals) >= 4  # every 500 iterations, and at the end
        assert [s for s, _ in got[f"eval/{target}/accuracy"]] == [s for s, _ in evals]
        assert [v for _, v in got[f"eval/{target}/accuracy"]] == pytest.approx(
            [v for _, v in evals], rel=1e-4)
    for wid in (0, 1):  # the loop's own scalars, in its own run, and its on_log calls
        own = read_scalars(board / f"worker{wid}")
        assert set(own) == {"custom/loss", "custom/id"}
        assert {v for _, v in own["custom/id"]} == {float(wid)}
        calls = [json.loads(line) for line in (out / f"{wid}.onlog").read_text().splitlines()]
        assert len(calls) == len(own["custom/loss"]) > 10
        assert [c["step"] for c in calls] == [s for s, _ in own["custom/loss"]]
        assert [c["scalars"]["custom/loss"] for c in calls] == pytest.approx(
            [v for _, v in own["custom/loss"]], rel=1e-6)
