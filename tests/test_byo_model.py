"""Bring your own model: entries, the evaluator, averaged statistics (toy job, through train.sh)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_clean_exit, metric_rows

TOY = dict(ENTRY="toyjob:main", LOG_LEVEL="INFO")


@pytest.mark.timeout(120)
def test_evaluation_runs_beside_training_without_stopping_it(cluster):
    # Each evaluation sleeps 1.5 s; rounds come every ~0.1 s. If evaluating held the workers,
    # no round could happen between an evaluation round and the arrival of its result.
    node = cluster(0, PORT=0, ITERATIONS=8000, EVAL_EVERY=1000, TOYJOB_STEP_SECONDS="0.001",
                   TOYJOB_EVAL_SECONDS="1.5", **TOY)
    assert node.wait(90) == 0, node.output
    rows = metric_rows(cluster.run_dir / "node0" / "metrics.csv")
    rounds = [r for r in rows if r["kind"] != "eval"]
    evals = [r for r in rows if r["kind"] == "eval"]
    final = max(int(r["round"]) for r in rows)
    periodic = [r for r in evals if int(r["round"]) < final]
    assert periodic, node.output
    assert {r["target"] for r in periodic} == {"leader", "average"}
    for e in periodic:
        start = next(float(r["time_s"]) for r in rounds if r["round"] == e["round"])
        done = float(e["time_s"])
        assert done - start >= 1.5  # the evaluation took its time...
        during = [r for r in rounds if start < float(r["time_s"]) < done]
        assert len(during) >= 4, (e, done - start)  # ...while rounds went on
    summary = node.summary()
    assert summary["evaluator"]["evaluations"] == len({r["round"] for r in periodic})
    assert summary["evaluator"]["skipped"] > 0  # evaluation rounds that came while it was busy
    assert summary["evaluator"]["exit_code"] == 0
    assert_clean_exit(cluster.run_dir, [node])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["lsgd", "easgd"])
def test_statistics_are_averaged_over_the_node_not_pulled(cluster, tmp_path, algorithm):
    # Each worker starts its 3 statistics at its id; training never changes them. After the
    # rounds, every worker of a node holds exactly the node's mean, untouched by the pulls.
    knobs = dict(NUM_GROUPS=2, WORKERS=3, ITERATIONS=3000, ALGORITHM=algorithm, ALPHA=0.05,
                 TOYJOB_STATS=3, TOYJOB_COUNT_DIR=tmp_path, **TOY)
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n0.wait(90) == 0 and n1.wait(90) == 0, n0.output + n1.output
    stats = {int(p.stem): np.loadtxt(p) for p in tmp_path.glob("*.stats")}
    assert sorted(stats) == [0, 1, 2, 3, 4, 5]
    for wid, s in stats.items():
        assert np.all(s == (1.0 if wid < 3 else 4.0)), (wid, s)
    assert_clean_exit(cluster.run_dir, [n0, n1])


@pytest.mark.timeout(60)
def test_function_entry_without_argument_uses_connect(cluster, tmp_path):
    (tmp_path / "noarg_job.py").write_text(
        "import numpy as np\nimport lsgd\n\n"
        "def main(argv=None):  # optional parameters do not receive the worker\n"
        "    x = np.zeros(10, np.float32)\n"
        "    worker = lsgd.connect([x])\n"
        "    while worker.step(1.0):\n"
        "        x += 1\n")
    node = cluster(0, PORT=0, ITERATIONS=500, ENTRY="noarg_job:main", PYTHONPATH=tmp_path)
    assert node.wait(60) == 0, node.output
    assert sum(node.summary()["workers"].values()) == 500


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script, message", [
    ("import lsgd\n", "returned without registering the model"),
    ("raise SystemExit(3)\n", "exited with status 3"),
    ("import lsgd\nlsgd.connect(['not an array'])\n", "register() takes"),
])
def test_a_script_that_does_not_become_a_worker_fails_clearly(cluster, tmp_path, script, message):
    path = tmp_path / "bad.py"
    path.write_text(script)
    node = cluster(0, PORT=0, ITERATIONS=100, ENTRY=str(path))
    assert node.wait(60) == 1, node.output
    assert message in node.output
    assert "no worker left on this node" in node.output


def test_missing_entry_script_is_a_configuration_error(cluster, tmp_path):
    node = cluster(0, PORT=0, ENTRY=str(tmp_path / "nope.py") + " --steps 5")
    assert node.wait(30) == 2
    assert "entry script" in node.output and "nope.py' not found" in node.output
