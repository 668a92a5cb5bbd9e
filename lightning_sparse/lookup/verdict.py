"""The verdict on a lookup round's input: written into each rank's header, read back as one error on every rank.

A rank never raises on its own input before the round: reading it (:mod:`lightning_sparse.lookup.features`)
and checking its ids against the tables (:func:`write_verdicts`, on the device, no host read)
give an error code and the feature's position in the rank's
:class:`~lightning_sparse.wire.header.LookupHeader`. Every rank receives every rank's header with
the ids, and :func:`check_round` raises the same error on all of them, naming the lowest rank
at fault. So bad input is an exception on every rank, never a hang, and the group stays usable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from lightning_sparse.kernels import uses_triton
from lightning_sparse.lookup.features import ID_DEVICES, ID_SOURCE_DTYPES, ID_SOURCE_TYPES, FeatureIds, Problem, code_name
from lightning_sparse.wire.header import (
    BAD_DTYPE,
    BAD_INPUT,
    BAD_OFFSETS,
    NOT_A_TENSOR,
    OK,
    OUT_OF_RANGE,
    UNREADABLE,
    Headers,
    LookupHeader,
)

if TYPE_CHECKING:
    from lightning_sparse.lookup.units import ShardedTable


class Subject(Protocol):
    """What an error message names: a lookup unit (a table, or a collection) and its features."""

    name: str
    table_of_feature: list[int]

    @property
    def table_list(self) -> list[ShardedTable]: ...
    @property
    def rank(self) -> int: ...
    def describe_feature(self, index: int) -> str: ...


def write_verdicts(fields: Tensor, read: list[FeatureIds], bad_offsets: Tensor | None, tables: list[ShardedTable]) -> None:
    """Write the first feature with an id out of its table's range, or misfit bag offsets, into the header fields.

    On the device: no host read (the header travels with the ids, and is read once there).
    """
    device = fields.device
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    ranges = [torch.stack(torch.aminmax(f.ids)) if len(f.ids) else zero for f in read]
    if len(read) == 1 and bad_offsets is None:  # one feature (a table's lookup): fewer ops, its range always in
        low, high = ranges[0]
        fields[_ID_RANGE] = ranges[0]
        fields[_ERROR] = ((low < 0) | (high >= tables[read[0].table].num_embeddings)) * OUT_OF_RANGE
        return  # ``feature`` and ``dtype`` are the feature's: the caller put them in the header (see header_of)
    ranges = torch.stack(ranges)  # [F, (min, max)]
    # Per feature: its table's size, then (position + 1, dtype code): the + 1 makes "no feature" -1 below.
    facts = torch.tensor([(tables[f.table].num_embeddings, f.index + 1, f.dtype) for f in read], device=device)
    codes = torch.where((ranges[:, 0] < 0) | (ranges[:, 1] >= facts[:, 0]), OUT_OF_RANGE, OK)
    if bad_offsets is not None:
        codes = torch.where((codes == OK) & bad_offsets, BAD_OFFSETS, codes)
    first = (codes != OK).to(torch.int64).argmax().view(1)
    summary = torch.cat([codes.view(-1, 1), facts[:, 1:], ranges], dim=1).index_select(0, first).view(-1)
    summary = summary * (summary[0] != OK) - _FEATURE_SHIFT.to(device)  # all zeros (feature -1) when every feature is fine
    fields.index_copy_(0, _VERDICT_SLOTS.to(device), summary)


_ERROR = LookupHeader.field_index("error")
_ID_RANGE = slice(LookupHeader.field_index("id_min"), LookupHeader.field_index("id_max") + 1)

# Where write_verdicts puts (error, feature, dtype, id_min, id_max) in the header fields, and the shift of ``feature``.
_VERDICT_SLOTS = torch.tensor([LookupHeader.field_index(name) for name in ("error", "feature", "dtype", "id_min", "id_max")])
_FEATURE_SHIFT = torch.tensor([0, 1, 0, 0, 0])


def header_of(
    unit_index: int,
    problem: Problem,
    read: list[FeatureIds],
    bad_offsets: Tensor | None = None,
    kind: int = 0,
    tables: Sequence[ShardedTable] = (),
) -> LookupHeader:
    """This rank's header for a round of lookup unit ``unit_index``: its problem, whether it records (grad mode), its kind.

    ``tables``: the unit's, to say whether the round is this rank's sole lookup of them before their next step
    (``LookupHeader.sole``): none holds a pending lookup and, recording, the round reads every one of them.
    A lookup of one feature also names the feature and its dtype, which :func:`write_verdicts` then leaves alone.
    """
    recording = torch.is_grad_enabled()
    sole = bool(tables) and all(t.pending.empty for t in tables)
    if sole and recording:
        sole = len({f.table for f in read}) == len(tables)
    header = LookupHeader(unit=unit_index, record=int(recording), error=problem.error, feature=problem.feature,
                          detail=problem.detail, dtype=problem.dtype, kind=kind, sole=int(sole))  # fmt: skip
    if len(read) != 1 or bad_offsets is not None or header.error != OK:
        return header
    return replace(header, feature=read[0].index, dtype=read[0].dtype)


def check_one_unit(headers: Headers, name: str) -> None:
    """Raise, on every rank alike, if the active ranks looked up different tables or collections in one round."""
    if len(headers) == 1:  # one rank agrees with itself
        return
    units = headers.active_units()
    if len(units) > 1 or len(headers.active_kinds()) > 1:
        raise RuntimeError(
            f"Ranks looked up different tables in the same round (lookup units {units}, this rank: {name}). "
            f"HINT: every rank must call its SparseEmbeddings and collections in the same order, every step, "
            f"also with empty ids."
        )


def check_round(unit: Subject, headers: Headers, problem: Problem | None = None) -> None:
    """Raise, on every rank alike, if any rank's header shows bad input or another lookup unit in this round.

    ``problem``: this rank's own account of its input; its words are added on this rank. The
    lowest rank with an error code is reported.
    """
    check_one_unit(headers, unit.name)
    rank = headers.first(headers.column("error") != OK)
    if rank is not None:
        own = rank == unit.rank or len(headers) == 1  # a one-rank round's header is this rank's (a gather's, a shared table's)
        raise _error(unit, headers[rank], rank, own, problem.words if own and problem is not None else None)


def _error(unit: Subject, h: LookupHeader, rank: int, own: bool, words: str | None) -> Exception:
    """The exception for rank ``rank``'s header ``h`` (``own``: it is this rank; ``words``: its own account)."""
    where = "this rank" if own else f"rank {rank}"
    subject = unit.describe_feature(h.feature)
    dtype = code_name(h.dtype, ID_SOURCE_DTYPES)
    table = unit.table_list[unit.table_of_feature[h.feature] if 0 <= h.feature < len(unit.table_of_feature) else 0]
    if h.error == NOT_A_TENSOR:
        kind = words or code_name(h.detail, ID_SOURCE_TYPES, "another type")
        return TypeError(f"{subject} got ids of type {kind} on {where}; ids must be a torch.Tensor of integers. "
                         f"HINT: wrap them in torch.tensor(...).")  # fmt: skip
    if h.error == BAD_DTYPE:
        return TypeError(f"{subject} got ids of dtype {dtype} on {where}; ids must be integers (int64, int32, ... or "
                         f"unsigned). HINT: convert them with ids.long().")  # fmt: skip
    if h.error == UNREADABLE:
        detail = f": {words}" if words else ""
        return RuntimeError(f"{subject} could not read the ids on {where} (a {code_name(h.detail, ID_DEVICES)} tensor of "
                            f"dtype {dtype}{detail}). HINT: pass ids that hold data, on the CPU or on the table's device "
                            f"({table.device}).")  # fmt: skip
    if h.error == OUT_OF_RANGE:
        valid = f"valid ids are 0..{table.num_embeddings - 1}"
        if h.id_min < 0 and dtype == "torch.uint64":
            return IndexError(f"{subject} got an id of 2**63 or more (dtype torch.uint64) on {where}; {valid}. "
                              f"HINT: remap ids into range or enlarge the table.")  # fmt: skip
        value = h.id_min if h.id_min < 0 else h.id_max
        return IndexError(f"{subject} got id {value} on {where}; {valid} (num_embeddings={table.num_embeddings}). "
                          f"HINT: remap ids into range or enlarge the table.")  # fmt: skip
    if h.error == BAD_OFFSETS:
        return ValueError(f"{subject} got bag offsets that do not fit its values on {where}: offsets must start at 0, "
                          f"never decrease, and end at len(values). HINT: build them with JaggedIds(values, "
                          f"lengths=...).")  # fmt: skip
    if h.error == BAD_INPUT:
        return ValueError(f"{subject} got input it cannot use on {where}: "
                          f"{words or f'HINT: the error raised on rank {rank} names the problem and its fix'}")  # fmt: skip
    return RuntimeError(f"{unit.name}: rank {rank} reported error code {h.error}.")


