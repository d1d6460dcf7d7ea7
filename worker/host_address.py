"""Whether a host name or address stays on this machine: the loopback interface's."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IPv4 or IPv6 address, or ``localhost``) is a loopback address, which only
    this machine can reach; any other name is taken as reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
