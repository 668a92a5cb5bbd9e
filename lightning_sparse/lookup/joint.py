"""One rank, many tables: every feature of a collection in one kernel (on a CPU, one gather each), one record, one update.

A collection's lookup on one GPU reads all its features at once (:func:`lightning_sparse.kernels.bags.gather_bags`:
ids or bags, sum or mean, from every table), and records one gradient for the whole round: each
id's key over all the tables (``table << shift | row``), its bag and its weight, and the bags'
gradient as backward gives it. The optimizer step then sorts the keys once and updates every
table in one fused launch (:mod:`lightning_sparse.optim.joint`). So the step's kernels do not
grow with the number of tables, as FBGEMM's table-batched embeddings do, without moving the
tables into one buffer: each table keeps its own shard (checkpoints, resharding and ``state_dict``
are untouched), and the kernels reach the tables through their addresses.

It takes a round when the collection is on one GPU (or Triton's interpreter), and every feature is
well-formed as the host sees it: tables of one dim, dtype and output dtype in one gather; others in
parts of one kind each (:class:`~lightning_sparse.lookup.units.Part`, a lookup unit of its own to
the gather and the step), a dynamic table's ids turned into its rows first
(:func:`~lightning_sparse.lookup.units.resolve_dynamic_ids`); any other round goes through the lookup engine
(:mod:`lightning_sparse.lookup.engine`), which names the problem. Ids out of range and offsets that do not fit are
found on the device and raised as for one table (:mod:`lightning_sparse.lookup.range_check`): at the next step or
lookup of the collection.

On a CPU (float32 tables) the same round runs by torch ops (:func:`~lightning_sparse.kernels.bags.torch_gather_bags`):
one ``index_select`` or ``F.embedding_bag`` per feature, the check and the record for all features at once; input
that does not fit goes to the engine at once, which raises naming it, as on a CPU it always has. Its step:
:mod:`lightning_sparse.optim.joint_cpu`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_sparse.kernels import uses_triton
from lightning_sparse.kernels.bags import Feature, gather_bags, torch_gather_bags, verdict_size
from lightning_sparse.kernels.host import KeptValues
from lightning_sparse.kernels.rounding import HALF
from lightning_sparse.kernels.runs import RuleState, table_entries
from lightning_sparse.lookup.engine import Round
from lightning_sparse.lookup.features import ID_DTYPES, ID_SOURCE_DTYPES, JaggedIds, as_feature_dict, code_of
from lightning_sparse.lookup.pending import Bags
from lightning_sparse.lookup.units import ReadFeature, parts_of, resolve_dynamic_ids
from lightning_sparse.lookup.verdict import check_round
from lightning_sparse.wire.header import Headers, LookupHeader

if TYPE_CHECKING:
    from lightning_sparse.lookup.pending import PendingGrads
    from lightning_sparse.lookup.range_check import RangeCheck
    from lightning_sparse.lookup.units import ShardedTable
    from lightning_sparse.wire.exchange import Route


class SparseEmbeddingCollection(Protocol):
    """What this module reads of a collection (:class:`~lightning_sparse.SparseEmbeddingCollection` is one)."""

    name: str
    feature_names: list[str]
    table_of_feature: list[int]
    feature_pooling: list[str]
    pending: PendingGrads
    range_check: RangeCheck

    @property
    def table_list(self) -> list[ShardedTable]: ...
    @property
    def rank(self) -> int: ...
    def describe_feature(self, index: int) -> str: ...


# The collections that hold each table, weakly both ways: a step finds a table's collections' rounds on one GPU here.
_HOLDERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet] = weakref.WeakKeyDictionary()


def hold(collection: SparseEmbeddingCollection) -> None:
    """Note that ``collection`` holds its tables (it calls this when made, or copied)."""
    for table in collection.table_list:
        _HOLDERS.setdefault(table, weakref.WeakSet()).add(collection)


def holders(table: ShardedTable) -> list[SparseEmbeddingCollection]:
    """The collections that hold ``table`` now."""
    return [unit for unit in _HOLDERS.get(table, ()) if any(t is table for t in unit.table_list)]


def fits(collection: SparseEmbeddingCollection) -> bool:
    """Whether the collection's rounds can take this path (its tables; each round's input is checked by :func:`read`).

    One rank. With Triton: no stochastically rounded half table (tables of several dims or dtypes go in parts, dynamic
    tables' ids turn into rows first: :class:`Joint`); on a CPU one dim and dtype, float32 only, no dynamic table (the
    per-table path's arithmetic, op for op, is float32's there).
    """
    tables = collection.table_list
    first = tables[0]
    if first.world_size != 1 or first.replicas != 1:
        return False
    if uses_triton(first.shard):
        return not any(t.dtype in HALF and t.stochastic_rounding is not False for t in tables)
    if any(t.resolves_ids for t in tables) or len({(t.embedding_dim, t.dtype, t.output_dtype or t.dtype) for t in tables}) != 1:
        return False
    return first.device.type == "cpu" and first.dtype == (first.output_dtype or first.dtype) == torch.float32


def key_shift(collection: SparseEmbeddingCollection) -> int:
    """Bits of a row in a key: keys are ``table << shift | row``."""
    return max(t.shard.shape[0] for t in collection.table_list).bit_length()


def read(collection: SparseEmbeddingCollection, features: Mapping[str, Any]) -> list[ReadFeature] | None:
    """Each given feature as the kernel reads it; ``None`` for anything the engine must judge (it names the problem)."""
    device = collection.table_list[0].device
    read_in = []
    for name, given in features.items():
        if name not in collection.feature_names:
            return None
        index = collection.feature_names.index(name)
        t, mode = collection.table_of_feature[index], collection.feature_pooling[index]
        table = collection.table_list[t]
        jagged = given if isinstance(given, JaggedIds) else None
        ids = jagged.values if jagged is not None else given
        if not isinstance(ids, Tensor) or ids.dtype not in ID_DTYPES or ids.device != device:
            return None
        if jagged is None:
            if mode != "none" and ids.dim() != 2:
                return None
            bags, per_bag, offsets = (ids.numel(), 1, None) if mode == "none" else (ids.shape[0], ids.shape[1], None)
            shape = (*ids.shape, table.embedding_dim) if mode == "none" else (ids.shape[0], table.embedding_dim)
        else:
            if ids.dim() != 1 or (jagged.weights is not None and (mode != "sum" or jagged.weights.requires_grad)):
                return None
            if mode == "none":
                bags, per_bag, offsets = len(ids), 1, None
            else:
                offsets = _offsets(jagged, device)
                if offsets is None:
                    return None
                bags, per_bag = len(offsets) - 1, 0
            shape = (bags, table.embedding_dim)
        weights = jagged.weights if jagged is not None else None
        if weights is not None:
            if weights.shape != ids.shape or not weights.dtype.is_floating_point or weights.device != device:
                return None
            weights = weights.to(torch.float32).contiguous()
        flat = ids.reshape(-1)
        flat = flat.view(torch.int64) if flat.dtype == torch.uint64 else flat.to(torch.int64)
        feature = Feature(flat.contiguous(), offsets, weights, per_bag, bags, t, table.shard.shape[0], mode == "mean", index)
        read_in.append(ReadFeature(name, feature, shape, code_of(ids.dtype, ID_SOURCE_DTYPES)))
    return read_in


def _offsets(jagged: JaggedIds, device: torch.device) -> Tensor | None:
    structure = jagged.offsets if jagged.offsets is not None else jagged.lengths
    if structure.dim() != 1 or structure.dtype not in ID_DTYPES or structure.device != device:
        return None
    if jagged.offsets is not None:
        return None if len(structure) == 0 else structure.to(torch.int64).contiguous()
    offsets = structure.new_zeros(len(structure) + 1, dtype=torch.int64)
    torch.cumsum(structure, 0, dtype=torch.int64, out=offsets[1:])
    return offsets


class _RecordedBags(torch.autograd.Function):
    """Every feature's output (views of one ``[bags, dim]`` tensor); backward hands the bags' gradient to the round's record."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, out: Tensor | list[Tensor], record: Any, splits: list[int], shapes: list[tuple]
                ) -> tuple[Tensor, ...]:  # fmt: skip
        ctx.record, ctx.splits = record, splits
        pieces = out.split(splits) if isinstance(out, Tensor) else out  # one tensor, or (on a CPU) one per feature
        return tuple(piece.view(*shape) for piece, shape in zip(pieces, shapes))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:
        dim = next(g for g in grads if g is not None).shape[-1]
        pieces = [g.reshape(-1, dim) if g is not None else grads_zeros(n, dim, grads) for g, n in zip(grads, ctx.splits)]
        ctx.record.add_grad(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        return None, None, None, None, None


def grads_zeros(rows: int, dim: int, grads: tuple[Tensor | None, ...]) -> Tensor:
    """The gradient of an output that got none: zeros, like the others."""
    like = next(g for g in grads if g is not None)
    return like.new_zeros(rows, dim)


def gather_features(collection: SparseEmbeddingCollection, read_in: list[ReadFeature], kept: KeptDeviceTables
                    ) -> dict[str, Tensor] | None:  # fmt: skip
    """The round on one GPU of what :func:`read` read; ``None`` if it cannot (the engine does). ``kept``: its device tables."""
    if not uses_triton(collection.table_list[0].shard):
        return _gather_on_cpu(collection, read_in) if read_in else None
    tables, check = collection.table_list, collection.range_check
    first, shift = tables[0], key_shift(collection)
    raise_failed(collection, check.failed(1))
    verdict = check.verdict(first.device, verdict_size(len(collection.feature_names)))
    recording = torch.is_grad_enabled()
    out, keys, sources, scales = gather_bags([r.feature for r in read_in], _gather_entries(collection, kept.entries),
                                             first.shard, first.output_dtype or first.dtype, shift, verdict,
                                             store=recording, kept=kept.features)  # fmt: skip
    check.sent({r.feature.report_as: r.dtype_code for r in read_in})
    for r in read_in:
        tables[r.feature.table].stats.ids_looked_up += len(r.feature.ids)
    splits, shapes = [r.feature.num_bags for r in read_in], [r.shape for r in read_in]
    if not recording:
        raise_failed(collection, check.failed(1, wait=True))
        return {r.name: piece.view(*r.shape) for r, piece in zip(read_in, out.split(splits))}
    touched = sorted({r.feature.table for r in read_in if len(r.feature.ids)})
    record = collection.pending.new_record(None, keys, bags=Bags(sources, scales, touched))
    token = torch.empty(0, device=first.device, requires_grad=True)
    outputs = _RecordedBags.apply(token, out, record, splits, shapes)
    return {r.name: output for r, output in zip(read_in, outputs)}


def _gather_on_cpu(collection: SparseEmbeddingCollection, read_in: list[ReadFeature]) -> dict[str, Tensor] | None:
    """The round on a CPU, as :func:`gather_features` (``None`` for bad input: the engine names it, at once).

    The outputs come in the collection's order of features, as the engine gives them on a CPU.
    """
    tables, recording = collection.table_list, torch.is_grad_enabled()
    read_in = sorted(read_in, key=lambda r: r.feature.report_as)
    gathered = torch_gather_bags([r.feature for r in read_in], [t.shard for t in tables], key_shift(collection), recording)
    if gathered is None:
        return None
    out, keys, sources, scales = gathered
    for r in read_in:
        tables[r.feature.table].stats.ids_looked_up += len(r.feature.ids)
    if not recording:
        return {r.name: piece.view(*r.shape) for r, piece in zip(read_in, out)}
    touched = sorted({r.feature.table for r in read_in if len(r.feature.ids)})
    record = collection.pending.new_record(None, keys, bags=Bags(sources, scales, touched))
    for t in {r.feature.table for r in read_in}:  # each table's step counts it, as for the engine's round
        tables[t].pending.note_lookup()
    token = torch.empty(0, requires_grad=True)
    outputs = _RecordedBags.apply(token, out, record, [r.feature.num_bags for r in read_in], [r.shape for r in read_in])
    return {r.name: output for r, output in zip(read_in, outputs)}


def _gather_entries(collection: SparseEmbeddingCollection, kept: KeptValues) -> Tensor:
    """The tables' addresses for the gather (a TableSet's entries), kept while the shards stay where they are."""
    shards, none = [t.shard for t in collection.table_list], [None] * len(collection.table_list)
    return table_entries(shards, [RuleState()] * len(shards), none, [(0.0, 0.0, 1.0)] * len(shards), kept=kept)


class KeptDeviceTables:
    """A collection's device tensors of host values, kept across rounds: what a captured round reads (no host pointer)."""

    def __init__(self) -> None:
        self.features = KeptValues()  # the features' table (where each feature's ids, offsets and weights are)
        self.entries = KeptValues()  # the tables' addresses


def raise_failed(collection: SparseEmbeddingCollection, failed: list[int] | None) -> None:
    """Raise, as the engine would, for the first feature a collection's verdict shows bad input for."""
    if failed is None:
        return
    for index in range(len(collection.feature_names)):
        code, low, high = failed[2 + 3 * index : 5 + 3 * index]
        if code:
            dtype = collection.range_check.dtype_code.get(index, -1)  # a collection's: per feature
            check_round(collection, Headers.of(LookupHeader(error=code, feature=index, id_min=low, id_max=high, dtype=dtype)))


class Joint:
    """A collection's lookups in one process (the path a collection that :func:`fits` takes): one gather per part.

    Every feature is read first, then dynamic tables admit ids: a round whose input the kernel cannot judge
    (see :func:`read`) goes through the engine's round instead (``fallback``), which names the problem.
    """

    def __init__(self, collection: SparseEmbeddingCollection) -> None:
        self.collection, self.fallback, self.parts = collection, Round(collection), parts_of(collection)
        for part in self.parts:
            hold(part)  # the optimizer finds a part's rounds through its tables
        self.kept = [KeptDeviceTables() for _ in self.parts]

    def lookup(self, features: Any) -> dict[str, Tensor]:
        given = as_feature_dict(features)
        out = self._gather(given) if given is not None else None
        return out if out is not None else self.fallback.lookup(features)

    def _gather(self, given: dict[str, Any]) -> dict[str, Tensor] | None:
        if len(self.parts) == 1:
            read_in = read(self.collection, given)
            return None if read_in is None else gather_features(self.collection, resolve_dynamic_ids(self.collection, read_in),
                                                                  self.kept[0])  # fmt: skip
        names = self.collection.feature_names
        reads = [read(part, {n: v for n, v in given.items() if n in part.feature_names}) for part in self.parts]
        if any(name not in names for name in given) or any(read_in is None for read_in in reads):
            return None
        out: dict[str, Tensor] = {}
        for part, read_in, kept in zip(self.parts, reads, self.kept):
            if resolve_dynamic_ids(part, read_in):
                out.update(gather_features(part, read_in, kept))
            else:  # no round of its own: an earlier round's bad input is raised at this lookup all the same
                raise_failed(part, part.range_check.failed(1))
        return {name: out[name] for name in names if name in out}  # the engine's order

    def serve(self, route: Route) -> None:
        self.fallback.serve(route)
