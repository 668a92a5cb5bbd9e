"""Trainer(strategy="sparse_ddp") on 2 and 3 CPU processes against a single-process plain-torch reference."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from datetime import timedelta

import lightning.pytorch as pl
import lightning_models as lm
import pytest
import torch
from rank_pool import COLLECTIVE_TIMEOUT_S, RankError
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_sparse as ls

TIMEOUT = timedelta(seconds=COLLECTIVE_TIMEOUT_S)  # for the process groups a strategy makes (2-D sharding)


def _rank() -> int:
    return torch.distributed.get_rank()


def _fit(world_size: int, module_kwargs: dict, trainer_kwargs: dict) -> dict[str, torch.Tensor]:
    num_nodes = trainer_kwargs.get("num_nodes", 1)
    lm.lightning_env(_rank(), world_size, num_nodes)
    module = lm.TwoTower(**module_kwargs)
    if isinstance(trainer_kwargs.get("strategy"), dict):  # DDP options
        trainer_kwargs = {**trainer_kwargs, "strategy": ls.SparseDDPStrategy(**trainer_kwargs["strategy"])}
    trainer = lm.trainer(world_size // num_nodes, **trainer_kwargs)
    trainer.fit(module)
    assert trainer.world_size == world_size and trainer.num_nodes == num_nodes
    return lm.state(module)


CASES = {
    "automatic": (dict(), dict(), dict()),
    "accumulate": (dict(), dict(accumulate_grad_batches=2), dict(accumulate=2)),
    "clip": (dict(dense_lr=0.5), dict(gradient_clip_val=0.05), dict(dense_lr=0.5, clip_norm=0.05)),
    "manual": (dict(manual=True), dict(), dict()),
    "scheduler": (dict(scheduler=True), dict(), dict(scheduler=True)),
    "two-nodes": (dict(), dict(num_nodes=2), dict()),
    "ddp-options": (
        dict(),
        dict(strategy=dict(find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=1)),
        dict(),
    ),
    "static-graph": (dict(), dict(strategy=dict(static_graph=True)), dict()),
    # 2-D sharding: tables sharded over groups of 2 ranks, replicated across the groups.
    "two-d-accumulate": (  # batches of 2: 6 per rank and epoch, so that every optimizer step takes 2
        dict(batch_size=2),
        dict(strategy=dict(sharding_group_size=2, timeout=TIMEOUT), accumulate_grad_batches=2),
        dict(accumulate=2),
    ),
    "adam-global": (
        dict(sparse="SparseAdam", sparse_kwargs=dict(lr=0.05, bias_correction="global")),
        dict(),
        dict(sparse_cls=torch.optim.SparseAdam, sparse_kwargs=dict(lr=0.05)),
    ),
}


@pytest.mark.parametrize(
    "world_size, case",
    [(2, case) for case in CASES if case != "two-d-accumulate"]
    + [(1, "automatic"), (3, "automatic"), (3, "accumulate"), (4, "two-d-accumulate"), (8, "automatic")],
)  # fmt: skip
def test_fit_matches_plain_torch_reference(rank_pools, world_size, case):
    module_kwargs, trainer_kwargs, reference_kwargs = CASES[case]
    reference_kwargs = {"sparse_cls": torch.optim.Adagrad, "sparse_kwargs": {"lr": 0.2}, **reference_kwargs}
    batches = lm.global_batches(world_size, batch_size=module_kwargs.get("batch_size", 4), epochs=2)
    expected = lm.reference(batches, **reference_kwargs)
    results = rank_pools(world_size).run(_fit, world_size, module_kwargs, {"max_epochs": 2, **trainer_kwargs})
    initial = lm.reference([], **reference_kwargs)
    assert not torch.equal(expected["users"], initial["users"])
    for got in results:
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{case}: {key}")


# ---------------------------------------------------------------- untouched rows, optional lookups
def _fit_adamw_and_report_untouched() -> tuple[torch.Tensor, torch.Tensor]:
    lm.lightning_env(_rank(), 2)
    module = lm.TwoTower(sparse="SparseAdam", sparse_kwargs=dict(lr=0.1, weight_decay=0.5, decoupled_weight_decay=True))
    lm.trainer(2, max_epochs=1).fit(module)
    return module.users.full_weight(), torch.unique(lm.dataset().tensors[0])


def test_untouched_rows_never_change(rank_pools):
    initial = ls.init.normal()(torch.arange(lm.USERS), lm.DIM, 1)
    for final, seen in rank_pools(2).run(_fit_adamw_and_report_untouched):
        untouched = torch.ones(lm.USERS, dtype=torch.bool)
        untouched[seen] = False
        assert untouched.any() and (~untouched).any()
        torch.testing.assert_close(final[untouched], initial[untouched], rtol=0, atol=0)
        assert not torch.equal(final[~untouched], initial[~untouched])


class Tags(pl.LightningModule):
    """Two tables: ``words`` is looked up twice per forward; rank 1 looks ``tags`` up with no ids at odd steps.

    The loss is linear in the rows, so the expected gradients are exact counts.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tags = ls.SparseEmbedding(7, 2, seed=3)
        self.words = ls.SparseEmbedding(5, 2, seed=4, sharding="range")
        self.scale = nn.Parameter(torch.ones(()))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        words = self.words(ids % 5).sum() + 2 * self.words((ids + 1) % 5).sum()
        if self.global_rank == 1 and self.global_step % 2:
            ids = ids[:0]  # nothing to look up this step; the call still happens
        return (self.tags(ids) * self.scale).sum() * 0.5 + words * self.scale

    def configure_optimizers(self):
        return torch.optim.SGD([self.scale], lr=0.0)

    def configure_sparse_optimizers(self):
        return ls.SparseSGD([self.tags, self.words], lr=0.1)


