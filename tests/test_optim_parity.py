"""Sparse optimizers on 1 to 4 ranks, 1-D and 2-D sharded, equal single-process torch references."""

from __future__ import annotations

import os

import pytest
import torch
from rank_pool import DEVICES, LAYOUTS, assert_replicas_identical, table_groups
from references import batch_loss, make_reference, reference_train

import lightning_sparse as ls
from lightning_sparse.kernels import backend

N, D, STEPS, GLOBAL_BATCH, BAG = 23, 4, 5, 12, 3
SEED = 11

CASES = {
    "sgd": ("SparseSGD", dict(lr=0.5)),
    "adagrad": ("SparseAdagrad", dict(lr=0.3, lr_decay=0.05, initial_accumulator_value=0.1)),
    "rowwise-adagrad": ("SparseRowWiseAdagrad", dict(lr=0.3, weight_decay=0.05)),
    "adam-global": ("SparseAdam", dict(lr=0.05, bias_correction="global")),
    "adam-row": ("SparseAdam", dict(lr=0.05)),
    "adamw-row": ("SparseAdam", dict(lr=0.05, weight_decay=0.2, decoupled_weight_decay=True)),
}
# Every other setting the optimizers take, each away from its default (test_each_setting_moves_its_reference): the
# arithmetic after the exchange, so on one rank and on three (two layouts instead of CASES' ten; adamw-row takes
# a decay through every layout).
SETTINGS = {
    "sgd-wd": ("SparseSGD", dict(lr=0.5, weight_decay=0.1)),
    "adagrad-wd": ("SparseAdagrad", dict(lr=0.3, weight_decay=0.1)),
    "adagrad-eps": ("SparseAdagrad", dict(lr=0.3, eps=0.3)),
    "rowwise-adagrad-init-eps": ("SparseRowWiseAdagrad", dict(lr=0.3, initial_accumulator_value=0.5, eps=0.3)),
    "adam-row-l2": ("SparseAdam", dict(lr=0.05, weight_decay=0.2)),
    "adam-row-betas-eps": ("SparseAdam", dict(lr=0.05, betas=(0.5, 0.9), eps=0.1)),
    "adam-global-betas-eps": ("SparseAdam", dict(lr=0.05, betas=(0.5, 0.9), eps=0.1, bias_correction="global")),
    "adam-global-l2": ("SparseAdam", dict(lr=0.05, weight_decay=0.2, bias_correction="global")),
    "adamw-global": ("SparseAdam", dict(lr=0.05, weight_decay=0.2, decoupled_weight_decay=True, bias_correction="global")),
}
# The GPU's code path, one process: compiled on a GPU, else through Triton's interpreter on CPU tensors (conftest.py).
GPU_PATH_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (backend.interpreting() and backend.triton_available()),
                                                 reason="needs triton's interpreter")),
    pytest.param("cuda", marks=pytest.mark.skipif(not (torch.cuda.is_available() and backend.triton_available()),
                                                  reason="needs CUDA and triton")),
]  # fmt: skip
SETTING_LAYOUTS = [pytest.param(1, "mod", id="W1-mod"), pytest.param(3, "range", id="W3-range")]


def make_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of bags of ids, skewed so that some rows repeat within and across ranks."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        ids = (torch.rand(GLOBAL_BATCH, BAG, generator=gen) ** 2 * N).long()
        target = torch.randn(GLOBAL_BATCH, D, generator=gen)
        batches.append((ids, target))
    return batches


