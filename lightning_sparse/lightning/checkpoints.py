"""Checkpoints: what Lightning hands a strategy, as a sharded checkpoint (the Trainer's and Fabric's), and the Trainer's loads.

The Trainer's ``SparseDDPStrategy`` and Fabric's ``FabricSparseDDPStrategy`` both write what
Lightning would put in one file (``{"state_dict": ..., "optimizer_states": [...], ...}``) through
:func:`write`, and read optimizers back through :func:`read_optimizer`. So a checkpoint written
by one loads in the other, on any number of ranks:

- ``state_dict``: the module's dense tensors (DCP) and every table's rows (bands, ``rows/``);
- ``optimizer_<i>``: the ``i``-th optimizer, dense ones first, then sparse ones (the Trainer's
  order: ``configure_optimizers``, then ``configure_sparse_optimizers``); ``meta.pt`` lists the
  sparse indices under ``sparse_optimizers``;
- everything else (Lightning's loops, callbacks, schedulers; Fabric's other entries) in ``meta.pt``.

The Trainer's strategy loads them back in place, on any number of ranks, with
:func:`trainer_optimizer_state` and the helper object :class:`TrainerCheckpoints`, which the strategy
holds (as Lightning's strategies hold a ``checkpoint_io``) and which remembers what the last load restored.
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
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_sparse import checkpoint
from lightning_sparse.checkpoint.contents import MODULE, optimizer_key
from lightning_sparse.lightning import compat
from lightning_sparse.optim.base import SparseOptimizer

log = logging.getLogger("lightning_sparse.lightning.strategy")

# meta.pt entries this format uses itself (a Fabric state may not use these names).
RESERVED = ("state_dict", "optimizer_states", "state_dict_rest", "optimizer_states_rest", "sparse_tables",
            "sparse_optimizers", "fabric", "format", "row_tensors")  # fmt: skip


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """What the checkpoint holds of an optimizer: a sparse one without its per-row tensors (``write`` streams them)."""
    if isinstance(optimizer, SparseOptimizer):
        return checkpoint.dense_optimizer_state(optimizer)
    return get_optimizer_state_dict(module, optimizer)  # keyed by parameter name: loads into any wrapper of the module


def write(path: Path, module: nn.Module, optimizers: list[Optimizer], contents: dict[str, Any]) -> None:
    """Write ``contents`` (Lightning's checkpoint dict; its ``optimizer_states`` follow ``optimizers``) sharded. Collective."""
    contents = dict(contents)
    dense, rest = checkpoint.split_tensors({MODULE: contents.pop("state_dict", {})})
    dense = dense or {}
    optimizer_states = contents.pop("optimizer_states", None)
    meta = {**contents, "state_dict_rest": (rest or {}).get("state_dict", {})}
    sparse: dict[int, SparseOptimizer] = {}
    if optimizer_states is not None:
        meta["optimizer_states_rest"] = []
        for index, state in enumerate(optimizer_states):
            state_tensors, state_rest = checkpoint.split_tensors(state)
            dense[optimizer_key(index)] = state_tensors or {}
            meta["optimizer_states_rest"].append(state_rest or {})
        sparse = {i: opt for i, opt in enumerate(optimizers) if isinstance(opt, SparseOptimizer)}
        meta["sparse_optimizers"] = sorted(sparse)
    tables = [table for _, table in checkpoint.tables(module)]
    meta["sparse_tables"] = {t.name: [t.num_embeddings, t.embedding_dim] for t in tables}
    log.debug("saving %s (%d tables, %d sparse optimizers)", path, len(tables), len(sparse))
    checkpoint.save(path, module, sparse, dense, meta)


def sparse_indices(meta: dict[str, Any]) -> list[int]:
    """Which saved optimizers are sparse (by their ``duplicate_grads`` hyperparameter where not recorded)."""
    if "sparse_optimizers" in meta:
        return list(meta["sparse_optimizers"])
    rests = meta.get("optimizer_states_rest", [])
    return [i for i, rest in enumerate(rests) if "duplicate_grads" in (rest.get("param_groups") or [{}])[0]]


def read_optimizer(path: Path, index: int, module: nn.Module, optimizer: Optimizer, meta: dict[str, Any]) -> None:
    """Load the saved ``optimizer_<index>`` into ``optimizer`` (each rank only its rows of a sparse one). Collective.

    ``meta``: the checkpoint's ``meta.pt`` as :func:`~lightning_sparse.checkpoint.load_meta` read it.
    """
    rest = meta["optimizer_states_rest"][index]
    if isinstance(optimizer, SparseOptimizer):
        checkpoint.load_sparse_optimizer(path, index, optimizer, rest["param_groups"], meta)
        return
    state = get_optimizer_state_dict(module, optimizer)
    checkpoint.load_tensors(path, {optimizer_key(index): {"state": state["state"]}}, f"the state of {type(optimizer).__name__}")
    state["param_groups"] = rest["param_groups"]
    set_optimizer_state_dict(module, optimizer, state)


def trainer_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """What the Trainer's checkpoint holds of ``optimizer`` (Lightning's stand-in for none: nothing)."""
    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if isinstance(inner, compat.MockOptimizer):
        return {}
    return optimizer_state(module, inner)


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
                    read_optimizer(path, index, module, optimizer, meta)
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


# ---------------------------------------------------------------- Fabric's state, as the Trainer's checkpoint numbers it
def fabric_module(state: dict[str, Any], verb: str) -> tuple[str, nn.Module]:
    """(key, module) of the one module of a Fabric ``state`` (unwrapped from DDP), for ``fabric.<verb>``."""
    modules = [(name, unwrapped(obj)) for name, obj in state.items() if isinstance(obj, nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"fabric.{verb} with strategy='sparse_ddp' takes exactly one module in its state, got {len(modules)} "
            f"({', '.join(name for name, _ in modules) or 'none'}). HINT: hold the models in one nn.Module "
            f"(e.g. an nn.ModuleDict) and set that up."
        )
    return modules[0]


def unwrapped(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def fabric_optimizers(state: dict[str, Any]) -> dict[str, Optimizer]:
    """The optimizers of ``state`` by key, dense ones first, then sparse ones: the Trainer's numbering."""
    optimizers = [(name, obj) for name, obj in state.items() if isinstance(obj, Optimizer)]
    return dict(sorted(optimizers, key=lambda item: isinstance(item[1], SparseOptimizer)))


def saved_indices(meta: dict[str, Any], optimizers: dict[str, Optimizer], path: Path) -> list[int]:
    """The saved index of each optimizer of ``optimizers`` (in its order)."""
    if not optimizers:
        return []
    saved = (meta.get("fabric") or {}).get("optimizers")
    if saved is not None and set(optimizers) <= set(saved):
        return [saved.index(name) for name in optimizers]
    count = len(meta.get("optimizer_states_rest") or [])
    sparse = sparse_indices(meta)
    dense = [i for i in range(count) if i not in sparse]
    want_sparse = [name for name, opt in optimizers.items() if isinstance(opt, SparseOptimizer)]
    want_dense = [name for name in optimizers if name not in want_sparse]
    if len(want_dense) != len(dense) or len(want_sparse) != len(sparse):
        raise ValueError(
            f"Checkpoint {path} holds {len(dense)} dense and {len(sparse)} sparse optimizers; the state to restore has "
            f"{len(want_dense)} dense ({', '.join(want_dense) or 'none'}) and {len(want_sparse)} sparse "
            f"({', '.join(want_sparse) or 'none'}). HINT: pass the same optimizers as when it was saved."
        )
    return [*dense, *sparse]