def _fit_tags() -> tuple[torch.Tensor, torch.Tensor]:
    lm.lightning_env(_rank(), 2)
    ids = torch.arange(16) % 7
    module = Tags()
    loader = DataLoader(TensorDataset(ids), batch_size=2)
    lm.trainer(2, max_epochs=1, use_distributed_sampler=False).fit(module, loader)
    return module.tags.full_weight(), module.words.full_weight()


def test_two_tables_one_used_twice_one_unused_on_some_ranks(rank_pools):
    ids = torch.arange(16) % 7
    tags = ls.init.normal()(torch.arange(7), 2, 3)
    words = ls.init.normal()(torch.arange(5), 2, 4)
    for step, batch in enumerate(ids.view(-1, 2)):  # both ranks see the same loader
        tag_grad, word_grad = torch.zeros(7, 2), torch.zeros(5, 2)
        for rank in range(2):
            word_grad.index_add_(0, batch % 5, torch.ones(2, 2))
            word_grad.index_add_(0, (batch + 1) % 5, torch.full((2, 2), 2.0))
            if not (rank == 1 and step % 2):
                tag_grad.index_add_(0, batch, torch.full((2, 2), 0.5))
        tags -= 0.1 * tag_grad / 2  # averaged over ranks
        words -= 0.1 * word_grad / 2
    for got_tags, got_words in rank_pools(2).run(_fit_tags):
        torch.testing.assert_close(got_tags, tags, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_words, words, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- precision
def _fit_precision(precision: str, inject: tuple[int, int] | None, module_cls: str = "TwoTower", into: str = "rows") -> dict:
    lm.lightning_env(_rank(), 2)
    module = getattr(lm, module_cls)(sparse_kwargs={"lr": 0.3}, dense_lr=0.2)
    module.inject_inf_at = inject if into == "rows" else None
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before = lm.state(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))
            after = lm.state(pl_module)
            changed.append({k: not torch.equal(after[k], self.before[k]) for k in after})

    class DenseOverflow(pl.Callback):  # an inf in one dense gradient (the last bias: no other gradient depends on it)
        def on_before_backward(self, trainer, pl_module, loss):
            if into == "dense" and inject == (pl_module.global_rank, pl_module.global_step):
                self.handle = pl_module.mlp[-1].bias.register_hook(lambda g: g * float("inf"))  # before DDP's all-reduce

        def on_after_backward(self, trainer, pl_module):
            if getattr(self, "handle", None) is not None:
                self.handle.remove()
                self.handle = None

    changed: list[dict] = []
    if precision == "16-mixed":
        # On CPU, Trainer(precision="16-mixed") quietly becomes bf16; the plugin keeps fp16 and its GradScaler.
        from lightning.pytorch.plugins.precision import MixedPrecision

        precision_kwargs = {"plugins": [MixedPrecision("16-mixed", device="cpu")]}
    else:
        precision_kwargs = {"precision": precision}
    lm.trainer(2, max_epochs=4, callbacks=[Record(), DenseOverflow()], **precision_kwargs).fit(module)
    scaler = getattr(module.trainer.precision_plugin, "scaler", None)
    return {"losses": losses, "changed": changed, "state": lm.state(module), "scale": scaler.get_scale() if scaler else None}


