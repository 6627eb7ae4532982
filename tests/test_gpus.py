"""Which GPU each worker process sees (lsgd/local_server/gpus.py), and the GPU path itself.

The mapping is checked without a GPU: it only sets each worker's ``CUDA_VISIBLE_DEVICES``. The
CUDA tests at the end skip without a CUDA device (CI has none); they ran on an H200
(docs/benchmarks.md, "GPU").
"""

from __future__ import annotations

import json

import pytest

from lsgd.config import ConfigError, JobConfig
from lsgd.local_server import gpus


def test_worker_i_gets_gpu_i_mod_n_and_the_evaluator_worker_0s():
    four = gpus.node_gpus("", {}, count=4)
    assert [gpus.for_worker(four, i) for i in range(6)] == ["0", "1", "2", "3", "0", "1"]
    assert gpus.for_worker(four, -1) == "0"  # the evaluator
    two = gpus.node_gpus("", {}, count=2)
    assert gpus.describe(two, 3).startswith("workers on GPUs 0, 1, 0 (")


def test_devices_overrides_then_the_nodes_own_visible_list_then_every_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "4,6"}
    assert gpus.node_gpus("2,2,3", env, count=8) == ["2", "2", "3"]  # DEVICES first
    assert gpus.node_gpus("", env, count=8) == ["4", "6"]  # a scheduler's allocation
    assert gpus.node_gpus("", {"CUDA_VISIBLE_DEVICES": "GPU-ab12, GPU-cd34"}, 8) == \
        ["GPU-ab12", "GPU-cd34"]
    assert gpus.node_gpus("", {"CUDA_VISIBLE_DEVICES": ""}, count=8) is None  # hidden: no GPU
    assert gpus.node_gpus("", {}, count=0) is None  # a CPU machine: nothing is set
    assert gpus.node_gpus("all", env, count=8) is None  # every worker sees every GPU
    assert gpus.for_worker(None, 3) is None and gpus.describe(None, 2) is None


def test_gpus_are_counted_by_nvidia_smi_else_from_the_driver(tmp_path):
    assert gpus.machine_gpus(tmp_path / "missing", smi=None) == 0
    for bus in ("0000:01:00.0", "0000:41:00.0", "0000:81:00.0"):
        (tmp_path / bus).mkdir()
    (tmp_path / "stray-file").write_text("")
    assert gpus.machine_gpus(tmp_path, smi=None) == 3  # no nvidia-smi: the driver's entries
    assert gpus.machine_gpus(tmp_path, smi=str(tmp_path / "no-such-tool")) == 3
    smi = tmp_path / "bin" / "nvidia-smi"  # a container's own GPUs, fewer than the host's
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1)'\n"
                   "echo '  MIG 1g.18gb Device 0: (UUID: MIG-2)'\necho 'GPU 1: NVIDIA H200'\n")
    smi.chmod(0o755)
    assert gpus.machine_gpus(tmp_path, smi=str(smi)) == 2


@pytest.mark.parametrize("value, ok", [
    ("", True), ("all", True), ("0", True), ("0,1,0,1", True), (" 1, 3", True),
    ("GPU-3f2a9c1e-0000-1111-2222-333344445555", True), ("MIG-GPU-3f2a/1/0", True),
    ("cuda:0", False), ("0,,1", False), ("0;1", False), ("-1", False), ("x" * 5000, False),
    (",".join(["0"] * 1025), False),
])
def test_devices_values_are_checked_when_the_job_starts(value, ok):
    if ok:
        assert JobConfig(devices=value or None).devices == (value or None)
    else:
        with pytest.raises(ConfigError, match="devices"):
            JobConfig(devices=value)


def test_a_bad_devices_knob_is_one_line_and_exit_2(tmp_path):
    from test_config_cli import run_train

    res = run_train(tmp_path, ("DEVICES", "cuda:1"), timeout=30)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "devices entry 'cuda:1' is not a GPU" in res.stderr


RECORD = '''
import json, os
import numpy as np
import lsgd

def main():
    x = np.zeros(10, np.float32)
    worker = lsgd.connect([x])
    with open(os.path.join(os.environ["SEEN_DIR"], f"{worker.worker_id}.json"), "w") as f:
        json.dump(os.environ.get("CUDA_VISIBLE_DEVICES"), f)
    while worker.step(1.0):
        x += 1
'''


@pytest.mark.timeout(90)
def test_each_worker_process_sees_its_gpu_and_a_respawned_one_the_same(cluster, tmp_path):
    (tmp_path / "seenjob.py").write_text(RECORD)
    seen = tmp_path / "seen"
    seen.mkdir()
    node = cluster(0, PORT=0, WORKERS=3, ITERATIONS=600, DEVICES="5,7", ENTRY="seenjob:main",
                   SEEN_DIR=seen, PYTHONPATH=tmp_path, LOG_LEVEL="INFO")
    assert node.wait(60) == 0, node.output
    got = {int(p.stem): json.loads(p.read_text()) for p in seen.glob("*.json")}
    assert got == {0: "5", 1: "7", 2: "5"}
    assert "workers on GPUs 5, 7, 5 (local worker i on GPU i mod 2" in node.output


