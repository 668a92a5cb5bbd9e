"""The checkpoint Lightning's Trainer hands a strategy, as a sharded checkpoint: shared by the Trainer and Fabric.

The Trainer's ``SparseDDPStrategy`` and Fabric's ``FabricSparseDDPStrategy`` both write what
Lightning would put in one file (``{"state_dict": ..., "optimizer_states": [...], ...}``) through
:func:`write`, and read optimizers back through :func:`read_optimizer`. So a checkpoint written
by one loads in the other, on any number of ranks:

- ``state_dict``: the module's dense tensors (DCP) and every table's rows (bands, ``rows/``);
- ``optimizer_<i>``: the ``i``-th optimizer, dense ones first, then sparse ones (the Trainer's
  order: ``configure_optimizers``, then ``configure_sparse_optimizers``); ``meta.pt`` lists the
  sparse indices under ``sparse_optimizers``;
- everything else (Lightning's loops, callbacks, schedulers; Fabric's other entries) in ``meta.pt``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer

from lightning_sparse import checkpoint
from lightning_sparse.checkpoint.contents import MODULE, optimizer_key
from lightning_sparse.optim.base import SparseOptimizer

log = logging.getLogger(__name__)

# meta.pt entries this format uses itself (a Fabric state may not use these names).
RESERVED = ("state_dict", "optimizer_states", "state_dict_rest", "optimizer_states_rest", "sparse_tables",
            "sparse_optimizers", "fabric", "format", "row_tensors")  # fmt: skip


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """What the checkpoint holds of an optimizer: a sparse one without its per-row tensors (``write`` streams them)."""
    if isinstance(optimizer, SparseOptimizer):
        return checkpoint.dense_optimizer_state(optimizer)
    return get_optimizer_state_dict(module, optimizer)  # keyed by parameter name: loads into any wrapper of the module


def write(path: Path, module: nn.Module, optimizers: list[Optimizer], contents: dict[str, Any]) -> None:
    """Write ``contents`` (Lightning's checkpoint dict; its ``optimizer_states`` follow ``optimizers``) sharded. Collective."""
    contents = dict(contents)
    dense, rest = checkpoint.split_tensors({MODULE: contents.pop("state_dict", {})})
    dense = dense or {}
    optimizer_states = contents.pop("optimizer_states", None)
    meta = {**contents, "state_dict_rest": (rest or {}).get("state_dict", {})}
    sparse: dict[int, SparseOptimizer] = {}
    if optimizer_states is not None:
        meta["optimizer_states_rest"] = []
        for index, state in enumerate(optimizer_states):
            state_tensors, state_rest = checkpoint.split_tensors(state)
            dense[optimizer_key(index)] = state_tensors or {}
            meta["optimizer_states_rest"].append(state_rest or {})
        sparse = {i: opt for i, opt in enumerate(optimizers) if isinstance(opt, SparseOptimizer)}
        meta["sparse_optimizers"] = sorted(sparse)
    tables = [table for _, table in checkpoint.tables(module)]
    meta["sparse_tables"] = {t.name: [t.num_embeddings, t.embedding_dim] for t in tables}
    log.debug("saving %s (%d tables, %d sparse optimizers)", path, len(tables), len(sparse))
    checkpoint.save(path, module, sparse, dense, meta)


def sparse_indices(meta: dict[str, Any]) -> list[int]:
    """Which saved optimizers are sparse (by their ``duplicate_grads`` hyperparameter where not recorded)."""
    if "sparse_optimizers" in meta:
        return list(meta["sparse_optimizers"])
    rests = meta.get("optimizer_states_rest", [])
    return [i for i, rest in enumerate(rests) if "duplicate_grads" in (rest.get("param_groups") or [{}])[0]]


def read_optimizer(path: Path, index: int, module: nn.Module, optimizer: Optimizer, meta: dict[str, Any]) -> None:
    """Load the saved ``optimizer_<index>`` into ``optimizer`` (each rank only its rows of a sparse one). Collective.

    ``meta``: the checkpoint's ``meta.pt`` as :func:`~lightning_sparse.checkpoint.load_meta` read it.
    """
    rest = meta["optimizer_states_rest"][index]
    if isinstance(optimizer, SparseOptimizer):
        checkpoint.load_sparse_optimizer(path, index, optimizer, rest["param_groups"], meta)
        return
    state = get_optimizer_state_dict(module, optimizer)
    checkpoint.load_tensors(path, {optimizer_key(index): {"state": state["state"]}}, f"the state of {type(optimizer).__name__}")
    state["param_groups"] = rest["param_groups"]
    set_optimizer_state_dict(module, optimizer, state)
