"""``kvserve serve``'s authentication and TLS: their flags, the TLS files they name, and
what start-up warns of (bearer tokens in clear text, secret files open to others)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.cluster.auth import MIN_TOKEN_CHARS

if TYPE_CHECKING:
    from kvserve.cluster.config import ServerConfig
    from kvserve.cluster.tls import TlsFiles



def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the token file, the monitoring tenants and TLS."""
    security = parser.add_argument_group("authentication and TLS (both front doors)")
    security.add_argument(
        "--auth-token-file", type=Path, default=None, metavar="FILE",
        help="require 'authorization: Bearer <token>' on every call but health: one token per line, optionally "
        f"'token tenant-name', each token at least {MIN_TOKEN_CHARS} characters long (e.g. from "
        "`openssl rand -hex 24`) of A-Z a-z 0-9 - . _ ~ + / (then = padding); '#' starts a comment at the "
        "start of a line or after whitespace; each tenant gets a prefix cache of its own, and a token without "
        "a name is a tenant of its own named line-N by its line; read at start-up only (default: no "
        "authentication; binding a non-loopback --host without it logs a warning)",
    )
    security.add_argument(
        "--monitoring-tenant", action="append", default=[], metavar="NAME", dest="monitoring_tenants",
        help="with --auth-token-file: only tokens of tenant NAME (repeatable) may read GetStats and /metrics, "
        "the cluster-wide figures; others get PERMISSION_DENIED / HTTP 403 (default: every tenant's token may).  "
        "Figures per tenant (kvserve_tenant_cached_blocks) only these tenants read (default: no one)",
    )
    security.add_argument("--tls-cert", type=Path, default=None, metavar="FILE", help="serve TLS with this PEM certificate chain")
    security.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    security.add_argument(
        "--tls-client-ca", type=Path, default=None, metavar="FILE",
        help="with --tls-cert: require client certificates signed by this PEM CA (mutual TLS)",
    )


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """``--tls-cert``/``--tls-key``/``--tls-client-ca`` as ``TlsFiles``; ``ValueError`` for a partial set."""
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    from kvserve.cluster.tls import TlsFiles, check_ca_file, check_key_pair

    try:
        tls = TlsFiles(
            str(args.tls_cert), str(args.tls_key), None if args.tls_client_ca is None else str(args.tls_client_ca)
        )
    except ValueError as exc:
        raise ValueError(f"--{str(exc).replace('_', '-', 1)}") from None
    # NOTE: grpc took files it could not use, and the server failed only after the
    # cluster's start-up, with "cannot listen on ...: Failed to bind".
    check_key_pair(tls.cert, tls.key, cert_name="--tls-cert", key_name="--tls-key")
    if tls.client_ca is not None:
        check_ca_file(tls.client_ca, name="--tls-client-ca")
    return tls


def security_warnings(config: ServerConfig) -> list[str]:
    """What ``config`` exposes that start-up should warn of (warnings, not errors: the
    operator may know better): bearer tokens in clear text off this machine, and
    secret files that others on this machine may read."""
    warnings = []
    if not config.is_loopback and config.auth_token_file is not None and config.tls is None:
        warnings.append(
            f"--host {config.host} with --auth-token-file but without --tls-cert: bearer tokens travel in "
            "clear text, and anyone on the network path can read and replay them"
        )
    secrets = [("--auth-token-file", config.auth_token_file), ("--tls-key", config.tls.key if config.tls else None)]
    for flag, path in secrets:
        if path is not None and _readable_by_others(path):
            warnings.append(
                f"{flag} {path} is open to group or others (mode {_mode(path):o}, a secret's is 600): chmod 600 it"
            )
    return warnings


def _readable_by_others(path: str) -> bool:
    try:
        return _mode(path) & 0o077 != 0
    except OSError:
        return False  # the file's own reading tells what is wrong with it


def _mode(path: str) -> int:
    return os.stat(path).st_mode & 0o777
