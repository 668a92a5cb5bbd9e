"""Pending row gradients: what a table's lookups received in backward, until a sparse optimizer takes them.

Each differentiable lookup makes a :class:`LookupRecord`, owned by the autograd graph (the
lookup's backward node holds it). Its backward hands the record the gradient of the rows the
lookup returned, and the record joins the table's :class:`PendingGrads`. Nothing is summed in
backward: the optimizer step sums the gradient rows that share a row, as it updates them (one
sort and one segment sum, or the fused update kernel on a GPU). A lookup whose graph is freed
without a backward (evaluation without ``torch.no_grad()``) leaves nothing behind, so memory
stays bounded by what has actually received a gradient.

The table also keeps the :class:`~lightning_sparse.wire.exchange.Route` of its last recorded lookup,
so that the optimizer can send that lookup's gradients back the way its ids came.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from lightning_sparse.kernels.rounding import HALF
from lightning_sparse.wire.exchange import Route


class LookupRecord:
    """One differentiable lookup: its keys, then the gradient of the rows it returned.

    Two kinds, by what the lookup returned:

    * *distinct* (made with ``occurrences``): the lookup engine's record. ``keys`` are the
      distinct rows' owner-major keys, ascending: the order in which the lookup sent its ids
      along ``route``; ``grad`` is ``[len(keys), dim]`` in that order. ``occurrences`` is how
      often each distinct row was read, or a function that counts them when asked (only
      ``duplicate_grads="mean"`` asks).
    * *per id* (no ``occurrences``): a one-process lookup that reads the shard at its ids
      (:func:`lightning_sparse.lookup.outputs.gather`). ``keys`` are the rows of the ids (the lookup's
      own copy: the caller may reuse its ids buffer), repeats included; ``grad`` is
      ``[len(keys), dim]``, one row per id.
    """

    __slots__ = ("route", "keys", "occurrences", "sources", "weights", "tables", "grad", "_pending", "_listed", "__weakref__")

    def __init__(
        self,
        pending: PendingGrads,
        route: Route | None,
        keys: Tensor,
        occurrences: Tensor | Callable[[], Tensor] | None = None,
        bags: Bags | None = None,
    ) -> None:
        self.route, self.keys, self.occurrences = route, keys, occurrences
        # A collection's lookup on one GPU (lightning_sparse.lookup.joint) records its ids' keys over all its tables:
        # key i's gradient is grad[sources[i]] * weights[i] (a bag's), and ``tables`` lists the tables it touched.
        self.sources = bags.sources if bags is not None else None
        self.weights = bags.weights if bags is not None else None
        self.tables = bags.tables if bags is not None else None
        self.grad: Tensor | None = None
        self._pending = pending
        self._listed = False  # in ``pending.received``: its gradient has not been taken or zeroed

    @property
    def distinct(self) -> bool:
        """Whether ``keys`` are distinct (one gradient row per distinct row), as the lookup engine records them."""
        return self.occurrences is not None

    def add_grad(self, grad_output: Tensor) -> None:
        """Called by the lookup's backward with the gradient of its ``[len(keys), dim]`` rows.

        A half-precision gradient is kept in float32 (the update's dtype for half tables).
        """
        if grad_output.dtype in HALF:
            grad_output = grad_output.float()
        if self._listed:  # out of place: the first gradient may be a tensor autograd also gave to others
            self.grad = self.grad + grad_output
        else:  # the first backward, or one after a step or zero_grad took the previous gradient
            self.grad, self._listed = grad_output.contiguous(), True
            self._pending.received.append(self)

    def scale(self, factor: float) -> None:
        """Multiply the received gradient by ``factor`` (out of place, as in :meth:`add_grad`)."""
        self.grad = self.grad * factor

    def hand_over(self) -> None:
        """Taken by a step, which reads the gradient; a later backward lists the record again, with a fresh one."""
        self._listed = False

    def drop(self) -> None:
        """Forget the received gradient: taken by a step, or zeroed. A later backward lists the record again."""
        self.grad, self._listed = None, False

    def counts(self) -> Tensor | None:
        """How often the lookup read each distinct row; ``None`` for a record per id (each gradient row counts once)."""
        if callable(self.occurrences):
            self.occurrences = self.occurrences()
        return self.occurrences


class Bags(NamedTuple):
    """How a collection's round on one GPU reaches its ids' gradients: key ``i``'s is ``grad[sources[i]] * weights[i]``."""

    sources: Tensor  # each id's bag (int32)
    weights: Tensor | None  # each id's weight (a mean's 1 / bag length, or a weighted sum's), None: 1 each
    tables: list[int]  # the tables the round touched


class TakenGrads(NamedTuple):
    """What a step takes of a table's pending gradients (:meth:`PendingGrads.take`)."""

    route: Route | None  # the last recorded lookup's route
    routed: LookupRecord | None  # this rank's record of that lookup, if it received a gradient
    others: list[LookupRecord]  # every other record that received a gradient (none if the step left them)
    received: list[LookupRecord]  # every record that received a gradient, in the order they did
    looked_up: bool  # whether this rank recorded a lookup of the table since the last step (a step counts then)


class PendingGrads:
    """A table's lookups that received a gradient since the last step, and its last recorded route."""

    def __init__(self) -> None:
        self.received: list[LookupRecord] = []
        self.route: Route | None = None
        self.recorded = 0  # lookups recorded since the last step took the table's gradients

    def new_record(
        self,
        route: Route | None,
        keys: Tensor,
        occurrences: Tensor | Callable[[], Tensor] | None = None,
        bags: Bags | None = None,
    ) -> LookupRecord:
        """A record of one lookup (see :class:`LookupRecord`: distinct with ``occurrences``, else one key per id)."""
        self.recorded += 1
        return LookupRecord(self, route, keys, occurrences, bags)

    def note_lookup(self) -> None:
        """Count a lookup of the table that its collection recorded (a joint round on a CPU): the next step counts for it."""
        self.recorded += 1

    @property
    def empty(self) -> bool:
        """Whether nothing waits for the next step: no lookup recorded and no gradient received since the last one.

        A lookup round of an empty table is its sole lookup before that step, unless the rank
        looks it up again (``LookupHeader.sole``).
        """
        return self.recorded == 0 and not self.received

    def keep_route(self, route: Route) -> None:
        """Keep ``route``, the table's latest round that some rank records, for its gradients to go back along."""
        self.route = route

    def grads(self) -> list[Tensor]:
        """The gradient rows received so far, one tensor per lookup (for inspection; see :meth:`scale`).

        Rows are not summed yet: a lookup's record per id has one row per id (see :class:`LookupRecord`).
        """
        return [record.grad for record in self.received]

    def scale(self, factor: float) -> None:
        """Multiply every received gradient by ``factor`` (e.g. to unscale a mixed-precision loss scale)."""
        for record in self.received:
            record.scale(factor)

    def zero_grad(self) -> None:
        """Drop the gradients received so far. Lookups still awaiting their backward are unaffected."""
        for record in self.received:
            record.drop()
        self.received = []

    def take(self, leave_others: bool = False) -> TakenGrads:
        """Hand over everything: the last route, this rank's record of it, the other records with gradients.

        Forgets the received gradients and the route. Every rank of the table's group must take
        at the same point (an optimizer step), so that all agree on which route is in use.
        ``leave_others``: the other records stay pending, for the next step (a step that every
        rank's header told there are none: see :func:`~lightning_sparse.wire.grads_exchange.grads_to_owners`).
        """
        route, routed, others, received = self.route, None, [], self.received
        for record in received:
            if routed is None and route is not None and record.route is route:
                routed = record
            else:
                others.append(record)
        kept = others if leave_others else []
        for record in received:
            if not any(record is k for k in kept):
                record.hand_over()
        looked_up = self.recorded > 0
        self.received, self.route, self.recorded = kept, None, 0
        return TakenGrads(route, routed, [] if leave_others else others, received, looked_up)
