"""Lightning and Fabric: the ``sparse_ddp`` strategies, their precision plugin, launcher, callbacks and checkpoint hooks."""

from lightning_sparse.lightning.callbacks import SparseStatsMonitor
from lightning_sparse.lightning.captured_strategy import CapturedSparseDDPStrategy
from lightning_sparse.lightning.fabric import FabricSparseDDPStrategy
from lightning_sparse.lightning.precision import SparseMixedPrecision
from lightning_sparse.lightning.strategy import SparseDDPStrategy

__all__ = [
    "CapturedSparseDDPStrategy",
    "FabricSparseDDPStrategy",
    "SparseDDPStrategy",
    "SparseMixedPrecision",
    "SparseStatsMonitor",
]
