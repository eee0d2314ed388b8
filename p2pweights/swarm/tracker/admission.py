"""Admission: whom a serving node keeps state for (pure: the node asks, then acts).

A connection holds state (a protocol state machine, a member, a child) once it
speaks; at most ``max_per_host`` connections from one address do, so one host
opening many cannot take every slot.  An ATTACH is admitted only with the
ticket the tracker put in the peer's plan (``membership.ticket_ok``), below
``max_children``, and one child per rank: a newer ATTACH with a valid ticket
for a rank replaces the child attached as that rank, and one with a ticket of
an earlier session than one seen here is void (``rank_slot``).  A child not
heard from for ``child_timeout`` (a peer heartbeats every link it pulls over)
is dropped, so idle connections that attached once cannot keep honest joiners
out for ever.
"""
from __future__ import annotations

from .membership import ticket_ok, ticket_session

MAX_PER_HOST = 64  # connections one address may hold state with at a node (a host's join uses two: tracker, link)
CHILD_TIMEOUT = 60.0  # seconds: a child not heard from this long is dropped
MEMBER_TIMEOUT = 30.0  # seconds: the tracker drops a member not heard from this long (it heartbeats every 0.5 s)
NOT_PLACED = "not placed here"  # how an ATTACH without a valid ticket is refused (the peer asks the tracker)


class Admission:
    """Connections per address, and the children that went quiet."""

    def __init__(self, max_per_host: int = MAX_PER_HOST, child_timeout: float = CHILD_TIMEOUT):
        self.max_per_host, self.child_timeout = max_per_host, child_timeout
        self.host: dict[bytes, str] = {}  # connection -> its address
        self.count: dict[str, int] = {}  # address -> connections holding state
        self.sessions: dict[int, int] = {}  # rank -> the latest session a ticket that attached here named

    def admit(self, ident: bytes, host: str) -> bool:
        """Whether connection ``ident``, from ``host``, may hold state (counted until ``release``)."""
        if ident in self.host:
            return True
        if self.count.get(host, 0) >= self.max_per_host:
            return False
        self.host[ident] = host
        self.count[host] = self.count.get(host, 0) + 1
        return True

    def release(self, ident: bytes) -> None:
        host = self.host.pop(ident, None)
        if host is not None:
            self.count[host] -= 1
            if not self.count[host]:
                del self.count[host]

    def rank_slot(self, children: dict, ident: bytes, rank: int, ticket) -> tuple[str | None, bytes | None]:
        """One attached child per rank: (why an ATTACH as ``rank`` on ``ident`` with a valid ``ticket`` is refused,
        the child attached as ``rank`` on another connection that it replaces).  A ticket of an earlier session
        than one seen here is void: that member joined again since."""
        session = ticket_session(ticket) or 0
        if session < self.sessions.get(rank, 0):
            return f"{NOT_PLACED}: the ticket for rank {rank} is of an earlier session than one seen here", None
        self.sessions[rank] = session
        return None, next((i for i, c in children.items() if c.rank == rank and i != ident), None)

    def idle(self, children, seen: dict, now: float) -> list[bytes]:
        """The ``children`` not heard from (``seen``: connection -> when) for ``child_timeout``."""
        return [i for i in children if now - seen.get(i, now) > self.child_timeout]


def placed_refusal(f: dict, model_id: str, secret: str | None) -> str | None:
    """Why an ATTACH or LANE with fields ``f`` is refused at a node serving ``model_id`` that holds ``secret``
    (None: no tracker placed it yet, and it admits anyone): the wrong model, or no ticket for its rank; else None."""
    if f["model_id"] != model_id:
        return "model id mismatch"
    if secret is not None and not ticket_ok(secret, f["rank"], f.get("ticket")):
        return f"{NOT_PLACED}: no valid ticket for rank {f['rank']} (the tracker gives one with each plan entry)"
    return None


def attach_refusal(f: dict, model_id: str, secret: str | None, children: dict, ident: bytes,
                   max_children: int, admission: Admission | None = None) -> tuple[str | None, bytes | None]:
    """(Why an ATTACH is refused: ``placed_refusal``, a void ticket, or ``max_children`` children already; or None
    to admit it, the child of its rank it replaces or None).  Ranks are one child each only where tickets are
    checked (``secret``): elsewhere a rank proves nothing."""
    why, older = placed_refusal(f, model_id, secret), None
    if why is None and secret is not None and admission is not None:
        why, older = admission.rank_slot(children, ident, f["rank"], f.get("ticket"))
    if why is None and older is None and ident not in children and len(children) >= max_children:
        return f"parent serves its maximum of {max_children} children", None
    return why, older
