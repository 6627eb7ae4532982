"""A node's place in the job from Slurm's or Kubernetes' environment (issue 13, step 1): the
host-list parser and the mapping, pure."""

from __future__ import annotations

import pytest

from conftest import assert_clean_exit, global_summary
from lsgd.placement import Placement, PlacementError, expand_hostlist, from_env, main


@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("gpu-[01-03,07],cpu5", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu5"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),  # the lower bound's width: no padding here
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # every combination, in order
    ("x[3],y[1,2]-ib", ["x3", "y1-ib", "y2-ib"]),
    (" c1,c2 ", ["c1", "c2"]),
])
def test_slurm_host_lists_expand_as_scontrol_does(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, words", [
    ("", "empty"), ("gpu-[01-03", "'[' without ']'"), ("gpu-01]", "']' without '['"),
    ("a[[1-2]]", "nested"), ("a[3-1]", "backwards"), ("a[1-x]", "not a number"),
    ("a,,b", "an empty name"), ("a[0-999999]", "over 100000"),
])
def test_a_bad_host_list_is_one_clear_error(text, words):
    with pytest.raises(PlacementError, match="host list|empty") as e:
        expand_hostlist(text)
    assert words in str(e.value)


SLURM = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu-[01-03]"}


def test_slurm_places_one_node_per_task_with_node_0_on_the_first_host():
    assert from_env(SLURM) == Placement(1, 3, "gpu-01", "slurm")
    # scontrol's own expansion is taken as given
    assert from_env(SLURM, hosts=["h7", "h8", "h9"]).ip_addr == "h7"
    # the user's IP_ADDR wins (node 0 on another network); NODE / NUM_GROUPS must agree
    assert from_env(SLURM | {"IP_ADDR": "10.0.0.5", "NUM_GROUPS": "3", "NODE": "1"}) == \
        Placement(1, 3, "10.0.0.5", "slurm")


@pytest.mark.parametrize("extra, words", [
    ({"SLURM_NTASKS": "6"}, "one task per node; Slurm gave SLURM_NTASKS=6 on 3 node(s)"),
    ({"SLURM_NTASKS_PER_NODE": "2"}, "SLURM_NTASKS_PER_NODE=2"),
    ({"SLURM_PROCID": "3"}, "SLURM_PROCID=3 is not below SLURM_NTASKS=3"),
    ({"SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not a whole number"),
    ({"NUM_GROUPS": "2"}, "NUM_GROUPS=2 disagrees with slurm, which makes it 3"),
    ({"NODE": "0"}, "NODE=0 disagrees with slurm, which makes it 1"),
    ({"SLURM_JOB_NODELIST": "gpu-[01-03"}, "'[' without ']'"),
])
def test_a_slurm_misfit_names_the_variable_and_the_fix(extra, words):
    with pytest.raises(PlacementError) as e:
        from_env(SLURM | extra)
    assert words in str(e.value)
    assert "--ntasks-per-node=1" in str(e.value) or "one task" not in str(e.value)


def test_slurm_places_on_the_steps_nodes_and_refuses_a_batch_script_of_several_nodes():
    # as real srun gives it (slurmd 22.05): a 2-task step inside a 3-node allocation
    step = SLURM | {"SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "gpu-[02-03]",
                    "SLURM_STEP_NUM_NODES": "2"}
    assert from_env(step) == Placement(1, 2, "gpu-02", "slurm")
    # sbatch's own script has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    with pytest.raises(PlacementError, match="not one of its tasks .* use `srun "
                                             "--ntasks-per-node=1 bash train.sh`"):
        from_env(batch)
    one = batch | {"SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "c7"}
    assert from_env(one) == Placement(0, 1, "c7", "slurm")  # a 1-node batch script is the job
    assert from_env(batch | {"SLURM_STEPID": "0"}).node_index == 0  # older Slurm's name


def test_lsgd_place_takes_node_0s_nodeaddr_from_scontrol(tmp_path, monkeypatch, capsys):
    # the local cluster's case (deploy/slurm): node names n1, n2 that are not host names
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\ncase "$2" in\n hostnames) echo n1; echo n2 ;;\n'
                    ' node) echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.0.$(echo $4 | tr -d n)'
                    ' NodeHostName=vm" ;;\nesac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    env = SLURM | {"SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert main(env) == 0
    assert capsys.readouterr().out == "1 2 10.1.0.1 slurm\n"
    assert main(env | {"IP_ADDR": "n1-ib"}) == 0  # the user's address wins, scontrol unasked
    assert capsys.readouterr().out == "1 2 n1-ib slurm\n"
    fake.write_text("#!/bin/sh\nexit 1\n")  # no controller: the parsed name, as before
    assert main(env) == 0
    assert capsys.readouterr().out == "1 2 n1 slurm\n"


