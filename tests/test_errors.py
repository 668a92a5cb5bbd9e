"""Every user error names the problem and its fix: one table of (call, the words naming the problem, the HINT).

A row runs in this process (no process group) unless it names a world size: then on every rank of a pool, each of which
must raise the same words. Errors met in the middle of a lookup or a fit (bad ids, a lost peer, a misconfigured Trainer)
are tested where they happen: test_embedding.py, test_collection.py, test_strategy.py, test_fabric.py, test_hosts.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_sparse as ls
from lightning_sparse import checkpoint
from lightning_sparse.kernels import backend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, for checkpoints saved in this process


def _table(rows: int = 4, dim: int = 2, **kwargs) -> ls.SparseEmbedding:
    return ls.SparseEmbedding(rows, dim, name="users", **kwargs)


def _collection(**kwargs) -> ls.SparseEmbeddingCollection:
    return ls.SparseEmbeddingCollection({"user": _table()}, **kwargs)


def _same_table_twice(tmp: Path) -> None:
    table = _table()
    ls.SparseEmbeddingCollection({"a": table, "b": table})


def _inf_gradient(tmp: Path) -> None:
    table = _table()
    opt = ls.SparseSGD([table], lr=0.1, check_finite=True)
    (table(torch.tensor([1, 2])).sum() * float("inf")).backward()
    opt.step()


def _inf_gradient_of_a_collection_on_the_gpu_path(tmp: Path) -> None:
    import os

    os.environ[backend.ENV] = "triton"  # one launch for the collection's tables: its own finiteness check
    try:
        collection = _collection()
        opt = ls.SparseSGD([collection], lr=0.1, check_finite=True)
        (collection({"user": torch.tensor([1, 2])})["user"].sum() * float("inf")).backward()
        opt.step()
    finally:
        del os.environ[backend.ENV]


def _init_returning_a_wrong_shape(tmp: Path) -> None:
    _table(init=lambda ids, dim, seed: torch.zeros(len(ids), dim + 1)).materialize()


def _pretrained_of_another_dim(tmp: Path) -> None:
    _table(dim=4, init=ls.init.from_tensor(torch.zeros(4, 3))).materialize()


def _file_of_several_tables(tmp: Path) -> None:
    torch.save({"users.weight": torch.zeros(4, 2), "items.weight": torch.zeros(3, 2)}, tmp / "exported.pt")
    ls.init.from_file(str(tmp / "exported.pt"))


def _saved(tmp: Path) -> Path:
    """A sharded checkpoint of a module holding one table, ``a``."""
    module = torch.nn.ModuleDict({"a": ls.SparseEmbedding(5, 2, seed=1)})
    return checkpoint.save(tmp / "saved.ckpt", module)


def _load_into_a_module_with_another_table(tmp: Path) -> None:
    path = _saved(tmp)
    checkpoint.load_module(path, torch.nn.ModuleDict({"a": ls.SparseEmbedding(5, 2), "b": ls.SparseEmbedding(3, 2)}))


def _load_into_a_module_with_another_dense_layer(tmp: Path) -> None:
    path = _saved(tmp)  # strict, as by default: a tensor the checkpoint lacks is an error, as for load_state_dict
    checkpoint.load_module(path, torch.nn.ModuleDict({"a": ls.SparseEmbedding(5, 2), "head": torch.nn.Linear(2, 1)}))


def _checkpoint_without_meta(tmp: Path) -> None:
    path = _saved(tmp)
    (path / checkpoint.METADATA_FILE).unlink()
    checkpoint.load_meta(path)


def _fabric_save(tmp: Path, state: dict | None = None, **kwargs) -> None:
    module = torch.nn.ModuleDict({"a": ls.SparseEmbedding(5, 2)})
    ls.FabricSparseDDPStrategy().save_checkpoint(tmp / "fabric.ckpt", {"model": module, **(state or {})}, **kwargs)


def _fabric_load(tmp: Path, state, strict: bool = True) -> None:
    ls.FabricSparseDDPStrategy().load_checkpoint(_saved(tmp), state, strict=strict)


def _reshard_a_dynamic_table_holding_ids(tmp: Path) -> None:
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    try:
        table = ls.DynamicEmbedding(8, 2, name="tags", process_group=alone[dist.get_rank()])  # one rank's table
        table(torch.tensor([3, 5])).sum().backward()  # admits its ids
        table.materialize(dist.group.WORLD)  # then the default group's ranks
    finally:
        for group in alone:
            dist.destroy_process_group(group)


def _collection_of_tables_over_two_groups(tmp: Path) -> None:
    group = dist.new_group([0, 1])  # the same ranks as the default group, another group
    try:
        other = ls.SparseEmbedding(4, 2, name="items", process_group=group)
        ls.SparseEmbeddingCollection({"user": _table(), "item": other})({"user": torch.tensor([1])})
    finally:
        dist.destroy_process_group(group)


def _bad_id_in_a_placed_collection(tmp: Path) -> None:
    from lightning_sparse.lightning.placement import place_tables

    module = torch.nn.Module()
    module.embeddings = _collection()
    place_tables(module)  # as a strategy does: the collection takes its module path as its name
    module.embeddings({"user": torch.tensor([1, 9])})


def _dynamic_table_on_2d_groups(tmp: Path) -> None:
    groups = ls.sharding_groups(2)
    try:
        ls.DynamicEmbedding(8, 2, name="tags").materialize(*groups)
    finally:
        for group in groups:
            dist.destroy_process_group(group)


def _arg(call, **kwargs):
    return lambda tmp: call(**kwargs)


E = ls.SparseEmbedding
# id: (call(tmp), error type, the words naming the problem (with the value), the HINT, world size or None)
ERRORS = {
    # tables
    "num_embeddings": (_arg(E, num_embeddings=0, embedding_dim=2), ValueError, "Invalid num_embeddings: 0", "a table needs", None),
    "embedding_dim": (_arg(E, num_embeddings=3, embedding_dim=0), ValueError, "Invalid embedding_dim: 0", "rows need", None),
    "sharding": (_arg(E, num_embeddings=3, embedding_dim=2, sharding="hash"), ValueError, "Invalid sharding: 'hash'",
                 "use one of ('mod', 'range')", None),
    "dtype": (_arg(E, num_embeddings=3, embedding_dim=2, dtype=torch.int64), ValueError, "Invalid dtype: torch.int64",
              "a table holds floating-point rows", None),
    # a collection's construction
    "no-table": (_arg(ls.SparseEmbeddingCollection, tables={}), ValueError, "needs at least one table",
                 "{'user': SparseEmbedding(...)}", None),
    "not-a-table": (_arg(ls.SparseEmbeddingCollection, tables={"user": torch.nn.Embedding(3, 2)}), TypeError,
                    "Table 'user' is a Embedding, not a SparseEmbedding", "build it as lightning_sparse.SparseEmbedding", None),
    "table-name": (_arg(ls.SparseEmbeddingCollection, tables={"a.b": E(3, 2)}), ValueError, "Invalid table name 'a.b'",
                   "use a non-empty name without '.'", None),
    "same-table-twice": (_same_table_twice, ValueError, "The same SparseEmbedding appears under two names",
                         "map two features to one table", None),
    "feature-table": (_arg(_collection, features={"a": "missing"}), ValueError,
                      "Feature 'a' reads table 'missing', which is not in the collection (['user'])",
                      "features maps feature name -> table name", None),
    "pooling": (_arg(_collection, pooling="max"), ValueError, "Invalid pooling 'max' for feature 'user'",
                "use one of", None),
    "pooling-feature": (_arg(_collection, pooling={"nope": "sum"}), ValueError,
                        "pooling names unknown features ['nope']; the features are ['user']", "key pooling by feature name",
                        None),
    "collection-groups": (_collection_of_tables_over_two_groups, ValueError,
                          "items and users are placed differently (process group or device)",
                          "the tables of a collection share one process group and device", 2),
    "collection-name": (_bad_id_in_a_placed_collection, IndexError, "Feature 'user' (table 'user') of embeddings got id 9",
                        "remap ids into range", None),
    "jagged": (_arg(ls.JaggedIds, values=torch.tensor([1])), ValueError, "JaggedIds needs exactly one of offsets and lengths",
               "JaggedIds(values, offsets=...)", None),
    # DynamicEmbedding
    "capacity": (_arg(ls.DynamicEmbedding, capacity=0, embedding_dim=2), ValueError, "Invalid capacity: 0",
                 "a dynamic table holds at least one id", None),
    "admit_after": (_arg(ls.DynamicEmbedding, capacity=8, embedding_dim=2, admit_after=0), ValueError,
                    "Invalid admit_after: 0", "1 admits an id on its first training lookup", None),
    "eviction": (_arg(ls.DynamicEmbedding, capacity=8, embedding_dim=2, eviction="fifo"), ValueError,
                 "Invalid eviction: 'fifo'", "use one of", None),
    "ttl": (_arg(ls.DynamicEmbedding, capacity=8, embedding_dim=2, ttl=0), ValueError, "Invalid ttl: 0",
            "a number of optimizer steps >= 1, or None", None),
    "dynamic-2d": (_dynamic_table_on_2d_groups, ValueError, "tags: a DynamicEmbedding is sharded over one group",
                   "use 1-D sharding (no sharding_group_size)", 4),
    "dynamic-reshard": (_reshard_a_dynamic_table_holding_ids, RuntimeError,
                        "tags holds ids on 1 rank(s) and cannot be re-sharded over 2",
                        "save a checkpoint and load it into a new module", 2),
    # optimizers
    "lr": (_arg(ls.SparseSGD, params=[E(4, 2)], lr=-1), ValueError, "Invalid learning rate: -1", "pass lr >= 0", None),
    "sgd-weight_decay": (_arg(ls.SparseSGD, params=[E(4, 2)], weight_decay=-0.5), ValueError,
                         "Invalid weight_decay value: -0.5", "pass weight_decay >= 0", None),
    "adagrad-weight_decay": (_arg(ls.SparseAdagrad, params=[E(4, 2)], weight_decay=-0.5), ValueError,
                             "Invalid weight_decay value: -0.5", "pass weight_decay >= 0", None),
    "adam-weight_decay": (_arg(ls.SparseAdam, params=[E(4, 2)], weight_decay=-0.5), ValueError,
                          "Invalid weight_decay value: -0.5", "pass weight_decay >= 0", None),
    "lr_decay": (_arg(ls.SparseAdagrad, params=[E(4, 2)], lr_decay=-0.1), ValueError, "Invalid lr_decay value: -0.1",
                 "pass lr_decay >= 0", None),
    "initial_accumulator_value": (_arg(ls.SparseAdagrad, params=[E(4, 2)], initial_accumulator_value=-1.0), ValueError,
                                  "Invalid initial_accumulator_value value: -1.0", "the sums of squares start at a value >= 0", None),
    "rowwise-initial_accumulator_value": (_arg(ls.SparseRowWiseAdagrad, params=[E(4, 2)], initial_accumulator_value=-1.0),
                                          ValueError, "Invalid initial_accumulator_value value: -1.0",
                                          "the sums of squares start at a value >= 0", None),
    "eps": (_arg(ls.SparseAdagrad, params=[E(4, 2)], eps=-1.0), ValueError, "Invalid epsilon value: -1.0", "pass eps >= 0",
            None),
    "betas[0]": (_arg(ls.SparseAdam, params=[E(4, 2)], betas=(1.0, 0.9)), ValueError,
                 "Invalid beta parameter at index 0: 1.0", "each beta is in [0, 1)", None),
    "betas[1]": (_arg(ls.SparseAdam, params=[E(4, 2)], betas=(0.9, 1.5)), ValueError,
                 "Invalid beta parameter at index 1: 1.5", "each beta is in [0, 1)", None),
    "bias_correction": (_arg(ls.SparseAdam, params=[E(4, 2)], bias_correction="step"), ValueError,
                        "Invalid bias_correction: 'step'", "use one of ('row', 'global')", None),
    "duplicate_grads": (_arg(ls.SparseSGD, params=[E(4, 2)], duplicate_grads="max"), ValueError,
                        "Invalid duplicate_grads: 'max'", "use one of ('sum', 'mean')", None),
    "check_finite": (_arg(ls.SparseSGD, params=[E(4, 2)], check_finite="yes"), ValueError, "Invalid check_finite: 'yes'",
                     "pass True or False", None),
    "capturable": (_arg(ls.SparseSGD, params=[E(4, 2)], capturable=1), ValueError, "Invalid capturable: 1",
                   "pass True or False", None),
    "dense-parameter": (_arg(ls.SparseSGD, params=[torch.nn.Linear(2, 2).weight]), TypeError,
                        "SparseSGD optimizes SparseEmbedding modules, got Parameter", "pass the SparseEmbedding modules", None),
    "check_finite-step": (_inf_gradient, FloatingPointError, "the sparse gradient is not finite (inf or NaN) for users on "
                          "rank(s) [0]; no row was updated", "look for the source", None),
    "check_finite-collection-gpu-path": pytest.param(
        _inf_gradient_of_a_collection_on_the_gpu_path, FloatingPointError, "SparseSGD: the sparse gradient of "
        "SparseEmbeddingCollection is not finite (inf or NaN); no row was updated", "look for the source", None,
        marks=pytest.mark.skipif(not (backend.interpreting() and backend.triton_available()), reason="needs triton's interpreter"),
    ),
    # the init functions
    "uniform": (_arg(ls.init.uniform, a=1.0, b=0.0), ValueError, "Invalid uniform bounds: a=1.0, b=0.0",
                "a must be smaller than b", None),
    "from_tensor": (_arg(ls.init.from_tensor, table=torch.zeros(3)), ValueError, "Invalid pretrained table shape: (3,)",
                    "pass a 2-D [rows, dim] tensor", None),
    "from_tensor-dim": (_pretrained_of_another_dim, ValueError,
                        "Pretrained table has dim 3 but the SparseEmbedding has embedding_dim=4",
                        "build the SparseEmbedding with embedding_dim=3", None),
    "from_file-key": (_file_of_several_tables, KeyError, "holds ['items.weight', 'users.weight'], not None",
                      "pick the table with from_file(path, key=...)", None),
    "init-shape": (_init_returning_a_wrong_shape, ValueError, "init for users returned shape (4, 3) for 4 ids",
                   "init(global_ids, embedding_dim, seed) must return [len(global_ids), embedding_dim]", None),
    # checkpoints
    "checkpoint-has-no-table": (_load_into_a_module_with_another_table, RuntimeError, "has no table SparseEmbedding(3, 2) (key 'state_dict.b.weight')",
                                "load it into the module it was saved from", None),
    "checkpoint-has-no-dense-tensor": (_load_into_a_module_with_another_dense_layer, RuntimeError,
                                       "has no tensor head.weight (key 'state_dict.head.weight')",
                                       "load it into the module it was saved from, or load with strict=False", None),
    "checkpoint-has-no-meta": (_checkpoint_without_meta, RuntimeError, f"has no {checkpoint.METADATA_FILE}",
                               "it is incomplete; use an earlier checkpoint", None),
    "load_file-unreadable": (lambda tmp: (tmp / "x.pt").write_bytes(b"not a file") and checkpoint.load_file(tmp / "x.pt"),
                             RuntimeError, "x.pt is neither a sharded checkpoint (no .metadata inside) nor a file torch.load",
                             "pass a checkpoint written by Trainer(strategy='sparse_ddp')", None),
    "load_file-not-a-state-dict": (lambda tmp: torch.save([1], tmp / "x.pt") or checkpoint.load_file(tmp / "x.pt"),
                                   RuntimeError, "x.pt holds list, neither a Lightning checkpoint nor a state dict",
                                   "pass a checkpoint written by Trainer(strategy='sparse_ddp')", None),
    # Fabric's save and load
    "fabric-save-filter": (lambda tmp: _fabric_save(tmp, filter={"model": lambda k, v: True}), ValueError,
                           "FabricSparseDDPStrategy.save_checkpoint takes neither storage_options nor filter",
                           "call fabric.save(path, state) without them", None),
    "fabric-save-reserved": (lambda tmp: _fabric_save(tmp, {"state_dict": 1}), ValueError,
                             "the state key 'state_dict' is reserved by the sharded checkpoint format", "rename it", None),
    "fabric-save-two-modules": (lambda tmp: _fabric_save(tmp, {"other": torch.nn.Linear(1, 1)}), ValueError,
                                "takes exactly one module in its state, got 2 (model, other)",
                                "hold the models in one nn.Module", None),
    "fabric-load-nothing": (lambda tmp: _fabric_load(tmp, None), ValueError,
                            "is a sharded checkpoint: it loads into the objects it restores",
                            "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})", None),
    "fabric-load-missing-key": (lambda tmp: _fabric_load(tmp, {"model": torch.nn.ModuleDict({"a": E(5, 2)}), "epoch": 0}),
                                KeyError, "contains a key 'epoch' that", "pass strict=False to skip it", None),
    "fabric-load-optimizers": (
        lambda tmp: _fabric_load(tmp, {"model": (m := torch.nn.ModuleDict({"a": E(5, 2)})), "opt": ls.SparseSGD([m["a"]])}),
        ValueError, "holds 0 dense and 0 sparse optimizers; the state to restore has 0 dense (none) and 1 sparse (opt)",
        "pass the same optimizers as when it was saved", None,
    ),
    # the strategy
    "sharding_group_size": (_arg(ls.SparseDDPStrategy, sharding_group_size=0), ValueError, "Invalid sharding_group_size: 0",
                            "pass a positive divisor of the world size", None),
    "warmup_steps": (_arg(ls.CapturedSparseDDPStrategy, warmup_steps=0), ValueError, "Invalid warmup_steps: 0",
                     "pass an int >= 1 (torch's recipe warms up first)", None),
}  # fmt: skip


def _run_on_a_rank(call, directory: str) -> tuple[str, str]:
    """On every rank of a pool: the error ``call`` raised (type name and message), in a directory of this rank's."""
    tmp = Path(directory) / f"rank{dist.get_rank()}"
    tmp.mkdir()
    try:
        call(tmp)
    except Exception as err:  # noqa: BLE001 - the error is the result
        return type(err).__name__, str(err)
    return "no error", ""


@pytest.mark.parametrize("call, error, words, hint, world_size", list(ERRORS.values()), ids=list(ERRORS))
def test_every_user_error_names_the_value_and_the_fix(rank_pools, tmp_path, call, error, words, hint, world_size):
    if world_size is None:
        with pytest.raises(error) as raised:
            call(tmp_path)
        results = [(type(raised.value).__name__, str(raised.value))]
    else:
        results = rank_pools(world_size).run(_run_on_a_rank, call, str(tmp_path))
    for kind, message in results:
        assert kind == error.__name__, message
        assert words in message, message
        assert f"HINT: {hint}" in message, message
