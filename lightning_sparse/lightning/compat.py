"""Every reach into Lightning's (and GradScaler's) private API, in one place, patches included.

The strategies need a few things Lightning and torch do not export, and four places where
Lightning offers no hook: a skipped evaluation loop (:func:`after_skipped_run` wraps its ``run``),
the weights a spawned rank 0 hands back (:class:`SparseMultiProcessingLauncher`), the
``self.log`` calls of a captured training step (:func:`logs_recorded`), and the training batch
after the one in hand (:func:`next_training_batch`, for a pipelined lookup). Each is
named here once, with what it is for; ``tests/test_compat.py`` checks each assumption (one test
per shim), so an upgrade that breaks one fails there, by name, instead of deep inside a fit, and
names the versions below. ``tests/test_layout.py`` fails on a patch anywhere else. Checked
against lightning 2.6.6 (and 2.6.0) and torch 2.13.0.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.fabric.wrappers import _FabricModule
from lightning.pytorch.core.optimizer import (
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
    _configure_schedulers_manual_opt,
    _MockOptimizer,
    _validate_scheduler_api,
)
from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.strategies import Strategy as TrainerStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse.tables import full_state_dict

LIGHTNING_CHECKED = "2.6.6"  # the Lightning version every shim here was checked against (test_compat's failures name it)

# Type names (used in annotations and isinstance checks).
PATH = _PATH  # str | Path, what Lightning accepts as a checkpoint path
Stateful = _Stateful  # runtime-checkable: has state_dict() and load_state_dict()
StrategyRegistry = _StrategyRegistry  # the registry ``register_strategies`` receives
DDPBackwardSyncControl = _DDPBackwardSyncControl  # Fabric DDP's no_backward_sync, subclassed for modules of tables only
MockOptimizer = _MockOptimizer  # Lightning's stand-in when configure_optimizers returns None

# Lightning's parsing of what configure_optimizers returns, reused for configure_sparse_optimizers
# so that both hooks accept the same shapes (an optimizer, lists, dicts with "lr_scheduler").
configure_optimizers = _configure_optimizers
configure_schedulers_automatic_opt = _configure_schedulers_automatic_opt
configure_schedulers_manual_opt = _configure_schedulers_manual_opt
validate_scheduler_api = _validate_scheduler_api


def evaluation_loop(trainer: Any) -> Any:
    """The loop running validation or test now (``trainer._evaluation_loop``)."""
    return trainer._evaluation_loop


def after_skipped_run(loop: Any, serve: Callable[[], None]) -> None:
    """Call ``serve()`` after each ``loop.run()`` that this rank skipped for want of batches (``loop.skip``).

    Lightning has no hook for a skipped evaluation or prediction loop: its ``run`` returns before
    calling any when ``skip`` is true. So the loop object's ``run`` is wrapped (that loop only, once;
    a second call changes nothing).
    """
    if getattr(loop, "_serves_lookups_when_skipped", False):
        return
    run = loop.run

    def run_then_serve(*args: Any, **kwargs: Any) -> Any:
        output = run(*args, **kwargs)
        if loop.skip:
            serve()
        return output

    loop.run = run_then_serve
    loop._serves_lookups_when_skipped = True


class SparseMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for ``start_method="spawn" | "fork" | "forkserver"``, handing full tables back.

    The ranks run in child processes; rank 0 writes ``module.state_dict()`` to a file that the main
    process loads into its own (unsharded) module. That state dict holds only rank 0's shard of each
    table; after Lightning wrote it (``_collect_rank_zero_results``, no public hook), rank 0 writes the
    full tables over it (:func:`~lightning_sparse.full_state_dict`, a collective every
    rank runs), which load on one process.
    """

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        full = full_state_dict(trainer.lightning_module)  # collective: every rank gathers the tables
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:  # rank 0, fitting
            self._strategy.checkpoint_io.save_checkpoint(full, output.weights_path)
        return output


def take_launched_processes(launcher: Any) -> list[Any]:
    """The rank processes this process launched (``launcher.procs``; none for other launchers), taken off that list.

    Lightning's child-process observer polls this very list (``_launch_process_observer(self.procs)``)
    every 5 s and answers a child's non-zero exit by SIGKILLing this process too: a rank taken off it
    can be killed without taking this process with it.
    """
    procs = getattr(launcher, "procs", None)
    if not procs:
        return []
    taken = list(procs)
    procs.clear()
    return taken


def fabric_strategy(module: Any) -> Any | None:
    """The strategy of a module Fabric set up (``_FabricModule._strategy``), ``None`` for any other object."""
    return module._strategy if isinstance(module, _FabricModule) else None


