"""A DynamicEmbedding on a CPU: the numba loops make the torch ops' decisions, and lru eviction follows its rule.

With numba (``LIGHTNING_SPARSE_KERNELS=auto`` or ``numba`` on CPU tensors) a one-process lookup finds
each id's slot in one loop, without sorting the batch (``SlotTable.resolve_ids``), and the slot map
reserves and places new keys in loops (``tables/slot_kernels.py``); ``torch`` runs the plain torch
ops. Both keep an ``"lru"`` table's eviction order between batches (``free_slots.LruQueue``).
"""

from __future__ import annotations

import pytest
import torch

import lightning_sparse as ls
from lightning_sparse.kernels import backend
from lightning_sparse.tables.slot_map import SlotMap
from lightning_sparse.wire.hashing import mix, unmix

pytestmark = pytest.mark.skipif(not backend.numba_available(), reason="needs numba")

CASES = {
    "room": dict(capacity=400),
    "full, lru": dict(capacity=40),
    "full, lfu, ttl": dict(capacity=40, eviction="lfu", ttl=2),
    "admit on the 2nd request": dict(capacity=400, admit_after=2, sketch_width=64),
}


def _batches(steps: int, size: int = 48) -> list[torch.Tensor]:
    """Raw ids: repeats within a batch and across batches, 8 new ones a step; at steps 2 and 3, 20 ids whose keys share
    both their groups of the slot map (``CROWDED``): some find no entry, and their admissions are rejections."""
    gen = torch.Generator().manual_seed(0)
    old = [(60 * torch.rand(size - 8, generator=gen) ** 2).long() for _ in range(steps)]
    batches = [mix(torch.cat([o, 1000 + 8 * step + torch.arange(8)]) * 2 + 1) for step, o in enumerate(old)]
    for step in (2, 3):
        batches[step][: len(CROWDED)] = unmix(CROWDED)
    return batches


CROWDED = (torch.arange(1, 21) << 40) + (1 << 32)  # 20 keys for the same two groups of 8 (groups 0 and 2 of a map)


def _train(options: dict, kernels: str, monkeypatch) -> ls.DynamicEmbedding:
    monkeypatch.setenv(backend.ENV, kernels)
    emb = ls.DynamicEmbedding(**options, embedding_dim=4, seed=1)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    for step, ids in enumerate(_batches(8)):
        emb(ids.view(6, 8)).sub(0.5).pow(2).sum().backward()  # (rows of ids without one, zeros, get a gradient too)
        opt.step()
        opt.zero_grad()
        if step % 3 == 1:
            with torch.no_grad():  # reads only: no admission, no stamp
                emb(ids + 1)
    return emb


@pytest.mark.parametrize("case", list(CASES))
def test_the_numba_loops_make_the_same_decisions_and_rows_as_the_torch_ops(case, monkeypatch):
    exact, looped = (_train(CASES[case], kernels, monkeypatch) for kernels in ("torch", "numba"))
    for name, value in exact.slot_state().items():
        assert torch.equal(looped.slot_state()[name], value), name
    fields = ("admissions", "evictions", "expirations", "rejections", "occupancy")
    assert [getattr(looped.slot_stats, n) for n in fields] == [getattr(exact.slot_stats, n) for n in fields]
    (ids, rows), (exact_ids, exact_rows) = looped.export(), exact.export()
    assert torch.equal(ids, exact_ids)
    # the decisions are compared bit for bit above; the rows went through each choice's update (numba's fused one or torch ops)
    torch.testing.assert_close(rows, exact_rows, rtol=1e-5, atol=1e-6)
    assert exact.slot_stats.evictions > 0 if "full" in case else exact.slot_stats.admissions > 0
    assert exact.slot_stats.rejections > 0
    assert not looped.shard[0].any() and not exact.shard[0].any()  # the null row: back to zero after the rejected ids' steps


def test_the_numba_slot_map_reserves_writes_and_finds_as_its_torch_ops(monkeypatch):
    keys = mix(torch.randperm(10**6, generator=torch.Generator().manual_seed(0))[:700])
    crowded = CROWDED
    maps = {}
    for kernels in ("torch", "numba"):
        monkeypatch.setenv(backend.ENV, kernels)
        slots = SlotMap(1000)
        slots.write(slots.reserve(keys[:500]), keys[:500], torch.arange(1, 501))
        slots.remove(torch.arange(1, 501, 3))  # emptied entries are taken again
        valid = torch.arange(200) % 4 != 3
        new = keys[500:].flip(0)  # not in key order: ties in a group go to the smaller key
        slots.write(slots.reserve(new, valid), new, torch.where(torch.arange(200) < 150, torch.arange(501, 701), 0))
        entries = slots.reserve(crowded)  # both groups fill up: some get no entry
        slots.write(entries, crowded, torch.where(entries >= 0, torch.arange(701, 721), 0))
        maps[kernels] = slots
        assert 0 < int((entries < 0).sum()) < 20
    assert torch.equal(maps["numba"].buckets, maps["torch"].buckets)
    monkeypatch.setenv(backend.ENV, "numba")
    everything = torch.cat([keys, crowded, mix(torch.arange(-50, 0))])
    found = maps["numba"].find(everything)
    monkeypatch.setenv(backend.ENV, "torch")
    assert torch.equal(found, maps["torch"].find(everything)) and int((found > 0).sum()) > 400


@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_lru_evicts_the_unpinned_slots_used_longest_ago_lowest_slot_first(kernels, monkeypatch):
    """The rule, checked on the table's own state before each batch, over enough batches to renew the kept order often."""
    monkeypatch.setenv(backend.ENV, kernels)
    emb = ls.DynamicEmbedding(100, 4, seed=1)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(40):
        ids = torch.cat([(300 * torch.rand(40, generator=gen) ** 2).long(), 10_000 + 10 * step + torch.arange(10)])
        table = emb.slots
        used, last_used = table.map.used(), table.last_used.clone()
        slots_before = table.map.keys.clone()
        found = table.map.find(torch.unique(mix(ids)))  # these are used now: pinned before the new ones come
        new, pinned = int((found == 0).sum()), last_used.index_fill(0, found, table.clock)
        short = max(0, new - (table.capacity - table.occupancy))
        unpinned = torch.nonzero(used & (pinned < table.clock)).view(-1)
        order = sorted(unpinned.tolist(), key=lambda slot: (int(last_used[slot]), slot))
        evictions = emb.slot_stats.evictions
        emb(ids).sum().backward()
        assert emb.slot_stats.evictions - evictions == min(short, len(order))
        evicted = set(order[: min(short, len(order))])
        gone = {slot for slot in range(1, 101) if used[slot] and table.map.keys[slot] != slots_before[slot]}
        assert gone == evicted, step
        opt.step()
        opt.zero_grad()
    assert emb.slot_stats.evictions > 250
