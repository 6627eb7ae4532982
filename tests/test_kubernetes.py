"""deploy/kubernetes validates offline against the Kubernetes schema, and what it sets maps to
the node's place in the job (issue 13, item 2): pure, no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from lsgd.placement import Placement, from_env

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")  # the dev extra installs it

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
VERSION = "1.30"  # the oldest Kubernetes these manifests promise to fit


def manifests() -> dict[str, dict]:
    out = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[doc["kind"]] = doc
    return out


@pytest.mark.parametrize("kind", ["Job", "Service", "Secret"])
def test_each_manifest_validates_strictly_against_the_schema(kind):
    kv.validate(manifests()[kind], VERSION, strict=True)


def test_the_validator_catches_a_mistake():  # (so the test above can fail)
    job = manifests()["Job"]
    job["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(job, VERSION, strict=True)
    job = manifests()["Job"]
    job["spec"]["completions"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(job, VERSION, strict=True)


def test_every_pod_maps_to_its_node_and_node_0_s_stable_name():
    m = manifests()
    job, svc = m["Job"], m["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (node,) = pod["containers"]
    env = {e["name"]: e["value"] for e in node["env"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["NUM_GROUPS"])
    # node 0's name: <job>-0.<subdomain>, and the subdomain is the headless Service
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert env["IP_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert int(env["PORT"]) in {p["port"] for p in svc["spec"]["ports"]}
    assert node["command"] == ["bash", "train.sh"]  # no index: the pod's index gives it
    assert node["readinessProbe"]["exec"]["command"] == ["python", "-m", "lsgd", "probe"]
    for kind in ("startupProbe", "livenessProbe"):
        assert node[kind]["exec"]["command"] == ["python", "-m", "lsgd", "probe", "--live"]
    # the startup probe must outlast the node's own wait to join before the liveness one counts
    startup = node["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > int(env["CONNECT_TIMEOUT"])
    for index in range(spec["completions"]):  # what train.sh -> lsgd place makes of each pod
        placed = from_env(env | {"JOB_COMPLETION_INDEX": str(index)})
        assert placed == Placement(index, spec["completions"], "lsgd-0.lsgd", "kubernetes")


def test_shared_memory_is_memory_backed_and_the_secret_is_a_mounted_file():
    pod = manifests()["Job"]["spec"]["template"]["spec"]
    (node,) = pod["containers"]
    mounts = {v["mountPath"]: v["name"] for v in node["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[mounts["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e["value"] for e in node["env"]}
    secret_dir = str(Path(env["SECRET_FILE"]).parent)
    assert volumes[mounts[secret_dir]]["secret"]["secretName"] == \
        manifests()["Secret"]["metadata"]["name"]
    assert Path(env["SECRET_FILE"]).name in manifests()["Secret"]["stringData"]


def test_only_a_pod_killed_from_outside_is_replaced():
    # lsgd's own exit codes fail the Job (running the node again cannot help); a liveness kill
    # (137/143) is retried up to backoffLimit; an eviction does not count
    from lsgd import exitcodes
    spec = manifests()["Job"]["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert len(fail) == 1 and fail[0]["onExitCodes"]["operator"] == "In"
    assert set(fail[0]["onExitCodes"]["values"]) == {exitcodes.FAILED, exitcodes.CONFIG,
                                                      exitcodes.DEGRADED, exitcodes.STOPPED}
    assert fail[0]["onExitCodes"]["containerName"] == spec["template"]["spec"]["containers"][0]["name"]
    assert spec["backoffLimit"] >= 1
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget"
               for r in rules)
