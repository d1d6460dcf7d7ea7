"""What ``kvserve serve`` warns of at start-up: bearer tokens in clear text, and secret files open to others."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.cluster.cli_serve_security import security_warnings
from kvserve.cluster.config import ServerConfig
from kvserve.cluster.tls import TlsFiles

TOKEN = "alice-token-0123456789"


def _secret(path: Path, mode: int) -> str:
    path.write_text(f"{TOKEN}\n")
    path.chmod(mode)
    return str(path)


def test_tokens_without_tls_on_a_non_loopback_host_are_warned_of(tmp_path) -> None:
    tokens = _secret(tmp_path / "tokens", 0o600)
    [warning] = security_warnings(ServerConfig(host="0.0.0.0", auth_token_file=tokens))
    assert warning.startswith("--host 0.0.0.0 with --auth-token-file but without --tls-cert: bearer tokens travel in clear")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_tokens_without_tls_on_loopback_are_not_warned_of(tmp_path, host) -> None:
    assert security_warnings(ServerConfig(host=host, auth_token_file=_secret(tmp_path / "tokens", 0o600))) == []


def test_tokens_with_tls_on_a_non_loopback_host_are_not_warned_of(tmp_path) -> None:
    tls = TlsFiles(_secret(tmp_path / "cert.pem", 0o644), _secret(tmp_path / "key.pem", 0o600))
    tokens = _secret(tmp_path / "tokens", 0o600)
    assert security_warnings(ServerConfig(host="0.0.0.0", auth_token_file=tokens, tls=tls)) == []


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o700 | 0o001])
def test_a_token_file_or_tls_key_open_to_others_is_warned_of_by_name(tmp_path, mode) -> None:
    tokens = _secret(tmp_path / "tokens", mode)
    key = _secret(tmp_path / "key.pem", mode)
    tls = TlsFiles(_secret(tmp_path / "cert.pem", 0o644), key)  # a certificate is public: no warning
    warnings = security_warnings(ServerConfig(auth_token_file=tokens, tls=tls))
    assert warnings == [
        f"--auth-token-file {tokens} is open to group or others (mode {mode:o}, a secret's is 600): chmod 600 it",
        f"--tls-key {key} is open to group or others (mode {mode:o}, a secret's is 600): chmod 600 it",
    ]


def test_serve_logs_the_warnings_before_anything_starts_once_each(tmp_path, capsys, caplog) -> None:
    tokens = _secret(tmp_path / "tokens", 0o644)
    # A missing model directory ends the run before Ray starts, after the warnings.
    flags = ["--host", "0.0.0.0", "--auth-token-file", tokens, "--model", str(tmp_path / "no-model")]
    with caplog.at_level(logging.WARNING):
        assert main(["serve", *flags]) == 2
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert [w for w in warnings if w.startswith("--host 0.0.0.0 with --auth-token-file but without --tls-cert")]
    assert [w for w in warnings if w.startswith(f"--auth-token-file {tokens} is open to group or others (mode 644")]
    # Not printed as progress lines too: one line for each (the log's, which --log-level governs).
    assert "WARNING" not in capsys.readouterr().out
