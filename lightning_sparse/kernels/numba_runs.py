"""numba: the fused update of :func:`~lightning_sparse.kernels.update_rows` for CPU tensors, the Triton runs kernel's twin.

One pass over the sorted keys finds the runs (a run: the positions of one distinct key); then, in parallel
over stretches of about equal numbers of runs (each a row to read and write: the cost of a stretch), each run's
values are summed through ``perm`` into a row buffer, scaled (``mean``: by the run's occurrences, else by
``divisor``), and the optimizer's rule is applied to the table row and its state, each read once and written
once: no gathered copies of rows or state, no row gradient written to memory.

The arithmetic is :mod:`lightning_sparse.optim.functional`'s, formula for formula, in the table's dtype
(float32 or float64; each state tensor in its own dtype), with IEEE division and square root and no
fastmath. What differs from the torch ops, within the suite's tolerance (``rtol=1e-5, atol=1e-6``) and not
bit for bit:

* no fused multiply-add: torch's vectorized ``add(alpha=)``, ``addcmul`` and ``lerp`` may use FMA;
* ``lerp`` (Adam's ``exp_avg``) is written in torch's two forms, ``m + w (g - m)`` for a weight below 0.5, else
  ``g - (g - m)(1 - w)``, element by element;
* row-wise Adagrad adds ``sum(g^2) / dim`` in order, where torch squares a ``vector_norm`` (a pairwise sum's
  square root);
* each run's values are added in sorted order, as ``F.embedding_bag`` adds them (so a row's sum matches
  the torch path's, but for the FMA above), in the values' dtype, then rounded to the table's.

The scalars are torch's: Python numbers rounded once to the table's dtype (``1 - lr * weight_decay`` and
Adam's step size computed in double first, as torch receives them).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_sparse.kernels.backend import compiled_call, numba_module, numba_threads

numba = numba_module()

FAMILIES = ("sgd", "adagrad", "rowwise_adagrad", "adam")
SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM = range(len(FAMILIES))
# The kernel's flags (ints) and scalars (the table's dtype), by position in their tuples.
FLAGS = ("family", "has_perm", "has_weights", "has_counts", "mean", "divide", "weight_decay", "decoupled", "row_bias",
         "lerp_from_end")  # fmt: skip
SCALARS = ("lr", "step_size", "decay", "weight_decay", "eps", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "one",
           "divisor", "dim")  # fmt: skip
(FAMILY, HAS_PERM, HAS_WEIGHTS, HAS_COUNTS, MEAN, DIVIDE, WEIGHT_DECAY, DECOUPLED, ROW_BIAS, LERP_FROM_END) = range(len(FLAGS))
(LR, STEP_SIZE, DECAY, DECAY_L2, EPS, BETA1, BETA2, ONE_MINUS_BETA1, ONE_MINUS_BETA2, ONE, DIVISOR, DIM) = range(len(SCALARS))
# Stretches of runs per thread, handed out one at a time (chunk size 1): a stretch holding a hot id's long run takes
# longer, and a thread that drew it is not left behind. (Stretches of equal numbers of positions instead left most rows
# of skewed ids to one thread: 2 threads ran no faster than one.)
STRETCHES_PER_THREAD = 4
ALL_IN = np.array([0, -1], dtype=np.int64)  # a verdict (min id, max id) of no ids: every table holds them
COMPILED = (FAMILY, DECOUPLED, ROW_BIAS)  # the flags each kernel is compiled for (update_runs)


@numba.njit(cache=True)
def run_starts(keys: np.ndarray, starts: np.ndarray) -> int:
    """``starts[u]``: the first position of run ``u`` of the sorted ``keys``; ``starts[runs]`` is ``len(keys)``. Returns
    the number of runs."""
    runs = 0
    for i in range(keys.shape[0]):
        if i == 0 or keys[i] != keys[i - 1]:
            starts[runs] = i
            runs += 1
    starts[runs] = keys.shape[0]
    return runs


@functools.cache
def update_runs(family: int, decoupled: int, row_bias: int) -> Any:
    """The kernel for these flags (:data:`COMPILED`), compiled at its first call and cached on disk.

    They are the closure's constants, not arguments: they rule branches inside the loop over a row's columns, which
    the compiler drops and then vectorizes what is left; with every flag an argument, Adam's update took about twice
    as long. The other flags are arguments, tested once per occurrence or per row, outside those loops (the sum has a
    loop for each case of ``has_perm``), since each constant multiplies the kernels compiled (4 to 7 CPU-seconds each,
    once per machine). With the sum's flags (``has_perm``, ``has_weights``) and ``weight_decay`` compiled in as well,
    the test suite compiled 33 kernels, now 13, and the single-process benchmark's updates measured the same within
    its run-to-run noise (two interleaved rounds each).
    """

    @numba.njit(parallel=True, cache=True)
    def kernel(table, first, second, per_row, row_step, values, perm, weights, counts, keys, starts, runs, stretches, given,
               scalars, verdict, counter):  # fmt: skip
        """The rule on the table row of each run (``keys[starts[u]]``), its gradient the run's values summed; nothing where
        ``verdict`` (the min and max id) shows an id out of the table; ``counter`` (one element, or none) gains ``runs``."""
        if verdict[0] < 0 or verdict[1] >= table.shape[0]:
            return
        if counter.shape[0]:
            counter[0] += runs
        flags = (family, given[1], given[2], given[3], given[4], given[5], given[6], decoupled, row_bias, given[9])
        for stretch in numba.prange(stretches):
            _stretch(table, first, second, per_row, row_step, values, perm, weights, counts, keys, starts,
                     stretch * runs // stretches, (stretch + 1) * runs // stretches, flags, scalars)  # fmt: skip

    return kernel


@numba.njit(cache=True, inline="always")
def _stretch(table, first, second, per_row, row_step, values, perm, weights, counts, keys, starts, low, high, flags, scalars):
    """Runs ``low`` to ``high``: each summed into a row gradient and applied (inlined into the kernel with its flags)."""
    dim = table.shape[1]
    total = np.empty(dim, dtype=values.dtype)
    g = np.empty(dim, dtype=table.dtype)
    cast = np.empty(2, dtype=table.dtype)  # a number in the table's dtype (numba types arithmetic as NumPy does)
    for u in range(low, high):
        total[:] = 0
        count = total[0]  # (zero, in the values' dtype)
        if flags[HAS_PERM]:  # a loop per case: the flags are arguments, tested outside the loop over the columns
            for k in range(starts[u], starts[u + 1]):
                count += _add(total, values, perm[k], weights, k, counts, flags)
        else:
            for k in range(starts[u], starts[u + 1]):
                count += _add(total, values, k, weights, k, counts, flags)
        if flags[HAS_COUNTS] and not count > 0:  # placeholders only (ranks without a gradient): no update
            continue
        cast[0] = count
        for j in range(dim):
            g[j] = total[j]
            if flags[MEAN]:  # duplicate_grads="mean": divided by the occurrences
                g[j] = g[j] / cast[0]
            elif flags[DIVIDE]:  # "sum" on several ranks: divided by their number
                g[j] = g[j] / scalars[DIVISOR]
        _apply(table, first, second, per_row, row_step, keys[starts[u]], g, cast, flags, scalars)


@numba.njit(cache=True, inline="always")
def _add(total, values, source, weights, k, counts, flags):
    """Adds ``values[source]`` (times ``weights[k]``) to ``total``; returns what the occurrence counts."""
    if flags[HAS_WEIGHTS]:
        weight = weights[k]
        for j in range(total.shape[0]):
            total[j] += values[source, j] * weight
    else:
        for j in range(total.shape[0]):
            total[j] += values[source, j]
    return counts[source] if flags[HAS_COUNTS] else 1


@numba.njit(cache=True, inline="always")
def _apply(table, first, second, per_row, row_step, row, g, cast, flags, scalars):
    """One step of the rule on ``table[row]`` and its state, with gradient ``g`` (functional.py, formula for formula)."""
    family, dim, lr = flags[FAMILY], table.shape[1], scalars[LR]
    if flags[WEIGHT_DECAY] and not (family == ADAM and flags[DECOUPLED]):  # L2: g += weight_decay * row
        for j in range(dim):
            g[j] = g[j] + scalars[DECAY_L2] * table[row, j]
    if family == SGD:  # row -= lr * g
        for j in range(dim):
            table[row, j] = table[row, j] + g[j] * -lr
    elif family == ADAGRAD:  # sum += g^2; row -= clr * g / (sqrt(sum) + eps)
        for j in range(dim):
            total = first[row, j] + g[j] * g[j]
            first[row, j] = total
            table[row, j] = table[row, j] + g[j] / (np.sqrt(total) + scalars[EPS]) * -lr
    elif family == ROWWISE_ADAGRAD:  # sum += mean(g^2); row -= lr * g / (sqrt(sum) + eps)
        squares = g[0] * g[0]
        for j in range(1, dim):
            squares += g[j] * g[j]
        total = per_row[row] + squares / scalars[DIM]
        per_row[row] = total
        scale = scalars[ONE] / (np.sqrt(total) + scalars[EPS]) * -lr
        for j in range(dim):
            table[row, j] = table[row, j] + g[j] * scale
    else:  # Adam (lazy): m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2
        corrected1 = corrected2 = scalars[ONE]
        if flags[ROW_BIAS]:  # each row's own step t: row -= lr * m_hat / (sqrt(v_hat) + eps)
            row_step[row] += 1
            cast[1] = row_step[row]
            corrected2 = scalars[ONE] - scalars[BETA2] ** cast[1]
            corrected1 = scalars[ONE] - scalars[BETA1] ** cast[1]
        for j in range(dim):
            value, m, v = table[row, j], first[row, j], second[row, j]
            if flags[DECOUPLED]:  # AdamW (decoupled is set only with a weight decay): row *= 1 - lr * weight_decay
                value = value * scalars[DECAY]
            if flags[LERP_FROM_END]:
                m = g[j] - (g[j] - m) * (scalars[ONE] - scalars[ONE_MINUS_BETA1])
            else:
                m = m + scalars[ONE_MINUS_BETA1] * (g[j] - m)
            v = v * scalars[BETA2] + scalars[ONE_MINUS_BETA2] * g[j] * g[j]
            first[row, j], second[row, j] = m, v
            if flags[ROW_BIAS]:
                delta = m / ((np.sqrt(v / corrected2) + scalars[EPS]) * corrected1) * -lr
            else:  # one step for the table: step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
                delta = m / (np.sqrt(v) + scalars[EPS]) * -scalars[STEP_SIZE]
            table[row, j] = value + delta


def update(runs_keys: Tensor, perm: Tensor | None, values: Tensor, table: Tensor, rule: Any, *, counts: Tensor | None,
           weights: Tensor | None, mean: bool, divisor: float, verdict: Tensor | None, unique: Tensor | None) -> None:  # fmt: skip
    """:func:`~lightning_sparse.kernels.update_rows` on CPU tensors: one table (no ``TableSet``), no stochastic rounding.

    ``rule``: the :class:`~lightning_sparse.kernels.UpdateRule`. Every array goes in contiguous, in one dtype per
    argument (int64 keys and counters, the table's dtype for its scalars), so one compiled kernel serves every family.
    """
    if rule.family not in FAMILIES:
        raise ValueError(f"Invalid update family: {rule.family!r}. HINT: use one of {FAMILIES}.")
    keys = runs_keys.to(torch.int64).contiguous().numpy()
    starts = np.empty(len(keys) + 1, dtype=np.int64)
    runs = compiled_call(run_starts, keys, starts)
    state, (beta1, beta2), family = rule.state, rule.betas, rule.family
    shard, values = table.detach().numpy(), values.detach().contiguous()
    spare, no_rows = shard[:0], np.empty(0, dtype=shard.dtype)  # for state a family does not read (never touched)
    adam = family == "adam"  # decoupled decay and per-row bias correction are Adam's (no other family's kernel for them)
    flags = (FAMILIES.index(family), perm is not None, weights is not None, counts is not None, mean, (not mean) and divisor != 1.0,
             rule.weight_decay != 0.0, adam and rule.decoupled_weight_decay and rule.weight_decay != 0.0, adam and rule.row_bias,
             1.0 - beta1 >= 0.5)  # fmt: skip
    numbers = (rule.lr, rule.step_size, 1.0 - rule.lr * rule.weight_decay, rule.weight_decay, rule.eps, beta1, beta2,
               1.0 - beta1, 1.0 - beta2, 1.0, divisor, table.shape[1])  # fmt: skip
    # Tuples, not arrays: values the compiler knows no store can change, so it keeps them in registers and vectorizes.
    flags, scalars = tuple(int(flag) for flag in flags), tuple(shard.dtype.type(float(number)) for number in numbers)
    per_row = state.per_row.numpy() if family == "rowwise_adagrad" else no_rows
    row_step = state.per_row.numpy() if flags[ROW_BIAS] else keys[:0]
    # A verdict that shows a bad id (the input check ran before): the kernel updates and counts nothing, as Triton's.
    bounds = verdict.numpy() if verdict is not None else ALL_IN
    counter = unique.view(1).numpy() if unique is not None else keys[:0]
    with numba_threads(), numba.parallel_chunksize(1):
        stretches = min(runs, numba.get_num_threads() * STRETCHES_PER_THREAD)
        compiled_call(update_runs(*(flags[i] for i in COMPILED)), shard, _array(state.first, spare), _array(state.second, spare),
                      per_row, row_step, values.numpy(), perm.numpy() if perm is not None else keys, _column(weights, values),
                      _column(counts, values), keys, starts, runs, stretches, flags, scalars, bounds, counter)  # fmt: skip


def _array(tensor: Tensor | None, spare: np.ndarray) -> np.ndarray:
    """A state tensor as an array; ``None``: ``spare`` (a family's unused state, of the type the kernel was compiled for)."""
    return tensor.detach().numpy() if tensor is not None else spare


def _column(tensor: Tensor | None, values: Tensor) -> np.ndarray:
    """Weights or counts as a contiguous array in the values' dtype (as the torch path sums them); ``None``: an empty one."""
    if tensor is None:
        return np.empty(0, dtype=values.numpy().dtype)
    return tensor.to(values.dtype).contiguous().numpy()
