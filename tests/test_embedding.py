"""SparseEmbedding: lookups, initialization, bad input, state dicts, on 1, 2 and 3 ranks."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rank_pool import COLLECTIVE_TIMEOUT_S, DEVICES

import lightning_sparse as ls
from lightning_sparse.tables import placement


def _rank() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


# ---------------------------------------------------------------- lookups and one step, as properties
def _lookup_and_step(num_embeddings, dim, scheme, ids_per_rank, coefs_per_rank, id_dtype, duplicate_grads, device):
    rank, world = _rank()
    emb = ls.SparseEmbedding(num_embeddings, dim, sharding=scheme, seed=5, device=device)
    opt = ls.SparseSGD([emb], lr=1.0, duplicate_grads=duplicate_grads)
    ids = ids_per_rank[rank].to(device=device, dtype=id_dtype)
    out = emb(ids)
    (out * coefs_per_rank[rank].to(device)).sum().backward()
    opt.step()
    return out.detach().cpu(), emb.full_weight().cpu()


@st.composite
def lookup_cases(draw, world_size):
    num_embeddings = draw(st.integers(1, 12))
    dim = draw(st.integers(1, 3))
    scheme = draw(st.sampled_from(["mod", "range"]))
    bag = draw(st.sampled_from([None, 1, 3]))  # None: 1-D ids; else ids of shape [B, bag]
    only_owner = draw(st.booleans())  # all ids owned by rank 0 ("mod": multiples of W)
    ids_per_rank, coefs_per_rank = [], []
    for _ in range(world_size):
        batch = draw(st.integers(0, 5))  # some ranks may look up nothing
        count = batch * (bag or 1)
        if only_owner and num_embeddings >= 1:
            owned = list(ls.RowSharding(num_embeddings, world_size, scheme).global_ids(0).tolist()) or [0]
            values = draw(st.lists(st.sampled_from(owned), min_size=count, max_size=count))
        else:
            values = draw(st.lists(st.integers(0, num_embeddings - 1), min_size=count, max_size=count))
        ids = torch.tensor(values, dtype=torch.int64).view(batch, bag) if bag else torch.tensor(values, dtype=torch.int64)
        ids_per_rank.append(ids)
        seed = draw(st.integers(0, 2**16))
        coefs_per_rank.append(torch.randn(*ids.shape, dim, generator=torch.Generator().manual_seed(seed)))
    id_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    duplicate_grads = draw(st.sampled_from(["sum", "mean"]))
    return num_embeddings, dim, scheme, ids_per_rank, coefs_per_rank, id_dtype, duplicate_grads


def _expected(num_embeddings, dim, ids_per_rank, coefs_per_rank, duplicate_grads):
    table = ls.init.normal()(torch.arange(num_embeddings), dim, 5)
    grad = torch.zeros(num_embeddings, dim)
    count = torch.zeros(num_embeddings)
    for ids, coefs in zip(ids_per_rank, coefs_per_rank):
        grad.index_add_(0, ids.reshape(-1), coefs.reshape(-1, dim))
        count.index_add_(0, ids.reshape(-1), torch.ones(ids.numel()))
    if duplicate_grads == "mean":
        grad = grad / count.clamp(min=1).unsqueeze(1)
    else:
        grad = grad / len(ids_per_rank)
    return table, table - grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_lookup_and_step_properties(rank_pools, world_size, device):
    pool = rank_pools(world_size, device)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=lookup_cases(world_size))
    def check(case):
        num_embeddings, dim, scheme, ids_per_rank, coefs_per_rank, id_dtype, duplicate_grads = case
        results = pool.run(_lookup_and_step, *case, device)
        table, stepped = _expected(num_embeddings, dim, ids_per_rank, coefs_per_rank, duplicate_grads)
        for rank, (out, full) in enumerate(results):
            ids = ids_per_rank[rank]
            assert out.shape == (*ids.shape, dim)
            torch.testing.assert_close(out, table[ids], rtol=0, atol=0)
            torch.testing.assert_close(full, stepped, rtol=1e-5, atol=1e-6)

    check()


# ---------------------------------------------------------------- initialization
def _full_table(num_embeddings, dim, scheme, seed):
    return ls.SparseEmbedding(num_embeddings, dim, sharding=scheme, seed=seed).full_weight()


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("scheme", ["mod", "range"])
def test_initial_table_independent_of_world_size_and_scheme(rank_pools, world_size, scheme):
    expected = ls.SparseEmbedding(31, 6, seed=9).full_weight()  # no process group: local table
    for full in rank_pools(world_size).run(_full_table, 31, 6, scheme, 9):
        torch.testing.assert_close(full, expected, rtol=0, atol=0)
    other_seed = ls.SparseEmbedding(31, 6, seed=10).full_weight()
    assert not torch.equal(other_seed, expected)


def test_default_init_statistics():
    table = ls.SparseEmbedding(20_000, 16, seed=0).full_weight()
    assert abs(table.mean().item()) < 0.01
    assert table.std().item() == pytest.approx(1 / 16**0.5, rel=0.02)
    uniform = ls.SparseEmbedding(20_000, 4, init=ls.init.uniform(-0.5, 0.5)).full_weight()
    assert uniform.min() >= -0.5 and uniform.max() < 0.5
    assert uniform.mean().abs() < 0.01


def test_pretrained_init_from_tensor():
    pretrained = torch.randn(7, 3)
    emb = ls.SparseEmbedding(7, 3, init=ls.init.from_tensor(pretrained))
    torch.testing.assert_close(emb.full_weight(), pretrained)
    with pytest.raises(ValueError, match="has dim 3 but the SparseEmbedding has embedding_dim=4"):
        ls.SparseEmbedding(7, 4, init=ls.init.from_tensor(pretrained)).materialize()


def _shard_rows(num_embeddings, dim):
    emb = ls.SparseEmbedding(num_embeddings, dim, sharding="range")
    constructed_lazily = not emb.is_materialized
    return constructed_lazily, tuple(emb.shard.shape)


def test_large_table_materializes_only_the_local_shard(rank_pools):
    # 30M rows: a rank holds 10M of them and never the whole table.
    results = rank_pools(3).run(_shard_rows, 30_000_000, 1)
    assert results == [(True, (10_000_000, 1))] * 3


def test_construction_allocates_nothing():
    emb = ls.SparseEmbedding(10**12, 1024)  # 4 PB if it were allocated
    assert not emb.is_materialized
    assert list(emb.parameters()) == [] and list(emb.buffers()) == []


def test_follows_to_and_keeps_shard_identity():
    emb = ls.SparseEmbedding(5, 2)
    shard = emb.shard
    opt = ls.SparseSGD([emb], lr=0.1)
    emb.double()
    assert emb.shard is shard and shard.dtype == torch.float64
    lazy = ls.SparseEmbedding(5, 2).to(torch.float64)
    assert lazy.shard.dtype == torch.float64
    assert opt.tables == [emb]


# ---------------------------------------------------------------- bad input fails on every rank
def _bad_lookup(bad_rank, bad_ids, device="cpu"):
    rank, _ = _rank()
    emb = ls.SparseEmbedding(10, 2, name="items", device=device)
    if isinstance(bad_ids, str) and bad_ids == "meta":
        bad_ids = torch.tensor([1, 2], device="meta")
    elif isinstance(bad_ids, torch.Tensor) and bad_ids.device.type != "meta" and bad_ids.dtype != torch.uint64:
        bad_ids = bad_ids.to(device)
    ids = bad_ids if rank == bad_rank else torch.tensor([1, 2], device=device)
    opt = ls.SparseSGD([emb], lr=0.1)
    start = time.monotonic()
    try:  # on a CPU, or on several ranks, the lookup raises; one GPU checks the ids on the device, and the step raises
        emb(ids).sum().backward()
        opt.step()
        if device == "cuda":  # ... once the verdict's copy is done: else the next lookup (lookup/range_check.py)
            torch.cuda.synchronize()
            emb(torch.tensor([1], device=device))
    except (IndexError, TypeError, RuntimeError) as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return None


def _healthy_lookup(device="cpu"):
    return ls.SparseEmbedding(10, 2, device=device)(torch.tensor([1, 9], device=device)).shape


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize(
    "bad_ids, error, message",
    [
        (torch.tensor([3, 10]), "IndexError", "got id 10 on {where}; valid ids are 0..9"),
        (torch.tensor([[-4, 1]]), "IndexError", "got id -4 on {where}; valid ids are 0..9"),
        (torch.tensor([1.0, 2.0]), "TypeError", "got ids of dtype torch.float32 on {where}; ids must be integers"),
        (torch.tensor([True]), "TypeError", "got ids of dtype torch.bool"),
        ([1, 2], "TypeError", "got ids of type list on {where}; ids must be a torch.Tensor"),
        (np.array([1, 2]), "TypeError", "got ids of type ndarray on {where}; ids must be a torch.Tensor"),
        ("meta", "RuntimeError", "could not read the ids on {where} (a meta tensor of dtype torch.int64"),
        (
            torch.tensor([3, 2**63 + 5], dtype=torch.uint64),
            "IndexError",
            "got an id of 2**63 or more (dtype torch.uint64) on {where}",
        ),
    ],
    ids=["too-large", "negative", "float", "bool", "list", "ndarray", "meta", "uint64-too-large"],
)
def test_bad_ids_raise_on_every_rank(rank_pools, world_size, bad_ids, error, message, device):
    pool = rank_pools(world_size, device)
    bad_rank = world_size - 1
    results = pool.run(_bad_lookup, bad_rank, bad_ids, device)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} did not raise"
        name, text, seconds = result
        where = "this rank" if rank == bad_rank else f"rank {bad_rank}"
        assert name == error
        assert message.format(where=where) in text
        assert "items" in text and "HINT:" in text
        assert seconds < COLLECTIVE_TIMEOUT_S, "a rank waited for a collective to time out"
    # The group is still usable: nothing is left half-way in a collective.
    assert pool.run(_healthy_lookup, device) == [torch.Size([2, 2])] * world_size


def test_bad_ids_without_process_group():
    emb = ls.SparseEmbedding(4, 2, name="users")
    with pytest.raises(IndexError, match=r"users got id 4 on this rank; valid ids are 0..3 \(num_embeddings=4\)"):
        emb(torch.tensor([4]))
    with pytest.raises(TypeError, match="HINT: wrap them in torch.tensor"):
        emb([1, 2])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16])
def test_unsigned_and_narrow_ids_are_accepted(dtype):
    emb = ls.SparseEmbedding(300, 3, seed=2)
    ids = torch.tensor([[0, 255], [7, 7]])
    torch.testing.assert_close(emb(ids.to(dtype)), emb(ids), rtol=0, atol=0)


# ---------------------------------------------------------------- state dicts
def test_local_state_dict_round_trip_and_nn_embedding_export():
    emb = ls.SparseEmbedding(6, 3, seed=1)
    other = ls.SparseEmbedding(6, 3, seed=2)
    other.load_state_dict(emb.state_dict())
    torch.testing.assert_close(other.full_weight(), emb.full_weight())
    full = ls.full_state_dict(torch.nn.ModuleDict({"table": emb}))
    plain = torch.nn.ModuleDict({"table": torch.nn.Embedding(6, 3)})
    plain.load_state_dict(full)
    torch.testing.assert_close(plain["table"].weight.detach(), emb.full_weight())


def _state_dicts(seed):
    emb = ls.SparseEmbedding(8, 2, seed=seed)
    module = torch.nn.ModuleDict({"table": emb})
    return module.state_dict(), ls.full_state_dict(module)


def _load(state_dict):
    """This rank's rows after loading, as (global ids, rows), or the error; no collective."""
    emb = ls.SparseEmbedding(8, 2, seed=99)
    try:
        torch.nn.ModuleDict({"table": emb}).load_state_dict(state_dict)
    except RuntimeError as err:
        return str(err)
    return emb.sharding.global_ids(emb.rank), emb.shard.clone()


