"""The exchange protocol: one sort per lookup, collectives and host reads per stage, routed gradients, pending lookups."""

from __future__ import annotations

import gc
import logging
import traceback
import weakref

import pytest
import torch
from host_reads import DeviceSyncs, HostReads
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_pool import DEVICES
from test_kernels import KERNEL_DEVICES

import lightning_sparse as ls
from lightning_sparse.kernels import backend
from lightning_sparse.wire.grouping import SortedKeys, coalesce, transpose_blocks, transposed_places
from lightning_sparse.wire.sharding import JointSharding, RowSharding


# ---------------------------------------------------------------- one sort
@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(0, 50), max_size=40), use_bound=st.booleans())
def test_sorted_keys_dedup_group_and_segment_sum(values, use_bound):
    keys = torch.tensor(values, dtype=torch.int64)
    runs = SortedKeys(keys, bound=51 if use_bound else None).finish()
    unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    assert runs.unique.dtype == torch.int64
    assert runs.unique.tolist() == unique.tolist()
    assert runs.inverse().tolist() == inverse.tolist()
    assert runs.counts().tolist() == counts.tolist()
    values_2d = torch.randn(len(values), 3, dtype=torch.float64)
    expected = torch.zeros(len(unique), 3, dtype=torch.float64).index_add_(0, inverse, values_2d)
    torch.testing.assert_close(runs.segment_sum(values_2d), expected)
    boundaries = torch.tensor([0, 10, 25, 51])
    below = runs.counts_below(boundaries).tolist()
    assert below == [int((unique < b).sum()) for b in boundaries.tolist()]
    blocks = runs.sorted.to(torch.int64) // 10  # block 5 (the key 50) is outside the 5 counted blocks
    assert runs.counts_in_blocks(blocks, 5).tolist() == [
        int(((unique >= 10 * b) & (unique < 10 * b + 10)).sum()) for b in range(5)
    ]
    ids, sums = coalesce(keys, values_2d)
    assert ids.tolist() == unique.tolist()
    torch.testing.assert_close(sums, expected)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 5), sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_ids_per_owner_and_table_by_search_and_by_one_pass_agree(data, world_size, sizes):
    """The stage-1 sender counts its ids per (owner, table) block one of two ways (few blocks or many): same counts."""
    joint = JointSharding(tuple(RowSharding(n, world_size, data.draw(st.sampled_from(["mod", "range"]))) for n in sizes))
    keys = [joint.key(t, torch.tensor(data.draw(st.lists(st.integers(0, n - 1), max_size=12)), dtype=torch.int64))
            for t, n in enumerate(sizes)]  # fmt: skip
    runs = SortedKeys(torch.cat(keys), joint.key_bound)
    below = runs.counts_below(joint.table_boundaries())
    sorted_keys = runs.sorted.to(torch.int64)
    blocks = joint.block(joint.owner_of_key(sorted_keys), joint.local_of_key(sorted_keys))
    assert runs.counts_in_blocks(blocks, world_size * len(sizes)).tolist() == (below[1:] - below[:-1]).tolist()


@settings(max_examples=80, deadline=None)
@given(data=st.data(), rows=st.integers(0, 6), columns=st.integers(0, 6))
def test_block_transposes_match_slicing_block_by_block(data, rows, columns):
    sizes = data.draw(st.lists(st.integers(0, 3), min_size=rows * columns, max_size=rows * columns))
    counts = torch.tensor(sizes, dtype=torch.int64).view(rows, columns)
    total = int(counts.sum())
    items = torch.arange(total)
    blocks = dict(zip([(a, b) for a in range(rows) for b in range(columns)], items.split(sizes)))  # a-major input
    by_b = [blocks[a, b] for b in range(columns) for a in range(rows)]
    expected = torch.cat(by_b).tolist() if by_b else []
    assert transpose_blocks(counts, total).tolist() == expected
    assert torch.empty(total, dtype=torch.int64).index_copy_(0, transposed_places(counts, total), items).tolist() == expected
    within = torch.empty(total, dtype=torch.int64)
    for b in range(columns):  # each item's index among its column's items
        column = [blocks[a, b] for a in range(rows)]
        if column:
            mine = torch.cat(column)
            within[mine] = torch.arange(len(mine))
    assert transposed_places(counts, total, within_b=True).tolist() == within.tolist()


