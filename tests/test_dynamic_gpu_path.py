"""A DynamicEmbedding's one-process step on the GPU's code path: no host read, and the same decisions as a CPU's.

On CPU these run the GPU's path through Triton's interpreter (``LIGHTNING_SPARSE_KERNELS=triton``):
batches sized by their bound instead of compacted, counters on the device, eviction only where
the host's floor on the free slots says a batch may run short. On a GPU the step also runs
under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads
from test_capturable import _captured
from test_gpu_path import AtenOps
from test_kernels import GPU_PATH_TOLERANCE, KERNEL_DEVICES

import lightning_sparse as ls
from lightning_sparse.kernels import backend
from lightning_sparse.tables import init as row_init
from lightning_sparse.tables.slot_map import SlotMap
from lightning_sparse.wire.hashing import mix

# name: table options, ids drawn per step (old ones from a pool, then new ones)
CASES = {
    "room": (dict(capacity=400), 48),
    "full, evicting (lru)": (dict(capacity=40), 48),
    "full, evicting (lfu), ttl": (dict(capacity=40, eviction="lfu", ttl=2), 48),
    "admit on the 2nd request": (dict(capacity=400, admit_after=2, sketch_width=64), 48),
}
# The most aten ops (plus Triton launches) of a one-process Adagrad step of a dynamic table with
# room, on the GPU's path: 60 aten ops and 12 launches here. A SparseEmbedding step takes 12; the
# ids' keys (11 ops before), the slot map's find and write and the new rows (hash, then
# Box-Muller: about 33 ops before) are a kernel each, its reserve three (two rounds of claims that
# do not depend on their order, then their settling); the rest is the sort of the keys and the
# slot decisions (about 30 small ops).
MAX_DYNAMIC_STEP_OPS = 72


def _batches(steps: int, size: int, device: str = "cpu") -> list[torch.Tensor]:
    """Ids on ``device``, mixed there (forced Triton kernels take device tensors, or CPU ones under the interpreter)."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        old = (60 * torch.rand(size - 8, generator=gen) ** 2).long()  # repeats within a batch, and across
        batches.append(mix((torch.cat([old, 1000 + 8 * step + torch.arange(8)]) * 2 + 1).to(device)))
    return batches