def test_sharded_state_dicts_never_load_silently_on_another_rank(rank_pools):
    pool = rank_pools(2)
    (shard0, full0), (shard1, full1) = pool.run(_state_dicts, 3)
    expected = ls.SparseEmbedding(8, 2, seed=3).full_weight()
    torch.testing.assert_close(full0["table.weight"], expected)
    for ids, rows in pool.run(_load, full0):  # a full table loads on every rank
        torch.testing.assert_close(rows, expected[ids], rtol=0, atol=0)
    # Rank 0's shard handed to both ranks: rank 0 accepts it, rank 1 refuses with a HINT.
    loaded = pool.run(_load, shard0)
    torch.testing.assert_close(loaded[0][1], expected[loaded[0][0]], rtol=0, atol=0)
    assert "holds rank 0's shard of 2" in loaded[1] and "HINT" in loaded[1]


def _loaded_before_the_process_group(full):
    """A table built and loaded before init_process_group (as a script does before Trainer.fit), then used: its rows."""
    from unittest import mock

    with mock.patch.object(torch.distributed, "is_initialized", return_value=False):
        emb = ls.SparseEmbedding(*full.shape, seed=99)
        emb.load_state_dict({"weight": full})  # a local table of one rank: the whole table
        assert emb.world_size == 1 and emb.shard.shape == full.shape
    emb(torch.tensor([0]))  # placed over the group now: the loaded table is cut to this rank's rows
    return emb.sharding.global_ids(emb.rank), emb.shard.clone()


