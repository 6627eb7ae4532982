"""What the in-place check (issue 9, item 7) adds to a worker's round, on 25M float32.

At each round a worker reads its model into its shared-memory slot, checks the slot is finite,
pulls it and writes it back. The check adds a fingerprint of the slot (``ops.fingerprint``: the
slot's 64-bit words summed) in the pass that checks finiteness (``ops.finite_fingerprint``),
and, in the first ``FULL_CHECKS`` rounds of a process, one more fingerprint pass after a pull
wrote the model. Timed here, alternately and in one run, on a real ``NodeStore`` slot and a
numpy model of one 25M-float array:

* **round before**: ``read_into``, ``all_finite``, ``pull_toward_``, ``write_from``;
* **round now, first rounds**: ``read_into``, ``finite_fingerprint``, ``pull_toward_``,
  ``write_from``, ``fingerprint``; **later rounds**: without the last ``fingerprint``;
* the same without the pull and the write (the round's leader), and each kernel alone.

Standalone: ``PYTHONPATH=. OMP_NUM_THREADS=1 python -m bench.round_check [--reps N]``.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from .pulls import N, _interleaved


def main() -> None:
    from lsgd.local_server.store import NodeStore, StoreLayout
    from lsgd.rules import ops
    from lsgd.worker.adapters import NumpyParams

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    reps = parser.parse_args().reps
    layout = StoreLayout.new("bench", 0, N, slots=1, buffers=("global_leader",))
    store = NodeStore.create(layout)
    try:
        slot, leader = store.slot(0), store.buffer("global_leader")
        rng = np.random.default_rng(0)
        model = rng.standard_normal(N, dtype=np.float32)
        leader[:] = rng.standard_normal(N, dtype=np.float32)
        params = NumpyParams([model])

        def before(pull: bool) -> None:
            params.read_into(slot)
            ops.all_finite(slot)
            if pull:
                ops.pull_toward_(slot, leader, 0.1)
                params.write_from(slot)

        def now(pull: bool, first: bool = False) -> None:
            params.read_into(slot)
            ops.finite_fingerprint(slot)
            if pull:
                ops.pull_toward_(slot, leader, 0.1)
                params.write_from(slot)
                if first:
                    ops.fingerprint(slot)

        t = _interleaved({
            "round before": lambda: before(True), "round now, first": lambda: now(True, True),
            "round now, later": lambda: now(True),
            "leader before": lambda: before(False), "leader now": lambda: now(False),
            "all_finite": lambda: ops.all_finite(slot),
            "finite_fingerprint": lambda: ops.finite_fingerprint(slot),
            "fingerprint": lambda: ops.fingerprint(slot),
            "pull_toward_": lambda: ops.pull_toward_(slot, leader, 0.1),
        }, reps)
        ms = {k: 1e3 * statistics.median(v) for k, v in t.items()}
        for k, v in ms.items():
            print(f"{k:20s} {v:7.1f} ms")
        for case, was in (("round now, first", "round before"), ("round now, later", "round before"),
                          ("leader now", "leader before")):
            extra = ms[case] - ms[was]
            print(f"added: {case:17s} {extra:4.1f} ms = {100 * extra / ms[was]:3.0f}% of the round "
                  f"before, {100 * extra / ms['pull_toward_']:3.0f}% of one pull")
    finally:
        store.close(unlink=True)


if __name__ == "__main__":
    main()
