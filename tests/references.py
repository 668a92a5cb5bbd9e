"""Single-process references built from plain torch: nn.Embedding(sparse=True) and torch's optimizers.

Row-wise Adagrad and per-row Adam have no torch optimizer, so they are written out here on the
coalesced sparse gradient, straight from their textbook formulas. torch refuses weight decay with
sparse gradients: it is added to torch's optimizers here, on the touched rows only (L2 on the
gradient, or AdamW's decoupled scaling). Every hyperparameter the optimizers take reaches one of
these (:func:`make_reference`), none through lightning_sparse's code.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RowWiseAdagradReference:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, the mean of the squared gradient row."""

    def __init__(
        self,
        weight: nn.Parameter,
        lr: float,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
    ) -> None:
        self.weight, self.lr, self.eps, self.wd = weight, lr, eps, weight_decay
        self.acc = torch.full((weight.shape[0],), initial_accumulator_value, dtype=weight.dtype)

    @torch.no_grad()
    def step(self) -> None:
        grad = self.weight.grad.coalesce()
        rows, g = grad.indices()[0], grad.values()
        g = g + self.wd * self.weight[rows]
        self.acc[rows] += (g * g).mean(dim=1)
        self.weight[rows] -= self.lr * g / (self.acc[rows].sqrt() + self.eps).unsqueeze(1)

    def zero_grad(self) -> None:
        self.weight.grad = None


class RowAdamReference:
    """DGL-style lazy Adam: per-row step counts and bias correction."""

    def __init__(
        self,
        weight: nn.Parameter,
        lr: float,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ) -> None:
        self.weight, self.lr, self.eps, self.wd, self.decoupled = weight, lr, eps, weight_decay, decoupled
        self.b1, self.b2 = betas
        self.m = torch.zeros_like(weight)
        self.v = torch.zeros_like(weight)
        self.t = torch.zeros(weight.shape[0], dtype=torch.int64)

    @torch.no_grad()
    def step(self) -> None:
        grad = self.weight.grad.coalesce()
        rows, g = grad.indices()[0], grad.values()
        w = self.weight[rows]
        if self.decoupled:
            w = w * (1 - self.lr * self.wd)
        else:
            g = g + self.wd * w
        self.t[rows] += 1
        t = self.t[rows].unsqueeze(1).to(self.weight.dtype)  # bias corrections in the table dtype, as SparseAdam
        self.m[rows] = self.b1 * self.m[rows] + (1 - self.b1) * g
        self.v[rows] = self.b2 * self.v[rows] + (1 - self.b2) * g * g
        m_hat = self.m[rows] / (1 - self.b1**t)
        v_hat = self.v[rows] / (1 - self.b2**t)
        self.weight[rows] = w - self.lr * m_hat / (v_hat.sqrt() + self.eps)

    def zero_grad(self) -> None:
        self.weight.grad = None


class TouchedRowWeightDecay:
    """A torch optimizer whose weight decay reaches only the rows in the sparse gradient.

    torch refuses weight decay with sparse gradients; this adds ``weight_decay * row`` to the
    coalesced gradient of each touched row and lets torch's optimizer do the rest. With
    ``decoupled=True`` (AdamW) it scales each touched row by ``1 - lr * weight_decay`` instead,
    before torch's step (whose update does not read the row).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, weight: nn.Parameter, weight_decay: float, decoupled: bool = False
    ) -> None:
        self.optimizer, self.weight, self.wd, self.decoupled = optimizer, weight, weight_decay, decoupled

    @torch.no_grad()
    def step(self) -> None:
        grad = self.weight.grad.coalesce()
        rows = grad.indices()
        if self.decoupled:
            self.weight[rows[0]] *= 1 - self.optimizer.param_groups[0]["lr"] * self.wd
            self.weight.grad = grad
        else:
            values = grad.values() + self.wd * self.weight[rows[0]]
            self.weight.grad = torch.sparse_coo_tensor(rows, values, grad.shape)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def make_reference(name: str, weight: nn.Parameter, kwargs: dict):
    """The single-process optimizer that ``lightning_sparse`` optimizer ``name`` must match."""
    kwargs = dict(kwargs)
    if name in ("SparseSGD", "SparseAdagrad"):
        wd = kwargs.pop("weight_decay", 0.0)
        torch_cls = torch.optim.SGD if name == "SparseSGD" else torch.optim.Adagrad
        return TouchedRowWeightDecay(torch_cls([weight], **kwargs), weight, wd)
    if name == "SparseRowWiseAdagrad":
        return RowWiseAdagradReference(weight, **kwargs)
    if name == "SparseAdam" and kwargs.pop("bias_correction", "row") == "global":  # one step count per table: torch's
        wd, decoupled = kwargs.pop("weight_decay", 0.0), kwargs.pop("decoupled_weight_decay", False)
        return TouchedRowWeightDecay(torch.optim.SparseAdam([weight], **kwargs), weight, wd, decoupled)
    if name == "SparseAdam":
        decoupled = kwargs.pop("decoupled_weight_decay", False)
        return RowAdamReference(weight, decoupled=decoupled, **kwargs)
    raise ValueError(name)


def reference_train(name: str, kwargs: dict, initial: Tensor, batches: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Train ``nn.Embedding(sparse=True)`` on whole global batches with the mean loss of :func:`batch_loss`."""
    emb = nn.Embedding(*initial.shape, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(initial)
    opt = make_reference(name, emb.weight, kwargs)
    for ids, target in batches:
        loss = batch_loss(emb(ids), target).sum() / len(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return emb.weight.detach().clone()


def batch_loss(rows: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss: a non-linear function of the looked-up rows (so duplicates matter)."""
    return ((rows.sum(dim=-2) * target).sum(dim=-1) - 1.0).pow(2)
