"""Runs of equal keys: one sort, then each run summed (a segment sum) or applied to its table row (a fused update).

A :class:`Runs` is the result of one stable sort of keys: the keys in order and ``perm``, the
value row behind each sorted position. Every gradient the sparse path sums goes through
:func:`segment_sum` (a lookup's distinct rows, pooled bags, gradients from several ranks), and
the optimizer's update of a table from gradient rows that may repeat goes through
:func:`update_rows`, which sums each run and updates its row in one pass, with no row gradient
written to memory.

Both run in Triton on a GPU (:mod:`lightning_sparse.kernels.triton_runs`) with no host read:
the kernels find the runs from the keys. :func:`segment_sum` has a plain torch implementation
(``F.embedding_bag``, fast on CPU); :func:`update_rows` runs on CPU tensors in numba
(:mod:`lightning_sparse.kernels.numba_runs`); without either the optimizer sums with :func:`segment_sum`
and updates with :mod:`lightning_sparse.optim.functional`, the reference both kernels are tested against.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.kernels.backend import launches, uses_numba, uses_triton
from lightning_sparse.kernels.host import KeptValues, host_tensor
from lightning_sparse.kernels.rows import ROW_MULTIPLIER

_INT32_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class Runs:
    """Values grouped by key: ``keys[i]`` is the key of value ``perm[i]`` (``perm`` ``None``: of value ``i``).

    A run is a stretch of equal neighbouring keys: sorted keys (:func:`sort_runs`) make one run of
    each distinct key; distinct keys are runs of one as they are, with no sort. Keys are never negative.
    """

    keys: Tensor
    perm: Tensor | None = None

    def __len__(self) -> int:
        return len(self.keys)


def sort_runs(keys: Tensor, bound: int | None = None) -> Runs:
    """One stable sort of ``keys`` (all below ``bound``: int32 keys sort faster, so they are sorted as int32 when they fit)."""
    if bound is not None and bound <= _INT32_LIMIT and keys.dtype == torch.int64:
        keys = keys.to(torch.int32)
    ordered, perm = torch.sort(keys, stable=True)
    return Runs(ordered, perm)


class RuleState(NamedTuple):
    """The state tensors an update family reads and writes, ``None`` where it has none."""

    first: Tensor | None = None  # per element: Adagrad's sum, Adam's exp_avg
    second: Tensor | None = None  # per element: Adam's exp_avg_sq
    per_row: Tensor | None = None  # one per row: row-wise Adagrad's sum, Adam's row_step (per-row bias correction)


@dataclass(frozen=True)
class UpdateRule:
    """One step of an optimizer family (``"sgd"``, ``"adagrad"``, ``"rowwise_adagrad"``, ``"adam"``) on a table's rows:
    by :func:`update_rows`, or by torch ops (:func:`lightning_sparse.optim.update.torch_update`).

    The step's scalars: ``lr`` (Adagrad's decayed ``clr``) and ``step_size`` (global-bias Adam's ``lr * sqrt(1 -
    beta2^t) / (1 - beta1^t)``), numbers or (capturable) device tensors, which a :class:`TableSet`'s entries carry.
    """

    family: str
    lr: float | Tensor
    state: RuleState = RuleState()
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    eps: float = 0.0
    betas: tuple[float, float] = (0.0, 0.0)
    step_size: float | Tensor = 0.0
    row_bias: bool = False


@dataclass(frozen=True)
class StochasticRounding:
    """Stochastic rounding of a bf16 table's new rows (:mod:`lightning_sparse.kernels.rounding`): ``salt`` is the hash
    salt of the update's draws (``rounding.noise_salt``); a local row ``r`` is global row ``r * global_mul + global_add``."""

    salt: int
    global_mul: int = 1
    global_add: int = 0


