"""``--address`` of a Ray cluster to join, and HOST:PORT parsing, checked before any slow start-up."""

from __future__ import annotations

import socket
import time

import pytest

from kvserve.cluster.host_port import split_host_port
from kvserve.cluster.ray_address import check_gcs_reachable, parse_gcs_address
from kvserve.worker.host_address import is_loopback


@pytest.mark.parametrize(
    "address, expected",
    [("127.0.0.1:6379", ("127.0.0.1", 6379)), ("head.example:1", ("head.example", 1)), ("[::1]:65535", ("::1", 65535))],
)
def test_host_port_is_split(address, expected):
    assert split_host_port(address) == expected


@pytest.mark.parametrize("address", ["head", "head:", ":6379", "head:0", "head:65536", "head:99999", "head:-1", "head:x"])
def test_a_bad_host_port_is_refused(address):
    with pytest.raises(ValueError, match="expected HOST:PORT with a port in 1..65535"):
        split_host_port(address)


def test_auto_and_ray_client_addresses_are_left_to_ray():
    assert parse_gcs_address("auto") is None
    assert parse_gcs_address("ray://head:10001") is None
    assert parse_gcs_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    with pytest.raises(ValueError, match="expected 'auto' or HOST:PORT"):
        parse_gcs_address("10.0.0.5")


def test_loopback_hosts_are_recognised():
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.5.0.1", "::1", "localhost"))
    assert not any(is_loopback(host) for host in ("10.0.0.5", "head.example", "0.0.0.0"))


def test_a_listening_gcs_port_passes():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert check_gcs_reachable(f"127.0.0.1:{port}") == ("127.0.0.1", port)
    assert check_gcs_reachable("auto") is None


def test_nothing_listening_is_a_connection_error_at_once():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens here once the socket closes
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no Ray cluster at 127.0.0.1:{port}: Connection refused"):
        check_gcs_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - start < 5.0


def test_an_unknown_host_is_a_connection_error():
    with pytest.raises(ConnectionError, match="no Ray cluster at no-such-host.invalid:6379"):
        check_gcs_reachable("no-such-host.invalid:6379")