@pytest.mark.parametrize("strength", [0.0, 0.1, 0.37, 1.0])
def test_a_pull_on_the_device_is_the_slots_pull_bit_for_bit(monkeypatch, strength):
    """DevicePull's arithmetic, run here on CPU tensors over an unregistered region: the same
    float32 results as ops.pull_toward_ on the slot, the statistics tail untouched."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from lsgd.rules import ops
    from lsgd.worker import torch_pinned

    monkeypatch.setattr(torch_pinned, "CHUNK", 7)  # tensors span several uploads
    rng = np.random.default_rng(0)
    shapes, stats = [(5, 4), (3,), (2, 9)], 6
    tensors = [torch.tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    tensors.append(torch.tensor(rng.standard_normal(stats).astype(np.float32)))
    spans, pos = [], 0
    for t in tensors:
        spans.append((pos, t.numel()))
        pos += t.numel()
    count = pos - stats
    memory = np.zeros(4 * pos + 64, np.uint8)  # like the node segment: a target somewhere in it
    region = torch_pinned.PinnedRegion(memory, torch.device("cpu"), register=False)
    target = memory[64:].view(np.float32)
    target[:] = rng.standard_normal(pos).astype(np.float32)
    slot = np.concatenate([t.reshape(-1).numpy() for t in tensors])
    want = ops.pull_toward_(slot[:count], target[:count], strength)
    got = torch_pinned.DevicePull(tensors, spans)(region.view(target), strength, count)
    assert np.array_equal(np.concatenate([t.reshape(-1).numpy() for t in tensors]), slot)
    assert got == pytest.approx(want, rel=1e-6)
    assert region.view(np.zeros(3, np.float32)) is None  # outside the region: not a view
    assert region.view(target[1:]) is not None


# ---------------------------------------------------------------- on a CUDA device only
def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


def test_pinned_round_trip_of_a_25m_parameter_model_is_exact():
    torch = _cuda()
    import numpy as np

    from lsgd.worker.adapters import as_params

    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 2048)).cuda()
    p = as_params(model)
    assert p.param_count > 25_000_000 and p._host.is_pinned()
    flat = np.empty(p.param_count, np.float32)
    p.read_into(flat)
    assert np.array_equal(flat[:10], model[0].weight.detach().reshape(-1)[:10].cpu().numpy())
    flat *= -1
    p.write_from(flat)
    back = torch.cat([t.detach().reshape(-1) for t in p.tensors]).cpu().numpy()
    assert np.array_equal(back, flat)


def test_a_page_locked_slot_is_copied_straight_and_exactly():
    torch = _cuda()
    import numpy as np

    from lsgd.worker.adapters import as_params

    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512)).cuda()
    p = as_params(model, buffers="average")
    memory = np.zeros(8 * p.param_count, np.uint8)  # two vectors, like a node segment
    slot = memory[: 4 * p.param_count].view(np.float32)
    other = np.empty(p.param_count, np.float32)
    assert p.pin(memory) and not p.pin(memory)  # once
    assert p._direct(slot) is not None and p._direct(other) is None
    p.read_into(slot)
    ref = torch.cat([t.detach().reshape(-1) for t in p.tensors]).cpu().numpy()
    assert np.array_equal(slot, ref)
    slot[:] = np.arange(p.param_count, dtype=np.float32)
    p.write_from(slot)  # straight from the slot
    assert np.array_equal(torch.cat([t.detach().reshape(-1) for t in p.tensors]).cpu().numpy(), slot)
    other[:] = -1.5
    p.write_from(other)  # any other vector: through the pinned buffer
    assert all(bool((t == -1.5).all()) for t in p.tensors)
    p.unpin()
    p.unpin()
    assert p._direct(slot) is None
    p.read_into(slot)
    assert (slot == -1.5).all()


def test_a_pull_on_the_gpu_matches_the_pull_in_the_slot():
    torch = _cuda()
    import numpy as np

    from lsgd.rules import ops
    from lsgd.worker.adapters import as_params

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048)).cuda()
    p = as_params(model, buffers="average")
    n = p.param_count - p.stats_count
    memory = np.zeros(8 * p.param_count, np.uint8)
    slot = memory[: 4 * p.param_count].view(np.float32)
    leader = memory[4 * p.param_count :].view(np.float32)
    leader[:] = np.random.default_rng(1).standard_normal(p.param_count).astype(np.float32)
    assert p.pin(memory) and p.can_pull(leader)
    assert not p.can_pull(np.zeros(p.param_count, np.float32))  # not page-locked
    p.read_into(slot)
    want = slot.copy()
    want_d = ops.pull_toward_(want[:n], leader[:n], 0.3)
    got_d = p.pull_toward(leader, 0.3, n)
    p.read_into(slot)
    assert np.array_equal(slot, want)  # bit for bit; the statistics tail untouched
    assert got_d == pytest.approx(want_d, rel=1e-5)
    assert p.pull_toward(leader, 1.0, n) == pytest.approx(np.linalg.norm(slot[:n] - leader[:n]), rel=1e-5)
    p.read_into(slot)
    assert np.array_equal(slot[:n], leader[:n])
    half = as_params(torch.nn.Linear(8, 8).cuda().half())  # not float32: pulled in the slot
    region = np.zeros(4 * half.param_count, np.uint8)
    half.pin(region)
    assert not half.can_pull(region.view(np.float32))
    p.unpin()
    half.unpin()
