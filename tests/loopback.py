"""A free port on 127.0.0.1, for a test's server or rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that nothing listened on when asked (bound, then closed at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
