"""Bearer-token authentication of the front doors, and the tenant each token stands for.

``kvserve serve --auth-token-file FILE`` (``read_token_file``): one token per line,
optionally followed by the name of its tenant after spaces or tabs (``token tenant-name``).
Blank lines are skipped; ``#`` starts a comment at the start of a line (after optional
whitespace) or after whitespace: a ``#`` inside a token is refused (it was cut off there),
and one inside a tenant name is part of the name.  CRLF
line ends and a UTF-8 byte-order mark are accepted.  A token is at least
``MIN_TOKEN_CHARS`` characters of RFC 6750's ``b64token`` set (``A-Z a-z 0-9 - . _ ~ + /``,
then ``=`` padding), as ``openssl rand -hex 24`` or ``-base64 24`` gives: the characters a
client can send after ``Bearer``.  Every RPC but health, and every HTTP request but
``/health``, must carry ``authorization: Bearer <token>``.  The file is read at start-up:
a change takes a restart.

A token without a name is a tenant of its own, named by its line: ``line-3``.  NOTE: not by
a digest of the token: tenant names are logged (in request ids), and an unsalted digest
there let anyone with the logs test guessed tokens offline.  A line number tells nothing
of the token; it changes when lines move, which only renames the tenant in logs after the
restart that reads the edited file (the prefix cache starts empty then anyway).

Tokens are compared in constant time, each against every known token, so that the
time of a refusal says nothing of how close a guess came.  The tenant then keys the
prefix cache (``tenant_cache_salt``) and the request-id namespace: two tenants never
share a cached block, so the cached-token counts a client sees reveal nothing of another
tenant's prompts.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MIN_TOKEN_CHARS = 16
MAX_TOKEN_BYTES = 4096
_BEARER = "bearer "
# RFC 6750 section 2.1: b64token = 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"="
_B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_B64TOKEN_CHARS = "A-Z a-z 0-9 - . _ ~ + / (then = padding)"
# A comment: '#' at the start of a line or after a space or tab, to the end of the line.
_COMMENT = re.compile(r"(^|[ \t])#.*")
_UNNAMED_TENANT = "line-{}"


class AuthenticationError(Exception):
    """A request without a valid bearer token."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a valid token belongs to."""

    name: str


@dataclass(frozen=True, slots=True)
class TokenLine:
    """One token of an auth token file, its line number, and the name of its tenant if the line gives one."""

    number: int
    token: str
    named_tenant: str | None = None

    @property
    def tenant(self) -> str:
        """The tenant's name: the line's, or ``line-N`` for a token without one (module docstring)."""
        return self.named_tenant if self.named_tenant is not None else _UNNAMED_TENANT.format(self.number)


def read_token_file(path: str | Path) -> list[TokenLine]:
    """The tokens of the auth token file ``path`` (module docstring), in file order.

    ``ValueError`` naming the file (and the line) for an unreadable or empty file or a
    malformed line; its message never holds a token.  The server reads the file with it,
    and so does ``kvserve generate``, so that both accept the same files.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the auth token file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"the auth token file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    lines = []
    # NOTE: split on '\n' only: str.splitlines() also ends a line at \v, \f, \x1c-\x1e and
    # U+2028, which would have cut a token in two and shifted the line numbers.
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        fields = _fields(line)
        if fields:
            lines.append(_token_line(path, number, fields))
    if not lines:
        raise ValueError(f"the auth token file {path} holds no token (one per line: 'token' or 'token tenant-name')")
    _check_unique(path, lines)
    return lines


def _fields(line: str) -> list[str]:
    """The fields of a line without its comment and line end, split on spaces and tabs.

    NOTE: only those two: ``str.split()`` also splits on non-ASCII spaces (U+00A0, ...),
    which turned the end of a token pasted with one into a tenant name.
    """
    line = _COMMENT.sub("", line.removesuffix("\r"))
    return [field for field in re.split(r"[ \t]+", line) if field]


def _token_line(path: str | Path, number: int, fields: list[str]) -> TokenLine:
    """One line's token and tenant, checked; ``ValueError`` naming the file and line."""
    where = f"{path}:{number}"
    if len(fields) > 2:
        raise ValueError(f"{where}: expected 'token' or 'token tenant-name', got {len(fields)} fields")
    token = fields[0]
    if len(token.rstrip("=")) < MIN_TOKEN_CHARS:  # padding is no secret: a=============== is one character
        raise ValueError(f"{where}: a token must have at least {MIN_TOKEN_CHARS} characters before any '=' padding")
    if len(token.encode()) > MAX_TOKEN_BYTES:
        raise ValueError(f"{where}: a token may have at most {MAX_TOKEN_BYTES} bytes")
    if not _B64TOKEN.fullmatch(token):
        raise ValueError(
            f"{where}: the token has a character that a bearer token cannot hold ({_describe_bad_char(token)}); "
            f"allowed: {_B64TOKEN_CHARS}"
        )
    if len(fields) == 1:
        return TokenLine(number, token)
    tenant = fields[1]
    if not tenant.isprintable():
        # Tenant names go into logs and the cache salt (with a NUL separator).
        raise ValueError(f"{where}: the tenant name {ascii(tenant)} has a control or non-printable character")
    return TokenLine(number, token, tenant)


