"""lightning-sparse: row-sharded embedding tables and sparse optimizers for PyTorch (Lightning).

Importing the package registers ``Trainer(strategy="sparse_ddp")`` and ``Fabric(strategy="sparse_ddp")`` and an exit handler that
releases the process groups before the interpreter finalizes (``lightning_sparse.faults.exits``), and turns torch's flight
recorder off for the process groups created after it, unless the program sized it (``lightning_sparse.faults.flight_recorder``).

The folders follow the data path, each importing only those before it: ``faults``, ``kernels``,
``wire``, ``lookup``, ``tables``, ``optim``, ``checkpoint``, ``lightning`` (docs/design.md).
"""

from lightning_sparse.faults import PeerFailure, exits, flight_recorder
from lightning_sparse.lightning import (
    CapturedSparseDDPStrategy,
    FabricSparseDDPStrategy,
    SparseDDPStrategy,
    SparseMixedPrecision,
    SparseStatsMonitor,
)
from lightning_sparse.lookup import JaggedIds, serve_lookups
from lightning_sparse.optim import SparseAdagrad, SparseAdam, SparseOptimizer, SparseRowWiseAdagrad, SparseSGD
from lightning_sparse.tables import DynamicEmbedding, SparseEmbedding, SparseEmbeddingCollection, full_state_dict, init
from lightning_sparse.wire import Pipeline, RowSharding, pipelined, sharding_groups

__version__ = "0.1.0"

exits.install()
flight_recorder.install()

__all__ = [
    "CapturedSparseDDPStrategy",
    "DynamicEmbedding",
    "FabricSparseDDPStrategy",
    "JaggedIds",
    "PeerFailure",
    "Pipeline",
    "RowSharding",
    "SparseAdagrad",
    "SparseAdam",
    "SparseEmbedding",
    "SparseEmbeddingCollection",
    "SparseOptimizer",
    "SparseRowWiseAdagrad",
    "SparseDDPStrategy",
    "SparseMixedPrecision",
    "SparseSGD",
    "SparseStatsMonitor",
    "full_state_dict",
    "exits",
    "init",
    "pipelined",
    "serve_lookups",
    "sharding_groups",
]