# ---------------------------------------------------------------- collectives and host reads
def _count_per_stage(accumulate: bool, device: str = "cpu"):
    """Collectives and host reads per stage, on the GPU's code path (Triton, through its interpreter on CPU)."""
    import os

    from lightning_sparse.kernels import backend

    os.environ[backend.ENV] = "triton"
    try:
        rank = torch.distributed.get_rank()
        emb = ls.SparseEmbedding(1000, 8, device=device)
        opt = ls.SparseAdagrad([emb], lr=0.1)
        ids = torch.arange(rank, 1000, 7, device=device)
        lookups = 2 if accumulate else 1
        emb(ids).sum().backward()  # the first round sizes the id room of the next ones
        opt.step()
        emb.stats.reset()
        opt.stats.reset()
        with HostReads() as forward_reads:
            outs = [emb(ids + i) for i in range(lookups)]
        with HostReads(follows=forward_reads) as backward_reads:
            sum(out.sum() for out in outs).backward()
        with HostReads(ignore=[opt.state[emb.shard]["step"]], follows=backward_reads) as step_reads:
            opt.step()
        counted = (emb.stats.collectives, opt.stats.collectives, forward_reads.calls, backward_reads.calls, step_reads.calls,
                   opt.stats.bytes_sent)  # fmt: skip
        syncs = None
        if device == "cuda":  # the GPU's own count of the same step's host syncs (gloo's waits are its own)
            torch.cuda.synchronize()
            with DeviceSyncs() as forward_syncs:
                outs = [emb(ids + i) for i in range(lookups)]
            with DeviceSyncs() as backward_syncs:
                sum(out.sum() for out in outs).backward()
            with DeviceSyncs() as step_syncs:
                opt.step()
            syncs = (forward_syncs.calls, backward_syncs.calls, step_syncs.calls)
    finally:
        del os.environ[backend.ENV]
    return (*counted, syncs)


def _same_count(syncs: tuple[list[str], ...] | None, *reads: list[str]) -> bool:
    """On a GPU, each phase syncs as often as the CPU harness counted its host reads (``syncs`` None: no GPU)."""
    return syncs is None or [len(calls) for calls in syncs] == [len(calls) for calls in reads]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_collectives_and_host_reads_per_stage(rank_pools, device):
    """Several ranks read the host once a step, for split sizes: a lookup for its headers (the ids' sizes). The step
    sends the gradients back along the lookup's route, and the headers said it was every rank's sole lookup: no
    word about other gradients, no host read. With accumulation the routed round's control codes say whether a
    general round follows, and the general round reads its header."""
    # One lookup: headers with ids, then rows; the step sends the gradients back along the lookup's route.
    for lookup_collectives, step_collectives, forward_reads, backward_reads, step_reads, _sent, syncs in rank_pools(
        2, device
    ).run(_count_per_stage, False, device):
        assert (lookup_collectives, step_collectives) == (2, 1)
        assert (forward_reads, backward_reads, step_reads) == (["cpu"], [], [])
        assert _same_count(syncs, forward_reads, backward_reads, step_reads), syncs
    # Two lookups before a step: the first lookup's gradients take the general round (header + values).
    for lookup_collectives, step_collectives, forward_reads, backward_reads, step_reads, _sent, syncs in rank_pools(
        2, device
    ).run(_count_per_stage, True, device):
        assert (lookup_collectives, step_collectives) == (4, 3)
        assert (forward_reads, step_reads) == (["cpu", "cpu"], ["cpu", "cpu"])
        assert _same_count(syncs, forward_reads, backward_reads, step_reads), syncs


