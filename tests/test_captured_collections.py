"""Collections of tables of several dims or dtypes, and collections holding a dynamic table, on one GPU's path: captured.

On CPU the GPU's path runs through Triton's interpreter (``LIGHTNING_SPARSE_KERNELS=triton``): a step of such a
collection (one gather and one update per part of one kind, a dynamic table's ids turned into rows on the device:
lightning_sparse/lookup/joint.py) reads the host never, and trains as the per-table path (the engine's round,
table by table after a host read) does. Then the Trainer's and Fabric's captured steps (the graph double on CPU, CUDA
graphs on a GPU) train such collections as their eager runs do.
"""

from __future__ import annotations

import copy
import os

import lightning_models as lm
import pytest
import torch
from graph_double import CallAgainGraphs
from host_reads import HostReads
from test_captured_steps import fabric_step
from test_kernels import KERNEL_DEVICES
from torch import nn

import lightning_sparse as ls
from lightning_sparse.kernels import backend
from lightning_sparse.lookup.engine import Round
from lightning_sparse.lookup.joint import Joint

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KINDS = ["mixed", "dynamic"]


def _collection(kind: str, device: str) -> ls.SparseEmbeddingCollection:
    """Mixed: float32 tables of dims 8 and 4 and a bf16 one of dim 8 (three parts); dynamic: a DynamicEmbedding among two."""
    half = dict(dtype=torch.bfloat16, stochastic_rounding=False, output_dtype=torch.float32)
    items = ls.SparseEmbedding(120, 4, seed=2, device=device) if kind == "mixed" else \
        ls.DynamicEmbedding(100, 8, seed=2, device=device)  # fmt: skip
    tables = {"users": ls.SparseEmbedding(300, 8, seed=1, device=device), "items": items,
              "tags": ls.SparseEmbedding(50, 8, seed=3, device=device, **(half if kind == "mixed" else {}))}  # fmt: skip
    return ls.SparseEmbeddingCollection(tables, features={"user": "users", "item": "items", "tags": "tags", "also": "users"},
                                        pooling={"tags": "sum"})  # fmt: skip


def _features(step: int, device: str, kind: str) -> dict:
    gen = torch.Generator().manual_seed(step)
    tags = ls.JaggedIds(torch.randint(0, 50, (40,), generator=gen).to(device), lengths=torch.tensor([2, 3] * 8).to(device))
    items = torch.randint(0, 120, (16,), generator=gen)  # a dynamic table: any ids
    users, also = (300 * torch.rand(16, generator=gen) ** 3).long(), torch.randint(0, 300, (16,), generator=gen)
    return {"user": users.to(device), "item": (items * 7 + 1 if kind == "dynamic" else items).to(device), "tags": tags,
            "also": also.to(device)}  # fmt: skip


def _step(collection, opt, features: dict) -> None:
    sum(out.pow(2).sum() for out in collection(features).values()).backward()
    opt.step()
    opt.zero_grad()


