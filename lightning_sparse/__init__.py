"""lightning-sparse: row-sharded embedding tables and sparse optimizers for PyTorch (Lightning).

Importing the package registers ``Trainer(strategy="sparse_ddp")`` and ``Fabric(strategy="sparse_ddp")`` and an exit handler that
releases the process groups before the interpreter finalizes (``lightning_sparse.faults.exits``), and turns torch's flight
recorder off for the process groups created after it, unless the program sized it (``lightning_sparse.faults.flight_recorder``).

A program without Lightning does not import it (about 40% of this package's import time): the Lightning half of the package
(``lightning_sparse.lightning``, its strategies, plugin and callback) is imported when Lightning is, before or after this
package, or when one of its names is asked for (``lightning_sparse.SparseDDPStrategy``, as a CLI's class path does).

The folders follow the data path, each importing only those before it: ``faults``, ``kernels``,
``wire``, ``lookup``, ``tables``, ``optim``, ``checkpoint``, ``lightning`` (docs/design.md).
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from lightning_sparse.faults import PeerFailure, exits, flight_recorder
from lightning_sparse.lookup import JaggedIds, serve_lookups
from lightning_sparse.optim import SparseAdagrad, SparseAdam, SparseOptimizer, SparseRowWiseAdagrad, SparseSGD
from lightning_sparse.tables import DynamicEmbedding, SparseEmbedding, SparseEmbeddingCollection, full_state_dict, init
from lightning_sparse.wire import Pipeline, RowSharding, pipelined, sharding_groups

if TYPE_CHECKING:  # for readers and type checkers; at run time, __getattr__ below
    from lightning_sparse.lightning import (
        CapturedSparseDDPStrategy,
        FabricSparseDDPStrategy,
        SparseDDPStrategy,
        SparseMixedPrecision,
        SparseStatsMonitor,
    )

__version__ = "0.1.0"

exits.install()
flight_recorder.install()

_LIGHTNING_NAMES = ("CapturedSparseDDPStrategy", "FabricSparseDDPStrategy", "SparseDDPStrategy", "SparseMixedPrecision",
                   "SparseStatsMonitor")  # fmt: skip


def __getattr__(name: str) -> Any:
    """The names of ``lightning_sparse.lightning``, imported on first use (PEP 562)."""
    if name in _LIGHTNING_NAMES:
        return getattr(importlib.import_module("lightning_sparse.lightning"), name)
    raise AttributeError(f"module 'lightning_sparse' has no attribute {name!r}")


class _ThenRegister(importlib.abc.Loader):
    """``lightning.pytorch``'s own loader, then ``lightning_sparse.lightning`` (whose import registers the strategies)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        importlib.import_module("lightning_sparse.lightning")

    def __getattr__(self, name: str) -> Any:  # get_filename, get_source, resources: the loader's
        return getattr(self.loader, name)


class _WhenLightningIsImported(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` through the other finders and hands its spec on with :class:`_ThenRegister`, once."""

    def __init__(self) -> None:
        self.finding = self.done = False

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "lightning.pytorch" or self.finding or self.done:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.finding = False
        if spec is None or spec.loader is None or spec.origin is None:
            return None
        self.done = True
        return importlib.util.spec_from_file_location(name, spec.origin, loader=_ThenRegister(spec.loader),
                                                      submodule_search_locations=spec.submodule_search_locations)  # fmt: skip


if "lightning.pytorch" in sys.modules:
    importlib.import_module("lightning_sparse.lightning")
else:
    sys.meta_path.insert(0, _WhenLightningIsImported())

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
