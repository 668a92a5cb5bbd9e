"""torch.compile: a lookup is one opaque op, so a model compiles with no graph break and trains as it does eagerly."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import lightning_models as lm
import pytest
import torch
from rank_pool import DEVICES
from torch import nn

import lightning_sparse as ls
from lightning_sparse.kernels import backend

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
PACKAGE = str(Path(ls.__file__).parent)


class Model(nn.Module):
    """A table, a dynamic table and a collection (ids, bags by lengths with weights, fixed bags), then a dense part."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.users = ls.SparseEmbedding(100, 8, seed=1, device=device)
        self.hashed = ls.DynamicEmbedding(64, 8, seed=2, device=device)
        tables = {"items": ls.SparseEmbedding(50, 8, seed=3, device=device), "tags": ls.SparseEmbedding(30, 8, seed=4,
                                                                                                       device=device)}  # fmt: skip
        self.features = ls.SparseEmbeddingCollection(tables, features={"item": "items", "tags": "tags", "recent": "items"},
                                                      pooling={"tags": "sum", "recent": "mean"})  # fmt: skip
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)

    def forward(self, users, raw, items, tags, recent):
        out = self.features({"item": items, "tags": tags, "recent": recent})
        x = self.users(users) + self.hashed(raw) + out["item"] + out["tags"] * out["recent"]
        return self.mlp(x).pow(2).mean()


def _batch(step: int, device: str):
    gen = torch.Generator().manual_seed(step)
    users, raw, items = torch.randint(0, 100, (16,), generator=gen), torch.randint(0, 2**40, (16,), generator=gen), \
        torch.randint(0, 50, (16,), generator=gen)  # fmt: skip
    lengths = torch.randint(0, 4, (16,), generator=gen)
    tags = ls.JaggedIds(torch.randint(0, 30, (int(lengths.sum()),), generator=gen).to(device), lengths=lengths.to(device),
                        weights=torch.rand(int(lengths.sum()), generator=gen).to(device))  # fmt: skip
    recent = torch.randint(0, 50, (16, 3), generator=gen)
    return users.to(device), raw.to(device), items.to(device), tags, recent.to(device)


def _train(model: nn.Module, tables: nn.Module, steps: int, device: str) -> None:
    dense = torch.optim.Adam(tables.mlp.parameters(), lr=0.01)
    sparse = ls.SparseAdagrad([tables.users, tables.hashed, tables.features], lr=0.1)
    for step in range(steps):
        model(*_batch(step, device)).backward()
        dense.step()
        sparse.step()
        dense.zero_grad()
        sparse.zero_grad()


# The CPU's torch path; the GPU's (one gather for a collection, whose outputs are views of one tensor) in Triton's
# interpreter; and where CUDA is present, the GPU's compiled (Triton for CUDA tensors by default).
PATHS = [
    *DEVICES[:1],
    pytest.param("cpu-gpu-kernels", id="cpu-gpu-kernels", marks=pytest.mark.skipif(
        not (INTERPRETING and backend.triton_available()), reason="needs triton's interpreter")),
    *DEVICES[1:],
]  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_a_compiled_model_has_no_graph_break_and_trains_like_eager(monkeypatch, path):
    if path == "cpu-gpu-kernels":
        monkeypatch.setenv(backend.ENV, "triton")
    _compiles_without_break_and_trains_like_eager("cuda" if path == "cuda" else "cpu")


def _compiles_without_break_and_trains_like_eager(device: str) -> None:
    torch._dynamo.reset()
    eager = Model(device)
    compiled_twin = copy.deepcopy(eager)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(copy.deepcopy(eager))(*_batch(0, device))
        # On CPU, AOTAutograd without inductor's codegen: the op, its fake kernel and backward are what is ours (inductor on
        # CPU runs in the compiled Lightning fit below, 9 s less here); on a GPU, inductor.
        _train(torch.compile(compiled_twin, backend="inductor" if device == "cuda" else "aot_eager"), compiled_twin, 3, device)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]
    assert not [str(w.message) for w in caught if w.filename.startswith(PACKAGE)], "no warning from lightning_sparse"
    _train(eager, eager, 3, device)
    for (name, expected), got in zip(eager.state_dict().items(), compiled_twin.state_dict().values()):
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(eager.users.full_weight(), Model(device).users.full_weight()), "the run must train"


