"""The medium benchmark workload: a ~2.1M-parameter numpy MLP on a synthetic teacher task.

Inputs are Gaussian; labels come from a fixed random "teacher" network, so the task is
learnable, needs no download and is the same in every process. One SGD step (batch 64,
Nesterov momentum) takes ~10 ms on one core.
"""

from __future__ import annotations

import numpy as np

SIZES = (256, 2048, 768, 10)


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples of the teacher task (the teacher is fixed; ``seed`` picks the inputs)."""
    teacher = np.random.default_rng(12345)
    w1 = teacher.normal(0, 1 / np.sqrt(SIZES[0]), (SIZES[0], 64)).astype(np.float32)
    w2 = teacher.normal(0, 1 / np.sqrt(64), (64, SIZES[-1])).astype(np.float32)
    x = np.random.default_rng(seed).normal(size=(n, SIZES[0])).astype(np.float32)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
    return x, y


class NumpyMLP:
    """ReLU MLP with softmax cross-entropy and Nesterov momentum, all float32 numpy."""

    def __init__(self, seed: int = 0, lr: float = 0.05, momentum: float = 0.9,
                 sizes: tuple[int, ...] = SIZES, grad_norm: bool = False) -> None:
        rng = np.random.default_rng(seed)
        self.params: list[np.ndarray] = []
        self.track_norm = grad_norm  # keep the step's gradient norm in ``grad_norm`` (a pass more)
        self.grad_norm = 0.0
        for a, b in zip(sizes[:-1], sizes[1:]):
            self.params.append(rng.normal(0, np.sqrt(2.0 / a), (a, b)).astype(np.float32))
            self.params.append(np.zeros(b, np.float32))
        self.vel = [np.zeros_like(p) for p in self.params]
        self.lr, self.momentum = np.float32(lr), np.float32(momentum)

    @property
    def param_count(self) -> int:
        return sum(p.size for p in self.params)

    def _forward(self, x: np.ndarray) -> list[np.ndarray]:
        acts = [x]
        for i in range(0, len(self.params), 2):
            z = acts[-1] @ self.params[i] + self.params[i + 1]
            acts.append(np.maximum(z, 0, out=z) if i + 2 < len(self.params) else z)
        return acts

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One Nesterov SGD step; returns the minibatch loss."""
        acts = self._forward(x)
        logits = acts[-1]
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        n = len(y)
        loss = float(-np.mean(np.log(p[np.arange(n), y] + 1e-12)))
        g = p
        g[np.arange(n), y] -= 1
        g /= n
        sq = 0.0
        for i in range(len(self.params) - 2, -1, -2):
            gw, gb = acts[i // 2].T @ g, g.sum(axis=0)
            if i:
                g = g @ self.params[i].T
                g *= acts[i // 2] > 0
            for j, grad in ((i, gw), (i + 1, gb)):
                if self.track_norm:
                    sq += float(np.vdot(grad, grad))
                v = self.vel[j]
                v *= self.momentum
                v -= self.lr * grad
                self.params[j] += self.momentum * v - self.lr * grad
        self.grad_norm = float(np.sqrt(sq))
        return loss

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(np.argmax(self._forward(x)[-1], axis=1) == y))
