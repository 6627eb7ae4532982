"""Real data sets from a directory the user gives (nothing is downloaded), and per-worker shards.

- ``load_digits()``: scikit-learn's digits (1797 images of 8x8), from the file scikit-learn
  bundles, read without importing scikit-learn (about 2 s of start-up per process).

- ``load_mnist(dir)``: the four MNIST IDX files (``train-images-idx3-ubyte`` ... optionally
  ``.gz``), as published by LeCun et al.
- ``load_cifar10(dir)``: the CIFAR-10 "python version" batches (``data_batch_1..5``,
  ``test_batch``). They are pickles; they are read with an unpickler that only builds plain
  containers, bytes and numbers, so a crafted file cannot run code.
- ``shard_indices(...)``: disjoint shards or per-worker permutations of a training set.

A missing or malformed file raises ``DataError`` with one line naming the file and the fix.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """A data file is missing or malformed; the message names it."""


@dataclass(frozen=True)
class Dataset:
    """Train and test arrays: inputs float32 in [0, 1], labels int64."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


# ------------------------------------------------------------------------------ digits (bundled)
def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: pixels (1797, 64) float64 in 0..16 and labels int32, read from
    ``sklearn/datasets/data/digits.csv.gz`` without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    path = (Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
            if spec is not None and spec.origin else None)
    if path is None or not path.is_file():  # a layout this code does not know: the slow way
        try:
            from sklearn.datasets import load_digits as sklearn_digits
        except ImportError:
            raise DataError("the digits data set comes with scikit-learn: "
                            "pip install scikit-learn") from None
        digits = sklearn_digits()
        return np.asarray(digits.data, dtype=np.float64), np.asarray(digits.target, np.int32)
    table = np.loadtxt(path, delimiter=",", dtype=np.float64)
    return np.ascontiguousarray(table[:, :-1]), table[:, -1].astype(np.int32)


def stratified_test_indices(y: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a test set holding ``test_fraction`` of every class (rounded), drawn
    with ``seed``: the same in every process."""
    rng = np.random.default_rng(seed)
    picks = []
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        picks.append(rng.permutation(members)[: int(round(test_fraction * len(members)))])
    return np.sort(np.concatenate(picks))


def digits_split(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's digits as ``digits_arrays`` gives them (pixels 0..16), split per class."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x, y = digits_arrays()
    test = stratified_test_indices(y, test_fraction, seed)
    train = np.setdiff1d(np.arange(len(y)), test)
    return Dataset(x[train], y[train], x[test], y[test])


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's digits, split per class: inputs (n, 64) float32 in [0, 1], labels int64."""
    d = digits_split(test_fraction, seed)
    return Dataset((d.x_train / 16.0).astype(np.float32), d.y_train.astype(np.int64),
                   (d.x_test / 16.0).astype(np.float32), d.y_test.astype(np.int64))


# ------------------------------------------------------------------------------ MNIST (IDX)
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (plain or gzip): magic ``00 00 <type> <ndim>``, big-endian sizes, data."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: broken gzip data ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES or raw[3] == 0:
        raise DataError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != need:
        raise DataError(f"{path}: {len(raw) - header} data bytes, the header {shape} needs {need}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def _find(directory: Path, name: str) -> Path:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.exists():
            return candidate
    raise DataError(f"{directory / name}: file not found (also looked for {name}.gz); "
                    "point the loader at the directory holding the MNIST IDX files")


def load_mnist(directory: str | Path) -> Dataset:
    """Load MNIST (or Fashion-MNIST) from its four IDX files in ``directory``."""
    d = Path(directory)
    if not d.is_dir():
        raise DataError(f"{d}: not a directory")
    parts = []
    for split in ("train", "t10k"):
        images = read_idx(_find(d, f"{split}-images-idx3-ubyte"))
        labels = read_idx(_find(d, f"{split}-labels-idx1-ubyte"))
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DataError(f"{d}: {split} images {images.shape} and labels {labels.shape} do "
                            "not match (expected (n, rows, cols) and (n,))")
        parts += [images.reshape(len(images), -1).astype(np.float32) / 255.0,
                  labels.astype(np.int64)]
    return Dataset(*parts)


# ------------------------------------------------------------------------------ CIFAR-10
class _PlainUnpickler(pickle.Unpickler):
    """Builds only what CIFAR batches hold: containers, bytes, numbers and numpy arrays.

    Any other class or function reference in the file is refused, so it cannot run code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes in protocol-2 pickles written by Python 3
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: data files may hold "
                                         "only containers, bytes, numbers and numpy arrays")
        if name == "_reconstruct":
            from numpy._core.multiarray import _reconstruct

            return _reconstruct
        if module == "_codecs":
            import codecs

            return codecs.encode
        return getattr(np, name)


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found; point the loader at the extracted "
                        "cifar-10-batches-py directory") from None
    try:
        batch = _PlainUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed file
        raise DataError(f"{path}: not a CIFAR-10 python batch ({exc})") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: not a CIFAR-10 python batch (no dictionary)")
    data, labels = batch.get(b"data"), batch.get(b"labels")
    if isinstance(data, (bytes, bytearray)):
        data = np.frombuffer(data, np.uint8)
    if data is None or labels is None:
        raise DataError(f"{path}: missing 'data' or 'labels'")
    data = np.asarray(data, dtype=np.uint8)
    labels = np.asarray(labels, dtype=np.int64)
    if data.size != len(labels) * 3072:
        raise DataError(f"{path}: {data.size} bytes of images for {len(labels)} labels "
                        "(expected 3072 per image)")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: labels outside 0..9")
    return data.reshape(len(labels), 3, 32, 32), labels


def load_cifar10(directory: str | Path) -> Dataset:
    """Load CIFAR-10 from the python batches in ``directory`` (images as (n, 3, 32, 32))."""
    d = Path(directory)
    if not d.is_dir():
        raise DataError(f"{d}: not a directory")
    train = [_read_batch(d / f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = _read_batch(d / "test_batch")
    x = np.concatenate([b[0] for b in train])
    y = np.concatenate([b[1] for b in train])
    return Dataset(x.astype(np.float32) / 255.0, y, x_test.astype(np.float32) / 255.0, y_test)


# ------------------------------------------------------------------------------ sharding
def shard_indices(n: int, worker_id: int, num_workers: int, mode: str = "disjoint",
                  seed: int = 0) -> np.ndarray:
    """Indices of the training samples one worker uses.

    Args:
        n: training set size.
        worker_id: 0 .. num_workers-1.
        num_workers: workers in the job.
        mode: ``"disjoint"`` (a shuffled split into equal-sized disjoint shards, the same
            shuffle on every worker) or ``"permutation"`` (every worker sees all samples, in an
            order of its own).
        seed: the job's seed.
    """
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id {worker_id} out of range 0..{num_workers - 1}")
    if mode == "disjoint":
        if n < num_workers:
            raise ValueError(f"{n} samples cannot give {num_workers} workers a shard each")
        order = np.random.default_rng(seed).permutation(n)
        return np.array_split(order, num_workers)[worker_id]
    if mode == "permutation":
        return np.random.default_rng([seed, worker_id]).permutation(n)
    raise ValueError(f"shard mode '{mode}' is unknown; choose disjoint or permutation")
