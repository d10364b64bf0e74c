"""A producer worker's paged KV cache in shared memory, with a generation per block.

A producer worker of disaggregated prefill keeps its KV cache itself in
one memfd (:class:`mpexec.ipc.shm.Segment`): a consumer worker on the
same machine maps it and copies the blocks it wants straight into its own
cache (one copy, nothing in between), or the producer's shard server
sends them over the network::

    offset 0            generation of each block (u64 x (num_blocks + 1)), page-aligned
    offset data_offset  the cache [layers, 2 (K, V), (num_blocks + 1) x block_size,
                                   heads, head_dim]

The data is the paged cache's own tensor (:class:`SharedCache.create`
puts the worker's :class:`~mpexec.models.kv_cache.KVCache` on it before
anything is computed), so a run of consecutive blocks is one strided copy
(one per layer range and K/V), never a loop over blocks.  A memfd has no
name in ``/dev/shm``; the kernel frees it when the last process that maps
it lets go, however the producer ended.

Generations (a sequence lock per block, written only by the cache's worker,
valued by the producer's scheduler side, which sees every allocation)::

    block handed out for new KV:  gen += 1 (odd: being written), before the
                                  step's forward can write it
    block's KV computed:          gen += 1 (even: whole), after the forward
    reader: gen == expected  copy  gen == expected      else: not used

A reader knows the even generation of a whole block from the producer's
index; a block reused meanwhile shows another value before or after the
copy, so the reader reports it invalid and the consumer recomputes it.
x86-64 keeps stores in order, so the generation store before a forward
and the one after it bracket its writes as seen from the reader; other
architectures would need a fence.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mpexec.ipc.shm import Segment, SegmentRef, segment_name


@dataclass(frozen=True)
class CacheShape:
    """What one worker's cache holds: which layers and KV heads, how many blocks, of what."""

    layers: tuple[int, int]
    heads: tuple[int, int]
    num_blocks: int  # with the scratch block
    block_size: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"

    @classmethod
    def of(cls, cache: Any) -> CacheShape:
        """The shape of a :class:`~mpexec.models.kv_cache.KVCache`."""
        tensor = cache.tensor
        return cls(layers=tuple(cache.layer_range), heads=tuple(cache.kv_head_range),
                   num_blocks=int(tensor.shape[2]) // cache.block_size,
                   block_size=cache.block_size, head_dim=int(tensor.shape[-1]),
                   dtype=str(tensor.dtype).removeprefix("torch."))

    @property
    def data_offset(self) -> int:
        return -(-self.num_blocks * 8 // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.layers[1] - self.layers[0], 2, self.num_blocks * self.block_size,
                self.heads[1] - self.heads[0], self.head_dim)

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.dims:
            count *= dim
        return self.data_offset + count * torch_dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "heads": list(self.heads),
                "num_blocks": self.num_blocks, "block_size": self.block_size,
                "head_dim": self.head_dim, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CacheShape:
        return cls(layers=(int(raw["layers"][0]), int(raw["layers"][1])),
                   heads=(int(raw["heads"][0]), int(raw["heads"][1])),
                   num_blocks=int(raw["num_blocks"]), block_size=int(raw["block_size"]),
                   head_dim=int(raw["head_dim"]), dtype=str(raw["dtype"]))


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def runs(pairs: list[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """``(a, b)`` block pairs grouped into maximal runs ``(a0, b0, length)``
    in which both sides are consecutive."""
    start = 0
    for index in range(1, len(pairs) + 1):
        if index == len(pairs) or pairs[index] != (pairs[index - 1][0] + 1,
                                                    pairs[index - 1][1] + 1):
            yield pairs[start][0], pairs[start][1], index - start
            start = index


class SharedCache:
    """A worker's cache segment seen as generations and the KV tensor."""

    def __init__(self, segment: Segment, shape: CacheShape, owner: bool = False) -> None:
        self.segment = segment
        self.shape = shape
        self.owner = owner  # created here: the worker's cache tensor is ``data``
        self.gens = segment.bytes[:shape.num_blocks * 8].cast("Q")
        count = segment.size - shape.data_offset
        dtype = torch_dtype(shape.dtype)
        self.data = torch.frombuffer(segment.bytes, dtype=dtype,
                                     count=count // dtype.itemsize,
                                     offset=shape.data_offset).view(shape.dims)

    @classmethod
    def create(cls, cache: Any) -> SharedCache:
        """A segment shaped like ``cache`` (a CPU KVCache) that becomes its tensor.

        Called before anything is computed: what the old tensor held is
        not copied.  The pages are not allocated either (as ``torch.empty``'s
        are not): the forward allocates them as it first writes blocks.
        """
        if cache.tensor.device.type != "cpu":
            raise ValueError("a KV cache in shared memory must be on the CPU; "
                             f"this one is on {cache.tensor.device}")
        shape = CacheShape.of(cache)
        segment = Segment.create(segment_name("kvcache"), shape.nbytes, "KV cache",
                                 allocate=False)
        shared = cls(segment, shape, owner=True)
        cache.tensor = shared.data
        return shared

    @classmethod
    def attach(cls, ref: SegmentRef, shape: CacheShape) -> SharedCache:
        if ref.size != shape.nbytes:
            raise ValueError(f"KV cache of {ref.size} bytes, expected {shape.nbytes}")
        return cls(Segment.attach(ref, "KV cache"), shape)

    def ref(self) -> SegmentRef:
        return self.segment.ref()

    def set_generations(self, pairs: list[tuple[int, int]]) -> None:
        """Store ``(block, generation)`` pairs (the producer worker's, in step order)."""
        gens = self.gens
        for block, gen in pairs:
            gens[block] = gen

    def whole(self, blocks: list[int], gens: list[int]) -> bool:
        """Whether every block still holds the KV its expected generation names."""
        current = self.gens
        return all(current[b] == g for b, g in zip(blocks, gens, strict=True))

    def close(self) -> None:
        """Let go of the segment.  The owner's cache keeps its tensor, and the
        mapping with it until the cache lets go of it (unmapping it under the
        cache would make any later access a segmentation fault); a reader's
        mapping is unmapped now."""
        self.gens.release()
        del self.data
        if self.owner:
            self.segment.let_go()
        else:
            self.segment.close()