def test_a_table_loaded_before_the_process_group_keeps_its_rows_once_placed(rank_pools):
    full = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
    for rank, (ids, rows) in enumerate(rank_pools(3).run(_loaded_before_the_process_group, full)):
        torch.testing.assert_close(rows, full[ids], rtol=0, atol=0, msg=f"rank {rank}")


def _advised_for_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether the memory map entry holding the tensor's first whole 2 MiB page is madvised for huge pages ("hg")."""
    address = -(-tensor.data_ptr() // placement.HUGE_PAGE_BYTES) * placement.HUGE_PAGE_BYTES
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(bound, 16) for bound in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no memory map entry holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and transparent huge pages are Linux's")
def test_a_big_cpu_shard_its_optimizer_state_and_its_slot_map_are_advised_onto_huge_pages():
    table, dynamic = ls.SparseEmbedding(40_000, 64), ls.DynamicEmbedding(600_000, 8)
    adam, adagrad = ls.SparseAdam([table], bias_correction="row"), ls.SparseAdagrad([dynamic])
    table(torch.arange(5)).sum().backward()
    dynamic(torch.arange(5)).sum().backward()
    adam.step()
    adagrad.step()
    slots = dynamic.slots
    advised = {"shard": table.shard, "dynamic shard": dynamic.shard, "adagrad sum": adagrad.state[dynamic.shard]["sum"],
               "buckets": slots.map.buckets, "slot keys": slots.map.keys, "last use": slots.last_used,
               **{key: adam.state[table.shard][key] for key in ("exp_avg", "exp_avg_sq")}}  # fmt: skip
    assert all(t.nbytes >= 2 * placement.HUGE_PAGE_BYTES for t in advised.values())
    assert {name for name, t in advised.items() if not _advised_for_huge_pages(t)} == set()


def test_huge_page_advice_covers_the_whole_pages_inside_and_is_off_with_the_switch(monkeypatch):
    calls = []
    monkeypatch.setattr(placement, "_madvise", lambda: lambda start, length, advice: calls.append((start, length)))
    rows = placement.empty_rows((3 * placement.HUGE_PAGE_BYTES // 4,), torch.float32, torch.device("cpu"))  # 3 pages' bytes
    ((start, length),) = calls
    assert (
        start % placement.HUGE_PAGE_BYTES == 0 and length % placement.HUGE_PAGE_BYTES == 0 and length >= placement.HUGE_PAGE_BYTES
    )
    assert rows.data_ptr() <= start and start + length <= rows.data_ptr() + rows.nbytes
    placement.empty_rows((placement.HUGE_PAGE_BYTES // 4,), torch.float32, torch.device("cpu"))  # 1 page's bytes: none inside
    monkeypatch.setenv(placement.HUGE_PAGES_ENV, "0")
    placement.empty_rows((3 * placement.HUGE_PAGE_BYTES // 4,), torch.float32, torch.device("cpu"))
    assert len(calls) == 1