def train_sharded(
    name: str, kwargs: dict, scheme: str, batches, device: str = "cpu", group_size: int | None = None
) -> torch.Tensor:
    """One rank's part of the run: its slice of each global batch, a loss scaled as in the README."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with table_groups(group_size) as groups:
        emb = ls.SparseEmbedding(N, D, sharding=scheme, seed=SEED, device=device, **groups)
        opt = getattr(ls, name)([emb], **kwargs)
        for ids, target in batches:
            mine = torch.tensor_split(torch.arange(len(ids)), world)[rank]
            # Each rank's loss is a mean over its own samples; equal slices make the average over
            # ranks equal to the global mean.
            loss = batch_loss(emb(ids[mine].to(device)), target[mine].to(device)).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return emb.full_weight().cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size, group_size", LAYOUTS)
@pytest.mark.parametrize("scheme", ["mod", "range"])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_process_reference(rank_pools, world_size, group_size, scheme, case, device):
    name, kwargs = CASES[case]
    batches = make_batches()
    initial = ls.init.normal()(torch.arange(N), D, SEED)
    expected = reference_train(name, kwargs, initial, batches)
    results = rank_pools(world_size, device).run(train_sharded, name, kwargs, scheme, batches, device, group_size)
    for got in results:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert_replicas_identical([(got,) for got in results], group_size)
    assert not torch.equal(expected, initial), "the run must actually train"


@pytest.mark.parametrize("world_size, scheme", SETTING_LAYOUTS)
@pytest.mark.parametrize("case", list(SETTINGS))
def test_every_setting_matches_its_reference(rank_pools, world_size, scheme, case):
    name, kwargs = SETTINGS[case]
    batches = make_batches()
    expected = reference_train(name, kwargs, ls.init.normal()(torch.arange(N), D, SEED), batches)
    for got in rank_pools(world_size).run(train_sharded, name, kwargs, scheme, batches):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", GPU_PATH_DEVICES)
@pytest.mark.parametrize("case", list(SETTINGS))
def test_the_gpu_path_matches_every_setting_s_reference(monkeypatch, case, device):
    """The fused update kernels (Triton; on CPU through its interpreter), one process, against the same references."""
    monkeypatch.setenv(backend.ENV, "triton")
    name, kwargs = SETTINGS[case]
    got, expected = train_in_one_process(name, kwargs, make_batches()[:3], device)  # (the interpreter: seconds a step)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def train_in_one_process(name: str, kwargs: dict, batches, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(the table trained by ``ls.<name>`` in this process, on ``device``; the torch reference's table)."""
    emb = ls.SparseEmbedding(N, D, seed=SEED, device=device)
    opt = getattr(ls, name)([emb], **kwargs)
    for ids, target in batches:
        batch_loss(emb(ids.to(device)), target.to(device)).mean().backward()
        opt.step()
        opt.zero_grad()
    return emb.full_weight().cpu(), reference_train(name, kwargs, ls.init.normal()(torch.arange(N), D, SEED), batches)


CPU_KERNELS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(not backend.numba_available(), reason="needs numba"))]


@pytest.mark.parametrize("kernels", CPU_KERNELS)
@pytest.mark.parametrize("case", [*CASES, *SETTINGS])
def test_the_cpu_update_matches_every_reference(monkeypatch, case, kernels):
    """Both CPU updates, one process: torch ops (:mod:`lightning_sparse.optim.functional`) and numba's fused kernel (what
    ``auto`` picks on a CPU when numba imports, so the multi-rank tests above run it), against torch's optimizers."""
    monkeypatch.setenv(backend.ENV, kernels)
    name, kwargs = {**CASES, **SETTINGS}[case]
    got, expected = train_in_one_process(name, kwargs, make_batches())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [*CASES, *SETTINGS])
def test_each_setting_moves_its_reference(case):
    """Left at its default, each setting of a case changes the trained table by more than the parity tests' tolerance:
    so an optimizer that ignored it would fail them."""
    name, kwargs = {**CASES, **SETTINGS}[case]
    initial, batches = ls.init.normal()(torch.arange(N), D, SEED), make_batches()
    expected = reference_train(name, kwargs, initial, batches)
    for key in set(kwargs) - {"lr"}:  # (the parity tests' "must train" guard holds lr)
        default = reference_train(name, {k: v for k, v in kwargs.items() if k != key}, initial, batches)
        assert not torch.allclose(default, expected, rtol=1e-5, atol=1e-6), f"{case}: {key} changes nothing"


def _decoy(value):
    """Another value of a numeric hyperparameter (a constructor default the param group overrides)."""
    if isinstance(value, tuple):
        return tuple(0.5 * v for v in value)
    return 3.0 * value + 0.01 if isinstance(value, float) else value


