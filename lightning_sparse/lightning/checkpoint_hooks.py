"""The Trainer strategy's checkpoints: Lightning's save and load, routed to sharded checkpoints.

Lightning hands the strategy what it would write to one file; the checkpoint overrides of
:class:`~lightning_sparse.lightning.strategy.SparseDDPStrategy` write the dense part and every
table's rows through ``lightning_sparse.checkpoint`` (:mod:`~lightning_sparse.lightning.checkpoint_format`)
and load them back in place, on any number of ranks, with :func:`optimizer_state` and the helper
object :class:`TrainerCheckpoints`, which the strategy holds (as Lightning's strategies hold a
``checkpoint_io``) and which remembers what the last load restored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_sparse import checkpoint
from lightning_sparse.lightning import checkpoint_format as lightning_format
from lightning_sparse.lightning import compat

log = logging.getLogger("lightning_sparse.lightning.strategy")


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """What the checkpoint holds of ``optimizer`` (Lightning's stand-in for none: nothing)."""
    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if isinstance(inner, compat.MockOptimizer):
        return {}
    return lightning_format.optimizer_state(module, inner)


class TrainerCheckpoints:
    """Loads of sharded checkpoints and single files for the Trainer's strategy, and what the last one restored."""

    def __init__(self) -> None:
        self._restored_sharded = False
        self._restored_weights_only = False

    @property
    def restores_optimizers(self) -> bool:
        """Whether Lightning restores the optimizers: not after a sharded load (done) nor a weights-only one (afresh)."""
        return not (self._restored_sharded or self._restored_weights_only)

    def load(self, path: Path, module: Any, optimizers: list[Optimizer], scheduler_configs: list[Any],
             weights_only: bool | None) -> dict[str, Any]:  # fmt: skip
        """Load a sharded checkpoint into ``module`` and (when fitting) ``optimizers``; return the rest.

        Works on any number of ranks and either sharding scheme. A single file with full tables
        loads too: one Lightning wrote, or a plain state dict (``python -m lightning_sparse export``),
        which restores weights only (optimizers, schedulers and loops start afresh). Collective.
        """
        self._restored_sharded = checkpoint.is_sharded(path)
        self._restored_weights_only = False
        weights_only = True if weights_only is None else weights_only
        if not self._restored_sharded:
            kind, loaded = checkpoint.load_file(path, weights_only=weights_only)
            log.debug("loading %s checkpoint %s", kind, path)
            return loaded if kind == "lightning" else self._weights_only_checkpoint(loaded, scheduler_configs)
        checkpoint.verify(path)
        meta = checkpoint.load_meta(path, weights_only=weights_only)
        trainer = module.trainer
        log.debug("%s: loading sharded checkpoint %s on %d ranks", type(trainer.strategy).__name__, path, trainer.world_size)
        checkpoint.load_module(path, module, strict=module.strict_loading, meta=meta)
        rests = meta.get("optimizer_states_rest")
        if trainer.state.fn == TrainerFn.FITTING and rests is not None:
            if len(rests) != len(optimizers):
                raise MisconfigurationException(
                    f"Checkpoint {path} holds {len(rests)} optimizer states but the module has {len(optimizers)} "
                    f"optimizers (dense and sparse). HINT: resume with the same configure_optimizers and "
                    f"configure_sparse_optimizers."
                )
            for index, optimizer in enumerate(optimizers):
                if not isinstance(optimizer, compat.MockOptimizer):
                    lightning_format.read_optimizer(path, index, module, optimizer, meta)
        if "fabric" in meta:  # written by Fabric: weights and optimizers restored; loops and schedulers start afresh
            import lightning

            meta.setdefault("pytorch-lightning_version", lightning.__version__)
            meta.setdefault("lr_schedulers", [config.scheduler.state_dict() for config in scheduler_configs])
        meta.pop("optimizer_states_rest", None)
        return meta

    def _weights_only_checkpoint(self, state_dict: dict[str, Tensor], scheduler_configs: list[Any]) -> dict[str, Any]:
        """What Lightning restores from a plain state dict: the weights; optimizers and schedulers as they are now."""
        import lightning

        self._restored_weights_only = True
        return {
            "pytorch-lightning_version": lightning.__version__,
            "state_dict": state_dict,
            "lr_schedulers": [config.scheduler.state_dict() for config in scheduler_configs],
        }

    def holds_weights(self, checkpoint_dict: Mapping[str, Any]) -> bool:
        """Whether Lightning loads the weights from ``checkpoint_dict`` (a single file); ``False`` after a sharded load.

        Each table keeps the rows of a full tensor it owns. A dict without weights that no sharded
        load restored raises.
        """
        if "state_dict" in checkpoint_dict:
            return True
        if not self._restored_sharded:
            raise RuntimeError(
                f"The checkpoint to restore has no 'state_dict' (keys: {sorted(checkpoint_dict)[:8]}). HINT: pass a "
                f"checkpoint written by Trainer(strategy='sparse_ddp') or by `python -m lightning_sparse export`."
            )
        return False
