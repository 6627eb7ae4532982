"""The Rule API tutorial (docs/rules.md, examples/rules/topk.py): its math on hand values through
the test kit, its size, one run of exactly that file through train.sh from outside the
repository, the one-line errors of bad ALGORITHM / RULE_ARGS specs, and the docs' code blocks
against the files they quote. Also the API extension the tutorial needs: ``Rule.weights``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_clean_exit, global_summary, metric_rows
from lsgd.config import JobConfig
from lsgd.local_server.round_runner import RoundMixin
from lsgd.rules import RULES, Average, Contribution, Rule, RuleError
from lsgd.rules.base import MIN_WEIGHT, SUM, node_weights
from lsgd.rules.testkit import RoundDriver

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "examples" / "rules" / "topk.py"
DOCS = REPO / "docs" / "rules.md"


def _load_topk() -> type[Rule]:
    spec = importlib.util.spec_from_file_location("tutorial_topk", TUTORIAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TopK


TopK = _load_topk()


def vecs(*values: float) -> list[np.ndarray]:
    return [np.array([v], dtype=np.float32) for v in values]


# --- (a) the tutorial's math, on hand values --------------------------------------------------

def test_one_node_pulls_toward_the_mean_of_its_k_best():
    w = vecs(0, 10, 20, 40)
    d = RoundDriver(TopK(k=2, pull=1.0), [w])
    d.global_round([0.4, 0.1, 0.3, 0.2])  # the best two: workers 1 (10) and 3 (40)
    assert d.rounds[-1]["weights"] == [MIN_WEIGHT, 1.0, MIN_WEIGHT, 1.0]
    expected = (10 + 40 + 1e-6 * (0 + 20)) / (2 + 2e-6)  # 24.999985: the others' share is tiny
    np.testing.assert_allclose(d.center, [expected], rtol=1e-6)
    for x in w:  # pull 1: every worker becomes the center
        np.testing.assert_array_equal(x, d.center)


def test_two_nodes_take_the_best_of_each_node_not_of_the_job():
    w = vecs(0, 10, 20, 40)
    d = RoundDriver(TopK(k=2, pull=0.5, nodes=2), [w[:2], w[2:]])
    # the job's two best (workers 0 and 1) are both on node 0; the rule takes each node's best
    d.global_round([0.1, 0.2, 0.8, 0.9])
    assert d.rounds[-1]["weights"] == [1.0, MIN_WEIGHT, 1.0, MIN_WEIGHT]
    center = (0 + 20 + 1e-6 * (10 + 40)) / (2 + 2e-6)  # 10.000015
    np.testing.assert_allclose(d.center, [center], rtol=1e-6)
    np.testing.assert_allclose([x[0] for x in w], [x - 0.5 * (x - center) for x in (0, 10, 20, 40)],
                               rtol=1e-6)  # [5, 10, 15, 25] up to the others' 1e-6 share
    d.global_round([0.5, 0.5, 0.5, 0.5])  # ties go to the lowest id of each node: 0 and 2
    assert d.rounds[-1]["weights"] == [1.0, MIN_WEIGHT, 1.0, MIN_WEIGHT]


def test_a_worker_without_a_loss_ranks_last():
    cs = [Contribution(4, float("nan")), Contribution(5, 0.7), Contribution(6, 0.2)]
    assert TopK(k=2).weights(cs) == [MIN_WEIGHT, 1.0, 1.0]


def test_k_is_shared_out_over_the_nodes_from_the_job_config():
    for k, groups, per_node in [(2, 2, 1), (3, 2, 2), (1, 3, 1), (4, 1, 4)]:
        config = JobConfig(algorithm=f"{TUTORIAL}:TopK", rule_args=f"k={k},pull=0.25",
                           num_groups=groups)
        rule = config.make_rule()
        assert (rule.per_node, rule.pull) == (per_node, 0.25)
    explicit = JobConfig(algorithm=f"{TUTORIAL}:TopK", rule_args="k=2,nodes=1", num_groups=2)
    assert explicit.make_rule().per_node == 2  # a RULE_ARGS value wins over the job's


# --- the API extension: Rule.weights, asked once per node ------------------------------------

class _Scaled(Rule):
    """weight() only: the default weights() asks it for each participant."""

    def weight(self, c: Contribution) -> float:
        return {0: 2.0, 1: 0.0, 2: float("nan"), 3: 1e9}[c.worker_id]

    def pulls(self, kind, roles):
        return []


def test_default_weights_ask_weight_and_a_node_clips_them():
    cs = [Contribution(i, 0.1) for i in range(4)]
    assert _Scaled().weights(cs)[0] == 2.0
    weights, clipped = node_weights(_Scaled(), cs)
    assert weights == [2.0, MIN_WEIGHT, MIN_WEIGHT, 1e6]
    assert [p for p, _ in clipped] == [1, 2, 3]


def test_weights_must_be_one_per_participant():
    class Short(Average):
        def weights(self, contributions):
            return [1.0]

    with pytest.raises(RuleError, match="gave 1 weights for 2 participants"):
        node_weights(Short(), [Contribution(0, 0.1), Contribution(1, 0.2)])


def test_the_node_loop_asks_weights_with_the_nodes_participants_together():
    """The local server's sum (round_runner._sum_slots) weighs by TopK.weights over the node's
    participants: only the node's best is summed with weight 1."""
    slots = vecs(1.0, 3.0, 100.0)
    node = types.SimpleNamespace(
        rule=TopK(k=1), warned=[],
        store=types.SimpleNamespace(buffer={SUM: np.zeros(1, np.float32)}.__getitem__,
                                    slot=slots.__getitem__),
        workers=[types.SimpleNamespace(worker_id=10 + i, set_up_at=0) for i in range(3)])
    node.repeats = types.SimpleNamespace(warning=lambda *a: node.warned.append(a))
    node._weights = types.MethodType(RoundMixin._weights, node)
    node._tell_missing_scalars = types.MethodType(RoundMixin._tell_missing_scalars, node)
    joins = {0: types.SimpleNamespace(loss=0.5, scalars={}, iterations=5),
             1: types.SimpleNamespace(loss=0.2, scalars={}, iterations=5),
             2: types.SimpleNamespace(loss=0.9, scalars={}, iterations=5)}
    total = RoundMixin._sum_slots(node, joins, weighted=True)
    assert total == pytest.approx(1 + 2e-6)
    np.testing.assert_allclose(node.store.buffer(SUM), [3.0 + 1e-6 * 101.0], rtol=1e-6)
    assert not node.warned


