"""What the chaos script starts ``kvserve serve`` with: a self-signed TLS certificate and a token file."""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from pathlib import Path

TENANT_A, TENANT_B = "tenant-a", "tenant-b"


def write_self_signed_certificate(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for ``host`` (and ``localhost``), valid for a day, and its key: the PEM
    files ``cert.pem`` and ``key.pem`` in ``directory``.  Clients trust the certificate itself."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host)),
                                                    x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.touch(mode=0o600)
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))
    return cert_path, key_path


def write_token_file(path: Path) -> dict[str, str]:
    """An auth token file of one new token per tenant (``token tenant-name`` lines); returns tenant -> token."""
    tokens = {tenant: secrets.token_hex(16) for tenant in (TENANT_A, TENANT_B)}
    path.touch(mode=0o600)
    path.write_text("".join(f"{token} {tenant}\n" for tenant, token in tokens.items()))
    return tokens
