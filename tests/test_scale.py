"""Large world sizes in one process: rank r of a W-rank job whose peers mirror it (benchmarks/mirror.py).

In the mirrored job every rank's shard starts equal to rank r's, and rank k looks up rank r's
ids with owner j replaced by (r + k - j) mod W. So rank r's lookups return its own shard's
rows at the ids' local indices, and its shard receives, for each local row, the gradients of
all of rank r's ids with that local index (averaged over the W ranks, as DDP does: the test
scales rank r's loss by W). The reference is therefore plain torch on one
shard-sized table indexed by ``sharding.to_local(ids)``: ``F.embedding(sparse=True)`` /
``F.embedding_bag(sparse=True)`` and torch's optimizers (or ``references.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from references import make_reference

import lightning_sparse as ls

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from mirror import init_mirror, mirror_groups  # noqa: E402

RANK, STEPS, BATCH = 5, 3, 48
# name: (rows per rank, dim, dtype)
TABLES = {"user": (7, 4, torch.float32), "item": (5, 6, torch.float64), "tag": (3, 2, torch.float32)}
CASES = {
    "sgd": ("SparseSGD", dict(lr=0.5)),
    "adagrad": ("SparseAdagrad", dict(lr=0.3, initial_accumulator_value=0.1)),
    "rowwise-adagrad": ("SparseRowWiseAdagrad", dict(lr=0.3)),
    "adam-row": ("SparseAdam", dict(lr=0.05)),
}


@pytest.fixture
def mirror(request):
    group = init_mirror(RANK, request.param)
    yield group
    dist.destroy_process_group()


def make_batches(world_size: int, seed: int = 0) -> list[dict]:
    """Per step: user ids [B], weighted clicked bags (0-3 items), candidates [B, 2], tag bags (1-3), targets."""
    gen = torch.Generator().manual_seed(seed)
    total = {t: rows * world_size for t, (rows, _, _) in TABLES.items()}
    batches = []
    for _ in range(STEPS):
        clicked = torch.randint(0, 4, (BATCH,), generator=gen)
        tags = torch.randint(1, 4, (BATCH,), generator=gen)
        batches.append({
            "user": torch.randint(0, total["user"], (BATCH,), generator=gen),
            "clicked": (torch.randint(0, total["item"], (int(clicked.sum()),), generator=gen), clicked,
                        torch.rand(int(clicked.sum()), generator=gen)),
            "candidates": torch.randint(0, total["item"], (BATCH, 2), generator=gen),
            "tags": (torch.randint(0, total["tag"], (int(tags.sum()),), generator=gen), tags, None),
            "target": torch.randn(BATCH, generator=gen, dtype=torch.float64),
        })  # fmt: skip
    return batches


def loss_of(out: dict, target: torch.Tensor) -> torch.Tensor:
    score = out["user"].sum(1).double() * out["clicked"].sum(1) + (out["candidates"].sum(1) * out["clicked"]).sum(1)
    return (score + out["tags"].pow(2).sum(1).double() - target).pow(2).mean()


def initial_shards() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {t: torch.randn(rows, dim, generator=gen).to(dtype) for t, (rows, dim, dtype) in TABLES.items()}


def halves(batch: dict, accumulate: bool) -> list[dict]:
    """The batch, or its two halves (accumulated before one step: the general gradient round runs too)."""
    if not accumulate:
        return [batch]
    half = BATCH // 2

    def cut(bags: tuple, first: bool) -> tuple:
        ids, lengths, weights = bags
        split = int(lengths[:half].sum())
        pick = (lambda t: t[:split]) if first else (lambda t: t[split:])  # noqa: E731
        return pick(ids), lengths[:half] if first else lengths[half:], None if weights is None else pick(weights)

    return [{key: cut(value, first) if isinstance(value, tuple) else (value[:half] if first else value[half:])
             for key, value in batch.items()} for first in (True, False)]  # fmt: skip


def train_mirrored(name: str, kwargs: dict, scheme: str, world_size: int, accumulate: bool = False,
                   group_size: int | None = None) -> tuple[list[dict], dict]:  # fmt: skip
    """``group_size``: 2-D sharding over mirrored groups of that many ranks, replicated ``world_size / group_size`` times.

    A shard then gets each row's gradient from the ``group_size`` ranks of its group (loss scaled
    by ``group_size``) and from each of the ``world_size / group_size`` replicas, divided by ``world_size``.
    """
    shards = initial_shards()
    placement, shard_ranks = {}, world_size
    if group_size is not None:
        shard_group, replica_group = mirror_groups(RANK, world_size, group_size)
        placement, shard_ranks = {"process_group": shard_group, "replica_group": replica_group}, group_size
    tables = {t: ls.SparseEmbedding(rows * shard_ranks, dim, dtype=dtype, sharding=scheme, **placement)
              for t, (rows, dim, dtype) in TABLES.items()}  # fmt: skip
    for t, table in tables.items():
        table.materialize()
        assert table.world_size == shard_ranks and table.rank == RANK % shard_ranks
        assert table.replicas == world_size // shard_ranks
        table.shard.copy_(shards[t])
    collection = ls.SparseEmbeddingCollection(tables, features={"user": "user", "clicked": "item", "candidates": "item",
                                              "tags": "tag"}, pooling={"clicked": "sum", "tags": "mean"})  # fmt: skip
    opt = getattr(ls, name)([collection], **kwargs)
    outputs = []
    for whole in make_batches(shard_ranks):
        for batch in halves(whole, accumulate):
            out = collection({
                "user": batch["user"],
                "clicked": ls.JaggedIds(batch["clicked"][0], lengths=batch["clicked"][1], weights=batch["clicked"][2]),
                "candidates": batch["candidates"],
                "tags": ls.JaggedIds(batch["tags"][0], lengths=batch["tags"][1]),
            })  # fmt: skip
            outputs.append({k: v.detach().clone() for k, v in out.items()})
            (loss_of(out, batch["target"]) * shard_ranks).backward()  # gradients are averaged over the ranks, as by DDP
        opt.step()
        opt.zero_grad()
    return outputs, {t: table.shard.detach().clone() for t, table in tables.items()}


def train_reference(name: str, kwargs: dict, scheme: str, world_size: int, accumulate: bool = False) -> tuple[list[dict], dict]:
    weights = {t: torch.nn.Parameter(shard) for t, shard in initial_shards().items()}
    local = {t: ls.RowSharding(rows * world_size, world_size, scheme).to_local for t, (rows, _, _) in TABLES.items()}
    opts = [make_reference(name, w, kwargs) for w in weights.values()]
    outputs = []
    for batch in (half for whole in make_batches(world_size) for half in halves(whole, accumulate)):

        def bags(table: str, ids: torch.Tensor, lengths: torch.Tensor, w: torch.Tensor | None, mode: str) -> torch.Tensor:
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            weight = weights[table]
            return F.embedding_bag(local[table](ids), weight, offsets, mode=mode, sparse=True, include_last_offset=True,
                                   per_sample_weights=None if w is None else w.to(weight.dtype))  # fmt: skip

        out = {
            "user": F.embedding(local["user"](batch["user"]), weights["user"], sparse=True),
            "clicked": bags("item", *batch["clicked"], "sum"),
            "candidates": F.embedding(local["item"](batch["candidates"]), weights["item"], sparse=True),
            "tags": bags("tag", *batch["tags"], "mean"),
        }
        outputs.append({k: v.detach().clone() for k, v in out.items()})
        loss_of(out, batch["target"]).backward()
        if len(outputs) % (2 if accumulate else 1) == 0:
            for opt in opts:
                opt.step()
                opt.zero_grad()
    return outputs, {t: w.detach() for t, w in weights.items()}


@pytest.mark.parametrize("mirror", [64, 1024], indirect=True, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("scheme", ["mod", "range"])
@pytest.mark.parametrize("case", list(CASES))
def test_collection_at_large_world_size_matches_plain_torch(mirror, case, scheme):
    """Most (owner, table) blocks of a round are empty or hold one id: every large-W code path runs."""
    world_size = mirror.size()
    name, kwargs = CASES[case]
    outputs, shards = train_mirrored(name, kwargs, scheme, world_size)
    expected_outputs, expected = train_reference(name, kwargs, scheme, world_size)
    for out, ref in zip(outputs, expected_outputs):
        for feature in ref:
            torch.testing.assert_close(out[feature], ref[feature], rtol=1e-5, atol=1e-6)
    for t in TABLES:
        torch.testing.assert_close(shards[t], expected[t], rtol=1e-5, atol=1e-6)
        assert not torch.equal(expected[t], initial_shards()[t]), "the run must actually train"
    assert mirror.counts.calls["all_to_all_single"] >= 3 * STEPS


@pytest.mark.parametrize("mirror", [1024], indirect=True, ids=lambda w: f"W{w}")
def test_collection_of_one_width_at_large_world_size_matches_plain_torch(mirror, monkeypatch):
    """Tables of one width: stage 2 packs and unpacks with the turns its lookup already made (no turns of its own)."""
    monkeypatch.setitem(globals(), "TABLES", {t: (rows, 4, dtype) for t, (rows, _, dtype) in TABLES.items()})
    name, kwargs = CASES["adagrad"]
    outputs, shards = train_mirrored(name, kwargs, "mod", mirror.size())
    expected_outputs, expected = train_reference(name, kwargs, "mod", mirror.size())
    for out, ref in zip(outputs, expected_outputs):
        for feature in ref:
            torch.testing.assert_close(out[feature], ref[feature], rtol=1e-5, atol=1e-6)
    for t in TABLES:
        torch.testing.assert_close(shards[t], expected[t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mirror", [1024], indirect=True, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("scheme", ["mod", "range"])
@pytest.mark.parametrize("case", ["adagrad", "adam-row"])
def test_two_d_sharding_at_large_world_size_matches_plain_torch(mirror, case, scheme):
    """Groups of 128 ranks, 8 replicas: the all-to-alls stay inside the group, the replicas' gradients are summed."""
    name, kwargs = CASES[case]
    outputs, shards = train_mirrored(name, kwargs, scheme, mirror.size(), group_size=128)
    expected_outputs, expected = train_reference(name, kwargs, scheme, 128)
    for out, ref in zip(outputs, expected_outputs):
        for feature in ref:
            torch.testing.assert_close(out[feature], ref[feature], rtol=1e-5, atol=1e-6)
    for t in TABLES:
        torch.testing.assert_close(shards[t], expected[t], rtol=1e-5, atol=1e-6)
    assert mirror.counts.calls == {}, "the default group carries nothing: tables use their sharding and replica groups"


