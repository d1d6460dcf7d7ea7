"""Bearer tokens: reading the token file, constant-time checks, and the tenant's cache salt."""

from __future__ import annotations

import pytest

from kvserve.cluster.auth import AuthenticationError, Tenant, TokenTable, tenant_cache_salt

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


def table(tmp_path, text: str) -> TokenTable:
    path = tmp_path / "tokens"
    path.write_text(text)
    return TokenTable.from_file(path)


def test_each_token_stands_for_its_named_tenant_and_an_unnamed_one_for_itself(tmp_path) -> None:
    tokens = table(tmp_path, f"# our tenants\n{ALICE} acme\n\n{BOB}   # no name\nshared-token-0000000 acme\n")
    assert len(tokens) == 3
    assert tokens.authenticate(f"Bearer {ALICE}") == Tenant("acme")
    assert tokens.authenticate(f"bearer shared-token-0000000") == Tenant("acme")  # a tenant may have several
    bob = tokens.authenticate(f"Bearer {BOB}")
    assert bob.name.startswith("token-") and BOB not in bob.name  # never the token itself


@pytest.mark.parametrize("header", [None, "", ALICE, f"Basic {ALICE}", f"Bearer {ALICE}x", "Bearer "])
def test_a_missing_malformed_or_unknown_token_is_refused(tmp_path, header) -> None:
    tokens = table(tmp_path, f"{ALICE} acme\n")
    with pytest.raises(AuthenticationError):
        tokens.authenticate(header)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "at least one token"),
        ("short acme\n", ":1: a token must have at least 16 characters"),
        (f"{ALICE} acme extra\n", ":1: expected 'token' or 'token tenant-name'"),
        (f"{ALICE}\n{ALICE} again\n", ":2: the token is listed twice"),
    ],
)
def test_a_malformed_token_file_is_refused_naming_the_line(tmp_path, text, message) -> None:
    with pytest.raises(ValueError, match=message):
        table(tmp_path, text)


def test_an_unreadable_token_file_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read the auth token file"):
        TokenTable.from_file(tmp_path / "missing")


def test_tenants_never_share_a_salt_and_without_auth_the_salt_is_the_clients() -> None:
    acme, globex = Tenant("acme"), Tenant("globex")
    assert tenant_cache_salt(acme, None) != tenant_cache_salt(globex, None)
    assert tenant_cache_salt(acme, "x") != tenant_cache_salt(globex, "x")
    assert tenant_cache_salt(acme, "x") != tenant_cache_salt(acme, "y")
    assert tenant_cache_salt(acme, None) == tenant_cache_salt(acme, None)
    assert tenant_cache_salt(None, "x") == "x" and tenant_cache_salt(None, None) is None
