"""DynamicEmbedding: arbitrary 64-bit ids, admission, eviction, expiry; parity with SparseEmbedding while ids fit."""

from __future__ import annotations

import pytest
import torch
from host_reads import CopyInFlight
from rank_pool import DEVICES
from references import batch_loss
from test_optim_parity import CASES, SEED, D, N, make_batches

import lightning_sparse as ls
from lightning_sparse.kernels.host import LateRead
from lightning_sparse.tables.admission import SlotTable
from lightning_sparse.tables.slot_map import SlotMap
from lightning_sparse.wire.hashing import HashSharding, mix, unmix

# Row r of the reference table answers to this 64-bit id (spread over the whole int64 range).
RAW = mix(torch.arange(N) * 7919 + 12345)


class RowOfRawId:
    """An init that gives raw id ``RAW[r]`` the row that ``ls.init.normal()`` gives row ``r`` (picklable)."""

    def __init__(self, raw: torch.Tensor) -> None:
        self.order = torch.argsort(raw)
        self.sorted = raw[self.order]

    def __call__(self, ids: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
        rows = self.order[torch.searchsorted(self.sorted, ids.cpu())]
        return ls.init.normal()(rows, dim, seed).to(ids.device)


# ---------------------------------------------------------------------------- building blocks
def test_mix_is_a_bijection_that_spreads_ids_over_owners():
    ids = torch.cat([torch.arange(-5, 5), torch.randint(-(2**63), 2**63 - 1, (10_000,)), torch.tensor([2**63 - 1, -(2**63)])])
    assert torch.equal(unmix(mix(ids)), ids)
    assert len(torch.unique(mix(ids))) == len(torch.unique(ids))
    # Ids that share their low bits (hash values often do) still spread evenly: id % W would put all on rank 0.
    counts = torch.bincount(HashSharding(4).owner_of_key(mix(torch.arange(4000) * 4096)), minlength=4)
    assert counts.min() > 900, counts


def test_slot_map_finds_inserts_and_removes_batches():
    gen = torch.Generator().manual_seed(0)
    slots = SlotMap(2001)
    keys = mix(torch.randperm(10**6, generator=gen)[:2000])
    assert bool(slots.place(keys, torch.arange(1, 2001)).all())
    assert torch.equal(slots.find(keys), torch.arange(1, 2001))
    for round_ in range(5):  # remove half, insert others into the freed slots, in batches as a table does
        freed = torch.arange(1 + round_ % 2, 2001, 2)
        slots.remove(freed)
        assert bool((slots.find(keys[freed - 1]) == 0).all()) and not bool(slots.used()[freed].any())
        keys[freed - 1] = mix(torch.arange(len(freed)) + 10**7 * (round_ + 1))
        entries = slots.reserve(keys[freed - 1])
        assert bool((entries >= 0).all()) and len(torch.unique(entries)) == len(freed)
        slots.write(entries, keys[freed - 1], freed)
        assert torch.equal(slots.find(keys), torch.arange(1, 2001))
    assert torch.equal(slots.find(mix(torch.arange(-50, 0))), torch.zeros(50, dtype=torch.int64))


def test_slot_map_keys_that_share_their_groups_fill_both_then_find_no_room_and_padding_takes_none():
    slots = SlotMap(20)  # 16 groups of 8 entries
    crowded = (torch.arange(1, 21) << 40) + (1 << 32)  # the same two groups for all (low bits, bits 32 to 34)
    valid = torch.arange(20) % 5 != 4  # every fifth key is padding
    entries = slots.reserve(crowded, valid)
    placed = entries >= 0
    assert not bool(placed[~valid].any())
    assert int(placed.sum()) == 16 and set((entries[placed] // 8).tolist()) == set(slots.groups(crowded[:1])[0].tolist())
    assert len(torch.unique(entries[placed])) == 16  # no entry twice
    given = torch.where(torch.arange(20) < 10, torch.arange(1, 21), 0)  # the last ones get no slot: entries back
    slots.write(entries, crowded, given)
    expected = torch.where(placed, given, 0)  # 0: the null slot, no row
    assert torch.equal(slots.find(crowded), expected)
    assert int((slots.buckets[:-1] > 0).sum()) == int((expected > 0).sum())
    assert int((slots.buckets[:-1] < 0).sum()) == 0  # no reservation left behind


def _table(capacity: int, **kwargs) -> SlotTable:
    options = dict(admit_after=1, eviction="lru", ttl=None, sketch_width=64, device=torch.device("cpu")) | kwargs
    return SlotTable(capacity + 1, capacity, **options)


def test_slots_admit_after_k_requests_and_evict_the_least_recently_used():
    table = _table(2, admit_after=2)
    one = torch.ones(3, dtype=torch.int64)
    keys = mix(torch.tensor([10, 20, 30]))
    slots, new, _ = table.resolve(keys, one)
    assert slots.tolist() == [0, 0, 0] and len(new) == 0  # seen once: no row yet
    slots, new, _ = table.resolve(keys[:2], one[:2])
    assert sorted(slots.tolist()) == [1, 2] and table.occupancy == 2
    table.tick()
    table.resolve(keys[1:2], one[:1])  # 20 used at step 1, 10 last used at step 0
    table.tick()
    slots, new, _ = table.resolve(keys[2:], one[:1])  # 30's second request: takes 10's slot
    assert table.stats.evictions == 1 and table.map.find(keys[:1]).tolist() == [0]
    assert slots.tolist() == new.tolist() and table.map.find(keys[2:]).tolist() == new.tolist()


@pytest.mark.parametrize("eviction", ["lru", "lfu"])  # on a CPU, "lru" takes its victims from a queue, "lfu" by a top-k
def test_slots_used_since_the_last_step_are_never_taken(eviction):
    table = _table(2, eviction=eviction)
    one = torch.ones(2, dtype=torch.int64)
    table.resolve(mix(torch.tensor([1, 2])), one)
    slots, new, _ = table.resolve(mix(torch.tensor([3])), one[:1])  # same step: both slots pinned
    assert slots.tolist() == [0] and table.stats.rejections == 1 and table.stats.evictions == 0
    table.tick()
    slots, _, _ = table.resolve(mix(torch.tensor([3])), one[:1])
    assert slots.tolist() != [0] and table.stats.evictions == 1


def test_a_batch_finds_no_free_slot_by_the_hosts_floor_and_evicts_while_the_free_count_copy_lags():
    """Nothing reads the free count on a step: the host's floor on it is the last copy read less every batch's bound since
    that copy started. A floor that forgot a batch (kept no tally while no copy came, or took a late copy as current) sees
    free slots that are gone, and the batch's new id is rejected instead of evicting the least recently used one."""
    table = _table(4)
    table.free._copy = copy = LateRead()
    copy._host, copy._event = torch.zeros((), dtype=torch.int64), (event := CopyInFlight())  # as on a GPU: pinned, evented
    one = torch.ones(2, dtype=torch.int64)
    for new in ([1, 2], [3, 4], [5]):  # the copy started after the first batch (2 free) stays on the way
        table.resolve(mix(torch.tensor(new)), one[: len(new)])
        table.tick()
    assert (table.occupancy, table.stats.evictions, table.stats.rejections) == (4, 1, 0)  # 5 took 1's slot
    event.done = True  # 2 free: the count before the last two batches, whose bounds (2, 1) the floor takes off
    slots, _, _ = table.resolve(mix(torch.tensor([6])), one[:1])
    assert slots.tolist() != [0] and (table.stats.evictions, table.stats.rejections) == (2, 0)  # 6 took 2's slot
    assert table.map.find(mix(torch.tensor([1, 2]))).tolist() == [0, 0]  # the least recently used, lowest slot first


def test_lfu_keeps_frequent_ids_and_ttl_expires_unused_ones():
    table = _table(2, eviction="lfu", ttl=2)
    keys = mix(torch.tensor([1, 2]))
    table.resolve(keys, torch.tensor([5, 1]))  # id 1 asked 5 times (by 5 ranks), id 2 once
    table.tick()
    table.resolve(mix(torch.tensor([3])), torch.tensor([1]))
    assert table.map.find(keys).tolist()[0] >= 1 and table.map.find(keys).tolist()[1] == 0  # 2 was evicted
    for _ in range(3):
        table.tick()
    assert table.occupancy == 0 and table.stats.expirations == 2


def test_ttl_frees_an_id_unused_for_more_than_ttl_steps_and_not_before():
    table = _table(2, ttl=2)
    key = mix(torch.tensor([1]))
    table.resolve(key, torch.ones(1, dtype=torch.int64))  # used at step 0
    for _ in range(2):  # the step it was used in, then one step unused
        table.tick()
        assert table.map.find(key).tolist() != [0] and table.stats.expirations == 0
    table.tick()  # the second step unused: more than ttl=2 steps since its use
    assert table.map.find(key).tolist() == [0] and table.occupancy == 0 and table.stats.expirations == 1


def test_restoring_more_ids_than_room_keeps_the_most_recently_used_or_most_requested():
    keys = mix(torch.tensor([1, 2, 3, 4]))
    last_used, requests = torch.tensor([5, 9, 2, 7]), torch.tensor([8, 1, 6, 3])
    for eviction, kept in (("lru", [1, 3]), ("lfu", [0, 2])):
        table = _table(2, eviction=eviction)
        slots = table.restore(keys, last_used, requests, clock=10)
        assert torch.nonzero(slots >= 0).view(-1).tolist() == kept, eviction
        assert torch.equal(table.map.find(keys), slots.clamp(min=0))
        assert torch.equal(table.last_used[slots[kept]], last_used[kept])
        assert torch.equal(table.requests[slots[kept]], requests[kept])


def test_a_local_state_dict_loads_with_every_free_slot_and_never_the_null_row():
    emb = ls.DynamicEmbedding(3, 2, seed=1)
    emb(torch.tensor([7]))  # one of 3 slots held
    loaded = ls.DynamicEmbedding(3, 2, seed=1)
    loaded.load_state_dict(emb.state_dict())
    loaded(torch.tensor([8, 9]))  # the two free slots: both admitted
    assert loaded.slot_stats.occupancy == 3
    with torch.no_grad():
        torch.testing.assert_close(loaded(torch.tensor([7, 8, 9, 10])), torch.cat([ls.init.normal()(torch.tensor([7, 8, 9]), 2, 1),
                                                                              torch.zeros(1, 2)]), rtol=0, atol=0)  # fmt: skip
    assert not loaded.shard[0].any()


def test_a_state_dict_of_a_full_table_loads_with_no_free_slot_and_its_next_new_id_evicts():
    """Loading sets the host's floor on the free slots to what the state leaves free (none here): a floor kept from the
    empty table would let the next new id skip eviction and be rejected, reading zeros."""
    emb = ls.DynamicEmbedding(2, 2, seed=1)
    opt = ls.SparseSGD([emb], lr=0.1)
    emb(torch.tensor([7, 8])).sum().backward()
    opt.step()  # both slots held, neither pinned
    loaded = ls.DynamicEmbedding(2, 2, seed=1)
    loaded.load_state_dict(emb.state_dict())
    row = loaded(torch.tensor([9]))
    assert (loaded.slot_stats.evictions, loaded.slot_stats.rejections, loaded.slot_stats.occupancy) == (1, 0, 2)
    torch.testing.assert_close(row.detach(), ls.init.normal()(torch.tensor([9]), 2, 1), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, saving and loading in this process
def test_a_dynamic_checkpoint_of_several_bands_loads_each_id_with_its_row_and_state(tmp_path, monkeypatch):
    from lightning_sparse import checkpoint
    from lightning_sparse.checkpoint import rows as row_store

    monkeypatch.setattr(row_store, "PART_BYTES", 256)  # 64 slots of 4 float32 values: 16 bands of 4 slots

    def module_and_optimizer(seed: int):
        module = torch.nn.Module()
        module.emb = ls.DynamicEmbedding(63, 4, seed=seed)
        return module, ls.SparseAdam([module.emb], lr=0.1)

    module, optimizer = module_and_optimizer(1)
    for step in range(3):
        module.emb(torch.arange(40) * 1009 + step).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dense = {"state_dict": checkpoint.dense_module_state(module),  # the slots' clock
             "optimizer_0": checkpoint.split_tensors(checkpoint.dense_optimizer_state(optimizer))[0]}  # fmt: skip
    path = checkpoint.save(tmp_path / "dynamic.ckpt", module, {0: optimizer}, dense)
    assert checkpoint.load_meta(path)["row_tensors"]["state_dict.emb.weight"]["parts"] > 1
    loaded, loaded_optimizer = module_and_optimizer(2)
    checkpoint.load_module(path, loaded)
    checkpoint.load_sparse_optimizer(path, 0, loaded_optimizer, loaded_optimizer.state_dict()["param_groups"])

    def by_id(emb, opt) -> dict[str, torch.Tensor]:
        held = torch.nonzero(emb.slots.map.used()).view(-1)
        order = torch.argsort(unmix(emb.slots.map.keys[held]))
        slots = held[order]
        return {"ids": unmix(emb.slots.map.keys[slots]), "rows": emb.shard[slots]} | {
            name: value[slots] for name, value in opt.state[emb.shard].items() if value.dim()}  # fmt: skip

    expected, got = by_id(module.emb, optimizer), by_id(loaded.emb, loaded_optimizer)
    assert len(expected["ids"]) == 63
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_read_only_lookups_neither_admit_nor_pin():
    emb = ls.DynamicEmbedding(4, 3)
    with torch.no_grad():
        assert torch.equal(emb(torch.tensor([7, 8])), torch.zeros(2, 3))
    assert emb.slots.occupancy == 0
    emb(torch.tensor([7]))  # grad mode: admitted
    with torch.no_grad():
        assert not torch.equal(emb(torch.tensor([7, 8])), torch.zeros(2, 3))


# ---------------------------------------------------------------------------- one process
def test_ids_without_a_row_read_zeros_and_drop_their_gradient():
    emb = ls.DynamicEmbedding(2, 3, admit_after=2, seed=1)
    opt = ls.SparseAdam([emb], lr=0.1)
    ids = torch.tensor([2**62, -9, 2**62])
    out = emb(ids)
    assert torch.equal(out, torch.zeros(3, 3))
    out.sum().backward()
    opt.step()
    opt.zero_grad()
    assert torch.equal(emb.shard, torch.zeros_like(emb.shard))  # the null row stayed zero
    out = emb(ids)  # second request: both admitted, rows from init
    expected = ls.init.normal()(torch.tensor([2**62, -9]), 3, 1)
    assert torch.equal(out, expected[[0, 1, 0]])
    ids_u64 = torch.tensor([2**62], dtype=torch.int64).view(torch.uint64)
    assert torch.equal(emb(ids_u64), expected[:1])


def test_a_reused_slot_starts_from_init_with_fresh_optimizer_state():
    emb = ls.DynamicEmbedding(1, 2, seed=3)
    opt = ls.SparseAdam([emb], lr=0.1)
    for ids in ([5], [6], [5]):  # 6 evicts 5, then 5 evicts 6 and comes back as new
        emb(torch.tensor(ids)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state[emb.shard]
    slot = emb.slots.map.find(mix(torch.tensor([5]))).item()
    assert state["row_step"][slot].item() == 1  # one step since it came back, not two
    fresh = ls.DynamicEmbedding(1, 2, seed=3)
    fresh_opt = ls.SparseAdam([fresh], lr=0.1)
    fresh(torch.tensor([5])).sum().backward()
    fresh_opt.step()
    assert torch.equal(emb.export()[1], fresh.export()[1])
    assert emb.slot_stats.evictions == 2


def test_every_public_field_of_slot_stats_reads():
    """Every public field (found by ``dir``, so a new one is covered too) reads as an int; the known ones as counted."""
    emb = ls.DynamicEmbedding(1, 2, seed=3)
    opt = ls.SparseSGD([emb], lr=0.1)
    for ids in ([5], [6], [5]):  # three steps; 6 evicts 5, then 5 evicts 6
        emb(torch.tensor(ids)).sum().backward()
        opt.step()
        opt.zero_grad()
    stats = emb.slot_stats
    fields = {name: getattr(stats, name) for name in dir(stats) if not name.startswith("_")}
    values = {name: value for name, value in fields.items() if not callable(value)}
    assert set(fields) - set(values) == {"reset"}  # the one method; everything else is a field
    assert all(type(value) is int for value in values.values()), values
    expected = {"clock": 3, "occupancy": 1, "admissions": 3, "evictions": 2, "expirations": 0, "rejections": 0}
    assert {name: values[name] for name in expected} == expected
    assert stats.clock == emb.slots.clock and stats.occupancy == emb.slots.occupancy


def test_resetting_slot_stats_zeroes_every_total_and_keeps_occupancy_and_clock():
    """``reset`` zeroes all four totals (admissions, evictions, expirations, rejections), which count on from zero."""
    emb = ls.DynamicEmbedding(1, 2, seed=3, ttl=1)
    opt = ls.SparseSGD([emb], lr=0.1)
    for ids in ([5, 6], [7], [], [8]):  # 6 rejected (5 holds the slot), 7 evicts 5, 7 expires, 8 admitted
        if ids:
            emb(torch.tensor(ids)).sum().backward()
        opt.step()
        opt.zero_grad()
    stats = emb.slot_stats
    totals = ("admissions", "evictions", "expirations", "rejections")
    assert [getattr(stats, name) for name in totals] == [3, 1, 1, 1]
    stats.reset()
    assert [getattr(stats, name) for name in totals] == [0, 0, 0, 0]
    assert (stats.occupancy, stats.clock) == (1, 4)
    emb(torch.tensor([9]))  # evicts 8
    assert [getattr(stats, name) for name in totals] == [1, 1, 0, 0]


def test_bad_ids_raise_with_a_hint():
    emb = ls.DynamicEmbedding(4, 3)
    with pytest.raises(TypeError, match="HINT"):
        emb([1, 2])
    with pytest.raises(TypeError, match="dtype torch.float32"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="Invalid capacity"):
        ls.DynamicEmbedding(0, 3)
    with pytest.raises(ValueError, match="Invalid eviction"):
        ls.DynamicEmbedding(3, 3, eviction="random")


# ---------------------------------------------------------------------------- 1 to 3 ranks
def _train_side_by_side(name: str, kwargs: dict, batches, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A SparseEmbedding fed row numbers and a DynamicEmbedding fed the raw ids of those rows, trained alike.

    Every other step accumulates the gradients of two lookups, so gradients of a lookup other than the last one go too.
    """
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sparse = ls.SparseEmbedding(N, D, seed=SEED, device=device)
    dynamic = ls.DynamicEmbedding(4 * N, D, seed=SEED, init=RowOfRawId(RAW), device=device)  # room on every rank
    opts = [getattr(ls, name)([table], **kwargs) for table in (sparse, dynamic)]
    for step, (ids, target) in enumerate(batches):
        mine = torch.tensor_split(torch.arange(len(ids)), world)[rank]
        for table, opt in zip((sparse, dynamic), opts):
            for part in mine.tensor_split(1 + step % 2):  # every other step: two lookups, then one optimizer step
                rows = ids[part].to(device)
                fed = rows if table is sparse else RAW.to(device)[rows]
                batch_loss(table(fed), target[part].to(device)).mean().backward()
            opt.step()
            opt.zero_grad()
    ids, rows = dynamic.export()
    return sparse.full_weight().cpu(), ids.cpu(), rows.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_sparse_embedding_while_ids_fit(rank_pools, world_size, case, device):
    name, kwargs = CASES[case]
    batches = make_batches()
    used = torch.unique(torch.cat([ids.view(-1) for ids, _ in batches]))
    by_id = used[torch.argsort(RAW[used])]  # the rows looked up, in the order of their raw ids
    initial = ls.init.normal()(by_id, D, SEED)
    for sparse, ids, rows in rank_pools(world_size, device).run(_train_side_by_side, name, kwargs, batches, device):
        assert torch.equal(ids, RAW[by_id])  # exactly the ids looked up hold rows
        torch.testing.assert_close(rows, sparse[by_id], rtol=0, atol=0)
        assert not torch.equal(rows, initial), "the run must actually train"


# ---------------------------------------------------------------------------- Lightning
USER_RAW = mix(torch.arange(200) * 104729 + 7)  # raw 64-bit ids of the towers' users


def _lightning_models():
    import lightning_models as lm

    class HashedTower(lm.CollectionTower):
        """CollectionTower whose user table is a DynamicEmbedding, fed the users' raw 64-bit ids."""

        def __init__(self, capacity: int = 4 * lm.USERS, **kwargs) -> None:
            super().__init__(**kwargs)
            self.embeddings.tables._modules["users"] = ls.DynamicEmbedding(capacity, lm.DIM, seed=1, init=RowOfRawId(USER_RAW))

        def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
            return super().forward(USER_RAW.to(users.device)[users], items)

    return lm, HashedTower


def _users_by_id(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(row numbers, rows) of the users that hold a row, for either tower (collective)."""
    table = module.users
    if isinstance(table, ls.DynamicEmbedding):
        ids, rows = table.export()
        return torch.argsort(USER_RAW)[torch.searchsorted(USER_RAW.sort().values, ids)], rows
    return torch.arange(table.num_embeddings), table.full_weight()


def _fit_and_predict(dynamic: bool, directory: str) -> dict:
    """2 epochs with accumulation, then predict with uneven loaders (rank 1 serves rank 0's lookups).

    The stats of every optimizer step go to ``directory``'s CSV log; ``logged`` holds the last step's."""
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    lm, HashedTower = _lightning_models()
    rank = torch.distributed.get_rank()
    lm.lightning_env(rank, 2)
    module = (HashedTower if dynamic else lm.CollectionTower)(sparse="SparseAdagrad")
    trainer = lm.trainer(2, max_epochs=2, accumulate_grad_batches=2, log_every_n_steps=1, callbacks=[ls.SparseStatsMonitor()],
                         logger=CSVLogger(directory, name="run", version=0))  # fmt: skip
    trainer.fit(module)
    logged = {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("sparse/")}
    data, index = lm.dataset(9), torch.arange(7) if rank == 0 else torch.arange(7, 9)  # 4 batches and 1
    loader = DataLoader(TensorDataset(data.tensors[0][index], data.tensors[1][index], index), batch_size=2)
    predictions = torch.cat(lm.trainer(2, use_distributed_sampler=False).predict(module, loader))
    rows, users = _users_by_id(module)
    return {"mlp": [p.detach().clone() for p in module.mlp.parameters()], "items": module.items.full_weight(),
            "user_rows": rows, "users": users, "predictions": predictions, "logged": logged}  # fmt: skip


def test_a_lightning_fit_equals_the_same_model_with_sparse_tables(rank_pools, tmp_path):
    """In a collection, under sparse_ddp, with accumulation and uneven prediction loaders.

    SparseStatsMonitor logs each optimizer step's admissions (summed over the ranks): over the fit they add up to the ids
    that hold a row at its end (nothing evicted)."""
    import csv

    expected = rank_pools(2).run(_fit_and_predict, False, str(tmp_path / "sparse"))
    got = rank_pools(2).run(_fit_and_predict, True, str(tmp_path / "dynamic"))
    users = "sparse/embeddings.tables.users"
    with open(tmp_path / "dynamic" / "run" / "version_0" / "metrics.csv") as f:
        steps = [row for row in csv.DictReader(f) if row.get(f"{users}/admissions")]
    assert len(steps) == 6  # 2 epochs of 3 optimizer steps (2 batches each)
    assert sum(float(row[f"{users}/admissions"]) for row in steps) == len(got[0]["user_rows"]) > 0
    assert all(float(row[f"{users}/rejections"]) == 0 for row in steps)
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine["predictions"], theirs["predictions"])
        assert mine["logged"][f"{users}/occupancy"] == len(mine["user_rows"])  # summed over the ranks
        assert mine["logged"][f"{users}/evictions"] == 0 and f"{users}/occupancy" not in theirs["logged"]
        assert sorted(mine["user_rows"].tolist()) == sorted(set(lm_users_seen()))
        torch.testing.assert_close(mine["users"], theirs["users"][mine["user_rows"]], rtol=0, atol=0)
        torch.testing.assert_close(mine["items"], theirs["items"], rtol=0, atol=0)
        for a, b in zip(mine["mlp"], theirs["mlp"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def lm_users_seen() -> list[int]:
    import lightning_models as lm

    return lm.dataset().tensors[0].tolist()


def _per_id_state(module, trainer) -> dict:
    """The users' rows and their SparseAdam state by id, the items, the step and the users' slot clock (collective)."""
    from lightning_sparse.wire.hashing import unmix

    table = module.users
    optimizer = next(o for o in trainer.optimizers if isinstance(o, ls.SparseAdam))
    slots = {name: table.gather_rows(value) for name, value in table.slot_state().items()}
    held = torch.nonzero(slots["slot_used"]).view(-1)
    order = torch.argsort(unmix(slots["slot_keys"][held]))
    out = {f"users.{name}": table.gather_rows(value)[held][order]
           for name, value in optimizer.state[table.shard].items() if value.dim()}  # fmt: skip
    out["users.ids"], out["users.rows"] = table.export()
    out["items"], out["step"] = module.items.full_weight(), torch.tensor(trainer.global_step)
    out["users.clock"] = torch.tensor(table.slot_stats.clock)  # last uses are stamped with it: a load restores it too
    out.update({name: p.detach().clone() for name, p in module.mlp.named_parameters()})
    return out


def _checkpoint_job(world_size: int, directory: str, ckpt: str | None, capacity: int) -> tuple[dict, str]:
    lm, HashedTower = _lightning_models()
    lm.lightning_env(torch.distributed.get_rank(), world_size)
    module = HashedTower(capacity=capacity, sparse="mixed", dense="Adam", dense_lr=0.01)
    trainer = lm.trainer(world_size, max_epochs=2, enable_checkpointing=ckpt is None, default_root_dir=directory)
    trainer.fit(module, ckpt_path=ckpt)  # from a checkpoint at the end of epoch 2: nothing left to train
    return _per_id_state(module, trainer), (trainer.checkpoint_callback.best_model_path if ckpt is None else "")


def test_a_checkpoint_of_dynamic_tables_loads_on_any_number_of_ranks(rank_pools, tmp_path):
    (expected, ckpt), *_ = rank_pools(2).run(_checkpoint_job, 2, str(tmp_path), None, 100)
    assert expected["step"] > 0 and bool((expected["users.row_step"] > 0).all())
    for world_size in (3, 1):
        for got, _ in rank_pools(world_size).run(_checkpoint_job, world_size, str(tmp_path), ckpt, 100):
            assert set(got) == set(expected)
            for key, value in expected.items():
                torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"2 -> {world_size} ranks: {key}")
    exported = torch.load(checkpoint_export(ckpt, tmp_path / "export.pt"))  # ids and their rows
    assert torch.equal(exported["embeddings.tables.users.ids"], expected["users.ids"])
    assert torch.equal(exported["embeddings.tables.users.weight"], expected["users.rows"])
    # A table with less room keeps the ids used last (LRU) with their state.
    got, _ = rank_pools(1).run(_checkpoint_job, 1, str(tmp_path), ckpt, 5)[0]
    kept = torch.searchsorted(expected["users.ids"], got["users.ids"])
    assert len(got["users.ids"]) == 5 and torch.equal(expected["users.ids"][kept], got["users.ids"])
    torch.testing.assert_close(got["users.exp_avg"], expected["users.exp_avg"][kept], rtol=0, atol=0)


def _serve_and_fail_together() -> tuple[torch.Tensor, torch.Tensor, str]:
    rank = torch.distributed.get_rank()
    emb = ls.DynamicEmbedding(8, 3, seed=4)
    emb(torch.tensor([rank * 10, rank * 10 + 1]))  # training lookups: admitted
    with torch.no_grad():  # rank 0 makes two lookups, rank 1 one, then answers rank 0's second
        looked_up = emb(torch.tensor([0, 1, 10, 99] if rank == 0 else [11]))
        if rank == 0:
            looked_up = torch.cat([looked_up, emb(torch.tensor([11, 12]))])
        ls.serve_lookups([emb])
    try:
        emb(torch.tensor([0.5]) if rank == 1 else torch.tensor([1]))  # bad ids on rank 1 only
        error = ""
    except TypeError as err:
        error = str(err)
    return looked_up, emb(torch.tensor([1, 11])).detach(), error


def test_uneven_lookups_are_served_and_bad_ids_raise_on_every_rank(rank_pools):
    (mine, after, error), (theirs, _, other_error) = rank_pools(2).run(_serve_and_fail_together)
    init = ls.init.normal()(torch.tensor([0, 1, 10, 11]), 3, 4)
    zero = torch.zeros(1, 3)
    assert torch.equal(mine, torch.cat([init[:3], zero, init[3:], zero]))  # 99 and 12 hold no row: zeros
    assert torch.equal(theirs, init[3:])
    assert "dtype torch.float32 on rank 1" in error and "dtype torch.float32 on this rank" in other_error
    assert torch.equal(after, init[[1, 3]])  # the group is still usable


def _one_id_asked_for_by_two_ranks() -> torch.Tensor:
    rank = torch.distributed.get_rank()
    emb = ls.DynamicEmbedding(8, 3, admit_after=2, seed=4)
    emb(torch.tensor([42, 7] if rank == 0 else [42]))  # training lookups: 42 asked for by both ranks, 7 by rank 0 only
    with torch.no_grad():
        return emb(torch.tensor([42, 7]))


def test_requests_of_one_id_from_several_ranks_add_up_to_its_admission(rank_pools):
    """A request is one rank's lookup asking for the id: two ranks in one step are two requests (admit_after=2)."""
    for rows in rank_pools(2).run(_one_id_asked_for_by_two_ranks):
        assert torch.equal(rows, torch.cat([ls.init.normal()(torch.tensor([42]), 3, 4), torch.zeros(1, 3)]))


def test_in_a_collection_ids_without_a_row_pool_as_zero_rows():
    dynamic = ls.DynamicEmbedding(10, 2, admit_after=2, seed=5)
    static = ls.SparseEmbedding(4, 2, seed=6)
    collection = ls.SparseEmbeddingCollection({"hashed": dynamic, "plain": static}, pooling={"bags": "mean"},
                                              features={"bags": "hashed", "one": "hashed", "plain": "plain"})  # fmt: skip
    batch = {"bags": ls.JaggedIds(torch.tensor([2**50, 7, 7]), lengths=torch.tensor([2, 1])),
             "one": torch.tensor([7]), "plain": torch.tensor([3])}  # fmt: skip
    first = collection(batch)  # 7 is asked for twice in one lookup: one request, no row yet
    assert torch.equal(first["bags"], torch.zeros(2, 2)) and torch.equal(first["one"], torch.zeros(1, 2))
    second = collection(batch)  # the second request: both admitted
    rows = ls.init.normal()(torch.tensor([2**50, 7]), 2, 5)
    torch.testing.assert_close(second["bags"], torch.stack([rows.mean(0), rows[1]]))
    with torch.no_grad():
        third = collection({"bags": ls.JaggedIds(torch.tensor([7, 123]), lengths=torch.tensor([2]))})
    torch.testing.assert_close(third["bags"], rows[1:] / 2)  # 123 holds no row: a zero row in the mean


def checkpoint_export(ckpt: str, out):
    from lightning_sparse import checkpoint

    checkpoint.export(ckpt, out)
    return out


def test_the_admission_sketch_never_underestimates_and_fades():
    from lightning_sparse.tables.admission import CountSketch

    sketch = CountSketch(64)
    keys = mix(torch.arange(40))
    estimate = sketch.add(keys, torch.ones(40, dtype=torch.int64))
    assert bool((estimate >= 1).all())  # never below the true count
    # and exact for a key that has a counter of its own in any of the 4 rows (the least of its counters): 38 of these 40
    # (a key shares each row's counter with another with odds 1 - (63/64)^39, about 0.46; all four: about 0.05)
    assert int((estimate == 1).sum()) >= 36
    assert bool((sketch.add(keys[:10], torch.full((10,), 3)) >= 4).all())
    assert sketch.added == 0 and bool((sketch.counters.sum(1) <= 35).all())  # 70 requests >= width 64: halved
    assert bool((sketch.add(keys[:10], torch.zeros(10, dtype=torch.int64)) >= 2).all())  # halved, still not below


@pytest.mark.parametrize("kernels", ["torch", "triton"])  # a CPU's host read, or the GPU's path without one
def test_the_admission_sketch_halves_at_exactly_width_requests(kernels, monkeypatch):
    """The counters are halved once they took ``width`` requests (64 here), not one request later."""
    from lightning_sparse.kernels import backend
    from lightning_sparse.tables.admission import CountSketch

    if kernels == "triton" and not (backend.interpreting() and backend.triton_available()):
        pytest.skip("needs triton's interpreter")
    monkeypatch.setenv(backend.ENV, kernels)
    sketch = CountSketch(64)
    keys = mix(torch.arange(64))
    sketch.add(keys[:63], torch.ones(63, dtype=torch.int64))
    assert int(sketch.added) == 63 and sketch.counters.sum(1).tolist() == [63] * 4  # not yet
    sketch.add(keys[63:], torch.ones(1, dtype=torch.int64))
    assert int(sketch.added) == 0 and bool((sketch.counters.sum(1) <= 32).all()), sketch.counters.sum(1)  # 64 counts, halved


def test_the_guide_example_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "dynamic.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "DynamicEmbedding(capacity=" in b]
    namespace: dict = {}
    exec(block, namespace)
    assert torch.equal(namespace["rows"], torch.zeros(3, 16))  # a first request: no row yet (admit_after=2)
    assert namespace["users"].slot_stats.occupancy == 0 and isinstance(namespace["optimizer"], ls.SparseAdagrad)
