"""Bearer tokens: reading the token file, constant-time checks, and the tenant's cache salt."""

from __future__ import annotations

import re

import pytest

from kvserve.cluster.auth import AuthenticationError, Tenant, TokenTable, read_token_file, tenant_cache_salt

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
    assert tokens.authenticate(f"Bearer {BOB}") == Tenant("line-4")  # named by its line, never by the token


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing 'authorization: Bearer <token>'"),
        ("", "missing 'authorization: Bearer <token>'"),
        (ALICE, "the authorization header is not 'Bearer <token>'"),
        (f"Basic {ALICE}", "the authorization header is not 'Bearer <token>'"),
        ("Bearer", "the authorization header is not 'Bearer <token>'"),
        (f"Bearer {ALICE}x", "invalid bearer token"),
        ("Bearer ", "invalid bearer token"),
    ],
)
def test_a_missing_malformed_or_unknown_token_is_refused_saying_which(tmp_path, header, message) -> None:
    tokens = table(tmp_path, f"{ALICE} acme\n")
    with pytest.raises(AuthenticationError, match=re.escape(message)):
        tokens.authenticate(header)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no token"),
        ("short acme\n", ":1: a token must have at least 16 characters before any '=' padding"),
        ("a=============== acme\n", ":1: a token must have at least 16 characters before any '=' padding"),
        ("abcdefghijklmno= acme\n", ":1: a token must have at least 16 characters before any '=' padding"),
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


def test_a_hash_inside_a_token_is_refused_not_taken_for_a_comment(tmp_path) -> None:
    # It cut the token short: "abc#def" served as "abc", silently.
    with pytest.raises(ValueError, match=r":1: the token has a character .*a '#' \(a comment starts only"):
        table(tmp_path, f"{ALICE}#{BOB}\n")


def test_a_hash_starts_a_comment_at_the_start_of_a_line_or_after_whitespace(tmp_path) -> None:
    tokens = table(tmp_path, f"#{BOB}\n   # {BOB}\n{ALICE}\t# the rest\n{BOB} team#2 # here too\n")
    assert len(tokens) == 2
    assert tokens.authenticate(f"Bearer {ALICE}") == Tenant("line-3")
    assert tokens.authenticate(f"Bearer {BOB}") == Tenant("team#2")  # a name may hold one


def test_a_byte_order_mark_and_crlf_line_ends_are_not_part_of_a_token(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_bytes(f"\ufeff{ALICE} acme\r\n{BOB}\r\n".encode())
    tokens = TokenTable.from_file(path)
    assert tokens.authenticate(f"Bearer {ALICE}") == Tenant("acme")
    assert tokens.authenticate(f"Bearer {BOB}") == Tenant("line-2")


def test_every_b64token_character_is_accepted_with_padding(tmp_path) -> None:
    token = "AZaz09-._~+/abcdefgh=="
    assert table(tmp_path, f"{token}\n").authenticate(f"Bearer {token}") == Tenant("line-1")


@pytest.mark.parametrize(
    ("token", "what"),
    [
        ("alice-token-\x000123456789", "a control character at character 13"),
        ("alice-token-\x1b[31m0123456789", "a control character at character 13"),
        ("alice-tökenö-0123456789", "a non-ASCII character at character 8"),
        ("alice-token-\u00a00123456789", "a non-ASCII character at character 13"),  # not a field separator
        ("alice-token-!0123456789", "a punctuation character outside the set at character 13"),
        ("alice=token-0123456789", "an '=' before its end"),
        ("\ufeff" + ALICE, "a byte-order mark at character 1"),  # a second one: the first is stripped
    ],
)
def test_a_token_that_no_client_can_send_is_refused_naming_the_line_not_the_token(tmp_path, token, what) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"\ufeff# header\n{token} acme\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        TokenTable.from_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}:2: the token has a character that a bearer token cannot hold ({what}")
    assert "0123456789" not in message and "alice" not in message


def test_an_empty_token_file_is_refused_naming_the_file(tmp_path) -> None:
    with pytest.raises(ValueError, match=f"the auth token file {tmp_path / 'tokens'} holds no token"):
        table(tmp_path, "# nothing yet\n\n")


def test_a_tenant_name_with_a_control_character_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r":1: the tenant name 'ac\\x1bme' has a control"):
        table(tmp_path, f"{ALICE} ac\x1bme\n")


def test_a_name_that_is_an_unnamed_token_s_tenant_is_refused(tmp_path) -> None:
    # Else the two tokens would share a tenant: its cache and its request ids.
    with pytest.raises(ValueError, match=r":2: the tenant name 'line-1' is the name of an unnamed token's tenant"):
        table(tmp_path, f"{ALICE}\n{BOB} line-1\n")
    assert len(table(tmp_path, f"{ALICE} line-1\n{BOB} line-1\n")) == 2  # a name of its own line's: no clash


def test_the_token_file_reader_gives_tokens_in_file_order_with_their_lines(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# first\n{BOB}\n{ALICE} acme\n")
    assert [(line.number, line.token, line.tenant) for line in read_token_file(path)] == [
        (2, BOB, "line-2"), (3, ALICE, "acme"),
    ]


def test_a_token_file_that_is_not_utf8_is_refused_naming_the_byte(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_bytes(b"abc\xff")
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 0xff at offset 3\)"):
        TokenTable.from_file(path)