# --- (b) under 50 lines ------------------------------------------------------------------------

def test_the_tutorial_rule_is_under_50_lines():
    lines = [line for line in TUTORIAL.read_text().splitlines() if line.strip()]
    assert len(lines) < 50, f"{TUTORIAL.name} has {len(lines)} non-blank lines"


# --- (e) the docs show the files as they are -------------------------------------------------

_BLOCK = re.compile(r"<!-- (file|from): (\S+) -->\n```\w*\n(.*?)\n```", re.S)


def test_the_docs_code_blocks_are_the_files_they_quote():
    blocks = _BLOCK.findall(DOCS.read_text())
    assert ("file", "examples/rules/topk.py") in {(k, p) for k, p, _ in blocks}
    assert len(blocks) >= 6  # the tutorial and the built-ins' excerpts
    for kind, path, code in blocks:
        text = (REPO / path).read_text()
        if kind == "file":
            assert code + "\n" == text, f"docs/rules.md's copy of {path} is not the file"
        else:
            assert code + "\n" in text, f"docs/rules.md quotes {path}, which no longer has:\n{code}"


def test_every_code_block_that_names_a_file_is_marked():
    """A block without a marker would escape the check above: every block that looks like a
    copy of the tutorial (its class line) must carry the marker."""
    text = DOCS.read_text()
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        if "class TopK(Rule):" in m.group(1):
            assert text[: m.start()].endswith("<!-- file: examples/rules/topk.py -->\n")


def test_the_readme_and_the_docs_list_every_rule_and_knob():
    readme = (REPO / "README.md").read_text()
    algorithm_row = next(line for line in readme.splitlines() if line.startswith("| `ALGORITHM` |"))
    docs = DOCS.read_text()
    for name in RULES:
        assert f"`{name}`" in algorithm_row, f"README's ALGORITHM row lacks {name}"
        assert f"### `{name}`" in docs, f"docs/rules.md has no section on {name}"
    knobs = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):-", (REPO / "train.sh").read_text())) - {"PYTHON"}
    assert {"ALGORITHM", "RULE_ARGS", "OUTER_LR", "OUTER_MOMENTUM"} <= knobs
    table = [line for line in readme.splitlines() if line.startswith("| `")]
    for knob in knobs:
        assert any(f"`{knob}`" in line.split("|")[1] for line in table), f"README lacks {knob}"


