"""``lsgd ray``'s pure parts, without Ray: knobs, the flags they become, the worst exit code,
and the one-line errors before any Ray call (test_ray.py runs the job on a Ray cluster)."""

from __future__ import annotations

import sys

import pytest

from lsgd import cli, exitcodes, ray_launch


@pytest.mark.parametrize("codes, worst", [
    ([], 0), ([0, 0], 0), ([0, 3], 3), ([4, 1], 1), ([130, 4], 130), ([143, 130], 130),
    ([3, 4], 4), ([2, 1, 0], 2), ([0, 137], 137), ([137, 1], 137),
])
def test_the_worst_code_is_the_cause_not_its_effects(codes, worst):
    assert exitcodes.worst(codes) == worst


def test_knobs_become_flags_for_config_fields_and_stay_environment_otherwise():
    knobs = ray_launch.parse_knobs(["WORKERS=2", "ITERATIONS=", "TOYJOB_SIZE=10", "L_COMM=8"])
    assert knobs == {"WORKERS": "2", "ITERATIONS": "", "TOYJOB_SIZE": "10", "L_COMM": "8"}
    assert ray_launch._argv(knobs) == ["--workers", "2", "--iterations", "", "--l-comm", "8"]


@pytest.mark.parametrize("item", ["WORKERS", "=2", "WOR KERS=2"])
def test_a_malformed_knob_is_one_line(item, capsys):
    assert cli.main(["ray", "--nodes", "2", "--", item]) == 2
    assert capsys.readouterr().err.startswith(f"lsgd ray: error: knob {item!r} is not NAME=value")


@pytest.mark.parametrize("knobs, message", [
    (["NODE=1"], "NODE is set by lsgd ray for each node"),
    (["NUM_GROUPS=3"], "NUM_GROUPS=3 disagrees with --nodes 2"),
])
def test_knobs_the_launcher_sets_are_refused(knobs, message, capsys):
    assert cli.main(["ray", "--nodes", "2", "--", *knobs]) == 2
    assert message in capsys.readouterr().err


def test_without_ray_installed_it_says_which_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert cli.main(["ray", "--nodes", "2", "--", "WORKERS=1"]) == 2
    assert "Ray is not installed here: pip install 'lsgd[ray]'" in capsys.readouterr().err
