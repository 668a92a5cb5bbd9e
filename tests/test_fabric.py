"""Fabric(strategy="sparse_ddp") on 1-3 CPU processes against a plain-torch reference; checkpoints shared with the Trainer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import lightning.pytorch as pl
import lightning_models as lm
import pytest
import torch
from example_runs import run_script
from processes import assert_clean_exit
from rank_pool import RankError
from references import make_reference
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import lightning_sparse as ls

OPTIMIZERS = {
    "sgd": ("SparseSGD", dict(lr=0.5)),
    "adagrad": ("SparseAdagrad", dict(lr=0.2, initial_accumulator_value=0.1)),
    "rowwise-adagrad": ("SparseRowWiseAdagrad", dict(lr=0.2)),
    "adam-row": ("SparseAdam", dict(lr=0.05)),
    "adam-global": ("SparseAdam", dict(lr=0.05, bias_correction="global")),
}
ACCUMULATE, DENSE_LR, CLIP, EPOCHS = 2, 0.5, 0.05, 2


def _rank() -> int:
    return torch.distributed.get_rank()


def _fabric(world_size: int, **kwargs) -> L.Fabric:
    lm.lightning_env(_rank(), world_size)  # the ranks exist: Fabric launches nothing and reuses their group
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="sparse_ddp", **kwargs)
    fabric.launch()
    return fabric


def _setup(fabric: L.Fabric, sparse: str, sparse_kwargs: dict):
    model = lm.TwoTower()  # seeds everything with 123: the dense init and the sampler's shuffle
    dense = torch.optim.SGD(model.mlp.parameters(), lr=DENSE_LR)
    sparse_opt = getattr(ls, sparse)([model.users, model.items], **sparse_kwargs)
    model, dense, sparse_opt = fabric.setup(model, dense, sparse_opt)
    # The sampler Lightning gives a shuffled loader, with epochs set here (Fabric's loader would
    # number them from its own first iteration, also after a resume).
    data = lm.dataset()
    sampler = DistributedSampler(data, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=True, seed=123)
    return model, dense, sparse_opt, DataLoader(data, batch_size=4, sampler=sampler)


def _train(fabric: L.Fabric, model, dense, sparse, loader, epochs: range) -> None:
    """A user's loop: accumulation under no_backward_sync, dense clipping, then both steps."""
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        for index, (users, items, target) in enumerate(loader):
            stepping = (index + 1) % ACCUMULATE == 0
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = nn.functional.mse_loss(model(users, items), target)
                fabric.backward(loss / ACCUMULATE)
            if stepping:
                fabric.clip_gradients(model, dense, max_norm=CLIP)
                dense.step()
                sparse.step()
                dense.zero_grad()
                sparse.zero_grad()


