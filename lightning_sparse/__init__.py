"""lightning-sparse: row-sharded embedding tables and sparse optimizers for PyTorch (Lightning).

Importing the package registers ``Trainer(strategy="sparse_ddp")`` and ``Fabric(strategy="sparse_ddp")`` and an exit handler that
releases the process groups before the interpreter finalizes (``lightning_sparse.exits``).
"""

from lightning_sparse import exits, init
from lightning_sparse.callbacks import SparseStatsMonitor
from lightning_sparse.collection import SparseEmbeddingCollection
from lightning_sparse.dynamic import DynamicEmbedding
from lightning_sparse.embedding import SparseEmbedding, full_state_dict
from lightning_sparse.fabric import FabricSparseDDPStrategy  # registers Fabric(strategy="sparse_ddp")
from lightning_sparse.faults import PeerFailure
from lightning_sparse.features import JaggedIds
from lightning_sparse.lookup import serve_lookups
from lightning_sparse.optim import SparseAdagrad, SparseAdam, SparseOptimizer, SparseRowWiseAdagrad, SparseSGD
from lightning_sparse.precision import SparseMixedPrecision
from lightning_sparse.replicas import sharding_groups
from lightning_sparse.sharding import RowSharding
from lightning_sparse.strategy import SparseDDPStrategy  # registers strategy="sparse_ddp"

__version__ = "0.1.0"

exits.install()

__all__ = [
    "DynamicEmbedding",
    "FabricSparseDDPStrategy",
    "JaggedIds",
    "PeerFailure",
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
    "serve_lookups",
    "sharding_groups",
]
