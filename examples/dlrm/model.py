"""DLRM (Naumov et al., 2019) with its 26 sparse features in one SparseEmbeddingCollection.

bottom MLP(dense features) -> one vector; collection(26 features) -> 26 vectors (the multi-hot
ones pooled: mean, or a weighted sum); pairwise dot products of the 27 vectors; top MLP(bottom
vector, dot products) -> click logit. All 26 tables travel in one exchange round per forward
and one gradient round per step.

On hashed ids (``hashed_features=F``, raw 64-bit values) the tables are one of two kinds of the
same memory per rank (``tables=``): ``"dynamic"``, a ``DynamicEmbedding`` per feature whose
capacity fits ``memory_per_rank`` (:func:`capacity_for_budget`), or ``"modulo"``, a
``SparseEmbedding`` of ``N`` rows per feature fed ``id % N``, ``N`` as many rows as the dynamic
table's bytes, metadata included, pay for (:func:`modulo_rows`). docs/dlrm-hashed.md compares them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from data import DENSE, MULTI_HOT, SPARSE, WEIGHTED, cardinalities, feature_names
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torchmetrics.classification import BinaryAUROC
from typing_extensions import override

import lightning_sparse as ls

TABLES = ("static", "dynamic", "modulo")  # Criteo-shaped row ids; hashed ids: DynamicEmbedding, or id % N
INT64, INT32 = 8, 4  # bytes
SKETCH_DEPTH = 4  # rows of a DynamicEmbedding's admission sketch
GROUP_WIDTH = 8  # entries of a group of its slot map


def _power_of_two_at_least(n: int, smallest: int = 16) -> int:
    return 1 << max(smallest.bit_length() - 1, (n - 1).bit_length())


def dynamic_bytes_per_rank(capacity: int, embedding_dim: int, ranks: int, *, admit_after: int = 1,
                           sketch_width: int | None = None, value_bytes: int = 4) -> int:  # fmt: skip
    """Bytes one rank (the fullest) holds for ``DynamicEmbedding(capacity, embedding_dim)`` over ``ranks`` ranks.

    With ``H = ceil(capacity / ranks)`` ids held at most and ``R = H + 1`` slots (the null slot too):

    * rows: ``R * embedding_dim * value_bytes``;
    * per slot, 4 int64: the key it holds, its last use, its request count, its entry in the index;
    * the index: ``G + 1`` groups of 8 int32 entries (``G = 2^ceil(log2(R / 2))``, at least 2);
    * the free-slot stack: ``H + 1`` int64, with the free count, the clock and 4 stats counters (int64);
    * with ``admit_after > 1``, the count sketch: 4 rows of ``S`` int32, ``S`` = ``sketch_width``
      (default ``4H``) rounded up to a power of two (at least 16), and its int64 request count.

    These are all the tensors a rank's table keeps between steps (tests/test_dlrm.py checks the
    sum against a materialized table); optimizer state is not counted (a row-wise optimizer adds
    one value per row, to both kinds of table).
    """
    held = -(-capacity // ranks)
    slots = held + 1
    total = slots * embedding_dim * value_bytes + 4 * slots * INT64
    total += (_power_of_two_at_least(-(-slots // 2), smallest=2) + 1) * GROUP_WIDTH * INT32
    total += (held + 1) * INT64 + 6 * INT64
    if admit_after > 1:
        total += SKETCH_DEPTH * _power_of_two_at_least(sketch_width or 4 * held) * INT32 + INT64
    return total


def capacity_for_budget(budget: int, embedding_dim: int, ranks: int, **options) -> int:
    """The largest capacity whose :func:`dynamic_bytes_per_rank` fits ``budget`` bytes (options as there)."""
    low, high = 0, ranks * (budget // (embedding_dim * options.get("value_bytes", 4)))
    while low < high:  # the bytes grow with the capacity
        middle = (low + high + 1) // 2
        if dynamic_bytes_per_rank(middle, embedding_dim, ranks, **options) <= budget:
            low = middle
        else:
            high = middle - 1
    if low < 1:
        least = dynamic_bytes_per_rank(1, embedding_dim, ranks, **options)
        raise ValueError(f"Invalid memory_per_rank: {budget} bytes hold no id of width {embedding_dim}. "
                         f"HINT: give at least {least} bytes.")  # fmt: skip
    return low


def modulo_rows(table_bytes: int, embedding_dim: int, ranks: int, value_bytes: int = 4) -> int:
    """Rows ``N`` of a table fed ``id % N`` that holds ``table_bytes`` per rank, less one row at most."""
    return ranks * (table_bytes // (embedding_dim * value_bytes))


def table_bytes(table: ls.SparseEmbedding) -> int:
    """Bytes this rank's part of a materialized table holds: its rows, and a dynamic table's slot tensors."""
    total = table.shard.numel() * table.shard.element_size()
    if isinstance(table, ls.DynamicEmbedding):
        holders = [table.slots, table.slots.map, table.slots.free, table.slots.sketch]
        tensors = [value for holder in holders if holder is not None for value in vars(holder).values()
                   if isinstance(value, torch.Tensor)]  # fmt: skip
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(LightningModule):
    """DLRM on ``(dense [B, 13], features {C1..C26: ids or JaggedIds} or {H1..HF: int64 hashes}, labels [B])``.

    Args:
        tables: ``"static"`` (Criteo-shaped row ids, ``max_rows`` capped tables), or, on hashed
            ids (``hashed_features > 0``), ``"dynamic"`` or ``"modulo"`` tables of
            ``memory_per_rank`` bytes per feature and rank (see the module docstring).
        ranks: the number of ranks the memory is split over (LightningCLI links it to the trainer's devices).
        admit_after, eviction, sketch_width: the ``DynamicEmbedding`` options (counted in its memory).
    """

    def __init__(
        self,
        embedding_dim: int = 16,
        bottom: list[int] = [64, 32],  # noqa: B006 - LightningCLI reads the default
        top: list[int] = [128, 64],  # noqa: B006
        max_rows: int = 200_000,
        sharding: str = "mod",
        sparse_lr: float = 0.01,
        dense_lr: float = 1e-3,
        tables: str = "static",
        hashed_features: int = 0,
        memory_per_rank: int = 2**20,
        ranks: int = 1,
        admit_after: int = 1,
        eviction: str = "lru",
        sketch_width: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if tables not in TABLES:
            raise ValueError(f"Invalid tables: {tables!r}. HINT: use one of {TABLES}.")
        if (tables == "static") != (hashed_features == 0):
            raise ValueError(f"tables={tables!r} with hashed_features={hashed_features}. HINT: hashed ids take "
                             f"tables='dynamic' or 'modulo', Criteo-shaped ids tables='static'.")  # fmt: skip
        self.features = feature_names(hashed_features)
        self.modulo = None  # N of the "modulo" tables
        pooling = {name: "sum" if name in WEIGHTED else "mean" for name in MULTI_HOT}
        if tables == "static":
            made = {
                name: ls.SparseEmbedding(rows, embedding_dim, seed=i, sharding=sharding)
                for i, (name, rows) in enumerate(zip(SPARSE, cardinalities(max_rows)))
            }
        else:
            pooling = {}
            options = {"admit_after": admit_after, "sketch_width": sketch_width}
            capacity = capacity_for_budget(memory_per_rank, embedding_dim, ranks, **options)
            self.planned_bytes = dynamic_bytes_per_rank(capacity, embedding_dim, ranks, **options)
            if tables == "dynamic":
                made = {name: ls.DynamicEmbedding(capacity, embedding_dim, admit_after=admit_after, eviction=eviction,
                                                  sketch_width=sketch_width, seed=i)
                        for i, name in enumerate(self.features)}  # fmt: skip
            else:
                self.modulo = modulo_rows(self.planned_bytes, embedding_dim, ranks)
                made = {name: ls.SparseEmbedding(self.modulo, embedding_dim, seed=i, sharding=sharding)
                        for i, name in enumerate(self.features)}  # fmt: skip
        self.embeddings = ls.SparseEmbeddingCollection(made, pooling=pooling)
        self.bottom = mlp([DENSE, *bottom, embedding_dim])
        vectors = len(self.features) + 1
        self.top = mlp([embedding_dim + vectors * (vectors - 1) // 2, *top, 1], last_activation=False)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", rows * vectors + cols, persistent=False)
        self.val_auroc = BinaryAUROC()

    def forward(self, dense: torch.Tensor, features: dict) -> torch.Tensor:
        x = self.bottom(dense)
        if self.modulo is not None:
            features = {name: ids % self.modulo for name, ids in features.items()}  # torch's %: in [0, N) for int64
        embedded = self.embeddings(features)
        vectors = torch.stack([x, *(embedded[name] for name in self.features)], dim=1)  # [B, 1 + features, dim]
        dots = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

    @override
    def setup(self, stage: str) -> None:
        if self.hparams.tables != "static" and self.trainer.world_size != self.hparams.ranks:
            raise ValueError(f"The tables' memory was sized for ranks={self.hparams.ranks}, the trainer has "
                             f"{self.trainer.world_size} processes. HINT: build the model with ranks="
                             f"{self.trainer.world_size} (main.py sets it from an int --trainer.devices).")  # fmt: skip

    def memory_summary(self) -> str:
        """What one table of each feature holds on this rank: planned bytes (the accounting) and measured ones."""
        if self.hparams.tables == "static":
            return ""
        table = self.embeddings.tables[self.features[0]]
        kind = f"DynamicEmbedding(capacity={table.capacity})" if self.modulo is None else f"id % {self.modulo}"
        return (f"{len(self.features)} tables of {kind}, dim {self.hparams.embedding_dim}: {self.planned_bytes} "
                f"bytes per table and rank planned, {table_bytes(table)} held on rank {self.global_rank}")  # fmt: skip

    def training_step(self, batch, batch_idx):
        dense, features, labels = batch
        loss = F.binary_cross_entropy_with_logits(self(dense, features), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        dense, features, labels = batch
        logits = self(dense, features)
        self.val_auroc(logits, labels.long())
        self.log("val_auroc", self.val_auroc, prog_bar=True)
        self.log("val_loss", F.binary_cross_entropy_with_logits(logits, labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam([*self.bottom.parameters(), *self.top.parameters()], lr=self.hparams.dense_lr)

    def configure_sparse_optimizers(self):
        return ls.SparseRowWiseAdagrad([self.embeddings], lr=self.hparams.sparse_lr)


class EpochSummary(Callback):
    """One line per epoch on rank 0: validation AUROC and loss (and, on hashed ids, the tables' memory first)."""

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        summary = getattr(pl_module, "memory_summary", str)()
        if trainer.is_global_zero and summary:
            print(summary, flush=True)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        print(f"\nepoch {trainer.current_epoch}: val_auroc {float(metrics['val_auroc']):.4f}, "
              f"val_loss {float(metrics['val_loss']):.4f}", flush=True)  # fmt: skip
