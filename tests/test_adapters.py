"""Parameter adapters: what is exchanged, what stays with the worker, exact round trips."""

from __future__ import annotations

import numpy as np
import pytest

from lsgd.worker.adapters import NumpyParams, PyTensorParams, as_params
from lsgd.worker.client import SoloWorker, connect


def _round_trip(adapter, fill: float = 0.25) -> np.ndarray:
    flat = np.empty(adapter.param_count, np.float32)
    adapter.read_into(flat)
    before = flat.copy()
    flat[:] = fill
    adapter.write_from(flat)
    return before


def test_numpy_float64_travels_as_float32_and_ints_are_refused():
    a, b = np.arange(6, dtype=np.float64).reshape(2, 3), np.ones(2, np.float32)
    p = as_params([a, b])
    assert isinstance(p, NumpyParams) and p.param_count == 8 and p.stats_count == 0
    assert _round_trip(p).tolist() == [0, 1, 2, 3, 4, 5, 1, 1]
    assert a.dtype == np.float64 and np.all(a == 0.25) and np.all(b == 0.25)
    with pytest.raises(TypeError, match="parameter 0 must be a floating-point"):
        as_params([np.zeros(3, np.int32)])


def test_pytensor_float64_is_pulled_and_integer_buffers_are_not():
    pytensor = pytest.importorskip("pytensor")
    w = pytensor.shared(np.full((2, 2), 1.5, np.float32), name="w")
    d = pytensor.shared(np.array([1 / 3, 2.0]), name="d")  # float64
    steps = pytensor.shared(np.int64(7), name="steps")
    mask = pytensor.shared(np.array([1, 0], np.int32), name="mask")
    kept = pytensor.shared(np.zeros(3, np.float32), name="kept")
    assert isinstance(as_params([w, d, steps]), PyTensorParams)
    p = PyTensorParams([w, d, steps, mask, kept], keep=["kept"])
    assert p.param_count == 6  # w (4) + d (2); the integers and `kept` stay per worker
    before = _round_trip(p, fill=0.5)
    assert before[:4].tolist() == [1.5] * 4 and before[4] == np.float32(1 / 3)
    assert np.all(w.get_value() == 0.5) and d.get_value().dtype == np.float64
    assert np.all(d.get_value() == 0.5)
    assert steps.get_value() == 7 and mask.get_value().tolist() == [1, 0]
    assert np.all(kept.get_value() == 0)
    with pytest.raises(ValueError, match="no floating-point shared variable"):
        PyTensorParams([steps])


def test_bad_registrations_fail_clearly():
    with pytest.raises(ValueError, match="no parameters"):
        as_params([])
    with pytest.raises(TypeError, match="register\\(\\) takes"):
        as_params(["x"])
    with pytest.raises(ValueError, match="buffers must be 'local' or 'average'"):
        as_params([np.zeros(2, np.float32)], buffers="mean")
    with pytest.raises(ValueError, match="PyTorch nn.Module only"):
        as_params([np.zeros(2, np.float32)], buffers="average")


def test_connect_outside_lsgd_trains_alone():
    x = np.zeros(3, np.float32)
    w = connect([x])
    assert isinstance(w, SoloWorker) and w is connect()
    assert all(w.step(1.0) for _ in range(10)) and w.iterations == 10
    xs, ys = np.arange(4), np.arange(4) * 2
    assert w.shard(xs, ys) == (xs, ys)
    w.close()


class TestTorch:
    @pytest.fixture(autouse=True)
    def _torch(self):
        self.torch = pytest.importorskip("torch")

    def _model(self):
        nn = self.torch.nn
        self.torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))

    def test_statistics_are_the_tail_and_parameters_round_trip(self):
        model = self._model()
        p = as_params(model)  # buffers="local": carried (for evaluation), never averaged
        assert p.param_count == 3 * 4 + 4 + 4 + 4 + 4 * 2 + 2 + 8 and p.stats_count == 8
        assert not p.average_stats and as_params(model, buffers="average").average_stats
        weight = model[0].weight.detach().numpy().ravel().copy()
        before = _round_trip(p)
        assert np.array_equal(before[:12], weight) and before[-4:].tolist() == [1.0] * 4
        assert all(bool((t == 0.25).all()) for t in model.parameters())
        assert bool((model[1].running_var == 0.25).all())

    def test_average_buffers_are_the_vector_tail_and_counters_stay(self):
        model = self._model()
        model[1].running_mean.fill_(3.0)
        p = as_params(model, buffers="average")
        assert p.stats_count == 8 and p.average_stats  # mean + var; num_batches_tracked is int
        flat = np.empty(p.param_count, np.float32)
        p.read_into(flat)
        assert flat[-8:-4].tolist() == [3.0] * 4 and flat[-4:].tolist() == [1.0] * 4
        flat[-8:] = 2.0
        p.write_from(flat)
        assert bool((model[1].running_var == 2).all())
        assert int(model[1].num_batches_tracked) == 0

    def test_tied_weights_once_and_device_and_dtype_checks(self):
        torch = self.torch
        lin = torch.nn.Linear(2, 2, bias=False)
        p = as_params([lin.weight, lin.weight, torch.zeros(3, dtype=torch.float64)])
        assert p.param_count == 4 + 3
        _round_trip(p)
        assert bool((lin.weight == 0.25).all())
        with pytest.raises(TypeError, match="floating-point torch tensor"):
            as_params([torch.zeros(2, dtype=torch.int64)])
        with pytest.raises(ValueError, match="needs an nn.Module"):
            as_params([lin.weight], buffers="average")

    def test_shard_indexes_tensors(self):
        from lsgd.worker.client import _take

        torch = self.torch
        x, y = torch.arange(6), torch.arange(6) * 10
        xs, ys = _take((x, y), np.array([4, 1]))
        assert xs.tolist() == [4, 1] and ys.tolist() == [40, 10]

    def test_cuda_round_trip_through_pinned_buffer(self):
        torch = self.torch
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        model = self._model().cuda()
        p = as_params(model, buffers="average")
        assert p._host is not None and p._host.is_pinned()
        flat = np.empty(p.param_count, np.float32)
        p.read_into(flat)
        ref = torch.cat([t.detach().reshape(-1).cpu() for t in p.tensors]).numpy()
        assert np.array_equal(flat, ref)
        flat[:] = 0.75
        p.write_from(flat)
        assert all(bool((t == 0.75).all()) for t in p.tensors)


def test_worker_state_saved_and_loaded_including_state_created_later(tmp_path):
    from lsgd.worker import state as worker_state

    v = np.arange(4, dtype=np.float32)
    s = worker_state.make([v], str(tmp_path), 0, 3)
    (tmp_path / "node0").mkdir()
    s.save(round_id=7)
    assert s.path.name == "state-worker3.npz" and stat_mode(s.path) == 0o600
    v[:] = 0
    assert s.load() and v.tolist() == [0, 1, 2, 3]
    lazy: list = []  # like a PyTorch optimizer before its first step
    later = worker_state.make(lambda: lazy, str(tmp_path), 0, 3)
    assert not later.exists
    lazy.append(np.zeros(4, np.float32))
    assert later.exists and later.load() and lazy[0].tolist() == [0, 1, 2, 3]
    wrong = worker_state.make([np.zeros(5, np.float32)], str(tmp_path), 0, 3)
    assert not wrong.load()  # another shape: not restored, logged


def stat_mode(path):
    import stat

    return stat.S_IMODE(path.stat().st_mode)
