"""SparseEmbeddingCollection on 1 to 4 ranks (1-D and 2-D sharded) against single-process plain torch.

The reference trains one ``nn.Parameter`` per table with ``F.embedding(sparse=True)`` and
``F.embedding_bag(sparse=True)`` (the functional forms of ``nn.Embedding`` and
``nn.EmbeddingBag``) and torch's optimizers (or the references of ``references.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rank_pool import COLLECTIVE_TIMEOUT_S, DEVICES, LAYOUTS, assert_replicas_identical, table_groups
from references import make_reference

import lightning_sparse as ls

STEPS, GLOBAL_BATCH = 3, 7
# name: (rows, dim, dtype, seed); the sharding scheme is a test parameter.
TABLES = {"user": (23, 4, torch.float32, 1), "item": (17, 3, torch.float64, 2), "tag": (11, 5, torch.float32, 3)}
FEATURES = {"user": "user", "clicked": "item", "history": "item", "candidates": "item", "tags": "tag"}
POOLING = {"clicked": "sum", "history": "mean", "tags": "mean"}
CASES = {
    "sgd": ("SparseSGD", dict(lr=0.5)),
    "adagrad": ("SparseAdagrad", dict(lr=0.3, initial_accumulator_value=0.1)),
    "rowwise-adagrad": ("SparseRowWiseAdagrad", dict(lr=0.3)),
    "adam-global": ("SparseAdam", dict(lr=0.05, bias_correction="global")),
    "adam-row": ("SparseAdam", dict(lr=0.05)),
}


def make_batches(seed: int = 0) -> list[list[dict]]:
    """Global batches: per sample a user id, weighted clicked bags, history bags (some empty), 2 candidates, 3 tags."""
    gen = torch.Generator().manual_seed(seed)

    def zipf(n: int, size: int) -> list[int]:
        return (torch.rand(size, generator=gen) ** 2 * n).long().tolist()

    batches = []
    for _ in range(STEPS):
        samples = []
        for _ in range(GLOBAL_BATCH):
            clicked = zipf(17, int(torch.randint(0, 4, (1,), generator=gen)))
            samples.append({
                "user": zipf(23, 1)[0],
                "clicked": clicked,
                "weights": torch.rand(len(clicked), generator=gen).tolist(),
                "history": zipf(17, int(torch.randint(0, 3, (1,), generator=gen))),
                "candidates": zipf(17, 2),
                "tags": zipf(11, 3),
                "target": torch.randn(1, generator=gen).item(),
            })  # fmt: skip
        batches.append(samples)
    return batches


def features_of(samples: list[dict], with_tags: bool, device: str = "cpu") -> dict:
    """The collection's input for some samples (the layout a data loader would produce)."""
    lengths = lambda key: torch.tensor([len(s[key]) for s in samples], dtype=torch.int64)  # noqa: E731
    flat = lambda key: torch.tensor([i for s in samples for i in s[key]], dtype=torch.int64)  # noqa: E731
    features = {
        "user": torch.tensor([s["user"] for s in samples], dtype=torch.int64).to(device),
        "clicked": ls.JaggedIds(flat("clicked").to(device), lengths=lengths("clicked").to(device),
                                weights=torch.tensor([w for s in samples for w in s["weights"]]).to(device)),
        "history": ls.JaggedIds(flat("history").to(device), offsets=torch.cat([torch.zeros(1, dtype=torch.int64),
                                lengths("history").cumsum(0)]).to(device)),
        "candidates": torch.tensor([s["candidates"] for s in samples], dtype=torch.int64).view(-1, 2).to(device),
    }  # fmt: skip
    if with_tags:
        features["tags"] = torch.tensor([s["tags"] for s in samples], dtype=torch.int64).view(-1, 3).to(device)
    return features


