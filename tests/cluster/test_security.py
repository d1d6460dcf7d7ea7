"""Authentication, TLS, tenant isolation and request limits on a live cluster (real Ray, gRPC, HTTP).

One cluster of a simulated replica (no model runs: steps take the cost model's time)
behind a server with an auth token file of two tenants and a TLS certificate signed
by a test CA, on both front doors.  Each tenant's share of the prefix cache is half of it
(``tenant_cache_share``).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import random
import re
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.client import Client, RequestError
from kvserve.cluster.config import ClusterConfig, ServerConfig
from kvserve.scheduler.engine_config import ParallelConfig
from kvserve.cluster.launcher import start_cluster
from kvserve.cluster.request_limits import RequestLimits
from kvserve.cluster.tls import TlsFiles
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulated_worker import SimulationConfig
from kvserve.worker.tiny_model import create_tiny_model
from tests.cluster.server_thread import ServerThread

ALICE, ALICE_AGAIN, BOB = "alice-token-00000000000001", "alice-token-00000000000002", "bob-token-0000000000000001"
PROMPT = list(range(10, 10 + 64))  # four blocks of 16


def _certificate(subject: str, issuer_key, public_key, issuer: str, *, ca: bool, ip: str | None = None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip)), x509.DNSName("localhost")]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, Path]:
    """A test CA, and a server certificate for 127.0.0.1 signed by it."""
    directory = tmp_path_factory.mktemp("tls")
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("kvserve test CA", ca_key, ca_key.public_key(), "kvserve test CA", ca=True)
    server = _certificate("127.0.0.1", ca_key, server_key.public_key(), "kvserve test CA", ca=False, ip="127.0.0.1")
    pem = serialization.Encoding.PEM
    (directory / "ca.pem").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(server.public_bytes(pem))
    (directory / "server.key").write_bytes(server_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))
    return TlsFiles(str(directory / "server.pem"), str(directory / "server.key")), directory / "ca.pem"


@pytest.fixture(scope="module")
def secured(ray_cluster, tmp_path_factory: pytest.TempPathFactory, tls_files) -> Iterator[tuple[ServerThread, Path, int]]:
    directory = tmp_path_factory.mktemp("secured")
    model_dir = create_tiny_model(directory / "model", "llama", seed=0)
    tokens = directory / "tokens"
    tokens.write_text(f"{ALICE} alice\n{ALICE_AGAIN} alice\n{BOB} bob\n")
    handle = start_cluster(ClusterConfig.from_kwargs(
        str(model_dir), parallel=ParallelConfig(num_replicas=1), block_size=16, num_blocks=256, tenant_cache_share=0.5,
        simulation=SimulationConfig(cost_model=StepCostModel(a=0.002, b=1e-5, c=1e-4, d=0.0), time_scale=1.0),
    ))
    tls, ca = tls_files
    server = None
    try:
        config = ServerConfig(
            port=0, http_port=0, auth_token_file=str(tokens), tls=tls, monitoring_tenants=("alice",),
            limits=RequestLimits(max_stop_token_ids=8, max_cache_salt_bytes=16),
        )
        server = ServerThread(handle, config)
        yield server, ca, server.start_http(config).port
    finally:
        if server is not None:
            server.stop()
        handle.shutdown()


def client(secured, token: str | None) -> Client:
    server, ca, _ = secured
    return Client(f"127.0.0.1:{server.server.port}", token=token, tls_ca=ca)


@pytest.mark.parametrize("token", [None, "not-a-token-of-ours-at-all"])
def test_a_call_without_a_valid_token_is_unauthenticated(secured, token, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.cluster.grpc_auth"), client(secured, token) as unauthenticated:
        for call in (lambda: unauthenticated.generate(PROMPT, max_tokens=2), unauthenticated.get_stats):
            with pytest.raises(RequestError) as info:
                call()
            assert info.value.code == "UNAUTHENTICATED"
    # Logged with the caller's address (it was not), and never with the token it sent.
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert [m.split(" from ")[0] for m in refusals] == [
        "refused /kvserve.v1.Generation/Generate", "refused /kvserve.v1.Generation/GetStats"
    ]
    assert all("127.0.0.1" in m for m in refusals)
    assert not any(token and token in r.getMessage() for r in caplog.records)


def test_a_generate_call_refused_for_its_token_is_counted_as_a_401(secured) -> None:
    # HTTP counted its 401s; gRPC's were refused before the front end and not counted.
    registry = secured[0].server.frontend.metrics.registry

    def refused() -> float:
        return registry.get_sample_value("kvserve_requests_total", {"code": "401"}) or 0.0

    before = refused()
    with client(secured, "not-a-token-of-ours-at-all") as unauthenticated:
        with pytest.raises(RequestError):
            unauthenticated.generate(PROMPT, max_tokens=2)
        assert refused() == before + 1
        with pytest.raises(RequestError):
            unauthenticated.get_stats()  # not a generation: not counted
        assert refused() == before + 1


def test_health_answers_without_a_token_over_tls(secured) -> None:
    server, ca, _ = secured
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{server.server.port}", credentials) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_a_plaintext_client_gets_nothing_from_the_tls_port(secured) -> None:
    server, _, _ = secured
    with grpc.insecure_channel(f"127.0.0.1:{server.server.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_two_tenants_never_share_cached_blocks_and_a_tenant_hits_its_own(secured) -> None:
    with client(secured, ALICE) as alice, client(secured, BOB) as bob, client(secured, ALICE_AGAIN) as alice_again:
        assert alice.generate(PROMPT, max_tokens=2).usage.cached_prompt_tokens == 0
        assert bob.generate(PROMPT, max_tokens=2).usage.cached_prompt_tokens == 0  # alice's blocks: not bob's
        # Her second token is the same tenant: her blocks (the last token is always recomputed).
        assert alice_again.generate(PROMPT, max_tokens=2).usage.cached_prompt_tokens == 48
        # A salt of the client's own splits a tenant's cache further.
        assert alice.generate(PROMPT, max_tokens=2, cache_salt="mine").usage.cached_prompt_tokens == 0


def test_one_tenant_s_flood_of_unique_prompts_leaves_another_tenant_s_prefix_cached(secured) -> None:
    # 20 unique prompts of 15 full blocks: 300 blocks through the 255 of the pool.  Past his
    # share, bob's requests take his own cached blocks: alice's survive (without the share, or
    # without the tenant reaching the scheduler, they would be evicted).
    flood = [[100 + i, *random.Random(i).choices(range(100, 1000), k=15 * 16 - 1)] for i in range(20)]
    with client(secured, ALICE) as alice, client(secured, BOB) as bob:
        alice.generate(PROMPT, max_tokens=2, cache_salt="flooded")
        for prompt in flood:
            bob.generate(prompt, max_tokens=1)
        assert alice.generate(PROMPT, max_tokens=2, cache_salt="flooded").usage.cached_prompt_tokens == 48
    # What each tenant holds is on /metrics, for a monitoring tenant (bob, past his share of 127 blocks,
    # recycles his own).
    _, ca, http_port = secured
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=30) as http:
        metrics = http.get(f"https://127.0.0.1:{http_port}/metrics", headers={"Authorization": f"Bearer {ALICE}"})
    cached = dict(re.findall(r'kvserve_tenant_cached_blocks\{replica="0",tenant="(\w+)"\} (\S+)', metrics.text))
    assert set(cached) == {"alice", "bob"}, metrics.text
    assert float(cached["alice"]) >= 3 and 127 <= float(cached["bob"]) <= 255 - 3


# Long enough to be still in flight while a test makes its other calls; each test closes it early.
IN_FLIGHT = dict(max_tokens=1500, ignore_eos=True)


def test_two_tenants_may_use_one_request_id_at_once(secured) -> None:
    with client(secured, ALICE) as alice, client(secured, BOB) as bob:
        alices = alice.stream(PROMPT, request_id="shared-id", **IN_FLIGHT)
        first = next(alices)
        bobs = bob.generate(PROMPT, max_tokens=2, request_id="shared-id")
        alices.close()

    assert first.request_id == bobs.request_id == "shared-id"
    assert bobs.finish_reason == "length"


def test_one_tenant_s_request_ids_in_flight_stay_unique_across_its_tokens(secured) -> None:
    with client(secured, ALICE) as alice, client(secured, ALICE_AGAIN) as alice_again:
        alices = alice.stream(PROMPT, request_id="alice-id", **IN_FLIGHT)
        next(alices)
        with pytest.raises(RequestError) as info:
            alice_again.generate(PROMPT, max_tokens=2, request_id="alice-id")
        alices.close()

    assert info.value.code == "ALREADY_EXISTS"
    assert info.value.message == "request_id 'alice-id' is already in flight"


def test_request_limits_are_refused_naming_the_limit(secured) -> None:
    with client(secured, ALICE) as alice:
        with pytest.raises(RequestError, match="max_stop_token_ids") as info:
            alice.generate(PROMPT, max_tokens=2, stop_token_ids=list(range(9)))
        assert info.value.code == "INVALID_ARGUMENT"
        with pytest.raises(RequestError, match="max_cache_salt_bytes"):
            alice.generate(PROMPT, max_tokens=2, cache_salt="x" * 17)


def test_http_needs_the_token_except_for_health_and_speaks_tls(secured, caplog) -> None:
    _, ca, http_port = secured
    base = f"https://127.0.0.1:{http_port}"
    caplog.set_level(logging.INFO, logger="kvserve.cluster.openai_api")
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=30) as http:
        assert http.get(f"{base}/health").status_code == 200
        assert http.get(f"{base}/health/", follow_redirects=True).status_code == 200
        refused = http.get(f"{base}/v1/models")
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["type"] == "authentication_error"
        wrong = http.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope-nope-nope-nope"})
        assert wrong.status_code == 401
        # HTTP's refusals were not logged at all; now with the client's address, never the token.
        refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused GET /v1/models")]
        assert len(refusals) == 2 and all(" from 127.0.0.1:" in m for m in refusals)
        assert not any("nope-nope" in r.getMessage() for r in caplog.records)
        models = http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {BOB}"})
        assert models.status_code == 200
        body = {"model": models.json()["data"][0]["id"], "prompt": PROMPT, "max_tokens": 2}
        first = http.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {BOB}"})
        assert first.status_code == 200, first.text


def test_kvserve_generate_sends_the_token_of_its_file_over_tls(secured, tmp_path, capsys) -> None:
    from kvserve.cli import main

    server, ca, _ = secured
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# mine\n{BOB} bob\n")
    target = ["generate", "hello", "--target", f"127.0.0.1:{server.server.port}", "--max-tokens", "2"]
    assert main([*target, "--auth-token-file", str(token_file), "--tls-ca", str(ca)]) == 0
    assert "completion 2 tokens" in capsys.readouterr().err
    assert main([*target, "--tls-ca", str(ca)]) == 1  # TLS without the token: refused
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main([*target, "--auth-token-file", str(token_file)]) == 1  # the token without TLS: no connection
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--auth-token-file", "missing"], "cannot read the auth token file"),
        (["--max-stop-token-ids", "0"], "--max-stop-token-ids must be a positive integer"),
    ],
)
def test_serve_refuses_bad_security_flags_before_starting_anything(flags, message, capsys) -> None:
    from kvserve.cli import main

    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_request_id_that_could_forge_a_log_line_is_refused_naming_the_field(secured) -> None:
    with client(secured, ALICE) as alice:
        with pytest.raises(RequestError) as info:
            alice.generate(PROMPT, max_tokens=2, request_id="ok\n2026-01-01 INFO forged")
    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.message.startswith("request_id has a control or format character (U+000A at character 3)")
