"""``lsgd ray``: run a job on a Ray cluster, one lsgd node per Ray node (issue 13).

Connects to a running Ray cluster, reserves one bundle per lsgd node in a ``STRICT_SPREAD``
placement group (so no two lsgd nodes share a Ray node), starts node 0's actor, learns node 0's
address from it (the IP of the Ray node it landed on, and the port its global server wrote to
``RUN_DIR/global.port``), then starts nodes 1..N-1 pointed there. Each actor runs
``python -m lsgd train`` as a subprocess (not ``train.sh``: an installed lsgd is enough on the
Ray nodes) and the driver streams every node's log lines, prefixed ``node i |``. On Ctrl-C or the
timeout every node gets SIGINT, then SIGKILL after a grace period; the placement group is removed
whatever happens. Examples::

    ray start --head                          # on one machine; `ray start --address ...` on the others
    python -m lsgd ray --nodes 2 -- WORKERS=2 ITERATIONS=6000 SECRET_FILE=/etc/lsgd/secret
    python -m lsgd ray --nodes 3 --timeout 600 --address 10.0.0.1:6379 -- ALGORITHM=easgd

From Python: ``lsgd.ray_launch.run(2, {"WORKERS": 2})`` returns node 0's ``summary.json`` with a
``"ray"`` key: each node's Ray node id, IP and exit code, and the worst exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable

from . import exitcodes
from .config import fields
from .ray_node import NodeProcess

log = logging.getLogger(__name__)

PLACE_TIMEOUT = 30.0  # seconds to wait for the placement group
PORT_TIMEOUT = 60.0  # seconds for node 0 to write its port
STOP_GRACE = 30.0  # seconds a node has after SIGINT before SIGKILL
POLL = 0.25  # seconds between the driver's polls of the actors
SET_BY_LAUNCHER = ("NODE", "NODE_INDEX")  # each actor's own index; refused as a knob


class RayLaunchError(RuntimeError):
    """The job cannot start on this Ray cluster; one line says why (exit 2)."""


def parse_knobs(items: list[str]) -> dict[str, str]:
    """``["WORKERS=2", ...]`` -> ``{"WORKERS": "2"}``; a malformed item is a RayLaunchError."""
    knobs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum():
            raise RayLaunchError(f"knob {item!r} is not NAME=value (e.g. WORKERS=2)")
        knobs[name] = value
    return knobs


def _argv(knobs: dict[str, str]) -> list[str]:
    """``lsgd train`` flags for the knobs that are config fields (the others stay env only)."""
    names = {f.name for f in fields()}
    return [a for k, v in knobs.items() if k.lower() in names
            for a in ("--" + k.lower().replace("_", "-"), v)]


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RayLaunchError("Ray is not installed here: pip install 'lsgd[ray]'") from None
    return ray


def run(nodes: int, knobs: dict[str, str], *, address: str = "auto", timeout: float | None = None,
        cpus_per_node: float = 1, gpus_per_node: float = 0, place_timeout: float = PLACE_TIMEOUT,
        on_line: Callable[[int, str], None] | None = None) -> dict:
    """Run an lsgd job of ``nodes`` nodes on the Ray cluster at ``address``.

    Args:
        nodes: lsgd nodes, one per Ray node (``NUM_GROUPS``).
        knobs: ``train.sh``'s knobs (``WORKERS``, ``ITERATIONS``, ...) plus any environment the
            job needs; they reach every node as given. ``IP_ADDR`` given wins over node 0's IP.
        address: the Ray cluster (``auto``: the one this machine belongs to). Used only when
            Ray is not initialized yet; a connection made here is closed at the end.
        timeout: seconds for the whole job; then every node is stopped (None: no limit).
        cpus_per_node, gpus_per_node: each bundle's (and actor's) resources.
        place_timeout: seconds to wait for the placement group.
        on_line: called with (node index, line) for each log line (default: logged here).

    Returns:
        Node 0's ``summary.json`` plus ``"ray"``: ``{"nodes": [{"node", "ray_node_id", "ip",
        "exit_code"}...], "exit_code": <the worst>, "stopped": None | "timeout"}``.

    Raises:
        RayLaunchError: Ray missing, no cluster, a bad knob, or the nodes cannot be placed.
        KeyboardInterrupt: after stopping every node and removing the placement group.
    """
    if nodes < 1:
        raise RayLaunchError(f"--nodes must be at least 1, got {nodes}")
    knobs = {k: str(v) for k, v in knobs.items()}
    for name in SET_BY_LAUNCHER:
        if name in knobs:
            raise RayLaunchError(f"{name} is set by lsgd ray for each node; leave it out")
    if knobs.setdefault("NUM_GROUPS", str(nodes)) != str(nodes):
        raise RayLaunchError(f"NUM_GROUPS={knobs['NUM_GROUPS']} disagrees with --nodes {nodes}")
    knobs.setdefault("PORT", "0")  # any free port; node 0's actor reads it back
    # one RUN_DIR for every node, absolute: a Ray worker's cwd is not the driver's
    knobs["RUN_DIR"] = str(Path(knobs.get("RUN_DIR", "runs/lsgd")).expanduser().absolute())
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    connected_here = not ray.is_initialized()
    if connected_here:
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayLaunchError(f"no Ray cluster answers at {address!r} ({exc}); start one with "
                                 "`ray start --head` or pass --address") from None
    on_line = on_line or (lambda i, line: log.info("node %d | %s", i, line))
    deadline = time.monotonic() + timeout if timeout else float("inf")
    bundle = {"CPU": cpus_per_node} | ({"GPU": gpus_per_node} if gpus_per_node else {})

    def misfit(wait: str) -> RayLaunchError:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        return RayLaunchError(
            f"cannot place {nodes} lsgd nodes on distinct Ray nodes{wait}: the cluster has "
            f"{alive} live Ray node(s), each lsgd node needs one with {bundle} free; use --nodes "
            f"{min(alive, nodes - 1)} or fewer, or add Ray nodes")

    if sum(1 for n in ray.nodes() if n.get("Alive")) < nodes:  # STRICT_SPREAD cannot fit: say now
        error = misfit("")
        if connected_here:
            ray.shutdown()
        raise error
    pg = placement_group([bundle] * nodes, strategy="STRICT_SPREAD", name=f"lsgd-{knobs.get('JOB_ID', 'lsgd')}")
    actors: list = []
    stopped = None
    try:
        ready, _ = ray.wait([pg.ready()], timeout=place_timeout)
        if not ready:
            raise misfit(f" within {place_timeout:g} s")
        actor_class = ray.remote(NodeProcess)

        def start(i: int) -> dict:
            """Start node i's actor, then its node; returns where it runs."""
            actor = actor_class.options(
                num_cpus=cpus_per_node, num_gpus=gpus_per_node,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i)).remote(i)
            actors.append(actor)
            place = ray.get(actor.where.remote(), timeout=60)
            knobs.setdefault("IP_ADDR", place["ip"])  # node 0's: the job's address
            argv = [sys.executable, "-m", "lsgd", "train", "--node-index", str(i), *_argv(knobs)]
            place["pid"] = ray.get(actor.start.remote(argv, knobs, os.getcwd()), timeout=60)
            return place

        places = [start(0)]
        codes: dict[int, int] = {}
        seen = [0] * nodes
        port_by = time.monotonic() + PORT_TIMEOUT
        while len(codes) < len(actors) or len(actors) < nodes:
            if time.monotonic() > deadline:
                stopped = "timeout"
                log.warning("timeout after %g s; stopping every node", timeout)
                break
            polls = ray.get([a.poll.remote(seen[i]) for i, a in enumerate(actors)], timeout=60)
            for i, (lines, code, port) in enumerate(polls):
                seen[i] += len(lines)
                for line in lines:
                    on_line(i, line)
                if code is not None:
                    codes[i] = code
            if len(actors) < nodes:
                lines, code, port = polls[0]
                if code is not None:  # node 0 ended before serving: nothing to join
                    break
                if port is None:
                    if time.monotonic() > port_by:
                        raise RayLaunchError(f"node 0 did not write its port within {PORT_TIMEOUT:g} s")
                else:
                    knobs["PORT"] = str(port)
                    places += [start(i) for i in range(1, nodes)]
            time.sleep(POLL)
        if len(codes) < len(actors):
            _stop(ray, actors, codes)
        summaries = ray.get([a.summary.remote() for a in actors], timeout=60)
    except BaseException:  # Ctrl-C, node 0 without a port, Ray lost: stop what runs, then say
        _stop(ray, actors, {})
        raise
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)
        if connected_here:
            ray.shutdown()
    for i in range(len(actors)):
        places[i]["exit_code"] = codes.get(i, exitcodes.FAILED)
    result = dict(summaries[0] or {})
    result["ray"] = {"nodes": places, "stopped": stopped,
                     "exit_code": exitcodes.worst([p["exit_code"] for p in places]
                                                  + ([exitcodes.FAILED] if len(actors) < nodes else []))}
    return result


