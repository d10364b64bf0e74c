"""One parallel group of ranks and its collectives: :class:`GroupCoordinator`.

A group holds up to two torch.distributed process groups over the same
ranks: ``device_group`` for tensors on the workers' device (gloo on CPU,
NCCL on CUDA) and ``cpu_group`` (always gloo) for CPU tensors and pickled
objects; with gloo they are one and the same.  A group of one rank holds
neither: every collective on it returns at once.

Which path a call takes::

    all_reduce / all_gather / gather of a CPU tensor
        every rank on one node ─▶ ShmCommunicator (shared memory)
        too large, several nodes, or shared memory refused ─▶ cpu_group (gloo)
    the same of a device tensor ─▶ device_group (NCCL)
    send / recv / send_tensor_dict in a CPU world
        both ranks on one node ─▶ ShmChannels (a MessageQueue per direction)
        otherwise ─▶ cpu_group (gloo)
    broadcast, and send / recv in a CUDA world ─▶ cpu_group for CPU tensors,
        device_group otherwise
    broadcast_object, a tensor dict's metadata over gloo, barrier ─▶ cpu_group

The shared-memory communicator is built on the first CPU collective, by
every rank of the group together (collectives run in the same order on
every rank, so the first one is the same everywhere): the ranks exchange
their node identity and pid through gloo and agree whether all could map
the segment.  ``src`` and ``dst`` arguments are ranks within the group.

A failure of a torch.distributed call (a peer gone: gloo's connection
reset, NCCL's error) escapes as ``mpexec.errors.CollectiveFailedError``
with the original as its ``__cause__`` (``liveness.CollectiveGuard``); a
shared-memory channel's dead peer stays its ``PeerDiedError``.  The driver
treats these, and only these, as the possible symptom of a death.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist

from mpexec.distributed.liveness import collective_guards
from mpexec.distributed.p2p import ShmChannels
from mpexec.distributed.shm_collectives import ShmCommunicator, node_identity

logger = logging.getLogger(__name__)

# Per-slot limit of the shared-memory path; larger tensors go through gloo.
DEFAULT_SHM_MAX_BYTES = 8 << 20


class GroupCoordinator:
    """The ranks of one parallel group, as seen from one member."""

    def __init__(self, name: str, ranks: list[int], rank: int, *,
                 device_group: Any, cpu_group: Any, device: torch.device,
                 use_shm: bool = True, shm_max_bytes: int = DEFAULT_SHM_MAX_BYTES) -> None:
        if rank not in ranks:
            raise ValueError(f"{name} group {ranks} does not contain rank {rank}")
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.world_size = len(ranks)
        self.rank_in_group = self.ranks.index(rank)
        self._guard = collective_guards(name, self.rank_in_group)  # by call name
        self.device = device
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.use_shm = use_shm and self.world_size > 1
        self.shm_max_bytes = shm_max_bytes
        self._shm: ShmCommunicator | None = None
        self._shm_decided = not self.use_shm
        # Point to point through shared memory only where every tensor is a
        # CPU tensor (a gloo world): both ends must pick the route alike.
        self._channels = (ShmChannels(rank, self._gloo_send_object, self._gloo_recv_object)
                          if self.use_shm and device.type == "cpu" else None)
        if self.world_size > 1 and (device_group is None or cpu_group is None):
            raise ValueError(f"{name} group of {self.world_size} ranks needs process groups")

    def __repr__(self) -> str:
        return (f"GroupCoordinator({self.name}, ranks={self.ranks}, "
                f"rank_in_group={self.rank_in_group})")

    # -- place in the group ------------------------------------------------------

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    @property
    def shm_active(self) -> bool:
        """True once CPU collectives of this group go through shared memory."""
        return self._shm is not None

    def point_to_point_routes(self) -> dict[tuple[int, int], str]:
        """``{(src, dst): "shm" | "gloo"}`` (global ranks) for the pairs used so far."""
        return {} if self._channels is None else self._channels.routes()

    def _group_for(self, tensor: torch.Tensor) -> Any:
        return self.cpu_group if tensor.device.type == "cpu" else self.device_group

    def _global(self, group_rank: int, what: str) -> int:
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"{what} {group_rank} is not a rank of the {self.name} group "
                             f"(size {self.world_size})")
        return self.ranks[group_rank]

    # -- shared memory -----------------------------------------------------------

    def _shm_communicator(self) -> ShmCommunicator | None:
        if self._shm_decided:
            return self._shm
        self._shm_decided = True
        peers = self.all_gather_object((node_identity(), os.getpid()))
        if len({node for node, _pid in peers}) != 1:
            logger.info("%s group spans several nodes: collectives go through gloo", self.name)
            return None
        comm, failure = None, None
        try:
            comm = ShmCommunicator(self.rank_in_group, [pid for _node, pid in peers],
                                   self.broadcast_object, max_bytes=self.shm_max_bytes,
                                   what=f"the {self.name} group")
        except Exception as exc:  # every rank must learn of it: see the agreement below
            failure = f"{type(exc).__name__}: {exc}"
        failures = [f for f in self.all_gather_object(failure) if f is not None]
        if failures:
            if comm is not None:
                comm.close()
            logger.warning("%s group: shared-memory collectives unavailable (%s); using gloo",
                           self.name, failures[0])
            return None
        self._shm = comm
        return comm

    # -- collectives ---------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the group (the input may be overwritten with it)."""
        if self.world_size == 1:
            return tensor
        if tensor.device.type != "cpu":
            with self._guard["all_reduce"]:
                dist.all_reduce(tensor, group=self.device_group)
            return tensor
        tensor = tensor.contiguous()
        comm = self._shm_communicator()
        if comm is not None and comm.all_reduce(tensor):
            return tensor
        with self._guard["all_reduce"]:
            dist.all_reduce(tensor, group=self.cpu_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's tensor concatenated along ``dim``, in group order.

        Sizes along ``dim`` may differ between ranks; dtype and the other
        sizes must agree.
        """
        if self.world_size == 1:
            return tensor
        dim = _normalise_dim(dim, tensor.dim())
        if tensor.device.type == "cpu":
            comm = self._shm_communicator()
            if comm is not None:
                gathered = comm.all_gather(tensor, dim)
                if gathered is not None:
                    return gathered
        return self._all_gather_uneven(tensor, dim)

    def _all_gather_uneven(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        group = self._group_for(tensor)
        moved = tensor.movedim(dim, 0).contiguous()
        extent = torch.tensor([moved.shape[0]], dtype=torch.int64, device=tensor.device)
        extents_t = [torch.empty_like(extent) for _ in range(self.world_size)]
        with self._guard["all_gather"]:
            dist.all_gather(extents_t, extent, group=group)
        extents = [int(e.item()) for e in extents_t]
        longest = max(extents)
        if moved.shape[0] < longest:
            padding = moved.new_zeros((longest - moved.shape[0], *moved.shape[1:]))
            moved = torch.cat([moved, padding])
        parts = [torch.empty_like(moved) for _ in range(self.world_size)]
        with self._guard["all_gather"]:
            dist.all_gather(parts, moved, group=group)
        joined = torch.cat([p[:n] for p, n in zip(parts, extents, strict=True)])
        return joined.movedim(0, dim).contiguous()

    def all_to_all(self, tensor: torch.Tensor,
                   splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Rows ``[sum(splits[:p]), sum(splits[:p + 1]))`` of ``tensor`` to group
        rank p; the rows every rank sent here (in group order) and their counts."""
        if self.world_size == 1:
            return tensor, list(splits)
        if tensor.device.type == "cpu":
            comm = self._shm_communicator()
            if comm is not None:
                exchanged = comm.all_to_all(tensor, splits)
                if exchanged is not None:
                    return exchanged
        group = self._group_for(tensor)
        sent = torch.tensor(splits, dtype=torch.int64, device=tensor.device)
        got = torch.empty_like(sent)
        with self._guard["all_to_all"]:
            dist.all_to_all_single(got, sent, group=group)
        counts = [int(c) for c in got.tolist()]
        out = tensor.new_empty((sum(counts), *tensor.shape[1:]))
        with self._guard["all_to_all"]:
            dist.all_to_all_single(out, tensor.contiguous(), counts, list(splits), group=group)
        return out, counts

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """The all_gather result on group rank ``dst``; None on the others."""
        self._global(dst, "dst")
        gathered = self.all_gather(tensor, dim)
        return gathered if self.rank_in_group == dst else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s tensor, written into ``tensor`` on every rank (same shape and dtype)."""
        source = self._global(src, "src")
        if self.world_size == 1:
            return tensor
        with self._guard["broadcast"]:
            dist.broadcast(tensor, src=source, group=self._group_for(tensor))
        return tensor

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``src``'s picklable ``obj`` on every rank (others pass anything, e.g. None)."""
        source = self._global(src, "src")
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        with self._guard["broadcast_object_list"]:
            dist.broadcast_object_list(box, src=source, group=self.cpu_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in group order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._guard["all_gather_object"]:
            dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        """Return once every rank of the group has called it."""
        if self.world_size > 1:
            with self._guard["barrier"]:
                dist.barrier(group=self.cpu_group)

    # -- point to point (pipeline stages) -----------------------------------------

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (default: the next rank)."""
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        target = self._point_to_point_peer(dst, "dst")
        queue = self._channels.to(target) if self._channels is not None else None
        if queue is not None:
            queue.enqueue(tensor)
        elif tensor.numel():
            with self._guard["send"]:
                dist.send(tensor.contiguous(), dst=target, group=self._group_for(tensor))

    def recv(self, shape: torch.Size | tuple[int, ...] | list[int], dtype: torch.dtype,
             src: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` sent by group rank ``src`` (default: previous)."""
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        source = self._point_to_point_peer(src, "src")
        queue = self._channels.from_(source) if self._channels is not None else None
        if queue is not None:
            got = queue.dequeue()
            if (not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(shape)
                    or got.dtype != dtype):
                raise ValueError(f"{self.name} group: expected a {dtype} tensor of shape "
                                 f"{tuple(shape)} from rank {src}, got {_describe(got)}")
            return got
        tensor = torch.empty(tuple(shape), dtype=dtype, device=device or self.device)
        if tensor.numel():
            with self._guard["recv"]:
                dist.recv(tensor, src=source, group=self._group_for(tensor))
        return tensor

    def send_object(self, obj: Any, dst: int) -> None:
        """Send a picklable ``obj`` to group rank ``dst``."""
        target = self._point_to_point_peer(dst, "dst")
        queue = self._channels.to(target) if self._channels is not None else None
        if queue is not None:
            queue.enqueue(obj)
        else:
            self._gloo_send_object(obj, target)

    def recv_object(self, src: int) -> Any:
        """The object group rank ``src`` sent with send_object."""
        source = self._point_to_point_peer(src, "src")
        queue = self._channels.from_(source) if self._channels is not None else None
        if queue is not None:
            return queue.dequeue()
        return self._gloo_recv_object(source)

    def _gloo_send_object(self, obj: Any, target: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        with self._guard["send"]:
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=target,
                      group=self.cpu_group)
            dist.send(payload, dst=target, group=self.cpu_group)

    def _gloo_recv_object(self, source: int) -> Any:
        length = torch.empty(1, dtype=torch.int64)
        with self._guard["recv"]:
            dist.recv(length, src=source, group=self.cpu_group)
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
            dist.recv(payload, src=source, group=self.cpu_group)
        return pickle.loads(payload.numpy().tobytes())

    def send_tensor_dict(self, tensors: dict[str, Any], dst: int | None = None) -> None:
        """Send a dict of tensors (and small picklable values) to group rank ``dst``.

        First the metadata (keys, shapes, dtypes, devices, the other values)
        as one pickled message, then each tensor in key order.
        """
        dst = (self.rank_in_group + 1) % self.world_size if dst is None else dst
        target = self._point_to_point_peer(dst, "dst")
        queue = self._channels.to(target) if self._channels is not None else None
        if queue is not None:
            queue.enqueue(dict(tensors))  # tensors travel out of band: one copy each way
            return
        metadata: list[tuple[str, Any]] = []
        payloads: list[torch.Tensor] = []
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor):
                metadata.append((key, _TensorMeta(value.dtype, tuple(value.shape),
                                                  value.device.type)))
                payloads.append(value)
            else:
                metadata.append((key, value))
        self.send_object(metadata, dst)
        for tensor in payloads:
            self.send(tensor, dst)

    def recv_tensor_dict(self, src: int | None = None) -> dict[str, Any]:
        """The dict that group rank ``src`` (default: previous) sent with send_tensor_dict."""
        src = (self.rank_in_group - 1) % self.world_size if src is None else src
        source = self._point_to_point_peer(src, "src")
        queue = self._channels.from_(source) if self._channels is not None else None
        if queue is not None:
            got = queue.dequeue()
            if not isinstance(got, dict):
                raise ValueError(f"{self.name} group: expected a tensor dict from rank {src}, "
                                 f"got {_describe(got)}")
            return got
        out: dict[str, Any] = {}
        for key, value in self.recv_object(src):
            if isinstance(value, _TensorMeta):
                device = torch.device("cpu") if value.device == "cpu" else self.device
                out[key] = self.recv(value.shape, value.dtype, src, device=device)
            else:
                out[key] = value
        return out

    def _point_to_point_peer(self, group_rank: int, what: str) -> int:
        peer = self._global(group_rank, what)
        if peer == self.rank:
            raise ValueError(f"{self.name} group: rank {self.rank_in_group} cannot "
                             f"send to or receive from itself ({what}={group_rank})")
        return peer

    def close(self) -> None:
        """Release the shared-memory communicator (not collective; idempotent)."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._shm_decided = True
        if self._channels is not None:
            self._channels.close()
            self._channels = None


class _TensorMeta:
    """What a receiver needs to allocate one tensor of a tensor dict."""

    __slots__ = ("dtype", "shape", "device")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], device: str) -> None:
        self.dtype = dtype
        self.shape = shape
        self.device = device

    def __reduce__(self) -> tuple[Any, ...]:
        return (_TensorMeta, (self.dtype, self.shape, self.device))


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
    return f"a {type(obj).__name__}"


def _normalise_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a tensor of {ndim} dimensions")
    return dim % ndim
