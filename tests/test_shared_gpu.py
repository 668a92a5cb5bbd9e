"""Ranks sharing one GPU over gloo: the several-rank GPU path as a tested configuration.

NCCL refuses two ranks on one device, but gloo moves CUDA tensors through pinned host memory, so 2 or 3 ranks on
one GPU run every part of the several-rank path that is the GPU's: the Triton kernels after the all-to-alls, the
split sizes' host reads, the device-side range check, the pinned buffers (docs/guide/launching.md). With CUDA the
ranks of a ``"cuda"`` pool share GPU 0 over gloo (``rank_pool.backend_for``); ``benchmarks/gpu_checks.sh`` runs them.
Without CUDA the same tests run the GPU's code path on CPU tensors through Triton's interpreter
(``"interpreted"``: ``LIGHTNING_SPARSE_KERNELS=triton``), a subset of the cases, as the suite's time allows.

The GPU path and the CPU torch path differ by up to 1 ulp on distinct ids (division and square root are rounded
alike, sums of runs are ordered alike, but fused multiply-adds are not), so every comparison across devices holds
to :data:`CROSS_DEVICE`.
"""

from __future__ import annotations

import os
import signal

import lightning_models as lm
import pytest
import test_collection
import test_dynamic
import test_optim_parity
import torch
from lightning.pytorch import Callback
from rank_pool import COLLECTIVE_TIMEOUT_S, RankError, RankPool, assert_replicas_identical
from references import reference_train
from test_kernels import KERNEL_DEVICES

import lightning_sparse as ls
from lightning_sparse.kernels import backend

# Tolerance of a GPU-path result against a plain-torch CPU reference (see the module's docstring).
CROSS_DEVICE = dict(rtol=1e-5, atol=1e-6)

# test_kernels' devices, the CPU one named "interpreted" (its ranks hold CPU tensors, on the GPU's code path).
_INTERPRETED, _CUDA = KERNEL_DEVICES
DEVICES = [pytest.param("interpreted", marks=_INTERPRETED.marks), _CUDA]


def _pool_device(device: str) -> str:
    """The rank pool's device: ``"interpreted"`` ranks hold CPU tensors."""
    return "cpu" if device == "interpreted" else device


def _on_gpu_path(fn, *args):
    """``fn(*args)`` on a rank, with the GPU's kernels (Triton: compiled on a GPU, interpreted on CPU tensors)."""
    os.environ[backend.ENV] = "triton"
    try:
        return fn(*args)
    finally:
        del os.environ[backend.ENV]


def _cases(both: list[tuple], cuda_only: list[tuple]) -> list:
    """Parameters: ``both`` run on both devices; ``cuda_only``, the rest of the cases, where the interpreter's time is not spent."""
    only_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter runs fewer cases")
    return [*both, *(pytest.param(*case, marks=only_cuda) for case in cuda_only)]


# ---------------------------------------------------------------- parity
TABLE_CASES = [("sgd-wd", "mod", 2), ("adagrad", "range", 3), ("rowwise-adagrad", "mod", 3), ("adam-row", "range", 2)]
MORE_TABLE_CASES = [(case, scheme, world) for case in [*test_optim_parity.CASES, "sgd-wd"] for scheme in ("mod", "range")
                    for world in (2, 3) if (case, scheme, world) not in TABLE_CASES]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, scheme, world_size", _cases(TABLE_CASES, MORE_TABLE_CASES))
def test_tables_train_as_one_process(rank_pools, device, case, scheme, world_size):
    """Every optimizer, both sharding schemes, 2 and 3 ranks: as nn.Embedding(sparse=True) and torch's optimizer."""
    name, kwargs = {**test_optim_parity.CASES, **test_optim_parity.SETTINGS}[case]
    batches = test_optim_parity.make_batches()
    initial = ls.init.normal()(torch.arange(test_optim_parity.N), test_optim_parity.D, test_optim_parity.SEED)
    expected = reference_train(name, kwargs, initial, batches)
    pool = rank_pools(world_size, _pool_device(device))
    for got in pool.run(_on_gpu_path, test_optim_parity.train_sharded, name, kwargs, scheme, batches, _pool_device(device)):
        torch.testing.assert_close(got, expected, **CROSS_DEVICE)
    assert not torch.equal(expected, initial), "the run must actually train"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size, group_size", [(2, None), (2, 1), (3, None)])