def _trained(kind: str, device: str, per_table: bool, counted: int | None = None):
    """Four steps (capturable Adagrad); ``per_table``: on the engine's round; ``counted``: the host reads of that step."""
    collection = _collection(kind, device)
    opt = ls.SparseAdagrad([collection], lr=0.2, capturable=True)
    collection.materialize()
    if per_table:
        collection.lookups = Round(collection)
    reads = None
    for step in range(4):
        features = _features(step, device, kind)
        if step == counted:
            known = [t.slots.free._copy._host for t in collection.table_list if isinstance(t, ls.DynamicEmbedding)]
            with HostReads(ignore=known) as reads:  # known: the free slots' copy, read without waiting
                _step(collection, opt, features)
        else:
            _step(collection, opt, features)
    return collection, opt, reads


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_mixed_or_dynamic_collections_step_reads_the_host_never_and_trains_as_the_per_table_path(device, kind, monkeypatch):
    """Bitwise the per-table path, but for the bf16 table: the joint path sums the gradients of its repeated ids
    otherwise (as for a collection of bf16 tables only; equal where ids do not repeat): within bf16's tolerance
    (torch's default for bf16: rtol 1.6e-2, atol 1e-5)."""
    monkeypatch.setenv(backend.ENV, "triton")
    collection, opt, reads = _trained(kind, device, False, counted=3)
    assert isinstance(collection.lookups, Joint) and len(collection.lookups.parts) == (3 if kind == "mixed" else 1)
    assert reads.calls == []
    twin, twin_opt, _ = _trained(kind, device, True)
    for name, table in collection.tables.items():
        other = twin.tables[name]
        exact = dict(rtol=0, atol=0) if table.dtype == torch.float32 else {}
        torch.testing.assert_close(table.shard, other.shard, msg=name, **exact)
        for key, value in opt.state[table.shard].items():
            torch.testing.assert_close(value, twin_opt.state[other.shard][key], msg=f"{name} {key}", **exact)
        if isinstance(table, ls.DynamicEmbedding):
            for key, value in table.slot_state().items():
                assert torch.equal(value, other.slot_state()[key]), key


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_copy_of_a_mixed_collection_steps_its_parts_as_the_original(device, monkeypatch):
    """A deep copy (as pickling makes one) of a placed collection holds its own parts: the optimizer finds their rounds."""
    monkeypatch.setenv(backend.ENV, "triton")
    collection = _collection("mixed", device).materialize()  # placed: its parts made
    copied = copy.deepcopy(collection)
    for unit in (collection, copied):
        opt = ls.SparseAdagrad([unit], lr=0.2)
        for step in range(2):
            _step(unit, opt, _features(step, device, "mixed"))
    for name, table in collection.tables.items():
        assert torch.equal(copied.tables[name].shard, table.shard), name


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_an_id_out_of_range_in_a_part_of_a_mixed_collection_raises_at_the_step_naming_the_feature(device, monkeypatch):
    """The part's range check speaks for the collection: the feature and table named as the per-table path names them."""
    monkeypatch.setenv(backend.ENV, "triton")
    collection = _collection("mixed", device)
    opt = ls.SparseAdagrad([collection], lr=0.2)
    before = {name: t.shard.clone() for name, t in collection.tables.items()}
    features = _features(0, device, "mixed")
    features["item"][3] = 120  # the second part's first feature; its table has 120 rows
    sum(out.pow(2).sum() for out in collection(features).values()).backward()
    if device == "cuda":
        torch.cuda.synchronize()  # the verdict's copy is on the host by the step
    with pytest.raises(IndexError, match=r"Feature 'item' \(table 'items'\) of SparseEmbeddingCollection got id 120 on"):
        opt.step()
    assert all(torch.equal(t.shard, before[name]) for name, t in collection.tables.items())


