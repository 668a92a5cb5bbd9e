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
- checkpoint hooks: sharded checkpoints through torch.distributed.checkpoint
  (``lightning_sparse/checkpoint.py``): each rank writes and reads only its rows, and a
  checkpoint loads on any number of ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import atexit
import gc
import logging
import signal
import sys

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import (
    LightningOptimizer,
    _MockOptimizer,
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
    _configure_schedulers_manual_opt,
    _validate_scheduler_api,
)
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse import checkpoint
from lightning_sparse.collection import SparseEmbeddingCollection
from lightning_sparse.embedding import SparseEmbedding
from lightning_sparse.lookup import serve_lookups
from lightning_sparse.exchange import ExchangeStats
from lightning_sparse.faults import PeerFailure, is_peer_failure
from lightning_sparse.precision import SparseMixedPrecision
from lightning_sparse.optim.base import SparseOptimizer

log = logging.getLogger(__name__)


class SparseDDPStrategy(DDPStrategy):
    """DDP for dense parameters; row-sharded SparseEmbedding tables updated by sparse optimizers."""

    strategy_name = "sparse_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
    def setup_environment(self) -> None:
        super().setup_environment()
        _destroy_process_groups_at_exit()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # A lost peer ends the run: ranks this process launched must not be left behind (a hung
        # rank, stopped or deadlocked, would otherwise outlive the program). SIGKILL reaches a stopped one.
        launcher = self.launcher
        lost_peer = isinstance(exception, PeerFailure) or is_peer_failure(exception)  # also from DDP's own all-reduce
        if lost_peer and launcher is not None and getattr(launcher, "procs", None):
            log.debug("%s: %s; killing the %d ranks this process launched", type(self).__name__,
                      type(exception).__name__, len(launcher.procs))  # fmt: skip
            launcher.kill(signal.SIGKILL)

    @override
    def teardown(self) -> None:
        super().teardown()
        # DDP's wrapper, unwrapped by Lightning, lives in reference cycles with its reducer's last
        # collective; free them now, not at interpreter shutdown (see _destroy_process_groups_at_exit).
        gc.collect()

    @override
    def model_to_device(self) -> None:
        super().model_to_device()
        self._tables = []
        for index, (name, table) in enumerate(
            (name, m) for name, m in self.lightning_module.named_modules() if isinstance(m, SparseEmbedding)
        ):
            table.adopt(name, index)
            table.materialize()
            self._tables.append(table)
        self._collections = []
        for index, (name, collection) in enumerate(
            ((name, m) for name, m in self.lightning_module.named_modules() if isinstance(m, SparseEmbeddingCollection)),
            start=len(self._tables),
        ):
            collection.adopt(name, index)
            collection.materialize()
            self._collections.append(collection)
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
        log.debug("%s: sparse optimizers %s (after %d dense), %d sparse LR schedulers", type(self).__name__,
                  [f"{type(o).__name__}({', '.join(t.name for t in o.tables)})" for o in optimizers],
                  len(self.optimizers) - len(optimizers), len(configs))  # fmt: skip

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

    # ------------------------------------------------------------------ evaluation with uneven loaders
    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        # A rank whose evaluation loader is empty never reaches a *_step: Lightning skips the loop.
        # It serves the other ranks' lookups instead, right after the skipped run.
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            _serve_when_skipped(loop, self)

    def _serve_after_last_batch(self, loop: Any) -> None:
        if self._tables and loop.batch_progress.is_last_batch:
            serve_lookups(self.lookup_units)

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
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # tables are sharded and optimizers exist: each rank loads straight into its rows

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # Sharded: load_checkpoint already restored them. Weights only: they start afresh.
        return not (self._restored_sharded or self._restored_weights_only)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's dense state; the tables are written by ``save_checkpoint`` from the module itself."""
        return checkpoint.dense_module_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, SparseOptimizer):  # per-row state is written by save_checkpoint, one tensor at a time
            return checkpoint.dense_optimizer_state(inner)
        if isinstance(inner, _MockOptimizer):
            return {}
        return get_optimizer_state_dict(self.lightning_module, inner)

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint (see ``lightning_sparse/checkpoint``). Collective."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options: it writes with DCP.")
        path = Path(self.broadcast(filepath))
        dense, rest = checkpoint.split_tensors({"state_dict": checkpoint_dict.pop("state_dict", {})})
        dense = dense or {}
        optimizer_states = checkpoint_dict.pop("optimizer_states", None)
        meta = {**checkpoint_dict, "state_dict_rest": (rest or {}).get("state_dict", {})}
        sparse: dict[int, SparseOptimizer] = {}
        if optimizer_states is not None:
            meta["optimizer_states_rest"] = []
            for index, state in enumerate(optimizer_states):
                state_tensors, state_rest = checkpoint.split_tensors(state)
                dense[f"optimizer_{index}"] = state_tensors or {}
                meta["optimizer_states_rest"].append(state_rest or {})
            sparse = {i: opt for i, opt in enumerate(self.optimizers) if isinstance(opt, SparseOptimizer)}
        meta["sparse_tables"] = {t.name: [t.num_embeddings, t.embedding_dim] for t in self._tables}
        log.debug("%s: saving %s (%d tables, %d sparse optimizers)", type(self).__name__, path, len(self._tables), len(sparse))
        checkpoint.save(path, self.lightning_module, sparse, dense, meta)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint into the module and (when fitting) the optimizers; return the rest.

        Works on any number of ranks and either sharding scheme. A single file with full tables
        loads too: one Lightning wrote, or a plain state dict (``python -m lightning_sparse export``),
        which restores weights only (optimizers, schedulers and loops start afresh). Collective.
        """
        path = Path(self.broadcast(checkpoint_path))
        self._restored_sharded = checkpoint.is_sharded(path)
        self._restored_weights_only = False
        if not self._restored_sharded:
            kind, loaded = checkpoint.load_file(path, weights_only=True if weights_only is None else weights_only)
            log.debug("loading %s checkpoint %s", kind, path)
            return loaded if kind == "lightning" else self._weights_only_checkpoint(loaded)
        checkpoint.verify(path)
        meta = checkpoint.load_meta(path, weights_only=True if weights_only is None else weights_only)
        log.debug("%s: loading sharded checkpoint %s on %d ranks", type(self).__name__, path, self.world_size)
        module = self.lightning_module
        checkpoint.load_module(path, module, strict=module.strict_loading)
        rests = meta.pop("optimizer_states_rest", None)
        if module.trainer.state.fn == TrainerFn.FITTING and rests is not None:
            if len(rests) != len(self.optimizers):
                raise MisconfigurationException(
                    f"Checkpoint {path} holds {len(rests)} optimizer states but the module has {len(self.optimizers)} "
                    f"optimizers (dense and sparse). HINT: resume with the same configure_optimizers and "
                    f"configure_sparse_optimizers."
                )
            for index, (optimizer, rest) in enumerate(zip(self.optimizers, rests)):
                self._load_optimizer(path, index, optimizer, rest)
        return meta

    def _weights_only_checkpoint(self, state_dict: dict[str, Tensor]) -> dict[str, Any]:
        """What Lightning restores from a plain state dict: the weights; optimizers and schedulers as they are now."""
        import lightning

        self._restored_weights_only = True
        return {
            "pytorch-lightning_version": lightning.__version__,
            "state_dict": state_dict,
            "lr_schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
        }

    def _load_optimizer(self, path: Path, index: int, optimizer: Optimizer, rest: dict[str, Any]) -> None:
        if isinstance(optimizer, SparseOptimizer):
            checkpoint.load_sparse_optimizer(path, index, optimizer, rest["param_groups"])
        elif not isinstance(optimizer, _MockOptimizer):
            state = get_optimizer_state_dict(self.lightning_module, optimizer)
            checkpoint.load_tensors(path, {f"optimizer_{index}": {"state": state["state"]}}, f"the state of {type(optimizer).__name__}")
            state["param_groups"] = rest["param_groups"]
            set_optimizer_state_dict(self.lightning_module, optimizer, state)

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint_dict:  # a single file; each table keeps the rows of its full tensor it owns
            super().load_model_state_dict(checkpoint_dict, strict=strict)
        elif not self._restored_sharded:
            raise RuntimeError(
                f"The checkpoint to restore has no 'state_dict' (keys: {sorted(checkpoint_dict)[:8]}). HINT: pass a "
                f"checkpoint written by Trainer(strategy='sparse_ddp') or by `python -m lightning_sparse export`."
            )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
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
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="DDP for dense parameters; row-sharded SparseEmbedding tables with sparse optimizers",
            )


_AT_EXIT_REGISTERED = False


def _destroy_process_groups_at_exit() -> None:
    """Register, once, an exit handler that destroys the process groups while the interpreter is alive.

    A gloo process group still alive when the interpreter finalizes can abort the process
    ("terminate called without an active exception", SIGABRT): its worker threads release
    finished collectives, and the tensors they hold, after Python is gone (torch issue #190489;
    pytorch/pytorch#179291 proposed this handler for torch itself). Lightning leaves the group
    for the next fit; if the program does not destroy it, this handler does, at exit.
    """
    global _AT_EXIT_REGISTERED
    if _AT_EXIT_REGISTERED:
        return
    _AT_EXIT_REGISTERED = True

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            gc.collect()  # work still referenced from garbage cycles goes first
            try:
                dist.destroy_process_group()
            except Exception as err:  # noqa: BLE001 - exiting anyway
                log.debug("destroying the process group at exit failed: %s", err)

    atexit.register(destroy)


def _serve_when_skipped(loop: Any, strategy: SparseDDPStrategy) -> None:
    """Make ``loop.run`` serve lookups when this rank had no batches (idempotent)."""
    if getattr(loop, "_serves_lookups_when_skipped", False):
        return
    run = loop.run

    def run_or_serve(*args: Any, **kwargs: Any) -> Any:
        output = run(*args, **kwargs)
        if loop.skip and strategy.sparse_tables:
            log.debug("%s: no batches on rank %d; serving the other ranks' lookups", type(loop).__name__, strategy.global_rank)
            serve_lookups(strategy.lookup_units)
        return output

    loop.run = run_or_serve
    loop._serves_lookups_when_skipped = True


def _refuse_foreign_strategy(table: SparseEmbedding) -> None:
    """Refuse to run inside a Lightning strategy other than SparseDDPStrategy (once per table).

    Under plain ``ddp`` or a single-device strategy nothing would ever step the table: training
    would silently leave it untouched. The running strategy is found on the call stack, so that
    plain PyTorch use pays nothing but this one look.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Strategy):
            if not isinstance(owner, SparseDDPStrategy):
                raise RuntimeError(
                    f"{table.name} is used under Lightning's {type(owner).__name__}, which does not shard or step "
                    f"SparseEmbeddings. HINT: pass strategy=\"sparse_ddp\" to the Trainer (import lightning_sparse first)."
                )
            return
        frame = frame.f_back


SparseDDPStrategy.register_strategies(StrategyRegistry)
SparseEmbedding.first_lookup_checks.append(_refuse_foreign_strategy)
