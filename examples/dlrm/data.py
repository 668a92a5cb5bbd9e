"""Criteo-shaped click data for the DLRM example: synthetic with a planted signal, or real Criteo TSV files.

A sample has a click label, 13 dense counts (``I1..I13``) and 26 categorical features
(``C1..C26``). The synthetic data keeps Criteo's shape:

* cardinalities are the Criteo Kaggle ones, capped at ``max_rows`` so that the tables fit a laptop;
* ids are Zipf-distributed (a few values are very frequent, most are rare), spread over the id
  space by a fixed permutation per feature;
* three features are multi-hot, like a user's recent items: ``C3`` and ``C12`` are bags of 1-5
  ids, ``C24`` a bag of 1-3 ids with per-id weights (a recency weight);
* the click probability is ``sigmoid(bias + effects of the ids of 8 features + a low-rank
  interaction of C1 and C2 + a dense term)``, so an embedding model must learn per-id vectors
  (and their interaction) to rank clicks: validation AUROC rises from 0.5.

``tsv=...`` reads Criteo's own layout instead (``label<TAB>I1..I13<TAB>C1..C26``, hex strings
for the categorical values, empty fields allowed): ids are the hex values modulo the capped
cardinality, every categorical feature a bag of one id. The same tensors come out either way.

``hashed_features=F`` makes a third kind of data, for tables addressed by raw 64-bit hashes
(:func:`hashed`): ``F`` single-hot features ``H1..HF`` whose values are Zipf-ranked ids out of
``id_space`` (10^8) per feature, each put through a fixed 64-bit mix so that they look like hash
values spread over the whole int64 range, and a click model in which every id has an effect of
its own, read off a hash of the id (see ``docs/dlrm-hashed.md``).
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

import lightning_sparse as ls

# Criteo Kaggle (Display Advertising Challenge) cardinalities of C1..C26.
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10, 5652,
    2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
DENSE = 13
SPARSE = tuple(f"C{i + 1}" for i in range(26))
MULTI_HOT = {"C3": 5, "C12": 5, "C24": 3}  # feature: largest bag
WEIGHTED = ("C24",)
SIGNAL = ("C1", "C2", "C3", "C5", "C7", "C12", "C14", "C24")


# The hashed-id mode (``hashed``): ids per feature, popularity exponent, and the planted model's scales.
ID_SPACE = 10**8
HASHED_EXPONENT = 1.1
HASHED_EFFECT = 0.6  # standard deviation of one feature's per-id effect on the click logit
HASHED_BIAS = -0.5
_FEATURE_SALT = 0x5851F42D4C957F2D  # odd 64-bit constants: they separate the features' id streams and effects
_EFFECT_SALT = 0x14057B7EF767814F


def cardinalities(max_rows: int) -> list[int]:
    return [min(c, max_rows) for c in CRITEO_CARDINALITIES]


def feature_names(hashed_features: int = 0) -> tuple[str, ...]:
    """The sparse features of a dataset: ``C1..C26`` (Criteo-shaped), or ``H1..HF`` in the hashed-id mode."""
    return tuple(f"H{i + 1}" for i in range(hashed_features)) if hashed_features else SPARSE


class ClickData(Dataset):
    """Column tensors of a click log; items are indices, batches are built by :meth:`collate`."""

    def __init__(
        self, labels: torch.Tensor, dense: torch.Tensor, single: dict, bags: dict, logits: torch.Tensor | None = None
    ) -> None:
        self.labels, self.dense, self.single, self.bags = labels, dense, single, bags
        self.logits = logits  # the planted click logits of synthetic data: the best any model can do

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> int:
        return index

    def collate(self, indices: list[int]) -> tuple[torch.Tensor, dict, torch.Tensor]:
        index = torch.tensor(indices)
        features = {name: ids.index_select(0, index) for name, ids in self.single.items()}
        for name, (values, offsets, weights) in self.bags.items():
            starts, lengths = offsets[index], offsets[index + 1] - offsets[index]
            total = int(lengths.sum())
            # positions of every id of the chosen bags: start of its bag + its place in the bag
            first = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
            position = first + torch.arange(total)
            features[name] = ls.JaggedIds(values[position], lengths=lengths,
                                          weights=weights[position] if weights is not None else None)  # fmt: skip
        return self.dense.index_select(0, index), features, self.labels.index_select(0, index)


def zipf_ids(num: int, count: int, exponent: float, order: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids in [0, num): Zipf-distributed popularity ranks mapped through ``order``."""
    cdf = torch.cumsum(torch.arange(1, num + 1, dtype=torch.float64).pow(-exponent), 0)
    ranks = torch.searchsorted(cdf, torch.rand(count, generator=generator, dtype=torch.float64) * cdf[-1])
    return order[ranks.clamp(max=num - 1)]


