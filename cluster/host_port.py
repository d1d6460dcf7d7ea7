"""``HOST:PORT`` addresses given on the command line, and gRPC targets."""

from __future__ import annotations

# The schemes of gRPC's name resolvers: a target that starts with one is passed to gRPC as it is.
GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")


def check_grpc_target(target: str) -> str:
    """``target`` if it is ``HOST:PORT`` or starts with a resolver's scheme (``GRPC_SCHEMES``), passed on
    as is; ``ValueError`` otherwise, a URL's (``http://HOST:PORT``) saying so.

    NOTE: a URL would pass ``split_host_port`` (its host "http://HOST"), and grpc took it for a host
    name, failing only at the first call, as an unreachable server.
    """
    if target.startswith(GRPC_SCHEMES):  # dns:///host:port is a gRPC target
        scheme, _, address = target.partition(":")
        if not address.strip("/"):  # grpc: "empty address list", at the first call
            raise ValueError(f"expected an address after {scheme + ':'!r}, got {target!r}")
        return target
    if "://" in target:
        raise ValueError(f"expected the server's HOST:PORT, not a URL: got {target!r}")
    split_host_port(target)
    return target


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) as ``(host, port)``.

    ``ValueError`` unless the host is not empty and the port is in 1..65535
    (a larger one would wrap around to another port in the C libraries).
    """
    host, sep, port_text = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {address!r}")
    return host, int(port_text)
