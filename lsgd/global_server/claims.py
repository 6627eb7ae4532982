"""Bounds on the counts a node reports: nothing a node claims can exceed what it can have done.

Pure functions of the coordinator (``coordinator.py``). Per node the server knows two amounts:

- ``outstanding``: credits granted and not yet reported used or released;
- ``spare``: credits the server no longer counts as the node's but which the node may still
  step on: credits it released (a stuck worker may use them later, as late steps), credits
  forfeited when the node was dropped or the time budget ran out, and the steps a *detached*
  node may take on credits of its own (at most ``Schedule.detached_steps`` per detachment, a
  rule the node keeps too: ``LocalServer._serve_pending``).

A report is accepted only when every step and every release in it is backed by one of these
credits; otherwise it is refused (``INVALID_ARGUMENT``) before anything changes. Each accepted
step uses its credit, so the counter grows by at most what the server granted plus the bounded
allowances, and no count can overflow.
"""

from __future__ import annotations

MAX_SEQ = 1 << 62  # request numbers beyond this are refused (uint64 on the wire, +1 stays safe)


class ClaimError(ValueError):
    """A count beyond what the node can have done; the message says which and the bound."""


def settle(index: int, outstanding: int, spare: int, consumed: int, late: int,
           released: int) -> tuple[int, int]:
    """``(outstanding, spare)`` after a report of ``consumed`` steps on granted credits,
    ``late`` steps on spare ones and ``released`` unused credits, or ClaimError.

    A step reported as consumed beyond ``outstanding`` is one on a forfeited credit (the node
    did not know); a release beyond it gives back a forfeited credit, which stays spare (a
    stuck worker may still step on it)."""
    if min(consumed, late, released) < 0:
        raise ClaimError("counts must be >= 0")
    from_out = min(consumed, outstanding)
    if consumed - from_out > spare:
        raise ClaimError(f"node {index} reports {consumed} steps but holds only {outstanding} "
                         f"credits (+{spare} given back or forfeited)")
    outstanding, spare = outstanding - from_out, spare - (consumed - from_out)
    freed = min(released, outstanding)
    if released - freed > spare:
        raise ClaimError(f"node {index} reports {consumed} consumed + {released} released but "
                         f"holds only {outstanding + from_out} credits")
    outstanding, spare = outstanding - freed, spare + freed
    if late > spare:
        raise ClaimError(f"node {index} reports {late} late steps; at most {spare} credits it "
                         "gave back or lost can have been used late")
    return outstanding, spare - late


def reattach(index: int, held: int, counted: int, outstanding: int, spare: int, *,
             period: int, detached_steps: int, restored: bool) -> int:
    """The node's ``spare`` after it reattached holding ``held`` credits with ``counted`` steps
    the server has not counted, or ClaimError.

    It can hold at most what the server grants between two rounds (``period``), and its held
    credits and uncounted steps come from what it held, its spare credits and the steps it may
    take detached. After a server restart what it held is unknown: the saved spare plus two
    periods (what it may have been granted and given back since the state was saved)."""
    if held > period:
        raise ClaimError(f"node {index} claims to hold {held} credits; the server grants a node "
                         f"at most {period} between two rounds")
    budget = (2 * period if restored else outstanding) + spare + detached_steps
    if held + counted > budget:
        raise ClaimError(f"node {index} claims {counted} uncounted steps and {held} held credits; "
                         f"at most {budget} are possible")
    return budget - held - counted


def check_seq(index: int, seq: int, last: int, *, ahead: int) -> None:
    """A request number must not run more than ``ahead`` past the newest one (``last``)."""
    if seq >= MAX_SEQ or (ahead and seq > last + ahead):
        raise ClaimError(f"request {seq} of node {index} is ahead of the expected "
                         f"{last + 1}; number requests 1, 2, ... per session")
