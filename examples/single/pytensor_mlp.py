"""A plain single-process PyTensor (Theano-style) training loop: an MLP on handwritten digits.

    python examples/single/pytensor_mlp.py [--steps 3000] [--mnist DIR]

``examples/pytensor_mlp.py`` is this file plus the lines that make it an lsgd worker.
"""

import argparse

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.mode import Mode
from lsgd.data import load_digits, load_mnist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3000)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--mnist", help="directory with the MNIST IDX files (default: scikit-learn's digits)")
args = parser.parse_args()

data = load_mnist(args.mnist) if args.mnist else load_digits()  # both bundled or local: no download
x_train, y_train, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
x_train = x_train.reshape(len(x_train), -1).astype(np.float32)
x_test = x_test.reshape(len(x_test), -1).astype(np.float32)
y_train, y_test = y_train.astype(np.int64), y_test.astype(np.int64)

# The model: shared variables, as in Theano. Every run starts from the same seed.
rng = np.random.default_rng(args.seed)
n_in, n_hidden = x_train.shape[1], 128


def shared(shape, scale, name):
    return pytensor.shared((rng.standard_normal(shape) * scale).astype(np.float32), name=name)


w1, b1 = shared((n_in, n_hidden), n_in ** -0.5, "w1"), shared((n_hidden,), 0.0, "b1")
w2, b2 = shared((n_hidden, 10), n_hidden ** -0.5, "w2"), shared((10,), 0.0, "b2")
params = [w1, b1, w2, b2]
velocities = [pytensor.shared(np.zeros_like(p.get_value())) for p in params]
steps_done = pytensor.shared(np.int64(0), name="steps_done")  # an integer buffer

x_var, y_var = pt.matrix("x", dtype="float32"), pt.lvector("y")
lr, mu = np.float32(args.lr), np.float32(0.9)
probs = pt.special.softmax(pt.tanh(x_var @ w1 + b1) @ w2 + b2, axis=-1)
loss_var = -pt.mean(pt.log(probs[pt.arange(y_var.shape[0]), y_var]))
grads = pytensor.grad(loss_var, params)
flat_grad = pt.concatenate([g.flatten() for g in grads])
grad_norm_var = pt.sqrt(flat_grad @ flat_grad)  # the gradient's norm, monitored below
updates = [(steps_done, steps_done + 1)]
for p, v, g in zip(params, velocities, grads):
    updates += [(v, mu * v - lr * g), (p, p + mu * (mu * v - lr * g) - lr * g)]  # Nesterov
mode = Mode(linker="py", optimizer="fast_compile")  # compiles in ~0.1 s
train_step = pytensor.function([x_var, y_var], [loss_var, grad_norm_var], updates=updates, mode=mode)
predict = pytensor.function([x_var], pt.argmax(probs, axis=-1), mode=mode)


def accuracy():
    return float(np.mean(predict(x_test) == y_test))


order = np.random.default_rng(args.seed + 1)
for step in range(args.steps):
    i = order.integers(0, len(x_train), args.batch_size)
    loss, grad_norm = train_step(x_train[i], y_train[i])
    if step % 1000 == 0:
        print(f"step {step}: loss {loss:.3f}, gradient norm {grad_norm:.3f}")
print(f"test accuracy {accuracy():.4f} after {steps_done.get_value()} steps")
