"""The GPU path, measured (issue 16): ``python -m bench.gpu [--seconds 12] [--out FILE]``.

Needs a CUDA device and PyTorch. Every ratio is against a baseline from the same run:

1. samples/s of 1 and 2 lsgd workers (one node, LSGD) against the same loop alone on the GPU
   (``bench/gpu_job.py``: a 25.2M-parameter MLP, batch 512), and against two such loops at once;
2. the overhead of lsgd per training step: the step time under lsgd over the loop alone, at the
   default periods (L_COMM=16, G_COMM=64) and at 4x longer ones;
3. a round's device<->host copies and pull for the 25.2M-parameter model, against one plain
   copy of the same bytes between the GPU and pinned memory;
4. peak host memory (RSS, whole process tree) and device memory (``nvidia-smi``'s per-process
   use, which counts each process's CUDA context, and PyTorch's own peak).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from . import gpu_job
from .common import REPO, children, lsgd_env, machine, run_node
from .throughput import rate


class Peaks:
    """Sample a process tree's RSS and every process's GPU memory every 0.2 s."""

    def __init__(self, root: int) -> None:
        self.root, self.rss_mib, self.gpu_mib, self.gpu_per_process_mib = root, 0.0, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        todo, seen = [self.root], []
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.append(p)
                todo += children(p)
        return seen

    def _run(self) -> None:
        smi = shutil.which("nvidia-smi")
        while not self._stop.wait(0.2):
            pids, rss = self._tree(), 0.0
            for p in pids:
                try:
                    for line in Path(f"/proc/{p}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            rss += int(line.split()[1]) / 1024
                except (OSError, ValueError):
                    pass
            self.rss_mib = max(self.rss_mib, rss)
            if smi:
                try:
                    out = subprocess.run([smi, "--query-compute-apps=pid,used_memory",
                                          "--format=csv,noheader,nounits"], capture_output=True,
                                         text=True, timeout=5).stdout
                except (OSError, subprocess.TimeoutExpired):
                    continue
                mine = [float(u) for p, u in (r.split(",") for r in out.splitlines() if "," in r)
                        if int(p) in pids]
                if mine:
                    self.gpu_mib = max(self.gpu_mib, sum(mine))
                    self.gpu_per_process_mib = max(self.gpu_per_process_mib, max(mine))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        return {"host_rss_mib": round(self.rss_mib), "gpu_mib": round(self.gpu_mib),
                "gpu_per_process_mib": round(self.gpu_per_process_mib)}


def plain(seconds: float, copies: int, tmp: Path) -> dict:
    """``copies`` loops alone at once, no lsgd."""
    outs = [tmp / f"plain{copies}-{i}.json" for i in range(copies)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.gpu_job", "--seconds", str(seconds),
                               "--out", str(o)], cwd=REPO, env=lsgd_env()) for o in outs]
    peaks = [Peaks(p.pid) for p in procs]
    for p in procs:
        if p.wait(seconds + 300) != 0:
            raise RuntimeError(f"the plain loop failed (exit {p.returncode})")
    mem = [pk.stop() for pk in peaks]
    records = [json.loads(o.read_text()) for o in outs]
    return {"records": records, "rate": rate_of(records), "memory": {
        k: sum(m[k] for m in mem) if k != "gpu_per_process_mib" else max(m[k] for m in mem)
        for k in mem[0]}}


def rate_of(records: list[dict]) -> float:
    return rate(records, records[0]["batch"])


def under_lsgd(workers: int, iterations: int, tmp: Path, **knobs: object) -> dict:
    """One node, LSGD, ``iterations`` steps in all (an iteration budget: the workers' start-up,
    importing PyTorch and starting CUDA, does not eat into it as it would into a time budget)."""
    run_dir = tmp / f"lsgd{workers}-{'-'.join(map(str, knobs.values())) or 'default'}"
    env = lsgd_env(ENTRY="bench.gpu_job:train", WORKERS=workers, ITERATIONS=iterations,
                   MINUTES="", PORT=0, RUN_DIR=run_dir, JOB_ID=f"benchgpu{workers}",
                   ALGORITHM="lsgd", LOG_LEVEL="INFO", **knobs)
    node = run_node(0, env)
    peaks = Peaks(node.pid)
    try:
        code = node.wait(600)
    finally:
        mem = peaks.stop()
        if node.poll() is None:  # interrupted or overdue: the node cleans up on SIGTERM
            node.terminate()
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                node.kill()
    log = (run_dir / "node0.log").read_text()
    if code != 0:
        raise RuntimeError(f"lsgd run failed (exit {code}): {log[-3000:]}")
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("gpu-*.json"))]
    summary = json.loads((run_dir / "node0" / "summary.json").read_text())
    gpu_line = next((ln for ln in log.splitlines() if "workers on GPUs" in ln), "")
    return {"records": records, "rate": rate_of(records), "memory": mem, "gpu_line": gpu_line,
            "rounds": summary.get("rounds"), "in_lsgd_pct": 100 * sum(r["in_lsgd_s"] for r in records)
            / sum(r["last"] - r["first"] for r in records)}


def copies(reps: int = 20) -> dict:
    """A round's host side for the 25.2M-parameter model: read, pull, write, through the pinned
    buffer (staged) and straight to the page-locked slot (as a worker does); and one plain copy
    of the same bytes each way between the GPU and pinned memory (the baseline)."""
    import torch

    from lsgd.rules import ops
    from lsgd.worker.adapters import as_params

    device = gpu_job.device()
    model = gpu_job.build().to(device)
    p = as_params(model)
    memory = np.zeros(8 * p.param_count, np.uint8)  # a slot and a leader, like a node segment
    slot = memory[: 4 * p.param_count].view(np.float32)
    leader = memory[4 * p.param_count :].view(np.float32)
    leader[:] = np.random.default_rng(0).standard_normal(p.param_count).astype(np.float32)
    flat = torch.empty(p.param_count, device=device)
    pinned = torch.empty(p.param_count, pin_memory=device.type == "cuda")

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        out = []
        for _ in range(reps):
            gpu_job.sync(device)
            t = time.perf_counter()
            fn()
            gpu_job.sync(device)
            out.append(time.perf_counter() - t)
        return statistics.median(out) * 1000

    res = {"params": p.param_count, "mbytes": p.param_count * 4 / 1e6,
           "staged_read_ms": timed(lambda: p.read_into(slot)),
           "staged_write_ms": timed(lambda: p.write_from(slot)),
           "pull_ms": timed(lambda: ops.pull_toward_(slot, leader, 0.1)),
           "fingerprint_ms": timed(lambda: ops.finite_fingerprint(slot)),
           "plain_d2h_ms": timed(lambda: pinned.copy_(flat, non_blocking=True)),
           "plain_h2d_ms": timed(lambda: flat.copy_(pinned, non_blocking=True))}
    t = time.perf_counter()
    res["pinned_slot"] = p.pin(memory)  # what a worker does at registration
    res["pin_ms"] = (time.perf_counter() - t) * 1000
    res["host_round_ms"] = (res["staged_read_ms"] + res["fingerprint_ms"] + res["pull_ms"]
                            + res["staged_write_ms"])
    if res["pinned_slot"]:
        res["read_ms"] = timed(lambda: p.read_into(slot))
        res["write_ms"] = timed(lambda: p.write_from(slot))
        res["gpu_pull_ms"] = timed(lambda: p.pull_toward(leader, 0.1, p.param_count))
        p.unpin()
        # a round now: read, check, pull on the GPU, read the pulled model into the slot
        res["round_ms"] = 2 * res["read_ms"] + res["fingerprint_ms"] + res["gpu_pull_ms"]
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="training seconds per run")
    parser.add_argument("--out", default=str(REPO / "bench" / "gpu_results.json"))
    parser.add_argument("--cpu", action="store_true",
                        help="a dry run of the benchmark itself on the CPU (no GPU numbers)")
    args = parser.parse_args(argv)
    import torch

    if args.cpu:
        os.environ[gpu_job.DEVICE_VAR] = "cpu"
    elif not torch.cuda.is_available():
        print("bench.gpu: no CUDA device (torch.cuda.is_available() is False); --cpu runs the "
              "benchmark's own code on the CPU", file=sys.stderr)
        return 2
    out: dict = {"machine": machine(), "gpu": "cpu (dry run)" if args.cpu else torch.cuda.get_device_name(),
                 "torch": torch.__version__, "seconds": args.seconds}
    save = lambda: Path(args.out).write_text(json.dumps(out, indent=1))  # noqa: E731
    parts = [("copies", copies),
             ("plain1", lambda t: plain(args.seconds, 1, t)),
             ("plain2", lambda t: plain(args.seconds, 2, t)),
             ("lsgd1", lambda t: under_lsgd(1, steps(1), t)),
             ("lsgd2", lambda t: under_lsgd(2, steps(2), t)),
             ("lsgd1_long", lambda t: under_lsgd(1, steps(1), t, L_COMM=64, G_COMM=256))]

    def steps(workers: int) -> int:
        """Iterations for about ``--seconds`` of training, from the loop alone's speed."""
        r = out.get("plain1", {}).get("records")
        per_s = r[0]["steps"] / (r[0]["last"] - r[0]["first"]) if r else 100.0
        return max(200, int(per_s * args.seconds * workers))

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in parts:
            t0 = time.time()
            try:
                out[name] = fn() if name == "copies" else fn(Path(tmp))
            except Exception as exc:  # noqa: BLE001 - reported, the other parts still run
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
                failed = True
            out[name]["wall_s"] = round(time.time() - t0, 1)
            for r in out[name].get("records", []):
                r.pop("marks", None)
            print(f"{name}: {json.dumps(out[name])}", flush=True)
            save()
    report(out)
    save()
    return 1 if failed else 0


