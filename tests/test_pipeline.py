"""Pipelined lookups (``ls.pipelined``): the next batch's ids go to their owners while this batch trains.

Each test trains the same model twice on the same batches, unpipelined and pipelined, and compares the
tables' weights and the optimizer's state bitwise; the pipelined run also records, at every optimizer
step, how many batches were sent ahead and how many lookups took a round sent ahead, so a pipeline that
silently fell back to unpipelined lookups fails.
"""

from __future__ import annotations

import re
from datetime import timedelta

import lightning.pytorch as pl
import lightning_models as lm
import pytest
import torch
import torch.distributed as dist
from rank_pool import COLLECTIVE_TIMEOUT_S, DEVICES

import lightning_sparse as ls

TIMEOUT = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
STEPS, ACCUMULATED = 5, 1  # batches; the one whose gradient is accumulated with the next's


def _batches(rank: int, rows: int, sizes: list[int], seed: int = 0, device: str = "cpu") -> list[dict]:
    """Each rank's batches: ids (their number varies, so rounds overflow the agreed room now and then) and weights."""
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    out = []
    for size in sizes:
        ids = torch.randint(0, rows, (size,), generator=g)
        features = {"user": ids, "item": torch.randint(0, rows // 2, (size, 2), generator=g)}
        batch = {"ids": ids, "features": features, "w": torch.randn(size, 4, generator=g)}
        out.append(
            {"ids": ids.to(device), "features": {k: v.to(device) for k, v in features.items()}, "w": batch["w"].to(device)}
        )
    return out


def _state(opt: ls.SparseOptimizer) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _train(unit_kind: str, pipeline: bool, sizes: list[int], bad: tuple[int, int] | None = None, device: str = "cpu"):
    """Train a table (``"table"``) or a collection (``"collection"``) on this rank's batches; see the module docstring."""
    rank = dist.get_rank()
    batches = _batches(rank, 40, sizes, device=device)
    if bad is not None and rank == bad[0]:
        batches[bad[1]]["ids"][0] = 40  # out of range on one rank, in a batch sent ahead
    if unit_kind == "table":
        unit = ls.SparseEmbedding(40, 4, seed=3, device=device)
        opt = ls.SparseAdagrad([unit], lr=0.5)
        inputs, look = (lambda b: {unit: b["ids"]}), (lambda b: unit(b["ids"]))
    else:
        tables = {"u": ls.SparseEmbedding(40, 4, seed=3, device=device), "i": ls.SparseEmbedding(20, 4, seed=4, device=device)}
        unit = ls.SparseEmbeddingCollection(tables, features={"user": "u", "item": "i"}, pooling={"item": "sum"})
        opt = ls.SparseAdam([unit], lr=0.5)
        inputs = lambda b: {unit: b["features"]}  # noqa: E731
        look = lambda b: sum(unit(b["features"]).values())  # noqa: E731  (user rows + item bags, [size, 4] each)
    pipe = ls.Pipeline(inputs, timeout=TIMEOUT) if pipeline else None
    seen = []
    for n, batch in enumerate(pipe.iterate(batches) if pipe else batches):
        (look(batch) * batch["w"]).sum().backward()
        if n == ACCUMULATED:  # its gradient waits for the next batch's: that batch's round is not the step's sole lookup
            continue
        seen.append((pipe.issued, unit.stats.rounds_ahead) if pipe else None)
        opt.step()
        opt.zero_grad()
    weights = [unit.full_weight()] if unit_kind == "table" else [t.full_weight() for t in unit.tables.values()]
    return [w.cpu() for w in weights], [v.cpu() for v in _state(opt)], seen


@pytest.mark.parametrize("device", DEVICES)  # CUDA: the ranks share the GPUs they have (on one GPU: over gloo)
@pytest.mark.parametrize("unit_kind", ["table", "collection"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_plain_loop_pipelined_trains_bitwise_as_unpipelined(rank_pools, world_size, unit_kind, device):
    sizes = [6, 30, 3, 50, 8][:STEPS]
    unpipelined = rank_pools(world_size, device).run(_train, unit_kind, False, sizes, None, device)
    pipelined = rank_pools(world_size, device).run(_train, unit_kind, True, sizes, None, device)
    for (weights, state, _), (p_weights, p_state, seen) in zip(unpipelined, pipelined):
        assert len(weights) == len(p_weights) and all(torch.equal(a, b) for a, b in zip(weights, p_weights))
        assert len(state) == len(p_state) and all(torch.equal(a, b) for a, b in zip(state, p_state))
        # At step n's optimizer step, batch n + 1 was sent ahead, and every lookup so far took its round ahead.
        assert seen == [(min(n + 2, STEPS), n + 1) for n in range(STEPS) if n != ACCUMULATED]


def _bad_ids_ahead(world_size: int):
    """Batch 2 holds an id out of range on the last rank; it was sent ahead while batch 1 trained."""
    try:
        _train("table", True, [4, 5, 6, 7], bad=(world_size - 1, 2))
    except IndexError as err:
        caught = str(err)
    else:
        caught = None
    after = _train("table", True, [3, 4, 5])  # the groups stay usable, the ahead group too
    return caught, after[2]


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_ids_in_a_batch_sent_ahead_raise_at_its_lookup_on_every_rank(rank_pools, world_size):
    for rank, (caught, seen_after) in enumerate(rank_pools(world_size).run(_bad_ids_ahead, world_size)):
        where = "this rank" if rank == world_size - 1 else f"rank {world_size - 1}"
        assert caught is not None and f"got id 40 on {where}" in caught and "HINT" in caught, caught
        assert seen_after == [(2, 1), (3, 3)]  # batch 1 accumulates with batch 2


def _unmatched_lookups(pipelined: bool) -> tuple[int, list[bool], torch.Tensor]:
    """The model looks up a copy of each batch's ids: it takes no round sent ahead (each goes unpipelined). Returns the
    rounds taken ahead, which batches were freed at the end, and the trained table."""
    import gc
    import weakref

    table = ls.SparseEmbedding(40, 4, seed=3)
    opt = ls.SparseAdagrad([table], lr=0.5)
    refs = []

    def batches():
        for n in range(6):
            ids = torch.arange(n, n + 5 * (dist.get_rank() + 1))
            refs.append(weakref.ref(ids))
            yield {"ids": ids}

    loader = ls.Pipeline(lambda b: {table: b["ids"]}, timeout=TIMEOUT).iterate(batches()) if pipelined else batches()
    for batch in loader:
        table(batch["ids"].clone()).sum().backward()
        opt.step()
        opt.zero_grad()
    del batch, loader
    gc.collect()
    return table.stats.rounds_ahead, [ref() is None for ref in refs], table.full_weight()


def test_rounds_sent_ahead_that_no_lookup_takes_are_dropped(rank_pools):
    """No batch outlives its loop in the pipeline but the last two's rounds (a round is kept for the batch in training and
    the next), and training is that of the plain loop."""
    for (taken, freed, weights), (_, plain_freed, plain_weights) in zip(
        rank_pools(2).run(_unmatched_lookups, True), rank_pools(2).run(_unmatched_lookups, False)
    ):
        assert taken == 0 and torch.equal(weights, plain_weights)
        assert freed[:-2] == plain_freed[:-2] and sum(plain_freed[:-2]) >= 3, (freed, plain_freed)


def _dynamic_ahead():
    """A DynamicEmbedding, alone and in a collection beside a SparseEmbedding: either unit is refused."""
    table = ls.DynamicEmbedding(16, 4, seed=1)
    mixed = ls.SparseEmbeddingCollection({"d": ls.DynamicEmbedding(16, 4, seed=1), "s": ls.SparseEmbedding(8, 4, seed=2)})
    for unit, ids in ((table, torch.tensor([5])), (mixed, {"d": torch.tensor([5]), "s": torch.tensor([1])})):
        with pytest.raises(ValueError, match="DynamicEmbedding.*HINT: leave it out"):
            next(iter(ls.pipelined([{"ids": ids}], inputs=lambda b, unit=unit: {unit: b["ids"]})))
    return True


def test_a_dynamic_table_is_refused_on_every_rank(rank_pools):
    assert rank_pools(2).run(_dynamic_ahead) == [True, True]


def _fabric_runs(world_size: int):
    """Test_fabric.py's model and shuffled loader, two epochs accumulating 2 batches a step, unpipelined and with the
    users' ids sent ahead (the items are looked up in slices that the forward makes: those go unpipelined)."""
    from test_fabric import _fabric, _setup

    fabric = _fabric(world_size)
    runs = []
    for pipeline in (False, True):
        model, dense, sparse, plain_loader = _setup(fabric, "SparseAdam", dict(lr=0.05))
        loader = fabric.setup_dataloaders(plain_loader, use_distributed_sampler=False)  # moves each batch as it yields it
        users, seen, looked_up = model.module.users, [], 0
        for epoch in range(2):
            plain_loader.sampler.set_epoch(epoch)
            batches = fabric.strategy.pipelined(loader, inputs=lambda b, users=users: {users: b[0]}) if pipeline else loader
            for index, (user_ids, items, target) in enumerate(batches):
                stepping, looked_up = index % 2 == 1, looked_up + 1
                with fabric.no_backward_sync(model, enabled=not stepping):
                    fabric.backward(torch.nn.functional.mse_loss(model(user_ids, items), target) / 2)
                if stepping:
                    seen.append((users.stats.rounds_ahead, looked_up))
                    dense.step(), sparse.step(), dense.zero_grad(), sparse.zero_grad()
        runs.append((lm.state(model.module), _state(sparse), seen))
    return runs


def _assert_bitwise(state, opt_state, p_state, p_opt_state) -> None:
    """The module's tensors and the sparse optimizer's state of the unpipelined run equal the pipelined run's, bit for bit."""
    assert state.keys() == p_state.keys() and all(torch.equal(state[k], p_state[k]) for k in state)
    assert len(opt_state) == len(p_opt_state) > 0 and all(torch.equal(a, b) for a, b in zip(opt_state, p_opt_state))


@pytest.mark.parametrize("world_size", [2, 3])
def test_fabric_pipelined_trains_bitwise_as_unpipelined(rank_pools, world_size):
    for (state, opt_state, _), (p_state, p_opt_state, seen) in rank_pools(world_size).run(_fabric_runs, world_size):
        _assert_bitwise(state, opt_state, p_state, p_opt_state)
        assert len(seen) > 2 and all(ahead == looked_up for ahead, looked_up in seen)  # every users lookup took its round ahead


class _Record(pl.Callback):
    """At each optimizer step: batches sent ahead so far, and the users lookups that took their round ahead."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.seen.append(
            (trainer.strategy._pipeline.issued if trainer.strategy._pipeline else 0, module.users.stats.rounds_ahead)
        )


def _trainer_runs(world_size: int):
    """Two epochs of TwoTower under the Trainer (its shuffled DistributedSampler, validation every 3 batches), unpipelined,
    then with the users' ids sent ahead."""
    lm.lightning_env(dist.get_rank(), world_size)
    runs = []
    for pipeline in (False, True):
        module, record = lm.TwoTower(sparse="SparseAdam", sparse_kwargs=dict(lr=0.05)), _Record()
        inputs = (lambda batch, users=module.users: {users: batch[0]}) if pipeline else None
        trainer = lm.trainer(world_size, strategy=ls.SparseDDPStrategy(pipeline=inputs, timeout=TIMEOUT), max_epochs=2,
                             callbacks=[record], limit_val_batches=2, val_check_interval=3)  # fmt: skip
        trainer.fit(module)
        runs.append((lm.state(module), _state(trainer.strategy.sparse_optimizers[0]), record.seen))
    return runs


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_trainer_pipelined_trains_bitwise_as_unpipelined(rank_pools, world_size):
    for (state, opt_state, _), (p_state, p_opt_state, seen) in rank_pools(world_size).run(_trainer_runs, world_size):
        _assert_bitwise(state, opt_state, p_state, p_opt_state)
        # Each epoch's first batch goes unpipelined and sends the second ahead; at each step the next batch was sent
        # ahead (but at an epoch's last batch), and every users lookup after the first of its epoch took its round.
        ahead_of_step = [issued - taken for issued, taken in seen]
        assert ahead_of_step.count(0) == 2 and set(ahead_of_step) == {0, 1} and ahead_of_step[-1] == 0, seen
        assert seen[-1] == (len(seen) - 2, len(seen) - 2), seen


def _guide_example() -> int:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "pipelining.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "ls.pipelined(loader" in b]
    namespace: dict = {}
    exec(block, namespace)
    return namespace["emb"].stats.rounds_ahead


def test_the_guides_plain_loop_runs_and_every_lookup_takes_its_round_ahead(rank_pools):
    assert rank_pools(2).run(_guide_example) == [8, 8]


def _rounds_not_taken(pipeline: bool):
    """Two passes over the same batches: the first looks up copies of the ids (so no round sent ahead is taken, and
    each is dropped), the second the ids themselves. Returns the weights, and the rounds taken after each pass."""
    batches = _batches(dist.get_rank(), 40, [5, 9, 4, 12])
    emb = ls.SparseEmbedding(40, 4, seed=3)
    opt = ls.SparseSGD([emb], lr=0.5)
    taken = []
    for copy in (True, False):
        pipe = ls.Pipeline(lambda b: {emb: b["ids"]}, timeout=TIMEOUT)
        for batch in pipe.iterate(batches) if pipeline else batches:
            (emb(batch["ids"].clone() if copy else batch["ids"]) * batch["w"]).sum().backward()
            opt.step()
        taken.append(emb.stats.rounds_ahead)
    return emb.full_weight(), taken


def test_rounds_not_taken_are_dropped_on_every_rank_and_the_ranks_stay_in_step(rank_pools):
    for (weights, _), (p_weights, taken) in zip(
        rank_pools(2).run(_rounds_not_taken, False), rank_pools(2).run(_rounds_not_taken, True)
    ):
        assert torch.equal(weights, p_weights)
        assert taken == [0, 4]  # the copies ran unpipelined; then every lookup took its round


def _subgroup_ahead():
    """Ranks 0 and 1 of 3 shard a table over their own group (as 2-D sharding does); rank 2 has no table."""
    group = dist.new_group([0, 1])  # every rank makes it
    if dist.get_rank() == 2:
        return True
    try:
        emb = ls.SparseEmbedding(8, 2, seed=1, process_group=group)
        with pytest.raises(ValueError, match=r"sharded over all 3 ranks.*HINT: leave sharding_group_size unset"):
            next(iter(ls.pipelined([{"ids": torch.tensor([1])}], inputs=lambda b: {emb: b["ids"]})))
        return True
    finally:
        dist.destroy_process_group(group)


def test_tables_sharded_over_some_ranks_are_refused_on_each_of_them(rank_pools):
    assert rank_pools(3).run(_subgroup_ahead) == [True] * 3


def _ahead_groups():
    """A table over a group of its own (its ahead group is made here): its ahead peers, asked for twice."""
    from lightning_sparse.wire.ahead import ahead_peers
    from lightning_sparse.wire.shared_memory import _timeout_s

    group = dist.new_group([0, 1], timeout=TIMEOUT)
    emb = ls.SparseEmbedding(8, 2, seed=1, process_group=group).materialize()  # (placed: its peers are over the group)
    first, second = (ahead_peers(emb.peers, timedelta(seconds=7)) for _ in range(2))
    try:
        return first.group is second.group, _timeout_s(first.group)
    finally:
        for made in {first.group, second.group}:
            dist.destroy_process_group(made)
        dist.destroy_process_group(group)


def test_a_groups_ahead_group_is_made_once_with_the_timeout_given(rank_pools):
    """Every batch's rounds go over the one ahead group (a group per batch would leak one, and its id room would start
    empty each time), which gives up on a lost peer after the pipeline's timeout, not torch's default of 30 minutes."""
    assert rank_pools(2).run(_ahead_groups) == [(True, 7.0)] * 2


def test_moved_ahead_moves_each_batch_once_and_hands_out_the_batch_sent_ahead():
    """As the Trainer's batch_to_device calls it, with a move that copies (as one to a GPU does): a batch moved again
    would hold new tensors, whose lookups take no round sent ahead."""
    sent, moved = [], []
    pipe = ls.Pipeline(lambda batch: sent.append(batch) or {})

    def move(batch: dict) -> dict:
        moved.append(batch)
        return {"ids": batch["ids"].clone()}

    batches = [{"ids": torch.tensor([n])} for n in range(3)]
    handed = [pipe.moved_ahead(batch, move, following) for batch, following in zip(batches, [*batches[1:], None])]
    assert len(moved) == 3 and all(a is b for a, b in zip(moved, batches))
    assert len(sent) == 2 and all(a is b for a, b in zip(handed[1:], sent)) and pipe.issued == 2


def test_in_one_process_a_pipeline_sends_nothing_and_trains_as_unpipelined():
    """One process: a table's gather and a collection's one-rank round have nothing to send ahead."""
    results = []
    for pipeline in (False, True):
        torch.manual_seed(0)
        table = ls.SparseEmbedding(10, 2, seed=1)
        collection = ls.SparseEmbeddingCollection({"t": ls.SparseEmbedding(10, 2, seed=2)}, features={"f": "t"})
        opt = ls.SparseAdagrad([table, collection], lr=0.5)
        batches = [{"ids": torch.randint(0, 10, (4,)), "f": {"f": torch.randint(0, 10, (3,))}} for _ in range(3)]
        inputs = lambda b, table=table, collection=collection: {table: b["ids"], collection: b["f"]}  # noqa: E731
        for batch in ls.pipelined(batches, inputs) if pipeline else batches:
            (table(batch["ids"]).sum() + collection(batch["f"])["f"].sum()).backward()
            opt.step()
        results.append((table.full_weight(), collection.tables["t"].full_weight(), table.stats.rounds_ahead))
    (a, b, _), (p_a, p_b, taken) = results
    assert torch.equal(a, p_a) and torch.equal(b, p_b) and taken == 0


def _changed_in_place():
    emb = ls.SparseEmbedding(10, 2, seed=1)
    batches = [{"ids": torch.tensor([1, 2])}, {"ids": torch.tensor([3])}]
    with pytest.raises(ValueError, match="changed in place after they were sent ahead.*HINT: change them in the loader"):
        for batch in ls.pipelined(batches, inputs=lambda b: {emb: b["ids"]}):
            emb(batch["ids"].clamp_(max=8)).sum().backward()  # a no-op that still changes the ids in place
    return _train("table", True, [3, 4, 5])[2]  # the groups stay usable


def test_ids_changed_in_place_after_they_were_sent_ahead_raise_on_every_rank(rank_pools):
    assert rank_pools(2).run(_changed_in_place) == [[(2, 1), (3, 3)]] * 2
