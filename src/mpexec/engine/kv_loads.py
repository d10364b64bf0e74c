"""The scheduler's side of a KV connector's loads: a prefix fetched from outside.

::

    waiting ──► offered(request, cached tokens) ─► external tokens (0: none)
            ──► start(request, hits, external)     blocks for the prefix cache's hits
                                                   and for the tokens to load; the
                                                   request WAITING_FOR_REMOTE_KVS
    a step's KVConnectorOutput ──► finish(kv) ─► (ready, failed)
        ready:  every worker loaded its blocks: it runs from past the loaded tokens
        failed: a worker could not: the blocks are freed and the request waits
                again, to recompute them (``skip_kv_load``)

The scheduler owns the queues and moves the requests ``finish`` returns;
this class owns the requests in flight (``loading``) and the calls into the
connector that go with them.  A request aborted while it loads is
``drop``-ped: the load in flight writes its blocks before any later step
can reuse them, so they are freed at once.
"""

from __future__ import annotations

import logging
from typing import Any

from mpexec.engine.block_manager import BlockManager
from mpexec.engine.request import Request, RequestStatus
from mpexec.models.kv_connector import KVConnectorBase

logger = logging.getLogger(__name__)


class KVLoads:
    def __init__(self, connector: KVConnectorBase, blocks: BlockManager,
                 block_size: int) -> None:
        self.connector = connector
        self.blocks = blocks
        self.block_size = block_size
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS

    def offered(self, request: Request, num_cached: int) -> int:
        """Tokens past the ``num_cached`` the connector can load for ``request``."""
        if request.skip_kv_load or request.sampling_params.prompt_logprobs is not None:
            return 0  # prompt logprobs need the prefix's logits: computed, not loaded
        return self.connector.get_num_new_matched_tokens(request, num_cached)

    def start(self, request: Request, hits: list[int], external: int) -> bool:
        """Blocks for the cached prefix and the tokens to load, and the load
        begun; False (nothing done) if they do not fit.  The caller takes the
        request off its waiting queue."""
        needed = external // self.block_size
        if not self.blocks.can_allocate(needed + self.blocks.num_unheld(hits)):
            return False
        self.blocks.take(request.req_id, hits)
        loaded = self.blocks.allocate(request.req_id, needed)
        request.block_ids = hits + loaded
        request.num_cached_blocks = len(hits)
        request.num_cached_tokens = len(hits) * self.block_size
        request.num_external_tokens = external
        self.blocks.stats.queries += request.num_tokens
        self.blocks.stats.hits += request.num_cached_tokens
        self.connector.update_state_after_alloc(request, loaded, external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.req_id] = request
        return True

    def finish(self, kv: Any) -> tuple[list[Request], list[Request]]:
        """The loads every worker finished (``kv``: a step's KVConnectorOutput):
        ``(ready, failed)``, each in the order reported."""
        self.connector.update_connector_output(kv)
        invalid = kv.invalid_block_ids or set()
        ready: list[Request] = []
        failed: list[Request] = []
        for req_id in kv.finished_recving or ():
            request = self.loading.pop(req_id, None)
            if request is None:
                continue  # aborted while loading: its blocks are already free
            loaded = request.block_ids[request.num_cached_blocks:]
            if invalid & set(loaded):
                logger.warning("%s: loading %d KV blocks failed; recomputing them", req_id,
                               len(loaded))
                first = request.num_cached_blocks
                self.connector.load_failed(request.block_hashes[first:first + len(loaded)])
                self.blocks.free(request.req_id, request.block_ids)
                request.block_ids = []
                request.num_cached_blocks = 0
                request.skip_kv_load = True
                request.status = RequestStatus.WAITING
                failed.append(request)
                continue
            request.num_computed_tokens = request.num_cached_tokens + request.num_external_tokens
            ready.append(request)
        return ready, failed

    def drop(self, request: Request) -> None:
        """``request`` ends while it loads: its blocks are freed."""
        del self.loading[request.req_id]
        self.blocks.free(request.req_id, request.block_ids)
        request.block_ids = []
