"""Target 4, pulls: LSGD/EASGD pulls (``ops.pull_toward_``) on 25M float32 in shared memory.

What is measured, all in one run, on vectors of a real ``NodeStore`` segment (touched before
any timing, so no first-touch page faults are measured):

* **baseline**: ``np.copyto`` of one 100 MB vector into another (useful traffic 2 x 100 MB),
  timed alternately with the pulls so that both see the same machine conditions.
* **pull**: ``ops.pull_toward_(x, target, 0.1)``, in place, chunked: useful traffic
  3 x 100 MB (read x, read target, write x). LSGD (``c1``/``c2`` toward a leader) and EASGD
  (``alpha`` toward the center) pulls are this one kernel. Median over a few repetitions; the
  result and the returned distance are checked against the closed form on a sample.
* **peak extra memory** during one pull (``RssAnon`` sampled every ~1 ms): no full-size
  temporary may appear.

Standalone: ``PYTHONPATH=. python -m bench.pulls [--quick]``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import numpy as np

from .common import Result
from .params import PeakSampler

TARGET = "4. pulls"
N = 25_000_000
NBYTES = N * 4
GB, MB = 1e9, 1e6
GOAL_GBPS = 10.0
STRENGTH = 0.1


def _timed(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _interleaved(fns: dict, reps: int) -> dict[str, list[float]]:
    """Time each function ``reps`` times, alternating, so that all see the same conditions."""
    for fn in fns.values():
        fn()  # warm-up
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


def measure(quick: bool) -> dict:
    from lsgd.local_server.store import NodeStore, StoreLayout
    from lsgd.rules import ops

    reps = 7 if quick else 21
    layout = StoreLayout.new("bench", 0, N, slots=2, buffers=("global_leader",))
    store = NodeStore.create(layout)
    try:
        x, y, target = store.slot(0), store.slot(1), store.buffer("global_leader")
        rng = np.random.default_rng(0)
        step = 1 << 22
        for lo in range(0, N, step):  # realistic values; touches every page of the segment
            hi = min(lo + step, N)
            rng.standard_normal(dtype=np.float32, out=x[lo:hi])
            rng.standard_normal(dtype=np.float32, out=target[lo:hi])
        y.fill(0.0)

        # correctness on a sample, against the closed form and a float64 distance
        k = 1 << 20
        x0, t0 = x[:k].copy(), target[:k].copy()
        d64 = 0.0
        for lo in range(0, N, step):
            d = x[lo : lo + step].astype(np.float64) - target[lo : lo + step]
            d64 += float(np.dot(d, d))
        dist = ops.pull_toward_(x, target, STRENGTH)
        expected = x0 - np.float32(STRENGTH) * (x0 - t0)
        np.testing.assert_allclose(x[:k], expected, rtol=1e-6, atol=1e-6)
        if not math.isclose(dist, math.sqrt(d64), rel_tol=1e-4):
            raise AssertionError(f"distance {dist} != {math.sqrt(d64)}")

        out = {"reps": reps, "chunk": ops.CHUNK}
        times = _interleaved({"copy_s": lambda: np.copyto(y, x),
                              "pull_s": lambda: ops.pull_toward_(x, target, STRENGTH)}, reps)
        out |= times
        with PeakSampler({"process": os.getpid()}) as mem:
            ops.pull_toward_(x, target, STRENGTH)
        out["peak_extra"] = mem.peaks()["process"]
        out["samples"] = mem.samples
        if not quick:  # the sampler does see full-size temporaries: the naive expression
            with PeakSampler({"process": os.getpid()}) as naive:
                x -= np.float32(STRENGTH) * (x - target)
            out["naive_peak_extra"] = naive.peaks()["process"]
            # the chunk size, for the record
            out["by_chunk_ms"] = {
                c: round(1e3 * statistics.median(
                    _timed(lambda c=c: ops.pull_toward_(x, target, STRENGTH, chunk=c), 5)), 2)
                for c in (1 << 14, 1 << 16, 1 << 18, 1 << 20)}
        return out
    finally:
        store.close(unlink=True)


def run(quick: bool) -> list[Result]:
    m = measure(quick)
    copy = 2 * NBYTES / statistics.median(m["copy_s"]) / GB
    pull = 3 * NBYTES / statistics.median(m["pull_s"]) / GB
    peak_mb = m["peak_extra"] / MB
    extra = {"pull_ms": [round(s * 1e3, 2) for s in m["pull_s"]],
             "copy_ms": [round(s * 1e3, 2) for s in m["copy_s"]],
             "reps": m["reps"], "chunk_elements": m["chunk"], "strength": STRENGTH}
    if "by_chunk_ms" in m:
        extra["pull_ms_by_chunk"] = m["by_chunk_ms"]
    return [
        Result(TARGET, "pull_toward_ on 25M float32 in shm, useful traffic 3 x 100 MB",
               round(pull, 2), "GB/s", baseline=round(copy, 2),
               baseline_name="np.copyto of 100 MB in shm, useful traffic 2 x 100 MB",
               ratio=round(pull / copy, 3), ratio_note="value / baseline (GB/s of useful traffic)",
               goal=f">= {GOAL_GBPS:g} GB/s, in place, chunked", met=pull >= GOAL_GBPS,
               extra=extra),
        Result(TARGET, "peak extra memory during one pull", round(peak_mb, 1), "MB",
               baseline=NBYTES / MB, baseline_name="model size",
               ratio=round(peak_mb / (NBYTES / MB), 3), ratio_note="value / model size",
               goal="no full-size temporary (< 10% of model size)",
               met=peak_mb < 0.1 * NBYTES / MB,
               extra={"samples": m["samples"]} | (
                   {"naive_expression_peak_mb": round(m["naive_peak_extra"] / MB, 1)}
                   if "naive_peak_extra" in m else {})),
    ]


if __name__ == "__main__":
    t0 = time.perf_counter()
    for r in run("--quick" in sys.argv):
        print(json.dumps(r.to_dict()))
    print(f"# {time.perf_counter() - t0:.1f} s", file=sys.stderr)
