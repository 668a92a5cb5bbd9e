"""Where a table's rows live: its process groups, this rank's place in them, its sharding, and the memory they take.

A table owns one :class:`Placement`. It holds the groups by weak reference, so that
``destroy_process_group()`` really releases them, and says so when a group it needs is gone.
:meth:`Placement.place` decides, without a collective, where this rank's rows are after a
``materialize``; the table then makes or cuts its shard (:meth:`~lightning_sparse.SparseEmbedding.materialize`).

In memory, :func:`empty_rows` puts a CPU tensor read and written at random rows (a shard, its per-row optimizer
state, a dynamic table's slot map) on 2 MiB pages where Linux has them (transparent huge pages, asked for with
``madvise``): on 4 KiB pages, a step's rows scattered over hundreds of MiB miss the TLB at almost every row.
``LIGHTNING_SPARSE_HUGE_PAGES=0`` keeps the system's default pages (an A/B switch, read at each allocation).
"""

from __future__ import annotations

import ctypes
import os
import sys
import weakref
from collections.abc import Callable
from enum import Enum
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.wire.alltoall import ExchangeStats, Peers
from lightning_sparse.wire.sharding import RowSharding

GroupRef = weakref.ref[dist.ProcessGroup]


class Move(Enum):
    """What a :meth:`Placement.place` call asks of the table's shard."""

    NONE = "the shard stays as it is"
    NEW = "make the shard: this rank's rows, from the table's init"
    CUT = "a full local table becomes this rank's shard: keep the rows this rank now owns"


class Placement:
    """A table's process group and replica group (weak references), its rank and world size in them, and its sharding.

    Before :meth:`place` the table is a local table of one rank; ``name`` names it in errors.
    """

    def __init__(self, name: str, process_group: dist.ProcessGroup | None, replica_group: dist.ProcessGroup | None) -> None:
        if replica_group is not None and process_group is None:
            raise ValueError(
                f"{name}: a replica_group needs the sharding group as process_group. "
                f"HINT: shard_group, replica_group = lightning_sparse.sharding_groups(group_size)."
            )
        self.name = name
        self._requested: GroupRef | None = weakref.ref(process_group) if process_group is not None else None
        self._group: GroupRef | None = None  # the group in use once placed (None: the default group)
        self._replica: GroupRef | None = weakref.ref(replica_group) if replica_group is not None else None
        self.rank, self.world_size, self.replicas = 0, 1, 1
        self.placed = False
        self._checked: tuple[GroupRef, torch.device] | None = None  # the group and device of the last full placement

    def __getstate__(self) -> dict:
        # A pickled table (a module returned from a process) re-checks its placement where it lands.
        return {**self.__dict__, "_checked": None}

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the shard is spread over, looked up when needed (``None`` for a local table)."""
        if self._group is not None:
            group = self._group()
        elif self._requested is not None and self._requested() is None:
            group = None
        else:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None and self.world_size > 1:
            raise self._destroyed()
        return group

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold this rank's shard (2-D sharding), looked up when needed; ``None`` for 1-D."""
        group = self._replica() if self._replica is not None else None
        if group is None and self.replicas > 1:
            raise RuntimeError(
                f"The replica group of {self.name} ({self.replicas} ranks) has been destroyed. HINT: use the table "
                f"before destroy_process_group(), or save a checkpoint and load it into a new module."
            )
        return group

    def peers(self, stats: ExchangeStats | None, fence: Any = None) -> Peers:
        """The ranks of the process group, as the wire takes them, counting into ``stats`` (``fence``: see :class:`Peers`)."""
        return Peers(self.process_group, self.rank, self.world_size, stats, fence)

    def replica_peers(self, stats: ExchangeStats | None) -> Peers:
        """The ranks of the replica group (2-D sharding), as the wire takes them."""
        group = self.replica_group
        return Peers(group, dist.get_rank(group) if group is not None else 0, self.replicas, stats)

    def sharding(self, num_embeddings: int, scheme: str) -> RowSharding:
        return _row_sharding(num_embeddings, self.world_size, scheme)

    def _destroyed(self) -> RuntimeError:
        return RuntimeError(
            f"The process group {self.name} is sharded over ({self.world_size} ranks) has been destroyed. HINT: use "
            f"the table before destroy_process_group(), or save a checkpoint and load it into a new module."
        )

    def place(
        self, process_group: dist.ProcessGroup | None, replica_group: dist.ProcessGroup | None, device: torch.device
    ) -> Move:
        """Place the table over ``process_group`` (or the one asked for before, or the default group). Local only.

        Groups given here replace those given before (the strategy places tables so under 2-D
        sharding). The same placement again moves nothing; a local table of one rank placed over
        W ranks is cut to this rank's rows (every rank must hold the same full table, as after
        loading the same state dict); a table placed over W ranks cannot be placed over others.
        """
        initialized = dist.is_available() and dist.is_initialized()
        if self.placed and process_group is None and self.world_size == 1 and self._requested is None and not initialized:
            return Move.NONE  # a local table stays one (every `shard` read asks)
        if process_group is not None:
            self._requested = weakref.ref(process_group)
            self._replica = weakref.ref(replica_group) if replica_group is not None else None
        requested = process_group or (self._requested() if self._requested is not None else None)
        gone = self._requested is not None and requested is None
        if self.placed and self.world_size > 1 and (gone or not initialized):
            raise self._destroyed()
        if initialized:
            group = requested or dist.group.WORLD
            if process_group is None and self._placed_before_on(group, device):
                return Move.NONE  # its rank and size in that group cannot have changed
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            check_device(self.name, device, group)
        else:
            rank, world_size = 0, 1
        placed = weakref.ref(requested) if requested is not None else None
        if self.placed:
            if (rank, world_size) == (self.rank, self.world_size):
                if self._group is not placed:  # (a weak reference to the same group is the same object)
                    self._group = placed
                self._checked = (weakref.ref(group), device) if initialized else None
                return Move.NONE
            if self.world_size != 1:
                raise RuntimeError(
                    f"{self.name} is already sharded over {self.world_size} ranks and cannot be re-sharded over "
                    f"{world_size}. HINT: save a checkpoint and load it into a new module."
                )
        move = Move.CUT if self.placed else Move.NEW
        self._group, self.rank, self.world_size, self.placed = placed, rank, world_size, True
        replicas = self._replica() if self._replica is not None else None
        self.replicas = dist.get_world_size(replicas) if replicas is not None else 1
        self._checked = (weakref.ref(group), device) if initialized else None
        return move

    def _placed_before_on(self, group: dist.ProcessGroup, device: torch.device) -> bool:
        """Whether the last full placement was on this very (live) group and device."""
        if self._checked is None:
            return False
        group_ref, checked_device = self._checked
        return group_ref() is group and checked_device == device

    def world_size_of(self, process_group: dist.ProcessGroup | None) -> int:
        """The ranks a placement over ``process_group`` (or the one asked for, or the default group) would have."""
        group = process_group or (self._requested() if self._requested is not None else None)
        initialized = dist.is_available() and dist.is_initialized()
        return dist.get_world_size(group or dist.group.WORLD) if initialized else 1

    def unplace(self) -> None:
        """Forget the placement of a table that holds nothing yet (a dynamic table re-made over a group)."""
        self.placed, self._checked = False, None

    def describe(self) -> str:
        return f"rank={self.rank}/{self.world_size}" if self.placed else "not materialized"


