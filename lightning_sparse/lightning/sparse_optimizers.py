"""The Trainer's ``configure_sparse_optimizers`` hook, read and checked, with its LR schedulers configured as Lightning's.

``setup_optimizers`` of :class:`~lightning_sparse.lightning.strategy.SparseDDPStrategy` calls
:func:`check_dense_optimizers` on what ``configure_optimizers`` returned, then
:func:`configure_sparse_optimizers`, and appends what that returns after the dense optimizers, so
that checkpoints, schedulers and LearningRateMonitor see them. Both hooks accept the same shapes
(an optimizer, lists, dicts with ``"lr_scheduler"``): Lightning's own parsing reads both.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer

from lightning_sparse.lightning import compat
from lightning_sparse.lightning.placement import shard_in_dense_optimizer
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.embedding import SparseEmbedding


def check_dense_optimizers(optimizers: list[Optimizer], tables: list[SparseEmbedding]) -> None:
    """Refuse a sparse optimizer among the dense ones, and a table's shard given to a dense one."""
    for optimizer in optimizers:
        if isinstance(optimizer, SparseOptimizer):
            raise MisconfigurationException(
                f"configure_optimizers returned {type(optimizer).__name__}. HINT: return sparse optimizers from "
                f"`configure_sparse_optimizers(self)` instead."
            )
        name = shard_in_dense_optimizer(optimizer, tables)
        if name is not None:
            raise MisconfigurationException(
                f"The shard of SparseEmbedding {name} was given to the dense optimizer {type(optimizer).__name__}. "
                f"HINT: give the table to a sparse optimizer in configure_sparse_optimizers; dense optimizers take "
                f"self.parameters(), which excludes it."
            )


def configure_sparse_optimizers(
    module: LightningModule, tables: list[SparseEmbedding]
) -> tuple[list[SparseOptimizer], list[Any]] | None:
    """The optimizers ``module.configure_sparse_optimizers()`` returns and their LR scheduler configs, checked.

    ``None`` when the module has no such hook or it returns ``None``, which only a module without
    tables may do. Every table must have an optimizer.
    """
    hook = getattr(module, "configure_sparse_optimizers", None)
    conf = hook() if callable(hook) else None
    if conf is None:
        if tables:
            raise MisconfigurationException(
                f"{type(module).__name__} has SparseEmbeddings ({', '.join(t.name for t in tables)}) but no "
                f"sparse optimizer. HINT: define `configure_sparse_optimizers(self)` returning e.g. "
                f"`lightning_sparse.SparseAdagrad([{', '.join('self.' + t.name for t in tables)}], lr=0.1)`."
            )
        return None
    optimizers, schedulers, monitor = compat.configure_optimizers(conf)
    for optimizer in optimizers:
        if not isinstance(optimizer, SparseOptimizer):
            raise MisconfigurationException(
                f"configure_sparse_optimizers returned {type(optimizer).__name__}. HINT: return a "
                f"lightning_sparse optimizer (SparseSGD, SparseAdagrad, ...); dense optimizers go in configure_optimizers."
            )
    covered = {id(t) for optimizer in optimizers for t in optimizer.tables}
    missing = [t.name for t in tables if id(t) not in covered]
    if missing:
        raise MisconfigurationException(
            f"No sparse optimizer updates {', '.join(missing)}. HINT: add them to an optimizer in "
            f"configure_sparse_optimizers; to freeze a table, look it up under torch.no_grad()."
        )
    if module.automatic_optimization:
        configs = compat.configure_schedulers_automatic_opt(schedulers, monitor)
    else:
        configs = compat.configure_schedulers_manual_opt(schedulers)
    compat.validate_scheduler_api(configs, module)
    return optimizers, configs
