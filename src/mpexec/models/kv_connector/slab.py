"""A worker's shard of KV blocks in one preallocated shared-memory segment.

A producer worker of disaggregated prefill copies the blocks it computed
into *slots* of its slab; a consumer worker on the same machine maps the
same segment and copies them out into its own cache (no file, no copy in
between), or the producer's shard server sends them over the network::

    offset 0            generation of each slot (u64 x num_slots), page-aligned
    offset data_offset  KV [layers, 2 (K, V), num_slots x block_size, heads, head_dim]

The data keeps the paged cache's own layout, so a run of consecutive
blocks is one strided copy (one per layer range and K/V), never a loop
over blocks.  The segment is a memfd (:class:`mpexec.ipc.shm.Segment`):
nothing in ``/dev/shm``, freed by the kernel when the last process that
maps it lets go, however the producer ended.

Generations (a sequence lock per slot, written only by the slab's worker)::

    writer: gen += 1 (odd: being written)  copy  gen += 1 (even: whole)
    reader: gen == expected  copy  gen == expected      else: not used

The producer's scheduler side assigns slots and knows how often it
assigned each one, so it knows the even generation a whole block has; a
reader that sees another value before or after its copy reports the block
invalid (it was overwritten meanwhile), and the consumer recomputes it.
x86-64 keeps stores in order, so the two generation stores bracket the
copy as seen from the reader; other architectures would need a fence.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mpexec.ipc.shm import Segment, SegmentRef, segment_name


@dataclass(frozen=True)
class SlabShape:
    """What one slab holds: which layers and KV heads, how many slots, of what."""

    layers: tuple[int, int]
    heads: tuple[int, int]
    num_slots: int
    block_size: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def data_offset(self) -> int:
        return -(-self.num_slots * 8 // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.layers[1] - self.layers[0], 2, self.num_slots * self.block_size,
                self.heads[1] - self.heads[0], self.head_dim)

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.dims:
            count *= dim
        return self.data_offset + count * torch_dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "heads": list(self.heads),
                "num_slots": self.num_slots, "block_size": self.block_size,
                "head_dim": self.head_dim, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SlabShape:
        return cls(layers=(int(raw["layers"][0]), int(raw["layers"][1])),
                   heads=(int(raw["heads"][0]), int(raw["heads"][1])),
                   num_slots=int(raw["num_slots"]), block_size=int(raw["block_size"]),
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


class BlockSlab:
    """The shard's segment seen as generations and a KV tensor."""

    def __init__(self, segment: Segment, shape: SlabShape) -> None:
        self.segment = segment
        self.shape = shape
        self.gens = segment.bytes[:shape.num_slots * 8].cast("Q")
        count = segment.size - shape.data_offset
        dtype = torch_dtype(shape.dtype)
        self.data = torch.frombuffer(segment.bytes, dtype=dtype,
                                     count=count // dtype.itemsize,
                                     offset=shape.data_offset).view(shape.dims)

    @classmethod
    def create(cls, shape: SlabShape) -> BlockSlab:
        segment = Segment.create(segment_name("kvslab"), shape.nbytes, "KV slab")
        slab = cls(segment, shape)
        slab.data.zero_()  # maps every page now: no transfer pays the page faults
        return slab

    @classmethod
    def attach(cls, ref: SegmentRef, shape: SlabShape) -> BlockSlab:
        if ref.size != shape.nbytes:
            raise ValueError(f"KV slab of {ref.size} bytes, expected {shape.nbytes}")
        slab = cls(Segment.attach(ref, "KV slab"), shape)
        slab.data.view(-1)[::mmap.PAGESIZE // slab.data.element_size()].sum()  # map the pages
        return slab

    def ref(self) -> SegmentRef:
        return self.segment.ref()

    def tokens(self, slot: int, count: int = 1) -> slice:
        size = self.shape.block_size
        return slice(slot * size, (slot + count) * size)

    def write(self, cache: Any, pairs: list[tuple[int, int]]) -> None:
        """Copy the cache's ``(block, slot)`` pairs in, bracketed by generations."""
        size = self.shape.block_size
        for _, slot in pairs:
            self.gens[slot] += 1
        for block, slot, count in runs(pairs):
            self.data[:, :, self.tokens(slot, count)].copy_(
                cache[:, :, block * size:(block + count) * size])
        for _, slot in pairs:
            self.gens[slot] += 1

    def whole(self, slots: list[int], gens: list[int]) -> bool:
        return all(self.gens[s] == g for s, g in zip(slots, gens, strict=True))

    def close(self) -> None:
        self.gens.release()
        del self.data
        self.segment.close()