def synthetic(samples: int, max_rows: int, seed: int, split_seed: int) -> ClickData:
    """``samples`` clicks; the hidden effects depend on ``seed`` only, the draws on ``split_seed`` too."""
    rows = cardinalities(max_rows)
    hidden = torch.Generator().manual_seed(seed)  # the world: id orders and effects, shared by all splits
    orders = [torch.randperm(n, generator=hidden) for n in rows]
    effects = {name: torch.randn(rows[SPARSE.index(name)], generator=hidden) for name in SIGNAL}
    factors = [torch.randn(rows[i], 2, generator=hidden) for i in (0, 1)]  # C1 x C2 interaction
    dense_weight = torch.randn(DENSE, generator=hidden) * 0.3
    draw = torch.Generator().manual_seed(seed * 1000 + split_seed)
    dense = torch.log1p(torch.exp(torch.randn(samples, DENSE, generator=draw) * 1.5 + 1.0).floor())
    single, bags = {}, {}
    logit = torch.full((samples,), -0.5) + (dense - dense.mean(0)) @ dense_weight
    for i, name in enumerate(SPARSE):
        if name in MULTI_HOT:
            lengths = torch.randint(1, MULTI_HOT[name] + 1, (samples,), generator=draw)
            values = zipf_ids(rows[i], int(lengths.sum()), 1.1, orders[i], draw)
            weights = torch.rand(len(values), generator=draw) + 0.5 if name in WEIGHTED else None
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
            bags[name] = (values, offsets, weights)
            if name in effects:  # the bag's mean effect
                bag = torch.repeat_interleave(torch.arange(samples), lengths)
                logit += torch.zeros(samples).index_add_(0, bag, effects[name][values]) / lengths
        else:
            single[name] = zipf_ids(rows[i], samples, 1.1, orders[i], draw)
            if name in effects:
                logit += effects[name][single[name]] * 0.8
    logit += (factors[0][single["C1"]] * factors[1][single["C2"]]).sum(1)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=draw)
    return ClickData(labels, dense, single, bags, logit)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer on int64 tensors: a bijection, every input bit spread over the output.

    (int64 products wrap modulo 2^64; ``>>`` on int64 copies the sign bit, so each shift is masked.)
    """
    for shift, multiplier in ((33, 0xFF51AFD7ED558CCD), (33, 0xC4CEB9FE1A85EC53)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * _signed(multiplier)
    return x ^ ((x >> 33) & ((1 << 31) - 1))


def zipf_ranks(count: int, id_space: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` popularity ranks in ``[0, id_space)``, rank ``r`` drawn with probability ~ ``(r + 1) ** -exponent``.

    The inverse CDF of a continuous power law on ``[1, id_space + 1)``, floored: O(count), the
    ``id_space`` probabilities are never built (``zipf_ids`` builds them, fine for 10^5 rows).
    """
    span = (id_space + 1) ** (1 - exponent) - 1
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return (1 + u * span).pow(1 / (1 - exponent)).floor().to(torch.int64).clamp(1, id_space) - 1


def hashed_ids(ranks: torch.Tensor, feature: int) -> torch.Tensor:
    """The raw 64-bit value of popularity rank ``ranks`` of feature ``feature`` (distinct ranks, distinct values)."""
    return mix64(ranks + _signed((feature + 1) * _FEATURE_SALT & ((1 << 64) - 1)))


def planted_effect(ids: torch.Tensor, feature: int) -> torch.Tensor:
    """Each id's own effect on the click logit: a standard normal read off a hash of the id (deterministic)."""
    bits = (mix64(ids ^ _signed((feature + 1) * _EFFECT_SALT & ((1 << 64) - 1))) >> 11) & ((1 << 53) - 1)
    uniform = (bits.to(torch.float64) + 0.5) / 2**53  # in (0, 1)
    return (math.sqrt(2) * torch.erfinv(2 * uniform - 1)).to(torch.float32)


def hashed(samples: int, features: int, seed: int, split_seed: int, id_space: int = ID_SPACE,
           exponent: float = HASHED_EXPONENT) -> ClickData:  # fmt: skip
    """``samples`` clicks with ``features`` single-hot features of raw 64-bit hashed values (``H1..HF``).

    Feature ``f``'s values are Zipf(``exponent``) popularity ranks out of ``id_space`` mapped by
    :func:`hashed_ids`; the click probability is ``sigmoid(bias + dense term + HASHED_EFFECT *
    sum_f planted_effect(id_f, f))``. The ids and effects are the same in every split and for
    every ``seed`` (they are functions of the rank and the id); ``seed`` and ``split_seed`` choose
    the draws and the dense term.
    """
    hidden = torch.Generator().manual_seed(seed)
    dense_weight = torch.randn(DENSE, generator=hidden) * 0.3
    draw = torch.Generator().manual_seed(seed * 1000 + split_seed)
    dense = torch.log1p(torch.exp(torch.randn(samples, DENSE, generator=draw) * 1.5 + 1.0).floor())
    logit = torch.full((samples,), HASHED_BIAS) + (dense - dense.mean(0)) @ dense_weight
    single = {}
    for f, name in enumerate(feature_names(features)):
        single[name] = hashed_ids(zipf_ranks(samples, id_space, exponent, draw), f)
        logit += HASHED_EFFECT * planted_effect(single[name], f)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=draw)
    return ClickData(labels, dense, single, {}, logit)


