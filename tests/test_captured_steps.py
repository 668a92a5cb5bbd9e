"""Captured steps: Trainer(strategy="sparse_ddp_captured") and Fabric's captured step functions, against the eager ones.

On CPU the Lightning side runs with a test double of the graph maker (tests/graph_double.py: a
capture keeps the step, a replay calls it again): what is captured, the static batch, the eager
step or the drop of a last batch of another shape, the checks before a capture, the log calls
made again after each replay. Where CUDA is present, the same fits run with real CUDA graphs.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import lightning_models as lm
import pytest
import torch
from graph_double import CallAgainGraphs
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

import lightning_sparse as ls
from lightning_sparse.lightning.capture import CaptureRefused

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Recorded(Logger):
    """Every metric a logger is given, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    name, version = "recorded", 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.metrics.append((step, {k: float(v) for k, v in metrics.items() if k != "epoch"}))


class Seen(pl.Callback):
    """Per batch: the progress bar's metrics, the loss of ``outputs`` and its extra output, kept as the callback got it."""

    def __init__(self) -> None:
        self.bar, self.losses, self.extras = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.bar.append(dict(trainer.progress_bar_metrics))
        self.losses.append(None if not outputs else float(outputs["loss"]))
        self.extras.append(None if not outputs else outputs["mean_prediction"])  # the tensor: a later step must not change it


class Logged(lm.TwoTower):
    """TwoTower logging a tensor to the progress bar and a number, and returning an extra output."""

    def __init__(self, problem: str = "", tensor_lr: bool = False, momentum: float = 0.0, **kwargs) -> None:
        kwargs.setdefault("sparse_kwargs", {"lr": 0.2, "capturable": True})
        super().__init__(batch_size=5, **kwargs)
        self.problem, self.tensor_lr, self.momentum = problem, tensor_lr, momentum

    def configure_optimizers(self):
        if self.momentum:
            return torch.optim.SGD(self.mlp.parameters(), lr=self.dense_lr, momentum=self.momentum)
        return super().configure_optimizers()

    def configure_sparse_optimizers(self):
        if self.tensor_lr:  # a scheduler fills it (a new tensor per module: fills must not reach another fit)
            self.sparse_kwargs = {**self.sparse_kwargs, "lr": torch.tensor(float(self.sparse_kwargs["lr"]), device=self.device)}
        return super().configure_sparse_optimizers()

    def training_step(self, batch, batch_idx):
        users, items, target = batch
        if self.problem == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                prediction = self(users, items).float()
        else:
            prediction = self(users, items).float()
        loss = torch.nn.functional.mse_loss(prediction, target)
        if self.problem == "host read" and loss.item() > 1e9:
            return None
        if self.problem == "no loss":
            return None
        self.log("loss", loss, prog_bar=True)
        self.log("constant", 3.0)
        return {"loss": loss, "mean_prediction": prediction.detach().mean()}


class AfterBackward(pl.Callback):
    def on_after_backward(self, trainer, pl_module) -> None:
        pass


def _fit(captured: dict | None, module_kwargs: dict = {}, trainer_kwargs: dict = {}, loader=None, device="cpu"):  # noqa: B006
    lm.lightning_env(0, 1)
    module, logger, seen = Logged(**module_kwargs), Recorded(), Seen()
    strategy = ls.CapturedSparseDDPStrategy(**captured) if captured is not None else "sparse_ddp"
    trainer = lm.trainer(1, strategy=strategy, logger=logger, log_every_n_steps=1, callbacks=[seen, *trainer_kwargs.pop("callbacks", [])],
                         accelerator=device, **trainer_kwargs)  # fmt: skip
    trainer.fit(module, loader)
    counts = dict(strategy.captures) if captured is not None else None
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.state_dict()
    return lm.state(module), logger.metrics, seen, counts, progress, trainer.global_step


def _compare(
    rank_pools,
    captured: dict,
    eager_trainer: dict,
    trainer_kwargs: dict = {},  # noqa: B006
    module_kwargs: dict = {},  # noqa: B006
) -> tuple:
    graphs = CallAgainGraphs()
    [(state, metrics, seen, counts, progress, steps)] = rank_pools(1).run(
        _fit, {**captured, "graphs": graphs}, module_kwargs, trainer_kwargs
    )
    [(twin, twin_metrics, twin_seen, _, twin_progress, twin_steps)] = rank_pools(1).run(
        _fit, None, module_kwargs, {**trainer_kwargs, **eager_trainer}
    )
    for key, value in twin.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    return metrics, seen, counts, progress, steps, twin_metrics, twin_seen, twin_progress, twin_steps


