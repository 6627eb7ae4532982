"""`lsgd plot RUN_DIR`: the panels, from hand-written metrics files and from a short real job."""

from __future__ import annotations

import csv
import os
import struct
import subprocess
import sys

import pytest

from conftest import REPO
from lsgd.cli import main
from lsgd.local_server.metrics import COLUMNS
from lsgd.plot import draw, load

pytest.importorskip("matplotlib")

PANELS = ["loss per worker vs time", "loss per worker vs global iterations",
          "leader timeline (global rounds)", "distance to the leader or center", "evaluations"]


def write_metrics(path, rows, partial: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow(row)
        f.write(partial)  # a row still being written: no newline yet


def round_rows(node: int, rid: int, kind: str, it: int, leader: int) -> list[dict]:
    """Two workers of ``node`` (ids 2*node, 2*node+1) at one round."""
    rows = []
    for k in range(2):
        wid = 2 * node + k
        row = {"round": rid, "kind": kind, "iteration": it, "time_s": rid * 0.5 + node,
               "worker_id": wid, "worker_iterations": it // 4, "loss": 1.0 / rid + wid / 100,
               "local_leader": 2 * node, "global_leader": leader}
        if kind == "global":
            row["pull_global"] = 0.1 * wid + 1.0 / rid
        else:
            row["pull_local"] = 0.05 * rid
        rows.append(row)
    return rows


@pytest.fixture
def two_nodes(tmp_path):
    """Rounds 1..6 (even: global, with leaders 0, 3, 3), node 0's evaluations, and a line
    of node 1 cut short by a job still writing."""
    leaders = {2: 0, 4: 3, 6: 3}
    for node in (0, 1):
        rows = []
        for rid in range(1, 7):
            kind = "global" if rid % 2 == 0 else "local"
            rows += round_rows(node, rid, kind, rid * 64, leaders.get(rid, leaders.get(rid - 1, "")))
        if node == 0:
            for rid, acc in ((2, 0.5), (6, 0.9)):
                rows += [{"round": rid, "kind": "eval", "iteration": rid * 64, "time_s": rid,
                          "worker_id": leaders[rid] if t == "leader" else "", "target": t,
                          "metric": "accuracy", "value": acc - j / 10}
                         for j, t in enumerate(("leader", "average", "center"))]
        write_metrics(tmp_path / "run" / f"node{node}" / "metrics.csv", rows,
                      partial="7,local,448,3.5,2,11" if node == 1 else "")
    return tmp_path / "run"


def panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes}


def test_figure_has_every_panel_with_its_data(two_nodes):
    run = load(two_nodes)
    assert run.skipped == 1 and run.nodes == [0, 1]
    assert len(run.rounds) == 24 and len(run.evals) == 6
    assert run.node_of == {0: 0, 1: 0, 2: 1, 3: 1}
    fig = draw(run)
    ax = panels(fig)
    assert set(PANELS) <= set(ax)
    for name in PANELS[:2]:
        lines = {line.get_label(): line for line in ax[name].lines}
        assert set(lines) == {f"worker {w} (node {w // 2})" for w in range(4)}
        assert len(lines["worker 3 (node 1)"].get_ydata()) == 6
    xs = list(ax["loss per worker vs global iterations"].lines[0].get_xdata())
    assert xs == [64, 128, 192, 256, 320, 384]
    # the leader timeline: one point per global round, coloured by the leader's node
    dots = {c.get_label(): [tuple(p) for p in c.get_offsets()] for c in ax[PANELS[2]].collections}
    assert dots == {"node 0": [(128.0, 0.0)], "node 1": [(256.0, 3.0), (384.0, 3.0)]}
    assert dots and len({tuple(c.get_facecolor()[0]) for c in ax[PANELS[2]].collections}) == 2
    dist = {line.get_label(): line for line in ax[PANELS[3]].lines}
    assert set(dist) == {f"worker {w} to {t}" for w in range(4) for t in ("global leader", "node leader")}
    assert list(dist["worker 2 to global leader"].get_ydata()) == pytest.approx(
        [0.2 + 1 / 2, 0.2 + 1 / 4, 0.2 + 1 / 6])
    evals = {line.get_label(): list(line.get_ydata()) for line in ax["evaluations"].lines}
    assert evals == {"leader accuracy": [0.5, 0.9], "average accuracy": [0.4, 0.8],
                     "center accuracy": pytest.approx([0.3, 0.7])}


