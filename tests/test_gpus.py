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
    assert gpus.describe(two, 3) == ("workers on GPUs 0, 1, 0 (local worker i on GPU i mod 2; "
                                     "set DEVICES to choose)")


def test_devices_overrides_then_the_nodes_own_visible_list_then_every_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "4,6"}
    assert gpus.node_gpus("1,1,0", env, count=8) == ["6", "6", "4"]  # DEVICES first, counted
    assert gpus.node_gpus("2,3", {}, count=8) == ["2", "3"]  # in what the node sees
    assert gpus.node_gpus("", env, count=8) == ["4", "6"]  # a scheduler's allocation
    assert gpus.node_gpus("", {"CUDA_VISIBLE_DEVICES": "GPU-ab12, GPU-cd34"}, 8) == \
        ["GPU-ab12", "GPU-cd34"]
    assert gpus.node_gpus("", {"CUDA_VISIBLE_DEVICES": ""}, count=8) is None  # hidden: no GPU
    assert gpus.node_gpus("", {}, count=0) is None  # a CPU machine: nothing is set
    assert gpus.node_gpus("all", env, count=8) is None  # every worker sees every GPU
    assert gpus.for_worker(None, 3) is None and gpus.describe(None, 2) is None
    # as CUDA reads it: up to the first entry that is not a GPU (-1 hides every GPU)
    assert gpus.node_gpus("", {"CUDA_VISIBLE_DEVICES": "-1"}, count=8) is None
    assert gpus.node_gpus("", {"CUDA_VISIBLE_DEVICES": "2,x,3"}, count=8) == ["2"]
    assert "sees no GPU" in gpus.check("0", {"CUDA_VISIBLE_DEVICES": "-1"})


def test_devices_naming_gpus_the_node_does_not_have_is_said_at_start():
    assert gpus.unseen("7", {}, count=0) == ("DEVICES names GPU 7 but this node sees no GPU: "
                                             "its workers will find no GPU there")
    assert "sees 2 GPUs" in gpus.unseen("0,2", {}, count=2)
    assert gpus.unseen("0,1", {}, count=2) is None and gpus.unseen("", {}, count=0) is None
    assert gpus.unseen("5", {"CUDA_VISIBLE_DEVICES": "4,5"}, count=0) is None  # checked by check()


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
import json, os, signal
import numpy as np
import lsgd

def main():
    worker = lsgd.connect()
    who = "evaluator" if worker.is_evaluator else f"{worker.worker_id}-{worker.restarts}"
    with open(os.path.join(os.environ["SEEN_DIR"], who + ".json"), "w") as f:
        json.dump(os.environ.get("CUDA_VISIBLE_DEVICES"), f)
    x = np.zeros(10, np.float32)
    worker.register([x], evaluate=lambda: {"accuracy": 1.0})
    while worker.step(1.0):
        x += 1
        if worker.worker_id == 1 and not worker.restarts and worker.iterations == 50:
            os.kill(os.getpid(), signal.SIGKILL)  # started again, on the GPU it had
