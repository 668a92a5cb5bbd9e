"""Sharded checkpoints: resharding on load, export, crash safety, faults, size and memory."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from datetime import timedelta
from pathlib import Path

import hosts
import lightning.pytorch as pl
import lightning_models as lm
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from rank_pool import COLLECTIVE_TIMEOUT_S, RankError, RankPool, table_groups

import lightning_sparse as ls
from lightning_sparse import checkpoint
from lightning_sparse.__main__ import main as export_main
from lightning_sparse.checkpoint import files

MODULE = dict(sparse="mixed", dense="Adam", dense_lr=0.01, scheduler=False)


def _rank() -> int:
    return torch.distributed.get_rank()


def _everything(module: lm.TwoTower, trainer: pl.Trainer) -> dict:
    """Trained state as full tensors, comparable across world sizes. Collective."""
    out = lm.state(module)
    for index, optimizer in enumerate(trainer.optimizers):
        if isinstance(optimizer, ls.SparseOptimizer):
            for p_index, entry in optimizer.full_state_dict()["state"].items():
                for key, value in entry.items():
                    out[f"opt{index}.{p_index}.{key}"] = value
        else:
            for p_index, entry in optimizer.state_dict()["state"].items():
                for key, value in entry.items():
                    out[f"opt{index}.{p_index}.{key}"] = torch.as_tensor(value)
    out["global_step"] = torch.tensor(trainer.global_step)
    return out


def _strategy(group_size: int | None) -> ls.SparseDDPStrategy:
    """sparse_ddp, 2-D with groups of ``group_size`` ranks (whose collectives time out as the pool's do) or 1-D."""
    return ls.SparseDDPStrategy(sharding_group_size=group_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _save(world_size: int, directory: str, schemes: tuple[str, str], group_size: int | None = None) -> tuple[dict, str]:
    lm.lightning_env(_rank(), world_size)
    module = lm.TwoTower(**MODULE, schemes=schemes)
    trainer = lm.trainer(world_size, max_epochs=2, enable_checkpointing=True, default_root_dir=directory,
                         strategy=_strategy(group_size))  # fmt: skip
    trainer.fit(module)
    return _everything(module, trainer), trainer.checkpoint_callback.best_model_path


def _load(world_size: int, ckpt: str, schemes: tuple[str, str], group_size: int | None = None) -> dict:
    lm.lightning_env(_rank(), world_size)
    module = lm.TwoTower(**MODULE, schemes=schemes)
    # The checkpoint is at the end of epoch 2: nothing to train.
    trainer = lm.trainer(world_size, max_epochs=2, strategy=_strategy(group_size))
    trainer.fit(module, ckpt_path=ckpt)
    return _everything(module, trainer)


def _layout(on: int | tuple[int, int]) -> tuple[int, int | None]:
    """A layout is a world size, or (world size, sharding group size) for 2-D sharding."""
    return on if isinstance(on, tuple) else (on, None)


# Saved on a layout -> loaded on each of these, with these sharding schemes (saved with ("mod", "range")).
MOVES = {
    2: [(3, ("mod", "range")), (1, ("mod", "range")), (2, ("range", "mod")), ((4, 2), ("range", "mod"))],
    3: [(2, ("mod", "range"))],
    (4, 2): [(3, ("range", "mod"))],
}


@pytest.mark.parametrize("saved_on", list(MOVES), ids=str)
def test_checkpoint_reshards_on_load(rank_pools, tmp_path, saved_on):
    save_world, save_group = _layout(saved_on)
    (expected, ckpt), *_ = rank_pools(save_world).run(_save, save_world, str(tmp_path), ("mod", "range"), save_group)
    assert expected["global_step"] > 0 and "opt1.0.row_step" in expected and "opt2.0.sum" in expected
    for loaded_on, schemes in MOVES[saved_on]:
        load_world, load_group = _layout(loaded_on)
        for got in rank_pools(load_world).run(_load, load_world, ckpt, schemes, load_group):
            assert set(got) == set(expected)
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{saved_on} -> {loaded_on}: {key}")


def _save_adam_table(directory: str, group_size: int | None = None) -> str:
    with table_groups(group_size) as groups:
        table = ls.SparseEmbedding(30_000, 16, sharding="mod", **groups)
        optimizer = ls.SparseAdam([table])
        table(torch.arange(30_000)).sum().backward()
        optimizer.step()
        holder = torch.nn.Module()
        holder.table = table
        dense = {"optimizer_0": checkpoint.split_tensors(checkpoint.dense_optimizer_state(optimizer))[0]}
        return str(checkpoint.save(Path(directory) / "adam.ckpt", holder, {0: optimizer}, dense))


@pytest.mark.parametrize("world_size, group_size", [(3, None), (4, 2)])
def test_checkpoint_holds_each_row_once(rank_pools, tmp_path, world_size, group_size):
    """Also under 2-D sharding, where two ranks hold each row: DCP writes one copy."""
    ckpt = rank_pools(world_size).run(_save_adam_table, str(tmp_path), group_size)[0]
    on_disk = sum(f.stat().st_size for f in Path(ckpt).resolve().rglob("*.distcp"))
    logical = 30_000 * 16 * 4 * 3 + 30_000 * 8  # table, exp_avg, exp_avg_sq (float32), row_step (int64)
    assert logical <= on_disk < logical * 1.05 + 65_536  # each row once, not once per rank
    # checksums.json names the rows each rank's file holds (a damaged file is reported so): under 2-D sharding a
    # replica's file holds its position's block, within the table, as on 1-D sharding over the group.
    block = -(-30_000 // (group_size or world_size))
    for name, entry in files.read_checksums(Path(ckpt)).items():
        if name.startswith("rows/") and name.endswith(".distcp"):
            position = int(Path(name).name[2:].split("_")[0]) % (group_size or world_size)
            first, last = position * block, min(30_000, (position + 1) * block) - 1
            assert entry["holds"].startswith(f"rows {first}..{last} of "), (name, entry["holds"])


# ---------------------------------------------------------------- Lightning's ModelCheckpoint options
def _checkpoint_options(directory: str) -> dict:
    lm.lightning_env(_rank(), 2)
    callback = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True)
    epochs = ModelCheckpoint(dirpath=os.path.join(directory, "epochs"), every_n_epochs=1, save_top_k=-1)
    module = lm.TwoTower(**MODULE)
    trainer = lm.trainer(2, max_epochs=2, enable_checkpointing=True, callbacks=[callback, epochs])
    trainer.fit(module)
    final = lm.state(module)
    resumed, first = lm.TwoTower(**MODULE), lm.FirstStep()
    lm.trainer(2, max_epochs=2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=directory), first]).fit(
        resumed, ckpt_path="last"
    )
    fresh = lm.TwoTower(**MODULE)
    tester = lm.trainer(2)
    tester.validate(fresh, fresh.val_dataloader(), ckpt_path=str(Path(directory) / "last.ckpt"), verbose=False)
    validated = lm.state(fresh)
    tested = lm.TwoTower(**MODULE)
    tester.test(tested, tested.val_dataloader(), ckpt_path=str(Path(directory) / "last.ckpt"), verbose=False)
    validated_tested = lm.state(tested)
    predictions = tester.predict(
        fresh, torch.utils.data.DataLoader(lm.dataset(8), batch_size=4), ckpt_path=str(Path(directory) / "last.ckpt")
    )
    return {"final": final, "resumed": lm.state(resumed), "resumed_at": first.step, "validated": validated, "tested": validated_tested,
            "predicted": len(predictions),
            "files": sorted(p.name for p in Path(directory).iterdir() if not p.name.startswith("."))}  # fmt: skip


