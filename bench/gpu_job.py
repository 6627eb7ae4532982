"""The GPU benchmark's training loop: a 25M-parameter PyTorch MLP on synthetic data, on CUDA.

Run under lsgd (``ENTRY=bench.gpu_job:train``) or alone, the baseline
(``python -m bench.gpu_job --seconds S --out FILE``). Both write the same record: step marks,
the time spent inside ``worker.step``, and peak host and device memory of the process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

BATCH = 512  # on the CPU dry run: 32
SIZES = (1024, 4096, 4096, 1024, 10)  # 25.2M parameters
DEVICE_VAR = "LSGD_BENCH_DEVICE"  # cpu: a dry run of the benchmark's code (python -m bench.gpu --cpu)


def device():
    import torch

    return torch.device(os.environ.get(DEVICE_VAR) or "cuda")


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build():
    import torch
    from torch import nn

    layers: list = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def loop(worker, seconds: float) -> dict:
    """Train until ``seconds`` pass (alone) or the job ends (``worker.step`` says False)."""
    import torch
    import torch.nn.functional as F

    dev = device()
    cuda = dev.type == "cuda"
    batch = BATCH if cuda else 32
    torch.manual_seed(0)
    model = build().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(16384, SIZES[0], device=dev, generator=gen)
    teacher = torch.randn(SIZES[0], SIZES[-1], device=dev, generator=gen)
    y = (x @ teacher).argmax(1)
    if worker is not None:
        worker.register(model)
    marks, steps, in_lsgd = [], 0, 0.0
    clock = time.perf_counter
    sync(dev)
    first = time.time()
    while True:
        i = torch.randint(0, len(x), (batch,), device=dev, generator=gen)
        loss = F.cross_entropy(model(x[i]), y[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        if steps % 10 == 0:
            marks.append((time.time(), steps))
        if worker is None:
            if time.time() - first >= seconds:
                break
            continue
        t = clock()
        keep = worker.step(loss)
        in_lsgd += clock() - t
        if not keep:
            break
    sync(dev)
    last = time.time()
    marks.append((last, steps))
    params = getattr(worker, "_params", None)  # lsgd's adapter of the model (a diagnostic)
    return {"steps": steps, "first": first, "last": last, "batch": batch, "marks": marks,
            "in_lsgd_s": in_lsgd, "params": sum(p.numel() for p in model.parameters()),
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "node_memory_page_locked": getattr(params, "pinned", None),
            "pulls_on_gpu": getattr(params, "pulls_on_device", None),
            "max_allocated_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if cuda else None,
            "max_reserved_mib": torch.cuda.max_memory_reserved(dev) / 2**20 if cuda else None,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def train(worker) -> None:
    """``ENTRY=bench.gpu_job:train``: writes ``$RUN_DIR/gpu-<worker id>.json``."""
    record = loop(worker, seconds=0)
    Path(worker.config.run_dir, f"gpu-{worker.worker_id}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the GPU benchmark's loop alone (the baseline)")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(loop(None, args.seconds)))
