"""Disaggregated prefill from a producer's KV caches, locally or over ZeroMQ.

A producer engine (``kv_role="kv_producer"``) computes prompts; each of
its workers keeps its paged KV cache in shared memory
(:class:`SharedCache`: one memfd per worker, its layers, its KV heads,
with a generation per block).  A consumer engine (``kv_role="kv_consumer"``,
any TP/PP layout) asks the producer which of a request's blocks it holds
and loads them instead of computing::

    consumer scheduler ── LOOKUP(hashes) ──> producer scheduler (index: hash -> block, gen)
                       <── instance, producer world size, [(block, gen), ...]
    consumer worker ── DESCRIBE ──> producer worker r (endpoint port + 1 + r)
                    <── its layers, heads, cache layout, memfd (pid, fd, inode)
        transport "shm": map the producer worker's cache once; per load, one strided
                         copy per run of consecutive blocks, straight from its cache
                         into ours (a generation check around it)
        transport "zmq": FETCH(blocks, gens, layers, heads) -> the bytes, gathered from
                         the producer worker's cache by its server thread into a ring
                         of RING_SLOTS reused send buffers and sent in chunks (about
                         CHUNK_BYTES), each copied into our cache as it arrives:
                         hashing, sending and copying overlap

Every message is authenticated (:mod:`peer_wire`); ``endpoint`` is the
producer scheduler's ``tcp://host:port`` (its workers use the next ports).

Generations.  The producer's scheduler side sees every block the block
manager hands out (:meth:`blocks_allocated`): such a block is about to be
overwritten, so it leaves the index and its generation becomes odd; the
workers store that generation before the step's forward runs.  A full
block the step computes (:meth:`blocks_computed`) gets the next, even,
generation, which the workers store after the forward; the scheduler
publishes it in its index only once *every* producer worker reported it
stored (the executor's aggregator).  A consumer copies a block only if
its generation is the published one before and after the copy, so a
block reused while it was being read is reported invalid and recomputed,
never used.  Blocks stay loadable while the producer keeps them in its
prefix cache (freed blocks are reused last; keep prefix caching on).

Failures are per request and bounded: a LOOKUP, DESCRIBE or FETCH that gets
no reply within ``timeout_s`` (a dead or stalled producer) makes the
consumer record a :class:`KVTransferError` for the request
(``connector.transfer_errors``, the latest ``MAX_ERRORS_KEPT``) and
compute the tokens itself; blocks allocated for a failed load go back to
the block manager through the scheduler's recompute path.  After a
timeout the consumer does not ask that peer again for ``RETRY_S``
seconds, so a dead producer costs one timeout, not one per request.
Nothing the consumer does keeps state on the producer, so a consumer that
dies leaves nothing behind there.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mpexec.envs import load_envs
from mpexec.ipc.shm import SegmentRef
from mpexec.models.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
    KVTransferError,
)
from mpexec.models.kv_connector.peer_wire import (
    KIND_DESCRIBE,
    KIND_FETCH,
    KIND_LOOKUP,
    PeerClient,
    PeerServer,
    SendRing,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
RETRY_S = 5.0
MAX_ERRORS_KEPT = 1024  # the latest requests' errors (a long-running server's memory)
# A FETCH reply's chunk (whole planes), hashed while the last one travels.  Measured
# on 69 MB (1.15 MB planes): chunks of 1-2 MiB (one plane) cost 15-20% more CPU than
# 4-8 MiB (per-message work on both sides); 16 MiB overlapped too little.
CHUNK_BYTES = 4 << 20
RING_SLOTS = 4  # FETCH chunks gathered ahead of the socket (the SendRing)
_SETTINGS = {"endpoint", "transport", "timeout_s", "secret"}


def worker_endpoint(endpoint: str, rank: int) -> str:
    """Producer worker ``rank``'s endpoint: the scheduler's port + 1 + rank."""
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + 1 + rank}"


@dataclass
class PeerLoad:
    req_id: str
    block_ids: list[int]  # the consumer's
    sources: list[int]  # the producer's blocks holding them
    gens: list[int]  # their published generations
    instance: str  # which producer run the blocks belong to
    world: int  # how many producer workers hold shards


@dataclass
class PeerMetadata(KVConnectorMetadata):
    instance: str = ""
    save_id: str = ""
    reused: list[tuple[int, int]] = field(default_factory=list)  # (block, odd gen), before
    saves: list[tuple[int, int]] = field(default_factory=list)  # (block, even gen), after
    loads: list[PeerLoad] = field(default_factory=list)


@dataclass
class _Shard:
    """A producer worker as a consumer worker knows it."""

    instance: str
    shape: Any  # CacheShape
    cache: Any = None  # SharedCache, mapped (transport "shm")


class PeerKVConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, rank: int = 0) -> None:
        super().__init__(config, role, rank)
        extra = config.kv_connector_extra_config
        unknown = set(extra) - _SETTINGS
        if unknown:
            raise ValueError(f"PeerKVConnector: unknown settings {sorted(unknown)}")
        if config.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError("PeerKVConnector: kv_role must be kv_producer or kv_consumer")
        self.endpoint = str(extra.get("endpoint", ""))
        base, _, port = self.endpoint.rpartition(":")
        if not base.startswith("tcp://") or not port.isdigit():
            raise ValueError(f"PeerKVConnector: endpoint must be tcp://host:port; "
                             f"got {self.endpoint!r}")
        self.transport = str(extra.get("transport", "shm"))
        if self.transport not in ("shm", "zmq"):
            raise ValueError(f"PeerKVConnector: transport must be shm or zmq; "
                             f"got {self.transport!r}")
        self.timeout_s = float(extra.get("timeout_s", DEFAULT_TIMEOUT_S))
        if self.timeout_s <= 0:
            raise ValueError("PeerKVConnector: timeout_s > 0 needed")
        secret = extra.get("secret") or load_envs().cluster_secret
        if not secret:
            raise ValueError("PeerKVConnector needs a secret: kv_connector_extra_config "
                             "'secret' or MPEXEC_CLUSTER_SECRET (the same on both sides)")
        self._secret: str = str(secret)
        self.produces = config.kv_role == "kv_producer"
        self.consumes = not self.produces
        self._lock = threading.Lock()  # the index, against the LOOKUP server's thread
        # scheduler side, producer
        self.instance = secrets.token_hex(8)
        self._index: dict[bytes, tuple[int, int]] = {}  # hash -> (block, gen): published
        self._owner: dict[int, bytes] = {}  # block -> hash: published or being saved
        self._gen: dict[int, int] = {}  # block -> its generation (odd: being written)
        self._saving: set[bytes] = set()
        self._step_reused: list[tuple[int, int]] = []
        self._step_saves: list[tuple[int, int]] = []
        self._step_published: list[tuple[bytes, int, int]] = []
        self._pending: dict[str, list[tuple[bytes, int, int]]] = {}
        self._next_save = 0
        self.num_saved_blocks = 0
        # scheduler side, consumer
        self._found: dict[str, tuple[str, int, list[list[int]]]] = {}
        self._loads: dict[str, list[int]] = {}
        self._step_loads: list[PeerLoad] = []
        self._down_until = 0.0
        self.transfer_errors: dict[str, KVTransferError] = {}
        self.num_loaded_blocks = 0
        self.num_failed_loads = 0
        # worker side
        self.cache: Any = None
        self.shared: Any = None  # SharedCache: this producer worker's cache
        self._worker_instance = ""
        self._shards: dict[str, _Shard] = {}
        self._dead_until: dict[str, float] = {}
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._invalid: set[int] = set()
        # sockets: the producer's servers start with their side; clients on first use
        self._server: PeerServer | None = None
        # the shard server's send buffers; a consumer that takes none for timeout_s has
        # given up on its stream (its own timeout_s, the same by default)
        self._ring = SendRing(RING_SLOTS, self.timeout_s)
        self._clients: dict[str, PeerClient] = {}
        if role is KVConnectorRole.SCHEDULER and self.produces:
            self._server = PeerServer(self.endpoint, self._secret, self._serve_index,
                                      "KV index server")

    def _client(self, endpoint: str) -> PeerClient:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = PeerClient(endpoint, self._secret,
                                                          f"KV client {self.rank}")
        return client

    # -- scheduler side: producer ----------------------------------------------------

    def blocks_allocated(self, block_ids: list[int]) -> None:
        if not self.produces:
            return
        for block in block_ids:
            gen = self._gen.get(block, 0)
            if gen % 2:
                continue  # already marked as being written; nothing published holds it
            self._gen[block] = gen + 1
            self._step_reused.append((block, gen + 1))
            with self._lock:
                old = self._owner.pop(block, None)
                if old is not None and self._index.get(old, (None, 0))[0] == block:
                    del self._index[old]

    def blocks_computed(self, blocks: list[tuple[int, bytes]]) -> None:
        if not self.produces:
            return
        for block, block_hash in blocks:
            if block_hash in self._index or block_hash in self._saving:
                continue
            gen = self._gen.get(block, 0)
            if not gen % 2:  # not handed out through blocks_allocated: never offered
                logger.debug("block %d computed without being allocated: not offered", block)
                continue
            self._gen[block] = gen + 1
            self._owner[block] = block_hash
            self._saving.add(block_hash)
            self._step_saves.append((block, gen + 1))
            self._step_published.append((block_hash, block, gen + 1))

    def _publish(self, save_id: str) -> None:
        for block_hash, block, gen in self._pending.pop(save_id, ()):
            self._saving.discard(block_hash)
            with self._lock:
                if self._owner.get(block) == block_hash and self._gen.get(block) == gen:
                    self._index[block_hash] = (block, gen)
                    self.num_saved_blocks += 1

    def _serve_index(self, kind: int, request: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        if kind != KIND_LOOKUP:
            raise ValueError(f"unexpected request kind {kind}")
        blocks = []
        with self._lock:
            for text in request["hashes"]:
                entry = self._index.get(bytes.fromhex(text))
                if entry is None:
                    break
                blocks.append(list(entry))
        return {"instance": self.instance, "world": self.config.world_size,
                "blocks": blocks}, []

    # -- scheduler side: consumer ----------------------------------------------------

    def _failed(self, req_id: str, message: str) -> None:
        logger.warning("%s: KV transfer from %s failed (%s); computing it here", req_id,
                       self.endpoint, message)
        self.transfer_errors[req_id] = KVTransferError(message, req_id=req_id,
                                                       peer=self.endpoint)
        while len(self.transfer_errors) > MAX_ERRORS_KEPT:
            del self.transfer_errors[next(iter(self.transfer_errors))]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if not self.consumes or time.monotonic() < self._down_until:
            return 0
        size = self.config.block_size
        first = num_computed_tokens // size
        usable = min((request.num_tokens - 1) // size, len(request.block_hashes))
        if usable <= first:
            return 0
        hashes = [h.hex() for h in request.block_hashes[first:usable]]
        try:
            reply, _ = self._client(self.endpoint).request(KIND_LOOKUP, {"hashes": hashes},
                                                           self.timeout_s)
        except (TimeoutError, ValueError, OSError) as exc:
            self._down_until = time.monotonic() + RETRY_S
            self._failed(request.req_id, f"lookup: {exc}")
            return 0
        if "error" in reply:
            self._failed(request.req_id, f"lookup refused: {reply['error']}")
            return 0
        blocks = reply["blocks"]
        self._found[request.req_id] = (str(reply["instance"]), int(reply["world"]), blocks)
        return len(blocks) * size

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        instance, world, blocks = self._found.pop(request.req_id)
        blocks = blocks[:num_external_tokens // self.config.block_size]
        self._step_loads.append(PeerLoad(request.req_id, list(block_ids),
                                         [int(b) for b, _ in blocks],
                                         [int(g) for _, g in blocks], instance, world))
        self._loads[request.req_id] = list(block_ids)
        self.num_loaded_blocks += len(blocks)

    def has_pending_work(self) -> bool:
        return bool(self._step_loads)

    def build_connector_meta(self, scheduler_output: Any) -> PeerMetadata:
        meta = PeerMetadata(instance=self.instance, reused=self._step_reused,
                            saves=self._step_saves, loads=self._step_loads)
        if meta.saves:
            meta.save_id = f"peer-{self._next_save}"
            self._next_save += 1
            self._pending[meta.save_id] = self._step_published
        self._step_reused, self._step_saves, self._step_published = [], [], []
        self._step_loads = []
        return meta

    def update_connector_output(self, kv_connector_output: Any) -> None:
        for save_id in kv_connector_output.finished_sending or ():
            self._publish(save_id)
        invalid = kv_connector_output.invalid_block_ids or set()
        for req_id in kv_connector_output.finished_recving or ():
            blocks = self._loads.pop(req_id, [])
            if invalid & set(blocks):
                self._failed(req_id, f"{len(invalid & set(blocks))} of {len(blocks)} blocks "
                                     "could not be loaded")

    def load_failed(self, hashes: list[bytes]) -> None:
        self.num_failed_loads += 1

    def request_finished(self, request: Any, block_ids: list[int]) -> None:
        self._found.pop(request.req_id, None)

    # -- worker side: producer -------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.cache = kv_cache
        if not self.produces:
            return
        from mpexec.models.kv_connector.shared_cache import SharedCache

        self.shared = SharedCache.create(kv_cache)  # the cache's tensor is now shared
        self._server = PeerServer(worker_endpoint(self.endpoint, self.rank), self._secret,
                                  self._serve_shard, f"KV shard server {self.rank}")

    def start_load_kv(self) -> None:
        meta = self._metadata
        if not isinstance(meta, PeerMetadata):
            return
        if self.produces:
            self._worker_instance = meta.instance  # known before any block is offered
            if meta.reused:  # before the forward may write them
                self.shared.set_generations(meta.reused)
            return
        for load in meta.loads:
            if not self._load(load):
                self._invalid.update(load.block_ids)
            self._finished_recving.add(load.req_id)

    def wait_for_save(self) -> None:
        meta = self._metadata
        if not isinstance(meta, PeerMetadata) or not self.produces or not meta.saves:
            return
        self.shared.set_generations(meta.saves)  # the forward wrote them: whole
        self._finished_sending.add(meta.save_id)

    def _serve_shard(self, kind: int, request: dict[str, Any]) -> Any:
        shared = self.shared
        if kind == KIND_DESCRIBE:
            ref = shared.ref()
            return {"instance": self._worker_instance, "shape": shared.shape.to_dict(),
                    "segment": [ref.pid, ref.fd, ref.inode, ref.size]}, []
        if kind != KIND_FETCH:
            raise ValueError(f"unexpected request kind {kind}")
        return self._fetch(request)

    def _fetch(self, request: dict[str, Any]) -> Iterator[tuple[dict[str, Any], list[Any]]]:
        """The blocks' bytes for the asked layers and heads, a few planes per reply.

        A *plane* is one layer's K or V of the asked blocks and heads; the
        planes of ``layers`` are numbered layer-major (``2 * layer + kv``).
        Each chunk is gathered into a buffer of the send ring between two
        generation checks (the cache may be overwritten once they passed; a
        buffer handed to ZeroMQ is not, until ZeroMQ has sent it).
        """
        import torch

        from mpexec.models.kv_connector.shared_cache import runs

        shared = self.shared
        blocks, gens = list(request["blocks"]), list(request["gens"])
        (lo, hi), (ho, hj) = request["layers"], request["heads"]
        (l0, l1), (h0, h1) = shared.shape.layers, shared.shape.heads
        if not (l0 <= lo < hi <= l1 and h0 <= ho < hj <= h1):
            raise ValueError("layers or heads outside this shard")
        if any(not 0 <= b < shared.shape.num_blocks - 1 for b in blocks):
            raise ValueError("a block outside this cache")
        size = shared.shape.block_size
        tokens = len(blocks) * size
        source = shared.data[lo - l0:hi - l0, :, :, ho - h0:hj - h0]
        source = source.view(-1, *source.shape[2:])  # [planes, slots, heads, head_dim]
        planes = source.shape[0]
        plane_bytes = tokens * (hj - ho) * shared.shape.head_dim * shared.data.element_size()
        step = max(1, CHUNK_BYTES // max(plane_bytes, 1))
        pairs = list(runs([(b, i) for i, b in enumerate(blocks)]))
        for first in range(0, planes, step):
            last = min(first + step, planes)
            buffer = self._ring.take((last - first) * plane_bytes)
            out = torch.frombuffer(buffer, dtype=source.dtype)
            out = out.view(last - first, tokens, *source.shape[2:])
            if not shared.whole(blocks, gens):
                yield {"ok": False}, []
                return
            for block, index, count in pairs:
                out[:, index * size:(index + count) * size].copy_(
                    source[first:last, block * size:(block + count) * size])
            if not shared.whole(blocks, gens):
                yield {"ok": False}, []
                return
            reply: dict[str, Any] = {"ok": True, "planes": [first, last]}
            if last < planes:
                reply["more"] = True
            yield reply, [self._ring.frame()]

    # -- worker side: consumer -------------------------------------------------------

    def _shard(self, endpoint: str, instance: str) -> _Shard | None:
        """Producer worker ``endpoint`` of run ``instance``, described (and mapped)."""
        shard = self._shards.get(endpoint)
        if shard is not None and shard.instance == instance:
            return shard
        if shard is not None and shard.cache is not None:
            shard.cache.close()
        self._shards.pop(endpoint, None)
        from mpexec.models.kv_connector.shared_cache import CacheShape, SharedCache

        reply, _ = self._client(endpoint).request(KIND_DESCRIBE, {}, self.timeout_s)
        if reply.get("instance") != instance:
            raise ValueError(f"{endpoint} serves another producer run")
        shard = _Shard(instance, CacheShape.from_dict(reply["shape"]))
        if self.transport == "shm":
            shard.cache = SharedCache.attach(SegmentRef(*reply["segment"]), shard.shape)
        self._shards[endpoint] = shard
        return shard

    def _load(self, load: PeerLoad) -> bool:
        """Copy the load's blocks (this worker's layers and heads) in; False if it could not."""
        import torch

        (cl0, cl1), (ch0, ch1) = self.cache.layer_range, self.cache.kv_head_range
        covered = torch.zeros((cl1 - cl0, ch1 - ch0), dtype=torch.bool)
        for rank in range(load.world):
            endpoint = worker_endpoint(self.endpoint, rank)
            if time.monotonic() < self._dead_until.get(endpoint, 0.0):
                return False
            try:
                shard = self._shard(endpoint, load.instance)
                assert shard is not None
                shape = shard.shape
                lo, hi = max(cl0, shape.layers[0]), min(cl1, shape.layers[1])
                ho, hj = max(ch0, shape.heads[0]), min(ch1, shape.heads[1])
                if lo >= hi or ho >= hj:
                    continue
                if (shape.block_size != self.config.block_size
                        or shape.dtype != str(self.cache.tensor.dtype).removeprefix("torch.")):
                    raise ValueError("the producer's block size or dtype differs")
                if any(not 0 <= b < shape.num_blocks - 1 for b in load.sources):
                    raise ValueError("a block outside the producer's cache")
                copied = self._copy_shm(shard, load, (lo, hi), (ho, hj)) \
                    if shard.cache is not None else self._copy_zmq(endpoint, load, (lo, hi),
                                                                    (ho, hj))
            except (TimeoutError, OSError, ValueError, KeyError) as exc:
                self._dead_until[endpoint] = time.monotonic() + RETRY_S
                logger.warning("KV load of %s from %s failed: %s", load.req_id, endpoint, exc)
                return False
            if not copied:
                return False
            covered[lo - cl0:hi - cl0, ho - ch0:hj - ch0] = True
        return bool(covered.all())

    def _target(self, layers: tuple[int, int], heads: tuple[int, int]) -> Any:
        (cl0, _), (ch0, _) = self.cache.layer_range, self.cache.kv_head_range
        return self.cache.tensor[layers[0] - cl0:layers[1] - cl0, :, :,
                                 heads[0] - ch0:heads[1] - ch0]

    def _copy_shm(self, shard: _Shard, load: PeerLoad, layers: tuple[int, int],
                  heads: tuple[int, int]) -> bool:
        """One copy per run of blocks, the producer's cache -> ours, between generation checks."""
        from mpexec.models.kv_connector.shared_cache import runs

        peer, size = shard.cache, self.config.block_size
        (l0, _), (h0, _) = shard.shape.layers, shard.shape.heads
        source = peer.data[layers[0] - l0:layers[1] - l0, :, :, heads[0] - h0:heads[1] - h0]
        target = self._target(layers, heads)
        if not peer.whole(load.sources, load.gens):
            return False
        for first, block, count in runs(list(zip(load.sources, load.block_ids, strict=True))):
            target[:, :, block * size:(block + count) * size].copy_(
                source[:, :, first * size:(first + count) * size])
        return bool(peer.whole(load.sources, load.gens))

    def _copy_zmq(self, endpoint: str, load: PeerLoad, layers: tuple[int, int],
                  heads: tuple[int, int]) -> bool:
        """The blocks fetched in chunks of planes (see :meth:`_fetch`), each copied
        in as it arrives, while the next one is hashed and sent."""
        import torch

        from mpexec.models.kv_connector.shared_cache import runs

        target = self._target(layers, heads)
        target = target.view(-1, *target.shape[2:])  # [planes, slots, heads, head_dim]; no copy
        size = self.config.block_size
        tokens = len(load.sources) * size
        plane = tokens * target.shape[2] * target.shape[3]
        pairs = list(runs([(i, b) for i, b in enumerate(load.block_ids)]))
        done = 0
        for reply, parts in self._client(endpoint).stream(
                KIND_FETCH, {"blocks": load.sources, "gens": load.gens, "layers": list(layers),
                             "heads": list(heads)}, self.timeout_s):
            if not reply.get("ok") or len(parts) != 1:
                return False
            first, last = (int(x) for x in reply["planes"])
            if first != done or not first < last <= target.shape[0]:
                return False
            with warnings.catch_warnings():  # a received frame is read-only; it is only read
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(parts[0], dtype=target.dtype)
            if data.numel() != (last - first) * plane:
                return False
            data = data.view(last - first, tokens, *target.shape[2:])
            for index, block, count in pairs:
                target[first:last, block * size:(block + count) * size].copy_(
                    data[:, index * size:(index + count) * size])
            done = last
        return done == target.shape[0]

    def get_finished(self) -> tuple[set[str], set[str], set[int]]:
        done = (self._finished_sending, self._finished_recving, self._invalid)
        self._finished_sending, self._finished_recving, self._invalid = set(), set(), set()
        return done

    def close(self) -> None:
        self._ring.close()  # ends a wait of the shard server's thread
        if self._server is not None:
            self._server.close()
            self._server = None
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        for shard in self._shards.values():
            if shard.cache is not None:
                shard.cache.close()
        self._shards.clear()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
