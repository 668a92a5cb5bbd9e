"""Every feature of a collection on one GPU in one Triton kernel: ids, or bags pooled by sum or mean, from many tables.

:func:`gather_bags` takes the features as a small host-built table of entries (where each
feature's ids, offsets and weights are, which table it reads, how it pools: :class:`Feature`),
kept on the device while they stay the same (:class:`~lightning_sparse.kernels.host.KeptValues`: a
captured step reads no host memory), and the tables as a :class:`~lightning_sparse.kernels.runs.TableSet`'s
entries. It writes one ``[bags, dim]`` output (an unpooled feature's ids are bags of one), and,
for the gradient, each id's key (``table << shift | row``), bag and weight (``1 / bag length`` for
``"mean"``), which the fused update reads (:func:`~lightning_sparse.kernels.runs.update_rows`). It
checks ids and offsets on the device into ``verdict`` (``[2 + 3 * features]``: see
:mod:`lightning_sparse.kernels.triton_bags`). No host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.kernels.backend import launches
from lightning_sparse.kernels.host import KeptValues

_TILE = 256  # values per program (4 bags of 64): more bags per program hold more feature entries in registers
NUM_WARPS = 2


@dataclass(frozen=True)
class Feature:
    """One feature of a collection as the kernel reads it.

    ``ids``: 1-D int64 on the device; ``offsets``: ``[bags + 1]`` int64, or ``None`` for bags of
    ``per_bag`` ids each (1: unpooled); ``weights``: float32 per id, or ``None``; ``table``: the
    index of its table in the TableSet, of ``rows`` rows; ``mean``: pooled by mean.
    """

    ids: Tensor
    offsets: Tensor | None
    weights: Tensor | None
    per_bag: int
    num_bags: int
    table: int
    rows: int
    mean: bool
    report_as: int = 0  # its place among the collection's features, for the verdict


def tile(dim: int) -> tuple[int, int]:
    """(bags per program, padded dim): few bags, as each bag's feature entry stays in registers (a bag per lane)."""
    block_d = max(16, 1 << (dim - 1).bit_length())
    return max(1, _TILE // block_d), block_d


def verdict_size(num_features: int) -> int:
    """The length of the verdict of a collection of ``num_features`` features."""
    return 2 + 3 * num_features


def gather_bags(
    features: list[Feature], entries: Tensor, table: Tensor, out_dtype: torch.dtype, shift: int, verdict: Tensor, store: bool,
    kept: KeptValues,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """(``[bags, dim]`` output, then with ``store``: each id's key, bag (int32) and weight or ``None``). Triton, no host read.

    ``kept``: the caller's table of features on the device, remade only when the features' tensors change.
    """
    from lightning_sparse.kernels import triton_bags as k

    rows, first_id, first_bag = [], 0, 0
    for f in features:
        entry = dict(ids=f.ids.data_ptr(), offsets=f.offsets.data_ptr() if f.offsets is not None else 0,
                     weights=f.weights.data_ptr() if f.weights is not None else 0, per_bag=f.per_bag, first_id=first_id,
                     first_bag=first_bag, table=f.table, rows=f.rows, mean=int(f.mean), num_ids=len(f.ids),
                     num_bags=f.num_bags, report_as=f.report_as)  # fmt: skip
        rows += [entry[name] for name in k.LAYOUT]
        first_id, first_bag = first_id + len(f.ids), first_bag + f.num_bags
    device, dim = table.device, table.shape[1]
    out = torch.empty(first_bag, dim, dtype=out_dtype, device=device)
    scaled = store and any(f.weights is not None or f.mean for f in features)
    keys = torch.empty(first_id, dtype=torch.int32 if (entries.shape[0] << shift) < 2**31 else torch.int64, device=device)
    sources = torch.empty(first_id, dtype=torch.int32, device=device) if store else None
    scales = torch.empty(first_id, dtype=torch.float32, device=device) if scaled else None
    if first_bag:
        block_b, block_d = tile(dim)
        meta = kept.get(rows, device)
        with launches.launch(device):
            k.gather_bags[(-(-first_bag // block_b),)](
                meta, len(features), first_bag, entries, table, table.stride(0), dim, out, out.stride(0),
                keys if store else None, sources, scales, verdict, shift,
                SEARCH=max(1, (len(features) - 1).bit_length()), STORE=store, SCALED=scaled, BLOCK_B=block_b,
                BLOCK_D=block_d, num_warps=NUM_WARPS, enable_fp_fusion=False,
            )  # fmt: skip
    return out, keys if store else None, sources, scales