def test_the_lookup_ops_stay_out_of_inductors_cuda_graphs():
    """mode="reduce-overhead" would replay a lookup's kernels without its records for the step: the ops say so."""
    for op in (torch.ops.lightning_sparse.lookup.default, torch.ops.lightning_sparse.lookup_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reduce_overhead_on_cuda_captures_the_dense_part_and_trains_like_eager():
    torch._dynamo.reset()
    eager = Model("cuda")
    twin = copy.deepcopy(eager)
    _train(torch.compile(twin, mode="reduce-overhead"), twin, 3, "cuda")
    _train(eager, eager, 3, "cuda")
    for (name, expected), got in zip(eager.state_dict().items(), twin.state_dict().values()):
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_weights_that_need_a_gradient_run_eagerly_under_compile():
    """The one input the op does not take: a graph break, and the weights' gradient as eagerly."""
    torch._dynamo.reset()
    features = ls.SparseEmbeddingCollection({"tags": ls.SparseEmbedding(30, 4)}, pooling="sum")

    def pooled(weights):
        bags = ls.JaggedIds(torch.tensor([1, 2, 3, 2]), lengths=torch.tensor([3, 1]), weights=weights)
        return features({"tags": bags})["tags"].pow(2).sum()

    eager_weights, compiled_weights = torch.rand(4, requires_grad=True), torch.rand(4, requires_grad=True)
    with torch.no_grad():
        compiled_weights.copy_(eager_weights)
    pooled(eager_weights).backward()
    torch.compile(pooled, backend="aot_eager")(compiled_weights).backward()  # the break and the op's backward are ours
    torch.testing.assert_close(compiled_weights.grad, eager_weights.grad)
    reference_weights = eager_weights.detach().clone().requires_grad_()
    table = features.tables["tags"].full_weight()
    offsets = torch.tensor([0, 3])
    nn.functional.embedding_bag(torch.tensor([1, 2, 3, 2]), table, offsets, per_sample_weights=reference_weights,
                                mode="sum").pow(2).sum().backward()  # fmt: skip
    torch.testing.assert_close(eager_weights.grad, reference_weights.grad)  # (both None would pass the comparison above)
    assert torch._dynamo.explain(pooled)(torch.rand(4, requires_grad=True)).graph_break_count >= 1


class Unlogged(lm.TwoTower):
    """TwoTower without ``self.log`` in its training step: with lightning 2.6.6 and torch 2.13, dynamo fails inside
    ``LightningModule.log`` (its signature check), with or without lightning_sparse."""

    def training_step(self, batch, batch_idx):
        users, items, target = batch
        return nn.functional.mse_loss(self(users, items).float(), target)


def _fit_compiled(world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    from torch._dynamo.utils import counters

    lm.lightning_env(torch.distributed.get_rank(), world_size)
    module = Unlogged()
    counters.clear()
    # Inductor's C++ kernels for the dense part without SIMD (what it probes first: a compiler run and a process per
    # instruction set, most of this test's time), compiled in this rank (no pool of compile workers to start): our ops
    # are extern kernels, called the same way from either kind of generated code.
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False, "compile_threads": 1}):
        lm.trainer(world_size, max_epochs=2).fit(torch.compile(module))
    return lm.state(module), dict(counters["frames"])


def test_a_compiled_lightning_module_fits_like_plain_torch(rank_pools):
    """Trainer(strategy="sparse_ddp").fit(torch.compile(module)) on 2 ranks equals the plain-torch replay.

    Compiled once for all 12 steps: a guard that fails at every step (on the step count, say) recompiles until dynamo's
    limit, then runs the rest eagerly."""
    batches = lm.global_batches(2, batch_size=4, epochs=2)
    expected = lm.reference(batches, sparse_cls=torch.optim.Adagrad, sparse_kwargs={"lr": 0.2})
    for got, frames in rank_pools(2).run(_fit_compiled, 2):
        assert frames == {"total": 1, "ok": 1}, frames
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
