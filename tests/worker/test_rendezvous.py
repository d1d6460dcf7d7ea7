"""The ranks' tcp:// rendezvous: a store on the given host only, which every rank shares."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from kvserve.worker.distributed import loopback_interface_settings, rendezvous_store
from tests.loopback import free_port

TIMEOUT = timedelta(seconds=10)


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* has them) that listen on ``port`` (IPv4 and IPv6)."""
    addresses = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, local_port = local.split(":")
            if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                addresses.add(address)
    return addresses


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/net/tcp")
def test_rank_0_serves_the_store_on_its_host_only_and_the_other_ranks_share_it() -> None:
    # torch's own tcp:// rendezvous listened on every interface ('*:PORT') for a
    # server that serves 127.0.0.1 only.
    port = free_port()
    master = rendezvous_store(f"tcp://127.0.0.1:{port}", 0, 1, TIMEOUT)

    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1
    other = rendezvous_store(f"tcp://127.0.0.1:{port}", 1, 2, TIMEOUT)
    master.set("rank0", "here")
    assert other.get("rank0") == b"here"


def test_a_rendezvous_without_a_port_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"a tcp:// rendezvous needs a host and a port, got 'tcp://127.0.0.1'"):
        rendezvous_store("tcp://127.0.0.1", 0, 1, TIMEOUT)


def test_a_taken_port_is_an_error_of_rank_0() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError):
            rendezvous_store(f"tcp://127.0.0.1:{taken.getsockname()[1]}", 0, 1, TIMEOUT)


def test_a_loopback_rendezvous_keeps_each_backends_connections_on_loopback() -> None:
    assert loopback_interface_settings("127.0.0.1", "gloo", {}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert loopback_interface_settings("localhost", "gloo", {}) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert loopback_interface_settings("::1", "nccl", {}) == {"NCCL_SOCKET_IFNAME": "=lo"}


def test_a_network_rendezvous_or_an_interface_the_user_chose_is_left_alone() -> None:
    assert loopback_interface_settings("10.0.0.7", "gloo", {}) == {}
    assert loopback_interface_settings("head-node", "nccl", {}) == {}
    assert loopback_interface_settings("127.0.0.1", "gloo", {"GLOO_SOCKET_IFNAME": "eth0"}) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux interface name")
def test_two_gloo_ranks_meeting_on_loopback_choose_the_loopback_interface(tmp_path: Path) -> None:
    # gloo left alone listens on the address of the host name, which is the network's on most
    # machines (this one resolves it to 127.0.0.1, so the variable is what can be checked here).
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, torch\n"
        "from kvserve.worker.distributed import init_distributed\n"
        "tp = init_distributed(int(sys.argv[1]), 2, sys.argv[2], backend='gloo', timeout_s=30)\n"
        "print(os.environ.get('GLOO_SOCKET_IFNAME'), tp.all_reduce(torch.ones(1)).item(), flush=True)\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), init_method], env=environ, stdout=subprocess.PIPE, text=True
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert outputs == ["lo 2.0\n", "lo 2.0\n"]
