"""Triton: a table's rows at ids, the ids checked on the device as they are read, new rows drawn for ids and put in place (see :mod:`lightning_sparse.kernels.rows`)."""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_sparse.kernels.triton_update import hash_bits


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


@triton.jit
def put_rows(rows, n, src, stride_s, dst, stride_d, dim, skip, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``dst[rows[i]] = src[i]`` where ``rows[i] != skip``: the padding of a batch writes nothing."""
    p = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = p < n
    row = tl.load(rows + p, mask=inside, other=0).to(tl.int64)
    keep = inside & (row != skip)
    cols = tl.arange(0, BLOCK_D)
    mask = keep[:, None] & (cols < dim)[None, :]
    values = tl.load(src + p.to(tl.int64)[:, None] * stride_s + cols[None, :], mask=mask, other=0)
    tl.store(dst + row[:, None] * stride_d + cols[None, :], values.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _uniform(bits):
    """float64 in (0, 1) from 32 hashed bits: ``(bits + 2**31 + 0.5) * 2**-32``, each step exact as in the torch version.

    Float literals are float32 in a compiled kernel (the interpreter keeps float64), so each one
    here is exact in float32: ``2**31 + 0.5`` is added as two.
    """
    return (bits.to(tl.float64) + 2147483648.0 + 0.5) * 2.3283064365386963e-10


@triton.jit
def normal_rows(
    ids, n, dim, half, out, stride_o, salt, row_multiplier, minus_two_var_bits, two_pi_bits, mean_bits,
    HAS_MEAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """``out[i]``: row ``ids[i]`` of lightning_sparse.tables.init.normal, Box-Muller in float64 as the torch version.

    Column ``c < half`` is ``cos(2 pi u2) * r`` and column ``half + c`` is ``sin(2 pi u2) * r``, with
    ``r = sqrt(log(u1) * -2 var)``, ``u1`` and ``u2`` the uniforms of columns ``c`` and ``half + c``.
    The float64 constants come as their int64 bits (a Python float argument would be float32).
    """
    minus_two_var = minus_two_var_bits.to(tl.float64, bitcast=True)
    two_pi = two_pi_bits.to(tl.float64, bitcast=True)
    p = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = p < n
    rows_here = tl.load(ids + p, mask=inside, other=0)
    c = tl.arange(0, BLOCK_H)
    radius = tl.sqrt(tl.log(_uniform(hash_bits(rows_here, c, salt, row_multiplier))) * minus_two_var)
    angle = _uniform(hash_bits(rows_here, c + half, salt, row_multiplier)) * two_pi
    first, second = tl.cos(angle) * radius, tl.sin(angle) * radius
    if HAS_MEAN:
        mean = mean_bits.to(tl.float64, bitcast=True)
        first, second = first + mean, second + mean
    rows = out + p.to(tl.int64)[:, None] * stride_o
    tl.store(rows + c[None, :], first.to(tl.float32), mask=inside[:, None] & (c < half)[None, :])
    tl.store(rows + half + c[None, :], second.to(tl.float32), mask=inside[:, None] & (half + c < dim)[None, :])
