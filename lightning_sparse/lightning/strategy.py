"""SparseDDPStrategy: Lightning's DDPStrategy, plus the sparse path for SparseEmbedding tables.

Narrow overrides, each calling ``super()``:

- ``model_to_device``: shard every SparseEmbedding of the module over the process group (idempotent: trained shards survive later
  validate/test/predict calls), and number the lookup units (tables, then SparseEmbeddingCollections) that idle ranks serve;
- ``setup_optimizers``: add the optimizers of ``configure_sparse_optimizers()`` (and their LR schedulers) after the
  dense ones, so checkpoints, schedulers and LearningRateMonitor see them;
- ``backward`` / ``optimizer_step``: after the last backward of a step, exchange and apply the sparse gradients,
  with one skip decision for dense and sparse under ``16-mixed``;
- ``batch_to_device``: with ``pipeline=``, the next training batch's ids go to their owners while this one trains;
- ``*_step`` of validation, test and predict, and ``setup``: a rank that has run out of batches keeps serving lookups
  (``serve_lookups``) until all ranks are done, so uneven loaders never hang (:mod:`~lightning_sparse.lightning.uneven_evaluation`);
- checkpoint hooks: sharded checkpoints through torch.distributed.checkpoint; each rank writes and reads only its rows,
  and a checkpoint loads on any number of ranks (the helper object :class:`~lightning_sparse.lightning.checkpoints.TrainerCheckpoints`);
- ``setup_distributed``, ``backward``, ``barrier``, ``broadcast``, ``reduce``, ``on_exception``: ranks that cannot meet, and lost
  peers in DDP's and Lightning's collectives, raise ``PeerFailure``; the ranks this process launched are killed after one
  (:mod:`~lightning_sparse.lightning.lost_peers`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse import checkpoint
from lightning_sparse.faults.peers import collective, rendezvous_failure
from lightning_sparse.lightning import checkpoints, compat, lost_peers, uneven_evaluation
from lightning_sparse.lightning.checkpoints import TrainerCheckpoints, trainer_optimizer_state
from lightning_sparse.lightning.placement import STRATEGY_NAME, ShardingGroups, place_tables, register, summarize
from lightning_sparse.lightning.precision import SparseMixedPrecision, step_after_dense, step_alone
from lightning_sparse.lightning.sparse_optimizers import check_dense_optimizers, configure_sparse_optimizers
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.collection import SparseEmbeddingCollection
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.ahead import Pipeline
from lightning_sparse.wire.alltoall import ExchangeStats

log = logging.getLogger(__name__)


class SparseDDPStrategy(DDPStrategy):
    """DDP for dense parameters; row-sharded SparseEmbedding tables updated by sparse optimizers.

    ``sharding_group_size=G`` shards every table over groups of ``G`` consecutive ranks (e.g. the GPUs of one host) and
    replicates it across the ``W / G`` groups (2-D sharding, :mod:`lightning_sparse.wire.replicas`); default: over all
    ranks. ``pipeline=inputs``: see :func:`lightning_sparse.pipelined`. ``shared_memory=True``: tables of their own keep
    their rows in the host's shared memory (docs/guide/shared-memory.md). Every other argument is DDPStrategy's.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *args: Any, sharding_group_size: int | None = None, pipeline: Callable[[Any], Any] | None = None,
                 shared_memory: bool = False, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self._pipeline = Pipeline(pipeline, self._timeout) if pipeline is not None else None
        self._sharding, self._shared_memory = ShardingGroups(sharding_group_size), shared_memory  # how tables are placed
        self._tables: list[SparseEmbedding] = []
        self._collections: list[SparseEmbeddingCollection] = []
        self._sparse_optimizers: list[SparseOptimizer] = []
        self._checkpoints = TrainerCheckpoints()

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
            self._launcher = compat.SparseMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def teardown(self) -> None:
        super().teardown()
        # DDP's wrapper (unwrapped by Lightning) and its reducer, which holds the process group, form cycles: free them now (exits.py).
        gc.collect()

    @override
    def setup_distributed(self) -> None:
        try:
            super().setup_distributed()
        except (dist.DistNetworkError, dist.DistStoreError) as err:  # the ranks never met: name the settings to fix
            raise rendezvous_failure(err, self.cluster_environment, self.node_rank, self._timeout) from err
        lost_peers.after_meeting(self.num_processes, self.global_rank)

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        uneven_evaluation.serve_when_skipped(trainer, self)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        lost_peers.kill_launched(self.launcher, exception)

    @property
    def sharding_group_size(self) -> int | None:
        """Ranks a table is sharded over under 2-D sharding (``None``: all ranks)."""
        return self._sharding.size

    @override
    def model_to_device(self) -> None:
        super().model_to_device()
        groups = self._sharding.of_rank(self.world_size, self._timeout)
        self._tables, self._collections = place_tables(self.lightning_module, *groups, shared_memory=self._shared_memory)
        if isinstance(self.precision_plugin, SparseMixedPrecision):
            self.precision_plugin.cover(self._tables)
        log.debug("%s: sharded %d tables over %d ranks: %s", type(self).__name__, len(self._tables), self.world_size,
                  ", ".join(f"{t.name} {t.num_embeddings}x{t.embedding_dim} ({t.sharding_scheme})" for t in self._tables))  # fmt: skip

    @override
    def configure_ddp(self) -> None:
        if self.world_size > 1 and any(p.requires_grad for p in self.lightning_module.parameters()):
            return super().configure_ddp()
        # One process (DDP would sum nothing) or only tables (DDP refuses a module without trainable parameters).
        log.debug("%s: one process, or no dense parameter needs a gradient: not wrapped in DDP", type(self).__name__)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        check_dense_optimizers(self.optimizers, self._tables)
        configured = configure_sparse_optimizers(self.lightning_module, self._tables)
        if configured is None:
            return
        optimizers, configs = configured
        self._sparse_optimizers = optimizers
        self.optimizers = [*self.optimizers, *optimizers]
        self.lr_scheduler_configs = [*self.lr_scheduler_configs, *configs]
        log.debug("%s: sparse optimizers %s (after %d dense), %d sparse LR schedulers", type(self).__name__,
                  [f"{type(o).__name__}({', '.join(t.name for t in o.tables)})" for o in optimizers],
                  len(self.optimizers) - len(optimizers), len(configs))  # fmt: skip
        if any(isinstance(callback, ModelSummary) for callback in trainer.callbacks):  # beside Lightning's summary
            rank_zero_info("\n" + summarize(self._tables, optimizers))

    # ------------------------------------------------------------------ training step
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._pipeline is None:
            return super().batch_to_device(batch, device, dataloader_idx)
        following = compat.next_training_batch(self.lightning_module.trainer)
        return self._pipeline.moved_ahead(batch, super().batch_to_device, following, device, dataloader_idx)

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
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        with collective("backward (with DDP's all-reduce of the dense gradients)", note_other_errors=False):
            return super().backward(*args, **kwargs)

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
            return step_alone(self.precision_plugin, inner)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._sparse_optimizers and self.lightning_module.automatic_optimization:
            step_after_dense(self.precision_plugin, self._sparse_optimizers)
        return output

    # ------------------------------------------------------------------ evaluation with uneven loaders
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        uneven_evaluation.serve_after_last_batch(compat.evaluation_loop(self.lightning_module.trainer), self)
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        uneven_evaluation.serve_after_last_batch(compat.evaluation_loop(self.lightning_module.trainer), self)
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        uneven_evaluation.serve_after_last_batch(self.lightning_module.trainer.predict_loop, self)
        return output

    # ------------------------------------------------------------------ collectives: a lost peer raises PeerFailure
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with collective("barrier"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with collective("broadcast"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        with collective("reduce (self.log(..., sync_dist=True))"):
            return super().reduce(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # tables are sharded and optimizers exist: each rank loads straight into its rows

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self._checkpoints.restores_optimizers

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's dense state; the tables are written by ``save_checkpoint`` from the module itself."""
        return checkpoint.dense_module_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return trainer_optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: compat.PATH, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint (see ``lightning_sparse/checkpoint``). Collective."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options: it writes with DCP.")
        checkpoints.write(Path(self.broadcast(filepath)), self.lightning_module, self.optimizers, checkpoint_dict)

    @override
    def load_checkpoint(self, checkpoint_path: compat.PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint or a single file (:meth:`TrainerCheckpoints.load`). Collective."""
        path = Path(self.broadcast(checkpoint_path))
        return self._checkpoints.load(path, self.lightning_module, self.optimizers, self.lr_scheduler_configs, weights_only)

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        if self._checkpoints.holds_weights(checkpoint_dict):  # a single file; each table keeps the rows it owns
            super().load_model_state_dict(checkpoint_dict, strict=strict)

    @override
    def remove_checkpoint(self, filepath: compat.PATH) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)

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