# ---------------------------------------------------------------- the Trainer's and Fabric's captured steps
class Tower(lm.CollectionTower):
    """CollectionTower whose collection holds a dynamic table (items) and a bf16 table of dim 2 (tags): two parts."""

    def __init__(self) -> None:
        lm.TwoTower.__init__(self, sparse_kwargs={"lr": 0.2, "capturable": True}, batch_size=5)
        users, _ = self._modules.pop("users"), self._modules.pop("items")
        items = ls.DynamicEmbedding(16, lm.DIM, seed=2)  # fewer slots than items: it evicts
        tags = ls.SparseEmbedding(
            lm.ITEMS, 2, seed=3, dtype=torch.bfloat16, stochastic_rounding=False, output_dtype=torch.float32
        )
        self.embeddings = ls.SparseEmbeddingCollection({"users": users, "items": items, "tags": tags},
                                                       features={"user": "users", "first": "items", "second": "items",
                                                                 "tag": "tags"})  # fmt: skip
        self.mlp = nn.Sequential(nn.Linear(3 * lm.DIM + 2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        out = self.embeddings({"user": users, "first": items[:, 0], "second": items[:, 1], "tag": items[:, 0]})
        return self.mlp(torch.cat([out["user"], out["first"], out["second"], out["tag"]], dim=-1)).squeeze(-1)

    def configure_sparse_optimizers(self):
        return ls.SparseAdagrad([self.embeddings], **self.sparse_kwargs)


def _state(module: Tower) -> dict[str, torch.Tensor]:
    out = {name: p.detach().clone().cpu() for name, p in module.mlp.named_parameters()}
    for name, table in module.embeddings.tables.items():
        out[name] = table.shard.detach().clone().cpu()
        if isinstance(table, ls.DynamicEmbedding):
            out.update({f"{name} {key}": value.cpu() for key, value in table.slot_state().items()})
    return out


def _on_the_gpu_path(device: str):
    """The GPU's code path: Triton's interpreter on a CPU, compiled kernels on a GPU (where it is the default)."""
    if device == "cpu":
        os.environ[backend.ENV] = "triton"


def _trainer_fit(captured: bool, device: str) -> tuple:
    _on_the_gpu_path(device)
    try:
        lm.lightning_env(0, 1)
        module = Tower()
        strategy = ls.CapturedSparseDDPStrategy(graphs=CallAgainGraphs() if device == "cpu" else None) if captured else \
            "sparse_ddp"  # fmt: skip
        trainer = lm.trainer(1, strategy=strategy, accelerator="gpu" if device == "cuda" else "cpu", max_steps=5)
        trainer.fit(module)
        assert isinstance(module.embeddings.lookups, Joint) and len(module.embeddings.lookups.parts) == 2
        return _state(module), dict(strategy.captures) if captured else None
    finally:
        os.environ.pop(backend.ENV, None)


def _fabric_steps(captured: bool, device: str) -> tuple:
    import lightning as L

    _on_the_gpu_path(device)
    try:
        lm.lightning_env(0, 1)
        fabric = L.Fabric(accelerator=device, devices=1, strategy="sparse_ddp")
        fabric.launch()
        module = Tower()
        model, dense_opt, sparse_opt = fabric.setup(module, torch.optim.SGD(module.mlp.parameters(), lr=0.05),
                                                    ls.SparseAdagrad([module.embeddings], lr=0.2, capturable=True))  # fmt: skip

        step = fabric_step(fabric, model, dense_opt, sparse_opt)

        run = fabric.strategy.captured(step, graphs=CallAgainGraphs() if device == "cpu" else None) if captured else step
        data, losses = lm.dataset(25), []
        for start in range(0, 25, 5):
            losses.append(float(run([t[start : start + 5].to(fabric.device) for t in data.tensors])["loss"]))
        return _state(module), losses, dict(run.counts) if captured else None
    finally:
        os.environ.pop(backend.ENV, None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_trainers_captured_step_trains_a_collection_of_two_kinds_and_a_dynamic_table_as_the_eager_fit(rank_pools, device):
    """5 steps (2 warm-ups, then a capture replayed at once and 2 more replays): bitwise the eager fit, on the GPU's path."""
    [(state, counts)] = rank_pools(1, device).run(_trainer_fit, True, device)
    [(twin, _)] = rank_pools(1, device).run(_trainer_fit, False, device)
    assert counts == {"warm-up": 2, "captured": 1, "replayed": 3, "eager": 0, "dropped": 0}
    for key, value in twin.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_captured_fabric_step_trains_a_collection_of_two_kinds_and_a_dynamic_table_as_the_eager_step(rank_pools, device):
    """5 steps (2 warm-ups, then a capture replayed at once and 2 more replays): bitwise the eager steps, the same losses."""
    [(state, losses, counts)] = rank_pools(1, device).run(_fabric_steps, True, device)
    [(twin, twin_losses, _)] = rank_pools(1, device).run(_fabric_steps, False, device)
    assert counts == {"warm-up": 2, "captured": 1, "replayed": 3, "eager": 0, "dropped": 0}
    assert losses == twin_losses
    for key, value in twin.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
