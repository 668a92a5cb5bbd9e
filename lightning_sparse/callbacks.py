"""SparseStatsMonitor: the sparse path's traffic and time per optimizer step, in any logger."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_sparse.strategy import SparseDDPStrategy


class SparseStatsMonitor(Callback):
    """Logs, per optimizer step and aggregated across ranks, what the sparse path did.

    Keys (with ``prefix``, default ``"sparse/"``): ``ids`` (ids looked up), ``unique_ids``
    (after per-rank dedup), ``bytes_sent`` and ``bytes_received`` (all-to-all payloads and
    headers), summed over ranks; ``exchange_s`` and ``update_s`` (seconds in the all-to-all
    stages and in the optimizer update), the maximum over ranks (the slowest rank sets the pace).
    Lookups made during validation are not counted.

    Args:
        prog_bar: also show the values on the progress bar.
        prefix: prepended to every key.
    """

    KEYS = ("ids", "unique_ids", "bytes_sent", "bytes_received", "exchange_s", "update_s")

    def __init__(self, prog_bar: bool = False, prefix: str = "sparse/") -> None:
        self.prog_bar = prog_bar
        self.prefix = prefix
        self._last_step = -1

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, SparseDDPStrategy):
            raise MisconfigurationException(
                f"SparseStatsMonitor needs the sparse_ddp strategy, got {type(trainer.strategy).__name__}. "
                f'HINT: Trainer(strategy="sparse_ddp", ...).'
            )

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating: the step has not happened yet
            return
        self._last_step = trainer.global_step
        stats = trainer.strategy.pop_sparse_stats()
        local = torch.tensor(
            [stats.ids_looked_up, stats.unique_ids, stats.bytes_sent, stats.bytes_received,
             stats.exchange_seconds, stats.update_seconds],
            dtype=torch.float64, device=trainer.strategy.root_device,
        )  # fmt: skip
        ranks = local.view(1, -1)
        if dist.is_initialized():  # collective: every rank logs the same [W, 6] totals
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local)
            ranks = torch.stack(parts)
        values = torch.cat([ranks[:, :4].sum(dim=0), ranks[:, 4:].max(dim=0).values])
        pl_module.log_dict(
            {self.prefix + key: float(v) for key, v in zip(self.KEYS, values)},
            prog_bar=self.prog_bar,
            on_step=True,
            on_epoch=False,
            batch_size=1,
        )

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.pop_sparse_stats()  # count training lookups only