@pytest.mark.parametrize("precision", ["bf16-mixed"])  # 16-mixed: against plain torch below
def test_mixed_precision_trains_and_replicas_agree(rank_pools, precision):
    results = rank_pools(2).run(_fit_precision, precision, None)
    assert (results[0]["scale"] is not None) == (precision == "16-mixed")
    for result in results:
        losses = result["losses"]
        assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6, "loss must fall"
    for key, value in results[0]["state"].items():
        torch.testing.assert_close(results[1]["state"][key], value, rtol=0, atol=0)


SGD_LOSS_SCALE = 2.0**10  # no step of this fit overflows at this scale (65536, the default, overflows once)
SGD_16_MIXED = {  # case: (manual, GradScaler arguments, module, trainer and reference keyword arguments)
    "automatic-lightning-plugin": (False, dict(init_scale=SGD_LOSS_SCALE), {}, {}, {}),
    "manual-our-plugin": (True, dict(init_scale=SGD_LOSS_SCALE), {}, {}, {}),
    "clip": (False, dict(init_scale=SGD_LOSS_SCALE), *CASES["clip"]),
    # the scale doubles after every step (2**4 to 2**10): each backward's row gradients carry the scale of their step
    "growing-scale": (False, dict(init_scale=2.0**4, growth_interval=1), {}, {}, {}),
}


def _fit_16_mixed_sgd(case: str) -> tuple[dict, float, float]:
    from lightning.pytorch.plugins.precision import MixedPrecision

    manual, scaler_kwargs, module_kwargs, trainer_kwargs, _ = SGD_16_MIXED[case]
    lm.lightning_env(_rank(), 2)
    module = lm.TwoTower(sparse="SparseSGD", sparse_kwargs={"lr": 1.0}, manual=manual, **module_kwargs)
    # On CPU, Trainer(precision="16-mixed") quietly becomes bf16; the plugin keeps fp16 and its GradScaler. Lightning's
    # plugin (which the strategy replaces), or ours given as such.
    plugin_cls = ls.SparseMixedPrecision if manual else MixedPrecision
    plugin = plugin_cls("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))
    scale = plugin.scaler.get_scale()
    trainer = lm.trainer(2, max_epochs=1, plugins=[plugin], **trainer_kwargs)
    trainer.fit(module)
    assert type(trainer.precision_plugin) is ls.SparseMixedPrecision and trainer.precision_plugin.scaler is plugin.scaler
    return lm.state(module), scale, plugin.scaler.get_scale()


@pytest.mark.parametrize("case", list(SGD_16_MIXED))
def test_16_mixed_steps_sparse_gradients_unscaled_as_plain_torch(rank_pools, case):
    """SGD's step is proportional to the gradient: a row gradient left multiplied by the loss scale (65536) would move
    the rows 1024 times too far. Plain torch in float32 is the reference (fp16's forward: a tolerance of 1e-3).
    ``clip``: gradient_clip_val clips the dense gradients once unscaled (clipped while scaled, they would barely move)."""
    growth = 2.0**6 if case == "growing-scale" else 1.0  # 6 steps
    reference_kwargs = SGD_16_MIXED[case][4]
    expected = lm.reference(lm.global_batches(2, batch_size=4, epochs=1), torch.optim.SGD, {"lr": 1.0}, **reference_kwargs)
    initial = lm.reference([], torch.optim.SGD, {"lr": 1.0})
    assert (expected["users"] - initial["users"]).abs().max() > 0.02, "the reference must train the rows"
    results = rank_pools(2).run(_fit_16_mixed_sgd, case)
    for state, scale_before, scale_after in results:
        assert scale_after == scale_before * growth > 1, "no step may overflow (a skipped step would differ from the reference)"
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-3, msg=key)
    for key, value in results[0][0].items():
        torch.testing.assert_close(results[1][0][key], value, rtol=0, atol=0)