@dataclass(frozen=True)
class TableSet:
    """Several tables that one launch of :func:`update_rows` updates: each key is ``table << shift | row``.

    ``entries``: an int64 ``[T, 8]`` on the device, per table its columns (``kernels.triton_runs.ENTRY``): the
    addresses of its rows, of its state tensors (``first``, ``second``, ``per_row`` as in :class:`RuleState`; 0 where
    unused) and of its unique-id counter, then the float64 bits of its step's scalars: learning rate, step size and
    decay (``1 - lr * weight_decay``), which differ per table with its step count (:func:`table_entries` makes it).
    ``rows``, ``state`` and ``counter``: one table's, for their dtypes.
    """

    entries: Tensor
    shift: int
    rows: Tensor
    state: RuleState = RuleState()
    counter: Tensor | None = None


def table_entries(tables: list[Tensor], states: list[RuleState], counters: list[Tensor | None],
                  scalars: list[tuple[float, float, float]], kept: KeptValues | None = None) -> Tensor:  # fmt: skip
    """The ``[T, 8]`` entries of a :class:`TableSet` on the tables' device (one copy from pinned host memory, no wait).

    Per table: its rows, the state its rule reads, its unique-id counter (``None``: none) and its step's scalars
    ``(lr, step_size, decay)``. ``kept``: made once and kept while the tables, their state and scalars stay the same
    (what a captured step reads).
    """
    from lightning_sparse.kernels.triton_runs import ENTRY

    rows = []
    for table, state, counter, (lr, step_size, decay) in zip(tables, states, counters, scalars):
        entry = {name: t.data_ptr() if t is not None else 0 for name, t in state._asdict().items()}
        entry.update(rows=table.data_ptr(), counter=counter.data_ptr() if counter is not None else 0,
                     lr=_bits(lr), step_size=_bits(step_size), decay=_bits(decay))  # fmt: skip
        rows.append([entry[name] for name in ENTRY])
    values, device = [value for row in rows for value in row], tables[0].device
    entries = kept.get(values, device) if kept is not None else host_tensor(values, torch.int64, device)
    return entries.view(len(rows), len(ENTRY))


def _bits(number: float) -> int:
    """A float64's bits as an int64 (an entry's scalar columns)."""
    return struct.unpack("<q", struct.pack("<d", float(number)))[0]


def segment_sum(
    runs: Runs,
    values: Tensor,
    num_out: int,
    *,
    shift: int = 0,
    weights: Tensor | None = None,
    offsets: Tensor | None = None,
) -> Tensor:
    """``[num_out, width]``: row ``k + shift`` is the sum of the values of the run of key ``k`` (zeros where no run).

    ``weights`` (one per sorted position, like ``runs.perm``) make it a weighted sum. ``offsets`` (where each output row's run
    starts; CPU only) spare the plain torch path a search. No host read.
    """
    if uses_triton(values) and values.dtype != torch.float64:  # the kernel sums in float32; torch sums float64 in float64
        out = values.new_zeros(num_out, values.shape[1], dtype=torch.float32)
        if len(runs):
            from lightning_sparse.kernels.triton_runs import Target

            _launch(_Sums(runs, values, weights), Target(out=out, stride_o=out.stride(0), shift=shift), UpdateRule("sum", 0.0))
        return out.to(values.dtype) if out.dtype != values.dtype else out
    if offsets is None:
        wanted = torch.arange(-shift, num_out - shift, device=values.device, dtype=runs.keys.dtype)
        offsets = torch.searchsorted(runs.keys, wanted)
    perm = runs.perm if runs.perm is not None else torch.arange(len(runs), device=values.device)
    return F.embedding_bag(perm, values.contiguous(), offsets, mode="sum", per_sample_weights=weights)


