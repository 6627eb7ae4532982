"""Target 7, rule exchange (issue 11): one global round's parameter work of model averaging and
DiLoCo against LSGD's, 25M float32 (100 MB) per vector, 2 nodes x 2 workers, all in one run.

**The exchange** is everything a global round does with parameter vectors once the workers have
published them (in their node's shared memory) until every participant holds its new ones, as
``round_runner.py`` and the workers do it, on the nodes and on the global server:

* the round's report (``ReportRound``; the server begins the exchange: CENTER rules zero its
  sum there);
* each node's work on shared memory: LSGD copies its local leader (and the winner's node the
  global leader) into node buffers; average and DiLoCo sum their two participants' slots
  (``ops.weighted_sum_into_`` with the rule's weights);
* the uploads over the real gRPC path (``GlobalClient.push``): LSGD the global leader (the
  winner's node), average and DiLoCo each node's sum; the server adds the sums and, once both
  are in, runs the rule's ``update_`` (the mean; the outer Nesterov step with momentum);
* the downloads (``GlobalClient.pull`` into the sum buffer, then a copy into the node buffer):
  LSGD the leader to the other node, average and DiLoCo the new center to both nodes;
* the participants' pulls, exactly those the rule's ``pulls`` names: LSGD's c1 pulls toward
  the local leader and c2 pulls toward the global leader (5 pulls of strength 0.1; a leader is
  not pulled toward itself), average's and DiLoCo's pulls of strength 1 toward the new center
  (4: a copy, plus the distance that goes to the metrics).

What every rule does alike in a round (workers publish their parameters, fingerprint them,
write them back into the model; credit calls) is left out. The two nodes run one after the
other in this process; on a machine with a core per node, average's and DiLoCo's two uploads
(and two downloads) would overlap, LSGD's upload and download cannot, so this view is the
conservative one for them. The servers are real ones (``process_main``), one subprocess per
rule, all three up at once; the rules' rounds alternate (in a rotating order), so that all see
the same machine conditions on this shared VM. The servers' periodic saves (``STATE_EVERY``)
are off, being no part of an exchange. Medians over all rounds; each round's exchanged vector
is checked against the closed form on a 1M-element sample.

Memory: the nodes' vectors are one ``NodeStore`` shared by the three rules' jobs (2 slots and
4 buffers: 600 MB; node 1's work is done on the same vectors as node 0's, the same bytes
moved), plus what each server touches (LSGD: its leader; average: sum and center; DiLoCo: sum,
center and momentum): about 1.4 GB resident in all at 25M.

Besides the whole round (the target), ``transfer``: the report, the uploads, the server's
update and the downloads only (no node math, no pulls); and ``narrow``: LSGD's leader upload and
download against average's/DiLoCo's round with their pulls (the narrowest LSGD view).

**Pull of strength 1**: ``ops.pull_toward_(x, c, 1.0)`` copies the target (and returns the
distance): timed, alternated, against the arithmetic pull (strength 1 - 2**-24, what strength 1
did before it copied), the plain copy-based pull (the distance pass, then ``ops.copy_``) and a
bare ``ops.copy_`` (no distance: a floor).

Standalone: ``PYTHONPATH=. python -m bench.exchange [--quick]``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from .common import Result

TARGET = "7. rule exchange"
N = 25_000_000
RULES = ("lsgd", "average", "diloco")
GOAL = 0.5  # average and DiLoCo: at least half LSGD's exchange rate
SAMPLE = 1 << 20  # elements checked against the closed form every round
GB, MB = 1e9, 1e6
PHASES = ("report", "node", "upload", "download", "pulls")
# The server's periodic saves of its vectors (STATE_EVERY, 1 s by default: a 100 MB write each
# second while they change) are not part of the exchange: off during the rounds.
STATE_EVERY = 3600.0


class Phases:
    """Seconds per phase of one round."""

    def __init__(self) -> None:
        self.s = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.s[name] += time.perf_counter() - t0


@contextmanager
def _server(algorithm: str, n: int, in_process: bool) -> Iterator[tuple[str, int | None]]:
    """A global server for a job of 2 nodes x 2 workers: ``(address, pid or None)``."""
    run_dir = tempfile.mkdtemp(prefix="lsgd-bench-exchange-")
    srv = proc = None
    try:
        if in_process:  # the smoke test: no process start
            from lsgd.config import JobConfig
            from lsgd.global_server.server import build_servicer, create_server

            config = JobConfig(num_groups=2, workers=2, l_comm=1, g_comm=1, algorithm=algorithm,
                               iterations=None, minutes=30, port=0, run_dir=run_dir,
                               job_id="bench", round_timeout=30.0, node_timeout=30.0,
                               state_every=STATE_EVERY)
            srv, port = create_server("127.0.0.1:0", build_servicer(config))
            yield f"127.0.0.1:{port}", None
        else:
            from .params import start_server

            proc, port = start_server(run_dir, algorithm=algorithm, workers=2,
                                      state_every=STATE_EVERY)
            yield f"127.0.0.1:{port}", proc.pid
    finally:
        if srv is not None:
            srv.stop(grace=0.5).wait(5)
        if proc is not None:
            from .params import stop_server

            stop_server(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


def node_store(n: int) -> Any:
    """The nodes' shared memory: two slots (random weights ~ N(0, 0.05)) and every node buffer
    the rules use, each starting at the initial model (slot 0), as a node's does. Every page is
    touched before any timing."""
    from lsgd.local_server.store import NodeStore, StoreLayout
    from lsgd.rules import ops
    from lsgd.rules.base import CENTER, GLOBAL_LEADER, LOCAL_LEADER, SUM

    layout = StoreLayout.new("bench", 0, n, slots=2,
                             buffers=(LOCAL_LEADER, GLOBAL_LEADER, CENTER, SUM))
    store = NodeStore.create(layout)
    try:
        rng = np.random.default_rng(0)
        step = 1 << 22
        for i in range(2):
            x = store.slot(i)
            for lo in range(0, n, step):
                rng.standard_normal(dtype=np.float32, out=x[lo : lo + step])
                x[lo : lo + step] *= np.float32(0.05)
        for name in layout.buffers:
            ops.copy_(store.buffer(name), store.slot(0))
    except BaseException:
        store.close(unlink=True)
        raise
    return store


class Job:
    """Two nodes of two workers in this process, speaking to one global server of a rule.

    Both nodes work on one store (``node_store``; the jobs of all rules share it, each using
    the buffers its rule names). Worker ids: node 0 has 0 and 1, node 1 has 2 and 3; slot
    ``w % 2``. Node 0 reports worker 0 as its best and leads every global round; each node's
    local leader is its slot 0.
    """

    def __init__(self, algorithm: str, store: Any, address: str) -> None:
        from lsgd.config import JobConfig
        from lsgd.local_server.global_client import GlobalClient
        from lsgd.rules import ops
        from lsgd.rules.base import CENTER

        from .params import Node

        self.rule = JobConfig(algorithm=algorithm).make_rule()
        self.store, self.n = store, store.layout.param_count
        self.clients: list[Any] = []
        try:
            for i in range(2):
                self.clients.append(GlobalClient(address, "bench", i, round_timeout=30.0))
                self.clients[i].join(workers=2, param_count=self.n, algorithm=algorithm,
                                     num_groups=2, connect_timeout=30)
            self.node = Node(self.clients, participants=2)
            self.center = self.rule.exchange.value == "center"
            k = min(SAMPLE, self.n)
            self.theta = self.state = None
            if self.center:  # node 0 seeds the center with its initial model, as at a start
                ops.copy_(store.buffer(CENTER), store.slot(0))
                self.clients[0].push(CENTER, store.buffer(CENTER), round_id=0)
                self.theta = store.slot(0)[:k].copy()
                self.state = {s: np.zeros(k, np.float32) for s in self.rule.server_state}
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def round(self) -> dict[str, float]:
        """One global round's exchange; returns seconds per phase. Checks it on a sample."""
        from lsgd.rules import ops
        from lsgd.rules.base import (CENTER, GLOBAL_LEADER, LOCAL_LEADER, SUM, Contribution,
                                     Exchange, RoundKind, RoundRoles)

        st, rule, t = self.store, self.rule, Phases()
        slots = [st.slot(0), st.slot(1)]
        k = min(SAMPLE, self.n)
        rid = self.node.next_round(report=False)
        if self.node.kind != RoundKind.GLOBAL:
            raise RuntimeError(f"round {rid} is not a global round ({self.node.kind})")
        local = LOCAL_LEADER in rule.node_buffers
        leader = rule.exchange == Exchange.LEADER
        weight = 0.0
        with t("node"):
            for _node in range(2):  # each node, before its report (round_runner._run_round)
                if local:
                    ops.copy_(st.buffer(LOCAL_LEADER), slots[0])
                if self.center:
                    ws = [float(rule.weight(Contribution(w, 1.0, {}))) for w in range(2)]
                    ops.weighted_sum_into_(st.buffer(SUM), slots, ws)
                    weight = sum(ws)
        if self.center:
            total = st.buffer(SUM)[:k] * np.float32(2)  # the server adds the two nodes' sums
            want = self.theta.copy()
            rule.update_(want, total, 2 * weight, 4, self.state)
        else:
            want = slots[0][:k].copy()
        with t("report"):
            self.node.report(rid)
        if leader:
            with t("node"):  # the winner's node (node 0)
                ops.copy_(st.buffer(GLOBAL_LEADER), slots[0])
            with t("upload"):
                self.clients[0].push(GLOBAL_LEADER, st.buffer(GLOBAL_LEADER), rid)
            with t("download"):  # node 1 (round_runner._pull: staged in the sum buffer)
                self.clients[1].pull(GLOBAL_LEADER, st.buffer(SUM), rid)
                ops.copy_(st.buffer(GLOBAL_LEADER), st.buffer(SUM))
            got = st.buffer(GLOBAL_LEADER)[:k]
        else:
            with t("upload"):  # the second upload settles the round: the rule's update_
                for i in range(2):
                    self.clients[i].push(SUM, st.buffer(SUM), rid, summands=2, weight=weight)
            with t("download"):
                for i in range(2):
                    self.clients[i].pull(CENTER, st.buffer(SUM), rid)
                    ops.copy_(st.buffer(CENTER), st.buffer(SUM))
            got = st.buffer(CENTER)[:k]
            self.theta = want
        if not np.array_equal(got, want):
            raise AssertionError(f"{rule.name}: round {rid} exchanged the wrong vector "
                                 f"(max error {float(np.max(np.abs(got - want)))})")
        with t("pulls"):
            for node in range(2):
                for w in (2 * node, 2 * node + 1):
                    roles = RoundRoles(w, 2 * node, 0 if leader else None, True)
                    for name, strength in rule.pulls(RoundKind.GLOBAL, roles):
                        ops.pull_toward_(slots[w % 2], st.buffer(name), strength)
        if self.center and not (np.array_equal(slots[0][:k], want)
                                and np.array_equal(slots[1][:k], want)):
            raise AssertionError(f"{rule.name}: round {rid}: a participant is not the center")
        for x in slots:  # the workers train on (outside the timing)
            x[:k] += np.float32(1e-3)
        return t.s