@pytest.mark.parametrize("module_cls, into", [("TwoTower", "rows"), ("CollectionTower", "rows"), ("TwoTower", "dense")])
def test_16_mixed_overflow_on_one_rank_skips_dense_and_sparse_on_every_rank(rank_pools, module_cls, into):
    """An inf in one rank's row gradients, or in a dense gradient only (then the rows must not step either)."""
    inject_step = 3
    results = rank_pools(2).run(_fit_precision, "16-mixed", (1, inject_step), module_cls, into)
    clean = rank_pools(2).run(_fit_precision, "16-mixed", None, module_cls)
    for result in results:
        skipped = result["changed"][inject_step]
        assert not any(skipped.values()), f"step {inject_step} must change nothing: {skipped}"
        assert all(result["changed"][inject_step + 1].values())
    # The scaler backed off once more than in the clean run.
    assert results[0]["scale"] == pytest.approx(clean[0]["scale"] / 2)
    for key, value in results[0]["state"].items():
        torch.testing.assert_close(results[1]["state"][key], value, rtol=0, atol=0)


class TablesOnly(pl.LightningModule):
    """All trainable state is tables: no dense gradient for GradScaler to check."""

    def __init__(self, inject_at: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.users = ls.SparseEmbedding(lm.USERS, 4, seed=1)
        self.inject_at = inject_at

    def training_step(self, batch, batch_idx):
        users, items, target = batch
        out = self.users(users).sum(-1)
        if self.inject_at == (self.global_rank, self.global_step):
            out = out * float("inf")
        return (out - target).pow(2).mean()

    def configure_optimizers(self):
        return None

    def configure_sparse_optimizers(self):
        return ls.SparseAdagrad([self.users], lr=0.1)

    def train_dataloader(self):
        return DataLoader(lm.dataset(48), batch_size=4)


def _fit_tables_only(inject: tuple[int, int] | None) -> dict:
    from lightning.pytorch.plugins.precision import MixedPrecision

    lm.lightning_env(_rank(), 2)
    module = TablesOnly(inject)
    changed = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before = pl_module.users.full_weight()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            changed.append(not torch.equal(pl_module.users.full_weight(), self.before))

    trainer = lm.trainer(2, max_epochs=1, callbacks=[Record()], plugins=[MixedPrecision("16-mixed", device="cpu")])
    trainer.fit(module)
    return {"changed": changed, "scale": trainer.precision_plugin.scaler.get_scale(), "table": module.users.full_weight()}


def test_16_mixed_with_tables_only_trains_and_skips_overflows(rank_pools):
    clean = rank_pools(2).run(_fit_tables_only, None)
    assert all(clean[0]["changed"])
    injected = rank_pools(2).run(_fit_tables_only, (1, 2))
    for result in injected:
        assert result["changed"][2] is False and all(result["changed"][:2]) and all(result["changed"][3:])
        assert result["scale"] == pytest.approx(clean[0]["scale"] / 2)
    torch.testing.assert_close(injected[0]["table"], injected[1]["table"], rtol=0, atol=0)


# ---------------------------------------------------------------- checkpoints
def _fit_resume(directory: str) -> tuple[dict, dict]:
    lm.lightning_env(_rank(), 2)
    straight = lm.TwoTower(sparse="SparseAdam", sparse_kwargs={"lr": 0.05}, scheduler=True)
    lm.trainer(2, max_epochs=2).fit(straight)
    first = lm.TwoTower(sparse="SparseAdam", sparse_kwargs={"lr": 0.05}, scheduler=True)
    lm.trainer(2, max_epochs=1, enable_checkpointing=True, default_root_dir=directory).fit(first)
    (ckpt,) = glob.glob(os.path.join(directory, "**", "*.ckpt"), recursive=True)
    resumed = lm.TwoTower(sparse="SparseAdam", sparse_kwargs={"lr": 0.05}, scheduler=True, dense_lr=123.0)
    trainer = lm.trainer(2, max_epochs=2, default_root_dir=directory)
    trainer.fit(resumed, ckpt_path=ckpt)
    # validate and test after fit run setup again: trained shards must stay as they are.
    trainer.validate(resumed, verbose=False)
    trainer.test(resumed, resumed.val_dataloader(), verbose=False)
    # validate from the checkpoint: a fresh module gets the checkpoint's tables on every rank.
    fresh = lm.TwoTower()
    lm.trainer(2).validate(fresh, fresh.val_dataloader(), ckpt_path=ckpt, verbose=False)
    return lm.state(straight), lm.state(resumed), ckpt, lm.state(first), lm.state(fresh)


def test_resume_from_checkpoint_equals_uninterrupted_fit(rank_pools, tmp_path):
    results = rank_pools(2).run(_fit_resume, str(tmp_path))
    for straight, resumed, _ckpt, first, from_checkpoint in results:
        for key, value in straight.items():
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
            torch.testing.assert_close(from_checkpoint[key], first[key], rtol=0, atol=0, msg=key)
    stored = ls.checkpoint.stored_tensors(results[0][2])
    assert stored["state_dict.users.weight"].shape == (lm.USERS, lm.DIM)  # the logical table, not a shard
    assert not any(key.endswith(".shard") for key in stored)
    assert stored["optimizer_1.state.0.exp_avg"].shape == (lm.USERS, lm.DIM)
    assert stored["optimizer_1.state.0.row_step"].dtype == torch.int64


# ---------------------------------------------------------------- evaluation with uneven loaders
def _predict_uneven() -> list:
    rank = _rank()
    lm.lightning_env(rank, 2)
    module = lm.TwoTower()
    sizes = {0: 7, 1: 2}  # rank 0: 4 batches, rank 1: 1 batch
    start = 0 if rank == 0 else sizes[0]
    data = lm.dataset(9)
    index = torch.arange(start, start + sizes[rank])
    loader = DataLoader(TensorDataset(data.tensors[0][index], data.tensors[1][index], index), batch_size=2)
    trainer = lm.trainer(2, use_distributed_sampler=False)
    predictions = trainer.predict(module, loader)
    trainer.validate(module, DataLoader(TensorDataset(*[t[index] for t in data.tensors]), batch_size=2), verbose=False)
    return torch.cat(predictions)


def test_predict_with_uneven_batches_finishes_and_predicts_every_sample_once(rank_pools):
    results = rank_pools(2).run(_predict_uneven)
    merged = torch.cat(results)
    assert sorted(merged[:, 0].long().tolist()) == list(range(9))
    # The same model in one process gives the same predictions.
    module = lm.TwoTower()
    data = lm.dataset(9)
    with torch.no_grad():
        expected = module(data.tensors[0], data.tensors[1])
    order = merged[:, 0].long()
    torch.testing.assert_close(merged[:, 1], expected[order], rtol=1e-5, atol=1e-6)


class EmptyOnRankOne(lm.TwoTower):
    """Evaluation loaders with no batches at all on rank 1; logs without sync_dist (a rank that skips
    the loop never joins Lightning's epoch-end reduction of logged values)."""

    def __init__(self) -> None:
        super().__init__()
        self.allow_zero_length_dataloader_with_multiple_devices = True
        self.seen = 0

    def validation_step(self, batch, batch_idx):
        users, items, target = batch
        self.seen += len(users)
        self.log("val_loss", torch.nn.functional.mse_loss(self(users, items).float(), target), batch_size=len(users))

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)


