"""A plain single-process PyTorch training loop: a small CNN with batch norm on handwritten digits.

    python examples/single/torch_cnn.py [--steps 3000] [--device cuda] [--mnist DIR]

``examples/torch_cnn.py`` is this file plus the lines that make it an lsgd worker.
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from lsgd.data import load_digits, load_mnist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3000)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--mnist", help="directory with the MNIST IDX files (default: scikit-learn's digits)")
args = parser.parse_args()

data = load_mnist(args.mnist) if args.mnist else load_digits()  # both bundled or local: no download
x_train, y_train, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
device = torch.device(args.device)
side = int(np.sqrt(np.prod(np.shape(x_train)[1:])))  # 8 (digits) or 28 (MNIST)
x_train = torch.tensor(np.asarray(x_train, np.float32)).reshape(-1, 1, side, side).to(device)
x_test = torch.tensor(np.asarray(x_test, np.float32)).reshape(-1, 1, side, side).to(device)
y_train = torch.tensor(np.asarray(y_train, np.int64)).to(device)
y_test = torch.tensor(np.asarray(y_test, np.int64)).to(device)

torch.manual_seed(args.seed)  # every run starts from the same weights
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)


@torch.no_grad()
def accuracy():
    model.eval()
    correct = (model(x_test).argmax(1) == y_test).float().mean().item()
    model.train()
    return correct


generator = torch.Generator(device=device).manual_seed(args.seed + 1)
for step in range(args.steps):
    i = torch.randint(0, len(x_train), (args.batch_size,), device=device, generator=generator)
    loss = F.cross_entropy(model(x_train[i]), y_train[i])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
print(f"test accuracy {accuracy():.4f} after {step + 1} steps on {device}")
