"""The README's examples: five added lines, trained through train.sh on 2 nodes x 2 workers."""

from __future__ import annotations

import ast
import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_clean_exit, metric_rows

EXAMPLES = ["pytensor_mlp", "torch_cnn"]
README_ACCURACY = 0.95  # the README states: leader and worker average reach >= 0.95


def _code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring (the docstrings may differ)."""
    text = path.read_text()
    body = ast.parse(text).body
    start = body[1].lineno - 1 if isinstance(body[0], ast.Expr) else 0
    return text.splitlines()[start:]


def _added_lines(name: str) -> list[str]:
    before = _code_lines(REPO / "examples" / "single" / f"{name}.py")
    after = _code_lines(REPO / "examples" / f"{name}.py")
    added = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        assert tag in ("equal", "insert"), f"{name}: the loop was changed, not only added to: " \
                                           f"{before[i1:i2]} -> {after[j1:j2]}"
        if tag == "insert":
            added += after[j1:j2]
    return added


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_plain_loop_becomes_a_worker_with_at_most_five_added_lines(name):
    added = [line for line in _added_lines(name) if line.strip()]
    assert 1 <= len(added) <= 5, added
    readme = (REPO / "README.md").read_text().splitlines()
    for line in added:  # the README's before/after diff shows exactly these lines
        assert "+" + line in readme, f"README diff lacks: +{line}"


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_worker_script_still_runs_alone(name):
    if name.startswith("torch"):
        pytest.importorskip("torch")
    out = subprocess.run([sys.executable, f"examples/{name}.py", "--steps", "200"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not started by train.sh; training alone" in out.stderr
    assert float(out.stdout.split("test accuracy")[1].split()[0]) > 0.5


def _train_two_nodes(cluster, entry: str, algorithm: str) -> dict:
    knobs = dict(NUM_GROUPS=2, WORKERS=2, ITERATIONS=8000, EVAL_EVERY=2000, ALGORITHM=algorithm,
                 ENTRY=entry, PYTHONPATH=REPO)
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n0.wait(180) == 0, n0.output
    assert n1.wait(60) == 0, n1.output
    for node in (n0, n1):
        assert set(node.summary()["worker_exit_codes"].values()) == {0}, node.output
        assert "Traceback" not in node.output
        assert "did not stop" not in node.output, node.output  # no worker was terminated
    assert n0.summary()["evaluator"]["exit_code"] == 0
    rows = [r for r in metric_rows(cluster.run_dir / "node0" / "metrics.csv") if r["kind"] == "eval"]
    rounds = sorted({int(r["round"]) for r in rows})
    assert len(rounds) >= 2, rows  # at least one periodic evaluation (others may be skipped
    # while the evaluator is busy) and the final one
    assert_clean_exit(cluster.run_dir, [n0, n1])
    ev = n0.summary()["evaluation"]
    print(f"{entry} {algorithm}: {json.dumps(ev)}")
    return ev


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["lsgd", pytest.param("easgd", marks=pytest.mark.slow)])
def test_pytensor_example_trains_on_two_nodes(cluster, algorithm):
    ev = _train_two_nodes(cluster, str(REPO / "examples" / "pytensor_mlp.py"), algorithm)
    assert ev["leader"]["accuracy"] >= README_ACCURACY
    assert ev["average"]["accuracy"] >= README_ACCURACY
    if algorithm == "easgd":
        assert ev["center"]["accuracy"] >= README_ACCURACY


@pytest.mark.timeout(300)
def test_torch_example_trains_on_two_nodes(cluster):
    pytest.importorskip("torch")
    ev = _train_two_nodes(cluster, str(REPO / "examples" / "torch_cnn.py") + " --device cpu", "lsgd")
    assert ev["leader"]["accuracy"] >= README_ACCURACY
    assert ev["average"]["accuracy"] >= README_ACCURACY


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["lsgd", "easgd"])
def test_torch_example_on_cuda(cluster, algorithm):
    """2 nodes x 2 workers, every worker's model on its GPU (tests/test_gpus.py: which one)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ev = _train_two_nodes(cluster, str(REPO / "examples" / "torch_cnn.py") + " --device cuda",
                          algorithm)
    assert ev["leader"]["accuracy"] >= README_ACCURACY
    assert ev["average"]["accuracy"] >= README_ACCURACY
    if algorithm == "easgd":
        assert ev["center"]["accuracy"] >= README_ACCURACY


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_read_mnist_idx_files(name, tmp_path):
    from test_data import write_idx
    import numpy as np

    if name.startswith("torch"):
        pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for split, n in (("train", 64), ("t10k", 16)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8),
                  compress=True)
    out = subprocess.run([sys.executable, f"examples/{name}.py", "--steps", "5", "--mnist", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "test accuracy" in out.stdout
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    out = subprocess.run([sys.executable, f"examples/{name}.py", "--mnist", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "t10k-labels-idx1-ubyte" in out.stderr