def _evaluate_with_an_empty_rank(stage: str) -> tuple[int, float, torch.Tensor | None]:
    import time

    rank = _rank()
    lm.lightning_env(rank, 2)
    module = EmptyOnRankOne()
    data = lm.dataset(6)
    index = torch.arange(6) if rank == 0 else torch.arange(0)
    tensors = [*[t[index] for t in data.tensors[:2]], index if stage == "predict" else data.tensors[2][index]]
    loader = DataLoader(TensorDataset(*tensors), batch_size=2)
    trainer = lm.trainer(2, use_distributed_sampler=False, limit_val_batches=None)
    start = time.monotonic()
    if stage == "fit":  # 3 training batches on each rank; the epoch's validation loop has none on rank 1
        output = trainer.fit(module, DataLoader(TensorDataset(*data.tensors), batch_size=2), loader)
    else:
        output = getattr(trainer, stage)(module, loader, **({} if stage == "predict" else {"verbose": False}))
    seconds = time.monotonic() - start
    predictions = torch.cat(output) if stage == "predict" and output else None
    return module.seen, seconds, predictions


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", ["validate", "test", "predict", "fit"])
def test_evaluation_with_an_empty_loader_on_one_rank_finishes(rank_pools, stage):
    """Also the validation loop of a fit: the rank without validation batches serves the other's lookups."""
    results = rank_pools(2).run(_evaluate_with_an_empty_rank, stage, timeout=90)
    (seen0, seconds0, predictions), (seen1, seconds1, nothing) = results
    assert max(seconds0, seconds1) < COLLECTIVE_TIMEOUT_S, "a rank waited for a collective to time out"
    assert seen1 == 0 and nothing is None
    if stage == "predict":
        assert sorted(predictions[:, 0].long().tolist()) == list(range(6))
        module, data = lm.TwoTower(), lm.dataset(6)
        with torch.no_grad():
            torch.testing.assert_close(predictions[:, 1], module(data.tensors[0], data.tensors[1]), rtol=1e-5, atol=1e-6)
    else:
        assert seen0 == 6


