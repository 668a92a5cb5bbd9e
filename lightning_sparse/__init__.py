"""lightning-sparse: row-sharded embedding tables and sparse optimizers for PyTorch (Lightning)."""

from lightning_sparse import init
from lightning_sparse.embedding import SparseEmbedding, full_state_dict
from lightning_sparse.optim import SparseAdagrad, SparseAdam, SparseOptimizer, SparseRowWiseAdagrad, SparseSGD
from lightning_sparse.sharding import RowSharding

__version__ = "0.1.0"

__all__ = [
    "RowSharding",
    "SparseAdagrad",
    "SparseAdam",
    "SparseEmbedding",
    "SparseOptimizer",
    "SparseRowWiseAdagrad",
    "SparseSGD",
    "full_state_dict",
    "init",
]
