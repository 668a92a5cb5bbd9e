"""Tables in one host's shared memory (``SparseEmbedding(shared_memory=True)``): lookups read every owner's rows in place.

Each equality test trains the same model twice on the same batches, with the table exchanged as usual and in shared
memory, and compares the trained tables, the optimizer state and lookups bitwise: the gradients reach the same owners
and are summed in the same order, only the rows' way to the requester differs.
"""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning_models as lm
import numpy as np
import pytest
import torch
import torch.distributed as dist
from rank_pool import COLLECTIVE_TIMEOUT_S

import lightning_sparse as ls
from lightning_sparse import checkpoint
from lightning_sparse.lookup.engine import serve_lookups
from lightning_sparse.wire import shared_memory

OPTIMIZERS = {"SparseSGD": {"lr": 0.3}, "SparseAdagrad": {"lr": 0.3}, "SparseRowWiseAdagrad": {"lr": 0.3},
              "SparseAdam": {"lr": 0.05}}  # fmt: skip


def _segments(pid: int | None = None) -> list[str]:
    """Our segments' names in /dev/shm (those made by process ``pid``: other tests may run beside this one)."""
    prefix = "lightning_sparse_" if pid is None else f"lightning_sparse_{pid}_"
    return sorted(f for f in os.listdir(shared_memory.SHM_DIR) if f.startswith(prefix))


