"""A gloo group outside the process's torch.distributed world, formed by generation.

Every group torch.distributed builds with ``new_group`` lives in the one
default world of its process, and every rank of that world must take part
in building it; a running world cannot take a new rank.  So a group whose
members come and go while the rest of each member's state (its world, its
TP and PP groups) carries on cannot be such a group.  A
:class:`DetachedGroup` is a ``ProcessGroupGloo`` built directly on a
``TCPStore``, under a key prefix of its own::

    TCPStore(host, port)                        one per generation; one member
      └─ PrefixStore("mpexec/<name>/g<generation>/place<place>/")   hosts it
           └─ ProcessGroupGloo(prefixed store, rank, size, timeout)

- ``generation`` numbers the successive groups of the same members: a new
  one is formed (on a fresh port the caller picked) when a member was
  replaced, and the previous one is retired.  The prefix keeps a late or
  stale joiner of generation g from ever meeting generation g + 1's keys,
  even on a reused port.
- ``place`` tells apart several groups formed at once over one store (one
  per place of a replica: the data parallel groups link the same place of
  every replica).
- Every wait is bounded by ``timeout_s``: forming (the store's connect and
  gloo's full mesh) and each collective.  A member that died makes gloo fail
  at once; one that froze makes it time out.  Either is a
  :class:`~mpexec.errors.DataParallelGroupError`, after which the group is
  retired.
- A retired group (its generation replaced, a member failed, or a collective
  of it failed) raises :class:`~mpexec.errors.StaleGroupError` from every
  collective at once, naming its generation and why it was retired: nothing
  waits on a group that no longer holds.  :meth:`DetachedGroup.unformed`
  is such a group from the start (before the first generation forms, or
  when a generation failed to form).

The collectives are those of :class:`~mpexec.distributed.GroupCoordinator`
that a data parallel group is used for: ``all_reduce``, ``all_gather``,
``gather``, ``broadcast``, ``broadcast_object``, ``all_gather_object`` and
``barrier``, over gloo only (no shared-memory path; a device tensor goes
through a CPU copy).  There is no point to point and no ``all_to_all``:
experts split across replicas keep one shared world instead (see
``mpexec.models.dp_world``).  Collectives run in the same order on every
member, from one thread.
"""

from __future__ import annotations

import logging
import pickle
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mpexec.errors import DataParallelGroupError, StaleGroupError

logger = logging.getLogger(__name__)


def store_prefix(name: str, generation: int, place: int) -> str:
    """The keys of one group of one generation."""
    return f"mpexec/{name}/g{generation}/place{place}/"


