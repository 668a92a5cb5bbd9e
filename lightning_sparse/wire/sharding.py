"""Which rank owns a row, and local <-> global row ids.

Pure functions of ``(num_embeddings, world_size, scheme)``: no collectives, no state.

Two schemes:

* ``"mod"``: global row ``r`` lives on rank ``r % W`` at local index ``r // W``. Hot low ids
  (frequent items usually get small ids) spread evenly over the ranks.
* ``"range"``: contiguous blocks of ``ceil(N / W)`` rows, the way ``torch.chunk`` splits a
  tensor. Rank ``k`` holds rows ``[k * B, min((k + 1) * B, N))``; trailing ranks may hold none.

>>> s = RowSharding(10, world_size=3, scheme="mod")
>>> s.owner(torch.tensor([0, 1, 2, 3, 9])).tolist()
[0, 1, 2, 0, 0]
>>> [s.num_local_rows(r) for r in range(3)]
[4, 3, 3]
>>> s.global_ids(1).tolist()
[1, 4, 7]
>>> RowSharding(10, world_size=3, scheme="range").global_ids(2).tolist()
[8, 9]

The *owner-major key* of a row, ``owner * block_size + local index``, sorts rows by owner and,
within an owner, by local index. One sort of the keys of a batch therefore both deduplicates
the ids and groups them by the rank they go to; under ``"range"`` the key is the id itself.

>>> s.key(torch.tensor([0, 1, 2, 3, 9])).tolist()
[0, 4, 8, 1, 3]
>>> s.local_of_key(s.key(torch.tensor([9]))).tolist(), s.owner_of_key(s.key(torch.tensor([9]))).tolist()
([3], [0])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch
from torch import Tensor

from lightning_sparse.wire.grouping import SortedKeys

SCHEMES = ("mod", "range")


class OwnerMajorKeys:
    """Keys ``owner * block_size + local``: the arithmetic the exchange asks of a row sharding.

    A subclass gives ``world_size`` and ``block_size`` (the keys each rank has room for).
    """

    world_size: int
    block_size: int

    @property
    def key_bound(self) -> int:
        """Every key is below this."""
        return self.world_size * self.block_size

    def owner_of_key(self, keys: Tensor) -> Tensor:
        return torch.div(keys, self.block_size, rounding_mode="floor")

    def local_of_key(self, keys: Tensor) -> Tensor:
        return torch.remainder(keys, self.block_size)

    def key_boundaries(self, device: torch.device | str | None = None) -> Tensor:
        """``[W + 1]`` keys: rank ``r`` owns the keys in ``[boundaries[r], boundaries[r + 1])``."""
        return torch.arange(self.world_size + 1, device=device) * self.block_size

    def owner_counts_below(self, runs: SortedKeys, device: torch.device) -> Tensor:
        """``[W + 1]``: how many distinct keys of ``runs`` go to ranks below each rank (and, last, all of them)."""
        return runs.counts_below(self.key_boundaries(device))


@dataclass(frozen=True)
class RowSharding(OwnerMajorKeys):
    """Row placement of one logical ``[num_embeddings, dim]`` table over ``world_size`` ranks."""

    num_embeddings: int
    world_size: int
    scheme: str = "mod"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"Invalid sharding scheme: {self.scheme!r}. HINT: use one of {SCHEMES}.")
        if self.num_embeddings < 1:
            raise ValueError(f"Invalid num_embeddings: {self.num_embeddings}. HINT: a table needs at least one row.")
        if self.world_size < 1:
            raise ValueError(f"Invalid world_size: {self.world_size}")

    @property
    def block_size(self) -> int:
        """Rows per rank under ``"range"`` (the last non-empty block may be shorter)."""
        return -(-self.num_embeddings // self.world_size)

    def owner(self, ids: Tensor) -> Tensor:
        """Rank that owns each global id."""
        if self.scheme == "mod":
            return torch.remainder(ids, self.world_size)
        return torch.div(ids, self.block_size, rounding_mode="floor")

    def to_local(self, ids: Tensor) -> Tensor:
        """Index of each global id inside its owner's shard."""
        if self.scheme == "mod":
            return torch.div(ids, self.world_size, rounding_mode="floor")
        return torch.remainder(ids, self.block_size)

    def key(self, ids: Tensor) -> Tensor:
        """Owner-major key of each global id: ``owner * block_size + local index`` (the id under ``"range"``)."""
        if self.scheme == "range":
            return ids
        return torch.remainder(ids, self.world_size) * self.block_size + torch.div(ids, self.world_size, rounding_mode="floor")

    def global_of_key(self, keys: Tensor) -> Tensor:
        """Inverse of :meth:`key`."""
        if self.scheme == "range":
            return keys
        return self.local_of_key(keys) * self.world_size + self.owner_of_key(keys)

    def num_local_rows(self, rank: int) -> int:
        """Number of rows that ``rank`` holds."""
        if self.scheme == "mod":
            return max(0, -(-(self.num_embeddings - rank) // self.world_size))
        return max(0, min(self.block_size, self.num_embeddings - rank * self.block_size))

    def global_ids(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """Global ids of the rows ``rank`` holds, in local order."""
        local = torch.arange(self.num_local_rows(rank), device=device)
        if self.scheme == "mod":
            return local * self.world_size + rank
        return local + rank * self.block_size


@dataclass(frozen=True)
class JointSharding(OwnerMajorKeys):
    """Several tables' rows in one owner-major key space, so that one sort groups a batch by owner, then table.

    Table ``t``'s row with owner ``o`` and local index ``l`` has the key
    ``o * block_size + offsets[t] + l``, where ``block_size`` is the sum of the tables' own
    block sizes and ``offsets[t]`` the sum of those before ``t``. So keys sort by owner, then
    table, then local row, and ``local_of_key`` gives a *joint local id* (``offsets[t] + l``)
    from which the owner reads the table (:meth:`table_of_local`). The interface is the one of
    :class:`RowSharding` that the exchange uses, plus which table each key belongs to.

    >>> joint = JointSharding((RowSharding(5, 2, "mod"), RowSharding(3, 2, "range")))
    >>> joint.block_size, joint.offsets
    (5, (0, 3, 5))
    >>> joint.key(0, torch.tensor([0, 1, 4])).tolist(), joint.key(1, torch.tensor([0, 2])).tolist()
    ([0, 5, 2], [3, 8])
    """

    shardings: tuple[RowSharding, ...]

    def __post_init__(self) -> None:
        if not self.shardings or len({s.world_size for s in self.shardings}) != 1:
            raise ValueError("JointSharding needs at least one table, all over the same number of ranks.")

    @property
    def world_size(self) -> int:
        return self.shardings[0].world_size

    @property
    def num_tables(self) -> int:
        return len(self.shardings)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each table's local ids start in a joint local id (and, last, ``block_size``)."""
        return (0, *accumulate(s.block_size for s in self.shardings))

    @cached_property
    def block_size(self) -> int:
        return self.offsets[-1]

    def key(self, table: int, ids: Tensor) -> Tensor:
        """Joint keys of table ``table``'s rows ``ids`` (all inside the table)."""
        sharding = self.shardings[table]
        if self.num_tables == 1:  # one table: its own owner-major keys (the same values, fewer ops)
            return sharding.key(ids)
        return sharding.owner(ids) * self.block_size + (sharding.to_local(ids) + self.offsets[table])

    def table_keys(self, table: int, keys: Tensor) -> Tensor:
        """Table ``table``'s own owner-major keys (:meth:`RowSharding.key`) of its joint keys ``keys``."""
        if self.num_tables == 1:  # one table: the joint keys are the table's own
            return keys
        local = self.local_of_key(keys) - self.offsets[table]
        return self.owner_of_key(keys) * self.shardings[table].block_size + local

    def table_boundaries(self, device: torch.device | str | None = None) -> Tensor:
        """The keys where each (owner, table) block starts, owner-major, and the bound: ``W * T + 1`` values."""
        starts = torch.arange(self.world_size, device=device).unsqueeze(1) * self.block_size
        starts = starts + torch.tensor(self.offsets[:-1], device=device)
        return torch.cat([starts.view(-1), torch.tensor([self.key_bound], device=device)])

    def block(self, owner: Tensor, local: Tensor) -> Tensor:
        """The (owner, table) block of keys with these owners and joint local ids, owner-major: ``owner * T + table``."""
        return owner * self.num_tables + self.table_of_local(local)

    def table_of_local(self, local: Tensor) -> Tensor:
        """The table of each joint local id."""
        return torch.bucketize(local, torch.tensor(self.offsets[1:-1], dtype=local.dtype, device=local.device), right=True)
