"""``lsgd ray`` end to end on a local 2-node Ray cluster (``ray.cluster_utils.Cluster``: two
raylets on this machine, 1 CPU and an 80 MB object store each). Skips without Ray (the ``ray``
extra; CI does not install it): ``pip install -e '.[ray]' && pytest tests/test_ray.py``.

Both Ray nodes have the same IP here, so node 0's global server listens beyond loopback and the
job runs with a secret, as on a real cluster.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from conftest import REPO, TESTS, global_summary, pid_alive, session_pids, shm_segments
from lsgd import cli, exitcodes

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from lsgd import ray_launch  # noqa: E402

MB = 1024 * 1024


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "object_store_memory": 80 * MB})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 * MB)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.fixture(autouse=True)
def _disconnect():
    yield
    if ray.is_initialized():  # a test's own connection, to look at the placement groups
        ray.shutdown()


def _left_behind(places: list[dict], job_id: str) -> list:
    """Processes of the nodes' sessions and segments of the job still there after 5 s."""
    end = time.monotonic() + 5
    while time.monotonic() < end:
        left = [s for p in places for s in session_pids(p["pid"])] + sorted(shm_segments(job_id))
        if not left:
            break
        time.sleep(0.1)
    return left


def _job(tmp_path) -> dict:
    return dict(ENTRY="toyjob:main", WORKERS=1, ITERATIONS=2000, JOB_ID="t" + uuid.uuid4().hex[:12],
                RUN_DIR=str(tmp_path / "run"), LSGD_SECRET="ray-test-secret-" + uuid.uuid4().hex,
                PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.timeout(150)
def test_a_two_node_job_runs_one_lsgd_node_per_ray_node(ray_cluster, tmp_path):
    knobs = _job(tmp_path)
    lines: list[tuple[int, str]] = []
    t0 = time.monotonic()
    result = ray_launch.run(2, knobs, address=ray_cluster.address, timeout=100,
                            on_line=lambda i, line: lines.append((i, line)))
    print(f"lsgd ray, 2 nodes: {time.monotonic() - t0:.1f} s")
    ray_info = result["ray"]
    text = "\n".join(f"node {i} | {line}" for i, line in lines)
    assert [p["exit_code"] for p in ray_info["nodes"]] == [0, 0], text
    assert ray_info["exit_code"] == 0 and ray_info["stopped"] is None
    assert result["node"] == 0 and set(result["worker_exit_codes"].values()) == {0}  # node 0's
    assert global_summary(tmp_path / "run")["counter"] == knobs["ITERATIONS"]
    # one lsgd node per Ray node, and both are this cluster's nodes
    ids = [p["ray_node_id"] for p in ray_info["nodes"]]
    assert len(set(ids)) == 2 and set(ids) <= {n.node_id for n in ray_cluster.list_all_nodes()}
    assert {i for i, _ in lines} == {0, 1}  # both nodes' logs reached the driver
    # nothing left: the nodes' processes and sessions, their segments, the placement group
    node1 = (tmp_path / "run" / "node1" / "summary.json").read_text()
    pids = result["pids"] + json.loads(node1)["pids"]
    end = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], "a process of the job survived"
    assert not _left_behind(ray_info["nodes"], knobs["JOB_ID"])
    ray.init(address=ray_cluster.address)
    assert {g["state"] for g in ray.util.placement_group_table().values()} == {"REMOVED"}


@pytest.mark.timeout(90)
def test_nodes_that_cannot_be_placed_fail_fast_naming_the_count(ray_cluster, tmp_path, capsys):
    # more lsgd nodes than Ray nodes: said at once, through the CLI, exit 2
    t0 = time.monotonic()
    knobs = [f"{k}={v}" for k, v in _job(tmp_path).items()]
    code = cli.main(["ray", "--nodes", "3", "--address", ray_cluster.address, "--", *knobs])
    err = capsys.readouterr().err
    assert code == exitcodes.CONFIG, err
    assert "cannot place 3 lsgd nodes" in err and "the cluster has 2 live Ray node(s)" in err, err
    assert time.monotonic() - t0 < 10  # the cluster is too small: no wait for the placement
    # enough Ray nodes, but not the CPUs: a bounded wait, then the same line
    with pytest.raises(ray_launch.RayLaunchError, match=r"cannot place 2 .* within 2 s: the "
                       r"cluster has 2 live Ray node\(s\)"):
        ray_launch.run(2, _job(tmp_path), address=ray_cluster.address, cpus_per_node=2,
                       place_timeout=2)
    assert not (tmp_path / "run").exists()  # no node was started
    ray.init(address=ray_cluster.address)
    assert {g["state"] for g in ray.util.placement_group_table().values()} == {"REMOVED"}


@pytest.mark.timeout(90)
def test_the_timeout_stops_every_node_and_leaves_nothing(ray_cluster, tmp_path):
    knobs = _job(tmp_path) | dict(ITERATIONS="", MINUTES=5, TOYJOB_STEP_SECONDS="0.01")
    lines: list[tuple[int, str]] = []
    t0 = time.monotonic()
    result = ray_launch.run(2, knobs, address=ray_cluster.address, timeout=12,
                            on_line=lambda i, line: lines.append((i, line)))
    took = time.monotonic() - t0
    ray_info = result["ray"]
    text = "\n".join(f"node {i} | {line}" for i, line in lines)
    assert ray_info["stopped"] == "timeout" and took < 12 + ray_launch.STOP_GRACE, text
    codes = [p["exit_code"] for p in ray_info["nodes"]]
    assert codes[0] == exitcodes.INTERRUPTED and codes[1] in (exitcodes.INTERRUPTED,
                                                             exitcodes.STOPPED), text
    assert ray_info["exit_code"] == exitcodes.INTERRUPTED
    assert not _left_behind(ray_info["nodes"], knobs["JOB_ID"])
    ray.init(address=ray_cluster.address)
    assert {g["state"] for g in ray.util.placement_group_table().values()} == {"REMOVED"}
