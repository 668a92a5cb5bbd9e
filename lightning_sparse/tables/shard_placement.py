"""Where a table's rows live: its process groups, this rank's place in them, and the shard (a mixin of SparseEmbedding).

A table materializes its shard on first use (or :meth:`ShardPlacementMixin.materialize`): each
rank allocates and initializes only the rows it owns under the table's sharding. The groups are
held by weak reference, so ``destroy_process_group()`` really releases them; a table whose group
is gone says so. What the host table provides is declared at the top of the class.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import cache

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.wire.alltoall import ExchangeStats, Peers
from lightning_sparse.wire.sharding import RowSharding


class ShardPlacementMixin:
    """A table's placement: group, rank, world size, replicas, sharding, and the shard itself."""

    # Set by the host table's constructor (SparseEmbedding.__init__).
    name: str
    num_embeddings: int
    embedding_dim: int
    sharding_scheme: str
    _requested_group: weakref.ref[dist.ProcessGroup] | None  # the group asked for (None: the default group)
    _group: weakref.ref[dist.ProcessGroup] | None  # the group in use once materialized (None: the default group)
    _replica_group: weakref.ref[dist.ProcessGroup] | None
    _rank: int
    _world_size: int
    _replicas: int
    _materialized: bool
    _shard: Tensor  # an empty placeholder until materialized, then the shard (the same tensor for life)
    stats: ExchangeStats
    _initial_rows: Callable[[Tensor], Tensor]  # the host table's method: the initial values of rows ``global_ids``

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the shard is spread over, looked up when needed (``None`` for a local table)."""
        if self._group is not None:
            group = self._group()
        elif self._requested_group is not None and self._requested_group() is None:
            group = None
        else:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if group is None and self._world_size > 1:
            raise self._group_destroyed()
        return group

    def _group_destroyed(self) -> RuntimeError:
        return RuntimeError(
            f"The process group {self.name} is sharded over ({self._world_size} ranks) has been destroyed. "
            f"HINT: use the table before destroy_process_group(), or save a checkpoint and load it into a new module."
        )

    @property
    def peers(self) -> Peers:
        """The ranks the shard is spread over, as the wire takes them, counting into the table's stats."""
        return Peers(self.process_group, self._rank, self._world_size, self.stats)

    @property
    def replica_peers(self) -> Peers:
        """The ranks that hold this rank's shard (2-D sharding), as the wire takes them."""
        group = self.replica_group
        return Peers(group, dist.get_rank(group) if group is not None else 0, self._replicas, self.stats)

    @property
    def replicas(self) -> int:
        """How many ranks hold each shard: 1, or the size of the replica group under 2-D sharding."""
        return self._replicas

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold this rank's shard (2-D sharding), looked up when needed; ``None`` for 1-D."""
        group = self._replica_group() if self._replica_group is not None else None
        if group is None and self._replicas > 1:
            raise RuntimeError(
                f"The replica group of {self.name} ({self._replicas} ranks) has been destroyed. "
                f"HINT: use the table before destroy_process_group(), or save a checkpoint and load it into a new module."
            )
        return group

    @property
    def sharding(self) -> RowSharding:
        return _row_sharding(self.num_embeddings, self._world_size, self.sharding_scheme)

    @property
    def is_materialized(self) -> bool:
        return self._materialized

    @property
    def shard(self) -> Tensor:
        """This rank's rows, ``[num_local_rows, embedding_dim]``, in local order (materializes)."""
        self.materialize()
        return self._shard

    @property
    def device(self) -> torch.device:
        return self._shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self._shard.dtype

    def materialize(
        self, process_group: dist.ProcessGroup | None = None, replica_group: dist.ProcessGroup | None = None
    ) -> ShardPlacementMixin:
        """Allocate and initialize this rank's shard. Local only: no collective.

        Groups given here replace those given to the constructor (the strategy places tables
        this way under 2-D sharding). Idempotent for the same placement. A table materialized as a one-process local table and
        then materialized over W ranks keeps the rows each rank now owns (every rank must hold
        the same full table, as after loading the same state dict). Returns ``self``.
        """
        if self._materialized and process_group is None and self._world_size == 1 and self._requested_group is None:
            if not (dist.is_available() and dist.is_initialized()):  # a local table stays one (every `shard` read asks)
                return self
        if process_group is not None:
            self._requested_group = weakref.ref(process_group)
            self._replica_group = weakref.ref(replica_group) if replica_group is not None else None
        requested = process_group or (self._requested_group() if self._requested_group is not None else None)
        gone = self._requested_group is not None and requested is None
        if self._materialized and self._world_size > 1 and (gone or not (dist.is_available() and dist.is_initialized())):
            raise self._group_destroyed()
        if dist.is_available() and dist.is_initialized():
            group = requested or dist.group.WORLD
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
            _check_device(self.name, self._shard.device, group)
        else:
            rank, world_size = 0, 1
        placed = weakref.ref(requested) if requested is not None else None
        if self._materialized:
            if (rank, world_size) == (self._rank, self._world_size):
                if self._group is not placed:  # (a weak reference to the same group is the same object)
                    self._group = placed
                return self
            if self._world_size != 1:
                raise RuntimeError(
                    f"{self.name} is already sharded over {self._world_size} ranks and cannot be re-sharded over "
                    f"{world_size}. HINT: save a checkpoint and load it into a new module."
                )
        self._group, self._rank, self._world_size = placed, rank, world_size
        replicas = self._replica_group() if self._replica_group is not None else None
        self._replicas = dist.get_world_size(replicas) if replicas is not None else 1
        global_ids = self.sharding.global_ids(rank, device=self._shard.device)
        if self._materialized:  # a full local table becomes this rank's shard
            self._shard.data = self._shard.data.index_select(0, global_ids)
        else:
            self._shard.data = self._initial_rows(global_ids)
            self._materialized = True
        return self


def _check_device(name: str, device: torch.device, group: dist.ProcessGroup) -> None:
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


@cache
def _row_sharding(num_embeddings: int, world_size: int, scheme: str) -> RowSharding:
    """One (frozen) RowSharding per placement: the step asks for it several times."""
    return RowSharding(num_embeddings, world_size, scheme)
