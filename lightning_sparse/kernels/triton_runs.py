"""Triton kernels over runs of equal keys: sum each run, then write the sum out or apply an optimizer to the run's row.

The input is one sort's result: ``keys`` non-decreasing (runs of equal keys are the
segments) and ``perm``, the value row behind each sorted position. A run starts where a key
differs from the one before it, and ends where the next key differs: the kernels find both by
reading the keys, so they need no segment count or offsets, and the host reads nothing.
Grids are sized by the number of keys (an upper bound on the runs).

Two kernels share the work, as FBGEMM's TBE backward splits it (warp per row, block per row):

* :func:`runs_cold`: one lane per sorted position; a lane at the start of a run of at most
  ``HOT`` keys sums it, walking it one position at a time (in order, so the sum is the same
  as a sequential one);
* :func:`runs_hot`: one program per ``HOT`` positions; the program at the first multiple of
  ``HOT`` inside a run longer than ``HOT`` sums it in ``[BLOCK_N, dim]`` tiles.

Each sum is then handed to :func:`~lightning_sparse.kernels.triton_update.apply_rows` (``FAMILY``): written to ``out[key + shift]``
(``SUM``), or used as the gradient of table row ``key``, whose new value and optimizer state
are computed in registers and written once. The arithmetic follows
:mod:`lightning_sparse.optim.functional` operation by operation, with IEEE division and square
root (``div_rn``, ``sqrt_rn``) as torch computes them. Hyperparameters arrive as the scalars
torch would use (computed on the host in double precision, then float32).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

from lightning_sparse.kernels.triton_update import (
    ADAGRAD,
    ADAM,
    ROWWISE_ADAGRAD,
    SUM,
    Draws,
    Hyper,
    RowPointers,
    StepScalars,
    apply_rows,
)

HOT = 32  # runs longer than this take a program of their own (runs_hot)
# A TableSet entry's columns (int64), in order: addresses (0 where unused), then float64 bits (kernels.runs.table_entries
# writes them by these names); the kernels' names for them are constexprs.
ENTRY = ("rows", "first", "second", "per_row", "counter", "lr", "step_size", "decay")
ENTRY_WIDTH = tl.constexpr(len(ENTRY))
ROWS, FIRST, SECOND, PER_ROW, COUNTER, LR, STEP_SIZE, DECAY = (tl.constexpr(column) for column in range(len(ENTRY)))


class Target(NamedTuple):
    """Where a run's sum goes: ``out[key + shift]`` (SUM), or table row ``key`` (``tables``: a TableSet's entries, whose
    keys are ``table << shift | row``; ``table`` and the state pointers are then one table's, for their types)."""

    out: Any = None
    stride_o: Any = 0
    shift: Any = 0
    table: Any = None
    stride_t: Any = 0
    state_first: Any = None
    state_second: Any = None
    state_per_row: Any = None
    tables: Any = None


@triton.jit
def _address(entry, column, like, lane):
    """The address in column ``column`` of each lane's table entry, typed like the pointer ``like``."""
    return tl.load(entry + column, mask=lane, other=0).to(tl.pointer_type(like.dtype.element_ty))


