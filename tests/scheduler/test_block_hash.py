"""Block hashes: the exact byte format, chaining, salts, and cross-process stability."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import xxhash

from kvserve.scheduler.block_hash import (
    ROOT_PARENT_DIGEST,
    BlockHasher,
    encode_extra_key,
    hash_block,
    token_ids_to_bytes,
)


def test_first_block_hash_is_xxh3_128_of_the_documented_bytes() -> None:
    tokens = [1, 2, 3, 70000]
    expected = xxhash.xxh3_128_digest(
        bytes(16)
        + b"".join(t.to_bytes(4, "little") for t in tokens)
        + (4).to_bytes(4, "little") + b"salt"
        + (5).to_bytes(4, "little") + b"model"
    )
    assert BlockHasher(4, "model").hash_token_ids(tokens, cache_salt="salt") == [expected]


def test_later_blocks_chain_the_parent_digest_and_carry_only_the_model_key() -> None:
    hasher = BlockHasher(2, "m")
    first, second = hasher.hash_token_ids([5, 6, 7, 8], cache_salt="s")
    expected = xxhash.xxh3_128_digest(first + token_ids_to_bytes([7, 8]) + encode_extra_key("m"))
    assert second == expected
    assert hash_block(first, [7, 8], encode_extra_key("m")) == expected


def test_partial_trailing_block_is_not_hashed() -> None:
    assert len(BlockHasher(4).hash_token_ids(list(range(11)))) == 2
    assert BlockHasher(4).hash_token_ids([1, 2, 3]) == []


def test_missing_salt_equals_empty_salt() -> None:
    hasher = BlockHasher(2)
    assert hasher.hash_token_ids([1, 2]) == hasher.hash_token_ids([1, 2], cache_salt="")


def test_salt_and_model_id_separate_caches() -> None:
    tokens = list(range(8))
    base = BlockHasher(4, "a").hash_token_ids(tokens, cache_salt="tenant-1")
    assert BlockHasher(4, "a").hash_token_ids(tokens, cache_salt="tenant-2")[1] != base[1]
    assert BlockHasher(4, "b").hash_token_ids(tokens, cache_salt="tenant-1")[1] != base[1]


def test_same_block_content_with_different_prefix_hashes_differently() -> None:
    hasher = BlockHasher(2)
    assert hasher.hash_token_ids([1, 2, 9, 9])[1] != hasher.hash_token_ids([3, 4, 9, 9])[1]


def test_incremental_hashing_matches_hashing_everything() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(100, 140))
    whole = hasher.hash_token_ids(tokens, cache_salt="x")
    head = hasher.hash_token_ids(tokens[:12], cache_salt="x")
    tail = hasher.hash_token_ids(tokens, cache_salt="x", parent=head[-1], start_block=3)
    assert head + tail == whole


def test_root_parent_is_sixteen_zero_bytes() -> None:
    assert ROOT_PARENT_DIGEST == bytes(16)
    assert hash_block(None, [1]) == hash_block(bytes(16), [1])


def test_token_ids_outside_uint32_are_rejected() -> None:
    with pytest.raises(ValueError):
        token_ids_to_bytes([-1])
    with pytest.raises(ValueError):
        token_ids_to_bytes([2**32])


def test_bad_block_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)


def test_hashes_agree_across_processes() -> None:
    """Hashes must not depend on PYTHONHASHSEED or the process (never Python's hash())."""
    code = textwrap.dedent(
        """
        from kvserve.scheduler.block_hash import BlockHasher
        print(",".join(h.hex() for h in BlockHasher(16, "m").hash_token_ids(list(range(64)), "s")))
        """
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    local = ",".join(h.hex() for h in BlockHasher(16, "m").hash_token_ids(list(range(64)), "s"))
    assert outputs == {local}
