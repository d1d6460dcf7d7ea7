"""TLS for the front doors: a certificate and key, and optionally the CA that client certificates need."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


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

    def server_credentials(self) -> grpc.ServerCredentials:
        """The gRPC server's credentials; ``ValueError`` when a file cannot be read."""
        client_ca = _read(self.client_ca) if self.client_ca is not None else None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """The same for uvicorn (the HTTP server)."""
        options: dict[str, Any] = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca is not None:
            options.update(ssl_ca_certs=self.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