_IDS_OF_RANK = ([0, 1, 1, 5], [1, 2, 7, 7])


def _without_backward_on_one_rank(optimizer: str, mean: bool, kernels: str, device: str = "cpu", dtype=torch.float32):
    """Two steps; at the second, rank 1 looks the table up in grad mode but its backward never reaches the lookup:
    its routed rows are placeholders, which the owners must skip (no move of a row only rank 1 read)."""
    import os

    from lightning_sparse.kernels import backend

    os.environ[backend.ENV] = kernels
    try:
        rank = torch.distributed.get_rank()
        emb = ls.SparseEmbedding(12, 3, seed=4, device=device, dtype=dtype)
        kwargs = {"bias_correction": "global"} if optimizer == "SparseAdam" else {}
        opt = getattr(ls, optimizer)([emb], lr=0.1, duplicate_grads="mean" if mean else "sum", **kwargs)
        before = emb.full_weight().cpu()
        ids = torch.tensor(_IDS_OF_RANK[rank], device=device)
        for step in range(2):
            out = emb(ids)
            if rank == 0 or step == 0:
                (out * torch.arange(1.0, 4.0, device=device, dtype=dtype)).sum().backward()
            opt.step()
        return before, emb.full_weight().cpu(), int(opt.state[emb.shard]["step"])
    finally:
        del os.environ[backend.ENV]


def _reference_loss(table: torch.nn.Embedding, ranks: list[int], mean: bool) -> torch.Tensor:
    """The loss whose gradient is the table's: ``"sum"`` averages over the 2 ranks, ``"mean"`` over a row's occurrences."""
    ids = torch.tensor([i for rank in ranks for i in _IDS_OF_RANK[rank]])
    rows = table(ids) * torch.arange(1.0, 4.0)
    if not mean:
        return rows.sum() / 2
    occurrences = torch.bincount(ids, minlength=12).to(torch.float32).index_select(0, ids).unsqueeze(1)
    return (rows / occurrences).sum()


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=KERNEL_DEVICES[0].marks)])
@pytest.mark.parametrize("optimizer,mean", [("SparseAdam", False), ("SparseSGD", True)])
def test_a_rank_whose_backward_never_reached_the_lookup_moves_no_row(rank_pools, kernels, optimizer, mean):
    """The sole-lookup step keeps the routed round's codes on the device on a GPU's path: its placeholders are skipped
    there by their zero counts. Reference: torch's optimizer on both ranks' gradients, then on rank 0's only."""
    for before, after, step in rank_pools(2).run(_without_backward_on_one_rank, optimizer, mean, kernels):
        reference = torch.nn.Embedding(12, 3, sparse=True)
        reference.weight.data.copy_(before)
        torch_opt = torch.optim.SparseAdam(reference.parameters(), lr=0.1) if optimizer == "SparseAdam" else (
            torch.optim.SGD(reference.parameters(), lr=0.1))  # fmt: skip
        for ranks in ([0, 1], [0]):
            torch_opt.zero_grad()
            _reference_loss(reference, ranks, mean).backward()
            torch_opt.step()
        torch.testing.assert_close(after, reference.weight.detach(), rtol=1e-6, atol=1e-6)
        assert step == 2  # looked up at both steps: both count


@pytest.mark.parametrize("kernels", [pytest.param("triton", marks=KERNEL_DEVICES[0].marks)])
def test_placeholder_rows_move_no_row_of_a_table_the_fused_update_does_not_take(rank_pools, kernels):
    """A float64 table on the GPU's path steps by torch ops after the segment sum (``row_grads.summed``), which must drop
    the rows only placeholders reached: Adam's moments would move them with a zero gradient."""
    for before, after, step in rank_pools(2).run(_without_backward_on_one_rank, "SparseAdam", False, kernels, "cpu",
                                                 torch.float64):  # fmt: skip
        reference = torch.nn.Embedding(12, 3, sparse=True, dtype=torch.float64)
        reference.weight.data.copy_(before)
        torch_opt = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
        for ranks in ([0, 1], [0]):
            torch_opt.zero_grad()
            _reference_loss(reference, ranks, False).backward()
            torch_opt.step()
        assert after.dtype == torch.float64
        torch.testing.assert_close(after, reference.weight.detach(), rtol=1e-12, atol=1e-12)
        assert step == 2


