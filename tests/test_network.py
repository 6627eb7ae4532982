"""Network faults between two hosts: network namespaces joined by a veth pair the test creates.

Node 0 runs in one namespace, node 1 in the other; all traffic crosses the veth link, which the
tests slow down (tc), degrade (tc netem, where the kernel has it) or cut (link down). Needs root
and iproute2; skipped otherwise.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
import uuid

import pytest

from conftest import assert_clean_exit, global_summary

TOY = dict(ENTRY="toyjob:main", LOG_LEVEL="INFO", LSGD_SECRET="netns-test-secret-0123456789")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


@pytest.fixture
def hosts():
    """Two namespaces ``a`` (node 0 at .1) and ``b`` (node 1 at .2) on a private /24."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2 (ip, tc)")
    tag = uuid.uuid4().hex[:6]
    a, b = f"lsgd{tag}a", f"lsgd{tag}b"
    net = f"10.{random.randint(64, 250)}.{random.randint(0, 250)}"
    try:
        _ip("netns", "add", a)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for ns, dev, host in ((a, f"v{tag}a", 1), (b, f"v{tag}b", 2)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{net}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {"a": a, "b": b, "ip": f"{net}.1", "link_b": f"v{tag}b"}
    finally:
        for ns in (a, b):
            _ip("netns", "del", ns, check=False)


def _tc(ns: str, dev: str, *spec: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *spec],
                          capture_output=True, text=True, timeout=10)


def _start(cluster, hosts, **knobs):
    knobs = dict(NUM_GROUPS=2, IP_ADDR=hosts["ip"], PORT=50051, **TOY) | knobs
    n0 = cluster(0, _netns=hosts["a"], **knobs)
    cluster.port_of_node0()
    n1 = cluster(1, _netns=hosts["b"], **knobs)
    return n0, n1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("link", ["rate 20mbit (tbf)", "delay 20ms, loss 1% (netem)"])
def test_a_slow_or_lossy_link_keeps_rounds_bounded(cluster, hosts, link):
    spec = (["tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms"] if "tbf" in link
            else ["netem", "delay", "20ms", "loss", "1%"])
    out = _tc(hosts["b"], hosts["link_b"], *spec)
    if out.returncode != 0:
        pytest.skip(f"tc {spec[0]} is not available in this kernel: {out.stderr.strip()}")
    n0, n1 = _start(cluster, hosts, ITERATIONS=8000, ROUND_TIMEOUT=10)
    t0 = time.monotonic()
    assert n0.wait(150) == 0, n0.output
    assert n1.wait(30) == 0, n1.output
    assert time.monotonic() - t0 < 120
    assert "missed" not in n0.output + n1.output  # no round ran into its deadline
    assert global_summary(cluster.run_dir)["counter"] == 8000
    assert_clean_exit(cluster.run_dir, [n0, n1])


@pytest.mark.timeout(180)
def test_a_congested_link_that_drops_packets_keeps_rounds_bounded(cluster, hosts):
    # A 2 Mbit/s link with a 30 ms queue: 200 kB parameter transfers overflow the queue, so
    # packets are dropped (and queued): loss and delay with the tbf qdisc every kernel has.
    out = _tc(hosts["b"], hosts["link_b"], "tbf", "rate", "2mbit", "burst", "4kb", "latency", "30ms")
    assert out.returncode == 0, out.stderr
    n0, n1 = _start(cluster, hosts, ITERATIONS=2048, ROUND_TIMEOUT=20, TOYJOB_SIZE=50000)
    assert n0.wait(150) == 0, n0.output
    assert n1.wait(30) == 0, n1.output
    stats = subprocess.run(["ip", "netns", "exec", hosts["b"], "tc", "-s", "qdisc", "show", "dev",
                            hosts["link_b"]], capture_output=True, text=True, timeout=10).stdout
    dropped = int(stats.split("dropped")[1].split(",")[0])
    print(f"tbf link: {dropped} packets dropped")
    assert dropped > 0, stats  # the link really lost packets
    assert "missed" not in n0.output + n1.output  # and no round ran into its deadline
    assert global_summary(cluster.run_dir)["counter"] == 2048
    assert_clean_exit(cluster.run_dir, [n0, n1])


@pytest.mark.timeout(180)
def test_a_partitioned_node_is_dropped_and_reattaches_when_the_link_returns(cluster, hosts):
    n0, n1 = _start(cluster, hosts, ITERATIONS=30000, NODE_TIMEOUT=2, TOYJOB_STEP_SECONDS="0.0005")
    metrics = cluster.run_dir / "node1" / "metrics.csv"
    end = time.monotonic() + 60
    while time.monotonic() < end and len(metrics.read_text().splitlines() if metrics.exists() else []) < 6:
        time.sleep(0.1)
    _ip("-n", hosts["b"], "link", "set", hosts["link_b"], "down")  # the partition
    cut = time.monotonic()
    while "node 1 dropped" not in n0.output and time.monotonic() < cut + 20:
        time.sleep(0.1)
    assert "node 1 dropped" in n0.output
    assert time.monotonic() - cut < 5.0
    time.sleep(1.0)
    _ip("-n", hosts["b"], "link", "set", hosts["link_b"], "up")  # the link returns
    assert n0.wait(150) == 0, n0.output
    assert n1.wait(30) == 0, n1.output
    assert "node 1: lost the global server" in n1.output
    assert "node 1: reattached" in n1.output
    assert global_summary(cluster.run_dir)["counter"] == 30000
    assert_clean_exit(cluster.run_dir, [n0, n1])
