"""A 2-node job under real Slurm daemons (issue 13): `srun -N 2 -n 2 --ntasks-per-node=1 bash
train.sh`, no node index, each task placed by `lsgd place` from Slurm's environment.

Skips unless srun and sinfo exist and a cluster with two idle nodes answers. On one machine
(as root; not in CI, which stays fast):

    bash deploy/slurm/local-cluster.sh              # munged, slurmctld, slurmd n1 + n2
    python -m pytest tests/test_slurm.py -v          # finds /var/tmp/lsgd-slurm/slurm.conf
    bash deploy/slurm/local-cluster.sh stop

On a real cluster, run it from a login node with SLURM_CONF (or /etc/slurm) pointing at it and
the repository on a shared file system.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, TESTS, global_summary, pid_alive, shm_segments

LOCAL_CONF = Path(os.environ.get("LSGD_SLURM_DIR", "/var/tmp/lsgd-slurm")) / "slurm.conf"
ITERATIONS = 3000
JOB_SECONDS = 150  # srun's whole run; Slurm's own --time is a little longer


def _slurm_env() -> dict[str, str]:
    """This environment without any allocation's SLURM_* (the test asks for its own job), with
    deploy/slurm's SLURM_CONF unless one is set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    if "SLURM_CONF" not in env and LOCAL_CONF.exists():
        env["SLURM_CONF"] = str(LOCAL_CONF)
    return env


def _run(args: list[str], timeout: float = 15) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(args, env=_slurm_env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


@pytest.fixture
def slurm() -> dict[str, str]:
    """Skip unless a Slurm cluster answers with two idle nodes; its environment otherwise."""
    for tool in ("srun", "sinfo", "scontrol", "scancel"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool}: Slurm is not installed (deploy/slurm/local-cluster.sh)")
    done = _run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"])
    if done is None or done.returncode != 0:
        why = "no answer in 15 s" if done is None else (done.stderr.strip() or "failed")
        pytest.skip(f"no Slurm cluster answers sinfo ({why}): deploy/slurm/local-cluster.sh")
    if len(set(done.stdout.split())) < 2:
        pytest.skip(f"Slurm has fewer than 2 idle nodes ({done.stdout.split()})")
    return _slurm_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_addr(node: str) -> str:
    done = _run(["scontrol", "show", "node", "-o", node])
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", done.stdout if done else "")
    return m.group(1) if m else node


@pytest.mark.timeout(JOB_SECONDS + 60)
def test_srun_runs_a_2_node_job_end_to_end_placed_by_slurm(slurm, tmp_path):
    job_id = "s" + uuid.uuid4().hex[:12]
    run_dir = tmp_path / "run"
    env = slurm | {
        "ENTRY": "toyjob:main", "ITERATIONS": str(ITERATIONS), "RUN_DIR": str(run_dir),
        "JOB_ID": job_id, "PYTHON": sys.executable, "PORT": str(_free_port()),
        "STATUS_PORT": "0", "PROGRESS_EVERY": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    # each task says where Slurm put it, then is exactly `bash train.sh` (no index)
    task = ('echo "task $SLURM_PROCID on $SLURMD_NODENAME of $SLURM_STEP_NODELIST"; '
            f'exec bash {REPO / "train.sh"}')
    cmd = ["srun", "-N", "2", "-n", "2", "--ntasks-per-node=1", "--label", f"--job-name={job_id}",
           f"--time={JOB_SECONDS // 60 + 2}", "--kill-on-bad-exit=1", f"--chdir={tmp_path}",
           "bash", "-c", task]
    log = tmp_path / "srun.log"
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(JOB_SECONDS)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:  # Slurm misbehaves or the job hangs: end it, then fail
                _run(["scancel", f"--name={job_id}"])
                proc.kill()
                proc.wait(30)
    output = log.read_text()
    assert rc == 0, f"srun {'timed out' if rc is None else f'exited {rc}'} after " \
                    f"{time.monotonic() - start:.0f} s:\n{output}"

    tasks = re.findall(r"^(\d+): task \1 on (\S+) of (\S+)$", output, re.M)
    where = {i: node for i, node, _ in tasks}
    assert set(where) == {"0", "1"} and where["0"] != where["1"], output  # two nodes
    nodelist = tasks[0][2]
    hosts = _run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
    assert where["0"] == hosts[0], output  # task 0 on the node list's first host
    addr = _node_addr(hosts[0])
    for i in (0, 1):
        assert f"{i}: lsgd: node {i} of 2, placed by slurm; node 0 at {addr}" in output, output
    assert global_summary(run_dir)["counter"] == ITERATIONS

    # nothing left behind: no process of the job, no segment, no job in Slurm's queue
    nodes = [global_summary(run_dir)] + [
        json.loads((run_dir / f"node{i}" / "summary.json").read_text())
        for i in (0, 1)]
    pids = [nodes[0]["pid"]] + nodes[1]["pids"] + nodes[2]["pids"]
    end = time.monotonic() + 10
    while (any(pid_alive(p) for p in pids) or shm_segments(job_id)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "a process of the job survived"
    assert not shm_segments(job_id), f"shared memory left behind: {shm_segments(job_id)}"
    queue = _run(["squeue", "-h", f"--name={job_id}", "-o", "%i %T"])
    assert queue is not None and not queue.stdout.strip(), f"job still queued: {queue.stdout}"
