"""One test per shim of lightning_sparse/lightning/compat.py and torch_compat.py: what each private reach assumes still holds.

A failing test names the versions the shims were checked against and the ones installed (``@checked``).
"""

from __future__ import annotations

import functools
import inspect

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_sparse.lightning import compat
from lightning_sparse.lookup import torch_compat

CHECKED = (
    f"The shims were checked against lightning {compat.LIGHTNING_CHECKED} (installed: {lightning.__version__}) and torch "
    f"{torch_compat.TORCH_CHECKED} (installed: {torch.__version__}). HINT: if the installed versions differ, the shim "
    f"named above needs a look at what that version changed."
)


def checked(test):
    """The test, with a note on any failure naming the versions each compat module was checked against and the installed ones."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except Exception as err:
            err.add_note(CHECKED)
            raise

    return run


def test_a_failing_shim_test_names_the_checked_versions():
    @checked
    def failing():
        raise AssertionError("a shim broke")

    with pytest.raises(AssertionError) as caught:
        failing()
    assert caught.value.__notes__ == [CHECKED] and compat.LIGHTNING_CHECKED in CHECKED and torch_compat.TORCH_CHECKED in CHECKED


@checked
def test_configure_optimizers_parses_what_the_hook_returns():
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    optimizers, schedulers, monitor = compat.configure_optimizers({"optimizer": optimizer, "lr_scheduler": scheduler})
    assert optimizers == [optimizer] and monitor is None
    configs = compat.configure_schedulers_automatic_opt(schedulers, monitor)
    assert configs[0].scheduler is scheduler and configs[0].interval == "epoch"
    assert compat.configure_schedulers_manual_opt(schedulers)[0].scheduler is scheduler
    assert list(inspect.signature(compat.validate_scheduler_api).parameters) == ["lr_scheduler_configs", "model"]


@checked
def test_type_names_are_what_the_strategies_take_them_for():
    assert issubclass(compat.MockOptimizer, torch.optim.Optimizer)
    assert isinstance(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), compat.Stateful)
    assert hasattr(compat.StrategyRegistry, "register")
    assert list(inspect.signature(compat.DDPBackwardSyncControl.no_backward_sync).parameters) == ["self", "module", "enabled"]


@checked
def test_multiprocessing_launcher_hands_the_weights_rank_zero_writes_to_the_main_process():
    from lightning.pytorch.strategies.launchers import multiprocessing

    hook = multiprocessing._MultiProcessingLauncher._collect_rank_zero_results
    assert issubclass(compat.SparseMultiProcessingLauncher, multiprocessing._MultiProcessingLauncher)
    assert list(inspect.signature(hook).parameters) == ["self", "trainer", "results"]
    # Rank 0 writes the weights with the strategy's checkpoint_io to the path its output names (SparseMultiProcessingLauncher
    # writes the full tables there after it), and the main process loads that file.
    assert "self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)" in inspect.getsource(hook)
    assert "weights_path" in multiprocessing._WorkerOutput._fields
    recover = inspect.getsource(multiprocessing._MultiProcessingLauncher._recover_results_in_main_process)
    assert "checkpoint_io.load_checkpoint(worker_output.weights_path)" in recover


@checked
def test_evaluation_loop_and_the_loops_attributes_the_strategy_reads():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    trainer.state.fn = TrainerFn.TESTING
    assert compat.evaluation_loop(trainer) is trainer.test_loop
    trainer.state.fn = TrainerFn.VALIDATING
    assert compat.evaluation_loop(trainer) is trainer.validate_loop
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        assert callable(loop.run) and hasattr(loop, "skip")  # compat.after_skipped_run wraps run, reads skip
        # Lightning calls no hook when it skips the loop: run returns first (so after_skipped_run wraps it).
        module = inspect.getsource(inspect.getmodule(type(loop)))  # run is wrapped (no grad): read it in its module
        run = module[module.index("    def run(self)") :]
        assert run.index("if self.skip:") < run.index("self.on_run_start()")
    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
        assert hasattr(loop.batch_progress, "is_last_batch")  # read after each step (serve_after_last_batch)
    # The prediction loop sets it on its progress while it runs.
    assert "self.batch_progress.is_last_batch = " in inspect.getsource(inspect.getmodule(type(trainer.predict_loop)))


@checked
def test_after_skipped_run_serves_after_skipped_runs_only_and_wraps_once():
    class Loop:
        skip = True

        def run(self, value):
            return [value]

    loop, served = Loop(), []
    compat.after_skipped_run(loop, lambda: served.append("first"))
    compat.after_skipped_run(loop, lambda: served.append("second"))  # a second setup: nothing changes
    assert loop.run(1) == [1] and served == ["first"]
    loop.skip = False
    assert loop.run(2) == [2] and served == ["first"]


@checked
def test_take_launched_processes_empties_the_list_lightnings_observer_polls():
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    assert "_launch_process_observer(self.procs)" in inspect.getsource(_SubprocessScriptLauncher.launch)

    class Launcher:
        def __init__(self):
            self.procs = ["rank 1", "rank 2"]  # Popen objects in a run

    launcher = Launcher()
    observed = launcher.procs  # the list the observer holds
    assert compat.take_launched_processes(launcher) == ["rank 1", "rank 2"] and observed == [] and launcher.procs is observed
    assert compat.take_launched_processes(launcher) == [] and compat.take_launched_processes(object()) == []


@checked
def test_fabric_strategy_of_a_set_up_module():
    from lightning.fabric.wrappers import _FabricModule

    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    wrapped = _FabricModule(nn.Linear(1, 1), strategy)
    assert compat.fabric_strategy(wrapped) is strategy
    assert compat.fabric_strategy(nn.Linear(1, 1)) is None


@checked
def test_after_closure_is_a_precision_hook():
    assert list(inspect.signature(Precision._after_closure).parameters) == ["self", "model", "optimizer"]
    calls = []

    class Recording(Precision):
        def _after_closure(self, model, optimizer):
            calls.append((model, optimizer))

    compat.after_closure(Recording(), "model", "optimizer")
    assert calls == [("model", "optimizer")]


@checked
def test_caller_objects_walk_the_stack():
    class Outer:
        def call(self):
            return list(compat.caller_objects(0))

    outer = Outer()
    assert outer in outer.call()


@pytest.mark.filterwarnings("ignore::UserWarning")
@checked
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


@checked
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


@checked
def test_the_captured_steps_shims_record_logs_set_the_hook_the_closure_result_and_count_zero_grad():
    """logs_recorded shadows LightningModule.log (log_dict goes through it), logging_as sets the hook's name,
    the closure's result is read and set where the loop consumes it, zero_grad is counted where the loop counts it."""
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult

    module, calls = pl.LightningModule(), []
    module._current_fx_name = "training_step"
    with compat.logs_recorded(module, lambda *call: calls.append(call)):
        module.log_dict({"a": 1.0, "b": torch.tensor(2.0)}, prog_bar=True)
    assert [(fx, name, args, kwargs["prog_bar"]) for fx, name, _, args, kwargs in calls] == [
        ("training_step", "a", (), True), ("training_step", "b", (), True)]  # fmt: skip
    assert "log" not in vars(module) and type(module).log is pl.LightningModule.log
    with compat.logging_as(module, "on_train_batch_end"):
        assert module._current_fx_name == "on_train_batch_end"
    assert module._current_fx_name == "training_step"
    closure = Closure(step_fn=lambda: ClosureResult(torch.tensor(3.0, requires_grad=True)))
    closure()
    assert float(compat.closure_result(closure).loss) == 3.0
    loss = torch.tensor(4.0)
    compat.set_closure_result(closure, loss, {"extra": 1})
    result = closure.consume_result()
    assert float(result.loss) == 4.0 and result.loss is not loss and result.extra == {"extra": 1}
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress
    compat.count_zero_grad(trainer)
    assert progress.optimizer.zero_grad.total.completed == progress.optimizer.zero_grad.total.ready == 1