def _train(options: dict, batches: list[torch.Tensor], device: str, gpu_path: bool, monkeypatch) -> ls.DynamicEmbedding:
    if gpu_path:
        monkeypatch.setenv(backend.ENV, "triton")
    else:
        monkeypatch.setenv(backend.ENV, "torch")
    emb = ls.DynamicEmbedding(**options, embedding_dim=4, seed=1, device=device)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    for ids in batches:
        emb(ids.to(device)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return emb


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_the_gpu_path_makes_the_same_slot_decisions_as_the_exact_one(device, case, monkeypatch):
    options, size = CASES[case]
    batches = _batches(6, size)
    exact = _train(options, batches, device, False, monkeypatch)
    padded = _train(options, batches, device, True, monkeypatch)
    for name, value in exact.slot_state().items():
        assert torch.equal(padded.slot_state()[name], value), name
    stats = exact.slot_stats
    assert [getattr(padded.slot_stats, n) for n in ("admissions", "evictions", "expirations", "rejections", "occupancy")] == [
        getattr(stats, n) for n in ("admissions", "evictions", "expirations", "rejections", "occupancy")]  # fmt: skip
    ids, rows = exact.export()
    padded_ids, padded_rows = padded.export()
    assert torch.equal(ids, padded_ids)
    torch.testing.assert_close(padded_rows, rows, **GPU_PATH_TOLERANCE)  # the torch update against the fused kernel
    if "evicting" in case:
        assert stats.evictions > 0
    if "2nd" in case:
        assert 0 < stats.admissions < len(torch.unique(torch.cat(batches)))


def _step(emb: ls.DynamicEmbedding, opt: ls.SparseAdagrad, ids: torch.Tensor) -> None:
    emb(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_one_process_step_of_a_dynamic_table_reads_the_host_never(device, case, monkeypatch):
    monkeypatch.setenv(backend.ENV, "triton")
    options, size = CASES[case]
    emb = ls.DynamicEmbedding(**options, embedding_dim=4, seed=1, device=device)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    batches = _batches(5, size, device)
    for ids in batches[:3]:  # the table fills (and, if small, starts evicting)
        _step(emb, opt, ids)
    # Known host tensors: the step counter (not capturable), and the free slots' copy, read without waiting.
    with HostReads(ignore=[opt.state[emb.shard]["step"], emb.slots.free._copy._host]) as reads:
        _step(emb, opt, batches[3])
    assert reads.calls == []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(emb, opt, batches[4])
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_dynamic_step_takes_a_bounded_number_of_ops(device, monkeypatch):
    """However large the batch: its new rows (the batch's bound on a GPU's path) are one init, not a CPU's cache-sized chunks."""
    monkeypatch.setenv(backend.ENV, "triton")
    monkeypatch.setattr(row_init, "_CHUNK_ELEMENTS", 64)  # a CPU's init chunk: 16 rows of 4, a third of the batch
    emb = ls.DynamicEmbedding(400, 4, seed=1, device=device)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    batches = _batches(3, 48, device)
    grad = torch.ones(48, 4, device=device)
    for ids in batches[:2]:
        emb(ids).backward(grad)
        opt.step()
        opt.zero_grad()
    launches = backend.launches.count
    with AtenOps(host=[opt.state[emb.shard]["step"]]) as aten:
        emb(batches[2]).backward(grad)
        opt.step()
        opt.zero_grad()
    triton = backend.launches.count - launches
    assert len(aten.ops) + triton <= MAX_DYNAMIC_STEP_OPS, f"{len(aten.ops)} aten ops + {triton} Triton launches"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_keys_kernel_mixes_ids_as_the_torch_ops(device, monkeypatch):
    ids = torch.cat([torch.randint(-(2**63), 2**63 - 1, (700,), generator=torch.Generator().manual_seed(0)),
                     torch.tensor([0, 1, -1, 2**63 - 1, -(2**63)])])  # fmt: skip
    monkeypatch.setenv(backend.ENV, "torch")
    expected = {dtype: mix(ids.to(dtype)) for dtype in (torch.int64, torch.int32)}
    monkeypatch.setenv(backend.ENV, "triton")
    for dtype, want in expected.items():
        before = backend.launches.count
        keys = mix(ids.to(dtype).to(device))
        assert backend.launches.count == before + 1 and torch.equal(keys.cpu(), want)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_slot_map_kernels_find_reserve_and_write_as_its_torch_ops(device, monkeypatch):
    keys = mix(torch.randperm(10**6, generator=torch.Generator().manual_seed(0))[:700]).to(device)
    crowded = ((torch.arange(1, 21) << 40) + (1 << 32)).to(device)  # 20 keys for the same two groups of 8
    found = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv(backend.ENV, kernels)
        slots = SlotMap(1000, device)
        slots.write(slots.reserve(keys[:500]), keys[:500], torch.arange(1, 501, device=device))
        slots.remove(torch.arange(1, 501, 3, device=device))  # emptied entries are taken again
        valid = torch.arange(200, device=device) % 4 != 3
        entries = slots.reserve(keys[500:], valid)
        assert bool((entries[valid] >= 0).all()) and not bool((entries[~valid] >= 0).any())
        assert len(torch.unique(entries[valid])) == int(valid.sum())  # no entry twice
        groups = slots.groups(keys[500:])
        assert bool(((entries[valid] // 8).unsqueeze(1) == groups[valid]).any(dim=1).all())  # in one of its groups
        given = torch.where(torch.arange(200, device=device) < 150, torch.arange(501, 701, device=device), 0)
        slots.write(entries, keys[500:], given)  # the last 50 get no slot: their entries are empty again
        assert int((slots.buckets < 0).sum()) == 0
        room = int((slots.buckets[slots.groups(crowded[:1])[0]] == 0).sum())  # empty entries of their two groups
        crowded_entries = slots.reserve(crowded)  # keys racing for the same entries: each empty one to one key
        placed = crowded_entries >= 0
        assert 8 < room < 20 and int(placed.sum()) == room and len(torch.unique(crowded_entries[placed])) == room
        slots.write(crowded_entries, crowded, torch.where(placed, torch.arange(701, 721, device=device), 0))
        found[kernels] = slots.find(torch.cat([keys, crowded, mix(torch.arange(-50, 0, device=device))]))
    assert torch.equal(found["triton"], found["torch"])
    expected = torch.where(torch.arange(500) % 3 == 0, 0, torch.arange(1, 501))
    assert torch.equal(found["torch"][:500].cpu(), expected)
    assert bool((found["torch"][-50:] == 0).all())


@pytest.mark.skipif(not torch.cuda.is_available() or not backend.triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", ["room", "full, evicting (lru)", "full, evicting (lfu), ttl"])
def test_a_dynamic_step_captured_in_a_cuda_graph_replays_as_eager_steps_train(case):
    """Lookup, backward and a capturable step of a dynamic table, captured once, replayed on new ids: bitwise eager.

    The eager table with room skips the eviction's ops (the host's floor on its free slots says
    it may); the captured one runs them on every replay, and they change nothing there.
    """
    options, size = CASES[case]
    batches = _batches(6, size, "cuda")

    def model():
        emb = ls.DynamicEmbedding(**options, embedding_dim=4, seed=1, device="cuda")
        return emb, ls.SparseAdagrad([emb], lr=0.1, capturable=True)

    eager = model()
    for ids in batches:
        _step(*eager, ids)
    captured, static_ids = model(), batches[0].clone()
    graph = _captured(lambda: _step(*captured, static_ids))
    for ids in batches[1:]:
        static_ids.copy_(ids)
        graph.replay()
    torch.cuda.synchronize()
    for name, value in eager[0].slot_state().items():
        assert torch.equal(captured[0].slot_state()[name], value), name
    assert captured[0].slots.clock == eager[0].slots.clock == len(batches)
    torch.testing.assert_close(captured[0].shard, eager[0].shard, rtol=0, atol=0)


def _reads_per_stage() -> tuple[list[str], list[str], list[str]]:
    import os

    os.environ[backend.ENV] = "triton"
    try:
        rank = torch.distributed.get_rank()
        emb = ls.DynamicEmbedding(400, 4, seed=1)
        opt = ls.SparseAdagrad([emb], lr=0.1)
        batches = _batches(3, 48)
        for ids in batches[:2]:
            _step(emb, opt, ids[rank::2])
        with HostReads(ignore=[emb.slots.free._copy._host]) as forward_reads:
            out = emb(batches[2][rank::2])
        with HostReads(follows=forward_reads) as backward_reads:
            out.pow(2).sum().backward()
        with HostReads(ignore=[opt.state[emb.shard]["step"], emb.slots.free._copy._host], follows=backward_reads) as step_reads:
            opt.step()
    finally:
        del os.environ[backend.ENV]
    return forward_reads.calls, backward_reads.calls, step_reads.calls


def test_on_two_ranks_a_dynamic_step_reads_the_host_only_for_split_sizes(rank_pools):
    """As a SparseEmbedding's: once, for the lookup's headers (the ids' sizes); the step reads none (tests/test_exchange.py)."""
    for forward_reads, backward_reads, step_reads in rank_pools(2).run(_reads_per_stage):
        assert (forward_reads, backward_reads, step_reads) == (["cpu"], [], [])