def test_a_captured_fit_trains_logs_and_counts_as_the_eager_fit(rank_pools):
    """10 batches an epoch (the last of 3 runs eagerly), 2 epochs: 2 warm-ups, a capture and 7 replays each."""
    metrics, seen, counts, progress, steps, *twin = _compare(rank_pools, {}, {}, dict(max_epochs=2))
    twin_metrics, twin_seen, twin_progress, twin_steps = twin
    assert counts == {"warm-up": 4, "captured": 2, "replayed": 14, "eager": 2, "dropped": 0}
    assert metrics == twin_metrics and len(metrics) == 20  # each step's loss and constant reach the logger
    assert seen.bar == twin_seen.bar and seen.losses == twin_seen.losses and all("loss" in bar for bar in seen.bar)
    # each step's extra output stays its own after later replays (the static output is copied for the loop)
    assert [float(t) for t in seen.extras] == [float(t) for t in twin_seen.extras], (seen.extras, twin_seen.extras)
    assert progress == twin_progress and steps == twin_steps == 20


def test_the_last_batch_of_another_shape_is_dropped_when_asked(rank_pools):
    """Dropped as a step whose training_step returns None: it trains nothing, and the loop counts it."""
    metrics, seen, counts, _, steps, twin_metrics, _, _, twin_steps = _compare(
        rank_pools, {"other_shapes": "drop"}, {"limit_train_batches": 9}, dict(max_epochs=1)
    )
    assert counts == {"warm-up": 2, "captured": 1, "replayed": 7, "eager": 0, "dropped": 1}
    # (Lightning logs the last values again at a step that logged nothing, as for any skipped step)
    assert seen.losses[-1] is None and metrics[:9] == twin_metrics and steps == twin_steps + 1 == 10


def _refusal(captured: dict, module_kwargs: dict, trainer_kwargs: dict, loader=None) -> tuple[str, int]:
    graphs = CallAgainGraphs()
    try:
        _fit({**captured, "graphs": graphs}, module_kwargs, trainer_kwargs, loader)
    except CaptureRefused as err:
        return str(err), len(graphs.captured)
    raise AssertionError("no CaptureRefused")


def _nothing_ahead(batch) -> dict:
    """A pipeline's ``inputs`` (the refusal comes before any batch)."""
    return {}


def test_what_cannot_be_replayed_is_refused_by_name_before_any_capture(rank_pools):
    many = dict(dense="Adagrad", scheduler=True, sparse_kwargs={"lr": 0.2})
    message, captures = rank_pools(1).run(
        _refusal, {"pipeline": _nothing_ahead}, many, dict(accumulate_grad_batches=2, callbacks=[AfterBackward()])
    )[0]
    for expected in ("- Adagrad has no capturable step", "- SparseAdagrad(capturable=False)", "- StepLR schedules SparseAdagrad",
                     "- accumulate_grad_batches=2", "- the callback AfterBackward overrides on_after_backward",
                     "- pipeline=: the next batch's ids"):  # fmt: skip
        assert expected in message, message
    assert message.rstrip().split("\n")[-1].startswith("HINT: ") and captures == 0
    message, captures = rank_pools(1).run(_refusal, {}, dict(problem="host read"), {})[0]
    assert "reads a tensor on the host (item) at " in message and "test_captured_steps.py" in message and "loss.item()" in message
    assert "HINT: keep the value on the device" in message and captures == 0
    message, captures = rank_pools(1).run(_refusal, {}, dict(problem="autocast"), {})[0]
    assert (
        "under torch.autocast with cache_enabled=True at " in message
        and "HINT: torch.autocast(..., cache_enabled=False)" in message
    )
    message, captures = rank_pools(1).run(_refusal, {}, dict(problem="no loss"), {})[0]  # a graph cannot skip a step
    assert "training_step returned no loss" in message and "HINT: return the loss in every step" in message, message
    assert captures == 0


class OwnOptimizerStep(Logged):
    """Overrides LightningModule.optimizer_step (changing nothing): its Python would run at the capture only."""

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)


def _refused_on_two_ranks() -> str:
    lm.lightning_env(torch.distributed.get_rank(), 2)
    trainer = lm.trainer(2, strategy=ls.CapturedSparseDDPStrategy(graphs=CallAgainGraphs()), max_steps=1)
    try:
        trainer.fit(OwnOptimizerStep())
    except CaptureRefused as err:
        return str(err)
    raise AssertionError("no CaptureRefused")


