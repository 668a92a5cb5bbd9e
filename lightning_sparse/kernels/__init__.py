"""Device kernels of the sparse path (Triton; numba for the CPU's fused update), each with its plain torch counterpart (see
``backend.py`` for which runs)."""

from lightning_sparse.kernels.backend import computes_in_triton, gpu_path, launches, uses_numba, uses_triton
from lightning_sparse.kernels.runs import (
    RuleState,
    Runs,
    StochasticRounding,
    TableSet,
    UpdateRule,
    segment_sum,
    sort_runs,
    table_entries,
    update_rows,
)

__all__ = [
    "RuleState",
    "Runs",
    "StochasticRounding",
    "TableSet",
    "UpdateRule",
    "computes_in_triton",
    "gpu_path",
    "launches",
    "segment_sum",
    "sort_runs",
    "table_entries",
    "update_rows",
    "uses_numba",
    "uses_triton",
]
