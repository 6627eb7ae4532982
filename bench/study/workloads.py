"""The study's two workloads, generated here (nothing is downloaded): data, model, one step.

- ``cnn``: a small PyTorch CNN (9,802 parameters) on *hard digits*: scikit-learn's bundled
  8x8 digits, upsampled to 16x16, each sample randomly rotated (up to 25 degrees), shifted (up
  to 3 pixels), its contrast scaled and Gaussian noise added. The source images are split
  before augmenting, so no test or validation digit was ever seen in training, in any form.
- ``mlp``: a numpy MLP (64-128-128-10, about 26K parameters) on a teacher task: Gaussian inputs
  labelled by a fixed random tanh network, with 20% of the training labels replaced by random
  ones (validation and test labels are clean).

Each worker builds the same model from the job's seed (the rules start every worker from the
same point anyway) and draws its own batches. ``Task.flat()`` / ``Task.load(flat)`` move the
parameters as one float32 vector, for the snapshots the study evaluates afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

NAMES = ("cnn", "mlp")
SPLITS = ("train", "val", "test")


# ------------------------------------------------------------------------------ data
def hard_digits(seed: int = 0, copies: tuple[int, int, int] = (24, 6, 6)) -> dict[str, tuple]:
    """{split: (x float32 [n,1,16,16], y int64 [n])}: ``copies`` augmented versions of each
    source digit of the train, validation and test splits (1197/300/300 source images)."""
    from scipy import ndimage
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(1234).permutation(len(labels))
    parts = {"train": order[:1197], "val": order[1197:1497], "test": order[1497:]}
    out = {}
    for k, (split, idx) in enumerate(parts.items()):
        rng = np.random.default_rng([seed, k])
        n = len(idx) * copies[k]
        xs = np.empty((n, 1, 16, 16), np.float32)
        ys = np.repeat(labels[idx], copies[k])
        src = np.repeat(idx, copies[k])
        for i, j in enumerate(src):
            img = ndimage.zoom(images[j], 2.0, order=1)
            img = ndimage.rotate(img, rng.uniform(-25, 25), reshape=False, order=1)
            img = ndimage.shift(img, rng.uniform(-3, 3, size=2), order=1)
            img = img * rng.uniform(0.6, 1.4) + rng.normal(0, 0.25, img.shape)
            xs[i, 0] = img
        perm = rng.permutation(n)
        out[split] = (xs[perm], ys[perm])
    return out


def noisy_teacher(seed: int = 0, sizes: tuple[int, int, int] = (20000, 2000, 2000),
                  noise: float = 0.2) -> dict[str, tuple]:
    """{split: (x float32 [n,64], y int64 [n])} of the teacher task; ``noise`` of the training
    labels are random."""
    teacher = np.random.default_rng(4321)
    w1 = teacher.normal(0, 1 / 8, (64, 32)).astype(np.float32)
    w2 = teacher.normal(0, 1 / np.sqrt(32), (32, 10)).astype(np.float32)
    out = {}
    for k, (split, n) in enumerate(zip(SPLITS, sizes)):
        rng = np.random.default_rng([seed, 100 + k])
        x = rng.normal(size=(n, 64)).astype(np.float32)
        y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
        if split == "train":
            flip = rng.random(n) < noise
            y[flip] = rng.integers(0, 10, int(flip.sum()))
        out[split] = (x, y)
    return out


def make_data(name: str, path: Path) -> Path:
    """Generate workload ``name``'s data into ``path`` (an .npz) unless it is there."""
    if not path.exists():
        data = hard_digits() if name == "cnn" else noisy_teacher()
        arrays = {f"{s}_{v}": a for s, (x, y) in data.items() for v, a in (("x", x), ("y", y))}
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
    return path


def load_data(path: Path | str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    with np.load(path) as f:
        return {s: (f[f"{s}_x"], f[f"{s}_y"]) for s in SPLITS}


# ------------------------------------------------------------------------------ models
@dataclass
class Task:
    """One worker's model: its parameter arrays (registered with lsgd), a training step on a
    batch, and evaluation of a flat parameter vector."""

    params: list  # what worker.register() gets
    step: Callable[[np.ndarray, np.ndarray], tuple[float, float]]  # (loss, gradient norm)
    flat: Callable[[], np.ndarray]
    load: Callable[[np.ndarray], None]
    accuracy: Callable[[np.ndarray, np.ndarray], float]


def cnn_task(seed: int, lr: float, momentum: float) -> Task:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
    loss_fn = nn.CrossEntropyLoss()
    params = list(model.parameters())

    def step(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        with torch.no_grad():
            norm = float(torch.sqrt(sum((p.grad * p.grad).sum() for p in params)))
        opt.step()
        return float(loss.detach()), norm

    def flat() -> np.ndarray:
        with torch.no_grad():
            return torch.cat([p.reshape(-1) for p in params]).numpy().astype(np.float32)

    def load(vec: np.ndarray) -> None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.from_numpy(np.ascontiguousarray(vec)), params)

    def accuracy(x: np.ndarray, y: np.ndarray) -> float:
        with torch.no_grad():
            pred = torch.cat([model(torch.from_numpy(x[i:i + 1000])).argmax(1)
                              for i in range(0, len(x), 1000)])
        return float((pred.numpy() == y).mean())

    return Task(params, step, flat, load, accuracy)


def mlp_task(seed: int, lr: float, momentum: float) -> Task:
    from ..workload import NumpyMLP  # the benchmarks' MLP, smaller, with its gradient norm

    model = NumpyMLP(seed, lr, momentum, sizes=(64, 128, 128, 10), grad_norm=True)
    params = model.params

    def step(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        loss = model.step(x, y)
        return loss, model.grad_norm

    def flat() -> np.ndarray:
        return np.concatenate([p.ravel() for p in params])

    def load(vec: np.ndarray) -> None:
        i = 0
        for p in params:
            p[...] = vec[i:i + p.size].reshape(p.shape)
            i += p.size

    return Task(params, step, flat, load, model.accuracy)


def task(name: str, seed: int, lr: float, momentum: float) -> Task:
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r}; the study has {', '.join(NAMES)}")
    return (cnn_task if name == "cnn" else mlp_task)(seed, lr, momentum)
