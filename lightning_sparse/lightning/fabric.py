"""FabricSparseDDPStrategy: ``Fabric(strategy="sparse_ddp")``, Fabric's DDPStrategy plus the sparse path.

The same tables, optimizers and checkpoints as the Trainer's :class:`~lightning_sparse.SparseDDPStrategy`,
for a loop the user writes::

    fabric = Fabric(accelerator="cpu", devices=2, strategy="sparse_ddp")
    fabric.launch()
    model = Model()                                   # holds SparseEmbeddings and dense layers
    dense_opt = torch.optim.Adam(model.mlp.parameters())
    sparse_opt = lightning_sparse.SparseAdagrad([model.users, model.items], lr=0.1)
    model, dense_opt, sparse_opt = fabric.setup(model, dense_opt, sparse_opt)
    ...
    fabric.backward(loss)
    dense_opt.step(); sparse_opt.step()

Narrow overrides, each calling ``super()``:

- ``setup_module``: name, number and shard the module's tables (:func:`~lightning_sparse.lightning.placement.place_tables`),
  then wrap it in DDP for its dense parameters (a module that is only tables is not wrapped);
- ``setup_optimizer``: a sparse optimizer's state follows its tables to the device Fabric moved them to;
- ``optimizer_step``: a sparse optimizer exchanges and applies its pending row gradients;
- ``clip_gradients_*``: dense optimizers only (row gradients are not in ``.grad``);
- ``captured(step)``: on one GPU, a step function captured in a CUDA graph and replayed per batch;
- ``pipelined(loader, inputs)``: each batch's ids sent to their owners while the batch before it trains;
- ``save_checkpoint`` / ``load_checkpoint``: the Trainer's sharded format (:mod:`lightning_sparse.lightning.checkpoints`),
  so checkpoints move between the two and load on any number of ranks.

One process is not wrapped in DDP (it would sum nothing). ``fabric.no_backward_sync`` accumulates as with DDP: row gradients always wait on their rank
until the sparse optimizer's ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse import checkpoint
from lightning_sparse.lightning import checkpoints as lightning_format
from lightning_sparse.lightning import compat
from lightning_sparse.lightning.capture import CaptureRefused, CudaGraphs, Replays
from lightning_sparse.lightning.placement import (
    STRATEGY_NAME,
    collection_problems,
    fingerprint,
    optimizer_problems,
    place_tables,
    register,
    shard_in_dense_optimizer,
)
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.collection import SparseEmbeddingCollection
from lightning_sparse.tables.embedding import SparseEmbedding
from lightning_sparse.wire.ahead import pipelined


class FabricSparseDDPStrategy(DDPStrategy):
    """Fabric's DDP for dense parameters; row-sharded SparseEmbedding tables updated by sparse optimizers.

    ``shared_memory=True``: every table of its own keeps its rows in the host's shared memory, as the Trainer's strategy.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, *args: Any, shared_memory: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shared_memory = shared_memory
        self._backward_sync_control = _TablesOnlySyncControl()
        self._tables: list[SparseEmbedding] = []
        self._collections: list[SparseEmbeddingCollection] = []
        self._optimizers: list[Optimizer] = []

    @property
    def sparse_tables(self) -> list[SparseEmbedding]:
        """The tables of the modules set up so far."""
        return self._tables

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers set up so far, dense and sparse."""
        return self._optimizers

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        tables, collections = place_tables(module, shared_memory=self._shared_memory)
        self._tables.extend(t for t in tables if all(t is not known for known in self._tables))
        self._collections.extend(c for c in collections if all(c is not known for known in self._collections))
        if self.world_size > 1 and any(p.requires_grad for p in module.parameters()):
            return super().setup_module(module)
        return module  # one process or only tables: DDP would have nothing to all-reduce (and refuses a module of tables)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if not isinstance(optimizer, SparseOptimizer):
            _refuse_shards(optimizer, self._tables)
            self._optimizers.append(optimizer)
            return super().setup_optimizer(optimizer)
        if isinstance(self.precision, MixedPrecision) and self.precision.scaler is not None:
            raise ValueError(
                f"Fabric(precision={self.precision.precision!r}) scales the loss for the dense optimizers only; "
                f"{type(optimizer).__name__}'s row gradients would be stepped unscaled. HINT: use precision='bf16-mixed' "
                f"(no loss scale), or the Trainer, whose SparseMixedPrecision covers both."
            )
        for table in optimizer.tables:
            if all(table is not known for known in self._tables):
                raise ValueError(
                    f"{type(optimizer).__name__} updates {table.name}, which no module set up by this Fabric holds. "
                    f"HINT: set up the module first or in the same call: fabric.setup(model, dense_opt, sparse_opt)."
                )
            _follow_table(optimizer, table)
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    def captured(self, step: Callable[[Any], Any], *, other_shapes: str = "eager", warmup_steps: int = 2,
                 graphs: Any = None) -> CapturedStep:  # fmt: skip
        """``step(batch)`` (forward, ``fabric.backward``, the optimizers' steps and zero_grad), captured in a CUDA graph.

        ``captured(batch)`` then warms up, captures and replays it as the Trainer's captured step does
        (:mod:`~lightning_sparse.lightning.capture`), and returns its outputs: the graph's static tensors,
        which the next call overwrites (clone what you keep). ``captured(batch, last=True)``: a last batch of
        another shape, run eagerly or dropped (``other_shapes``); ``graphs``: tests pass a stand-in.
        """
        graphs = graphs if graphs is not None else CudaGraphs()
        return CapturedStep(self, step, Replays(graphs, other_shapes, warmup_steps, getattr(graphs, "device_type", "cuda")))

    def pipelined(self, loader: Iterable[Any], inputs: Callable[[Any], Mapping[Any, Any]]) -> Iterator[Any]:
        """``loader``'s batches, each one's ids sent ahead (:func:`lightning_sparse.pipelined`, over this strategy's timeout)."""
        return pipelined(loader, inputs, timeout=self._timeout)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, SparseOptimizer):  # no precision step: GradScaler would look for .grad
            return optimizer.step(**kwargs)
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:  # fmt: skip
        _refuse_sparse_clipping(optimizer)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        _refuse_sparse_clipping(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, path: compat.PATH, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:  # fmt: skip
        """Write ``state`` as a sharded checkpoint in the Trainer's format (see the module's docstring). Collective."""
        if storage_options is not None or filter:
            raise ValueError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter: it writes "
                             f"every table with DCP. HINT: call fabric.save(path, state) without them.")  # fmt: skip
        key, module = lightning_format.fabric_module(state, "save")
        optimizers = lightning_format.fabric_optimizers(state)
        contents: dict[str, Any] = {
            "state_dict": checkpoint.dense_module_state(module),
            "optimizer_states": [lightning_format.optimizer_state(module, opt) for opt in optimizers.values()],
            "fabric": {"module": key, "optimizers": list(optimizers)},
        }
        for name, obj in state.items():
            if name == key or name in optimizers:
                continue
            if name in lightning_format.RESERVED:
                raise ValueError(f"fabric.save: the state key {name!r} is reserved by the sharded checkpoint format. "
                                 f"HINT: rename it.")  # fmt: skip
            contents[name] = obj.state_dict() if isinstance(obj, compat.Stateful) else obj
        lightning_format.write(Path(self.broadcast(path)), module, list(optimizers.values()), contents)

    @override
    def load_checkpoint(
        self, path: compat.PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a sharded checkpoint written by Fabric or the Trainer; return the rest. Collective.

        Optimizers are matched by their key in ``state`` when Fabric wrote the checkpoint, else by
        order: the dense ones, then the sparse ones, as the Trainer numbers them. A single file
        (``python -m lightning_sparse export``) loads through Fabric's DDPStrategy.
        """
        path = Path(self.broadcast(path))
        if not checkpoint.is_sharded(path):
            return super().load_checkpoint(path, state, strict, weights_only)
        if isinstance(state, nn.Module):
            state = {"module": state}
        if not isinstance(state, dict) or not state:
            raise ValueError(f"{path} is a sharded checkpoint: it loads into the objects it restores. "
                             f"HINT: fabric.load(path, {{'model': model, 'optimizer': optimizer, ...}}).")  # fmt: skip
        checkpoint.verify(path)
        meta = checkpoint.load_meta(path, weights_only=True if weights_only is None else weights_only)
        key, module = lightning_format.fabric_module(state, "load")
        checkpoint.load_module(path, module, strict=strict, meta=meta)
        optimizers = lightning_format.fabric_optimizers(state)
        for index, optimizer in zip(lightning_format.saved_indices(meta, optimizers, path), optimizers.values()):
            lightning_format.read_optimizer(path, index, module, optimizer, meta)
        remainder = {k: v for k, v in meta.items() if k not in lightning_format.RESERVED}
        for name, obj in state.items():
            if name == key or name in optimizers:
                continue
            if name not in remainder:
                if strict:
                    raise KeyError(f"The requested state contains a key {name!r} that {path} does not hold. "
                                   f"HINT: pass strict=False to skip it.")  # fmt: skip
                continue
            value = remainder.pop(name)
            obj.load_state_dict(value) if isinstance(obj, compat.Stateful) else state.__setitem__(name, value)
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        register(cls, strategy_registry)


class CapturedStep:
    """A Fabric step function captured in a CUDA graph (:meth:`FabricSparseDDPStrategy.captured`)."""

    def __init__(self, strategy: FabricSparseDDPStrategy, step: Callable[[Any], Any], replays: Replays) -> None:
        self._strategy, self._step, self._replays = strategy, step, replays
        self._checked = False
        self._fingerprint: tuple | None = None

    @property
    def counts(self) -> dict[str, int]:
        """How many calls warmed up, were captured, replayed, ran eagerly or were dropped."""
        return self._replays.counts

    def __call__(self, batch: Any, *, last: bool = False) -> Any:
        strategy = self._strategy
        if not self._checked:  # before the first warm-up: what would not replay as it runs eagerly, by name
            self._replays.graphs.check_device(strategy.root_device, "fabric.strategy.captured")
            found = optimizer_problems(strategy.optimizers, [])
            found += [problem for collection in strategy._collections for problem in collection_problems(collection)]
            if strategy.world_size > 1:
                found.append((f"{strategy.world_size} processes: the all-to-all sizes each message on the host", "one GPU"))
            if getattr(strategy.precision, "scaler", None) is not None:
                found.append(("a loss scale: GradScaler decides on the host whether to step", "precision='bf16-mixed'"))
            if found:
                raise CaptureRefused("fabric.strategy.captured cannot capture this step:\n" + "\n".join(f"- {w}" for w, _ in found)
                                     + f"\nHINT: {'; '.join(dict.fromkeys(fix for _, fix in found))}.")  # fmt: skip
            self._checked = True
        if self._replays.captured and fingerprint(strategy.optimizers) != self._fingerprint:
            self._replays.invalidate()  # a load or a new hyperparameter: what the graph read is gone
        static = lambda: self._step(self._replays.static_batch)  # noqa: E731
        how, outputs = self._replays.step(batch, static, lambda: self._step(batch), last, "the captured step's batch")
        if how == "warm-up":
            self._fingerprint = fingerprint(strategy.optimizers)
        return outputs


class _TablesOnlySyncControl(compat.DDPBackwardSyncControl):
    """DDP's ``no_sync`` for a wrapped module; nothing to hold back for a module of tables only."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not isinstance(module, DistributedDataParallel):
            return nullcontext()
        return super().no_backward_sync(module, enabled)


def _follow_table(optimizer: SparseOptimizer, table: SparseEmbedding) -> None:
    """Move the optimizer's state of ``table`` to the table's device; refuse state built for another placement."""
    state = optimizer.state[table.shard]
    for name, value in state.items():
        if value.dim() and value.shape[0] != table.shard.shape[0]:
            raise ValueError(
                f"{type(optimizer).__name__} holds {value.shape[0]} rows of {name!r} for {table.name}, whose shard on "
                f"this rank has {table.shard.shape[0]}. HINT: build the optimizers after fabric.launch(), so that "
                f"tables and state are sharded alike."
            )
        state[name] = value.to(table.device)


def _refuse_shards(optimizer: Optimizer, tables: list[SparseEmbedding]) -> None:
    name = shard_in_dense_optimizer(optimizer, tables)
    if name is not None:
        raise ValueError(
            f"The shard of SparseEmbedding {name} was given to the dense optimizer {type(optimizer).__name__}. "
            f"HINT: give the table to a lightning_sparse optimizer (SparseAdagrad([model.table], ...))."
        )


def _refuse_sparse_clipping(optimizer: Optimizer) -> None:
    if isinstance(optimizer, SparseOptimizer):
        raise ValueError(
            f"fabric.clip_gradients clips the .grad of dense parameters; {type(optimizer).__name__}'s row gradients "
            f"wait on their ranks until step(). HINT: pass the dense optimizer: fabric.clip_gradients(model, dense_opt, ...)."
        )


FabricSparseDDPStrategy.register_strategies(STRATEGY_REGISTRY)
