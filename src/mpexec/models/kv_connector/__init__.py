"""KV connectors: KV blocks loaded from and saved to outside the paged cache.

``base`` holds the interface both sides speak and the configuration;
``offload`` the CPU (and disk) offload connector; ``shared`` disaggregated
prefill through a shared-memory directory; ``peer`` disaggregated prefill
from a producer's KV caches in shared memory (``shared_cache``), on this
machine or over authenticated ZeroMQ (``peer_wire``).
"""

from mpexec.models.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
    KVTransferError,
    create_connector,
)

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "KVConnectorRole", "KVTransferConfig",
           "KVTransferError", "create_connector"]
