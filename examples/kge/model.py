"""Knowledge-graph embeddings with entity and relation tables in lightning-sparse.

Models (all score a query ``(h, r, ?)`` against candidate tails):

* ``distmult``: ``<h * r, t>`` (Yang et al., 2015);
* ``complex``: ``Re(<h * r, conj(t)>)`` with rows split into real and imaginary halves
  (Trouillon et al., 2016);
* ``rotate``: ``-sum_i |h_i * r_i - t_i|`` with ``r`` a rotation in the complex plane, phases from
  the relation row (Sun et al., 2019).

Training (``training``):

* ``"1vsall"`` (DistMult, ComplEx): cross entropy of each query against **all** entities. No rank
  ever holds the entity table: every rank's queries are gathered (``all_gather`` with autograd),
  each rank scores them against the entity rows it owns (one lookup of its own rows: no row
  crosses ranks), and the log-sum-exp over all entities is combined from the ranks' partial ones.
* ``"negatives"`` (any model, RotatE's usual recipe): each query against its true tail and
  ``negatives`` entities drawn uniformly, shared by the batch, with self-adversarial weighting.

Evaluation is filtered ranking against all entities, sharded the same way: every rank counts,
for every rank's queries, the entities it owns that score above the true answer (known answers
removed), and the counts are summed over ranks. MRR and Hits@1/3/10 count ties as the mean rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torchmetrics import MeanMetric

import lightning_sparse as ls

MODELS = ("distmult", "complex", "rotate")


class _Gather(torch.autograd.Function):
    """``all_gather`` along dim 0 whose backward hands each rank the summed gradient of its own part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.rows = dist.get_rank(), len(x)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's loss may depend on every rank's part (gloo has no reduce_scatter)
        return grad.narrow(0, ctx.rank * ctx.rows, ctx.rows)


