"""Triton: every feature of a collection read in one kernel, from many tables: ids, or bags pooled by sum or mean.

A program reads ``BLOCK_B`` bags (an id of an unpooled feature is a bag of one). Each bag finds
its feature by a binary search over the features' first bags, and the feature's entry says
where its ids, offsets and weights are, which table it reads and how it pools (see
:mod:`lightning_sparse.kernels.bags`). Ids and offsets are checked as they are read, without a
host read: an id out of its table's range is clamped for the read, offsets that do not fit are
clamped to the feature's ids, and the feature's verdict records either, as the one-table
gather's does (:mod:`lightning_sparse.lookup.range_check`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_sparse.kernels.triton_runs import ENTRY_WIDTH
from lightning_sparse.kernels.triton_runs import ROWS as ENTRY_ROWS

# The columns of a feature's entry (int64), in order; the kernel's names for them are constexprs (a kernel reads no
# other globals).
LAYOUT = ("ids", "offsets", "weights", "per_bag", "first_id", "first_bag", "table", "rows", "mean", "num_ids", "num_bags",
          "report_as")  # fmt: skip
COLUMNS = tl.constexpr(len(LAYOUT))
IDS, OFFSETS, WEIGHTS, PER_BAG, FIRST_ID, FIRST_BAG, TABLE, ROWS, MEAN, NUM_IDS, NUM_BAGS, REPORT_AS = (
    tl.constexpr(i) for i in range(len(LAYOUT))
)
# The verdict: [0] -1 once anything is wrong (0 else), [1] 0, then per feature (error code, lowest id, highest id),
# the feature numbered as its entry's REPORT_AS says (its place among the collection's features).
OUT_OF_RANGE, BAD_OFFSETS = tl.constexpr(4), tl.constexpr(6)  # lightning_sparse.wire.header's codes


@triton.jit
def _column(features, feature, column, lane):
    return tl.load(features + feature * COLUMNS + column, mask=lane, other=0)


@triton.jit
def _report(verdict, feature, code, low, high, bad):
    """Mark the lanes in ``bad`` as failed: the flag, the feature's code and its id range (atomics: only bad lanes)."""
    tl.atomic_min(verdict + feature * 0, tl.full(bad.shape, -1, tl.int64), mask=bad)  # + 0: one pointer per lane
    tl.atomic_max(verdict + 2 + 3 * feature, code, mask=bad)
    tl.atomic_min(verdict + 3 + 3 * feature, low, mask=bad & (low < 0))
    tl.atomic_max(verdict + 4 + 3 * feature, high, mask=bad & (high >= 0))


@triton.jit
def gather_bags(
    features, num_features, total_bags, entries, table, stride_t, dim, out, stride_o, keys, sources, scales, verdict, shift,
    SEARCH: tl.constexpr, STORE: tl.constexpr, SCALED: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``out[b]`` = the (pooled) rows of bag ``b`` of all features; with ``STORE``, each id's key, bag and weight.

    ``entries``: the tables' ``[T, ENTRY_WIDTH]`` entries (column ROWS: the table's address; see ``triton_runs.ENTRY``),
    ``table``: one of them, for the type. Keys are ``table << shift | row``.
    """
    bag = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    lane = bag < total_bags
    low = tl.zeros([BLOCK_B], tl.int64)  # the feature: the last one whose first bag is at or below ``bag``
    high = tl.zeros([BLOCK_B], tl.int64) + num_features - 1
    for _ in tl.static_range(SEARCH):
        middle = (low + high + 1) // 2
        below = _column(features, middle, FIRST_BAG, lane) <= bag
        low = tl.where(below, middle, low)
        high = tl.where(below, high, middle - 1)
    feature = low
    reported = _column(features, feature, REPORT_AS, lane)
    ids = _column(features, feature, IDS, lane).to(tl.pointer_type(tl.int64))
    offsets = _column(features, feature, OFFSETS, lane)
    weights = _column(features, feature, WEIGHTS, lane)
    num_ids, rows = _column(features, feature, NUM_IDS, lane), _column(features, feature, ROWS, lane)
    index = _column(features, feature, TABLE, lane)
    local = bag - _column(features, feature, FIRST_BAG, lane)
    jagged = lane & (offsets != 0)
    start = tl.where(jagged, tl.load(offsets.to(tl.pointer_type(tl.int64)) + local, mask=jagged, other=0),
                     local * _column(features, feature, PER_BAG, lane))  # fmt: skip
    end = tl.where(jagged, tl.load(offsets.to(tl.pointer_type(tl.int64)) + local + 1, mask=jagged, other=0),
                   start + _column(features, feature, PER_BAG, lane))  # fmt: skip
    last = local == _column(features, feature, NUM_BAGS, lane) - 1
    misfit = jagged & ((end < start) | (start < 0) | (end > num_ids) | ((local == 0) & (start != 0)) | (last & (end != num_ids)))
    _report(verdict, reported, BAD_OFFSETS, tl.zeros_like(start), tl.zeros_like(start) - 1, misfit)
    start = tl.minimum(tl.maximum(start, 0), num_ids)
    end = tl.minimum(tl.maximum(end, start), num_ids)
    count = end - start
    base = tl.load(entries + index * ENTRY_WIDTH + ENTRY_ROWS, mask=lane, other=0).to(tl.pointer_type(table.dtype.element_ty))
    first_id = _column(features, feature, FIRST_ID, lane)
    mean = _column(features, feature, MEAN, lane) != 0
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    acc = tl.zeros([BLOCK_B, BLOCK_D], tl.float32)
    step = 0
    going = lane & (count > 0)
    while tl.max(going.to(tl.int32), axis=0) > 0:
        position = start + step
        found = tl.load(ids + position, mask=going, other=0)
        bad = going & ((found < 0) | (found >= rows))
        _report(verdict, reported, OUT_OF_RANGE, found, found, bad)
        row = tl.minimum(tl.maximum(found, 0), rows - 1)
        weight = tl.load(weights.to(tl.pointer_type(tl.float32)) + position, mask=going & (weights != 0), other=1.0)
        if STORE:
            at = first_id + position
            tl.store(keys + at, ((index << shift) | row).to(keys.dtype.element_ty), mask=going)
            tl.store(sources + at, bag.to(sources.dtype.element_ty), mask=going)
            if SCALED:
                tl.store(scales + at, tl.where(mean, tl.div_rn(weight, tl.maximum(count, 1).to(tl.float32)), weight), mask=going)
        values = tl.load(
            base[:, None] + row[:, None] * stride_t + cols[None, :], mask=going[:, None] & col_ok[None, :], other=0.0
        )
        acc += values.to(tl.float32) * weight[:, None]
        step += 1
        going = going & (step < count)
    acc = tl.where(mean[:, None], tl.div_rn(acc, tl.maximum(count, 1).to(tl.float32)[:, None]), acc)  # rounded as torch divides
    tl.store(out + bag.to(tl.int64)[:, None] * stride_o + cols[None, :], acc.to(out.dtype.element_ty),
             mask=lane[:, None] & col_ok[None, :])  # fmt: skip
