"""TLS for the front doors: a certificate and key, and optionally the CA that client certificates need.

The files are checked with Python's ``ssl`` before use (``check_key_pair``, ``check_ca_file``):
grpc takes any bytes and fails later with a message that names no file ("Failed to bind"
at the server, "Failed to create security handshaker" at the client).  The checks name the
file and the reason: not PEM, an encrypted key, a key that is not the certificate's, a CA
file without a certificate.  The names in their messages are the caller's (a field or a flag).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PEM_PRIVATE_KEY = b"PRIVATE KEY-----"
# What OpenSSL's reasons mean for these files.
_SSL_REASONS = {
    "KEY_VALUES_MISMATCH": "the private key does not belong to the certificate",
    "NO_CERTIFICATE_OR_CRL_FOUND": "holds no certificate",
}


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the server's certificate chain and private key; ``client_ca``: require client
    certificates signed by it (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert", "key", "client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls_{name}: no such file: {path}")

    def check(self) -> None:
        """``ValueError`` naming the file (``tls_cert: PATH: reason``) unless Python's ``ssl`` serves with them."""
        check_key_pair(self.cert, self.key, cert_name="tls_cert", key_name="tls_key")
        if self.client_ca is not None:
            check_ca_file(self.client_ca, name="tls_client_ca")

    def server_credentials(self) -> grpc.ServerCredentials:
        """The gRPC server's credentials; ``ValueError`` when a file cannot be read or used (``check``)."""
        self.check()
        client_ca = _read(self.client_ca, "tls_client_ca") if self.client_ca is not None else None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "tls_key"), _read(self.cert, "tls_cert"))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """The same for uvicorn (the HTTP server)."""
        options: dict[str, Any] = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca is not None:
            options.update(ssl_ca_certs=self.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


class _EncryptedKey(Exception):
    """The private key asked for a password (raised by the password callback instead of a prompt)."""


def check_key_pair(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], *, cert_name: str, key_name: str
) -> tuple[bytes, bytes]:
    """The bytes of a PEM certificate chain and of its private key, checked to load together in ``ssl``.

    ``ValueError`` as ``{name}: {path}: {reason}``, ``name`` being ``cert_name`` or ``key_name``.
    """
    cert_pem = _read(cert, cert_name)
    key_pem = _read(key, key_name)
    if _PEM_CERTIFICATE not in cert_pem:
        raise ValueError(f"{cert_name}: {os.fspath(cert)}: not a PEM certificate ({_PEM_CERTIFICATE.decode()} ...)")
    if _PEM_PRIVATE_KEY not in key_pem:
        raise ValueError(f"{key_name}: {os.fspath(key)}: not a PEM private key (-----BEGIN ... PRIVATE KEY-----)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=_refuse_password)
    except _EncryptedKey:
        raise ValueError(
            f"{key_name}: {os.fspath(key)}: the private key is encrypted; gRPC needs it unencrypted "
            f"(e.g. `openssl pkey -in KEY -out KEY.plain`, then restrict its mode to 0600)"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"{key_name}: {os.fspath(key)}: {_SSL_REASONS[exc.reason]} in {cert_name} {os.fspath(cert)}"
            ) from None
        # Both files have PEM markers, so OpenSSL's bare "PEM lib" means a damaged PEM body.
        raise ValueError(
            f"{cert_name} {os.fspath(cert)} and {key_name} {os.fspath(key)}: cannot load them as a "
            f"PEM certificate chain and its private key ({_ssl_reason(exc)})"
        ) from None
    return cert_pem, key_pem


def check_ca_file(path: str | os.PathLike[str], *, name: str) -> bytes:
    """The bytes of a PEM CA file, checked to hold a certificate that ``ssl`` loads; ``ValueError`` naming it."""
    pem = _read(path, name)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=os.fspath(path))
    except ssl.SSLError as exc:
        raise ValueError(f"{name}: {os.fspath(path)}: {_ssl_reason(exc)} (expected PEM CA certificates)") from None
    return pem


def _refuse_password() -> str:
    raise _EncryptedKey


def _ssl_reason(error: ssl.SSLError) -> str:
    return _SSL_REASONS.get(error.reason or "", error.reason or str(error))


def _read(path: str | os.PathLike[str], name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {os.fspath(path)}: {exc.strerror or exc}") from None