def _growing_lookups(device: str = "cpu"):
    """Batches that outgrow the agreed id room take an overflow round and stay exact."""
    rank = torch.distributed.get_rank()
    emb = ls.SparseEmbedding(5000, 3, seed=2, device=device)
    rounds, outs = [], []
    for size in (10, 10, 400, 400, 3000, 5):
        emb.stats.reset()
        ids = torch.randperm(5000, generator=torch.Generator().manual_seed(size + rank))[:size].to(device)
        outs.append((ids.cpu(), emb(ids).cpu()))
        rounds.append(emb.stats.collectives)
    return rounds, outs


@pytest.mark.parametrize("device", DEVICES)
def test_id_slots_follow_the_batch_and_overflow_stays_exact(rank_pools, device):
    table = ls.init.normal()(torch.arange(5000), 3, 2)
    for rounds, outs in rank_pools(3, device).run(_growing_lookups, device):
        assert rounds[1] == 2 and rounds[3] == 2 and rounds[5] == 2  # within the slots: ids + rows
        assert rounds[2] == 3 and rounds[4] == 3  # outgrown: one overflow round
        for ids, out in outs:
            torch.testing.assert_close(out, table[ids], rtol=0, atol=0)


def _one_rank_reads():
    emb = ls.SparseEmbedding(50, 4)
    opt = ls.SparseAdam([emb], lr=0.1)
    ids = torch.tensor([3, 1, 3, 49], device="cpu")  # data: on the device (see HostReads)
    with HostReads() as forward_reads:
        out = emb(ids)
    with HostReads(follows=forward_reads) as backward_reads:
        out.sum().backward()
    with HostReads(ignore=[opt.state[emb.shard]["step"]], follows=backward_reads) as step_reads:
        opt.step()
    return len(forward_reads.calls), len(backward_reads.calls), len(step_reads.calls)


@pytest.mark.parametrize("kernels", ["torch", "numba"])
def test_one_rank_on_a_cpu_reads_the_host_for_the_id_range_and_the_distinct_rows(kernels, monkeypatch):
    """On a CPU host reads cost nothing: the lookup reads the id range; the torch ops' step reads the number of distinct
    rows, numba's fused step (Adam's) reads none. The GPU's path reads none (tests/test_gpu_path.py)."""
    if kernels == "numba" and not backend.numba_available():
        pytest.skip("needs numba")
    monkeypatch.setenv(backend.ENV, kernels)
    assert _one_rank_reads() == (1, 0, 1 if kernels == "torch" else 0)


def test_one_rank_rounds_send_nothing_and_read_the_host_once_for_the_verdict():
    """With one rank the engine runs the same stages; the mechanisms send nothing (no collective) and stage 1
    reads the host once, for the verdict and the ids per table. A round of one table (pooled), then of two."""
    tables = {"user": ls.SparseEmbedding(10, 2, seed=1), "item": ls.SparseEmbedding(6, 3, seed=2)}
    collection = ls.SparseEmbeddingCollection(tables, features={"user": "user", "clicked": "item"}, pooling={"clicked": "sum"})
    opt = ls.SparseAdagrad([collection], lr=0.1)
    user, clicked = torch.tensor([3, 1, 3, 9]), ls.JaggedIds(torch.tensor([0, 5, 5, 2]), lengths=torch.tensor([3, 1]))
    for features in ({"clicked": clicked}, {"user": user, "clicked": clicked}):
        rows = {name: table.shard.detach().clone() for name, table in tables.items()}
        with HostReads() as reads:
            out = collection(features)
        assert reads.calls.count("cpu") == 1, reads.calls  # the header and the ids per table
        assert tables["user"].stats.collectives == tables["item"].stats.collectives == 0
        expected = torch.stack([rows["item"][[0, 5, 5]].sum(0), rows["item"][2]])
        torch.testing.assert_close(out["clicked"], expected, rtol=0, atol=0)
        if "user" in features:
            torch.testing.assert_close(out["user"], rows["user"][user], rtol=0, atol=0)
        sum(v.sum() for v in out.values()).backward()
        opt.step()