def test_two_tables_with_accumulation_and_2d_sharding(rank_pools, device, world_size, group_size):
    """Two tables of two widths in one optimizer, two backward passes a step (the general round), 1-D and 2-D sharded."""
    pool = rank_pools(world_size, _pool_device(device))
    results = pool.run(_on_gpu_path, test_optim_parity._accumulate_and_multi_table, _pool_device(device), group_size)
    assert_replicas_identical([result[:2] for result in results], group_size)
    expected = test_optim_parity.accumulate_reference(world_size)
    for got_a, got_b, _sent in results:
        torch.testing.assert_close(got_a, expected[0], **CROSS_DEVICE)
        torch.testing.assert_close(got_b, expected[1], **CROSS_DEVICE)


@pytest.mark.parametrize("device", DEVICES)
def test_tables_of_mixed_dtypes_keep_their_precision(rank_pools, device):
    """float64, fp16 and fp16 alone, two optimizers: float64 gradients are summed in float64 (the kernel's float32 sum
    would lose them)."""
    device = _pool_device(device)
    test_optim_parity.check_mixed_dtypes(rank_pools(2, device).run(_on_gpu_path, test_optim_parity._mixed_dtypes, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, world_size", _cases([("adagrad", 2)], [("adagrad", 3), ("adam-row", 2), ("sgd", 3)]))
def test_collections_pooled_and_jagged_train_as_plain_torch(rank_pools, device, case, world_size):
    """Mixed dims and dtypes, pooled (sum, weighted, mean) and jagged features, a feature missing on one rank."""
    name, kwargs = test_collection.CASES[case]
    schemes = {"user": "mod", "item": "range", "tag": "mod"}
    batches = test_collection.make_batches()
    expected_out, expected = test_collection.reference(name, kwargs, batches, world_size)
    pool = rank_pools(world_size, _pool_device(device))
    results = pool.run(_on_gpu_path, test_collection.train_sharded, name, kwargs, schemes, batches, _pool_device(device), None)
    for rank, (outputs, tables) in enumerate(results):
        for step, out in enumerate(outputs):
            for feature, value in out.items():
                torch.testing.assert_close(value, expected_out[step][rank][feature], **CROSS_DEVICE)
        for t, weight in tables.items():
            torch.testing.assert_close(weight, expected[t], **CROSS_DEVICE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, world_size", _cases([("adagrad", 2)], [("adagrad", 3), ("adam-row", 3), ("sgd", 2)]))
def test_dynamic_tables_train_as_sparse_tables(rank_pools, device, case, world_size):
    """A DynamicEmbedding fed raw 64-bit ids trains as a SparseEmbedding fed their rows (accumulation included)."""
    name, kwargs = test_dynamic.CASES[case]
    batches = test_dynamic.make_batches()
    used = torch.unique(torch.cat([ids.view(-1) for ids, _ in batches]))
    by_id = used[torch.argsort(test_dynamic.RAW[used])]
    pool = rank_pools(world_size, _pool_device(device))
    for sparse, ids, rows in pool.run(
        _on_gpu_path, test_dynamic._train_side_by_side, name, kwargs, batches, _pool_device(device)
    ):
        assert torch.equal(ids, test_dynamic.RAW[by_id])
        torch.testing.assert_close(rows, sparse[by_id], rtol=0, atol=0)  # the same kernels on both: bit for bit


# ---------------------------------------------------------------- bad input and lost ranks
def _bad_id_on_rank_one(device: str) -> tuple[str, str, torch.Size]:
    rank = torch.distributed.get_rank()
    emb = ls.SparseEmbedding(50, 4, device=device)
    try:
        emb(torch.tensor([3, 50 + 7 * rank if rank == 1 else 4], device=device)).sum().backward()
    except IndexError as err:
        message = str(err)
    else:
        message = ""
    # the group is still usable: the next lookup works on every rank
    return message, emb(torch.tensor([1, 49], device=device)).shape


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_id_on_one_rank_raises_on_every_rank(rank_pools, device):
    results = rank_pools(2, _pool_device(device)).run(_on_gpu_path, _bad_id_on_rank_one, _pool_device(device))
    for rank, (message, shape) in enumerate(results):
        assert "got id 57 on " + ("rank 1" if rank == 0 else "this rank") in message and "HINT: " in message, message
        assert shape == torch.Size([2, 4])


def _lose_rank_one(device: str) -> str:
    emb = ls.SparseEmbedding(50, 4, device=device)
    opt = ls.SparseAdagrad([emb], lr=0.1)
    ids = torch.tensor([1, 2, 40], device=device)
    emb(ids).sum().backward()
    opt.step()
    if torch.distributed.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    emb(ids).sum().backward()  # rank 0 waits for rank 1's ids in vain
    opt.step()
    return "no failure"


@pytest.mark.parametrize("device", DEVICES)
def test_a_lost_rank_is_a_peer_failure(device):
    pool = RankPool(2, _pool_device(device))
    try:
        results = pool.run_raw(_on_gpu_path, _lose_rank_one, _pool_device(device), timeout=3 * COLLECTIVE_TIMEOUT_S)
    finally:
        pool.close()
    survivor, lost = results
    assert isinstance(survivor, RankError) and survivor.type == "PeerFailure" and "HINT: " in survivor.message, survivor
    assert isinstance(lost, RankError) and lost.type == "ProcessDied"


# ---------------------------------------------------------------- Lightning: a fit, and checkpoints across devices
def _shared_strategy(device: str, world_size: int) -> ls.SparseDDPStrategy:
    """``sparse_ddp`` with every rank on one device: ``parallel_devices`` names it once per rank; gloo moves its tensors."""
    one = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    return ls.SparseDDPStrategy(parallel_devices=[one] * world_size, process_group_backend="gloo")


class _TrainedOn(Callback):
    """The devices of the table's shard and of the dense weights in each training batch."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.add((pl_module.users.shard.device.type, pl_module.mlp[0].weight.device.type))


def _fit(device: str, world_size: int, directory: str, epochs: int, ckpt_path: str | None) -> tuple[dict, str]:
    """A fit of lm.TwoTower on ``world_size`` ranks of ``device`` (``"cpu"``: plain torch kernels), checkpointing each epoch."""
    import test_checkpoint
    from lightning.pytorch.callbacks import ModelCheckpoint

    lm.lightning_env(torch.distributed.get_rank(), world_size)
    module = lm.TwoTower()  # SparseAdagrad for the tables, SGD for the dense part: torch's reference is exact
    on_gpu_path = device != "cpu"
    devices = _TrainedOn()
    trainer = lm.trainer(
        1, accelerator="gpu" if device == "cuda" else "cpu", strategy=_shared_strategy(device, world_size), max_epochs=epochs,
        enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1), devices],
    )  # fmt: skip
    assert trainer.world_size == world_size
    if on_gpu_path:
        os.environ[backend.ENV] = "triton"
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    finally:
        os.environ.pop(backend.ENV, None)
    # Checked while training: Lightning moves the module back to the CPU at the end of a fit.
    on_device = {("cuda" if device == "cuda" else "cpu",) * 2}
    assert devices.seen == on_device if ckpt_path is None else devices.seen <= on_device, devices.seen
    return test_checkpoint._everything(module, trainer), trainer.checkpoint_callback.best_model_path


@pytest.mark.parametrize("device", DEVICES)
def test_a_fit_on_one_device_checkpoints_for_cpu_ranks_and_back(rank_pools, tmp_path, device):
    """Two ranks on one device fit as plain torch would; their checkpoint loads on three CPU ranks, which train on, and
    theirs loads back on the device's ranks: each load restores exactly what was saved."""
    (first, saved), _ = rank_pools(2, _pool_device(device)).run(_fit, device, 2, str(tmp_path / "device"), 1, None)
    expected = lm.reference(lm.global_batches(2, batch_size=4, epochs=1), torch.optim.Adagrad, {"lr": 0.2})
    assert not torch.equal(expected["users"], lm.reference([], torch.optim.Adagrad, {"lr": 0.2})["users"]), "it must train"
    for key, value in expected.items():
        torch.testing.assert_close(first[key], value, **CROSS_DEVICE, msg=key)
    loaded = rank_pools(3).run(_fit, "cpu", 3, str(tmp_path / "cpu"), 1, saved)  # nothing left to train: a load
    for got, _ in loaded:
        for key, value in first.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    (trained, resaved), *_ = rank_pools(3).run(_fit, "cpu", 3, str(tmp_path / "cpu"), 2, saved)
    assert not torch.equal(trained["users"], first["users"])
    for got, _ in rank_pools(2, _pool_device(device)).run(_fit, device, 2, str(tmp_path / "back"), 2, resaved):
        for key, value in trained.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