def test_two_processes_and_an_overridden_optimizer_step_are_refused_by_name(rank_pools):
    """Each rank names both, before any capture: the all-to-all of two ranks sizes its messages on the host, and a
    module's own optimizer_step would run its Python at the capture only."""
    for message in rank_pools(2).run(_refused_on_two_ranks):
        assert "- 2 processes: the all-to-all sizes each message on the host" in message, message
        assert "- OwnOptimizerStep.optimizer_step is overridden" in message, message
        assert "HINT: train on one GPU (devices=1); leave optimizer_step as Lightning's." in message, message


def test_a_batch_of_another_shape_in_the_middle_of_an_epoch_is_refused_by_name(rank_pools):
    data = lm.dataset()
    batches = [[t[i : i + size] for t in data.tensors] for i, size in ((0, 5), (5, 5), (10, 5), (15, 4), (19, 5))]
    message, captures = rank_pools(1).run(_refusal, {}, {}, {}, DataLoader(batches, batch_size=None))[0]
    assert "batch[0] has shape [4] torch.int64 where the captured step took shape [5] torch.int64" in message, message
    assert "in the middle of an epoch" in message and captures == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where there is no CUDA")
def test_without_cuda_the_captured_strategy_refuses_with_a_hint(rank_pools):
    with pytest.raises(AssertionError, match=r"no CUDA device\. HINT: run on one GPU"):
        rank_pools(1).run(_fit, {}, {}, dict(max_steps=1))


def _losses(metrics: list[tuple[int, dict]]) -> list[tuple[int, float]]:
    return [(step, values["loss"]) for step, values in metrics if "loss" in values]


def _fit_resume(captured: dict | None, device: str, epochs: int, at: int, path: str, module_kwargs: dict) -> tuple:
    """A fit of ``epochs`` epochs; with ``at``, stopped after that many (a checkpoint) and resumed by a new Trainer and module."""
    if not at:
        state, metrics, *_ = _fit(captured, module_kwargs, dict(max_epochs=epochs, limit_val_batches=2), device=device)
        return state, _losses(metrics), None
    lm.lightning_env(0, 1)
    first, logger = Logged(**module_kwargs), Recorded()
    strategy = ls.CapturedSparseDDPStrategy(**captured) if captured is not None else "sparse_ddp"
    trainer = lm.trainer(1, strategy=strategy, logger=logger, log_every_n_steps=1, max_epochs=at,
                         accelerator=device, limit_val_batches=2)  # fmt: skip
    trainer.fit(first)
    trainer.save_checkpoint(path)
    resumed, second = Logged(**module_kwargs), Recorded()
    strategy = ls.CapturedSparseDDPStrategy(**captured) if captured is not None else "sparse_ddp"
    trainer = lm.trainer(1, strategy=strategy, logger=second, log_every_n_steps=1, max_epochs=epochs,
                         accelerator=device, limit_val_batches=2)  # fmt: skip
    trainer.fit(resumed, ckpt_path=path)
    counts = dict(strategy.captures) if captured is not None else None
    return lm.state(resumed), _losses(logger.metrics) + _losses(second.metrics), counts


def test_a_captured_fit_stopped_and_resumed_from_its_checkpoint_equals_the_eager_fit(rank_pools, tmp_path):
    """2 epochs of 10 steps (validation after each), a checkpoint after the first: bitwise the eager fit, the same losses."""
    module = dict(scheduler=True, tensor_lr=True)  # the scheduler fills a tensor lr
    [(state, losses, counts)] = rank_pools(1).run(
        _fit_resume, {"graphs": CallAgainGraphs()}, "cpu", 2, 1, str(tmp_path / "c"), module
    )
    [(twin, twin_losses, _)] = rank_pools(1).run(_fit_resume, None, "cpu", 2, 0, "", module)
    for key, value in twin.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert losses == twin_losses and len(losses) == 20
    assert counts == {"warm-up": 2, "captured": 1, "replayed": 7, "eager": 1, "dropped": 0}  # the resumed fit's


