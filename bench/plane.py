"""Issue 15, parameter plane: a broadcast and a reduce through rate-limited links, star
against lsgd's chain (PLANE=chain).

Each node gets a host of its own, and a link of its own: a network namespace joined to a
*switch* namespace (a Linux bridge) by a veth pair, both ends shaped by ``tc tbf`` at ``RATE``.
A model of ``SIZE`` bytes (float32) moves among the nodes, five ways, in the same run:

- **one transfer** node 0 → node 1: the baseline, one link's time; beside it a plain TCP socket on
  the same link (issue 15: bulk transfers at >= 0.8x of it);
- **star broadcast**: node 0 sends to each of the others at once, as the global server serves the
  leader with PLANE=star: its one link carries ``N - 1`` copies;
- **chain broadcast**: lsgd's parameter plane as a node runs it with PLANE=chain
  (``lsgd/plane/node.py``): node 0 → 1 → 2 → …, each forwarding every chunk as it arrives;
- **star reduce**: every other node sends its vector to node 0 at once, as every node uploads its
  sum to the global server with PLANE=star;
- **chain reduce**: the plane's reduce: the sums added up along a chain toward node 0.

The star ways use lsgd's raw data connection (``lsgd/plane/wire.py``), not gRPC: they model the
star's link cost (``N - 1`` copies through one link) at its best; today's gRPC streams move a
vector at 0.33-0.57x a raw socket's speed (docs/benchmarks.md), so the real star is slower
still. The target (issue 15): the chain broadcast within 1.5x of one transfer for N = 4, 8, 16.
Needs root and iproute2; ``--quick``: N = 4 and 8, 10 MB. Each row records the load average
before it and the share of the host's CPU its processes used.

    python -m bench.plane [--quick] [--rate 100mbit] [--size-mb 25] [--nodes 4 8 16] [--fanout 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

from .common import REPO, Result

TARGET = "10. parameter plane (issue 15)"
SECRET = "bench-plane-secret-0123456789abcdef"
PORT = 47000
CHUNK = 1 << 16  # float32 elements per chunk: 256 KiB


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


class Links:
    """``n`` node namespaces on a bridge, every link shaped to ``rate`` both ways."""

    def __init__(self, n: int, rate: str) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.switch = f"lp{self.tag}sw"
        self.nodes = [f"lp{self.tag}n{i}" for i in range(n)]
        self.ips = [f"10.77.{int(self.tag[:2], 16) % 200}.{i + 1}" for i in range(n)]
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.nodes):
                a, b = f"v{self.tag}{i}a", f"v{self.tag}{i}b"
                _ip("netns", "add", ns)
                _ip("link", "add", a, "type", "veth", "peer", "name", b)
                _ip("link", "set", a, "netns", ns)
                _ip("link", "set", b, "netns", self.switch)
                _ip("-n", ns, "addr", "add", f"{self.ips[i]}/24", "dev", a)
                _ip("-n", ns, "link", "set", a, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "set", b, "master", "br0")
                _ip("-n", self.switch, "link", "set", b, "up")
                for where, dev in ((ns, a), (self.switch, b)):  # the node's link, both ways
                    subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev",
                                    dev, "root", "tbf", "rate", rate, "burst", "256kb",
                                    "latency", "100ms"], check=True, capture_output=True,
                                   timeout=20)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for ns in self.nodes + [self.switch]:
            _ip("netns", "del", ns, check=False)


def _node(links: Links, i: int, spec: dict) -> subprocess.Popen:
    """``bench.plane_node`` in node ``i``'s namespace."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(["ip", "netns", "exec", links.nodes[i], sys.executable, "-m",
                             "bench.plane_node", json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def transfer(links: Links, count: int, mode: str, routes: dict[int, list[int]] | None,
             timeout: float, fanout: int = 1) -> float:
    """One vector of ``count`` elements moved as ``mode`` says (``bench/plane_node.py``):
    ``raw`` along ``routes`` (node -> the nodes it sends to) from node 0; ``gather``, ``chain``
    and ``reduce`` among all the nodes. Seconds from the common start to the last node's end."""
    if routes is not None:
        members = sorted({0} | {d for ds in routes.values() for d in ds})
        parent = {d: src for src, ds in routes.items() for d in ds}
    else:
        members, parent = list(range(len(links.nodes))), {}
    procs = {}
    start_at = time.time() + 6.0  # every node listens (and knows its route) by then
    for i in members:
        spec = {"mode": mode, "node": i, "count": count, "chunk": CHUNK, "secret": SECRET,
                "port": PORT, "ips": links.ips[:len(members)], "start_at": start_at,
                "timeout": timeout, "listen": links.ips[i] if i in parent else None,
                "sendto": [[d, links.ips[d]] for d in (routes or {}).get(i, [])],
                "from": parent.get(i), "fanout": fanout}
        procs[i] = _node(links, i, spec)
    out = {}
    for i, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise RuntimeError(f"node {i} did not finish within {timeout + 10:g} s")
        if p.returncode != 0:
            raise RuntimeError(f"node {i} ({mode}) failed: {stderr.strip()[-800:]}")
        out[i] = json.loads(stdout.strip().splitlines()[-1])
    return max(r["done"] for r in out.values()) - start_at


