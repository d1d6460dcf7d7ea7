"""TLS files checked before use (server and client), and client certificates for mutual TLS.

In process: a test CA, a server certificate for 127.0.0.1 and a client certificate signed
by it, and grpc servers that require client certificates as ``--tls-client-ca`` makes serve's.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvserve.client import AsyncClient, Client, RequestError
from kvserve.cli import main
from kvserve.cluster.config import ServerConfig
from kvserve.cluster.serve_runtime import api_url
from kvserve.cluster.server import add_port
from kvserve.cluster.tls import TlsFiles
from kvserve.proto import generate_pb2, generate_pb2_grpc
from tests.cluster.test_security import _certificate as security_certificate

_PEM = serialization.Encoding.PEM


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate for 127.0.0.1 and a client certificate signed by it,
    their keys, a key of neither, and an encrypted copy of the client's key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_key: Path
    encrypted_key: Path


def _certificate(subject: str, key, ca_key, *, ca: bool) -> x509.Certificate:
    """Signed by the test CA; a leaf one names 127.0.0.1 and localhost (test_security's certificates)."""
    return security_certificate(
        subject, ca_key, key.public_key(), "kvserve test CA", ca=ca, ip=None if ca else "127.0.0.1"
    )


def _write_key(path: Path, key, encryption=None) -> Path:
    path.write_bytes(key.private_bytes(
        _PEM, serialization.PrivateFormat.PKCS8, encryption or serialization.NoEncryption()
    ))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca_key, server_key, client_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    certificates = {
        "ca.pem": _certificate("kvserve test CA", ca_key, ca_key, ca=True),
        "server.pem": _certificate("127.0.0.1", server_key, ca_key, ca=False),
        "client.pem": _certificate("a client", client_key, ca_key, ca=False),
    }
    for name, certificate in certificates.items():
        (directory / name).write_bytes(certificate.public_bytes(_PEM))
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=_write_key(directory / "server.key", server_key),
        client_cert=directory / "client.pem",
        client_key=_write_key(directory / "client.key", client_key),
        other_key=_write_key(directory / "other.key", other_key),
        encrypted_key=_write_key(
            directory / "encrypted.key", client_key, serialization.BestAvailableEncryption(b"secret")
        ),
    )


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- the server's files ---------------------------------------------------------


def test_the_server_s_files_pass_the_check(pki) -> None:
    TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)).check()


def test_a_key_that_is_not_the_certificate_s_is_refused_naming_both(pki) -> None:
    with pytest.raises(ValueError) as info:
        TlsFiles(str(pki.server_cert), str(pki.other_key)).server_credentials()
    assert str(info.value) == (
        f"tls_key: {pki.other_key}: the private key does not belong to the certificate in tls_cert {pki.server_cert}"
    )


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (lambda pki, tmp: (_written(tmp / "c.pem", "junk\n"), pki.server_key, None),
         "tls_cert: {0}: not a PEM certificate (-----BEGIN CERTIFICATE----- ...)"),
        (lambda pki, tmp: (pki.server_cert, pki.server_cert, None),
         "tls_key: {1}: not a PEM private key (-----BEGIN ... PRIVATE KEY-----)"),
        (lambda pki, tmp: (pki.server_cert, pki.server_key, pki.server_key),
         "tls_client_ca: {2}: holds no certificate (expected PEM CA certificates)"),
        (lambda pki, tmp: (pki.client_cert, pki.encrypted_key, None),
         "tls_key: {1}: the private key is encrypted; gRPC needs it unencrypted"),
    ],
)
def test_an_unusable_tls_file_is_refused_with_the_reason_and_its_name(pki, tmp_path, files, message) -> None:
    paths = files(pki, tmp_path)
    with pytest.raises(ValueError) as info:
        TlsFiles(*(None if path is None else str(path) for path in paths)).check()
    assert str(info.value).startswith(message.format(*paths))


def test_serve_refuses_mismatched_tls_files_before_starting_anything(pki, capsys) -> None:
    # They passed, and the cluster started, then died with "cannot listen on ...: Failed to bind".
    assert main(["serve", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.other_key)]) == 2
    assert capsys.readouterr().err == (
        f"kvserve serve: error: --tls-key: {pki.other_key}: the private key does not belong to the "
        f"certificate in --tls-cert {pki.server_cert}\n"
    )


def test_serve_refuses_a_client_ca_file_without_a_certificate(pki, capsys) -> None:
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.server_key)]
    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err == (
        f"kvserve serve: error: --tls-client-ca: {pki.server_key}: holds no certificate (expected PEM CA certificates)\n"
    )