def _fit_every_optimizer(world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    fabric = _fabric(world_size)
    results = {}
    for case, (sparse, sparse_kwargs) in OPTIMIZERS.items():
        model, dense, sparse_opt, loader = _setup(fabric, sparse, sparse_kwargs)
        _train(fabric, model, dense, sparse_opt, loader, range(EPOCHS))
        results[case] = lm.state(model.module if hasattr(model, "module") else model)
    return results


class _PerTable:
    """One reference optimizer per table, stepped together (torch's sparse optimizers keep per-parameter state)."""

    def __init__(self, name: str, params: list[nn.Parameter], **kwargs) -> None:
        self.optimizers = [make_reference(name, p, kwargs) for p in params]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fabric_loop_matches_plain_torch_reference_for_every_optimizer(rank_pools, world_size):
    results = rank_pools(world_size).run(_fit_every_optimizer, world_size)
    batches = lm.global_batches(world_size, batch_size=4, epochs=EPOCHS)
    for case, (sparse, sparse_kwargs) in OPTIMIZERS.items():
        kwargs = dict(dense_lr=DENSE_LR, accumulate=ACCUMULATE, clip_norm=CLIP)

        def make(params, sparse=sparse, **kw):
            return _PerTable(sparse, params, **kw)

        expected = lm.reference(batches, make, sparse_kwargs, **kwargs)
        initial = lm.reference([], make, sparse_kwargs, **kwargs)
        assert not torch.equal(expected["users"], initial["users"]), case
        for got in results:
            for key, value in expected.items():
                torch.testing.assert_close(got[case][key], value, rtol=1e-5, atol=1e-6, msg=f"{case}: {key}")


# ---------------------------------------------------------------- checkpoints: Fabric, reshard, Trainer
SPARSE = ("SparseAdam", dict(lr=0.05))  # per-row state of three kinds: exp_avg, exp_avg_sq, row_step


def _full_state(model, sparse) -> dict[str, torch.Tensor]:
    model = model.module if hasattr(model, "module") else model
    state = lm.state(model)
    for index, entry in sparse.full_state_dict()["state"].items():
        state.update({f"sparse.{index}.{key}": value.clone() for key, value in entry.items()})  # counters are shared
    return state


def _fabric_save_and_resume(path: str) -> tuple[dict, dict, dict]:
    """Two epochs straight (saving after the first), and the second epoch again from the checkpoint."""
    fabric = _fabric(2)
    model, dense, sparse, loader = _setup(fabric, *SPARSE)
    _train(fabric, model, dense, sparse, loader, range(1))
    # the sparse optimizer listed first: saved in the Trainer's numbering all the same (dense 0, sparse 1)
    fabric.save(path, {"model": model, "sparse": sparse, "dense": dense, "epoch": 1})
    saved = _full_state(model, sparse)
    _train(fabric, model, dense, sparse, loader, range(1, 2))
    straight = _full_state(model, sparse)

    model, dense, sparse, loader = _setup(fabric, *SPARSE)
    state = {"model": model, "dense": dense, "sparse": sparse, "epoch": 0}
    assert fabric.load(path, state) == {}
    assert state["epoch"] == 1
    _train(fabric, model, dense, sparse, loader, range(state["epoch"], 2))
    return saved, straight, _full_state(model, sparse)


def _fabric_load(path: str, world_size: int) -> tuple[dict, dict]:
    fabric = _fabric(world_size)
    model, dense, sparse, _ = _setup(fabric, *SPARSE)
    remainder = fabric.load(path, {"model": model, "dense": dense, "sparse": sparse})
    return _full_state(model, sparse), remainder


def test_fabric_checkpoint_resumes_exactly_and_reshards(rank_pools, tmp_path):
    path = str(tmp_path / "fabric.ckpt")
    results = rank_pools(2).run(_fabric_save_and_resume, path)
    for _, straight, resumed in results:
        for key, value in straight.items():
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)
    stored = ls.checkpoint.stored_tensors(path)  # the Trainer's layout: dense optimizer 0, sparse optimizer 1
    assert stored["state_dict.users.weight"].shape == (lm.USERS, lm.DIM)
    assert stored["optimizer_1.state.0.row_step"].shape == (lm.USERS,)
    saved = results[0][0]  # the state at the save, as rank 0 gathered it
    for got, remainder in rank_pools(3).run(_fabric_load, path, 3):
        assert remainder == {"epoch": 1}
        for key, value in saved.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def _fabric_load_sparse_only(path: str) -> tuple[dict, dict]:
    """Saves the dense and the sparse optimizer after an epoch, then loads the sparse one alone (by its key) afresh."""
    fabric = _fabric(2)
    model, dense, sparse, loader = _setup(fabric, *SPARSE)
    _train(fabric, model, dense, sparse, loader, range(1))
    fabric.save(path, {"model": model, "dense": dense, "sparse": sparse})
    saved = _full_state(model, sparse)
    model, _, sparse, _ = _setup(fabric, *SPARSE)
    assert fabric.load(path, {"model": model, "sparse": sparse}) == {}
    return saved, _full_state(model, sparse)


def test_fabric_load_matches_optimizers_by_their_keys_also_a_subset_of_those_saved(rank_pools, tmp_path):
    """The sparse optimizer alone gets the state saved under its key ("sparse", index 1), not the first one saved."""
    for saved, loaded in rank_pools(2).run(_fabric_load_sparse_only, str(tmp_path / "fabric.ckpt")):
        assert set(loaded) == set(saved)
        for key, value in saved.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)


def _trainer_save(path: str) -> dict:
    lm.lightning_env(_rank(), 2)
    module = lm.TwoTower(sparse=SPARSE[0], sparse_kwargs=SPARSE[1])
    trainer = lm.trainer(2, max_epochs=1)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    return _full_state(module, trainer.strategy.sparse_optimizers[0])


class _StateAtStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = _full_state(module, trainer.strategy.sparse_optimizers[0])
        self.epoch = trainer.current_epoch


def _trainer_resume(path: str) -> tuple[dict, int]:
    lm.lightning_env(_rank(), 3)
    module = lm.TwoTower(sparse=SPARSE[0], sparse_kwargs=SPARSE[1])
    probe = _StateAtStart()
    lm.trainer(3, max_epochs=1, callbacks=[probe]).fit(module, ckpt_path=path)
    return probe.state, probe.epoch