def sample_losses(out: dict, samples: list[dict], with_tags: bool) -> torch.Tensor:
    """A non-linear loss per sample, so that duplicates and pooling matter."""
    target = torch.tensor([s["target"] for s in samples], dtype=torch.float64, device=out["user"].device)
    score = out["user"].sum(1).double() * out["clicked"].sum(1) + (out["history"] * out["candidates"].sum(1)).sum(1)
    if with_tags:
        score = score + out["tags"].pow(2).sum(1).double()
    return (score - target).pow(2)


def has_tags(rank: int, world_size: int) -> bool:
    return world_size == 1 or rank != world_size - 1  # the last rank sends no tags feature at all


def train_sharded(name, kwargs, schemes, batches, device="cpu", group_size=None):
    with table_groups(group_size) as groups:
        return _train_sharded(name, kwargs, schemes, batches, device, groups)


def _train_sharded(name, kwargs, schemes, batches, device, groups):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tables = {t: ls.SparseEmbedding(n, d, dtype=dtype, seed=seed, sharding=schemes[t], device=device, **groups)
              for t, (n, d, dtype, seed) in TABLES.items()}  # fmt: skip
    collection = ls.SparseEmbeddingCollection(tables, features=FEATURES, pooling=POOLING)
    opt = getattr(ls, name)([collection], **kwargs)
    outputs = []
    for samples in batches:
        mine = [samples[i] for i in torch.tensor_split(torch.arange(len(samples)), world)[rank].tolist()]
        tags = has_tags(rank, world)
        out = collection(features_of(mine, tags, device))
        outputs.append({k: v.detach().cpu() for k, v in out.items()})
        # Ranks hold different numbers of samples: scale so that the average over ranks is the global mean.
        (sample_losses(out, mine, tags).sum() * world / len(samples)).backward()
        opt.step()
        opt.zero_grad()
    return outputs, {t: table.full_weight().cpu() for t, table in tables.items()}


