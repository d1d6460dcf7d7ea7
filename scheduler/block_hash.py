"""Chained, content-addressed hashes of full KV blocks.

The hash of block ``i`` is::

    xxh3_128( parent digest (16 bytes; zeros for block 0)
            ‖ the block's token ids as little-endian uint32
            ‖ extra keys )

Extra keys are length-prefixed (uint32 little-endian) UTF-8 fields: the cache
salt on the first block only, then the model/adapter id on every block.  A
missing salt is encoded as the empty string.  Only full blocks are hashed.

Hashes are 16-byte ``bytes`` digests: stable across processes and machines
(never Python's ``hash()``), cheap to compare and to use as dict keys.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

from kvserve.scheduler.checks import check_block_size

BlockHash = bytes
"""A 16-byte xxh3_128 digest identifying a full block and its whole prefix."""

ROOT_PARENT_DIGEST: bytes = bytes(16)

_xxh3_128 = xxhash.xxh3_128_digest
_LITTLE_ENDIAN = sys.byteorder == "little"


def encode_extra_key(value: str) -> bytes:
    """One length-prefixed UTF-8 field of the extra keys."""
    data = value.encode("utf-8")
    return len(data).to_bytes(4, "little") + data


def token_ids_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32; raises ``ValueError`` outside [0, 2**32)."""
    try:
        packed = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - platforms where "I" is not 32-bit
        packed = array("L", token_ids)
    if not _LITTLE_ENDIAN:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def num_cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence of ``num_tokens`` a prefix-cache hit may
    cover: never the block of its last token, which a step must compute to sample from."""
    return (num_tokens - 1) // block_size


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    """Hash one full block; ``parent`` is ``None`` for the first block."""
    return _xxh3_128((parent or ROOT_PARENT_DIGEST) + token_ids_to_bytes(token_ids) + extra_keys)


class BlockHasher:
    """Computes the block hashes of token sequences for one model and block size.

    The same hasher (same ``block_size`` and ``model_id``) must be used by the
    pools and by the router so that their hashes agree.
    """

    __slots__ = ("block_size", "model_id", "_model_key", "_block_bytes")

    def __init__(self, block_size: int, model_id: str = "") -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self.model_id = model_id
        self._model_key = encode_extra_key(model_id)
        self._block_bytes = 4 * block_size

    def first_block_extra_keys(self, cache_salt: str | None) -> bytes:
        return encode_extra_key(cache_salt or "") + self._model_key

    def hash_token_ids(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        parent: BlockHash | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``token_ids[start_block * block_size:]``.

        ``parent`` is the hash of block ``start_block - 1`` (``None`` when
        starting at block 0).  A trailing partial block is not hashed.
        """
        block_size = self.block_size
        num_full = len(token_ids) // block_size
        if start_block >= num_full:
            return []
        if start_block == 0 and parent is not None:
            raise ValueError("parent must be None when hashing from the first block")
        data = token_ids_to_bytes(token_ids[start_block * block_size : num_full * block_size])
        model_key = self._model_key
        step = self._block_bytes
        digest = _xxh3_128
        hashes: list[BlockHash] = []
        append = hashes.append
        offset = 0
        if start_block == 0:
            parent = digest(
                ROOT_PARENT_DIGEST + data[:step] + self.first_block_extra_keys(cache_salt)
            )
            append(parent)
            offset = step
        for offset in range(offset, len(data), step):
            parent = digest(parent + data[offset : offset + step] + model_key)  # type: ignore[operator]
            append(parent)
        return hashes
