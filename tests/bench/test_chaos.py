"""``bench.chaos``'s pieces: its flags and help, its table, the certificate and token file serve gets,
the endpoint that carries a tenant's token over TLS, the timing of a replica's outage, and the Ray
driver that kills serve's actors by name.  The whole run (minutes against ``kvserve serve
--replicas 2 --tp 2`` on CPU) is run by hand: ``python -m kvserve.bench.chaos``."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2_grpc

from kvserve.bench import chaos
from kvserve.bench.chaos import (
    EXIT_LIMIT_S, KILLED_BY_NAME, KILLED_BY_PID, Check, health_status, parse_args, replica_outage, stats_code, table,
)
from kvserve.bench.chaos_credentials import write_self_signed_certificate, write_token_file
from kvserve.bench.fault_streams import Endpoint
from kvserve.bench.serve_process import RayDriver, ServeProcess
from kvserve.cluster.auth import TokenTable
from kvserve.cluster.grpc_auth import BearerTokenInterceptor
from kvserve.cluster.scheduler_actor import SCHEDULER_ACTOR_NAME
from kvserve.cluster.worker_actor import worker_actor_name
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.worker.tiny_model import create_tiny_model


def test_the_flags_default_to_a_run_of_a_few_minutes() -> None:
    args = parse_args([])
    assert (args.streams, args.max_tokens, args.fuzz_requests, args.good_streams, args.recovery_timeout,
            args.seed) == (12, 32, 100, 4, 60.0, 0)


@pytest.mark.parametrize("flags", [["--streams", "2"], ["--max-tokens", "0"], ["--fuzz-requests", "many"],
                                   ["--recovery-timeout", "0"], ["--recovery-timeout", "601"]])
def test_a_bad_flag_is_a_usage_error(flags, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(flags)
    assert info.value.code == 2
    assert "error: " in capsys.readouterr().err


def test_the_help_names_every_scenario_the_actors_it_kills_and_the_exit_codes(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("1. auth:", "2. tenants:", "3. worker kill by name:", "4. worker kill by PID:", "5. fuzz:",
                  "6. scheduler kill by name:", "Exits 1 when a check failed or was not exercised, or serve or the Ray driver could not start, 2 on bad flags",
                  worker_actor_name(*KILLED_BY_NAME), worker_actor_name(*KILLED_BY_PID), SCHEDULER_ACTOR_NAME,
                  f"serve exits non-zero within {EXIT_LIMIT_S:g} s"):
        assert words in text


def test_the_table_marks_failed_checks_and_rows_that_count_no_requests() -> None:
    text = table([
        Check("1. auth: no token", 2, 2, "UNAUTHENTICATED", "UNAUTHENTICATED 2", True),
        Check("6. scheduler kill by name: serve", None, None, "exits non-zero", "still running", False),
    ])
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()]
    assert rows[0] == ["scenario", "sent", "ok", "expected", "observed", "result"]
    assert rows[2] == ["1. auth: no token", "2", "2", "UNAUTHENTICATED", "UNAUTHENTICATED 2", "pass"]
    assert rows[3] == ["6. scheduler kill by name: serve", "-", "-", "exits non-zero", "still running", "FAIL"]


def test_a_check_that_sent_nothing_is_not_exercised_and_does_not_pass() -> None:
    # --fuzz-requests 5 sends every bad kind before any odd one: the odd check has nothing to count.
    idle = Check("5. fuzz: odd, valid requests", 0, 0, "OK, the plain request's tokens", "", True)
    assert idle.result == "NOT EXERCISED"
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table([idle]).splitlines()]
    assert rows[2][-1] == "NOT EXERCISED"
    # A check that counts no requests (sent None) is judged on what it observed.
    assert Check("6. scheduler kill by name: serve", None, None, "exits", "exit code 1", True).result == "pass"


def test_the_certificate_is_its_own_issuer_for_loopback_and_the_key_is_private(tmp_path) -> None:
    cert, key = write_self_signed_certificate(tmp_path)
    certificate = x509.load_pem_x509_certificate(cert.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert certificate.issuer == certificate.subject
    assert key.stat().st_mode & 0o077 == 0


def test_the_token_file_gives_each_tenant_a_token_of_its_own(tmp_path) -> None:
    tokens = write_token_file(tmp_path / "tokens")
    known = TokenTable.from_file(tmp_path / "tokens")
    assert {tenant: known.authenticate(f"Bearer {token}").name for tenant, token in tokens.items()} == {
        "tenant-a": "tenant-a", "tenant-b": "tenant-b",
    }
    assert (tmp_path / "tokens").stat().st_mode & 0o077 == 0


class _NoReplicas(generate_pb2_grpc.GenerationServicer):
    async def GetStats(self, request, context):
        return generate_pb2.GetStatsResponse()


def test_an_endpoint_carries_its_token_over_tls_and_a_plaintext_client_gets_nothing(tmp_path: Path) -> None:
    # The server checks tokens as serve's does; health needs none.
    cert, key = write_self_signed_certificate(tmp_path)
    tokens = write_token_file(tmp_path / "tokens")

    async def calls() -> dict[str, str]:
        server = grpc.aio.server(interceptors=[BearerTokenInterceptor(TokenTable.from_file(tmp_path / "tokens"))])
        generate_pb2_grpc.add_GenerationServicer_to_server(_NoReplicas(), server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port(
            "127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        )
        await server.start()
        target, root = f"127.0.0.1:{port}", cert.read_bytes()
        codes = {}
        try:
            for label, token in (("tenant-b", tokens["tenant-b"]), ("no token", None), ("wrong", "w" * 32)):
                async with Endpoint(target, root, token).channel() as channel:
                    codes[label] = await stats_code(generate_pb2_grpc.GenerationStub(channel))
            async with Endpoint(target, root).channel() as channel:
                codes["health"] = await health_status(channel)
            async with Endpoint(target).channel() as channel:
                codes["plaintext health"] = await health_status(channel)
        finally:
            await server.stop(0)
        return codes

    assert asyncio.run(calls()) == {"tenant-b": "OK", "no token": "UNAUTHENTICATED", "wrong": "UNAUTHENTICATED",
                                    "health": "SERVING", "plaintext health": "UNAVAILABLE"}


def test_an_endpoint_never_sends_a_token_in_plaintext() -> None:
    with pytest.raises(ValueError, match="over TLS only"):
        Endpoint("127.0.0.1:50051", token="t" * 32)


class _Replicas:
    """A stub whose GetStats says replica 1 is healthy as ``healthy`` says, one answer per call (the last repeats)."""

    def __init__(self, healthy: list[bool]) -> None:
        self._healthy = healthy
        self._calls = 0

    async def GetStats(self, request, timeout):
        healthy = self._healthy[min(self._calls, len(self._healthy) - 1)]
        self._calls += 1
        return generate_pb2.GetStatsResponse(replicas=[
            generate_pb2.ReplicaStats(replica=0, healthy=True), generate_pb2.ReplicaStats(replica=1, healthy=healthy),
        ])


@pytest.fixture
def fast_polls(monkeypatch) -> None:
    monkeypatch.setattr(chaos, "POLL_S", 0.01)


def test_an_outage_lasts_from_a_replica_down_until_every_replica_is_healthy_again(fast_polls) -> None:
    down_s, back_s = asyncio.run(replica_outage(_Replicas([True, False, False, True]), time.monotonic(), 5.0))
    assert down_s is not None and back_s is not None and 0 <= down_s < back_s < 5.0


def test_all_replicas_healthy_all_along_is_no_recovery(fast_polls) -> None:
    # A kill the scheduler never noticed: "healthy" alone proves nothing.
    assert asyncio.run(replica_outage(_Replicas([True]), time.monotonic(), 0.2)) == (None, None)


def test_a_replica_down_until_the_timeout_never_came_back(fast_polls) -> None:
    down_s, back_s = asyncio.run(replica_outage(_Replicas([False]), time.monotonic(), 0.2))
    assert down_s is not None and back_s is None


@pytest.mark.slow
def test_the_ray_driver_finds_a_workers_process_and_kills_the_scheduler_by_name(tmp_path) -> None:
    # A simulated replica (no model runs): serve's Ray instance and actors as chaos meets them.
    model_dir = create_tiny_model(tmp_path / "model", "llama", seed=0)
    with ServeProcess(["--model", str(model_dir), "--simulated", "--num-blocks", "64", "--host", "127.0.0.1",
                       "--port", "0", "--no-http"]) as serve:
        serve.wait_for_port()
        driver = RayDriver(serve.ray_address())

        async def worker_pid() -> int:
            await driver.ping()
            return await driver.pid(worker_actor_name(0, 0))

        try:
            assert "WorkerActor" in dict(serve.session_processes())[asyncio.run(worker_pid())]
            asyncio.run(driver.kill(SCHEDULER_ACTOR_NAME))
            assert serve.proc.wait(timeout=60) == 1
        finally:
            driver.close()
        assert any("the scheduler actor died" in line for line in serve.output)