def exchange_rounds(quick: bool, n: int = N, in_process: bool = False,
                    rounds: int | None = None) -> dict[str, Any]:
    """``rounds`` timed rounds of each rule (after one warm-up round each), the rules
    alternating round by round in a rotating order; phases per round."""
    from contextlib import ExitStack

    from .params import rss_anon

    rounds = rounds or (4 if quick else 15)
    out: dict[str, Any] = {r: {"phases": [], "server_rss_mb": None} for r in RULES}
    with ExitStack() as stack:
        store = node_store(n)
        stack.callback(store.close, unlink=True)
        jobs, pids = {}, {}
        for r in RULES:
            address, pids[r] = stack.enter_context(_server(r, n, in_process))
            jobs[r] = Job(r, store, address)
            stack.callback(jobs[r].close)
        for r in RULES:
            jobs[r].round()  # warm-up: the server's buffers, the channels, the allocators
        for i in range(rounds):
            for j in range(len(RULES)):
                r = RULES[(i + j) % len(RULES)]
                out[r]["phases"].append(jobs[r].round())
        for r in RULES:
            out[r]["server_rss_mb"] = rss_anon(pids[r]) / MB if pids[r] else None
    return out


# ---------------------------------------------------------------------------- pulls of strength 1
def pull_one(quick: bool, n: int = N) -> dict[str, list[float]]:
    """Seconds of a pull of strength 1 and of the ways to do without it, alternated."""
    from lsgd.local_server.store import NodeStore, StoreLayout
    from lsgd.rules import ops

    from .pulls import _interleaved

    below_one = float(np.nextafter(np.float32(1), np.float32(0)))  # the arithmetic branch
    layout = StoreLayout.new("bench", 0, n, slots=1, buffers=("center",))
    store = NodeStore.create(layout)
    try:
        x, c = store.slot(0), store.buffer("center")
        rng = np.random.default_rng(1)
        for lo in range(0, n, 1 << 22):  # touches every page
            rng.standard_normal(dtype=np.float32, out=x[lo : lo + (1 << 22)])
            rng.standard_normal(dtype=np.float32, out=c[lo : lo + (1 << 22)])
        k = min(SAMPLE, n)
        want = c[:k].copy()
        ops.pull_toward_(x, c, 1.0)
        if not np.array_equal(x[:k], want):
            raise AssertionError("a pull of strength 1 is not exactly the target")

        def copy_based() -> None:
            ops.pull_toward_(x, c, 0.0)  # the distance (reported to the metrics) ...
            ops.copy_(x, c)  # ... then the copy

        return _interleaved({"pull_1": lambda: ops.pull_toward_(x, c, 1.0),
                             "copy_based": copy_based,
                             "arithmetic": lambda: ops.pull_toward_(x, c, below_one),
                             "copy": lambda: ops.copy_(x, c)}, 7 if quick else 21)
    finally:
        store.close(unlink=True)


