"""Membership credentials: what binds a member to the tracker that placed it (pure, no I/O).

The tracker holds one random key for its lifetime.  Each member's ``secret``
is derived from it and the member's rank and handed out in WELCOME only:
a HELLO from another connection names a member it means to be again only
with that secret (a peer id, which STATUS may show, proves nothing).  A
restarted tracker has a new key: no old secret proves anything to it, and a
member re-introducing itself joins anew (at its old rank while nobody holds it).

Each plan entry a member is sent (a parent or partner ``p``) carries a
``ticket``: a MAC of the member's rank under ``p``'s secret.  ``p`` checks it
at ATTACH with its own secret alone (``ticket_ok``), so a node serves only
peers the tracker placed with it, and a stranger cannot take its child slots.
"""
from __future__ import annotations

import os
from _blake2 import blake2b  # keyed BLAKE2b is a MAC; hashlib and hmac would load OpenSSL, 2 ms of a join's start
from _operator import _compare_digest as compare_digest  # what hmac.compare_digest is without OpenSSL

SECRET_BYTES = 16  # a secret or ticket: 32 hex digits


def _mac(key: bytes, text: str) -> str:
    return blake2b(text.encode(), key=key[:64], digest_size=SECRET_BYTES).hexdigest()


def ticket_for(secret: str, rank: int) -> str:
    """The ticket that admits ``rank`` at the node holding ``secret``."""
    return _mac(secret.encode(), f"attach:{rank}")


def ticket_ok(secret: str | None, rank, ticket) -> bool:
    """Whether ``ticket`` (from an ATTACH) admits ``rank`` at the node holding ``secret``."""
    return (secret is not None and type(rank) is int and isinstance(ticket, str)
            and compare_digest(ticket_for(secret, rank), ticket))


class Seal:
    """The tracker's key, and the secrets and tickets derived from it."""

    def __init__(self, key: bytes | None = None):
        self.key = os.urandom(32) if key is None else key

    def secret(self, rank: int) -> str:
        """Member ``rank``'s secret (the seeder is rank 0)."""
        return _mac(self.key, f"member:{rank}")

    def proves(self, rank, secret) -> bool:
        """Whether ``secret`` is member ``rank``'s."""
        return type(rank) is int and isinstance(secret, str) and compare_digest(self.secret(rank), secret)

    def ticket(self, parent: int, child: int) -> str:
        """What ``child`` shows ``parent`` at ATTACH."""
        return ticket_for(self.secret(parent), child)