def test_kubernetes_takes_the_index_and_needs_num_groups_and_ip_addr():
    env = {"JOB_COMPLETION_INDEX": "2", "NUM_GROUPS": "4", "IP_ADDR": "lsgd-0.lsgd"}
    assert from_env(env) == Placement(2, 4, "lsgd-0.lsgd", "kubernetes")
    with pytest.raises(PlacementError, match="NUM_GROUPS and IP_ADDR are not"):
        from_env({"JOB_COMPLETION_INDEX": "0", "NUM_GROUPS": "2"})
    with pytest.raises(PlacementError, match="JOB_COMPLETION_INDEX=4 is not below NUM_GROUPS=4"):
        from_env(env | {"JOB_COMPLETION_INDEX": "4"})


def test_no_launcher_is_none_and_a_partial_slurm_environment_is_not_slurm():
    assert from_env({}) is None
    assert from_env({"SLURM_JOB_ID": "5"}) is None  # e.g. a login shell inside an allocation


# ---------------------------------------------------------------------- train.sh, placed
def _slurm_env(procid: int, **extra) -> dict:
    # what srun --ntasks-per-node=1 gives two tasks; both "hosts" are this machine
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(procid), "SLURM_NTASKS": "2",
            "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NODELIST": "localhost,localhost"} | extra


@pytest.mark.timeout(90)
def test_train_sh_under_a_slurm_environment_places_both_nodes_without_an_index(cluster):
    knobs = dict(ENTRY="toyjob:main", ITERATIONS=3000)
    n0 = cluster(0, _placed=True, PORT=0, **_slurm_env(0), **knobs)
    n1 = cluster(1, _placed=True, PORT=cluster.port_of_node0(), **_slurm_env(1), **knobs)
    for node in (n1, n0):
        assert node.wait(60) == 0, node.output
    assert "lsgd: node 0 of 2, placed by slurm; node 0 at localhost" in n0.output
    assert "lsgd: node 1 of 2, placed by slurm; node 0 at localhost" in n1.output
    assert global_summary(cluster.run_dir)["counter"] == 3000
    assert sorted(n0.summary()["workers"]) + sorted(n1.summary()["workers"]) == \
        ["0", "1", "2", "3"]  # two nodes, not two node 0s
    assert_clean_exit(cluster.run_dir, [n0, n1])


@pytest.mark.timeout(30)
def test_train_sh_without_an_index_or_a_launcher_and_a_misfit_are_one_line_exit_2(cluster):
    bare = cluster(0, _placed=True)
    assert bare.wait(20) == 2
    assert bare.output.startswith("usage: bash train.sh <node-index>"), bare.output
    misfit = cluster(0, _placed=True, **_slurm_env(0, SLURM_NTASKS="4"))
    assert misfit.wait(20) == 2
    lines = misfit.output.strip().splitlines()
    assert len(lines) == 1 and "--ntasks-per-node=1" in lines[0], misfit.output


@pytest.mark.timeout(60)
def test_a_node_0_name_that_does_not_resolve_yet_is_said_once_and_bounded(cluster):
    # a Kubernetes pod starts before node 0's Service name resolves; .invalid never does
    node = cluster(1, NUM_GROUPS=2, IP_ADDR="lsgd-0.lsgd.invalid", CONNECT_TIMEOUT=2,
                   ALLOW_INSECURE=1, ENTRY="toyjob:main")
    assert node.wait(30) == 1
    out = node.output
    assert out.count("node 0's address lsgd-0.lsgd.invalid (IP_ADDR) does not resolve yet") == 1
    assert "did not resolve within 2 s (CONNECT_TIMEOUT)" in out, out
