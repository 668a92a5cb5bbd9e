"""SparseStatsMonitor: what the sparse path moves and spends per optimizer step, in any logger."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_sparse.lightning.strategy import SparseDDPStrategy
from lightning_sparse.tables.dynamic import DynamicEmbedding
from lightning_sparse.wire.alltoall import ExchangeStats


class SparseStatsMonitor(Callback):
    """Logs what the sparse path did per optimizer step, reduced over ranks.

    Keys (with ``prefix``, default ``"sparse/"``): ``ids`` (ids looked up), ``unique_ids`` (after
    per-rank dedup), ``bytes_sent`` and ``bytes_received`` (all-to-all payloads and headers that
    crossed to other ranks), summed over ranks; ``exchange_s`` and ``update_s`` (seconds in the
    all-to-all stages and in the optimizer update), the maximum over ranks (the slowest rank sets
    the pace). Each is the mean per optimizer step since the last log, and it is logged when
    Lightning logs (every ``Trainer(log_every_n_steps=...)`` optimizer steps), through
    ``self.log(..., sync_dist=True)``: between logs the monitor only adds numbers, with no
    collective and no host read. Lookups made during validation are not counted.

    With ``per_table=True`` it also logs, per table, ``<table>/ids`` and ``<table>/unique_ids``
    (summed over ranks; the table's module path, e.g. ``sparse/embeddings.tables.user/ids``).

    For every :class:`~lightning_sparse.DynamicEmbedding` it logs, summed over ranks,
    ``<table>/occupancy`` (ids holding a row when it logs) and, per optimizer step since the
    last log, ``<table>/admissions``, ``<table>/evictions``, ``<table>/expirations`` and
    ``<table>/rejections`` (ids that were due a row but found every slot pinned).

    Args:
        prog_bar: also show the values on the progress bar.
        prefix: prepended to every key.
        per_table: also log the ids and unique ids of each table.
    """

    SUMMED = ("ids", "unique_ids", "bytes_sent", "bytes_received")
    SLOWEST = ("exchange_s", "update_s")
    SLOTS = ("admissions", "evictions", "expirations", "rejections")

    def __init__(self, prog_bar: bool = False, prefix: str = "sparse/", per_table: bool = False) -> None:
        self.prog_bar = prog_bar
        self.prefix = prefix
        self.per_table = per_table
        self._table_totals: dict[str, list[int]] = {}
        self._last_step = 0
        self._steps = 0
        self._totals = ExchangeStats()

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, SparseDDPStrategy):
            raise MisconfigurationException(
                f"SparseStatsMonitor needs the sparse_ddp strategy, got {type(trainer.strategy).__name__}. "
                f'HINT: Trainer(strategy="sparse_ddp", ...).'
            )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step, self._steps = trainer.global_step, 0
        self._totals.reset()
        self._table_totals = {}
        trainer.strategy.pop_sparse_stats()
        for table in trainer.strategy.sparse_tables:
            if isinstance(table, DynamicEmbedding):
                table.slot_stats.reset()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._steps += trainer.global_step - self._last_step
        self._last_step = trainer.global_step
        if self.per_table:  # before the pop resets the tables' counts
            for table in trainer.strategy.sparse_tables:
                totals = self._table_totals.setdefault(table.name, [0, 0])
                totals[0] += table.stats.ids_looked_up
                totals[1] += table.stats.unique_ids
        self._totals.add(trainer.strategy.pop_sparse_stats())
        if trainer.global_step % trainer.log_every_n_steps:
            return
        totals, steps = self._totals, self._steps
        summed = dict(zip(self.SUMMED, (totals.ids_looked_up, totals.unique_ids, totals.bytes_sent, totals.bytes_received)))
        slowest = dict(zip(self.SLOWEST, (totals.exchange_seconds, totals.update_seconds)))
        for name, (ids, unique) in self._table_totals.items():
            summed[f"{name}/ids"], summed[f"{name}/unique_ids"] = ids, unique
        self._table_totals = {}
        levels = {}
        for table in trainer.strategy.sparse_tables:
            if isinstance(table, DynamicEmbedding):
                slots = table.slot_stats
                levels[f"{table.name}/occupancy"] = slots.occupancy
                summed.update({f"{table.name}/{key}": getattr(slots, key) for key in self.SLOTS})
                slots.reset()
        for values, reduce_fx, per_step in ((summed, "sum", True), (slowest, "max", True), (levels, "sum", False)):
            pl_module.log_dict(  # every rank logs at the same steps
                {self.prefix + key: float(value) / (steps if per_step else 1) for key, value in values.items()},
                prog_bar=self.prog_bar, on_step=True, on_epoch=False, batch_size=1, sync_dist=True, reduce_fx=reduce_fx,
            )  # fmt: skip
        self._totals.reset()
        self._steps = 0

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.pop_sparse_stats()  # count training lookups only