def read_tsv(path: str | Path, max_rows: int, limit: int | None = None) -> ClickData:
    """Criteo's TSV layout: ``label, I1..I13, C1..C26`` per line; hex categorical values, empty fields allowed."""
    rows = cardinalities(max_rows)
    labels, dense, cats = [], [], []
    with open(path) as f:
        for number, line in enumerate(f):
            if limit is not None and number >= limit:
                break
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + DENSE + len(SPARSE):
                raise ValueError(f"{path}:{number + 1}: {len(fields)} fields, expected {1 + DENSE + len(SPARSE)} "
                                 f"(label, I1..I13, C1..C26 separated by tabs). HINT: pass a Criteo day or train.txt file.")  # fmt: skip
            labels.append(float(fields[0]))
            dense.append([math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1 : 1 + DENSE]])
            cats.append([int(v, 16) % n if v else 0 for v, n in zip(fields[1 + DENSE :], rows)])
    ids = torch.tensor(cats, dtype=torch.int64).view(-1, len(SPARSE))
    single, bags = {}, {}
    offsets = torch.arange(len(ids) + 1)
    for i, name in enumerate(SPARSE):
        if name in MULTI_HOT:  # Criteo is single-hot: bags of one
            bags[name] = (ids[:, i].contiguous(), offsets, torch.ones(len(ids)) if name in WEIGHTED else None)
        else:
            single[name] = ids[:, i].contiguous()
    return ClickData(torch.tensor(labels), torch.tensor(dense).view(-1, DENSE), single, bags)


class CriteoDataModule(LightningDataModule):
    """Synthetic Criteo-shaped clicks (default), Criteo TSV files (``tsv`` and, optionally, ``val_tsv``), or hashed ids.

    Args:
        max_rows: cap on every table's rows (Criteo's largest features have 10M values).
        train_samples, val_samples: sizes of the synthetic splits.
        hashed_features: if > 0, the hashed-id mode (:func:`hashed`): this many features of raw
            64-bit values instead of the 26 Criteo-shaped ones.
        id_space, zipf_exponent: the hashed-id mode's ids per feature and popularity exponent.
        tsv: a Criteo TSV file to train on instead; ``val_tsv`` to validate on (default: the
            last ``val_samples`` lines of ``tsv``).
        tsv_limit: read at most this many lines of ``tsv``.
    """

    def __init__(
        self,
        max_rows: int = 200_000,
        train_samples: int = 200_000,
        val_samples: int = 50_000,
        batch_size: int = 2048,
        seed: int = 0,
        tsv: str | None = None,
        val_tsv: str | None = None,
        tsv_limit: int | None = None,
        hashed_features: int = 0,
        id_space: int = ID_SPACE,
        zipf_exponent: float = HASHED_EXPONENT,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        if h.hashed_features and h.tsv is not None:
            raise ValueError("tsv and hashed_features are two kinds of data. HINT: pass one of them.")
        if h.hashed_features:
            make = partial(hashed, features=h.hashed_features, seed=h.seed, id_space=h.id_space,
                           exponent=h.zipf_exponent)  # fmt: skip
            self.train_data, self.val_data = make(h.train_samples, split_seed=1), make(h.val_samples, split_seed=2)
            return
        if h.tsv is None:
            self.train_data = synthetic(h.train_samples, h.max_rows, h.seed, split_seed=1)
            self.val_data = synthetic(h.val_samples, h.max_rows, h.seed, split_seed=2)
            return
        data = read_tsv(h.tsv, h.max_rows, h.tsv_limit)
        if h.val_tsv is not None:
            self.train_data, self.val_data = data, read_tsv(h.val_tsv, h.max_rows, h.tsv_limit)
        else:
            cut = max(1, len(data) - h.val_samples)
            self.train_data, self.val_data = _rows(data, slice(0, cut)), _rows(data, slice(cut, len(data)))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_data, batch_size=self.hparams.batch_size, shuffle=True,
                          collate_fn=self.train_data.collate)  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_data, batch_size=2 * self.hparams.batch_size, collate_fn=self.val_data.collate)


def _rows(data: ClickData, part: slice) -> ClickData:
    """Some rows of a TSV dataset (whose bags hold one id each)."""
    bags = {
        name: (values[part], torch.arange(len(values[part]) + 1), None if weights is None else weights[part])
        for name, (values, _, weights) in data.bags.items()
    }
    return ClickData(data.labels[part], data.dense[part], {n: ids[part] for n, ids in data.single.items()}, bags)
