"""The address of an existing Ray cluster to join (``--address``), checked before ``ray.init``.

``ray.init`` with the address of a cluster that is not there retries for
minutes (over 3 on our machines) before it fails; a quick TCP connection to
the head's GCS port tells the user at once.
"""

from __future__ import annotations

import socket

from kvserve.cluster.host_port import split_host_port

AUTO = "auto"
# NOTE: Ray Client addresses (ray://HOST:PORT) go to a proxy, not the GCS; they
# are passed on to ray.init unchecked.
RAY_CLIENT_PREFIX = "ray://"
PROBE_TIMEOUT_S = 5.0


def parse_gcs_address(address: str) -> tuple[str, int] | None:
    """``address``'s host and port, or ``None`` for ``auto`` and a Ray Client address.

    ``ValueError`` unless it is one of those or ``HOST:PORT`` (``[V6]:PORT`` for IPv6).
    """
    if address == AUTO or address.startswith(RAY_CLIENT_PREFIX):
        return None
    try:
        return split_host_port(address)
    except ValueError:
        raise ValueError(f"expected 'auto' or HOST:PORT (the head node's GCS address), got {address!r}") from None


def check_gcs_reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str, int] | None:
    """``address`` parsed (see ``parse_gcs_address``), once something accepts connections at its GCS port.

    ``ConnectionError`` when nothing does, ``ValueError`` for a malformed
    address; ``auto`` and Ray Client addresses are not checked (``ray.init``
    fails fast on those).
    """
    parsed = parse_gcs_address(address)
    if parsed is None:
        return None
    try:
        with socket.create_connection(parsed, timeout=timeout_s):
            pass
    except OSError as exc:  # socket.gaierror and timeouts included
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise ConnectionError(f"no Ray cluster at {address}: {reason}") from None
    return parsed
