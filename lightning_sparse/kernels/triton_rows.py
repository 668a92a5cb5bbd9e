"""Triton: a table's rows at ids, the ids checked on the device as they are read (see :mod:`lightning_sparse.kernels.rows`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_rows(
    ids, n, table, stride_t, num_rows, dim, out, stride_o, keys, verdict,
    STORE_KEYS: tl.constexpr, CHECK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``out[i] = table[clamp(ids[i])]`` in out's dtype; ids out of range widen ``verdict`` (min, max) instead of raising.

    With ``STORE_KEYS`` the clamped ids are also written to ``keys`` (the lookup's own copy, for backward).
    """
    p = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = p < n
    ids_here = tl.load(ids + p, mask=inside, other=0).to(tl.int64)
    if CHECK:  # atomics only when an id is out of range
        low = tl.min(ids_here, axis=0)
        high = tl.max(ids_here, axis=0)
        if low < 0:
            tl.atomic_min(verdict, low)
        if high >= num_rows:
            tl.atomic_max(verdict + 1, high)
    rows = tl.minimum(tl.maximum(ids_here, 0), num_rows - 1)
    if STORE_KEYS:
        tl.store(keys + p, rows.to(keys.dtype.element_ty), mask=inside)
    cols = tl.arange(0, BLOCK_D)
    mask = inside[:, None] & (cols < dim)[None, :]
    found = tl.load(table + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
    tl.store(out + p.to(tl.int64)[:, None] * stride_o + cols[None, :], found.to(out.dtype.element_ty), mask=mask)
