"""Data loaders on small files written here in the real formats; missing and corrupt files."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest

from lsgd.data import DataError, load_cifar10, load_mnist, read_idx, shard_indices


def write_idx(path, array, compress=False):
    codes = {np.uint8: 0x08}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + struct.pack(
        f">{array.ndim}I", *array.shape)
    raw = header + array.tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


@pytest.fixture
def mnist_dir(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("t10k", 4)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                  compress=(split == "t10k"))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))
    return tmp_path


def test_mnist_reads_plain_and_gzip_idx(mnist_dir):
    ds = load_mnist(mnist_dir)
    assert ds.x_train.shape == (6, 784) and ds.x_test.shape == (4, 784)
    assert ds.x_train.dtype == np.float32 and 0 <= ds.x_train.min() and ds.x_train.max() <= 1
    raw = read_idx(mnist_dir / "train-images-idx3-ubyte")
    np.testing.assert_allclose(ds.x_train[2], raw[2].reshape(-1) / 255.0)
    assert ds.y_train.dtype == np.int64


def test_mnist_missing_file_is_one_clear_error(mnist_dir):
    (mnist_dir / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="train-labels-idx1-ubyte: file not found"):
        load_mnist(mnist_dir)
    with pytest.raises(DataError, match="not a directory"):
        load_mnist(mnist_dir / "nope")


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"\x01\x02" + b[2:], "bad magic number"),
    (lambda b: b[:-7], "data bytes, the header"),
    (lambda b: b[:6], "truncated IDX header"),
    (lambda b: b"\x1f\x8b" + b[2:], "broken gzip"),
])
def test_mnist_corrupt_files(mnist_dir, damage, message):
    path = mnist_dir / "train-images-idx3-ubyte"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=message):
        load_mnist(mnist_dir)


def test_mnist_images_and_labels_must_match(mnist_dir):
    write_idx(mnist_dir / "train-labels-idx1-ubyte", np.zeros(5, np.uint8))
    with pytest.raises(DataError, match="do not match"):
        load_mnist(mnist_dir)


@pytest.fixture
def cifar_dir(tmp_path):
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        # like the published files: a numpy uint8 array under b"data", pickle protocol 2
        batch = {b"data": rng.integers(0, 256, (3, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, 3)],
                 b"batch_label": b"synthetic"}
        (tmp_path / name).write_bytes(pickle.dumps(batch, protocol=2))
    return tmp_path


def test_cifar10_reads_python_batches(cifar_dir):
    ds = load_cifar10(cifar_dir)
    assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    assert ds.y_train.shape == (15,) and ds.x_train.dtype == np.float32


def test_cifar10_refuses_code_in_a_pickle(cifar_dir):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (cifar_dir / "data_batch_3").write_bytes(pickle.dumps({b"data": Evil(), b"labels": []}))
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        load_cifar10(cifar_dir)


@pytest.mark.parametrize("content, message", [
    (b"garbage", "not a CIFAR-10 python batch"),
    (pickle.dumps([1, 2]), "no dictionary"),
    (pickle.dumps({b"data": b"\0" * 100, b"labels": [1]}), "expected 3072 per image"),
    (pickle.dumps({b"data": b"\0" * 3072, b"labels": [12]}), "labels outside 0..9"),
])
def test_cifar10_malformed_batches(cifar_dir, content, message):
    (cifar_dir / "test_batch").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_cifar10(cifar_dir)
    (cifar_dir / "test_batch").unlink()
    with pytest.raises(DataError, match="test_batch: file not found"):
        load_cifar10(cifar_dir)


def test_shards_disjoint_cover_everything_and_permutations_differ():
    shards = [shard_indices(10, w, 3, "disjoint", seed=5) for w in range(3)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(10))
    assert [len(s) for s in shards] == [4, 3, 3]
    a, b = (shard_indices(10, w, 2, "permutation", seed=5) for w in range(2))
    assert sorted(a.tolist()) == sorted(b.tolist()) == list(range(10)) and not np.array_equal(a, b)
    with pytest.raises(ValueError, match="unknown"):
        shard_indices(10, 0, 2, "random")
    with pytest.raises(ValueError, match="out of range"):
        shard_indices(10, 2, 2)


def test_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    # A fresh interpreter: loading the digits must not import scikit-learn (2 s per process).
    code = ("import sys; from lsgd.data import load_digits; d = load_digits(); "
            "print(len(d.x_train), len(d.x_test), 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["1438", "359", "False"]
    from sklearn.datasets import load_digits as sklearn_digits

    from lsgd.data import digits_arrays, load_digits
    x, y = digits_arrays()
    ref = sklearn_digits()
    np.testing.assert_array_equal(x, ref.data)
    np.testing.assert_array_equal(y, ref.target)
    d = load_digits(test_fraction=0.25, seed=3)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0 and d.x_train.shape[1] == 64
    # every class split 75/25, and the two parts are the whole set, once each
    np.testing.assert_array_equal(np.bincount(d.y_test), np.round(0.25 * np.bincount(y)))
    whole = np.concatenate([d.x_train, d.x_test]) * 16.0
    assert sorted(map(bytes, whole.astype(np.uint8))) == sorted(map(bytes, x.astype(np.uint8)))
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.0)