# ---------------------------------------------------------------- error paths
class NoSparseOptimizer(lm.TwoTower):
    def configure_sparse_optimizers(self):
        return None


class ShardToDense(lm.TwoTower):
    def configure_optimizers(self):
        return torch.optim.SGD([*self.mlp.parameters(), self.users.shard], lr=0.1)


class SparseInDense(lm.TwoTower):
    def configure_optimizers(self):
        return ls.SparseSGD([self.users, self.items])


class MissingTable(lm.TwoTower):
    def configure_sparse_optimizers(self):
        return ls.SparseSGD([self.users])


class OutOfOrder(lm.TwoTower):
    def forward(self, users, items):
        if self.global_rank == 0:
            return super().forward(users, items)
        first, second = self.items(items[:, 0]), self.items(items[:, 1])  # items before users on rank 1
        return self.mlp(torch.cat([self.users(users), first, second], dim=-1)).squeeze(-1)


def _fit_error(module_cls: type, strategy: str | dict, devices: int) -> str:
    lm.lightning_env(_rank(), 2)
    if isinstance(strategy, dict):  # SparseDDPStrategy's options
        strategy = ls.SparseDDPStrategy(**strategy)
    lm.trainer(devices, strategy=strategy).fit(module_cls())
    return "no error"


@pytest.mark.parametrize(
    "module_cls, strategy, devices, message",
    [
        (NoSparseOptimizer, "sparse_ddp", 2, "has SparseEmbeddings (users, items) but no sparse optimizer. HINT: define"),
        (ShardToDense, "sparse_ddp", 2, "The shard of SparseEmbedding users was given to the dense optimizer SGD. HINT"),
        (SparseInDense, "sparse_ddp", 2, "configure_optimizers returned SparseSGD. HINT: return sparse optimizers"),
        (MissingTable, "sparse_ddp", 2, "No sparse optimizer updates items. HINT"),
        (OutOfOrder, "sparse_ddp", 2, "Ranks looked up different tables in the same round"),
        (
            lm.TwoTower,
            "ddp",
            2,
            'used under Lightning\'s DDPStrategy, which does not shard or step SparseEmbeddings. HINT: pass strategy="sparse_ddp"',
        ),
        (lm.TwoTower, dict(sharding_group_size=3), 2, "Invalid sharding_group_size: 3 for 2 ranks. HINT: use a divisor"),
    ],
)
def test_error_paths_name_the_fix(rank_pools, module_cls, strategy, devices, message):
    results = rank_pools(2).run_raw(_fit_error, module_cls, strategy, devices, timeout=60)
    for result in results:
        assert isinstance(result, RankError), result
        assert message in result.message


