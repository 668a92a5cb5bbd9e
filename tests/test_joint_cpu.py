"""A collection's one-process CPU step takes all its tables at once (lookup/joint.py, optim/joint_cpu.py).

Against the engine's round (each table's own distinct rows, pooled and summed per table, each table stepped on its
own): bitwise the same tables and optimizer state, for every optimizer, pooling mode and ``duplicate_grads``; and the
ops of a step grow by less than the tables do.
"""

from __future__ import annotations

import io

import pytest
import torch
from host_reads import HostReads
from test_gpu_path import AtenOps

import lightning_sparse as ls
from lightning_sparse.kernels import backend
from lightning_sparse.lookup.engine import Round
from lightning_sparse.lookup.joint import Joint

OPTIMIZERS = [("SparseSGD", dict(lr=0.1, weight_decay=0.01)), ("SparseAdagrad", dict(lr=0.1, lr_decay=0.1)),
              ("SparseRowWiseAdagrad", dict(lr=0.1, weight_decay=0.01)),
              ("SparseAdam", dict(lr=0.01, bias_correction="global", weight_decay=0.1, decoupled_weight_decay=True)),
              ("SparseAdam", dict(lr=0.01, weight_decay=0.1))]  # fmt: skip


FEATURES = ("ids", "bags", "means", "more", "grid", "jagged_means", "rows")
POOLING = {"bags": "sum", "means": "mean", "grid": "sum", "jagged_means": "mean"}


def _collection(shared: bool = False) -> ls.SparseEmbeddingCollection:
    """A table per feature, or (``shared``) 4 tables, several features reading one."""
    if shared:
        tables = {f"t{i}": ls.SparseEmbedding(30 + 7 * i, 4, seed=i) for i in range(4)}
        features = dict(zip(FEATURES, ("t0", "t1", "t2", "t0", "t3", "t3", "t1")))
    else:
        tables = {name: ls.SparseEmbedding(51, 4, seed=i) for i, name in enumerate(FEATURES)}
        features = None
    return ls.SparseEmbeddingCollection(tables, features=features, pooling=POOLING)


def _features(step: int) -> dict:
    """Every kind of input, repeated ids, an empty bag; at step 1 three features rest (their tables' step counts differ)."""
    gen = torch.Generator().manual_seed(step)
    ids = lambda high, *shape: torch.randint(0, high, shape, generator=gen)  # noqa: E731
    features = {"ids": ids(12, 6), "more": ids(30, 2, 3),
                "bags": ls.JaggedIds(ids(37, 9), lengths=torch.tensor([2, 0, 4, 3]), weights=torch.rand(9, generator=gen)),
                "rows": ls.JaggedIds(ids(37, 5), lengths=torch.tensor([3, 2])),
                "means": ids(44, 4, 3), "grid": ids(51, 3, 2),
                "jagged_means": ls.JaggedIds(ids(51, 7), offsets=torch.tensor([0, 3, 3, 7]))}  # fmt: skip
    if step == 1:
        for name in ("means", "grid", "jagged_means"):
            del features[name]
    return features


def _train(optimizer: str, kwargs: dict, joint: bool, duplicate_grads: str = "sum", also_direct: bool = False, steps: int = 4,
           shared: bool = False) -> tuple:  # fmt: skip
    collection = _collection(shared)
    opt = getattr(ls, optimizer)([collection], duplicate_grads=duplicate_grads, **kwargs)
    collection.materialize()
    assert isinstance(collection.lookups, Joint)  # a CPU collection of float32 tables of one dim takes the joint path
    if not joint:  # the engine's round: the per-table path
        collection.lookups = Round(collection)
    for step in range(steps):
        out = collection(_features(step))
        loss = sum((value - 0.1 * index).pow(2).sum() for index, value in enumerate(out.values()))
        if step == 1:  # two lookups before one step
            loss = loss + collection({"ids": torch.tensor([3, 3, 11])})["ids"].sum()
        if also_direct:  # a table of the collection also looked up on its own: the joint round is split per table
            loss = loss + collection.table_list[1](torch.tensor([3, 3, 9])).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    tables = {name: table.shard.clone() for name, table in collection.tables.items()}
    state = {(t.name, key): value.clone() for t in collection.table_list for key, value in opt.state[t.shard].items()}
    return tables, state, {name: (t.stats.ids_looked_up, int(t.stats.unique_ids)) for name, t in collection.tables.items()}


@pytest.mark.parametrize("optimizer, kwargs", OPTIMIZERS)
@pytest.mark.parametrize("duplicate_grads, kernels", [("sum", "auto"), ("mean", "auto"), ("mean", "torch")])
def test_the_joint_cpu_step_trains_bitwise_as_the_per_table_path(monkeypatch, optimizer, kwargs, duplicate_grads, kernels):
    """Ids, 2-D and jagged bags pooled by sum, weighted sum and mean; tables at different steps; two lookups in a step.

    Both CPU updates (``auto``: numba's kernel where numba imports; ``torch``: the torch ops), each on both paths."""
    monkeypatch.setenv(backend.ENV, kernels)
    expected = _train(optimizer, kwargs, False, duplicate_grads)
    got = _train(optimizer, kwargs, True, duplicate_grads)
    for part, name in zip(range(2), ("tables", "optimizer state")):
        assert got[part].keys() == expected[part].keys()
        for key in expected[part]:
            assert torch.equal(got[part][key], expected[part][key]), (name, key)
    assert [looked_up for looked_up, _ in got[2].values()] == [looked_up for looked_up, _ in expected[2].values()]