def test_the_docs_test_kit_examples_run(monkeypatch):
    """The page's unmarked examples that drive a rule (the test kit's, the tutorial's test) run
    and their asserts hold."""
    monkeypatch.syspath_prepend(str(TUTORIAL.parent))  # "examples/rules on sys.path"
    text = DOCS.read_text()
    examples = [m.group(1) for m in re.finditer(r"(?<!-->\n)```python\n(.*?)```", text, re.S)
                if "RoundDriver(" in m.group(1) or "AsyncDriver(" in m.group(1)]
    assert len(examples) >= 3
    for code in examples:
        exec(compile(code, "docs/rules.md", "exec"), {})


# --- (d) bad specs: one line, exit 2 ---------------------------------------------------------

def _train(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"),
                PYTHONPATH=str(REPO), **env)
    return subprocess.run(["bash", str(REPO / "train.sh"), "0"], env=full, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize("spec, args, expected", [
    ("{tmp}/absent.py:TopK", "", "rule file '{tmp}/absent.py' not found"),
    ("{topk}:TopKay", "", "{topk} has no class TopKay"),
    ("{tmp}/plain.py:Plain", "", "{tmp}/plain.py: Plain is not a subclass of lsgd.rules.Rule"),
    ("{tmp}/plain.py:Half", "", "Half does not implement pulls"),
    ("{topk}:TopK", "q=3", "rule_args: TopK takes no argument 'q' (it takes: k, pull, nodes)"),
    ("{topk}:TopK", "k=two", "rule_args: k must be int, got 'two'"),
    ("{topk}:TopK", "k=0", "ValueError: need k >= 1, nodes >= 1, pull in [0, 1]; got 0, 1, 0.5"),
])
def test_a_bad_rule_spec_is_one_line_and_exit_2(tmp_path, spec, args, expected):
    (tmp_path / "plain.py").write_text(
        "from lsgd.rules import Rule\n\nclass Plain:\n    pass\n\nclass Half(Rule):\n    pass\n")
    fill = {"tmp": str(tmp_path), "topk": str(TUTORIAL)}
    res = _train(tmp_path, ALGORITHM=spec.format(**fill), RULE_ARGS=args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and expected.format(**fill) in lines[0], res.stderr
    assert "Traceback" not in res.stderr + res.stdout


# --- (c) exactly the tutorial's file, through train.sh, from outside the repository -----------

@pytest.mark.timeout(180)
def test_the_tutorial_rule_trains_two_nodes_of_two_workers(cluster):
    knobs = dict(NUM_GROUPS=2, WORKERS=2, ALGORITHM=f"{TUTORIAL}:TopK", RULE_ARGS="k=2",
                 ITERATIONS=6000)
    n0 = cluster(0, PORT=0, **knobs)  # cwd: the test's tmp directory, outside the repository
    assert not str(n0.log.parent).startswith(str(REPO))
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    assert n1.wait(120) == 0, n1.output
    assert n0.wait(30) == 0, n0.output
    counter = global_summary(cluster.run_dir)["counter"]
    done = sum(sum(n.summary()["workers"].values()) for n in (n0, n1))
    assert counter == done == 6000
    ev = n0.summary()["evaluation"]
    print(f"topk: test accuracy {ev}")
    assert ev["center"]["accuracy"] >= 0.95  # the rule's product
    assert "Traceback" not in n0.output + n1.output
    rows = metric_rows(cluster.run_dir / "node1" / "metrics.csv")
    assert {r["kind"] for r in rows} == {"global"}
    assert all(r["pull_center"] for r in rows)  # every participant pulled toward the center
    for node in (n0, n1):  # 1e-6 is a weight in bounds: none was clipped
        assert "weight" not in node.summary().get("repeated_warnings", {})
    assert_clean_exit(cluster.run_dir, [n0, n1])