def reference(name, kwargs, batches, world_size):
    weights = {t: torch.nn.Parameter(ls.init.normal()(torch.arange(n), d, seed).to(dtype))
               for t, (n, d, dtype, seed) in TABLES.items()}  # fmt: skip
    opts = {t: make_reference(name, w, kwargs) for t, w in weights.items()}
    slices = lambda n: torch.tensor_split(torch.arange(n), world_size)  # noqa: E731
    outputs = []
    for samples in batches:
        loss, per_rank = 0.0, []
        for rank, part in enumerate(slices(len(samples))):
            mine = [samples[i] for i in part.tolist()]
            tags = has_tags(rank, world_size)
            features, out = features_of(mine, tags), {}
            for feature, value in features.items():
                weight, mode = weights[FEATURES[feature]], POOLING.get(feature, "none")
                if mode == "none":
                    out[feature] = F.embedding(value, weight, sparse=True)
                else:
                    if isinstance(value, ls.JaggedIds):
                        ids, offsets, w = value.values, value.bag_offsets(), value.weights
                    else:
                        ids, offsets, w = value.reshape(-1), torch.arange(len(value) + 1) * value.shape[1], None
                    out[feature] = F.embedding_bag(ids, weight, offsets, mode=mode, sparse=True, include_last_offset=True,
                                                   per_sample_weights=None if w is None else w.to(weight.dtype))  # fmt: skip
            per_rank.append({k: v.detach() for k, v in out.items()})
            loss = loss + sample_losses(out, mine, tags).sum() / len(samples)
        outputs.append(per_rank)
        loss.backward()
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    return outputs, {t: w.detach() for t, w in weights.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size, group_size", LAYOUTS)
@pytest.mark.parametrize("scheme", ["mod", "range"])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_plain_torch(rank_pools, case, scheme, world_size, group_size, device):
    """Mixed dims and dtypes, both schemes, one table read by three features, weighted and empty bags, a feature missing on one rank."""
    name, kwargs = CASES[case]
    other = {"mod": "range", "range": "mod"}[scheme]
    schemes = {"user": scheme, "item": other, "tag": scheme}
    batches = make_batches()
    expected_out, expected = reference(name, kwargs, batches, world_size)
    results = rank_pools(world_size, device).run(train_sharded, name, kwargs, schemes, batches, device, group_size)
    assert_replicas_identical([tuple(tables.values()) for _, tables in results], group_size)
    for rank, (outputs, tables) in enumerate(results):
        for step, out in enumerate(outputs):
            assert out.keys() == expected_out[step][rank].keys()
            for feature, value in out.items():
                torch.testing.assert_close(value, expected_out[step][rank][feature], rtol=1e-5, atol=1e-6)
        for t, weight in tables.items():
            assert weight.dtype == TABLES[t][2]
            torch.testing.assert_close(weight, expected[t], rtol=1e-5, atol=1e-6)
    initial = ls.init.normal()(torch.arange(TABLES["item"][0]), TABLES["item"][1], TABLES["item"][3]).double()
    assert not torch.equal(expected["item"], initial), "the run must actually train"


def reference_sgd_mean(lr, batches, world_size):
    """SGD with DGL's duplicate_grads="mean": each row's summed gradient divided by its occurrences over all ranks."""
    weights = {t: ls.init.normal()(torch.arange(n), d, seed).to(dtype) for t, (n, d, dtype, seed) in TABLES.items()}
    for samples in batches:
        counts = {t: torch.zeros(len(w), dtype=torch.float64) for t, w in weights.items()}
        params = {t: w.clone().requires_grad_() for t, w in weights.items()}
        for rank, part in enumerate(torch.tensor_split(torch.arange(len(samples)), world_size)):
            mine = [samples[i] for i in part.tolist()]
            tags = has_tags(rank, world_size)
            features, out = features_of(mine, tags), {}
            for feature, value in features.items():
                table, mode = FEATURES[feature], POOLING.get(feature, "none")
                ids = value.values if isinstance(value, ls.JaggedIds) else value.reshape(-1)
                counts[table].index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
                if mode == "none":
                    out[feature] = F.embedding(value, params[table])
                elif isinstance(value, ls.JaggedIds):
                    w = None if value.weights is None else value.weights.to(params[table].dtype)
                    out[feature] = F.embedding_bag(value.values, params[table], value.bag_offsets(), mode=mode,
                                                   include_last_offset=True, per_sample_weights=w)  # fmt: skip
                else:
                    out[feature] = F.embedding_bag(value, params[table], mode=mode)
            # each rank's loss as the rank computes it: its occurrences' raw gradients are what "mean" averages
            (sample_losses(out, mine, tags).sum() * world_size / len(samples)).backward()
        for t, w in weights.items():
            touched = counts[t] > 0
            w[touched] -= lr * params[t].grad[touched] / counts[t][touched].unsqueeze(1).to(w.dtype)
    return weights


@pytest.mark.parametrize("world_size, group_size", LAYOUTS)
def test_duplicate_grads_mean_matches_reference(rank_pools, world_size, group_size):
    batches = make_batches(seed=4)
    expected = reference_sgd_mean(0.5, batches, world_size)
    schemes = {"user": "mod", "item": "range", "tag": "mod"}
    kwargs = dict(lr=0.5, duplicate_grads="mean")
    for _, tables in rank_pools(world_size).run(train_sharded, "SparseSGD", kwargs, schemes, batches, "cpu", group_size):
        for t, weight in tables.items():
            torch.testing.assert_close(weight, expected[t], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- collectives do not grow with the tables
def _count_collectives(num_tables: int, separate: bool = False) -> list[tuple[int, int]]:
    """(all-to-alls per forward, per optimizer step) over three steps with ``num_tables`` tables (``separate``: not in a
    collection, each looked up on its own, one optimizer for all)."""
    rank = torch.distributed.get_rank()
    tables = {f"t{i}": ls.SparseEmbedding(50 + i, 4, seed=i) for i in range(num_tables)}
    if separate:
        collection = lambda features: {n: tables[n](ids).sum(1) for n, ids in features.items()}  # noqa: E731
        opt = ls.SparseAdagrad(list(tables.values()), lr=0.1)
    else:
        collection = ls.SparseEmbeddingCollection(tables, pooling="sum")
        opt = ls.SparseAdagrad([collection], lr=0.1)
    calls = [0]
    original = torch.distributed.all_to_all_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    torch.distributed.all_to_all_single = counted
    try:
        counts = []
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            before = calls[0]
            out = collection({name: torch.randint(0, 50, (8, 3), generator=gen) for name in tables})
            forward = calls[0] - before
            sum(v.sum() for v in out.values()).backward()
            before = calls[0]
            opt.step()
            opt.zero_grad()
            counts.append((forward, calls[0] - before))
    finally:
        torch.distributed.all_to_all_single = original
    return counts


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_per_step_do_not_depend_on_the_number_of_tables(rank_pools, world_size):
    pool = rank_pools(world_size)
    few, many = pool.run(_count_collectives, 2)[0], pool.run(_count_collectives, 26)[0]
    # After the first round (which agrees on the id slots: one extra round), a forward is two
    # all-to-alls (ids out, rows back) and a step one (gradients along the route).
    assert few[1:] == many[1:] == [(2, 1), (2, 1)]
    assert many[0][0] <= 3
    # Separate tables (the README): two all-to-alls per lookup of each, and one step for all of them.
    separate = pool.run(_count_collectives, 5, True)[0]
    assert separate[1:] == [(10, 1), (10, 1)]


# ---------------------------------------------------------------- bad input raises on every rank
def _small_collection():
    tables = {"user": ls.SparseEmbedding(10, 2, seed=1), "item": ls.SparseEmbedding(6, 3, seed=2)}
    return ls.SparseEmbeddingCollection(tables, features={"user": "user", "clicked": "item"}, pooling={"clicked": "sum"})


def _bad_collection_lookup(bad_rank, bad):
    import time

    rank = torch.distributed.get_rank()
    collection = _small_collection()
    good = {"user": torch.tensor([1, 2]), "clicked": ls.JaggedIds(torch.tensor([0, 5]), lengths=torch.tensor([1, 1]))}
    features = {**good, **bad} if rank == bad_rank else good
    start = time.perf_counter()
    try:
        collection(features)
    except Exception as err:  # noqa: BLE001 - the error is the result
        error = (type(err).__name__, str(err), time.perf_counter() - start)
    else:
        error = None
    out = collection(good)  # the group is still usable
    return error, {k: tuple(v.shape) for k, v in out.items()}


# case: (input on the bad rank, error type, the words naming the problem on that rank). Other ranks get the same error
# with "on rank <bad>" for "on this rank", except where only the bad rank can name the problem (LOCAL_WORDS).
BAD_FEATURES = {
    "list": ({"user": [1, 2]}, "TypeError", "Feature 'user' (table 'user') of SparseEmbeddingCollection got ids of type list"),
    "ndarray": ({"user": __import__("numpy").array([1, 2])}, "TypeError", "got ids of type ndarray on this rank"),
    "meta": ({"user": torch.empty(2, dtype=torch.int64, device="meta")}, "RuntimeError", "could not read the ids on this rank"),
    "float": ({"user": torch.tensor([1.0])}, "TypeError", "got ids of dtype torch.float32 on this rank"),
    "out-of-range": ({"clicked": ls.JaggedIds(torch.tensor([0, 6]), lengths=torch.tensor([2]))}, "IndexError",
                     "Feature 'clicked' (table 'item') of SparseEmbeddingCollection got id 6 on this rank"),
    "negative": ({"user": torch.tensor([-3])}, "IndexError", "got id -3 on this rank"),
    "offsets": ({"clicked": ls.JaggedIds(torch.tensor([0, 1]), offsets=torch.tensor([0, 3]))}, "ValueError",
                "got bag offsets that do not fit its values on this rank"),
    "unknown": ({"nope": torch.tensor([1])}, "ValueError", "unknown feature 'nope'; the collection's features are"),
    "weights-shape": ({"clicked": ls.JaggedIds(torch.tensor([0, 1]), lengths=torch.tensor([2]), weights=torch.ones(3))},
                      "ValueError", "weights must be floating point and shaped like values (2,), got torch.float32 of shape (3,)"),
    "1d-bags": ({"clicked": torch.tensor([0, 1])}, "ValueError", "pooling 'sum' needs bags: got ids of shape (2,)"),
}  # fmt: skip
LOCAL_WORDS = {"unknown", "weights-shape", "1d-bags"}


def _not_a_dict(bad_rank):
    rank = torch.distributed.get_rank()
    collection = _small_collection()
    try:
        collection([torch.tensor([1])] if rank == bad_rank else {})
    except ValueError as err:
        return str(err)


def test_input_that_is_not_a_dict_raises_on_every_rank(rank_pools):
    own, other = rank_pools(2).run(_not_a_dict, 0)
    assert "takes a dict of feature name" in own and "got list" in own and "HINT" in own
    assert "rank 0" in other and "got input it cannot use" in other


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("case", list(BAD_FEATURES))
def test_bad_input_raises_the_same_error_on_every_rank(rank_pools, world_size, case):
    bad, error, message = BAD_FEATURES[case]
    bad_rank = world_size - 1
    for rank, ((kind, text, seconds), shapes) in enumerate(rank_pools(world_size).run(_bad_collection_lookup, bad_rank, bad)):
        assert kind == error, text
        words = message
        if rank != bad_rank:
            where = f"rank {bad_rank}"
            words = f"got input it cannot use on {where}" if case in LOCAL_WORDS else message.replace("this rank", where)
        assert words in text, text
        assert "HINT: " in text, text
        assert seconds < COLLECTIVE_TIMEOUT_S, "a rank waited for a collective to time out"
        assert shapes == {"user": (2, 2), "clicked": (2, 3)}


def test_one_process_rounds_sum_the_rows_that_accumulated_lookups_share():
    """Tables of two widths take the lookup engine's rounds in one process, each lookup recording its distinct rows: a
    row two accumulated lookups share is summed before Adagrad's step (one step, not two), also when the last lookup
    before the step got no backward. Against torch's Adagrad on the same lookups."""
    from lightning_sparse.lookup.engine import Round

    a, b = ls.SparseEmbedding(9, 3, seed=1), ls.SparseEmbedding(7, 2, seed=2)
    collection = ls.SparseEmbeddingCollection({"a": a, "b": b})
    assert isinstance(collection.materialize().lookups, Round)
    opt = ls.SparseAdagrad([collection], lr=0.5)
    plain_a, plain_b = torch.nn.Embedding(9, 3, sparse=True), torch.nn.Embedding(7, 2, sparse=True)
    with torch.no_grad():
        plain_a.weight.copy_(a.full_weight())
        plain_b.weight.copy_(b.full_weight())
    reference = torch.optim.Adagrad([plain_a.weight, plain_b.weight], lr=0.5)
    for micro_batches in (([1, 4, 4], [4, 2]), ([0, 1], [1, 5, 5])):
        for ids in map(torch.tensor, micro_batches):
            out = collection({"a": ids, "b": ids})
            (out["a"].pow(2).sum() + out["b"].sum()).backward()
            (plain_a(ids).pow(2).sum() + plain_b(ids).sum()).backward()
        collection({"a": torch.tensor([3]), "b": torch.tensor([3])})  # looked up in grad mode, never backpropagated
        opt.step()
        opt.zero_grad()
        reference.step()
        reference.zero_grad()
    torch.testing.assert_close(a.full_weight(), plain_a.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.full_weight(), plain_b.weight.detach(), rtol=1e-5, atol=1e-6)


def _look_up_after_shipping(collection, features):
    with torch.no_grad():
        out = collection(features)
    return out, [t.world_size for t in collection.table_list]


def test_a_collection_looked_up_in_one_process_then_shipped_to_two_ranks_reads_its_rows_there(rank_pools):
    """Shipped to the ranks (as Lightning's spawn ships a module), its tables are sharded over them at the next lookup; the
    collection's key space, kept while the placement stays, must follow, or ids go to the owners of the one-process
    placement. Against the full tables indexed with plain torch."""
    collection = _small_collection()
    features = {"user": torch.tensor([1, 7, 9]), "clicked": ls.JaggedIds(torch.tensor([0, 5, 3]), lengths=torch.tensor([2, 1]))}
    with torch.no_grad():
        collection(features)  # one process, tables of two widths: the engine's rounds, which keep the key space
    user, item = (t.full_weight() for t in collection.table_list)
    expected = {"user": user[[1, 7, 9]], "clicked": torch.stack([item[0] + item[5], item[3]])}
    for out, world_sizes in rank_pools(2).run(_look_up_after_shipping, collection, features):
        assert world_sizes == [2, 2]
        for name, value in expected.items():
            torch.testing.assert_close(out[name], value, rtol=0, atol=0, msg=name)


def test_keyed_jagged_tensor_input():
    """A TorchRec KeyedJaggedTensor, as it is (docs/guide/torchrec.md). `make setup` installs torchrec: this never skips."""
    try:
        import torchrec
    except ImportError as err:
        pytest.fail(f"torchrec does not import ({err}). HINT: `make setup` installs it (the Makefile's TORCHREC).")
    collection = _small_collection()
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "clicked"], values=torch.tensor([1, 2, 3, 0, 5, 5]), lengths=torch.tensor([1, 1, 1, 2, 0, 1])
    )
    out = collection(kjt)
    users, items = collection.tables["user"].full_weight(), collection.tables["item"].full_weight()
    torch.testing.assert_close(out["user"], users[[1, 2, 3]], rtol=0, atol=0)
    torch.testing.assert_close(out["clicked"], torch.stack([items[0] + items[5], torch.zeros(3), items[5]]))