def _stop(ray, actors: list, codes: dict[int, int]) -> None:
    """SIGINT every node still running, SIGKILL after STOP_GRACE; fills in ``codes``."""
    if not actors:
        return
    refs = [a.stop.remote(STOP_GRACE) for a in actors]
    try:
        for i, code in enumerate(ray.get(refs, timeout=STOP_GRACE + 15)):
            codes.setdefault(i, code)
    except Exception as exc:  # an actor lost with its Ray node: nothing more to stop there
        log.warning("stopping the nodes: %s", exc)


def main(args) -> int:
    """``lsgd ray`` (cli.py parses the flags): the nodes' lines on stdout, exit the worst code."""
    logging.basicConfig(level=logging.INFO, format="lsgd ray: %(message)s")
    try:
        result = run(args.nodes, parse_knobs(args.knobs), address=args.address,
                     timeout=args.timeout, cpus_per_node=args.cpus_per_node,
                     gpus_per_node=args.gpus_per_node,
                     on_line=lambda i, line: print(f"node {i} | {line}", flush=True))
    except RayLaunchError as exc:
        print(f"lsgd ray: error: {exc}", file=sys.stderr)
        return exitcodes.CONFIG
    except KeyboardInterrupt:
        print("lsgd ray: interrupted; every node was stopped", file=sys.stderr)
        return exitcodes.INTERRUPTED
    ray_info = result["ray"]
    for place in ray_info["nodes"]:
        print(f"lsgd ray: node {place['node']} on Ray node {place['ray_node_id'][:12]} "
              f"({place['ip']}): exit code {place['exit_code']}", file=sys.stderr)
    return ray_info["exit_code"]
