"""Names for full KV blocks: a hash of the block's tokens and of everything before it.

::

    root      = H(b"mpexec-kv" | namespace)            (model identity, dtype, salt)
    hash[0]   = H(root    | tokens[0 : B])
    hash[i]   = H(hash[i-1] | tokens[i*B : (i+1)*B])

Two requests whose first ``k`` blocks hold the same tokens, in the same
model, share ``hash[0..k)`` and so the KV of those blocks: position ``p``'s
K/V depends only on the tokens at positions ``0..p``.  The hash is BLAKE2b
(16 bytes), stable across processes and runs, so a block can
be named on disk by an offload store and found again by another engine.
Only full blocks get a name; a partial block is never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

BlockHash = bytes

_DIGEST_SIZE = 16


def root_hash(namespace: str) -> BlockHash:
    """The hash that precedes block 0: a different namespace shares nothing."""
    return hashlib.blake2b(b"mpexec-kv|" + namespace.encode(),
                           digest_size=_DIGEST_SIZE).digest()


def chain_hash(parent: BlockHash, tokens: list[int]) -> BlockHash:
    """The hash of a block holding ``tokens`` after the block hashed ``parent``."""
    digest = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def extend_hashes(hashes: list[BlockHash], tokens: list[int], block_size: int,
                  root: BlockHash) -> None:
    """Append to ``hashes`` the names of the full blocks of ``tokens`` it lacks."""
    full = len(tokens) // block_size
    parent = hashes[-1] if hashes else root
    for index in range(len(hashes), full):
        parent = chain_hash(parent, tokens[index * block_size:(index + 1) * block_size])
        hashes.append(parent)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and those found (served from it)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
