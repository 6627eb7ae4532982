"""The global server's own Python cost per credit call, without gRPC, as the job grows.

The real servicer (``build_servicer``), called in process: N nodes join, then take credits,
report them used and ask again, in turn, as the paced scenario of ``bench/scale.py`` does,
until ``CALLS`` calls were answered. What is timed is the servicer's and the coordinator's
Python per ``AcquireCredits``; gRPC's own cost per call (HTTP/2, the thread pool, protobuf on
the wire: about 0.2-0.3 ms here, ``../shared/reference/limits.md``) comes on top and does not
depend on this code. This shows whether a call grows with the number of nodes (issue 15: it
did, by passes over every node).

    python -m bench.percall [N ...]                   # default 64 256 512
    python -m bench.percall 64 512 --against 19fd4c8  # and that revision's code, same run

With ``--against REV`` each count runs twice, one after the other: this harness on REV's
``lsgd`` (a git worktree), then on this checkout's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

CALLS = 20_000
REPEATS = 3  # the best of three: the host's other load only ever adds


def measure(nodes: int) -> dict:
    """Microseconds of Python per credit call at ``nodes`` nodes (the best of REPEATS)."""
    from lsgd.config import JobConfig
    from lsgd.global_server.server import build_servicer
    from lsgd.proto import lsgd_pb2 as pb

    class Context:
        def is_active(self) -> bool:
            return True

        def abort(self, code: object, details: str) -> None:
            raise RuntimeError(f"{code}: {details}")

    timed = "used_ms" in pb.AcquireCreditsRequest.DESCRIPTOR.fields_by_name  # newer servers
    best = float("inf")
    for _ in range(REPEATS):
        cfg = JobConfig(num_groups=nodes, workers=8, l_comm=16, g_comm=64, iterations=10**12)
        sv = build_servicer(cfg)
        ctx = Context()
        sessions = {}
        for i in range(nodes):
            r = sv.Join(pb.JoinRequest(node=pb.NodeId(job_id=cfg.job_id, node_index=i),
                                       num_workers=8, param_count=10, algorithm=cfg.rule_spec,
                                       num_groups=nodes), ctx)
            sessions[i] = r.session
        held, seen, seq = [0] * nodes, [0] * nodes, [0] * nodes
        calls = 0
        t = time.perf_counter()
        while calls < CALLS:
            for i in range(nodes):
                seq[i] += 1
                req = pb.AcquireCreditsRequest(
                    node=pb.NodeId(job_id=cfg.job_id, node_index=i, session=sessions[i]),
                    consumed=held[i], want=1 << 30, last_round_seen=seen[i], max_wait_ms=0,
                    seq=seq[i])
                if timed and held[i]:
                    req.used_ms = 100
                answer = sv.AcquireCredits(req, ctx)
                calls += 1
                held[i] = answer.grant
                seen[i] = max(seen[i], answer.round.id)
        best = min(best, (time.perf_counter() - t) / calls)
        rounds = sv.coord.rounds_opened
    return {"nodes": nodes, "us_per_call": round(best * 1e6, 1), "calls": calls,
            "rounds": rounds}


def main(argv: list[str]) -> int:
    against = None
    if "--against" in argv:
        k = argv.index("--against")
        if k + 1 >= len(argv):
            print("bench.percall: --against needs a git revision", file=sys.stderr)
            return 2
        against, argv = argv[k + 1], argv[:k] + argv[k + 2:]
    if argv and argv[0] == "--one":  # one count, on whatever lsgd is on the path
        print(json.dumps(measure(int(argv[1]))), flush=True)
        return 0
    counts = [int(a) for a in argv] or [64, 256, 512]
    if against is None:
        for n in counts:
            print(json.dumps(measure(n)), flush=True)
        return 0
    from bench.against import cell, json_rows, short, worktree

    script = str(Path(__file__).resolve())  # run as a file: lsgd comes from PYTHONPATH alone
    here = Path(__file__).resolve().parents[1]
    rev = short(against)
    lines = []
    with worktree(rev) as tree:
        for n in counts:
            old = json_rows([script, "--one", str(n)], tree, tree)[0]  # REV's lsgd
            new = json_rows([script, "--one", str(n)], here, here)[0]
            print(json.dumps(old | {"rev": rev}), json.dumps(new | {"rev": "this checkout"}),
                  sep="\n", flush=True)
            lines.append(f"| {n} | {cell(old['us_per_call'], new['us_per_call'], ' µs')} |")
    print(f"\nPython per credit call (no gRPC), this checkout against {rev}, same run:")
    print("| nodes | µs per call |\n|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
