"""Pipelined lookups (``ls.pipelined``): the next batch's ids go to their owners while this batch trains.

Each test trains the same model twice on the same batches, unpipelined and pipelined, and compares the
tables' weights and the optimizer's state bitwise; the pipelined run also records, at every optimizer
step, how many batches were sent ahead and how many lookups took a round sent ahead, so a pipeline that
silently fell back to unpipelined lookups fails.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from rank_pool import COLLECTIVE_TIMEOUT_S

import lightning_sparse as ls

TIMEOUT = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
STEPS = 5


def _batches(rank: int, rows: int, sizes: list[int], seed: int = 0) -> list[dict]:
    """Each rank's batches: ids (their number varies, so rounds overflow the agreed room now and then) and weights."""
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    out = []
    for size in sizes:
        ids = torch.randint(0, rows, (size,), generator=g)
        features = {"user": ids, "item": torch.randint(0, rows // 2, (size, 2), generator=g)}
        out.append({"ids": ids, "features": features, "w": torch.randn(size, 4, generator=g)})
    return out


def _state(opt: ls.SparseOptimizer) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _train(unit_kind: str, pipeline: bool, sizes: list[int], bad: tuple[int, int] | None = None):
    """Train a table (``"table"``) or a collection (``"collection"``) on this rank's batches; see the module docstring."""
    rank = dist.get_rank()
    batches = _batches(rank, 40, sizes)
    if bad is not None and rank == bad[0]:
        batches[bad[1]]["ids"][0] = 40  # out of range on one rank, in a batch sent ahead
    if unit_kind == "table":
        unit = ls.SparseEmbedding(40, 4, seed=3)
        opt = ls.SparseAdagrad([unit], lr=0.5)
        inputs, look = (lambda b: {unit: b["ids"]}), (lambda b: unit(b["ids"]))
    else:
        tables = {"u": ls.SparseEmbedding(40, 4, seed=3), "i": ls.SparseEmbedding(20, 4, seed=4)}
        unit = ls.SparseEmbeddingCollection(tables, features={"user": "u", "item": "i"}, pooling={"item": "sum"})
        opt = ls.SparseAdam([unit], lr=0.5)
        inputs = lambda b: {unit: b["features"]}  # noqa: E731
        look = lambda b: sum(unit(b["features"]).values())  # noqa: E731  (user rows + item bags, [size, 4] each)
    pipe = ls.Pipeline(inputs, timeout=TIMEOUT) if pipeline else None
    seen = []
    for batch in pipe.iterate(batches) if pipe else batches:
        (look(batch) * batch["w"]).sum().backward()
        seen.append((pipe.issued, unit.stats.rounds_ahead) if pipe else None)
        opt.step()
        opt.zero_grad()
    weights = unit.full_weight() if unit_kind == "table" else [t.full_weight() for t in unit.tables.values()]
    return weights, _state(opt), seen


@pytest.mark.parametrize("unit_kind", ["table", "collection"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_plain_loop_pipelined_trains_bitwise_as_unpipelined(rank_pools, world_size, unit_kind):
    sizes = [6, 30, 3, 50, 8][:STEPS]
    unpipelined = rank_pools(world_size).run(_train, unit_kind, False, sizes)
    pipelined = rank_pools(world_size).run(_train, unit_kind, True, sizes)
    for (weights, state, _), (p_weights, p_state, seen) in zip(unpipelined, pipelined):
        assert all(torch.equal(a, b) for a, b in zip(weights if isinstance(weights, list) else [weights],
                                                       p_weights if isinstance(p_weights, list) else [p_weights]))  # fmt: skip
        assert len(state) == len(p_state) and all(torch.equal(a, b) for a, b in zip(state, p_state))
        # At step n's optimizer step, batch n + 1 was sent ahead, and every lookup so far took its round ahead.
        assert seen == [(min(n + 2, STEPS), n + 1) for n in range(STEPS)]
