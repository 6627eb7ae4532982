"""What a first-time user meets (issue 9, item 20 and papercuts): a private RUN_DIR, a port
in use, a wrong ENTRY, and a first screen without noise. Each bounded, most without workers."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lsgd.lograte import RepeatedLog
from lsgd.worker.process import check_entry

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def run_train(tmp_path, timeout=60, **env):
    full = dict(os.environ, PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"),
                PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]), PORT="0")
    full.update({k: str(v) for k, v in env.items()})
    return subprocess.run(["bash", str(REPO / "train.sh"), "0"], env=full, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)


def test_run_dir_is_created_private(tmp_path):
    # RESUME=1 without a checkpoint ends (exit 2) right after the run directory is made
    run = tmp_path / "runs" / "job"
    res = run_train(tmp_path, RUN_DIR=run, RESUME=1)
    assert res.returncode == 2, res.stderr
    for d in (run, run / "node0", tmp_path / "runs"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, (d, oct(d.stat().st_mode))


def test_an_existing_run_dir_keeps_its_mode(tmp_path):
    run = tmp_path / "mine"
    run.mkdir(mode=0o755)
    os.chmod(run, 0o755)
    assert run_train(tmp_path, RUN_DIR=run, RESUME=1).returncode == 2
    assert stat.S_IMODE(run.stat().st_mode) == 0o755  # the user's directory (maybe ".")
    assert stat.S_IMODE((run / "node0").stat().st_mode) == 0o700


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_train(tmp_path, PORT=port, timeout=30)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == [f"lsgd: error: PORT {port} is taken on 127.0.0.1 (another lsgd job or another "
                     "program listens there); pick another with PORT=<n> on every node, or PORT=0 "
                     "on a single machine for any free port"], res.stderr


def test_a_session_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:  # PORT+2, the default SESSION_PORT, of a free PORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_train(tmp_path, PORT=port - 2, timeout=30)
        explicit = run_train(tmp_path, PORT=0, SESSION_PORT=port, timeout=30)
    for r, why in ((res, "; empty SESSION_PORT means PORT+2"), (explicit, "")):
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip().splitlines() == [
            f"lsgd: error: SESSION_PORT {port} is taken on 127.0.0.1 (another lsgd job or "
            f"another program listens there{why}); set SESSION_PORT=<n> to a free port, or "
            "SESSION_PORT=0 to serve the nodes' session streams on PORT"], r.stderr


def test_a_bulk_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:  # PORT+3, the default BULK_PORT, of a free PORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_train(tmp_path, PORT=port - 3, SESSION_PORT=0, timeout=30)
        explicit = run_train(tmp_path, PORT=0, BULK_PORT=port, timeout=30)
    for r, why in ((res, "; empty BULK_PORT means PORT+3"), (explicit, "")):
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip().splitlines() == [
            f"lsgd: error: BULK_PORT {port} is taken on 127.0.0.1 (another lsgd job or "
            f"another program listens there{why}); set BULK_PORT=<n> to a free port, or "
            "BULK_PORT=0 to move the parameters on PORT"], r.stderr


@pytest.mark.parametrize("entry, expected", [
    ("nosuch_pkg.train:main", "ENTRY 'nosuch_pkg.train:main': no module named 'nosuch_pkg.train' "
                              "(check ENTRY and PYTHONPATH)"),
    ("lsgd.jobs.nosuch:main", "ENTRY 'lsgd.jobs.nosuch:main': no module named 'lsgd.jobs.nosuch' "
                              "(check ENTRY and PYTHONPATH)"),
    ("toyjob:mian", "ENTRY 'toyjob:mian': toyjob has no function mian"),
])
def test_a_wrong_entry_is_caught_before_workers_start(tmp_path, entry, expected):
    res = run_train(tmp_path, ENTRY=entry, timeout=30)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [f"lsgd: error: {expected}"]
    assert "worker" not in res.stdout + res.stderr  # no worker process was started


def _module(tmp_path, name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(source)


def test_check_entry_reads_the_source_without_running_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "ran"
    _module(tmp_path, "b4_plain", f"open({str(marker)!r}, 'w').close()\n"
            "import numpy as np\nfrom os import path as p\nX = 1\n"
            "if X:\n    def cond():\n        pass\nelse:\n    pass\n"
            "try:\n    import missing_thing as alias\nexcept ImportError:\n    alias = None\n"
            "def main(worker):\n    inner = 1\nclass Job:\n    method = 1\n")
    for fn in ("main", "Job", "cond", "alias", "np", "p", "X"):
        assert check_entry(f"b4_plain:{fn}") is None, fn
    for fn in ("inner", "method", "nope"):
        assert check_entry(f"b4_plain:{fn}") == f"ENTRY 'b4_plain:{fn}': b4_plain has no function {fn}"
    assert not marker.exists() and "b4_plain" not in sys.modules
    # what it cannot rule out is accepted (the worker's import has the last word)
    _module(tmp_path, "b4_star", "from os.path import *\n")
    _module(tmp_path, "b4_getattr", "def __getattr__(name):\n    return print\n")
    _module(tmp_path, "b4_globals", "globals()['made'] = print\n")
    for mod in ("b4_star", "b4_getattr", "b4_globals"):
        assert check_entry(f"{mod}:anything") is None, mod
    # a package's submodule is found without importing the package
    pkg = tmp_path / "b4_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "job.py").write_text("def main():\n    pass\n")
    assert check_entry("b4_pkg.job:main") is None
    assert "no module named 'b4_pkg.nojob'" in check_entry("b4_pkg.nojob:main")
    assert "no function other" in check_entry("b4_pkg.job:other")
    assert check_entry("b4_plain.sub:main").startswith("ENTRY 'b4_plain.sub:main': no module")
    assert not marker.exists() and "b4_pkg" not in sys.modules
    assert check_entry("examples/torch_cnn.py --device cpu") is None  # scripts: JobConfig checks


def test_repeated_warnings_are_logged_once_then_counted(caplog):
    now = [0.0]
    repeats = RepeatedLog(logging.getLogger("b4.test"), every=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="b4.test"):
        for rid in range(1, 101):  # one a second for 100 s
            repeats.warning("late", "round %d: reported too late", rid)
            if rid == 50:
                repeats.warning("worker 3 reset", "round %d: worker 3 reset", rid)
            now[0] += 1.0
        totals = repeats.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "round 1: reported too late",
        "round 31: reported too late (29 more like this in the last 30 s, not logged)",
        "round 50: worker 3 reset",
        "round 61: reported too late (29 more like this in the last 30 s, not logged)",
        "round 91: reported too late (29 more like this in the last 30 s, not logged)",
        "late: 9 more time(s) since it was last logged (100 in all)",
    ]
    assert totals == {"late": 100, "worker 3 reset": 1}


@pytest.mark.timeout(90)
def test_the_default_job_has_no_pytensor_config_noise(tmp_path):
    res = run_train(tmp_path, ITERATIONS=200, timeout=80)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "test accuracy" in res.stdout
    assert "Suppressed KeyError" not in res.stdout + res.stderr