def update_rows(
    runs: Runs,
    values: Tensor,
    table: Tensor | TableSet,
    rule: UpdateRule,
    *,
    counts: Tensor | None = None,
    weights: Tensor | None = None,
    mean: bool = False,
    divisor: float = 1.0,
    rounding: StochasticRounding | None = None,
    verdict: Tensor | None = None,
    unique: Tensor | None = None,
) -> None:
    """Apply ``rule`` to the table row of each run (its key) with the run's summed values as gradient: in Triton, or (CPU
    tensors, one table, no stochastic rounding; :func:`~lightning_sparse.kernels.backend.uses_numba`) in numba.

    ``table``: one table, or a :class:`TableSet` (keys name table and row; each table's scalars
    and counter come from its entry, the rest of ``rule`` is shared; no stochastic rounding).

    The gradient of a row is the sum of its run's ``values`` (``[n, dim]``; times ``weights``, one
    per sorted position, if given: a pooled bag's gradient reaches each of its ids so), divided by the
    number of occurrences (``mean``: ``counts`` per value, else 1 each) or by ``divisor``. A run whose
    ``counts`` sum to 0 (placeholders of ranks without a gradient) leaves its row and state alone.
    ``verdict`` (``[2]`` int64, the min and max id looked up; see :mod:`lightning_sparse.kernels.rows`):
    when it shows an id out of range, nothing is updated. ``unique`` (int64 scalar) gains the
    number of runs (a TableSet's tables: each its own, when the set has a ``counter``). No host read.
    """
    from lightning_sparse.kernels.triton_runs import Target
    from lightning_sparse.kernels.triton_update import FAMILIES

    if rule.family not in FAMILIES[1:]:
        raise ValueError(f"Invalid update family: {rule.family!r}. HINT: use one of {FAMILIES[1:]}.")
    many = table if isinstance(table, TableSet) else None
    if many is None and rounding is None and uses_numba(table):
        from lightning_sparse.kernels import numba_runs

        return numba_runs.update(runs.keys, runs.perm, values, table, rule, counts=counts, weights=weights, mean=mean,
                                 divisor=divisor, verdict=verdict, unique=unique)  # fmt: skip
    if many is not None and rounding is not None:
        raise ValueError("update_rows: stochastic rounding takes one table at a time.")
    rows, state = (many.rows, many.state) if many is not None else (table, rule.state)
    to = Target(shift=many.shift if many else 0, table=rows, stride_t=rows.stride(0), state_first=state.first,
                state_second=state.second, state_per_row=state.per_row, tables=many.entries if many else None)  # fmt: skip
    if len(runs):
        _launch(_Sums(runs, values, weights, counts, mean, divisor, verdict, num_rows=1 if many else rows.shape[0],
                      unique=many.counter if many else unique), to, rule, rounding)  # fmt: skip


def cold_tile(dim: int, family: str, many: bool) -> tuple[int, int]:
    """(runs per program, padded dim) of ``runs_cold``: Adam over many tables holds the most in registers, so it takes half."""
    return tile(dim, 512 if family == "adam" and many else 1024)


# runs_hot sums a long run serially, a tile at a time, each tile a gather through ``perm``: its time is
# the number of tiles times a memory latency. On an H100 (2026-11-27) 32-row tiles of 4 warps took
# 86 us a step for the skewed 1M x 64 workload (a run of 2,072 ids: 65 tiles), 40% of the step's GPU time.
HOT_ELEMENTS, HOT_WARPS = 8192, 16


def hot_tile(dim: int) -> tuple[int, int]:
    """(rows per tile, padded dim) of ``runs_hot``: 128 rows of 64 in 16 warps (16 values per thread, as the cold
    kernel holds): a quarter of the tiles of 32 rows, at 59 registers for Adagrad on sm_90 and no spills."""
    return tile(dim, HOT_ELEMENTS)