@pytest.mark.parametrize("also_direct", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_features_sharing_a_table_train_as_on_the_per_table_path(monkeypatch, also_direct, kernels):
    """The joint sum adds a row's gradients over all features at once, the engine feature by feature: float32 rounding.

    A table also looked up alone: the joint round's gradient goes to each table (``split_into_tables``). The tables
    differ in size: ``torch``'s update finds each row's state in the joined state after the tables before its table.
    """
    monkeypatch.setenv(backend.ENV, kernels)
    expected = _train("SparseAdagrad", dict(lr=0.1), False, "mean", also_direct=also_direct, shared=True)
    got = _train("SparseAdagrad", dict(lr=0.1), True, "mean", also_direct=also_direct, shared=True)
    for name in expected[0]:
        torch.testing.assert_close(got[0][name], expected[0][name], rtol=1e-5, atol=1e-6, msg=name)


def _steps(collection, opt, steps: range) -> None:
    for step in steps:
        loss = sum((value - 0.1 * index).pow(2).sum() for index, value in enumerate(collection(_features(step)).values()))
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_a_joint_cpu_run_saved_and_loaded_goes_on_bitwise():
    """The joined state is the optimizer's (views of one tensor per key): its state_dict saves each byte once, and a
    loaded state, new tensors, is joined again at the next step."""
    collection = _collection()
    opt = ls.SparseAdam([collection], lr=0.01)
    _steps(collection, opt, range(4))
    resumed = _collection()
    resumed_opt = ls.SparseAdam([resumed], lr=0.01)
    _steps(resumed, resumed_opt, range(5, 6))  # its state joined before the load
    saved = _collection()
    saved_opt = ls.SparseAdam([saved], lr=0.01)
    _steps(saved, saved_opt, range(2))
    buffer = io.BytesIO()
    torch.save({"tables": saved.state_dict(), "optimizer": saved_opt.state_dict()}, buffer)
    state_bytes = sum(v.nelement() * v.element_size() for s in saved_opt.state.values() for v in s.values())
    table_bytes = sum(t.shard.nelement() * t.shard.element_size() for t in saved.table_list)
    assert len(buffer.getvalue()) < 1.2 * (state_bytes + table_bytes) + 100_000
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    resumed.load_state_dict(loaded["tables"])
    resumed_opt.load_state_dict(loaded["optimizer"])
    _steps(resumed, resumed_opt, range(2, 4))
    for expected, got in zip(collection.table_list, resumed.table_list):
        assert torch.equal(expected.shard, got.shard), expected.name
        for key, value in opt.state[expected.shard].items():
            assert torch.equal(value, resumed_opt.state[got.shard][key]), (expected.name, key)


def _late_and_missing_gradients(joint: bool) -> tuple:
    """A lookup without backward, a late gradient (after a step and a later lookup): what each table's step counts."""
    collection = _collection()
    opt = ls.SparseAdam([collection], lr=0.01, bias_correction="global")
    collection.materialize()
    if not joint:
        collection.lookups = Round(collection)
    out_a = collection({"ids": torch.tensor([1, 2]), "bags": ls.JaggedIds(torch.tensor([3, 4, 5]), lengths=torch.tensor([1, 2]))})
    opt.step()
    out_b = collection({"ids": torch.tensor([2, 7]), "means": torch.tensor([[1, 2]])})
    sum(v.sum() for v in out_a.values()).backward()
    sum(v.sum() for v in out_b.values()).backward()
    opt.step()
    collection({"grid": torch.tensor([[1, 2]])})  # no backward
    opt.step()
    opt.step()
    return [t.shard.clone() for t in collection.table_list], [int(opt.state[t.shard]["step"]) for t in collection.table_list]


def test_a_joint_cpu_step_counts_the_steps_as_the_per_table_path():
    """A table's step counts the steps after a lookup of it or with a gradient for it, with a backward or not."""
    (expected, expected_steps), (got, got_steps) = _late_and_missing_gradients(False), _late_and_missing_gradients(True)
    assert got_steps == expected_steps == [2, 2, 1, 0, 1, 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_collection_cast_to_bf16_after_a_lookup_leaves_the_joint_path_and_trains_as_one_cast_before():
    """The joint CPU path takes float32 tables only, so the path is chosen again when the tables' dtype changes: a
    collection looked up as float32, then cast to bf16, trains bitwise as the same collection cast before any lookup."""
    trained = []
    for cast_after_a_lookup in (False, True):
        collection = _collection()
        if cast_after_a_lookup:
            with torch.no_grad():
                collection(_features(0))
            assert isinstance(collection.lookups, Joint)
        collection.to(torch.bfloat16)
        opt = ls.SparseSGD([collection], lr=0.1)
        for step in range(2):
            sum(value.float().sum() for value in collection(_features(step)).values()).backward()
            opt.step()
            opt.zero_grad()
        assert isinstance(collection.lookups, Round)
        trained.append([t.shard.clone() for t in collection.table_list])
    assert all(torch.equal(a, b) for a, b in zip(*trained))


@pytest.mark.parametrize("offsets", [[0, 5, 3, 7], [1, 3, 3, 7], [0, 3, 3, 6]])
def test_bad_input_of_a_joint_cpu_round_raises_at_the_lookup_naming_the_feature(offsets):
    """Found for all features at once; the engine's round then names the feature (falling, rising or short offsets)."""
    collection = _collection(shared=True)
    features = _features(0)
    features["means"][1, 2] = 44  # table t2 has 44 rows
    with pytest.raises(IndexError, match=r"Feature 'means' \(table 't2'\) of SparseEmbeddingCollection got id 44"):
        collection(features)
    features = _features(0)
    features["jagged_means"] = ls.JaggedIds(features["jagged_means"].values, offsets=torch.tensor(offsets))
    with pytest.raises(ValueError, match=r"Feature 'jagged_means' \(table 't3'\) of SparseEmbeddingCollection got bag offsets"):
        collection(features)


def test_per_id_weights_that_need_a_gradient_get_it_as_from_f_embedding_bag():
    """The joint CPU round records no gradient for the weights: such a lookup takes the engine's round, which gives it."""
    collection = ls.SparseEmbeddingCollection({"tags": ls.SparseEmbedding(30, 4, seed=1)}, pooling="sum")
    assert isinstance(collection.materialize().lookups, Joint)
    opt = ls.SparseSGD([collection], lr=1.0)
    initial = collection.tables["tags"].full_weight().clone().requires_grad_()
    ids, offsets = torch.tensor([1, 2, 3, 2, 7]), torch.tensor([0, 3, 3, 5])
    weights = torch.rand(5, generator=torch.Generator().manual_seed(0)).requires_grad_()
    expected_weights = weights.detach().clone().requires_grad_()
    out = collection({"tags": ls.JaggedIds(ids, offsets=offsets, weights=weights)})["tags"]
    expected = torch.nn.functional.embedding_bag(ids, initial, offsets, mode="sum", per_sample_weights=expected_weights,
                                                 include_last_offset=True)  # fmt: skip
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(weights.grad, expected_weights.grad)
    opt.step()
    torch.testing.assert_close(collection.tables["tags"].full_weight(), (initial - initial.grad).detach())


# ---------------------------------------------------------------- ops of a step: 26 tables against 2
MULTI_HOT_EVERY = 9  # benchmarks/collection.py's workload, small: every 9th table multi-hot (3 of 26, 1 of 2), sum-pooled


def _workload(num_tables: int) -> tuple:
    tables = {f"t{i}": ls.SparseEmbedding(100 + 13 * i, 64, seed=i) for i in range(num_tables)}
    multi_hot = [f"t{i}" for i in range(num_tables) if i % MULTI_HOT_EVERY == 1]
    collection = ls.SparseEmbeddingCollection(tables, pooling={name: "sum" for name in multi_hot})
    opt = ls.SparseRowWiseAdagrad([collection], lr=0.1)
    gen, features = torch.Generator().manual_seed(0), {}
    for name in tables:
        lengths = torch.randint(1, 6, (32,), generator=gen) if name in multi_hot else torch.ones(32, dtype=torch.int64)
        ids = torch.randint(0, 100, (int(lengths.sum()),), generator=gen)
        features[name] = ls.JaggedIds(ids, lengths=lengths) if name in multi_hot else ids
    return collection, opt, features


def _phases(num_tables: int) -> tuple[dict[str, int], list[str]]:
    """The aten ops of each phase of a second step (forward, backward of given gradients, step with zero_grad)."""
    collection, opt, features = _workload(num_tables)
    out = collection(features)
    sum(value.sum() for value in out.values()).backward()
    opt.step()
    opt.zero_grad()
    host = [opt.state[t.shard]["step"] for t in collection.table_list]
    counts = {}
    with HostReads(ignore=host) as reads:
        with AtenOps(host=host) as aten:
            out = collection(features)
        counts["forward"] = len(aten.ops)
        grads = [torch.ones_like(value) for value in out.values()]
        with AtenOps(host=host) as aten:
            torch.autograd.backward(list(out.values()), grads)
        counts["backward"] = len(aten.ops)
        with AtenOps(host=host) as aten:
            opt.step()
            opt.zero_grad()
        counts["step"] = len(aten.ops)
    return counts, reads.calls


def test_a_26_table_cpu_step_takes_at_most_twice_the_ops_of_a_2_table_one():
    """Issue 46: per phase. What still grows with the tables: one gather per feature, one row update per table."""
    (two, two_reads), (many, many_reads) = _phases(2), _phases(26)
    for phase in two:
        assert many[phase] <= 2 * two[phase], (phase, two, many)
    assert len(many_reads) == len(two_reads) <= 2, (two_reads, many_reads)