class DetachedGroup:
    """One member's view of a group formed outside its world (module docstring)."""

    def __init__(self, name: str, rank: int, size: int, generation: int, *,
                 process_group: Any = None, store: Any = None,
                 retired: str | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"{name} group: rank {rank} is not in [0, {size})")
        self.name = name
        self.generation = generation
        self.ranks = list(range(size))
        self.rank = rank
        self.rank_in_group = rank
        self.world_size = size
        self.device = torch.device("cpu")
        self._pg = process_group
        self._store = store
        self._retired = retired
        if process_group is None and size > 1 and retired is None:
            raise ValueError(f"{name} group of {size} ranks needs a process group")

    @classmethod
    def unformed(cls, name: str, rank: int, size: int, reason: str,
                 generation: int = -1) -> DetachedGroup:
        """A group that does not hold (yet): every collective raises ``StaleGroupError``."""
        return cls(name, rank, size, generation, retired=reason)

    def __repr__(self) -> str:
        state = f"retired: {self._retired}" if self._retired else "formed"
        return (f"DetachedGroup({self.name}, generation={self.generation}, "
                f"rank_in_group={self.rank_in_group}, size={self.world_size}, {state})")

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def retired(self) -> str | None:
        """Why the group no longer holds; None while it does."""
        return self._retired

    def retire(self, reason: str) -> None:
        """Release the group; every later collective raises ``StaleGroupError``
        (idempotent: the first reason stays)."""
        if self._retired is None:
            self._retired = reason
            logger.debug("%s group generation %d retired: %s", self.name, self.generation,
                         reason)
        # gloo's pairs close their sockets, and the store (its host's server
        # too) goes, when the last reference does
        self._pg = None
        self._store = None

    def close(self) -> None:
        self.retire("closed")

    # -- collectives -----------------------------------------------------------------

    def _live(self, call: str) -> Any:
        if self._retired is not None:
            which = ("no generation has formed yet" if self.generation < 0
                     else f"generation {self.generation}")
            raise StaleGroupError(f"{call} on the {self.name} group: {which} does not hold "
                                  f"({self._retired})", generation=self.generation)
        return self._pg

    def _wait(self, call: str, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # a member died (connection closed) or froze (timeout)
            self.retire(f"its {call} failed")
            raise DataParallelGroupError(
                f"{call} on the {self.name} group (generation {self.generation}, rank "
                f"{self.rank_in_group} of {self.world_size}) failed: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the group (written into ``tensor``)."""
        pg = self._live("all_reduce")
        if self.world_size == 1:
            return tensor
        host = _on_cpu(tensor)
        self._wait("all_reduce", pg.allreduce([host]))
        return _back(tensor, host)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's tensor concatenated along ``dim`` in group order (sizes
        along ``dim`` may differ)."""
        pg = self._live("all_gather")
        if self.world_size == 1:
            return tensor
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(f"dim {dim} is out of range for a tensor of {tensor.dim()} "
                             "dimensions")
        moved = _on_cpu(tensor).movedim(dim, 0).contiguous()
        extents = [int(e) for e in self._gather_cpu(
            pg, "all_gather", torch.tensor([moved.shape[0]], dtype=torch.int64))]
        longest = max(extents)
        if moved.shape[0] < longest:
            moved = torch.cat([moved, moved.new_zeros((longest - moved.shape[0],
                                                       *moved.shape[1:]))])
        parts = self._gather_cpu(pg, "all_gather", moved)
        joined = torch.cat([p[:n] for p, n in zip(parts, extents, strict=True)])
        return joined.movedim(0, dim).contiguous().to(tensor.device)

    def _gather_cpu(self, pg: Any, call: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(call, pg.allgather([parts], [tensor]))
        return parts

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """The all_gather result on group rank ``dst``; None on the others."""
        self._check_rank(dst, "dst")
        gathered = self.all_gather(tensor, dim)
        return gathered if self.rank_in_group == dst else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s tensor written into ``tensor`` on every member."""
        self._check_rank(src, "src")
        pg = self._live("broadcast")
        if self.world_size == 1:
            return tensor
        host = _on_cpu(tensor)
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self._wait("broadcast", pg.broadcast([host], options))
        return _back(tensor, host)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's picklable ``obj``, in group order."""
        pg = self._live("all_gather_object")
        if self.world_size == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        lengths = [int(n) for n in self._gather_cpu(
            pg, "all_gather_object", torch.tensor([payload.numel()], dtype=torch.int64))]
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        parts = self._gather_cpu(pg, "all_gather_object", padded)
        return [pickle.loads(p[:n].numpy().tobytes()) for p, n in zip(parts, lengths,
                                                                       strict=True)]

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``src``'s picklable ``obj`` on every member."""
        self._check_rank(src, "src")
        return self.all_gather_object(obj if self.rank_in_group == src else None)[src]

    def barrier(self) -> None:
        """Return once every member has called it."""
        pg = self._live("barrier")
        if self.world_size > 1:
            self._wait("barrier", pg.barrier())

    def _check_rank(self, group_rank: int, what: str) -> None:
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"{what} {group_rank} is not a rank of the {self.name} group "
                             f"(size {self.world_size})")


def form_detached_group(name: str, *, host: str, port: int, generation: int, place: int,
                        rank: int, size: int, host_store: bool,
                        timeout_s: float) -> DetachedGroup:
    """Form generation ``generation`` of group ``name`` at ``place`` as ``rank`` of
    ``size``; ``host_store``: this member hosts the store at ``host:port`` (one
    member of all the places formed at once).  Bounded by ``timeout_s``:
    ``DataParallelGroupError`` when the members do not all meet in time."""
    if size == 1:
        return DetachedGroup(name, rank, size, generation)
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, is_master=host_store, timeout=timeout,
                              wait_for_workers=False)
        prefixed = dist.PrefixStore(store_prefix(name, generation, place), store)
        process_group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    except (RuntimeError, OSError) as exc:  # a member dead, frozen or never there
        raise DataParallelGroupError(
            f"generation {generation} of the {name} group (place {place}, rank {rank} of "
            f"{size}, store {host}:{port}) did not form within {timeout_s:g} s: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    logger.debug("%s group generation %d formed (place %d, rank %d of %d)", name,
                 generation, place, rank, size)
    return DetachedGroup(name, rank, size, generation, process_group=process_group,
                         store=store)


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous() if tensor.device.type == "cpu" else tensor.cpu()


def _back(tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host``'s values in ``tensor``'s place (a copy back for a device tensor)."""
    if host is not tensor:
        tensor.copy_(host)
    return tensor
