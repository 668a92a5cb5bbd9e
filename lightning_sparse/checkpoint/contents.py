"""What a sharded checkpoint holds: the module's and optimizers' state, split into dense tensors, per-row tensors and the rest."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_sparse.dynamic import DynamicEmbedding
from lightning_sparse.embedding import SparseEmbedding
from lightning_sparse.optim.base import SparseOptimizer


def tables(module: nn.Module) -> Iterator[tuple[str, SparseEmbedding]]:
    for name, sub in module.named_modules():
        if isinstance(sub, SparseEmbedding):
            yield (f"{name}." if name else ""), sub


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# ---------------------------------------------------------------------------- what Lightning holds
def dense_module_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` without the tables (they are written by :func:`save` from the module itself)."""
    state = module.state_dict()
    for prefix, table in tables(module):
        for key in table.sharded_keys():
            state.pop(prefix + key, None)
    return state


def dense_optimizer_state(optimizer: SparseOptimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` without its per-row tensors (written by :func:`save` from the optimizer itself)."""
    state = optimizer.state_dict()
    state["state"] = {index: {k: v for k, v in entry.items() if v.dim() == 0} for index, entry in state["state"].items()}
    return state


def split_tensors(tree: Any) -> tuple[Any, Any]:
    """Split nested dicts into (tensor leaves, everything else), both keeping the nesting."""
    if isinstance(tree, dict):
        tensors, rest = {}, {}
        for key, value in tree.items():
            t, r = split_tensors(value)
            if t is not None:
                tensors[key] = t
            if r is not None:
                rest[key] = r
        return (tensors or None), (rest or None)
    if isinstance(tree, Tensor):
        return tree, None
    return None, tree


def iter_row_tensors(
    module: nn.Module, sparse_optimizers: Mapping[int, SparseOptimizer]
) -> Iterator[tuple[str, SparseEmbedding, Tensor]]:
    """Every per-row tensor to store: (key, its table, this rank's rows in the table's sharding)."""
    for prefix, table in tables(module):
        yield f"state_dict.{prefix}weight", table, table.shard
        if isinstance(table, DynamicEmbedding):
            for name, value in table.slot_state().items():
                yield f"state_dict.{prefix}{name}", table, value
    for index, optimizer in sparse_optimizers.items():
        for p_index, table in enumerate(optimizer.tables):
            for name, value in optimizer.state[table.shard].items():
                if value.dim() > 0:
                    yield f"optimizer_{index}.state.{p_index}.{name}", table, value
