"""The strategy's evaluation hooks for uneven loaders: a rank out of batches serves the others' lookups.

A mixin of :class:`~lightning_sparse.lightning.strategy.SparseDDPStrategy` (one job per class). Every
lookup is a collective, so a rank whose validation, test or predict loader has fewer batches
(or none) must keep taking part in the others' lookup rounds: after its last batch, or after
Lightning skipped its empty loop, it calls :func:`~lightning_sparse.lookup.engine.serve_lookups` until
every rank is done. The host provides ``sparse_tables`` and ``lookup_units``.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Trainer
from typing_extensions import override

from lightning_sparse.lightning import compat
from lightning_sparse.lookup.engine import serve_lookups

log = logging.getLogger("lightning_sparse.lightning.strategy")


class UnevenEvaluationHooks:
    """Serve lookups after this rank's last evaluation batch, or in place of a skipped evaluation loop."""

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        # A rank whose evaluation loader is empty never reaches a *_step: Lightning skips the loop.
        # It serves the other ranks' lookups instead, right after the skipped run.
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            _serve_when_skipped(loop, self)

    def _serve_after_last_batch(self, loop: Any) -> None:
        if self.sparse_tables and loop.batch_progress.is_last_batch:
            serve_lookups(self.lookup_units)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self._serve_after_last_batch(compat.evaluation_loop(self.lightning_module.trainer))
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._serve_after_last_batch(compat.evaluation_loop(self.lightning_module.trainer))
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        self._serve_after_last_batch(self.lightning_module.trainer.predict_loop)
        return output


def _serve_when_skipped(loop: Any, strategy: UnevenEvaluationHooks) -> None:
    """Make ``loop.run`` serve lookups when this rank had no batches (idempotent)."""
    if getattr(loop, "_serves_lookups_when_skipped", False):
        return
    run = loop.run

    def run_or_serve(*args: Any, **kwargs: Any) -> Any:
        output = run(*args, **kwargs)
        if loop.skip and strategy.sparse_tables:
            log.debug("%s: no batches on rank %d; serving the other ranks' lookups", type(loop).__name__, strategy.global_rank)
            serve_lookups(strategy.lookup_units)
        return output

    loop.run = run_or_serve
    loop._serves_lookups_when_skipped = True
