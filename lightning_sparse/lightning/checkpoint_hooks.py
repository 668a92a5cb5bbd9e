"""The strategy's checkpoint hooks: Lightning's save and load, routed to sharded checkpoints.

A mixin of :class:`~lightning_sparse.lightning.strategy.SparseDDPStrategy` (kept apart so that each class
has one job): Lightning hands the strategy what it would write to one file; these hooks write
the dense part and every table's rows through ``lightning_sparse.checkpoint`` and load them back
in place, on any number of ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sparse import checkpoint
from lightning_sparse.lightning import checkpoint_format as lightning_format
from lightning_sparse.lightning import compat

log = logging.getLogger("lightning_sparse.lightning.strategy")


class SparseCheckpointHooks:
    """Sharded checkpoints for a Lightning strategy that holds ``_tables`` (mixed in before the strategy)."""

    _restored_sharded = False
    _restored_weights_only = False

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # tables are sharded and optimizers exist: each rank loads straight into its rows

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # Sharded: load_checkpoint already restored them. Weights only: they start afresh.
        return not (self._restored_sharded or self._restored_weights_only)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's dense state; the tables are written by ``save_checkpoint`` from the module itself."""
        return checkpoint.dense_module_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, compat.MockOptimizer):
            return {}
        return lightning_format.optimizer_state(self.lightning_module, inner)

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: compat.PATH, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint (see ``lightning_sparse/checkpoint``). Collective."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options: it writes with DCP.")
        path = Path(self.broadcast(filepath))
        lightning_format.write(path, self.lightning_module, self.optimizers, checkpoint_dict)

    @override
    def load_checkpoint(self, checkpoint_path: compat.PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint into the module and (when fitting) the optimizers; return the rest.

        Works on any number of ranks and either sharding scheme. A single file with full tables
        loads too: one Lightning wrote, or a plain state dict (``python -m lightning_sparse export``),
        which restores weights only (optimizers, schedulers and loops start afresh). Collective.
        """
        path = Path(self.broadcast(checkpoint_path))
        self._restored_sharded = checkpoint.is_sharded(path)
        self._restored_weights_only = False
        if not self._restored_sharded:
            kind, loaded = checkpoint.load_file(path, weights_only=True if weights_only is None else weights_only)
            log.debug("loading %s checkpoint %s", kind, path)
            return loaded if kind == "lightning" else self._weights_only_checkpoint(loaded)
        checkpoint.verify(path)
        meta = checkpoint.load_meta(path, weights_only=True if weights_only is None else weights_only)
        log.debug("%s: loading sharded checkpoint %s on %d ranks", type(self).__name__, path, self.world_size)
        module = self.lightning_module
        checkpoint.load_module(path, module, strict=module.strict_loading, meta=meta)
        rests = meta.get("optimizer_states_rest")
        if module.trainer.state.fn == TrainerFn.FITTING and rests is not None:
            if len(rests) != len(self.optimizers):
                raise MisconfigurationException(
                    f"Checkpoint {path} holds {len(rests)} optimizer states but the module has {len(self.optimizers)} "
                    f"optimizers (dense and sparse). HINT: resume with the same configure_optimizers and "
                    f"configure_sparse_optimizers."
                )
            for index, optimizer in enumerate(self.optimizers):
                if not isinstance(optimizer, compat.MockOptimizer):
                    lightning_format.read_optimizer(path, index, module, optimizer, meta)
        if "fabric" in meta:  # written by Fabric: weights and optimizers restored; loops and schedulers start afresh
            import lightning

            meta.setdefault("pytorch-lightning_version", lightning.__version__)
            meta.setdefault("lr_schedulers", [config.scheduler.state_dict() for config in self.lr_scheduler_configs])
        meta.pop("optimizer_states_rest", None)
        return meta

    def _weights_only_checkpoint(self, state_dict: dict[str, Tensor]) -> dict[str, Any]:
        """What Lightning restores from a plain state dict: the weights; optimizers and schedulers as they are now."""
        import lightning

        self._restored_weights_only = True
        return {
            "pytorch-lightning_version": lightning.__version__,
            "state_dict": state_dict,
            "lr_schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
        }

    @override
    def load_model_state_dict(self, checkpoint_dict: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint_dict:  # a single file; each table keeps the rows of its full tensor it owns
            super().load_model_state_dict(checkpoint_dict, strict=strict)
        elif not self._restored_sharded:
            raise RuntimeError(
                f"The checkpoint to restore has no 'state_dict' (keys: {sorted(checkpoint_dict)[:8]}). HINT: pass a "
                f"checkpoint written by Trainer(strategy='sparse_ddp') or by `python -m lightning_sparse export`."
            )

    @override
    def remove_checkpoint(self, filepath: compat.PATH) -> None:
        if self.is_global_zero:
            checkpoint.remove(filepath)
