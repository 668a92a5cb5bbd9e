"""SparseDDPStrategy: Lightning's DDPStrategy, plus the sparse path for SparseEmbedding tables.

Narrow overrides, each calling ``super()``:

- ``model_to_device``: shard every SparseEmbedding of the module over the process group
  (idempotent: trained shards survive later validate/test/predict calls);
- ``setup_optimizers``: add the optimizers of ``configure_sparse_optimizers()`` (and their LR
  schedulers) after the dense ones, so checkpoints, schedulers and LearningRateMonitor see them;
- ``backward`` / ``optimizer_step``: after the last backward of a step, exchange and apply
  the sparse gradients, with one skip decision for dense and sparse under ``16-mixed``;
- ``*_step`` of validation, test and predict: a rank that has run out of batches keeps serving
  lookups (``serve_lookups``) until all ranks are done, so uneven loaders never hang;
- checkpoint hooks: tables and sparse optimizer state are gathered into full tensors on save
  and each rank keeps its rows on load.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import (
    LightningOptimizer,
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
    _configure_schedulers_manual_opt,
    _validate_scheduler_api,
)
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse.embedding import SparseEmbedding, full_state_dict, serve_lookups
from lightning_sparse.exchange import ExchangeStats
from lightning_sparse.optim.base import SparseOptimizer


class SparseDDPStrategy(DDPStrategy):
    """DDP for dense parameters; row-sharded SparseEmbedding tables updated by sparse optimizers."""

    strategy_name = "sparse_ddp"
    # Read by SparseEmbedding to refuse running under strategies that would never step it.
    manages_sparse_embeddings = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tables: list[SparseEmbedding] = []
        self._sparse_optimizers: list[SparseOptimizer] = []
        self._loss_scale: float | None = None  # the 16-mixed scale of the pending sparse gradients

    @property
    def sparse_tables(self) -> list[SparseEmbedding]:
        """The module's SparseEmbeddings, in ``named_modules`` order (their ``table_index``)."""
        return self._tables

    @property
    def sparse_optimizers(self) -> list[SparseOptimizer]:
        return self._sparse_optimizers

    # ------------------------------------------------------------------ setup
    @override
    def model_to_device(self) -> None:
        super().model_to_device()
        self._tables = []
        for index, (name, table) in enumerate(
            (name, m) for name, m in self.lightning_module.named_modules() if isinstance(m, SparseEmbedding)
        ):
            if not table.has_given_name:
                table.name = name
            table.table_index = index
            table._strategy_checked = True
            table.materialize()
            self._tables.append(table)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        self._check_dense_optimizers()
        hook = getattr(module, "configure_sparse_optimizers", None)
        conf = hook() if callable(hook) else None
        if conf is None:
            if self._tables:
                raise MisconfigurationException(
                    f"{type(module).__name__} has SparseEmbeddings ({', '.join(t.name for t in self._tables)}) but no "
                    f"sparse optimizer. HINT: define `configure_sparse_optimizers(self)` returning e.g. "
                    f"`lightning_sparse.SparseAdagrad([{', '.join('self.' + t.name for t in self._tables)}], lr=0.1)`."
                )
            return
        optimizers, schedulers, monitor = _configure_optimizers(conf)
        for optimizer in optimizers:
            if not isinstance(optimizer, SparseOptimizer):
                raise MisconfigurationException(
                    f"configure_sparse_optimizers returned {type(optimizer).__name__}. HINT: return a "
                    f"lightning_sparse optimizer (SparseSGD, SparseAdagrad, ...); dense optimizers go in configure_optimizers."
                )
        covered = {id(t) for optimizer in optimizers for t in optimizer.tables}
        missing = [t.name for t in self._tables if id(t) not in covered]
        if missing:
            raise MisconfigurationException(
                f"No sparse optimizer updates {', '.join(missing)}. HINT: add them to an optimizer in "
                f"configure_sparse_optimizers; to freeze a table, look it up under torch.no_grad()."
            )
        if module.automatic_optimization:
            configs = _configure_schedulers_automatic_opt(schedulers, monitor)
        else:
            configs = _configure_schedulers_manual_opt(schedulers)
        _validate_scheduler_api(configs, module)
        self._sparse_optimizers = optimizers
        self.optimizers = [*self.optimizers, *optimizers]
        self.lr_scheduler_configs = [*self.lr_scheduler_configs, *configs]

    def _check_dense_optimizers(self) -> None:
        shards = {id(t.shard): t.name for t in self._tables}
        for optimizer in self.optimizers:
            if isinstance(optimizer, SparseOptimizer):
                raise MisconfigurationException(
                    f"configure_optimizers returned {type(optimizer).__name__}. HINT: return sparse optimizers from "
                    f"`configure_sparse_optimizers(self)` instead."
                )
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in shards:
                        raise MisconfigurationException(
                            f"The shard of SparseEmbedding {shards[id(p)]} was given to the dense optimizer "
                            f"{type(optimizer).__name__}. HINT: give the table to a sparse optimizer in "
                            f"configure_sparse_optimizers; dense optimizers take self.parameters(), which excludes it."
                        )

    # ------------------------------------------------------------------ training step
    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        scaler = self._scaler
        if scaler is not None:
            self._loss_scale = float(scaler.get_scale())
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Dense step through DDP and the precision plugin, then the sparse step (automatic optimization).

        A sparse optimizer stepped directly (manual optimization) runs only its own step.
        """
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, SparseOptimizer):
            closure()
            return self._sparse_step(inner)
        if not self._sparse_optimizers or not self.lightning_module.automatic_optimization:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        scaler = self._scaler
        scale_before = scaler.get_scale() if scaler is not None else None

        def closure_then_check_sparse() -> Any:
            result = closure()
            if scaler is not None and result is not None and self._unscale_sparse_grads():
                _make_scaler_skip(inner)
            return result

        output = super().optimizer_step(optimizer, closure_then_check_sparse, model, **kwargs)
        skipped = scaler is not None and scaler.get_scale() < scale_before
        for sparse in self._sparse_optimizers:
            if skipped:
                sparse.zero_grad()
            else:
                sparse.step()
        return output

    def _sparse_step(self, optimizer: SparseOptimizer) -> Any:
        if self._scaler is not None and self._unscale_sparse_grads(optimizer.tables):
            optimizer.zero_grad()  # every rank agreed: skip, as GradScaler skips a dense step
            return None
        return optimizer.step()

    @property
    def _scaler(self) -> torch.amp.GradScaler | None:
        plugin = self.precision_plugin
        return plugin.scaler if isinstance(plugin, MixedPrecision) else None

    def _unscale_sparse_grads(self, tables: list[SparseEmbedding] | None = None) -> bool:
        """Divide pending sparse gradients by the loss scale; True if any rank found inf/NaN. Collective."""
        inv_scale = 1.0 / self._loss_scale if self._loss_scale else 1.0
        found = torch.zeros(1, device=self.root_device)
        for table in tables or self._tables:
            for lookup in table._pending:
                if lookup.rows.grad is not None:
                    lookup.rows.grad.mul_(inv_scale)
                    found += (~torch.isfinite(lookup.rows.grad)).any()
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    # ------------------------------------------------------------------ evaluation with uneven loaders
    def _serve_after_last_batch(self, loop: Any) -> None:
        if self._tables and loop.batch_progress.is_last_batch:
            serve_lookups(self._tables)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self._serve_after_last_batch(self.lightning_module.trainer._evaluation_loop)
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._serve_after_last_batch(self.lightning_module.trainer._evaluation_loop)
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        self._serve_after_last_batch(self.lightning_module.trainer.predict_loop)
        return output

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with every table gathered into its full ``weight``. Collective."""
        return full_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, SparseOptimizer):
            return inner.full_state_dict()
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise MisconfigurationException(
                f"The checkpoint holds {len(states)} optimizer states but the module has {len(self.optimizers)} "
                f"optimizers (dense and sparse). HINT: resume with the same configure_optimizers and "
                f"configure_sparse_optimizers."
            )
        for optimizer, state in zip(self.optimizers, states):
            if isinstance(optimizer, SparseOptimizer):
                optimizer.load_full_state_dict(state)
            else:
                optimizer.load_state_dict(state)
                _optimizer_to_device(optimizer, self.root_device)

    # ------------------------------------------------------------------ stats
    def pop_sparse_stats(self) -> ExchangeStats:
        """This rank's sparse-path totals since the last call (tables and sparse optimizers)."""
        total = ExchangeStats()
        for source in [*self._tables, *self._sparse_optimizers]:
            total.add(source.stats)
            source.stats.reset()
        return total

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="DDP for dense parameters; row-sharded SparseEmbedding tables with sparse optimizers",
            )


def _make_scaler_skip(optimizer: Optimizer) -> None:
    """Make GradScaler skip this step: it decides from the dense gradients alone.

    A sparse overflow (already agreed on by every rank) is written into one dense gradient as
    NaN, so the scaler skips the dense step and backs off its scale exactly as for a dense
    overflow; the strategy then drops the sparse gradients too.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.view(-1)[0] = float("nan")
                return


SparseDDPStrategy.register_strategies(StrategyRegistry)