def test_keyed_jagged_tensor_weights_are_per_id_weights():
    """A weighted KeyedJaggedTensor pools as F.embedding_bag with per_sample_weights does (the weights are not dropped)."""
    import torchrec

    collection = _small_collection()
    values, lengths, weights = torch.tensor([0, 5, 5]), torch.tensor([2, 0, 1]), torch.tensor([0.5, 2.0, 3.0])
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["clicked"], values=values, lengths=lengths, weights=weights)
    out = collection(kjt)
    items = collection.tables["item"].full_weight()
    expected = F.embedding_bag(values, items, torch.tensor([0, 2, 2, 3]), mode="sum", per_sample_weights=weights,
                               include_last_offset=True)  # fmt: skip
    torch.testing.assert_close(out["clicked"], expected)


# ---------------------------------------------------------------- under Lightning
import lightning_models as lm  # noqa: E402


def _fit_collection(world_size: int, trainer_kwargs: dict) -> dict:
    lm.lightning_env(torch.distributed.get_rank(), world_size)
    module = lm.CollectionTower()
    trainer = lm.trainer(world_size, max_epochs=2, **trainer_kwargs)
    trainer.fit(module)
    return lm.state(module)


@pytest.mark.parametrize("world_size, accumulate", [(2, 2), (3, 1)])
def test_lightning_fit_matches_plain_torch_reference(rank_pools, world_size, accumulate):
    batches = lm.global_batches(world_size, batch_size=4, epochs=2)
    expected = lm.reference(batches, torch.optim.Adagrad, {"lr": 0.2}, accumulate=accumulate)
    for got in rank_pools(world_size).run(_fit_collection, world_size, {"accumulate_grad_batches": accumulate}):
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _save_collection(directory: str) -> tuple[dict, str]:
    lm.lightning_env(torch.distributed.get_rank(), 2)
    module = lm.CollectionTower(sparse="mixed", dense="Adam", dense_lr=0.01)
    trainer = lm.trainer(2, max_epochs=2, enable_checkpointing=True, default_root_dir=directory)
    trainer.fit(module)
    return lm.state(module), trainer.checkpoint_callback.best_model_path


