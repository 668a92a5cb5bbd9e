"""Ids ahead: a batch's stage 1 issued before its lookup, while the batch before it trains (a pipelined lookup).

The ids of a lookup do not depend on the tables' values, so their all-to-all (stage 1,
:func:`~lightning_sparse.wire.exchange.send_ids`) can be issued as soon as the batch is known, and
waited for at its lookup (:meth:`~lightning_sparse.wire.exchange.IdsSent.route`), where the headers are
read and checked as in any round; the rows (stage 2) move only then, after the previous step's update.
TorchRec's ``TrainPipelineSparseDist`` does the same with its input distribution.

A stage issued ahead is in flight while the batch before it runs its own rounds, its grads round and
DDP's all-reduce. It goes over the *ahead group*: a second process group of the same ranks
(:func:`ahead_peers`), so that nothing else queues behind it (NCCL runs one group's collectives
in order on one stream) and its room (``exchange._ROOM``, keyed by group) follows only the rounds
issued ahead. Every rank issues and finishes the rounds ahead in the same order, as with any collective.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from lightning_sparse.wire.alltoall import Peers

ProcessGroup = dist.ProcessGroup

# Each process group's ahead group (the default group under ``dist.group.WORLD``); both die with the tables' group.
_AHEAD: weakref.WeakKeyDictionary[ProcessGroup, ProcessGroup] = weakref.WeakKeyDictionary()


def ahead_peers(peers: Peers, timeout: timedelta | None = None) -> Peers:
    """``peers`` over their ahead group: a process group of the same ranks for the rounds issued ahead.

    Made at the first call for a group with ``torch.distributed.new_group`` (same backend; ``timeout``
    defaults to torch's for the backend: pass the default group's), which every rank of the default
    group must call: so the tables' group must hold every rank (not 2-D sharding's groups). With one rank,
    ``peers`` as they are. Collective at the first call for a group: every rank must call it.
    """
    if peers.alone:
        return peers
    group = peers.group if peers.group is not None else dist.group.WORLD
    ahead = _AHEAD.get(group)
    if ahead is None:  # the first round ahead over this group: check it and make its ahead group (once, not per batch)
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) != dist.get_world_size():
            raise ValueError(
                f"A pipelined lookup needs tables sharded over all {dist.get_world_size()} ranks; these are sharded over "
                f"ranks {ranks}. HINT: leave sharding_group_size unset to pipeline, or iterate the loader unpipelined."
            )
        ahead = _AHEAD[group] = dist.new_group(ranks, backend=dist.get_backend(group), timeout=timeout)
    return replace(peers, group=ahead)


class Prefetching(Protocol):
    """A table's or a collection's lookup path, as :class:`Pipeline` sends its rounds ahead (the engine's ``Round``)."""

    def prefetch(self, inputs: Any, timeout: timedelta | None = None) -> bool: ...


class LookupUnit(Protocol):
    """A :class:`~lightning_sparse.SparseEmbedding` or a :class:`~lightning_sparse.SparseEmbeddingCollection`."""

    name: str

    def materialize(self) -> Any: ...


class Pipeline:
    """Sends each batch's ids to their owners ahead of its lookups: batch N+1's while batch N trains.

    ``inputs(batch)`` says which part of a batch each table or collection looks up, as a mapping
    ``{table_or_collection: ids_or_features}`` holding the very objects the training step will pass
    (``batch["ids"]``, not a copy): a lookup whose inputs are those of a round sent ahead takes it from
    there (:meth:`~lightning_sparse.lookup.engine.Round.prefetch`), any other runs unpipelined.
    ``issued`` counts the batches sent ahead; each table's and collection's ``stats.rounds_ahead`` counts
    the rounds that took theirs. Collective: every rank must send the same units' batches ahead in the same order.
    """

    def __init__(self, inputs: Callable[[Any], Mapping[LookupUnit, Any]], timeout: timedelta | None = None) -> None:
        if not callable(inputs):
            raise TypeError(
                f"Invalid inputs: {inputs!r}. HINT: pass a function of a batch, e.g. inputs=lambda b: {{model.emb: b['ids']}}."
            )
        self.inputs, self.timeout, self.issued = inputs, timeout, 0

    def send_ahead(self, batch: Any) -> None:
        """Issue stage 1 of every lookup round of ``batch`` (see the class docstring). Collective: every rank must call it."""
        given = self.inputs(batch)
        if not isinstance(given, Mapping):
            raise TypeError(f"The pipeline's inputs gave {type(given).__name__}, not a mapping. HINT: return "
                            f"{{table_or_collection: ids_or_features}}, e.g. {{model.emb: batch['ids']}}.")  # fmt: skip
        for unit, unit_inputs in given.items():
            tables = getattr(unit, "table_list", [unit])
            if any(getattr(table, "resolves_ids", False) for table in tables):
                raise ValueError(f"{unit.name} holds a DynamicEmbedding, whose ids find their slots at the lookup; its "
                                 f"rounds cannot run ahead. HINT: leave it out of the pipeline's inputs.")  # fmt: skip
            lookups = unit.materialize().lookups
            if hasattr(lookups, "prefetch"):  # a round (a lone table's gather and one GPU's collection send nothing)
                lookups.prefetch(unit_inputs, self.timeout)
        self.issued += 1

    def iterate(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s batches, each one's ids sent ahead before the batch before it is handed out."""
        iterator = iter(loader)
        batch = next(iterator, _END)
        if batch is not _END:
            self.send_ahead(batch)
        while batch is not _END:
            following = next(iterator, _END)
            if following is not _END:
                self.send_ahead(following)
            yield batch
            batch = following

    def moved_ahead(self, batch: Any, move: Callable[..., Any], following: Any | None, *args: Any) -> Any:
        """``move(batch, *args)``, after sending ``following`` (moved now) ahead; a batch sent ahead is moved once.

        For a loop that moves each batch to the device as it takes it (the Trainer's ``batch_to_device``): the
        batch sent ahead must come back as the same object to be moved no more (then its lookups take their rounds).
        """
        if self._raw is batch:
            moved, self._raw, self._moved = self._moved, None, None
        else:  # a batch not sent ahead (the first, or one in between, e.g. a validation batch)
            moved = move(batch, *args)
        if following is not None:
            self._raw, self._moved = following, move(following, *args)
            self.send_ahead(self._moved)
        return moved

    _raw: Any = None  # the last batch sent ahead by moved_ahead, as given, and as moved
    _moved: Any = None


_END = object()


def pipelined(
    loader: Iterable[Any], inputs: Callable[[Any], Mapping[LookupUnit, Any]], *, timeout: timedelta | None = None
) -> Iterator[Any]:
    """Iterate ``loader`` with each batch's ids sent to their owners while the batch before it trains.

    ``inputs(batch)`` returns ``{table_or_collection: ids_or_features}``: the objects the training step
    passes to each (see :class:`Pipeline`). Training is bitwise what it is unpipelined. Collective:
    every rank must iterate its loader this way, with as many batches. ``timeout``: the ahead group's
    (:func:`ahead_peers`; pass the default group's).
    """
    return Pipeline(inputs, timeout).iterate(loader)
