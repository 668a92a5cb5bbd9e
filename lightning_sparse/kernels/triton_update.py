"""One optimizer step on rows, in registers: the arithmetic of the fused update (:mod:`triton_runs` calls it).

:func:`apply_rows` takes each row's summed gradient and applies SGD, Adagrad, row-wise Adagrad
or Adam to the row and its state, reading each once and writing each once. It follows
:mod:`lightning_sparse.optim.functional` operation by operation, with IEEE division and square
root (``div_rn``, ``sqrt_rn``) as torch computes them; bf16 rows are written with the
stochastic rounding of :mod:`lightning_sparse.kernels.rounding`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

# The update families (``FAMILY``), by the names an UpdateRule gives them, in order; the kernels' names for them are
# constexprs (a kernel reads no other globals). SUM writes each run's sum out instead of updating a row.
FAMILIES = ("sum", "sgd", "adagrad", "rowwise_adagrad", "adam")
SUM, SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = (tl.constexpr(code) for code in range(len(FAMILIES)))
# How new rows are written (``ROUNDING``): in the table's dtype (rounded to nearest), or bf16 with stochastic rounding.
NEAREST, STOCHASTIC_BF16 = tl.constexpr(0), tl.constexpr(1)


# The arguments of apply_rows, grouped. The kernels take each value under the field's name (kernels/runs.py passes
# them by name: ``**group._asdict()``) and group them for the functions they call; a group is flattened when the
# kernel compiles (the same code as the values one by one).
class StepScalars(NamedTuple):
    """The step's scalars (float32): a table's own in a TableSet (its entry's LR, STEP_SIZE and DECAY columns)."""

    lr: Any  # the learning rate (Adagrad's decayed ``clr``)
    step_size: Any  # global-bias Adam's ``lr * sqrt(1 - beta2^t) / (1 - beta1^t)``
    decay: Any  # AdamW's ``1 - lr * weight_decay``


class Hyper(NamedTuple):
    """The hyperparameters every table of a launch shares (float32), the betas' forms computed on the host."""

    weight_decay: Any
    eps: Any
    beta1: Any
    beta2: Any
    one_minus_beta1: Any
    one_minus_beta2: Any
    log2_beta1: Any  # log2 of beta1 rounded to float32 (per-row bias correction)
    log2_beta2: Any


class Draws(NamedTuple):
    """Stochastic rounding's hash (:mod:`lightning_sparse.kernels.rounding`): local row ``r`` is global row
    ``r * global_mul + global_add``."""

    salt: Any
    row_multiplier: Any
    global_mul: Any
    global_add: Any


class UpdateFlags(NamedTuple):
    """The constexprs that choose apply_rows's code: the family and its options (passed one by one: a tuple made in a
    kernel holds values, not constexprs)."""

    FAMILY: Any
    WEIGHT_DECAY: Any
    DECOUPLED: Any
    ROW_BIAS: Any
    LERP_FROM_END: Any  # Adam's lerp written from the gradient's end (1 - beta1 >= 0.5), as torch's lerp_ computes it
    ROUNDING: Any


class RowPointers(NamedTuple):
    """Per lane, pointers to its row's first element in the table and in its state: per element (``first``,
    ``second``) and per row (``per_row``); a family's unused state points at the row (never read)."""

    row: Any
    first: Any
    second: Any
    per_row: Any


@triton.jit
def _lowbias32(x):
    """Chris Wellons' lowbias32 on int32 holding 32 bits (lightning_sparse.kernels.rows._hash32_, op for op)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 2146121005  # 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -2073254261  # 0x846CA68B as int32
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def hash_bits(global_rows, columns, salt, row_multiplier):
    """``[rows, columns]`` int32 of 32 random bits: lightning_sparse.kernels.rows.hashes for these rows and columns."""
    x = global_rows.to(tl.int64) * row_multiplier + salt
    row_keys = (x ^ (x >> 32)).to(tl.int32)
    return _lowbias32(row_keys[:, None] + columns[None, :] * -1640531527)  # 0x9E3779B9 as int32


@triton.jit
def _rounding_noise(global_rows, cols, half_columns, salt, row_multiplier):
    """``[rows, cols]`` int32 in [0, 2**16): lightning_sparse.kernels.rounding.rounding_noise for these rows and columns."""
    low = cols < half_columns
    bits = hash_bits(global_rows, tl.where(low, cols, cols - half_columns), salt, row_multiplier)
    return tl.where(low[None, :], bits & 0xFFFF, (bits >> 16) & 0xFFFF)


@triton.jit
def _one_minus_power(t, log2_beta):
    """``1 - beta**t`` as the CPU path computes it in float32 (``torch.pow`` of ``beta`` rounded to float32).

    ``log2_beta`` is that float32 ``beta``'s log2. A GPU's fast ``exp2`` is off by about 2**-22 of
    its value, and ``1 - beta**t`` cancels near 1: ``1 - 0.999`` came out about 1e-4 of itself
    wrong, and Adam's per-row bias correction with it. So near 1 (``|y| < 0.5``, ``y = t ln(beta)``)
    the power is ``1 + expm1(y)``, ``expm1`` summed from its series (9 terms: relative error below
    1e-9), rounded once; further out ``exp2`` is exact enough.
    """
    y = t * log2_beta * 0.6931471805599453
    series = 1.0 + y * (1.0 / 9.0)
    series = 1.0 + y * series * (1.0 / 8.0)
    series = 1.0 + y * series * (1.0 / 7.0)
    series = 1.0 + y * series * (1.0 / 6.0)
    series = 1.0 + y * series * (1.0 / 5.0)
    series = 1.0 + y * series * (1.0 / 4.0)
    series = 1.0 + y * series * (1.0 / 3.0)
    series = 1.0 + y * series * 0.5
    return 1.0 - tl.where(y > -0.5, 1.0 + y * series, tl.exp2(t * log2_beta))


@triton.jit
def apply_rows(
    at, global_rows, lane, g, cols, col_ok, dim, dim_f, scalars, hyper, draws,
    FAMILY: tl.constexpr, WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, ROW_BIAS: tl.constexpr,
    LERP_FROM_END: tl.constexpr, ROUNDING: tl.constexpr,
):  # fmt: skip
    """One optimizer step on ``[S]`` rows with gradient ``g`` (``[S, BLOCK_D]``), lanes where ``lane``.

    ``at``: the rows' :class:`RowPointers`; ``global_rows``: their global ids (for the rounding draws). ``scalars``
    (:class:`StepScalars`): scalars, or ``[S, 1]`` (one per row's table, see ``triton_runs._finish``); ``hyper``
    (:class:`Hyper`), ``draws`` (:class:`Draws`); then the :class:`UpdateFlags`.
    """
    mask = lane[:, None] & col_ok[None, :]
    row = at.row[:, None] + cols[None, :]
    first, second, per_row = at.first[:, None] + cols[None, :], at.second[:, None] + cols[None, :], at.per_row
    # Every read before the first write. A row's per-row state (and a hot run's whole [1, D] tile) is held
    # by several warps at once; a warp that read after another wrote would step the row twice (seen on an
    # H100: Adam's per-row step counter read as t + 1 by some warps). One barrier between the two halves.
    value = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    if FAMILY == ADAGRAD:
        state = tl.load(first, mask=mask, other=0.0)
    elif FAMILY == ROWWISE_ADAGRAD:
        state = tl.load(per_row, mask=lane, other=0.0)
    elif FAMILY == ADAM:
        m = tl.load(first, mask=mask, other=0.0)
        v = tl.load(second, mask=mask, other=0.0)
        if ROW_BIAS:
            t = tl.load(per_row, mask=lane, other=0) + 1
    tl.debug_barrier()
    if WEIGHT_DECAY:
        if DECOUPLED:
            value = value * scalars.decay  # AdamW: row *= 1 - lr * weight_decay
        else:
            g = g + hyper.weight_decay * value
    if FAMILY == SGD:  # row -= lr * g
        delta = g * -scalars.lr
    elif FAMILY == ADAGRAD:  # sum += g^2; row -= clr * g / (sqrt(sum) + eps)
        total = state + g * g
        tl.store(first, total, mask=mask)
        delta = tl.div_rn(g, tl.sqrt_rn(total) + hyper.eps) * -scalars.lr
    elif FAMILY == ROWWISE_ADAGRAD:  # sum += mean(g^2); row -= lr * g / (sqrt(sum) + eps)
        total = state + tl.div_rn(tl.sum(g * g, axis=1), dim_f)
        tl.store(per_row, total, mask=lane)
        delta = g * (tl.div_rn(1.0, tl.sqrt_rn(total[:, None]) + hyper.eps) * -scalars.lr)
    else:  # Adam (lazy): m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2
        if LERP_FROM_END:
            m = g - (g - m) * (1.0 - hyper.one_minus_beta1)
        else:
            m = m + hyper.one_minus_beta1 * (g - m)
        v = v * hyper.beta2 + hyper.one_minus_beta2 * (g * g)
        tl.store(first, m, mask=mask)
        tl.store(second, v, mask=mask)
        if ROW_BIAS:  # each row's own step t: row -= lr * m_hat / (sqrt(v_hat) + eps)
            tl.store(per_row, t, mask=lane)
            t = t.to(tl.float32)[:, None]
            denom = (tl.sqrt_rn(tl.div_rn(v, _one_minus_power(t, hyper.log2_beta2))) + hyper.eps) * _one_minus_power(
                t, hyper.log2_beta1
            )
            delta = tl.div_rn(m, denom) * -scalars.lr
        else:  # one step for the table: step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
            delta = tl.div_rn(m, tl.sqrt_rn(v) + hyper.eps) * -scalars.step_size
    new = value + delta
    element = at.row.dtype.element_ty
    if ROUNDING == STOCHASTIC_BF16:  # add 16 random low bits, cut them
        noise = _rounding_noise(global_rows, cols, (dim + 1) // 2, draws.salt, draws.row_multiplier)
        bits = (new.to(tl.int32, bitcast=True) + noise) & -65536
        tl.store(row, bits.to(tl.float32, bitcast=True).to(element), mask=mask)
    else:
        tl.store(row, new.to(element), mask=mask)