def test_trainer_checkpoint_loads_in_fabric_and_the_reverse(rank_pools, tmp_path):
    trainer_path, fabric_path = str(tmp_path / "trainer.ckpt"), str(tmp_path / "fabric.ckpt")
    saved = rank_pools(2).run(_trainer_save, trainer_path)[0]
    for got, remainder in rank_pools(3).run(_fabric_load, trainer_path, 3):
        assert remainder["global_step"] == 6 and remainder["epoch"] == 1  # Lightning's own entries come back
        for key, value in saved.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)

    saved = rank_pools(2).run(_fabric_save_and_resume, fabric_path)[0][0]
    for got, epoch in rank_pools(3).run(_trainer_resume, fabric_path):
        assert epoch == 0  # Fabric keeps no loop state: weights and optimizers resume, the loops start afresh
        for key, value in saved.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


# ---------------------------------------------------------------- errors name the fix
def _misuse(case: str) -> None:
    if case == "foreign-strategy":
        lm.lightning_env(_rank(), 2)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        model = fabric.setup(lm.TwoTower())
        model(torch.tensor([1]), torch.tensor([[1, 2]]))
    fabric = _fabric(2)
    model, dense, sparse, _ = _setup(fabric, "SparseSGD", dict(lr=0.1))
    if case == "clip-sparse":
        fabric.clip_gradients(model, sparse, max_norm=1.0)
    if case == "two-modules":
        fabric.save("unused.ckpt", {"a": model, "b": model.mlp})


@pytest.mark.parametrize(
    "case, message",
    [
        ("foreign-strategy", "used under Fabric's DDPStrategy, which does not shard, step or save SparseEmbeddings. HINT"),
        ("clip-sparse", "HINT: pass the dense optimizer"),
        ("two-modules", "takes exactly one module in its state, got 2 (a, b). HINT"),
    ],
)
def test_misuse_raises_on_every_rank_naming_the_fix(rank_pools, case, message):
    for result in rank_pools(2).run_raw(_misuse, case, timeout=60):
        assert isinstance(result, RankError), result
        assert message in result.message


def test_a_loss_scale_is_refused_for_sparse_optimizers():
    """16-mixed (on a GPU; Fabric turns it into bf16-mixed on a CPU) scales the loss for dense optimizers only."""
    from lightning.fabric.plugins.precision import MixedPrecision

    strategy = ls.FabricSparseDDPStrategy(precision=MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu")))
    table = ls.SparseEmbedding(4, 2)
    strategy.setup_module(nn.ModuleDict({"table": table}))
    with pytest.raises(ValueError, match="HINT: use precision='bf16-mixed'"):
        strategy.setup_optimizer(ls.SparseSGD([table], lr=0.1))


def test_fabric_registry_holds_sparse_ddp():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    assert isinstance(STRATEGY_REGISTRY.get("sparse_ddp"), ls.FabricSparseDDPStrategy)


# ---------------------------------------------------------------- the example
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fabric_recommender.py"
SMALL = [
    "--num-users",
    "3000",
    "--num-items",
    "800",
    "--train-interactions",
    "6000",
    "--batch-size",
    "256",
    "--sparse-lr",
    "0.05",
]


def _arguments(tmp_path: Path, *args: str) -> list[str]:
    """The small run's command-line arguments, its checkpoint in ``tmp_path``."""
    return [*SMALL, "--checkpoint", str(tmp_path / "rec.ckpt"), *args]


def _example(tmp_path: Path, *args: str) -> str:
    """``python fabric_recommender.py`` (the small run) in a process of its own; what it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, str(EXAMPLE), *_arguments(tmp_path, *args)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert_clean_exit(result)
    return result.stdout


@pytest.mark.subprocesses
def test_fabric_example_trains_and_resumes_on_another_number_of_processes(rank_pools, tmp_path):
    """Launched as written (Fabric starts the second process), then resumed on the 3-rank pool (tests/example_runs.py).

    While the launched run imports and trains (a thread waits for it), the pool starts and its ranks run the example's
    start-up (``--epochs 0``: its imports, numba's kernels, the tables; no checkpoint): the resume then only resumes."""
    with ThreadPoolExecutor(max_workers=1) as launched:
        first_run = launched.submit(_example, tmp_path, "--devices", "2", "--epochs", "1")
        pool = rank_pools(3)
        pool.run(run_script, EXAMPLE, [*SMALL, "--devices", "3", "--epochs", "0"])
        first = first_run.result()
    resumed = pool.run(run_script, EXAMPLE, _arguments(tmp_path, "--devices", "3", "--epochs", "2", "--resume"))[0]
    assert "resumed from" in resumed and "at epoch 1 on 3 processes" in resumed
    aurocs = [float(x) for x in re.findall(r"val_auroc ([0-9.]+)", first + resumed)]
    assert len(aurocs) == 2 and aurocs[1] > aurocs[0] > 0.5, first + resumed
