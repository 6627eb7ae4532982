"""The user's training loop (issue 9): a loop that trains arrays other than the registered ones
is stopped with one line naming the fix (item 7); ``step()`` and the stand-in worker outside
``train.sh`` (papercuts)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import global_summary
from lsgd.config import JobConfig
from lsgd.rules import ops
from lsgd.worker.client import SoloWorker, Worker, WorkerContext

# ------------------------------------------------------------------ item 7: the in-place rule

NUMPY_JOB = """
import numpy as np

def main(worker):
    w = np.zeros(100, np.float32)
    frozen = np.ones(50, np.float32)  # registered, never trained: must not look like a fault
    worker.register([w, frozen])
    rng = np.random.default_rng(worker.worker_id)
    while True:
        g = w - 1 + rng.normal(0, 0.1, w.size).astype(np.float32)
        {update}
        if not worker.step(float(np.mean(g ** 2))):
            break
"""

TORCH_JOB = """
import torch

def main(worker):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    worker.register(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    while True:
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        {update}
        if not worker.step(loss):
            break
"""

CASES = {
    "numpy-rebinds": (NUMPY_JOB, "w = w - np.float32(0.1) * g",
                      "steps: the loop trains other arrays, and lsgd would exchange stale ones"),
    "numpy-in-place": (NUMPY_JOB, "w -= np.float32(0.1) * g", None),
    "torch-replaces": (TORCH_JOB, "model[1].weight = torch.nn.Parameter(model[1].weight - 0.01 * "
                                  "model[1].weight.grad); opt.step()",
                       "the model's tensor '1.weight' was replaced after register()"),
    "torch-in-place": (TORCH_JOB, "opt.step()", None),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_a_loop_that_does_not_train_the_registered_parameters_is_stopped(cluster, tmp_path, case):
    job, update, error = CASES[case]
    if job is TORCH_JOB:
        pytest.importorskip("torch")
    (tmp_path / "loopjob.py").write_text(job.replace("{update}", update))
    node = cluster(0, PORT=0, ITERATIONS=1000, ENTRY="loopjob:main", PYTHONPATH=tmp_path)
    if error is None:  # a correct loop never trips the check
        assert node.wait(100) == 0, node.output
        assert global_summary(cluster.run_dir)["counter"] == 1000
        return
    assert node.wait(100) == 1, node.output
    fix = "update the registered parameters in place (numpy: `W -= lr * g`, not `W = W - lr * g`"
    lines = [line for line in node.output.splitlines() if "failed: " in line]
    assert len(lines) == 2 and all(error in line and fix in line for line in lines), node.output
    assert "no worker left on this node" in node.output
    assert "Traceback" not in node.output and "started again" not in node.output


def test_fingerprint_sees_any_one_change_and_only_a_change():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 8, 1001):
        x = rng.standard_normal(n).astype(np.float32)
        fp = ops.fingerprint(x, chunk=4)
        assert ops.fingerprint(x.copy(), chunk=4) == fp == ops.fingerprint(x)  # any chunking
        for i in range(n):
            y = x.copy()
            y[i] = np.nextafter(y[i], np.float32(np.inf))  # the smallest change there is
            assert ops.fingerprint(y, chunk=4) != fp, (n, i)
    x = np.ones(9, np.float32)
    assert ops.finite_fingerprint(x, chunk=4)[0]
    x[8] = np.nan
    assert not ops.finite_fingerprint(x, chunk=4)[0]


def test_torch_params_report_a_replaced_tensor_but_not_in_place_updates():
    torch = pytest.importorskip("torch")
    from lsgd.worker.torch_params import TorchParams

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    p = TorchParams(model)
    with torch.no_grad():
        model[0].weight -= 1.0
        model[0].bias.data = torch.zeros(2)  # .data keeps the registered tensor
    model[1].running_mean.add_(1.0)
    assert p.replaced() is None
    model[1].running_var = torch.ones(2)
    assert p.replaced() == "the model's tensor '1.running_var' was replaced after register()"
    assert TorchParams([torch.zeros(3)]).replaced() is None  # a bare list: checked by values


# ------------------------------------------------------------------ papercuts


def test_the_stand_in_worker_refuses_the_mistakes_the_real_one_refuses():
    real = Worker(WorkerContext(JobConfig(), 0, None, None, 0, None))
    for w in (SoloWorker(), real):
        with pytest.raises(RuntimeError, match=r"call register\(\) before step\(\)"):
            w.step(0.5)
    solo = SoloWorker()
    solo.register([np.zeros(3, np.float32)])
    with pytest.raises(RuntimeError, match=r"register\(\) may be called once"):
        solo.register([np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="scalar"):
        solo.step(np.ones(2))
    assert solo.step(np.float32(0.5)) and solo.iterations == 1


class Inbox:
    def put(self, msg: object) -> None:
        pass


def test_a_one_element_loss_is_a_scalar_whatever_holds_it():
    worker = Worker(WorkerContext(JobConfig(), 0, Inbox(), None, 0, None))
    worker._params, worker._credits = object(), 10  # registered, holding credits
    assert worker.step(np.array([0.25])) and worker.iterations == 1
    with pytest.raises(ValueError, match="scalar"):
        worker.step(np.ones(2))
    from lsgd.worker.client import loss_value  # what Worker.step and SoloWorker.step keep

    assert loss_value(np.array([0.25])) == 0.25
    assert loss_value(np.array([[3]])) == 3.0
    assert loss_value(np.float32(0.5)) == 0.5 and loss_value(2) == 2.0
    for bad in (np.ones(2), np.array([]), [0.1, 0.2], np.array(["a"])):
        with pytest.raises(ValueError, match="scalar"):
            loss_value(bad)
    torch = pytest.importorskip("torch")
    assert float(loss_value(torch.tensor([0.75], requires_grad=True))) == 0.75
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        loss_value(torch.ones(2))


@pytest.mark.timeout(120)
def test_every_update_the_loops_make_is_counted_also_without_credits(cluster, tmp_path):
    # 3 workers and 1 iteration: two workers get no credit before the job ends, yet their
    # loops make one update each before step() tells them to stop.
    node = cluster(0, PORT=0, WORKERS=3, ITERATIONS=1, ENTRY="toyjob:main", TOYJOB_COUNT_DIR=tmp_path)
    assert node.wait(60) == 0, node.output
    updates = sum(int(p.read_text()) for p in tmp_path.glob("*.count"))  # step() calls
    assert updates == 3
    assert global_summary(cluster.run_dir)["counter"] == updates
