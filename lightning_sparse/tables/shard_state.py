"""The whole-table views and the state dict of a row-sharded table (a mixin of :class:`~lightning_sparse.SparseEmbedding`).

Kept apart from the table's placement and lookups so that each class has one job: here a shard
becomes the logical table (a gather, collective) and back (``local_rows``), and a state dict
holds either this rank's shard (same placement) or the full table (any placement). It builds on
the table's placement (:class:`~lightning_sparse.tables.shard_placement.ShardPlacementMixin`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sparse.faults.peers import collective
from lightning_sparse.tables.shard_placement import ShardPlacementMixin


class ShardStateMixin(ShardPlacementMixin):
    """Gather a shard into the logical table, take this rank's rows of one, and the table's state dict."""

    def full_weight(self) -> Tensor:
        """The logical ``[num_embeddings, embedding_dim]`` table in global row order, on every rank.

        Collective: every rank of the group must call it. Holds the whole table on every rank:
        meant for export and tests, not for tables that do not fit one host.
        """
        return self.gather_rows(self.shard)

    @torch.no_grad()
    def gather_rows(self, local: Tensor) -> Tensor:
        """Concatenate a per-row tensor (first dim: this rank's rows) from all ranks in global row order.

        Collective: every rank of the group must call it. Used for the table and for per-row
        optimizer state.
        """
        if self._world_size == 1:
            return local.clone()
        sharding = self.sharding
        most = max(sharding.num_local_rows(r) for r in range(self._world_size))
        padded = local.new_zeros(most, *local.shape[1:])
        padded[: len(local)] = local
        gathered = [torch.empty_like(padded) for _ in range(self._world_size)]
        with collective(f"all-gather of {self.name}"):
            dist.all_gather(gathered, padded, group=self.process_group)
        out = local.new_empty(self.num_embeddings, *local.shape[1:])
        for rank, part in enumerate(gathered):
            ids = sharding.global_ids(rank, device=out.device)
            out.index_copy_(0, ids, part[: len(ids)])
        return out

    def local_rows(self, full: Tensor) -> Tensor:
        """This rank's rows of a full per-row tensor (the inverse of :meth:`gather_rows`)."""
        self.materialize()
        return full.index_select(0, self.sharding.global_ids(self._rank, device=full.device))

    # ------------------------------------------------------------------ state dict
    def sharded_keys(self) -> tuple[str, ...]:
        """The state-dict entries that hold this rank's part of the table (``full_state_dict`` replaces them)."""
        return ("shard", "_extra_state")

    def full_tensors(self) -> dict[str, Tensor]:
        """The whole table as state-dict entries, loadable on any placement: ``weight``. Collective."""
        return {"weight": self.full_weight()}

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "sharding": self.sharding_scheme,
            "world_size": self._world_size,
            "rank": self._rank,
        }

    def set_extra_state(self, state: Any) -> None:
        pass  # checked in _load_from_state_dict, which sees the tensors too

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self.materialize()  # first, so that the extra state records the placement
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "shard"] = self.shard if keep_vars else self.shard.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Accepts this rank's ``shard`` (same placement) or the full logical ``weight`` table."""
        extra = state_dict.get(prefix + "_extra_state", {})
        full, shard = state_dict.get(prefix + "weight"), state_dict.get(prefix + "shard")
        self.materialize()
        if full is not None:
            if tuple(full.shape) != (self.num_embeddings, self.embedding_dim):
                error_msgs.append(
                    f"{self.name}: checkpoint table {prefix}weight has shape {tuple(full.shape)}, "
                    f"expected {(self.num_embeddings, self.embedding_dim)}."
                )
            else:
                with torch.no_grad():
                    self._shard.copy_(self.local_rows(full))
        elif shard is not None:
            mine = self.get_extra_state()
            theirs = {k: extra.get(k) for k in mine}
            if theirs != mine or tuple(shard.shape) != tuple(self._shard.shape):
                error_msgs.append(
                    f"{self.name}: {prefix}shard holds rank {theirs['rank']}'s shard of {theirs['world_size']} "
                    f"({theirs['sharding']}), but this module is rank {self._rank} of {self._world_size} "
                    f"({self.sharding_scheme}). HINT: load a state dict that holds the full table as "
                    f"'{prefix}weight' (see lightning_sparse.full_state_dict)."
                )
            else:
                with torch.no_grad():
                    self._shard.copy_(shard)
        elif strict:
            missing_keys.append(prefix + "shard")
        if strict:
            ours = {prefix + name for name in ("weight", "shard", "_extra_state")}
            unexpected_keys.extend(key for key in state_dict if key.startswith(prefix) and key not in ours)