# ---------------------------------------------------------------------------- results
VIEWS = {"round": PHASES,  # the target: the whole round's parameter work
         "transfer": ("report", "upload", "download")}  # the wire and the server only


def _totals(phases: list[dict[str, float]], keys: tuple[str, ...]) -> list[float]:
    return [sum(p[k] for k in keys) for p in phases]


def summarize(m: dict[str, Any], n: int = N) -> dict[str, dict[str, Any]]:
    """Per rule: median seconds of each view and of each phase, GB/s on the wire."""
    out = {}
    for r in RULES:
        ph = m[r]["phases"]
        x: dict[str, Any] = {f"{v}_s": statistics.median(_totals(ph, keys))
                             for v, keys in VIEWS.items()}
        wire = (2 if r == "lsgd" else 4) * 4 * n  # LSGD: 1 up, 1 down; the others: 2 and 2
        x |= {"gbps_wire": round(wire / x["round_s"] / GB, 3), "wire_bytes": wire,
              "phases_ms": {k: round(1e3 * statistics.median(p[k] for p in ph), 2)
                            for k in PHASES},
              "seconds": [round(v, 4) for v in _totals(ph, PHASES)], "rounds": len(ph),
              "server_rss_mb": m[r]["server_rss_mb"] and round(m[r]["server_rss_mb"], 1)}
        out[r] = x
    return out


