"""The lookup header: what each rank tells every rank about its part of a lookup round.

It rides in front of the ids (:func:`lightning_sparse.wire.exchange.ids_to_owners`), so every rank
learns every rank's verdict on its input, and every rank raises the same error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sparse.kernels.host import host_tensor

# Error codes a rank reports in its lookup header; every rank raises the same error for them
# (lightning_sparse/lookup/verdict.py). The header names the feature an error is about (``feature``).
OK, BAD_DTYPE, NOT_A_TENSOR, UNREADABLE, OUT_OF_RANGE, BAD_INPUT, BAD_OFFSETS = 0, 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class LookupHeader:
    """What one rank tells every rank about its part of a lookup round: one row of the header.

    ``count`` differs per destination (the ids sent to it); the other fields are the same in
    every row a rank sends. ``error`` is a code (``OK``, ``BAD_DTYPE``, ``NOT_A_TENSOR``,
    ``UNREADABLE``, ``OUT_OF_RANGE``, ``BAD_INPUT``, ``BAD_OFFSETS``) with an argument in
    ``detail``; ``dtype`` names the dtype of the ids it was given; ``id_min``/``id_max`` are the
    range of the ids (of the feature at fault, or of a lookup's only feature; 0 when there is
    none), for the message; ``unit`` (the lookup unit's index) and ``active`` let a rank that has run out of batches
    answer the others (``serve_lookups``) and catch ranks that call tables out of order;
    ``record`` says the rank records the lookup for a gradient (grad mode is on); ``most`` is
    the largest ``count`` the rank sends to anyone, which sizes the next round; ``feature`` names
    the feature that an error is about (``-1``: none); ``kind`` tells a round
    that looks up rows (0) from one that turns a dynamic table's ids into rows (1) and from one
    that sends a dynamic table's ids and gets their rows back (2, :mod:`lightning_sparse.tables.dynamic`),
    so that a rank serving others knows which round it is in; ``sole`` says the round is the rank's sole
    lookup of its tables before their next optimizer step: it holds no other lookup of them since their last
    step and, if it records, reads every one of them. When every rank says so of a table's last round, the
    step knows without a word that only that round's gradients exist and which tables it counts
    (:func:`lightning_sparse.wire.grads_exchange.grads_to_owners`). ``0``, the default, promises nothing.
    """

    count: int = 0
    error: int = OK
    detail: int = 0
    id_min: int = 0
    id_max: int = 0
    unit: int = -1
    active: int = 1
    record: int = 0
    most: int = 0
    dtype: int = -1
    feature: int = -1
    kind: int = 0
    sole: int = 0

    WIDTH = 13

    def fields(self, device: torch.device, id_range: Tensor | None = None) -> Tensor:
        """The fields after ``count`` as an int64 tensor; ``id_range`` (device ``[min, max]``) fills ``id_min``/``id_max``."""
        fields = host_tensor(self.values()[1:], torch.int64, device)
        if id_range is not None:
            fields[self.field_index("id_min") : self.field_index("id_max") + 1] = id_range
        return fields

    def values(self) -> tuple[int, ...]:
        """All fields in declaration order, ``count`` first (``dataclasses.astuple`` without its deep copies: this is per lookup)."""
        return tuple(getattr(self, name) for name in _FIELD_NAMES)

    @classmethod
    def field_index(cls, name: str) -> int:
        """Where field ``name`` sits in :meth:`fields` (which leaves out ``count``)."""
        return _FIELD_NAMES.index(name) - 1


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(LookupHeader))  # the wire order


class Headers:
    """Every rank's :class:`LookupHeader` of one round, as one host tensor ``[W, WIDTH]`` (``count`` first).

    Questions about all ranks are tensor operations (no Python loop over ranks); ``headers[r]``
    gives rank ``r``'s header as a :class:`LookupHeader`, for the error messages.
    """

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    @classmethod
    def of(cls, header: LookupHeader) -> Headers:
        """One rank's header as the headers of a one-rank round."""
        return cls(torch.tensor([header.values()], dtype=torch.int64))

    def __len__(self) -> int:
        return len(self.tensor)

    def __getitem__(self, rank: int) -> LookupHeader:
        return LookupHeader(*self.tensor[rank].tolist())

    def column(self, name: str) -> Tensor:
        return self.tensor[:, LookupHeader.field_index(name) + 1]

    def first(self, flags: Tensor) -> int | None:
        """The lowest rank whose flag is set, if any."""
        return int(flags.to(torch.int64).argmax()) if bool(flags.any()) else None

    @property
    def records(self) -> bool:
        """Whether any rank records the lookup for a gradient."""
        return bool(self.column("record").any())

    @property
    def sole(self) -> bool:
        """Whether the round is every rank's sole lookup of its tables since their last step (see :class:`LookupHeader`)."""
        return bool(self.column("sole").all())

    def active_units(self) -> list[int]:
        """The lookup units (tables, collections) that the active ranks called in this round, ascending."""
        return torch.unique(self.column("unit")[self.column("active") != 0]).tolist()

    def active_kinds(self) -> list[int]:
        """The kinds of round (``LookupHeader.kind``) that the active ranks are in, ascending."""
        return torch.unique(self.column("kind")[self.column("active") != 0]).tolist()
