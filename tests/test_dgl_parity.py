"""With ``duplicate_grads="mean"``, SparseAdagrad and SparseAdam match DGL's sparse optimizers.

Both libraries start from the same logical table, see the same ids on each rank (with duplicates
within a rank and across ranks) and the same per-rank loss; after a few steps the tables agree.
Checked in one process without a process group, and on 1 and 2 gloo ranks, where DGL shares its
table and optimizer state through shared memory named after the embedding (a fresh uuid per run).
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

os.environ.setdefault("DGLBACKEND", "pytorch")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dgl = pytest.importorskip("dgl")

from dgl.nn.pytorch import sparse_emb as dgl_sparse_emb  # noqa: E402
from references import batch_loss  # noqa: E402

import lightning_sparse as ls  # noqa: E402

N, D, STEPS, BATCH, BAG = 19, 4, 4, 4, 3
SEED = 7
HOT_ID = 0  # looked up by every rank at every step: a duplicate across ranks

# Same hyperparameters for both libraries. DGL's Adagrad divides by sqrt(sum + eps), ours (torch's
# formula) by sqrt(sum) + eps. With eps = 1e-20 both additions round away in float32 whenever the
# accumulated sum exceeds ~1e-12 (gradients here are far larger), and an element whose sum is 0 has
# gradient 0 and moves by 0 either way, so the two formulas agree up to rounding. (DGL's default
# eps = 1e-10 already differs by ~1e-6 on this data: too close to the tolerance.)
# Adam's update (per-row step count, eps outside the sqrt) is the same formula in both.
CASES = {
    "adagrad": ("SparseAdagrad", dict(lr=0.3, eps=1e-20)),
    "adam": ("SparseAdam", dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8)),
}


def make_batches(world: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: ids ``[world, BATCH * BAG]`` and targets ``[world, BATCH, D]``, one slice per rank.

    Skewed ids repeat within a rank; ``HOT_ID`` is on every rank, so it repeats across ranks.
    """
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        ids = (torch.rand(world, BATCH * BAG, generator=gen) ** 2 * N).long()
        ids[:, 0] = HOT_ID
        ids[:, 1] = HOT_ID
        target = torch.randn(world, BATCH, D, generator=gen)
        batches.append((ids, target))
    return batches


def _initial_table() -> torch.Tensor:
    return ls.init.normal()(torch.arange(N), D, SEED)


def _init_dgl_table(table: torch.Tensor) -> torch.Tensor:
    # NodeEmbedding uses init_func's return value as its table.
    table.copy_(_initial_table())
    return table


def _use_private_dgl_store() -> None:
    """Point DGL at a TCPStore on a free port instead of its fixed 127.0.0.1:12346.

    NodeEmbedding creates one store per process at that fixed address (module global ``_STORE``)
    to tell the other ranks that a shared-memory array exists; two test runs at once would
    collide on the port. Rank 0 hosts a store on a port the OS picks and broadcasts it.
    """
    if dgl_sparse_emb._STORE is not None:
        return
    timeout = timedelta(seconds=30)
    if dist.get_rank() == 0:
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
        dist.broadcast_object_list([store.port], src=0)
    else:
        port = [None]
        dist.broadcast_object_list(port, src=0)
        store = dist.TCPStore("127.0.0.1", port[0], None, False, timeout)
    dgl_sparse_emb._STORE = store


def train_both(name: str, kwargs: dict, scheme: str, batches, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's run of both libraries; returns (our full table, DGL's full table)."""
    if dist.is_initialized():
        rank = dist.get_rank()
        _use_private_dgl_store()
    else:
        rank = 0
    ours = ls.SparseEmbedding(N, D, sharding=scheme, seed=SEED)
    ours_opt = getattr(ls, name)([ours], duplicate_grads="mean", **kwargs)
    theirs = dgl.nn.NodeEmbedding(N, D, f"lsparity_{tag}", init_func=_init_dgl_table)
    theirs_opt = getattr(dgl.optim, name)([theirs], **kwargs)
    for ids, target in batches:
        ids, target = ids[rank], target[rank]

        batch_loss(ours(ids).view(BATCH, BAG, D), target).mean().backward()
        ours_opt.step()
        ours_opt.zero_grad()

        # DGL's forward records (ids, rows) in a trace that step() reads; zero_grad() only marks
        # the trace to be cleared by the *next* step() after it has read it, so it goes before
        # step() (DGL's examples call it before backward), else old gradients are applied again.
        batch_loss(theirs(ids).view(BATCH, BAG, D), target).mean().backward()
        theirs_opt.zero_grad()
        theirs_opt.step()
    # DGL's step ends with a barrier, so every rank's updates are in the shared table.
    return ours.full_weight(), theirs.weight.clone()


def _check(results, batches) -> None:
    world = batches[0][0].shape[0]
    for ids, _ in batches:
        assert any(len(row.unique()) < len(row) for row in ids), "some rank must repeat an id"
        if world > 1:
            shared = set(ids[0].tolist()).intersection(*(set(r.tolist()) for r in ids[1:]))
            assert HOT_ID in shared, "an id must repeat across ranks"
    initial = _initial_table()
    for ours, theirs in results:
        assert not torch.equal(theirs, initial), "the run must actually train"
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_dgl_without_process_group(case):
    assert not dist.is_initialized()
    name, kwargs = CASES[case]
    batches = make_batches(1, seed=1)
    _check([train_both(name, kwargs, "mod", batches, uuid.uuid4().hex)], batches)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("scheme", ["mod", "range"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dgl_on_ranks(rank_pools, world_size, scheme, case):
    name, kwargs = CASES[case]
    batches = make_batches(world_size, seed=world_size)
    results = rank_pools(world_size).run(train_both, name, kwargs, scheme, batches, uuid.uuid4().hex)
    _check(results, batches)
