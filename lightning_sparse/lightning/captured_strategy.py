"""CapturedSparseDDPStrategy: ``"sparse_ddp"`` with its training step captured in a CUDA graph, on one GPU.

``Trainer(strategy="sparse_ddp_captured")`` or ``Trainer(strategy=CapturedSparseDDPStrategy(other_shapes="drop"))``.
The strategy's ``optimizer_step`` holds the whole automatic step: the closure Lightning hands it
(``zero_grad``, ``training_step``, ``backward``), the precision plugin's hooks and gradient
clipping, the dense optimizer's step, then the sparse optimizers' steps. That is what is
captured, with :class:`~lightning_sparse.lightning.capture.Replays` (warm-ups on a side stream,
the checks, one capture, then a replay per batch); ``training_step`` reads the static batch.
What a replay does not run is done on the host after it, from the graph's static outputs:

- each ``self.log`` call the step made (recorded at the capture, :func:`compat.logs_recorded`) is
  made again with the static value, so loggers and the progress bar see every step;
- the loop gets the step's loss and extra outputs (``on_train_batch_end``'s ``outputs``), and its
  ``zero_grad`` count, as after an eager step (checkpoints hold it);
- before each replay the optimizers' tensors and hyperparameters are compared with the capture's:
  a load of optimizer state or a new learning rate float warms up and captures again (a checkpoint
  load does so too).

Everything else the step runs in Python (conditions, counters of one's own) runs at the capture
only. ``on_train_start`` refuses, by name and before any capture, what would not replay as it runs
eagerly (:func:`problems`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse.lightning import compat
from lightning_sparse.lightning.capture import CaptureRefused, CudaGraphs, Replays
from lightning_sparse.lightning.placement import collection_problems, fingerprint, optimizer_problems
from lightning_sparse.lightning.precision import SparseMixedPrecision
from lightning_sparse.lightning.strategy import SparseDDPStrategy
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.tables.collection import SparseEmbeddingCollection

NAME = "sparse_ddp_captured"
# Hooks Lightning calls inside the captured step: a callback's would run at the capture only.
INSIDE_THE_STEP = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
CAPTURABLE_PRECISION = (Precision, MixedPrecision, SparseMixedPrecision, HalfPrecision)  # types, with no GradScaler


class CapturedSparseDDPStrategy(SparseDDPStrategy):
    """SparseDDPStrategy whose automatic training step is captured in a CUDA graph once and replayed per batch.

    ``other_shapes``: the epoch's last batch, when its shape differs: ``"eager"`` (run it eagerly) or
    ``"drop"`` (skip it, as Lightning skips a step whose ``training_step`` returns ``None``: the loop
    and the schedulers still count it; ``DataLoader(drop_last=True)`` never loads it instead).
    ``warmup_steps``: eager steps on a side stream before the capture (each trains on its batch).
    ``graphs``: what makes the graphs (:class:`~lightning_sparse.lightning.capture.CudaGraphs`; tests
    pass a stand-in). Every other argument is SparseDDPStrategy's.
    """

    strategy_name = NAME

    def __init__(self, *args: Any, other_shapes: str = "eager", warmup_steps: int = 2, graphs: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        graphs = graphs if graphs is not None else CudaGraphs()
        self._replays = Replays(graphs, other_shapes, warmup_steps, getattr(graphs, "device_type", "cuda"))
        self._batch: Any = None
        self._reading_static = False
        self._calls: list[tuple] = []  # the self.log calls of the step's last Python run (the capture's)
        self._fingerprint: tuple | None = None

    @property
    def captures(self) -> Mapping[str, int]:
        """How many steps warmed up, were captured, replayed, ran eagerly or were dropped."""
        return self._replays.counts

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.training:
            self._replays.graphs.check_device(self.root_device, type(self).__name__)
        super().setup(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._replays.graphs.check_device(self.root_device, type(self).__name__)
        found = problems(self.lightning_module.trainer, self)
        if found:
            raise CaptureRefused(f"{type(self).__name__} cannot capture this fit's training step:\n"
                                 + "\n".join(f"- {what}" for what, _ in found)
                                 + f"\nHINT: {'; '.join(dict.fromkeys(fix for _, fix in found))}.")  # fmt: skip

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._batch = batch

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._reading_static:  # warmed up, captured or replayed: the step reads the static batch
            args = (self._replays.static_batch, *args[1:])
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The automatic step of the current batch, warmed up, replayed, run eagerly or dropped (see the module)."""
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, SparseOptimizer) or not self.lightning_module.automatic_optimization:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        eager = partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        trainer, module = self.lightning_module.trainer, self.lightning_module
        if self._replays.captured and fingerprint(self.optimizers) != self._fingerprint:
            self._replays.invalidate()  # a load or a new hyperparameter: what the graph read is gone
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        how, outputs = self._replays.step(self._batch, partial(self._run, eager, closure), eager, last, "the batch")
        if how == "dropped":
            compat.set_closure_result(closure, None, {})
            return None
        if how == "eager":
            return outputs
        compat.count_zero_grad(trainer)
        for (fx, name, _, args, log_kwargs), value in zip(self._calls, outputs["logs"]):
            with compat.logging_as(module, fx):
                module.log(name, value, *args, **log_kwargs)
        # The loop's loss and outputs: the static ones, copied (a capture leaves the closure the graph's, not yet computed)
        compat.set_closure_result(closure, outputs["loss"], {k: _copied(v) for k, v in outputs["extra"].items()})
        if how == "warm-up":
            self._fingerprint = fingerprint(self.optimizers)  # after the warm-ups made the optimizers' state
        return outputs["loss"]

    def _run(self, eager: Callable[[], Any], closure: Any) -> dict[str, Any]:
        """The step on the static batch, as warmed up and captured: its loss, extra outputs and logged values."""
        trainer, calls = self.lightning_module.trainer, []
        progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
        kept = progress.state_dict()
        self._reading_static = True
        try:
            with compat.logs_recorded(self.lightning_module, lambda *call: calls.append(_recorded(*call))):
                eager()
        finally:
            self._reading_static = False
            progress.load_state_dict(kept)  # counted once per step, after it (a replay runs no Python)
        result = compat.closure_result(closure)
        if result is None or result.loss is None:
            raise CaptureRefused(f"{type(self).__name__}: training_step returned no loss: a step skipped by the host's "
                                 f"choice cannot be replayed. HINT: return the loss in every step, or leave capture off.")  # fmt: skip
        self._calls = calls
        return {"loss": result.loss, "extra": result.extra, "logs": [call[2] for call in calls]}

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._replays.invalidate()  # the optimizers' state is replaced: the graph would read the old one
        return super().load_checkpoint(*args, **kwargs)

    @override
    def teardown(self) -> None:
        self._replays.invalidate()  # the graph's memory goes back
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        super().register_strategies(strategy_registry)
        if NAME not in strategy_registry:
            strategy_registry.register(NAME, cls, description="sparse_ddp with the training step captured in a CUDA graph")