@triton.jit
def _scalar(entry, column, lane):
    """The float64 in column ``column`` of each lane's table entry, as float32 (torch's scalar arguments are so too)."""
    return tl.load(entry + column, mask=lane, other=0).to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def _finish(
    key, lane, acc, count, cols, col_ok, dim, dim_f, divisor, to, scalars, hyper, draws,
    FAMILY: tl.constexpr, WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, ROW_BIAS: tl.constexpr,
    LERP_FROM_END: tl.constexpr, ROUNDING: tl.constexpr, MEAN: tl.constexpr, DIVIDE: tl.constexpr, MANY: tl.constexpr,
):  # fmt: skip
    """A run's sum (``acc``, ``count`` values) scaled, then written out (SUM) or applied to table row ``key``.

    ``to``: the :class:`Target`. ``MANY``: the keys are ``table << shift | row`` over several tables, and ``to.tables``
    points to the int64 ``[T, ENTRY_WIDTH]`` entries: per table its columns (see ``ENTRY``), its step's scalars among
    them; else ``scalars`` (:class:`~lightning_sparse.kernels.triton_update.StepScalars`) are the launch's. The
    constexprs come one by one (a tuple made in a kernel holds values): the update's (``UpdateFlags``), then the sum's.
    """
    if MEAN:  # duplicate_grads="mean": divide by the occurrences
        acc = tl.div_rn(acc, tl.where(lane, count, 1.0)[:, None])
    elif DIVIDE:  # duplicate_grads="sum" on several ranks: divide by their number
        acc = tl.div_rn(acc, divisor)
    if FAMILY == SUM:
        at = (key + to.shift).to(tl.int64)[:, None] * to.stride_o + cols[None, :]
        tl.store(to.out + at, acc.to(to.out.dtype.element_ty), mask=lane[:, None] & col_ok[None, :])
    else:
        if MANY:
            index = key >> to.shift
            local = (key - (index << to.shift)).to(tl.int64)
            entry = to.tables + index.to(tl.int64) * ENTRY_WIDTH
            row = _address(entry, ROWS, to.table, lane) + local * to.stride_t
            scalars = StepScalars(_scalar(entry, LR, lane)[:, None], _scalar(entry, STEP_SIZE, lane)[:, None],
                                  _scalar(entry, DECAY, lane)[:, None])  # fmt: skip
        else:
            local = key.to(tl.int64)
            row = to.table + local * to.stride_t
        first, second, per_row = row, row, row  # the state a family does not read stays unused
        if FAMILY == ADAGRAD or FAMILY == ADAM:
            first = (_address(entry, FIRST, to.state_first, lane) if MANY else to.state_first) + local * to.stride_t
        if FAMILY == ADAM:
            second = (_address(entry, SECOND, to.state_second, lane) if MANY else to.state_second) + local * to.stride_t
        if FAMILY == ROWWISE_ADAGRAD or ROW_BIAS:
            per_row = (_address(entry, PER_ROW, to.state_per_row, lane) if MANY else to.state_per_row) + local
        apply_rows(RowPointers(row, first, second, per_row), local * draws.global_mul + draws.global_add, lane, acc, cols,
                   col_ok, dim, dim_f, scalars, hyper, draws, FAMILY, WEIGHT_DECAY, DECOUPLED, ROW_BIAS, LERP_FROM_END,
                   ROUNDING)  # fmt: skip