def report(out: dict) -> None:
    base = out.get("plain1", {}).get("rate")
    if not base:
        return
    lines = [f"GPU: {out['gpu']}, torch {out['torch']}"]
    for name, what in (("plain2", "two loops alone at once"), ("lsgd1", "lsgd, 1 worker"),
                       ("lsgd2", "lsgd, 2 workers"), ("lsgd1_long", "lsgd, 1 worker, L_COMM=64 G_COMM=256")):
        r = out.get(name, {}).get("rate")
        if r:
            lines.append(f"{what}: {r:,.0f} samples/s = {r / base:.3f}x the loop alone ({base:,.0f})")
            if name.startswith("lsgd1"):
                lines.append(f"  lsgd's cost per step: {100 * (base / r - 1):.1f}% "
                             f"({1e3 * (1 / r - 1 / base) * out[name]['records'][0]['batch']:.3f} ms)")
    c = out.get("copies", {})
    if "gpu_pull_ms" in c:
        lines.append(f"pull on the GPU {c['gpu_pull_ms']:.2f} ms (on the CPU {c['pull_ms']:.2f}); a "
                     f"round's host side {c['round_ms']:.1f} ms (before this issue "
                     f"{c['host_round_ms']:.1f})")
    if "read_ms" in c:
        lines.append(f"round for {c['params'] / 1e6:.1f}M parameters: read {c['read_ms']:.2f} ms "
                     f"(staged {c['staged_read_ms']:.2f}; plain copy {c['plain_d2h_ms']:.2f}), "
                     f"check {c['fingerprint_ms']:.2f} ms, pull {c['pull_ms']:.2f} ms, write "
                     f"{c['write_ms']:.2f} ms (staged {c['staged_write_ms']:.2f}; plain copy "
                     f"{c['plain_h2d_ms']:.2f}); slot page-locked: {c['pinned_slot']}")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