@checked
@pytest.mark.parametrize("length", [1, 2, 4])
def test_next_training_batch_peeks_the_fit_loops_fetcher_and_leaves_is_last_batch_right(length):
    from types import SimpleNamespace

    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    def run(peek: bool) -> list[tuple[int, bool, int | None]]:
        fetcher = _PrefetchDataFetcher()
        fetcher.setup(CombinedLoader(torch.utils.data.DataLoader(list(range(length)), batch_size=1)))
        iter(fetcher)
        trainer = SimpleNamespace(training=True, fit_loop=SimpleNamespace(_data_fetcher=fetcher))
        seen = []
        while not fetcher.done:  # the training epoch loop: next batch, is_last_batch, then the strategy's batch_to_device
            batch, _, _ = next(fetcher)
            done = fetcher.done
            following = compat.next_training_batch(trainer) if peek else None
            seen.append((int(batch), done, None if following is None else int(following)))
        return seen

    peeked = run(True)
    assert [(b, done) for b, done, _ in peeked] == [(b, done) for b, done, _ in run(False)]
    assert [following for _, _, following in peeked] == [*range(1, length), None]


@checked
def test_version_counts_in_place_changes_only():
    ids = torch.tensor([1, 2])
    start = torch_compat.version(ids)
    ids.clone().add_(1), ids.to(torch.int64), ids[:1]
    assert torch_compat.version(ids) == start
    ids.clamp_(max=5)
    assert torch_compat.version(ids) > start