def run(quick: bool, n: int = N, in_process: bool = False,
        rounds: int | None = None) -> list[Result]:
    load = [round(v, 2) for v in os.getloadavg()]  # other work on the machine, for the record
    m = exchange_rounds(quick, n, in_process, rounds)
    s = summarize(m, n)
    lsgd = s["lsgd"]
    size = f"{n / 1e6:g}M float32" if n >= 1e6 else f"{n} float32"
    what = {"lsgd": "leader copies, 1 upload, 1 download, 5 pulls of strength 0.1",
            "average": "sums, 2 uploads, mean, 2 downloads, 4 pulls of strength 1",
            "diloco": "sums, 2 uploads, outer Nesterov step, 2 downloads, 4 pulls of strength 1"}
    results = [Result(
        TARGET, f"LSGD: one global round's exchange, 2 nodes x 2 workers, {size} ({what['lsgd']})",
        round(lsgd["round_s"], 4), "s",
        extra=lsgd | {"load_1_5_15_before": load,
                      "load_1_5_15_after": [round(v, 2) for v in os.getloadavg()]})]
    for r in ("average", "diloco"):
        x = s[r]
        ratio = lsgd["round_s"] / x["round_s"]
        results.append(Result(
            TARGET, f"{r}: one global round's exchange, 2 nodes x 2 workers, {size} ({what[r]})",
            round(x["round_s"], 4), "s", baseline=round(lsgd["round_s"], 4),
            baseline_name="LSGD's exchange, same run", ratio=round(ratio, 3),
            ratio_note="exchange rate vs LSGD's: LSGD's seconds / these",
            goal=f">= {GOAL}x of LSGD's", met=ratio >= GOAL,
            extra=x | {"ratio_transfer": round(lsgd["transfer_s"] / x["transfer_s"], 3),
                       "ratio_narrow": round(lsgd["transfer_s"] / x["round_s"], 3)}))
    p = pull_one(quick, n)
    med = {k: statistics.median(v) for k, v in p.items()}
    results.append(Result(
        TARGET, f"pull of strength 1 (distance and copy in one pass) on {size} in shm",
        round(1e3 * med["pull_1"], 2), "ms", baseline=round(1e3 * med["copy_based"], 2),
        baseline_name="copy-based pull: the distance pass, then ops.copy_",
        ratio=round(med["copy_based"] / med["pull_1"], 3),
        ratio_note="baseline time / this time", goal="not slower than the copy-based pull",
        met=med["pull_1"] <= med["copy_based"],
        extra={"arithmetic_ms": round(1e3 * med["arithmetic"], 2),
               "copy_only_ms": round(1e3 * med["copy"], 2),
               "vs_arithmetic": round(med["arithmetic"] / med["pull_1"], 3),
               "vs_copy_only": round(med["copy"] / med["pull_1"], 3),
               "ms": {k: [round(1e3 * v, 2) for v in p[k]] for k in p}}))
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    for res in run("--quick" in sys.argv):
        print(json.dumps(res.to_dict()))
    print(f"# {time.perf_counter() - t0:.1f} s, load {os.getloadavg()}", file=sys.stderr)
