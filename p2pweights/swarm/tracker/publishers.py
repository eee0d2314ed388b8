"""Publishers: who may PUBLISH to a standalone tracker (``p2pw tracker --publish-from ADDR[,ADDR...]``; pure).

Without the flag anyone who reaches the tracker may publish, and nobody is the
operator.  With it, a PUBLISH from an address outside the listed IPs and CIDRs
is refused, and a listed address is the operator's: its swarms are not evicted
to make room for others, nor capped per address.
"""
from __future__ import annotations

import ipaddress

from ...errors import UserError


class Publishers:
    """The networks publishes may come from (None: anywhere, and no operator)."""

    def __init__(self, networks=None):
        self.networks = None if networks is None else list(networks)

    @classmethod
    def parse(cls, text: str | None) -> Publishers:
        """``--publish-from``'s value: IPs or CIDRs, comma-separated (UserError naming a bad one)."""
        if text is None:
            return cls()
        nets = []
        for part in (p.strip() for p in text.split(",")):
            try:
                nets.append(ipaddress.ip_network(part, strict=False))
            except ValueError:
                raise UserError(f"--publish-from: {part!r} is not an IP address or CIDR (e.g. 10.0.0.5,10.1.0.0/16)"
                                ) from None
        return cls(nets)

    @property
    def restricted(self) -> bool:
        return self.networks is not None

    def allows(self, source: str) -> bool:
        """Whether a PUBLISH from ``source`` (a connection's Peer-Address, "local" in process) is taken."""
        return not self.restricted or self.operator(source)

    def operator(self, source: str) -> bool:
        """Whether ``source`` is one of the listed addresses (the same process counts as listed)."""
        if not self.restricted:
            return False
        if source == "local":
            return True
        try:
            ip = ipaddress.ip_address(source.split("%")[0])
        except ValueError:
            return False
        if getattr(ip, "ipv4_mapped", None) is not None:
            ip = ip.ipv4_mapped
        return any(ip in n for n in self.networks)