def test_a_failed_bind_with_tls_on_names_the_tls_files_as_a_possible_cause(pki) -> None:
    async def bind(config: ServerConfig, credentials) -> str:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        try:
            with pytest.raises(RuntimeError) as info:
                add_port(server, config, credentials)
        finally:
            await server.stop(None)
        return str(info.value)

    tls = TlsFiles(str(pki.server_cert), str(pki.server_key))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        secure = asyncio.run(bind(ServerConfig(port=port, tls=tls), tls.server_credentials()))
        plain = asyncio.run(bind(ServerConfig(port=port), None))
    assert secure.startswith(f"cannot listen on 127.0.0.1:{port}")
    assert f"or grpc could not use the TLS credentials: certificate {pki.server_cert}, key {pki.server_key}" in secure
    assert plain.startswith(f"cannot listen on 127.0.0.1:{port}") and "TLS" not in plain


def test_the_api_url_printed_at_start_up_is_https_with_tls_on(pki) -> None:
    tls = TlsFiles(str(pki.server_cert), str(pki.server_key))
    assert api_url(ServerConfig(host="0.0.0.0", tls=tls), 8000) == "https://0.0.0.0:8000/v1"
    assert api_url(ServerConfig(host="::1"), 8001) == "http://[::1]:8001/v1"


# -- client certificates ----------------------------------------------------------


class _StandIn(generate_pb2_grpc.GenerationServicer):
    def GetStats(self, request, context):  # noqa: N802 - the gRPC method's name
        return generate_pb2.GetStatsResponse()

    def Generate(self, request, context):  # noqa: N802
        usage = generate_pb2.Usage(prompt_tokens=1, completion_tokens=1, cached_prompt_tokens=0)
        yield generate_pb2.GenerateResponse(
            request_id="r", text="Hello", token_ids=[7], replica=0,
            finish_reason=generate_pb2.FINISH_REASON_LENGTH, usage=usage,
        )


@pytest.fixture(scope="module")
def mutual_tls_target(pki) -> Iterator[str]:
    """A server that requires client certificates signed by the test CA, as serve --tls-client-ca does."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_GenerationServicer_to_server(_StandIn(), server)
    tls = TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_a_client_presents_its_certificate_to_a_server_that_requires_one(pki, mutual_tls_target) -> None:
    with Client(mutual_tls_target, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key) as client:
        assert client.get_stats(timeout=10) == ()


def test_a_client_without_a_certificate_is_refused_by_such_a_server(pki, mutual_tls_target) -> None:
    with Client(mutual_tls_target, tls_ca=pki.ca) as client:
        with pytest.raises(RequestError) as info:
            client.get_stats(timeout=10)
    assert info.value.code == "UNAVAILABLE"


def test_an_async_client_presents_its_certificate_too(pki, mutual_tls_target) -> None:
    async def stats():
        async with AsyncClient(
            mutual_tls_target, tls_ca=pki.ca, tls_cert=str(pki.client_cert), tls_key=str(pki.client_key)
        ) as client:
            return await client.get_stats(timeout=10)

    assert asyncio.run(stats()) == ()


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (lambda pki: dict(tls_cert=pki.client_cert), "tls_cert and tls_key go together"),
        (lambda pki: dict(tls_key=pki.client_key), "tls_cert and tls_key go together"),
        (lambda pki: dict(tls_cert=pki.client_cert, tls_key=pki.other_key),
         "tls_key: {other_key}: the private key does not belong to the certificate in tls_cert {client_cert}"),
        (lambda pki: dict(tls_cert=pki.client_key, tls_key=pki.client_key),
         "tls_cert: {client_key}: not a PEM certificate"),
        (lambda pki: dict(tls_cert=pki.client_cert, tls_key=pki.client_cert.parent / "missing.key"),
         "tls_key: cannot read {missing}: No such file or directory"),
    ],
)
def test_a_bad_client_certificate_or_key_is_refused_when_the_client_is_made(pki, files, message) -> None:
    names = dict(
        other_key=pki.other_key, client_cert=pki.client_cert, client_key=pki.client_key,
        missing=pki.client_cert.parent / "missing.key",
    )
    with pytest.raises(ValueError) as info:
        Client("127.0.0.1:1", tls_ca=pki.ca, **files(pki))
    assert str(info.value).startswith(message.format(**names))


def test_kvserve_generate_presents_a_client_certificate(pki, mutual_tls_target, capsys) -> None:
    flags = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    assert main(["generate", "--timeout", "10", "--target", mutual_tls_target, *flags, "hi"]) == 0
    assert capsys.readouterr().out == "Hello\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (lambda pki: ["--tls-cert", str(pki.client_cert)], "--tls-cert and --tls-key go together"),
        (lambda pki: ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.other_key)],
         "--tls-key: {other_key}: the private key does not belong to the certificate in --tls-cert {client_cert}"),
    ],
)
def test_kvserve_generate_refuses_a_bad_client_certificate_naming_the_flag(pki, capsys, flags, message) -> None:
    assert main(["generate", *flags(pki), "hi"]) == 2
    expected = message.format(other_key=pki.other_key, client_cert=pki.client_cert)
    assert capsys.readouterr().err == f"kvserve generate: error: {expected}\n"