WAYS = ("star_broadcast", "chain_broadcast", "star_reduce", "chain_reduce")


def measure(quick: bool, rate: str, size_mb: float, counts: list[int],
            fanouts: tuple[int, ...] = ()) -> dict:
    count = int(size_mb * 1e6) // 4
    timeout = 600.0
    rows = []
    for n in counts:
        links = Links(n, rate)
        load0 = os.getloadavg()[0]
        cpu0 = time.process_time(), _children_cpu()
        t0 = time.monotonic()
        try:
            row = {"nodes": n, "one_s": transfer(links, count, "raw", {0: [1]}, timeout)}
            row["tcp_s"] = transfer(links, count, "tcp", {0: [1]}, timeout)
            row["star_broadcast_s"] = transfer(links, count, "raw", {0: list(range(1, n))}, timeout)
            row["chain_broadcast_s"] = transfer(links, count, "chain", None, timeout)
            row["star_reduce_s"] = transfer(links, count, "gather", None, timeout)
            row["chain_reduce_s"] = transfer(links, count, "reduce", None, timeout)
            for f in fanouts:  # PLANE_FANOUT: the broadcast as a tree of f chains
                row[f"tree{f}_broadcast_s"] = transfer(links, count, "chain", None, timeout, f)
        finally:
            links.close()
        row["load_before"] = round(load0, 2)
        row["host_cpu_share"] = round((_children_cpu() - cpu0[1]) / (time.monotonic() - t0)
                                      / (os.cpu_count() or 1), 3)
        rows.append(row)
        print(f"  {n} nodes: plain TCP {row['tcp_s']:.2f} s, one transfer {row['one_s']:.2f} s; " + ", ".join(
            f"{w.replace('_', ' ')} {row[w + '_s']:.2f} s ({row[w + '_s'] / row['one_s']:.2f}x)"
            for w in WAYS + tuple(f"tree{f}_broadcast" for f in fanouts)), flush=True)
    return {"rate": rate, "size_mb": size_mb, "chunk_bytes": CHUNK * 4, "rows": rows}


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def run(quick: bool) -> list[Result]:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise RuntimeError("bench.plane needs root and iproute2 (ip, tc)")
    m = measure(quick, "100mbit", 10.0 if quick else 25.0, [4, 8] if quick else [4, 8, 16])
    out = []
    for r in m["rows"]:
        out.append(Result(
            TARGET, f"one transfer of {m['size_mb']:g} MB over lsgd's data connection (MAC'd), "
            f"{m['rate']} link", r["one_s"], "s", baseline=r["tcp_s"],
            baseline_name="a plain TCP socket on the same link", ratio=r["tcp_s"] / r["one_s"],
            ratio_note="speed: baseline / value", goal=">= 0.8x", met=r["tcp_s"] / r["one_s"] >= 0.8,
            extra=r))
        for way in WAYS:
            ratio = r[f"{way}_s"] / r["one_s"]
            out.append(Result(
                TARGET, f"{way.replace('_', ' ')} of {m['size_mb']:g} MB, {r['nodes']} nodes, "
                f"{m['rate']} links", r[f"{way}_s"], "s",
                baseline=r["one_s"], baseline_name="one transfer on the same links",
                ratio=ratio, ratio_note="value / baseline",
                goal="<= 1.5x" if way == "chain_broadcast" else "",
                met=(ratio <= 1.5) if way == "chain_broadcast" else None,
                extra=r | {"chunk_bytes": m["chunk_bytes"]}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plane", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--size-mb", type=float, default=None)
    p.add_argument("--nodes", type=int, nargs="+", default=None)
    p.add_argument("--fanout", type=int, nargs="+", default=[],
                   help="also the broadcast as a tree of this many chains (PLANE_FANOUT)")
    a = p.parse_args(argv)
    size = a.size_mb or (10.0 if a.quick else 25.0)
    counts = a.nodes or ([4, 8] if a.quick else [4, 8, 16])
    print(json.dumps(measure(a.quick, a.rate, size, counts, tuple(a.fanout)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
