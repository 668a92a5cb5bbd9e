"""Row initializers: initial values that depend only on ``(seed, global row id)``.

A ``RowInit`` is any callable ``init(global_ids, embedding_dim, seed) -> Tensor`` that returns
``[len(global_ids), embedding_dim]`` values for the given rows. Because every rank asks only for
the rows it owns, the same ``seed`` gives the same logical table on 1, 2 or 3 ranks and under
both sharding schemes, and no rank ever builds the whole table. The initializers made here
pickle (``functools.partial`` of module functions), so a module holding tables can be sent to
ranks started with ``start_method="spawn"``.

The random initializers use a counter-based generator: each element is a hash of
``(seed, row, column)``, so row ``r`` gets the same values whichever rank computes it.

>>> ids = torch.tensor([5, 7])
>>> torch.equal(normal(0.1)(ids, 4, seed=1)[1], normal(0.1)(torch.tensor([7]), 4, seed=1)[0])
True
>>> from_tensor(torch.arange(6.0).view(3, 2))(torch.tensor([2, 0]), 2, seed=0).tolist()
[[4.0, 5.0], [0.0, 1.0]]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

RowInit = Callable[[Tensor, int, int], Tensor]

_MASK32 = 0xFFFFFFFF


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


def _uniform01(global_ids: Tensor, embedding_dim: int, seed: int, streams: tuple[int, ...]) -> Tensor:
    """Float64 uniforms in (0, 1), ``[streams, rows, dim]``: a pure function of (seed, stream, row, column).

    Row ``r``'s key is the hash of the stream's key and the low 32 bits of ``r``, hashed again
    with its high 32 bits; element ``(r, c)`` is the hash of the row's key and ``c``. All streams
    are computed at once, in place on one int32 buffer (a row of a DynamicEmbedding is
    initialized as its id arrives, so this is on the training path).
    """
    ids = global_ids.to(torch.int64).view(1, -1, 1)
    keys = [_int32(_hash32((seed * 2 + stream) & _MASK32)) for stream in streams]
    keys = torch.tensor(keys, dtype=torch.int32, device=ids.device).view(-1, 1, 1)
    low, high = ids.to(torch.int32), (ids >> 32).to(torch.int32)  # the id's two 32-bit halves
    row_keys = _hash32_(_hash32_(keys ^ low) ^ high)
    cols = torch.arange(embedding_dim, dtype=torch.int32, device=ids.device).view(1, 1, -1)
    return _hash32_(row_keys ^ cols).view(torch.uint32).to(torch.float64).add_(0.5).div_(2.0**32)


def normal(std: float | None = None, mean: float = 0.0) -> RowInit:
    """Normal rows; ``std`` defaults to ``1 / sqrt(embedding_dim)`` (the package's default init)."""
    return partial(_normal, std=std, mean=mean)


def _normal(global_ids: Tensor, embedding_dim: int, seed: int, *, std: float | None, mean: float) -> Tensor:
    scale = std if std is not None else 1.0 / math.sqrt(embedding_dim)
    u1, u2 = _uniform01(global_ids, embedding_dim, seed, streams=(0, 1))
    z = u1.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2.0 * math.pi).cos_())  # Box-Muller
    return z.mul_(scale).add_(mean).to(torch.float32)


def uniform(a: float = -0.1, b: float = 0.1) -> RowInit:
    """Rows uniform in ``[a, b)``."""
    if not a < b:
        raise ValueError(f"Invalid uniform bounds: a={a}, b={b}. HINT: a must be smaller than b.")
    return partial(_uniform, a=a, b=b)


def _uniform(global_ids: Tensor, embedding_dim: int, seed: int, *, a: float, b: float) -> Tensor:
    return (_uniform01(global_ids, embedding_dim, seed, streams=(0,))[0] * (b - a) + a).to(torch.float32)


def zeros() -> RowInit:
    """All-zero rows."""
    return _zeros


def _zeros(global_ids: Tensor, embedding_dim: int, seed: int) -> Tensor:
    return torch.zeros(len(global_ids), embedding_dim, device=global_ids.device)


def from_tensor(table: Tensor) -> RowInit:
    """Rows copied from a full ``[num_embeddings, embedding_dim]`` tensor (a pretrained table).

    The tensor may be memory-mapped (``torch.load(path, mmap=True)``): each rank then reads
    only the rows it owns.
    """
    if table.dim() != 2:
        raise ValueError(f"Invalid pretrained table shape: {tuple(table.shape)}. HINT: pass a 2-D [rows, dim] tensor.")

    return partial(_from_tensor, table=table)


def _from_tensor(global_ids: Tensor, embedding_dim: int, seed: int, *, table: Tensor) -> Tensor:
    if table.shape[1] != embedding_dim:
        raise ValueError(
            f"Pretrained table has dim {table.shape[1]} but the SparseEmbedding has embedding_dim={embedding_dim}."
        )
    return table[global_ids.to(table.device)]


def from_file(path: str, key: str | None = None) -> RowInit:
    """Rows from a file holding a full ``[num_embeddings, embedding_dim]`` table, read lazily.

    ``.npy`` files are memory-mapped with NumPy; anything else is opened with
    ``torch.load(path, mmap=True, weights_only=True)`` and may hold a tensor or a dict of tensors
    (pick one with ``key``: an exported checkpoint's ``"users.weight"``, or a table saved from
    DGL's ``NodeEmbedding`` with ``torch.save(emb.weight, path)``). Each rank reads only the
    rows it owns.
    """
    if str(path).endswith(".npy"):
        import warnings

        import numpy as np

        with warnings.catch_warnings():  # a read-only map is fine: rows are only read
            warnings.simplefilter("ignore", UserWarning)
            return from_tensor(torch.from_numpy(np.load(path, mmap_mode="r")))
    loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    if isinstance(loaded, dict):
        if key is None or key not in loaded:
            raise KeyError(f"{path} holds {sorted(loaded)}; pick the table with key=... (got {key!r}).")
        loaded = loaded[key]
    return from_tensor(loaded)