def check_gather(unit: Subject, read: list[FeatureIds], problem: Problem) -> FeatureIds:
    """The one feature of a lone table's gather, after raising, as a round would, for bad input.

    A problem of the ids raises; so do ids out of range, checked on the host on a CPU (it costs
    nothing there), and, on a GPU, an earlier lookup's range check once its copy is done (read
    without waiting: :mod:`lightning_sparse.lookup.range_check`).
    """
    if problem.error != OK:
        check_round(unit, Headers.of(header_of(unit.unit_index, problem, read)), problem)
    feature, table = read[0], unit.table_list[0]
    if not uses_triton(table.shard):
        low, high = torch.stack(torch.aminmax(feature.ids)).tolist() if len(feature.ids) else (0, 0)
        raise_if_out_of_range(unit, low, high, feature.dtype)
    else:
        check = table.range_check
        raise_if_out_of_range(unit, *(check.failed(table.num_embeddings) or (0, 0))[:2], check.dtype_code)
    return feature


def raise_if_out_of_range(unit: Subject, low: int, high: int, dtype: int) -> None:
    """Raise the out-of-range error of a one-rank lookup of one table whose ids ranged over ``low..high`` (host values)."""
    if low < 0 or high >= unit.table_list[0].num_embeddings:
        check_round(unit, Headers.of(LookupHeader(error=OUT_OF_RANGE, id_min=low, id_max=high, feature=0, dtype=dtype)))
