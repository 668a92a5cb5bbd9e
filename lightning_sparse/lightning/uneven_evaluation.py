"""Evaluation with uneven loaders: a rank out of batches serves the others' lookups.

Every lookup is a collective, so a rank whose validation, test or predict loader has fewer batches
(or none) must keep taking part in the others' lookup rounds: after its last batch
(:func:`serve_after_last_batch`, called by the strategy's ``*_step`` overrides), or after Lightning
skipped its empty loop (:func:`serve_when_skipped`, called by its ``setup``), it calls
:func:`~lightning_sparse.lookup.engine.serve_lookups` until every rank is done. ``strategy`` is a
:class:`~lightning_sparse.lightning.strategy.SparseDDPStrategy`: these read its ``sparse_tables``,
``lookup_units`` and ``global_rank``.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Trainer

from lightning_sparse.lightning import compat
from lightning_sparse.lookup.engine import serve_lookups

log = logging.getLogger("lightning_sparse.lightning.strategy")


def serve_after_last_batch(loop: Any, strategy: Any) -> None:
    """After the step of this rank's last batch of ``loop``, serve the other ranks' lookups until all are done."""
    if strategy.sparse_tables and loop.batch_progress.is_last_batch:
        serve_lookups(strategy.lookup_units)


def serve_when_skipped(trainer: Trainer, strategy: Any) -> None:
    """Make each evaluation and prediction loop of ``trainer`` serve lookups after a run this rank skipped (no batches).

    Such a rank never reaches a ``*_step``: Lightning skips the loop. It serves the other ranks'
    lookups instead, right after the skipped run. Idempotent (``setup`` runs at every fit, validate, ...).
    """
    loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop)
    for loop in loops:
        compat.after_skipped_run(loop, lambda loop=loop: _serve_for_skipped(loop, strategy))


def _serve_for_skipped(loop: Any, strategy: Any) -> None:
    if strategy.sparse_tables:
        log.debug("%s: no batches on rank %d; serving the other ranks' lookups", type(loop).__name__, strategy.global_rank)
        serve_lookups(strategy.lookup_units)
