"""Default LSGD/EASGD training job: an MLP classifier on scikit-learn's digits.

The model is written in the classic Theano style with PyTensor: the parameters
and the momentum buffers are ``pytensor.shared`` variables, and one Nesterov SGD
step is a compiled ``pytensor.function`` whose ``updates`` modify them in place.
A distributed trainer reads and writes :attr:`DigitsMLP.params` (e.g. with
``get_value``/``set_value``) between local steps.

The data is scikit-learn's digits (the file scikit-learn bundles, no download),
read without importing scikit-learn: 1797 grey-scale 8x8 images of the digits
0-9, split 80/20 per class by ``split_seed``.

Compile mode
------------
Every worker is a freshly spawned process that builds its own
:class:`DigitsMLP`, possibly with an empty compile cache, and several workers
share 2 CPU cores, so the compile time dominates the cost of this job. Measured
on a 2-core machine (PyTensor 3.0.7, NumPy 2.4, OMP_NUM_THREADS=1, batch 32,
hidden 64; "cold" means an empty ``base_compiledir``; build = construction plus
the first step, where numba JIT-compiles)::

    mode                                 1 proc cold  1 proc warm  per step
    default (numba linker, fast_run)         ~20 s       ~0.6 s      25 us
    Mode("cvm", "fast_run") (C code)         ~13 s       ~0.5 s      34 us
    "FAST_COMPILE" (VM + C lazylinker)       ~0.5 s      ~0.15 s    270 us
    Mode("py", "fast_run")                   ~0.2 s      ~0.2 s    70 ms (!)
    Mode("py", "fast_compile")  <- chosen    ~0.09 s     ~0.09 s   290 us

    4 processes started at once, cold cache, 3000 steps each (wall time):
    default (numba) ~50 s, C ~32 s, chosen ~5-6 s (of which ~2 s was importing
    pytensor/sklearn and ~2.5 s training, each process getting half a core).
    The data is now read without importing scikit-learn (about 2 s of that).

The chosen pure-Python ``PerformLinker`` compiles no C or LLVM code, so it
never writes or locks anything in the compile directory and has no cold/warm
difference; its ~0.3 ms steps cost about 1 s per few thousand steps, far less
than the 13-40 s the compiling backends need before their first step (their
caches are also guarded by file locks that serialise processes starting
together). ``fast_run`` rewrites must not be paired with the Python linker:
its fused ``Composite`` elementwise ops are evaluated element by element.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import Mode

from ..data import digits_split

__all__ = [
    "N_CLASSES",
    "N_FEATURES",
    "DigitsData",
    "DigitsMLP",
    "load_digits_split",
    "make_default_mode",
    "minibatches",
]

logger = logging.getLogger(__name__)

#: Number of input features (8x8 pixels).
N_FEATURES = 64
#: Number of classes (digits 0-9).
N_CLASSES = 10

# Standardisation divides by max(std, _STD_FLOOR) (in raw pixel units, 0..16).
# Border pixels that are almost always 0 have a tiny std; dividing by it would
# turn their rare non-zero values into features of magnitude ~40 that make
# SGD with lr=0.05 / momentum=0.9 diverge.
_STD_FLOOR = 1.0


def make_default_mode() -> Mode:
    """Build the default PyTensor compile mode of this job.

    Returns:
        ``Mode(linker="py", optimizer="fast_compile")``: the pure-Python
        ``PerformLinker`` with the cheap graph rewrites. See the module
        docstring for why.
    """
    return Mode(linker="py", optimizer="fast_compile")


@dataclass(frozen=True)
class DigitsData:
    """A train/test split of the digits dataset.

    Attributes:
        x_train: Float32 array of shape ``(n_train, 64)``, standardised with the
            training-set mean and standard deviation.
        y_train: Int32 array of shape ``(n_train,)`` with labels in ``0..9``.
        x_test: Float32 array of shape ``(n_test, 64)``, standardised with the
            training-set statistics.
        y_test: Int32 array of shape ``(n_test,)``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_split(test_fraction: float = 0.2, split_seed: int = 0) -> DigitsData:
    """Load the digits dataset and split it into train and held-out test sets.

    The split is stratified by class and depends only on ``test_fraction`` and
    ``split_seed``, so every worker process gets the same split.

    Args:
        test_fraction: Fraction of the 1797 samples held out for testing, in
            ``(0, 1)``.
        split_seed: Seed of the split.

    Returns:
        The split, with features standardised by the training statistics.

    Raises:
        ValueError: If ``test_fraction`` is not strictly between 0 and 1.
    """
    d = digits_split(test_fraction, split_seed)
    x_train, x_test, y_train, y_test = d.x_train, d.x_test, d.y_train, d.y_test
    mean = x_train.mean(axis=0)
    std = np.maximum(x_train.std(axis=0), _STD_FLOOR)
    return DigitsData(
        x_train=np.ascontiguousarray((x_train - mean) / std, dtype=np.float32),
        y_train=np.ascontiguousarray(y_train, dtype=np.int32),
        x_test=np.ascontiguousarray((x_test - mean) / std, dtype=np.float32),
        y_test=np.ascontiguousarray(y_test, dtype=np.int32),
    )