def problems(trainer: Any, strategy: CapturedSparseDDPStrategy) -> list[tuple[str, str]]:
    """(what, fix) of everything the captured step could not replay as it runs eagerly."""
    module = strategy.lightning_module
    found = optimizer_problems(strategy.optimizers, strategy.lr_scheduler_configs)
    if strategy.world_size > 1:
        found.append((f"{strategy.world_size} processes: the all-to-all sizes each message on the host",
                      "train on one GPU (devices=1)"))  # fmt: skip
    if strategy._pipeline is not None:
        found.append(("pipeline=: the next batch's ids would be sent ahead by Python that a replay skips",
                      "leave pipeline unset (it pays on several ranks, which a captured step does not run on)"))  # fmt: skip
    if not module.automatic_optimization:
        found.append(("manual optimization: the Trainer hands the strategy no whole step to capture",
                      "capture your own step as docs/guide/gpu.md shows"))  # fmt: skip
    if trainer.accumulate_grad_batches != 1:
        found.append((f"accumulate_grad_batches={trainer.accumulate_grad_batches}: the loop calls the step's parts apart",
                      "a batch that many times larger, or accumulate_grad_batches=1"))  # fmt: skip
    plugin = strategy.precision_plugin
    if getattr(plugin, "scaler", None) is not None:
        found.append((f"precision={plugin.precision!r}: GradScaler decides on the host whether to step",
                      "precision='bf16-mixed' or '32-true'"))  # fmt: skip
    elif type(plugin) not in CAPTURABLE_PRECISION:
        found.append((f"the precision plugin {type(plugin).__name__}", "precision='bf16-mixed' or '32-true'"))
    if type(module).optimizer_step is not LightningModule.optimizer_step:
        found.append((f"{type(module).__name__}.optimizer_step is overridden: its Python would run at the capture only",
                      "leave optimizer_step as Lightning's"))  # fmt: skip
    for callback in trainer.callbacks:
        hooks = [h for h in INSIDE_THE_STEP if getattr(type(callback), h) is not getattr(Callback, h)]
        if hooks:
            found.append((f"the callback {type(callback).__name__} overrides {', '.join(hooks)}, which run inside the step: "
                          f"at the capture only", f"remove {type(callback).__name__}"))  # fmt: skip
    for unit in strategy.lookup_units:
        if isinstance(unit, SparseEmbeddingCollection):
            found.extend(collection_problems(unit))
    return found


def _recorded(fx: str, name: str, value: Any, args: tuple, kwargs: dict) -> tuple:
    if not isinstance(value, (Tensor, int, float, bool)):
        raise CaptureRefused(f"{NAME}: self.log({name!r}, <{type(value).__name__}>) in {fx}: its update would run at the "
                             f"capture only. HINT: log a tensor (e.g. the metric's functional form), or update the "
                             f"metric in on_train_batch_end.")  # fmt: skip
    return fx, name, value.detach() if isinstance(value, Tensor) else value, args, kwargs


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


CapturedSparseDDPStrategy.register_strategies(StrategyRegistry)