@pytest.mark.parametrize("kernels", CPU_KERNELS)
@pytest.mark.parametrize("case", [*CASES, *SETTINGS])
def test_a_param_group_s_settings_win_over_the_constructor_s(monkeypatch, case, kernels):
    """Every numeric setting given in the param group (torch's convention) is the one the step uses, whatever the
    constructor was given: the same training as the constructor given the group's settings. (An optimizer that read
    ``self.defaults``, e.g. SGD's weight decay or Adam's betas, fails it.)"""
    monkeypatch.setenv(backend.ENV, kernels)
    name, kwargs = {**CASES, **SETTINGS}[case]
    emb = ls.SparseEmbedding(N, D, seed=SEED)
    opt = getattr(ls, name)([{"params": [emb], **kwargs}], **{key: _decoy(value) for key, value in kwargs.items()})
    for ids, target in make_batches():
        batch_loss(emb(ids), target).mean().backward()
        opt.step()
        opt.zero_grad()
    expected, _ = train_in_one_process(name, kwargs, make_batches())
    torch.testing.assert_close(emb.full_weight(), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- param groups with their own learning rates
GROUP_OPTIMIZERS = {  # lightning_sparse's, torch's (on nn.Embedding(sparse=True)), the hyperparameters both take, ours only
    "adagrad": ("SparseAdagrad", torch.optim.Adagrad, dict(initial_accumulator_value=0.1), {}),
    "adam-global": ("SparseAdam", torch.optim.SparseAdam, dict(betas=(0.8, 0.99)), dict(bias_correction="global")),
}
GROUP_LRS = (0.1, 1.0)


def _group_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(8)
    return [((torch.rand(9, generator=gen) ** 2 * 13).long(), (torch.rand(5, generator=gen) ** 2 * 7).long()) for _ in range(3)]


def _group_loss(rows_a: torch.Tensor, rows_b: torch.Tensor) -> torch.Tensor:
    return rows_a.pow(2).sum() + (rows_b.sum(0) * rows_a[:3].sum(0)).pow(2).sum()


@pytest.mark.parametrize("collection", [False, True], ids=["tables", "collection"])
@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=GPU_PATH_DEVICES[0].marks)])
@pytest.mark.parametrize("case", list(GROUP_OPTIMIZERS))
def test_param_groups_keep_their_own_learning_rates(monkeypatch, case, kernels, collection):
    """Two tables in two param groups (lr 0.1 and 1.0), on the plain path and the fused one (Triton), as two tables or as
    the tables of one collection (whose rounds then split per group), against torch's optimizer with the same groups."""
    monkeypatch.setenv(backend.ENV, kernels)
    name, torch_cls, kwargs, ours = GROUP_OPTIMIZERS[case]
    a, b = ls.SparseEmbedding(13, 3, seed=1), ls.SparseEmbedding(7, 3, seed=2, sharding="range")
    if collection:
        both = ls.SparseEmbeddingCollection({"a": a, "b": b})
        lookup = lambda ids_a, ids_b: tuple(both({"a": ids_a, "b": ids_b}).values())  # noqa: E731
    else:
        lookup = lambda ids_a, ids_b: (a(ids_a), b(ids_b))  # noqa: E731
    opt = getattr(ls, name)([{"params": [a], "lr": GROUP_LRS[0]}, {"params": [b], "lr": GROUP_LRS[1]}], **kwargs, **ours)
    plain_a, plain_b = torch.nn.Embedding(13, 3, sparse=True), torch.nn.Embedding(7, 3, sparse=True)
    with torch.no_grad():
        plain_a.weight.copy_(ls.init.normal()(torch.arange(13), 3, 1))
        plain_b.weight.copy_(ls.init.normal()(torch.arange(7), 3, 2))
    reference = torch_cls([{"params": [plain_a.weight], "lr": GROUP_LRS[0]}, {"params": [plain_b.weight], "lr": GROUP_LRS[1]}],
                          **kwargs)  # fmt: skip
    for ids_a, ids_b in _group_batches():
        _group_loss(*lookup(ids_a, ids_b)).backward()
        opt.step()
        opt.zero_grad()
        _group_loss(plain_a(ids_a), plain_b(ids_b)).backward()
        reference.step()
        reference.zero_grad()
    assert [group["lr"] for group in opt.param_groups] == list(GROUP_LRS)
    torch.testing.assert_close(a.full_weight(), plain_a.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.full_weight(), plain_b.weight.detach(), rtol=1e-5, atol=1e-6)


