"""Sparse optimizers: torch optimizers that update only the touched rows of SparseEmbedding tables."""

from lightning_sparse.optim.adagrad import SparseAdagrad, SparseRowWiseAdagrad
from lightning_sparse.optim.adam import SparseAdam
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.optim.sgd import SparseSGD

__all__ = ["SparseAdagrad", "SparseAdam", "SparseOptimizer", "SparseRowWiseAdagrad", "SparseSGD"]