@CUDA
def test_fifty_captured_steps_with_a_checkpoint_and_a_resume_are_bitwise_the_eager_steps_cuda(rank_pools, tmp_path):
    """On a GPU, real CUDA graphs: 50 steps (10 an epoch, the last batch of each eager, validation after each epoch),
    stopped after 20 and resumed from the checkpoint; the tables, the MLP and every logged loss equal the eager fit's."""
    module = dict(sparse_kwargs={"lr": 0.2, "capturable": True})
    [(state, losses, counts)] = rank_pools(1, "cuda").run(_fit_resume, {}, "gpu", 5, 2, str(tmp_path / "c"), module)
    [(twin, twin_losses, _)] = rank_pools(1, "cuda").run(_fit_resume, None, "gpu", 5, 0, "", module)
    for key, value in twin.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert losses == twin_losses and len(losses) == 50
    assert counts["captured"] == 3 and counts["replayed"] == 21  # 3 epochs after the resume: 7 replays each


# ---------------------------------------------------------------- Fabric: a captured step function
def fabric_step(fabric, model, dense_opt, sparse_opt):
    """A plain Fabric training step of a two-tower model on ``(users, items, target)``: the step the tests capture."""

    def step(batch):
        users, items, target = batch
        loss = torch.nn.functional.mse_loss(model(users, items), target)
        fabric.backward(loss)
        dense_opt.step()
        sparse_opt.step()
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        return {"loss": loss.detach()}

    return step


def _fabric_steps(captured: bool, dense: str = "SGD", device: str = "cpu") -> tuple:
    """Steps of a step function under Fabric, captured (the graph double on CPU, CUDA graphs on a GPU) or eager."""
    import lightning as L

    lm.lightning_env(0, 1)
    fabric = L.Fabric(accelerator=device, devices=1, strategy="sparse_ddp")
    fabric.launch()
    module = lm.TwoTower()
    model, dense_opt, sparse_opt = fabric.setup(module, getattr(torch.optim, dense)(module.mlp.parameters(), lr=0.05),
                                                ls.SparseAdagrad([module.users, module.items], lr=0.2, capturable=True))  # fmt: skip

    step = fabric_step(fabric, model, dense_opt, sparse_opt)

    graphs = CallAgainGraphs() if device == "cpu" else None  # None: the strategy's CUDA graphs
    run = fabric.strategy.captured(step, graphs=graphs) if captured else step
    data = lm.dataset(23)
    losses = []
    for start in range(0, 23, 5):  # 4 batches of 5, then 3
        batch = [t[start : start + 5].to(fabric.device) for t in data.tensors]
        out = run(batch, last=start + 5 >= 23) if captured else run(batch)
        losses.append(float(out["loss"]))
    captures = len(graphs.captured) if graphs is not None else run.counts["captured"] if captured else 0
    return lm.state(module), losses, dict(run.counts) if captured else None, captures


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_captured_fabric_step_trains_and_returns_as_the_eager_step(rank_pools, device):
    """On CPU with the graph double; on a GPU with CUDA graphs: bitwise the eager steps, losses equal."""
    [(state, losses, counts, captures)] = rank_pools(1, device).run(_fabric_steps, True, "SGD", device)
    [(twin, twin_losses, _, _)] = rank_pools(1, device).run(_fabric_steps, False, "SGD", device)
    for key, value in twin.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert losses == twin_losses and captures == 1
    assert counts == {"warm-up": 2, "captured": 1, "replayed": 2, "eager": 1, "dropped": 0}


def _fabric_refusal() -> str:
    try:
        _fabric_steps(True, dense="Adagrad")
    except CaptureRefused as err:
        return str(err)
    raise AssertionError("no CaptureRefused")


def test_a_fabric_step_that_cannot_replay_is_refused_by_name(rank_pools):
    message = rank_pools(1).run(_fabric_refusal)[0]
    assert "- Adagrad has no capturable step" in message and message.split("\n")[-1].startswith("HINT: ")


class RoundedCollection(lm.CollectionTower):
    """Its collection holds a bf16 table rounded stochastically (it steps table by table); optimized by hand when ``manual``."""

    def __init__(self, **kwargs) -> None:
        lm.TwoTower.__init__(self, sparse_kwargs={"lr": 0.2}, **kwargs)  # (capturable=True refuses such a table itself)
        users, _ = self._modules.pop("users"), self._modules.pop("items")
        items = ls.SparseEmbedding(lm.ITEMS, lm.DIM, seed=2, dtype=torch.bfloat16)
        self.embeddings = ls.SparseEmbeddingCollection({"users": users, "items": items},
                                                       features={"user": "users", "first": "items", "second": "items"})  # fmt: skip