def tile(dim: int, elements: int) -> tuple[int, int]:
    """(rows per tile, padded dim): tiles of about ``elements`` values."""
    block_d = max(16, 1 << (dim - 1).bit_length())
    return max(1, elements // block_d), block_d


def _log2_float32(beta: float) -> float:
    """log2 of ``beta`` rounded to float32: the per-row bias correction's ``beta**t`` is float32's, as on the CPU path."""
    beta = struct.unpack("<f", struct.pack("<f", beta))[0]
    return math.log2(beta) if beta > 0 else -math.inf


@dataclass(frozen=True)
class _Sums:
    """The runs, how each run's values are summed and scaled, the input's verdict (bad input: no update; ids below
    ``num_rows``) and the counter of distinct keys (see :func:`update_rows`)."""

    runs: Runs
    values: Tensor
    weights: Tensor | None = None
    counts: Tensor | None = None
    mean: bool = False
    divisor: float = 1.0
    verdict: Tensor | None = None
    num_rows: int = 0
    unique: Tensor | None = None


def _launch(sums: _Sums, to: Any, rule: UpdateRule, rounding: StochasticRounding | None = None) -> None:
    """Both kernels over the runs (``runs_cold``, then ``runs_hot``), every argument by the kernels' name for it.

    ``to``: where each run's sum goes (``triton_runs.Target``); ``rule``: what it does there (its scalars are unused
    when ``to.tables`` hold each table's own).
    """
    from lightning_sparse.kernels import triton_runs as k
    from lightning_sparse.kernels import triton_update as u

    runs, values, many = sums.runs, sums.values, to.tables is not None
    n, dim = len(runs), (to.table.shape[1] if to.table is not None else values.shape[1])
    if values.stride(1) != 1:
        values = values.contiguous()
    (beta1, beta2), counts = rule.betas, sums.counts
    lr, step_size = (0.0, 0.0) if many else (rule.lr, rule.step_size)
    arguments = dict(
        keys=runs.keys, perm=runs.perm, n=n, values=values, stride_v=values.stride(0), weights=sums.weights, counts=counts,
        stride_c=counts.stride(0) if counts is not None else 0, dim=dim, dim_f=float(dim), divisor=float(sums.divisor),
        verdict=sums.verdict, num_rows=sums.num_rows, unique=sums.unique, **to._asdict(),
        **u.StepScalars(lr=lr, step_size=step_size, decay=1.0 - lr * rule.weight_decay)._asdict(),
        **u.Hyper(weight_decay=rule.weight_decay, eps=rule.eps, beta1=beta1, beta2=beta2, one_minus_beta1=1.0 - beta1,
                  one_minus_beta2=1.0 - beta2, log2_beta1=_log2_float32(beta1), log2_beta2=_log2_float32(beta2))._asdict(),
        **u.Draws(salt=rounding.salt if rounding else 0, row_multiplier=ROW_MULTIPLIER,
                  global_mul=rounding.global_mul if rounding else 1, global_add=rounding.global_add if rounding else 0)._asdict(),
        **u.UpdateFlags(FAMILY=u.FAMILIES.index(rule.family), WEIGHT_DECAY=rule.weight_decay != 0.0,
                        DECOUPLED=rule.decoupled_weight_decay, ROW_BIAS=rule.row_bias, LERP_FROM_END=1.0 - beta1 >= 0.5,
                        ROUNDING=(u.STOCHASTIC_BF16 if rounding is not None else u.NEAREST).value)._asdict(),
        HAS_PERM=runs.perm is not None, HAS_WEIGHTS=sums.weights is not None, HAS_COUNTS=counts is not None, MEAN=sums.mean,
        DIVIDE=(not sums.mean) and sums.divisor != 1.0, CHECK=sums.verdict is not None,
        COUNT_UNIQUE=sums.unique is not None, MANY=many, HOT_RUN=k.HOT,
    )  # fmt: skip
    block_s, block_d = cold_tile(dim, rule.family, many)
    with launches.launch(values.device):
        k.runs_cold[(-(-n // block_s),)](**arguments, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False)
    block_n, _ = hot_tile(dim)
    with launches.launch(values.device):
        k.runs_hot[(-(-n // k.HOT),)](**arguments, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=HOT_WARPS, enable_fp_fusion=False)