@triton.jit
def runs_cold(
    keys, perm, n, values, stride_v, weights, counts, stride_c, dim, dim_f,
    out, stride_o, shift, divisor, table, stride_t, state_first, state_second, state_per_row, tables, num_rows, verdict, unique,
    lr, step_size, weight_decay, decay, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2,
    salt, row_multiplier, global_mul, global_add,
    FAMILY: tl.constexpr, HAS_PERM: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_COUNTS: tl.constexpr,
    MEAN: tl.constexpr, DIVIDE: tl.constexpr, CHECK: tl.constexpr, COUNT_UNIQUE: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, ROW_BIAS: tl.constexpr, LERP_FROM_END: tl.constexpr,
    ROUNDING: tl.constexpr, MANY: tl.constexpr, HOT_RUN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Runs of at most HOT_RUN keys: a lane per position, the lane at a run's start sums it in order."""
    p = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    inside = p < n
    key = tl.load(keys + p, mask=inside, other=-1)
    starts = inside & (tl.load(keys + p - 1, mask=inside & (p > 0), other=-1) != key)
    if (
        CHECK
    ):  # bad input since the verdict was cleared: no row is updated, no key is trusted (lightning_sparse.lookup.range_check)
        starts = tl.where((tl.load(verdict) >= 0) & (tl.load(verdict + 1) < num_rows), starts, False)
    if COUNT_UNIQUE and MANY:  # distinct keys per table, for SparseStatsMonitor: on the device
        counter = _address(tables + (key >> shift).to(tl.int64) * ENTRY_WIDTH, COUNTER, unique, starts)
        tl.atomic_add(counter, tl.full([BLOCK_S], 1, tl.int64), mask=starts)
    elif COUNT_UNIQUE:  # one atomic per program
        tl.atomic_add(unique, tl.sum(starts.to(tl.int64), axis=0))
    far = tl.load(keys + p + HOT_RUN, mask=starts & (p + HOT_RUN < n), other=-1)
    lane = starts & (far != key)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    count = tl.zeros([BLOCK_S], dtype=tl.float32)
    going = lane
    step = 0
    while tl.max(going.to(tl.int32), axis=0) > 0:
        q = p + step
        if HAS_PERM:
            source = tl.load(perm + q, mask=going, other=0).to(tl.int64)
        else:
            source = q.to(tl.int64)
        g = tl.load(values + source[:, None] * stride_v + cols[None, :], mask=going[:, None] & col_ok[None, :], other=0.0)
        g = g.to(tl.float32)
        if HAS_WEIGHTS:
            g = g * tl.load(weights + q, mask=going, other=0.0).to(tl.float32)[:, None]
        acc += g
        if HAS_COUNTS:
            count += tl.load(counts + source * stride_c, mask=going, other=0.0).to(tl.float32)
        else:
            count += going.to(tl.float32)
        step += 1
        going = going & (tl.load(keys + p + step, mask=going & (p + step < n), other=-1) == key)
    if HAS_COUNTS:  # a run of placeholders only (counts 0: ranks without a gradient) updates nothing
        lane = lane & (count > 0)
    to = Target(out, stride_o, shift, table, stride_t, state_first, state_second, state_per_row, tables)
    scalars = StepScalars(lr, step_size, decay)
    hyper = Hyper(weight_decay, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2)
    draws = Draws(salt, row_multiplier, global_mul, global_add)
    _finish(key, lane, acc, count, cols, col_ok, dim, dim_f, divisor, to, scalars, hyper, draws,
            FAMILY, WEIGHT_DECAY, DECOUPLED, ROW_BIAS, LERP_FROM_END, ROUNDING, MEAN, DIVIDE, MANY)  # fmt: skip


@triton.jit
def runs_hot(
    keys, perm, n, values, stride_v, weights, counts, stride_c, dim, dim_f,
    out, stride_o, shift, divisor, table, stride_t, state_first, state_second, state_per_row, tables, num_rows, verdict, unique,
    lr, step_size, weight_decay, decay, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2,
    salt, row_multiplier, global_mul, global_add,
    FAMILY: tl.constexpr, HAS_PERM: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_COUNTS: tl.constexpr,
    MEAN: tl.constexpr, DIVIDE: tl.constexpr, CHECK: tl.constexpr, COUNT_UNIQUE: tl.constexpr,
    WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, ROW_BIAS: tl.constexpr, LERP_FROM_END: tl.constexpr,
    ROUNDING: tl.constexpr, MANY: tl.constexpr, HOT_RUN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Runs longer than HOT_RUN keys: the program at the run's first position that is a multiple of HOT_RUN sums it."""
    q = tl.program_id(0) * HOT_RUN
    key = tl.load(keys + q)
    before = tl.load(keys + q - HOT_RUN, mask=q >= HOT_RUN, other=-1)
    window = q - HOT_RUN + 1 + tl.arange(0, HOT_RUN)  # the run starts in here (else ``before`` is in it)
    start = tl.min(tl.where(tl.load(keys + window, mask=window >= 0, other=-1) == key, window, q), axis=0)
    far = tl.load(keys + start + HOT_RUN, mask=start + HOT_RUN < n, other=-1)
    mine = (before != key) & (far == key)
    if CHECK:
        mine = mine & (tl.load(verdict) >= 0) & (tl.load(verdict + 1) < num_rows)
    if mine:
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        count = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = start
        more = 1
        while more > 0:
            pos = first + tl.arange(0, BLOCK_N)
            take = (pos < n) & (tl.load(keys + pos, mask=pos < n, other=-1) == key)
            if HAS_PERM:
                source = tl.load(perm + pos, mask=take, other=0).to(tl.int64)
            else:
                source = pos.to(tl.int64)
            g = tl.load(values + source[:, None] * stride_v + cols[None, :], mask=take[:, None] & col_ok[None, :], other=0.0)
            g = g.to(tl.float32)
            if HAS_WEIGHTS:
                g = g * tl.load(weights + pos, mask=take, other=0.0).to(tl.float32)[:, None]
            acc += g
            if HAS_COUNTS:
                count += tl.load(counts + source * stride_c, mask=take, other=0.0).to(tl.float32)
            else:
                count += take.to(tl.float32)
            first += BLOCK_N
            more = tl.min(take.to(tl.int32), axis=0)  # the whole tile was the run's: it may go on
        one = tl.arange(0, 1)
        total = tl.sum(count, axis=0) + tl.zeros([1], tl.float32)
        live = one == 0
        if HAS_COUNTS:  # as in runs_cold
            live = live & (total > 0)
        to = Target(out, stride_o, shift, table, stride_t, state_first, state_second, state_per_row, tables)
        scalars = StepScalars(lr, step_size, decay)
        hyper = Hyper(weight_decay, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2)
        draws = Draws(salt, row_multiplier, global_mul, global_add)
        _finish(key + one, live, tl.sum(acc, axis=0)[None, :], total, cols, col_ok, dim, dim_f, divisor, to, scalars, hyper,
                draws, FAMILY, WEIGHT_DECAY, DECOUPLED, ROW_BIAS, LERP_FROM_END, ROUNDING, MEAN, DIVIDE, MANY)  # fmt: skip
