"""The free list of the paged KV cache, kept by the scheduler.

Every worker holds ``num_blocks`` KV blocks of ``block_size`` token slots
(the same count on every worker: the engine takes the minimum over them).
The scheduler decides which request owns which block; workers only follow
the block tables it sends.  A request holding ``n`` tokens of KV needs
``ceil(n / block_size)`` blocks; blocks are appended as it grows and all
returned at once when it finishes or is preempted.  Block ids are handed out
lowest first, so runs are reproducible.
"""

from __future__ import annotations

import heapq


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates block ids to requests; counts what is free."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1; got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap: lowest id first
        self._owner: dict[int, str] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, held: int, num_tokens: int) -> int:
        """Blocks to add to a table of ``held`` blocks so it holds ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - held)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, req_id: str, count: int) -> list[int]:
        """``count`` free block ids, now owned by ``req_id``."""
        if count > len(self._free):
            raise RuntimeError(
                f"{count} KV blocks requested for {req_id} with {len(self._free)} free")
        taken = [heapq.heappop(self._free) for _ in range(count)]
        for block in taken:
            self._owner[block] = req_id
        return taken

    def free(self, req_id: str, block_ids: list[int]) -> None:
        """Return ``req_id``'s blocks to the free list."""
        for block in block_ids:
            owner = self._owner.get(block)
            if owner != req_id:
                raise RuntimeError(f"block {block} freed by {req_id} but owned by {owner}")
        for block in block_ids:
            del self._owner[block]
            heapq.heappush(self._free, block)