def test_model_checkpoint_options_and_ckpt_path_last(rank_pools, tmp_path):
    (result, _) = rank_pools(2).run(_checkpoint_options, str(tmp_path))
    # 12 steps; every 2 steps, keep the 2 latest by "step", plus last; every epoch in epochs/.
    assert result["files"] == ["epoch=1-step=10.ckpt", "epoch=1-step=12.ckpt", "epochs", "last.ckpt"]
    assert sorted(p.name for p in (tmp_path / "epochs").iterdir() if not p.name.startswith(".")) == [
        "epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt",
    ]  # fmt: skip
    assert result["resumed_at"] == 12  # "last" is the end of the fit: nothing left to train (a fresh fit ends equal too)
    for key, value in result["final"].items():
        torch.testing.assert_close(result["resumed"][key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(result["validated"][key], value, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(result["tested"][key], value, rtol=0, atol=0, msg=key)
    assert result["predicted"] == 1
    # Data directories of replaced or removed checkpoints are gone: one per remaining link.
    links = [p for p in tmp_path.iterdir() if p.is_symlink()]
    assert len(list(tmp_path.glob(checkpoint.DATA_PREFIX + "*"))) == len(links)


# ---------------------------------------------------------------- export and import
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, reading in this process
def test_export_round_trip(rank_pools, tmp_path, capsys, monkeypatch):
    (expected, ckpt), *_ = rank_pools(2).run(_save, 2, str(tmp_path), ("mod", "range"))
    out = tmp_path / "model.pt"
    monkeypatch.setattr(sys, "argv", ["python -m lightning_sparse", "export", ckpt, str(out)])
    monkeypatch.delitem(sys.modules, "lightning_sparse.__main__")  # imported above as export_main: runpy runs it afresh
    with pytest.raises(SystemExit) as exit_info:  # `python -m lightning_sparse export`, in this process (it has no group)
        runpy.run_module("lightning_sparse", run_name="__main__")
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "table  users.weight" in printed and f"[{lm.USERS}, {lm.DIM}]" in printed and "wrote" in printed
    state = torch.load(out, weights_only=True)
    users = torch.nn.Embedding(lm.USERS, lm.DIM)
    users.load_state_dict({"weight": state["users.weight"]})
    torch.testing.assert_close(users.weight.detach(), expected["users"], rtol=0, atol=0)
    torch.testing.assert_close(state["mlp.0.weight"], expected["0.weight"], rtol=0, atol=0)
    # And back: a table initialized from the exported file, each rank reading only its rows.
    table = ls.SparseEmbedding(lm.USERS, lm.DIM, init=ls.init.from_file(str(out), key="users.weight"))
    torch.testing.assert_close(table.full_weight(), expected["users"], rtol=0, atol=0)


def _use_exported(path: str, world_size: int) -> dict:
    lm.lightning_env(_rank(), world_size)
    exported = torch.load(path, weights_only=True)
    tester = lm.trainer(world_size, limit_val_batches=None)
    results = {}
    for stage in ("validate", "test"):
        module = lm.TwoTower(**MODULE)
        getattr(tester, stage)(module, module.val_dataloader(), ckpt_path=path, verbose=False)
        results[stage] = lm.state(module)
    module = lm.TwoTower(**MODULE)
    index = torch.arange(8)
    data = lm.dataset(8)
    tester.predict(
        module,
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.tensors[0], data.tensors[1], index), batch_size=4),
        ckpt_path=path,
    )
    results["predict"] = lm.state(module)
    # fit from the exported weights (weights only) = fit of a module that loaded them itself
    fitted, reference = lm.TwoTower(**MODULE), lm.TwoTower(**MODULE)
    lm.trainer(world_size, max_epochs=1).fit(fitted, ckpt_path=path)
    reference.load_state_dict(exported)
    lm.trainer(world_size, max_epochs=1).fit(reference)
    results["fit"], results["fit_reference"] = lm.state(fitted), lm.state(reference)
    results["exported"] = exported
    return results


def _garbage_ckpt_path(path: str) -> str:
    lm.lightning_env(_rank(), 2)
    module = lm.TwoTower(**MODULE)
    lm.trainer(2, limit_val_batches=None).validate(module, module.val_dataloader(), ckpt_path=path, verbose=False)
    return "loaded"


def test_exported_file_loads_through_ckpt_path_on_another_world_size(rank_pools, tmp_path):
    (expected, ckpt), *_ = rank_pools(2).run(_save, 2, str(tmp_path), ("mod", "range"))
    out = tmp_path / "model.pt"
    assert export_main(["export", ckpt, str(out)]) == 0  # test_export_round_trip runs it as `python -m` does
    for got in rank_pools(3).run(_use_exported, str(out), 3):
        exported = got["exported"]
        for stage in ("validate", "test", "predict"):
            torch.testing.assert_close(got[stage]["users"], exported["users.weight"], rtol=0, atol=0)
            torch.testing.assert_close(got[stage]["items"], exported["items.weight"], rtol=0, atol=0)
            torch.testing.assert_close(got[stage]["0.weight"], exported["mlp.0.weight"], rtol=0, atol=0)
        for key, value in got["fit_reference"].items():
            torch.testing.assert_close(got["fit"][key], value, rtol=0, atol=0, msg=key)
        assert not torch.equal(got["fit"]["users"], exported["users.weight"])  # it trained
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    for result in rank_pools(2).run_raw(_garbage_ckpt_path, str(garbage)):
        assert isinstance(result, RankError)
        assert str(garbage) in result.message and "HINT" in result.message
    no_weights = tmp_path / "no_weights.ckpt"  # Lightning's file without weights: refused, not evaluated with the weights at hand
    torch.save({"pytorch-lightning_version": pl.__version__, "epoch": 0}, no_weights)
    for result in rank_pools(2).run_raw(_garbage_ckpt_path, str(no_weights)):
        assert isinstance(result, RankError), result
        assert "The checkpoint to restore has no 'state_dict'" in result.message, result.message
        assert "HINT: pass a checkpoint written by Trainer(strategy='sparse_ddp')" in result.message


def _init_from_tensor(full: torch.Tensor, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    a = ls.SparseEmbedding(*full.shape, init=ls.init.from_tensor(full))
    b = ls.SparseEmbedding(*full.shape, init=ls.init.from_file(path), sharding="range")
    return a.full_weight(), b.full_weight()


def test_init_from_full_tensor_and_numpy_file(rank_pools, tmp_path):
    import numpy as np

    full = torch.randn(11, 3)
    np.save(tmp_path / "table.npy", full.numpy())
    for a, b in rank_pools(3).run(_init_from_tensor, full, str(tmp_path / "table.npy")):
        torch.testing.assert_close(a, full, rtol=0, atol=0)
        torch.testing.assert_close(b, full, rtol=0, atol=0)


# ---------------------------------------------------------------- broken checkpoints
def _load_expect_error(ckpt: str, users: int, sparse: str = MODULE["sparse"]) -> str:
    lm.lightning_env(_rank(), 2)
    module = lm.TwoTower(**{**MODULE, "sparse": sparse})
    if users != lm.USERS:
        module.users = ls.SparseEmbedding(users, lm.DIM, seed=1)
    lm.trainer(2, max_epochs=2).fit(module, ckpt_path=ckpt)
    return "loaded"


def test_truncated_or_mismatched_checkpoint_fails_clearly(rank_pools, tmp_path):
    (_, ckpt), *_ = rank_pools(2).run(_save, 2, str(tmp_path), ("mod", "range"))
    for result in rank_pools(2).run_raw(_load_expect_error, ckpt, lm.USERS + 1):
        assert isinstance(result, RankError)
        assert f"table users has shape ({lm.USERS}, {lm.DIM}) in checkpoint {ckpt}" in result.message
        assert "HINT" in result.message
    # saved with a dense and two sparse optimizers, resumed with one sparse optimizer: none is loaded into another's state
    for result in rank_pools(2).run_raw(_load_expect_error, ckpt, lm.USERS, "SparseAdam"):
        assert isinstance(result, RankError)
        assert f"Checkpoint {ckpt} holds 3 optimizer states but the module has 2 optimizers" in result.message, result.message
        assert "HINT: resume with the same configure_optimizers and configure_sparse_optimizers" in result.message
    shard_file = Path(ckpt) / "rows" / "state_dict.users.weight" / "part-0" / "__1_0.distcp"
    with open(shard_file, "r+b") as f:
        f.truncate(16)  # keeps nothing of the rows this file held
    for result in rank_pools(2).run_raw(_load_expect_error, ckpt, lm.USERS):
        assert isinstance(result, RankError)
        assert f"Checkpoint {ckpt} is damaged: {shard_file}" in result.message, result.message
        assert "table users" in result.message and "16 bytes" in result.message and "HINT" in result.message


def _flip(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of a file (its data, not only its header)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "key, holds",
    [
        ("state_dict.users.weight", "rows {rows} of table users"),
        ("optimizer_1.state.0.exp_avg", "rows {rows} of optimizer state 'exp_avg' of table users"),
    ],
    ids=["table", "optimizer-state"],
)
def test_flipped_bytes_are_caught_on_load_and_export(rank_pools, tmp_path, key, holds):
    (_, ckpt), *_ = rank_pools(2).run(_save, 2, str(tmp_path), ("mod", "range"))
    damaged = Path(ckpt) / "rows" / key / "part-0" / "__1_0.distcp"
    _flip(damaged)
    rows = f"{-(-lm.USERS // 2)}..{lm.USERS - 1}"  # rank 1's block of the one band
    for result in rank_pools(2).run_raw(_load_expect_error, ckpt, lm.USERS):
        assert isinstance(result, RankError)
        assert f"Checkpoint {ckpt} is damaged: {damaged} ({holds.format(rows=rows)}" in result.message, result.message
    with pytest.raises(RuntimeError, match=f"is damaged: {damaged}"):  # the export command, in this process
        export_main(["export", ckpt, str(tmp_path / "out.pt")])
    assert not (tmp_path / "out.pt").exists()


def test_a_damaged_meta_file_is_named_without_unsafe_advice(rank_pools, tmp_path):
    """Also a meta file holding an object that only unsafe unpickling makes: ``fit(ckpt_path=...)`` loads with
    ``weights_only=True`` unless told otherwise, so it refuses the file instead of running its pickle."""
    from fractions import Fraction

    (_, ckpt), *_ = rank_pools(2).run(_save, 2, str(tmp_path), ("mod", "range"))
    meta = Path(ckpt) / checkpoint.METADATA_FILE
    torch.save({**checkpoint.load_meta(ckpt), "planted": Fraction(1, 3)}, meta)
    entries = files.read_checksums(Path(ckpt))  # a planted file, not a damaged one: its checksum matches
    entries[checkpoint.METADATA_FILE].update(zip(("crc32", "bytes"), files.crc32(meta)))
    files.write_checksums(Path(ckpt), entries)
    for result in rank_pools(2).run_raw(_load_expect_error, ckpt, lm.USERS):
        assert isinstance(result, RankError), "a meta file that needs unsafe unpickling was loaded"
        assert f"{meta} of checkpoint {ckpt} cannot be read" in result.message, result.message
    meta.write_bytes(b"garbage" * 100)
    for result in rank_pools(2).run_raw(_load_expect_error, ckpt, lm.USERS):
        assert isinstance(result, RankError)
        assert f"is damaged: {meta}" in result.message and "weights_only=False" not in result.message
    with pytest.raises(RuntimeError, match="meta.pt of checkpoint .* cannot be read .* HINT: the file is damaged") as err:
        checkpoint.load_meta(ckpt)
    assert "weights_only=False" not in str(err.value)


# ---------------------------------------------------------------- crashes
class KillAt(pl.Callback):
    """SIGKILL this process at a given global step (on one rank), or in the middle of the next save."""

    def __init__(self, rank: int, step: int, during_save: bool = False) -> None:
        self.rank, self.step, self.during_save = rank, step, during_save

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if not self.during_save:
            os.kill(os.getpid(), signal.SIGKILL)

        def save_then_die(*args, **kwargs):  # the other rank is writing its chunks: die half-way
            os.kill(os.getpid(), signal.SIGKILL)

        dcp.save = save_then_die  # torch.distributed.checkpoint.save, as the checkpoint writer calls it


def _fit_until(directory: str, max_epochs: int, kill: tuple[int, int, bool] | None, ckpt_path: str | None) -> tuple:
    """(The tables and dense weights after the fit, the global step it started from.)"""
    from datetime import timedelta

    lm.lightning_env(_rank(), 2)
    module = lm.TwoTower(**MODULE)
    # Epoch-end checkpoints: resuming mid-epoch replays the epoch unless the DataLoader is stateful.
    first = lm.FirstStep()
    callbacks = [ModelCheckpoint(dirpath=directory, save_top_k=-1, save_last=True), first]
    if kill is not None:
        callbacks.append(KillAt(*kill))
    strategy = ls.SparseDDPStrategy(timeout=timedelta(seconds=20))
    lm.trainer(2, max_epochs=max_epochs, enable_checkpointing=True, callbacks=callbacks, strategy=strategy).fit(
        module, ckpt_path=ckpt_path
    )
    return lm.state(module), first.step


@pytest.mark.timeout(300)
# A rank killed between saves: tests/test_hosts.py kills a whole host mid-fit and resumes, where it may build hosts.
@pytest.mark.parametrize("during_save", [True] + ([False] if hosts.skip_reason() else []))
def test_killed_rank_stops_the_others_and_resume_matches_uninterrupted_run(rank_pools, tmp_path, during_save):
    straight, _ = rank_pools(2).run(_fit_until, str(tmp_path / "straight"), 2, None, None)[0]
    crashed = RankPool(2)
    try:
        # 6 steps an epoch; rank 1 dies in epoch 1 at step 9, or while writing the step-12 checkpoint.
        results = crashed.run_raw(
            _fit_until, str(tmp_path / "run"), 2, (1, 12 if during_save else 9, during_save), None, timeout=120
        )
    finally:
        crashed.close()
    survivor = results[0]
    assert isinstance(survivor, RankError), "rank 0 must stop with an error"
    assert survivor.type == "PeerFailure" and "HINT: " in survivor.message, survivor.message
    assert isinstance(results[1], RankError) and results[1].type == "ProcessDied"
    last = tmp_path / "run" / "last.ckpt"
    assert checkpoint.is_sharded(last)  # intact and complete: the epoch-0 checkpoint
    assert checkpoint.load_meta(last)["global_step"] == 6
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == [
        "epoch=0-step=6.ckpt",
        "last.ckpt",
    ]
    resumed = rank_pools(2).run(_fit_until, str(tmp_path / "run"), 2, None, "last")
    for got, first_step in resumed:
        assert first_step == 6, "the fit did not resume from last.ckpt"
        for key, value in straight.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


# ---------------------------------------------------------------- memory
ROWS, DIM = 3_000_000, 16  # 192 MB in all, 64 MB per rank on 3 ranks


def _adam_module(init=None) -> tuple[torch.nn.Module, ls.SparseAdam]:
    module = torch.nn.Module()
    module.table = ls.SparseEmbedding(ROWS, DIM, init=init)  # "mod": rows move to row blocks and back
    optimizer = ls.SparseAdam([module.table])
    return module, optimizer


def _peak_while_saving_and_loading(directory: str) -> tuple[int, int, int]:
    """Peak extra resident memory of saving and of loading a table with SparseAdam's state (3 shards and row_step)."""
    module, optimizer = _adam_module()
    module.table(torch.arange(torch.distributed.get_rank(), ROWS, 7)).sum().backward()
    optimizer.step()  # some rows with state, so that nothing is all zero
    shard_bytes = module.table.shard.numel() * 4
    small, small_opt = torch.nn.Module(), None
    small.t = ls.SparseEmbedding(10, 2)
    small_opt = ls.SparseAdam([small.t])
    checkpoint.save(Path(directory) / "warm.ckpt", small, {0: small_opt})  # warm up the code path on a tiny table
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size
    before = _rss("VmRSS")
    dense = {"optimizer_0": checkpoint.split_tensors(checkpoint.dense_optimizer_state(optimizer))[0]}
    checkpoint.save(Path(directory) / "big.ckpt", module, {0: optimizer}, dense)
    saving = _rss("VmHWM") - before
    target, target_opt = _adam_module(init=ls.init.zeros())
    for value in target_opt.state[target.table.shard].values():
        value.fill_(1)  # resident, as trained state is (fresh zeros are mapped lazily)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    checkpoint.load_module(Path(directory) / "big.ckpt", target)
    checkpoint.load_sparse_optimizer(Path(directory) / "big.ckpt", 0, target_opt, target_opt.state_dict()["param_groups"])
    loading = _rss("VmHWM") - before
    assert torch.equal(target.table.shard, module.table.shard)
    for key, value in optimizer.state[module.table.shard].items():
        assert torch.equal(target_opt.state[target.table.shard][key], value), key
    return saving, loading, shard_bytes


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def test_saving_and_loading_with_adam_state_stays_below_two_extra_shards(rank_pools, tmp_path):
    """A 3M-row "mod" table with SparseAdam's exp_avg, exp_avg_sq and row_step on 3 ranks: about 3 shards held.

    Then its export, in this process: memory of about one band, not of the table (checkpoints.md)."""
    for saving, loading, shard in rank_pools(3).run(_peak_while_saving_and_loading, str(tmp_path)):
        assert saving < 2 * shard, f"saving took {saving / 2**20:.0f} MiB over a {shard / 2**20:.0f} MiB shard"
        assert loading < 2 * shard, f"loading took {loading / 2**20:.0f} MiB over a {shard / 2**20:.0f} MiB shard"
    big = tmp_path / "big.ckpt"
    stored = checkpoint.load_meta(big)["row_tensors"]["state_dict.table.weight"]
    band = stored["part_rows"] * DIM * 4
    assert stored["parts"] >= 8, "the table must span several bands"
    exporting = _peak_anonymous_growth(lambda: checkpoint.export(big, tmp_path / "exported.pt"))
    assert exporting < 3 * band, f"exporting took {exporting / 2**20:.0f} MiB over a {band / 2**20:.0f} MiB band"
    exported = torch.load(tmp_path / "exported.pt", weights_only=True, mmap=True)["table.weight"]
    assert exported.shape == (ROWS, DIM) and exported.abs().sum() > 0


def _peak_anonymous_growth(run) -> int:
    """How far this process's anonymous resident memory (not file pages: an export writes into a memory-mapped file)
    grew above its level before ``run()``, sampled every millisecond while it runs."""
    import threading
    import time

    def anonymous() -> int:
        return _rss("RssAnon")

    before, peak, done = anonymous(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], anonymous()) - before


# ---------------------------------------------------------------- meta.pt once, with the caller's weights_only
class _Opaque:
    """Not loadable with weights_only=True (a user's callback state, say)."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_meta_is_read_once_per_load_with_the_callers_weights_only(tmp_path, monkeypatch):
    module = torch.nn.ModuleDict({"a": ls.SparseEmbedding(7, 3, seed=1), "b": ls.SparseEmbedding(5, 2, seed=2)})
    optimizer = ls.SparseAdam(list(module.values()), lr=0.1)
    module["a"](torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt"
    counters, _ = checkpoint.split_tensors(checkpoint.dense_optimizer_state(optimizer))
    checkpoint.save(path, module, {0: optimizer}, {"optimizer_0": counters}, {"callback": _Opaque(3)})
    weights = {name: table.full_weight() for name, table in module.items()}
    state = optimizer.full_state_dict()

    reads = []
    real_load = torch.load

    def counting_load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and Path(f).name == checkpoint.METADATA_FILE:
            reads.append(kwargs.get("weights_only"))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    fresh = torch.nn.ModuleDict({"a": ls.SparseEmbedding(7, 3, seed=8), "b": ls.SparseEmbedding(5, 2, seed=9)})
    fresh_optimizer = ls.SparseAdam(list(fresh.values()), lr=0.1)
    meta = checkpoint.load_meta(path, weights_only=False)
    checkpoint.load_module(path, fresh, meta=meta)
    checkpoint.load_sparse_optimizer(path, 0, fresh_optimizer, optimizer.state_dict()["param_groups"], meta)
    assert reads == [False], reads
    assert meta["callback"].value == 3
    for name, table in fresh.items():
        torch.testing.assert_close(table.full_weight(), weights[name], rtol=0, atol=0)
    for index, entry in fresh_optimizer.full_state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(value, state["state"][index][key], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="cannot be read"):  # the default stays weights_only=True
        checkpoint.load_module(path, fresh)


def test_export_of_a_path_that_is_not_a_sharded_checkpoint_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "plain.pt").write_bytes(b"not a checkpoint")
    for target in (tmp_path / "plain.pt", tmp_path / "missing"):
        with pytest.raises(SystemExit) as exit_info:
            export_main(["export", str(target), str(tmp_path / "out.pt")])
        assert exit_info.value.code == 2
        assert f"{target} is not a sharded checkpoint (no .metadata inside)" in capsys.readouterr().err


def test_saves_of_other_names_in_one_folder_never_touch_each_other(tmp_path):
    """Two jobs saving into one folder: one's save in progress survives the other's finished save."""
    from lightning_sparse.checkpoint.files import new_data_directory

    module = torch.nn.ModuleDict({"a": ls.SparseEmbedding(7, 3, seed=1)})
    in_progress = new_data_directory(tmp_path / "other-job.ckpt")  # another job's save, not linked yet
    (in_progress / "rows").mkdir()
    killed = new_data_directory(tmp_path / "mine.ckpt")  # a killed save of this name: this name's next save removes it
    checkpoint.save(tmp_path / "mine.ckpt", module)
    checkpoint.save(tmp_path / "mine.ckpt", module)  # replaces the first save, which goes too
    assert in_progress.is_dir() and (in_progress / "rows").is_dir()
    assert not killed.exists()
    data = sorted(p.name for p in tmp_path.glob(checkpoint.DATA_PREFIX + "*"))
    assert data == sorted([in_progress.name, os.readlink(tmp_path / "mine.ckpt")])


# ---------------------------------------------------------------- the checkpoint module's functions, in one process
def _small_checkpoint(path: Path) -> tuple[Path, torch.nn.Module, ls.SparseAdam]:
    """A table (trained one step with SparseAdam) beside a dense head, saved as the Trainer lays a checkpoint out."""
    module = torch.nn.Module()
    module.table, module.head = ls.SparseEmbedding(9, 3, seed=1), torch.nn.Linear(3, 1)
    optimizer = ls.SparseAdam([module.table], lr=0.1)
    module.table(torch.tensor([1, 4, 4])).sum().backward()
    optimizer.step()
    dense = {"state_dict": checkpoint.split_tensors(checkpoint.dense_module_state(module))[0],
             "optimizer_0": checkpoint.split_tensors(checkpoint.dense_optimizer_state(optimizer))[0]}  # fmt: skip
    return checkpoint.save(path, module, {0: optimizer}, dense), module, optimizer


def test_dense_module_state_verify_load_tensors_load_file_and_remove(tmp_path):
    path, module, optimizer = _small_checkpoint(tmp_path / "small.ckpt")
    # dense_module_state: the module's state without its tables
    assert set(checkpoint.dense_module_state(module)) == {"head.weight", "head.bias"}
    assert any(key.startswith("table.") for key in module.state_dict())
    # verify: every file against its checksum
    checkpoint.verify(path)
    # load_tensors: the dense tensors, into tensors nested as they were saved
    tensors = {"state_dict": {"head.weight": torch.zeros(1, 3), "head.bias": torch.zeros(1)},
               "optimizer_0": {"state": {0: {"step": torch.zeros((), dtype=torch.int64)}}}}  # fmt: skip
    checkpoint.load_tensors(path, tensors, "the head and the step counter")
    torch.testing.assert_close(tensors["state_dict"]["head.weight"], module.head.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(tensors["state_dict"]["head.bias"], module.head.bias.detach(), rtol=0, atol=0)
    assert int(tensors["optimizer_0"]["state"][0]["step"]) == int(optimizer.state[module.table.shard]["step"]) == 1
    # load_file: an export, and a Lightning checkpoint of one file
    checkpoint.export(path, tmp_path / "exported.pt")
    kind, state = checkpoint.load_file(tmp_path / "exported.pt")
    assert kind == "export" and set(state) == {"table.weight", "head.weight", "head.bias"}
    torch.testing.assert_close(state["table.weight"], module.table.full_weight(), rtol=0, atol=0)
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": state, "epoch": 3}, tmp_path / "lightning.ckpt")
    kind, loaded = checkpoint.load_file(tmp_path / "lightning.ckpt")
    assert kind == "lightning" and loaded["epoch"] == 3
    # verify names a damaged file
    damaged = Path(path) / "rows" / "state_dict.table.weight" / "part-0" / "__0_0.distcp"
    _flip(damaged, count=8)
    with pytest.raises(RuntimeError, match=f"Checkpoint {path} is damaged: {damaged} .*HINT: restore the file"):
        checkpoint.verify(path)
    # remove: the link and its data directory, nothing of another checkpoint in the folder
    other, _, _ = _small_checkpoint(tmp_path / "other.ckpt")
    data = Path(path).resolve()
    checkpoint.remove(path)
    assert not Path(path).exists() and not Path(path).is_symlink() and not data.exists()
    checkpoint.verify(other)
    assert sorted(p.name for p in tmp_path.glob(checkpoint.DATA_PREFIX + "*")) == [os.readlink(other)]