def check_device(name: str, device: torch.device, group: dist.ProcessGroup) -> None:
    """On NCCL a shard lives on the GPU the rank's communicator was made for: the current device (local, no collective).

    NCCL binds a rank's communicator to the device that was current when it was made; collectives on another
    device's tensors hang or fail far from their cause. Every rank runs the same check on its own placement.
    """
    if device.type != "cuda" or "nccl" not in str(dist.get_backend(group)).lower():
        return
    current = torch.cuda.current_device()
    if device.index is not None and device.index != current:
        raise RuntimeError(
            f"{name} is on {device}, but this rank's current CUDA device is cuda:{current}, for which its NCCL "
            f"communicator is made. HINT: call torch.cuda.set_device(local_rank) before init_process_group and build "
            f"or move the table to that device (Lightning's strategies do both)."
        )


HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGES_ENV = "LIGHTNING_SPARSE_HUGE_PAGES"
_MADV_HUGEPAGE = 14  # <sys/mman.h>


def empty_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> Tensor:
    """``torch.empty(shape)`` for rows a step reads and writes at random; on a CPU, on 2 MiB pages where Linux has them.

    The advice covers the whole 2 MiB pages inside the tensor (so tensors under 4 MiB stay as they are) and takes effect
    as its pages are first written, which is why it comes with the allocation: the caller fills the tensor (``fill_``,
    ``zero_``, ``out=``). A hint: where the kernel has no transparent huge pages, or none to spare, the pages are the
    usual ones.
    """
    rows = torch.empty(shape, dtype=dtype, device=device)
    madvise = _madvise() if rows.device.type == "cpu" and rows.nbytes >= 2 * HUGE_PAGE_BYTES else None
    if madvise is not None and os.environ.get(HUGE_PAGES_ENV) != "0":
        start, end = rows.data_ptr(), rows.data_ptr() + rows.nbytes
        first, last = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        madvise(first, last - first, _MADV_HUGEPAGE)  # (its result is ignored: a hint, as above)
    return rows


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` on Linux; ``None`` elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, use_errno=True)
    try:
        return prototype(("madvise", ctypes.CDLL(None)))
    except (OSError, AttributeError):
        return None


@cache
def _row_sharding(num_embeddings: int, world_size: int, scheme: str) -> RowSharding:
    """One (frozen) RowSharding per placement: the step asks for it several times."""
    return RowSharding(num_embeddings, world_size, scheme)
