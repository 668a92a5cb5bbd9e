"""SparseDDPStrategy: Lightning's DDPStrategy, plus the sparse path for SparseEmbedding tables.

Narrow overrides, each calling ``super()``:

- ``model_to_device``: shard every SparseEmbedding of the module over the process group
  (idempotent: trained shards survive later validate/test/predict calls), and number the
  lookup units (tables, then SparseEmbeddingCollections) that idle ranks serve;
- ``setup_optimizers``: add the optimizers of ``configure_sparse_optimizers()`` (and their LR
  schedulers) after the dense ones, so checkpoints, schedulers and LearningRateMonitor see them;
- ``backward`` / ``optimizer_step``: after the last backward of a step, exchange and apply
  the sparse gradients, with one skip decision for dense and sparse under ``16-mixed``;
- ``*_step`` of validation, test and predict (the ``UnevenEvaluationHooks`` mixin,
  ``lightning_sparse/lightning/uneven_evaluation.py``): a rank that has run out of batches keeps serving
  lookups (``serve_lookups``) until all ranks are done, so uneven loaders never hang;
- checkpoint hooks (the ``SparseCheckpointHooks`` mixin, ``lightning_sparse/lightning/checkpoint_hooks.py``):
  sharded checkpoints through torch.distributed.checkpoint; each rank writes and reads only its
  rows, and a checkpoint loads on any number of ranks;
- lost-peer hooks (the ``LostPeerHooks`` mixin, ``lightning_sparse/lightning/lost_peers.py``): ranks that
  cannot meet, and lost peers in DDP's and Lightning's collectives, raise ``PeerFailure``; the
  ranks this process launched are killed after one.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse.lightning import compat
from lightning_sparse.lightning.checkpoint_hooks import SparseCheckpointHooks
from lightning_sparse.lightning.launcher import SparseMultiProcessingLauncher
from lightning_sparse.lightning.lost_peers import LostPeerHooks
from lightning_sparse.lightning.placement import STRATEGY_NAME, place_tables, register, shard_in_dense_optimizer
from lightning_sparse.lightning.precision import SparseMixedPrecision
from lightning_sparse.lightning.table_summary import summarize
from lightning_sparse.lightning.uneven_evaluation import UnevenEvaluationHooks
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.collection import SparseEmbeddingCollection
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.alltoall import ExchangeStats
from lightning_sparse.wire.replicas import sharding_groups

log = logging.getLogger(__name__)


class SparseDDPStrategy(LostPeerHooks, SparseCheckpointHooks, UnevenEvaluationHooks, DDPStrategy):
    """DDP for dense parameters; row-sharded SparseEmbedding tables updated by sparse optimizers.

    ``sharding_group_size=G`` shards every table over groups of ``G`` consecutive ranks (e.g. the
    GPUs of one host) and replicates it across the ``W / G`` groups (2-D sharding,
    :mod:`lightning_sparse.wire.replicas`); default: over all ranks. Every other argument is DDPStrategy's.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *args: Any, sharding_group_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if sharding_group_size is not None and (not isinstance(sharding_group_size, int) or sharding_group_size < 1):
            raise ValueError(
                f"Invalid sharding_group_size: {sharding_group_size!r}. HINT: pass a positive divisor of the world size."
            )
        self._sharding_group_size = sharding_group_size
        self._sharding_groups: tuple[dist.ProcessGroup, dist.ProcessGroup | None] | None = None
        self._tables: list[SparseEmbedding] = []
        self._collections: list[SparseEmbeddingCollection] = []
        self._sparse_optimizers: list[SparseOptimizer] = []
        self._restored_sharded = False
        self._restored_weights_only = False

    @property
    def sparse_tables(self) -> list[SparseEmbedding]:
        """The module's SparseEmbeddings, in ``named_modules`` order (their ``table_index``)."""
        return self._tables

    @property
    def lookup_units(self) -> list[SparseEmbedding | SparseEmbeddingCollection]:
        """What a rank out of batches serves (``serve_lookups``): the tables, then the collections."""
        return [*self._tables, *self._collections]

    @property
    def sparse_optimizers(self) -> list[SparseOptimizer]:
        return self._sparse_optimizers

    # ------------------------------------------------------------------ setup and teardown
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method != "popen":  # ranks in child processes: rank 0 hands back full tables
            self._launcher = SparseMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def teardown(self) -> None:
        super().teardown()
        # DDP's wrapper, unwrapped by Lightning, lives in reference cycles with its reducer (which
        # holds the process group); free them now, not at interpreter shutdown (see exits.py).
        gc.collect()

    @property
    def sharding_group_size(self) -> int | None:
        """Ranks a table is sharded over under 2-D sharding (``None``: all ranks)."""
        return self._sharding_group_size

    def _table_groups(self) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(sharding group, replica group) of this rank: the 2-D groups, made once, or (None, None) for the default group."""
        size = self._sharding_group_size
        if size is None or size == self.world_size or not dist.is_initialized():
            return None, None
        if self._sharding_groups is None:
            try:
                self._sharding_groups = sharding_groups(size, timeout=self._timeout)
            except ValueError as err:
                raise MisconfigurationException(str(err)) from None
            log.debug("%s: 2-D sharding, groups of %d ranks, %d replicas", type(self).__name__, size, self.world_size // size)
        return self._sharding_groups

    @override
    def model_to_device(self) -> None:
        super().model_to_device()
        self._tables, self._collections = place_tables(self.lightning_module, *self._table_groups())
        if isinstance(self.precision_plugin, SparseMixedPrecision):
            self.precision_plugin.tables = self._tables
        log.debug("%s: sharded %d tables over %d ranks: %s", type(self).__name__, len(self._tables), self.world_size,
                  ", ".join(f"{t.name} {t.num_embeddings}x{t.embedding_dim} ({t.sharding_scheme})" for t in self._tables))  # fmt: skip

    @override
    def configure_ddp(self) -> None:
        if any(p.requires_grad for p in self.lightning_module.parameters()):
            return super().configure_ddp()
        # Only tables (DDP refuses a module without trainable parameters, and would have nothing to all-reduce).
        log.debug("%s: no dense parameter needs a gradient; the module is not wrapped in DDP", type(self).__name__)

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
        optimizers, schedulers, monitor = compat.configure_optimizers(conf)
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
            configs = compat.configure_schedulers_automatic_opt(schedulers, monitor)
        else:
            configs = compat.configure_schedulers_manual_opt(schedulers)
        compat.validate_scheduler_api(configs, module)
        self._sparse_optimizers = optimizers
        self.optimizers = [*self.optimizers, *optimizers]
        self.lr_scheduler_configs = [*self.lr_scheduler_configs, *configs]
        log.debug("%s: sparse optimizers %s (after %d dense), %d sparse LR schedulers", type(self).__name__,
                  [f"{type(o).__name__}({', '.join(t.name for t in o.tables)})" for o in optimizers],
                  len(self.optimizers) - len(optimizers), len(configs))  # fmt: skip
        if any(isinstance(callback, ModelSummary) for callback in trainer.callbacks):  # beside Lightning's summary
            rank_zero_info("\n" + summarize(self._tables, optimizers))

    def _check_dense_optimizers(self) -> None:
        for optimizer in self.optimizers:
            if isinstance(optimizer, SparseOptimizer):
                raise MisconfigurationException(
                    f"configure_optimizers returned {type(optimizer).__name__}. HINT: return sparse optimizers from "
                    f"`configure_sparse_optimizers(self)` instead."
                )
            name = shard_in_dense_optimizer(optimizer, self._tables)
            if name is not None:
                raise MisconfigurationException(
                    f"The shard of SparseEmbedding {name} was given to the dense optimizer {type(optimizer).__name__}. "
                    f"HINT: give the table to a sparse optimizer in configure_sparse_optimizers; dense optimizers take "
                    f"self.parameters(), which excludes it."
                )

    # ------------------------------------------------------------------ training step
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if type(plugin) is MixedPrecision:  # 16-mixed / bf16-mixed: one skip decision covering the tables
            plugin = SparseMixedPrecision.replacing(plugin)
        self._precision_plugin = plugin

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
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._sparse_optimizers and self.lightning_module.automatic_optimization:
            plugin = self.precision_plugin
            skipped = isinstance(plugin, SparseMixedPrecision) and plugin.skipped
            for sparse in self._sparse_optimizers:
                sparse.zero_grad() if skipped else sparse.step()
        return output

    def _sparse_step(self, optimizer: SparseOptimizer) -> Any:
        plugin = self.precision_plugin
        if isinstance(plugin, SparseMixedPrecision) and plugin.scaler is not None:
            if plugin.unscale_sparse(optimizer.tables).item():
                optimizer.zero_grad()  # every rank agreed: skip, as GradScaler skips a dense step
                return None
        return optimizer.step()

    # ------------------------------------------------------------------ stats
    def pop_sparse_stats(self) -> ExchangeStats:
        """This rank's sparse-path totals since the last call (tables and sparse optimizers)."""
        total = ExchangeStats()
        for source in [*self._tables, *self._collections, *self._sparse_optimizers]:
            total.add(source.stats)
            source.stats.reset()
        return total

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        register(cls, strategy_registry)


SparseDDPStrategy.register_strategies(StrategyRegistry)
