"""CPU offload: full KV blocks copied to host memory (and optionally disk), loaded back later.

Scheduler side: every full block a step computes (named by its prefix
hash, :mod:`mpexec.engine.prefix_cache`) is saved once; the save becomes
usable only when every worker reported it (``finished_sending`` of the
step's save id).  The index of usable blocks is bounded
(``num_cpu_blocks``, or ``num_disk_blocks`` with ``disk_path``) and
evicts least recently used first, telling the workers to drop them.  A new
request whose next blocks (past the GPU prefix cache) are in the index
gets fresh blocks and one step in which the workers copy them in; it runs
once every worker reported the load (``finished_recving``), or recomputes
if one could not (``invalid_block_ids``).

Worker side: the loads of a step are done in ``start_load_kv``, before the
forward; the saves in ``wait_for_save``, after it (a saved block is held by
a running request, so the forward never overwrites it).  Each worker keeps
its own share of a block (its layers, its KV heads) in a
:class:`HostKVStore`: a dict of CPU tensors, and with ``disk_path`` one raw
file per block under ``<disk_path>/<layout digest>/rank<r>/``, written to a
temporary name and renamed, so a second engine with the same model and
layout finds them (the scheduler side lists what every rank holds when it
starts).  Nothing is ever unpickled: a file is bytes of a known shape.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpexec.models.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
)

logger = logging.getLogger(__name__)

DEFAULT_CPU_BLOCKS = 1024
DEFAULT_DISK_BLOCKS = 65536


@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    save_id: str = ""
    saves: list[tuple[int, bytes]] = field(default_factory=list)  # (block id, hash)
    loads: list[LoadSpec] = field(default_factory=list)
    drops: list[bytes] = field(default_factory=list)


def _layout_dir(config: KVTransferConfig) -> Path | None:
    path = config.kv_connector_extra_config.get("disk_path")
    if not path:
        return None
    key = f"{config.namespace}|{config.block_size}|{config.world_size}"
    return Path(path) / hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


class HostKVStore:
    """One worker's offloaded blocks: in memory over an optional directory.

    Without a directory the memory is the store, and what it holds is the
    scheduler side's decision (``drop``); with one, the memory is a read
    cache of ``max_blocks`` (LRU) over the files.
    """

    def __init__(self, max_blocks: int | None, directory: Path | None) -> None:
        self.max_blocks = max_blocks
        self.directory = directory
        self.memory: OrderedDict[bytes, Any] = OrderedDict()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def _file(self, block_hash: bytes) -> Path:
        assert self.directory is not None
        return self.directory / f"{block_hash.hex()}.kv"

    def put(self, block_hash: bytes, data: Any) -> None:
        self.memory[block_hash] = data
        self.memory.move_to_end(block_hash)
        while self.max_blocks is not None and len(self.memory) > self.max_blocks:
            self.memory.popitem(last=False)
        if self.directory is not None:
            target = self._file(block_hash)
            temporary = target.with_suffix(f".{os.getpid()}.tmp")
            data.contiguous().view(-1).view(dtype=_uint8()).numpy().tofile(temporary)
            os.replace(temporary, target)

    def get(self, block_hash: bytes, like: Any) -> Any | None:
        """The block's data shaped like ``like``, or None if it is not here (or broken)."""
        data = self.memory.get(block_hash)
        if data is not None:
            self.memory.move_to_end(block_hash)
            return data
        if self.directory is None:
            return None
        import numpy
        import torch

        try:
            raw = numpy.fromfile(self._file(block_hash), dtype=numpy.uint8)
        except OSError:
            return None
        expected = like.numel() * like.element_size()
        if raw.size != expected:
            logger.warning("offloaded KV block %s has %d bytes, expected %d: ignored",
                           block_hash.hex(), raw.size, expected)
            return None
        return torch.from_numpy(raw).view(like.dtype).view(like.shape)

    def drop(self, block_hash: bytes) -> None:
        self.memory.pop(block_hash, None)
        if self.directory is not None:
            self._file(block_hash).unlink(missing_ok=True)


def _uint8() -> Any:
    import torch

    return torch.uint8


class CPUOffloadConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, rank: int = 0) -> None:
        super().__init__(config, role, rank)
        extra = config.kv_connector_extra_config
        unknown = set(extra) - {"num_cpu_blocks", "disk_path", "num_disk_blocks"}
        if unknown:
            raise ValueError(f"CPUOffloadConnector: unknown settings {sorted(unknown)}")
        self.num_cpu_blocks = int(extra.get("num_cpu_blocks", DEFAULT_CPU_BLOCKS))
        self.directory = _layout_dir(config)
        self.capacity = int(extra.get("num_disk_blocks", DEFAULT_DISK_BLOCKS)) \
            if self.directory is not None else self.num_cpu_blocks
        if self.num_cpu_blocks < 1 or self.capacity < 1:
            raise ValueError("CPUOffloadConnector: block counts must be >= 1")
        # scheduler side
        self.index: OrderedDict[bytes, None] = OrderedDict()
        self._saving: set[bytes] = set()
        self._pending_saves: dict[str, list[bytes]] = {}
        self._step_saves: list[tuple[int, bytes]] = []
        self._step_loads: list[LoadSpec] = []
        self._drops: list[bytes] = []
        self._next_save = 0
        self.num_loaded_blocks = 0
        self.num_failed_loads = 0
        # worker side
        self.store: HostKVStore | None = None
        self.cache: Any = None
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._invalid: set[int] = set()
        if role is KVConnectorRole.SCHEDULER:
            self._scan_disk()

    # -- scheduler side ------------------------------------------------------------

    def _scan_disk(self) -> None:
        """Index the blocks every rank left on disk (oldest first, newest kept)."""
        if self.directory is None:
            return
        found: dict[bytes, float] = {}
        rank0 = self.directory / "rank0"
        if not rank0.is_dir():
            return
        for path in rank0.glob("*.kv"):
            try:
                block_hash = bytes.fromhex(path.stem)
            except ValueError:
                continue
            if all((self.directory / f"rank{r}" / path.name).is_file()
                   for r in range(1, self.config.world_size)):
                found[block_hash] = path.stat().st_mtime
        for block_hash in sorted(found, key=found.__getitem__)[-self.capacity:]:
            self.index[block_hash] = None
        if found:
            logger.info("KV offload: %d blocks found on disk under %s", len(self.index),
                        self.directory)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        size = self.config.block_size
        first = num_computed_tokens // size
        usable = (request.num_tokens - 1) // size  # the last token is always computed
        hashes = request.block_hashes
        count = 0
        for index in range(first, min(usable, len(hashes))):
            if hashes[index] not in self.index:
                break
            count += 1
        return count * size

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        size = self.config.block_size
        first = len(request.block_ids) - len(block_ids)
        hashes = request.block_hashes[first:first + num_external_tokens // size]
        for block_hash in hashes:
            self.index.move_to_end(block_hash)
        self.num_loaded_blocks += len(hashes)
        self._step_loads.append(LoadSpec(request.req_id, list(block_ids), list(hashes)))

    def blocks_computed(self, blocks: list[tuple[int, bytes]]) -> None:
        """Full blocks whose KV a step computes: save those not stored or being saved."""
        for block, block_hash in blocks:
            if block_hash in self.index or block_hash in self._saving:
                continue
            self._saving.add(block_hash)
            self._step_saves.append((block, block_hash))

    def has_pending_work(self) -> bool:
        return bool(self._step_loads or self._drops)

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMetadata:
        meta = OffloadMetadata(saves=self._step_saves, loads=self._step_loads,
                               drops=self._drops)
        if meta.saves:
            meta.save_id = f"save-{self._next_save}"
            self._next_save += 1
            self._pending_saves[meta.save_id] = [h for _, h in meta.saves]
        self._step_saves, self._step_loads, self._drops = [], [], []
        return meta

    def update_connector_output(self, kv_connector_output: Any) -> None:
        for save_id in kv_connector_output.finished_sending or ():
            for block_hash in self._pending_saves.pop(save_id, ()):
                self._saving.discard(block_hash)
                self.index[block_hash] = None
        while len(self.index) > self.capacity:
            evicted, _ = self.index.popitem(last=False)
            self._drops.append(evicted)

    def load_failed(self, hashes: list[bytes]) -> None:
        """A load did not complete everywhere: those blocks are not used again."""
        self.num_failed_loads += 1
        for block_hash in hashes:
            if block_hash in self.index:
                del self.index[block_hash]
                self._drops.append(block_hash)

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.cache = kv_cache
        directory = None if self.directory is None else self.directory / f"rank{self.rank}"
        self.store = HostKVStore(None if directory is None else self.num_cpu_blocks, directory)

    def _slots(self, block: int) -> slice:
        size = self.config.block_size
        return slice(block * size, (block + 1) * size)

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadMetadata) or not meta.loads:
            return
        assert self.store is not None and self.cache is not None
        tensor = self.cache.tensor
        for load in meta.loads:
            for block, block_hash in zip(load.block_ids, load.hashes, strict=True):
                target = tensor[:, :, self._slots(block)]
                data = self.store.get(block_hash, target)
                if data is None:
                    self._invalid.add(block)
                    continue
                target.copy_(data)
            self._finished_recving.add(load.req_id)

    def wait_for_save(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadMetadata):
            return
        assert self.store is not None and self.cache is not None
        for block_hash in meta.drops:
            self.store.drop(block_hash)
        if not meta.saves:
            return
        import torch

        tensor = self.cache.tensor
        for block, block_hash in meta.saves:
            try:
                data = tensor[:, :, self._slots(block)]
                # one copy, owned by the store: out of the cache (and off the device)
                self.store.put(block_hash, data.clone(memory_format=torch.contiguous_format)
                               if data.device.type == "cpu" else data.cpu())
            except OSError as exc:  # a later load of it fails and is recomputed
                logger.warning("KV offload: saving block %s failed: %s", block_hash.hex(), exc)
        self._finished_sending.add(meta.save_id)

    def get_finished(self) -> tuple[set[str], set[str], set[int]]:
        done = (self._finished_sending, self._finished_recving, self._invalid)
        self._finished_sending, self._finished_recving, self._invalid = set(), set(), set()
        return done
