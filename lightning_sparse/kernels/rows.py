"""A table's rows at ids, with the id-range check on the device: the forward of a one-process lookup on a GPU.

:func:`gather` reads ``table[ids]`` in one Triton kernel and checks the ids as it goes, without
a host read: ids out of range are clamped for the read and widen ``verdict``, a ``[2]`` int64
(the lowest id below 0 and the highest at or above the table's rows, else 0). The
optimizer's fused update reads the verdict and updates nothing while it shows an id out of
range (:func:`lightning_sparse.kernels.runs.update_rows`); the host raises the error once it
has read it (:mod:`lightning_sparse.lookup.range_check`). With ``keys`` the kernel also writes the
clamped ids, as int32 when the table has fewer than 2**31 rows: the lookup's own copy for its
backward, so that a caller who changes its ids buffer in place cannot move the gradient.

:func:`normal` draws new rows of :func:`lightning_sparse.tables.init.normal` in one kernel (a
dynamic table initializes rows on its step, where the torch version is about 33 launches), and
:func:`put` writes them, and their optimizer state, to the slots a batch gave, its padding skipped.

:func:`copy_rows` is ``index_copy_`` along rows for the torch path: the same bytes, moved as whole 16-byte words.

The counter-based hash every random row comes from (initial rows and the draws of stochastic rounding) is here too:
element ``(row, column)`` of a draw is a pure function of ``(seed, global row, column)``, so a row gets the same values
whichever rank computes it, on a CPU or a GPU. :func:`hashes` is the plain torch implementation; the Triton kernels hash
alike (``triton_update.hash_bits``: the update's rounding noise, and the new rows of ``triton_rows.normal_rows``), with
:data:`ROW_MULTIPLIER` and :func:`seed_salt` from here.

>>> hashes(torch.tensor([3]), 2, seed=7).shape
torch.Size([1, 1, 2])
"""

from __future__ import annotations

import functools
import math
import struct

import torch
from torch import Tensor

from lightning_sparse.kernels.backend import compiled_call, interpreting, launches, numba_module, uses_numba, uses_triton

_INT32_LIMIT = 2**31 - 1
_TILE = 1024  # values per program: [BLOCK_N, BLOCK_D] with 4 warps
NORMAL_TILE = 256  # values per program of new rows: float64 log, sin and cos take many registers a value
_INTERPRETER_TILE = 1 << 16  # Triton's interpreter runs a program as a few NumPy calls: fewer, larger ones


def key_dtype(num_rows: int) -> torch.dtype:
    """The dtype of a lookup's keys for a table of ``num_rows`` rows: int32 while it can hold them (its sort is faster)."""
    return torch.int32 if num_rows <= _INT32_LIMIT else torch.int64


