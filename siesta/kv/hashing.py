"""Chained keys for full KV blocks.

A block's key covers its parent's key, its token ids and the extra keys (model
fingerprint, weight version, cache salt), so equal keys mean equal KV. Keys are
stable across processes: the disk tier reuses them after a restart.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes

_DIGEST_BYTES = 16
_ROOT_PARENT = b"siesta-kv-root-v1"


@dataclass(frozen=True)
class ExtraKeys:
    """What besides the tokens decides a block's KV."""

    model_fingerprint: str
    weight_version: str
    cache_salt: str | None = None

    def encode(self) -> bytes:
        salt = "" if self.cache_salt is None else self.cache_salt
        return f"{self.model_fingerprint}\x00{self.weight_version}\x00{salt}".encode()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(_ROOT_PARENT if parent is None else parent)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra: bytes) -> None:
    """Append keys for every block that ``token_ids`` fills beyond those already in ``hashes``."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
