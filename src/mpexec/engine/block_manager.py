"""The paged KV cache's blocks, kept by the scheduler: who holds which, what is cached.

Every worker holds ``num_blocks`` KV blocks of ``block_size`` token slots
(the same count on every worker: the engine takes the minimum over them).
The scheduler decides which request holds which block; workers only follow
the block tables it sends.  A request holding ``n`` tokens of KV needs
``ceil(n / block_size)`` blocks; blocks are appended as it grows and all
returned at once when it finishes or is preempted.

Prefix caching (``enable_caching``): a full block whose KV has been
scheduled is registered under its hash (:mod:`mpexec.engine.prefix_cache`).
A block has a reference count: the requests holding it.  A block at zero
references that has a hash stays cached, in LRU order, until its memory is
needed; one without a hash is plainly free.  ``allocate`` takes plainly
free blocks first (lowest id first, so runs are reproducible), then evicts
the least recently freed cached block.  ``find_cached`` returns the longest
run of cached blocks naming a request's first blocks; ``take`` shares
them (a block in use is never evicted).

A cached block's KV may still be being written by a step in flight: it is
safe to share, because every worker runs steps in order, so the step that
writes it finishes before any later step reads it.

``on_allocate`` (when set) hears of every block ``allocate`` hands out,
whose KV is about to be overwritten (a KV connector whose peers read this
cache marks them so; blocks shared through ``take`` keep their KV).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from mpexec.engine.prefix_cache import BlockHash, PrefixCacheStats


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates block ids to requests; counts references; keeps the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free = list(range(num_blocks))  # a heap of uncached free blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, 0 refs: LRU first
        self._holders: dict[int, list[str]] = {}  # block -> requests holding it
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self.stats = PrefixCacheStats()
        self.num_evictions = 0
        self.on_allocate: Callable[[list[int]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def blocks_needed(self, held: int, num_tokens: int) -> int:
        """Blocks to add to a table of ``held`` blocks so it holds ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - held)

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free_blocks

    def allocate(self, req_id: str, count: int) -> list[int]:
        """``count`` blocks now held by ``req_id`` alone; evicts cached blocks if needed."""
        if count > self.num_free_blocks:
            raise RuntimeError(
                f"{count} KV blocks requested for {req_id} with {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            if self._free:
                block = heapq.heappop(self._free)
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
                self.num_evictions += 1
            self._holders[block] = [req_id]
            taken.append(block)
        if self.on_allocate is not None:
            self.on_allocate(taken)
        return taken

    def free(self, req_id: str, block_ids: list[int]) -> None:
        """Drop ``req_id``'s reference to its blocks; unreferenced cached blocks stay cached.

        The blocks are released last first, so that a request's tail (the
        part least likely to be shared) is evicted before its head.
        """
        for block in block_ids:
            holders = self._holders.get(block)
            if holders is None or req_id not in holders:
                raise RuntimeError(f"block {block} freed by {req_id} but held by "
                                   f"{', '.join(holders) if holders else None}")
        for block in reversed(block_ids):
            holders = self._holders[block]
            holders.remove(req_id)
            if holders:
                continue
            del self._holders[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    # -- prefix cache ------------------------------------------------------------------

    def find_cached(self, hashes: list[BlockHash]) -> list[int]:
        """The cached blocks named by the longest prefix of ``hashes``."""
        found: list[int] = []
        if not self.enable_caching:
            return found
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` no request holds (taking them uses up free blocks)."""
        return sum(1 for block in block_ids if block not in self._holders)

    def take(self, req_id: str, block_ids: list[int]) -> None:
        """Share cached blocks with ``req_id`` (from :meth:`find_cached`)."""
        for block in block_ids:
            if block not in self._hash_of:
                raise RuntimeError(f"block {block} is not cached; {req_id} cannot share it")
            holders = self._holders.get(block)
            if holders is None:
                del self._evictable[block]
                self._holders[block] = [req_id]
            else:
                holders.append(req_id)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Name a full block held by a request; a hash already cached keeps its block."""
        if not self.enable_caching or block in self._hash_of or block_hash in self._by_hash:
            return
        if block not in self._holders:
            raise RuntimeError(f"block {block} is cached while no request holds it")
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block no request holds; False if some are held."""
        for block in list(self._evictable):
            del self._evictable[block]
            self._uncache(block)
            heapq.heappush(self._free, block)
        return not self._by_hash

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        if self._by_hash.get(block_hash) == block:
            del self._by_hash[block_hash]
