"""One optimizer step on rows, in registers: the arithmetic of the fused update (:mod:`triton_runs` calls it).

:func:`apply_rows` takes each row's summed gradient and applies SGD, Adagrad, row-wise Adagrad
or Adam to the row and its state, reading each once and writing each once. It follows
:mod:`lightning_sparse.optim.functional` operation by operation, with IEEE division and square
root (``div_rn``, ``sqrt_rn``) as torch computes them; bf16 rows are written with the
stochastic rounding of :mod:`lightning_sparse.kernels.rounding`.
"""

from __future__ import annotations

import triton
import triton.language as tl

# How new rows are written (``ROUNDING``): in the table's dtype (rounded to nearest), or bf16 with stochastic rounding.
NEAREST, STOCHASTIC_BF16 = 0, 1


@triton.jit
def _lowbias32(x):
    """Chris Wellons' lowbias32 on int32 holding 32 bits (lightning_sparse.kernels.hashes._hash32_, op for op)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 2146121005  # 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -2073254261  # 0x846CA68B as int32
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def hash_bits(global_rows, columns, salt, row_multiplier):
    """``[rows, columns]`` int32 of 32 random bits: lightning_sparse.kernels.hashes.hashes for these rows and columns."""
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
    row, state1_row, state2_row, state_one, global_rows, lane, g, cols, col_ok, dim, dim_f, element,
    lr, step_size, weight_decay, decay, eps, beta1, beta2, one_minus_beta1, one_minus_beta2, log2_beta1, log2_beta2,
    salt, row_multiplier,
    FAMILY: tl.constexpr, WEIGHT_DECAY: tl.constexpr, DECOUPLED: tl.constexpr, ROW_BIAS: tl.constexpr,
    LERP_FROM_END: tl.constexpr, ROUNDING: tl.constexpr,
):  # fmt: skip
    """One optimizer step on ``[S]`` rows with gradient ``g`` (``[S, BLOCK_D]``), lanes where ``lane``.

    ``row``, ``state1_row``, ``state2_row``: pointers to each row's first element in the table and
    its per-element state; ``state_one``: to its per-row state; ``element``: the table's element
    type. ``lr``, ``step_size`` and ``decay`` are scalars or ``[S, 1]`` (one per row's table, see ``_finish``).
    """
    mask = lane[:, None] & col_ok[None, :]
    at = row[:, None] + cols[None, :]
    first, second = state1_row[:, None] + cols[None, :], state2_row[:, None] + cols[None, :]
    # Every read before the first write. A row's per-row state (and a hot run's whole [1, D] tile) is held
    # by several warps at once; a warp that read after another wrote would step the row twice (seen on an
    # H100: Adam's per-row step counter read as t + 1 by some warps). One barrier between the two halves.
    value = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    if FAMILY == 2:
        state = tl.load(first, mask=mask, other=0.0)
    elif FAMILY == 3:
        state = tl.load(state_one, mask=lane, other=0.0)
    elif FAMILY == 4:
        m = tl.load(first, mask=mask, other=0.0)
        v = tl.load(second, mask=mask, other=0.0)
        if ROW_BIAS:
            t = tl.load(state_one, mask=lane, other=0) + 1
    tl.debug_barrier()
    if WEIGHT_DECAY:
        if DECOUPLED:
            value = value * decay  # AdamW: row *= 1 - lr * weight_decay
        else:
            g = g + weight_decay * value
    if FAMILY == 1:  # SGD: row -= lr * g
        delta = g * -lr
    elif FAMILY == 2:  # Adagrad: sum += g^2; row -= clr * g / (sqrt(sum) + eps)
        total = state + g * g
        tl.store(first, total, mask=mask)
        delta = tl.div_rn(g, tl.sqrt_rn(total) + eps) * -lr
    elif FAMILY == 3:  # row-wise Adagrad: sum += mean(g^2); row -= lr * g / (sqrt(sum) + eps)
        total = state + tl.div_rn(tl.sum(g * g, axis=1), dim_f)
        tl.store(state_one, total, mask=lane)
        delta = g * (tl.div_rn(1.0, tl.sqrt_rn(total[:, None]) + eps) * -lr)
    else:  # Adam (lazy): m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2
        if LERP_FROM_END:
            m = g - (g - m) * (1.0 - one_minus_beta1)
        else:
            m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * (g * g)
        tl.store(first, m, mask=mask)
        tl.store(second, v, mask=mask)
        if ROW_BIAS:  # each row's own step t: row -= lr * m_hat / (sqrt(v_hat) + eps)
            tl.store(state_one, t, mask=lane)
            t = t.to(tl.float32)[:, None]
            denom = (tl.sqrt_rn(tl.div_rn(v, _one_minus_power(t, log2_beta2))) + eps) * _one_minus_power(t, log2_beta1)
            delta = tl.div_rn(m, denom) * -lr
        else:  # one step for the table: step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
            delta = tl.div_rn(m, tl.sqrt_rn(v) + eps) * -step_size
    new = value + delta
    if ROUNDING == 1:  # bf16, stochastic: add 16 random low bits, cut them
        noise = _rounding_noise(global_rows, cols, (dim + 1) // 2, salt, row_multiplier)
        bits = (new.to(tl.int32, bitcast=True) + noise) & -65536
        tl.store(at, bits.to(tl.float32, bitcast=True).to(element), mask=mask)
    else:
        tl.store(at, new.to(element), mask=mask)