class _CollectionTowerLocalLog(lm.CollectionTower):
    """Logs validation loss without sync_dist: a rank that skips the loop never joins that reduction."""

    def validation_step(self, batch, batch_idx):
        users, items, target = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(users, items).float(), target), batch_size=len(users))


def _load_collection_and_evaluate(ckpt: str) -> tuple[dict, float]:
    import time

    from torch.utils.data import DataLoader, TensorDataset

    rank = torch.distributed.get_rank()
    lm.lightning_env(rank, 3)
    module = _CollectionTowerLocalLog(sparse="mixed", dense="Adam", dense_lr=0.01)
    module.allow_zero_length_dataloader_with_multiple_devices = True
    trainer = lm.trainer(3, max_epochs=2)
    trainer.fit(module, ckpt_path=ckpt)  # the checkpoint is at the end of epoch 2: nothing to train
    data = lm.dataset(6)
    index = torch.arange(6) if rank == 0 else torch.arange(0)  # ranks 1 and 2 have no validation batch
    loader = DataLoader(TensorDataset(*[t[index] for t in data.tensors]), batch_size=2)
    start = time.monotonic()
    lm.trainer(3, use_distributed_sampler=False, limit_val_batches=None).validate(module, loader, verbose=False)
    return lm.state(module), time.monotonic() - start