class _ScoreLogSumExp(torch.autograd.Function):
    """``logsumexp(queries @ rows.T, dim=1)`` with one ``[B, N]`` buffer and one ``exp``.

    Autograd's ``logsumexp`` of a product keeps the scores, takes ``exp`` in forward and again in
    backward, and allocates three ``[B, N]`` temporaries; on CPU that cost as much as the matrix
    products. Here forward turns the scores into ``exp(score - max)`` in place and backward scales
    that same buffer into the softmax gradient, so a step is the three products and one ``exp``.
    """

    @staticmethod
    def forward(ctx, queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 0:  # a rank that owns no rows adds nothing to the sum
            ctx.empty = True
            ctx.save_for_backward(queries, rows)
            return queries.new_full((queries.shape[0],), float("-inf"))
        ctx.empty = False
        numerators = queries @ rows.T
        top = numerators.amax(dim=1, keepdim=True)
        total = numerators.sub_(top).exp_().sum(dim=1)
        ctx.save_for_backward(queries, rows, numerators, total)
        return top.squeeze(1) + total.log()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx.empty:
            queries, rows = ctx.saved_tensors
            return torch.zeros_like(queries), torch.zeros_like(rows)
        queries, rows, numerators, total = ctx.saved_tensors
        weights = numerators.mul_((grad / total).unsqueeze(1))  # in place (a second backward raises: version check)
        return weights @ rows, weights.T @ queries


def gather(x: torch.Tensor, differentiable: bool = True) -> torch.Tensor:
    """Every rank's ``x`` (equal shapes), concatenated along dim 0; gradients flow back to their ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    if differentiable:
        return _Gather.apply(x)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


class KGE(LightningModule):
    """A knowledge-graph embedding model trained with strategy="sparse_ddp"."""

    def __init__(
        self,
        model: str = "distmult",
        num_entities: int = 40943,
        num_relations: int = 22,
        dim: int = 256,
        training: str = "1vsall",
        negatives: int = 256,
        adversarial_temperature: float = 1.0,
        margin: float = 6.0,
        dropout: float = 0.0,
        l2: float = 0.0,
        optimizer: str = "SparseAdagrad",
        lr: float = 0.1,
        init_std: float = 0.1,
        sharding: str = "mod",
        table_dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if table_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"Invalid table_dtype {table_dtype!r}. HINT: float32, or bfloat16 / float16 for half the memory.")
        if model not in MODELS:
            raise ValueError(f"Invalid model {model!r}. HINT: use one of {MODELS}.")
        if training not in ("1vsall", "negatives") or (model == "rotate" and training == "1vsall"):
            raise ValueError(f"Invalid training {training!r} for {model}. HINT: '1vsall' (distmult, complex) or 'negatives'.")
        if model != "distmult" and dim % 2:
            raise ValueError(f"{model} splits rows into real and imaginary halves: dim must be even, got {dim}.")
        init = ls.init.normal(init_std)
        # Half tables keep float32 optimizer state and round updates stochastically; lookups return float32.
        tables = {"dtype": getattr(torch, table_dtype), "output_dtype": torch.float32, "sharding": sharding}
        self.entities = ls.SparseEmbedding(num_entities, dim, init=init, seed=1, **tables)
        if model == "rotate":  # one phase per complex coordinate, in units of pi: uniform over the circle
            relation_dim, relation_init = dim // 2, ls.init.uniform(-1.0, 1.0)
        else:
            relation_dim, relation_init = dim, init
        self.relations = ls.SparseEmbedding(num_relations, relation_dim, init=relation_init, seed=2, **tables)
        self.metrics = torch.nn.ModuleDict({
            f"{split}_{name}": MeanMetric() for split in ("val", "test") for name in ("mrr", "hits1", "hits3", "hits10")
        })  # fmt: skip

    # ------------------------------------------------------------------ scoring
    def query(self, heads: torch.Tensor, relations: torch.Tensor) -> torch.Tensor:
        """What a candidate tail row is compared with: ``h * r`` (complex product for ComplEx and RotatE)."""
        if self.hparams.model == "distmult":
            return heads * relations
        a, b = heads.chunk(2, dim=-1)
        if self.hparams.model == "rotate":
            # Phases in units of pi: an optimizer step of lr turns a rotation by at most about lr * pi whatever
            # init_std (scaling rows of std init_std to phases of std pi multiplied that by 1 / init_std).
            phase = relations * math.pi
            c, d = torch.cos(phase), torch.sin(phase)
        else:
            c, d = relations.chunk(2, dim=-1)
        return torch.cat([a * c - b * d, a * d + b * c], dim=-1)

    def score(self, queries: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        """Scores of ``queries [B, d]`` against every row of ``tails [N, d]``: ``[B, N]``."""
        if self.hparams.model != "rotate":
            return queries @ tails.T
        # [B, N, d/2] at a time would not fit for all entities: a block of tails at a time.
        block = max(1, (1 << 24) // max(1, len(queries) * queries.shape[1]))
        return (
            self.hparams.margin - torch.cat([self._distance(queries.unsqueeze(1), part) for part in tails.split(block)], dim=1)
            if len(tails)
            else queries.new_empty(len(queries), 0)
        )

    @staticmethod
    def _distance(queries: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        """RotatE's distance: the sum over complex coordinates of ``|q - t|`` (broadcasting)."""
        q_re, q_im = queries.chunk(2, dim=-1)
        t_re, t_im = tails.chunk(2, dim=-1)
        return torch.sqrt((q_re - t_re) ** 2 + (q_im - t_im) ** 2 + 1e-9).sum(-1)

    def pair_score(self, queries: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        """Score of each query against its own tail: ``[B]``."""
        if self.hparams.model != "rotate":
            return (queries * tails).sum(-1)
        return self.hparams.margin - self._distance(queries, tails)

    def own_entity_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(global ids, rows) of the entities this rank owns; a lookup, so every rank calls it."""
        ids = self.entities.sharding.global_ids(self.entities.rank, device=self.device)
        return ids, self.entities(ids)

    # ------------------------------------------------------------------ training
    def training_step(self, batch, batch_idx):
        (triples,) = batch
        h, r, t = triples.unbind(1)
        rows = self.entities(torch.cat([h, t]))
        heads, tails = rows.chunk(2)
        p = self.hparams.dropout
        q = self.query(F.dropout(heads, p, self.training), F.dropout(self.relations(r), p, self.training))
        if self.hparams.training == "1vsall":
            loss = self._one_vs_all(q, tails)
        else:
            loss = self._negatives(q, tails)
        if self.hparams.l2:
            loss = loss + self.hparams.l2 * (heads.pow(2).mean() + tails.pow(2).mean())
        self.log("train_loss", loss, prog_bar=True, batch_size=len(triples))
        return loss

    def _one_vs_all(self, q: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        _, own = self.own_entity_rows()
        everyone = gather(q)  # [W * B, d]: every rank's queries
        partial = _ScoreLogSumExp.apply(everyone, own)  # over the entities this rank owns (scores are products)
        total = torch.logsumexp(gather(partial.unsqueeze(0)), dim=0)  # over all entities
        mine = total.narrow(0, self.entities.rank * len(q), len(q))
        return (mine - self.pair_score(q, tails)).mean()

    def _negatives(self, q: torch.Tensor, tails: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator(device=q.device).manual_seed(int(self.global_step) * 7919 + self.global_rank)
        ids = torch.randint(0, self.hparams.num_entities, (self.hparams.negatives,), generator=generator, device=q.device)
        negative = self.score(q, self.entities(ids))  # [B, negatives]
        positive = self.pair_score(q, tails)
        weights = torch.softmax(negative.detach() * self.hparams.adversarial_temperature, dim=1)
        return (-F.logsigmoid(positive) - (weights * F.logsigmoid(-negative)).sum(1)).mean()

    def configure_optimizers(self):
        return None  # tables only

    def configure_sparse_optimizers(self):
        return getattr(ls, self.hparams.optimizer)([self.entities, self.relations], lr=self.hparams.lr)

    # ------------------------------------------------------------------ filtered ranking
    def _evaluate(self, batch, split: str) -> None:
        triples, valid = batch
        h, r, t = triples.unbind(1)
        with torch.no_grad():
            rows = self.entities(torch.cat([h, t]))
            heads, tails = rows.chunk(2)
            q = self.query(heads, self.relations(r))
            target = self.pair_score(q, tails)
            ids, own = self.own_entity_rows()
            everyone = gather(torch.cat([q, target.unsqueeze(1)], dim=1), differentiable=False)
            keys = gather(h * self.hparams.num_relations + r, differentiable=False)
            scores = self.score(everyone[:, :-1], own)  # [W * B, own entities]
            self._remove_known(scores, keys)
            goal = everyone[:, -1:]
            counts = torch.stack([(scores > goal).sum(1), (scores == goal).sum(1)], dim=1).to(torch.float64)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(counts)
            mine = counts.narrow(0, self.entities.rank * len(q), len(q))
        rank = 1 + mine[:, 0] + mine[:, 1] / 2  # ties: the mean rank among them
        weight = valid.to(torch.float64)
        for name, value in (("mrr", 1 / rank), ("hits1", rank <= 1), ("hits3", rank <= 3), ("hits10", rank <= 10)):
            metric = self.metrics[f"{split}_{name}"]
            metric.update(value.to(torch.float64), weight)
            self.log(f"{split}_{name}", metric, prog_bar=name == "mrr", on_epoch=True, on_step=False)

    def _remove_known(self, scores: torch.Tensor, keys: torch.Tensor) -> None:
        """Set the scores of known answers owned here (the true one included: it is compared separately) to -inf."""
        known = self.trainer.datamodule.known
        empty = torch.empty(0, dtype=torch.int64)
        tails = [known.get(k, empty) for k in keys.tolist()]
        rows = torch.repeat_interleave(torch.arange(len(tails)), torch.tensor([len(x) for x in tails]))
        tails = torch.cat(tails) if tails else empty
        sharding = self.entities.sharding
        mine = sharding.owner(tails) == self.entities.rank
        scores[rows[mine].to(scores.device), sharding.to_local(tails[mine]).to(scores.device)] = float("-inf")

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")


class EvalSummary(Callback):
    """One line per evaluation on rank 0: filtered MRR and Hits@1/3/10."""

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._print(trainer, "val")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._print(trainer, "test")

    def _print(self, trainer: Trainer, split: str) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        figures = ", ".join(
            f"{k} {float(m[f'{split}_{k}']):.4f}" for k in ("mrr", "hits1", "hits3", "hits10") if f"{split}_{k}" in m
        )
        print(f"epoch {trainer.current_epoch} {split}: {figures}", flush=True)
