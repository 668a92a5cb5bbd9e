"""Lightning's spawn launcher for ``SparseDDPStrategy(start_method="spawn" | "fork" | "forkserver")``.

With these start methods the ranks run in child processes and rank 0 hands the trained weights
back to the main process, which loads them into its own (unsharded) module. Rank 0's
``state_dict()`` holds only its shard of each table; this launcher hands back the full tables
instead (``full_state_dict``, a collective every rank runs), which load on one process.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_sparse.lightning.compat import MultiProcessingLauncher
from lightning_sparse.tables.shard_state import full_state_dict


class SparseMultiProcessingLauncher(MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, returning full tables to the main process."""

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        module = trainer.lightning_module
        full = full_state_dict(module)  # collective: every rank gathers the tables
        # Lightning reads ``module.state_dict()`` on every rank here (checked against lightning 2.6.6);
        # for the length of this call it reads the full tables.
        module.state_dict = lambda *args, **kwargs: full
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
