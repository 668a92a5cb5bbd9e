"""capturable=True: the step count and the step's scalars on the device, so that a one-process step can be captured.

On CPU the GPU's path runs through Triton's interpreter: a capturable step trains as the default
one does and reads the host never (not even its step count). On a GPU a step is also captured in
a CUDA graph, beside a dense part, and replayed on new ids: it trains as the eager steps do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from host_reads import HostReads
from test_kernels import DEVICE_SCALARS_TOLERANCE, KERNEL_DEVICES
from torch import nn

import lightning_sparse as ls
from lightning_sparse.kernels import backend

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
# The warm-up and capture of docs/guide/gpu.md's recipe, as the GPU benchmarks run it (written once).
from gpu_capture import captured as _captured  # noqa: E402

CASES = {
    "sgd": ("SparseSGD", dict(lr=0.3, weight_decay=0.1)),
    "adagrad": ("SparseAdagrad", dict(lr=0.2, lr_decay=0.05, weight_decay=0.05)),
    "rowwise_adagrad": ("SparseRowWiseAdagrad", dict(lr=0.2)),
    "adam-row": ("SparseAdam", dict(lr=0.05)),
    "adam-global": ("SparseAdam", dict(lr=0.05, bias_correction="global")),
    "adamw-global": ("SparseAdam", dict(lr=0.05, weight_decay=0.1, decoupled_weight_decay=True, bias_correction="global")),
}


@pytest.fixture
def gpu_path(monkeypatch):
    monkeypatch.setenv(backend.ENV, "triton")


def _batches(device: str, count: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(300 * torch.rand(128, generator=gen) ** 3).long().to(device) for _ in range(count)]


def _train(
    case: str, capturable: bool, device: str, batches: list[torch.Tensor]
) -> tuple[ls.SparseEmbedding, ls.SparseOptimizer]:
    name, kwargs = CASES[case]
    emb = ls.SparseEmbedding(300, 8, seed=1, device=device)
    opt = getattr(ls, name)([emb], capturable=capturable, **kwargs)
    target = torch.linspace(-1, 1, 8, device=device)
    for ids in batches:
        (emb(ids) - target).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return emb, opt


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_a_capturable_step_trains_as_the_default_one(gpu_path, device, case):
    batches = _batches(device)
    (emb, opt), (twin, twin_opt) = _train(case, True, device, batches), _train(case, False, device, batches)
    exact = dict(rtol=0, atol=0) if device == "cpu" else DEVICE_SCALARS_TOLERANCE
    torch.testing.assert_close(emb.full_weight(), twin.full_weight(), **exact)
    step = opt.state[emb.shard]["step"]
    assert step.device == emb.shard.device and int(step) == int(twin_opt.state[twin.shard]["step"]) == len(batches)


@pytest.mark.parametrize("case", ["adagrad", "adam-global"])
def test_a_capturable_step_on_the_cpu_path_trains_as_the_default_one(case):
    batches = _batches("cpu")
    (emb, _), (twin, _) = _train(case, True, "cpu", batches), _train(case, False, "cpu", batches)
    torch.testing.assert_close(emb.full_weight(), twin.full_weight(), rtol=0, atol=0)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["adagrad", "adam-global"])
def test_a_capturable_step_reads_the_host_never_not_even_its_count(gpu_path, device, case):
    batches = _batches(device, 2)
    emb, opt = _train(case, True, device, batches[:1])  # the first step makes the buffers and the table's entry
    with HostReads() as reads:  # nothing ignored: the step count is a device tensor
        emb(batches[1]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert reads.calls == []


def _collection(case: str, capturable: bool, device: str) -> tuple[ls.SparseEmbeddingCollection, ls.SparseOptimizer]:
    """Three tables of one dim (one GPU: one gather, one launch), an unpooled feature and a summed bag."""
    tables = {name: ls.SparseEmbedding(rows, 8, seed=seed, device=device) for name, rows, seed in
              (("users", 300, 1), ("items", 120, 2), ("tags", 50, 3))}  # fmt: skip
    collection = ls.SparseEmbeddingCollection(tables, features={"user": "users", "item": "items", "tags": "tags"},
                                              pooling={"tags": "sum"})  # fmt: skip
    name, kwargs = CASES[case]
    return collection, getattr(ls, name)([collection], capturable=capturable, **kwargs)


def _features(step: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (32,), generator=gen)
    tags = ls.JaggedIds(torch.randint(0, 50, (int(lengths.sum()),), generator=gen).to(device), lengths=lengths.to(device))
    users, items = (300 * torch.rand(32, generator=gen) ** 3).long(), torch.randint(0, 120, (32,), generator=gen)
    return {"user": users.to(device), "item": items.to(device), "tags": tags}


def _collection_step(collection, opt, features: dict) -> None:
    sum(out.pow(2).sum() for out in collection(features).values()).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["adagrad", "adam-global", "adam-row"])
def test_a_collections_capturable_step_trains_as_the_default_one_and_reads_the_host_never(gpu_path, device, case):
    (collection, opt), (twin, twin_opt) = _collection(case, True, device), _collection(case, False, device)
    batches = [_features(step, device) for step in range(4)]
    for features in batches[:3]:
        _collection_step(collection, opt, features)
        _collection_step(twin, twin_opt, features)
    with HostReads() as reads:
        _collection_step(collection, opt, batches[3])
    assert reads.calls == []
    _collection_step(twin, twin_opt, batches[3])
    exact = dict(rtol=0, atol=0) if device == "cpu" else DEVICE_SCALARS_TOLERANCE
    for name, table in collection.tables.items():
        torch.testing.assert_close(table.full_weight(), twin.tables[name].full_weight(), msg=name, **exact)


def test_capturable_refuses_a_table_whose_step_must_read_the_host(gpu_path):
    table = ls.SparseEmbedding(10, 4, dtype=torch.bfloat16)  # stochastic rounding: draws keyed by the host's count
    with pytest.raises(ValueError, match=r"capturable=True\) cannot step .*HINT: stochastic_rounding=False"):
        ls.SparseAdagrad([table], capturable=True)
    ls.SparseAdagrad([ls.SparseEmbedding(10, 4, dtype=torch.bfloat16, stochastic_rounding=False)], capturable=True)


@pytest.mark.skipif(not torch.cuda.is_available() or not backend.triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", list(CASES))
def test_a_step_captured_in_a_cuda_graph_replays_as_eager_steps_train(case):
    """A table and a dense layer, captured once in a CUDA graph, replayed on new ids: bitwise the eager run."""
    batches, name, kwargs = _batches("cuda", 6), *CASES[case]

    def model():
        torch.manual_seed(0)
        emb, dense = ls.SparseEmbedding(300, 8, seed=1, device="cuda"), nn.Linear(8, 1, device="cuda")
        sparse = getattr(ls, name)([emb], capturable=True, **kwargs)
        return emb, dense, sparse, torch.optim.Adam(dense.parameters(), lr=0.01, capturable=True)

    def step(emb, dense, sparse, adam, ids):
        dense(emb(ids)).pow(2).mean().backward()
        sparse.step()
        adam.step()
        sparse.zero_grad()
        adam.zero_grad(set_to_none=False)  # captured: the dense gradients stay in the graph's memory

    eager = model()
    for ids in batches:
        step(*eager, ids)
    captured, static_ids = model(), batches[0].clone()
    graph = _captured(lambda: step(*captured, static_ids))
    for ids in batches[1:]:
        static_ids.copy_(ids)
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[0].full_weight(), eager[0].full_weight(), rtol=0, atol=0)
    torch.testing.assert_close(captured[1].weight, eager[1].weight, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available() or not backend.triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("case", ["adagrad", "adam-global", "adam-row"])
def test_a_collection_step_captured_in_a_cuda_graph_replays_as_eager_steps_train(case):
    """Three tables in one gather and one launch, fixed-size bags: captured once, replayed on new ids, bitwise eager."""
    gen = torch.Generator().manual_seed(0)
    batches = [{"user": (300 * torch.rand(32, generator=gen) ** 3).long().cuda(), "item": torch.randint(0, 120, (32,), generator=gen).cuda(),
                "tags": torch.randint(0, 50, (32, 3), generator=gen).cuda()} for _ in range(5)]  # fmt: skip
    eager = _collection(case, True, "cuda")
    for features in batches:
        _collection_step(*eager, features)
    captured, static = _collection(case, True, "cuda"), {name: ids.clone() for name, ids in batches[0].items()}
    graph = _captured(lambda: _collection_step(*captured, static))
    for features in batches[1:]:
        for name, ids in features.items():
            static[name].copy_(ids)
        graph.replay()
    torch.cuda.synchronize()
    for name, table in captured[0].tables.items():
        torch.testing.assert_close(table.full_weight(), eager[0].tables[name].full_weight(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_capturable_optimizer_resumes_from_its_state_dict(gpu_path, device):
    """torch loads a capturable group's ``step`` as float32 on the table's device: the step goes on from there, exactly."""
    batches = _batches(device, 4)
    uninterrupted, _ = _train("adam-global", True, device, batches)
    emb, opt = _train("adam-global", True, device, batches[:2])
    resumed = ls.SparseEmbedding(300, 8, seed=1, device=device)
    resumed.load_state_dict(emb.state_dict())
    name, kwargs = CASES["adam-global"]
    resumed_opt = getattr(ls, name)([resumed], capturable=True, **kwargs)
    resumed_opt.load_state_dict(opt.state_dict())
    assert resumed_opt.state[resumed.shard]["step"].device == resumed.shard.device
    target = torch.linspace(-1, 1, 8, device=device)
    for ids in batches[2:]:
        (resumed(ids) - target).pow(2).sum().backward()
        resumed_opt.step()
        resumed_opt.zero_grad()
    exact = dict(rtol=0, atol=0) if device == "cpu" else DEVICE_SCALARS_TOLERANCE
    torch.testing.assert_close(resumed.full_weight(), uninterrupted.full_weight(), **exact)