def test_sparse_embedding_under_single_device_strategy_errors():
    module = lm.TwoTower()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    with pytest.raises(RuntimeError, match="SingleDeviceStrategy, which does not shard or step SparseEmbeddings"):
        trainer.fit(module)


# ---------------------------------------------------------------- CLI, stats, LR monitor
def _cli(args: list[str]) -> dict:
    from lightning.pytorch.cli import LightningCLI

    lm.lightning_env(_rank(), 2)
    cli = LightningCLI(lm.TwoTower, args=args, run=False, save_config_callback=None)
    cli.trainer.fit(cli.model)
    strategy = cli.trainer.strategy
    return {"strategy": type(strategy).__name__, "ddp_kwargs": dict(strategy._ddp_kwargs), "state": lm.state(cli.model)}


def test_cli_string_and_class_path_forms(rank_pools, tmp_path):
    common = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=1", "--trainer.logger=false",
              "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
              f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    by_name = rank_pools(2).run(_cli, [*common, "--trainer.strategy=sparse_ddp"])
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lightning_sparse.SparseDDPStrategy\n"
        "    init_args:\n      find_unused_parameters: true\n      bucket_cap_mb: 5\n"
    )
    by_class = rank_pools(2).run(_cli, [f"--config={config}", *common])
    for result in by_name + by_class:
        assert result["strategy"] == "SparseDDPStrategy"
    assert by_class[0]["ddp_kwargs"]["find_unused_parameters"] is True
    assert by_class[0]["ddp_kwargs"]["bucket_cap_mb"] == 5
    for key, value in by_name[0]["state"].items():
        torch.testing.assert_close(by_class[0]["state"][key], value, rtol=0, atol=0)


LIGHTNING_AFTER = """
import sys
import lightning_sparse as ls
assert not [m for m in sys.modules if m.split(".")[0] == "lightning"], "import lightning_sparse imported Lightning"
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
assert StrategyRegistry["sparse_ddp"]["strategy"] is ls.SparseDDPStrategy
assert isinstance(STRATEGY_REGISTRY.get("sparse_ddp"), ls.FabricSparseDDPStrategy)
trainer = Trainer(strategy="sparse_ddp", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
print(type(trainer.strategy).__name__)
"""