def after_closure(plugin: Any, model: Any, optimizer: Optimizer) -> None:
    """Lightning's precision hooks after the training-step closure (``Precision._after_closure``)."""
    plugin._after_closure(model, optimizer)


def running_strategy() -> tuple[str, Any] | None:
    """The Lightning strategy the current call runs under: ``("Trainer", strategy)`` inside a method of a
    Trainer strategy, ``("Fabric", strategy)`` inside a module Fabric set up, ``None`` in plain PyTorch.
    """
    for owner in caller_objects(1):
        if isinstance(owner, TrainerStrategy):
            return "Trainer", owner
        strategy = fabric_strategy(owner)
        if strategy is not None:
            return "Fabric", strategy
    return None


def caller_objects(depth: int) -> Any:
    """The ``self`` of each frame on the call stack, from ``depth`` frames up (to find the running strategy)."""
    frame = sys._getframe(depth + 1)
    while frame is not None:
        yield frame.f_locals.get("self")
        frame = frame.f_back


# GradScaler: the sparse gradients join the dense skip decision (lightning_sparse.lightning.precision).
def loss_scale(scaler: torch.amp.GradScaler) -> Tensor:
    """The current loss scale, a device tensor (``GradScaler._scale``; no host read)."""
    return scaler._scale


def found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> dict[torch.device, Tensor]:
    """The overflow flags ``unscale_(optimizer)`` recorded, which ``step(optimizer)`` reads."""
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def update_scale(scaler: torch.amp.GradScaler, found_inf: Tensor) -> None:
    """Grow or back off the loss scale as ``GradScaler.update`` would, for a step with no dense gradient."""
    torch._amp_update_scale_(
        scaler._scale,
        scaler._growth_tracker,
        found_inf.to(scaler._scale.device),
        scaler._growth_factor,
        scaler._backoff_factor,
        scaler._growth_interval,
    )


# The Trainer's captured step (lightning_sparse.lightning.captured_step): what a replay does not run, done by hand.
@contextmanager
def logs_recorded(module: Any, record: Callable[..., None]) -> Iterator[None]:
    """Route the module's ``self.log`` (and ``log_dict``, which calls it) to ``record(fx, name, value, args, kwargs)``.

    ``fx``: the hook that logged (``module._current_fx_name``). Patch: an instance attribute shadows
    the module's ``log`` meanwhile (Lightning has no hook for the log calls of a step).
    """

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        record(module._current_fx_name, name, value, args, kwargs)

    module.log = log
    try:
        yield
    finally:
        del module.log


@contextmanager
def logging_as(module: Any, fx: str) -> Iterator[None]:
    """``self.log`` calls made meanwhile count as made by the hook ``fx`` (``module._current_fx_name``)."""
    previous, module._current_fx_name = module._current_fx_name, fx
    try:
        yield
    finally:
        module._current_fx_name = previous


def closure_result(closure: Any) -> ClosureResult | None:
    """What the training-step closure's last call returned (``Closure._result``), without consuming it."""
    return closure._result


def set_closure_result(closure: Any, loss: Tensor | None, extra: dict[str, Any]) -> None:
    """Make the loop's ``closure.consume_result()`` return ``loss`` (cloned, as Lightning does) and ``extra``."""
    closure._result = ClosureResult(loss, extra=extra)


def count_zero_grad(trainer: Any) -> None:
    """Count one ``zero_grad`` in the loop's progress, as ``_AutomaticOptimization._on_before_zero_grad`` and
    ``_optimizer_zero_grad`` do (their counters go into checkpoints)."""
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad
    progress.increment_ready()
    progress.increment_started()
    progress.increment_completed()


def next_training_batch(trainer: Any) -> Any | None:
    """The fit loop's next training batch as its loader gave it, or ``None`` (the last batch, or not in training).

    The fit loop's ``_PrefetchDataFetcher`` holds one batch ahead only for loaders without a length;
    for others this fetches it now and leaves ``fetched`` and ``done`` as they were, so ``is_last_batch``
    stays right: the fetcher then keeps that batch ahead itself (its ``batches``). A ``training_step``
    that takes a ``dataloader_iter`` gets ``None``.
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if not trainer.training or type(fetcher) is not _PrefetchDataFetcher:
        return None
    if not fetcher.batches and not fetcher.done:
        fetched, done = fetcher.fetched, fetcher.done
        try:
            fetcher.batches.append(_DataFetcher.__next__(fetcher))
        except StopIteration:
            pass  # an iterable shorter than its length: the fetcher finds out at its next batch
        fetcher.fetched, fetcher.done = fetched, done
    return fetcher.batches[0][0] if fetcher.batches else None  # the fetcher holds (batch, batch_idx, dataloader_idx)