def _routed_bytes():
    rank = torch.distributed.get_rank()
    dim = 16
    emb = ls.SparseEmbedding(100, dim)
    opt = ls.SparseSGD([emb], lr=0.1)
    ids = torch.tensor([[0, 1, 2, 3, 5, 5], [1, 7, 9, 9, 10, 11]])[rank]
    emb(ids).sum().backward()
    opt.step()
    owned_by_peer = int(torch.unique(ids).remainder(2).ne(rank).sum())  # "mod": row r lives on rank r % 2
    # rows of float32, then one control value per table, padded to a whole unit (here: one row of `dim` values)
    return opt.stats.bytes_sent, owned_by_peer * dim * 4 + dim * 4


def test_routed_gradients_carry_no_ids(rank_pools):
    for sent, expected in rank_pools(2).run(_routed_bytes):
        assert sent == expected


# ---------------------------------------------------------------- pending lookups
def _lookup_record(out):
    """The LookupRecord held by the lookup's node in ``out``'s graph (a few nodes up: view, index_select)."""
    nodes = [out.grad_fn]
    while nodes:
        node = nodes.pop()
        if hasattr(node, "record"):
            return node.record
        nodes += [n for n, _ in node.next_functions if n is not None]
    raise AssertionError("no lookup node in the graph")


def test_lookups_without_backward_leave_nothing_behind():
    """Evaluation without torch.no_grad(): nothing accumulates, whatever the number of lookups."""
    emb = ls.SparseEmbedding(100, 4)
    out = emb(torch.arange(10))
    record = weakref.ref(_lookup_record(out))
    for _ in range(50):
        emb(torch.arange(100))
    del out
    gc.collect()
    assert record() is None
    assert emb.pending.received == [] and emb.pending_grads() == []


def _mixed_grad_mode():
    rank = torch.distributed.get_rank()
    emb = ls.SparseEmbedding(10, 2, seed=1)
    opt = ls.SparseSGD([emb], lr=1.0)
    before = emb.full_weight()
    with torch.set_grad_enabled(rank == 1):
        out = emb(torch.tensor([rank, 4]))
    if out.requires_grad:
        out.sum().backward()
    opt.step()
    return before, emb.full_weight()


def test_ranks_that_record_and_ranks_that_do_not_agree_on_the_step(rank_pools):
    for before, after in rank_pools(2).run(_mixed_grad_mode):
        expected = before.clone()
        expected[[1, 4]] -= 0.5  # rank 1's gradient of 1 per row, averaged over 2 ranks
        torch.testing.assert_close(after, expected)


def _two_lookups_recorded_on_one_rank_only():
    """Rank 0 records both lookups before the step; rank 1 only the second (its first is under no_grad), whose header
    alone promises a sole lookup: rank 0's first gradient must still count at this step."""
    rank = torch.distributed.get_rank()
    emb = ls.SparseEmbedding(10, 2, seed=1)
    opt = ls.SparseSGD([emb], lr=1.0)
    before = emb.full_weight()
    with torch.set_grad_enabled(rank == 0):
        first = emb(torch.tensor([rank]))
    second = emb(torch.tensor([5 + rank]))
    (second.sum() + first.sum() if first.requires_grad else second.sum()).backward()
    opt.step()
    return before - emb.full_weight()


