"""Claims of the README and the guide that no other test pins, each against what a user can observe."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightning_sparse as ls

# Every collective of torch.distributed a step could call (the library calls them as ``dist.<name>``).
COLLECTIVES = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier", "gather", "scatter")  # fmt: skip


class CountedCollectives:
    """Counts the calls of :data:`COLLECTIVES` while active (every rank counts its own)."""

    def __enter__(self) -> CountedCollectives:
        self.calls: list[str] = []
        self._originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, original in self._originals.items():
            setattr(dist, name, self._counting(name, original))
        return self

    def _counting(self, name, original):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


# ---------------------------------------------------------------- step counts the steps in which a table was looked up
def _steps_with_an_unused_table() -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Table b is looked up (by rank 0 only) at steps 0 and 2 of 4; a at every step."""
    rank = dist.get_rank()
    a, b = ls.SparseEmbedding(9, 2, seed=1), ls.SparseEmbedding(7, 2, seed=2, sharding="range")
    opt = ls.SparseAdagrad([a, b], lr=0.5, lr_decay=1.0)
    for ids_a, ids_b in _step_ids():
        loss = a(ids_a[rank]).pow(2).sum()
        if ids_b is not None:  # every rank calls the lookup (a collective); rank 1 with no ids
            loss = loss + b(ids_b if rank == 0 else ids_b[:0]).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [int(opt.state[t.shard]["step"]) for t in (a, b)], a.full_weight(), b.full_weight()


def _step_ids() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 9, (2, 4), generator=gen), torch.randint(0, 7, (3,), generator=gen) if step % 2 == 0 else None)
            for step in range(4)]  # fmt: skip


def test_step_counts_only_the_steps_in_which_some_rank_looked_the_table_up(rank_pools):
    """semantics.md: ``step`` counts the optimizer steps in which some rank looked the table up, as torch counts the steps
    in which a parameter had a gradient; Adagrad's lr_decay reads it. torch's Adagrad with the same lookups is the reference."""
    plain_a, plain_b = torch.nn.Embedding(9, 2, sparse=True), torch.nn.Embedding(7, 2, sparse=True)
    with torch.no_grad():
        plain_a.weight.copy_(ls.init.normal()(torch.arange(9), 2, 1))
        plain_b.weight.copy_(ls.init.normal()(torch.arange(7), 2, 2))
    reference = torch.optim.Adagrad([plain_a.weight, plain_b.weight], lr=0.5, lr_decay=1.0)
    for ids_a, ids_b in _step_ids():
        loss = plain_a(ids_a.flatten()).pow(2).sum()
        if ids_b is not None:
            loss = loss + plain_b(ids_b).pow(2).sum()
        (loss / 2).backward()  # the mean over the 2 ranks
        reference.step()
        reference.zero_grad()
    assert [int(reference.state[p]["step"]) for p in (plain_a.weight, plain_b.weight)] == [4, 2]
    for steps, a, b in rank_pools(2).run(_steps_with_an_unused_table):
        assert steps == [4, 2]
        torch.testing.assert_close(a, plain_a.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, plain_b.weight.detach(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- each rank sends each owner only its distinct ids
def _bytes_of_lookups() -> tuple[int, int, int, int]:
    rank = dist.get_rank()
    table = ls.SparseEmbedding(100, 8, seed=1)
    distinct = torch.randperm(100, generator=torch.Generator().manual_seed(rank))[:20]
    repeated = distinct.repeat(5)[torch.randperm(100, generator=torch.Generator().manual_seed(7))]  # each id 5 times
    table(repeated)  # agrees the id room of the rounds below
    sent = []
    for ids in (distinct, repeated):
        table.stats.reset()
        table(ids)
        sent.append(table.stats.bytes_sent)
    return sent[0], sent[1], table.stats.ids_looked_up, table.stats.unique_ids


def test_a_lookup_sends_only_distinct_ids_and_rows(rank_pools):
    """semantics.md: each rank sends each owner only its unique ids (and gets one row back for each): a lookup of 20
    distinct ids, each 5 times, moves the bytes of a lookup of the 20 ids once."""
    for distinct, repeated, looked_up, unique in rank_pools(2).run(_bytes_of_lookups):
        assert (looked_up, unique) == (100, 20)
        assert distinct > 0 and repeated == distinct


# ---------------------------------------------------------------- check_finite costs no collective
def _collectives_of_steps(check: bool, inf: bool) -> tuple[list[str], str]:
    rank = dist.get_rank()
    users, items = ls.SparseEmbedding(20, 2, seed=1), ls.SparseEmbedding(10, 3, seed=2)
    opt = ls.SparseAdam([users, items], lr=0.1, check_finite=check)
    scale = float("inf") if inf and rank == 1 else 1.0
    (users(torch.tensor([rank, 5])).sum() * scale + items(torch.tensor([3, rank])).sum()).backward()
    outcome = "stepped"
    with CountedCollectives() as counted:
        try:
            opt.step()
        except FloatingPointError:
            outcome = "raised"
    return counted.calls, outcome


@pytest.mark.parametrize("inf", [False, True], ids=["finite", "inf-on-rank-1"])
def test_check_finite_adds_no_collective(rank_pools, inf):
    """semantics.md: the flag rides with the gradients: a step with check_finite=True calls the collectives a step without
    it calls, also when it raises."""
    pool = rank_pools(2)
    unchecked = pool.run(_collectives_of_steps, False, inf)
    checked = pool.run(_collectives_of_steps, True, inf)
    for (plain, stepped), (calls, outcome) in zip(unchecked, checked):
        assert stepped == "stepped" and outcome == ("raised" if inf else "stepped")
        assert plain and calls == plain


# ---------------------------------------------------------------- reset_parameters
def _reset_after_training() -> tuple[bool, torch.Tensor]:
    table = ls.SparseEmbedding(11, 3, seed=5, sharding="range", init=ls.init.uniform(-0.5, 0.5))
    opt = ls.SparseSGD([table], lr=1.0)
    table(torch.arange(11)).pow(2).sum().backward()
    opt.step()
    trained = not torch.equal(table.full_weight(), ls.init.uniform(-0.5, 0.5)(torch.arange(11), 3, 5))
    table.reset_parameters()
    return trained, table.full_weight()


def test_reset_parameters_redraws_each_ranks_rows_from_init_and_seed(rank_pools):
    expected = ls.init.uniform(-0.5, 0.5)(torch.arange(11), 3, 5)
    for trained, table in rank_pools(2).run(_reset_after_training):
        assert trained
        torch.testing.assert_close(table, expected, rtol=0, atol=0)
