"""The parameter plane on the control wire: routes to and from ``DataRoute`` messages, and the
checks of what a node announces (its data address) and of what a node is told (a route).
Every field is bounded on both sides."""

from __future__ import annotations

import ipaddress
import math
import urllib.parse

from ..proto import lsgd_pb2 as pb
from .node import RouteInfo, chunk_for
from .route import Kind, Route
from .wire import MAX_CHUNK

MAX_ADDRESS = 255


class PlaneError(ValueError):
    """A data address or a route that cannot be used; the message says why."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port), or PlaneError."""
    if not address or len(address) > MAX_ADDRESS or not address.isascii():
        raise PlaneError(f"a data address is 1-{MAX_ADDRESS} ASCII characters, got "
                         f"{len(address)}")
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise PlaneError(f"data address {address!r} is not host:port")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise PlaneError(f"data address {address!r}: the host must be an IP address") from None
    return host, int(port)


def check_data_address(address: str, peer: str) -> str:
    """The address a joining node announced, checked against the address the server sees it
    at (``peer`` as gRPC gives it: ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``); PlaneError if they
    differ: a node may not point other nodes' sends at a third party."""
    host, _ = split_address(address)
    kind, _, rest = urllib.parse.unquote(peer).partition(":")  # ipv6:%5B::1%5D:5 as well
    if kind not in ("ipv4", "ipv6"):
        raise PlaneError(f"the data plane needs a TCP connection to the global server, not {kind}")
    seen = rest.rpartition(":")[0].strip("[]")
    try:
        same = ipaddress.ip_address(host) == ipaddress.ip_address(seen)
    except ValueError:
        same = False
    if not same:
        raise PlaneError(f"data address {address!r} is not the address this node connects from "
                         f"({seen}); set DATA_HOST to it")
    return address


def to_pb(info: RouteInfo | None) -> pb.DataRoute:
    if info is None:
        return pb.DataRoute()
    r = info.route
    members = [pb.RouteMember(node=r.root, parent=-1, address=info.addresses[r.root])]
    members += [pb.RouteMember(node=n, parent=r.parent[n], address=info.addresses[n])
                for n in sorted(r.parent)]
    return pb.DataRoute(round_id=info.round_id, epoch=r.epoch, members=members,
                        feeds_server=info.feeds_server, chunk_elements=info.chunk,
                        reduce=info.reduce, total_summands=info.total_summands,
                        total_weight=info.total_weight)


def from_pb(msg: pb.DataRoute, num_groups: int) -> RouteInfo | None:
    """The route in ``msg`` (None when it has no members), or PlaneError if it is not a tree
    of distinct nodes of this job rooted at its first member."""
    if not msg.members:
        return None
    if len(msg.members) > num_groups:
        raise PlaneError(f"a route of {len(msg.members)} members in a job of {num_groups} nodes")
    nodes = [m.node for m in msg.members]
    if len(set(nodes)) != len(nodes) or any(n >= num_groups for n in nodes):
        raise PlaneError(f"route members {nodes} are not distinct nodes of 0..{num_groups - 1}")
    root = msg.members[0]
    if root.parent != -1 or any(m.parent == -1 for m in msg.members[1:]):
        raise PlaneError("a route has one source, its first member")
    parent = {m.node: m.parent for m in msg.members[1:]}
    reaches = {root.node}
    for n in parent:  # every member reaches the source (each node walked once)
        path, at = [], n
        while at not in reaches:
            if at not in parent or at in path:
                raise PlaneError(f"member {n} does not reach the source {root.node}")
            path.append(at)
            at = parent[at]
        reaches.update(path)
    for m in msg.members:
        split_address(m.address)
    if not msg.chunk_elements or msg.chunk_elements > MAX_CHUNK:
        raise PlaneError(f"chunk of {msg.chunk_elements} elements, outside 1..{MAX_CHUNK}")
    if msg.feeds_server not in nodes:
        raise PlaneError(f"the member feeding the server, {msg.feeds_server}, is not on the route")
    if msg.reduce and (msg.feeds_server != root.node or msg.epoch
                       or not math.isfinite(msg.total_weight) or msg.total_weight < 0):
        raise PlaneError("a reduce ends at the member feeding the server, at epoch 0, with a "
                         "finite total weight")
    route = Route(Kind.REDUCE if msg.reduce else Kind.BROADCAST, root.node, parent,
                  epoch=msg.epoch)
    return RouteInfo(msg.round_id, route, {m.node: m.address for m in msg.members},
                     msg.feeds_server, msg.chunk_elements, msg.total_summands, msg.total_weight)


def leader_route(round_id: int, members: list[int], source: int,
                 addresses: dict[int, str], fanout: int = 1, count: int = 0) -> RouteInfo | None:
    """The route of a round's leader from ``source`` to the other ``members`` that have a data
    address; None when fewer than two of them do (the star then serves alone). Node 0, which
    runs beside the server, feeds the server when it is on the route (loopback); else the
    source does. ``count``: the model's elements, which size the chunks (``chunk_for``)."""
    from .route import plan

    on = [n for n in members if n in addresses]
    if source not in on or len(on) < 2:
        return None
    route = plan(Kind.BROADCAST, on, source, fanout)
    return RouteInfo(round_id, route, {n: addresses[n] for n in on},
                     feeds_server=0 if 0 in on else source, chunk=chunk_for(count, route.depth()))


def sum_route(round_id: int, sums: dict[int, tuple[int, float]],
              addresses: dict[int, str], count: int = 0) -> RouteInfo | None:
    """The route of a round's sums: ``sums`` maps each node that reported to (participants,
    weight). A chain of the nodes with participants and a data address ends at node 0, which
    adds its own sum and uploads the total; None when node 0 is not among them or fewer than
    two are (their sums go to the server each, the star)."""
    from .route import plan

    on = [n for n, (p, _) in sorted(sums.items()) if p > 0 and n in addresses]
    if 0 not in on or len(on) < 2:
        return None
    route = plan(Kind.REDUCE, on, 0, 1)
    return RouteInfo(round_id, route, {n: addresses[n] for n in on}, feeds_server=0,
                     chunk=chunk_for(count, route.depth()), total_summands=sum(sums[n][0] for n in on),
                     total_weight=math.fsum(sums[n][1] or sums[n][0] for n in on))


def center_route(reduce: RouteInfo) -> RouteInfo:
    """The broadcast of the new center after a reduce: the same chain, the other way, from node
    0 (which downloads the center from the server beside it) to the far end."""
    route = Route(Kind.BROADCAST, reduce.route.root, dict(reduce.route.parent))
    return RouteInfo(reduce.round_id, route, dict(reduce.addresses), reduce.route.root,
                     reduce.chunk)