@pytest.mark.subprocesses
def test_a_program_without_lightning_does_not_import_it_and_lightning_imported_later_knows_sparse_ddp():
    """``import lightning_sparse`` before Lightning (as isort orders ``import`` before ``from``): Lightning's registries
    learn ``sparse_ddp`` when Lightning is imported; a plain-torch program never pays Lightning's import."""
    run = subprocess.run([sys.executable, "-c", LIGHTNING_AFTER], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0 and run.stdout.strip().endswith("SparseDDPStrategy"), run.stdout[-2000:] + run.stderr[-3000:]


def _fit_with_stats(directory: str, accumulate: int, every: int, validate: bool = False) -> list[str]:
    import logging

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    lm.lightning_env(_rank(), 2)
    module = lm.TwoTower(scheduler=True)
    trainer = lm.trainer(
        2, logger=CSVLogger(directory, name="run", version=0), log_every_n_steps=every, accumulate_grad_batches=accumulate,
        callbacks=[ls.SparseStatsMonitor(prog_bar=True), LearningRateMonitor("step")],
        **dict(limit_val_batches=None, val_check_interval=3) if validate else {},  # mid-epoch: after step 3 of 6
    )  # fmt: skip
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("lightning_sparse")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        trainer.fit(module)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    return records


@pytest.mark.parametrize("accumulate, every, validate", [(1, 1, False), (2, 1, False), (1, 2, False), (1, 1, True)])
def test_stats_monitor_logs_per_optimizer_step_when_lightning_logs(rank_pools, tmp_path, accumulate, every, validate):
    """``validate``: a validation between two steps; its lookups are not counted in the next step's."""
    import csv

    debug = rank_pools(2).run(_fit_with_stats, str(tmp_path), accumulate, every, validate)[0]
    assert any("sharded 2 tables over 2 ranks" in line for line in debug), debug
    assert any("sparse optimizers ['SparseAdagrad(users, items)']" in line for line in debug), debug
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    stats = [r for r in rows if r.get("sparse/ids")]
    steps = 6 // accumulate  # 48 samples / 2 ranks / batch 4, one optimizer step per `accumulate` batches
    assert len(stats) == steps // every and [int(r["step"]) for r in stats] == list(range(every - 1, steps, every))
    for row in stats:
        # per optimizer step: 2 ranks x `accumulate` batches x 4 samples x (1 user + 2 items)
        assert float(row["sparse/ids"]) == 2 * accumulate * 4 * 3
        assert 0 < float(row["sparse/unique_ids"]) <= float(row["sparse/ids"])
        assert float(row["sparse/bytes_sent"]) > 0 and float(row["sparse/bytes_sent"]) == float(row["sparse/bytes_received"])
        assert float(row["sparse/exchange_s"]) > 0 and float(row["sparse/update_s"]) > 0
    if (accumulate, every) == (1, 1):
        lrs = [float(r["lr-SparseAdagrad"]) for r in rows if r.get("lr-SparseAdagrad")]
        assert lrs[:4] == pytest.approx([0.2, 0.2, 0.1, 0.1])


# ---------------------------------------------------------------- the model summary
def _fit_with_summary() -> str:
    import logging

    lm.lightning_env(_rank(), 2)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        lm.trainer(2, max_epochs=1, limit_train_batches=1, enable_model_summary=True).fit(lm.TwoTower())
    finally:
        logger.removeHandler(handler)
    return "\n".join(records)


def test_the_model_summary_lists_each_table_with_what_a_rank_holds(rank_pools):
    """Lightning counts parameters only: the strategy logs the tables beside it, on rank 0."""
    logged, other_rank = rank_pools(2).run(_fit_with_summary)
    summary = logged[logged.index("| Table") :]
    assert "0 | users | 40   | 4   | float32 | mod over 2 ranks   | 20            | 320 B          | 320 B" in summary, summary
    assert "1 | items | 25   | 4   | float32 | range over 2 ranks | 13            | 208 B          | 208 B" in summary, summary
    assert "Sparse tables: 65 rows, 528 B per rank, 528 B of optimizer state per rank" in summary and "Total params" in logged
    assert "| Table" not in other_rank


def test_manual_optimization_takes_a_plateau_scheduler_without_a_monitor():
    """As Lightning's ``configure_optimizers``: a manual module steps its schedulers itself, so its ``ReduceLROnPlateau``
    needs no monitor (an automatic one needs it, to step the scheduler on that metric)."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_sparse.lightning.sparse_optimizers import configure_sparse_optimizers

    class Plateau(pl.LightningModule):
        def __init__(self, manual: bool) -> None:
            super().__init__()
            self.automatic_optimization = not manual
            self.users = ls.SparseEmbedding(8, 2)

        def configure_sparse_optimizers(self):
            optimizer = ls.SparseSGD([self.users], lr=0.1)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}

    manual = Plateau(manual=True)
    _, configs = configure_sparse_optimizers(manual, [manual.users])
    assert isinstance(configs[0].scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    automatic = Plateau(manual=False)
    with pytest.raises(MisconfigurationException, match="monitor"):
        configure_sparse_optimizers(automatic, [automatic.users])
