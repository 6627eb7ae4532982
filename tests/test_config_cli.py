"""Bad configuration ends with one clear line and a non-zero exit, never a traceback or hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lsgd.config import ConfigError, JobConfig

REPO = Path(__file__).resolve().parents[1]


def run_train(tmp_path, *env_pairs: tuple[str, str], args=("0",), timeout=60):
    env = dict(os.environ, PYTHON=sys.executable, RUN_DIR=str(tmp_path / "run"),
               PYTHONPATH=str(REPO))
    env.update(dict(env_pairs))
    return subprocess.run(["bash", str(REPO / "train.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)


@pytest.mark.parametrize("env, expected", [
    ((("G_COMM", "10"), ("L_COMM", "4")), "g_comm (10) must be a positive multiple of l_comm (4)"),
    ((("ALGORITHM", "sgd"),), "algorithm 'sgd' is unknown; choose one of: average, diloco, downpour, easgd, easgd-async, gosgd, grawa, lsgd, or your own"),
    ((("NUM_GROUPS", "0"),), "num_groups must be >= 1, got 0"),
    ((("NUM_GROUPS", "2"),), None),  # placeholder replaced below (node index test)
    ((("C1", "1.5"),), "c1 (pulling strength) must be in [0, 1], got 1.5"),
    ((("C2", "-0.1"),), "c2 (pulling strength) must be in [0, 1], got -0.1"),
    ((("ALPHA", "0.9"), ("ALGORITHM", "easgd")), "alpha * workers in the job = 1.8 > 1"),
    ((("LR", "fast"),), "argument --lr: lr must be float, got 'fast'"),
    ((("ITERATIONS", ""), ("MINUTES", "")), "set an iteration budget"),
    ((("WIRE", "float16"),), "wire 'float16' is unknown; choose float32 or bfloat16"),
    ((("PLANE", "ring"),), "plane 'ring' is unknown; choose star or chain"),
    ((("PLANE", "chain"), ("ALGORITHM", "easgd-async")), "algorithm 'easgd-async' has no rounds: set PLANE=star"),
    ((("PLANE", "chain"), ("DATA_HOST", "node-1")), "data_host 'node-1' is not an IP address"),
    ((("PLANE", "chain"), ("DATA_PORT", "70000")), "data_port must be in 0..65535, got 70000"),
    ((("PLANE_FANOUT", "0"),), "plane_fanout must be in 1..64, got 0"),
    ((("PLANE_FANOUT", "2"),), "with plane star it does nothing: set PLANE=chain"),
    ((("SESSION_PORT", "70000"),), "session_port must be in 0..65535 (0: the session streams on PORT), got 70000"),
    ((("PORT", "50051"), ("STATUS_PORT", "50053")),
     "STATUS_PORT 50053 is PORT+2, the default SESSION_PORT"),
    ((("SESSION_PORT", "50051"),), "SESSION_PORT 50051 is also PORT; give each its own port"),
    ((("PORT", "50051"), ("STATUS_PORT", "50061"), ("SESSION_PORT", "50061")),
     "SESSION_PORT 50061 is also STATUS_PORT"),
    ((("PORT", "50051"), ("STATUS_PORT", "50051"), ("SESSION_PORT", "0")),
     "STATUS_PORT 50051 is also PORT (the global server's)"),
    ((("PLANE", "chain"), ("PORT", "50051"), ("DATA_PORT", "50053")),
     "DATA_PORT 50053 is also node 0's SESSION_PORT (PORT+2 by default), a port of the global"),
    ((("PLANE", "chain"), ("PORT", "50051"), ("DATA_PORT", "50051")),
     "DATA_PORT 50051 is also node 0's PORT, a port of the global server"),
    ((("PLANE", "chain"), ("PORT", "50051"), ("DATA_PORT", "50054")),
     "DATA_PORT 50054 is also node 0's BULK_PORT (PORT+3 by default), a port of the global"),
    ((("IP_ADDR", "fd00::2"),), "ip_addr fd00::2 is an IPv6 address; node 0's servers listen "
     "on IPv4 only: give node 0's IPv4 address or a host name"),
    ((("BULK_PORT", "70000"),), "bulk_port must be in 0..65535 (0: parameter transfers on PORT), got 70000"),
    ((("PORT", "50051"), ("BULK_PORT", "50052")),
     "BULK_PORT 50052 is also STATUS_PORT (PORT+1 by default); give each its own port, or "
     "BULK_PORT=0 to move the parameters on PORT"),
    ((("PORT", "50051"), ("STATUS_PORT", "50054")),
     "BULK_PORT 50054 (PORT+3 by default) is also STATUS_PORT"),
    ((("BULK_PORT", "50060"), ("TLS_CA", "ca.pem")),
     "BULK_PORT's connections are authenticated by the job secret but not encrypted: with "
     "TLS_CA set, leave BULK_PORT empty or 0"),
    ((("SESSION_PORT", "50060"), ("TLS_CA", "ca.pem")),
     "SESSION_PORT's connections are authenticated by the job secret but not encrypted: with "
     "TLS_CA set, leave SESSION_PORT empty or 0"),
])
def test_bad_config_one_clear_line(tmp_path, env, expected):
    if expected is None:
        env, args, expected = (("NUM_GROUPS", "2"),), ("2",), "node index 2 is out of range for num_groups=2; use 0 .. 1"
    else:
        args = ("0",)
    res = run_train(tmp_path, *env, args=args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_unusable_run_dir_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    res = run_train(tmp_path, ("RUN_DIR", str(tmp_path / "afile" / "x")))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        f"lsgd: error: cannot create run directory {tmp_path / 'afile' / 'x'}: Not a directory"]


def test_missing_node_index_prints_usage(tmp_path):
    res = run_train(tmp_path, args=())
    assert res.returncode == 2 and "usage: bash train.sh <node-index>" in res.stderr


def test_unreachable_global_server_fails_after_bounded_retry(tmp_path):
    import socket

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_train(tmp_path, ("NUM_GROUPS", "2"), ("PORT", str(port)), ("CONNECT_TIMEOUT", "1.5"),
                    args=("1",), timeout=30)
    assert res.returncode == 1
    assert f"global server at 127.0.0.1:{port} unreachable for 1.5 s" in res.stderr
    assert "Traceback" not in res.stderr
    assert not list(Path("/dev/shm").glob("lsgd-n1-*"))


def test_bad_entry_fails_with_its_error(tmp_path):
    # found and well-formed, so only the worker's import can tell (a missing module is caught
    # before workers start: tests/test_first_run.py)
    (tmp_path / "broken_job.py").write_text("import no_such_module\n\ndef main():\n    pass\n")
    res = run_train(tmp_path, ("ENTRY", "broken_job:main"), ("PORT", "0"), timeout=90)
    assert res.returncode == 1
    assert "entry 'broken_job:main': cannot import broken_job: No module named 'no_such_module'" in res.stderr
    assert "no worker left on this node" in res.stderr


@pytest.mark.parametrize("rule", ["easgd-async", "downpour", "gosgd"])
def test_resume_with_an_asynchronous_rule_is_one_clear_line(tmp_path, rule):
    # such a job makes no checkpoint; one of a synchronous rule in the same RUN_DIR holds a
    # node memory of another layout (it used to start, then stop the job: "buffer_outbox missing")
    res = run_train(tmp_path, ("ALGORITHM", rule), ("RESUME", "1"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert lines == [f"lsgd: error: resume needs the checkpoints of a synchronous rule; {rule} "
                     "makes none (set RESUME=0: the job starts afresh)"], res.stderr
    JobConfig(algorithm="easgd", resume=True)  # a synchronous rule may resume


def test_config_derived_values():
    c = JobConfig(num_groups=3, node_index=2, workers=4, l_comm=8)
    assert c.window == 4 and c.total_workers == 12 and c.worker_id(1) == 9
    assert JobConfig(avg_size=5).window == 5
    with pytest.raises(ConfigError, match="port 0"):
        JobConfig(num_groups=2, node_index=1, port=0)
    with pytest.raises(ConfigError, match="job_id"):
        JobConfig(job_id="a b")


def test_generated_grpc_code_matches_the_proto():
    res = subprocess.run([sys.executable, "-m", "lsgd.proto.generate", "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_a_data_port_that_cannot_be_bound_is_one_line_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = run_train(tmp_path, ("PLANE", "chain"), ("DATA_PORT", str(port)))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"lsgd: error: PLANE=chain: 127.0.0.1:{port} is taken; set DATA_PORT to a free port "
        "(0: any) or DATA_HOST to an address of this machine"]
    res = run_train(tmp_path, ("PLANE", "chain"), ("DATA_HOST", "192.0.2.77"))  # TEST-NET-1
    assert res.returncode == 2 and "192.0.2.77:0 is not an address of this machine" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "global").exists()  # nothing was started


def test_a_python_without_lsgds_dependencies_gets_one_line_not_a_traceback():
    # e.g. train.sh run outside the virtualenv lsgd was installed into
    code = ("import sys, runpy; sys.modules['grpc'] = None; "
            "runpy.run_module('lsgd', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, "train"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "cannot import 'grpc'" in out.stderr and "virtualenv" in out.stderr