def test_a_step_after_two_lookups_on_some_ranks_takes_every_gradient_at_once(rank_pools):
    for change in rank_pools(2).run(_two_lookups_recorded_on_one_rank_only):
        expected = torch.zeros(10, 2)
        expected[[0, 5, 6]] = 0.5  # each rank's gradient of 1 per row, averaged over 2 ranks
        torch.testing.assert_close(change, expected)


def _step_after_a_step():
    """A step, then one with no lookup since: the second one's collectives."""
    emb = ls.SparseEmbedding(10, 2, seed=1)
    opt = ls.SparseSGD([emb], lr=1.0)
    emb(torch.tensor([torch.distributed.get_rank()])).sum().backward()
    opt.step()
    opt.stats.reset()
    opt.step()
    return opt.stats.collectives


def test_a_step_with_nothing_to_send_sends_its_header_only(rank_pools):
    """No lookup since the last step, so no route: the general round's header carries the control codes, and when they
    say that no rank has rows, no values round follows."""
    assert rank_pools(2).run(_step_after_a_step) == [1, 1]


def _gradient_after_a_step(device="cpu"):
    """forward -> step -> backward -> step: the late gradient counts at the second step, as in torch."""
    rank = torch.distributed.get_rank()
    emb = ls.SparseEmbedding(10, 2, seed=1, device=device)
    opt = ls.SparseSGD([emb], lr=1.0)
    before = emb.full_weight()
    out = emb(torch.tensor([rank + 2], device=device))
    opt.step()
    unchanged = torch.equal(emb.full_weight(), before)
    out.sum().backward()
    opt.step()
    return unchanged, (before - emb.full_weight()).cpu()


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradient_after_a_step_applies_at_the_next(rank_pools, world_size):
    for unchanged, change in rank_pools(world_size).run(_gradient_after_a_step):
        assert unchanged
        expected = torch.zeros(10, 2)
        expected[2 : 2 + world_size] = 1.0 / world_size
        torch.testing.assert_close(change, expected)


