"""One test per shim of lightning_sparse/lightning/compat.py and torch_compat.py: what each private reach assumes still holds."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_sparse.lightning import compat
from lightning_sparse.lookup import torch_compat


def test_configure_optimizers_parses_what_the_hook_returns():
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    optimizers, schedulers, monitor = compat.configure_optimizers({"optimizer": optimizer, "lr_scheduler": scheduler})
    assert optimizers == [optimizer] and monitor is None
    configs = compat.configure_schedulers_automatic_opt(schedulers, monitor)
    assert configs[0].scheduler is scheduler and configs[0].interval == "epoch"
    assert compat.configure_schedulers_manual_opt(schedulers)[0].scheduler is scheduler
    assert list(inspect.signature(compat.validate_scheduler_api).parameters) == ["lr_scheduler_configs", "model"]


def test_type_names_are_what_the_strategies_take_them_for():
    assert issubclass(compat.MockOptimizer, torch.optim.Optimizer)
    assert isinstance(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), compat.Stateful)
    assert hasattr(compat.StrategyRegistry, "register")
    assert list(inspect.signature(compat.DDPBackwardSyncControl.no_backward_sync).parameters) == ["self", "module", "enabled"]


def test_multiprocessing_launcher_collects_rank_zero_results_from_the_trainer():
    hook = compat.MultiProcessingLauncher._collect_rank_zero_results
    assert list(inspect.signature(hook).parameters) == ["self", "trainer", "results"]
    # The launcher reads the module's state_dict() in it; SparseMultiProcessingLauncher hands full tables there.
    assert "state_dict()" in inspect.getsource(hook)


def test_evaluation_loop_and_the_loops_attributes_the_strategy_reads():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    trainer.state.fn = TrainerFn.TESTING
    assert compat.evaluation_loop(trainer) is trainer.test_loop
    trainer.state.fn = TrainerFn.VALIDATING
    assert compat.evaluation_loop(trainer) is trainer.validate_loop
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        assert callable(loop.run) and hasattr(loop, "skip")  # strategy._serve_when_skipped wraps run, reads skip
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
        assert hasattr(loop.batch_progress, "is_last_batch")  # read after each step (_serve_after_last_batch)
    # The prediction loop sets it on its progress while it runs.
    assert "self.batch_progress.is_last_batch = " in inspect.getsource(inspect.getmodule(type(trainer.predict_loop)))


def test_fabric_strategy_of_a_set_up_module():
    from lightning.fabric.wrappers import _FabricModule

    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    wrapped = _FabricModule(nn.Linear(1, 1), strategy)
    assert compat.fabric_strategy(wrapped) is strategy
    assert compat.fabric_strategy(nn.Linear(1, 1)) is None


def test_after_closure_is_a_precision_hook():
    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    calls = []

    class Recording(Precision):
        def _after_closure(self, model, optimizer):
            calls.append((model, optimizer))

    compat.after_closure(Recording(), "model", "optimizer")
    assert calls == [("model", "optimizer")]


def test_caller_objects_walk_the_stack():
    class Outer:
        def call(self):
            return list(compat.caller_objects(0))

    outer = Outer()
    assert outer in outer.call()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_grad_scaler_internals_the_sparse_skip_decision_uses():
    parameter = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    scaler.scale(parameter.sum()).backward()
    scaler.unscale_(optimizer)
    flags = compat.found_inf_per_device(scaler, optimizer)
    assert all(flag.item() == 0 for flag in flags.values())
    assert compat.loss_scale(scaler).item() == 8.0
    compat.update_scale(scaler, torch.ones(1))  # an overflow: back off
    assert compat.loss_scale(scaler).item() == 4.0
    compat.update_scale(scaler, torch.zeros(1))  # growth_interval=1: grow
    assert compat.loss_scale(scaler).item() == 8.0


@torch.library.custom_op("lightning_sparse_test::doubled_with_graph", mutates_args=())
def _doubled_with_graph(x: torch.Tensor) -> torch.Tensor:
    """Inside an op's implementation: does autograd record, without and with the shim? ``[without, with]``."""
    leaf = x.detach().requires_grad_()
    recorded = [(leaf * 2).view(-1).grad_fn is not None]
    with torch_compat.autograd_in_custom_op():
        out = (leaf * 2).view(-1)
        out.sum().backward()
        recorded.append(out.grad_fn is not None and bool((leaf.grad == 2).all()))
    return torch.tensor(recorded)


def test_autograd_records_inside_a_custom_op_only_with_the_shim():
    """compiled.py runs the eager lookup and its backward inside custom ops: torch excludes autograd there."""
    without, with_shim = torch.ops.lightning_sparse_test.doubled_with_graph(torch.ones(3, requires_grad=True)).tolist()
    assert with_shim and not without


def test_a_handle_holds_its_value_exactly_as_long_as_a_graph_saves_it():
    """torch keeps a saved tensor's Python object, attributes included, while the graph holds it (torch_compat)."""
    import gc
    import weakref

    from lightning_sparse.lookup import torch_compat

    class Value:
        pass

    seen = []

    class Saves(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, handle):
            ctx.save_for_backward(handle)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(torch_compat.held_by(ctx.saved_tensors[0]))
            return grad * 2, None

    value = Value()
    alive = weakref.ref(value)
    out = Saves.apply(torch.ones(1, requires_grad=True), torch_compat.handle_holding(value))
    del value
    gc.collect()
    assert alive() is not None, "the graph holds the handle, and the handle its value"
    out.sum().backward()
    assert seen == [alive()]
    seen.clear()
    del out
    gc.collect()
    assert alive() is None, "the value dies with the graph"
    assert torch_compat.held_by(torch.zeros(())) is None