def _refused_configuration() -> str:
    lm.lightning_env(0, 1)
    trainer = lm.trainer(1, strategy=ls.CapturedSparseDDPStrategy(graphs=CallAgainGraphs()), max_steps=1)
    try:
        trainer.fit(RoundedCollection(manual=True))
    except CaptureRefused as err:
        return str(err)
    raise AssertionError("no CaptureRefused")


def test_manual_optimization_and_a_collection_that_steps_table_by_table_are_refused(rank_pools):
    message = rank_pools(1).run(_refused_configuration)[0]
    assert "- manual optimization" in message and "embeddings.tables.items, rounded stochastically" in message
    assert "stochastic_rounding=False for its half tables" in message
    assert message.split("\n")[-1].startswith("HINT: ")


def test_user_host_reads_names_the_users_line_and_passes_over_the_librarys_own():
    from lightning_sparse.lightning.capture import UserHostReads

    x, masked, repeats = torch.arange(4.0), torch.arange(4.0), torch.tensor([1, 2, 0, 1])
    for step, what in [(lambda: x.sum().item(), r"reads a tensor on the host \(item\)"),
                       (lambda: x.nonzero(), r"sizes an output by values \(nonzero\)"),
                       (lambda: x[x > 1], r"sizes an output by values \(__getitem__ with a boolean mask\)"),
                       (lambda: masked.__setitem__(x > 1, 0.0), r"sizes an output by values \(__setitem__ with a boolean mask\)"),
                       (lambda: x.repeat_interleave(repeats), r"sizes an output by values \(repeat_interleave\)"),
                       (lambda: torch.tensor([1.0], device="cpu"), r"copies host data to the device \(tensor\)")]:  # fmt: skip
        with pytest.raises(CaptureRefused, match=what + r" at .*test_captured_steps\.py:\d+ .*HINT: "):
            with UserHostReads("cpu"):
                step()
    with UserHostReads("cpu"):  # its output sized by the caller: no host read
        repeated = x.repeat_interleave(repeats, output_size=4)
    assert repeated.tolist() == [0.0, 1.0, 1.0, 3.0]
    with pytest.raises(CaptureRefused, match=r"under torch\.autocast with cache_enabled=True"):
        with UserHostReads("cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.linear(x, torch.ones(2, 4, requires_grad=True))
    table = ls.SparseEmbedding(10, 2, seed=0)
    with UserHostReads("cpu"):  # the CPU lookup reads the host in lightning_sparse's code: not the user's
        table(torch.tensor([1, 2]))
    with UserHostReads("cuda"):  # a CPU tensor's values are the host's already
        x.sum().item()


class Reload(pl.Callback):
    """Loads every optimizer's state anew (new tensors) before the 6th batch: what the graph read is gone."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 5:
            import copy

            for optimizer in trainer.optimizers:
                optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


def test_optimizer_state_loaded_anew_is_captured_again(rank_pools):
    """Before batch 5 the state moves: that batch and the next warm up again, the next captures (10 batches, the last eager)."""
    _, _, counts, *_ = _compare(rank_pools, {}, {}, dict(max_epochs=1, callbacks=[Reload()]))
    assert counts == {"warm-up": 4, "captured": 2, "replayed": 5, "eager": 1, "dropped": 0}


class MoveDense(pl.Callback):
    """Before the 6th batch, gives the dense SGD a new float learning rate ("lr"), or loads its state anew ("momentum":
    new momentum buffers, and SGD keeps no step count that would move with them)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 5:
            dense = trainer.optimizers[0]
            if self.what == "lr":
                for group in dense.param_groups:
                    group["lr"] = group["lr"] / 2
            else:
                dense.load_state_dict(copy.deepcopy(dense.state_dict()))


@pytest.mark.parametrize("what", ["lr", "momentum"])
def test_a_new_float_learning_rate_or_new_momentum_buffers_of_the_dense_optimizer_are_captured_again(rank_pools, what):
    """A float the graph baked in, or state tensors it reads that moved while no step count did: as after a load of
    every optimizer's state, batch 5 and the next warm up again and the next captures; bitwise the eager fit."""
    _, _, counts, *_ = _compare(rank_pools, {}, {}, dict(max_epochs=1, callbacks=[MoveDense(what)]), dict(momentum=0.9))
    assert counts == {"warm-up": 4, "captured": 2, "replayed": 5, "eager": 1, "dropped": 0}
