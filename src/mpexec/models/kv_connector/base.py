"""The KV connector interface: moving KV blocks in and out of the paged cache.

One connector class serves two roles, each with its own instance:

- **scheduler side** (in the engine process), per step::

      get_num_new_matched_tokens(request, num_computed)  -> tokens it can load
      update_state_after_alloc(request, block_ids, n)    -> remember what to load where
      build_connector_meta(scheduler_output)             -> what workers do this step
      blocks_allocated([block, ...])                    <- blocks handed out for new KV
      blocks_computed([(block, hash), ...])             <- full blocks this step computes
      update_connector_output(kv_connector_output)       <- what every worker finished
      request_finished(request, block_ids)               <- it ended (its blocks are freed
                                                            at once: a connector saves
                                                            blocks while they are held)

- **worker side** (in every worker), around each ``execute_model``::

      bind_connector_metadata(meta)
      start_load_kv()  ─ forward (wait_for_layer_load / save_kv_layer per stage) ─
      wait_for_save()  ─ get_finished() -> (finished sending, finished receiving)

Transfers are named by string ids (a request id for a load).  A worker
reports an id in ``finished_sending`` / ``finished_recving`` once its own
part is done; the executor's ``KVOutputAggregator`` counts the workers, and
the scheduler side sees an id only when *every* worker reported it.  A
worker that could not load a block reports it in ``invalid_block_ids``
(merged over the workers) with the load finished: the scheduler side then
recomputes those tokens, never using the block.

``kv_transfer_config`` (``LLM(kv_transfer_config=...)``,
``--kv-transfer-config`` JSON) picks the connector::

    {"kv_connector": "CPUOffloadConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"cpu_bytes": 1 << 30, "disk_path": "/var/cache/kv"}}
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import Any

from mpexec.errors import MpexecError

CONNECTORS = {
    "CPUOffloadConnector": "mpexec.models.kv_connector.offload:CPUOffloadConnector",
    "PeerKVConnector": "mpexec.models.kv_connector.peer:PeerKVConnector",
    "SharedStorageConnector": "mpexec.models.kv_connector.shared:SharedStorageConnector",
}


class KVTransferError(MpexecError, RuntimeError):
    """A request's KV could not be had from its peer (unreachable, died, overwritten).

    The request does not fail: its tokens are computed locally instead.
    ``req_id`` names the request, ``peer`` the other side (an endpoint).
    """

    def __init__(self, message: str, *, req_id: str, peer: str) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.peer = peer


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector, in which role, with what settings; the engine adds the rest.

    ``namespace`` names what the KV depends on besides the tokens (model,
    dtype, block size, parallel layout): stores of different namespaces
    never mix.  ``world_size`` is the number of workers (each keeps its own
    share of every block).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    namespace: str = ""
    block_size: int = 16
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS and ":" not in self.kv_connector:
            raise ValueError(f"unknown kv_connector {self.kv_connector!r}: expected one of "
                             f"{sorted(CONNECTORS)} or 'module:Class'")
        if self.kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"kv_role must be kv_both, kv_producer or kv_consumer; "
                             f"got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a dict")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], **engine_fields: Any) -> KVTransferConfig:
        unknown = set(raw) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}")
        if "kv_connector" not in raw:
            raise ValueError("kv_transfer_config needs 'kv_connector'")
        return cls(**raw, **engine_fields)

    def to_dict(self) -> dict[str, Any]:
        return {"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                "kv_connector_extra_config": dict(self.kv_connector_extra_config),
                "namespace": self.namespace, "block_size": self.block_size,
                "world_size": self.world_size}


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the workers for one step (connector-specific)."""


class KVConnectorBase:
    """Both sides of a connector; a subclass implements the methods of its roles."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, rank: int = 0) -> None:
        self.config = config
        self.role = role
        self.rank = rank
        self._metadata: KVConnectorMetadata | None = None

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens of ``request`` past ``num_computed_tokens`` that can be loaded from outside."""
        raise NotImplementedError

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The blocks allocated for the ``num_external_tokens`` to load."""
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's work for the workers; resets the scheduler side's step state."""
        raise NotImplementedError

    def update_connector_output(self, kv_connector_output: Any) -> None:
        """Transfers every worker finished (the aggregated output of a step)."""

    def blocks_allocated(self, block_ids: list[int]) -> None:
        """Blocks just handed out for new KV: what they held is about to be overwritten."""

    def blocks_computed(self, blocks: list[tuple[int, bytes]]) -> None:
        """Full blocks (id, prefix hash) whose KV this step computes; held while it runs."""

    def load_failed(self, hashes: list[bytes]) -> None:
        """A load of these blocks failed on some worker; they are recomputed."""

    def request_finished(self, request: Any, block_ids: list[int]) -> None:
        """``request`` ended; ``block_ids`` are released right after this call."""

    def has_pending_work(self) -> bool:
        """Whether a step should run for the connector alone (no tokens to compute)."""
        return False

    def close(self) -> None:
        """Stop what the connector started (threads, sockets, shared memory); idempotent."""

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any) -> None:
        """The worker's paged KV cache (once, after ``initialize_cache``)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Begin (or do) this step's loads, before the forward writes anything."""
        raise NotImplementedError

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Block until ``layer_index``'s part of the loads is in the cache."""

    def save_kv_layer(self, layer_index: int, kv_layer: Any) -> None:
        """Layer ``layer_index`` has been computed: start saving its part."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done (the cache may then be overwritten)."""
        raise NotImplementedError

    def get_finished(self) -> tuple[set[str], set[str], set[int]]:
        """Ids whose sends and receives finished on this worker, and blocks it failed to load."""
        raise NotImplementedError


def create_connector(config: KVTransferConfig, role: KVConnectorRole,
                     rank: int = 0) -> KVConnectorBase:
    spec = CONNECTORS.get(config.kv_connector, config.kv_connector)
    module_name, _, qualname = spec.partition(":")
    cls = getattr(importlib.import_module(module_name), qualname)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise TypeError(f"kv_connector {config.kv_connector!r} is not a KVConnectorBase")
    connector: KVConnectorBase = cls(config, role, rank)
    return connector