def gather(table: Tensor, ids: Tensor, out_dtype: torch.dtype, verdict: Tensor, keys: bool) -> tuple[Tensor, Tensor | None]:
    """(``table[clamp(ids)]`` as ``[len(ids), dim]`` in ``out_dtype``, the clamped ids if ``keys``). Triton, no host read.

    ``ids``: 1-D, int64 or int32. ``verdict`` widens to cover any id out of range (see the module).
    """
    from lightning_sparse.kernels import triton_rows as k

    n, dim = len(ids), table.shape[1]
    out = torch.empty(n, dim, dtype=out_dtype, device=table.device)
    copy = torch.empty(n, dtype=key_dtype(table.shape[0]), device=table.device) if keys else None
    if n:
        block_n, block_d = tile(dim)
        with launches.launch(table.device):
            k.gather_rows[(-(-n // block_n),)](
                ids, n, table, table.stride(0), table.shape[0], dim, out, out.stride(0), copy, verdict,
                STORE_KEYS=keys, CHECK=True, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False,
            )  # fmt: skip
    return out, copy


_WORD = torch.complex128  # the widest dtype: index_copy_ moves one element at a time, so wider elements mean fewer moves


def copy_rows(dst: Tensor, rows: Tensor, src: Tensor) -> Tensor:
    """``dst.index_copy_(0, rows, src)``, bitwise, with each row moved as 16-byte words where its layout allows.

    torch's CPU ``index_copy_`` computes an offset per element; a float32 row of 64 values is 16 such words,
    a quarter of the elements (about 30% less time for a table's touched rows on a 2-core EPYC). Rows whose
    bytes, strides or addresses are not multiples of 16 are copied as they are; ``dst`` that is no tensor (several
    tables seen as one) copies with its own ``index_copy_``. Returns ``dst``.
    """
    if not isinstance(dst, Tensor):  # several tables seen as one (lightning_sparse.optim.joint_cpu.Tables): its own copy
        dst.index_copy_(0, rows, src)
    elif _as_words(dst) and _as_words(src) and src.dtype == dst.dtype:
        dst.view(_WORD).index_copy_(0, rows, src.view(_WORD))
    else:
        dst.index_copy_(0, rows, src)
    return dst


def _as_words(t: Tensor) -> bool:
    size, word = t.element_size(), _WORD.itemsize
    return (t.dim() == 2 and t.stride(1) == 1 and (t.shape[1] * size) % word == 0 and (t.stride(0) * size) % word == 0
            and t.data_ptr() % word == 0 and not t.is_complex())  # fmt: skip


def put(dst: Tensor, rows: Tensor, src: Tensor, skip: int | None) -> None:
    """``dst[rows[i]] = src[i]`` in place, for each ``i`` whose row is not ``skip`` (a padded batch's filler row, if any).

    ``dst``: ``[N, ...]``; ``src``: ``[len(rows), ...]``, possibly expanded (one fresh row for all).
    On the GPU's path one Triton kernel, in which the padding writes nothing. ``index_copy_`` would
    send every padding row to the one row ``skip``: for a dynamic table's bound of 65,536 new rows,
    tens of thousands of writes queued on the same addresses, 110 us a call on an H100. Elsewhere
    ``index_copy_``, and row ``skip`` then holds one of the padding rows: the caller owns that row.
    """
    if skip is None or not uses_triton(dst) or not len(rows):
        copy_rows(dst, rows, src)
        return
    from lightning_sparse.kernels import triton_rows as k

    flat_dst, flat_src = dst.view(len(dst), -1), src.reshape(len(src), -1)
    if flat_src.shape[1] > 1 and flat_src.stride(1) != 1:
        flat_src = flat_src.contiguous()
    n, dim = len(rows), flat_dst.shape[1]
    block_n, block_d = tile(dim)
    with launches.launch(dst.device):
        k.put_rows[(-(-n // block_n),)](rows, n, flat_src, flat_src.stride(0), flat_dst, flat_dst.stride(0), dim, skip,
                                        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4)  # fmt: skip


def tile(dim: int) -> tuple[int, int]:
    """(ids per program, padded dim) of the gather for rows of ``dim``."""
    block_d = max(16, 1 << (dim - 1).bit_length())
    return max(1, _TILE // block_d), block_d


def reference_gather(table: Tensor, ids: Tensor, out_dtype: torch.dtype, verdict: Tensor) -> tuple[Tensor, Tensor]:
    """What :func:`gather` computes, in plain torch (the tests compare the two)."""
    low, high = torch.aminmax(ids.to(torch.int64)) if len(ids) else (torch.zeros(()), torch.zeros(()))
    verdict[0] = torch.minimum(verdict[0], low.clamp(max=0))
    verdict[1] = torch.where(high >= table.shape[0], torch.maximum(verdict[1], high), verdict[1])
    rows = ids.to(torch.int64).clamp(0, table.shape[0] - 1)
    return table.index_select(0, rows).to(out_dtype), rows.to(key_dtype(table.shape[0]))


def normal(global_ids: Tensor, dim: int, seed: int, std: float, mean: float) -> Tensor:
    """Rows of :func:`lightning_sparse.tables.init.normal` for ``global_ids`` as ``[n, dim]`` float32: one Triton kernel.

    The same float64 arithmetic as the torch version, op for op (no fused multiply-add), so the
    rows agree with it to the last bit wherever the two math libraries' ``log``, ``cos`` and
    ``sin`` round alike in float64 (a difference there lies far below a float32 ulp).
    """
    from lightning_sparse.kernels import triton_rows as k

    n, half = len(global_ids), -(-dim // 2)
    out = torch.empty(n, dim, dtype=torch.float32, device=global_ids.device)
    if n:
        block_h = max(16, 1 << (half - 1).bit_length())
        block_n = max(1, (_INTERPRETER_TILE if interpreting() else NORMAL_TILE) // block_h)
        with launches.launch(global_ids.device):
            k.normal_rows[(-(-n // block_n),)](
                global_ids, n, dim, half, out, out.stride(0), seed_salt(seed), ROW_MULTIPLIER, _bits(-2.0 * std * std),
                _bits(2.0 * math.pi), _bits(mean), HAS_MEAN=bool(mean), BLOCK_N=block_n, BLOCK_H=block_h, num_warps=4,
                enable_fp_fusion=False,
            )  # fmt: skip
    return out


def _bits(value: float) -> int:
    """A float64's bits as an int64 (how a kernel gets an exact float64 argument)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


# ---------------------------------------------------------------- the counter-based hash of random rows
_MASK32, _MASK64 = 0xFFFFFFFF, (1 << 64) - 1


def _hash32(x: int) -> int:
    """Chris Wellons' ``lowbias32`` integer hash of a 32-bit value."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _hash32_(x: Tensor) -> Tensor:
    """:func:`_hash32` in place on int32 tensors holding the values' 32 bits.

    int32 shifts and multiplies wrap and vectorize (int64 right shifts do not, on AVX2): a right
    shift is arithmetic, so its copies of the sign bit are masked off.
    """
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x ^= (x >> shift).bitwise_and_((1 << (32 - shift)) - 1)
        x.mul_(_int32(multiplier))
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    return x


def _int32(value: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    return value - (1 << 32) if value >= 1 << 31 else value


def hashes(global_ids: Tensor, columns: int, seed: int, blocks: int = 1) -> Tensor:
    """int32 ``[blocks, rows, columns]`` of 32 random bits each: a pure function of (seed, row, block * columns + column).

    A row's key folds the 64-bit product of its id with an odd constant (plus the seed's salt)
    to 32 bits; element ``(r, c)`` is the ``lowbias32`` hash of the row's key plus ``c`` times the
    golden ratio. On a CPU with numba one loop (:func:`_hash_loop`, the same bits); else few tensor ops, in
    int32 in place (a row of a DynamicEmbedding is initialized as its id arrives, so this is on the training path).
    """
    if uses_numba(global_ids):
        return _hashed_in_numba(global_ids, columns, seed, blocks, torch.int32)
    x = global_ids.to(torch.int64).view(-1, 1) * ROW_MULTIPLIER + seed_salt(seed)
    row_keys = (x ^ (x >> 32)).to(torch.int32)  # low ^ high 32 bits (the shift's sign copies fall outside them)
    cols = torch.arange(blocks * columns, dtype=torch.int32, device=x.device).mul_(COLUMN_MULTIPLIER)
    return _hash32_(row_keys + cols.view(blocks, 1, columns))


def uniforms(global_ids: Tensor, columns: int, seed: int, blocks: int = 1) -> Tensor:
    """float64 ``[blocks, rows, columns]`` in (0, 1): :func:`hashes`' bits as int32 ``h``, ``(h + 2**31 + 0.5) / 2**32``."""
    if uses_numba(global_ids):
        return _hashed_in_numba(global_ids, columns, seed, blocks, torch.float64)
    return hashes(global_ids, columns, seed, blocks).to(torch.float64).add_(2.0**31 + 0.5).mul_(2.0**-32)


def _hashed_in_numba(global_ids: Tensor, columns: int, seed: int, blocks: int, dtype: torch.dtype) -> Tensor:
    import numpy as np

    out = torch.empty(blocks, len(global_ids), columns, dtype=dtype)
    ids = global_ids.to(torch.int64).contiguous().numpy().view(np.uint64)
    compiled_call(_hash_loop(dtype.is_floating_point), ids, np.uint64(seed_salt(seed) & _MASK64), out.numpy())
    return out


@functools.cache
def _hash_loop(uniform: bool):  # noqa: ANN202 (a numba dispatcher)
    """The numba loop of :func:`hashes` on a CPU (``uniform``: of :func:`uniforms`): ``out[b, r, c]`` from ``ids[r]``
    (uint64) and the seed's salt (uint64)."""
    import numpy as np

    numba = numba_module()
    row_multiplier, column_multiplier = np.uint64(ROW_MULTIPLIER & _MASK64), np.uint32(COLUMN_MULTIPLIER & _MASK32)
    low_bits, high = np.uint64(_MASK32), np.uint64(32)
    shifts, multipliers = (np.uint32(16), np.uint32(15)), (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))

    @numba.njit(cache=True, nogil=True)
    def loop(ids, salt, out):  # pragma: no cover (compiled)
        blocks, rows, columns = out.shape
        for r in range(rows):
            x = ids[r] * row_multiplier + salt
            key = np.uint32((x ^ (x >> high)) & low_bits)
            for b in range(blocks):
                for c in range(columns):
                    h = np.uint32(key + np.uint32(b * columns + c) * column_multiplier)
                    for step in range(2):
                        h ^= h >> shifts[step]
                        h = np.uint32(h * multipliers[step])
                    h ^= h >> shifts[0]
                    if uniform:
                        out[b, r, c] = (np.float64(np.int32(h)) + (2.0**31 + 0.5)) * 2.0**-32
                    else:
                        out[b, r, c] = np.int32(h)

    return loop


def seed_salt(seed: int) -> int:
    """The int64 that :func:`hashes` adds to ``id * ROW_MULTIPLIER`` for ``seed`` (the Triton kernels hash alike)."""
    return _signed64(_hash32(seed & _MASK32) << 32 | _hash32((seed >> 32) & _MASK32 ^ 0x5BD1E995))


def _signed64(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# The odd constants of :func:`hashes` (the golden ratio's bits), as the signed ints that hold them.
ROW_MULTIPLIER = _signed64(0x9E3779B97F4A7C15)
COLUMN_MULTIPLIER = _int32(0x9E3779B9)