def _train(shared: bool, optimizer: str, sharding: str, dtype: torch.dtype = torch.float32, twice: bool = False):
    """Six steps of one table (ids with repeats within and across ranks; the odd steps crowd 30 rows; the last rank has
    none at the third), then a lookup of every row. ``twice``: a second lookup before one step."""
    rank = dist.get_rank()
    emb = ls.SparseEmbedding(103, 4, sharding=sharding, seed=5, dtype=dtype, shared_memory=shared)
    opt = getattr(ls, optimizer)([emb], **OPTIMIZERS[optimizer])
    g = torch.Generator().manual_seed(rank)
    segments_while_training = None
    for step in range(6):
        ids = torch.randint(0, 30 if step % 2 else 103, (2, 40), generator=g)
        if step == 2 and rank == dist.get_world_size() - 1:
            ids = ids[:, :0]  # this rank has no ids: it sends no gradient rows, and its rows still get the others'

        (emb(ids).float() * torch.randn(*ids.shape, 4, generator=g)).sum().backward()  # (rounding tells any change of order)
        if twice and step == 3:  # its gradient accumulates with the first's
            (emb(ids[:, :5]).float() * torch.randn(2, 5, 4, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
        segments_while_training = segments_while_training or _segments(os.getpid())  # (rank 0 makes them)
    with torch.no_grad():
        every_row = emb(torch.arange(103))
    state = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return emb.full_weight(), every_row, state, segments_while_training


def _both_ways(optimizer: str, sharding: str, dtype: torch.dtype = torch.float32, twice: bool = False):
    return _train(False, optimizer, sharding, dtype, twice), _train(True, optimizer, sharding, dtype, twice)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("sharding", ["mod", "range"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_table_in_shared_memory_trains_bitwise_as_an_exchanged_one(rank_pools, world_size, sharding, optimizer):
    for (weight, rows, state, _), (s_weight, s_rows, s_state, segments) in rank_pools(world_size).run(
        _both_ways, optimizer, sharding
    ):
        assert torch.equal(weight, s_weight) and torch.equal(rows, s_rows)
        assert torch.equal(rows, weight)  # a lookup of every row reads the trained table
        assert len(state) == len(s_state) and all(torch.equal(a, b) for a, b in zip(state, s_state))
        assert segments == []  # every segment's name is gone once the ranks mapped it: a dead job leaves nothing


def test_two_lookups_before_a_step_add_the_same_gradients_in_another_order(rank_pools):
    """An exchanged table's owner adds each lookup's rows as they come; a shared one's requester adds its lookups first."""
    for (weight, rows, state, _), (s_weight, s_rows, s_state, _) in rank_pools(3).run(_both_ways, "SparseAdagrad", "mod",
                                                                                       torch.float32, True):  # fmt: skip
        torch.testing.assert_close(s_weight, weight, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s_rows, rows, rtol=1e-6, atol=1e-6)
        for a, b in zip(state, s_state):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_a_bf16_table_in_shared_memory_trains_as_an_exchanged_one(rank_pools):
    """In float32 its gradients add up per row at the step; an exchanged table's lookup adds a row's repeats in bf16 first."""
    for (weight, rows, state, _), (s_weight, s_rows, s_state, _) in rank_pools(2).run(
        _both_ways, "SparseAdagrad", "mod", torch.bfloat16
    ):
        assert s_weight.dtype == torch.bfloat16 and torch.equal(s_rows, s_weight)
        torch.testing.assert_close(s_weight, weight, rtol=0.02, atol=0.02)
        torch.testing.assert_close(s_rows, rows, rtol=0.02, atol=0.02)
        for a, b in zip(state, s_state):
            torch.testing.assert_close(b, a, rtol=0.02, atol=0.02)


def _state_dicts():
    """Save a trained table's state dict; load it, and a full one, into fresh tables in shared memory; read every row."""
    emb = ls.SparseEmbedding(50, 3, seed=1, shared_memory=True)
    opt = ls.SparseAdagrad([emb], lr=0.5)
    emb(torch.arange(dist.get_rank(), 50, 7)).sum().backward()
    opt.step()
    saved = emb.state_dict()
    full = ls.full_state_dict(emb)
    trained = emb(torch.arange(50)).detach()
    fresh, fresh_full = (
        ls.SparseEmbedding(50, 3, seed=2, shared_memory=True),
        ls.SparseEmbedding(50, 3, seed=2, shared_memory=True),
    )
    before = fresh(torch.arange(50)).detach()  # mapped first: the loads below write into the segment
    if dist.get_rank() == 1:
        time.sleep(0.3)  # a slow load: rank 0's next lookup must wait for it
    fresh.load_state_dict(saved)
    fresh_full(torch.arange(50))
    fresh_full.load_state_dict(full)
    return (
        saved["shard"].shape,
        saved["shard"].untyped_storage().nbytes(),
        trained,
        before,
        fresh(torch.arange(50)).detach(),
        fresh_full(torch.arange(50)).detach(),
    )


def test_a_state_dict_holds_this_ranks_rows_and_loads_write_into_the_segment(rank_pools):
    for rank, (shape, nbytes, trained, before, loaded, loaded_full) in enumerate(rank_pools(2).run(_state_dicts)):
        assert shape == (25, 3) and nbytes == 25 * 3 * 4  # a copy of its rows, not a view of the whole segment
        assert not torch.equal(before, trained)
        assert torch.equal(loaded, trained) and torch.equal(loaded_full, trained), rank  # every rank reads every rank's load


def _slow_owner():
    """Rank 1 updates its rows late; rank 0 reads every row right after the step."""
    emb = ls.SparseEmbedding(20, 2, seed=1, shared_memory=True)
    opt = ls.SparseSGD([emb], lr=1.0)
    if dist.get_rank() == 1:
        update = opt._apply
        opt._apply = lambda *args: (time.sleep(0.3), update(*args))
    emb(torch.arange(20)).sum().backward()
    opt.step()
    read = emb(torch.arange(20)).detach()
    return read, emb.full_weight()


def test_the_step_fences_so_that_no_rank_reads_a_row_before_its_owner_updated_it(rank_pools):
    for read, weight in rank_pools(2).run(_slow_owner):
        assert torch.equal(read, weight)


def _bad_id():
    emb = ls.SparseEmbedding(10, 2, shared_memory=True)
    emb(torch.arange(10))  # mapped
    try:
        emb(torch.tensor([3, 10 + dist.get_rank()]))
    except IndexError as err:
        return str(err)
    return None


def test_an_id_out_of_range_raises_on_the_rank_that_read_it_with_the_value_and_a_hint(rank_pools):
    on_zero, on_one = rank_pools(2).run(_bad_id)
    assert "got id 10 on this rank" in on_zero and "HINT" in on_zero and "got id 11 on this rank" in on_one


def _exchange():
    group = dist.group.WORLD
    fence = shared_memory.Fence(group, "test")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for k in (1, 3):
        send = torch.tensor([[100 * rank + 10 * j + i for i in range(k)] for j in range(world)])
        out.append(fence.exchange(send))
    out.append(fence.exchange(torch.zeros(world, shared_memory.MESSAGE_WORDS, dtype=torch.int64)))  # too long: declined
    for width in (3, 100_000):  # rows of 3 floats, then a buffer over the first mailbox's MiB: the mailboxes grow
        splits = [(rank + j) % world for j in range(world)]  # rank j gets (rank + j) % W rows from this rank (one gets none)
        rows = torch.cat([torch.full((n, width), 10.0 * rank + j) for j, n in enumerate(splits)])
        out.append(fence.exchange_values(rows, splits, [(source + rank) % world for source in range(world)]))
    splits = [0] * world if rank == 0 else [1] * world  # rank 0 sends nothing and gets a row from each other rank
    rows = torch.full((sum(splits), 2), float(rank))
    out.append(fence.exchange_values(rows, splits, [0 if source == 0 else 1 for source in range(world)]))
    return out


@pytest.mark.skipif(not shared_memory.STORES_IN_ORDER, reason="the ranks meet in shared memory on x86-64 only")
def test_the_fence_carries_split_sizes_and_rows_to_each_rank(rank_pools):
    for rank, (one, three, declined, *values, from_others) in enumerate(rank_pools(3).run(_exchange)):
        assert torch.equal(from_others, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
        assert one.view(-1).tolist() == [100 * source + 10 * rank for source in range(3)]
        assert three.tolist() == [[100 * source + 10 * rank + i for i in range(3)] for source in range(3)]
        assert declined is None
        for received, width in zip(values, (3, 100_000)):  # by source: its rows for this rank
            expected = torch.cat([torch.full(((source + rank) % 3, width), 10.0 * source + rank) for source in range(3)])
            assert torch.equal(received, expected)


def _uneven_buffers():
    """Rank 0 posts one row of 1000 floats for rank 1, rank 1 400 rows for rank 0 (1.6 MB, over a mailbox's first MiB)."""
    rank = dist.get_rank()
    fence = shared_memory.Fence(dist.group.WORLD, "test")
    splits = [0, 1] if rank == 0 else [400, 0]
    rows = torch.arange(sum(splits) * 1000, dtype=torch.float32).view(-1, 1000) + 1e6 * rank
    return fence.exchange_values(rows, splits, [0, 400] if rank == 0 else [1, 0])


@pytest.mark.skipif(not shared_memory.STORES_IN_ORDER, reason="the ranks meet in shared memory on x86-64 only")
def test_every_rank_sizes_the_mailboxes_for_the_largest_buffer_of_any_rank(rank_pools):
    """The mailboxes are one segment, a row per rank: every rank must map it with the same row size, the largest rank's
    buffer's, or a rank that sized them for its own small buffer reads and writes the others' rows at other offsets."""
    to_zero, to_one = rank_pools(2).run(_uneven_buffers)
    assert torch.equal(to_zero, torch.arange(400_000, dtype=torch.float32).view(400, 1000) + 1e6)
    assert torch.equal(to_one, torch.arange(1000, dtype=torch.float32).view(1, 1000))


def _fence_made():
    fence = shared_memory.Fence(dist.group.WORLD, "emb")
    return os.getpid(), fence.slots[:, 1].tolist(), fence.timeout_s


@pytest.mark.skipif(not shared_memory.STORES_IN_ORDER, reason="the ranks meet in shared memory on x86-64 only")
def test_a_fence_holds_every_ranks_pid_and_its_groups_timeout(rank_pools):
    """What a waiting fence checks (the tests below): the pid in each rank's slot tells a dead rank, and it gives up
    after the group's timeout (the pool's), not torch's default of 30 minutes."""
    made = rank_pools(2).run(_fence_made)
    for _, pids, timeout_s in made:
        assert pids == [pid for pid, _, _ in made] and timeout_s == COLLECTIVE_TIMEOUT_S


def _rank_0s_fence(peer_pid: int, timeout_s: float) -> shared_memory.Fence:
    """Rank 0's fence of a group of 2 (no segment, no group): both slots at arrival 0, rank 1's held by ``peer_pid``."""
    fence = object.__new__(shared_memory.Fence)
    fence.what, fence.rank, fence.arrivals, fence.timeout_s = "emb", 0, 0, timeout_s
    fence.slots = np.array([[0, os.getpid()], [0, peer_pid]], dtype=np.int64)
    return fence


def test_a_fence_waiting_for_a_dead_rank_raises_naming_it(monkeypatch):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    fence = _rank_0s_fence(peer_pid=dead, timeout_s=60.0)
    monkeypatch.setattr(shared_memory, "CHECK_PEERS_S", 0.01)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of its group died.*HINT"):
        fence()


def test_a_fence_waiting_past_its_groups_timeout_for_a_live_rank_raises_naming_it(monkeypatch):
    """Rank 1 is alive but late. On a clock that moves a second each time the fence reads it, with rank 1 arriving at the
    100th reading, the fence gives up after its 5 s timeout instead of waiting for it."""
    fence = _rank_0s_fence(peer_pid=os.getpid(), timeout_s=5.0)
    checks = itertools.count()

    def clock() -> float:
        now = next(checks)
        if now == 100:
            fence.slots[1, 0] = 1  # rank 1 arrives
        return float(now)

    monkeypatch.setattr(shared_memory, "time", SimpleNamespace(perf_counter=clock, sleep=lambda seconds: None))
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not arrive within 6 s.*HINT"):
        fence()


def test_a_segment_too_big_for_dev_shm_is_refused_with_the_room_there():
    made = shared_memory._create(1 << 62, "emb")
    assert "has no room" in made["error"] and "HINT" in made["error"] and "--shm-size" in made["error"]
    assert _segments(os.getpid()) == []


def _another_host():
    """Rank 1 reads another boot id than rank 0's (as on another host, were a file at the segment's path there too)."""
    own = shared_memory._boot_id
    if dist.get_rank() == 1:
        shared_memory._boot_id = lambda: "another host"
    try:
        shared_memory.map_segment((2, 3), torch.float32, dist.group.WORLD, "emb")
        raised = None
    except RuntimeError as err:
        raised = str(err)
    finally:
        shared_memory._boot_id = own
    return raised, _segments(os.getpid())


def test_a_rank_on_another_host_makes_every_rank_raise_naming_it(rank_pools):
    """Rank 1 cannot share rank 0's memory: it must not map the file, and rank 0, which could, raises too (else it would
    wait for rank 1 in its first fence); the file is gone all the same."""
    for raised, segments in rank_pools(2).run(_another_host):
        assert raised is not None and "emb: rank 1 sees another file" in raised and "HINT" in raised and "one host" in raised
        assert segments == []


def test_the_strategies_shared_memory_reaches_tables_of_their_own_only():
    """Tables in a collection keep its rounds, a DynamicEmbedding its keyed rounds; a table already placed is placed again."""
    from lightning_sparse.lightning.placement import place_tables

    module = torch.nn.ModuleDict({"alone": ls.SparseEmbedding(8, 2), "dynamic": ls.DynamicEmbedding(8, 2),
                                  "collection": ls.SparseEmbeddingCollection({"inner": ls.SparseEmbedding(8, 2)})})  # fmt: skip
    place_tables(module)
    chosen = module["alone"].lookups
    assert chosen is not None and not module["alone"].shared_memory
    place_tables(module, shared_memory=True)
    assert module["alone"].shared_memory and module["alone"].lookups not in (None, chosen)  # (chosen again)
    assert not module["dynamic"].shared_memory and not module["collection"].tables["inner"].shared_memory


def test_tables_in_shared_memory_are_refused_in_a_collection():
    with pytest.raises(ValueError, match=r"\['u'\] have shared_memory=True.*HINT"):
        ls.SparseEmbeddingCollection({"u": ls.SparseEmbedding(4, 2, shared_memory=True), "i": ls.SparseEmbedding(4, 2)})


def _serving():
    """Rank 0 looks up an exchanged table twice more than rank 1, which serves it; a table in shared memory comes first."""
    shared, exchanged = ls.SparseEmbedding(10, 2, shared_memory=True), ls.SparseEmbedding(1000, 2)
    shared.adopt("shared", 0)
    exchanged.adopt("exchanged", 1)
    shared(torch.arange(10)), exchanged(torch.arange(10))
    if dist.get_rank() == 0:
        for _ in range(2):  # more ids than the round's first message has room for: the rest follow by exchange_values
            exchanged(torch.arange(1000))
    return serve_lookups([shared, exchanged])


def test_a_rank_out_of_batches_serves_the_others_rounds_beside_a_table_in_shared_memory(rank_pools):
    assert rank_pools(2).run(_serving) == [0, 2]


def _sharded_checkpoint(directory: str):
    """A sharded checkpoint of a table in shared memory, loaded into a fresh one (rank 1 late); every rank reads every row."""
    emb = ls.SparseEmbedding(30, 3, seed=1, shared_memory=True)
    opt = ls.SparseAdagrad([emb], lr=0.5)
    emb(torch.arange(dist.get_rank(), 30, 4)).sum().backward()
    opt.step()
    trained = emb(torch.arange(30)).detach()
    path = checkpoint.save(Path(directory) / "shared.ckpt", emb, {0: opt})
    fresh = ls.SparseEmbedding(30, 3, seed=2, shared_memory=True)
    before = fresh(torch.arange(30)).detach()
    if dist.get_rank() == 1:
        time.sleep(0.3)
    checkpoint.load_module(path, fresh)
    return trained, before, fresh(torch.arange(30)).detach()


def test_a_sharded_checkpoint_loads_into_the_segment_before_any_rank_reads_it(rank_pools, tmp_path):
    for trained, before, loaded in rank_pools(2).run(_sharded_checkpoint, str(tmp_path)):
        assert not torch.equal(before, trained) and torch.equal(loaded, trained)


def _trainer_runs(world_size: int):
    """Two epochs of TwoTower under the Trainer (shuffled DistributedSampler, validation), its tables exchanged, then shared.

    Its items are looked up twice per batch: the same gradients, added in another order (see the test above).
    """
    lm.lightning_env(dist.get_rank(), world_size)
    runs = []
    for shared in (False, True):
        module = lm.TwoTower(sparse="SparseAdam", sparse_kwargs=dict(lr=0.05))
        if shared:  # users shared by its own argument, items by the strategy's
            module.users = ls.SparseEmbedding(lm.USERS, lm.DIM, seed=1, sharding="mod", shared_memory=True)
        strategy = ls.SparseDDPStrategy(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), shared_memory=shared)
        trainer = lm.trainer(world_size, strategy=strategy, max_epochs=2, limit_val_batches=2, val_check_interval=3)
        trainer.fit(module)
        opt = trainer.strategy.sparse_optimizers[0]
        state = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        runs.append((lm.state(module), state, [type(t.lookups).__name__ for t in (module.users, module.items)]))
    return runs


def test_the_trainer_trains_tables_in_shared_memory_as_exchanged_ones(rank_pools):
    for (state, opt_state, paths), (s_state, s_opt_state, s_paths) in rank_pools(2).run(_trainer_runs, 2):
        assert paths == ["Round", "Round"] and s_paths == ["SharedReads", "SharedReads"]
        assert state.keys() == s_state.keys()
        for key in state:
            torch.testing.assert_close(s_state[key], state[key], rtol=1e-5, atol=1e-6)
        for a, b in zip(opt_state, s_opt_state):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _copied():
    """A deepcopy of a trained table in shared memory: its own segment, the same rows; training the copy leaves the original."""
    import copy

    emb = ls.SparseEmbedding(20, 2, seed=1, shared_memory=True)
    opt = ls.SparseSGD([emb], lr=1.0)
    emb(torch.arange(20)).sum().backward()
    opt.step()
    twin = copy.deepcopy(emb)
    rows = emb(torch.arange(20)).detach()
    twin_opt = ls.SparseSGD([twin], lr=1.0)
    twin(torch.arange(20)).sum().backward()
    twin_opt.step()
    return rows, emb(torch.arange(20)).detach(), twin(torch.arange(20)).detach()


def test_a_copy_of_a_table_in_shared_memory_maps_its_own_segment(rank_pools):
    for rows, after, twin in rank_pools(2).run(_copied):
        assert torch.equal(rows, after) and torch.equal(twin, rows - 1)


def _fabric_runs():
    """Test_fabric.py's loop under Fabric (accumulation, clipping, a shuffled sampler), its tables exchanged, then shared."""
    import lightning as L
    from test_fabric import DENSE_LR, _train
    from torch.utils.data import DataLoader, DistributedSampler

    lm.lightning_env(dist.get_rank(), 2)  # the ranks exist: Fabric launches nothing and reuses their group
    runs = []
    for shared in (False, True):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ls.FabricSparseDDPStrategy(shared_memory=shared))
        fabric.launch()
        model = lm.TwoTower()
        if shared:  # users shared by its own argument, items by the strategy's
            model.users = ls.SparseEmbedding(lm.USERS, lm.DIM, seed=1, sharding="mod", shared_memory=True)
        dense = torch.optim.SGD(model.mlp.parameters(), lr=DENSE_LR)
        sparse = ls.SparseAdagrad([model.users, model.items], lr=0.2)
        model, dense, sparse = fabric.setup(model, dense, sparse)
        data = lm.dataset()
        sampler = DistributedSampler(data, num_replicas=fabric.world_size, rank=fabric.global_rank, shuffle=True, seed=123)
        _train(fabric, model, dense, sparse, DataLoader(data, batch_size=4, sampler=sampler), range(2))
        runs.append((lm.state(model.module), [type(t.lookups).__name__ for t in (model.module.users, model.module.items)]))
    return runs


def test_fabric_trains_tables_in_shared_memory_as_exchanged_ones(rank_pools):
    for (state, paths), (s_state, s_paths) in rank_pools(2).run(_fabric_runs):
        assert paths == ["Round", "Round"] and s_paths == ["SharedReads", "SharedReads"]
        assert state.keys() == s_state.keys()
        for key in state:
            torch.testing.assert_close(s_state[key], state[key], rtol=1e-5, atol=1e-6)
