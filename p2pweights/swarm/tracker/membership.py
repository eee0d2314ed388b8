"""Membership credentials: what binds a member to the tracker that placed it (pure, no I/O).

The tracker holds one random key for its lifetime.  Each member's ``secret``
is derived from it and the member's rank and handed out in WELCOME only:
a HELLO from another connection names a member it means to be again only
with that secret (a peer id, which STATUS may show, proves nothing).  A
restarted tracker has a new key: no old secret proves anything to it, and a
member re-introducing itself joins anew (at its old rank while nobody holds it).

Each plan entry a member is sent (a parent or partner ``p``) carries a
``ticket``: the member's session (a count of its joins at this tracker) and a
MAC of its rank and session under ``p``'s secret.  ``p`` checks it at ATTACH
with its own secret alone (``ticket_ok``), so a node serves only peers the
tracker placed with it, and a stranger cannot take its child slots.  A node
keeps one attached child per rank, the latest session's (``admission``): a
member that joined again voids the tickets of its earlier sessions.
"""
from __future__ import annotations

import os
from _blake2 import blake2b  # keyed BLAKE2b is a MAC; hashlib and hmac would load OpenSSL, 2 ms of a join's start
from _operator import _compare_digest as compare_digest  # what hmac.compare_digest is without OpenSSL

SECRET_BYTES = 16  # a secret or ticket: 32 hex digits


def _mac(key: bytes, text: str) -> str:
    return blake2b(text.encode(), key=key[:64], digest_size=SECRET_BYTES).hexdigest()


def ticket_for(secret: str, rank: int, session: int = 0) -> str:
    """The ticket that admits ``rank``, in its ``session``, at the node holding ``secret``."""
    return f"{session}.{_mac(secret.encode(), f'attach:{rank}:{session}')}"


def ticket_session(ticket) -> int | None:
    """The session a ticket names (None: not a ticket's form)."""
    head = ticket.partition(".")[0] if isinstance(ticket, str) and "." in ticket else ""
    return int(head) if head.isdigit() and len(head) <= 12 else None


def ticket_ok(secret: str | None, rank, ticket) -> bool:
    """Whether ``ticket`` (from an ATTACH) admits ``rank`` at the node holding ``secret``."""
    session = ticket_session(ticket)
    return (secret is not None and type(rank) is int and session is not None
            and compare_digest(ticket_for(secret, rank, session), ticket))


class Seal:
    """The tracker's key, and the secrets and tickets derived from it."""

    def __init__(self, key: bytes | None = None):
        self.key = os.urandom(32) if key is None else key
        self.sessions: dict[int, int] = {}  # rank -> its joins here: the session its tickets name

    def begin(self, rank: int) -> int:
        """Member ``rank`` (re)joined: a new session, whose tickets void its earlier ones where it attaches."""
        self.sessions[rank] = self.sessions.get(rank, 0) + 1
        return self.sessions[rank]

    def secret(self, rank: int) -> str:
        """Member ``rank``'s secret (the seeder is rank 0)."""
        return _mac(self.key, f"member:{rank}")

    def proves(self, rank, secret) -> bool:
        """Whether ``secret`` is member ``rank``'s."""
        return type(rank) is int and isinstance(secret, str) and compare_digest(self.secret(rank), secret)

    def ticket(self, parent: int, child: int) -> str:
        """What ``child``, in its latest session, shows ``parent`` at ATTACH."""
        return ticket_for(self.secret(parent), child, self.sessions.get(child, 0))