def test_cli_writes_a_png(two_nodes, tmp_path, capsys):
    out = tmp_path / "out.png"
    assert main(["plot", str(two_nodes), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 1200) and len(data) > 50_000
    assert main(["plot", str(two_nodes)]) == 0  # default: RUN_DIR/plots.png
    assert (two_nodes / "plots.png").read_bytes()[:4] == b"\x89PNG"


def test_a_second_metric_gets_its_own_axis(tmp_path):
    rows = [{"round": r, "kind": "eval", "iteration": 64 * r, "time_s": r, "target": t,
             "metric": m, "value": v * r} for r in (1, 2) for t in ("leader", "average")
            for m, v in (("accuracy", 0.45), ("loss", 0.05))]
    write_metrics(tmp_path / "run" / "node0" / "metrics.csv", rows)
    fig = draw(load(tmp_path / "run"))
    ax = panels(fig)["evaluations"]
    twin, = [a for a in fig.axes if a is not ax and a.bbox.bounds == ax.bbox.bounds]
    assert {line.get_label() for line in ax.lines} == {"leader accuracy", "average accuracy"}
    assert {line.get_label() for line in twin.lines} == {"leader loss", "average loss"}
    assert ax.get_ylabel() == "accuracy" and twin.get_ylabel() == "loss"
    assert len(ax.get_legend().get_texts()) == 4


def test_easgd_run_has_no_leaders_but_center_distances(tmp_path):
    rows = [{"round": r, "kind": "global", "iteration": 64 * r, "time_s": r, "worker_id": w,
             "worker_iterations": 16 * r, "loss": 1 / r, "pull_center": 1 / r} for r in (1, 2, 3)
            for w in (0, 1)]
    write_metrics(tmp_path / "run" / "node0" / "metrics.csv", rows)
    ax = panels(draw(load(tmp_path / "run")))
    assert {line.get_label() for line in ax[PANELS[3]].lines} == {"worker 0 to center", "worker 1 to center"}
    assert not ax[PANELS[2]].collections
    assert "no global leader" in " ".join(t.get_text() for t in ax[PANELS[2]].texts)


@pytest.mark.parametrize("case", ["missing", "empty", "header only"])
def test_a_run_dir_without_rows_is_one_line_and_exit_2(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    if case == "header only":
        write_metrics(run / "node0" / "metrics.csv", [])
    assert main(["plot", str(run)]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and str(run) in err
    assert not (run / "plots.png").exists()


def test_without_matplotlib_it_says_what_to_install(two_nodes):
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # import matplotlib fails
            "from lsgd.cli import main; sys.exit(main(['plot', sys.argv[1]]))")
    proc = subprocess.run([sys.executable, "-c", code, str(two_nodes)], capture_output=True,
                          text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.count("\n") == 1 and "pip install 'lsgd[plot]'" in proc.stderr
    assert not (two_nodes / "plots.png").exists()


@pytest.mark.timeout(120)
def test_plot_of_a_real_run(cluster):
    node = cluster(0, PORT=0, ENTRY="toyjob:main", ITERATIONS=2000, EVAL_EVERY=500,
                   TOYJOB_SIZE=100, LOG_LEVEL="WARNING")
    assert node.wait(90) == 0, node.output
    out = cluster.run_dir / "plots.png"
    assert main(["plot", str(cluster.run_dir)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    run = load(cluster.run_dir)
    ax = panels(draw(run))
    for name in PANELS:
        assert ax[name].lines or ax[name].collections, f"panel '{name}' is empty"
    assert {line.get_label() for line in ax["evaluations"].lines} >= {"leader accuracy",
                                                                     "average accuracy"}
    assert run.stop_reason == "iteration budget reached"
