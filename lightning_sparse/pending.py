"""Pending row gradients: what a table's lookups received in backward, until a sparse optimizer takes them.

Each differentiable lookup makes a :class:`LookupRecord`, owned by the autograd graph (the
lookup's backward node holds it). Its backward sums the output's gradient per distinct row (a
segment sum, ``F.embedding_bag``) and hands the record to the table's :class:`PendingGrads`.
With one rank, the forward never deduplicated (nothing is exchanged), so the backward sorts
the ids first. A lookup whose graph is freed without a backward (evaluation without
``torch.no_grad()``) leaves nothing behind, so memory stays bounded by what has actually
received a gradient.

The table also keeps the :class:`~lightning_sparse.exchange.Route` of its last recorded lookup,
so that the optimizer can send that lookup's gradients back the way its ids came.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor

from lightning_sparse.exchange import Route
from lightning_sparse.grouping import SortedKeys
from lightning_sparse.rounding import HALF


class LookupRecord:
    """One differentiable lookup: what its backward needs, then the gradient of each distinct row it read.

    ``keys`` are the distinct rows' owner-major keys, ascending: the order in which the lookup
    sent its ids along ``route``; ``grad`` is ``[len(keys), dim]`` in that order. A lookup that
    did not deduplicate (one rank) is made with its ids as ``keys`` and no ``perm``/``offsets``;
    its first backward sorts them. A lookup that hands its backward the gradient of its distinct
    rows (the lookup engine's) is made with ``occurrences``: how often each distinct row was read,
    or a function that counts them when asked (only ``duplicate_grads="mean"`` asks); its backward
    receives one gradient row per key.
    """

    __slots__ = ("route", "keys", "perm", "offsets", "bound", "occurrences", "grad", "_pending", "_listed", "__weakref__")

    def __init__(
        self,
        pending: PendingGrads,
        route: Route | None,
        keys: Tensor,
        perm: Tensor | None,
        offsets: Tensor | None,
        bound: int | None = None,
        occurrences: Tensor | Callable[[], Tensor] | None = None,
    ) -> None:
        self.route, self.keys, self.perm, self.offsets, self.bound = route, keys, perm, offsets, bound
        self.occurrences = occurrences
        self.grad: Tensor | None = None
        self._pending = pending
        self._listed = False  # in ``pending.received``: its gradient has not been taken or zeroed

    def add_grad(self, grad_output: Tensor) -> None:
        """Called by the lookup's backward with the gradient of its ``[ids, dim]`` output (``[keys, dim]`` for a collection).

        A half-precision gradient is summed in float32 (the update's dtype for half tables).
        """
        if grad_output.dtype in HALF:
            grad_output = grad_output.float()
        if self.occurrences is not None:
            rows = grad_output
        else:
            if self.perm is None:
                runs = SortedKeys(self.keys, self.bound).finish()
                self.keys, self.perm, self.offsets = runs.unique, runs.perm, runs.offsets
            rows = F.embedding_bag(self.perm, grad_output.contiguous(), self.offsets, mode="sum")  # [ids, dim] -> [rows, dim]
        if self._listed:
            self.grad.add_(rows)
        else:  # the first backward, or one after a step or zero_grad took the previous gradient
            self.grad, self._listed = rows, True
            self._pending.received.append(self)

    def counts(self) -> Tensor:
        """How often the lookup read each distinct row."""
        if callable(self.occurrences):
            self.occurrences = self.occurrences()
        if self.occurrences is not None:
            return self.occurrences
        ends = self.offsets.new_empty(len(self.offsets))
        ends[:-1] = self.offsets[1:]
        ends[-1:] = len(self.perm)
        return ends - self.offsets


class PendingGrads:
    """A table's lookups that received a gradient since the last step, and its last recorded route."""

    def __init__(self) -> None:
        self.received: list[LookupRecord] = []
        self.route: Route | None = None

    def new_record(
        self,
        route: Route | None,
        keys: Tensor,
        perm: Tensor | None = None,
        offsets: Tensor | None = None,
        bound: int | None = None,
        occurrences: Tensor | Callable[[], Tensor] | None = None,
    ) -> LookupRecord:
        """A record of one lookup; without ``perm``/``offsets`` its backward sorts ``keys`` (all below ``bound``)."""
        return LookupRecord(self, route, keys, perm, offsets, bound, occurrences)

    def grads(self) -> list[Tensor]:
        """The row gradients received so far (for inspection; see :meth:`scale`)."""
        return [record.grad for record in self.received]

    def scale(self, factor: float) -> None:
        """Multiply every received gradient by ``factor`` (e.g. to unscale a mixed-precision loss scale)."""
        for record in self.received:
            record.grad.mul_(factor)

    def zero_grad(self) -> None:
        """Drop the gradients received so far. Lookups still awaiting their backward are unaffected."""
        for record in self.received:
            record.grad, record._listed = None, False
        self.received = []

    def take(self) -> tuple[Route | None, LookupRecord | None, list[LookupRecord]]:
        """Hand over everything: (last route, this rank's record of it, the other records with gradients).

        Forgets the received gradients and the route. Every rank of the table's group must take
        at the same point (an optimizer step), so that all agree on which route is in use.
        """
        route, routed, others = self.route, None, []
        for record in self.received:
            record._listed = False
            if routed is None and route is not None and record.route is route:
                routed = record
            else:
                others.append(record)
        self.received, self.route = [], None
        return route, routed, others