def minibatches(
    x: np.ndarray, y: np.ndarray, batch_size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield minibatches forever, reshuffling the data at every epoch.

    Each epoch draws a fresh permutation from ``rng`` and yields consecutive
    slices of it; the last incomplete slice of an epoch is dropped, so every
    batch has exactly ``batch_size`` rows.

    Args:
        x: Inputs, first axis indexes samples.
        y: Targets, same length as ``x``.
        batch_size: Rows per batch, between 1 and ``len(x)``.
        rng: Source of the per-epoch permutations.

    Yields:
        Pairs ``(xb, yb)`` of copies of ``batch_size`` rows of ``x`` and ``y``.

    Raises:
        ValueError: If the lengths differ or ``batch_size`` is out of range
            (raised on the first ``next``).
    """
    n = len(x)
    if len(y) != n:
        raise ValueError(f"x and y have different lengths: {n} != {len(y)}")
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be in [1, {n}], got {batch_size}")
    while True:
        perm = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = perm[start : start + batch_size]
            yield x[idx], y[idx]


class DigitsMLP:
    """One-hidden-layer ReLU MLP trained with Nesterov-momentum SGD.

    The architecture is ``64 -> hidden (ReLU) -> 10 (softmax)`` with a mean
    cross-entropy loss. Models built with the same ``seed`` start from
    identical parameters, whatever the process.

    The Nesterov step is the Sutskever formulation (as in Lasagne)::

        v <- momentum * v - lr * grad(p)
        p <- p + momentum * v - lr * grad(p)

    Attributes:
        params: The parameters ``[W1, b1, W2, b2]`` as float32 PyTensor shared
            variables (``W1``: ``(64, hidden)``, ``b1``: ``(hidden,)``,
            ``W2``: ``(hidden, 10)``, ``b2``: ``(10,)``).
        velocities: The momentum buffers, float32 shared variables matching
            ``params``.
        hidden: Width of the hidden layer.
        momentum: Momentum coefficient.
        grad_norm: The L2 norm of the gradient of the last :meth:`train_step`
            (a float; NaN before the first step or without ``grad_norm=True``).
    """

    def __init__(
        self,
        hidden: int = 64,
        seed: int = 0,
        lr: float = 0.05,
        momentum: float = 0.9,
        *,
        mode: str | Mode | None = None,
        grad_norm: bool = False,
    ) -> None:
        """Create the parameters and compile the training and predict functions.

        Args:
            hidden: Width of the hidden layer.
            seed: Seed of ``np.random.default_rng`` for the initial weights.
            lr: Learning rate (can be changed later with :meth:`set_lr`).
            momentum: Nesterov momentum coefficient in ``[0, 1)``.
            mode: PyTensor compile mode; ``None`` uses
                :func:`make_default_mode`.
            grad_norm: Also compute the norm of each step's gradient (the
                gradients the step already has; a few more ops per step) into
                :attr:`grad_norm`, for rules that weigh workers by it (GRAWA).

        Raises:
            ValueError: If ``hidden`` < 1, ``lr`` < 0 or ``momentum`` is not in
                ``[0, 1)``.
        """
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.hidden = int(hidden)
        self.momentum = float(momentum)
        self.grad_norm = float("nan")
        self._tracks_norm = bool(grad_norm)
        t0 = time.perf_counter()

        rng = np.random.default_rng(seed)
        # He-normal for the ReLU layer, LeCun-normal for the softmax layer.
        w1 = rng.standard_normal((N_FEATURES, self.hidden)) * np.sqrt(2.0 / N_FEATURES)
        w2 = rng.standard_normal((self.hidden, N_CLASSES)) * np.sqrt(1.0 / self.hidden)
        init = {
            "W1": w1,
            "b1": np.zeros(self.hidden),
            "W2": w2,
            "b2": np.zeros(N_CLASSES),
        }
        self.params: list = [
            pytensor.shared(value.astype(np.float32), name=name) for name, value in init.items()
        ]
        self.velocities: list = [
            pytensor.shared(np.zeros_like(p.get_value()), name=f"v_{p.name}") for p in self.params
        ]
        self._lr = pytensor.shared(np.float32(lr), name="lr")

        w1_s, b1_s, w2_s, b2_s = self.params
        x = pt.matrix("x", dtype="float32")
        y = pt.vector("y", dtype="int32")
        hid = pt.maximum(pt.dot(x, w1_s) + b1_s, np.float32(0.0))
        logits = pt.dot(hid, w2_s) + b2_s
        # Log-softmax spelled out with elementary ops on purpose: in PyTensor 3
        # ``pt.special.log_softmax``'s graph contains ``OpFromGraph`` nodes
        # whose ``perform`` JIT-compiles an inner function with the global
        # default (numba) mode on the first call, which cost 10-16 s per cold
        # process and defeats the Python linker chosen above.
        shift = pt.max(pytensor.gradient.disconnected_grad(logits), axis=1, keepdims=True)
        z = logits - shift
        log_probs = z - pt.log(pt.sum(pt.exp(z), axis=1, keepdims=True))
        loss = -pt.mean(log_probs[pt.arange(y.shape[0]), y])

        grads = pytensor.grad(loss, self.params)
        mu = np.float32(self.momentum)
        updates = []
        for p, v, g in zip(self.params, self.velocities, grads, strict=True):
            step = self._lr * g
            if not mu:  # plain SGD: PyTensor's graph of ``0 * v`` runs ~45x slower per step
                updates.append((p, p - step))
                continue
            v_new = mu * v - step
            updates.append((v, v_new))
            updates.append((p, p + mu * v_new - step))

        mode = make_default_mode() if mode is None else mode
        outputs = loss
        if self._tracks_norm:  # one concatenation and one dot: the fewest Python-linker ops
            flat = pt.concatenate([g.flatten() for g in grads])
            outputs = [loss, pt.sqrt(pt.dot(flat, flat))]
        self._train_fn = pytensor.function(
            [x, y], outputs, updates=updates, mode=mode, name="digits_mlp_train"
        )
        self._predict_fn = pytensor.function(
            [x], pt.argmax(logits, axis=1), mode=mode, name="digits_mlp_predict"
        )
        self._loss_fn = pytensor.function([x, y], loss, mode=mode, name="digits_mlp_loss")
        logger.debug(
            "DigitsMLP(hidden=%d, seed=%d) compiled in %.3f s",
            self.hidden,
            seed,
            time.perf_counter() - t0,
        )

    @property
    def lr(self) -> float:
        """The current learning rate."""
        return float(self._lr.get_value())

    def set_lr(self, lr: float) -> None:
        """Change the learning rate without recompiling.

        Args:
            lr: New learning rate, >= 0.

        Raises:
            ValueError: If ``lr`` is negative.
        """
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        self._lr.set_value(np.float32(lr))

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """Do one Nesterov SGD step on a minibatch.

        Args:
            x: Inputs of shape ``(batch, 64)``; converted to float32.
            y: Integer labels of shape ``(batch,)``; converted to int32.

        Returns:
            The mean cross-entropy of the minibatch before the update (with
            ``grad_norm=True``, the gradient's norm goes to :attr:`grad_norm`).
        """
        if self._tracks_norm:
            loss, norm = self._train_fn(_as_x(x), _as_y(y))
            self.grad_norm = float(norm)
            return float(loss)
        return float(self._train_fn(_as_x(x), _as_y(y)))

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Compute the mean cross-entropy without updating anything.

        Args:
            x: Inputs of shape ``(n, 64)``.
            y: Integer labels of shape ``(n,)``.

        Returns:
            The mean cross-entropy.
        """
        return float(self._loss_fn(_as_x(x), _as_y(y)))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predict class labels.

        Args:
            x: Inputs of shape ``(n, 64)``.

        Returns:
            Array of shape ``(n,)`` with the predicted digits.
        """
        return np.asarray(self._predict_fn(_as_x(x)))

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        """Compute the classification accuracy.

        Args:
            x: Inputs of shape ``(n, 64)``.
            y: Integer labels of shape ``(n,)``.

        Returns:
            Fraction of correctly classified samples, in ``[0, 1]``.

        Raises:
            ValueError: If ``y`` is empty.
        """
        y = np.asarray(y)
        if len(y) == 0:
            raise ValueError("accuracy of an empty set is undefined")
        return float(np.mean(self.predict(x) == y))

    def get_param_values(self) -> list[np.ndarray]:
        """Return copies of the parameter values, in the order of :attr:`params`."""
        return [p.get_value(borrow=False) for p in self.params]

    def set_param_values(self, values: list[np.ndarray]) -> None:
        """Overwrite the parameter values (the momentum buffers are kept).

        Args:
            values: Arrays in the order and shapes of :attr:`params`.

        Raises:
            ValueError: If the number or shapes of ``values`` do not match.
        """
        if len(values) != len(self.params):
            raise ValueError(f"expected {len(self.params)} arrays, got {len(values)}")
        for p, v in zip(self.params, values, strict=True):
            current = p.get_value(borrow=True)
            arr = np.array(v, dtype=np.float32, copy=True)
            if arr.shape != current.shape:
                raise ValueError(f"shape mismatch for {p.name}: {arr.shape} != {current.shape}")
            p.set_value(arr, borrow=True)


def _as_x(x: np.ndarray) -> np.ndarray:
    """Convert inputs to a C-contiguous float32 matrix."""
    return np.ascontiguousarray(x, dtype=np.float32)


def _as_y(y: np.ndarray) -> np.ndarray:
    """Convert labels to a C-contiguous int32 vector."""
    return np.ascontiguousarray(y, dtype=np.int32)


def main(worker) -> None:
    """Worker entry of the default job (``ENTRY=lsgd.jobs.digits_mlp:main``).

    Every worker builds the same initial model (``seed``), sees the same train/test split and
    draws its own minibatch order (a per-worker permutation each epoch). The held-out split
    evaluates the final leader, the worker average and the center (EASGD, GRAWA, ...). A rule
    that weighs workers by their gradient norms (GRAWA) gets them with each step; the others
    do not pay for computing them.

    Args:
        worker: the ``lsgd.worker.Worker`` handed over by the local server.
    """
    cfg = worker.config
    data = load_digits_split(split_seed=cfg.seed)
    norms = worker.wants("grad_norm")
    model = DigitsMLP(seed=cfg.seed, lr=cfg.lr, momentum=cfg.momentum, grad_norm=norms)
    batches = minibatches(data.x_train, data.y_train, cfg.batch_size,
                          np.random.default_rng([cfg.seed, worker.worker_id]))
    worker.register(model.params,
                    evaluate=lambda: {"accuracy": model.accuracy(data.x_test, data.y_test),
                                      "loss": model.loss(data.x_test, data.y_test)},
                    state=model.velocities)  # its momentum, kept in checkpoints
    for xb, yb in batches:
        loss = model.train_step(xb, yb)
        if not (worker.step(loss, grad_norm=model.grad_norm) if norms else worker.step(loss)):
            break