'''


@pytest.mark.timeout(90)
def test_each_worker_process_sees_its_gpu_and_a_respawned_one_the_same(cluster, tmp_path):
    (tmp_path / "seenjob.py").write_text(RECORD)
    seen = tmp_path / "seen"
    seen.mkdir()
    node = cluster(0, PORT=0, WORKERS=3, ITERATIONS=1500, EVAL_EVERY=500, DEVICES="5,7",
                   ENTRY="seenjob:main", SEEN_DIR=seen, PYTHONPATH=tmp_path, LOG_LEVEL="INFO")
    assert node.wait(60) == 0, node.output
    got = {p.stem: json.loads(p.read_text()) for p in seen.glob("*.json")}
    assert got == {"0-0": "5", "1-0": "7", "2-0": "5", "1-1": "7", "evaluator": "5"}, got
    assert "workers on GPUs 5, 7, 5 (local worker i on GPU i mod 2; from DEVICES)" in node.output


def test_devices_indices_count_the_gpus_the_node_sees():
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert gpus.node_gpus("1,0,1", env) == ["5", "4", "5"]
    assert gpus.node_gpus("GPU-ab12,0", env) == ["GPU-ab12", "4"]
    assert gpus.check("1", env) is None
    assert "it sees 2 (CUDA_VISIBLE_DEVICES=4,5): use 0..1" in gpus.check("0,2", env)
    assert "sees no GPU" in gpus.check("0", {"CUDA_VISIBLE_DEVICES": ""})
    assert gpus.check("3", {}) is None  # no list: the machine's own indices


def test_a_hung_nvidia_smi_does_not_hold_the_node(tmp_path):
    import time

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 60\n")
    smi.chmod(0o755)
    t = time.monotonic()
    assert gpus.machine_gpus(tmp_path / "missing", smi=str(smi), timeout=0.5) == 0
    assert time.monotonic() - t < 5


class _Inbox:
    def put(self, msg: object) -> None:
        pass


def _worker_with(model, region=None):
    """A Worker holding ``model`` over a real node segment (one slot, two buffers)."""
    from lsgd.config import JobConfig
    from lsgd.local_server.store import NodeStore, StoreLayout
    from lsgd.worker.adapters import as_params
    from lsgd.worker.client import Worker, WorkerContext

    w = Worker(WorkerContext(JobConfig(), 0, _Inbox(), None, 0, None))
    w._params = as_params(model, buffers="average")
    layout = StoreLayout.new("tgpus", 0, w._params.param_count, 1, ("local_leader", "global_leader"))
    store = NodeStore.create(layout)
    w._store, w._pulled = store, w._params.param_count - w._params.stats_count
    if region:  # the GPU path's views and arithmetic, here on CPU tensors
        assert w._params.pin(store.memory(), register=False)
    return w, store


@pytest.mark.parametrize("pulls, stats", [
    ((("local_leader", 0.3), ("global_leader", 0.1)), True),
    ((("local_leader", 0.3),), False),
    ((("local_leader", 0.0),), True),  # no pull, the statistics averaged: still into the model
    ((("global_leader", 1.0),), False),
    ((), False),
])
def test_pulls_on_the_model_leave_model_and_slot_as_pulls_in_the_slot_do(pulls, stats):
    """Worker._apply_pulls on both paths: the model, the slot and the distances agree."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from lsgd.local_server import messages as m

    results = []
    for on_model in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
        w, store = _worker_with(model, region=on_model)
        try:
            rng = np.random.default_rng(1)
            for name in ("local_leader", "global_leader"):
                store.buffer(name)[:] = rng.standard_normal(w._params.param_count)
            slot = store.slot(0)
            w._params.read_into(slot)
            if stats:  # the node set the statistics tail to the participants' mean
                slot[w._pulled:] = np.arange(w._params.stats_count, dtype=np.float32)
            assert w._params.can_pull(store.buffer("local_leader")) is on_model
            d = w._apply_pulls(slot, m.Pull(1, tuple(pulls), True, stats_averaged=stats))
            model_now = torch.cat([t.detach().reshape(-1) for t in w._params.tensors]).numpy()
            results.append((d, slot.copy(), model_now.copy()))
        finally:
            w._params.unpin()
            store.close(unlink=True)
    (d0, slot0, model0), (d1, slot1, model1) = results
    assert np.array_equal(slot0, slot1) and np.array_equal(model0, model1)
    assert np.array_equal(slot1, model1)  # the slot holds the model
    assert d0.keys() == d1.keys() and all(d1[k] == pytest.approx(d0[k], rel=1e-6) for k in d0)


def test_a_model_whose_storage_changed_after_pin_is_pulled_where_it_now_lives():
    torch = pytest.importorskip("torch")
    import numpy as np

    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Conv2d(3, 2, 1))
    w, store = _worker_with(model, region=True)
    try:
        model.to(memory_format=torch.channels_last)  # same Parameter objects, new storage
        target = store.buffer("local_leader")
        target[:] = 0.5
        assert not w._params.can_pull(target)  # not contiguous now: pulled in the slot
        model.to(memory_format=torch.contiguous_format)
        assert w._params.can_pull(target)
        w._params.pull_toward(target, 1.0, w._pulled)
        assert all(bool((t == 0.5).all()) for t in w._params.tensors)
    finally:
        w._params.unpin()
        store.close(unlink=True)


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


def test_a_refused_page_lock_leaves_cuda_usable():
    """CUDA refuses a second registration of the same memory; the worker goes on through the
    pinned buffer, and the refusal must not surface at the next kernel."""
    torch = _cuda()
    import numpy as np

    from lsgd.worker.adapters import as_params

    memory = np.zeros(1 << 20, np.uint8)
    first = as_params(torch.nn.Linear(16, 16).cuda())
    second = as_params(torch.nn.Linear(16, 16).cuda())
    assert first.pin(memory)
    assert not second.pin(memory)  # already registered
    x = torch.randn(64, 64, device="cuda") @ torch.randn(64, 64, device="cuda")
    assert bool(torch.isfinite(x).all())
    slot = memory[: 4 * second.param_count].view(np.float32)
    second.read_into(slot)  # through its pinned buffer
    assert np.array_equal(slot, torch.cat([t.detach().reshape(-1) for t in second.tensors]).cpu().numpy())
    first.unpin()
