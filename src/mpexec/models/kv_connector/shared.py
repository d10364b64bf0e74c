"""Disaggregated prefill on one machine: KV blocks shared through a directory in shared memory.

A producer engine (``kv_role="kv_producer"``) computes prompts (usually
with ``max_tokens=1``) and saves every full block it computes; a consumer
engine (``kv_role="kv_consumer"``) with the same model, dtype and block
size finds them and loads them instead of computing its prompts.  The two
may use different TP and PP layouts: each worker stores its *shard* of a
block (its layers, its KV heads) in a file named by those ranges, and a
worker of the other side assembles what it needs from whichever shards
cover it::

    <path>/<digest of model, dtype, block size>/<block hash>/
        L<first>-<stop>.H<first>-<stop>.kv     one per producer worker (raw bytes)
        complete                               written once every worker saved

The producer's scheduler side writes ``complete`` when every producer
worker reported the save (the executor's aggregator), so a consumer never
sees a block in which a shard is missing or half written (shards are
written to a temporary name and renamed).  A producer that dies mid-way
leaves blocks without ``complete``: the consumer recomputes them.  A
consumer worker that finds a shard missing or short reports the block
invalid, and the consumer's scheduler recomputes.  ``path`` should be on a
shared-memory file system (``/dev/shm``, the default) for memory speed.
Blocks are not removed by the connector: the directory is the deployment's
to clean (or a tmpfs whose lifetime is the deployment's).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from mpexec.models.kv_connector.base import (
    KVConnectorBase,
    KVConnectorRole,
    KVTransferConfig,
)
from mpexec.models.kv_connector.offload import LoadSpec, OffloadMetadata

_SHARD = re.compile(r"L(\d+)-(\d+)\.H(\d+)-(\d+)\.kv")


def _root(config: KVTransferConfig) -> Path:
    path = config.kv_connector_extra_config.get("path", "/dev/shm/mpexec-kv")
    key = f"{config.namespace}|{config.block_size}"
    return Path(path) / hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


class SharedStorageConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, rank: int = 0) -> None:
        super().__init__(config, role, rank)
        unknown = set(config.kv_connector_extra_config) - {"path"}
        if unknown:
            raise ValueError(f"SharedStorageConnector: unknown settings {sorted(unknown)}")
        self.root = _root(config)
        self.produces = config.kv_role in ("kv_producer", "kv_both")
        self.consumes = config.kv_role in ("kv_consumer", "kv_both")
        # scheduler side
        self._saving: set[bytes] = set()
        self._pending_saves: dict[str, list[bytes]] = {}
        self._step_saves: list[tuple[int, bytes]] = []
        self._step_loads: list[LoadSpec] = []
        self._next_save = 0
        self.num_loaded_blocks = 0
        self.num_saved_blocks = 0
        self.num_failed_loads = 0
        # worker side
        self.cache: Any = None
        self.layers = (0, 0)
        self.kv_heads = (0, 0)
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._invalid: set[int] = set()

    def _complete(self, block_hash: bytes) -> Path:
        return self.root / block_hash.hex() / "complete"

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if not self.consumes:
            return 0
        size = self.config.block_size
        usable = min((request.num_tokens - 1) // size, len(request.block_hashes))
        count = 0
        for index in range(num_computed_tokens // size, usable):
            if not self._complete(request.block_hashes[index]).exists():
                break
            count += 1
        return count * size

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        first = len(request.block_ids) - len(block_ids)
        hashes = request.block_hashes[first:first + num_external_tokens // self.config.block_size]
        self.num_loaded_blocks += len(hashes)
        self._step_loads.append(LoadSpec(request.req_id, list(block_ids), list(hashes)))

    def blocks_computed(self, blocks: list[tuple[int, bytes]]) -> None:
        if not self.produces:
            return
        for block, block_hash in blocks:
            if block_hash in self._saving or self._complete(block_hash).exists():
                continue
            self._saving.add(block_hash)
            self._step_saves.append((block, block_hash))

    def has_pending_work(self) -> bool:
        return bool(self._step_loads)

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMetadata:
        meta = OffloadMetadata(saves=self._step_saves, loads=self._step_loads)
        if meta.saves:
            meta.save_id = f"share-{self._next_save}"
            self._next_save += 1
            self._pending_saves[meta.save_id] = [h for _, h in meta.saves]
        self._step_saves, self._step_loads = [], []
        return meta

    def update_connector_output(self, kv_connector_output: Any) -> None:
        for save_id in kv_connector_output.finished_sending or ():
            for block_hash in self._pending_saves.pop(save_id, ()):
                self._saving.discard(block_hash)
                marker = self._complete(block_hash)
                if marker.parent.is_dir():
                    marker.touch()
                    self.num_saved_blocks += 1

    def load_failed(self, hashes: list[bytes]) -> None:
        self.num_failed_loads += 1

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.cache = kv_cache
        self.layers = kv_cache.layer_range
        self.kv_heads = kv_cache.kv_head_range

    def _slots(self, block: int) -> slice:
        size = self.config.block_size
        return slice(block * size, (block + 1) * size)

    def _shard_name(self) -> str:
        return f"L{self.layers[0]}-{self.layers[1]}.H{self.kv_heads[0]}-{self.kv_heads[1]}.kv"

    def wait_for_save(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadMetadata) or not meta.saves:
            return
        tensor = self.cache.tensor
        import torch

        for block, block_hash in meta.saves:
            directory = self.root / block_hash.hex()
            directory.mkdir(parents=True, exist_ok=True)
            target = directory / self._shard_name()
            temporary = target.with_suffix(f".{os.getpid()}.tmp")
            data = tensor[:, :, self._slots(block)]
            data = data.contiguous() if data.device.type == "cpu" else data.cpu()
            data.view(-1).view(torch.uint8).numpy().tofile(temporary)
            os.replace(temporary, target)
        self._finished_sending.add(meta.save_id)

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, OffloadMetadata) or not meta.loads:
            return
        tensor = self.cache.tensor
        for load in meta.loads:
            for block, block_hash in zip(load.block_ids, load.hashes, strict=True):
                if not self._load_block(tensor[:, :, self._slots(block)], block_hash):
                    self._invalid.add(block)
            self._finished_recving.add(load.req_id)

    def _load_block(self, target: Any, block_hash: bytes) -> bool:
        """Fill ``target`` [local layers, 2, block, local KV heads, d] from the shards."""
        import numpy
        import torch

        directory = self.root / block_hash.hex()
        (l0, l1), (h0, h1) = self.layers, self.kv_heads
        covered = torch.zeros((l1 - l0, h1 - h0), dtype=torch.bool)
        try:
            names = os.listdir(directory)
        except OSError:
            return False
        for name in names:
            match = _SHARD.fullmatch(name)
            if match is None:
                continue
            sl0, sl1, sh0, sh1 = map(int, match.groups())
            lo, hi = max(l0, sl0), min(l1, sl1)
            ho, hj = max(h0, sh0), min(h1, sh1)
            if lo >= hi or ho >= hj:
                continue
            shape = (sl1 - sl0, 2, target.shape[2], sh1 - sh0, target.shape[4])
            try:
                raw = numpy.fromfile(directory / name, dtype=numpy.uint8)
            except OSError:
                return False
            expected = target.element_size()
            for dim in shape:
                expected *= dim
            if raw.size != expected:
                return False
            shard = torch.from_numpy(raw).view(target.dtype).view(shape)
            target[lo - l0:hi - l0, :, :, ho - h0:hj - h0].copy_(
                shard[lo - sl0:hi - sl0, :, :, ho - sh0:hj - sh0])
            covered[lo - l0:hi - l0, ho - h0:hj - h0] = True
        return bool(covered.all())

    def get_finished(self) -> tuple[set[str], set[str], set[int]]:
        done = (self._finished_sending, self._finished_recving, self._invalid)
        self._finished_sending, self._finished_recving, self._invalid = set(), set(), set()
        return done
