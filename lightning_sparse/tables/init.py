"""Row initializers: initial values that depend only on ``(seed, global row id)``.

A ``RowInit`` is any callable ``init(global_ids, embedding_dim, seed) -> Tensor`` that returns
``[len(global_ids), embedding_dim]`` values for the given rows. Because every rank asks only for
the rows it owns, the same ``seed`` gives the same logical table on 1, 2 or 3 ranks and under
both sharding schemes, and no rank ever builds the whole table. The initializers made here
pickle (``functools.partial`` of module functions), so a module holding tables can be sent to
ranks started with ``start_method="spawn"``.

The random initializers use a counter-based generator: each element is a hash of
``(seed, row, column)``, so row ``r`` gets the same values whichever rank computes it.
:func:`normal` turns pairs of 32-bit uniforms into pairs of normals (Box-Muller in float64,
rounded to float32). A :class:`~lightning_sparse.tables.dynamic.DynamicEmbedding`
initializes rows as ids arrive, so this is on its training path and kept to a few tensor ops.
(``normal`` used two uniforms per value before the package's dynamic tables: the same seed now
gives other values; tables saved earlier load as saved.)

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

from lightning_sparse.kernels import computes_in_triton, gpu_path
from lightning_sparse.kernels import rows as kernel_rows
from lightning_sparse.kernels.rows import hashes, uniforms
from lightning_sparse.tables.placement import empty_rows

RowInit = Callable[[Tensor, int, int], Tensor]

# Elements initialized per chunk. On a CPU the int64/float64 hash temporaries of a chunk stay in
# cache (10x faster for wide tables than one pass). On the GPU's path a chunk only bounds their
# memory (16M elements: 128 MiB a temporary), so a batch's new rows are one chunk (one launch).
_CHUNK_ELEMENTS, _GPU_CHUNK_ELEMENTS = 1 << 16, 1 << 24


@torch.no_grad()
def init_rows(init: RowInit, global_ids: Tensor, embedding_dim: int, seed: int, like: Tensor, name: str) -> Tensor:
    """The rows ``global_ids`` start from under ``init``, in the dtype and on the device of ``like``, a chunk at a time.

    ``name`` names the table when ``init`` returns a wrong shape.
    """
    elements = _GPU_CHUNK_ELEMENTS if gpu_path(global_ids) else _CHUNK_ELEMENTS
    rows_per_chunk = max(1, elements // embedding_dim)

    def chunk(ids: Tensor) -> Tensor:
        rows = init(ids, embedding_dim, seed)
        if tuple(rows.shape) != (len(ids), embedding_dim):
            raise ValueError(
                f"init for {name} returned shape {tuple(rows.shape)} for {len(ids)} ids. "
                f"HINT: init(global_ids, embedding_dim, seed) must return [len(global_ids), embedding_dim]."
            )
        return rows

    if len(global_ids) <= rows_per_chunk:  # one chunk: no copy
        return chunk(global_ids).to(device=like.device, dtype=like.dtype)
    out = empty_rows((len(global_ids), embedding_dim), like.dtype, like.device)
    for start in range(0, len(global_ids), rows_per_chunk):
        ids = global_ids[start : start + rows_per_chunk]
        out[start : start + len(ids)] = chunk(ids)
    return out


def _uniform01(global_ids: Tensor, embedding_dim: int, seed: int) -> Tensor:
    """Float64 uniforms in (0, 1), ``[rows, dim]``, from the 32 bits of :func:`hashes`."""
    bits = hashes(global_ids, embedding_dim, seed)[0]
    return bits.view(torch.uint32).to(torch.float64).add_(0.5).div_(2.0**32)


def normal(std: float | None = None, mean: float = 0.0) -> RowInit:
    """Normal rows; ``std`` defaults to ``1 / sqrt(embedding_dim)`` (the package's default init)."""
    return partial(_normal, std=std, mean=mean)


def _normal(global_ids: Tensor, embedding_dim: int, seed: int, *, std: float | None, mean: float) -> Tensor:
    """Box-Muller on 32-bit uniforms, both outputs of each pair: columns ``c`` and ``half + c`` share ``(u1, u2)``.

    In float64, rounded to float32 at the end: CPU and CUDA math libraries agree far below a
    float32 ulp there (their float32 functions, and ``erfinv`` in float64, do not).
    """
    scale = std if std is not None else 1.0 / math.sqrt(embedding_dim)
    if computes_in_triton(global_ids):  # on a GPU: one kernel instead of about 30 ops (new rows are on a dynamic table's step)
        return kernel_rows.normal(global_ids, embedding_dim, seed, scale, mean)
    half = -(-embedding_dim // 2)
    u1, u2 = uniforms(global_ids, half, seed, blocks=2)  # in (0, 1)
    radius = u1.log_().mul_(-2.0 * scale * scale).sqrt_()
    angle = u2.mul_(2.0 * math.pi)
    z = torch.cat([torch.cos(angle).mul_(radius), angle.sin_().mul_(radius)], dim=1)
    z = z[:, :embedding_dim] if 2 * half != embedding_dim else z
    return (z.add_(mean) if mean else z).to(torch.float32)


def uniform(a: float = -0.1, b: float = 0.1) -> RowInit:
    """Rows uniform in ``[a, b)``."""
    if not a < b:
        raise ValueError(f"Invalid uniform bounds: a={a}, b={b}. HINT: a must be smaller than b.")
    return partial(_uniform, a=a, b=b)


def _uniform(global_ids: Tensor, embedding_dim: int, seed: int, *, a: float, b: float) -> Tensor:
    return (_uniform01(global_ids, embedding_dim, seed) * (b - a) + a).to(torch.float32)


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
        raise ValueError(f"Pretrained table has dim {table.shape[1]} but the SparseEmbedding has embedding_dim={embedding_dim}. "
                         f"HINT: build the SparseEmbedding with embedding_dim={table.shape[1]}.")  # fmt: skip
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
            raise KeyError(f"{path} holds {sorted(loaded)}, not {key!r}. HINT: pick the table with from_file(path, key=...).")
        loaded = loaded[key]
    return from_tensor(loaded)
