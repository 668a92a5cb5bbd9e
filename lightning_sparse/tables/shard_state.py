"""A row-sharded table as a whole: gathered into the logical table (collective) and back, and its state dicts.

Functions of a :class:`~lightning_sparse.SparseEmbedding`, which calls them from its methods: a shard
becomes the logical table (:func:`gather_rows`) and back (:func:`local_rows`), and a state dict
holds either this rank's shard (same placement) or the full table (any placement).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparse.faults.peers import collective
from lightning_sparse.wire.sharding import RowSharding


class SparseEmbedding(Protocol):
    """What these functions read of a table (:class:`lightning_sparse.SparseEmbedding`, which calls them)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    sharding_scheme: str
    shared_memory: bool

    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def sharding(self) -> RowSharding: ...
    @property
    def process_group(self) -> dist.ProcessGroup | None: ...
    @property
    def shard(self) -> Tensor: ...
    def materialize(self) -> Any: ...
    def rows_written(self, fenced: bool) -> None: ...


@torch.no_grad()
def gather_rows(table: SparseEmbedding, local: Tensor) -> Tensor:
    """Concatenate a per-row tensor (first dim: this rank's rows) from all ranks in global row order.

    Collective: every rank of the table's group must call it. Used for the table and for per-row
    optimizer state.
    """
    world_size = table.world_size
    if world_size == 1:
        return local.clone()
    sharding = table.sharding
    most = max(sharding.num_local_rows(r) for r in range(world_size))
    padded = local.new_zeros(most, *local.shape[1:])
    padded[: len(local)] = local
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    with collective(f"all-gather of {table.name}"):
        dist.all_gather(gathered, padded, group=table.process_group)
    out = local.new_empty(table.num_embeddings, *local.shape[1:])
    for rank, part in enumerate(gathered):
        ids = sharding.global_ids(rank, device=out.device)
        out.index_copy_(0, ids, part[: len(ids)])
    return out


def local_rows(table: SparseEmbedding, full: Tensor) -> Tensor:
    """This rank's rows of a full per-row tensor (the inverse of :func:`gather_rows`)."""
    table.materialize()
    return full.index_select(0, table.sharding.global_ids(table.rank, device=full.device))


def extra_state(table: SparseEmbedding) -> dict[str, Any]:
    """The placement a state dict's shard was saved with: loading it elsewhere is refused."""
    return {
        "num_embeddings": table.num_embeddings,
        "embedding_dim": table.embedding_dim,
        "sharding": table.sharding_scheme,
        "world_size": table.world_size,
        "rank": table.rank,
    }


def saved_shard(table: SparseEmbedding, keep_vars: bool) -> Tensor:
    """The shard as a state dict holds it; a copy for a shard in shared memory (a view of the whole table: ``torch.save``
    would write the whole table)."""
    if keep_vars:
        return table.shard
    shard = table.shard.detach()
    return shard.clone() if table.shared_memory and table.world_size > 1 else shard


def load(table: SparseEmbedding, state_dict: dict, prefix: str, strict: bool, missing_keys: list, unexpected_keys: list,
         error_msgs: list) -> None:  # fmt: skip
    """Load this rank's ``shard`` (same placement) or the full logical ``weight`` table into ``table``."""
    extra = state_dict.get(prefix + "_extra_state", {})
    full, shard = state_dict.get(prefix + "weight"), state_dict.get(prefix + "shard")
    table.materialize()
    if full is not None:
        if tuple(full.shape) != (table.num_embeddings, table.embedding_dim):
            error_msgs.append(
                f"{table.name}: checkpoint table {prefix}weight has shape {tuple(full.shape)}, "
                f"expected {(table.num_embeddings, table.embedding_dim)}."
            )
        else:
            with torch.no_grad():
                table.shard.copy_(local_rows(table, full))
    elif shard is not None:
        mine = extra_state(table)
        theirs = {k: extra.get(k) for k in mine}
        if theirs != mine or tuple(shard.shape) != tuple(table.shard.shape):
            error_msgs.append(
                f"{table.name}: {prefix}shard holds rank {theirs['rank']}'s shard of {theirs['world_size']} "
                f"({theirs['sharding']}), but this module is rank {table.rank} of {table.world_size} "
                f"({table.sharding_scheme}). HINT: load a state dict that holds the full table as "
                f"'{prefix}weight' (see lightning_sparse.full_state_dict)."
            )
        else:
            with torch.no_grad():
                table.shard.copy_(shard)
    elif strict:
        missing_keys.append(prefix + "shard")
    if strict:
        ours = {prefix + name for name in ("weight", "shard", "_extra_state")}
        unexpected_keys.extend(key for key in state_dict if key.startswith(prefix) and key not in ours)
    table.rows_written(fenced=False)


def full_state_dict(module: nn.Module, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """``module.state_dict()`` with every SparseEmbedding shard replaced by its full table.

    Collective: every rank of each table's group must call it. The result holds each table as
    ``<prefix>weight`` of shape ``[num_embeddings, embedding_dim]``, loadable on any number of
    ranks and into ``nn.Embedding`` (a DynamicEmbedding as ``<prefix>ids`` and their rows as
    ``<prefix>weight``, loadable on any number of ranks).
    """
    state_dict = dict(module.state_dict() if state_dict is None else state_dict)
    for name, sub in module.named_modules():
        if callable(getattr(sub, "sharded_keys", None)):  # a SparseEmbedding (this module is below it)
            prefix = f"{name}." if name else ""
            for key in sub.sharded_keys():
                state_dict.pop(prefix + key, None)
            state_dict.update({prefix + key: value for key, value in sub.full_tensors().items()})
    return state_dict


class StateDictHooks(nn.Module):
    """A table's state-dict hooks: its ``shard`` (this rank's rows) with its placement, or the whole ``weight`` on load.

    The base of :class:`~lightning_sparse.SparseEmbedding`, which gives what :class:`SparseEmbedding` above names.
    """

    def sharded_keys(self) -> tuple[str, ...]:
        """The state-dict entries that hold this rank's part of the table (``full_state_dict`` replaces them)."""
        return ("shard", "_extra_state")

    def full_tensors(self) -> dict[str, Tensor]:
        """The whole table as state-dict entries, loadable on any placement: ``weight``. Collective."""
        return {"weight": self.full_weight()}

    def get_extra_state(self) -> dict[str, Any]:
        return extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        pass  # checked in _load_from_state_dict, which sees the tensors too

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self.materialize()  # first, so that the extra state records the placement
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "shard"] = saved_shard(self, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Accepts this rank's ``shard`` (same placement) or the full logical ``weight`` table."""
        load(self, state_dict, prefix, strict, missing_keys, unexpected_keys, error_msgs)