def _late_gradient_after_a_later_lookup():
    """forward A -> step -> forward B -> backward A -> backward B -> step -> step: A's gradient reached its lookup after
    B's header promised the step B's gradients only (``LookupHeader.sole``); it stays pending for the next step."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    emb = ls.SparseEmbedding(10, 2, seed=1)
    opt = ls.SparseSGD([emb], lr=1.0)
    before = emb.full_weight()
    out_a = emb(torch.tensor([rank]))
    opt.step()
    out_b = emb(torch.tensor([5 + rank]))
    out_a.sum().backward()
    out_b.sum().backward()
    opt.step()
    middle = emb.full_weight()
    opt.step()
    return (before - middle), (before - emb.full_weight()), int(opt.state[emb.shard]["step"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_late_gradient_is_applied_at_the_next_step_and_never_lost(rank_pools, world_size):
    """One rank applies it at once, as torch does; several ranks one step later (docs/guide/semantics.md)."""
    for first, last, step in rank_pools(world_size).run(_late_gradient_after_a_later_lookup):
        late, fresh = torch.zeros(10, 2), torch.zeros(10, 2)
        late[:world_size] = 1.0 / world_size  # A's rows, each rank's gradient of 1 averaged over the ranks
        fresh[5 : 5 + world_size] = 1.0 / world_size
        torch.testing.assert_close(first, fresh + late if world_size == 1 else fresh)
        torch.testing.assert_close(last, fresh + late)
        # steps after a lookup count (the first, then the second); the third counts where the late gradient was applied
        assert step == (2 if world_size == 1 else 3)


def _steps_counted(world_size_hint: int):
    """Step counts of two tables of one collection: a step whose round read only the first, then one whose lookup
    got no backward, then one without a lookup. ``step`` counts the steps in which some rank looked a table up."""
    collection = ls.SparseEmbeddingCollection(
        {"a": ls.SparseEmbedding(8, 2, seed=1), "b": ls.SparseEmbedding(8, 2, seed=2)}, features={"fa": "a", "fb": "b"}
    )
    opt = ls.SparseSGD([collection], lr=0.1)
    counts = []
    for features, backward in (({"fa": torch.tensor([1, 2])}, True), ({"fa": torch.tensor([3]), "fb": torch.tensor([4])}, False),
                               (None, False)):  # fmt: skip
        if features is not None:
            out = collection(features)
            if backward:
                sum(v.sum() for v in out.values()).backward()
        opt.step()
        counts.append([int(opt.state[t.shard]["step"]) for t in collection.tables.values()])
    return counts


@pytest.mark.parametrize("world_size", [1, 2])
def test_step_counts_the_steps_in_which_a_table_was_looked_up(rank_pools, world_size):
    for counts in rank_pools(world_size).run(_steps_counted, world_size):
        assert counts == [[1, 0], [2, 1], [2, 1]]


def test_retain_graph_accumulates_and_a_step_takes_it():
    emb = ls.SparseEmbedding(5, 2, seed=0)
    opt = ls.SparseSGD([emb], lr=1.0)
    before = emb.full_weight()
    out = emb(torch.tensor([1, 1, 3]))
    out.sum().backward(retain_graph=True)
    out.sum().backward(retain_graph=True)
    opt.step()
    opt.zero_grad()
    expected = before.clone()
    expected[1] -= 4.0
    expected[3] -= 2.0
    torch.testing.assert_close(emb.full_weight(), expected)
    out.sum().backward()  # after the step: a fresh gradient, not added to the one already applied
    opt.step()
    expected[1] -= 2.0
    expected[3] -= 1.0
    torch.testing.assert_close(emb.full_weight(), expected)


# ---------------------------------------------------------------- faults
def test_only_lost_peers_are_reported_as_peer_failures():
    from lightning_sparse.faults.peers import is_peer_failure

    assert is_peer_failure(torch.distributed.DistBackendError("NCCL watchdog: collective timed out"))
    assert is_peer_failure(torch.distributed.DistNetworkError("Connection reset by peer"))
    assert is_peer_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6346"))
    assert is_peer_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 30000ms for recv"))
    assert not is_peer_failure(RuntimeError("[enforce fail at gloo/alltoall.cc:30] in->size == out->size."))
    assert not is_peer_failure(RuntimeError("Split sizes doesn't match total dim 0 size"))
    assert not is_peer_failure(TypeError("timed out"))  # only RuntimeError's messages are read


def test_torchrun_restarts_with_the_shared_store_are_warned_about(monkeypatch):
    from lightning_sparse.faults.peers import restart_hazard

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert "HINT: launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_hazard()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the workers' own store: nothing to warn about
    assert restart_hazard() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restarts
    assert restart_hazard() is None


def test_after_the_ranks_meet_only_rank_0_warns_of_torchrun_restarts_with_the_shared_store(monkeypatch, caplog):
    """One warning per job, not one per rank (``after_meeting`` runs on every rank)."""
    from lightning_sparse.faults import peers
    from lightning_sparse.lightning.lost_peers import after_meeting

    monkeypatch.setattr(peers, "_ranks_per_node", None)  # after_meeting sets it: restored after the test
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with caplog.at_level(logging.WARNING, logger="lightning_sparse.lightning.strategy"):
        after_meeting(2, 1)
        assert caplog.records == []
        after_meeting(2, 0)
    assert [record.getMessage() for record in caplog.records] == [peers.restart_hazard()]


def test_a_checkpoint_exception_over_a_ranks_lost_peer_is_a_lost_peer():
    """DCP raises a CheckpointException holding each failed rank's (exception, traceback): a lost peer among them makes the
    save or load report a PeerFailure (its HINT: resume); any other failure (a full disk) does not."""
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_sparse.faults.peers import caused_by_lost_peer

    def failed_on_rank_1(err: BaseException) -> CheckpointException:
        return CheckpointException("save failed", {1: (err, traceback.StackSummary())})

    assert caused_by_lost_peer(failed_on_rank_1(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")))
    assert caused_by_lost_peer(failed_on_rank_1(ls.PeerFailure("The all-gather of the save plan failed")))
    assert not caused_by_lost_peer(failed_on_rank_1(OSError(28, "No space left on device")))


def _roll_call_that_rank_1_answers_late() -> str:
    from lightning_sparse.faults.peers import roll_call, set_ranks_per_node
    from lightning_sparse.lightning.lost_peers import after_meeting

    rank = torch.distributed.get_rank()
    after_meeting(1, rank)  # as the strategy does once the ranks met: one rank per machine
    try:
        early = roll_call(wait_s=0.5) if rank == 0 else ""  # rank 1 does not answer in time
        torch.distributed.barrier()
        late = roll_call(wait_s=0.5) if rank == 1 else ""  # rank 0 answered this roll call already
    finally:
        set_ranks_per_node(None)
    return early + late


def test_a_roll_call_names_the_ranks_that_did_not_answer_with_their_machines(rank_pools):
    """The sentence a PeerFailure carries: the ranks whose key did not come within the wait (and their node, rank //
    ranks per node), or that every rank answered."""
    early, late = rank_pools(2).run(_roll_call_that_rank_1_answers_late)
    assert early.endswith("within 0.5 s (dead, hung, or cut off from it): rank 1 (node 1)."), early
    assert late.startswith(" Every rank answered a roll call on the job's store afterwards"), late


def test_nccls_duplicate_gpu_error_gets_a_hint_that_names_both_fixes():
    from lightning_sparse.faults.peers import collective

    with pytest.raises(RuntimeError) as caught, collective("all-to-all of lookup ids"):
        raise RuntimeError("NCCL error: invalid usage, NCCL version 2.21.5\nncclInvalidUsage: Duplicate GPU detected : rank 1")
    notes = " ".join(caught.value.__notes__)
    assert "HINT: " in notes and "torch.cuda.set_device(local_rank)" in notes and '"gloo"' in notes
    assert not isinstance(caught.value, ls.PeerFailure)


def test_a_table_on_another_gpu_than_its_nccl_device_says_so(monkeypatch):
    """NCCL binds a rank's communicator to the current device: a shard elsewhere raises (CPU-testable: the backend faked)."""
    from lightning_sparse.tables import placement

    monkeypatch.setattr(placement.dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(placement.torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match=r"users is on cuda:1, but this rank's current CUDA device is cuda:0.*HINT: "):
        placement.check_device("users", torch.device("cuda", 1), None)
    placement.check_device("users", torch.device("cuda", 0), None)  # its own device: fine
    monkeypatch.setattr(placement.dist, "get_backend", lambda group: "gloo")
    placement.check_device("users", torch.device("cuda", 1), None)  # gloo moves any device's tensors


def _misuse_then_healthy():
    from lightning_sparse.wire.alltoall import Peers, exchange_values

    rank = torch.distributed.get_rank()
    try:
        exchange_values(torch.zeros(3, 2), [1, 1], [1, 1], Peers(None, rank, 2))  # 3 rows, splits for 2: a caller's bug
    except ls.PeerFailure as err:
        return "PeerFailure", str(err)
    except RuntimeError as err:
        notes = getattr(err, "__notes__", [])
        return type(err).__name__, " ".join(notes), ls.SparseEmbedding(10, 2)(torch.tensor([1, 9])).shape
    return None


def test_a_programming_error_in_a_collective_is_not_blamed_on_a_peer(rank_pools):
    for result in rank_pools(2).run(_misuse_then_healthy):
        assert result[0] == "RuntimeError", result
        assert "not a lost peer" in result[1]
        assert result[2] == torch.Size([2, 2])  # nothing was left half-way: the group still works