def _describe_bad_char(token: str) -> str:
    """Where a token leaves the b64token set, and what kind of character is there, without the token itself."""
    for position, char in enumerate(token, start=1):
        if char.isascii() and (char.isalnum() or char in "-._~+/="):
            continue
        if char == "#":
            kind = "a '#' (a comment starts only at the start of a line or after whitespace)"
        elif char == "\ufeff":
            kind = "a byte-order mark"
        elif not char.isascii():
            kind = "a non-ASCII character"
        elif not char.isprintable():
            kind = "a control character"
        else:
            kind = "a punctuation character outside the set"
        return f"{kind} at character {position}"
    return "an '=' before its end: '=' may only pad the end"


def _check_unique(path: str | Path, lines: list[TokenLine]) -> None:
    """``ValueError`` for a token listed twice, or a name given to a tenant that is an unnamed token's."""
    seen: set[str] = set()
    unnamed = {line.tenant for line in lines if line.named_tenant is None}
    for line in lines:
        if line.token in seen:
            raise ValueError(f"{path}:{line.number}: the token is listed twice")
        seen.add(line.token)
        if line.named_tenant in unnamed:
            raise ValueError(
                f"{path}:{line.number}: the tenant name {line.tenant!r} is the name of an unnamed token's tenant "
                f"(tokens without a name are named by their line); choose another"
            )


class TokenTable:
    """The valid tokens and their tenants."""

    def __init__(self, tokens: dict[str, str]) -> None:
        if not tokens:
            raise ValueError("an auth token file must hold at least one token")
        self._tokens = [(token.encode(), Tenant(tenant)) for token, tenant in tokens.items()]

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        """Read ``path`` (``read_token_file``); ``ValueError`` naming the file and line for a malformed one."""
        return cls({line.token: line.tenant for line in read_token_file(path)})

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tenant_names(self) -> frozenset[str]:
        return frozenset(tenant.name for _, tenant in self._tokens)

    def check_tenant_names(self, names: Iterable[str], *, flag: str) -> None:
        """``ValueError`` naming ``flag`` for a name of ``names`` that no token's tenant has."""
        unknown = sorted(set(names) - self.tenant_names)
        if unknown:
            raise ValueError(
                f"{flag}: no token of the auth token file is of tenant {', '.join(map(repr, unknown))}; "
                f"its tenants: {', '.join(sorted(self.tenant_names))}"
            )

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``authorization`` header value; ``AuthenticationError`` when it is not valid."""
        if not authorization:
            raise AuthenticationError("missing 'authorization: Bearer <token>'")
        if not authorization[: len(_BEARER)].lower() == _BEARER:  # "Basic ...", a bare token, "Bearer" alone
            raise AuthenticationError("the authorization header is not 'Bearer <token>'")
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
