"""Names for full KV blocks: a hash of the block's tokens and of everything before it.

::

    root      = H(b"mpexec-kv" | namespace)            (model identity, dtype, salt)
    hash[0]   = H(root    | tokens[0 : B] [| rounded])
    hash[i]   = H(hash[i-1] | tokens[i*B : (i+1)*B] [| rounded])

Two requests whose first ``k`` blocks hold the same tokens, in the same
model, share ``hash[0..k)`` and so the KV of those blocks: position ``p``'s
K/V depends only on the tokens at positions ``0..p`` and on how packed
weights took their activations (``mpexec.models.split_rule``): ``rounded``,
the block's tokens rounded to bfloat16 once rather than split (a long
prompt's tokens before its last), joins the name when it is not 0.  So a
block of a long prompt is never shared with the same tokens of a short
one (which splits them), and a request gets back exactly the KV it would
compute.  The hash is BLAKE2b
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


def chain_hash(parent: BlockHash, tokens: list[int], rounded: int = 0) -> BlockHash:
    """The hash of a block holding ``tokens`` after the block hashed ``parent``
    (``rounded``: how many of them are rounded once, see the module docstring)."""
    digest = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    digest.update(array("q", tokens).tobytes())
    if rounded:
        digest.update(b"|rounded %d" % rounded)
    return digest.digest()


def extend_hashes(hashes: list[BlockHash], tokens: list[int], block_size: int,
                  root: BlockHash, split_from: int = 0) -> None:
    """Append to ``hashes`` the names of the full blocks of ``tokens`` it lacks
    (``split_from``: the request's first position that splits, ``split_rule``)."""
    full = len(tokens) // block_size
    parent = hashes[-1] if hashes else root
    for index in range(len(hashes), full):
        start = index * block_size
        rounded = min(max(split_from - start, 0), block_size)
        parent = chain_hash(parent, tokens[start:start + block_size], rounded)
        hashes.append(parent)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and those found (served from it)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
