"""KV connectors for tests, loaded by the workers as ``tests.engine.kv_connectors:Name``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from mpexec.models.kv_connector.offload import CPUOffloadConnector, OffloadMetadata
from mpexec.models.kv_connector.peer import PeerKVConnector


class LaggingOffloadConnector(CPUOffloadConnector):
    """CPU offload whose rank 1 loads late (an asynchronous transfer).

    Rank 1 copies a step's loads only after the forward of the *next* step
    and reports them then, so a scheduler that ran a request as soon as one
    worker reported its load would compute on rank 1's stale blocks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: list[list[Any]] = []  # [steps waited, metadata]
        self.lagged_loads = 0

    def start_load_kv(self) -> None:
        if self.rank != 1:
            super().start_load_kv()
            return
        current = self._metadata
        if isinstance(current, OffloadMetadata) and current.loads:
            self._deferred.append([0, OffloadMetadata(loads=current.loads)])
            self.lagged_loads += 1

    def wait_for_save(self) -> None:
        super().wait_for_save()
        current, keep = self._metadata, []
        for entry in self._deferred:
            if entry[0] >= 1:
                self._metadata = entry[1]
                super().start_load_kv()
            else:
                entry[0] += 1
                keep.append(entry)
        self._metadata, self._deferred = current, keep


class StallingPeerConnector(PeerKVConnector):
    """A producer whose workers stall on every DESCRIBE or FETCH (a hung peer).

    Before stalling (``KV_STALL_S`` seconds, default 60) it creates the file
    named by ``KV_STALL_MARKER`` (both in its environment), so that a test
    knows the consumer is mid-transfer.
    """

    def _serve_shard(self, kind: int, request: dict[str, Any]) -> tuple[dict[str, Any],
                                                                        list[Any]]:
        Path(os.environ["KV_STALL_MARKER"]).touch()
        time.sleep(float(os.environ.get("KV_STALL_S", "60")))
        return super()._serve_shard(kind, request)
