"""SparseMixedPrecision: Lightning's ``16-mixed`` with one skip decision for dense and sparse gradients.

``GradScaler`` checks the gradients of the dense optimizer it steps; it cannot see row gradients
waiting for a sparse optimizer, and with no dense gradient at all (a model that is only tables)
it has nothing to check. This plugin, which ``SparseDDPStrategy`` puts in place of Lightning's
``MixedPrecision`` (``precision="16-mixed"``), unscales the pending sparse gradients with the
loss scale of their backward and all-reduces whether any rank found an inf or NaN in them.
That flag joins GradScaler's own record for the dense optimizer, so the scaler skips the step
and backs off exactly as for a dense overflow; with no dense gradient the scale is updated as
GradScaler would (``compat.update_scale``). The strategy then steps the sparse optimizers, or drops
their gradients if the step was skipped (:func:`step_after_dense`, :func:`step_alone`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor
from typing_extensions import override

from lightning_sparse.faults.peers import collective
from lightning_sparse.lightning import compat
from lightning_sparse.optim.base import SparseOptimizer
from lightning_sparse.optim.joint import units_with_rounds
from lightning_sparse.tables.embedding import SparseEmbedding


class SparseMixedPrecision(MixedPrecision):
    """Mixed precision whose loss-scale skip decision covers the sparse gradients of ``tables``."""

    def __init__(self, precision: str, device: str, scaler: torch.amp.GradScaler | None = None) -> None:
        super().__init__(precision, device, scaler)
        self._tables: list[SparseEmbedding] = []  # whose gradients the skip decision covers (cover)
        self.skipped = False  # whether the last automatic optimizer step was skipped on every rank
        self._inv_scale: Tensor | None = None  # 1 / the loss scale of the pending sparse gradients

    @classmethod
    def replacing(cls, plugin: MixedPrecision) -> SparseMixedPrecision:
        """This plugin with the settings (and the GradScaler) of Lightning's ``plugin``."""
        return cls(plugin.precision, plugin.device, plugin.scaler)

    def cover(self, tables: list[SparseEmbedding]) -> None:
        """Make the skip decision cover the sparse gradients of ``tables`` (the strategy's, once it placed them)."""
        self._tables = list(tables)

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        scaled = super().pre_backward(tensor, module)
        if self.scaler is not None:  # the scale this backward's gradients carry (a device tensor: no host read)
            self._inv_scale = compat.loss_scale(self.scaler).double().reciprocal().float()
        return scaled

    def unscale_sparse(self, tables: list[SparseEmbedding]) -> Tensor:
        """Divide the pending gradients of ``tables`` by their loss scale; 1.0 if any rank found inf/NaN. Collective."""
        device = tables[0].device if tables else torch.device(self.device)
        found = torch.zeros(1, device=device)
        pendings = [table.pending for table in tables] + [unit.pending for unit in units_with_rounds(tables)]
        for pending in pendings:  # the tables', and their collections' rounds on one GPU
            if self._inv_scale is not None:
                pending.scale(self._inv_scale.to(device))
            for grad in pending.grads():
                found = torch.maximum(found, (~torch.isfinite(grad)).any().float())
        with collective("all-reduce of the 16-mixed overflow flag"):
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found

    @override
    def optimizer_step(self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        self.skipped = False
        if self.scaler is None or not self._tables or not model.automatic_optimization:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None:  # backward was skipped: nothing to step
            return closure_result
        found_sparse = self.unscale_sparse(self._tables)
        has_dense = any(p.grad is not None for group in optimizer.param_groups for p in group["params"])
        if not has_dense:  # only tables: update the scale as GradScaler would
            compat.after_closure(self, model, optimizer)
            compat.update_scale(self.scaler, found_sparse)
            self.skipped = bool(found_sparse.item())
            return closure_result
        self.scaler.unscale_(optimizer)
        flags = compat.found_inf_per_device(self.scaler, optimizer)
        for found in flags.values():  # one decision for dense and sparse
            found.copy_(torch.maximum(found, found_sparse.to(found.device).reshape(found.shape)))
        compat.after_closure(self, model, optimizer)
        self.skipped = bool(sum(v.item() for v in flags.values()))
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output


def step_after_dense(plugin: Any, optimizers: list[SparseOptimizer]) -> None:
    """The automatic step's sparse part: step ``optimizers``, or drop their gradients where the dense step was skipped."""
    skipped = isinstance(plugin, SparseMixedPrecision) and plugin.skipped
    for sparse in optimizers:
        sparse.zero_grad() if skipped else sparse.step()


def step_alone(plugin: Any, optimizer: SparseOptimizer) -> Any:
    """A sparse optimizer stepped on its own (manual optimization); under a loss scale, its pending gradients are
    unscaled and checked, and dropped if any rank found an overflow (a collective). What ``step()`` returned, or None."""
    if isinstance(plugin, SparseMixedPrecision) and plugin.scaler is not None:
        if plugin.unscale_sparse(optimizer.tables).item():
            optimizer.zero_grad()  # every rank agreed: skip, as GradScaler skips a dense step
            return None
    return optimizer.step()