@pytest.mark.parametrize("mirror", [1024], indirect=True, ids=lambda w: f"W{w}")
def test_accumulation_at_large_world_size_matches_plain_torch(mirror):
    """Two lookups before each step: the first one's gradients take the general round (ids and values)."""
    world_size = mirror.size()
    outputs, shards = train_mirrored("SparseAdagrad", dict(lr=0.3), "mod", world_size, accumulate=True)
    expected_outputs, expected = train_reference("SparseAdagrad", dict(lr=0.3), "mod", world_size, accumulate=True)
    assert len(outputs) == len(expected_outputs) == 2 * STEPS
    for out, ref in zip(outputs, expected_outputs):
        for feature in ref:
            torch.testing.assert_close(out[feature], ref[feature], rtol=1e-5, atol=1e-6)
    for t in TABLES:
        torch.testing.assert_close(shards[t], expected[t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mirror", [1024], indirect=True, ids=lambda w: f"W{w}")
def test_single_table_at_large_world_size_matches_plain_torch(mirror):
    world_size, rows, dim = mirror.size(), 6, 5
    gen = torch.Generator().manual_seed(3)
    initial = torch.randn(rows, dim, generator=gen)
    table = ls.SparseEmbedding(rows * world_size, dim).materialize()
    table.shard.copy_(initial)
    opt = ls.SparseAdagrad([table], lr=0.2)
    weight = torch.nn.Parameter(initial.clone())
    ref_opt = torch.optim.Adagrad([weight], lr=0.2)
    for _ in range(STEPS):
        ids = torch.randint(0, rows * world_size, (3 * BATCH,), generator=gen)
        out = table(ids)
        ref = F.embedding(table.sharding.to_local(ids), weight, sparse=True)
        torch.testing.assert_close(out, ref.detach())
        (out.pow(3).sum() * world_size).backward()  # gradients are averaged over the ranks
        ref.pow(3).sum().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    torch.testing.assert_close(table.shard, weight.detach())
