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

import itertools
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


def torch_gather_bags(
    features: list[Feature], shards: list[Tensor], shift: int, store: bool
) -> tuple[list[Tensor], Tensor | None, Tensor | None, Tensor | None] | None:  # fmt: skip
    """What :func:`gather_bags` computes, by torch ops on CPU tensors: each feature's output, then with ``store`` each id's
    key, bag (int64) and weight or ``None``; ``None`` if an id is out of range or offsets do not fit (one host read).

    ``shards``: the float32 tables. One gather per feature (``index_select``, or ``F.embedding_bag`` as the engine
    pools); the check of the ids and offsets, the keys, bags and weights are computed for all features at once. A bag's
    weight is its id's weight, or ``1 / bag length`` for ``"mean"``, in float32, as the engine's backward scales it
    (:mod:`lightning_sparse.lookup.pooling`).
    """
    import torch.nn.functional as F

    lengths, num_bags = torch.tensor([len(f.ids) for f in features]), [f.num_bags for f in features]
    ids = features[0].ids if len(features) == 1 else torch.cat([f.ids for f in features])
    rows = torch.repeat_interleave(torch.tensor([f.rows for f in features]), lengths, output_size=len(ids))
    bad = ((ids < 0) | (ids >= rows)).any()
    bag_lengths = torch.repeat_interleave(torch.tensor([f.per_bag for f in features] + [0]), torch.tensor(num_bags + [1]))
    jagged = [
        (f, first_bag) for f, first_bag in zip(features, itertools.accumulate(num_bags, initial=0)) if f.offsets is not None
    ]
    if jagged:  # each feature's offsets rise from 0 to its number of ids; their steps are its bags' lengths
        offsets = torch.cat([f.offsets for f, _ in jagged]) if len(jagged) > 1 else jagged[0][0].offsets
        starts = [sum(f.num_bags + 1 for f, _ in jagged[:j]) for j in range(len(jagged))]
        ends = [e for (f, _), start in zip(jagged, starts) for e in (start, start + f.num_bags)]
        steps = offsets[1:] - offsets[:-1]
        bad = (
            bad
            | offsets.index_select(0, torch.tensor(ends)).ne(torch.tensor([e for f, _ in jagged for e in (0, len(f.ids))])).any()
        )
        # Step k of jagged feature j (from its start) is the length of bag first_bag + k; the steps between two
        # features go to the spare last entry.
        shifts = [
            d
            for (f, first_bag), start in zip(jagged, starts)
            for d in (first_bag - start, len(bag_lengths) - 1 - start - f.num_bags)
        ]
        repeats = torch.tensor([r for f, _ in jagged for r in (f.num_bags, 1)][:-1])
        to = torch.arange(len(steps)) + torch.repeat_interleave(torch.tensor(shifts[:-1]), repeats, output_size=len(steps))
        bag_lengths.index_copy_(0, to, steps)
        bad = bad | (bag_lengths[:-1] < 0).any()
    if bool(bad):
        return None
    out = []
    for f in features:
        shard, mode = shards[f.table], "mean" if f.mean else "sum"
        if f.offsets is not None:
            out.append(
                F.embedding_bag(f.ids, shard, f.offsets, mode=mode, per_sample_weights=f.weights, include_last_offset=True)
            )
        elif f.per_bag == 1 and f.weights is None:  # a bag of one is its row
            out.append(shard.index_select(0, f.ids))
        elif f.per_bag == 0:  # bags of no id: zeros
            out.append(shard.new_zeros(f.num_bags, shard.shape[1]))
        else:
            out.append(F.embedding_bag(f.ids.view(-1, f.per_bag), shard, mode=mode, per_sample_weights=f.weights))
    if not store:
        return out, None, None, None
    keys = ids + torch.repeat_interleave(torch.tensor([f.table << shift for f in features]), lengths, output_size=len(ids))
    if (len(shards) << shift) < 2**31:
        keys = keys.to(torch.int32)
    bag_lengths = bag_lengths[:-1]
    sources = torch.repeat_interleave(torch.arange(len(bag_lengths)), bag_lengths, output_size=len(ids))
    scales = None
    if any(f.mean or f.weights is not None for f in features):
        means = torch.repeat_interleave(
            torch.tensor([f.mean for f in features]), torch.tensor(num_bags), output_size=len(bag_lengths)
        )
        scales = torch.where(means, 1 / bag_lengths.clamp(min=1).to(torch.float32), 1.0).index_select(0, sources)
        first_id = 0
        for f in features:
            if f.weights is not None:
                scales[first_id : first_id + len(f.ids)] = f.weights
            first_id += len(f.ids)
    return out, keys, sources, scales
