"""Bearer-token authentication of the front doors, and the tenant each token stands for.

``kvserve serve --auth-token-file FILE``: one token per line, optionally followed by
the name of its tenant (``token tenant-name``); blank lines and ``#`` comments are
skipped.  A token without a name is a tenant of its own.  Every RPC but health, and
every HTTP request but ``/health``, must carry ``authorization: Bearer <token>``.

Tokens are compared in constant time, each against every known token, so that the
time of a refusal says nothing of how close a guess came.  The tenant then keys the
prefix cache (``tenant_cache_salt``): two tenants never share a cached block, so the
cached-token counts a client sees reveal nothing of another tenant's prompts.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

MAX_TOKEN_BYTES = 4096
_BEARER = "bearer "


class AuthenticationError(Exception):
    """A request without a valid bearer token."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a valid token belongs to."""

    name: str


class TokenTable:
    """The valid tokens and their tenants."""

    def __init__(self, tokens: dict[str, str]) -> None:
        if not tokens:
            raise ValueError("an auth token file must hold at least one token")
        self._tokens = [(token.encode(), Tenant(tenant)) for token, tenant in tokens.items()]

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        """Read ``path`` (module docstring); ``ValueError`` naming the line for a malformed one."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the auth token file {path}: {exc}") from None
        tokens: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) > 2:
                raise ValueError(f"{path}:{number}: expected 'token' or 'token tenant-name', got {len(fields)} fields")
            token = fields[0]
            if len(token) < 16:
                raise ValueError(f"{path}:{number}: a token must have at least 16 characters")
            if len(token.encode()) > MAX_TOKEN_BYTES:
                raise ValueError(f"{path}:{number}: a token may have at most {MAX_TOKEN_BYTES} bytes")
            if token in tokens:
                raise ValueError(f"{path}:{number}: the token is listed twice")
            # A token without a name is a tenant of its own, named by a digest (never the token itself).
            tokens[token] = fields[1] if len(fields) == 2 else "token-" + hashlib.sha256(token.encode()).hexdigest()[:16]
        return cls(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``authorization`` header value; ``AuthenticationError`` when it is not valid."""
        if not authorization or not authorization[: len(_BEARER)].lower() == _BEARER:
            raise AuthenticationError("missing 'authorization: Bearer <token>'")
        presented = authorization[len(_BEARER):].strip().encode()
        found: Tenant | None = None
        for token, tenant in self._tokens:  # every token, whatever matches: constant time in the table
            if hmac.compare_digest(token, presented):
                found = tenant
        if found is None:
            raise AuthenticationError("invalid bearer token")
        return found


def tenant_cache_salt(tenant: Tenant | None, cache_salt: str | None) -> str | None:
    """The cache salt a request is scheduled with: its tenant's, combined with the one it sent.

    Without authentication (``tenant`` None) the request's own salt, as sent.
    """
    if tenant is None:
        return cache_salt
    return f"tenant={tenant.name}\x00{cache_salt or ''}"