def test_checkpoint_saved_on_two_ranks_loads_on_three_and_serves_empty_ranks(rank_pools, tmp_path):
    from lightning_sparse import checkpoint

    (expected, ckpt), _ = rank_pools(2).run(_save_collection, str(tmp_path))
    checkpoint.export(ckpt, tmp_path / "exported.pt")  # one process: full tables under the collection's keys
    exported = torch.load(tmp_path / "exported.pt", weights_only=True)
    torch.testing.assert_close(exported["embeddings.tables.users.weight"], expected["users"], rtol=0, atol=0)
    torch.testing.assert_close(exported["embeddings.tables.items.weight"], expected["items"], rtol=0, atol=0)
    for got, seconds in rank_pools(3).run(_load_collection_and_evaluate, ckpt):
        assert seconds < COLLECTIVE_TIMEOUT_S, "a rank waited for a collective to time out"
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def _fit_collection_with_stats(directory: str) -> None:
    from lightning.pytorch.loggers import CSVLogger

    lm.lightning_env(torch.distributed.get_rank(), 2)
    trainer = lm.trainer(2, logger=CSVLogger(directory, name="run", version=0), log_every_n_steps=1,
                         callbacks=[ls.SparseStatsMonitor(per_table=True, prefix="emb:")])  # fmt: skip
    trainer.fit(lm.CollectionTower())


def test_stats_monitor_reports_each_table_of_a_collection(rank_pools, tmp_path):
    import csv

    rank_pools(2).run(_fit_collection_with_stats, str(tmp_path))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert not any(key.startswith("sparse/") for key in rows[0]), "the prefix replaces sparse/"
    rows = [r for r in rows if r.get("emb:ids")]
    assert len(rows) == 6
    for row in rows:  # per step: 2 ranks x 4 samples x (1 user; 2 items)
        assert float(row["emb:embeddings.tables.users/ids"]) == 8
        assert float(row["emb:embeddings.tables.items/ids"]) == 16
        assert 0 < float(row["emb:embeddings.tables.items/unique_ids"]) <= 16
        assert float(row["emb:ids"]) == 24