def test_local_table_without_process_group_matches_reference():
    """No process group at all: a plain local table, for notebooks and unit tests."""
    name, kwargs = CASES["adagrad"]
    batches = make_batches(seed=3)
    emb = ls.SparseEmbedding(N, D, seed=SEED)
    opt = ls.SparseAdagrad([emb], **kwargs)
    for ids, target in batches:
        batch_loss(emb(ids), target).mean().backward()
        opt.step()
        opt.zero_grad()
    expected = reference_train(name, kwargs, ls.init.normal()(torch.arange(N), D, SEED), batches)
    torch.testing.assert_close(emb.full_weight(), expected, rtol=1e-5, atol=1e-6)


def _accumulate_and_multi_table(device: str = "cpu", group_size: int | None = None):
    """Two tables (different widths) in one optimizer, two backward passes per step."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    with table_groups(group_size) as groups:
        a = ls.SparseEmbedding(13, 3, seed=1, sharding="range", device=device, **groups)
        b = ls.SparseEmbedding(7, 5, seed=2, device=device, **groups)
        opt = ls.SparseSGD([a, b], lr=0.1)
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            for _micro in range(2):
                ids_a = torch.randint(0, 13, (4 * world,), generator=gen)
                ids_b = torch.randint(0, 7, (2 * world,), generator=gen)
                mine_a, mine_b = ids_a.chunk(world)[rank].to(device), ids_b.chunk(world)[rank].to(device)
                loss = a(mine_a).pow(2).sum() + (b(mine_b) * 3).sum()
                loss.backward()
            opt.step()
            opt.zero_grad()
        return a.full_weight().cpu(), b.full_weight().cpu(), opt.stats.bytes_sent


def accumulate_reference(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tables of :func:`_accumulate_and_multi_table` trained in one process: nn.Embedding and torch's SGD."""
    a = torch.nn.Embedding(13, 3, sparse=True)
    b = torch.nn.Embedding(7, 5, sparse=True)
    with torch.no_grad():
        a.weight.copy_(ls.init.normal()(torch.arange(13), 3, 1))
        b.weight.copy_(ls.init.normal()(torch.arange(7), 5, 2))
    opt = torch.optim.SGD([a.weight, b.weight], lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for _micro in range(2):
            ids_a = torch.randint(0, 13, (4 * world_size,), generator=gen)
            ids_b = torch.randint(0, 7, (2 * world_size,), generator=gen)
            # Sum of per-rank losses averaged over ranks.
            ((a(ids_a).pow(2).sum() + (b(ids_b) * 3).sum()) / world_size).backward()
        opt.step()
        opt.zero_grad()
    return a.weight.detach(), b.weight.detach()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size, group_size", LAYOUTS)
def test_gradient_accumulation_and_two_tables(rank_pools, world_size, group_size, device):
    results = rank_pools(world_size, device).run(_accumulate_and_multi_table, device, group_size)
    assert_replicas_identical([result[:2] for result in results], group_size)
    expected_a, expected_b = accumulate_reference(world_size)
    for got_a, got_b, sent in results:
        torch.testing.assert_close(got_a, expected_a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_b, expected_b, rtol=1e-5, atol=1e-6)
        assert (sent > 0) == (world_size > 1)


def _one_sharding_group_looks_up_b():
    """4 ranks, sharding groups of 2: both groups look up table a, only ranks 0 and 1 (group 0) table b."""
    rank = torch.distributed.get_rank()
    with table_groups(2) as groups:
        a = ls.SparseEmbedding(6, 2, seed=1, **groups)
        b = ls.SparseEmbedding(5, 3, seed=2, **groups)
        opt = ls.SparseSGD([a, b], lr=0.5)
        loss = a(torch.tensor([rank])).sum()
        if rank < 2:
            loss = loss + b(torch.tensor([rank + 1, 4])).sum()
        loss.backward()
        opt.step()
        return a.full_weight(), b.full_weight()


def test_a_table_only_one_sharding_group_looked_up_is_updated_on_every_replica(rank_pools):
    """Ranks 2 and 3 never look b up: its rows still take group 0's gradient there (replicas stay identical). b's rows
    are 3 float32 wide, 20 bytes with their id on the replicas' wire: a gather of one row is read at that stride."""
    a, b = ls.SparseEmbedding(6, 2, seed=1).full_weight(), ls.SparseEmbedding(5, 3, seed=2).full_weight()
    a[:4] -= 0.5 / 4  # each rank's row, d(sum)/d(row) = 1, averaged over the 4 ranks
    b[[1, 2]] -= 0.5 / 4
    b[4] -= 0.5 * 2 / 4  # looked up by ranks 0 and 1
    for rank, (got_a, got_b) in enumerate(rank_pools(4).run(_one_sharding_group_looks_up_b)):
        torch.testing.assert_close(got_a, a, rtol=0, atol=1e-6, msg=f"rank {rank}: a")
        torch.testing.assert_close(got_b, b, rtol=0, atol=1e-6, msg=f"rank {rank}: b")


def test_zero_grad_drops_pending_gradients_now():
    """DGL's zero_grad only marks; ours drops what backward produced, so step() after it is a no-op."""
    emb = ls.SparseEmbedding(5, 2, seed=0)
    opt = ls.SparseSGD([emb], lr=1.0)
    before = emb.full_weight()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.zero_grad()
    opt.step()
    torch.testing.assert_close(emb.full_weight(), before)
    # A lookup whose backward comes after zero_grad (Lightning's order) still counts.
    out = emb(torch.tensor([3]))
    opt.zero_grad()
    out.sum().backward()
    opt.step()
    changed = (emb.full_weight() != before).any(dim=1)
    assert changed.tolist() == [False, False, False, True, False]


def test_untouched_rows_and_state_never_change():
    emb = ls.SparseEmbedding(6, 3, seed=0)
    opt = ls.SparseAdam([emb], lr=0.1, weight_decay=0.5, decoupled_weight_decay=True)
    before = emb.full_weight()
    for _ in range(3):
        emb(torch.tensor([0, 4, 4])).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    after = emb.full_weight()
    untouched = [1, 2, 3, 5]
    torch.testing.assert_close(after[untouched], before[untouched], rtol=0, atol=0)
    assert opt.state[emb.shard]["row_step"].tolist() == [3, 0, 0, 0, 3, 0]
    assert (opt.state[emb.shard]["exp_avg"][untouched] == 0).all()


def test_state_dict_round_trip_and_lr_scheduler():
    def run(steps, opt_state=None, weights=None):
        emb = ls.SparseEmbedding(9, 2, seed=4)
        if weights is not None:
            emb.load_state_dict(weights)
        opt = ls.SparseAdam([emb], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if opt_state is not None:
            opt.load_state_dict(opt_state[0])
            sched.load_state_dict(opt_state[1])
        for ids in steps:
            emb(ids).pow(3).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        return emb, opt, sched

    steps = [torch.tensor([1, 2, 2]), torch.tensor([2, 8]), torch.tensor([0, 1]), torch.tensor([8, 8, 3])]
    full, _, _ = run(steps)
    half_emb, half_opt, half_sched = run(steps[:2])
    assert half_opt.param_groups[0]["lr"] == pytest.approx(0.025)
    state = half_opt.state_dict()
    assert set(state) == {"state", "param_groups"}
    assert state["state"][0]["row_step"].dtype == torch.int64
    resumed, resumed_opt, _ = run(steps[2:], (state, half_sched.state_dict()), half_emb.state_dict())
    assert resumed_opt.state[resumed.shard]["row_step"].dtype == torch.int64
    torch.testing.assert_close(resumed.full_weight(), full.full_weight(), rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_an_lr_scheduler_reaches_every_optimizer_s_next_step(case):
    """StepLR halves the param group's lr after each step: every optimizer reads it at its next step (none keeps the lr it
    was built with), as its reference given the same lr does."""
    name, kwargs = CASES[case]
    emb = ls.SparseEmbedding(N, D, seed=SEED)
    opt = getattr(ls, name)([emb], **kwargs)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    plain = torch.nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        plain.weight.copy_(emb.full_weight())
    reference = make_reference(name, plain.weight, kwargs)
    for ids, target in make_batches():
        batch_loss(emb(ids), target).mean().backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        batch_loss(plain(ids), target).mean().backward()
        reference.step()
        reference.zero_grad()
        if hasattr(reference, "optimizer"):  # a torch optimizer (weight decay added on the touched rows)
            reference.optimizer.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
        else:
            reference.lr = opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] == pytest.approx(kwargs["lr"] * 0.5**STEPS)
    torch.testing.assert_close(emb.full_weight(), plain.weight.detach(), rtol=1e-5, atol=1e-6)


def _full_state_after_steps() -> dict:
    emb = ls.SparseEmbedding(N, D, seed=SEED)
    opt = ls.SparseAdam([emb], lr=0.05)
    for ids, target in make_batches()[:3]:
        batch_loss(emb(ids), target).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"weights": ls.full_state_dict(torch.nn.ModuleDict({"t": emb})), "optimizer": opt.full_state_dict()}


def _continue_from_full_state(saved: dict, scheme: str) -> tuple[torch.Tensor, dict]:
    emb = ls.SparseEmbedding(N, D, seed=0, sharding=scheme)
    torch.nn.ModuleDict({"t": emb}).load_state_dict(saved["weights"])
    opt = ls.SparseAdam([emb], lr=0.05)
    opt.load_full_state_dict(saved["optimizer"])
    for ids, target in make_batches()[3:]:
        batch_loss(emb(ids), target).mean().backward()
        opt.step()
        opt.zero_grad()
    return emb.full_weight(), opt.full_state_dict()


def test_full_optimizer_state_moves_between_world_sizes(rank_pools):
    saved = rank_pools(2).run(_full_state_after_steps)[0]
    assert saved["optimizer"]["state"][0]["row_step"].shape == (N,)
    reference = rank_pools(1).run(_continue_from_full_state, saved, "mod")[0]
    for weights, state in rank_pools(3).run(_continue_from_full_state, saved, "range"):
        torch.testing.assert_close(weights, reference[0], rtol=1e-6, atol=1e-7)
        for key, value in reference[1]["state"][0].items():
            torch.testing.assert_close(state["state"][0][key], value, rtol=1e-6, atol=1e-7)


MIXED_IDS = torch.tensor([[31745, 5, 40_000 - 1], [31745, 7, 12]])  # per rank; 31745 is 0x7C01, a float16 NaN bit pattern
# The float64 table's gradient: 1 + 2**-30 per occurrence, which a float32 wire would round to 1.
FINE = 1 + 2**-30
# (dtype, seed, dim, rtol, atol): each table held to the precision of its dtype (float16: one rounding to nearest).
MIXED_TABLES = [(torch.float64, 1, 2, 0.0, 1e-14), (torch.float16, 2, 3, 2**-10, 0.0), (torch.float16, 3, 2, 2**-10, 0.0)]


def _mixed_dtypes(device: str = "cpu") -> list[torch.Tensor]:
    ids = MIXED_IDS[torch.distributed.get_rank()].to(device)
    (wide_dtype, wide_seed, wide_dim, *_), (_, half_seed, half_dim, *_), (_, alone_seed, alone_dim, *_) = MIXED_TABLES
    wide = ls.SparseEmbedding(40_000, wide_dim, dtype=wide_dtype, seed=wide_seed, device=device)
    # Rounded to nearest, as the reference below; the gradients of half tables travel in float32.
    half = ls.SparseEmbedding(40_000, half_dim, dtype=torch.float16, stochastic_rounding=False, seed=half_seed,
                              sharding="range", device=device)  # fmt: skip
    together = ls.SparseSGD([wide, half], lr=0.5)  # wire dtype float64
    alone_table = ls.SparseEmbedding(40_000, alone_dim, dtype=torch.float16, stochastic_rounding=False, seed=alone_seed,
                                     device=device)  # fmt: skip
    alone = ls.SparseSGD([alone_table], lr=0.5)  # wire float32
    (wide(ids).sum() * FINE + half(ids).float().sum() + alone_table(ids).float().sum()).backward()
    together.step()
    alone.step()
    return [table.full_weight().cpu() for table in (wide, half, alone_table)]


@pytest.mark.parametrize("device", DEVICES)
def test_tables_of_mixed_dtypes_share_one_round(rank_pools, device):
    """Every row of each table (touched or not), each to its dtype's precision: float64 gradients keep float64's."""
    check_mixed_dtypes(rank_pools(2, device).run(_mixed_dtypes, device))


def check_mixed_dtypes(got: list[list[torch.Tensor]]) -> None:
    """Each rank's tables from :func:`_mixed_dtypes` against float64 arithmetic rounded once to each table's dtype."""
    counts = torch.zeros(40_000, dtype=torch.float64).index_add_(0, MIXED_IDS.flatten(), torch.ones(6, dtype=torch.float64))
    for index, (dtype, seed, dim, rtol, atol) in enumerate(MIXED_TABLES):
        table = ls.init.normal()(torch.arange(40_000), dim, seed).to(dtype).double()
        grad = counts / 2 * (FINE if dtype == torch.float64 else 1.0)  # per occurrence, averaged over 2 ranks
        expected = (table - 0.5 * grad.unsqueeze(1)).to(dtype)  # float64 arithmetic, one rounding to the table's dtype
        assert not torch.equal(expected, table.to(dtype)), "the step must move rows"
        for rank, result in enumerate(got):
            assert result[index].dtype == dtype
            torch.testing.assert_close(result[index], expected, rtol=rtol, atol=atol, msg=f"rank {rank}, {dtype}, seed {seed}")


def _non_finite_on_one_rank(check: bool, group_size: int | None = None):
    with table_groups(group_size) as groups:
        return _step_with_inf_on_last_rank(check, groups)


def _step_with_inf_on_last_rank(check: bool, groups: dict):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    users = ls.SparseEmbedding(20, 2, seed=1, name="users", **groups)
    items = ls.SparseEmbedding(20, 2, seed=2, name="items", **groups)
    opt = ls.SparseAdam([users, items], lr=0.1, check_finite=check)
    before = (users.full_weight(), items.full_weight())
    scale = float("inf") if rank == world - 1 else 1.0
    (users(torch.tensor([rank, 5])).sum() * scale + items(torch.tensor([3])).sum()).backward()
    try:
        opt.step()
        outcome = "stepped"
    except FloatingPointError as err:
        outcome = str(err)
    unchanged = torch.equal(users.full_weight(), before[0]) and torch.equal(items.full_weight(), before[1])
    (users(torch.tensor([rank])).sum() + items(torch.tensor([3])).sum()).backward()
    opt.step()  # the group and the optimizer still work
    return outcome, unchanged, bool(torch.isfinite(users.full_weight()).all())


@pytest.mark.parametrize("world_size, group_size", [(1, None), (2, None), (4, 2)])
def test_check_finite_raises_on_every_rank_and_updates_nothing(rank_pools, world_size, group_size):
    """Under 2-D sharding (4, 2) the other sharding group learns of the inf through the replica round."""
    for outcome, unchanged, finite in rank_pools(world_size).run(_non_finite_on_one_rank, True, group_size):
        assert f"not finite (inf or NaN) for users on rank(s) [{world_size - 1}]" in outcome and "HINT" in outcome
        assert "items" not in outcome.split("HINT")[0].split("for ", 1)[1]
        assert unchanged and finite
    for outcome, unchanged, finite in rank_pools(world_size).run(_non_finite_on_one_rank, False, group_size):
        assert outcome == "stepped" and not unchanged and not finite  # the default: torch's behaviour, rows poisoned


def _non_finite_checked(way: str):
    """``_step_with_inf_on_last_rank`` with the check on: on the GPU's path (Triton, through its interpreter on CPU), or
    with the tables in shared memory."""
    if way == "shared_memory":
        return _step_with_inf_on_last_rank(True, {"shared_memory": True})
    os.environ[backend.ENV] = "triton"
    try:
        return _step_with_inf_on_last_rank(True, {})
    finally:
        del os.environ[backend.ENV]


@pytest.mark.parametrize("way", [pytest.param("triton", marks=GPU_PATH_DEVICES[0].marks), "shared_memory"])
def test_check_finite_raises_on_every_rank_on_the_gpu_path_and_in_shared_memory(rank_pools, way):
    """On the GPU's path a step after every rank's sole lookup keeps its control codes on the device, unless gradients
    are checked: their flags ride in the codes. Tables in shared memory take no routed round: the flags ride in the
    general round's header, which must give every rank every rank's codes, not its own."""
    for outcome, unchanged, finite in rank_pools(2).run(_non_finite_checked, way):
        assert "not finite (inf or NaN) for users on rank(s) [1]" in outcome and "HINT" in outcome, outcome
        assert unchanged and finite
